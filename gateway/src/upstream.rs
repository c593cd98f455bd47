//! Upstream adapters: where a call goes once the gateway has accepted it. One adapter per
//! kind of backend, chosen by the [`Upstream`] enum. Passthrough mode has one today: any
//! OpenAI-compatible server (SGLang, vLLM, `graft serve`, a hosted API).

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::{HeaderMap, HeaderValue, Method, Request, Response, header};
use http_body_util::Full;
use hyper::body::Incoming;
use hyper_rustls::HttpsConnector;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;

use crate::error::GatewayError;

/// The backends graft can forward to.
pub enum Upstream {
    OpenAiCompatible(OpenAiCompatible),
}

impl Upstream {
    pub fn base_url(&self) -> &str {
        match self {
            Upstream::OpenAiCompatible(u) => &u.base,
        }
    }

    /// Sends one request (`path` relative to the base URL, e.g. `/chat/completions`) and
    /// returns once the response head has arrived.
    pub async fn send(
        &self,
        method: Method,
        path: &str,
        body: Bytes,
        client_headers: &HeaderMap,
    ) -> Result<Response<Incoming>, GatewayError> {
        match self {
            Upstream::OpenAiCompatible(u) => u.send(method, path, body, client_headers).await,
        }
    }

    pub fn timeout(&self) -> Duration {
        match self {
            Upstream::OpenAiCompatible(u) => u.timeout,
        }
    }
}

/// Any server that speaks OpenAI's HTTP API. The client's own API key never reaches it:
/// graft sends its configured key instead.
pub struct OpenAiCompatible {
    base: String,
    api_key: Option<HeaderValue>,
    client: Client<HttpsConnector<HttpConnector>, Full<Bytes>>,
    timeout: Duration,
}

/// Client headers worth passing on; everything else (Authorization first) stays behind.
const FORWARDED: [header::HeaderName; 2] = [header::ACCEPT, header::USER_AGENT];

impl OpenAiCompatible {
    pub fn new(
        base: String,
        api_key: Option<String>,
        timeout: Duration,
        connect_timeout: Duration,
        ca_file: Option<&Path>,
    ) -> Result<Self, GatewayError> {
        let client = http_client(connect_timeout, ca_file)?;
        let api_key = match api_key {
            Some(k) => Some(HeaderValue::from_str(&format!("Bearer {k}")).map_err(|_| {
                GatewayError::Internal(
                    "upstream.api_key contains characters not allowed in a header".into(),
                )
            })?),
            None => None,
        };
        Ok(OpenAiCompatible {
            base,
            api_key,
            client,
            timeout,
        })
    }

    async fn send(
        &self,
        method: Method,
        path: &str,
        body: Bytes,
        client_headers: &HeaderMap,
    ) -> Result<Response<Incoming>, GatewayError> {
        let url = format!("{}{}", self.base, path);
        let mut req = Request::builder().method(method).uri(&url);
        if let Some(h) = req.headers_mut() {
            for name in FORWARDED {
                if let Some(v) = client_headers.get(&name) {
                    h.insert(name, v.clone());
                }
            }
            if !body.is_empty() {
                h.insert(
                    header::CONTENT_TYPE,
                    HeaderValue::from_static("application/json"),
                );
            }
            if let Some(k) = &self.api_key {
                let mut k = k.clone();
                k.set_sensitive(true);
                h.insert(header::AUTHORIZATION, k);
            }
        }
        let req = req.body(Full::new(body)).map_err(|e| {
            GatewayError::Internal(format!("cannot build upstream request to {url}: {e}"))
        })?;
        match tokio::time::timeout(self.timeout, self.client.request(req)).await {
            Ok(Ok(resp)) => Ok(resp),
            Ok(Err(e)) => Err(GatewayError::UpstreamUnreachable {
                upstream: self.base.clone(),
                detail: error_chain(&e),
            }),
            Err(_) => Err(GatewayError::UpstreamTimeout {
                upstream: self.base.clone(),
                secs: self.timeout.as_secs(),
            }),
        }
    }
}

/// The HTTP(S) client graft talks to backends with: HTTP/1, no Nagle, a connect timeout,
/// public roots or the CAs of `ca_file`.
pub(crate) type HttpClient = Client<HttpsConnector<HttpConnector>, Full<Bytes>>;

pub(crate) fn http_client(
    connect_timeout: Duration,
    ca_file: Option<&Path>,
) -> Result<HttpClient, GatewayError> {
    let mut http = HttpConnector::new();
    http.enforce_http(false);
    http.set_nodelay(true);
    http.set_connect_timeout(Some(connect_timeout));
    let tls_err =
        |e: String| GatewayError::Internal(format!("TLS set-up for the upstream failed: {e}"));
    let builder = hyper_rustls::HttpsConnectorBuilder::new();
    let builder = match ca_file {
        None => builder
            .with_provider_and_webpki_roots(rustls::crypto::ring::default_provider())
            .map_err(|e| tls_err(e.to_string()))?,
        Some(path) => {
            use rustls::pki_types::CertificateDer;
            use rustls::pki_types::pem::PemObject;
            let mut roots = rustls::RootCertStore::empty();
            let certs = CertificateDer::pem_file_iter(path)
                .and_then(|it| it.collect::<Result<Vec<_>, _>>())
                .map_err(|e| {
                    tls_err(format!(
                        "cannot read upstream.ca_file {}: {e}",
                        path.display()
                    ))
                })?;
            let (added, _) = roots.add_parsable_certificates(certs);
            if added == 0 {
                return Err(tls_err(format!(
                    "upstream.ca_file {} holds no usable certificate",
                    path.display()
                )));
            }
            let cfg = rustls::ClientConfig::builder_with_provider(Arc::new(
                rustls::crypto::ring::default_provider(),
            ))
            .with_safe_default_protocol_versions()
            .map_err(|e| tls_err(e.to_string()))?
            .with_root_certificates(roots)
            .with_no_client_auth();
            builder.with_tls_config(cfg)
        }
    };
    let https = builder.https_or_http().enable_http1().wrap_connector(http);
    Ok(Client::builder(TokioExecutor::new())
        .pool_idle_timeout(Duration::from_secs(90))
        .pool_max_idle_per_host(4096)
        .build(https))
}

/// An error and its sources on one line ("client error (Connect): tcp connect error: Connection refused").
pub fn error_chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut src = e.source();
    while let Some(inner) = src {
        let t = inner.to_string();
        if !s.contains(&t) {
            s.push_str(": ");
            s.push_str(&t);
        }
        src = inner.source();
    }
    s
}

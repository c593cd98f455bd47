//! The HTTP(S) client every backend is reached with, and how upstream failures read in
//! errors. The backends themselves are in `backend/`.

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;

use http_body_util::Full;

use hyper_rustls::HttpsConnector;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;

use crate::error::GatewayError;

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

/// The first 200 bytes of a body, for an error message.
pub(crate) fn snippet(b: &[u8]) -> String {
    let s = String::from_utf8_lossy(&b[..b.len().min(200)]).to_string();
    format!("'{}'{}", s.trim(), if b.len() > 200 { "…" } else { "" })
}

/// The upstream's own error message when it sent OpenAI's error shape, else a snippet.
pub(crate) fn upstream_message(b: &[u8]) -> String {
    serde_json::from_slice::<serde_json::Value>(b)
        .ok()
        .and_then(|v| {
            v.pointer("/error/message")
                .or_else(|| v.get("message"))
                .or_else(|| v.get("detail"))
                .and_then(serde_json::Value::as_str)
                .map(str::to_string)
        })
        .unwrap_or_else(|| snippet(b))
}

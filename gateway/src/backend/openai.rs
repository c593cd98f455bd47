//! Passthrough to any OpenAI-compatible server (SGLang, vLLM, `graft serve`, a hosted API):
//! the client's body is forwarded unchanged (the one exception: `upstream.token_ids` asks
//! the upstream for token ids and logprobs and strips them from what the client gets), and
//! its answer relayed unchanged, SSE event by event. The client's own API key never reaches
//! the upstream: graft sends its configured key instead. Responses and Messages calls the
//! upstream does not speak are translated (`translate.rs`).

use std::time::Duration;

use bytes::Bytes;
use http::{HeaderMap, HeaderValue, Method, Request, Response, StatusCode, header};
use http_body_util::Full;
use hyper::body::Incoming;
use serde_json::Value;
use tracing::info;

use super::translate::Translate;
use super::{Answering, Finished, Leg, Piece, Plan, PlanRecord, Whole};
use crate::config::{BackendHttp, OpenAiConfig};
use crate::dialect::{Delta, Dialect, DialectKind};
use crate::error::GatewayError;
use crate::outcome::Outcome;
use crate::policy::SamplingPolicy;
use crate::route::Route;
use crate::sse::Event;
use crate::token_ids::{self, Added, Capture, TokenIdsMode};
use crate::upstream::{HttpClient, error_chain, http_client, snippet, upstream_message};

/// Client headers worth passing on; everything else (Authorization first) stays behind.
const FORWARDED: [header::HeaderName; 2] = [header::ACCEPT, header::USER_AGENT];

/// An OpenAI-compatible upstream and what it speaks.
pub struct OpenAi {
    base: String,
    api_key: Option<HeaderValue>,
    client: HttpClient,
    timeout: Duration,
    dialects: Vec<DialectKind>,
    token_ids: TokenIdsMode,
}

impl OpenAi {
    pub fn new(cfg: &OpenAiConfig, http: &BackendHttp) -> Result<Self, GatewayError> {
        let api_key = match &cfg.api_key {
            Some(k) => Some(HeaderValue::from_str(&format!("Bearer {k}")).map_err(|_| {
                GatewayError::Internal(
                    "upstream.api_key contains characters not allowed in a header".into(),
                )
            })?),
            None => None,
        };
        Ok(OpenAi {
            base: cfg.url.clone(),
            api_key,
            client: http_client(http.connect_timeout, http.ca_file.as_deref())?,
            timeout: http.timeout,
            dialects: cfg.dialects.clone(),
            token_ids: cfg.token_ids,
        })
    }

    pub fn base_url(&self) -> &str {
        &self.base
    }

    pub(crate) fn timeout(&self) -> Duration {
        self.timeout
    }

    /// Passthrough, or translation when the client's dialect is one the upstream does not speak.
    pub(crate) fn plan(
        &self,
        route: Route,
        dialect: &'static dyn Dialect,
        request: &Value,
        bytes: Bytes,
        policy: Option<&SamplingPolicy>,
    ) -> Result<Plan, GatewayError> {
        let stream = request
            .get("stream")
            .and_then(Value::as_bool)
            .unwrap_or(false);
        let model = request
            .get("model")
            .and_then(Value::as_str)
            .map(str::to_string);
        let mut plan = Plan {
            leg: Leg::Passthrough(Passthrough::new(
                route.upstream_path(),
                bytes.clone(),
                &self.base,
            )),
            conv: None,
            record: PlanRecord {
                normalized_request: None,
                upstream_request: None,
                upstream_dialect: None,
                upstream: self.base.clone(),
                model,
                stream,
                sampling: None,
            },
        };
        // Chat and Completions bodies go as they are; other dialects are parsed into the
        // internal conversation (that validates them field by field and gives the record
        // its normalized form), then passed through or translated.
        let kind = dialect.kind();
        if dialect.upstream_speaks() {
            // Passthrough ids: ask the upstream for token ids and logprobs; a sampling policy
            // rewrites the sampling keys. The body is then no longer the client's: the record
            // keeps both.
            if self.token_ids != TokenIdsMode::Off || policy.is_some() {
                let mut body = request.clone();
                let sampled = policy.map(|p| {
                    let asked = sampling_keys(&body);
                    p.apply_openai_body(&mut body);
                    crate::policy::record_value(p, asked, sampling_keys(&body))
                });
                let added = token_ids::augment(self.token_ids, route, stream, &mut body);
                if added.is_some() || body != *request {
                    let mut p = Passthrough::new(
                        route.upstream_path(),
                        Bytes::from(body.to_string()),
                        &self.base,
                    );
                    p.added = added;
                    plan.leg = Leg::Passthrough(p);
                    graft_recorder::redact_json(&mut body);
                    plan.record.upstream_request = Some(body);
                    if route == Route::ChatCompletions {
                        plan.record.upstream_dialect = Some(DialectKind::ChatCompletions.label());
                    }
                }
                plan.record.sampling = sampled;
            }
            return Ok(plan);
        }
        let mut conv = dialect.parse(request)?;
        if self.dialects.contains(&kind) {
            plan.record.normalized_request = serde_json::to_value(&conv).ok();
            plan.conv = Some(conv);
            return Ok(plan);
        }
        let (mut chat_req, notes) = crate::dialect::chat::to_request(&conv);
        conv.notes.extend(notes);
        if let Some(p) = policy {
            let asked = sampling_keys(&chat_req);
            p.apply_openai_body(&mut chat_req);
            plan.record.sampling = Some(crate::policy::record_value(
                p,
                asked,
                sampling_keys(&chat_req),
            ));
        }
        // Passthrough ids work for translated calls too: the client never sees the Chat
        // answer, so nothing has to be stripped from what it gets.
        token_ids::augment(
            self.token_ids,
            Route::ChatCompletions,
            stream,
            &mut chat_req,
        );
        if !conv.notes.is_empty() {
            info!(notes = ?conv.notes, "request translated to Chat Completions");
        }
        plan.record.normalized_request = serde_json::to_value(&conv).ok();
        plan.leg = Leg::Translate(Translate::new(
            Bytes::from(chat_req.to_string()),
            &self.base,
        ));
        plan.record.upstream_request = Some(chat_req);
        plan.record.upstream_dialect = Some(DialectKind::ChatCompletions.label());
        plan.conv = Some(conv);
        Ok(plan)
    }

    /// Sends one request (`path` relative to the base URL, e.g. `/chat/completions`) and
    /// returns once the response head has arrived.
    pub(crate) async fn send(
        &self,
        path: &str,
        body: Bytes,
        client_headers: &HeaderMap,
    ) -> Result<Response<Incoming>, GatewayError> {
        self.request(Method::POST, path, body, client_headers).await
    }

    pub(crate) async fn models(
        &self,
        headers: &HeaderMap,
    ) -> Result<(String, Response<Incoming>), GatewayError> {
        let r = self
            .request(
                Method::GET,
                Route::Models.upstream_path(),
                Bytes::new(),
                headers,
            )
            .await?;
        Ok((self.base.clone(), r))
    }

    async fn request(
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

/// The record's token fields from what was captured; a reason not to trust them is logged.
/// The sampling keys of an OpenAI body (what a policy reads and writes), for the record.
fn sampling_keys(body: &Value) -> Value {
    const KEYS: [&str; 8] = [
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "seed",
        "max_tokens",
        "max_completion_tokens",
        "n",
    ];
    let mut out = serde_json::Map::new();
    if let Some(o) = body.as_object() {
        for k in KEYS {
            if let Some(v) = o.get(k) {
                out.insert(k.to_string(), v.clone());
            }
        }
    }
    Value::Object(out)
}

/// One passthrough call: the body as it goes, what graft added to it, what came back.
pub(crate) struct Passthrough {
    pub(crate) path: &'static str,
    pub(crate) body: Bytes,
    /// What graft added to get token ids (`upstream.token_ids`), stripped from the answer.
    added: Option<Added>,
    capture: Capture,
    events: u64,
    upstream: String,
}

impl Passthrough {
    fn new(path: &'static str, body: Bytes, upstream: &str) -> Self {
        Passthrough {
            path,
            body,
            upstream: upstream.to_string(),
            added: None,
            capture: Capture::default(),
            events: 0,
        }
    }
}

impl Answering for Passthrough {
    fn relays(&self) -> bool {
        true
    }

    fn event(
        &mut self,
        ev: &mut Event,
        parsed: Option<&mut Value>,
        o: &mut Outcome,
    ) -> Result<Piece, GatewayError> {
        self.events += 1;
        let Some(v) = parsed else {
            return Ok(Piece::Relay { answer: false });
        };
        let err = v.get("error").filter(|e| !e.is_null());
        if err.is_some() || v.get("type").and_then(Value::as_str) == Some("error") {
            o.upstream_error_text = Some(format!(
                "upstream sent an error event: {}",
                err.unwrap_or(v)
            ));
            return Ok(Piece::Relay { answer: false });
        }
        self.capture.push(v);
        if let Some(added) = self.added
            && token_ids::strip(v, added)
        {
            // The client gets the chunk without what graft asked for.
            ev.raw = Bytes::from(format!("data: {v}\n\n"));
        }
        Ok(Piece::Relay { answer: true })
    }

    fn end(&mut self, o: &mut Outcome, relayed_terminal: bool) -> Result<Vec<Delta>, GatewayError> {
        if !relayed_terminal && o.upstream_error_text.is_none() {
            return Err(GatewayError::UpstreamStream {
                upstream: self.upstream.clone(),
                detail: format!(
                    "the stream ended after {} events without its final event",
                    self.events
                ),
            });
        }
        Ok(vec![])
    }

    fn finish(&mut self, o: &mut Outcome, _ok: bool) -> Option<Finished> {
        o.tokens = std::mem::take(&mut self.capture).into_recorded(self.added.is_some());
        None
    }

    fn whole(
        &mut self,
        status: StatusCode,
        content_type: Option<HeaderValue>,
        bytes: Bytes,
        o: &mut Outcome,
    ) -> Result<Whole, GatewayError> {
        o.status = status.as_u16();
        if status.is_success() {
            let mut v: Value =
                serde_json::from_slice(&bytes).map_err(|e| GatewayError::UpstreamInvalid {
                    upstream: self.upstream.clone(),
                    detail: format!("the body is not JSON ({e}): {}", snippet(&bytes)),
                })?;
            o.finish_reason = v
                .pointer("/choices/0/finish_reason")
                .and_then(Value::as_str)
                .map(str::to_string);
            self.capture.push(&v);
            o.tokens = std::mem::take(&mut self.capture).into_recorded(self.added.is_some());
            let bytes = match self.added {
                Some(added) if token_ids::strip(&mut v, added) => Bytes::from(v.to_string()),
                _ => bytes,
            };
            o.response = Some(v);
            return Ok(Whole::Raw {
                status,
                content_type,
                bytes,
            });
        }
        if status.is_client_error() {
            // The upstream refused the request itself (context too long, bad parameter):
            // relay its answer unchanged so the client sees the upstream's own words.
            o.upstream_error_text = Some(format!(
                "upstream answered HTTP {}: {}",
                status.as_u16(),
                upstream_message(&bytes)
            ));
            o.response = serde_json::from_slice(&bytes).ok();
            return Ok(Whole::Raw {
                status,
                content_type,
                bytes,
            });
        }
        Err(GatewayError::UpstreamStatus {
            upstream: self.upstream.clone(),
            status: status.as_u16(),
            detail: upstream_message(&bytes),
        })
    }
}

//! Passthrough of one inference call: validate, forward the body unchanged, relay the answer
//! unchanged (SSE event by event as it arrives), tee it into a `CallRecord`, and hand the
//! record to the recorder at the end of the call's life.

use crate::dialect::kind;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use graft_recorder::{CallRecord, SCHEMA_VERSION, Usage};
use http::{HeaderMap, HeaderValue, Method, Response, StatusCode, header};
use http_body_util::BodyExt;
use hyper::body::Incoming;
use serde_json::Value;
use tokio::sync::mpsc;
use tracing::{Instrument, debug, error, info_span, warn};

use crate::body::{GBody, channel_body, full};
use crate::dialect::{DialectKind, anthropic, responses};
use crate::error::{Cause, GatewayError};
use crate::server::State;
use crate::sessions::{Session, now_us};
use crate::sse::{Assembler, Event, Splitter};
use crate::token_ids::{self, Added, Capture, Recorded};

/// The OpenAI routes graft proxies.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Route {
    ChatCompletions,
    Completions,
    Models,
    Responses,
    Messages,
}

impl Route {
    pub fn label(self) -> &'static str {
        match self {
            Route::ChatCompletions => "chat_completions",
            Route::Completions => "completions",
            Route::Models => "models",
            Route::Responses => "responses",
            Route::Messages => "anthropic_messages",
        }
    }

    /// The dialect a route speaks, for the routes that can be translated.
    pub fn dialect(self) -> Option<DialectKind> {
        match self {
            Route::ChatCompletions => Some(DialectKind::ChatCompletions),
            Route::Responses => Some(DialectKind::Responses),
            Route::Messages => Some(DialectKind::AnthropicMessages),
            Route::Completions | Route::Models => None,
        }
    }

    pub(crate) fn upstream_path(self) -> &'static str {
        match self {
            Route::ChatCompletions => "/chat/completions",
            Route::Completions => "/completions",
            Route::Models => "/models",
            Route::Responses => "/responses",
            Route::Messages => "/messages",
        }
    }

    pub(crate) fn endpoint(self) -> &'static str {
        match self {
            Route::ChatCompletions => "/v1/chat/completions",
            Route::Completions => "/v1/completions",
            Route::Models => "/v1/models",
            Route::Responses => "/v1/responses",
            Route::Messages => "/v1/messages",
        }
    }
}

/// Reads a request body within the size and time limits.
pub async fn read_body(
    body: Incoming,
    limit: usize,
    timeout: Duration,
) -> Result<Bytes, GatewayError> {
    let limited = http_body_util::Limited::new(body, limit);
    match tokio::time::timeout(timeout, limited.collect()).await {
        Err(_) => Err(GatewayError::BodyTimeout {
            secs: timeout.as_secs(),
        }),
        Ok(Err(e)) => {
            if e.downcast_ref::<http_body_util::LengthLimitError>()
                .is_some()
            {
                Err(GatewayError::BodyTooLarge { limit })
            } else {
                Err(GatewayError::BodyRead(crate::upstream::error_chain(
                    e.as_ref(),
                )))
            }
        }
        Ok(Ok(c)) => Ok(c.to_bytes()),
    }
}

/// Parses and checks the request body; returns it as JSON.
pub fn parse_request(route: Route, bytes: &[u8]) -> Result<Value, GatewayError> {
    if let Err(e) = std::str::from_utf8(bytes) {
        return Err(GatewayError::InvalidUtf8 {
            offset: e.valid_up_to(),
        });
    }
    let v: Value =
        serde_json::from_slice(bytes).map_err(|e| GatewayError::InvalidJson(e.to_string()))?;
    let Some(obj) = v.as_object() else {
        return Err(GatewayError::field(
            "",
            format!("the request body must be a JSON object, got {}", kind(&v)),
        ));
    };
    match obj.get("model") {
        Some(Value::String(_)) => {}
        Some(other) => {
            return Err(GatewayError::field(
                "model",
                format!("'model' must be a string, got {}", kind(other)),
            ));
        }
        None => return Err(GatewayError::field("model", "'model' is required")),
    }
    if let Some(s) = obj.get("stream")
        && !s.is_boolean()
        && !s.is_null()
    {
        return Err(GatewayError::field(
            "stream",
            format!("'stream' must be a boolean, got {}", kind(s)),
        ));
    }
    if let Some(s) = obj.get("stream_options")
        && !s.is_object()
        && !s.is_null()
    {
        return Err(GatewayError::field(
            "stream_options",
            format!("'stream_options' must be an object, got {}", kind(s)),
        ));
    }
    match route {
        Route::ChatCompletions => {
            let Some(msgs) = obj.get("messages") else {
                return Err(GatewayError::field("messages", "'messages' is required"));
            };
            let Some(msgs) = msgs.as_array() else {
                return Err(GatewayError::field(
                    "messages",
                    format!("'messages' must be an array, got {}", kind(msgs)),
                ));
            };
            for (i, m) in msgs.iter().enumerate() {
                match m.get("role") {
                    Some(Value::String(_)) => {}
                    Some(r) => {
                        return Err(GatewayError::field(
                            format!("messages[{i}].role"),
                            format!("'messages[{i}].role' must be a string, got {}", kind(r)),
                        ));
                    }
                    None => {
                        return Err(GatewayError::field(
                            format!("messages[{i}]"),
                            format!(
                                "'messages[{i}]' must be an object with a 'role', got {}",
                                kind(m)
                            ),
                        ));
                    }
                }
            }
            if let Some(t) = obj.get("tools")
                && !t.is_array()
                && !t.is_null()
            {
                return Err(GatewayError::field(
                    "tools",
                    format!("'tools' must be an array, got {}", kind(t)),
                ));
            }
        }
        Route::Completions => match obj.get("prompt") {
            Some(Value::String(_)) | Some(Value::Array(_)) => {}
            Some(p) => {
                return Err(GatewayError::field(
                    "prompt",
                    format!("'prompt' must be a string or an array, got {}", kind(p)),
                ));
            }
            None => return Err(GatewayError::field("prompt", "'prompt' is required")),
        },
        // Responses and Messages are checked field by field by their dialect's parser.
        Route::Models | Route::Responses | Route::Messages => {}
    }
    Ok(v)
}

/// What is known about a call from its arrival until its record is written.
pub(crate) struct Call {
    pub(crate) state: Arc<State>,
    pub(crate) call_id: String,
    pub(crate) session: Arc<Session>,
    pub(crate) route: Route,
    pub(crate) request: Value,
    pub(crate) model: Option<String>,
    pub(crate) stream: bool,
    pub(crate) client: Option<String>,
    pub(crate) started_at_us: i64,
    pub(crate) t0: Instant,
    /// The conversation in graft's own form (dialects other than plain passthrough chat).
    pub(crate) normalized_request: Option<Value>,
    /// What graft sent upstream when it translated the request.
    pub(crate) upstream_request: Option<Value>,
    /// The wire graft spoke upstream when it was not the client's (`chat_completions`,
    /// `sglang_generate`).
    pub(crate) upstream_dialect: Option<&'static str>,
    /// The backend the call went to, when not `upstream.url` (exact mode).
    pub(crate) backend: Option<String>,
    /// The id graft gives the answer in the client's dialect (`resp_…`, `msg_…`).
    pub(crate) response_id: String,
    /// What graft added to the forwarded request to get token ids (`upstream.token_ids`).
    pub(crate) token_ids: Option<Added>,
}

/// The outcome of a call, for its record.
#[derive(Default)]
pub(crate) struct Outcome {
    pub(crate) status: u16,
    pub(crate) error: Option<GatewayError>,
    pub(crate) upstream_error_text: Option<String>,
    pub(crate) response: Option<Value>,
    pub(crate) normalized_response: Option<Value>,
    pub(crate) finish_reason: Option<String>,
    pub(crate) ttft: Option<Duration>,
    pub(crate) upstream_time: Duration,
    /// Token ids and logprobs the upstream returned (passthrough ids, exact mode).
    pub(crate) tokens: Recorded,
    /// The backend's `weight_version` (exact mode).
    pub(crate) weight_version: Option<String>,
}

impl Call {
    pub(crate) fn build_record(&self, o: &Outcome, client_gone: bool) -> CallRecord {
        let usage = usage_of(o);
        let (outcome, error) = match (&o.error, &o.upstream_error_text) {
            _ if client_gone => (
                "client_disconnected".to_string(),
                o.error.as_ref().map(|e| e.to_string()).or(Some(
                    "the client closed the connection before the response ended".into(),
                )),
            ),
            (Some(e), _) => (e.cause().outcome().to_string(), Some(e.to_string())),
            (None, Some(t)) => (Cause::Upstream.outcome().to_string(), Some(t.clone())),
            (None, None) => ("ok".to_string(), None),
        };
        let mut request = self.request.clone();
        graft_recorder::redact_json(&mut request);
        CallRecord {
            schema_version: SCHEMA_VERSION,
            call_id: self.call_id.clone(),
            session_id: self.session.id.clone(),
            group_id: self.session.group_id.clone(),
            seq: 0,
            started_at_us: self.started_at_us,
            finished_at_us: now_us(),
            dialect: self.route.label().to_string(),
            endpoint: self.route.endpoint().to_string(),
            model: self.model.clone(),
            upstream: self
                .backend
                .clone()
                .unwrap_or_else(|| self.state.upstream.base_url().to_string()),
            stream: self.stream,
            request,
            response: o.response.clone(),
            normalized_request: self.normalized_request.clone(),
            normalized_response: o.normalized_response.clone(),
            upstream_request: self.upstream_request.clone(),
            upstream_dialect: self.upstream_dialect.map(str::to_string),
            status: o.status,
            outcome,
            error,
            prompt_token_ids: o.tokens.prompt_token_ids.clone(),
            completion_token_ids: o.tokens.completion_token_ids.clone(),
            completion_logprobs: o.tokens.completion_logprobs.clone(),
            finish_reason: o.finish_reason.clone(),
            weight_version: o.weight_version.clone(),
            usage,
            ttft_ms: o.ttft.map(|d| d.as_secs_f64() * 1e3),
            latency_ms: self.t0.elapsed().as_secs_f64() * 1e3,
            client: self.client.clone(),
        }
    }

    /// Hands the record to the recorder; under sync durability this returns once it is fsynced.
    pub(crate) async fn commit(
        &self,
        o: &Outcome,
        client_gone: bool,
    ) -> Result<Duration, GatewayError> {
        let rec = self.build_record(o, client_gone);
        let t = Instant::now();
        self.session
            .count_call(rec.outcome == Cause::Upstream.outcome());
        self.state.metrics.records_written.inc();
        let res = self.state.recorder.record(rec).await;
        let waited = t.elapsed();
        self.state.metrics.record_wait.observe(waited.as_secs_f64());
        match res {
            Ok(_) => Ok(waited),
            Err(e) => {
                error!(call_id = %self.call_id, session = %self.session.id, error = %e, "call record could not be written");
                Err(GatewayError::Record(e.to_string()))
            }
        }
    }

    /// Records a call that failed with `e` (best effort: the error goes back to the client
    /// either way) and hands the error back.
    pub(crate) async fn fail(&self, mut o: Outcome, e: GatewayError) -> GatewayError {
        o.status = e.status().as_u16();
        o.error = Some(e);
        let wait = self.commit(&o, false).await.unwrap_or_default();
        self.observe(o.upstream_time, wait, None);
        o.error
            .take()
            .unwrap_or_else(|| GatewayError::Internal("lost error".into()))
    }

    pub(crate) fn observe(
        &self,
        upstream_time: Duration,
        record_wait: Duration,
        ttft: Option<Duration>,
    ) {
        let m = &self.state.metrics;
        let route = crate::metrics::RouteLabel {
            route: self.route.label(),
        };
        m.upstream_latency
            .get_or_create(&route)
            .observe(upstream_time.as_secs_f64());
        let overhead = self
            .t0
            .elapsed()
            .saturating_sub(upstream_time)
            .saturating_sub(record_wait);
        m.overhead
            .get_or_create(&route)
            .observe(overhead.as_secs_f64());
        if let Some(t) = ttft {
            m.ttft.get_or_create(&route).observe(t.as_secs_f64());
        }
    }

    /// Records a whole answer (under sync durability this waits for the fsync), then hands
    /// `o.response` to the client as JSON.
    pub(crate) async fn answer_json(&self, o: &Outcome) -> Result<Response<GBody>, GatewayError> {
        let wait = self.commit(o, false).await?;
        self.observe(o.upstream_time, wait, None);
        let body = o
            .response
            .as_ref()
            .map(Value::to_string)
            .unwrap_or_default();
        let mut resp = Response::new(full(Bytes::from(body)));
        resp.headers_mut().insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/json"),
        );
        self.headers(&mut resp);
        Ok(resp)
    }

    /// The client's SSE response (its events come through the returned sender).
    pub(crate) fn sse_response(&self) -> (mpsc::Sender<Bytes>, Response<GBody>) {
        let (tx, body) = channel_body(64);
        let mut out = Response::new(body);
        out.headers_mut().insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("text/event-stream"),
        );
        out.headers_mut()
            .insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
        self.headers(&mut out);
        (tx, out)
    }

    pub(crate) fn headers(&self, resp: &mut Response<GBody>) {
        if let Ok(v) = HeaderValue::from_str(&self.call_id) {
            resp.headers_mut().insert("x-graft-call-id", v);
        }
        if let Ok(v) = HeaderValue::from_str(&self.session.id) {
            resp.headers_mut().insert("x-graft-session", v);
        }
    }
}

/// Token counts from the internal answer, else from the response in any dialect's shape
/// (`prompt_tokens`/`completion_tokens` or `input_tokens`/`output_tokens`).
fn usage_of(o: &Outcome) -> Option<Usage> {
    if let Some(u) = o
        .normalized_response
        .as_ref()
        .and_then(|a| a.get("usage"))
        .filter(|u| u.is_object())
    {
        let i = u.get("input_tokens").and_then(Value::as_u64);
        let out = u.get("output_tokens").and_then(Value::as_u64);
        return Some(Usage {
            prompt_tokens: i,
            completion_tokens: out,
            total_tokens: i.zip(out).map(|(a, b)| a + b),
        });
    }
    let u = o.response.as_ref()?.get("usage")?.as_object()?;
    let get = |a: &str, b: &str| u.get(a).or_else(|| u.get(b)).and_then(Value::as_u64);
    let prompt = get("prompt_tokens", "input_tokens");
    let completion = get("completion_tokens", "output_tokens");
    Some(Usage {
        prompt_tokens: prompt,
        completion_tokens: completion,
        total_tokens: u
            .get("total_tokens")
            .and_then(Value::as_u64)
            .or(prompt.zip(completion).map(|(a, b)| a + b)),
    })
}

/// Handles one call on a `/v1/...` route whose session is already resolved.
pub async fn handle(
    state: Arc<State>,
    route: Route,
    session: Arc<Session>,
    headers: HeaderMap,
    body: Incoming,
    t0: Instant,
) -> Result<Response<GBody>, GatewayError> {
    if route == Route::Models {
        return models(&state, &headers).await;
    }
    let bytes = read_body(body, state.cfg.max_body_bytes, state.cfg.body_timeout).await?;
    let request = parse_request(route, &bytes)?;
    if state.exact.is_some() {
        return crate::exact::handle(state, route, session, headers, request, t0).await;
    }
    let stream = request
        .get("stream")
        .and_then(Value::as_bool)
        .unwrap_or(false);
    let model = request
        .get("model")
        .and_then(Value::as_str)
        .map(str::to_string);
    // Dialects other than Chat are parsed into the internal conversation: that validates
    // them field by field and gives the record its normalized form.
    let conv = match route {
        Route::Responses => Some(responses::parse_request(&request)?),
        Route::Messages => Some(anthropic::parse_request(&request)?),
        _ => None,
    };
    let translate = match (route.dialect(), &conv) {
        (Some(d), Some(_)) => !state.cfg.upstream_dialects.contains(&d),
        _ => false,
    };
    let mut call = Call {
        call_id: uuid::Uuid::now_v7().to_string(),
        client: headers
            .get(header::USER_AGENT)
            .and_then(|v| v.to_str().ok())
            .map(str::to_string),
        started_at_us: now_us(),
        state: state.clone(),
        session,
        route,
        request,
        model,
        stream,
        t0,
        normalized_request: None,
        upstream_request: None,
        upstream_dialect: None,
        backend: None,
        response_id: match route {
            Route::Messages => crate::dialect::new_id("msg_"),
            _ => crate::dialect::new_id("resp_"),
        },
        token_ids: None,
    };
    let (upstream_path, bytes, translation) = match conv {
        Some(mut conv) if translate => {
            let (mut chat_req, notes) = crate::dialect::chat::to_request(&conv);
            conv.notes.extend(notes);
            // Passthrough ids work for translated calls too: the client never sees the
            // Chat answer, so nothing has to be stripped from what it gets.
            call.token_ids = token_ids::augment(
                state.cfg.token_ids,
                Route::ChatCompletions,
                stream,
                &mut chat_req,
            );
            if !conv.notes.is_empty() {
                tracing::info!(call_id = %call.call_id, notes = ?conv.notes, "request translated to Chat Completions");
            }
            call.normalized_request = serde_json::to_value(&conv).ok();
            let body = Bytes::from(chat_req.to_string());
            call.upstream_request = Some(chat_req);
            call.upstream_dialect = Some(DialectKind::ChatCompletions.label());
            (Route::ChatCompletions.upstream_path(), body, Some(conv))
        }
        Some(conv) => {
            call.normalized_request = serde_json::to_value(&conv).ok();
            (route.upstream_path(), bytes, None)
        }
        None => {
            // Passthrough ids: ask the upstream for token ids and logprobs. The body is no
            // longer the client's: the record keeps both.
            let mut body = match state.cfg.token_ids {
                token_ids::TokenIdsMode::Off => Value::Null,
                _ => call.request.clone(),
            };
            match token_ids::augment(state.cfg.token_ids, route, stream, &mut body) {
                Some(added) => {
                    let bytes = Bytes::from(body.to_string());
                    graft_recorder::redact_json(&mut body);
                    call.upstream_request = Some(body);
                    if route == Route::ChatCompletions {
                        call.upstream_dialect = Some(DialectKind::ChatCompletions.label());
                    }
                    call.token_ids = Some(added);
                    (route.upstream_path(), bytes, None)
                }
                None => (route.upstream_path(), bytes, None),
            }
        }
    };
    let span = info_span!("call", call_id = %call.call_id, session = %call.session.id, route = route.label(), stream, translated = translation.is_some());
    async move {
        let permit = state.limits.upstream_permit().await?;
        state.metrics.upstream_inflight.inc();
        let t_up = Instant::now();
        let sent = state
            .upstream
            .send(Method::POST, upstream_path, bytes, &headers)
            .await;
        let resp = match sent {
            Ok(r) => r,
            Err(e) => {
                state.metrics.upstream_inflight.dec();
                drop(permit);
                let o = Outcome {
                    upstream_time: t_up.elapsed(),
                    ..Default::default()
                };
                return Err(call.fail(o, e).await);
            }
        };
        let is_sse = resp
            .headers()
            .get(header::CONTENT_TYPE)
            .and_then(|v| v.to_str().ok())
            .is_some_and(|v| v.starts_with("text/event-stream"));
        if call.stream && resp.status().is_success() && is_sse {
            let (tx, out) = call.sse_response();
            tokio::spawn(
                async move {
                    match translation {
                        Some(conv) => {
                            crate::translate::pump(call, conv, resp.into_body(), tx, t_up).await
                        }
                        None => pump(call, resp.into_body(), tx, t_up).await,
                    }
                    state.metrics.upstream_inflight.dec();
                    drop(permit);
                }
                .in_current_span(),
            );
            return Ok(out);
        }
        let result = match translation {
            Some(conv) => crate::translate::whole(&call, &conv, resp, t_up).await,
            None => whole(&call, resp, t_up).await,
        };
        state.metrics.upstream_inflight.dec();
        drop(permit);
        result
    }
    .instrument(span)
    .await
}

/// Reads a whole upstream body within the response size limit and the upstream timeout.
pub(crate) async fn collect_upstream(
    call: &Call,
    resp: Response<Incoming>,
) -> Result<Bytes, GatewayError> {
    let upstream = call
        .backend
        .clone()
        .unwrap_or_else(|| call.state.upstream.base_url().to_string());
    let limit = call.state.cfg.max_response_bytes;
    let collected = tokio::time::timeout(
        call.state.upstream.timeout(),
        http_body_util::Limited::new(resp.into_body(), limit).collect(),
    )
    .await;
    match collected {
        Err(_) => Err(GatewayError::UpstreamTimeout {
            upstream,
            secs: call.state.upstream.timeout().as_secs(),
        }),
        Ok(Err(e)) => {
            if e.downcast_ref::<http_body_util::LengthLimitError>()
                .is_some()
            {
                Err(GatewayError::UpstreamInvalid {
                    upstream,
                    detail: format!(
                        "the response is larger than limits.max_response_bytes ({limit} bytes)"
                    ),
                })
            } else {
                Err(GatewayError::UpstreamStream {
                    upstream,
                    detail: crate::upstream::error_chain(e.as_ref()),
                })
            }
        }
        Ok(Ok(c)) => Ok(c.to_bytes()),
    }
}

/// A non-streamed answer (or an upstream error answer to a streamed request).
async fn whole(
    call: &Call,
    resp: Response<Incoming>,
    t_up: Instant,
) -> Result<Response<GBody>, GatewayError> {
    let status = resp.status();
    let content_type = resp.headers().get(header::CONTENT_TYPE).cloned();
    let upstream = call.state.upstream.base_url().to_string();
    let body = collect_upstream(call, resp).await;
    let mut o = Outcome {
        status: status.as_u16(),
        upstream_time: t_up.elapsed(),
        ..Default::default()
    };
    let result = match body {
        Err(e) => Err(e),
        Ok(bytes) if status.is_success() => match serde_json::from_slice::<Value>(&bytes) {
            Ok(mut v) => {
                o.finish_reason = v
                    .pointer("/choices/0/finish_reason")
                    .and_then(Value::as_str)
                    .map(str::to_string);
                let mut capture = Capture::default();
                capture.push(&v);
                o.tokens = finish_capture(call, capture);
                let bytes = match call.token_ids {
                    Some(added) if token_ids::strip(&mut v, added) => Bytes::from(v.to_string()),
                    _ => bytes,
                };
                o.response = Some(v);
                Ok(bytes)
            }
            Err(e) => Err(GatewayError::UpstreamInvalid {
                upstream,
                detail: format!("the body is not JSON ({e}): {}", snippet(&bytes)),
            }),
        },
        Ok(bytes) if status.is_client_error() => {
            // The upstream refused the request itself (context too long, bad parameter):
            // relay its answer unchanged so the client sees the upstream's own words.
            o.upstream_error_text = Some(format!(
                "upstream answered HTTP {}: {}",
                status.as_u16(),
                upstream_message(&bytes)
            ));
            o.response = serde_json::from_slice(&bytes).ok();
            Ok(bytes)
        }
        Ok(bytes) => Err(GatewayError::UpstreamStatus {
            upstream,
            status: status.as_u16(),
            detail: upstream_message(&bytes),
        }),
    };
    match result {
        Ok(bytes) => {
            let wait = call.commit(&o, false).await?;
            call.observe(o.upstream_time, wait, None);
            let mut resp = Response::new(full(bytes));
            *resp.status_mut() = status;
            resp.headers_mut().insert(
                header::CONTENT_TYPE,
                content_type.unwrap_or_else(|| HeaderValue::from_static("application/json")),
            );
            call.headers(&mut resp);
            Ok(resp)
        }
        Err(e) => Err(call.fail(o, e).await),
    }
}

/// The record's token fields from what was captured; a reason not to trust them is logged.
pub(crate) fn finish_capture(call: &Call, capture: Capture) -> Recorded {
    let (recorded, note) = capture.finish();
    if let Some(note) = note {
        warn!(call_id = %call.call_id, "passthrough token ids: {note}");
    } else if call.token_ids.is_some() && recorded.prompt_token_ids.is_none() {
        debug!(call_id = %call.call_id, "passthrough token ids were asked for but none came; the record is text-only");
    }
    recorded
}

/// Reads an upstream SSE body as whole events, watching the client side for disconnects.
pub(crate) struct UpstreamEvents {
    body: Incoming,
    splitter: Splitter,
    upstream: String,
    idle: Duration,
    max_event: usize,
    pending: std::collections::VecDeque<Event>,
    ended: bool,
    pub(crate) events: u64,
}

/// What the next read from the upstream brought.
pub(crate) enum Next {
    Event(Event),
    /// The upstream ended its body; leftovers were handled.
    End,
    Failed(GatewayError),
    ClientGone,
}

impl UpstreamEvents {
    pub(crate) fn new(call: &Call, body: Incoming) -> Self {
        UpstreamEvents {
            body,
            splitter: Splitter::default(),
            upstream: call
                .backend
                .clone()
                .unwrap_or_else(|| call.state.upstream.base_url().to_string()),
            idle: call.state.upstream.timeout(),
            max_event: call.state.cfg.max_response_bytes,
            pending: Default::default(),
            ended: false,
            events: 0,
        }
    }

    pub(crate) async fn next(&mut self, tx: &mpsc::Sender<Bytes>) -> Next {
        loop {
            if let Some(ev) = self.pending.pop_front() {
                self.events += 1;
                return Next::Event(ev);
            }
            if self.ended {
                return Next::End;
            }
            let frame = tokio::select! {
                f = tokio::time::timeout(self.idle, self.body.frame()) => f,
                _ = tx.closed() => return Next::ClientGone,
            };
            let chunk = match frame {
                Err(_) => {
                    return Next::Failed(GatewayError::UpstreamTimeout {
                        upstream: self.upstream.clone(),
                        secs: self.idle.as_secs(),
                    });
                }
                Ok(None) => {
                    self.ended = true;
                    if let Some(rest) = self.splitter.finish() {
                        if rest.is_done() {
                            self.pending.push_back(rest);
                        } else if rest.data.is_none() {
                            return Next::Failed(GatewayError::UpstreamInvalid {
                                upstream: self.upstream.clone(),
                                detail: format!(
                                    "the stream is not server-sent events: {}",
                                    snippet(&rest.raw)
                                ),
                            });
                        } else {
                            return Next::Failed(GatewayError::UpstreamStream {
                                upstream: self.upstream.clone(),
                                detail: format!(
                                    "the stream ended inside an event: {}",
                                    snippet(&rest.raw)
                                ),
                            });
                        }
                    }
                    continue;
                }
                Ok(Some(Err(e))) => {
                    return Next::Failed(GatewayError::UpstreamStream {
                        upstream: self.upstream.clone(),
                        detail: format!(
                            "the connection failed after {} events: {}",
                            self.events,
                            crate::upstream::error_chain(&e)
                        ),
                    });
                }
                Ok(Some(Ok(f))) => match f.into_data() {
                    Ok(d) => d,
                    Err(_) => continue,
                },
            };
            self.splitter.push(&chunk);
            loop {
                match self.splitter.next_event(self.max_event) {
                    Ok(Some(ev)) => self.pending.push_back(ev),
                    Ok(None) => break,
                    Err(e) => {
                        return Next::Failed(GatewayError::UpstreamInvalid {
                            upstream: self.upstream.clone(),
                            detail: e.to_string(),
                        });
                    }
                }
            }
        }
    }

    /// Parses an event's data as JSON, or says the upstream sent something else.
    pub(crate) fn json(&self, data: &str) -> Result<Value, GatewayError> {
        serde_json::from_str(data).map_err(|_| GatewayError::UpstreamInvalid {
            upstream: self.upstream.clone(),
            detail: format!("an SSE event is not JSON: {}", snippet(data.as_bytes())),
        })
    }

    pub(crate) fn upstream(&self) -> &str {
        &self.upstream
    }
}

/// The passthrough tee: assembles the relayed stream in its own dialect for the record.
enum Tee {
    Chat(Assembler),
    Responses(responses::ResponsesAssembler),
    Anthropic(anthropic::AnthropicAssembler),
}

impl Tee {
    fn for_route(route: Route) -> Tee {
        match route {
            Route::Completions => Tee::Chat(Assembler::completions()),
            Route::Responses => Tee::Responses(Default::default()),
            Route::Messages => Tee::Anthropic(Default::default()),
            Route::ChatCompletions | Route::Models => Tee::Chat(Assembler::chat()),
        }
    }

    fn push(&mut self, v: &Value) {
        match self {
            Tee::Chat(a) => a.push(v),
            Tee::Responses(a) => a.push(v),
            Tee::Anthropic(a) => a.push(v),
        }
    }

    /// Whether this event is the stream's last word (held back until the record is durable).
    fn is_terminal(&self, ev: &Event, v: Option<&Value>) -> bool {
        let ty = v.and_then(|v| v.get("type")).and_then(Value::as_str);
        match self {
            Tee::Chat(_) => ev.is_done(),
            Tee::Responses(_) => matches!(
                ty,
                Some("response.completed" | "response.incomplete" | "response.failed")
            ),
            Tee::Anthropic(_) => ty == Some("message_stop"),
        }
    }

    fn finish(&self) -> Option<Value> {
        match self {
            Tee::Chat(a) => (a.chunks > 0).then(|| a.finish()),
            Tee::Responses(a) => a.finish(),
            Tee::Anthropic(a) => a.finish(),
        }
    }

    fn finish_reason(&self, response: Option<&Value>) -> Option<String> {
        match self {
            Tee::Chat(a) => a.finish_reason(),
            Tee::Responses(_) => response
                .and_then(|r| r.get("status"))
                .and_then(Value::as_str)
                .map(str::to_string),
            Tee::Anthropic(_) => response
                .and_then(|r| r.get("stop_reason"))
                .and_then(Value::as_str)
                .map(str::to_string),
        }
    }
}

/// The error event for a stream in the call's dialect.
pub(crate) fn error_event(call: &Call, e: &GatewayError) -> Bytes {
    match call.route {
        Route::Responses => responses::error_event(e, &call.response_id),
        Route::Messages => anthropic::error_event(e),
        _ => e.sse_event(),
    }
}

/// Ends a stream: writes the record (under sync durability this waits for the fsync), then
/// sends the held-back last bytes, or the error event.
pub(crate) async fn close_stream(
    call: &Call,
    o: &Outcome,
    client_gone: bool,
    tx: &mpsc::Sender<Bytes>,
    last: Vec<Bytes>,
) {
    if let Some(e) = &o.error {
        warn!(error = %e, "stream ended with an error");
    }
    let wait = match call.commit(o, client_gone).await {
        Ok(w) => w,
        Err(e) => {
            if !client_gone {
                let _ = tx.send(error_event(call, &e)).await;
            }
            return;
        }
    };
    call.observe(o.upstream_time, wait, o.ttft);
    if client_gone {
        debug!("client went away mid-stream; partial call recorded");
        return;
    }
    match &o.error {
        Some(e) => {
            let _ = tx.send(error_event(call, e)).await;
        }
        None => {
            for b in last {
                if tx.send(b).await.is_err() {
                    return;
                }
            }
        }
    }
}

/// Relays an SSE answer event by event while the tee assembles it. The stream's last event
/// (`[DONE]`, `response.completed`, `message_stop`) is held back until the record is written
/// (sync durability: the last byte waits for the fsync).
async fn pump(call: Call, body: Incoming, tx: mpsc::Sender<Bytes>, t_up: Instant) {
    let mut up = UpstreamEvents::new(&call, body);
    let mut tee = Tee::for_route(call.route);
    let mut o = Outcome {
        status: StatusCode::OK.as_u16(),
        ..Default::default()
    };
    let mut last: Vec<Bytes> = vec![];
    let mut client_gone = false;
    let mut capture = Capture::default();
    loop {
        let mut ev = match up.next(&tx).await {
            Next::Event(ev) => ev,
            Next::End => break,
            Next::Failed(e) => {
                o.error = Some(e);
                break;
            }
            Next::ClientGone => {
                client_gone = true;
                break;
            }
        };
        let mut parsed = match ev.data.as_deref() {
            Some(d) if !ev.is_done() => match up.json(d) {
                Ok(v) => Some(v),
                Err(e) => {
                    o.error = Some(e);
                    break;
                }
            },
            _ => None,
        };
        if let Some(v) = &mut parsed {
            let err = v.get("error").filter(|e| !e.is_null());
            let ty = v.get("type").and_then(Value::as_str);
            if err.is_some() || ty == Some("error") {
                o.upstream_error_text = Some(format!(
                    "upstream sent an error event: {}",
                    err.unwrap_or(v)
                ));
            } else {
                if o.ttft.is_none() {
                    o.ttft = Some(call.t0.elapsed());
                }
                capture.push(v);
                if let Some(added) = call.token_ids
                    && token_ids::strip(v, added)
                {
                    // The client gets the chunk without what graft asked for.
                    ev.raw = Bytes::from(format!("data: {v}\n\n"));
                }
                tee.push(v);
            }
        }
        if tee.is_terminal(&ev, parsed.as_ref()) {
            last.push(ev.raw);
            continue;
        }
        if !last.is_empty() {
            // Something after the "last" event: relay in order, keep holding only the end.
            for b in std::mem::take(&mut last) {
                if tx.send(b).await.is_err() {
                    client_gone = true;
                }
            }
        }
        if tx.send(ev.raw).await.is_err() {
            client_gone = true;
            break;
        }
    }
    if o.error.is_none() && !client_gone && last.is_empty() && o.upstream_error_text.is_none() {
        o.error = Some(GatewayError::UpstreamStream {
            upstream: up.upstream().to_string(),
            detail: format!(
                "the stream ended after {} events without its final event",
                up.events
            ),
        });
    }
    o.upstream_time = t_up.elapsed();
    o.response = tee.finish();
    o.finish_reason = tee.finish_reason(o.response.as_ref());
    o.tokens = finish_capture(&call, capture);
    close_stream(&call, &o, client_gone, &tx, last).await;
}

/// `GET /v1/models`: relayed, not recorded (it is not an inference call).
async fn models(state: &State, headers: &HeaderMap) -> Result<Response<GBody>, GatewayError> {
    let resp = state
        .upstream
        .send(
            Method::GET,
            Route::Models.upstream_path(),
            Bytes::new(),
            headers,
        )
        .await?;
    let status = resp.status();
    let upstream = state.upstream.base_url().to_string();
    let bytes = http_body_util::Limited::new(resp.into_body(), state.cfg.max_response_bytes)
        .collect()
        .await
        .map_err(|e| GatewayError::UpstreamStream {
            upstream: upstream.clone(),
            detail: crate::upstream::error_chain(e.as_ref()),
        })?
        .to_bytes();
    if status.is_server_error() {
        return Err(GatewayError::UpstreamStatus {
            upstream,
            status: status.as_u16(),
            detail: upstream_message(&bytes),
        });
    }
    let mut resp = Response::new(full(bytes));
    *resp.status_mut() = status;
    resp.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    Ok(resp)
}

pub(crate) fn snippet(b: &[u8]) -> String {
    let s = String::from_utf8_lossy(&b[..b.len().min(200)]).to_string();
    format!("'{}'{}", s.trim(), if b.len() > 200 { "…" } else { "" })
}

/// The upstream's own error message when it sent OpenAI's error shape, else a snippet.
pub(crate) fn upstream_message(b: &[u8]) -> String {
    serde_json::from_slice::<Value>(b)
        .ok()
        .and_then(|v| {
            v.pointer("/error/message")
                .or_else(|| v.get("message"))
                .or_else(|| v.get("detail"))
                .and_then(Value::as_str)
                .map(str::to_string)
        })
        .unwrap_or_else(|| snippet(b))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn wrong_types_name_the_field() {
        let e =
            parse_request(Route::ChatCompletions, br#"{"model": 3, "messages": []}"#).unwrap_err();
        assert!(
            e.to_string()
                .contains("'model' must be a string, got a number"),
            "{e}"
        );
        let e = parse_request(Route::ChatCompletions, br#"{"model": "m", "messages": {}}"#)
            .unwrap_err();
        assert!(e.to_string().contains("'messages' must be an array"), "{e}");
        let e = parse_request(
            Route::ChatCompletions,
            br#"{"model": "m", "messages": [{"content": "x"}]}"#,
        )
        .unwrap_err();
        assert!(e.to_string().contains("messages[0]"), "{e}");
        let e = parse_request(Route::Completions, br#"{"model": "m", "prompt": 1}"#).unwrap_err();
        assert!(
            e.to_string()
                .contains("'prompt' must be a string or an array"),
            "{e}"
        );
        let e = parse_request(
            Route::ChatCompletions,
            br#"{"model": "m", "messages": [], "stream": "yes"}"#,
        )
        .unwrap_err();
        assert!(e.to_string().contains("'stream' must be a boolean"), "{e}");
    }

    #[test]
    fn invalid_utf8_and_json_are_named() {
        let e = parse_request(Route::ChatCompletions, b"{\"model\": \"\xff\"}").unwrap_err();
        assert!(matches!(e, GatewayError::InvalidUtf8 { offset: 11 }), "{e}");
        let e = parse_request(Route::ChatCompletions, b"{\"model\": ").unwrap_err();
        assert!(
            e.to_string().starts_with("request body is not valid JSON"),
            "{e}"
        );
        assert_eq!(e.status(), StatusCode::BAD_REQUEST);
    }

    #[test]
    fn unknown_fields_are_kept() {
        let v = parse_request(
            Route::ChatCompletions,
            br#"{"model":"m","messages":[],"x_custom":{"a":1}}"#,
        )
        .unwrap();
        assert_eq!(v["x_custom"]["a"], 1);
    }
}

//! The accept loop, the routing of a request to its wire, and the HTTP helpers (JSON and
//! OpenAI-shaped error answers, the SSE body with its delay and reset).

use std::convert::Infallible;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::task::{Context, Poll};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use http::{Method, Request, Response, StatusCode, header};
use http_body_util::{BodyExt, Full, Limited};
use hyper::body::{Body, Frame, Incoming, SizeHint};
use serde_json::{Value, json};

use crate::faults::{Fault, garbage};
use crate::openai::{Meta, chat_events, chat_json, completion_events, completion_json, usage_for};
use crate::script::{Prompt, Script};
use crate::tokens::TokenModel;
use crate::{MAX_REQUEST_BYTES, RESET_FLUSH_PAUSE, sglang, vllm};

pub(crate) async fn serve(
    listener: tokio::net::TcpListener,
    state: Arc<State>,
) -> anyhow::Result<()> {
    // Connection errors are client disconnects and the deliberate `fault-reset` aborts.
    let handler = move |req| handle(Arc::clone(&state), req);
    let shutdown = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    graft_http::serve(
        listener,
        graft_http::Options::new("scripted-upstream"),
        handler,
        shutdown,
    )
    .await;
    Ok(())
}

pub(crate) struct State {
    pub(crate) model: Option<TokenModel>,
    pub(crate) script: Script,
    pub(crate) expect_key: Option<String>,
    pub(crate) admin_key: Option<String>,
    pub(crate) sglang_version: String,
    pub(crate) legacy_info_routes: bool,
    /// What vLLM's `GET /version` says (`--vllm-version`).
    pub(crate) vllm_version: String,
    pub(crate) chunk_delay: Duration,
    pub(crate) models: Vec<String>,
    pub(crate) next_id: AtomicU64,
    /// The SGLang-native side's state (weight version, pause).
    pub(crate) sglang: sglang::Backend,
    /// Whether vLLM's development routes are served (`--vllm-dev-mode`).
    pub(crate) vllm_dev_mode: bool,
    /// The vLLM-native side's state (weight version, pause) and log (requests, aborts).
    pub(crate) vllm: vllm::Backend,
    /// Every body the OpenAI routes were sent, for tests (`GET /testkit/openai/requests`).
    pub(crate) openai_bodies: std::sync::Mutex<Vec<serde_json::Value>>,
}

/// The path of the test log of what the OpenAI routes were sent.
pub(crate) const OPENAI_REQUESTS: &str = "/testkit/openai/requests";

impl State {
    pub(crate) fn next_id(&self) -> u64 {
        self.next_id.fetch_add(1, Ordering::Relaxed)
    }
}

pub(crate) type RespBody = http_body_util::combinators::UnsyncBoxBody<Bytes, std::io::Error>;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Dialect {
    Chat,
    Completions,
}

/// Returned to hyper to abort the connection (the `fault-reset` fault).
#[derive(Debug)]
pub(crate) struct Abort;

impl std::fmt::Display for Abort {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("scripted-upstream: connection aborted on purpose (fault-reset)")
    }
}
impl std::error::Error for Abort {}

pub(crate) async fn handle(
    state: Arc<State>,
    req: Request<Incoming>,
) -> Result<Response<RespBody>, Abort> {
    let path = req.uri().path().to_owned();
    // vLLM's development routes: its `--api-key` does not guard them.
    if vllm::is_dev_route(&path) {
        let method = req.method().clone();
        let query = req.uri().query().map(str::to_owned);
        let body = match read_json(req.into_body(), true).await {
            Ok(v) => v,
            Err(resp) => return Ok(resp),
        };
        return Ok(vllm::dev_route(
            &state,
            &method,
            &path,
            query.as_deref(),
            &body,
        ));
    }
    if sglang::is_route(&path) {
        let bearer = req
            .headers()
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "));
        if let Some(refused) = sglang_auth(&state, &path, bearer) {
            return Ok(refused);
        }
    } else if let Some(key) = &state.expect_key {
        let ok = req
            .headers()
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "))
            .is_some_and(|got| got == key);
        if !ok {
            return Ok(error(
                StatusCode::UNAUTHORIZED,
                "Incorrect API key provided. The scripted upstream was started with --expect-key; send it as 'Authorization: Bearer KEY'.",
                "invalid_request_error",
                Some("invalid_api_key"),
            ));
        }
    }
    if state.legacy_info_routes && ["/model_info", "/server_info"].contains(&path.as_str()) {
        // FastAPI's answer for a route it does not have.
        return Ok(json_response(
            StatusCode::NOT_FOUND,
            &serde_json::json!({"detail": "Not Found"}),
        ));
    }
    if sglang::is_route(&path) {
        let method = req.method().clone();
        let routing_key = req
            .headers()
            .get("x-smg-routing-key")
            .and_then(|v| v.to_str().ok())
            .map(str::to_string);
        // SGLang's control routes take an empty body as no parameters.
        let body = match read_json(req.into_body(), true).await {
            Ok(v) => v,
            Err(resp) => return Ok(resp),
        };
        if let Some(resp) = sglang::route(&state, &method, &path, &body, routing_key).await? {
            return Ok(resp);
        }
        return Ok(error(
            StatusCode::METHOD_NOT_ALLOWED,
            &format!("method {method} is not allowed on {path}"),
            "invalid_request_error",
            None,
        ));
    }
    let dialect = match (req.method(), path.as_str()) {
        (&Method::GET, "/v1/models") => return Ok(models(&state)),
        (&Method::GET, vllm::REQUESTS) => return Ok(vllm::requests(&state)),
        (&Method::GET, OPENAI_REQUESTS) => {
            let bodies = state
                .openai_bodies
                .lock()
                .map(|v| v.clone())
                .unwrap_or_default();
            return Ok(json_response(
                StatusCode::OK,
                &serde_json::json!({"requests": bodies}),
            ));
        }
        // vLLM's `GET /version`: the release whose wire `src/vllm.rs` plays.
        (&Method::GET, "/version") => {
            return Ok(json_response(
                StatusCode::OK,
                &serde_json::json!({"version": state.vllm_version}),
            ));
        }
        (&Method::POST, "/v1/chat/completions") => Dialect::Chat,
        (&Method::POST, "/v1/completions") => Dialect::Completions,
        (_, "/v1/models" | "/v1/chat/completions" | "/v1/completions") => {
            return Ok(error(
                StatusCode::METHOD_NOT_ALLOWED,
                &format!("method {} is not allowed on {path}", req.method()),
                "invalid_request_error",
                None,
            ));
        }
        _ => {
            return Ok(error(
                StatusCode::NOT_FOUND,
                &format!(
                    "Unknown request URL: {} {path}. The scripted upstream serves POST /v1/chat/completions, POST /v1/completions and GET /v1/models.",
                    req.method()
                ),
                "invalid_request_error",
                Some("unknown_url"),
            ));
        }
    };
    let body = match read_json(req.into_body(), false).await {
        Ok(v) => v,
        Err(resp) => return Ok(resp),
    };
    if let Ok(mut log) = state.openai_bodies.lock() {
        log.push(serde_json::json!({"path": path, "body": body}));
    }
    // A token-id prompt is vLLM's token-in/token-out use of the route.
    if dialect == Dialect::Completions && vllm::is_token_prompt(&body) {
        return vllm::completions(&state, &body).await;
    }
    let parsed = match dialect {
        Dialect::Chat => Prompt::from_chat(&body),
        Dialect::Completions => Prompt::from_completions(&body),
    };
    let prompt = match parsed {
        Ok(p) => p,
        Err(msg) => return Ok(bad_request(&msg)),
    };
    let fault = Fault::from_model(&prompt.model);
    let mut delay = state.chunk_delay;
    match fault {
        Some(Fault::Status500) => {
            return Ok(error(
                StatusCode::INTERNAL_SERVER_ERROR,
                "The server had an error while processing your request (scripted fault-500).",
                "server_error",
                None,
            ));
        }
        Some(Fault::Hang) => {
            tokio::time::sleep(Duration::from_secs(3600)).await;
        }
        Some(Fault::Garbage) => return Ok(garbage(prompt.stream)),
        Some(Fault::Reset) if !prompt.stream => return Err(Abort),
        Some(Fault::Slow) => {
            delay = Duration::from_millis(200);
            if !prompt.stream {
                tokio::time::sleep(delay).await;
            }
        }
        Some(Fault::Reset) | None => {}
    }

    if let Some(status) = state
        .script
        .rule_for(&prompt)
        .and_then(|r| r.first_failure())
    {
        return Ok(error(
            status,
            "The server had an error while processing your request (scripted first_status).",
            "server_error",
            None,
        ));
    }
    if let Some(d) = state.script.rule_for(&prompt).and_then(|r| r.first_delay()) {
        tokio::time::sleep(d).await;
    }
    let reply = state.script.reply_or_echo(&prompt);
    let reply = reply.as_ref();
    let meta = Meta {
        id: state.next_id(),
        created: SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_secs())
            .unwrap_or(0),
        model: prompt.model.clone(),
    };
    let tokens = match &state.model {
        Some(m) => match m.answer(dialect, &body, &meta, reply) {
            Ok(t) => Some(t),
            Err(msg) => return Ok(bad_request(&msg)),
        },
        None => None,
    };
    let usage = match &tokens {
        Some(t) => t.usage(),
        None => usage_for(&prompt, reply),
    };
    let tokens = tokens.as_ref();
    if !prompt.stream {
        let v = match dialect {
            Dialect::Chat => chat_json(&meta, reply, &usage, tokens),
            Dialect::Completions => completion_json(&meta, reply, &usage, tokens),
        };
        return Ok(json_response(StatusCode::OK, &v));
    }
    let usage = prompt.include_usage.then_some(&usage);
    let events = match dialect {
        Dialect::Chat => chat_events(&meta, reply, usage, tokens),
        Dialect::Completions => completion_events(&meta, reply, usage, tokens),
    };
    let abort_after = (fault == Some(Fault::Reset)).then_some(2);
    Ok(sse_response(SseBody::new(events, delay, abort_after)))
}

pub(crate) fn full(bytes: impl Into<Bytes>) -> RespBody {
    Full::new(bytes.into())
        .map_err(|never: Infallible| match never {})
        .boxed_unsync()
}

pub(crate) fn json_response(status: StatusCode, v: &Value) -> Response<RespBody> {
    graft_http::json_response(status, v, full)
}

/// An error in OpenAI's shape: `{"error":{"message","type","param","code"}}`.
/// The request body (at most `MAX_REQUEST_BYTES`) as JSON, or the OpenAI-shaped error to
/// answer with; with `empty_is_null` a body of only whitespace reads as `null`.
async fn read_json(body: Incoming, empty_is_null: bool) -> Result<Value, Response<RespBody>> {
    let bytes = match Limited::new(body, MAX_REQUEST_BYTES).collect().await {
        Ok(c) => c.to_bytes(),
        Err(e) => {
            return Err(error(
                StatusCode::PAYLOAD_TOO_LARGE,
                &format!("cannot read the request body: {e}"),
                "invalid_request_error",
                None,
            ));
        }
    };
    if empty_is_null && bytes.iter().all(u8::is_ascii_whitespace) {
        return Ok(Value::Null);
    }
    serde_json::from_slice(&bytes)
        .map_err(|e| bad_request(&format!("the request body is not valid JSON: {e}")))
}

/// OpenAI's 400 for a request the scripted upstream cannot take.
fn bad_request(message: &str) -> Response<RespBody> {
    error(
        StatusCode::BAD_REQUEST,
        message,
        "invalid_request_error",
        None,
    )
}

pub(crate) fn error(
    status: StatusCode,
    message: &str,
    kind: &str,
    code: Option<&str>,
) -> Response<RespBody> {
    json_response(
        status,
        &json!({"error": {"message": message, "type": kind, "param": null, "code": code}}),
    )
}

pub(crate) fn models(state: &State) -> Response<RespBody> {
    let data: Vec<Value> = state
        .models
        .iter()
        .map(String::as_str)
        .chain(Fault::MODELS)
        .map(|id| json!({"id": id, "object": "model", "created": 1_700_000_000u64, "owned_by": "graft-scripted"}))
        .collect();
    json_response(StatusCode::OK, &json!({"object": "list", "data": data}))
}

pub(crate) fn sse_response(body: SseBody) -> Response<RespBody> {
    let mut resp = Response::new(body.boxed_unsync());
    let h = resp.headers_mut();
    h.insert(
        header::CONTENT_TYPE,
        header::HeaderValue::from_static("text/event-stream; charset=utf-8"),
    );
    h.insert(
        header::CACHE_CONTROL,
        header::HeaderValue::from_static("no-cache"),
    );
    resp
}

/// An SSE response body: one HTTP chunk per event, `delay` between events, and optionally
/// an error after `abort_after` events, which makes hyper drop the connection without the
/// terminating chunk (the client sees a transport error, as when an upstream dies).
pub(crate) struct SseBody {
    pub(crate) events: std::vec::IntoIter<Bytes>,
    pub(crate) delay: Duration,
    pub(crate) sleep: Option<Pin<Box<tokio::time::Sleep>>>,
    pub(crate) sent: usize,
    pub(crate) abort_after: Option<usize>,
    /// Events that exist only once something happened (a weight update): awaited after
    /// `events` ran out.
    pub(crate) later: Option<LaterEvents>,
}

/// Events produced by a future (see [`SseBody::later`]).
pub(crate) type LaterEvents = Pin<Box<dyn Future<Output = Vec<Bytes>> + Send>>;

impl SseBody {
    pub(crate) fn new(events: Vec<Bytes>, delay: Duration, abort_after: Option<usize>) -> Self {
        SseBody {
            events: events.into_iter(),
            delay,
            sleep: None,
            sent: 0,
            abort_after,
            later: None,
        }
    }

    /// Once `events` are sent, awaits `later` and sends what it gives.
    pub(crate) fn then(mut self, later: LaterEvents) -> Self {
        self.later = Some(later);
        self
    }
}

/// Waits `delay` in a body's `poll_frame`: the timer lives in `sleep` across polls and is
/// cleared once it fired.
fn pause(
    sleep: &mut Option<Pin<Box<tokio::time::Sleep>>>,
    delay: Duration,
    cx: &mut Context<'_>,
) -> Poll<()> {
    let timer = sleep.get_or_insert_with(|| Box::pin(tokio::time::sleep(delay)));
    if timer.as_mut().poll(cx).is_pending() {
        return Poll::Pending;
    }
    *sleep = None;
    Poll::Ready(())
}

impl Body for SseBody {
    type Data = Bytes;
    type Error = std::io::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, std::io::Error>>> {
        let this = &mut *self;
        if this.abort_after.is_some_and(|n| this.sent >= n) {
            // Pause first: hyper flushes what it buffered (headers, the chunks so far) when
            // the body is pending, and drops the buffer when the body fails.
            if pause(&mut this.sleep, RESET_FLUSH_PAUSE, cx).is_pending() {
                return Poll::Pending;
            }
            this.abort_after = None;
            this.events = Vec::new().into_iter();
            return Poll::Ready(Some(Err(std::io::Error::new(
                std::io::ErrorKind::ConnectionAborted,
                Abort,
            ))));
        }
        if this.events.len() == 0
            && let Some(later) = this.later.as_mut()
        {
            let Poll::Ready(more) = later.as_mut().poll(cx) else {
                return Poll::Pending;
            };
            this.later = None;
            this.events = more.into_iter();
        }
        if this.sent > 0
            && !this.delay.is_zero()
            && this.events.len() > 0
            && pause(&mut this.sleep, this.delay, cx).is_pending()
        {
            return Poll::Pending;
        }
        match this.events.next() {
            Some(event) => {
                this.sent += 1;
                Poll::Ready(Some(Ok(Frame::data(event))))
            }
            None => Poll::Ready(None),
        }
    }

    fn is_end_stream(&self) -> bool {
        self.events.len() == 0 && self.abort_after.is_none() && self.later.is_none()
    }

    fn size_hint(&self) -> SizeHint {
        // Unknown on purpose: SSE goes out chunked.
        SizeHint::default()
    }
}

/// SGLang's own decision on a native route (`decide_request_auth` in
/// `sglang/srt/utils/auth.py`, `--expect-key` as its `--api-key`, `--admin-key` as its
/// `--admin-api-key`): health routes are open; admin routes want the admin key when there
/// is one, else the API key; the others want the API key when there is one. A refusal is
/// SGLang's `{"error": "Unauthorized"}` with 401.
fn sglang_auth(state: &State, path: &str, bearer: Option<&str>) -> Option<Response<RespBody>> {
    const ADMIN: [&str; 8] = [
        "/pause_generation",
        "/continue_generation",
        "/flush_cache",
        "/update_weights_from_disk",
        "/update_weights_from_tensor",
        "/begin_weight_update",
        "/end_weight_update",
        "/abort_request",
    ];
    if path.starts_with("/health") || path == sglang::REQUESTS {
        return None;
    }
    let (api, admin) = (state.expect_key.as_deref(), state.admin_key.as_deref());
    let want = if ADMIN.contains(&path) {
        admin.or(api)
    } else {
        api
    };
    match want {
        Some(k) if bearer != Some(k) => Some(json_response(
            StatusCode::UNAUTHORIZED,
            &serde_json::json!({"error": "Unauthorized"}),
        )),
        _ => None,
    }
}

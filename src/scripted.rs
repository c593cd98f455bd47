//! The scripted upstream: an OpenAI-compatible server that plays the *model's text* from a
//! script while speaking the real wire format (JSON and SSE, byte for byte the shapes OpenAI
//! sends). It is the one stand-in graft's tests allow; the gateway, the SDKs, the harnesses
//! and the files on disk around it are all real. It is also the upstream of the load
//! benchmark, so the hot path takes no lock and blocks nothing: the script is read once at
//! start and shared read-only, ids come from an atomic counter.
//!
//! What it says is chosen by [`Script`] rules matched against the request (see
//! [`Rule`]); with no matching rule it echoes `You said: <last user text>`.
//! Faults are chosen by the request's `model` field (see [`Fault`]), because the gateway
//! forwards request bodies unchanged.
//!
//! With `--tokenizer DIR` (a HF model directory) it also answers like vLLM does to
//! `return_token_ids: true` and `logprobs` (see [`TokenModel`]): the prompt ids are the chat
//! template's rendering of the request (messages, tools, generation prompt) tokenized, the
//! completion ids the tokenized text the model "generated" (content, then each tool call in
//! the Hermes `<tool_call>` form Qwen3 uses, then the end-of-turn token), split across SSE
//! chunks along with the text, and each logprob is `-(id % 97) / 100`. Usage then counts
//! those tokens. Without `--tokenizer` nothing of this happens.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::task::{Context, Poll};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use anyhow::Context as _;
use bytes::Bytes;
use http::{Method, Request, Response, StatusCode, header};
use http_body_util::{BodyExt, Full, Limited};
use hyper::body::{Body, Frame, Incoming, SizeHint};
use hyper_util::rt::{TokioExecutor, TokioIo};
use serde::Deserialize;
use serde_json::{Value, json};

mod sglang;

#[derive(Debug, Clone, clap::Args)]
pub struct ScriptedArgs {
    /// Address to listen on (port 0 picks a free port).
    #[arg(long, default_value = "127.0.0.1:0")]
    pub listen: SocketAddr,
    /// JSON script: `{"rules":[{"match":"substring","reply":{"content":"...","tool_calls":[...]}}]}`.
    /// Without it every reply echoes `You said: <last user text>`.
    #[arg(long)]
    pub script: Option<PathBuf>,
    /// Require `Authorization: Bearer KEY` on every request (401 otherwise).
    #[arg(long)]
    pub expect_key: Option<String>,
    /// Delay between SSE chunks, in milliseconds.
    #[arg(long, default_value_t = 0)]
    pub chunk_delay_ms: u64,
    /// Model ids listed by `GET /v1/models` (repeatable). Any model id is accepted in requests.
    #[arg(long = "model", default_value = "scripted")]
    pub models: Vec<String>,
    /// A HF model directory (tokenizer.json + chat template): answer `return_token_ids` and
    /// `logprobs` with real token ids, as vLLM does.
    #[arg(long)]
    pub tokenizer: Option<PathBuf>,
}

/// The largest request body read (bigger ones get 413).
const MAX_REQUEST_BYTES: usize = 64 * 1024 * 1024;
/// Tool-call arguments are streamed in at most this many pieces.
const ARGUMENT_PIECES: usize = 4;
/// `fault-reset` waits this long after its last chunk before aborting, so the chunks reach
/// the client first.
const RESET_FLUSH_PAUSE: Duration = Duration::from_millis(50);

pub async fn run(args: ScriptedArgs) -> anyhow::Result<()> {
    let (addr, serve) = start(&args).await?;
    {
        use std::io::Write as _;
        let mut out = std::io::stdout().lock();
        writeln!(out, "graft scripted-upstream listening on http://{addr}")?;
        out.flush()?;
    }
    serve.await
}

/// Binds the scripted upstream; returns its address and the future that serves it (until
/// Ctrl-C, or until it is dropped).
pub async fn start(
    args: &ScriptedArgs,
) -> anyhow::Result<(
    SocketAddr,
    impl std::future::Future<Output = anyhow::Result<()>> + use<>,
)> {
    let script = match &args.script {
        Some(path) => Script::load(path)?,
        None => Script::default(),
    };
    let model = match &args.tokenizer {
        Some(dir) => Some(TokenModel::load(dir)?),
        None => None,
    };
    let state = Arc::new(State {
        model,
        script,
        expect_key: args.expect_key.clone(),
        chunk_delay: Duration::from_millis(args.chunk_delay_ms),
        models: args.models.clone(),
        next_id: AtomicU64::new(1),
        sglang: sglang::Backend::default(),
    });
    let listener = tokio::net::TcpListener::bind(args.listen)
        .await
        .with_context(|| {
            format!(
                "cannot listen on {}; pick another --listen address",
                args.listen
            )
        })?;
    let addr = listener
        .local_addr()
        .context("cannot read the bound address")?;
    Ok((addr, serve(listener, state)))
}

async fn serve(listener: tokio::net::TcpListener, state: Arc<State>) -> anyhow::Result<()> {
    let builder = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new());
    loop {
        let accepted = tokio::select! {
            accepted = listener.accept() => accepted,
            _ = tokio::signal::ctrl_c() => return Ok(()),
        };
        let (stream, _peer) = match accepted {
            Ok(conn) => conn,
            Err(e) => {
                // Out of file descriptors and the like: back off instead of spinning.
                tracing::warn!(error = %e, "scripted-upstream: accept failed");
                tokio::time::sleep(Duration::from_millis(20)).await;
                continue;
            }
        };
        let _ = stream.set_nodelay(true);
        let state = Arc::clone(&state);
        let builder = builder.clone();
        tokio::spawn(async move {
            let service = hyper::service::service_fn(move |req| {
                let state = Arc::clone(&state);
                async move { handle(state, req).await }
            });
            // Errors here are client disconnects and the deliberate `fault-reset` aborts.
            let _ = builder
                .serve_connection(TokioIo::new(stream), service)
                .await;
        });
    }
}

struct State {
    model: Option<TokenModel>,
    script: Script,
    expect_key: Option<String>,
    chunk_delay: Duration,
    models: Vec<String>,
    next_id: AtomicU64,
    /// The SGLang-native side's state (weight version, pause).
    sglang: sglang::Backend,
}

impl State {
    fn next_id(&self) -> u64 {
        self.next_id.fetch_add(1, Ordering::Relaxed)
    }
}

// ---------------------------------------------------------------------------------------
// Script

/// The script file: rules tried in order, the first that matches answers.
#[derive(Debug, Default, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Script {
    #[serde(default)]
    pub rules: Vec<Rule>,
}

/// One rule. Every condition that is set must hold; a rule with none always matches.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Rule {
    /// Substring of the text of the LAST message (chat) or of the prompt (completions).
    #[serde(default, rename = "match")]
    pub pattern: Option<String>,
    /// Role of the last message (`user`, `tool`, ...).
    #[serde(default)]
    pub role: Option<String>,
    /// Exact number of messages in the request.
    #[serde(default)]
    pub messages: Option<usize>,
    /// At least this many messages.
    #[serde(default)]
    pub min_messages: Option<usize>,
    /// At most this many messages.
    #[serde(default)]
    pub max_messages: Option<usize>,
    /// Whether the request offers tools (a non-empty `tools` array).
    #[serde(default)]
    pub tools: Option<bool>,
    /// The request's `model` field, exactly.
    #[serde(default)]
    pub model: Option<String>,
    #[serde(default)]
    pub reply: Reply,
    /// SGLang `/generate` only (it has no model field to pick faults by): fail instead of
    /// answering: `500`, `garbage`, `reset` (mid-stream), `hang`, `abort` (finish_reason
    /// abort).
    #[serde(default)]
    pub fault: Option<String>,
}

/// What the model says.
#[derive(Debug, Clone, Default, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct Reply {
    #[serde(default)]
    pub content: Option<String>,
    #[serde(default)]
    pub tool_calls: Vec<ScriptToolCall>,
    /// Overrides the finish reason (default: `tool_calls` when there are tool calls, else `stop`).
    #[serde(default)]
    pub finish_reason: Option<String>,
    /// Reasoning the model writes first, in `<think>` (SGLang `/generate` answers only).
    #[serde(default)]
    pub reasoning: Option<String>,
}

#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct ScriptToolCall {
    pub name: String,
    /// A JSON object (serialized for the wire) or an already-serialized string.
    #[serde(default)]
    pub arguments: Value,
}

impl ScriptToolCall {
    fn arguments_string(&self) -> String {
        match &self.arguments {
            Value::String(s) => s.clone(),
            Value::Null => "{}".to_owned(),
            other => other.to_string(),
        }
    }
}

impl Script {
    pub fn load(path: &std::path::Path) -> anyhow::Result<Self> {
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("cannot read the script '{}'", path.display()))?;
        Self::parse(&text).with_context(|| format!("script '{}' is not valid", path.display()))
    }

    pub fn parse(text: &str) -> anyhow::Result<Self> {
        serde_json::from_str(text).context(
            r#"expected {"rules":[{"match":"substring","reply":{"content":"...","tool_calls":[{"name":"bash","arguments":{...}}]}}]}"#,
        )
    }

    /// The reply for a request, or `None` when no rule matches.
    fn reply_for(&self, req: &Prompt) -> Option<&Reply> {
        self.rule_for(req).map(|rule| &rule.reply)
    }

    fn rule_for(&self, req: &Prompt) -> Option<&Rule> {
        self.rules.iter().find(|rule| rule.matches(req))
    }
}

impl Rule {
    fn matches(&self, req: &Prompt) -> bool {
        if let Some(p) = &self.pattern
            && !req.last_text.contains(p.as_str())
        {
            return false;
        }
        if let Some(role) = &self.role
            && req.last_role.as_deref() != Some(role.as_str())
        {
            return false;
        }
        if self.messages.is_some_and(|n| req.message_count != n)
            || self.min_messages.is_some_and(|n| req.message_count < n)
            || self.max_messages.is_some_and(|n| req.message_count > n)
            || self.tools.is_some_and(|t| req.has_tools != t)
        {
            return false;
        }
        if let Some(m) = &self.model
            && req.model != *m
        {
            return false;
        }
        true
    }
}

// ---------------------------------------------------------------------------------------
// Requests

/// What the script looks at in a request.
#[derive(Debug, Default)]
struct Prompt {
    model: String,
    stream: bool,
    include_usage: bool,
    /// Text of the last message (chat) or the prompt (completions).
    last_text: String,
    last_role: Option<String>,
    /// Text of the last user message (chat) or the prompt (completions), for the echo.
    last_user_text: String,
    message_count: usize,
    has_tools: bool,
    /// Whitespace-separated words of the whole prompt (see [`count_words`]).
    prompt_words: u64,
}

/// The text of a message's `content`: a string, or a list of `{type: text, text}` parts.
fn content_text(content: Option<&Value>) -> String {
    match content {
        Some(Value::String(s)) => s.clone(),
        Some(Value::Array(parts)) => parts
            .iter()
            .filter_map(|p| match p {
                Value::String(s) => Some(s.as_str()),
                Value::Object(o) => o.get("text").and_then(Value::as_str),
                _ => None,
            })
            .collect::<Vec<_>>()
            .join("\n"),
        _ => String::new(),
    }
}

/// Usage numbers count whitespace-separated words. A real tokenizer arrives with a later
/// issue (reconstruct's tokenizer); until then, words are a stable, cheap stand-in.
fn count_words(text: &str) -> u64 {
    text.split_whitespace().count() as u64
}

impl Prompt {
    fn common(body: &Value) -> Self {
        Prompt {
            model: body
                .get("model")
                .and_then(Value::as_str)
                .unwrap_or_default()
                .to_owned(),
            stream: body.get("stream").and_then(Value::as_bool).unwrap_or(false),
            include_usage: body
                .pointer("/stream_options/include_usage")
                .and_then(Value::as_bool)
                .unwrap_or(false),
            has_tools: body
                .get("tools")
                .and_then(Value::as_array)
                .is_some_and(|t| !t.is_empty()),
            ..Prompt::default()
        }
    }

    fn from_chat(body: &Value) -> Result<Self, String> {
        let mut p = Self::common(body);
        let messages = body
            .get("messages")
            .and_then(Value::as_array)
            .ok_or_else(|| "'messages' must be an array of messages".to_owned())?;
        p.message_count = messages.len();
        let mut words = 0;
        for m in messages {
            words += count_words(&content_text(m.get("content")));
            if let Some(calls) = m.get("tool_calls").and_then(Value::as_array) {
                for c in calls {
                    if let Some(a) = c.pointer("/function/arguments").and_then(Value::as_str) {
                        words += count_words(a);
                    }
                }
            }
        }
        p.prompt_words = words;
        if let Some(last) = messages.last() {
            p.last_text = content_text(last.get("content"));
            p.last_role = last.get("role").and_then(Value::as_str).map(str::to_owned);
        }
        p.last_user_text = messages
            .iter()
            .rev()
            .find(|m| m.get("role").and_then(Value::as_str) == Some("user"))
            .map(|m| content_text(m.get("content")))
            .unwrap_or_default();
        Ok(p)
    }

    fn from_completions(body: &Value) -> Result<Self, String> {
        let mut p = Self::common(body);
        let prompt = match body.get("prompt") {
            Some(Value::String(s)) => s.clone(),
            Some(Value::Array(items)) => items
                .iter()
                .filter_map(Value::as_str)
                .collect::<Vec<_>>()
                .join("\n"),
            _ => return Err("'prompt' must be a string or an array of strings".to_owned()),
        };
        p.prompt_words = count_words(&prompt);
        p.last_text = prompt.clone();
        p.last_user_text = prompt;
        Ok(p)
    }
}

/// Faults, chosen by the request's `model` field.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Fault {
    /// HTTP 500 with an OpenAI error body.
    Status500,
    /// 200 with a body that is not JSON (or, streaming, not SSE).
    Garbage,
    /// Streaming: two valid chunks, then the connection is aborted. JSON: aborted before any response.
    Reset,
    /// 200 ms between SSE chunks (and before a JSON answer).
    Slow,
    /// Never answers.
    Hang,
}

impl Fault {
    fn from_model(model: &str) -> Option<Self> {
        match model {
            "fault-500" => Some(Fault::Status500),
            "fault-garbage" => Some(Fault::Garbage),
            "fault-reset" => Some(Fault::Reset),
            "fault-slow" => Some(Fault::Slow),
            "fault-hang" => Some(Fault::Hang),
            _ => None,
        }
    }
    const MODELS: [&'static str; 5] = [
        "fault-500",
        "fault-garbage",
        "fault-reset",
        "fault-slow",
        "fault-hang",
    ];
}

// ---------------------------------------------------------------------------------------
// HTTP

type RespBody = http_body_util::combinators::UnsyncBoxBody<Bytes, std::io::Error>;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Dialect {
    Chat,
    Completions,
}

/// Returned to hyper to abort the connection (the `fault-reset` fault).
#[derive(Debug)]
struct Abort;

impl std::fmt::Display for Abort {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("scripted-upstream: connection aborted on purpose (fault-reset)")
    }
}
impl std::error::Error for Abort {}

async fn handle(state: Arc<State>, req: Request<Incoming>) -> Result<Response<RespBody>, Abort> {
    if let Some(key) = &state.expect_key {
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
    let path = req.uri().path().to_owned();
    if sglang::is_route(&path) {
        let method = req.method().clone();
        let body = match Limited::new(req.into_body(), MAX_REQUEST_BYTES)
            .collect()
            .await
        {
            Ok(c) => c.to_bytes(),
            Err(e) => {
                return Ok(error(
                    StatusCode::PAYLOAD_TOO_LARGE,
                    &format!("cannot read the request body: {e}"),
                    "invalid_request_error",
                    None,
                ));
            }
        };
        let body: Value = if body.iter().all(u8::is_ascii_whitespace) {
            Value::Null
        } else {
            match serde_json::from_slice(&body) {
                Ok(v) => v,
                Err(e) => {
                    return Ok(error(
                        StatusCode::BAD_REQUEST,
                        &format!("the request body is not valid JSON: {e}"),
                        "invalid_request_error",
                        None,
                    ));
                }
            }
        };
        if let Some(resp) = sglang::route(&state, &method, &path, &body).await? {
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
    let bytes = match Limited::new(req.into_body(), MAX_REQUEST_BYTES)
        .collect()
        .await
    {
        Ok(c) => c.to_bytes(),
        Err(e) => {
            return Ok(error(
                StatusCode::PAYLOAD_TOO_LARGE,
                &format!("cannot read the request body: {e}"),
                "invalid_request_error",
                None,
            ));
        }
    };
    let body: Value = match serde_json::from_slice(&bytes) {
        Ok(v) => v,
        Err(e) => {
            return Ok(error(
                StatusCode::BAD_REQUEST,
                &format!("the request body is not valid JSON: {e}"),
                "invalid_request_error",
                None,
            ));
        }
    };
    let parsed = match dialect {
        Dialect::Chat => Prompt::from_chat(&body),
        Dialect::Completions => Prompt::from_completions(&body),
    };
    let prompt = match parsed {
        Ok(p) => p,
        Err(msg) => {
            return Ok(error(
                StatusCode::BAD_REQUEST,
                &msg,
                "invalid_request_error",
                None,
            ));
        }
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

    let echo;
    let reply = match state.script.reply_for(&prompt) {
        Some(r) => r,
        None => {
            echo = Reply {
                content: Some(format!("You said: {}", prompt.last_user_text)),
                ..Reply::default()
            };
            &echo
        }
    };
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
            Err(msg) => {
                return Ok(error(
                    StatusCode::BAD_REQUEST,
                    &msg,
                    "invalid_request_error",
                    None,
                ));
            }
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

fn full(bytes: impl Into<Bytes>) -> RespBody {
    Full::new(bytes.into())
        .map_err(|never: Infallible| match never {})
        .boxed_unsync()
}

fn json_response(status: StatusCode, v: &Value) -> Response<RespBody> {
    let mut resp = Response::new(full(v.to_string()));
    *resp.status_mut() = status;
    resp.headers_mut().insert(
        header::CONTENT_TYPE,
        header::HeaderValue::from_static("application/json"),
    );
    resp
}

/// An error in OpenAI's shape: `{"error":{"message","type","param","code"}}`.
fn error(status: StatusCode, message: &str, kind: &str, code: Option<&str>) -> Response<RespBody> {
    json_response(
        status,
        &json!({"error": {"message": message, "type": kind, "param": null, "code": code}}),
    )
}

fn models(state: &State) -> Response<RespBody> {
    let data: Vec<Value> = state
        .models
        .iter()
        .map(String::as_str)
        .chain(Fault::MODELS)
        .map(|id| json!({"id": id, "object": "model", "created": 1_700_000_000u64, "owned_by": "graft-scripted"}))
        .collect();
    json_response(StatusCode::OK, &json!({"object": "list", "data": data}))
}

fn garbage(stream: bool) -> Response<RespBody> {
    let (body, ctype) = if stream {
        (
            "this is not server-sent events\n{{{ garbage ]]]\n<html>502 bad gateway</html>\n",
            "text/event-stream",
        )
    } else {
        (
            "<html><body>this is not JSON {\"choices\": [</body></html>\n",
            "application/json",
        )
    };
    let mut resp = Response::new(full(body));
    resp.headers_mut().insert(
        header::CONTENT_TYPE,
        header::HeaderValue::from_static(ctype),
    );
    resp
}

fn sse_response(body: SseBody) -> Response<RespBody> {
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
struct SseBody {
    events: std::vec::IntoIter<Bytes>,
    delay: Duration,
    sleep: Option<Pin<Box<tokio::time::Sleep>>>,
    sent: usize,
    abort_after: Option<usize>,
}

impl SseBody {
    fn new(events: Vec<Bytes>, delay: Duration, abort_after: Option<usize>) -> Self {
        SseBody {
            events: events.into_iter(),
            delay,
            sleep: None,
            sent: 0,
            abort_after,
        }
    }
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
            let sleep = this
                .sleep
                .get_or_insert_with(|| Box::pin(tokio::time::sleep(RESET_FLUSH_PAUSE)));
            if sleep.as_mut().poll(cx).is_pending() {
                return Poll::Pending;
            }
            this.sleep = None;
            this.abort_after = None;
            this.events = Vec::new().into_iter();
            return Poll::Ready(Some(Err(std::io::Error::new(
                std::io::ErrorKind::ConnectionAborted,
                Abort,
            ))));
        }
        if this.sent > 0 && !this.delay.is_zero() && this.events.len() > 0 {
            let delay = this.delay;
            let sleep = this
                .sleep
                .get_or_insert_with(|| Box::pin(tokio::time::sleep(delay)));
            if sleep.as_mut().poll(cx).is_pending() {
                return Poll::Pending;
            }
            this.sleep = None;
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
        self.events.len() == 0 && self.abort_after.is_none()
    }

    fn size_hint(&self) -> SizeHint {
        // Unknown on purpose: SSE goes out chunked.
        SizeHint::default()
    }
}

// ---------------------------------------------------------------------------------------
// Wire shapes

struct Meta {
    id: u64,
    created: u64,
    model: String,
}

impl Meta {
    fn chat_id(&self) -> String {
        format!("chatcmpl-scripted{:012x}", self.id)
    }
    fn completion_id(&self) -> String {
        format!("cmpl-scripted{:012x}", self.id)
    }
    fn tool_call_id(&self, index: usize) -> String {
        format!("call_scripted{:08x}x{index}", self.id)
    }
}

fn finish_reason(reply: &Reply) -> &str {
    match &reply.finish_reason {
        Some(r) => r,
        None if reply.tool_calls.is_empty() => "stop",
        None => "tool_calls",
    }
}

fn usage_for(prompt: &Prompt, reply: &Reply) -> Value {
    let completion = count_words(reply.content.as_deref().unwrap_or_default())
        + reply
            .tool_calls
            .iter()
            .map(|c| count_words(&c.arguments_string()))
            .sum::<u64>();
    json!({
        "prompt_tokens": prompt.prompt_words,
        "completion_tokens": completion,
        "total_tokens": prompt.prompt_words + completion,
    })
}

fn chat_json(meta: &Meta, reply: &Reply, usage: &Value, tokens: Option<&TokenAnswer>) -> Value {
    let mut message = json!({
        "role": "assistant",
        "content": reply.content,
        "refusal": null,
    });
    if !reply.tool_calls.is_empty() {
        let calls: Vec<Value> = reply
            .tool_calls
            .iter()
            .enumerate()
            .map(|(i, c)| {
                json!({
                    "id": meta.tool_call_id(i),
                    "type": "function",
                    "function": {"name": c.name, "arguments": c.arguments_string()},
                })
            })
            .collect();
        message["tool_calls"] = Value::Array(calls);
    }
    let mut v = json!({
        "id": meta.chat_id(),
        "object": "chat.completion",
        "created": meta.created,
        "model": meta.model,
        "choices": [{
            "index": 0,
            "message": message,
            "logprobs": null,
            "finish_reason": finish_reason(reply),
        }],
        "usage": usage,
        "system_fingerprint": "fp_graft_scripted",
    });
    if let Some(t) = tokens {
        let all: Vec<usize> = (0..t.completion.len()).collect();
        if t.want_logprobs {
            v["choices"][0]["logprobs"] = t.chat_logprobs(&all);
        }
        if t.want_ids {
            v["choices"][0]["token_ids"] = json!(t.completion);
            v["prompt_token_ids"] = json!(t.prompt);
        }
    }
    v
}

fn completion_json(
    meta: &Meta,
    reply: &Reply,
    usage: &Value,
    tokens: Option<&TokenAnswer>,
) -> Value {
    let mut v = json!({
        "id": meta.completion_id(),
        "object": "text_completion",
        "created": meta.created,
        "model": meta.model,
        "choices": [{
            "text": reply.content.as_deref().unwrap_or_default(),
            "index": 0,
            "logprobs": null,
            "finish_reason": finish_reason(reply),
        }],
        "usage": usage,
    });
    if let Some(t) = tokens {
        let all: Vec<usize> = (0..t.completion.len()).collect();
        if t.want_logprobs {
            v["choices"][0]["logprobs"] = t.completion_logprobs(&all, 0);
        }
        if t.want_ids {
            v["choices"][0]["prompt_token_ids"] = json!(t.prompt);
            v["choices"][0]["token_ids"] = json!(t.completion);
        }
    }
    v
}

/// One SSE event: `data: {json}\n\n`.
fn sse(v: &Value) -> Bytes {
    Bytes::from(format!("data: {v}\n\n"))
}

const DONE: &[u8] = b"data: [DONE]\n\n";

/// Splits text into word-sized deltas (each word keeps the whitespace before it), the way
/// a tokenizer-driven stream arrives. Concatenating the pieces gives back `text` exactly.
fn split_words(text: &str) -> Vec<&str> {
    let mut pieces = Vec::new();
    let mut start = 0;
    let mut in_word = false;
    for (i, ch) in text.char_indices() {
        if ch.is_whitespace() {
            if in_word {
                pieces.push(&text[start..i]);
                start = i;
                in_word = false;
            }
        } else {
            in_word = true;
        }
    }
    if start < text.len() {
        pieces.push(&text[start..]);
    }
    pieces
}

/// Splits a string into at most `n` non-empty pieces on char boundaries.
fn split_n(text: &str, n: usize) -> Vec<&str> {
    let chars = text.chars().count();
    if chars == 0 {
        return Vec::new();
    }
    let per = chars.div_ceil(n.max(1));
    let mut pieces = Vec::new();
    let mut start = 0;
    for (count, (i, _)) in text.char_indices().enumerate() {
        if count > 0 && count % per == 0 {
            pieces.push(&text[start..i]);
            start = i;
        }
    }
    pieces.push(&text[start..]);
    pieces
}

/// One chunk of a streamed answer before it is rendered: its delta (chat) or text piece,
/// its finish reason, and the text of the completion it stands for (what the model
/// generated, special tokens included; used to split the token ids along the chunks).
struct Piece {
    delta: Value,
    finish: Option<String>,
    text: String,
}

/// The chunks of a chat answer, in order. `eos` is the end-of-turn token the model ends
/// with (empty without a tokenizer).
fn chat_pieces(meta: &Meta, reply: &Reply, eos: &str) -> Vec<Piece> {
    let piece = |delta: Value, text: String| Piece {
        delta,
        finish: None,
        text,
    };
    let tool_header = |i: usize, call: &ScriptToolCall| {
        json!([{
            "index": i,
            "id": meta.tool_call_id(i),
            "type": "function",
            "function": {"name": call.name, "arguments": ""},
        }])
    };
    let content = reply.content.as_deref().unwrap_or_default();
    // The Hermes form of a tool call as Qwen3's template writes it in history: a newline
    // before it unless it opens the turn, the arguments verbatim, then `}` and the tag.
    let header_text = |i: usize, call: &ScriptToolCall| {
        format!(
            "{}<tool_call>\n{{\"name\": \"{}\", \"arguments\": ",
            if i > 0 || !content.is_empty() {
                "\n"
            } else {
                ""
            },
            call.name
        )
    };
    let mut out = Vec::new();
    let mut calls = reply.tool_calls.iter().enumerate().peekable();
    if content.is_empty() && calls.peek().is_some() {
        // Tool calls only: the role arrives with the first tool call's header, content null.
        if let Some((i, call)) = calls.next() {
            out.push(piece(
                json!({"role": "assistant", "content": null, "tool_calls": tool_header(i, call)}),
                header_text(i, call),
            ));
            push_arguments(&mut out, i, call);
        }
    } else {
        out.push(piece(
            json!({"role": "assistant", "content": "", "refusal": null}),
            String::new(),
        ));
        for p in split_words(content) {
            out.push(piece(json!({"content": p}), p.to_owned()));
        }
    }
    for (i, call) in calls {
        out.push(piece(
            json!({"tool_calls": tool_header(i, call)}),
            header_text(i, call),
        ));
        push_arguments(&mut out, i, call);
    }
    out.push(Piece {
        delta: json!({}),
        finish: Some(finish_reason(reply).to_owned()),
        text: eos.to_owned(),
    });
    out
}

/// The chat SSE stream exactly as OpenAI sends it: a first delta with the role, the content
/// in several deltas, each tool call's header (index, id, type, name, empty arguments)
/// followed by its arguments in pieces, a final chunk with `finish_reason`, a usage chunk
/// with `choices: []` iff `stream_options.include_usage`, then `[DONE]`. With `tokens`, as
/// vLLM streams `return_token_ids`/`logprobs`: `prompt_token_ids` on the first chunk, each
/// chunk's new `token_ids` and `logprobs` in its choice.
fn chat_events(
    meta: &Meta,
    reply: &Reply,
    usage: Option<&Value>,
    tokens: Option<&TokenAnswer>,
) -> Vec<Bytes> {
    let id = meta.chat_id();
    let pieces = chat_pieces(meta, reply, tokens.map_or("", |t| t.eos.as_str()));
    let split = tokens.map(|t| t.split(&pieces));
    let mut events = Vec::new();
    for (k, p) in pieces.iter().enumerate() {
        let mut c = json!({
            "id": id,
            "object": "chat.completion.chunk",
            "created": meta.created,
            "model": meta.model,
            "system_fingerprint": "fp_graft_scripted",
            "choices": [{"index": 0, "delta": p.delta, "logprobs": null, "finish_reason": p.finish}],
        });
        if usage.is_some() {
            // With include_usage every chunk carries `usage: null` but the last one.
            c["usage"] = Value::Null;
        }
        if let (Some(t), Some(split)) = (tokens, &split) {
            let idx = &split[k];
            if t.want_logprobs && !idx.is_empty() {
                c["choices"][0]["logprobs"] = t.chat_logprobs(idx);
            }
            if t.want_ids {
                c["choices"][0]["token_ids"] = json!(t.ids_of(idx));
                if k == 0 {
                    c["prompt_token_ids"] = json!(t.prompt);
                }
            }
        }
        events.push(sse(&c));
    }
    if let Some(usage) = usage {
        events.push(sse(&json!({
            "id": id,
            "object": "chat.completion.chunk",
            "created": meta.created,
            "model": meta.model,
            "system_fingerprint": "fp_graft_scripted",
            "choices": [],
            "usage": usage,
        })));
    }
    events.push(Bytes::from_static(DONE));
    events
}

fn push_arguments(out: &mut Vec<Piece>, index: usize, call: &ScriptToolCall) {
    let args = call.arguments_string();
    let pieces = split_n(&args, ARGUMENT_PIECES);
    let n = pieces.len();
    for (j, piece) in pieces.into_iter().enumerate() {
        let mut text = piece.to_owned();
        if j + 1 == n {
            text.push_str("}\n</tool_call>");
        }
        out.push(Piece {
            delta: json!({"tool_calls": [{"index": index, "function": {"arguments": piece}}]}),
            finish: None,
            text,
        });
    }
    if n == 0
        && let Some(last) = out.last_mut()
    {
        last.text.push_str("}\n</tool_call>");
    }
}

/// The pieces of a completions answer: the text in word-sized pieces, then the finish.
fn completion_pieces(reply: &Reply, eos: &str) -> Vec<Piece> {
    let mut out: Vec<Piece> = split_words(reply.content.as_deref().unwrap_or_default())
        .into_iter()
        .map(|p| Piece {
            delta: json!(p),
            finish: None,
            text: p.to_owned(),
        })
        .collect();
    out.push(Piece {
        delta: json!(""),
        finish: Some(finish_reason(reply).to_owned()),
        text: eos.to_owned(),
    });
    out
}

/// The completions SSE stream: `text_completion` chunks with the text in pieces, a final
/// chunk with `finish_reason`, the usage chunk iff `include_usage`, then `[DONE]`.
fn completion_events(
    meta: &Meta,
    reply: &Reply,
    usage: Option<&Value>,
    tokens: Option<&TokenAnswer>,
) -> Vec<Bytes> {
    let id = meta.completion_id();
    let pieces = completion_pieces(reply, tokens.map_or("", |t| t.eos.as_str()));
    let split = tokens.map(|t| t.split(&pieces));
    let mut events = Vec::new();
    let mut offset = 0;
    for (k, p) in pieces.iter().enumerate() {
        let mut c = json!({
            "id": id,
            "object": "text_completion",
            "created": meta.created,
            "model": meta.model,
            "choices": [{"text": p.delta, "index": 0, "logprobs": null, "finish_reason": p.finish}],
        });
        if usage.is_some() {
            c["usage"] = Value::Null;
        }
        if let (Some(t), Some(split)) = (tokens, &split) {
            let idx = &split[k];
            if t.want_logprobs && !idx.is_empty() {
                c["choices"][0]["logprobs"] = t.completion_logprobs(idx, offset);
            }
            if t.want_ids {
                c["choices"][0]["token_ids"] = json!(t.ids_of(idx));
                if k == 0 {
                    c["choices"][0]["prompt_token_ids"] = json!(t.prompt);
                }
            }
        }
        offset += p.delta.as_str().map_or(0, str::len);
        events.push(sse(&c));
    }
    if let Some(usage) = usage {
        events.push(sse(&json!({
            "id": id,
            "object": "text_completion",
            "created": meta.created,
            "model": meta.model,
            "choices": [],
            "usage": usage,
        })));
    }
    events.push(Bytes::from_static(DONE));
    events
}

// ---------------------------------------------------------------------------------------
// Token ids (`--tokenizer`)

/// A model's chat template and tokenizer, for answering like vLLM with token ids.
pub struct TokenModel {
    template: graft_reconstruct::template::ChatTemplate,
    tokenizer: graft_reconstruct::template::Tokenizer,
    /// The end-of-turn token every completion ends with (`<|im_end|>` for Qwen3).
    eos: String,
}

/// The deterministic logprob the scripted model reports for a token.
pub fn scripted_logprob(id: u32) -> f64 {
    -f64::from(id % 97) / 100.0
}

impl TokenModel {
    pub fn load(dir: &std::path::Path) -> anyhow::Result<Self> {
        let template = graft_reconstruct::template::ChatTemplate::from_dir(dir)
            .with_context(|| format!("cannot load the chat template from {}", dir.display()))?;
        let tokenizer = graft_reconstruct::template::Tokenizer::from_dir(dir)
            .with_context(|| format!("cannot load the tokenizer from {}", dir.display()))?;
        let eos = template.eos_token().unwrap_or_default().to_owned();
        Ok(TokenModel {
            template,
            tokenizer,
            eos,
        })
    }

    /// The prompt ids of a request: chat messages (+ tools) rendered with the generation
    /// prompt (as vLLM applies the template; `chat_template_kwargs` are passed on), or the
    /// completions prompt, tokenized.
    fn prompt_ids(&self, dialect: Dialect, body: &Value) -> Result<Vec<u32>, String> {
        let text = match dialect {
            Dialect::Chat => {
                let messages = graft_reconstruct::exact::template_messages(
                    body.get("messages")
                        .and_then(Value::as_array)
                        .map_or(&[][..], Vec::as_slice),
                );
                let tools = body
                    .get("tools")
                    .and_then(Value::as_array)
                    .filter(|t| !t.is_empty())
                    .map(Vec::as_slice);
                let extra = body
                    .get("chat_template_kwargs")
                    .and_then(Value::as_object)
                    .cloned()
                    .unwrap_or_default();
                self.template
                    .render(&messages, tools, true, &extra)
                    .map_err(|e| format!("cannot apply the chat template: {e}"))?
            }
            Dialect::Completions => match body.get("prompt") {
                Some(Value::Array(items)) if items.iter().all(Value::is_u64) => {
                    return Ok(items
                        .iter()
                        .filter_map(Value::as_u64)
                        .filter_map(|n| u32::try_from(n).ok())
                        .collect());
                }
                Some(Value::Array(items)) => items
                    .iter()
                    .filter_map(Value::as_str)
                    .collect::<Vec<_>>()
                    .join("\n"),
                Some(Value::String(p)) => p.clone(),
                _ => String::new(),
            },
        };
        self.tokenizer
            .encode(&text)
            .map_err(|e| format!("cannot tokenize the prompt: {e}"))
    }

    /// Tokenizes the prompt and the reply, and notes what the request asked for.
    fn answer(
        &self,
        dialect: Dialect,
        body: &Value,
        meta: &Meta,
        reply: &Reply,
    ) -> Result<TokenAnswer, String> {
        let prompt = self.prompt_ids(dialect, body)?;
        let pieces = match dialect {
            Dialect::Chat => chat_pieces(meta, reply, &self.eos),
            Dialect::Completions => completion_pieces(reply, &self.eos),
        };
        let text: String = pieces.iter().map(|p| p.text.as_str()).collect();
        let completion = self
            .tokenizer
            .encode(&text)
            .map_err(|e| format!("cannot tokenize the completion: {e}"))?;
        // Where each token's text ends in the completion text (decoding the prefix).
        let mut ends = Vec::with_capacity(completion.len());
        let mut tokens = Vec::with_capacity(completion.len());
        for i in 0..completion.len() {
            let prefix = self
                .tokenizer
                .decode(&completion[..=i])
                .map_err(|e| format!("cannot decode the completion: {e}"))?;
            ends.push(prefix.len());
            tokens.push(
                self.tokenizer
                    .decode(&completion[i..=i])
                    .map_err(|e| format!("cannot decode the completion: {e}"))?,
            );
        }
        let want_logprobs = match dialect {
            Dialect::Chat => body.get("logprobs").and_then(Value::as_bool) == Some(true),
            Dialect::Completions => body.get("logprobs").is_some_and(Value::is_u64),
        };
        Ok(TokenAnswer {
            eos: self.eos.clone(),
            prompt,
            completion,
            ends,
            tokens,
            want_ids: body.get("return_token_ids").and_then(Value::as_bool) == Some(true),
            want_logprobs,
        })
    }
}

/// One answer's tokens.
struct TokenAnswer {
    eos: String,
    prompt: Vec<u32>,
    completion: Vec<u32>,
    /// Byte offset in the completion text where each completion token's text ends.
    ends: Vec<usize>,
    /// Each completion token's text.
    tokens: Vec<String>,
    want_ids: bool,
    want_logprobs: bool,
}

impl TokenAnswer {
    fn usage(&self) -> Value {
        let (p, c) = (self.prompt.len(), self.completion.len());
        json!({"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c})
    }

    /// The completion tokens each piece carries: a token goes with the piece in which its
    /// text ends (the text of a chunk and its ids stay together; a token that straddles two
    /// pieces goes with the later one). Concatenated, the pieces' ids are the completion.
    fn split(&self, pieces: &[Piece]) -> Vec<Vec<usize>> {
        let mut out = vec![Vec::new(); pieces.len()];
        let mut bound = 0;
        let mut k = 0;
        for (i, end) in self.ends.iter().enumerate() {
            while k + 1 < pieces.len() && {
                let b = bound + pieces[k].text.len();
                *end > b
            } {
                bound += pieces[k].text.len();
                k += 1;
            }
            if let Some(slot) = out.get_mut(k) {
                slot.push(i);
            }
        }
        out
    }

    fn ids_of(&self, idx: &[usize]) -> Vec<u32> {
        idx.iter()
            .filter_map(|&i| self.completion.get(i).copied())
            .collect()
    }

    /// Chat logprobs (`{"content": [{token, logprob, bytes, top_logprobs}]}`).
    fn chat_logprobs(&self, idx: &[usize]) -> Value {
        let content: Vec<Value> = idx
            .iter()
            .filter_map(|&i| {
                let id = *self.completion.get(i)?;
                let tok = self.tokens.get(i)?;
                Some(json!({
                    "token": tok,
                    "logprob": scripted_logprob(id),
                    "bytes": tok.as_bytes(),
                    "top_logprobs": [],
                }))
            })
            .collect();
        json!({ "content": content })
    }

    /// Completions logprobs (parallel arrays), text offsets from `offset`.
    fn completion_logprobs(&self, idx: &[usize], offset: usize) -> Value {
        let mut tokens = vec![];
        let mut lps = vec![];
        let mut offsets = vec![];
        let mut at = offset;
        for &i in idx {
            let (Some(id), Some(tok)) = (self.completion.get(i), self.tokens.get(i)) else {
                continue;
            };
            tokens.push(json!(tok));
            lps.push(json!(scripted_logprob(*id)));
            offsets.push(json!(at));
            at += tok.len();
        }
        let top: Vec<Value> = tokens.iter().map(|_| json!({})).collect();
        json!({"tokens": tokens, "token_logprobs": lps, "top_logprobs": top, "text_offset": offsets})
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

    use super::*;

    fn meta() -> Meta {
        Meta {
            id: 7,
            created: 1_700_000_000,
            model: "m".to_owned(),
        }
    }

    /// Parses `data: ...\n\n` events; `None` stands for `[DONE]`.
    fn parse(events: &[Bytes]) -> Vec<Option<Value>> {
        events
            .iter()
            .map(|e| {
                let s = std::str::from_utf8(e).unwrap();
                let data = s
                    .strip_prefix("data: ")
                    .unwrap()
                    .strip_suffix("\n\n")
                    .unwrap();
                assert!(!data.contains('\n'), "one line per event: {data:?}");
                (data != "[DONE]").then(|| serde_json::from_str(data).unwrap())
            })
            .collect()
    }

    /// Assembles a chat stream the way the OpenAI SDK does.
    fn assemble(chunks: &[Option<Value>]) -> (String, Vec<(String, String, String)>, String) {
        let mut content = String::new();
        let mut calls: Vec<(String, String, String)> = Vec::new();
        let mut finish = String::new();
        for c in chunks.iter().flatten() {
            for choice in c["choices"].as_array().unwrap() {
                let delta = &choice["delta"];
                if let Some(t) = delta["content"].as_str() {
                    content.push_str(t);
                }
                for tc in delta["tool_calls"].as_array().into_iter().flatten() {
                    let i = tc["index"].as_u64().unwrap() as usize;
                    if i == calls.len() {
                        calls.push((
                            tc["id"].as_str().unwrap().to_owned(),
                            tc["function"]["name"].as_str().unwrap().to_owned(),
                            String::new(),
                        ));
                    }
                    if let Some(a) = tc["function"]["arguments"].as_str() {
                        calls[i].2.push_str(a);
                    }
                }
                if let Some(f) = choice["finish_reason"].as_str() {
                    finish = f.to_owned();
                }
            }
        }
        (content, calls, finish)
    }

    fn reply(content: Option<&str>, calls: &[(&str, Value)]) -> Reply {
        Reply {
            reasoning: None,
            content: content.map(str::to_owned),
            tool_calls: calls
                .iter()
                .map(|(n, a)| ScriptToolCall {
                    name: (*n).to_owned(),
                    arguments: a.clone(),
                })
                .collect(),
            finish_reason: None,
        }
    }

    #[test]
    fn content_streams_in_several_deltas_that_reassemble_exactly() {
        let text = "Hello there,  world!\nSecond line ";
        let events = parse(&chat_events(&meta(), &reply(Some(text), &[]), None, None));
        assert_eq!(events.last().unwrap(), &None, "ends with [DONE]");
        let first = events[0].as_ref().unwrap();
        assert_eq!(first["object"], "chat.completion.chunk");
        assert_eq!(first["choices"][0]["delta"]["role"], "assistant");
        let content_deltas = events
            .iter()
            .flatten()
            .filter(|c| {
                c["choices"][0]["delta"]["content"]
                    .as_str()
                    .is_some_and(|s| !s.is_empty())
            })
            .count();
        assert!(
            content_deltas >= 4,
            "content split into several deltas, got {content_deltas}"
        );
        let (content, calls, finish) = assemble(&events);
        assert_eq!(content, text);
        assert!(calls.is_empty());
        assert_eq!(finish, "stop");
        assert!(
            events.iter().flatten().all(|c| c.get("usage").is_none()),
            "no usage unless asked"
        );
    }

    #[test]
    fn tool_calls_stream_header_then_argument_pieces() {
        let args = json!({"command": "ls -la /workspace && echo done"});
        let r = reply(
            None,
            &[("bash", args.clone()), ("read", json!({"path": "a.txt"}))],
        );
        let events = parse(&chat_events(&meta(), &r, None, None));
        let first = events[0].as_ref().unwrap();
        let delta = &first["choices"][0]["delta"];
        assert_eq!(delta["role"], "assistant");
        assert_eq!(delta["content"], Value::Null);
        assert_eq!(delta["tool_calls"][0]["index"], 0);
        assert_eq!(delta["tool_calls"][0]["type"], "function");
        assert_eq!(delta["tool_calls"][0]["function"]["name"], "bash");
        assert_eq!(delta["tool_calls"][0]["function"]["arguments"], "");
        // Argument-only deltas carry neither id nor name.
        let arg_deltas: Vec<&Value> = events
            .iter()
            .flatten()
            .filter_map(|c| c["choices"][0]["delta"]["tool_calls"].get(0))
            .filter(|tc| tc.get("id").is_none())
            .collect();
        assert!(
            arg_deltas.len() >= 5,
            "arguments in several pieces: {arg_deltas:?}"
        );
        assert!(
            arg_deltas
                .iter()
                .all(|tc| tc["function"].get("name").is_none())
        );
        let (content, calls, finish) = assemble(&events);
        assert_eq!(content, "");
        assert_eq!(calls.len(), 2);
        assert_eq!(calls[0].1, "bash");
        assert_eq!(serde_json::from_str::<Value>(&calls[0].2).unwrap(), args);
        assert_eq!(calls[1].1, "read");
        assert_eq!(calls[1].2, r#"{"path":"a.txt"}"#);
        assert_ne!(calls[0].0, calls[1].0, "distinct tool call ids");
        assert_eq!(finish, "tool_calls");
    }

    #[test]
    fn content_and_tool_call_in_one_reply() {
        let r = reply(Some("Let me look."), &[("bash", json!({"command": "ls"}))]);
        let events = parse(&chat_events(&meta(), &r, None, None));
        let (content, calls, finish) = assemble(&events);
        assert_eq!(content, "Let me look.");
        assert_eq!(calls[0].2, r#"{"command":"ls"}"#);
        assert_eq!(finish, "tool_calls");
        assert_eq!(
            events[0].as_ref().unwrap()["choices"][0]["delta"]["content"],
            ""
        );
    }

    #[test]
    fn usage_chunk_has_empty_choices_and_comes_last_before_done() {
        let usage = json!({"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5});
        let events = parse(&chat_events(
            &meta(),
            &reply(Some("a b"), &[]),
            Some(&usage),
            None,
        ));
        let n = events.len();
        assert_eq!(events[n - 1], None);
        let last = events[n - 2].as_ref().unwrap();
        assert_eq!(last["choices"], json!([]));
        assert_eq!(last["usage"], usage);
        let fin = events[n - 3].as_ref().unwrap();
        assert_eq!(fin["choices"][0]["finish_reason"], "stop");
        assert_eq!(fin["usage"], Value::Null);
    }

    #[test]
    fn completion_stream_reassembles() {
        let usage = json!({"prompt_tokens": 1, "completion_tokens": 3, "total_tokens": 4});
        let events = parse(&completion_events(
            &meta(),
            &reply(Some("one two three"), &[]),
            Some(&usage),
            None,
        ));
        let text: String = events
            .iter()
            .flatten()
            .filter_map(|c| {
                c["choices"]
                    .get(0)
                    .and_then(|ch| ch["text"].as_str())
                    .map(str::to_owned)
            })
            .collect();
        assert_eq!(text, "one two three");
        assert!(
            events
                .iter()
                .flatten()
                .all(|c| c["object"] == "text_completion")
        );
        assert_eq!(
            events[events.len() - 2].as_ref().unwrap()["choices"],
            json!([])
        );
    }

    #[test]
    fn split_helpers_lose_nothing() {
        for s in ["", "a", " lead", "trail ", "x  y\tz\n", "héllo wörld ✓"] {
            assert_eq!(split_words(s).concat(), s);
            assert_eq!(split_n(s, 4).concat(), s);
            assert!(split_n(s, 4).len() <= 4);
        }
        assert_eq!(split_words("a b c"), vec!["a", " b", " c"]);
    }

    fn chat_prompt(body: Value) -> Prompt {
        Prompt::from_chat(&body).unwrap()
    }

    #[test]
    fn rules_match_last_message_text_count_and_tools() {
        let script = Script::parse(
            r#"{"rules":[
                {"match":"DONE","role":"tool","reply":{"content":"finished"}},
                {"messages":2,"tools":true,"reply":{"tool_calls":[{"name":"bash","arguments":{"command":"ls"}}]}},
                {"match":"hello","reply":{"content":"hi"}}
            ]}"#,
        )
        .unwrap();
        let p = chat_prompt(json!({"model":"m","messages":[
            {"role":"system","content":"sys"},
            {"role":"user","content":[{"type":"text","text":"say"},{"type":"text","text":"hello"}]}
        ]}));
        assert_eq!(p.last_text, "say\nhello");
        assert_eq!(script.reply_for(&p).unwrap().content.as_deref(), Some("hi"));

        let p = chat_prompt(
            json!({"model":"m","tools":[{"type":"function"}],"messages":[
                {"role":"system","content":"sys"},{"role":"user","content":"hello"}
            ]}),
        );
        assert_eq!(script.reply_for(&p).unwrap().tool_calls[0].name, "bash");

        let p = chat_prompt(json!({"model":"m","messages":[
            {"role":"user","content":"do it"},
            {"role":"assistant","content":null,"tool_calls":[]},
            {"role":"tool","tool_call_id":"x","content":"DONE here"}
        ]}));
        assert_eq!(
            script.reply_for(&p).unwrap().content.as_deref(),
            Some("finished")
        );
        assert_eq!(p.last_user_text, "do it");

        let p = chat_prompt(json!({"model":"m","messages":[{"role":"user","content":"nothing"}]}));
        assert!(script.reply_for(&p).is_none());
    }

    #[test]
    fn script_with_an_unknown_key_is_rejected() {
        assert!(Script::parse(r#"{"rules":[{"matches":"x","reply":{}}]}"#).is_err());
    }

    #[test]
    fn usage_counts_words() {
        let p = chat_prompt(json!({"model":"m","messages":[
            {"role":"system","content":"you are helpful"},{"role":"user","content":"two words"}
        ]}));
        let u = usage_for(&p, &reply(Some("a b c"), &[]));
        assert_eq!(
            u,
            json!({"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8})
        );
    }

    #[tokio::test]
    async fn reset_body_errors_after_two_chunks() {
        let events = chat_events(&meta(), &reply(Some("a b c d e"), &[]), None, None);
        let mut body = SseBody::new(events, Duration::ZERO, Some(2));
        let mut got = 0;
        loop {
            match body.frame().await {
                Some(Ok(_)) => got += 1,
                Some(Err(_)) => break,
                None => panic!("stream ended cleanly; a reset must end in an error"),
            }
        }
        assert_eq!(got, 2);
    }

    #[tokio::test]
    async fn body_yields_one_frame_per_event_in_order() {
        let events = chat_events(&meta(), &reply(Some("a b"), &[]), None, None);
        let expected = events.clone();
        let mut body = SseBody::new(events, Duration::from_millis(1), None);
        let mut got = Vec::new();
        while let Some(frame) = body.frame().await {
            got.push(frame.unwrap().into_data().unwrap());
        }
        assert_eq!(got, expected);
        assert!(body.is_end_stream());
    }
}

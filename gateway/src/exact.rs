//! Exact mode: graft owns the tokens. A call in any dialect becomes a conversation, graft
//! renders it with the model's own chat template and tokenizes it (reusing the session's
//! earlier prompt and sampled ids verbatim when the call extends an earlier one, see
//! `graft_reconstruct::exact`), calls the backend's SGLang-native `POST /generate` with
//! `input_ids`, then decodes and parses the output ids (text, reasoning, tool calls) and
//! answers in the client's dialect, streaming as ids arrive. The record holds the prompt ids,
//! the completion ids and their logprobs, the finish reason and the backend's
//! `weight_version`.
//!
//! A session is pinned to one backend (its first call picks the one with the fewest
//! sessions), so the backend's prefix cache keeps serving it. `pause` holds new calls before
//! they reach a backend (one backend, or all) and returns once the calls in flight there are
//! done; `resume` lets them go (weight updates happen in between: nothing is aborted).

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use graft_reconstruct::exact::{
    Detokenizer, Prompt, PromptBuilder, PromptKind, Turn, answer_message, template_messages,
};
use graft_reconstruct::parser::{OutputParser, Piece, ReasoningFormat, ToolCallFormat};
use graft_reconstruct::retokenize::Model;
use http::{HeaderMap, Method, Request, Response, StatusCode, header};
use http_body_util::Full;
use hyper::body::Incoming;
use serde_json::Value;
use tokio::sync::{OwnedRwLockWriteGuard, RwLock, mpsc};
use tracing::{Instrument, info, info_span, warn};

use crate::body::GBody;
use crate::config::ExactConfig;
use crate::dialect::{
    Answer, Conversation, Delta, Finish, StreamEmitter, TokenUsage, ToolCall, anthropic, chat,
    responses,
};
use crate::error::GatewayError;
use crate::proxy::{
    Call, Next, Outcome, Route, UpstreamEvents, close_stream, collect_upstream, snippet,
};
use crate::server::State;
use crate::sessions::{Session, now_us};
use crate::sglang::{self, FinishReason, Progress};
use crate::token_ids::Recorded;
use crate::upstream::{HttpClient, error_chain, http_client};

/// The upstream wire label exact-mode records carry.
pub const WIRE: &str = "sglang_generate";

#[derive(Debug, thiserror::Error)]
pub enum ExactSetupError {
    #[error("exact mode cannot load the model's tokenizer and chat template from {dir}: {message}")]
    Model { dir: String, message: String },
    #[error(transparent)]
    Gateway(#[from] GatewayError),
}

#[derive(Default)]
struct SessionTokens {
    backend: usize,
    /// Most recent first.
    turns: VecDeque<Arc<Turn>>,
    /// Ids held by `turns`.
    held: usize,
    /// When the session was last used (a counter).
    last_used: u64,
}

/// Every session's recent calls, within a budget of ids held in all.
#[derive(Default)]
struct Histories {
    map: HashMap<String, SessionTokens>,
    held: usize,
    clock: u64,
}

impl Histories {
    /// Drops the token histories of the least recently used sessions (their backend pin
    /// stays) until at most `budget` ids are held. Their next call is tokenized in full.
    fn evict(&mut self, budget: usize) -> usize {
        let mut evicted = 0;
        while self.held > budget {
            let Some((_, s)) = self
                .map
                .iter_mut()
                .filter(|(_, s)| s.held > 0)
                .min_by_key(|(_, s)| s.last_used)
            else {
                break;
            };
            self.held -= s.held;
            s.held = 0;
            s.turns.clear();
            evicted += 1;
        }
        evicted
    }
}

/// Exact mode's state: the model's template and tokenizer, the backends, each session's
/// recent calls, and the pause gate.
pub struct Exact {
    builder: Arc<PromptBuilder>,
    tool_format: ToolCallFormat,
    reasoning_format: ReasoningFormat,
    backends: Vec<String>,
    pinned: Mutex<Vec<usize>>,
    client: HttpClient,
    timeout: Duration,
    max_new_tokens: u64,
    history: usize,
    history_budget: usize,
    sessions: Mutex<Histories>,
    /// One gate per backend: a call holds its backend's for reading while the backend has
    /// it; a pause takes it for writing.
    gates: Vec<Arc<RwLock<()>>>,
    paused: tokio::sync::Mutex<Vec<Option<OwnedRwLockWriteGuard<()>>>>,
}

impl Exact {
    pub fn new(
        cfg: &ExactConfig,
        timeout: Duration,
        connect_timeout: Duration,
        ca_file: Option<&std::path::Path>,
    ) -> Result<Self, ExactSetupError> {
        let mut model = Model::from_dir(&cfg.model_dir).map_err(|e| ExactSetupError::Model {
            dir: cfg.model_dir.display().to_string(),
            message: e.to_string(),
        })?;
        model.extra = cfg.template_kwargs.clone();
        Ok(Exact {
            builder: Arc::new(PromptBuilder::new(model)),
            tool_format: cfg.tool_call_format,
            reasoning_format: cfg.reasoning_format,
            pinned: Mutex::new(vec![0; cfg.backends.len()]),
            backends: cfg.backends.clone(),
            client: http_client(connect_timeout, ca_file)?,
            timeout,
            max_new_tokens: cfg.max_new_tokens,
            history: cfg.history_per_session,
            history_budget: cfg.history_max_tokens,
            sessions: Mutex::new(Histories::default()),
            gates: cfg
                .backends
                .iter()
                .map(|_| Arc::new(RwLock::new(())))
                .collect(),
            paused: tokio::sync::Mutex::new(cfg.backends.iter().map(|_| None).collect()),
        })
    }

    pub fn backends(&self) -> &[String] {
        &self.backends
    }

    /// The session's backend (pinning it on first use) and its recent calls.
    fn session(&self, id: &str) -> (usize, Vec<Arc<Turn>>) {
        let Ok(mut h) = self.sessions.lock() else {
            return (0, vec![]);
        };
        h.clock += 1;
        let now = h.clock;
        if let Some(s) = h.map.get_mut(id) {
            s.last_used = now;
            return (s.backend, s.turns.iter().cloned().collect());
        }
        let backend = match self.pinned.lock() {
            Ok(mut counts) => {
                let (i, _) = counts
                    .iter()
                    .enumerate()
                    .min_by_key(|(_, n)| **n)
                    .unwrap_or((0, &0));
                if let Some(c) = counts.get_mut(i) {
                    *c += 1;
                }
                i
            }
            Err(_) => 0,
        };
        h.map.insert(
            id.to_string(),
            SessionTokens {
                backend,
                last_used: now,
                ..Default::default()
            },
        );
        (backend, vec![])
    }

    fn remember(&self, id: &str, turn: Turn) {
        let Ok(mut h) = self.sessions.lock() else {
            return;
        };
        let Some(s) = h.map.get_mut(id) else {
            return;
        };
        s.turns.push_front(Arc::new(turn));
        s.turns.truncate(self.history);
        let before = s.held;
        s.held = s.turns.iter().map(|t| t.tokens.len()).sum();
        let after = s.held;
        h.held = h.held.saturating_sub(before) + after;
        let evicted = h.evict(self.history_budget);
        if evicted > 0 {
            info!(
                evicted,
                budget = self.history_budget,
                "exact mode: token histories of the least recently used sessions dropped (exact.history_max_tokens); their next calls are tokenized in full"
            );
        }
    }

    /// A closed session's tokens are dropped.
    pub fn forget(&self, id: &str) {
        let removed = self.sessions.lock().ok().and_then(|mut h| {
            let s = h.map.remove(id)?;
            h.held = h.held.saturating_sub(s.held);
            Some(s)
        });
        if let (Some(s), Ok(mut counts)) = (removed, self.pinned.lock())
            && let Some(c) = counts.get_mut(s.backend)
        {
            *c = c.saturating_sub(1);
        }
    }

    /// Ids held in all sessions' histories.
    pub fn held_tokens(&self) -> usize {
        self.sessions.lock().map(|h| h.held).unwrap_or(0)
    }

    /// The index of a configured backend, by its URL (a trailing `/` ignored).
    pub fn backend_index(&self, url: &str) -> Option<usize> {
        let url = url.trim_end_matches('/');
        self.backends
            .iter()
            .position(|b| b.trim_end_matches('/') == url)
    }

    /// Holds new calls to `backend` (every backend when None) and waits until its calls in
    /// flight are done. Calls pinned to other backends go on. Returns how long that took.
    pub async fn pause(&self, backend: Option<usize>) -> Duration {
        let t = Instant::now();
        let mut paused = self.paused.lock().await;
        for (i, slot) in paused.iter_mut().enumerate() {
            if backend.is_none_or(|b| b == i)
                && slot.is_none()
                && let Some(gate) = self.gates.get(i)
            {
                *slot = Some(gate.clone().write_owned().await);
            }
        }
        t.elapsed()
    }

    /// Lets held calls to `backend` (every backend when None) go. Returns whether any of
    /// them was paused.
    pub async fn resume(&self, backend: Option<usize>) -> bool {
        let mut paused = self.paused.lock().await;
        let mut was = false;
        for (i, slot) in paused.iter_mut().enumerate() {
            if backend.is_none_or(|b| b == i) {
                was |= slot.take().is_some();
            }
        }
        was
    }

    /// The backends now paused.
    pub async fn paused_backends(&self) -> Vec<String> {
        let paused = self.paused.lock().await;
        self.backends
            .iter()
            .zip(paused.iter())
            .filter(|(_, p)| p.is_some())
            .map(|(b, _)| b.clone())
            .collect()
    }

    fn parser(&self, call_id: &str, starts_in_reasoning: bool, tools: &[Value]) -> OutputParser {
        let short: String = call_id
            .chars()
            .filter(char::is_ascii_hexdigit)
            .rev()
            .take(12)
            .collect();
        OutputParser::new(self.tool_format, self.reasoning_format, starts_in_reasoning)
            .with_schemas(tools)
            .with_id_prefix(format!("call_{short}_"))
    }
}

/// Handles one call in exact mode.
pub(crate) async fn handle(
    state: Arc<State>,
    route: Route,
    session: Arc<Session>,
    headers: HeaderMap,
    request: Value,
    t0: Instant,
) -> Result<Response<GBody>, GatewayError> {
    let Some(ex) = state.exact.as_ref() else {
        return Err(GatewayError::Internal("exact mode is not set up".into()));
    };
    let conv = match route {
        Route::ChatCompletions => chat::parse_request(&request)?,
        Route::Responses => responses::parse_request(&request)?,
        Route::Messages => anthropic::parse_request(&request)?,
        Route::Completions | Route::Models => {
            return Err(GatewayError::field(
                "prompt",
                "exact mode serves chat conversations (/v1/chat/completions, /v1/responses, /v1/messages); /v1/completions takes raw text, which graft cannot pair with a chat template: use passthrough mode for it",
            ));
        }
    };
    if let Some(n) = request.get("n").and_then(Value::as_u64)
        && n > 1
    {
        return Err(GatewayError::field(
            "n",
            format!(
                "exact mode samples one choice per call ('n' is {n}); send {n} calls in the same group instead"
            ),
        ));
    }
    let (chat_req, notes) = chat::to_request(&conv);
    let mut conv = conv;
    conv.notes.extend(notes);
    let messages = template_messages(
        chat_req
            .get("messages")
            .and_then(Value::as_array)
            .map_or(&[][..], Vec::as_slice),
    );
    let tools: Option<Vec<Value>> = chat_req
        .get("tools")
        .and_then(Value::as_array)
        .filter(|t| !t.is_empty())
        .cloned();
    let (backend_index, history) = ex.session(&session.id);
    let backend = ex
        .backends
        .get(backend_index)
        .cloned()
        .ok_or_else(|| GatewayError::Internal("no exact-mode backend configured".into()))?;

    // Rendering and tokenizing is CPU work: off the reactor.
    let builder = ex.builder.clone();
    let (msgs, tls) = (messages.clone(), tools.clone());
    let t_render = Instant::now();
    let prompt =
        tokio::task::spawn_blocking(move || builder.prompt(&msgs, tls.as_deref(), &history))
            .await
            .map_err(|e| GatewayError::Internal(format!("the prompt task failed: {e}")))?
            .map_err(|e| {
                GatewayError::field(
                    "messages",
                    format!("the model's chat template cannot render this conversation: {e}"),
                )
            })?;
    let render_time = t_render.elapsed();
    state.metrics.observe_exact_prompt(
        matches!(prompt.kind, PromptKind::Reused { .. }),
        render_time,
    );

    let params = sglang::sampling_params(&conv.sampling, ex.max_new_tokens);
    let body = sglang::generate_body(&prompt.ids, params, conv.stream);
    let mut recorded_body = body.clone();
    if let Some(o) = recorded_body.as_object_mut() {
        // The ids are the record's prompt_token_ids; the body keeps what else was sent.
        o.remove("input_ids");
        o.insert(
            "graft_prompt".into(),
            serde_json::json!({
                "tokens": prompt.ids.len(),
                "reused_tokens": match prompt.kind { PromptKind::Reused { reused } => reused, PromptKind::Full => 0 },
                "render_ms": render_time.as_secs_f64() * 1e3,
            }),
        );
    }
    let call = Call {
        call_id: uuid::Uuid::now_v7().to_string(),
        client: headers
            .get(header::USER_AGENT)
            .and_then(|v| v.to_str().ok())
            .map(str::to_string),
        started_at_us: now_us(),
        state: state.clone(),
        session,
        route,
        model: Some(conv.model.clone()),
        stream: conv.stream,
        request,
        t0,
        normalized_request: serde_json::to_value(&conv).ok(),
        upstream_request: Some(recorded_body),
        upstream_dialect: Some(WIRE),
        backend: Some(backend.clone()),
        response_id: match route {
            Route::Messages => crate::dialect::new_id("msg_"),
            Route::ChatCompletions => crate::dialect::new_id("chatcmpl-"),
            _ => crate::dialect::new_id("resp_"),
        },
        token_ids: None,
    };
    let include_usage = call
        .request
        .pointer("/stream_options/include_usage")
        .and_then(Value::as_bool)
        .unwrap_or(false);
    let job = Job {
        conv,
        messages,
        tools,
        prompt,
        include_usage,
        created: now_us() / 1_000_000,
    };
    let gate_lock = ex
        .gates
        .get(backend_index)
        .cloned()
        .ok_or_else(|| GatewayError::Internal("no exact-mode backend configured".into()))?;
    let client = ex.client.clone();
    let timeout = ex.timeout;
    let span = info_span!("call", call_id = %call.call_id, session = %call.session.id, route = route.label(), stream = call.stream, mode = "exact");
    async move {
        let permit = state.limits.upstream_permit().await?;
        // Held until the backend is done with this call; `pause` waits for it.
        let gate = gate_lock.read_owned().await;
        state.metrics.upstream_inflight.inc();
        let t_up = Instant::now();
        let sent = send(&client, timeout, &backend, &body).await;
        let resp = match sent {
            Ok(r) => r,
            Err(e) => {
                state.metrics.upstream_inflight.dec();
                drop((gate, permit));
                let o = Outcome {
                    upstream_time: t_up.elapsed(),
                    ..Default::default()
                };
                return Err(call.fail(o, e).await);
            }
        };
        let status = resp.status();
        if !status.is_success() {
            let bytes = collect_upstream(&call, resp).await.unwrap_or_default();
            state.metrics.upstream_inflight.dec();
            drop((gate, permit));
            let detail = crate::proxy::upstream_message(&bytes);
            let e = if status.is_client_error() {
                GatewayError::UpstreamRefused {
                    upstream: backend.clone(),
                    status: status.as_u16(),
                    detail,
                }
            } else {
                GatewayError::UpstreamStatus {
                    upstream: backend.clone(),
                    status: status.as_u16(),
                    detail,
                }
            };
            let o = Outcome {
                upstream_time: t_up.elapsed(),
                ..Default::default()
            };
            return Err(call.fail(o, e).await);
        }
        if call.stream {
            let (tx, out) = call.sse_response();
            tokio::spawn(
                async move {
                    pump(call, job, resp.into_body(), tx, t_up).await;
                    state.metrics.upstream_inflight.dec();
                    drop((gate, permit));
                }
                .in_current_span(),
            );
            return Ok(out);
        }
        let result = whole(&call, job, &backend, resp, t_up).await;
        state.metrics.upstream_inflight.dec();
        drop((gate, permit));
        result
    }
    .instrument(span)
    .await
}

/// What a call needs after the backend answered.
struct Job {
    conv: Conversation,
    messages: Vec<Value>,
    tools: Option<Vec<Value>>,
    prompt: Prompt,
    include_usage: bool,
    created: i64,
}

async fn send(
    client: &HttpClient,
    timeout: Duration,
    backend: &str,
    body: &Value,
) -> Result<Response<Incoming>, GatewayError> {
    let url = format!("{backend}/generate");
    let req = Request::builder()
        .method(Method::POST)
        .uri(&url)
        .header(header::CONTENT_TYPE, "application/json")
        .body(Full::new(Bytes::from(body.to_string())))
        .map_err(|e| GatewayError::Internal(format!("cannot build the request to {url}: {e}")))?;
    match tokio::time::timeout(timeout, client.request(req)).await {
        Ok(Ok(r)) => Ok(r),
        Ok(Err(e)) => Err(GatewayError::UpstreamUnreachable {
            upstream: backend.to_string(),
            detail: error_chain(&e),
        }),
        Err(_) => Err(GatewayError::UpstreamTimeout {
            upstream: backend.to_string(),
            secs: timeout.as_secs(),
        }),
    }
}

/// Output ids → text → parsed pieces, as they arrive.
struct Decoder {
    builder: Arc<PromptBuilder>,
    detok: Detokenizer,
    parser: OutputParser,
}

impl Decoder {
    fn new(ex: &Exact, call: &Call, job: &Job) -> Self {
        Decoder {
            builder: ex.builder.clone(),
            detok: Detokenizer::new(),
            parser: ex.parser(
                &call.call_id,
                job.prompt.starts_in_reasoning,
                job.tools.as_deref().unwrap_or(&[]),
            ),
        }
    }

    fn push(&mut self, ids: &[u32]) -> Result<Vec<Delta>, String> {
        let text = self
            .detok
            .push(&self.builder.model().tokenizer, ids)
            .map_err(|e| e.to_string())?;
        Ok(deltas(self.parser.push(&text)))
    }

    fn finish(&mut self) -> Result<Vec<Delta>, String> {
        let text = self
            .detok
            .finish(&self.builder.model().tokenizer)
            .map_err(|e| e.to_string())?;
        let mut out = deltas(self.parser.push(&text));
        out.extend(deltas(self.parser.finish()));
        Ok(out)
    }
}

fn deltas(pieces: Vec<Piece>) -> Vec<Delta> {
    pieces
        .into_iter()
        .map(|p| match p {
            Piece::Text(t) => Delta::Text(t),
            Piece::Reasoning(r) => Delta::Reasoning(r),
            Piece::ToolCallStart { index, id, name } => Delta::ToolCallStart { index, id, name },
            Piece::ToolCallArgs { index, arguments } => Delta::ToolCallArgs { index, arguments },
        })
        .collect()
}

/// The answer from what was parsed and what the backend reported.
fn answer(call: &Call, job: &Job, dec: &Decoder, p: &Progress) -> Answer {
    let parsed = dec.parser.parsed();
    for n in &parsed.notes {
        warn!(call_id = %call.call_id, "exact mode: the model's output: {n}");
    }
    let tool_calls: Vec<ToolCall> = parsed
        .tool_calls
        .iter()
        .map(|t| ToolCall {
            id: t.id.clone(),
            name: t.name.clone(),
            arguments: t.arguments.clone(),
        })
        .collect();
    let mut finish = p
        .finish
        .as_ref()
        .map_or(Finish::Error, FinishReason::finish);
    if finish == Finish::Stop && !tool_calls.is_empty() {
        finish = Finish::ToolCalls;
    }
    Answer {
        id: call.response_id.clone(),
        model: job.conv.model.clone(),
        created: job.created,
        text: parsed.text,
        reasoning: parsed.reasoning,
        tool_calls,
        finish,
        usage: Some(TokenUsage {
            input_tokens: job.prompt.ids.len() as u64,
            output_tokens: p.output_ids.len() as u64,
            cached_tokens: p.cached_tokens.unwrap_or(0),
            reasoning_tokens: 0,
        }),
    }
}

fn render(call: &Call, job: &Job, a: &Answer) -> Value {
    match call.route {
        Route::Messages => anthropic::render_answer(&job.conv, a, &call.response_id),
        Route::Responses => responses::render_answer(&job.conv, a, &call.response_id),
        _ => chat::render_answer(a, &call.response_id),
    }
}

fn emitter(call: &Call, job: &Job) -> Box<dyn StreamEmitter> {
    match call.route {
        Route::Messages => Box::new(anthropic::stream(&job.conv, &call.response_id)),
        Route::Responses => Box::new(responses::stream(&job.conv, &call.response_id)),
        _ => Box::new(chat::stream(
            &job.conv.model,
            &call.response_id,
            job.created,
            job.include_usage,
        )),
    }
}

fn finish_label(p: &Progress) -> Option<String> {
    p.finish.as_ref().map(|f| match f {
        FinishReason::Stop => "stop".to_string(),
        FinishReason::Length => "length".to_string(),
        FinishReason::Abort(_) => "abort".to_string(),
    })
}

/// Fills the record's token fields and, for a complete answer, remembers the call for the
/// session's next prompt.
fn settle(call: &Call, job: Job, p: &Progress, a: &Answer, o: &mut Outcome, ok: bool) {
    o.tokens = Recorded {
        prompt_token_ids: Some(job.prompt.ids.clone()),
        completion_token_ids: Some(p.output_ids.clone()),
        completion_logprobs: p.aligned_logprobs(),
    };
    if p.aligned_logprobs().is_none() && !p.output_ids.is_empty() {
        warn!(call_id = %call.call_id, ids = p.output_ids.len(), logprobs = p.logprobs.len(), "exact mode: the backend sent logprobs for another number of tokens than it sampled; the record keeps the ids without logprobs");
    }
    o.weight_version = p.weight_version.clone();
    o.finish_reason = finish_label(p);
    o.normalized_response = serde_json::to_value(a).ok();
    if !ok {
        return;
    }
    let Some(ex) = call.state.exact.as_ref() else {
        return;
    };
    let calls: Vec<(String, String, String)> = a
        .tool_calls
        .iter()
        .map(|t| (t.id.clone(), t.name.clone(), t.arguments.clone()))
        .collect();
    let mut tokens = job.prompt.ids;
    tokens.extend_from_slice(&p.output_ids);
    ex.remember(
        &call.session.id,
        Turn {
            messages: job.messages,
            tools: job.tools,
            answer: answer_message(&a.text, a.reasoning.as_deref(), &calls),
            tokens,
        },
    );
}

/// A whole (non-streamed) answer.
async fn whole(
    call: &Call,
    job: Job,
    backend: &str,
    resp: Response<Incoming>,
    t_up: Instant,
) -> Result<Response<GBody>, GatewayError> {
    let Some(ex) = call.state.exact.as_ref() else {
        return Err(GatewayError::Internal("exact mode is not set up".into()));
    };
    let bytes = collect_upstream(call, resp).await;
    let mut o = Outcome {
        status: StatusCode::OK.as_u16(),
        upstream_time: t_up.elapsed(),
        ..Default::default()
    };
    let invalid = |detail: String| GatewayError::UpstreamInvalid {
        upstream: backend.to_string(),
        detail,
    };
    let bytes = match bytes {
        Ok(b) => b,
        Err(e) => return Err(call.fail(o, e).await),
    };
    let v: Value = match serde_json::from_slice(&bytes) {
        Ok(v) => v,
        Err(e) => {
            let e = invalid(format!(
                "the /generate answer is not JSON ({e}): {}",
                snippet(&bytes)
            ));
            return Err(call.fail(o, e).await);
        }
    };
    let mut p = Progress::default();
    let mut dec = Decoder::new(ex, call, &job);
    let decoded = p
        .push(&v)
        .map_err(|d| invalid(format!("the /generate answer cannot be read: {d}")))
        .and_then(|ids| {
            let mut d = dec.push(&ids).map_err(|m| invalid(m.clone()))?;
            d.extend(dec.finish().map_err(invalid)?);
            Ok(d)
        });
    if let Err(e) = decoded {
        return Err(call.fail(o, e).await);
    }
    let a = answer(call, &job, &dec, &p);
    if let Some(FinishReason::Abort(m)) = &p.finish {
        let e = GatewayError::UpstreamStream {
            upstream: backend.to_string(),
            detail: format!("the backend aborted the generation: {m}"),
        };
        settle(call, job, &p, &a, &mut o, false);
        return Err(call.fail(o, e).await);
    }
    let rendered = render(call, &job, &a);
    settle(call, job, &p, &a, &mut o, true);
    o.response = Some(rendered);
    call.answer_json(&o).await
}

/// A streamed answer: each backend event's new ids are decoded and parsed, and whatever is
/// certain goes to the client at once in its dialect. The closing events wait for the record.
async fn pump(call: Call, job: Job, body: Incoming, tx: mpsc::Sender<Bytes>, t_up: Instant) {
    let Some(ex) = call.state.exact.as_ref() else {
        return;
    };
    let mut up = UpstreamEvents::new(&call, body);
    let upstream = call.backend.clone().unwrap_or_default();
    let mut em = emitter(&call, &job);
    let mut dec = Decoder::new(ex, &call, &job);
    let mut p = Progress::default();
    let mut o = Outcome {
        status: StatusCode::OK.as_u16(),
        ..Default::default()
    };
    let mut client_gone = false;
    for b in em.start() {
        if tx.send(b).await.is_err() {
            client_gone = true;
        }
    }
    let invalid = |detail: String| GatewayError::UpstreamInvalid {
        upstream: upstream.clone(),
        detail,
    };
    'read: while !client_gone {
        let ev = match up.next(&tx).await {
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
        if ev.is_done() {
            continue;
        }
        let Some(data) = ev.data.as_deref() else {
            continue;
        };
        let v = match up.json(data) {
            Ok(v) => v,
            Err(e) => {
                o.error = Some(e);
                break;
            }
        };
        if let Some(err) = v.get("error").filter(|e| !e.is_null()) {
            o.error = Some(GatewayError::UpstreamStream {
                upstream: upstream.clone(),
                detail: format!("the backend sent an error event: {err}"),
            });
            break;
        }
        let new = match p.push(&v) {
            Ok(ids) => ids,
            Err(d) => {
                o.error = Some(invalid(format!("a /generate event cannot be read: {d}")));
                break;
            }
        };
        if o.ttft.is_none() && !new.is_empty() {
            o.ttft = Some(call.t0.elapsed());
        }
        let ds = match dec.push(&new) {
            Ok(d) => d,
            Err(m) => {
                o.error = Some(invalid(m));
                break;
            }
        };
        for d in ds {
            for b in em.push(&d) {
                if tx.send(b).await.is_err() {
                    client_gone = true;
                    break 'read;
                }
            }
        }
    }
    if o.error.is_none() && !client_gone {
        match dec.finish() {
            Ok(ds) => {
                for d in ds {
                    for b in em.push(&d) {
                        if tx.send(b).await.is_err() {
                            client_gone = true;
                        }
                    }
                }
            }
            Err(m) => o.error = Some(invalid(m)),
        }
    }
    if o.error.is_none() && !client_gone {
        match &p.finish {
            None => {
                o.error = Some(GatewayError::UpstreamStream {
                    upstream: upstream.clone(),
                    detail: format!(
                        "the stream ended after {} events without a finish_reason",
                        up.events
                    ),
                });
            }
            Some(FinishReason::Abort(m)) => {
                o.error = Some(GatewayError::UpstreamStream {
                    upstream: upstream.clone(),
                    detail: format!("the backend aborted the generation: {m}"),
                });
            }
            Some(_) => {}
        }
    }
    o.upstream_time = t_up.elapsed();
    let a = answer(&call, &job, &dec, &p);
    o.response = Some(render(&call, &job, &a));
    let ok = o.error.is_none() && !client_gone;
    let last = if ok { em.finish(&a) } else { vec![] };
    settle(&call, job, &p, &a, &mut o, ok);
    if ok {
        info!(tokens = p.output_ids.len(), "exact stream done");
    }
    close_stream(&call, &o, client_gone, &tx, last).await;
}

#[cfg(test)]
mod tests {
    use super::*;

    fn turn(n: usize) -> Arc<Turn> {
        Arc::new(Turn {
            messages: vec![],
            tools: None,
            answer: Value::Null,
            tokens: vec![1; n],
        })
    }

    #[test]
    fn eviction_drops_the_least_recently_used_histories_first() {
        let mut h = Histories::default();
        for (i, id) in ["a", "b", "c"].iter().enumerate() {
            h.map.insert(
                id.to_string(),
                SessionTokens {
                    backend: 0,
                    turns: VecDeque::from([turn(100)]),
                    held: 100,
                    last_used: i as u64,
                },
            );
        }
        h.held = 300;
        // "a" is used again: "b" is now the oldest.
        if let Some(a) = h.map.get_mut("a") {
            a.last_used = 10;
        }
        assert_eq!(h.evict(250), 1);
        assert_eq!(h.held, 200);
        assert!(h.map["b"].turns.is_empty() && h.map["b"].held == 0);
        assert_eq!(h.map["a"].held, 100);
        assert_eq!(h.evict(50), 2);
        assert_eq!(h.held, 0);
        // Pins stay: the sessions are still known.
        assert_eq!(h.map.len(), 3);
        assert_eq!(h.evict(0), 0);
    }
}

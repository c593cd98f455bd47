//! Exact mode: graft owns the tokens. A call in any dialect becomes a conversation, graft
//! renders it with the model's own chat template and tokenizes it (reusing the session's
//! earlier prompt and sampled ids verbatim when the call extends an earlier one, see
//! `graft_reconstruct::exact`), calls the backend's SGLang-native `POST /generate` with
//! `input_ids`, then decodes and parses the output ids (text, reasoning, tool calls) into
//! deltas the client dialect's emitter writes, as ids arrive. The record holds the prompt
//! ids, the completion ids and their logprobs, the finish reason and the backend's
//! `weight_version`.
//!
//! A session is pinned to one backend (its first call picks the configured one with the
//! fewest sessions, unless the session named its own backend at creation: a trainer's own
//! server, added to the gateway's list then), so the backend's prefix cache keeps serving it. `pause` holds new calls before
//! they reach a backend (one backend, or all) and returns once the calls in flight there are
//! done; `resume` lets them go (weight updates happen in between: nothing is aborted).

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use graft_reconstruct::exact::{
    Detokenizer, Prompt, PromptBuilder, PromptKind, Turn, answer_message, template_messages,
};
use graft_reconstruct::parse_rule::{self, ParseRule};
use graft_reconstruct::parser::{OutputParser, Piece as Parsed, ReasoningFormat, ToolCallFormat};
use graft_reconstruct::retokenize::Model;
use http::{HeaderValue, Method, Request, Response, StatusCode, header};
use http_body_util::Full;
use hyper::body::Incoming;
use serde_json::Value;
use tokio::sync::{OwnedRwLockWriteGuard, RwLock};
use tracing::{info, warn};

use super::probe::{self, Verdict};
use super::restore::Restored;
use super::{
    Answering, BackendSetupError, Finished, Leg, Piece, Plan, PlanRecord, Whole, content_event,
};
use crate::config::{BackendHttp, ExactConfig};
use crate::dialect::{Answer, Delta, Dialect, Finish, RawPrompt, TokenUsage, ToolCall, ToolChoice};
use crate::error::GatewayError;
use crate::outcome::Outcome;
use crate::policy::SamplingPolicy;
use crate::sessions::now_us;
use crate::sglang::{self, FinishReason, Progress};
use crate::sse::Event;
use crate::token_ids::Recorded;
use crate::upstream::{HttpClient, error_chain, http_client, snippet, upstream_message};

/// How long a backend's server info may take to answer.
const PROBE_TIMEOUT: Duration = Duration::from_secs(10);

/// The upstream wire label exact-mode records carry (SGLang's `/generate`).
pub const WIRE: &str = graft_recorder::wire::SGLANG_GENERATE;
/// The label of vLLM's `/v1/completions` with token ids.
pub const VLLM_WIRE: &str = graft_recorder::wire::VLLM_COMPLETIONS;

/// The backend wire a gateway's exact mode speaks (`exact.wire`): how a call's body is
/// built, where it goes, how its answer is read and how a generation is aborted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Wire {
    /// SGLang's native `POST /generate` (`crate::sglang`); aborted by `POST /abort_request`.
    Sglang,
    /// vLLM's `POST /v1/completions` with a token-id prompt (`crate::vllm`); aborted by
    /// closing the connection (vLLM cancels a request whose client went away).
    Vllm,
}

impl Wire {
    fn new(w: crate::config::ExactWire) -> Wire {
        match w {
            crate::config::ExactWire::Sglang => Wire::Sglang,
            crate::config::ExactWire::Vllm => Wire::Vllm,
        }
    }

    /// The record's `upstream_dialect`.
    pub fn label(self) -> &'static str {
        match self {
            Wire::Sglang => WIRE,
            Wire::Vllm => VLLM_WIRE,
        }
    }

    /// The generation route.
    fn path(self) -> &'static str {
        match self {
            Wire::Sglang => graft_wire::sglang::path::GENERATE,
            Wire::Vllm => graft_wire::vllm::path::COMPLETIONS,
        }
    }

    /// The request body: the prompt ids, the sampling keys, the call id as the request id.
    fn body(self, ids: &[u32], params: Value, stream: bool, call_id: &str, top: u32) -> Value {
        match self {
            Wire::Sglang => {
                let mut body = sglang::generate_body(ids, params, stream, top);
                if let Some(o) = body.as_object_mut() {
                    // The call id is SGLang's request id: `/abort_request` stops it by that name.
                    o.insert("rid".into(), Value::String(call_id.to_string()));
                }
                body
            }
            Wire::Vllm => crate::vllm::completions_body(ids, params, stream, call_id, top),
        }
    }

    /// The sampling keys in the wire's names.
    fn sampling(self, s: &crate::dialect::Sampling, default_max: u64) -> Value {
        match self {
            Wire::Sglang => sglang::sampling_params(s, default_max),
            Wire::Vllm => crate::vllm::sampling(s, default_max),
        }
    }

    /// Reads one answer or streamed event into `p`; the new ids.
    fn read(self, p: &mut Progress, v: &Value) -> Result<Vec<u32>, String> {
        match self {
            Wire::Sglang => p.push(v),
            Wire::Vllm => p.push_vllm(v),
        }
    }
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

/// Every session's recent calls and their budget: shared by the backend and its calls
/// (a call remembers itself once it is answered).
struct Memory {
    histories: Mutex<Histories>,
    per_session: usize,
    budget: usize,
}

impl Memory {
    fn remember(&self, id: &str, turn: Turn) {
        let Ok(mut h) = self.histories.lock() else {
            return;
        };
        let Some(s) = h.map.get_mut(id) else {
            return;
        };
        s.turns.push_front(Arc::new(turn));
        s.turns.truncate(self.per_session);
        let before = s.held;
        s.held = s.turns.iter().map(|t| t.tokens.len()).sum();
        let after = s.held;
        h.held = h.held.saturating_sub(before) + after;
        let evicted = h.evict(self.budget);
        if evicted > 0 {
            info!(
                evicted,
                budget = self.budget,
                "exact mode: token histories of the least recently used sessions dropped (exact.history_max_tokens); their next calls are tokenized in full"
            );
        }
    }
}

/// One backend: its URL, its pause gate (a call holds it for reading while the backend has
/// it; a pause takes it for writing), how many sessions are pinned to it.
struct Slot {
    url: String,
    gate: Arc<RwLock<()>>,
    sessions: usize,
    /// What its `/server_info` said, once it answered (see `probe.rs`).
    checked: Arc<tokio::sync::OnceCell<Verdict>>,
    /// The weight version given when the backend was last resumed after a pause (a push
    /// driven with a drain): the record's `weight_version` for answers that report none
    /// (vLLM before 0.34). Every call in flight then was sampled by it: the pause waited for
    /// the ones before.
    stamp: Stamp,
}

/// See [`Slot::stamp`].
type Stamp = Arc<std::sync::Mutex<Option<String>>>;

impl Slot {
    fn new(url: &str) -> Slot {
        Slot {
            url: url.trim_end_matches('/').to_string(),
            gate: Arc::new(RwLock::new(())),
            sessions: 0,
            checked: Arc::new(tokio::sync::OnceCell::new()),
            stamp: Stamp::default(),
        }
    }
}

/// Exact mode's state: the model's template and tokenizer, the backends, each session's
/// recent calls, and the pause gates.
pub struct Sglang {
    builder: Arc<PromptBuilder>,
    wire: Wire,
    logprobs: crate::config::LogprobKind,
    tool_format: ToolCallFormat,
    reasoning_format: ReasoningFormat,
    /// `exact.vllm_strict_tool_calling`: the vLLM backends' `VLLM_ENFORCE_STRICT_TOOL_CALLING`.
    vllm_strict_tool_calling: bool,
    /// The configured backends first, then those sessions named for themselves. Only ever
    /// appended to, so an index stays valid.
    slots: Mutex<Vec<Slot>>,
    /// How many of `slots` are configured: a session that names no backend is pinned among
    /// these.
    configured: usize,
    /// Sessions that named their own backend: its index, taken by their first call.
    named: Mutex<HashMap<String, usize>>,
    client: HttpClient,
    timeout: Duration,
    /// `exact.backend_api_key` and `exact.admin_api_key`.
    backend_key: Option<String>,
    admin_key: Option<String>,
    check_backends: bool,
    max_new_tokens: u64,
    /// The model's context length (`exact.context_length`, else the model's
    /// `config.json`); `None` when neither says (then nothing is clamped or refused).
    context_length: Option<u64>,
    memory: Arc<Memory>,
    /// The paused backends (by index) and the write half of their gates.
    paused: tokio::sync::Mutex<HashMap<usize, OwnedRwLockWriteGuard<()>>>,
    /// Histories rebuilt from the records at start, taken by each session's first call.
    restored: Arc<Mutex<HashMap<String, Restored>>>,
    /// Whether the rebuild is done (calls wait for it).
    ready: Arc<tokio::sync::watch::Sender<bool>>,
}

impl Sglang {
    pub fn new(cfg: &ExactConfig, http: &BackendHttp) -> Result<Self, BackendSetupError> {
        let mut model = Model::from_dir(&cfg.model_dir).map_err(|e| BackendSetupError::Model {
            dir: cfg.model_dir.display().to_string(),
            message: e.to_string(),
        })?;
        model.extra = cfg.template_kwargs.clone();
        let context_length = cfg.context_length.or_else(|| context_of(&cfg.model_dir));
        if context_length.is_none() {
            warn!(
                dir = %cfg.model_dir.display(),
                "exact mode: the model's config.json names no max_position_embeddings and exact.context_length is not set; token limits are sent unclamped"
            );
        }
        Ok(Sglang {
            builder: Arc::new(PromptBuilder::new(model)),
            wire: Wire::new(cfg.wire),
            logprobs: cfg.logprobs,
            tool_format: cfg.tool_call_format,
            reasoning_format: cfg.reasoning_format,
            vllm_strict_tool_calling: cfg.vllm_strict_tool_calling,
            slots: Mutex::new(cfg.backends.iter().map(|b| Slot::new(b)).collect()),
            configured: cfg.backends.len(),
            named: Mutex::new(HashMap::new()),
            client: http_client(http.connect_timeout, http.ca_file.as_deref())?,
            timeout: http.timeout,
            backend_key: cfg.backend_api_key.clone(),
            admin_key: cfg.admin_api_key.clone(),
            check_backends: cfg.check_backends,
            max_new_tokens: cfg.max_new_tokens,
            context_length,
            memory: Arc::new(Memory {
                histories: Mutex::new(Histories::default()),
                per_session: cfg.history_per_session,
                budget: cfg.history_max_tokens,
            }),
            paused: tokio::sync::Mutex::new(HashMap::new()),
            restored: Arc::new(Mutex::new(HashMap::new())),
            ready: Arc::new(tokio::sync::watch::Sender::new(true)),
        })
    }

    /// Whether the start's rebuild of token histories ([`Sglang::restore`]) is done: until
    /// then calls wait and `/healthz` answers 503 `starting`.
    pub fn is_ready(&self) -> bool {
        *self.ready.borrow()
    }

    /// Rebuilds the token histories of the `open` sessions from the records in `data_dir`,
    /// in the background; calls wait until it is done (see `restore.rs`).
    pub fn restore(&self, data_dir: std::path::PathBuf, open: std::collections::HashSet<String>) {
        self.ready.send_replace(false);
        let (restored, ready) = (self.restored.clone(), self.ready.clone());
        let per_session = self.memory.per_session;
        tokio::task::spawn_blocking(move || {
            let t = Instant::now();
            match graft_recorder::read_records(&data_dir) {
                Ok(records) => {
                    let found = super::restore::histories(records, &open, per_session);
                    let turns: usize = found.values().map(|r| r.turns.len()).sum();
                    if !found.is_empty() {
                        info!(
                            sessions = found.len(),
                            turns,
                            ms = t.elapsed().as_millis() as u64,
                            "exact mode: token histories rebuilt from the records"
                        );
                    }
                    if let Ok(mut r) = restored.lock() {
                        *r = found;
                    }
                }
                Err(e) => warn!(
                    error = %e,
                    dir = %data_dir.display(),
                    "exact mode: the records cannot be read to rebuild token histories; open sessions' next calls are tokenized in full"
                ),
            }
            ready.send_replace(true);
        });
    }

    /// Checks every configured backend's server info now, in the background (a backend
    /// that cannot be reached yet is checked again before its first call).
    pub fn check_backends(&self) {
        if !self.check_backends {
            return;
        }
        let slots: Vec<(String, Arc<tokio::sync::OnceCell<Verdict>>)> = self
            .slots
            .lock()
            .map(|s| {
                s.iter()
                    .map(|b| (b.url.clone(), b.checked.clone()))
                    .collect()
            })
            .unwrap_or_default();
        let (client, key) = (self.client.clone(), self.backend_key.clone());
        let vllm = self.wire == Wire::Vllm;
        tokio::spawn(async move {
            let ask = probe::Asker {
                client: &client,
                key: key.as_deref(),
                timeout: PROBE_TIMEOUT,
            };
            for (url, cell) in slots {
                if let Err(e) = cell
                    .get_or_try_init(|| probe::check_wire(&ask, &url, vllm))
                    .await
                {
                    warn!(backend = %url, error = %e, "exact mode: the backend's server info cannot be read yet; it is checked again before its first call");
                }
            }
        });
    }

    /// The backend's verdict (reading its server info the first time): Err when calls to
    /// it are refused. A backend that cannot be reached is let through (the call then
    /// fails on its own) and checked again next time.
    async fn checked(&self, i: usize, url: &str) -> Result<(), GatewayError> {
        if !self.check_backends {
            return Ok(());
        }
        let Some(cell) = self
            .slots
            .lock()
            .ok()
            .and_then(|s| s.get(i).map(|b| b.checked.clone()))
        else {
            return Ok(());
        };
        let ask = probe::Asker {
            client: &self.client,
            key: self.backend_key.as_deref(),
            timeout: PROBE_TIMEOUT,
        };
        let vllm = self.wire == Wire::Vllm;
        match cell
            .get_or_try_init(|| probe::check_wire(&ask, url, vllm))
            .await
        {
            Ok(Verdict::Refused(why)) => Err(GatewayError::UpstreamInvalid {
                upstream: url.to_string(),
                detail: why.clone(),
            }),
            Ok(Verdict::Fine) => Ok(()),
            Err(e) => {
                warn!(backend = %url, error = %e, "exact mode: the backend's server info cannot be read; the call goes on unchecked");
                Ok(())
            }
        }
    }

    /// Every backend's URL: the configured ones, then those sessions named.
    pub fn backends(&self) -> Vec<String> {
        self.slots
            .lock()
            .map(|s| s.iter().map(|b| b.url.clone()).collect())
            .unwrap_or_default()
    }

    /// The backend's URL, pause gate and stamped weight version.
    fn slot(&self, i: usize) -> Option<(String, Arc<RwLock<()>>, Stamp)> {
        let slots = self.slots.lock().ok()?;
        slots
            .get(i)
            .map(|s| (s.url.clone(), s.gate.clone(), s.stamp.clone()))
    }

    /// Pins `session` to the backend at `url` (a trainer's own SGLang-compatible server),
    /// added to the gateway's backends if it is not one yet. Refused when the URL is not an
    /// absolute http(s) URL, or when the session's calls already went to another backend.
    pub fn pin(&self, session: &str, url: &str) -> Result<(), GatewayError> {
        let url = check_backend_url(url)?;
        if let Ok(h) = self.memory.histories.lock()
            && let Some(s) = h.map.get(session)
            && self.slot(s.backend).is_none_or(|(u, _, _)| u != url)
        {
            return Err(GatewayError::field(
                "backend",
                format!("session '{session}' already calls another backend"),
            ));
        }
        let i = {
            let mut slots = self
                .slots
                .lock()
                .map_err(|_| GatewayError::Internal("the backend list is poisoned".into()))?;
            match slots.iter().position(|s| s.url == url) {
                Some(i) => i,
                None => {
                    info!(backend = %url, "exact mode: a session named a new backend");
                    slots.push(Slot::new(&url));
                    slots.len() - 1
                }
            }
        };
        if let Ok(mut n) = self.named.lock() {
            n.insert(session.to_string(), i);
        }
        Ok(())
    }

    pub(crate) fn timeout(&self) -> Duration {
        self.timeout
    }

    /// The session's backend (pinning it on first use) and its recent calls.
    fn session(&self, id: &str) -> (usize, Vec<Arc<Turn>>) {
        let Ok(mut h) = self.memory.histories.lock() else {
            return (0, vec![]);
        };
        h.clock += 1;
        let now = h.clock;
        if let Some(s) = h.map.get_mut(id) {
            s.last_used = now;
            return (s.backend, s.turns.iter().cloned().collect());
        }
        // The session's first call since the start: its history from the records, if any.
        let restored = self.restored.lock().ok().and_then(|mut r| r.remove(id));
        let named = self.named.lock().ok().and_then(|n| n.get(id).copied());
        let pin = named.or_else(|| {
            restored
                .as_ref()
                .and_then(|r| self.backend_index(&r.backend))
        });
        let backend = match self.slots.lock() {
            Ok(mut slots) => {
                let i = pin.unwrap_or_else(|| {
                    slots
                        .iter()
                        .take(self.configured)
                        .enumerate()
                        .min_by_key(|(_, s)| s.sessions)
                        .map_or(0, |(i, _)| i)
                });
                if let Some(s) = slots.get_mut(i) {
                    s.sessions += 1;
                }
                i
            }
            Err(_) => 0,
        };
        let turns: VecDeque<Arc<Turn>> = restored.map(|r| r.turns.into()).unwrap_or_default();
        let held: usize = turns.iter().map(|t| t.tokens.len()).sum();
        let out: Vec<Arc<Turn>> = turns.iter().cloned().collect();
        h.map.insert(
            id.to_string(),
            SessionTokens {
                backend,
                turns,
                held,
                last_used: now,
            },
        );
        h.held += held;
        if held > 0 {
            h.evict(self.memory.budget);
        }
        (backend, out)
    }

    /// A closed session's tokens are dropped.
    pub fn forget(&self, id: &str) {
        let removed = self.memory.histories.lock().ok().and_then(|mut h| {
            let s = h.map.remove(id)?;
            h.held = h.held.saturating_sub(s.held);
            Some(s)
        });
        if let Ok(mut n) = self.named.lock() {
            n.remove(id);
        }
        if let (Some(s), Ok(mut slots)) = (removed, self.slots.lock())
            && let Some(b) = slots.get_mut(s.backend)
        {
            b.sessions = b.sessions.saturating_sub(1);
        }
    }

    /// The index of a configured backend, by its URL (a trailing `/` ignored).
    pub fn backend_index(&self, url: &str) -> Option<usize> {
        let url = url.trim_end_matches('/');
        self.slots.lock().ok()?.iter().position(|b| b.url == url)
    }

    /// Holds new calls to `backend` (every backend known now when None) and waits until its
    /// calls in flight are done. Calls pinned to other backends go on. Returns how long
    /// that took.
    pub async fn pause(&self, backend: Option<usize>) -> Duration {
        let t = Instant::now();
        let gates: Vec<(usize, Arc<RwLock<()>>)> = self
            .slots
            .lock()
            .map(|s| {
                s.iter()
                    .enumerate()
                    .filter(|(i, _)| backend.is_none_or(|b| b == *i))
                    .map(|(i, s)| (i, s.gate.clone()))
                    .collect()
            })
            .unwrap_or_default();
        let mut paused = self.paused.lock().await;
        for (i, gate) in gates {
            if let std::collections::hash_map::Entry::Vacant(e) = paused.entry(i) {
                e.insert(gate.write_owned().await);
            }
        }
        t.elapsed()
    }

    /// Lets held calls to `backend` (every backend when None) go. Returns the backends
    /// that were paused. `weight_version`: the version the paused backends now serve (a
    /// push was made while they were drained), recorded on their answers that report none;
    /// refused, and nothing resumed, when none of them was paused (then calls may be in
    /// flight under other weights, and the label would be a guess).
    pub async fn resume(
        &self,
        backend: Option<usize>,
        weight_version: Option<String>,
    ) -> Result<Vec<String>, GatewayError> {
        let mut paused = self.paused.lock().await;
        let resumed: Vec<usize> = paused
            .keys()
            .copied()
            .filter(|i| backend.is_none_or(|b| b == *i))
            .collect();
        if weight_version.is_some() && resumed.is_empty() {
            return Err(GatewayError::field(
                "weight_version",
                "labels the calls after a push made while the backend was drained: pause it first (POST /graft/backend/pause)",
            ));
        }
        if let Some(v) = &weight_version
            && let Ok(slots) = self.slots.lock()
        {
            for i in &resumed {
                if let Some(s) = slots.get(*i)
                    && let Ok(mut stamp) = s.stamp.lock()
                {
                    *stamp = Some(v.clone());
                }
            }
        }
        paused.retain(|i, _| !resumed.contains(i));
        let urls = self.backends();
        Ok(resumed
            .into_iter()
            .filter_map(|i| urls.get(i).cloned())
            .collect())
    }

    /// The backends now paused.
    pub async fn paused_backends(&self) -> Vec<String> {
        let mut paused: Vec<usize> = self.paused.lock().await.keys().copied().collect();
        paused.sort_unstable();
        let urls = self.backends();
        paused
            .into_iter()
            .filter_map(|i| urls.get(i).cloned())
            .collect()
    }

    /// The call's output parser, decided from its request as SGLang's chat server decides it
    /// (`graft_reconstruct::parse_rule`): no tool-call parsing without tools or with
    /// `tool_choice: none`; `required` / a named function parse like `auto` (their decode is
    /// constrained: [`Sglang::tool_constraint`]), except on vLLM with
    /// `exact.vllm_strict_tool_calling = false`, where they are read as vLLM's forced JSON.
    /// Reasoning is forced where the request thinks or the prompt opened the think block
    /// (`starts_in_reasoning`).
    fn parser(
        &self,
        call_id: &str,
        starts_in_reasoning: bool,
        tools: &[Value],
        tool_choice: Option<&ToolChoice>,
        parallel_tool_calls: Option<bool>,
        streamed: bool,
    ) -> OutputParser {
        let choice = match tool_choice {
            None | Some(ToolChoice::Auto) => parse_rule::ToolChoice::Auto,
            Some(ToolChoice::None) => parse_rule::ToolChoice::None,
            Some(ToolChoice::Required) => parse_rule::ToolChoice::Required,
            Some(ToolChoice::Function { name }) => parse_rule::ToolChoice::Function(name.clone()),
        };
        let rule = ParseRule::new(self.tool_format, self.reasoning_format, tools, choice)
            .with_thinking(starts_in_reasoning)
            .parallel_tool_calls(parallel_tool_calls)
            .streamed(streamed);
        let rule = match self.wire {
            Wire::Sglang => rule,
            Wire::Vllm => rule.as_vllm(self.vllm_strict_tool_calling),
        };
        rule.parser().with_id_prefix(tool_call_prefix(call_id))
    }

    /// Adds the tool-call decode constraint to `params` where the server's own chat endpoint
    /// adds one; whether it did. SGLang ([`sglang::tool_call_constraint`]): another output
    /// constraint (`response_format`) wins over an `auto` one; with `required` or a named
    /// function both cannot hold, and the call is refused as SGLang refuses it. vLLM
    /// ([`crate::vllm::structured_outputs`]): the `structured_outputs` its chat server would
    /// send, a structural tag in the model's own call syntax (with
    /// `exact.vllm_strict_tool_calling`, vLLM's default) or a forced call's JSON schema, in
    /// place of the response format's (or beside it, under `auto`).
    fn tool_constraint(
        &self,
        conv: &crate::dialect::Conversation,
        output: Option<&crate::dialect::OutputFormat>,
        params: &mut Value,
    ) -> Result<bool, GatewayError> {
        let required = matches!(
            conv.tool_choice,
            Some(ToolChoice::Required | ToolChoice::Function { .. })
        );
        let output_constrained = params.get("json_schema").is_some();
        if self.tool_format == ToolCallFormat::None || conv.tools.is_empty() {
            return Ok(false);
        }
        if self.wire == Wire::Vllm {
            let plain = params.get("structured_outputs").cloned();
            let so = crate::vllm::structured_outputs(
                self.tool_format,
                self.vllm_strict_tool_calling,
                &conv.tools,
                conv.tool_choice.as_ref(),
                conv.parallel_tool_calls,
                output,
            )
            .and_then(|so| serde_json::to_value(so).ok());
            if so == plain {
                return Ok(false);
            }
            if let (Some(o), Some(so)) = (params.as_object_mut(), so) {
                o.insert("structured_outputs".into(), so);
            }
            return Ok(true);
        }
        if required && output_constrained {
            return Err(GatewayError::field(
                "tool_choice",
                "a required or named 'tool_choice' cannot be combined with structured output (response_format): the tool-call constraint and the output constraint cannot both be honored",
            ));
        }
        let Some(tag) = sglang::tool_call_constraint(
            self.tool_format,
            &conv.tools,
            conv.tool_choice.as_ref(),
            conv.parallel_tool_calls != Some(false),
        ) else {
            return Ok(false);
        };
        if output_constrained {
            return Ok(false);
        }
        if let Some(o) = params.as_object_mut() {
            o.insert("structural_tag".into(), Value::String(tag));
        }
        Ok(true)
    }

    /// Renders and tokenizes the call's prompt (reusing the session's sampled ids where it
    /// extends an earlier call) and builds the `/generate` request.
    pub(crate) async fn plan(
        &self,
        dialect: &'static dyn Dialect,
        request: &Value,
        session: &str,
        call_id: &str,
        policy: Option<&SamplingPolicy>,
    ) -> Result<Plan, GatewayError> {
        let conv = dialect.parse(request)?;
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
        let mut conv = conv;
        if conv.prompt.is_none() {
            check_tool_choice(&conv)?;
        }
        // Chat clients get the answer in the shape of the backend's own chat endpoint.
        conv.shape = match self.wire {
            Wire::Sglang => crate::dialect::AnswerShape::Sglang,
            Wire::Vllm => crate::dialect::AnswerShape::Vllm,
        };
        // `None`: the request names no template variables, the model's own apply.
        let kwargs = template_kwargs(&self.builder.model().extra, &conv)?;
        // The request thinks and the model's reasoning is separated. SGLang: the template has
        // a thinking toggle and `enable_thinking` is not `false`; its chat server then sets
        // `require_reasoning`, so a decode constraint waits for the reasoning's end, and the
        // output starts in reasoning; a template without a toggle (SmolLM2, Qwen2.5, Llama)
        // thinks only where its prompt opens the block. vLLM: its `qwen3` reasoning parser
        // starts in reasoning whenever `enable_thinking` is not `false`
        // (`Qwen3Parser.__init__`, `chat_template_kwargs.get("enable_thinking", True)`),
        // whatever the template.
        let thinking = self.reasoning_format == ReasoningFormat::Think
            && (self.wire == Wire::Vllm || self.builder.model().template.has_thinking_toggle())
            && parse_rule::thinking_enabled(Some(
                kwargs.as_ref().unwrap_or(&self.builder.model().extra),
            ));
        // Histories are being rebuilt from the records after a start: wait for them.
        let _ = self.ready.subscribe().wait_for(|done| *done).await;
        let (backend_index, history) = self.session(session);
        let (backend, gate, stamp) = self
            .slot(backend_index)
            .ok_or_else(|| GatewayError::Internal("no exact-mode backend configured".into()))?;
        self.checked(backend_index, &backend).await?;

        // Rendering and tokenizing is CPU work: off the reactor.
        let builder = self.builder.clone();
        let t_render = Instant::now();
        let (messages, tools, rendered_tools, prompt, chat) = match conv.prompt.clone() {
            // Completions: raw text has no chat template: it is tokenized as it is (the
            // client's own ids are sent as they are); no tool calls or reasoning are parsed,
            // and nothing is remembered for prefix reuse.
            Some(raw) => {
                let ids = match raw {
                    RawPrompt::Tokens(ids) => ids,
                    RawPrompt::Text(text) => {
                        tokio::task::spawn_blocking(move || builder.model().tokenizer.encode(&text))
                            .await
                            .map_err(|e| {
                                GatewayError::Internal(format!("the prompt task failed: {e}"))
                            })?
                            .map_err(|e| {
                                GatewayError::field(
                                    "prompt",
                                    format!("the model's tokenizer cannot encode this prompt: {e}"),
                                )
                            })?
                    }
                };
                if ids.is_empty() {
                    return Err(GatewayError::field("prompt", "'prompt' is empty"));
                }
                let prompt = Prompt {
                    ids,
                    kind: PromptKind::Full,
                    starts_in_reasoning: false,
                };
                (vec![], None, None, prompt, false)
            }
            None => {
                let (chat_req, notes) = crate::dialect::chat::to_request(&conv);
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
                // The template renders the tools SGLang's chat server renders: none under
                // `tool_choice: "none"`, only the named one under a named choice
                // (`_process_messages` in `serving_chat.py`); the parser still knows them all.
                // vLLM's renders every tool whatever the choice (unless it runs with
                // `--exclude-tools-when-tool-choice-none`).
                let rendered = match self.wire {
                    Wire::Sglang => template_tools(tools.as_deref(), conv.tool_choice.as_ref()),
                    Wire::Vllm => tools.clone(),
                };
                let (msgs, tls, kw) = (messages.clone(), rendered.clone(), kwargs.clone());
                let prompt = tokio::task::spawn_blocking(move || match &kw {
                    Some(kw) => builder.prompt_with(&msgs, tls.as_deref(), &history, kw),
                    None => builder.prompt(&msgs, tls.as_deref(), &history),
                })
                .await
                .map_err(|e| GatewayError::Internal(format!("the prompt task failed: {e}")))?
                .map_err(|e| {
                    GatewayError::field(
                        "messages",
                        format!("the model's chat template cannot render this conversation: {e}"),
                    )
                })?;
                (messages, tools, rendered, prompt, true)
            }
        };
        let render_time = t_render.elapsed();
        let reused = match prompt.kind {
            PromptKind::Reused { reused } => reused,
            PromptKind::Full => 0,
        };
        // A sampling policy decides what is sent; the normalized request keeps what the
        // client asked for.
        let mut sent = policy.map_or_else(|| conv.sampling.clone(), |p| p.apply(&conv.sampling));
        if let Some((key, why)) = sent.out_of_range(self.wire == Wire::Sglang) {
            return Err(GatewayError::field(key, format!("'{key}' {why}")));
        }
        // The context budget: a prompt that leaves no room for one token is refused before
        // anything is sent (as OpenAI's API refuses it: `context_length_exceeded`); a token
        // limit past what is left is clamped to it (SGLang would refuse it, vLLM too).
        let mut refusal = None;
        if let Some(context) = self.context_length {
            let n = prompt.ids.len() as u64;
            if n >= context {
                refusal = Some(GatewayError::ContextLength {
                    context,
                    prompt: n,
                    param: if chat { "messages" } else { "prompt" },
                });
            } else {
                let room = context - n;
                if sent.max_tokens.unwrap_or(self.max_new_tokens) > room {
                    sent.max_tokens = Some(room);
                }
            }
        }
        let top = conv.logprobs.unwrap_or(0);
        let mut params = self.wire.sampling(&sent, self.max_new_tokens);
        let mut constrained = sent.format.is_some();
        if chat {
            constrained |= self.tool_constraint(&conv, sent.format.as_ref(), &mut params)?;
        }
        let stops = sent.stop.clone();
        let sampling = policy.map(|p| {
            crate::policy::record_value(
                p,
                serde_json::to_value(&conv.sampling).unwrap_or(Value::Null),
                params.clone(),
            )
        });
        // Always streamed from the backend, whatever the client asked: SGLang and vLLM send a
        // whole answer's head only when it is done, so a long generation would outlast any
        // head timeout; a stream instead shows progress, and a stall is timed between
        // events. A client that asked for a whole answer gets it assembled from the events.
        let mut body = self.wire.body(&prompt.ids, params, true, call_id, top);
        // As SGLang's chat server asks it for a thinking request (`require_reasoning`): a
        // grammar then starts at the reasoning's end (SGLang's `--reasoning-parser` decides
        // where that is), not at the first token.
        if chat
            && constrained
            && self.wire == Wire::Sglang
            && (thinking || prompt.starts_in_reasoning)
            && let Some(o) = body.as_object_mut()
        {
            o.insert("require_reasoning".into(), Value::Bool(true));
        }
        let mut recorded_body = body.clone();
        if let Some(o) = recorded_body.as_object_mut() {
            // The ids are the record's prompt_token_ids; the body keeps what else was sent.
            o.remove("input_ids");
            o.remove("prompt");
            o.insert(
                "graft_logprobs".into(),
                Value::String(self.logprobs.label().into()),
            );
            o.insert(
                "graft_prompt".into(),
                serde_json::json!({
                    "tokens": prompt.ids.len(),
                    "reused_tokens": reused,
                    "render_ms": render_time.as_secs_f64() * 1e3,
                }),
            );
        }
        let parser = if chat {
            self.parser(
                call_id,
                // Both servers' Qwen3 reasoning parsers start in reasoning whenever the request
                // thinks, whether or not the prompt opened the block (SGLang's
                // `force_reasoning`, vLLM's `initial_state=REASONING`).
                prompt.starts_in_reasoning || thinking,
                tools.as_deref().unwrap_or(&[]),
                conv.tool_choice.as_ref(),
                conv.parallel_tool_calls,
                conv.stream,
            )
        } else {
            OutputParser::new(ToolCallFormat::None, ReasoningFormat::None, false)
        };
        let stream = conv.stream;
        let model = conv.model.clone();
        let tokenizer = &self.builder.model().tokenizer;
        // SGLang counts the reasoning part's tokens (`meta_info.reasoning_tokens`: from the
        // output's start, or its own `<think>`, through `</think>`): only where reasoning is
        // separated.
        let reasoning_ids = (chat && self.reasoning_format == ReasoningFormat::Think)
            .then(|| tokenizer.token_id("</think>"))
            .flatten()
            .map(|end| ThinkIds {
                start: tokenizer.token_id("<think>"),
                end,
                opened: prompt.starts_in_reasoning,
            });
        let generate = Generate {
            dialect,
            refusal,
            want_logprobs: conv.logprobs.is_some(),
            // vLLM's chat endpoint shows the first `top_logprobs` of a position's candidates
            // (the sampled token first: `chat_top_logprobs_limit`); its completions endpoint
            // all it sent (`logprobs + 1`); SGLang's the `top_logprobs_num` it sent.
            top_shown: if self.wire == Wire::Vllm && chat {
                top as usize
            } else {
                usize::MAX
            },
            logprobs_sent: 0,
            offset: 0,
            reasoning_ids,
            body: Bytes::from(body.to_string()),
            wire: self.wire,
            backend: backend.clone(),
            gate,
            stamp,
            session: session.to_string(),
            memory: self.memory.clone(),
            model: model.clone(),
            created: now_us() / 1_000_000,
            messages,
            tools: rendered_tools,
            prompt,
            decoder: Decoder {
                builder: self.builder.clone(),
                detok: Detokenizer::keeping(
                    parser
                        .special_tokens()
                        .iter()
                        .filter_map(|t| self.builder.model().tokenizer.token_id(t))
                        .collect(),
                ),
                parser,
                stops: stops.into_iter().filter(|s| !s.is_empty()).collect(),
                pending: String::new(),
                stopped: false,
            },
            progress: Progress::default(),
            events: 0,
            response_id: String::new(),
            reused: reused > 0,
            render_time,
            remember: chat,
            named_call_stops: self.wire == Wire::Vllm
                && matches!(conv.tool_choice, Some(ToolChoice::Function { .. })),
        };
        Ok(Plan {
            leg: Leg::Generate(Box::new(generate)),
            record: PlanRecord {
                normalized_request: serde_json::to_value(&conv).ok(),
                upstream_request: Some(recorded_body),
                upstream_dialect: Some(self.wire.label()),
                upstream: backend,
                model: Some(model),
                stream,
                sampling,
            },
            conv: Some(conv),
        })
    }

    /// `POST {backend}/generate` (or vLLM's `/v1/completions`); returns once the answer's
    /// head has arrived. The session is the routing key of SGLang's router
    /// (`X-SMG-Routing-Key`: its `consistent_hashing` and `manual` policies keep a key on one
    /// worker, so the prefix cache keeps serving it).
    pub(crate) async fn send(&self, g: &Generate) -> Result<Response<Incoming>, GatewayError> {
        self.request_with(
            Method::POST,
            &format!("{}{}", g.backend, g.wire.path()),
            &g.backend,
            g.body.clone(),
            HeaderValue::from_str(&g.session).ok(),
            self.backend_key.as_deref(),
        )
        .await
    }

    /// `POST {backend}/abort_request {"rid": call_id}`: stops a generation whose client went
    /// away (best effort: a generation that already finished is not an error).
    pub(crate) async fn abort(&self, backend: &str, call_id: &str) {
        if self.wire == Wire::Vllm {
            // vLLM has no abort-by-id route: it cancels a request when its connection
            // closes, which dropping the call's upstream answer does.
            info!(
                call_id,
                backend,
                "exact mode: the client went away; the connection to vLLM is closed, which aborts its generation"
            );
            return;
        }
        let body = serde_json::json!({"rid": call_id}).to_string();
        let url = format!("{backend}{}", graft_wire::sglang::path::ABORT_REQUEST);
        // An admin route: SGLang wants the admin key there when it has one.
        let key = self.admin_key.as_deref().or(self.backend_key.as_deref());
        match self
            .request_with(Method::POST, &url, backend, Bytes::from(body), None, key)
            .await
        {
            Ok(r) if r.status().is_success() => {
                info!(
                    call_id,
                    backend, "exact mode: the client went away; generation aborted"
                );
            }
            Ok(r) => warn!(
                call_id,
                backend,
                status = r.status().as_u16(),
                "exact mode: /abort_request was refused"
            ),
            Err(e) => warn!(call_id, backend, error = %e, "exact mode: /abort_request failed"),
        }
    }

    /// `GET /v1/models` of the first backend (SGLang serves the OpenAI routes too).
    pub(crate) async fn models(&self) -> Result<(String, Response<Incoming>), GatewayError> {
        let (backend, _, _) = self
            .slot(0)
            .ok_or_else(|| GatewayError::Internal("no exact-mode backend configured".into()))?;
        let url = format!("{backend}/v1/models");
        let r = self
            .request_with(
                Method::GET,
                &url,
                &backend,
                Bytes::new(),
                None,
                self.backend_key.as_deref(),
            )
            .await?;
        Ok((backend, r))
    }

    async fn request_with(
        &self,
        method: Method,
        url: &str,
        backend: &str,
        body: Bytes,
        routing_key: Option<HeaderValue>,
        key: Option<&str>,
    ) -> Result<Response<Incoming>, GatewayError> {
        let mut req = Request::builder().method(method).uri(url);
        if let Some(k) = key {
            req = req.header(header::AUTHORIZATION, format!("Bearer {k}"));
        }
        if !body.is_empty() {
            req = req.header(header::CONTENT_TYPE, "application/json");
        }
        if let Some(k) = routing_key {
            req = req.header("x-smg-routing-key", k);
        }
        let req = req.body(Full::new(body)).map_err(|e| {
            GatewayError::Internal(format!("cannot build the request to {url}: {e}"))
        })?;
        match tokio::time::timeout(self.timeout, self.client.request(req)).await {
            Ok(Ok(r)) => Ok(r),
            Ok(Err(e)) => Err(GatewayError::UpstreamUnreachable {
                upstream: backend.to_string(),
                detail: error_chain(&e),
            }),
            Err(_) => Err(GatewayError::UpstreamTimeout {
                upstream: backend.to_string(),
                secs: self.timeout.as_secs(),
            }),
        }
    }
}

/// One exact-mode call: its prompt, its `/generate` body, and what came back so far.
pub(crate) struct Generate {
    /// The client's dialect (its words for how the answer ended go in the record).
    dialect: &'static dyn Dialect,
    /// Why the call is refused before anything is sent (the context budget), if it is.
    refusal: Option<GatewayError>,
    /// Whether the client asked for logprobs; how many tokens' were answered so far, and
    /// where the next one starts in the answer's text (characters).
    want_logprobs: bool,
    /// How many of a position's candidates the client is shown.
    top_shown: usize,
    logprobs_sent: usize,
    offset: usize,
    /// The think tags' ids, to count reasoning tokens as SGLang does.
    reasoning_ids: Option<ThinkIds>,
    body: Bytes,
    wire: Wire,
    backend: String,
    pub(crate) gate: Arc<RwLock<()>>,
    /// The backend's stamped weight version (see [`Slot::stamp`]).
    stamp: Stamp,
    session: String,
    memory: Arc<Memory>,
    model: String,
    created: i64,
    messages: Vec<Value>,
    /// The tools the prompt rendered (remembered with the turn for prefix reuse).
    tools: Option<Vec<Value>>,
    prompt: Prompt,
    decoder: Decoder,
    progress: Progress,
    events: u64,
    /// The id of the answer in the client's dialect (set by the pipeline).
    pub(crate) response_id: String,
    /// Whether the prompt reused the session's earlier ids, and how long rendering took.
    pub(crate) reused: bool,
    pub(crate) render_time: Duration,
    /// Whether the answered call is kept for the session's prefix reuse (chat calls).
    remember: bool,
    /// A forced named call ends as `stop`, not `tool_calls` (vLLM's `resolve_finish_reason`,
    /// as OpenAI reports it); SGLang says `tool_calls`.
    named_call_stops: bool,
}

/// The think tags' ids and whether the prompt opened the block.
#[derive(Debug, Clone, Copy)]
struct ThinkIds {
    start: Option<u32>,
    end: u32,
    opened: bool,
}

impl ThinkIds {
    /// The reasoning part's tokens as SGLang counts them (`Req.update_reasoning_tokens`,
    /// `update_self_opened_reasoning_tokens` in `managers/schedule_batch.py`): from the
    /// output's start when the prompt opened the block, or when the output opens it itself,
    /// through the first `</think>` (all of them when it never closes).
    fn count(&self, ids: &[u32]) -> u64 {
        if !self.opened && (self.start.is_none() || ids.first() != self.start.as_ref()) {
            return 0;
        }
        ids.iter()
            .position(|&i| i == self.end)
            .map_or(ids.len(), |p| p + 1) as u64
    }
}

/// Output ids → text → parsed pieces, as they arrive.
struct Decoder {
    builder: Arc<PromptBuilder>,
    detok: Detokenizer,
    parser: OutputParser,
    /// The request's stop strings. The backend keeps a matched one in its output (graft asks
    /// it not to trim, so the recorded ids hold everything sampled); the client's text ends
    /// before it, as the servers show it. Text that may begin one is held back.
    stops: Vec<String>,
    pending: String,
    /// A stop string was met: nothing after it is the client's.
    stopped: bool,
}

impl Decoder {
    fn push(&mut self, ids: &[u32]) -> Result<Vec<Delta>, String> {
        let text = self
            .detok
            .push(&self.builder.model().tokenizer, ids)
            .map_err(|e| e.to_string())?;
        let text = self.cut(&text, false);
        Ok(deltas(self.parser.push(&text)))
    }

    fn finish(&mut self) -> Result<Vec<Delta>, String> {
        let text = self
            .detok
            .finish(&self.builder.model().tokenizer)
            .map_err(|e| e.to_string())?;
        let text = self.cut(&text, true);
        let mut out = deltas(self.parser.push(&text));
        out.extend(deltas(self.parser.finish()));
        Ok(out)
    }

    /// The part of `text` the client sees now: everything before the first stop string,
    /// less a tail that may be the start of one (unless `end`).
    fn cut(&mut self, text: &str, end: bool) -> String {
        if self.stops.is_empty() {
            return text.to_string();
        }
        if self.stopped {
            return String::new();
        }
        self.pending.push_str(text);
        let first = self
            .stops
            .iter()
            .filter_map(|s| self.pending.find(s.as_str()))
            .min();
        if let Some(at) = first {
            self.stopped = true;
            let out = self.pending[..at].to_string();
            self.pending.clear();
            return out;
        }
        let keep = if end {
            0
        } else {
            self.stops
                .iter()
                .filter_map(|s| {
                    (1..s.len())
                        .rev()
                        .find(|&k| s.is_char_boundary(k) && self.pending.ends_with(&s[..k]))
                })
                .max()
                .unwrap_or(0)
        };
        let rest = self.pending.split_off(self.pending.len() - keep);
        std::mem::replace(&mut self.pending, rest)
    }
}

/// The prefix of the tool-call ids the parser gives a call's answer (from its call id).
fn tool_call_prefix(call_id: &str) -> String {
    let short: String = call_id
        .chars()
        .filter(char::is_ascii_hexdigit)
        .rev()
        .take(12)
        .collect();
    format!("call_{short}_")
}

fn deltas(pieces: Vec<Parsed>) -> Vec<Delta> {
    pieces
        .into_iter()
        .map(|p| match p {
            Parsed::Text(t) => Delta::Text(t),
            Parsed::Reasoning(r) => Delta::Reasoning(r),
            Parsed::ToolCallStart { index, id, name } => Delta::ToolCallStart { index, id, name },
            Parsed::ToolCallArgs { index, arguments } => Delta::ToolCallArgs { index, arguments },
        })
        .collect()
}

/// The chat template's extra variables for one call when the request names its own
/// `chat_template_kwargs`: `exact.template_kwargs` overlaid by them (SGLang's and vLLM's
/// chat servers render with the request's, the server's defaults filling what it leaves
/// unset); `None` when it names none (the defaults apply as they are).
fn template_kwargs(
    defaults: &serde_json::Map<String, Value>,
    conv: &crate::dialect::Conversation,
) -> Result<Option<serde_json::Map<String, Value>>, GatewayError> {
    match conv.extra.get("chat_template_kwargs") {
        None | Some(Value::Null) => Ok(None),
        Some(Value::Object(o)) => {
            let mut kwargs = defaults.clone();
            kwargs.extend(o.clone());
            Ok(Some(kwargs))
        }
        Some(v) => Err(GatewayError::field(
            "chat_template_kwargs",
            format!(
                "'chat_template_kwargs' must be an object of template variables, got {}",
                crate::dialect::kind(v)
            ),
        )),
    }
}

/// A `tool_choice` SGLang's and vLLM's chat servers refuse: `required` or a named function
/// without tools, a named function that is not declared.
fn check_tool_choice(conv: &crate::dialect::Conversation) -> Result<(), GatewayError> {
    let declared = |name: &str| conv.tools.iter().any(|t| t.name == name);
    let why = match &conv.tool_choice {
        Some(ToolChoice::Required) if conv.tools.is_empty() => {
            "'tool_choice' asks for a tool call but the request declares no tools".to_string()
        }
        Some(ToolChoice::Function { name }) if !declared(name) => {
            format!(
                "'tool_choice' names the function '{name}', which the request's tools do not declare"
            )
        }
        _ => return Ok(()),
    };
    Err(GatewayError::field("tool_choice", why))
}

/// The tools a chat template is given, as SGLang's chat server gives them: none under
/// `tool_choice: "none"`, only the named function under a named choice (none when no tool
/// has that name), else all of them.
fn template_tools(tools: Option<&[Value]>, choice: Option<&ToolChoice>) -> Option<Vec<Value>> {
    let tools = tools?;
    match choice {
        Some(ToolChoice::None) => None,
        Some(ToolChoice::Function { name }) => {
            let named: Vec<Value> = tools
                .iter()
                .filter(|t| {
                    t.get("function")
                        .unwrap_or(t)
                        .get("name")
                        .and_then(Value::as_str)
                        == Some(name.as_str())
                })
                .cloned()
                .collect();
            (!named.is_empty()).then_some(named)
        }
        _ => Some(tools.to_vec()),
    }
}

fn finish_label(p: &Progress) -> Option<String> {
    p.finish.as_ref().map(|f| match f {
        FinishReason::Stop => "stop".to_string(),
        FinishReason::Length => "length".to_string(),
        FinishReason::Abort(_) => "abort".to_string(),
    })
}

impl Generate {
    /// The rendered prompt's ids (a branch compares them with its parent's).
    pub(crate) fn prompt_ids(&self) -> &[u32] {
        &self.prompt.ids
    }

    /// Answers from a recorded call of another session (`backend/replay.rs`): its events
    /// come in SGLang's `/generate` wire whatever the backend's, and its tool calls get
    /// the ids the recorded call's had.
    pub(crate) fn replay_as(&mut self, call_id: &str) {
        self.wire = Wire::Sglang;
        let parser = std::mem::replace(
            &mut self.decoder.parser,
            OutputParser::new(ToolCallFormat::None, ReasoningFormat::None, false),
        );
        self.decoder.parser = parser.with_id_prefix(tool_call_prefix(call_id));
    }

    /// A hash of the prompt ids (to recognise a resent prompt as a retry).
    pub(crate) fn prompt_hash(&self) -> u64 {
        crate::retries::prompt_hash(&self.prompt.ids)
    }

    fn invalid(&self, detail: String) -> GatewayError {
        GatewayError::UpstreamInvalid {
            upstream: self.backend.clone(),
            detail,
        }
    }

    fn aborted(&self, m: &str) -> GatewayError {
        GatewayError::UpstreamStream {
            upstream: self.backend.clone(),
            detail: format!("the backend aborted the generation: {m}"),
        }
    }

    /// Why the call is refused before it reaches the backend (its prompt does not fit the
    /// context), with the prompt ids for its record.
    pub(crate) fn refused(&mut self) -> Option<(GatewayError, Recorded)> {
        let e = self.refusal.take()?;
        Some((
            e,
            Recorded {
                prompt_token_ids: Some(self.prompt.ids.clone()),
                completion_token_ids: None,
                completion_logprobs: None,
            },
        ))
    }

    /// The logprobs of output tokens `from..to`, as the client gets them: each id decoded
    /// alone, its most likely alternatives when asked for.
    fn token_logprobs(&mut self, from: usize, to: usize) -> Vec<crate::dialect::TokenLogprob> {
        let tok = &self.decoder.builder.model().tokenizer;
        let text = |id: u32| tok.decode(&[id]).unwrap_or_default();
        let p = &self.progress;
        let mut out = Vec::new();
        for (i, &id) in p.output_ids.iter().enumerate().take(to).skip(from) {
            let token = text(id);
            let top = p
                .top_logprobs
                .get(i)
                .map(|t| {
                    t.iter()
                        .take(self.top_shown)
                        .map(|&(id, l)| (text(id), l))
                        .collect()
                })
                .unwrap_or_default();
            let len = token.chars().count();
            out.push(crate::dialect::TokenLogprob {
                token,
                logprob: p.logprobs.get(i).copied().flatten(),
                top,
                offset: self.offset,
            });
            self.offset += len;
        }
        out
    }

    /// The answer from what was parsed and what the backend reported.
    fn answer(&mut self) -> Answer {
        let parsed = self.decoder.parser.parsed();
        for n in &parsed.notes {
            warn!("exact mode: the model's output: {n}");
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
        let p = &self.progress;
        let mut finish = p
            .finish
            .as_ref()
            .map_or(Finish::Error, FinishReason::finish);
        if finish == Finish::Stop && !tool_calls.is_empty() && !self.named_call_stops {
            finish = Finish::ToolCalls;
        }
        Answer {
            id: self.response_id.clone(),
            model: self.model.clone(),
            created: self.created,
            text: parsed.text,
            reasoning: parsed.reasoning,
            tool_calls,
            finish,
            usage: Some(TokenUsage {
                input_tokens: self.prompt.ids.len() as u64,
                output_tokens: p.output_ids.len() as u64,
                cached_tokens: p.cached_tokens.unwrap_or(0),
                reasoning_tokens: self.reasoning_ids.map_or(0, |t| t.count(&p.output_ids)),
            }),
            logprobs: self.want_logprobs.then(|| {
                self.offset = 0;
                self.token_logprobs(0, self.progress.output_ids.len())
            }),
        }
    }

    /// Fills the record's token fields and, for a complete answer, remembers the call for
    /// the session's next prompt.
    fn settle(&mut self, a: &Answer, o: &mut Outcome, ok: bool) {
        let p = &self.progress;
        o.tokens = Recorded {
            prompt_token_ids: Some(self.prompt.ids.clone()),
            completion_token_ids: Some(p.output_ids.clone()),
            completion_logprobs: p.aligned_logprobs(),
        };
        if p.aligned_logprobs().is_none() && !p.output_ids.is_empty() {
            warn!(
                ids = p.output_ids.len(),
                logprobs = p.logprobs.len(),
                "exact mode: the backend sent logprobs for another number of tokens than it sampled; the record keeps the ids without logprobs"
            );
        }
        // An answer without a version (vLLM before 0.34) takes the one graft stamped at the
        // backend's last drained push; it holds for this call: the call holds the pause
        // gate, so no push has happened since it began.
        o.weight_version = p
            .weight_version
            .clone()
            .or_else(|| self.stamp.lock().ok().and_then(|s| s.clone()));
        o.weight_version_spans = p.weight_version_spans();
        // The record says how the answer ended as the client was told (its dialect's words,
        // as a passthrough record says it); the backend's own reason goes beside it.
        o.backend_finish_reason = finish_label(p);
        o.finish_reason = match p.finish {
            Some(FinishReason::Stop | FinishReason::Length) => {
                Some(self.dialect.finish_reason(a).to_string())
            }
            _ => finish_label(p),
        };
        o.stop_matched = match p.finish {
            Some(FinishReason::Stop) => p.stop_reason.clone(),
            _ => None,
        };
        o.normalized_response = serde_json::to_value(a).ok();
        if !ok || !self.remember {
            return;
        }
        let calls: Vec<(String, String, String)> = a
            .tool_calls
            .iter()
            .map(|t| (t.id.clone(), t.name.clone(), t.arguments.clone()))
            .collect();
        let mut tokens = std::mem::take(&mut self.prompt.ids);
        tokens.extend_from_slice(&p.output_ids);
        self.memory.remember(
            &self.session,
            Turn {
                messages: std::mem::take(&mut self.messages),
                tools: self.tools.take(),
                answer: answer_message(&a.text, a.reasoning.as_deref(), &calls),
                tokens,
            },
        );
    }
}

impl Answering for Generate {
    fn relays(&self) -> bool {
        false
    }

    fn streams(&self, status: StatusCode, _is_sse: bool) -> bool {
        status.is_success()
    }

    fn event(
        &mut self,
        ev: &mut Event,
        parsed: Option<&mut Value>,
        _o: &mut Outcome,
    ) -> Result<Piece, GatewayError> {
        self.events += 1;
        let Some(v) = content_event(ev, parsed, &self.backend)? else {
            return Ok(Piece::Skip);
        };
        let new = self.wire.read(&mut self.progress, v).map_err(|d| {
            self.invalid(format!("a {} event cannot be read: {d}", self.wire.path()))
        })?;
        let mut deltas = self.decoder.push(&new).map_err(|m| self.invalid(m))?;
        // The new tokens' logprobs, once the backend sent them (SGLang sends each token's
        // with it; an incremental stream before sglang#21583 could trail).
        let ready = self
            .progress
            .logprobs
            .len()
            .min(self.progress.output_ids.len());
        if self.want_logprobs && ready > self.logprobs_sent {
            let lps = self.token_logprobs(self.logprobs_sent, ready);
            self.logprobs_sent = ready;
            deltas.push(Delta::Logprobs(lps));
        }
        Ok(Piece::Deltas {
            deltas,
            progress: !new.is_empty(),
        })
    }

    fn end(&mut self, _o: &mut Outcome, _relayed: bool) -> Result<Vec<Delta>, GatewayError> {
        let ds = self.decoder.finish().map_err(|m| self.invalid(m))?;
        match &self.progress.finish {
            None => Err(GatewayError::UpstreamStream {
                upstream: self.backend.clone(),
                detail: format!(
                    "the stream ended after {} events without a finish_reason",
                    self.events
                ),
            }),
            Some(FinishReason::Abort(m)) => Err(self.aborted(m)),
            Some(_) => Ok(ds),
        }
    }

    fn finish(&mut self, o: &mut Outcome, ok: bool) -> Option<Finished> {
        let a = self.answer();
        self.settle(&a, o, ok);
        if ok {
            info!(tokens = self.progress.output_ids.len(), "exact stream done");
        }
        Some(Finished {
            answer: a,
            render: true,
        })
    }

    fn whole(
        &mut self,
        status: StatusCode,
        _content_type: Option<HeaderValue>,
        bytes: Bytes,
        o: &mut Outcome,
    ) -> Result<Whole, GatewayError> {
        if !status.is_success() {
            let detail = upstream_message(&bytes);
            return Err(if status.is_client_error() {
                GatewayError::UpstreamRefused {
                    upstream: self.backend.clone(),
                    status: status.as_u16(),
                    detail,
                }
            } else {
                GatewayError::UpstreamStatus {
                    upstream: self.backend.clone(),
                    status: status.as_u16(),
                    detail,
                }
            });
        }
        let v: Value = serde_json::from_slice(&bytes).map_err(|e| {
            self.invalid(format!(
                "the {} answer is not JSON ({e}): {}",
                self.wire.path(),
                snippet(&bytes)
            ))
        })?;
        let ids = self.wire.read(&mut self.progress, &v).map_err(|d| {
            self.invalid(format!(
                "the {} answer cannot be read: {d}",
                self.wire.path()
            ))
        })?;
        self.decoder.push(&ids).map_err(|m| self.invalid(m))?;
        self.decoder.finish().map_err(|m| self.invalid(m))?;
        let a = self.answer();
        if let Some(FinishReason::Abort(m)) = &self.progress.finish {
            let e = self.aborted(m);
            self.settle(&a, o, false);
            return Err(e);
        }
        self.settle(&a, o, true);
        Ok(Whole::Answer(a))
    }
}

/// The model's context length from its `config.json` (`max_position_embeddings`, or a
/// multimodal model's `text_config.max_position_embeddings`); `None` when it names none.
fn context_of(dir: &std::path::Path) -> Option<u64> {
    let text = std::fs::read_to_string(dir.join("config.json")).ok()?;
    let v: Value = serde_json::from_str(&text).ok()?;
    v.get("max_position_embeddings")
        .or_else(|| v.pointer("/text_config/max_position_embeddings"))
        .and_then(Value::as_u64)
}

/// A backend URL a session may name: absolute http(s) with a host; without a trailing `/`.
pub fn check_backend_url(url: &str) -> Result<String, GatewayError> {
    let bad = |why: &str| {
        GatewayError::field(
            "backend",
            format!("'backend' must be an SGLang-compatible server's http(s) URL ({why}): {url:?}"),
        )
    };
    let uri: http::Uri = url.parse().map_err(|_| bad("not a URL"))?;
    if !matches!(uri.scheme_str(), Some("http" | "https")) {
        return Err(bad("the scheme must be http or https"));
    }
    if uri.host().is_none_or(str::is_empty) {
        return Err(bad("no host"));
    }
    if uri.query().is_some() {
        return Err(bad("a query string is not allowed"));
    }
    Ok(url.trim_end_matches('/').to_string())
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

//! The merge of one session's calls into token-masked training samples.
//!
//! # Rule
//!
//! Calls are taken in `seq` order. Every sample of the session stays open. A call
//! **continues** a sample iff its prompt starts with all of the sample's tokens (the
//! previous prompt + completion of that sample); among several such samples the longest
//! wins, then the most recently extended. The prompt tokens past the sample's end (tool
//! results, user turns, template glue) are appended with loss mask 0 and an unknown
//! logprob, the completion with mask 1, its logprobs (unknown where the record has none)
//! and the weight version that sampled each token (its span's, else the call's). So interleaved parallel branches each keep
//! growing their own sample.
//!
//! A sample's logprobs are of one convention ([`LogprobKind`]: post- or pre-temperature,
//! the record's `upstream_request.graft_logprobs`): its first call with a known logprob
//! decides the sample's `logprob_kind`. A later call of the other convention (a session
//! whose calls reached backends that report differently) still merges, its tokens mask 1,
//! but its logprobs are dropped (unknown) and counted
//! ([`MergeResult::logprob_kind_dropped`], the summary's `logprobs dropped`): a per-token
//! convention would make every consumer of samples handle two distributions in one row,
//! and an unknown logprob is already trained correctly (against a recomputed π_old).
//!
//! Otherwise the call **forks**: a new sample starts with the whole prompt (mask 0) and
//! the completion (mask 1), and the reason is classified by the first rule that holds:
//!
//! 0. [`ForkReason::NewRoot`]: the call starts a conversation of its own: its root (system
//!    prompt and first user message, [`CallTokens::root`]) is none of the open samples'
//!    (a title or summary request, a sub-agent, a small second model beside the rollout's
//!    own conversation). No drift event: nothing was rewritten. Rules 1-4 then only look
//!    at the open samples of the call's own root (when roots are known).
//!
//! 1. [`ForkReason::TemplateDrift`]: the prompt holds ALL of some open sample's tokens, in
//!    order, except in at most [`DRIFT_MAX_REGIONS`] differing regions, each at most
//!    [`DRIFT_MAX_SPAN`] tokens long on the sample's side and on the prompt's side, and the
//!    sample's last tokens (at least [`DRIFT_MIN_TAIL`] of them) are found in the prompt.
//!    Between regions the alignment resynchronises on runs of [`DRIFT_ANCHOR`] equal tokens
//!    (shorter only for the sample's final tokens), nearest first, with a bounded
//!    backtracking search ([`DRIFT_BRANCHING`] candidates per region,
//!    [`DRIFT_MAX_ATTEMPTS`] in all). Typical cause: a template re-rendering history (Qwen3
//!    drops old `<think>` blocks), a harness re-serializing tool arguments, a changing date
//!    in a system prompt. Recorded as a [`Drift`] event: `first_diff_at` = where the prompt
//!    first differs from the sample, `len` = sample tokens inside the differing regions.
//!    When a differing region is a block the harness moved (the sample's tokens from the
//!    region's start, at least [`REORDER_MIN_RUN`] of them, are found verbatim in a part of
//!    the prompt the alignment left unmatched), the fork is [`ForkReason::Reordered`]
//!    instead: the harness reordered its own history (OpenClaw keeps its internal-context
//!    user message last, so each turn's new messages go in before it). Other regions of the
//!    same alignment are allowed (the template's re-rendering the move causes: Qwen3 drops
//!    the `<think>` of an assistant turn that is no longer after the last user message).
//!    Also a [`Drift`] event, with `reason` = `reordered`.
//! 2. [`ForkReason::ParallelBranch`]: the prompt extends an earlier state of the session:
//!    for some call merged into an open sample, the prompt EQUALS that call's prompt (the
//!    same prompt sampled again), or it STARTS WITH the sample's tokens up to the end of
//!    that call's completion while the sample has grown past it (a branch from an earlier
//!    turn). A prompt that starts with an earlier call's prompt and then differs inside
//!    the assistant turn is not a branch (the assistant turn was rewritten).
//! 3. [`ForkReason::Compaction`]: the prompt keeps the start of an open sample (at least
//!    [`COMPACTION_MIN_KEPT_PREFIX`] leading tokens in common) and is much shorter than it:
//!    `prompt_len <= sample_len * COMPACTION_MAX_RATIO_NUM / COMPACTION_MAX_RATIO_DEN`
//!    (at most 3/4). History was dropped or summarised.
//! 4. [`ForkReason::Other`]: anything else (also recorded as a [`Drift`] event, with
//!    `first_diff_at` = the common prefix and `len` = the sample tokens after it);
//!    [`ForkReason::Rewritten`] when the calls' messages name a change the harness made.
//!
//! Every fork and drift event of rules 1, 3 and 4 names what changed, message by message
//! ([`crate::threads::rewrites`]: the sample's last call's messages and answer against the
//! forking call's messages), in the new (or realigned) sample's `rewrites`. Every call is
//! in a thread ([`crate::threads`]): a fork of rules 1-4 stays in its sample's, a new root
//! goes to the thread of its shape; after the merge the main thread is chosen, side
//! samples are linked to their parent and kept or left out by
//! [`MergeOptions::side_threads`].
//!
//! With [`OnDrift::Realign`] a call classified by rule 1 (template drift or reordered)
//! does not fork: it continues the drifted sample, whose tokens become the prompt's own
//! (see [`OnDrift::Realign`]).
//!
//! Rules 1 and 3 look at every open sample (those with the longest common prefix with the
//! prompt first, then the most recently extended); the reference sample named in events
//! is the one the rule matched, for rule 4 the one with the longest common prefix.

use std::collections::{BTreeMap, HashMap};
use std::fmt;

use std::sync::Arc;

use crate::sample::{EventKind, LogprobKind, SAMPLE_SCHEMA_VERSION, Sample, SampleEvent};
use crate::threads::{CallView, Rewrite, SideThreads, ThreadKey};

/// Anchor length (tokens) the drift alignment resynchronises on between differing regions.
pub const DRIFT_ANCHOR: usize = 8;
/// The sample's final tokens must be found in the prompt, at least this many of them (or
/// all remaining ones when fewer than [`DRIFT_ANCHOR`] follow the last region).
pub const DRIFT_MIN_TAIL: usize = 2;
/// Longest differing region (tokens), on the sample's side and on the prompt's side.
pub const DRIFT_MAX_SPAN: usize = 4096;
/// Most differing regions a template drift may have.
pub const DRIFT_MAX_REGIONS: usize = 16;
/// Resynchronisation candidates tried per region (nearest first).
pub const DRIFT_BRANCHING: usize = 4;
/// Resynchronisation searches per (call, sample) pair, in all.
pub const DRIFT_MAX_ATTEMPTS: usize = 64;
/// Open samples the drift alignment is tried against per fork (longest common prefix first).
pub const DRIFT_MAX_SAMPLES: usize = 8;
/// Leading tokens a compacted prompt shares with the sample at least.
pub const COMPACTION_MIN_KEPT_PREFIX: usize = 1;
/// A compacted prompt is at most `NUM/DEN` of the sample's length.
pub const COMPACTION_MAX_RATIO_NUM: usize = 3;
/// See [`COMPACTION_MAX_RATIO_NUM`].
pub const COMPACTION_MAX_RATIO_DEN: usize = 4;
/// Tokens of a differing region (from its start) that must reappear elsewhere in the prompt
/// for the fork to be a move of the harness's ([`ForkReason::Reordered`]), not a re-render.
pub const REORDER_MIN_RUN: usize = 16;

/// One call's tokens, as the policy saw and produced them.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct CallTokens {
    pub call_id: String,
    pub seq: u64,
    /// The FULL prompt the policy saw (not a delta).
    pub prompt_ids: Vec<u32>,
    pub completion_ids: Vec<u32>,
    /// One per completion token (`None` items: unknown); `None` for text-only records that
    /// were re-tokenized. A list of the wrong length is treated as unknown.
    pub completion_logprobs: Option<Vec<Option<f32>>>,
    /// Which distribution `completion_logprobs` come from (the record's
    /// `upstream_request.graft_logprobs`; post-temperature without it).
    pub logprob_kind: LogprobKind,
    pub weight_version: Option<String>,
    /// Which weights sampled which completion tokens, when they changed during the call.
    pub weight_version_spans: Option<Vec<graft_recorder::WeightSpan>>,
    pub finish_reason: Option<String>,
    /// Fingerprint of the conversation the call belongs to (its system prompt and first
    /// user message, [`conversation_root`]); `None` when unknown (then the call is never
    /// a new root).
    pub root: Option<String>,
    /// The reward posted for this call (a process reward for its turn), if any.
    pub reward: Option<f64>,
    /// The call's shape (system prompt and tools), which places a call that starts its own
    /// conversation in a thread ([`crate::threads`]); `None` when unknown (every such call
    /// is one thread).
    pub thread: Option<ThreadKey>,
    /// The call's messages and answer, to name the rewrites of a fork or drift
    /// ([`crate::threads::rewrites`]); `None` when unknown.
    pub view: Option<Arc<CallView>>,
}

impl CallTokens {
    /// The weight version that sampled completion token `i`: its span's, else the call's.
    pub fn version_of(&self, i: usize) -> Option<&str> {
        match &self.weight_version_spans {
            Some(spans) => spans
                .iter()
                .find(|s| (s.start..s.end).contains(&(i as u64)))
                .map(|s| s.version.as_str()),
            None => self.weight_version.as_deref(),
        }
    }
}

impl CallTokens {
    /// The tokens of a record that carries ids (`prompt_token_ids` must be the full
    /// prompt); `None` for a text-only record. A `graft_logprobs` this version does not
    /// know makes the call's logprobs unknown (never trained against a distribution it
    /// cannot name).
    pub fn from_record(rec: &graft_recorder::CallRecord) -> Option<CallTokens> {
        let kind = record_logprob_kind(rec);
        Some(
            CallTokens {
                call_id: rec.call_id.clone(),
                seq: rec.seq,
                prompt_ids: rec.prompt_token_ids.clone()?,
                completion_ids: rec.completion_token_ids.clone()?,
                completion_logprobs: rec.completion_logprobs.clone().filter(|_| kind.is_some()),
                logprob_kind: kind.unwrap_or_default(),
                weight_version: rec.weight_version.clone(),
                weight_version_spans: rec.weight_version_spans.clone(),
                finish_reason: rec.finish_reason.clone(),
                root: conversation_root(rec),
                reward: None,
                thread: None,
                view: None,
            }
            .with_view(crate::threads::call_view(rec)),
        )
    }

    /// The call with its conversation (`view`) and the thread key it gives.
    pub fn with_view(mut self, view: Option<CallView>) -> CallTokens {
        self.thread = view.as_ref().map(CallView::key);
        self.view = view.map(Arc::new);
        self
    }
}

/// The logprob convention a record names in `upstream_request.graft_logprobs`:
/// post-temperature when the key is absent (every record before it), `None` for a value
/// this version does not know.
pub fn record_logprob_kind(rec: &graft_recorder::CallRecord) -> Option<LogprobKind> {
    match rec
        .upstream_request
        .as_ref()
        .and_then(|r| r.get("graft_logprobs"))
    {
        None | Some(serde_json::Value::Null) => Some(LogprobKind::PostTemperature),
        Some(v) => v.as_str().and_then(LogprobKind::parse),
    }
}

/// The text of a message content for the root fingerprint (strings, and text parts joined).
fn root_text(v: Option<&serde_json::Value>) -> serde_json::Value {
    use serde_json::Value;
    match v {
        Some(Value::Array(parts)) => {
            let texts: Vec<&str> = parts
                .iter()
                .filter_map(|p| p.as_str().or_else(|| p.get("text").and_then(Value::as_str)))
                .collect();
            if texts.len() == parts.len() {
                Value::String(texts.join("\n"))
            } else {
                Value::Array(parts.clone())
            }
        }
        Some(v) => v.clone(),
        None => Value::Null,
    }
}

/// A fingerprint of the conversation a record's call belongs to: its system prompt (a
/// `system`/`developer` message, or the request's `system`/`instructions`) and its first
/// user message, as the client sent them (any dialect). Two calls of one conversation
/// share it; a call that starts its own conversation (a title request, a sub-agent) does
/// not. `None` when the request has no conversation (a raw completions prompt is its own
/// first user message).
pub fn conversation_root(rec: &graft_recorder::CallRecord) -> Option<String> {
    use serde_json::{Value, json};
    use sha2::{Digest, Sha256};
    let req = &rec.request;
    let turns = req
        .get("messages")
        .or_else(|| req.get("input"))
        .or_else(|| req.get("prompt"))?;
    let (system, first_user) = match turns {
        Value::Array(items) => {
            fn role(m: &Value) -> &str {
                m.get("role").and_then(Value::as_str).unwrap_or("")
            }
            let system = req
                .get("system")
                .or_else(|| req.get("instructions"))
                .map(|v| root_text(Some(v)))
                .or_else(|| {
                    items
                        .iter()
                        .find(|m| matches!(role(m), "system" | "developer"))
                        .map(|m| root_text(m.get("content")))
                })
                .unwrap_or(Value::Null);
            let user = items
                .iter()
                .find(|m| role(m) == "user")
                .map(|m| root_text(m.get("content")))
                .unwrap_or(Value::Null);
            (system, user)
        }
        other => (
            req.get("instructions").cloned().unwrap_or(Value::Null),
            other.clone(),
        ),
    };
    if system.is_null() && first_user.is_null() {
        return None;
    }
    let key = json!([system, first_user]).to_string();
    let digest = Sha256::digest(key.as_bytes());
    Some(digest.iter().take(12).map(|b| format!("{b:02x}")).collect())
}

/// Why a call started a new sample instead of continuing one.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum ForkReason {
    Compaction,
    TemplateDrift,
    /// Like template drift, but a block of the history was moved by the harness (rule 1).
    Reordered,
    ParallelBranch,
    /// The call starts its own conversation beside the open ones (rule 0).
    NewRoot,
    /// Rule 4's fork, where comparing the calls' messages names what the harness rewrote
    /// (its assistant turn re-serialized, a tool result re-wrapped, ...: the sample's
    /// `rewrites`).
    Rewritten,
    Other,
}

impl ForkReason {
    pub const ALL: [ForkReason; 7] = [
        ForkReason::Compaction,
        ForkReason::TemplateDrift,
        ForkReason::Reordered,
        ForkReason::ParallelBranch,
        ForkReason::NewRoot,
        ForkReason::Rewritten,
        ForkReason::Other,
    ];

    /// The name stored in `Sample::fork_reason`.
    pub fn as_str(self) -> &'static str {
        match self {
            ForkReason::Compaction => "compaction",
            ForkReason::TemplateDrift => "template_drift",
            ForkReason::Reordered => "reordered",
            ForkReason::ParallelBranch => "parallel_branch",
            ForkReason::NewRoot => "new_root",
            ForkReason::Rewritten => "rewritten",
            ForkReason::Other => "other",
        }
    }

    /// The reason named `name` (as [`ForkReason::as_str`] writes it).
    pub fn parse(name: &str) -> Option<ForkReason> {
        ForkReason::ALL.into_iter().find(|r| r.as_str() == name)
    }
}

impl fmt::Display for ForkReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A call whose prompt disagrees with tokens a sample already holds (template drift or an
/// unexplained fork). Never silent: every such fork yields one.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Drift {
    pub call_id: String,
    /// `sample_id` of the sample the prompt was compared with.
    pub against_sample: String,
    /// Index (in that sample's tokens and in the prompt) of the first differing token.
    pub first_diff_at: usize,
    /// Sample tokens inside the differing regions.
    pub len: usize,
    pub reason: ForkReason,
}

/// The samples of one session, and why it forked.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct MergeResult {
    /// In the order they were started.
    pub samples: Vec<Sample>,
    /// (call_id, reason) of every call that started a sample other than the first.
    pub forks: Vec<(String, ForkReason)>,
    pub drift: Vec<Drift>,
    /// Under [`OnDrift::Realign`]: (call_id, sampled tokens that lost their mask) of every
    /// drifted call that continued its sample instead of forking.
    pub realigned: Vec<(String, usize)>,
    /// (call_id, sampled tokens) of every call whose logprobs were dropped (made unknown)
    /// because their convention ([`LogprobKind`]) is not their sample's.
    pub logprob_kind_dropped: Vec<(String, usize)>,
    /// What every fork and drift event changed in the history, message by message.
    pub rewrites: Vec<Rewrite>,
    /// The session's threads, the main one first.
    pub threads: Vec<ThreadInfo>,
    /// Side-thread samples the policy ([`MergeOptions::side_threads`]) left out: not in
    /// `samples`.
    pub side_left_out: Vec<Sample>,
}

/// One thread of a session ([`crate::threads`]).
#[derive(Debug, Clone, PartialEq, Default)]
pub struct ThreadInfo {
    /// `main` or `side`.
    pub kind: &'static str,
    /// The fingerprint of its shape ([`ThreadKey::id`]); `unknown` when the calls' shape
    /// is not known.
    pub id: String,
    /// Its name ([`ThreadKey::name`]).
    pub name: String,
    pub calls: usize,
    /// Its samples' ids, in the order they were started.
    pub samples: Vec<String>,
    /// The `parent_sample` of each side sample, aligned to `samples` (empty for main).
    pub parents: Vec<Option<String>>,
    /// Whether its samples are in the output (a side thread left out by the policy is not).
    pub trained: bool,
}

struct Open {
    sample: Sample,
    /// Index of its thread.
    thread: usize,
    /// Merge index of its first call.
    first_k: usize,
    /// The last call merged into it: its id and conversation.
    last_call: Option<(String, Option<Arc<CallView>>)>,
    /// The conversation root of the call that started it.
    root: Option<String>,
    /// (prompt end, completion end) in `sample.tokens` of each call merged into it.
    bounds: Vec<(usize, usize)>,
    /// Index (in merge order) of the last call merged into it.
    last_touched: usize,
    /// The logprob convention of its first call with a known logprob; `None` until then.
    logprob_kind: Option<LogprobKind>,
}

/// What to do with a call whose prompt drifted from a sample (rule 1).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum OnDrift {
    /// Start a new sample (`template_drift`): every sample reproduces its calls' prompts.
    #[default]
    Fork,
    /// Continue the drifted sample, as slime does: its tokens become the prompt's own
    /// tokens; the sample's tokens that the prompt still holds (the aligned runs) keep
    /// their mask, logprobs and versions, the prompt's rewritten regions are mask 0 (the
    /// earlier sampled tokens they replace are no longer trained). Counted as realigned
    /// (with the sampled tokens that lost their mask), still reported as a drift event.
    Realign,
}

impl OnDrift {
    /// `fork` | `realign`.
    pub fn parse(name: &str) -> Option<OnDrift> {
        match name {
            "fork" => Some(OnDrift::Fork),
            "realign" => Some(OnDrift::Realign),
            _ => None,
        }
    }
}

/// How a session is merged.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct MergeOptions {
    pub on_drift: OnDrift,
    /// What side threads' samples train on ([`crate::threads`]).
    pub side_threads: SideThreads,
}

/// A thread while merging: its shape, calls, and the merge index of its first call.
struct Thread {
    key: Option<ThreadKey>,
    calls: usize,
    first_k: usize,
}

/// Merges one session's calls into samples (see the module docs for the rule).
/// `fingerprints` = (tokenizer, template). Calls are sorted by `seq` (stable) first.
pub fn merge_session(
    session_id: &str,
    group_id: Option<&str>,
    calls: &[CallTokens],
    reward: Option<f64>,
    fingerprints: (&str, &str),
) -> MergeResult {
    merge_session_with(
        session_id,
        group_id,
        calls,
        reward,
        fingerprints,
        MergeOptions::default(),
    )
}

/// [`merge_session`] with options (the drift policy).
pub fn merge_session_with(
    session_id: &str,
    group_id: Option<&str>,
    calls: &[CallTokens],
    reward: Option<f64>,
    fingerprints: (&str, &str),
    options: MergeOptions,
) -> MergeResult {
    let mut order: Vec<&CallTokens> = calls.iter().collect();
    order.sort_by_key(|c| c.seq);

    let mut opens: Vec<Open> = Vec::new();
    let mut threads: Vec<Thread> = Vec::new();
    // (merge index, open index) of every call.
    let mut placed: Vec<(usize, usize)> = Vec::new();
    let mut result = MergeResult::default();
    for (k, call) in order.into_iter().enumerate() {
        let prompt = &call.prompt_ids[..];
        let continued = opens
            .iter()
            .enumerate()
            .filter(|(_, o)| prompt.starts_with(&o.sample.tokens))
            .max_by_key(|(_, o)| (o.sample.tokens.len(), o.last_touched))
            .map(|(i, _)| i);
        let index = match continued {
            Some(i) => {
                let s = &mut opens[i].sample;
                let gap = &prompt[s.tokens.len()..];
                s.tokens.extend_from_slice(gap);
                s.loss_mask.resize(s.tokens.len(), 0);
                s.logprobs.resize(s.tokens.len(), None);
                s.token_weight_versions.resize(s.tokens.len(), None);
                s.token_calls.resize(s.tokens.len(), None);
                i
            }
            None => {
                // The open samples of the call's own conversation (all when unknown).
                let own: Vec<usize> = (0..opens.len())
                    .filter(|&i| {
                        call.root.is_none() || opens[i].root.is_none() || opens[i].root == call.root
                    })
                    .collect();
                let mut realigned = None;
                let new_id = format!("{session_id}/{}", opens.len());
                let mut fork_event = None;
                let mut rewrites = Vec::new();
                // The thread of a sample it forks from; else the thread of its shape.
                let mut thread = None;
                let fork_reason = if opens.is_empty() {
                    None
                } else if own.is_empty() {
                    result
                        .forks
                        .push((call.call_id.clone(), ForkReason::NewRoot));
                    fork_event = Some(SampleEvent {
                        kind: EventKind::Fork,
                        at: 0,
                        len: 0,
                        reason: ForkReason::NewRoot.as_str().to_owned(),
                        call_id: call.call_id.clone(),
                        other_sample: None,
                    });
                    Some(ForkReason::NewRoot.as_str().to_owned())
                } else {
                    let refs: Vec<&Open> = own.iter().map(|&i| &opens[i]).collect();
                    let mut c = classify(&refs, prompt);
                    let against = own[c.against];
                    thread = Some(opens[against].thread);
                    let against_id = opens[against].sample.sample_id.clone();
                    // What the harness changed, message by message (a parallel branch
                    // changed nothing: it extends an earlier state).
                    if c.reason != ForkReason::ParallelBranch
                        && let (Some((prev_id, Some(prev))), Some(next)) =
                            (&opens[against].last_call, &call.view)
                    {
                        rewrites = crate::threads::rewrites(prev, prev_id, next, &call.call_id);
                    }
                    if c.drift_len.is_some() {
                        if c.reason == ForkReason::Other
                            && rewrites.iter().any(|r| r.kind.by_harness())
                        {
                            c.reason = ForkReason::Rewritten;
                        }
                        result.drift.push(Drift {
                            call_id: call.call_id.clone(),
                            against_sample: against_id.clone(),
                            first_diff_at: c.first_diff_at,
                            len: c.drift_len.unwrap_or(0),
                            reason: c.reason,
                        });
                    }
                    let event = |kind, other_sample| SampleEvent {
                        kind,
                        at: u32::try_from(c.first_diff_at).unwrap_or(u32::MAX),
                        len: c
                            .drift_len
                            .map_or(0, |l| u32::try_from(l).unwrap_or(u32::MAX)),
                        reason: c.reason.as_str().to_owned(),
                        call_id: call.call_id.clone(),
                        other_sample,
                    };
                    if matches!(c.reason, ForkReason::TemplateDrift | ForkReason::Reordered)
                        && options.on_drift == OnDrift::Realign
                    {
                        let lost = realign(&mut opens[against], prompt, &c.runs);
                        opens[against]
                            .sample
                            .events
                            .push(event(EventKind::Drift, None));
                        opens[against]
                            .sample
                            .rewrites
                            .extend(rewrites.iter().cloned());
                        result.realigned.push((call.call_id.clone(), lost));
                        realigned = Some(against);
                        None
                    } else {
                        let kind = if c.drift_len.is_some() {
                            EventKind::Drift
                        } else {
                            EventKind::Branch
                        };
                        opens[against]
                            .sample
                            .events
                            .push(event(kind, Some(new_id.clone())));
                        fork_event = Some(event(EventKind::Fork, Some(against_id)));
                        result.forks.push((call.call_id.clone(), c.reason));
                        Some(c.reason.as_str().to_owned())
                    }
                };
                result.rewrites.extend(rewrites.iter().cloned());
                match realigned {
                    Some(i) => i,
                    None => {
                        let thread = match thread {
                            Some(t) => t,
                            None => {
                                let id = call.thread.as_ref().map(|t| &t.id);
                                match threads
                                    .iter()
                                    .position(|t| t.key.as_ref().map(|t| &t.id) == id)
                                {
                                    Some(t) => t,
                                    None => {
                                        threads.push(Thread {
                                            key: call.thread.clone(),
                                            calls: 0,
                                            first_k: k,
                                        });
                                        threads.len() - 1
                                    }
                                }
                            }
                        };
                        opens.push(Open {
                            sample: Sample {
                                sample_id: new_id,
                                session_id: session_id.to_owned(),
                                group_id: group_id.map(str::to_owned),
                                tokens: prompt.to_vec(),
                                loss_mask: vec![0; prompt.len()],
                                logprobs: vec![None; prompt.len()],
                                reward,
                                weight_versions: Vec::new(),
                                token_weight_versions: vec![None; prompt.len()],
                                call_ids: Vec::new(),
                                token_calls: vec![None; prompt.len()],
                                call_rewards: Vec::new(),
                                fork_reason,
                                events: fork_event.into_iter().collect(),
                                tokenizer_fingerprint: fingerprints.0.to_owned(),
                                template_fingerprint: fingerprints.1.to_owned(),
                                schema_version: SAMPLE_SCHEMA_VERSION,
                                logprob_kind: LogprobKind::default(),
                                rewrites,
                                ..Sample::default()
                            },
                            thread,
                            first_k: k,
                            last_call: None,
                            root: call.root.clone(),
                            bounds: Vec::new(),
                            last_touched: k,
                            logprob_kind: None,
                        });
                        opens.len() - 1
                    }
                }
            }
        };
        if let Some(n) = push_completion(&mut opens[index], call, k) {
            result.logprob_kind_dropped.push((call.call_id.clone(), n));
        }
        opens[index].last_call = Some((call.call_id.clone(), call.view.clone()));
        threads[opens[index].thread].calls += 1;
        placed.push((k, index));
    }
    assign_threads(
        &mut opens,
        &threads,
        &placed,
        options.side_threads,
        &mut result,
    );
    result
}

/// Names each sample's thread, links side samples to their parent, and applies the side
/// threads' policy (see [`crate::threads`]).
fn assign_threads(
    opens: &mut Vec<Open>,
    threads: &[Thread],
    placed: &[(usize, usize)],
    policy: SideThreads,
    result: &mut MergeResult,
) {
    // The main thread: the most tools, then the most calls, then the first started.
    let main = (0..threads.len()).max_by_key(|&t| {
        let th = &threads[t];
        (
            th.key.as_ref().map_or(0, |k| k.tools.len()),
            th.calls,
            std::cmp::Reverse(th.first_k),
        )
    });
    let main_key = main.and_then(|m| threads[m].key.as_ref());
    let first_main = opens.iter().position(|o| Some(o.thread) == main);
    let parent_of = |opens: &[Open], o: &Open| -> Option<String> {
        placed
            .iter()
            .rev()
            .find(|&&(k, i)| k < o.first_k && Some(opens[i].thread) == main)
            .map(|&(_, i)| i)
            .or(first_main)
            .map(|i| opens[i].sample.sample_id.clone())
    };
    let parents: Vec<Option<String>> = opens
        .iter()
        .map(|o| {
            if Some(o.thread) == main {
                None
            } else {
                parent_of(opens, o)
            }
        })
        .collect();
    let mut infos: Vec<ThreadInfo> = threads
        .iter()
        .enumerate()
        .map(|(t, th)| ThreadInfo {
            kind: if Some(t) == main { "main" } else { "side" },
            id: th
                .key
                .as_ref()
                .map_or_else(|| "unknown".to_owned(), |k| k.id.clone()),
            name: th
                .key
                .as_ref()
                .map(|k| k.name(main_key))
                .unwrap_or_default(),
            calls: th.calls,
            samples: Vec::new(),
            parents: Vec::new(),
            trained: false,
        })
        .collect();
    for (o, parent) in opens.drain(..).zip(parents) {
        let info = &mut infos[o.thread];
        let mut s = o.sample;
        s.thread = info.kind.to_owned();
        s.thread_id = info.id.clone();
        s.thread_name = info.name.clone();
        s.parent_sample = parent.clone();
        info.samples.push(s.sample_id.clone());
        if info.kind == "side" {
            info.parents.push(parent);
        }
        let keep = info.kind == "main"
            || match policy {
                SideThreads::Session => true,
                SideThreads::LeaveOut => false,
                SideThreads::Own => {
                    let own = s.call_rewards.iter().any(|r| r.is_some_and(f64::is_finite));
                    if own {
                        // Trained on its own call rewards, not the session's.
                        s.reward = None;
                    }
                    own
                }
            };
        if keep {
            info.trained = true;
            result.samples.push(s);
        } else {
            result.side_left_out.push(s);
        }
    }
    if let Some(m) = main {
        let info = infos.remove(m);
        infos.insert(0, info);
    }
    result.threads = infos;
}

/// Makes `open`'s sample the drifted `prompt` (see [`OnDrift::Realign`]): the sample's
/// tokens in the aligned `runs` keep their mask, logprob and version; the rest of the
/// prompt is mask 0. Returns how many sampled (mask 1) tokens lost their mask.
fn realign(open: &mut Open, prompt: &[u32], runs: &[(usize, usize, usize)]) -> usize {
    let s = &mut open.sample;
    let n = prompt.len();
    let mut mask = vec![0u8; n];
    let mut logprobs = vec![None; n];
    let mut versions = vec![None; n];
    let mut token_calls = vec![None; n];
    let mut kept = 0;
    for &(a, b, len) in runs {
        let len = len
            .min(n.saturating_sub(b))
            .min(s.tokens.len().saturating_sub(a));
        for k in 0..len {
            mask[b + k] = s.loss_mask[a + k];
            logprobs[b + k] = s.logprobs[a + k];
            versions[b + k] = s.token_weight_versions[a + k];
            token_calls[b + k] = s.token_calls.get(a + k).copied().flatten();
            kept += usize::from(s.loss_mask[a + k] == 1);
        }
    }
    let lost = s.trained_tokens().saturating_sub(kept);
    // Earlier events move with the tokens they point at (or to the end of the aligned run
    // before them, when their token was rewritten).
    for ev in &mut s.events {
        let at = ev.at as usize;
        if let Some(&(a, b, len)) = runs.iter().rev().find(|&&(a, _, _)| a <= at) {
            let to = if at < a + len { b + (at - a) } else { b + len };
            ev.at = u32::try_from(to).unwrap_or(u32::MAX);
        }
    }
    s.tokens = prompt.to_vec();
    s.loss_mask = mask;
    s.logprobs = logprobs;
    s.token_weight_versions = versions;
    s.token_calls = token_calls;
    // The earlier calls' ends no longer index these tokens.
    open.bounds.clear();
    lost
}

/// Appends `call`'s completion to `open`'s sample. Returns the number of its sampled
/// tokens when their logprobs were dropped for another convention than the sample's.
fn push_completion(open: &mut Open, call: &CallTokens, k: usize) -> Option<usize> {
    let s = &mut open.sample;
    let prompt_end = s.tokens.len();
    let n = call.completion_ids.len();
    s.tokens.extend_from_slice(&call.completion_ids);
    s.loss_mask.resize(s.tokens.len(), 1);
    let mut dropped = None;
    let known = call
        .completion_logprobs
        .as_deref()
        .filter(|l| l.len() == n && l.iter().any(Option::is_some));
    // A sample's logprobs are of one convention: its first call with a known logprob
    // decides it; a later call of the other one keeps its tokens (mask 1) but not its
    // logprobs (unknown: trained against a recomputed π_old, see docs/records.md).
    let known = match (known, open.logprob_kind) {
        (Some(_), Some(kind)) if kind != call.logprob_kind => {
            dropped = Some(n);
            None
        }
        (Some(l), None) => {
            open.logprob_kind = Some(call.logprob_kind);
            s.logprob_kind = call.logprob_kind;
            Some(l)
        }
        (l, _) => l,
    };
    match known {
        Some(l) => s.logprobs.extend_from_slice(l),
        None => s.logprobs.resize(s.tokens.len(), None),
    }
    let call_index = u32::try_from(s.call_ids.len()).ok();
    s.call_ids.push(call.call_id.clone());
    s.call_rewards.push(call.reward);
    s.token_calls.resize(prompt_end, None);
    s.token_calls.resize(s.tokens.len(), call_index);
    let mut index = |v: &str| -> Option<u32> {
        let i = match s.weight_versions.iter().position(|w| w == v) {
            Some(i) => i,
            None => {
                s.weight_versions.push(v.to_owned());
                s.weight_versions.len() - 1
            }
        };
        u32::try_from(i).ok()
    };
    // Versions in order of first appearance: the call's spans, then its own version.
    let mut versions = Vec::with_capacity(n);
    let mut last: Option<(&str, Option<u32>)> = None;
    for i in 0..n {
        let v = call.version_of(i);
        let id = match (v, last) {
            (Some(v), Some((l, id))) if l == v => id,
            (Some(v), _) => index(v),
            (None, _) => None,
        };
        last = v.map(|v| (v, id));
        versions.push(id);
    }
    if let Some(v) = &call.weight_version {
        index(v);
    }
    s.token_weight_versions.extend(versions);
    open.bounds.push((prompt_end, s.tokens.len()));
    open.last_touched = k;
    dropped
}

struct Classified {
    reason: ForkReason,
    /// Index into the open samples of the sample the reason refers to.
    against: usize,
    first_diff_at: usize,
    /// `Some(len)` when the fork is a drift event.
    drift_len: Option<usize>,
    /// Template drift: where the sample's tokens lie in the prompt.
    runs: Vec<(usize, usize, usize)>,
}

fn lcp(a: &[u32], b: &[u32]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

fn classify(opens: &[&Open], prompt: &[u32]) -> Classified {
    let lcps: Vec<usize> = opens
        .iter()
        .map(|o| lcp(prompt, &o.sample.tokens))
        .collect();
    let mut by_prefix: Vec<usize> = (0..opens.len()).collect();
    by_prefix.sort_by_key(|&i| {
        (
            std::cmp::Reverse(lcps[i]),
            std::cmp::Reverse(opens[i].last_touched),
        )
    });

    // 1. template drift
    let p = Hashed::new(prompt);
    for &i in by_prefix.iter().take(DRIFT_MAX_SAMPLES) {
        let t = Hashed::new(&opens[i].sample.tokens);
        if let Some(a) = align_drift(&t, &p, lcps[i]) {
            let reason = if moved_block(&t, &p, &a.runs) {
                ForkReason::Reordered
            } else {
                ForkReason::TemplateDrift
            };
            return Classified {
                reason,
                against: i,
                first_diff_at: lcps[i],
                drift_len: Some(a.changed),
                runs: a.runs,
            };
        }
    }

    // 2. parallel branch
    for &i in &by_prefix {
        let l = lcps[i];
        let n = opens[i].sample.tokens.len();
        let branch = opens[i].bounds.iter().any(|&(prompt_end, completion_end)| {
            (prompt.len() == prompt_end && l >= prompt_end)
                || (completion_end < n && completion_end > 0 && l >= completion_end)
        });
        if branch {
            return Classified {
                reason: ForkReason::ParallelBranch,
                against: i,
                first_diff_at: l,
                drift_len: None,
                runs: Vec::new(),
            };
        }
    }

    // 3. compaction
    for &i in &by_prefix {
        let n = opens[i].sample.tokens.len();
        if lcps[i] >= COMPACTION_MIN_KEPT_PREFIX
            && prompt.len() * COMPACTION_MAX_RATIO_DEN <= n * COMPACTION_MAX_RATIO_NUM
        {
            return Classified {
                reason: ForkReason::Compaction,
                against: i,
                first_diff_at: lcps[i],
                drift_len: None,
                runs: Vec::new(),
            };
        }
    }

    // 4. other
    let i = by_prefix.first().copied().unwrap_or(0);
    let l = lcps.get(i).copied().unwrap_or(0);
    let n = opens.get(i).map_or(0, |o| o.sample.tokens.len());
    Classified {
        reason: ForkReason::Other,
        against: i,
        first_diff_at: l,
        drift_len: Some(n.saturating_sub(l)),
        runs: Vec::new(),
    }
}

// -------------------------------------------------------------------------------------
// Drift alignment

const HASH_BASE: u64 = 0x9E37_79B9_7F4A_7C15;
const HASH_MIX: u64 = 0xD6E8_FEB8_6659_FD93;

/// A token sequence with polynomial prefix hashes (mod 2^64), for O(1) range comparison.
struct Hashed<'a> {
    s: &'a [u32],
    pre: Vec<u64>,
    pow: Vec<u64>,
}

impl<'a> Hashed<'a> {
    fn new(s: &'a [u32]) -> Self {
        let mut pre = Vec::with_capacity(s.len() + 1);
        let mut pow = Vec::with_capacity(s.len() + 1);
        let (mut h, mut p) = (0u64, 1u64);
        pre.push(h);
        pow.push(p);
        for &t in s {
            h = h
                .wrapping_mul(HASH_BASE)
                .wrapping_add((u64::from(t) + 1).wrapping_mul(HASH_MIX));
            p = p.wrapping_mul(HASH_BASE);
            pre.push(h);
            pow.push(p);
        }
        Hashed { s, pre, pow }
    }

    fn len(&self) -> usize {
        self.s.len()
    }

    /// Hash of `s[a..a + len]`.
    fn range(&self, a: usize, len: usize) -> u64 {
        self.pre[a + len].wrapping_sub(self.pre[a].wrapping_mul(self.pow[len]))
    }

    fn same(&self, a: usize, other: &Hashed<'_>, b: usize, len: usize) -> bool {
        self.range(a, len) == other.range(b, len) && self.s[a..a + len] == other.s[b..b + len]
    }

    /// Length of the common prefix of `self[a..]` and `other[b..]` (by hash, binary search).
    fn lcp_at(&self, a: usize, other: &Hashed<'_>, b: usize) -> usize {
        let (mut lo, mut hi) = (0, (self.len() - a).min(other.len() - b));
        while lo < hi {
            let mid = lo + (hi - lo).div_ceil(2);
            if self.range(a, mid) == other.range(b, mid) {
                lo = mid;
            } else {
                hi = mid - 1;
            }
        }
        lo
    }
}

/// Aligns the sample `t` against the prompt `p`, which agree on their first `start`
/// tokens; `Some(sample tokens inside differing regions)` when `p` holds all of `t` except
/// in small regions (module docs, rule 1).
fn align_drift(t: &Hashed<'_>, p: &Hashed<'_>, start: usize) -> Option<Alignment> {
    if start >= t.len() {
        return None;
    }
    let mut attempts = 0;
    let (changed, mut runs) = align_from(t, p, start, start, 0, &mut attempts)?;
    runs.push((0, 0, start));
    runs.reverse();
    Some(Alignment { changed, runs })
}

/// How a sample's tokens lie in a drifted prompt.
struct Alignment {
    /// Sample tokens inside the differing regions.
    changed: usize,
    /// `(sample index, prompt index, len)` of the runs where they agree, in order.
    runs: Vec<(usize, usize, usize)>,
}

/// `(changed, runs)` with the runs in reverse order.
type Aligned = (usize, Vec<(usize, usize, usize)>);

fn align_from(
    t: &Hashed<'_>,
    p: &Hashed<'_>,
    i: usize,
    j: usize,
    regions: usize,
    attempts: &mut usize,
) -> Option<Aligned> {
    if regions >= DRIFT_MAX_REGIONS || *attempts >= DRIFT_MAX_ATTEMPTS {
        return None;
    }
    *attempts += 1;
    for (dt, dp) in resync_candidates(t, p, i, j) {
        let a = i + dt;
        let b = j + dp;
        let run = t.lcp_at(a, p, b);
        if a + run == t.len() {
            return Some((dt, vec![(a, b, run)]));
        }
        if let Some((rest, mut runs)) = align_from(t, p, a + run, b + run, regions + 1, attempts) {
            runs.push((a, b, run));
            return Some((dt + rest, runs));
        }
        if *attempts >= DRIFT_MAX_ATTEMPTS {
            return None;
        }
    }
    None
}

/// Up to [`DRIFT_BRANCHING`] places `(dt, dp)` where `t[i + dt..]` and `p[j + dp..]`
/// agree again (on [`DRIFT_ANCHOR`] tokens, or on all of `t`'s remaining tokens when
/// fewer), nearest (smallest `dt + dp`) first.
fn resync_candidates(t: &Hashed<'_>, p: &Hashed<'_>, i: usize, j: usize) -> Vec<(usize, usize)> {
    let (n, m) = (t.len(), p.len());
    let mut found: Vec<(usize, usize)> = Vec::new();
    const MAX_FOUND: usize = 1024;

    // Full anchors: index the prompt's anchors in its window.
    let p_last = m.saturating_sub(DRIFT_ANCHOR);
    let mut anchors: HashMap<u64, Vec<usize>> = HashMap::new();
    if m >= DRIFT_ANCHOR {
        for b in j..=p_last.min(j + DRIFT_MAX_SPAN) {
            anchors
                .entry(p.range(b, DRIFT_ANCHOR))
                .or_default()
                .push(b - j);
        }
    }
    'outer: for dt in 0..=DRIFT_MAX_SPAN {
        let a = i + dt;
        if a + DRIFT_ANCHOR > n {
            break;
        }
        if let Some(hits) = anchors.get(&t.range(a, DRIFT_ANCHOR)) {
            for &dp in hits {
                // Skip the inside of a run already found on the same diagonal.
                if dt > 0 && dp > 0 && t.s[a - 1] == p.s[j + dp - 1] {
                    continue;
                }
                if t.same(a, p, j + dp, DRIFT_ANCHOR) {
                    found.push((dt, dp));
                    if found.len() >= MAX_FOUND {
                        break 'outer;
                    }
                }
            }
        }
    }
    // The sample's final tokens, fewer than an anchor.
    let tail_from = n.saturating_sub(DRIFT_ANCHOR - 1).max(i);
    for a in tail_from..n {
        let (dt, r) = (a - i, n - a);
        if r < DRIFT_MIN_TAIL || dt > DRIFT_MAX_SPAN {
            continue;
        }
        for dp in 0..=DRIFT_MAX_SPAN {
            let b = j + dp;
            if b + r > m {
                break;
            }
            if (dt == 0 || dp == 0 || t.s[a - 1] != p.s[b - 1]) && t.same(a, p, b, r) {
                found.push((dt, dp));
            }
        }
    }
    found.retain(|&(dt, dp)| dt + dp > 0);
    found.sort_by_key(|&(dt, dp)| (dt + dp, dt));
    found.truncate(DRIFT_BRANCHING);
    found
}

/// Whether a differing region of the alignment `runs` of the sample `t` in the prompt `p`
/// is a moved block: the sample's tokens from the region's start, at least
/// [`REORDER_MIN_RUN`] of them (a shorter region is no move), are found verbatim in a part
/// of `p` that no run covers.
fn moved_block(t: &Hashed<'_>, p: &Hashed<'_>, runs: &[(usize, usize, usize)]) -> bool {
    // The prompt's parts no run covers: between runs, and after the last one.
    let mut free: Vec<(usize, usize)> = Vec::new();
    let mut at = 0;
    for &(_, b, len) in runs {
        if b > at {
            free.push((at, b));
        }
        at = at.max(b + len);
    }
    if p.len() > at {
        free.push((at, p.len()));
    }
    // The sample's differing regions: between consecutive runs.
    runs.windows(2).any(|w| {
        let (a0, _, len0) = w[0];
        let (a1, _, _) = w[1];
        let (g0, g1) = (a0 + len0, a1);
        if g1 < g0 + REORDER_MIN_RUN {
            return false;
        }
        free.iter().any(|&(f0, f1)| {
            f1 >= f0 + REORDER_MIN_RUN
                && (f0..=f1 - REORDER_MIN_RUN).any(|y| {
                    p.range(y, REORDER_MIN_RUN) == t.range(g0, REORDER_MIN_RUN)
                        && t.same(g0, p, y, REORDER_MIN_RUN)
                })
        })
    })
}

// -------------------------------------------------------------------------------------
// Summary

/// Totals over merged sessions, for the CLI.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Summary {
    pub sessions: u64,
    pub samples: u64,
    /// Forks per [`ForkReason::as_str`] name; every reason is present once anything was added.
    pub forks_by_reason: BTreeMap<String, u64>,
    /// Tokens with loss mask 1.
    pub trained_tokens: u64,
    pub total_tokens: u64,
    pub drift_events: u64,
    /// Drifted calls that continued their sample ([`OnDrift::Realign`]).
    pub realigned: u64,
    /// Sampled tokens that realignment left untrained (their re-rendered text is mask 0).
    pub realigned_untrained_tokens: u64,
    /// Calls whose logprobs were dropped because their convention is not their sample's
    /// ([`MergeResult::logprob_kind_dropped`]), and their sampled tokens.
    pub logprob_kind_dropped: u64,
    pub logprob_kind_dropped_tokens: u64,
    /// Rewrites named at forks and drift events, per [`crate::threads::RewriteKind`] name.
    pub rewrites_by_kind: BTreeMap<String, u64>,
    /// The first [`SUMMARY_EXAMPLES`] rewrites, with their excerpts.
    pub rewrite_examples: Vec<Rewrite>,
    /// Threads of the merged sessions: main ones (one per session with calls) and side ones.
    pub main_threads: u64,
    pub side_threads: u64,
    /// What side threads trained on ([`MergeOptions::side_threads`]).
    pub side_policy: SideThreads,
    /// Side-thread samples kept in the output, and those the policy left out (with their calls).
    pub side_samples_trained: u64,
    pub side_samples_left_out: u64,
    pub side_calls_left_out: u64,
    /// The first [`SUMMARY_EXAMPLES`] side threads: (session, thread).
    pub side_thread_examples: Vec<(String, ThreadInfo)>,
}

/// Rewrites and side threads a summary shows one by one.
pub const SUMMARY_EXAMPLES: usize = 20;

impl Summary {
    /// Adds one session's result.
    pub fn add(&mut self, result: &MergeResult) {
        self.sessions += 1;
        self.samples += result.samples.len() as u64;
        for r in ForkReason::ALL {
            self.forks_by_reason
                .entry(r.as_str().to_owned())
                .or_insert(0);
        }
        for (_, reason) in &result.forks {
            *self
                .forks_by_reason
                .entry(reason.as_str().to_owned())
                .or_insert(0) += 1;
        }
        for s in &result.samples {
            self.trained_tokens += s.trained_tokens() as u64;
            self.total_tokens += s.tokens.len() as u64;
        }
        self.drift_events += result.drift.len() as u64;
        self.realigned += result.realigned.len() as u64;
        self.realigned_untrained_tokens +=
            result.realigned.iter().map(|(_, n)| *n as u64).sum::<u64>();
        for r in &result.rewrites {
            *self
                .rewrites_by_kind
                .entry(r.kind.as_str().to_owned())
                .or_insert(0) += 1;
            if self.rewrite_examples.len() < SUMMARY_EXAMPLES {
                self.rewrite_examples.push(r.clone());
            }
        }
        for t in &result.threads {
            if t.kind == "main" {
                self.main_threads += 1;
                continue;
            }
            self.side_threads += 1;
            if self.side_thread_examples.len() < SUMMARY_EXAMPLES {
                let session = result
                    .samples
                    .iter()
                    .chain(&result.side_left_out)
                    .next()
                    .map(|s| s.session_id.clone())
                    .unwrap_or_default();
                self.side_thread_examples.push((session, t.clone()));
            }
        }
        for s in &result.samples {
            self.side_samples_trained += u64::from(s.thread == "side");
        }
        self.side_samples_left_out += result.side_left_out.len() as u64;
        self.side_calls_left_out += result
            .side_left_out
            .iter()
            .map(|s| s.call_ids.len() as u64)
            .sum::<u64>();
        self.logprob_kind_dropped += result.logprob_kind_dropped.len() as u64;
        self.logprob_kind_dropped_tokens += result
            .logprob_kind_dropped
            .iter()
            .map(|(_, n)| *n as u64)
            .sum::<u64>();
    }

    /// The summary of `results`.
    pub fn of<'a>(results: impl IntoIterator<Item = &'a MergeResult>) -> Summary {
        let mut s = Summary::default();
        for r in results {
            s.add(r);
        }
        s
    }

    /// Total forks.
    pub fn forks(&self) -> u64 {
        self.forks_by_reason.values().sum()
    }
}

impl fmt::Display for Summary {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f, "sessions:       {}", self.sessions)?;
        writeln!(f, "samples:        {}", self.samples)?;
        let parts: Vec<String> = ForkReason::ALL
            .iter()
            .map(|r| {
                let n = self.forks_by_reason.get(r.as_str()).copied().unwrap_or(0);
                format!("{r} {n}")
            })
            .collect();
        writeln!(f, "forks:          {} ({})", self.forks(), parts.join(", "))?;
        let pct = if self.total_tokens == 0 {
            0.0
        } else {
            100.0 * self.trained_tokens as f64 / self.total_tokens as f64
        };
        writeln!(
            f,
            "trained tokens: {} of {} ({pct:.1}%)",
            self.trained_tokens, self.total_tokens
        )?;
        write!(f, "drift events:   {}", self.drift_events)?;
        if self.realigned > 0 {
            write!(
                f,
                "\nrealigned:      {} calls ({} sampled tokens left untrained)",
                self.realigned, self.realigned_untrained_tokens
            )?;
        }
        if self.logprob_kind_dropped > 0 {
            write!(
                f,
                "\nlogprobs dropped: {} calls ({} sampled tokens) whose logprob convention (pre/post temperature) differs from their sample's; they train without rollout logprobs",
                self.logprob_kind_dropped, self.logprob_kind_dropped_tokens
            )?;
        }
        if self.main_threads > 0 {
            write!(
                f,
                "\nthreads:        {} main, {} side; side threads are {} (--side-threads {}): {} samples ({} calls) left out, {} trained",
                self.main_threads,
                self.side_threads,
                self.side_policy.describe(),
                self.side_policy.as_str(),
                self.side_samples_left_out,
                self.side_calls_left_out,
                self.side_samples_trained
            )?;
        }
        for (session, t) in self.side_thread_examples.iter().take(5) {
            let links: Vec<String> = t
                .samples
                .iter()
                .zip(&t.parents)
                .map(|(s, p)| match p {
                    Some(p) => format!("{s} (parent {p})"),
                    None => s.clone(),
                })
                .collect();
            write!(
                f,
                "\nside thread:    {session} {} «{}»: {} calls in {}, {}",
                t.id,
                t.name,
                t.calls,
                links.join(", "),
                if t.trained { "trained" } else { "left out" }
            )?;
        }
        if !self.rewrites_by_kind.is_empty() {
            let parts: Vec<String> = self
                .rewrites_by_kind
                .iter()
                .map(|(k, n)| format!("{k} {n}"))
                .collect();
            write!(f, "\nrewrites:       {}", parts.join(", "))?;
            for r in self.rewrite_examples.iter().take(5) {
                write!(f, "\nrewrite:        {r}")?;
            }
        }
        Ok(())
    }
}

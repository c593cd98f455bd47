//! The `CallRecord` schema and its on-disk form.

use serde::{Deserialize, Serialize};

use crate::delta::{self, RequestDelta, TokenIdsDelta};
use crate::redact::redact_json;

/// Version of the record schema written by this build. Changes are additive only:
/// new optional fields, never renamed or retyped ones.
///
/// - 1: the client's request and response.
/// - 2: adds `normalized_request`, `normalized_response`, `upstream_request` and
///   `upstream_dialect` (dialect translation). Version 1 data reads back with them `None`.
/// - 3: an item of `completion_logprobs` may be null (the backend sent no logprob for
///   that token: unknown, never 0.0); adds `weight_version_spans`. Earlier data reads back
///   with every logprob known and no spans.
pub const SCHEMA_VERSION: u32 = 3;

/// Completion tokens `start..end` (indices into `completion_token_ids`) were sampled by
/// the weights of `version` (SGLang's `meta_info.weight_versions`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct WeightSpan {
    pub version: String,
    pub start: u64,
    pub end: u64,
}

/// A call of a branch session (`POST /graft/sessions` with `branch_of`): whether the
/// gateway answered it from its parent's record or sampled it live, and what differed.
/// Every call of a branch carries one.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Replay {
    /// The parent session.
    pub branch_of: String,
    /// The branch point: the parent's first `at_call` answered calls are replayed.
    pub at_call: u64,
    /// `tolerant` or `strict`.
    pub policy: String,
    /// The call's position in the branch (1: its first call).
    pub position: u64,
    /// The parent's call this one was answered from (its call id); `None`: sampled live.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub replayed_from: Option<String>,
    /// That call's `seq` in the parent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub parent_seq: Option<u64>,
    /// For a live call: why (the branch point was reached, the request differed from the
    /// parent's, or the branch went live at an earlier call).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub live: Option<String>,
    /// Where this call's request differed from the parent's at the same position (the
    /// volatile differences a tolerant replay answered through, or the one that sent it
    /// live); empty when it matched.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub differences: Vec<Difference>,
}

impl Replay {
    /// Whether the call was answered from the parent's record (never trained in the branch).
    pub fn replayed(&self) -> bool {
        self.replayed_from.is_some()
    }
}

/// One place a branch call's request differed from its parent's.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Difference {
    /// Where: `messages[0].content`, `tools`, `prompt_token_ids[42]`, ...
    pub at: String,
    /// What kind: a volatile rule's name (`timestamp`, `uuid`, `hex_id`, `long_number`), or
    /// `turn` (the conversation itself differs), `tokens` (exact mode's prompt ids).
    pub kind: String,
    /// Excerpts of the parent's and the branch's side.
    pub parent: String,
    pub branch: String,
}

/// Token usage as reported by the upstream.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Usage {
    pub prompt_tokens: Option<u64>,
    pub completion_tokens: Option<u64>,
    pub total_tokens: Option<u64>,
}

impl Usage {
    fn is_empty(&self) -> bool {
        self.prompt_tokens.is_none()
            && self.completion_tokens.is_none()
            && self.total_tokens.is_none()
    }
}

/// What a call came to: the words [`CallRecord::outcome`] holds, compared through this type
/// rather than by spelling.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CallOutcome {
    Ok,
    ClientError,
    UpstreamError,
    GraftError,
    ClientDisconnected,
}

impl CallOutcome {
    pub const ALL: [CallOutcome; 5] = [
        CallOutcome::Ok,
        CallOutcome::ClientError,
        CallOutcome::UpstreamError,
        CallOutcome::GraftError,
        CallOutcome::ClientDisconnected,
    ];

    /// The word the record keeps.
    pub const fn as_str(self) -> &'static str {
        match self {
            CallOutcome::Ok => "ok",
            CallOutcome::ClientError => "client_error",
            CallOutcome::UpstreamError => "upstream_error",
            CallOutcome::GraftError => "graft_error",
            CallOutcome::ClientDisconnected => "client_disconnected",
        }
    }

    /// The outcome a record's word names (`None` for a word this build does not know).
    pub fn parse(word: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|o| o.as_str() == word)
    }
}

/// The wires graft speaks to a backend, as [`CallRecord::upstream_dialect`] names them when
/// the call did not go upstream in the client's own dialect.
pub mod wire {
    /// OpenAI Chat Completions (translation of another dialect, passthrough with token ids).
    pub const CHAT_COMPLETIONS: &str = "chat_completions";
    /// Exact mode over SGLang's native `/generate`.
    pub const SGLANG_GENERATE: &str = "sglang_generate";
    /// Exact mode over vLLM's `/v1/completions` with prompt token ids.
    pub const VLLM_COMPLETIONS: &str = "vllm_completions";
}

/// One inference call as the gateway saw it. `request`, `normalized_request` and
/// `upstream_request` are always FULL values here; on disk each is stored as a delta
/// against the same value of an earlier call of the session.
///
/// `Default` gives an empty record (schema version 0, empty strings, `None`s, `request`
/// `null`); set `schema_version` to [`SCHEMA_VERSION`].
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct CallRecord {
    pub schema_version: u32,
    /// UUIDv7 string, set by the caller.
    pub call_id: String,
    pub session_id: String,
    pub group_id: Option<String>,
    /// Per-session sequence, assigned by the recorder (callers pass 0); 1-based and
    /// increasing in WAL order (gaps are possible after a failed write).
    pub seq: u64,
    /// Unix microseconds.
    pub started_at_us: i64,
    pub finished_at_us: i64,
    /// "chat_completions" | "completions" | "models" | "responses" | "anthropic_messages"
    pub dialect: String,
    pub endpoint: String,
    pub model: Option<String>,
    pub upstream: String,
    pub stream: bool,
    /// The client's request body, already redacted by the caller.
    pub request: serde_json::Value,
    pub response: Option<serde_json::Value>,
    pub status: u16,
    /// [`CallOutcome::as_str`]: "ok" | "client_error" | "upstream_error" | "graft_error" |
    /// "client_disconnected".
    pub outcome: String,
    pub error: Option<String>,
    pub prompt_token_ids: Option<Vec<u32>>,
    pub completion_token_ids: Option<Vec<u32>>,
    /// One per completion token; an item is `None` where the backend gave no logprob
    /// (unknown: never stored as 0.0).
    pub completion_logprobs: Option<Vec<Option<f32>>>,
    pub finish_reason: Option<String>,
    /// The version of the weights that answered (the last one when they changed during
    /// the call; see `weight_version_spans`).
    pub weight_version: Option<String>,
    /// A `Usage` whose three fields are all `None` is stored as `None`.
    pub usage: Option<Usage>,
    pub ttft_ms: Option<f64>,
    pub latency_ms: f64,
    /// The client's user-agent.
    pub client: Option<String>,
    /// Since v2. The conversation in graft's internal form (an object whose conversation
    /// list is under `messages`, plus `tools`, `sampling`, `model`, `notes`, ...), already
    /// redacted by the caller. `None` when the call was not normalized.
    #[serde(default)]
    pub normalized_request: Option<serde_json::Value>,
    /// Since v2. The answer in graft's internal form.
    #[serde(default)]
    pub normalized_response: Option<serde_json::Value>,
    /// Since v2. The request graft sent upstream when it differs from `request` (dialect
    /// translation, or token-id fields added for a vLLM/SGLang upstream); `None` when the
    /// client's body was forwarded unchanged.
    #[serde(default)]
    pub upstream_request: Option<serde_json::Value>,
    /// Since v2. The upstream's dialect (same names as `dialect`); `None` when unknown or
    /// not recorded.
    #[serde(default)]
    pub upstream_dialect: Option<String>,
    /// Since v3. Which weights sampled which completion tokens, when the backend reported
    /// it (SGLang's `meta_info.weight_versions`): spans in order, covering the completion.
    /// `None` when it did not (then every token is `weight_version`'s).
    #[serde(default)]
    pub weight_version_spans: Option<Vec<WeightSpan>>,
    /// Additive (no schema version of its own; absent in older data). The sampling policy
    /// the gateway applied, as `{"policy", "requested", "sent"}`: the policy, the client's
    /// sampling parameters, and the ones sent upstream. `None`: no policy applied.
    #[serde(default)]
    pub sampling: Option<serde_json::Value>,
    /// Additive. Which attempt of its turn this call is (1: the first); `None` when the
    /// gateway did not look (older data).
    #[serde(default)]
    pub attempt: Option<u32>,
    /// Additive. For a retry (`attempt` > 1): the call id of the turn's first attempt.
    #[serde(default)]
    pub retry_of: Option<String>,
    /// Additive. Exact mode: how the backend said generation ended (`stop`, `length`,
    /// `abort`) where `finish_reason` says what the client was told (e.g. `tool_calls`,
    /// `tool_use`); `None` for other calls and older data.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub backend_finish_reason: Option<String>,
    /// Additive. Exact mode: what a `stop` finish matched, as the backend said it: a stop
    /// string (`"Observation:"`), a stop token id, or several ids (SGLang's
    /// `finish_reason.matched`, vLLM's `stop_reason`); `None` for an end-of-sequence
    /// finish on vLLM, other finishes, other calls and older data.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stop_matched: Option<serde_json::Value>,
    /// Additive. The request headers the gateway was configured to record
    /// (`recorder.record_headers`: names lower-cased, never credentials), name → value;
    /// `None` when none were configured or present.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub headers: Option<std::collections::BTreeMap<String, String>>,
    /// Additive. A branch session's call: replayed from the parent's record or live, and
    /// what differed ([`Replay`]); `None` for calls of other sessions and older data.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub replay: Option<Replay>,
}

impl CallRecord {
    /// Whether the call was answered ([`CallOutcome::Ok`]).
    pub fn is_ok(&self) -> bool {
        self.outcome == CallOutcome::Ok.as_str()
    }

    /// Replaces credentials (see [`crate::redact_json`]) in every JSON value of the record:
    /// `request`, `response`, `normalized_request`, `normalized_response` and
    /// `upstream_request`.
    pub fn redact_credentials(&mut self) {
        redact_json(&mut self.request);
        for v in [
            &mut self.response,
            &mut self.normalized_request,
            &mut self.normalized_response,
            &mut self.upstream_request,
            &mut self.sampling,
        ]
        .into_iter()
        .flatten()
        {
            redact_json(v);
        }
    }
}

/// A record's growing values, FULL: what a delta is encoded against and decoded into.
#[derive(Debug, Clone, Default, PartialEq)]
pub(crate) struct Requests {
    pub request: serde_json::Value,
    pub normalized_request: Option<serde_json::Value>,
    pub upstream_request: Option<serde_json::Value>,
    /// The call's token sequence (`prompt_token_ids ++ completion_token_ids`), what a later
    /// call's prompt ids are encoded against; `None` without prompt ids.
    pub token_ids: Option<Vec<u32>>,
}

/// A record's growing values as stored: each a delta against the same value of an earlier
/// call of the session (each with its own base).
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Deltas {
    pub request: RequestDelta,
    pub normalized_request: Option<RequestDelta>,
    pub upstream_request: Option<RequestDelta>,
    /// `prompt_token_ids` against an earlier call's token sequence; `None`: stored whole.
    pub prompt_token_ids: Option<TokenIdsDelta>,
}

/// A record as it lies on disk (WAL payload and parquet row): the request, normalized
/// request and upstream request are replaced by their deltas against earlier calls of the
/// same session. Fields added after v1 are omitted from the WAL payload when `None`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub(crate) struct StoredRecord {
    pub schema_version: u32,
    pub call_id: String,
    pub session_id: String,
    #[serde(default)]
    pub group_id: Option<String>,
    pub seq: u64,
    pub started_at_us: i64,
    pub finished_at_us: i64,
    pub dialect: String,
    pub endpoint: String,
    #[serde(default)]
    pub model: Option<String>,
    pub upstream: String,
    pub stream: bool,
    pub request_delta: RequestDelta,
    #[serde(default)]
    pub response: Option<serde_json::Value>,
    pub status: u16,
    pub outcome: String,
    #[serde(default)]
    pub error: Option<String>,
    #[serde(default)]
    pub prompt_token_ids: Option<Vec<u32>>,
    #[serde(default)]
    pub completion_token_ids: Option<Vec<u32>>,
    #[serde(default)]
    pub completion_logprobs: Option<Vec<Option<f32>>>,
    #[serde(default)]
    pub finish_reason: Option<String>,
    #[serde(default)]
    pub weight_version: Option<String>,
    #[serde(default)]
    pub usage: Option<Usage>,
    #[serde(default)]
    pub ttft_ms: Option<f64>,
    pub latency_ms: f64,
    #[serde(default)]
    pub client: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub normalized_request_delta: Option<RequestDelta>,
    /// Absent when `None`; a present `null` is `Some(null)` (as in parquet).
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        deserialize_with = "crate::delta::present_value"
    )]
    pub normalized_response: Option<serde_json::Value>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub upstream_request_delta: Option<RequestDelta>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub upstream_dialect: Option<String>,
    /// Additive (no schema version of its own): `prompt_token_ids` as a delta against an
    /// earlier call of the session; `prompt_token_ids` is then `None`. Absent when `None`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prompt_token_ids_delta: Option<TokenIdsDelta>,
    /// Since v3; absent when `None`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub weight_version_spans: Option<Vec<WeightSpan>>,
    /// Additive; absent when `None`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sampling: Option<serde_json::Value>,
    /// Additive; absent when `None`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub attempt: Option<u32>,
    /// Additive; absent when `None`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub retry_of: Option<String>,
    /// Additive; absent when `None`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub backend_finish_reason: Option<String>,
    /// Additive; absent when `None`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stop_matched: Option<serde_json::Value>,
    /// Additive; absent when `None`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub headers: Option<std::collections::BTreeMap<String, String>>,
    /// Additive; absent when `None`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub replay: Option<Replay>,
}

impl StoredRecord {
    /// Splits a full record into its stored form; returns the full values separately (the
    /// writer keeps them as the next delta bases).
    pub(crate) fn from_call(rec: CallRecord, deltas: Deltas) -> (Self, Requests) {
        let CallRecord {
            schema_version,
            call_id,
            session_id,
            group_id,
            seq,
            started_at_us,
            finished_at_us,
            dialect,
            endpoint,
            model,
            upstream,
            stream,
            request,
            response,
            status,
            outcome,
            error,
            prompt_token_ids,
            completion_token_ids,
            completion_logprobs,
            finish_reason,
            weight_version,
            usage,
            ttft_ms,
            latency_ms,
            client,
            normalized_request,
            normalized_response,
            upstream_request,
            upstream_dialect,
            weight_version_spans,
            sampling,
            attempt,
            retry_of,
            backend_finish_reason,
            stop_matched,
            headers,
            replay,
        } = rec;
        let token_ids =
            delta::token_sequence(prompt_token_ids.as_deref(), completion_token_ids.as_deref());
        let prompt_token_ids = if deltas.prompt_token_ids.is_some() {
            None
        } else {
            prompt_token_ids
        };
        let stored = Self {
            schema_version,
            call_id,
            session_id,
            group_id,
            seq,
            started_at_us,
            finished_at_us,
            dialect,
            endpoint,
            model,
            upstream,
            stream,
            request_delta: deltas.request,
            response,
            status,
            outcome,
            error,
            prompt_token_ids,
            completion_token_ids,
            completion_logprobs,
            finish_reason,
            weight_version,
            usage: usage.filter(|u| !u.is_empty()),
            ttft_ms,
            latency_ms,
            client,
            normalized_request_delta: deltas.normalized_request,
            normalized_response,
            upstream_request_delta: deltas.upstream_request,
            upstream_dialect,
            prompt_token_ids_delta: deltas.prompt_token_ids,
            weight_version_spans,
            sampling,
            attempt,
            retry_of,
            backend_finish_reason,
            stop_matched,
            headers,
            replay,
        };
        let requests = Requests {
            request,
            normalized_request,
            upstream_request,
            token_ids,
        };
        (stored, requests)
    }

    /// Rebuilds the full record once its deltas have been resolved (`prompt_ids`: the full
    /// prompt ids when they were stored as a delta).
    pub(crate) fn into_call(self, full: Requests, prompt_ids: Option<Vec<u32>>) -> CallRecord {
        CallRecord {
            schema_version: self.schema_version,
            call_id: self.call_id,
            session_id: self.session_id,
            group_id: self.group_id,
            seq: self.seq,
            started_at_us: self.started_at_us,
            finished_at_us: self.finished_at_us,
            dialect: self.dialect,
            endpoint: self.endpoint,
            model: self.model,
            upstream: self.upstream,
            stream: self.stream,
            request: full.request,
            response: self.response,
            status: self.status,
            outcome: self.outcome,
            error: self.error,
            prompt_token_ids: prompt_ids.or(self.prompt_token_ids),
            completion_token_ids: self.completion_token_ids,
            completion_logprobs: self.completion_logprobs,
            finish_reason: self.finish_reason,
            weight_version: self.weight_version,
            usage: self.usage,
            ttft_ms: self.ttft_ms,
            latency_ms: self.latency_ms,
            client: self.client,
            normalized_request: full.normalized_request,
            normalized_response: self.normalized_response,
            upstream_request: full.upstream_request,
            upstream_dialect: self.upstream_dialect,
            weight_version_spans: self.weight_version_spans,
            sampling: self.sampling,
            attempt: self.attempt,
            retry_of: self.retry_of,
            backend_finish_reason: self.backend_finish_reason,
            stop_matched: self.stop_matched,
            headers: self.headers,
            replay: self.replay,
        }
    }
}

#[cfg(test)]
mod outcome_tests {
    use super::*;

    /// Every outcome reads back from its word; a word this build does not know is none, and
    /// a record is ok only with the word `ok`.
    #[test]
    fn outcomes_read_back_from_their_words() {
        for o in CallOutcome::ALL {
            assert_eq!(CallOutcome::parse(o.as_str()), Some(o));
        }
        assert_eq!(CallOutcome::parse("OK"), None);
        let mut r = CallRecord {
            outcome: "ok".into(),
            ..CallRecord::default()
        };
        assert!(r.is_ok());
        r.outcome = CallOutcome::ClientDisconnected.as_str().into();
        assert!(!r.is_ok());
    }
}

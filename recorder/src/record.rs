//! The `CallRecord` schema and its on-disk form.

use serde::{Deserialize, Serialize};

use crate::delta::RequestDelta;

/// Version of the record schema written by this build. Changes are additive only:
/// new optional fields, never renamed or retyped ones.
pub const SCHEMA_VERSION: u32 = 1;

/// Token usage as reported by the upstream.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
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

/// One inference call as the gateway saw it. `request` is always the FULL request here;
/// on disk it is stored as a delta against the session's previous call.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
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
    /// "ok" | "client_error" | "upstream_error" | "graft_error" | "client_disconnected"
    pub outcome: String,
    pub error: Option<String>,
    pub prompt_token_ids: Option<Vec<u32>>,
    pub completion_token_ids: Option<Vec<u32>>,
    pub completion_logprobs: Option<Vec<f32>>,
    pub finish_reason: Option<String>,
    pub weight_version: Option<String>,
    /// A `Usage` whose three fields are all `None` is stored as `None`.
    pub usage: Option<Usage>,
    pub ttft_ms: Option<f64>,
    pub latency_ms: f64,
    /// The client's user-agent.
    pub client: Option<String>,
}

/// A record as it lies on disk (WAL payload and parquet row): the request is replaced by
/// its delta against an earlier call of the same session.
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
    pub completion_logprobs: Option<Vec<f32>>,
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
}

impl StoredRecord {
    /// Splits a full record into its stored form; returns the full request separately
    /// (the writer keeps it as the next delta base).
    pub(crate) fn from_call(rec: CallRecord, delta: RequestDelta) -> (Self, serde_json::Value) {
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
        } = rec;
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
            request_delta: delta,
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
        };
        (stored, request)
    }

    /// Rebuilds the full record once the request has been resolved.
    pub(crate) fn into_call(self, request: serde_json::Value) -> CallRecord {
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
            request,
            response: self.response,
            status: self.status,
            outcome: self.outcome,
            error: self.error,
            prompt_token_ids: self.prompt_token_ids,
            completion_token_ids: self.completion_token_ids,
            completion_logprobs: self.completion_logprobs,
            finish_reason: self.finish_reason,
            weight_version: self.weight_version,
            usage: self.usage,
            ttft_ms: self.ttft_ms,
            latency_ms: self.latency_ms,
            client: self.client,
        }
    }
}

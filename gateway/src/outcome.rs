//! What a call came to, gathered by its backend and the relay for its record (a leaf: the
//! backends fill it, `call.rs` turns it into a `CallRecord`).

use std::time::Duration;

use serde_json::Value;

use crate::error::GatewayError;
use crate::token_ids::Recorded;

#[derive(Default)]
pub(crate) struct Outcome {
    pub(crate) status: u16,
    pub(crate) error: Option<GatewayError>,
    /// The upstream's own refusal, relayed to the client as it was (passthrough 4xx, an error
    /// event inside a relayed stream).
    pub(crate) upstream_error_text: Option<String>,
    /// The answer as the client got it, in its dialect.
    pub(crate) response: Option<Value>,
    /// The answer in graft's internal form (translation, exact mode).
    pub(crate) normalized_response: Option<Value>,
    pub(crate) finish_reason: Option<String>,
    /// Exact mode: the backend's own finish reason and what a stop matched.
    pub(crate) backend_finish_reason: Option<String>,
    pub(crate) stop_matched: Option<Value>,
    pub(crate) ttft: Option<Duration>,
    pub(crate) upstream_time: Duration,
    /// Token ids and logprobs the upstream returned (passthrough ids, exact mode).
    pub(crate) tokens: Recorded,
    /// The backend's `weight_version` (exact mode).
    pub(crate) weight_version: Option<String>,
    /// Which weights sampled which completion tokens, when they changed during the call.
    pub(crate) weight_version_spans: Option<Vec<graft_recorder::WeightSpan>>,
}

impl Outcome {
    pub(crate) fn ok() -> Self {
        Outcome {
            status: http::StatusCode::OK.as_u16(),
            ..Default::default()
        }
    }
}

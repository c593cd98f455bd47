//! vLLM's token-in/token-out surface as graft uses it: `POST /v1/completions` with a prompt
//! of token ids, `return_token_ids`, `logprobs` and `return_weight_versions`. Read from vLLM
//! 0.34.0's source (`vllm/entrypoints/openai/completion/{protocol,serving,api_router}.py`,
//! `vllm/entrypoints/serve/engine/protocol.py`, `vllm/outputs.py`,
//! `vllm/v1/engine/__init__.py`).
//!
//! Why this route and not `/inference/v1/generate` (`vllm/entrypoints/scale_out/
//! token_in_token_out/`): that one answers 403 `PermissionDeniedError` unless the server runs
//! with `--enable-scale-out` (`scale_out/factories.py`), while `/v1/completions` takes a
//! token-id prompt on every vLLM server and has returned `token_ids` since
//! `return_token_ids` was added; `return_weight_versions` is new in 0.34 and older servers
//! ignore it (vLLM's request models accept unknown fields with a warning).
//!
//! Semantics that differ from SGLang's `/generate` (each in vLLM 0.34.0's source):
//! - `max_tokens` absent means **16** (`CompletionRequest.max_tokens = 16`, and
//!   `normalize_null_max_tokens` turns `null` into 16): graft always sends it.
//! - `stream_options` without `stream: true` is refused (`validate_stream_options`).
//! - A streamed request's errors after the head arrive as HTTP 200 and then
//!   `data: {"error": {...}}` before `data: [DONE]` (`completion_stream_generator`); errors
//!   before the stream are a JSON [`ErrorResponse`] with its status (400 for a bad request).
//! - A stop token's text is dropped from `text`, its id kept in `token_ids`
//!   (`stop_reason` names the id from `stop_token_ids`; `null` for the model's EOS); the
//!   streamed text trails the ids by up to a stop string's length. graft decodes the ids
//!   itself and reads no text.
//! - `ignore_eos` does not switch `stop_token_ids` off.
//! - A client that goes away aborts the request: `with_cancellation` for a whole answer,
//!   the cancelled `StreamingResponse` for a stream. Closing the connection is the abort;
//!   there is no abort-by-id route.
//! - Logprobs are the model's raw ones (`--logprobs-mode raw_logprobs`, the default in
//!   `vllm/config/model.py`): before temperature, penalties and truncation.
//!
//! Weight pushes ([`path::PAUSE`] and the routes after it) use vLLM's development routes,
//! mounted only when the server runs with `VLLM_SERVER_DEV_MODE=1`
//! (`vllm/entrypoints/launchers/api_server/routers.py`: `register_vllm_dev_api_routers` and
//! `register_rl_api_routers`); without it each answers FastAPI's 404
//! `{"detail": "Not Found"}`. The RL router (`vllm/entrypoints/rl/online/api_router.py`):
//! `POST /pause?mode=keep` (the engine's `PAUSED_ALL`: no request is stepped, new ones are
//! queued, all go on after `/resume`; `abort` and `wait` answer new requests 503 instead),
//! `POST /resume`, `GET /is_paused`, `POST /update_weight_version {"new_version"}` (the
//! version the engine stamps on every output from then on, `EngineCore._weight_version`,
//! `"default"` at start), `GET /weight_info`. The dev routers (`vllm/entrypoints/serve/dev/`):
//! `POST /reset_prefix_cache?reset_running_requests=true` (`cache/api_router.py`; the
//! scheduler preempts the running requests, which are recomputed from their tokens so far
//! when they run again) and `POST /collective_rpc {"method", "args", "kwargs"}`
//! (`rpc/api_router.py`: strings only) calling the worker's `reload_weights(weights_path=DIR)`
//! (`vllm/v1/worker/gpu_worker.py`, HF checkpoint format by default).
//!
//! `--api-key` does not guard them: vLLM's `AuthenticationMiddleware`
//! (`vllm/entrypoints/serve/middleware/authenticate.py`) checks only paths under `/v1`,
//! `/v2`, `/inference` and `/cohere`; a dev-mode server must not be reachable by anyone who
//! should not push weights. Errors come in three shapes: the RL router's own
//! `{"error": "..."}` (400 for an unknown pause mode, 500), vLLM's [`ErrorResponse`] from its
//! exception handlers (an exception in `reload_weights` is a 500 with its message), and
//! FastAPI's `{"detail": ...}` (404, 422 for a bad query); [`error_message`] reads each.

use serde::{Deserialize, Serialize};

pub use crate::sglang::WeightVersionSpan;

/// Routes.
pub mod path {
    pub const COMPLETIONS: &str = "/v1/completions";
    /// `GET`: `{"version": "0.34.0"}`.
    pub const VERSION: &str = "/version";
    pub const MODELS: &str = "/v1/models";
    pub const HEALTH: &str = "/health";
    // Development routes (`VLLM_SERVER_DEV_MODE=1`); see the module doc.
    /// `POST`, query `mode` ([`super::PauseMode`]).
    pub const PAUSE: &str = "/pause";
    pub const RESUME: &str = "/resume";
    pub const IS_PAUSED: &str = "/is_paused";
    /// `POST`, query `reset_running_requests`, `reset_external`.
    pub const RESET_PREFIX_CACHE: &str = "/reset_prefix_cache";
    pub const COLLECTIVE_RPC: &str = "/collective_rpc";
    pub const UPDATE_WEIGHT_VERSION: &str = "/update_weight_version";
    pub const WEIGHT_INFO: &str = "/weight_info";
}

/// The vLLM release that first reports per-request weight versions
/// (`return_weight_versions` on `/v1/completions`, the `weight_versions` spans of a choice).
/// With an older one graft labels the calls itself, from the pushes it drives with a drain
/// (`docs/BACKENDS.md`).
pub const WEIGHT_VERSIONS_SINCE: (u32, u32, u32) = (0, 34, 0);

/// Whether a vLLM that says `version` at `GET /version` reports weight versions per request;
/// false for an unreadable version (nothing is assumed).
pub fn reports_weight_versions(version: &str) -> bool {
    crate::sglang::parse_version(version).is_some_and(|v| v >= WEIGHT_VERSIONS_SINCE)
}

/// What to tell someone whose vLLM answers 404 on a development route.
pub const DEV_MODE_HINT: &str = "vLLM serves its weight-update routes only in development mode: start vLLM with VLLM_SERVER_DEV_MODE=1 (and keep it where only the trainer can reach it: --api-key does not guard these routes)";

/// What to tell someone whose vLLM refuses `reload_weights` ("Model reloading with `dummy`
/// format"): the reload reads the directory with the server's own `--load-format`
/// (`vllm/model_executor/model_loader/reload/inplace.py`), and the dummy loader cannot.
pub const DUMMY_LOAD_FORMAT_HINT: &str = "vLLM reloads weights with the --load-format it was started with, and `dummy` cannot read a checkpoint: start vLLM without --load-format dummy (e.g. on the starting checkpoint)";

/// `POST /pause?mode=...` (`PauseMode` in `vllm/v1/engine/__init__.py`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum PauseMode {
    /// Abort every request in flight (vLLM's default); new ones get 503 until `/resume`.
    #[default]
    Abort,
    /// Let the requests in flight finish; new ones get 503 until `/resume`.
    Wait,
    /// Freeze every request where it is (queued and running); new ones are queued; all go
    /// on after `/resume`.
    Keep,
}

impl PauseMode {
    pub fn as_str(self) -> &'static str {
        match self {
            PauseMode::Abort => "abort",
            PauseMode::Wait => "wait",
            PauseMode::Keep => "keep",
        }
    }

    /// The route with its query: `/pause?mode=keep`.
    pub fn path(self) -> String {
        format!("{}?mode={}", path::PAUSE, self.as_str())
    }
}

/// `POST /reset_prefix_cache` with `reset_running_requests=true`: the running requests are
/// preempted first, so the reset cannot be refused for blocks they hold.
pub const RESET_PREFIX_CACHE_PREEMPTING: &str = "/reset_prefix_cache?reset_running_requests=true";

/// The answer of `/pause` (`{"status": "paused"}`) and `/resume` (`{"status": "resumed"}`).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct StatusResponse {
    #[serde(default)]
    pub status: String,
}

/// `GET /is_paused`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct IsPausedResponse {
    pub is_paused: bool,
}

/// `POST /reset_prefix_cache`: `success` false while blocks are still held (without
/// `reset_running_requests`, by running requests); callers may retry.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct ResetPrefixCacheResponse {
    pub success: bool,
}

/// The worker method that reloads the weights (`Worker.reload_weights` in
/// `vllm/v1/worker/gpu_worker.py`) and its keyword for a checkpoint directory.
pub const RELOAD_WEIGHTS: &str = "reload_weights";
pub const WEIGHTS_PATH: &str = "weights_path";
/// The worker method that replaces parts of its config (`Worker.update_config`).
pub const UPDATE_CONFIG: &str = "update_config";

/// `POST /collective_rpc`: `method` called on every worker with `args` and `kwargs`. vLLM's
/// comment says strings only; its route passes the JSON values as they are
/// (`update_config` takes a dict).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct CollectiveRpcRequest {
    pub method: String,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub args: Vec<String>,
    #[serde(default, skip_serializing_if = "std::collections::BTreeMap::is_empty")]
    pub kwargs: std::collections::BTreeMap<String, serde_json::Value>,
    /// Seconds; none: vLLM's own.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub timeout: Option<f64>,
}

impl CollectiveRpcRequest {
    /// `reload_weights(weights_path=dir)`: the HF checkpoint directory `dir`, read by the
    /// server.
    pub fn reload_weights(dir: &str) -> Self {
        CollectiveRpcRequest {
            method: RELOAD_WEIGHTS.to_owned(),
            kwargs: [(WEIGHTS_PATH.to_owned(), dir.into())].into(),
            ..CollectiveRpcRequest::default()
        }
    }

    /// A vLLM whose `reload_weights` takes no directory (before `weights_path`, e.g. 0.11)
    /// reloads from `model_config.model`: `update_config({"model_config": {"model": dir}})`
    /// points it at `dir` (`GPUModelRunner.update_config` in `vllm/v1/worker/
    /// gpu_model_runner.py` allows `model_config` and `load_config`).
    pub fn point_model_at(dir: &str) -> Self {
        CollectiveRpcRequest {
            method: UPDATE_CONFIG.to_owned(),
            kwargs: [(
                "overrides".to_owned(),
                serde_json::json!({"model_config": {"model": dir}}),
            )]
            .into(),
            ..CollectiveRpcRequest::default()
        }
    }

    /// `reload_weights()` with no arguments: from the model path the server has.
    pub fn reload_in_place() -> Self {
        CollectiveRpcRequest {
            method: RELOAD_WEIGHTS.to_owned(),
            ..CollectiveRpcRequest::default()
        }
    }
}

/// `/collective_rpc`'s answer: one result per worker (`null` for a method that returns
/// nothing); an empty 200 when the call returned nothing at all.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct CollectiveRpcResponse {
    #[serde(default)]
    pub results: Vec<serde_json::Value>,
}

/// `POST /update_weight_version`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct UpdateWeightVersionRequest {
    pub new_version: String,
}

/// `/update_weight_version`'s answer.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct UpdateWeightVersionResponse {
    pub success: bool,
    pub new_version: String,
}

/// `GET /weight_info`: the version the engine stamps on its outputs (`"default"` until one
/// is set).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct WeightInfo {
    pub weight_version: String,
}

/// The message of a vLLM error answer, whichever of its shapes it has (see the module
/// doc): `{"error": {"message"}}`, `{"error": "..."}`, `{"detail": "..."}` (or a list of
/// FastAPI validation errors); else the body itself, trimmed.
pub fn error_message(body: &str) -> String {
    let v: serde_json::Value = match serde_json::from_str(body) {
        Ok(v) => v,
        Err(_) => return body.trim().to_owned(),
    };
    if let Some(m) = v.pointer("/error/message").and_then(|m| m.as_str()) {
        return m.to_owned();
    }
    match (v.get("error"), v.get("detail")) {
        (Some(serde_json::Value::String(m)), _) | (None, Some(serde_json::Value::String(m))) => {
            m.clone()
        }
        (None, Some(d)) => d.to_string(),
        _ => body.trim().to_owned(),
    }
}

/// `finish_reason` values (`FINISH_REASON_STRINGS` in `vllm/v1/engine/__init__.py`); `error`
/// is turned into an error answer by the server and never sent as a finish reason.
pub const FINISH_REASONS: [&str; 5] = ["stop", "length", "abort", "error", "repetition"];

/// vLLM's default `--max-logprobs`: a request asking for more is refused.
pub const DEFAULT_MAX_LOGPROBS: i64 = 20;

/// The part of `CompletionRequest` graft sends (single token-id prompt, one choice).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct CompletionRequest {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model: Option<String>,
    /// One prompt as token ids (vLLM also takes text and lists of prompts; graft sends this).
    pub prompt: Vec<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_tokens: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub temperature: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub top_p: Option<f64>,
    /// `0` or `-1`: no top-k (`SamplingParams`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub top_k: Option<i64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub min_p: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub seed: Option<i64>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub stop: Vec<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stop_token_ids: Option<Vec<u32>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub presence_penalty: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub frequency_penalty: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub repetition_penalty: Option<f64>,
    /// Token id (as a string) → bias.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub logit_bias: Option<serde_json::Map<String, serde_json::Value>>,
    /// How many top logprobs per token besides the sampled one's (`0`: the sampled one only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub logprobs: Option<i64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub return_token_ids: Option<bool>,
    /// Tokens (and `top_logprobs` keys) as `token_id:{id}` instead of their decoded text, so
    /// that alternatives decoding to the same text stay apart.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub return_tokens_as_token_ids: Option<bool>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub return_weight_versions: Option<bool>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub include_stop_str_in_output: Option<bool>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub skip_special_tokens: Option<bool>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub spaces_between_special_tokens: Option<bool>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ignore_eos: Option<bool>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub n: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stream: Option<bool>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stream_options: Option<StreamOptions>,
    /// The id vLLM runs the request under (`cmpl-{request_id}` in its answer and logs).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub request_id: Option<String>,
    /// Constrained decoding (`StructuredOutputsParams` in `vllm/sampling_params.py`): one of
    /// `json` (a schema), `json_object`, `regex`, `choice`, `grammar`, `structural_tag`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub structured_outputs: Option<StructuredOutputs>,
}

/// `StructuredOutputsParams`, the constraints graft sends (exactly one is set, as vLLM's
/// `__post_init__` requires).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct StructuredOutputs {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub json: Option<serde_json::Value>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub json_object: Option<bool>,
    /// An xgrammar structural tag as a JSON string (`{"type": "structural_tag", "format":
    /// ...}`), checked by the completions endpoint (`validate_structured_outputs_structural_tag`:
    /// nesting, then xgrammar compiles it) before the request is accepted.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub structural_tag: Option<String>,
}

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct StreamOptions {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub include_usage: Option<bool>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub continuous_usage_stats: Option<bool>,
}

/// A whole answer (`CompletionResponse`) or one streamed chunk (`CompletionStreamResponse`):
/// the same fields, a chunk's choice carrying the new part only.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct CompletionResponse {
    #[serde(default)]
    pub id: String,
    #[serde(default)]
    pub object: String,
    #[serde(default)]
    pub created: i64,
    #[serde(default)]
    pub model: String,
    #[serde(default)]
    pub choices: Vec<Choice>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub usage: Option<Usage>,
}

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Choice {
    #[serde(default)]
    pub index: u32,
    #[serde(default)]
    pub text: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub logprobs: Option<Logprobs>,
    /// `stop`, `length`, `abort`, `repetition` (see [`FINISH_REASONS`]); `null` until the end.
    #[serde(default)]
    pub finish_reason: Option<String>,
    /// The stop string or stop token id that ended it; `null` for EOS or another reason.
    #[serde(default)]
    pub stop_reason: Option<StopReason>,
    /// Streamed: the first chunk only.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prompt_token_ids: Option<Vec<u32>>,
    /// The output ids (streamed: the new ones), with `return_token_ids`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub token_ids: Option<Vec<u32>>,
    /// With `return_weight_versions` (vLLM 0.34+); streamed: the last chunk only, covering the
    /// whole output.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub weight_versions: Option<Vec<WeightVersionSpan>>,
}

/// `CompletionLogProbs`: one entry per token of the choice (streamed: of the chunk).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Logprobs {
    #[serde(default)]
    pub text_offset: Vec<i64>,
    #[serde(default)]
    pub token_logprobs: Vec<Option<f64>>,
    #[serde(default)]
    pub tokens: Vec<String>,
    /// Per token: the candidates, the sampled token first, then the most likely in rank
    /// order, `logprobs + 1` at most (a candidate that is the sampled one appears once);
    /// keyed by the token's text, or `token_id:{id}` under `return_tokens_as_token_ids`.
    #[serde(default)]
    pub top_logprobs: Vec<Option<serde_json::Map<String, serde_json::Value>>>,
}

/// The id of a `token_id:{id}` token (`return_tokens_as_token_ids`).
pub fn token_id_of(token: &str) -> Option<u32> {
    token.strip_prefix("token_id:")?.parse().ok()
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum StopReason {
    Token(i64),
    Text(String),
}

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Usage {
    #[serde(default)]
    pub prompt_tokens: u64,
    #[serde(default)]
    pub completion_tokens: u64,
    #[serde(default)]
    pub total_tokens: u64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prompt_tokens_details: Option<PromptTokensDetails>,
}

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct PromptTokensDetails {
    #[serde(default)]
    pub cached_tokens: u64,
}

/// vLLM's `ErrorResponse`: `{"error": {"message", "type", "param", "code"}}`, with `code` the
/// HTTP status (before a stream, as the answer's body; in a stream, as a `data:` event).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ErrorResponse {
    pub error: ErrorInfo,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ErrorInfo {
    pub message: String,
    #[serde(rename = "type")]
    pub kind: String,
    #[serde(default)]
    pub param: Option<String>,
    pub code: u16,
}

impl ErrorResponse {
    pub fn new(code: u16, kind: &str, message: impl Into<String>, param: Option<&str>) -> Self {
        ErrorResponse {
            error: ErrorInfo {
                message: message.into(),
                kind: kind.to_owned(),
                param: param.map(str::to_owned),
                code,
            },
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use serde_json::json;

    /// A streamed chunk as `completion_stream_generator` writes it with `return_token_ids`,
    /// `logprobs: 0` and `return_weight_versions` (the last chunk of a choice).
    #[test]
    fn a_last_stream_chunk_reads_with_its_ids_logprobs_stop_reason_and_spans() {
        let v = json!({"id": "cmpl-c1-0", "object": "text_completion", "created": 1, "model": "m",
            "choices": [{"index": 0, "text": "", "logprobs": {"text_offset": [3], "token_logprobs": [-0.5],
                "tokens": ["<|im_end|>"], "top_logprobs": [{}]}, "finish_reason": "stop", "stop_reason": 151645,
                "token_ids": [151645], "weight_versions": [{"version": "v1", "start": 0, "end": 4}]}]});
        let r: CompletionResponse = serde_json::from_value(v).unwrap();
        let c = &r.choices[0];
        assert_eq!(c.token_ids.as_deref(), Some(&[151645][..]));
        assert_eq!(c.stop_reason, Some(StopReason::Token(151645)));
        assert_eq!(
            c.logprobs.as_ref().unwrap().token_logprobs,
            vec![Some(-0.5)]
        );
        assert_eq!(c.weight_versions.as_ref().unwrap()[0].end, 4);
        let s: StopReason = serde_json::from_value(json!("END")).unwrap();
        assert_eq!(s, StopReason::Text("END".into()));
    }

    #[test]
    fn push_bodies_are_vllms() {
        assert_eq!(PauseMode::Keep.path(), "/pause?mode=keep");
        assert_eq!(
            serde_json::to_value(CollectiveRpcRequest::reload_weights("/w/step-1")).unwrap(),
            json!({"method": "reload_weights", "kwargs": {"weights_path": "/w/step-1"}})
        );
        assert_eq!(
            serde_json::to_value(UpdateWeightVersionRequest {
                new_version: "step-1".into()
            })
            .unwrap(),
            json!({"new_version": "step-1"})
        );
        let r: CollectiveRpcResponse = serde_json::from_value(json!({"results": [null]})).unwrap();
        assert_eq!(r.results, vec![serde_json::Value::Null]);
    }

    #[test]
    fn error_messages_read_in_each_of_vllms_shapes() {
        assert_eq!(
            error_message(
                r#"{"error": {"message": "no such file", "type": "InternalServerError", "param": null, "code": 500}}"#
            ),
            "no such file"
        );
        assert_eq!(
            error_message(r#"{"error": "Invalid pause mode: x"}"#),
            "Invalid pause mode: x"
        );
        assert_eq!(error_message(r#"{"detail": "Not Found"}"#), "Not Found");
        assert_eq!(
            error_message(" Internal Server Error\n"),
            "Internal Server Error"
        );
    }

    #[test]
    fn a_request_leaves_out_what_is_not_set() {
        let r = CompletionRequest {
            prompt: vec![1, 2],
            max_tokens: Some(8),
            ..Default::default()
        };
        assert_eq!(
            serde_json::to_value(&r).unwrap(),
            json!({"prompt": [1, 2], "max_tokens": 8})
        );
        let e = ErrorResponse::new(400, "BadRequestError", "bad", Some("logprobs"));
        assert_eq!(
            serde_json::to_value(&e).unwrap(),
            json!({"error": {"message": "bad", "type": "BadRequestError", "param": "logprobs", "code": 400}})
        );
    }
}

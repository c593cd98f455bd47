//! SGLang's native HTTP API as graft speaks it: `POST /generate` (token ids in, token ids
//! and logprobs out, whole or streamed) and the control endpoints a weight push and a
//! gateway use.
//!
//! Field names and shapes come from SGLang's own source (sgl-project/sglang):
//! - `python/sglang/srt/managers/io_struct.py`: `GenerateReqInput` (the `/generate` body),
//!   `UpdateWeightFromDiskReqInput` / `UpdateWeightFromDiskReqOutput`,
//!   `PauseGenerationReqInput` (`mode`), `ContinueGenerationReqInput`, `FlushCacheReqInput`,
//!   `AbortReq`;
//! - `python/sglang/srt/sampling/sampling_params.py`: `SamplingParams` (the keys of
//!   `sampling_params`);
//! - `python/sglang/srt/managers/schedule_batch.py`: `FINISH_MATCHED_TOKEN`,
//!   `FINISH_MATCHED_STR`, `FINISH_LENGTH`, `FINISH_ABORT` and their `to_json()` (the
//!   `meta_info.finish_reason` object);
//! - `python/sglang/srt/managers/tokenizer_manager.py`: the answer's `meta_info` (`id`,
//!   `finish_reason`, `prompt_tokens`, `completion_tokens`, `cached_tokens`,
//!   `output_token_logprobs` as `[logprob, token_id, text|null]` triples, `weight_version`);
//! - `python/sglang/srt/utils/weight_versions.py`: `add_weight_versions_to_meta_info`
//!   (`meta_info.weight_versions`, spans of `{version, start, end}`);
//! - `python/sglang/srt/entrypoints/http_server.py`: the routes and the answers of
//!   `/pause_generation`, `/continue_generation`, `/model_info` (`/get_model_info` before),
//!   `/server_info` (`/get_server_info` before: the resolved server arguments, from
//!   `python/sglang/srt/arg_groups/fields/*.py`, plus `version`), `/health`.
//!
//! Only the single-prompt form is modelled (`text` one string, `input_ids` one list): graft
//! sends one prompt per request. SGLang adds fields release by release, so unknown fields are
//! ignored when reading, and every optional field is an `Option` left out when `None` (SGLang
//! then applies its own default).

use serde::{Deserialize, Deserializer, Serialize};
use serde_json::{Map, Value};

/// The routes graft uses, relative to the server's base URL.
pub mod path {
    pub const GENERATE: &str = "/generate";
    pub const HEALTH: &str = "/health";
    pub const HEALTH_GENERATE: &str = "/health_generate";
    /// Deprecated by SGLang (a warning per call) in favour of [`MODEL_INFO`]; older servers
    /// have only this one.
    pub const GET_MODEL_INFO: &str = "/get_model_info";
    pub const MODEL_INFO: &str = "/model_info";
    /// The server's resolved arguments and `version` (`/get_server_info` before the rename).
    pub const SERVER_INFO: &str = "/server_info";
    pub const GET_SERVER_INFO: &str = "/get_server_info";
    pub const PAUSE_GENERATION: &str = "/pause_generation";
    pub const CONTINUE_GENERATION: &str = "/continue_generation";
    pub const FLUSH_CACHE: &str = "/flush_cache";
    pub const UPDATE_WEIGHTS_FROM_DISK: &str = "/update_weights_from_disk";
    pub const UPDATE_WEIGHTS_FROM_TENSOR: &str = "/update_weights_from_tensor";
    pub const BEGIN_WEIGHT_UPDATE: &str = "/begin_weight_update";
    pub const END_WEIGHT_UPDATE: &str = "/end_weight_update";
    pub const ABORT_REQUEST: &str = "/abort_request";
}

/// The data of the event that ends a `/generate` stream (`data: [DONE]`).
pub const STREAM_DONE: &str = "[DONE]";

// ---------------------------------------------------------------------------------------
// /generate

/// The `POST /generate` body (`GenerateReqInput`), single-prompt form.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct GenerateRequest {
    /// The prompt as text (SGLang tokenizes it). One of `text` and `input_ids`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub text: Option<String>,
    /// The prompt as token ids.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub input_ids: Option<Vec<u32>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sampling_params: Option<SamplingParams>,
    /// Return logprobs (`meta_info.output_token_logprobs`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub return_logprob: Option<bool>,
    /// Where in the prompt logprobs start; `-1`: output tokens only.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub logprob_start_len: Option<i64>,
    /// Top logprobs per position (with `return_logprob`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub top_logprobs_num: Option<u32>,
    /// Put each token's text in the logprob triples (else `null`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub return_text_in_logprobs: Option<bool>,
    /// Stream `data:` events (SGLang's default: `false`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stream: Option<bool>,
    /// The request id (`meta_info.id`; `/abort_request` takes it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rid: Option<String>,
    /// Stable identity shared by requests of one session (does not change the prompt).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub session_id: Option<String>,
    /// The key of SGLang's routing-key schedule policy.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub routing_key: Option<String>,
}

impl GenerateRequest {
    /// Whether the answer streams (absent means no, as in SGLang).
    pub fn is_stream(&self) -> bool {
        self.stream == Some(true)
    }
}

/// `sampling_params` (`SamplingParams`). Absent keys take SGLang's defaults (for
/// `max_new_tokens` that is 128).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct SamplingParams {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub temperature: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub top_p: Option<f64>,
    /// `-1`: no top-k.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub top_k: Option<i64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub min_p: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_new_tokens: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub min_new_tokens: Option<u64>,
    /// Stop strings: one string or a list.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stop: Option<Stop>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stop_token_ids: Option<Vec<i64>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sampling_seed: Option<i64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub presence_penalty: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub frequency_penalty: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub repetition_penalty: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ignore_eos: Option<bool>,
    /// Keep the matched stop string / token in the output.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub no_stop_trim: Option<bool>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub skip_special_tokens: Option<bool>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub spaces_between_special_tokens: Option<bool>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub n: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub json_schema: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub regex: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ebnf: Option<String>,
    /// Token id (as a string) → bias added to its logit before sampling
    /// (`sampling_params.py`'s `logit_bias`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub logit_bias: Option<Map<String, Value>>,
    /// Free-form parameters for a custom logit processor.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub custom_params: Option<Map<String, Value>>,
}

/// Every key SGLang 0.5.23 reads in `sampling_params`, in its declaration order
/// (`SamplingParams` of `sglang/api/v1/api_types.py`, the generated HTTP JSON contract that
/// the server checks each `/generate` body against). SGLang refuses any other key with a 400;
/// [`sampling_params_contract_error`] words the refusal as it does. `tests/conformance.rs`
/// checks this list against the installed package.
pub const SAMPLING_PARAMS_FIELDS: &[&str] = &[
    "max_new_tokens",
    "stop",
    "stop_token_ids",
    "stop_regex",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "frequency_penalty",
    "presence_penalty",
    "repetition_penalty",
    "min_new_tokens",
    "n",
    "json_schema",
    "regex",
    "ebnf",
    "structural_tag",
    "ignore_eos",
    "skip_special_tokens",
    "spaces_between_special_tokens",
    "no_stop_trim",
    "stream_interval",
    "logit_bias",
    "sampling_seed",
    "custom_params",
    "beam_width",
    "watermark",
    "choice",
];

/// Why SGLang refuses the `sampling_params` of a `/generate` body for its keys: the first
/// key it does not read, in serde's words (`unknown field `x`, expected one of `a`, ...`),
/// which is the text of SGLang's 400 ([`ContractError`]). `None` when every key is known
/// or `sampling_params` is absent or not an object (the types are checked elsewhere).
pub fn sampling_params_contract_error(body: &Value) -> Option<String> {
    let keys = body.get("sampling_params")?.as_object()?;
    let unknown = keys
        .keys()
        .find(|k| !SAMPLING_PARAMS_FIELDS.contains(&k.as_str()))?;
    let listed = SAMPLING_PARAMS_FIELDS
        .iter()
        .map(|f| format!("`{f}`"))
        .collect::<Vec<_>>()
        .join(", ");
    Some(format!(
        "unknown field `{unknown}`, expected one of {listed}"
    ))
}

/// The body of SGLang's 400 for a `/generate` body that breaks its JSON contract
/// (`http_server.py`: `{"error": <the contract's message>}`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ContractError {
    pub error: String,
}

/// `stop`: SGLang takes one string or a list of them.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum Stop {
    One(String),
    Many(Vec<String>),
}

impl Stop {
    /// The stop strings as a list.
    pub fn to_vec(&self) -> Vec<String> {
        match self {
            Stop::One(s) => vec![s.clone()],
            Stop::Many(v) => v.clone(),
        }
    }
}

/// A whole `/generate` answer, and each event of a streamed one (same shape). By default
/// SGLang streams cumulatively (each event holds everything so far); with
/// `--incremental-streaming-output` each event holds only the new part, while
/// `meta_info.completion_tokens` keeps counting the whole.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct GenerateResponse {
    /// The decoded output.
    #[serde(default)]
    pub text: String,
    pub output_ids: Vec<u32>,
    #[serde(default)]
    pub meta_info: MetaInfo,
}

/// `meta_info` of an answer.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct MetaInfo {
    /// The request id (`rid`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub id: Option<String>,
    /// `null` until the generation ends. Always written (as SGLang does), `null` included.
    #[serde(default)]
    pub finish_reason: Option<FinishReason>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prompt_tokens: Option<u64>,
    /// Output tokens so far (the whole count, also in incremental streams).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub completion_tokens: Option<u64>,
    /// Prompt tokens served from the prefix cache.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cached_tokens: Option<u64>,
    /// One `[logprob, token_id, text|null]` per output token (with `return_logprob`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub output_token_logprobs: Option<Vec<TokenLogprob>>,
    /// With `top_logprobs_num`: per output token, the most likely tokens at that position as
    /// `[logprob, token_id, text|null]` (`null` where SGLang has none for a position).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub output_top_logprobs: Option<Vec<Option<Vec<TokenLogprob>>>>,
    /// The weights that produced the last token. SGLang sends a string; a number is read as
    /// its decimal text.
    #[serde(
        default,
        deserialize_with = "version_text",
        skip_serializing_if = "Option::is_none"
    )]
    pub weight_version: Option<String>,
    /// Which weights produced which output tokens, when they changed mid-generation.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub weight_versions: Option<Vec<WeightVersionSpan>>,
    /// Seconds from arrival to this answer.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub e2e_latency: Option<f64>,
}

/// One output token's `[logprob, token_id, text|null]`. The logprob is `null` where SGLang
/// has none.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TokenLogprob(pub Option<f64>, pub u32, pub Option<String>);

impl TokenLogprob {
    pub fn logprob(&self) -> Option<f64> {
        self.0
    }
    pub fn token_id(&self) -> u32 {
        self.1
    }
}

/// Output tokens `start..end` were produced by `version`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct WeightVersionSpan {
    pub version: String,
    pub start: u64,
    pub end: u64,
}

/// `meta_info.finish_reason`: `{"type": "stop", "matched": id | [ids] | "text"}`,
/// `{"type": "length", "length": n}`, `{"type": "abort", "message", "status_code",
/// "err_type"}`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct FinishReason {
    #[serde(rename = "type")]
    pub kind: FinishKind,
    /// `stop`: the stop token id(s) or stop string that matched.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub matched: Option<Matched>,
    /// `length`: the length limit that was reached.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub length: Option<u64>,
    /// `abort`: why.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub message: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub status_code: Option<u16>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub err_type: Option<String>,
}

impl FinishReason {
    pub fn stop(matched: Option<Matched>) -> Self {
        FinishReason {
            matched,
            ..FinishReason::of(FinishKind::Stop)
        }
    }
    pub fn length(length: u64) -> Self {
        FinishReason {
            length: Some(length),
            ..FinishReason::of(FinishKind::Length)
        }
    }
    pub fn abort(message: impl Into<String>) -> Self {
        FinishReason {
            message: Some(message.into()),
            ..FinishReason::of(FinishKind::Abort)
        }
    }
    fn of(kind: FinishKind) -> Self {
        FinishReason {
            kind,
            matched: None,
            length: None,
            message: None,
            status_code: None,
            err_type: None,
        }
    }
}

/// `finish_reason.type`. A type this crate does not know is kept as [`FinishKind::Other`]
/// (reading never fails on it; the reader decides).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(from = "String", into = "String")]
pub enum FinishKind {
    Stop,
    Length,
    Abort,
    Other(String),
}

impl From<String> for FinishKind {
    fn from(s: String) -> Self {
        match s.as_str() {
            "stop" => FinishKind::Stop,
            "length" => FinishKind::Length,
            "abort" => FinishKind::Abort,
            _ => FinishKind::Other(s),
        }
    }
}

impl From<FinishKind> for String {
    fn from(k: FinishKind) -> Self {
        match k {
            FinishKind::Stop => "stop".to_owned(),
            FinishKind::Length => "length".to_owned(),
            FinishKind::Abort => "abort".to_owned(),
            FinishKind::Other(s) => s,
        }
    }
}

/// What a `stop` finish matched: a token id, several (multi-token EOS), or a stop string.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum Matched {
    Token(i64),
    Tokens(Vec<i64>),
    Text(String),
}

/// Reads a weight version that is a string (SGLang) or, leniently, any other JSON value
/// (its JSON text). `null` is no version.
fn version_text<'de, D: Deserializer<'de>>(d: D) -> Result<Option<String>, D::Error> {
    Ok(match Option::<Value>::deserialize(d)? {
        None | Some(Value::Null) => None,
        Some(Value::String(s)) => Some(s),
        Some(other) => Some(other.to_string()),
    })
}

// ---------------------------------------------------------------------------------------
// Control endpoints

/// `POST /update_weights_from_disk` (`UpdateWeightFromDiskReqInput`).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct UpdateWeightsFromDiskRequest {
    /// A directory (HF layout) the server can read.
    pub model_path: String,
    /// The version the new weights report in `meta_info.weight_version`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub weight_version: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub load_format: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub abort_all_requests: Option<bool>,
    /// SGLang's default: `true`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub flush_cache: Option<bool>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub keep_pause: Option<bool>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub is_async: Option<bool>,
}

/// The answer to `/update_weights_from_disk` (`UpdateWeightFromDiskReqOutput`; HTTP 200 on
/// success, 400 with `success: false` otherwise).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct UpdateWeightsFromDiskResponse {
    pub success: bool,
    #[serde(default)]
    pub message: String,
    #[serde(default)]
    pub num_paused_requests: u64,
}

/// `POST /update_weights_from_tensor` (`UpdateWeightsFromTensorReqInput` in
/// `io_struct.py`): new weights from a process on the same machine, without a file.
/// `serialized_named_tensors` holds one entry per tensor-parallel rank: SGLang's
/// `MultiprocessingSerializer` output (a pickle of `(name, tensor)` pairs whose tensors
/// travel as CUDA IPC handles, or a flattened bucket with `load_format =
/// "flattened_bucket"`), base64-encoded over HTTP. graft models the envelope; the entries
/// are opaque strings here (only a torch process can make or read them).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct UpdateWeightsFromTensorRequest {
    pub serialized_named_tensors: Vec<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub load_format: Option<String>,
    /// SGLang's default: `true`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub flush_cache: Option<bool>,
    /// SGLang's default: `false`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub abort_all_requests: Option<bool>,
    /// The version the new weights report in `meta_info.weight_version`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub weight_version: Option<String>,
}

/// The answer to `/update_weights_from_tensor` (`UpdateWeightsFromTensorReqOutput`; HTTP 200
/// on success, 400 with `success: false` otherwise).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct UpdateWeightsFromTensorResponse {
    pub success: bool,
    #[serde(default)]
    pub message: String,
}

/// `POST /begin_weight_update` (`BeginWeightUpdateReqInput`): opens the weight-update
/// session that SGLang 0.5.23 requires around `/update_weights_from_tensor` (and
/// `/update_weights_from_distributed`); `/end_weight_update` (`EndWeightUpdateReqInput`,
/// no fields) closes it. Both answer `{success, message}` (the shape of
/// [`UpdateWeightsFromTensorResponse`]), 400 when refused.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct BeginWeightUpdateRequest {
    /// Which runners: `target`, `draft` or `all` (SGLang's default).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub selector: Option<String>,
}

/// SGLang's refusals around the weight-update session
/// (`managers/scheduler_components/weight_updater.py`).
pub mod weight_session {
    pub const TENSOR_OUTSIDE: &str =
        "update_weights_from_tensor must run between begin_weight_update() and end_weight_update()";
    pub const ALREADY_OPEN: &str =
        "a weight-update session is already open; call end_weight_update() first";
    pub const NOT_OPEN: &str = "no weight-update session is open; call begin_weight_update() first";
}

/// `POST /pause_generation` (`PauseGenerationReqInput`).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct PauseGenerationRequest {
    /// SGLang's default: [`PauseMode::Abort`].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mode: Option<PauseMode>,
}

/// How `/pause_generation` treats the requests in flight.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum PauseMode {
    /// Abort them (each ends with `finish_reason.type = "abort"`).
    #[default]
    Abort,
    /// Put them back in the waiting queue; they resume after `/continue_generation`.
    Retract,
    /// Freeze them where they are, KV cache kept.
    InPlace,
}

/// `POST /continue_generation` (`ContinueGenerationReqInput`).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ContinueGenerationRequest {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub torch_empty_cache: Option<bool>,
}

/// `POST /flush_cache` (`FlushCacheReqInput`). SGLang answers with plain text, not JSON.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct FlushCacheRequest {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub timeout_s: Option<f64>,
}

/// `POST /abort_request` (`AbortReq`): one request by `rid`, or all.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct AbortRequest {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rid: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub abort_all: Option<bool>,
}

/// The answer of `/pause_generation` and `/continue_generation`:
/// `{"message": "...", "status": "ok"}`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct MessageResponse {
    pub message: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub status: Option<String>,
}

/// `GET /get_model_info`. The last three fields are `graft serve`'s own additions (SGLang
/// does not send them).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct ModelInfo {
    pub model_path: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tokenizer_path: Option<String>,
    #[serde(default)]
    pub is_generation: bool,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub preferred_sampling_params: Option<Value>,
    #[serde(
        default,
        deserialize_with = "version_text",
        skip_serializing_if = "Option::is_none"
    )]
    pub weight_version: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub running: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub waiting: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub paused: Option<bool>,
}

/// `GET /server_info`: what graft reads of it (the server's resolved arguments and its
/// `version`; everything else is ignored). `graft` is `graft serve`'s own: it marks a
/// server that is not SGLang, whose `version` is graft's.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct ServerInfo {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub version: Option<String>,
    /// `--incremental-streaming-output`: streamed events hold only what is new. Without it
    /// every event re-sends every id and logprob so far.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub incremental_streaming_output: Option<bool>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub load_format: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model_path: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub graft: Option<bool>,
}

/// The oldest SGLang release graft works with: the first with sglang#10071 (merged
/// 2025-11-26), before which `/pause_generation` ignored its `mode` and aborted every
/// request in flight, so each weight push lost the calls it was meant to keep.
pub const MIN_VERSION: (u32, u32, u32) = (0, 5, 6);

/// `major.minor.patch` of a version string (`0.5.23`, `0.5.6.post1`, `v0.5.10rc0`); None when
/// it does not start so.
pub fn parse_version(v: &str) -> Option<(u32, u32, u32)> {
    let v = v.trim().trim_start_matches('v');
    let mut parts = v.splitn(3, '.');
    let num = |s: &str| -> Option<u32> {
        let digits: String = s.chars().take_while(char::is_ascii_digit).collect();
        digits.parse().ok()
    };
    let major = num(parts.next()?)?;
    let minor = num(parts.next()?)?;
    let patch = parts.next().map_or(Some(0), num)?;
    Some((major, minor, patch))
}

/// An error body in the shape of SGLang's `ErrorResponse` (its OpenAI-compatible protocol
/// module): `{"object": "error", "message", "type", "param", "code"}`. `graft serve` and the
/// scripted upstream answer their errors so.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ErrorResponse {
    #[serde(default = "error_object")]
    pub object: String,
    pub message: String,
    #[serde(rename = "type", default)]
    pub kind: String,
    #[serde(default)]
    pub param: Option<String>,
    #[serde(default)]
    pub code: u16,
}

fn error_object() -> String {
    "error".to_owned()
}

impl ErrorResponse {
    /// An error body with SGLang's `object` and the given type (`BadRequestError`, ...).
    pub fn new(code: u16, kind: &str, message: impl Into<String>) -> Self {
        ErrorResponse {
            object: error_object(),
            message: message.into(),
            kind: kind.to_owned(),
            param: None,
            code,
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

    use super::*;
    use serde_json::json;

    // The fixtures under `wire/fixtures/` are written by hand from SGLang's source (the files
    // named in this module's doc), in the shapes its `/generate` and control routes send and
    // take; they are not captured from a running SGLang.

    fn fixture(name: &str) -> Value {
        let text = match name {
            "generate_request" => include_str!("../fixtures/generate_request.json"),
            "generate_response" => include_str!("../fixtures/generate_response.json"),
            "generate_stream" => include_str!("../fixtures/generate_stream.jsonl"),
            "finish_reasons" => include_str!("../fixtures/finish_reasons.json"),
            "control" => include_str!("../fixtures/control.json"),
            other => panic!("no fixture {other}"),
        };
        if name == "generate_stream" {
            Value::Array(
                text.lines()
                    .filter(|l| !l.trim().is_empty())
                    .map(|l| serde_json::from_str(l).unwrap())
                    .collect(),
            )
        } else {
            serde_json::from_str(text).unwrap()
        }
    }

    /// Drops the keys of `v` this crate does not model (recursively), so a round trip can be
    /// compared with the fixture.
    fn known_only(v: &Value, known: &Value) -> Value {
        match (v, known) {
            (Value::Object(a), Value::Object(k)) => Value::Object(
                a.iter()
                    .filter_map(|(key, val)| {
                        k.get(key).map(|kv| (key.clone(), known_only(val, kv)))
                    })
                    .collect(),
            ),
            (Value::Array(a), Value::Array(k)) => {
                Value::Array(a.iter().zip(k).map(|(x, y)| known_only(x, y)).collect())
            }
            _ => v.clone(),
        }
    }

    #[test]
    fn generate_request_round_trips_and_ignores_unknown_fields() {
        let f = fixture("generate_request");
        let r: GenerateRequest = serde_json::from_value(f.clone()).unwrap();
        assert_eq!(r.input_ids.as_deref(), Some(&[151644u32, 872, 198][..]));
        assert!(r.is_stream());
        assert_eq!(r.rid.as_deref(), Some("r-1"));
        assert_eq!(r.routing_key.as_deref(), Some("session-7"));
        assert_eq!(r.logprob_start_len, Some(-1));
        let sp = r.sampling_params.clone().unwrap();
        assert_eq!(sp.max_new_tokens, Some(512));
        assert_eq!(sp.top_k, Some(20));
        assert_eq!(sp.min_p, Some(0.05));
        assert_eq!(sp.stop, Some(Stop::Many(vec!["</answer>".into()])));
        assert_eq!(sp.stop_token_ids, Some(vec![151645]));
        assert_eq!(sp.repetition_penalty, Some(1.05));
        assert_eq!(sp.no_stop_trim, Some(true));
        assert_eq!(sp.skip_special_tokens, Some(false));
        assert_eq!(sp.sampling_seed, Some(3));
        let back = serde_json::to_value(&r).unwrap();
        // Everything modelled comes back as it was; the unknown keys are dropped.
        assert_eq!(back, known_only(&f, &back));
        assert!(f.get("lora_path").is_some() && back.get("lora_path").is_none());
        assert!(back["sampling_params"].get("custom_future_knob").is_none());
    }

    #[test]
    fn unknown_sampling_keys_are_refused_in_serdes_words() {
        let body =
            json!({"input_ids": [1], "sampling_params": {"temperature": 0.5, "graft_bogus": 1}});
        let e = sampling_params_contract_error(&body).unwrap();
        assert!(
            e.starts_with("unknown field `graft_bogus`, expected one of `max_new_tokens`, `stop`,"),
            "{e}"
        );
        assert!(e.ends_with("`watermark`, `choice`"), "{e}");
        // Every key graft's own SamplingParams writes is one SGLang reads.
        let all = json!({"sampling_params": {
            "temperature": 1.0, "top_p": 1.0, "top_k": -1, "min_p": 0.0, "max_new_tokens": 1,
            "min_new_tokens": 0, "stop": "x", "stop_token_ids": [1], "sampling_seed": 1,
            "presence_penalty": 0.0, "frequency_penalty": 0.0, "repetition_penalty": 1.0,
            "ignore_eos": false, "no_stop_trim": false, "skip_special_tokens": true,
            "spaces_between_special_tokens": true, "n": 1, "json_schema": "{}", "regex": "a",
            "ebnf": "a", "logit_bias": {"1": 0.5}, "custom_params": {}}});
        let sp: SamplingParams = serde_json::from_value(all["sampling_params"].clone()).unwrap();
        let written = json!({"sampling_params": serde_json::to_value(&sp).unwrap()});
        assert_eq!(written["sampling_params"].as_object().unwrap().len(), 22);
        assert_eq!(sampling_params_contract_error(&written), None);
        assert_eq!(
            sampling_params_contract_error(&json!({"input_ids": [1]})),
            None
        );
    }

    #[test]
    fn absent_fields_stay_absent() {
        let r = GenerateRequest {
            input_ids: Some(vec![1, 2]),
            ..Default::default()
        };
        assert_eq!(
            serde_json::to_value(&r).unwrap(),
            json!({"input_ids": [1, 2]})
        );
        let s: SamplingParams = serde_json::from_value(json!({"stop": "END"})).unwrap();
        assert_eq!(s.stop.unwrap().to_vec(), vec!["END".to_string()]);
        assert_eq!(
            serde_json::to_value(SamplingParams::default()).unwrap(),
            json!({})
        );
    }

    #[test]
    fn whole_answer_round_trips() {
        let f = fixture("generate_response");
        let r: GenerateResponse = serde_json::from_value(f.clone()).unwrap();
        assert_eq!(r.output_ids, vec![40, 1079, 151645]);
        let m = &r.meta_info;
        assert_eq!(m.id.as_deref(), Some("4c1e0f1f9c1b4a7e8d7f6a5b4c3d2e1f"));
        assert_eq!(m.prompt_tokens, Some(12));
        assert_eq!(m.completion_tokens, Some(3));
        assert_eq!(m.cached_tokens, Some(8));
        assert_eq!(m.weight_version.as_deref(), Some("step-3"));
        let lps = m.output_token_logprobs.as_ref().unwrap();
        assert_eq!(lps.len(), 3);
        assert_eq!(lps[0].logprob(), Some(-0.0123));
        assert_eq!(lps[2].token_id(), 151645);
        assert_eq!(lps[2].2, None);
        let fin = m.finish_reason.as_ref().unwrap();
        assert_eq!(fin.kind, FinishKind::Stop);
        assert_eq!(fin.matched, Some(Matched::Token(151645)));
        let spans = m.weight_versions.as_ref().unwrap();
        assert_eq!(
            spans,
            &vec![
                WeightVersionSpan {
                    version: "step-2".into(),
                    start: 0,
                    end: 1
                },
                WeightVersionSpan {
                    version: "step-3".into(),
                    start: 1,
                    end: 3
                },
            ]
        );
        let back = serde_json::to_value(&r).unwrap();
        assert_eq!(back, known_only(&f, &back));
        assert!(f["meta_info"].get("reasoning_tokens").is_some());
    }

    #[test]
    fn stream_events_parse_with_null_finish_until_the_last() {
        let events = fixture("generate_stream");
        let events: Vec<GenerateResponse> = events
            .as_array()
            .unwrap()
            .iter()
            .map(|e| serde_json::from_value(e.clone()).unwrap())
            .collect();
        assert_eq!(events.len(), 3);
        assert!(
            events[..2]
                .iter()
                .all(|e| e.meta_info.finish_reason.is_none())
        );
        assert_eq!(
            events[1].output_ids,
            vec![40, 1079],
            "cumulative by default"
        );
        let last = events[2].meta_info.finish_reason.clone().unwrap();
        assert_eq!(last, FinishReason::length(3));
        // A streamed event that has not finished writes `finish_reason: null`, as SGLang does.
        assert_eq!(
            serde_json::to_value(&events[0]).unwrap()["meta_info"]["finish_reason"],
            Value::Null
        );
    }

    #[test]
    fn every_finish_reason_shape_reads_and_writes_back() {
        let all = fixture("finish_reasons");
        let mut kinds = vec![];
        for f in all.as_array().unwrap() {
            let r: FinishReason = serde_json::from_value(f.clone()).unwrap();
            let back = serde_json::to_value(&r).unwrap();
            // `null` fields (an abort without status_code) are left out when written.
            let f_no_nulls: Map<String, Value> = f
                .as_object()
                .unwrap()
                .iter()
                .filter(|(_, v)| !v.is_null())
                .map(|(k, v)| (k.clone(), v.clone()))
                .collect();
            assert_eq!(back, Value::Object(f_no_nulls), "{f}");
            kinds.push(r);
        }
        assert_eq!(kinds[0].matched, Some(Matched::Token(151645)));
        assert_eq!(
            kinds[1].matched,
            Some(Matched::Tokens(vec![128001, 128009]))
        );
        assert_eq!(kinds[2].matched, Some(Matched::Text("</answer>".into())));
        assert_eq!(kinds[3].length, Some(512));
        assert_eq!(kinds[4].kind, FinishKind::Abort);
        assert_eq!(kinds[4].status_code, Some(400));
        assert_eq!(kinds[5].kind, FinishKind::Abort);
        assert_eq!(kinds[5].message.as_deref(), Some("Aborted"));
        assert_eq!(
            kinds[6].kind,
            FinishKind::Other("cancelled".into()),
            "unknown types are kept"
        );
    }

    #[test]
    fn weight_version_numbers_are_read_as_text() {
        let r: GenerateResponse = serde_json::from_value(
            json!({"output_ids": [], "meta_info": {"weight_version": 7, "finish_reason": null}}),
        )
        .unwrap();
        assert_eq!(r.meta_info.weight_version.as_deref(), Some("7"));
        assert_eq!(r.text, "");
    }

    #[test]
    fn bad_answers_fail_to_read() {
        assert!(serde_json::from_value::<GenerateResponse>(json!({"text": "x"})).is_err());
        assert!(serde_json::from_value::<GenerateResponse>(json!({"output_ids": [-1]})).is_err());
        assert!(
            serde_json::from_value::<GenerateResponse>(
                json!({"output_ids": [], "meta_info": {"finish_reason": {"matched": 1}}})
            )
            .is_err(),
            "a finish_reason without type"
        );
    }

    #[test]
    fn control_bodies_round_trip() {
        let c = fixture("control");
        let u: UpdateWeightsFromDiskRequest =
            serde_json::from_value(c["update_weights_from_disk"].clone()).unwrap();
        assert_eq!(u.model_path, "/ckpt/step-3");
        assert_eq!(u.weight_version.as_deref(), Some("step-3"));
        assert_eq!(u.flush_cache, Some(true));
        let back = serde_json::to_value(&u).unwrap();
        assert_eq!(back, known_only(&c["update_weights_from_disk"], &back));

        let t: UpdateWeightsFromTensorRequest = serde_json::from_value(serde_json::json!({
            "serialized_named_tensors": ["gAR9cQA="], "load_format": "flattened_bucket",
            "flush_cache": true, "abort_all_requests": false, "weight_version": "step-3",
            "disable_draft_model": null
        }))
        .unwrap();
        assert_eq!(t.serialized_named_tensors, ["gAR9cQA="]);
        assert_eq!(t.load_format.as_deref(), Some("flattened_bucket"));
        assert_eq!(t.weight_version.as_deref(), Some("step-3"));
        let back = serde_json::to_value(&t).unwrap();
        assert!(back.get("disable_draft_model").is_none());
        let r: UpdateWeightsFromTensorResponse =
            serde_json::from_value(serde_json::json!({"success": false, "message": "bad"}))
                .unwrap();
        assert!(!r.success && r.message == "bad");

        let a: UpdateWeightsFromDiskResponse =
            serde_json::from_value(c["update_weights_from_disk_answer"].clone()).unwrap();
        assert!(a.success);
        assert_eq!(a.num_paused_requests, 2);
        assert_eq!(
            serde_json::to_value(&a).unwrap(),
            c["update_weights_from_disk_answer"]
        );
        let refused: UpdateWeightsFromDiskResponse =
            serde_json::from_value(c["update_weights_from_disk_refused"].clone()).unwrap();
        assert!(!refused.success);

        for (key, mode) in [
            ("pause_abort", PauseMode::Abort),
            ("pause_retract", PauseMode::Retract),
            ("pause_in_place", PauseMode::InPlace),
        ] {
            let p: PauseGenerationRequest = serde_json::from_value(c[key].clone()).unwrap();
            assert_eq!(p.mode, Some(mode));
            assert_eq!(serde_json::to_value(&p).unwrap(), c[key]);
        }
        let none: PauseGenerationRequest = serde_json::from_value(json!({})).unwrap();
        assert_eq!(
            none.mode.unwrap_or_default(),
            PauseMode::Abort,
            "SGLang's default"
        );
        assert!(
            serde_json::from_value::<PauseGenerationRequest>(json!({"mode": "drain"}))
                .unwrap_err()
                .to_string()
                .contains("in_place")
        );

        let m: MessageResponse = serde_json::from_value(c["pause_answer"].clone()).unwrap();
        assert_eq!(m.status.as_deref(), Some("ok"));
        assert_eq!(serde_json::to_value(&m).unwrap(), c["pause_answer"]);

        let cont: ContinueGenerationRequest =
            serde_json::from_value(c["continue_generation"].clone()).unwrap();
        assert_eq!(cont.torch_empty_cache, Some(true));
        assert_eq!(
            serde_json::to_value(ContinueGenerationRequest::default()).unwrap(),
            json!({})
        );
        assert_eq!(
            serde_json::to_value(FlushCacheRequest::default()).unwrap(),
            json!({})
        );

        let ab: AbortRequest = serde_json::from_value(c["abort_request"].clone()).unwrap();
        assert_eq!(ab.rid.as_deref(), Some("r-1"));
        assert_eq!(serde_json::to_value(&ab).unwrap(), c["abort_request"]);

        let info: ModelInfo = serde_json::from_value(c["get_model_info"].clone()).unwrap();
        assert_eq!(info.model_path, "Qwen/Qwen3-8B");
        assert!(info.is_generation);
        assert_eq!(info.weight_version.as_deref(), Some("default"));
        let back = serde_json::to_value(&info).unwrap();
        assert_eq!(back, known_only(&c["get_model_info"], &back));

        let e: ErrorResponse = serde_json::from_value(c["error"].clone()).unwrap();
        assert_eq!(e.code, 400);
        assert_eq!(serde_json::to_value(&e).unwrap(), c["error"]);
    }

    #[test]
    fn versions_read_as_sglang_writes_them() {
        assert_eq!(parse_version("0.5.23"), Some((0, 5, 23)));
        assert_eq!(parse_version("0.5.6.post1"), Some((0, 5, 6)));
        assert_eq!(parse_version("v0.5.10rc0"), Some((0, 5, 10)));
        assert_eq!(parse_version("0.6"), Some((0, 6, 0)));
        assert_eq!(parse_version("graft"), None);
        assert!(parse_version("0.5.5.post3").unwrap() < MIN_VERSION);
        assert!(parse_version("0.5.10").unwrap() > MIN_VERSION);
    }

    #[test]
    fn server_info_reads_the_resolved_arguments() {
        // The keys as `/server_info` sends them (`server_args.resolved_dict()` + `version`).
        let v = json!({"model_path": "Qwen/Qwen3-8B", "incremental_streaming_output": false,
            "load_format": "dummy", "version": "0.5.23", "internal_states": [{}], "tp_size": 1});
        let info: ServerInfo = serde_json::from_value(v).unwrap();
        assert_eq!(info.version.as_deref(), Some("0.5.23"));
        assert_eq!(info.incremental_streaming_output, Some(false));
        assert_eq!(info.load_format.as_deref(), Some("dummy"));
        assert_eq!(info.graft, None);
    }
}

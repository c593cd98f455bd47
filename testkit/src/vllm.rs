//! The scripted upstream's vLLM-native side (with `--tokenizer`): `POST /v1/completions`
//! whose `prompt` is a list of token ids answers as vLLM 0.34 does with `return_token_ids`,
//! `logprobs` and `return_weight_versions` (`graft-wire`'s [`graft_wire::vllm`] types, which
//! cite vLLM's source): whole, or streamed as deltas (the first chunk with
//! `prompt_token_ids`, each with its new `token_ids` and logprobs, the last with
//! `finish_reason`, `stop_reason` and the weight-version spans, then a usage chunk when
//! `stream_options.include_usage`, then `data: [DONE]`). The reply is the model's raw output
//! for the script's answer, as on the SGLang side, tokenized with the real tokenizer; each
//! token's logprob is [`scripted_logprob`]. `logprobs: n` (n > 0) also answers each
//! position's candidates as vLLM orders them: the sampled token first, then the scripted top
//! `n` ([`candidates`], where a token more likely than the sampled one leads), `n + 1` at
//! most, keyed by text or, under `return_tokens_as_token_ids`, by `token_id:{id}` (as
//! `tokens` are then too).
//!
//! It refuses what vLLM refuses, in vLLM's error shape (`{"error": {"message", "type",
//! "param", "code"}}`): a prompt longer than the context ([`MAX_MODEL_LEN`], Qwen3's), a
//! `max_tokens` that does not fit beside the prompt, `logprobs` above vLLM's default
//! `--max-logprobs` (20), `stream_options` without `stream`, `top_k` below -1, a negative
//! temperature, `top_p` outside (0, 1], an unknown model name (404), an out-of-vocabulary id,
//! `structured_outputs` with no constraint or several, or a `structural_tag` that is not
//! one (its shape is checked; vLLM has xgrammar compile it).
//! No `max_tokens` means 16, as on vLLM. `stop_token_ids` and `stop` strings end the output
//! with `stop_reason` naming them (the stop id is kept in `token_ids`); the end-of-turn
//! token ends it with `stop_reason: null`. Script faults: `500` (before a stream: a 500 JSON
//! error; in a stream: HTTP 200, then `data: {"error": ...}` and `[DONE]`, as vLLM sends a
//! generation error), `abort` (`finish_reason: "abort"`), `hang`, `garbage`, `reset`.
//!
//! vLLM aborts a request when its client closes the connection; this side notes it the same
//! way: a streamed answer whose body is dropped before its end counts its `request_id` as
//! aborted. `GET /testkit/vllm/requests` answers `{"completions": [{"request_id", "body"
//! (without the prompt), "prompt_tokens", "prompt_text" (the prompt decoded)}, ...], "aborted": [request_id, ...], "control":
//! [{"path" (with its query), "body"}, ...]}` (`control`: every call of a development route).
//!
//! Generations step as vLLM's engine does, [`TOKENS_PER_CHUNK`] tokens a step, each step's
//! tokens stamped with the weight version current when they were sampled (`"default"` until
//! `/update_weight_version`); the last chunk's `weight_versions` spans say which version
//! sampled which tokens. A script rule's `weight_update_after` holds a generation after that
//! many tokens until the version changes (as on the SGLang side), so a generation straddles
//! a push deterministically.
//!
//! With `--vllm-dev-mode` (vLLM's `VLLM_SERVER_DEV_MODE=1`) it serves the development
//! routes a weight push uses (`graft-wire`'s `vllm` module cites vLLM's files):
//! `POST /pause?mode=keep` (no generation steps, new ones wait, until `/resume`; other
//! modes are refused: graft pauses in place), `POST /resume`, `GET /is_paused`, `POST
//! /reset_prefix_cache` (`{"success": true}`), `POST /collective_rpc` (`reload_weights`
//! with a `weights_path`, not looked at; another method is vLLM's 500), `POST
//! /update_weight_version`, `GET /weight_info`. Without the flag they answer FastAPI's 404
//! `{"detail": "Not Found"}`, as vLLM does. `--expect-key` does not guard them (vLLM's
//! `--api-key` guards `/v1` and a few other prefixes only).

use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};

use bytes::Bytes;
use graft_wire::vllm::{
    self as wire, Choice, CollectiveRpcRequest, CollectiveRpcResponse, CompletionRequest,
    CompletionResponse, ErrorResponse, IsPausedResponse, Logprobs, ResetPrefixCacheResponse,
    StatusResponse, StopReason, UpdateWeightVersionRequest, UpdateWeightVersionResponse, Usage,
    WeightInfo, WeightVersionSpan,
};
use http::{Response, StatusCode};
use http_body_util::BodyExt as _;
use hyper::body::{Body, Frame, SizeHint};
use serde::Deserialize as _;
use serde_json::{Value, json};
use tokio::sync::{mpsc, watch};

use crate::RESET_FLUSH_PAUSE;
use crate::answer::{Abort, RespBody, SseBody, json_response};
use crate::faults::garbage;
use crate::openai::{DONE, sse};
use crate::script::scripted_logprob;
use crate::sglang::{next_version, prompt_of, raw_output};
use crate::state::{State, VllmSide};

/// The context length the scripted vLLM serves (Qwen3's `max_position_embeddings`).
pub const MAX_MODEL_LEN: usize = 40960;

/// Tokens per streamed chunk.
const TOKENS_PER_CHUNK: usize = 2;

/// The path of the test log of what the vLLM side was asked.
pub(crate) const REQUESTS: &str = "/testkit/vllm/requests";

/// Whether this side plays a vLLM before 0.34 (`--vllm-version`), as read from 0.11.0's
/// source: no weight-version spans; of the development routes only `/reset_prefix_cache`
/// (an empty 200) and `/collective_rpc`, whose `reload_weights` takes no `weights_path`
/// (it reloads from `model_config.model`, which `update_config` can point elsewhere).
pub(crate) fn plays_old(state: &State) -> bool {
    !wire::reports_weight_versions(&state.vllm_version)
}

/// Whether `path` is one of vLLM's development routes (see the module doc).
pub(crate) fn is_dev_route(path: &str) -> bool {
    [
        wire::path::PAUSE,
        wire::path::RESUME,
        wire::path::IS_PAUSED,
        wire::path::RESET_PREFIX_CACHE,
        wire::path::COLLECTIVE_RPC,
        wire::path::UPDATE_WEIGHT_VERSION,
        wire::path::WEIGHT_INFO,
    ]
    .contains(&path)
}

/// FastAPI's answer for a route the app does not have.
pub(crate) fn not_found() -> Response<RespBody> {
    json_response(StatusCode::NOT_FOUND, &json!({"detail": "Not Found"}))
}

/// An answer of one of the wire's types.
fn typed(status: StatusCode, v: &impl serde::Serialize) -> Response<RespBody> {
    json_response(status, &serde_json::to_value(v).unwrap_or(Value::Null))
}

/// A development route (`--vllm-dev-mode`); `query` is the URL's query string.
pub(crate) fn dev_route(
    state: &State,
    method: &http::Method,
    path: &str,
    query: Option<&str>,
    body: &Value,
) -> Response<RespBody> {
    if !state.vllm_dev_mode {
        return not_found();
    }
    let old = plays_old(state);
    if old && ![wire::path::RESET_PREFIX_CACHE, wire::path::COLLECTIVE_RPC].contains(&path) {
        return not_found();
    }
    let b = &state.vllm;
    let full = match query {
        Some(q) => format!("{path}?{q}"),
        None => path.to_owned(),
    };
    if let Ok(mut c) = b.control.lock() {
        c.push(json!({"path": full, "body": body}));
    }
    let param = |name: &str| {
        query
            .unwrap_or_default()
            .split('&')
            .filter_map(|kv| kv.split_once('='))
            .find(|(k, _)| *k == name)
            .map(|(_, v)| v.to_owned())
    };
    let get = *method == http::Method::GET;
    let method_not_allowed = || {
        json_response(
            StatusCode::METHOD_NOT_ALLOWED,
            &json!({"detail": "Method Not Allowed"}),
        )
    };
    match path {
        wire::path::IS_PAUSED | wire::path::WEIGHT_INFO if !get => method_not_allowed(),
        wire::path::IS_PAUSED => typed(
            StatusCode::OK,
            &IsPausedResponse {
                is_paused: *b.paused.borrow(),
            },
        ),
        wire::path::WEIGHT_INFO => typed(
            StatusCode::OK,
            &WeightInfo {
                weight_version: b.weight_version.borrow().clone(),
            },
        ),
        _ if get => method_not_allowed(),
        wire::path::PAUSE => match param("mode").as_deref().unwrap_or("abort") {
            "keep" => {
                b.paused.send_replace(true);
                typed(
                    StatusCode::OK,
                    &StatusResponse {
                        status: "paused".into(),
                    },
                )
            }
            m @ ("abort" | "wait") => json_response(
                StatusCode::BAD_REQUEST,
                &json!({"error": format!("the scripted vLLM plays mode=keep only (graft pauses in place), not mode={m}")}),
            ),
            m => json_response(
                StatusCode::UNPROCESSABLE_ENTITY,
                &json!({"detail": [{"type": "literal_error", "loc": ["query", "mode"],
                    "msg": "Input should be 'abort', 'wait' or 'keep'", "input": m}]}),
            ),
        },
        wire::path::RESUME => {
            b.paused.send_replace(false);
            typed(
                StatusCode::OK,
                &StatusResponse {
                    status: "resumed".into(),
                },
            )
        }
        wire::path::RESET_PREFIX_CACHE if old => json_response(StatusCode::OK, &Value::Null),
        wire::path::RESET_PREFIX_CACHE => {
            typed(StatusCode::OK, &ResetPrefixCacheResponse { success: true })
        }
        wire::path::COLLECTIVE_RPC => {
            let Ok(req) = CollectiveRpcRequest::deserialize(body) else {
                return error(
                    StatusCode::BAD_REQUEST,
                    "Bad Request",
                    "Missing 'method' in request body",
                    None,
                );
            };
            if old {
                return old_collective_rpc(b, &req);
            }
            if req.method != wire::RELOAD_WEIGHTS {
                return error(
                    StatusCode::INTERNAL_SERVER_ERROR,
                    "InternalServerError",
                    &format!(
                        "'Worker' object has no attribute '{}' (the scripted vLLM plays reload_weights only)",
                        req.method
                    ),
                    None,
                );
            }
            if !req.kwargs.contains_key(wire::WEIGHTS_PATH) {
                return error(
                    StatusCode::INTERNAL_SERVER_ERROR,
                    "InternalServerError",
                    "reload_weights needs weights_path (the scripted vLLM has no weights_iterator)",
                    None,
                );
            }
            typed(
                StatusCode::OK,
                &CollectiveRpcResponse {
                    results: vec![Value::Null],
                },
            )
        }
        wire::path::UPDATE_WEIGHT_VERSION => {
            let Ok(req) = UpdateWeightVersionRequest::deserialize(body) else {
                return json_response(
                    StatusCode::UNPROCESSABLE_ENTITY,
                    &json!({"detail": [{"type": "missing", "loc": ["body", "new_version"], "msg": "Field required"}]}),
                );
            };
            b.weight_version.send_replace(req.new_version.clone());
            typed(
                StatusCode::OK,
                &UpdateWeightVersionResponse {
                    success: true,
                    new_version: req.new_version,
                },
            )
        }
        _ => not_found(),
    }
}

/// `/collective_rpc` on a vLLM before 0.34: `update_config` (model_config / load_config
/// overrides) and `reload_weights()`; a worker's exception (a keyword it does not take)
/// reaches the client as Starlette's bare 500.
fn old_collective_rpc(b: &VllmSide, req: &CollectiveRpcRequest) -> Response<RespBody> {
    let bare_500 = || {
        Response::builder()
            .status(StatusCode::INTERNAL_SERVER_ERROR)
            .header(http::header::CONTENT_TYPE, "text/plain; charset=utf-8")
            .body(crate::answer::full(Bytes::from_static(
                b"Internal Server Error",
            )))
            .unwrap_or_else(|_| not_found())
    };
    match req.method.as_str() {
        wire::UPDATE_CONFIG => {
            let model = req.kwargs.get("overrides").and_then(|o| {
                let o = o.as_object()?;
                if o.keys().any(|k| k != "model_config" && k != "load_config") {
                    return None;
                }
                Some(o.get("model_config")?.get("model")?.as_str()?.to_owned())
            });
            match model {
                Some(m) => {
                    if let Ok(mut p) = b.model_path.lock() {
                        *p = Some(m);
                    }
                    typed(
                        StatusCode::OK,
                        &CollectiveRpcResponse {
                            results: vec![Value::Null],
                        },
                    )
                }
                None => bare_500(),
            }
        }
        wire::RELOAD_WEIGHTS if req.kwargs.is_empty() && req.args.is_empty() => {
            let reloaded = b.model_path.lock().ok().and_then(|p| p.clone());
            if let Ok(mut c) = b.control.lock() {
                c.push(json!({"reloaded_from": reloaded}));
            }
            typed(
                StatusCode::OK,
                &CollectiveRpcResponse {
                    results: vec![Value::Null],
                },
            )
        }
        _ => bare_500(),
    }
}

/// Whether a `/v1/completions` body is for this side: its prompt is a list of token ids.
pub(crate) fn is_token_prompt(body: &Value) -> bool {
    body.get("prompt")
        .and_then(Value::as_array)
        .is_some_and(|a| !a.is_empty() && a.iter().all(Value::is_number))
}

/// vLLM's error answer.
fn error(status: StatusCode, kind: &str, message: &str, param: Option<&str>) -> Response<RespBody> {
    let e = ErrorResponse::new(status.as_u16(), kind, message, param);
    json_response(status, &serde_json::to_value(&e).unwrap_or(Value::Null))
}

fn bad(message: &str, param: Option<&str>) -> Response<RespBody> {
    error(StatusCode::BAD_REQUEST, "BadRequestError", message, param)
}

/// `GET /testkit/vllm/requests`.
pub(crate) fn requests(state: &State) -> Response<RespBody> {
    let b = &state.vllm;
    let seen = b.seen.lock().map(|v| v.clone()).unwrap_or_default();
    let aborted = b.aborted.lock().map(|v| v.clone()).unwrap_or_default();
    let control = b.control.lock().map(|v| v.clone()).unwrap_or_default();
    json_response(
        StatusCode::OK,
        &json!({"completions": seen, "aborted": aborted, "control": control}),
    )
}

/// What vLLM refuses before generating, as its answer (`CompletionRequest`'s validators, `SamplingParams`,
/// `get_max_tokens` and the renderer's length checks).
fn refusal(state: &State, req: &CompletionRequest, raw: &Value) -> Option<Response<RespBody>> {
    if let Some(m) = &req.model
        && !state.models.iter().any(|s| s == m)
        && m != "scripted"
    {
        return Some(error(
            StatusCode::NOT_FOUND,
            "NotFoundError",
            &format!("The model `{m}` does not exist."),
            Some("model"),
        ));
    }
    if raw.get("stream_options").is_some_and(|v| !v.is_null()) && req.stream != Some(true) {
        return Some(bad(
            "Stream options can only be defined when `stream=True`.",
            Some("stream_options"),
        ));
    }
    if let Some(n) = req.logprobs
        && !(-1..=wire::DEFAULT_MAX_LOGPROBS).contains(&n)
    {
        return Some(bad(
            &format!(
                "Requested sample logprobs of {n}, which is greater than max allowed: {}",
                wire::DEFAULT_MAX_LOGPROBS
            ),
            Some("logprobs"),
        ));
    }
    if let Some(why) = raw
        .get("structured_outputs")
        .and_then(structured_outputs_refusal)
    {
        return Some(bad(&why, Some("structured_outputs")));
    }
    if req.n.is_some_and(|n| n != 1) {
        return Some(bad(
            "the scripted vLLM plays one choice per request ('n' must be 1)",
            Some("n"),
        ));
    }
    if let Some(k) = req.top_k
        && k < -1
    {
        return Some(bad(
            &format!("top_k must be 0 (disable), or at least 1, got {k}."),
            Some("top_k"),
        ));
    }
    if let Some(t) = req.temperature
        && t < 0.0
    {
        return Some(bad(
            &format!("temperature must be non-negative, got {t}."),
            Some("temperature"),
        ));
    }
    if let Some(p) = req.top_p
        && !(p > 0.0 && p <= 1.0)
    {
        return Some(bad(
            &format!("top_p must be in (0, 1], got {p}."),
            Some("top_p"),
        ));
    }
    if req.max_tokens == Some(0) {
        return Some(bad(
            "max_tokens must be at least 1, got 0.",
            Some("max_tokens"),
        ));
    }
    let input = req.prompt.len();
    if input > MAX_MODEL_LEN {
        return Some(bad(
            &format!(
                "This model's maximum context length is {MAX_MODEL_LEN} tokens. However, your request has {input} input tokens. Please reduce the length of the input messages."
            ),
            Some("prompt"),
        ));
    }
    let max = max_tokens(req) as usize;
    if input + max > MAX_MODEL_LEN {
        return Some(bad(
            &format!(
                "This model's maximum context length is {MAX_MODEL_LEN} tokens. However, you requested {max} output tokens and your prompt contains {input} input tokens, for a total of {} tokens. Please reduce the length of the input prompt or the number of requested output tokens.",
                input + max
            ),
            Some("max_tokens"),
        ));
    }
    None
}

/// Why vLLM refuses a request's `structured_outputs`, in its words: more than one of `json`,
/// `regex`, `choice` (`check_structured_outputs_count`), not exactly one constraint
/// (`StructuredOutputsParams.__post_init__`), or a `structural_tag` that is not a structural
/// tag (`validate_structured_outputs_structural_tag`). vLLM has xgrammar compile the tag; this
/// side checks its shape only: JSON, `{"type": "structural_tag", "format": ...}` (or the
/// legacy `structures` + `triggers`), every nested format of a type xgrammar 0.2.8 knows.
fn structured_outputs_refusal(so: &Value) -> Option<String> {
    const CONSTRAINTS: [&str; 6] = [
        "json",
        "regex",
        "choice",
        "grammar",
        "json_object",
        "structural_tag",
    ];
    if so.is_null() {
        return None;
    }
    let set = |k: &str| so.get(k).is_some_and(|v| !v.is_null());
    if ["json", "regex", "choice"]
        .iter()
        .filter(|k| set(k))
        .count()
        > 1
    {
        return Some(
            "You can only use one kind of constraints for structured outputs ('json', 'regex' or 'choice').".into(),
        );
    }
    match CONSTRAINTS.iter().filter(|k| set(k)).count() {
        0 => {
            return Some(format!(
                "You must use one kind of structured outputs constraint but none are specified: {so}"
            ));
        }
        1 => {}
        _ => {
            return Some(format!(
                "You can only use one kind of structured outputs constraint but multiple are specified: {so}"
            ));
        }
    }
    let tag = so.get("structural_tag")?;
    let invalid = || Some("Invalid structured_outputs structural_tag specification.".to_string());
    let Some(tag) = tag
        .as_str()
        .and_then(|t| serde_json::from_str::<Value>(t).ok())
    else {
        return invalid();
    };
    let ok = if tag.get("structures").is_some() {
        tag["structures"].is_array() && tag["triggers"].is_array()
    } else {
        tag["type"] == "structural_tag" && known_format(&tag["format"])
    };
    if ok { None } else { invalid() }
}

/// A format of a type xgrammar 0.2.8 knows (`structural_tag.py`), with its nested formats.
fn known_format(f: &Value) -> bool {
    const TYPES: [&str; 21] = [
        "const_string",
        "json_schema",
        "any_text",
        "token",
        "exclude_token",
        "any_tokens",
        "grammar",
        "regex",
        "sequence",
        "or",
        "tag",
        "triggered_tags",
        "token_triggered_tags",
        "tags_with_separator",
        "optional",
        "plus",
        "star",
        "repeat",
        "dispatch",
        "token_dispatch",
        "qwen_xml_parameter",
    ];
    let Some(kind) = f.get("type").and_then(Value::as_str) else {
        return false;
    };
    if !TYPES.contains(&kind) {
        return false;
    }
    let nested = |k: &str| f.get(k).is_none_or(known_format);
    let all = |k: &str| {
        f.get(k)
            .is_none_or(|v| v.as_array().is_some_and(|a| a.iter().all(known_format)))
    };
    nested("content") && all("elements") && all("tags")
}

/// vLLM's `max_tokens` default (`CompletionRequest.max_tokens = 16`).
fn max_tokens(req: &CompletionRequest) -> u64 {
    req.max_tokens.unwrap_or(16)
}

/// One generation: the output ids, the visible text after each prefix, how it ended.
#[derive(Clone)]
struct Generation {
    id: String,
    created: i64,
    model: String,
    prompt: Vec<u32>,
    output: Vec<u32>,
    texts: Vec<String>,
    finish: &'static str,
    stop_reason: Option<StopReason>,
    weight_versions: bool,
    /// Each output token as a `tokens` entry and `top_logprobs` key: its text, or
    /// `token_id:{id}` under `return_tokens_as_token_ids`.
    token_names: Vec<String>,
    /// The names of the candidates at each position ([`candidates`]).
    candidate_names: std::collections::HashMap<u32, String>,
}

/// The scripted candidates at a position where `id` was sampled, in rank order: `id + 1`
/// (more likely than the sampled one, so the sampled token is outside the top unless
/// `logprobs` covers it), then `id`, `id + 2`, … each less likely.
fn candidates(id: u32, n: usize) -> Vec<(u32, f64)> {
    let l = scripted_logprob(id);
    (0..n)
        .map(|k| match k {
            0 => (id.wrapping_add(1), l + 0.5),
            1 => (id, l),
            k => (id.wrapping_add(k as u32), l - k as f64),
        })
        .collect()
}

impl Generation {
    /// The choice for output tokens `from..to`; `versions`: (version, first token) of each
    /// weight version that sampled the output, in order (the last choice's spans).
    fn choice(
        &self,
        from: usize,
        to: usize,
        last: bool,
        first: bool,
        logprobs: Option<i64>,
        versions: &[(String, usize)],
    ) -> Choice {
        let ids = &self.output[from..to];
        let text = |n: usize| self.texts.get(n).cloned().unwrap_or_default();
        let (before, after) = (text(from), text(to));
        // vLLM's `_create_completion_logprobs`: per position the sampled token, then the top
        // `logprobs` in rank order, a candidate already there (the sampled one) not again;
        // the first `logprobs + 1` of those (`completion_top_logprobs_limit`).
        let top = |k: usize, id: u32| {
            let n = usize::try_from(logprobs.unwrap_or(0)).unwrap_or(0);
            let mut m = serde_json::Map::new();
            if n == 0 {
                return m;
            }
            m.insert(
                self.token_names[from + k].clone(),
                json!(scripted_logprob(id)),
            );
            for (alt, l) in candidates(id, n) {
                let name = self.candidate_names.get(&alt).cloned().unwrap_or_default();
                m.entry(name).or_insert(json!(l));
            }
            m
        };
        Choice {
            index: 0,
            text: after.get(before.len()..).unwrap_or_default().to_string(),
            logprobs: logprobs.map(|_| Logprobs {
                text_offset: (from..to).map(|n| text(n).len() as i64).collect(),
                token_logprobs: ids.iter().map(|&i| Some(scripted_logprob(i))).collect(),
                tokens: self.token_names[from..to].to_vec(),
                top_logprobs: ids
                    .iter()
                    .enumerate()
                    .map(|(k, &id)| Some(top(k, id)))
                    .collect(),
            }),
            finish_reason: last.then(|| self.finish.to_string()),
            stop_reason: if last { self.stop_reason.clone() } else { None },
            prompt_token_ids: first.then(|| self.prompt.clone()),
            token_ids: Some(ids.to_vec()),
            weight_versions: (last && self.weight_versions).then(|| spans(versions, to)),
        }
    }

    /// Samples the output as vLLM's engine steps: [`TOKENS_PER_CHUNK`] tokens a step (a
    /// step ends at `hold`, where the generation waits for new weights), none while the
    /// server is paused, `delay` between steps. `step(from, to, versions)` gets each step's
    /// tokens and the versions so far; it returns false when nobody wants more (the client
    /// went away). Returns the versions that sampled the output.
    async fn sample(
        &self,
        engine: Engine,
        mut step: impl FnMut(usize, usize, &[(String, usize)]) -> bool,
    ) -> Vec<(String, usize)> {
        let Engine {
            mut paused,
            version,
            hold,
            delay,
        } = engine;
        let len = self.output.len();
        let mut versions: Vec<(String, usize)> = vec![];
        let mut from = 0;
        loop {
            if from > 0 && !delay.is_zero() {
                tokio::time::sleep(delay).await;
            }
            let _ = paused.wait_for(|p| !*p).await;
            if hold == Some(from)
                && let Some((first, _)) = versions.first()
            {
                next_version(version.clone(), first.clone()).await;
                let _ = paused.wait_for(|p| !*p).await;
            }
            let v = version.borrow().clone();
            if versions.last().map(|(x, _)| x) != Some(&v) {
                versions.push((v, from));
            }
            let mut to = (from + TOKENS_PER_CHUNK).min(len);
            if let Some(h) = hold.filter(|&h| from < h && h < to) {
                to = h;
            }
            if !step(from, to, &versions) || to == len {
                return versions;
            }
            from = to;
        }
    }

    fn answer(&self, choices: Vec<Choice>, usage: Option<Usage>) -> Value {
        let r = CompletionResponse {
            id: self.id.clone(),
            object: "text_completion".into(),
            created: self.created,
            model: self.model.clone(),
            choices,
            usage,
        };
        serde_json::to_value(&r).unwrap_or(Value::Null)
    }

    fn usage(&self) -> Usage {
        Usage {
            prompt_tokens: self.prompt.len() as u64,
            completion_tokens: self.output.len() as u64,
            total_tokens: (self.prompt.len() + self.output.len()) as u64,
            prompt_tokens_details: None,
        }
    }
}

/// The weight-version spans of an output of `n` tokens sampled by `versions`.
fn spans(versions: &[(String, usize)], n: usize) -> Vec<WeightVersionSpan> {
    versions
        .iter()
        .enumerate()
        .map(|(i, (v, at))| WeightVersionSpan {
            version: v.clone(),
            start: *at as u64,
            end: versions.get(i + 1).map_or(n, |(_, e)| *e) as u64,
        })
        .collect()
}

/// What a generation steps by: the server's pause and weight version, the script's hold,
/// the delay between steps.
struct Engine {
    paused: watch::Receiver<bool>,
    version: watch::Receiver<String>,
    hold: Option<usize>,
    delay: std::time::Duration,
}

pub(crate) async fn completions(state: &State, body: &Value) -> Result<Response<RespBody>, Abort> {
    let Some(model) = &state.model else {
        return Ok(bad(
            "a token-id prompt needs the scripted upstream started with --tokenizer DIR",
            Some("prompt"),
        ));
    };
    let req = match CompletionRequest::deserialize(body) {
        Ok(r) => r,
        Err(e) => return Ok(bad(&format!("invalid request: {e}"), None)),
    };
    let request_id = req
        .request_id
        .clone()
        .unwrap_or_else(|| format!("{:032x}", state.next_id()));
    if let Ok(mut seen) = state.vllm.seen.lock() {
        let mut b = body.clone();
        if let Some(o) = b.as_object_mut() {
            o.remove("prompt");
        }
        let text = model.tokenizer.decode(&req.prompt).unwrap_or_default();
        seen.push(
            json!({"request_id": request_id, "body": b, "prompt_tokens": req.prompt.len(),
            "prompt_text": text}),
        );
    }
    if let Some(resp) = refusal(state, &req, body) {
        return Ok(resp);
    }
    let prompt_text = match model.tokenizer.decode(&req.prompt) {
        Ok(t) => t,
        Err(e) => {
            return Ok(bad(
                &format!("Token id out of vocabulary or undecodable prompt: {e}"),
                Some("prompt"),
            ));
        }
    };
    let prompt = prompt_of(&prompt_text);
    let stream = req.stream == Some(true);
    let rule = state.script.rule_for(&prompt);
    let fault = rule.and_then(|r| r.fault.clone());
    let error_event = || {
        let e = ErrorResponse::new(
            500,
            "InternalServerError",
            "scripted fault 500: the engine failed while generating",
            None,
        );
        sse(&serde_json::to_value(&e).unwrap_or(Value::Null))
    };
    match fault.as_deref() {
        Some("500") if !stream => {
            return Ok(error(
                StatusCode::INTERNAL_SERVER_ERROR,
                "InternalServerError",
                "scripted fault 500: the engine failed while generating",
                None,
            ));
        }
        Some("500") => {
            // vLLM's stream has begun (HTTP 200) when a generation error comes.
            return Ok(crate::answer::sse_response(SseBody::new(
                vec![error_event(), Bytes::from_static(DONE)],
                state.chunk_delay,
                None,
            )));
        }
        Some("garbage") => return Ok(garbage(stream)),
        Some("hang") => tokio::time::sleep(std::time::Duration::from_secs(3600)).await,
        Some("reset") if !stream => return Err(Abort),
        _ => {}
    }
    let reply = state.script.reply_or_echo(&prompt);
    let text = raw_output(reply.as_ref(), &model.eos, model.thinks_after(&prompt_text));
    let mut output = match model.tokenizer.encode(&text) {
        Ok(ids) => ids,
        Err(e) => {
            return Ok(error(
                StatusCode::INTERNAL_SERVER_ERROR,
                "InternalServerError",
                &format!("cannot tokenize the reply: {e}"),
                None,
            ));
        }
    };
    let texts_of = |ids: &[u32]| -> Vec<String> {
        (0..=ids.len())
            .map(|n| {
                model
                    .tokenizer
                    .decode_visible(&ids[..n])
                    .unwrap_or_default()
            })
            .collect()
    };
    let eos = model.tokenizer.token_id(&model.eos);
    let stop_ids = req.stop_token_ids.clone().unwrap_or_default();
    let texts = texts_of(&output);
    // Where the output stops: the first stop id (kept), the token completing a stop string
    // (kept: the text is what vLLM trims), or the end-of-turn token; else max_tokens.
    let mut end: Option<(usize, &'static str, Option<StopReason>)> = None;
    for (i, id) in output.iter().enumerate() {
        if stop_ids.contains(id) {
            end = Some((i + 1, "stop", Some(StopReason::Token(i64::from(*id)))));
            break;
        }
        if let Some(s) = req
            .stop
            .iter()
            .find(|s| !s.is_empty() && texts[i + 1].contains(s.as_str()))
        {
            end = Some((i + 1, "stop", Some(StopReason::Text(s.clone()))));
            break;
        }
        if Some(*id) == eos && req.ignore_eos != Some(true) {
            end = Some((i + 1, "stop", None));
            break;
        }
    }
    let (mut n, mut finish, mut stop_reason) = end.unwrap_or((output.len(), "length", None));
    let max = max_tokens(&req) as usize;
    if n > max {
        (n, finish, stop_reason) = (max, "length", None);
    }
    if fault.as_deref() == Some("abort") {
        finish = "abort";
        stop_reason = None;
    }
    output.truncate(n);
    let texts = texts_of(&output);
    let as_ids = req.return_tokens_as_token_ids == Some(true);
    let name_of = |id: u32| {
        if as_ids {
            format!("token_id:{id}")
        } else {
            model.tokenizer.decode(&[id]).unwrap_or_default()
        }
    };
    let token_names = output.iter().map(|&id| name_of(id)).collect();
    let top_n = usize::try_from(req.logprobs.unwrap_or(0)).unwrap_or(0);
    let candidate_names = output
        .iter()
        .flat_map(|&id| candidates(id, top_n))
        .map(|(alt, _)| (alt, name_of(alt)))
        .collect();
    let g = Generation {
        id: format!("cmpl-{request_id}"),
        created: std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs() as i64),
        model: req.model.clone().unwrap_or_else(|| "scripted".into()),
        prompt: req.prompt.clone(),
        output,
        texts,
        finish,
        stop_reason,
        weight_versions: req.return_weight_versions == Some(true) && !plays_old(state),
        token_names,
        candidate_names,
    };
    let logprobs = req.logprobs;
    let with_ids = req.return_token_ids == Some(true);
    let strip = move |mut c: Choice| {
        if !with_ids {
            c.token_ids = None;
            c.prompt_token_ids = None;
        }
        c
    };
    let len = g.output.len();
    let engine = Engine {
        paused: state.vllm.paused.subscribe(),
        version: state.vllm.weight_version.subscribe(),
        hold: rule
            .and_then(|r| r.weight_update_after)
            .filter(|&h| h < len),
        delay: state.chunk_delay,
    };
    if !stream {
        // A whole answer once it is generated.
        let versions = g.sample(engine, |_, _, _| true).await;
        let mut c = strip(g.choice(0, len, true, true, logprobs, &versions));
        if with_ids {
            c.prompt_token_ids = Some(g.prompt.clone());
        }
        return Ok(json_response(
            StatusCode::OK,
            &g.answer(vec![c], Some(g.usage())),
        ));
    }
    let include_usage = req
        .stream_options
        .as_ref()
        .and_then(|o| o.include_usage)
        .unwrap_or(false);
    let reset = fault.as_deref() == Some("reset");
    let (tx, rx) = mpsc::unbounded_channel();
    let task = tokio::spawn(async move {
        let mut sent = 0;
        g.sample(engine, |from, to, versions| {
            let c = strip(g.choice(from, to, to == len, from == 0, logprobs, versions));
            sent += 1;
            // `reset`: the connection dies after two chunks.
            tx.send(Ok(sse(&g.answer(vec![c], None)))).is_ok() && !(reset && sent == 2)
        })
        .await;
        if reset {
            // Let the chunks reach the client before the connection dies.
            tokio::time::sleep(RESET_FLUSH_PAUSE).await;
            let _ = tx.send(Err(std::io::Error::new(
                std::io::ErrorKind::ConnectionAborted,
                Abort,
            )));
            return;
        }
        if include_usage {
            let _ = tx.send(Ok(sse(&g.answer(vec![], Some(g.usage())))));
        }
        let _ = tx.send(Ok(Bytes::from_static(DONE)));
    });
    let body = Streamed {
        rx,
        task,
        ended: false,
        request_id,
        aborted: state.vllm.aborted.clone(),
    };
    let mut resp = Response::new(body.boxed_unsync());
    resp.headers_mut().insert(
        http::header::CONTENT_TYPE,
        http::HeaderValue::from_static("text/event-stream; charset=utf-8"),
    );
    Ok(resp)
}

/// A streamed answer fed by its generation's task; it notes its request as aborted when it
/// is dropped before its end (hyper drops the body when the client closes the connection),
/// as vLLM aborts it then, and stops the generation.
struct Streamed {
    rx: mpsc::UnboundedReceiver<Result<Bytes, std::io::Error>>,
    task: tokio::task::JoinHandle<()>,
    ended: bool,
    request_id: String,
    aborted: Arc<Mutex<Vec<String>>>,
}

impl Body for Streamed {
    type Data = Bytes;
    type Error = std::io::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, std::io::Error>>> {
        let this = &mut *self;
        match this.rx.poll_recv(cx) {
            Poll::Ready(Some(Ok(event))) => {
                // The end is `[DONE]`: the client may close as soon as it has it.
                if event.as_ref() == DONE {
                    this.ended = true;
                }
                Poll::Ready(Some(Ok(Frame::data(event))))
            }
            Poll::Ready(Some(Err(e))) => Poll::Ready(Some(Err(e))),
            Poll::Ready(None) => {
                this.ended = true;
                Poll::Ready(None)
            }
            Poll::Pending => Poll::Pending,
        }
    }

    fn size_hint(&self) -> SizeHint {
        SizeHint::default()
    }
}

impl Drop for Streamed {
    fn drop(&mut self) {
        self.task.abort();
        if !self.ended
            && let Ok(mut a) = self.aborted.lock()
        {
            a.push(std::mem::take(&mut self.request_id));
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn only_token_id_prompts_are_this_sides() {
        assert!(is_token_prompt(&json!({"prompt": [1, 2]})));
        assert!(!is_token_prompt(&json!({"prompt": "hi"})));
        assert!(!is_token_prompt(&json!({"prompt": ["hi"]})));
        assert!(!is_token_prompt(&json!({"prompt": []})));
    }

    #[test]
    fn structured_outputs_are_refused_as_vllm_refuses_them() {
        let tag = |t: Value| json!({"structural_tag": t.to_string()});
        let good = json!({"type": "structural_tag", "format": {"type": "tags_with_separator",
            "tags": [{"type": "tag", "begin": "<a>", "content": {"type": "json_schema", "json_schema": true}, "end": "</a>"}],
            "separator": "", "at_least_one": true, "stop_after_first": false}});
        assert_eq!(structured_outputs_refusal(&tag(good)), None);
        assert_eq!(
            structured_outputs_refusal(&json!({"json": {"type": "object"}})),
            None
        );
        let odd = json!({"type": "structural_tag", "format": {"type": "or", "elements": [{"type": "nope"}]}});
        assert!(
            structured_outputs_refusal(&tag(odd))
                .unwrap()
                .contains("Invalid structured_outputs structural_tag")
        );
        assert!(
            structured_outputs_refusal(&json!({"structural_tag": "{"}))
                .unwrap()
                .contains("structural_tag")
        );
        assert!(
            structured_outputs_refusal(&json!({"json": {}, "regex": "a"}))
                .unwrap()
                .contains("one kind of constraints")
        );
        assert!(
            structured_outputs_refusal(&json!({"json": {}, "structural_tag": "{}"}))
                .unwrap()
                .contains("multiple")
        );
        assert!(
            structured_outputs_refusal(&json!({}))
                .unwrap()
                .contains("none are specified")
        );
    }

    #[test]
    fn no_max_tokens_is_sixteen_as_on_vllm() {
        assert_eq!(max_tokens(&CompletionRequest::default()), 16);
    }
}

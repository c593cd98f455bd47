//! The scripted upstream's SGLang-native side (with `--tokenizer`): `POST /generate` with
//! `input_ids` answers in SGLang's shape (`text`, `output_ids`, `meta_info` with
//! `finish_reason`, `prompt_tokens`, `completion_tokens`, `cached_tokens`,
//! `output_token_logprobs`, `weight_version`), whole or streamed as SGLang streams by
//! default (each `data:` event holds everything so far, then `data: [DONE]`). The reply is
//! the model's raw output for the script's answer in Qwen3's form (`<think>` reasoning,
//! content, Hermes `<tool_call>` blocks, `<|im_end|>`), tokenized with the real tokenizer;
//! each token's logprob is [`scripted_logprob`]. Rules are matched against the prompt decoded
//! back into ChatML turns (a `user` turn that holds `<tool_response>` counts as `tool`).
//!
//! Also served, for weight pushes: `/pause_generation` (new generations wait),
//! `/continue_generation`, `/flush_cache`, `/begin_weight_update` and `/end_weight_update`
//! (the session SGLang 0.5.23 requires), `/update_weights_from_tensor` (takes
//! `weight_version`, only inside that session; the tensors are not looked at),
//! `/update_weights_from_disk` (takes `weight_version`), `/model_info` (and the older
//! `/get_model_info`), `/server_info` (and `/get_server_info`: the `version` of
//! `--sglang-version`, cumulative streaming; `--legacy-info-routes` serves only the old
//! names), `/health`; `/abort_request` (takes `rid`). With `--expect-key` / `--admin-key`
//! the routes want the keys as SGLang's `--api-key` / `--admin-api-key` decide.
//!
//! It refuses what SGLang 0.5.23 refuses, in its words: a `sampling_params` key SGLang does
//! not read (400 `{"error": "unknown field ..."}`, its JSON contract's check), a tensor
//! update outside a weight-update session, a second `/begin_weight_update`, an
//! `/end_weight_update` without one (400 `{"success": false, "message"}`).
//!
//! For tests, `GET /testkit/requests` answers what this side was asked:
//! `{"generate": [{"rid", "sampling_params", "stream", "routing_key"}, ...], "aborted": [rid, ...],
//! "bodies": [{"path", "body"}, ...]}` (`routing_key`: the `X-SMG-Routing-Key` header SGLang's
//! router reads, else the body's; `bodies`: every POST to an SGLang route, whole, in order).
//!
//! Bodies and answers are `graft-wire`'s SGLang types, the ones the gateway and the trainer's
//! push read and write.

use serde::Deserialize as _;

use graft_wire::sglang::{
    self as wire, AbortRequest, ErrorResponse, FinishReason, GenerateRequest, GenerateResponse,
    Matched, MessageResponse, MetaInfo, ModelInfo, ServerInfo, TokenLogprob,
    UpdateWeightsFromDiskRequest, UpdateWeightsFromDiskResponse, UpdateWeightsFromTensorRequest,
    UpdateWeightsFromTensorResponse,
};
use http::{Response, StatusCode};
use serde::Serialize;
use serde_json::{Value, json};
use tokio::sync::watch;

use crate::answer::{Abort, RespBody, SseBody, json_response, sse_response};
use crate::faults::garbage;
use crate::openai::{DONE, Meta, chat_pieces, sse};
use crate::script::scripted_logprob;
use crate::script::{Prompt, Reply};
use crate::state::State;

/// Tokens per streamed event.
const TOKENS_PER_EVENT: usize = 2;

/// The path of the test log of what the SGLang side was asked.
pub(crate) const REQUESTS: &str = "/testkit/requests";

/// How long a generation held for a weight update waits before it goes on with the old
/// weights.
const WEIGHT_UPDATE_WAIT: std::time::Duration = std::time::Duration::from_secs(60);

/// Waits until the weights are no longer `from` (or [`WEIGHT_UPDATE_WAIT`] passed); the
/// version then.
pub(crate) async fn next_version(mut rx: watch::Receiver<String>, from: String) -> String {
    let _ = tokio::time::timeout(WEIGHT_UPDATE_WAIT, rx.wait_for(|v| *v != from)).await;
    rx.borrow().clone()
}

/// Everything one generation's answers are made of, owned (a held stream builds its last
/// events later).
#[derive(Clone)]
struct Generation {
    rid: String,
    prompt_tokens: u64,
    output: Vec<u32>,
    /// The visible text of `output[..n]`, per `n`.
    texts: Vec<String>,
    finish: FinishReason,
    /// `top_logprobs_num`: how many most likely tokens each position reports.
    top: u32,
}

impl Generation {
    /// The answer after `n` output tokens; `versions`: (version, first token) of each
    /// weight version so far, in order; spans are reported when asked for (a held
    /// generation reports them from its first event).
    fn event(&self, n: usize, last: bool, versions: &[(String, usize)], spans: bool) -> Value {
        let ids = &self.output[..n];
        let current = versions
            .iter()
            .rev()
            .find(|(_, at)| *at <= n)
            .map(|(v, _)| v.clone());
        let weight_versions = spans.then(|| {
            versions
                .iter()
                .enumerate()
                .filter(|(_, (_, at))| *at < n || (*at == 0 && n == 0))
                .map(|(i, (v, at))| wire::WeightVersionSpan {
                    version: v.clone(),
                    start: *at as u64,
                    end: versions.get(i + 1).map_or(n, |(_, e)| (*e).min(n)) as u64,
                })
                .collect()
        });
        let answer = GenerateResponse {
            text: self.texts.get(n).cloned().unwrap_or_default(),
            output_ids: ids.to_vec(),
            meta_info: MetaInfo {
                // The sampled token first, then the next ids, each less likely.
                output_top_logprobs: (self.top > 0).then(|| {
                    ids.iter()
                        .map(|&id| {
                            Some(
                                (0..self.top)
                                    .map(|k| {
                                        let alt = id.wrapping_add(k);
                                        let l = scripted_logprob(id) - k as f64;
                                        TokenLogprob(Some(l), alt, None)
                                    })
                                    .collect(),
                            )
                        })
                        .collect()
                }),
                id: Some(self.rid.clone()),
                finish_reason: last.then(|| self.finish.clone()),
                prompt_tokens: Some(self.prompt_tokens),
                completion_tokens: Some(n as u64),
                cached_tokens: Some(0),
                output_token_logprobs: Some(
                    ids.iter()
                        .map(|&id| TokenLogprob(Some(scripted_logprob(id)), id, None))
                        .collect(),
                ),
                weight_version: current,
                weight_versions,
                e2e_latency: Some(0.0),
            },
        };
        serde_json::to_value(&answer).unwrap_or(Value::Null)
    }

    /// The streamed events for output lengths `from+1..=to` (every
    /// [`TOKENS_PER_EVENT`] tokens), the last one finishing when `to` is the end.
    fn events(
        &self,
        from: usize,
        to: usize,
        versions: &[(String, usize)],
        spans: bool,
    ) -> Vec<bytes::Bytes> {
        let mut out = vec![];
        let mut n = from;
        while n < to {
            n = (n + TOKENS_PER_EVENT).min(to);
            out.push(sse(&self.event(n, n == self.output.len(), versions, spans)));
        }
        out
    }
}

/// An answer of one of the wire's types.
fn typed(status: StatusCode, v: &impl Serialize) -> Response<RespBody> {
    json_response(status, &serde_json::to_value(v).unwrap_or(Value::Null))
}

/// SGLang's error shape.
fn error(status: StatusCode, message: &str) -> Response<RespBody> {
    typed(
        status,
        &ErrorResponse::new(status.as_u16(), "BadRequestError", message),
    )
}

/// SGLang's `{success, message}` answer: 200, or 400 when refused.
fn outcome(success: bool, message: &str) -> Response<RespBody> {
    typed(
        if success {
            StatusCode::OK
        } else {
            StatusCode::BAD_REQUEST
        },
        &UpdateWeightsFromTensorResponse {
            success,
            message: message.to_owned(),
        },
    )
}

fn message(text: &str) -> Response<RespBody> {
    typed(
        StatusCode::OK,
        &MessageResponse {
            message: text.to_owned(),
            status: None,
        },
    )
}

/// Whether `path` is one of the SGLang-native routes.
pub(crate) fn is_route(path: &str) -> bool {
    [
        wire::path::HEALTH,
        wire::path::GET_MODEL_INFO,
        wire::path::MODEL_INFO,
        wire::path::SERVER_INFO,
        wire::path::GET_SERVER_INFO,
        wire::path::PAUSE_GENERATION,
        wire::path::CONTINUE_GENERATION,
        wire::path::FLUSH_CACHE,
        wire::path::UPDATE_WEIGHTS_FROM_DISK,
        wire::path::UPDATE_WEIGHTS_FROM_TENSOR,
        wire::path::BEGIN_WEIGHT_UPDATE,
        wire::path::END_WEIGHT_UPDATE,
        wire::path::GENERATE,
        wire::path::ABORT_REQUEST,
        REQUESTS,
    ]
    .contains(&path)
}

/// The SGLang routes; `None` when the method is not the route's.
pub(crate) async fn route(
    state: &State,
    method: &http::Method,
    path: &str,
    body: &Value,
    routing_key: Option<String>,
) -> Result<Option<Response<RespBody>>, Abort> {
    let b = &state.sglang;
    if *method == http::Method::POST
        && let Ok(mut bodies) = b.bodies.lock()
    {
        bodies.push(json!({"path": path, "body": body}));
    }
    let resp = match (method.as_str(), path) {
        ("GET", wire::path::HEALTH) => json_response(StatusCode::OK, &json!({})),
        ("GET", wire::path::SERVER_INFO | wire::path::GET_SERVER_INFO) => typed(
            StatusCode::OK,
            &ServerInfo {
                version: Some(state.sglang_version.clone()),
                // It streams as SGLang does by default: every event holds everything so far.
                incremental_streaming_output: Some(false),
                load_format: Some("auto".into()),
                model_path: Some("scripted".into()),
                graft: None,
            },
        ),
        ("GET", wire::path::GET_MODEL_INFO | wire::path::MODEL_INFO) => typed(
            StatusCode::OK,
            &ModelInfo {
                model_path: "scripted".into(),
                tokenizer_path: Some("scripted".into()),
                is_generation: true,
                weight_version: Some(b.weight_version()),
                ..ModelInfo::default()
            },
        ),
        ("POST", wire::path::PAUSE_GENERATION) => {
            b.paused.send_replace(true);
            message("Generation paused")
        }
        ("POST", wire::path::CONTINUE_GENERATION) => {
            b.paused.send_replace(false);
            message("Generation continued")
        }
        ("POST", wire::path::FLUSH_CACHE) => message("Cache flushed"),
        ("POST", wire::path::UPDATE_WEIGHTS_FROM_DISK) => {
            let Ok(req) = UpdateWeightsFromDiskRequest::deserialize(body) else {
                return Ok(Some(error(
                    StatusCode::BAD_REQUEST,
                    "'model_path' is required",
                )));
            };
            if let Some(v) = &req.weight_version {
                b.weight_version.send_replace(v.clone());
            }
            typed(
                StatusCode::OK,
                &UpdateWeightsFromDiskResponse {
                    success: true,
                    message: format!("Succeeded to update model weights from {}.", req.model_path),
                    num_paused_requests: 0,
                },
            )
        }
        ("POST", wire::path::BEGIN_WEIGHT_UPDATE) => {
            let mut open = b
                .weight_session
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            if *open {
                outcome(false, wire::weight_session::ALREADY_OPEN)
            } else {
                *open = true;
                outcome(true, "Success")
            }
        }
        ("POST", wire::path::END_WEIGHT_UPDATE) => {
            let mut open = b
                .weight_session
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            if *open {
                *open = false;
                outcome(true, "Success")
            } else {
                outcome(false, wire::weight_session::NOT_OPEN)
            }
        }
        ("POST", wire::path::UPDATE_WEIGHTS_FROM_TENSOR) => {
            if !*b
                .weight_session
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
            {
                return Ok(Some(outcome(false, wire::weight_session::TENSOR_OUTSIDE)));
            }
            let Ok(req) = UpdateWeightsFromTensorRequest::deserialize(body) else {
                return Ok(Some(error(
                    StatusCode::BAD_REQUEST,
                    "'serialized_named_tensors' must be a list of strings",
                )));
            };
            if req.serialized_named_tensors.is_empty() {
                return Ok(Some(typed(
                    StatusCode::BAD_REQUEST,
                    &UpdateWeightsFromTensorResponse {
                        success: false,
                        message: "serialized_named_tensors is empty".into(),
                    },
                )));
            }
            if let Some(v) = &req.weight_version {
                b.weight_version.send_replace(v.clone());
            }
            typed(
                StatusCode::OK,
                &UpdateWeightsFromTensorResponse {
                    success: true,
                    message: "Succeeded to update model weights.".into(),
                },
            )
        }
        ("POST", wire::path::GENERATE) => generate(state, body, routing_key).await?,
        ("POST", wire::path::ABORT_REQUEST) => {
            let Ok(req) = AbortRequest::deserialize(body) else {
                return Ok(Some(error(
                    StatusCode::BAD_REQUEST,
                    "'rid' must be a string",
                )));
            };
            if let (Some(rid), Ok(mut a)) = (req.rid, b.aborted.lock()) {
                a.push(rid);
            }
            json_response(StatusCode::OK, &json!({}))
        }
        ("GET", REQUESTS) => {
            let seen = b.seen.lock().map(|v| v.clone()).unwrap_or_default();
            let aborted = b.aborted.lock().map(|v| v.clone()).unwrap_or_default();
            let bodies = b.bodies.lock().map(|v| v.clone()).unwrap_or_default();
            let prompts = b.prompts.lock().map(|v| v.clone()).unwrap_or_default();
            json_response(
                StatusCode::OK,
                &json!({"generate": seen, "aborted": aborted, "bodies": bodies, "prompts": prompts}),
            )
        }
        _ => return Ok(None),
    };
    Ok(Some(resp))
}

/// Llama 3's end of turn; a model whose template ends turns with it answers in Llama 3's
/// form ([`raw_output`]).
const LLAMA3_EOT: &str = "<|eot_id|>";

/// The turns of a prompt: ChatML blocks (Qwen), or Llama 3's
/// `<|start_header_id|>ROLE<|end_header_id|>\n\n…<|eot_id|>` blocks (`ipython` is a tool
/// turn). Whether the prompt offered tools: Qwen's `<tools>`, Llama 3's `Environment: ipython`.
fn turns_of(text: &str) -> (Vec<(String, String)>, bool, bool) {
    let mut turns: Vec<(String, String)> = vec![];
    if text.contains("<|start_header_id|>") {
        for block in text.split("<|start_header_id|>").skip(1) {
            let block = block.split(LLAMA3_EOT).next().unwrap_or_default();
            let (role, body) = block.split_once("<|end_header_id|>").unwrap_or((block, ""));
            let role = if role == "ipython" { "tool" } else { role };
            let body = body.strip_prefix("\n\n").unwrap_or(body);
            turns.push((role.to_string(), body.to_string()));
        }
        return (turns, true, text.contains("Environment: ipython"));
    }
    for block in text.split("<|im_start|>").skip(1) {
        let block = block.split("<|im_end|>").next().unwrap_or_default();
        let (role, body) = block.split_once('\n').unwrap_or((block, ""));
        let role = if role == "user" && body.trim_start().starts_with("<tool_response>") {
            "tool"
        } else {
            role
        };
        turns.push((role.to_string(), body.to_string()));
    }
    (
        turns,
        text.contains("<|im_start|>"),
        text.contains("<tools>"),
    )
}

/// The prompt decoded into turns (ChatML, or Llama 3's), as the script sees it.
pub(crate) fn prompt_of(text: &str) -> Prompt {
    let (mut turns, templated, has_tools) = turns_of(text);
    // The last turn is the generation prompt (`assistant`, maybe an empty think block).
    if turns.last().is_some_and(|(r, _)| r == "assistant") {
        turns.pop();
    }
    // A raw prompt (Completions: no chat template) is the user's text as it is.
    if turns.is_empty() && !templated {
        turns.push(("user".to_string(), text.to_string()));
    }
    // System turns after the last turn (Claude Code sends one) are skipped, as on the
    // OpenAI wire.
    let last = turns
        .iter()
        .rev()
        .find(|(r, _)| r != "system")
        .or(turns.last())
        .cloned()
        .unwrap_or_default();
    let last_user = turns
        .iter()
        .rev()
        .find(|(r, _)| r == "user")
        .map(|(_, t)| t.clone())
        .unwrap_or_default();
    Prompt {
        model: "scripted".into(),
        last_text: last.1,
        last_role: Some(last.0),
        last_user_text: last_user,
        message_count: turns.iter().filter(|(r, _)| r != "system").count(),
        has_tools,
        prompt_text: text.to_string(),
        ..Prompt::default()
    }
}

/// The model's raw output for a reply: reasoning in `<think>`, then what the chat stream's
/// pieces stand for (content, Hermes tool calls, the end-of-turn token). `thinks`: the
/// prompt leaves thinking on ([`TokenModel::thinks_after`]), so the model opens its own think
/// block, as Qwen3 does in thinking mode, empty when the script gives no reasoning. A Llama 3 model
/// (`eos` `<|eot_id|>`) writes no reasoning, and its calls as Llama 3.2 does: bare
/// `{"name": …, "parameters": …}` objects joined by `; ` when they are the whole answer,
/// after `<|python_tag|>` when content comes first.
pub(crate) fn raw_output(reply: &Reply, eos: &str, thinks: bool) -> String {
    if let Some(raw) = &reply.raw {
        return format!("{raw}{eos}");
    }
    if eos == LLAMA3_EOT {
        let mut out = reply.content.clone().unwrap_or_default();
        let calls: Vec<String> = reply
            .tool_calls
            .iter()
            .map(|c| {
                let args = c.arguments_string();
                let args = if args.trim().is_empty() {
                    "{}".to_owned()
                } else {
                    args
                };
                format!("{{\"name\": \"{}\", \"parameters\": {args}}}", c.name)
            })
            .collect();
        if !calls.is_empty() {
            if !out.is_empty() {
                out.push_str("<|python_tag|>");
            }
            out.push_str(&calls.join("; "));
        }
        return out + eos;
    }
    let meta = Meta {
        id: 0,
        created: 0,
        model: String::new(),
    };
    let mut out = String::new();
    match &reply.reasoning {
        Some(r) => out.push_str(&format!("<think>\n{r}\n</think>\n\n")),
        None if thinks => out.push_str("<think>\n\n</think>\n\n"),
        None => {}
    }
    for p in chat_pieces(&meta, reply, eos) {
        out.push_str(&p.text);
    }
    out
}

async fn generate(
    state: &State,
    body: &Value,
    routing_key: Option<String>,
) -> Result<Response<RespBody>, Abort> {
    // SGLang checks the body against its JSON contract before anything else.
    if let Some(e) = wire::sampling_params_contract_error(body) {
        return Ok(typed(
            StatusCode::BAD_REQUEST,
            &wire::ContractError { error: e },
        ));
    }
    let Some(model) = &state.model else {
        return Ok(error(
            StatusCode::BAD_REQUEST,
            "/generate needs the scripted upstream started with --tokenizer DIR",
        ));
    };
    // A body that does not fit the wire is read as one without a prompt (the error below
    // names what is needed).
    let req = GenerateRequest::deserialize(body).unwrap_or_default();
    if let Ok(mut seen) = state.sglang.seen.lock() {
        seen.push(json!({
            "rid": req.rid,
            "sampling_params": body.get("sampling_params"),
            "stream": req.is_stream(),
            // SGLang's router reads the header; the body field is the scheduler's.
            "routing_key": routing_key.or_else(|| req.routing_key.clone()),
        }));
    }
    let input_ids = match (req.input_ids.clone(), &req.text) {
        (Some(ids), _) => ids,
        (None, Some(text)) => match model.tokenizer.encode(text) {
            Ok(ids) => ids,
            Err(e) => {
                return Ok(error(
                    StatusCode::BAD_REQUEST,
                    &format!("cannot tokenize 'text': {e}"),
                ));
            }
        },
        (None, None) => {
            return Ok(error(
                StatusCode::BAD_REQUEST,
                "either 'input_ids' (a list of token ids) or 'text' is required",
            ));
        }
    };
    if input_ids.is_empty() {
        return Ok(error(StatusCode::BAD_REQUEST, "'input_ids' is empty"));
    }
    // Paused: wait for /continue_generation, as SGLang holds new requests.
    let mut paused = state.sglang.paused.subscribe();
    let _ = paused.wait_for(|p| !*p).await;

    let prompt_text = match model.tokenizer.decode(&input_ids) {
        Ok(t) => t,
        Err(e) => {
            return Ok(error(
                StatusCode::BAD_REQUEST,
                &format!("cannot decode 'input_ids': {e}"),
            ));
        }
    };
    if let Ok(mut p) = state.sglang.prompts.lock() {
        p.push(json!({"rid": req.rid, "text": prompt_text}));
    }
    let prompt = prompt_of(&prompt_text);
    let stream = req.is_stream();
    let fault = state.script.rule_for(&prompt).and_then(|r| r.fault.clone());
    match fault.as_deref() {
        Some("500") => {
            return Ok(json_response(
                StatusCode::INTERNAL_SERVER_ERROR,
                &json!({"object": "error", "message": "scripted fault 500: the scheduler crashed", "type": "InternalServerError", "param": null, "code": 500}),
            ));
        }
        Some("garbage") => return Ok(garbage(stream)),
        Some("hang") => {
            tokio::time::sleep(std::time::Duration::from_secs(3600)).await;
        }
        Some("reset") if !stream => return Err(Abort),
        _ => {}
    }
    if let Some(status) = state
        .script
        .rule_for(&prompt)
        .and_then(|r| r.first_failure())
    {
        return Ok(json_response(
            status,
            &json!({"object": "error", "message": "scripted first_status: the first attempt fails", "type": "InternalServerError", "param": null, "code": status.as_u16()}),
        ));
    }
    if let Some(d) = state.script.rule_for(&prompt).and_then(|r| r.first_delay()) {
        tokio::time::sleep(d).await;
    }
    let reply = state.script.reply_or_echo(&prompt);
    let reply = reply.as_ref();
    let text = raw_output(reply, &model.eos, model.thinks_after(&prompt_text));
    let mut output = match model.tokenizer.encode(&text) {
        Ok(ids) => ids,
        Err(e) => {
            return Ok(error(
                StatusCode::INTERNAL_SERVER_ERROR,
                &format!("cannot tokenize the reply: {e}"),
            ));
        }
    };
    let max_new = req
        .sampling_params
        .as_ref()
        .and_then(|p| p.max_new_tokens)
        .unwrap_or(128) as usize;
    let eos_id = model.tokenizer.token_id(&model.eos);
    // Stop strings end the output at the token that completes the first one met in the
    // decoded text, as SGLang checks them (`Req.check_finished`); the token stays (graft
    // sends `no_stop_trim`) and `matched` names the string.
    let stops: Vec<String> = match req.sampling_params.as_ref().and_then(|p| p.stop.clone()) {
        Some(wire::Stop::One(s)) => vec![s],
        Some(wire::Stop::Many(v)) => v,
        None => vec![],
    };
    let stopped = (!stops.is_empty())
        .then(|| {
            (1..=output.len()).find_map(|n| {
                let text = model.tokenizer.decode_visible(&output[..n]).ok()?;
                stops
                    .iter()
                    .find(|s| !s.is_empty() && text.contains(s.as_str()))
                    .map(|s| (n, s.clone()))
            })
        })
        .flatten();
    let finish = if fault.as_deref() == Some("abort") {
        FinishReason::abort("scripted abort: the request was aborted by the server")
    } else if let Some((n, s)) = stopped.filter(|(n, _)| *n <= max_new) {
        output.truncate(n);
        FinishReason::stop(Some(Matched::Text(s)))
    } else if output.len() > max_new {
        output.truncate(max_new);
        FinishReason::length(max_new as u64)
    } else {
        FinishReason::stop(eos_id.map(|id| Matched::Token(i64::from(id))))
    };
    let texts = (0..=output.len())
        .map(|n| {
            model
                .tokenizer
                .decode_visible(&output[..n])
                .unwrap_or_default()
        })
        .collect();
    let generation = Generation {
        rid: req
            .rid
            .clone()
            .unwrap_or_else(|| format!("{:032x}", state.next_id())),
        prompt_tokens: input_ids.len() as u64,
        output,
        texts,
        finish,
        top: req.top_logprobs_num.unwrap_or(0),
    };
    let len = generation.output.len();
    let first = state.sglang.weight_version();
    let rx = state.sglang.weight_version.subscribe();
    // Held for a weight update after `hold` tokens (script rule `weight_update_after`).
    let hold = state
        .script
        .rule_for(&prompt)
        .and_then(|r| r.weight_update_after)
        .filter(|&h| h < len);
    if !stream {
        // SGLang sends a whole answer once it is generated: as late as its stream's end.
        tokio::time::sleep(state.chunk_delay.saturating_mul(len as u32)).await;
        let mut versions = vec![(first.clone(), 0)];
        if let Some(h) = hold {
            versions.push((next_version(rx, first).await, h));
        }
        return Ok(json_response(
            StatusCode::OK,
            &generation.event(len, true, &versions, hold.is_some()),
        ));
    }
    let abort_after = (fault.as_deref() == Some("reset")).then_some(2);
    let Some(h) = hold else {
        let versions = vec![(first, 0)];
        let mut events = generation.events(0, len, &versions, false);
        if len == 0 {
            events.push(sse(&generation.event(0, true, &versions, false)));
        }
        events.push(bytes::Bytes::from_static(DONE));
        return Ok(sse_response(SseBody::new(
            events,
            state.chunk_delay,
            abort_after,
        )));
    };
    let before = vec![(first.clone(), 0)];
    let events = generation.events(0, h, &before, true);
    let later = Box::pin(async move {
        let mut versions = before;
        versions.push((next_version(rx, first).await, h));
        let mut events = generation.events(h, len, &versions, true);
        events.push(bytes::Bytes::from_static(DONE));
        events
    });
    Ok(sse_response(
        SseBody::new(events, state.chunk_delay, abort_after).then(later),
    ))
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn prompt_turns_are_read_back_from_chatml() {
        let p = prompt_of(
            "<|im_start|>system\nS<tools>x</tools><|im_end|>\n<|im_start|>user\ngraft-task<|im_end|>\n<|im_start|>assistant\nok<|im_end|>\n<|im_start|>user\n<tool_response>\ndone\n</tool_response><|im_end|>\n<|im_start|>assistant\n",
        );
        assert_eq!(p.last_role.as_deref(), Some("tool"));
        assert!(p.last_text.contains("done"));
        assert_eq!(p.last_user_text, "graft-task");
        assert!(p.has_tools);
        assert_eq!(p.message_count, 3);
    }

    #[test]
    fn a_system_turn_after_the_last_turn_is_skipped() {
        let p = prompt_of(
            "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\ngraft-task<|im_end|>\n<|im_start|>system\nagent types<|im_end|>\n<|im_start|>assistant\n",
        );
        assert_eq!(p.last_role.as_deref(), Some("user"));
        assert_eq!(p.last_text, "graft-task");
    }

    #[test]
    fn a_raw_prompt_is_the_users_text() {
        let p = prompt_of("graft-completion: Once upon a time");
        assert_eq!(p.last_user_text, "graft-completion: Once upon a time");
        assert_eq!(p.last_role.as_deref(), Some("user"));
        assert_eq!(p.message_count, 1);
    }

    #[test]
    fn raw_output_has_reasoning_content_and_tool_call() {
        let reply = Reply {
            content: Some("Checking.".into()),
            reasoning: Some("I should look.".into()),
            tool_calls: vec![crate::script::ScriptToolCall {
                name: "bash".into(),
                arguments: json!({"command": "ls"}),
            }],
            finish_reason: None,
            raw: None,
        };
        let out = raw_output(&reply, "<|im_end|>", false);
        assert_eq!(
            out,
            "<think>\nI should look.\n</think>\n\nChecking.\n<tool_call>\n{\"name\": \"bash\", \"arguments\": {\"command\":\"ls\"}}\n</tool_call><|im_end|>"
        );
    }
}

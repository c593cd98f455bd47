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
//! `/continue_generation`, `/flush_cache`, `/update_weights_from_disk` (takes
//! `weight_version`), `/get_model_info`, `/health`.
//!
//! Bodies and answers are `graft-wire`'s SGLang types, the ones the gateway and the trainer's
//! push read and write.

use std::sync::Mutex;

use serde::Deserialize as _;

use graft_wire::sglang::{
    self as wire, ErrorResponse, FinishReason, GenerateRequest, GenerateResponse, Matched,
    MessageResponse, MetaInfo, ModelInfo, TokenLogprob, UpdateWeightsFromDiskRequest,
    UpdateWeightsFromDiskResponse,
};
use http::{Response, StatusCode};
use serde::Serialize;
use serde_json::{Value, json};
use tokio::sync::watch;

use crate::faults::garbage;
use crate::openai::{DONE, Meta, chat_pieces, sse};
use crate::script::{Prompt, Reply};
use crate::server::{Abort, RespBody, SseBody, State, json_response, sse_response};
use crate::tokens::scripted_logprob;

/// Tokens per streamed event.
const TOKENS_PER_EVENT: usize = 2;

/// What the SGLang side keeps between requests.
pub(crate) struct Backend {
    weight_version: Mutex<String>,
    paused: watch::Sender<bool>,
}

impl Default for Backend {
    fn default() -> Self {
        Backend {
            weight_version: Mutex::new("default".to_string()),
            paused: watch::Sender::new(false),
        }
    }
}

impl Backend {
    fn weight_version(&self) -> String {
        self.weight_version
            .lock()
            .map(|v| v.clone())
            .unwrap_or_default()
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
        wire::path::PAUSE_GENERATION,
        wire::path::CONTINUE_GENERATION,
        wire::path::FLUSH_CACHE,
        wire::path::UPDATE_WEIGHTS_FROM_DISK,
        wire::path::GENERATE,
    ]
    .contains(&path)
}

/// The SGLang routes; `None` when the method is not the route's.
pub(crate) async fn route(
    state: &State,
    method: &http::Method,
    path: &str,
    body: &Value,
) -> Result<Option<Response<RespBody>>, Abort> {
    let b = &state.sglang;
    let resp = match (method.as_str(), path) {
        ("GET", wire::path::HEALTH) => json_response(StatusCode::OK, &json!({})),
        ("GET", wire::path::GET_MODEL_INFO) => typed(
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
            if let Some(v) = &req.weight_version
                && let Ok(mut w) = b.weight_version.lock()
            {
                *w = v.clone();
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
        ("POST", wire::path::GENERATE) => generate(state, body).await?,
        _ => return Ok(None),
    };
    Ok(Some(resp))
}

/// The prompt decoded into ChatML turns, as the script sees it.
fn prompt_of(text: &str) -> Prompt {
    let mut turns: Vec<(String, String)> = vec![];
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
    // The last turn is the generation prompt (`assistant`, maybe an empty think block).
    if turns.last().is_some_and(|(r, _)| r == "assistant") {
        turns.pop();
    }
    // A raw prompt (Completions: no chat template) is the user's text as it is.
    if turns.is_empty() && !text.contains("<|im_start|>") {
        turns.push(("user".to_string(), text.to_string()));
    }
    let last = turns.last().cloned().unwrap_or_default();
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
        has_tools: text.contains("<tools>"),
        ..Prompt::default()
    }
}

/// The model's raw output for a reply: reasoning in `<think>`, then what the chat stream's
/// pieces stand for (content, Hermes tool calls, the end-of-turn token).
fn raw_output(reply: &Reply, eos: &str) -> String {
    let meta = Meta {
        id: 0,
        created: 0,
        model: String::new(),
    };
    let mut out = String::new();
    if let Some(r) = &reply.reasoning {
        out.push_str(&format!("<think>\n{r}\n</think>\n\n"));
    }
    for p in chat_pieces(&meta, reply, eos) {
        out.push_str(&p.text);
    }
    out
}

async fn generate(state: &State, body: &Value) -> Result<Response<RespBody>, Abort> {
    let Some(model) = &state.model else {
        return Ok(error(
            StatusCode::BAD_REQUEST,
            "/generate needs the scripted upstream started with --tokenizer DIR",
        ));
    };
    // A body that does not fit the wire is read as one without a prompt (the error below
    // names what is needed).
    let req = GenerateRequest::deserialize(body).unwrap_or_default();
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
    let reply = state.script.reply_or_echo(&prompt);
    let reply = reply.as_ref();
    let text = raw_output(reply, &model.eos);
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
    let finish = if fault.as_deref() == Some("abort") {
        FinishReason::abort("scripted abort: the request was aborted by the server")
    } else if output.len() > max_new {
        output.truncate(max_new);
        FinishReason::length(max_new as u64)
    } else {
        FinishReason::stop(eos_id.map(|id| Matched::Token(i64::from(id))))
    };
    let rid = format!("{:032x}", state.next_id());
    let weight_version = state.sglang.weight_version();
    let event = |n: usize, last: bool| -> Value {
        let ids = &output[..n];
        let answer = GenerateResponse {
            text: model.tokenizer.decode_visible(ids).unwrap_or_default(),
            output_ids: ids.to_vec(),
            meta_info: MetaInfo {
                id: Some(rid.clone()),
                finish_reason: last.then(|| finish.clone()),
                prompt_tokens: Some(input_ids.len() as u64),
                completion_tokens: Some(n as u64),
                cached_tokens: Some(0),
                output_token_logprobs: Some(
                    ids.iter()
                        .map(|&id| TokenLogprob(Some(scripted_logprob(id)), id, None))
                        .collect(),
                ),
                weight_version: Some(weight_version.clone()),
                e2e_latency: Some(0.0),
                ..MetaInfo::default()
            },
        };
        serde_json::to_value(&answer).unwrap_or(Value::Null)
    };
    if !stream {
        return Ok(json_response(StatusCode::OK, &event(output.len(), true)));
    }
    let mut events = vec![];
    let mut n = 0;
    while n < output.len() {
        n = (n + TOKENS_PER_EVENT).min(output.len());
        events.push(sse(&event(n, n == output.len())));
    }
    if output.is_empty() {
        events.push(sse(&event(0, true)));
    }
    events.push(bytes::Bytes::from_static(DONE));
    let abort_after = (fault.as_deref() == Some("reset")).then_some(2);
    Ok(sse_response(SseBody::new(
        events,
        state.chunk_delay,
        abort_after,
    )))
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
        };
        let out = raw_output(&reply, "<|im_end|>");
        assert_eq!(
            out,
            "<think>\nI should look.\n</think>\n\nChecking.\n<tool_call>\n{\"name\": \"bash\", \"arguments\": {\"command\":\"ls\"}}\n</tool_call><|im_end|>"
        );
    }
}

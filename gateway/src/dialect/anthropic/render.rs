//! Whole Anthropic `message` objects and Anthropic error bodies.

use serde_json::{Map, Value, json};

use crate::dialect::{Answer, Conversation, Finish, TokenUsage, ToolCall};
use crate::error::GatewayError;

/// The tool_use id sent to the client: the model's call id when it is a valid Anthropic id
/// (`[A-Za-z0-9_-]+`), a sanitized `toolu_` form of it otherwise, and a deterministic
/// `toolu_<message>_<n>` when the model gave none (so a whole answer and its stream agree).
pub(super) fn tool_use_id(raw: &str, message_id: &str, index: usize) -> String {
    let valid = |c: char| c.is_ascii_alphanumeric() || c == '_' || c == '-';
    if !raw.is_empty() && raw.chars().all(valid) {
        return raw.to_string();
    }
    if !raw.is_empty() {
        let clean: String = raw
            .chars()
            .map(|c| if valid(c) { c } else { '_' })
            .collect();
        return format!("toolu_{clean}");
    }
    let base: String = message_id
        .strip_prefix("msg_")
        .unwrap_or(message_id)
        .chars()
        .filter(|c| valid(*c))
        .collect();
    format!("toolu_{base}_{index}")
}

/// A tool call's arguments as the `input` object Anthropic clients expect. Empty, invalid or
/// non-object arguments become `{}` (the raw text stays in the recorded answer).
fn tool_input(arguments: &str) -> Value {
    match serde_json::from_str::<Value>(arguments) {
        Ok(v @ Value::Object(_)) => v,
        _ => Value::Object(Map::new()),
    }
}

pub(super) fn stop_reason(finish: Finish, has_tool_calls: bool) -> &'static str {
    match finish {
        Finish::Length => "max_tokens",
        Finish::ContentFilter => "refusal",
        Finish::Stop | Finish::ToolCalls if has_tool_calls => "tool_use",
        Finish::Stop | Finish::ToolCalls | Finish::Error => "end_turn",
    }
}

/// Anthropic usage. `TokenUsage::input_tokens` counts the whole prompt (OpenAI's convention,
/// cached tokens included); Anthropic's `input_tokens` excludes cache reads.
pub(super) fn usage_json(usage: Option<&TokenUsage>) -> Value {
    let u = usage.copied().unwrap_or_default();
    let mut out = Map::new();
    out.insert(
        "input_tokens".into(),
        json!(u.input_tokens.saturating_sub(u.cached_tokens)),
    );
    out.insert("output_tokens".into(), json!(u.output_tokens));
    if u.cached_tokens > 0 {
        out.insert("cache_read_input_tokens".into(), json!(u.cached_tokens));
    }
    Value::Object(out)
}

pub(super) fn model_name<'a>(conv: &'a Conversation, answer: Option<&'a Answer>) -> &'a str {
    match answer {
        Some(a) if conv.model.is_empty() => &a.model,
        _ => &conv.model,
    }
}

pub(super) fn tool_use_block(call: &ToolCall, message_id: &str, index: usize) -> Value {
    json!({
        "type": "tool_use",
        "id": tool_use_id(&call.id, message_id, index),
        "name": call.name,
        "input": tool_input(&call.arguments),
    })
}

/// A whole (non-streamed) answer as an Anthropic `message` object.
pub fn render_answer(conv: &Conversation, answer: &Answer, message_id: &str) -> Value {
    let mut content = Vec::new();
    if let Some(r) = answer.reasoning.as_deref().filter(|r| !r.is_empty()) {
        content.push(json!({"type": "thinking", "thinking": r, "signature": ""}));
    }
    if !answer.text.is_empty() {
        content.push(json!({"type": "text", "text": answer.text}));
    }
    for (i, call) in answer.tool_calls.iter().enumerate() {
        content.push(tool_use_block(call, message_id, i));
    }
    json!({
        "id": message_id,
        "type": "message",
        "role": "assistant",
        "model": model_name(conv, Some(answer)),
        "content": content,
        "stop_reason": stop_reason(answer.finish, !answer.tool_calls.is_empty()),
        "stop_sequence": null,
        "usage": usage_json(answer.usage.as_ref()),
    })
}

/// Anthropic's `error.type` for an HTTP status (docs.claude.com/en/api/errors).
pub(super) fn error_type(err: &GatewayError) -> &'static str {
    match err.status().as_u16() {
        401 => "authentication_error",
        403 => "permission_error",
        404 => "not_found_error",
        413 => "request_too_large",
        429 => "rate_limit_error",
        503 | 529 => "overloaded_error",
        s if s >= 500 => "api_error",
        _ => match err.error_type() {
            "rate_limit_error" => "rate_limit_error",
            "not_found_error" => "not_found_error",
            _ => "invalid_request_error",
        },
    }
}

/// The Anthropic error body: `{"type":"error","error":{"type":…,"message":…}}`.
pub fn error_body(err: &GatewayError) -> Value {
    json!({
        "type": "error",
        "error": {"type": error_type(err), "message": err.to_string()},
    })
}

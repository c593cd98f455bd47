//! Whole answers in Chat Completions form: `chat.completion` → [`Answer`] (an upstream's
//! answer) and [`Answer`] → `chat.completion` (exact mode answers Chat clients itself).

use serde_json::{Map, Value, json};

use crate::dialect::{Answer, AnswerShape, Finish, TokenUsage, ToolCall};

fn finish_of(s: Option<&str>) -> Finish {
    match s {
        Some("length") => Finish::Length,
        Some("tool_calls") | Some("function_call") => Finish::ToolCalls,
        Some("content_filter") => Finish::ContentFilter,
        _ => Finish::Stop,
    }
}

/// A `chat.completion` object → answer.
pub fn parse_answer(v: &Value) -> Result<Answer, String> {
    let choice = v
        .pointer("/choices/0")
        .ok_or("the response has no choices[0]")?;
    let msg = choice.get("message").ok_or("choices[0] has no message")?;
    let text = match msg.get("content") {
        Some(Value::String(s)) => s.clone(),
        Some(Value::Array(parts)) => parts
            .iter()
            .filter_map(|p| p.get("text").and_then(Value::as_str))
            .collect(),
        _ => String::new(),
    };
    let tool_calls: Vec<ToolCall> = msg
        .get("tool_calls")
        .and_then(Value::as_array)
        .map(|a| {
            a.iter()
                .map(|t| ToolCall {
                    id: t
                        .get("id")
                        .and_then(Value::as_str)
                        .map(str::to_string)
                        .unwrap_or_else(|| crate::dialect::new_id("call_")),
                    name: t
                        .pointer("/function/name")
                        .and_then(Value::as_str)
                        .unwrap_or_default()
                        .to_string(),
                    arguments: t
                        .pointer("/function/arguments")
                        .and_then(Value::as_str)
                        .unwrap_or_default()
                        .to_string(),
                })
                .collect()
        })
        .unwrap_or_default();
    let usage = v
        .get("usage")
        .filter(|u| u.is_object())
        .map(|u| TokenUsage {
            input_tokens: u.get("prompt_tokens").and_then(Value::as_u64).unwrap_or(0),
            output_tokens: u
                .get("completion_tokens")
                .and_then(Value::as_u64)
                .unwrap_or(0),
            cached_tokens: u
                .pointer("/prompt_tokens_details/cached_tokens")
                .and_then(Value::as_u64)
                .unwrap_or(0),
            reasoning_tokens: u
                .pointer("/completion_tokens_details/reasoning_tokens")
                .and_then(Value::as_u64)
                .unwrap_or(0),
        });
    let mut finish = finish_of(choice.get("finish_reason").and_then(Value::as_str));
    if finish == Finish::Stop && !tool_calls.is_empty() {
        finish = Finish::ToolCalls;
    }
    Ok(Answer {
        id: v
            .get("id")
            .and_then(Value::as_str)
            .map(str::to_string)
            .unwrap_or_else(|| crate::dialect::new_id("chatcmpl-")),
        model: v
            .get("model")
            .and_then(Value::as_str)
            .unwrap_or_default()
            .to_string(),
        created: v.get("created").and_then(Value::as_i64).unwrap_or(0),
        text,
        reasoning: msg
            .get("reasoning_content")
            .or_else(|| msg.get("reasoning"))
            .and_then(Value::as_str)
            .map(str::to_string),
        tool_calls,
        finish,
        usage,
        logprobs: None,
    })
}

pub(super) fn finish_str(f: Finish) -> &'static str {
    match f {
        Finish::Stop | Finish::Error => "stop",
        Finish::Length => "length",
        Finish::ToolCalls => "tool_calls",
        Finish::ContentFilter => "content_filter",
    }
}

pub(super) fn usage_value(u: &TokenUsage) -> Value {
    json!({
        "prompt_tokens": u.input_tokens,
        "completion_tokens": u.output_tokens,
        "total_tokens": u.input_tokens + u.output_tokens,
        "prompt_tokens_details": {"cached_tokens": u.cached_tokens},
        "completion_tokens_details": {"reasoning_tokens": u.reasoning_tokens},
    })
}

/// A whole answer as a `chat.completion` object in OpenAI's shape; reasoning in
/// `reasoning_content`.
pub fn render_answer(answer: &Answer, id: &str) -> Value {
    render_shaped(answer, id, AnswerShape::OpenAi, false)
}

/// A whole answer as the `chat.completion` object of `shape`'s endpoint; `forced`: the
/// request forces a call (`tool_choice` required or a named function, with tools).
pub fn render_shaped(answer: &Answer, id: &str, shape: AnswerShape, forced: bool) -> Value {
    let mut msg = Map::new();
    msg.insert("role".into(), json!("assistant"));
    let empty = answer.text.is_empty();
    let content = match shape {
        AnswerShape::OpenAi if empty && !answer.tool_calls.is_empty() => Value::Null,
        AnswerShape::Vllm if empty && !forced => Value::Null,
        AnswerShape::OpenAi | AnswerShape::Sglang | AnswerShape::Vllm => json!(answer.text),
    };
    msg.insert("content".into(), content);
    if let Some(r) = &answer.reasoning {
        msg.insert(shape.reasoning_key().into(), json!(r));
    }
    if !answer.tool_calls.is_empty() {
        msg.insert(
            "tool_calls".into(),
            Value::Array(
                answer
                    .tool_calls
                    .iter()
                    .map(|t| json!({"id": t.id, "type": "function", "function": {"name": t.name, "arguments": t.arguments}}))
                    .collect(),
            ),
        );
    }
    let mut v = json!({
        "id": id,
        "object": "chat.completion",
        "created": answer.created,
        "model": answer.model,
        "choices": [{"index": 0, "message": msg, "logprobs": answer.logprobs.as_deref().map_or(Value::Null, crate::dialect::chat_logprobs), "finish_reason": finish_str(answer.finish)}],
    });
    if let Some(u) = &answer.usage {
        v["usage"] = usage_value(u);
    }
    v
}

//! Whole answers as `text_completion` objects.

use serde_json::{Value, json};

use crate::dialect::{Answer, Finish, TokenUsage};

/// The Completions `finish_reason`: `stop`, `length` or `content_filter` (the only three the
/// API has; a tool-call or error finish reads `stop`).
pub(super) fn finish_str(f: Finish) -> &'static str {
    match f {
        Finish::Stop | Finish::ToolCalls | Finish::Error => "stop",
        Finish::Length => "length",
        Finish::ContentFilter => "content_filter",
    }
}

pub(super) fn usage_value(u: &TokenUsage) -> Value {
    json!({
        "prompt_tokens": u.input_tokens,
        "completion_tokens": u.output_tokens,
        "total_tokens": u.input_tokens + u.output_tokens,
    })
}

/// A whole answer as a `text_completion` object (`usage` only when the answer has it).
/// Reasoning and tool calls have no place in this dialect and are left out.
pub fn render_answer(answer: &Answer, id: &str) -> Value {
    let mut v = json!({
        "id": id,
        "object": "text_completion",
        "created": answer.created,
        "model": answer.model,
        "choices": [{
            "index": 0,
            "text": answer.text,
            "logprobs": answer.logprobs.as_deref().map_or(Value::Null, |t| {
                crate::dialect::completions_logprobs(t, t.iter().any(|x| !x.top.is_empty()))
            }),
            "finish_reason": finish_str(answer.finish),
        }],
    });
    if let Some(u) = &answer.usage {
        v["usage"] = usage_value(u);
    }
    v
}

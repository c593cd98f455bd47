//! The Chat Completions stream emitter: deltas → `chat.completion.chunk` events.

use serde_json::{Value, json};

use super::render::{finish_str, usage_value};
use crate::dialect::{Answer, AnswerShape, Delta};

/// Chat Completions SSE, as OpenAI streams it: a first chunk with the role, content and
/// reasoning deltas, each tool call's header then its arguments, a chunk with the finish
/// reason, a usage chunk with `choices: []` when the client asked for
/// `stream_options.include_usage`, then `[DONE]`.
pub struct ChatStream {
    id: String,
    model: String,
    created: i64,
    include_usage: bool,
    /// The key of reasoning deltas ([`AnswerShape::reasoning_key`]).
    reasoning_key: &'static str,
}

pub fn stream(model: &str, id: &str, created: i64, include_usage: bool) -> ChatStream {
    ChatStream {
        id: id.to_string(),
        model: model.to_string(),
        created,
        include_usage,
        reasoning_key: AnswerShape::OpenAi.reasoning_key(),
    }
}

impl ChatStream {
    /// Streams in `shape`'s form (vLLM names reasoning deltas `reasoning`).
    #[must_use]
    pub fn shaped(mut self, shape: AnswerShape) -> Self {
        self.reasoning_key = shape.reasoning_key();
        self
    }

    fn chunk(&self, delta: Value, finish: Option<&str>) -> bytes::Bytes {
        self.chunk_with(delta, Value::Null, finish)
    }

    fn chunk_with(&self, delta: Value, logprobs: Value, finish: Option<&str>) -> bytes::Bytes {
        let mut c = json!({
            "id": self.id,
            "object": "chat.completion.chunk",
            "created": self.created,
            "model": self.model,
            "choices": [{"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish}],
        });
        if self.include_usage {
            c["usage"] = Value::Null;
        }
        bytes::Bytes::from(format!("data: {c}\n\n"))
    }
}

impl crate::dialect::StreamEmitter for ChatStream {
    fn start(&mut self) -> Vec<bytes::Bytes> {
        vec![self.chunk(json!({"role": "assistant", "content": ""}), None)]
    }

    fn push(&mut self, delta: &Delta) -> Vec<bytes::Bytes> {
        let d = match delta {
            Delta::Logprobs(tokens) => {
                // The tokens' logprobs in a chunk of their own (an empty delta): a client
                // joins every chunk's `logprobs.content`.
                return vec![self.chunk_with(
                    json!({}),
                    crate::dialect::chat_logprobs(tokens),
                    None,
                )];
            }
            Delta::Text(t) => json!({"content": t}),
            Delta::Reasoning(r) => json!({ self.reasoning_key: r }),
            Delta::ToolCallStart { index, id, name } => json!({"tool_calls": [
                {"index": index, "id": id, "type": "function", "function": {"name": name, "arguments": ""}}]}),
            Delta::ToolCallArgs { index, arguments } => json!({"tool_calls": [
                {"index": index, "function": {"arguments": arguments}}]}),
        };
        vec![self.chunk(d, None)]
    }

    fn finish(&mut self, answer: &Answer) -> Vec<bytes::Bytes> {
        let mut out = vec![self.chunk(json!({}), Some(finish_str(answer.finish)))];
        if self.include_usage {
            let u = answer.usage.unwrap_or_default();
            let c = json!({
                "id": self.id,
                "object": "chat.completion.chunk",
                "created": self.created,
                "model": self.model,
                "choices": [],
                "usage": usage_value(&u),
            });
            out.push(bytes::Bytes::from(format!("data: {c}\n\n")));
        }
        out.push(bytes::Bytes::from_static(b"data: [DONE]\n\n"));
        out
    }
}

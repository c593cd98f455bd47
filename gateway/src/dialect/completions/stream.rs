//! The Completions stream emitter: text deltas → `text_completion` chunks.

use bytes::Bytes;
use serde_json::{Value, json};

use super::render::{finish_str, usage_value};
use crate::dialect::{Answer, Delta, StreamEmitter};

/// Completions SSE as vLLM and OpenAI stream it: no opening chunk, one chunk per text delta
/// (`finish_reason: null`), a last choice chunk with empty text and the finish reason, a usage
/// chunk with `choices: []` when the client asked for `stream_options.include_usage` (every
/// chunk then carries `usage: null`), then `[DONE]`. Reasoning and tool-call deltas are
/// dropped: the dialect has no place for them.
pub struct CompletionsStream {
    id: String,
    model: String,
    created: i64,
    include_usage: bool,
    /// Deltas dropped because the dialect cannot carry them (reasoning, tool calls).
    dropped: usize,
}

/// A stream emitter for one completion.
pub fn stream(model: &str, id: &str, created: i64, include_usage: bool) -> CompletionsStream {
    CompletionsStream {
        id: id.to_string(),
        model: model.to_string(),
        created,
        include_usage,
        dropped: 0,
    }
}

impl CompletionsStream {
    fn chunk(&self, choices: Value, usage: Option<Value>) -> Bytes {
        let mut c = json!({
            "id": self.id,
            "object": "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": choices,
        });
        if self.include_usage {
            c["usage"] = usage.unwrap_or(Value::Null);
        }
        Bytes::from(format!("data: {c}\n\n"))
    }

    fn choice(text: &str, finish: Option<&str>) -> Value {
        json!([{"index": 0, "text": text, "logprobs": null, "finish_reason": finish}])
    }
}

impl StreamEmitter for CompletionsStream {
    fn start(&mut self) -> Vec<Bytes> {
        vec![]
    }

    fn push(&mut self, delta: &Delta) -> Vec<Bytes> {
        match delta {
            Delta::Text(t) => vec![self.chunk(Self::choice(t, None), None)],
            Delta::Logprobs(tokens) => {
                let mut choice = Self::choice("", None);
                choice[0]["logprobs"] = crate::dialect::completions_logprobs(
                    tokens,
                    tokens.iter().any(|t| !t.top.is_empty()),
                );
                vec![self.chunk(choice, None)]
            }
            Delta::Reasoning(_) | Delta::ToolCallStart { .. } | Delta::ToolCallArgs { .. } => {
                self.dropped += 1;
                vec![]
            }
        }
    }

    fn finish(&mut self, answer: &Answer) -> Vec<Bytes> {
        if self.dropped > 0 {
            tracing::debug!(
                dropped = self.dropped,
                "completions stream: reasoning/tool-call deltas have no place in this dialect and were dropped"
            );
        }
        let mut out = vec![self.chunk(Self::choice("", Some(finish_str(answer.finish))), None)];
        if self.include_usage {
            let u = answer.usage.unwrap_or_default();
            out.push(self.chunk(json!([]), Some(usage_value(&u))));
        }
        out.push(Bytes::from_static(b"data: [DONE]\n\n"));
        out
    }
}

//! The Anthropic Messages stream emitter and its mid-stream error event.

use bytes::Bytes;
use serde_json::json;

use super::render::{error_body, model_name, stop_reason, tool_use_block, usage_json};
use crate::dialect::{Answer, Conversation, Delta, EventStream, ToolCall, sse_named};
use crate::error::GatewayError;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum BlockKind {
    Text,
    Thinking,
}

#[derive(Debug, Default)]
struct PendingTool {
    id: String,
    name: String,
    arguments: String,
}

/// Emits Anthropic SSE events for one streamed answer. See the module docs for why tool_use
/// blocks are sent whole at the end.
pub struct AnthropicStream {
    message_id: String,
    model: String,
    started: bool,
    finished: bool,
    next_index: usize,
    open: Option<(usize, BlockKind)>,
    sent_text: bool,
    sent_thinking: bool,
    /// Tool calls by their delta index, in start order.
    tools: std::collections::BTreeMap<usize, PendingTool>,
    /// Argument pieces buffered since the last keep-alive `ping`.
    buffered_since_ping: usize,
}

/// Argument pieces buffered between two keep-alive pings while tool calls are being written.
const PING_EVERY: usize = 32;

/// A stream emitter for one answer to `conv`; `message_id` is the `msg_…` id sent to the client.
pub fn stream(conv: &Conversation, message_id: &str) -> AnthropicStream {
    AnthropicStream {
        message_id: message_id.to_string(),
        model: model_name(conv, None).to_string(),
        started: false,
        finished: false,
        next_index: 0,
        open: None,
        sent_text: false,
        sent_thinking: false,
        tools: std::collections::BTreeMap::new(),
        buffered_since_ping: 0,
    }
}

fn ping() -> Bytes {
    sse_named("ping", &json!({"type": "ping"}))
}

impl AnthropicStream {
    fn ensure_started(&mut self, out: &mut Vec<Bytes>) {
        if self.started {
            return;
        }
        self.started = true;
        out.push(sse_named(
            "message_start",
            &json!({
                "type": "message_start",
                "message": {
                    "id": self.message_id,
                    "type": "message",
                    "role": "assistant",
                    "content": [],
                    "model": self.model,
                    "stop_reason": null,
                    "stop_sequence": null,
                    "usage": {"input_tokens": 0, "output_tokens": 0},
                },
            }),
        ));
        out.push(ping());
    }

    fn close_open(&mut self, out: &mut Vec<Bytes>) {
        if let Some((index, _)) = self.open.take() {
            out.push(sse_named(
                "content_block_stop",
                &json!({"type": "content_block_stop", "index": index}),
            ));
        }
    }

    fn take_index(&mut self) -> usize {
        let i = self.next_index;
        self.next_index += 1;
        i
    }

    /// Streams a text or thinking piece, opening a block of that kind first if needed.
    fn piece(&mut self, kind: BlockKind, text: &str, out: &mut Vec<Bytes>) {
        if text.is_empty() {
            return;
        }
        let index = match self.open {
            Some((index, k)) if k == kind => index,
            _ => {
                self.close_open(out);
                let index = self.take_index();
                let block = match kind {
                    BlockKind::Text => json!({"type": "text", "text": ""}),
                    BlockKind::Thinking => {
                        json!({"type": "thinking", "thinking": "", "signature": ""})
                    }
                };
                out.push(sse_named(
                    "content_block_start",
                    &json!({"type": "content_block_start", "index": index, "content_block": block}),
                ));
                self.open = Some((index, kind));
                index
            }
        };
        let delta = match kind {
            BlockKind::Text => {
                self.sent_text = true;
                json!({"type": "text_delta", "text": text})
            }
            BlockKind::Thinking => {
                self.sent_thinking = true;
                json!({"type": "thinking_delta", "thinking": text})
            }
        };
        out.push(sse_named(
            "content_block_delta",
            &json!({"type": "content_block_delta", "index": index, "delta": delta}),
        ));
    }

    fn tool_block(&mut self, call: &ToolCall, n: usize, out: &mut Vec<Bytes>) {
        let index = self.take_index();
        let block = tool_use_block(call, &self.message_id, n);
        let input = block.get("input").cloned().unwrap_or_else(|| json!({}));
        let mut start = block;
        if let Some(o) = start.as_object_mut() {
            o.insert("input".into(), json!({}));
        }
        out.push(sse_named(
            "content_block_start",
            &json!({"type": "content_block_start", "index": index, "content_block": start}),
        ));
        out.push(sse_named(
            "content_block_delta",
            &json!({
                "type": "content_block_delta",
                "index": index,
                "delta": {"type": "input_json_delta", "partial_json": input.to_string()},
            }),
        ));
        out.push(sse_named(
            "content_block_stop",
            &json!({"type": "content_block_stop", "index": index}),
        ));
    }
}

impl EventStream for AnthropicStream {
    fn ended(&self) -> bool {
        self.finished
    }

    fn open(&mut self, out: &mut Vec<Bytes>) {
        self.ensure_started(out);
    }

    fn delta(&mut self, delta: &Delta, out: &mut Vec<Bytes>) {
        match delta {
            // Messages has no place for logprobs.
            Delta::Logprobs(_) => {}
            Delta::Text(t) => self.piece(BlockKind::Text, t, out),
            Delta::Reasoning(t) => self.piece(BlockKind::Thinking, t, out),
            Delta::ToolCallStart { index, id, name } => {
                let tool = self.tools.entry(*index).or_default();
                tool.id.clone_from(id);
                tool.name.clone_from(name);
            }
            Delta::ToolCallArgs { index, arguments } => {
                self.tools
                    .entry(*index)
                    .or_default()
                    .arguments
                    .push_str(arguments);
                self.buffered_since_ping += 1;
                if self.buffered_since_ping >= PING_EVERY {
                    self.buffered_since_ping = 0;
                    out.push(ping());
                }
            }
        }
    }

    fn close(&mut self, answer: &Answer, out: &mut Vec<Bytes>) {
        self.finished = true;
        // Whatever the answer has that never arrived as a delta.
        if !self.sent_thinking
            && let Some(r) = answer.reasoning.as_deref()
        {
            self.piece(BlockKind::Thinking, r, out);
        }
        if !self.sent_text {
            self.piece(BlockKind::Text, &answer.text, out);
        }
        self.close_open(out);

        // The assembled answer's calls are authoritative; the buffered deltas are the fallback.
        let buffered: Vec<ToolCall> = std::mem::take(&mut self.tools)
            .into_values()
            .map(|t| ToolCall {
                id: t.id,
                name: t.name,
                arguments: t.arguments,
            })
            .collect();
        let calls = if answer.tool_calls.is_empty() {
            &buffered
        } else {
            &answer.tool_calls
        };
        for (n, call) in calls.iter().enumerate() {
            self.tool_block(call, n, out);
        }

        out.push(sse_named(
            "message_delta",
            &json!({
                "type": "message_delta",
                "delta": {
                    "stop_reason": stop_reason(answer.finish, !calls.is_empty()),
                    "stop_sequence": null,
                },
                "usage": usage_json(answer.usage.as_ref()),
            }),
        ));
        out.push(sse_named("message_stop", &json!({"type": "message_stop"})));
    }
}

/// The error as a mid-stream SSE event (`event: error`), as Anthropic sends it after a 200.
pub fn error_event(err: &GatewayError) -> Bytes {
    sse_named("error", &error_body(err))
}

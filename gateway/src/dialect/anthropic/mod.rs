//! Anthropic Messages (`POST /v1/messages`): the request parser, whole-message rendering,
//! the SSE stream emitter, Anthropic-shaped error bodies, and an assembler that rebuilds the
//! final message from a stream's events (for tests and for recording a passthrough stream).
//!
//! Event shapes follow the Messages streaming protocol as the official SDKs type it
//! (`RawMessageStreamEvent`): `message_start`, `content_block_start` / `_delta` / `_stop`,
//! `message_delta` (stop reason and cumulative usage) and `message_stop`, each sent as
//! `event: <type>\ndata: <json>\n\n`.
//!
//! Tool calls are streamed whole: a `tool_use` block is emitted (start, one
//! `input_json_delta`, stop) once the answer is complete, with its input normalized to a JSON
//! object. Streaming the model's raw argument text piece by piece would let malformed JSON
//! from an open-weights model reach the client, and the Anthropic SDKs abort the whole stream
//! on a tool input they cannot parse; it would also break when an upstream interleaves the
//! arguments of parallel calls. Text and thinking stream as they arrive.

mod assemble;
mod render;
mod request;
mod stream;
#[cfg(test)]
mod tests;

pub use assemble::AnthropicAssembler;
pub use render::{error_body, render_answer};
pub use request::parse_request;
pub use stream::{AnthropicStream, error_event, stream};

use bytes::Bytes;
use serde_json::Value;

use crate::dialect::{Answer, Conversation, Dialect, DialectKind, StreamAssembler, StreamEmitter};
use crate::error::GatewayError;

/// Anthropic Messages (`/v1/messages`), with Anthropic's own error shapes.
#[derive(Debug, Clone, Copy, Default)]
pub struct Anthropic;

impl Dialect for Anthropic {
    fn kind(&self) -> DialectKind {
        DialectKind::AnthropicMessages
    }

    fn parse(&self, body: &Value) -> Result<Conversation, GatewayError> {
        parse_request(body)
    }

    fn render(&self, conv: &Conversation, answer: &Answer, id: &str) -> Value {
        render_answer(conv, answer, id)
    }

    fn emitter(&self, conv: &Conversation, id: &str, _created: i64) -> Box<dyn StreamEmitter> {
        Box::new(stream(conv, id))
    }

    fn assembler(&self) -> Box<dyn StreamAssembler> {
        Box::new(AnthropicAssembler::new())
    }

    fn error_body(&self, e: &GatewayError) -> Value {
        error_body(e)
    }

    fn error_event(&self, e: &GatewayError, _response_id: &str) -> Bytes {
        error_event(e)
    }

    fn finish_reason(&self, answer: &Answer) -> &'static str {
        render::stop_reason(answer.finish, !answer.tool_calls.is_empty())
    }

    fn id_prefix(&self) -> &'static str {
        "msg_"
    }
}

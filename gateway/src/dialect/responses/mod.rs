//! The OpenAI Responses API dialect (`POST /v1/responses`), as the OpenAI SDKs and Codex speak it.
//!
//! - [`parse_request`]: a Responses request body → [`Conversation`]. graft is stateless here:
//!   `previous_response_id` / `conversation` are refused (Codex sends `store: false` and the full
//!   history every turn). Hosted and non-function tools are dropped with a note; Codex's freeform
//!   `custom` tools (e.g. `apply_patch` with a grammar) become a function with one string
//!   argument `input`, and calls to them are rendered back as `custom_tool_call` items.
//! - [`render_answer`]: an [`Answer`] → a whole `response` object.
//! - [`ResponsesStream`]: deltas → the SSE events OpenAI's servers send, in their order
//!   (`response.created`, `response.in_progress`, per item `response.output_item.added` … `done`,
//!   then `response.completed` / `response.incomplete` / `response.failed` with `usage`).
//! - [`error_event`] / [`ResponsesStream::fail`]: a mid-stream failure.
//! - [`ResponsesAssembler`]: events → the final `response` object (tests, passthrough recording).
//!
//! Output item ids are derived from the response id (`msg_<id>_<n>`, `fc_<id>_<n>`,
//! `rs_<id>_<n>`, `ctc_<id>_<n>`, with `<n>` the output index), so a streamed and a whole
//! rendering of the same answer agree exactly.

mod assemble;
mod render;
mod request;
mod stream;
#[cfg(test)]
mod tests;

pub use assemble::ResponsesAssembler;
pub use render::render_answer;
pub use request::{CUSTOM_TOOLS_KEY, parse_request};
pub use stream::{ResponsesStream, error_event, stream};

use bytes::Bytes;
use serde_json::Value;

use crate::dialect::{Answer, Conversation, Dialect, DialectKind, StreamAssembler, StreamEmitter};
use crate::error::GatewayError;

/// OpenAI Responses (`/v1/responses`). The stream emitter stamps `created_at` itself.
#[derive(Debug, Clone, Copy, Default)]
pub struct Responses;

impl Dialect for Responses {
    fn kind(&self) -> DialectKind {
        DialectKind::Responses
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
        Box::new(ResponsesAssembler::new())
    }

    fn error_event(&self, e: &GatewayError, response_id: &str) -> Bytes {
        error_event(e, response_id)
    }

    fn finish_reason(&self, answer: &Answer) -> &'static str {
        render::status(answer.finish)
    }

    fn id_prefix(&self) -> &'static str {
        "resp_"
    }
}

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

//! OpenAI Completions (`POST /v1/completions`): the legacy raw-prompt API that vLLM, SGLang
//! and OpenAI (`gpt-3.5-turbo-instruct`) still serve, and that RL rollouts use when they
//! render the prompt themselves.
//!
//! - [`parse_request`]: a request body → a [`Conversation`] with no messages and the raw
//!   [`RawPrompt`](crate::dialect::RawPrompt) (a string, a one-element array of strings, or
//!   token ids). A batch (several prompts), `echo`, `best_of > 1`, `suffix` and `n > 1` are
//!   refused: graft records one completion of one prompt per call.
//! - [`render_answer`]: an [`Answer`] → a whole `text_completion` object.
//! - [`CompletionsStream`]: deltas → `text_completion` chunks as vLLM and OpenAI stream them
//!   (one chunk per text delta, the finish reason in the last choice chunk, a usage chunk with
//!   `choices: []` when `stream_options.include_usage`, then `data: [DONE]`).
//! - The assembler is the Chat one in completions mode ([`Assembler::completions`](crate::dialect::chat::Assembler::completions)).
//!
//! The dialect has only text: reasoning and tool calls do not exist in it. An [`Answer`]'s
//! reasoning and tool calls (which only a reasoning or tool-call parser would produce) are
//! dropped by [`render_answer`] and [`CompletionsStream`]; run Completions calls without
//! such parsers.

mod assemble;
mod render;
mod request;
mod stream;
#[cfg(test)]
mod tests;

pub use assemble::assembler;
pub use render::render_answer;
pub use request::parse_request;
pub use stream::{CompletionsStream, stream};

use serde_json::Value;

use crate::dialect::{Answer, Conversation, Dialect, DialectKind, StreamAssembler, StreamEmitter};
use crate::error::GatewayError;

/// OpenAI Completions (`/v1/completions`), with OpenAI's error shapes.
#[derive(Debug, Clone, Copy, Default)]
pub struct Completions;

impl Dialect for Completions {
    fn kind(&self) -> DialectKind {
        DialectKind::Completions
    }

    fn check(&self, body: &serde_json::Map<String, Value>) -> Result<(), GatewayError> {
        request::check(body)
    }

    fn upstream_speaks(&self) -> bool {
        true
    }

    fn parse(&self, body: &Value) -> Result<Conversation, GatewayError> {
        parse_request(body)
    }

    fn render(&self, _conv: &Conversation, answer: &Answer, id: &str) -> Value {
        render_answer(answer, id)
    }

    fn emitter(&self, conv: &Conversation, id: &str, created: i64) -> Box<dyn StreamEmitter> {
        Box::new(stream(&conv.model, id, created, conv.include_usage))
    }

    fn assembler(&self) -> Box<dyn StreamAssembler> {
        Box::new(assembler())
    }

    fn finish_reason(&self, answer: &Answer) -> &'static str {
        render::finish_str(answer.finish)
    }

    fn id_prefix(&self) -> &'static str {
        "cmpl-"
    }
}

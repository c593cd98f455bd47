//! OpenAI Chat Completions: the dialect most inference servers (SGLang, vLLM, `graft serve`)
//! speak, and so the one other dialects are translated to when the upstream speaks nothing
//! else.

mod assemble;
mod render;
mod request;
mod stream;
#[cfg(test)]
mod tests;

pub use assemble::{Assembler, ChunkReader};
pub use render::{parse_answer, render_answer, render_shaped};
pub use request::{parse_request, to_request};
pub use stream::{ChatStream, stream};

use serde_json::Value;

use crate::dialect::{
    Answer, Conversation, Dialect, DialectKind, StreamAssembler, StreamEmitter, ToolChoice,
};
use crate::error::GatewayError;

/// OpenAI Chat Completions (`/v1/chat/completions`).
#[derive(Debug, Clone, Copy, Default)]
pub struct Chat;

impl Dialect for Chat {
    fn kind(&self) -> DialectKind {
        DialectKind::ChatCompletions
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

    fn render(&self, conv: &Conversation, answer: &Answer, id: &str) -> Value {
        let forced = !conv.tools.is_empty()
            && matches!(
                conv.tool_choice,
                Some(ToolChoice::Required | ToolChoice::Function { .. })
            );
        render_shaped(answer, id, conv.shape, forced)
    }

    fn emitter(&self, conv: &Conversation, id: &str, created: i64) -> Box<dyn StreamEmitter> {
        Box::new(stream(&conv.model, id, created, conv.include_usage).shaped(conv.shape))
    }

    fn assembler(&self) -> Box<dyn StreamAssembler> {
        Box::new(Assembler::chat())
    }

    fn finish_reason(&self, answer: &Answer) -> &'static str {
        render::finish_str(answer.finish)
    }

    fn id_prefix(&self) -> &'static str {
        "chatcmpl-"
    }
}

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
pub use render::{parse_answer, render_answer};
pub use request::{parse_request, to_request};
pub use stream::{ChatStream, stream};

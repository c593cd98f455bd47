//! Rebuilding a whole `text_completion` from a relayed Completions stream: the Chat
//! [`Assembler`] in completions mode (it concatenates each choice's `text` and the legacy
//! parallel-array `logprobs`).

use crate::dialect::chat::Assembler;

/// The assembler of a Completions stream.
pub fn assembler() -> Assembler {
    Assembler::completions()
}

//! graft-reconstruct: chat templates and tokenizers of real models, parsers for their tool
//! calls and reasoning, and (later) the merge of a session's calls into training samples.
//! Pure and synchronous: no I/O beyond loading model files, no async, no HTTP.

pub mod merge;
pub mod parser;
pub mod template;

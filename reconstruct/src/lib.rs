//! graft-reconstruct: chat templates and tokenizers of real models, parsers for their tool
//! calls and reasoning, and the merge of a session's calls into training samples.
//! Pure and synchronous: no I/O beyond loading model files, reading a gateway's records
//! ([`records`]) and reading/writing sample Parquet files; no async, no HTTP.

pub mod attempts;
pub mod branch;
pub mod error;
pub mod exact;
pub mod merge;
pub mod parse_rule;
pub mod parser;
mod pyliteral;
pub mod records;
pub mod retokenize;
pub mod sample;
pub mod template;
pub mod threads;
pub mod vllm_engine;

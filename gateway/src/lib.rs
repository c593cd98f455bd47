//! graft's recording gateway: an OpenAI-compatible proxy that records every inference call.
//!
//! Every call takes one pipeline (`pipeline.rs`): route → session → limits → the client's
//! `Dialect` → a `Backend` leg (passthrough, translation, exact mode) → one relay → the
//! record committed → the last event released. See `docs/ARCHITECTURE.md`.

pub mod admin_key;
pub mod backend;
pub mod body;
pub mod branch;
mod call;
pub mod config;
pub mod dialect;
pub mod error;
pub mod limits;
pub mod metrics;
mod outcome;
pub mod pipeline;
pub mod policy;
mod retries;
pub mod route;
pub mod server;
pub mod sessions;
pub mod sglang;
pub mod sse;
pub mod state;
pub mod token_ids;
pub mod upstream;
pub mod vllm;
pub mod xgrammar;

pub use config::{
    BackendConfig, ConfigError, DurabilityMode, ExactConfig, FileConfig, GatewayConfig,
    OpenAiConfig, Overrides,
};
pub use error::{Cause, GatewayError};
pub use server::{Gateway, StartError};

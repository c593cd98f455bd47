//! graft's recording gateway: an OpenAI-compatible proxy that records every inference call.
//!
//! Every call takes one pipeline (`pipeline.rs`): route → session → limits → the client's
//! `Dialect` → a `Backend` leg (passthrough, translation, exact mode) → one relay → the
//! record committed → the last event released. See `docs/ARCHITECTURE.md`.

pub mod admin_key;
pub mod backend;
mod body;
mod branch;
mod call;
pub mod config;
pub mod dialect;
mod error;
mod limits;
mod metrics;
mod outcome;
mod pipeline;
pub mod policy;
mod retries;
mod route;
mod server;
pub mod sessions;
mod sglang;
pub mod sse;
mod state;
mod token_ids;
mod upstream;
mod upstream_events;
mod vllm;
mod xgrammar;

pub use config::{
    BackendConfig, ConfigError, DurabilityMode, ExactConfig, FileConfig, GatewayConfig,
    OpenAiConfig, Overrides,
};
pub use error::{Cause, GatewayError};
pub use server::{Gateway, StartError};

//! graft's recording gateway: an OpenAI-compatible proxy that records every inference call.
//!
//! Passthrough mode forwards each request body unchanged to an OpenAI-compatible upstream,
//! relays the answer unchanged (SSE event by event), and tees it into a
//! [`graft_recorder::CallRecord`]. See `docs/ARCHITECTURE.md`.

pub mod body;
pub mod config;
pub mod dialect;
pub mod error;
pub mod exact;
pub mod limits;
pub mod metrics;
pub mod proxy;
pub mod server;
pub mod sessions;
pub mod sglang;
pub mod sse;
pub mod token_ids;
pub mod translate;
pub mod upstream;

pub use config::{ConfigError, DurabilityMode, FileConfig, GatewayConfig, Overrides};
pub use error::{Cause, GatewayError};
pub use server::{Gateway, StartError};

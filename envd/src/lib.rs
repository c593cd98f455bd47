//! envd: graft's sandbox service. An HTTP API (create, exec, files, apply_patch, TTL +
//! heartbeat) over sandboxes; the local backend runs them with bubblewrap and cgroups, the
//! Kubernetes backend as Pods; `envd-agent` is the first process of every exec inside a
//! local sandbox and the server a Pod's execs and files go through. envd knows nothing of
//! the gateway's internals: a sandbox reaches the gateway over HTTP through a forwarded
//! loopback port, and a gateway session is only a URL and a key to it.

/// The in-sandbox agent (its own crate, `envd/agent`, so it can be built static).
pub use graft_envd_agent as agent;
pub mod backend;
pub mod config;
pub mod error;
pub mod files;
pub mod kubernetes;
pub mod local;
pub mod metrics;
pub mod model;
pub mod openapi;
pub mod server;
pub mod service;

pub use config::{
    AgentCommand, BackendKind, DefaultLimits, EnvdConfig, HarnessRenderer, HarnessRequest,
    KubeConfig, RenderedHarness,
};
pub use error::{EnvdError, StartError};
pub use server::Envd;

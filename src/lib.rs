//! graft: train a model inside the agent harness it will be deployed in.
//!
//! This package is the `graft` CLI. The work lives in the workspace crates
//! (`graft-recorder`, `graft-gateway`, ...); this crate wires them to commands. The scripted
//! upstream (`graft-testkit`) comes in only with the `testkit` feature.

pub mod cli;
#[cfg(feature = "testkit")]
pub mod demo;
pub mod envd;
pub mod export;
pub mod harness;
#[cfg(feature = "trainer")]
pub mod model;
pub mod reconstruct;
pub mod records;
pub mod rl;
pub mod rollouts;
#[cfg(feature = "trainer")]
pub mod serve;
#[cfg(feature = "trainer")]
pub mod train;
pub mod view;

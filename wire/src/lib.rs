//! The backend wires graft speaks, as serde types shared by every side that speaks them:
//! the gateway (exact mode's client), `graft serve` (a server), the scripted upstream in
//! `graft-testkit` (a server) and the trainer's weight push (a client).
//!
//! Two wires: SGLang's native HTTP API ([`sglang`]) and vLLM's token-in/token-out
//! `/v1/completions` ([`vllm`], exact mode's other backend). This crate is a leaf: serde and
//! serde_json only, no I/O.

pub mod sglang;
pub mod vllm;

//! graft's trainer: Llama / Qwen2 / Qwen3 in libtorch (tch) from HF safetensors, the GRPO
//! loss, Balanced Adaptive Rollout selection, AdamW with fp32 master weights, checkpoints,
//! KV-cache sampling and the serving engine behind `graft serve`, and the weight push to
//! an SGLang-compatible server.
//!
//! Call [`device::init`] first: it loads libtorch's CUDA backend when there is one.

pub mod bar;
pub mod batch;
pub mod device;
pub mod engine;
pub mod error;
pub mod generate;
pub mod gguf;
pub mod grpo;
pub mod model;
pub mod optim;
pub mod push;
pub mod sampler;
pub mod step;
pub mod train;
pub mod weights;

pub use error::{Result, TrainerError};
/// The tch this crate is built on (seeding, devices, tensors for callers).
pub use tch;

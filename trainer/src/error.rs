//! The trainer's one error type.

use std::path::PathBuf;

/// Everything that can go wrong in the trainer. Messages say what was wrong and what to do.
#[derive(Debug, thiserror::Error)]
pub enum TrainerError {
    #[error("{action} '{path}': {source}")]
    Io {
        action: &'static str,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("config '{path}': {problem}")]
    Config { path: PathBuf, problem: String },
    #[error("weights '{path}': {problem}")]
    Weights { path: PathBuf, problem: String },
    #[error("libtorch: {0}")]
    Torch(#[from] tch::TchError),
    #[error("{0}")]
    Invalid(String),
    #[error("samples: {0}")]
    Samples(#[from] graft_reconstruct::error::ReconstructError),
    #[error("weight push to '{url}': {problem}")]
    Push { url: String, problem: String },
}

impl TrainerError {
    pub(crate) fn io(
        action: &'static str,
        path: impl Into<PathBuf>,
        source: std::io::Error,
    ) -> Self {
        TrainerError::Io {
            action,
            path: path.into(),
            source,
        }
    }

    pub(crate) fn invalid(msg: impl Into<String>) -> Self {
        TrainerError::Invalid(msg.into())
    }
}

pub type Result<T, E = TrainerError> = std::result::Result<T, E>;

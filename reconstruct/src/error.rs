//! The crate's error type.

use std::path::PathBuf;

/// Errors of reconstruct's I/O: reading records, reading and writing sample files.
#[derive(Debug, thiserror::Error)]
pub enum ReconstructError {
    #[error("{action} {path}: {source}")]
    Io {
        action: &'static str,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("parquet file {path}: {source}")]
    Parquet {
        path: PathBuf,
        #[source]
        source: parquet::errors::ParquetError,
    },
    #[error("arrow data of {path}: {source}")]
    Arrow {
        path: PathBuf,
        #[source]
        source: arrow_schema::ArrowError,
    },
    #[error("reading the recorded calls: {0}")]
    Records(#[from] graft_recorder::RecorderError),
    #[error("samples file {path}: column `{column}` {problem}")]
    Schema {
        path: PathBuf,
        column: String,
        problem: String,
    },
}

impl ReconstructError {
    pub(crate) fn io(
        action: &'static str,
        path: impl Into<PathBuf>,
        source: std::io::Error,
    ) -> Self {
        Self::Io {
            action,
            path: path.into(),
            source,
        }
    }

    pub(crate) fn parquet(path: impl Into<PathBuf>, source: parquet::errors::ParquetError) -> Self {
        Self::Parquet {
            path: path.into(),
            source,
        }
    }

    pub(crate) fn arrow(path: impl Into<PathBuf>, source: arrow_schema::ArrowError) -> Self {
        Self::Arrow {
            path: path.into(),
            source,
        }
    }
}

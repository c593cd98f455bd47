//! The recorder's one error type.

use std::path::PathBuf;

/// Everything that can go wrong while recording, sealing or reading calls.
///
/// Messages name the file, offset or value involved and say what to do.
#[derive(Debug, thiserror::Error)]
pub enum RecorderError {
    #[error(
        "{action} {path}: {source}; check that the data directory exists, is writable and the disk is not full"
    )]
    Io {
        action: &'static str,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },

    #[error(
        "could not encode call {call_id} as JSON: {source}; this is a graft bug, please report it"
    )]
    Encode {
        call_id: String,
        #[source]
        source: serde_json::Error,
    },

    #[error(
        "{path} at byte {offset} holds a frame with a valid checksum but unreadable JSON ({source}); it was written by a different graft version or is damaged: move the file aside and restart"
    )]
    WalPayload {
        path: PathBuf,
        offset: u64,
        #[source]
        source: serde_json::Error,
    },

    #[error(
        "{path} holds a record with schema_version {found}, newer than this build supports ({supported}); upgrade graft to read it"
    )]
    UnsupportedSchema {
        path: PathBuf,
        found: u32,
        supported: u32,
    },

    #[error(
        "parquet error in {path}: {source}; if the file is damaged, move it aside (the WAL may still hold its records)"
    )]
    Parquet {
        path: PathBuf,
        #[source]
        source: parquet::errors::ParquetError,
    },

    #[error("arrow error for {path}: {source}; if the file is damaged, move it aside")]
    Arrow {
        path: PathBuf,
        #[source]
        source: arrow_schema::ArrowError,
    },

    #[error(
        "{path}: column '{column}' {problem}; the file was not written by graft or is damaged: move it aside"
    )]
    Schema {
        path: PathBuf,
        column: String,
        problem: String,
    },

    #[error(
        "{path}: invalid JSON in column '{column}' row {row} ({source}); the file is damaged: move it aside"
    )]
    ColumnJson {
        path: PathBuf,
        column: &'static str,
        row: usize,
        #[source]
        source: serde_json::Error,
    },

    #[error(
        "call {call_id} (session '{session_id}', seq {seq}) is stored as a delta against call {base}, which is not in the data directory; restore the missing WAL segment or parquet file that holds call {base}"
    )]
    MissingBase {
        call_id: String,
        session_id: String,
        seq: u64,
        base: String,
    },

    #[error(
        "call {call_id}: its request delta cannot be applied to base {base}: {reason}; the data is damaged"
    )]
    BadDelta {
        call_id: String,
        base: String,
        reason: String,
    },

    #[error("the recorder is shut down; call {call_id} was NOT recorded (open a new Recorder)")]
    Closed { call_id: String },

    #[error("the recorder's writer stopped before confirming {what}; check the logs for the cause")]
    WriterGone { what: String },

    #[error(
        "writing WAL segment {path} failed: {message}; the calls of this batch may not be durable. Check the disk; the recorder continues in a fresh segment"
    )]
    WalWrite { path: PathBuf, message: String },

    #[error(
        "sealing WAL segment {segment} into parquet failed: {message}; the WAL segment is kept and will be sealed again on the next seal or restart"
    )]
    Seal { segment: u64, message: String },

    #[error(
        "session log {path} line {line} (byte {offset}) is not a valid session event ({source}); `graft records repair --data-dir DIR` rewrites the log keeping every whole event (the original is kept beside it)"
    )]
    SessionLogLine {
        path: PathBuf,
        line: usize,
        offset: u64,
        #[source]
        source: serde_json::Error,
    },

    #[error("a blocking recorder task failed: {message}; this is a graft bug, please report it")]
    Task { message: String },
}

impl RecorderError {
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
}

/// Shorthand used across the crate.
pub type Result<T, E = RecorderError> = std::result::Result<T, E>;

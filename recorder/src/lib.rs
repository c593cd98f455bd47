//! graft's recorder: the `CallRecord` schema, a write-ahead log with group commit,
//! sealing into day-partitioned Parquet, recovery, linear-per-trajectory request storage,
//! readers, export and the durable session event log. It knows nothing about HTTP.
//!
//! On-disk layout under the data directory (see README.md):
//! ```text
//! wal/00000007.wal                              open / unsealed WAL segments
//! records/date=YYYY-MM-DD/seg-00000006.parquet  sealed segments, one file per UTC day
//! records/_sealed/seg-00000006.json             seal manifests (commit points)
//! sessions.log                                  session events, JSON lines
//! ```

mod columnar;
pub mod delta;
mod error;
pub mod lines;
mod prealloc;
mod reader;
mod record;
mod redact;
mod seal;
mod session_log;
mod wal;
mod writer;

#[cfg(test)]
mod fixture_tests;
#[cfg(test)]
mod tests;

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

pub use delta::RequestDelta;
pub use error::RecorderError;
pub use lines::LineFile;
pub use reader::{
    SessionBytes, SessionSummary, StoredBytes, export_jsonl, export_parquet, list_sessions,
    read_export_parquet, read_records, read_session, stored_bytes,
};
pub use record::{
    CallOutcome, CallRecord, Difference, Replay, SCHEMA_VERSION, Usage, WeightSpan, wire,
};
pub use redact::{
    REDACTED, SECRET_BODY_KEYS, is_sensitive_key, redact_body_keys, redact_header_pairs,
    redact_headers, redact_json,
};
pub use session_log::{
    Repair, SessionEvent, SessionLog, read_session_events, repair as repair_session_log,
};
pub use writer::Recorder;

/// When `Recorder::record` resolves.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Durability {
    /// After the record is in a fsynced WAL segment (group commit).
    Sync,
    /// Once queued; the writer fsyncs at most `max_delay` after a write. A crash loses at
    /// most the queue plus the last `max_delay` of writes.
    Async { max_delay: Duration },
}

/// Called after each WAL fsync with its latency and the number of records it covered.
pub type OnFsync = Arc<dyn Fn(Duration, usize) + Send + Sync>;

#[derive(Clone)]
pub struct RecorderConfig {
    /// Data directory (layout: see the crate docs).
    pub dir: PathBuf,
    pub durability: Durability,
    /// Bounded queue; when full, `record()` waits (never drops a call).
    pub queue_capacity: usize,
    /// Rotate the WAL segment once it is past this size.
    pub segment_max_bytes: u64,
    /// Rotate and seal a non-empty segment older than this.
    pub seal_after: Duration,
    /// Sessions whose recent calls are kept in memory as delta bases. Past it the least
    /// recently written sessions lose theirs (their next call is stored whole), so sessions
    /// that are never closed cannot grow the writer's memory.
    pub max_base_sessions: usize,
    /// Keep the open WAL segment zero-filled (and synced) a little ahead of the writer, so
    /// that a record's fsync does not also commit a new file size through the
    /// filesystem's journal.
    pub preallocate: bool,
    pub on_fsync: Option<OnFsync>,
}

impl RecorderConfig {
    /// Defaults: `Sync`, queue 65536, 64 MiB segments, sealed after 60 s, delta bases for
    /// 4096 sessions, segments zero-filled ahead, no fsync hook.
    pub fn new(dir: impl Into<PathBuf>) -> Self {
        Self {
            dir: dir.into(),
            durability: Durability::Sync,
            queue_capacity: 65_536,
            segment_max_bytes: 64 * 1024 * 1024,
            seal_after: Duration::from_secs(60),
            max_base_sessions: 4096,
            preallocate: true,
            on_fsync: None,
        }
    }
}

impl std::fmt::Debug for RecorderConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RecorderConfig")
            .field("dir", &self.dir)
            .field("durability", &self.durability)
            .field("queue_capacity", &self.queue_capacity)
            .field("segment_max_bytes", &self.segment_max_bytes)
            .field("seal_after", &self.seal_after)
            .field("max_base_sessions", &self.max_base_sessions)
            .field("preallocate", &self.preallocate)
            .field("on_fsync", &self.on_fsync.is_some())
            .finish()
    }
}

/// What `Recorder::open` found and repaired.
#[derive(Debug, Clone, Default)]
pub struct RecoveryReport {
    /// Records replayed from WAL segments.
    pub recovered_records: u64,
    /// Bytes of torn WAL tails truncated.
    pub torn_bytes_dropped: u64,
    /// WAL segments sealed into parquet during open.
    pub sealed_segments: u64,
    /// Last seq per session, from everything stored.
    pub sessions: HashMap<String, SessionState>,
}

#[derive(Debug, Clone, Default)]
pub struct SessionState {
    pub last_seq: u64,
    pub records: u64,
}

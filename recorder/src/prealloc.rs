//! WAL segments zero-filled ahead of the writer, on a thread of their own.
//!
//! An fdatasync after an append must also commit the file's new size (and any newly
//! allocated blocks) through the filesystem's journal: on ext4 that is about 10 KB written
//! for a 1.7 KB record, against about 6 KB when the record overwrites blocks that are
//! already allocated, written and synced (docs/BENCHMARKS.md, "where sync's tail is").
//! So the writer asks this thread to write zeros some way past its position and fsync
//! them; its own fdatasyncs then carry only the record's pages. Zeros cost nothing to
//! readers: a frame length of 0 ends a segment's valid part (`wal::SegmentReader`), and
//! recovery does not count a zero tail as torn.
//!
//! The writer never writes into a range whose zeroing has not finished (it waits, which
//! with the lead kept here it rarely has to), so the zeros never land on a record.

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::sync::mpsc;
use std::sync::{Arc, Condvar, Mutex, PoisonError};

/// How far past the writer's position the segment is kept zero-filled.
const LEAD: u64 = 2 * 1024 * 1024;
/// Zeros written per call.
const CHUNK: usize = 256 * 1024;

struct Job {
    file: File,
    from: u64,
    to: u64,
    progress: Arc<Progress>,
    /// Its outcome is published (else dropping it publishes a failure).
    finished: bool,
}

impl Job {
    /// Publishes the outcome and wakes the writer.
    fn finish(mut self, result: std::io::Result<()>) {
        let mut done = self
            .progress
            .state
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        match result {
            Ok(()) => done.upto = done.upto.max(self.to),
            Err(e) => {
                if !done.failed {
                    tracing::warn!(error = %e, "zero-filling a WAL segment ahead of the writer failed; appending instead");
                }
                done.failed = true;
            }
        }
        drop(done);
        self.finished = true;
        self.progress.changed.notify_all();
    }
}

/// A job dropped unfinished (the thread panicked, or stopped with jobs queued) counts as
/// failed, so that a writer waiting on it goes on appending instead of waiting forever.
impl Drop for Job {
    fn drop(&mut self) {
        if self.finished {
            return;
        }
        let mut done = self
            .progress
            .state
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        done.failed = true;
        self.progress.changed.notify_all();
    }
}

/// How far one segment is zero-filled and synced.
#[derive(Default)]
struct Progress {
    state: Mutex<Done>,
    changed: Condvar,
}

#[derive(Default)]
struct Done {
    /// Bytes from the start of the segment that are zero-filled and synced (or written by
    /// the writer) and will not be written by this thread again.
    upto: u64,
    /// Zeroing failed (the disk is full, ...): the writer appends as if it had none.
    failed: bool,
}

/// The zero-filling thread; one per recorder. Dropping it lets the thread finish its jobs
/// and exit.
pub(crate) struct Zeroer {
    tx: mpsc::Sender<Job>,
}

impl Zeroer {
    pub(crate) fn start() -> std::io::Result<Zeroer> {
        let (tx, rx) = mpsc::channel::<Job>();
        std::thread::Builder::new()
            .name("graft-wal-zero".into())
            .spawn(move || {
                let zeros = vec![0u8; CHUNK];
                while let Ok(job) = rx.recv() {
                    // Once a segment's zeroing failed its writer no longer waits: nothing
                    // more may be zeroed in it, or the zeros could land on its records.
                    let failed = job
                        .progress
                        .state
                        .lock()
                        .unwrap_or_else(PoisonError::into_inner)
                        .failed;
                    if failed {
                        job.finish(Err(std::io::Error::other("an earlier zero-fill failed")));
                        continue;
                    }
                    let result = zero_fill(&job.file, job.from, job.to, &zeros);
                    job.finish(result);
                }
            })?;
        Ok(Zeroer { tx })
    }
}

fn zero_fill(file: &File, from: u64, to: u64, zeros: &[u8]) -> std::io::Result<()> {
    let mut at = from;
    while at < to {
        let n = usize::try_from(to - at).map_or(zeros.len(), |left| left.min(zeros.len()));
        file.write_all_at(&zeros[..n], at)?;
        at += n as u64;
    }
    file.sync_data()
}

/// One open segment's zero-filled lead.
pub(crate) struct Ahead {
    progress: Arc<Progress>,
    /// Bytes asked to be zero-filled so far.
    requested: u64,
    /// Never zero past this (the segment's rotation size, or the end of a larger record).
    limit: u64,
}

impl Ahead {
    /// Starts zero-filling a fresh segment (if its file cannot be shared with the thread,
    /// nothing is zeroed and the writer appends).
    pub(crate) fn start(zeroer: &Zeroer, file: &File, limit: u64) -> Ahead {
        let mut ahead = Ahead {
            progress: Arc::default(),
            requested: 0,
            limit,
        };
        ahead.request(zeroer, file, 0);
        ahead
    }

    /// Called before the writer writes `[at, end)`: keeps the lead ahead of `end` and
    /// waits until no zeroing is pending inside `[at, end)`.
    pub(crate) fn before_write(&mut self, zeroer: &Zeroer, file: &File, end: u64) {
        if self.requested < end.saturating_add(LEAD / 2) {
            self.request(zeroer, file, end);
        }
        let mut done = self
            .progress
            .state
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        // Zeroing runs in order from 0, so once `upto` covers `end` (or everything asked),
        // nothing pending overlaps the write.
        while !done.failed && done.upto < end.min(self.requested) {
            done = self
                .progress
                .changed
                .wait(done)
                .unwrap_or_else(PoisonError::into_inner);
        }
    }

    fn request(&mut self, zeroer: &Zeroer, file: &File, end: u64) {
        let to = end.saturating_add(LEAD).min(self.limit.max(end));
        if to <= self.requested {
            return;
        }
        let Ok(file) = file.try_clone() else {
            return;
        };
        let job = Job {
            file,
            from: self.requested,
            to,
            progress: self.progress.clone(),
            finished: false,
        };
        if zeroer.tx.send(job).is_ok() {
            self.requested = to;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Read;

    #[test]
    fn the_lead_is_zeroed_and_synced_and_never_lands_on_written_bytes() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("seg");
        let file = std::fs::OpenOptions::new()
            .create_new(true)
            .read(true)
            .write(true)
            .open(&path)
            .unwrap();
        let zeroer = Zeroer::start().unwrap();
        let limit = 8 * 1024 * 1024;
        let mut ahead = Ahead::start(&zeroer, &file, limit);
        // Write 5 MiB of ones in uneven pieces, as the writer would.
        let mut at = 0u64;
        let piece = vec![1u8; 70_001];
        while at < 5 * 1024 * 1024 {
            let end = at + piece.len() as u64;
            ahead.before_write(&zeroer, &file, end);
            file.write_all_at(&piece, at).unwrap();
            at = end;
        }
        drop(zeroer);
        // Wait until the lead asked for is done.
        {
            let mut done = ahead.progress.state.lock().unwrap();
            while done.upto < ahead.requested {
                done = ahead.progress.changed.wait(done).unwrap();
            }
            assert!(!done.failed);
        }
        let mut bytes = Vec::new();
        File::open(&path).unwrap().read_to_end(&mut bytes).unwrap();
        assert!(
            bytes[..at as usize].iter().all(|&b| b == 1),
            "a record was zeroed"
        );
        let tail = &bytes[at as usize..];
        assert!(tail.iter().all(|&b| b == 0));
        // The lead: at least half of LEAD past the last write, never past the limit.
        assert!(tail.len() as u64 >= LEAD / 2, "lead {}", tail.len());
        assert!(bytes.len() as u64 <= limit);
    }

    #[test]
    fn a_failed_zero_fill_lets_the_writer_go_on_and_zeroes_nothing_more() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("seg");
        std::fs::write(&path, b"").unwrap();
        // Read-only: every zero write fails.
        let file = File::open(&path).unwrap();
        let zeroer = Zeroer::start().unwrap();
        let mut ahead = Ahead::start(&zeroer, &file, 64 * 1024 * 1024);
        // Returns (does not wait forever) although nothing was zeroed.
        ahead.before_write(&zeroer, &file, 10);
        ahead.before_write(&zeroer, &file, 3 * 1024 * 1024);
        let done = ahead.progress.state.lock().unwrap();
        assert!(done.failed);
        assert_eq!(done.upto, 0);
        drop(done);
        assert_eq!(std::fs::metadata(&path).unwrap().len(), 0);
    }
}

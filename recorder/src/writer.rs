//! The recorder: a bounded queue in front of one writer task that group-commits records
//! into WAL segments, rotates them and seals closed ones in the background.
//!
//! Full-queue policy: `record()` waits for room (never drops a call). Durability:
//! - `Sync`: `record()` resolves after the batch holding the record was written and
//!   `sync_data`'d (one fsync per batch: group commit).
//! - `Async { max_delay }`: `record()` resolves once queued; the writer writes promptly
//!   and fsyncs once `max_delay` has passed since the oldest unsynced write, on rotation,
//!   on `flush`/`seal_now`/`shutdown`. A crash loses at most what was queued plus what was
//!   written in the last `max_delay`.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::fs::{File, OpenOptions};
use std::future::Future as _;
use std::os::unix::fs::FileExt;
use std::path::PathBuf;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use serde_json::Value;
use tokio::sync::{mpsc, oneshot, watch};
use tokio::task::JoinHandle;

use crate::delta::{self, RequestDelta};
use crate::error::{RecorderError, Result};
use crate::prealloc::{Ahead, Zeroer};
use crate::record::{CallRecord, Deltas, Requests, StoredRecord};
use crate::seal::{self, Manifest};
use crate::wal;
use crate::{Durability, RecorderConfig, RecoveryReport};

/// Most records written (and fsynced) as one group commit.
const MAX_BATCH: usize = 4096;
/// Earlier calls per session kept as delta bases; each new call is stored against the
/// one that gives the smallest delta (handles interleaved side calls, e.g. a title or
/// summary request between two turns of the main conversation).
const MAX_BASES: usize = 3;

type FsyncHook = Arc<dyn Fn(Duration, usize) + Send + Sync>;

enum Command {
    Record {
        rec: Box<CallRecord>,
        ack: Option<oneshot::Sender<Result<u64>>>,
    },
    Flush(oneshot::Sender<Result<()>>),
    SealNow(oneshot::Sender<Result<()>>),
    Shutdown(oneshot::Sender<Result<()>>),
    /// A deadline of the writer's (an async fsync, a seal, a seal to reap) may be due.
    Tick,
    /// Stop writing without sealing, as a crash after the last fsync would.
    #[cfg(test)]
    Halt(oneshot::Sender<()>),
}

#[derive(Default)]
struct SeqEntry {
    last: u64,
    assigned_in_run: bool,
}

#[derive(Default)]
struct SeqState {
    sessions: HashMap<String, SeqEntry>,
    /// session → last seq assigned when `forget_session` was called.
    forgets: HashMap<String, u64>,
}

struct Shared {
    tx: mpsc::Sender<Command>,
    seqs: Arc<Mutex<SeqState>>,
    durability: Durability,
}

/// Cheap, cloneable handle to the recorder.
#[derive(Clone)]
pub struct Recorder {
    shared: Arc<Shared>,
}

impl std::fmt::Debug for Recorder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Recorder")
            .field("durability", &self.shared.durability)
            .field("queue_depth", &self.queue_depth())
            .finish()
    }
}

impl Recorder {
    /// Recovers `cfg.dir` (torn WAL tails truncated, unsealed segments sealed) and starts
    /// the writer. Must be called inside a tokio runtime.
    pub async fn open(cfg: RecorderConfig) -> Result<(Recorder, RecoveryReport)> {
        let dir = cfg.dir.clone();
        let (report, next_segment) = tokio::task::spawn_blocking(move || seal::recover(&dir))
            .await
            .map_err(|e| RecorderError::Task {
                message: e.to_string(),
            })??;
        tracing::info!(
            dir = %cfg.dir.display(),
            recovered_records = report.recovered_records,
            torn_bytes_dropped = report.torn_bytes_dropped,
            sealed_segments = report.sealed_segments,
            sessions = report.sessions.len(),
            "recorder opened"
        );

        let seqs = SeqState {
            sessions: report
                .sessions
                .iter()
                .map(|(id, s)| {
                    (
                        id.clone(),
                        SeqEntry {
                            last: s.last_seq,
                            assigned_in_run: false,
                        },
                    )
                })
                .collect(),
            forgets: HashMap::new(),
        };
        let seqs = Arc::new(Mutex::new(seqs));
        let (tx, rx) = mpsc::channel(cfg.queue_capacity.max(1));
        let state = WalState {
            dir: cfg.dir.clone(),
            next_segment,
            current: None,
            unsynced_since: None,
            unsynced_records: 0,
            bases: HashMap::new(),
            base_order: BTreeMap::new(),
            base_clock: 0,
            max_base_sessions: cfg.max_base_sessions,
            on_fsync: cfg.on_fsync.clone(),
            segment_max_bytes: cfg.segment_max_bytes,
            zeroer: if cfg.preallocate {
                Zeroer::start()
                    .map_err(
                        |e| tracing::warn!(error = %e, "no WAL zero-filling thread; appending"),
                    )
                    .ok()
            } else {
                None
            },
        };
        let writer = Writer {
            dir: cfg.dir.clone(),
            durability: cfg.durability,
            seal_after: cfg.seal_after,
            seqs: seqs.clone(),
            state: Some(state),
            seals: Vec::new(),
            failed_seals: Vec::new(),
        };
        // The writer owns a thread: it writes and fsyncs in place, where a task would hand
        // every batch to the blocking pool and back (two thread wake-ups per batch, about a
        // twentieth of a call's CPU at full load). Its deadlines come from a ticker task.
        let (deadline_tx, deadline_rx) = watch::channel(None);
        tokio::spawn(ticker(tx.downgrade(), deadline_rx));
        let runtime = tokio::runtime::Handle::current();
        std::thread::Builder::new()
            .name("graft-recorder".to_owned())
            .spawn(move || runtime.block_on(writer.run(rx, deadline_tx)))
            .map_err(|e| RecorderError::Task {
                message: format!("cannot start the recorder's writer thread: {e}"),
            })?;
        let shared = Arc::new(Shared {
            tx,
            seqs,
            durability: cfg.durability,
        });
        Ok((Recorder { shared }, report))
    }

    /// Records one call and returns its assigned per-session `seq`. Waits while the queue
    /// is full. `Sync`: resolves once the record is in a fsynced WAL segment; `Async`:
    /// once it is queued.
    pub async fn record(&self, mut rec: CallRecord) -> Result<u64> {
        let permit = self
            .shared
            .tx
            .reserve()
            .await
            .map_err(|_| RecorderError::Closed {
                call_id: rec.call_id.clone(),
            })?;
        // Assign the seq and enqueue under one lock so that WAL order == seq order.
        let (seq, ack) = {
            let mut seqs = self
                .shared
                .seqs
                .lock()
                .unwrap_or_else(PoisonError::into_inner);
            let entry = match seqs.sessions.get_mut(&rec.session_id) {
                Some(e) => e,
                None => seqs.sessions.entry(rec.session_id.clone()).or_default(),
            };
            entry.last += 1;
            entry.assigned_in_run = true;
            rec.seq = entry.last;
            let seq = rec.seq;
            match self.shared.durability {
                Durability::Sync => {
                    let (tx, rx) = oneshot::channel();
                    permit.send(Command::Record {
                        rec: Box::new(rec),
                        ack: Some(tx),
                    });
                    (seq, Some(rx))
                }
                Durability::Async { .. } => {
                    permit.send(Command::Record {
                        rec: Box::new(rec),
                        ack: None,
                    });
                    (seq, None)
                }
            }
        };
        match ack {
            Some(rx) => rx.await.map_err(|_| RecorderError::WriterGone {
                what: format!("the write of seq {seq}"),
            })?,
            None => Ok(seq),
        }
    }

    /// Records (and control requests) queued and not yet taken by the writer.
    pub fn queue_depth(&self) -> usize {
        self.shared.tx.max_capacity() - self.shared.tx.capacity()
    }

    /// Waits until everything recorded before this call is written and fsynced (useful
    /// with `Async` durability).
    pub async fn flush(&self) -> Result<()> {
        self.control(Command::Flush, "a flush").await
    }

    /// Rotates the current segment and seals every closed segment into parquet; resolves
    /// when they are sealed.
    pub async fn seal_now(&self) -> Result<()> {
        self.control(Command::SealNow, "a seal").await
    }

    /// Flushes, fsyncs and seals everything, then stops the writer. Later `record()` calls
    /// fail with [`RecorderError::Closed`]. Calling it again is a no-op.
    pub async fn shutdown(&self) -> Result<()> {
        self.control(Command::Shutdown, "the shutdown").await
    }

    /// The session is closed: drop its in-memory delta bases once the calls already
    /// queued for it are written. A later call of the same session is stored whole.
    pub fn forget_session(&self, session_id: &str) {
        let mut seqs = self
            .shared
            .seqs
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        if let Some(last) = seqs
            .sessions
            .get(session_id)
            .filter(|e| e.assigned_in_run)
            .map(|e| e.last)
        {
            seqs.forgets.insert(session_id.to_owned(), last);
        }
    }

    async fn control(
        &self,
        make: fn(oneshot::Sender<Result<()>>) -> Command,
        what: &str,
    ) -> Result<()> {
        let (tx, rx) = oneshot::channel();
        if self.shared.tx.send(make(tx)).await.is_err() {
            // Writer already stopped after a shutdown: everything is flushed and sealed.
            return Ok(());
        }
        rx.await.map_err(|_| RecorderError::WriterGone {
            what: what.to_owned(),
        })?
    }

    /// Stops the writer without sealing (the WAL stays as a crash would leave it, minus
    /// the torn tail: everything acked is fsynced).
    #[cfg(test)]
    pub(crate) async fn halt(&self) {
        let (tx, rx) = oneshot::channel();
        if self.shared.tx.send(Command::Halt(tx)).await.is_ok() {
            let _ = rx.await;
        }
    }
}

struct OpenSegment {
    number: u64,
    path: PathBuf,
    file: File,
    bytes: u64,
    opened_at: Instant,
    /// The zero-filled lead (with `RecorderConfig::preallocate`).
    ahead: Option<Ahead>,
}

#[derive(Default)]
struct SessionBases {
    last_seq: u64,
    /// Most recent first: (call_id, its full request, normalized and upstream request, and
    /// token sequence).
    recent: VecDeque<(String, Requests)>,
    /// Its key in `WalState::base_order` while `recent` is not empty.
    touched: Option<u64>,
}

/// Everything the blocking side of the writer owns.
struct WalState {
    dir: PathBuf,
    next_segment: u64,
    current: Option<OpenSegment>,
    unsynced_since: Option<Instant>,
    unsynced_records: usize,
    bases: HashMap<String, SessionBases>,
    /// The sessions holding bases, least recently written first (write clock → session);
    /// at most `max_base_sessions`.
    base_order: BTreeMap<u64, String>,
    base_clock: u64,
    max_base_sessions: usize,
    on_fsync: Option<FsyncHook>,
    segment_max_bytes: u64,
    zeroer: Option<Zeroer>,
}

type Ack = Option<oneshot::Sender<Result<u64>>>;

impl WalState {
    fn open_segment(&mut self) -> Result<&mut OpenSegment> {
        if self.current.is_none() {
            let number = self.next_segment;
            let path = wal::segment_path(&self.dir, number);
            // Written at explicit offsets: the lead past the writer is zeros.
            let file = OpenOptions::new()
                .create_new(true)
                .write(true)
                .open(&path)
                .map_err(|e| RecorderError::io("creating WAL segment", &path, e))?;
            wal::fsync_dir(&wal::wal_dir(&self.dir))?;
            self.next_segment += 1;
            tracing::debug!(segment = number, "opened WAL segment");
            let ahead = self
                .zeroer
                .as_ref()
                .map(|z| Ahead::start(z, &file, self.segment_max_bytes));
            self.current = Some(OpenSegment {
                number,
                path,
                file,
                bytes: 0,
                opened_at: Instant::now(),
                ahead,
            });
        }
        self.current.as_mut().ok_or_else(|| RecorderError::Task {
            message: "WAL segment vanished after opening".to_owned(),
        })
    }

    /// Encodes each growing value against the base giving its smallest delta.
    fn encode(&self, rec: &CallRecord) -> Deltas {
        let recent = self.bases.get(&rec.session_id).map(|b| &b.recent);
        let bases = || recent.into_iter().flatten();
        Deltas {
            request: best_delta(
                &rec.request,
                bases().map(|(id, full)| (id.as_str(), Some(&full.request))),
            ),
            normalized_request: rec.normalized_request.as_ref().map(|v| {
                best_delta(
                    v,
                    bases().map(|(id, full)| (id.as_str(), full.normalized_request.as_ref())),
                )
            }),
            upstream_request: rec.upstream_request.as_ref().map(|v| {
                best_delta(
                    v,
                    bases().map(|(id, full)| (id.as_str(), full.upstream_request.as_ref())),
                )
            }),
            prompt_token_ids: rec.prompt_token_ids.as_deref().and_then(|ids| {
                delta::encode_ids(
                    ids,
                    bases().map(|(id, full)| (id.as_str(), full.token_ids.as_deref())),
                )
            }),
        }
    }

    fn fsync(&mut self) -> Result<()> {
        let Some(seg) = self.current.as_mut() else {
            return Ok(());
        };
        if self.unsynced_records == 0 && self.unsynced_since.is_none() {
            return Ok(());
        }
        let started = Instant::now();
        seg.file
            .sync_data()
            .map_err(|e| RecorderError::io("fsyncing WAL segment", &seg.path, e))?;
        let n = std::mem::take(&mut self.unsynced_records);
        self.unsynced_since = None;
        if let Some(hook) = &self.on_fsync {
            hook(started.elapsed(), n);
        }
        Ok(())
    }

    /// Writes one group of records; with `sync`, fsyncs once and acks them all.
    /// Returns segments closed on the way (to seal).
    fn write_batch(&mut self, items: Vec<(CallRecord, Ack)>, sync: bool) -> Vec<u64> {
        let mut buf = Vec::new();
        let mut written: Vec<(String, String, u64, Requests, Ack)> =
            Vec::with_capacity(items.len());
        for (rec, ack) in items {
            let rec = sanitize(rec);
            let deltas = self.encode(&rec);
            let (session, call_id, seq) = (rec.session_id.clone(), rec.call_id.clone(), rec.seq);
            let (stored, request) = StoredRecord::from_call(rec, deltas);
            // Serialized straight into the batch's buffer, then framed in place.
            let start = buf.len();
            match wal::frame_into(&mut buf, |out| serde_json::to_writer(out, &stored)) {
                Ok(Ok(())) => written.push((session, call_id, seq, request, ack)),
                Ok(Err(source)) => {
                    buf.truncate(start);
                    send(ack, Err(RecorderError::Encode { call_id, source }));
                }
                Err(size) => {
                    buf.truncate(start);
                    tracing::error!(
                        call_id,
                        size,
                        "call record too large for a WAL frame; not recorded"
                    );
                    send(
                        ack,
                        Err(RecorderError::WalWrite {
                            path: wal::wal_dir(&self.dir),
                            message: format!(
                                "record {call_id} is {size} bytes, over the 1 GiB frame limit"
                            ),
                        }),
                    );
                }
            }
        }
        if written.is_empty() {
            return Vec::new();
        }
        let n = written.len();
        let result = self.append(&buf, n, sync);
        let mut closed = Vec::new();
        match result {
            Ok(()) => {
                for (session, call_id, seq, request, ack) in written {
                    let b = self.bases.entry(session.clone()).or_default();
                    b.last_seq = seq;
                    b.recent.push_front((call_id, request));
                    b.recent.truncate(MAX_BASES);
                    self.base_clock += 1;
                    if let Some(old) = b.touched.replace(self.base_clock) {
                        self.base_order.remove(&old);
                    }
                    self.base_order.insert(self.base_clock, session);
                    send(ack, Ok(seq));
                }
                self.evict_bases();
                if self
                    .current
                    .as_ref()
                    .is_some_and(|s| s.bytes >= self.segment_max_bytes)
                {
                    closed.extend(self.rotate());
                }
            }
            Err(e) => {
                let path = self
                    .current
                    .as_ref()
                    .map(|s| s.path.clone())
                    .unwrap_or_default();
                tracing::error!(
                    error = %e,
                    path = %path.display(),
                    records = n,
                    "WAL write failed; these calls may be lost. Continuing in a fresh segment"
                );
                let message = e.to_string();
                for (session, _, seq, _, ack) in written {
                    // Later calls must not reference a call that may not be on disk.
                    let b = self.bases.entry(session).or_default();
                    b.last_seq = seq;
                    b.recent.clear();
                    if let Some(t) = b.touched.take() {
                        self.base_order.remove(&t);
                    }
                    send(
                        ack,
                        Err(RecorderError::WalWrite {
                            path: path.clone(),
                            message: message.clone(),
                        }),
                    );
                }
                if let Some(seg) = self.current.take() {
                    self.unsynced_since = None;
                    self.unsynced_records = 0;
                    closed.push(seg.number);
                }
            }
        }
        closed
    }

    fn append(&mut self, buf: &[u8], n: usize, sync: bool) -> Result<()> {
        self.open_segment()?;
        let WalState {
            current, zeroer, ..
        } = self;
        let seg = current.as_mut().ok_or_else(|| RecorderError::Task {
            message: "WAL segment vanished after opening".to_owned(),
        })?;
        let end = seg.bytes + buf.len() as u64;
        if let (Some(ahead), Some(z)) = (seg.ahead.as_mut(), zeroer.as_ref()) {
            ahead.before_write(z, &seg.file, end);
        }
        seg.file
            .write_all_at(buf, seg.bytes)
            .map_err(|e| RecorderError::io("appending to WAL segment", &seg.path, e))?;
        seg.bytes += buf.len() as u64;
        self.unsynced_records += n;
        self.unsynced_since.get_or_insert_with(Instant::now);
        if sync { self.fsync() } else { Ok(()) }
    }

    /// Fsyncs and closes the current segment; returns its number when it holds data.
    fn rotate(&mut self) -> Option<u64> {
        if let Err(e) = self.fsync() {
            tracing::error!(error = %e, "fsync before WAL rotation failed; recent calls may be lost");
        }
        let seg = self.current.take()?;
        self.unsynced_since = None;
        self.unsynced_records = 0;
        (seg.bytes > 0).then_some(seg.number)
    }

    fn apply_forgets(&mut self, seqs: &Mutex<SeqState>) {
        let mut seqs = seqs.lock().unwrap_or_else(PoisonError::into_inner);
        if seqs.forgets.is_empty() {
            return;
        }
        let (bases, order) = (&mut self.bases, &mut self.base_order);
        seqs.forgets
            .retain(|session, at| match bases.get_mut(session) {
                Some(b) if b.last_seq >= *at => {
                    b.recent.clear();
                    if let Some(t) = b.touched.take() {
                        order.remove(&t);
                    }
                    false
                }
                _ => true,
            });
    }

    /// Past `max_base_sessions`, the least recently written sessions lose their delta bases
    /// (their next call is stored whole, as after a forget). Returns how many did.
    fn evict_bases(&mut self) -> usize {
        let mut evicted = 0;
        while self.base_order.len() > self.max_base_sessions {
            let Some((_, session)) = self.base_order.pop_first() else {
                break;
            };
            if let Some(b) = self.bases.get_mut(&session) {
                b.recent.clear();
                b.touched = None;
            }
            evicted += 1;
        }
        if evicted > 0 {
            tracing::debug!(
                evicted,
                max = self.max_base_sessions,
                "recorder: delta bases of the least recently written sessions dropped; their next calls are stored whole"
            );
        }
        evicted
    }
}

/// `value` as a delta against whichever of `bases` (call_id, that call's value if it has
/// one) gives the smallest one, or whole when none is smaller.
fn best_delta<'a>(
    value: &Value,
    bases: impl Iterator<Item = (&'a str, Option<&'a Value>)>,
) -> RequestDelta {
    let mut best = None;
    let mut best_len = RequestDelta::full_stored_len(value);
    for (call_id, base) in bases {
        let Some(base) = base else { continue };
        let d = delta::encode(Some((call_id, base)), value);
        let len = d.stored_len();
        if len < best_len {
            best = Some(d);
            best_len = len;
        }
    }
    best.unwrap_or_else(|| delta::encode(None, value))
}

fn send<T>(ack: Option<oneshot::Sender<T>>, value: T) {
    if let Some(ack) = ack {
        // The caller may have gone away (e.g. its request was cancelled); the record is
        // written regardless.
        let _ = ack.send(value);
    }
}

/// JSON has no NaN or infinity: keep the record writable and readable.
fn sanitize(mut rec: CallRecord) -> CallRecord {
    if !rec.latency_ms.is_finite() {
        rec.latency_ms = 0.0;
    }
    rec.ttft_ms = rec.ttft_ms.filter(|t| t.is_finite());
    if let Some(lp) = rec.completion_logprobs.as_mut() {
        for x in lp.iter_mut() {
            match *x {
                // NaN says nothing: unknown.
                Some(v) if v.is_nan() => *x = None,
                // -inf (and +inf) logprobs are stored as the lowest finite f32.
                Some(v) if v.is_infinite() => *x = Some(f32::MIN),
                _ => {}
            }
        }
    }
    rec
}

struct Writer {
    dir: PathBuf,
    durability: Durability,
    seal_after: Duration,
    seqs: Arc<Mutex<SeqState>>,
    state: Option<WalState>,
    seals: Vec<(u64, JoinHandle<Result<Option<Manifest>>>)>,
    failed_seals: Vec<u64>,
}

enum Event {
    Commands(Vec<Command>),
    Closed,
}

/// Sends the writer a [`Command::Tick`] at each deadline it announces. It holds the queue
/// weakly, so the writer still sees the queue close once every `Recorder` is dropped; it
/// ends with the queue or the runtime.
async fn ticker(tx: mpsc::WeakSender<Command>, mut deadline: watch::Receiver<Option<Instant>>) {
    loop {
        let at = *deadline.borrow_and_update();
        let changed = match at {
            Some(at) => tokio::select! {
                _ = tokio::time::sleep_until(at.into()) => {
                    let Some(tx) = tx.upgrade() else { return };
                    if tx.send(Command::Tick).await.is_err() {
                        return;
                    }
                    // Until the writer announces a new deadline.
                    deadline.changed().await
                }
                c = deadline.changed() => c,
            },
            None => deadline.changed().await,
        };
        if changed.is_err() {
            return;
        }
    }
}

impl Writer {
    async fn run(
        mut self,
        mut rx: mpsc::Receiver<Command>,
        deadline: watch::Sender<Option<Instant>>,
    ) {
        loop {
            let event = match rx.recv().await {
                Some(first) => Event::Commands(drain(first, &mut rx)),
                None => Event::Closed,
            };
            let stop = match event {
                Event::Commands(cmds) => self.handle(cmds, &mut rx).await,
                Event::Closed => {
                    // Every handle is gone without a shutdown: make what we have durable.
                    self.blocking(|st| st.rotate()).await;
                    true
                }
            };
            if stop || self.state.is_none() {
                break;
            }
            self.on_timers().await;
            self.reap_seals();
            // Tell the ticker only about an earlier deadline: a later one it would wake for
            // early, and the next round sets it again (so a busy writer rarely wakes it).
            let next = self.deadline();
            deadline.send_if_modified(|at| match (*at, next) {
                (_, None) => false,
                (Some(cur), Some(n)) if cur <= n && cur > Instant::now() => false,
                (_, n) => {
                    *at = n;
                    true
                }
            });
        }
        tracing::debug!(dir = %self.dir.display(), "recorder writer stopped");
    }

    fn deadline(&self) -> Option<Instant> {
        let st = self.state.as_ref()?;
        let fsync_at = match self.durability {
            Durability::Async { max_delay } => st.unsynced_since.map(|t| t + max_delay),
            Durability::Sync => None,
        };
        let seal_at = st
            .current
            .as_ref()
            .filter(|s| s.bytes > 0)
            .map(|s| s.opened_at + self.seal_after);
        let reap_at = (!self.seals.is_empty()).then(|| Instant::now() + Duration::from_millis(200));
        [fsync_at, seal_at, reap_at].into_iter().flatten().min()
    }

    /// Runs `f` on the WAL state, on the writer's own thread. `None` if it panicked (the
    /// state is then lost and the writer stops).
    async fn blocking<R>(&mut self, f: impl FnOnce(&mut WalState) -> R) -> Option<R> {
        let st = self.state.as_mut()?;
        match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| f(st))) {
            Ok(r) => Some(r),
            Err(_) => {
                self.state = None;
                tracing::error!("recorder writer failed; no more calls will be recorded");
                None
            }
        }
    }

    async fn write(&mut self, pending: &mut Vec<(CallRecord, Ack)>) {
        if pending.is_empty() {
            return;
        }
        let items = std::mem::take(pending);
        let sync = self.durability == Durability::Sync;
        // Forgets that came in since the last batch apply before it is encoded (the call
        // after a forget is stored whole); those for calls still in this batch, after it.
        if let Some(st) = self.state.as_mut() {
            st.apply_forgets(&self.seqs);
        }
        if let Some(closed) = self.blocking(move |st| st.write_batch(items, sync)).await {
            self.spawn_seals(closed);
        }
        if let Some(st) = self.state.as_mut() {
            st.apply_forgets(&self.seqs);
        }
    }

    /// Returns true when the writer must stop.
    async fn handle(&mut self, cmds: Vec<Command>, rx: &mut mpsc::Receiver<Command>) -> bool {
        let mut pending = Vec::new();
        let mut cmds = cmds.into_iter();
        while let Some(cmd) = cmds.next() {
            match cmd {
                Command::Record { rec, ack } => pending.push((*rec, ack)),
                // Deadlines are checked after every round.
                Command::Tick => {}
                Command::Flush(ack) => {
                    self.write(&mut pending).await;
                    let r = self.blocking(|st| st.fsync()).await;
                    let _ = ack.send(r.unwrap_or_else(|| Err(gone("flush"))));
                }
                Command::SealNow(ack) => {
                    self.write(&mut pending).await;
                    let r = self.seal_all().await;
                    let _ = ack.send(r);
                }
                Command::Shutdown(ack) => {
                    self.write(&mut pending).await;
                    let r = self.seal_all().await;
                    if let Err(e) = &r {
                        tracing::warn!(error = %e, "sealing at shutdown failed; the WAL will be sealed on next open");
                    }
                    let _ = ack.send(r);
                    rx.close();
                    reject_rest(cmds.chain(std::iter::from_fn(|| rx.try_recv().ok())));
                    tracing::info!(dir = %self.dir.display(), "recorder shut down");
                    return true;
                }
                #[cfg(test)]
                Command::Halt(ack) => {
                    self.write(&mut pending).await;
                    self.blocking(|st| st.fsync()).await;
                    let _ = ack.send(());
                    rx.close();
                    return true;
                }
            }
        }
        self.write(&mut pending).await;
        false
    }

    async fn on_timers(&mut self) {
        let Some(st) = self.state.as_ref() else {
            return;
        };
        let now = Instant::now();
        let fsync_due = match self.durability {
            Durability::Async { max_delay } => {
                st.unsynced_since.is_some_and(|t| now >= t + max_delay)
            }
            Durability::Sync => false,
        };
        let seal_due = st
            .current
            .as_ref()
            .is_some_and(|s| s.bytes > 0 && now >= s.opened_at + self.seal_after);
        if seal_due {
            if let Some(closed) = self.blocking(|st| st.rotate()).await {
                self.spawn_seals(closed.into_iter().collect());
            }
        } else if fsync_due && let Some(Err(e)) = self.blocking(|st| st.fsync()).await {
            tracing::error!(error = %e, "WAL fsync failed; calls written since the last fsync may be lost");
        }
    }

    /// Seals `segments` in the background, retrying earlier failures too.
    fn spawn_seals(&mut self, segments: Vec<u64>) {
        let retry = std::mem::take(&mut self.failed_seals);
        for segment in retry.into_iter().chain(segments) {
            let dir = self.dir.clone();
            let handle = tokio::task::spawn_blocking(move || seal::seal_segment(&dir, segment));
            self.seals.push((segment, handle));
        }
    }

    /// Logs finished background seals; failed ones are retried at the next seal.
    fn reap_seals(&mut self) {
        let (done, running): (Vec<_>, Vec<_>) =
            self.seals.drain(..).partition(|(_, h)| h.is_finished());
        self.seals = running;
        for (segment, handle) in done {
            // Finished, so this does not block for long; poll it with a no-op waker.
            let mut handle = handle;
            let waker = std::task::Waker::noop();
            let mut cx = std::task::Context::from_waker(waker);
            if let std::task::Poll::Ready(r) = std::pin::Pin::new(&mut handle).poll(&mut cx) {
                self.note_seal(segment, r);
            } else {
                self.seals.push((segment, handle));
            }
        }
    }

    fn note_seal(
        &mut self,
        segment: u64,
        r: std::result::Result<Result<Option<Manifest>>, tokio::task::JoinError>,
    ) -> Option<RecorderError> {
        let err = match r {
            Ok(Ok(_)) => return None,
            Ok(Err(e)) => e,
            Err(e) => RecorderError::Task {
                message: e.to_string(),
            },
        };
        tracing::warn!(segment, error = %err, "sealing WAL segment failed; it stays in the WAL and is retried");
        self.failed_seals.push(segment);
        Some(RecorderError::Seal {
            segment,
            message: err.to_string(),
        })
    }

    /// Rotates, seals every closed segment (retrying failed ones) and waits for all seals.
    async fn seal_all(&mut self) -> Result<()> {
        let closed = self
            .blocking(|st| st.rotate())
            .await
            .ok_or_else(|| gone("seal"))?;
        self.spawn_seals(closed.into_iter().collect());
        let mut first_err = None;
        for (segment, handle) in std::mem::take(&mut self.seals) {
            let r = handle.await;
            if let Some(e) = self.note_seal(segment, r) {
                first_err.get_or_insert(e);
            }
        }
        first_err.map_or(Ok(()), Err)
    }
}

fn gone(what: &str) -> RecorderError {
    RecorderError::WriterGone {
        what: what.to_owned(),
    }
}

fn drain(first: Command, rx: &mut mpsc::Receiver<Command>) -> Vec<Command> {
    let mut out = vec![first];
    while out.len() < MAX_BATCH {
        match rx.try_recv() {
            Ok(c) => out.push(c),
            Err(_) => break,
        }
    }
    out
}

fn reject_rest(rest: impl Iterator<Item = Command>) {
    for cmd in rest {
        match cmd {
            Command::Record { rec, ack } => send(
                ack,
                Err(RecorderError::Closed {
                    call_id: rec.call_id,
                }),
            ),
            Command::Flush(ack) | Command::SealNow(ack) | Command::Shutdown(ack) => {
                let _ = ack.send(Ok(()));
            }
            Command::Tick => {}
            #[cfg(test)]
            Command::Halt(ack) => {
                let _ = ack.send(());
            }
        }
    }
}

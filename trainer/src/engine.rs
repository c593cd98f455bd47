//! The generation engine behind `graft serve`: one thread owns the model; requests from
//! any thread join the running batch between decode steps (continuous batching: new
//! requests are prefilled as a left-padded batch and merged, finished ones leave), and
//! each streams its tokens back over a channel.
//!
//! Control follows SGLang: pause with `abort` (in-flight requests end, aborted), `retract`
//! (they go back to the queue keeping what they generated, and are recomputed on
//! continue) or `in_place` (they stay, with their cache); continue; reload weights from an
//! HF directory (running requests are retracted first, so no request mixes caches of two
//! weight versions); or take new weights as tensors from a trainer in the same process
//! ([`Engine::update_weights_from_tensors`]: a copy into the served model's own tensors on
//! its device, no file); flush (there is no prefix cache; it refuses while requests are
//! held in place, as SGLang does).

use std::collections::VecDeque;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, Sender};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use tch::{Kind, Tensor};

use crate::error::{Result, TrainerError};
use crate::generate::{SamplingParams, sample_row};
use crate::model::{KvCache, Model};

pub type RequestId = u64;

/// One generation request.
#[derive(Debug, Clone, PartialEq)]
pub struct Request {
    pub input_ids: Vec<i64>,
    pub params: SamplingParams,
    /// Do not stop at the model's end-of-sequence tokens.
    pub ignore_eos: bool,
}

/// How a request ended.
#[derive(Debug, Clone, PartialEq)]
pub enum EngineFinish {
    /// Sampled a stop token or an end-of-sequence token (`matched`).
    Stop {
        matched: i64,
    },
    Length,
    Abort(String),
}

/// What a request's channel carries: tokens as they are sampled, then one `Done`.
#[derive(Debug, Clone, PartialEq)]
pub enum Event {
    Token {
        id: i64,
        logprob: f32,
        /// The weights that sampled it: a request that runs across a weight update has
        /// tokens of both versions (the update does not wait for it to end).
        weight_version: String,
    },
    Done {
        finish: EngineFinish,
        prompt_tokens: usize,
        completion_tokens: usize,
        weight_version: String,
    },
}

/// How [`Engine::pause`] treats requests in flight.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PauseMode {
    Abort,
    Retract,
    InPlace,
}

/// The engine's state, for `/get_model_info` and tests.
#[derive(Debug, Clone, PartialEq)]
pub struct EngineInfo {
    pub weight_version: String,
    pub running: usize,
    pub waiting: usize,
    pub paused: bool,
    /// The largest batch decoded together so far.
    pub max_batch_seen: usize,
    pub config: serde_json::Value,
    /// Where the engine's steps spent their time so far.
    pub timing: StepTiming,
}

/// Where the engine's steps spend their time since it started, decode steps and prefill
/// steps apart. On a GPU the phases are host times (kernels run asynchronously) unless
/// `GRAFT_ENGINE_SYNC_TIMING=1`, which synchronizes the device at each phase's end so the
/// split is the device's too.
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize)]
pub struct StepTiming {
    /// Steps where every running row gets one token.
    pub decode: Phases,
    /// Steps where newcomers are prefilled and join (each gets its first token).
    pub prefill: Phases,
}

/// Time per phase, summed over steps of one kind (seconds).
#[derive(Debug, Clone, Copy, Default, PartialEq, serde::Serialize)]
pub struct Phases {
    pub steps: u64,
    /// Rows that got a token, summed over the steps (mean batch = rows / steps).
    pub rows: u64,
    /// The model's forward pass, the lm_head included.
    pub forward_s: f64,
    /// Choosing the next tokens from the logits (bias, temperature, truncation, the draw,
    /// the logprobs).
    pub sample_s: f64,
    /// Moving ids in and the sampled ids and logprobs (or logits) out.
    pub transfer_s: f64,
    /// Newcomers joining the running batch (their cache, the merge).
    pub join_s: f64,
    /// Finished rows leaving (their cache dropped, the batch compacted).
    pub leave_s: f64,
    /// The rest: per-row bookkeeping, events sent, stop checks.
    pub bookkeeping_s: f64,
    /// The steps' wall time.
    pub wall_s: f64,
}

impl Phases {
    fn add(&mut self, o: &Phases) {
        self.steps += o.steps;
        self.rows += o.rows;
        self.forward_s += o.forward_s;
        self.sample_s += o.sample_s;
        self.transfer_s += o.transfer_s;
        self.join_s += o.join_s;
        self.leave_s += o.leave_s;
        self.bookkeeping_s += o.bookkeeping_s;
        self.wall_s += o.wall_s;
    }

    /// `self - before`, phase by phase.
    pub fn since(&self, before: &Phases) -> Phases {
        Phases {
            steps: self.steps - before.steps,
            rows: self.rows - before.rows,
            forward_s: self.forward_s - before.forward_s,
            sample_s: self.sample_s - before.sample_s,
            transfer_s: self.transfer_s - before.transfer_s,
            join_s: self.join_s - before.join_s,
            leave_s: self.leave_s - before.leave_s,
            bookkeeping_s: self.bookkeeping_s - before.bookkeeping_s,
            wall_s: self.wall_s - before.wall_s,
        }
    }
}

enum Cmd {
    Generate {
        id: RequestId,
        req: Request,
        events: Sender<Event>,
    },
    Abort {
        id: RequestId,
    },
    Pause {
        mode: PauseMode,
        reply: Sender<()>,
    },
    Continue {
        reply: Sender<()>,
    },
    Update {
        dir: PathBuf,
        version: String,
        reply: Sender<Result<(), String>>,
    },
    UpdateTensors {
        params: Vec<(String, Tensor)>,
        version: String,
        reply: Sender<Result<(), String>>,
    },
    Flush {
        reply: Sender<Result<(), String>>,
    },
    Info {
        reply: Sender<EngineInfo>,
    },
    Shutdown,
}

/// Handle to the engine thread. Dropping it stops the thread.
pub struct Engine {
    tx: Sender<Cmd>,
    next_id: AtomicU64,
    thread: Option<JoinHandle<()>>,
}

impl std::fmt::Debug for Engine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Engine").finish_non_exhaustive()
    }
}

fn gone() -> TrainerError {
    TrainerError::invalid("the generation engine has stopped (see the log for why)")
}

impl Engine {
    /// Starts the engine thread with `model`, serving it as `weight_version`, decoding at
    /// most `max_batch` requests together.
    pub fn start(mut model: Model, weight_version: String, max_batch: usize) -> Result<Engine> {
        tch::no_grad(|| model.fuse_projections())?;
        let (tx, rx) = mpsc::channel();
        let eos = eos_ids(model.raw_config());
        let mut state = State {
            model,
            version: weight_version,
            max_batch: max_batch.max(1),
            eos,
            waiting: VecDeque::new(),
            batch: Batch::default(),
            paused: false,
            max_batch_seen: 0,
            timing: StepTiming::default(),
            sync_timing: std::env::var("GRAFT_ENGINE_SYNC_TIMING").is_ok_and(|v| v == "1"),
        };
        let thread = std::thread::Builder::new()
            .name("graft-engine".to_owned())
            .spawn(move || state.run(rx))
            .map_err(|e| TrainerError::invalid(format!("cannot start the engine thread: {e}")))?;
        Ok(Engine {
            tx,
            next_id: AtomicU64::new(1),
            thread: Some(thread),
        })
    }

    /// Queues a request; its tokens and end arrive on the returned channel.
    pub fn generate(&self, req: Request) -> Result<(RequestId, Receiver<Event>)> {
        if req.input_ids.is_empty() {
            return Err(TrainerError::invalid(
                "a request needs at least one input id",
            ));
        }
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let (events, rx) = mpsc::channel();
        self.tx
            .send(Cmd::Generate { id, req, events })
            .map_err(|_| gone())?;
        Ok((id, rx))
    }

    /// Ends a request (it gets `Done` with `Abort`).
    pub fn abort(&self, id: RequestId) -> Result<()> {
        self.tx.send(Cmd::Abort { id }).map_err(|_| gone())
    }

    fn ask<T>(&self, make: impl FnOnce(Sender<T>) -> Cmd) -> Result<T> {
        let (reply, rx) = mpsc::channel();
        self.tx.send(make(reply)).map_err(|_| gone())?;
        rx.recv().map_err(|_| gone())
    }

    pub fn pause(&self, mode: PauseMode) -> Result<()> {
        self.ask(|reply| Cmd::Pause { mode, reply })
    }

    pub fn resume(&self) -> Result<()> {
        self.ask(|reply| Cmd::Continue { reply })
    }

    /// Loads new weights from an HF directory (same architecture) and serves them as
    /// `version`.
    pub fn update_weights(&self, dir: PathBuf, version: String) -> Result<()> {
        self.ask(|reply| Cmd::Update {
            dir,
            version,
            reply,
        })?
        .map_err(TrainerError::Invalid)
    }

    /// Copies `params` (HF names and shapes of the served model; a trainer's parameters)
    /// into the served model between two decode steps and serves them as `version`. The
    /// running requests are retracted first, as for an update from disk. Returns once the
    /// copy is done, so the caller may change `params` afterwards.
    pub fn update_weights_from_tensors(
        &self,
        params: Vec<(String, Tensor)>,
        version: String,
    ) -> Result<()> {
        self.ask(|reply| Cmd::UpdateTensors {
            params,
            version,
            reply,
        })?
        .map_err(TrainerError::Invalid)
    }

    pub fn flush_cache(&self) -> Result<()> {
        self.ask(|reply| Cmd::Flush { reply })?
            .map_err(TrainerError::Invalid)
    }

    pub fn info(&self) -> Result<EngineInfo> {
        self.ask(|reply| Cmd::Info { reply })
    }
}

impl Drop for Engine {
    fn drop(&mut self) {
        let _ = self.tx.send(Cmd::Shutdown);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// `eos_token_id` of a config: a number or a list.
fn eos_ids(config: &serde_json::Value) -> Vec<i64> {
    match config.get("eos_token_id") {
        Some(serde_json::Value::Number(n)) => n.as_i64().into_iter().collect(),
        Some(serde_json::Value::Array(a)) => a.iter().filter_map(|v| v.as_i64()).collect(),
        _ => Vec::new(),
    }
}

struct Seq {
    id: RequestId,
    prompt: Vec<i64>,
    out: Vec<i64>,
    req: Request,
    events: Sender<Event>,
}

/// The running batch: rows, their left padding in the cache, the token each feeds next.
#[derive(Default)]
struct Batch {
    rows: Vec<Seq>,
    cache: KvCache,
    pad: Vec<i64>,
}

struct State {
    model: Model,
    version: String,
    max_batch: usize,
    eos: Vec<i64>,
    waiting: VecDeque<Seq>,
    batch: Batch,
    paused: bool,
    max_batch_seen: usize,
    timing: StepTiming,
    sync_timing: bool,
}

impl State {
    fn run(&mut self, rx: Receiver<Cmd>) {
        loop {
            let idle = self.paused || (self.batch.rows.is_empty() && self.waiting.is_empty());
            let first = if idle {
                match rx.recv() {
                    Ok(c) => Some(c),
                    Err(_) => return,
                }
            } else {
                match rx.recv_timeout(Duration::ZERO) {
                    Ok(c) => Some(c),
                    Err(RecvTimeoutError::Timeout) => None,
                    Err(RecvTimeoutError::Disconnected) => return,
                }
            };
            let mut next = first;
            while let Some(cmd) = next {
                if !self.handle(cmd) {
                    self.abort_all("the engine is shutting down");
                    return;
                }
                next = rx.try_recv().ok();
            }
            if self.paused || (self.batch.rows.is_empty() && self.waiting.is_empty()) {
                continue;
            }
            if let Err(e) = tch::no_grad(|| self.step()) {
                tracing::error!(error = %e, "engine: a generation step failed; its requests are aborted");
                self.abort_all(&format!("generation failed: {e}"));
            }
        }
    }

    /// Returns false on shutdown.
    fn handle(&mut self, cmd: Cmd) -> bool {
        match cmd {
            Cmd::Generate { id, req, events } => {
                let s = Seq {
                    id,
                    prompt: req.input_ids.clone(),
                    out: Vec::new(),
                    req,
                    events,
                };
                if s.req.params.max_new_tokens == 0 {
                    self.finish(&s, EngineFinish::Length);
                } else {
                    self.waiting.push_back(s);
                }
            }
            Cmd::Abort { id } => {
                if let Some(i) = self.waiting.iter().position(|s| s.id == id)
                    && let Some(s) = self.waiting.remove(i)
                {
                    self.finish(&s, EngineFinish::Abort("aborted by request".to_owned()));
                }
                if let Some(i) = self.batch.rows.iter().position(|s| s.id == id) {
                    let keep: Vec<usize> = (0..self.batch.rows.len()).filter(|&j| j != i).collect();
                    let s = &self.batch.rows[i];
                    self.finish(s, EngineFinish::Abort("aborted by request".to_owned()));
                    if let Err(e) = self.keep_rows(&keep) {
                        self.abort_all(&format!("generation failed: {e}"));
                    }
                }
            }
            Cmd::Pause { mode, reply } => {
                match mode {
                    PauseMode::Abort => self.abort_all("generation was paused with mode 'abort'"),
                    PauseMode::Retract => self.retract(),
                    PauseMode::InPlace => {}
                }
                self.paused = true;
                let _ = reply.send(());
            }
            Cmd::Continue { reply } => {
                self.paused = false;
                let _ = reply.send(());
            }
            Cmd::Update {
                dir,
                version,
                reply,
            } => {
                let loaded = Model::load(&dir, self.model.device(), self.model.kind())
                    .and_then(|mut m| tch::no_grad(|| m.fuse_projections()).map(|()| m));
                let r = match loaded {
                    Ok(m) if m.spec() == self.model.spec() => {
                        self.retract();
                        self.model = m;
                        tracing::info!(version = %version, dir = %dir.display(), "engine: weights updated");
                        self.version = version;
                        Ok(())
                    }
                    Ok(m) => Err(format!(
                        "'{}' holds a different architecture ({:?}) than the one served ({:?})",
                        dir.display(),
                        m.spec(),
                        self.model.spec()
                    )),
                    Err(e) => Err(e.to_string()),
                };
                let _ = reply.send(r);
            }
            Cmd::UpdateTensors {
                params,
                version,
                reply,
            } => {
                self.retract();
                let r = self
                    .model
                    .copy_params_from(&params)
                    .map_err(|e| e.to_string());
                if r.is_ok() {
                    tracing::info!(version = %version, "engine: weights updated from tensors");
                    self.version = version;
                }
                let _ = reply.send(r);
            }
            Cmd::Flush { reply } => {
                let r = if self.paused && !self.batch.rows.is_empty() {
                    Err("requests are held in place (paused with mode 'in_place'); pause with mode 'retract' before flushing".to_owned())
                } else {
                    Ok(())
                };
                let _ = reply.send(r);
            }
            Cmd::Info { reply } => {
                let _ = reply.send(EngineInfo {
                    weight_version: self.version.clone(),
                    running: self.batch.rows.len(),
                    waiting: self.waiting.len(),
                    paused: self.paused,
                    max_batch_seen: self.max_batch_seen,
                    config: self.model.raw_config().clone(),
                    timing: self.timing.clone(),
                });
            }
            Cmd::Shutdown => return false,
        }
        true
    }

    fn finish(&self, s: &Seq, finish: EngineFinish) {
        let _ = s.events.send(Event::Done {
            finish,
            prompt_tokens: s.prompt.len(),
            completion_tokens: s.out.len(),
            weight_version: self.version.clone(),
        });
    }

    fn abort_all(&mut self, why: &str) {
        let batch = std::mem::take(&mut self.batch);
        for s in batch.rows.iter().chain(self.waiting.iter()) {
            self.finish(s, EngineFinish::Abort(why.to_owned()));
        }
        self.waiting.clear();
    }

    /// Running requests go back to the front of the queue, keeping their tokens; their
    /// cache is dropped (recomputed when they run again).
    fn retract(&mut self) {
        let batch = std::mem::take(&mut self.batch);
        for s in batch.rows.into_iter().rev() {
            self.waiting.push_front(s);
        }
    }

    /// Keeps only these rows of the running batch and drops padding they all share.
    fn keep_rows(&mut self, keep: &[usize]) -> Result<()> {
        if keep.len() == self.batch.rows.len() {
            return Ok(());
        }
        let rows = std::mem::take(&mut self.batch.rows);
        let mut kept = Vec::with_capacity(keep.len());
        for (i, s) in rows.into_iter().enumerate() {
            if keep.contains(&i) {
                kept.push(s);
            }
        }
        if kept.is_empty() {
            self.batch = Batch::default();
            return Ok(());
        }
        let idx: Vec<i64> = keep.iter().map(|&i| i as i64).collect();
        let mut pad: Vec<i64> = keep.iter().map(|&i| self.batch.pad[i]).collect();
        let mut cache = self.batch.cache.select_rows(&idx)?;
        let shared = pad.iter().copied().min().unwrap_or(0);
        if shared > 0 {
            cache = cache.trim_left(shared)?;
            pad.iter_mut().for_each(|p| *p -= shared);
        }
        self.batch = Batch {
            rows: kept,
            cache,
            pad,
        };
        Ok(())
    }

    /// One step: prefill newcomers (and merge them in) if any, else decode every row.
    fn step(&mut self) -> Result<()> {
        let mut clock = Clock::start(self.sync_timing, self.model.device());
        let started = clock.at;
        let mut ph = Phases::default();
        let room = self.max_batch.saturating_sub(self.batch.rows.len());
        let newcomers: Vec<Seq> = (0..room.min(self.waiting.len()))
            .filter_map(|_| self.waiting.pop_front())
            .collect();
        let device = self.model.device();
        let is_prefill = !newcomers.is_empty();
        let joining = newcomers.len();
        let rows_before = self.batch.rows.len();
        let (logits, first_new) = if is_prefill {
            let seqs: Vec<Vec<i64>> = newcomers
                .iter()
                .map(|s| s.prompt.iter().chain(&s.out).copied().collect())
                .collect();
            let longest = seqs.iter().map(Vec::len).max().unwrap_or(0);
            let pad: Vec<i64> = seqs.iter().map(|s| (longest - s.len()) as i64).collect();
            let mut flat = Vec::with_capacity(seqs.len() * longest);
            for (s, &p) in seqs.iter().zip(&pad) {
                flat.extend(std::iter::repeat_n(0i64, p as usize));
                flat.extend(s);
            }
            let ids = Tensor::from_slice(&flat)
                .f_reshape([seqs.len() as i64, longest as i64])?
                .f_to_device(device)?;
            let mut cache = KvCache::new();
            let hidden = self
                .model
                .forward_hidden_padded(&ids, &pad, Some(&mut cache))?;
            let logits = self.model.logits(&hidden.f_select(1, -1)?)?;
            clock.lap(&mut ph.forward_s);
            // Merge: pad the shorter cache on the left so both have the same length.
            let old_len = self.batch.cache.len();
            let new_len = cache.len();
            let len = old_len.max(new_len);
            let old_rows = self.batch.rows.len();
            let old = if old_rows > 0 {
                self.batch.cache.left_padded(len - old_len)?
            } else {
                KvCache::new()
            };
            let new = cache.left_padded(len - new_len)?;
            let mut all_pad: Vec<i64> = self.batch.pad.iter().map(|p| p + len - old_len).collect();
            all_pad.extend(pad.iter().map(|p| p + len - new_len));
            self.batch.cache = KvCache::concat_rows(&old, &new)?;
            self.batch.pad = all_pad;
            self.batch.rows.extend(newcomers);
            clock.lap(&mut ph.join_s);
            (logits, old_rows)
        } else {
            let last: Vec<i64> = self
                .batch
                .rows
                .iter()
                .map(|s| s.out.last().copied().unwrap_or(0))
                .collect();
            let ids = Tensor::from_slice(&last)
                .f_reshape([last.len() as i64, 1])?
                .f_to_device(device)?;
            let pad = self.batch.pad.clone();
            let hidden =
                self.model
                    .forward_hidden_padded(&ids, &pad, Some(&mut self.batch.cache))?;
            self.max_batch_seen = self.max_batch_seen.max(self.batch.rows.len());
            let logits = self.model.logits(&hidden.f_select(1, -1)?)?;
            clock.lap(&mut ph.forward_s);
            (logits, 0)
        };
        let logits = logits
            .f_to_kind(Kind::Float)?
            .f_to_device(tch::Device::Cpu)?;
        clock.lap(&mut ph.transfer_s);
        let mut sampling = 0.0;
        let mut keep = Vec::with_capacity(self.batch.rows.len());
        for i in 0..self.batch.rows.len() {
            if i < first_new {
                keep.push(i);
                continue;
            }
            let row = logits.f_get((i - first_new) as i64)?;
            let s = &self.batch.rows[i];
            let t = Instant::now();
            let (id, logprob) = sample_row(&row, &s.req.params)?;
            sampling += t.elapsed().as_secs_f64();
            let s = &mut self.batch.rows[i];
            s.out.push(id);
            let alive = s
                .events
                .send(Event::Token {
                    id,
                    logprob,
                    weight_version: self.version.clone(),
                })
                .is_ok();
            let stop = s.req.params.stop_token_ids.contains(&id)
                || (!s.req.ignore_eos && self.eos.contains(&id));
            let s = &self.batch.rows[i];
            if !alive {
                continue;
            }
            if stop {
                self.finish(s, EngineFinish::Stop { matched: id });
            } else if s.out.len() >= s.req.params.max_new_tokens {
                self.finish(s, EngineFinish::Length);
            } else {
                keep.push(i);
            }
        }
        ph.sample_s += sampling;
        clock.lap(&mut ph.bookkeeping_s);
        ph.bookkeeping_s -= sampling;
        self.keep_rows(&keep)?;
        clock.lap(&mut ph.leave_s);
        ph.steps = 1;
        ph.wall_s = started.elapsed().as_secs_f64();
        if is_prefill {
            ph.rows = joining as u64;
            self.timing.prefill.add(&ph);
        } else {
            ph.rows = rows_before as u64;
            self.timing.decode.add(&ph);
        }
        Ok(())
    }
}

/// Times the phases of a step: [`Clock::lap`] adds the time since the last lap to a
/// phase (synchronizing a CUDA device first when asked, so queued kernels count).
struct Clock {
    sync: Option<i64>,
    at: Instant,
}

impl Clock {
    fn start(sync: bool, device: tch::Device) -> Clock {
        let sync = match device {
            tch::Device::Cuda(i) if sync => Some(i as i64),
            _ => None,
        };
        Clock {
            sync,
            at: Instant::now(),
        }
    }

    fn lap(&mut self, phase: &mut f64) {
        if let Some(i) = self.sync {
            tch::Cuda::synchronize(i);
        }
        let now = Instant::now();
        *phase += (now - self.at).as_secs_f64();
        self.at = now;
    }
}

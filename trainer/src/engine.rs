//! The generation engine behind `graft serve`: one thread owns the model; requests from
//! any thread join the running batch between decode steps (continuous batching:
//! newcomers are prefilled together into free cache slots, finished rows leave; see
//! [`crate::batch`]), every row is sampled in one batched pass on the model's device
//! ([`crate::sampler`]), and each request streams its tokens back over a channel.
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
use std::time::Duration;

use tch::Tensor;

pub use crate::batch::Phases;
use crate::batch::{Clock, Entry, Running};
use crate::error::{Result, TrainerError};
use crate::generate::SamplingParams;
use crate::model::Model;

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
        let batch = Running::new(&model);
        let mut state = State {
            model,
            version: weight_version,
            max_batch: max_batch.max(1),
            eos,
            waiting: VecDeque::new(),
            batch,
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

/// What the engine keeps of a request besides its tokens.
struct Tag {
    id: RequestId,
    ignore_eos: bool,
    events: Sender<Event>,
}

type Seq = Entry<Tag>;

struct State {
    model: Model,
    version: String,
    max_batch: usize,
    eos: Vec<i64>,
    waiting: VecDeque<Seq>,
    batch: Running<Tag>,
    paused: bool,
    max_batch_seen: usize,
    timing: StepTiming,
    sync_timing: bool,
}

impl State {
    fn run(&mut self, rx: Receiver<Cmd>) {
        loop {
            let idle = self.paused || (self.batch.is_empty() && self.waiting.is_empty());
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
            if self.paused || (self.batch.is_empty() && self.waiting.is_empty()) {
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
                    prompt: req.input_ids,
                    out: Vec::new(),
                    params: req.params,
                    tag: Tag {
                        id,
                        ignore_eos: req.ignore_eos,
                        events,
                    },
                };
                if s.params.max_new_tokens == 0 {
                    self.finish(&s, EngineFinish::Length);
                } else {
                    self.waiting.push_back(s);
                }
            }
            Cmd::Abort { id } => {
                let why = || EngineFinish::Abort("aborted by request".to_owned());
                if let Some(i) = self.waiting.iter().position(|s| s.tag.id == id)
                    && let Some(s) = self.waiting.remove(i)
                {
                    self.finish(&s, why());
                }
                let keep: Vec<bool> = self.batch.rows().iter().map(|s| s.tag.id != id).collect();
                match self.batch.retain(&keep) {
                    Ok(gone) => gone.iter().for_each(|s| self.finish(s, why())),
                    Err(e) => self.abort_all(&format!("generation failed: {e}")),
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
                let r = if self.paused && !self.batch.is_empty() {
                    Err("requests are held in place (paused with mode 'in_place'); pause with mode 'retract' before flushing".to_owned())
                } else {
                    Ok(())
                };
                let _ = reply.send(r);
            }
            Cmd::Info { reply } => {
                let _ = reply.send(EngineInfo {
                    weight_version: self.version.clone(),
                    running: self.batch.len(),
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
        let _ = s.tag.events.send(Event::Done {
            finish,
            prompt_tokens: s.prompt.len(),
            completion_tokens: s.out.len(),
            weight_version: self.version.clone(),
        });
    }

    fn abort_all(&mut self, why: &str) {
        let running = self.batch.clear();
        for s in running.iter().chain(self.waiting.iter()) {
            self.finish(s, EngineFinish::Abort(why.to_owned()));
        }
        self.waiting.clear();
    }

    /// Running requests go back to the front of the queue, keeping their tokens; their
    /// cache is dropped (recomputed when they run again).
    fn retract(&mut self) {
        for s in self.batch.clear().into_iter().rev() {
            self.waiting.push_front(s);
        }
    }

    /// One step: prefill newcomers (they join the batch with their first token) if any,
    /// else decode every row; then rows that stopped leave.
    fn step(&mut self) -> Result<()> {
        let mut clock = Clock::start(self.sync_timing, self.model.device());
        let room = self.max_batch.saturating_sub(self.batch.len());
        let newcomers: Vec<Seq> = (0..room.min(self.waiting.len()))
            .filter_map(|_| self.waiting.pop_front())
            .collect();
        let prefill = !newcomers.is_empty();
        let first = if prefill { self.batch.len() } else { 0 };
        let drawn = if prefill {
            self.batch.admit(&self.model, newcomers, &mut clock)?
        } else {
            self.max_batch_seen = self.max_batch_seen.max(self.batch.len());
            self.batch.decode(&self.model, &mut clock)?
        };
        let mut keep = vec![true; self.batch.len()];
        let mut ends = Vec::new();
        for (k, &(id, logprob)) in drawn.iter().enumerate() {
            let i = first + k;
            let s = &self.batch.rows()[i];
            let alive = s
                .tag
                .events
                .send(Event::Token {
                    id,
                    logprob,
                    weight_version: self.version.clone(),
                })
                .is_ok();
            let end = if !alive {
                Some(None)
            } else if s.params.stop_token_ids.contains(&id)
                || (!s.tag.ignore_eos && self.eos.contains(&id))
            {
                Some(Some(EngineFinish::Stop { matched: id }))
            } else if s.out.len() >= s.params.max_new_tokens {
                Some(Some(EngineFinish::Length))
            } else {
                None
            };
            if let Some(end) = end {
                keep[i] = false;
                ends.push(end);
            }
        }
        clock.lap(|p| &mut p.bookkeeping_s);
        let gone = self.batch.retain(&keep)?;
        for (s, end) in gone.iter().zip(ends) {
            if let Some(end) = end {
                self.finish(s, end);
            }
        }
        clock.lap(|p| &mut p.leave_s);
        let phases = clock.finish(drawn.len());
        if prefill {
            self.timing.prefill.add(&phases);
        } else {
            self.timing.decode.add(&phases);
        }
        Ok(())
    }
}

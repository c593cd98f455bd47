//! `graft rl --config rl.toml`: online RL sessions in a real harness. Each step opens a
//! group per task, runs rollouts in envd sandboxes (each with its own gateway session, the
//! harness pointed at it), scores them with the task's reward command, posts the rewards,
//! reconstructs the step's sessions into samples, and (when training is wired) trains and
//! pushes weights.
//!
//! The gateway (exact mode) and a local envd run inside this process; the backend is an
//! SGLang-compatible server given by URL, or the scripted upstream for tests and demos.
//! Every step appends a line to `<out_dir>/steps.jsonl`; `<out_dir>/state.json` says which
//! step is next, so a run killed mid-step resumes there (finished rollouts stay in the
//! records under `<out_dir>/data`).
//!
//! Groups grow in strides until Balanced Adaptive Rollout (`graft_trainer::bar`) selects a
//! balanced set or drops the group; with `trainer.enabled` each step then trains on the
//! selected sessions' samples (`training.rs`: a resident trainer kept in memory across
//! steps, or the per-step path) and hands the new weights to the backends (the gateway
//! holds new calls meanwhile), so the next step's records carry the new `weight_version`.
//! With no backend URL or script, `graft serve` runs in this process and takes each new
//! version from the trainer as a tensor copy. Up to `rollout.max_staleness` steps train
//! while the next step's rollouts run.

pub mod backends;
pub mod config;
mod progress;
pub mod rollout;
pub mod tasks;
#[cfg(feature = "trainer")]
mod training;

use std::collections::{HashSet, VecDeque};
use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use graft_gateway::{BackendConfig, ExactConfig, Gateway, GatewayConfig};
use graft_reconstruct::merge::Summary;
use graft_reconstruct::records::{FromRecords, WithoutTokenIds, samples_from_records};
use graft_reconstruct::retokenize::Model;
use graft_recorder::SessionEvent;
use http::Method;
use serde_json::{Value, json};

use backends::Shared;
use config::RlConfig;
use rollout::{Api, Outcome, Rollout};

#[derive(Debug, clap::Args)]
pub struct RlArgs {
    /// The run's config (see `examples/rl/`).
    #[arg(long)]
    pub config: PathBuf,
    /// Print the plan and check that every component answers; start nothing else.
    #[arg(long)]
    pub dry_run: bool,
    /// Run this many steps instead of the config's `run.steps`.
    #[arg(long)]
    pub steps: Option<usize>,
    /// Keep the run here instead of the config's `run.out_dir`.
    #[arg(long)]
    pub out_dir: Option<PathBuf>,
}

/// The running components.
pub(crate) struct Components {
    pub(crate) gateway: Api,
    pub(crate) gateway_url: String,
    pub(crate) envd: Api,
    pub(crate) backends: Vec<String>,
    /// The backends' health and weights, shared by the step loop and the watchdog.
    shared: Arc<Shared>,
    stops: Vec<tokio::sync::oneshot::Sender<()>>,
    tasks: Vec<tokio::task::JoinHandle<()>>,
    /// Servers without a stop signal (the scripted backend): aborted at the end.
    aborts: Vec<tokio::task::JoinHandle<()>>,
    /// The embedded `graft serve`'s engine (new weights are handed to it in memory).
    engine: Option<EngineHandle>,
}

#[cfg(feature = "trainer")]
type EngineHandle = Arc<graft_trainer::engine::Engine>;
#[cfg(not(feature = "trainer"))]
type EngineHandle = ();

impl Components {
    /// Stops the gateway and envd (they drain and flush), then whatever has no stop signal.
    pub(crate) async fn stop(self) {
        for s in self.stops {
            let _ = s.send(());
        }
        for mut t in self.tasks {
            if tokio::time::timeout(Duration::from_secs(30), &mut t)
                .await
                .is_err()
            {
                t.abort();
            }
        }
        for t in self.aborts {
            t.abort();
        }
    }
}

/// `graft serve` on the policy's weights, in this process: the embedded backend.
#[cfg(feature = "trainer")]
async fn start_serve(
    cfg: &RlConfig,
    aborts: &mut Vec<tokio::task::JoinHandle<()>>,
) -> anyhow::Result<(Vec<String>, Option<EngineHandle>)> {
    let model = cfg
        .trainer
        .model
        .clone()
        .unwrap_or_else(|| cfg.backend.model_dir.clone());
    let args = crate::serve::ServeArgs {
        model,
        listen: ([127, 0, 0, 1], 0).into(),
        max_batch: cfg.rollout.concurrency.max(1),
        weight_version: "default".into(),
        max_body_bytes: 64 << 20,
    };
    let (addr, device, engine, serve) = crate::serve::start(&args).await?;
    println!("embedded backend: graft serve on {device:?}");
    aborts.push(tokio::spawn(async move {
        if let Err(e) = serve.await {
            tracing::error!(error = %format!("{e:#}"), "the embedded graft serve stopped");
        }
    }));
    Ok((vec![format!("http://{addr}")], Some(engine)))
}

#[cfg(not(feature = "trainer"))]
async fn start_serve(
    _cfg: &RlConfig,
    _aborts: &mut Vec<tokio::task::JoinHandle<()>>,
) -> anyhow::Result<(Vec<String>, Option<EngineHandle>)> {
    bail!(
        "no backend: give backend.urls (SGLang-compatible servers); the embedded `graft serve` needs a graft built with the 'trainer' feature"
    )
}

/// The scripted upstream in this process (`backend.scripted`): it goes away with it,
/// whatever happens.
#[cfg(feature = "testkit")]
async fn start_scripted(
    cfg: &RlConfig,
    script: &Path,
    aborts: &mut Vec<tokio::task::JoinHandle<()>>,
) -> anyhow::Result<Vec<String>> {
    // It wants the keys the config gives, as an SGLang started with them would.
    let keys = cfg.backend.keys()?;
    let args = graft_testkit::ScriptedArgs {
        listen: ([127, 0, 0, 1], 0).into(),
        script: Some(script.to_path_buf()),
        expect_key: keys.api,
        admin_key: keys.admin,
        sglang_version: "0.5.23".into(),
        legacy_info_routes: false,
        vllm_version: "0.34.0".into(),
        // It plays the wire the config names; a vLLM one can take pushes.
        vllm_dev_mode: cfg.backend.wire == graft_gateway::config::ExactWire::Vllm,
        chunk_delay_ms: 0,
        models: vec!["scripted".into()],
        tokenizer: Some(cfg.backend.model_dir.clone()),
    };
    let (addr, serve) = graft_testkit::start(&args).await?;
    aborts.push(tokio::spawn(async move {
        if let Err(e) = serve.await {
            tracing::error!(error = %format!("{e:#}"), "the scripted backend stopped");
        }
    }));
    Ok(vec![format!("http://{addr}")])
}

/// Without the `testkit` feature there is no scripted upstream; the config's validation
/// already refused `backend.scripted`.
#[cfg(not(feature = "testkit"))]
async fn start_scripted(
    _cfg: &RlConfig,
    _script: &Path,
    _aborts: &mut Vec<tokio::task::JoinHandle<()>>,
) -> anyhow::Result<Vec<String>> {
    bail!("{}", config::SCRIPTED_NEEDS_TESTKIT)
}

pub(crate) async fn start(cfg: &RlConfig) -> anyhow::Result<Components> {
    let mut stops = vec![];
    let mut tasks = vec![];
    let mut aborts = vec![];
    // The backend.
    let mut engine = None;
    let backends = if !cfg.backend.urls.is_empty() {
        cfg.backend.urls.clone()
    } else if let Some(script) = &cfg.backend.scripted {
        start_scripted(cfg, script, &mut aborts).await?
    } else {
        let (urls, e) = start_serve(cfg, &mut aborts).await?;
        engine = e;
        urls
    };
    let keys = cfg.backend.keys()?;
    for b in &backends {
        rollout::wait_ready(&keys.api(b), "/health", Duration::from_secs(30))
            .await
            .with_context(|| format!("the backend {b} does not answer GET /health"))?;
        // Pushes to vLLM need its development routes: say so now, not after a step.
        if cfg.trainer.enabled {
            backends::check_pushable(cfg.backend.wire, b, &keys).await?;
        }
    }
    // The gateway, exact mode, in this process.
    let data_dir = cfg.run.out_dir.join("data");
    let mut exact = ExactConfig::new(cfg.backend.model_dir.clone(), backends.clone())?;
    exact.backend_api_key = keys.api.clone();
    exact.admin_api_key = keys.admin.clone();
    exact.wire = cfg.backend.wire;
    exact.logprobs = cfg.backend.wire.logprob_kind(cfg.backend.logprobs_mode);
    let mut gcfg = GatewayConfig::new(BackendConfig::Sglang(exact))?;
    gcfg.server.listen = ([127, 0, 0, 1], 0).into();
    gcfg.recorder.data_dir = data_dir;
    // Closed: the admin API behind the key the gateway keeps in OUT/data/admin.key (where an
    // operator finds it for /ui), model calls behind each session's key.
    gcfg.auth.require_client_key = true;
    let gw = Gateway::bind(gcfg).await?;
    let gateway_url = gw.url();
    let admin = gw
        .admin_key()
        .context("the run's gateway has no admin key")?
        .to_string();
    let (tx, rx) = tokio::sync::oneshot::channel::<()>();
    stops.push(tx);
    tasks.push(tokio::spawn(async move {
        if let Err(e) = gw
            .serve(async {
                let _ = rx.await;
            })
            .await
        {
            tracing::error!(error = %e, "the gateway stopped");
        }
    }));
    let gateway = Api::new(
        &gateway_url,
        Some(("authorization", format!("Bearer {admin}"))),
    );
    // envd: given, or local in this process.
    let envd = match &cfg.envd.url {
        Some(u) => {
            let key = match cfg.envd.api_key.as_deref() {
                Some(k) => Some(match k.strip_prefix("env::") {
                    Some(var) => std::env::var(var).with_context(|| {
                        format!(
                            "envd.api_key names the environment variable {var}, which is not set"
                        )
                    })?,
                    None => k.to_string(),
                }),
                None => None,
            };
            Api::new(u, key.map(|k| ("x-api-key", k)))
        }
        None => {
            // A local envd in this process: its sandboxes die with it (bubblewrap
            // --die-with-parent), so a killed run leaves nothing running.
            let key = format!("envd-{}", uuid::Uuid::new_v4().simple());
            let gw_addr: std::net::SocketAddr = gateway_url
                .trim_start_matches("http://")
                .parse()
                .context("the gateway's address")?;
            let mut ecfg = graft_envd::EnvdConfig::new(
                ([127, 0, 0, 1], 0).into(),
                cfg.run.out_dir.join("envd"),
                key.clone(),
                crate::envd::agent_command(None)?,
            );
            ecfg.gateway = Some(gw_addr);
            ecfg.harnesses = Some(crate::envd::harness_renderer());
            if let Some(uid) = cfg.envd.sandbox_uid {
                ecfg.sandbox_uid = uid;
                ecfg.sandbox_gid = uid;
            }
            if let Some(m) = cfg.envd.memory_mb {
                ecfg.defaults.memory_mb = m;
            }
            if let Some(p) = cfg.envd.pids {
                ecfg.defaults.pids = p;
            }
            if let Some(c) = cfg.envd.cpus {
                ecfg.defaults.cpus = c;
            }
            let envd = graft_envd::Envd::bind(ecfg)
                .await
                .context("envd could not start")?;
            let url = envd.url();
            let (tx, rx) = tokio::sync::oneshot::channel::<()>();
            stops.push(tx);
            tasks.push(tokio::spawn(async move {
                envd.serve(async {
                    let _ = rx.await;
                })
                .await;
            }));
            Api::new(&url, Some(("x-api-key", key)))
        }
    };
    rollout::wait_ready(&envd, "/healthz", Duration::from_secs(30))
        .await
        .context("envd does not answer GET /healthz")?;
    let shared = Arc::new(Shared::new(keys));
    aborts.push(tokio::spawn(backends::watch(
        cfg.clone(),
        gateway.clone(),
        backends.clone(),
        shared.clone(),
    )));
    Ok(Components {
        gateway,
        gateway_url,
        envd,
        backends,
        shared,
        stops,
        tasks,
        aborts,
        engine,
    })
}

#[derive(serde::Serialize, serde::Deserialize, Default)]
struct State {
    /// The first step not finished (trained and logged); step s runs tasks from
    /// s × tasks_per_step on.
    next_step: usize,
    /// The policy's current weights (the last step's checkpoint); None: the starting model.
    #[serde(default)]
    policy: Option<PathBuf>,
    /// The weight_version the backends serve.
    #[serde(default)]
    weight_version: Option<String>,
    /// The run's steps up to the newest checkpoint (`policy`): a resident trainer's run
    /// resumes there (None, in a state.json written before resident trainers: `next_step`).
    #[serde(default)]
    checkpoint_next: Option<usize>,
    /// The weight_version of the newest checkpoint.
    #[serde(default)]
    checkpoint_version: Option<String>,
    /// The weight versions served so far, oldest first ("default" or the resumed policy's
    /// first): a call's staleness is how many of them lie between its version and the
    /// trainer's.
    #[serde(default)]
    versions: Vec<String>,
}

fn read_state(out: &Path) -> anyhow::Result<State> {
    let p = out.join("state.json");
    match std::fs::read(&p) {
        Ok(b) => serde_json::from_slice(&b).with_context(|| format!("{} is damaged", p.display())),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(State::default()),
        Err(e) => Err(e).with_context(|| format!("reading {}", p.display())),
    }
}

fn write_state(out: &Path, s: &State) -> anyhow::Result<()> {
    let p = out.join("state.json");
    let tmp = out.join("state.json.tmp");
    let mut f = std::fs::File::create(&tmp)?;
    f.write_all(&serde_json::to_vec(s)?)?;
    f.sync_all()?;
    std::fs::rename(&tmp, &p)?;
    Ok(())
}

pub async fn run(args: RlArgs) -> anyhow::Result<()> {
    let mut cfg = RlConfig::load(&args.config)?;
    let tasks_file = cfg.for_rl(args.steps)?;
    cfg.check_files()?;
    if let Some(d) = &args.out_dir {
        cfg.run.out_dir = std::path::absolute(d)?;
    }
    let tasks = tasks::load(&tasks_file)?;
    for t in &tasks {
        cfg.check_task_harness(&t.id, t.harness.as_deref())?;
    }
    let model = Model::from_dir(&cfg.backend.model_dir).with_context(|| {
        format!(
            "loading the model's tokenizer and template from {}",
            cfg.backend.model_dir.display()
        )
    })?;
    let r = &cfg.rollout;
    let per_step_min = r.tasks_per_step * r.group_size;
    let per_step_max = r.tasks_per_step * r.max_group_size;
    let prompt_tokens: usize = tasks
        .iter()
        .map(|t| {
            model
                .tokenizer
                .encode(&t.prompt)
                .map(|v| v.len())
                .unwrap_or(0)
        })
        .sum::<usize>()
        / tasks.len();
    println!(
        "plan: {} steps × {} tasks × {}–{} rollouts ({}–{} sandboxes and sessions per step, {} at a time); {} tasks in {} (task prompts ≈ {} tokens); harness `{}` with up to {} s per rollout",
        cfg.steps(),
        r.tasks_per_step,
        r.group_size,
        r.max_group_size,
        per_step_min,
        per_step_max,
        r.concurrency,
        tasks.len(),
        tasks_file.display(),
        prompt_tokens,
        cfg.harness
            .iter()
            .map(|h| format!("{} ({})", h.label(), h.command))
            .collect::<Vec<_>>()
            .join("`, `"),
        cfg.harness
            .iter()
            .map(|h| h.timeout_secs)
            .fold(0.0, f64::max)
    );
    println!(
        "expected tokens per step: at least {}–{} prompt tokens from the task prompts alone (the harness's system prompt, tools and every further turn come on top; each step's line in steps.jsonl has the trained tokens); overlap: {}",
        per_step_min * prompt_tokens,
        per_step_max * prompt_tokens,
        if r.max_staleness == 0 {
            "none (max_staleness = 0)".to_string()
        } else {
            format!(
                "up to {} steps train while a step's rollouts run (max_staleness = {})",
                r.max_staleness, r.max_staleness
            )
        }
    );
    std::fs::create_dir_all(&cfg.run.out_dir)
        .with_context(|| format!("creating {}", cfg.run.out_dir.display()))?;
    let c = start(&cfg).await?;
    println!(
        "components: backend {}; gateway {} (exact mode); envd {}",
        c.backends.join(", "),
        c.gateway_url,
        c.envd.base_url()
    );
    if args.dry_run {
        let v = c.envd.ok(Method::GET, "/sandboxes", None).await?;
        println!(
            "dry run: every component answers (envd holds {} sandboxes); nothing was started",
            v["sandboxes"].as_array().map_or(0, Vec::len)
        );
        c.stop().await;
        return Ok(());
    }
    let result = steps(&cfg, &tasks, &model, &c).await;
    c.stop().await;
    result
}

/// What one step's rollouts left: the input of its training, and of its log line.
struct Collected {
    step: usize,
    started: Instant,
    rollouts: Vec<Rollout>,
    groups: Vec<Value>,
    samples_path: PathBuf,
    summary: Summary,
    /// Calls of the step's sessions per `weight_version` of the backend that served them.
    versions: std::collections::BTreeMap<String, usize>,
    /// Calls of each of the step's sessions.
    calls: std::collections::BTreeMap<String, usize>,
    t_rollouts: f64,
    t_reconstruct: f64,
}

/// What training a step did.
struct Trained {
    log: Value,
    t_train: f64,
    /// The weight handoff: in memory to the embedded backend, or write + push of files.
    t_push: f64,
    /// Writing the checkpoint (and, for file pushes, the weights) outside the train step.
    t_checkpoint: f64,
    /// Whether the step changed the policy's weights.
    changed: bool,
    /// The checkpoint written (None: none was due) and the version the backends now serve.
    policy: Option<PathBuf>,
    version: Option<String>,
}

impl Trained {
    fn skipped(why: &str) -> Trained {
        Trained {
            log: json!({"skipped": why}),
            t_train: 0.0,
            t_push: 0.0,
            t_checkpoint: 0.0,
            changed: false,
            policy: None,
            version: None,
        }
    }
}

/// A collected step whose training runs.
type Pending = (Collected, tokio::task::JoinHandle<anyhow::Result<Trained>>);

async fn steps(
    cfg: &RlConfig,
    tasks: &[tasks::Task],
    model: &Model,
    c: &Components,
) -> anyhow::Result<()> {
    let out = &cfg.run.out_dir;
    let mut state = read_state(out)?;
    if state.next_step == 0 && state.checkpoint_next.is_none() {
        state.checkpoint_next = Some(0);
    }
    if state.versions.is_empty() {
        state.versions.push(
            state
                .weight_version
                .clone()
                .unwrap_or_else(|| "default".into()),
        );
    }
    let resident = cfg.trainer.enabled && cfg.trainer.resident;
    if resident {
        rewind_to_checkpoint(out, &mut state)?;
    }
    if state.next_step > 0 {
        println!("resuming at step {} (state.json)", state.next_step);
    }
    c.shared
        .set_expected(state.policy.clone(), state.weight_version.clone());
    let trainer = start_trainer(cfg, c, &state).await?;
    // A failed append is cut back at once (a full disk never leaves a torn line for the
    // next step's line to land on); a torn last line from a crash is cut here.
    let (mut log, torn) = graft_recorder::LineFile::open(&out.join("steps.jsonl"))?;
    if torn > 0 {
        tracing::warn!(
            torn_bytes = torn,
            "steps.jsonl ended in a torn line (the run stopped while writing it); cut"
        );
    }
    let progress = Arc::new(progress::Progress::new(cfg.steps()));
    let sem = Arc::new(tokio::sync::Semaphore::new(cfg.rollout.concurrency));
    // Steps whose training runs while later steps' rollouts are collected, oldest first;
    // trainings run one at a time in this order (each waits for the previous one's signal).
    let mut pending: VecDeque<Pending> = VecDeque::new();
    let mut last_done: Option<tokio::sync::oneshot::Receiver<()>> = None;
    let mut step = state.next_step;
    let result = async {
        while step < cfg.steps() {
            // Step s samples with weights no older than step s − 1 − max_staleness's.
            while pending.len() > cfg.rollout.max_staleness {
                if let Some((prev, h)) = pending.pop_front() {
                    let trained = h.await.context("the training task failed")??;
                    finish(cfg, c, &mut state, &mut log, prev, trained, &progress).await?;
                }
            }
            progress.training(pending.front().map(|(p, _)| p.step));
            progress.start_step(step);
            let col = collect(cfg, tasks, model, c, step, &sem, &progress).await?;
            let (done_tx, done_rx) = tokio::sync::oneshot::channel();
            let h = spawn_training(cfg, c, &trainer, &col, last_done.take(), done_tx);
            last_done = Some(done_rx);
            progress.training(Some(pending.front().map_or(step, |(p, _)| p.step)));
            pending.push_back((col, h));
            step += 1;
        }
        while let Some((prev, h)) = pending.pop_front() {
            let trained = h.await.context("the training task failed")??;
            finish(cfg, c, &mut state, &mut log, prev, trained, &progress).await?;
        }
        progress.training(None);
        anyhow::Ok(())
    }
    .await;
    progress.finish();
    result
}

/// A resident trainer's run resumes from its newest checkpoint: the steps finished after it
/// (their weights were in memory only) are run again; their finished rollouts are kept (as
/// for a step cut off mid-way) and their lines leave the step log.
fn rewind_to_checkpoint(out: &Path, state: &mut State) -> anyhow::Result<()> {
    let back = state.checkpoint_next.unwrap_or(state.next_step);
    if back >= state.next_step {
        return Ok(());
    }
    println!(
        "the newest checkpoint is from before step {back}; steps {back}..{} are run again (their finished rollouts are kept)",
        state.next_step - 1
    );
    let path = out.join("steps.jsonl");
    let text = std::fs::read_to_string(&path).unwrap_or_default();
    let kept: String = text
        .lines()
        .filter(|l| {
            serde_json::from_str::<Value>(l)
                .ok()
                .and_then(|v| v["step"].as_u64())
                .is_some_and(|s| (s as usize) < back)
        })
        .map(|l| format!("{l}\n"))
        .collect();
    // Whole and on disk before it replaces the old file (no empty steps.jsonl after a crash).
    let tmp = out.join("steps.jsonl.tmp");
    let mut f = std::fs::File::create(&tmp)?;
    f.write_all(kept.as_bytes())?;
    f.sync_all()?;
    std::fs::rename(&tmp, &path)?;
    if let Ok(d) = std::fs::File::open(out) {
        d.sync_all()?;
    }
    state.next_step = back;
    state.weight_version = state.checkpoint_version.clone();
    let v = state
        .weight_version
        .clone()
        .unwrap_or_else(|| "default".into());
    if let Some(i) = state.versions.iter().rposition(|x| *x == v) {
        state.versions.truncate(i + 1);
    }
    write_state(out, state)
}

#[cfg(feature = "trainer")]
type TrainerHandle = Option<Arc<training::RunTrainer>>;
#[cfg(not(feature = "trainer"))]
type TrainerHandle = Option<()>;

/// The run's trainer: loaded now when resident (and its weights handed to the embedded
/// backend when the run resumes from a checkpoint).
#[cfg(feature = "trainer")]
async fn start_trainer(
    cfg: &RlConfig,
    c: &Components,
    state: &State,
) -> anyhow::Result<TrainerHandle> {
    if !cfg.trainer.enabled {
        return Ok(None);
    }
    let policy = state
        .policy
        .clone()
        .or_else(|| cfg.trainer.model.clone())
        .unwrap_or_else(|| cfg.backend.model_dir.clone());
    let t = Arc::new(training::RunTrainer::new(policy, c.engine.clone()));
    if cfg.trainer.resident {
        println!("{}", t.load(cfg).await?);
        if let (Some(_), Some(v)) = (&state.policy, &state.weight_version)
            && t.in_process()
        {
            t.hand_over(v).await?;
            c.shared.set_expected(None, Some(v.clone()));
        }
    }
    Ok(Some(t))
}

#[cfg(not(feature = "trainer"))]
async fn start_trainer(
    _cfg: &RlConfig,
    _c: &Components,
    _state: &State,
) -> anyhow::Result<TrainerHandle> {
    Ok(None)
}

/// Runs one step's groups and reconstructs the scored sessions of its selected rollouts.
async fn collect(
    cfg: &RlConfig,
    tasks: &[tasks::Task],
    model: &Model,
    c: &Components,
    step: usize,
    sem: &Arc<tokio::sync::Semaphore>,
    progress: &Arc<progress::Progress>,
) -> anyhow::Result<Collected> {
    let started = Instant::now();
    let mut rollouts: Vec<Rollout> = vec![];
    let mut selected: HashSet<String> = HashSet::new();
    let mut groups: Vec<Value> = vec![];
    for k in 0..cfg.rollout.tasks_per_step {
        let task = &tasks[(step * cfg.rollout.tasks_per_step + k) % tasks.len()];
        let group = format!("step{step}-{}", task.id);
        let (mut rs, decision, chosen) =
            run_group(cfg, c, task, &group, sem, step, progress).await?;
        selected.extend(chosen.iter().map(|i| rs[*i].session_id.clone()));
        groups.push(json!({"group": group, "rollouts": rs.len(), "decision": decision, "selected": chosen.len()}));
        rollouts.append(&mut rs);
    }
    let t_rollouts = started.elapsed().as_secs_f64();
    let t = Instant::now();
    let samples_path = cfg
        .run
        .out_dir
        .join("samples")
        .join(format!("step-{step:05}.parquet"));
    let all: HashSet<String> = rollouts.iter().map(|r| r.session_id.clone()).collect();
    let (summary, versions, calls) = samples(
        model,
        &cfg.run.out_dir.join("data"),
        &selected,
        &all,
        &samples_path,
        cfg.run.side_threads.policy(),
    )?;
    Ok(Collected {
        step,
        started,
        rollouts,
        groups,
        samples_path,
        summary,
        versions,
        calls,
        t_rollouts,
        t_reconstruct: t.elapsed().as_secs_f64(),
    })
}

/// Starts training on a collected step once `prev` (the previous step's training) is done
/// (or decides there is nothing to train); `done` fires when it is finished.
fn spawn_training(
    cfg: &RlConfig,
    c: &Components,
    trainer: &TrainerHandle,
    col: &Collected,
    prev: Option<tokio::sync::oneshot::Receiver<()>>,
    done: tokio::sync::oneshot::Sender<()>,
) -> tokio::task::JoinHandle<anyhow::Result<Trained>> {
    if !cfg.trainer.enabled {
        return tokio::spawn(async { Ok(Trained::skipped("trainer.enabled = false")) });
    }
    if col.summary.samples == 0 {
        // Nothing trains: the next training waits only for the one before this.
        return tokio::spawn(async move {
            if let Some(p) = prev {
                let _ = p.await;
            }
            drop(done);
            Ok(Trained::skipped("no selected samples"))
        });
    }
    #[cfg(feature = "trainer")]
    {
        let Some(t) = trainer.clone() else {
            return tokio::spawn(async { anyhow::bail!("the run has no trainer") });
        };
        let ctx = training::Ctx {
            cfg: cfg.clone(),
            gateway: c.gateway.clone(),
            backends: c.backends.clone(),
            shared: c.shared.clone(),
            trainer: t,
        };
        let (step, samples) = (col.step, col.samples_path.clone());
        tokio::spawn(async move {
            let r = training::train(ctx, step, samples, prev).await;
            drop(done);
            r
        })
    }
    #[cfg(not(feature = "trainer"))]
    {
        let _ = (c, trainer, prev, done);
        tokio::spawn(async { anyhow::bail!("this graft was built without the 'trainer' feature") })
    }
}

/// Writes a step's log line and moves the run's state past it.
async fn finish(
    cfg: &RlConfig,
    c: &Components,
    state: &mut State,
    log: &mut graft_recorder::LineFile,
    col: Collected,
    trained: Trained,
    progress: &progress::Progress,
) -> anyhow::Result<()> {
    // Staleness: the versions between the one that sampled a call and the one the trainer
    // held when it trained on it (the version served before this step's update).
    let trainer_version = state
        .weight_version
        .clone()
        .unwrap_or_else(|| "default".into());
    let position = |v: &str| state.versions.iter().rposition(|x| x == v);
    let mut staleness: std::collections::BTreeMap<String, usize> = Default::default();
    let mut max_staleness: Option<usize> = None;
    for (v, n) in &col.versions {
        let key = match (position(v), position(&trainer_version)) {
            (Some(a), Some(b)) if a <= b => {
                max_staleness = Some(max_staleness.unwrap_or(0).max(b - a));
                (b - a).to_string()
            }
            _ => "unknown".to_string(),
        };
        *staleness.entry(key).or_default() += n;
    }
    if let Some(v) = trained.version.clone() {
        state.weight_version = Some(v.clone());
        state.versions.push(v);
    }
    if let Some(p) = trained.policy.clone() {
        state.policy = Some(p);
        state.checkpoint_next = Some(col.step + 1);
        state.checkpoint_version = state.weight_version.clone();
    } else if !(cfg.trainer.enabled && cfg.trainer.resident && trained.changed) {
        // Nothing only in memory: a resume may start after this step.
        if state.checkpoint_next == Some(col.step) {
            state.checkpoint_next = Some(col.step + 1);
        }
    }
    let rollouts = &col.rollouts;
    let summary = &col.summary;
    let rewards: Vec<f64> = rollouts.iter().filter_map(Rollout::reward).collect();
    // Nothing may be left behind by a step: every sandbox deleted, every session closed.
    let sandboxes_open = c
        .envd
        .ok(Method::GET, "/sandboxes", None)
        .await
        .map(|v| v["sandboxes"].as_array().map_or(0, Vec::len))
        .unwrap_or(usize::MAX);
    let sessions_open = c
        .gateway
        .ok(Method::GET, "/graft/sessions", None)
        .await
        .map(|v| {
            v["sessions"].as_array().map_or(0, |a| {
                a.iter()
                    .filter(|s| s["closed"] == false && s["session_id"] != "default")
                    .count()
            })
        })
        .unwrap_or(usize::MAX);
    let count = |f: fn(&Outcome) -> bool| rollouts.iter().filter(|r| f(&r.outcome)).count();
    let step = col.step;
    let line = json!({
        "step": step,
        "rollouts": rollouts.len(),
        "scored": rewards.len(),
        "timed_out": count(|o| matches!(o, Outcome::TimedOut)),
        "reward_failed": count(|o| matches!(o, Outcome::RewardFailed(_))),
        "backend_failed": count(|o| matches!(o, Outcome::BackendFailed(_))),
        "failed": count(|o| matches!(o, Outcome::Failed(_))),
        "reward_mean": if rewards.is_empty() { Value::Null } else { json!(rewards.iter().sum::<f64>() / rewards.len() as f64) },
        "samples": summary.samples,
        "trained_tokens": summary.trained_tokens,
        "drift_events": summary.drift_events,
        "samples_file": col.samples_path,
        "sandboxes_open": sandboxes_open,
        "sessions_open": sessions_open,
        "groups": col.groups,
        "train": trained.log,
        "weight_version": state.weight_version,
        "call_weight_versions": col.versions,
        "harnesses": per_harness(rollouts, &col.calls),
        "call_staleness": staleness,
        "max_call_staleness": max_staleness,
        "backend_events": c.shared.take_events(),
        "secs": {"step": col.started.elapsed().as_secs_f64(), "rollout": col.t_rollouts,
                 "reconstruct": col.t_reconstruct, "train": trained.t_train, "push": trained.t_push,
                 "handoff": trained.t_push, "checkpoint": trained.t_checkpoint,
                 "harness_in_rollouts": rollouts.iter().map(|r| r.harness_secs).sum::<f64>(),
                 "reward_in_rollouts": rollouts.iter().map(|r| r.reward_secs).sum::<f64>()},
        "rollout_list": rollouts.iter().map(|r| json!({
            "session": r.session_id, "task": r.task_id, "harness": r.harness, "reward": r.reward(),
            "harness_exit": r.harness_exit, "harness_secs": r.harness_secs})).collect::<Vec<_>>(),
        "problems": rollouts.iter().filter(|r| r.reward().is_none() || r.harness_exit != Some(0)).map(|r| json!({
            "session": r.session_id, "task": r.task_id, "harness": r.harness, "outcome": format!("{:?}", r.outcome),
            "harness_exit": r.harness_exit, "harness_oom": r.harness_oom, "harness_tail": r.harness_tail})).collect::<Vec<_>>(),
    });
    log.append(format!("{line}\n").as_bytes())
        .with_context(|| format!("appending step {step}'s line to steps.jsonl"))?;
    progress.println(format!(
        "step {step}: {} rollouts, {} scored, reward mean {}, {} samples ({} trained tokens), {:.1} s",
        rollouts.len(),
        rewards.len(),
        line["reward_mean"],
        summary.samples,
        summary.trained_tokens,
        col.started.elapsed().as_secs_f64()
    ));
    state.next_step = step + 1;
    write_state(&cfg.run.out_dir, state)?;
    // report.html: the run page, self-contained, rewritten after every step.
    let report = graft_viewer::Viewer::new(
        &cfg.run.out_dir.join("data"),
        Some(&cfg.run.out_dir),
        None,
        "",
    )
    .and_then(|v| v.run_report());
    match report {
        Ok(html) => {
            if let Err(e) = std::fs::write(cfg.run.out_dir.join("report.html"), html) {
                tracing::warn!(error = %e, "report.html not written");
            }
        }
        Err(e) => tracing::warn!(error = %e, "report.html not written"),
    }
    prune_checkpoints(cfg, state);
    Ok(())
}

/// Deletes all but the newest `run.keep_checkpoints` step checkpoints, never the policy the
/// run continues from (state.json, already written, names it); and likewise the weights
/// directories written for file pushes (never the newest: a restarted backend gets it).
/// The step's rollouts per harness: how many, how many scored, their reward mean and the
/// calls their sessions made.
fn per_harness(rollouts: &[Rollout], calls: &std::collections::BTreeMap<String, usize>) -> Value {
    let mut by: std::collections::BTreeMap<&str, (usize, Vec<f64>, usize)> = Default::default();
    for r in rollouts {
        let e = by.entry(r.harness.as_str()).or_default();
        e.0 += 1;
        e.1.extend(r.reward());
        e.2 += calls.get(&r.session_id).copied().unwrap_or(0);
    }
    by.into_iter()
        .map(|(h, (n, rewards, calls))| {
            let mean = (!rewards.is_empty()).then(|| rewards.iter().sum::<f64>() / rewards.len() as f64);
            (h.to_owned(), json!({"rollouts": n, "scored": rewards.len(), "reward_mean": mean, "calls": calls}))
        })
        .collect::<serde_json::Map<_, _>>()
        .into()
}

fn prune_checkpoints(cfg: &RlConfig, state: &State) {
    let keep = cfg.run.keep_checkpoints;
    if keep == 0 {
        return;
    }
    for sub in ["checkpoints", "weights"] {
        let dir = cfg.run.out_dir.join(sub);
        let Ok(entries) = std::fs::read_dir(&dir) else {
            continue;
        };
        let mut steps: Vec<PathBuf> = entries
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| {
                p.file_name()
                    .and_then(|n| n.to_str())
                    .is_some_and(|n| n.starts_with("step-"))
            })
            .collect();
        steps.sort();
        let old = steps.len().saturating_sub(keep);
        for p in &steps[..old] {
            if state.policy.as_deref() == Some(p.as_path()) {
                continue;
            }
            if let Err(e) = std::fs::remove_dir_all(p) {
                tracing::warn!(checkpoint = %p.display(), error = %e, "could not delete an old checkpoint");
            }
        }
    }
}

/// What to do with a group given its rewards so far: `Ok(indices)` to train on (into the
/// scored rollouts), `Err(n)` for n more rollouts, or `Ok(vec![])` with `dropped` to drop it.
enum Decision {
    Take(Vec<usize>, &'static str),
    More(usize),
}

fn decide(cfg: &RlConfig, rewards: &[f64], attempts: usize) -> Decision {
    let r = &cfg.rollout;
    let room = r.max_group_size.saturating_sub(attempts);
    if cfg.trainer.enabled && r.selection == config::Selection::Group {
        if rewards.len() < r.group_size && room > 0 {
            return Decision::More((r.group_size - rewards.len()).min(room));
        }
        let take: Vec<usize> = (0..rewards.len().min(r.group_size)).collect();
        let first = take.first().map(|&i| rewards[i]);
        return if take.len() < 2 || take.iter().all(|&i| Some(rewards[i]) == first) {
            Decision::Take(vec![], "dropped: no learning signal")
        } else {
            Decision::Take(take, "group")
        };
    }
    #[cfg(feature = "trainer")]
    if cfg.trainer.enabled {
        use graft_trainer::bar::{BarConfig, BarDecision, select};
        let bar = BarConfig {
            n: r.group_size,
            n_max: r.max_group_size,
            stride: r.stride,
            min_positive: r.min_positive,
            max_positive: r.max_positive,
            positive_above: r.positive_above,
        };
        return match select(rewards, &bar) {
            BarDecision::Select { indices, relaxed } => {
                Decision::Take(indices, if relaxed { "relaxed" } else { "balanced" })
            }
            BarDecision::NeedMore(n) if room > 0 => Decision::More(n.max(r.stride).min(room)),
            BarDecision::NeedMore(_) => Decision::Take(vec![], "dropped: too few scored rollouts"),
            BarDecision::Drop => Decision::Take(vec![], "dropped: no learning signal"),
        };
    }
    if rewards.len() >= r.group_size || room == 0 {
        Decision::Take((0..rewards.len().min(r.group_size)).collect(), "collected")
    } else {
        Decision::More((r.group_size - rewards.len()).min(room))
    }
}

/// One group: rollouts in strides until the group is decided. Returns the rollouts, the
/// decision, and which of them (indices into the returned list) are trained on.
async fn run_group(
    cfg: &RlConfig,
    c: &Components,
    task: &tasks::Task,
    group: &str,
    sem: &Arc<tokio::sync::Semaphore>,
    step: usize,
    progress: &Arc<progress::Progress>,
) -> anyhow::Result<(Vec<Rollout>, &'static str, Vec<usize>)> {
    let mut rollouts = resumed(cfg, c, task, group).await?;
    if !rollouts.is_empty() {
        progress.println(format!(
            "  step {step} {group}: {} rollouts finished before the restart are kept",
            rollouts.len()
        ));
    }
    let mut next = rollouts.len();
    loop {
        let scored: Vec<usize> = (0..rollouts.len())
            .filter(|&i| rollouts[i].reward().is_some())
            .collect();
        let rewards: Vec<f64> = scored
            .iter()
            .filter_map(|&i| rollouts[i].reward())
            .collect();
        let want = match decide(cfg, &rewards, rollouts.len()) {
            Decision::More(n) => n,
            Decision::Take(idx, why) => {
                let chosen = idx.iter().filter_map(|&k| scored.get(k).copied()).collect();
                return Ok((rollouts, why, chosen));
            }
        };
        let mut jobs = tokio::task::JoinSet::new();
        for i in next..next + want {
            let (cfg, gw, envd, task, group, sem, progress) = (
                cfg.clone(),
                c.gateway.clone(),
                c.envd.clone(),
                task.clone(),
                group.to_string(),
                sem.clone(),
                progress.clone(),
            );
            jobs.spawn(async move {
                let _permit = sem.acquire_owned().await;
                progress.rollout_started();
                let r = rollout::run(&cfg, &gw, &envd, &task, &group, i, &Default::default()).await;
                progress.rollout_done(r.as_ref().ok().and_then(Rollout::reward));
                (i, r)
            });
        }
        next += want;
        let mut batch = vec![];
        while let Some(j) = jobs.join_next().await {
            match j {
                Ok((i, Ok(r))) => {
                    progress.println(match &r.outcome {
                        Outcome::Scored(x) => format!(
                            "  step {step} {} rollout {}: reward {x}",
                            r.task_id, r.session_id
                        ),
                        o => format!(
                            "  step {step} {} rollout {}: {o:?}",
                            r.task_id, r.session_id
                        ),
                    });
                    batch.push((i, r));
                }
                Ok((_, Err(e))) => bail!("a rollout could not be run: {e:#}"),
                Err(e) => bail!("a rollout task failed: {e}"),
            }
        }
        batch.sort_by_key(|(i, _)| *i);
        rollouts.extend(batch.into_iter().map(|(_, r)| r));
    }
}

/// The rollouts of `group` an earlier, interrupted run finished (rewarded sessions): they
/// count, and are not run again. Sessions it left open (rollouts cut off by the crash) are
/// closed now and count as failed attempts.
async fn resumed(
    cfg: &RlConfig,
    c: &Components,
    task: &tasks::Task,
    group: &str,
) -> anyhow::Result<Vec<Rollout>> {
    let data = cfg.run.out_dir.join("data");
    if !data.join("sessions.log").exists() {
        return Ok(vec![]);
    }
    let mut order: Vec<(i64, String, String)> = vec![];
    let mut rewards = std::collections::HashMap::new();
    let mut closed = HashSet::new();
    for ev in graft_recorder::read_session_events(&data)? {
        match ev {
            SessionEvent::Created {
                session_id,
                group_id,
                metadata,
                ..
            } if group_id.as_deref() == Some(group) => {
                let i = metadata
                    .get("rollout")
                    .and_then(Value::as_i64)
                    .unwrap_or(i64::MAX);
                let harness = metadata
                    .get("harness")
                    .and_then(Value::as_str)
                    .map(str::to_owned)
                    .unwrap_or_else(|| {
                        let i = usize::try_from(i).unwrap_or(0);
                        cfg.harness_for(task.harness.as_deref(), i)
                            .label()
                            .to_owned()
                    });
                order.push((i, session_id, harness));
            }
            SessionEvent::Reward {
                session_id, reward, ..
            } => {
                rewards.insert(session_id, reward);
            }
            SessionEvent::Closed { session_id, .. } => {
                closed.insert(session_id);
            }
            _ => {}
        }
    }
    order.sort();
    let mut out = vec![];
    for (_, sid, harness) in order {
        if !closed.contains(&sid) {
            c.gateway
                .ok(
                    Method::POST,
                    &format!("/graft/sessions/{sid}/close"),
                    Some(&json!({})),
                )
                .await
                .with_context(|| {
                    format!("closing session {sid} left open by the interrupted run")
                })?;
        }
        out.push(Rollout {
            task_id: task.id.clone(),
            group_id: group.to_string(),
            outcome: match rewards.get(&sid) {
                // A reward is posted after the rollout's sandbox is gone: it finished.
                Some(r) => Outcome::Scored(*r),
                _ => Outcome::Failed("interrupted by a restart of graft rl".into()),
            },
            session_id: sid,
            harness,
            harness_exit: None,
            harness_oom: false,
            harness_secs: 0.0,
            reward_secs: 0.0,
            harness_tail: String::new(),
        });
    }
    Ok(out)
}

/// Calls counted by a key (a weight version, a session).
type Counts = std::collections::BTreeMap<String, usize>;

/// The exact-mode records of `sessions` merged into samples (with their rewards), written to
/// `path`; and the calls of all the step's sessions (`all`) counted by `weight_version` and by
/// session.
fn samples(
    model: &Model,
    data: &Path,
    sessions: &HashSet<String>,
    all: &HashSet<String>,
    path: &Path,
    side_threads: graft_reconstruct::threads::SideThreads,
) -> anyhow::Result<(Summary, Counts, Counts)> {
    let done = samples_from_records(
        model,
        data,
        FromRecords {
            sessions: Some(sessions),
            without_token_ids: WithoutTokenIds::Skip,
            count_versions_of: Some(all),
            side_threads,
            ..FromRecords::all()
        },
        path,
    )?;
    for (why, n) in &done.skipped {
        tracing::warn!(calls = n, reason = %why, "calls of an exact-mode run are skipped");
    }
    Ok((done.summary, done.weight_versions, done.calls_per_session))
}

//! `graft rollouts serve --config rl.toml`: graft as the rollout engine of another trainer
//! (verl, TRL, SkyRL, slime, OpenRLHF). The config names the harnesses, envd and the
//! backend, as for `graft rl`; the same components start in this process
//! (`crate::rl::start`). Each request is a batch of tasks:
//!
//! ```text
//! POST /rollouts {"tasks": [{"id", "prompt", "setup", "reward": {"command"}, "harness"?}, ...],
//!                 "group_size": 4, "weight_version": "step-12", "allow_stale": false,
//!                 "harness": "codex", "backends": ["http://sglang-0:30000", ...],
//!                 "sampling": {"mode": "enforce", "temperature": 1.0, "top_p": 1.0} | "temperature": 1.0}
//! → 200 application/x-ndjson, one line per group as it finishes:
//!   {"group_id", "task_id", "rollouts": [{"session_id", "harness", "backend", "reward", "outcome", "stop_reason"}],
//!    "samples": [{"sample_id", "session_id", "group_id", "tokens", "loss_mask", "logprobs",
//!                 "reward", "weight_versions", "token_weight_versions", "stop_reason", ...}],
//!    "calls_by_weight_version": {...}, "stale_calls": n, "stale_samples": n}
//!   then {"done": true, "groups", "rollouts", "secs"}
//! → or, with `Accept: application/vnd.apache.arrow.stream`, one Arrow IPC stream: a record
//!   batch (one row) per group as it finishes, the same fields as columns, `samples` a list
//!   of structs in the samples file's schema plus `stop_reason` (see `answer_schema`).
//! ```
//!
//! Each rollout is `graft rl`'s (`crate::rl::rollout::run`: a gateway session, a sandbox,
//! the harness, the reward command); the group's scored sessions are reconstructed from the
//! records into samples. Per request: the harness of tasks that name none (a label of the
//! config's `[[harness]]`), the sessions' sampling policy (enforced by the gateway), and the
//! trainer's own SGLang-compatible servers (`backends`: the batch's sessions are spread over
//! them, each pinned to one; the config's backends otherwise). A policy without a
//! temperature gets the config's `trainer.temperature`, never the harness's own.
//!
//! The trainer keeps control of the weights: `weight_version` is the version it says its
//! servers serve. graft checks it: before any rollout runs, every backend of the batch must
//! report it (`GET /model_info`), else the batch is refused (409) and nothing runs; a
//! sample with a sampled token of another version (the trainer updated a server mid-batch)
//! is left out of the answer (`stale_samples` counts them) unless `allow_stale` is true, in
//! which case each token's version is in `token_weight_versions`. `stale_calls` counts the
//! group's calls a backend answered with another version. Groups are not grown or filtered
//! (no BAR): every scored rollout's samples come back.
//!
//! Stop reasons (SkyRL's `stop_reasons`, OpenRLHF's `truncated`, slime's `status`) are in the
//! answer, not in the samples file: a sample's is the `finish_reason` the gateway recorded for
//! its last call (`stop`, `length`, `tool_calls`, SGLang's `abort`); a rollout's is its
//! session's last model call's, or why it ended before that could count: `timeout` (past the
//! harness's budget) or `error` (set-up, the harness or the backend failed). `null` where no
//! call recorded one.

use std::collections::{BTreeMap, HashSet};
use std::convert::Infallible;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context as TaskContext, Poll};
use std::time::Instant;

use anyhow::Context;
use arrow_array::builder::{Float64Builder, StringBuilder, UInt64Builder};
use arrow_array::{Array, ArrayRef, ListArray, RecordBatch, StringArray, StructArray};
use arrow_buffer::OffsetBuffer;
use arrow_schema::{DataType, Field, Fields, Schema, SchemaRef};
use bytes::Bytes;
use graft_reconstruct::records::{FromRecords, WithoutTokenIds, samples_from_records};
use graft_reconstruct::retokenize::Model;
use graft_reconstruct::sample::{Sample, read_samples_parquet, samples_batch, samples_schema};
use http::{Method, Response, StatusCode, header};
use http_body_util::{BodyExt, Full, combinators::UnsyncBoxBody};
use hyper::body::{Frame, Incoming};
use serde::Deserialize;
use serde_json::{Value, json};

use crate::rl::config::RlConfig;
use crate::rl::rollout::{self, Outcome, Rollout, SessionOptions};
use crate::rl::tasks::Task;

/// An answer's body; an error cuts the connection (the client sees the answer broken off).
type RespBody = UnsyncBoxBody<Bytes, std::io::Error>;

/// A chunk of a streamed answer, or why the answer breaks off there.
type Chunk = Result<Bytes, std::io::Error>;

/// The media type of an Arrow IPC stream (IANA-registered).
pub const ARROW_STREAM: &str = "application/vnd.apache.arrow.stream";

#[derive(Debug, clap::Subcommand)]
pub enum RolloutsCommand {
    /// The rollout service: POST /rollouts runs a batch of tasks in the harness and streams
    /// token-level samples with rewards back, one NDJSON line (or Arrow IPC batch) per
    /// finished group.
    Serve(ServeArgs),
}

#[derive(Debug, clap::Args)]
pub struct ServeArgs {
    /// The harnesses, envd and backend, as for `graft rl`: the same file works, but `[tasks]`
    /// and `run.steps` are not needed (tasks come with each request); a file the config
    /// names must exist.
    #[arg(long)]
    pub config: PathBuf,
    /// Address to listen on (port 0 picks a free port; the real address is printed).
    #[arg(long, default_value = "127.0.0.1:0")]
    pub listen: SocketAddr,
    /// The largest rollout batch read (tasks are prompts and metadata); a longer body is
    /// answered 413.
    #[arg(long, default_value_t = 16 << 20)]
    pub max_body_bytes: usize,
}

/// One request: the tasks, how many rollouts per task, and what the trainer decides for
/// this batch (its weight version, harness, sampling policy, servers).
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct Batch {
    tasks: Vec<Task>,
    #[serde(default = "one")]
    group_size: usize,
    #[serde(default)]
    weight_version: Option<String>,
    /// Keep samples with tokens of another weight version than `weight_version`.
    #[serde(default)]
    allow_stale: bool,
    /// The temperature the sessions sample at (enforced); the config's by default.
    #[serde(default)]
    temperature: Option<f64>,
    /// The sessions' whole sampling policy, as the gateway takes it (instead of
    /// `temperature`).
    #[serde(default)]
    sampling: Option<Value>,
    /// The harness of the tasks that name none: a label of the config's `[[harness]]`.
    #[serde(default)]
    harness: Option<String>,
    /// The trainer's own SGLang-compatible servers; the config's backends by default.
    #[serde(default)]
    backends: Option<Vec<String>>,
}

fn one() -> usize {
    1
}

struct State {
    cfg: RlConfig,
    model: Arc<Model>,
    gateway: rollout::Api,
    envd: rollout::Api,
    /// The config's backends (what the gateway pins sessions to by default).
    backends: Vec<String>,
    sem: Arc<tokio::sync::Semaphore>,
    max_body_bytes: usize,
}

pub async fn run(cmd: RolloutsCommand) -> anyhow::Result<()> {
    let RolloutsCommand::Serve(a) = cmd;
    let cfg = RlConfig::load(&a.config)?;
    cfg.check_files()?;
    let model = Model::from_dir(&cfg.backend.model_dir).with_context(|| {
        format!(
            "loading the model's tokenizer and template from {}",
            cfg.backend.model_dir.display()
        )
    })?;
    std::fs::create_dir_all(cfg.run.out_dir.join("rollouts"))
        .with_context(|| format!("creating {}", cfg.run.out_dir.display()))?;
    let c = crate::rl::start(&cfg).await?;
    let listener = tokio::net::TcpListener::bind(a.listen)
        .await
        .with_context(|| format!("cannot listen on {}", a.listen))?;
    let addr = listener.local_addr()?;
    let state = Arc::new(State {
        sem: Arc::new(tokio::sync::Semaphore::new(cfg.rollout.concurrency.max(1))),
        cfg,
        model: Arc::new(model),
        gateway: c.gateway.clone(),
        envd: c.envd.clone(),
        backends: c.backends.clone(),
        max_body_bytes: a.max_body_bytes,
    });
    println!("graft rollouts listening on http://{addr}");
    let handler = move |req| {
        let state = Arc::clone(&state);
        async move { Ok::<_, Infallible>(handle(state, req).await) }
    };
    graft_http::serve(
        listener,
        graft_http::Options::new("rollouts"),
        handler,
        graft_http::shutdown_signal(),
    )
    .await;
    c.stop().await;
    Ok(())
}

fn json_response(status: StatusCode, v: &Value) -> Response<RespBody> {
    graft_http::json_response(status, v, |b| {
        Full::new(b).map_err(|never| match never {}).boxed_unsync()
    })
}

fn error(status: StatusCode, message: String) -> Response<RespBody> {
    json_response(status, &json!({"error": {"message": message}}))
}

/// How long a request body may take to arrive whole.
const BODY_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(60);

async fn handle(state: Arc<State>, req: hyper::Request<Incoming>) -> Response<RespBody> {
    match (req.method(), req.uri().path()) {
        (&Method::GET, "/health") => json_response(StatusCode::OK, &json!({"ok": true})),
        (&Method::POST, "/rollouts") => {
            let arrow = req
                .headers()
                .get_all(header::ACCEPT)
                .iter()
                .filter_map(|v| v.to_str().ok())
                .any(|v| v.contains(ARROW_STREAM));
            let body =
                match graft_http::read_body(req.into_body(), state.max_body_bytes, BODY_TIMEOUT)
                    .await
                {
                    Ok(b) => b,
                    Err(e @ graft_http::BodyError::TooLarge { .. }) => {
                        return error(StatusCode::PAYLOAD_TOO_LARGE, e.to_string());
                    }
                    Err(e) => return error(StatusCode::BAD_REQUEST, e.to_string()),
                };
            let batch: Batch = match serde_json::from_slice(&body) {
                Ok(b) => b,
                Err(e) => {
                    return error(
                        StatusCode::BAD_REQUEST,
                        format!(
                            "the body is not a rollout batch ({e}); send {{\"tasks\": [...], \"group_size\": N}}"
                        ),
                    );
                }
            };
            let plan = match plan(&state, batch) {
                Ok(p) => p,
                Err(msg) => return error(StatusCode::BAD_REQUEST, msg),
            };
            if let Some(v) = &plan.weight_version {
                let keys = match plan.cfg.backend.keys() {
                    Ok(k) => k,
                    Err(e) => return error(StatusCode::INTERNAL_SERVER_ERROR, format!("{e:#}")),
                };
                if let Err((status, msg)) = check_versions(&plan.backends, v, &keys).await {
                    return error(status, msg);
                }
            }
            let mut enc = if arrow {
                Encoder::arrow()
            } else {
                Encoder::Ndjson
            };
            let head = match enc.start() {
                Ok(b) => b,
                Err(e) => {
                    return error(
                        StatusCode::INTERNAL_SERVER_ERROR,
                        format!("encoding the answer: {e:#}"),
                    );
                }
            };
            let (tx, rx) = tokio::sync::mpsc::channel::<Chunk>(plan.tasks.len() + 2);
            let _ = tx.try_send(Ok(head));
            tokio::spawn(run_batch(state, plan, enc, tx));
            let mut resp = Response::new(UnsyncBoxBody::new(Chunks { rx }));
            resp.headers_mut().insert(
                header::CONTENT_TYPE,
                header::HeaderValue::from_static(if arrow {
                    ARROW_STREAM
                } else {
                    "application/x-ndjson"
                }),
            );
            resp
        }
        (_, path) => error(
            StatusCode::NOT_FOUND,
            format!("no route {path}; POST /rollouts or GET /health"),
        ),
    }
}

/// A checked batch: what each rollout runs with.
struct Plan {
    tasks: Vec<Task>,
    group_size: usize,
    weight_version: Option<String>,
    allow_stale: bool,
    cfg: Arc<RlConfig>,
    sampling: Option<Value>,
    /// The batch's own servers (each session pinned to one), or none: the gateway's.
    own_backends: Vec<String>,
    /// Every backend the batch's calls may reach (for the version check).
    backends: Vec<String>,
}

/// Checks a batch before anything runs; the error says what is wrong with it.
fn plan(state: &State, mut batch: Batch) -> Result<Plan, String> {
    if batch.tasks.is_empty() || batch.group_size == 0 {
        return Err("a batch needs at least one task and group_size >= 1".into());
    }
    let mut ids = HashSet::new();
    for t in &batch.tasks {
        if !ids.insert(t.id.as_str()) {
            return Err(format!(
                "task id '{}' is given twice; the answer has one group per task id",
                t.id
            ));
        }
    }
    let mut cfg = state.cfg.clone();
    if let Some(h) = &batch.harness {
        state
            .cfg
            .check_task_harness("(the batch's harness)", Some(h))
            .map_err(|e| format!("{e:#}"))?;
        for t in &mut batch.tasks {
            t.harness.get_or_insert_with(|| h.clone());
        }
    }
    for t in &batch.tasks {
        state
            .cfg
            .check_task_harness(&t.id, t.harness.as_deref())
            .map_err(|e| format!("{e:#}"))?;
    }
    let sampling = match (batch.sampling, batch.temperature) {
        (Some(_), Some(_)) => {
            return Err(
                "give the sampling policy as 'sampling' or only a 'temperature', not both".into(),
            );
        }
        (Some(mut p), None) => {
            let policy: graft_gateway::policy::SamplingPolicy =
                serde_json::from_value(p.clone())
                    .map_err(|e| format!("'sampling' is not a sampling policy: {e}"))?;
            match policy.temperature {
                // The trainer's log-softmax assumes the temperature sampled at.
                Some(t) => cfg.trainer.temperature = t,
                // Never the harness's own (aider sends 0): the config's, as without a policy.
                None => p["temperature"] = json!(cfg.trainer.temperature),
            }
            Some(p)
        }
        (None, Some(t)) => {
            if !t.is_finite() || t < 0.0 {
                return Err(format!("'temperature' must be a number >= 0, got {t}"));
            }
            cfg.trainer.temperature = t;
            None
        }
        (None, None) => None,
    };
    let own_backends = match batch.backends {
        None => vec![],
        Some(b) if b.is_empty() => {
            return Err(
                "'backends' is empty: name the trainer's servers, or leave it out for the config's"
                    .into(),
            );
        }
        Some(b) => b
            .iter()
            .map(|u| {
                graft_gateway::backend::sglang::check_backend_url(u).map_err(|e| e.to_string())
            })
            .collect::<Result<Vec<_>, _>>()?,
    };
    let backends = if own_backends.is_empty() {
        state.backends.clone()
    } else {
        own_backends.clone()
    };
    Ok(Plan {
        tasks: batch.tasks,
        group_size: batch.group_size,
        weight_version: batch.weight_version,
        allow_stale: batch.allow_stale,
        cfg: Arc::new(cfg),
        sampling,
        own_backends,
        backends,
    })
}

/// Every backend must report `version` (`GET /model_info`), else the batch is refused
/// before any rollout runs: 409 when one serves another version, 502 when one cannot say.
async fn check_versions(
    backends: &[String],
    version: &str,
    keys: &crate::rl::backends::Keys,
) -> Result<(), (StatusCode, String)> {
    for b in backends {
        let info = crate::rl::backends::model_info(&keys.api(b))
            .await
            .ok_or_else(|| {
                (
                    StatusCode::BAD_GATEWAY,
                    format!("the backend {b} cannot say which weights it serves (GET /model_info and GET /get_model_info answer no model info)"),
                )
            })?;
        let serves = info.get("weight_version").and_then(Value::as_str);
        if serves != Some(version) {
            return Err((
                StatusCode::CONFLICT,
                format!(
                    "the backend {b} serves weight version {}, the batch asks for '{version}': update its weights first, or leave 'weight_version' out",
                    serves.map_or_else(|| "(none reported)".to_string(), |s| format!("'{s}'"))
                ),
            ));
        }
    }
    Ok(())
}

/// Runs every group of a batch at once (rollouts bounded by `rollout.concurrency`) and sends
/// each group as it finishes, then the end of the answer.
async fn run_batch(
    state: Arc<State>,
    plan: Plan,
    mut enc: Encoder,
    tx: tokio::sync::mpsc::Sender<Chunk>,
) {
    let started = Instant::now();
    let id = uuid::Uuid::new_v4().simple().to_string();
    let plan = Arc::new(plan);
    let mut groups = tokio::task::JoinSet::new();
    for (k, task) in plan.tasks.iter().enumerate() {
        let (state, plan, task) = (state.clone(), plan.clone(), task.clone());
        let group = format!("{}-{}", &id[..12], task.id);
        groups.spawn(async move {
            run_one_group(&state, &plan, &task, &group, k * plan.group_size)
                .await
                .unwrap_or_else(|e| GroupResult::failed(&group, &task.id, format!("{e:#}")))
        });
    }
    let (mut n_groups, mut n_rollouts) = (0, 0);
    while let Some(j) = groups.join_next().await {
        let g = j
            .unwrap_or_else(|e| GroupResult::failed("", "", format!("a group's task failed: {e}")));
        n_groups += 1;
        n_rollouts += g.rollouts.len();
        let chunk = enc.group(&g).map_err(|e| {
            let e = format!("a group could not be encoded: {e:#}");
            tracing::error!(error = %e, "rollouts: the answer breaks off");
            std::io::Error::other(e)
        });
        let broken = chunk.is_err();
        if tx.send(chunk).await.is_err() || broken {
            return; // the client went away
        }
    }
    let summary = json!({"done": true, "groups": n_groups, "rollouts": n_rollouts,
                         "secs": started.elapsed().as_secs_f64()});
    let end = enc.finish(&summary).map_err(|e| {
        let e = format!("the answer could not be closed: {e:#}");
        tracing::error!(error = %e, "rollouts: the answer breaks off");
        std::io::Error::other(e)
    });
    let _ = tx.send(end).await;
}

/// One rollout of a group, as the answer gives it.
struct RolloutRow {
    session_id: String,
    harness: String,
    backend: Option<String>,
    reward: Option<f64>,
    outcome: Value,
    stop_reason: Option<String>,
}

/// A finished group: its rollouts, its samples (each with its stop reason), the weight
/// versions its calls were answered with; or why it failed.
struct GroupResult {
    group_id: String,
    task_id: String,
    error: Option<String>,
    rollouts: Vec<RolloutRow>,
    samples: Vec<Sample>,
    /// Aligned to `samples`: each one's stop reason.
    stop_reasons: Vec<Option<String>>,
    calls_by_weight_version: BTreeMap<String, usize>,
    stale_calls: usize,
    stale_samples: usize,
}

impl GroupResult {
    fn failed(group: &str, task: &str, error: String) -> GroupResult {
        GroupResult {
            group_id: group.to_string(),
            task_id: task.to_string(),
            error: Some(error),
            rollouts: vec![],
            samples: vec![],
            stop_reasons: vec![],
            calls_by_weight_version: BTreeMap::new(),
            stale_calls: 0,
            stale_samples: 0,
        }
    }

    fn json(&self) -> Value {
        let mut v = json!({"group_id": self.group_id, "task_id": self.task_id});
        if let Some(e) = &self.error {
            v["error"] = json!(e);
            return v;
        }
        v["rollouts"] = self
            .rollouts
            .iter()
            .map(|r| {
                json!({
                    "session_id": r.session_id, "harness": r.harness, "backend": r.backend,
                    "reward": r.reward, "outcome": r.outcome, "stop_reason": r.stop_reason,
                })
            })
            .collect();
        v["samples"] = self
            .samples
            .iter()
            .zip(&self.stop_reasons)
            .map(|(s, why)| {
                let mut v = sample_json(s);
                v["stop_reason"] = json!(why);
                v
            })
            .collect();
        v["calls_by_weight_version"] = json!(self.calls_by_weight_version);
        v["stale_calls"] = json!(self.stale_calls);
        v["stale_samples"] = json!(self.stale_samples);
        v
    }
}

/// Whether a sample holds a token sampled by another version than `version` (tokens of an
/// unknown version count for nothing).
fn is_stale(s: &Sample, version: &str) -> bool {
    (0..s.tokens.len()).any(|i| {
        s.loss_mask.get(i) == Some(&1) && s.token_weight_version(i).is_some_and(|v| v != version)
    })
}

async fn run_one_group(
    state: &Arc<State>,
    plan: &Arc<Plan>,
    task: &Task,
    group: &str,
    first: usize,
) -> anyhow::Result<GroupResult> {
    let cfg = &plan.cfg;
    let mut jobs = tokio::task::JoinSet::new();
    for i in 0..plan.group_size {
        // The batch's own servers, in turn over all its rollouts.
        let backend = (!plan.own_backends.is_empty())
            .then(|| plan.own_backends[(first + i) % plan.own_backends.len()].clone());
        let opts = SessionOptions {
            sampling: plan.sampling.clone(),
            backend,
        };
        let (cfg, gw, envd, task, group, sem) = (
            cfg.clone(),
            state.gateway.clone(),
            state.envd.clone(),
            task.clone(),
            group.to_string(),
            state.sem.clone(),
        );
        jobs.spawn(async move {
            let _permit = sem.acquire_owned().await;
            let r = rollout::run(&cfg, &gw, &envd, &task, &group, i, &opts).await;
            (i, opts.backend, r)
        });
    }
    let mut rollouts: Vec<(usize, Option<String>, Rollout)> = vec![];
    while let Some(j) = jobs.join_next().await {
        let (i, backend, r) = j.context("a rollout task failed")?;
        rollouts.push((i, backend, r.context("a rollout could not be run")?));
    }
    rollouts.sort_by_key(|(i, _, _)| *i);
    let scored: HashSet<String> = rollouts
        .iter()
        .filter(|(_, _, r)| r.reward().is_some())
        .map(|(_, _, r)| r.session_id.clone())
        .collect();
    let all: HashSet<String> = rollouts
        .iter()
        .map(|(_, _, r)| r.session_id.clone())
        .collect();
    let path = cfg
        .run
        .out_dir
        .join("rollouts")
        .join(format!("{group}.parquet"));
    let (model, data) = (state.model.clone(), cfg.run.out_dir.join("data"));
    let side_threads = cfg.run.side_threads.policy();
    let sessions: Vec<String> = rollouts
        .iter()
        .map(|(_, _, r)| r.session_id.clone())
        .collect();
    let (samples, versions, finishes) = tokio::task::spawn_blocking(move || {
        let done = samples_from_records(
            &model,
            &data,
            FromRecords {
                sessions: Some(&scored),
                without_token_ids: WithoutTokenIds::Skip,
                count_versions_of: Some(&all),
                side_threads,
                ..FromRecords::all()
            },
            &path,
        )?;
        let samples = read_samples_parquet(&path)?;
        let _ = std::fs::remove_file(&path);
        let finishes = Finishes::read(&data, &sessions)?;
        anyhow::Ok((samples, done.weight_versions, finishes))
    })
    .await
    .context("the reconstruct task failed")??;
    let version = plan.weight_version.as_deref();
    let stale_calls: usize = match version {
        Some(v) => versions
            .iter()
            .filter(|(k, _)| k.as_str() != v)
            .map(|(_, n)| *n)
            .sum(),
        None => 0,
    };
    let n = samples.len();
    let samples: Vec<Sample> = samples
        .into_iter()
        .filter(|s| plan.allow_stale || version.is_none_or(|v| !is_stale(s, v)))
        .collect();
    let stop_reasons = samples.iter().map(|s| finishes.of_sample(s)).collect();
    Ok(GroupResult {
        group_id: group.to_string(),
        task_id: task.id.clone(),
        error: None,
        stale_samples: n - samples.len(),
        rollouts: rollouts
            .iter()
            .map(|(_, backend, r)| RolloutRow {
                session_id: r.session_id.clone(),
                harness: r.harness.clone(),
                backend: backend.clone(),
                reward: r.reward(),
                outcome: outcome(&r.outcome),
                stop_reason: finishes.of_rollout(r),
            })
            .collect(),
        samples,
        stop_reasons,
        calls_by_weight_version: versions.into_iter().collect(),
        stale_calls,
    })
}

/// The `finish_reason` of each recorded call of a group's sessions, and each session's last
/// model call's: what the stop reasons in the answer come from.
#[derive(Debug, Default)]
struct Finishes {
    by_call: BTreeMap<String, Option<String>>,
    last_of_session: BTreeMap<String, Option<String>>,
}

impl Finishes {
    /// Reads only these sessions' records (`graft_recorder::read_session`).
    fn read(data: &std::path::Path, sessions: &[String]) -> anyhow::Result<Finishes> {
        let mut f = Finishes::default();
        for id in sessions {
            let recs = graft_recorder::read_session(data, id)
                .with_context(|| format!("reading session {id}'s records"))?;
            f.add(recs.iter().map(|r| {
                (
                    r.session_id.as_str(),
                    r.call_id.as_str(),
                    r.dialect == "models",
                    r.finish_reason.as_deref(),
                )
            }));
        }
        Ok(f)
    }

    /// (session, call, is a model listing, finish_reason) in each session's seq order.
    fn add<'a>(&mut self, calls: impl Iterator<Item = (&'a str, &'a str, bool, Option<&'a str>)>) {
        for (session, call, listing, finish) in calls {
            if listing {
                continue;
            }
            let finish = finish.map(str::to_owned);
            self.by_call.insert(call.to_owned(), finish.clone());
            self.last_of_session.insert(session.to_owned(), finish);
        }
    }

    /// Its last call's finish reason.
    fn of_sample(&self, s: &Sample) -> Option<String> {
        s.call_ids
            .last()
            .and_then(|c| self.by_call.get(c).cloned().flatten())
    }

    /// Why it stopped: a rollout cut short says so, else its last model call's reason.
    fn of_rollout(&self, r: &Rollout) -> Option<String> {
        match r.outcome {
            Outcome::TimedOut => Some("timeout".into()),
            Outcome::Failed(_) | Outcome::BackendFailed(_) => Some("error".into()),
            Outcome::Scored(_) | Outcome::RewardFailed(_) => {
                self.last_of_session.get(&r.session_id).cloned().flatten()
            }
        }
    }
}

fn outcome(o: &Outcome) -> Value {
    match o {
        Outcome::Scored(_) => json!("scored"),
        Outcome::TimedOut => json!("timed_out"),
        Outcome::RewardFailed(e) => json!({"reward_failed": e}),
        Outcome::BackendFailed(e) => json!({"backend_failed": e}),
        Outcome::Failed(e) => json!({"failed": e}),
    }
}

/// A sample in the samples file's column names (`reconstruct/src/sample.rs`).
fn sample_json(s: &Sample) -> Value {
    json!({
        "sample_id": s.sample_id,
        "session_id": s.session_id,
        "group_id": s.group_id,
        "tokens": s.tokens,
        "loss_mask": s.loss_mask,
        "logprobs": s.logprobs,
        "reward": s.reward,
        "weight_versions": s.weight_versions,
        "token_weight_versions": (0..s.tokens.len()).map(|i| s.token_weight_version(i)).collect::<Vec<_>>(),
        "call_ids": s.call_ids,
        "token_calls": s.token_calls,
        "call_rewards": s.call_rewards,
        "fork_reason": s.fork_reason,
        "events": s.events.iter().map(|e| json!({
            "kind": e.kind.as_str(), "at": e.at, "len": e.len, "reason": e.reason,
            "call_id": e.call_id, "other_sample": e.other_sample,
        })).collect::<Vec<_>>(),
        "tokenizer_fingerprint": s.tokenizer_fingerprint,
        "template_fingerprint": s.template_fingerprint,
        "schema_version": s.schema_version,
        "logprob_kind": s.logprob_kind.as_str(),
        "thread": s.thread,
        "thread_id": s.thread_id,
        "thread_name": s.thread_name,
        "parent_sample": s.parent_sample,
        "rewrites": s.rewrites.iter().map(|r| json!({
            "kind": r.kind.as_str(), "call_id": r.call_id, "against_call": r.against_call,
            "message": r.message, "role": r.role, "before": r.before, "after": r.after,
        })).collect::<Vec<_>>(),
    })
}

/// The answer's body: each chunk sent, until the sender is dropped.
struct Chunks {
    rx: tokio::sync::mpsc::Receiver<Chunk>,
}

impl hyper::body::Body for Chunks {
    type Data = Bytes;
    type Error = std::io::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut TaskContext<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, std::io::Error>>> {
        match self.rx.poll_recv(cx) {
            Poll::Ready(Some(c)) => Poll::Ready(Some(c.map(Frame::data))),
            Poll::Ready(None) => Poll::Ready(None),
            Poll::Pending => Poll::Pending,
        }
    }
}

/// How the answer is written: NDJSON lines, or one Arrow IPC stream.
enum Encoder {
    Ndjson,
    Arrow(Box<arrow_ipc::writer::StreamWriter<Vec<u8>>>),
    /// An Arrow writer that could not start (the error is reported by `start`).
    Broken(String),
}

impl Encoder {
    fn arrow() -> Encoder {
        match arrow_ipc::writer::StreamWriter::try_new(Vec::new(), &answer_schema()) {
            Ok(w) => Encoder::Arrow(Box::new(w)),
            Err(e) => Encoder::Broken(e.to_string()),
        }
    }

    /// What goes first (Arrow: the schema).
    fn start(&mut self) -> anyhow::Result<Bytes> {
        match self {
            Encoder::Ndjson => Ok(Bytes::new()),
            Encoder::Arrow(w) => Ok(Bytes::from(std::mem::take(w.get_mut()))),
            Encoder::Broken(e) => anyhow::bail!("the Arrow stream cannot start: {e}"),
        }
    }

    fn group(&mut self, g: &GroupResult) -> anyhow::Result<Bytes> {
        match self {
            Encoder::Ndjson | Encoder::Broken(_) => Ok(Bytes::from(format!("{}\n", g.json()))),
            Encoder::Arrow(w) => {
                w.write(&group_batch(g)?)?;
                Ok(Bytes::from(std::mem::take(w.get_mut())))
            }
        }
    }

    /// The end (NDJSON: the closing line; Arrow: the end-of-stream marker).
    fn finish(&mut self, summary: &Value) -> anyhow::Result<Bytes> {
        match self {
            Encoder::Ndjson | Encoder::Broken(_) => Ok(Bytes::from(format!("{summary}\n"))),
            Encoder::Arrow(w) => {
                w.finish()?;
                Ok(Bytes::from(std::mem::take(w.get_mut())))
            }
        }
    }
}

fn rollout_fields() -> Fields {
    Fields::from(vec![
        Field::new("session_id", DataType::Utf8, false),
        Field::new("harness", DataType::Utf8, false),
        Field::new("backend", DataType::Utf8, true),
        Field::new("reward", DataType::Float64, true),
        // "scored", "timed_out", "reward_failed", "backend_failed" or "failed"
        Field::new("outcome", DataType::Utf8, false),
        // why, for the three failures
        Field::new("outcome_detail", DataType::Utf8, true),
        Field::new("stop_reason", DataType::Utf8, true),
    ])
}

/// The samples file's columns plus each sample's stop reason.
fn sample_fields() -> Fields {
    let mut f: Vec<Arc<Field>> = samples_schema().fields().iter().cloned().collect();
    f.push(Arc::new(Field::new("stop_reason", DataType::Utf8, true)));
    Fields::from(f)
}

fn version_fields() -> Fields {
    Fields::from(vec![
        Field::new("weight_version", DataType::Utf8, false),
        Field::new("calls", DataType::UInt64, false),
    ])
}

fn list_of(name: &str, fields: Fields) -> Field {
    Field::new(
        name,
        DataType::List(Arc::new(Field::new_list_field(
            DataType::Struct(fields),
            true,
        ))),
        false,
    )
}

/// The Arrow answer's schema: one row per group.
pub fn answer_schema() -> SchemaRef {
    Arc::new(Schema::new(vec![
        Field::new("group_id", DataType::Utf8, false),
        Field::new("task_id", DataType::Utf8, false),
        Field::new("error", DataType::Utf8, true),
        list_of("rollouts", rollout_fields()),
        list_of("samples", sample_fields()),
        list_of("calls_by_weight_version", version_fields()),
        Field::new("stale_calls", DataType::UInt64, false),
        Field::new("stale_samples", DataType::UInt64, false),
    ]))
}

/// `rows` (a batch of `fields`) as one list cell.
fn one_cell(fields: Fields, rows: Vec<ArrayRef>) -> anyhow::Result<ArrayRef> {
    let item = Arc::new(Field::new_list_field(
        DataType::Struct(fields.clone()),
        true,
    ));
    let values = StructArray::try_new(fields, rows, None)?;
    let n = values.len();
    Ok(Arc::new(ListArray::try_new(
        item,
        OffsetBuffer::from_lengths([n]),
        Arc::new(values),
        None,
    )?))
}

/// A group as one Arrow row in `answer_schema`.
fn group_batch(g: &GroupResult) -> anyhow::Result<RecordBatch> {
    let (mut session, mut harness, mut backend) = (
        StringBuilder::new(),
        StringBuilder::new(),
        StringBuilder::new(),
    );
    let (mut reward, mut kind, mut detail, mut stop) = (
        Float64Builder::new(),
        StringBuilder::new(),
        StringBuilder::new(),
        StringBuilder::new(),
    );
    for r in &g.rollouts {
        session.append_value(&r.session_id);
        harness.append_value(&r.harness);
        backend.append_option(r.backend.as_deref());
        reward.append_option(r.reward);
        let (k, d) = match &r.outcome {
            Value::Object(m) => match m.iter().next() {
                Some((k, v)) => (
                    k.clone(),
                    Some(v.as_str().map_or(v.to_string(), str::to_owned)),
                ),
                None => ("failed".to_string(), None),
            },
            v => (v.as_str().unwrap_or("failed").to_string(), None),
        };
        kind.append_value(k);
        detail.append_option(d);
        stop.append_option(r.stop_reason.as_deref());
    }
    let rollouts = one_cell(
        rollout_fields(),
        vec![
            Arc::new(session.finish()),
            Arc::new(harness.finish()),
            Arc::new(backend.finish()),
            Arc::new(reward.finish()),
            Arc::new(kind.finish()),
            Arc::new(detail.finish()),
            Arc::new(stop.finish()),
        ],
    )?;
    let mut cols = samples_batch(&g.samples)?.columns().to_vec();
    cols.push(Arc::new(StringArray::from_iter(
        g.stop_reasons.iter().map(Option::as_deref),
    )));
    let samples = one_cell(sample_fields(), cols)?;
    let (mut version, mut calls) = (StringBuilder::new(), UInt64Builder::new());
    for (v, n) in &g.calls_by_weight_version {
        version.append_value(v);
        calls.append_value(*n as u64);
    }
    let versions = one_cell(
        version_fields(),
        vec![Arc::new(version.finish()), Arc::new(calls.finish())],
    )?;
    Ok(RecordBatch::try_new(
        answer_schema(),
        vec![
            Arc::new(StringArray::from(vec![g.group_id.as_str()])),
            Arc::new(StringArray::from(vec![g.task_id.as_str()])),
            Arc::new(StringArray::from(vec![g.error.as_deref()])),
            rollouts,
            samples,
            versions,
            Arc::new(arrow_array::UInt64Array::from(vec![g.stale_calls as u64])),
            Arc::new(arrow_array::UInt64Array::from(vec![g.stale_samples as u64])),
        ],
    )?)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn rollout(session: &str, outcome: Outcome) -> Rollout {
        Rollout {
            task_id: "t".into(),
            group_id: "g".into(),
            session_id: session.into(),
            harness: "h".into(),
            outcome,
            harness_exit: None,
            harness_oom: false,
            harness_secs: 0.0,
            reward_secs: 0.0,
            harness_tail: String::new(),
        }
    }

    #[test]
    fn stop_reasons_come_from_the_last_call_or_from_why_the_rollout_ended() {
        let mut f = Finishes::default();
        f.add(
            [
                ("a", "a1", false, Some("tool_calls")),
                ("a", "a2", false, Some("stop")),
                ("a", "a3", true, None), // a model listing after the last call counts for nothing
                ("b", "b1", false, Some("length")),
                ("c", "c1", false, None),
            ]
            .into_iter(),
        );
        // A sample ends where its last call ended (a fork's first part: at the tool call).
        let s = |calls: &[&str]| Sample {
            call_ids: calls.iter().map(|c| c.to_string()).collect(),
            ..Sample::default()
        };
        assert_eq!(f.of_sample(&s(&["a1"])).as_deref(), Some("tool_calls"));
        assert_eq!(f.of_sample(&s(&["a1", "a2"])).as_deref(), Some("stop"));
        assert_eq!(f.of_sample(&s(&["b1"])).as_deref(), Some("length"));
        assert_eq!(f.of_sample(&s(&["c1"])), None);
        assert_eq!(f.of_sample(&s(&[])), None);
        let of = |session: &str, o: Outcome| f.of_rollout(&rollout(session, o));
        assert_eq!(of("a", Outcome::Scored(1.0)).as_deref(), Some("stop"));
        assert_eq!(
            of("b", Outcome::RewardFailed("x".into())).as_deref(),
            Some("length")
        );
        assert_eq!(of("a", Outcome::TimedOut).as_deref(), Some("timeout"));
        assert_eq!(
            of("a", Outcome::Failed("x".into())).as_deref(),
            Some("error")
        );
        assert_eq!(
            of("b", Outcome::BackendFailed("x".into())).as_deref(),
            Some("error")
        );
        assert_eq!(of("none", Outcome::Scored(0.0)), None);
    }

    fn sample(id: &str, versions: &[&str], token_versions: &[Option<u32>]) -> Sample {
        Sample {
            sample_id: id.into(),
            session_id: format!("s-{id}"),
            tokens: vec![1, 2, 3, 4],
            loss_mask: vec![0, 1, 1, 0],
            logprobs: vec![None, Some(-0.5), None, None],
            weight_versions: versions.iter().map(|v| v.to_string()).collect(),
            token_weight_versions: token_versions.to_vec(),
            ..Sample::default()
        }
    }

    #[test]
    fn a_sample_is_stale_when_a_sampled_token_has_another_version() {
        let s = sample("a", &["v1", "v2"], &[None, Some(0), Some(1), None]);
        assert_eq!(s.token_weight_version(1), Some("v1"));
        assert!(is_stale(&s, "v1"), "token 2 was sampled by v2");
        assert!(is_stale(&s, "v2"), "token 1 was sampled by v1");
        let one = sample("b", &["v1"], &[None, Some(0), Some(0), None]);
        assert!(!is_stale(&one, "v1"));
        assert!(is_stale(&one, "v0"));
        let unknown = sample("c", &[], &[]);
        assert!(
            !is_stale(&unknown, "v1"),
            "an unknown version counts for nothing"
        );
    }

    /// The Arrow answer: one row per group, read back by Arrow's own stream reader, with the
    /// rollouts, the samples (their columns and stop reasons) and the version counts.
    #[test]
    fn groups_round_trip_through_the_arrow_stream() {
        let g = GroupResult {
            group_id: "g1".into(),
            task_id: "t1".into(),
            error: None,
            rollouts: vec![
                RolloutRow {
                    session_id: "s-a".into(),
                    harness: "agent".into(),
                    backend: Some("http://127.0.0.1:1".into()),
                    reward: Some(1.0),
                    outcome: json!("scored"),
                    stop_reason: Some("stop".into()),
                },
                RolloutRow {
                    session_id: "s-b".into(),
                    harness: "agent".into(),
                    backend: None,
                    reward: None,
                    outcome: json!({"failed": "no sandbox"}),
                    stop_reason: Some("error".into()),
                },
            ],
            samples: vec![sample("a", &["v1"], &[None, Some(0), Some(0), None])],
            stop_reasons: vec![Some("stop".into())],
            calls_by_weight_version: [("v1".to_string(), 2)].into_iter().collect(),
            stale_calls: 0,
            stale_samples: 1,
        };
        let failed = GroupResult::failed("g2", "t2", "boom".into());
        let mut enc = Encoder::arrow();
        let mut bytes = enc.start().unwrap().to_vec();
        bytes.extend_from_slice(&enc.group(&g).unwrap());
        bytes.extend_from_slice(&enc.group(&failed).unwrap());
        bytes.extend_from_slice(&enc.finish(&json!({})).unwrap());
        let reader = arrow_ipc::reader::StreamReader::try_new(&bytes[..], None).unwrap();
        let batches: Vec<RecordBatch> = reader.map(|b| b.unwrap()).collect();
        assert_eq!(batches.len(), 2);
        assert_eq!(batches[0].schema(), answer_schema());
        let col = |b: &RecordBatch, name: &str| b.column_by_name(name).unwrap().clone();
        let strings = |a: &ArrayRef| {
            a.as_any()
                .downcast_ref::<StringArray>()
                .unwrap()
                .iter()
                .map(|s| s.map(str::to_owned))
                .collect::<Vec<_>>()
        };
        let cell = |b: &RecordBatch, name: &str| {
            let l = col(b, name);
            let l = l.as_any().downcast_ref::<ListArray>().unwrap();
            let v = l.value(0);
            v.as_any().downcast_ref::<StructArray>().unwrap().clone()
        };
        let b = &batches[0];
        assert_eq!(strings(&col(b, "group_id")), vec![Some("g1".into())]);
        let r = cell(b, "rollouts");
        assert_eq!(
            strings(r.column_by_name("outcome").unwrap()),
            vec![Some("scored".into()), Some("failed".into())]
        );
        assert_eq!(
            strings(r.column_by_name("outcome_detail").unwrap()),
            vec![None, Some("no sandbox".into())]
        );
        assert_eq!(
            strings(r.column_by_name("backend").unwrap()),
            vec![Some("http://127.0.0.1:1".into()), None]
        );
        // The samples cell is the samples file's batch plus stop_reason: read back as samples.
        let sm = cell(b, "samples");
        let cols: Vec<ArrayRef> = sm
            .columns()
            .iter()
            .take(samples_schema().fields().len())
            .cloned()
            .collect();
        let back = RecordBatch::try_new(samples_schema(), cols).unwrap();
        let want = samples_batch(&g.samples).unwrap();
        assert_eq!(back, want);
        assert_eq!(
            strings(sm.column_by_name("stop_reason").unwrap()),
            vec![Some("stop".into())]
        );
        let stale = col(b, "stale_samples");
        let stale = stale
            .as_any()
            .downcast_ref::<arrow_array::UInt64Array>()
            .unwrap();
        assert_eq!(stale.value(0), 1);
        let b = &batches[1];
        assert_eq!(strings(&col(b, "error")), vec![Some("boom".into())]);
        assert_eq!(cell(b, "samples").len(), 0);
    }
}

//! `graft rollouts serve --config rl.toml`: graft as the rollout engine of another trainer
//! (verl, TRL, SkyRL, slime, OpenRLHF). The config names the harness, envd and the backend
//! (the trainer's own SGLang servers in `backend.urls`), as for `graft rl`; the same
//! components start in this process (`crate::rl::start`). Each request is a batch of tasks:
//!
//! ```text
//! POST /rollouts {"tasks": [{"id", "prompt", "setup", "reward": {"command"}}, ...],
//!                 "group_size": 4, "weight_version": "step-12", "temperature": 1.0}
//! → 200 application/x-ndjson, one line per group as it finishes:
//!   {"group_id", "task_id", "rollouts": [{"session_id", "reward", "outcome", "stop_reason"}],
//!    "samples": [{"sample_id", "session_id", "group_id", "tokens", "loss_mask", "logprobs",
//!                 "reward", "weight_versions", "token_weight_versions", "stop_reason"}],
//!    "calls_by_weight_version": {...}, "stale_calls": n}
//!   then {"done": true, "groups", "rollouts", "secs"}
//! ```
//!
//! Each rollout is `graft rl`'s (`crate::rl::rollout::run`: a gateway session, a sandbox,
//! the harness, the reward command); the group's scored sessions are reconstructed from the
//! records into samples. The trainer keeps control of the weights: `weight_version` is the
//! version it says its servers serve, and `stale_calls` counts the group's calls that a
//! backend answered with another version. Groups are not grown or filtered (no BAR): every
//! scored rollout's samples come back.
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
use bytes::Bytes;
use graft_reconstruct::records::{FromRecords, WithoutTokenIds, samples_from_records};
use graft_reconstruct::retokenize::Model;
use graft_reconstruct::sample::{Sample, read_samples_parquet};
use http::{Method, Response, StatusCode, header};
use http_body_util::{BodyExt, Full, combinators::UnsyncBoxBody};
use hyper::body::{Frame, Incoming};
use serde::Deserialize;
use serde_json::{Value, json};

use crate::rl::config::RlConfig;
use crate::rl::rollout::{self, Outcome, Rollout};
use crate::rl::tasks::Task;

type RespBody = UnsyncBoxBody<Bytes, Infallible>;

#[derive(Debug, clap::Subcommand)]
pub enum RolloutsCommand {
    /// The rollout service: POST /rollouts runs a batch of tasks in the harness and streams
    /// token-level samples with rewards back, one NDJSON line per finished group.
    Serve(ServeArgs),
}

#[derive(Debug, clap::Args)]
pub struct ServeArgs {
    /// The harness, envd and backend, as for `graft rl` (its `[tasks]` file is not read).
    #[arg(long)]
    pub config: PathBuf,
    /// Address to listen on (port 0 picks a free port; the real address is printed).
    #[arg(long, default_value = "127.0.0.1:0")]
    pub listen: SocketAddr,
}

/// One request: the tasks, how many rollouts per task, the trainer's weight version.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct Batch {
    tasks: Vec<Task>,
    #[serde(default = "one")]
    group_size: usize,
    #[serde(default)]
    weight_version: Option<String>,
    /// The temperature the sessions sample at (enforced); the config's by default.
    #[serde(default)]
    temperature: Option<f64>,
}

fn one() -> usize {
    1
}

struct State {
    cfg: RlConfig,
    model: Arc<Model>,
    gateway: rollout::Api,
    envd: rollout::Api,
    sem: Arc<tokio::sync::Semaphore>,
}

pub async fn run(cmd: RolloutsCommand) -> anyhow::Result<()> {
    let RolloutsCommand::Serve(a) = cmd;
    let cfg = RlConfig::load(&a.config)?;
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
        crate::cli::shutdown_signal(),
    )
    .await;
    c.stop().await;
    Ok(())
}

fn json_response(status: StatusCode, v: &Value) -> Response<RespBody> {
    let mut resp = Response::new(Full::new(Bytes::from(v.to_string())).boxed_unsync());
    *resp.status_mut() = status;
    resp.headers_mut().insert(
        header::CONTENT_TYPE,
        header::HeaderValue::from_static("application/json"),
    );
    resp
}

fn error(status: StatusCode, message: String) -> Response<RespBody> {
    json_response(status, &json!({"error": {"message": message}}))
}

async fn handle(state: Arc<State>, req: hyper::Request<Incoming>) -> Response<RespBody> {
    match (req.method(), req.uri().path()) {
        (&Method::GET, "/health") => json_response(StatusCode::OK, &json!({"ok": true})),
        (&Method::POST, "/rollouts") => {
            let body = match req.into_body().collect().await {
                Ok(b) => b.to_bytes(),
                Err(e) => return error(StatusCode::BAD_REQUEST, format!("reading the body: {e}")),
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
            if batch.tasks.is_empty() || batch.group_size == 0 {
                return error(
                    StatusCode::BAD_REQUEST,
                    "a batch needs at least one task and group_size >= 1".into(),
                );
            }
            let (tx, rx) = tokio::sync::mpsc::channel::<Value>(batch.tasks.len() + 1);
            tokio::spawn(run_batch(state, batch, tx));
            let mut resp = Response::new(UnsyncBoxBody::new(Lines { rx }));
            resp.headers_mut().insert(
                header::CONTENT_TYPE,
                header::HeaderValue::from_static("application/x-ndjson"),
            );
            resp
        }
        (_, path) => error(
            StatusCode::NOT_FOUND,
            format!("no route {path}; POST /rollouts or GET /health"),
        ),
    }
}

/// Runs every group of a batch at once (rollouts bounded by `rollout.concurrency`) and sends
/// each group's line as it finishes, then the closing line.
async fn run_batch(state: Arc<State>, batch: Batch, tx: tokio::sync::mpsc::Sender<Value>) {
    let started = Instant::now();
    let id = uuid::Uuid::new_v4().simple().to_string();
    let mut cfg = state.cfg.clone();
    if let Some(t) = batch.temperature {
        cfg.trainer.temperature = t;
    }
    let cfg = Arc::new(cfg);
    let mut groups = tokio::task::JoinSet::new();
    for task in batch.tasks {
        let (state, cfg, version) = (state.clone(), cfg.clone(), batch.weight_version.clone());
        let group = format!("{}-{}", &id[..12], task.id);
        let n = batch.group_size;
        groups.spawn(async move {
            run_one_group(&state, &cfg, &task, &group, n, version.as_deref())
                .await
                .unwrap_or_else(
                    |e| json!({"group_id": group, "task_id": task.id, "error": format!("{e:#}")}),
                )
        });
    }
    let (mut n_groups, mut n_rollouts) = (0, 0);
    while let Some(j) = groups.join_next().await {
        let line = j.unwrap_or_else(|e| json!({"error": format!("a group's task failed: {e}")}));
        n_groups += 1;
        n_rollouts += line["rollouts"].as_array().map_or(0, Vec::len);
        if tx.send(line).await.is_err() {
            return; // the client went away
        }
    }
    let _ = tx
        .send(
            json!({"done": true, "groups": n_groups, "rollouts": n_rollouts,
                     "secs": started.elapsed().as_secs_f64()}),
        )
        .await;
}

async fn run_one_group(
    state: &Arc<State>,
    cfg: &Arc<RlConfig>,
    task: &Task,
    group: &str,
    n: usize,
    version: Option<&str>,
) -> anyhow::Result<Value> {
    let mut jobs = tokio::task::JoinSet::new();
    for i in 0..n {
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
            (i, rollout::run(&cfg, &gw, &envd, &task, &group, i).await)
        });
    }
    let mut rollouts: Vec<(usize, Rollout)> = vec![];
    while let Some(j) = jobs.join_next().await {
        let (i, r) = j.context("a rollout task failed")?;
        rollouts.push((i, r.context("a rollout could not be run")?));
    }
    rollouts.sort_by_key(|(i, _)| *i);
    let scored: HashSet<String> = rollouts
        .iter()
        .filter(|(_, r)| r.reward().is_some())
        .map(|(_, r)| r.session_id.clone())
        .collect();
    let all: HashSet<String> = rollouts.iter().map(|(_, r)| r.session_id.clone()).collect();
    let path = cfg
        .run
        .out_dir
        .join("rollouts")
        .join(format!("{group}.parquet"));
    let (model, data) = (state.model.clone(), cfg.run.out_dir.join("data"));
    let sessions: Vec<String> = rollouts.iter().map(|(_, r)| r.session_id.clone()).collect();
    let (samples, versions, finishes) = tokio::task::spawn_blocking(move || {
        let done = samples_from_records(
            &model,
            &data,
            FromRecords {
                sessions: Some(&scored),
                without_token_ids: WithoutTokenIds::Skip,
                count_versions_of: Some(&all),
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
    let stale: usize = match version {
        Some(v) => versions
            .iter()
            .filter(|(k, _)| k.as_str() != v)
            .map(|(_, n)| *n)
            .sum(),
        None => 0,
    };
    Ok(json!({
        "group_id": group,
        "task_id": task.id,
        "rollouts": rollouts.iter().map(|(_, r)| json!({
            "session_id": r.session_id,
            "reward": r.reward(),
            "outcome": outcome(&r.outcome),
            "stop_reason": finishes.of_rollout(r),
        })).collect::<Vec<_>>(),
        "samples": samples.iter().map(|s| {
            let mut v = sample_json(s);
            v["stop_reason"] = json!(finishes.of_sample(s));
            v
        }).collect::<Vec<_>>(),
        "calls_by_weight_version": versions.into_iter().collect::<BTreeMap<_, _>>(),
        "stale_calls": stale,
    }))
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
    })
}

/// The NDJSON body: one line per value sent, until the sender is dropped.
struct Lines {
    rx: tokio::sync::mpsc::Receiver<Value>,
}

impl hyper::body::Body for Lines {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut TaskContext<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        match self.rx.poll_recv(cx) {
            Poll::Ready(Some(v)) => {
                Poll::Ready(Some(Ok(Frame::data(Bytes::from(format!("{v}\n"))))))
            }
            Poll::Ready(None) => Poll::Ready(None),
            Poll::Pending => Poll::Pending,
        }
    }
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
}

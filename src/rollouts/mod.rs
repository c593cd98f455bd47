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
//!   of structs in the samples file's schema plus `stop_reason` (see `encode.rs`, `answer_schema`).
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
//!
//! The service by concern: `plan` checks a batch (and the backends' weight version) before
//! anything runs; `groups` runs a group's rollouts and reconstructs its samples; `encode`
//! writes a finished group as an NDJSON line or an Arrow IPC batch; `server` answers the
//! HTTP routes and streams a batch's groups as they finish. This file is the command and
//! its configuration.

mod encode;
mod groups;
mod plan;
mod server;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;

use anyhow::Context;
use graft_reconstruct::retokenize::Model;

use crate::rl::config::RlConfig;

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

/// The rollout service's settings: what `graft rollouts serve` reads from its flags, and
/// what a user in the same process gives [`start`].
#[derive(Debug, Clone)]
pub struct RolloutsConfig {
    /// The harnesses, envd and backend, as for `graft rl` (`[tasks]` and `run.steps` are not
    /// used: tasks come with each request).
    pub rl: RlConfig,
    /// Address to listen on (port 0 picks a free port).
    pub listen: SocketAddr,
    /// The largest rollout batch read; a longer body is answered 413.
    pub max_body_bytes: usize,
}

impl TryFrom<&ServeArgs> for RolloutsConfig {
    type Error = anyhow::Error;

    /// Loads the config file and checks that the files it names exist.
    fn try_from(a: &ServeArgs) -> anyhow::Result<Self> {
        let rl = RlConfig::load(&a.config)?;
        rl.check_files()?;
        Ok(RolloutsConfig {
            rl,
            listen: a.listen,
            max_body_bytes: a.max_body_bytes,
        })
    }
}

pub async fn run(cmd: RolloutsCommand) -> anyhow::Result<()> {
    let RolloutsCommand::Serve(a) = cmd;
    let (addr, serve) = start(RolloutsConfig::try_from(&a)?).await?;
    println!("graft rollouts listening on http://{addr}");
    serve.await;
    Ok(())
}

/// Loads the model's tokenizer, starts `graft rl`'s components (`crate::rl::start`) and
/// binds; returns the bound address and the future that serves until Ctrl-C or SIGTERM, then
/// stops the components.
pub async fn start(
    cfg: RolloutsConfig,
) -> anyhow::Result<(SocketAddr, impl std::future::Future<Output = ()> + use<>)> {
    let RolloutsConfig {
        rl: cfg,
        listen,
        max_body_bytes,
    } = cfg;
    let model = Model::from_dir(&cfg.backend.model_dir).with_context(|| {
        format!(
            "loading the model's tokenizer and template from {}",
            cfg.backend.model_dir.display()
        )
    })?;
    std::fs::create_dir_all(cfg.run.out_dir.join("rollouts"))
        .with_context(|| format!("creating {}", cfg.run.out_dir.display()))?;
    let c = crate::rl::start(&cfg).await?;
    let listener = tokio::net::TcpListener::bind(listen)
        .await
        .with_context(|| format!("cannot listen on {listen}"))?;
    let addr = listener.local_addr()?;
    let runner = groups::Runner {
        sem: Arc::new(tokio::sync::Semaphore::new(cfg.rollout.concurrency.max(1))),
        model: Arc::new(model),
        gateway: c.gateway.clone(),
        envd: c.envd.clone(),
    };
    let state = Arc::new(server::State {
        cfg,
        runner,
        backends: c.backends.clone(),
        max_body_bytes,
    });
    Ok((addr, async move {
        server::serve(listener, state).await;
        c.stop().await;
    }))
}

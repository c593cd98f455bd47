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
mod checkpoints;
mod collect;
pub mod config;
mod finish;
mod progress;
pub mod rollout;
mod startup;
mod state;
mod steps;
pub mod tasks;
#[cfg(feature = "trainer")]
mod training;

pub(crate) use startup::start;

use std::path::PathBuf;

use anyhow::Context;
use graft_reconstruct::retokenize::Model;
use http::Method;

use config::RlConfig;

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
    let result = steps::steps(&cfg, &tasks, &model, &c).await;
    c.stop().await;
    result
}

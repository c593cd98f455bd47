//! `graft train`: one GRPO iteration over a samples file (from `graft reconstruct`):
//! select (groups, advantages, optional Balanced Adaptive Rollout), train, write the new
//! weights as an HF directory with the optimizer state beside them, and optionally push
//! them to an SGLang-compatible server. A thin CLI over [`graft_trainer::step::run_step`].

use std::io::Write;
use std::path::PathBuf;

use clap::ValueEnum;
use graft_trainer::step::{self, PolicyChoice, PushTarget, StepError, StepEvent, StepRequest};

#[derive(Debug, Clone, Copy, ValueEnum, PartialEq, Eq)]
pub enum Policy {
    /// π_old = the rollout logprobs (one optimizer step per batch).
    Bypass,
    /// π_old = the trainer's own logprobs, with the truncated importance weight.
    Recompute,
}

#[derive(Debug, clap::Args)]
pub struct TrainArgs {
    /// Samples Parquet file(s) written by `graft reconstruct`.
    #[arg(long, required = true, num_args = 1..)]
    pub samples: Vec<PathBuf>,
    /// The policy: an HF model directory (config.json + safetensors), or a directory an
    /// earlier `graft train --out` wrote (its optimizer state is resumed).
    #[arg(long)]
    pub model: PathBuf,
    /// Where the new weights (HF layout) and optimizer state go.
    #[arg(long)]
    pub out: PathBuf,
    #[arg(long, default_value_t = 1e-6)]
    pub lr: f64,
    /// Optimizer steps per pass over the samples (the samples are dealt round-robin
    /// into this many mini-batches).
    #[arg(long, default_value_t = 1)]
    pub mini_batches: usize,
    /// Passes over the samples.
    #[arg(long, default_value_t = 1)]
    pub epochs: usize,
    /// Where π_old comes from; default: bypass for a single step, recompute otherwise.
    #[arg(long, value_enum)]
    pub policy: Option<Policy>,
    /// The rollouts' sampling temperature.
    #[arg(long, default_value_t = 1.0)]
    pub temperature: f64,
    /// Padded tokens per micro-batch.
    #[arg(long, default_value_t = 16384)]
    pub micro_batch_tokens: usize,
    /// k3 KL coefficient (0: off); needs --ref-model.
    #[arg(long, default_value_t = 0.0)]
    pub kl_coef: f64,
    /// The frozen reference policy of the KL term (usually the model RL started from).
    #[arg(long)]
    pub ref_model: Option<PathBuf>,
    /// Choose each group's rollouts by Balanced Adaptive Rollout (8 of up to 16, 37.5%
    /// to 62.5% positive).
    #[arg(long)]
    pub bar: bool,
    /// After writing, push the weights to this SGLang-compatible server
    /// (pause → flush_cache → update_weights_from_disk → continue).
    #[arg(long)]
    pub push: Option<String>,
    /// The weight_version the pushed weights are served as (default: the out dir's name).
    #[arg(long)]
    pub weight_version: Option<String>,
    /// The environment variable holding the push server's key (its `--admin-api-key`, else
    /// its `--api-key`), for a server started with one.
    #[arg(long, value_name = "VAR")]
    pub push_key_env: Option<String>,
    /// Seed for libtorch.
    #[arg(long, default_value_t = 0)]
    pub seed: i64,
    /// Activation checkpointing: recompute each decoder layer's activations in the
    /// backward instead of keeping them (less memory, one more forward of the layers).
    #[arg(long)]
    pub checkpoint_layers: bool,
}

impl TrainArgs {
    /// The library request these flags describe.
    pub fn request(&self) -> StepRequest {
        StepRequest {
            samples: self.samples.clone(),
            model: self.model.clone(),
            out: self.out.clone(),
            lr: self.lr,
            mini_batches: self.mini_batches,
            epochs: self.epochs,
            policy: match self.policy {
                Some(Policy::Bypass) => PolicyChoice::Bypass,
                Some(Policy::Recompute) => PolicyChoice::Recompute,
                None => PolicyChoice::Auto,
            },
            temperature: self.temperature,
            micro_batch_tokens: self.micro_batch_tokens,
            kl_coef: self.kl_coef,
            ref_model: self.ref_model.clone(),
            bar: self.bar,
            push: self.push.clone().map(|url| PushTarget {
                url,
                weight_version: self.weight_version.clone(),
                api_key: self
                    .push_key_env
                    .as_deref()
                    .and_then(|v| std::env::var(v).ok()),
            }),
            seed: self.seed,
            tis_level: graft_trainer::grpo::Level::Token,
            reject: None,
            checkpoint_layers: self.checkpoint_layers,
        }
    }
}

fn selection_line(c: &step::SelectionCounts) -> String {
    format!(
        "graft train: {} samples read; {} groups, {} dropped (no signal), {} relaxed; {} sessions without a reward; {} samples train",
        c.read, c.groups, c.groups_dropped, c.groups_relaxed, c.sessions_without_reward, c.train
    )
}

pub fn run(a: TrainArgs) -> anyhow::Result<()> {
    if let Some(var) = &a.push_key_env
        && std::env::var(var).is_err()
    {
        anyhow::bail!("--push-key-env names {var}, which is not set");
    }
    let mut out = std::io::stdout().lock();
    let mut write_err = None;
    let report = step::run_step(&a.request(), |ev| match ev {
        StepEvent::Selected(c) => eprintln!("{}", selection_line(c)),
        StepEvent::Loaded {
            parameters,
            device,
            compute_kind,
            cpu_reason,
        } => eprintln!(
            "graft train: {parameters} parameters on {device} ({compute_kind}){}",
            cpu_reason
                .map(|r| format!("; CPU because {r}"))
                .unwrap_or_default()
        ),
        StepEvent::Resumed(at) => eprintln!("graft train: resumed the optimizer at step {at}"),
        StepEvent::Step(s) => {
            if let Err(e) = writeln!(out, "{}", step::step_line(s)) {
                write_err.get_or_insert(e);
            }
        }
    });
    if let Some(e) = write_err {
        return Err(e.into());
    }
    let report = match report {
        Err(StepError::NoLearningSignal(c)) => {
            eprintln!("{}", selection_line(&c));
            return Err(StepError::NoLearningSignal(c).into());
        }
        r => r?,
    };
    if report.recompute_forced {
        eprintln!(
            "graft train: some samples have no rollout logprobs (re-tokenized text): used the recompute policy"
        );
    }
    if let Some(c) = &report.checkpoint {
        writeln!(out, "weights written to {}", c.display())?;
    }
    if let Some((url, version)) = &report.pushed {
        writeln!(out, "pushed to {url} as weight_version {version}")?;
    }
    Ok(())
}

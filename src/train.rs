//! `graft train`: one GRPO iteration over a samples file (from `graft reconstruct`):
//! select (groups, advantages, optional Balanced Adaptive Rollout), train, write the new
//! weights as an HF directory with the optimizer state beside them, and optionally push
//! them to an SGLang-compatible server.

use std::io::Write;
use std::path::PathBuf;

use anyhow::Context;
use clap::ValueEnum;
use graft_trainer::bar::BarConfig;
use graft_trainer::grpo::{GrpoConfig, PolicyMode};
use graft_trainer::model::Model;
use graft_trainer::optim::AdamWConfig;
use graft_trainer::train::{self, TrainConfig, Trainer};

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
    /// Seed for libtorch.
    #[arg(long, default_value_t = 0)]
    pub seed: i64,
}

pub fn run(a: TrainArgs) -> anyhow::Result<()> {
    if a.kl_coef != 0.0 && a.ref_model.is_none() {
        anyhow::bail!(
            "--kl-coef needs --ref-model DIR (the frozen reference policy, usually the model RL started from)"
        );
    }
    let dev = graft_trainer::device::init();
    graft_trainer::tch::manual_seed(a.seed);
    let mut samples = Vec::new();
    for path in &a.samples {
        samples.extend(
            graft_reconstruct::sample::read_samples_parquet(path)
                .with_context(|| format!("reading samples from {}", path.display()))?,
        );
    }
    let bar = a.bar.then(BarConfig::default);
    let sel = train::select_samples(&samples, bar.as_ref(), 1e-6);
    eprintln!(
        "graft train: {} samples read; {} groups, {} dropped (no signal), {} relaxed; {} sessions without a reward; {} samples train",
        samples.len(),
        sel.groups,
        sel.groups_dropped,
        sel.groups_relaxed,
        sel.sessions_without_reward,
        sel.samples.len()
    );
    if sel.samples.is_empty() {
        anyhow::bail!(
            "no sample has a learning signal: every group is missing rewards or has equal rewards; give sessions a group_id and a reward"
        );
    }
    let mode = match a.policy {
        Some(Policy::Bypass) => PolicyMode::Bypass,
        Some(Policy::Recompute) => PolicyMode::Recompute,
        None if a.mini_batches <= 1 && a.epochs <= 1 => PolicyMode::Bypass,
        None => PolicyMode::Recompute,
    };
    let mode = if mode == PolicyMode::Bypass
        && sel.samples.iter().any(|s| s.rollout_logprobs.is_none())
    {
        eprintln!(
            "graft train: some samples have no rollout logprobs (re-tokenized text): using the recompute policy"
        );
        PolicyMode::Recompute
    } else {
        mode
    };
    let model = Model::load(&a.model, dev.device, dev.compute_kind())
        .with_context(|| format!("loading the model from {}", a.model.display()))?;
    eprintln!(
        "graft train: {} parameters on {:?} ({:?}){}",
        model.spec().num_parameters(),
        dev.device,
        dev.compute_kind(),
        dev.cpu_reason
            .as_ref()
            .map(|r| format!("; CPU because {r}"))
            .unwrap_or_default()
    );
    let config = TrainConfig {
        grpo: GrpoConfig {
            mode,
            kl_coef: a.kl_coef,
            temperature: a.temperature,
            ..GrpoConfig::default()
        },
        optim: AdamWConfig {
            lr: a.lr,
            ..AdamWConfig::default()
        },
        micro_batch_tokens: a.micro_batch_tokens,
        bar,
        advantage_eps: 1e-6,
    };
    let mut trainer = Trainer::new(model, config)?;
    if let (Some(dir), true) = (&a.ref_model, a.kl_coef != 0.0) {
        let reference = Model::load(dir, dev.device, dev.compute_kind())
            .with_context(|| format!("loading the reference model from {}", dir.display()))?;
        trainer = trainer.with_reference(reference)?;
    }
    if a.model.join("optimizer.safetensors").exists() {
        trainer
            .resume(&a.model)
            .context("resuming the optimizer state")?;
        eprintln!(
            "graft train: resumed the optimizer at step {}",
            trainer.optimizer.steps
        );
    }
    let k = a.mini_batches.max(1);
    let mut out = std::io::stdout().lock();
    for _ in 0..a.epochs.max(1) {
        for part in 0..k {
            let batch: Vec<_> = sel
                .samples
                .iter()
                .enumerate()
                .filter(|(i, _)| i % k == part)
                .map(|(_, s)| s.clone())
                .collect();
            if batch.is_empty() {
                continue;
            }
            let s = trainer.step(&batch)?;
            train::log_step(&s);
            writeln!(
                out,
                "step {} loss {:.5} reward {:.4} clip {:.4} gap {:.2e} kl {:.2e} grad_norm {:.4} tokens {} tokens/s {:.0}{}",
                s.step,
                s.loss,
                s.mean_reward,
                s.clip_fraction,
                s.logprob_gap,
                s.kl,
                s.grad_norm,
                s.tokens,
                s.tokens_per_s,
                if s.skipped {
                    " SKIPPED (non-finite gradients)"
                } else {
                    ""
                }
            )?;
        }
    }
    trainer
        .save_checkpoint(&a.out)
        .with_context(|| format!("writing the checkpoint to {}", a.out.display()))?;
    writeln!(out, "weights written to {}", a.out.display())?;
    if let Some(url) = &a.push {
        let version = a.weight_version.clone().unwrap_or_else(|| {
            a.out
                .file_name()
                .map(|n| n.to_string_lossy().into_owned())
                .unwrap_or_else(|| "graft".to_owned())
        });
        let path = std::fs::canonicalize(&a.out).unwrap_or_else(|_| a.out.clone());
        graft_trainer::push::push_weights(url, &path, &version)?;
        writeln!(out, "pushed to {url} as weight_version {version}")?;
    }
    Ok(())
}

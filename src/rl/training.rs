//! Training in `graft rl`: the run's trainer and how a step's new weights reach the backends.
//!
//! - **Resident** (`trainer.resident = true`, the default): one
//!   [`graft_trainer::step::Resident`] owned by the run keeps the model, the fp32 master
//!   weights and AdamW's moments in memory across steps. It is loaded once at the start (from
//!   the newest checkpoint when the run resumes) and writes a checkpoint every
//!   `trainer.checkpoint_every` steps and after the last.
//! - **Per step** (`trainer.resident = false`): each step loads the policy from the previous
//!   step's checkpoint and writes a new one (`graft_trainer::step::run_step`, what `graft
//!   train` does): the benchmark's baseline.
//!
//! Weight handoff after a step: to the embedded `graft serve` in memory (the gateway holds
//! new calls, the engine copies the trainer's tensors into its own between two decode
//! steps, calls go on), never through a file; to SGLang backends as an HF directory under
//! `<out_dir>/weights` pushed with `update_weights_from_disk` (with `max_staleness` ≥ 1 the
//! write and the push run while the next step's rollouts go on).
//!
//! Trainings run one at a time, in step order: each waits for the previous one's signal.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use anyhow::Context;
use serde_json::{Value, json};

use super::backends::Shared;
use super::config::{self, RlConfig};
use super::finish::Trained;
use super::rollout::Api;
use graft_trainer::engine::Engine;
use graft_trainer::grpo::{Level, Reject};
use graft_trainer::step::{
    self as trainer_step, PolicyChoice, Resident, StepError, StepReport, StepRequest,
};

/// The run's trainer, shared by the step loop and the training tasks.
pub struct RunTrainer {
    /// The resident trainer (None until loaded, and on the per-step path).
    resident: Mutex<Option<Resident>>,
    /// The policy directory the next per-step training loads.
    policy: Mutex<PathBuf>,
    /// The embedded `graft serve`'s engine, when the backend is in this process.
    engine: Option<Arc<Engine>>,
}

fn guard<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// The trainer's knobs from the run config.
fn request(cfg: &RlConfig, policy: &Path, samples: Vec<PathBuf>, out: PathBuf) -> StepRequest {
    let t = &cfg.trainer;
    let mut req = StepRequest::new(samples, policy.to_path_buf(), out);
    req.lr = t.lr;
    req.temperature = t.temperature;
    req.policy = match t.policy {
        config::PolicyChoice::Auto => PolicyChoice::Auto,
        config::PolicyChoice::Bypass => PolicyChoice::Bypass,
        config::PolicyChoice::Recompute => PolicyChoice::Recompute,
    };
    let level = |l: config::Level| match l {
        config::Level::Token => Level::Token,
        config::Level::Sequence => Level::Sequence,
    };
    req.tis_level = level(t.tis_level);
    req.reject = t.reject.map(|r| Reject {
        level: level(r.level),
        low: r.low,
        high: r.high,
    });
    req.checkpoint_layers = t.checkpoint_layers;
    req
}

impl RunTrainer {
    pub fn new(policy: PathBuf, engine: Option<Arc<Engine>>) -> RunTrainer {
        RunTrainer {
            resident: Mutex::new(None),
            policy: Mutex::new(policy),
            engine,
        }
    }

    /// Whether new weights go to the backend in memory (the embedded `graft serve`).
    pub fn in_process(&self) -> bool {
        self.engine.is_some()
    }

    /// Loads the resident trainer from `policy` (a checkpoint resumes its optimizer state).
    /// Returns a line for the console.
    pub async fn load(self: &Arc<Self>, cfg: &RlConfig) -> anyhow::Result<String> {
        let me = Arc::clone(self);
        let req = request(cfg, &guard(&self.policy).clone(), vec![], PathBuf::new());
        tokio::task::spawn_blocking(move || {
            let t = Instant::now();
            let r = Resident::load(&req, |_| {})
                .with_context(|| format!("loading the trainer from {}", req.model.display()))?;
            let line = format!(
                "trainer: resident, {} parameters on {}, loaded from {} in {:.1} s{}",
                r.num_parameters(),
                r.device(),
                req.model.display(),
                t.elapsed().as_secs_f64(),
                if r.optimizer_steps() > 0 {
                    format!(
                        " (optimizer state resumed at update {})",
                        r.optimizer_steps()
                    )
                } else {
                    String::new()
                }
            );
            *guard(&me.resident) = Some(r);
            anyhow::Ok(line)
        })
        .await
        .context("the trainer's loading thread failed")?
    }

    /// Hands the resident trainer's weights to the embedded engine as `version` (also a
    /// resumed run's policy, before its first step). Nothing is drained: calls in flight go
    /// on, the engine swaps the weights between two decode steps (its running requests keep
    /// the tokens they have and continue under the new weights), and every token says which
    /// weights sampled it (`meta_info.weight_versions`, the records' spans).
    pub async fn hand_over(self: &Arc<Self>, version: &str) -> anyhow::Result<f64> {
        let Some(engine) = self.engine.clone() else {
            return Ok(0.0);
        };
        let t = Instant::now();
        let me = Arc::clone(self);
        let v = version.to_string();
        tokio::task::spawn_blocking(move || {
            let g = guard(&me.resident);
            let Some(r) = g.as_ref() else {
                anyhow::bail!("the resident trainer is not loaded");
            };
            engine
                .update_weights_from_tensors(r.parameters(), v)
                .context("the embedded graft serve refused the new weights")
        })
        .await
        .context("the handoff thread failed")??;
        Ok(t.elapsed().as_secs_f64())
    }
}

/// Everything a training task needs.
#[derive(Clone)]
pub struct Ctx {
    pub cfg: RlConfig,
    pub gateway: Api,
    pub backends: Vec<String>,
    pub shared: Arc<Shared>,
    pub trainer: Arc<RunTrainer>,
}

/// Whether step `step` writes a checkpoint (resident trainer).
fn checkpoint_due(cfg: &RlConfig, step: usize) -> bool {
    let every = cfg.trainer.checkpoint_every;
    step + 1 >= cfg.steps() || (every > 0 && (step + 1).is_multiple_of(every))
}

/// Trains step `step` on `samples` once `prev` (the previous training) is done, then hands
/// the new weights to the backends.
pub async fn train(
    ctx: Ctx,
    step: usize,
    samples: PathBuf,
    prev: Option<tokio::sync::oneshot::Receiver<()>>,
) -> anyhow::Result<Trained> {
    if let Some(p) = prev {
        let _ = p.await;
    }
    let cfg = &ctx.cfg;
    let ckpt = cfg
        .run
        .out_dir
        .join("checkpoints")
        .join(format!("step-{step:05}"));
    let seed = cfg.run.seed as i64 + step as i64;
    let resident = cfg.trainer.resident;
    let t = Instant::now();
    let me = Arc::clone(&ctx.trainer);
    let (c2, s2, k2) = (cfg.clone(), samples.clone(), ckpt.clone());
    let result = tokio::task::spawn_blocking(move || -> Result<StepReport, StepError> {
        if resident {
            let mut g = guard(&me.resident);
            let r = g.as_mut().ok_or_else(|| StepError::Trainer {
                context: "training".into(),
                source: graft_trainer::TrainerError::Invalid(
                    "the resident trainer is not loaded".into(),
                ),
            })?;
            r.train(&[s2], seed, |_| {})
        } else {
            let policy = guard(&me.policy).clone();
            let mut req = request(&c2, &policy, vec![s2], k2);
            req.seed = seed;
            trainer_step::run_step(&req, |_| {})
        }
    })
    .await
    .context("the training thread failed")?;
    let t_train = t.elapsed().as_secs_f64();
    let report = match result {
        Ok(r) => r,
        Err(StepError::NoLearningSignal(c)) => {
            let mut s = Trained::skipped("no learning signal in the selected samples");
            s.log["selection"] = selection_json(&c);
            s.t_train = t_train;
            return Ok(s);
        }
        Err(e) => {
            return Err(anyhow::Error::new(e).context(format!("training failed at step {step}")));
        }
    };
    let version = format!("step-{step:05}");
    let mut t_push = 0.0;
    let mut t_export = 0.0;
    let mut weights_dir = None;
    let mut handoff = Value::Null;
    if cfg.trainer.push {
        if resident && ctx.trainer.in_process() {
            t_push = ctx
                .trainer
                .hand_over(&version)
                .await
                .context("handing the new weights to the embedded graft serve")?;
            ctx.shared.set_expected(None, Some(version.clone()));
            handoff = json!("in memory (tensor copy into the embedded graft serve)");
        } else {
            // Files: the checkpoint (per step) or a weights-only directory (resident).
            let dir = match resident {
                false => ckpt.clone(),
                true => {
                    let dir = cfg
                        .run
                        .out_dir
                        .join("weights")
                        .join(format!("step-{step:05}"));
                    let t = Instant::now();
                    let me = Arc::clone(&ctx.trainer);
                    let d = dir.clone();
                    tokio::task::spawn_blocking(move || {
                        guard(&me.resident)
                            .as_ref()
                            .map(|r| r.export(&d))
                            .transpose()
                    })
                    .await
                    .context("the weights writer failed")??;
                    t_export = t.elapsed().as_secs_f64();
                    dir
                }
            };
            let t = Instant::now();
            let path = std::fs::canonicalize(&dir)?;
            ctx.shared
                .push(cfg, &ctx.gateway, &ctx.backends, &path, &version)
                .await
                .context("pushing the new weights")?;
            t_push = t.elapsed().as_secs_f64();
            handoff = json!("file (update_weights_from_disk)");
            weights_dir = Some(path);
        }
    }
    // The checkpoint, after the handoff (the backends need not wait for it): per-step
    // training wrote one; a resident trainer writes one when it is due.
    let mut t_checkpoint = 0.0;
    let checkpoint = if !resident {
        *guard(&ctx.trainer.policy) = ckpt.clone();
        Some(ckpt.clone())
    } else if checkpoint_due(cfg, step) {
        let t = Instant::now();
        let me = Arc::clone(&ctx.trainer);
        let dir = ckpt.clone();
        tokio::task::spawn_blocking(move || {
            guard(&me.resident)
                .as_ref()
                .map(|r| r.checkpoint(&dir))
                .transpose()
        })
        .await
        .context("the checkpoint thread failed")??;
        t_checkpoint = t.elapsed().as_secs_f64();
        Some(ckpt.clone())
    } else {
        None
    };
    let log: Vec<String> = report.steps.iter().map(trainer_step::step_line).collect();
    let figures: Vec<Value> = report
        .steps
        .iter()
        .map(|s| {
            json!({
                "step": s.step, "loss": s.loss, "reward": s.mean_reward,
                "clip_fraction": s.clip_fraction, "logprob_gap": s.logprob_gap,
                "tokens_without_logprob": s.tokens_without_logprob, "kl": s.kl,
                "grad_norm": s.grad_norm, "tokens": s.tokens, "tokens_per_s": s.tokens_per_s,
                "micro_batches": s.micro_batches, "skipped": s.skipped,
                "mismatch_kl": s.mismatch_kl, "masked_share": s.masked_share,
                "masked_samples": s.masked_samples,
            })
        })
        .collect();
    Ok(Trained {
        log: json!({
            "log": log,
            "trainer": if resident { "resident" } else { "per step" },
            "checkpoint": checkpoint,
            "weights": weights_dir,
            "handoff": handoff,
            "weight_version": version,
            "pushed": cfg.trainer.push,
            "steps": figures,
            "mismatch_kl": report.steps.last().map(|s| s.mismatch_kl),
            "masked_share": report.steps.last().map(|s| s.masked_share),
            "masked_samples": report.steps.iter().map(|s| s.masked_samples).sum::<usize>(),
            "selection": selection_json(&report.selection),
            "policy": match report.policy {
                graft_trainer::grpo::PolicyMode::Bypass => "bypass",
                graft_trainer::grpo::PolicyMode::Recompute => "recompute",
            },
            "recompute_forced": report.recompute_forced,
            "parameters": report.parameters,
            "device": report.device,
            "resumed_at": report.resumed_at,
        }),
        t_train,
        t_push,
        t_checkpoint: t_checkpoint + t_export,
        changed: true,
        policy: checkpoint,
        version: cfg.trainer.push.then_some(version),
    })
}

fn selection_json(c: &graft_trainer::step::SelectionCounts) -> Value {
    json!({
        "read": c.read, "groups": c.groups, "groups_dropped": c.groups_dropped,
        "groups_relaxed": c.groups_relaxed, "sessions_without_reward": c.sessions_without_reward,
        "train": c.train,
    })
}

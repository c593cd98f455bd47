//! One training run over samples files as a library call: select (groups, advantages,
//! optional Balanced Adaptive Rollout), load the policy (resuming its optimizer state when
//! the directory holds one), train, write the checkpoint, optionally push it. `graft train`
//! prints its report ([`run_step`]).
//!
//! [`Resident`] is the same trainer kept in memory across steps (the model, the fp32
//! master weights and AdamW's moments): `graft rl` loads it once, calls
//! [`Resident::train`] per step on a blocking thread, hands its weights to the backend and
//! writes a checkpoint only every so many steps ([`Resident::checkpoint`]). A checkpoint
//! holds the optimizer state, so loading a `Resident` from one continues exactly where it
//! stopped. `run_step` is `Resident::load` + `train` + `checkpoint` (the per-step path).

use std::path::{Path, PathBuf};

use tch::Tensor;

use crate::bar::BarConfig;
use crate::error::TrainerError;
use crate::grpo::{GrpoConfig, Level, PolicyMode, Reject};
use crate::model::Model;
use crate::optim::AdamWConfig;
use crate::train::{self, StepStats, TrainConfig, TrainSample, Trainer};

/// Where π_old comes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PolicyChoice {
    /// The rollout logprobs (one optimizer step per batch).
    Bypass,
    /// The trainer's own logprobs, with the truncated importance weight.
    Recompute,
    /// Bypass for a single step (one mini-batch, one epoch), recompute otherwise.
    Auto,
}

/// Push the written weights to an SGLang-compatible server
/// (pause → flush_cache → update_weights_from_disk → continue).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PushTarget {
    pub url: String,
    /// The weight_version the pushed weights are served as; `None`: the out dir's name.
    pub weight_version: Option<String>,
    /// The server's admin key (else its API key), when it was started with one.
    pub api_key: Option<String>,
}

/// Everything one training run is given.
#[derive(Debug, Clone, PartialEq)]
pub struct StepRequest {
    /// Samples Parquet files written by `graft reconstruct` (or `graft rl`).
    pub samples: Vec<PathBuf>,
    /// An HF model directory, or one an earlier run wrote (its optimizer state is resumed).
    pub model: PathBuf,
    /// Where the new weights (HF layout) and the optimizer state go.
    pub out: PathBuf,
    pub lr: f64,
    /// Optimizer steps per pass (the samples are dealt round-robin into this many batches).
    pub mini_batches: usize,
    pub epochs: usize,
    pub policy: PolicyChoice,
    /// The rollouts' sampling temperature.
    pub temperature: f64,
    /// Padded tokens per micro-batch.
    pub micro_batch_tokens: usize,
    /// k3 KL coefficient (0: off); needs `ref_model`.
    pub kl_coef: f64,
    /// The frozen reference policy of the KL term.
    pub ref_model: Option<PathBuf>,
    /// Choose each group's rollouts by Balanced Adaptive Rollout.
    pub bar: bool,
    pub push: Option<PushTarget>,
    /// libtorch's seed.
    pub seed: i64,
    /// What the truncated importance weight is computed over (recompute mode).
    pub tis_level: Level,
    /// Rejection of tokens or samples beyond a trainer/rollout ratio bound.
    pub reject: Option<Reject>,
    /// Activation checkpointing: recompute each decoder layer in the backward instead of
    /// keeping its activations (less memory, one more forward of the layers).
    pub checkpoint_layers: bool,
}

impl StepRequest {
    /// A request with `graft train`'s defaults: lr 1e-6, one mini-batch, one epoch, policy
    /// chosen automatically, temperature 1, 16384 tokens per micro-batch, no KL, no BAR, no
    /// push, seed 0, no activation checkpointing.
    pub fn new(samples: Vec<PathBuf>, model: PathBuf, out: PathBuf) -> StepRequest {
        StepRequest {
            samples,
            model,
            out,
            lr: 1e-6,
            mini_batches: 1,
            epochs: 1,
            policy: PolicyChoice::Auto,
            temperature: 1.0,
            micro_batch_tokens: 16384,
            kl_coef: 0.0,
            ref_model: None,
            bar: false,
            push: None,
            seed: 0,
            tis_level: Level::Token,
            reject: None,
            checkpoint_layers: false,
        }
    }
}

/// How the samples read were selected (the counts of [`train::Selection`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SelectionCounts {
    /// Samples read from the files.
    pub read: usize,
    pub groups: usize,
    /// Groups without a learning signal (missing or equal rewards).
    pub groups_dropped: usize,
    pub groups_relaxed: usize,
    pub sessions_without_reward: usize,
    /// Samples trained on.
    pub train: usize,
}

/// What one training run did.
#[derive(Debug, Clone, PartialEq)]
pub struct StepReport {
    pub selection: SelectionCounts,
    /// The π_old actually used.
    pub policy: PolicyMode,
    /// Bypass was asked for (or chosen) but some trained tokens have no rollout logprob
    /// (re-tokenized text, a backend that sent none), so recompute was used.
    pub recompute_forced: bool,
    pub parameters: i64,
    /// The device and dtype trained on, as libtorch names them (`Cuda(0)`, `BFloat16`).
    pub device: String,
    pub compute_kind: String,
    /// Why the CPU was used, when it was.
    pub cpu_reason: Option<String>,
    /// The optimizer step the run resumed at, when the model directory held optimizer state.
    pub resumed_at: Option<i64>,
    /// One entry per optimizer step.
    pub steps: Vec<StepStats>,
    /// The checkpoint written (`StepRequest::out`); `None` from [`Resident::train`].
    pub checkpoint: Option<PathBuf>,
    /// The server and weight_version pushed to, when pushed.
    pub pushed: Option<(String, String)>,
}

/// What a run has done so far, as it happens (for a caller that prints progress).
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum StepEvent<'a> {
    /// The samples are read and selected (there is something to train).
    Selected(&'a SelectionCounts),
    /// The policy is loaded.
    Loaded {
        parameters: i64,
        device: &'a str,
        compute_kind: &'a str,
        cpu_reason: Option<&'a str>,
    },
    /// The optimizer state was resumed at this step.
    Resumed(i64),
    /// An optimizer step finished.
    Step(&'a StepStats),
}

/// Why a training run did not train.
#[derive(Debug, thiserror::Error)]
pub enum StepError {
    #[error(
        "no sample has a learning signal: every group is missing rewards or has equal rewards ({} samples, {} groups, {} dropped, {} sessions without a reward); give sessions a group_id and a reward",
        .0.read, .0.groups, .0.groups_dropped, .0.sessions_without_reward
    )]
    NoLearningSignal(SelectionCounts),
    #[error(
        "a KL coefficient of {0} needs a reference model (--ref-model DIR: the frozen reference policy, usually the model RL started from)"
    )]
    KlWithoutReference(f64),
    #[error("{context}: {source}")]
    Trainer {
        context: String,
        #[source]
        source: TrainerError,
    },
}

fn ctx<T>(r: crate::Result<T>, context: impl FnOnce() -> String) -> Result<T, StepError> {
    r.map_err(|source| StepError::Trainer {
        context: context(),
        source,
    })
}

/// The one line `graft train` prints per optimizer step (also `graft rl`'s step log).
pub fn step_line(s: &StepStats) -> String {
    format!(
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
    )
}

/// Reads the samples files and selects what trains (groups, advantages, optional BAR).
fn select(paths: &[PathBuf], bar: bool) -> Result<(Vec<TrainSample>, SelectionCounts), StepError> {
    let mut samples = Vec::new();
    for path in paths {
        let read = graft_reconstruct::sample::read_samples_parquet(path).map_err(|e| {
            StepError::Trainer {
                context: format!("reading samples from {}", path.display()),
                source: e.into(),
            }
        })?;
        samples.extend(read);
    }
    let bar = bar.then(BarConfig::default);
    let sel = train::select_samples(&samples, bar.as_ref(), 1e-6);
    let selection = SelectionCounts {
        read: samples.len(),
        groups: sel.groups,
        groups_dropped: sel.groups_dropped,
        groups_relaxed: sel.groups_relaxed,
        sessions_without_reward: sel.sessions_without_reward,
        train: sel.samples.len(),
    };
    if sel.samples.is_empty() {
        return Err(StepError::NoLearningSignal(selection));
    }
    Ok((sel.samples, selection))
}

/// The trainer kept in memory across steps: the model, AdamW (fp32 masters and moments)
/// and, with a KL term, the reference policy. Blocking (libtorch): use it from a blocking
/// thread in async code.
pub struct Resident {
    trainer: Trainer,
    /// The request it was loaded with: the knobs every step uses.
    req: StepRequest,
    parameters: i64,
    device: String,
    compute_kind: String,
    cpu_reason: Option<String>,
    resumed_at: Option<i64>,
}

impl std::fmt::Debug for Resident {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Resident")
            .field("trainer", &self.trainer)
            .field("device", &self.device)
            .finish_non_exhaustive()
    }
}

impl Resident {
    /// Loads the policy `req.model` (resuming its optimizer state when the directory holds
    /// `optimizer.safetensors`) and the reference model. `req.samples`, `req.out` and
    /// `req.push` are not used here.
    pub fn load(
        req: &StepRequest,
        mut on_event: impl FnMut(StepEvent<'_>),
    ) -> Result<Resident, StepError> {
        if req.kl_coef != 0.0 && req.ref_model.is_none() {
            return Err(StepError::KlWithoutReference(req.kl_coef));
        }
        let dev = crate::device::init();
        let model = ctx(
            Model::load(&req.model, dev.device, dev.compute_kind()),
            || format!("loading the model from {}", req.model.display()),
        )?;
        let parameters = model.spec().num_parameters();
        let device = format!("{:?}", dev.device);
        let compute_kind = format!("{:?}", dev.compute_kind());
        on_event(StepEvent::Loaded {
            parameters,
            device: &device,
            compute_kind: &compute_kind,
            cpu_reason: dev.cpu_reason.as_deref(),
        });
        let config = TrainConfig {
            grpo: GrpoConfig {
                mode: PolicyMode::Bypass,
                kl_coef: req.kl_coef,
                temperature: req.temperature,
                tis_level: req.tis_level,
                reject: req.reject,
                ..GrpoConfig::default()
            },
            optim: AdamWConfig {
                lr: req.lr,
                ..AdamWConfig::default()
            },
            micro_batch_tokens: req.micro_batch_tokens,
            bar: req.bar.then(BarConfig::default),
            advantage_eps: 1e-6,
            checkpoint_layers: req.checkpoint_layers,
        };
        let mut trainer = ctx(Trainer::new(model, config), || {
            "building the trainer".to_owned()
        })?;
        if let (Some(dir), true) = (&req.ref_model, req.kl_coef != 0.0) {
            let reference = ctx(Model::load(dir, dev.device, dev.compute_kind()), || {
                format!("loading the reference model from {}", dir.display())
            })?;
            trainer = ctx(trainer.with_reference(reference), || {
                "attaching the reference model".to_owned()
            })?;
        }
        let mut resumed_at = None;
        if req.model.join("optimizer.safetensors").exists() {
            ctx(trainer.resume(&req.model), || {
                "resuming the optimizer state".to_owned()
            })?;
            resumed_at = Some(trainer.optimizer.steps);
            on_event(StepEvent::Resumed(trainer.optimizer.steps));
        }
        Ok(Resident {
            trainer,
            req: req.clone(),
            parameters,
            device,
            compute_kind,
            cpu_reason: dev.cpu_reason.clone(),
            resumed_at,
        })
    }

    /// One training run over `samples` (files) with libtorch seeded by `seed`, in memory:
    /// nothing is written.
    pub fn train(
        &mut self,
        samples: &[PathBuf],
        seed: i64,
        mut on_event: impl FnMut(StepEvent<'_>),
    ) -> Result<StepReport, StepError> {
        let (selected, selection) = select(samples, self.req.bar)?;
        on_event(StepEvent::Selected(&selection));
        self.train_selected(&selected, selection, seed, on_event)
    }

    fn train_selected(
        &mut self,
        selected: &[TrainSample],
        selection: SelectionCounts,
        seed: i64,
        mut on_event: impl FnMut(StepEvent<'_>),
    ) -> Result<StepReport, StepError> {
        tch::manual_seed(seed);
        let req = &self.req;
        let asked = match req.policy {
            PolicyChoice::Bypass => PolicyMode::Bypass,
            PolicyChoice::Recompute => PolicyMode::Recompute,
            PolicyChoice::Auto if req.mini_batches <= 1 && req.epochs <= 1 => PolicyMode::Bypass,
            PolicyChoice::Auto => PolicyMode::Recompute,
        };
        let recompute_forced =
            asked == PolicyMode::Bypass && !selected.iter().all(TrainSample::rollout_complete);
        let mode = if recompute_forced {
            PolicyMode::Recompute
        } else {
            asked
        };
        self.trainer.config.grpo.mode = mode;
        let k = req.mini_batches.max(1);
        let mut steps = vec![];
        for _ in 0..req.epochs.max(1) {
            for part in 0..k {
                let batch: Vec<_> = selected
                    .iter()
                    .enumerate()
                    .filter(|(i, _)| i % k == part)
                    .map(|(_, s)| s.clone())
                    .collect();
                if batch.is_empty() {
                    continue;
                }
                let s = ctx(self.trainer.step(&batch), || "a training step".to_owned())?;
                train::log_step(&s);
                on_event(StepEvent::Step(&s));
                steps.push(s);
            }
        }
        Ok(StepReport {
            selection,
            policy: mode,
            recompute_forced,
            parameters: self.parameters,
            device: self.device.clone(),
            compute_kind: self.compute_kind.clone(),
            cpu_reason: self.cpu_reason.clone(),
            resumed_at: self.resumed_at,
            steps,
            checkpoint: None,
            pushed: None,
        })
    }

    /// Writes a checkpoint: the HF model directory plus the optimizer state (fp32 masters,
    /// moments, step counters), which [`Resident::load`] resumes exactly.
    pub fn checkpoint(&self, dir: &Path) -> Result<(), StepError> {
        ctx(self.trainer.save_checkpoint(dir), || {
            format!("writing the checkpoint to {}", dir.display())
        })
    }

    /// Writes the weights only (an HF directory an inference server loads).
    pub fn export(&self, dir: &Path) -> Result<(), StepError> {
        ctx(self.trainer.export(dir), || {
            format!("writing the weights to {}", dir.display())
        })
    }

    /// The policy's parameters by HF name, sharing storage with the trainer (for a copy
    /// into a backend in this process; they change at the next [`Resident::train`]).
    pub fn parameters(&self) -> Vec<(String, Tensor)> {
        self.trainer.model.named_parameters()
    }

    /// The device and dtype trained on, as libtorch names them.
    pub fn device(&self) -> String {
        format!("{} ({})", self.device, self.compute_kind)
    }

    /// Parameters of the model.
    pub fn num_parameters(&self) -> i64 {
        self.parameters
    }

    /// Optimizer updates applied so far (resumed ones included).
    pub fn optimizer_steps(&self) -> i64 {
        self.trainer.optimizer.steps
    }
}

/// Runs one training run. Blocking (libtorch): call it from a blocking thread in async code.
/// `on_event` sees the run's progress as it happens; the report holds all of it.
pub fn run_step(
    req: &StepRequest,
    mut on_event: impl FnMut(StepEvent<'_>),
) -> Result<StepReport, StepError> {
    if req.kl_coef != 0.0 && req.ref_model.is_none() {
        return Err(StepError::KlWithoutReference(req.kl_coef));
    }
    let (selected, selection) = select(&req.samples, req.bar)?;
    on_event(StepEvent::Selected(&selection));
    let mut resident = Resident::load(req, &mut on_event)?;
    let mut report = resident.train_selected(&selected, selection, req.seed, &mut on_event)?;
    resident.checkpoint(&req.out)?;
    report.checkpoint = Some(req.out.clone());
    if let Some(target) = &req.push {
        let version = target.weight_version.clone().unwrap_or_else(|| {
            req.out
                .file_name()
                .map(|n| n.to_string_lossy().into_owned())
                .unwrap_or_else(|| "graft".to_owned())
        });
        let path = std::fs::canonicalize(&req.out).unwrap_or_else(|_| req.out.clone());
        ctx(
            crate::push::push_weights(&target.url, &path, &version, target.api_key.as_deref()),
            || format!("pushing the weights to {}", target.url),
        )?;
        report.pushed = Some((target.url.clone(), version));
    }
    Ok(report)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kl_without_a_reference_is_refused_before_anything_loads() {
        let mut req = StepRequest::new(
            vec![PathBuf::from("does-not-exist.parquet")],
            PathBuf::from("no-model"),
            PathBuf::from("no-out"),
        );
        req.kl_coef = 0.1;
        match run_step(&req, |_| {}) {
            Err(StepError::KlWithoutReference(k)) => assert_eq!(k, 0.1),
            other => panic!("expected KlWithoutReference, got {other:?}"),
        }
    }

    #[test]
    fn samples_without_signal_are_a_typed_error_with_the_counts() {
        use graft_reconstruct::sample::{Sample, write_samples_parquet};
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("s.parquet");
        let flat = |sid: &str| Sample {
            session_id: sid.to_owned(),
            group_id: Some("g".to_owned()),
            tokens: vec![1, 2, 3],
            loss_mask: vec![0, 1, 1],
            logprobs: vec![None, Some(-0.5), Some(-0.25)],
            reward: Some(1.0),
            ..Sample::default()
        };
        write_samples_parquet(&[flat("a"), flat("b")], &path).unwrap();
        let req = StepRequest::new(vec![path], dir.path().join("m"), dir.path().join("o"));
        match run_step(&req, |_| {}) {
            Err(StepError::NoLearningSignal(c)) => {
                assert_eq!(c.read, 2);
                assert_eq!(c.groups, 1);
                assert_eq!(c.groups_dropped, 1);
                assert_eq!(c.train, 0);
            }
            other => panic!("expected NoLearningSignal, got {other:?}"),
        }
        assert!(!dir.path().join("o").exists(), "nothing is written");
    }

    #[test]
    fn the_step_line_is_graft_trains_format() {
        let s = StepStats {
            step: 3,
            loss: 0.5,
            mean_reward: 0.25,
            tokens: 10.0,
            clip_fraction: 0.0,
            logprob_gap: 0.0,
            tokens_without_logprob: 0.0,
            kl: 0.0,
            grad_norm: 1.0,
            skipped: false,
            micro_batches: 1,
            tokens_per_s: 100.0,
            mismatch_kl: 0.0,
            masked_share: 0.0,
            masked_samples: 0,
        };
        assert_eq!(
            step_line(&s),
            "step 3 loss 0.50000 reward 0.2500 clip 0.0000 gap 0.00e0 kl 0.00e0 grad_norm 1.0000 tokens 10 tokens/s 100"
        );
    }
}

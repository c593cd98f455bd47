//! The step loop: per step, collect its rollouts (`super::collect`), start its training
//! (`super::training`, at most `rollout.max_staleness` steps behind), and finish the steps
//! whose training is done (`super::finish`) in order.

use std::collections::VecDeque;
use std::sync::Arc;

use anyhow::Context;
use graft_reconstruct::retokenize::Model;

use super::checkpoints::rewind_to_checkpoint;
use super::collect::{Collected, collect};
use super::config::RlConfig;
use super::finish::{Trained, finish};
use super::startup::Components;
use super::state::{State, read_state};
#[cfg(feature = "trainer")]
use super::training;
use super::{progress, tasks};

/// A collected step whose training runs.
type Pending = (Collected, tokio::task::JoinHandle<anyhow::Result<Trained>>);

pub(super) async fn steps(
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

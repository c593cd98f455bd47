//! A step's end: what its training did (`Trained`, made by `super::training`), its line in
//! `<out_dir>/steps.jsonl` (rewards, staleness, timings, what was left open), the run's
//! state moved past it, `report.html` rewritten and old checkpoints pruned.

use std::path::PathBuf;

use anyhow::Context;
use http::Method;
use serde_json::{Value, json};

use super::checkpoints::prune_checkpoints;
use super::collect::Collected;
use super::config::RlConfig;
use super::progress;
use super::rollout::{Outcome, Rollout};
use super::startup::Components;
use super::state::{State, write_state};

/// What training a step did.
pub(super) struct Trained {
    pub(super) log: Value,
    pub(super) t_train: f64,
    /// The weight handoff: in memory to the embedded backend, or write + push of files.
    pub(super) t_push: f64,
    /// Writing the checkpoint (and, for file pushes, the weights) outside the train step.
    pub(super) t_checkpoint: f64,
    /// Whether the step changed the policy's weights.
    pub(super) changed: bool,
    /// The checkpoint written (None: none was due) and the version the backends now serve.
    pub(super) policy: Option<PathBuf>,
    pub(super) version: Option<String>,
}

impl Trained {
    pub(super) fn skipped(why: &str) -> Trained {
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

/// Writes a step's log line and moves the run's state past it.
pub(super) async fn finish(
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

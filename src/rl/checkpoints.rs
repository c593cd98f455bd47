//! Checkpoints: a resident trainer's run rewound to its newest checkpoint on resume, and old
//! step checkpoints (and pushed weights directories) pruned after each step.

use std::io::Write as _;
use std::path::{Path, PathBuf};

use serde_json::Value;

use super::config::RlConfig;
use super::state::{State, write_state};

/// A resident trainer's run resumes from its newest checkpoint: the steps finished after it
/// (their weights were in memory only) are run again; their finished rollouts are kept (as
/// for a step cut off mid-way) and their lines leave the step log.
pub(super) fn rewind_to_checkpoint(out: &Path, state: &mut State) -> anyhow::Result<()> {
    let back = state.checkpoint_next.unwrap_or(state.next_step);
    if back >= state.next_step {
        return Ok(());
    }
    println!(
        "the newest checkpoint is from before step {back}; steps {back}..{} are run again (their finished rollouts are kept)",
        state.next_step - 1
    );
    let path = out.join("steps.jsonl");
    let text = std::fs::read_to_string(&path).unwrap_or_default();
    let kept: String = text
        .lines()
        .filter(|l| {
            serde_json::from_str::<Value>(l)
                .ok()
                .and_then(|v| v["step"].as_u64())
                .is_some_and(|s| (s as usize) < back)
        })
        .map(|l| format!("{l}\n"))
        .collect();
    // Whole and on disk before it replaces the old file (no empty steps.jsonl after a crash).
    let tmp = out.join("steps.jsonl.tmp");
    let mut f = std::fs::File::create(&tmp)?;
    f.write_all(kept.as_bytes())?;
    f.sync_all()?;
    std::fs::rename(&tmp, &path)?;
    if let Ok(d) = std::fs::File::open(out) {
        d.sync_all()?;
    }
    state.next_step = back;
    state.weight_version = state.checkpoint_version.clone();
    let v = state
        .weight_version
        .clone()
        .unwrap_or_else(|| "default".into());
    if let Some(i) = state.versions.iter().rposition(|x| *x == v) {
        state.versions.truncate(i + 1);
    }
    write_state(out, state)
}

/// Deletes all but the newest `run.keep_checkpoints` step checkpoints, never the policy the
/// run continues from (state.json, already written, names it); and likewise the weights
/// directories written for file pushes (never the newest: a restarted backend gets it).
pub(super) fn prune_checkpoints(cfg: &RlConfig, state: &State) {
    let keep = cfg.run.keep_checkpoints;
    if keep == 0 {
        return;
    }
    for sub in ["checkpoints", "weights"] {
        let dir = cfg.run.out_dir.join(sub);
        let Ok(entries) = std::fs::read_dir(&dir) else {
            continue;
        };
        let mut steps: Vec<PathBuf> = entries
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| {
                p.file_name()
                    .and_then(|n| n.to_str())
                    .is_some_and(|n| n.starts_with("step-"))
            })
            .collect();
        steps.sort();
        let old = steps.len().saturating_sub(keep);
        for p in &steps[..old] {
            if state.policy.as_deref() == Some(p.as_path()) {
                continue;
            }
            if let Err(e) = std::fs::remove_dir_all(p) {
                tracing::warn!(checkpoint = %p.display(), error = %e, "could not delete an old checkpoint");
            }
        }
    }
}

//! One step's rollouts: each task's group grown in strides until it is decided (Balanced
//! Adaptive Rollout with the trainer on), the rollouts an interrupted run finished taken
//! over, and the selected sessions reconstructed into the step's samples file.

use std::collections::HashSet;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use anyhow::{Context, bail};
use graft_reconstruct::merge::Summary;
use graft_reconstruct::records::{FromRecords, WithoutTokenIds, samples_from_records};
use graft_reconstruct::retokenize::Model;
use graft_recorder::SessionEvent;
use http::Method;
use serde_json::{Value, json};

use super::config::{self, RlConfig};
use super::rollout::{self, Outcome, Rollout};
use super::startup::Components;
use super::{progress, tasks};

/// What one step's rollouts left: the input of its training, and of its log line.
pub(super) struct Collected {
    pub(super) step: usize,
    pub(super) started: Instant,
    pub(super) rollouts: Vec<Rollout>,
    pub(super) groups: Vec<Value>,
    pub(super) samples_path: PathBuf,
    pub(super) summary: Summary,
    /// Calls of the step's sessions per `weight_version` of the backend that served them.
    pub(super) versions: std::collections::BTreeMap<String, usize>,
    /// Calls of each of the step's sessions.
    pub(super) calls: std::collections::BTreeMap<String, usize>,
    pub(super) t_rollouts: f64,
    pub(super) t_reconstruct: f64,
}

/// Runs one step's groups and reconstructs the scored sessions of its selected rollouts.
pub(super) async fn collect(
    cfg: &RlConfig,
    tasks: &[tasks::Task],
    model: &Model,
    c: &Components,
    step: usize,
    sem: &Arc<tokio::sync::Semaphore>,
    progress: &Arc<progress::Progress>,
) -> anyhow::Result<Collected> {
    let started = Instant::now();
    let mut rollouts: Vec<Rollout> = vec![];
    let mut selected: HashSet<String> = HashSet::new();
    let mut groups: Vec<Value> = vec![];
    for k in 0..cfg.rollout.tasks_per_step {
        let task = &tasks[(step * cfg.rollout.tasks_per_step + k) % tasks.len()];
        let group = format!("step{step}-{}", task.id);
        let (mut rs, decision, chosen) =
            run_group(cfg, c, task, &group, sem, step, progress).await?;
        selected.extend(chosen.iter().map(|i| rs[*i].session_id.clone()));
        groups.push(json!({"group": group, "rollouts": rs.len(), "decision": decision, "selected": chosen.len()}));
        rollouts.append(&mut rs);
    }
    let t_rollouts = started.elapsed().as_secs_f64();
    let t = Instant::now();
    let samples_path = cfg
        .run
        .out_dir
        .join("samples")
        .join(format!("step-{step:05}.parquet"));
    let all: HashSet<String> = rollouts.iter().map(|r| r.session_id.clone()).collect();
    let (summary, versions, calls) = samples(
        model,
        &cfg.run.out_dir.join("data"),
        &selected,
        &all,
        &samples_path,
        cfg.run.side_threads.policy(),
    )?;
    Ok(Collected {
        step,
        started,
        rollouts,
        groups,
        samples_path,
        summary,
        versions,
        calls,
        t_rollouts,
        t_reconstruct: t.elapsed().as_secs_f64(),
    })
}

/// What to do with a group given its rewards so far: `Ok(indices)` to train on (into the
/// scored rollouts), `Err(n)` for n more rollouts, or `Ok(vec![])` with `dropped` to drop it.
enum Decision {
    Take(Vec<usize>, &'static str),
    More(usize),
}

fn decide(cfg: &RlConfig, rewards: &[f64], attempts: usize) -> Decision {
    let r = &cfg.rollout;
    let room = r.max_group_size.saturating_sub(attempts);
    if cfg.trainer.enabled && r.selection == config::Selection::Group {
        if rewards.len() < r.group_size && room > 0 {
            return Decision::More((r.group_size - rewards.len()).min(room));
        }
        let take: Vec<usize> = (0..rewards.len().min(r.group_size)).collect();
        let first = take.first().map(|&i| rewards[i]);
        return if take.len() < 2 || take.iter().all(|&i| Some(rewards[i]) == first) {
            Decision::Take(vec![], "dropped: no learning signal")
        } else {
            Decision::Take(take, "group")
        };
    }
    #[cfg(feature = "trainer")]
    if cfg.trainer.enabled {
        use graft_trainer::bar::{BarConfig, BarDecision, select};
        let bar = BarConfig {
            n: r.group_size,
            n_max: r.max_group_size,
            stride: r.stride,
            min_positive: r.min_positive,
            max_positive: r.max_positive,
            positive_above: r.positive_above,
        };
        return match select(rewards, &bar) {
            BarDecision::Select { indices, relaxed } => {
                Decision::Take(indices, if relaxed { "relaxed" } else { "balanced" })
            }
            BarDecision::NeedMore(n) if room > 0 => Decision::More(n.max(r.stride).min(room)),
            BarDecision::NeedMore(_) => Decision::Take(vec![], "dropped: too few scored rollouts"),
            BarDecision::Drop => Decision::Take(vec![], "dropped: no learning signal"),
        };
    }
    if rewards.len() >= r.group_size || room == 0 {
        Decision::Take((0..rewards.len().min(r.group_size)).collect(), "collected")
    } else {
        Decision::More((r.group_size - rewards.len()).min(room))
    }
}

/// One group: rollouts in strides until the group is decided. Returns the rollouts, the
/// decision, and which of them (indices into the returned list) are trained on.
async fn run_group(
    cfg: &RlConfig,
    c: &Components,
    task: &tasks::Task,
    group: &str,
    sem: &Arc<tokio::sync::Semaphore>,
    step: usize,
    progress: &Arc<progress::Progress>,
) -> anyhow::Result<(Vec<Rollout>, &'static str, Vec<usize>)> {
    let mut rollouts = resumed(cfg, c, task, group).await?;
    if !rollouts.is_empty() {
        progress.println(format!(
            "  step {step} {group}: {} rollouts finished before the restart are kept",
            rollouts.len()
        ));
    }
    let mut next = rollouts.len();
    loop {
        let scored: Vec<usize> = (0..rollouts.len())
            .filter(|&i| rollouts[i].reward().is_some())
            .collect();
        let rewards: Vec<f64> = scored
            .iter()
            .filter_map(|&i| rollouts[i].reward())
            .collect();
        let want = match decide(cfg, &rewards, rollouts.len()) {
            Decision::More(n) => n,
            Decision::Take(idx, why) => {
                let chosen = idx.iter().filter_map(|&k| scored.get(k).copied()).collect();
                return Ok((rollouts, why, chosen));
            }
        };
        let mut jobs = tokio::task::JoinSet::new();
        for i in next..next + want {
            let (cfg, gw, envd, task, group, sem, progress) = (
                cfg.clone(),
                c.gateway.clone(),
                c.envd.clone(),
                task.clone(),
                group.to_string(),
                sem.clone(),
                progress.clone(),
            );
            jobs.spawn(async move {
                let _permit = sem.acquire_owned().await;
                progress.rollout_started();
                let r = rollout::run(&cfg, &gw, &envd, &task, &group, i, &Default::default()).await;
                progress.rollout_done(r.as_ref().ok().and_then(Rollout::reward));
                (i, r)
            });
        }
        next += want;
        let mut batch = vec![];
        while let Some(j) = jobs.join_next().await {
            match j {
                Ok((i, Ok(r))) => {
                    progress.println(match &r.outcome {
                        Outcome::Scored(x) => format!(
                            "  step {step} {} rollout {}: reward {x}",
                            r.task_id, r.session_id
                        ),
                        o => format!(
                            "  step {step} {} rollout {}: {o:?}",
                            r.task_id, r.session_id
                        ),
                    });
                    batch.push((i, r));
                }
                Ok((_, Err(e))) => bail!("a rollout could not be run: {e:#}"),
                Err(e) => bail!("a rollout task failed: {e}"),
            }
        }
        batch.sort_by_key(|(i, _)| *i);
        rollouts.extend(batch.into_iter().map(|(_, r)| r));
    }
}

/// The rollouts of `group` an earlier, interrupted run finished (rewarded sessions): they
/// count, and are not run again. Sessions it left open (rollouts cut off by the crash) are
/// closed now and count as failed attempts.
async fn resumed(
    cfg: &RlConfig,
    c: &Components,
    task: &tasks::Task,
    group: &str,
) -> anyhow::Result<Vec<Rollout>> {
    let data = cfg.run.out_dir.join("data");
    if !data.join("sessions.log").exists() {
        return Ok(vec![]);
    }
    let mut order: Vec<(i64, String, String)> = vec![];
    let mut rewards = std::collections::HashMap::new();
    let mut closed = HashSet::new();
    for ev in graft_recorder::read_session_events(&data)? {
        match ev {
            SessionEvent::Created {
                session_id,
                group_id,
                metadata,
                ..
            } if group_id.as_deref() == Some(group) => {
                let i = metadata
                    .get("rollout")
                    .and_then(Value::as_i64)
                    .unwrap_or(i64::MAX);
                let harness = metadata
                    .get("harness")
                    .and_then(Value::as_str)
                    .map(str::to_owned)
                    .unwrap_or_else(|| {
                        let i = usize::try_from(i).unwrap_or(0);
                        cfg.harness_for(task.harness.as_deref(), i)
                            .label()
                            .to_owned()
                    });
                order.push((i, session_id, harness));
            }
            SessionEvent::Reward {
                session_id, reward, ..
            } => {
                rewards.insert(session_id, reward);
            }
            SessionEvent::Closed { session_id, .. } => {
                closed.insert(session_id);
            }
            _ => {}
        }
    }
    order.sort();
    let mut out = vec![];
    for (_, sid, harness) in order {
        if !closed.contains(&sid) {
            c.gateway
                .ok(
                    Method::POST,
                    &format!("/graft/sessions/{sid}/close"),
                    Some(&json!({})),
                )
                .await
                .with_context(|| {
                    format!("closing session {sid} left open by the interrupted run")
                })?;
        }
        out.push(Rollout {
            task_id: task.id.clone(),
            group_id: group.to_string(),
            outcome: match rewards.get(&sid) {
                // A reward is posted after the rollout's sandbox is gone: it finished.
                Some(r) => Outcome::Scored(*r),
                _ => Outcome::Failed("interrupted by a restart of graft rl".into()),
            },
            session_id: sid,
            harness,
            harness_exit: None,
            harness_oom: false,
            harness_secs: 0.0,
            reward_secs: 0.0,
            harness_tail: String::new(),
        });
    }
    Ok(out)
}

/// Calls counted by a key (a weight version, a session).
type Counts = std::collections::BTreeMap<String, usize>;

/// The exact-mode records of `sessions` merged into samples (with their rewards), written to
/// `path`; and the calls of all the step's sessions (`all`) counted by `weight_version` and by
/// session.
fn samples(
    model: &Model,
    data: &Path,
    sessions: &HashSet<String>,
    all: &HashSet<String>,
    path: &Path,
    side_threads: graft_reconstruct::threads::SideThreads,
) -> anyhow::Result<(Summary, Counts, Counts)> {
    let done = samples_from_records(
        model,
        data,
        FromRecords {
            sessions: Some(sessions),
            without_token_ids: WithoutTokenIds::Skip,
            count_versions_of: Some(all),
            side_threads,
            ..FromRecords::all()
        },
        path,
    )?;
    for (why, n) in &done.skipped {
        tracing::warn!(calls = n, reason = %why, "calls of an exact-mode run are skipped");
    }
    Ok((done.summary, done.weight_versions, done.calls_per_session))
}

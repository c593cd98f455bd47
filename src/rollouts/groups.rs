//! A group's rollouts (`graft rl`'s `crate::rl::rollout::run`, bounded by
//! `rollout.concurrency` over the whole service), its scored sessions reconstructed from the
//! records into samples, and the stop reasons and weight versions the answer reports.

use std::collections::{BTreeMap, HashSet};
use std::sync::Arc;

use anyhow::Context;
use graft_reconstruct::records::{FromRecords, WithoutTokenIds, samples_from_records};
use graft_reconstruct::retokenize::Model;
use graft_reconstruct::sample::{Sample, read_samples_parquet};
use serde_json::{Value, json};

use super::plan::Plan;
use crate::rl::rollout::{self, Outcome, Rollout, SessionOptions};
use crate::rl::tasks::Task;

/// What every group of the service runs its rollouts with.
pub(super) struct Runner {
    pub(super) model: Arc<Model>,
    pub(super) gateway: rollout::Api,
    pub(super) envd: rollout::Api,
    /// Rollouts at once, over all batches (`rollout.concurrency`).
    pub(super) sem: Arc<tokio::sync::Semaphore>,
}

/// One rollout of a group, as the answer gives it.
pub(super) struct RolloutRow {
    pub(super) session_id: String,
    pub(super) harness: String,
    pub(super) backend: Option<String>,
    pub(super) reward: Option<f64>,
    pub(super) outcome: Value,
    pub(super) stop_reason: Option<String>,
}

/// A finished group: its rollouts, its samples (each with its stop reason), the weight
/// versions its calls were answered with; or why it failed.
pub(super) struct GroupResult {
    pub(super) group_id: String,
    pub(super) task_id: String,
    pub(super) error: Option<String>,
    pub(super) rollouts: Vec<RolloutRow>,
    pub(super) samples: Vec<Sample>,
    /// Aligned to `samples`: each one's stop reason.
    pub(super) stop_reasons: Vec<Option<String>>,
    pub(super) calls_by_weight_version: BTreeMap<String, usize>,
    pub(super) stale_calls: usize,
    pub(super) stale_samples: usize,
}

impl GroupResult {
    pub(super) fn failed(group: &str, task: &str, error: String) -> GroupResult {
        GroupResult {
            group_id: group.to_string(),
            task_id: task.to_string(),
            error: Some(error),
            rollouts: vec![],
            samples: vec![],
            stop_reasons: vec![],
            calls_by_weight_version: BTreeMap::new(),
            stale_calls: 0,
            stale_samples: 0,
        }
    }
}

/// Whether a sample holds a token sampled by another version than `version` (tokens of an
/// unknown version count for nothing).
fn is_stale(s: &Sample, version: &str) -> bool {
    (0..s.tokens.len()).any(|i| {
        s.loss_mask.get(i) == Some(&1) && s.token_weight_version(i).is_some_and(|v| v != version)
    })
}

pub(super) async fn run_one_group(
    runner: &Runner,
    plan: &Arc<Plan>,
    task: &Task,
    group: &str,
    first: usize,
) -> anyhow::Result<GroupResult> {
    let cfg = &plan.cfg;
    let mut jobs = tokio::task::JoinSet::new();
    for i in 0..plan.group_size {
        // The batch's own servers, in turn over all its rollouts.
        let backend = (!plan.own_backends.is_empty())
            .then(|| plan.own_backends[(first + i) % plan.own_backends.len()].clone());
        let opts = SessionOptions {
            sampling: plan.sampling.clone(),
            backend,
        };
        let (cfg, gw, envd, task, group, sem) = (
            cfg.clone(),
            runner.gateway.clone(),
            runner.envd.clone(),
            task.clone(),
            group.to_string(),
            runner.sem.clone(),
        );
        jobs.spawn(async move {
            let _permit = sem.acquire_owned().await;
            let r = rollout::run(&cfg, &gw, &envd, &task, &group, i, &opts).await;
            (i, opts.backend, r)
        });
    }
    let mut rollouts: Vec<(usize, Option<String>, Rollout)> = vec![];
    while let Some(j) = jobs.join_next().await {
        let (i, backend, r) = j.context("a rollout task failed")?;
        rollouts.push((i, backend, r.context("a rollout could not be run")?));
    }
    rollouts.sort_by_key(|(i, _, _)| *i);
    let scored: HashSet<String> = rollouts
        .iter()
        .filter(|(_, _, r)| r.reward().is_some())
        .map(|(_, _, r)| r.session_id.clone())
        .collect();
    let all: HashSet<String> = rollouts
        .iter()
        .map(|(_, _, r)| r.session_id.clone())
        .collect();
    let path = cfg
        .run
        .out_dir
        .join("rollouts")
        .join(format!("{group}.parquet"));
    let (model, data) = (runner.model.clone(), cfg.run.out_dir.join("data"));
    let side_threads = cfg.run.side_threads.policy();
    let sessions: Vec<String> = rollouts
        .iter()
        .map(|(_, _, r)| r.session_id.clone())
        .collect();
    let (samples, versions, finishes) = tokio::task::spawn_blocking(move || {
        let done = samples_from_records(
            &model,
            &data,
            FromRecords {
                sessions: Some(&scored),
                without_token_ids: WithoutTokenIds::Skip,
                count_versions_of: Some(&all),
                side_threads,
                ..FromRecords::all()
            },
            &path,
        )?;
        let samples = read_samples_parquet(&path)?;
        let _ = std::fs::remove_file(&path);
        let finishes = Finishes::read(&data, &sessions)?;
        anyhow::Ok((samples, done.weight_versions, finishes))
    })
    .await
    .context("the reconstruct task failed")??;
    let version = plan.weight_version.as_deref();
    let stale_calls: usize = match version {
        Some(v) => versions
            .iter()
            .filter(|(k, _)| k.as_str() != v)
            .map(|(_, n)| *n)
            .sum(),
        None => 0,
    };
    let n = samples.len();
    let samples: Vec<Sample> = samples
        .into_iter()
        .filter(|s| plan.allow_stale || version.is_none_or(|v| !is_stale(s, v)))
        .collect();
    let stop_reasons = samples.iter().map(|s| finishes.of_sample(s)).collect();
    Ok(GroupResult {
        group_id: group.to_string(),
        task_id: task.id.clone(),
        error: None,
        stale_samples: n - samples.len(),
        rollouts: rollouts
            .iter()
            .map(|(_, backend, r)| RolloutRow {
                session_id: r.session_id.clone(),
                harness: r.harness.clone(),
                backend: backend.clone(),
                reward: r.reward(),
                outcome: outcome(&r.outcome),
                stop_reason: finishes.of_rollout(r),
            })
            .collect(),
        samples,
        stop_reasons,
        calls_by_weight_version: versions.into_iter().collect(),
        stale_calls,
    })
}

/// The `finish_reason` of each recorded call of a group's sessions, and each session's last
/// model call's: what the stop reasons in the answer come from.
#[derive(Debug, Default)]
struct Finishes {
    by_call: BTreeMap<String, Option<String>>,
    last_of_session: BTreeMap<String, Option<String>>,
}

impl Finishes {
    /// Reads only these sessions' records (`graft_recorder::read_session`).
    fn read(data: &std::path::Path, sessions: &[String]) -> anyhow::Result<Finishes> {
        let mut f = Finishes::default();
        for id in sessions {
            let recs = graft_recorder::read_session(data, id)
                .with_context(|| format!("reading session {id}'s records"))?;
            f.add(recs.iter().map(|r| {
                (
                    r.session_id.as_str(),
                    r.call_id.as_str(),
                    r.dialect == "models",
                    r.finish_reason.as_deref(),
                )
            }));
        }
        Ok(f)
    }

    /// (session, call, is a model listing, finish_reason) in each session's seq order.
    fn add<'a>(&mut self, calls: impl Iterator<Item = (&'a str, &'a str, bool, Option<&'a str>)>) {
        for (session, call, listing, finish) in calls {
            if listing {
                continue;
            }
            let finish = finish.map(str::to_owned);
            self.by_call.insert(call.to_owned(), finish.clone());
            self.last_of_session.insert(session.to_owned(), finish);
        }
    }

    /// Its last call's finish reason.
    fn of_sample(&self, s: &Sample) -> Option<String> {
        s.call_ids
            .last()
            .and_then(|c| self.by_call.get(c).cloned().flatten())
    }

    /// Why it stopped: a rollout cut short says so, else its last model call's reason.
    fn of_rollout(&self, r: &Rollout) -> Option<String> {
        match r.outcome {
            Outcome::TimedOut => Some("timeout".into()),
            Outcome::Failed(_) | Outcome::BackendFailed(_) => Some("error".into()),
            Outcome::Scored(_) | Outcome::RewardFailed(_) => {
                self.last_of_session.get(&r.session_id).cloned().flatten()
            }
        }
    }
}

fn outcome(o: &Outcome) -> Value {
    match o {
        Outcome::Scored(_) => json!("scored"),
        Outcome::TimedOut => json!("timed_out"),
        Outcome::RewardFailed(e) => json!({"reward_failed": e}),
        Outcome::BackendFailed(e) => json!({"backend_failed": e}),
        Outcome::Failed(e) => json!({"failed": e}),
    }
}

#[cfg(test)]
pub(super) mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn rollout(session: &str, outcome: Outcome) -> Rollout {
        Rollout {
            task_id: "t".into(),
            group_id: "g".into(),
            session_id: session.into(),
            harness: "h".into(),
            outcome,
            harness_exit: None,
            harness_oom: false,
            harness_secs: 0.0,
            reward_secs: 0.0,
            harness_tail: String::new(),
        }
    }

    #[test]
    fn stop_reasons_come_from_the_last_call_or_from_why_the_rollout_ended() {
        let mut f = Finishes::default();
        f.add(
            [
                ("a", "a1", false, Some("tool_calls")),
                ("a", "a2", false, Some("stop")),
                ("a", "a3", true, None), // a model listing after the last call counts for nothing
                ("b", "b1", false, Some("length")),
                ("c", "c1", false, None),
            ]
            .into_iter(),
        );
        // A sample ends where its last call ended (a fork's first part: at the tool call).
        let s = |calls: &[&str]| Sample {
            call_ids: calls.iter().map(|c| c.to_string()).collect(),
            ..Sample::default()
        };
        assert_eq!(f.of_sample(&s(&["a1"])).as_deref(), Some("tool_calls"));
        assert_eq!(f.of_sample(&s(&["a1", "a2"])).as_deref(), Some("stop"));
        assert_eq!(f.of_sample(&s(&["b1"])).as_deref(), Some("length"));
        assert_eq!(f.of_sample(&s(&["c1"])), None);
        assert_eq!(f.of_sample(&s(&[])), None);
        let of = |session: &str, o: Outcome| f.of_rollout(&rollout(session, o));
        assert_eq!(of("a", Outcome::Scored(1.0)).as_deref(), Some("stop"));
        assert_eq!(
            of("b", Outcome::RewardFailed("x".into())).as_deref(),
            Some("length")
        );
        assert_eq!(of("a", Outcome::TimedOut).as_deref(), Some("timeout"));
        assert_eq!(
            of("a", Outcome::Failed("x".into())).as_deref(),
            Some("error")
        );
        assert_eq!(
            of("b", Outcome::BackendFailed("x".into())).as_deref(),
            Some("error")
        );
        assert_eq!(of("none", Outcome::Scored(0.0)), None);
    }

    pub(in crate::rollouts) fn sample(
        id: &str,
        versions: &[&str],
        token_versions: &[Option<u32>],
    ) -> Sample {
        Sample {
            sample_id: id.into(),
            session_id: format!("s-{id}"),
            tokens: vec![1, 2, 3, 4],
            loss_mask: vec![0, 1, 1, 0],
            logprobs: vec![None, Some(-0.5), None, None],
            weight_versions: versions.iter().map(|v| v.to_string()).collect(),
            token_weight_versions: token_versions.to_vec(),
            ..Sample::default()
        }
    }

    #[test]
    fn a_sample_is_stale_when_a_sampled_token_has_another_version() {
        let s = sample("a", &["v1", "v2"], &[None, Some(0), Some(1), None]);
        assert_eq!(s.token_weight_version(1), Some("v1"));
        assert!(is_stale(&s, "v1"), "token 2 was sampled by v2");
        assert!(is_stale(&s, "v2"), "token 1 was sampled by v1");
        let one = sample("b", &["v1"], &[None, Some(0), Some(0), None]);
        assert!(!is_stale(&one, "v1"));
        assert!(is_stale(&one, "v0"));
        let unknown = sample("c", &[], &[]);
        assert!(
            !is_stale(&unknown, "v1"),
            "an unknown version counts for nothing"
        );
    }
}

//! Records → samples, the one path `graft reconstruct` and `graft rl` share: a gateway data
//! dir's recorded calls (through `graft_recorder`'s readers) grouped by session, each
//! session's reward from its session log attached, the session merged
//! ([`merge_session`]), the samples written as Parquet, and a summary of what was done.

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::path::Path;

use graft_recorder::{CallRecord, SessionEvent};

use crate::error::ReconstructError;
use crate::merge::{CallTokens, MergeOptions, MergeResult, OnDrift, Summary, merge_session_with};
use crate::retokenize::{Model, Skip};
use crate::sample::write_samples_parquet;
use crate::threads::SideThreads;

/// What to do with a call the gateway recorded without token ids.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WithoutTokenIds {
    /// Re-tokenize its messages through the model's template (passthrough records).
    Retokenize,
    /// Skip it, counted under [`NO_TOKEN_IDS`] (an exact-mode run, where every call should
    /// carry the served token ids).
    Skip,
}

/// The skip reason of a call without token ids under [`WithoutTokenIds::Skip`].
pub const NO_TOKEN_IDS: &str = "no recorded token ids";

/// Which records to turn into samples, and how.
#[derive(Debug, Clone, Copy)]
pub struct FromRecords<'a> {
    /// Only these sessions are merged; every session when `None`.
    pub sessions: Option<&'a HashSet<String>>,
    pub without_token_ids: WithoutTokenIds,
    /// Count the calls of these sessions per `weight_version` (merged or not); none when
    /// `None`.
    pub count_versions_of: Option<&'a HashSet<String>>,
    /// What a drifted call does (fork, or realign its sample).
    pub on_drift: OnDrift,
    /// Calls left out of training by rule (side calls: a title model, tool-less calls).
    pub leave_out: Option<&'a LeaveOut>,
    /// What side threads' samples train on ([`crate::threads`]).
    pub side_threads: SideThreads,
}

impl FromRecords<'_> {
    /// Every session; calls without token ids re-tokenized; no version counts; drift
    /// forks; nothing left out by rule; side threads trained only on their own call rewards.
    pub fn all() -> FromRecords<'static> {
        FromRecords {
            sessions: None,
            without_token_ids: WithoutTokenIds::Retokenize,
            count_versions_of: None,
            on_drift: OnDrift::Fork,
            leave_out: None,
            side_threads: SideThreads::default(),
        }
    }
}

/// Rules that leave calls out of training: the side calls a harness makes beside the
/// rollout's conversation (titles, summaries with a small second model, tool-less helper
/// calls). A call left out is counted (with the rule that matched), never merged.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct LeaveOut {
    /// Model names (`model` of the record): exact, or a prefix when ending in `*`.
    pub models: Vec<String>,
    /// Calls that offer the model no tools.
    pub without_tools: bool,
    /// Calls whose recorded headers (the gateway's `recorder.record_headers`) match.
    pub headers: Vec<HeaderRule>,
}

/// A rule on a recorded request header: `NAME` (present), `NAME=VALUE` (equal),
/// `NAME~TEXT` (contains), `NAME!~TEXT` (present and does not contain). Names are
/// compared lower-cased.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HeaderRule {
    pub text: String,
    pub name: String,
    pub test: HeaderTest,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum HeaderTest {
    Present,
    Equals(String),
    Contains(String),
    Lacks(String),
}

impl HeaderRule {
    /// Parses `NAME`, `NAME=VALUE`, `NAME~TEXT` or `NAME!~TEXT`.
    pub fn parse(text: &str) -> Result<HeaderRule, String> {
        let (name, test) = if let Some((n, v)) = text.split_once("!~") {
            (n, HeaderTest::Lacks(v.to_owned()))
        } else if let Some((n, v)) = text.split_once('~') {
            (n, HeaderTest::Contains(v.to_owned()))
        } else if let Some((n, v)) = text.split_once('=') {
            (n, HeaderTest::Equals(v.to_owned()))
        } else {
            (text, HeaderTest::Present)
        };
        let name = name.trim().to_ascii_lowercase();
        if name.is_empty()
            || !name
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b"-_.".contains(&b))
        {
            return Err(format!(
                "'{text}' is not a header rule: NAME, NAME=VALUE, NAME~TEXT or NAME!~TEXT"
            ));
        }
        Ok(HeaderRule {
            text: text.to_owned(),
            name,
            test,
        })
    }

    fn matches(&self, rec: &CallRecord) -> bool {
        let value = rec.headers.as_ref().and_then(|h| h.get(&self.name));
        match (&self.test, value) {
            (_, None) => false,
            (HeaderTest::Present, Some(_)) => true,
            (HeaderTest::Equals(v), Some(x)) => x == v,
            (HeaderTest::Contains(v), Some(x)) => x.contains(v.as_str()),
            (HeaderTest::Lacks(v), Some(x)) => !x.contains(v.as_str()),
        }
    }
}

impl LeaveOut {
    /// The rule that leaves `rec` out, if one does.
    pub fn reason(&self, rec: &CallRecord) -> Option<String> {
        let model = rec
            .model
            .as_deref()
            .or_else(|| rec.request.get("model").and_then(serde_json::Value::as_str));
        if let Some(m) = model
            && let Some(rule) = self.models.iter().find(|r| match r.strip_suffix('*') {
                Some(prefix) => m.starts_with(prefix),
                None => m == r.as_str(),
            })
        {
            return Some(format!("left out: model '{m}' (rule '{rule}')"));
        }
        let offers_tools = rec
            .request
            .get("tools")
            .and_then(serde_json::Value::as_array)
            .is_some_and(|t| !t.is_empty());
        if self.without_tools && !offers_tools {
            return Some("left out: offers no tools".to_owned());
        }
        if let Some(rule) = self.headers.iter().find(|r| r.matches(rec)) {
            return Some(format!(
                "left out: header {} (rule '{}')",
                rule.name, rule.text
            ));
        }
        None
    }
}

/// What [`samples_from_records`] did.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Reconstruction {
    pub summary: Summary,
    /// Calls merged from their recorded token ids.
    pub exact_calls: u64,
    /// Calls merged after re-tokenizing their text.
    pub retokenized_calls: u64,
    /// Calls left out, per reason ([`skip_reason`], [`NO_TOKEN_IDS`]).
    pub skipped: BTreeMap<String, u64>,
    /// Sessions with inference calls of which none became part of a sample (every call
    /// skipped or left out), in id order.
    pub sessions_without_samples: Vec<String>,
    /// The sessions of `sessions_without_samples` whose every call a [`LeaveOut`] rule left
    /// out (e.g. `without_tools` on an agent that never offers tools), in id order.
    pub sessions_left_out: Vec<String>,
    /// Calls of [`FromRecords::count_versions_of`] per `weight_version` ("unknown" when the
    /// record has none).
    pub weight_versions: BTreeMap<String, usize>,
    /// Calls of [`FromRecords::count_versions_of`] per session.
    pub calls_per_session: BTreeMap<String, usize>,
    /// Call rewards attached to a merged call.
    pub call_rewards: u64,
    /// Call rewards of the merged sessions that name no merged call (a call of another
    /// session, one left out or skipped, or no call at all), as `SESSION/CALL_ID` or
    /// `SESSION/seq N`.
    pub call_rewards_unmatched: Vec<String>,
}

/// Why a call could not be re-tokenized, as the summary counts it: each distinct reason,
/// with the template's own error text.
pub fn skip_reason(s: &Skip) -> String {
    s.to_string()
}

/// The rewards of a data dir's session log, the last posted of each.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Rewards {
    /// Per session.
    pub sessions: HashMap<String, f64>,
    /// Per (session, call id): process rewards of single turns.
    pub calls: HashMap<(String, String), f64>,
    /// Per (session, seq): the same, for calls named by their seq.
    pub seqs: HashMap<(String, u64), f64>,
}

/// Reads the rewards of `data_dir`'s session log.
pub fn rewards(data_dir: &Path) -> Result<Rewards, ReconstructError> {
    let mut out = Rewards::default();
    for ev in graft_recorder::read_session_events(data_dir)? {
        match ev {
            SessionEvent::Reward {
                session_id, reward, ..
            } => {
                out.sessions.insert(session_id, reward);
            }
            SessionEvent::CallReward {
                session_id,
                call_id,
                seq,
                reward,
                ..
            } => {
                if let Some(c) = call_id {
                    out.calls.insert((session_id, c), reward);
                } else if let Some(n) = seq {
                    out.seqs.insert((session_id, n), reward);
                }
            }
            _ => {}
        }
    }
    Ok(out)
}

/// Reads the records of `data_dir`, merges the chosen sessions' calls (in record order)
/// into samples with their rewards, writes them to `out` (its directory is created) and
/// says what was done. Sessions are merged in session-id order.
pub fn samples_from_records(
    model: &Model,
    data_dir: &Path,
    how: FromRecords<'_>,
    out: &Path,
) -> Result<Reconstruction, ReconstructError> {
    let (tok_fp, tpl_fp) = model.fingerprints();
    let Rewards {
        sessions: rewards,
        calls: mut call_rewards,
        seqs: mut seq_rewards,
    } = rewards(data_dir)?;
    let mut done = Reconstruction::default();
    let mut sessions: BTreeMap<String, (Option<String>, Vec<CallTokens>)> = BTreeMap::new();
    // Branch sessions (the gateway's `branch_of`): their replayed calls, by session.
    let mut branches: BTreeMap<String, Option<crate::branch::BranchInfo>> = BTreeMap::new();
    let mut seen: BTreeSet<String> = BTreeSet::new();
    // Sessions with a call a leave-out rule took out.
    let mut ruled: BTreeSet<String> = BTreeSet::new();
    let records = graft_recorder::read_records(data_dir)?;
    // Retried turns are trained on the attempt the client received; abandoned calls not at all.
    let left_out = crate::attempts::left_out(&records);
    for rec in records {
        if how
            .count_versions_of
            .is_some_and(|s| s.contains(&rec.session_id))
        {
            *done
                .weight_versions
                .entry(
                    rec.weight_version
                        .clone()
                        .unwrap_or_else(|| "unknown".into()),
                )
                .or_insert(0) += 1;
            *done
                .calls_per_session
                .entry(rec.session_id.clone())
                .or_insert(0) += 1;
        }
        if how.sessions.is_some_and(|s| !s.contains(&rec.session_id)) {
            continue;
        }
        // A model listing is no inference call: nothing to train on, nothing skipped.
        if rec.dialect == "models" {
            continue;
        }
        if let Some(why) = how.leave_out.and_then(|l| l.reason(&rec)) {
            *done.skipped.entry(why).or_default() += 1;
            ruled.insert(rec.session_id.clone());
            continue;
        }
        if let Some(why) = left_out.get(&rec.call_id) {
            *done.skipped.entry((*why).to_owned()).or_default() += 1;
            continue;
        }
        seen.insert(rec.session_id.clone());
        if rec.replay.is_some() {
            crate::branch::BranchInfo::add(
                branches.entry(rec.session_id.clone()).or_default(),
                &rec,
            );
        }
        let calls = match CallTokens::from_record(&rec) {
            Some(c) => {
                done.exact_calls += 1;
                c
            }
            None if how.without_token_ids == WithoutTokenIds::Skip => {
                *done.skipped.entry(NO_TOKEN_IDS.to_owned()).or_default() += 1;
                continue;
            }
            None => match model.record_tokens(&rec) {
                Ok(c) => {
                    done.retokenized_calls += 1;
                    c
                }
                Err(s) => {
                    *done.skipped.entry(skip_reason(&s)).or_default() += 1;
                    continue;
                }
            },
        };
        let mut calls = calls;
        // Named by id, else by seq (a call named both ways takes the reward by id).
        let by_id = call_rewards.remove(&(rec.session_id.clone(), rec.call_id.clone()));
        let by_seq = seq_rewards.remove(&(rec.session_id.clone(), rec.seq));
        calls.reward = by_id.or(by_seq);
        done.call_rewards += u64::from(calls.reward.is_some());
        sessions
            .entry(rec.session_id.clone())
            .or_insert_with(|| (rec.group_id.clone(), vec![]))
            .1
            .push(calls);
    }
    let results: Vec<MergeResult> = sessions
        .iter()
        .map(|(sid, (group, calls))| {
            let mut merged = merge_session_with(
                sid,
                group.as_deref(),
                calls,
                rewards.get(sid).copied(),
                (&tok_fp, &tpl_fp),
                MergeOptions {
                    on_drift: how.on_drift,
                    side_threads: how.side_threads,
                },
            );
            if let Some(Some(b)) = branches.get(sid) {
                crate::branch::mask_replayed(&mut merged, b);
            }
            merged
        })
        .collect();
    write_results(&results, out)?;
    done.summary = Summary::of(&results);
    done.summary.side_policy = how.side_threads;
    let mut unmatched: Vec<String> = call_rewards
        .into_keys()
        .chain(
            seq_rewards
                .into_keys()
                .map(|(s, n)| (s, format!("seq {n}"))),
        )
        .filter(|(sid, _)| how.sessions.is_none_or(|s| s.contains(sid)))
        .map(|(sid, call)| format!("{sid}/{call}"))
        .collect();
    unmatched.sort();
    done.call_rewards_unmatched = unmatched;
    done.sessions_left_out = ruled
        .iter()
        .filter(|s| !seen.contains(*s))
        .cloned()
        .collect();
    done.sessions_without_samples = seen
        .into_iter()
        .chain(ruled)
        .filter(|s| !sessions.contains_key(s))
        .collect::<BTreeSet<_>>()
        .into_iter()
        .collect();
    Ok(done)
}

/// Writes the samples of merged sessions to `out` (its directory is created).
pub fn write_results(results: &[MergeResult], out: &Path) -> Result<(), ReconstructError> {
    let samples: Vec<_> = results
        .iter()
        .flat_map(|r| r.samples.iter().cloned())
        .collect();
    if let Some(dir) = out.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir)
            .map_err(|e| ReconstructError::io("creating the directory", dir, e))?;
    }
    write_samples_parquet(&samples, out)
}

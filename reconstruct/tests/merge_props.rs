//! Property tests of the merge of a session's calls into token-masked samples, and the
//! samples' Parquet round trip (also read back by pyarrow and DuckDB from the test
//! environment, `.graft-test-env/` or `$GRAFT_TEST_ENV`).

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::collections::HashMap;
use std::path::PathBuf;
use std::process::Command;

use graft_reconstruct::merge::{
    CallTokens, ForkReason, MergeOptions, MergeResult, OnDrift, REORDER_MIN_RUN, Summary,
    merge_session, merge_session_with,
};
use graft_reconstruct::sample::{
    EventKind, SAMPLE_SCHEMA_VERSION, Sample, SampleEvent, read_samples_parquet,
    write_samples_parquet,
};
use graft_recorder::WeightSpan;
use proptest::prelude::*;

const FP: (&str, &str) = ("tok-fp", "tpl-fp");

// -------------------------------------------------------------------------------------
// Building sessions

/// A session under construction: its calls and the conversation state of each branch.
#[derive(Default)]
struct Session {
    calls: Vec<CallTokens>,
    /// Conversation state (last prompt + completion) of each branch.
    branches: Vec<Vec<u32>>,
    /// Per branch: (prompt end, completion end) of each of its calls.
    bounds: Vec<Vec<(usize, usize)>>,
    /// Per branch: its calls' ids.
    branch_calls: Vec<Vec<String>>,
    /// Source of tokens no other call uses (constructed cases).
    fresh: u32,
    with_logprobs: bool,
    /// The conversation root the next calls carry.
    root: Option<String>,
}

impl Session {
    fn new() -> Self {
        Session {
            fresh: 1_000_000,
            with_logprobs: true,
            ..Session::default()
        }
    }

    fn fresh(&mut self, n: usize) -> Vec<u32> {
        let v: Vec<u32> = (self.fresh..self.fresh + n as u32).collect();
        self.fresh += n as u32;
        v
    }

    /// Records a call; returns its id.
    fn call(&mut self, prompt: Vec<u32>, completion: Vec<u32>) -> String {
        let seq = self.calls.len() as u64 + 1;
        let call_id = format!("call-{seq}");
        // Some tokens' logprobs unknown (a backend that sent null for them).
        let logprobs = self.with_logprobs.then(|| {
            (0..completion.len())
                .map(|r| (r % 5 != 3).then(|| -(seq as f32) * 0.01 - r as f32 * 1e-4))
                .collect()
        });
        // Every fourth call straddles a weight update halfway through its completion.
        let n = completion.len() as u64;
        let weight_version_spans = (seq.is_multiple_of(4) && n >= 2).then(|| {
            vec![
                WeightSpan {
                    version: format!("w{}", seq / 3),
                    start: 0,
                    end: n / 2,
                },
                WeightSpan {
                    version: format!("w{}-next", seq / 3),
                    start: n / 2,
                    end: n,
                },
            ]
        });
        self.calls.push(CallTokens {
            call_id: call_id.clone(),
            seq,
            prompt_ids: prompt,
            completion_ids: completion,
            completion_logprobs: logprobs,
            logprob_kind: Default::default(),
            weight_version: Some(format!(
                "w{}{}",
                seq / 3,
                if weight_version_spans.is_some() {
                    "-next"
                } else {
                    ""
                }
            )),
            weight_version_spans,
            finish_reason: Some("stop".to_owned()),
            root: self.root.clone(),
            // Some turns carry a process reward.
            reward: (seq % 3 == 1).then_some(seq as f64 * 0.25),
            ..Default::default()
        });
        call_id
    }

    /// A call on branch `b` (a new branch when `b == branches.len()`) with this prompt.
    fn call_on(&mut self, b: usize, prompt: Vec<u32>, completion: Vec<u32>) -> String {
        let pe = prompt.len();
        let mut state = prompt.clone();
        state.extend_from_slice(&completion);
        let id = self.call(prompt, completion);
        if b == self.branches.len() {
            self.branches.push(Vec::new());
            self.bounds.push(Vec::new());
            self.branch_calls.push(Vec::new());
        }
        if !state.starts_with(&self.branches[b]) {
            // Compacted or re-rendered: the old call ends no longer index this state.
            self.bounds[b].clear();
        }
        self.bounds[b].push((pe, state.len()));
        self.branches[b] = state;
        self.branch_calls[b].push(id.clone());
        id
    }

    /// Continues branch `b` with `gap` then `completion`.
    fn turn(&mut self, b: usize, gap: &[u32], completion: Vec<u32>) -> String {
        let mut prompt = self.branches[b].clone();
        prompt.extend_from_slice(gap);
        self.call_on(b, prompt, completion)
    }

    fn merge(&self) -> MergeResult {
        let r = merge_session("sess", Some("grp"), &self.calls, Some(0.5), FP);
        check_invariants(&self.calls, &r);
        r
    }
}

/// Calls in a session's first sample.
fn first_calls(r: &MergeResult) -> usize {
    r.samples.first().map_or(0, |s| s.call_ids.len())
}

/// The properties every merge must have, whatever the session.
fn check_invariants(calls: &[CallTokens], r: &MergeResult) {
    let by_id: HashMap<&str, &CallTokens> = calls.iter().map(|c| (c.call_id.as_str(), c)).collect();
    // Every call in exactly one sample.
    let mut seen: HashMap<&str, usize> = HashMap::new();
    for s in &r.samples {
        for id in &s.call_ids {
            *seen.entry(id.as_str()).or_default() += 1;
        }
    }
    for c in calls {
        assert_eq!(
            seen.get(c.call_id.as_str()),
            Some(&1),
            "call {} must be in exactly one sample",
            c.call_id
        );
    }
    assert_eq!(seen.len(), calls.len());
    assert_eq!(
        r.samples.len(),
        r.forks.len() + usize::from(!calls.is_empty())
    );

    let mut forks = r.forks.iter();
    for (k, s) in r.samples.iter().enumerate() {
        assert_eq!(s.sample_id, format!("sess/{k}"));
        assert_eq!(s.session_id, "sess");
        assert_eq!(s.group_id.as_deref(), Some("grp"));
        assert_eq!(s.reward, Some(0.5));
        assert_eq!(s.schema_version, SAMPLE_SCHEMA_VERSION);
        assert_eq!(
            (
                s.tokenizer_fingerprint.as_str(),
                s.template_fingerprint.as_str()
            ),
            FP
        );
        assert_eq!(s.tokens.len(), s.loss_mask.len());
        assert_eq!(s.tokens.len(), s.logprobs.len());
        assert_eq!(s.tokens.len(), s.token_weight_versions.len());
        if k == 0 {
            assert_eq!(s.fork_reason, None);
        } else {
            let (call_id, reason) = forks.next().expect("a fork per later sample");
            assert_eq!(&s.call_ids[0], call_id);
            assert_eq!(s.fork_reason.as_deref(), Some(reason.as_str()));
        }
        // Each call's prompt + completion is a prefix of the sample; the completion is
        // masked 1 with its logprobs; completions are disjoint and in seq order.
        let mut spans = Vec::new();
        let mut last_seq = 0;
        for id in &s.call_ids {
            let c = by_id[id.as_str()];
            assert!(c.seq > last_seq, "call_ids in seq order");
            last_seq = c.seq;
            let (p, n) = (c.prompt_ids.len(), c.completion_ids.len());
            assert_eq!(
                &s.tokens[..p],
                &c.prompt_ids[..],
                "{id}: prompt is a prefix"
            );
            assert_eq!(
                &s.tokens[p..p + n],
                &c.completion_ids[..],
                "{id}: completion follows"
            );
            assert!(
                s.loss_mask[p..p + n].iter().all(|&m| m == 1),
                "{id}: masked 1"
            );
            let want: Vec<Option<f32>> = c
                .completion_logprobs
                .clone()
                .unwrap_or_else(|| vec![None; n]);
            assert_eq!(&s.logprobs[p..p + n], &want[..], "{id}: logprobs");
            for i in 0..n {
                assert_eq!(
                    s.token_weight_version(p + i),
                    c.version_of(i),
                    "{id}: token {i}'s weight version"
                );
            }
            if let Some(spans_last) = spans.last() {
                let (_, end): &(usize, usize) = spans_last;
                assert!(p >= *end, "{id}: completions overlap");
            }
            spans.push((p, p + n));
        }
        // Each sampled token names the call that sampled it; each call its reward.
        assert_eq!(s.token_calls.len(), s.tokens.len());
        assert_eq!(s.call_rewards.len(), s.call_ids.len());
        for (j, id) in s.call_ids.iter().enumerate() {
            let c = by_id[id.as_str()];
            let (p, n) = (c.prompt_ids.len(), c.completion_ids.len());
            assert!(
                s.token_calls[p..p + n].iter().all(|&t| t == Some(j as u32)),
                "{id}: its completion's tokens name it"
            );
            assert_eq!(s.call_rewards[j], c.reward, "{id}: its reward");
        }
        for (i, &m) in s.loss_mask.iter().enumerate() {
            assert_eq!(
                s.token_calls[i].is_some(),
                m == 1,
                "token {i}: a call iff sampled"
            );
        }
        // Mask 1 exactly on those completions.
        let sampled: usize = spans.iter().map(|(a, b)| b - a).sum();
        assert_eq!(
            s.trained_tokens(),
            sampled,
            "{}: mask 1 only on sampled tokens",
            s.sample_id
        );
        assert!(s.loss_mask.iter().all(|&m| m <= 1));
        for (i, &m) in s.loss_mask.iter().enumerate() {
            if m == 0 {
                assert_eq!(s.logprobs[i], None, "a prompt token's logprob is unknown");
                assert_eq!(s.token_weight_versions[i], None);
            }
        }
        let versions: Vec<String> = {
            let mut v: Vec<String> = Vec::new();
            for id in &s.call_ids {
                let c = by_id[id.as_str()];
                let spans = c.weight_version_spans.iter().flatten();
                for w in spans.map(|s| &s.version).chain(&c.weight_version) {
                    if !v.contains(w) {
                        v.push(w.clone());
                    }
                }
            }
            v
        };
        assert_eq!(s.weight_versions, versions);
    }
    for d in &r.drift {
        assert!(matches!(
            d.reason,
            ForkReason::TemplateDrift | ForkReason::Reordered | ForkReason::Other
        ));
        assert!(r.forks.contains(&(d.call_id.clone(), d.reason)));
        // Each drift event stands in the sample it was found in, at its position.
        let against = r
            .samples
            .iter()
            .find(|s| s.sample_id == d.against_sample)
            .expect("the drifted sample");
        assert!(
            against.events.iter().any(|e| e.kind == EventKind::Drift
                && e.call_id == d.call_id
                && e.at as usize == d.first_diff_at
                && e.len as usize == d.len
                && e.reason == d.reason.as_str()),
            "{d:?} in {:?}",
            against.events
        );
    }
    check_events(r);
}

/// The samples' events: every later sample opens with its fork, where its tokens leave the
/// sample it forked from; that sample holds the matching branch or drift event; nothing else.
fn check_events(r: &MergeResult) {
    let by_id: HashMap<&str, &Sample> = r
        .samples
        .iter()
        .map(|s| (s.sample_id.as_str(), s))
        .collect();
    let (mut forks, mut drifts) = (0, 0);
    for (k, s) in r.samples.iter().enumerate() {
        for (j, e) in s.events.iter().enumerate() {
            assert!(e.at as usize <= s.tokens.len(), "{e:?} off {}", s.sample_id);
            match e.kind {
                EventKind::Fork => {
                    forks += 1;
                    assert!(k > 0 && j == 0, "a fork opens a later sample: {e:?}");
                    assert_eq!(Some(&e.reason), s.fork_reason.as_ref());
                    assert_eq!(e.call_id, s.call_ids[0]);
                    match &e.other_sample {
                        None => assert_eq!(e.reason, "new_root"),
                        Some(o) => {
                            let from = by_id[o.as_str()];
                            let at = e.at as usize;
                            assert_eq!(
                                &s.tokens[..at],
                                &from.tokens[..at],
                                "{}: forked from {o} at {at}",
                                s.sample_id
                            );
                            assert!(
                                from.events.iter().any(|f| f.kind != EventKind::Fork
                                    && f.call_id == e.call_id
                                    && f.at == e.at
                                    && f.other_sample.as_deref() == Some(&s.sample_id)),
                                "{o} marks where {} left it: {:?}",
                                s.sample_id,
                                from.events
                            );
                        }
                    }
                }
                EventKind::Drift | EventKind::Branch => {
                    drifts += usize::from(e.kind == EventKind::Drift);
                    let other = e.other_sample.as_deref().expect("the sample it started");
                    assert_eq!(by_id[other].events[0].call_id, e.call_id);
                }
            }
        }
    }
    assert_eq!(forks, r.forks.len(), "one fork event per fork");
    assert_eq!(drifts, r.drift.len(), "one drift event per drift");
}

// -------------------------------------------------------------------------------------
// Random sessions: the invariants

#[derive(Debug, Clone)]
enum Op {
    /// Continue a branch: gap (tool result, user turn, glue), then a completion.
    Turn {
        b: usize,
        gap: Vec<u32>,
        completion: Vec<u32>,
    },
    /// The same prompt as a branch's last call, sampled again (a new branch).
    Resample { b: usize, completion: Vec<u32> },
    /// A new branch from an earlier call's end of a branch.
    BranchEarlier {
        b: usize,
        at: usize,
        gap: Vec<u32>,
        completion: Vec<u32>,
    },
    /// Keep a start of the branch, replace the rest by a summary.
    Compact {
        b: usize,
        keep: usize,
        summary: Vec<u32>,
        completion: Vec<u32>,
    },
    /// Re-render a region of the branch's history, then continue.
    Rerender {
        b: usize,
        at: usize,
        cut: usize,
        with: Vec<u32>,
        gap: Vec<u32>,
        completion: Vec<u32>,
    },
    /// A prompt unrelated to anything before.
    Fresh {
        prompt: Vec<u32>,
        completion: Vec<u32>,
    },
}

fn toks(max: usize) -> impl Strategy<Value = Vec<u32>> {
    prop::collection::vec(0u32..50_000, 0..max)
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        6 => (any::<usize>(), toks(12), toks(16))
            .prop_map(|(b, gap, completion)| Op::Turn { b, gap, completion }),
        1 => (any::<usize>(), toks(16)).prop_map(|(b, completion)| Op::Resample { b, completion }),
        1 => (any::<usize>(), any::<usize>(), toks(12), toks(16))
            .prop_map(|(b, at, gap, completion)| Op::BranchEarlier { b, at, gap, completion }),
        1 => (any::<usize>(), any::<usize>(), toks(8), toks(16))
            .prop_map(|(b, keep, summary, completion)| Op::Compact { b, keep, summary, completion }),
        1 => (any::<usize>(), any::<usize>(), 0usize..12, toks(12), toks(8), toks(16))
            .prop_map(|(b, at, cut, with, gap, completion)| Op::Rerender { b, at, cut, with, gap, completion }),
        1 => (toks(24), toks(16)).prop_map(|(prompt, completion)| Op::Fresh { prompt, completion }),
    ]
}

/// Plays `ops` into a session; `alphabet` > 0 folds every token into `0..alphabet` (many
/// coincidental matches), 0 keeps them as drawn.
fn play(first: (Vec<u32>, Vec<u32>), ops: &[Op], alphabet: u32, with_logprobs: bool) -> Session {
    let fold = |v: &[u32]| -> Vec<u32> {
        if alphabet == 0 {
            v.to_vec()
        } else {
            v.iter().map(|t| t % alphabet).collect()
        }
    };
    let mut s = Session::new();
    s.with_logprobs = with_logprobs;
    s.call_on(0, fold(&first.0), fold(&first.1));
    for op in ops {
        let nb = s.branches.len();
        match op {
            Op::Turn { b, gap, completion } => {
                s.turn(b % nb, &fold(gap), fold(completion));
            }
            Op::Resample { b, completion } => {
                let b = b % nb;
                let (pe, _) = *s.bounds[b].last().expect("a branch has calls");
                let prompt = s.branches[b][..pe].to_vec();
                s.call_on(nb, prompt, fold(completion));
            }
            Op::BranchEarlier {
                b,
                at,
                gap,
                completion,
            } => {
                let b = b % nb;
                let (_, ce) = s.bounds[b][at % s.bounds[b].len()];
                let mut prompt = s.branches[b][..ce].to_vec();
                prompt.extend(fold(gap));
                s.call_on(nb, prompt, fold(completion));
            }
            Op::Compact {
                b,
                keep,
                summary,
                completion,
            } => {
                let b = b % nb;
                let state = &s.branches[b];
                let mut prompt = state[..keep % (state.len() + 1)].to_vec();
                prompt.extend(fold(summary));
                s.call_on(b, prompt, fold(completion));
            }
            Op::Rerender {
                b,
                at,
                cut,
                with,
                gap,
                completion,
            } => {
                let b = b % nb;
                let state = &s.branches[b];
                let at = at % (state.len() + 1);
                let end = (at + cut).min(state.len());
                let mut prompt = state[..at].to_vec();
                prompt.extend(fold(with));
                prompt.extend_from_slice(&state[end..]);
                prompt.extend(fold(gap));
                s.call_on(b, prompt, fold(completion));
            }
            Op::Fresh { prompt, completion } => {
                s.call_on(nb, fold(prompt), fold(completion));
            }
        }
    }
    s
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn random_sessions_keep_the_invariants(
        first in (toks(24), toks(16)),
        ops in prop::collection::vec(op(), 0..24),
        alphabet in prop_oneof![Just(0u32), Just(2u32), Just(5u32), Just(300u32)],
        with_logprobs in any::<bool>(),
    ) {
        let s = play(first, &ops, alphabet, with_logprobs);
        s.merge();
    }

    /// Calls that start their own conversation (titles, summaries, sub-agents) between
    /// the turns of the rollout's conversation are new roots: each its own sample, never
    /// drift, never another reason; the rollout's conversation stays one sample, and a
    /// side conversation's own next call continues its sample.
    #[test]
    fn side_conversations_are_new_roots_not_drift(
        first in (toks(24), toks(16)),
        turns in prop::collection::vec(
            (toks(12), toks(16), prop::option::of((toks(20), toks(8), any::<bool>()))),
            1..16,
        ),
    ) {
        let mut s = Session::new();
        s.root = Some("main".into());
        s.call_on(0, first.0.clone(), first.1.clone());
        let mut sides = 0;
        let mut side_turns = 0;
        for (gap, completion, side) in turns {
            s.root = Some("main".into());
            s.turn(0, &gap, completion);
            if let Some((p, c, again)) = side {
                sides += 1;
                s.root = Some(format!("side-{sides}"));
                // Shares the start of the main conversation (the template's system
                // header), then differs.
                let keep = 4.min(s.branches[0].len().saturating_sub(1));
                let mut prompt = s.branches[0][..keep].to_vec();
                prompt.extend(s.fresh(1));
                prompt.extend(p);
                s.call_on(sides, prompt, c.clone());
                if again {
                    let g = s.fresh(2);
                    s.turn(sides, &g, c);
                    side_turns += 1;
                }
            }
        }
        let r = s.merge();
        prop_assert_eq!(r.samples.len(), 1 + sides);
        prop_assert!(r.drift.is_empty(), "{:?}", r.drift);
        prop_assert_eq!(r.forks.len(), sides);
        prop_assert!(r.forks.iter().all(|(_, why)| *why == ForkReason::NewRoot), "{:?}", r.forks);
        prop_assert_eq!(&r.samples[0].tokens, &s.branches[0]);
        let merged: usize = r.samples.iter().map(|x| x.call_ids.len()).sum();
        prop_assert_eq!(merged, s.calls.len());
        prop_assert_eq!(s.calls.len(), first_calls(&r) + sides + side_turns);
    }

    #[test]
    fn a_linear_session_is_one_sample(
        first in (toks(24), toks(16)),
        turns in prop::collection::vec((toks(12), toks(16)), 0..30),
        alphabet in prop_oneof![Just(0u32), Just(2u32), Just(7u32)],
    ) {
        let ops: Vec<Op> = turns
            .into_iter()
            .map(|(gap, completion)| Op::Turn { b: 0, gap, completion })
            .collect();
        let s = play(first, &ops, alphabet, true);
        let r = s.merge();
        prop_assert_eq!(r.samples.len(), 1);
        prop_assert!(r.forks.is_empty());
        prop_assert!(r.drift.is_empty());
        prop_assert_eq!(r.samples[0].call_ids.len(), s.calls.len());
        prop_assert_eq!(&r.samples[0].tokens, &s.branches[0]);
    }

    /// Interleaved parallel branches (same prompt sampled again, or a branch from an
    /// earlier turn) are each continued in their own sample.
    #[test]
    fn interleaved_parallel_branches_continue_their_own_samples(
        lens in prop::collection::vec((1usize..12, 1usize..16), 1..6),
        from_prompt in any::<bool>(),
        at in any::<usize>(),
        steps in prop::collection::vec((any::<bool>(), 1usize..12, 1usize..16), 1..12),
    ) {
        let mut s = Session::new();
        let sys = s.fresh(10);
        let c = s.fresh(lens[0].1);
        s.call_on(0, sys, c);
        for &(g, c) in &lens[1..] {
            let (g, c) = (s.fresh(g), s.fresh(c));
            s.turn(0, &g, c);
        }
        let k = at % s.bounds[0].len();
        let (pe, ce) = s.bounds[0][k];
        let prompt = if from_prompt {
            s.branches[0][..pe].to_vec()
        } else {
            let mut p = s.branches[0][..ce].to_vec();
            p.extend(s.fresh(3));
            p
        };
        // A branch from the very end of the branch would be a continuation.
        prop_assume!(from_prompt || ce < s.branches[0].len());
        let c = s.fresh(5);
        let branch_call = s.call_on(1, prompt, c);
        for (which, g, c) in steps {
            let (g, c) = (s.fresh(g), s.fresh(c));
            s.turn(usize::from(which), &g, c);
        }
        let r = s.merge();
        prop_assert_eq!(r.forks, vec![(branch_call, ForkReason::ParallelBranch)]);
        prop_assert!(r.drift.is_empty());
        prop_assert_eq!(r.samples.len(), 2);
        prop_assert_eq!(&r.samples[0].call_ids, &s.branch_calls[0]);
        prop_assert_eq!(&r.samples[1].call_ids, &s.branch_calls[1]);
        prop_assert_eq!(&r.samples[0].tokens, &s.branches[0]);
        prop_assert_eq!(&r.samples[1].tokens, &s.branches[1]);
    }

    /// A compaction keeps a start of the first prompt (the system prompt) and replaces
    /// the history by a summary; later turns continue the compacted sample.
    #[test]
    fn compaction_is_classified(
        sys_len in 1usize..24,
        user_len in 1usize..8,
        turns in prop::collection::vec((1usize..20, 8usize..30), 2..8),
        keep in any::<usize>(),
        summary_len in 1usize..6,
        after in 0usize..4,
    ) {
        let mut s = Session::new();
        let mut p = s.fresh(sys_len);
        p.extend(s.fresh(user_len));
        let c = s.fresh(turns[0].1);
        s.call_on(0, p, c);
        for &(g, c) in &turns[1..] {
            let (g, c) = (s.fresh(g), s.fresh(c));
            s.turn(0, &g, c);
        }
        let keep = 1 + keep % sys_len;
        let mut p = s.branches[0][..keep].to_vec();
        p.extend(s.fresh(summary_len));
        prop_assume!(p.len() * 4 <= s.branches[0].len() * 3);
        let c = s.fresh(7);
        let compacted = s.call_on(0, p, c);
        for _ in 0..after {
            let (g, c) = (s.fresh(4), s.fresh(6));
            s.turn(0, &g, c);
        }
        let r = s.merge();
        prop_assert_eq!(r.forks, vec![(compacted, ForkReason::Compaction)]);
        prop_assert!(r.drift.is_empty());
        prop_assert_eq!(r.samples.len(), 2);
        prop_assert_eq!(r.samples[1].call_ids.len(), 1 + after);
    }

    /// Qwen3-style template drift: the re-rendered prompt drops the `<think>` blocks of
    /// every earlier assistant turn (one differing region per turn) and keeps the rest.
    /// Answer + glue between two dropped blocks is at least `DRIFT_ANCHOR` tokens, so each
    /// block is its own region and `len` is exactly the dropped tokens.
    #[test]
    fn dropped_think_blocks_are_template_drift(
        sys_len in 1usize..24,
        turns in prop::collection::vec((1usize..300, 4usize..20, 3usize..20), 1..6),
        user_len in 1usize..10,
    ) {
        const OPEN: u32 = 7;
        const CLOSE: u32 = 8;
        const END: u32 = 9;
        let mut s = Session::new();
        let mut sampled = s.fresh(sys_len); // the sampled history, thinks included
        let mut rendered = sampled.clone(); // as the template re-renders it
        let mut first_think_at = None;
        let mut dropped = 0;
        for (k, &(think, answer, gap)) in turns.iter().enumerate() {
            let g = s.fresh(gap);
            sampled.extend_from_slice(&g);
            rendered.extend_from_slice(&g);
            let mut c = vec![OPEN];
            c.extend(s.fresh(think));
            c.push(CLOSE);
            let a = s.fresh(answer);
            c.extend_from_slice(&a);
            c.push(END);
            first_think_at.get_or_insert(sampled.len());
            dropped += think + 2;
            rendered.extend_from_slice(&a);
            rendered.push(END);
            if k == 0 {
                s.call_on(0, sampled.clone(), c.clone());
            } else {
                s.turn(0, &g, c.clone());
            }
            sampled.extend_from_slice(&c);
        }
        prop_assert_eq!(&sampled, &s.branches[0]);
        rendered.extend(s.fresh(user_len));
        let c = s.fresh(5);
        let drifted = s.call_on(1, rendered, c);
        let r = s.merge();
        prop_assert_eq!(&r.forks, &vec![(drifted.clone(), ForkReason::TemplateDrift)]);
        prop_assert_eq!(r.drift.len(), 1);
        prop_assert_eq!(&r.drift[0].call_id, &drifted);
        prop_assert_eq!(r.drift[0].against_sample.as_str(), "sess/0");
        prop_assert_eq!(Some(r.drift[0].first_diff_at), first_think_at);
        prop_assert_eq!(r.drift[0].len, dropped);
    }
}

// -------------------------------------------------------------------------------------
// Constructed cases

#[test]
fn a_re_serialized_tool_call_is_template_drift() {
    let mut s = Session::new();
    let sys = s.fresh(30);
    let mut c = s.fresh(20);
    c.extend([5, 6, 9]); // ... `}}`, `</tool_call>`, `<|im_end|>`
    s.call_on(0, sys, c.clone());
    let g = s.fresh(12);
    let c2 = s.fresh(15);
    s.turn(0, &g, c2);
    // The first turn's arguments re-serialized: 4 tokens in the middle differ.
    let mut p = s.branches[0].clone();
    p.splice(35..39, s.fresh(6));
    p.extend(s.fresh(9));
    let c3 = s.fresh(4);
    let id = s.call_on(1, p, c3);
    let r = s.merge();
    assert_eq!(r.forks, vec![(id.clone(), ForkReason::TemplateDrift)]);
    assert_eq!(r.drift.len(), 1);
    assert_eq!((r.drift[0].first_diff_at, r.drift[0].len), (35, 4));
}

/// OpenClaw's history, as the Qwen3 template renders it: the internal-context user message
/// `ctx` is kept last, so the next call's prompt has the answer and the tool result BEFORE
/// it, and the answer loses its `<think>` (it is no longer after the last user message).
/// `ctx_len` tokens of context.
fn moved_context_session(ctx_len: usize) -> (Session, String, usize) {
    const OPEN: u32 = 7;
    const CLOSE: u32 = 8;
    const END: u32 = 9;
    let mut s = Session::new();
    let sys_user = s.fresh(40);
    let head = s.fresh(2); // `<|im_start|>` + a role token shared with the next message
    let ctx = s.fresh(ctx_len);
    let gen_prompt = s.fresh(3); // `<|im_start|>assistant\n`
    let mut p1 = sys_user.clone();
    p1.extend_from_slice(&head);
    p1.extend_from_slice(&ctx);
    p1.extend_from_slice(&gen_prompt);
    let think = s.fresh(6);
    let answer = s.fresh(12);
    let mut c1 = vec![OPEN];
    c1.extend_from_slice(&think);
    c1.push(CLOSE);
    c1.extend_from_slice(&answer);
    c1.push(END);
    s.call_on(0, p1, c1);
    // Call 2: the answer (without its think) and the tool result, THEN the context again.
    let mut p2 = sys_user;
    p2.extend_from_slice(&gen_prompt);
    p2.extend_from_slice(&answer);
    p2.push(END);
    p2.extend(s.fresh(10)); // the tool result
    p2.extend_from_slice(&head);
    p2.extend_from_slice(&ctx);
    p2.extend_from_slice(&gen_prompt);
    let c2 = s.fresh(5);
    let id = s.call_on(1, p2, c2);
    (s, id, 40)
}

#[test]
fn a_message_the_harness_moves_to_the_end_is_reordered_not_template_drift() {
    let (s, id, first_diff) = moved_context_session(REORDER_MIN_RUN + 30);
    let r = s.merge();
    assert_eq!(r.forks, vec![(id.clone(), ForkReason::Reordered)]);
    assert_eq!(r.samples[1].fork_reason.as_deref(), Some("reordered"));
    assert_eq!(
        r.drift.len(),
        1,
        "a reorder is a drift event: {:?}",
        r.drift
    );
    assert_eq!(r.drift[0].reason, ForkReason::Reordered);
    assert_eq!(r.drift[0].call_id, id);
    assert_eq!(r.drift[0].first_diff_at, first_diff);
    // Realigned, the session is one sample: the answer the prompt still holds stays
    // trained, the dropped think is counted as left untrained.
    let options = MergeOptions {
        on_drift: OnDrift::Realign,
        ..MergeOptions::default()
    };
    let r = merge_session_with("sess", Some("grp"), &s.calls, Some(0.5), FP, options);
    assert_eq!(r.samples.len(), 1, "{:?}", r.forks);
    let x = &r.samples[0];
    assert_eq!(x.call_ids, [s.calls[0].call_id.clone(), id.clone()]);
    assert_eq!(r.realigned.len(), 1);
    let lost = r.realigned[0].1;
    assert!(
        lost >= 8,
        "the think and its tags are no longer trained: {lost}"
    );
    let c1 = &s.calls[0].completion_ids;
    assert_eq!(
        x.trained_tokens(),
        c1.len() - lost + s.calls[1].completion_ids.len()
    );
    let answer = &c1[8..];
    let at = x
        .tokens
        .windows(answer.len())
        .position(|w| w == answer)
        .expect("the answer is in the realigned sample");
    assert!(
        x.loss_mask[at..at + answer.len()].iter().all(|&m| m == 1),
        "the answer stays trained"
    );
    assert_eq!(x.events[0].kind, EventKind::Drift);
    assert_eq!(x.events[0].reason, "reordered");
}

#[test]
fn a_rewritten_region_too_short_to_be_a_moved_message_stays_template_drift() {
    // The same shape with a context too short for a move: the block that reappears (the
    // 2 head tokens, the context, the 3 generation-prompt tokens) is one token short of
    // `REORDER_MIN_RUN`, so the region is only re-rendered text as far as the rule can tell.
    let (s, id, _) = moved_context_session(REORDER_MIN_RUN - 6);
    let r = s.merge();
    assert_eq!(r.forks, vec![(id, ForkReason::TemplateDrift)]);
    assert_eq!(r.drift[0].reason, ForkReason::TemplateDrift);
}

#[test]
fn an_unrelated_prompt_is_other_and_a_drift_event() {
    let mut s = Session::new();
    let p = s.fresh(20);
    let c = s.fresh(10);
    s.call_on(0, p, c);
    let p = s.fresh(40);
    let c = s.fresh(10);
    let id = s.call_on(1, p, c);
    let r = s.merge();
    assert_eq!(r.forks, vec![(id.clone(), ForkReason::Other)]);
    assert_eq!(r.drift.len(), 1);
    assert_eq!(r.drift[0].first_diff_at, 0);
    assert_eq!(r.drift[0].len, 30);
    assert_eq!(r.drift[0].reason, ForkReason::Other);
}

#[test]
fn a_slightly_shorter_rewrite_is_other_not_compaction() {
    let mut s = Session::new();
    let p = s.fresh(40);
    let c = s.fresh(10);
    s.call_on(0, p, c);
    // Keeps 30 tokens of the start, then 10 new ones: 40 of 50 is more than 3/4.
    let mut p = s.branches[0][..30].to_vec();
    p.extend(s.fresh(10));
    let c = s.fresh(3);
    let id = s.call_on(1, p, c);
    let r = s.merge();
    assert_eq!(r.forks, vec![(id, ForkReason::Other)]);
}

#[test]
fn text_only_calls_have_unknown_logprobs_and_full_masks() {
    let mut s = Session::new();
    s.with_logprobs = false;
    let p = s.fresh(5);
    let c = s.fresh(4);
    s.call_on(0, p, c);
    let g = s.fresh(2);
    let c = s.fresh(3);
    s.turn(0, &g, c);
    let r = s.merge();
    assert_eq!(r.samples.len(), 1);
    assert_eq!(
        r.samples[0].loss_mask,
        [0, 0, 0, 0, 0, 1, 1, 1, 1, 0, 0, 1, 1, 1]
    );
    assert!(r.samples[0].logprobs.iter().all(Option::is_none));
}

#[test]
fn calls_are_taken_in_seq_order() {
    let mut s = Session::new();
    let p = s.fresh(5);
    let c = s.fresh(4);
    s.call_on(0, p, c);
    let g = s.fresh(2);
    let c = s.fresh(3);
    s.turn(0, &g, c);
    let mut calls = s.calls.clone();
    calls.reverse();
    let r = merge_session("sess", Some("grp"), &calls, Some(0.5), FP);
    check_invariants(&calls, &r);
    assert_eq!(r.samples.len(), 1);
    assert_eq!(r.samples[0].call_ids, ["call-1", "call-2"]);
}

/// `--on-drift realign`: a drifted call continues its sample, whose tokens become the
/// prompt's own; the sampled tokens the prompt still holds keep mask 1 and their logprobs,
/// the rewritten ones are mask 0 and counted.
#[test]
fn realign_continues_the_drifted_sample_with_the_prompts_own_tokens() {
    let mut s = Session::new();
    let p = s.fresh(20);
    let c = s.fresh(10);
    let first = s.call_on(0, p, c);
    // The client re-rendered 3 tokens inside call 1's completion as 2 others.
    let mut prompt = s.branches[0].clone();
    let rewritten = s.fresh(2);
    prompt.splice(25..28, rewritten);
    prompt.extend(s.fresh(5));
    let c2 = s.fresh(6);
    let second = s.call(prompt.clone(), c2.clone());
    let options = MergeOptions {
        on_drift: OnDrift::Realign,
        ..MergeOptions::default()
    };
    let r = merge_session_with("sess", Some("grp"), &s.calls, Some(0.5), FP, options);
    assert_eq!(r.samples.len(), 1);
    assert!(r.forks.is_empty());
    assert_eq!(r.realigned, vec![(second.clone(), 3)]);
    assert_eq!(r.drift.len(), 1, "still reported as drift");
    assert_eq!(r.drift[0].reason, ForkReason::TemplateDrift);
    let x = &r.samples[0];
    assert_eq!(
        x.events,
        [SampleEvent {
            kind: EventKind::Drift,
            at: 25,
            len: 3,
            reason: "template_drift".into(),
            call_id: second.clone(),
            other_sample: None,
        }],
        "the realigned drift stands where the prompt first differs"
    );
    assert_eq!(x.call_ids, [first.clone(), second]);
    let mut want = prompt.clone();
    want.extend(&c2);
    assert_eq!(x.tokens, want);
    let mut mask = vec![0u8; 20];
    mask.extend([1; 5]);
    mask.extend([0; 2]);
    mask.extend([1; 2]);
    mask.extend([0; 5]);
    mask.extend([1; 6]);
    assert_eq!(x.loss_mask, mask);
    let lp1 = s.calls[0].completion_logprobs.clone().unwrap();
    assert_eq!(&x.logprobs[20..25], &lp1[..5]);
    assert_eq!(&x.logprobs[27..29], &lp1[8..10]);
    assert!(x.logprobs[25..27].iter().all(Option::is_none));
    assert_eq!(x.trained_tokens(), 10 - 3 + 6);
    let sum = Summary::of([&r]);
    assert_eq!((sum.realigned, sum.realigned_untrained_tokens), (1, 3));
    assert!(
        sum.to_string()
            .contains("realigned:      1 calls (3 sampled tokens left untrained)")
    );
    // The default forks.
    let r = s.merge();
    assert_eq!(r.samples.len(), 2);
    assert!(r.realigned.is_empty());
}

#[test]
fn summary_counts_and_prints() {
    let mut s = Session::new();
    let p = s.fresh(20);
    let c = s.fresh(10);
    s.call_on(0, p.clone(), c);
    let c = s.fresh(10);
    s.call_on(1, p, c); // parallel
    let p = s.fresh(50);
    let c = s.fresh(5);
    s.call_on(2, p, c); // other
    let r = s.merge();
    let empty = merge_session("empty", None, &[], None, FP);
    assert!(empty.samples.is_empty());
    let sum = Summary::of([&r, &empty]);
    assert_eq!(sum.sessions, 2);
    assert_eq!(sum.samples, 3);
    assert_eq!(sum.forks(), 2);
    assert_eq!(sum.forks_by_reason["parallel_branch"], 1);
    assert_eq!(sum.forks_by_reason["other"], 1);
    assert_eq!(sum.forks_by_reason["compaction"], 0);
    assert_eq!(sum.trained_tokens, 25);
    assert_eq!(sum.total_tokens, 30 + 30 + 55);
    assert_eq!(sum.drift_events, 1);
    let text = sum.to_string();
    assert!(
        text.contains(
            "forks:          2 (compaction 0, template_drift 0, reordered 0, parallel_branch 1, new_root 0, rewritten 0, other 1)"
        ),
        "{text}"
    );
    assert!(text.contains("trained tokens: 25 of 115 (21.7%)"), "{text}");
    // Calls of unknown shape are one thread: the session's main one.
    assert_eq!((sum.main_threads, sum.side_threads), (1, 0));
    assert!(
        text.contains("threads:        1 main, 0 side; side threads are left out of training unless a reward was posted for one of their calls (--side-threads own)"),
        "{text}"
    );
    for r in ForkReason::ALL {
        assert_eq!(ForkReason::parse(r.as_str()), Some(r));
    }
}

// -------------------------------------------------------------------------------------
// Parquet

fn some_samples() -> Vec<Sample> {
    let ops = vec![
        Op::Turn {
            b: 0,
            gap: vec![1, 2],
            completion: vec![3, 4, 5],
        },
        Op::Resample {
            b: 0,
            completion: vec![6, 7],
        },
        Op::Turn {
            b: 1,
            gap: vec![8],
            completion: vec![9],
        },
        Op::Fresh {
            prompt: vec![100, 101],
            completion: vec![],
        },
    ];
    let s = play((vec![10, 11, 12], vec![13, u32::MAX]), &ops, 0, true);
    let mut samples = s.merge().samples;
    let t = play((vec![1], vec![2]), &[], 0, false);
    let mut other = merge_session("other", None, &t.calls, None, ("", "")).samples;
    other[0].weight_versions.clear();
    other[0].token_weight_versions.fill(None);
    samples.append(&mut other);
    samples
}

#[test]
fn samples_round_trip_through_parquet() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("samples.parquet");
    let samples = some_samples();
    write_samples_parquet(&samples, &path).unwrap();
    assert_eq!(read_samples_parquet(&path).unwrap(), samples);
    // Nothing else left behind; rewriting replaces the file.
    write_samples_parquet(&samples[..1], &path).unwrap();
    assert_eq!(read_samples_parquet(&path).unwrap(), samples[..1]);
    write_samples_parquet(&[], &path).unwrap();
    assert!(read_samples_parquet(&path).unwrap().is_empty());
    let names: Vec<_> = std::fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(names, ["samples.parquet"]);
}

fn test_env_python() -> PathBuf {
    let root = match std::env::var_os("GRAFT_TEST_ENV").filter(|v| !v.is_empty()) {
        Some(p) => PathBuf::from(p),
        None => PathBuf::from(env!("CARGO_MANIFEST_DIR"))
            .join("..")
            .join(".graft-test-env"),
    };
    let python = root.join("py").join("bin").join("python");
    assert!(
        python.exists(),
        "the test environment's Python ({}) is missing.\n\
         Run `bash scripts/setup-test-env.sh` from the repository root \
         (or point GRAFT_TEST_ENV at an environment it made).",
        python.display()
    );
    python
}

const READ_BACK: &str = r#"
import json, sys
import pyarrow.parquet as pq
import duckdb
t = pq.read_table(sys.argv[1])
types = {f.name: str(f.type) for f in t.schema}
rows = t.to_pylist()
con = duckdb.connect()
dk = con.execute(
    "select sample_id, len(tokens), list_sum(loss_mask), call_ids, fork_reason, reward "
    "from read_parquet(?) order by sample_id", [sys.argv[1]]).fetchall()
print(json.dumps({"types": types, "rows": rows, "duckdb": [list(r) for r in dk]}))
"#;

#[test]
fn pyarrow_and_duckdb_read_samples_as_they_are() {
    let python = test_env_python();
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("samples.parquet");
    let samples = some_samples();
    write_samples_parquet(&samples, &path).unwrap();
    let out = Command::new(&python)
        .arg("-c")
        .arg(READ_BACK)
        .arg(&path)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "python failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let types = &v["types"];
    let want = [
        ("sample_id", "string"),
        ("group_id", "string"),
        ("reward", "double"),
        ("fork_reason", "string"),
        ("schema_version", "uint32"),
    ];
    for (name, ty) in want {
        assert_eq!(types[name], ty, "{name}: {types}");
    }
    for (name, item) in [
        ("tokens", "uint32"),
        ("loss_mask", "uint8"),
        ("logprobs", "float"),
        ("weight_versions", "string"),
        ("call_ids", "string"),
        ("token_weight_versions", "string"),
    ] {
        let t = types[name].as_str().unwrap();
        assert!(
            t.starts_with("list<") && t.ends_with(&format!(": {item}>")),
            "{name}: {t}"
        );
    }
    let rows = v["rows"].as_array().unwrap();
    assert_eq!(rows.len(), samples.len());
    for (row, s) in rows.iter().zip(&samples) {
        let u32s = |k: &str| -> Vec<u64> {
            row[k]
                .as_array()
                .unwrap()
                .iter()
                .map(|x| x.as_u64().unwrap())
                .collect()
        };
        let strs = |k: &str| -> Vec<String> {
            row[k]
                .as_array()
                .unwrap()
                .iter()
                .map(|x| x.as_str().unwrap().to_owned())
                .collect()
        };
        assert_eq!(row["sample_id"], s.sample_id.as_str());
        assert_eq!(row["session_id"], s.session_id.as_str());
        assert_eq!(row["group_id"].as_str(), s.group_id.as_deref());
        assert_eq!(
            u32s("tokens"),
            s.tokens.iter().map(|&t| u64::from(t)).collect::<Vec<_>>()
        );
        assert_eq!(
            u32s("loss_mask"),
            s.loss_mask
                .iter()
                .map(|&t| u64::from(t))
                .collect::<Vec<_>>()
        );
        let lps: Vec<Option<f32>> = row["logprobs"]
            .as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_f64().map(|f| f as f32))
            .collect();
        assert_eq!(lps, s.logprobs);
        let versions: Vec<Option<String>> = row["token_weight_versions"]
            .as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_str().map(str::to_owned))
            .collect();
        let want: Vec<Option<String>> = (0..s.tokens.len())
            .map(|i| s.token_weight_version(i).map(str::to_owned))
            .collect();
        assert_eq!(versions, want);
        assert_eq!(row["reward"].as_f64(), s.reward);
        assert_eq!(strs("weight_versions"), s.weight_versions);
        assert_eq!(strs("call_ids"), s.call_ids);
        assert_eq!(row["fork_reason"].as_str(), s.fork_reason.as_deref());
        assert_eq!(
            row["tokenizer_fingerprint"],
            s.tokenizer_fingerprint.as_str()
        );
        assert_eq!(row["template_fingerprint"], s.template_fingerprint.as_str());
        assert_eq!(row["schema_version"], s.schema_version);
    }
    let mut sorted = samples.clone();
    sorted.sort_by(|a, b| a.sample_id.cmp(&b.sample_id));
    let dk = v["duckdb"].as_array().unwrap();
    assert_eq!(dk.len(), sorted.len());
    for (d, s) in dk.iter().zip(&sorted) {
        assert_eq!(d[0], s.sample_id.as_str());
        assert_eq!(d[1].as_u64(), Some(s.tokens.len() as u64));
        assert_eq!(d[2].as_u64(), Some(s.trained_tokens() as u64));
        assert_eq!(d[3].as_array().unwrap().len(), s.call_ids.len());
        assert_eq!(d[4].as_str(), s.fork_reason.as_deref());
        assert_eq!(d[5].as_f64(), s.reward);
    }
}

//! Branch sessions in training. A branch session (the gateway's `branch_of`) answered its
//! first calls from its parent's records: those tokens are the parent's samples, not the
//! branch's, so in the branch they are context. [`mask_replayed`] makes every token that a
//! replayed call sampled mask 0 (logprob, weight version and call unknown, as on any
//! mask-0 token) and names the branch on each of the session's samples (`branch_of`,
//! `branch_at`). The parent keeps training them.

use std::collections::HashSet;

use graft_recorder::CallRecord;

use crate::merge::MergeResult;
use crate::sample::Sample;

/// What the records of one session say about it being a branch.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct BranchInfo {
    /// The parent session.
    pub of: String,
    /// The branch point (the parent's calls replayed at most).
    pub at_call: u64,
    /// The call ids of the session's calls that were replayed.
    pub replayed: HashSet<String>,
}

impl BranchInfo {
    /// Adds one record of the session; `info` starts as `None`.
    pub fn add(info: &mut Option<BranchInfo>, rec: &CallRecord) {
        let Some(r) = &rec.replay else {
            return;
        };
        let b = info.get_or_insert_with(|| BranchInfo {
            of: r.branch_of.clone(),
            at_call: r.at_call,
            replayed: HashSet::new(),
        });
        if r.replayed() {
            b.replayed.insert(rec.call_id.clone());
        }
    }
}

/// Masks the replayed calls' tokens in a branch session's samples and names the branch on
/// each of them.
pub fn mask_replayed(result: &mut MergeResult, branch: &BranchInfo) {
    for s in result
        .samples
        .iter_mut()
        .chain(result.side_left_out.iter_mut())
    {
        mask_sample(s, branch);
    }
}

fn mask_sample(s: &mut Sample, branch: &BranchInfo) {
    s.branch_of = Some(branch.of.clone());
    s.branch_at = u32::try_from(branch.at_call).ok();
    let replayed: Vec<bool> = s
        .call_ids
        .iter()
        .map(|c| branch.replayed.contains(c))
        .collect();
    for i in 0..s.tokens.len() {
        let Some(c) = s.token_calls.get(i).copied().flatten() else {
            continue;
        };
        if !replayed.get(c as usize).copied().unwrap_or(false) {
            continue;
        }
        if let Some(m) = s.loss_mask.get_mut(i) {
            *m = 0;
        }
        if let Some(l) = s.logprobs.get_mut(i) {
            *l = None;
        }
        if let Some(v) = s.token_weight_versions.get_mut(i) {
            *v = None;
        }
        s.token_calls[i] = None;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn replayed_calls_tokens_become_context_and_live_ones_keep_their_mask() {
        let mut r = MergeResult {
            samples: vec![Sample {
                tokens: vec![1, 2, 3, 4, 5, 6],
                loss_mask: vec![0, 1, 1, 0, 1, 1],
                logprobs: vec![None, Some(-0.1), Some(-0.2), None, Some(-0.3), Some(-0.4)],
                token_weight_versions: vec![None, Some(0), Some(0), None, Some(0), Some(0)],
                call_ids: vec!["replayed".into(), "live".into()],
                token_calls: vec![None, Some(0), Some(0), None, Some(1), Some(1)],
                ..Sample::default()
            }],
            ..MergeResult::default()
        };
        let b = BranchInfo {
            of: "parent".into(),
            at_call: 1,
            replayed: ["replayed".to_owned()].into(),
        };
        mask_replayed(&mut r, &b);
        let s = &r.samples[0];
        assert_eq!(s.loss_mask, [0, 0, 0, 0, 1, 1]);
        assert_eq!(s.logprobs, [None, None, None, None, Some(-0.3), Some(-0.4)]);
        assert_eq!(s.token_calls, [None, None, None, None, Some(1), Some(1)]);
        assert_eq!(
            s.token_weight_versions,
            [None, None, None, None, Some(0), Some(0)]
        );
        assert_eq!(s.branch_of.as_deref(), Some("parent"));
        assert_eq!(s.branch_at, Some(1));
    }
}

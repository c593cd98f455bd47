//! Which recorded calls the client actually received. A turn the client retried (the
//! gateway links its attempts: `attempt`, `retry_of`) is trained on once: on its last
//! attempt that was answered (`outcome` ok). Every other attempt of the turn is left out,
//! and so is any call whose client went away before the answer was complete
//! (`client_disconnected`): nobody continued from it.

use std::collections::{HashMap, HashSet};

use graft_recorder::CallRecord;

/// Why a call is left out.
pub const SUPERSEDED: &str = "superseded by a retry the client received";
/// Why a call is left out.
pub const ABANDONED: &str = "abandoned by the client (client_disconnected)";

/// The call ids to leave out, with the reason of each.
pub fn left_out(records: &[CallRecord]) -> HashMap<String, &'static str> {
    // The turn of each call: its first attempt's call id.
    let turn = |r: &CallRecord| r.retry_of.clone().unwrap_or_else(|| r.call_id.clone());
    // The kept attempt of each turn: the answered one with the highest attempt number
    // (then the latest in record order).
    let mut kept: HashMap<String, (u32, u64, String)> = HashMap::new();
    let mut retried: HashSet<String> = HashSet::new();
    for r in records {
        if r.retry_of.is_some() {
            retried.insert(turn(r));
        }
    }
    for r in records.iter().filter(|r| r.is_ok()) {
        let key = (r.attempt.unwrap_or(1), r.seq, r.call_id.clone());
        let e = kept.entry(turn(r)).or_insert_with(|| key.clone());
        if (key.0, key.1) > (e.0, e.1) {
            *e = key;
        }
    }
    let mut out = HashMap::new();
    for r in records {
        if r.outcome == graft_recorder::CallOutcome::ClientDisconnected.as_str() {
            out.insert(r.call_id.clone(), ABANDONED);
            continue;
        }
        let t = turn(r);
        if !retried.contains(&t) {
            continue;
        }
        match kept.get(&t) {
            Some((_, _, id)) if *id == r.call_id => {}
            _ => {
                out.insert(r.call_id.clone(), SUPERSEDED);
            }
        }
    }
    out
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn rec(id: &str, seq: u64, outcome: &str, attempt: u32, retry_of: Option<&str>) -> CallRecord {
        CallRecord {
            call_id: id.into(),
            seq,
            outcome: outcome.into(),
            attempt: Some(attempt),
            retry_of: retry_of.map(str::to_string),
            ..CallRecord::default()
        }
    }

    #[test]
    fn only_the_answered_last_attempt_of_a_retried_turn_is_kept() {
        let recs = vec![
            rec("a1", 1, "ok", 1, None),
            // Turn b: the first attempt abandoned, the second finished as the client gave
            // up (recorded ok), the third received.
            rec("b1", 2, "client_disconnected", 1, None),
            rec("b2", 3, "ok", 2, Some("b1")),
            rec("b3", 4, "ok", 3, Some("b1")),
            rec("c1", 5, "upstream_error", 1, None),
            rec("c2", 6, "ok", 2, Some("c1")),
        ];
        let out = left_out(&recs);
        assert_eq!(out.get("b1"), Some(&ABANDONED));
        assert_eq!(out.get("b2"), Some(&SUPERSEDED));
        assert_eq!(out.get("c1"), Some(&SUPERSEDED));
        for kept in ["a1", "b3", "c2"] {
            assert!(!out.contains_key(kept), "{kept}: {out:?}");
        }
        // Older records (no attempt fields) are all kept unless abandoned.
        let old = vec![CallRecord {
            call_id: "x".into(),
            outcome: "ok".into(),
            ..CallRecord::default()
        }];
        assert!(left_out(&old).is_empty());
    }
}

//! Branch sessions: a session made with `branch_of: {session, at_call, policy}` continues a
//! recorded rollout from its `at_call`-th answered call. The harness is re-run unmodified;
//! its first `at_call` calls are answered from the parent's records (a source of backend
//! events beside the live wires: `backend/replay.rs`), so it is back where the parent was,
//! and from then on every call is sampled live.
//!
//! Each call that could be replayed is first checked against the parent's call at the same
//! position: in exact mode by its prompt ids (the branch call rendered and tokenized as any
//! live call), in passthrough by its normalized messages and tools. What happens when they
//! differ is the branch's [`ReplayPolicy`]:
//!
//! - `strict`: the first differing call goes live, and so does every call after it;
//! - `tolerant` (the default): the call is still replayed when its conversation differs from
//!   the parent's only in [`volatile`] parts (timestamps, UUIDs, hex ids, long numbers, in
//!   any message); a call whose turns differ otherwise goes live.
//!
//! Every call of a branch records a [`Replay`]: replayed (from which parent call) or live
//! (why), and where and what differed. Replayed calls are never trained in the branch
//! (`graft reconstruct` masks their tokens), so a tolerated difference cannot put
//! off-policy tokens into training.

use std::sync::{Arc, Mutex};

use graft_recorder::{CallRecord, Difference, Replay};
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};

use crate::backend::{Leg, UpBody, replay};
use crate::dialect::{Conversation, Dialect, DialectKind, dialect};
use crate::error::GatewayError;

/// `branch_of` of `POST /graft/sessions`.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BranchOf {
    /// The parent session.
    pub session: String,
    /// How many of the parent's answered calls are replayed.
    pub at_call: u64,
    #[serde(default)]
    pub policy: ReplayPolicy,
}

/// What a branch does with a call whose request differs from its parent's.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ReplayPolicy {
    /// Replay through differences in volatile parts only ([`volatile`]).
    #[default]
    Tolerant,
    /// The first difference of any kind goes live.
    Strict,
}

impl ReplayPolicy {
    pub fn label(self) -> &'static str {
        match self {
            ReplayPolicy::Tolerant => "tolerant",
            ReplayPolicy::Strict => "strict",
        }
    }
}

/// A branch session's parent calls and how far its replay has come.
pub struct Branch {
    pub of: String,
    pub at_call: u64,
    pub policy: ReplayPolicy,
    /// The parent's first `at_call` answered calls, in seq order.
    parent: Vec<Arc<CallRecord>>,
    progress: Mutex<Progress>,
}

#[derive(Default)]
struct Progress {
    /// Calls of the branch so far (positions handed out).
    calls: u64,
    replayed: u64,
    /// Where the branch went live (its position) and why.
    live: Option<(u64, String)>,
    /// Differences answered through (tolerant), in all.
    tolerated: u64,
}

/// The wires of exact-mode records.
fn is_exact(rec: &CallRecord) -> bool {
    matches!(
        rec.upstream_dialect.as_deref(),
        Some(graft_recorder::wire::SGLANG_GENERATE | graft_recorder::wire::VLLM_COMPLETIONS)
    )
}

/// Whether a record is one of a session's answered model calls (what a branch counts).
fn answered(rec: &CallRecord) -> bool {
    rec.is_ok() && rec.dialect != "models"
}

impl Branch {
    /// The branch of `req.session` from its records (`records`: that session's, in seq
    /// order); refused, naming the field, when the branch point is past the parent's
    /// answered calls or the parent was recorded in another mode than this gateway's.
    pub fn open(
        req: BranchOf,
        records: Vec<CallRecord>,
        exact: bool,
    ) -> Result<Self, GatewayError> {
        let parent = req.session.as_str();
        if req.at_call == 0 {
            return Err(GatewayError::field(
                "branch_of.at_call",
                "'branch_of.at_call' must be at least 1 (a branch at call 0 replays nothing: create a session without 'branch_of')",
            ));
        }
        let answered: Vec<CallRecord> = records.into_iter().filter(answered).collect();
        if answered.is_empty() {
            return Err(GatewayError::field(
                "branch_of.session",
                format!("session '{parent}' has no answered calls to branch from"),
            ));
        }
        if (answered.len() as u64) < req.at_call {
            return Err(GatewayError::field(
                "branch_of.at_call",
                format!(
                    "session '{parent}' has {} answered calls; 'branch_of.at_call' is {}: branch at 1..={}",
                    answered.len(),
                    req.at_call,
                    answered.len()
                ),
            ));
        }
        let mut parent_calls: Vec<Arc<CallRecord>> = answered
            .into_iter()
            .take(req.at_call as usize)
            .map(Arc::new)
            .collect();
        if let Some(other) = parent_calls.iter().find(|r| is_exact(r) != exact) {
            let (was, is) = if exact {
                ("passthrough", "exact mode")
            } else {
                ("exact mode", "passthrough")
            };
            return Err(GatewayError::field(
                "branch_of.session",
                format!(
                    "session '{parent}' was recorded in {was} (call {} of it), and this gateway runs {is}: a branch is replayed in its parent's mode",
                    other.call_id
                ),
            ));
        }
        parent_calls.shrink_to_fit();
        Ok(Branch {
            of: req.session,
            at_call: req.at_call,
            policy: req.policy,
            parent: parent_calls,
            progress: Mutex::new(Progress::default()),
        })
    }

    fn replay(&self, position: u64) -> Replay {
        Replay {
            branch_of: self.of.clone(),
            at_call: self.at_call,
            policy: self.policy.label().to_owned(),
            position,
            ..Replay::default()
        }
    }

    /// Decides how the branch's next call is answered. `request` is its body in
    /// `dialect`; `prompt_ids` its rendered prompt (exact mode). Returns the call's record
    /// and, when it is replayed, the parent's call to answer it from.
    pub(crate) fn decide(
        &self,
        request: &Value,
        dialect: &'static dyn Dialect,
        prompt_ids: Option<&[u32]>,
        replayable: Result<(), String>,
    ) -> (Replay, Option<Arc<CallRecord>>) {
        let Ok(mut p) = self.progress.lock() else {
            let mut r = self.replay(0);
            r.live = Some("the branch's state is poisoned: answered live".into());
            return (r, None);
        };
        p.calls += 1;
        let position = p.calls;
        let mut r = self.replay(position);
        if let Some((at, _)) = &p.live {
            r.live = Some(format!("the branch went live at its call {at}"));
            return (r, None);
        }
        let Some(parent) = self.parent.get(position as usize - 1).cloned() else {
            let why = format!(
                "past the branch point (call {} of the parent)",
                self.at_call
            );
            p.live = Some((position, why.clone()));
            r.live = Some(why);
            return (r, None);
        };
        let go_live = |p: &mut Progress, mut r: Replay, why: String| {
            p.live = Some((position, why.clone()));
            r.live = Some(why);
            (r, None)
        };
        if let Err(why) = replayable {
            return go_live(&mut p, r, why);
        }
        let (diffs, turns_differ) = compare(&parent, request, dialect, prompt_ids);
        r.differences = diffs;
        if r.differences.is_empty() {
            // Matched.
        } else if self.policy == ReplayPolicy::Strict {
            let why = format!(
                "strict: the request differs from the parent's call {position} ({})",
                r.differences[0].at
            );
            return go_live(&mut p, r, why);
        } else if turns_differ {
            let at = r
                .differences
                .iter()
                .find(|d| d.kind == "turn")
                .map_or("the conversation", |d| d.at.as_str())
                .to_owned();
            let why = format!(
                "tolerant: a turn differs from the parent's call {position} ({at}), not only volatile parts"
            );
            return go_live(&mut p, r, why);
        } else {
            p.tolerated += 1;
        }
        p.replayed += 1;
        r.replayed_from = Some(parent.call_id.clone());
        r.parent_seq = Some(parent.seq);
        (r, Some(parent))
    }

    /// A call `decide` chose to replay could not be (its record has no answer in the
    /// leg's wire): it goes live, and so does the branch.
    fn unreplay(&self, r: &mut Replay, why: String) {
        if let Ok(mut p) = self.progress.lock() {
            p.replayed = p.replayed.saturating_sub(1);
            p.live = Some((r.position, why.clone()));
        }
        r.replayed_from = None;
        r.parent_seq = None;
        r.live = Some(why);
    }

    /// The branch's state for `GET /graft/sessions/{id}`.
    pub fn view(&self) -> Value {
        let p = self.progress.lock().ok();
        let (calls, replayed, tolerated, live) = p
            .as_deref()
            .map(|p| (p.calls, p.replayed, p.tolerated, p.live.clone()))
            .unwrap_or_default();
        json!({
            "of": self.of,
            "at_call": self.at_call,
            "policy": self.policy.label(),
            "calls": calls,
            "replayed": replayed,
            "tolerated": tolerated,
            "live": live.is_some(),
            "live_at": live.as_ref().map(|l| l.0),
            "live_reason": live.map(|l| l.1),
        })
    }
}

/// How a branch session's call is answered: its record's [`Replay`], and the parent's
/// answer in the leg's wire when it is replayed (`None`: the leg sends it live).
pub(crate) fn answer(
    b: &Branch,
    leg: &mut Leg,
    request: &Value,
    dialect: &'static dyn Dialect,
    conv: Option<&Conversation>,
    stream: bool,
) -> (Option<Replay>, Option<http::Response<UpBody>>) {
    let prompt_ids = match leg {
        Leg::Generate(g) => Some(g.prompt_ids().to_vec()),
        _ => None,
    };
    let replayable = replay::replayable(leg, dialect);
    let (mut r, parent) = b.decide(request, dialect, prompt_ids.as_deref(), replayable);
    let Some(parent) = parent else {
        tracing::info!(branch_of = %b.of, position = r.position, live = r.live.as_deref().unwrap_or(""), "branch call goes live");
        return (Some(r), None);
    };
    let parsed;
    let conv = match conv {
        Some(c) => Some(c),
        None => {
            parsed = dialect.parse(request).ok();
            parsed.as_ref()
        }
    };
    match replay::response(leg, &parent, conv, stream) {
        Ok(resp) => {
            tracing::info!(branch_of = %b.of, position = r.position, parent_call = %parent.call_id, differences = r.differences.len(), "branch call replayed from its parent's record");
            (Some(r), Some(resp))
        }
        Err(why) => {
            b.unreplay(
                &mut r,
                format!("the parent's call cannot be replayed: {why}"),
            );
            (Some(r), None)
        }
    }
}

/// Where a branch call's request differs from its parent's call: the differences, and
/// whether any of them is more than volatile (a turn differs).
fn compare(
    parent: &CallRecord,
    request: &Value,
    dialect: &'static dyn Dialect,
    prompt_ids: Option<&[u32]>,
) -> (Vec<Difference>, bool) {
    let mut out = Vec::new();
    if let Some(ids) = prompt_ids {
        let theirs = parent.prompt_token_ids.as_deref().unwrap_or(&[]);
        if ids == theirs {
            return (out, false);
        }
        let at = ids
            .iter()
            .zip(theirs)
            .position(|(a, b)| a != b)
            .unwrap_or(ids.len().min(theirs.len()));
        out.push(Difference {
            at: format!("prompt_token_ids[{at}]"),
            kind: "tokens".into(),
            parent: format!("{} ids, from {at}: {:?}", theirs.len(), window(theirs, at)),
            branch: format!("{} ids, from {at}: {:?}", ids.len(), window(ids, at)),
        });
    }
    let theirs = match kind_of(&parent.dialect).map(|k| dialect_of(k).parse(&parent.request)) {
        Some(Ok(c)) => c,
        _ => {
            out.push(turn(
                "request",
                &format!("a {} request this gateway cannot read", parent.dialect),
                "",
            ));
            return (out, true);
        }
    };
    let ours = match dialect.parse(request) {
        Ok(c) => c,
        Err(e) => {
            out.push(turn("request", "", &e.to_string()));
            return (out, true);
        }
    };
    let mut turns_differ = false;
    let json = |v: Result<Value, serde_json::Error>| v.unwrap_or(Value::Null);
    diff(
        "messages",
        &json(serde_json::to_value(&theirs.messages)),
        &json(serde_json::to_value(&ours.messages)),
        &mut out,
        &mut turns_differ,
    );
    diff(
        "tools",
        &json(serde_json::to_value(&theirs.tools)),
        &json(serde_json::to_value(&ours.tools)),
        &mut out,
        &mut turns_differ,
    );
    (out, turns_differ)
}

fn dialect_of(k: DialectKind) -> &'static dyn Dialect {
    dialect(k)
}

fn kind_of(label: &str) -> Option<DialectKind> {
    [
        DialectKind::ChatCompletions,
        DialectKind::Completions,
        DialectKind::Responses,
        DialectKind::AnthropicMessages,
    ]
    .into_iter()
    .find(|k| k.label() == label)
}

fn window(ids: &[u32], at: usize) -> &[u32] {
    &ids[at.min(ids.len())..(at + 8).min(ids.len())]
}

fn turn(at: &str, parent: &str, branch: &str) -> Difference {
    Difference {
        at: at.to_owned(),
        kind: "turn".into(),
        parent: excerpt(parent, 0),
        branch: excerpt(branch, 0),
    }
}

/// Up to 80 characters of `s` from about `from` (a char index).
fn excerpt(s: &str, from: usize) -> String {
    let start = from.saturating_sub(20);
    let out: String = s.chars().skip(start).take(80).collect();
    if start > 0 { format!("…{out}") } else { out }
}

/// Records every place `a` (the parent's) and `b` (the branch's) differ; `turns` is set when
/// one of them is more than volatile.
fn diff(at: &str, a: &Value, b: &Value, out: &mut Vec<Difference>, turns: &mut bool) {
    if a == b {
        return;
    }
    match (a, b) {
        (Value::Object(x), Value::Object(y)) => {
            for (k, va) in x {
                let path = format!("{at}.{k}");
                match y.get(k) {
                    Some(vb) => diff(&path, va, vb, out, turns),
                    None => {
                        *turns = true;
                        out.push(turn(&path, &va.to_string(), "(absent)"));
                    }
                }
            }
            for (k, vb) in y {
                if !x.contains_key(k) {
                    *turns = true;
                    out.push(turn(&format!("{at}.{k}"), "(absent)", &vb.to_string()));
                }
            }
        }
        (Value::Array(x), Value::Array(y)) if x.len() == y.len() => {
            for (i, (va, vb)) in x.iter().zip(y).enumerate() {
                diff(&format!("{at}[{i}]"), va, vb, out, turns);
            }
        }
        (Value::Array(x), Value::Array(y)) => {
            *turns = true;
            out.push(turn(
                at,
                &format!("{} items", x.len()),
                &format!("{} items", y.len()),
            ));
        }
        (Value::String(x), Value::String(y)) => {
            let first = x
                .chars()
                .zip(y.chars())
                .position(|(p, q)| p != q)
                .unwrap_or(x.chars().count().min(y.chars().count()));
            let (nx, rx) = volatile::normalize(x);
            let (ny, ry) = volatile::normalize(y);
            let kind = if nx == ny {
                let mut rules: Vec<&str> = rx.into_iter().chain(ry).collect();
                rules.sort_unstable();
                rules.dedup();
                rules.join("+")
            } else {
                *turns = true;
                "turn".to_owned()
            };
            out.push(Difference {
                at: at.to_owned(),
                kind,
                parent: excerpt(x, first),
                branch: excerpt(y, first),
            });
        }
        _ => {
            *turns = true;
            out.push(turn(at, &a.to_string(), &b.to_string()));
        }
    }
}

/// What counts as volatile: the parts of a prompt a harness makes anew on every run
/// without the conversation being another. Narrow on purpose: each rule names one
/// shape, and anything else that differs is a different turn.
///
/// | rule | matches | e.g. |
/// |---|---|---|
/// | `uuid` | an RFC 4122 UUID (any version, either case) | `0190a4c2-7b1e-7c3a-9f00-1234567890ab` |
/// | `timestamp` | an ISO 8601 date with an optional time and zone; a clock time `HH:MM[:SS[.f]]`; an English date `Dec 7, 2026` / `7 December 2026` | `2026-12-07T12:58:19Z`, `12:58:19`, `Mon Dec 7` |
/// | `hex_id` | a run of 8 or more hex digits holding both a digit and a letter (commit SHAs, container ids, hashes) | `3f9c2a7e1b`, `call_0123456789ab_0`'s middle |
/// | `long_number` | a run of 6 or more digits (epoch times, pids of long-running hosts, random seeds) | `1733572699` |
///
/// Not volatile: short numbers (`3 files` vs `4 files`), words, paths other than those
/// parts, the order or number of messages, roles, tool calls and the tools declared.
pub mod volatile {
    use std::sync::LazyLock;

    use regex::Regex;

    /// One volatile shape and the placeholder it is normalized to.
    pub struct Rule {
        pub name: &'static str,
        placeholder: &'static str,
        pattern: &'static str,
    }

    pub const RULES: [Rule; 4] = [
        Rule {
            name: "uuid",
            placeholder: "<uuid>",
            pattern: r"(?i)\b[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}\b",
        },
        Rule {
            name: "timestamp",
            placeholder: "<timestamp>",
            pattern: r"(?x)
                \d{4}-\d{2}-\d{2}(?:[T\ ]\d{2}:\d{2}(?::\d{2}(?:[.,]\d+)?)?(?:\ ?Z|\ ?[+-]\d{2}:?\d{2}|\ ?UTC)?)?
              | \b\d{1,2}:\d{2}(?::\d{2}(?:\.\d+)?)?\b
              | \b(?:Monday|Tuesday|Wednesday|Thursday|Friday|Saturday|Sunday|Mon|Tue|Wed|Thu|Fri|Sat|Sun)\b,?\ +
              | \b(?:January|February|March|April|May|June|July|August|September|October|November|December|Jan|Feb|Mar|Apr|Jun|Jul|Aug|Sept|Sep|Oct|Nov|Dec)\b\.?\ +\d{1,2}(?:st|nd|rd|th)?\b,?(?:\ +\d{4}\b)?
              | \b\d{1,2}(?:st|nd|rd|th)?\ +(?:January|February|March|April|May|June|July|August|September|October|November|December|Jan|Feb|Mar|Apr|Jun|Jul|Aug|Sept|Sep|Oct|Nov|Dec)\b\.?,?(?:\ +\d{4}\b)?",
        },
        Rule {
            name: "hex_id",
            placeholder: "<hex>",
            // Word parts split at `_` and `-` too (`call_0123456789ab_0`); the run must hold
            // a digit and a letter (checked below): all-digit runs are numbers.
            pattern: r"[0-9A-Fa-f]{8,}",
        },
        Rule {
            name: "long_number",
            placeholder: "<n>",
            pattern: r"\d{6,}",
        },
    ];

    static COMPILED: LazyLock<Vec<Option<Regex>>> =
        LazyLock::new(|| RULES.iter().map(|r| Regex::new(r.pattern).ok()).collect());

    /// Whether a match of the `hex_id` rule stands alone (not inside a longer word of
    /// letters or digits) and holds both a digit and a hex letter.
    fn hex_id(s: &str, m: &regex::Match<'_>) -> bool {
        let t = m.as_str();
        let alnum = |c: Option<char>| c.is_some_and(|c| c.is_ascii_alphanumeric());
        !alnum(s[..m.start()].chars().next_back())
            && !alnum(s[m.end()..].chars().next())
            && t.bytes().any(|b| b.is_ascii_digit())
            && t.bytes().any(|b| b.is_ascii_alphabetic())
    }

    /// `s` with every volatile part replaced by its rule's placeholder, and the names of
    /// the rules that matched (in rule order).
    pub fn normalize(s: &str) -> (String, Vec<&'static str>) {
        let mut out = s.to_owned();
        let mut fired = Vec::new();
        for (rule, re) in RULES.iter().zip(COMPILED.iter()) {
            let Some(re) = re else { continue };
            let cur = out.clone();
            let mut next = String::with_capacity(cur.len());
            let mut last = 0;
            let mut hit = false;
            for m in re.find_iter(&cur) {
                if rule.name == "hex_id" && !hex_id(&cur, &m) {
                    continue;
                }
                if rule.name == "long_number" {
                    let digit = |c: Option<char>| c.is_some_and(|c| c.is_ascii_digit());
                    if digit(cur[..m.start()].chars().next_back()) {
                        continue;
                    }
                }
                next.push_str(&cur[last..m.start()]);
                next.push_str(rule.placeholder);
                last = m.end();
                hit = true;
            }
            if hit {
                next.push_str(&cur[last..]);
                out = next;
                fired.push(rule.name);
            }
        }
        (out, fired)
    }

    #[cfg(test)]
    mod tests {
        use super::normalize;

        fn same(a: &str, b: &str) -> Vec<&'static str> {
            let (na, ra) = normalize(a);
            let (nb, _) = normalize(b);
            assert_eq!(na, nb, "{a:?} and {b:?} should normalize alike");
            ra
        }

        fn differ(a: &str, b: &str) {
            assert_ne!(
                normalize(a).0,
                normalize(b).0,
                "{a:?} and {b:?} should differ"
            );
        }

        #[test]
        fn uuids_are_volatile() {
            let r = same(
                "session 0190a4c2-7b1e-7c3a-9f00-1234567890ab ready",
                "session 6F9619FF-8B86-D011-B42D-00C04FC964FF ready",
            );
            assert_eq!(r, ["uuid"]);
        }

        #[test]
        fn timestamps_dates_and_clock_times_are_volatile() {
            assert_eq!(
                same(
                    "Current time: 2026-12-07T12:58:19.123Z.",
                    "Current time: 2027-01-31T00:00:01.999Z."
                ),
                ["timestamp"]
            );
            same("Today is 2026-12-07.", "Today is 2026-12-08.");
            same("at 12:58:19 UTC", "at 09:01:00 UTC");
            same("Mon Dec 7 2026", "Tue Dec 8 2026");
            same("date: December 7, 2026", "date: January 12, 2027");
            same("7 Dec 2026", "12 Jan 2027");
        }

        #[test]
        fn hex_ids_are_volatile_but_words_and_short_runs_are_not() {
            assert_eq!(
                same("commit 3f9c2a7e1b4d", "commit 0a1b2c3d4e5f"),
                ["hex_id"]
            );
            same("call_0123456789ab_0", "call_fedcba987654_0");
            // Too short, or letters only ("deadbeef" is a word here), or inside a longer word.
            differ("id 3f9c2a7", "id 0a1b2c3");
            differ("deadbeef", "facefeed");
            differ("xx3f9c2a7e1b4dyy", "xx0a1b2c3d4e5fyy");
        }

        #[test]
        fn long_numbers_are_volatile_but_short_ones_are_not() {
            assert_eq!(
                same("epoch 1733572699", "epoch 1733579999"),
                ["long_number"]
            );
            same("pid 123456", "pid 654321");
            differ("3 files changed", "4 files changed");
            differ("port 8080", "port 8081");
        }

        #[test]
        fn words_and_paths_are_never_volatile() {
            differ("list the files", "delete the files");
            differ("Month 3", "Month 4");
            differ("Maybe 3", "Maybe 4");
            differ("cwd /home/alice/project", "cwd /home/bob/project");
            assert!(normalize("plain text, no ids").1.is_empty());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn chat(system: &str, user: &str) -> Value {
        json!({"model": "m", "messages": [
            {"role": "system", "content": system},
            {"role": "user", "content": user}]})
    }

    fn rec(n: u64, request: Value, upstream_dialect: Option<&str>) -> CallRecord {
        CallRecord {
            call_id: format!("p{n}"),
            session_id: "parent".into(),
            seq: n,
            dialect: "chat_completions".into(),
            outcome: "ok".into(),
            request,
            upstream_dialect: upstream_dialect.map(str::to_owned),
            ..CallRecord::default()
        }
    }

    fn parent() -> Vec<CallRecord> {
        (1..=3)
            .map(|n| {
                rec(
                    n,
                    chat("It is 2026-01-01T10:00:00Z.", &format!("turn {n}")),
                    None,
                )
            })
            .collect()
    }

    fn branch(policy: ReplayPolicy, at_call: u64) -> Branch {
        let req = BranchOf {
            session: "parent".into(),
            at_call,
            policy,
        };
        Branch::open(req, parent(), false).unwrap()
    }

    fn chat_dialect() -> &'static dyn Dialect {
        dialect(DialectKind::ChatCompletions)
    }

    /// The branch's decision on a Chat call with this system prompt and user turn
    /// (passthrough: no prompt ids, replayable).
    fn decide_chat(b: &Branch, system: &str, user: &str) -> (Replay, Option<Arc<CallRecord>>) {
        b.decide(&chat(system, user), chat_dialect(), None, Ok(()))
    }

    #[test]
    fn a_branch_is_refused_past_the_parents_answered_calls_or_in_another_mode() {
        let req = |at_call| BranchOf {
            session: "parent".into(),
            at_call,
            policy: ReplayPolicy::Tolerant,
        };
        let mut records = parent();
        // A failed call is not an answered one.
        records[2].outcome = "upstream_error".into();
        let e = Branch::open(req(3), records, false).err().unwrap();
        assert!(e.to_string().contains("has 2 answered calls"), "{e}");
        let e = Branch::open(req(1), parent(), true).err().unwrap();
        assert!(e.to_string().contains("recorded in passthrough"), "{e}");
        let exact: Vec<CallRecord> = (1..=2)
            .map(|n| {
                rec(
                    n,
                    chat("s", "u"),
                    Some(graft_recorder::wire::SGLANG_GENERATE),
                )
            })
            .collect();
        let e = Branch::open(req(1), exact, false).err().unwrap();
        assert!(e.to_string().contains("recorded in exact mode"), "{e}");
        assert!(Branch::open(req(3), parent(), false).is_ok());
    }

    #[test]
    fn tolerant_replays_through_volatile_parts_and_goes_live_at_a_changed_turn() {
        let b = branch(ReplayPolicy::Tolerant, 3);
        let (r, from) = decide_chat(&b, "It is 2026-02-02T11:00:00Z.", "turn 1");
        assert_eq!(from.map(|p| p.call_id.clone()).as_deref(), Some("p1"));
        assert_eq!(r.replayed_from.as_deref(), Some("p1"));
        assert_eq!(r.differences.len(), 1, "{r:?}");
        assert_eq!(r.differences[0].kind, "timestamp");
        assert_eq!(r.differences[0].at, "messages[0].content[0].text");
        let (r, from) = decide_chat(&b, "It is 2026-01-01T10:00:00Z.", "turn 2");
        assert!(from.is_some() && r.differences.is_empty(), "{r:?}");
        let (r, from) = decide_chat(&b, "It is 2026-01-01T10:00:00Z.", "turn two");
        assert!(from.is_none());
        assert!(
            r.live
                .as_deref()
                .unwrap()
                .starts_with("tolerant: a turn differs"),
            "{r:?}"
        );
        assert_eq!(r.differences[0].kind, "turn");
        // Live from then on, whatever comes.
        let (r, from) = decide_chat(&b, "It is 2026-01-01T10:00:00Z.", "turn 3");
        assert!(from.is_none());
        assert_eq!(
            r.live.as_deref(),
            Some("the branch went live at its call 3")
        );
        assert_eq!(b.view()["replayed"], 2);
        assert_eq!(b.view()["tolerated"], 1);
    }

    #[test]
    fn strict_goes_live_at_the_first_difference_and_past_the_branch_point() {
        let b = branch(ReplayPolicy::Strict, 1);
        let (r, from) = decide_chat(&b, "It is 2026-02-02T11:00:00Z.", "turn 1");
        assert!(from.is_none());
        assert!(r.live.as_deref().unwrap().starts_with("strict:"), "{r:?}");
        assert_eq!(r.differences[0].kind, "timestamp");
        let b = branch(ReplayPolicy::Strict, 1);
        let (_, from) = decide_chat(&b, "It is 2026-01-01T10:00:00Z.", "turn 1");
        assert!(from.is_some());
        let (r, from) = decide_chat(&b, "It is 2026-01-01T10:00:00Z.", "turn 2");
        assert!(from.is_none());
        assert!(
            r.live
                .as_deref()
                .unwrap()
                .starts_with("past the branch point"),
            "{r:?}"
        );
    }

    #[test]
    fn exact_mode_compares_prompt_ids_first() {
        let mut records = parent();
        records[0].prompt_token_ids = Some(vec![1, 2, 3]);
        records[0].upstream_dialect = Some(graft_recorder::wire::SGLANG_GENERATE.into());
        let req = BranchOf {
            session: "parent".into(),
            at_call: 1,
            policy: ReplayPolicy::Strict,
        };
        let b = Branch::open(req.clone(), records.clone(), true).unwrap();
        // The same ids: replayed, whatever the conversation says.
        let (r, from) = b.decide(
            &chat("other", "turn 1"),
            chat_dialect(),
            Some(&[1, 2, 3][..]),
            Ok(()),
        );
        assert!(from.is_some() && r.differences.is_empty(), "{r:?}");
        let b = Branch::open(req, records, true).unwrap();
        let (r, from) = b.decide(
            &chat("It is 2026-01-01T10:00:00Z.", "turn 1"),
            chat_dialect(),
            Some(&[1, 2, 4][..]),
            Ok(()),
        );
        assert!(from.is_none());
        assert_eq!(r.differences[0].at, "prompt_token_ids[2]");
        assert_eq!(r.differences[0].kind, "tokens");
    }
}

//! Retries: attempts of one turn, linked. The OpenAI SDKs retry timeouts and 5xx answers
//! (twice by default, sending `x-stainless-retry-count`), harnesses retry on their own, some
//! send an `Idempotency-Key`. A call is a retry of an earlier call of its session when
//!
//! - it carries the same `Idempotency-Key`, or
//! - its `x-stainless-retry-count` is above 0 and its body is byte-identical, or
//! - (exact mode) its prompt ids are the same as those of an earlier call that has not
//!   answered yet or failed.
//!
//! A retry is recorded with `attempt` (2, 3, ...) and `retry_of` (the call id of the turn's
//! first attempt); a first attempt with `attempt` 1. Reconstruct trains only on the attempt
//! whose answer the client received.
//!
//! What is remembered is bounded for the whole gateway, not per session, so thousands of
//! sessions that are never closed cost no more than the bound ([`Bounds`], the
//! `limits.retry_memory_*` keys): each session keeps its last 8 attempts (bodies only for
//! the last 2: SDK retries follow the attempt they repeat); over all sessions at most
//! `attempts` attempts and `bytes` of bodies and keys are kept, and an attempt untouched
//! (begun or settled) for `ttl` is forgotten. Past a bound the least recently touched
//! attempts go first, whichever session they belong to; a retry of a forgotten attempt is
//! recorded as a new turn (attempt 1). A session's attempts are dropped when it is closed.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::hash::{Hash, Hasher};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::HeaderMap;

use crate::metrics::Metrics;

/// Attempts remembered per session.
const KEPT: usize = 8;
/// Attempts per session whose body is kept for comparison.
const BODIES_KEPT: usize = 2;

/// What a call says about being a retry.
pub(crate) struct Signals {
    key: Option<String>,
    retry_count: u32,
    body: Bytes,
}

impl Signals {
    pub(crate) fn of(headers: &HeaderMap, body: &Bytes) -> Signals {
        let text = |name: &str| {
            headers
                .get(name)
                .and_then(|v| v.to_str().ok())
                .map(str::trim)
                .filter(|v| !v.is_empty())
        };
        Signals {
            key: text("idempotency-key").map(str::to_string),
            retry_count: text("x-stainless-retry-count")
                .and_then(|v| v.parse().ok())
                .unwrap_or(0),
            body: body.clone(),
        }
    }
}

/// A hash of prompt ids (exact mode), to recognise a resent prompt.
pub(crate) fn prompt_hash(ids: &[u32]) -> u64 {
    let mut h = std::collections::hash_map::DefaultHasher::new();
    ids.hash(&mut h);
    h.finish()
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    /// Not answered yet.
    Open,
    Ok,
    Failed,
}

struct Attempt {
    call_id: String,
    /// The call id of the turn's first attempt.
    first: String,
    n: u32,
    key: Option<String>,
    body: Option<Bytes>,
    prompt: Option<u64>,
    state: State,
    /// When it was last begun or settled: its place in [`Ledger::order`].
    touched: u64,
    at: Instant,
}

impl Attempt {
    /// The bytes it holds beyond its fixed size (what [`Bounds::bytes`] counts).
    fn bytes(&self) -> usize {
        self.key.as_ref().map_or(0, String::len) + self.body.as_ref().map_or(0, Bytes::len)
    }
}

/// How a call is linked to its turn.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Link {
    pub(crate) attempt: u32,
    pub(crate) retry_of: Option<String>,
}

/// What the retry bookkeeping may hold over all sessions.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Bounds {
    /// Attempts remembered in all (`limits.retry_memory_attempts`).
    pub attempts: usize,
    /// Bytes of bodies and idempotency keys held in all (`limits.retry_memory_bytes`).
    pub bytes: usize,
    /// An attempt not begun or settled for this long is forgotten
    /// (`limits.retry_memory_secs`).
    pub ttl: Duration,
}

impl Default for Bounds {
    /// 65 536 attempts (a few hundred bytes each), 64 MiB of bodies, 10 minutes: an
    /// SDK retries within seconds of the attempt it repeats failing or being abandoned.
    fn default() -> Self {
        Bounds {
            attempts: 65_536,
            bytes: 64 << 20,
            ttl: Duration::from_secs(600),
        }
    }
}

#[derive(Default)]
struct Ledger {
    /// Each session's attempts, most recent first.
    sessions: HashMap<String, VecDeque<Attempt>>,
    /// Every attempt by when it was last touched: (session, call id).
    order: BTreeMap<u64, (String, String)>,
    attempts: usize,
    bytes: usize,
    clock: u64,
}

impl Ledger {
    fn tick(&mut self) -> u64 {
        self.clock += 1;
        self.clock
    }

    /// Forgets what is past the bounds: untouched for `ttl`, then the least recently
    /// touched until the counts fit. Returns how many attempts were forgotten.
    fn evict(&mut self, b: &Bounds, now: Instant) -> usize {
        let mut evicted = 0;
        while let Some((&seq, (session, call))) = self.order.first_key_value() {
            let stale = self
                .sessions
                .get(session)
                .and_then(|q| q.iter().find(|a| a.call_id == *call))
                .is_none_or(|a| now.saturating_duration_since(a.at) >= b.ttl);
            if !stale && self.attempts <= b.attempts && self.bytes <= b.bytes {
                break;
            }
            let (session, call) = (session.clone(), call.clone());
            self.order.remove(&seq);
            self.remove(&session, &call);
            evicted += 1;
        }
        evicted
    }

    /// Removes one attempt from its session (not from `order`).
    fn remove(&mut self, session: &str, call: &str) {
        let Some(q) = self.sessions.get_mut(session) else {
            return;
        };
        if let Some(i) = q.iter().position(|a| a.call_id == call)
            && let Some(a) = q.remove(i)
        {
            self.attempts -= 1;
            self.bytes -= a.bytes();
        }
        if q.is_empty() {
            self.sessions.remove(session);
        }
    }
}

/// Every session's recent attempts, within [`Bounds`].
pub struct Retries {
    ledger: Mutex<Ledger>,
    bounds: Bounds,
    metrics: Option<Arc<Metrics>>,
}

impl Retries {
    pub fn new(bounds: Bounds) -> Retries {
        Retries {
            ledger: Mutex::new(Ledger::default()),
            bounds,
            metrics: None,
        }
    }

    /// Reports what is held and forgotten as `graft_retry_memory_*`.
    pub fn with_metrics(mut self, m: Arc<Metrics>) -> Retries {
        self.metrics = Some(m);
        self
    }

    fn observe(&self, l: &Ledger, forgotten: usize) {
        if let Some(m) = &self.metrics {
            m.retry_memory_attempts
                .set(i64::try_from(l.attempts).unwrap_or(i64::MAX));
            m.retry_memory_bytes
                .set(i64::try_from(l.bytes).unwrap_or(i64::MAX));
            if forgotten > 0 {
                m.retry_memory_forgotten.inc_by(forgotten as u64);
            }
        }
    }

    /// Registers call `call_id` of `session` and says which attempt of which turn it is.
    pub(crate) fn begin(
        &self,
        session: &str,
        call_id: &str,
        s: Signals,
        prompt: Option<u64>,
    ) -> Link {
        self.begin_at(session, call_id, s, prompt, Instant::now())
    }

    fn begin_at(
        &self,
        session: &str,
        call_id: &str,
        s: Signals,
        prompt: Option<u64>,
        now: Instant,
    ) -> Link {
        let first_attempt = Link {
            attempt: 1,
            retry_of: None,
        };
        let Ok(mut ledger) = self.ledger.lock() else {
            return first_attempt;
        };
        let l = &mut *ledger;
        let evicted = l.evict(&self.bounds, now);
        if evicted > 0 {
            tracing::debug!(
                evicted,
                "retries: attempts past limits.retry_memory_* forgotten"
            );
        }
        let recent = l.sessions.entry(session.to_string()).or_default();
        // The most recent attempt each rule finds (the highest attempt of its turn).
        let by_key = s
            .key
            .as_ref()
            .and_then(|k| recent.iter().find(|a| a.key.as_ref() == Some(k)));
        let by_body = if s.retry_count > 0 {
            recent.iter().find(|a| a.body.as_ref() == Some(&s.body))
        } else {
            None
        };
        // A resent prompt is a retry only while its latest attempt has no answer.
        let by_prompt = prompt
            .and_then(|p| recent.iter().find(|a| a.prompt == Some(p)))
            .filter(|a| a.state != State::Ok);
        let earlier = by_key.or(by_body).or(by_prompt);
        let (n, first) = match earlier {
            Some(a) => (a.n + 1, a.first.clone()),
            None => (1, call_id.to_string()),
        };
        let link = Link {
            attempt: n,
            retry_of: (n > 1).then(|| first.clone()),
        };
        let touched = l.tick();
        let mut a = Attempt {
            call_id: call_id.to_string(),
            first,
            n,
            key: s.key,
            body: Some(s.body),
            prompt,
            state: State::Open,
            touched,
            at: now,
        };
        // A body past the whole bound is not kept (it would push out every other).
        if a.bytes() > self.bounds.bytes {
            a.body = None;
        }
        l.attempts += 1;
        l.bytes += a.bytes();
        let recent = l.sessions.entry(session.to_string()).or_default();
        recent.push_front(a);
        // Only the `KEPT` most recent attempts per session, bodies for `BODIES_KEPT`.
        while recent.len() > KEPT {
            if let Some(old) = recent.pop_back() {
                l.attempts -= 1;
                l.bytes -= old.bytes();
                l.order.remove(&old.touched);
            }
        }
        for old in recent.iter_mut().skip(BODIES_KEPT) {
            if let Some(b) = old.body.take() {
                l.bytes -= b.len();
            }
        }
        l.order
            .insert(touched, (session.to_string(), call_id.to_string()));
        let forgotten = evicted + l.evict(&self.bounds, now);
        self.observe(l, forgotten);
        link
    }

    /// The call's answer is settled (`ok`: recorded as answered).
    pub(crate) fn settle(&self, session: &str, call_id: &str, ok: bool) {
        self.settle_at(session, call_id, ok, Instant::now());
    }

    fn settle_at(&self, session: &str, call_id: &str, ok: bool, now: Instant) {
        let Ok(mut ledger) = self.ledger.lock() else {
            return;
        };
        let l = &mut *ledger;
        let seq = l.tick();
        let Some(a) = l
            .sessions
            .get_mut(session)
            .and_then(|q| q.iter_mut().find(|a| a.call_id == call_id))
        else {
            return;
        };
        a.state = if ok { State::Ok } else { State::Failed };
        let old = std::mem::replace(&mut a.touched, seq);
        a.at = now;
        if let Some(v) = l.order.remove(&old) {
            l.order.insert(seq, v);
        }
    }

    /// Forgets a session's attempts (it was closed).
    pub(crate) fn forget(&self, session: &str) {
        let Ok(mut ledger) = self.ledger.lock() else {
            return;
        };
        let l = &mut *ledger;
        if let Some(q) = l.sessions.remove(session) {
            for a in q {
                l.order.remove(&a.touched);
                l.attempts -= 1;
                l.bytes -= a.bytes();
            }
        }
        self.observe(l, 0);
    }

    /// (attempts, bytes) held now.
    #[cfg(test)]
    fn held(&self) -> (usize, usize) {
        self.ledger
            .lock()
            .map(|l| (l.attempts, l.bytes))
            .unwrap_or_default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sig(key: Option<&str>, retry: u32, body: &'static str) -> Signals {
        Signals {
            key: key.map(str::to_string),
            retry_count: retry,
            body: Bytes::from_static(body.as_bytes()),
        }
    }

    #[test]
    fn an_sdk_retry_of_the_same_body_is_linked_to_the_first_attempt() {
        let t = Retries::new(Bounds::default());
        let a = t.begin("s", "c1", sig(None, 0, "{\"a\":1}"), None);
        assert_eq!(
            a,
            Link {
                attempt: 1,
                retry_of: None
            }
        );
        // The same body again without the retry header is a new turn (a harness may ask
        // the same thing twice on purpose).
        let b = t.begin("s", "c2", sig(None, 0, "{\"a\":1}"), None);
        assert_eq!(b.attempt, 1);
        let c = t.begin("s", "c3", sig(None, 1, "{\"a\":1}"), None);
        assert_eq!(
            c,
            Link {
                attempt: 2,
                retry_of: Some("c2".into())
            }
        );
        let d = t.begin("s", "c4", sig(None, 2, "{\"a\":1}"), None);
        assert_eq!(
            d,
            Link {
                attempt: 3,
                retry_of: Some("c2".into())
            }
        );
        // A retry count with another body is not a retry of these.
        assert_eq!(
            t.begin("s", "c5", sig(None, 1, "{\"b\":2}"), None).attempt,
            1
        );
    }

    #[test]
    fn idempotency_keys_and_resent_prompts_link_attempts() {
        let t = Retries::new(Bounds::default());
        t.begin("s", "k1", sig(Some("idem-1"), 0, "x"), None);
        let r = t.begin("s", "k2", sig(Some("idem-1"), 0, "y"), None);
        assert_eq!(
            r,
            Link {
                attempt: 2,
                retry_of: Some("k1".into())
            }
        );
        // Exact mode: the same prompt ids as an attempt that failed (or has not answered).
        let p = Some(prompt_hash(&[1, 2, 3]));
        t.begin("s", "p1", sig(None, 0, "p"), p);
        t.settle("s", "p1", false);
        let r = t.begin("s", "p2", sig(None, 0, "q"), p);
        assert_eq!(
            r,
            Link {
                attempt: 2,
                retry_of: Some("p1".into())
            }
        );
        // Once answered, the same prompt again is a new turn.
        t.settle("s", "p2", true);
        assert_eq!(t.begin("s", "p3", sig(None, 0, "r"), p).attempt, 1);
    }

    fn body(n: usize) -> Signals {
        Signals {
            key: None,
            retry_count: 0,
            body: Bytes::from(vec![b'x'; n]),
        }
    }

    fn retry_of_body(n: usize) -> Signals {
        Signals {
            retry_count: 1,
            ..body(n)
        }
    }

    #[test]
    fn retry_memory_stays_bounded_over_sessions_never_closed() {
        let bounds = Bounds {
            attempts: 16,
            bytes: 1000,
            ttl: Duration::from_secs(60),
        };
        let metrics = Metrics::new();
        let t = Retries::new(bounds).with_metrics(metrics.clone());
        let now = Instant::now();
        // Thousands of rollouts, none closed, each call unanswered (the worst case).
        for i in 0..5000 {
            let s = format!("s{i}");
            t.begin_at(&s, &format!("{s}-a"), body(100), Some(i), now);
            t.begin_at(&s, &format!("{s}-b"), body(100), None, now);
            let (attempts, bytes) = t.held();
            assert!(
                attempts <= 16 && bytes <= 1000,
                "{attempts} attempts, {bytes} bytes held"
            );
        }
        let l = t.ledger.lock().unwrap();
        assert!(
            l.sessions.len() <= 16,
            "{} sessions remembered",
            l.sessions.len()
        );
        assert_eq!(
            l.order.len(),
            l.attempts,
            "every attempt has its place in the order"
        );
        let (attempts, bytes) = (l.attempts, l.bytes);
        drop(l);
        assert_eq!(t.held(), (attempts, bytes));
        assert!(attempts > 0, "the most recent attempts are still kept");
        // A body past the whole bound is not kept, and pushes out nothing.
        t.begin_at("big", "big-1", body(5000), None, now);
        assert_eq!(t.held(), (attempts + 1, bytes));
        // What /metrics says.
        assert_eq!(metrics.retry_memory_attempts.get(), (attempts + 1) as i64);
        assert_eq!(metrics.retry_memory_bytes.get(), bytes as i64);
        assert_eq!(
            metrics.retry_memory_forgotten.get(),
            10_001 - (attempts as u64 + 1),
            "every attempt begun and not held was forgotten"
        );
    }

    #[test]
    fn a_retry_within_the_bounds_is_linked_and_one_past_them_is_a_new_turn() {
        let bounds = Bounds {
            attempts: 16,
            bytes: 1000,
            ttl: Duration::from_secs(60),
        };
        let t = Retries::new(bounds);
        let t0 = Instant::now();
        t.begin_at("live", "first", body(100), None, t0);
        // Other sessions' calls, within the bounds (5 more bodies of 100 bytes).
        for i in 0..5 {
            t.begin_at(&format!("o{i}"), &format!("o{i}"), body(100), None, t0);
        }
        // The SDK's retry, 59 s later (the first attempt failed just now): linked.
        t.settle_at("live", "first", false, t0 + Duration::from_secs(59));
        let r = t.begin_at(
            "live",
            "second",
            retry_of_body(100),
            None,
            t0 + Duration::from_secs(59),
        );
        assert_eq!(
            r,
            Link {
                attempt: 2,
                retry_of: Some("first".into())
            }
        );
        // The other sessions' attempts (untouched for 60 s) are gone; `live`'s are kept,
        // the settle touched the first one.
        t.begin_at("o9", "o9", body(1), None, t0 + Duration::from_secs(61));
        assert_eq!(t.held().0, 3, "live's two attempts and o9's");
        // Past the TTL from its last touch: forgotten, the retry is a new turn.
        let late = t0 + Duration::from_secs(59 + 61);
        assert_eq!(
            t.begin_at("live", "third", retry_of_body(100), None, late)
                .attempt,
            1
        );
        // Past the byte bound: the least recently touched attempts go first, whichever
        // session they belong to (o9's, then `third`).
        t.begin_at("live", "fourth", body(300), None, late);
        t.settle_at("live", "fourth", false, late);
        for i in 0..7 {
            t.begin_at(&format!("p{i}"), &format!("p{i}"), body(100), None, late);
        }
        // 300 + 7 × 100 = 1000 bytes: still within the bound, still linked.
        let r = t.begin_at("live", "fifth", retry_of_body(300), None, late);
        assert_eq!(r.retry_of.as_deref(), Some("fourth"));
        // A session's attempts go when it is closed.
        let before = t.held().0;
        t.forget("live");
        assert!(t.held().0 < before);
        assert_eq!(
            t.begin_at("live", "sixth", retry_of_body(300), None, late)
                .attempt,
            1
        );
    }
}

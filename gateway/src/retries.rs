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
//! whose answer the client received. Each session keeps its last few attempts (bodies only
//! for the last two: SDK retries follow the attempt they repeat).

use std::collections::VecDeque;
use std::hash::{Hash, Hasher};
use std::sync::Mutex;

use bytes::Bytes;
use http::HeaderMap;

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
}

/// How a call is linked to its turn.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Link {
    pub(crate) attempt: u32,
    pub(crate) retry_of: Option<String>,
}

/// A session's recent attempts.
#[derive(Default)]
pub struct Turns {
    recent: Mutex<VecDeque<Attempt>>,
}

impl Turns {
    /// Registers call `call_id` and says which attempt of which turn it is.
    pub(crate) fn begin(&self, call_id: &str, s: Signals, prompt: Option<u64>) -> Link {
        let Ok(mut recent) = self.recent.lock() else {
            return Link {
                attempt: 1,
                retry_of: None,
            };
        };
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
        recent.push_front(Attempt {
            call_id: call_id.to_string(),
            first,
            n,
            key: s.key,
            body: Some(s.body),
            prompt,
            state: State::Open,
        });
        recent.truncate(KEPT);
        for a in recent.iter_mut().skip(BODIES_KEPT) {
            a.body = None;
        }
        link
    }

    /// The call's answer is settled (`ok`: recorded as answered).
    pub(crate) fn settle(&self, call_id: &str, ok: bool) {
        if let Ok(mut recent) = self.recent.lock()
            && let Some(a) = recent.iter_mut().find(|a| a.call_id == call_id)
        {
            a.state = if ok { State::Ok } else { State::Failed };
        }
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
        let t = Turns::default();
        let a = t.begin("c1", sig(None, 0, "{\"a\":1}"), None);
        assert_eq!(
            a,
            Link {
                attempt: 1,
                retry_of: None
            }
        );
        // The same body again without the retry header is a new turn (a harness may ask
        // the same thing twice on purpose).
        let b = t.begin("c2", sig(None, 0, "{\"a\":1}"), None);
        assert_eq!(b.attempt, 1);
        let c = t.begin("c3", sig(None, 1, "{\"a\":1}"), None);
        assert_eq!(
            c,
            Link {
                attempt: 2,
                retry_of: Some("c2".into())
            }
        );
        let d = t.begin("c4", sig(None, 2, "{\"a\":1}"), None);
        assert_eq!(
            d,
            Link {
                attempt: 3,
                retry_of: Some("c2".into())
            }
        );
        // A retry count with another body is not a retry of these.
        assert_eq!(t.begin("c5", sig(None, 1, "{\"b\":2}"), None).attempt, 1);
    }

    #[test]
    fn idempotency_keys_and_resent_prompts_link_attempts() {
        let t = Turns::default();
        t.begin("k1", sig(Some("idem-1"), 0, "x"), None);
        let r = t.begin("k2", sig(Some("idem-1"), 0, "y"), None);
        assert_eq!(
            r,
            Link {
                attempt: 2,
                retry_of: Some("k1".into())
            }
        );
        // Exact mode: the same prompt ids as an attempt that failed (or has not answered).
        let p = Some(prompt_hash(&[1, 2, 3]));
        t.begin("p1", sig(None, 0, "p"), p);
        t.settle("p1", false);
        let r = t.begin("p2", sig(None, 0, "q"), p);
        assert_eq!(
            r,
            Link {
                attempt: 2,
                retry_of: Some("p1".into())
            }
        );
        // Once answered, the same prompt again is a new turn.
        t.settle("p2", true);
        assert_eq!(t.begin("p3", sig(None, 0, "r"), p).attempt, 1);
    }
}

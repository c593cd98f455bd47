//! Rate limits (governor) per session and global, and the cap on concurrent upstream requests.

use std::num::NonZeroU32;
use std::sync::Arc;
use std::time::Duration;

use governor::clock::{Clock, DefaultClock};
use governor::{DefaultDirectRateLimiter, DefaultKeyedRateLimiter, Quota, RateLimiter};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use crate::error::GatewayError;

pub struct Limits {
    global: Option<DefaultDirectRateLimiter>,
    per_session: Option<DefaultKeyedRateLimiter<String>>,
    upstream: Arc<Semaphore>,
    queue_timeout: Duration,
    clock: DefaultClock,
}

fn quota(rps: u32, burst: u32) -> Option<Quota> {
    let rps = NonZeroU32::new(rps)?;
    let burst = NonZeroU32::new(burst).unwrap_or(rps);
    Some(Quota::per_second(rps).allow_burst(burst))
}

impl Limits {
    pub fn new(
        global_rps: u32,
        session_rps: u32,
        burst: u32,
        max_upstream: usize,
        queue_timeout: Duration,
    ) -> Self {
        Limits {
            global: quota(global_rps, burst).map(RateLimiter::direct),
            per_session: quota(session_rps, burst).map(RateLimiter::keyed),
            upstream: Arc::new(Semaphore::new(max_upstream)),
            queue_timeout,
            clock: DefaultClock::default(),
        }
    }

    /// Admits one request for `session` or says how long to wait.
    pub fn check(&self, session: &str) -> Result<(), GatewayError> {
        if let Some(g) = &self.global
            && let Err(not_until) = g.check()
        {
            return Err(GatewayError::RateLimited {
                scope: "global requests per second".into(),
                retry_after_secs: secs_ceil(not_until.wait_time_from(self.clock.now())),
            });
        }
        if let Some(k) = &self.per_session
            && let Err(not_until) = k.check_key(&session.to_string())
        {
            return Err(GatewayError::RateLimited {
                scope: format!("requests per second for session '{session}'"),
                retry_after_secs: secs_ceil(not_until.wait_time_from(self.clock.now())),
            });
        }
        Ok(())
    }

    /// Waits for an upstream slot, up to the queue timeout.
    pub async fn upstream_permit(&self) -> Result<OwnedSemaphorePermit, GatewayError> {
        let sem = self.upstream.clone();
        match tokio::time::timeout(self.queue_timeout, sem.acquire_owned()).await {
            Ok(Ok(p)) => Ok(p),
            Ok(Err(_)) => Err(GatewayError::Internal("upstream semaphore closed".into())),
            Err(_) => Err(GatewayError::RateLimited {
                scope: format!(
                    "all upstream slots busy for {} ms (limits.max_concurrent_upstream)",
                    self.queue_timeout.as_millis()
                ),
                retry_after_secs: 1,
            }),
        }
    }

    /// Forgets idle per-session limiter state.
    pub fn housekeeping(&self) {
        if let Some(k) = &self.per_session {
            k.retain_recent();
        }
    }
}

fn secs_ceil(d: Duration) -> u64 {
    d.as_secs() + u64::from(d.subsec_nanos() > 0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn session_limit_is_per_session() {
        let l = Limits::new(0, 1, 1, 1, Duration::from_millis(1));
        assert!(l.check("a").is_ok());
        let e = l.check("a").unwrap_err();
        assert!(
            matches!(
                e,
                GatewayError::RateLimited {
                    retry_after_secs: 1,
                    ..
                }
            ),
            "{e}"
        );
        assert!(l.check("b").is_ok());
    }

    #[tokio::test]
    async fn upstream_cap_times_out_with_429() {
        let l = Limits::new(0, 0, 0, 1, Duration::from_millis(20));
        let _p = l.upstream_permit().await.unwrap();
        let e = l.upstream_permit().await.unwrap_err();
        assert_eq!(e.status(), http::StatusCode::TOO_MANY_REQUESTS);
    }
}

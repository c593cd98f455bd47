//! The inference backends during a run: weight pushes, and a watchdog for backends that go
//! away (restarted, crashed, rescheduled).
//!
//! Every `backend.health_interval_secs` each backend is asked `GET /health` and, once the
//! run has pushed weights, `GET /get_model_info` (a restart quicker than the interval shows
//! as the wrong `weight_version`). One that does not answer is waited for (up to
//! `backend.restart_wait_secs`) while the gateway holds the new calls pinned to it
//! (`/graft/backend/pause {"backend": URL}`; calls to the other backends go on), so
//! rollouts that had not yet called it lose nothing but time. When it answers again, its
//! `weight_version` is compared with the version the run last pushed: a restarted backend
//! serves its start-up weights, so the policy's current checkpoint is pushed to it again
//! before the gateway lets calls through. Each outage is an event in the step log
//! (`backend_events`). Calls that were in flight when it went away fail; the gateway counts
//! them per session and their rollouts are excluded (`Outcome::BackendFailed`).
//!
//! A push (after a training step) and the watchdog's recovery take the same lock, so a
//! backend is paused and resumed by one of them at a time.

use std::collections::HashSet;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::Context;
use http::Method;
use serde_json::{Value, json};

use super::config::RlConfig;
use super::rollout::Api;

#[derive(Default)]
pub struct Shared {
    /// Held while the gateway is paused for a push or a backend's recovery.
    lock: tokio::sync::Mutex<()>,
    /// The checkpoint and `weight_version` the backends should serve (None: their own
    /// start-up weights).
    expected: Mutex<(Option<PathBuf>, Option<String>)>,
    events: Mutex<Vec<Value>>,
}

fn guard<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl Shared {
    pub fn set_expected(&self, policy: Option<PathBuf>, version: Option<String>) {
        *guard(&self.expected) = (policy, version);
    }

    /// The backend events since the last call.
    pub fn take_events(&self) -> Vec<Value> {
        std::mem::take(&mut *guard(&self.events))
    }

    fn event(&self, v: Value) {
        tracing::warn!(event = %v, "backend event");
        guard(&self.events).push(v);
    }

    /// Pushes `ckpt` as `version` to every backend, one at a time, while the gateway holds
    /// the calls pinned to that one. A backend that fails the push is waited for (it may be
    /// restarting) and pushed again once.
    pub async fn push(
        &self,
        cfg: &RlConfig,
        gateway: &Api,
        backends: &[String],
        ckpt: &Path,
        version: &str,
    ) -> anyhow::Result<()> {
        let _g = self.lock.lock().await;
        // One backend at a time: calls pinned to the others go on meanwhile.
        for b in backends {
            let one = json!({"backend": b});
            gateway
                .ok(Method::POST, "/graft/backend/pause", Some(&one))
                .await?;
            let mut r = push_one(b, ckpt, version).await;
            if let Err(e) = &r {
                let first = format!("{e:#}");
                let t = Instant::now();
                tracing::warn!(backend = %b, error = %first, "the weight push failed; waiting for the backend");
                if wait_healthy(b, cfg.backend.restart_wait_secs).await {
                    r = push_one(b, ckpt, version).await;
                    self.event(json!({"backend": b, "event": "push retried after the backend came back",
                        "first_error": first, "waited_secs": t.elapsed().as_secs_f64(), "ok": r.is_ok()}));
                }
            }
            let resumed = gateway
                .ok(Method::POST, "/graft/backend/resume", Some(&one))
                .await;
            r?;
            resumed?;
        }
        self.set_expected(Some(ckpt.to_path_buf()), Some(version.to_string()));
        Ok(())
    }
}

#[cfg(feature = "trainer")]
async fn push_one(backend: &str, ckpt: &Path, version: &str) -> anyhow::Result<()> {
    let (b, p, v) = (backend.to_string(), ckpt.to_path_buf(), version.to_string());
    tokio::task::spawn_blocking(move || graft_trainer::push::push_weights(&b, &p, &v))
        .await
        .context("the weight push task failed")?
        .with_context(|| format!("pushing {} to {backend}", ckpt.display()))
}

#[cfg(not(feature = "trainer"))]
async fn push_one(backend: &str, _ckpt: &Path, _version: &str) -> anyhow::Result<()> {
    anyhow::bail!(
        "cannot push weights to {backend}: this graft was built without the 'trainer' feature"
    )
}

async fn healthy(backend: &str) -> bool {
    let api = Api::new(backend, None);
    matches!(
        tokio::time::timeout(Duration::from_secs(5), api.call(Method::GET, "/health", None)).await,
        Ok(Ok((s, _))) if (200..300).contains(&s)
    )
}

/// The `weight_version` a backend reports (`GET /get_model_info`), if it says.
async fn serving_version(backend: &str) -> Option<String> {
    let api = Api::new(backend, None);
    match tokio::time::timeout(
        Duration::from_secs(5),
        api.ok(Method::GET, "/get_model_info", None),
    )
    .await
    {
        Ok(Ok(v)) => v["weight_version"].as_str().map(str::to_string),
        _ => None,
    }
}

async fn wait_healthy(backend: &str, within_secs: f64) -> bool {
    let deadline = Instant::now() + Duration::from_secs_f64(within_secs);
    loop {
        if healthy(backend).await {
            return true;
        }
        if Instant::now() > deadline {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

/// The watchdog: runs until the run ends (it is aborted then).
pub async fn watch(cfg: RlConfig, gateway: Api, backends: Vec<String>, shared: Arc<Shared>) {
    let interval = Duration::from_secs_f64(cfg.backend.health_interval_secs);
    let mut gave_up: HashSet<String> = HashSet::new();
    loop {
        tokio::time::sleep(interval).await;
        for b in &backends {
            if !healthy(b).await {
                if !gave_up.contains(b)
                    && !recover(&cfg, &gateway, b, &shared, Instant::now()).await
                {
                    gave_up.insert(b.clone());
                }
                continue;
            }
            // Up. A restart quicker than the interval shows as weights it should not have.
            let want = guard(&shared.expected).1.clone();
            let stale = match (want, serving_version(b).await) {
                (Some(w), Some(v)) => w != v,
                _ => false,
            };
            if gave_up.remove(b) || stale {
                recover(&cfg, &gateway, b, &shared, Instant::now()).await;
            }
        }
    }
}

/// Holds the gateway's calls until `backend` answers again and serves the expected weights.
/// false when it did not come back in time.
async fn recover(
    cfg: &RlConfig,
    gateway: &Api,
    backend: &str,
    shared: &Shared,
    since: Instant,
) -> bool {
    let _g = shared.lock.lock().await;
    let was_down = !healthy(backend).await;
    // New calls wait at the gateway rather than fail against a backend that is away. The
    // pause returns once the calls in flight are done; those to a dead backend end quickly,
    // a hung one at the gateway's upstream timeout, so this does not wait for it forever.
    if was_down {
        let paused = tokio::time::timeout(
            Duration::from_secs(30),
            gateway.ok(
                Method::POST,
                "/graft/backend/pause",
                Some(&json!({"backend": backend})),
            ),
        )
        .await;
        if !matches!(paused, Ok(Ok(_))) {
            tracing::warn!(backend, "the gateway did not confirm the pause in time");
        }
    }
    if was_down && !wait_healthy(backend, cfg.backend.restart_wait_secs).await {
        shared.event(json!({"backend": backend, "event": "did not come back",
            "gave_up_after_secs": since.elapsed().as_secs_f64()}));
        resume(gateway, backend).await;
        return false;
    }
    let (ckpt, want) = guard(&shared.expected).clone();
    let serving = serving_version(backend).await;
    let mut ev = json!({"backend": backend, "event": if was_down { "restarted" } else { "checked" },
        "down_secs": since.elapsed().as_secs_f64(), "serving": serving});
    if let (Some(ckpt), Some(want)) = (ckpt, want)
        && serving.as_deref() != Some(want.as_str())
    {
        let r = push_one(backend, &ckpt, &want).await;
        ev["repushed"] = json!(want);
        ev["repush_error"] = json!(r.as_ref().err().map(|e| format!("{e:#}")));
    }
    if was_down || ev.get("repushed").is_some() {
        shared.event(ev);
    }
    if was_down {
        resume(gateway, backend).await;
    }
    true
}

async fn resume(gateway: &Api, backend: &str) {
    if let Err(e) = gateway
        .ok(
            Method::POST,
            "/graft/backend/resume",
            Some(&json!({"backend": backend})),
        )
        .await
    {
        tracing::error!(error = %format!("{e:#}"), "the gateway could not be resumed after a backend outage");
    }
}

//! The inference backends during a run: weight pushes, and a watchdog for backends that go
//! away (restarted, crashed, rescheduled).
//!
//! Every `backend.health_interval_secs` each backend is asked which weights it serves: SGLang
//! (`backend.wire = "sglang"`) `GET /model_info` (`/get_model_info` on servers older than
//! the rename): it answers at once, also while a push pauses generation, where SGLang's
//! `GET /health` generates a token each time and fails while paused; vLLM `GET
//! /weight_info` (a development route, `VLLM_SERVER_DEV_MODE=1`), else, on a vLLM without
//! it, `GET /health` (cheap in vLLM, also while paused), which says it is up but not which
//! weights it serves. The `weight_version` shows a restart quicker than the interval (the
//! wrong weights; a restarted vLLM says `"default"`). One that does not answer is waited for (up to
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

use super::config::{BackendSection, RlConfig};
use super::rollout::Api;
use graft_gateway::config::ExactWire;
use graft_wire::sglang::path;
use graft_wire::vllm as vllm_wire;

/// The backends' keys (`backend.api_key`, `backend.admin_api_key`).
#[derive(Debug, Clone, Default)]
pub struct Keys {
    pub api: Option<String>,
    pub admin: Option<String>,
}

impl Keys {
    /// `backend.api_key` and `backend.admin_api_key`, read (an `env::NAME` from the
    /// environment).
    pub fn of(b: &BackendSection) -> anyhow::Result<Keys> {
        let read = |key: &str, v: &Option<String>| -> anyhow::Result<Option<String>> {
            match v.as_deref() {
                None => Ok(None),
                Some(v) => match v.strip_prefix("env::") {
                    Some(var) => std::env::var(var).map(Some).map_err(|_| {
                        anyhow::anyhow!(
                            "backend.{key} names the environment variable {var}, which is not set"
                        )
                    }),
                    None => Ok(Some(v.to_string())),
                },
            }
        };
        Ok(Keys {
            api: read("api_key", &b.api_key)?,
            admin: read("admin_api_key", &b.admin_api_key)?,
        })
    }

    /// The key for SGLang's admin routes (pauses, weight updates): the admin key where the
    /// server has one, else its API key.
    pub fn admin(&self) -> Option<&str> {
        self.admin.as_deref().or(self.api.as_deref())
    }

    /// An API client of `backend` with the API key.
    pub fn api(&self, backend: &str) -> Api {
        Api::new(
            backend,
            self.api
                .as_ref()
                .map(|k| ("authorization", format!("Bearer {k}"))),
        )
    }
}

#[derive(Default)]
pub struct Shared {
    /// How the backends are asked.
    pub keys: Keys,
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
    pub fn new(keys: Keys) -> Shared {
        Shared {
            keys,
            ..Shared::default()
        }
    }

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

    /// Pushes `ckpt` as `version` to every backend, one at a time. No call is drained: the
    /// server's own pause (SGLang's `/pause_generation {mode: "retract"}`, vLLM's `/pause?mode=keep`
    /// and `/reset_prefix_cache?reset_running_requests=true`) keeps its running requests and
    /// holds new ones while the weights load, then the resume goes on with them under the new
    /// weights; each answer's `weight_version` spans label every
    /// token with the weights that sampled it, and the trainer's staleness rules decide.
    /// With `backend.drain_on_push` the gateway instead holds the calls pinned to the
    /// backend and waits for those in flight (for servers that cannot pause in place). A
    /// backend that fails the push is waited for (it may be restarting) and pushed again once.
    pub async fn push(
        &self,
        cfg: &RlConfig,
        gateway: &Api,
        backends: &[String],
        ckpt: &Path,
        version: &str,
    ) -> anyhow::Result<()> {
        let _g = self.lock.lock().await;
        let wire = cfg.backend.wire;
        // One backend at a time: calls pinned to the others go on meanwhile.
        for b in backends {
            let one = json!({"backend": b});
            // A backend that does not say which weights sampled each token (vLLM before
            // 0.34) is drained, so the version graft gives at the resume labels its calls.
            let labels = reports_weight_versions(wire, b, &self.keys).await;
            if !labels && !cfg.backend.drain_on_push {
                tracing::info!(backend = %b, "the backend does not report weight versions per request: the push drains it, and the gateway labels its calls with the version pushed");
            }
            let drain = cfg.backend.drain_on_push || !labels;
            if drain {
                gateway
                    .ok(Method::POST, "/graft/backend/pause", Some(&one))
                    .await?;
            }
            let mut r = push_one(wire, b, ckpt, version, &self.keys).await;
            if let Err(e) = &r {
                let first = format!("{e:#}");
                let t = Instant::now();
                tracing::warn!(backend = %b, error = %first, "the weight push failed; waiting for the backend");
                if wait_healthy(wire, b, cfg.backend.restart_wait_secs, &self.keys).await {
                    r = push_one(wire, b, ckpt, version, &self.keys).await;
                    self.event(json!({"backend": b, "event": "push retried after the backend came back",
                        "first_error": first, "waited_secs": t.elapsed().as_secs_f64(), "ok": r.is_ok()}));
                }
            }
            let resumed = if drain {
                // The version labels the calls after a push that went through; after one
                // that failed the backend serves what it served before.
                let body = match &r {
                    Ok(()) => json!({"backend": b, "weight_version": version}),
                    Err(_) => one,
                };
                gateway
                    .ok(Method::POST, "/graft/backend/resume", Some(&body))
                    .await
                    .map(|_| ())
            } else {
                Ok(())
            };
            r?;
            resumed?;
        }
        self.set_expected(Some(ckpt.to_path_buf()), Some(version.to_string()));
        Ok(())
    }
}

/// One backend's push: SGLang's (`graft_trainer::push::push_weights`) or vLLM's
/// (`push_weights_vllm`), with the admin key (vLLM's dev routes take no key; a proxy in
/// front may want one).
#[cfg(feature = "trainer")]
async fn push_one(
    wire: ExactWire,
    backend: &str,
    ckpt: &Path,
    version: &str,
    keys: &Keys,
) -> anyhow::Result<()> {
    let (b, p, v) = (backend.to_string(), ckpt.to_path_buf(), version.to_string());
    let key = keys.admin().map(str::to_string);
    tokio::task::spawn_blocking(move || match wire {
        ExactWire::Sglang => graft_trainer::push::push_weights(&b, &p, &v, key.as_deref()),
        ExactWire::Vllm => graft_trainer::push::push_weights_vllm(&b, &p, &v, key.as_deref()),
    })
    .await
    .context("the weight push task failed")?
    .with_context(|| format!("pushing {} to {backend}", ckpt.display()))
}

#[cfg(not(feature = "trainer"))]
async fn push_one(
    _wire: ExactWire,
    backend: &str,
    _ckpt: &Path,
    _version: &str,
    _keys: &Keys,
) -> anyhow::Result<()> {
    anyhow::bail!(
        "cannot push weights to {backend}: this graft was built without the 'trainer' feature"
    )
}

/// The backend's model info (`GET /model_info`, else the older `GET /get_model_info`);
/// None when it does not answer with 200 within 5 s.
pub async fn model_info(api: &Api) -> Option<Value> {
    for route in [path::MODEL_INFO, path::GET_MODEL_INFO] {
        match tokio::time::timeout(Duration::from_secs(5), api.call(Method::GET, route, None)).await
        {
            Ok(Ok((404, _))) => continue,
            Ok(Ok((s, v))) if (200..300).contains(&s) => return Some(v),
            _ => return None,
        }
    }
    None
}

/// A vLLM backend's weight info (`GET /weight_info`, a development route); `{}` when it
/// has no such route (not in dev mode) but `GET /health` answers 200: up, its weights
/// unknown. None when it does not answer with 200 within 5 s.
pub async fn vllm_weight_info(api: &Api) -> Option<Value> {
    let ask =
        |route| tokio::time::timeout(Duration::from_secs(5), api.call(Method::GET, route, None));
    match ask(vllm_wire::path::WEIGHT_INFO).await {
        Ok(Ok((s, v))) if (200..300).contains(&s) => Some(v),
        Ok(Ok((404, _))) => match ask(vllm_wire::path::HEALTH).await {
            Ok(Ok((s, _))) if (200..300).contains(&s) => Some(json!({})),
            _ => None,
        },
        _ => None,
    }
}

/// What a backend says about the weights it serves (see the module doc); None when it
/// does not answer.
async fn weight_info(wire: ExactWire, backend: &str, keys: &Keys) -> Option<Value> {
    let api = keys.api(backend);
    match wire {
        ExactWire::Sglang => model_info(&api).await,
        ExactWire::Vllm => vllm_weight_info(&api).await,
    }
}

/// Whether the backend reports the weight version that sampled each token: SGLang does
/// (every version graft accepts); vLLM from 0.34 (`GET /version`), not before, nor where
/// its version cannot be read.
async fn reports_weight_versions(wire: ExactWire, backend: &str, keys: &Keys) -> bool {
    if wire != ExactWire::Vllm {
        return true;
    }
    let asked = tokio::time::timeout(
        Duration::from_secs(5),
        keys.api(backend)
            .call(Method::GET, vllm_wire::path::VERSION, None),
    )
    .await;
    match asked {
        Ok(Ok((s, v))) if (200..300).contains(&s) => v["version"]
            .as_str()
            .is_some_and(vllm_wire::reports_weight_versions),
        _ => false,
    }
}

async fn healthy(wire: ExactWire, backend: &str, keys: &Keys) -> bool {
    weight_info(wire, backend, keys).await.is_some()
}

/// The `weight_version` a backend reports, if it says.
async fn serving_version(wire: ExactWire, backend: &str, keys: &Keys) -> Option<String> {
    weight_info(wire, backend, keys).await?["weight_version"]
        .as_str()
        .map(str::to_string)
}

/// Refuses a backend that cannot take weight pushes, before the run spends a step on it:
/// a vLLM without its development routes (`GET /weight_info` answers 404).
pub async fn check_pushable(wire: ExactWire, backend: &str, keys: &Keys) -> anyhow::Result<()> {
    if wire != ExactWire::Vllm {
        return Ok(());
    }
    let (status, _) = keys
        .api(backend)
        .call(Method::GET, vllm_wire::path::WEIGHT_INFO, None)
        .await
        .with_context(|| format!("asking the vLLM backend {backend} for GET /weight_info"))?;
    if status == 404 {
        anyhow::bail!(
            "the vLLM backend {backend} answers 404 on GET /weight_info, so graft rl could not push the trained weights to it: {}",
            vllm_wire::DEV_MODE_HINT
        );
    }
    Ok(())
}

async fn wait_healthy(wire: ExactWire, backend: &str, within_secs: f64, keys: &Keys) -> bool {
    let deadline = Instant::now() + Duration::from_secs_f64(within_secs);
    loop {
        if healthy(wire, backend, keys).await {
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
    let wire = cfg.backend.wire;
    let mut gave_up: HashSet<String> = HashSet::new();
    loop {
        tokio::time::sleep(interval).await;
        for b in &backends {
            if !healthy(wire, b, &shared.keys).await {
                if !gave_up.contains(b)
                    && !recover(&cfg, &gateway, b, &shared, Instant::now()).await
                {
                    gave_up.insert(b.clone());
                }
                continue;
            }
            // Up. A restart quicker than the interval shows as weights it should not have.
            let want = guard(&shared.expected).1.clone();
            let stale = match (want, serving_version(wire, b, &shared.keys).await) {
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
    let wire = cfg.backend.wire;
    let was_down = !healthy(wire, backend, &shared.keys).await;
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
    if was_down && !wait_healthy(wire, backend, cfg.backend.restart_wait_secs, &shared.keys).await {
        shared.event(json!({"backend": backend, "event": "did not come back",
            "gave_up_after_secs": since.elapsed().as_secs_f64()}));
        resume(gateway, backend, None).await;
        return false;
    }
    let (ckpt, want) = guard(&shared.expected).clone();
    let mut serving = serving_version(wire, backend, &shared.keys).await;
    let mut ev = json!({"backend": backend, "event": if was_down { "restarted" } else { "checked" },
        "down_secs": since.elapsed().as_secs_f64(), "serving": serving});
    if let (Some(ckpt), Some(want)) = (ckpt, want)
        && serving.as_deref() != Some(want.as_str())
    {
        let r = push_one(wire, backend, &ckpt, &want, &shared.keys).await;
        ev["repushed"] = json!(want);
        ev["repush_error"] = json!(r.as_ref().err().map(|e| format!("{e:#}")));
        if r.is_ok() {
            serving = Some(want);
        }
    }
    if was_down || ev.get("repushed").is_some() {
        shared.event(ev);
    }
    if was_down {
        resume(gateway, backend, serving.as_deref()).await;
    }
    true
}

/// Lets the calls held for `backend` go; `weight_version`: what it serves now, where known
/// (the label of its calls when it reports none itself).
async fn resume(gateway: &Api, backend: &str, weight_version: Option<&str>) {
    let mut body = json!({"backend": backend});
    if let Some(v) = weight_version {
        body["weight_version"] = json!(v);
    }
    if let Err(e) = gateway
        .ok(Method::POST, "/graft/backend/resume", Some(&body))
        .await
    {
        tracing::error!(error = %format!("{e:#}"), "the gateway could not be resumed after a backend outage");
    }
}

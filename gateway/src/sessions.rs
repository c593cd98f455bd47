//! Sessions: one rollout each. The registry lives in memory and every change is first made
//! durable in the recorder's session log, so it survives a restart.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};

use graft_recorder::{SessionEvent, SessionLog, SessionState};
use rand::Rng;
use serde_json::{Value, json};
use sha2::{Digest, Sha256};

use crate::error::GatewayError;
use crate::policy::SamplingPolicy;
use crate::route::{SESSION_ID_RULE, valid_session_id};

pub struct Session {
    pub id: String,
    pub group_id: Option<String>,
    pub created_at_us: i64,
    pub metadata: Value,
    closed: AtomicBool,
    reward: Mutex<Option<(f64, Value)>>,
    /// Call rewards posted (process rewards for single turns).
    call_rewards: AtomicU64,
    calls: AtomicU64,
    /// Calls of this session that failed at the backend (unreachable, 5xx, timeout, broken
    /// stream): a rollout with any is not the policy's doing.
    upstream_errors: AtomicU64,
    /// The session's own sampling policy (it replaces the gateway's `[sampling]`).
    sampling: RwLock<Option<Arc<SamplingPolicy>>>,
    /// The exact-mode backend the session named for itself at creation (a trainer's own
    /// server); `None`: the gateway pins it to one of its configured backends.
    pub backend: Option<String>,
    /// The session has its own API key (made by `POST /graft/sessions`): its calls need that
    /// key (or the admin key). The default session and auto-created ones have none.
    pub keyed: bool,
    /// A branch of another session's rollout (`POST /graft/sessions` with `branch_of`):
    /// its first calls are answered from the parent's records (`branch.rs`).
    pub branch: Option<Arc<crate::branch::Branch>>,
}

impl Session {
    fn new(id: String, group_id: Option<String>, created_at_us: i64, metadata: Value) -> Self {
        Session {
            id,
            group_id,
            created_at_us,
            metadata,
            closed: AtomicBool::new(false),
            reward: Mutex::new(None),
            call_rewards: AtomicU64::new(0),
            calls: AtomicU64::new(0),
            upstream_errors: AtomicU64::new(0),
            sampling: RwLock::new(None),
            backend: None,
            keyed: false,
            branch: None,
        }
    }

    fn with_backend(mut self, backend: Option<String>) -> Self {
        self.backend = backend;
        self
    }

    fn with_key(mut self, keyed: bool) -> Self {
        self.keyed = keyed;
        self
    }

    /// The session's own sampling policy, if it has one.
    pub fn sampling(&self) -> Option<Arc<SamplingPolicy>> {
        self.sampling.read().ok().and_then(|p| p.clone())
    }

    fn set_sampling(&self, p: Option<SamplingPolicy>) {
        if let Ok(mut s) = self.sampling.write() {
            *s = p.map(Arc::new);
        }
    }

    pub fn is_closed(&self) -> bool {
        self.closed.load(Ordering::Acquire)
    }

    /// Counts a recorded call; `upstream_failed` when the backend, not the client, failed it.
    pub fn count_call(&self, upstream_failed: bool) {
        self.calls.fetch_add(1, Ordering::Relaxed);
        if upstream_failed {
            self.upstream_errors.fetch_add(1, Ordering::Relaxed);
        }
    }

    pub fn view(&self) -> Value {
        let reward = self.reward.lock().map(|r| r.clone()).unwrap_or(None);
        json!({
            "session_id": self.id,
            "group_id": self.group_id,
            "created_at_us": self.created_at_us,
            "closed": self.is_closed(),
            "reward": reward.as_ref().map(|r| r.0),
            "reward_info": reward.map(|r| r.1),
            "call_rewards": self.call_rewards.load(Ordering::Relaxed),
            "calls": self.calls.load(Ordering::Relaxed),
            "upstream_errors": self.upstream_errors.load(Ordering::Relaxed),
            "metadata": self.metadata,
            "sampling": self.sampling().as_deref(),
            "backend": self.backend,
            "branch": self.branch.as_ref().map(|b| b.view()),
        })
    }
}

#[derive(Default)]
struct Inner {
    by_id: HashMap<String, Arc<Session>>,
    by_key: HashMap<String, String>,
}

pub struct Sessions {
    inner: RwLock<Inner>,
    log: SessionLog,
    default_id: String,
}

/// A reward must be a finite number.
fn finite(reward: f64) -> Result<(), GatewayError> {
    if reward.is_finite() {
        return Ok(());
    }
    Err(GatewayError::field(
        "reward",
        format!("reward must be a finite number, got {reward}"),
    ))
}

/// What a client asks for on `POST /graft/sessions` (also what `graft rl` sends).
#[derive(Debug, Default, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CreateRequest {
    pub session_id: Option<String>,
    pub group_id: Option<String>,
    #[serde(default)]
    pub metadata: Value,
    /// The session's sampling policy (replaces the gateway's `[sampling]`).
    #[serde(default)]
    pub sampling: Option<SamplingPolicy>,
    /// Exact mode: the backend (an SGLang-compatible server's URL) this session's calls go
    /// to, e.g. a trainer's own server; the gateway's configured backends otherwise.
    #[serde(default)]
    pub backend: Option<String>,
    /// Make the session a branch of another one's rollout at a call (`branch.rs`).
    #[serde(default)]
    pub branch_of: Option<crate::branch::BranchOf>,
}

/// A policy as the session log keeps it; a policy this build cannot read is dropped with a
/// warning (the session then samples with the gateway's).
fn policy_of(session: &str, v: Option<Value>) -> Option<SamplingPolicy> {
    let v = v?;
    match serde_json::from_value(v) {
        Ok(p) => Some(p),
        Err(e) => {
            tracing::warn!(session, error = %e, "the session log holds a sampling policy this build cannot read; the session samples with the gateway's");
            None
        }
    }
}

/// Refuses a policy graft cannot sample with, naming the field.
pub fn check_policy(p: &SamplingPolicy) -> Result<(), GatewayError> {
    p.check().map_err(|(key, message)| {
        GatewayError::field(
            format!("sampling.{key}"),
            format!("sampling.{key} {message}"),
        )
    })
}

pub fn key_hash(key: &str) -> String {
    format!("{:x}", Sha256::digest(key.as_bytes()))
}

pub fn now_us() -> i64 {
    chrono::Utc::now().timestamp_micros()
}

fn poisoned() -> GatewayError {
    GatewayError::Internal("session registry lock poisoned".into())
}

impl Sessions {
    /// Rebuilds the registry from the session log and the recorder's recovery report.
    pub fn new(
        log: SessionLog,
        events: Vec<SessionEvent>,
        recovered: &HashMap<String, SessionState>,
        default_id: String,
    ) -> Self {
        let mut inner = Inner::default();
        for ev in events {
            match ev {
                SessionEvent::Created {
                    session_id,
                    group_id,
                    key_sha256,
                    metadata,
                    sampling,
                    backend,
                    at_us,
                } => {
                    let keyed = key_sha256.is_some();
                    if let Some(h) = key_sha256 {
                        inner.by_key.insert(h, session_id.clone());
                    }
                    let s = Session::new(session_id.clone(), group_id, at_us, metadata)
                        .with_backend(backend)
                        .with_key(keyed);
                    s.set_sampling(policy_of(&session_id, sampling));
                    inner.by_id.insert(session_id, Arc::new(s));
                }
                SessionEvent::Sampling {
                    session_id, policy, ..
                } => {
                    if let Some(s) = inner.by_id.get(&session_id) {
                        s.set_sampling(policy_of(&session_id, policy));
                    }
                }
                SessionEvent::Reward {
                    session_id,
                    reward,
                    info,
                    ..
                } => {
                    if let Some(s) = inner.by_id.get(&session_id)
                        && let Ok(mut r) = s.reward.lock()
                    {
                        *r = Some((reward, info));
                    }
                }
                SessionEvent::CallReward { session_id, .. } => {
                    if let Some(s) = inner.by_id.get(&session_id) {
                        s.call_rewards.fetch_add(1, Ordering::Relaxed);
                    }
                }
                SessionEvent::Closed { session_id, .. } => {
                    if let Some(s) = inner.by_id.get(&session_id) {
                        s.closed.store(true, Ordering::Release);
                    }
                }
            }
        }
        // A session with records but no `created` event (its line dropped by a repair, or
        // the log deleted) may have had a key, now unknown: only the admin key reaches it,
        // never a call without a key. The default session has none.
        for (id, state) in recovered {
            let s = inner.by_id.entry(id.clone()).or_insert_with(|| {
                Arc::new(Session::new(id.clone(), None, 0, Value::Null).with_key(*id != default_id))
            });
            s.calls.store(state.records, Ordering::Relaxed);
        }
        inner.by_id.entry(default_id.clone()).or_insert_with(|| {
            Arc::new(Session::new(
                default_id.clone(),
                None,
                now_us(),
                Value::Null,
            ))
        });
        Sessions {
            inner: RwLock::new(inner),
            log,
            default_id,
        }
    }

    pub fn default_session(&self) -> Result<Arc<Session>, GatewayError> {
        self.get(&self.default_id)
            .ok_or_else(|| GatewayError::Internal("default session missing".into()))
    }

    pub fn get(&self, id: &str) -> Option<Arc<Session>> {
        self.inner.read().ok()?.by_id.get(id).cloned()
    }

    pub fn by_key(&self, key: &str) -> Option<Arc<Session>> {
        let inner = self.inner.read().ok()?;
        let id = inner.by_key.get(&key_hash(key))?;
        inner.by_id.get(id).cloned()
    }

    /// The ids of the sessions that are not closed.
    pub fn open_ids(&self) -> std::collections::HashSet<String> {
        let Ok(inner) = self.inner.read() else {
            return Default::default();
        };
        inner
            .by_id
            .values()
            .filter(|s| !s.is_closed())
            .map(|s| s.id.clone())
            .collect()
    }

    /// The open sessions that named their own backend, with it (re-pinned after a start).
    pub fn open_backends(&self) -> Vec<(String, String)> {
        let Ok(inner) = self.inner.read() else {
            return vec![];
        };
        inner
            .by_id
            .values()
            .filter(|s| !s.is_closed())
            .filter_map(|s| Some((s.id.clone(), s.backend.clone()?)))
            .collect()
    }

    pub fn list(&self) -> Vec<Value> {
        let Ok(inner) = self.inner.read() else {
            return vec![];
        };
        let mut v: Vec<_> = inner
            .by_id
            .values()
            .map(|s| (s.created_at_us, s.view()))
            .collect();
        v.sort_by_key(|(t, _)| *t);
        v.into_iter().map(|(_, v)| v).collect()
    }

    /// Creates a session with its own API key. Durable before it returns.
    pub async fn create(
        &self,
        req: CreateRequest,
        branch: Option<crate::branch::Branch>,
    ) -> Result<(Arc<Session>, String), GatewayError> {
        let id = match req.session_id {
            Some(id) => {
                if !valid_session_id(&id) {
                    return Err(GatewayError::field(
                        "session_id",
                        format!("session_id '{id}' must be {SESSION_ID_RULE}"),
                    ));
                }
                id
            }
            None => uuid::Uuid::now_v7().to_string(),
        };
        if let Some(g) = &req.group_id
            && !valid_session_id(g)
        {
            return Err(GatewayError::field(
                "group_id",
                format!("group_id '{g}' must be {SESSION_ID_RULE}"),
            ));
        }
        if self.get(&id).is_some() {
            return Err(GatewayError::SessionExists(id));
        }
        if let Some(p) = &req.sampling {
            check_policy(p)?;
        }
        let key_bytes: [u8; 24] = rand::rng().random();
        let key = format!(
            "gk-{}",
            key_bytes
                .iter()
                .map(|b| format!("{b:02x}"))
                .collect::<String>()
        );
        let at_us = now_us();
        let metadata = if req.metadata.is_null() {
            json!({})
        } else {
            req.metadata
        };
        let ev = SessionEvent::Created {
            session_id: id.clone(),
            group_id: req.group_id.clone(),
            key_sha256: Some(key_hash(&key)),
            metadata: metadata.clone(),
            sampling: req
                .sampling
                .as_ref()
                .and_then(|p| serde_json::to_value(p).ok()),
            backend: req.backend.clone(),
            at_us,
        };
        self.append(&ev).await?;
        let mut session = Session::new(id.clone(), req.group_id, at_us, metadata)
            .with_backend(req.backend)
            .with_key(true);
        session.branch = branch.map(Arc::new);
        let session = Arc::new(session);
        session.set_sampling(req.sampling);
        let mut inner = self.inner.write().map_err(|_| poisoned())?;
        if inner.by_id.contains_key(&id) {
            return Err(GatewayError::SessionExists(id));
        }
        inner.by_key.insert(key_hash(&key), id.clone());
        inner.by_id.insert(id, session.clone());
        Ok((session, key))
    }

    /// A session named by a client that was never created (`sessions.auto_create`).
    pub async fn auto_create(&self, id: &str) -> Result<Arc<Session>, GatewayError> {
        if let Some(s) = self.get(id) {
            return Ok(s);
        }
        let at_us = now_us();
        let ev = SessionEvent::Created {
            session_id: id.to_string(),
            group_id: None,
            key_sha256: None,
            metadata: json!({"auto_created": true}),
            sampling: None,
            backend: None,
            at_us,
        };
        self.append(&ev).await?;
        let mut inner = self.inner.write().map_err(|_| poisoned())?;
        Ok(inner
            .by_id
            .entry(id.to_string())
            .or_insert_with(|| {
                Arc::new(Session::new(
                    id.to_string(),
                    None,
                    at_us,
                    json!({"auto_created": true}),
                ))
            })
            .clone())
    }

    pub async fn reward(
        &self,
        id: &str,
        reward: f64,
        info: Value,
    ) -> Result<Arc<Session>, GatewayError> {
        let s = self.existing(id)?;
        finite(reward)?;
        let ev = SessionEvent::Reward {
            session_id: id.to_string(),
            reward,
            info: info.clone(),
            at_us: now_us(),
        };
        self.append(&ev).await?;
        if let Ok(mut r) = s.reward.lock() {
            *r = Some((reward, info));
        }
        Ok(s)
    }

    /// Session `id`, or the error that names it unknown.
    fn existing(&self, id: &str) -> Result<Arc<Session>, GatewayError> {
        self.get(id)
            .ok_or_else(|| GatewayError::UnknownSession(id.to_string()))
    }

    /// Makes `ev` durable in the session log.
    async fn append(&self, ev: &SessionEvent) -> Result<(), GatewayError> {
        self.log
            .append(ev)
            .await
            .map_err(|e| GatewayError::Record(e.to_string()))
    }

    /// Records a reward for one call of session `id` (a process reward for that turn). The
    /// call is named by `call`: its `seq` in the session (1 for the first call; at most the
    /// calls recorded so far) or its call id (the `x-graft-call-id` response header;
    /// whether the session recorded that id is checked when samples are made: `graft
    /// reconstruct` counts call rewards that match no call).
    pub async fn call_reward(
        &self,
        id: &str,
        call: &str,
        reward: f64,
        info: Value,
    ) -> Result<Arc<Session>, GatewayError> {
        let s = self.existing(id)?;
        let shown: String = call.chars().take(80).collect();
        let (call_id, seq) = match call.parse::<u64>() {
            Ok(seq) => {
                let calls = s.calls.load(Ordering::Relaxed);
                if seq == 0 || seq > calls {
                    return Err(GatewayError::field(
                        "call",
                        format!(
                            "session '{id}' has no call {seq}: its calls are numbered 1..={calls} (their seq)"
                        ),
                    ));
                }
                (None, Some(seq))
            }
            Err(_) if uuid::Uuid::parse_str(call).is_ok() => (Some(call.to_owned()), None),
            Err(_) => {
                return Err(GatewayError::field(
                    "call",
                    format!(
                        "'{shown}' names no call: use the call's seq in the session (1, 2, ...) or its id (the x-graft-call-id header of its response)"
                    ),
                ));
            }
        };
        finite(reward)?;
        let ev = SessionEvent::CallReward {
            session_id: id.to_string(),
            call_id,
            seq,
            reward,
            info,
            at_us: now_us(),
        };
        self.append(&ev).await?;
        s.call_rewards.fetch_add(1, Ordering::Relaxed);
        Ok(s)
    }

    /// Sets (or with `None` removes) a session's sampling policy. Durable before it returns.
    pub async fn set_sampling(
        &self,
        id: &str,
        policy: Option<SamplingPolicy>,
    ) -> Result<Arc<Session>, GatewayError> {
        let s = self.existing(id)?;
        if let Some(p) = &policy {
            check_policy(p)?;
        }
        let ev = SessionEvent::Sampling {
            session_id: id.to_string(),
            policy: policy.as_ref().and_then(|p| serde_json::to_value(p).ok()),
            at_us: now_us(),
        };
        self.append(&ev).await?;
        s.set_sampling(policy);
        Ok(s)
    }

    pub async fn close(&self, id: &str) -> Result<Arc<Session>, GatewayError> {
        let s = self.existing(id)?;
        if id == self.default_id {
            return Err(GatewayError::field(
                "session_id",
                format!("the default session '{id}' cannot be closed"),
            ));
        }
        if !s.is_closed() {
            let ev = SessionEvent::Closed {
                session_id: id.to_string(),
                at_us: now_us(),
            };
            self.append(&ev).await?;
            s.closed.store(true, Ordering::Release);
        }
        Ok(s)
    }
}

//! The service behind the HTTP API: validation, the sandbox registry, jobs with
//! idempotency keys, snapshots' bookkeeping, TTL and heartbeat reaping — the same for every
//! backend. Where a sandbox lives (a directory and bubblewrap runs on this host, or a Pod
//! whose agent is called over HTTP) is the [`SandboxBackend`]'s business alone.

use std::collections::{BTreeMap, HashMap};
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use tokio::sync::{broadcast, watch};
use tracing::{info, warn};

use crate::backend::SandboxBackend;
use crate::config::{EnvdConfig, HarnessRequest};
use crate::error::EnvdError;
use crate::files::clean_path;
use crate::model::{
    CreateSandbox, CreateSnapshot, DirEntry, ExecRequest, ExecSpec, GatewaySession, JobInfo,
    Limits, Mount, NetworkPolicy, OutputEvent, SandboxInfo, SandboxSpec, SnapshotInfo, WORKSPACE,
    now_ms,
};

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// One exec, running or finished.
pub struct Job {
    pub id: String,
    pub request: ExecRequest,
    started_at_ms: u64,
    sandbox_id: String,
    result: watch::Sender<Option<JobInfo>>,
    /// Taken (dropped) when the job ends, which closes the output stream.
    events: Mutex<Option<broadcast::Sender<OutputEvent>>>,
    kill: watch::Sender<bool>,
}

impl Job {
    pub fn info(&self) -> JobInfo {
        match &*self.result.borrow() {
            Some(i) => i.clone(),
            None => JobInfo {
                job_id: self.id.clone(),
                sandbox_id: self.sandbox_id.clone(),
                state: "running",
                exit_code: None,
                stdout: String::new(),
                stderr: String::new(),
                stdout_bytes: 0,
                stderr_bytes: 0,
                stdout_truncated: false,
                stderr_truncated: false,
                max_output_bytes: self.request.max_output_bytes.unwrap_or(0),
                timed_out: false,
                oom_killed: false,
                error: None,
                started_at_ms: self.started_at_ms,
                finished_at_ms: None,
                duration_ms: None,
                idempotency_key: self.request.idempotency_key.clone(),
            },
        }
    }

    pub fn finished(&self) -> bool {
        self.result.borrow().is_some()
    }

    /// Waits until the job ends or `timeout` passes; returns its state then.
    pub async fn wait(&self, timeout: Option<Duration>) -> JobInfo {
        let mut rx = self.result.subscribe();
        let done = rx.wait_for(|r| r.is_some());
        match timeout {
            Some(t) => {
                let _ = tokio::time::timeout(t, done).await;
            }
            None => {
                let _ = done.await;
            }
        }
        self.info()
    }

    /// The live output (None when the job has already ended) and the result channel.
    pub fn subscribe(
        &self,
    ) -> (
        Option<broadcast::Receiver<OutputEvent>>,
        watch::Receiver<Option<JobInfo>>,
    ) {
        (
            lock(&self.events).as_ref().map(|s| s.subscribe()),
            self.result.subscribe(),
        )
    }

    pub fn kill(&self) {
        let _ = self.kill.send(true);
    }
}

#[derive(Default)]
struct Jobs {
    by_id: HashMap<String, Arc<Job>>,
    by_key: HashMap<String, String>,
    order: Vec<String>,
}

pub struct Sandbox {
    pub id: String,
    limits: Limits,
    env: BTreeMap<String, String>,
    labels: BTreeMap<String, String>,
    mounts: Vec<Mount>,
    from_snapshot: Option<String>,
    network: NetworkPolicy,
    gateway_url: Option<String>,
    created_at_ms: u64,
    ttl: Duration,
    touched: Mutex<(Instant, u64)>,
    jobs: Mutex<Jobs>,
    deleting: AtomicBool,
}

impl Sandbox {
    pub fn touch(&self) {
        *lock(&self.touched) = (Instant::now(), now_ms());
    }

    fn running_jobs(&self) -> Vec<Arc<Job>> {
        lock(&self.jobs)
            .by_id
            .values()
            .filter(|j| !j.finished())
            .cloned()
            .collect()
    }

    fn expired(&self, now: Instant) -> bool {
        let (t, _) = *lock(&self.touched);
        now.duration_since(t) > self.ttl && self.running_jobs().is_empty()
    }

    pub fn job(&self, id: &str) -> Result<Arc<Job>, EnvdError> {
        lock(&self.jobs)
            .by_id
            .get(id)
            .cloned()
            .ok_or_else(|| EnvdError::JobNotFound {
                sandbox: self.id.clone(),
                job: id.to_owned(),
            })
    }

    pub fn jobs(&self) -> Vec<JobInfo> {
        let j = lock(&self.jobs);
        j.order
            .iter()
            .filter_map(|id| j.by_id.get(id))
            .map(|j| j.info())
            .collect()
    }
}

pub struct Service {
    pub cfg: Arc<EnvdConfig>,
    pub backend: Arc<dyn SandboxBackend>,
    pub metrics: crate::metrics::Metrics,
    sandboxes: Mutex<Registry>,
    snapshots: Mutex<HashMap<String, SnapshotInfo>>,
}

#[derive(Default)]
struct Registry {
    live: HashMap<String, Arc<Sandbox>>,
    /// Ids reserved by a create in progress, with the snapshot they fork.
    creating: HashMap<String, Option<String>>,
}

fn valid_id(id: &str) -> bool {
    !id.is_empty()
        && id.len() <= 64
        && id
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_')
}

fn check_env(env: &BTreeMap<String, String>, field: &str) -> Result<(), EnvdError> {
    for (k, v) in env {
        if k.is_empty() || k.contains('=') || k.contains('\0') || v.contains('\0') {
            return Err(EnvdError::BadRequest(format!(
                "{field}: '{k}' is not a valid environment variable (names are non-empty, without '=' or NUL; values without NUL)"
            )));
        }
    }
    Ok(())
}

/// The harness variables for a gateway session, as the sandbox sees the gateway.
fn session_env(gw: &str, s: &GatewaySession) -> BTreeMap<String, String> {
    let base = format!("{gw}/s/{}", s.session_id);
    let key = s.api_key.clone().unwrap_or_else(|| "graft".to_owned());
    let mut e = BTreeMap::new();
    e.insert("OPENAI_BASE_URL".into(), format!("{base}/v1"));
    e.insert("OPENAI_API_BASE".into(), format!("{base}/v1"));
    e.insert("OPENAI_API_KEY".into(), key.clone());
    e.insert("ANTHROPIC_BASE_URL".into(), base.clone());
    e.insert("ANTHROPIC_API_KEY".into(), key);
    e.insert("GRAFT_SESSION_ID".into(), s.session_id.clone());
    if let Some(m) = &s.model {
        e.insert("GRAFT_MODEL".into(), m.clone());
    }
    e
}

impl Service {
    /// The service over `backend`, with the snapshots an earlier run left (they are data;
    /// sandboxes are not kept).
    pub fn new(cfg: Arc<EnvdConfig>, backend: Arc<dyn SandboxBackend>) -> Self {
        let snapshots = backend
            .saved_snapshots()
            .into_iter()
            .map(|m| (m.snapshot_id.clone(), m))
            .collect();
        Service {
            cfg,
            backend,
            metrics: crate::metrics::Metrics::new(),
            sandboxes: Mutex::new(Registry::default()),
            snapshots: Mutex::new(snapshots),
        }
    }

    /// Copies the sandbox's workspace into a new snapshot.
    pub async fn snapshot(
        &self,
        sb: &Arc<Sandbox>,
        req: CreateSnapshot,
    ) -> Result<SnapshotInfo, EnvdError> {
        sb.touch();
        let id = match req.id {
            Some(id) if !valid_id(&id) => {
                return Err(EnvdError::BadRequest(format!(
                    "id '{id}': use 1 to 64 characters of A-Z, a-z, 0-9, '-' and '_'"
                )));
            }
            Some(id) => id,
            None => format!("snap-{}", uuid::Uuid::new_v4().simple()),
        };
        if lock(&self.snapshots).contains_key(&id) {
            return Err(EnvdError::SnapshotExists(id));
        }
        let info = self.backend.snapshot(&sb.id, &id).await?;
        lock(&self.snapshots).insert(id.clone(), info.clone());
        info!(snapshot = %id, sandbox = %sb.id, files = info.files, bytes = info.bytes, "snapshot taken");
        Ok(info)
    }

    pub fn snapshots(&self) -> Vec<SnapshotInfo> {
        let mut v: Vec<SnapshotInfo> = lock(&self.snapshots).values().cloned().collect();
        v.sort_by(|a, b| (a.created_at_ms, &a.snapshot_id).cmp(&(b.created_at_ms, &b.snapshot_id)));
        v
    }

    pub fn get_snapshot(&self, id: &str) -> Result<SnapshotInfo, EnvdError> {
        lock(&self.snapshots)
            .get(id)
            .cloned()
            .ok_or_else(|| EnvdError::SnapshotNotFound(id.to_owned()))
    }

    /// Removes a snapshot no sandbox is forked from.
    pub fn delete_snapshot(&self, id: &str) -> Result<(), EnvdError> {
        self.get_snapshot(id)?;
        {
            // Under the registry lock: no fork of it can be starting meanwhile.
            let reg = lock(&self.sandboxes);
            let mut users: Vec<String> = reg
                .live
                .values()
                .filter(|s| s.from_snapshot.as_deref() == Some(id))
                .map(|s| format!("'{}'", s.id))
                .chain(
                    reg.creating
                        .iter()
                        .filter(|(_, snap)| snap.as_deref() == Some(id))
                        .map(|(sb, _)| format!("'{sb}'")),
                )
                .collect();
            users.sort();
            if !users.is_empty() {
                return Err(EnvdError::SnapshotInUse {
                    id: id.to_owned(),
                    sandboxes: users.join(", "),
                });
            }
            lock(&self.snapshots).remove(id);
        }
        self.backend.delete_snapshot(id)
    }

    pub fn get(&self, id: &str) -> Result<Arc<Sandbox>, EnvdError> {
        let sb = lock(&self.sandboxes)
            .live
            .get(id)
            .cloned()
            .ok_or_else(|| EnvdError::SandboxNotFound(id.to_owned()))?;
        if sb.deleting.load(Ordering::SeqCst) {
            return Err(EnvdError::SandboxDeleting(id.to_owned()));
        }
        Ok(sb)
    }

    pub fn info(&self, sb: &Sandbox) -> SandboxInfo {
        let (_, touched_ms) = *lock(&sb.touched);
        let state = if sb.deleting.load(Ordering::SeqCst) {
            "deleting"
        } else {
            self.backend.state(&sb.id)
        };
        let processes = self.backend.processes(&sb.id);
        SandboxInfo {
            id: sb.id.clone(),
            state,
            backend: self.backend.name(),
            created_at_ms: sb.created_at_ms,
            expires_at_ms: touched_ms + sb.ttl.as_millis() as u64,
            ttl_secs: sb.ttl.as_secs(),
            limits: sb.limits.clone(),
            limits_enforced: self.backend.limits_enforced(),
            network: sb.network,
            gateway_url: sb.gateway_url.clone(),
            workspace: WORKSPACE,
            env: sb.env.clone(),
            labels: sb.labels.clone(),
            mounts: sb.mounts.clone(),
            from_snapshot: sb.from_snapshot.clone(),
            processes,
            jobs_running: sb.running_jobs().len(),
        }
    }

    pub fn list(&self) -> Vec<SandboxInfo> {
        let mut all: Vec<Arc<Sandbox>> = lock(&self.sandboxes).live.values().cloned().collect();
        all.sort_by(|a, b| (a.created_at_ms, &a.id).cmp(&(b.created_at_ms, &b.id)));
        all.iter().map(|s| self.info(s)).collect()
    }

    pub async fn create(&self, mut req: CreateSandbox) -> Result<SandboxInfo, EnvdError> {
        let started = Instant::now();
        if req.image.is_some() && req.rootfs.is_some() {
            return Err(EnvdError::BadRequest(
                "give `image` or `rootfs`, not both".to_owned(),
            ));
        }
        let id = match req.id.take() {
            Some(id) if !valid_id(&id) => {
                return Err(EnvdError::BadRequest(format!(
                    "id '{id}': use 1 to 64 characters of A-Z, a-z, 0-9, '-' and '_'"
                )));
            }
            Some(id) => id,
            None => uuid::Uuid::new_v4().simple().to_string(),
        };
        self.backend.check_create(&id, &req)?;
        let d = self.cfg.defaults;
        let limits = Limits {
            cpus: req.cpus.unwrap_or(d.cpus),
            memory_mb: req.memory_mb.unwrap_or(d.memory_mb),
            pids: req.pids.unwrap_or(d.pids),
        };
        if !(limits.cpus > 0.0 && limits.cpus <= 1024.0) {
            return Err(EnvdError::BadRequest(format!(
                "cpus {} is out of range; give a number of CPUs above 0 (e.g. 0.5, 2)",
                limits.cpus
            )));
        }
        if limits.memory_mb < 16 {
            return Err(EnvdError::BadRequest(format!(
                "memory_mb {} is too small; a sandbox needs at least 16 MiB",
                limits.memory_mb
            )));
        }
        if limits.pids < 8 {
            return Err(EnvdError::BadRequest(format!(
                "pids {} is too small; a sandbox needs at least 8 (bubblewrap, the agent, a shell)",
                limits.pids
            )));
        }
        let ttl = Duration::from_secs(req.ttl_secs.unwrap_or(self.cfg.default_ttl.as_secs()));
        if ttl.is_zero() || ttl > self.cfg.max_ttl {
            return Err(EnvdError::BadRequest(format!(
                "ttl_secs {} is out of range 1..={}",
                ttl.as_secs(),
                self.cfg.max_ttl.as_secs()
            )));
        }
        check_env(&req.env, "env")?;
        let network = match req.network {
            Some(n) => n,
            None if self.cfg.gateway.is_some() => NetworkPolicy::Gateway,
            None => NetworkPolicy::None,
        };
        if network == NetworkPolicy::Gateway && self.cfg.gateway.is_none() {
            return Err(EnvdError::BadRequest(
                "network 'gateway': envd was started without --gateway, so no sandbox can reach a gateway; restart it with --gateway HOST:PORT or ask for network 'none'".to_owned(),
            ));
        }
        let gateway_url = (network == NetworkPolicy::Gateway)
            .then(|| format!("http://127.0.0.1:{}", self.cfg.sandbox_gateway_port));
        let mut env = BTreeMap::new();
        if let Some(gw) = &gateway_url {
            env.insert("GRAFT_GATEWAY_URL".to_owned(), gw.clone());
        }
        let mut harness_files = Vec::new();
        if let Some(s) = &req.gateway_session {
            let Some(gw) = &gateway_url else {
                return Err(EnvdError::BadRequest(
                    "gateway_session needs network 'gateway' (the harness must reach the gateway)"
                        .to_owned(),
                ));
            };
            if !valid_id(&s.session_id) {
                return Err(EnvdError::BadRequest(format!(
                    "gateway_session.session_id '{}' is not a session id",
                    s.session_id
                )));
            }
            env.extend(session_env(gw, s));
            if let Some(name) = &s.harness {
                let Some(render) = &self.cfg.harnesses else {
                    return Err(EnvdError::BadRequest(format!(
                        "gateway_session.harness '{name}': this envd has no harness templates"
                    )));
                };
                let rendered = (render.0)(&HarnessRequest {
                    harness: name.clone(),
                    base_url: format!("{gw}/s/{}/v1", s.session_id),
                    api_key: s.api_key.clone().unwrap_or_else(|| "graft".to_owned()),
                    model: s.model.clone().unwrap_or_else(|| "default".to_owned()),
                })
                .map_err(|e| EnvdError::BadRequest(format!("gateway_session.harness: {e}")))?;
                for (rel, body) in rendered.files {
                    harness_files.push((clean_path(&rel)?, body));
                }
                env.extend(rendered.env);
            }
        }
        env.extend(req.env);
        let spec = SandboxSpec {
            id: id.clone(),
            limits: limits.clone(),
            network,
            ttl,
            image: req.image,
            rootfs: req.rootfs,
            mounts: req.mounts.clone(),
            from_snapshot: req.from_snapshot.clone(),
            files: harness_files,
        };
        self.reserve(&id, req.from_snapshot.as_ref())?;
        if let Err(e) = self.backend.create(spec).await {
            lock(&self.sandboxes).creating.remove(&id);
            return Err(e);
        }
        let sb = Arc::new(Sandbox {
            id,
            limits,
            env,
            labels: req.labels,
            mounts: req.mounts,
            from_snapshot: req.from_snapshot,
            network,
            gateway_url,
            created_at_ms: now_ms(),
            ttl,
            touched: Mutex::new((Instant::now(), now_ms())),
            jobs: Mutex::new(Jobs::default()),
            deleting: AtomicBool::new(false),
        });
        {
            let mut reg = lock(&self.sandboxes);
            reg.creating.remove(&sb.id);
            reg.live.insert(sb.id.clone(), sb.clone());
        }
        self.metrics.created.inc();
        self.metrics.sandboxes.inc();
        self.metrics
            .create_seconds
            .observe(started.elapsed().as_secs_f64());
        info!(sandbox = %sb.id, backend = self.backend.name(), "sandbox created");
        Ok(self.info(&sb))
    }

    /// Reserves `id` in the registry while a backend creates it.
    fn reserve(&self, id: &str, snapshot: Option<&String>) -> Result<(), EnvdError> {
        let mut reg = lock(&self.sandboxes);
        if reg.live.contains_key(id) || reg.creating.contains_key(id) {
            return Err(EnvdError::SandboxExists(id.to_owned()));
        }
        // Under the registry lock, so a snapshot cannot be deleted in between.
        if let Some(snap) = snapshot
            && !lock(&self.snapshots).contains_key(snap)
        {
            return Err(EnvdError::SnapshotNotFound(snap.clone()));
        }
        reg.creating.insert(id.to_owned(), snapshot.cloned());
        Ok(())
    }

    /// Waits until the sandbox can serve (a Pod: ready by the watch, its harness files
    /// written).
    pub async fn ready(&self, sb: &Sandbox, timeout: Option<Duration>) -> Result<(), EnvdError> {
        self.backend.ready(&sb.id, timeout).await
    }

    /// Lists a directory of the sandbox's workspace.
    pub async fn list_files(&self, sb: &Sandbox, rel: &Path) -> Result<Vec<DirEntry>, EnvdError> {
        self.backend.list_files(&sb.id, rel).await
    }

    pub async fn read_file(&self, sb: &Sandbox, rel: &Path) -> Result<Vec<u8>, EnvdError> {
        self.backend
            .read_file(&sb.id, rel, self.cfg.max_file_bytes)
            .await
    }

    pub async fn write_file(
        &self,
        sb: &Sandbox,
        rel: &Path,
        data: Bytes,
        mode: u32,
    ) -> Result<u64, EnvdError> {
        self.backend.write_file(&sb.id, rel, data, mode).await
    }

    pub async fn remove_file(
        &self,
        sb: &Sandbox,
        rel: &Path,
        recursive: bool,
    ) -> Result<(), EnvdError> {
        self.backend.remove_file(&sb.id, rel, recursive).await
    }

    /// Kills the sandbox's jobs, then removes it. Later requests for it get 404.
    pub async fn delete(&self, id: &str, why: &str) -> Result<(), EnvdError> {
        let sb = self.get(id)?;
        if sb.deleting.swap(true, Ordering::SeqCst) {
            return Err(EnvdError::SandboxDeleting(id.to_owned()));
        }
        let running = sb.running_jobs();
        for j in &running {
            j.kill();
        }
        for j in &running {
            j.wait(Some(Duration::from_secs(30))).await;
        }
        let r = self.backend.delete(id).await;
        lock(&self.sandboxes).live.remove(id);
        self.metrics.sandboxes.dec();
        let reason = if why.contains("ttl") {
            "ttl"
        } else if why.contains("shutting") {
            "shutdown"
        } else {
            "request"
        };
        self.metrics
            .deleted
            .get_or_create(&crate::metrics::ReasonLabel { reason })
            .inc();
        info!(sandbox = %id, reason = why, "sandbox deleted");
        r
    }

    /// Validates an exec request into what the backend runs.
    fn spec(&self, sb: &Sandbox, req: &ExecRequest) -> Result<ExecSpec, EnvdError> {
        let argv = match (&req.command, &req.argv) {
            (Some(c), None) => vec!["/bin/sh".to_owned(), "-c".to_owned(), c.clone()],
            (None, Some(a)) if !a.is_empty() => a.clone(),
            (None, Some(_)) => {
                return Err(EnvdError::BadRequest(
                    "argv is empty; name a program".to_owned(),
                ));
            }
            (Some(_), Some(_)) => {
                return Err(EnvdError::BadRequest(
                    "give either `command` (a shell line) or `argv`, not both".to_owned(),
                ));
            }
            (None, None) => {
                return Err(EnvdError::BadRequest(
                    "nothing to run: give `command` (a shell line, run with /bin/sh -c) or `argv`"
                        .to_owned(),
                ));
            }
        };
        if argv.iter().any(|a| a.contains('\0')) {
            return Err(EnvdError::BadRequest(
                "the command contains a NUL byte".to_owned(),
            ));
        }
        check_env(&req.env, "env")?;
        let timeout = match req.timeout_secs {
            None => self.cfg.default_exec_timeout,
            Some(t) if t > 0.0 && t <= self.cfg.max_exec_timeout.as_secs_f64() => {
                Duration::from_secs_f64(t)
            }
            Some(t) => {
                return Err(EnvdError::BadRequest(format!(
                    "timeout_secs {t} is out of range (0, {}]",
                    self.cfg.max_exec_timeout.as_secs()
                )));
            }
        };
        let max_output_bytes = match req.max_output_bytes {
            None => self.cfg.max_output_bytes,
            Some(n) if n <= self.cfg.max_output_bytes => n,
            Some(n) => {
                return Err(EnvdError::BadRequest(format!(
                    "max_output_bytes {n} is above the server's cap of {}; ask for less or restart envd with a larger --max-output-bytes",
                    self.cfg.max_output_bytes
                )));
            }
        };
        let cwd = match req.cwd.as_deref() {
            None | Some("") => WORKSPACE.to_owned(),
            Some(c) if c.starts_with('/') => c.to_owned(),
            Some(c) => {
                let rel = clean_path(c)?;
                if !self.backend.cwd_exists(&sb.id, &rel)? {
                    return Err(EnvdError::BadRequest(format!(
                        "cwd '{c}' is not a directory in the workspace; create it first (e.g. PUT a file below it, or exec `mkdir -p`)"
                    )));
                }
                format!("{WORKSPACE}/{}", rel.display())
            }
        };
        let mut env = sb.env.clone();
        env.extend(req.env.clone());
        Ok(ExecSpec {
            argv,
            cwd,
            env,
            timeout,
            stdin: req.stdin.clone().map(String::into_bytes),
            max_output_bytes,
        })
    }

    /// Starts an exec as a job (or, for a reused idempotency key, returns the first one).
    /// The second value says whether this call started it.
    pub fn start_job(
        self: &Arc<Self>,
        sb: &Arc<Sandbox>,
        mut req: ExecRequest,
    ) -> Result<(Arc<Job>, bool), EnvdError> {
        sb.touch();
        let spec = self.spec(sb, &req)?;
        req.max_output_bytes = Some(spec.max_output_bytes);
        let mut jobs = lock(&sb.jobs);
        if let Some(key) = &req.idempotency_key
            && let Some(job_id) = jobs.by_key.get(key)
            && let Some(job) = jobs.by_id.get(job_id)
        {
            if !same_command(&job.request, &req) {
                return Err(EnvdError::IdempotencyConflict {
                    key: key.clone(),
                    sandbox: sb.id.clone(),
                    job: job.id.clone(),
                });
            }
            return Ok((job.clone(), false));
        }
        let id = format!("job-{}", uuid::Uuid::new_v4().simple());
        let (events, _) = broadcast::channel(1024);
        let (kill, kill_rx) = watch::channel(false);
        let job = Arc::new(Job {
            id: id.clone(),
            request: req.clone(),
            started_at_ms: now_ms(),
            sandbox_id: sb.id.clone(),
            result: watch::channel(None).0,
            events: Mutex::new(Some(events.clone())),
            kill,
        });
        if let Some(key) = &req.idempotency_key {
            jobs.by_key.insert(key.clone(), id.clone());
        }
        jobs.by_id.insert(id.clone(), job.clone());
        jobs.order.push(id.clone());
        drop(jobs);
        let svc = self.clone();
        let sb2 = sb.clone();
        let job2 = job.clone();
        tokio::spawn(async move {
            let base = job2.info();
            let info = svc.run(&sb2, &job2.id, spec, base, events, kill_rx).await;
            if let Some(e) = &info.error {
                warn!(sandbox = %sb2.id, job = %job2.id, error = %e, "job ended with an error");
            }
            svc.metrics
                .jobs
                .get_or_create(&crate::metrics::StateLabel { state: info.state })
                .inc();
            if let Some(ms) = info.duration_ms {
                svc.metrics.job_seconds.observe(ms as f64 / 1000.0);
            }
            if info.oom_killed {
                svc.metrics.oom_kills.inc();
            }
            job2.result.send_replace(Some(info));
            lock(&job2.events).take();
            sb2.touch();
        });
        Ok((job, true))
    }

    /// Runs one exec on the sandbox's backend.
    async fn run(
        &self,
        sb: &Sandbox,
        job: &str,
        spec: ExecSpec,
        base: JobInfo,
        events: broadcast::Sender<OutputEvent>,
        kill: watch::Receiver<bool>,
    ) -> JobInfo {
        self.backend
            .exec(&sb.id, job, spec, base, events, kill)
            .await
    }

    /// Deletes sandboxes whose TTL ran out since their last request or heartbeat; on
    /// kubernetes also, every `reconcile_interval`, Pods and NetworkPolicies of this envd
    /// that no sandbox owns.
    pub async fn reap(&self) {
        if let Err(e) = self.reconcile(false).await {
            warn!(error = %e, "could not reconcile the sandboxes with the cluster");
        }
        let now = Instant::now();
        let expired: Vec<String> = lock(&self.sandboxes)
            .live
            .values()
            .filter(|s| !s.deleting.load(Ordering::SeqCst) && s.expired(now))
            .map(|s| s.id.clone())
            .collect();
        for id in expired {
            if let Err(e) = self.delete(&id, "ttl expired").await {
                warn!(sandbox = %id, error = %e, "could not reap the sandbox");
            }
        }
    }

    /// Kubernetes: deletes the cluster's objects of this envd that no sandbox owns (all of
    /// them at start, when the registry is empty). Returns how many were deleted.
    pub async fn reconcile(&self, force: bool) -> Result<usize, EnvdError> {
        let known = || {
            let reg = lock(&self.sandboxes);
            reg.live
                .keys()
                .chain(reg.creating.keys())
                .cloned()
                .collect::<std::collections::HashSet<String>>()
        };
        self.backend.reconcile(force, &known).await
    }

    /// Deletes every sandbox (envd is shutting down).
    pub async fn delete_all(&self) {
        let ids: Vec<String> = lock(&self.sandboxes).live.keys().cloned().collect();
        for id in ids {
            let _ = self.delete(&id, "envd shutting down").await;
        }
    }
}

/// Whether two requests ask for the same command (what an idempotency key protects).
fn same_command(a: &ExecRequest, b: &ExecRequest) -> bool {
    a.command == b.command
        && a.argv == b.argv
        && a.cwd == b.cwd
        && a.env == b.env
        && a.timeout_secs == b.timeout_secs
        && a.stdin == b.stdin
}

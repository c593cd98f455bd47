//! The service behind the HTTP API: the sandbox registry, jobs with idempotency keys, TTL
//! and heartbeat reaping — the same for both backends ([`Backend`]); only where a sandbox
//! lives ([`Place`]) differs: a directory and bubblewrap runs on this host, or a Pod whose
//! agent is called over HTTP.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use tokio::sync::{broadcast, watch};
use tracing::{info, warn};

use crate::agent_client::Endpoint;
use crate::backend::Backend;
use crate::config::{EnvdConfig, HarnessRequest};
use crate::error::EnvdError;
use crate::files::{Owner, Workspace, clean_path};
use crate::kubernetes::{KubeBackend, KubeSandbox};
use crate::local::{ExecSpec, LocalBackend, OutputEvent, SandboxPaths, WORKSPACE};
use crate::model::{
    CreateSandbox, CreateSnapshot, DirEntry, ExecRequest, GatewaySession, JobInfo, Limits, Mount,
    NetworkPolicy, SandboxInfo, SnapshotInfo,
};

/// A job that could not start.
fn failed_job(mut info: JobInfo, e: &EnvdError) -> JobInfo {
    info.state = "failed";
    info.error = Some(e.to_string());
    info.finished_at_ms = Some(now_ms());
    info.duration_ms = Some(now_ms().saturating_sub(info.started_at_ms));
    info
}

fn not_kube() -> EnvdError {
    EnvdError::Backend("a Kubernetes sandbox on an envd without the kubernetes backend".to_owned())
}

fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

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

/// Where a sandbox lives.
pub enum Place {
    /// A directory under the data dir; every exec a bubblewrap run.
    Local {
        paths: SandboxPaths,
        workspace: Workspace,
        forward: Mutex<Option<tokio::task::JoinHandle<()>>>,
    },
    /// A Pod; exec and files go to its agent.
    Kube {
        sb: KubeSandbox,
        /// Harness files to write once the Pod is ready.
        pending_files: tokio::sync::Mutex<Vec<(PathBuf, String)>>,
    },
}

/// What a create has checked, for the backend to make.
struct NewSandbox {
    id: String,
    limits: Limits,
    env: BTreeMap<String, String>,
    labels: BTreeMap<String, String>,
    network: NetworkPolicy,
    gateway_url: Option<String>,
    ttl: Duration,
    harness_files: Vec<(PathBuf, String)>,
}

pub struct Sandbox {
    pub id: String,
    place: Place,
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
    pub backend: Backend,
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
    pub fn new(cfg: Arc<EnvdConfig>, backend: Backend) -> Self {
        let mut snapshots = HashMap::new();
        let dir = backend.local().map(|l| l.data_dir().join("snapshots"));
        if let Some(Ok(rd)) = dir.as_ref().map(std::fs::read_dir) {
            for e in rd.flatten() {
                let meta = e.path().join("meta.json");
                match std::fs::read(&meta)
                    .ok()
                    .and_then(|b| serde_json::from_slice::<SnapshotInfo>(&b).ok())
                {
                    Some(m) => {
                        snapshots.insert(m.snapshot_id.clone(), m);
                    }
                    // A snapshot without its meta file was never finished.
                    None => {
                        let _ = std::fs::remove_dir_all(e.path());
                    }
                }
            }
        }
        Service {
            cfg,
            backend,
            metrics: crate::metrics::Metrics::new(),
            sandboxes: Mutex::new(Registry::default()),
            snapshots: Mutex::new(snapshots),
        }
    }

    fn snapshot_dir(&self, id: &str) -> PathBuf {
        match self.backend.local() {
            Some(l) => l.data_dir().join("snapshots").join(id),
            None => PathBuf::from("snapshots").join(id),
        }
    }

    /// Copies the sandbox's workspace into a new snapshot.
    pub async fn snapshot(
        &self,
        sb: &Arc<Sandbox>,
        req: CreateSnapshot,
    ) -> Result<SnapshotInfo, EnvdError> {
        sb.touch();
        let (Some(local), Place::Local { paths, .. }) = (self.backend.local(), &sb.place) else {
            return Err(EnvdError::BadRequest(
                "snapshots need the local backend (a Pod's workspace is an emptyDir on its node)"
                    .to_owned(),
            ));
        };
        let id = match req.id {
            Some(id) if !valid_id(&id) => {
                return Err(EnvdError::BadRequest(format!(
                    "id '{id}': use 1 to 64 characters of A-Z, a-z, 0-9, '-' and '_'"
                )));
            }
            Some(id) => id,
            None => format!("snap-{}", uuid::Uuid::new_v4().simple()),
        };
        let dir = self.snapshot_dir(&id);
        if lock(&self.snapshots).contains_key(&id) || dir.exists() {
            return Err(EnvdError::SnapshotExists(id));
        }
        let parent = local.data_dir().join("snapshots");
        std::fs::create_dir_all(&parent)
            .map_err(|e| EnvdError::io(format!("cannot create {}", parent.display()), e))?;
        // create_dir, not _all: of two requests for one id, exactly one gets it.
        match std::fs::create_dir(&dir) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {
                return Err(EnvdError::SnapshotExists(id));
            }
            Err(e) => {
                return Err(EnvdError::io(format!("cannot create {}", dir.display()), e));
            }
        }
        let copied = {
            let tree = dir.join("tree");
            let backend_paths = paths.clone();
            let owner = local.owner;
            let r = tokio::task::spawn_blocking(move || {
                let d = cap_std::fs::Dir::open_ambient_dir(
                    &backend_paths.workspace,
                    cap_std::ambient_authority(),
                )
                .map_err(|e| EnvdError::io("cannot open the workspace", e))?;
                crate::snapshot::copy_tree(&d, &tree, owner)
            })
            .await
            .map_err(|e| EnvdError::Backend(format!("the snapshot copy failed: {e}")))
            .and_then(|r| r);
            if r.is_err() {
                let _ = std::fs::remove_dir_all(&dir);
            }
            r?
        };
        let info = SnapshotInfo {
            snapshot_id: id.clone(),
            source_sandbox: sb.id.clone(),
            created_at_ms: now_ms(),
            files: copied.files,
            bytes: copied.bytes,
        };
        let meta = serde_json::to_vec_pretty(&info)
            .map_err(|e| EnvdError::Backend(format!("cannot encode the snapshot's meta: {e}")))?;
        std::fs::write(dir.join("meta.json"), meta)
            .map_err(|e| EnvdError::io(format!("cannot write {}", dir.display()), e))?;
        lock(&self.snapshots).insert(id.clone(), info.clone());
        info!(snapshot = %id, sandbox = %sb.id, files = copied.files, bytes = copied.bytes, "snapshot taken");
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
        let dir = self.snapshot_dir(id);
        std::fs::remove_dir_all(&dir)
            .map_err(|e| EnvdError::io(format!("cannot remove {}", dir.display()), e))
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
        let state = match (&self.backend, &sb.place) {
            _ if sb.deleting.load(Ordering::SeqCst) => "deleting",
            (Backend::Kubernetes(k), Place::Kube { .. }) => k.state(&sb.id).api_state(),
            _ => "ready",
        };
        let processes = match (&self.backend, &sb.place) {
            (Backend::Local(l), Place::Local { .. }) => l.processes(&sb.id),
            _ => None,
        };
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

    pub async fn create(&self, req: CreateSandbox) -> Result<SandboxInfo, EnvdError> {
        let started = Instant::now();
        if req.image.is_some() && req.rootfs.is_some() {
            return Err(EnvdError::BadRequest(
                "give `image` or `rootfs`, not both".to_owned(),
            ));
        }
        let id = match req.id {
            Some(id) if !valid_id(&id) => {
                return Err(EnvdError::BadRequest(format!(
                    "id '{id}': use 1 to 64 characters of A-Z, a-z, 0-9, '-' and '_'"
                )));
            }
            Some(id) => id,
            None => uuid::Uuid::new_v4().simple().to_string(),
        };
        if let Backend::Kubernetes(_) = &self.backend {
            crate::kubernetes::check_id(&id)?;
            let local_only = [
                ("rootfs", req.rootfs.is_some()),
                ("mounts", !req.mounts.is_empty()),
                ("from_snapshot", req.from_snapshot.is_some()),
            ];
            if let Some((field, _)) = local_only.iter().find(|(_, given)| *given) {
                return Err(EnvdError::BadRequest(format!(
                    "`{field}` needs the local backend; on kubernetes a sandbox is a Pod: give `image` (a registry reference) and put what it needs into the image"
                )));
            }
        }
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
        let common = NewSandbox {
            id,
            limits,
            env,
            labels: req.labels,
            network,
            gateway_url,
            ttl,
            harness_files,
        };
        let sb = match &self.backend {
            Backend::Local(local) => {
                self.create_local(
                    local,
                    common,
                    req.image,
                    req.rootfs,
                    req.mounts,
                    req.from_snapshot,
                )
                .await?
            }
            Backend::Kubernetes(kube) => {
                let image = req
                    .image
                    .or_else(|| self.cfg.kubernetes.default_image.clone())
                    .ok_or_else(|| {
                        EnvdError::BadRequest(
                            "`image` is required on the kubernetes backend (a registry reference such as python:3.12-slim); or set [kubernetes] default_image".to_owned(),
                        )
                    })?;
                self.create_kube(kube, common, &image).await?
            }
        };
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
    fn reserve(&self, id: &str, snapshot: Option<&String>, exists: bool) -> Result<(), EnvdError> {
        let mut reg = lock(&self.sandboxes);
        if reg.live.contains_key(id) || reg.creating.contains_key(id) || exists {
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

    fn sandbox(
        &self,
        n: NewSandbox,
        place: Place,
        mounts: Vec<Mount>,
        snap: Option<String>,
    ) -> Arc<Sandbox> {
        Arc::new(Sandbox {
            id: n.id,
            place,
            limits: n.limits,
            env: n.env,
            labels: n.labels,
            mounts,
            from_snapshot: snap,
            network: n.network,
            gateway_url: n.gateway_url,
            created_at_ms: now_ms(),
            ttl: n.ttl,
            touched: Mutex::new((Instant::now(), now_ms())),
            jobs: Mutex::new(Jobs::default()),
            deleting: AtomicBool::new(false),
        })
    }

    async fn create_local(
        &self,
        backend: &LocalBackend,
        n: NewSandbox,
        image: Option<String>,
        rootfs: Option<String>,
        req_mounts: Vec<Mount>,
        from_snapshot: Option<String>,
    ) -> Result<Arc<Sandbox>, EnvdError> {
        let image_root = match &image {
            Some(image) => {
                let image = PathBuf::from(image);
                let cache = backend.data_dir().join("images");
                Some(
                    tokio::task::spawn_blocking(move || crate::image::rootfs(&image, &cache))
                        .await
                        .map_err(|e| {
                            EnvdError::Backend(format!("unpacking the image failed: {e}"))
                        })??,
                )
            }
            None => None,
        };
        let rootfs = match rootfs {
            Some(r) => {
                let p = PathBuf::from(&r);
                if !p.is_absolute() || !p.is_dir() {
                    return Err(EnvdError::BadRequest(format!(
                        "rootfs '{r}' is not an absolute path to a directory on the envd host"
                    )));
                }
                Some(p)
            }
            None => image_root,
        };
        let taken = crate::local::taken_root_names(rootfs.as_deref());
        let mut mounts = Vec::new();
        for m in &req_mounts {
            let src = PathBuf::from(&m.source);
            if !src.is_absolute() || !src.exists() {
                return Err(EnvdError::BadRequest(format!(
                    "mounts: source '{}' is not an absolute path that exists on the envd host",
                    m.source
                )));
            }
            let rel = m.target.strip_prefix('/').map(clean_path).transpose()?;
            let first = rel
                .as_ref()
                .and_then(|r| r.components().next())
                .map(|c| c.as_os_str().to_string_lossy().into_owned());
            match (&rel, first) {
                (Some(r), Some(f)) if !taken.contains(&f) => {
                    mounts.push((src, format!("/{}", r.display())));
                }
                _ => {
                    return Err(EnvdError::BadRequest(format!(
                        "mounts: target '{}' must be an absolute path outside /workspace, /tmp, /proc, /dev and the read-only root's own directories ({}); e.g. /mnt/tools",
                        m.target,
                        taken.join(", ")
                    )));
                }
            }
        }
        let mut paths = backend.paths(&n.id, rootfs, n.network == NetworkPolicy::Gateway);
        paths.mounts = mounts;
        if let Some(snap) = &from_snapshot {
            paths.lower = Some(self.snapshot_dir(snap).join("tree"));
        }
        self.reserve(&n.id, from_snapshot.as_ref(), paths.dir.exists())?;
        let mut forward = None;
        let created = async {
            forward = backend.create(&paths, &n.limits).await?;
            let owner = backend.owner.map(|(uid, gid)| Owner { uid, gid });
            let workspace = Workspace::open(&paths.workspace, owner)?;
            for (rel, body) in &n.harness_files {
                workspace.write(rel, body.as_bytes(), 0o644)?;
            }
            Ok::<_, EnvdError>(workspace)
        }
        .await;
        let workspace = match created {
            Ok(w) => w,
            Err(e) => {
                if let Some(f) = forward.take() {
                    f.abort();
                }
                let _ = backend.delete(&paths).await;
                lock(&self.sandboxes).creating.remove(&n.id);
                return Err(e);
            }
        };
        let place = Place::Local {
            paths,
            workspace,
            forward: Mutex::new(forward),
        };
        Ok(self.sandbox(n, place, req_mounts, from_snapshot))
    }

    async fn create_kube(
        &self,
        backend: &KubeBackend,
        mut n: NewSandbox,
        image: &str,
    ) -> Result<Arc<Sandbox>, EnvdError> {
        self.reserve(&n.id, None, false)?;
        let created = backend
            .create(crate::kubernetes::KubeCreate {
                id: &n.id,
                image,
                limits: &n.limits,
                network: n.network,
                ttl: n.ttl,
            })
            .await;
        let kube = match created {
            Ok(k) => k,
            Err(e) => {
                lock(&self.sandboxes).creating.remove(&n.id);
                return Err(e);
            }
        };
        // Harness files are written through the agent once the Pod is ready.
        let files = std::mem::take(&mut n.harness_files);
        let place = Place::Kube {
            sb: kube,
            pending_files: tokio::sync::Mutex::new(files),
        };
        Ok(self.sandbox(n, place, Vec::new(), None))
    }

    /// Waits until the sandbox can serve (a Pod: ready by the watch, its harness files
    /// written); returns the agent's endpoint on kubernetes, None for a local sandbox.
    pub async fn ready(
        &self,
        sb: &Sandbox,
        timeout: Option<Duration>,
    ) -> Result<Option<Endpoint>, EnvdError> {
        let (
            Backend::Kubernetes(kube),
            Place::Kube {
                sb: k,
                pending_files,
            },
        ) = (&self.backend, &sb.place)
        else {
            return Ok(None);
        };
        let timeout = timeout.unwrap_or(self.cfg.kubernetes.ready_timeout);
        let ip = kube.wait_ready(&sb.id, timeout).await?;
        let ep = Endpoint {
            sandbox: sb.id.clone(),
            ip,
            token: k.token.clone(),
        };
        let mut pending = pending_files.lock().await;
        while let Some((rel, body)) = pending.first() {
            kube.agent
                .write(
                    &ep,
                    &rel.display().to_string(),
                    Bytes::from(body.clone()),
                    0o644,
                )
                .await?;
            pending.remove(0);
        }
        Ok(Some(ep))
    }

    /// Lists a directory of the sandbox's workspace.
    pub async fn list_files(&self, sb: &Sandbox, rel: &Path) -> Result<Vec<DirEntry>, EnvdError> {
        match (&sb.place, self.ready(sb, None).await?) {
            (Place::Local { workspace, .. }, _) => workspace.list(rel),
            (Place::Kube { .. }, Some(ep)) => {
                self.kube()?
                    .agent
                    .list(&ep, &rel.display().to_string())
                    .await
            }
            (Place::Kube { .. }, None) => Err(not_kube()),
        }
    }

    pub async fn read_file(&self, sb: &Sandbox, rel: &Path) -> Result<Vec<u8>, EnvdError> {
        let max = self.cfg.max_file_bytes;
        match (&sb.place, self.ready(sb, None).await?) {
            (Place::Local { workspace, .. }, _) => workspace.read(rel, max),
            (Place::Kube { .. }, Some(ep)) => {
                let r = self
                    .kube()?
                    .agent
                    .read(&ep, &rel.display().to_string(), max)
                    .await;
                match r {
                    Err(EnvdError::Agent {
                        kind: "too_large", ..
                    }) => Err(EnvdError::TooLarge {
                        limit: max,
                        hint: "the file is larger than the files API's limit (--max-file-bytes); read it in parts with exec (e.g. `split`, `head -c`)",
                    }),
                    r => r,
                }
            }
            (Place::Kube { .. }, None) => Err(not_kube()),
        }
    }

    pub async fn write_file(
        &self,
        sb: &Sandbox,
        rel: &Path,
        data: Bytes,
        mode: u32,
    ) -> Result<u64, EnvdError> {
        match (&sb.place, self.ready(sb, None).await?) {
            (Place::Local { workspace, .. }, _) => workspace.write(rel, &data, mode),
            (Place::Kube { .. }, Some(ep)) => {
                self.kube()?
                    .agent
                    .write(&ep, &rel.display().to_string(), data, mode)
                    .await
            }
            (Place::Kube { .. }, None) => Err(not_kube()),
        }
    }

    pub async fn remove_file(
        &self,
        sb: &Sandbox,
        rel: &Path,
        recursive: bool,
    ) -> Result<(), EnvdError> {
        match (&sb.place, self.ready(sb, None).await?) {
            (Place::Local { workspace, .. }, _) => workspace.remove(rel, recursive),
            (Place::Kube { .. }, Some(ep)) => {
                self.kube()?
                    .agent
                    .remove(&ep, &rel.display().to_string(), recursive)
                    .await
            }
            (Place::Kube { .. }, None) => Err(not_kube()),
        }
    }

    fn kube(&self) -> Result<&KubeBackend, EnvdError> {
        match &self.backend {
            Backend::Kubernetes(k) => Ok(k),
            Backend::Local(_) => Err(not_kube()),
        }
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
        let r = match (&self.backend, &sb.place) {
            (Backend::Local(l), Place::Local { paths, forward, .. }) => {
                if let Some(f) = lock(forward).take() {
                    f.abort();
                }
                l.delete(paths).await
            }
            (Backend::Kubernetes(k), Place::Kube { sb: ks, .. }) => k.delete(ks).await,
            _ => Err(not_kube()),
        };
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
                // A Pod's agent checks the cwd itself (the job fails with a clear error).
                if let Place::Local { workspace, .. } = &sb.place
                    && !workspace.is_dir(&rel)?
                {
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
        match (&self.backend, &sb.place) {
            (Backend::Local(l), Place::Local { paths, .. }) => {
                l.run(paths, job, spec, base, events, kill).await
            }
            (Backend::Kubernetes(k), Place::Kube { .. }) => {
                let ep = match self.ready(sb, None).await {
                    Ok(Some(ep)) => ep,
                    Ok(None) => return failed_job(base, &not_kube()),
                    Err(e) => return failed_job(base, &e),
                };
                k.agent
                    .run(&ep, job, spec, self.cfg.kill_grace, base, events, kill)
                    .await
            }
            _ => failed_job(base, &not_kube()),
        }
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
        let Backend::Kubernetes(k) = &self.backend else {
            return Ok(0);
        };
        let known = || {
            let reg = lock(&self.sandboxes);
            reg.live
                .keys()
                .chain(reg.creating.keys())
                .cloned()
                .collect::<std::collections::HashSet<String>>()
        };
        k.reconcile(force, known).await
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

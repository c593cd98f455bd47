//! The Kubernetes backend: a Pod per sandbox.
//!
//! ```text
//! Pod graft-sbx-<id>   labels app.kubernetes.io/managed-by=graft-envd,
//!                             graft.dev/envd=<instance>, graft.dev/sandbox=<id>
//!   init container envd-agent-install (agent image): envd-agent install /.graft/bin/envd-agent
//!   container sandbox (the task's image, unmodified):
//!     /.graft/bin/envd-agent serve --listen 0.0.0.0:<agent_port> --workspace /workspace
//!         [--forward 127.0.0.1:<sandbox_gateway_port>=<gateway ip:port>]
//!     env GRAFT_ENVD_AGENT_TOKEN=<the sandbox's token>; requests = limits (cpu, memory)
//!   volumes: emptyDir graft-agent (/.graft/bin, read-only in the sandbox), emptyDir workspace
//! NetworkPolicy graft-sbx-<id>: ingress only from envd's Pods to the agent port; egress
//!   only to the gateway (network "gateway") or nothing (network "none")
//! ```
//!
//! The objects and their rules are in `pod.rs`, the watch in `pod_watch.rs`, the agent's
//! client in `agent_client.rs`; this file is the backend: create, readiness, exec and
//! files through the agent, delete, reconcile.
//!
//! Readiness comes from one LIST+WATCH of the Pods with this envd's labels
//! (`kube::runtime::watcher`, which lists again after a `410 Gone`); exec and files go to
//! the agent at the Pod IP over HTTP with the sandbox's token ([`agent_client`]).
//! The reaper lists the cluster every `reconcile_interval` and deletes Pods and
//! NetworkPolicies of this instance that no sandbox in the registry owns (left by an
//! earlier envd, or by a create that failed half-way).

pub mod agent_client;
mod pod;
mod pod_watch;

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use futures_util::future::BoxFuture;
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::networking::v1::NetworkPolicy as KubeNetworkPolicy;
use kube::api::{Api, DeleteParams, ListParams, PostParams};
use tokio::sync::{broadcast, watch};
use tracing::{info, warn};

use crate::backend::{KnownIds, SandboxBackend};
use crate::config::{EnvdConfig, KubeConfig};
use crate::error::EnvdError;
use crate::model::{
    CreateSandbox, DirEntry, ExecSpec, JobInfo, OutputEvent, SandboxSpec, SnapshotInfo,
};
use agent_client::{AgentClient, Endpoint};
pub use pod::{KubeCreate, PodState, check_id, pod_name};

pub const MANAGED_BY: &str = "app.kubernetes.io/managed-by";
pub const INSTANCE_LABEL: &str = "graft.dev/envd";
pub const SANDBOX_LABEL: &str = "graft.dev/sandbox";

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// A sandbox on the cluster: its Pod's name and the token its agent wants.
#[derive(Debug)]
pub struct KubeSandbox {
    pub id: String,
    pub pod: String,
    pub token: String,
}

pub struct KubeBackend {
    cfg: Arc<EnvdConfig>,
    pods: Api<Pod>,
    policies: Api<KubeNetworkPolicy>,
    namespace: String,
    selector: String,
    /// Sandbox id → what the watch last saw of its Pod.
    states: Arc<Mutex<HashMap<String, PodState>>>,
    /// Bumped on every change of `states`.
    changed: watch::Sender<u64>,
    /// Times the watch (re)listed the Pods.
    lists: Arc<std::sync::atomic::AtomicU64>,
    watcher: tokio::task::JoinHandle<()>,
    last_reconcile: tokio::sync::Mutex<Option<Instant>>,
    agent: AgentClient,
    /// Sandbox id → its Pod, its token and the harness files still to write.
    sandboxes: Mutex<HashMap<String, Arc<KubeEntry>>>,
}

/// What the backend keeps of one sandbox.
struct KubeEntry {
    sb: KubeSandbox,
    /// Harness files to write through the agent once the Pod is ready.
    pending_files: tokio::sync::Mutex<Vec<(PathBuf, String)>>,
}

impl Drop for KubeBackend {
    fn drop(&mut self) {
        self.watcher.abort();
    }
}

/// A `kube::Error` as envd's error, naming what was attempted.
pub fn kube_error(what: impl Into<String>, e: kube::Error) -> EnvdError {
    let what = what.into();
    match e {
        kube::Error::Api(s) => {
            let hint = if s.code == 403 {
                " (envd's service account lacks a permission; apply deploy/kubernetes/role.yaml)"
            } else {
                ""
            };
            EnvdError::Kube {
                what,
                code: Some(s.code),
                message: format!("{} ({}, {}){hint}", s.message, s.code, s.reason),
            }
        }
        other => EnvdError::Kube {
            what,
            code: None,
            message: format!("{other}; is the API server reachable?"),
        },
    }
}

fn is_code(e: &kube::Error, code: u16) -> bool {
    matches!(e, kube::Error::Api(s) if s.code == code)
}

impl KubeBackend {
    /// The backend over `client`; starts the Pod watch.
    pub fn new(cfg: Arc<EnvdConfig>, client: kube::Client) -> Self {
        let k = &cfg.kubernetes;
        let namespace = k
            .namespace
            .clone()
            .unwrap_or_else(|| client.default_namespace().to_owned());
        let selector = format!("{MANAGED_BY}=graft-envd,{INSTANCE_LABEL}={}", k.instance);
        let pods: Api<Pod> = Api::namespaced(client.clone(), &namespace);
        let policies: Api<KubeNetworkPolicy> = Api::namespaced(client, &namespace);
        let states = Arc::new(Mutex::new(HashMap::new()));
        let (changed, _) = watch::channel(0u64);
        let lists = Arc::new(std::sync::atomic::AtomicU64::new(0));
        let watcher = tokio::spawn(pod_watch::watch_pods(
            pods.clone(),
            selector.clone(),
            states.clone(),
            changed.clone(),
            lists.clone(),
        ));
        KubeBackend {
            agent: AgentClient::new(k.agent_port),
            sandboxes: Mutex::new(HashMap::new()),
            cfg,
            pods,
            policies,
            namespace,
            selector,
            states,
            changed,
            lists,
            watcher,
            last_reconcile: tokio::sync::Mutex::new(None),
        }
    }

    pub fn namespace(&self) -> &str {
        &self.namespace
    }

    /// How many times the watch has listed the Pods (1 at start, one more per re-list).
    pub fn lists(&self) -> u64 {
        self.lists.load(std::sync::atomic::Ordering::SeqCst)
    }

    fn kcfg(&self) -> &KubeConfig {
        &self.cfg.kubernetes
    }

    /// Creates the sandbox's NetworkPolicy, then its Pod (the policy first, so the Pod
    /// never runs without it). The Pod becomes ready later; [`Self::wait_ready`] waits.
    pub async fn create_pod(&self, c: KubeCreate<'_>) -> Result<KubeSandbox, EnvdError> {
        check_id(c.id)?;
        let token = format!(
            "{}{}",
            uuid::Uuid::new_v4().simple(),
            uuid::Uuid::new_v4().simple()
        );
        let name = pod_name(c.id);
        let np: KubeNetworkPolicy = serde_json::from_value(self.network_policy(c.id, c.network))
            .map_err(|e| EnvdError::Backend(format!("cannot build the NetworkPolicy: {e}")))?;
        let pod: Pod = serde_json::from_value(self.pod_spec(&c, &token))
            .map_err(|e| EnvdError::Backend(format!("cannot build the Pod: {e}")))?;
        lock(&self.states).insert(
            c.id.to_owned(),
            PodState {
                phase: "Pending".to_owned(),
                ..PodState::default()
            },
        );
        let pp = PostParams::default();
        let created = async {
            match self.policies.create(&pp, &np).await {
                Ok(_) => {}
                Err(e) if is_code(&e, 409) => {
                    return Err(EnvdError::SandboxExists(c.id.to_owned()));
                }
                Err(e) => {
                    return Err(kube_error(
                        format!(
                            "refused to create NetworkPolicy {name} in namespace {}",
                            self.namespace
                        ),
                        e,
                    ));
                }
            }
            match self.pods.create(&pp, &pod).await {
                Ok(_) => Ok(()),
                Err(e) if is_code(&e, 409) => Err(EnvdError::SandboxExists(c.id.to_owned())),
                Err(e) => Err(kube_error(
                    format!(
                        "refused to create Pod {name} in namespace {}",
                        self.namespace
                    ),
                    e,
                )),
            }
        }
        .await;
        if let Err(e) = created {
            lock(&self.states).remove(c.id);
            // Whatever was made is removed (a 409 means the objects are someone else's:
            // those stay, and the reaper removes them if no sandbox owns them).
            if !matches!(e, EnvdError::SandboxExists(_)) {
                let _ = self.delete_objects(&name).await;
            }
            return Err(e);
        }
        info!(sandbox = %c.id, pod = %name, namespace = %self.namespace, "sandbox Pod created");
        Ok(KubeSandbox {
            id: c.id.to_owned(),
            pod: name,
            token,
        })
    }

    async fn delete_objects(&self, name: &str) -> Result<(), EnvdError> {
        let dp = DeleteParams {
            grace_period_seconds: Some(1),
            ..DeleteParams::default()
        };
        let pod = match self.pods.delete(name, &dp).await {
            Ok(_) => Ok(()),
            Err(e) if is_code(&e, 404) => Ok(()),
            Err(e) => Err(kube_error(format!("refused to delete Pod {name}"), e)),
        };
        let np = match self.policies.delete(name, &DeleteParams::default()).await {
            Ok(_) => Ok(()),
            Err(e) if is_code(&e, 404) => Ok(()),
            Err(e) => Err(kube_error(
                format!("refused to delete NetworkPolicy {name}"),
                e,
            )),
        };
        pod.and(np)
    }

    /// Deletes the sandbox's Pod and NetworkPolicy (already gone is fine).
    async fn delete_sandbox(&self, id: &str) -> Result<(), EnvdError> {
        let entry = lock(&self.sandboxes)
            .remove(id)
            .ok_or_else(|| EnvdError::SandboxNotFound(id.to_owned()))?;
        let r = self.delete_objects(&entry.sb.pod).await;
        lock(&self.states).remove(id);
        r
    }

    /// Makes the sandbox's Pod from the task's image (or `[kubernetes] default_image`);
    /// its harness files are written through the agent once the Pod is ready.
    async fn create_sandbox(&self, spec: SandboxSpec) -> Result<(), EnvdError> {
        let image = spec
            .image
            .clone()
            .or_else(|| self.kcfg().default_image.clone())
            .ok_or_else(|| {
                EnvdError::BadRequest(
                    "`image` is required on the kubernetes backend (a registry reference such as python:3.12-slim); or set [kubernetes] default_image".to_owned(),
                )
            })?;
        let sb = self
            .create_pod(KubeCreate {
                id: &spec.id,
                image: &image,
                limits: &spec.limits,
                network: spec.network,
                ttl: spec.ttl,
            })
            .await?;
        let entry = KubeEntry {
            sb,
            pending_files: tokio::sync::Mutex::new(spec.files),
        };
        lock(&self.sandboxes).insert(spec.id, Arc::new(entry));
        Ok(())
    }

    fn entry(&self, id: &str) -> Result<Arc<KubeEntry>, EnvdError> {
        lock(&self.sandboxes)
            .get(id)
            .cloned()
            .ok_or_else(|| EnvdError::SandboxNotFound(id.to_owned()))
    }

    /// Waits until the sandbox's Pod is ready (`ready_timeout` when `timeout` is None),
    /// writes its pending harness files, and returns its agent's endpoint.
    pub async fn endpoint(
        &self,
        id: &str,
        timeout: Option<Duration>,
    ) -> Result<Endpoint, EnvdError> {
        let entry = self.entry(id)?;
        let timeout = timeout.unwrap_or(self.kcfg().ready_timeout);
        let ip = self.wait_ready(id, timeout).await?;
        let ep = Endpoint {
            sandbox: id.to_owned(),
            ip,
            token: entry.sb.token.clone(),
        };
        let mut pending = entry.pending_files.lock().await;
        while let Some((rel, body)) = pending.first() {
            self.agent
                .write(
                    &ep,
                    &rel.display().to_string(),
                    Bytes::from(body.clone()),
                    0o644,
                )
                .await?;
            pending.remove(0);
        }
        Ok(ep)
    }

    /// What the watch last saw of the sandbox's Pod.
    pub fn pod_state(&self, id: &str) -> PodState {
        lock(&self.states).get(id).cloned().unwrap_or_default()
    }

    /// Waits until the sandbox's Pod is Running and Ready (by the watch) and returns its
    /// IP; fails at once when the Pod failed or was deleted, and after `timeout`.
    pub async fn wait_ready(&self, id: &str, timeout: Duration) -> Result<String, EnvdError> {
        let mut rx = self.changed.subscribe();
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            let st = self.pod_state(id);
            if st.terminal() {
                return Err(EnvdError::SandboxUnavailable {
                    id: id.to_owned(),
                    reason: format!("{}; delete it and create a new one", st.describe()),
                });
            }
            if st.ready
                && let Some(ip) = st.ip
            {
                return Ok(ip);
            }
            if tokio::time::timeout_at(deadline, rx.changed())
                .await
                .is_err()
            {
                let seen = if st.phase.is_empty() {
                    "the watch has not seen its Pod yet".to_owned()
                } else {
                    st.describe()
                };
                return Err(EnvdError::SandboxUnavailable {
                    id: id.to_owned(),
                    reason: format!(
                        "not ready after {:.0?} ({seen}); wait longer with GET /sandboxes/{id}/wait?timeout_secs=N",
                        timeout
                    ),
                });
            }
        }
    }

    /// Deletes Pods and NetworkPolicies of this instance that no sandbox owns, at most
    /// once per `reconcile_interval` unless `force`. `known` is read after the cluster was
    /// listed, so a sandbox created meanwhile is never taken for a leftover.
    async fn reconcile_cluster(
        &self,
        force: bool,
        known: KnownIds<'_>,
    ) -> Result<usize, EnvdError> {
        let mut last = self.last_reconcile.lock().await;
        if !force && last.is_some_and(|t| t.elapsed() < self.kcfg().reconcile_interval) {
            return Ok(0);
        }
        *last = Some(Instant::now());
        let lp = ListParams::default().labels(&self.selector);
        let pods = self
            .pods
            .list(&lp)
            .await
            .map_err(|e| kube_error("refused to list sandbox Pods", e))?;
        let policies = self
            .policies
            .list(&lp)
            .await
            .map_err(|e| kube_error("refused to list sandbox NetworkPolicies", e))?;
        let known = known();
        lock(&self.states).retain(|id, _| known.contains(id));
        let owner = |labels: &Option<BTreeMap<String, String>>| {
            labels
                .as_ref()
                .and_then(|l| l.get(SANDBOX_LABEL))
                .cloned()
                .unwrap_or_default()
        };
        let mut leftovers: Vec<(String, String)> = Vec::new();
        for p in &pods.items {
            let id = owner(&p.metadata.labels);
            if !known.contains(&id)
                && let Some(n) = &p.metadata.name
            {
                leftovers.push((id, n.clone()));
            }
        }
        for np in &policies.items {
            let id = owner(&np.metadata.labels);
            if !known.contains(&id)
                && let Some(n) = &np.metadata.name
                && !leftovers.iter().any(|(_, m)| m == n)
            {
                leftovers.push((id, n.clone()));
            }
        }
        let mut n = 0;
        for (id, name) in leftovers {
            info!(sandbox = %id, object = %name, "deleting a sandbox no registry entry owns (left by an earlier envd or a failed create)");
            match self.delete_objects(&name).await {
                Ok(()) => n += 1,
                Err(e) => warn!(object = %name, error = %e, "could not delete a leftover"),
            }
        }
        Ok(n)
    }
}

impl SandboxBackend for KubeBackend {
    fn name(&self) -> &'static str {
        "kubernetes"
    }

    /// The kubelet enforces them (requests = limits; a pids limit is a node setting there,
    /// not a Pod's).
    fn limits_enforced(&self) -> bool {
        true
    }

    fn check_create(&self, id: &str, req: &CreateSandbox) -> Result<(), EnvdError> {
        check_id(id)?;
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
        Ok(())
    }

    fn create(&self, spec: SandboxSpec) -> BoxFuture<'_, Result<(), EnvdError>> {
        Box::pin(self.create_sandbox(spec))
    }

    fn ready<'a>(
        &'a self,
        id: &'a str,
        timeout: Option<Duration>,
    ) -> BoxFuture<'a, Result<(), EnvdError>> {
        Box::pin(async move { self.endpoint(id, timeout).await.map(|_| ()) })
    }

    fn state(&self, id: &str) -> &'static str {
        self.pod_state(id).api_state()
    }

    fn processes(&self, _id: &str) -> Option<u64> {
        None
    }

    /// The Pod's agent checks the cwd itself (the job fails with a clear error).
    fn cwd_exists(&self, _id: &str, _rel: &Path) -> Result<bool, EnvdError> {
        Ok(true)
    }

    fn exec<'a>(
        &'a self,
        id: &'a str,
        job: &'a str,
        spec: ExecSpec,
        base: JobInfo,
        events: broadcast::Sender<OutputEvent>,
        kill: watch::Receiver<bool>,
    ) -> BoxFuture<'a, JobInfo> {
        Box::pin(async move {
            let ep = match self.endpoint(id, None).await {
                Ok(ep) => ep,
                Err(e) => return base.failed(e.to_string()),
            };
            self.agent
                .run(&ep, job, spec, self.cfg.kill_grace, base, events, kill)
                .await
        })
    }

    fn list_files<'a>(
        &'a self,
        id: &'a str,
        rel: &'a Path,
    ) -> BoxFuture<'a, Result<Vec<DirEntry>, EnvdError>> {
        Box::pin(async move {
            let ep = self.endpoint(id, None).await?;
            self.agent.list(&ep, &rel.display().to_string()).await
        })
    }

    fn read_file<'a>(
        &'a self,
        id: &'a str,
        rel: &'a Path,
        max: usize,
    ) -> BoxFuture<'a, Result<Vec<u8>, EnvdError>> {
        Box::pin(async move {
            let ep = self.endpoint(id, None).await?;
            match self.agent.read(&ep, &rel.display().to_string(), max).await {
                Err(EnvdError::Agent {
                    kind: "too_large", ..
                }) => Err(EnvdError::TooLarge {
                    limit: max,
                    hint: "the file is larger than the files API's limit (--max-file-bytes); read it in parts with exec (e.g. `split`, `head -c`)",
                }),
                r => r,
            }
        })
    }

    fn write_file<'a>(
        &'a self,
        id: &'a str,
        rel: &'a Path,
        data: Bytes,
        mode: u32,
    ) -> BoxFuture<'a, Result<u64, EnvdError>> {
        Box::pin(async move {
            let ep = self.endpoint(id, None).await?;
            self.agent
                .write(&ep, &rel.display().to_string(), data, mode)
                .await
        })
    }

    fn remove_file<'a>(
        &'a self,
        id: &'a str,
        rel: &'a Path,
        recursive: bool,
    ) -> BoxFuture<'a, Result<(), EnvdError>> {
        Box::pin(async move {
            let ep = self.endpoint(id, None).await?;
            self.agent
                .remove(&ep, &rel.display().to_string(), recursive)
                .await
        })
    }

    fn delete<'a>(&'a self, id: &'a str) -> BoxFuture<'a, Result<(), EnvdError>> {
        Box::pin(self.delete_sandbox(id))
    }

    fn snapshot<'a>(
        &'a self,
        _id: &'a str,
        _snapshot: &'a str,
    ) -> BoxFuture<'a, Result<SnapshotInfo, EnvdError>> {
        Box::pin(async {
            Err(EnvdError::BadRequest(
                "snapshots need the local backend (a Pod's workspace is an emptyDir on its node)"
                    .to_owned(),
            ))
        })
    }

    fn reconcile<'a>(
        &'a self,
        force: bool,
        known: KnownIds<'a>,
    ) -> BoxFuture<'a, Result<usize, EnvdError>> {
        Box::pin(self.reconcile_cluster(force, known))
    }
}

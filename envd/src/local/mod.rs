//! The local [`SandboxBackend`]: a sandbox is a directory under the data dir with a private
//! writable workspace; every exec runs under bubblewrap in fresh PID, mount, IPC, UTS, user, cgroup
//! and network namespaces, inside the sandbox's cgroups, as an unprivileged host user.
//!
//! ```text
//! <data>/bin/envd-agent                 the agent, bind-mounted read-only at /.graft/envd-agent
//! <data>/sandboxes/<id>/workspace/      bind-mounted writable at /workspace
//! <data>/sandboxes/<id>/run/gateway.sock  host side of the gateway forward (/.graft/run)
//! ```
//!
//! One exec, from the host's side (`exec.rs`):
//! `sh` (as the sandbox user) writes its pid into the sandbox's and the job's
//! `cgroup.procs`, then execs `bwrap` → `envd-agent` (pid 1 inside, `--as-pid-1`: it
//! reaps orphans, opens the gateway forward, runs the command) → the command. The root is a read-only
//! view of the host's `/usr`, `/etc`, ... (or of a given rootfs), with private `/tmp`,
//! `/proc`, `/dev`. When the command ends, the agent (pid 1) exits and the kernel kills
//! whatever is left in the PID namespace; the outer bwrap reaps the agent and exits. On
//! timeout envd sends SIGTERM to the command's processes, waits the grace period, then
//! SIGKILLs the agent (the namespace goes with it; bwrap's process group after that if
//! bwrap lingers) and sweeps the job's cgroup until it is empty.

pub mod cgroup;
mod exec;
pub mod image;
pub mod snapshot;

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use futures_util::future::BoxFuture;
use tokio::sync::{broadcast, watch};
use tracing::{info, warn};

use crate::backend::SandboxBackend;
use crate::config::EnvdConfig;
use crate::error::{EnvdError, StartError};
use crate::files::{Owner, Workspace, clean_path};
use crate::model::{
    DirEntry, ExecSpec, JobInfo, Limits, NetworkPolicy, OutputEvent, SandboxSpec, SnapshotInfo,
    now_ms,
};
use cgroup::Cgroups;

/// Host top-level entries shown read-only inside a sandbox that has no rootfs of its own.
const HOST_VIEW: &[&str] = &[
    "usr", "bin", "sbin", "lib", "lib32", "lib64", "libx32", "etc", "opt",
];
/// Entries of a given rootfs that are replaced by the sandbox's own.
const ROOTFS_SKIP: &[&str] = &["proc", "sys", "dev", "tmp", "workspace", "run", ".graft"];

/// The parts of a sandbox the backend needs.
#[derive(Debug, Clone)]
pub struct SandboxPaths {
    pub id: String,
    pub dir: PathBuf,
    pub workspace: PathBuf,
    pub rootfs: Option<PathBuf>,
    pub forward: bool,
    /// Read-only binds: (host source, target inside).
    pub mounts: Vec<(PathBuf, String)>,
    /// A fork: the snapshot tree its workspace overlays.
    pub lower: Option<PathBuf>,
}

impl SandboxPaths {
    pub fn new(data_dir: &Path, id: &str, rootfs: Option<PathBuf>, forward: bool) -> Self {
        let dir = data_dir.join("sandboxes").join(id);
        SandboxPaths {
            id: id.to_owned(),
            workspace: dir.join("workspace"),
            dir,
            rootfs,
            forward,
            mounts: Vec::new(),
            lower: None,
        }
    }
}

/// Top-level names the sandbox's root already uses (a mount target must not be below one:
/// they are read-only, so bubblewrap could not create the mount point).
pub fn taken_root_names(rootfs: Option<&Path>) -> Vec<String> {
    let mut names: Vec<String> = ROOTFS_SKIP.iter().map(|s| s.to_string()).collect();
    match rootfs {
        Some(r) => names.extend(
            std::fs::read_dir(r)
                .map(|rd| {
                    rd.flatten()
                        .map(|e| e.file_name().to_string_lossy().into_owned())
                        .collect::<Vec<_>>()
                })
                .unwrap_or_default(),
        ),
        None => names.extend(HOST_VIEW.iter().map(|s| s.to_string())),
    }
    names
}

/// What the backend keeps of one sandbox.
struct LocalSandbox {
    paths: SandboxPaths,
    workspace: Workspace,
    /// The host side of the gateway forward, aborted on delete.
    forward: Option<tokio::task::JoinHandle<()>>,
}

pub struct LocalBackend {
    cfg: Arc<EnvdConfig>,
    sandboxes: Mutex<HashMap<String, Arc<LocalSandbox>>>,
    cgroups: Cgroups,
    agent: PathBuf,
    bwrap: PathBuf,
    /// (uid, gid) the sandboxed processes run as; `None` when envd is not root.
    owner: Option<(u32, u32)>,
    /// `<data>/envd.lock`, held (flock) while this envd runs.
    _lock: std::fs::File,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

fn set_mode(path: &Path, mode: u32) -> std::io::Result<()> {
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode))
}

fn which(prog: &Path) -> Option<PathBuf> {
    if prog.components().count() > 1 {
        return prog.is_file().then(|| prog.to_owned());
    }
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .map(|d| d.join(prog))
        .find(|p| p.is_file())
}

impl LocalBackend {
    /// Checks bubblewrap, prepares the data dir (traversable by the sandbox user, the agent
    /// copied in), detects cgroups and removes sandboxes an earlier run left behind.
    pub async fn new(cfg: Arc<EnvdConfig>) -> Result<Self, StartError> {
        let bwrap = which(&cfg.bwrap).ok_or_else(|| {
            StartError::Config(format!(
                "bubblewrap ('{}') was not found; install it (Debian/Ubuntu: apt-get install bubblewrap; scripts/setup-test-env.sh does) or pass --bwrap PATH",
                cfg.bwrap.display()
            ))
        })?;
        let is_root = rustix::process::geteuid().is_root();
        let owner = is_root.then_some((cfg.sandbox_uid, cfg.sandbox_gid));
        let data = &cfg.data_dir;
        let dd = |message: String| StartError::DataDir {
            dir: data.display().to_string(),
            message,
        };
        std::fs::create_dir_all(data.join("sandboxes"))
            .map_err(|e| dd(format!("cannot create it: {e}")))?;
        let data =
            std::fs::canonicalize(data).map_err(|e| dd(format!("cannot resolve it: {e}")))?;
        // One envd per data dir: a second one would take the first one's sandboxes for
        // leftovers of a crash and remove them.
        let lock_path = data.join("envd.lock");
        let lock = std::fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .read(true)
            .write(true)
            .open(&lock_path)
            .map_err(|e| dd(format!("cannot open {}: {e}", lock_path.display())))?;
        if rustix::fs::flock(&lock, rustix::fs::FlockOperation::NonBlockingLockExclusive).is_err() {
            let holder = std::fs::read_to_string(&lock_path).unwrap_or_default();
            return Err(dd(format!(
                "another envd (pid {}) is using it; stop that one or choose another --data-dir",
                holder.trim()
            )));
        }
        {
            use std::io::Write;
            let mut l = &lock;
            let _ = l.set_len(0);
            let _ = write!(l, "{}", std::process::id());
        }
        if is_root {
            // The sandbox user must be able to reach the workspace to bind-mount it: every
            // ancestor needs search permission for others.
            for dir in [data.clone(), data.join("sandboxes")] {
                set_mode(&dir, 0o711)
                    .map_err(|e| dd(format!("cannot chmod {}: {e}", dir.display())))?;
            }
            for anc in data.ancestors().skip(1) {
                use std::os::unix::fs::PermissionsExt;
                let mode = std::fs::metadata(anc)
                    .map(|m| m.permissions().mode())
                    .unwrap_or(0);
                if mode & 0o001 == 0 {
                    return Err(dd(format!(
                        "its ancestor {} (mode {:o}) is not searchable by the sandbox user {}; `chmod o+x {}` or choose a --data-dir below a searchable directory",
                        anc.display(),
                        mode & 0o7777,
                        cfg.sandbox_uid,
                        anc.display()
                    )));
                }
            }
        }
        // The agent binary lives in the data dir so the sandbox user can always read it.
        let bin = data.join("bin");
        std::fs::create_dir_all(&bin)
            .map_err(|e| dd(format!("cannot create {}: {e}", bin.display())))?;
        let agent = bin.join("envd-agent");
        let tmp = bin.join(format!(".envd-agent.{}", uuid::Uuid::new_v4().simple()));
        std::fs::hard_link(&cfg.agent.exe, &tmp)
            .or_else(|_| std::fs::copy(&cfg.agent.exe, &tmp).map(|_| ()))
            .and_then(|()| set_mode(&tmp, 0o755))
            .and_then(|()| std::fs::rename(&tmp, &agent))
            .map_err(|e| {
                let _ = std::fs::remove_file(&tmp);
                dd(format!(
                    "cannot put the agent {} at {}: {e}",
                    cfg.agent.exe.display(),
                    agent.display()
                ))
            })?;
        let cgroups = if is_root {
            Cgroups::detect(Path::new("/sys/fs/cgroup"), cgroup::group_for(&data))
        } else {
            Cgroups::None {
                why: "envd does not run as root".to_owned(),
            }
        };
        if let Cgroups::None { why } = &cgroups {
            warn!(%why, "no cgroup limits: sandboxes get no memory, pids or cpu limits");
        }
        let mut cfg2 = (*cfg).clone();
        cfg2.data_dir = data.clone();
        let backend = LocalBackend {
            cfg: Arc::new(cfg2),
            sandboxes: Mutex::new(HashMap::new()),
            cgroups,
            agent,
            bwrap,
            owner,
            _lock: lock,
        };
        backend.remove_leftovers().await;
        Ok(backend)
    }

    pub fn data_dir(&self) -> &Path {
        &self.cfg.data_dir
    }

    fn get(&self, id: &str) -> Result<Arc<LocalSandbox>, EnvdError> {
        lock(&self.sandboxes)
            .get(id)
            .cloned()
            .ok_or_else(|| EnvdError::SandboxNotFound(id.to_owned()))
    }

    fn snapshot_dir(&self, id: &str) -> PathBuf {
        self.cfg.data_dir.join("snapshots").join(id)
    }

    /// Makes a sandbox: its root (the host's view, a rootfs directory or an image
    /// flattened once), its read-only mounts, its workspace (a fork's an overlay of its
    /// snapshot) with the harness files in it, its cgroups and its gateway forward.
    async fn create_sandbox(&self, spec: SandboxSpec) -> Result<(), EnvdError> {
        let image_root = match &spec.image {
            Some(image) => {
                let image = PathBuf::from(image);
                let cache = self.data_dir().join("images");
                Some(
                    tokio::task::spawn_blocking(move || image::rootfs(&image, &cache))
                        .await
                        .map_err(|e| {
                            EnvdError::Backend(format!("unpacking the image failed: {e}"))
                        })??,
                )
            }
            None => None,
        };
        let rootfs = match &spec.rootfs {
            Some(r) => {
                let p = PathBuf::from(r);
                if !p.is_absolute() || !p.is_dir() {
                    return Err(EnvdError::BadRequest(format!(
                        "rootfs '{r}' is not an absolute path to a directory on the envd host"
                    )));
                }
                Some(p)
            }
            None => image_root,
        };
        let taken = taken_root_names(rootfs.as_deref());
        let mut mounts = Vec::new();
        for m in &spec.mounts {
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
        let mut paths = SandboxPaths::new(
            &self.cfg.data_dir,
            &spec.id,
            rootfs,
            spec.network == NetworkPolicy::Gateway,
        );
        paths.mounts = mounts;
        if let Some(snap) = &spec.from_snapshot {
            paths.lower = Some(self.snapshot_dir(snap).join("tree"));
        }
        // Not ours to remove: the service reserved the id, so this is a leftover.
        if paths.dir.exists() {
            return Err(EnvdError::SandboxExists(spec.id));
        }
        let mut forward = None;
        let created = async {
            forward = self.make(&paths, &spec.limits).await?;
            let owner = self.owner.map(|(uid, gid)| Owner { uid, gid });
            let workspace = Workspace::open(&paths.workspace, owner)?;
            for (rel, body) in &spec.files {
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
                let _ = self.remove(&paths).await;
                return Err(e);
            }
        };
        let sb = LocalSandbox {
            paths,
            workspace,
            forward,
        };
        lock(&self.sandboxes).insert(spec.id, Arc::new(sb));
        Ok(())
    }

    /// Ends the gateway forward and removes the sandbox (forgotten even when that fails).
    async fn delete_sandbox(&self, id: &str) -> Result<(), EnvdError> {
        let sb = lock(&self.sandboxes)
            .remove(id)
            .ok_or_else(|| EnvdError::SandboxNotFound(id.to_owned()))?;
        if let Some(f) = &sb.forward {
            f.abort();
        }
        self.remove(&sb.paths).await
    }

    /// Copies the sandbox's workspace into `<data>/snapshots/<snapshot>/tree` (through
    /// cap-std: a planted symlink never makes envd copy a host file) with its meta file.
    async fn take_snapshot(&self, id: &str, snapshot: &str) -> Result<SnapshotInfo, EnvdError> {
        let sb = self.get(id)?;
        let dir = self.snapshot_dir(snapshot);
        if dir.exists() {
            return Err(EnvdError::SnapshotExists(snapshot.to_owned()));
        }
        let parent = self.cfg.data_dir.join("snapshots");
        std::fs::create_dir_all(&parent)
            .map_err(|e| EnvdError::io(format!("cannot create {}", parent.display()), e))?;
        // create_dir, not _all: of two requests for one id, exactly one gets it.
        match std::fs::create_dir(&dir) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {
                return Err(EnvdError::SnapshotExists(snapshot.to_owned()));
            }
            Err(e) => {
                return Err(EnvdError::io(format!("cannot create {}", dir.display()), e));
            }
        }
        let copied = {
            let tree = dir.join("tree");
            let workspace = sb.paths.workspace.clone();
            let owner = self.owner;
            let r = tokio::task::spawn_blocking(move || {
                let d =
                    cap_std::fs::Dir::open_ambient_dir(&workspace, cap_std::ambient_authority())
                        .map_err(|e| EnvdError::io("cannot open the workspace", e))?;
                snapshot::copy_tree(&d, &tree, owner)
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
            snapshot_id: snapshot.to_owned(),
            source_sandbox: id.to_owned(),
            created_at_ms: now_ms(),
            files: copied.files,
            bytes: copied.bytes,
        };
        let meta = serde_json::to_vec_pretty(&info)
            .map_err(|e| EnvdError::Backend(format!("cannot encode the snapshot's meta: {e}")))?;
        std::fs::write(dir.join("meta.json"), meta)
            .map_err(|e| EnvdError::io(format!("cannot write {}", dir.display()), e))?;
        Ok(info)
    }

    /// Sandboxes of an earlier run cannot be resumed (their jobs died with it): kill what
    /// is left in their cgroups and remove their directories.
    async fn remove_leftovers(&self) {
        let mut ids = self.cgroups.leftovers();
        if let Ok(rd) = std::fs::read_dir(self.cfg.data_dir.join("sandboxes")) {
            ids.extend(
                rd.flatten()
                    .map(|e| e.file_name().to_string_lossy().into_owned()),
            );
        }
        ids.sort();
        ids.dedup();
        for id in ids {
            info!(sandbox = %id, "removing a sandbox left by an earlier run");
            if let Err(e) = self.cgroups.remove_sandbox(&id).await {
                warn!(sandbox = %id, error = %e, "could not remove its cgroups");
            }
            let dir = self.cfg.data_dir.join("sandboxes").join(&id);
            for m in snapshot::mounts_below(&dir) {
                snapshot::unmount(&m);
            }
            let _ = std::fs::remove_dir_all(dir);
        }
    }

    /// Creates the sandbox's directories and cgroups, and the host side of its gateway
    /// forward (returned as a task to abort on delete).
    async fn make(
        &self,
        p: &SandboxPaths,
        limits: &Limits,
    ) -> Result<Option<tokio::task::JoinHandle<()>>, EnvdError> {
        let io = |what: String| move |e| EnvdError::io(what, e);
        std::fs::create_dir(&p.dir).map_err(io(format!("cannot create {}", p.dir.display())))?;
        set_mode(&p.dir, 0o711).map_err(io(format!("cannot chmod {}", p.dir.display())))?;
        std::fs::create_dir(&p.workspace)
            .map_err(io(format!("cannot create {}", p.workspace.display())))?;
        // A fork writes into its own upper directory over the snapshot; the merged view is
        // mounted on `workspace`, so the files API and the sandbox both see it.
        let root = match &p.lower {
            Some(_) => p.dir.join("upper"),
            None => p.workspace.clone(),
        };
        if p.lower.is_some() {
            std::fs::create_dir(&root).map_err(io(format!("cannot create {}", root.display())))?;
            let work = p.dir.join("overlay-work");
            std::fs::create_dir(&work).map_err(io(format!("cannot create {}", work.display())))?;
        }
        set_mode(&root, 0o755).map_err(io(format!("cannot chmod {}", root.display())))?;
        if let Some((u, g)) = self.owner {
            std::os::unix::fs::chown(&root, Some(u), Some(g))
                .map_err(io(format!("cannot chown {}", root.display())))?;
        }
        if let Some(lower) = &p.lower {
            snapshot::mount_overlay(lower, &root, &p.dir.join("overlay-work"), &p.workspace)?;
        }
        self.cgroups
            .create_sandbox(&p.id, limits)
            .map_err(EnvdError::Backend)?;
        if !p.forward {
            return Ok(None);
        }
        let Some(gateway) = self.cfg.gateway else {
            return Ok(None);
        };
        let run = p.dir.join("run");
        std::fs::create_dir(&run).map_err(io(format!("cannot create {}", run.display())))?;
        set_mode(&run, 0o755).map_err(io(format!("cannot chmod {}", run.display())))?;
        let sock = run.join("gateway.sock");
        // A socket path must fit sun_path (108 bytes); a deep data dir does not. Bind through
        // /proc/self/fd/<the run dir>/, which names the same place in a few bytes.
        let run_fd =
            std::fs::File::open(&run).map_err(io(format!("cannot open {}", run.display())))?;
        let bind_at = if sock.as_os_str().len() < 100 {
            sock.clone()
        } else {
            use std::os::fd::AsRawFd as _;
            PathBuf::from(format!("/proc/self/fd/{}/gateway.sock", run_fd.as_raw_fd()))
        };
        let listener = tokio::net::UnixListener::bind(&bind_at)
            .map_err(io(format!("cannot listen on {}", sock.display())))?;
        drop(run_fd);
        set_mode(&sock, 0o666).map_err(io(format!("cannot chmod {}", sock.display())))?;
        let id = p.id.clone();
        Ok(Some(tokio::spawn(async move {
            loop {
                let Ok((mut inside, _)) = listener.accept().await else {
                    tokio::time::sleep(Duration::from_millis(20)).await;
                    continue;
                };
                let id = id.clone();
                tokio::spawn(async move {
                    match tokio::net::TcpStream::connect(gateway).await {
                        Ok(mut out) => {
                            let _ = tokio::io::copy_bidirectional(&mut inside, &mut out).await;
                        }
                        Err(e) => {
                            warn!(sandbox = %id, %gateway, error = %e, "the gateway is unreachable for the sandbox's forward");
                        }
                    }
                });
            }
        })))
    }

    /// Kills what is left and removes the sandbox's cgroups and directory.
    async fn remove(&self, p: &SandboxPaths) -> Result<(), EnvdError> {
        let cg = self.cgroups.remove_sandbox(&p.id).await;
        for m in snapshot::mounts_below(&p.dir) {
            snapshot::unmount(&m);
        }
        let dir = match std::fs::remove_dir_all(&p.dir) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(EnvdError::io(
                format!("cannot remove {}", p.dir.display()),
                e,
            )),
            _ => Ok(()),
        };
        cg.map_err(EnvdError::Backend)?;
        dir
    }
}

impl SandboxBackend for LocalBackend {
    fn name(&self) -> &'static str {
        "local"
    }

    fn limits_enforced(&self) -> bool {
        self.cgroups.enforced()
    }

    fn create(&self, spec: SandboxSpec) -> BoxFuture<'_, Result<(), EnvdError>> {
        Box::pin(self.create_sandbox(spec))
    }

    /// A local sandbox is ready once created.
    fn ready<'a>(
        &'a self,
        id: &'a str,
        _timeout: Option<Duration>,
    ) -> BoxFuture<'a, Result<(), EnvdError>> {
        Box::pin(async move { self.get(id).map(|_| ()) })
    }

    fn state(&self, _id: &str) -> &'static str {
        "ready"
    }

    fn processes(&self, id: &str) -> Option<u64> {
        self.cgroups.sandbox_processes(id)
    }

    fn cwd_exists(&self, id: &str, rel: &Path) -> Result<bool, EnvdError> {
        self.get(id)?.workspace.is_dir(rel)
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
            match self.get(id) {
                Ok(sb) => self.run(&sb.paths, job, spec, base, events, kill).await,
                Err(e) => base.failed(e.to_string()),
            }
        })
    }

    fn list_files<'a>(
        &'a self,
        id: &'a str,
        rel: &'a Path,
    ) -> BoxFuture<'a, Result<Vec<DirEntry>, EnvdError>> {
        Box::pin(async move { self.get(id)?.workspace.list(rel) })
    }

    fn read_file<'a>(
        &'a self,
        id: &'a str,
        rel: &'a Path,
        max: usize,
    ) -> BoxFuture<'a, Result<Vec<u8>, EnvdError>> {
        Box::pin(async move { self.get(id)?.workspace.read(rel, max) })
    }

    fn write_file<'a>(
        &'a self,
        id: &'a str,
        rel: &'a Path,
        data: Bytes,
        mode: u32,
    ) -> BoxFuture<'a, Result<u64, EnvdError>> {
        Box::pin(async move { self.get(id)?.workspace.write(rel, &data, mode) })
    }

    fn remove_file<'a>(
        &'a self,
        id: &'a str,
        rel: &'a Path,
        recursive: bool,
    ) -> BoxFuture<'a, Result<(), EnvdError>> {
        Box::pin(async move { self.get(id)?.workspace.remove(rel, recursive) })
    }

    fn delete<'a>(&'a self, id: &'a str) -> BoxFuture<'a, Result<(), EnvdError>> {
        Box::pin(self.delete_sandbox(id))
    }

    fn snapshot<'a>(
        &'a self,
        id: &'a str,
        snapshot: &'a str,
    ) -> BoxFuture<'a, Result<SnapshotInfo, EnvdError>> {
        Box::pin(self.take_snapshot(id, snapshot))
    }

    fn saved_snapshots(&self) -> Vec<SnapshotInfo> {
        let mut found = Vec::new();
        let Ok(rd) = std::fs::read_dir(self.cfg.data_dir.join("snapshots")) else {
            return found;
        };
        for e in rd.flatten() {
            let meta = e.path().join("meta.json");
            match std::fs::read(&meta)
                .ok()
                .and_then(|b| serde_json::from_slice::<SnapshotInfo>(&b).ok())
            {
                Some(m) => found.push(m),
                // A snapshot without its meta file was never finished.
                None => {
                    let _ = std::fs::remove_dir_all(e.path());
                }
            }
        }
        found
    }

    fn delete_snapshot(&self, snapshot: &str) -> Result<(), EnvdError> {
        let dir = self.snapshot_dir(snapshot);
        std::fs::remove_dir_all(&dir)
            .map_err(|e| EnvdError::io(format!("cannot remove {}", dir.display()), e))
    }

    fn shutdown(&self) {
        self.cgroups.remove_group();
    }
}

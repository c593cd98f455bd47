//! The local backend: a sandbox is a directory under the data dir with a private writable
//! workspace; every exec runs under bubblewrap in fresh PID, mount, IPC, UTS, user, cgroup
//! and network namespaces, inside the sandbox's cgroups, as an unprivileged host user.
//!
//! ```text
//! <data>/bin/envd-agent                 the agent, bind-mounted read-only at /.graft/envd-agent
//! <data>/sandboxes/<id>/workspace/      bind-mounted writable at /workspace
//! <data>/sandboxes/<id>/run/gateway.sock  host side of the gateway forward (/.graft/run)
//! ```
//!
//! One exec, from the host's side:
//! `sh` (as the sandbox user) writes its pid into the sandbox's and the job's
//! `cgroup.procs`, then execs `bwrap` → `envd-agent` (pid 1 inside, `--as-pid-1`: it
//! reaps orphans, opens the gateway forward, runs the command) → the command. The root is a read-only
//! view of the host's `/usr`, `/etc`, ... (or of a given rootfs), with private `/tmp`,
//! `/proc`, `/dev`. When the command ends, the agent (pid 1) exits and the kernel kills
//! whatever is left in the PID namespace; the outer bwrap reaps the agent and exits. On
//! timeout envd sends SIGTERM to the command's processes, waits the grace period, then
//! SIGKILLs the agent (the namespace goes with it; bwrap's process group after that if
//! bwrap lingers) and sweeps the job's cgroup until it is empty.

use std::collections::BTreeMap;
use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::sync::{broadcast, watch};
use tracing::{debug, info, warn};

use crate::cgroup::Cgroups;
use crate::config::EnvdConfig;
use crate::error::{EnvdError, StartError};
use crate::model::{JobInfo, Limits};

/// Where things appear inside a sandbox.
pub const WORKSPACE: &str = "/workspace";
const AGENT_IN: &str = "/.graft/envd-agent";
const RUN_IN: &str = "/.graft/run";
const PATH_IN: &str = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";

/// Writes the shell's own pid into each `cgroup.procs` given before `--`, then execs the
/// rest: joining happens before bubblewrap starts, so every process of the exec is inside.
const JOIN: &str =
    r#"while [ "$1" != -- ]; do echo $$ > "$1" || exit 125; shift; done; shift; exec "$@""#;

/// Host top-level entries shown read-only inside a sandbox that has no rootfs of its own.
const HOST_VIEW: &[&str] = &[
    "usr", "bin", "sbin", "lib", "lib32", "lib64", "libx32", "etc", "opt",
];
/// Entries of a given rootfs that are replaced by the sandbox's own.
const ROOTFS_SKIP: &[&str] = &["proc", "sys", "dev", "tmp", "workspace", "run", ".graft"];

/// Output of a running job, as it is produced (for streaming).
#[derive(Debug, Clone)]
pub enum OutputEvent {
    Stdout(Bytes),
    Stderr(Bytes),
}

/// What an exec runs, checked by the API layer.
#[derive(Debug, Clone)]
pub struct ExecSpec {
    pub argv: Vec<String>,
    /// Absolute path inside the sandbox.
    pub cwd: String,
    pub env: BTreeMap<String, String>,
    pub timeout: Duration,
    pub stdin: Option<Vec<u8>>,
    pub max_output_bytes: usize,
}

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

pub struct LocalBackend {
    cfg: Arc<EnvdConfig>,
    pub cgroups: Cgroups,
    agent: PathBuf,
    bwrap: PathBuf,
    /// (uid, gid) the sandboxed processes run as; `None` when envd is not root.
    pub owner: Option<(u32, u32)>,
    /// `<data>/envd.lock`, held (flock) while this envd runs.
    _lock: std::fs::File,
}

fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
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

/// Parent pid of a host process, from `/proc/<pid>/stat`.
fn ppid(pid: i32) -> Option<i32> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let rest = &s[s.rfind(')')? + 1..];
    rest.split_whitespace().nth(1)?.parse().ok()
}

fn signal(pid: i32, sig: rustix::process::Signal) {
    if let Some(p) = rustix::process::Pid::from_raw(pid) {
        let _ = rustix::process::kill_process(p, sig);
    }
}

fn signal_group(pgid: i32, sig: rustix::process::Signal) {
    if let Some(p) = rustix::process::Pid::from_raw(pgid) {
        let _ = rustix::process::kill_process_group(p, sig);
    }
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
            Cgroups::detect(Path::new("/sys/fs/cgroup"), crate::cgroup::group_for(&data))
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
            for m in crate::snapshot::mounts_below(&dir) {
                crate::snapshot::unmount(&m);
            }
            let _ = std::fs::remove_dir_all(dir);
        }
    }

    pub fn paths(&self, id: &str, rootfs: Option<PathBuf>, forward: bool) -> SandboxPaths {
        SandboxPaths::new(&self.cfg.data_dir, id, rootfs, forward)
    }

    /// Creates the sandbox's directories and cgroups, and the host side of its gateway
    /// forward (returned as a task to abort on delete).
    pub async fn create(
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
            crate::snapshot::mount_overlay(
                lower,
                &root,
                &p.dir.join("overlay-work"),
                &p.workspace,
            )?;
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
    pub async fn delete(&self, p: &SandboxPaths) -> Result<(), EnvdError> {
        let cg = self.cgroups.remove_sandbox(&p.id).await;
        for m in crate::snapshot::mounts_below(&p.dir) {
            crate::snapshot::unmount(&m);
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

    /// Processes alive in the sandbox now.
    pub fn processes(&self, id: &str) -> Option<u64> {
        self.cgroups.sandbox_processes(id)
    }

    fn bwrap_args(&self, p: &SandboxPaths, spec: &ExecSpec) -> Vec<OsString> {
        let mut a: Vec<OsString> = Vec::with_capacity(64);
        let mut push = |v: &[&str]| a.extend(v.iter().map(OsString::from));
        push(&[
            "--unshare-all",
            "--as-pid-1",
            "--die-with-parent",
            "--new-session",
            "--hostname",
            "sandbox",
        ]);
        let (root, names): (PathBuf, Vec<String>) = match &p.rootfs {
            Some(r) => (
                r.clone(),
                std::fs::read_dir(r)
                    .map(|rd| {
                        rd.flatten()
                            .map(|e| e.file_name().to_string_lossy().into_owned())
                            .filter(|n| !ROOTFS_SKIP.contains(&n.as_str()))
                            .collect()
                    })
                    .unwrap_or_default(),
            ),
            None => (
                PathBuf::from("/"),
                HOST_VIEW.iter().map(|s| s.to_string()).collect(),
            ),
        };
        for name in names {
            let src = root.join(&name);
            let dst = format!("/{name}");
            match std::fs::symlink_metadata(&src) {
                Ok(m) if m.file_type().is_symlink() => {
                    if let Ok(target) = std::fs::read_link(&src) {
                        a.push("--symlink".into());
                        a.push(target.into());
                        a.push(dst.into());
                    }
                }
                Ok(_) => {
                    a.push("--ro-bind".into());
                    a.push(src.into());
                    a.push(dst.into());
                }
                Err(_) => {}
            }
        }
        let mut push = |v: &[&str]| a.extend(v.iter().map(OsString::from));
        push(&["--proc", "/proc", "--dev", "/dev", "--tmpfs", "/tmp"]);
        a.push("--bind".into());
        a.push(p.workspace.clone().into());
        a.push(WORKSPACE.into());
        for (src, dst) in &p.mounts {
            a.push("--ro-bind".into());
            a.push(src.clone().into());
            a.push(dst.into());
        }
        a.push("--ro-bind".into());
        a.push(self.agent.clone().into());
        a.push(AGENT_IN.into());
        let forward = p.forward && self.cfg.gateway.is_some();
        if forward {
            a.push("--ro-bind".into());
            a.push(p.dir.join("run").into());
            a.push(RUN_IN.into());
        }
        a.push("--remount-ro".into());
        a.push("/".into());
        a.push("--chdir".into());
        a.push(spec.cwd.clone().into());
        a.push("--".into());
        a.push(AGENT_IN.into());
        a.extend(self.cfg.agent.args.iter().map(OsString::from));
        if forward {
            a.push("--forward".into());
            a.push(
                format!(
                    "127.0.0.1:{}={RUN_IN}/gateway.sock",
                    self.cfg.sandbox_gateway_port
                )
                .into(),
            );
        }
        a.push("--".into());
        a.extend(spec.argv.iter().map(OsString::from));
        a
    }

    /// Runs one exec to its end (or its timeout, or `kill`), streaming its output to
    /// `events`. Never fails: a failure to start is a job in state `failed`.
    #[allow(clippy::too_many_arguments)]
    pub async fn run(
        &self,
        p: &SandboxPaths,
        job_id: &str,
        spec: ExecSpec,
        base: JobInfo,
        events: broadcast::Sender<OutputEvent>,
        mut kill: watch::Receiver<bool>,
    ) -> JobInfo {
        let started = Instant::now();
        let mut info = base;
        let fail = |mut info: JobInfo, msg: String| {
            info.state = "failed";
            info.error = Some(msg);
            info.finished_at_ms = Some(now_ms());
            info.duration_ms = Some(started.elapsed().as_millis() as u64);
            info
        };
        let join = match self.cgroups.create_job(&p.id, job_id, self.owner) {
            Ok(j) => j,
            Err(e) => return fail(info, format!("cannot prepare the job's cgroup: {e}")),
        };
        let oom_before = self.cgroups.oom_kills(&p.id);
        let mut env: BTreeMap<String, String> = BTreeMap::new();
        env.insert("PATH".into(), PATH_IN.into());
        env.insert("HOME".into(), WORKSPACE.into());
        env.insert("LANG".into(), "C.UTF-8".into());
        env.insert("GRAFT_SANDBOX_ID".into(), p.id.clone());
        env.extend(spec.env.clone());
        let mut cmd = tokio::process::Command::new("/bin/sh");
        cmd.arg("-c")
            .arg(JOIN)
            .arg("envd-join")
            .args(&join)
            .arg("--")
            .arg(&self.bwrap)
            .args(self.bwrap_args(p, &spec))
            .env_clear()
            .envs(&env)
            .current_dir("/")
            .process_group(0)
            .kill_on_drop(true)
            .stdin(if spec.stdin.is_some() {
                Stdio::piped()
            } else {
                Stdio::null()
            })
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        if let Some((u, g)) = self.owner {
            cmd.uid(u).gid(g);
        }
        let mut child = match cmd.spawn() {
            Ok(c) => c,
            Err(e) => {
                let _ = self.cgroups.kill_job(&p.id, job_id).await;
                return fail(info, format!("cannot start bubblewrap: {e}"));
            }
        };
        let outer = child.id().map(|p| p as i32).unwrap_or(0);
        if let (Some(mut w), Some(data)) = (child.stdin.take(), spec.stdin.clone()) {
            tokio::spawn(async move {
                let _ = w.write_all(&data).await;
                let _ = w.shutdown().await;
            });
        }
        let cap = spec.max_output_bytes;
        let out = child
            .stdout
            .take()
            .map(|r| tokio::spawn(pump(r, cap, events.clone(), true)));
        let err = child
            .stderr
            .take()
            .map(|r| tokio::spawn(pump(r, cap, events.clone(), false)));
        drop(events);
        let mut timed_out = false;
        let mut killed = false;
        let status = tokio::select! {
            s = child.wait() => s.ok(),
            _ = tokio::time::sleep(spec.timeout) => { timed_out = true; None },
            _ = kill.wait_for(|k| *k) => { killed = true; None },
        };
        let status = match status {
            Some(s) => Some(s),
            None => {
                let grace = if killed {
                    Duration::ZERO
                } else {
                    self.cfg.kill_grace
                };
                self.terminate(&p.id, job_id, outer, grace, &mut child)
                    .await
            }
        };
        // Everything still in the job's cgroup (nothing, normally: the PID namespace died
        // with the agent) is killed before the job is reported finished.
        let swept = self.cgroups.kill_job(&p.id, job_id).await;
        let collect = |h: Option<tokio::task::JoinHandle<(Vec<u8>, u64)>>| async move {
            match h {
                Some(h) => tokio::time::timeout(Duration::from_secs(5), h)
                    .await
                    .ok()
                    .and_then(|r| r.ok())
                    .unwrap_or_default(),
                None => (Vec::new(), 0),
            }
        };
        let (stdout, stdout_total) = collect(out).await;
        let (stderr, stderr_total) = collect(err).await;
        let oom = self.cgroups.oom_kills(&p.id) > oom_before;
        info.exit_code = status.map(|s| {
            use std::os::unix::process::ExitStatusExt;
            match (s.code(), s.signal()) {
                (Some(c), _) => i64::from(c),
                (None, Some(sig)) => 128 + i64::from(sig),
                _ => -1,
            }
        });
        info.stdout_truncated = stdout_total > stdout.len() as u64;
        info.stderr_truncated = stderr_total > stderr.len() as u64;
        info.stdout = String::from_utf8_lossy(&stdout).into_owned();
        info.stderr = String::from_utf8_lossy(&stderr).into_owned();
        info.stdout_bytes = stdout_total;
        info.stderr_bytes = stderr_total;
        info.timed_out = timed_out;
        info.oom_killed = oom;
        info.state = if timed_out {
            "timed_out"
        } else if killed {
            "killed"
        } else {
            "exited"
        };
        // The join step (before bubblewrap) exits 125 when it cannot enter the cgroups;
        // that is envd's failure, not the command's.
        if info.exit_code == Some(125) && info.stderr.contains("cgroup.procs") {
            info.state = "failed";
            info.error = Some(format!(
                "could not put the job into the sandbox's cgroups: {}",
                info.stderr.trim()
            ));
        }
        match swept {
            Ok(0) => {}
            Ok(n) => {
                debug!(sandbox = %p.id, job = %job_id, n, "killed processes left after the job")
            }
            Err(e) => {
                warn!(sandbox = %p.id, job = %job_id, error = %e, "processes survived the job");
                info.error = Some(e);
            }
        }
        info.finished_at_ms = Some(now_ms());
        info.duration_ms = Some(started.elapsed().as_millis() as u64);
        info
    }

    /// SIGTERM to the command's processes (not bwrap, not the agent: the agent's death
    /// would end the PID namespace at once), `grace`, then SIGKILL to the agent, which
    /// takes the namespace and everything in it down.
    async fn terminate(
        &self,
        sb: &str,
        job: &str,
        outer: i32,
        grace: Duration,
        child: &mut tokio::process::Child,
    ) -> Option<std::process::ExitStatus> {
        if !grace.is_zero() && self.cgroups.enforced() {
            let pids = self.cgroups.job_pids(sb, job);
            let agent = pids.iter().copied().find(|&p| ppid(p) == Some(outer));
            for &pid in &pids {
                if pid != outer && Some(pid) != agent {
                    signal(pid, rustix::process::Signal::TERM);
                }
            }
            if let Ok(s) = tokio::time::timeout(grace, child.wait()).await {
                return s.ok();
            }
        }
        // SIGKILL the sandbox's pid 1 (the agent) first: the kernel kills the whole PID
        // namespace with it and the outer bwrap reaps it and exits (killing the outer one
        // first would leave the agent's zombie to the host's pid 1).
        if let Some(pid1) = child_of(outer) {
            signal(pid1, rustix::process::Signal::KILL);
            if let Ok(s) = tokio::time::timeout(Duration::from_secs(3), child.wait()).await {
                return s.ok();
            }
        }
        signal_group(outer, rustix::process::Signal::KILL);
        signal(outer, rustix::process::Signal::KILL);
        tokio::time::timeout(Duration::from_secs(10), child.wait())
            .await
            .ok()
            .and_then(|s| s.ok())
    }
}

/// A child of `parent` (the outer bwrap has exactly one: the sandbox's pid 1), from /proc.
fn child_of(parent: i32) -> Option<i32> {
    let children = std::fs::read_to_string(format!("/proc/{parent}/task/{parent}/children")).ok();
    if let Some(c) = children.and_then(|c| c.split_whitespace().next()?.parse().ok()) {
        return Some(c);
    }
    std::fs::read_dir("/proc").ok()?.flatten().find_map(|e| {
        let pid: i32 = e.file_name().to_str()?.parse().ok()?;
        (ppid(pid) == Some(parent)).then_some(pid)
    })
}

/// Reads a pipe to its end, keeping the first `cap` bytes (streamed as they come) and
/// counting the rest.
async fn pump(
    mut r: impl tokio::io::AsyncRead + Unpin,
    cap: usize,
    events: broadcast::Sender<OutputEvent>,
    stdout: bool,
) -> (Vec<u8>, u64) {
    let mut kept = Vec::new();
    let mut total: u64 = 0;
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        let n = match r.read(&mut buf).await {
            Ok(0) | Err(_) => break,
            Ok(n) => n,
        };
        total += n as u64;
        if kept.len() < cap {
            let take = n.min(cap - kept.len());
            kept.extend_from_slice(&buf[..take]);
            let chunk = Bytes::copy_from_slice(&buf[..take]);
            let _ = events.send(if stdout {
                OutputEvent::Stdout(chunk)
            } else {
                OutputEvent::Stderr(chunk)
            });
        }
    }
    (kept, total)
}

//! One exec of a local sandbox, from the host's side: `sh` (as the sandbox user) writes its
//! pid into the sandbox's and the job's `cgroup.procs`, then execs `bwrap` → `envd-agent`
//! (pid 1 inside, `--as-pid-1`) → the command; output pumped with a cap; timeout and kill
//! end the whole tree (see the module above for the life cycle).

use std::collections::BTreeMap;
use std::ffi::OsString;
use std::path::PathBuf;
use std::process::Stdio;
use std::time::{Duration, Instant};

use bytes::Bytes;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::sync::{broadcast, watch};
use tracing::{debug, warn};

use super::{HOST_VIEW, LocalBackend, ROOTFS_SKIP, SandboxPaths};
use crate::model::{ExecSpec, JobInfo, OutputEvent, WORKSPACE, now_ms};

const AGENT_IN: &str = "/.graft/envd-agent";
const RUN_IN: &str = "/.graft/run";
const PATH_IN: &str = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";

/// Writes the shell's own pid into each `cgroup.procs` given before `--`, then execs the
/// rest: joining happens before bubblewrap starts, so every process of the exec is inside.
const JOIN: &str =
    r#"while [ "$1" != -- ]; do echo $$ > "$1" || exit 125; shift; done; shift; exec "$@""#;

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
        // bwrap's `--die-with-parent` misses an envd killed before bwrap armed it; the agent
        // also watches its stdout pipe, which only envd reads.
        a.push("--die-with-envd".into());
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
    pub(super) async fn run(
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

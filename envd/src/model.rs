//! The backend-neutral types: the API's request and response bodies, and what the service
//! hands a [`crate::backend::SandboxBackend`] (a checked create, a checked exec, the output
//! of a running job).

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::Duration;

use bytes::Bytes;
use serde::{Deserialize, Serialize};

/// Where the workspace appears inside every sandbox (and its default working directory).
pub const WORKSPACE: &str = "/workspace";

pub(crate) fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

/// What a sandbox may reach on the network. Both deny every route out; `gateway` adds
/// graft's gateway as a loopback port inside the sandbox.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum NetworkPolicy {
    Gateway,
    None,
}

/// A gateway session the harness in the sandbox should record into (`POST /graft/sessions`
/// on the gateway returns it).
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GatewaySession {
    pub session_id: String,
    #[serde(default)]
    pub api_key: Option<String>,
    #[serde(default)]
    pub model: Option<String>,
    /// A harness from `harness-configs/` (`codex`, `mini-swe-agent`, ...): its variables are
    /// set and its config files written into the workspace, pointed at this session.
    #[serde(default)]
    pub harness: Option<String>,
}

/// A host path shown read-only inside the sandbox (a toolchain, a harness, a dataset).
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Mount {
    /// Absolute path on the envd host (the sandbox user must be able to reach it).
    pub source: String,
    /// Absolute path inside the sandbox, outside the read-only root's own directories
    /// (e.g. `/mnt/tools`, `/toolchain`).
    pub target: String,
}

/// `POST /sandboxes` (also what a client such as `graft rl` sends).
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CreateSandbox {
    /// Caller-chosen id (`[A-Za-z0-9_-]`, at most 64); a UUID when left out.
    #[serde(default)]
    pub id: Option<String>,
    /// Container image: for the local backend, an absolute path to a `docker save` tarball
    /// (or its unpacked directory) on the envd host; flattened once and reused.
    #[serde(default)]
    pub image: Option<String>,
    /// A root filesystem directory on the envd host; the host's read-only view when left out.
    #[serde(default)]
    pub rootfs: Option<String>,
    #[serde(default)]
    pub cpus: Option<f64>,
    #[serde(default)]
    pub memory_mb: Option<u64>,
    #[serde(default)]
    pub pids: Option<u64>,
    /// Idle time to live: the sandbox is deleted when no request touched it for this long.
    #[serde(default)]
    pub ttl_secs: Option<u64>,
    #[serde(default)]
    pub env: BTreeMap<String, String>,
    #[serde(default)]
    pub network: Option<NetworkPolicy>,
    #[serde(default)]
    pub labels: BTreeMap<String, String>,
    #[serde(default)]
    pub gateway_session: Option<GatewaySession>,
    /// Read-only bind mounts of host paths.
    #[serde(default)]
    pub mounts: Vec<Mount>,
    /// Start from a snapshot: the workspace is a copy-on-write overlay of it.
    #[serde(default)]
    pub from_snapshot: Option<String>,
}

/// `POST /sandboxes/{id}/snapshot`
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CreateSnapshot {
    #[serde(default)]
    pub id: Option<String>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct SnapshotInfo {
    pub snapshot_id: String,
    pub source_sandbox: String,
    pub created_at_ms: u64,
    pub files: u64,
    pub bytes: u64,
}

#[derive(Debug, Clone, Serialize)]
pub struct Limits {
    pub cpus: f64,
    pub memory_mb: u64,
    pub pids: u64,
}

#[derive(Debug, Clone, Serialize)]
pub struct SandboxInfo {
    pub id: String,
    pub state: &'static str,
    pub backend: &'static str,
    pub created_at_ms: u64,
    pub expires_at_ms: u64,
    pub ttl_secs: u64,
    pub limits: Limits,
    /// Whether the host enforces the limits (cgroups available).
    pub limits_enforced: bool,
    pub network: NetworkPolicy,
    /// The gateway as the sandbox sees it (`http://127.0.0.1:PORT`), when reachable.
    pub gateway_url: Option<String>,
    pub workspace: &'static str,
    pub env: BTreeMap<String, String>,
    pub labels: BTreeMap<String, String>,
    pub mounts: Vec<Mount>,
    pub from_snapshot: Option<String>,
    /// Tasks (processes and their threads) alive in the sandbox now, from its pids cgroup
    /// (null without cgroups).
    pub processes: Option<u64>,
    pub jobs_running: usize,
}

/// `POST /sandboxes/{id}/exec`
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct ExecRequest {
    /// A shell command line, run with `/bin/sh -c`.
    #[serde(default)]
    pub command: Option<String>,
    /// Or an argv, run as is.
    #[serde(default)]
    pub argv: Option<Vec<String>>,
    /// Working directory: relative to /workspace, or absolute inside the sandbox.
    #[serde(default)]
    pub cwd: Option<String>,
    #[serde(default)]
    pub env: BTreeMap<String, String>,
    #[serde(default)]
    pub timeout_secs: Option<f64>,
    /// Bytes written to the command's stdin (UTF-8 text).
    #[serde(default)]
    pub stdin: Option<String>,
    /// Cap on the stdout and on the stderr kept (each), at most the server's cap.
    #[serde(default)]
    pub max_output_bytes: Option<usize>,
    /// Run as a job: answer 202 with the job id at once.
    #[serde(default)]
    pub background: bool,
    /// Stream the output as Server-Sent Events (also chosen by `Accept: text/event-stream`).
    #[serde(default)]
    pub stream: bool,
    /// A retried request with the same key returns the first request's job, never runs twice
    /// (also accepted as the `Idempotency-Key` header).
    #[serde(default)]
    pub idempotency_key: Option<String>,
}

/// A job's state and, once finished, its result.
#[derive(Debug, Clone, Serialize)]
pub struct JobInfo {
    pub job_id: String,
    pub sandbox_id: String,
    /// `running`, `exited`, `timed_out`, `killed` (sandbox deleted or job killed), `failed`
    /// (could not start).
    pub state: &'static str,
    pub exit_code: Option<i64>,
    pub stdout: String,
    pub stderr: String,
    pub stdout_bytes: u64,
    pub stderr_bytes: u64,
    pub stdout_truncated: bool,
    pub stderr_truncated: bool,
    pub max_output_bytes: usize,
    pub timed_out: bool,
    /// The kernel's OOM killer killed a process of this sandbox while the job ran.
    pub oom_killed: bool,
    /// Why the job could not start, or what went wrong while ending it.
    pub error: Option<String>,
    pub started_at_ms: u64,
    pub finished_at_ms: Option<u64>,
    pub duration_ms: Option<u64>,
    pub idempotency_key: Option<String>,
}

impl JobInfo {
    /// This job as one that could not start (or could not reach its sandbox).
    pub fn failed(mut self, error: String) -> JobInfo {
        let now = now_ms();
        self.state = "failed";
        self.error = Some(error);
        self.finished_at_ms = Some(now);
        self.duration_ms = Some(now.saturating_sub(self.started_at_ms));
        self
    }
}

/// A create the service has checked (id, limits, TTL, network, harness files), for a
/// backend to make. The backend-specific fields (`image`, `rootfs`, `mounts`,
/// `from_snapshot`) are the request's, for the backend to check and use or refuse. Not
/// `Debug`: the harness files carry the session's key.
#[derive(Clone)]
pub struct SandboxSpec {
    pub id: String,
    pub limits: Limits,
    pub network: NetworkPolicy,
    pub ttl: Duration,
    pub image: Option<String>,
    pub rootfs: Option<String>,
    pub mounts: Vec<Mount>,
    pub from_snapshot: Option<String>,
    /// Harness config files (workspace-relative, already cleaned) to be in the workspace
    /// before the first exec.
    pub files: Vec<(PathBuf, String)>,
}

/// What an exec runs, checked by the service.
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

/// Output of a running job, as it is produced (for streaming).
#[derive(Debug, Clone)]
pub enum OutputEvent {
    Stdout(Bytes),
    Stderr(Bytes),
}

/// `GET /sandboxes/{id}/files?dir=` entries.
#[derive(Debug, Clone, Serialize)]
pub struct DirEntry {
    pub name: String,
    /// `file`, `dir`, `symlink`, `other`
    #[serde(rename = "type")]
    pub kind: &'static str,
    pub size: u64,
    pub mode: u32,
}

/// `POST /sandboxes/{id}/apply_patch`
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ApplyPatch {
    pub patch: String,
    /// Directory to apply in, relative to /workspace.
    #[serde(default)]
    pub cwd: Option<String>,
    /// Only check that it applies (`git apply --check`).
    #[serde(default)]
    pub check: bool,
}

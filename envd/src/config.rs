//! envd's runtime configuration (the CLI fills it from flags and environment).

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

/// What a harness needs to be pointed at a gateway session from inside a sandbox.
#[derive(Debug, Clone)]
pub struct HarnessRequest {
    pub harness: String,
    /// The session's base URL as the sandbox sees it (`http://127.0.0.1:PORT/s/<id>/v1`).
    pub base_url: String,
    pub api_key: String,
    pub model: String,
}

/// A harness's variables and config files (paths relative to the workspace), filled.
#[derive(Debug, Clone, Default)]
pub struct RenderedHarness {
    pub env: Vec<(String, String)>,
    pub files: Vec<(String, String)>,
}

type RenderFn = dyn Fn(&HarnessRequest) -> Result<RenderedHarness, String> + Send + Sync;

/// Fills a harness's templates. envd knows no harness: the CLI wires this to the
/// repository's `harness-configs/`.
#[derive(Clone)]
pub struct HarnessRenderer(pub Arc<RenderFn>);

impl std::fmt::Debug for HarnessRenderer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("HarnessRenderer")
    }
}

/// How to start the in-sandbox agent: an executable on the host (bind-mounted read-only
/// into every sandbox) and the arguments that select the agent mode (`["envd", "agent"]`
/// for the `graft` binary, none for the standalone `envd-agent`).
#[derive(Debug, Clone)]
pub struct AgentCommand {
    pub exe: PathBuf,
    pub args: Vec<String>,
}

/// Limits a sandbox gets when its create request names none.
#[derive(Debug, Clone, Copy)]
pub struct DefaultLimits {
    pub memory_mb: u64,
    pub pids: u64,
    pub cpus: f64,
}

#[derive(Debug, Clone)]
pub struct EnvdConfig {
    pub listen: SocketAddr,
    pub data_dir: PathBuf,
    /// The key every request but `/healthz` and `/openapi.json` must send in `X-API-Key`.
    pub api_key: String,
    /// graft's gateway (`host:port`); sandboxes with network policy `gateway` reach it as
    /// `127.0.0.1:{sandbox_gateway_port}` inside. `None`: no sandbox can reach it.
    pub gateway: Option<SocketAddr>,
    pub sandbox_gateway_port: u16,
    /// Host uid/gid the sandboxed processes run as (when envd runs as root).
    pub sandbox_uid: u32,
    pub sandbox_gid: u32,
    pub bwrap: PathBuf,
    pub agent: AgentCommand,
    pub defaults: DefaultLimits,
    pub default_ttl: Duration,
    pub max_ttl: Duration,
    pub reap_interval: Duration,
    /// Largest file the files API accepts (and the largest request body).
    pub max_file_bytes: usize,
    /// Default (and largest) stdout/stderr kept per exec, each.
    pub max_output_bytes: usize,
    pub default_exec_timeout: Duration,
    pub max_exec_timeout: Duration,
    /// Time between SIGTERM and SIGKILL when an exec times out.
    pub kill_grace: Duration,
    /// Fills `gateway_session.harness` on create; `None`: naming a harness is an error.
    pub harnesses: Option<HarnessRenderer>,
}

impl EnvdConfig {
    /// A config with the defaults, for `listen`, `data_dir`, `api_key` and the agent.
    pub fn new(
        listen: SocketAddr,
        data_dir: PathBuf,
        api_key: String,
        agent: AgentCommand,
    ) -> Self {
        EnvdConfig {
            listen,
            data_dir,
            api_key,
            gateway: None,
            sandbox_gateway_port: 4000,
            sandbox_uid: 100_000,
            sandbox_gid: 100_000,
            bwrap: PathBuf::from("bwrap"),
            agent,
            defaults: DefaultLimits {
                memory_mb: 2048,
                pids: 512,
                cpus: 1.0,
            },
            default_ttl: Duration::from_secs(600),
            max_ttl: Duration::from_secs(24 * 3600),
            reap_interval: Duration::from_secs(1),
            max_file_bytes: 64 << 20,
            max_output_bytes: 1 << 20,
            default_exec_timeout: Duration::from_secs(600),
            max_exec_timeout: Duration::from_secs(24 * 3600),
            kill_grace: Duration::from_secs(2),
            harnesses: None,
        }
    }
}

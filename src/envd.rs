//! `graft envd`: the sandbox service (`graft-envd`), and `graft envd agent`, the
//! in-sandbox agent envd runs as the first process of every exec.

use std::io::Write;
use std::net::{SocketAddr, ToSocketAddrs};
use std::path::PathBuf;
use std::time::Duration;

use anyhow::{Context, bail};
use graft_envd::{
    AgentCommand, DefaultLimits, Envd, EnvdConfig, HarnessRenderer, HarnessRequest, RenderedHarness,
};

#[derive(Debug, clap::Args)]
#[command(args_conflicts_with_subcommands = true)]
pub struct EnvdArgs {
    #[command(subcommand)]
    pub command: Option<EnvdCommand>,
    #[command(flatten)]
    pub serve: ServeArgs,
}

#[derive(Debug, clap::Subcommand)]
pub enum EnvdCommand {
    /// The in-sandbox agent (envd starts it inside every sandbox): `agent [--forward
    /// 127.0.0.1:PORT=SOCKET] -- PROGRAM [ARGS...]`.
    #[command(hide = true)]
    Agent {
        #[arg(long)]
        forward: Option<String>,
        #[arg(last = true, required = true)]
        argv: Vec<String>,
    },
}

#[derive(Debug, Clone, Copy, clap::ValueEnum)]
pub enum Backend {
    Local,
    Kubernetes,
}

#[derive(Debug, clap::Args)]
pub struct ServeArgs {
    /// Address to listen on (port 0 picks a free port; the real address is printed).
    #[arg(long, default_value = "127.0.0.1:7070")]
    pub listen: SocketAddr,
    #[arg(long, value_enum, default_value = "local")]
    pub backend: Backend,
    /// Where sandboxes live (each one's workspace is a directory below it).
    #[arg(long, default_value = "graft-envd-data")]
    pub data_dir: PathBuf,
    /// The key clients send in X-API-Key.
    #[arg(long, env = "GRAFT_ENVD_API_KEY", hide_env_values = true)]
    pub api_key: Option<String>,
    /// graft's gateway (HOST:PORT or http://HOST:PORT): sandboxes reach it, and nothing
    /// else, on their loopback at --sandbox-gateway-port.
    #[arg(long)]
    pub gateway: Option<String>,
    #[arg(long, default_value_t = 4000)]
    pub sandbox_gateway_port: u16,
    /// Host uid (and gid) sandboxed processes run as when envd runs as root.
    #[arg(long, default_value_t = 100_000)]
    pub sandbox_uid: u32,
    #[arg(long)]
    pub sandbox_gid: Option<u32>,
    /// bubblewrap executable.
    #[arg(long, default_value = "bwrap")]
    pub bwrap: PathBuf,
    /// The agent binary run inside sandboxes (default: `envd-agent` next to this binary,
    /// else this binary's `envd agent`).
    #[arg(long)]
    pub agent: Option<PathBuf>,
    /// Defaults for sandboxes whose create request names no limits.
    #[arg(long, default_value_t = 2048)]
    pub memory_mb: u64,
    #[arg(long, default_value_t = 512)]
    pub pids: u64,
    #[arg(long, default_value_t = 1.0)]
    pub cpus: f64,
    /// Idle TTL of a sandbox whose create request names none.
    #[arg(long, default_value_t = 600)]
    pub default_ttl_secs: u64,
    /// How often expired sandboxes are looked for.
    #[arg(long, default_value_t = 1000)]
    pub reap_interval_ms: u64,
    /// Largest file the files API moves.
    #[arg(long, default_value_t = 64 << 20)]
    pub max_file_bytes: usize,
    /// Largest stdout (and stderr) kept per exec.
    #[arg(long, default_value_t = 1 << 20)]
    pub max_output_bytes: usize,
    /// Seconds between SIGTERM and SIGKILL when an exec times out.
    #[arg(long, default_value_t = 2.0)]
    pub kill_grace_secs: f64,
}

fn gateway_addr(s: &str) -> anyhow::Result<SocketAddr> {
    let hostport = s
        .strip_prefix("http://")
        .unwrap_or(s)
        .split('/')
        .next()
        .unwrap_or_default();
    if s.starts_with("https://") {
        bail!("--gateway {s}: envd forwards plain TCP to the gateway; give its http:// address");
    }
    hostport
        .to_socket_addrs()
        .with_context(|| format!("--gateway {s}: expected HOST:PORT or http://HOST:PORT"))?
        .next()
        .with_context(|| format!("--gateway {s}: the name resolves to no address"))
}

/// Where a harness config file goes in the workspace (`harness-configs/` names it for a
/// person: `$CODEX_HOME/config.toml`, `~/.zeroclaw/config.toml`, `graft.yaml (mini -c ...)`),
/// and a variable it needs.
fn workspace_path(path: &str) -> (String, Option<(String, String)>) {
    if let Some(rest) = path.strip_prefix("$CODEX_HOME/") {
        return (
            format!(".codex/{rest}"),
            Some(("CODEX_HOME".to_owned(), "/workspace/.codex".to_owned())),
        );
    }
    let p = path
        .strip_prefix("~/")
        .or_else(|| path.strip_prefix("<repo root>/"))
        .unwrap_or(path);
    (p.split_whitespace().next().unwrap_or(p).to_owned(), None)
}

/// Fills a harness from `harness-configs/` for a sandbox (HOME is the workspace there).
fn render_harness(r: &HarnessRequest) -> Result<RenderedHarness, String> {
    use crate::harness;
    let h = harness::find(&r.harness).map_err(|e| format!("{e:#}"))?;
    let v =
        harness::Values::new(&r.base_url, &r.api_key, &r.model).map_err(|e| format!("{e:#}"))?;
    let mut env = harness::env_vars(h, &v).map_err(|e| format!("{e:#}"))?;
    let mut files = Vec::new();
    for f in h.files {
        let (rel, var) = workspace_path(f.path);
        files.push((
            rel,
            harness::render(f.template, &v).map_err(|e| format!("{e:#}"))?,
        ));
        env.extend(var);
    }
    Ok(RenderedHarness { env, files })
}

pub async fn run(args: EnvdArgs) -> anyhow::Result<()> {
    if let Some(EnvdCommand::Agent { forward, argv }) = args.command {
        let mut a = Vec::new();
        if let Some(f) = forward {
            a.push("--forward".to_owned());
            a.push(f);
        }
        a.push("--".to_owned());
        a.extend(argv);
        std::process::exit(graft_envd::agent::main_with(&a));
    }
    let s = args.serve;
    if let Backend::Kubernetes = s.backend {
        bail!(
            "--backend kubernetes is not built yet (issue 6); use --backend local on one machine"
        );
    }
    let Some(api_key) = s.api_key.filter(|k| !k.is_empty()) else {
        bail!(
            "no API key: pass --api-key KEY or set GRAFT_ENVD_API_KEY (clients send it in X-API-Key)"
        );
    };
    let agent = match s.agent {
        Some(exe) => AgentCommand { exe, args: vec![] },
        None => {
            let me = std::env::current_exe().context("cannot find this binary")?;
            let sibling = me.with_file_name("envd-agent");
            if sibling.is_file() {
                AgentCommand {
                    exe: sibling,
                    args: vec![],
                }
            } else {
                AgentCommand {
                    exe: me,
                    args: vec!["envd".to_owned(), "agent".to_owned()],
                }
            }
        }
    };
    let mut cfg = EnvdConfig::new(s.listen, s.data_dir, api_key, agent);
    cfg.gateway = s.gateway.as_deref().map(gateway_addr).transpose()?;
    cfg.sandbox_gateway_port = s.sandbox_gateway_port;
    cfg.sandbox_uid = s.sandbox_uid;
    cfg.sandbox_gid = s.sandbox_gid.unwrap_or(s.sandbox_uid);
    cfg.bwrap = s.bwrap;
    cfg.defaults = DefaultLimits {
        memory_mb: s.memory_mb,
        pids: s.pids,
        cpus: s.cpus,
    };
    cfg.default_ttl = Duration::from_secs(s.default_ttl_secs);
    cfg.reap_interval = Duration::from_millis(s.reap_interval_ms.max(10));
    cfg.max_file_bytes = s.max_file_bytes;
    cfg.max_output_bytes = s.max_output_bytes;
    if !(s.kill_grace_secs >= 0.0 && s.kill_grace_secs <= 600.0) {
        bail!(
            "--kill-grace-secs {}: give 0 to 600 seconds",
            s.kill_grace_secs
        );
    }
    cfg.kill_grace = Duration::from_secs_f64(s.kill_grace_secs);
    cfg.harnesses = Some(HarnessRenderer(std::sync::Arc::new(render_harness)));
    let gateway = cfg.gateway;
    let envd = Envd::bind(cfg).await.context("envd could not start")?;
    tracing::info!(
        ?gateway,
        limits_enforced = envd.limits_enforced(),
        "envd ready"
    );
    {
        let mut out = std::io::stdout().lock();
        writeln!(out, "graft envd listening on {}", envd.url())?;
        out.flush()?;
    }
    envd.serve(crate::cli::shutdown_signal()).await;
    Ok(())
}

//! `graft envd`: the sandbox service (`graft-envd`), and `graft envd agent`, the
//! in-sandbox agent envd runs as the first process of every exec.

use std::io::Write;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::{Context, bail};
use graft_envd::config::{FileConfig, parse_gateway};
use graft_envd::{
    AgentCommand, Envd, EnvdConfig, HarnessRenderer, HarnessRequest, RenderedHarness,
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
    /// envd.toml with every setting (strict: unknown keys are errors; flags override it;
    /// `envd/envd.example.toml` lists the keys).
    #[arg(long)]
    pub config: Option<PathBuf>,
    /// Address to listen on [default: 127.0.0.1:7070] (port 0 picks a free port; the real
    /// address is printed).
    #[arg(long)]
    pub listen: Option<SocketAddr>,
    /// Where sandboxes run [default: local, or `backend` in the config file]; kubernetes
    /// takes its settings from the file's [kubernetes] section.
    #[arg(long, value_enum)]
    pub backend: Option<Backend>,
    /// Where sandboxes live [default: graft-envd-data].
    #[arg(long)]
    pub data_dir: Option<PathBuf>,
    /// The key clients send in X-API-Key.
    #[arg(long, env = "GRAFT_ENVD_API_KEY", hide_env_values = true)]
    pub api_key: Option<String>,
    /// graft's gateway (HOST:PORT or http://HOST:PORT): sandboxes reach it, and nothing
    /// else, on their loopback at the sandbox gateway port.
    #[arg(long)]
    pub gateway: Option<String>,
    /// Loopback port of the gateway inside sandboxes [default: 4000].
    #[arg(long)]
    pub sandbox_gateway_port: Option<u16>,
    /// Host uid (and gid) sandboxed processes run as when envd runs as root [default: 100000].
    #[arg(long)]
    pub sandbox_uid: Option<u32>,
    #[arg(long)]
    pub sandbox_gid: Option<u32>,
    /// bubblewrap executable [default: bwrap].
    #[arg(long)]
    pub bwrap: Option<PathBuf>,
    /// The agent binary run inside sandboxes (default: `envd-agent` next to this binary,
    /// else this binary's `envd agent`).
    #[arg(long)]
    pub agent: Option<PathBuf>,
    /// Default memory limit of a sandbox in MiB [default: 2048].
    #[arg(long)]
    pub memory_mb: Option<u64>,
    /// Default pids limit of a sandbox [default: 512].
    #[arg(long)]
    pub pids: Option<u64>,
    /// Default CPU limit of a sandbox [default: 1.0].
    #[arg(long)]
    pub cpus: Option<f64>,
    /// Idle TTL of a sandbox whose create request names none [default: 600].
    #[arg(long)]
    pub default_ttl_secs: Option<u64>,
    /// How often expired sandboxes are looked for [default: 1000].
    #[arg(long)]
    pub reap_interval_ms: Option<u64>,
    /// Largest file the files API moves [default: 64 MiB].
    #[arg(long)]
    pub max_file_bytes: Option<usize>,
    /// Largest stdout (and stderr) kept per exec [default: 1 MiB].
    #[arg(long)]
    pub max_output_bytes: Option<usize>,
    /// Seconds between SIGTERM and SIGKILL when an exec times out [default: 2].
    #[arg(long)]
    pub kill_grace_secs: Option<f64>,
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

/// envd's harness injection wired to the repository's `harness-configs/` (`graft envd`,
/// and the envd `graft rl` runs in process).
pub fn harness_renderer() -> HarnessRenderer {
    HarnessRenderer(std::sync::Arc::new(render_harness))
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
    let agent = agent_command(s.agent.clone())?;
    let mut cfg = EnvdConfig::new(
        "127.0.0.1:7070".parse()?,
        PathBuf::from("graft-envd-data"),
        String::new(),
        agent,
    );
    // Defaults, then the file, then the flags.
    if let Some(path) = &s.config {
        FileConfig::load(path)?.apply(&mut cfg)?;
    }
    if let Some(v) = s.listen {
        cfg.listen = v;
    }
    match s.backend {
        Some(Backend::Local) => cfg.backend = graft_envd::BackendKind::Local,
        Some(Backend::Kubernetes) => cfg.backend = graft_envd::BackendKind::Kubernetes,
        None => {}
    }
    if let Some(v) = s.data_dir {
        cfg.data_dir = v;
    }
    if let Some(k) = s.api_key.filter(|k| !k.is_empty()) {
        cfg.api_key = k;
    }
    if let Some(g) = s.gateway.as_deref() {
        cfg.gateway = Some(parse_gateway(g).map_err(anyhow::Error::msg)?);
    }
    if let Some(v) = s.sandbox_gateway_port {
        cfg.sandbox_gateway_port = v;
    }
    if let Some(v) = s.sandbox_uid {
        cfg.sandbox_uid = v;
        cfg.sandbox_gid = v;
    }
    if let Some(v) = s.sandbox_gid {
        cfg.sandbox_gid = v;
    }
    if let Some(v) = s.bwrap {
        cfg.bwrap = v;
    }
    if let Some(exe) = s.agent {
        // The flag wins over the file's `agent`.
        cfg.agent = AgentCommand { exe, args: vec![] };
    }
    if let Some(v) = s.memory_mb {
        cfg.defaults.memory_mb = v;
    }
    if let Some(v) = s.pids {
        cfg.defaults.pids = v;
    }
    if let Some(v) = s.cpus {
        cfg.defaults.cpus = v;
    }
    if let Some(v) = s.default_ttl_secs {
        cfg.default_ttl = Duration::from_secs(v);
    }
    if let Some(v) = s.reap_interval_ms {
        cfg.reap_interval = Duration::from_millis(v.max(10));
    }
    if let Some(v) = s.max_file_bytes {
        cfg.max_file_bytes = v;
    }
    if let Some(v) = s.max_output_bytes {
        cfg.max_output_bytes = v;
    }
    if let Some(v) = s.kill_grace_secs {
        if !(0.0..=600.0).contains(&v) {
            bail!("--kill-grace-secs {v}: give 0 to 600 seconds");
        }
        cfg.kill_grace = Duration::from_secs_f64(v);
    }
    cfg.harnesses = Some(harness_renderer());
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
    envd.serve(graft_http::shutdown_signal()).await;
    Ok(())
}

/// The agent run inside sandboxes: `explicit`, else `envd-agent` next to this binary, else
/// this binary's `envd agent`.
pub fn agent_command(explicit: Option<PathBuf>) -> anyhow::Result<AgentCommand> {
    if let Some(exe) = explicit {
        return Ok(AgentCommand { exe, args: vec![] });
    }
    let me = std::env::current_exe().context("cannot find this binary")?;
    let sibling = me.with_file_name("envd-agent");
    if sibling.is_file() {
        return Ok(AgentCommand {
            exe: sibling,
            args: vec![],
        });
    }
    // This binary links libtorch, which a sandbox cannot see: it cannot be the agent.
    if cfg!(feature = "trainer") {
        anyhow::bail!(
            "envd needs its in-sandbox agent, the `envd-agent` binary, beside {} (this graft links libtorch, which sandboxes cannot load); build it too: cargo build --release --bin graft --bin envd-agent",
            me.display()
        );
    }
    Ok(AgentCommand {
        exe: me,
        args: vec!["envd".to_owned(), "agent".to_owned()],
    })
}

//! Command-line interface: parses arguments and dispatches to the crates.

use std::io::Write;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Context;
use clap::{Parser, Subcommand, ValueEnum};
use graft_gateway::{DurabilityMode, FileConfig, Gateway, GatewayConfig, Overrides};

#[derive(Debug, Parser)]
#[command(
    name = "graft",
    version,
    about = "Record, reconstruct and train on real agent-harness calls"
)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Run the recording gateway in front of an OpenAI-compatible upstream.
    Gateway(GatewayArgs),
    /// Read what the recorder stored: sessions, calls, exports.
    #[command(subcommand)]
    Records(RecordsCommand),
    /// Turn recorded calls (or an OpenAI-format JSONL log) into token-masked training samples.
    Reconstruct(crate::reconstruct::ReconstructArgs),
    /// A samples Parquet in a training framework's layout (verl, TRL, SkyRL, OpenRLHF, slime,
    /// Tinker), through the `graft_rl` Python package.
    Export(crate::export::ExportArgs),
    /// One GRPO iteration over a samples file: new weights (HF layout), optionally pushed
    /// to an SGLang-compatible server.
    #[cfg(feature = "trainer")]
    Train(crate::train::TrainArgs),
    /// The model behind SGLang's native API (`/generate`, weight updates, pause/continue),
    /// batching concurrent requests; CPU or CUDA.
    #[cfg(feature = "trainer")]
    Serve(crate::serve::ServeArgs),
    /// Model files: import a GGUF (e.g. SmolLM2) as an HF directory.
    #[cfg(feature = "trainer")]
    #[command(subcommand)]
    Model(crate::model::ModelCommand),
    /// The embedded default: a scripted upstream, the gateway in front of it, and a short
    /// client run through it; prints where the records went.
    #[cfg(feature = "testkit")]
    Demo(crate::demo::DemoArgs),
    /// Print how to point a harness at a graft session (env vars or its config file).
    #[command(subcommand)]
    Harness(crate::harness::HarnessCommand),
    /// A scripted OpenAI-compatible upstream that plays the model's text (tests, demo, benchmarks).
    #[cfg(feature = "testkit")]
    ScriptedUpstream(graft_testkit::ScriptedArgs),
    /// The sandbox service: sandboxes for harnesses (create, exec, files, apply_patch) over HTTP.
    Envd(crate::envd::EnvdArgs),
    /// Online RL sessions in a real harness: rollouts in sandboxes through the gateway,
    /// rewards, samples per step (`--dry-run` checks the components and prints the plan).
    Rl(crate::rl::RlArgs),
    /// The rollout service for another trainer: batches of tasks in, token-level samples
    /// with rewards out (NDJSON, a line per finished group).
    #[command(subcommand)]
    Rollouts(crate::rollouts::RolloutsCommand),
    /// Web pages over a data dir (sessions, groups, calls) and an RL run (steps, samples).
    View(crate::view::ViewArgs),
}

impl Command {
    /// `graft demo` (which talks to a person).
    fn is_demo(&self) -> bool {
        #[cfg(feature = "testkit")]
        {
            matches!(self, Command::Demo(_))
        }
        #[cfg(not(feature = "testkit"))]
        {
            false
        }
    }
}

#[derive(Debug, Clone, Copy, ValueEnum)]
pub enum Durability {
    Sync,
    Async,
}

#[derive(Debug, clap::Args)]
pub struct GatewayArgs {
    /// Address to listen on (port 0 picks a free port; the real address is printed).
    #[arg(long)]
    pub listen: Option<SocketAddr>,
    /// Upstream base URL, e.g. http://127.0.0.1:30000/v1 (a URL without a path gets /v1).
    #[arg(long)]
    pub upstream: Option<String>,
    /// Where records are written.
    #[arg(long)]
    pub data_dir: Option<PathBuf>,
    /// graft.toml with everything else (strict: unknown keys are errors).
    #[arg(long)]
    pub config: Option<PathBuf>,
    /// sync: a response ends only after its record is fsynced; async: fsync within a bounded delay.
    #[arg(long, value_enum)]
    pub durability: Option<Durability>,
    /// passthrough: forward request bodies to an OpenAI-compatible upstream; exact: render and
    /// tokenize prompts with the model's own template and call SGLang's /generate with token ids.
    #[arg(long, value_enum)]
    pub mode: Option<GatewayMode>,
    /// The model's HF directory (tokenizer + chat template), for exact mode (`exact.model_dir`).
    #[arg(long)]
    pub model_dir: Option<PathBuf>,
    /// Listen beyond loopback with no admin key (`auth.insecure_open_admin`): anyone who can
    /// reach the port can read every recorded call, post rewards and pause backends.
    #[arg(long)]
    pub insecure_open_admin: bool,
}

#[derive(Debug, Clone, Copy, ValueEnum)]
pub enum GatewayMode {
    Passthrough,
    Exact,
}

#[derive(Debug, Subcommand)]
pub enum RecordsCommand {
    /// One line per session: calls, errors, reward, closed.
    Sessions(crate::records::SessionsArgs),
    /// Full call records (requests rebuilt from their deltas), keys redacted.
    Show(crate::records::ShowArgs),
    /// Export records to Parquet (zstd) or JSONL, full requests, keys redacted.
    Export(crate::records::ExportArgs),
    /// Rewrite the session log keeping every whole event, after a failure left a bad line
    /// (the original is kept beside it). Stop the gateway on the data dir first.
    Repair(crate::records::RepairArgs),
}

pub fn main() -> ExitCode {
    let cli = Cli::parse();
    // The demo talks to a person: keep the log to warnings unless GRAFT_LOG says otherwise.
    init_tracing(if cli.command.is_demo() {
        "warn"
    } else {
        "info"
    });
    let rt = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("graft: cannot start the async runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    let result = rt.block_on(async move {
        match cli.command {
            Command::Gateway(args) => gateway(args).await,
            Command::Records(RecordsCommand::Sessions(a)) => crate::records::sessions(a),
            Command::Records(RecordsCommand::Show(a)) => crate::records::show(a),
            Command::Records(RecordsCommand::Export(a)) => crate::records::export(a),
            Command::Records(RecordsCommand::Repair(a)) => crate::records::repair(a),
            #[cfg(feature = "testkit")]
            Command::Demo(args) => crate::demo::run(args).await,
            #[cfg(feature = "testkit")]
            Command::ScriptedUpstream(args) => graft_testkit::run(args).await,
            Command::Harness(cmd) => crate::harness::run(cmd),
            Command::Reconstruct(args) => crate::reconstruct::run(args),
            Command::Export(args) => crate::export::run(args),
            #[cfg(feature = "trainer")]
            Command::Train(args) => crate::train::run(args),
            #[cfg(feature = "trainer")]
            Command::Serve(args) => crate::serve::run(args).await,
            #[cfg(feature = "trainer")]
            Command::Model(cmd) => crate::model::run(cmd),
            Command::Envd(args) => crate::envd::run(args).await,
            Command::Rl(args) => crate::rl::run(args).await,
            Command::Rollouts(cmd) => crate::rollouts::run(cmd).await,
            Command::View(args) => crate::view::run(args).await,
        }
    });
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("graft: {}", error_line(&e));
            ExitCode::FAILURE
        }
    }
}

/// An error and its causes in one line, as `{e:#}` writes it, less the causes whose text an
/// earlier message already quotes (many of graft's errors name their cause in their own
/// words, and the chain would repeat it).
fn error_line(e: &anyhow::Error) -> String {
    let mut line = String::new();
    for cause in e.chain() {
        let text = cause.to_string();
        if line.contains(&text) {
            continue;
        }
        if !line.is_empty() {
            line.push_str(": ");
        }
        line.push_str(&text);
    }
    line
}

/// Builds the gateway's configuration from the optional file and the flags.
pub fn gateway_config(args: &GatewayArgs) -> anyhow::Result<GatewayConfig> {
    let file = match &args.config {
        Some(p) => FileConfig::load(p)?,
        None => FileConfig::default(),
    };
    let overrides = Overrides {
        listen: args.listen,
        upstream: args.upstream.clone(),
        data_dir: args.data_dir.clone(),
        durability: args.durability.map(|d| match d {
            Durability::Sync => DurabilityMode::Sync,
            Durability::Async => DurabilityMode::Async,
        }),
        mode: args.mode.map(|m| match m {
            GatewayMode::Passthrough => graft_gateway::config::Mode::Passthrough,
            GatewayMode::Exact => graft_gateway::config::Mode::Exact,
        }),
        model_dir: args.model_dir.clone(),
        insecure_open_admin: args.insecure_open_admin,
    };
    Ok(GatewayConfig::resolve(file, overrides)?)
}

async fn gateway(args: GatewayArgs) -> anyhow::Result<()> {
    let cfg = gateway_config(&args)?;
    let data_dir = cfg.recorder.data_dir.clone();
    let durability = cfg.recorder.durability;
    let upstream = cfg.backend.describe();
    let gw = Gateway::bind(cfg)
        .await
        .context("the gateway could not start")?;
    let r = gw.recovery();
    tracing::info!(
        recovered = r.recovered_records,
        torn_bytes_dropped = r.torn_bytes_dropped,
        sealed_segments = r.sealed_segments,
        sessions = r.sessions.len(),
        "recorder opened in {}: recovered {} records from the WAL",
        data_dir.display(),
        r.recovered_records
    );
    tracing::info!(%upstream, ?durability, "gateway ready");
    {
        let mut out = std::io::stdout().lock();
        writeln!(out, "graft gateway listening on {}", gw.url())?;
        out.flush()?;
    }
    gw.serve(graft_http::shutdown_signal()).await?;
    Ok(())
}

fn init_tracing(default: &str) {
    let filter = tracing_subscriber::EnvFilter::try_from_env("GRAFT_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(default));
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .try_init();
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An error that quotes its cause in its own message, and names it as its source.
    #[derive(Debug)]
    struct Outer {
        source: std::io::Error,
    }

    impl std::fmt::Display for Outer {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            write!(f, "outer ({})", self.source)
        }
    }

    impl std::error::Error for Outer {
        fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
            Some(&self.source)
        }
    }

    #[test]
    fn a_cause_the_message_already_quotes_is_not_repeated() {
        let inner = std::io::Error::other("disk full");
        let e = anyhow::Error::new(Outer { source: inner }).context("cannot start");
        assert_eq!(error_line(&e), "cannot start: outer (disk full)");
        let e = anyhow::anyhow!("no such file").context("reading a.toml");
        assert_eq!(error_line(&e), "reading a.toml: no such file");
    }
}

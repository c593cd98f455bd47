//! The scripted upstream: an OpenAI-compatible server that plays the *model's text* from a
//! script while speaking the real wire format (JSON and SSE, byte for byte the shapes OpenAI
//! sends). It is the one stand-in graft's tests allow; the gateway, the SDKs, the harnesses
//! and the files on disk around it are all real. It is also the upstream of the load
//! benchmark, so the hot path takes no lock and blocks nothing: the script is read once at
//! start and shared read-only, ids come from an atomic counter.
//!
//! It lives in its own crate so the product build never carries it: the `graft` package
//! reaches it only through its `testkit` cargo feature (`graft scripted-upstream`, `graft
//! demo`, `graft rl`'s `backend.scripted`).
//!
//! What it says is chosen by [`Script`] rules matched against the request (see
//! [`Rule`]); with no matching rule it echoes `You said: <last user text>`.
//! Faults are chosen by the request's `model` field (see `faults.rs`), because the gateway
//! forwards request bodies unchanged.
//!
//! With `--tokenizer DIR` (a HF model directory) it also answers like vLLM does to
//! `return_token_ids: true` and `logprobs` (see [`TokenModel`]): the prompt ids are the chat
//! template's rendering of the request (messages, tools, generation prompt) tokenized, the
//! completion ids the tokenized text the model "generated" (content, then each tool call in
//! the Hermes `<tool_call>` form Qwen3 uses, then the end-of-turn token), split across SSE
//! chunks along with the text, and each logprob is `-(id % 97) / 100`. Usage then counts
//! those tokens. Without `--tokenizer` nothing of this happens. It then also serves SGLang's
//! native `/generate` and control routes (`sglang.rs`, in `graft-wire`'s types).
//!
//! Layout: [`script`] (the script file and what it looks at in a request), `openai` (Chat
//! Completions and Completions answers, JSON and SSE), `sglang` (the SGLang-native side),
//! `vllm` (the vLLM-native side: token-id completions, and with `--vllm-dev-mode` the
//! development routes of a weight push),
//! [`tokens`] (token ids with `--tokenizer`), `faults`, `server` (the accept loop and
//! routing), `answer` (the body type, JSON answers, the SSE body), `state` (what the server
//! keeps: settings, script, each native side's state).

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::AtomicU64;
use std::time::Duration;

use anyhow::Context as _;

mod answer;
mod faults;
mod openai;
pub mod script;
mod server;
mod sglang;
mod state;
#[cfg(test)]
mod tests;
pub mod tokens;
mod vllm;

pub use script::{Reply, Rule, Script, ScriptToolCall, scripted_logprob};
pub use tokens::TokenModel;

use state::State;

#[derive(Debug, Clone, clap::Args)]
pub struct ScriptedArgs {
    /// Address to listen on (port 0 picks a free port).
    #[arg(long, default_value = "127.0.0.1:0")]
    pub listen: SocketAddr,
    /// JSON script: `{"rules":[{"match":"substring","reply":{"content":"...","tool_calls":[...]}}]}`.
    /// Without it every reply echoes `You said: <last user text>`.
    #[arg(long)]
    pub script: Option<PathBuf>,
    /// Require `Authorization: Bearer KEY` on every request (401 otherwise).
    #[arg(long)]
    pub expect_key: Option<String>,
    /// SGLang's `--admin-api-key`: its admin routes (pauses, weight updates, aborts, cache
    /// flushes) then want this key, and `--expect-key` is SGLang's `--api-key` for the
    /// other routes, as SGLang decides (`sglang/srt/utils/auth.py`).
    #[arg(long)]
    pub admin_key: Option<String>,
    /// The SGLang version `GET /server_info` reports (graft checks it).
    #[arg(long, default_value = "0.5.23")]
    pub sglang_version: String,
    /// The vLLM version `GET /version` reports. Before 0.34 the vLLM side plays an older
    /// vLLM: no `weight_versions` spans in its answers, no `/update_weight_version` or
    /// `/weight_info` development routes.
    #[arg(long, default_value = "0.34.0")]
    pub vllm_version: String,
    /// Serve the info routes only under their old names (`/get_model_info`,
    /// `/get_server_info`), as SGLang did before `/model_info` and `/server_info`.
    #[arg(long)]
    pub legacy_info_routes: bool,
    /// vLLM's `VLLM_SERVER_DEV_MODE=1`: serve the development routes a weight push uses
    /// (`/pause`, `/resume`, `/reset_prefix_cache`, `/collective_rpc`,
    /// `/update_weight_version`, `/weight_info`, ...); without it they answer 404, as vLLM's do.
    #[arg(long)]
    pub vllm_dev_mode: bool,
    /// Delay between SSE chunks, in milliseconds.
    #[arg(long, default_value_t = 0)]
    pub chunk_delay_ms: u64,
    /// Model ids listed by `GET /v1/models` (repeatable). Any model id is accepted in requests.
    #[arg(long = "model", default_value = "scripted")]
    pub models: Vec<String>,
    /// A HF model directory (tokenizer.json + chat template): answer `return_token_ids` and
    /// `logprobs` with real token ids, as vLLM does.
    #[arg(long)]
    pub tokenizer: Option<PathBuf>,
}

/// The largest request body read (bigger ones get 413).
pub(crate) const MAX_REQUEST_BYTES: usize = 64 * 1024 * 1024;
/// Tool-call arguments are streamed in at most this many pieces.
pub(crate) const ARGUMENT_PIECES: usize = 4;
/// `fault-reset` waits this long after its last chunk before aborting, so the chunks reach
/// the client first.
pub(crate) const RESET_FLUSH_PAUSE: Duration = Duration::from_millis(50);

pub async fn run(args: ScriptedArgs) -> anyhow::Result<()> {
    let (addr, serve) = start(&args).await?;
    {
        use std::io::Write as _;
        let mut out = std::io::stdout().lock();
        writeln!(out, "graft scripted-upstream listening on http://{addr}")?;
        out.flush()?;
    }
    serve.await
}

/// Binds the scripted upstream; returns its address and the future that serves it (until
/// Ctrl-C, or until it is dropped).
pub async fn start(
    args: &ScriptedArgs,
) -> anyhow::Result<(
    SocketAddr,
    impl std::future::Future<Output = anyhow::Result<()>> + use<>,
)> {
    let script = match &args.script {
        Some(path) => Script::load(path)?,
        None => Script::default(),
    };
    let model = match &args.tokenizer {
        Some(dir) => Some(TokenModel::load(dir)?),
        None => None,
    };
    let state = Arc::new(State {
        model,
        script,
        expect_key: args.expect_key.clone(),
        admin_key: args.admin_key.clone(),
        sglang_version: args.sglang_version.clone(),
        legacy_info_routes: args.legacy_info_routes,
        vllm_version: args.vllm_version.clone(),
        vllm_dev_mode: args.vllm_dev_mode,
        chunk_delay: Duration::from_millis(args.chunk_delay_ms),
        models: args.models.clone(),
        next_id: AtomicU64::new(1),
        sglang: state::SglangSide::default(),
        vllm: state::VllmSide::default(),
        openai_bodies: Default::default(),
    });
    let listener = tokio::net::TcpListener::bind(args.listen)
        .await
        .with_context(|| {
            format!(
                "cannot listen on {}; pick another --listen address",
                args.listen
            )
        })?;
    let addr = listener
        .local_addr()
        .context("cannot read the bound address")?;
    Ok((addr, server::serve(listener, state)))
}

//! `graft.toml`: strict TOML (unknown keys are rejected with the key named), validated once
//! at start. Secrets are written as `env::NAME` and resolved here; they are never logged.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::Deserialize;

use crate::route::valid_session_id;

#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("cannot read config file {path}: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("config file {path} is invalid: {message}")]
    Parse { path: PathBuf, message: String },
    #[error(
        "config value {key} refers to environment variable {var}, which is not set; export it or change {key}"
    )]
    MissingEnv { key: String, var: String },
    #[error("config value {key} is invalid: {message}")]
    Invalid { key: String, message: String },
}

/// A secret as written in the config: a literal, or `env::NAME`.
#[derive(Clone, Default, Deserialize)]
#[serde(transparent)]
pub struct SecretRef(pub String);

impl std::fmt::Debug for SecretRef {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.0.starts_with("env::") {
            write!(f, "{}", self.0)
        } else {
            f.write_str("[redacted]")
        }
    }
}

impl SecretRef {
    /// The secret (from the environment for `env::VAR`). An empty or whitespace-only one is
    /// refused: a key nobody can send (or anybody can guess) is a mistake, not a setting.
    pub fn resolve(&self, key: &str) -> Result<String, ConfigError> {
        let (value, from) = match self.0.strip_prefix("env::") {
            Some(var) => (
                std::env::var(var).map_err(|_| ConfigError::MissingEnv {
                    key: key.to_string(),
                    var: var.to_string(),
                })?,
                format!("the environment variable {var}"),
            ),
            None => (self.0.clone(), "graft.toml".to_string()),
        };
        if value.trim().is_empty() {
            return Err(ConfigError::Invalid {
                key: key.to_string(),
                message: format!(
                    "the key from {from} is empty or whitespace only; set it to a long random secret (e.g. `openssl rand -hex 32`), or remove the setting"
                ),
            });
        }
        Ok(value)
    }
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DurabilityMode {
    /// The last byte of a response reaches the client only after its record is fsynced.
    #[default]
    Sync,
    /// Records are fsynced at most `async_max_delay_ms` after the response; a crash can lose that window.
    Async,
}

#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FileConfig {
    #[serde(default)]
    pub server: ServerSection,
    #[serde(default)]
    pub upstream: UpstreamSection,
    #[serde(default)]
    pub recorder: RecorderSection,
    #[serde(default)]
    pub auth: AuthSection,
    #[serde(default)]
    pub sessions: SessionsSection,
    #[serde(default)]
    pub limits: LimitsSection,
    #[serde(default)]
    pub exact: ExactSection,
    /// `[sampling]`: the sampling policy of every session that has none of its own.
    #[serde(default)]
    pub sampling: Option<crate::policy::SamplingPolicy>,
}

/// How calls reach the model.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Mode {
    /// Request bodies forwarded to an OpenAI-compatible upstream (text in, text out).
    #[default]
    Passthrough,
    /// graft renders and tokenizes the prompt itself and calls SGLang's `/generate` with
    /// token ids: the record holds exactly the ids the policy saw and sampled.
    Exact,
}

impl Mode {
    pub fn label(self) -> &'static str {
        match self {
            Mode::Passthrough => "passthrough",
            Mode::Exact => "exact",
        }
    }
}

/// `[exact]`: what exact mode needs to own the tokens.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ExactSection {
    /// The model's HF directory (`tokenizer.json`, `tokenizer_config.json` or
    /// `chat_template.jinja`): the same files the backend serves.
    pub model_dir: Option<PathBuf>,
    /// SGLang-native backends (`http://host:30000`, no `/v1`). A session stays on the one its
    /// first call went to. Default: `upstream.url` without its `/v1`.
    #[serde(default)]
    pub backends: Vec<String>,
    /// How the model writes tool calls: `hermes` (Qwen2.5/Qwen3, default), `qwen3_coder`,
    /// `llama3` (Llama 3.1/3.2 JSON calls), `none`.
    pub tool_call_format: Option<graft_reconstruct::parser::ToolCallFormat>,
    /// How the model writes reasoning: `think` (default) or `none`.
    pub reasoning_format: Option<graft_reconstruct::parser::ReasoningFormat>,
    /// `max_new_tokens` when the request sets no limit (default 8192).
    pub max_new_tokens: Option<u64>,
    /// The model's context length in tokens (default: `max_position_embeddings` of the model
    /// dir's `config.json`). A prompt that leaves no room for one token is refused (400
    /// `context_length_exceeded`); the token limit sent is clamped to what is left.
    pub context_length: Option<u64>,
    /// Earlier calls kept per session for prefix reuse (default 4).
    pub history_per_session: Option<usize>,
    /// Token ids kept over all sessions' histories (default 100 M, ≈ 400 MB); past it the
    /// least recently used sessions' histories are dropped.
    pub history_max_tokens: Option<usize>,
    /// Extra chat-template variables, e.g. `{ enable_thinking = false }`.
    #[serde(default)]
    pub template_kwargs: toml::Table,
    /// The key of backends started with `--api-key` (`env::NAME` reads it from the
    /// environment): sent as `Authorization: Bearer` on generations and info probes.
    pub backend_api_key: Option<SecretRef>,
    /// The key of backends started with `--admin-api-key`: SGLang then wants it, not the API
    /// key, on its admin routes (`/abort_request`, pauses, weight updates). Default: the
    /// backend key.
    pub admin_api_key: Option<SecretRef>,
    /// Whether graft reads each backend's `GET /server_info` before its first call and
    /// refuses an SGLang older than the oldest it supports (default true).
    pub check_backends: Option<bool>,
    /// The backends' wire: `sglang` (default: `POST /generate`) or `vllm` (`POST
    /// /v1/completions` with a token-id prompt).
    pub wire: Option<ExactWire>,
    /// vLLM only: the `--logprobs-mode` the backends run with, `raw_logprobs` (vLLM's
    /// default: before temperature) or `processed_logprobs` (after it). Recorded with each
    /// call so the trainer compares like with like.
    pub logprobs_mode: Option<LogprobsMode>,
    /// vLLM only: the backends' `VLLM_ENFORCE_STRICT_TOOL_CALLING` (vLLM's default: true).
    /// On, vLLM's chat server holds tool calls to the model's own call syntax (a structural
    /// tag) and parses `required` / named calls like `auto`; off, it forces them as a JSON
    /// list (or the named function's arguments) and reads that. graft sends and reads as
    /// the server would (default true).
    pub vllm_strict_tool_calling: Option<bool>,
}

/// Which backend wire exact mode speaks.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ExactWire {
    /// SGLang's native `POST /generate` (also `graft serve`'s).
    #[default]
    Sglang,
    /// vLLM's `POST /v1/completions` with a token-id prompt and `return_token_ids`.
    Vllm,
}

/// Which distribution an exact-mode backend's logprobs come from; each record says it
/// (`upstream_request.graft_logprobs`), so the trainer compares like with like.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum LogprobKind {
    /// `log_softmax(logits / T)` after penalties and bias (SGLang; vLLM with
    /// `--logprobs-mode processed_logprobs`): the distribution sampled from.
    #[default]
    PostTemperature,
    /// `log_softmax(logits)` of the raw model output (vLLM's default `raw_logprobs`): the
    /// sampling distribution only at temperature 1 with no penalties or bias.
    PreTemperature,
}

impl LogprobKind {
    pub fn label(self) -> &'static str {
        match self {
            LogprobKind::PostTemperature => "post_temperature",
            LogprobKind::PreTemperature => "pre_temperature",
        }
    }
}

impl ExactWire {
    /// What the backends' logprobs are: SGLang's are after temperature; vLLM's depend on
    /// its `--logprobs-mode` (`mode`; None: its default, `raw_logprobs`).
    pub fn logprob_kind(self, mode: Option<LogprobsMode>) -> LogprobKind {
        match (self, mode) {
            (ExactWire::Sglang, _) | (ExactWire::Vllm, Some(LogprobsMode::ProcessedLogprobs)) => {
                LogprobKind::PostTemperature
            }
            (ExactWire::Vllm, _) => LogprobKind::PreTemperature,
        }
    }

    pub fn label(self) -> &'static str {
        match self {
            ExactWire::Sglang => "sglang",
            ExactWire::Vllm => "vllm",
        }
    }
}

/// vLLM's `--logprobs-mode` values that return logprobs (the `*_logits` modes return logits,
/// which graft cannot record as logprobs).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum LogprobsMode {
    /// `log_softmax(logits)` of the model's raw output: before temperature, penalties, bias.
    #[default]
    RawLogprobs,
    /// After temperature, penalties and bias, before top-k/top-p truncation.
    ProcessedLogprobs,
}

#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ServerSection {
    pub listen: Option<SocketAddr>,
    /// The URL clients reach graft at, used in `base_url` of new sessions. Default: from the
    /// request's Host header.
    pub public_url: Option<String>,
    pub tls: Option<TlsSection>,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TlsSection {
    pub cert: PathBuf,
    pub key: PathBuf,
}

#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct UpstreamSection {
    pub url: Option<String>,
    pub api_key: Option<SecretRef>,
    pub timeout_secs: Option<u64>,
    pub connect_timeout_secs: Option<u64>,
    /// Dialects the upstream speaks besides Chat Completions ("responses",
    /// "anthropic_messages"): calls in those are passed through unchanged instead of
    /// translated to Chat Completions.
    #[serde(default)]
    pub dialects: Vec<crate::dialect::DialectKind>,
    /// PEM file of the CA(s) to trust for an `https://` upstream instead of the public roots
    /// (a cluster's private CA).
    pub ca_file: Option<PathBuf>,
    /// Passthrough token ids: `"off"` (default), `"vllm"` or `"sglang"`. When on, graft asks
    /// the upstream for token ids and logprobs on Chat Completions and Completions calls and
    /// records them (see `token_ids.rs`).
    pub token_ids: Option<crate::token_ids::TokenIdsMode>,
    /// `passthrough` (default) or `exact` (see `[exact]`).
    pub mode: Option<Mode>,
}

#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RecorderSection {
    pub data_dir: Option<PathBuf>,
    pub durability: Option<DurabilityMode>,
    pub async_max_delay_ms: Option<u64>,
    pub queue_capacity: Option<usize>,
    pub segment_max_mb: Option<u64>,
    pub seal_after_secs: Option<u64>,
    /// Request headers to keep in each record (`headers`), e.g. a harness's own
    /// `x-codex-turn-metadata`, so that reconstruct can leave calls out by them. Never
    /// credentials: `authorization`, `cookie`, names holding `key`, `token`, `secret` or
    /// `auth` are refused.
    #[serde(default)]
    pub record_headers: Vec<String>,
    /// Keys whose values are redacted from each recorded request, anywhere outside its
    /// conversation and tools (`metadata`, `user`, provider extras); replaces the default
    /// list, `graft_recorder::SECRET_BODY_KEYS` (`password`, `secret`, `token`, ...).
    /// Credentials (`authorization`, `api_key`, ...) are redacted whatever this says.
    pub redact_keys: Option<Vec<String>>,
    /// Sessions whose recent calls the writer keeps as delta bases (default 4096; the least
    /// recently written lose theirs first: their next call is stored whole).
    pub delta_base_sessions: Option<usize>,
    /// Keep the open WAL segment zero-filled a little ahead of the writer (default true),
    /// so that a record's fsync does not also commit a new file size to the filesystem's
    /// journal. Off: the WAL is appended to.
    pub wal_preallocate: Option<bool>,
}

#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AuthSection {
    /// Required on `/graft/*` and `/ui`. Unset, the gateway generates one at its first start
    /// and keeps it in `<data_dir>/admin.key` (mode 0600), where graft's local tools read it.
    /// A gateway that listens beyond loopback refuses to start without one set here (unless
    /// `insecure_open_admin`).
    pub admin_key: Option<SecretRef>,
    /// Keys accepted on `/v1/*` besides session keys.
    #[serde(default)]
    pub client_keys: Vec<SecretRef>,
    /// When true, `/v1/*` needs a client key or a session key. Default: on when the gateway
    /// listens beyond loopback, off on loopback.
    pub require_client_key: Option<bool>,
    /// No admin key at all (none set, none generated): anyone who reaches the port, on
    /// loopback or beyond it, can read every recorded call, post rewards and pause backends.
    /// Loudly named on purpose.
    #[serde(default)]
    pub insecure_open_admin: bool,
}

#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SessionsSection {
    /// Create sessions named in `/s/{id}/` or `x-graft-session` on first use instead of refusing them.
    #[serde(default)]
    pub auto_create: bool,
    /// Session for calls that name none.
    pub default_session: Option<String>,
}

#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LimitsSection {
    pub max_body_bytes: Option<usize>,
    pub max_response_bytes: Option<usize>,
    pub body_timeout_secs: Option<u64>,
    pub header_timeout_secs: Option<u64>,
    /// Requests per second over all sessions (0 = unlimited).
    pub global_rps: Option<u32>,
    /// Requests per second per session (0 = unlimited).
    pub session_rps: Option<u32>,
    pub burst: Option<u32>,
    pub max_concurrent_upstream: Option<usize>,
    pub upstream_queue_timeout_ms: Option<u64>,
    /// Retry bookkeeping over all sessions: attempts remembered (default 65536).
    pub retry_memory_attempts: Option<usize>,
    /// ... bytes of request bodies and idempotency keys kept (default 64 MiB).
    pub retry_memory_bytes: Option<usize>,
    /// ... seconds an attempt is remembered after it was last begun or settled (default 600).
    pub retry_memory_secs: Option<u64>,
}

/// The validated, resolved configuration the gateway runs with: one typed section per
/// concern, and the backend as an enum, so a passthrough gateway has no exact-mode settings
/// and an exact-mode gateway needs no OpenAI upstream.
#[derive(Debug, Clone)]
pub struct GatewayConfig {
    pub server: ServerConfig,
    pub backend: BackendConfig,
    /// How graft's HTTP client reaches any backend.
    pub backend_http: BackendHttp,
    pub recorder: RecordingConfig,
    pub auth: AuthConfig,
    pub sessions: SessionsConfig,
    pub limits: LimitsConfig,
    /// The sampling policy of sessions without their own (`[sampling]`).
    pub sampling: Option<crate::policy::SamplingPolicy>,
}

#[derive(Debug, Clone)]
pub struct ServerConfig {
    pub listen: SocketAddr,
    pub public_url: Option<String>,
    pub tls: Option<TlsSection>,
    pub header_timeout: Duration,
}

/// Where calls go, and how.
#[derive(Debug, Clone)]
pub enum BackendConfig {
    /// Any OpenAI-compatible server: bodies forwarded (or translated to Chat Completions).
    OpenAi(OpenAiConfig),
    /// SGLang-native `/generate` with token ids: graft owns the template and the tokens.
    Sglang(ExactConfig),
}

impl BackendConfig {
    pub fn mode(&self) -> Mode {
        match self {
            BackendConfig::OpenAi(_) => Mode::Passthrough,
            BackendConfig::Sglang(_) => Mode::Exact,
        }
    }

    /// The backend URLs, for logs.
    pub fn describe(&self) -> String {
        match self {
            BackendConfig::OpenAi(o) => o.url.clone(),
            BackendConfig::Sglang(e) => e.backends.join(", "),
        }
    }
}

/// Passthrough's upstream.
#[derive(Debug, Clone)]
pub struct OpenAiConfig {
    pub url: String,
    pub api_key: Option<String>,
    /// Always holds ChatCompletions, plus what `upstream.dialects` adds.
    pub dialects: Vec<crate::dialect::DialectKind>,
    /// `upstream.token_ids`.
    pub token_ids: crate::token_ids::TokenIdsMode,
}

impl OpenAiConfig {
    pub fn new(url: &str) -> Result<Self, ConfigError> {
        Ok(OpenAiConfig {
            url: normalize_upstream(url)?,
            api_key: None,
            dialects: vec![crate::dialect::DialectKind::ChatCompletions],
            token_ids: Default::default(),
        })
    }
}

#[derive(Debug, Clone)]
pub struct BackendHttp {
    pub timeout: Duration,
    pub connect_timeout: Duration,
    pub ca_file: Option<PathBuf>,
}

#[derive(Debug, Clone)]
pub struct RecordingConfig {
    pub data_dir: PathBuf,
    pub durability: DurabilityMode,
    pub async_max_delay: Duration,
    pub queue_capacity: usize,
    pub segment_max_bytes: u64,
    pub seal_after: Duration,
    /// Lower-cased names of the request headers each record keeps.
    pub record_headers: Vec<http::HeaderName>,
    /// `recorder.redact_keys`, else the default list.
    pub redact_keys: Vec<String>,
    pub delta_base_sessions: usize,
    pub wal_preallocate: bool,
}

#[derive(Clone, Default)]
pub struct AuthConfig {
    /// `auth.admin_key`; once the gateway is bound, the generated one if none was set.
    pub admin_key: Option<String>,
    /// Set when the gateway generated `admin_key` and keeps it in this file.
    pub admin_key_file: Option<PathBuf>,
    pub client_keys: Vec<String>,
    pub require_client_key: bool,
    /// No admin key at all: the admin surface is open to any request but a session's.
    pub insecure_open_admin: bool,
}

/// Keys stay out of `{:?}`: only whether they are set.
impl std::fmt::Debug for AuthConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AuthConfig")
            .field("admin_key", &self.admin_key.as_ref().map(|_| "<set>"))
            .field("admin_key_file", &self.admin_key_file)
            .field("client_keys", &self.client_keys.len())
            .field("require_client_key", &self.require_client_key)
            .field("insecure_open_admin", &self.insecure_open_admin)
            .finish()
    }
}

impl AuthConfig {
    /// Closed by default: an address beyond loopback needs an admin key, or the loudly named
    /// opt-out. The error says how to set one.
    pub fn check_listen(&self, what: &str, listen: SocketAddr) -> Result<(), ConfigError> {
        if listen.ip().is_loopback() || self.admin_key.is_some() || self.insecure_open_admin {
            return Ok(());
        }
        Err(ConfigError::Invalid {
            key: "auth.admin_key".into(),
            message: format!(
                "{what} refuses to listen on {listen} (beyond loopback) without an admin key: anyone who can reach it could read every recorded call, post rewards and pause backends. Set auth.admin_key = \"env::GRAFT_ADMIN_KEY\" in graft.toml and export GRAFT_ADMIN_KEY to a long random secret (e.g. `openssl rand -hex 32`), or listen on 127.0.0.1, or, if the network itself is trusted, pass --insecure-open-admin (auth.insecure_open_admin = true)"
            ),
        })
    }
}

#[derive(Debug, Clone)]
pub struct SessionsConfig {
    pub auto_create: bool,
    pub default_session: String,
}

#[derive(Debug, Clone)]
pub struct LimitsConfig {
    pub max_body_bytes: usize,
    pub max_response_bytes: usize,
    pub body_timeout: Duration,
    pub global_rps: u32,
    pub session_rps: u32,
    pub burst: u32,
    pub max_concurrent_upstream: usize,
    pub upstream_queue_timeout: Duration,
    /// What the retry bookkeeping may hold over all sessions (`retry_memory_*`).
    pub retries: crate::retries::Bounds,
}

/// Exact mode's resolved settings.
#[derive(Debug, Clone)]
pub struct ExactConfig {
    pub model_dir: PathBuf,
    pub backends: Vec<String>,
    pub tool_call_format: graft_reconstruct::parser::ToolCallFormat,
    pub reasoning_format: graft_reconstruct::parser::ReasoningFormat,
    pub max_new_tokens: u64,
    /// `exact.context_length` as configured (`None`: read from the model's `config.json`).
    pub context_length: Option<u64>,
    pub history_per_session: usize,
    pub history_max_tokens: usize,
    pub template_kwargs: serde_json::Map<String, serde_json::Value>,
    pub backend_api_key: Option<String>,
    pub admin_api_key: Option<String>,
    pub check_backends: bool,
    pub wire: ExactWire,
    /// What the backends' logprobs are: `post_temperature` (SGLang's, and vLLM's with
    /// `processed_logprobs`) or `pre_temperature` (vLLM's default `raw_logprobs`).
    pub logprobs: LogprobKind,
    /// vLLM only: `exact.vllm_strict_tool_calling` (the servers'
    /// `VLLM_ENFORCE_STRICT_TOOL_CALLING`).
    pub vllm_strict_tool_calling: bool,
}

impl ExactConfig {
    /// Exact mode over `backends` (SGLang base URLs, no `/v1`) with the model in
    /// `model_dir`, every other setting at its default.
    pub fn new(model_dir: PathBuf, backends: Vec<String>) -> Result<Self, ConfigError> {
        let section = ExactSection {
            backends,
            ..Default::default()
        };
        resolve_exact(&section, Some(model_dir), None)
    }
}

/// Runtime knobs given as CLI flags; they win over the file.
#[derive(Debug, Clone, Default)]
pub struct Overrides {
    pub listen: Option<SocketAddr>,
    pub upstream: Option<String>,
    pub data_dir: Option<PathBuf>,
    pub durability: Option<DurabilityMode>,
    pub mode: Option<Mode>,
    /// `exact.model_dir`.
    pub model_dir: Option<PathBuf>,
    /// `--insecure-open-admin`: `auth.insecure_open_admin = true`.
    pub insecure_open_admin: bool,
}

impl FileConfig {
    pub fn from_toml(text: &str, path: &Path) -> Result<Self, ConfigError> {
        toml::from_str(text).map_err(|e| ConfigError::Parse {
            path: path.to_path_buf(),
            message: e.to_string().trim_end().to_string(),
        })
    }

    pub fn load(path: &Path) -> Result<Self, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
            path: path.to_path_buf(),
            source,
        })?;
        Self::from_toml(&text, path)
    }
}

impl GatewayConfig {
    /// A gateway in front of `backend` with every other setting at its default (what an
    /// empty graft.toml gives); callers in process set the fields they need.
    pub fn new(backend: BackendConfig) -> Result<Self, ConfigError> {
        let mut cfg =
            Self::resolve_with(FileConfig::default(), Overrides::default(), Some(backend))?;
        cfg.auth = AuthConfig::default();
        Ok(cfg)
    }

    pub fn resolve(file: FileConfig, o: Overrides) -> Result<Self, ConfigError> {
        Self::resolve_with(file, o, None)
    }

    fn resolve_with(
        file: FileConfig,
        o: Overrides,
        backend: Option<BackendConfig>,
    ) -> Result<Self, ConfigError> {
        let mode = o.mode.or(file.upstream.mode).unwrap_or_default();
        let upstream_url = match o.upstream.clone().or(file.upstream.url.clone()) {
            Some(u) => Some(normalize_upstream(&u)?),
            None => None,
        };
        let backend = match backend {
            Some(b) => b,
            None => match mode {
                Mode::Passthrough => {
                    let url = upstream_url.ok_or_else(|| ConfigError::Invalid {
                        key: "upstream.url".into(),
                        message: "no upstream given; pass --upstream URL or set upstream.url"
                            .into(),
                    })?;
                    let api_key = match &file.upstream.api_key {
                        Some(s) => Some(s.resolve("upstream.api_key")?),
                        None => None,
                    };
                    let mut dialects = vec![crate::dialect::DialectKind::ChatCompletions];
                    dialects.extend(
                        file.upstream
                            .dialects
                            .iter()
                            .copied()
                            .filter(|x| *x != crate::dialect::DialectKind::ChatCompletions),
                    );
                    BackendConfig::OpenAi(OpenAiConfig {
                        url,
                        api_key,
                        dialects,
                        token_ids: file.upstream.token_ids.unwrap_or_default(),
                    })
                }
                Mode::Exact => {
                    // Passthrough-only settings are refused rather than ignored.
                    if file
                        .upstream
                        .token_ids
                        .is_some_and(|t| t != crate::token_ids::TokenIdsMode::Off)
                    {
                        return Err(ConfigError::Invalid {
                            key: "upstream.token_ids".into(),
                            message: "is for passthrough mode; exact mode records the ids itself: remove it or set upstream.mode = \"passthrough\"".into(),
                        });
                    }
                    if !file.upstream.dialects.is_empty() {
                        return Err(ConfigError::Invalid {
                            key: "upstream.dialects".into(),
                            message: "is for passthrough mode; exact mode answers every dialect itself: remove it or set upstream.mode = \"passthrough\"".into(),
                        });
                    }
                    BackendConfig::Sglang(resolve_exact(
                        &file.exact,
                        o.model_dir.clone(),
                        upstream_url.as_deref(),
                    )?)
                }
            },
        };
        let admin_key = match &file.auth.admin_key {
            Some(s) => Some(s.resolve("auth.admin_key")?),
            None => None,
        };
        let client_keys = file
            .auth
            .client_keys
            .iter()
            .enumerate()
            .map(|(i, k)| k.resolve(&format!("auth.client_keys[{i}]")))
            .collect::<Result<Vec<_>, _>>()?;
        let l = &file.limits;
        let r = &file.recorder;
        let listen = o
            .listen
            .or(file.server.listen)
            .unwrap_or_else(|| SocketAddr::from(([127, 0, 0, 1], 8400)));
        let cfg = GatewayConfig {
            server: ServerConfig {
                listen,
                public_url: file
                    .server
                    .public_url
                    .map(|u| u.trim_end_matches('/').to_string()),
                tls: file.server.tls,
                header_timeout: Duration::from_secs(l.header_timeout_secs.unwrap_or(10)),
            },
            backend,
            backend_http: BackendHttp {
                timeout: Duration::from_secs(file.upstream.timeout_secs.unwrap_or(600)),
                connect_timeout: Duration::from_secs(
                    file.upstream.connect_timeout_secs.unwrap_or(10),
                ),
                ca_file: file.upstream.ca_file.clone(),
            },
            recorder: RecordingConfig {
                data_dir: o
                    .data_dir
                    .or(r.data_dir.clone())
                    .unwrap_or_else(|| PathBuf::from("graft-data")),
                durability: o.durability.or(r.durability).unwrap_or_default(),
                async_max_delay: Duration::from_millis(r.async_max_delay_ms.unwrap_or(10)),
                queue_capacity: r.queue_capacity.unwrap_or(65_536),
                segment_max_bytes: r.segment_max_mb.unwrap_or(64) * 1024 * 1024,
                seal_after: Duration::from_secs(r.seal_after_secs.unwrap_or(60)),
                record_headers: record_headers(&r.record_headers)?,
                redact_keys: r.redact_keys.clone().unwrap_or_else(|| {
                    graft_recorder::SECRET_BODY_KEYS
                        .iter()
                        .map(|k| (*k).to_string())
                        .collect()
                }),
                delta_base_sessions: r.delta_base_sessions.unwrap_or(4096),
                wal_preallocate: r.wal_preallocate.unwrap_or(true),
            },
            auth: AuthConfig {
                admin_key,
                admin_key_file: None,
                client_keys,
                require_client_key: file
                    .auth
                    .require_client_key
                    .unwrap_or(!listen.ip().is_loopback()),
                insecure_open_admin: o.insecure_open_admin || file.auth.insecure_open_admin,
            },
            sessions: SessionsConfig {
                auto_create: file.sessions.auto_create,
                default_session: file
                    .sessions
                    .default_session
                    .unwrap_or_else(|| "default".into()),
            },
            limits: LimitsConfig {
                max_body_bytes: l.max_body_bytes.unwrap_or(32 * 1024 * 1024),
                max_response_bytes: l.max_response_bytes.unwrap_or(256 * 1024 * 1024),
                body_timeout: Duration::from_secs(l.body_timeout_secs.unwrap_or(30)),
                global_rps: l.global_rps.unwrap_or(0),
                session_rps: l.session_rps.unwrap_or(0),
                burst: l.burst.unwrap_or(0),
                max_concurrent_upstream: l.max_concurrent_upstream.unwrap_or(4096),
                upstream_queue_timeout: Duration::from_millis(
                    l.upstream_queue_timeout_ms.unwrap_or(30_000),
                ),
                retries: {
                    let d = crate::retries::Bounds::default();
                    crate::retries::Bounds {
                        attempts: l.retry_memory_attempts.unwrap_or(d.attempts),
                        bytes: l.retry_memory_bytes.unwrap_or(d.bytes),
                        ttl: l.retry_memory_secs.map_or(d.ttl, Duration::from_secs),
                    }
                },
            },
            sampling: file.sampling.clone(),
        };
        if let Some(p) = &cfg.sampling
            && let Err((key, message)) = p.check()
        {
            return Err(ConfigError::Invalid {
                key: format!("sampling.{key}"),
                message,
            });
        }
        for (key, value) in [
            ("retry_memory_attempts", cfg.limits.retries.attempts as u64),
            ("retry_memory_secs", cfg.limits.retries.ttl.as_secs()),
        ] {
            if value == 0 {
                return Err(ConfigError::Invalid {
                    key: format!("limits.{key}"),
                    message: "must be at least 1 (retries of a call would never be linked to it)"
                        .into(),
                });
            }
        }
        if cfg.limits.max_concurrent_upstream == 0 {
            return Err(ConfigError::Invalid {
                key: "limits.max_concurrent_upstream".into(),
                message: "must be at least 1".into(),
            });
        }
        if cfg.recorder.queue_capacity == 0 {
            return Err(ConfigError::Invalid {
                key: "recorder.queue_capacity".into(),
                message: "must be at least 1".into(),
            });
        }
        cfg.auth.check_listen("the gateway", cfg.server.listen)?;
        if !valid_session_id(&cfg.sessions.default_session) {
            return Err(ConfigError::Invalid {
                key: "sessions.default_session".into(),
                message: format!(
                    "'{}' is not a valid session id",
                    cfg.sessions.default_session
                ),
            });
        }
        Ok(cfg)
    }
}

/// `recorder.record_headers` as header names; credentials and bad names refused.
fn record_headers(names: &[String]) -> Result<Vec<http::HeaderName>, ConfigError> {
    names
        .iter()
        .map(|n| {
            let bad = |message: String| ConfigError::Invalid {
                key: "recorder.record_headers".into(),
                message,
            };
            let lower = n.trim().to_ascii_lowercase();
            let secret = ["authorization", "cookie", "set-cookie"].contains(&lower.as_str())
                || ["key", "token", "secret", "auth", "password"]
                    .iter()
                    .any(|w| lower.contains(w));
            if secret {
                return Err(bad(format!(
                    "'{n}' may carry a credential; records never keep those"
                )));
            }
            http::HeaderName::from_bytes(lower.as_bytes())
                .map_err(|_| bad(format!("'{n}' is not a header name")))
        })
        .collect()
}

fn resolve_exact(
    e: &ExactSection,
    model_dir: Option<PathBuf>,
    upstream_url: Option<&str>,
) -> Result<ExactConfig, ConfigError> {
    let model_dir = model_dir
        .or(e.model_dir.clone())
        .ok_or_else(|| ConfigError::Invalid {
            key: "exact.model_dir".into(),
            message: "exact mode renders and tokenizes prompts itself: give the model's HF directory with --model-dir DIR or exact.model_dir".into(),
        })?;
    let backends: Vec<String> = if e.backends.is_empty() {
        match upstream_url {
            Some(u) => vec![u.trim_end_matches("/v1").to_string()],
            None => {
                return Err(ConfigError::Invalid {
                    key: "exact.backends".into(),
                    message: "exact mode needs its SGLang or vLLM backends: set exact.backends = [\"http://host:30000\"] or pass --upstream URL".into(),
                });
            }
        }
    } else {
        e.backends
            .iter()
            .map(|b| {
                let b = b.trim_end_matches('/');
                if !(b.starts_with("http://") || b.starts_with("https://")) {
                    return Err(ConfigError::Invalid {
                        key: "exact.backends".into(),
                        message: format!("'{b}' is not an http:// or https:// URL"),
                    });
                }
                Ok(b.trim_end_matches("/v1").to_string())
            })
            .collect::<Result<_, _>>()?
    };
    let template_kwargs = serde_json::to_value(&e.template_kwargs)
        .ok()
        .and_then(|v| v.as_object().cloned())
        .unwrap_or_default();
    let wire = e.wire.unwrap_or_default();
    if wire == ExactWire::Sglang && e.logprobs_mode.is_some() {
        return Err(ConfigError::Invalid {
            key: "exact.logprobs_mode".into(),
            message: "is vLLM's --logprobs-mode and needs exact.wire = \"vllm\"; SGLang's logprobs are after temperature: remove it".into(),
        });
    }
    if wire == ExactWire::Sglang && e.vllm_strict_tool_calling.is_some() {
        return Err(ConfigError::Invalid {
            key: "exact.vllm_strict_tool_calling".into(),
            message: "is vLLM's VLLM_ENFORCE_STRICT_TOOL_CALLING and needs exact.wire = \"vllm\"; remove it".into(),
        });
    }
    let logprobs = wire.logprob_kind(e.logprobs_mode);
    let history_per_session = e.history_per_session.unwrap_or(4);
    if history_per_session == 0 {
        return Err(ConfigError::Invalid {
            key: "exact.history_per_session".into(),
            message: "must be at least 1 (prefix reuse needs the previous call)".into(),
        });
    }
    Ok(ExactConfig {
        model_dir,
        backends,
        tool_call_format: e
            .tool_call_format
            .unwrap_or(graft_reconstruct::parser::ToolCallFormat::Hermes),
        reasoning_format: e
            .reasoning_format
            .unwrap_or(graft_reconstruct::parser::ReasoningFormat::Think),
        max_new_tokens: e.max_new_tokens.unwrap_or(8192),
        context_length: e.context_length,
        history_per_session,
        history_max_tokens: e.history_max_tokens.unwrap_or(100_000_000),
        template_kwargs,
        backend_api_key: e
            .backend_api_key
            .as_ref()
            .map(|k| k.resolve("exact.backend_api_key"))
            .transpose()?,
        admin_api_key: e
            .admin_api_key
            .as_ref()
            .map(|k| k.resolve("exact.admin_api_key"))
            .transpose()?,
        check_backends: e.check_backends.unwrap_or(true),
        wire,
        logprobs,
        vllm_strict_tool_calling: e.vllm_strict_tool_calling.unwrap_or(true),
    })
}

/// Upstream base URLs are written like OpenAI's `base_url`: `http://host:port/v1`. A URL with
/// no path gets `/v1`.
fn normalize_upstream(url: &str) -> Result<String, ConfigError> {
    let uri: http::Uri = url.parse().map_err(|e| ConfigError::Invalid {
        key: "upstream.url".into(),
        message: format!("'{url}' is not a URL: {e}"),
    })?;
    match uri.scheme_str() {
        Some("http") | Some("https") => {}
        _ => {
            return Err(ConfigError::Invalid {
                key: "upstream.url".into(),
                message: format!("'{url}' must start with http:// or https://"),
            });
        }
    }
    let trimmed = url.trim_end_matches('/');
    if uri.path() == "/" || uri.path().is_empty() {
        Ok(format!("{trimmed}/v1"))
    } else {
        Ok(trimmed.to_string())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unknown_key_is_rejected_with_its_name() {
        let err = FileConfig::from_toml("[limits]\nmax_body_byte = 3\n", Path::new("g.toml"))
            .unwrap_err()
            .to_string();
        assert!(err.contains("max_body_byte"), "{err}");
    }

    #[test]
    fn the_retry_memory_bounds_are_read_and_a_zero_is_refused_by_name() {
        let up = Overrides {
            upstream: Some("http://u:1".into()),
            ..Default::default()
        };
        let f = FileConfig::from_toml(
            "[limits]\nretry_memory_attempts = 100\nretry_memory_bytes = 4096\nretry_memory_secs = 30\n",
            Path::new("g.toml"),
        )
        .unwrap();
        let c = GatewayConfig::resolve(f, up.clone()).unwrap();
        assert_eq!(
            c.limits.retries,
            crate::retries::Bounds {
                attempts: 100,
                bytes: 4096,
                ttl: Duration::from_secs(30)
            }
        );
        let c = GatewayConfig::resolve(FileConfig::default(), up.clone()).unwrap();
        assert_eq!(c.limits.retries, crate::retries::Bounds::default());
        for key in ["retry_memory_attempts", "retry_memory_secs"] {
            let f = FileConfig::from_toml(&format!("[limits]\n{key} = 0\n"), Path::new("g.toml"))
                .unwrap();
            let err = GatewayConfig::resolve(f, up.clone())
                .unwrap_err()
                .to_string();
            assert!(err.contains(&format!("limits.{key}")), "{err}");
        }
    }

    #[test]
    fn env_secret_resolves_and_missing_env_is_named() {
        let f = FileConfig::from_toml(
            "[upstream]\nurl = \"http://x:1\"\napi_key = \"env::GRAFT_TEST_SURELY_UNSET_VAR\"\n",
            Path::new("g.toml"),
        )
        .unwrap();
        let err = GatewayConfig::resolve(f, Overrides::default())
            .unwrap_err()
            .to_string();
        assert!(err.contains("GRAFT_TEST_SURELY_UNSET_VAR") && err.contains("upstream.api_key"));
    }

    #[test]
    fn recorded_headers_are_lower_cased_and_credentials_refused() {
        let with = |names: &str| {
            let f = FileConfig::from_toml(
                &format!(
                    "[upstream]\nurl = \"http://x:1\"\n[recorder]\nrecord_headers = {names}\n"
                ),
                Path::new("g.toml"),
            )
            .unwrap();
            GatewayConfig::resolve(f, Overrides::default()).map(|c| c.recorder.record_headers)
        };
        let kept = with(r#"["X-Codex-Turn-Metadata", "originator"]"#).unwrap();
        assert_eq!(kept, ["x-codex-turn-metadata", "originator"]);
        for bad in ["Authorization", "x-api-key", "Cookie", "x-session-token"] {
            let err = with(&format!("[\"{bad}\"]")).unwrap_err().to_string();
            assert!(
                err.contains("recorder.record_headers") && err.contains("credential"),
                "{bad}: {err}"
            );
        }
        let err = with(r#"["not a header"]"#).unwrap_err().to_string();
        assert!(err.contains("is not a header name"), "{err}");
    }

    #[test]
    fn the_example_config_is_valid_and_complete() {
        let text = include_str!("../../examples/graft.toml");
        let f = FileConfig::from_toml(text, Path::new("examples/graft.toml")).unwrap();
        let c = GatewayConfig::resolve(f, Overrides::default()).unwrap();
        let BackendConfig::OpenAi(up) = &c.backend else {
            panic!("the example is a passthrough gateway: {:?}", c.backend)
        };
        assert_eq!(up.url, "http://127.0.0.1:30000/v1");
        assert_eq!(c.recorder.durability, DurabilityMode::Sync);
        assert_eq!(up.token_ids, crate::token_ids::TokenIdsMode::Off);
        assert!(!c.auth.require_client_key && !c.auth.insecure_open_admin);
    }

    #[test]
    fn beyond_loopback_needs_an_admin_key_and_client_keys_by_default() {
        let beyond = Overrides {
            listen: Some(([0, 0, 0, 0], 8400).into()),
            upstream: Some("http://u:1".into()),
            ..Default::default()
        };
        let err = GatewayConfig::resolve(FileConfig::default(), beyond.clone())
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("0.0.0.0:8400")
                && err.contains("auth.admin_key")
                && err.contains("--insecure-open-admin"),
            "{err}"
        );
        // With a key: starts, and model calls need a key by default.
        let f =
            FileConfig::from_toml("[auth]\nadmin_key = \"a-key\"\n", Path::new("g.toml")).unwrap();
        let c = GatewayConfig::resolve(f, beyond.clone()).unwrap();
        assert!(c.auth.require_client_key);
        assert!(!format!("{:?}", c.auth).contains("a-key"));
        // The explicit opt-outs.
        let f = FileConfig::from_toml(
            "[auth]\ninsecure_open_admin = true\nrequire_client_key = false\n",
            Path::new("g.toml"),
        )
        .unwrap();
        let c = GatewayConfig::resolve(f, beyond.clone()).unwrap();
        assert!(c.auth.admin_key.is_none() && !c.auth.require_client_key);
        let o = Overrides {
            insecure_open_admin: true,
            ..beyond
        };
        assert!(GatewayConfig::resolve(FileConfig::default(), o).is_ok());
        // Loopback (v4 and v6) needs neither.
        for l in ["127.0.0.1:0", "[::1]:0"] {
            let o = Overrides {
                listen: Some(l.parse().unwrap()),
                upstream: Some("http://u:1".into()),
                ..Default::default()
            };
            let c = GatewayConfig::resolve(FileConfig::default(), o).unwrap();
            assert!(!c.auth.require_client_key, "{l}");
        }
    }

    #[test]
    fn a_sampling_policy_is_read_and_a_negative_temperature_refused() {
        let f = FileConfig::from_toml(
            "[upstream]\nurl = \"http://u:1/v1\"\n[sampling]\nmode = \"default\"\ntemperature = 0.7\nmax_new_tokens = 256\n",
            Path::new("g.toml"),
        )
        .unwrap();
        let c = GatewayConfig::resolve(f, Overrides::default()).unwrap();
        let p = c.sampling.unwrap();
        assert_eq!(p.mode, crate::policy::PolicyMode::Default);
        assert_eq!((p.temperature, p.max_new_tokens), (Some(0.7), Some(256)));
        let f = FileConfig::from_toml(
            "[upstream]\nurl = \"http://u:1/v1\"\n[sampling]\ntemperature = -1.0\n",
            Path::new("g.toml"),
        )
        .unwrap();
        let err = GatewayConfig::resolve(f, Overrides::default())
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("sampling.temperature") && err.contains("-1"),
            "{err}"
        );
        let err = FileConfig::from_toml("[sampling]\ntemp = 1.0\n", Path::new("g.toml"))
            .unwrap_err()
            .to_string();
        assert!(err.contains("temp"), "{err}");
    }

    #[test]
    fn exact_mode_needs_a_model_dir_and_takes_backends() {
        let f =
            FileConfig::from_toml("[upstream]\nmode = \"exact\"\n", Path::new("g.toml")).unwrap();
        let o = Overrides {
            upstream: Some("http://sglang:30000".into()),
            ..Default::default()
        };
        let err = GatewayConfig::resolve(f, o.clone())
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("exact.model_dir") && err.contains("--model-dir"),
            "{err}"
        );
        let f = FileConfig::from_toml(
            "[upstream]\nmode = \"exact\"\n[exact]\nmodel_dir = \"m\"\ntemplate_kwargs = { enable_thinking = false }\n",
            Path::new("g.toml"),
        )
        .unwrap();
        let c = GatewayConfig::resolve(f, o.clone()).unwrap();
        let BackendConfig::Sglang(e) = c.backend else {
            panic!("exact mode resolves to the SGLang backend")
        };
        // The default backend is the upstream without /v1 (SGLang's native routes).
        assert_eq!(e.backends, vec!["http://sglang:30000".to_string()]);
        assert_eq!(e.template_kwargs["enable_thinking"], false);
        assert_eq!(e.max_new_tokens, 8192);
        let f = FileConfig::from_toml("[exact]\nbackends = [\"sglang:1\"]\n", Path::new("g.toml"))
            .unwrap();
        let o2 = Overrides {
            mode: Some(Mode::Exact),
            model_dir: Some("m".into()),
            ..o
        };
        let err = GatewayConfig::resolve(f, o2).unwrap_err().to_string();
        assert!(
            err.contains("exact.backends") && err.contains("sglang:1"),
            "{err}"
        );
        let err =
            FileConfig::from_toml("[exact]\ntool_call_format = \"xml\"\n", Path::new("g.toml"))
                .unwrap_err()
                .to_string();
        assert!(
            err.contains("tool_call_format") || err.contains("xml"),
            "{err}"
        );
    }

    #[test]
    fn token_ids_mode_is_strict() {
        use crate::token_ids::TokenIdsMode;
        let f = FileConfig::from_toml(
            "[upstream]\nurl = \"http://x:1\"\ntoken_ids = \"vllm\"\n",
            Path::new("g.toml"),
        )
        .unwrap();
        let c = GatewayConfig::resolve(f, Overrides::default()).unwrap();
        let BackendConfig::OpenAi(up) = c.backend else {
            panic!("passthrough")
        };
        assert_eq!(up.token_ids, TokenIdsMode::Vllm);
        let f = FileConfig::from_toml("[upstream]\ntoken_ids = \"sglang\"\n", Path::new("g.toml"))
            .unwrap();
        assert_eq!(f.upstream.token_ids, Some(TokenIdsMode::Sglang));
        let err = FileConfig::from_toml("[upstream]\ntoken_ids = \"yes\"\n", Path::new("g.toml"))
            .unwrap_err()
            .to_string();
        assert!(err.contains("token_ids") || err.contains("yes"), "{err}");
        assert!(
            FileConfig::from_toml("[upstream]\ntoken_ids = true\n", Path::new("g.toml")).is_err()
        );
    }

    #[test]
    fn exact_wire_defaults_to_sglang_and_logprobs_mode_needs_vllm() {
        let resolve = |extra: &str| {
            let f = FileConfig::from_toml(
                &format!("[upstream]\nmode = \"exact\"\n[exact]\nmodel_dir = \"m\"\nbackends = [\"http://a:1\"]\n{extra}"),
                Path::new("g.toml"),
            )
            .unwrap();
            GatewayConfig::resolve(f, Overrides::default())
        };
        let BackendConfig::Sglang(e) = resolve("").unwrap().backend else {
            panic!("exact")
        };
        assert_eq!(e.wire, ExactWire::Sglang);
        assert_eq!(e.logprobs, LogprobKind::PostTemperature);
        let BackendConfig::Sglang(e) = resolve("wire = \"vllm\"").unwrap().backend else {
            panic!("exact")
        };
        assert_eq!(e.wire, ExactWire::Vllm);
        assert_eq!(e.logprobs, LogprobKind::PreTemperature);
        let BackendConfig::Sglang(e) =
            resolve("wire = \"vllm\"\nlogprobs_mode = \"processed_logprobs\"")
                .unwrap()
                .backend
        else {
            panic!("exact")
        };
        assert_eq!(e.logprobs, LogprobKind::PostTemperature);
        assert!(e.vllm_strict_tool_calling, "vLLM's default");
        let BackendConfig::Sglang(e) = resolve("wire = \"vllm\"\nvllm_strict_tool_calling = false")
            .unwrap()
            .backend
        else {
            panic!("exact")
        };
        assert!(!e.vllm_strict_tool_calling);
        let err = resolve("vllm_strict_tool_calling = true")
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("exact.vllm_strict_tool_calling") && err.contains("vllm"),
            "{err}"
        );
        let err = resolve("logprobs_mode = \"raw_logprobs\"")
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("exact.logprobs_mode") && err.contains("vllm"),
            "{err}"
        );
        let err = FileConfig::from_toml("[exact]\nwire = \"trtllm\"\n", Path::new("g.toml"))
            .unwrap_err()
            .to_string();
        assert!(err.contains("trtllm"), "{err}");
    }

    #[test]
    fn exact_mode_needs_no_openai_upstream_and_refuses_passthrough_settings() {
        // Backends named in [exact]: no upstream.url anywhere.
        let f = FileConfig::from_toml(
            "[upstream]\nmode = \"exact\"\n[exact]\nmodel_dir = \"m\"\nbackends = [\"http://a:1\", \"http://b:2/v1\"]\n",
            Path::new("g.toml"),
        )
        .unwrap();
        let c = GatewayConfig::resolve(f, Overrides::default()).unwrap();
        let BackendConfig::Sglang(e) = &c.backend else {
            panic!("exact")
        };
        assert_eq!(e.backends, vec!["http://a:1", "http://b:2"]);
        assert_eq!(c.backend.mode(), Mode::Exact);
        // No backends and no upstream: the error says how to give one.
        let f = FileConfig::from_toml(
            "[upstream]\nmode = \"exact\"\n[exact]\nmodel_dir = \"m\"\n",
            Path::new("g.toml"),
        )
        .unwrap();
        let err = GatewayConfig::resolve(f, Overrides::default())
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("exact.backends") && err.contains("--upstream"),
            "{err}"
        );
        // Passthrough-only keys in exact mode are refused, not ignored.
        for (key, line) in [
            ("upstream.token_ids", "token_ids = \"vllm\""),
            ("upstream.dialects", "dialects = [\"responses\"]"),
        ] {
            let f = FileConfig::from_toml(
                &format!("[upstream]\nmode = \"exact\"\nurl = \"http://s:1\"\n{line}\n[exact]\nmodel_dir = \"m\"\n"),
                Path::new("g.toml"),
            )
            .unwrap();
            let err = GatewayConfig::resolve(f, Overrides::default())
                .unwrap_err()
                .to_string();
            assert!(err.contains(key) && err.contains("passthrough"), "{err}");
        }
        // In process: typed constructors, no TOML.
        let c = GatewayConfig::new(BackendConfig::Sglang(
            ExactConfig::new("m".into(), vec!["http://s:3".into()]).unwrap(),
        ))
        .unwrap();
        assert_eq!(c.backend.describe(), "http://s:3");
        assert_eq!(c.recorder.durability, DurabilityMode::Sync);
    }

    #[test]
    fn upstream_without_path_gets_v1() {
        assert_eq!(normalize_upstream("http://h:1").unwrap(), "http://h:1/v1");
        assert_eq!(normalize_upstream("http://h:1/").unwrap(), "http://h:1/v1");
        assert_eq!(
            normalize_upstream("https://h/api/v1/").unwrap(),
            "https://h/api/v1"
        );
        assert!(normalize_upstream("ftp://h").is_err());
    }
}

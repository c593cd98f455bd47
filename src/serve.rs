//! `graft serve`: the trainer's model behind SGLang's native API, so exact mode, weight
//! pushes and the whole loop run on one machine (CPU included).
//!
//! Routes (SGLang's names and shapes): `POST /generate` (`input_ids` or `text`,
//! `sampling_params` with temperature / top_p / top_k / min_p / logit_bias / penalties /
//! sampling_seed / max_new_tokens / stop / stop_token_ids / ignore_eos — other parameters that would change
//! the sampling are refused by name, and a key SGLang 0.5.23 does not read with SGLang's own
//! 400 `{"error": "unknown field ..."}` —, `return_logprob`, `stream`: SSE events holding
//! everything so far, then `data: [DONE]`, `rid`: the answer's `meta_info.id`),
//! `/abort_request {rid | abort_all}`, `/pause_generation {mode}`, `/continue_generation`,
//! `/flush_cache`, `/update_weights_from_disk {model_path, weight_version}`,
//! `/model_info` (and the older `/get_model_info`), `/server_info` (`graft: true`: not
//! SGLang), `/health`; graft's own `GET /graft/engine` says where the engine's
//! steps spend their time. Concurrent requests are decoded as one batch by the
//! engine (`graft_trainer::engine`). Bodies and answers are `graft-wire`'s SGLang types, the
//! ones the gateway and the trainer's push use.

use std::collections::HashMap;
use std::convert::Infallible;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::pin::Pin;
use std::sync::{Arc, Mutex, PoisonError};
use std::task::{Context as TaskContext, Poll};

use anyhow::Context;
use bytes::Bytes;
use graft_reconstruct::template::Tokenizer;
use graft_trainer::engine::{
    Engine, EngineFinish, Event, PauseMode, Request as EngineRequest, RequestId,
};
use graft_trainer::generate::SamplingParams;
use graft_trainer::model::Model;
use graft_wire::sglang::{
    self as wire, ErrorResponse, FinishReason, GenerateRequest, GenerateResponse, Matched,
    MessageResponse, MetaInfo, ModelInfo, PauseGenerationRequest, ServerInfo, TokenLogprob,
    UpdateWeightsFromDiskRequest, UpdateWeightsFromDiskResponse,
};
use http::{Method, Response, StatusCode, header};
use http_body_util::{BodyExt, Full, combinators::UnsyncBoxBody};
use hyper::body::{Frame, Incoming};
use serde::Deserialize as _;
use serde_json::{Value, json};

type RespBody = UnsyncBoxBody<Bytes, Infallible>;
/// A control call, run on a blocking thread (the engine's API blocks).
type ControlFn = Box<dyn FnOnce(&State) -> Result<Value, String> + Send>;

#[derive(Debug, clap::Args)]
pub struct ServeArgs {
    /// HF model directory (config.json + safetensors; tokenizer.json for `text` in and out).
    #[arg(long)]
    pub model: PathBuf,
    /// Address to listen on (port 0 picks a free port; the real address is printed).
    #[arg(long, default_value = "127.0.0.1:30000")]
    pub listen: SocketAddr,
    /// Requests decoded together at most.
    #[arg(long, default_value_t = ServeConfig::MAX_BATCH)]
    pub max_batch: usize,
    /// The weight_version reported until the first update.
    #[arg(long, default_value = ServeConfig::WEIGHT_VERSION)]
    pub weight_version: String,
    /// The largest request body read (a `/generate` of a million prompt ids is about 8 MB);
    /// a longer one is answered 413.
    #[arg(long, default_value_t = ServeConfig::MAX_BODY_BYTES)]
    pub max_body_bytes: usize,
}

/// What `graft serve` runs with: the command's flags, or an in-process user's choice (`graft
/// rl`'s embedded backend).
#[derive(Debug, Clone)]
pub struct ServeConfig {
    /// HF model directory.
    pub model: PathBuf,
    pub listen: SocketAddr,
    /// Requests decoded together at most.
    pub max_batch: usize,
    /// The weight_version reported until the first update.
    pub weight_version: String,
    /// The largest request body read; a longer one is answered 413.
    pub max_body_bytes: usize,
}

impl ServeConfig {
    pub const MAX_BATCH: usize = 32;
    pub const WEIGHT_VERSION: &str = "default";
    pub const MAX_BODY_BYTES: usize = 64 << 20;

    /// The model at `model`, on `listen`, with the command's defaults otherwise.
    pub fn new(model: PathBuf, listen: SocketAddr) -> Self {
        ServeConfig {
            model,
            listen,
            max_batch: Self::MAX_BATCH,
            weight_version: Self::WEIGHT_VERSION.to_owned(),
            max_body_bytes: Self::MAX_BODY_BYTES,
        }
    }
}

impl From<ServeArgs> for ServeConfig {
    fn from(a: ServeArgs) -> Self {
        ServeConfig {
            model: a.model,
            listen: a.listen,
            max_batch: a.max_batch,
            weight_version: a.weight_version,
            max_body_bytes: a.max_body_bytes,
        }
    }
}

struct State {
    /// The model's vocabulary size: token ids are below it.
    vocab: i64,
    engine: Arc<Engine>,
    tokenizer: Option<Tokenizer>,
    model_path: PathBuf,
    /// The running requests that came with a `rid`, by it (for `/abort_request`).
    rids: Mutex<HashMap<String, RequestId>>,
    max_body_bytes: usize,
}

impl State {
    fn rids(&self) -> std::sync::MutexGuard<'_, HashMap<String, RequestId>> {
        self.rids.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// Forgets a request's `rid` when its generation ends, however it ends.
struct RidGuard {
    state: Arc<State>,
    rid: Option<String>,
}

impl Drop for RidGuard {
    fn drop(&mut self) {
        if let Some(r) = &self.rid {
            self.state.rids().remove(r);
        }
    }
}

pub async fn run(a: ServeArgs) -> anyhow::Result<()> {
    let (addr, device, _engine, serve) = start(&ServeConfig::from(a)).await?;
    {
        use std::io::Write as _;
        let mut out = std::io::stdout().lock();
        writeln!(out, "graft serve listening on http://{addr} ({device:?})")?;
        out.flush()?;
    }
    serve.await
}

/// Loads the model and binds; returns the address, the device, the engine (so a trainer in
/// the same process can hand it new weights as tensors:
/// [`Engine::update_weights_from_tensors`]) and the future that serves (until Ctrl-C or
/// SIGTERM, or until it is dropped).
pub async fn start(
    a: &ServeConfig,
) -> anyhow::Result<(
    std::net::SocketAddr,
    graft_trainer::tch::Device,
    Arc<Engine>,
    impl std::future::Future<Output = anyhow::Result<()>> + use<>,
)> {
    let dev = graft_trainer::device::init();
    let model = Model::load(&a.model, dev.device, dev.compute_kind())
        .with_context(|| format!("loading the model from {}", a.model.display()))?;
    let tokenizer = Tokenizer::from_dir(&a.model).ok();
    if tokenizer.is_none() {
        tracing::warn!(dir = %a.model.display(), "serve: no tokenizer here; /generate takes input_ids only and answers no text");
    }
    let vocab = model.spec().vocab_size;
    let engine = Arc::new(Engine::start(model, a.weight_version.clone(), a.max_batch)?);
    let state = Arc::new(State {
        vocab,
        engine: Arc::clone(&engine),
        tokenizer,
        model_path: a.model.clone(),
        rids: Mutex::new(HashMap::new()),
        max_body_bytes: a.max_body_bytes,
    });
    let listener = tokio::net::TcpListener::bind(a.listen)
        .await
        .with_context(|| {
            format!(
                "cannot listen on {}; pick another --listen address",
                a.listen
            )
        })?;
    let addr = listener
        .local_addr()
        .context("cannot read the bound address")?;
    Ok((addr, dev.device, engine, serve(listener, state)))
}

async fn serve(listener: tokio::net::TcpListener, state: Arc<State>) -> anyhow::Result<()> {
    let handler = move |req| {
        let state = Arc::clone(&state);
        async move { Ok::<_, Infallible>(handle(state, req).await) }
    };
    graft_http::serve(
        listener,
        graft_http::Options::new("serve"),
        handler,
        graft_http::shutdown_signal(),
    )
    .await;
    Ok(())
}

fn full(bytes: impl Into<Bytes>) -> RespBody {
    Full::new(bytes.into()).boxed_unsync()
}

fn json_response(status: StatusCode, v: &Value) -> Response<RespBody> {
    graft_http::json_response(status, v, full)
}

/// SGLang's error shape.
fn error(status: StatusCode, message: &str) -> Response<RespBody> {
    json_response(
        status,
        &to_value(&ErrorResponse::new(
            status.as_u16(),
            "BadRequestError",
            message,
        )),
    )
}

/// How long a request body may take to arrive whole.
const BODY_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(60);

async fn handle(state: Arc<State>, req: hyper::Request<Incoming>) -> Response<RespBody> {
    let method = req.method().clone();
    let path = req.uri().path().to_owned();
    let body =
        match graft_http::read_body(req.into_body(), state.max_body_bytes, BODY_TIMEOUT).await {
            Ok(b) => b,
            Err(e @ graft_http::BodyError::TooLarge { .. }) => {
                return error(StatusCode::PAYLOAD_TOO_LARGE, &e.to_string());
            }
            Err(e) => return error(StatusCode::BAD_REQUEST, &e.to_string()),
        };
    let json: Value = if body.is_empty() {
        json!({})
    } else {
        match serde_json::from_slice(&body) {
            Ok(v) => v,
            Err(e) => {
                return error(
                    StatusCode::BAD_REQUEST,
                    &format!("the body is not JSON: {e}"),
                );
            }
        }
    };
    let st = Arc::clone(&state);
    let control = |f: ControlFn| async move {
        match tokio::task::spawn_blocking(move || f(&st)).await {
            Ok(Ok(v)) => json_response(StatusCode::OK, &v),
            Ok(Err(e)) => error(StatusCode::BAD_REQUEST, &e),
            Err(e) => error(StatusCode::INTERNAL_SERVER_ERROR, &e.to_string()),
        }
    };
    match (method, path.as_str()) {
        (Method::GET, wire::path::HEALTH) | (Method::GET, wire::path::HEALTH_GENERATE) => {
            json_response(StatusCode::OK, &json!({}))
        }
        (Method::GET, wire::path::SERVER_INFO | wire::path::GET_SERVER_INFO) => json_response(
            StatusCode::OK,
            &to_value(&ServerInfo {
                version: Some(env!("CARGO_PKG_VERSION").to_string()),
                // Streamed events hold everything so far.
                incremental_streaming_output: Some(false),
                load_format: Some("safetensors".into()),
                model_path: Some(state.model_path.display().to_string()),
                graft: Some(true),
            }),
        ),
        (Method::GET | Method::POST, wire::path::GET_MODEL_INFO | wire::path::MODEL_INFO) => {
            let path = state.model_path.display().to_string();
            control(Box::new(move |s| {
                let info = s.engine.info().map_err(|e| e.to_string())?;
                Ok(to_value(&ModelInfo {
                    model_path: path.clone(),
                    tokenizer_path: Some(path),
                    is_generation: true,
                    weight_version: Some(info.weight_version),
                    running: Some(info.running as u64),
                    waiting: Some(info.waiting as u64),
                    paused: Some(info.paused),
                    ..ModelInfo::default()
                }))
            }))
            .await
        }
        (Method::GET, "/graft/engine") => {
            control(Box::new(|s| {
                let info = s.engine.info().map_err(|e| e.to_string())?;
                Ok(json!({
                    "weight_version": info.weight_version,
                    "running": info.running,
                    "waiting": info.waiting,
                    "max_batch_seen": info.max_batch_seen,
                    "timing": to_value(&info.timing),
                }))
            }))
            .await
        }
        (Method::POST, wire::path::PAUSE_GENERATION) => {
            let req = match PauseGenerationRequest::deserialize(&json) {
                Ok(r) => r,
                Err(e) => {
                    return error(
                        StatusCode::BAD_REQUEST,
                        &format!("{e}: mode must be one of abort, retract, in_place"),
                    );
                }
            };
            let mode = match req.mode.unwrap_or_default() {
                wire::PauseMode::Abort => PauseMode::Abort,
                wire::PauseMode::Retract => PauseMode::Retract,
                wire::PauseMode::InPlace => PauseMode::InPlace,
            };
            control(Box::new(move |s| {
                s.engine.pause(mode).map_err(|e| e.to_string())?;
                Ok(message("paused"))
            }))
            .await
        }
        (Method::POST, wire::path::CONTINUE_GENERATION) => {
            control(Box::new(|s| {
                s.engine.resume().map_err(|e| e.to_string())?;
                Ok(message("continued"))
            }))
            .await
        }
        (Method::GET | Method::POST, wire::path::FLUSH_CACHE) => {
            control(Box::new(|s| {
                s.engine.flush_cache().map_err(|e| e.to_string())?;
                Ok(message("Cache flushed."))
            }))
            .await
        }
        (Method::POST, wire::path::UPDATE_WEIGHTS_FROM_DISK) => {
            let Ok(req) = UpdateWeightsFromDiskRequest::deserialize(&json) else {
                return error(
                    StatusCode::BAD_REQUEST,
                    "update_weights_from_disk needs 'model_path'",
                );
            };
            let dir = PathBuf::from(&req.model_path);
            let version = req
                .weight_version
                .unwrap_or_else(|| dir.display().to_string());
            let st = Arc::clone(&state);
            let answer = |success: bool, message: String| UpdateWeightsFromDiskResponse {
                success,
                message,
                num_paused_requests: 0,
            };
            match tokio::task::spawn_blocking(move || st.engine.update_weights(dir, version)).await
            {
                Ok(Ok(())) => json_response(
                    StatusCode::OK,
                    &to_value(&answer(
                        true,
                        "Succeeded to update model weights.".to_owned(),
                    )),
                ),
                Ok(Err(e)) => json_response(
                    StatusCode::BAD_REQUEST,
                    &to_value(&answer(false, e.to_string())),
                ),
                Err(e) => error(StatusCode::INTERNAL_SERVER_ERROR, &e.to_string()),
            }
        }
        (Method::POST, wire::path::GENERATE) => generate(state, &json).await,
        (Method::POST, wire::path::ABORT_REQUEST) => {
            let req = match wire::AbortRequest::deserialize(&json) {
                Ok(r) => r,
                Err(e) => {
                    return error(
                        StatusCode::BAD_REQUEST,
                        &format!(
                            "abort_request takes {{\"rid\": string}} or {{\"abort_all\": true}}: {e}"
                        ),
                    );
                }
            };
            let ids: Vec<RequestId> = {
                let rids = state.rids();
                match (req.abort_all, &req.rid) {
                    (Some(true), _) => rids.values().copied().collect(),
                    (_, Some(r)) => rids.get(r).copied().into_iter().collect(),
                    _ => {
                        return error(
                            StatusCode::BAD_REQUEST,
                            "abort_request needs 'rid' or 'abort_all': true",
                        );
                    }
                }
            };
            // A rid that is not running (finished, or never sent) is nothing to abort, as
            // in SGLang.
            for id in &ids {
                let _ = state.engine.abort(*id);
            }
            json_response(StatusCode::OK, &json!({"aborted": ids.len()}))
        }
        (_, p) => error(StatusCode::NOT_FOUND, &format!("no route {p}")),
    }
}

/// A parsed `/generate` request.
struct Gen {
    /// The client's request id (`/abort_request` takes it; the answer's `meta_info.id`).
    rid: Option<String>,
    input_ids: Vec<i64>,
    params: SamplingParams,
    stop: Vec<String>,
    ignore_eos: bool,
    return_logprob: bool,
    stream: bool,
}

fn parse_generate(state: &State, v: &Value) -> Result<Gen, String> {
    let req = GenerateRequest::deserialize(v).map_err(|e| unfit(v, &e))?;
    let input_ids: Vec<i64> = match (req.input_ids, req.text) {
        (Some(ids), _) => ids.into_iter().map(i64::from).collect(),
        (None, Some(text)) => {
            let tok = state.tokenizer.as_ref().ok_or(
                "this server has no tokenizer (no tokenizer.json in --model); send input_ids",
            )?;
            tok.encode(&text)
                .map_err(|e| e.to_string())?
                .into_iter()
                .map(i64::from)
                .collect()
        }
        (None, None) => return Err("/generate needs 'input_ids' or 'text'".to_owned()),
    };
    if input_ids.is_empty() {
        return Err("the prompt is empty".to_owned());
    }
    // Checked here: an id the model has no embedding for would fail the engine's whole batch.
    if let Some(bad) = input_ids.iter().find(|&&i| i >= state.vocab) {
        return Err(format!(
            "input_ids holds {bad}, outside the model's vocabulary (0..{})",
            state.vocab
        ));
    }
    let sp = req.sampling_params.unwrap_or_default();
    let stop: Vec<String> = sp.stop.as_ref().map(wire::Stop::to_vec).unwrap_or_default();
    if !stop.is_empty() && state.tokenizer.is_none() {
        return Err(
            "'stop' strings need a tokenizer (no tokenizer.json in --model); use stop_token_ids"
                .to_owned(),
        );
    }
    unsupported(&sp)?;
    let logit_bias = match &sp.logit_bias {
        None => Vec::new(),
        Some(m) => {
            m.iter()
                .map(|(k, v)| {
                    let id = k
                        .parse::<u32>()
                        .map_err(|_| format!("logit_bias keys are token ids; '{k}' is not one"))?;
                    if i64::from(id) >= state.vocab {
                        return Err(format!(
                            "logit_bias names token {id}, outside the vocabulary (0..{})",
                            state.vocab
                        ));
                    }
                    let b = v.as_f64().filter(|b| b.is_finite()).ok_or_else(|| {
                        format!("logit_bias['{k}'] must be a finite number, got {v}")
                    })?;
                    Ok((i64::from(id), b as f32))
                })
                .collect::<Result<Vec<_>, String>>()?
        }
    };
    let params = SamplingParams {
        temperature: sp.temperature.unwrap_or(1.0),
        top_p: sp.top_p.unwrap_or(1.0),
        top_k: sp.top_k.unwrap_or(-1),
        min_p: sp.min_p.unwrap_or(0.0),
        logit_bias,
        max_new_tokens: sp.max_new_tokens.unwrap_or(128) as usize,
        stop_token_ids: sp.stop_token_ids.unwrap_or_default(),
        frequency_penalty: sp.frequency_penalty.unwrap_or(0.0),
        presence_penalty: sp.presence_penalty.unwrap_or(0.0),
        repetition_penalty: sp.repetition_penalty.unwrap_or(1.0),
        seed: sp.sampling_seed.map(|s| s as u64),
    };
    // SGLang's SamplingParams.verify ranges.
    for (name, v, lo, hi) in [
        ("frequency_penalty", params.frequency_penalty, -2.0, 2.0),
        ("presence_penalty", params.presence_penalty, -2.0, 2.0),
        ("repetition_penalty", params.repetition_penalty, 0.0, 2.0),
    ] {
        if !(lo..=hi).contains(&v) {
            return Err(format!("{name} must be in [{lo}, {hi}], got {v}"));
        }
    }
    if !(0.0..=1.0).contains(&params.min_p) {
        return Err(format!("min_p must lie in [0, 1], got {}", params.min_p));
    }
    Ok(Gen {
        rid: req.rid,
        input_ids,
        params,
        stop,
        ignore_eos: sp.ignore_eos.unwrap_or(false),
        return_logprob: req.return_logprob.unwrap_or(false),
        stream: req.stream.unwrap_or(false),
    })
}

/// Refuses sampling parameters this server does not implement when they ask for something
/// (a value other than the one that changes nothing): sampling under other parameters
/// than the client asked for would be silent. Penalties and `sampling_seed` are honoured
/// (a seeded request samples the same tokens whatever it is batched with).
fn unsupported(sp: &wire::SamplingParams) -> Result<(), String> {
    let mut asked: Vec<String> = Vec::new();
    let mut check = |name: &str, set: bool, v: String| {
        if set {
            asked.push(format!("{name} = {v}"));
        }
    };
    check(
        "min_new_tokens",
        sp.min_new_tokens.is_some_and(|n| n > 0),
        format!("{}", sp.min_new_tokens.unwrap_or_default()),
    );
    check(
        "n",
        sp.n.is_some_and(|n| n != 1),
        format!("{}", sp.n.unwrap_or(1)),
    );
    for (name, v) in [
        ("json_schema", &sp.json_schema),
        ("regex", &sp.regex),
        ("ebnf", &sp.ebnf),
    ] {
        check(name, v.is_some(), "(set)".into());
    }
    check(
        "custom_params",
        sp.custom_params.as_ref().is_some_and(|m| !m.is_empty()),
        "(set)".into(),
    );
    if asked.is_empty() {
        return Ok(());
    }
    Err(format!(
        "graft serve does not implement {}: it samples with temperature, top_p, top_k, min_p, logit_bias, frequency_penalty, presence_penalty, repetition_penalty, sampling_seed, max_new_tokens, stop, stop_token_ids and ignore_eos only; leave the others out or use SGLang",
        asked.join(", ")
    ))
}

/// Why a `/generate` body does not fit the wire, naming the field for the common cases
/// (batches, ids that are not token ids, sampling parameters of the wrong type).
fn unfit(v: &Value, e: &serde_json::Error) -> String {
    let is_token_id = |x: &Value| x.as_u64().is_some_and(|i| u32::try_from(i).is_ok());
    match (v.get("input_ids"), v.get("text")) {
        (Some(Value::Array(a)), _) if a.iter().any(Value::is_array) => {
            return "'input_ids' must be one list of token ids (batches are not supported)"
                .to_owned();
        }
        (Some(Value::Array(a)), _) => {
            if let Some(bad) = a.iter().find(|x| !is_token_id(x)) {
                return format!("'input_ids' holds {bad}, which is not a token id");
            }
        }
        (Some(Value::Null) | None, _) => {}
        (Some(_), _) => {
            return "'input_ids' must be one list of token ids (batches are not supported)"
                .to_owned();
        }
    }
    if v.get("text")
        .is_some_and(|t| !t.is_string() && !t.is_null())
    {
        return "'text' must be one string (batches are not supported)".to_owned();
    }
    if let Some(sp) = v.get("sampling_params").filter(|sp| !sp.is_null())
        && let Err(e) = wire::SamplingParams::deserialize(sp)
    {
        return format!("'sampling_params' does not fit SGLang's SamplingParams: {e}");
    }
    format!("the /generate body does not fit SGLang's GenerateReqInput: {e}")
}

/// A wire value as JSON (plain data, which serde_json always serializes).
fn to_value(v: &impl serde::Serialize) -> Value {
    serde_json::to_value(v).unwrap_or(Value::Null)
}

fn message(text: &str) -> Value {
    to_value(&MessageResponse {
        message: text.to_owned(),
        status: None,
    })
}

/// A token id of the engine (an index into the vocabulary, so never negative and never past
/// `u32`) as the wire's.
fn wire_id(id: i64) -> u32 {
    u32::try_from(id).unwrap_or(u32::MAX)
}

/// What a request has produced so far, rendered in SGLang's answer shape.
struct Answer {
    id: String,
    ids: Vec<i64>,
    logprobs: Vec<f32>,
    prompt_tokens: usize,
    finish: Option<FinishReason>,
    version: String,
    /// Which weights sampled which output tokens (a weight update may land mid-request).
    spans: Vec<wire::WeightVersionSpan>,
    text: String,
    return_logprob: bool,
}

impl Answer {
    fn json(&self) -> Value {
        let answer = GenerateResponse {
            text: self.text.clone(),
            output_ids: self.ids.iter().map(|&i| wire_id(i)).collect(),
            meta_info: MetaInfo {
                output_top_logprobs: None,
                id: Some(self.id.clone()),
                finish_reason: self.finish.clone(),
                prompt_tokens: Some(self.prompt_tokens as u64),
                completion_tokens: Some(self.ids.len() as u64),
                cached_tokens: Some(0),
                weight_version: Some(self.version.clone()),
                // SGLang's spans, when one version does not say it all.
                weight_versions: (self.spans.len() > 1
                    || self
                        .spans
                        .first()
                        .is_some_and(|s| s.version != self.version))
                .then(|| self.spans.clone()),
                output_token_logprobs: self.return_logprob.then(|| {
                    self.ids
                        .iter()
                        .zip(&self.logprobs)
                        .map(|(&i, &l)| TokenLogprob(Some(f64::from(l)), wire_id(i), None))
                        .collect()
                }),
                ..MetaInfo::default()
            },
        };
        to_value(&answer)
    }
}

async fn generate(state: Arc<State>, body: &Value) -> Response<RespBody> {
    // SGLang checks the body against its JSON contract first and refuses a sampling key it
    // does not read with a 400 in the contract's words; so does this server.
    if let Some(e) = wire::sampling_params_contract_error(body) {
        return json_response(
            StatusCode::BAD_REQUEST,
            &to_value(&wire::ContractError { error: e }),
        );
    }
    let g = match parse_generate(&state, body) {
        Ok(g) => g,
        Err(e) => return error(StatusCode::BAD_REQUEST, &e),
    };
    if let Some(r) = &g.rid
        && state.rids().contains_key(r)
    {
        return error(
            StatusCode::BAD_REQUEST,
            &format!("a request with rid '{r}' is already running"),
        );
    }
    let (tx, mut rx) = tokio::sync::mpsc::channel::<Value>(64);
    let stream = g.stream;
    let st = Arc::clone(&state);
    // The engine's channel is blocking: a blocking task turns its events into answers.
    tokio::task::spawn_blocking(move || {
        let req = EngineRequest {
            input_ids: g.input_ids.clone(),
            params: g.params.clone(),
            ignore_eos: g.ignore_eos,
        };
        let (rid, events) = match st.engine.generate(req) {
            Ok(x) => x,
            Err(e) => {
                let _ = tx.blocking_send(json!({"error": e.to_string()}));
                return;
            }
        };
        let _forget = RidGuard {
            state: Arc::clone(&st),
            rid: g.rid.clone(),
        };
        if let Some(r) = &g.rid {
            st.rids().insert(r.clone(), rid);
        }
        let mut a = Answer {
            id: g.rid.clone().unwrap_or_else(|| format!("graft-{rid}")),
            ids: Vec::new(),
            logprobs: Vec::new(),
            prompt_tokens: g.input_ids.len(),
            finish: None,
            version: String::new(),
            spans: Vec::new(),
            text: String::new(),
            return_logprob: g.return_logprob,
        };
        let decode = |ids: &[i64]| -> String {
            let ids: Vec<u32> = ids.iter().filter_map(|&i| u32::try_from(i).ok()).collect();
            st.tokenizer
                .as_ref()
                .and_then(|t| t.decode(&ids).ok())
                .unwrap_or_default()
        };
        let mut stopped: Option<String> = None;
        while let Ok(ev) = events.recv() {
            match ev {
                Event::Token {
                    id,
                    logprob,
                    weight_version,
                } => {
                    if stopped.is_some() {
                        continue;
                    }
                    a.ids.push(id);
                    a.logprobs.push(logprob);
                    let n = a.ids.len() as u64;
                    match a.spans.last_mut() {
                        Some(last) if last.version == weight_version => last.end = n,
                        _ => a.spans.push(wire::WeightVersionSpan {
                            version: weight_version.clone(),
                            start: n - 1,
                            end: n,
                        }),
                    }
                    // Each event names the weights that sampled its newest token.
                    a.version = weight_version;
                    a.text = decode(&a.ids);
                    if let Some(s) = g.stop.iter().find(|s| a.text.contains(s.as_str())) {
                        stopped = Some(s.clone());
                        let _ = st.engine.abort(rid);
                    }
                    if stream && tx.blocking_send(a.json()).is_err() {
                        let _ = st.engine.abort(rid);
                        return;
                    }
                    // A client that went away stops its generation (streamed or not).
                    if tx.is_closed() {
                        let _ = st.engine.abort(rid);
                        return;
                    }
                }
                Event::Done {
                    finish,
                    weight_version,
                    ..
                } => {
                    a.version = weight_version;
                    a.finish = Some(match (&stopped, finish) {
                        (Some(s), _) => FinishReason::stop(Some(Matched::Text(s.clone()))),
                        (None, EngineFinish::Stop { matched }) => {
                            FinishReason::stop(Some(Matched::Token(matched)))
                        }
                        (None, EngineFinish::Length) => FinishReason::length(a.ids.len() as u64),
                        (None, EngineFinish::Abort(m)) => FinishReason::abort(m),
                    });
                    let _ = tx.blocking_send(a.json());
                    return;
                }
            }
        }
    });
    if !stream {
        let mut last = None;
        while let Some(v) = rx.recv().await {
            last = Some(v);
        }
        return match last {
            Some(v) if v.get("error").is_some() => {
                error(StatusCode::SERVICE_UNAVAILABLE, &v["error"].to_string())
            }
            Some(v) => json_response(StatusCode::OK, &v),
            None => error(
                StatusCode::INTERNAL_SERVER_ERROR,
                "the engine ended the request without an answer",
            ),
        };
    }
    let mut resp = Response::new(UnsyncBoxBody::new(Sse { rx, done: false }));
    let h = resp.headers_mut();
    h.insert(
        header::CONTENT_TYPE,
        header::HeaderValue::from_static("text/event-stream; charset=utf-8"),
    );
    h.insert(
        header::CACHE_CONTROL,
        header::HeaderValue::from_static("no-cache"),
    );
    resp
}

/// `data: {...}` per answer so far, then `data: [DONE]`.
struct Sse {
    rx: tokio::sync::mpsc::Receiver<Value>,
    done: bool,
}

impl hyper::body::Body for Sse {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut TaskContext<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        if self.done {
            return Poll::Ready(None);
        }
        match self.rx.poll_recv(cx) {
            Poll::Ready(Some(v)) => {
                Poll::Ready(Some(Ok(Frame::data(Bytes::from(format!("data: {v}\n\n"))))))
            }
            Poll::Ready(None) => {
                self.done = true;
                Poll::Ready(Some(Ok(Frame::data(Bytes::from_static(
                    b"data: [DONE]\n\n",
                )))))
            }
            Poll::Pending => Poll::Pending,
        }
    }
}

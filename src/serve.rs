//! `graft serve`: the trainer's model behind SGLang's native API, so exact mode, weight
//! pushes and the whole loop run on one machine (CPU included).
//!
//! Routes (SGLang's names and shapes): `POST /generate` (`input_ids` or `text`,
//! `sampling_params` with temperature / top_p / top_k / max_new_tokens / stop /
//! stop_token_ids / ignore_eos, `return_logprob`, `stream`: SSE events holding everything
//! so far, then `data: [DONE]`), `/pause_generation {mode}`, `/continue_generation`,
//! `/flush_cache`, `/update_weights_from_disk {model_path, weight_version}`,
//! `/get_model_info`, `/health`. Concurrent requests are decoded as one batch by the
//! engine (`graft_trainer::engine`).

use std::convert::Infallible;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context as TaskContext, Poll};

use anyhow::Context;
use bytes::Bytes;
use graft_reconstruct::template::Tokenizer;
use graft_trainer::engine::{Engine, EngineFinish, Event, PauseMode, Request as EngineRequest};
use graft_trainer::generate::SamplingParams;
use graft_trainer::model::Model;
use http::{Method, Response, StatusCode, header};
use http_body_util::{BodyExt, Full, combinators::UnsyncBoxBody};
use hyper::body::{Frame, Incoming};
use hyper_util::rt::{TokioExecutor, TokioIo};
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
    #[arg(long, default_value_t = 32)]
    pub max_batch: usize,
    /// The weight_version reported until the first update.
    #[arg(long, default_value = "default")]
    pub weight_version: String,
}

struct State {
    engine: Engine,
    tokenizer: Option<Tokenizer>,
    model_path: PathBuf,
}

pub async fn run(a: ServeArgs) -> anyhow::Result<()> {
    let (addr, device, serve) = start(&a).await?;
    {
        use std::io::Write as _;
        let mut out = std::io::stdout().lock();
        writeln!(out, "graft serve listening on http://{addr} ({device:?})")?;
        out.flush()?;
    }
    serve.await
}

/// Loads the model and binds; returns the address, the device, and the future that serves
/// (until Ctrl-C or SIGTERM, or until it is dropped).
pub async fn start(
    a: &ServeArgs,
) -> anyhow::Result<(
    std::net::SocketAddr,
    graft_trainer::tch::Device,
    impl std::future::Future<Output = anyhow::Result<()>> + use<>,
)> {
    let dev = graft_trainer::device::init();
    let model = Model::load(&a.model, dev.device, dev.compute_kind())
        .with_context(|| format!("loading the model from {}", a.model.display()))?;
    let tokenizer = Tokenizer::from_dir(&a.model).ok();
    if tokenizer.is_none() {
        tracing::warn!(dir = %a.model.display(), "serve: no tokenizer here; /generate takes input_ids only and answers no text");
    }
    let engine = Engine::start(model, a.weight_version.clone(), a.max_batch)?;
    let state = Arc::new(State {
        engine,
        tokenizer,
        model_path: a.model.clone(),
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
    Ok((addr, dev.device, serve(listener, state)))
}

async fn serve(listener: tokio::net::TcpListener, state: Arc<State>) -> anyhow::Result<()> {
    let builder = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new());
    let shutdown = crate::cli::shutdown_signal();
    tokio::pin!(shutdown);
    loop {
        let accepted = tokio::select! {
            accepted = listener.accept() => accepted,
            _ = &mut shutdown => return Ok(()),
        };
        let Ok((stream, _)) = accepted else {
            tokio::time::sleep(std::time::Duration::from_millis(20)).await;
            continue;
        };
        let _ = stream.set_nodelay(true);
        let state = Arc::clone(&state);
        let builder = builder.clone();
        tokio::spawn(async move {
            let service = hyper::service::service_fn(move |req| {
                let state = Arc::clone(&state);
                async move { Ok::<_, Infallible>(handle(state, req).await) }
            });
            let _ = builder
                .serve_connection(TokioIo::new(stream), service)
                .await;
        });
    }
}

fn full(bytes: impl Into<Bytes>) -> RespBody {
    Full::new(bytes.into()).boxed_unsync()
}

fn json_response(status: StatusCode, v: &Value) -> Response<RespBody> {
    let mut resp = Response::new(full(v.to_string()));
    *resp.status_mut() = status;
    resp.headers_mut().insert(
        header::CONTENT_TYPE,
        header::HeaderValue::from_static("application/json"),
    );
    resp
}

/// SGLang's error shape.
fn error(status: StatusCode, message: &str) -> Response<RespBody> {
    json_response(
        status,
        &json!({"object": "error", "message": message, "type": "BadRequestError", "param": null, "code": status.as_u16()}),
    )
}

async fn handle(state: Arc<State>, req: hyper::Request<Incoming>) -> Response<RespBody> {
    let method = req.method().clone();
    let path = req.uri().path().to_owned();
    let body = match req.into_body().collect().await {
        Ok(b) => b.to_bytes(),
        Err(e) => {
            return error(
                StatusCode::BAD_REQUEST,
                &format!("cannot read the body: {e}"),
            );
        }
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
        (Method::GET, "/health") | (Method::GET, "/health_generate") => {
            json_response(StatusCode::OK, &json!({}))
        }
        (Method::GET | Method::POST, "/get_model_info") => {
            let path = state.model_path.display().to_string();
            control(Box::new(move |s| {
                let info = s.engine.info().map_err(|e| e.to_string())?;
                Ok(json!({"model_path": path, "tokenizer_path": path, "is_generation": true,
                          "weight_version": info.weight_version, "running": info.running, "waiting": info.waiting, "paused": info.paused}))
            }))
            .await
        }
        (Method::POST, "/pause_generation") => {
            let mode = match json.get("mode").and_then(Value::as_str).unwrap_or("abort") {
                "abort" => PauseMode::Abort,
                "retract" => PauseMode::Retract,
                "in_place" => PauseMode::InPlace,
                other => {
                    return error(
                        StatusCode::BAD_REQUEST,
                        &format!("mode '{other}' is not one of abort, retract, in_place"),
                    );
                }
            };
            control(Box::new(move |s| {
                s.engine.pause(mode).map_err(|e| e.to_string())?;
                Ok(json!({"message": "paused"}))
            }))
            .await
        }
        (Method::POST, "/continue_generation") => {
            control(Box::new(|s| {
                s.engine.resume().map_err(|e| e.to_string())?;
                Ok(json!({"message": "continued"}))
            }))
            .await
        }
        (Method::GET | Method::POST, "/flush_cache") => {
            control(Box::new(|s| {
                s.engine.flush_cache().map_err(|e| e.to_string())?;
                Ok(json!({"message": "Cache flushed."}))
            }))
            .await
        }
        (Method::POST, "/update_weights_from_disk") => {
            let Some(dir) = json
                .get("model_path")
                .and_then(Value::as_str)
                .map(PathBuf::from)
            else {
                return error(
                    StatusCode::BAD_REQUEST,
                    "update_weights_from_disk needs 'model_path'",
                );
            };
            let version = json
                .get("weight_version")
                .and_then(Value::as_str)
                .map(str::to_owned)
                .unwrap_or_else(|| dir.display().to_string());
            let st = Arc::clone(&state);
            match tokio::task::spawn_blocking(move || st.engine.update_weights(dir, version)).await
            {
                Ok(Ok(())) => json_response(
                    StatusCode::OK,
                    &json!({"success": true, "message": "Succeeded to update model weights.", "num_paused_requests": 0}),
                ),
                Ok(Err(e)) => json_response(
                    StatusCode::BAD_REQUEST,
                    &json!({"success": false, "message": e.to_string(), "num_paused_requests": 0}),
                ),
                Err(e) => error(StatusCode::INTERNAL_SERVER_ERROR, &e.to_string()),
            }
        }
        (Method::POST, "/generate") => generate(state, &json).await,
        (_, p) => error(StatusCode::NOT_FOUND, &format!("no route {p}")),
    }
}

/// A parsed `/generate` request.
struct Gen {
    input_ids: Vec<i64>,
    params: SamplingParams,
    stop: Vec<String>,
    ignore_eos: bool,
    return_logprob: bool,
    stream: bool,
}

fn parse_generate(state: &State, v: &Value) -> Result<Gen, String> {
    let input_ids: Vec<i64> = match (v.get("input_ids"), v.get("text")) {
        (Some(ids), _) => {
            let arr = ids
                .as_array()
                .ok_or("'input_ids' must be one list of token ids (batches are not supported)")?;
            arr.iter()
                .map(|x| x.as_i64().filter(|&n| n >= 0))
                .collect::<Option<_>>()
                .ok_or("'input_ids' holds something that is not a token id")?
        }
        (None, Some(text)) => {
            let text = text
                .as_str()
                .ok_or("'text' must be one string (batches are not supported)")?;
            let tok = state.tokenizer.as_ref().ok_or(
                "this server has no tokenizer (no tokenizer.json in --model); send input_ids",
            )?;
            tok.encode(text)
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
    let sp = v.get("sampling_params").cloned().unwrap_or(json!({}));
    let f = |k: &str| sp.get(k).and_then(Value::as_f64);
    let stop: Vec<String> = match sp.get("stop") {
        Some(Value::String(s)) => vec![s.clone()],
        Some(Value::Array(a)) => a
            .iter()
            .filter_map(|x| x.as_str().map(str::to_owned))
            .collect(),
        _ => Vec::new(),
    };
    if !stop.is_empty() && state.tokenizer.is_none() {
        return Err(
            "'stop' strings need a tokenizer (no tokenizer.json in --model); use stop_token_ids"
                .to_owned(),
        );
    }
    let params = SamplingParams {
        temperature: f("temperature").unwrap_or(1.0),
        top_p: f("top_p").unwrap_or(1.0),
        top_k: sp.get("top_k").and_then(Value::as_i64).unwrap_or(-1),
        max_new_tokens: sp
            .get("max_new_tokens")
            .and_then(Value::as_u64)
            .unwrap_or(128) as usize,
        stop_token_ids: sp
            .get("stop_token_ids")
            .and_then(Value::as_array)
            .map(|a| a.iter().filter_map(Value::as_i64).collect())
            .unwrap_or_default(),
    };
    Ok(Gen {
        input_ids,
        params,
        stop,
        ignore_eos: sp
            .get("ignore_eos")
            .and_then(Value::as_bool)
            .unwrap_or(false),
        return_logprob: v
            .get("return_logprob")
            .and_then(Value::as_bool)
            .unwrap_or(false),
        stream: v.get("stream").and_then(Value::as_bool).unwrap_or(false),
    })
}

/// What a request has produced so far, rendered in SGLang's answer shape.
struct Answer {
    id: String,
    ids: Vec<i64>,
    logprobs: Vec<f32>,
    prompt_tokens: usize,
    finish: Option<Value>,
    version: String,
    text: String,
    return_logprob: bool,
}

impl Answer {
    fn json(&self) -> Value {
        let mut meta = json!({
            "id": self.id,
            "finish_reason": self.finish.clone().unwrap_or(Value::Null),
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.ids.len(),
            "cached_tokens": 0,
            "weight_version": self.version,
        });
        if self.return_logprob {
            meta["output_token_logprobs"] = Value::Array(
                self.ids
                    .iter()
                    .zip(&self.logprobs)
                    .map(|(i, l)| json!([l, i, null]))
                    .collect(),
            );
        }
        json!({"text": self.text, "output_ids": self.ids, "meta_info": meta})
    }
}

async fn generate(state: Arc<State>, body: &Value) -> Response<RespBody> {
    let g = match parse_generate(&state, body) {
        Ok(g) => g,
        Err(e) => return error(StatusCode::BAD_REQUEST, &e),
    };
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
        let mut a = Answer {
            id: format!("graft-{rid}"),
            ids: Vec::new(),
            logprobs: Vec::new(),
            prompt_tokens: g.input_ids.len(),
            finish: None,
            version: String::new(),
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
                Event::Token { id, logprob } => {
                    if stopped.is_some() {
                        continue;
                    }
                    a.ids.push(id);
                    a.logprobs.push(logprob);
                    a.text = decode(&a.ids);
                    if let Some(s) = g.stop.iter().find(|s| a.text.contains(s.as_str())) {
                        stopped = Some(s.clone());
                        let _ = st.engine.abort(rid);
                    }
                    if stream && tx.blocking_send(a.json()).is_err() {
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
                        (Some(s), _) => json!({"type": "stop", "matched": s}),
                        (None, EngineFinish::Stop { matched }) => {
                            json!({"type": "stop", "matched": matched})
                        }
                        (None, EngineFinish::Length) => {
                            json!({"type": "length", "length": a.ids.len()})
                        }
                        (None, EngineFinish::Abort(m)) => json!({"type": "abort", "message": m}),
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

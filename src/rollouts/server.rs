//! The service's HTTP side: `POST /rollouts` (a batch checked, the backends' weight version
//! checked, then every group run at once and each written as it finishes) and
//! `GET /health`.

use std::convert::Infallible;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context as TaskContext, Poll};
use std::time::Instant;

use bytes::Bytes;
use http::{Method, Response, StatusCode, header};
use http_body_util::{BodyExt, Full, combinators::UnsyncBoxBody};
use hyper::body::{Frame, Incoming};
use serde_json::{Value, json};

use super::encode::{ARROW_STREAM, Encoder};
use super::groups::{GroupResult, Runner, run_one_group};
use super::plan::{Batch, Plan, check_versions, plan};
use crate::rl::config::RlConfig;

/// An answer's body; an error cuts the connection (the client sees the answer broken off).
type RespBody = UnsyncBoxBody<Bytes, std::io::Error>;

/// A chunk of a streamed answer, or why the answer breaks off there.
type Chunk = Result<Bytes, std::io::Error>;

pub(super) struct State {
    pub(super) cfg: RlConfig,
    pub(super) runner: Runner,
    /// The config's backends (what the gateway pins sessions to by default).
    pub(super) backends: Vec<String>,
    pub(super) max_body_bytes: usize,
}

/// Answers requests until Ctrl-C or SIGTERM.
pub(super) async fn serve(listener: tokio::net::TcpListener, state: Arc<State>) {
    let handler = move |req| {
        let state = Arc::clone(&state);
        async move { Ok::<_, Infallible>(handle(state, req).await) }
    };
    graft_http::serve(
        listener,
        graft_http::Options::new("rollouts"),
        handler,
        graft_http::shutdown_signal(),
    )
    .await;
}

fn json_response(status: StatusCode, v: &Value) -> Response<RespBody> {
    graft_http::json_response(status, v, |b| {
        Full::new(b).map_err(|never| match never {}).boxed_unsync()
    })
}

fn error(status: StatusCode, message: String) -> Response<RespBody> {
    json_response(status, &json!({"error": {"message": message}}))
}

/// How long a request body may take to arrive whole.
const BODY_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(60);

async fn handle(state: Arc<State>, req: hyper::Request<Incoming>) -> Response<RespBody> {
    match (req.method(), req.uri().path()) {
        (&Method::GET, "/health") => json_response(StatusCode::OK, &json!({"ok": true})),
        (&Method::POST, "/rollouts") => {
            let arrow = req
                .headers()
                .get_all(header::ACCEPT)
                .iter()
                .filter_map(|v| v.to_str().ok())
                .any(|v| v.contains(ARROW_STREAM));
            let body =
                match graft_http::read_body(req.into_body(), state.max_body_bytes, BODY_TIMEOUT)
                    .await
                {
                    Ok(b) => b,
                    Err(e @ graft_http::BodyError::TooLarge { .. }) => {
                        return error(StatusCode::PAYLOAD_TOO_LARGE, e.to_string());
                    }
                    Err(e) => return error(StatusCode::BAD_REQUEST, e.to_string()),
                };
            let batch: Batch = match serde_json::from_slice(&body) {
                Ok(b) => b,
                Err(e) => {
                    return error(
                        StatusCode::BAD_REQUEST,
                        format!(
                            "the body is not a rollout batch ({e}); send {{\"tasks\": [...], \"group_size\": N}}"
                        ),
                    );
                }
            };
            let plan = match plan(&state.cfg, &state.backends, batch) {
                Ok(p) => p,
                Err(msg) => return error(StatusCode::BAD_REQUEST, msg),
            };
            if let Some(v) = &plan.weight_version {
                let keys = match crate::rl::backends::Keys::of(&plan.cfg.backend) {
                    Ok(k) => k,
                    Err(e) => return error(StatusCode::INTERNAL_SERVER_ERROR, format!("{e:#}")),
                };
                if let Err((status, msg)) = check_versions(&plan.backends, v, &keys).await {
                    return error(status, msg);
                }
            }
            let mut enc = if arrow {
                Encoder::arrow()
            } else {
                Encoder::Ndjson
            };
            let head = match enc.start() {
                Ok(b) => b,
                Err(e) => {
                    return error(
                        StatusCode::INTERNAL_SERVER_ERROR,
                        format!("encoding the answer: {e:#}"),
                    );
                }
            };
            let (tx, rx) = tokio::sync::mpsc::channel::<Chunk>(plan.tasks.len() + 2);
            let _ = tx.try_send(Ok(head));
            tokio::spawn(run_batch(state, plan, enc, tx));
            let mut resp = Response::new(UnsyncBoxBody::new(Chunks { rx }));
            resp.headers_mut().insert(
                header::CONTENT_TYPE,
                header::HeaderValue::from_static(if arrow {
                    ARROW_STREAM
                } else {
                    "application/x-ndjson"
                }),
            );
            resp
        }
        (_, path) => error(
            StatusCode::NOT_FOUND,
            format!("no route {path}; POST /rollouts or GET /health"),
        ),
    }
}

/// Runs every group of a batch at once (rollouts bounded by `rollout.concurrency`) and sends
/// each group as it finishes, then the end of the answer.
async fn run_batch(
    state: Arc<State>,
    plan: Plan,
    mut enc: Encoder,
    tx: tokio::sync::mpsc::Sender<Chunk>,
) {
    let started = Instant::now();
    let id = uuid::Uuid::new_v4().simple().to_string();
    let plan = Arc::new(plan);
    let mut groups = tokio::task::JoinSet::new();
    for (k, task) in plan.tasks.iter().enumerate() {
        let (state, plan, task) = (state.clone(), plan.clone(), task.clone());
        let group = format!("{}-{}", &id[..12], task.id);
        groups.spawn(async move {
            run_one_group(&state.runner, &plan, &task, &group, k * plan.group_size)
                .await
                .unwrap_or_else(|e| GroupResult::failed(&group, &task.id, format!("{e:#}")))
        });
    }
    let (mut n_groups, mut n_rollouts) = (0, 0);
    while let Some(j) = groups.join_next().await {
        let g = j
            .unwrap_or_else(|e| GroupResult::failed("", "", format!("a group's task failed: {e}")));
        n_groups += 1;
        n_rollouts += g.rollouts.len();
        let chunk = enc.group(&g).map_err(|e| {
            let e = format!("a group could not be encoded: {e:#}");
            tracing::error!(error = %e, "rollouts: the answer breaks off");
            std::io::Error::other(e)
        });
        let broken = chunk.is_err();
        if tx.send(chunk).await.is_err() || broken {
            return; // the client went away
        }
    }
    let summary = json!({"done": true, "groups": n_groups, "rollouts": n_rollouts,
                         "secs": started.elapsed().as_secs_f64()});
    let end = enc.finish(&summary).map_err(|e| {
        let e = format!("the answer could not be closed: {e:#}");
        tracing::error!(error = %e, "rollouts: the answer breaks off");
        std::io::Error::other(e)
    });
    let _ = tx.send(end).await;
}

/// The answer's body: each chunk sent, until the sender is dropped.
struct Chunks {
    rx: tokio::sync::mpsc::Receiver<Chunk>,
}

impl hyper::body::Body for Chunks {
    type Data = Bytes;
    type Error = std::io::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut TaskContext<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, std::io::Error>>> {
        match self.rx.poll_recv(cx) {
            Poll::Ready(Some(c)) => Poll::Ready(Some(c.map(Frame::data))),
            Poll::Ready(None) => Poll::Ready(None),
            Poll::Pending => Poll::Pending,
        }
    }
}

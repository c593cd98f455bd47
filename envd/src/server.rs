//! The HTTP API (hyper 1): routing, the API key, bodies within limits, JSON and SSE
//! answers, errors as `{"error": {"message", "type"}}`.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::{HeaderValue, Method, Request, Response, StatusCode, header};
use http_body_util::{BodyExt, Full, StreamBody, combinators::BoxBody};
use hyper::body::{Frame, Incoming};
use serde_json::{Value, json};
use tokio::net::TcpListener;
use tokio::sync::broadcast::error::RecvError;
use tracing::{debug, info, warn};

use crate::backend::SandboxBackend;
use crate::config::BackendKind;
use crate::config::EnvdConfig;
use crate::error::{EnvdError, StartError};
use crate::files::clean_path;
use crate::kubernetes::KubeBackend;
use crate::local::LocalBackend;
use crate::model::{ApplyPatch, CreateSandbox, CreateSnapshot, ExecRequest, OutputEvent};
use crate::service::{Job, Service};

pub type Body = BoxBody<Bytes, Infallible>;

/// A bound, ready envd. `serve` runs it until the shutdown future resolves.
pub struct Envd {
    svc: Arc<Service>,
    listener: TcpListener,
}

impl Envd {
    /// Binds `cfg.listen` with the configured backend (kubernetes: the client from
    /// KUBECONFIG or the Pod's service account).
    pub async fn bind(cfg: EnvdConfig) -> Result<Self, StartError> {
        if cfg.backend == BackendKind::Kubernetes {
            cfg.validate()?;
            let client = kube::Client::try_default().await.map_err(|e| {
                StartError::Config(format!(
                    "the kubernetes backend cannot reach a cluster: {e}; run envd in a Pod with a service account (deploy/kubernetes/) or set KUBECONFIG"
                ))
            })?;
            return Self::bind_kubernetes(cfg, client).await;
        }
        cfg.validate()?;
        let cfg = Arc::new(cfg);
        let backend = Arc::new(LocalBackend::new(cfg.clone()).await?);
        Self::listen(cfg, backend).await
    }

    /// Binds with the kubernetes backend over `client` (tests give a mock API server's).
    /// Pods and NetworkPolicies of this envd's instance that an earlier run left are
    /// deleted before it answers.
    pub async fn bind_kubernetes(
        mut cfg: EnvdConfig,
        client: kube::Client,
    ) -> Result<Self, StartError> {
        cfg.backend = BackendKind::Kubernetes;
        cfg.validate()?;
        let cfg = Arc::new(cfg);
        let backend = KubeBackend::new(cfg.clone(), client);
        let namespace = backend.namespace().to_owned();
        let envd = Self::listen(cfg, Arc::new(backend)).await?;
        // Also the first check that the API server answers and the Role is right.
        let n = envd.svc.reconcile(true).await.map_err(|e| {
            StartError::Config(format!(
                "the kubernetes backend cannot list its sandboxes in namespace '{namespace}': {e}"
            ))
        })?;
        if n > 0 {
            info!(n, "deleted sandboxes an earlier envd left in the cluster");
        }
        Ok(envd)
    }

    async fn listen(
        cfg: Arc<EnvdConfig>,
        backend: Arc<dyn SandboxBackend>,
    ) -> Result<Self, StartError> {
        let listener = TcpListener::bind(cfg.listen)
            .await
            .map_err(|source| StartError::Bind {
                addr: cfg.listen,
                source,
            })?;
        Ok(Envd {
            svc: Arc::new(Service::new(cfg, backend)),
            listener,
        })
    }

    pub fn local_addr(&self) -> Option<SocketAddr> {
        self.listener.local_addr().ok()
    }

    pub fn url(&self) -> String {
        match self.local_addr() {
            Some(a) => format!("http://{a}"),
            None => format!("http://{}", self.svc.cfg.listen),
        }
    }

    /// Whether cgroup limits are enforced on this host.
    pub fn limits_enforced(&self) -> bool {
        self.svc.backend.limits_enforced()
    }

    /// Serves until `shutdown` resolves, then deletes every sandbox.
    pub async fn serve(self, shutdown: impl std::future::Future<Output = ()>) {
        let Envd { svc, listener } = self;
        let reaper = {
            let svc = svc.clone();
            tokio::spawn(async move {
                let mut tick = tokio::time::interval(svc.cfg.reap_interval);
                loop {
                    tick.tick().await;
                    svc.reap().await;
                }
            })
        };
        let options = graft_http::Options::new("envd").header_read_timeout(Duration::from_secs(30));
        let handler = {
            let svc = svc.clone();
            move |req| {
                let svc = svc.clone();
                async move { Ok::<_, Infallible>(handle(svc, req).await) }
            }
        };
        let draining = graft_http::serve(listener, options, handler, shutdown).await;
        reaper.abort();
        info!("shutting down: deleting every sandbox");
        svc.delete_all().await;
        svc.backend.shutdown();
        draining.finish(Duration::from_secs(10)).await;
    }
}

fn full(status: StatusCode, content_type: &'static str, body: impl Into<Bytes>) -> Response<Body> {
    let mut r = Response::new(Full::new(body.into()).boxed());
    *r.status_mut() = status;
    r.headers_mut()
        .insert(header::CONTENT_TYPE, HeaderValue::from_static(content_type));
    r
}

fn json_response(status: StatusCode, v: &Value) -> Response<Body> {
    graft_http::json_response(status, v, |b| Full::new(b).boxed())
}

fn to_json<T: serde::Serialize>(status: StatusCode, v: &T) -> Response<Body> {
    match serde_json::to_value(v) {
        Ok(v) => json_response(status, &v),
        Err(e) => error_response(&EnvdError::Backend(format!(
            "cannot encode the answer: {e}"
        ))),
    }
}

fn error_response(e: &EnvdError) -> Response<Body> {
    let status = e.status();
    if status.is_server_error() {
        warn!(error = %e, "request failed");
    }
    json_response(status, &e.body())
}

/// Percent-decoding, shared with the agent (which decodes envd's requests the same way).
fn percent_decode(s: &str) -> Result<String, EnvdError> {
    graft_envd_agent::server::percent_decode(s).map_err(EnvdError::BadRequest)
}

fn query(req: &Request<Incoming>, name: &str) -> Result<Option<String>, EnvdError> {
    let Some(q) = req.uri().query() else {
        return Ok(None);
    };
    for pair in q.split('&') {
        let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
        if k == name {
            return percent_decode(&v.replace('+', " ")).map(Some);
        }
    }
    Ok(None)
}

fn query_secs(req: &Request<Incoming>, name: &str) -> Result<Option<Duration>, EnvdError> {
    match query(req, name)? {
        None => Ok(None),
        Some(v) => v
            .parse::<f64>()
            .ok()
            .filter(|s| *s >= 0.0 && *s <= 86_400.0)
            .map(|s| Some(Duration::from_secs_f64(s)))
            .ok_or_else(|| {
                EnvdError::BadRequest(format!(
                    "?{name}={v}: give a number of seconds between 0 and 86400"
                ))
            }),
    }
}

async fn read_body(req: Request<Incoming>, limit: usize) -> Result<Bytes, EnvdError> {
    // No arrival deadline, as before: a file upload takes as long as the link needs.
    match graft_http::read_body(req.into_body(), limit, std::time::Duration::MAX).await {
        Ok(b) => Ok(b),
        Err(graft_http::BodyError::TooLarge { limit }) => Err(EnvdError::TooLarge {
            limit,
            hint: "raise --max-file-bytes or send less",
        }),
        Err(graft_http::BodyError::Read(e)) => Err(EnvdError::BadRequest(format!(
            "could not read the request body: {e}"
        ))),
        Err(e) => Err(EnvdError::BadRequest(e.to_string())),
    }
}

fn parse_json<T: serde::de::DeserializeOwned>(
    body: &[u8],
    what: &'static str,
) -> Result<T, EnvdError> {
    let body: &[u8] = if body.iter().all(u8::is_ascii_whitespace) {
        b"{}"
    } else {
        body
    };
    serde_json::from_slice(body).map_err(|e| EnvdError::BadJson {
        what,
        err: e.to_string(),
    })
}

fn authorized(svc: &Service, req: &Request<Incoming>) -> bool {
    let Some(got) = req.headers().get("x-api-key") else {
        return false;
    };
    let (a, b) = (got.as_bytes(), svc.cfg.api_key.as_bytes());
    // Length leaks; the bytes do not (no early exit).
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

async fn handle(svc: Arc<Service>, req: Request<Incoming>) -> Response<Body> {
    let method = req.method().clone();
    let path = req.uri().path().to_owned();
    let resp = match route(svc, req).await {
        Ok(r) => r,
        Err(e) => error_response(&e),
    };
    debug!(%method, %path, status = resp.status().as_u16(), "request");
    resp
}

async fn route(svc: Arc<Service>, req: Request<Incoming>) -> Result<Response<Body>, EnvdError> {
    let path = req.uri().path().to_owned();
    let method = req.method().clone();
    let segs: Vec<&str> = path.trim_start_matches('/').split('/').collect();
    let not_allowed = |allowed: &'static str| EnvdError::MethodNotAllowed {
        method: method.to_string(),
        path: path.clone(),
        allowed,
    };
    match segs.as_slice() {
        ["healthz"] => return Ok(json_response(StatusCode::OK, &json!({"status": "ok"}))),
        ["metrics"] => {
            return Ok(full(
                StatusCode::OK,
                "application/openmetrics-text; version=1.0.0; charset=utf-8",
                svc.metrics.encode(),
            ));
        }
        ["openapi.json"] => {
            return Ok(json_response(StatusCode::OK, &crate::openapi::document()));
        }
        _ => {}
    }
    if !authorized(&svc, &req) {
        return Err(EnvdError::Unauthorized);
    }
    let limit = svc.cfg.max_file_bytes + 64 * 1024;
    match segs.as_slice() {
        ["sandboxes"] | ["sandboxes", ""] => match method {
            Method::GET => Ok(to_json(StatusCode::OK, &json!({"sandboxes": svc.list()}))),
            Method::POST => {
                let body = read_body(req, limit).await?;
                let create: CreateSandbox = parse_json(&body, "a sandbox (POST /sandboxes)")?;
                let info = svc.create(create).await?;
                Ok(to_json(StatusCode::CREATED, &info))
            }
            _ => Err(not_allowed("GET, POST")),
        },
        ["sandboxes", id] => match method {
            Method::GET => {
                let sb = svc.get(id)?;
                Ok(to_json(StatusCode::OK, &svc.info(&sb)))
            }
            Method::DELETE => {
                svc.delete(id, "deleted by request").await?;
                Ok(json_response(
                    StatusCode::OK,
                    &json!({"id": id, "deleted": true}),
                ))
            }
            _ => Err(not_allowed("GET, DELETE")),
        },
        ["sandboxes", id, "wait"] => {
            if method != Method::GET && method != Method::POST {
                return Err(not_allowed("GET, POST"));
            }
            // A local sandbox is ready once created; a Pod when the watch says so.
            let timeout = query_secs(&req, "timeout_secs")?;
            let sb = svc.get(id)?;
            sb.touch();
            svc.ready(&sb, timeout).await?;
            Ok(to_json(StatusCode::OK, &svc.info(&sb)))
        }
        ["sandboxes", id, "heartbeat"] => {
            if method != Method::POST {
                return Err(not_allowed("POST"));
            }
            let sb = svc.get(id)?;
            sb.touch();
            Ok(to_json(StatusCode::OK, &svc.info(&sb)))
        }
        ["sandboxes", id, "exec"] => {
            if method != Method::POST {
                return Err(not_allowed("POST"));
            }
            let sb = svc.get(id)?;
            let sse = req
                .headers()
                .get(header::ACCEPT)
                .and_then(|v| v.to_str().ok())
                .is_some_and(|v| v.contains("text/event-stream"));
            let header_key = req
                .headers()
                .get("idempotency-key")
                .and_then(|v| v.to_str().ok())
                .map(str::to_owned);
            let body = read_body(req, limit).await?;
            let mut exec: ExecRequest = parse_json(&body, "an exec request")?;
            if let Some(k) = header_key {
                match &exec.idempotency_key {
                    Some(b) if *b != k => {
                        return Err(EnvdError::BadRequest(format!(
                            "the Idempotency-Key header '{k}' and the body's idempotency_key '{b}' differ; send one"
                        )));
                    }
                    _ => exec.idempotency_key = Some(k),
                }
            }
            let background = exec.background;
            let stream = exec.stream || sse;
            let (job, _started) = svc.start_job(&sb, exec)?;
            if stream {
                return Ok(sse_response(job));
            }
            if background {
                return Ok(to_json(StatusCode::ACCEPTED, &job.info()));
            }
            let info = job.wait(None).await;
            Ok(to_json(StatusCode::OK, &info))
        }
        ["sandboxes", id, "jobs"] => {
            if method != Method::GET {
                return Err(not_allowed("GET"));
            }
            let sb = svc.get(id)?;
            sb.touch();
            Ok(to_json(StatusCode::OK, &json!({"jobs": sb.jobs()})))
        }
        ["sandboxes", id, "jobs", job] => {
            if method != Method::GET {
                return Err(not_allowed("GET"));
            }
            let sb = svc.get(id)?;
            sb.touch();
            Ok(to_json(StatusCode::OK, &sb.job(job)?.info()))
        }
        ["sandboxes", id, "jobs", job, "wait"] => {
            if method != Method::GET && method != Method::POST {
                return Err(not_allowed("GET, POST"));
            }
            let timeout = query_secs(&req, "timeout_secs")?;
            let sb = svc.get(id)?;
            sb.touch();
            let job = sb.job(job)?;
            Ok(to_json(StatusCode::OK, &job.wait(timeout).await))
        }
        ["sandboxes", id, "jobs", job, "kill"] => {
            if method != Method::POST {
                return Err(not_allowed("POST"));
            }
            let sb = svc.get(id)?;
            let job = sb.job(job)?;
            job.kill();
            Ok(to_json(StatusCode::OK, &job.wait(None).await))
        }
        ["sandboxes", id, "snapshot"] => {
            if method != Method::POST {
                return Err(not_allowed("POST"));
            }
            let sb = svc.get(id)?;
            let body = read_body(req, 64 * 1024).await?;
            let r: CreateSnapshot = parse_json(&body, "a snapshot request")?;
            let info = svc.snapshot(&sb, r).await?;
            Ok(to_json(StatusCode::CREATED, &info))
        }
        ["snapshots"] | ["snapshots", ""] => match method {
            Method::GET => Ok(to_json(
                StatusCode::OK,
                &json!({"snapshots": svc.snapshots()}),
            )),
            _ => Err(not_allowed(
                "GET (take one with POST /sandboxes/{id}/snapshot)",
            )),
        },
        ["snapshots", snap] => match method {
            Method::GET => Ok(to_json(StatusCode::OK, &svc.get_snapshot(snap)?)),
            Method::DELETE => {
                svc.delete_snapshot(snap)?;
                Ok(json_response(
                    StatusCode::OK,
                    &json!({"snapshot_id": snap, "deleted": true}),
                ))
            }
            _ => Err(not_allowed("GET, DELETE")),
        },
        ["sandboxes", id, "apply_patch"] => {
            if method != Method::POST {
                return Err(not_allowed("POST"));
            }
            let sb = svc.get(id)?;
            let is_json = req
                .headers()
                .get(header::CONTENT_TYPE)
                .and_then(|v| v.to_str().ok())
                .is_some_and(|v| v.starts_with("application/json"));
            let body = read_body(req, limit).await?;
            let p: ApplyPatch = if is_json {
                parse_json(&body, "an apply_patch request")?
            } else {
                ApplyPatch {
                    patch: String::from_utf8(body.to_vec()).map_err(|_| {
                        EnvdError::BadRequest("the patch is not UTF-8 text".to_owned())
                    })?,
                    cwd: None,
                    check: false,
                }
            };
            apply_patch(&svc, &sb, p).await
        }
        ["sandboxes", id, "files"] | ["sandboxes", id, "files", ""] => {
            if method != Method::GET {
                return Err(not_allowed("GET (list with ?dir=PATH)"));
            }
            let sb = svc.get(id)?;
            sb.touch();
            let dir = query(&req, "dir")?.unwrap_or_default();
            let rel = clean_path(&dir)?;
            let entries = svc.list_files(&sb, &rel).await?;
            Ok(to_json(
                StatusCode::OK,
                &json!({"dir": rel.display().to_string(), "entries": entries}),
            ))
        }
        ["sandboxes", id, "files", rest @ ..] => {
            let raw = rest
                .iter()
                .map(|s| percent_decode(s))
                .collect::<Result<Vec<_>, _>>()?
                .join("/");
            let rel = clean_path(&raw)?;
            let sb = svc.get(id)?;
            sb.touch();
            match method {
                Method::GET => {
                    let data = svc.read_file(&sb, &rel).await?;
                    Ok(full(StatusCode::OK, "application/octet-stream", data))
                }
                Method::PUT | Method::POST => {
                    let mode = match query(&req, "mode")? {
                        None => 0o644,
                        Some(m) => u32::from_str_radix(&m, 8)
                            .ok()
                            .filter(|m| *m <= 0o7777)
                            .ok_or_else(|| {
                                EnvdError::BadRequest(format!(
                                    "?mode={m}: give an octal mode such as 644 or 755"
                                ))
                            })?,
                    };
                    let max = svc.cfg.max_file_bytes;
                    let body = match read_body(req, max).await {
                        Err(EnvdError::TooLarge { limit, .. }) => {
                            return Err(EnvdError::TooLarge {
                                limit,
                                hint: "files larger than --max-file-bytes are refused; raise it or move the file in parts",
                            });
                        }
                        r => r?,
                    };
                    let n = svc.write_file(&sb, &rel, body, mode).await?;
                    Ok(json_response(
                        StatusCode::OK,
                        &json!({"path": rel.display().to_string(), "bytes": n}),
                    ))
                }
                Method::DELETE => {
                    let recursive =
                        query(&req, "recursive")?.is_some_and(|v| v == "true" || v == "1");
                    svc.remove_file(&sb, &rel, recursive).await?;
                    Ok(json_response(
                        StatusCode::OK,
                        &json!({"path": rel.display().to_string(), "deleted": true}),
                    ))
                }
                _ => Err(not_allowed("GET, PUT, DELETE")),
            }
        }
        _ => Err(EnvdError::NoRoute {
            method: method.to_string(),
            path,
        }),
    }
}

/// `git apply` inside the sandbox (as its user, in its namespaces: a hostile `.git/config`
/// in the workspace can only run code inside the sandbox, never on the host).
async fn apply_patch(
    svc: &Arc<Service>,
    sb: &Arc<crate::service::Sandbox>,
    p: ApplyPatch,
) -> Result<Response<Body>, EnvdError> {
    if p.patch.trim().is_empty() {
        return Err(EnvdError::BadRequest("the patch is empty".to_owned()));
    }
    let mut argv = vec!["git".to_owned(), "apply".to_owned(), "--verbose".to_owned()];
    if p.check {
        argv.push("--check".to_owned());
    }
    argv.push("-".to_owned());
    let req = ExecRequest {
        argv: Some(argv),
        cwd: p.cwd,
        stdin: Some(p.patch),
        timeout_secs: Some(120.0),
        ..ExecRequest::default()
    };
    let (job, _) = svc.start_job(sb, req)?;
    let info = job.wait(None).await;
    let output = format!("{}{}", info.stdout, info.stderr);
    match (info.state, info.exit_code) {
        ("exited", Some(0)) => Ok(json_response(
            StatusCode::OK,
            &json!({"applied": !p.check, "checked": true, "output": output, "job_id": info.job_id}),
        )),
        ("exited", Some(127)) => Err(EnvdError::Backend(format!(
            "git is not installed in the sandbox's root filesystem: {output}"
        ))),
        (_, code) => Err(EnvdError::PatchFailed {
            exit_code: code.unwrap_or(-1),
            output: output.trim().to_owned(),
        }),
    }
}

fn sse_frame(event: &str, data: &Value) -> Bytes {
    Bytes::from(format!("event: {event}\ndata: {data}\n\n"))
}

/// The job's output as Server-Sent Events: `job` (its id) first, then `stdout` / `stderr`
/// chunks (`{"data": text}`) as they come, `lagged` if this client fell behind, and `exit`
/// with the job's result last.
fn sse_response(job: Arc<Job>) -> Response<Body> {
    let (out, result) = job.subscribe();
    let first = sse_frame("job", &json!({"job_id": job.id}));
    enum St {
        First,
        Out,
        Done,
    }
    let state = (St::First, out, result, job, first);
    let stream =
        futures_util::stream::unfold(state, |(st, mut out, mut result, job, first)| async move {
            match st {
                St::First => Some((
                    Ok::<_, Infallible>(Frame::data(first.clone())),
                    (St::Out, out, result, job, first),
                )),
                St::Out => {
                    if let Some(rx) = out.as_mut() {
                        match rx.recv().await {
                            Ok(ev) => {
                                let (name, data) = match ev {
                                    OutputEvent::Stdout(b) => ("stdout", b),
                                    OutputEvent::Stderr(b) => ("stderr", b),
                                };
                                let f = sse_frame(
                                    name,
                                    &json!({"data": String::from_utf8_lossy(&data)}),
                                );
                                return Some((
                                    Ok(Frame::data(f)),
                                    (St::Out, out, result, job, first),
                                ));
                            }
                            Err(RecvError::Lagged(n)) => {
                                let f = sse_frame("lagged", &json!({"missed_events": n}));
                                return Some((
                                    Ok(Frame::data(f)),
                                    (St::Out, out, result, job, first),
                                ));
                            }
                            Err(RecvError::Closed) => {}
                        }
                    }
                    let _ = result.wait_for(|r| r.is_some()).await;
                    let info = serde_json::to_value(job.info()).unwrap_or(Value::Null);
                    Some((
                        Ok(Frame::data(sse_frame("exit", &info))),
                        (St::Done, None, result, job, first),
                    ))
                }
                St::Done => None,
            }
        });
    let mut r = Response::new(BodyExt::boxed(StreamBody::new(stream)));
    r.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/event-stream"),
    );
    r.headers_mut()
        .insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    r
}

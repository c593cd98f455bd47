//! envd's side of the in-sandbox agent's server mode (Kubernetes backend): exec with the
//! output streamed back as it comes, kill, and the files API, over HTTP/1.1 to the Pod IP,
//! each call carrying the sandbox's token. The wire format is the agent's
//! (`graft_envd_agent::server`).

use std::time::{Duration, Instant};

use bytes::Bytes;
use http::{Method, Request, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use tokio::sync::{broadcast, watch};

use graft_envd_agent::server::{
    ExecResult, ExecSpec as WireSpec, FRAME_RESULT, FRAME_STDERR, FRAME_STDOUT, percent_encode,
};

use crate::error::EnvdError;
use crate::model::{DirEntry, ExecSpec, JobInfo, OutputEvent, now_ms};

/// Where a sandbox's agent answers and the token it wants.
#[derive(Debug, Clone)]
pub struct Endpoint {
    pub sandbox: String,
    pub ip: String,
    pub token: String,
}

#[derive(Clone)]
pub struct AgentClient {
    http: Client<HttpConnector, Full<Bytes>>,
    port: u16,
}

/// The agent's error types that envd passes on (anything else is a backend error).
fn known_kind(kind: &str) -> Option<&'static str> {
    [
        "path_outside_sandbox",
        "file_not_found",
        "is_a_directory",
        "not_a_directory",
        "too_large",
        "invalid_request",
        "io_error",
        "job_not_found",
    ]
    .into_iter()
    .find(|k| *k == kind)
}

impl AgentClient {
    pub fn new(port: u16) -> Self {
        let mut c = HttpConnector::new();
        c.set_connect_timeout(Some(Duration::from_secs(10)));
        c.set_nodelay(true);
        AgentClient {
            http: Client::builder(TokioExecutor::new()).build(c),
            port,
        }
    }

    fn url(&self, ep: &Endpoint, path_and_query: &str) -> String {
        let host = if ep.ip.contains(':') {
            format!("[{}]", ep.ip)
        } else {
            ep.ip.clone()
        };
        format!("http://{host}:{}{path_and_query}", self.port)
    }

    fn request(
        &self,
        ep: &Endpoint,
        method: Method,
        path_and_query: &str,
    ) -> http::request::Builder {
        Request::builder()
            .method(method)
            .uri(self.url(ep, path_and_query))
            .header("authorization", format!("Bearer {}", ep.token))
    }

    async fn send(
        &self,
        ep: &Endpoint,
        req: Request<Full<Bytes>>,
        what: &str,
    ) -> Result<http::Response<hyper::body::Incoming>, EnvdError> {
        self.http
            .request(req)
            .await
            .map_err(|e| EnvdError::SandboxUnavailable {
                id: ep.sandbox.clone(),
                reason: format!(
                    "its agent at {}:{} did not answer {what}: {e}",
                    ep.ip, self.port
                ),
            })
    }

    /// One whole-body call; a non-2xx answer becomes the agent's error.
    async fn call(
        &self,
        ep: &Endpoint,
        method: Method,
        path_and_query: &str,
        body: Bytes,
        limit: usize,
    ) -> Result<Bytes, EnvdError> {
        let what = format!(
            "{method} {}",
            path_and_query.split('?').next().unwrap_or("")
        );
        let req = self
            .request(ep, method, path_and_query)
            .body(Full::new(body))
            .map_err(|e| EnvdError::Backend(format!("cannot build the agent request: {e}")))?;
        let resp = tokio::time::timeout(Duration::from_secs(300), self.send(ep, req, &what))
            .await
            .map_err(|_| EnvdError::SandboxUnavailable {
                id: ep.sandbox.clone(),
                reason: format!("its agent did not answer {what} within 300 s"),
            })??;
        let status = resp.status();
        let bytes = http_body_util::Limited::new(resp.into_body(), limit)
            .collect()
            .await
            .map_err(|e| EnvdError::SandboxUnavailable {
                id: ep.sandbox.clone(),
                reason: format!("reading its agent's answer to {what} failed: {e}"),
            })?
            .to_bytes();
        if status.is_success() {
            return Ok(bytes);
        }
        Err(agent_error(ep, status, &bytes))
    }

    pub async fn read(&self, ep: &Endpoint, rel: &str, limit: usize) -> Result<Vec<u8>, EnvdError> {
        let q = format!("/files?path={}&max={limit}", percent_encode(rel));
        Ok(self
            .call(ep, Method::GET, &q, Bytes::new(), limit + 64 * 1024)
            .await?
            .to_vec())
    }

    pub async fn write(
        &self,
        ep: &Endpoint,
        rel: &str,
        data: Bytes,
        mode: u32,
    ) -> Result<u64, EnvdError> {
        let q = format!("/files?path={}&mode={mode:o}", percent_encode(rel));
        let n = data.len() as u64;
        self.call(ep, Method::PUT, &q, data, 64 * 1024).await?;
        Ok(n)
    }

    pub async fn remove(&self, ep: &Endpoint, rel: &str, recursive: bool) -> Result<(), EnvdError> {
        let q = format!(
            "/files?path={}&recursive={}",
            percent_encode(rel),
            u8::from(recursive)
        );
        self.call(ep, Method::DELETE, &q, Bytes::new(), 64 * 1024)
            .await
            .map(|_| ())
    }

    pub async fn list(&self, ep: &Endpoint, rel: &str) -> Result<Vec<DirEntry>, EnvdError> {
        let q = format!("/list?path={}", percent_encode(rel));
        let body = self
            .call(ep, Method::GET, &q, Bytes::new(), 64 << 20)
            .await?;
        let fields: Vec<&[u8]> = body.split(|&b| b == 0).collect();
        let mut out = Vec::new();
        for rec in fields.chunks(4) {
            let [kind, size, mode, name] = rec else {
                continue;
            };
            let kind = match *kind {
                b"file" => "file",
                b"dir" => "dir",
                b"symlink" => "symlink",
                _ => "other",
            };
            let text = |b: &[u8]| String::from_utf8_lossy(b).into_owned();
            out.push(DirEntry {
                name: text(name),
                kind,
                size: text(size).parse().unwrap_or(0),
                mode: u32::from_str_radix(&text(mode), 8).unwrap_or(0),
            });
        }
        Ok(out)
    }

    /// Runs one exec in the sandbox to its end (the agent applies the timeout and kills
    /// the tree), streaming its output to `events`; `kill` asks the agent to kill it.
    /// Never fails: a failure is a job in state `failed`.
    #[allow(clippy::too_many_arguments)]
    pub async fn run(
        &self,
        ep: &Endpoint,
        job_id: &str,
        spec: ExecSpec,
        grace: Duration,
        mut info: JobInfo,
        events: broadcast::Sender<OutputEvent>,
        mut kill: watch::Receiver<bool>,
    ) -> JobInfo {
        let started = Instant::now();
        let finish = |mut info: JobInfo, state: &'static str, error: Option<String>| {
            info.state = state;
            if error.is_some() {
                info.error = error;
            }
            info.finished_at_ms = Some(now_ms());
            info.duration_ms = Some(started.elapsed().as_millis() as u64);
            info
        };
        let wire = WireSpec {
            argv: spec.argv.clone(),
            env: spec.env.clone().into_iter().collect(),
            cwd: spec.cwd.clone(),
            timeout: spec.timeout,
            grace,
            max_output: spec.max_output_bytes,
            stdin: spec.stdin.clone(),
        };
        let req =
            Ok::<_, EnvdError>(self.request(ep, Method::POST, &format!("/exec?job={job_id}")))
                .map(|b| {
                    let mut b = b
                        .header("x-envd-timeout-ms", spec.timeout.as_millis().to_string())
                        .header("x-envd-grace-ms", grace.as_millis().to_string())
                        .header("x-envd-max-output", spec.max_output_bytes.to_string())
                        .header("x-envd-cwd", percent_encode(&spec.cwd));
                    if spec.stdin.is_some() {
                        b = b.header("x-envd-stdin", "1");
                    }
                    b
                })
                .and_then(|b| {
                    b.body(Full::new(Bytes::from(wire.encode_body())))
                        .map_err(|e| EnvdError::Backend(format!("cannot build the exec: {e}")))
                });
        let req = match req {
            Ok(r) => r,
            Err(e) => return finish(info, "failed", Some(e.to_string())),
        };
        let resp = match self.send(ep, req, "the exec").await {
            Ok(r) => r,
            Err(e) => return finish(info, "failed", Some(e.to_string())),
        };
        if resp.status() != StatusCode::OK {
            let status = resp.status();
            let body = resp
                .into_body()
                .collect()
                .await
                .map(|c| c.to_bytes())
                .unwrap_or_default();
            return finish(
                info,
                "failed",
                Some(agent_error(ep, status, &body).to_string()),
            );
        }
        let mut body = resp.into_body();
        let mut buf: Vec<u8> = Vec::new();
        let (mut stdout, mut stderr) = (Vec::new(), Vec::new());
        let mut result: Option<ExecResult> = None;
        let mut killed = false;
        // The agent ends the exec after its timeout and grace; this bounds a lost agent.
        let deadline = tokio::time::Instant::now() + spec.timeout + grace + Duration::from_secs(60);
        loop {
            enum Step<F> {
                Frame(F),
                Kill(bool),
                Deadline,
            }
            let step = tokio::select! {
                f = body.frame() => Step::Frame(f),
                r = kill.wait_for(|k| *k), if !killed => Step::Kill(r.is_ok()),
                _ = tokio::time::sleep_until(deadline) => Step::Deadline,
            };
            let frame = match step {
                Step::Frame(f) => f,
                Step::Kill(asked) => {
                    killed = true;
                    if asked {
                        let q = format!("/kill?job={job_id}");
                        // The agent knows the job once it has read the exec: a kill right
                        // after the start may need a few tries.
                        for _ in 0..50 {
                            match self.call(ep, Method::POST, &q, Bytes::new(), 4096).await {
                                Err(EnvdError::Agent {
                                    kind: "job_not_found",
                                    ..
                                }) => {
                                    tokio::time::sleep(Duration::from_millis(100)).await;
                                }
                                Err(e) => {
                                    tracing::warn!(sandbox = %ep.sandbox, job = %job_id, error = %e, "could not kill the exec");
                                    break;
                                }
                                Ok(_) => break,
                            }
                        }
                    }
                    continue;
                }
                Step::Deadline => {
                    return finish(
                        info,
                        "failed",
                        Some(format!(
                            "the sandbox's agent did not finish the exec within its timeout + {} s",
                            (grace + Duration::from_secs(60)).as_secs()
                        )),
                    );
                }
            };
            let data = match frame {
                Some(Ok(f)) => match f.into_data() {
                    Ok(d) => d,
                    Err(_) => continue,
                },
                Some(Err(e)) => {
                    return finish(
                        info,
                        "failed",
                        Some(format!("the connection to the sandbox's agent broke: {e}")),
                    );
                }
                None => break,
            };
            buf.extend_from_slice(&data);
            while buf.len() >= 5 {
                let len = u32::from_be_bytes([buf[1], buf[2], buf[3], buf[4]]) as usize;
                if buf.len() < 5 + len {
                    break;
                }
                let payload: Vec<u8> = buf[5..5 + len].to_vec();
                let kind = buf[0];
                buf.drain(..5 + len);
                match kind {
                    FRAME_STDOUT => {
                        let _ = events.send(OutputEvent::Stdout(Bytes::from(payload.clone())));
                        stdout.extend_from_slice(&payload);
                    }
                    FRAME_STDERR => {
                        let _ = events.send(OutputEvent::Stderr(Bytes::from(payload.clone())));
                        stderr.extend_from_slice(&payload);
                    }
                    FRAME_RESULT => {
                        result = ExecResult::decode(&String::from_utf8_lossy(&payload)).ok();
                    }
                    _ => {}
                }
            }
        }
        drop(events);
        let Some(r) = result else {
            return finish(
                info,
                "failed",
                Some(
                    "the sandbox's agent closed the exec without a result (did the Pod die?)"
                        .to_owned(),
                ),
            );
        };
        info.exit_code = r.exit_code;
        info.stdout_truncated = r.stdout_bytes > stdout.len() as u64;
        info.stderr_truncated = r.stderr_bytes > stderr.len() as u64;
        info.stdout = String::from_utf8_lossy(&stdout).into_owned();
        info.stderr = String::from_utf8_lossy(&stderr).into_owned();
        info.stdout_bytes = r.stdout_bytes;
        info.stderr_bytes = r.stderr_bytes;
        info.timed_out = r.timed_out;
        // An OOM kill ends the command with SIGKILL; the agent cannot tell it from others.
        info.oom_killed = false;
        let state = if r.timed_out {
            "timed_out"
        } else if r.killed || killed {
            "killed"
        } else if r.error.is_some()
            && r.exit_code == Some(126)
            && stdout.is_empty()
            && stderr.is_empty()
        {
            "failed"
        } else {
            "exited"
        };
        finish(info, state, r.error)
    }
}

fn agent_error(ep: &Endpoint, status: StatusCode, body: &[u8]) -> EnvdError {
    let text = String::from_utf8_lossy(body);
    let (kind, message) = text.split_once('\n').unwrap_or(("", &text));
    if status == StatusCode::UNAUTHORIZED {
        return EnvdError::Backend(format!(
            "the agent of sandbox '{}' refused envd's token ({message}); the Pod may belong to another envd",
            ep.sandbox
        ));
    }
    match known_kind(kind) {
        Some(k) => EnvdError::Agent {
            status: status.as_u16(),
            kind: k,
            message: message.to_owned(),
        },
        None => EnvdError::Backend(format!(
            "the agent of sandbox '{}' answered {status}: {text}",
            ep.sandbox
        )),
    }
}

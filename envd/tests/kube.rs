//! The Kubernetes backend's controller logic against kube-rs's mock service: envd (the real
//! HTTP API, `Envd::bind_kubernetes`) talks to a `kube::Client` whose transport is
//! `tower_test::mock::pair`; the test answers each request with Kubernetes API bodies from
//! `fixtures/kube/` (see its README for where their shape comes from) and records what envd
//! sent. Exec and files go to a real `envd-agent` in server mode on loopback (the fixture
//! Pod's IP is 127.0.0.1), with the token envd put into the Pod spec.
//!
//! No API server runs here: what a cluster would do beyond these answers (scheduling, the
//! kubelet's readiness probe, NetworkPolicy enforcement) is not tested by this file.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::collections::BTreeMap;
use std::convert::Infallible;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::{Method, Request, Response, StatusCode};
use http_body_util::combinators::UnsyncBoxBody;
use http_body_util::{BodyExt, Full, StreamBody};
use hyper::body::Frame;
use serde_json::{Value, json};
use tokio::sync::mpsc;

use graft_envd::{AgentCommand, Envd, EnvdConfig};

type MockBody = UnsyncBoxBody<Bytes, Infallible>;

const NS: &str = "sandboxes";
const AGENT_IMAGE: &str = "ghcr.io/graft-rl/envd-agent:0.1.0";
const KEY: &str = "test-key";

fn fixture(name: &str, id: &str, rv: u64) -> Value {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/kube")
        .join(name);
    let text = std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("{}: {e}", path.display()))
        .replace("SANDBOX_ID", id)
        .replace("POD_IP", "127.0.0.1")
        .replace("RESOURCE_VERSION", &rv.to_string());
    serde_json::from_str(&text).unwrap()
}

/// A request envd sent to the API server.
#[derive(Debug, Clone)]
struct Sent {
    method: Method,
    path: String,
    query: BTreeMap<String, String>,
    body: Option<Value>,
}

impl Sent {
    fn is_watch(&self) -> bool {
        self.query.get("watch").is_some_and(|v| v == "true")
    }
}

/// What the mock API server holds and answers with.
#[derive(Default)]
struct Cluster {
    sent: Mutex<Vec<Sent>>,
    pods: Mutex<BTreeMap<String, Value>>,
    policies: Mutex<BTreeMap<String, Value>>,
    watches: Mutex<Vec<mpsc::UnboundedSender<Bytes>>>,
    rv: AtomicU64,
    /// A fixture (and its status code) to answer the next Pod create with.
    pod_create_error: Mutex<Option<(u16, &'static str)>>,
    /// A Status to answer every LIST with.
    list_error: Mutex<Option<(u16, Value)>>,
}

fn json_response(status: u16, v: &Value) -> Response<MockBody> {
    Response::builder()
        .status(status)
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(v.to_string())).boxed_unsync())
        .unwrap()
}

fn query_map(q: Option<&str>) -> BTreeMap<String, String> {
    q.unwrap_or("")
        .split('&')
        .filter(|p| !p.is_empty())
        .map(|p| {
            let (k, v) = p.split_once('=').unwrap_or((p, ""));
            (
                k.to_owned(),
                v.replace("%3D", "=")
                    .replace("%2C", ",")
                    .replace("%2F", "/"),
            )
        })
        .collect()
}

fn labels_match(obj: &Value, selector: Option<&String>) -> bool {
    let Some(sel) = selector else { return true };
    sel.split(',').all(|kv| {
        let (k, v) = kv.split_once('=').unwrap();
        obj["metadata"]["labels"][k] == v
    })
}

impl Cluster {
    fn next_rv(&self) -> u64 {
        self.rv.fetch_add(1, Ordering::SeqCst) + 1000
    }

    fn sent(&self) -> Vec<Sent> {
        self.sent.lock().unwrap().clone()
    }

    fn emit(&self, kind: &str, obj: &Value) {
        let line = Bytes::from(format!("{}\n", json!({"type": kind, "object": obj})));
        self.watches
            .lock()
            .unwrap()
            .retain(|w| w.send(line.clone()).is_ok());
    }

    /// Puts a Pod (a fixture for sandbox `id`) into the cluster without telling watches.
    fn put_pod_silently(&self, id: &str, fixture_name: &str) -> Value {
        let rv = self.next_rv();
        let pod = fixture(fixture_name, id, rv);
        self.pods
            .lock()
            .unwrap()
            .insert(format!("graft-sbx-{id}"), pod.clone());
        pod
    }

    /// The Pod of sandbox `id` moves to the fixture's status; watches see MODIFIED.
    fn set_pod(&self, id: &str, fixture_name: &str) {
        let pod = self.put_pod_silently(id, fixture_name);
        self.emit("MODIFIED", &pod);
    }

    /// Every open watch gets the 410 Gone ERROR event and ends.
    fn expire_watches(&self) {
        let ev = fixture("watch-error-410-expired.json", "", 0);
        let line = Bytes::from(format!("{ev}\n"));
        for w in self.watches.lock().unwrap().drain(..) {
            let _ = w.send(line.clone());
        }
    }

    fn answer(
        &self,
        method: &Method,
        path: &str,
        q: &BTreeMap<String, String>,
        body: Option<&Value>,
    ) -> Response<MockBody> {
        let pods_path = format!("/api/v1/namespaces/{NS}/pods");
        let np_path = format!("/apis/networking.k8s.io/v1/namespaces/{NS}/networkpolicies");
        let (store, list_fixture, collection) = if path.starts_with(&pods_path) {
            (&self.pods, "podlist.json", pods_path.as_str())
        } else if path.starts_with(&np_path) {
            (&self.policies, "networkpolicylist.json", np_path.as_str())
        } else {
            return json_response(404, &fixture("status-404-notfound.json", "unknown", 0));
        };
        let name = path
            .strip_prefix(collection)
            .and_then(|r| r.strip_prefix('/'))
            .map(str::to_owned);
        match (method.clone(), name) {
            (Method::GET, None) if q.get("watch").is_some_and(|v| v == "true") => {
                let (tx, rx) = mpsc::unbounded_channel::<Bytes>();
                self.watches.lock().unwrap().push(tx);
                let stream = futures_util::stream::unfold(rx, |mut rx| async move {
                    rx.recv()
                        .await
                        .map(|b| (Ok::<_, Infallible>(Frame::data(b)), rx))
                });
                Response::builder()
                    .status(200)
                    .header("content-type", "application/json")
                    .body(StreamBody::new(stream).boxed_unsync())
                    .unwrap()
            }
            (Method::GET, None) if self.list_error.lock().unwrap().is_some() => {
                let (code, st) = self.list_error.lock().unwrap().clone().unwrap();
                json_response(code, &st)
            }
            (Method::GET, None) => {
                let mut list = fixture(list_fixture, "", self.next_rv());
                let items: Vec<Value> = store
                    .lock()
                    .unwrap()
                    .values()
                    .filter(|o| labels_match(o, q.get("labelSelector")))
                    .cloned()
                    .collect();
                list["items"] = json!(items);
                json_response(200, &list)
            }
            (Method::POST, None) => {
                let mut obj = body.cloned().unwrap_or(Value::Null);
                let name = obj["metadata"]["name"].as_str().unwrap_or("").to_owned();
                let id = name.trim_start_matches("graft-sbx-").to_owned();
                let is_pod = list_fixture == "podlist.json";
                if is_pod && let Some((code, f)) = self.pod_create_error.lock().unwrap().take() {
                    return json_response(code, &fixture(f, &id, 0));
                }
                if store.lock().unwrap().contains_key(&name) {
                    let mut st = fixture("status-409-alreadyexists.json", &id, 0);
                    if !is_pod {
                        st["details"]["kind"] = json!("networkpolicies");
                    }
                    return json_response(409, &st);
                }
                let rv = self.next_rv();
                obj["metadata"]["namespace"] = json!(NS);
                obj["metadata"]["uid"] = json!(format!("uid-{name}-{rv}"));
                obj["metadata"]["resourceVersion"] = json!(rv.to_string());
                obj["metadata"]["creationTimestamp"] = json!("2026-11-30T17:40:02Z");
                if is_pod {
                    obj["status"] = json!({"phase": "Pending", "qosClass": "Guaranteed"});
                }
                store.lock().unwrap().insert(name, obj.clone());
                if is_pod {
                    self.emit("ADDED", &obj);
                }
                json_response(201, &obj)
            }
            (Method::DELETE, Some(name)) => {
                let removed = store.lock().unwrap().remove(&name);
                match removed {
                    Some(mut obj) => {
                        if list_fixture == "podlist.json" {
                            obj["metadata"]["deletionTimestamp"] = json!("2026-11-30T17:41:00Z");
                            self.emit("DELETED", &obj);
                        }
                        json_response(200, &obj)
                    }
                    None => {
                        let id = name.trim_start_matches("graft-sbx-");
                        json_response(404, &fixture("status-404-notfound.json", id, 0))
                    }
                }
            }
            _ => json_response(404, &fixture("status-404-notfound.json", "unknown", 0)),
        }
    }
}

/// Serves the mock API: records each request and answers it from `cluster`.
fn api_client(cluster: Arc<Cluster>) -> kube::Client {
    let (svc, handle) = tower_test::mock::pair::<Request<kube::client::Body>, Response<MockBody>>();
    tokio::spawn(async move {
        let mut handle = std::pin::pin!(handle);
        while let Some((req, send)) = handle.next_request().await {
            let (parts, body) = req.into_parts();
            let bytes = body.collect_bytes().await.unwrap_or_default();
            let body: Option<Value> = serde_json::from_slice(&bytes).ok();
            let sent = Sent {
                method: parts.method.clone(),
                path: parts.uri.path().to_owned(),
                query: query_map(parts.uri.query()),
                body: body.clone(),
            };
            cluster.sent.lock().unwrap().push(sent.clone());
            send.send_response(cluster.answer(
                &sent.method,
                &sent.path,
                &sent.query,
                body.as_ref(),
            ));
        }
    });
    kube::Client::new(svc, NS)
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

struct Env {
    cluster: Arc<Cluster>,
    url: String,
    agent_port: u16,
    _data: tempfile::TempDir,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    served: Option<tokio::task::JoinHandle<()>>,
}

impl Env {
    /// Stops envd the way a SIGTERM would (it deletes its sandboxes).
    async fn shutdown(mut self) -> Arc<Cluster> {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
        if let Some(h) = self.served.take() {
            h.await.unwrap();
        }
        self.cluster.clone()
    }
}

async fn start_with(cluster: Arc<Cluster>, tweak: impl FnOnce(&mut EnvdConfig)) -> Env {
    let data = tempfile::tempdir().unwrap();
    let agent_port = free_port();
    let mut cfg = EnvdConfig::new(
        "127.0.0.1:0".parse().unwrap(),
        data.path().to_owned(),
        KEY.to_owned(),
        AgentCommand {
            exe: PathBuf::from("unused"),
            args: vec![],
        },
    );
    cfg.gateway = Some("10.0.0.9:8400".parse().unwrap());
    cfg.kubernetes.agent_image = AGENT_IMAGE.to_owned();
    cfg.kubernetes.agent_port = agent_port;
    cfg.kubernetes.ready_timeout = Duration::from_secs(5);
    cfg.kill_grace = Duration::from_millis(300);
    tweak(&mut cfg);
    let envd = Envd::bind_kubernetes(cfg, api_client(cluster.clone()))
        .await
        .unwrap();
    let url = envd.url();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let served = tokio::spawn(envd.serve(async move {
        let _ = stopped.await;
    }));
    Env {
        cluster,
        url,
        agent_port,
        _data: data,
        stop: Some(stop),
        served: Some(served),
    }
}

async fn start() -> Env {
    start_with(Arc::new(Cluster::default()), |_| {}).await
}

async fn call(env: &Env, method: Method, path: &str, body: Option<Value>) -> (StatusCode, Value) {
    call_url(&env.url, method, path, body).await
}

async fn call_url(
    url: &str,
    method: Method,
    path: &str,
    body: Option<Value>,
) -> (StatusCode, Value) {
    let (status, bytes) = raw(url, method, path, body.map(|b| Bytes::from(b.to_string()))).await;
    let v = serde_json::from_slice(&bytes)
        .unwrap_or_else(|_| json!({"raw": String::from_utf8_lossy(&bytes)}));
    (status, v)
}

async fn call_raw(
    env: &Env,
    method: Method,
    path: &str,
    body: Option<Bytes>,
) -> (StatusCode, Bytes) {
    raw(&env.url, method, path, body).await
}

async fn raw(url: &str, method: Method, path: &str, body: Option<Bytes>) -> (StatusCode, Bytes) {
    let client = hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
        .build_http::<Full<Bytes>>();
    let req = Request::builder()
        .method(method)
        .uri(format!("{url}{path}"))
        .header("x-api-key", KEY)
        .header("content-type", "application/json")
        .body(Full::new(body.unwrap_or_default()))
        .unwrap();
    let resp = client.request(req).await.unwrap();
    let status = resp.status();
    (status, resp.into_body().collect().await.unwrap().to_bytes())
}

async fn create(env: &Env, body: Value) -> Value {
    let (status, v) = call(env, Method::POST, "/sandboxes", Some(body)).await;
    assert_eq!(status, StatusCode::CREATED, "{v}");
    v
}

/// The body of the one request matching `method` and `path`.
fn body_of(sent: &[Sent], method: Method, path: &str) -> Value {
    let m: Vec<&Sent> = sent
        .iter()
        .filter(|s| s.method == method && s.path == path)
        .collect();
    assert_eq!(m.len(), 1, "{method} {path}: {m:?}");
    m[0].body.clone().unwrap()
}

fn pods_path() -> String {
    format!("/api/v1/namespaces/{NS}/pods")
}

fn np_path() -> String {
    format!("/apis/networking.k8s.io/v1/namespaces/{NS}/networkpolicies")
}

async fn eventually(what: &str, mut f: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while !f() {
        assert!(Instant::now() < deadline, "timed out waiting until {what}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// A real agent in server mode on the port envd calls, with `token`.
struct Agent {
    child: Child,
    ws: tempfile::TempDir,
}

impl Drop for Agent {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn agent_exe() -> PathBuf {
    static EXE: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();
    EXE.get_or_init(|| {
        let out = Command::new(env!("CARGO"))
            .args([
                "build",
                "-p",
                "graft-envd-agent",
                "--example",
                "envd-agent",
                "--message-format=json",
            ])
            .current_dir(env!("CARGO_MANIFEST_DIR"))
            .stderr(Stdio::inherit())
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "building the envd-agent example failed"
        );
        String::from_utf8_lossy(&out.stdout)
            .lines()
            .filter_map(|l| serde_json::from_str::<Value>(l).ok())
            .find(|v| v["reason"] == "compiler-artifact" && v["target"]["name"] == "envd-agent")
            .and_then(|v| v["executable"].as_str().map(PathBuf::from))
            .expect("cargo named no envd-agent executable")
    })
    .clone()
}

fn start_agent(port: u16, token: &str, sandbox: &str) -> Agent {
    let ws = tempfile::tempdir().unwrap();
    let mut child = Command::new(agent_exe())
        .args([
            "serve",
            "--listen",
            &format!("127.0.0.1:{port}"),
            "--workspace",
        ])
        .arg(ws.path())
        .args(["--sandbox-id", sandbox])
        .env("GRAFT_ENVD_AGENT_TOKEN", token)
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    // It prints its address once it listens.
    let mut out = child.stdout.take().unwrap();
    let mut b = [0u8; 1];
    while std::io::Read::read(&mut out, &mut b).unwrap() == 1 && b[0] != b'\n' {}
    Agent { child, ws }
}

fn token_of(pod: &Value) -> String {
    pod["spec"]["containers"][0]["env"]
        .as_array()
        .unwrap()
        .iter()
        .find(|e| e["name"] == "GRAFT_ENVD_AGENT_TOKEN")
        .and_then(|e| e["value"].as_str())
        .unwrap()
        .to_owned()
}

#[tokio::test]
async fn startup_lists_and_watches_pods_by_graft_labels() {
    let env = start().await;
    let selector = "app.kubernetes.io/managed-by=graft-envd,graft.dev/envd=envd";
    eventually("the watch is open", || {
        env.cluster.sent().iter().any(Sent::is_watch)
    })
    .await;
    let sent = env.cluster.sent();
    for path in [pods_path(), np_path()] {
        assert!(
            sent.iter().any(|s| s.method == Method::GET
                && s.path == path
                && !s.is_watch()
                && s.query.get("labelSelector").map(String::as_str) == Some(selector)),
            "no LIST of {path} with the selector: {sent:?}"
        );
    }
    let watch = sent.iter().find(|s| s.is_watch()).unwrap();
    assert_eq!(watch.path, pods_path());
    assert_eq!(
        watch.query.get("labelSelector").map(String::as_str),
        Some(selector)
    );
    assert!(watch.query.contains_key("resourceVersion"), "{watch:?}");
    // Only reads: nothing was created or deleted in an empty cluster.
    assert!(sent.iter().all(|s| s.method == Method::GET), "{sent:?}");
    env.shutdown().await;
}

#[tokio::test]
async fn create_sends_a_networkpolicy_then_a_pod_with_the_agent_injected() {
    let env = start().await;
    let v = create(
        &env,
        json!({"id": "sb1", "image": "python:3.12-slim", "cpus": 0.5, "memory_mb": 512, "network": "gateway", "ttl_secs": 120}),
    )
    .await;
    assert_eq!(v["backend"], "kubernetes");
    assert_eq!(v["state"], "pending");
    assert_eq!(v["gateway_url"], "http://127.0.0.1:4000");
    let sent = env.cluster.sent();
    let np_at = sent
        .iter()
        .position(|s| s.method == Method::POST && s.path == np_path())
        .unwrap();
    let pod_at = sent
        .iter()
        .position(|s| s.method == Method::POST && s.path == pods_path())
        .unwrap();
    assert!(
        np_at < pod_at,
        "the NetworkPolicy must exist before the Pod runs"
    );

    let np = body_of(&sent, Method::POST, &np_path());
    assert_eq!(np["metadata"]["name"], "graft-sbx-sb1");
    assert_eq!(
        np["spec"]["podSelector"]["matchLabels"],
        json!({"graft.dev/envd": "envd", "graft.dev/sandbox": "sb1"})
    );
    assert_eq!(np["spec"]["policyTypes"], json!(["Ingress", "Egress"]));
    assert_eq!(
        np["spec"]["egress"],
        json!([{"to": [{"ipBlock": {"cidr": "10.0.0.9/32"}}], "ports": [{"protocol": "TCP", "port": 8400}]}]),
        "egress only to the gateway"
    );
    assert_eq!(
        np["spec"]["ingress"],
        json!([{"from": [{"podSelector": {"matchLabels": {"app.kubernetes.io/name": "graft-envd"}}}],
                "ports": [{"protocol": "TCP", "port": env.agent_port}]}]),
        "ingress only from envd to the agent port"
    );

    let pod = body_of(&sent, Method::POST, &pods_path());
    let spec = &pod["spec"];
    assert_eq!(pod["metadata"]["labels"]["graft.dev/sandbox"], "sb1");
    assert_eq!(
        pod["metadata"]["labels"]["app.kubernetes.io/managed-by"],
        "graft-envd"
    );
    assert_eq!(spec["restartPolicy"], "Never");
    assert_eq!(spec["automountServiceAccountToken"], false);
    let init = &spec["initContainers"][0];
    assert_eq!(init["image"], AGENT_IMAGE);
    assert_eq!(
        init["command"],
        json!(["/envd-agent", "install", "/.graft/bin/envd-agent"])
    );
    assert_eq!(
        init["volumeMounts"],
        json!([{"name": "graft-agent", "mountPath": "/.graft/bin"}])
    );
    assert_eq!(
        spec["volumes"],
        json!([{"name": "graft-agent", "emptyDir": {}}, {"name": "workspace", "emptyDir": {}}])
    );
    let main = &spec["containers"][0];
    assert_eq!(
        main["image"], "python:3.12-slim",
        "the task image, unmodified"
    );
    let cmd: Vec<String> = serde_json::from_value(main["command"].clone()).unwrap();
    assert_eq!(
        cmd[..2],
        ["/.graft/bin/envd-agent".to_owned(), "serve".to_owned()]
    );
    assert!(
        cmd.windows(2)
            .any(|w| w == ["--listen".to_owned(), format!("0.0.0.0:{}", env.agent_port)]),
        "{cmd:?}"
    );
    assert!(
        cmd.windows(2)
            .any(|w| w == ["--forward", "127.0.0.1:4000=10.0.0.9:8400"]),
        "{cmd:?}"
    );
    let want = json!({"cpu": "500m", "memory": "512Mi"});
    assert_eq!(main["resources"]["requests"], want);
    assert_eq!(main["resources"]["limits"], want, "requests = limits");
    assert_eq!(
        init["resources"]["limits"], want,
        "the init container too (Guaranteed QoS)"
    );
    let token = token_of(&pod);
    assert_eq!(token.len(), 64);
    assert!(token.chars().all(|c| c.is_ascii_hexdigit()));
    assert!(
        !cmd.iter().any(|a| a.contains(&token)),
        "the token is not in argv"
    );
    assert_eq!(main["readinessProbe"]["httpGet"]["path"], "/healthz");
    assert_eq!(main["securityContext"]["allowPrivilegeEscalation"], false);
    assert_eq!(
        main["securityContext"]["capabilities"]["drop"],
        json!(["ALL"])
    );

    // Network "none": the policy allows no egress at all, and the agent forwards nothing.
    create(
        &env,
        json!({"id": "sb2", "image": "python:3.12-slim", "network": "none"}),
    )
    .await;
    let sent = env.cluster.sent();
    let np2 = sent
        .iter()
        .filter(|s| s.method == Method::POST && s.path == np_path())
        .nth(1)
        .and_then(|s| s.body.clone())
        .unwrap();
    assert_eq!(np2["spec"]["egress"], json!([]));
    let pod2 = sent
        .iter()
        .filter(|s| s.method == Method::POST && s.path == pods_path())
        .nth(1)
        .and_then(|s| s.body.clone())
        .unwrap();
    assert!(
        !pod2["spec"]["containers"][0]["command"]
            .to_string()
            .contains("--forward")
    );
    assert_ne!(token_of(&pod2), token, "each sandbox has its own token");
    env.shutdown().await;
}

#[tokio::test]
async fn ready_only_after_the_watch_reports_running_and_ready() {
    let env = start().await;
    create(&env, json!({"id": "sbr", "image": "python:3.12-slim"})).await;
    let (status, v) = call(
        &env,
        Method::GET,
        "/sandboxes/sbr/wait?timeout_secs=0.3",
        None,
    )
    .await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE, "{v}");
    assert_eq!(v["error"]["type"], "sandbox_unavailable");
    assert!(
        v["error"]["message"]
            .as_str()
            .unwrap()
            .contains("not ready"),
        "{v}"
    );
    env.cluster.set_pod("sbr", "pod-pending.json");
    env.cluster.set_pod("sbr", "pod-running-not-ready.json");
    let (status, _) = call(
        &env,
        Method::GET,
        "/sandboxes/sbr/wait?timeout_secs=0.3",
        None,
    )
    .await;
    assert_eq!(
        status,
        StatusCode::SERVICE_UNAVAILABLE,
        "Running but not Ready is not ready"
    );
    let (_, info) = call(&env, Method::GET, "/sandboxes/sbr", None).await;
    assert_eq!(info["state"], "pending");
    // The watch brings Ready while a wait is pending: it returns then.
    let waiting = {
        let url = env.url.clone();
        tokio::spawn(async move {
            call_url(
                &url,
                Method::GET,
                "/sandboxes/sbr/wait?timeout_secs=5",
                None,
            )
            .await
        })
    };
    tokio::time::sleep(Duration::from_millis(200)).await;
    env.cluster.set_pod("sbr", "pod-running-ready.json");
    let (status, v) = waiting.await.unwrap();
    assert_eq!(status, StatusCode::OK, "{v}");
    assert_eq!(v["state"], "ready");
    // Readiness came from the watch alone: envd never polled the Pod.
    assert!(
        !env.cluster
            .sent()
            .iter()
            .any(|s| s.method == Method::GET && s.path.ends_with("/pods/graft-sbx-sbr")),
        "envd polled the Pod instead of watching"
    );
    env.shutdown().await;
}

#[tokio::test]
async fn the_watch_lists_again_after_410_gone_and_sees_what_it_missed() {
    let env = start().await;
    create(&env, json!({"id": "sbg", "image": "python:3.12-slim"})).await;
    eventually("the watch is open", || {
        env.cluster.sent().iter().any(Sent::is_watch)
    })
    .await;
    let lists = |c: &Cluster| {
        c.sent()
            .iter()
            .filter(|s| s.method == Method::GET && s.path == pods_path() && !s.is_watch())
            .count()
    };
    let before = lists(&env.cluster);
    // The Pod becomes ready while the watch is broken: no event carries it.
    env.cluster
        .put_pod_silently("sbg", "pod-running-ready.json");
    env.cluster.expire_watches();
    eventually("the watcher lists the Pods again", || {
        lists(&env.cluster) > before
    })
    .await;
    let (status, v) = call(
        &env,
        Method::GET,
        "/sandboxes/sbg/wait?timeout_secs=5",
        None,
    )
    .await;
    assert_eq!(status, StatusCode::OK, "{v}");
    assert_eq!(
        v["state"], "ready",
        "the re-list brought the state the watch missed"
    );
    // And it watches again, from the new list's resourceVersion.
    eventually("a new watch", || {
        env.cluster.sent().iter().filter(|s| s.is_watch()).count() >= 2
    })
    .await;
    env.shutdown().await;
}

#[tokio::test]
async fn exec_files_and_patches_go_to_the_agent_at_the_pod_ip_with_the_sandbox_token() {
    let env = start().await;
    create(
        &env,
        json!({"id": "sbx", "image": "python:3.12-slim", "env": {"TASK": "t1"}}),
    )
    .await;
    let pod = body_of(&env.cluster.sent(), Method::POST, &pods_path());
    let agent = start_agent(env.agent_port, &token_of(&pod), "sbx");
    env.cluster.set_pod("sbx", "pod-running-ready.json");

    let (status, v) = call(
        &env,
        Method::POST,
        "/sandboxes/sbx/exec",
        Some(json!({"command": "echo out-$TASK-$GRAFT_SANDBOX_ID; echo err >&2; exit 3"})),
    )
    .await;
    assert_eq!(status, StatusCode::OK, "{v}");
    assert_eq!(v["state"], "exited", "{v}");
    assert_eq!(v["exit_code"], 3);
    assert_eq!(v["stdout"], "out-t1-sbx\n");
    assert_eq!(v["stderr"], "err\n");

    // Output cap and truncation, as on the local backend.
    let (_, v) = call(
        &env,
        Method::POST,
        "/sandboxes/sbx/exec",
        Some(json!({"command": "head -c 5000 /dev/zero | tr '\\0' a", "max_output_bytes": 100})),
    )
    .await;
    assert_eq!(v["stdout"].as_str().unwrap().len(), 100);
    assert_eq!(v["stdout_bytes"], 5000);
    assert_eq!(v["stdout_truncated"], true);

    // A timeout ends the whole tree; the job says so.
    let started = Instant::now();
    let (_, v) = call(
        &env,
        Method::POST,
        "/sandboxes/sbx/exec",
        Some(json!({"command": "(setsid sleep 300 &); sleep 300", "timeout_secs": 0.5})),
    )
    .await;
    assert_eq!(v["state"], "timed_out", "{v}");
    assert_eq!(v["timed_out"], true);
    assert!(started.elapsed() < Duration::from_secs(20));

    // Files: up, down, listed, through the agent into its workspace.
    let (status, _) = call_raw(
        &env,
        Method::PUT,
        "/sandboxes/sbx/files/src/main.py?mode=755",
        Some(Bytes::from_static(b"print(1)\n")),
    )
    .await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(
        std::fs::read(agent.ws.path().join("src/main.py")).unwrap(),
        b"print(1)\n"
    );
    let (status, data) =
        call_raw(&env, Method::GET, "/sandboxes/sbx/files/src/main.py", None).await;
    assert_eq!((status, &data[..]), (StatusCode::OK, &b"print(1)\n"[..]));
    let (_, l) = call(&env, Method::GET, "/sandboxes/sbx/files?dir=src", None).await;
    assert_eq!(
        l["entries"],
        json!([{"name": "main.py", "type": "file", "size": 9, "mode": 0o755}])
    );
    let (status, v) = call(&env, Method::GET, "/sandboxes/sbx/files/nope", None).await;
    assert_eq!(status, StatusCode::NOT_FOUND, "{v}");
    assert_eq!(v["error"]["type"], "file_not_found");
    // Escapes are refused: lexically by envd, and a planted symlink by the agent.
    let outside = tempfile::tempdir().unwrap();
    std::fs::write(outside.path().join("secret"), b"node secret").unwrap();
    std::os::unix::fs::symlink(outside.path().join("secret"), agent.ws.path().join("link"))
        .unwrap();
    for p in ["link", "..%2Fx", "%2Fetc%2Fpasswd"] {
        let (status, v) = call(
            &env,
            Method::GET,
            &format!("/sandboxes/sbx/files/{p}"),
            None,
        )
        .await;
        assert_eq!(status, StatusCode::FORBIDDEN, "{p}: {v}");
        assert_eq!(v["error"]["type"], "path_outside_sandbox");
    }
    let (status, _) = call_raw(
        &env,
        Method::PUT,
        "/sandboxes/sbx/files/link",
        Some(Bytes::from_static(b"x")),
    )
    .await;
    assert_eq!(status, StatusCode::FORBIDDEN);
    assert_eq!(
        std::fs::read(outside.path().join("secret")).unwrap(),
        b"node secret"
    );

    // apply_patch is git apply run by the agent in the workspace.
    if Command::new("git").arg("--version").output().is_ok() {
        let patch = "--- a/src/main.py\n+++ b/src/main.py\n@@ -1 +1 @@\n-print(1)\n+print(2)\n";
        let (status, v) = call(
            &env,
            Method::POST,
            "/sandboxes/sbx/apply_patch",
            Some(json!({"patch": patch})),
        )
        .await;
        assert_eq!(status, StatusCode::OK, "{v}");
        assert_eq!(
            std::fs::read(agent.ws.path().join("src/main.py")).unwrap(),
            b"print(2)\n"
        );
    }
    env.shutdown().await;
}

#[tokio::test]
async fn an_agent_with_another_token_is_refused_and_the_error_says_so() {
    let env = start().await;
    create(&env, json!({"id": "sbt", "image": "python:3.12-slim"})).await;
    let _agent = start_agent(env.agent_port, "someone-elses-token-0123456789", "sbt");
    env.cluster.set_pod("sbt", "pod-running-ready.json");
    let (status, v) = call(&env, Method::GET, "/sandboxes/sbt/files/x", None).await;
    assert_eq!(status, StatusCode::INTERNAL_SERVER_ERROR, "{v}");
    assert!(
        v["error"]["message"]
            .as_str()
            .unwrap()
            .contains("refused envd's token"),
        "{v}"
    );
    let (_, v) = call(
        &env,
        Method::POST,
        "/sandboxes/sbt/exec",
        Some(json!({"command": "true"})),
    )
    .await;
    assert_eq!(v["state"], "failed");
    assert!(v["error"].as_str().unwrap().contains("token"), "{v}");
    env.shutdown().await;
}

#[tokio::test]
async fn a_failed_pod_is_reported_and_calls_fail_with_its_reason() {
    let env = start().await;
    create(&env, json!({"id": "sbf", "image": "python:3.12-slim"})).await;
    env.cluster.set_pod("sbf", "pod-failed-init.json");
    let (status, v) = call(
        &env,
        Method::GET,
        "/sandboxes/sbf/wait?timeout_secs=5",
        None,
    )
    .await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE, "{v}");
    let msg = v["error"]["message"].as_str().unwrap();
    assert!(
        msg.contains("Failed") && msg.contains("envd-agent-install exited with 1"),
        "{msg}"
    );
    let (_, info) = call(&env, Method::GET, "/sandboxes/sbf", None).await;
    assert_eq!(info["state"], "failed");
    let (_, job) = call(
        &env,
        Method::POST,
        "/sandboxes/sbf/exec",
        Some(json!({"command": "true"})),
    )
    .await;
    assert_eq!(job["state"], "failed");
    assert!(
        job["error"]
            .as_str()
            .unwrap()
            .contains("envd-agent-install"),
        "{job}"
    );
    // An image that cannot be pulled: still pending, and the wait names the reason.
    create(
        &env,
        json!({"id": "sbi", "image": "registry.invalid/nope:1"}),
    )
    .await;
    env.cluster.set_pod("sbi", "pod-image-pull-backoff.json");
    let (status, v) = call(
        &env,
        Method::GET,
        "/sandboxes/sbi/wait?timeout_secs=0.5",
        None,
    )
    .await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
    assert!(
        v["error"]["message"]
            .as_str()
            .unwrap()
            .contains("ImagePullBackOff"),
        "{v}"
    );
    env.shutdown().await;
}

#[tokio::test]
async fn create_failures_are_clear_errors_and_leave_nothing_behind() {
    let env = start().await;
    for (code, fixture_name, want_status, want_type, needle) in [
        (
            403,
            "status-403-forbidden.json",
            StatusCode::INTERNAL_SERVER_ERROR,
            "backend_error",
            "role.yaml",
        ),
        (
            422,
            "status-422-invalid.json",
            StatusCode::BAD_REQUEST,
            "invalid_request",
            "spec.containers[0].image",
        ),
        (
            409,
            "status-409-alreadyexists.json",
            StatusCode::CONFLICT,
            "sandbox_exists",
            "already exists",
        ),
    ] {
        *env.cluster.pod_create_error.lock().unwrap() = Some((code, fixture_name));
        let id = format!("bad{code}");
        let (status, v) = call(
            &env,
            Method::POST,
            "/sandboxes",
            Some(json!({"id": id, "image": "python:3.12-slim"})),
        )
        .await;
        assert_eq!(status, want_status, "{v}");
        assert_eq!(v["error"]["type"], want_type, "{v}");
        assert!(
            v["error"]["message"].as_str().unwrap().contains(needle),
            "{v}"
        );
        let (status, _) = call(&env, Method::GET, &format!("/sandboxes/{id}"), None).await;
        assert_eq!(
            status,
            StatusCode::NOT_FOUND,
            "a failed create is not a sandbox"
        );
        if code != 409 {
            // The NetworkPolicy made before the Pod is removed again.
            let np = format!("{}/graft-sbx-{id}", np_path());
            assert!(
                env.cluster
                    .sent()
                    .iter()
                    .any(|s| s.method == Method::DELETE && s.path == np),
                "no DELETE of {np}"
            );
            assert!(
                !env.cluster
                    .policies
                    .lock()
                    .unwrap()
                    .contains_key(&format!("graft-sbx-{id}"))
            );
        }
    }
    // Requests the kubernetes backend cannot serve are refused before the cluster is asked.
    let before = env.cluster.sent().len();
    for (body, needle) in [
        (json!({"id": "Bad_Id", "image": "x"}), "a-z, 0-9 and '-'"),
        (
            json!({"rootfs": "/srv/root"}),
            "`rootfs` needs the local backend",
        ),
        (
            json!({"image": "x", "mounts": [{"source": "/usr", "target": "/mnt/u"}]}),
            "`mounts` needs the local backend",
        ),
        (json!({"cpus": 1}), "`image` is required"),
    ] {
        let (status, v) = call(&env, Method::POST, "/sandboxes", Some(body)).await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{v}");
        assert!(
            v["error"]["message"].as_str().unwrap().contains(needle),
            "{v}"
        );
    }
    let after: Vec<Sent> = env.cluster.sent()[before..].to_vec();
    assert!(after.iter().all(|s| s.method == Method::GET), "{after:?}");
    env.shutdown().await;
}

#[tokio::test]
async fn delete_removes_the_pod_and_its_networkpolicy_and_tolerates_404() {
    let env = start().await;
    create(&env, json!({"id": "sbd", "image": "python:3.12-slim"})).await;
    // Someone deleted the Pod behind envd's back; the delete still succeeds.
    env.cluster.pods.lock().unwrap().remove("graft-sbx-sbd");
    let (status, v) = call(&env, Method::DELETE, "/sandboxes/sbd", None).await;
    assert_eq!(status, StatusCode::OK, "{v}");
    let sent = env.cluster.sent();
    for path in [
        format!("{}/graft-sbx-sbd", pods_path()),
        format!("{}/graft-sbx-sbd", np_path()),
    ] {
        assert!(
            sent.iter()
                .any(|s| s.method == Method::DELETE && s.path == path),
            "no DELETE {path}"
        );
    }
    assert!(env.cluster.policies.lock().unwrap().is_empty());
    let (status, _) = call(&env, Method::GET, "/sandboxes/sbd", None).await;
    assert_eq!(status, StatusCode::NOT_FOUND);
    env.shutdown().await;
}

#[tokio::test]
async fn the_reaper_deletes_expired_sandboxes_and_pods_no_sandbox_owns() {
    let cluster = Arc::new(Cluster::default());
    // Left by an earlier envd of this instance, and one of another instance.
    cluster.put_pod_silently("old1", "pod-running-ready.json");
    let mut np = fixture("networkpolicy.json", "old1", 5);
    cluster
        .policies
        .lock()
        .unwrap()
        .insert("graft-sbx-old1".to_owned(), np.clone());
    let mut other = fixture("pod-running-ready.json", "theirs", 6);
    other["metadata"]["labels"]["graft.dev/envd"] = json!("other");
    cluster
        .pods
        .lock()
        .unwrap()
        .insert("graft-sbx-theirs".to_owned(), other);
    np["metadata"]["name"] = json!("graft-sbx-theirs");
    np["metadata"]["labels"]["graft.dev/envd"] = json!("other");
    cluster
        .policies
        .lock()
        .unwrap()
        .insert("graft-sbx-theirs".to_owned(), np);
    let env = start_with(cluster.clone(), |c| {
        c.reap_interval = Duration::from_millis(100);
        c.kubernetes.reconcile_interval = Duration::from_secs(1);
    })
    .await;
    // At start, before answering anything.
    assert!(!cluster.pods.lock().unwrap().contains_key("graft-sbx-old1"));
    assert!(
        !cluster
            .policies
            .lock()
            .unwrap()
            .contains_key("graft-sbx-old1")
    );
    assert!(
        cluster
            .pods
            .lock()
            .unwrap()
            .contains_key("graft-sbx-theirs"),
        "another envd's Pod was deleted"
    );
    assert!(
        cluster
            .policies
            .lock()
            .unwrap()
            .contains_key("graft-sbx-theirs")
    );

    // A sandbox of ours with a short TTL, and one kept alive.
    create(
        &env,
        json!({"id": "short", "image": "python:3.12-slim", "ttl_secs": 1}),
    )
    .await;
    create(
        &env,
        json!({"id": "kept", "image": "python:3.12-slim", "ttl_secs": 60}),
    )
    .await;
    eventually("the expired sandbox's Pod is deleted", || {
        !cluster.pods.lock().unwrap().contains_key("graft-sbx-short")
    })
    .await;
    let (status, _) = call(&env, Method::GET, "/sandboxes/short", None).await;
    assert_eq!(status, StatusCode::NOT_FOUND);
    // A Pod that appears in the cluster without a sandbox (a create that failed half-way
    // elsewhere) is removed by the next reconcile; ours stays.
    cluster.put_pod_silently("stray", "pod-pending.json");
    eventually("the stray Pod is deleted", || {
        !cluster.pods.lock().unwrap().contains_key("graft-sbx-stray")
    })
    .await;
    assert!(cluster.pods.lock().unwrap().contains_key("graft-sbx-kept"));
    env.shutdown().await;
}

#[tokio::test]
async fn a_restarted_envd_deletes_the_pods_the_previous_one_left() {
    let cluster = Arc::new(Cluster::default());
    let first = start_with(cluster.clone(), |_| {}).await;
    create(&first, json!({"id": "orphan", "image": "python:3.12-slim"})).await;
    // The first envd dies without cleaning up (kill -9): its serve task is dropped.
    let Env { served, .. } = first;
    if let Some(h) = served {
        h.abort();
    }
    assert!(
        cluster
            .pods
            .lock()
            .unwrap()
            .contains_key("graft-sbx-orphan")
    );
    let second = start_with(cluster.clone(), |_| {}).await;
    assert!(
        !cluster
            .pods
            .lock()
            .unwrap()
            .contains_key("graft-sbx-orphan"),
        "the Pod leaked"
    );
    assert!(
        !cluster
            .policies
            .lock()
            .unwrap()
            .contains_key("graft-sbx-orphan")
    );
    // A graceful shutdown deletes its own sandboxes.
    create(&second, json!({"id": "mine", "image": "python:3.12-slim"})).await;
    let cluster = second.shutdown().await;
    assert!(cluster.pods.lock().unwrap().is_empty());
    assert!(cluster.policies.lock().unwrap().is_empty());
}

/// `deploy/kubernetes/role.yaml`'s rules: resource → verbs.
fn role_rules() -> BTreeMap<String, Vec<String>> {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../deploy/kubernetes/role.yaml");
    let text = std::fs::read_to_string(&path).unwrap();
    let list = |l: &str| -> Vec<String> {
        let inner = &l[l.find('[').unwrap() + 1..l.rfind(']').unwrap()];
        inner
            .split(',')
            .map(|s| s.trim().trim_matches('"').to_owned())
            .filter(|s| !s.is_empty())
            .collect()
    };
    let mut rules = BTreeMap::new();
    let mut resources = Vec::new();
    for line in text.lines().map(str::trim) {
        if line.starts_with("resources:") {
            resources = list(line);
        } else if line.starts_with("verbs:") {
            for r in &resources {
                rules.insert(r.clone(), list(line));
            }
        }
    }
    rules
}

#[tokio::test]
async fn the_role_grants_exactly_the_verbs_envd_uses() {
    let cluster = Arc::new(Cluster::default());
    cluster.put_pod_silently("left", "pod-pending.json");
    cluster.policies.lock().unwrap().insert(
        "graft-sbx-left".to_owned(),
        fixture("networkpolicy.json", "left", 7),
    );
    let env = start_with(cluster.clone(), |_| {}).await;
    create(&env, json!({"id": "rbac", "image": "python:3.12-slim"})).await;
    eventually("the watch is open", || {
        env.cluster.sent().iter().any(Sent::is_watch)
    })
    .await;
    let (status, _) = call(&env, Method::DELETE, "/sandboxes/rbac", None).await;
    assert_eq!(status, StatusCode::OK);
    let mut used: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for s in env.cluster.sent() {
        let (resource, collection) = if s.path.starts_with(&pods_path()) {
            ("pods", pods_path())
        } else if s.path.starts_with(&np_path()) {
            ("networkpolicies", np_path())
        } else {
            panic!("envd called {} {}", s.method, s.path)
        };
        let named = s.path != collection;
        let verb = match (s.method.clone(), named) {
            (Method::GET, _) if s.is_watch() => "watch",
            (Method::GET, false) => "list",
            (Method::GET, true) => "get",
            (Method::POST, _) => "create",
            (Method::DELETE, _) => "delete",
            (m, _) => panic!("unexpected {m} {}", s.path),
        };
        let v = used.entry(resource.to_owned()).or_default();
        if !v.iter().any(|x| x == verb) {
            v.push(verb.to_owned());
        }
    }
    let mut granted = role_rules();
    for v in granted.values_mut().chain(used.values_mut()) {
        v.sort();
    }
    assert_eq!(
        used, granted,
        "role.yaml must grant what envd uses, and no more"
    );
    env.shutdown().await;
}

#[test]
fn the_deployed_envd_toml_is_valid_for_the_kubernetes_backend() {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../deploy/kubernetes/envd.toml");
    let file = graft_envd::config::FileConfig::load(&path).unwrap();
    let mut cfg = EnvdConfig::new(
        "127.0.0.1:0".parse().unwrap(),
        PathBuf::from("d"),
        String::new(),
        AgentCommand {
            exe: PathBuf::from("a"),
            args: vec![],
        },
    );
    let file = graft_envd::config::FileConfig {
        api_key: Some("k".to_owned()),
        ..file
    };
    file.apply(&mut cfg).unwrap();
    cfg.validate().unwrap();
    assert_eq!(cfg.backend, graft_envd::BackendKind::Kubernetes);
    assert_eq!(
        cfg.kubernetes
            .envd_pod_labels
            .get("app.kubernetes.io/name")
            .map(String::as_str),
        Some("graft-envd"),
        "deployment.yaml labels envd's Pods app.kubernetes.io/name=graft-envd"
    );
}

#[tokio::test]
async fn a_gateway_session_is_injected_and_harness_files_are_written_once_the_pod_is_ready() {
    use graft_envd::{HarnessRenderer, HarnessRequest, RenderedHarness};
    let render = |r: &HarnessRequest| {
        Ok(RenderedHarness {
            env: vec![(
                "HARNESS_CFG".to_owned(),
                "/workspace/.h/config.toml".to_owned(),
            )],
            files: vec![(
                ".h/config.toml".to_owned(),
                format!("base_url = \"{}\"\n", r.base_url),
            )],
        })
    };
    let env = start_with(Arc::new(Cluster::default()), |c| {
        c.harnesses = Some(HarnessRenderer(Arc::new(render)));
    })
    .await;
    create(
        &env,
        json!({"id": "sbh", "image": "python:3.12-slim",
               "gateway_session": {"session_id": "s1", "api_key": "k1", "harness": "h"}}),
    )
    .await;
    let pod = body_of(&env.cluster.sent(), Method::POST, &pods_path());
    let agent = start_agent(env.agent_port, &token_of(&pod), "sbh");
    assert!(
        !agent.ws.path().join(".h").exists(),
        "written before the Pod was ready"
    );
    env.cluster.set_pod("sbh", "pod-running-ready.json");
    let (_, v) = call(
        &env,
        Method::POST,
        "/sandboxes/sbh/exec",
        Some(json!({"command": "echo $OPENAI_BASE_URL $OPENAI_API_KEY $HARNESS_CFG; cat .h/config.toml"})),
    )
    .await;
    assert_eq!(v["exit_code"], 0, "{v}");
    assert_eq!(
        v["stdout"],
        "http://127.0.0.1:4000/s/s1/v1 k1 /workspace/.h/config.toml\nbase_url = \"http://127.0.0.1:4000/s/s1/v1\"\n"
    );
    env.shutdown().await;
}

#[tokio::test]
async fn envd_does_not_start_when_it_may_not_list_its_pods() {
    let cluster = Arc::new(Cluster::default());
    let mut st = fixture("status-403-forbidden.json", "x", 0);
    st["message"] = json!(st["message"].as_str().unwrap().replace("create", "list"));
    *cluster.list_error.lock().unwrap() = Some((403, st));
    let mut cfg = EnvdConfig::new(
        "127.0.0.1:0".parse().unwrap(),
        PathBuf::from("unused"),
        KEY.to_owned(),
        AgentCommand {
            exe: PathBuf::from("unused"),
            args: vec![],
        },
    );
    cfg.kubernetes.agent_image = AGENT_IMAGE.to_owned();
    let e = match Envd::bind_kubernetes(cfg, api_client(cluster)).await {
        Ok(_) => panic!("envd started without permission to list its Pods"),
        Err(e) => e.to_string(),
    };
    assert!(
        e.contains("cannot list its sandboxes in namespace 'sandboxes'"),
        "{e}"
    );
    assert!(
        e.contains("cannot list resource \"pods\"") && e.contains("role.yaml"),
        "{e}"
    );
}

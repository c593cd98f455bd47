//! The Kubernetes backend against a real cluster. Ignored unless asked for, since it needs a
//! Kubernetes API server:
//!
//! ```text
//! KUBECONFIG=... GRAFT_ENVD_TEST_AGENT_IMAGE=... cargo test -p graft-envd --test kube_cluster -- --ignored
//! ```
//!
//! It needs the agent image (`GRAFT_ENVD_TEST_AGENT_IMAGE`, built from
//! `deploy/kubernetes/Dockerfile.envd-agent`) pullable by the cluster, and must run where Pod
//! IPs are reachable (a node, or a Pod in the cluster), since envd calls each sandbox's agent
//! at its Pod IP. Optional: `GRAFT_ENVD_TEST_NAMESPACE` (default `default`; envd needs the
//! verbs of `deploy/kubernetes/role.yaml` there) and `GRAFT_ENVD_TEST_IMAGE` (default
//! `busybox:1.36`). Run with `--ignored` but without `KUBECONFIG`, it fails and says so.
//!
//! It has not been run where it was written (no cluster there).

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::path::PathBuf;
use std::time::Duration;

use bytes::Bytes;
use http::{Method, Request, StatusCode};
use http_body_util::{BodyExt, Full};
use serde_json::{Value, json};

use graft_envd::{AgentCommand, BackendKind, Envd, EnvdConfig};

async fn call(url: &str, method: Method, path: &str, body: Option<Bytes>) -> (StatusCode, Bytes) {
    let client = hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
        .build_http::<Full<Bytes>>();
    let req = Request::builder()
        .method(method)
        .uri(format!("{url}{path}"))
        .header("x-api-key", "cluster-test-key")
        .header("content-type", "application/json")
        .body(Full::new(body.unwrap_or_default()))
        .unwrap();
    let resp = client.request(req).await.unwrap();
    let status = resp.status();
    (status, resp.into_body().collect().await.unwrap().to_bytes())
}

fn json_of(b: &Bytes) -> Value {
    serde_json::from_slice(b).unwrap_or(Value::Null)
}

#[tokio::test]
#[ignore = "needs a Kubernetes API server: KUBECONFIG=... cargo test -p graft-envd --test kube_cluster -- --ignored"]
async fn a_sandbox_pod_runs_execs_and_moves_files_on_a_real_cluster() {
    assert!(
        std::env::var_os("KUBECONFIG").is_some(),
        "the real-cluster suite needs KUBECONFIG (see the top of envd/tests/kube_cluster.rs for what it needs)"
    );
    let agent_image = std::env::var("GRAFT_ENVD_TEST_AGENT_IMAGE").expect(
        "the real-cluster suite needs GRAFT_ENVD_TEST_AGENT_IMAGE: the envd-agent image (deploy/kubernetes/Dockerfile.envd-agent)",
    );
    let image =
        std::env::var("GRAFT_ENVD_TEST_IMAGE").unwrap_or_else(|_| "busybox:1.36".to_owned());
    let data = tempfile::tempdir().unwrap();
    let mut cfg = EnvdConfig::new(
        "127.0.0.1:0".parse().unwrap(),
        data.path().to_owned(),
        "cluster-test-key".to_owned(),
        AgentCommand {
            exe: PathBuf::from("unused"),
            args: vec![],
        },
    );
    cfg.backend = BackendKind::Kubernetes;
    cfg.kubernetes.namespace = std::env::var("GRAFT_ENVD_TEST_NAMESPACE").ok();
    // An instance of its own: the reaper never touches another envd's Pods.
    cfg.kubernetes.instance = format!("envd-test-{}", std::process::id());
    cfg.kubernetes.agent_image = agent_image;
    // The test runs outside envd's Pods: admit any source to the agent port (the token
    // still guards it).
    cfg.kubernetes.envd_pod_labels.clear();
    cfg.kubernetes.ready_timeout = Duration::from_secs(240);
    let envd = Envd::bind(cfg).await.unwrap();
    let url = envd.url();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let served = tokio::spawn(envd.serve(async move {
        let _ = stopped.await;
    }));

    let (status, b) = call(
        &url,
        Method::POST,
        "/sandboxes",
        Some(Bytes::from(
            json!({"image": image, "cpus": 0.25, "memory_mb": 128, "network": "none"}).to_string(),
        )),
    )
    .await;
    assert_eq!(
        status,
        StatusCode::CREATED,
        "{}",
        String::from_utf8_lossy(&b)
    );
    let id = json_of(&b)["id"].as_str().unwrap().to_owned();
    let (status, b) = call(
        &url,
        Method::GET,
        &format!("/sandboxes/{id}/wait?timeout_secs=240"),
        None,
    )
    .await;
    assert_eq!(status, StatusCode::OK, "{}", String::from_utf8_lossy(&b));
    assert_eq!(json_of(&b)["state"], "ready");

    let (_, b) = call(
        &url,
        Method::POST,
        &format!("/sandboxes/{id}/exec"),
        Some(Bytes::from(
            json!({"command": "echo hi-$GRAFT_SANDBOX_ID; pwd"}).to_string(),
        )),
    )
    .await;
    let job = json_of(&b);
    assert_eq!(job["exit_code"], 0, "{job}");
    assert_eq!(job["stdout"], format!("hi-{id}\n/workspace\n"));
    let (_, b) = call(
        &url,
        Method::POST,
        &format!("/sandboxes/{id}/exec"),
        Some(Bytes::from(
            json!({"command": "sleep 300", "timeout_secs": 1}).to_string(),
        )),
    )
    .await;
    assert_eq!(json_of(&b)["state"], "timed_out");
    let (status, _) = call(
        &url,
        Method::PUT,
        &format!("/sandboxes/{id}/files/a/b.txt"),
        Some(Bytes::from_static(b"data")),
    )
    .await;
    assert_eq!(status, StatusCode::OK);
    let (status, b) = call(
        &url,
        Method::GET,
        &format!("/sandboxes/{id}/files/a/b.txt"),
        None,
    )
    .await;
    assert_eq!((status, &b[..]), (StatusCode::OK, &b"data"[..]));
    // No route out with network "none".
    let (_, b) = call(
        &url,
        Method::POST,
        &format!("/sandboxes/{id}/exec"),
        Some(Bytes::from(json!({"command": "wget -T 3 -q -O- http://1.1.1.1/ && echo reached", "timeout_secs": 10}).to_string())),
    )
    .await;
    assert!(
        !json_of(&b)["stdout"]
            .as_str()
            .unwrap_or("")
            .contains("reached"),
        "egress was not denied (does the CNI enforce NetworkPolicies?)"
    );

    let (status, _) = call(&url, Method::DELETE, &format!("/sandboxes/{id}"), None).await;
    assert_eq!(status, StatusCode::OK);
    let _ = stop.send(());
    served.await.unwrap();
}

//! envd's latency and burst benchmark (the numbers in docs/BENCHMARKS.md):
//!
//! - exec of `true` through the API (sync), p50/p99, against two baselines measured in the
//!   same run: a plain fork+exec of /bin/true, and bubblewrap with the same namespaces run
//!   directly (the floor envd builds on);
//! - create → ready (POST /sandboxes answers when the sandbox is usable), p50/p99;
//! - a burst of N concurrent sandboxes, each create → 4 execs → delete, success rate and
//!   wall time.
//!
//! Needs root (cgroups, the sandbox user) and bubblewrap, like the local backend.
//! `cargo bench -p graft-envd --bench envd [-- --burst 200 --execs 300]`
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::os::unix::fs::PermissionsExt;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use bytes::Bytes;
use graft_envd::{AgentCommand, Envd, EnvdConfig};
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use serde_json::{Value, json};

const KEY: &str = "bench-key";

type C = Client<HttpConnector, Full<Bytes>>;

async fn call(c: &C, method: &str, url: &str, body: Option<Value>) -> (u16, Value) {
    let req = http::Request::builder()
        .method(method)
        .uri(url)
        .header("x-api-key", KEY)
        .body(Full::new(Bytes::from(
            body.map(|b| b.to_string()).unwrap_or_default(),
        )))
        .unwrap();
    let resp = c.request(req).await.unwrap();
    let status = resp.status().as_u16();
    let bytes = resp.into_body().collect().await.unwrap().to_bytes();
    (
        status,
        serde_json::from_slice(&bytes).unwrap_or(Value::Null),
    )
}

fn pct(v: &mut [f64], p: f64) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    let i = ((v.len() as f64 - 1.0) * p).round() as usize;
    v[i]
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

fn arg(name: &str, default: usize) -> usize {
    let args: Vec<String> = std::env::args().collect();
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1))
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn main() {
    // This binary is also the agent inside the sandboxes (`<bench> envd-agent -- ...`).
    let args: Vec<String> = std::env::args().collect();
    if args.get(1).map(String::as_str) == Some("envd-agent") {
        std::process::exit(graft_envd::agent::main_with(&args[2..]));
    }
    let execs = arg("--execs", 300);
    let creates = arg("--creates", 50);
    let burst = arg("--burst", 200);
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(run(execs, creates, burst));
}

async fn run(execs: usize, creates: usize, burst: usize) {
    let dir = tempfile::tempdir().unwrap();
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o711)).unwrap();
    let data = dir.path().join("data");
    let agent = AgentCommand {
        exe: std::env::current_exe().unwrap(),
        args: vec!["envd-agent".to_owned()],
    };
    let mut cfg = EnvdConfig::new("127.0.0.1:0".parse().unwrap(), data, KEY.to_owned(), agent);
    cfg.defaults.pids = 256;
    let envd = Envd::bind(cfg).await.unwrap();
    let base = envd.url();
    let enforced = envd.limits_enforced();
    tokio::spawn(envd.serve(std::future::pending()));
    let c: C = Client::builder(TokioExecutor::new()).build_http();

    // Baseline 1: fork+exec of /bin/true.
    let mut fork: Vec<f64> = (0..execs)
        .map(|_| {
            let t = Instant::now();
            Command::new("/bin/true").status().unwrap();
            ms(t.elapsed())
        })
        .collect();
    // Baseline 2: bubblewrap with the same namespaces, run directly.
    let mut bw: Vec<f64> = (0..execs)
        .map(|_| {
            let t = Instant::now();
            let s = Command::new("bwrap")
                .args([
                    "--unshare-all",
                    "--as-pid-1",
                    "--die-with-parent",
                    "--ro-bind",
                    "/usr",
                    "/usr",
                    "--symlink",
                    "usr/lib",
                    "/lib",
                    "--symlink",
                    "usr/lib64",
                    "/lib64",
                    "--symlink",
                    "usr/bin",
                    "/bin",
                    "--proc",
                    "/proc",
                    "--dev",
                    "/dev",
                    "--",
                    "/bin/true",
                ])
                .stdout(Stdio::null())
                .status()
                .unwrap();
            assert!(s.success());
            ms(t.elapsed())
        })
        .collect();

    // exec `true` through the API.
    let (st, sb) = call(&c, "POST", &format!("{base}/sandboxes"), Some(json!({}))).await;
    assert_eq!(st, 201, "{sb}");
    let id = sb["id"].as_str().unwrap().to_owned();
    let url = format!("{base}/sandboxes/{id}/exec");
    let mut api = Vec::with_capacity(execs);
    for _ in 0..execs {
        let t = Instant::now();
        let (st, r) = call(&c, "POST", &url, Some(json!({"argv": ["true"]}))).await;
        api.push(ms(t.elapsed()));
        assert!(st == 200 && r["exit_code"] == 0, "{r}");
    }
    call(&c, "DELETE", &format!("{base}/sandboxes/{id}"), None).await;

    // create → ready, then delete (timed separately).
    let mut create = Vec::new();
    let mut delete = Vec::new();
    for _ in 0..creates {
        let t = Instant::now();
        let (st, sb) = call(&c, "POST", &format!("{base}/sandboxes"), Some(json!({}))).await;
        create.push(ms(t.elapsed()));
        assert_eq!(st, 201, "{sb}");
        let id = sb["id"].as_str().unwrap();
        let t = Instant::now();
        let (st, _) = call(&c, "DELETE", &format!("{base}/sandboxes/{id}"), None).await;
        delete.push(ms(t.elapsed()));
        assert_eq!(st, 200);
    }

    // Burst: N concurrent sandboxes, each create → 4 execs → delete.
    let t = Instant::now();
    let mut tasks = Vec::new();
    for i in 0..burst {
        let c = c.clone();
        let base = base.clone();
        tasks.push(tokio::spawn(async move {
            let (st, sb) = call(&c, "POST", &format!("{base}/sandboxes"), Some(json!({}))).await;
            if st != 201 {
                return Err(format!("create: {st} {sb}"));
            }
            let id = sb["id"].as_str().unwrap_or_default().to_owned();
            for k in 0..4 {
                let (st, r) = call(
                    &c,
                    "POST",
                    &format!("{base}/sandboxes/{id}/exec"),
                    Some(json!({"argv": ["echo", format!("{i}-{k}")]})),
                )
                .await;
                if st != 200 || r["stdout"] != format!("{i}-{k}\n") {
                    return Err(format!("exec: {st} {r}"));
                }
            }
            let (st, r) = call(&c, "DELETE", &format!("{base}/sandboxes/{id}"), None).await;
            if st != 200 {
                return Err(format!("delete: {st} {r}"));
            }
            Ok(())
        }));
    }
    let mut ok = 0;
    let mut errors = Vec::new();
    for t in tasks {
        match t.await.unwrap() {
            Ok(()) => ok += 1,
            Err(e) => errors.push(e),
        }
    }
    let burst_wall = t.elapsed();

    let (f50, f99) = (pct(&mut fork, 0.5), pct(&mut fork, 0.99));
    let (b50, b99) = (pct(&mut bw, 0.5), pct(&mut bw, 0.99));
    let (a50, a99) = (pct(&mut api, 0.5), pct(&mut api, 0.99));
    let (c50, c99) = (pct(&mut create, 0.5), pct(&mut create, 0.99));
    let (d50, d99) = (pct(&mut delete, 0.5), pct(&mut delete, 0.99));
    println!(
        "cgroup limits enforced: {enforced}; {} CPUs",
        std::thread::available_parallelism()
            .map(|n| n.get())
            .unwrap_or(0)
    );
    println!();
    println!("| measurement | n | p50 ms | p99 ms | p50 vs bwrap alone |");
    println!("|---|---|---|---|---|");
    println!(
        "| fork+exec /bin/true (baseline) | {execs} | {f50:.2} | {f99:.2} | {:.2}x |",
        f50 / b50
    );
    println!(
        "| bwrap --unshare-all /bin/true (baseline) | {execs} | {b50:.2} | {b99:.2} | 1.00x |"
    );
    println!(
        "| envd exec `true` via API (sync) | {execs} | {a50:.2} | {a99:.2} | {:.2}x |",
        a50 / b50
    );
    println!("| envd create → ready | {creates} | {c50:.2} | {c99:.2} | |");
    println!("| envd delete | {creates} | {d50:.2} | {d99:.2} | |");
    println!();
    println!(
        "burst: {burst} concurrent sandboxes × (create → 4 execs → delete): {ok}/{burst} succeeded ({:.1}%) in {:.2} s",
        100.0 * ok as f64 / burst.max(1) as f64,
        burst_wall.as_secs_f64()
    );
    for e in errors.iter().take(5) {
        println!("  error: {e}");
    }
}

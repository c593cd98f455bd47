//! envd through its HTTP API, with the real `graft envd` binary: lifecycle, exec (sync,
//! job, SSE), files, apply_patch, timeouts, idempotency, TTL reaping, and containment
//! (files API and exec escapes, network, fork bomb, memory hog, orphaned processes).
//!
//! The local backend needs root (cgroups, the sandbox user) and bubblewrap
//! (`bash scripts/setup-test-env.sh` installs it). Without them these tests fail, with
//! envd's own message saying what is missing.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use common::http::{self, Resp};
use common::{Proc, Stack};
use serde_json::{Value, json};

const KEY: &str = "envd-test-key";

struct Envd {
    proc: Proc,
    data: PathBuf,
    _dir: tempfile::TempDir,
    rt: tokio::runtime::Runtime,
}

impl Envd {
    fn start(args: &[&str]) -> Envd {
        Self::start_at("data", args)
    }

    /// envd with its data dir at `sub` below a fresh temporary directory.
    fn start_at(sub: &str, args: &[&str]) -> Envd {
        let dir = tempfile::tempdir().unwrap();
        // The sandbox user must be able to reach the workspaces below it.
        std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o711)).unwrap();
        let data = dir.path().join(sub);
        let proc = Proc::envd(&data, KEY, args);
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        Envd {
            proc,
            data,
            _dir: dir,
            rt,
        }
    }

    fn raw(&self, method: &str, path: &str, headers: &[(&str, &str)], body: Vec<u8>) -> Resp {
        let url = format!("{}{path}", self.proc.url);
        self.rt
            .block_on(http::send(method, &url, headers, body))
            .unwrap_or_else(|e| panic!("{method} {url} failed: {e}"))
    }

    fn call(&self, method: &str, path: &str, body: Option<Value>) -> Resp {
        let body = body.map(|b| b.to_string().into_bytes()).unwrap_or_default();
        self.raw(method, path, &[("x-api-key", KEY)], body)
    }

    fn ok(&self, method: &str, path: &str, body: Option<Value>) -> Value {
        let r = self.call(method, path, body);
        assert!(
            r.status == 200 || r.status == 201 || r.status == 202,
            "{method} {path}: {} {}",
            r.status,
            r.text()
        );
        r.json()
    }

    fn create(&self, body: Value) -> String {
        let r = self.call("POST", "/sandboxes", Some(body));
        assert_eq!(r.status, 201, "create: {}", r.text());
        r.json()["id"].as_str().unwrap().to_owned()
    }

    fn exec(&self, id: &str, body: Value) -> Value {
        let r = self.call("POST", &format!("/sandboxes/{id}/exec"), Some(body.clone()));
        assert_eq!(r.status, 200, "exec {body}: {}", r.text());
        r.json()
    }

    fn sh(&self, id: &str, cmd: &str) -> Value {
        self.exec(id, json!({"command": cmd, "timeout_secs": 60}))
    }

    /// Runs a command that must exit 0; returns its stdout.
    fn sh_ok(&self, id: &str, cmd: &str) -> String {
        let r = self.sh(id, cmd);
        assert_eq!(r["exit_code"], 0, "{cmd}: {r:#}");
        r["stdout"].as_str().unwrap().to_owned()
    }

    fn error_type(r: &Resp) -> String {
        r.json()["error"]["type"]
            .as_str()
            .unwrap_or_default()
            .to_owned()
    }
}

/// Host processes whose command line contains `marker`.
fn host_procs_with(marker: &str) -> Vec<String> {
    let mut found = Vec::new();
    for e in std::fs::read_dir("/proc").unwrap().flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        if !name.chars().all(|c| c.is_ascii_digit()) {
            continue;
        }
        if let Ok(cmd) = std::fs::read(e.path().join("cmdline")) {
            let cmd = String::from_utf8_lossy(&cmd).replace('\0', " ");
            if cmd.contains(marker) {
                found.push(format!("{name}: {cmd}"));
            }
        }
    }
    found
}

fn wait_until(what: &str, limit: Duration, mut f: impl FnMut() -> bool) {
    let deadline = Instant::now() + limit;
    while !f() {
        assert!(
            Instant::now() < deadline,
            "{what} did not happen within {limit:?}"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

fn workspace_dir(data: &Path, id: &str) -> PathBuf {
    data.join("sandboxes").join(id)
}

// -------------------------------------------------------------------------------------
// Lifecycle and API basics

#[test]
fn lifecycle_create_get_list_wait_heartbeat_delete() {
    let e = Envd::start(&[]);
    let id = e.create(
        json!({"id": "life-1", "ttl_secs": 300, "labels": {"task": "t1"}, "env": {"FOO": "bar"}}),
    );
    assert_eq!(id, "life-1");
    let got = e.ok("GET", "/sandboxes/life-1", None);
    assert_eq!(got["state"], "ready", "{got:#}");
    assert_eq!(got["backend"], "local");
    assert_eq!(got["workspace"], "/workspace");
    assert_eq!(got["labels"]["task"], "t1");
    assert_eq!(
        got["limits_enforced"], true,
        "cgroups are expected on this host: {got:#}"
    );
    assert_eq!(got["network"], "none", "no --gateway given: {got:#}");
    let listed = e.ok("GET", "/sandboxes", None);
    let ids: Vec<&str> = listed["sandboxes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s["id"].as_str().unwrap())
        .collect();
    assert_eq!(ids, vec!["life-1"]);
    let waited = e.ok("GET", "/sandboxes/life-1/wait", None);
    assert_eq!(waited["state"], "ready");
    let before = got["expires_at_ms"].as_u64().unwrap();
    std::thread::sleep(Duration::from_millis(20));
    let hb = e.ok("POST", "/sandboxes/life-1/heartbeat", None);
    assert!(
        hb["expires_at_ms"].as_u64().unwrap() > before,
        "heartbeat renews: {hb:#}"
    );
    // The sandbox's env reaches commands; the exec's own env wins over it.
    assert_eq!(e.sh_ok(&id, "echo $FOO"), "bar\n");
    let r = e.exec(&id, json!({"command": "echo $FOO", "env": {"FOO": "baz"}}));
    assert_eq!(r["stdout"], "baz\n");
    // A second sandbox with the same id is refused.
    let dup = e.call("POST", "/sandboxes", Some(json!({"id": "life-1"})));
    assert_eq!(dup.status, 409, "{}", dup.text());
    assert!(workspace_dir(&e.data, &id).join("workspace").is_dir());
    let del = e.ok("DELETE", "/sandboxes/life-1", None);
    assert_eq!(del["deleted"], true);
    let gone = e.call("GET", "/sandboxes/life-1", None);
    assert_eq!(gone.status, 404);
    assert_eq!(Envd::error_type(&gone), "sandbox_not_found");
    assert!(
        gone.json()["error"]["message"]
            .as_str()
            .unwrap()
            .contains("'life-1'"),
        "the message names the sandbox: {}",
        gone.text()
    );
    assert!(
        !workspace_dir(&e.data, &id).exists(),
        "delete removes the sandbox's directory"
    );
    // The metrics saw it all (no key needed to scrape them).
    let m = e.raw("GET", "/metrics", &[], vec![]);
    assert_eq!(m.status, 200);
    let text = m.text();
    for line in [
        "graft_envd_sandboxes 0",
        "graft_envd_sandboxes_created_total 1",
        "graft_envd_sandboxes_deleted_total{reason=\"request\"} 1",
        "graft_envd_jobs_total{state=\"exited\"} 2",
        "graft_envd_create_seconds_count 1",
    ] {
        assert!(text.lines().any(|l| l == line), "no '{line}' in:\n{text}");
    }
}

#[test]
fn api_key_is_required_and_errors_name_the_problem() {
    let e = Envd::start(&[]);
    // Health and the OpenAPI document are open; everything else needs the key.
    assert_eq!(e.raw("GET", "/healthz", &[], vec![]).status, 200);
    let doc = e.raw("GET", "/openapi.json", &[], vec![]).json();
    assert_eq!(doc["openapi"], "3.1.0");
    for (m, p) in [
        ("post", "/sandboxes"),
        ("post", "/sandboxes/{id}/exec"),
        ("put", "/sandboxes/{id}/files/{path}"),
        ("post", "/sandboxes/{id}/apply_patch"),
        ("get", "/sandboxes/{id}/jobs/{job}/wait"),
    ] {
        assert!(
            doc["paths"][p][m].is_object(),
            "{m} {p} missing from /openapi.json"
        );
    }
    let no_key = e.raw("GET", "/sandboxes", &[], vec![]);
    assert_eq!(no_key.status, 401);
    assert_eq!(Envd::error_type(&no_key), "unauthorized");
    assert!(no_key.text().contains("X-API-Key"), "{}", no_key.text());
    let wrong = e.raw(
        "GET",
        "/sandboxes",
        &[("x-api-key", "envd-test-kez")],
        vec![],
    );
    assert_eq!(wrong.status, 401);
    // Unknown fields are refused by name.
    let bad = e.call("POST", "/sandboxes", Some(json!({"memroy_mb": 10})));
    assert_eq!(bad.status, 400);
    assert!(bad.text().contains("memroy_mb"), "{}", bad.text());
    let img = e.call("POST", "/sandboxes", Some(json!({"image": "python:3.12"})));
    assert_eq!(img.status, 400);
    assert!(img.text().contains("docker save"), "{}", img.text());
    let gw = e.call("POST", "/sandboxes", Some(json!({"network": "gateway"})));
    assert_eq!(gw.status, 400);
    assert!(gw.text().contains("--gateway"), "{}", gw.text());
    let route = e.call("GET", "/nope", None);
    assert_eq!(route.status, 404);
    assert_eq!(Envd::error_type(&route), "no_route");
    let id = e.create(json!({}));
    let none = e.call("POST", &format!("/sandboxes/{id}/exec"), Some(json!({})));
    assert_eq!(none.status, 400);
    assert!(none.text().contains("command"), "{}", none.text());
    let job = e.call("GET", &format!("/sandboxes/{id}/jobs/job-x"), None);
    assert_eq!(job.status, 404);
    assert_eq!(Envd::error_type(&job), "job_not_found");
}

// -------------------------------------------------------------------------------------
// Exec

#[test]
fn exec_reports_exit_code_output_cwd_stdin_and_caps_output() {
    let e = Envd::start(&[]);
    let id = e.create(json!({}));
    let r = e.sh(&id, "echo out; echo err >&2; exit 3");
    assert_eq!(r["state"], "exited", "{r:#}");
    assert_eq!(r["exit_code"], 3);
    assert_eq!(r["stdout"], "out\n");
    assert_eq!(r["stderr"], "err\n");
    assert_eq!(r["timed_out"], false);
    // argv runs without a shell.
    let r = e.exec(&id, json!({"argv": ["printf", "%s|", "a b", "$HOME"]}));
    assert_eq!(r["stdout"], "a b|$HOME|", "{r:#}");
    // cwd relative to the workspace; HOME is the workspace.
    e.sh_ok(&id, "mkdir -p sub/dir");
    let r = e.exec(&id, json!({"command": "pwd; echo $HOME", "cwd": "sub/dir"}));
    assert_eq!(r["stdout"], "/workspace/sub/dir\n/workspace\n", "{r:#}");
    let missing = e.call(
        "POST",
        &format!("/sandboxes/{id}/exec"),
        Some(json!({"command": "pwd", "cwd": "no/such"})),
    );
    assert_eq!(missing.status, 400);
    assert!(missing.text().contains("no/such"), "{}", missing.text());
    let r = e.exec(
        &id,
        json!({"command": "tr a-z A-Z", "stdin": "hello stdin"}),
    );
    assert_eq!(r["stdout"], "HELLO STDIN");
    // Output past the cap is counted, not kept.
    let r = e.exec(
        &id,
        json!({"command": "head -c 100000 /dev/zero | tr '\\0' x", "max_output_bytes": 1000}),
    );
    assert_eq!(
        r["stdout"].as_str().unwrap().len(),
        1000,
        "{}",
        r["stdout_bytes"]
    );
    assert_eq!(r["stdout_bytes"], 100000);
    assert_eq!(r["stdout_truncated"], true);
    assert_eq!(r["stderr_truncated"], false);
    let r = e.sh(&id, "exec /no/such/program");
    assert_eq!(r["exit_code"], 127, "{r:#}");
}

#[test]
fn background_jobs_can_be_polled_waited_and_killed() {
    let e = Envd::start(&[]);
    let id = e.create(json!({}));
    let r = e.call(
        "POST",
        &format!("/sandboxes/{id}/exec"),
        Some(json!({"command": "read line; echo got $line", "stdin": "x\n", "background": true})),
    );
    assert_eq!(r.status, 202, "{}", r.text());
    let job = r.json()["job_id"].as_str().unwrap().to_owned();
    let done = e.ok(
        "GET",
        &format!("/sandboxes/{id}/jobs/{job}/wait?timeout_secs=60"),
        None,
    );
    assert_eq!(done["state"], "exited", "{done:#}");
    assert_eq!(done["stdout"], "got x\n");
    let again = e.ok("GET", &format!("/sandboxes/{id}/jobs/{job}"), None);
    assert_eq!(again["stdout"], "got x\n");
    // A long job: still running after a short wait, then killed on request.
    let long = e.ok(
        "POST",
        &format!("/sandboxes/{id}/exec"),
        Some(json!({"command": "sleep 300", "background": true})),
    );
    let long_id = long["job_id"].as_str().unwrap().to_owned();
    let waited = e.ok(
        "GET",
        &format!("/sandboxes/{id}/jobs/{long_id}/wait?timeout_secs=0.3"),
        None,
    );
    assert_eq!(waited["state"], "running", "{waited:#}");
    let got = e.ok("GET", &format!("/sandboxes/{id}"), None);
    assert_eq!(got["jobs_running"], 1, "{got:#}");
    let killed = e.ok(
        "POST",
        &format!("/sandboxes/{id}/jobs/{long_id}/kill"),
        None,
    );
    assert_eq!(killed["state"], "killed", "{killed:#}");
    let jobs = e.ok("GET", &format!("/sandboxes/{id}/jobs"), None);
    assert_eq!(jobs["jobs"].as_array().unwrap().len(), 2, "{jobs:#}");
    let got = e.ok("GET", &format!("/sandboxes/{id}"), None);
    assert_eq!(got["processes"], 0, "nothing left running: {got:#}");
}

#[test]
fn exec_streams_output_as_server_sent_events() {
    let e = Envd::start(&[]);
    let id = e.create(json!({}));
    let r = e.raw(
        "POST",
        &format!("/sandboxes/{id}/exec"),
        &[("x-api-key", KEY), ("accept", "text/event-stream")],
        json!({"command": "echo one; echo two >&2; echo three"})
            .to_string()
            .into_bytes(),
    );
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(
        r.header("content-type").as_deref(),
        Some("text/event-stream")
    );
    let text = r.text();
    let events: Vec<&str> = text
        .split("\n\n")
        .filter_map(|ev| ev.lines().find_map(|l| l.strip_prefix("event: ")))
        .collect();
    assert_eq!(events.first(), Some(&"job"), "{text}");
    assert_eq!(events.last(), Some(&"exit"), "{text}");
    let data = r.sse_data();
    let exit: Value = serde_json::from_str(data.last().unwrap()).unwrap();
    assert_eq!(exit["exit_code"], 0, "{exit:#}");
    assert_eq!(exit["stdout"], "one\nthree\n");
    let streamed_out: String = text
        .split("\n\n")
        .filter(|ev| ev.starts_with("event: stdout"))
        .map(|ev| {
            let d = ev.lines().find_map(|l| l.strip_prefix("data: ")).unwrap();
            serde_json::from_str::<Value>(d).unwrap()["data"]
                .as_str()
                .unwrap()
                .to_owned()
        })
        .collect();
    assert_eq!(streamed_out, "one\nthree\n", "{text}");
    assert!(text.contains("event: stderr"), "{text}");
}

/// A command that ignores SIGTERM and leaves a double-forked, setsid'd, SIGTERM-ignoring
/// grandchild: after the timeout nothing of it is left on the host.
#[test]
fn timeout_kills_the_whole_process_tree() {
    let e = Envd::start(&["--kill-grace-secs", "0.5"]);
    let id = e.create(json!({}));
    let marker = format!("envd-orphan-{}", std::process::id());
    let inner = format!(
        "trap '' TERM; while :; do echo beat >> /workspace/beat; sleep 0.2; done # {marker}"
    );
    let cmd = format!("trap '' TERM; ( ( setsid sh -c \"{inner}\" & ) & ); sleep 1000 # {marker}");
    let r = e.ok(
        "POST",
        &format!("/sandboxes/{id}/exec"),
        Some(json!({"command": cmd, "timeout_secs": 8, "background": true})),
    );
    let job = r["job_id"].as_str().unwrap().to_owned();
    // The orphan is alive on the host while the job runs (so the check below can fail).
    wait_until("the orphan showing up", Duration::from_secs(30), || {
        host_procs_with(&marker).len() >= 2
    });
    let done = e.ok("GET", &format!("/sandboxes/{id}/jobs/{job}/wait"), None);
    assert_eq!(done["state"], "timed_out", "{done:#}");
    assert_eq!(done["timed_out"], true);
    assert_eq!(done["exit_code"], 137, "ended by SIGKILL: {done:#}");
    let left = host_procs_with(&marker);
    assert!(left.is_empty(), "processes outlived the timeout: {left:#?}");
    let got = e.ok("GET", &format!("/sandboxes/{id}"), None);
    assert_eq!(got["processes"], 0, "{got:#}");
    // The heartbeat file stopped growing: read it twice, a beat period apart.
    let a = e
        .call("GET", &format!("/sandboxes/{id}/files/beat"), None)
        .body;
    std::thread::sleep(Duration::from_millis(600));
    let b = e
        .call("GET", &format!("/sandboxes/{id}/files/beat"), None)
        .body;
    assert!(!a.is_empty());
    assert_eq!(a, b, "something still writes to the workspace");
    // The sandbox is still usable.
    assert_eq!(e.sh_ok(&id, "echo alive"), "alive\n");
}

#[test]
fn idempotency_key_never_runs_a_command_twice() {
    let e = Envd::start(&[]);
    let id = e.create(json!({}));
    let body = json!({"command": "echo run >> runs; wc -l < runs", "idempotency_key": "k-1"});
    let first = e.exec(&id, body.clone());
    assert_eq!(first["stdout"], "1\n", "{first:#}");
    let retry = e.exec(&id, body.clone());
    assert_eq!(
        retry["job_id"], first["job_id"],
        "a retry returns the first job"
    );
    assert_eq!(retry["stdout"], "1\n");
    // The header works too, and concurrent retries share one run.
    let path = format!("/sandboxes/{id}/exec");
    let url = format!("{}{path}", e.proc.url);
    let b2 = json!({"command": "sleep 1; echo run >> runs2; wc -l < runs2"})
        .to_string()
        .into_bytes();
    let results = e.rt.block_on(async {
        let hs: [(&str, &str); 2] = [("x-api-key", KEY), ("idempotency-key", "k-2")];
        let a = http::send("POST", &url, &hs, b2.clone());
        let b = http::send("POST", &url, &hs, b2.clone());
        let c = http::send("POST", &url, &hs, b2.clone());
        let (a, b, c) = tokio::join!(a, b, c);
        [a.unwrap().json(), b.unwrap().json(), c.unwrap().json()]
    });
    for r in &results {
        assert_eq!(r["job_id"], results[0]["job_id"], "{results:#?}");
        assert_eq!(r["stdout"], "1\n", "{r:#}");
    }
    let runs = e.call("GET", &format!("/sandboxes/{id}/files/runs2"), None);
    assert_eq!(runs.text(), "run\n", "the command ran exactly once");
    // The same key for another command is a conflict, not a silent reuse.
    let other = e.call(
        "POST",
        &path,
        Some(json!({"command": "echo other", "idempotency_key": "k-1"})),
    );
    assert_eq!(other.status, 409, "{}", other.text());
    assert_eq!(Envd::error_type(&other), "idempotency_conflict");
    assert!(other.text().contains("k-1"), "{}", other.text());
}

#[test]
fn ttl_reaps_idle_sandboxes_and_heartbeats_keep_them() {
    let e = Envd::start(&["--reap-interval-ms", "100"]);
    let kept = e.create(json!({"ttl_secs": 3}));
    let idle = e.create(json!({"ttl_secs": 3}));
    e.sh_ok(&idle, "echo data > f");
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        e.ok("POST", &format!("/sandboxes/{kept}/heartbeat"), None);
        let r = e.call("GET", "/sandboxes", None).json();
        let alive: Vec<&str> = r["sandboxes"]
            .as_array()
            .unwrap()
            .iter()
            .map(|s| s["id"].as_str().unwrap())
            .collect();
        if !alive.contains(&idle.as_str()) {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the idle sandbox was never reaped"
        );
        std::thread::sleep(Duration::from_millis(300));
    }
    assert_eq!(
        e.call("GET", &format!("/sandboxes/{idle}"), None).status,
        404
    );
    assert!(
        !workspace_dir(&e.data, &idle).exists(),
        "the reaper removes the directory"
    );
    assert_eq!(
        e.call("GET", &format!("/sandboxes/{kept}"), None).status,
        200
    );
    assert!(e.proc.stderr_contains("ttl expired"), "{}", e.proc.stderr());
}

// -------------------------------------------------------------------------------------
// Files and patches

#[test]
fn files_round_trip_list_delete_and_size_limit() {
    let e = Envd::start(&["--max-file-bytes", "4096"]);
    let id = e.create(json!({}));
    let data: Vec<u8> = (0..=255u8).cycle().take(3000).collect();
    let put = e.raw(
        "PUT",
        &format!("/sandboxes/{id}/files/src/pkg/data.bin"),
        &[("x-api-key", KEY)],
        data.clone(),
    );
    assert_eq!(put.status, 200, "{}", put.text());
    assert_eq!(put.json()["bytes"], 3000);
    let got = e.call(
        "GET",
        &format!("/sandboxes/{id}/files/src/pkg/data.bin"),
        None,
    );
    assert_eq!(got.status, 200);
    assert_eq!(got.body.to_vec(), data);
    // What the API wrote, the sandbox can read and change; what it writes, the API reads.
    assert_eq!(e.sh_ok(&id, "wc -c < src/pkg/data.bin").trim(), "3000");
    e.sh_ok(
        &id,
        "echo more >> src/pkg/data.bin && printf made > src/made.txt",
    );
    let made = e.call("GET", &format!("/sandboxes/{id}/files/src/made.txt"), None);
    assert_eq!(made.text(), "made");
    let script = e.raw(
        "PUT",
        &format!("/sandboxes/{id}/files/run.sh?mode=755"),
        &[("x-api-key", KEY)],
        b"#!/bin/sh\necho script ran\n".to_vec(),
    );
    assert_eq!(script.status, 200, "{}", script.text());
    assert_eq!(e.sh_ok(&id, "./run.sh"), "script ran\n");
    let list = e.ok("GET", &format!("/sandboxes/{id}/files?dir=src"), None);
    let entries = list["entries"].as_array().unwrap();
    let names: Vec<(&str, &str)> = entries
        .iter()
        .map(|x| (x["name"].as_str().unwrap(), x["type"].as_str().unwrap()))
        .collect();
    assert_eq!(
        names,
        vec![("made.txt", "file"), ("pkg", "dir")],
        "{list:#}"
    );
    let root = e.ok("GET", &format!("/sandboxes/{id}/files"), None);
    assert!(root["entries"].as_array().unwrap().len() >= 2);
    let dir = e.call("GET", &format!("/sandboxes/{id}/files/src"), None);
    assert_eq!(dir.status, 400);
    assert_eq!(Envd::error_type(&dir), "is_a_directory");
    let missing = e.call("GET", &format!("/sandboxes/{id}/files/nope.txt"), None);
    assert_eq!(missing.status, 404);
    assert!(missing.text().contains("nope.txt"), "{}", missing.text());
    let big = e.raw(
        "PUT",
        &format!("/sandboxes/{id}/files/big.bin"),
        &[("x-api-key", KEY)],
        vec![7u8; 5000],
    );
    assert_eq!(big.status, 413, "{}", big.text());
    assert!(big.text().contains("4096"), "{}", big.text());
    assert_eq!(
        e.call("GET", &format!("/sandboxes/{id}/files/big.bin"), None)
            .status,
        404
    );
    // A file the sandbox made too big for the API is refused on download too.
    e.sh_ok(&id, "head -c 10000 /dev/zero > huge.bin");
    let huge = e.call("GET", &format!("/sandboxes/{id}/files/huge.bin"), None);
    assert_eq!(huge.status, 413, "{}", huge.text());
    let del = e.call("DELETE", &format!("/sandboxes/{id}/files/src"), None);
    assert_eq!(
        del.status,
        400,
        "a directory needs ?recursive=true: {}",
        del.text()
    );
    let del = e.call(
        "DELETE",
        &format!("/sandboxes/{id}/files/src?recursive=true"),
        None,
    );
    assert_eq!(del.status, 200, "{}", del.text());
    assert_eq!(e.sh(&id, "test -e src")["exit_code"], 1);
}

#[test]
fn apply_patch_applies_in_the_workspace_and_reports_failures() {
    let e = Envd::start(&[]);
    let id = e.create(json!({}));
    e.raw(
        "PUT",
        &format!("/sandboxes/{id}/files/app/main.py"),
        &[("x-api-key", KEY)],
        b"def main():\n    print('hello')\n".to_vec(),
    );
    let patch = "diff --git a/app/main.py b/app/main.py\n--- a/app/main.py\n+++ b/app/main.py\n@@ -1,2 +1,2 @@\n def main():\n-    print('hello')\n+    print('patched')\n";
    let checked = e.ok(
        "POST",
        &format!("/sandboxes/{id}/apply_patch"),
        Some(json!({"patch": patch, "check": true})),
    );
    assert_eq!(checked["applied"], false, "{checked:#}");
    let unchanged = e.call("GET", &format!("/sandboxes/{id}/files/app/main.py"), None);
    assert!(unchanged.text().contains("hello"));
    let r = e.ok(
        "POST",
        &format!("/sandboxes/{id}/apply_patch"),
        Some(json!({"patch": patch})),
    );
    assert_eq!(r["applied"], true, "{r:#}");
    let now = e.call("GET", &format!("/sandboxes/{id}/files/app/main.py"), None);
    assert_eq!(now.text(), "def main():\n    print('patched')\n");
    // The same patch again no longer applies: 422 with git's own words.
    let again = e.call(
        "POST",
        &format!("/sandboxes/{id}/apply_patch"),
        Some(json!({"patch": patch})),
    );
    assert_eq!(again.status, 422, "{}", again.text());
    assert_eq!(Envd::error_type(&again), "patch_failed");
    assert!(again.text().contains("app/main.py"), "{}", again.text());
    // A patch that reaches out of the workspace is refused by git inside the sandbox.
    let evil = "--- a/../../etc/evil\n+++ b/../../etc/evil\n@@ -0,0 +1 @@\n+x\n";
    let r = e.call(
        "POST",
        &format!("/sandboxes/{id}/apply_patch"),
        Some(json!({"patch": evil})),
    );
    assert_eq!(r.status, 422, "{}", r.text());
    assert!(!Path::new("/etc/evil").exists());
}

// -------------------------------------------------------------------------------------
// Containment

#[test]
fn files_api_refuses_paths_that_leave_the_workspace() {
    let e = Envd::start(&[]);
    let id = e.create(json!({}));
    // Symlinks planted by the sandbox: absolute, relative upward, to a directory outside.
    e.sh_ok(
        &id,
        "ln -s /etc/passwd leak && ln -s / rootdir && ln -s ../../../../../../../etc up && mkdir d && ln -s ../.. d/out",
    );
    let k = [("x-api-key", KEY)];
    for path in [
        "../../etc/passwd",
        "%2e%2e/%2e%2e/etc/passwd",
        "/etc/passwd",
        "a/../../etc/passwd",
        "leak",
        "rootdir/etc/passwd",
        "up/passwd",
        "d/out/etc/passwd",
    ] {
        let url = format!("/sandboxes/{id}/files/{path}");
        let r = e.raw("GET", &url, &k, vec![]);
        assert_eq!(r.status, 403, "GET {path}: {} {}", r.status, r.text());
        assert_eq!(Envd::error_type(&r), "path_outside_sandbox", "{}", r.text());
        assert!(
            !r.text().contains("root:x:0:0"),
            "host file leaked: {}",
            r.text()
        );
        let w = e.raw("PUT", &url, &k, b"owned".to_vec());
        assert_eq!(w.status, 403, "PUT {path}: {} {}", w.status, w.text());
    }
    for dir in ["..", "/etc", "rootdir", "up", "d/out"] {
        let r = e.call("GET", &format!("/sandboxes/{id}/files?dir={dir}"), None);
        assert_eq!(r.status, 403, "list {dir}: {}", r.text());
    }
    let host_passwd = std::fs::read_to_string("/etc/passwd").unwrap();
    assert!(!host_passwd.contains("owned"));
    // An empty upload to the planted link is refused too; the host file is unchanged.
    let over = e.raw("PUT", &format!("/sandboxes/{id}/files/leak"), &k, vec![]);
    assert_eq!(
        over.status,
        403,
        "a symlink pointing out is refused: {}",
        over.text()
    );
    assert_eq!(std::fs::read_to_string("/etc/passwd").unwrap(), host_passwd);
}

#[test]
fn exec_cannot_touch_the_host_outside_its_workspace() {
    let e = Envd::start(&[]);
    let id = e.create(json!({}));
    let probe = format!("envd-probe-{}", std::process::id());
    let r = e.sh(&id, "echo x > /etc/envd-escape");
    assert_ne!(r["exit_code"], 0, "{r:#}");
    assert!(r["stderr"].as_str().unwrap().contains("Read-only"), "{r:#}");
    assert_ne!(e.sh(&id, "touch /usr/envd-escape")["exit_code"], 0);
    assert_ne!(e.sh(&id, "touch /envd-escape")["exit_code"], 0);
    assert!(!Path::new("/etc/envd-escape").exists());
    assert!(!Path::new("/usr/envd-escape").exists());
    // /tmp is the sandbox's own.
    e.sh_ok(&id, &format!("echo x > /tmp/{probe}"));
    assert!(
        !Path::new("/tmp").join(&probe).exists(),
        "/tmp is shared with the host"
    );
    // Not root on the host, no secrets, no host processes, no data dir.
    let uid = e.sh_ok(&id, "id -u");
    assert_ne!(
        uid.trim(),
        "0",
        "sandboxed processes run as an unprivileged user"
    );
    assert_ne!(e.sh(&id, "cat /etc/shadow")["exit_code"], 0);
    let me = std::process::id();
    assert_ne!(
        e.sh(&id, &format!("test -e /proc/{me}"))["exit_code"],
        0,
        "host pids are visible"
    );
    let data = e.data.display().to_string();
    assert_ne!(
        e.sh(&id, &format!("ls {data}"))["exit_code"],
        0,
        "the data dir is visible"
    );
    assert_ne!(e.sh(&id, "ls /root")["exit_code"], 0);
    // And another sandbox's workspace is out of reach.
    let other = e.create(json!({}));
    e.sh_ok(&other, "echo secret > s");
    let r = e.sh(&id, &format!("cat {data}/sandboxes/{other}/workspace/s"));
    assert_ne!(r["exit_code"], 0, "{r:#}");
}

/// A data dir deep enough that a sandbox's forward socket path is longer than a Unix socket
/// address may be (108 bytes): the forward still works.
#[test]
fn the_gateway_forward_works_under_a_deep_data_dir() {
    let stack = Stack::start();
    let gw = stack.gateway.authority().to_owned();
    let deep = format!("{}/data", "a-rather-long-folder-name".repeat(3));
    let e = Envd::start_at(&deep, &["--gateway", &gw]);
    assert!(e.data.as_os_str().len() > 60, "{}", e.data.display());
    let id = e.create(json!({}));
    let ok = e.sh_ok(&id, "curl -sS --max-time 20 $GRAFT_GATEWAY_URL/healthz");
    assert!(
        ok.contains("ok"),
        "the gateway answers through the forward: {ok}"
    );
}

#[test]
fn network_reaches_only_the_gateway_through_the_forward() {
    let stack = Stack::start();
    let gw = stack.gateway.authority().to_owned();
    let e = Envd::start(&["--gateway", &gw]);
    let envd_addr = e.proc.authority().to_owned();
    let id = e.create(json!({}));
    let got = e.ok("GET", &format!("/sandboxes/{id}"), None);
    assert_eq!(got["network"], "gateway", "{got:#}");
    assert_eq!(got["gateway_url"], "http://127.0.0.1:4000");
    let ok = e.sh_ok(&id, "curl -sS --max-time 20 $GRAFT_GATEWAY_URL/healthz");
    assert!(
        ok.contains("ok"),
        "the gateway answers through the forward: {ok}"
    );
    // Nothing else: not the gateway's real address, not envd itself, not the internet.
    for target in [
        format!("http://{gw}/healthz"),
        format!("http://{envd_addr}/sandboxes"),
        "http://1.1.1.1/".to_owned(),
        "http://10.0.0.1/".to_owned(),
    ] {
        let r = e.sh(&id, &format!("curl -sS --max-time 5 {target}"));
        assert_ne!(
            r["exit_code"], 0,
            "{target} was reachable from the sandbox: {r:#}"
        );
    }
    // A sandbox without the gateway policy reaches nothing at all.
    let closed = e.create(json!({"network": "none"}));
    let r = e.sh(
        &closed,
        "curl -sS --max-time 5 http://127.0.0.1:4000/healthz",
    );
    assert_ne!(r["exit_code"], 0, "{r:#}");
}

#[test]
fn harness_env_points_at_the_gateway_session_and_records_carry_it() {
    let stack = Stack::start();
    let session = stack.open_session("envd-sess-1");
    let gw = stack.gateway.authority().to_owned();
    let e = Envd::start(&["--gateway", &gw]);
    let id = e.create(json!({
        "gateway_session": {"session_id": "envd-sess-1", "api_key": session["api_key"], "model": "scripted"}
    }));
    let env = e.sh_ok(&id, "echo $OPENAI_BASE_URL; echo $ANTHROPIC_BASE_URL");
    assert_eq!(
        env,
        "http://127.0.0.1:4000/s/envd-sess-1/v1\nhttp://127.0.0.1:4000/s/envd-sess-1\n"
    );
    let body = json!({"model": "scripted", "messages": [{"role": "user", "content": "hello from a sandbox"}]});
    e.raw(
        "PUT",
        &format!("/sandboxes/{id}/files/req.json"),
        &[("x-api-key", KEY)],
        body.to_string().into_bytes(),
    );
    let out = e.sh_ok(
        &id,
        "curl -sS --fail-with-body --max-time 30 -H 'content-type: application/json' -H \"authorization: Bearer $OPENAI_API_KEY\" -d @req.json $OPENAI_BASE_URL/chat/completions",
    );
    let answer: Value = serde_json::from_str(&out).unwrap();
    assert!(answer["choices"][0]["message"].is_object(), "{answer:#}");
    let recs = stack.wait_records("envd-sess-1", 1);
    assert_eq!(recs[0]["session_id"], "envd-sess-1");
    // A harness from harness-configs/: its variables and config files, pointed at the session.
    let key = session["api_key"].as_str().unwrap();
    let codex = e.create(json!({
        "gateway_session": {"session_id": "envd-sess-1", "api_key": key, "model": "scripted", "harness": "codex"}
    }));
    let cfg = e.sh_ok(
        &codex,
        "cat $CODEX_HOME/config.toml; echo \"key=$GRAFT_API_KEY\"",
    );
    assert!(
        cfg.contains("base_url = \"http://127.0.0.1:4000/s/envd-sess-1/v1\""),
        "{cfg}"
    );
    assert!(cfg.contains("wire_api = \"responses\""), "{cfg}");
    assert!(cfg.contains(&format!("key={key}")), "{cfg}");
    let mini = e.create(json!({
        "gateway_session": {"session_id": "envd-sess-1", "model": "scripted", "harness": "mini-swe-agent"}
    }));
    let out = e.sh_ok(
        &mini,
        "echo $MSWEA_MODEL_NAME; test -s graft.yaml && echo has-config",
    );
    assert_eq!(out, "openai/scripted\nhas-config\n");
    let bad = e.call(
        "POST",
        "/sandboxes",
        Some(json!({"gateway_session": {"session_id": "envd-sess-1", "harness": "nope"}})),
    );
    assert_eq!(bad.status, 400, "{}", bad.text());
    assert!(
        bad.text().contains("codex"),
        "the error lists the known harnesses: {}",
        bad.text()
    );
}

#[test]
fn fork_bomb_hits_the_pids_limit_and_leaves_nothing() {
    let e = Envd::start(&[]);
    let id = e.create(json!({"pids": 40}));
    // Bounded: the 100 background sleeps cannot all start.
    let r = e.sh(
        &id,
        "i=0; while [ $i -lt 100 ]; do sleep 60 & i=$((i+1)); done; echo started $i",
    );
    assert_ne!(
        r["exit_code"], 0,
        "100 processes started under pids=40: {r:#}"
    );
    assert!(
        r["stderr"]
            .as_str()
            .unwrap()
            .to_lowercase()
            .contains("fork"),
        "the shell reports the failed fork: {r:#}"
    );
    // The real thing, stopped by the timeout.
    let r = e.exec(
        &id,
        json!({"command": "bash -c ':(){ :|:& };:; sleep 30'", "timeout_secs": 3}),
    );
    assert!(r["state"] == "timed_out" || r["state"] == "exited", "{r:#}");
    let got = e.ok("GET", &format!("/sandboxes/{id}"), None);
    assert_eq!(got["processes"], 0, "the bomb is gone: {got:#}");
    assert_eq!(e.sh_ok(&id, "echo alive"), "alive\n");
}

#[test]
fn memory_hog_is_oom_killed_with_a_clear_status() {
    let e = Envd::start(&[]);
    let id = e.create(json!({"memory_mb": 64}));
    let r = e.sh(&id, "python3 -c 'b = b\"x\" * (512 << 20); print(len(b))'");
    assert_eq!(r["exit_code"], 137, "SIGKILL by the OOM killer: {r:#}");
    assert_eq!(r["oom_killed"], true, "{r:#}");
    assert_eq!(r["stdout"], "");
    // The sandbox stays usable, and a small job is not reported as OOM.
    let ok = e.sh(&id, "python3 -c 'b = b\"x\" * (8 << 20); print(len(b))'");
    assert_eq!(ok["exit_code"], 0, "{ok:#}");
    assert_eq!(ok["oom_killed"], false);
}

/// kill -9 of envd takes every sandbox process with it (bubblewrap's `--die-with-parent`,
/// and the agent's `--die-with-envd` for an envd killed before bubblewrap armed that: the
/// marker shows up in the joining `sh` already), and the next envd on the same data dir
/// removes what the crashed one left.
#[test]
fn a_crashed_envd_leaves_no_process_and_the_next_one_cleans_up() {
    let mut e = Envd::start(&[]);
    let id = e.create(json!({"id": "crash-1"}));
    let marker = format!("envd-crash-{}", std::process::id());
    e.ok(
        "POST",
        &format!("/sandboxes/{id}/exec"),
        Some(json!({"command": format!("sleep 1000 # {marker}"), "background": true})),
    );
    wait_until("the job showing up", Duration::from_secs(30), || {
        !host_procs_with(&marker).is_empty()
    });
    e.proc.kill9();
    wait_until(
        "the sandbox's processes dying with envd",
        Duration::from_secs(30),
        || host_procs_with(&marker).is_empty(),
    );
    assert!(
        workspace_dir(&e.data, &id).exists(),
        "the crash left the sandbox dir"
    );
    e.proc = Proc::envd(&e.data, KEY, &[]);
    assert_eq!(e.call("GET", &format!("/sandboxes/{id}"), None).status, 404);
    assert!(
        !workspace_dir(&e.data, &id).exists(),
        "the next envd removes what the crashed one left"
    );
    assert!(
        e.proc.stderr_contains("left by an earlier run"),
        "{}",
        e.proc.stderr()
    );
    // The id is free again.
    assert_eq!(e.create(json!({"id": "crash-1"})), "crash-1");
}

/// The real Codex CLI inside a sandbox: it finds the gateway only through the injected
/// config (`harness: codex`), runs the scripted two-turn task (its shell tool writes into
/// the workspace), and the gateway's records carry the sandbox's session.
#[test]
fn codex_in_a_sandbox_completes_a_task_through_the_gateway_session() {
    let env = common::TestEnv::get();
    env.codex_bin();
    let vendor = env
        .root
        .join("codex/node_modules/@openai/codex-linux-x64/vendor/x86_64-unknown-linux-musl");
    assert!(
        vendor.join("bin/codex").is_file(),
        "the native Codex binary is missing at {}; run `bash scripts/setup-test-env.sh`",
        vendor.display()
    );
    let stack = Stack::start();
    let session = stack.open_session("envd-codex-1");
    let gw = stack.gateway.authority().to_owned();
    let e = Envd::start(&["--gateway", &gw]);
    let id = e.create(json!({
        "gateway_session": {
            "session_id": "envd-codex-1",
            "api_key": session["api_key"],
            "model": "scripted",
            "harness": "codex"
        },
        "mounts": [{"source": vendor.to_str().unwrap(), "target": "/mnt/codex"}],
        "memory_mb": 2048
    }));
    let task = "graft-codex-task: write the word graft-codex-step-done into codex_result.txt.";
    let r = e.exec(
        &id,
        json!({
            "argv": [
                "/mnt/codex/bin/codex", "exec",
                "--dangerously-bypass-approvals-and-sandbox", "--skip-git-repo-check",
                "--ephemeral", "--color", "never", "-o", "/workspace/last-message.txt", task
            ],
            "env": {"NO_COLOR": "1", "TERM": "dumb", "RUST_LOG": "warn"},
            "timeout_secs": 200
        }),
    );
    assert_eq!(r["exit_code"], 0, "codex failed in the sandbox: {r:#}");
    let result = e.call(
        "GET",
        &format!("/sandboxes/{id}/files/codex_result.txt"),
        None,
    );
    assert_eq!(result.status, 200, "codex did not write its result: {r:#}");
    assert_eq!(result.text(), "graft-codex-step-done\n");
    let last = e.call(
        "GET",
        &format!("/sandboxes/{id}/files/last-message.txt"),
        None,
    );
    assert!(
        last.text()
            .contains(&common::scripted_content("graft-codex-step-done")),
        "{}",
        last.text()
    );
    let recs = stack.wait_records("envd-codex-1", 2);
    assert_eq!(recs.len(), 2, "exactly two model calls: {recs:#?}");
    for rec in &recs {
        assert_eq!(rec["session_id"], "envd-codex-1");
        assert_eq!(rec["dialect"], "responses");
        assert_eq!(rec["outcome"], "ok", "{rec:#}");
    }
}

/// k rollouts branching from one prepared state: a snapshot of a sandbox's workspace, and
/// forks whose workspaces are copy-on-write overlays of it.
#[test]
fn snapshot_and_forks_branch_from_one_prepared_state() {
    let e = Envd::start(&[]);
    let base = e.create(json!({"id": "base"}));
    e.sh_ok(
        &base,
        "mkdir -p repo/src && echo v1 > repo/src/app.txt && echo keep > repo/README && ln -s src/app.txt repo/link && ln -s /etc/passwd repo/hostlink",
    );
    let snap = e.call(
        "POST",
        "/sandboxes/base/snapshot",
        Some(json!({"id": "prepared"})),
    );
    assert_eq!(snap.status, 201, "{}", snap.text());
    let info = snap.json();
    assert_eq!(info["snapshot_id"], "prepared");
    assert_eq!(info["files"], 2, "{info:#}");
    let listed = e.ok("GET", "/snapshots", None);
    assert_eq!(listed["snapshots"][0]["snapshot_id"], "prepared");
    // The source keeps changing; the snapshot does not.
    e.sh_ok(&base, "echo base-change > repo/src/app.txt");
    let a = e.create(json!({"id": "fork-a", "from_snapshot": "prepared"}));
    let b = e.create(json!({"id": "fork-b", "from_snapshot": "prepared"}));
    assert_eq!(e.sh_ok(&a, "cat repo/src/app.txt"), "v1\n");
    assert_eq!(
        e.sh_ok(&a, "cat repo/link"),
        "v1\n",
        "links survive the copy"
    );
    assert_eq!(
        e.sh_ok(&a, "readlink repo/hostlink"),
        "/etc/passwd\n",
        "a link is copied as a link, never followed"
    );
    e.sh_ok(
        &a,
        "echo from-a > repo/src/app.txt && rm repo/README && echo new > repo/a-only",
    );
    let up = e.raw(
        "PUT",
        "/sandboxes/fork-b/files/repo/src/app.txt",
        &[("x-api-key", KEY)],
        b"from-b\n".to_vec(),
    );
    assert_eq!(up.status, 200, "{}", up.text());
    assert_eq!(e.sh_ok(&a, "cat repo/src/app.txt"), "from-a\n");
    assert_eq!(e.sh_ok(&b, "cat repo/src/app.txt"), "from-b\n");
    assert_eq!(
        e.sh_ok(&b, "cat repo/README"),
        "keep\n",
        "a's delete stays in a"
    );
    assert_ne!(e.sh(&b, "test -e repo/a-only")["exit_code"], 0);
    let listing = e.ok("GET", "/sandboxes/fork-a/files?dir=repo", None);
    let names: Vec<&str> = listing["entries"]
        .as_array()
        .unwrap()
        .iter()
        .map(|x| x["name"].as_str().unwrap())
        .collect();
    assert_eq!(
        names,
        vec!["a-only", "hostlink", "link", "src"],
        "{listing:#}"
    );
    assert_eq!(
        e.call("GET", "/sandboxes/fork-a/files/repo/hostlink", None)
            .status,
        403,
        "the copied link still cannot lead out"
    );
    assert_eq!(e.sh_ok(&base, "cat repo/src/app.txt"), "base-change\n");
    let got = e.ok("GET", "/sandboxes/fork-a", None);
    assert_eq!(got["from_snapshot"], "prepared");
    // A snapshot in use cannot go; once its forks are gone it can.
    let busy = e.call("DELETE", "/snapshots/prepared", None);
    assert_eq!(busy.status, 409, "{}", busy.text());
    assert!(
        busy.text().contains("fork-a") && busy.text().contains("fork-b"),
        "{}",
        busy.text()
    );
    e.ok("DELETE", "/sandboxes/fork-a", None);
    e.ok("DELETE", "/sandboxes/fork-b", None);
    assert!(
        !workspace_dir(&e.data, "fork-a").exists(),
        "the overlay was unmounted and removed"
    );
    e.ok("DELETE", "/snapshots/prepared", None);
    assert_eq!(e.call("GET", "/snapshots/prepared", None).status, 404);
    let missing = e.call(
        "POST",
        "/sandboxes",
        Some(json!({"from_snapshot": "prepared"})),
    );
    assert_eq!(missing.status, 404, "{}", missing.text());
}

/// `graft envd --config envd.toml`: the file's settings apply (flags win), the key may be
/// an `env::NAME` reference, and an unknown key stops envd with a message naming it.
#[test]
fn config_file_settings_apply_and_unknown_keys_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = dir.path().join("envd.toml");
    std::fs::write(
        &cfg,
        "api_key = \"env::GRAFT_ENVD_API_KEY\"\n[defaults]\npids = 64\nttl_secs = 120\n[limits]\nmax_file_bytes = 1000\n",
    )
    .unwrap();
    let e = Envd::start(&["--config", cfg.to_str().unwrap(), "--memory-mb", "256"]);
    let id = e.create(json!({}));
    let got = e.ok("GET", &format!("/sandboxes/{id}"), None);
    assert_eq!(got["limits"]["pids"], 64, "{got:#}");
    assert_eq!(got["limits"]["memory_mb"], 256, "the flag: {got:#}");
    assert_eq!(got["ttl_secs"], 120);
    let big = e.raw(
        "PUT",
        &format!("/sandboxes/{id}/files/f"),
        &[("x-api-key", KEY)],
        vec![1u8; 2000],
    );
    assert_eq!(big.status, 413, "{}", big.text());

    let bad = dir.path().join("bad.toml");
    std::fs::write(
        &bad,
        "listen = \"127.0.0.1:0\"\n[defaults]\nmemroy_mb = 1\n",
    )
    .unwrap();
    let out = std::process::Command::new(common::graft_bin())
        .args(["envd", "--config", bad.to_str().unwrap()])
        .env("GRAFT_ENVD_API_KEY", KEY)
        .stdin(std::process::Stdio::null())
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("memroy_mb") && err.contains("bad.toml"),
        "{err}"
    );
}

/// Copies the shared libraries `ldd` names for `bin` (and `bin` itself with `with_bin`)
/// into `root` at the same paths.
fn copy_with_libs(bin: &Path, root: &Path, with_bin: bool) {
    let out = std::process::Command::new("ldd").arg(bin).output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    let mut files = if with_bin {
        vec![bin.to_path_buf()]
    } else {
        vec![]
    };
    files.extend(
        text.split_whitespace()
            .filter(|w| w.starts_with('/'))
            .map(PathBuf::from),
    );
    for f in files {
        let dst = root.join(f.strip_prefix("/").unwrap());
        std::fs::create_dir_all(dst.parent().unwrap()).unwrap();
        std::fs::copy(&f, &dst).unwrap_or_else(|e| panic!("copy {}: {e}", f.display()));
    }
}

/// A sandbox over a given root filesystem sees that root (read-only), not the host's.
#[test]
fn a_rootfs_directory_replaces_the_host_view() {
    let e = Envd::start(&[]);
    let rootfs = e._dir.path().join("rootfs");
    std::fs::create_dir_all(rootfs.join("etc")).unwrap();
    std::fs::write(rootfs.join("etc/marker"), "from the rootfs\n").unwrap();
    for bin in ["/bin/sh", "/bin/cat", "/bin/ls"] {
        copy_with_libs(Path::new(bin), &rootfs, true);
    }
    // The agent is mounted in by envd; the rootfs only needs its C library.
    copy_with_libs(Path::new(env!("CARGO_BIN_EXE_envd-agent")), &rootfs, false);
    let id = e.create(json!({"rootfs": rootfs.to_str().unwrap()}));
    assert_eq!(e.sh_ok(&id, "cat /etc/marker"), "from the rootfs\n");
    let top = e.sh_ok(&id, "ls -a /");
    let mut names: Vec<&str> = top.lines().filter(|l| *l != "." && *l != "..").collect();
    names.sort();
    let want = vec![
        ".graft",
        "bin",
        "dev",
        "etc",
        "lib",
        "lib64",
        "proc",
        "tmp",
        "workspace",
    ];
    assert_eq!(
        names, want,
        "only the rootfs and the sandbox's own mounts: {top}"
    );
    assert_ne!(
        e.sh(&id, "cat /etc/passwd")["exit_code"],
        0,
        "the host's /etc is not there"
    );
    assert_ne!(
        e.sh(&id, "echo x > /bin/x")["exit_code"],
        0,
        "the rootfs is read-only"
    );
    assert!(!rootfs.join("bin/x").exists());
    e.sh_ok(&id, "echo data > /workspace/f");
    assert_eq!(
        e.call("GET", &format!("/sandboxes/{id}/files/f"), None)
            .text(),
        "data\n"
    );
    let bad = e.call(
        "POST",
        "/sandboxes",
        Some(json!({"rootfs": "relative/dir"})),
    );
    assert_eq!(bad.status, 400, "{}", bad.text());
}

/// A second envd on a data dir in use refuses to start (it would take the first one's
/// sandboxes for leftovers of a crash), and says which process holds it.
#[test]
fn a_second_envd_on_the_same_data_dir_refuses_to_start() {
    let e = Envd::start(&[]);
    let id = e.create(json!({}));
    let out = std::process::Command::new(common::graft_bin())
        .args([
            "envd",
            "--listen",
            "127.0.0.1:0",
            "--data-dir",
            e.data.to_str().unwrap(),
        ])
        .env("GRAFT_ENVD_API_KEY", KEY)
        .stdin(std::process::Stdio::null())
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("another envd"), "{err}");
    // The first one's sandbox is untouched.
    assert_eq!(e.sh_ok(&id, "echo still here"), "still here\n");
}

/// A `docker save` tarball as the sandbox's root: its layers are applied in order with
/// whiteouts (a deleted file, an opaque directory), setuid bits and fifos are dropped, and
/// a second sandbox of the same image reuses the flattened root.
#[test]
fn a_docker_save_image_becomes_the_sandbox_root() {
    let e = Envd::start(&[]);
    let base = e._dir.path().join("img");
    let l1 = base.join("l1root");
    std::fs::create_dir_all(l1.join("etc")).unwrap();
    std::fs::create_dir_all(l1.join("opt/x")).unwrap();
    for bin in ["/bin/sh", "/bin/cat", "/bin/ls"] {
        copy_with_libs(Path::new(bin), &l1, true);
    }
    copy_with_libs(Path::new(env!("CARGO_BIN_EXE_envd-agent")), &l1, false);
    std::fs::write(l1.join("etc/a"), "a1\n").unwrap();
    std::fs::write(l1.join("etc/b"), "b1\n").unwrap();
    std::fs::write(l1.join("opt/x/old"), "old\n").unwrap();
    let l2 = base.join("l2root");
    std::fs::create_dir_all(l2.join("etc")).unwrap();
    std::fs::create_dir_all(l2.join("opt/x")).unwrap();
    std::fs::write(l2.join("etc/a"), "a2\n").unwrap();
    std::fs::write(l2.join("etc/.wh.b"), "").unwrap();
    std::fs::write(l2.join("opt/x/.wh..wh..opq"), "").unwrap();
    std::fs::write(l2.join("opt/x/new"), "new\n").unwrap();
    std::fs::write(l2.join("etc/suid"), "#!/bin/sh\necho hi\n").unwrap();
    std::fs::set_permissions(l2.join("etc/suid"), std::fs::Permissions::from_mode(0o4755)).unwrap();
    let st = std::process::Command::new("mkfifo")
        .arg(l2.join("etc/fifo"))
        .status()
        .unwrap();
    assert!(st.success());
    let img = base.join("image");
    std::fs::create_dir_all(img.join("l1")).unwrap();
    std::fs::create_dir_all(img.join("l2")).unwrap();
    let tar = |args: &[&str]| {
        let st = std::process::Command::new("tar")
            .args(args)
            .status()
            .unwrap();
        assert!(st.success(), "tar {args:?}");
    };
    let p = |x: &Path| x.to_str().unwrap().to_owned();
    tar(&["-cf", &p(&img.join("l1/layer.tar")), "-C", &p(&l1), "."]);
    tar(&["-czf", &p(&img.join("l2/layer.tar.gz")), "-C", &p(&l2), "."]);
    std::fs::write(img.join("config.json"), "{}").unwrap();
    std::fs::write(
        img.join("manifest.json"),
        r#"[{"Config":"config.json","RepoTags":["envd-test:1"],"Layers":["l1/layer.tar","l2/layer.tar.gz"]}]"#,
    )
    .unwrap();
    let tarball = base.join("envd-test.tar");
    tar(&["-cf", &p(&tarball), "-C", &p(&img), "."]);

    let id = e.create(json!({"image": p(&tarball)}));
    assert_eq!(e.sh_ok(&id, "cat /etc/a"), "a2\n", "the upper layer wins");
    assert_ne!(
        e.sh(&id, "cat /etc/b")["exit_code"],
        0,
        "the whiteout removed b"
    );
    assert_eq!(
        e.sh_ok(&id, "ls /opt/x"),
        "new\n",
        "the opaque dir hides the lower layer"
    );
    assert_ne!(
        e.sh(&id, "cat /etc/fifo < /dev/null")["exit_code"],
        0,
        "no fifo"
    );
    assert_ne!(
        e.sh(&id, "cat /etc/passwd")["exit_code"],
        0,
        "not the host's root"
    );
    let images: Vec<PathBuf> = std::fs::read_dir(e.data.join("images"))
        .unwrap()
        .flatten()
        .map(|x| x.path())
        .collect();
    assert_eq!(images.len(), 1, "{images:?}");
    let suid = std::fs::metadata(images[0].join("rootfs/etc/suid")).unwrap();
    assert_eq!(suid.permissions().mode() & 0o7777, 0o755, "setuid dropped");
    // The same image again: the flattened root is reused.
    let again = e.create(json!({"image": p(&tarball)}));
    assert_eq!(e.sh_ok(&again, "cat /etc/a"), "a2\n");
    assert_eq!(std::fs::read_dir(e.data.join("images")).unwrap().count(), 1);
    // Errors name the problem.
    let rel = e.call(
        "POST",
        "/sandboxes",
        Some(json!({"image": "envd-test.tar"})),
    );
    assert_eq!(rel.status, 400, "{}", rel.text());
    assert!(rel.text().contains("docker save"), "{}", rel.text());
    let not_tar = base.join("not.tar");
    std::fs::write(&not_tar, "hello").unwrap();
    let r = e.call("POST", "/sandboxes", Some(json!({"image": p(&not_tar)})));
    assert_eq!(r.status, 400, "{}", r.text());
}

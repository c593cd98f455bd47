//! Bad input and crashes: every malformed, oversized or hostile request gets a well-formed
//! OpenAI error that names the problem, nothing accepted earlier is lost, the gateway keeps
//! serving; and kill -9 under load loses no call whose response the client fully received.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::collections::HashSet;
use std::time::Duration;

use common::{Proc, graft_records, http};
use serde_json::{Value, json};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

fn chat(model: &str, text: &str, stream: bool) -> Value {
    json!({"model": model, "stream": stream, "messages": [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": text}]})
}

fn assert_error(resp: &http::Resp, status: u16, code: &str, needle: &str) {
    assert_eq!(resp.status, status, "{}: {}", needle, resp.text());
    let v: Value = serde_json::from_slice(&resp.body)
        .unwrap_or_else(|e| panic!("not JSON ({e}): {}", resp.text()));
    assert_eq!(v["error"]["code"], code, "{v}");
    let msg = v["error"]["message"].as_str().unwrap();
    assert!(
        msg.contains(needle),
        "message {msg:?} should mention {needle:?}"
    );
    assert!(v["error"]["type"].is_string(), "{v}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_input_gets_named_errors_and_loses_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let upstream = Proc::scripted_upstream(&[]);
    let config = dir.path().join("graft.toml");
    std::fs::write(
        &config,
        r#"
[upstream]
timeout_secs = 3
[auth]
admin_key = "env::GRAFT_TEST_ADMIN_KEY"
client_keys = ["client-key-1"]
require_client_key = true
[limits]
max_body_bytes = 4096
body_timeout_secs = 2
header_timeout_secs = 2
"#,
    )
    .unwrap();
    let data = dir.path().join("data");
    let gw = Proc::gateway_with(
        &upstream.url,
        &data,
        &["--config", config.to_str().unwrap()],
        &[("GRAFT_TEST_ADMIN_KEY", "admin-1")],
    );
    let base = gw.url.clone();
    let chat_url = format!("{base}/v1/chat/completions");
    let key = [("authorization", "Bearer client-key-1")];

    // A good call first: it must survive everything below.
    let ok = http::post_json(&chat_url, &key, &chat("m", "first good call", false)).await;
    assert_eq!(ok.status, 200, "{}", ok.text());
    let first_call = ok.header("x-graft-call-id").unwrap();

    // Malformed JSON, wrong types, invalid UTF-8, oversized body.
    let r = http::post_raw(
        &chat_url,
        &key,
        b"{\"model\": \"m\", \"messages\": [".to_vec(),
    )
    .await;
    assert_error(&r, 400, "invalid_json", "not valid JSON");
    let r = http::post_json(&chat_url, &key, &json!({"model": "m", "messages": "hi"})).await;
    assert_error(
        &r,
        400,
        "invalid_value",
        "'messages' must be an array, got a string",
    );
    let r = http::post_json(&chat_url, &key, &json!({"model": 7, "messages": []})).await;
    assert_error(&r, 400, "invalid_value", "'model' must be a string");
    let r = http::post_raw(
        &chat_url,
        &key,
        b"{\"model\": \"m\xc3\x28\", \"messages\": []}".to_vec(),
    )
    .await;
    assert_error(&r, 400, "invalid_utf8", "not valid UTF-8");
    let big = chat("m", &"x".repeat(10_000), false);
    let r = http::post_json(&chat_url, &key, &big).await;
    assert_error(&r, 413, "body_too_large", "4096 bytes");

    // Routes and methods.
    let r = http::post_json(&format!("{base}/v1/embeddings"), &key, &json!({})).await;
    assert_error(&r, 404, "unknown_route", "/v1/embeddings");
    let r = http::get(&chat_url, &key).await;
    assert_error(&r, 405, "method_not_allowed", "GET");

    // Keys and sessions.
    let r = http::post_json(&chat_url, &[], &chat("m", "no key", false)).await;
    assert_error(&r, 401, "invalid_api_key", "missing API key");
    let r = http::post_json(
        &chat_url,
        &[("authorization", "Bearer sk-wrong")],
        &chat("m", "bad key", false),
    )
    .await;
    assert_error(&r, 401, "invalid_api_key", "is not valid");
    let r = http::post_json(
        &format!("{base}/s/nope/v1/chat/completions"),
        &key,
        &chat("m", "x", false),
    )
    .await;
    assert_error(&r, 404, "unknown_session", "session 'nope' does not exist");
    let r = http::post_json(&format!("{base}/graft/sessions"), &[], &json!({})).await;
    assert_error(&r, 401, "invalid_api_key", "admin key");
    let admin = [("authorization", "Bearer admin-1")];
    let a = http::post_json(
        &format!("{base}/graft/sessions"),
        &admin,
        &json!({"session_id": "sess-a"}),
    )
    .await;
    assert_eq!(a.status, 201, "{}", a.text());
    let key_a = format!("Bearer {}", a.json()["api_key"].as_str().unwrap());
    let b = http::post_json(
        &format!("{base}/graft/sessions"),
        &admin,
        &json!({"session_id": "sess-b"}),
    )
    .await;
    let key_b = b.json()["api_key"].as_str().unwrap().to_string();
    let r = http::post_json(
        &format!("{base}/s/sess-a/v1/chat/completions"),
        &[("authorization", &format!("Bearer {key_b}"))],
        &chat("m", "wrong session", false),
    )
    .await;
    assert_error(&r, 403, "forbidden", "belongs to session 'sess-b'");
    let r = http::post_json(
        &format!("{base}/graft/sessions/sess-a/reward"),
        &admin,
        &json!({"reward": "high"}),
    )
    .await;
    assert_error(&r, 400, "invalid_value", "'reward' must be a number");
    // Sampling policies graft cannot sample with, at create and at update.
    let r = http::post_json(
        &format!("{base}/graft/sessions"),
        &admin,
        &json!({"session_id": "sess-neg", "sampling": {"temperature": -0.1}}),
    )
    .await;
    assert_error(&r, 400, "invalid_value", "sampling.temperature");
    let r = http::post_json(
        &format!("{base}/graft/sessions/sess-a/sampling"),
        &admin,
        &json!({"top_p": 1.5}),
    )
    .await;
    assert_error(
        &r,
        400,
        "invalid_value",
        "sampling.top_p must be in (0, 1], got 1.5",
    );
    let r = http::post_json(
        &format!("{base}/graft/sessions/sess-a/sampling"),
        &admin,
        &json!({"temperature": "hot"}),
    )
    .await;
    assert_error(&r, 400, "invalid_value", "invalid sampling policy");
    let r = http::post_json(
        &format!("{base}/graft/sessions/sess-a/close"),
        &admin,
        &json!({}),
    )
    .await;
    assert_eq!(r.status, 200);
    let r = http::post_json(
        &format!("{base}/s/sess-a/v1/chat/completions"),
        &[("authorization", key_a.as_str())],
        &chat("m", "closed", false),
    )
    .await;
    assert_error(&r, 409, "session_closed", "session 'sess-a' is closed");

    // Slow-loris: headers that never finish must not block others, and get cut off.
    let addr = base.trim_start_matches("http://").to_string();
    let mut loris = tokio::net::TcpStream::connect(&addr).await.unwrap();
    loris
        .write_all(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: app")
        .await
        .unwrap();
    let during = http::post_json(
        &chat_url,
        &key,
        &chat("m", "while a slow client waits", false),
    )
    .await;
    assert_eq!(during.status, 200, "{}", during.text());
    let mut buf = vec![0u8; 1024];
    let n = tokio::time::timeout(Duration::from_secs(10), loris.read(&mut buf))
        .await
        .expect("the gateway must close a connection whose headers never finish")
        .unwrap_or(0);
    let head = String::from_utf8_lossy(&buf[..n]).to_string();
    assert!(
        n == 0 || head.starts_with("HTTP/1.1 408"),
        "slow-loris got: {head}"
    );

    // A body that stops arriving: 408 naming the problem.
    let mut slow = tokio::net::TcpStream::connect(&addr).await.unwrap();
    slow.write_all(
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer client-key-1\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{\"model\":",
    )
    .await
    .unwrap();
    let mut resp = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(10), slow.read_to_end(&mut resp)).await;
    let resp = String::from_utf8_lossy(&resp).to_string();
    assert!(resp.starts_with("HTTP/1.1 408"), "slow body got: {resp}");
    assert!(resp.contains("did not arrive within 2 s"), "{resp}");

    // Upstream failures: 500, garbage, reset mid-stream, a hang.
    let r = http::post_json(&chat_url, &key, &chat("fault-500", "x", false)).await;
    assert_error(&r, 502, "upstream_http_error", "answered HTTP 500");
    let r = http::post_json(&chat_url, &key, &chat("fault-garbage", "x", false)).await;
    assert_error(&r, 502, "upstream_invalid_response", "not JSON");
    let r = http::post_json(&chat_url, &key, &chat("fault-hang", "x", false)).await;
    assert_error(&r, 504, "upstream_timeout", "did not answer within 3 s");
    let r = http::post_json(&chat_url, &key, &chat("fault-reset", "x", true)).await;
    assert_eq!(r.status, 200);
    let events = r.sse_data();
    let last: Value = serde_json::from_str(events.last().unwrap()).unwrap();
    assert_eq!(
        last["error"]["code"], "upstream_stream_interrupted",
        "{events:?}"
    );
    assert!(
        events.len() >= 2,
        "the chunks before the reset are relayed: {events:?}"
    );
    let r = http::post_json(&chat_url, &key, &chat("fault-garbage", "x", true)).await;
    let events = r.sse_data();
    let last: Value = serde_json::from_str(events.last().unwrap()).unwrap();
    assert_eq!(
        last["error"]["code"], "upstream_invalid_response",
        "{events:?}"
    );

    // Still serving, and nothing accepted earlier was lost.
    let again = http::post_json(&chat_url, &key, &chat("m", "still alive", true)).await;
    assert_eq!(again.status, 200);
    assert_eq!(again.sse_data().last().map(String::as_str), Some("[DONE]"));
    let health = http::get(&format!("{base}/healthz"), &[]).await;
    assert_eq!(health.status, 200);
    let metrics = http::get(&format!("{base}/metrics"), &[]).await.text();
    assert!(
        metrics.contains("graft_errors_total{cause=\"upstream\""),
        "{metrics}"
    );
    assert!(metrics.contains("graft_overhead_seconds"), "{metrics}");
    assert!(
        metrics.contains("graft_recorder_fsync_seconds"),
        "{metrics}"
    );
    drop(gw);

    let records = graft_records(&data);
    let by_id = |id: &str| records.iter().find(|r| r["call_id"] == id).cloned();
    let first = by_id(&first_call).expect("the first good call survived");
    assert_eq!(first["outcome"], "ok");
    assert_eq!(
        first["request"]["messages"][1]["content"],
        "first good call"
    );
    let outcomes: Vec<(String, String)> = records
        .iter()
        .map(|r| {
            (
                r["model"].as_str().unwrap_or("").to_string(),
                r["outcome"].as_str().unwrap().to_string(),
            )
        })
        .collect();
    for fault in ["fault-500", "fault-garbage", "fault-hang", "fault-reset"] {
        assert!(
            outcomes
                .iter()
                .any(|(m, o)| m == fault && o == "upstream_error"),
            "{fault} recorded as upstream_error: {outcomes:?}"
        );
    }
    let reset = records
        .iter()
        .find(|r| r["model"] == "fault-reset")
        .unwrap();
    assert!(
        reset["error"]
            .as_str()
            .unwrap()
            .contains("failed mid-response"),
        "{reset}"
    );
    // Refused requests are not model calls and are not recorded; the good ones all are.
    assert_eq!(
        outcomes.iter().filter(|(_, o)| o == "ok").count(),
        3,
        "{outcomes:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kill_9_mid_load_loses_no_fully_received_call() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let upstream = Proc::scripted_upstream(&[]);
    let mut gw = Proc::gateway_with(&upstream.url, &data, &["--durability", "sync"], &[]);
    let url = format!("{}/v1/chat/completions", gw.url);

    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let mut tasks = vec![];
    for worker in 0..8 {
        let url = url.clone();
        let stop = stop.clone();
        tasks.push(tokio::spawn(async move {
            let mut completed = vec![];
            let mut i = 0;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                i += 1;
                let stream = i % 2 == 0;
                let body = chat("m", &format!("worker {worker} call {i}"), stream);
                let Ok(r) = http::try_post_json(&url, &[], &body).await else {
                    continue;
                };
                let complete = r.status == 200
                    && (!stream || r.sse_data().last().map(String::as_str) == Some("[DONE]"));
                if complete {
                    completed.push(r.header("x-graft-call-id").unwrap());
                }
            }
            completed
        }));
    }
    tokio::time::sleep(Duration::from_millis(1500)).await;
    gw.kill9();
    tokio::time::sleep(Duration::from_millis(200)).await;
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let mut completed = vec![];
    for t in tasks {
        completed.extend(t.await.unwrap());
    }
    assert!(
        completed.len() > 20,
        "the load ran: {} calls completed",
        completed.len()
    );

    // Restart on the same data dir: it recovers, serves, and every completed call is there once.
    let gw2 = Proc::gateway_with(&upstream.url, &data, &[], &[]);
    assert!(
        gw2.stderr_contains("recovered"),
        "the gateway says what it recovered"
    );
    let r = http::post_json(
        &format!("{}/v1/chat/completions", gw2.url),
        &[],
        &chat("m", "after restart", false),
    )
    .await;
    assert_eq!(r.status, 200, "{}", r.text());
    drop(gw2);

    let records = graft_records(&data);
    let ids: Vec<&str> = records
        .iter()
        .map(|r| r["call_id"].as_str().unwrap())
        .collect();
    let unique: HashSet<&str> = ids.iter().copied().collect();
    assert_eq!(ids.len(), unique.len(), "no record is duplicated");
    let missing: Vec<&String> = completed
        .iter()
        .filter(|c| !unique.contains(c.as_str()))
        .collect();
    assert!(
        missing.is_empty(),
        "{} of {} fully received calls missing after kill -9: {:?}",
        missing.len(),
        completed.len(),
        &missing[..missing.len().min(5)]
    );
    for r in &records {
        assert!(
            r["request"]["messages"].is_array(),
            "every record's request rebuilds: {r}"
        );
    }
    // Sessions' sequence numbers stay unique across the restart.
    let seqs: Vec<u64> = records
        .iter()
        .filter(|r| r["session_id"] == "default")
        .map(|r| r["seq"].as_u64().unwrap())
        .collect();
    let unique_seqs: HashSet<u64> = seqs.iter().copied().collect();
    assert_eq!(
        seqs.len(),
        unique_seqs.len(),
        "seq numbers are unique within the session"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn client_gone_mid_stream_is_recorded_as_such() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let upstream = Proc::scripted_upstream(&[]);
    let gw = Proc::gateway_with(&upstream.url, &data, &[], &[]);
    let body = chat("fault-slow", "a long slow answer", true).to_string();
    let mut conn = tokio::net::TcpStream::connect(gw.authority())
        .await
        .unwrap();
    let req = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    );
    conn.write_all(req.as_bytes()).await.unwrap();
    let mut buf = vec![0u8; 4096];
    let n = conn.read(&mut buf).await.unwrap();
    assert!(String::from_utf8_lossy(&buf[..n]).starts_with("HTTP/1.1 200"));
    drop(conn);

    // The gateway notices at its next write, records the partial answer, and keeps serving.
    let mut found = None;
    for _ in 0..100 {
        tokio::time::sleep(Duration::from_millis(100)).await;
        let ok = http::post_json(
            &format!("{}/v1/chat/completions", gw.url),
            &[],
            &chat("m", "poll", false),
        )
        .await;
        assert_eq!(ok.status, 200);
        drop(ok);
        let recs = graft_records(&data);
        if let Some(r) = recs.into_iter().find(|r| r["model"] == "fault-slow") {
            found = Some(r);
            break;
        }
    }
    let rec = found.expect("the abandoned call was recorded");
    assert_eq!(rec["outcome"], "client_disconnected", "{rec}");
    assert!(
        rec["error"]
            .as_str()
            .unwrap()
            .contains("closed the connection"),
        "{rec}"
    );
}

/// Runs `graft ARGS` with `envs` to completion: (success, stdout + stderr).
fn graft_run(args: &[&str], envs: &[(&str, &str)]) -> (bool, String) {
    let o = std::process::Command::new(common::graft_bin())
        .args(args)
        .envs(envs.iter().copied())
        .stdin(std::process::Stdio::null())
        .output()
        .unwrap();
    (
        o.status.success(),
        format!(
            "{}{}",
            String::from_utf8_lossy(&o.stdout),
            String::from_utf8_lossy(&o.stderr)
        ),
    )
}

/// Issue 32, hole 1: a session log left with an event glued onto a torn one (what a full
/// disk did to a graft that did not cut its log back; graft now cuts it back at once, see
/// `recorder/src/session_log.rs`). The gateway refuses to start with the line, its byte
/// offset and the repair command, never asking to delete acknowledged data; `graft records
/// repair` keeps every whole event (the glued one included) and the original beside it;
/// then the gateway starts with every session, and their rewards and keys hold.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hole1_a_session_log_torn_by_a_full_disk_is_repaired_keeping_every_whole_event() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let upstream = Proc::scripted_upstream(&[]);
    let mut gw = Proc::gateway_with(&upstream.url, &data, &[], &[]);
    let mut keys = vec![];
    for id in ["s1", "s2", "s3"] {
        let r = http::post_json(
            &format!("{}/graft/sessions", gw.url),
            &[],
            &json!({"session_id": id}),
        )
        .await;
        assert_eq!(r.status, 201, "{}", r.text());
        keys.push(r.json()["api_key"].as_str().unwrap().to_string());
    }
    gw.stop();
    // s2's line torn half-way, s3's glued onto it, as the old appender left them.
    let path = data.join("sessions.log");
    let text = std::fs::read_to_string(&path).unwrap();
    let lines: Vec<&str> = text.lines().collect();
    assert_eq!(lines.len(), 3, "{text}");
    let torn = &lines[1][..lines[1].len() / 2];
    let broken = format!("{}\n{torn}{}\n", lines[0], lines[2]);
    std::fs::write(&path, &broken).unwrap();
    let offset = lines[0].len() + 1;
    let (ok, out) = graft_run(
        &[
            "gateway",
            "--listen",
            "127.0.0.1:0",
            "--upstream",
            &upstream.url,
            "--data-dir",
            data.to_str().unwrap(),
        ],
        &[],
    );
    assert!(!ok, "{out}");
    assert!(
        out.contains("line 2")
            && out.contains(&format!("byte {offset}"))
            && out.contains("graft records repair"),
        "{out}"
    );
    assert!(!out.contains("delete"), "{out}");
    let (ok, out) = graft_run(
        &["records", "repair", "--data-dir", data.to_str().unwrap()],
        &[],
    );
    assert!(ok, "{out}");
    let report: Value = serde_json::from_str(out.lines().next().unwrap()).unwrap();
    assert_eq!(report["kept"], 2, "{report}");
    assert_eq!(report["recovered"], 1, "{report}");
    assert_eq!(
        report["dropped"],
        json!([{"offset": offset, "bytes": torn.len()}]),
        "{report}"
    );
    let original = report["original"].as_str().unwrap();
    assert_eq!(std::fs::read_to_string(original).unwrap(), broken);
    // The gateway starts; s1 and s3 are there with their keys (s2 was never whole).
    let gw = Proc::gateway_with(&upstream.url, &data, &[], &[]);
    let list = http::get(&format!("{}/graft/sessions", gw.url), &[]).await;
    let ids: HashSet<String> = list.json()["sessions"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s["session_id"].as_str().unwrap().to_string())
        .collect();
    assert!(
        ids.contains("s1") && ids.contains("s3") && !ids.contains("s2"),
        "{}",
        list.text()
    );
    for key in [&keys[0], &keys[2]] {
        let auth = format!("Bearer {key}");
        let r = http::post_json(
            &format!("{}/v1/chat/completions", gw.url),
            &[("authorization", auth.as_str())],
            &chat("m", "hello", false),
        )
        .await;
        assert_eq!(r.status, 200, "{}", r.text());
    }
}

/// A tmpfs of `size` mounted on a fresh temp dir, unmounted on drop; `None` when this
/// process may not mount (not root, no mount namespace rights).
struct TinyFs {
    dir: tempfile::TempDir,
}

impl TinyFs {
    fn mount(size: &str) -> Result<TinyFs, String> {
        let dir = tempfile::tempdir().unwrap();
        let o = std::process::Command::new("mount")
            .args(["-t", "tmpfs", "-o", &format!("size={size}"), "tmpfs"])
            .arg(dir.path())
            .output()
            .map_err(|e| format!("cannot run mount: {e}"))?;
        if !o.status.success() {
            return Err(String::from_utf8_lossy(&o.stderr).trim().to_string());
        }
        Ok(TinyFs { dir })
    }

    fn path(&self) -> &std::path::Path {
        self.dir.path()
    }

    /// Writes a file until the filesystem is full (down to the last byte).
    fn fill(&self) -> std::path::PathBuf {
        use std::io::Write;
        let p = self.path().join("filler");
        let mut f = std::fs::File::create(&p).unwrap();
        for chunk in [64 * 1024, 4096, 1] {
            let buf = vec![7u8; chunk];
            while f.write_all(&buf).is_ok() {}
        }
        p
    }
}

impl Drop for TinyFs {
    fn drop(&mut self) {
        let _ = std::process::Command::new("umount")
            .arg(self.dir.path())
            .status();
    }
}

/// Issue 32, hole 1 on a real full disk (a 16 MiB tmpfs filled to the last byte while the
/// gateway runs): session creations and rewards fail while it is full (the session log's
/// appends cross into pages there is no room for, so some fail part-way), calls fail or
/// succeed (the WAL), and once space is back everything goes on; after a restart, with no
/// repair, every acknowledged session is there with its key, the last acknowledged reward
/// and every acknowledged call, and every line of the session log is one whole event. The
/// same for `steps.jsonl`'s `LineFile` on the full disk: every acknowledged line, whole, and
/// the one after. Skipped,
/// loudly, only where this process cannot mount a tmpfs (the injected-fault tests in
/// `recorder/src/{lines,session_log}.rs` cover the same path everywhere).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hole1_on_a_real_full_filesystem_nothing_acknowledged_is_lost_and_the_log_stays_whole() {
    let fs = match TinyFs::mount("16m") {
        Ok(fs) => fs,
        Err(why) => {
            eprintln!(
                "SKIPPED hole1_on_a_real_full_filesystem_…: cannot mount a tmpfs here ({why}); run as root to test a real full disk"
            );
            return;
        }
    };
    let data = fs.path().join("data");
    let upstream = Proc::scripted_upstream(&[]);
    let mut gw = Proc::gateway_with(&upstream.url, &data, &[], &[]);
    let base = gw.url.clone();
    let pad = "x".repeat(900);
    let create = |id: String| {
        let base = base.clone();
        let pad = pad.clone();
        async move {
            http::post_json(
                &format!("{base}/graft/sessions"),
                &[],
                &json!({"session_id": id, "metadata": {"pad": pad}}),
            )
            .await
        }
    };
    let call = |sid: &str, key: &str, text: &str| {
        let url = format!("{base}/s/{sid}/v1/chat/completions");
        let auth = format!("Bearer {key}");
        let body = chat("m", text, false);
        async move { http::post_json(&url, &[("authorization", auth.as_str())], &body).await }
    };
    let mut acked: Vec<(String, String)> = vec![];
    let mut acked_calls = 0usize;
    let r = create("s-0".into()).await;
    assert_eq!(r.status, 201, "{}", r.text());
    acked.push((
        "s-0".into(),
        r.json()["api_key"].as_str().unwrap().to_string(),
    ));
    let r = call("s-0", &acked[0].1, "before").await;
    assert_eq!(r.status, 200, "{}", r.text());
    acked_calls += 1;

    let steps = fs.path().join("steps.jsonl");
    let (mut lines, _) = graft_recorder::LineFile::open(&steps).unwrap();
    lines
        .append(format!("{{\"step\":0,\"pad\":\"{pad}\"}}\n").as_bytes())
        .unwrap();
    let mut steps_acked = vec![0];

    // Full.
    let filler = fs.fill();
    let mut failed = 0;
    for i in 1..=60 {
        let r = create(format!("s-{i}")).await;
        match r.status {
            201 => acked.push((
                format!("s-{i}"),
                r.json()["api_key"].as_str().unwrap().to_string(),
            )),
            s => {
                assert!(s >= 500, "{s}: {}", r.text());
                failed += 1;
                if failed == 3 {
                    break;
                }
            }
        }
        let r = http::post_json(
            &format!("{base}/graft/sessions/s-0/reward"),
            &[],
            &json!({"reward": i as f64 / 100.0, "info": {"pad": pad}}),
        )
        .await;
        assert!(r.status == 200 || r.status >= 500, "{}", r.text());
        let r = call("s-0", &acked[0].1, &format!("full {i}")).await;
        if r.status == 200 {
            acked_calls += 1;
        } else {
            assert_eq!(r.status, 503, "{}", r.text());
        }
    }
    assert!(
        failed > 0,
        "the full filesystem failed no session creation: {} acknowledged",
        acked.len()
    );
    eprintln!(
        "while full: {} sessions acknowledged, {failed} refused",
        acked.len() - 1
    );

    // `graft rl`'s steps.jsonl is the same LineFile: on the full disk, appends fail (some
    // part-way) and leave no torn line behind for the next one.
    let mut steps_failed = 0;
    for i in 1..200 {
        let line = format!("{{\"step\":{i},\"pad\":\"{pad}\"}}\n");
        match lines.append(line.as_bytes()) {
            Ok(()) => steps_acked.push(i),
            Err(_) => {
                steps_failed += 1;
                if steps_failed == 3 {
                    break;
                }
            }
        }
    }
    assert!(
        steps_failed > 0,
        "the full filesystem failed no steps.jsonl append"
    );

    // Space again: everything goes on in the same process.
    std::fs::remove_file(filler).unwrap();
    lines.append(b"{\"step\":\"after\"}\n").unwrap();
    drop(lines);
    let text = std::fs::read_to_string(&steps).unwrap();
    let got: Vec<Value> = text
        .lines()
        .map(|l| {
            serde_json::from_str(l).unwrap_or_else(|e| panic!("steps.jsonl line not whole: {e}"))
        })
        .collect();
    let mut want: Vec<Value> = steps_acked.iter().map(|i| json!(i)).collect();
    want.push(json!("after"));
    assert_eq!(
        got.iter().map(|v| v["step"].clone()).collect::<Vec<_>>(),
        want
    );
    let r = create("after".into()).await;
    assert_eq!(r.status, 201, "{}", r.text());
    acked.push((
        "after".into(),
        r.json()["api_key"].as_str().unwrap().to_string(),
    ));
    let r = http::post_json(
        &format!("{base}/graft/sessions/s-0/reward"),
        &[],
        &json!({"reward": 0.99}),
    )
    .await;
    assert_eq!(r.status, 200, "{}", r.text());
    let r = call("s-0", &acked[0].1, "after").await;
    assert_eq!(r.status, 200, "{}", r.text());
    acked_calls += 1;
    gw.stop();

    // Every line of the log is a whole event: nothing glued onto a torn append.
    let log = std::fs::read_to_string(data.join("sessions.log")).unwrap();
    for (n, line) in log.lines().enumerate() {
        serde_json::from_str::<Value>(line)
            .unwrap_or_else(|e| panic!("sessions.log line {} is not whole: {e}", n + 1));
    }
    // A restart, no repair: every acknowledged session, key, reward and call.
    let gw = Proc::gateway_with(&upstream.url, &data, &[], &[]);
    let s0 = http::get(&format!("{}/graft/sessions/s-0", gw.url), &[])
        .await
        .json();
    assert_eq!(s0["reward"], 0.99, "the last acknowledged reward: {s0}");
    for (id, key) in &acked {
        let r = http::post_json(
            &format!("{}/s/{id}/v1/chat/completions", gw.url),
            &[("authorization", &format!("Bearer {key}"))],
            &chat("m", "after restart", false),
        )
        .await;
        assert_eq!(r.status, 200, "{id}: {}", r.text());
    }
    drop(gw);
    let recs = graft_records(&data);
    let s0_calls = recs.iter().filter(|r| r["session_id"] == "s-0").count();
    assert_eq!(
        s0_calls,
        acked_calls + 1,
        "every acknowledged call of s-0 (and the one after the restart)"
    );
}

/// Issue 32, hole 2: `.` and `..` are dot-segments that HTTP clients remove from a base URL
/// (`/s/../v1` is sent as `/v1`, the default session): refused as session and group ids,
/// by name.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hole2_session_ids_dot_and_dotdot_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let upstream = Proc::scripted_upstream(&[]);
    let gw = Proc::gateway_with(&upstream.url, &dir.path().join("data"), &[], &[]);
    for (key, id) in [
        ("session_id", "."),
        ("session_id", ".."),
        ("group_id", ".."),
    ] {
        let r = http::post_json(
            &format!("{}/graft/sessions", gw.url),
            &[],
            &json!({key: id}),
        )
        .await;
        assert_error(&r, 400, "invalid_value", "not '.' or '..'");
        assert!(r.text().contains(key), "{}", r.text());
    }
    // Three dots is a plain segment: accepted.
    let r = http::post_json(
        &format!("{}/graft/sessions", gw.url),
        &[],
        &json!({"session_id": "..."}),
    )
    .await;
    assert_eq!(r.status, 201, "{}", r.text());
}

/// Issue 32, hole 3: on loopback with no `auth.admin_key`, a harness that dropped its
/// session key (no key, or a made-up one) is no admin: it cannot list sessions, read or
/// reward another session, pause backends, open `/ui`, or call into another session by URL
/// or header; it reaches only the default session. A session's own key reaches only its own
/// calls. graft's local tools take the key the gateway generated into the data dir (0600,
/// the same across restarts) and still work. A session whose creation is no longer in the
/// log (a damaged line dropped by a repair) answers only the admin key.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hole3_without_an_admin_key_a_harness_without_its_key_reaches_only_the_default_session() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let upstream = Proc::scripted_upstream(&[]);
    let mut gw = Proc::gateway_with(&upstream.url, &data, &[], &[]);
    let base = gw.url.clone();
    let key_file = data.join("admin.key");
    let admin_key = common::admin_key(&data).expect("the gateway generated an admin key");
    {
        use std::os::unix::fs::PermissionsExt;
        let mode = std::fs::metadata(&key_file).unwrap().permissions().mode();
        assert_eq!(mode & 0o777, 0o600, "{mode:o}");
    }
    let admin_h = format!("Bearer {admin_key}");
    let admin = [("authorization", admin_h.as_str())];
    // The orchestrator, with the admin key, opens two sessions.
    let mut keys = vec![];
    for id in ["sess-a", "sess-b"] {
        let r = http::send_bare(
            "POST",
            &format!("{base}/graft/sessions"),
            &admin,
            json!({"session_id": id}).to_string().into_bytes(),
        )
        .await
        .unwrap();
        assert_eq!(r.status, 201, "{}", r.text());
        keys.push(r.json()["api_key"].as_str().unwrap().to_string());
    }
    let a_h = format!("Bearer {}", keys[0]);
    let body = chat("m", "hi", false).to_string().into_bytes();
    let reward = br#"{"reward": 1.0}"#.to_vec();
    let admin_routes = [
        ("GET", "/graft/sessions"),
        ("POST", "/graft/sessions"),
        ("GET", "/graft/sessions/sess-b"),
        ("POST", "/graft/sessions/sess-b/reward"),
        ("POST", "/graft/sessions/sess-b/calls/1/reward"),
        ("POST", "/graft/sessions/sess-b/close"),
        ("GET", "/graft/backend/status"),
        ("GET", "/ui"),
        ("GET", "/ui/session/sess-b"),
    ];
    // A harness without its key: no key, or a made-up one (what SDKs send when told none).
    for headers in [vec![], vec![("authorization", "Bearer sk-made-up")]] {
        for (method, path) in admin_routes {
            let r = http::send_bare(method, &format!("{base}{path}"), &headers, reward.clone())
                .await
                .unwrap();
            assert_eq!(r.status, 401, "{method} {path} {headers:?}: {}", r.text());
            assert!(
                r.text().contains("admin.key"),
                "names where the key is: {}",
                r.text()
            );
            assert!(!r.text().contains(&admin_key));
        }
        let into_b = [
            (format!("{base}/s/sess-b/v1/chat/completions"), None),
            (format!("{base}/v1/chat/completions"), Some("sess-b")),
        ];
        for (url, header) in &into_b {
            let mut h = headers.clone();
            if let Some(s) = header {
                h.push(("x-graft-session", s));
            }
            let r = http::send_bare("POST", url, &h, body.clone())
                .await
                .unwrap();
            assert_error(&r, 401, "invalid_api_key", "takes only its own API key");
        }
        // The default session is the one a call without a key reaches.
        let r = http::send_bare(
            "POST",
            &format!("{base}/v1/chat/completions"),
            &headers,
            body.clone(),
        )
        .await
        .unwrap();
        assert_eq!(r.status, 200, "{}", r.text());
        assert_eq!(r.header("x-graft-session").as_deref(), Some("default"));
    }
    // A session's key: its own calls, nothing else.
    let a_auth = [("authorization", a_h.as_str())];
    for (method, path) in admin_routes {
        let r = http::send_bare(method, &format!("{base}{path}"), &a_auth, reward.clone())
            .await
            .unwrap();
        assert_eq!(r.status, 403, "{method} {path}: {}", r.text());
    }
    let r = http::send_bare(
        "POST",
        &format!("{base}/s/sess-b/v1/chat/completions"),
        &a_auth,
        body.clone(),
    )
    .await
    .unwrap();
    assert_eq!(r.status, 403, "{}", r.text());
    let r = http::send_bare(
        "POST",
        &format!("{base}/s/sess-a/v1/chat/completions"),
        &a_auth,
        body.clone(),
    )
    .await
    .unwrap();
    assert_eq!(r.status, 200, "{}", r.text());

    // Nothing above touched B. The key is the same after a restart; the admin API and a
    // session's calls still work with the keys.
    gw.stop();
    let mut gw = Proc::gateway_with(&upstream.url, &data, &[], &[]);
    assert_eq!(
        common::admin_key(&data).as_deref(),
        Some(admin_key.as_str())
    );
    let b = http::send_bare(
        "GET",
        &format!("{}/graft/sessions/sess-b", gw.url),
        &admin,
        vec![],
    )
    .await
    .unwrap();
    assert_eq!(b.status, 200, "{}", b.text());
    let b = b.json();
    assert!(
        b["calls"] == 0 && b["reward"].is_null() && b["call_rewards"] == 0 && b["closed"] == false,
        "{b}"
    );
    let sessions: Vec<String> = graft_records(&data)
        .iter()
        .map(|r| r["session_id"].as_str().unwrap().to_string())
        .collect();
    assert_eq!(
        sessions.iter().filter(|s| *s == "default").count(),
        2,
        "{sessions:?}"
    );
    assert_eq!(
        sessions.iter().filter(|s| *s == "sess-a").count(),
        1,
        "{sessions:?}"
    );
    assert!(!sessions.iter().any(|s| s == "sess-b"), "{sessions:?}");
    let r = http::send_bare(
        "POST",
        &format!("{}/s/sess-a/v1/chat/completions", gw.url),
        &a_auth,
        body.clone(),
    )
    .await
    .unwrap();
    assert_eq!(r.status, 200, "{}", r.text());

    // A session whose `created` line is gone (dropped by a repair as damaged) but whose
    // records are there may have had a key, now unknown: no call without a key gets in,
    // nor its old key; the admin key does.
    gw.stop();
    let log = data.join("sessions.log");
    let kept: String = std::fs::read_to_string(&log)
        .unwrap()
        .lines()
        .filter(|l| !(l.contains("\"created\"") && l.contains("\"sess-a\"")))
        .map(|l| format!("{l}\n"))
        .collect();
    std::fs::write(&log, kept).unwrap();
    let gw = Proc::gateway_with(&upstream.url, &data, &[], &[]);
    let url = format!("{}/s/sess-a/v1/chat/completions", gw.url);
    for headers in [vec![], a_auth.to_vec()] {
        let r = http::send_bare("POST", &url, &headers, body.clone())
            .await
            .unwrap();
        assert_error(&r, 401, "invalid_api_key", "takes only its own API key");
    }
    let r = http::send_bare("POST", &url, &admin, body.clone())
        .await
        .unwrap();
    assert_eq!(r.status, 200, "{}", r.text());

    // A local tool on its own data dir: `graft demo` opens a session, rewards and closes
    // it through the admin API of a gateway given no key.
    let demo = dir.path().join("demo");
    let (ok, out) = graft_run(&["demo", "--data-dir", demo.to_str().unwrap()], &[]);
    assert!(ok, "{out}");
    assert!(
        out.contains("reward    1.0 posted, session closed"),
        "{out}"
    );
    assert!(demo.join("admin.key").is_file());
}

/// Issue 32, hole 4: an empty or whitespace-only key is refused at start, from graft.toml
/// or from the environment, on loopback too, naming the setting.
#[test]
fn hole4_an_empty_admin_key_is_refused_at_start() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    for (toml, envs) in [
        ("[auth]\nadmin_key = \"\"\n", vec![]),
        (
            "[auth]\nadmin_key = \"env::GRAFT_TEST_EMPTY_KEY\"\n",
            vec![("GRAFT_TEST_EMPTY_KEY", "  ")],
        ),
        ("[auth]\nclient_keys = [\" \"]\n", vec![]),
    ] {
        let cfg = dir.path().join("graft.toml");
        std::fs::write(&cfg, toml).unwrap();
        for listen in ["127.0.0.1:0", "0.0.0.0:0"] {
            let (ok, out) = graft_run(
                &[
                    "gateway",
                    "--listen",
                    listen,
                    "--upstream",
                    "http://127.0.0.1:9",
                    "--data-dir",
                    data.to_str().unwrap(),
                    "--config",
                    cfg.to_str().unwrap(),
                ],
                &envs,
            );
            assert!(!ok, "{toml} on {listen}: {out}");
            assert!(
                out.contains("empty or whitespace only") && out.contains("auth."),
                "{toml}: {out}"
            );
        }
    }
}

/// Issue 32, hole 5 (keys): a refused `/v1` key is never echoed, not even its first
/// characters.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hole5_a_refused_key_is_never_echoed() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = dir.path().join("graft.toml");
    std::fs::write(
        &cfg,
        "[auth]\nclient_keys = [\"client-key-1\"]\nrequire_client_key = true\n",
    )
    .unwrap();
    let upstream = Proc::scripted_upstream(&[]);
    let gw = Proc::gateway_with(
        &upstream.url,
        &dir.path().join("data"),
        &["--config", cfg.to_str().unwrap()],
        &[],
    );
    let secret = "sk-live-SECRETVALUE-123";
    let auth = format!("Bearer {secret}");
    let r = http::post_json(
        &format!("{}/v1/chat/completions", gw.url),
        &[("authorization", auth.as_str())],
        &chat("m", "hi", false),
    )
    .await;
    assert_error(&r, 401, "invalid_api_key", "not valid");
    for part in ["sk-l", "SECRET", "123"] {
        assert!(!r.text().contains(part), "{}", r.text());
    }
    assert!(!gw.stderr().contains("SECRET"), "{}", gw.stderr());
}

/// Issue 32, hole 5 (secrets in bodies): `password`, `token`, `secret` and the rest of
/// `graft_recorder::SECRET_BODY_KEYS` are redacted from the recorded request wherever the
/// client put them beside the conversation; the conversation and tools are kept exactly
/// (a tool parameter named `password` is the tool's definition, not a secret).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hole5_secrets_beside_the_conversation_are_redacted_in_records() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let upstream = Proc::scripted_upstream(&[]);
    let gw = Proc::gateway_with(&upstream.url, &data, &[], &[]);
    let tools = json!([{"type": "function", "function": {"name": "login", "parameters":
        {"type": "object", "properties": {"password": {"type": "string"}}}}}]);
    let mut body = chat("m", "log me in", false);
    body["tools"] = tools.clone();
    body["metadata"] =
        json!({"password": "hunter2", "run": "r1", "auth": {"Access-Token": "tok-9"}});
    let r = http::post_json(&format!("{}/v1/chat/completions", gw.url), &[], &body).await;
    assert_eq!(r.status, 200, "{}", r.text());
    let recs = graft_records(&data);
    let rec = recs.last().unwrap();
    let req = &rec["request"];
    assert_eq!(
        req["metadata"],
        json!({"password": "[redacted]", "run": "r1", "auth": {"Access-Token": "[redacted]"}}),
        "{rec:#}"
    );
    assert_eq!(req["tools"], tools, "{rec:#}");
    assert_eq!(req["messages"], body["messages"], "{rec:#}");
    assert!(
        !rec.to_string().contains("hunter2") && !rec.to_string().contains("tok-9"),
        "{rec:#}"
    );
}

//! Retries: the openai Python SDK with a short timeout retries a call whose first attempt
//! is slow (the scripted upstream's `first_delay_ms`) or failed with a 500 (`first_status`),
//! streaming and not, in exact and passthrough modes. Both attempts are recorded and linked (`attempt`, `retry_of`), the
//! abandoned one as `client_disconnected`; in exact mode the backend is told to stop it
//! (`/abort_request` with the call id as `rid`, which the scripted SGLang side logs); and
//! `graft reconstruct` trains one sample per session, on the attempt the client received.
//!
//! The other two rules, through the same real SDK retry loop: the stock `OpenAI` client sends
//! no `Idempotency-Key` (its `_idempotency_header` is None; it sends `x-stainless-retry-count`
//! 0, 1, ...), but its retry machinery keeps one key for every attempt of a request once a
//! client turns the header on. With that header and no retry count the attempts are linked by
//! the key alone (passthrough, where no other rule can); with neither header, in exact mode
//! by the resent prompt ids alone; and with neither in passthrough they are not linked (the
//! control: two turns, still trained once, as the abandoned one is left out).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use common::{Proc, TestEnv, http};
use serde_json::Value;

const SCRIPT: &str = r#"{"rules": [
  {"match": "graft-retry-json", "first_delay_ms": 5000, "reply": {"content": "Answered on the second attempt."}},
  {"match": "graft-retry-stream", "first_delay_ms": 5000, "reply": {"content": "Streamed on the second attempt."}},
  {"match": "graft-key-json", "first_delay_ms": 5000, "reply": {"content": "Answered on the second attempt."}},
  {"match": "graft-key-stream", "first_delay_ms": 5000, "reply": {"content": "Streamed on the second attempt."}},
  {"match": "graft-none-json", "first_delay_ms": 5000, "reply": {"content": "Answered on the second attempt."}},
  {"match": "graft-none-stream", "first_delay_ms": 5000, "reply": {"content": "Streamed on the second attempt."}},
  {"match": "graft-fail-json", "first_status": 500, "reply": {"content": "Answered on the second attempt."}},
  {"match": "graft-fail-stream", "first_status": 500, "reply": {"content": "Streamed on the second attempt."}}
]}"#;

fn reconstruct(data: &Path, qwen3: &Path, out: &Path) -> Value {
    let text = common::graft(&[
        "reconstruct",
        "--data-dir",
        data.to_str().unwrap(),
        "--tokenizer",
        qwen3.to_str().unwrap(),
        "--out",
        out.to_str().unwrap(),
        "--json",
    ]);
    serde_json::from_str(text.lines().last().unwrap()).unwrap_or_else(|e| panic!("{e}: {text}"))
}

fn block_on<F: std::future::Future>(f: F) -> F::Output {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
        .block_on(f)
}

/// Polls `f` until it gives something (30 s at most).
fn wait_for<T>(what: &str, mut f: impl FnMut() -> Option<T>) -> T {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        if let Some(v) = f() {
            return v;
        }
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// Runs the SDK once (`mode`: json | stream) in a new session, its attempts saying they are
/// one request by `signal` (the client's SIGNAL); checks the answer and what the SDK sent;
/// returns the session id and its records.
fn sdk_call(
    env: &TestEnv,
    gw: &Proc,
    data: &Path,
    mode: &str,
    signal: &str,
) -> (String, Vec<Value>) {
    let (sid, base) = block_on(common::open_session(&gw.url));
    // `fail`: the stock SDK (its retry count) on a first attempt the upstream fails with 500.
    let (tag, signal) = match signal {
        "stainless" => ("retry", "stainless"),
        "fail" => ("fail", "stainless"),
        s => (s, s),
    };
    let text = format!("graft-{tag}-{mode}: say something");
    let mut cmd = Command::new(env.python());
    cmd.arg(common::clients_dir().join("python").join("openai_retry.py"))
        .arg(mode)
        .arg(signal)
        .env("GRAFT_BASE_URL", &base)
        .env("GRAFT_API_KEY", common::session_key(&base))
        .env("GRAFT_MODEL", "qwen3")
        .env("GRAFT_TIMEOUT", "1.5")
        .env("GRAFT_TEXT", &text)
        .env("PYTHONUNBUFFERED", "1")
        .env("PYTHONDONTWRITEBYTECODE", "1");
    let out = common::run_client(cmd, Duration::from_secs(120));
    let want = if mode == "json" {
        "Answered on the second attempt."
    } else {
        "Streamed on the second attempt."
    };
    assert_eq!(out["content"], want, "{out:#}");
    // What the real SDK put on its two attempts.
    let sent = out["attempts"].as_array().unwrap();
    assert_eq!(
        sent.len(),
        2,
        "the SDK's first attempt failed, it retried once: {out:#}"
    );
    let (key, count) = (
        &sent[1]["idempotency-key"],
        &sent[1]["x-stainless-retry-count"],
    );
    match signal {
        "stainless" => {
            assert_eq!(sent[0]["x-stainless-retry-count"], "0", "{out:#}");
            assert_eq!(*count, "1", "{out:#}");
            assert!(
                key.is_null(),
                "the stock client sends no Idempotency-Key: {out:#}"
            );
        }
        "key" => {
            assert!(
                key.as_str().unwrap().starts_with("stainless-python-retry-"),
                "{out:#}"
            );
            assert_eq!(
                sent[0]["idempotency-key"], *key,
                "one key for both: {out:#}"
            );
            assert!(count.is_null(), "{out:#}");
        }
        _ => assert!(key.is_null() && count.is_null(), "{out:#}"),
    }
    let recs = wait_for("both attempts' records", || {
        let recs: Vec<Value> = common::records_show(data)
            .into_iter()
            .filter(|r| r["session_id"] == sid.as_str())
            .collect();
        (recs.len() >= 2).then_some(recs)
    });
    assert_eq!(recs.len(), 2, "one abandoned attempt, one retry: {recs:#?}");
    assert_eq!(
        recs.iter().filter(|r| r["outcome"] == "ok").count(),
        1,
        "one answered call for the one request: {recs:#?}"
    );
    assert_eq!(
        recs[0]["request"], recs[1]["request"],
        "the SDK resent the same body"
    );
    (sid, recs)
}

/// Runs the SDK once with its stock retry header; checks the attempts are linked; returns
/// the session id and the abandoned attempt's call id.
fn retried_call(env: &TestEnv, gw: &Proc, data: &Path, mode: &str) -> (String, String) {
    let (sid, recs) = sdk_call(env, gw, data, mode, "stainless");
    check_linked(&recs, mode, "client_disconnected");
    let first = recs.iter().find(|r| r["attempt"] == 1).unwrap();
    (sid, first["call_id"].as_str().unwrap().to_string())
}

/// The first attempt (abandoned, or failed: `first_outcome`) and the answered retry,
/// linked as one turn.
fn check_linked(recs: &[Value], mode: &str, first_outcome: &str) {
    let first = recs
        .iter()
        .find(|r| r["attempt"] == 1)
        .unwrap_or_else(|| panic!("{recs:#?}"));
    let retry = recs
        .iter()
        .find(|r| r["attempt"] == 2)
        .unwrap_or_else(|| panic!("{recs:#?}"));
    assert_eq!(first["outcome"], first_outcome, "{first:#}");
    assert!(first["retry_of"].is_null(), "{first:#}");
    assert_eq!(retry["outcome"], "ok", "{retry:#}");
    assert_eq!(retry["retry_of"], first["call_id"], "{retry:#}");
    assert_eq!(retry["stream"], mode == "stream");
}

fn run(exact: bool) {
    let env = TestEnv::get();
    let qwen3 = env.qwen3_dir();
    let q = qwen3.to_str().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let script = dir.path().join("script.json");
    std::fs::write(&script, SCRIPT).unwrap();
    let s = script.to_str().unwrap();
    let (upstream, gw) = if exact {
        let up = Proc::scripted_upstream(&["--script", s, "--tokenizer", q]);
        let gw = Proc::gateway_with(&up.url, &data, &["--mode", "exact", "--model-dir", q], &[]);
        (up, gw)
    } else {
        let up = Proc::scripted_upstream(&["--script", s]);
        let gw = Proc::gateway_with(&up.url, &data, &[], &[]);
        (up, gw)
    };
    let mut abandoned = vec![];
    let mut sessions = vec![];
    for mode in ["json", "stream"] {
        let (sid, first) = retried_call(&env, &gw, &data, mode);
        abandoned.push(first);
        sessions.push(sid);
    }
    // The retry bookkeeping on /metrics: the two sessions' two attempts each, none forgotten.
    let metrics = block_on(http::get(&format!("{}/metrics", gw.url), &[])).text();
    let value = |name: &str| {
        metrics
            .lines()
            .find_map(|l| l.strip_prefix(name)?.strip_prefix(' '))
            .unwrap_or_else(|| panic!("no {name} in /metrics:\n{metrics}"))
            .to_string()
    };
    assert_eq!(value("graft_retry_memory_attempts"), "4", "{metrics}");
    assert_eq!(
        value("graft_retry_memory_forgotten_total"),
        "0",
        "{metrics}"
    );
    if exact {
        // The backend was told to stop each abandoned generation, by the call id.
        let log = wait_for("the aborts", || {
            let log = block_on(http::get(
                &format!("{}/testkit/requests", upstream.url),
                &[],
            ))
            .json();
            let aborted: Vec<String> = log["aborted"]
                .as_array()
                .unwrap()
                .iter()
                .map(|v| v.as_str().unwrap().to_string())
                .collect();
            abandoned.iter().all(|a| aborted.contains(a)).then_some(log)
        });
        // Every /generate carried its call id as rid and its session as the router's
        // routing key.
        let gens = log["generate"].as_array().unwrap();
        assert_eq!(gens.len(), 4, "{log:#}");
        assert!(gens.iter().all(|g| g["rid"].is_string()), "{log:#}");
        let keys: Vec<&str> = gens
            .iter()
            .map(|g| g["routing_key"].as_str().unwrap())
            .collect();
        assert_eq!(
            keys,
            [
                sessions[0].as_str(),
                sessions[0].as_str(),
                sessions[1].as_str(),
                sessions[1].as_str()
            ],
            "{log:#}"
        );
    }
    let out = dir.path().join("samples.parquet");
    let summary = reconstruct(&data, &qwen3, &out);
    assert_eq!(summary["samples"], 2, "one sample per session: {summary:#}");
    assert_eq!(
        summary["skipped"]["abandoned by the client (client_disconnected)"], 2,
        "{summary:#}"
    );
}

#[test]
fn sdk_retries_after_a_timeout_are_linked_and_trained_once_in_exact_mode() {
    run(true);
}

#[test]
fn sdk_retries_after_a_timeout_are_linked_and_trained_once_in_passthrough_mode() {
    run(false);
}

/// SDK calls (whole and streamed, a session each) whose attempts carry no retry count:
/// linked by the Idempotency-Key (passthrough), by the prompt ids (exact), not at all
/// without either (passthrough); each session still trains once.
fn run_without_the_retry_count(exact: bool, signal: &str) {
    let env = TestEnv::get();
    let qwen3 = env.qwen3_dir();
    let q = qwen3.to_str().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let script = dir.path().join("script.json");
    std::fs::write(&script, SCRIPT).unwrap();
    let s = script.to_str().unwrap();
    let (_upstream, gw) = if exact {
        let up = Proc::scripted_upstream(&["--script", s, "--tokenizer", q]);
        let gw = Proc::gateway_with(&up.url, &data, &["--mode", "exact", "--model-dir", q], &[]);
        (up, gw)
    } else {
        let up = Proc::scripted_upstream(&["--script", s]);
        let gw = Proc::gateway_with(&up.url, &data, &[], &[]);
        (up, gw)
    };
    let linked = exact || signal == "key";
    for mode in ["json", "stream"] {
        let (_, recs) = sdk_call(&env, &gw, &data, mode, signal);
        if linked {
            check_linked(&recs, mode, "client_disconnected");
        } else {
            // Nothing says the second attempt repeats the first: two turns.
            assert!(
                recs.iter()
                    .all(|r| r["attempt"] == 1 && r["retry_of"].is_null()),
                "{recs:#?}"
            );
        }
    }
    let out = dir.path().join("samples.parquet");
    let summary = reconstruct(&data, &qwen3, &out);
    assert_eq!(summary["samples"], 2, "one sample per session: {summary:#}");
    assert_eq!(
        summary["skipped"]["abandoned by the client (client_disconnected)"], 2,
        "{summary:#}"
    );
}

#[test]
fn an_idempotency_key_alone_links_sdk_retries_in_passthrough_mode() {
    run_without_the_retry_count(false, "key");
}

#[test]
fn resent_prompt_ids_alone_link_sdk_retries_in_exact_mode() {
    run_without_the_retry_count(true, "none");
}

#[test]
fn sdk_retries_without_a_key_or_retry_count_are_separate_turns_in_passthrough_mode() {
    run_without_the_retry_count(false, "none");
}

/// The upstream fails the first attempt with a 500 (the scripted `first_status`): the
/// gateway answers the SDK a 5xx, the SDK retries it with its retry count, and the retry is
/// linked to the failed attempt; each session trains once, on the answered attempt.
fn run_after_a_5xx(exact: bool) {
    let env = TestEnv::get();
    let qwen3 = env.qwen3_dir();
    let q = qwen3.to_str().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let script = dir.path().join("script.json");
    std::fs::write(&script, SCRIPT).unwrap();
    let s = script.to_str().unwrap();
    let (_upstream, gw) = if exact {
        let up = Proc::scripted_upstream(&["--script", s, "--tokenizer", q]);
        let gw = Proc::gateway_with(&up.url, &data, &["--mode", "exact", "--model-dir", q], &[]);
        (up, gw)
    } else {
        let up = Proc::scripted_upstream(&["--script", s]);
        let gw = Proc::gateway_with(&up.url, &data, &[], &[]);
        (up, gw)
    };
    for mode in ["json", "stream"] {
        let (_, recs) = sdk_call(&env, &gw, &data, mode, "fail");
        check_linked(&recs, mode, "upstream_error");
    }
    let out = dir.path().join("samples.parquet");
    let summary = reconstruct(&data, &qwen3, &out);
    assert_eq!(summary["samples"], 2, "one sample per session: {summary:#}");
}

#[test]
fn sdk_retries_after_an_upstream_500_are_linked_and_trained_once_in_passthrough_mode() {
    run_after_a_5xx(false);
}

#[test]
fn sdk_retries_after_an_upstream_500_are_linked_and_trained_once_in_exact_mode() {
    run_after_a_5xx(true);
}

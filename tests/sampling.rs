//! Sampling policy: a session (or `[sampling]` in graft.toml) decides the sampling
//! parameters its rollouts are sampled with, whatever the harness sends. aider sends
//! `temperature: 0`; Codex sends its own settings; under an enforced policy the backend
//! (the scripted SGLang side, which logs what it was asked) must receive the policy's
//! temperature, and each record must hold what the client asked for and what was sent.
//! Bad policies and what exact mode cannot sample (`n > 1`) get clear errors in the
//! client's dialect.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use common::{Proc, Stack, TestEnv, http};
use serde_json::{Value, json};

const POLICY_TEMPERATURE: f64 = 0.7;

fn block_on<F: std::future::Future>(f: F) -> F::Output {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
        .block_on(f)
}

/// Opens session `id` with an enforced policy; returns the API's answer.
fn open_with_policy(stack: &Stack, id: &str) -> Value {
    let r = block_on(http::post_json(
        &format!("{}/graft/sessions", stack.gateway.url),
        &[],
        &json!({"session_id": id, "sampling": {"mode": "enforce",
            "temperature": POLICY_TEMPERATURE, "top_p": 1.0, "max_new_tokens": 2048}}),
    ));
    assert_eq!(r.status, 201, "{}", r.text());
    let v = r.json();
    assert_eq!(
        v["session_id"], id,
        "the session API answers as before: {v}"
    );
    let s = block_on(http::get(
        &format!("{}/graft/sessions/{id}", stack.gateway.url),
        &[],
    ))
    .json();
    assert_eq!(s["sampling"]["temperature"], POLICY_TEMPERATURE, "{s}");
    v
}

/// What the scripted SGLang side was asked (`GET /testkit/requests`).
fn backend_log(stack: &Stack) -> Value {
    block_on(http::get(
        &format!("{}/testkit/requests", stack.upstream.url),
        &[],
    ))
    .json()
}

fn exact_stack() -> (Stack, String) {
    let env = TestEnv::get();
    let q = env.qwen3_dir();
    let q = q.to_str().unwrap().to_string();
    let stack = Stack::start_with(
        &["--tokenizer", &q],
        &["--mode", "exact", "--model-dir", &q],
    );
    (stack, q)
}

/// Every record holds the policy, what the client asked for, and what was sent; every
/// `/generate` the backend saw carried the policy's temperature and capped new tokens.
fn check_policy_applied(stack: &Stack, recs: &[Value]) {
    for r in recs {
        let s = &r["sampling"];
        assert_eq!(s["policy"]["mode"], "enforce", "{r:#}");
        assert_eq!(s["policy"]["temperature"], POLICY_TEMPERATURE, "{s}");
        assert_eq!(s["sent"]["temperature"], POLICY_TEMPERATURE, "{s}");
        assert_eq!(s["sent"]["top_p"], 1.0, "{s}");
        assert!(
            s["sent"]["max_new_tokens"].as_u64().unwrap() <= 2048,
            "the cap holds: {s}"
        );
        assert!(s["requested"].is_object(), "{s}");
        // The normalized request keeps what the client asked for; the upstream request is
        // what the backend got.
        assert_eq!(r["normalized_request"]["sampling"], s["requested"], "{r:#}");
        assert_eq!(
            r["upstream_request"]["sampling_params"]["temperature"],
            POLICY_TEMPERATURE
        );
    }
    let log = backend_log(stack);
    let seen = log["generate"].as_array().unwrap();
    assert!(seen.len() >= recs.len(), "{log:#}");
    for g in seen {
        assert_eq!(
            g["sampling_params"]["temperature"], POLICY_TEMPERATURE,
            "{g}"
        );
    }
}

#[test]
fn aider_in_exact_mode_under_an_enforced_policy_samples_at_the_policy_temperature() {
    let env = TestEnv::get();
    let (stack, _q) = exact_stack();
    open_with_policy(&stack, "aider-policy");
    let out = env.aider_client(&stack.target(Some("aider-policy"), None));
    assert_eq!(
        out["changed"], true,
        "aider did not apply the scripted edit: {out:#}"
    );
    let recs = stack.wait_records("aider-policy", 1);
    let rec = recs
        .iter()
        .find(|r| r["request"].to_string().contains("graft-aider-task"))
        .unwrap_or_else(|| panic!("no recorded call carries aider's message: {recs:#?}"));
    // aider asks for greedy decoding; the record keeps that it did.
    assert_eq!(rec["request"]["temperature"], 0, "{:#}", rec["request"]);
    assert_eq!(rec["sampling"]["requested"]["temperature"], 0.0, "{rec:#}");
    check_policy_applied(&stack, &recs);
}

#[test]
fn codex_in_exact_mode_under_an_enforced_policy_samples_at_the_policy_temperature() {
    let env = TestEnv::get();
    let (stack, _q) = exact_stack();
    let session = open_with_policy(&stack, "codex-policy");
    let target = stack.target(Some("codex-policy"), None);
    let config_text = common::graft(&[
        "harness",
        "config",
        "codex",
        "--session",
        session["base_url"].as_str().unwrap(),
        "--api-key",
        &target.api_key,
        "--model",
        &target.model,
    ]);
    let config = stack.dir.path().join("codex-config.toml");
    std::fs::write(&config, &config_text).unwrap();
    let out = env.codex_client(&config, &target);
    assert_eq!(out["result_txt"], "graft-codex-step-done\n", "{out:#}");
    let recs = stack.wait_records("codex-policy", 2);
    assert!(recs.iter().all(|r| r["dialect"] == "responses"));
    check_policy_applied(&stack, &recs);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_policies_and_n_in_exact_mode_get_clear_errors_in_the_clients_dialect() {
    let env = TestEnv::get();
    let q = env.qwen3_dir();
    let q = q.to_str().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let upstream = Proc::scripted_upstream(&["--tokenizer", q]);
    let data = dir.path().join("data");

    // A gateway config with a negative temperature does not start, and says why.
    let config = dir.path().join("graft.toml");
    std::fs::write(&config, "[sampling]\ntemperature = -0.5\n").unwrap();
    let out = std::process::Command::new(common::graft_bin())
        .args(["gateway", "--mode", "exact", "--model-dir", q])
        .args(["--upstream", &upstream.url, "--listen", "127.0.0.1:0"])
        .args(["--data-dir", data.to_str().unwrap()])
        .args(["--config", config.to_str().unwrap()])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("sampling.temperature") && err.contains("-0.5"),
        "{err}"
    );

    let gw = Proc::gateway_with(
        &upstream.url,
        &data,
        &["--mode", "exact", "--model-dir", q],
        &[],
    );
    let sessions = format!("{}/graft/sessions", gw.url);
    // Session policies are checked when they are set.
    let r = http::post_json(
        &sessions,
        &[],
        &json!({"session_id": "neg", "sampling": {"temperature": -1.0}}),
    )
    .await;
    assert_eq!(r.status, 400, "{}", r.text());
    let e = &r.json()["error"];
    assert_eq!(e["param"], "sampling.temperature", "{e}");
    assert!(e["message"].as_str().unwrap().contains("-1"), "{e}");
    assert_eq!(
        http::get(&format!("{sessions}/neg"), &[]).await.status,
        404,
        "a refused session is not created"
    );
    let r = http::post_json(
        &sessions,
        &[],
        &json!({"session_id": "typo", "sampling": {"temprature": 1.0}}),
    )
    .await;
    assert_eq!(r.status, 400, "{}", r.text());
    assert!(r.text().contains("temprature"), "{}", r.text());
    let r = http::post_json(&sessions, &[], &json!({"session_id": "ok"})).await;
    assert_eq!(r.status, 201, "{}", r.text());
    let r = http::post_json(
        &format!("{sessions}/ok/sampling"),
        &[],
        &json!({"temperature": -2.0}),
    )
    .await;
    assert_eq!(r.status, 400, "{}", r.text());
    assert_eq!(r.json()["error"]["param"], "sampling.temperature");
    let r = http::post_json(
        &format!("{sessions}/ok/sampling"),
        &[],
        &json!({"mode": "default", "temperature": 0.9}),
    )
    .await;
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.json()["sampling"]["mode"], "default");

    // `n: 4` cannot be one exact-mode call: refused, naming the field, in OpenAI's shape.
    let base = format!("{}/s/ok/v1", gw.url);
    for (path, body) in [
        (
            "chat/completions",
            json!({"model": "qwen3", "n": 4, "messages": [{"role": "user", "content": "hi"}]}),
        ),
        (
            "completions",
            json!({"model": "qwen3", "n": 4, "prompt": "hi"}),
        ),
    ] {
        let r = http::post_json(&format!("{base}/{path}"), &[], &body).await;
        assert_eq!(r.status, 400, "{path}: {}", r.text());
        let e = &r.json()["error"];
        assert_eq!(e["param"], "n", "{path}: {e}");
        assert_eq!(e["type"], "invalid_request_error", "{path}: {e}");
        assert!(e["message"].as_str().unwrap().contains('4'), "{path}: {e}");
    }
    // A logit_bias that is not token id → number: refused, naming the entry.
    let r = http::post_json(
        &format!("{base}/chat/completions"),
        &[],
        &json!({"model": "qwen3", "logit_bias": {"42": "high"}, "messages": [{"role": "user", "content": "hi"}]}),
    )
    .await;
    assert_eq!(r.status, 400, "{}", r.text());
    assert_eq!(r.json()["error"]["param"], "logit_bias.42", "{}", r.text());

    // A good call under the session's `default` policy: the client's temperature stays,
    // the policy fills nothing it set; penalties and logit_bias reach the backend.
    let r = http::post_json(
        &format!("{base}/chat/completions"),
        &[],
        &json!({"model": "qwen3", "temperature": 0.3, "min_p": 0.05, "repetition_penalty": 1.1,
                "logit_bias": {"42": -100}, "messages": [{"role": "user", "content": "hi"}]}),
    )
    .await;
    assert_eq!(r.status, 200, "{}", r.text());
    let log = http::get(&format!("{}/testkit/requests", upstream.url), &[])
        .await
        .json();
    let sp = &log["generate"].as_array().unwrap().last().unwrap()["sampling_params"];
    assert_eq!(sp["temperature"], 0.3, "{sp}");
    assert_eq!(sp["min_p"], 0.05, "{sp}");
    assert_eq!(sp["repetition_penalty"], 1.1, "{sp}");
    assert_eq!(sp["logit_bias"], json!({"42": -100}), "{sp}");
    let recs = common::records_show(&data);
    let rec = recs.iter().find(|r| r["session_id"] == "ok").unwrap();
    assert_eq!(rec["sampling"]["policy"]["mode"], "default", "{rec:#}");
    assert_eq!(rec["sampling"]["requested"]["temperature"], 0.3);
    assert_eq!(rec["sampling"]["sent"]["temperature"], 0.3);
    let health = http::get(&format!("{}/healthz", gw.url), &[]).await;
    assert_eq!(health.status, 200);

    // A session's policy is durable: after a restart on the same data dir it still holds.
    let mut gw = gw;
    gw.stop();
    let gw = Proc::gateway_with(
        &upstream.url,
        &data,
        &["--mode", "exact", "--model-dir", q],
        &[],
    );
    let s = http::get(&format!("{}/graft/sessions/ok", gw.url), &[])
        .await
        .json();
    assert_eq!(s["sampling"]["mode"], "default", "{s}");
    assert_eq!(s["sampling"]["temperature"], 0.9, "{s}");
}

/// Passthrough: a policy rewrites the sampling keys of the Chat Completions body graft
/// forwards (set in graft.toml here, as `default`: only what the client left out is filled;
/// then a session's own `enforce` policy replaces it). The record holds what the client
/// sent (`request`), what was forwarded (`upstream_request`) and the policy.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn passthrough_bodies_are_sampled_under_the_gateway_or_session_policy() {
    let dir = tempfile::tempdir().unwrap();
    let upstream = Proc::scripted_upstream(&[]);
    let data = dir.path().join("data");
    let config = dir.path().join("graft.toml");
    std::fs::write(
        &config,
        "[sampling]\nmode = \"default\"\ntop_p = 0.95\nmax_new_tokens = 64\n",
    )
    .unwrap();
    let gw = Proc::gateway_with(
        &upstream.url,
        &data,
        &["--config", config.to_str().unwrap()],
        &[],
    );
    let chat = json!({"model": "m", "temperature": 0.0, "max_tokens": 500,
        "messages": [{"role": "user", "content": "hi"}]});
    let sessions = format!("{}/graft/sessions", gw.url);
    let r = http::post_json(&sessions, &[], &json!({"session_id": "plain"})).await;
    assert_eq!(r.status, 201);
    let r = http::post_json(
        &sessions,
        &[],
        &json!({"session_id": "forced", "sampling": {"temperature": 1.0}}),
    )
    .await;
    assert_eq!(r.status, 201);
    for sid in ["plain", "forced"] {
        let url = format!("{}/s/{sid}/v1/chat/completions", gw.url);
        let r = http::post_json(&url, &[], &chat).await;
        assert_eq!(r.status, 200, "{}", r.text());
    }
    let recs = common::records_show(&data);
    let rec = |sid: &str| {
        recs.iter()
            .find(|r| r["session_id"] == sid)
            .unwrap()
            .clone()
    };
    let plain = rec("plain");
    assert_eq!(plain["request"]["temperature"], 0.0, "{plain:#}");
    // `default`: the client's temperature stays, its missing top_p is filled, the cap holds.
    assert_eq!(plain["upstream_request"]["temperature"], 0.0, "{plain:#}");
    assert_eq!(plain["upstream_request"]["top_p"], 0.95, "{plain:#}");
    assert_eq!(plain["upstream_request"]["max_tokens"], 64, "{plain:#}");
    assert_eq!(plain["sampling"]["policy"]["mode"], "default");
    assert_eq!(plain["sampling"]["requested"]["max_tokens"], 500);
    let forced = rec("forced");
    assert_eq!(forced["request"]["temperature"], 0.0, "{forced:#}");
    assert_eq!(forced["upstream_request"]["temperature"], 1.0, "{forced:#}");
    assert!(
        forced["upstream_request"].get("top_p").is_none(),
        "the session's policy replaces the gateway's: {forced:#}"
    );
    assert_eq!(forced["sampling"]["sent"]["temperature"], 1.0);
}

//! The gateway's own contract, driven over real HTTP: the session API and its persistence
//! across restarts, rate limits, the upstream key, async durability, TLS on both sides.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use common::{Proc, graft_records, http};
use http_body_util::{BodyExt, Full};
use serde_json::{Value, json};

fn chat(model: &str, text: &str, stream: bool) -> Value {
    json!({"model": model, "stream": stream, "messages": [{"role": "user", "content": text}]})
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sessions_route_calls_and_survive_a_restart() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let upstream = Proc::scripted_upstream(&[]);
    let mut gw = Proc::gateway_with(&upstream.url, &data, &[], &[]);
    let base = gw.url.clone();

    let created = http::post_json(
        &format!("{base}/graft/sessions"),
        &[],
        &json!({"group_id": "task-1", "metadata": {"task": "t1"}}),
    )
    .await;
    assert_eq!(created.status, 201, "{}", created.text());
    let s = created.json();
    let id = s["session_id"].as_str().unwrap().to_string();
    let key = s["api_key"].as_str().unwrap().to_string();
    assert_eq!(s["base_url"], format!("{base}/s/{id}/v1"));
    assert_eq!(s["group_id"], "task-1");

    // The three ways to name a session all land in it.
    let by_url = http::post_json(
        &format!("{}/chat/completions", s["base_url"].as_str().unwrap()),
        &[],
        &chat("m", "by url", false),
    )
    .await;
    assert_eq!(by_url.status, 200, "{}", by_url.text());
    assert_eq!(
        by_url.header("x-graft-session").as_deref(),
        Some(id.as_str())
    );
    let by_header = http::post_json(
        &format!("{base}/v1/chat/completions"),
        &[("x-graft-session", &id)],
        &chat("m", "by header", false),
    )
    .await;
    assert_eq!(
        by_header.header("x-graft-session").as_deref(),
        Some(id.as_str())
    );
    let by_key = http::post_json(
        &format!("{base}/v1/chat/completions"),
        &[("authorization", &format!("Bearer {key}"))],
        &chat("m", "by key", true),
    )
    .await;
    assert_eq!(
        by_key.header("x-graft-session").as_deref(),
        Some(id.as_str())
    );
    let none = http::post_json(
        &format!("{base}/v1/chat/completions"),
        &[("authorization", "Bearer sk-whatever")],
        &chat("m", "no session", false),
    )
    .await;
    assert_eq!(none.header("x-graft-session").as_deref(), Some("default"));

    let r = http::post_json(
        &format!("{base}/graft/sessions/{id}/reward"),
        &[],
        &json!({"reward": 0.75, "info": {"tests_passed": 3}}),
    )
    .await;
    assert_eq!(r.status, 200, "{}", r.text());
    let got = http::get(&format!("{base}/graft/sessions/{id}"), &[])
        .await
        .json();
    assert_eq!(got["calls"], 3);
    assert_eq!(got["reward"], 0.75);
    assert_eq!(got["closed"], false);
    let dup = http::post_json(
        &format!("{base}/graft/sessions"),
        &[],
        &json!({"session_id": id}),
    )
    .await;
    assert_eq!(dup.status, 409, "{}", dup.text());

    // Restart: the session, its key, its reward and its call count come back.
    gw.stop();
    let gw = Proc::gateway_with(&upstream.url, &data, &[], &[]);
    let base = gw.url.clone();
    let got = http::get(&format!("{base}/graft/sessions/{id}"), &[])
        .await
        .json();
    assert_eq!(got["calls"], 3, "{got}");
    assert_eq!(got["reward"], 0.75);
    assert_eq!(got["metadata"]["task"], "t1");
    let after = http::post_json(
        &format!("{base}/v1/chat/completions"),
        &[("authorization", &format!("Bearer {key}"))],
        &chat("m", "after restart", false),
    )
    .await;
    assert_eq!(
        after.header("x-graft-session").as_deref(),
        Some(id.as_str()),
        "the session key still works"
    );
    let closed = http::post_json(
        &format!("{base}/graft/sessions/{id}/close"),
        &[],
        &json!({}),
    )
    .await;
    assert_eq!(closed.json()["closed"], true);
    let refused = http::post_json(
        &format!("{base}/s/{id}/v1/chat/completions"),
        &[],
        &chat("m", "too late", false),
    )
    .await;
    assert_eq!(refused.status, 409);
    drop(gw);

    let records = graft_records(&data);
    let mine: Vec<&Value> = records
        .iter()
        .filter(|r| r["session_id"] == id.as_str())
        .collect();
    assert_eq!(mine.len(), 4, "{mine:?}");
    let seqs: Vec<u64> = mine.iter().map(|r| r["seq"].as_u64().unwrap()).collect();
    assert_eq!(seqs, vec![1, 2, 3, 4], "seq continues across the restart");
    assert!(mine.iter().all(|r| r["group_id"] == "task-1"));
    let texts: Vec<&str> = mine
        .iter()
        .map(|r| r["request"]["messages"][0]["content"].as_str().unwrap())
        .collect();
    assert_eq!(
        texts,
        vec!["by url", "by header", "by key", "after restart"]
    );
    let sessions = common::graft(&[
        "records",
        "sessions",
        "--data-dir",
        data.to_str().unwrap(),
        "--json",
    ]);
    let line: Value = sessions
        .lines()
        .map(|l| serde_json::from_str::<Value>(l).unwrap())
        .find(|v| v["session_id"] == id.as_str())
        .unwrap();
    assert_eq!(line["reward"], 0.75);
    assert_eq!(line["closed"], true);
    assert_eq!(line["calls"], 4);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn over_the_limit_is_429_with_retry_after() {
    let dir = tempfile::tempdir().unwrap();
    let upstream = Proc::scripted_upstream(&[]);
    let config = dir.path().join("graft.toml");
    std::fs::write(
        &config,
        "[sessions]\nauto_create = true\n[limits]\nsession_rps = 1\nburst = 2\nmax_concurrent_upstream = 1\nupstream_queue_timeout_ms = 100\n",
    )
    .unwrap();
    let gw = Proc::gateway_with(
        &upstream.url,
        &dir.path().join("data"),
        &["--config", config.to_str().unwrap()],
        &[],
    );
    let url = |s: &str| format!("{}/s/{s}/v1/chat/completions", gw.url);

    // Per session: a burst of 2, then 429; another session is unaffected.
    assert_eq!(
        http::post_json(&url("a"), &[], &chat("m", "1", false))
            .await
            .status,
        200
    );
    assert_eq!(
        http::post_json(&url("a"), &[], &chat("m", "2", false))
            .await
            .status,
        200
    );
    let r = http::post_json(&url("a"), &[], &chat("m", "3", false)).await;
    assert_eq!(r.status, 429, "{}", r.text());
    assert_eq!(r.header("retry-after").as_deref(), Some("1"));
    assert_eq!(r.json()["error"]["type"], "rate_limit_error");
    assert!(
        r.json()["error"]["message"]
            .as_str()
            .unwrap()
            .contains("session 'a'")
    );
    assert_eq!(
        http::post_json(&url("b"), &[], &chat("m", "1", false))
            .await
            .status,
        200
    );

    // One upstream slot: while a slow stream holds it, the next call waits 100 ms, then 429.
    let slow_url = url("c");
    let slow = tokio::spawn(async move {
        http::post_json(&slow_url, &[], &chat("fault-slow", "slow one", true)).await
    });
    tokio::time::sleep(Duration::from_millis(150)).await;
    let r = http::post_json(&url("d"), &[], &chat("m", "blocked", false)).await;
    assert_eq!(r.status, 429, "{}", r.text());
    assert!(
        r.json()["error"]["message"]
            .as_str()
            .unwrap()
            .contains("max_concurrent_upstream")
    );
    let slow = slow.await.unwrap();
    assert_eq!(slow.sse_data().last().map(String::as_str), Some("[DONE]"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn upstream_gets_grafts_key_never_the_clients() {
    let dir = tempfile::tempdir().unwrap();
    let upstream = Proc::scripted_upstream(&["--expect-key", "upstream-secret"]);
    let config = dir.path().join("graft.toml");
    std::fs::write(
        &config,
        "[upstream]\napi_key = \"env::GRAFT_TEST_UPSTREAM_KEY\"\n",
    )
    .unwrap();
    let data = dir.path().join("data");
    let gw = Proc::gateway_with(
        &upstream.url,
        &data,
        &[
            "--config",
            config.to_str().unwrap(),
            "--durability",
            "async",
        ],
        &[("GRAFT_TEST_UPSTREAM_KEY", "upstream-secret")],
    );
    let body = json!({"model": "m", "api_key": "sk-in-body", "messages": [{"role": "user", "content": "hi"}]});
    let r = http::post_json(
        &format!("{}/v1/chat/completions", gw.url),
        &[("authorization", "Bearer sk-client-own")],
        &body,
    )
    .await;
    assert_eq!(
        r.status,
        200,
        "the upstream accepted graft's key: {}",
        r.text()
    );
    drop(gw);

    // Without graft's key the same upstream refuses: the check above can fail.
    let gw2 = Proc::gateway_with(&upstream.url, &dir.path().join("data2"), &[], &[]);
    let r = http::post_json(
        &format!("{}/v1/chat/completions", gw2.url),
        &[("authorization", "Bearer upstream-secret")],
        &body,
    )
    .await;
    assert_eq!(
        r.status,
        401,
        "the client's key is not forwarded: {}",
        r.text()
    );
    drop(gw2);

    // Async durability still records, and keys in bodies are redacted.
    let records = graft_records(&data);
    assert_eq!(records.len(), 1);
    assert_eq!(records[0]["request"]["api_key"], "[redacted]");
    let all = std::process::Command::new("grep")
        .args(["-r", "-l", "sk-in-body"])
        .arg(&data)
        .output()
        .unwrap();
    assert!(
        all.stdout.is_empty(),
        "no file in the data dir holds the key: {}",
        String::from_utf8_lossy(&all.stdout)
    );
}

/// TLS on the listener, and an `https://` upstream with a private CA: gateway B forwards to
/// gateway A over TLS, A forwards to the scripted upstream.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tls_listener_and_https_upstream() {
    let dir = tempfile::tempdir().unwrap();
    let ca =
        rcgen::generate_simple_self_signed(vec!["localhost".to_string(), "127.0.0.1".to_string()])
            .unwrap();
    let cert = dir.path().join("cert.pem");
    let key = dir.path().join("key.pem");
    std::fs::write(&cert, ca.cert.pem()).unwrap();
    std::fs::write(&key, ca.signing_key.serialize_pem()).unwrap();

    let upstream = Proc::scripted_upstream(&[]);
    let cfg_a = dir.path().join("a.toml");
    std::fs::write(
        &cfg_a,
        format!("[server]\ntls = {{ cert = {:?}, key = {:?} }}\n", cert, key),
    )
    .unwrap();
    let a = Proc::spawn_env(
        "gateway-a",
        &[
            "gateway",
            "--listen",
            "127.0.0.1:0",
            "--upstream",
            &upstream.url,
            "--data-dir",
            dir.path().join("a").to_str().unwrap(),
            "--config",
            cfg_a.to_str().unwrap(),
        ],
        &[],
        "graft gateway listening on",
        None,
    );
    assert!(a.url.starts_with("https://"), "{}", a.url);
    let a_url = a.url.replace("127.0.0.1", "localhost");

    // A real TLS client that trusts only our CA.
    let mut roots = rustls::RootCertStore::empty();
    roots.add(ca.cert.der().clone()).unwrap();
    let tls = rustls::ClientConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .unwrap()
    .with_root_certificates(roots)
    .with_no_client_auth();
    let https = hyper_rustls::HttpsConnectorBuilder::new()
        .with_tls_config(tls)
        .https_only()
        .enable_http1()
        .build();
    let client = hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
        .build::<_, Full<Bytes>>(https);
    let req = ::http::Request::post(format!("{a_url}/v1/chat/completions"))
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(
            chat("m", "over tls", false).to_string(),
        )))
        .unwrap();
    let resp = client.request(req).await.unwrap();
    assert_eq!(resp.status(), 200);
    let body: Value =
        serde_json::from_slice(&resp.into_body().collect().await.unwrap().to_bytes()).unwrap();
    assert!(
        body["choices"][0]["message"]["content"]
            .as_str()
            .unwrap()
            .contains("over tls"),
        "{body}"
    );

    // Gateway B in front of A over https with A's CA.
    let cfg_b = dir.path().join("b.toml");
    std::fs::write(&cfg_b, format!("[upstream]\nca_file = {:?}\n", cert)).unwrap();
    let data_b = dir.path().join("b");
    let b = Proc::gateway_with(
        &format!("{a_url}/v1"),
        &data_b,
        &["--config", cfg_b.to_str().unwrap()],
        &[],
    );
    let r = http::post_json(
        &format!("{}/v1/chat/completions", b.url),
        &[],
        &chat("m", "through two", true),
    )
    .await;
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.sse_data().last().map(String::as_str), Some("[DONE]"));
    // Without the CA, B cannot verify A and says so.
    let c = Proc::gateway_with(&format!("{a_url}/v1"), &dir.path().join("c"), &[], &[]);
    let r = http::post_json(
        &format!("{}/v1/chat/completions", c.url),
        &[],
        &chat("m", "untrusted", false),
    )
    .await;
    assert_eq!(r.status, 502, "{}", r.text());
    assert!(
        r.json()["error"]["message"]
            .as_str()
            .unwrap()
            .contains("unreachable"),
        "{}",
        r.text()
    );
    drop((b, c));
    let recs = graft_records(&data_b);
    assert_eq!(recs.len(), 1);
    assert_eq!(recs[0]["upstream"], format!("{a_url}/v1"));
    assert!(
        recs[0]["response"]["choices"][0]["message"]["content"]
            .as_str()
            .unwrap()
            .contains("through two")
    );
}

/// An upstream that speaks Responses and Anthropic Messages gets those calls unchanged:
/// gateway B (passthrough, `upstream.dialects`) in front of gateway A (which translates to
/// the Chat-only scripted upstream). B records the client's dialect with no translation.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn same_dialect_upstreams_get_the_call_unchanged() {
    let dir = tempfile::tempdir().unwrap();
    let upstream = Proc::scripted_upstream(&[]);
    let a = Proc::gateway_with(&upstream.url, &dir.path().join("a"), &[], &[]);
    let cfg_b = dir.path().join("b.toml");
    std::fs::write(
        &cfg_b,
        "[upstream]\ndialects = [\"responses\", \"anthropic_messages\"]\n",
    )
    .unwrap();
    let data_b = dir.path().join("b");
    let b = Proc::gateway_with(&a.url, &data_b, &["--config", cfg_b.to_str().unwrap()], &[]);

    let resp_body =
        json!({"model": "m", "input": "through two", "stream": true, "x_unknown": {"kept": true}});
    let r = http::post_json(&format!("{}/v1/responses", b.url), &[], &resp_body).await;
    assert_eq!(r.status, 200, "{}", r.text());
    let evs = r.sse_data();
    let last: Value = serde_json::from_str(evs.last().unwrap()).unwrap();
    assert_eq!(last["type"], "response.completed", "{evs:?}");
    let msg_body = json!({"model": "c", "max_tokens": 50, "messages": [{"role": "user", "content": "hello anthropic"}]});
    let m = http::post_json(&format!("{}/v1/messages", b.url), &[], &msg_body).await;
    assert_eq!(m.status, 200, "{}", m.text());
    assert!(
        m.json()["content"][0]["text"]
            .as_str()
            .unwrap()
            .contains("hello anthropic")
    );
    drop((b, a));

    let recs = graft_records(&data_b);
    assert_eq!(recs.len(), 2, "{recs:?}");
    let r0 = &recs[0];
    assert_eq!(r0["dialect"], "responses");
    assert_eq!(
        r0["request"], resp_body,
        "the client's request as sent, unknown fields kept"
    );
    assert!(
        r0["upstream_request"].is_null(),
        "passthrough: nothing translated"
    );
    assert_eq!(
        r0["normalized_request"]["messages"][0]["content"][0]["text"],
        "through two"
    );
    assert_eq!(
        r0["response"]["status"], "completed",
        "the tee assembled the Responses stream"
    );
    assert!(
        r0["response"]["output"][0]["content"][0]["text"]
            .as_str()
            .unwrap()
            .contains("through two"),
        "{}",
        r0["response"]
    );
    let r1 = &recs[1];
    assert_eq!(r1["dialect"], "anthropic_messages");
    assert!(r1["upstream_request"].is_null());
    assert_eq!(r1["response"]["type"], "message");
    // A, behind it, translated both.
    let recs_a = graft_records(&dir.path().join("a"));
    assert!(
        recs_a
            .iter()
            .all(|r| r["upstream_dialect"] == "chat_completions"),
        "{recs_a:?}"
    );
}

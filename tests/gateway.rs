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
    // (a session made by the session API takes its own key, also when named.)
    let by_header = http::post_json(
        &format!("{base}/v1/chat/completions"),
        &[
            ("x-graft-session", &id),
            ("authorization", &format!("Bearer {key}")),
        ],
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
        &[("authorization", &format!("Bearer {key}"))],
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

/// Closed by default: beyond loopback the gateway refuses to start without an admin key
/// (saying how to set one); with one, every admin route needs it (401 in the caller's
/// dialect), model calls need a key too (also into a session named in the URL), and a
/// session's own key reaches only its own calls: not other sessions, rewards or backends.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn beyond_loopback_the_admin_surface_is_closed_by_default() {
    let dir = tempfile::tempdir().unwrap();
    let upstream = Proc::scripted_upstream(&[]);
    let data = dir.path().join("data");
    let data_s = data.to_str().unwrap();
    let beyond = [
        "gateway",
        "--listen",
        "0.0.0.0:0",
        "--upstream",
        upstream.url.as_str(),
        "--data-dir",
        data_s,
    ];

    // 1. No key: refused, with the reason and the way out; nothing listens.
    let out = std::process::Command::new(common::graft_bin())
        .args(beyond)
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("0.0.0.0:0")
            && err.contains("auth.admin_key")
            && err.contains("GRAFT_ADMIN_KEY")
            && err.contains("--insecure-open-admin"),
        "{err}"
    );
    assert!(
        out.stdout.is_empty(),
        "{}",
        String::from_utf8_lossy(&out.stdout)
    );

    // 2. With a key.
    let admin_key = "admin-key-7f3a9c1e5b";
    let config = dir.path().join("graft.toml");
    std::fs::write(
        &config,
        "[auth]\nadmin_key = \"env::GRAFT_TEST_ADMIN_KEY\"\n",
    )
    .unwrap();
    let mut args = beyond.to_vec();
    args.extend(["--config", config.to_str().unwrap()]);
    let mut gw = Proc::spawn_env(
        "gateway",
        &args,
        &[("GRAFT_TEST_ADMIN_KEY", admin_key)],
        "graft gateway listening on",
        None,
    );
    let base = gw.url.clone();
    let admin_h = format!("Bearer {admin_key}");
    let admin = [("authorization", admin_h.as_str())];
    let mut sessions = vec![];
    for g in ["ga", "gb"] {
        let r = http::post_json(
            &format!("{base}/graft/sessions"),
            &admin,
            &json!({"group_id": g}),
        )
        .await;
        assert_eq!(r.status, 201, "{}", r.text());
        let v = r.json();
        sessions.push((
            v["session_id"].as_str().unwrap().to_string(),
            v["api_key"].as_str().unwrap().to_string(),
        ));
    }
    let (a, a_key) = sessions[0].clone();
    let (b, b_key) = sessions[1].clone();
    let a_h = format!("Bearer {a_key}");
    let a_auth = [("authorization", a_h.as_str())];
    let admin_routes: Vec<(&str, String)> = vec![
        ("GET", "/graft/sessions".into()),
        ("POST", "/graft/sessions".into()),
        ("GET", format!("/graft/sessions/{b}")),
        ("POST", format!("/graft/sessions/{a}/reward")),
        ("POST", format!("/graft/sessions/{b}/reward")),
        ("POST", format!("/graft/sessions/{a}/calls/1/reward")),
        ("POST", format!("/graft/sessions/{b}/calls/1/reward")),
        ("POST", format!("/graft/sessions/{b}/close")),
        ("POST", "/graft/backend/pause".into()),
        ("POST", "/graft/backend/resume".into()),
        ("GET", "/graft/backend/status".into()),
        ("GET", "/ui".into()),
        ("GET", "/ui/groups".into()),
        ("GET", format!("/ui/session/{b}")),
    ];
    let reward = br#"{"reward": 1.0}"#.to_vec();
    for (method, path) in &admin_routes {
        let url = format!("{base}{path}");
        // No key, a wrong key: 401 in the route's dialect (OpenAI's JSON for the admin API,
        // a viewer page for /ui, which browsers read), the wrong key not echoed.
        let page = path.starts_with("/ui");
        for headers in [vec![], vec![("authorization", "Bearer not-the-admin-key")]] {
            let r = http::send(method, &url, &headers, reward.clone())
                .await
                .unwrap();
            assert_eq!(r.status, 401, "{method} {path}: {}", r.text());
            if page {
                assert!(r.header("content-type").unwrap().starts_with("text/html"));
                assert!(r.text().contains("admin key"), "{}", r.text());
            } else {
                let v = r.json();
                assert_eq!(v["error"]["type"], "authentication_error", "{v}");
            }
            assert!(r.header("www-authenticate").is_some());
            assert!(!r.text().contains("not-the-admin-key"), "{}", r.text());
        }
        // A session's own key: 403, never the admin API.
        let r = http::send(method, &url, &a_auth, reward.clone())
            .await
            .unwrap();
        assert_eq!(r.status, 403, "{method} {path}: {}", r.text());
        if page {
            assert!(
                r.text().contains("not open to session keys"),
                "{}",
                r.text()
            );
        } else {
            assert_eq!(r.json()["error"]["type"], "permission_error");
        }
    }
    // Nothing above touched the sessions.
    let listed = http::get(&format!("{base}/graft/sessions"), &admin).await;
    assert_eq!(listed.status, 200);
    for s in listed.json()["sessions"].as_array().unwrap() {
        assert!(
            s["reward"].is_null() && s["call_rewards"] == 0 && s["closed"] != true,
            "{s}"
        );
    }
    assert!(!listed.text().contains(&a_key) && !listed.text().contains(&b_key));

    // Model calls: no key is 401 also into a session named in the URL; OpenAI's body on
    // /v1/chat/completions, Anthropic's on /v1/messages.
    for path in [
        "/v1/chat/completions".to_string(),
        format!("/s/{a}/v1/chat/completions"),
    ] {
        let r = http::send_bare(
            "POST",
            &format!("{base}{path}"),
            &[],
            chat("m", "hi", false).to_string().into_bytes(),
        )
        .await
        .unwrap();
        assert_eq!(r.status, 401, "{path}: {}", r.text());
        assert_eq!(r.json()["error"]["type"], "authentication_error");
    }
    let r = http::send_bare(
        "POST",
        &format!("{base}/s/{a}/v1/messages"),
        &[("anthropic-version", "2023-06-01")],
        json!({"model": "m", "max_tokens": 16, "messages": [{"role": "user", "content": "hi"}]})
            .to_string()
            .into_bytes(),
    )
    .await
    .unwrap();
    assert_eq!(r.status, 401, "{}", r.text());
    let v = r.json();
    assert_eq!(v["type"], "error", "{v}");
    assert_eq!(v["error"]["type"], "authentication_error", "{v}");
    // A's key into B's session: 403; into its own: answered and recorded.
    let r = http::post_json(
        &format!("{base}/s/{b}/v1/chat/completions"),
        &a_auth,
        &chat("m", "hi", false),
    )
    .await;
    assert_eq!(r.status, 403, "{}", r.text());
    let r = http::post_json(
        &format!("{base}/s/{a}/v1/chat/completions"),
        &a_auth,
        &chat("m", "hi", false),
    )
    .await;
    assert_eq!(r.status, 200, "{}", r.text());
    // The viewer with the admin key: the session's page, no key in it.
    let page = http::get(&format!("{base}/ui/session/{a}"), &admin).await;
    assert_eq!(page.status, 200, "{}", page.text());
    assert!(
        page.header("content-type")
            .unwrap()
            .starts_with("text/html")
    );
    assert!(page.text().contains(&a) && page.text().contains("call-1"));
    let listing = http::get(&format!("{base}/ui/"), &admin).await;
    assert_eq!(listing.status, 200, "{}", listing.text());
    for body in [page.text(), listing.text()] {
        for secret in [admin_key, a_key.as_str(), b_key.as_str()] {
            assert!(!body.contains(secret), "a key is on a page");
        }
    }
    // The admin key does what the session key could not.
    let r = http::post_json(
        &format!("{base}/graft/sessions/{a}/reward"),
        &admin,
        &json!({"reward": 0.5}),
    )
    .await;
    assert_eq!(r.status, 200, "{}", r.text());
    gw.stop();
    let log = gw.stderr();
    for secret in [admin_key, a_key.as_str(), b_key.as_str()] {
        assert!(
            !log.contains(secret),
            "a key is in the gateway's log:\n{log}"
        );
    }
    let recs = graft_records(&data);
    assert_eq!(recs.len(), 1, "{recs:?}");
    assert_eq!(recs[0]["session_id"], a.as_str());
    assert!(!serde_json::to_string(&recs).unwrap().contains(&a_key));

    // 3. The loud opt-out starts without a key; model calls still need one there.
    let mut args = beyond.to_vec();
    let data2 = dir.path().join("data2");
    args[6] = data2.to_str().unwrap();
    args.push("--insecure-open-admin");
    let open = Proc::spawn_env("gateway", &args, &[], "graft gateway listening on", None);
    let r = http::post_json(
        &format!("{}/v1/chat/completions", open.url),
        &[],
        &chat("m", "hi", false),
    )
    .await;
    assert_eq!(r.status, 401, "{}", r.text());
}

/// Claude Code sends `HEAD <base url>` (the session root) before its first call: the roots
/// a client may probe answer 200, record nothing, and a wrong method on them is still a 404.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connectivity_probes_on_the_base_url_answer_200_and_record_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let upstream = Proc::scripted_upstream(&[]);
    let gw = Proc::gateway_with(&upstream.url, &data, &[], &[]);
    let base = gw.url.clone();
    for path in ["/s/probe-1", "/s/probe-1/", "/s/probe-1/v1", "/v1", "/"] {
        for method in ["HEAD", "GET"] {
            let r = http::send(method, &format!("{base}{path}"), &[], vec![])
                .await
                .unwrap();
            assert_eq!(r.status, 200, "{method} {path}: {}", r.text());
        }
    }
    let r = http::send("POST", &format!("{base}/s/probe-1/api/show"), &[], vec![])
        .await
        .unwrap();
    assert_eq!(r.status, 404, "{}", r.text());
    assert_eq!(r.json()["error"]["code"], "unknown_route");
    drop(gw);
    assert!(graft_records(&data).is_empty());
}

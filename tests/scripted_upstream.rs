//! The scripted upstream on its own, over real HTTP: wire framing, faults, auth, and every
//! real client straight against it (so a failure in tests/clients.rs can be told apart:
//! client + script fine here means the gateway is at fault there).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use common::{Proc, Target, TestEnv, http, scripted_content};
use serde_json::{Value, json};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

fn chat(model: &str, text: &str, stream: bool) -> Value {
    json!({"model": model, "stream": stream, "stream_options": {"include_usage": true},
           "messages": [{"role": "user", "content": text}]})
}

/// Sends one HTTP/1.1 request on a raw socket and returns everything the server sent until
/// it closed the connection (`Connection: close`), with whether the read ended in an error.
async fn raw_exchange(authority: &str, path: &str, body: &Value) -> (Vec<u8>, bool) {
    let mut s = tokio::net::TcpStream::connect(authority).await.unwrap();
    let body = body.to_string();
    let req = format!(
        "POST {path} HTTP/1.1\r\nHost: {authority}\r\nContent-Type: application/json\r\nConnection: close\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    );
    s.write_all(req.as_bytes()).await.unwrap();
    let mut out = Vec::new();
    let mut buf = [0u8; 8192];
    loop {
        match tokio::time::timeout(std::time::Duration::from_secs(30), s.read(&mut buf)).await {
            Ok(Ok(0)) => return (out, false),
            Ok(Ok(n)) => out.extend_from_slice(&buf[..n]),
            Ok(Err(_)) => return (out, true),
            Err(_) => panic!(
                "no end of response within 30 s: {}",
                String::from_utf8_lossy(&out)
            ),
        }
    }
}

/// Splits a chunked body into its chunks; `complete` is whether the terminating
/// zero-length chunk arrived.
fn dechunk(raw: &[u8]) -> (Vec<String>, bool) {
    let text = String::from_utf8_lossy(raw).into_owned();
    let (head, mut rest) = text.split_once("\r\n\r\n").unwrap();
    assert!(
        head.to_ascii_lowercase()
            .contains("transfer-encoding: chunked"),
        "{head}"
    );
    let mut chunks = Vec::new();
    loop {
        let Some((size, after)) = rest.split_once("\r\n") else {
            return (chunks, false);
        };
        let size = usize::from_str_radix(size.trim(), 16).unwrap();
        if size == 0 {
            return (chunks, true);
        }
        if after.len() < size + 2 {
            return (chunks, false);
        }
        chunks.push(after[..size].to_owned());
        rest = &after[size + 2..];
    }
}

#[tokio::test]
async fn each_sse_event_is_its_own_http_chunk_and_the_stream_ends_cleanly() {
    let up = Proc::scripted_upstream(&["--script", common::script_path().to_str().unwrap()]);
    let body = json!({"model": "scripted", "stream": true, "stream_options": {"include_usage": true},
        "tools": [{"type": "function", "function": {"name": "bash", "parameters": {}}}],
        "messages": [{"role": "user", "content": "graft-tool-call please"}]});
    let (raw, errored) = raw_exchange(up.authority(), "/v1/chat/completions", &body).await;
    assert!(!errored);
    let (chunks, complete) = dechunk(&raw);
    assert!(complete, "terminating chunk missing");
    assert!(chunks.len() > 8, "{chunks:?}");
    for c in &chunks {
        assert!(
            c.starts_with("data: ") && c.ends_with("\n\n") && c.matches("data: ").count() == 1,
            "one event per chunk: {c:?}"
        );
    }
    assert_eq!(chunks.last().unwrap(), "data: [DONE]\n\n");
    let usage: Value =
        serde_json::from_str(chunks[chunks.len() - 2].trim_start_matches("data: ").trim()).unwrap();
    assert_eq!(usage["choices"], json!([]));
    assert!(usage["usage"]["total_tokens"].as_u64().unwrap() > 0);
}

#[tokio::test]
async fn fault_reset_sends_two_chunks_then_drops_the_connection() {
    let up = Proc::scripted_upstream(&[]);
    let (raw, _) = raw_exchange(
        up.authority(),
        "/v1/chat/completions",
        &chat("fault-reset", "one two three four", true),
    )
    .await;
    let (chunks, complete) = dechunk(&raw);
    assert!(
        !complete,
        "a reset stream must not end with the terminating chunk: {}",
        String::from_utf8_lossy(&raw)
    );
    assert_eq!(chunks.len(), 2, "{chunks:?}");
    // A real client sees a transport error, streaming or not.
    let url = format!("{}/v1/chat/completions", up.url);
    assert!(
        http::try_post_json(&url, &[], &chat("fault-reset", "x", true))
            .await
            .is_err()
    );
    assert!(
        http::try_post_json(&url, &[], &chat("fault-reset", "x", false))
            .await
            .is_err()
    );
}

#[tokio::test]
async fn faults_auth_and_routes_answer_like_openai() {
    let up = Proc::scripted_upstream(&["--expect-key", "sk-up"]);
    let url = format!("{}/v1/chat/completions", up.url);
    let key = [("authorization", "Bearer sk-up")];

    let r = http::post_json(&url, &[], &chat("scripted", "hi", false)).await;
    assert_eq!(r.status, 401);
    assert_eq!(r.json()["error"]["code"], "invalid_api_key");
    let r = http::post_json(
        &url,
        &[("authorization", "Bearer nope")],
        &chat("scripted", "hi", false),
    )
    .await;
    assert_eq!(r.status, 401);

    let r = http::post_json(&url, &key, &chat("scripted", "hi there", false)).await;
    assert_eq!(r.status, 200, "{}", r.text());
    let v = r.json();
    assert_eq!(v["object"], "chat.completion");
    assert_eq!(v["model"], "scripted");
    assert_eq!(v["choices"][0]["message"]["content"], "You said: hi there");
    assert_eq!(
        v["usage"],
        json!({"prompt_tokens": 2, "completion_tokens": 4, "total_tokens": 6})
    );

    let r = http::post_json(&url, &key, &chat("fault-500", "x", false)).await;
    assert_eq!(r.status, 500);
    assert_eq!(r.json()["error"]["type"], "server_error");

    let r = http::post_json(&url, &key, &chat("fault-garbage", "x", false)).await;
    assert_eq!(r.status, 200);
    assert_eq!(
        r.header("content-type").as_deref(),
        Some("application/json")
    );
    assert!(
        serde_json::from_slice::<Value>(&r.body).is_err(),
        "{}",
        r.text()
    );
    let r = http::post_json(&url, &key, &chat("fault-garbage", "x", true)).await;
    assert_eq!(r.status, 200);
    assert!(r.sse_data().is_empty(), "garbage is not SSE: {}", r.text());

    let r = http::post_json(&url, &key, &chat("fault-slow", "a b", true)).await;
    assert_eq!(r.sse_data().last().map(String::as_str), Some("[DONE]"));

    let r = http::get(&format!("{}/v1/models", up.url), &key).await;
    assert_eq!(r.status, 200);
    let ids: Vec<Value> = r.json()["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["id"].clone())
        .collect();
    assert!(ids.contains(&json!("scripted")), "{ids:?}");

    let r = http::post_json(&format!("{}/v1/embeddings", up.url), &key, &json!({})).await;
    assert_eq!(r.status, 404);
    let r = http::post_raw(&url, &key, b"{not json".to_vec()).await;
    assert_eq!(r.status, 400);
    assert_eq!(r.json()["error"]["type"], "invalid_request_error");
}

#[test]
fn every_real_client_works_against_the_scripted_upstream_directly() {
    let env = TestEnv::get();
    let up = Proc::scripted_upstream(&["--script", common::script_path().to_str().unwrap()]);
    let target = Target {
        base_url: format!("{}/v1", up.url),
        session_header: None,
        api_key: "sk-direct".to_owned(),
        model: "scripted".to_owned(),
    };

    let out = env.py_client("openai_sdk.py", &["chat"], &target);
    assert_eq!(out["content"], "You said: graft-chat: hello there");
    let out = env.py_client("openai_sdk.py", &["chat-stream-tools"], &target);
    assert_eq!(out["content"], scripted_content("graft-tool-call"));
    assert_eq!(
        out["tool_calls"][0]["arguments"],
        r#"{"command":"ls -la /workspace"}"#
    );
    assert_eq!(
        out["usage"]["total_tokens"].as_u64().map(|t| t > 0),
        Some(true)
    );
    let out = env.py_client("openai_sdk.py", &["completions"], &target);
    assert_eq!(out["content"], scripted_content("graft-completion"));
    let out = env.node_client("openai_chat_stream.cjs", &target);
    assert_eq!(
        out["content"],
        "You said: graft-node: streaming hello from node"
    );
    for mode in ["chat", "chat-stream"] {
        let out = env.py_client("litellm_client.py", &[mode], &target);
        assert_eq!(
            out["content"], "You said: graft-litellm: hello from litellm",
            "{mode}"
        );
    }
    let out = env.py_client("mini_swe_agent.py", &[], &target);
    assert_eq!(out["exit_status"], "Submitted", "{out:#}");
    assert_eq!(out["model_calls"], 2, "{out:#}");
    let out = env.aider_client(&target);
    assert_eq!(out["changed"], true, "{out:#}");
}

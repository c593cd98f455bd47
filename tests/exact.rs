//! Exact mode (`graft gateway --mode exact`): the gateway renders and tokenizes prompts with
//! the real Qwen3 chat template and tokenizer, calls the scripted upstream's SGLang-native
//! `/generate` with `input_ids` (it tokenizes its scripted replies with the same tokenizer
//! and reports per-token logprobs), and answers each client in its own dialect. The records
//! must hold exactly the ids the backend produced, a session's later prompts must contain the
//! earlier sampled ids verbatim even though Qwen3 rewrites history (it drops old `<think>`
//! blocks), and `graft reconstruct` must merge each session into one sample with no drift.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::path::{Path, PathBuf};

use common::{Proc, Stack, TestEnv, f32s, http, ids, logprob};
use graft_reconstruct::exact::PromptBuilder;
use graft_reconstruct::retokenize::Model;
use graft_reconstruct::sample::read_samples_parquet;
use graft_reconstruct::template::Tokenizer;
use serde_json::{Value, json};

fn tools() -> Value {
    json!([{"type": "function", "function": {"name": "bash", "description": "Run a shell command",
        "parameters": {"type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]}}}])
}

const SCRIPT: &str = r#"{"rules": [
  {"role": "tool", "reply": {"reasoning": "The listing is in.", "content": "The directory holds a.txt and b.txt."}},
  {"match": "list the files", "reply": {"reasoning": "I need to look at the directory.", "content": "Let me look.", "tool_calls": [{"name": "bash", "arguments": {"command": "ls -la"}}]}},
  {"match": "and count them", "reply": {"reasoning": "Two files were listed.", "content": "There are 2 files."}},
  {"match": "tell a long story", "reply": {"content": "Once upon a time there was a gateway that recorded every single token the policy sampled, and the researchers who trained on them never again wondered what the model had really seen."}}
]}"#;

/// What the scripted Qwen3 "generated" for a turn: `<think>` reasoning, content, Hermes tool
/// calls, `<|im_end|>`.
fn generated(reasoning: &str, content: &str, calls: &[(&str, &str)]) -> String {
    let mut out = format!("<think>\n{reasoning}\n</think>\n\n{content}");
    for (name, args) in calls {
        out.push_str(&format!(
            "\n<tool_call>\n{{\"name\": \"{name}\", \"arguments\": {args}}}\n</tool_call>"
        ));
    }
    out + "<|im_end|>"
}

struct Setup {
    gateway: Proc,
    upstream: Proc,
    data: PathBuf,
    qwen3: PathBuf,
    dir: tempfile::TempDir,
}

fn start(script: &str, upstream_args: &[&str], gateway_args: &[&str]) -> Setup {
    start_model(
        &TestEnv::get().qwen3_dir(),
        script,
        upstream_args,
        gateway_args,
    )
}

/// [`start`] with another model dir (`qwen3` in the setup is then that dir).
fn start_model(model: &Path, script: &str, upstream_args: &[&str], gateway_args: &[&str]) -> Setup {
    let qwen3 = model.to_path_buf();
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let script_path = dir.path().join("script.json");
    std::fs::write(&script_path, script).unwrap();
    let q = qwen3.to_str().unwrap();
    let mut up = vec!["--script", script_path.to_str().unwrap(), "--tokenizer", q];
    up.extend_from_slice(upstream_args);
    let upstream = Proc::scripted_upstream(&up);
    let mut gw = vec!["--mode", "exact", "--model-dir", q];
    gw.extend_from_slice(gateway_args);
    let gateway = Proc::gateway_with(&upstream.url, &data, &gw, &[]);
    Setup {
        gateway,
        upstream,
        data,
        qwen3,
        dir,
    }
}

/// One three-call session: a tool call, the answer to its result, then a second user turn
/// (where Qwen3's template drops the earlier `<think>` blocks). The client echoes each answer
/// back WITHOUT its reasoning, as most clients do. Returns the session id.
async fn session(gw: &str, stream: bool) -> String {
    let (sid, base) = common::open_session(gw).await;
    let mut messages = vec![
        json!({"role": "system", "content": "You run shell commands."}),
        json!({"role": "user", "content": "list the files please"}),
    ];
    let expect = [
        ("I need to look at the directory.", "Let me look.", true),
        (
            "The listing is in.",
            "The directory holds a.txt and b.txt.",
            false,
        ),
        ("Two files were listed.", "There are 2 files.", false),
    ];
    for (turn, (reasoning, content, tool)) in expect.iter().enumerate() {
        let mut body = json!({"model": "qwen3", "tools": tools(), "messages": messages});
        if stream {
            body["stream"] = json!(true);
            body["stream_options"] = json!({"include_usage": true});
        }
        let r = http::post_json(&format!("{base}/chat/completions"), &[], &body).await;
        assert_eq!(r.status, 200, "{}", r.text());
        let msg = if stream {
            let data = r.sse_data();
            assert_eq!(data.last().map(String::as_str), Some("[DONE]"));
            let chunks: Vec<Value> = data[..data.len() - 1]
                .iter()
                .map(|d| serde_json::from_str(d).unwrap())
                .collect();
            assert!(chunks.len() > 4, "streamed in several chunks: {chunks:#?}");
            let usage = &chunks.last().unwrap()["usage"];
            assert!(usage["completion_tokens"].as_u64().unwrap() > 5, "{usage}");
            common::assemble_chat(&chunks)
        } else {
            let v = r.json();
            assert_eq!(v["object"], "chat.completion");
            v["choices"][0]["message"].clone()
        };
        assert_eq!(msg["content"], *content, "turn {turn}: {msg}");
        assert_eq!(msg["reasoning_content"], *reasoning, "turn {turn}: {msg}");
        let mut echo = msg.clone();
        echo.as_object_mut().unwrap().remove("reasoning_content");
        messages.push(echo);
        if *tool {
            let call = &msg["tool_calls"][0];
            assert_eq!(call["function"]["name"], "bash", "{msg}");
            assert_eq!(
                serde_json::from_str::<Value>(call["function"]["arguments"].as_str().unwrap())
                    .unwrap(),
                json!({"command": "ls -la"})
            );
            messages.push(
                json!({"role": "tool", "tool_call_id": call["id"], "content": "a.txt b.txt"}),
            );
        } else if turn == 1 {
            messages.push(json!({"role": "user", "content": "and count them"}));
        }
    }
    sid
}

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

/// Checks a session's records (seq order) against what the backend produced, and that each
/// prompt holds the previous prompt and completion verbatim. Returns the records.
fn check_session_records(records: &[Value], sid: &str, tok: &Tokenizer) -> Vec<Value> {
    let mut recs: Vec<Value> = records
        .iter()
        .filter(|r| r["session_id"] == sid)
        .cloned()
        .collect();
    recs.sort_by_key(|r| r["seq"].as_u64().unwrap());
    for r in &recs {
        assert_eq!(r["outcome"], "ok", "{r:#}");
        assert_eq!(r["upstream_dialect"], "sglang_generate", "{r:#}");
        assert_eq!(r["weight_version"], "default", "{r:#}");
        assert_eq!(r["backend_finish_reason"], "stop", "{r:#}");
        let up = &r["upstream_request"];
        assert_eq!(up["return_logprob"], true, "{up}");
        assert!(
            up.get("input_ids").is_none(),
            "ids live in prompt_token_ids: {up}"
        );
        let completion = ids(&r["completion_token_ids"]);
        let lps = f32s(&r["completion_logprobs"]);
        assert_eq!(
            lps,
            completion.iter().map(|&i| logprob(i)).collect::<Vec<_>>()
        );
        assert_eq!(
            r["usage"]["completion_tokens"].as_u64(),
            Some(completion.len() as u64)
        );
        assert!(
            tok.decode(&completion).unwrap().starts_with("<think>\n"),
            "{r:#}"
        );
    }
    for w in recs.windows(2) {
        let mut sampled = ids(&w[0]["prompt_token_ids"]);
        sampled.extend(ids(&w[0]["completion_token_ids"]));
        let next = ids(&w[1]["prompt_token_ids"]);
        assert!(
            next.starts_with(&sampled),
            "call {} does not start with call {}'s prompt + completion",
            w[1]["seq"],
            w[0]["seq"]
        );
        assert_eq!(
            w[1]["upstream_request"]["graft_prompt"]["reused_tokens"].as_u64(),
            Some(sampled.len() as u64)
        );
    }
    recs
}

/// The trained tokens of each sample are exactly the sampled ones, with their logprobs.
fn check_samples(out: &Path, records: &[Value]) {
    for x in read_samples_parquet(out).unwrap() {
        let mut recs: Vec<&Value> = records
            .iter()
            .filter(|r| r["session_id"] == x.session_id)
            .collect();
        recs.sort_by_key(|r| r["seq"].as_u64().unwrap());
        let mut want_ids = vec![];
        let mut want_lps = vec![];
        for r in &recs {
            want_ids.extend(ids(&r["completion_token_ids"]));
            want_lps.extend(f32s(&r["completion_logprobs"]).into_iter().map(Some));
        }
        let (got_ids, got_lps): (Vec<u32>, Vec<Option<f32>>) = x
            .tokens
            .iter()
            .zip(&x.loss_mask)
            .zip(&x.logprobs)
            .filter(|((_, m), _)| **m == 1)
            .map(|((t, _), l)| (*t, *l))
            .unzip();
        assert_eq!(got_ids, want_ids, "session {}", x.session_id);
        assert_eq!(got_lps, want_lps, "session {}", x.session_id);
        assert_eq!(x.fork_reason, None, "session {}", x.session_id);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn exact_chat_sessions_keep_sampled_tokens_through_qwen3_history_rewrites() {
    let s = start(SCRIPT, &[], &[]);
    let gw = s.gateway.url.clone();
    let json_sid = session(&gw, false).await;
    let sse_sid = session(&gw, true).await;

    let tok = Tokenizer::from_dir(&s.qwen3).unwrap();
    let records = common::records_show(&s.data);
    for sid in [&json_sid, &sse_sid] {
        let recs = check_session_records(&records, sid, &tok);
        assert_eq!(recs.len(), 3, "{records:#?}");
        // The backend produced exactly the scripted model's output, think blocks included.
        let texts: Vec<String> = recs
            .iter()
            .map(|r| tok.decode(&ids(&r["completion_token_ids"])).unwrap())
            .collect();
        assert_eq!(
            texts[0],
            generated(
                "I need to look at the directory.",
                "Let me look.",
                &[("bash", r#"{"command":"ls -la"}"#)]
            )
        );
        assert_eq!(
            texts[2],
            generated("Two files were listed.", "There are 2 files.", &[])
        );
        // Without reuse the third prompt would drift: Qwen3's own rendering of the
        // conversation drops the earlier `<think>` blocks the model sampled.
        let builder = PromptBuilder::new(Model::from_dir(&s.qwen3).unwrap());
        let msgs = graft_reconstruct::exact::template_messages(
            recs[2]["request"]["messages"].as_array().unwrap(),
        );
        let full = builder
            .full(&msgs, Some(tools().as_array().unwrap()))
            .unwrap();
        let mut sampled = ids(&recs[1]["prompt_token_ids"]);
        sampled.extend(ids(&recs[1]["completion_token_ids"]));
        assert!(
            !full.ids.starts_with(&sampled),
            "the template rewrites history"
        );
        assert!(ids(&recs[2]["prompt_token_ids"]).starts_with(&sampled));
    }
    drop(s.gateway);
    drop(s.upstream);

    let out = s.dir.path().join("samples.parquet");
    let summary = reconstruct(&s.data, &s.qwen3, &out);
    assert_eq!(summary["exact_calls"], 6, "{summary}");
    assert_eq!(summary["retokenized_calls"], 0, "{summary}");
    assert_eq!(summary["samples"], 2, "one sample per session: {summary}");
    assert_eq!(summary["drift_events"], 0, "{summary}");
    check_samples(&out, &common::records_show(&s.data));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn exact_streaming_sends_tokens_while_the_backend_is_still_generating() {
    // 300 ms between the backend's events: the answer takes several seconds to generate.
    let s = start(SCRIPT, &["--chunk-delay-ms", "300"], &[]);
    let (sid, base) = common::open_session(&s.gateway.url).await;
    let body = json!({"model": "qwen3", "stream": true,
        // Not thinking: the first tokens are the answer's content.
        "chat_template_kwargs": {"enable_thinking": false},
        "messages": [{"role": "user", "content": "tell a long story"}]});
    let resp = http::post_stream(&format!("{base}/chat/completions"), &body).await;
    assert_eq!(resp.status(), 200);
    let mut body = resp.into_body();
    let mut buf = String::new();
    let mut text = String::new();
    // Read until the first piece of content.
    chat_content(&mut body, &mut buf, &mut text, true).await;
    // The backend has not finished: the gateway's call to it is still open and nothing is
    // recorded yet.
    let metrics = http::get(&format!("{}/metrics", s.gateway.url), &[])
        .await
        .text();
    assert!(
        metrics.lines().any(|l| l == "graft_upstream_inflight 1"),
        "the backend call should still be in flight:\n{metrics}"
    );
    assert!(common::records_show(&s.data).is_empty());
    chat_content(&mut body, &mut buf, &mut text, false).await;
    assert!(
        text.starts_with("Once upon a time") && text.ends_with("really seen."),
        "{text}"
    );
    let recs = common::records_show(&s.data);
    let rec = recs.iter().find(|r| r["session_id"] == sid).unwrap();
    let tok = Tokenizer::from_dir(&s.qwen3).unwrap();
    assert_eq!(
        tok.decode(&ids(&rec["completion_token_ids"])).unwrap(),
        format!("{text}<|im_end|>")
    );
    assert!(rec["ttft_ms"].as_f64().unwrap() < rec["latency_ms"].as_f64().unwrap());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pause_holds_new_calls_until_resume_and_waits_for_calls_in_flight() {
    let s = start(SCRIPT, &["--chunk-delay-ms", "100"], &[]);
    let gw = s.gateway.url.clone();
    let (sid, base) = common::open_session(&gw).await;
    let story = json!({"model": "qwen3", "stream": true,
        // Not thinking: the first tokens are the answer's content.
        "chat_template_kwargs": {"enable_thinking": false},
        "messages": [{"role": "user", "content": "tell a long story"}]});
    // A call in flight: pause must wait for it to finish, not abort it.
    let resp = http::post_stream(&format!("{base}/chat/completions"), &story).await;
    let mut inflight = resp.into_body();
    let mut buf = String::new();
    http::next_sse_data(&mut inflight, &mut buf).await.unwrap();
    let reader = tokio::spawn(async move {
        let mut n = 0;
        while let Some(d) = http::next_sse_data(&mut inflight, &mut buf).await {
            n += 1;
            if d == "[DONE]" {
                return n;
            }
        }
        panic!("the stream in flight ended without [DONE]");
    });
    let paused = http::post_json(&format!("{gw}/graft/backend/pause"), &[], &json!({})).await;
    assert_eq!(paused.status, 200, "{}", paused.text());
    // The call in flight completed and was recorded before pause returned: its record is
    // read now, before anything waits for the stream (the story takes seconds to stream, so
    // a pause that returned early finds no record here).
    let recs = common::records_show(&s.data);
    assert_eq!(
        recs.iter().filter(|r| r["session_id"] == sid).count(),
        1,
        "pause returned before the call in flight was done"
    );
    assert_eq!(recs[0]["outcome"], "ok");
    assert!(
        paused.json()["drained_in_ms"].as_f64().unwrap() > 200.0,
        "{}",
        paused.text()
    );
    assert!(
        reader.await.unwrap() > 1,
        "the stream in flight ended without [DONE]"
    );

    // While paused a new call waits.
    let url = format!("{base}/chat/completions");
    let held = tokio::spawn(async move {
        http::post_json(
            &url,
            &[],
            &json!({"model": "qwen3",
            "messages": [{"role": "user", "content": "hello"}]}),
        )
        .await
    });
    tokio::time::sleep(std::time::Duration::from_millis(1500)).await;
    assert!(
        !held.is_finished(),
        "a call went through while the gateway was paused"
    );
    let status = http::get(&format!("{gw}/graft/backend/status"), &[])
        .await
        .json();
    assert_eq!(status["paused"], true, "{status}");
    let resumed = http::post_json(&format!("{gw}/graft/backend/resume"), &[], &json!({})).await;
    assert_eq!(resumed.json()["was_paused"], true);
    let r = held.await.unwrap();
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(
        r.json()["choices"][0]["message"]["content"],
        "You said: hello"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sessions_are_pinned_to_one_backend_and_bad_calls_get_clear_errors() {
    let env = TestEnv::get();
    let qwen3 = env.qwen3_dir();
    let q = qwen3.to_str().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let script = dir.path().join("script.json");
    std::fs::write(&script, SCRIPT).unwrap();
    let a = Proc::scripted_upstream(&["--script", script.to_str().unwrap(), "--tokenizer", q]);
    let b = Proc::scripted_upstream(&["--script", script.to_str().unwrap(), "--tokenizer", q]);
    let config = dir.path().join("graft.toml");
    std::fs::write(
        &config,
        format!("[exact]\nbackends = [\"{}\", \"{}\"]\n", a.url, b.url),
    )
    .unwrap();
    let data = dir.path().join("data");
    let gw = Proc::gateway_with(
        &a.url,
        &data,
        &[
            "--mode",
            "exact",
            "--model-dir",
            q,
            "--config",
            config.to_str().unwrap(),
        ],
        &[],
    );
    let mut sids = vec![];
    let mut bases = vec![];
    for _ in 0..2 {
        let (sid, base) = common::open_session(&gw.url).await;
        bases.push(base.clone());
        for text in ["hello", "again"] {
            let r = http::post_json(
                &format!("{base}/chat/completions"),
                &[],
                &json!({"model": "qwen3", "messages": [{"role": "user", "content": text}]}),
            )
            .await;
            assert_eq!(r.status, 200, "{}", r.text());
        }
        sids.push(sid);
    }
    let recs = common::records_show(&data);
    let backend_of = |sid: &str| -> Vec<String> {
        recs.iter()
            .filter(|r| r["session_id"] == sid)
            .map(|r| r["upstream"].as_str().unwrap().to_string())
            .collect()
    };
    let (x, y) = (backend_of(&sids[0]), backend_of(&sids[1]));
    assert_eq!(x.len(), 2);
    assert!(
        x.iter().all(|u| *u == x[0]) && y.iter().all(|u| *u == y[0]),
        "{x:?} {y:?}"
    );
    assert_ne!(
        x[0], y[0],
        "two sessions share one backend while the other is idle"
    );

    // Pausing one backend holds only the calls pinned to it.
    let one = json!({"backend": x[0]});
    let r = http::post_json(&format!("{}/graft/backend/pause", gw.url), &[], &one).await;
    assert_eq!(r.status, 200, "{}", r.text());
    let url = format!("{}/chat/completions", bases[0]);
    let held = tokio::spawn(async move {
        http::post_json(
            &url,
            &[],
            &json!({"model": "qwen3", "messages": [{"role": "user", "content": "held"}]}),
        )
        .await
    });
    let other = http::post_json(
        &format!("{}/chat/completions", bases[1]),
        &[],
        &json!({"model": "qwen3", "messages": [{"role": "user", "content": "goes on"}]}),
    )
    .await;
    assert_eq!(other.status, 200, "{}", other.text());
    let status = http::get(&format!("{}/graft/backend/status", gw.url), &[])
        .await
        .json();
    assert_eq!(status["paused_backends"], json!([x[0]]), "{status}");
    // The scripted backend answers in milliseconds: a second is plenty to go through.
    tokio::time::sleep(std::time::Duration::from_millis(1000)).await;
    assert!(
        !held.is_finished(),
        "a call to the paused backend went through"
    );
    let r = http::post_json(&format!("{}/graft/backend/resume", gw.url), &[], &one).await;
    assert_eq!(r.json()["was_paused"], true);
    let r = held.await.unwrap();
    assert_eq!(r.status, 200, "{}", r.text());
    // A backend the gateway does not have: a 400 that lists the ones it has.
    let r = http::post_json(
        &format!("{}/graft/backend/pause", gw.url),
        &[],
        &json!({"backend": "http://127.0.0.1:9"}),
    )
    .await;
    assert_eq!(r.status, 400, "{}", r.text());
    let msg = r.json()["error"]["message"].as_str().unwrap().to_string();
    assert!(
        msg.contains("http://127.0.0.1:9") && msg.contains(&y[0]),
        "{msg}"
    );
    let status = http::get(&format!("{}/graft/backend/status", gw.url), &[])
        .await
        .json();
    assert_eq!(status["paused"], false, "{status}");

    // /v1/completions is served in exact mode (raw text, tokenized as is), but what one
    // choice per call cannot hold is refused with a message naming the field.
    let r = http::post_json(
        &format!("{}/v1/completions", gw.url),
        &[],
        &json!({"model": "qwen3", "prompt": ["one", "two"]}),
    )
    .await;
    assert_eq!(r.status, 400, "{}", r.text());
    assert_eq!(r.json()["error"]["param"], "prompt", "{}", r.text());
    // A negative token limit is refused, not read as "no limit" (which decoded to the end
    // of the context).
    let r = http::post_json(
        &format!("{}/v1/chat/completions", gw.url),
        &[],
        &json!({"model": "qwen3", "max_tokens": -5,
                "messages": [{"role": "user", "content": "hi"}]}),
    )
    .await;
    assert_eq!(r.status, 400, "{}", r.text());
    assert_eq!(r.json()["error"]["param"], "max_tokens", "{}", r.text());
    // Issue 32, hole 5: values the backend would refuse are refused by name before it,
    // in each dialect's own words for the key.
    for (path, body, param) in [
        (
            "/v1/chat/completions",
            json!({"model": "qwen3", "temperature": -1,
                   "messages": [{"role": "user", "content": "hi"}]}),
            "temperature",
        ),
        (
            "/v1/chat/completions",
            json!({"model": "qwen3", "top_p": 0,
                   "messages": [{"role": "user", "content": "hi"}]}),
            "top_p",
        ),
        (
            "/v1/chat/completions",
            json!({"model": "qwen3", "presence_penalty": 3,
                   "messages": [{"role": "user", "content": "hi"}]}),
            "presence_penalty",
        ),
        (
            "/v1/messages",
            json!({"model": "qwen3", "max_tokens": 10, "temperature": -0.5,
                   "messages": [{"role": "user", "content": "hi"}]}),
            "temperature",
        ),
    ] {
        let r = http::post_json(&format!("{}{path}", gw.url), &[], &body).await;
        assert_eq!(r.status, 400, "{}", r.text());
        assert!(r.text().contains(param), "{}", r.text());
    }
    // A backend that is down: a 502 in the client's dialect, recorded; the gateway stays up.
    drop(b);
    drop(a);
    let r = http::post_json(
        &format!("{}/v1/messages", gw.url),
        &[("anthropic-version", "2023-06-01")],
        &json!({"model": "qwen3", "max_tokens": 50, "messages": [{"role": "user", "content": "hi"}]}),
    )
    .await;
    assert_eq!(r.status, 502, "{}", r.text());
    assert_eq!(
        r.json()["type"],
        "error",
        "Anthropic's error shape: {}",
        r.text()
    );
    let health = http::get(&format!("{}/healthz", gw.url), &[]).await;
    assert_eq!(health.status, 200);
}

#[test]
fn mini_swe_agent_in_exact_mode_merges_into_one_sample_with_think_every_turn() {
    let env = TestEnv::get();
    let q = env.qwen3_dir();
    let q = q.to_str().unwrap();
    let stack = Stack::start_with(&["--tokenizer", q], &["--mode", "exact", "--model-dir", q]);
    stack.open_session("mini-exact");
    let out = env.py_client(
        "mini_swe_agent.py",
        &[],
        &stack.target(Some("mini-exact"), None),
    );
    assert_eq!(out["result_txt"], "graft-mini-step-one-done\n", "{out:#}");
    let recs = stack.wait_records("mini-exact", 2);
    let tok = Tokenizer::from_dir(Path::new(q)).unwrap();
    let recs = check_session_records(&recs, "mini-exact", &tok);
    assert_eq!(recs.len(), 2);
    let out_file = stack.dir.path().join("samples.parquet");
    let summary = reconstruct(&stack.data_dir, Path::new(q), &out_file);
    assert_eq!(summary["samples"], 1, "{summary}");
    assert_eq!(summary["drift_events"], 0, "{summary}");
    check_samples(&out_file, &recs);
}

#[test]
fn codex_in_exact_mode_merges_into_one_sample_with_think_every_turn() {
    let env = TestEnv::get();
    let q = env.qwen3_dir();
    let q = q.to_str().unwrap();
    let stack = Stack::start_with(&["--tokenizer", q], &["--mode", "exact", "--model-dir", q]);
    let session = stack.open_session("codex-exact");
    let target = stack.target(Some("codex-exact"), None);
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
    let recs = stack.wait_records("codex-exact", 2);
    let tok = Tokenizer::from_dir(Path::new(q)).unwrap();
    let recs = check_session_records(&recs, "codex-exact", &tok);
    assert!(recs.len() >= 2);
    assert!(
        recs.iter()
            .all(|r| r["dialect"] == "responses" && r["stream"] == true)
    );
    let out_file = stack.dir.path().join("samples.parquet");
    let summary = reconstruct(&stack.data_dir, Path::new(q), &out_file);
    assert_eq!(summary["samples"], 1, "{summary}");
    assert_eq!(summary["drift_events"], 0, "{summary}");
    check_samples(&out_file, &recs);
}

const FAULTS: &str = r#"{"rules": [
  {"match": "graft-fault-500", "fault": "500"},
  {"match": "graft-fault-garbage", "fault": "garbage"},
  {"match": "graft-fault-reset", "fault": "reset", "reply": {"content": "one two three four five six seven eight nine ten eleven twelve"}},
  {"match": "graft-fault-hang", "fault": "hang"},
  {"match": "graft-fault-abort", "fault": "abort", "reply": {"content": "cut short"}},
  {"match": "tell a long story", "reply": {"content": "Once upon a time there was a gateway that recorded every single token the policy sampled, and the researchers who trained on them never again wondered what the model had really seen."}}
]}"#;

fn chat(text: &str, stream: bool) -> Value {
    json!({"model": "qwen3", "stream": stream, "messages": [{"role": "user", "content": text}]})
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn backend_faults_get_clear_errors_in_the_clients_dialect_and_lose_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("graft.toml");
    std::fs::write(&config, "[upstream]\ntimeout_secs = 3\n").unwrap();
    let s = start(
        FAULTS,
        &["--chunk-delay-ms", "50"],
        &["--config", config.to_str().unwrap()],
    );
    let (sid, base) = common::open_session(&s.gateway.url).await;
    let url = format!("{base}/chat/completions");
    // A good call first: it must survive everything after it.
    let ok = http::post_json(&url, &[], &chat("hello", false)).await;
    assert_eq!(ok.status, 200, "{}", ok.text());

    let msg = |r: &http::Resp| {
        r.json()["error"]["message"]
            .as_str()
            .unwrap_or_default()
            .to_string()
    };
    let r = http::post_json(&url, &[], &chat("graft-fault-500", false)).await;
    assert_eq!(r.status, 502, "{}", r.text());
    assert!(
        msg(&r).contains("HTTP 500") && msg(&r).contains("scheduler crashed"),
        "{}",
        r.text()
    );

    // Exact mode streams from the backend even for a whole answer: garbage there is a
    // stream that is not server-sent events.
    let r = http::post_json(&url, &[], &chat("graft-fault-garbage", false)).await;
    assert_eq!(r.status, 502, "{}", r.text());
    assert!(msg(&r).contains("not server-sent events"), "{}", r.text());

    let r = http::post_json(&url, &[], &chat("graft-fault-abort", false)).await;
    assert_eq!(r.status, 502, "{}", r.text());
    assert!(msg(&r).contains("aborted"), "{}", r.text());

    let r = http::post_json(&url, &[], &chat("graft-fault-hang", false)).await;
    assert_eq!(r.status, 504, "{}", r.text());
    assert!(
        msg(&r).contains("did not answer within 3 s"),
        "{}",
        r.text()
    );

    // Streamed garbage: the stream ends with an error event, never with [DONE].
    let r = http::post_json(&url, &[], &chat("graft-fault-garbage", true)).await;
    assert_eq!(r.status, 200);
    let data = r.sse_data();
    assert_ne!(data.last().map(String::as_str), Some("[DONE]"), "{data:?}");
    let last: Value = serde_json::from_str(data.last().unwrap()).unwrap();
    assert!(
        last["error"]["message"]
            .as_str()
            .unwrap()
            .contains("not server-sent events"),
        "{last}"
    );

    // A reset mid-stream, to an Anthropic client: its own `error` event after the text began.
    let r = http::post_json(
        &format!("{base}/messages"),
        &[("anthropic-version", "2023-06-01")],
        &json!({"model": "qwen3", "max_tokens": 100, "stream": true,
                "messages": [{"role": "user", "content": "graft-fault-reset"}]}),
    )
    .await;
    assert_eq!(r.status, 200);
    let text = r.text();
    assert!(text.contains("event: message_start"), "{text}");
    assert!(text.contains("event: error"), "{text}");
    assert!(!text.contains("event: message_stop"), "{text}");

    // A client that goes away mid-stream: recorded as such, with what was generated so far.
    let resp = http::post_stream(&url, &chat("tell a long story", true)).await;
    let mut body = resp.into_body();
    let mut buf = String::new();
    http::next_sse_data(&mut body, &mut buf).await.unwrap();
    drop(body);

    // The gateway is still up and serves.
    let again = http::post_json(&url, &[], &chat("hello again", false)).await;
    assert_eq!(again.status, 200, "{}", again.text());

    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    let recs = loop {
        let recs: Vec<Value> = common::records_show(&s.data)
            .into_iter()
            .filter(|r| r["session_id"] == sid)
            .collect();
        if recs.len() >= 9 || std::time::Instant::now() > deadline {
            break recs;
        }
        tokio::time::sleep(std::time::Duration::from_millis(200)).await;
    };
    assert_eq!(recs.len(), 9, "every call is recorded: {recs:#?}");
    let outcomes: Vec<&str> = recs
        .iter()
        .map(|r| r["outcome"].as_str().unwrap())
        .collect();
    assert_eq!(
        outcomes.iter().filter(|o| **o == "ok").count(),
        2,
        "{outcomes:?}"
    );
    assert!(outcomes.contains(&"client_disconnected"), "{outcomes:?}");
    for r in recs.iter().filter(|r| r["outcome"] != "ok") {
        assert!(r["error"].as_str().is_some_and(|e| !e.is_empty()), "{r:#}");
    }
    // The first call's record is intact.
    let first = recs
        .iter()
        .find(|r| r["request"]["messages"][0]["content"] == "hello")
        .unwrap();
    assert_eq!(first["outcome"], "ok");
    assert!(!ids(&first["completion_token_ids"]).is_empty());
    // The reset stream kept the ids generated before the failure.
    let reset = recs
        .iter()
        .find(|r| r["request"]["messages"][0]["content"] == "graft-fault-reset")
        .unwrap();
    assert!(!ids(&reset["completion_token_ids"]).is_empty(), "{reset:#}");
}

/// Completions in exact mode (a fourth dialect on the same pipeline): the raw prompt is
/// tokenized as it is (no chat template), the answer comes back as `text_completion` to the
/// openai SDK, whole and streamed, and the record holds exactly the ids sent and sampled.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn completions_in_exact_mode_send_the_raw_prompt_ids_through_the_openai_sdk() {
    let s = start(SCRIPT, &[], &[]);
    let (sid, base) = common::open_session(&s.gateway.url).await;
    let target = common::Target {
        base_url: base.clone(),
        session_header: None,
        api_key: common::session_key(&base),
        model: "qwen3".into(),
    };
    let out = tokio::task::spawn_blocking(move || {
        TestEnv::get().py_client("openai_sdk.py", &["completions"], &target)
    })
    .await
    .unwrap();
    let prompt = "graft-completion: Once upon a time";
    assert_eq!(out["object"], "text_completion", "{out:#}");
    assert_eq!(out["content"], format!("You said: {prompt}"), "{out:#}");
    assert_eq!(out["finish_reason"], "stop", "{out:#}");
    let tok = Tokenizer::from_dir(&s.qwen3).unwrap();
    let prompt_ids = tok.encode(prompt).unwrap();
    assert_eq!(out["usage"]["prompt_tokens"], prompt_ids.len(), "{out:#}");

    // Streamed, by hand: text_completion chunks, the finish reason last, then [DONE].
    let r = http::post_json(
        &format!("{base}/completions"),
        &[],
        &json!({"model": "qwen3", "prompt": "say it streamed", "stream": true}),
    )
    .await;
    assert_eq!(r.status, 200, "{}", r.text());
    let data = r.sse_data();
    assert_eq!(data.last().map(String::as_str), Some("[DONE]"), "{data:?}");
    let chunks: Vec<Value> = data[..data.len() - 1]
        .iter()
        .map(|d| serde_json::from_str(d).unwrap())
        .collect();
    assert!(chunks.len() > 2, "{chunks:#?}");
    assert!(
        chunks.iter().all(|c| c["object"] == "text_completion"),
        "{chunks:#?}"
    );
    let text: String = chunks
        .iter()
        .filter_map(|c| c["choices"][0]["text"].as_str())
        .collect();
    assert_eq!(text, "You said: say it streamed");
    assert_eq!(
        chunks
            .iter()
            .rev()
            .find_map(|c| c["choices"][0]["finish_reason"].as_str()),
        Some("stop")
    );

    let recs = common::records_show(&s.data);
    let recs: Vec<&Value> = recs.iter().filter(|r| r["session_id"] == sid).collect();
    assert_eq!(recs.len(), 2);
    for (r, (p, said)) in recs.iter().zip([
        (prompt, out["content"].as_str().unwrap()),
        ("say it streamed", "You said: say it streamed"),
    ]) {
        assert_eq!(r["dialect"], "completions", "{r:#}");
        assert_eq!(r["upstream_dialect"], "sglang_generate");
        assert_eq!(r["outcome"], "ok", "{r:#}");
        // The prompt ids are the raw text's, with no template around them.
        assert_eq!(ids(&r["prompt_token_ids"]), tok.encode(p).unwrap(), "{r:#}");
        let completion = ids(&r["completion_token_ids"]);
        assert_eq!(
            tok.decode(&completion).unwrap(),
            format!("{said}<|im_end|>")
        );
        assert_eq!(
            r["completion_logprobs"].as_array().unwrap().len(),
            completion.len()
        );
    }
}

/// Reads a Chat stream's content deltas into `text`: until some text has come (`first`),
/// else to its end.
async fn chat_content(
    body: &mut hyper::body::Incoming,
    buf: &mut String,
    text: &mut String,
    first: bool,
) {
    while !first || text.is_empty() {
        let Some(d) = http::next_sse_data(body, buf).await else {
            assert!(!first, "the stream ended before any content");
            return;
        };
        if d == "[DONE]" {
            return;
        }
        let c: Value = serde_json::from_str(&d).unwrap();
        text.push_str(
            c["choices"][0]["delta"]["content"]
                .as_str()
                .unwrap_or_default(),
        );
    }
}

/// An outside controller pushes new weights while a call is being generated (SGLang keeps
/// generating; the scripted backend holds the generation after 3 tokens until the update
/// lands): the record keeps both spans, and the sample labels each sampled token with the
/// weights that sampled it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_call_straddling_an_outside_weight_update_is_labelled_per_span() {
    let script = r#"{"rules": [
      {"match": "weights change", "weight_update_after": 3, "reply": {"content": "Partly old weights, partly new ones: both are recorded."}}
    ]}"#;
    let s = start(script, &[], &[]);
    let (sid, base) = common::open_session(&s.gateway.url).await;
    let body = json!({"model": "qwen3", "stream": true,
        // Not thinking: the first tokens are the answer's content.
        "chat_template_kwargs": {"enable_thinking": false},
        "messages": [{"role": "user", "content": "the weights change mid-call"}]});
    let resp = http::post_stream(&format!("{base}/chat/completions"), &body).await;
    assert_eq!(resp.status(), 200);
    let mut body = resp.into_body();
    let mut buf = String::new();
    let mut text = String::new();
    // The first tokens arrived, sampled by the weights being served ("default").
    chat_content(&mut body, &mut buf, &mut text, true).await;
    // The outside controller updates the weights, straight at the backend.
    let up = http::post_json(
        &format!("{}/update_weights_from_disk", s.upstream.url),
        &[],
        &json!({"model_path": "/ckpt/step-7", "weight_version": "step-7"}),
    )
    .await;
    assert_eq!(up.status, 200, "{}", up.text());
    chat_content(&mut body, &mut buf, &mut text, false).await;
    assert_eq!(
        text,
        "Partly old weights, partly new ones: both are recorded."
    );
    let recs = common::records_show(&s.data);
    let rec = recs.iter().find(|r| r["session_id"] == sid).unwrap();
    let n = ids(&rec["completion_token_ids"]).len() as u64;
    assert!(n > 3);
    assert_eq!(rec["weight_version"], "step-7", "{rec:#}");
    assert_eq!(
        rec["weight_version_spans"],
        json!([{"version": "default", "start": 0, "end": 3}, {"version": "step-7", "start": 3, "end": n}]),
        "{rec:#}"
    );

    let out = s.dir.path().join("samples.parquet");
    let summary = reconstruct(&s.data, &s.qwen3, &out);
    assert_eq!(summary["samples"], 1, "{summary}");
    let samples = read_samples_parquet(&out).unwrap();
    let x = &samples[0];
    assert_eq!(x.weight_versions, ["default", "step-7"]);
    let sampled: Vec<Option<&str>> = (0..x.tokens.len())
        .filter(|&i| x.loss_mask[i] == 1)
        .map(|i| x.token_weight_version(i))
        .collect();
    let mut want = vec![Some("default"); 3];
    want.extend(vec![Some("step-7"); n as usize - 3]);
    assert_eq!(sampled, want);
    assert!(
        (0..x.tokens.len())
            .filter(|&i| x.loss_mask[i] == 0)
            .all(|i| x.token_weight_version(i).is_none() && x.logprobs[i].is_none()),
        "prompt tokens have no version and no logprob"
    );
}

/// kill -9 of the gateway between two turns of a session: after the restart (same data
/// dir) the session's token history is rebuilt from its records, so the next prompt still
/// reuses the sampled ids verbatim (`reused_tokens` > 0: without it the client's echo,
/// which drops the reasoning, would render differently) and reconstruct merges the session
/// into one sample without drift.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_session_goes_on_after_kill_9_of_the_gateway_reusing_its_sampled_tokens() {
    let mut s = start(SCRIPT, &[], &[]);
    let (sid, _) = common::open_session(&s.gateway.url).await;
    let chat_url = |gw: &str| format!("{gw}/s/{sid}/v1/chat/completions");
    let mut messages = vec![
        json!({"role": "system", "content": "You run shell commands."}),
        json!({"role": "user", "content": "list the files please"}),
    ];
    let body = json!({"model": "qwen3", "tools": tools(), "messages": messages});
    let r = http::post_json(&chat_url(&s.gateway.url), &[], &body).await;
    assert_eq!(r.status, 200, "{}", r.text());
    let msg = r.json()["choices"][0]["message"].clone();
    let call = msg["tool_calls"][0].clone();
    let mut echo = msg.clone();
    echo.as_object_mut().unwrap().remove("reasoning_content");
    messages.push(echo);
    messages.push(json!({"role": "tool", "tool_call_id": call["id"], "content": "a.txt b.txt"}));

    s.gateway.kill9();
    let q = s.qwen3.to_str().unwrap().to_string();
    let gw = Proc::gateway_with(
        &s.upstream.url,
        &s.data,
        &["--mode", "exact", "--model-dir", &q],
        &[],
    );
    let body = json!({"model": "qwen3", "tools": tools(), "messages": messages, "stream": true});
    let r = http::post_json(&chat_url(&gw.url), &[], &body).await;
    assert_eq!(r.status, 200, "{}", r.text());
    let data = r.sse_data();
    assert_eq!(data.last().map(String::as_str), Some("[DONE]"));
    let chunks: Vec<Value> = data[..data.len() - 1]
        .iter()
        .map(|d| serde_json::from_str(d).unwrap())
        .collect();
    let msg = common::assemble_chat(&chunks);
    assert_eq!(
        msg["content"], "The directory holds a.txt and b.txt.",
        "{msg}"
    );

    let tok = Tokenizer::from_dir(&s.qwen3).unwrap();
    let recs = check_session_records(&common::records_show(&s.data), &sid, &tok);
    assert_eq!(recs.len(), 2, "{recs:#?}");
    let reused = recs[1]["upstream_request"]["graft_prompt"]["reused_tokens"]
        .as_u64()
        .unwrap();
    assert!(
        reused > 0,
        "the restarted gateway reused the sampled ids: {:#}",
        recs[1]
    );
    let mut sampled = ids(&recs[0]["prompt_token_ids"]);
    sampled.extend(ids(&recs[0]["completion_token_ids"]));
    assert!(ids(&recs[1]["prompt_token_ids"]).starts_with(&sampled));
    drop(gw);

    let out = s.dir.path().join("samples.parquet");
    let summary = reconstruct(&s.data, &s.qwen3, &out);
    assert_eq!(summary["samples"], 1, "{summary}");
    assert_eq!(summary["drift_events"], 0, "{summary}");
    check_samples(&out, &common::records_show(&s.data));
}

/// The same through the real Codex CLI: its first turn's shell command waits for a file the
/// test writes only after it has killed the gateway with -9 and started it again on the
/// same port and data dir, so Codex's second call (the tool result, in the Responses
/// dialect) reaches a gateway that has never seen the session in memory. The session's
/// history is rebuilt from its records: the second call reuses the sampled ids
/// (`reused_tokens` > 0) and reconstruct makes one sample without drift.
#[test]
fn a_codex_session_goes_on_after_kill_9_of_the_gateway_between_its_turns() {
    let env = TestEnv::get();
    let dir = tempfile::tempdir().unwrap();
    let qwen3 = env.qwen3_dir();
    let q = qwen3.to_str().unwrap();
    let data = dir.path().join("data");
    let go = dir.path().join("go");
    let cmd = format!(
        "while [ ! -e '{}' ]; do sleep 0.2; done; echo graft-codex-step-done > codex_result.txt && cat codex_result.txt",
        go.display()
    );
    let script = json!({"rules": [
        {"match": "graft-codex-step-done", "role": "tool",
         "reply": {"reasoning": "The file exists now.", "content": "graft-codex: codex_result.txt is written."}},
        {"match": "graft-codex-restart-task", "role": "user", "tools": true,
         "reply": {"reasoning": "A shell redirect writes the file in one step.",
                   "content": "I will write the file.",
                   "tool_calls": [{"name": "exec_command", "arguments": {"cmd": cmd, "yield_time_ms": 30000}}]}}
    ]});
    let script_file = dir.path().join("script.json");
    std::fs::write(&script_file, script.to_string()).unwrap();
    let upstream =
        Proc::scripted_upstream(&["--script", script_file.to_str().unwrap(), "--tokenizer", q]);
    // A port of our own, so the restarted gateway is where Codex's config points.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let listen = format!("127.0.0.1:{port}");
    let gateway = || {
        Proc::spawn_env(
            "gateway",
            &[
                "gateway",
                "--listen",
                &listen,
                "--upstream",
                &upstream.url,
                "--data-dir",
                data.to_str().unwrap(),
                "--mode",
                "exact",
                "--model-dir",
                q,
            ],
            &[],
            "graft gateway listening on",
            None,
        )
    };
    let mut gw = gateway();
    let (sid, base) = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
        .block_on(common::open_session(&gw.url));
    let target = common::Target {
        base_url: base.clone(),
        session_header: None,
        api_key: common::session_key(&base),
        model: "scripted".to_owned(),
    };
    let config_text = common::graft(&[
        "harness",
        "config",
        "codex",
        "--session",
        &base,
        "--api-key",
        &target.api_key,
        "--model",
        &target.model,
    ]);
    let config = dir.path().join("codex-config.toml");
    std::fs::write(&config, &config_text).unwrap();
    let codex = {
        let (config, target) = (config.clone(), target.clone());
        std::thread::spawn(move || {
            let env = TestEnv::get();
            env.codex_client_with(
                &config,
                &target,
                &[(
                    "GRAFT_CODEX_TASK",
                    "graft-codex-restart-task: write the word graft-codex-step-done into codex_result.txt.",
                )],
            )
        })
    };
    // Codex's first turn is answered and recorded; its command now waits for `go`.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(120);
    loop {
        let recs = common::records_show(&data);
        if recs
            .iter()
            .any(|r| r["session_id"] == sid.as_str() && r["outcome"] == "ok")
        {
            break;
        }
        assert!(
            !codex.is_finished(),
            "Codex ended before its first call was recorded"
        );
        assert!(
            std::time::Instant::now() < deadline,
            "no record of Codex's first call: {recs:#?}"
        );
        std::thread::sleep(std::time::Duration::from_millis(200));
    }
    gw.kill9();
    drop(gw);
    let gw = gateway();
    std::fs::write(&go, "").unwrap();
    let out = codex.join().unwrap();
    assert_eq!(out["result_txt"], "graft-codex-step-done\n", "{out:#}");
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    let recs = loop {
        let recs: Vec<Value> = common::records_show(&data)
            .into_iter()
            .filter(|r| r["session_id"] == sid.as_str())
            .collect();
        if recs.len() >= 2 {
            break recs;
        }
        assert!(std::time::Instant::now() < deadline, "{recs:#?}");
        std::thread::sleep(std::time::Duration::from_millis(200));
    };
    let tok = Tokenizer::from_dir(&qwen3).unwrap();
    let recs = check_session_records(&recs, &sid, &tok);
    assert!(
        recs.len() >= 2,
        "one call before the kill, the others after: {recs:#?}"
    );
    assert!(
        recs.iter()
            .all(|r| r["dialect"] == "responses" && r["stream"] == true),
        "{recs:#?}"
    );
    let reused = recs[1]["upstream_request"]["graft_prompt"]["reused_tokens"]
        .as_u64()
        .unwrap();
    assert!(
        reused > 0,
        "the restarted gateway reused Codex's sampled ids: {:#}",
        recs[1]
    );
    let mut sampled = ids(&recs[0]["prompt_token_ids"]);
    sampled.extend(ids(&recs[0]["completion_token_ids"]));
    assert!(ids(&recs[1]["prompt_token_ids"]).starts_with(&sampled));
    drop(gw);
    let out_file = dir.path().join("samples.parquet");
    let summary = reconstruct(&data, &qwen3, &out_file);
    assert_eq!(summary["samples"], 1, "{summary}");
    assert_eq!(summary["drift_events"], 0, "{summary}");
    check_samples(&out_file, &recs);
}

/// A session names its own backend (a trainer's server the gateway was not configured
/// with): its calls go there, also after kill -9 and a restart of the gateway (the pin is in
/// the session log), while a session that names none stays on the configured backend. A
/// backend that is no http(s) URL is refused with the field named, and so is any backend in
/// passthrough mode.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_session_names_its_own_backend_and_keeps_it_across_a_restart() {
    let mut s = start(SCRIPT, &[], &[]);
    let q = s.qwen3.to_str().unwrap().to_string();
    let script = s.dir.path().join("script.json");
    let own = Proc::scripted_upstream(&["--script", script.to_str().unwrap(), "--tokenizer", &q]);
    let create = |body: Value| {
        let url = format!("{}/graft/sessions", s.gateway.url);
        async move { http::post_json(&url, &[], &body).await }
    };
    for (body, want) in [
        (
            json!({"backend": "ftp://127.0.0.1:1"}),
            "scheme must be http or https",
        ),
        (json!({"backend": "not a url"}), "not a URL"),
        (json!({"backend": 30000}), "invalid session create body"),
    ] {
        let r = create(body.clone()).await;
        assert_eq!(r.status, 400, "{body}: {}", r.text());
        assert!(r.text().contains(want), "{body}: {}", r.text());
    }
    let r = create(json!({"session_id": "own-1", "backend": format!("{}/", own.url)})).await;
    assert_eq!(r.status, 201, "{}", r.text());
    let r = create(json!({"session_id": "cfg-1"})).await;
    assert_eq!(r.status, 201, "{}", r.text());
    let call = |gw: String, sid: &'static str| async move {
        let body = json!({"model": "qwen3", "tools": tools(),
                          "messages": [{"role": "user", "content": "list the files please"}]});
        let r = http::post_json(&format!("{gw}/s/{sid}/v1/chat/completions"), &[], &body).await;
        assert_eq!(r.status, 200, "{}", r.text());
    };
    call(s.gateway.url.clone(), "own-1").await;
    call(s.gateway.url.clone(), "cfg-1").await;
    let st = http::get(&format!("{}/graft/backend/status", s.gateway.url), &[]).await;
    assert_eq!(
        st.json()["backends"],
        json!([s.upstream.url, own.url]),
        "{}",
        st.text()
    );
    s.gateway.kill9();
    let gw = Proc::gateway_with(
        &s.upstream.url,
        &s.data,
        &["--mode", "exact", "--model-dir", &q],
        &[],
    );
    call(gw.url.clone(), "own-1").await;
    let view = http::get(&format!("{}/graft/sessions/own-1", gw.url), &[]).await;
    assert_eq!(view.json()["backend"], own.url.as_str(), "{}", view.text());
    drop(gw);
    let recs = common::records_show(&s.data);
    let upstreams = |sid: &str| -> Vec<String> {
        recs.iter()
            .filter(|r| r["session_id"] == sid)
            .map(|r| r["upstream"].as_str().unwrap().to_string())
            .collect()
    };
    assert_eq!(upstreams("own-1"), vec![own.url.clone(), own.url.clone()]);
    assert_eq!(upstreams("cfg-1"), vec![s.upstream.url.clone()]);

    // Passthrough has no backends of its own to pin: the field is refused by name.
    let stack = common::Stack::start();
    let r = http::post_json(
        &format!("{}/graft/sessions", stack.gateway.url),
        &[],
        &json!({"backend": own.url}),
    )
    .await;
    assert_eq!(r.status, 400, "{}", r.text());
    assert!(r.text().contains("exact mode only"), "{}", r.text());
}

/// What the scripted SGLang side was asked (`GET /testkit/requests`).
async fn asked(upstream: &str) -> Value {
    http::get(&format!("{upstream}/testkit/requests"), &[])
        .await
        .json()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn point4_an_sglang_older_than_the_minimum_is_refused_by_name() {
    let s = start(SCRIPT, &["--sglang-version", "0.5.2"], &[]);
    let (_, base) = common::open_session(&s.gateway.url).await;
    let r = http::post_json(
        &format!("{base}/chat/completions"),
        &[],
        &chat("hello", false),
    )
    .await;
    assert_eq!(r.status, 502, "{}", r.text());
    let m = r.json()["error"]["message"].as_str().unwrap().to_string();
    assert!(
        m.contains("SGLang 0.5.2") && m.contains("0.5.6 or newer"),
        "{m}"
    );
    // Refused before anything was generated.
    assert_eq!(asked(&s.upstream.url).await["generate"], json!([]));

    // exact.check_backends = false calls it anyway.
    let config = s.dir.path().join("unchecked.toml");
    std::fs::write(&config, "[exact]\ncheck_backends = false\n").unwrap();
    let data = s.dir.path().join("data-unchecked");
    let q = s.qwen3.to_str().unwrap();
    let gw = Proc::gateway_with(
        &s.upstream.url,
        &data,
        &[
            "--mode",
            "exact",
            "--model-dir",
            q,
            "--config",
            config.to_str().unwrap(),
        ],
        &[],
    );
    let (_, base) = common::open_session(&gw.url).await;
    let r = http::post_json(
        &format!("{base}/chat/completions"),
        &[],
        &chat("hello", false),
    )
    .await;
    assert_eq!(r.status, 200, "{}", r.text());

    // A supported one (the scripted upstream's default, 0.5.23) is used, and the gateway says
    // in one line that it streams cumulatively.
    let ok = start(SCRIPT, &[], &[]);
    let (_, base) = common::open_session(&ok.gateway.url).await;
    let r = http::post_json(
        &format!("{base}/chat/completions"),
        &[],
        &chat("hello", false),
    )
    .await;
    assert_eq!(r.status, 200, "{}", r.text());
    assert!(
        ok.gateway.stderr_contains("--incremental-streaming-output"),
        "{}",
        ok.gateway.stderr()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn point5_a_whole_exact_answer_longer_than_the_backend_timeout_is_not_cut() {
    // A 2 s backend timeout and an answer streamed in ~18 events 250 ms apart: a whole
    // answer that takes about 4.5 s. It used to wait for SGLang's whole answer under the head timeout; now it is
    // streamed from the backend and only a 2 s stall between events would fail it.
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("graft.toml");
    std::fs::write(&config, "[upstream]\ntimeout_secs = 2\n").unwrap();
    let s = start(
        SCRIPT,
        &["--chunk-delay-ms", "250"],
        &["--config", config.to_str().unwrap()],
    );
    let (sid, base) = common::open_session(&s.gateway.url).await;
    let t = std::time::Instant::now();
    let r = http::post_json(
        &format!("{base}/chat/completions"),
        &[],
        &chat("tell a long story", false),
    )
    .await;
    let took = t.elapsed();
    assert_eq!(r.status, 200, "{}", r.text());
    assert!(
        took > std::time::Duration::from_secs(2),
        "the answer should outlast the backend timeout (took {took:?}): the test shows nothing otherwise"
    );
    let v = r.json();
    assert!(
        v["choices"][0]["message"]["content"]
            .as_str()
            .unwrap()
            .starts_with("Once upon a time"),
        "{v}"
    );
    // Streamed from the backend, whole to the client; the record has every id.
    let log = asked(&s.upstream.url).await;
    assert_eq!(log["generate"][0]["stream"], json!(true), "{log}");
    let recs: Vec<Value> = common::records_show(&s.data)
        .into_iter()
        .filter(|r| r["session_id"] == sid)
        .collect();
    assert_eq!(recs.len(), 1);
    assert_eq!(recs[0]["stream"], json!(false), "{}", recs[0]);
    let n = recs[0]["completion_token_ids"].as_array().unwrap().len();
    assert_eq!(
        recs[0]["completion_logprobs"].as_array().unwrap().len(),
        n,
        "{}",
        recs[0]
    );
    assert_eq!(
        v["usage"]["completion_tokens"].as_u64().unwrap() as usize,
        n,
        "{v}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn point6_backend_and_admin_keys_reach_the_backend() {
    // The scripted upstream decides as SGLang started with --api-key and --admin-api-key.
    // Events 50 ms apart: the abandoned stream below is still running when its client goes.
    let keys = [
        "--expect-key",
        "sk-backend",
        "--admin-key",
        "sk-admin",
        "--chunk-delay-ms",
        "50",
    ];
    let dir = tempfile::tempdir().unwrap();
    let with_keys = dir.path().join("keys.toml");
    std::fs::write(
        &with_keys,
        "[exact]\nbackend_api_key = \"sk-backend\"\nadmin_api_key = \"env::GRAFT_TEST_ADMIN_KEY\"\n",
    )
    .unwrap();
    let s = start(SCRIPT, &keys, &[]);
    // Without keys: the backend's 401 reaches the client as a refusal naming the backend.
    let (_, base) = common::open_session(&s.gateway.url).await;
    let r = http::post_json(
        &format!("{base}/chat/completions"),
        &[],
        &chat("hello", false),
    )
    .await;
    assert_eq!(r.status, 401, "{}", r.text());
    assert!(r.text().contains("Unauthorized"), "{}", r.text());

    // With them: generations carry the API key, the abort of an abandoned stream the admin key.
    let q = s.qwen3.to_str().unwrap();
    let gw = Proc::gateway_with(
        &s.upstream.url,
        &s.dir.path().join("data-keys"),
        &[
            "--mode",
            "exact",
            "--model-dir",
            q,
            "--config",
            with_keys.to_str().unwrap(),
        ],
        &[("GRAFT_TEST_ADMIN_KEY", "sk-admin")],
    );
    let (_, base) = common::open_session(&gw.url).await;
    let url = format!("{base}/chat/completions");
    let r = http::post_json(&url, &[], &chat("hello", false)).await;
    assert_eq!(r.status, 200, "{}", r.text());
    let resp = http::post_stream(&url, &chat("tell a long story", true)).await;
    let mut body = resp.into_body();
    let mut buf = String::new();
    http::next_sse_data(&mut body, &mut buf).await.unwrap();
    drop(body);
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    loop {
        let log = asked(&s.upstream.url).await;
        if log["aborted"].as_array().is_some_and(|a| !a.is_empty()) {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the abort never reached the backend with the admin key: {log}\n{}",
            gw.stderr()
        );
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }

    // The weight push wants the admin key: refused without it, done with it.
    let err =
        graft_trainer::push::push_weights(&s.upstream.url, Path::new("/m/step-1"), "step-1", None)
            .unwrap_err()
            .to_string();
    assert!(err.contains("401"), "{err}");
    graft_trainer::push::push_weights(
        &s.upstream.url,
        Path::new("/m/step-1"),
        "step-1",
        Some("sk-admin"),
    )
    .unwrap();
    let info = http::get(
        &format!("{}/model_info", s.upstream.url),
        &[("authorization", "Bearer sk-backend")],
    )
    .await;
    assert_eq!(info.json()["weight_version"], "step-1", "{}", info.text());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn point9_model_info_is_read_from_the_current_route_else_the_deprecated_one() {
    use graft::rl::backends::{Keys, model_info};
    // A current SGLang: `/model_info` (the deprecated `/get_model_info` warns per call).
    let s = start(SCRIPT, &[], &[]);
    let keys = Keys::default();
    let info = model_info(&keys.api(&s.upstream.url))
        .await
        .expect("model info");
    assert_eq!(info["weight_version"], "default", "{info}");
    // One from before the rename answers 404 there: the old route is read instead, and the
    // gateway's start-up check reads `/get_server_info` the same way.
    let old = start(SCRIPT, &["--legacy-info-routes"], &[]);
    let r = http::get(&format!("{}/model_info", old.upstream.url), &[]).await;
    assert_eq!(r.status, 404);
    let info = model_info(&keys.api(&old.upstream.url))
        .await
        .expect("model info");
    assert_eq!(info["weight_version"], "default", "{info}");
    let (_, base) = common::open_session(&old.gateway.url).await;
    let r = http::post_json(
        &format!("{base}/chat/completions"),
        &[],
        &chat("hello", false),
    )
    .await;
    assert_eq!(r.status, 200, "{}", r.text());
    assert!(
        old.gateway.stderr_contains("backend checked"),
        "{}",
        old.gateway.stderr()
    );
    // A backend that is not reachable has no model info (the watchdog's "down").
    assert!(model_info(&keys.api("http://127.0.0.1:9")).await.is_none());
}

/// `graft rl`'s weight push to an SGLang backend while a call is being generated: nothing is
/// drained. The backend pauses in place (the scripted one holds the generation after 3
/// tokens until the new weights land), the push completes while the stream is still open,
/// the stream goes on whole, a new call right after is answered, and the record labels each
/// token with the weights that sampled it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_push_from_graft_rl_keeps_the_calls_in_flight_running() {
    use graft::rl::backends::Shared;
    use graft::rl::config::RlConfig;
    use graft::rl::rollout::Api;
    let script = r#"{"rules": [
      {"match": "weights change", "weight_update_after": 3, "reply": {"content": "Partly old weights, partly new ones: both are recorded."}},
      {"match": "after the push", "reply": {"content": "Answered with the new weights."}}
    ]}"#;
    let s = start(script, &[], &[]);
    let cfg_path = s.dir.path().join("rl.toml");
    std::fs::write(s.dir.path().join("t.jsonl"), "{\"prompt\": \"x\"}\n").unwrap();
    std::fs::write(
        &cfg_path,
        format!(
            "[run]\nout_dir = \"o\"\nsteps = 1\n[tasks]\nfile = \"t.jsonl\"\n[harness]\ncommand = \"true\"\n[backend]\nmodel_dir = \"{}\"\nurls = [\"{}\"]\n",
            s.qwen3.display(),
            s.upstream.url
        ),
    )
    .unwrap();
    let cfg = RlConfig::load(&cfg_path).unwrap();
    assert!(!cfg.backend.drain_on_push, "pushes do not drain by default");
    let shared = Shared::default();

    let (sid, base) = common::open_session(&s.gateway.url).await;
    let url = format!("{base}/chat/completions");
    let body = json!({"model": "qwen3", "stream": true,
        // Not thinking: the first tokens are the answer's content.
        "chat_template_kwargs": {"enable_thinking": false},
        "messages": [{"role": "user", "content": "the weights change mid-call"}]});
    let resp = http::post_stream(&url, &body).await;
    assert_eq!(resp.status(), 200);
    let mut body = resp.into_body();
    let mut buf = String::new();
    let mut text = String::new();
    chat_content(&mut body, &mut buf, &mut text, true).await;
    // The stream is held by the backend until new weights land. A draining push would wait
    // for it (and it for the push): this one returns.
    let gateway = Api::new(&s.gateway.url, common::admin_auth(&s.data));
    let pushed = tokio::time::timeout(
        std::time::Duration::from_secs(30),
        shared.push(
            &cfg,
            &gateway,
            std::slice::from_ref(&s.upstream.url),
            Path::new("/ckpt/step-1"),
            "step-1",
        ),
    )
    .await
    .expect("the push waited for the call in flight");
    pushed.unwrap();
    let status = http::get(&format!("{}/graft/backend/status", s.gateway.url), &[]).await;
    assert_eq!(status.json()["paused"], json!(false), "{}", status.text());
    // A new call goes straight through.
    let r = http::post_json(
        &url,
        &[],
        &json!({"model": "qwen3", "messages": [{"role": "user", "content": "after the push"}]}),
    )
    .await;
    assert_eq!(r.status, 200, "{}", r.text());
    // The held stream ends whole.
    chat_content(&mut body, &mut buf, &mut text, false).await;
    assert_eq!(
        text,
        "Partly old weights, partly new ones: both are recorded."
    );
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    let recs = loop {
        let recs: Vec<Value> = common::records_show(&s.data)
            .into_iter()
            .filter(|r| r["session_id"] == sid)
            .collect();
        if recs.len() == 2 || std::time::Instant::now() > deadline {
            break recs;
        }
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    };
    let held = recs
        .iter()
        .find(|r| r["stream"] == json!(true))
        .unwrap_or_else(|| panic!("{recs:#?}"));
    let n = ids(&held["completion_token_ids"]).len() as u64;
    assert_eq!(
        held["weight_version_spans"],
        json!([{"version": "default", "start": 0, "end": 3}, {"version": "step-1", "start": 3, "end": n}]),
        "{held:#}"
    );
    let after = recs.iter().find(|r| r["stream"] == json!(false)).unwrap();
    assert_eq!(after["weight_version"], "step-1", "{after:#}");
}

const WEATHER: &str = r#"{"rules": [
  {"match": "weather", "reply": {"reasoning": "A tool answers this.", "content": "Checking.", "tool_calls": [{"name": "get_weather", "arguments": {"city": "Paris"}}]}}
]}"#;

/// One weather request in `dialect` (chat, responses, messages) with the tool offered or not
/// and the dialect's own `tool_choice` (`none` / `auto`, Chat form named).
fn weather_request(dialect: &str, tools: bool, choice: Option<&str>, stream: bool) -> Value {
    let schema = json!({"type": "object", "properties": {"city": {"type": "string"}}});
    let mut body = match dialect {
        "chat" => {
            json!({"model": "qwen3", "messages": [{"role": "user", "content": "the weather in Paris?"}]})
        }
        "responses" => json!({"model": "qwen3", "input": "the weather in Paris?"}),
        _ => json!({"model": "qwen3", "max_tokens": 200,
                    "messages": [{"role": "user", "content": "the weather in Paris?"}]}),
    };
    if tools {
        body["tools"] = match dialect {
            "chat" => {
                json!([{"type": "function", "function": {"name": "get_weather", "parameters": schema}}])
            }
            "responses" => {
                json!([{"type": "function", "name": "get_weather", "parameters": schema}])
            }
            _ => json!([{"name": "get_weather", "input_schema": schema}]),
        };
    }
    if let Some(c) = choice {
        body["tool_choice"] = if dialect == "messages" {
            json!({"type": c})
        } else {
            json!(c)
        };
    }
    body["stream"] = json!(stream);
    body
}

/// SGLang's rule (`reconstruct/src/parse_rule.rs`), through every dialect, whole and streamed:
/// without tools or with `tool_choice: none` the model's `<tool_call>` text is content; with
/// `auto` it is a call in the dialect's own shape.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tool_call_text_is_parsed_only_when_the_request_lets_the_server_parse_it() {
    let s = start(WEATHER, &[], &[]);
    let (_, base) = common::open_session(&s.gateway.url).await;
    for (dialect, path, call_marker) in [
        ("chat", "chat/completions", "\"tool_calls\""),
        ("responses", "responses", "\"function_call\""),
        ("messages", "messages", "\"tool_use\""),
    ] {
        for (tools, choice, parsed) in [
            (false, None, false),
            (true, Some("none"), false),
            (true, Some("auto"), true),
        ] {
            for stream in [false, true] {
                let body = weather_request(dialect, tools, choice, stream);
                let r = http::post_json(
                    &format!("{base}/{path}"),
                    &[("anthropic-version", "2023-06-01")],
                    &body,
                )
                .await;
                let text = r.text();
                let ctx =
                    format!("{dialect} tools={tools} choice={choice:?} stream={stream}: {text}");
                assert_eq!(r.status, 200, "{ctx}");
                assert_eq!(text.contains(call_marker), parsed, "{ctx}");
                assert_eq!(text.contains("<tool_call>"), !parsed, "{ctx}");
                assert!(text.contains("Checking"), "{ctx}");
            }
        }
    }
    // The prompt renders the tools as SGLang's chat server renders them: all under `auto`,
    // none under `none`, only the named one under a named choice (the parse still knows
    // them all).
    let log = http::get(&format!("{}/testkit/requests", s.upstream.url), &[])
        .await
        .json();
    let last_prompt = |log: &Value| {
        log["prompts"].as_array().unwrap().last().unwrap()["text"]
            .as_str()
            .unwrap()
            .to_string()
    };
    let prompts = log["prompts"].as_array().unwrap();
    assert_eq!(prompts.len(), 18, "{log:#}");
    for (i, p) in prompts.iter().enumerate() {
        // Per dialect: no tools (2 calls), none (2), auto (2).
        let tools_rendered = p["text"].as_str().unwrap().contains("<tools>");
        assert_eq!(tools_rendered, i % 6 >= 4, "call {i}: {p:#}");
    }
    let two_tools = |choice: Value| {
        json!({"model": "qwen3", "tool_choice": choice,
        "messages": [{"role": "user", "content": "the weather in Paris?"}],
        "tools": [
            {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}},
            {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}
        ]})
    };
    let url = format!("{base}/chat/completions");
    let r = http::post_json(&url, &[], &two_tools(json!("auto"))).await;
    assert_eq!(r.status, 200, "{}", r.text());
    let log = http::get(&format!("{}/testkit/requests", s.upstream.url), &[])
        .await
        .json();
    let p = last_prompt(&log);
    assert!(
        p.contains("\"get_weather\"") && p.contains("\"get_time\""),
        "{p}"
    );
    let r = http::post_json(
        &url,
        &[],
        &two_tools(json!({"type": "function", "function": {"name": "get_weather"}})),
    )
    .await;
    assert_eq!(r.status, 200, "{}", r.text());
    assert!(r.text().contains("\"tool_calls\""), "{}", r.text());
    let log = http::get(&format!("{}/testkit/requests", s.upstream.url), &[])
        .await
        .json();
    let p = last_prompt(&log);
    assert!(
        p.contains("\"get_weather\"") && !p.contains("get_time"),
        "{p}"
    );
}

/// The structured-output request of each client dialect, with the schema it carries.
fn structured_requests() -> Vec<(&'static str, Value, Value)> {
    let schema = json!({"type": "object", "properties": {"title": {"type": "string"}},
        "required": ["title"], "additionalProperties": false});
    let user = json!([{"role": "user", "content": "hello"}]);
    vec![
        (
            "chat/completions",
            json!({"model": "qwen3", "messages": user, "response_format": {"type": "json_schema",
                "json_schema": {"name": "title", "schema": schema, "strict": true}}}),
            schema.clone(),
        ),
        (
            "chat/completions",
            json!({"model": "qwen3", "messages": user, "stream": true,
                "response_format": {"type": "json_object"}}),
            json!({"type": "object"}),
        ),
        (
            "responses",
            json!({"model": "qwen3", "input": "hello", "text": {"format": {"type": "json_schema",
                "name": "title", "schema": schema, "strict": true}}}),
            schema.clone(),
        ),
        (
            "messages",
            json!({"model": "qwen3", "max_tokens": 100, "messages": user,
                "output_config": {"format": {"type": "json_schema", "schema": schema}}}),
            schema.clone(),
        ),
        (
            "completions",
            json!({"model": "qwen3", "prompt": "hello", "response_format": {"type": "json_schema",
                "json_schema": {"name": "title", "schema": schema}}}),
            schema,
        ),
    ]
}

/// Structured output in exact mode: the schema each dialect carries reaches the backend as
/// SGLang's `json_schema` sampling parameter (a JSON string, as SGLang's own chat server
/// sends it), a plain call carries none, and a malformed format is refused by name.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn structured_output_reaches_the_backend_in_every_dialect() {
    let s = start(SCRIPT, &[], &[]);
    let (_, base) = common::open_session(&s.gateway.url).await;
    let cases = structured_requests();
    for (path, body, _) in &cases {
        let r = http::post_json(
            &format!("{base}/{path}"),
            &[("anthropic-version", "2023-06-01")],
            body,
        )
        .await;
        assert_eq!(r.status, 200, "{path}: {}", r.text());
    }
    let r = http::post_json(
        &format!("{base}/chat/completions"),
        &[],
        &chat("hello", false),
    )
    .await;
    assert_eq!(r.status, 200, "{}", r.text());
    let log = asked(&s.upstream.url).await;
    let sent: Vec<&Value> = log["generate"].as_array().unwrap().iter().collect();
    assert_eq!(sent.len(), cases.len() + 1, "{log}");
    for ((path, _, schema), got) in cases.iter().zip(&sent) {
        let js = got["sampling_params"]["json_schema"]
            .as_str()
            .unwrap_or_else(|| panic!("{path}: no json_schema reached SGLang: {got}"));
        assert_eq!(
            serde_json::from_str::<Value>(js).unwrap(),
            *schema,
            "{path}: {got}"
        );
    }
    assert!(
        sent[cases.len()]["sampling_params"]
            .get("json_schema")
            .is_none()
    );
    // A thinking request's grammar waits for the reasoning's end, as SGLang's chat server
    // asks it (`require_reasoning`): every templated call with a format; not a raw
    // completion, not a call without one.
    let bodies = generate_bodies(&log);
    let require: Vec<bool> = bodies
        .iter()
        .map(|b| b["require_reasoning"] == json!(true))
        .collect();
    assert_eq!(require, [true, true, true, true, false, false], "{log:#}");
    // Malformed formats: 400 naming the field, in the client's dialect.
    for (path, body, field) in [
        (
            "chat/completions",
            json!({"model": "qwen3", "messages": [{"role": "user", "content": "x"}],
                "response_format": {"type": "json_schema"}}),
            "response_format",
        ),
        (
            "responses",
            json!({"model": "qwen3", "input": "x", "text": {"format": {"type": "xml"}}}),
            "text.format",
        ),
        (
            "messages",
            json!({"model": "qwen3", "max_tokens": 10, "messages": [{"role": "user", "content": "x"}],
                "output_config": {"format": {"type": "json_schema"}}}),
            "output_config.format.schema",
        ),
    ] {
        let r = http::post_json(
            &format!("{base}/{path}"),
            &[("anthropic-version", "2023-06-01")],
            &body,
        )
        .await;
        assert_eq!(r.status, 400, "{path}: {}", r.text());
        assert!(r.text().contains(field), "{path}: {}", r.text());
    }
    assert_eq!(
        asked(&s.upstream.url).await["generate"]
            .as_array()
            .unwrap()
            .len(),
        cases.len() + 1,
        "a refused format reached the backend"
    );
}

/// The `/generate` bodies the scripted SGLang side was sent, in order.
fn generate_bodies(log: &Value) -> Vec<Value> {
    log["bodies"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|b| b["path"] == "/generate")
        .map(|b| b["body"].clone())
        .collect()
}

/// Issue 31: a `tool_choice` that asks for a call (`required`, Anthropic's `any`, a named
/// function) constrains the decode at SGLang as its chat server does (the legacy
/// structural tag of SGLang's `qwen25` detector, `at_least_one`, every declared tool; the
/// grammar waiting for the reasoning's end), in Chat, Responses and Messages; `auto` and
/// `none` send none. What SGLang's chat server refuses is refused by name before the
/// backend: such a choice without tools, a named function not declared, and a forced call
/// together with structured output.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tool_choice_that_asks_for_a_call_constrains_the_decode_at_sglang() {
    let s = start(WEATHER, &[], &[]);
    let (_, base) = common::open_session(&s.gateway.url).await;
    let anthropic = [("anthropic-version", "2023-06-01")];
    let cases = [
        (
            "chat",
            "chat/completions",
            Some("required"),
            "\"tool_calls\"",
            true,
        ),
        (
            "responses",
            "responses",
            Some("required"),
            "\"function_call\"",
            true,
        ),
        ("messages", "messages", Some("any"), "\"tool_use\"", true),
        (
            "chat",
            "chat/completions",
            Some("auto"),
            "\"tool_calls\"",
            false,
        ),
        ("messages", "messages", Some("auto"), "\"tool_use\"", false),
        ("chat", "chat/completions", None, "\"tool_calls\"", false),
    ];
    for (dialect, path, choice, marker, _) in cases {
        let body = weather_request(dialect, true, choice, false);
        let r = http::post_json(&format!("{base}/{path}"), &anthropic, &body).await;
        assert_eq!(r.status, 200, "{dialect} {choice:?}: {}", r.text());
        assert!(
            r.text().contains(marker),
            "{dialect} {choice:?}: {}",
            r.text()
        );
    }
    // Chat's named function.
    let mut named = weather_request("chat", true, None, true);
    named["tool_choice"] = json!({"type": "function", "function": {"name": "get_weather"}});
    let r = http::post_json(&format!("{base}/chat/completions"), &[], &named).await;
    assert_eq!(r.status, 200, "{}", r.text());
    let forced = json!({"type": "structural_tag", "triggers": ["<tool_call>"], "at_least_one": true,
        "structures": [{"begin": "<tool_call>\n{\"name\":\"get_weather\", \"arguments\":",
            "schema": {}, "end": "}\n</tool_call>"}]});
    let log = asked(&s.upstream.url).await;
    let bodies = generate_bodies(&log);
    assert_eq!(bodies.len(), cases.len() + 1, "{log:#}");
    let expected = cases.iter().map(|c| c.4).chain([true]);
    for (i, (b, constrained)) in bodies.iter().zip(expected).enumerate() {
        let tag = b["sampling_params"]["structural_tag"].as_str();
        if constrained {
            let tag: Value =
                serde_json::from_str(tag.unwrap_or_else(|| panic!("call {i}: {b}"))).unwrap();
            assert_eq!(tag, forced, "call {i}");
            assert_eq!(b["require_reasoning"], json!(true), "call {i}: {b}");
        } else {
            assert!(tag.is_none(), "call {i}: {b}");
            assert!(b.get("require_reasoning").is_none(), "call {i}: {b}");
        }
    }
    // Refused before the backend, naming `tool_choice`, in the client's dialect.
    let mut no_tools = weather_request("chat", false, Some("required"), false);
    let mut undeclared = weather_request("chat", true, None, false);
    undeclared["tool_choice"] = json!({"type": "function", "function": {"name": "get_time"}});
    let mut with_format = weather_request("chat", true, Some("required"), false);
    with_format["response_format"] = json!({"type": "json_object"});
    let mut any_without_tools = weather_request("messages", false, None, false);
    any_without_tools["tool_choice"] = json!({"type": "any"});
    for (path, body, words) in [
        ("chat/completions", &mut no_tools, "declares no tools"),
        ("chat/completions", &mut undeclared, "'get_time'"),
        ("chat/completions", &mut with_format, "structured output"),
        ("messages", &mut any_without_tools, "declares no tools"),
    ] {
        let r = http::post_json(&format!("{base}/{path}"), &anthropic, body).await;
        assert_eq!(r.status, 400, "{path} {body}: {}", r.text());
        let e = &r.json()["error"];
        let message = e["message"].as_str().unwrap_or_default();
        assert!(
            message.contains("tool_choice") && message.contains(words),
            "{e}"
        );
        if path == "messages" {
            assert_eq!(r.json()["type"], "error", "{}", r.text());
        } else {
            assert_eq!(e["param"], "tool_choice", "{e}");
        }
    }
    assert_eq!(
        generate_bodies(&asked(&s.upstream.url).await).len(),
        cases.len() + 1,
        "a refused tool_choice reached the backend"
    );
}

/// Issue 31: a request's `chat_template_kwargs` render its prompt as SGLang's and vLLM's
/// chat servers render it (over `exact.template_kwargs`): `enable_thinking: false` closes
/// the think block in Qwen3's generation prompt, and such a request does not ask the grammar
/// to wait for reasoning; anything but an object is refused by name.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_requests_chat_template_kwargs_render_its_prompt() {
    let s = start(SCRIPT, &[], &[]);
    let (_, base) = common::open_session(&s.gateway.url).await;
    let url = format!("{base}/chat/completions");
    let ask = |kwargs: Value| {
        json!({"model": "qwen3", "messages": [{"role": "user", "content": "hello"}],
            "response_format": {"type": "json_object"}, "chat_template_kwargs": kwargs})
    };
    for kwargs in [json!({"enable_thinking": false}), Value::Null] {
        let r = http::post_json(&url, &[], &ask(kwargs.clone())).await;
        assert_eq!(r.status, 200, "{kwargs}: {}", r.text());
    }
    let log = asked(&s.upstream.url).await;
    let prompts: Vec<&str> = log["prompts"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| p["text"].as_str().unwrap())
        .collect();
    assert_eq!(prompts.len(), 2, "{log:#}");
    assert!(
        prompts[0].ends_with("<|im_start|>assistant\n<think>\n\n</think>\n\n"),
        "{}",
        prompts[0]
    );
    assert!(
        prompts[1].ends_with("<|im_start|>assistant\n"),
        "{}",
        prompts[1]
    );
    let bodies = generate_bodies(&log);
    assert!(
        bodies[0].get("require_reasoning").is_none(),
        "{}",
        bodies[0]
    );
    assert_eq!(bodies[1]["require_reasoning"], json!(true), "{}", bodies[1]);
    let r = http::post_json(&url, &[], &ask(json!("no thinking"))).await;
    assert_eq!(r.status, 400, "{}", r.text());
    assert_eq!(
        r.json()["error"]["param"],
        "chat_template_kwargs",
        "{}",
        r.text()
    );
}

/// Chunks of a streamed Chat or Completions answer (the `[DONE]` left out).
fn chunks_of(r: &http::Resp) -> Vec<Value> {
    let data = r.sse_data();
    assert_eq!(data.last().map(String::as_str), Some("[DONE]"), "{data:?}");
    data[..data.len() - 1]
        .iter()
        .map(|d| serde_json::from_str(d).unwrap())
        .collect()
}

/// Issue 31, part 1: the model's context (`exact.context_length`) bounds each call. A
/// prompt that leaves no room for one token is refused by name in the client's own error
/// shape (Chat, Responses, Messages) before anything reaches the backend, and recorded; a
/// token limit past what is left is clamped to it in the body the backend gets.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prompt_past_the_context_is_refused_by_name_before_the_backend_and_a_long_limit_is_clamped()
 {
    let context = 120u64;
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("graft.toml");
    std::fs::write(&config, format!("[exact]\ncontext_length = {context}\n")).unwrap();
    let s = start(SCRIPT, &[], &["--config", config.to_str().unwrap()]);
    let (_, base) = common::open_session(&s.gateway.url).await;

    let ok = http::post_json(
        &format!("{base}/chat/completions"),
        &[],
        &chat("hello", false),
    )
    .await;
    assert_eq!(ok.status, 200, "{}", ok.text());
    let records = common::records_show(&s.data);
    let prompt = ids(&records[0]["prompt_token_ids"]).len() as u64;
    let log = asked(&s.upstream.url).await;
    assert_eq!(
        log["generate"][0]["sampling_params"]["max_new_tokens"],
        json!(context - prompt),
        "the default limit is clamped to what the context leaves: {log}"
    );

    let long = "word ".repeat(200);
    let chat_r = http::post_json(
        &format!("{base}/chat/completions"),
        &[],
        &chat(&long, false),
    )
    .await;
    let resp_r = http::post_json(
        &format!("{base}/responses"),
        &[],
        &json!({"model": "qwen3", "input": long}),
    )
    .await;
    let msgs_r = http::post_json(
        &format!("{base}/messages"),
        &[],
        &json!({"model": "qwen3", "max_tokens": 50, "messages": [{"role": "user", "content": long}]}),
    )
    .await;
    for (name, r) in [("chat", &chat_r), ("responses", &resp_r)] {
        assert_eq!(r.status, 400, "{name}: {}", r.text());
        let e = &r.json()["error"];
        assert_eq!(e["code"], "context_length_exceeded", "{name}: {e}");
        assert_eq!(e["type"], "invalid_request_error", "{name}: {e}");
        assert_eq!(e["param"], "messages", "{name}: {e}");
        assert_eq!(e["retryable"], false, "{name}: {e}");
        let m = e["message"].as_str().unwrap();
        assert!(
            m.starts_with(&format!("This model's maximum context length is {context} tokens. However, your messages resulted in ")),
            "{name}: {m}"
        );
    }
    assert_eq!(msgs_r.status, 400, "{}", msgs_r.text());
    let v = msgs_r.json();
    assert_eq!(v["type"], "error", "{v}");
    assert_eq!(v["error"]["type"], "invalid_request_error", "{v}");
    assert!(
        v["error"]["message"]
            .as_str()
            .unwrap()
            .contains(&format!("maximum context length is {context} tokens")),
        "{v}"
    );
    // Nothing of the refused calls reached the backend.
    let log = asked(&s.upstream.url).await;
    assert_eq!(log["generate"].as_array().unwrap().len(), 1, "{log}");
    // Each is recorded as the client's error, with the prompt that did not fit.
    let records = common::records_show(&s.data);
    assert_eq!(records.len(), 4);
    for r in &records[1..] {
        assert_eq!(r["status"], 400, "{r}");
        assert_eq!(r["outcome"], "client_error", "{r}");
        assert!(ids(&r["prompt_token_ids"]).len() as u64 >= context, "{r}");
        assert!(r["completion_token_ids"].is_null(), "{r}");
    }
}

/// Issue 31, part 5: graft asks the backend to keep a matched stop string (`no_stop_trim`)
/// so the record holds every sampled id; the client's text ends before it, whole and
/// streamed, as SGLang's own endpoint shows it, and the record names what matched.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stop_string_ends_the_clients_text_before_it_while_the_record_keeps_it() {
    const STOPS: &str = r#"{"rules": [
      {"match": "run the code", "reply": {"content": "Thought: I print it.\nCode:\n```py\nprint(2)\n```<end_code>\nObservation: 2 was printed, and more follows."}}
    ]}"#;
    let s = start(STOPS, &["--chunk-delay-ms", "5"], &[]);
    let (sid, base) = common::open_session(&s.gateway.url).await;
    let url = format!("{base}/chat/completions");
    // What smolagents sends.
    let stop = json!(["Observation:", "Calling tools:", "</code>"]);
    let expected = "Thought: I print it.\nCode:\n```py\nprint(2)\n```<end_code>";
    let mut whole = chat("run the code", false);
    whole["stop"] = stop.clone();
    let r = http::post_json(&url, &[], &whole).await;
    assert_eq!(r.status, 200, "{}", r.text());
    let v = r.json();
    assert_eq!(v["choices"][0]["finish_reason"], "stop", "{v}");
    assert_eq!(
        v["choices"][0]["message"]["content"]
            .as_str()
            .unwrap()
            .trim_end(),
        expected,
        "{v}"
    );
    let mut streamed = chat("run the code", true);
    streamed["stop"] = stop.clone();
    let r = http::post_json(&url, &[], &streamed).await;
    assert_eq!(r.status, 200, "{}", r.text());
    let msg = common::assemble_chat(&chunks_of(&r));
    assert_eq!(
        msg["content"].as_str().unwrap().trim_end(),
        expected,
        "{msg}"
    );

    let log = asked(&s.upstream.url).await;
    assert_eq!(
        log["generate"][0]["sampling_params"]["no_stop_trim"], true,
        "{log}"
    );
    let tok = Tokenizer::from_dir(&s.qwen3).unwrap();
    let records: Vec<Value> = common::records_show(&s.data)
        .into_iter()
        .filter(|r| r["session_id"] == sid)
        .collect();
    assert_eq!(records.len(), 2);
    for r in &records {
        let text = tok.decode(&ids(&r["completion_token_ids"])).unwrap();
        // Thinking is on: the model opened (and closed) its think block first.
        let text = text.trim_start_matches("<think>\n\n</think>\n\n");
        assert!(text.starts_with(expected), "{text}");
        assert!(
            text.contains("Observation:"),
            "the ids keep the stop string: {text}"
        );
        assert!(
            !text.contains("more follows"),
            "the backend stopped at it: {text}"
        );
        assert_eq!(r["finish_reason"], "stop", "{r}");
        assert_eq!(r["backend_finish_reason"], "stop", "{r}");
        assert_eq!(r["stop_matched"], "Observation:", "{r}");
    }
}

/// Checks a client's per-token logprob entries (`{token, logprob, bytes, top_logprobs}`,
/// Chat's and Responses' shape) against a record: one per sampled token, the recorded
/// logprob, the id decoded alone, its UTF-8 bytes, `top` alternatives each.
fn assert_logprob_entries(entries: &[Value], rec: &Value, tok: &Tokenizer, top: usize) {
    let ids = ids(&rec["completion_token_ids"]);
    let lps = f32s(&rec["completion_logprobs"]);
    assert_eq!(entries.len(), ids.len(), "one entry per sampled token");
    for ((e, id), lp) in entries.iter().zip(&ids).zip(&lps) {
        assert_eq!(e["logprob"].as_f64().unwrap() as f32, *lp, "{e}");
        assert_eq!(e["token"], tok.decode(&[*id]).unwrap(), "{e}");
        assert_eq!(e["bytes"], json!(e["token"].as_str().unwrap().as_bytes()));
        assert_eq!(e["top_logprobs"].as_array().unwrap().len(), top, "{e}");
    }
}

/// Issue 31: a Responses client that includes `message.output_text.logprobs` (with
/// `top_logprobs: 2`) gets every output token's logprob on the message's `output_text`, as
/// vLLM's Responses server gives them, equal to the recorded ones: whole; streamed, spread
/// over the text deltas and whole on `output_text.done` and the completed response. Without
/// the include they stay empty.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn responses_logprobs_are_answered_when_included() {
    let s = start(SCRIPT, &[], &[]);
    let (sid, base) = common::open_session(&s.gateway.url).await;
    let url = format!("{base}/responses");
    let body = |stream: bool, include: bool| {
        let mut b = json!({"model": "qwen3", "stream": stream, "input": "tell a long story"});
        if include {
            b["include"] = json!(["message.output_text.logprobs"]);
            b["top_logprobs"] = json!(2);
        }
        b
    };
    let message_logprobs = |resp: &Value| -> Vec<Value> {
        let msg = resp["output"]
            .as_array()
            .unwrap()
            .iter()
            .find(|i| i["type"] == "message")
            .unwrap_or_else(|| panic!("no message: {resp}"))
            .clone();
        msg["content"][0]["logprobs"].as_array().unwrap().clone()
    };
    let whole = http::post_json(&url, &[], &body(false, true)).await;
    assert_eq!(whole.status, 200, "{}", whole.text());
    let whole_lps = message_logprobs(&whole.json());
    let streamed = http::post_json(&url, &[], &body(true, true)).await;
    assert_eq!(streamed.status, 200, "{}", streamed.text());
    let events: Vec<Value> = streamed
        .sse_data()
        .iter()
        .map(|d| serde_json::from_str(d).unwrap())
        .collect();
    let of = |ty: &str| -> Vec<&Value> { events.iter().filter(|e| e["type"] == ty).collect() };
    let spread: Vec<Value> = of("response.output_text.delta")
        .iter()
        .flat_map(|e| e["logprobs"].as_array().unwrap().clone())
        .collect();
    let done = of("response.output_text.done")[0]["logprobs"]
        .as_array()
        .unwrap()
        .clone();
    let completed = message_logprobs(&of("response.completed")[0]["response"]);

    let tok = Tokenizer::from_dir(&s.qwen3).unwrap();
    let records: Vec<Value> = common::records_show(&s.data)
        .into_iter()
        .filter(|r| r["session_id"] == sid)
        .collect();
    assert_eq!(records.len(), 2);
    for (r, lists) in [
        (&records[0], vec![whole_lps]),
        (&records[1], vec![done, completed]),
    ] {
        for list in lists {
            assert_logprob_entries(&list, r, &tok, 2);
        }
    }
    // The deltas carried them all, in order (the last ones may ride on `done` only).
    let n = spread.len();
    assert!(n > 0, "no delta carried logprobs");
    assert_eq!(
        spread[..],
        of("response.output_text.done")[0]["logprobs"]
            .as_array()
            .unwrap()[..n]
    );
    // Not asked for: empty, as before.
    let plain = http::post_json(&url, &[], &body(false, false)).await;
    assert_eq!(plain.status, 200, "{}", plain.text());
    assert!(message_logprobs(&plain.json()).is_empty());
}

/// Issue 31, parts 2-4: a Chat client with `logprobs: true, top_logprobs: 2` gets the
/// sampled tokens' logprobs (whole and streamed), equal to the recorded ones; a Completions
/// client with `logprobs: 2` gets them in its own shape; `reasoning_tokens` counts the
/// reasoning part's tokens as SGLang counts them; the record says `tool_calls` where the
/// client was told so, with the backend's `stop` beside it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn logprobs_reasoning_tokens_and_finish_reasons_are_answered_as_the_server_would() {
    let s = start(SCRIPT, &[], &[]);
    let (sid, base) = common::open_session(&s.gateway.url).await;
    let url = format!("{base}/chat/completions");
    let body = |stream: bool| {
        json!({"model": "qwen3", "stream": stream, "tools": tools(), "logprobs": true, "top_logprobs": 2,
            "stream_options": if stream { json!({"include_usage": true}) } else { Value::Null },
            "messages": [{"role": "user", "content": "list the files please"}]})
    };
    let whole = http::post_json(&url, &[], &body(false)).await;
    assert_eq!(whole.status, 200, "{}", whole.text());
    let whole = whole.json();
    let streamed = http::post_json(&url, &[], &body(true)).await;
    assert_eq!(streamed.status, 200, "{}", streamed.text());
    let chunks = chunks_of(&streamed);
    let done = http::post_json(
        &format!("{base}/completions"),
        &[],
        &json!({"model": "qwen3", "prompt": "tell a long story", "logprobs": 2, "max_tokens": 12}),
    )
    .await;
    assert_eq!(done.status, 200, "{}", done.text());
    let done = done.json();

    let tok = Tokenizer::from_dir(&s.qwen3).unwrap();
    let records: Vec<Value> = common::records_show(&s.data)
        .into_iter()
        .filter(|r| r["session_id"] == sid)
        .collect();
    assert_eq!(records.len(), 3);
    let think_end = tok.token_id("</think>").unwrap();
    let streamed_lps: Vec<Value> = chunks
        .iter()
        .flat_map(|c| {
            c["choices"]
                .as_array()
                .and_then(|a| a.first())
                .and_then(|ch| ch["logprobs"]["content"].as_array().cloned())
                .unwrap_or_default()
        })
        .collect();
    let usage_streamed = &chunks.last().unwrap()["usage"];
    for (r, content, usage, finish) in [
        (
            &records[0],
            whole["choices"][0]["logprobs"]["content"]
                .as_array()
                .unwrap()
                .clone(),
            &whole["usage"],
            &whole["choices"][0]["finish_reason"],
        ),
        (
            &records[1],
            streamed_lps,
            usage_streamed,
            &chunks[chunks.len() - 2]["choices"][0]["finish_reason"],
        ),
    ] {
        assert_eq!(*finish, "tool_calls");
        assert_eq!(r["finish_reason"], "tool_calls", "{r}");
        assert_eq!(r["backend_finish_reason"], "stop", "{r}");
        assert_logprob_entries(&content, r, &tok, 2);
        for e in &content {
            assert_eq!(
                e["top_logprobs"][0]["token"], e["token"],
                "the sampled token is the likeliest here"
            );
        }
        let ids = ids(&r["completion_token_ids"]);
        let reasoning = ids.iter().position(|&i| i == think_end).unwrap() as u64 + 1;
        assert_eq!(
            usage["completion_tokens_details"]["reasoning_tokens"],
            json!(reasoning),
            "{usage}"
        );
    }
    // Completions: `logprobs.{tokens, token_logprobs, top_logprobs, text_offset}`.
    let r = &records[2];
    let ids = ids(&r["completion_token_ids"]);
    let lp = &done["choices"][0]["logprobs"];
    assert_eq!(lp["tokens"].as_array().unwrap().len(), ids.len(), "{lp}");
    let got: Vec<f32> = lp["token_logprobs"]
        .as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_f64().unwrap() as f32)
        .collect();
    assert_eq!(got, f32s(&r["completion_logprobs"]));
    assert_eq!(lp["top_logprobs"][0].as_object().unwrap().len(), 2, "{lp}");
    assert_eq!(lp["text_offset"][0], 0, "{lp}");
    assert_eq!(r["finish_reason"], "length", "{r}");
    assert_eq!(r["backend_finish_reason"], "length", "{r}");
}

/// The readiness recipe `docs/gateway.md` gives scripts: poll `GET /healthz` from before
/// the start until it answers 200. An exact-mode gateway loads its tokenizer before binding
/// (the port refuses meanwhile), may answer 503 `starting` while rebuilding token histories,
/// and answers 200 `ok` once a call can go through: the first call after it succeeds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn healthz_answers_ok_only_once_an_exact_mode_gateway_can_take_a_call() {
    let env = TestEnv::get();
    let q = env.qwen3_dir();
    let q = q.to_str().unwrap();
    let upstream = Proc::scripted_upstream(&["--tokenizer", q]);
    let dir = tempfile::tempdir().unwrap();
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let url = format!("http://127.0.0.1:{port}");
    /// Kills the gateway however the test ends.
    struct Kill(std::process::Child);
    impl Drop for Kill {
        fn drop(&mut self) {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
    let _gateway = Kill(
        std::process::Command::new(common::graft_bin())
            .args([
                "gateway",
                "--listen",
                &format!("127.0.0.1:{port}"),
                "--upstream",
            ])
            .arg(&upstream.url)
            .arg("--data-dir")
            .arg(dir.path().join("data"))
            .args(["--mode", "exact", "--model-dir", q])
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .unwrap(),
    );
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    let mut seen = vec![];
    loop {
        assert!(
            std::time::Instant::now() < deadline,
            "no 200 in 60 s: {seen:?}"
        );
        match http::send("GET", &format!("{url}/healthz"), &[], vec![]).await {
            Ok(r) if r.status == 200 => {
                assert_eq!(r.json()["status"], "ok");
                break;
            }
            Ok(r) => {
                assert_eq!(r.status, 503, "{}", r.text());
                assert_eq!(r.json()["status"], "starting", "{}", r.text());
                seen.push(503);
            }
            Err(_) => seen.push(0),
        }
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    let r = http::post_json(
        &format!("{url}/v1/chat/completions"),
        &[],
        &json!({"model": "m", "messages": [{"role": "user", "content": "graft-completion: hi"}]}),
    )
    .await;
    assert_eq!(r.status, 200, "{}", r.text());
}

/// Every text the client was shown, whole or streamed, in any dialect: the string values of
/// `content`, `text` and `delta` keys of the answer (or of each `data:` event), in order.
fn visible_text(body: &str) -> String {
    fn walk(v: &Value, out: &mut String) {
        match v {
            Value::Object(o) => {
                for (k, v) in o {
                    match (k.as_str(), v) {
                        ("content" | "text" | "delta", Value::String(s)) => out.push_str(s),
                        _ => walk(v, out),
                    }
                }
            }
            Value::Array(a) => a.iter().for_each(|v| walk(v, out)),
            _ => {}
        }
    }
    let mut out = String::new();
    let docs: Vec<Value> = match serde_json::from_str::<Value>(body) {
        Ok(v) => vec![v],
        Err(_) => body
            .lines()
            .filter_map(|l| l.strip_prefix("data: "))
            .filter_map(|d| serde_json::from_str(d).ok())
            .collect(),
    };
    for d in &docs {
        walk(d, &mut out);
    }
    out
}

const LLAMA3_SCRIPT: &str = r#"{"rules": [
  {"role": "tool", "reply": {"content": "It is sunny in Paris."}},
  {"match": "weather in Paris", "reply": {"tool_calls": [{"name": "get_weather", "arguments": {"city": "Paris"}}]}},
  {"match": "time in Tokyo", "reply": {"content": "Let me look that up.", "tool_calls": [{"name": "get_time", "arguments": {"tz": "Asia/Tokyo"}}]}}
]}"#;

/// The Llama 3 family (`exact.tool_call_format = "llama3"`, no reasoning parser) on Llama
/// 3.2's own tokenizer and tool-calling template, as SGLang's `llama3` parser reads its
/// answers (`reconstruct/tests/parse_rules.rs` holds the reference table): a bare
/// `{"name", "parameters"}` answer and one after `<|python_tag|>` are calls in every
/// dialect, whole and streamed, when the request lets the server parse calls; otherwise the
/// JSON is content and the special `<|python_tag|>` is not in it. A forced call gets the
/// `llama3` structural tag. A tool session merges into one sample with the sampled ids.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn llama3_tool_calls_are_read_as_sglangs_llama3_parser_reads_them() {
    let llama = TestEnv::get().llama3_dir();
    let cfg_dir = tempfile::tempdir().unwrap();
    let cfg = cfg_dir.path().join("graft.toml");
    std::fs::write(
        &cfg,
        "[exact]\ntool_call_format = \"llama3\"\nreasoning_format = \"none\"\n",
    )
    .unwrap();
    let Setup {
        gateway,
        upstream,
        data,
        dir,
        ..
    } = start_model(
        &llama,
        LLAMA3_SCRIPT,
        &[],
        &["--config", cfg.to_str().unwrap()],
    );
    let (sid, base) = common::open_session(&gateway.url).await;
    let schema = json!({"type": "object", "properties": {"city": {"type": "string"}, "tz": {"type": "string"}}});
    for (question, name, content) in [
        ("the weather in Paris?", "get_weather", ""),
        ("the time in Tokyo?", "get_time", "Let me look that up."),
    ] {
        for (dialect, path) in [
            ("chat", "chat/completions"),
            ("responses", "responses"),
            ("messages", "messages"),
        ] {
            for (tools, choice, parsed) in [
                (false, None, false),
                (true, Some("none"), false),
                (true, Some("auto"), true),
            ] {
                for stream in [false, true] {
                    let mut body = weather_request(dialect, tools, choice, stream);
                    if tools {
                        // Both functions, in the dialect's shape.
                        let mut second = body["tools"][0].clone();
                        for t in [&mut body["tools"][0], &mut second] {
                            let f = if dialect == "chat" {
                                &mut t["function"]
                            } else {
                                t
                            };
                            for key in ["parameters", "input_schema"] {
                                if f.get(key).is_some() {
                                    f[key] = schema.clone();
                                }
                            }
                        }
                        let f = if dialect == "chat" {
                            &mut second["function"]
                        } else {
                            &mut second
                        };
                        f["name"] = json!("get_time");
                        body["tools"].as_array_mut().unwrap().push(second);
                    }
                    match dialect {
                        "responses" => body["input"] = json!(question),
                        _ => body["messages"][0]["content"] = json!(question),
                    }
                    let r = http::post_json(
                        &format!("{base}/{path}"),
                        &[("anthropic-version", "2023-06-01")],
                        &body,
                    )
                    .await;
                    let text = r.text();
                    let ctx = format!(
                        "{question} {dialect} tools={tools} choice={choice:?} stream={stream}: {text}"
                    );
                    assert_eq!(r.status, 200, "{ctx}");
                    assert!(!text.contains("python_tag"), "{ctx}");
                    let call_marker = match dialect {
                        "chat" => "\"tool_calls\"",
                        "responses" => "\"function_call\"",
                        _ => "\"tool_use\"",
                    };
                    assert_eq!(text.contains(call_marker), parsed, "{ctx}");
                    // The call's JSON is content exactly when it is not parsed.
                    let shown = visible_text(&text);
                    assert_eq!(shown.contains("\"parameters\""), !parsed, "{ctx}");
                    if parsed {
                        assert!(text.contains(name), "{ctx}");
                    }
                    if !content.is_empty() {
                        assert!(shown.contains("Let me look that up."), "{ctx}");
                    }
                    if parsed && !stream && dialect == "chat" {
                        let msg = &r.json()["choices"][0]["message"];
                        // SGLang's message content is a string, `""` beside calls
                        // (`serving_chat.py`: `content=text if text else ""`).
                        let want_content = json!(content);
                        assert_eq!(msg["content"], want_content, "{ctx}");
                        assert_eq!(msg["tool_calls"].as_array().unwrap().len(), 1, "{ctx}");
                        assert_eq!(msg["tool_calls"][0]["function"]["name"], name, "{ctx}");
                        assert_eq!(
                            r.json()["choices"][0]["finish_reason"],
                            "tool_calls",
                            "{ctx}"
                        );
                    }
                }
            }
        }
    }
    // A forced call is constrained with the `llama3` detector's structural tag.
    let mut forced = weather_request("chat", true, Some("required"), false);
    forced["tools"][0]["function"]["parameters"] = schema.clone();
    let r = http::post_json(&format!("{base}/chat/completions"), &[], &forced).await;
    assert_eq!(r.status, 200, "{}", r.text());
    let log = http::get(&format!("{}/testkit/requests", upstream.url), &[])
        .await
        .json();
    let last = log["generate"].as_array().unwrap().last().unwrap().clone();
    let tag: Value =
        serde_json::from_str(last["sampling_params"]["structural_tag"].as_str().unwrap()).unwrap();
    assert_eq!(tag["triggers"], json!(["<|python_tag|>"]), "{tag}");
    assert_eq!(tag["at_least_one"], true, "{tag}");
    // The prompts are Llama 3.2's: tools in the first user turn.
    let prompt = log["prompts"].as_array().unwrap().last().unwrap()["text"]
        .as_str()
        .unwrap()
        .to_owned();
    assert!(
        prompt.starts_with("<|begin_of_text|><|start_header_id|>system<|end_header_id|>"),
        "{prompt}"
    );
    assert!(prompt.contains("Given the following functions"), "{prompt}");

    // A tool session: the call, its result as an `ipython` turn, the answer. One sample,
    // trained tokens equal to the sampled ids (`<|python_tag|>`-free here: a bare call).
    let (sid2, base2) = common::open_session(&gateway.url).await;
    let tools =
        json!([{"type": "function", "function": {"name": "get_weather", "parameters": schema}}]);
    let mut messages = vec![json!({"role": "user", "content": "the weather in Paris?"})];
    for turn in 0..2 {
        let body =
            json!({"model": "llama", "tools": tools, "messages": messages, "stream": turn == 1});
        let r = http::post_json(&format!("{base2}/chat/completions"), &[], &body).await;
        assert_eq!(r.status, 200, "{}", r.text());
        let msg = if turn == 1 {
            let data = r.sse_data();
            let chunks: Vec<Value> = data[..data.len() - 1]
                .iter()
                .map(|d| serde_json::from_str(d).unwrap())
                .collect();
            common::assemble_chat(&chunks)
        } else {
            r.json()["choices"][0]["message"].clone()
        };
        messages.push(msg.clone());
        if turn == 0 {
            let call = &msg["tool_calls"][0];
            assert_eq!(call["function"]["name"], "get_weather", "{msg}");
            messages.push(json!({"role": "tool", "tool_call_id": call["id"], "content": "sunny"}));
        } else {
            assert_eq!(msg["content"], "It is sunny in Paris.", "{msg}");
        }
    }
    drop(gateway);
    drop(upstream);
    let records = common::records_show(&data);
    let tok = Tokenizer::from_dir(&llama).unwrap();
    let mut recs: Vec<&Value> = records.iter().filter(|r| r["session_id"] == sid2).collect();
    recs.sort_by_key(|r| r["seq"].as_u64().unwrap());
    assert_eq!(recs.len(), 2);
    assert_eq!(
        tok.decode(&ids(&recs[0]["completion_token_ids"])).unwrap(),
        "{\"name\": \"get_weather\", \"parameters\": {\"city\":\"Paris\"}}<|eot_id|>"
    );
    assert_eq!(recs[0]["finish_reason"], "tool_calls", "{:#}", recs[0]);
    let mut sampled = ids(&recs[0]["prompt_token_ids"]);
    sampled.extend(ids(&recs[0]["completion_token_ids"]));
    assert!(ids(&recs[1]["prompt_token_ids"]).starts_with(&sampled));
    // The first session's python-tag answers keep the tag in their recorded ids.
    let tag_id = tok.token_id("<|python_tag|>").unwrap();
    assert!(
        records
            .iter()
            .filter(|r| r["session_id"] == sid)
            .any(|r| ids(&r["completion_token_ids"]).contains(&tag_id))
    );
    let out = dir.path().join("samples.parquet");
    let summary = reconstruct(&data, &llama, &out);
    assert_eq!(summary["exact_calls"], records.len(), "{summary}");
    let samples = read_samples_parquet(&out).unwrap();
    let mine: Vec<_> = samples.iter().filter(|x| x.session_id == sid2).collect();
    assert_eq!(mine.len(), 1, "one sample for the tool session: {summary}");
    let x = mine[0];
    assert_eq!(x.fork_reason, None);
    let trained = common::trained_ids(x);
    let mut want = ids(&recs[0]["completion_token_ids"]);
    want.extend(ids(&recs[1]["completion_token_ids"]));
    assert_eq!(trained, want);
}

//! Exact mode against a vLLM-wire backend (`exact.wire = "vllm"`): graft renders and
//! tokenizes with the real Qwen3 template and tokenizer, calls the scripted upstream's
//! vLLM-native side (`/v1/completions` with a token-id prompt, `return_token_ids`,
//! `logprobs`, vLLM 0.34's chunk shapes and refusals) and answers each client in its own
//! dialect. Real clients: the openai Python SDK, Codex (in its own network namespace) and
//! mini-swe-agent. Each session must merge into one sample with no drift, its trained
//! tokens equal to the sampled ids with their logprobs; a stream the client abandons must be
//! aborted at the backend (vLLM aborts on the closed connection).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::io::{Read, Write};
use std::time::{Duration, Instant};

use common::{Proc, Stack, TestEnv, f32s, http, ids, logprob};
use graft_reconstruct::sample::read_samples_parquet;
use serde_json::{Value, json};

/// A gateway in exact mode over the vLLM wire in front of the scripted upstream.
fn stack(upstream_args: &[&str]) -> Stack {
    let env = TestEnv::get();
    let q = env.qwen3_dir();
    let q = q.to_str().unwrap();
    let cfg = std::env::temp_dir().join(format!("graft-vllm-{}.toml", std::process::id()));
    std::fs::write(&cfg, "[exact]\nwire = \"vllm\"\n").unwrap();
    let mut up = vec!["--tokenizer", q];
    up.extend_from_slice(upstream_args);
    Stack::start_with(
        &up,
        &[
            "--mode",
            "exact",
            "--model-dir",
            q,
            "--config",
            cfg.to_str().unwrap(),
        ],
    )
}

/// A gateway over the vLLM wire in front of a scripted upstream playing `script`.
struct Own {
    gateway: Proc,
    upstream: Proc,
    data_dir: std::path::PathBuf,
    _dir: tempfile::TempDir,
}

fn own(script: &Value, upstream_args: &[&str]) -> Own {
    own_with(script, upstream_args, "")
}

/// [`own`] with more `[exact]` keys.
fn own_with(script: &Value, upstream_args: &[&str], exact: &str) -> Own {
    own_model(&TestEnv::get().qwen3_dir(), script, upstream_args, exact)
}

/// [`own_with`] on the model (tokenizer and template) in `model`.
fn own_model(model: &std::path::Path, script: &Value, upstream_args: &[&str], exact: &str) -> Own {
    let q = model.to_str().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let data_dir = dir.path().join("data");
    let script_path = dir.path().join("script.json");
    std::fs::write(&script_path, script.to_string()).unwrap();
    let cfg = dir.path().join("graft.toml");
    std::fs::write(&cfg, format!("[exact]\nwire = \"vllm\"\n{exact}\n")).unwrap();
    let mut up = vec!["--script", script_path.to_str().unwrap(), "--tokenizer", q];
    up.extend_from_slice(upstream_args);
    let upstream = Proc::scripted_upstream(&up);
    let gateway = Proc::gateway_with(
        &upstream.url,
        &data_dir,
        &[
            "--mode",
            "exact",
            "--model-dir",
            q,
            "--config",
            cfg.to_str().unwrap(),
        ],
        &[],
    );
    Own {
        gateway,
        upstream,
        data_dir,
        _dir: dir,
    }
}

/// The last `/v1/completions` the scripted vLLM was asked, from its log.
fn last_completion(log: &Value) -> Value {
    log["completions"]
        .as_array()
        .and_then(|c| c.last())
        .unwrap_or_else(|| panic!("no completion asked: {log}"))
        .clone()
}

/// What the scripted vLLM was asked (`GET /testkit/vllm/requests`).
async fn vllm_log(upstream: &str) -> Value {
    http::get(&format!("{upstream}/testkit/vllm/requests"), &[])
        .await
        .json()
}

/// Checks a session's records against what the backend sampled and that each prompt holds
/// the previous prompt and completion verbatim. Returns them in seq order.
fn check_records(records: &[Value], sid: &str) -> Vec<Value> {
    let mut recs: Vec<Value> = records
        .iter()
        .filter(|r| r["session_id"] == sid)
        .cloned()
        .collect();
    recs.sort_by_key(|r| r["seq"].as_u64().unwrap());
    assert!(!recs.is_empty(), "no records of {sid}");
    for r in &recs {
        assert_eq!(r["outcome"], "ok", "{r:#}");
        assert_eq!(r["upstream_dialect"], "vllm_completions", "{r:#}");
        assert_eq!(r["backend_finish_reason"], "stop", "{r:#}");
        assert_eq!(r["weight_version"], "default", "{r:#}");
        let up = &r["upstream_request"];
        assert!(
            up.get("prompt").is_none(),
            "ids live in prompt_token_ids: {up}"
        );
        assert_eq!(up["return_token_ids"], true, "{up}");
        assert_eq!(up["logprobs"], 0, "{up}");
        assert!(
            up["max_tokens"].as_u64().is_some(),
            "vLLM's default is 16: {up}"
        );
        assert_eq!(up["graft_logprobs"], "pre_temperature", "{up}");
        let completion = ids(&r["completion_token_ids"]);
        assert!(!completion.is_empty(), "{r:#}");
        let lps = f32s(&r["completion_logprobs"]);
        assert_eq!(
            lps,
            completion.iter().map(|&i| logprob(i)).collect::<Vec<_>>()
        );
    }
    for w in recs.windows(2) {
        let mut sampled = ids(&w[0]["prompt_token_ids"]);
        sampled.extend(ids(&w[0]["completion_token_ids"]));
        assert!(
            ids(&w[1]["prompt_token_ids"]).starts_with(&sampled),
            "call {} does not start with call {}'s prompt + completion",
            w[1]["seq"],
            w[0]["seq"]
        );
    }
    recs
}

/// Reconstructs the data dir: one sample per session, no drift, the trained tokens exactly
/// the sampled ones with their logprobs.
fn check_one_sample_per_session(stack: &Stack, sessions: &[&str]) {
    let env = TestEnv::get();
    let q = env.qwen3_dir();
    let out = stack.dir.path().join("samples.parquet");
    let text = common::graft(&[
        "reconstruct",
        "--data-dir",
        stack.data_dir.to_str().unwrap(),
        "--tokenizer",
        q.to_str().unwrap(),
        "--out",
        out.to_str().unwrap(),
        "--json",
    ]);
    let summary: Value = serde_json::from_str(text.lines().last().unwrap()).unwrap();
    assert_eq!(summary["samples"], sessions.len(), "{summary}");
    assert_eq!(summary["drift_events"], 0, "{summary}");
    assert_eq!(summary["retokenized_calls"], 0, "{summary}");
    let records = common::records_show(&stack.data_dir);
    let samples = read_samples_parquet(&out).unwrap();
    for sid in sessions {
        let x = samples
            .iter()
            .find(|x| x.session_id == *sid)
            .unwrap_or_else(|| panic!("no sample of {sid}"));
        let recs = check_records(&records, sid);
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
        assert_eq!(got_ids, want_ids, "session {sid}");
        assert_eq!(got_lps, want_lps, "session {sid}");
        assert_eq!(x.fork_reason, None, "session {sid}");
    }
}

#[test]
fn vllm_wire_sessions_of_the_openai_sdk_codex_and_mini_swe_agent_merge_with_no_drift() {
    let env = TestEnv::get();
    let stack = stack(&[]);

    // The openai SDK: a streamed tool call, then the answer to its result.
    stack.open_session("vllm-sdk");
    let out = env.py_client(
        "openai_sdk.py",
        &["tool-session"],
        &stack.target(Some("vllm-sdk"), None),
    );
    assert_eq!(out["first"]["finish_reason"], "tool_calls", "{out:#}");
    assert_eq!(
        out["first"]["tool_calls"][0]["name"], "get_weather",
        "{out:#}"
    );
    assert_eq!(
        out["content"], "It is sunny in Paris (graft-weather-done).",
        "{out:#}"
    );
    stack.wait_records("vllm-sdk", 2);

    // Codex (Responses over SSE), in a network namespace of its own.
    let session = stack.open_session("vllm-codex");
    let target = stack.target(Some("vllm-codex"), None);
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
    let recs = stack.wait_records("vllm-codex", 2);
    assert!(
        recs.iter()
            .all(|r| r["dialect"] == "responses" && r["stream"] == true)
    );

    // mini-swe-agent (litellm underneath), a second harness.
    stack.open_session("vllm-mini");
    let out = env.py_client(
        "mini_swe_agent.py",
        &[],
        &stack.target(Some("vllm-mini"), None),
    );
    assert_eq!(out["result_txt"], "graft-mini-step-one-done\n", "{out:#}");
    stack.wait_records("vllm-mini", 2);

    check_one_sample_per_session(&stack, &["vllm-sdk", "vllm-codex", "vllm-mini"]);

    // Every request was vLLM's: a token-id prompt, max_tokens set, no model name.
    let rt = tokio::runtime::Runtime::new().unwrap();
    let log = rt.block_on(vllm_log(&stack.upstream.url));
    let asked = log["completions"].as_array().unwrap();
    assert!(asked.len() >= 6, "{log:#}");
    for a in asked {
        assert!(a["prompt_tokens"].as_u64().unwrap() > 0, "{a}");
        assert!(a["body"]["max_tokens"].as_u64().is_some(), "{a}");
        assert!(a["body"].get("model").is_none(), "{a}");
    }
    assert_eq!(log["aborted"], json!([]), "{log:#}");
}

const LONG: &str = "tell a long story";

/// A streamed call the client abandons after its first event: the gateway records it as
/// `client_disconnected` and closes its connection to vLLM, which vLLM takes as the abort.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn vllm_wire_stream_abandoned_mid_way_is_aborted_at_the_backend() {
    // 300 ms between the backend's chunks: the answer takes several seconds.
    let s = own(
        &json!({"rules": [{"match": LONG, "reply": {"content": "Once upon a time there was a gateway that recorded every single token the policy sampled, and the researchers who trained on them never again wondered what the model had really seen."}}]}),
        &["--chunk-delay-ms", "300"],
    );
    let (sid, base) = common::open_session(&s.gateway.url).await;
    let key = common::session_key(&base);
    let body = json!({"model": "qwen3", "stream": true,
        "messages": [{"role": "user", "content": LONG}]})
    .to_string();
    let addr = s.gateway.url.trim_start_matches("http://").to_string();
    let sid2 = sid.clone();
    tokio::task::spawn_blocking(move || {
        let mut c = std::net::TcpStream::connect(&addr).unwrap();
        write!(
            c,
            "POST /s/{sid2}/v1/chat/completions HTTP/1.1\r\nhost: {addr}\r\nauthorization: Bearer {key}\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
            body.len()
        )
        .unwrap();
        c.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
        let mut got = Vec::new();
        let mut buf = [0u8; 4096];
        while !String::from_utf8_lossy(&got).contains("data: ") {
            let n = c.read(&mut buf).unwrap();
            assert!(n > 0, "the gateway closed before the first event");
            got.extend_from_slice(&buf[..n]);
        }
        assert!(String::from_utf8_lossy(&got).starts_with("HTTP/1.1 200"));
        // Gone mid-way: the socket is dropped here.
    })
    .await
    .unwrap();

    let deadline = Instant::now() + Duration::from_secs(30);
    let (record, log) = loop {
        let recs: Vec<Value> = common::records_show(&s.data_dir)
            .into_iter()
            .filter(|r| r["session_id"] == sid.as_str())
            .collect();
        let log = vllm_log(&s.upstream.url).await;
        if let Some(r) = recs.first()
            && log["aborted"].as_array().is_some_and(|a| !a.is_empty())
        {
            break (r.clone(), log);
        }
        assert!(
            Instant::now() < deadline,
            "no abort seen: {recs:#?} {log:#}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    assert_eq!(record["outcome"], "client_disconnected", "{record:#}");
    assert_eq!(record["upstream_dialect"], "vllm_completions");
    // The request vLLM ran under is the call's id; that one was aborted, and only it.
    assert_eq!(log["aborted"], json!([record["call_id"]]), "{log:#}");
    let asked = log["completions"].as_array().unwrap();
    assert_eq!(asked.len(), 1, "{log:#}");
    assert_eq!(asked[0]["request_id"], record["call_id"]);
    // Fewer ids were sampled than the whole answer: it was stopped, not finished.
    let sampled = record["completion_token_ids"]
        .as_array()
        .map_or(0, Vec::len);
    assert!(sampled < 30, "{record:#}");
}

/// What vLLM refuses, and an error inside a stream (HTTP 200, then an error event), reach
/// the client as errors in its own dialect naming the backend's words.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn vllm_wire_refusals_and_stream_errors_reach_the_client_in_its_dialect() {
    let s = own(
        &json!({"rules": [{"match": "graft-fault-500", "fault": "500"},
            {"match": "graft-fault-abort", "fault": "abort", "reply": {"content": "cut short"}}]}),
        &[],
    );
    let (_, base) = common::open_session(&s.gateway.url).await;
    let url = format!("{base}/chat/completions");
    let chat = |text: &str, stream: bool| json!({"model": "qwen3", "stream": stream, "messages": [{"role": "user", "content": text}]});

    // A max_tokens that does not fit beside the prompt: vLLM's 400, relayed.
    let mut too_long = chat("hello", false);
    too_long["max_tokens"] = json!(50_000);
    let r = http::post_json(&url, &[], &too_long).await;
    assert_eq!(r.status, 400, "{}", r.text());
    let msg = r.json()["error"]["message"].as_str().unwrap().to_string();
    assert!(msg.contains("maximum context length"), "{msg}");

    // A streamed generation error: 200, then an error event the client sees as an error.
    let r = http::post_json(&url, &[], &chat("graft-fault-500", true)).await;
    assert_eq!(r.status, 200, "{}", r.text());
    let data = r.sse_data();
    assert!(
        data.iter()
            .any(|d| d.contains("\"error\"") && d.contains("scripted fault 500")),
        "{data:#?}"
    );

    // The same on Anthropic's wire: its own error shape.
    let r = http::post_json(
        &format!("{base}/messages"),
        &[],
        &json!({"model": "qwen3", "max_tokens": 50_000, "messages": [{"role": "user", "content": "hi"}]}),
    )
    .await;
    assert_eq!(r.status, 400, "{}", r.text());
    assert_eq!(r.json()["type"], "error", "{}", r.text());

    // finish_reason "abort" from vLLM is an error, not an answer.
    let r = http::post_json(&url, &[], &chat("graft-fault-abort", false)).await;
    assert!(r.status >= 500, "{}", r.text());
    assert!(r.text().contains("abort"), "{}", r.text());

    let recs = common::records_show(&s.data_dir);
    assert!(
        recs.iter()
            .all(|r| r["upstream_dialect"] == "vllm_completions"),
        "{recs:#?}"
    );
}

/// Structured output over the vLLM wire: each dialect's schema reaches vLLM as
/// `structured_outputs` (`json`, or `json_object` for any object), as vLLM's own chat server
/// turns `response_format` into it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn vllm_wire_structured_output_reaches_the_backend_in_every_dialect() {
    let schema = json!({"type": "object", "properties": {"title": {"type": "string"}},
        "required": ["title"]});
    let user = json!([{"role": "user", "content": "hello"}]);
    let cases = [
        (
            "chat/completions",
            json!({"model": "qwen3", "messages": user, "response_format": {"type": "json_schema",
                "json_schema": {"name": "title", "schema": schema}}}),
            json!({"json": schema}),
        ),
        (
            "chat/completions",
            json!({"model": "qwen3", "messages": user, "response_format": {"type": "json_object"}}),
            json!({"json_object": true}),
        ),
        (
            "responses",
            json!({"model": "qwen3", "input": "hello", "text": {"format": {"type": "json_schema",
                "name": "title", "schema": schema}}}),
            json!({"json": schema}),
        ),
        (
            "messages",
            json!({"model": "qwen3", "max_tokens": 100, "messages": user,
                "output_config": {"format": {"type": "json_schema", "schema": schema}}}),
            json!({"json": schema}),
        ),
    ];
    let s = stack(&[]);
    let base = s.base_url(None);
    for (path, body, _) in &cases {
        let r = http::post_json(
            &format!("{base}/{path}"),
            &[("anthropic-version", "2023-06-01")],
            body,
        )
        .await;
        assert_eq!(r.status, 200, "{path}: {}", r.text());
    }
    let log = vllm_log(&s.upstream.url).await;
    let sent = log["completions"].as_array().unwrap();
    assert_eq!(sent.len(), cases.len(), "{log}");
    for ((path, _, want), got) in cases.iter().zip(sent) {
        assert_eq!(got["body"]["structured_outputs"], *want, "{path}: {got}");
    }
}

/// The structural tag a `/v1/completions` body carries (`structured_outputs.structural_tag`,
/// a JSON string), read.
fn structural_tag(body: &Value) -> Value {
    let s = body["structured_outputs"]["structural_tag"]
        .as_str()
        .unwrap_or_else(|| panic!("no structural tag: {body}"));
    assert_eq!(
        body["structured_outputs"].as_object().unwrap().len(),
        1,
        "one constraint: {body}"
    );
    serde_json::from_str(s).unwrap()
}

/// Issue 31 over the vLLM wire, with vLLM's default `VLLM_ENFORCE_STRICT_TOOL_CALLING`: a
/// `tool_choice` that forces a call is sent as vLLM 0.34's chat server sends it, a
/// structural tag in the model's own `<tool_call>` syntax (vLLM's `hermes` tag: two forms per
/// tool, only calls, at least one; a named function's alone) in place of the
/// `response_format`; under `auto` a strict tool gets the `required` tag OR the format.
/// The answer is parsed from the model's markup like `auto` (reasoning separated, calls out
/// of the `<tool_call>` blocks); a named call's finish reason is `stop` (OpenAI's and
/// vLLM's), and an answer without a call keeps its text as content.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn vllm_wire_forced_tool_calls_get_the_structural_tag_and_parse_the_models_markup() {
    let script = json!({"rules": [
        {"match": "both cities", "reply": {"reasoning": "Two calls.", "tool_calls": [
            {"name": "get_weather", "arguments": {"city": "Paris"}},
            {"name": "get_time", "arguments": {}}]}},
        {"match": "paris only", "reply": {"reasoning": "One.", "tool_calls": [
            {"name": "get_weather", "arguments": {"city": "Paris"}}]}},
        {"match": "refuse", "reply": {"content": "I will not call a tool."}}
    ]});
    let o = own(&script, &[]);
    let (_, base) = common::open_session(&o.gateway.url).await;
    let weather = json!({"type": "object", "properties": {"city": {"type": "string"}}});
    let tools = json!([
        {"type": "function", "function": {"name": "get_weather", "parameters": weather, "strict": true}},
        {"type": "function", "function": {"name": "get_time"}}
    ]);
    let ask = |text: &str, choice: Value, stream: bool| {
        json!({"model": "qwen3", "stream": stream, "tools": tools, "tool_choice": choice,
            "messages": [{"role": "user", "content": text}],
            "response_format": {"type": "json_object"}})
    };
    let url = format!("{base}/chat/completions");
    let named = json!({"type": "function", "function": {"name": "get_weather"}});
    let calls_of = |m: &Value| -> Vec<(String, String)> {
        m["tool_calls"]
            .as_array()
            .unwrap_or_else(|| panic!("{m}"))
            .iter()
            .map(|c| {
                (
                    c["function"]["name"].as_str().unwrap().to_owned(),
                    c["function"]["arguments"].as_str().unwrap().to_owned(),
                )
            })
            .collect()
    };
    let blank = |m: &Value| m["content"].as_str().is_none_or(|c| c.trim().is_empty());
    for stream in [false, true] {
        // `required`: both calls, parsed from the model's own markup.
        let r = http::post_json(&url, &[], &ask("both cities", json!("required"), stream)).await;
        assert_eq!(r.status, 200, "{}", r.text());
        let m = common::chat_message(&r);
        assert!(blank(&m), "{m}");
        assert_eq!(m["reasoning"], "Two calls.", "{m}");
        let args: Vec<(String, Value)> = calls_of(&m)
            .into_iter()
            .map(|(n, a)| (n, serde_json::from_str(&a).unwrap()))
            .collect();
        assert_eq!(
            args,
            [
                ("get_weather".to_owned(), json!({"city": "Paris"})),
                ("get_time".to_owned(), json!({}))
            ],
            "{m}"
        );
        assert_eq!(m["finish_reason"], "tool_calls", "{m}");
        // A named function: its call, out of the markup; the finish reason stays `stop`.
        let r = http::post_json(&url, &[], &ask("paris only", named.clone(), stream)).await;
        assert_eq!(r.status, 200, "{}", r.text());
        let m = common::chat_message(&r);
        assert!(blank(&m), "{m}");
        let calls = calls_of(&m);
        assert_eq!(calls.len(), 1, "{m}");
        assert_eq!(calls[0].0, "get_weather", "{m}");
        assert_eq!(
            serde_json::from_str::<Value>(&calls[0].1).unwrap(),
            json!({"city": "Paris"})
        );
        assert_eq!(m["finish_reason"], "stop", "{m}");
        // No call in the answer: its text stays content (vLLM's `auto` reading).
        let r = http::post_json(&url, &[], &ask("refuse", json!("required"), stream)).await;
        assert_eq!(r.status, 200, "{}", r.text());
        let m = common::chat_message(&r);
        assert_eq!(m["content"], "I will not call a tool.", "{m}");
        assert!(m["tool_calls"].as_array().is_none_or(Vec::is_empty), "{m}");
        assert_eq!(m["finish_reason"], "stop", "{m}");
    }
    let log = vllm_log(&o.upstream.url).await;
    let sent = log["completions"].as_array().unwrap();
    assert_eq!(sent.len(), 6, "{log}");
    let begins = |format: &Value| -> Vec<String> {
        format["tags"]
            .as_array()
            .unwrap()
            .iter()
            .map(|t| t["begin"].as_str().unwrap().to_owned())
            .collect()
    };
    let form = |name: &str| {
        [
            format!("<tool_call>\n{{\"name\": \"{name}\", \"arguments\": "),
            format!("<tool_call>{{\"name\": \"{name}\", \"arguments\": "),
        ]
    };
    for (i, got) in sent.iter().enumerate() {
        let tag = structural_tag(&got["body"]);
        assert_eq!(tag["type"], "structural_tag", "{tag}");
        let f = &tag["format"];
        assert_eq!(f["type"], "tags_with_separator", "call {i}: {tag}");
        assert_eq!(f["at_least_one"], true, "{tag}");
        match i % 3 {
            // Named: its two forms alone, one call.
            1 => {
                assert_eq!(begins(f), form("get_weather"), "{tag}");
                assert_eq!(f["stop_after_first"], true, "{tag}");
            }
            _ => {
                let mut want = form("get_weather").to_vec();
                want.extend(form("get_time"));
                assert_eq!(begins(f), want, "{tag}");
                assert_eq!(f["stop_after_first"], false, "{tag}");
            }
        }
        // The strict tool's arguments are held to its schema, the other's are any JSON.
        assert_eq!(f["tags"][0]["content"]["json_schema"], weather, "{tag}");
        if i % 3 != 1 {
            assert_eq!(f["tags"][2]["content"]["json_schema"], true, "{tag}");
        }
    }
    // `parallel_tool_calls: false`: one call.
    let mut one = ask("both cities", json!("required"), false);
    one["parallel_tool_calls"] = json!(false);
    let r = http::post_json(&url, &[], &one).await;
    assert_eq!(r.status, 200, "{}", r.text());
    let tag = structural_tag(&last_completion(&vllm_log(&o.upstream.url).await)["body"]);
    assert_eq!(tag["format"]["stop_after_first"], true, "{tag}");
    // `auto` with a strict tool and a response format: the `required` tag OR the format.
    let r = http::post_json(&url, &[], &ask("paris only", json!("auto"), false)).await;
    assert_eq!(r.status, 200, "{}", r.text());
    let m = common::chat_message(&r);
    assert_eq!(calls_of(&m).len(), 1, "{m}");
    assert_eq!(m["finish_reason"], "tool_calls", "{m}");
    let tag = structural_tag(&last_completion(&vllm_log(&o.upstream.url).await)["body"]);
    assert_eq!(tag["format"]["type"], "or", "{tag}");
    assert_eq!(tag["format"]["elements"][0]["type"], "tags_with_separator");
    assert_eq!(
        tag["format"]["elements"][1]["json_schema"],
        json!({"type": "object"}),
        "{tag}"
    );
    // `auto` with no strict tool and no format: nothing constrains the decode.
    let mut loose = ask("paris only", json!("auto"), false);
    loose["tools"][0]["function"]
        .as_object_mut()
        .unwrap()
        .remove("strict");
    loose.as_object_mut().unwrap().remove("response_format");
    let r = http::post_json(&url, &[], &loose).await;
    assert_eq!(r.status, 200, "{}", r.text());
    let last = last_completion(&vllm_log(&o.upstream.url).await);
    assert!(last["body"].get("structured_outputs").is_none(), "{last}");
}

/// Issue 31 over the vLLM wire, with `exact.vllm_strict_tool_calling = false` (a vLLM run
/// with `VLLM_ENFORCE_STRICT_TOOL_CALLING=0`): a `tool_choice` that forces a call is
/// answered as vLLM's chat server then answers it. The decode is constrained to vLLM's JSON
/// schema (`get_json_schema_from_tools`: a list of `{"name", "parameters"}` under
/// `required`, the function's parameters under a named choice) in place of any
/// `response_format`, the prompt renders every tool, and the answer after the reasoning is
/// read as the calls (never content): a list under `required` (arguments as Python's
/// `json.dumps`), the arguments themselves under a named choice, whose finish reason is
/// `stop` (OpenAI's and vLLM's).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn vllm_wire_without_strict_tool_calling_forces_json_calls_and_reads_them_as_vllm_does() {
    let script = json!({"rules": [
        {"match": "both cities", "reply": {"reasoning": "Two calls.",
            "content": "[{\"name\": \"get_weather\", \"parameters\": {\"city\":\"Paris\"}}, {\"name\": \"get_time\", \"parameters\": {}}]"}},
        {"match": "paris only", "reply": {"reasoning": "One.", "content": "{\"city\": \"Paris\"}"}},
        {"match": "refuse", "reply": {"content": "I will not call a tool."}}
    ]});
    let o = own_with(&script, &[], "vllm_strict_tool_calling = false");
    let (_, base) = common::open_session(&o.gateway.url).await;
    let weather = json!({"type": "object", "properties": {"city": {"type": "string"}}});
    let tools = json!([
        {"type": "function", "function": {"name": "get_weather", "parameters": weather}},
        {"type": "function", "function": {"name": "get_time"}}
    ]);
    let ask = |text: &str, choice: Value, stream: bool| {
        json!({"model": "qwen3", "stream": stream, "tools": tools, "tool_choice": choice,
            "messages": [{"role": "user", "content": text}],
            "response_format": {"type": "json_object"}})
    };
    let url = format!("{base}/chat/completions");
    let named = json!({"type": "function", "function": {"name": "get_weather"}});
    for stream in [false, true] {
        // `required`: two calls out of the list, no content.
        let r = http::post_json(&url, &[], &ask("both cities", json!("required"), stream)).await;
        assert_eq!(r.status, 200, "{}", r.text());
        let m = common::chat_message(&r);
        // A forced call's message has content `""` at least (`assemble_chat_message_fields`);
        // a stream sends no content delta for it.
        assert_eq!(
            m["content"],
            if stream { Value::Null } else { json!("") },
            "{m}"
        );
        assert_eq!(m["reasoning"], "Two calls.", "{m}");
        let calls: Vec<(String, String)> = m["tool_calls"]
            .as_array()
            .unwrap_or_else(|| panic!("{m}"))
            .iter()
            .map(|c| {
                (
                    c["function"]["name"].as_str().unwrap().to_owned(),
                    c["function"]["arguments"].as_str().unwrap().to_owned(),
                )
            })
            .collect();
        assert_eq!(
            calls,
            [
                ("get_weather".to_owned(), "{\"city\": \"Paris\"}".to_owned()),
                ("get_time".to_owned(), "{}".to_owned())
            ],
            "{m}"
        );
        assert_eq!(m["finish_reason"], "tool_calls", "{m}");
        // A named function: the answer is its arguments; the finish reason stays `stop`.
        let r = http::post_json(&url, &[], &ask("paris only", named.clone(), stream)).await;
        assert_eq!(r.status, 200, "{}", r.text());
        let m = common::chat_message(&r);
        // A forced call's message has content `""` at least (`assemble_chat_message_fields`);
        // a stream sends no content delta for it.
        assert_eq!(
            m["content"],
            if stream { Value::Null } else { json!("") },
            "{m}"
        );
        assert_eq!(m["tool_calls"][0]["function"]["name"], "get_weather", "{m}");
        assert_eq!(
            m["tool_calls"][0]["function"]["arguments"], "{\"city\": \"Paris\"}",
            "{m}"
        );
        assert_eq!(m["finish_reason"], "stop", "{m}");
        // An answer that is not a list of calls: no call, and no content (vLLM's reading: `""`
        // whole, the request forcing a call).
        let r = http::post_json(&url, &[], &ask("refuse", json!("required"), stream)).await;
        assert_eq!(r.status, 200, "{}", r.text());
        let m = common::chat_message(&r);
        assert_eq!(
            m["content"],
            if stream { Value::Null } else { json!("") },
            "{m}"
        );
        assert!(m["tool_calls"].as_array().is_none_or(Vec::is_empty), "{m}");
        assert_eq!(m["finish_reason"], "stop", "{m}");
    }
    let log = vllm_log(&o.upstream.url).await;
    let sent = log["completions"].as_array().unwrap();
    assert_eq!(sent.len(), 6, "{log}");
    let required = json!({"json": {"type": "array", "minItems": 1, "items": {"type": "object", "anyOf": [
        {"properties": {"name": {"type": "string", "enum": ["get_weather"]}, "parameters": weather},
         "required": ["name", "parameters"]},
        {"properties": {"name": {"type": "string", "enum": ["get_time"]},
            "parameters": {"type": "object", "properties": {}}},
         "required": ["name", "parameters"]}
    ]}}});
    for (i, got) in sent.iter().enumerate() {
        let want = match i % 3 {
            1 => json!({"json": weather}),
            _ => required.clone(),
        };
        assert_eq!(got["body"]["structured_outputs"], want, "call {i}: {got}");
    }
    // `parallel_tool_calls: false` allows one call.
    let mut one = ask("both cities", json!("required"), false);
    one["parallel_tool_calls"] = json!(false);
    let r = http::post_json(&url, &[], &one).await;
    assert_eq!(r.status, 200, "{}", r.text());
    let log = vllm_log(&o.upstream.url).await;
    let last = last_completion(&log);
    assert_eq!(
        last["body"]["structured_outputs"]["json"]["maxItems"], 1,
        "{last}"
    );
    // Every tool is in every prompt (vLLM renders them all, whatever the choice).
    for got in log["completions"].as_array().unwrap() {
        let text = got["prompt_text"].as_str().unwrap();
        assert!(
            text.contains("\"get_time\"") && text.contains("\"get_weather\""),
            "{text}"
        );
    }
    // ... `none` too.
    let mut none = ask("paris only", json!("none"), false);
    none.as_object_mut().unwrap().remove("response_format");
    let r = http::post_json(&url, &[], &none).await;
    assert_eq!(r.status, 200, "{}", r.text());
    let log = vllm_log(&o.upstream.url).await;
    let last = last_completion(&log);
    assert!(
        last["prompt_text"]
            .as_str()
            .unwrap()
            .contains("\"get_time\""),
        "{last}"
    );
    assert!(last["body"].get("structured_outputs").is_none(), "{last}");
}

/// Issue 31 over the vLLM wire: a stop string ends the client's text before it while the
/// record keeps it (vLLM's `include_stop_str_in_output`) and names it (`stop_reason`); the
/// sampled tokens' logprobs are answered and equal the recorded ones, and the alternatives
/// (`top_logprobs`, Completions' `logprobs: n`) as vLLM's endpoints answer them; a prompt past
/// `exact.context_length` never reaches vLLM, and a long limit is clamped in `max_tokens`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn vllm_wire_trims_stop_strings_answers_logprobs_and_keeps_the_context_budget() {
    let script = json!({"rules": [
        {"match": "run the code", "reply": {"content": "Code:\nprint(2)<end_code>\nObservation: 2, and more follows."}}
    ]});
    let env = TestEnv::get();
    let q = env.qwen3_dir();
    let q = q.to_str().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let data_dir = dir.path().join("data");
    let script_path = dir.path().join("script.json");
    std::fs::write(&script_path, script.to_string()).unwrap();
    let cfg = dir.path().join("graft.toml");
    std::fs::write(&cfg, "[exact]\nwire = \"vllm\"\ncontext_length = 200\n").unwrap();
    let upstream =
        Proc::scripted_upstream(&["--script", script_path.to_str().unwrap(), "--tokenizer", q]);
    let gateway = Proc::gateway_with(
        &upstream.url,
        &data_dir,
        &[
            "--mode",
            "exact",
            "--model-dir",
            q,
            "--config",
            cfg.to_str().unwrap(),
        ],
        &[],
    );
    let (sid, base) = common::open_session(&gateway.url).await;
    let url = format!("{base}/chat/completions");
    let body = |stream: bool| {
        json!({"model": "qwen3", "stream": stream, "logprobs": true, "stop": ["Observation:", "Calling tools:", "</code>"],
            "messages": [{"role": "user", "content": "run the code"}]})
    };
    let whole = http::post_json(&url, &[], &body(false)).await;
    assert_eq!(whole.status, 200, "{}", whole.text());
    let whole = whole.json();
    assert_eq!(
        whole["choices"][0]["message"]["content"]
            .as_str()
            .unwrap()
            .trim_end(),
        "Code:\nprint(2)<end_code>",
        "{whole}"
    );
    let streamed = http::post_json(&url, &[], &body(true)).await;
    assert_eq!(streamed.status, 200, "{}", streamed.text());
    let data = streamed.sse_data();
    let chunks: Vec<Value> = data[..data.len() - 1]
        .iter()
        .map(|d| serde_json::from_str(d).unwrap())
        .collect();
    let msg = common::assemble_chat(&chunks);
    assert_eq!(
        msg["content"].as_str().unwrap().trim_end(),
        "Code:\nprint(2)<end_code>"
    );
    let streamed_lps: Vec<f32> = chunks
        .iter()
        .flat_map(|c| {
            c["choices"][0]["logprobs"]["content"]
                .as_array()
                .cloned()
                .unwrap_or_default()
        })
        .map(|e| e["logprob"].as_f64().unwrap() as f32)
        .collect();

    let long = "word ".repeat(300);
    let r = http::post_json(
        &url,
        &[],
        &json!({"model": "qwen3", "messages": [{"role": "user", "content": long}]}),
    )
    .await;
    assert_eq!(r.status, 400, "{}", r.text());
    assert_eq!(r.json()["error"]["code"], "context_length_exceeded");

    let log = vllm_log(&upstream.url).await;
    let sent = log["completions"].as_array().unwrap();
    assert_eq!(sent.len(), 2, "the refused calls never reached vLLM: {log}");
    let records = common::records_show(&data_dir);
    let recs: Vec<&Value> = records.iter().filter(|r| r["session_id"] == sid).collect();
    // The context refusal is recorded.
    assert_eq!(recs.len(), 3);
    let prompt = ids(&recs[0]["prompt_token_ids"]).len() as u64;
    assert_eq!(sent[0]["body"]["max_tokens"], json!(200 - prompt), "{log}");
    assert_eq!(sent[0]["body"]["include_stop_str_in_output"], true);
    let content_lps: Vec<f32> = whole["choices"][0]["logprobs"]["content"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["logprob"].as_f64().unwrap() as f32)
        .collect();
    for (r, lps) in [(recs[0], content_lps), (recs[1], streamed_lps)] {
        assert_eq!(f32s(&r["completion_logprobs"]), lps, "{r}");
        assert_eq!(r["finish_reason"], "stop", "{r}");
        assert_eq!(r["backend_finish_reason"], "stop", "{r}");
        assert_eq!(r["stop_matched"], "Observation:", "{r}");
    }
    assert_eq!(recs[2]["outcome"], "client_error");
    assert_eq!(recs[2]["status"], 400);

    // The most likely alternatives: asked of vLLM (`logprobs: n`, keyed by id), answered as
    // vLLM's own endpoints answer them. Chat shows the first `top_logprobs` of a position's
    // candidates in vLLM's order, the sampled token first (even where a likelier one
    // exists: the scripted model makes `id + 1` likelier); Completions all it sent, `n + 1`
    // where the sampled token is not among the top `n`.
    let tok =
        graft_reconstruct::template::Tokenizer::from_dir(&TestEnv::get().qwen3_dir()).unwrap();
    let name = |id: u32| tok.decode(&[id]).unwrap();
    for stream in [false, true] {
        let mut top = body(stream);
        top["top_logprobs"] = json!(2);
        let r = http::post_json(&url, &[], &top).await;
        assert_eq!(r.status, 200, "{}", r.text());
        let entries: Vec<Value> = if stream {
            r.sse_data()
                .iter()
                .filter(|d| d.as_str() != "[DONE]")
                .flat_map(|d| {
                    let c: Value = serde_json::from_str(d).unwrap();
                    c["choices"][0]["logprobs"]["content"]
                        .as_array()
                        .cloned()
                        .unwrap_or_default()
                })
                .collect()
        } else {
            r.json()["choices"][0]["logprobs"]["content"]
                .as_array()
                .unwrap()
                .clone()
        };
        let recs = common::records_show(&data_dir);
        let rec = recs.last().unwrap();
        let sampled = ids(&rec["completion_token_ids"]);
        assert_eq!(entries.len(), sampled.len(), "{}", r.text());
        for (e, &id) in entries.iter().zip(&sampled) {
            let t = e["top_logprobs"].as_array().unwrap();
            assert_eq!(t.len(), 2, "{e}");
            assert_eq!(t[0]["token"], name(id), "{e}");
            assert_eq!(t[0]["logprob"], e["logprob"], "{e}");
            assert_eq!(t[1]["token"], name(id + 1), "{e}");
            assert!(t[1]["logprob"].as_f64() > e["logprob"].as_f64(), "{e}");
        }
    }
    let r = http::post_json(
        &format!("{base}/completions"),
        &[],
        &json!({"model": "qwen3", "prompt": "run the code", "logprobs": 1, "max_tokens": 8}),
    )
    .await;
    assert_eq!(r.status, 200, "{}", r.text());
    let lp = &r.json()["choices"][0]["logprobs"];
    let tops = lp["top_logprobs"].as_array().unwrap();
    assert!(!tops.is_empty(), "{lp}");
    for (t, token) in tops.iter().zip(lp["tokens"].as_array().unwrap()) {
        let t = t.as_object().unwrap();
        // The scripted top 1 is not the sampled token: both are shown, the sampled first.
        assert_eq!(t.len(), 2, "the sampled token and the top 1: {lp}");
        assert_eq!(t.keys().next().map(String::as_str), token.as_str(), "{lp}");
    }
    let log = vllm_log(&upstream.url).await;
    let last = last_completion(&log);
    assert_eq!(last["body"]["logprobs"], 1, "{last}");
    assert_eq!(last["body"]["return_tokens_as_token_ids"], true, "{last}");
}

/// The calls of one weight push to vLLM, in order (`graft_trainer::push::push_weights_vllm`).
const VLLM_PUSH: [&str; 5] = [
    "/pause?mode=keep",
    "/reset_prefix_cache?reset_running_requests=true",
    "/collective_rpc",
    "/update_weight_version",
    "/resume",
];

/// An `rl.toml` whose one backend is `upstream`, over the vLLM wire.
fn rl_config(dir: &std::path::Path, upstream: &str) -> graft::rl::config::RlConfig {
    let q = TestEnv::get().qwen3_dir();
    std::fs::write(dir.join("t.jsonl"), "{\"prompt\": \"x\"}\n").unwrap();
    let path = dir.join("rl.toml");
    std::fs::write(
        &path,
        format!(
            "[run]\nout_dir = \"o\"\nsteps = 1\n[tasks]\nfile = \"t.jsonl\"\n[harness]\ncommand = \"true\"\n[backend]\nmodel_dir = \"{}\"\nurls = [\"{upstream}\"]\nwire = \"vllm\"\nrestart_wait_secs = 2\n",
            q.display()
        ),
    )
    .unwrap();
    graft::rl::config::RlConfig::load(&path).unwrap()
}

/// A weight push from `graft rl` to a vLLM backend while a call streams through the gateway
/// is not drained: vLLM pauses in place (`/pause?mode=keep`; the scripted one holds the
/// generation after 3 tokens until the new weights land), the push completes while the
/// stream is still open, the stream goes on whole, a new call right after is answered with
/// the new weights, and the record labels each token with the weights that sampled it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn vllm_wire_push_from_graft_rl_keeps_the_calls_in_flight_running() {
    use graft::rl::backends::Shared;
    use graft::rl::rollout::Api;
    let s = own(
        &json!({"rules": [
            {"match": "weights change", "weight_update_after": 3, "reply": {"content": "Partly old weights, partly new ones: both are recorded."}},
            {"match": "after the push", "reply": {"content": "Answered with the new weights."}}
        ]}),
        &["--vllm-dev-mode"],
    );
    let cfg = rl_config(s._dir.path(), &s.upstream.url);
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
    while text.is_empty() {
        let d = http::next_sse_data(&mut body, &mut buf)
            .await
            .expect("stream ended early");
        let c: Value = serde_json::from_str(&d).unwrap();
        text.push_str(
            c["choices"][0]["delta"]["content"]
                .as_str()
                .unwrap_or_default(),
        );
    }
    // The stream is held by the backend until new weights land. A draining push would wait
    // for it (and it for the push): this one returns.
    let gateway = Api::new(&s.gateway.url, common::admin_auth(&s.data_dir));
    tokio::time::timeout(
        Duration::from_secs(30),
        shared.push(
            &cfg,
            &gateway,
            std::slice::from_ref(&s.upstream.url),
            std::path::Path::new("/ckpt/step-1"),
            "step-1",
        ),
    )
    .await
    .expect("the push waited for the call in flight")
    .unwrap();
    let status = http::get(&format!("{}/graft/backend/status", s.gateway.url), &[]).await;
    assert_eq!(status.json()["paused"], json!(false), "{}", status.text());
    // vLLM was asked in order, with vLLM's bodies, and serves the new version.
    let log = vllm_log(&s.upstream.url).await;
    let control = log["control"].as_array().unwrap();
    let paths: Vec<&str> = control
        .iter()
        .map(|c| c["path"].as_str().unwrap())
        .collect();
    assert_eq!(paths, VLLM_PUSH, "{log:#}");
    assert_eq!(
        control[2]["body"],
        json!({"method": "reload_weights", "kwargs": {"weights_path": "/ckpt/step-1"}})
    );
    assert_eq!(control[3]["body"], json!({"new_version": "step-1"}));
    // The watchdog reads the served version from /weight_info.
    let info = graft::rl::backends::vllm_weight_info(&Api::new(&s.upstream.url, None)).await;
    assert_eq!(info, Some(json!({"weight_version": "step-1"})));
    // A new call goes straight through.
    let r = http::post_json(
        &url,
        &[],
        &json!({"model": "qwen3", "messages": [{"role": "user", "content": "after the push"}]}),
    )
    .await;
    assert_eq!(r.status, 200, "{}", r.text());
    // The held stream ends whole.
    while let Some(d) = http::next_sse_data(&mut body, &mut buf).await {
        if d == "[DONE]" {
            break;
        }
        let c: Value = serde_json::from_str(&d).unwrap();
        text.push_str(
            c["choices"][0]["delta"]["content"]
                .as_str()
                .unwrap_or_default(),
        );
    }
    assert_eq!(
        text,
        "Partly old weights, partly new ones: both are recorded."
    );
    let deadline = Instant::now() + Duration::from_secs(20);
    let recs = loop {
        let recs: Vec<Value> = common::records_show(&s.data_dir)
            .into_iter()
            .filter(|r| r["session_id"] == sid)
            .collect();
        if recs.len() == 2 || Instant::now() > deadline {
            break recs;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    let held = recs
        .iter()
        .find(|r| r["stream"] == json!(true))
        .unwrap_or_else(|| panic!("{recs:#?}"));
    assert_eq!(held["upstream_dialect"], "vllm_completions", "{held:#}");
    let n = ids(&held["completion_token_ids"]).len() as u64;
    assert_eq!(
        held["weight_version_spans"],
        json!([{"version": "default", "start": 0, "end": 3}, {"version": "step-1", "start": 3, "end": n}]),
        "{held:#}"
    );
    let after = recs.iter().find(|r| r["stream"] == json!(false)).unwrap();
    assert_eq!(after["weight_version"], "step-1", "{after:#}");
    assert_eq!(log["aborted"], json!([]), "{log:#}");

    // Between /pause?mode=keep and /resume a new call waits in vLLM's queue, then is
    // answered: nothing is refused or aborted.
    let up = Api::new(&s.upstream.url, None);
    up.ok(::http::Method::POST, "/pause?mode=keep", None)
        .await
        .unwrap();
    let waiting = tokio::spawn({
        let url = url.clone();
        async move {
            http::post_json(
                &url,
                &[],
                &json!({"model": "qwen3", "messages": [{"role": "user", "content": "after the push"}]}),
            )
            .await
        }
    });
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(
        !waiting.is_finished(),
        "a call was answered while vLLM was paused"
    );
    up.ok(::http::Method::POST, "/resume", None).await.unwrap();
    let r = tokio::time::timeout(Duration::from_secs(20), waiting)
        .await
        .expect("the call was not answered after /resume")
        .unwrap();
    assert_eq!(r.status, 200, "{}", r.text());
}

/// A vLLM started without `VLLM_SERVER_DEV_MODE=1` has no weight-update routes (404): the
/// push from `graft rl` fails saying how to start it, and nothing is left paused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn vllm_wire_push_without_dev_mode_says_to_start_vllm_with_it() {
    use graft::rl::backends::{Keys, Shared, check_pushable};
    use graft::rl::rollout::Api;
    let q = TestEnv::get().qwen3_dir();
    let upstream = Proc::scripted_upstream(&["--tokenizer", q.to_str().unwrap()]);
    let dir = tempfile::tempdir().unwrap();
    let cfg = rl_config(dir.path(), &upstream.url);
    let e = check_pushable(cfg.backend.wire, &upstream.url, &Keys::default())
        .await
        .unwrap_err();
    assert!(format!("{e:#}").contains("VLLM_SERVER_DEV_MODE=1"), "{e:#}");
    // The gateway is not called without drain_on_push.
    let gateway = Api::new("http://127.0.0.1:9", None);
    let e = Shared::default()
        .push(
            &cfg,
            &gateway,
            std::slice::from_ref(&upstream.url),
            std::path::Path::new("/ckpt/step-1"),
            "step-1",
        )
        .await
        .unwrap_err();
    let msg = format!("{e:#}");
    assert!(
        msg.contains("VLLM_SERVER_DEV_MODE=1") && msg.contains("reset_prefix_cache"),
        "{msg}"
    );
    let log = vllm_log(&upstream.url).await;
    assert_eq!(log["control"], json!([]), "{log:#}");
    // The watchdog still sees it up (GET /health), its weights unknown.
    let info = graft::rl::backends::vllm_weight_info(&Api::new(&upstream.url, None)).await;
    assert_eq!(info, Some(json!({})));
}

/// A vLLM before 0.34 reports no weight versions and (0.11) has no `/pause`: `graft rl`
/// drains it at the gateway for a push, reloads it the way its routes allow
/// (`update_config` pointing `model_config.model` at the checkpoint, then
/// `reload_weights()`), and resumes the gateway with the pushed version, which the gateway
/// records on the calls after it. Before any push the records say no version. A label
/// given to a backend that was not paused is refused by name.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn vllm_before_0_34_is_drained_for_a_push_and_the_gateway_labels_its_calls() {
    use graft::rl::backends::Shared;
    use graft::rl::rollout::Api;
    let s = own(
        &json!({"rules": [
            {"match": "before the push", "reply": {"content": "Old weights."}},
            {"match": "after the push", "reply": {"content": "New weights."}}
        ]}),
        &["--vllm-dev-mode", "--vllm-version", "0.11.0"],
    );
    let cfg = rl_config(s._dir.path(), &s.upstream.url);
    assert!(!cfg.backend.drain_on_push, "pushes do not drain by default");
    let (sid, base) = common::open_session(&s.gateway.url).await;
    let url = format!("{base}/chat/completions");
    let ask =
        |text: &str| json!({"model": "qwen3", "messages": [{"role": "user", "content": text}]});
    let r = http::post_json(&url, &[], &ask("before the push")).await;
    assert_eq!(r.status, 200, "{}", r.text());

    // Without a pause a label would be a guess: refused, nothing resumed or labelled.
    let r = http::post_json(
        &format!("{}/graft/backend/resume", s.gateway.url),
        &[],
        &json!({"backend": s.upstream.url, "weight_version": "guess"}),
    )
    .await;
    assert_eq!(r.status, 400, "{}", r.text());
    assert!(r.text().contains("weight_version"), "{}", r.text());

    let gateway = Api::new(&s.gateway.url, common::admin_auth(&s.data_dir));
    tokio::time::timeout(
        Duration::from_secs(30),
        Shared::default().push(
            &cfg,
            &gateway,
            std::slice::from_ref(&s.upstream.url),
            std::path::Path::new("/ckpt/step-1"),
            "step-1",
        ),
    )
    .await
    .expect("the push hung")
    .unwrap();
    let status = http::get(&format!("{}/graft/backend/status", s.gateway.url), &[]).await;
    assert_eq!(status.json()["paused"], json!(false), "{}", status.text());
    // What 0.11 has: no /pause, /resume or /update_weight_version (404, not logged).
    let log = vllm_log(&s.upstream.url).await;
    let calls: Vec<&Value> = log["control"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|c| c.get("path").is_some())
        .collect();
    let paths: Vec<&str> = calls.iter().map(|c| c["path"].as_str().unwrap()).collect();
    assert_eq!(
        paths,
        [
            "/reset_prefix_cache?reset_running_requests=true",
            "/collective_rpc",
            "/collective_rpc"
        ],
        "{log:#}"
    );
    assert_eq!(
        calls[1]["body"],
        json!({"method": "update_config", "kwargs": {"overrides": {"model_config": {"model": "/ckpt/step-1"}}}})
    );
    assert_eq!(calls[2]["body"], json!({"method": "reload_weights"}));
    assert!(
        log["control"]
            .as_array()
            .unwrap()
            .contains(&json!({"reloaded_from": "/ckpt/step-1"})),
        "{log:#}"
    );
    // The backend's answers carry no versions; the gateway's label does.
    let sent = log["completions"].as_array().unwrap();
    assert!(
        !sent.is_empty()
            && sent
                .iter()
                .all(|c| c["body"]["return_weight_versions"] == json!(true)),
        "{log:#}"
    );
    let r = http::post_json(&url, &[], &ask("after the push")).await;
    assert_eq!(r.status, 200, "{}", r.text());
    let deadline = Instant::now() + Duration::from_secs(20);
    let recs = loop {
        let mut recs: Vec<Value> = common::records_show(&s.data_dir)
            .into_iter()
            .filter(|r| r["session_id"] == sid)
            .collect();
        if recs.len() == 2 || Instant::now() > deadline {
            recs.sort_by_key(|r| r["seq"].as_u64());
            break recs;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert_eq!(recs.len(), 2, "{recs:#?}");
    assert_eq!(recs[0]["weight_version"], Value::Null, "{:#}", recs[0]);
    assert_eq!(recs[1]["weight_version"], "step-1", "{:#}", recs[1]);
    for r in &recs {
        assert_eq!(r["weight_version_spans"], Value::Null, "{r:#}");
        assert_eq!(r["outcome"], "ok", "{r:#}");
    }
}

// ---------------------------------------------------------------------------------------
// The engine families' table: vLLM's own parsers' message, through exact mode, per dialect

/// What a client reads off one answer: content (`None` where the dialect says null or has
/// no text), reasoning, and the calls as `(name, arguments JSON text)`.
#[derive(Debug, Default)]
struct Seen {
    content: Option<String>,
    reasoning: Option<String>,
    calls: Vec<(String, String)>,
    /// Chat's `finish_reason`.
    finish: Option<String>,
}

/// The events of an SSE body, as JSON.
fn sse_events(r: &http::Resp) -> Vec<Value> {
    r.sse_data()
        .iter()
        .filter(|d| d.as_str() != "[DONE]")
        .map(|d| serde_json::from_str(d).unwrap_or_else(|e| panic!("{e}: {d}")))
        .collect()
}

fn push_opt(slot: &mut Option<String>, s: &str) {
    slot.get_or_insert_with(String::new).push_str(s);
}

/// A Chat answer as vLLM's chat endpoint shapes it: reasoning in `reasoning` (never
/// `reasoning_content`), whole or streamed.
fn read_chat(r: &http::Resp, stream: bool) -> Seen {
    let mut out = Seen::default();
    if !stream {
        let v = r.json();
        let m = &v["choices"][0]["message"];
        assert!(m.get("reasoning_content").is_none(), "{v}");
        out.content = m["content"].as_str().map(str::to_owned);
        out.reasoning = m["reasoning"].as_str().map(str::to_owned);
        for c in m["tool_calls"].as_array().into_iter().flatten() {
            out.calls.push((
                c["function"]["name"].as_str().unwrap().to_owned(),
                c["function"]["arguments"].as_str().unwrap().to_owned(),
            ));
        }
        out.finish = v["choices"][0]["finish_reason"].as_str().map(str::to_owned);
        return out;
    }
    for c in sse_events(r) {
        for ch in c["choices"].as_array().into_iter().flatten() {
            let d = &ch["delta"];
            assert!(d.get("reasoning_content").is_none(), "{c}");
            if let Some(t) = d["content"].as_str().filter(|t| !t.is_empty()) {
                push_opt(&mut out.content, t);
            }
            if let Some(t) = d["reasoning"].as_str() {
                push_opt(&mut out.reasoning, t);
            }
            for tc in d["tool_calls"].as_array().into_iter().flatten() {
                let i = tc["index"].as_u64().unwrap() as usize;
                if i == out.calls.len() {
                    let name = tc["function"]["name"].as_str().unwrap_or_default();
                    out.calls.push((name.to_owned(), String::new()));
                }
                out.calls[i]
                    .1
                    .push_str(tc["function"]["arguments"].as_str().unwrap_or_default());
            }
            if let Some(f) = ch["finish_reason"].as_str() {
                out.finish = Some(f.to_owned());
            }
        }
    }
    out
}

/// A Responses answer: its output items, whole, or the stream's text and reasoning deltas
/// and finished function-call items.
fn read_responses(r: &http::Resp, stream: bool) -> Seen {
    let mut out = Seen::default();
    let item = |out: &mut Seen, it: &Value| {
        if it["type"] == "function_call" {
            out.calls.push((
                it["name"].as_str().unwrap().to_owned(),
                it["arguments"].as_str().unwrap().to_owned(),
            ));
        }
    };
    if !stream {
        for it in r.json()["output"].as_array().into_iter().flatten() {
            match it["type"].as_str() {
                Some("reasoning") => {
                    for c in it["content"].as_array().into_iter().flatten() {
                        push_opt(&mut out.reasoning, c["text"].as_str().unwrap_or_default());
                    }
                }
                Some("message") => {
                    for c in it["content"].as_array().into_iter().flatten() {
                        push_opt(&mut out.content, c["text"].as_str().unwrap_or_default());
                    }
                }
                _ => item(&mut out, it),
            }
        }
        return out;
    }
    for e in sse_events(r) {
        match e["type"].as_str() {
            Some("response.output_text.delta") => {
                push_opt(&mut out.content, e["delta"].as_str().unwrap());
            }
            Some("response.reasoning_text.delta") => {
                push_opt(&mut out.reasoning, e["delta"].as_str().unwrap());
            }
            Some("response.output_item.done") => item(&mut out, &e["item"]),
            _ => {}
        }
    }
    out
}

/// An Anthropic Messages answer: its content blocks, whole or streamed (a `tool_use`'s input
/// as JSON text).
fn read_messages(r: &http::Resp, stream: bool) -> Seen {
    let mut out = Seen::default();
    if !stream {
        for b in r.json()["content"].as_array().into_iter().flatten() {
            match b["type"].as_str() {
                Some("thinking") => push_opt(&mut out.reasoning, b["thinking"].as_str().unwrap()),
                Some("text") => push_opt(&mut out.content, b["text"].as_str().unwrap()),
                Some("tool_use") => out.calls.push((
                    b["name"].as_str().unwrap().to_owned(),
                    b["input"].to_string(),
                )),
                other => panic!("{other:?}: {b}"),
            }
        }
        return out;
    }
    let mut blocks: Vec<(String, String)> = vec![];
    for e in sse_events(r) {
        match e["type"].as_str() {
            Some("content_block_start") => {
                let b = &e["content_block"];
                blocks.push((
                    b["type"].as_str().unwrap().to_owned(),
                    b["name"].as_str().unwrap_or_default().to_owned(),
                ));
                if b["type"] == "tool_use" {
                    out.calls
                        .push((blocks.last().unwrap().1.clone(), String::new()));
                }
            }
            Some("content_block_delta") => {
                let d = &e["delta"];
                match d["type"].as_str() {
                    Some("text_delta") => push_opt(&mut out.content, d["text"].as_str().unwrap()),
                    Some("thinking_delta") => {
                        push_opt(&mut out.reasoning, d["thinking"].as_str().unwrap());
                    }
                    Some("input_json_delta") => out
                        .calls
                        .last_mut()
                        .unwrap()
                        .1
                        .push_str(d["partial_json"].as_str().unwrap()),
                    _ => {}
                }
            }
            _ => {}
        }
    }
    out
}

/// The tools of vLLM's engine fixtures in `dialect`'s form, and its `tool_choice` for a
/// request shape of the fixtures (`None`: the key is left out).
fn dialect_tools(dialect: &str, tools: &[Value], shape: &str) -> (Option<Value>, Option<Value>) {
    if shape == "no tools" {
        return (None, None);
    }
    let given: Vec<Value> = tools
        .iter()
        .map(|t| {
            let f = &t["function"];
            match dialect {
                "chat" => t.clone(),
                "responses" => {
                    json!({"type": "function", "name": f["name"], "parameters": f["parameters"]})
                }
                _ => json!({"name": f["name"], "input_schema": f["parameters"]}),
            }
        })
        .collect();
    let choice = match (dialect, shape) {
        ("messages", "none") => json!({"type": "none"}),
        ("messages", "auto") => json!({"type": "auto"}),
        ("messages", "required") => json!({"type": "any"}),
        ("messages", "named") => json!({"type": "tool", "name": "get_weather"}),
        ("chat", "named") => json!({"type": "function", "function": {"name": "get_weather"}}),
        ("responses", "named") => json!({"type": "function", "name": "get_weather"}),
        (_, other) => json!(other),
    };
    (Some(Value::Array(given)), Some(choice))
}

/// vLLM 0.34's own engine-based parsers (`qwen3_coder` with the `qwen3` reasoning parser on
/// Qwen3's tokenizer and template; `llama3_json` on Llama 3.2's), run by
/// `scripts/vllm-engine-parse-fixtures.py` on every fixture text for every request shape
/// (`reconstruct/tests/fixtures/parse/vllm_engine.jsonl`), against the same text played by
/// the scripted vLLM through graft's exact mode over the vLLM wire: the message a client gets
/// is vLLM's in Chat (whole: content null or `""` exactly as vLLM gives it, reasoning and
/// arguments byte for byte, the finish reason), and its content, reasoning and calls in
/// Responses and Messages, whole and streamed (streamed text compared with its edges
/// trimmed: vLLM moves whitespace-only deltas). Qwen3 thinking off (`chat_template_kwargs`)
/// is a Chat case. Plus `parallel_tool_calls: false` (Anthropic `disable_parallel_tool_use`):
/// only the first call, as vLLM's `maybe_filter_parallel_tool_calls` leaves it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn vllm_wire_answers_the_engine_families_as_vllms_own_parsers_in_every_dialect() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    let dir = root.join("reconstruct/tests/fixtures/parse");
    let tools: Vec<Value> =
        serde_json::from_str(&std::fs::read_to_string(dir.join("vllm_engine_tools.json")).unwrap())
            .unwrap();
    let fixtures: Vec<Value> = std::fs::read_to_string(dir.join("vllm_engine.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let env = TestEnv::get();
    let mut checked = std::collections::BTreeMap::<(&str, &str), usize>::new();
    for (family, model, exact) in [
        (
            "qwen3_coder",
            env.qwen3_dir(),
            "tool_call_format = \"qwen3_coder\"\nreasoning_format = \"think\"",
        ),
        (
            "llama3",
            env.llama3_dir(),
            "tool_call_format = \"llama3\"\nreasoning_format = \"none\"",
        ),
    ] {
        let mine: Vec<&Value> = fixtures.iter().filter(|f| f["family"] == family).collect();
        assert!(mine.len() >= 20, "{family}: {}", mine.len());
        let mut rules: Vec<Value> = mine
            .iter()
            .enumerate()
            .map(|(i, f)| json!({"match": format!("[case-{i}]"), "reply": {"raw": f["text"]}}))
            .collect();
        // Two calls in one answer, for `parallel_tool_calls: false`.
        let two = if family == "llama3" {
            "{\"name\": \"get_weather\", \"parameters\": {\"city\": \"Paris\"}}; {\"name\": \"get_time\", \"parameters\": {\"tz\": \"CET\"}}"
        } else {
            "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n</tool_call>\n<tool_call>\n<function=get_time>\n<parameter=tz>\nCET\n</parameter>\n</function>\n</tool_call>"
        };
        rules.push(json!({"match": "[two-calls]", "reply": {"raw": two}}));
        let o = own_model(&model, &json!({ "rules": rules }), &[], exact);
        let (_, base) = common::open_session(&o.gateway.url).await;
        for (i, f) in mine.iter().enumerate() {
            let text = f["text"].as_str().unwrap();
            for case in f["cases"].as_array().unwrap() {
                let shape = case["request"].as_str().unwrap();
                let thinking = case["thinking"].as_bool();
                for dialect in ["chat", "responses", "messages"] {
                    // Thinking off is asked with Chat's `chat_template_kwargs`.
                    if dialect != "chat" && thinking == Some(false) {
                        continue;
                    }
                    let (given, choice) = dialect_tools(dialect, &tools, shape);
                    for stream in [false, true] {
                        let ask = format!("[case-{i}] go");
                        let mut body = match dialect {
                            "responses" => json!({"model": "m", "input": ask}),
                            _ => json!({"model": "m", "max_tokens": 1024,
                                "messages": [{"role": "user", "content": ask}]}),
                        };
                        body["stream"] = json!(stream);
                        if let Some(t) = &given {
                            body["tools"] = t.clone();
                        }
                        if let Some(c) = &choice {
                            body["tool_choice"] = c.clone();
                        }
                        if thinking == Some(false) {
                            body["chat_template_kwargs"] = json!({"enable_thinking": false});
                        }
                        let path = match dialect {
                            "chat" => "chat/completions",
                            d => d,
                        };
                        let r = http::post_json(
                            &format!("{base}/{path}"),
                            &[("anthropic-version", "2023-06-01")],
                            &body,
                        )
                        .await;
                        let ctx = format!(
                            "{family} / {} / {shape} / thinking {thinking:?} / {dialect} / stream {stream}: {text:?}\n{}",
                            f["name"],
                            r.text()
                        );
                        assert_eq!(r.status, 200, "{ctx}");
                        let got = match dialect {
                            "chat" => read_chat(&r, stream),
                            "responses" => read_responses(&r, stream),
                            _ => read_messages(&r, stream),
                        };
                        let want = &case[if stream { "streamed" } else { "whole" }];
                        let want_calls: Vec<(String, String)> = want["tool_calls"]
                            .as_array()
                            .unwrap()
                            .iter()
                            .map(|c| {
                                (
                                    c["name"].as_str().unwrap().to_owned(),
                                    c["arguments"].as_str().unwrap().to_owned(),
                                )
                            })
                            .collect();
                        let trimmed = |s: Option<&str>| {
                            s.map(str::trim)
                                .filter(|s| !s.is_empty())
                                .map(str::to_owned)
                        };
                        if dialect == "chat" && !stream {
                            assert_eq!(got.content.as_deref(), want["content"].as_str(), "{ctx}");
                            assert_eq!(
                                got.reasoning.as_deref(),
                                want["reasoning"].as_str(),
                                "{ctx}"
                            );
                            let finish = if !want_calls.is_empty() && shape != "named" {
                                "tool_calls"
                            } else {
                                "stop"
                            };
                            assert_eq!(got.finish.as_deref(), Some(finish), "{ctx}");
                        } else {
                            assert_eq!(
                                trimmed(got.content.as_deref()),
                                trimmed(want["content"].as_str()),
                                "{ctx}"
                            );
                            assert_eq!(
                                trimmed(got.reasoning.as_deref()),
                                trimmed(want["reasoning"].as_str()),
                                "{ctx}"
                            );
                        }
                        if dialect == "messages" {
                            // A tool_use's input is an object: compared as JSON values; a
                            // truncated call's arguments are no JSON, and graft's `input` is
                            // then `{}` (only the name is compared).
                            let values = |c: &[(String, String)], of: &[(String, String)]| {
                                c.iter()
                                    .zip(of)
                                    .map(|((n, a), (_, w))| {
                                        let json = serde_json::from_str::<Value>(w).is_ok();
                                        let a: Option<Value> = serde_json::from_str(a).ok();
                                        (n.clone(), json.then_some(a))
                                    })
                                    .collect::<Vec<_>>()
                            };
                            assert_eq!(got.calls.len(), want_calls.len(), "{ctx}");
                            assert_eq!(
                                values(&got.calls, &want_calls),
                                values(&want_calls, &want_calls),
                                "{ctx}"
                            );
                        } else {
                            assert_eq!(got.calls, want_calls, "{ctx}");
                        }
                        *checked.entry((family, dialect)).or_default() += 1;
                    }
                }
            }
        }
        // `parallel_tool_calls: false`: the first call only, whole and streamed, per dialect.
        for dialect in ["chat", "responses", "messages"] {
            for (parallel, n) in [(None, 2), (Some(false), 1)] {
                for stream in [false, true] {
                    let (given, mut choice) = dialect_tools(dialect, &tools, "auto");
                    let mut body = match dialect {
                        "responses" => json!({"model": "m", "input": "[two-calls]"}),
                        _ => json!({"model": "m", "max_tokens": 1024,
                            "messages": [{"role": "user", "content": "[two-calls]"}]}),
                    };
                    if parallel == Some(false) {
                        if dialect == "messages" {
                            choice.as_mut().unwrap()["disable_parallel_tool_use"] = json!(true);
                        } else {
                            body["parallel_tool_calls"] = json!(false);
                        }
                    }
                    body["tools"] = given.unwrap();
                    body["tool_choice"] = choice.unwrap();
                    body["stream"] = json!(stream);
                    let path = match dialect {
                        "chat" => "chat/completions",
                        d => d,
                    };
                    let r = http::post_json(
                        &format!("{base}/{path}"),
                        &[("anthropic-version", "2023-06-01")],
                        &body,
                    )
                    .await;
                    let ctx = format!(
                        "{family} {dialect} parallel {parallel:?} stream {stream}: {}",
                        r.text()
                    );
                    assert_eq!(r.status, 200, "{ctx}");
                    let got = match dialect {
                        "chat" => read_chat(&r, stream),
                        "responses" => read_responses(&r, stream),
                        _ => read_messages(&r, stream),
                    };
                    let names: Vec<&str> = got.calls.iter().map(|c| c.0.as_str()).collect();
                    assert_eq!(names, ["get_weather", "get_time"][..n], "{ctx}");
                }
            }
        }
    }
    // Every dialect of both families ran; a case count that shows the table was walked.
    assert_eq!(checked.len(), 6, "{checked:?}");
    for ((family, dialect), n) in &checked {
        assert!(*n >= 100, "{family} {dialect}: {n}");
    }
}

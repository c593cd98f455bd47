//! Passthrough token ids (`upstream.token_ids = "vllm"`): the gateway asks the upstream for
//! `return_token_ids` and `logprobs`, records the ids and logprobs, and the client gets the
//! answer without the fields it did not ask for. The upstream is the scripted upstream with
//! the real Qwen3 tokenizer and chat template (`--tokenizer`), answering as vLLM does.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::path::Path;

use common::{Proc, TestEnv, http, ids, logprob};
use graft_reconstruct::sample::read_samples_parquet;
use graft_reconstruct::template::{ChatTemplate, Tokenizer};
use serde_json::{Map, Value, json};

fn tools() -> Value {
    json!([{"type": "function", "function": {"name": "bash", "description": "Run a shell command", "parameters": {"type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]}}}])
}

const SCRIPT: &str = r#"{"rules": [
  {"role": "tool", "reply": {"content": "The directory holds a.txt and b.txt."}},
  {"match": "list the files", "reply": {"content": "Let me look.", "tool_calls": [{"name": "bash", "arguments": {"command": "ls -la"}}]}},
  {"match": "just run it", "reply": {"tool_calls": [{"name": "bash", "arguments": {"command": "cat a.txt | wc -l"}}]}}
]}"#;

/// The fields the client must not see (it never asked for them).
fn assert_no_id_fields(v: &Value, what: &str) {
    assert!(v.get("prompt_token_ids").is_none(), "{what}: {v}");
    for c in v["choices"].as_array().unwrap() {
        assert!(c.get("token_ids").is_none(), "{what}: {v}");
        assert!(c.get("prompt_token_ids").is_none(), "{what}: {v}");
    }
}

struct Setup {
    upstream: Proc,
    gateway: Proc,
    data: std::path::PathBuf,
    qwen3: std::path::PathBuf,
    dir: tempfile::TempDir,
}

fn start() -> Setup {
    let env = TestEnv::get();
    let qwen3 = env.qwen3_dir();
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let script = dir.path().join("script.json");
    std::fs::write(&script, SCRIPT).unwrap();
    let config = dir.path().join("graft.toml");
    std::fs::write(&config, "[upstream]\ntoken_ids = \"vllm\"\n").unwrap();
    let upstream = Proc::scripted_upstream(&[
        "--script",
        script.to_str().unwrap(),
        "--tokenizer",
        qwen3.to_str().unwrap(),
    ]);
    let gateway = Proc::gateway_with(
        &upstream.url,
        &data,
        &["--config", config.to_str().unwrap()],
        &[],
    );
    Setup {
        upstream,
        gateway,
        data,
        qwen3,
        dir,
    }
}

/// A two-turn tool session: the model calls `bash`, gets the tool's output, answers.
/// Returns the session id. `logprobs_on_turn2`: the client itself asks for logprobs on the
/// second call (graft must leave its choice and its logprobs alone).
async fn session(gw: &str, stream: bool, first: &str, logprobs_on_turn2: bool) -> String {
    let (sid, base) = common::open_session(gw).await;
    let mut messages = vec![
        json!({"role": "system", "content": "You run shell commands."}),
        json!({"role": "user", "content": first}),
    ];
    for turn in 0..2 {
        let mut body = json!({"model": "qwen3", "tools": tools(), "messages": messages});
        if stream {
            body["stream"] = json!(true);
            body["stream_options"] = json!({"include_usage": true});
        }
        let client_logprobs = turn == 1 && logprobs_on_turn2;
        if client_logprobs {
            body["logprobs"] = json!(true);
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
            assert!(chunks.len() > 3, "streamed in several chunks");
            for c in &chunks {
                assert_no_id_fields(c, "an SSE chunk");
                for ch in c["choices"].as_array().unwrap() {
                    assert!(ch["logprobs"].is_null(), "logprobs nobody asked for: {c}");
                }
            }
            common::assemble_chat(&chunks)
        } else {
            let v = r.json();
            assert_no_id_fields(&v, "a JSON answer");
            if client_logprobs {
                let lp = v["choices"][0]["logprobs"]["content"].as_array().unwrap();
                assert!(!lp.is_empty(), "the client asked for logprobs: {v}");
            } else {
                assert!(v["choices"][0]["logprobs"].is_null(), "{v}");
            }
            v["choices"][0]["message"].clone()
        };
        if turn == 0 {
            let id = msg["tool_calls"][0]["id"].clone();
            assert!(id.is_string(), "a tool call: {msg}");
            messages.push(msg);
            messages.push(json!({"role": "tool", "tool_call_id": id, "content": "a.txt b.txt"}));
        } else {
            assert_eq!(msg["content"], "The directory holds a.txt and b.txt.");
        }
    }
    sid
}

/// What Qwen3 generates for an assistant message: content, each tool call in the Hermes
/// form, the end-of-turn token.
fn generated_text(msg: &Value) -> String {
    let content = msg["content"].as_str().unwrap_or_default();
    let mut out = content.to_string();
    for (i, c) in msg["tool_calls"]
        .as_array()
        .into_iter()
        .flatten()
        .enumerate()
    {
        if i > 0 || !content.is_empty() {
            out.push('\n');
        }
        out.push_str(&format!(
            "<tool_call>\n{{\"name\": \"{}\", \"arguments\": {}}}\n</tool_call>",
            c["function"]["name"].as_str().unwrap(),
            c["function"]["arguments"].as_str().unwrap()
        ));
    }
    out + "<|im_end|>"
}

/// The prompt a vLLM server renders for a request: the chat template with the generation
/// prompt, tokenized.
fn prompt_ids(qwen3: &Path, req: &Value) -> Vec<u32> {
    let t = ChatTemplate::from_dir(qwen3).unwrap();
    let tok = Tokenizer::from_dir(qwen3).unwrap();
    let messages: Vec<Value> = req["messages"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| {
            let mut m = m.clone();
            if m["content"].is_null() {
                m["content"] = json!("");
            }
            m
        })
        .collect();
    let tools = req["tools"].as_array().unwrap();
    let text = t.render(&messages, Some(tools), true, &Map::new()).unwrap();
    tok.encode(&text).unwrap()
}

fn assert_record_has_ids(rec: &Value, qwen3: &Path, client_logprobs: bool) {
    let tok = Tokenizer::from_dir(qwen3).unwrap();
    assert_eq!(rec["outcome"], "ok", "{rec:#}");
    // The client's request is recorded as sent; the body graft sent is beside it.
    let req = &rec["request"];
    assert!(req.get("return_token_ids").is_none(), "{req}");
    assert_eq!(req.get("logprobs").is_some(), client_logprobs, "{req}");
    let up = &rec["upstream_request"];
    assert_eq!(up["return_token_ids"], true, "{rec:#}");
    assert_eq!(up["logprobs"], true, "{rec:#}");
    assert_eq!(up["messages"], req["messages"]);
    assert_eq!(rec["upstream_dialect"], "chat_completions");
    // The record's response is what the client got: no ids in it.
    assert_no_id_fields(&rec["response"], "the recorded response");

    let prompt = ids(&rec["prompt_token_ids"]);
    assert_eq!(
        prompt,
        prompt_ids(qwen3, req),
        "the full prompt as the upstream rendered it"
    );
    let completion = ids(&rec["completion_token_ids"]);
    let msg = &rec["response"]["choices"][0]["message"];
    assert_eq!(
        tok.decode(&completion).unwrap(),
        generated_text(msg),
        "the completion ids are the answer's text"
    );
    let lps: Vec<f32> = rec["completion_logprobs"]
        .as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_f64().unwrap() as f32)
        .collect();
    let expected: Vec<f32> = completion.iter().map(|&i| logprob(i)).collect();
    assert_eq!(
        lps, expected,
        "one logprob per completion id, as the upstream sent them"
    );
    assert_eq!(
        rec["usage"]["completion_tokens"].as_u64(),
        Some(completion.len() as u64)
    );
    assert_eq!(
        rec["usage"]["prompt_tokens"].as_u64(),
        Some(prompt.len() as u64)
    );
}

fn reconstruct(args: &[&str]) -> Value {
    let out = common::graft(args);
    serde_json::from_str(out.lines().last().unwrap()).unwrap_or_else(|e| panic!("{e}: {out}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn vllm_token_ids_are_recorded_stripped_from_answers_and_reconstructed_exactly() {
    let s = start();
    let gw = s.gateway.url.clone();
    let json_sid = session(&gw, false, "list the files please", true).await;
    let sse_sid = session(&gw, true, "just run it", false).await;

    let records = common::records_show(&s.data);
    for (sid, client_logprobs) in [(&json_sid, true), (&sse_sid, false)] {
        let mut recs: Vec<&Value> = records.iter().filter(|r| r["session_id"] == *sid).collect();
        recs.sort_by_key(|r| r["seq"].as_u64().unwrap());
        assert_eq!(recs.len(), 2, "{records:#?}");
        assert_record_has_ids(recs[0], &s.qwen3, false);
        assert_record_has_ids(recs[1], &s.qwen3, client_logprobs);
        // The second prompt really extends the first prompt + the sampled completion: the
        // scripted model generates no `<think>` block, and Qwen3's template renders a
        // tool-calling turn after the last user message as `<|im_start|>assistant\n` +
        // content + `<tool_call>…</tool_call>` + `<|im_end|>`, exactly what was sampled.
        let p1 = ids(&recs[0]["prompt_token_ids"]);
        let c1 = ids(&recs[0]["completion_token_ids"]);
        let p2 = ids(&recs[1]["prompt_token_ids"]);
        let mut sampled = p1.clone();
        sampled.extend(&c1);
        assert!(
            p2.starts_with(&sampled),
            "turn 2's prompt extends turn 1's prompt + completion"
        );
    }
    drop(s.gateway);
    drop(s.upstream);

    let q = s.qwen3.to_str().unwrap();
    let out = s.dir.path().join("samples.parquet");
    let summary = reconstruct(&[
        "reconstruct",
        "--data-dir",
        s.data.to_str().unwrap(),
        "--tokenizer",
        q,
        "--out",
        out.to_str().unwrap(),
        "--json",
    ]);
    assert_eq!(summary["exact_calls"], 4, "{summary}");
    assert_eq!(summary["retokenized_calls"], 0, "{summary}");
    assert_eq!(summary["sessions"], 2, "{summary}");
    // With the upstream's own ids each session merges into ONE sample and nothing drifts.
    // Re-tokenizing the same text-only records (tests/reconstruct.rs) forks every session
    // with `template_drift`: there the answer is re-rendered as the live turn, which Qwen3
    // writes with an empty `<think>` block that the next call's history omits. The ids the
    // upstream sampled have no such block, so the next prompt extends them exactly.
    assert_eq!(summary["samples"], 2, "{summary}");
    assert_eq!(summary["drift_events"], 0, "{summary}");

    // The trained tokens are exactly the sampled ones, with the upstream's logprobs.
    let tok = Tokenizer::from_dir(&s.qwen3).unwrap();
    let records = common::records_show(&s.data);
    for x in read_samples_parquet(&out).unwrap() {
        let mut recs: Vec<&Value> = records
            .iter()
            .filter(|r| r["session_id"] == x.session_id)
            .collect();
        recs.sort_by_key(|r| r["seq"].as_u64().unwrap());
        let mut want_ids = vec![];
        let mut want_lps = vec![];
        for r in &recs {
            let c = ids(&r["completion_token_ids"]);
            want_lps.extend(c.iter().map(|&i| Some(logprob(i))));
            want_ids.extend(c);
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
        assert!(tok.decode(&got_ids).unwrap().contains("<tool_call>"));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn completions_and_client_requested_ids_pass_through() {
    let s = start();
    let gw = s.gateway.url.clone();
    let tok = Tokenizer::from_dir(&s.qwen3).unwrap();
    let (sid, base) = common::open_session(&gw).await;

    // Legacy completions, JSON and SSE: ids recorded, none shown.
    for stream in [false, true] {
        let r = http::post_json(
            &format!("{base}/completions"),
            &[],
            &json!({"model": "qwen3", "prompt": "Say hello to the files", "stream": stream}),
        )
        .await;
        assert_eq!(r.status, 200, "{}", r.text());
        if stream {
            for d in r.sse_data().iter().filter(|d| *d != "[DONE]") {
                let c: Value = serde_json::from_str(d).unwrap();
                assert_no_id_fields(&c, "a completions chunk");
                assert!(
                    c["choices"][0]["logprobs"].is_null()
                        || c["choices"].as_array().unwrap().is_empty(),
                    "{c}"
                );
            }
        } else {
            let v = r.json();
            assert_no_id_fields(&v, "a completions answer");
            assert!(v["choices"][0]["logprobs"].is_null(), "{v}");
        }
    }
    // A client that asks for ids itself gets them, and graft leaves its request alone.
    let body = json!({"model": "qwen3", "messages": [{"role": "user", "content": "hi"}], "return_token_ids": true});
    let v = http::post_json(&format!("{base}/chat/completions"), &[], &body)
        .await
        .json();
    assert!(v["prompt_token_ids"].is_array(), "{v}");
    assert!(v["choices"][0]["token_ids"].is_array(), "{v}");
    assert!(v["choices"][0]["logprobs"].is_null(), "{v}");

    let records = common::records_show(&s.data);
    let mut recs: Vec<&Value> = records.iter().filter(|r| r["session_id"] == sid).collect();
    recs.sort_by_key(|r| r["seq"].as_u64().unwrap());
    assert_eq!(recs.len(), 3);
    for r in &recs[..2] {
        assert_eq!(r["upstream_request"]["logprobs"], 0, "{r:#}");
        assert_eq!(
            ids(&r["prompt_token_ids"]),
            tok.encode("Say hello to the files").unwrap()
        );
        let c = ids(&r["completion_token_ids"]);
        assert_eq!(
            tok.decode(&c).unwrap(),
            format!(
                "{}<|im_end|>",
                r["response"]["choices"][0]["text"].as_str().unwrap()
            )
        );
        let lps: Vec<f32> = r["completion_logprobs"]
            .as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_f64().unwrap() as f32)
            .collect();
        assert_eq!(lps, c.iter().map(|&i| logprob(i)).collect::<Vec<_>>());
        assert_no_id_fields(&r["response"], "a recorded completions response");
    }
    let r = recs[2];
    assert_eq!(r["upstream_request"]["return_token_ids"], true);
    assert_eq!(
        r["upstream_request"]["logprobs"], true,
        "graft added only logprobs"
    );
    assert_eq!(ids(&r["prompt_token_ids"]), ids(&v["prompt_token_ids"]));
    assert_eq!(
        ids(&r["completion_token_ids"]),
        ids(&v["choices"][0]["token_ids"])
    );
    assert!(r["completion_logprobs"].is_array(), "{r:#}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn translated_responses_calls_record_the_upstreams_ids_too() {
    let s = start();
    let (sid, base) = common::open_session(&s.gateway.url).await;
    let tools = json!([{"type": "function", "name": "bash", "description": "Run a shell command",
        "parameters": {"type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]}}]);
    for stream in [false, true] {
        let r = http::post_json(
            &format!("{base}/responses"),
            &[],
            &json!({"model": "qwen3", "input": "list the files please", "tools": tools, "stream": stream}),
        )
        .await;
        assert_eq!(r.status, 200, "{}", r.text());
        // The client gets a Responses answer; ids are no part of that dialect.
        assert!(!r.text().contains("token_ids"), "{}", r.text());
    }
    let tok = Tokenizer::from_dir(&s.qwen3).unwrap();
    let records = common::records_show(&s.data);
    let recs: Vec<&Value> = records.iter().filter(|r| r["session_id"] == sid).collect();
    assert_eq!(recs.len(), 2, "{records:#?}");
    for r in recs {
        assert_eq!(r["outcome"], "ok", "{r:#}");
        assert_eq!(r["dialect"], "responses");
        let up = &r["upstream_request"];
        assert_eq!(up["return_token_ids"], true, "{up}");
        assert_eq!(up["logprobs"], true, "{up}");
        assert_eq!(ids(&r["prompt_token_ids"]), prompt_ids(&s.qwen3, up));
        let c = ids(&r["completion_token_ids"]);
        let text = tok.decode(&c).unwrap();
        assert!(
            text.starts_with("Let me look.\n<tool_call>") && text.ends_with("<|im_end|>"),
            "{text}"
        );
        let lps: Vec<f32> = r["completion_logprobs"]
            .as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_f64().unwrap() as f32)
            .collect();
        assert_eq!(lps, c.iter().map(|&i| logprob(i)).collect::<Vec<_>>());
    }
}

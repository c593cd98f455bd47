//! `graft reconstruct` on records the real gateway wrote: text-only calls are re-tokenized
//! with the real Qwen3 template and tokenizer, merged into samples, and every drift is
//! classified; a foreign JSONL log gives SFT-style samples.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use common::{Proc, TestEnv, http};
use graft_reconstruct::sample::read_samples_parquet;
use graft_reconstruct::template::Tokenizer;
use serde_json::{Value, json};

fn tools() -> Value {
    json!([{"type": "function", "function": {"name": "bash", "parameters": {"type": "object", "properties": {"command": {"type": "string"}}}}}])
}

/// A two-turn tool-using session through the gateway: tool call, tool result, answer.
async fn session(gw: &str) -> String {
    let s = http::post_json(
        &format!("{gw}/graft/sessions"),
        &[],
        &json!({"group_id": "g"}),
    )
    .await
    .json();
    let base = s["base_url"].as_str().unwrap().to_string();
    let mut messages = vec![
        json!({"role": "system", "content": "You run shell commands."}),
        json!({"role": "user", "content": "graft-tool-call please"}),
    ];
    let r1 = http::post_json(
        &format!("{base}/chat/completions"),
        &[],
        &json!({"model": "m", "tools": tools(), "messages": messages}),
    )
    .await
    .json();
    let msg = r1["choices"][0]["message"].clone();
    let id = msg["tool_calls"][0]["id"].clone();
    messages.push(msg);
    messages.push(json!({"role": "tool", "tool_call_id": id, "content": "a.txt b.txt"}));
    let r2 = http::post_json(
        &format!("{base}/chat/completions"),
        &[],
        &json!({"model": "m", "tools": tools(), "messages": messages}),
    )
    .await;
    assert_eq!(r2.status, 200);
    let sid = s["session_id"].as_str().unwrap().to_string();
    http::post_json(
        &format!("{gw}/graft/sessions/{sid}/reward"),
        &[],
        &json!({"reward": 1.0}),
    )
    .await;
    sid
}

fn reconstruct(args: &[&str]) -> Value {
    let out = common::graft(args);
    serde_json::from_str(out.lines().last().unwrap()).unwrap_or_else(|e| panic!("{e}: {out}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn text_only_records_are_retokenized_merged_and_drift_is_classified() {
    let env = TestEnv::get();
    let qwen3 = env.qwen3_dir();
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let upstream = Proc::scripted_upstream(&["--script", common::script_path().to_str().unwrap()]);
    let gw = Proc::gateway_with(&upstream.url, &data, &[], &[]);
    let sid = session(&gw.url).await;
    drop(gw);

    let q = qwen3.to_str().unwrap();
    let d = data.to_str().unwrap();
    // Qwen3 renders the answer being generated with a `<think>` block and drops it from
    // history once the turn is over: re-tokenized, call 2's prompt does not extend call 1's
    // prompt + answer. That is drift, and it must be found and classified, not hidden.
    let out = dir.path().join("samples.parquet");
    let s = reconstruct(&[
        "reconstruct",
        "--data-dir",
        d,
        "--tokenizer",
        q,
        "--out",
        out.to_str().unwrap(),
        "--json",
    ]);
    assert_eq!(s["sessions"], 1, "{s}");
    assert_eq!(s["retokenized_calls"], 2, "{s}");
    assert_eq!(s["exact_calls"], 0, "{s}");
    assert_eq!(s["samples"], 2, "{s}");
    assert_eq!(s["forks_by_reason"]["template_drift"], 1, "{s}");
    assert_eq!(s["drift_events"], 1, "{s}");

    let samples = read_samples_parquet(&out).unwrap();
    let tok = Tokenizer::from_dir(&qwen3).unwrap();
    let trained = |i: usize| {
        let x = &samples[i];
        let ids: Vec<u32> = x
            .tokens
            .iter()
            .zip(&x.loss_mask)
            .filter(|(_, m)| **m == 1)
            .map(|(t, _)| *t)
            .collect();
        tok.decode(&ids).unwrap()
    };
    for x in &samples {
        assert_eq!(x.session_id, sid);
        assert_eq!(x.group_id.as_deref(), Some("g"));
        assert_eq!(
            x.reward,
            Some(1.0),
            "the session's reward reaches its samples"
        );
        assert_eq!(x.tokens.len(), x.loss_mask.len());
        assert_eq!(x.tokenizer_fingerprint, tok.fingerprint());
    }
    assert_eq!(samples[0].fork_reason, None);
    assert_eq!(samples[1].fork_reason.as_deref(), Some("template_drift"));
    // Call 1's answer is its tool call; call 2's answer is trained, its tool result is context.
    let first = trained(0);
    assert!(
        first.contains("<tool_call>") && first.contains("\"bash\""),
        "{first}"
    );
    assert!(
        first.ends_with("<|im_end|>"),
        "the answer ends at the end-of-turn token: {first:?}"
    );
    let second = trained(1);
    assert!(
        !second.contains("a.txt b.txt"),
        "tool results are not trained on: {second}"
    );
    let all = tok.decode(&samples[1].tokens).unwrap();
    assert!(
        all.contains("<tool_response>\na.txt b.txt\n</tool_response>"),
        "{all}"
    );
}

#[test]
fn a_foreign_jsonl_log_gives_sft_samples() {
    let env = TestEnv::get();
    let qwen3 = env.qwen3_dir();
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("log.jsonl");
    let conv = json!({"id": "c1", "reward": 0.5, "messages": [
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "And 3+3?"},
        {"role": "assistant", "content": "6"}]});
    std::fs::write(&log, format!("{conv}\n\n{{\"messages\": []}}\n")).unwrap();
    let out = dir.path().join("sft.parquet");
    let s = reconstruct(&[
        "reconstruct",
        "--from-jsonl",
        log.to_str().unwrap(),
        "--tokenizer",
        qwen3.to_str().unwrap(),
        "--out",
        out.to_str().unwrap(),
        "--enable-thinking",
        "false",
        "--json",
    ]);
    assert_eq!(s["sessions"], 1, "{s}");
    assert_eq!(
        s["skipped"]["conversation without an assistant turn"], 1,
        "{s}"
    );
    // Each assistant turn is trained with the prompt it would see at inference; Qwen3's
    // history rendering differs from the live turn's, so the turns are two samples.
    assert_eq!(s["samples"], 2, "{s}");
    let samples = read_samples_parquet(&out).unwrap();
    let tok = Tokenizer::from_dir(&qwen3).unwrap();
    let mut trained_text = String::new();
    for x in &samples {
        assert_eq!(x.session_id, "c1");
        assert_eq!(x.reward, Some(0.5));
        assert!(
            x.logprobs.iter().all(Option::is_none),
            "SFT samples have no logprobs"
        );
        let ids: Vec<u32> = x
            .tokens
            .iter()
            .zip(&x.loss_mask)
            .filter(|(_, m)| **m == 1)
            .map(|(t, _)| *t)
            .collect();
        trained_text.push_str(&tok.decode(&ids).unwrap());
    }
    assert!(
        trained_text.contains('4') && trained_text.contains('6'),
        "{trained_text}"
    );
    assert!(
        !trained_text.contains("3+3") && !trained_text.contains("2+2"),
        "user turns are not trained on: {trained_text}"
    );
}

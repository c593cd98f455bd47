//! `graft reconstruct` on records the real gateway wrote: text-only calls are re-tokenized
//! with the real Qwen3 template and tokenizer, merged into samples, and every drift is
//! classified; a foreign JSONL log gives SFT-style samples.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use common::{Proc, Stack, TestEnv, http};
use graft_reconstruct::sample::read_samples_parquet;
use graft_reconstruct::template::Tokenizer;
use serde_json::{Value, json};

fn tools() -> Value {
    json!([{"type": "function", "function": {"name": "bash", "parameters": {"type": "object", "properties": {"command": {"type": "string"}}}}}])
}

/// A two-turn tool-using session through the gateway: tool call, tool result, answer.
/// Returns the session id and its two call ids.
async fn session(gw: &str) -> (String, [String; 2]) {
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
    .await;
    let call1 = r1.header("x-graft-call-id").unwrap();
    let msg = r1.json()["choices"][0]["message"].clone();
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
    let call2 = r2.header("x-graft-call-id").unwrap();
    let sid = s["session_id"].as_str().unwrap().to_string();
    http::post_json(
        &format!("{gw}/graft/sessions/{sid}/reward"),
        &[],
        &json!({"reward": 1.0}),
    )
    .await;
    (sid, [call1, call2])
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
    let (sid, calls) = session(&gw.url).await;
    // Process rewards: call 1 by its seq, call 2 by its id; then the ones refused.
    let reward = |call: String, body: Value| {
        let url = format!("{}/graft/sessions/{sid}/calls/{call}/reward", gw.url);
        async move { http::post_json(&url, &[], &body).await }
    };
    let r = reward(
        "1".into(),
        json!({"reward": 0.25, "info": {"rubric": "listed"}}),
    )
    .await;
    assert_eq!(r.status, 200, "{}", r.text());
    let r = reward(calls[1].clone(), json!({"reward": -0.5})).await;
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.json()["call_rewards"], 2);
    for (call, body, says) in [
        (
            "3",
            json!({"reward": 1.0}),
            "has no call 3: its calls are numbered 1..=2",
        ),
        ("0", json!({"reward": 1.0}), "has no call 0"),
        (
            "turn-two",
            json!({"reward": 1.0}),
            "'turn-two' names no call",
        ),
        ("2", json!({"score": 1.0}), "'reward' is required"),
        ("2", json!({"reward": "high"}), "'reward' must be a number"),
    ] {
        let r = reward(call.into(), body).await;
        assert_eq!(r.status, 400, "{call}: {}", r.text());
        let msg = r.json()["error"]["message"].as_str().unwrap().to_owned();
        assert!(msg.contains(says), "{call}: {msg}");
    }
    let r = http::post_json(
        &format!("{}/graft/sessions/nobody/calls/1/reward", gw.url),
        &[],
        &json!({"reward": 1.0}),
    )
    .await;
    assert_eq!(r.status, 404, "{}", r.text());
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
    assert_eq!(s["call_rewards"], 2, "{s}");
    assert_eq!(s["call_rewards_unmatched"], json!([]), "{s}");

    let samples = read_samples_parquet(&out).unwrap();
    let tok = Tokenizer::from_dir(&qwen3).unwrap();
    let trained = |i: usize| {
        let x = &samples[i];
        let ids = common::trained_ids(x);
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
    // Each call's process reward stands beside it, and on the tokens it sampled.
    assert_eq!(samples[0].call_ids, [calls[0].clone()]);
    assert_eq!(samples[0].call_rewards, [Some(0.25)]);
    assert_eq!(samples[1].call_ids, [calls[1].clone()]);
    assert_eq!(samples[1].call_rewards, [Some(-0.5)]);
    for x in &samples {
        for (i, &m) in x.loss_mask.iter().enumerate() {
            assert_eq!(
                x.token_calls[i],
                (m == 1).then_some(0),
                "{}: token {i}",
                x.sample_id
            );
        }
    }
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
        let ids = common::trained_ids(x);
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

/// `graft reconstruct` with its exit status and output (it may fail on purpose).
fn reconstruct_status(args: &[&str]) -> (bool, String, String) {
    let mut all = vec!["reconstruct"];
    all.extend_from_slice(args);
    common::graft_status(&all, None)
}

/// Passthrough against a text-only upstream, with the shapes real clients send: OpenHands'
/// content as text parts (system, user, assistant and tool messages), a tool message with a
/// name, assistant turns echoed with `reasoning_content` or `reasoning` (the openai SDK sends
/// them as given), mini-swe-agent through litellm, and the openai SDK's streamed tool calls.
/// Reconstruct re-tokenizes every call (nothing skipped) and classifies every fork. A call
/// holding an image is refused with the reason printed, and the run fails because its
/// session yields no sample, unless `--allow-skips`.
#[test]
fn real_client_shapes_in_passthrough_are_all_retokenized_and_images_refused_by_name() {
    let env = TestEnv::get();
    let qwen3 = env.qwen3_dir();
    let stack = Stack::start();
    stack.open_session("shapes-1");
    let out = env.py_client(
        "passthrough_shapes.py",
        &["agent"],
        &stack.target(Some("shapes-1"), None),
    );
    assert_eq!(out["calls"], 3, "{out}");
    stack.open_session("mini-1");
    let mini = env.py_client(
        "mini_swe_agent.py",
        &[],
        &stack.target(Some("mini-1"), None),
    );
    assert_eq!(mini["exit_status"], "Submitted", "{mini:#}");
    stack.open_session("sdk-1");
    env.py_client(
        "openai_sdk.py",
        &["chat-stream-tools"],
        &stack.target(Some("sdk-1"), None),
    );
    let calls = stack.wait_records("shapes-1", 3).len()
        + stack.wait_records("mini-1", 2).len()
        + stack.wait_records("sdk-1", 1).len();
    let shapes = stack.wait_records("shapes-1", 3);
    assert!(
        shapes[1]["request"]["messages"][3]["name"] == "bash"
            && shapes[1]["request"]["messages"][0]["content"].is_array(),
        "the client's shapes are recorded as sent: {:#}",
        shapes[1]["request"]
    );

    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("samples.parquet");
    let (q, d, o) = (
        qwen3.to_str().unwrap(),
        stack.data_dir.to_str().unwrap(),
        out.to_str().unwrap(),
    );
    let (ok, stdout, stderr) =
        reconstruct_status(&["--data-dir", d, "--tokenizer", q, "--out", o, "--json"]);
    assert!(ok, "{stdout}\n{stderr}");
    let s: Value = serde_json::from_str(stdout.lines().last().unwrap()).unwrap();
    assert_eq!(s["retokenized_calls"], calls as u64, "{s}");
    assert_eq!(s["skipped"], json!({}), "no call skipped: {s}");
    assert_eq!(
        s["forks_by_reason"]["other"], 0,
        "every fork classified: {s}"
    );
    let forks: u64 = s["forks_by_reason"]
        .as_object()
        .unwrap()
        .values()
        .map(|v| v.as_u64().unwrap())
        .sum();
    assert_eq!(
        s["drift_events"].as_u64().unwrap(),
        s["forks_by_reason"]["template_drift"].as_u64().unwrap(),
        "{s}"
    );
    assert_eq!(s["samples"].as_u64().unwrap(), 3 + forks, "{s}");
    // The text of the parts reached the template (Qwen3's renders non-string content as
    // nothing): the system prompt, the task, the tool result.
    let tok = Tokenizer::from_dir(&qwen3).unwrap();
    let samples = read_samples_parquet(&out).unwrap();
    let text: String = samples
        .iter()
        .filter(|x| x.session_id == "shapes-1")
        .map(|x| tok.decode(&x.tokens).unwrap())
        .collect();
    for want in [
        "You are OpenHands agent.",
        "graft-shapes-task: list the files",
        "graft-shapes-listing: a.txt b.txt",
        "graft-shapes-more: and now?",
    ] {
        assert!(text.contains(want), "{want:?} missing from {text}");
    }

    // An image: refused with its reason, and the session without a sample fails the run.
    stack.open_session("img-1");
    env.py_client(
        "passthrough_shapes.py",
        &["image"],
        &stack.target(Some("img-1"), None),
    );
    stack.wait_records("img-1", 1);
    let (ok, stdout, stderr) = reconstruct_status(&["--data-dir", d, "--tokenizer", q, "--out", o]);
    assert!(
        !ok,
        "a session without a sample must fail the run:\n{stdout}"
    );
    assert!(
        stdout.contains("skipped: 1 (message 0 (user) holds an image: the model's chat template renders text only"),
        "{stdout}"
    );
    assert!(
        stderr.contains("1 session(s) yielded no sample (img-1)")
            && stderr.contains("--allow-skips"),
        "{stderr}"
    );
    let (ok, stdout, stderr) = reconstruct_status(&[
        "--data-dir",
        d,
        "--tokenizer",
        q,
        "--out",
        o,
        "--allow-skips",
        "--json",
    ]);
    assert!(ok, "{stdout}\n{stderr}");
    let s: Value = serde_json::from_str(stdout.lines().last().unwrap()).unwrap();
    assert_eq!(s["sessions_without_samples"], json!(["img-1"]), "{s}");
    assert_eq!(s["retokenized_calls"], calls as u64, "{s}");
}

/// A call that starts its own conversation in the same session (a title request to a small
/// model, no tools, between two turns of the tool-using conversation) is a new root: its
/// own sample with its own reason, no drift, not "other". A rule leaves such calls out of
/// training: by model name, or because they offer no tools.
#[test]
fn side_conversations_are_new_roots_and_rules_leave_them_out() {
    let env = TestEnv::get();
    let qwen3 = env.qwen3_dir();
    // The gateway keeps two request headers in each record: the harness's own marker and
    // one the openai SDK always sends.
    let cfg_dir = tempfile::tempdir().unwrap();
    let cfg = cfg_dir.path().join("graft.toml");
    std::fs::write(
        &cfg,
        "[recorder]\nrecord_headers = [\"X-Graft-Purpose\", \"x-stainless-lang\"]\n",
    )
    .unwrap();
    let stack = Stack::start_with(&[], &["--config", cfg.to_str().unwrap()]);
    stack.open_session("side-1");
    let out = env.py_client(
        "passthrough_shapes.py",
        &["side"],
        &stack.target(Some("side-1"), None),
    );
    assert_eq!(out["title"], "Listing files", "{out}");
    let recs = stack.wait_records("side-1", 3);
    assert_eq!(recs[1]["request"]["model"], "scripted-small");
    assert_eq!(
        recs[1]["headers"],
        json!({"x-graft-purpose": "title", "x-stainless-lang": "python"})
    );
    assert_eq!(recs[0]["headers"], json!({"x-stainless-lang": "python"}));

    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("samples.parquet");
    let (q, d, o) = (
        qwen3.to_str().unwrap(),
        stack.data_dir.to_str().unwrap(),
        out.to_str().unwrap(),
    );
    let base = ["--data-dir", d, "--tokenizer", q, "--out", o, "--json"];
    let run = |extra: &[&str]| -> Value {
        let mut args = base.to_vec();
        args.extend_from_slice(extra);
        let (ok, stdout, stderr) = reconstruct_status(&args);
        assert!(ok, "{stdout}\n{stderr}");
        serde_json::from_str(stdout.lines().last().unwrap()).unwrap()
    };
    // Re-tokenized with Qwen3, the main conversation's second call drifts (the live turn's
    // `<think>` block is not in history): that is template drift, found and counted.
    let ids: Vec<&str> = recs
        .iter()
        .map(|r| r["call_id"].as_str().unwrap())
        .collect();
    let s = run(&["--side-threads", "session"]);
    let drift = s["forks_by_reason"]["template_drift"].as_u64().unwrap();
    assert_eq!(s["forks_by_reason"]["new_root"], 1, "{s}");
    assert_eq!(s["forks_by_reason"]["other"], 0, "{s}");
    assert_eq!(s["forks_by_reason"]["compaction"], 0, "{s}");
    assert_eq!(s["samples"].as_u64().unwrap(), 2 + drift, "{s}");
    assert_eq!(
        s["drift_events"].as_u64().unwrap(),
        drift,
        "the side call is no drift event: {s}"
    );
    let samples = read_samples_parquet(&out).unwrap();
    let side: Vec<_> = samples
        .iter()
        .filter(|x| x.fork_reason.as_deref() == Some("new_root"))
        .collect();
    assert_eq!(side.len(), 1);
    assert_eq!(side[0].call_ids, [ids[1]]);
    // A conversation of its own without the agent's tools: a side thread, whose parent is
    // the main sample that was running when it started.
    assert_eq!(side[0].thread, "side");
    assert_eq!(
        side[0].parent_sample.as_deref(),
        Some(samples[0].sample_id.as_str())
    );
    assert!(
        samples
            .iter()
            .filter(|x| x.call_ids != [ids[1]])
            .all(|x| x.thread == "main")
    );

    // By default a side thread without call rewards of its own is left out, and the
    // summary says so.
    let s = run(&[]);
    assert_eq!(s["samples"].as_u64().unwrap(), 1 + drift, "{s}");
    assert_eq!(s["threads"]["side_samples_left_out"], 1, "{s}");
    assert_eq!(s["threads"]["side_policy"], "own", "{s}");
    let (ok, text, _) = reconstruct_status(&base[..base.len() - 1]);
    assert!(ok);
    assert!(
        text.contains("side threads are left out of training unless a reward was posted for one of their calls (--side-threads own): 1 samples (1 calls) left out, 0 trained"),
        "{text}"
    );

    // Realigned instead of forked, the main conversation is one sample again.
    let s = run(&["--on-drift", "realign", "--side-threads", "session"]);
    assert_eq!(s["realigned"].as_u64().unwrap(), drift, "{s}");
    assert_eq!(s["forks_by_reason"]["template_drift"], 0, "{s}");
    assert_eq!(s["samples"], 2, "{s}");
    let samples = read_samples_parquet(&out).unwrap();
    assert_eq!(samples[0].call_ids, [ids[0], ids[2]]);
    let tok = Tokenizer::from_dir(&qwen3).unwrap();
    let trained: Vec<u32> = samples[0]
        .tokens
        .iter()
        .zip(&samples[0].loss_mask)
        .filter(|(_, m)| **m == 1)
        .map(|(t, _)| *t)
        .collect();
    assert!(
        tok.decode(&trained)
            .unwrap()
            .contains("There are two files"),
        "the last call's completion is trained"
    );

    for rule in [
        &["--leave-out-model", "scripted-sm*"][..],
        &["--leave-out-without-tools"][..],
        &["--leave-out-header", "x-graft-purpose=title"][..],
        &["--leave-out-header", "X-Graft-Purpose"][..],
        &["--leave-out-header", "x-graft-purpose~itl"][..],
        &["--leave-out-header", "x-graft-purpose!~main"][..],
    ] {
        let s = run(rule);
        assert_eq!(s["samples"].as_u64().unwrap(), 1 + drift, "{rule:?}: {s}");
        assert_eq!(s["forks_by_reason"]["new_root"], 0, "{rule:?}: {s}");
        let skipped = s["skipped"].as_object().unwrap();
        assert_eq!(skipped.len(), 1, "{rule:?}: {s}");
        let (why, n) = skipped.iter().next().unwrap();
        assert!(why.starts_with("left out: "), "{why}");
        assert_eq!(n, 1);
        assert_eq!(s["sessions_without_samples"], json!([]), "{s}");
    }
    // A rule that matches nothing leaves nothing out; a malformed one is refused.
    let s = run(&[
        "--leave-out-header",
        "x-graft-purpose=summary",
        "--side-threads",
        "session",
    ]);
    assert_eq!(s["samples"].as_u64().unwrap(), 2 + drift, "{s}");
    let mut args = base.to_vec();
    args.extend_from_slice(&["--leave-out-header", "no such=header"]);
    let (ok, _, stderr) = reconstruct_status(&args);
    assert!(!ok && stderr.contains("is not a header rule"), "{stderr}");
}

/// An agent that never offers tools (smolagents' CodeAgent, aider) keeps no call under
/// `--leave-out-without-tools`: its session yields no sample, and that is the error `--help`
/// promises, naming the rule that left the calls out, not a silent 0 with exit 0; with
/// `--allow-skips` it is accepted and the summary names the session.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn leave_out_without_tools_on_a_text_only_agent_is_an_error_naming_the_flag() {
    let env = TestEnv::get();
    let qwen3 = env.qwen3_dir();
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let upstream = Proc::scripted_upstream(&["--script", common::script_path().to_str().unwrap()]);
    let gw = Proc::gateway_with(&upstream.url, &data, &[], &[]);
    let (sid, base) = common::open_session(&gw.url).await;
    let mut messages =
        vec![json!({"role": "user", "content": "graft-completion: once upon a time"})];
    for _ in 0..2 {
        let r = http::post_json(
            &format!("{base}/chat/completions"),
            &[],
            &json!({"model": "m", "messages": messages}),
        )
        .await;
        assert_eq!(r.status, 200, "{}", r.text());
        messages.push(r.json()["choices"][0]["message"].clone());
        messages.push(json!({"role": "user", "content": "go on"}));
    }
    http::post_json(
        &format!("{}/graft/sessions/{sid}/reward", gw.url),
        &[],
        &json!({"reward": 1.0}),
    )
    .await;
    let out = dir.path().join("samples.parquet");
    let (q, d, o) = (
        qwen3.to_str().unwrap(),
        data.to_str().unwrap(),
        out.to_str().unwrap(),
    );
    let base = ["--data-dir", d, "--tokenizer", q, "--out", o];

    // Without the rule: one sample, exit 0.
    let (ok, stdout, stderr) = reconstruct_status(&base);
    assert!(ok, "{stdout}\n{stderr}");
    // With it: no sample, a non-zero exit that names the session and the flag.
    let mut args = base.to_vec();
    args.push("--leave-out-without-tools");
    let (ok, stdout, stderr) = reconstruct_status(&args);
    assert!(!ok, "0 samples must not exit 0:\n{stdout}\n{stderr}");
    assert!(
        stdout.contains("skipped: 2 (left out: offers no tools)"),
        "{stdout}"
    );
    assert!(
        stderr.contains(&format!("1 session(s) yielded no sample ({sid})"))
            && stderr.contains("left out by --leave-out-without-tools")
            && stderr.contains("--allow-skips"),
        "{stderr}"
    );
    // Accepted on request, and the summary says which session the rule emptied.
    args.extend(["--allow-skips", "--json"]);
    let (ok, stdout, stderr) = reconstruct_status(&args);
    assert!(ok, "{stdout}\n{stderr}");
    let s: Value = serde_json::from_str(stdout.lines().last().unwrap()).unwrap();
    assert_eq!(s["samples"], 0, "{s}");
    assert_eq!(s["sessions_without_samples"], json!([sid]), "{s}");
    assert_eq!(s["sessions_left_out"], json!([sid]), "{s}");
}

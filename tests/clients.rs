//! Real clients through the real gateway: each test starts the scripted upstream and the
//! gateway (`graft` binaries, port 0, temp data dir), runs one real client (openai Python
//! and Node SDKs, litellm, mini-swe-agent, aider) through graft, and checks both what the
//! client received and what the recorder wrote (`graft records show --json`).
//!
//! Needs `bash scripts/setup-test-env.sh` first; without it the tests fail and say so.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use common::{
    Stack, TestEnv, assert_ok_record, assert_usage, message, scripted_content, tool_calls,
};
use serde_json::{Value, json};

#[test]
fn openai_python_chat_json_is_recorded_under_the_url_session() {
    let env = TestEnv::get();
    let stack = Stack::start();
    stack.open_session("py-chat");
    let out = env.py_client(
        "openai_sdk.py",
        &["chat"],
        &stack.target(Some("py-chat"), None),
    );

    // What the client got: the echo of the last user message, in OpenAI's shape.
    assert_eq!(out["object"], "chat.completion");
    assert_eq!(out["content"], "You said: graft-chat: hello there");
    assert_eq!(out["finish_reason"], "stop");

    let recs = stack.wait_records("py-chat", 1);
    assert_eq!(recs.len(), 1, "{recs:#?}");
    let rec = &recs[0];
    assert_ok_record(rec, "py-chat", "chat_completions", false, &stack);
    assert_eq!(rec["seq"], 1);
    assert_eq!(
        rec["request"], out["sent"],
        "the recorded request is the body the client sent"
    );
    assert_eq!(rec["model"], "scripted");
    assert_eq!(rec["response"]["id"], out["id"]);
    assert_eq!(message(rec)["content"], out["content"]);
    assert_eq!(message(rec)["role"], "assistant");
    assert_eq!(rec["finish_reason"], out["finish_reason"]);
    assert_usage(rec, &out["usage"]);
    assert!(
        rec["client"]
            .as_str()
            .is_some_and(|c| c.contains("OpenAI/Python")),
        "client is the SDK's user-agent: {}",
        rec["client"]
    );
}

#[test]
fn openai_python_chat_stream_tool_call_is_assembled_under_the_header_session() {
    let env = TestEnv::get();
    let stack = Stack::start();
    stack.open_session("py-tools");
    let out = env.py_client(
        "openai_sdk.py",
        &["chat-stream-tools"],
        &stack.target(None, Some("py-tools")),
    );

    // The SDK assembled the streamed tool call.
    assert_eq!(out["content"], scripted_content("graft-tool-call"));
    assert_eq!(out["finish_reason"], "tool_calls");
    let calls = out["tool_calls"].as_array().unwrap();
    assert_eq!(calls.len(), 1, "{out}");
    assert_eq!(calls[0]["name"], "bash");
    let args: Value = serde_json::from_str(calls[0]["arguments"].as_str().unwrap()).unwrap();
    assert_eq!(args, json!({"command": "ls -la /workspace"}));
    assert!(
        out["chunks"].as_u64().unwrap() > 5,
        "it really streamed: {out}"
    );

    let recs = stack.wait_records("py-tools", 1);
    assert_eq!(recs.len(), 1, "{recs:#?}");
    let rec = &recs[0];
    assert_ok_record(rec, "py-tools", "chat_completions", true, &stack);
    assert_eq!(rec["request"], out["sent"]);
    // The record holds the stream assembled into one chat.completion-like message.
    assert_eq!(rec["response"]["id"], out["id"]);
    assert_eq!(message(rec)["content"], out["content"]);
    assert_eq!(
        tool_calls(rec),
        vec![(
            calls[0]["name"].as_str().unwrap().to_owned(),
            calls[0]["arguments"].as_str().unwrap().to_owned()
        )]
    );
    assert_eq!(message(rec)["tool_calls"][0]["id"], calls[0]["id"]);
    assert_eq!(rec["finish_reason"], "tool_calls");
    assert_usage(rec, &out["usage"]);
    assert!(
        rec["ttft_ms"].as_f64().is_some(),
        "a streamed call records its time to first token: {rec:#}"
    );
    // No call leaked into the default session.
    assert!(
        stack
            .records()
            .iter()
            .all(|r| r["session_id"] == "py-tools"),
        "{:#?}",
        stack.records()
    );
}

#[test]
fn openai_python_completions_without_a_session_go_to_the_default_session() {
    let env = TestEnv::get();
    let stack = Stack::start();
    let out = env.py_client("openai_sdk.py", &["completions"], &stack.target(None, None));

    assert_eq!(out["object"], "text_completion");
    assert_eq!(out["content"], scripted_content("graft-completion"));

    let recs = stack.wait_records("default", 1);
    assert_eq!(recs.len(), 1, "{recs:#?}");
    let rec = &recs[0];
    assert_ok_record(rec, "default", "completions", false, &stack);
    assert_eq!(rec["request"], out["sent"]);
    assert_eq!(rec["response"]["choices"][0]["text"], out["content"]);
    assert_eq!(rec["finish_reason"], "stop");
    assert_usage(rec, &out["usage"]);
}

#[test]
fn openai_node_chat_stream_is_recorded() {
    let env = TestEnv::get();
    let stack = Stack::start();
    stack.open_session("node-stream");
    let out = env.node_client(
        "openai_chat_stream.cjs",
        &stack.target(Some("node-stream"), None),
    );

    assert_eq!(
        out["content"],
        "You said: graft-node: streaming hello from node"
    );
    assert_eq!(out["role"], "assistant");
    assert_eq!(out["finish_reason"], "stop");

    let recs = stack.wait_records("node-stream", 1);
    assert_eq!(recs.len(), 1, "{recs:#?}");
    let rec = &recs[0];
    assert_ok_record(rec, "node-stream", "chat_completions", true, &stack);
    assert_eq!(rec["request"], out["sent"]);
    assert_eq!(rec["response"]["id"], out["id"]);
    assert_eq!(message(rec)["content"], out["content"]);
    assert!(tool_calls(rec).is_empty());
    assert_usage(rec, &out["usage"]);
    assert!(
        rec["client"]
            .as_str()
            .is_some_and(|c| c.contains("OpenAI/JS")),
        "client is the Node SDK's user-agent: {}",
        rec["client"]
    );
}

#[test]
fn litellm_chat_stream_is_recorded_under_the_header_session() {
    let env = TestEnv::get();
    let stack = Stack::start();
    stack.open_session("litellm-1");
    let out = env.py_client(
        "litellm_client.py",
        &["chat-stream"],
        &stack.target(None, Some("litellm-1")),
    );

    assert_eq!(
        out["content"],
        "You said: graft-litellm: hello from litellm"
    );
    assert_eq!(out["finish_reason"], "stop");

    let recs = stack.wait_records("litellm-1", 1);
    assert_eq!(recs.len(), 1, "{recs:#?}");
    let rec = &recs[0];
    assert_ok_record(rec, "litellm-1", "chat_completions", true, &stack);
    // litellm strips its `openai/` provider prefix and adds fields of its own; the messages
    // must arrive as the caller gave them.
    assert_eq!(rec["request"]["model"], "scripted");
    assert_eq!(rec["request"]["messages"], out["sent_messages"]);
    assert_eq!(rec["request"]["stream"], true);
    assert_eq!(message(rec)["content"], out["content"]);
    assert_eq!(rec["finish_reason"], "stop");
}

#[test]
fn mini_swe_agent_finishes_a_one_step_task_in_two_recorded_calls() {
    let env = TestEnv::get();
    let stack = Stack::start();
    stack.open_session("mini-1");
    let out = env.py_client(
        "mini_swe_agent.py",
        &[],
        &stack.target(Some("mini-1"), None),
    );

    // The agent ran the scripted command in its temp dir and then submitted.
    assert_eq!(out["exit_status"], "Submitted", "{out:#}");
    assert_eq!(out["result_txt"], "graft-mini-step-one-done\n");
    let assistant = out["assistant"].as_array().unwrap();
    assert_eq!(assistant.len(), 2, "{out:#}");

    let recs = stack.wait_records("mini-1", 2);
    assert_eq!(recs.len(), 2, "{recs:#?}");
    for (i, rec) in recs.iter().enumerate() {
        assert_ok_record(rec, "mini-1", "chat_completions", false, &stack);
        assert_eq!(rec["seq"], i as u64 + 1);
        // mini offers its bash tool on every call.
        let tools = rec["request"]["tools"]
            .as_array()
            .unwrap_or_else(|| panic!("no tools: {rec:#}"));
        assert!(
            tools.iter().any(|t| t["function"]["name"] == "bash"),
            "{tools:?}"
        );
        // What the agent stored as the model's message is what the record assembled.
        let got = &assistant[i]["tool_calls"][0];
        assert_eq!(
            tool_calls(rec),
            vec![(
                got["name"].as_str().unwrap().to_owned(),
                got["arguments"].as_str().unwrap().to_owned()
            )]
        );
        assert_eq!(message(rec)["content"], assistant[i]["content"]);
    }
    // Call 1 carries the task; call 2 extends it with the tool result of call 1.
    let m1 = recs[0]["request"]["messages"].as_array().unwrap();
    let m2 = recs[1]["request"]["messages"].as_array().unwrap();
    assert_eq!(m1.last().unwrap()["role"], "user");
    assert!(
        m1.last().unwrap()["content"]
            .to_string()
            .contains("graft-mini-task")
    );
    assert_eq!(m2.last().unwrap()["role"], "tool");
    assert!(
        m2.last().unwrap()["content"]
            .to_string()
            .contains("graft-mini-step-one-done")
    );
    assert_eq!(
        &m2[..m1.len()],
        &m1[..],
        "the second request starts with the first one's messages"
    );
    assert!(
        tool_calls(&recs[1])[0]
            .1
            .contains("COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT")
    );
}

#[test]
fn aider_one_shot_edit_streams_through_graft_and_is_recorded() {
    let env = TestEnv::get();
    let stack = Stack::start();
    stack.open_session("aider-1");
    let out = env.aider_client(&stack.target(Some("aider-1"), None));

    assert_eq!(
        out["changed"], true,
        "aider did not apply the scripted edit: {out:#}"
    );
    assert!(
        out["edited"]
            .as_str()
            .unwrap()
            .contains("return \"hello from graft\""),
        "{out:#}"
    );

    let recs = stack.wait_records("aider-1", 1);
    let rec = recs
        .iter()
        .find(|r| r["request"].to_string().contains("graft-aider-task"))
        .unwrap_or_else(|| panic!("no recorded call carries aider's message: {recs:#?}"));
    assert_ok_record(rec, "aider-1", "chat_completions", true, &stack);
    assert!(
        rec["request"].get("tools").is_none_or(Value::is_null),
        "aider sends no tools: {rec:#}"
    );
    let last_user = rec["request"]["messages"]
        .as_array()
        .unwrap()
        .iter()
        .rev()
        .find(|m| m["role"] == "user")
        .unwrap();
    assert!(
        last_user["content"]
            .to_string()
            .contains(out["message"].as_str().unwrap())
    );
    // The streamed reply, assembled, is exactly what the model (script) said; aider applied it.
    assert_eq!(
        message(rec)["content"],
        scripted_content("graft-aider-task")
    );
    assert_eq!(rec["finish_reason"], "stop");
}

#[test]
fn parquet_export_reads_back_in_pyarrow_and_duckdb() {
    let env = TestEnv::get();
    let stack = Stack::start();
    stack.open_session("pq-a");
    stack.open_session("pq-b");
    let chat = env.py_client(
        "openai_sdk.py",
        &["chat"],
        &stack.target(Some("pq-a"), None),
    );
    let tools = env.py_client(
        "openai_sdk.py",
        &["chat-stream-tools"],
        &stack.target(Some("pq-b"), None),
    );
    let recs_a = stack.wait_records("pq-a", 1);
    let recs_b = stack.wait_records("pq-b", 1);

    let file = stack.export_parquet();
    let mut cmd = std::process::Command::new(env.python());
    cmd.arg(common::clients_dir().join("python").join("read_parquet.py"))
        .arg(&file);
    let got = common::run_client(cmd, common::CLIENT_TIMEOUT);

    assert_eq!(got["num_rows"], 2, "{got:#}");
    let columns: Vec<&str> = got["columns"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(Value::as_str)
        .collect();
    for c in [
        "call_id",
        "session_id",
        "group_id",
        "seq",
        "started_at_us",
        "finished_at_us",
        "dialect",
        "endpoint",
        "model",
        "upstream",
        "stream",
        "request",
        "response",
        "status",
        "outcome",
        "error",
        "finish_reason",
        "ttft_ms",
        "latency_ms",
        "client",
    ] {
        assert!(columns.contains(&c), "column {c} missing from {columns:?}");
    }
    assert!(
        columns.iter().any(|c| c.starts_with("usage")),
        "no usage column in {columns:?}"
    );
    assert_eq!(
        got["column_types"]["request"], "string",
        "request is a JSON string column: {got:#}"
    );
    let duck_columns: Vec<&str> = got["duckdb_columns"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(Value::as_str)
        .collect();
    assert_eq!(
        duck_columns, columns,
        "duckdb sees the same columns as pyarrow"
    );

    for (session, sent, rec) in [
        ("pq-a", &chat["sent"], &recs_a[0]),
        ("pq-b", &tools["sent"], &recs_b[0]),
    ] {
        let row = got["rows"]
            .as_array()
            .unwrap()
            .iter()
            .find(|r| r["session_id"] == session)
            .unwrap_or_else(|| panic!("no row for {session}: {got:#}"));
        assert_eq!(row["call_id"], rec["call_id"]);
        assert_eq!(row["outcome"], "ok");
        let request: Value = serde_json::from_str(row["request"].as_str().unwrap()).unwrap();
        assert_eq!(
            &request, sent,
            "the exported request is the full body the client sent"
        );
        let duck = got["duckdb_rows"]
            .as_array()
            .unwrap()
            .iter()
            .find(|r| r["session_id"] == session)
            .unwrap();
        let request: Value = serde_json::from_str(duck["request"].as_str().unwrap()).unwrap();
        assert_eq!(&request, sent, "duckdb reads the same request");
    }
}

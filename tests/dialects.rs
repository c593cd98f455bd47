//! The Responses (`POST /v1/responses`) and Anthropic Messages (`POST /v1/messages`)
//! dialects, translated to Chat Completions for the Chat-only scripted upstream and back:
//! real clients (Codex CLI, openai Python/Node SDKs, anthropic SDK, litellm's `anthropic/`
//! route) through real sessions, checked on what the client got AND on the records
//! (`graft records show --json`): the client's request exactly as sent, the Chat request
//! graft sent upstream, the normalized conversation, and the answer assembled in the
//! client's dialect. Plus bad input on both routes, answered in each dialect's error shape.
//!
//! Needs `bash scripts/setup-test-env.sh` first (the bad-input tests do not).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use common::{Stack, TestEnv, assert_ok_translated_record, graft, http, scripted_content};
use serde_json::{Value, json};

const WEATHER_ARGS: &str = r#"{"city":"Paris"}"#;

fn weather_args() -> Value {
    serde_json::from_str(WEATHER_ARGS).unwrap()
}

fn parse_args(v: &Value) -> Value {
    let s = v
        .as_str()
        .unwrap_or_else(|| panic!("arguments must be a JSON string: {v}"));
    serde_json::from_str(s).unwrap_or_else(|e| panic!("arguments {s:?} are not whole JSON ({e})"))
}

/// The Chat message list graft sent upstream.
fn upstream_messages(rec: &Value) -> &Vec<Value> {
    rec["upstream_request"]["messages"]
        .as_array()
        .unwrap_or_else(|| panic!("no upstream_request.messages: {rec:#}"))
}

/// The `get_weather` tool, translated to Chat's `{type: function, function: {...}}`.
fn assert_upstream_weather_tool(rec: &Value) {
    let tools = rec["upstream_request"]["tools"]
        .as_array()
        .unwrap_or_else(|| panic!("no upstream tools: {rec:#}"));
    assert_eq!(tools.len(), 1, "{tools:?}");
    assert_eq!(tools[0]["type"], "function", "{tools:?}");
    assert_eq!(tools[0]["function"]["name"], "get_weather", "{tools:?}");
    assert_eq!(
        tools[0]["function"]["parameters"]["properties"]["city"]["type"], "string",
        "{tools:?}"
    );
}

/// Call 2 of a weather conversation, upstream: the assistant's tool call and the tool
/// result, linked by `call_id`, as Chat messages.
fn assert_upstream_tool_round_trip(rec: &Value, call_id: &str) {
    let msgs = upstream_messages(rec);
    let last = msgs.last().unwrap();
    assert_eq!(last["role"], "tool", "{msgs:#?}");
    assert_eq!(last["tool_call_id"], call_id, "{msgs:#?}");
    assert!(
        last["content"].to_string().contains("graft-weather-result"),
        "{msgs:#?}"
    );
    let assistant = msgs
        .iter()
        .rev()
        .find(|m| m["role"] == "assistant")
        .unwrap_or_else(|| panic!("no assistant message upstream: {msgs:#?}"));
    let calls = assistant["tool_calls"].as_array().unwrap();
    assert_eq!(calls.len(), 1, "{assistant}");
    assert_eq!(calls[0]["id"], call_id, "{assistant}");
    assert_eq!(calls[0]["function"]["name"], "get_weather", "{assistant}");
    assert_eq!(
        parse_args(&calls[0]["function"]["arguments"]),
        weather_args()
    );
}

fn final_weather_text() -> String {
    scripted_content("graft-weather-result")
}

// -------------------------------------------------------------------------------------
// Responses

/// The `function_call` items of a Responses `response` object.
fn function_calls(response: &Value) -> Vec<&Value> {
    response["output"]
        .as_array()
        .unwrap_or_else(|| panic!("response has no output: {response:#}"))
        .iter()
        .filter(|i| i["type"] == "function_call")
        .collect()
}

/// The text of the `message` items of a Responses `response` object.
fn output_text(response: &Value) -> String {
    response["output"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|i| i["type"] == "message")
        .flat_map(|i| i["content"].as_array().cloned().unwrap_or_default())
        .filter(|c| c["type"] == "output_text")
        .map(|c| c["text"].as_str().unwrap_or_default().to_owned())
        .collect()
}

/// A two-call weather conversation over Responses (Python JSON/stream, Node stream): what
/// the client got, and what each of the two records holds.
fn check_responses_weather(out: &Value, stack: &Stack, session: &str, stream: bool) {
    let calls = out["calls"].as_array().unwrap();
    let sent = out["sent"].as_array().unwrap();
    assert_eq!((calls.len(), sent.len()), (2, 2), "{out:#}");

    // What the client got: call 1 a function call with whole arguments, call 2 the answer.
    let fc = &calls[0]["function_calls"].as_array().unwrap()[0];
    assert_eq!(fc["name"], "get_weather", "{out:#}");
    assert_eq!(parse_args(&fc["arguments"]), weather_args());
    let call_id = fc["call_id"].as_str().unwrap();
    assert!(!call_id.is_empty());
    assert!(calls[1]["function_calls"].as_array().unwrap().is_empty());
    let final_text = calls[1]["output_text"]
        .as_str()
        .map(str::to_owned)
        .unwrap_or_else(|| output_text(&json!({"output": calls[1]["output"]})));
    assert_eq!(final_text, final_weather_text(), "{out:#}");
    if stream {
        for c in calls {
            let events: Vec<&str> = c["events"]
                .as_array()
                .unwrap()
                .iter()
                .filter_map(Value::as_str)
                .collect();
            assert_eq!(events.first(), Some(&"response.created"), "{events:?}");
            assert_eq!(events.last(), Some(&"response.completed"), "{events:?}");
            for e in ["response.output_item.added", "response.output_item.done"] {
                assert!(events.contains(&e), "{e} missing: {events:?}");
            }
        }
        let ev0: Vec<&str> = calls[0]["events"]
            .as_array()
            .unwrap()
            .iter()
            .filter_map(Value::as_str)
            .collect();
        assert!(
            ev0.contains(&"response.function_call_arguments.delta"),
            "{ev0:?}"
        );
        // The argument deltas add up to the whole arguments.
        let deltas: String = calls[0]["delta_arguments"]
            .as_array()
            .unwrap()
            .iter()
            .filter_map(Value::as_str)
            .collect();
        assert_eq!(
            serde_json::from_str::<Value>(&deltas).unwrap(),
            weather_args()
        );
        assert_eq!(calls[1]["delta_text"], final_weather_text().as_str());
    }

    let recs = stack.wait_records(session, 2);
    assert_eq!(recs.len(), 2, "{recs:#?}");
    for (i, rec) in recs.iter().enumerate() {
        assert_ok_translated_record(rec, session, "responses", stream, stack);
        assert_eq!(rec["seq"], i as u64 + 1);
        assert_eq!(
            rec["request"], sent[i],
            "the recorded request is exactly the body the client sent"
        );
        let resp = &rec["response"];
        assert_eq!(resp["object"], "response", "{resp:#}");
        assert_eq!(resp["id"], calls[i]["id"], "{resp:#}");
        assert_eq!(resp["status"], "completed", "{resp:#}");
        assert_upstream_weather_tool(rec);
        if stream {
            assert!(rec["ttft_ms"].as_f64().is_some(), "ttft: {rec:#}");
        }
    }
    // Call 1: the user's question went upstream as the last Chat message; the recorded
    // answer holds the function call with whole arguments and the client's call_id.
    let m1 = upstream_messages(&recs[0]);
    assert_eq!(m1.last().unwrap()["role"], "user", "{m1:#?}");
    assert!(
        m1.last().unwrap()["content"]
            .to_string()
            .contains("graft-weather-ask")
    );
    let rec_calls = function_calls(&recs[0]["response"]);
    assert_eq!(rec_calls.len(), 1, "{:#}", recs[0]["response"]);
    assert_eq!(rec_calls[0]["call_id"], call_id);
    assert_eq!(rec_calls[0]["name"], "get_weather");
    assert_eq!(parse_args(&rec_calls[0]["arguments"]), weather_args());
    // Call 2: function_call + function_call_output became a tool round trip upstream, and
    // the answer is the model's text.
    assert_upstream_tool_round_trip(&recs[1], call_id);
    assert!(function_calls(&recs[1]["response"]).is_empty());
    assert_eq!(output_text(&recs[1]["response"]), final_weather_text());
}

#[test]
fn openai_python_responses_json_function_call_then_answer() {
    let env = TestEnv::get();
    let stack = Stack::start();
    stack.open_session("resp-json");
    let out = env.py_client(
        "openai_responses.py",
        &["json"],
        &stack.target(Some("resp-json"), None),
    );
    assert_eq!(out["calls"][0]["object"], "response", "{out:#}");
    check_responses_weather(&out, &stack, "resp-json", false);
    // Responses carries `instructions` as the system message upstream.
    let recs = stack.wait_records("resp-json", 2);
    let first = &upstream_messages(&recs[0])[0];
    assert!(
        matches!(first["role"].as_str(), Some("system" | "developer")),
        "{first}"
    );
    assert!(first["content"].to_string().contains("You are a test."));
    assert!(
        recs[0]["client"]
            .as_str()
            .is_some_and(|c| c.contains("OpenAI/Python")),
        "{}",
        recs[0]["client"]
    );
}

#[test]
fn openai_python_responses_stream_function_call_then_answer() {
    let env = TestEnv::get();
    let stack = Stack::start();
    stack.open_session("resp-stream");
    let out = env.py_client(
        "openai_responses.py",
        &["stream"],
        &stack.target(None, Some("resp-stream")),
    );
    check_responses_weather(&out, &stack, "resp-stream", true);
}

#[test]
fn openai_node_responses_stream_function_call_then_answer() {
    let env = TestEnv::get();
    let stack = Stack::start();
    stack.open_session("resp-node");
    let out = env.node_client(
        "openai_responses_stream.cjs",
        &stack.target(Some("resp-node"), None),
    );
    check_responses_weather(&out, &stack, "resp-node", true);
    let recs = stack.wait_records("resp-node", 2);
    assert!(
        recs[0]["client"]
            .as_str()
            .is_some_and(|c| c.contains("OpenAI/JS")),
        "{}",
        recs[0]["client"]
    );
}

#[test]
fn codex_exec_runs_a_two_turn_task_through_one_session() {
    let env = TestEnv::get();
    let stack = Stack::start();
    let session = stack.open_session("codex-1");
    let target = stack.target(Some("codex-1"), None);
    // The config Codex runs with is exactly what `graft harness config codex` prints.
    let config_text = graft(&[
        "harness",
        "config",
        "codex",
        "--session",
        session["base_url"].as_str().unwrap_or(&target.base_url),
        "--api-key",
        &target.api_key,
        "--model",
        &target.model,
    ]);
    assert!(
        config_text.contains("wire_api = \"responses\""),
        "{config_text}"
    );
    let config = stack.dir.path().join("codex-config.toml");
    std::fs::write(&config, &config_text).unwrap();
    let out = env.codex_client(&config, &target);

    // Codex ran the scripted command (turn 1) and then ended with the scripted answer.
    assert_eq!(
        out["result_txt"], "graft-codex-step-done\n",
        "codex did not run the scripted exec_command: {out:#}"
    );
    assert!(
        out["last_message"]
            .as_str()
            .is_some_and(|m| m.contains(&scripted_content("graft-codex-step-done"))),
        "{out:#}"
    );

    let recs = stack.wait_records("codex-1", 2);
    assert_eq!(recs.len(), 2, "exactly two model calls: {recs:#?}");
    for (i, rec) in recs.iter().enumerate() {
        // Codex always streams.
        assert_ok_translated_record(rec, "codex-1", "responses", true, &stack);
        assert_eq!(rec["seq"], i as u64 + 1);
        assert_eq!(rec["request"]["stream"], true);
        assert_eq!(rec["response"]["object"], "response");
        assert_eq!(rec["response"]["status"], "completed");
        assert!(
            rec["client"]
                .as_str()
                .is_some_and(|c| c.contains("codex_exec")),
            "{}",
            rec["client"]
        );
        // Its shell tool reached the upstream as a Chat function tool.
        let tools = rec["upstream_request"]["tools"].as_array().unwrap();
        assert!(
            tools
                .iter()
                .any(|t| t["type"] == "function" && t["function"]["name"] == "exec_command"),
            "{tools:#?}"
        );
    }
    // Turn 1: the task went up as the last user message; the answer is an exec_command
    // call with whole arguments.
    let input1 = recs[0]["request"]["input"].as_array().unwrap();
    assert!(
        input1
            .last()
            .unwrap()
            .to_string()
            .contains("graft-codex-task"),
        "{input1:#?}"
    );
    let calls = function_calls(&recs[0]["response"]);
    assert_eq!(calls.len(), 1, "{:#}", recs[0]["response"]);
    assert_eq!(calls[0]["name"], "exec_command");
    let call_id = calls[0]["call_id"].as_str().unwrap();
    assert_eq!(
        parse_args(&calls[0]["arguments"]),
        json!({"cmd": "echo graft-codex-step-done > codex_result.txt && cat codex_result.txt"})
    );
    // Turn 2: Codex resent the whole history plus the function call and its output.
    let input2 = recs[1]["request"]["input"].as_array().unwrap();
    assert_eq!(
        &input2[..input1.len()],
        &input1[..],
        "turn 2 starts with turn 1's input"
    );
    let fc = input2
        .iter()
        .find(|i| i["type"] == "function_call")
        .unwrap_or_else(|| panic!("no function_call in turn 2: {input2:#?}"));
    assert_eq!(fc["call_id"], call_id);
    assert_eq!(fc["name"], "exec_command");
    let fco = input2
        .iter()
        .find(|i| i["type"] == "function_call_output")
        .unwrap_or_else(|| panic!("no function_call_output in turn 2: {input2:#?}"));
    assert_eq!(fco["call_id"], call_id);
    assert!(
        fco["output"].to_string().contains("graft-codex-step-done"),
        "{fco}"
    );
    let up2 = upstream_messages(&recs[1]);
    assert_eq!(up2.last().unwrap()["role"], "tool", "{up2:#?}");
    assert_eq!(up2.last().unwrap()["tool_call_id"], call_id, "{up2:#?}");
    assert_eq!(
        output_text(&recs[1]["response"]),
        scripted_content("graft-codex-step-done")
    );
}

// -------------------------------------------------------------------------------------
// Anthropic Messages

fn tool_uses(message: &Value) -> Vec<&Value> {
    message["content"]
        .as_array()
        .unwrap_or_else(|| panic!("message has no content: {message:#}"))
        .iter()
        .filter(|b| b["type"] == "tool_use")
        .collect()
}

fn message_text(message: &Value) -> String {
    message["content"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|b| b["type"] == "text")
        .map(|b| b["text"].as_str().unwrap_or_default().to_owned())
        .collect()
}

fn check_anthropic_weather(out: &Value, stack: &Stack, session: &str, stream: bool) {
    let calls = out["calls"].as_array().unwrap();
    let sent = out["sent"].as_array().unwrap();
    assert_eq!((calls.len(), sent.len()), (2, 2), "{out:#}");

    // What the client got.
    let first = &calls[0];
    assert_eq!(first["type"], "message", "{out:#}");
    assert_eq!(first["role"], "assistant");
    assert_eq!(first["stop_reason"], "tool_use", "{out:#}");
    assert_eq!(
        first["text"],
        scripted_content("graft-weather-ask").as_str()
    );
    let tu = &first["tool_uses"].as_array().unwrap()[0];
    assert_eq!(tu["name"], "get_weather");
    assert_eq!(tu["input"], weather_args());
    let tool_use_id = tu["id"].as_str().unwrap();
    assert!(!tool_use_id.is_empty());
    assert_eq!(calls[1]["stop_reason"], "end_turn", "{out:#}");
    assert_eq!(calls[1]["text"], final_weather_text().as_str());
    assert!(calls[1]["tool_uses"].as_array().unwrap().is_empty());
    for c in calls {
        assert!(
            c["usage"]["input_tokens"].as_u64().is_some()
                && c["usage"]["output_tokens"].as_u64().is_some(),
            "{c:#}"
        );
    }
    if stream {
        for c in calls {
            let events: Vec<&str> = c["events"]
                .as_array()
                .unwrap()
                .iter()
                .filter_map(Value::as_str)
                .collect();
            for e in [
                "message_start",
                "content_block_start",
                "content_block_delta",
                "content_block_stop",
                "message_delta",
                "message_stop",
            ] {
                assert!(events.contains(&e), "{e} missing: {events:?}");
            }
        }
        assert_eq!(
            serde_json::from_str::<Value>(first["delta_input_json"].as_str().unwrap()).unwrap(),
            weather_args()
        );
        assert_eq!(calls[1]["delta_text"], final_weather_text().as_str());
    }

    let recs = stack.wait_records(session, 2);
    assert_eq!(recs.len(), 2, "{recs:#?}");
    for (i, rec) in recs.iter().enumerate() {
        assert_ok_translated_record(rec, session, "anthropic_messages", stream, stack);
        assert_eq!(rec["seq"], i as u64 + 1);
        assert_eq!(
            rec["request"], sent[i],
            "the recorded request is exactly the body the client sent"
        );
        let resp = &rec["response"];
        assert_eq!(resp["type"], "message", "{resp:#}");
        assert_eq!(resp["role"], "assistant", "{resp:#}");
        assert_eq!(resp["id"], calls[i]["id"], "{resp:#}");
        assert_eq!(resp["stop_reason"], calls[i]["stop_reason"], "{resp:#}");
        assert_upstream_weather_tool(rec);
        // `system` went upstream as the first Chat message.
        let m = upstream_messages(rec);
        assert_eq!(m[0]["role"], "system", "{m:#?}");
        assert!(m[0]["content"].to_string().contains("You are a test."));
        if stream {
            assert!(rec["ttft_ms"].as_f64().is_some(), "ttft: {rec:#}");
        }
    }
    // Call 1: the recorded message holds the tool_use block, input whole.
    let rec_uses = tool_uses(&recs[0]["response"]);
    assert_eq!(rec_uses.len(), 1, "{:#}", recs[0]["response"]);
    assert_eq!(rec_uses[0]["id"], tool_use_id);
    assert_eq!(rec_uses[0]["name"], "get_weather");
    assert_eq!(rec_uses[0]["input"], weather_args());
    assert_eq!(
        message_text(&recs[0]["response"]),
        scripted_content("graft-weather-ask")
    );
    // Call 2: tool_use + tool_result became a Chat tool round trip upstream.
    assert_upstream_tool_round_trip(&recs[1], tool_use_id);
    assert!(tool_uses(&recs[1]["response"]).is_empty());
    assert_eq!(message_text(&recs[1]["response"]), final_weather_text());
}

#[test]
fn anthropic_sdk_messages_json_tool_use_then_answer() {
    let env = TestEnv::get();
    let stack = Stack::start();
    stack.open_session("anth-json");
    let out = env.py_client(
        "anthropic_sdk.py",
        &["json"],
        &stack.target(Some("anth-json"), None),
    );
    check_anthropic_weather(&out, &stack, "anth-json", false);
    let recs = stack.wait_records("anth-json", 2);
    assert!(
        recs[0]["client"]
            .as_str()
            .is_some_and(|c| c.contains("Anthropic/Python")),
        "{}",
        recs[0]["client"]
    );
}

#[test]
fn anthropic_sdk_messages_stream_tool_use_then_answer() {
    let env = TestEnv::get();
    let stack = Stack::start();
    stack.open_session("anth-stream");
    let out = env.py_client(
        "anthropic_sdk.py",
        &["stream"],
        &stack.target(None, Some("anth-stream")),
    );
    check_anthropic_weather(&out, &stack, "anth-stream", true);
}

#[test]
fn litellm_anthropic_route_gets_a_tool_call_through_messages() {
    let env = TestEnv::get();
    let stack = Stack::start();
    stack.open_session("litellm-anth");
    let out = env.py_client(
        "litellm_anthropic.py",
        &[],
        &stack.target(Some("litellm-anth"), None),
    );
    let calls = out["tool_calls"].as_array().unwrap();
    assert_eq!(calls.len(), 1, "{out:#}");
    assert_eq!(calls[0]["name"], "get_weather");
    assert_eq!(parse_args(&calls[0]["arguments"]), weather_args());
    assert_eq!(out["finish_reason"], "tool_calls", "{out:#}");

    let recs = stack.wait_records("litellm-anth", 1);
    assert_eq!(recs.len(), 1, "{recs:#?}");
    let rec = &recs[0];
    let stream = rec["stream"].as_bool().unwrap_or(false);
    assert_ok_translated_record(rec, "litellm-anth", "anthropic_messages", stream, &stack);
    // litellm moved the system message to `system` and the tool to Anthropic's shape.
    assert!(
        rec["request"]["system"]
            .to_string()
            .contains("You are a test.")
    );
    assert_eq!(rec["request"]["tools"][0]["name"], "get_weather");
    assert!(
        rec["request"]["messages"]
            .to_string()
            .contains("graft-weather-ask (litellm)")
    );
    let uses = tool_uses(&rec["response"]);
    assert_eq!(uses.len(), 1, "{:#}", rec["response"]);
    assert_eq!(uses[0]["input"], weather_args());
    assert_eq!(uses[0]["id"], calls[0]["id"]);
}

// -------------------------------------------------------------------------------------
// Bad input, in each dialect's own error shape

fn json_of(r: &http::Resp) -> Value {
    serde_json::from_slice(&r.body).unwrap_or_else(|e| panic!("not JSON ({e}): {}", r.text()))
}

/// Anthropic's `{"type": "error", "error": {"type": "invalid_request_error", "message"}}`.
fn assert_anthropic_error(r: &http::Resp, needle: &str) {
    assert_eq!(r.status, 400, "{needle}: {}", r.text());
    let v = json_of(r);
    assert_eq!(v["type"], "error", "{v}");
    assert_eq!(v["error"]["type"], "invalid_request_error", "{v}");
    let msg = v["error"]["message"].as_str().unwrap_or_default();
    assert!(
        msg.contains(needle),
        "message {msg:?} should mention {needle:?}"
    );
}

/// OpenAI's `{"error": {"message", "type", "code", "param"}}`.
fn assert_openai_error(r: &http::Resp, needle: &str) {
    assert_eq!(r.status, 400, "{needle}: {}", r.text());
    let v = json_of(r);
    assert!(v["error"].is_object(), "{v}");
    assert!(v["error"]["type"].is_string(), "{v}");
    assert!(v.get("type").is_none(), "not Anthropic's shape: {v}");
    let msg = v["error"]["message"].as_str().unwrap_or_default();
    assert!(
        msg.contains(needle),
        "message {msg:?} should mention {needle:?}"
    );
}

fn block_on<F: std::future::Future>(f: F) -> F::Output {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
        .block_on(f)
}

#[test]
fn bad_input_on_messages_gets_anthropic_errors_naming_the_field() {
    let stack = Stack::start();
    let session = stack.open_session("bad-anth");
    let url = format!("{}/messages", stack.base_url(Some("bad-anth")));
    let key = [
        ("x-api-key", session["api_key"].as_str().unwrap()),
        ("anthropic-version", "2023-06-01"),
    ];
    let good =
        json!({"model": "m", "max_tokens": 16, "messages": [{"role": "user", "content": "hi"}]});
    block_on(async {
        let r = http::post_raw(&url, &key, b"{\"model\": \"m\", \"messages\": [".to_vec()).await;
        assert_anthropic_error(&r, "JSON");
        let mut bad = good.clone();
        bad["messages"] = json!("hi");
        assert_anthropic_error(&http::post_json(&url, &key, &bad).await, "messages");
        let mut bad = good.clone();
        bad["model"] = json!(7);
        assert_anthropic_error(&http::post_json(&url, &key, &bad).await, "model");
        let mut bad = good.clone();
        bad["max_tokens"] = json!("many");
        assert_anthropic_error(&http::post_json(&url, &key, &bad).await, "max_tokens");

        // The route still works after them.
        let ok = http::post_json(&url, &key, &good).await;
        assert_eq!(ok.status, 200, "{}", ok.text());
        assert_eq!(json_of(&ok)["type"], "message", "{}", ok.text());
    });
    // Refused requests are not model calls: only the good one is recorded.
    let recs = stack.wait_records("bad-anth", 1);
    assert_eq!(recs.len(), 1, "only the good call is recorded: {recs:#?}");
    assert_eq!(recs[0]["request"], good);
}

#[test]
fn bad_input_on_responses_gets_openai_errors_naming_the_field() {
    let stack = Stack::start();
    let session = stack.open_session("bad-resp");
    let url = format!("{}/responses", stack.base_url(Some("bad-resp")));
    let auth = format!("Bearer {}", session["api_key"].as_str().unwrap());
    let key = [("authorization", auth.as_str())];
    let good = json!({"model": "m", "input": "hi"});
    block_on(async {
        let r = http::post_raw(&url, &key, b"{\"model\": \"m\", \"input\": [".to_vec()).await;
        assert_openai_error(&r, "JSON");
        let r = http::post_json(&url, &key, &json!({"model": "m", "input": 42})).await;
        assert_openai_error(&r, "input");
        assert_eq!(json_of(&r)["error"]["param"], "input", "{}", r.text());
        let r = http::post_json(
            &url,
            &key,
            &json!({"model": "m", "input": "hi", "tools": "x"}),
        )
        .await;
        assert_openai_error(&r, "tools");
        let r = http::post_json(&url, &key, &json!({"model": ["m"], "input": "hi"})).await;
        assert_openai_error(&r, "model");

        let ok = http::post_json(&url, &key, &good).await;
        assert_eq!(ok.status, 200, "{}", ok.text());
        assert_eq!(json_of(&ok)["object"], "response", "{}", ok.text());
    });
    let recs = stack.wait_records("bad-resp", 1);
    assert_eq!(recs.len(), 1, "only the good call is recorded: {recs:#?}");
    assert_eq!(recs[0]["request"], good);
}

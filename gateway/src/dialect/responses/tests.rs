use std::collections::HashMap;

use proptest::prelude::*;
use serde_json::{Value, json};

use super::*;
use crate::dialect::{
    Answer, Delta, Finish, Message, Part, Role, StreamEmitter, TokenUsage, ToolCall, ToolChoice,
};
use crate::error::GatewayError;

fn capture(name: &str) -> Value {
    // The captures are vendored under tests/fixtures; the shared originals beside the
    // checkout are a fallback, and GRAFT_CAPTURES_DIR overrides both.
    let base = env!("CARGO_MANIFEST_DIR");
    let mut candidates = vec![
        format!("{base}/tests/fixtures/captures/{name}"),
        format!("{base}/../shared/captures/{name}"),
        format!("{base}/../../shared/captures/{name}"),
    ];
    if let Ok(dir) = std::env::var("GRAFT_CAPTURES_DIR") {
        candidates.insert(0, format!("{dir}/{name}"));
    }
    for c in &candidates {
        if let Ok(s) = std::fs::read_to_string(c) {
            let v: Value = serde_json::from_str(&s).unwrap();
            return v["body"].clone();
        }
    }
    panic!("capture {name} not found in {candidates:?}: the shared captures are required");
}

fn answer(text: &str, reasoning: Option<&str>, calls: Vec<ToolCall>, finish: Finish) -> Answer {
    Answer {
        id: "up-1".into(),
        model: "m".into(),
        created: 1_700_000_000,
        text: text.into(),
        reasoning: reasoning.map(str::to_string),
        tool_calls: calls,
        finish,
        usage: Some(TokenUsage {
            input_tokens: 10,
            output_tokens: 5,
            cached_tokens: 2,
            reasoning_tokens: 1,
        }),
        logprobs: None,
    }
}

/// Splits SSE bytes into (event name, data JSON).
fn parse_sse(bytes: &[u8]) -> Vec<(String, Value)> {
    let s = std::str::from_utf8(bytes).unwrap();
    let mut out = Vec::new();
    for block in s.split("\n\n").filter(|b| !b.trim().is_empty()) {
        let mut name = String::new();
        let mut data = String::new();
        for line in block.lines() {
            if let Some(n) = line.strip_prefix("event: ") {
                name = n.to_string();
            } else if let Some(d) = line.strip_prefix("data: ") {
                data.push_str(d);
            }
        }
        out.push((name, serde_json::from_str(&data).unwrap()));
    }
    out
}

#[test]
fn python_sdk_string_input() {
    let c = parse_request(&capture("openai-python-sdk.responses-stream.json")).unwrap();
    assert_eq!(c.model, "mock-model");
    assert!(c.stream);
    assert_eq!(c.messages, vec![Message::text(Role::User, "hi")]);
    assert!(c.tools.is_empty());
}

#[test]
fn node_sdk_function_tool() {
    let c = parse_request(&capture("openai-node-sdk.responses.json")).unwrap();
    assert!(!c.stream);
    assert_eq!(c.messages, vec![Message::text(Role::User, "hi")]);
    assert_eq!(c.tools.len(), 1);
    assert_eq!(c.tools[0].name, "get_weather");
    assert_eq!(
        c.tools[0].parameters["properties"]["city"]["type"],
        "string"
    );
    assert!(c.notes.is_empty(), "{:?}", c.notes);
}

#[test]
fn codex_turn1() {
    let c = parse_request(&capture("codex.turn1.responses-sse.json")).unwrap();
    assert!(c.stream);
    let roles: Vec<Role> = c.messages.iter().map(|m| m.role).collect();
    assert_eq!(
        roles,
        vec![Role::Developer, Role::Developer, Role::User, Role::User]
    );
    assert!(
        c.messages[0]
            .joined_text()
            .starts_with("You are a coding agent")
    );
    assert_eq!(c.messages[3].joined_text(), "What does hello.py print?");
    let names: Vec<&str> = c.tools.iter().map(|t| t.name.as_str()).collect();
    assert_eq!(
        names,
        [
            "exec_command",
            "write_stdin",
            "request_user_input",
            "view_image",
            "get_goal",
            "create_goal",
            "update_goal"
        ]
    );
    assert_eq!(c.tool_choice, Some(ToolChoice::Auto));
    assert_eq!(c.parallel_tool_calls, Some(true));
    assert_eq!(
        c.reasoning.as_ref().unwrap().summary.as_deref(),
        Some("auto")
    );
    assert_eq!(c.extra["store"], json!(false));
    assert_eq!(c.extra["include"], json!(["reasoning.encrypted_content"]));
    assert!(c.extra.contains_key("prompt_cache_key"));
    assert!(c.extra.contains_key("client_metadata"));
    assert!(
        c.notes
            .iter()
            .any(|n| n.contains("namespace 'multi_agent_v1'"))
    );
    assert!(c.notes.iter().any(|n| n.contains("'web_search'")));
}

#[test]
fn codex_turn2_function_call_and_output() {
    let c = parse_request(&capture("codex.turn2-after-tool.responses-sse.json")).unwrap();
    assert_eq!(c.messages.len(), 6);
    let call = &c.messages[4];
    assert_eq!(call.role, Role::Assistant);
    assert!(call.content.is_empty());
    assert_eq!(
        call.tool_calls,
        vec![ToolCall {
            id: "call_bc249f76".into(),
            name: "exec_command".into(),
            arguments: "{\"cmd\": \"cat hello.py\"}".into(),
        }]
    );
    let out = &c.messages[5];
    assert_eq!(out.role, Role::Tool);
    assert_eq!(out.tool_call_id.as_deref(), Some("call_bc249f76"));
    assert_eq!(
        out.joined_text(),
        "Chunk ID: 428c61\nWall time: 0.1975 seconds\nProcess exited with code 0\nOriginal token count: 3\nOutput:\nprint('hi')\n"
    );
}

#[test]
fn parallel_calls_reasoning_and_instructions() {
    let body = json!({
        "model": "m",
        "instructions": "be brief",
        "input": [
            {"role": "user", "content": "go", "litellm_extra": null},
            {"type": "reasoning", "id": "rs_1", "summary": [{"type": "summary_text", "text": "think"}], "encrypted_content": "xyz"},
            {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "calling"}]},
            {"type": "function_call", "call_id": "a", "name": "f", "arguments": "{}"},
            {"type": "function_call", "call_id": "b", "name": "g", "arguments": "{\"x\":1}"},
            {"type": "function_call_output", "call_id": "a", "output": [{"type": "input_text", "text": "A"}]},
            {"type": "function_call_output", "call_id": "b", "output": "B"},
            {"type": "message", "role": "user", "content": [{"type": "input_image", "image_url": "data:image/png;base64,AA"}]}
        ],
        "max_output_tokens": 50,
        "metadata": {"k": "v"}
    });
    let c = parse_request(&body).unwrap();
    assert_eq!(c.messages[0], Message::text(Role::System, "be brief"));
    assert_eq!(c.messages[1], Message::text(Role::User, "go"));
    let a = &c.messages[2];
    assert_eq!(a.joined_text(), "calling");
    assert_eq!(a.reasoning.as_deref(), Some("think"));
    assert_eq!(a.tool_calls.len(), 2);
    assert_eq!(a.tool_calls[1].arguments, "{\"x\":1}");
    assert_eq!(c.messages[3].tool_call_id.as_deref(), Some("a"));
    assert_eq!(c.messages[4].joined_text(), "B");
    assert_eq!(
        c.messages[5].content,
        vec![Part::Image {
            url: "data:image/png;base64,AA".into()
        }]
    );
    assert_eq!(c.messages.len(), 6);
    assert_eq!(c.sampling.max_tokens, Some(50));
    assert!(c.notes.iter().any(|n| n.contains("encrypted_content")));
    assert_eq!(c.extra["instructions"], "be brief");
    let r = render_answer(&c, &answer("ok", None, vec![], Finish::Stop), "resp_x");
    assert_eq!(r["instructions"], "be brief");
    assert_eq!(r["metadata"], json!({"k": "v"}));
    assert_eq!(r["max_output_tokens"], 50);
    assert_eq!(r["previous_response_id"], Value::Null);
}

#[test]
fn custom_tool_maps_to_function_and_back() {
    let body = json!({
        "model": "m",
        "input": [
            {"type": "custom_tool_call", "call_id": "c1", "name": "apply_patch", "input": "*** Begin Patch"},
            {"type": "custom_tool_call_output", "call_id": "c1", "output": "done"}
        ],
        "tools": [{"type": "custom", "name": "apply_patch", "description": "Patch files.",
                   "format": {"type": "grammar", "syntax": "lark", "definition": "start: x"}}]
    });
    let c = parse_request(&body).unwrap();
    assert_eq!(c.tools[0].name, "apply_patch");
    assert!(
        c.tools[0]
            .description
            .as_deref()
            .unwrap()
            .contains("start: x")
    );
    assert_eq!(
        c.messages[0].tool_calls[0].arguments,
        json!({"input": "*** Begin Patch"}).to_string()
    );
    let call = ToolCall {
        id: "c2".into(),
        name: "apply_patch".into(),
        arguments: json!({"input": "P"}).to_string(),
    };
    let r = render_answer(
        &c,
        &answer("", None, vec![call.clone()], Finish::ToolCalls),
        "resp_1",
    );
    assert_eq!(r["output"][0]["type"], "custom_tool_call");
    assert_eq!(r["output"][0]["input"], "P");
    assert_eq!(r["output"][0]["call_id"], "c2");
    // Streamed the same way.
    let mut s = stream(&c, "resp_1");
    let mut bytes = s.start();
    bytes.extend(s.push(&Delta::ToolCallStart {
        index: 0,
        id: "c2".into(),
        name: "apply_patch".into(),
    }));
    bytes.extend(s.push(&Delta::ToolCallArgs {
        index: 0,
        arguments: call.arguments.clone(),
    }));
    bytes.extend(s.finish(&answer("", None, vec![call], Finish::ToolCalls)));
    let mut asm = ResponsesAssembler::new();
    for b in &bytes {
        for (_, ev) in parse_sse(b) {
            asm.push(&ev);
        }
    }
    assert_eq!(asm.finish().unwrap()["output"], r["output"]);
}

#[test]
fn bad_inputs_name_the_path() {
    let cases: Vec<(Value, &str)> = vec![
        (json!([]), "body"),
        (json!({"input": "x"}), "model"),
        (json!({"model": 3, "input": "x"}), "model"),
        (json!({"model": "m"}), "input"),
        (json!({"model": "m", "input": 5}), "input"),
        (json!({"model": "m", "input": [1]}), "input[0]"),
        (
            json!({"model": "m", "input": [{"foo": 1}]}),
            "input[0].type",
        ),
        (
            json!({"model": "m", "input": ["x", {"role": "user", "content": "a"}, {"role": "user", "content": "b"}, {"role": "user", "content": 7}]}),
            "input[0]",
        ),
        (
            json!({"model": "m", "input": [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}, {"role": "user", "content": "c"}, {"role": "user", "content": 7}]}),
            "input[3].content",
        ),
        (
            json!({"model": "m", "input": [{"role": "robot", "content": "a"}]}),
            "input[0].role",
        ),
        (
            json!({"model": "m", "input": [{"role": "user", "content": [{"type": "input_text", "text": 1}]}]}),
            "input[0].content[0].text",
        ),
        (
            json!({"model": "m", "input": [{"role": "user", "content": [{"type": "input_image", "image_url": 1}]}]}),
            "input[0].content[0].image_url",
        ),
        (
            json!({"model": "m", "input": [{"type": "function_call", "name": "f", "arguments": "{}"}]}),
            "input[0].call_id",
        ),
        (
            json!({"model": "m", "input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": 3}]}),
            "input[0].arguments",
        ),
        (
            json!({"model": "m", "input": [{"type": "function_call_output", "call_id": "c", "output": 3}]}),
            "input[0].output",
        ),
        (
            json!({"model": "m", "input": [{"type": "reasoning", "summary": "s"}]}),
            "input[0].summary",
        ),
        (
            json!({"model": "m", "input": [{"type": "item_reference", "id": "x"}]}),
            "input[0]",
        ),
        (
            json!({"model": "m", "input": "x", "previous_response_id": "resp_1"}),
            "previous_response_id",
        ),
        (json!({"model": "m", "input": "x", "tools": {}}), "tools"),
        (
            json!({"model": "m", "input": "x", "tools": [{"type": "function"}]}),
            "tools[0].name",
        ),
        (
            json!({"model": "m", "input": "x", "tools": [{"type": "function", "name": "f", "parameters": "x"}]}),
            "tools[0].parameters",
        ),
        (
            json!({"model": "m", "input": "x", "tool_choice": "sometimes"}),
            "tool_choice",
        ),
        (
            json!({"model": "m", "input": "x", "temperature": "hot"}),
            "temperature",
        ),
        (
            json!({"model": "m", "input": "x", "max_output_tokens": -1}),
            "max_output_tokens",
        ),
        (
            json!({"model": "m", "input": "x", "stream": "yes"}),
            "stream",
        ),
        (
            json!({"model": "m", "input": "x", "reasoning": {"effort": 1}}),
            "reasoning.effort",
        ),
    ];
    for (body, path) in cases {
        match parse_request(&body) {
            Err(GatewayError::InvalidField { param, message }) => {
                assert_eq!(param, path, "{body}: {message}");
                assert!(message.contains(path), "{message} should name {path}");
            }
            other => panic!("{body}: expected an InvalidField error for {path}, got {other:?}"),
        }
    }
}

#[test]
fn unknown_tools_and_nulls_are_tolerated() {
    let body = json!({
        "model": "m", "input": [{"type": "message", "role": "user", "content": "x", "status": null, "id": null}],
        "tools": [{"type": "local_shell"}, {"type": "file_search", "vector_store_ids": []}, {"type": "image_generation"}],
        "tool_choice": {"type": "web_search"},
        "temperature": null, "previous_response_id": null, "store": false, "truncation": "auto"
    });
    let c = parse_request(&body).unwrap();
    assert!(c.tools.is_empty());
    assert_eq!(c.notes.len(), 4, "{:?}", c.notes);
    assert_eq!(c.tool_choice, None);
    let r = render_answer(&c, &answer("x", None, vec![], Finish::Stop), "resp_1");
    assert_eq!(r["store"], false);
    assert_eq!(r["truncation"], "auto");
}

#[test]
fn render_text_and_tool_calls() {
    let c = parse_request(&json!({"model": "m", "input": "hi"})).unwrap();
    let calls = vec![
        ToolCall {
            id: "call_1".into(),
            name: "f".into(),
            arguments: "{\"a\":1}".into(),
        },
        ToolCall {
            id: "call_2".into(),
            name: "g".into(),
            arguments: "{}".into(),
        },
    ];
    let r = render_answer(
        &c,
        &answer("hello", Some("hmm"), calls, Finish::ToolCalls),
        "resp_abc",
    );
    assert_eq!(r["object"], "response");
    assert_eq!(r["id"], "resp_abc");
    assert_eq!(r["status"], "completed");
    assert_eq!(r["model"], "m");
    assert_eq!(r["created_at"], 1_700_000_000);
    let out = r["output"].as_array().unwrap();
    assert_eq!(out.len(), 4);
    assert_eq!(out[0]["type"], "reasoning");
    assert_eq!(out[0]["id"], "rs_abc_0");
    assert_eq!(out[0]["content"][0]["text"], "hmm");
    assert_eq!(out[1]["type"], "message");
    assert_eq!(out[1]["id"], "msg_abc_1");
    assert_eq!(out[1]["content"][0]["type"], "output_text");
    assert_eq!(out[1]["content"][0]["text"], "hello");
    assert_eq!(
        out[2],
        json!({"id": "fc_abc_2", "type": "function_call", "status": "completed", "call_id": "call_1", "name": "f", "arguments": "{\"a\":1}"})
    );
    assert_eq!(out[3]["call_id"], "call_2");
    assert_eq!(
        r["usage"],
        json!({"input_tokens": 10, "input_tokens_details": {"cached_tokens": 2}, "output_tokens": 5,
                   "output_tokens_details": {"reasoning_tokens": 1}, "total_tokens": 15})
    );
    let r = render_answer(&c, &answer("cut", None, vec![], Finish::Length), "resp_abc");
    assert_eq!(r["status"], "incomplete");
    assert_eq!(
        r["incomplete_details"],
        json!({"reason": "max_output_tokens"})
    );
    assert_eq!(r["output"][0]["status"], "incomplete");
}

#[test]
fn stream_event_order_text_then_tool_then_text() {
    let c = parse_request(&json!({"model": "m", "input": "hi"})).unwrap();
    let mut s = stream(&c, "resp_z");
    let mut bytes = s.start();
    bytes.extend(s.push(&Delta::Text("a".into())));
    bytes.extend(s.push(&Delta::ToolCallStart {
        index: 0,
        id: "c".into(),
        name: "f".into(),
    }));
    bytes.extend(s.push(&Delta::ToolCallArgs {
        index: 0,
        arguments: "{}".into(),
    }));
    bytes.extend(s.push(&Delta::Text("b".into())));
    bytes.extend(s.finish(&answer("ab", None, vec![], Finish::Length)));
    let events: Vec<(String, Value)> = bytes.iter().flat_map(|b| parse_sse(b)).collect();
    let names: Vec<&str> = events.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(
        names,
        [
            "response.created",
            "response.in_progress",
            "response.output_item.added",
            "response.content_part.added",
            "response.output_text.delta",
            "response.output_text.done",
            "response.content_part.done",
            "response.output_item.done",
            "response.output_item.added",
            "response.function_call_arguments.delta",
            "response.function_call_arguments.done",
            "response.output_item.done",
            "response.output_item.added",
            "response.content_part.added",
            "response.output_text.delta",
            "response.output_text.done",
            "response.content_part.done",
            "response.output_item.done",
            "response.incomplete",
        ]
    );
    for (n, v) in &events {
        assert_eq!(v["type"], n.as_str());
    }
    assert_eq!(events[0].1["response"]["status"], "in_progress");
    let last = &events.last().unwrap().1["response"];
    assert_eq!(last["status"], "incomplete");
    assert_eq!(last["incomplete_details"]["reason"], "max_output_tokens");
    assert_eq!(last["output"][2]["id"], "msg_z_2");
    assert_eq!(last["output"][2]["status"], "incomplete");
    assert_eq!(last["output"][1]["arguments"], "{}");
}

#[test]
fn errors_mid_stream() {
    let err = GatewayError::UpstreamStream {
        upstream: "u".into(),
        detail: "reset".into(),
    };
    let evs = parse_sse(&error_event(&err, "resp_q"));
    assert_eq!(evs.len(), 2);
    assert_eq!(evs[0].0, "error");
    assert_eq!(evs[0].1["code"], "upstream_stream_interrupted");
    assert!(evs[0].1["message"].as_str().unwrap().contains("reset"));
    assert!(evs[0].1["error"].is_object());
    assert_eq!(evs[1].1["response"]["status"], "failed");
    assert_eq!(
        evs[1].1["response"]["error"]["code"],
        "upstream_stream_interrupted"
    );
    assert!(evs[0].1["sequence_number"].as_u64() < evs[1].1["sequence_number"].as_u64());

    let c = parse_request(&json!({"model": "m", "input": "hi"})).unwrap();
    let mut s = stream(&c, "resp_q");
    let mut bytes = s.start();
    bytes.extend(s.push(&Delta::Text("par".into())));
    let ctx = GatewayError::UpstreamStatus {
        upstream: "u".into(),
        status: 400,
        detail: "maximum context length is 8192".into(),
    };
    bytes.extend(s.fail(&ctx));
    assert!(s.finish(&answer("", None, vec![], Finish::Stop)).is_empty());
    let evs: Vec<(String, Value)> = bytes.iter().flat_map(|b| parse_sse(b)).collect();
    let (name, failed) = evs.last().unwrap();
    assert_eq!(name, "response.failed");
    assert_eq!(
        failed["response"]["error"]["code"],
        "context_length_exceeded"
    );
    let mut asm = ResponsesAssembler::new();
    for (_, e) in &evs {
        asm.push(e);
    }
    assert_eq!(asm.finish().unwrap()["status"], "failed");
}

#[test]
fn assembler_builds_from_deltas_without_terminal() {
    let mut asm = ResponsesAssembler::new();
    assert!(asm.finish().is_none());
    for e in [
        json!({"type": "response.created", "response": {"id": "r", "object": "response", "status": "in_progress", "output": []}}),
        json!({"type": "response.output_item.added", "output_index": 0, "item": {"id": "rs", "type": "reasoning", "summary": []}}),
        json!({"type": "response.reasoning_summary_text.delta", "item_id": "rs", "output_index": 0, "summary_index": 0, "delta": "th"}),
        json!({"type": "response.reasoning_summary_text.delta", "item_id": "rs", "output_index": 0, "summary_index": 0, "delta": "ink"}),
        json!({"type": "response.output_item.added", "output_index": 1, "item": {"id": "fc", "type": "function_call", "call_id": "c", "name": "f", "arguments": ""}}),
        json!({"type": "response.function_call_arguments.delta", "item_id": "fc", "delta": "{\"a\""}),
        json!({"type": "response.function_call_arguments.delta", "item_id": "fc", "output_index": 1, "delta": ":1}"}),
    ] {
        asm.push(&e);
    }
    let r = asm.finish().unwrap();
    assert_eq!(r["status"], "incomplete");
    assert_eq!(r["output"][0]["summary"][0]["text"], "think");
    assert_eq!(r["output"][1]["arguments"], "{\"a\":1}");
    // A terminal event with an empty output (as some servers send) gets the items.
    asm.push(&json!({"type": "response.completed", "response": {"id": "r", "status": "completed", "output": [], "usage": {"input_tokens": 1}}}));
    let r = asm.finish().unwrap();
    assert_eq!(r["status"], "completed");
    assert_eq!(r["output"].as_array().unwrap().len(), 2);
}

/// Splits `s` into pieces at the given char cut points.
fn chop(s: &str, cuts: &[usize]) -> Vec<String> {
    let chars: Vec<char> = s.chars().collect();
    let mut points: Vec<usize> = cuts.iter().map(|c| c % (chars.len() + 1)).collect();
    points.push(0);
    points.push(chars.len());
    points.sort_unstable();
    points.dedup();
    points
        .windows(2)
        .map(|w| chars[w[0]..w[1]].iter().collect::<String>())
        .filter(|p| !p.is_empty())
        .collect()
}

fn json_args() -> impl Strategy<Value = String> {
    prop::collection::btree_map(
        "[a-z]{1,5}",
        prop_oneof![
            any::<i64>().prop_map(|n| json!(n)),
            "[ -~é😀\\n\"]{0,12}".prop_map(|s| json!(s)),
            any::<bool>().prop_map(|b| json!(b)),
        ],
        0..4,
    )
    .prop_map(|m| serde_json::to_string(&m).unwrap())
}

proptest! {
    #[test]
    fn stream_matches_render(
        text in "[ -~é😀\\n]{0,40}",
        reasoning in prop::option::of("[ -~ü\\n]{1,30}"),
        calls in prop::collection::vec(("[a-z_]{1,8}", json_args()), 0..4),
        cuts in prop::collection::vec(any::<usize>(), 0..8),
        finish in prop_oneof![Just(Finish::Stop), Just(Finish::Length), Just(Finish::ToolCalls)],
    ) {
        let conv = parse_request(&json!({"model": "m", "input": "hi", "stream": true})).unwrap();
        let tool_calls: Vec<ToolCall> = calls
            .iter()
            .enumerate()
            .map(|(i, (name, args))| ToolCall { id: format!("call_{i}"), name: name.clone(), arguments: args.clone() })
            .collect();
        let ans = answer(&text, reasoning.as_deref(), tool_calls.clone(), finish);

        let mut deltas = Vec::new();
        if let Some(r) = &reasoning {
            deltas.extend(chop(r, &cuts).into_iter().map(Delta::Reasoning));
        }
        deltas.extend(chop(&text, &cuts).into_iter().map(Delta::Text));
        for (i, tc) in tool_calls.iter().enumerate() {
            deltas.push(Delta::ToolCallStart { index: i, id: tc.id.clone(), name: tc.name.clone() });
            deltas.extend(chop(&tc.arguments, &cuts).into_iter().map(|a| Delta::ToolCallArgs { index: i, arguments: a }));
        }

        let mut s = stream(&conv, "resp_p");
        let mut bytes = s.start();
        for d in &deltas {
            bytes.extend(s.push(d));
        }
        bytes.extend(s.finish(&ans));
        let all: Vec<u8> = bytes.iter().flat_map(|b| b.iter().copied()).collect();
        let events = parse_sse(&all);

        let mut last_seq = None;
        let mut added: HashMap<String, usize> = HashMap::new();
        let mut done: HashMap<String, usize> = HashMap::new();
        let mut asm = ResponsesAssembler::new();
        for (name, ev) in &events {
            prop_assert_eq!(ev["type"].as_str(), Some(name.as_str()));
            let seq = ev["sequence_number"].as_u64().unwrap();
            prop_assert!(last_seq.is_none_or(|l| seq > l));
            last_seq = Some(seq);
            if name == "response.output_item.added" {
                *added.entry(ev["item"]["id"].as_str().unwrap().to_string()).or_default() += 1;
            }
            if name == "response.output_item.done" {
                *done.entry(ev["item"]["id"].as_str().unwrap().to_string()).or_default() += 1;
            }
            asm.push(ev);
        }
        prop_assert!(added.values().all(|n| *n == 1));
        prop_assert_eq!(&added, &done);

        let rendered = render_answer(&conv, &ans, "resp_p");
        let assembled = asm.finish().unwrap();
        prop_assert_eq!(&assembled["output"], &rendered["output"]);
        prop_assert_eq!(&assembled["usage"], &rendered["usage"]);
        prop_assert_eq!(&assembled["status"], &rendered["status"]);
        prop_assert_eq!(added.len(), rendered["output"].as_array().unwrap().len());

        // The assembler also rebuilds the same output from the deltas alone.
        let mut from_deltas = ResponsesAssembler::new();
        for (name, ev) in &events {
            if name != "response.output_item.done" && !name.starts_with("response.completed") && !name.starts_with("response.incomplete") {
                from_deltas.push(ev);
            }
        }
        let partial = from_deltas.finish().unwrap();
        let strip = |v: &Value| -> Vec<Value> {
            v.as_array().unwrap().iter().map(|i| {
                let mut i = i.clone();
                i.as_object_mut().unwrap().remove("status");
                i
            }).collect()
        };
        prop_assert_eq!(strip(&partial["output"]), strip(&rendered["output"]));
    }
}

use bytes::Bytes;
use proptest::prelude::*;
use serde_json::{Value, json};

use super::render::tool_use_id;
use super::*;
use crate::dialect::{
    Answer, Conversation, Delta, Finish, Message, Part, Role, StreamEmitter, TokenUsage, Tool,
    ToolCall, ToolChoice,
};
use crate::error::GatewayError;

fn parse_err(body: Value) -> (String, String) {
    match parse_request(&body) {
        Err(GatewayError::InvalidField { param, message }) => (param, message),
        other => panic!("expected an InvalidField error, got {other:?}"),
    }
}

/// Splits SSE bytes into (event name, data JSON), checking each event's name is its type.
fn sse_events(chunks: &[Bytes]) -> Vec<(String, Value)> {
    let all: Vec<u8> = chunks.iter().flat_map(|c| c.iter().copied()).collect();
    let text = String::from_utf8(all).unwrap();
    assert!(text.ends_with("\n\n"), "stream must end with a blank line");
    let mut out = Vec::new();
    for raw in text.split("\n\n").filter(|e| !e.is_empty()) {
        let mut name = None;
        let mut data = None;
        for line in raw.lines() {
            if let Some(n) = line.strip_prefix("event: ") {
                name = Some(n.to_string());
            } else if let Some(d) = line.strip_prefix("data: ") {
                data = Some(serde_json::from_str::<Value>(d).unwrap());
            } else {
                panic!("unexpected SSE line {line:?}");
            }
        }
        let (name, data) = (name.unwrap(), data.unwrap());
        assert_eq!(data["type"], name, "event name must equal data.type");
        out.push((name, data));
    }
    out
}

/// Block indexes start at 0 and increase by one, at most one block is open, deltas go to
/// the open block, and every started block is stopped exactly once.
fn check_block_discipline(events: &[(String, Value)]) {
    assert_eq!(events.first().unwrap().0, "message_start");
    assert_eq!(events.last().unwrap().0, "message_stop");
    assert_eq!(events[events.len() - 2].0, "message_delta");
    let mut next = 0u64;
    let mut open: Option<u64> = None;
    let mut stopped = Vec::new();
    for (name, data) in events {
        let index = data.get("index").and_then(Value::as_u64);
        match name.as_str() {
            "content_block_start" => {
                assert_eq!(open, None, "a block started while another was open");
                assert_eq!(index, Some(next), "block indexes must be contiguous");
                open = index;
                next += 1;
            }
            "content_block_delta" => assert_eq!(index, open, "delta to a block not open"),
            "content_block_stop" => {
                assert_eq!(index, open, "stop of a block not open");
                stopped.push(index.unwrap());
                open = None;
            }
            "message_delta" | "message_stop" => assert_eq!(open, None),
            "message_start" | "ping" => {}
            other => panic!("unexpected event {other}"),
        }
    }
    assert_eq!(stopped, (0..next).collect::<Vec<_>>());
}

fn assemble(events: &[(String, Value)]) -> Value {
    let mut a = AnthropicAssembler::new();
    for (_, data) in events {
        a.push(data);
    }
    assert!(a.is_complete());
    a.finish().unwrap()
}

fn answer(text: &str, tool_calls: Vec<ToolCall>, finish: Finish) -> Answer {
    Answer {
        id: "chatcmpl-1".into(),
        model: "upstream-model".into(),
        created: 0,
        text: text.into(),
        reasoning: None,
        tool_calls,
        finish,
        usage: Some(TokenUsage {
            input_tokens: 120,
            output_tokens: 7,
            cached_tokens: 100,
            reasoning_tokens: 0,
        }),
        logprobs: None,
    }
}

fn conv() -> Conversation {
    Conversation {
        model: "claude-sonnet-4-5".into(),
        ..Conversation::default()
    }
}

#[test]
fn litellm_capture_parses() {
    // The body of shared/captures/litellm.anthropic-messages.json.
    let body = json!({
        "model": "claude-sonnet-4-5",
        "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
        "tools": [{
            "name": "get_weather",
            "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}},
            "type": "custom"
        }],
        "system": [{"type": "text", "text": "sys"}],
        "max_tokens": 64000
    });
    let c = parse_request(&body).unwrap();
    assert_eq!(c.model, "claude-sonnet-4-5");
    assert_eq!(
        c.messages,
        vec![
            Message::text(Role::System, "sys"),
            Message::text(Role::User, "hi")
        ]
    );
    assert_eq!(
        c.tools,
        vec![Tool {
            name: "get_weather".into(),
            description: None,
            parameters: json!({"type": "object", "properties": {"city": {"type": "string"}}}),
            strict: None,
        }]
    );
    assert_eq!(c.sampling.max_tokens, Some(64000));
    assert!(!c.stream);
    assert!(c.tool_choice.is_none());
    assert!(c.notes.is_empty(), "{:?}", c.notes);
    assert!(c.extra.is_empty());
}

#[test]
fn multi_turn_tool_use_maps_to_tool_calls_and_tool_messages_in_order() {
    let body = json!({
        "model": "m",
        "max_tokens": 100,
        "system": "be brief",
        "messages": [
            {"role": "user", "content": "weather in Paris and Rome?"},
            {"role": "assistant", "content": [
                {"type": "thinking", "thinking": "two cities", "signature": "sig"},
                {"type": "text", "text": "Checking."},
                {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris", "units": "c"}},
                {"type": "tool_use", "id": "toolu_2", "name": "get_weather", "input": {"city": "Rome"}}
            ]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1", "content": "18C"},
                {"type": "tool_result", "tool_use_id": "toolu_2", "is_error": true,
                 "content": [{"type": "text", "text": "timeout"}]},
                {"type": "text", "text": "and tomorrow?", "cache_control": {"type": "ephemeral"}}
            ]}
        ],
        "tool_choice": {"type": "any", "disable_parallel_tool_use": true},
        "temperature": 0.5, "top_p": 0.9, "top_k": 40,
        "stop_sequences": ["END"],
        "thinking": {"type": "enabled", "budget_tokens": 2048},
        "metadata": {"user_id": "u1"},
        "stream": true
    });
    let c = parse_request(&body).unwrap();
    let roles: Vec<Role> = c.messages.iter().map(|m| m.role).collect();
    assert_eq!(
        roles,
        vec![
            Role::System,
            Role::User,
            Role::Assistant,
            Role::Tool,
            Role::Tool,
            Role::User
        ]
    );
    let a = &c.messages[2];
    assert_eq!(a.reasoning.as_deref(), Some("two cities"));
    assert_eq!(a.joined_text(), "Checking.");
    assert_eq!(
        a.tool_calls,
        vec![
            ToolCall {
                id: "toolu_1".into(),
                name: "get_weather".into(),
                arguments: r#"{"city":"Paris","units":"c"}"#.into(),
            },
            ToolCall {
                id: "toolu_2".into(),
                name: "get_weather".into(),
                arguments: r#"{"city":"Rome"}"#.into(),
            },
        ]
    );
    assert_eq!(c.messages[3].tool_call_id.as_deref(), Some("toolu_1"));
    assert_eq!(c.messages[3].joined_text(), "18C");
    assert_eq!(c.messages[4].tool_call_id.as_deref(), Some("toolu_2"));
    assert_eq!(c.messages[4].joined_text(), "timeout");
    assert_eq!(c.messages[5].joined_text(), "and tomorrow?");
    assert_eq!(c.tool_choice, Some(ToolChoice::Required));
    assert_eq!(c.parallel_tool_calls, Some(false));
    assert_eq!(c.sampling.temperature, Some(0.5));
    assert_eq!(c.sampling.top_p, Some(0.9));
    assert_eq!(c.sampling.top_k, Some(40));
    assert_eq!(c.sampling.stop, vec!["END".to_string()]);
    assert_eq!(
        c.reasoning.as_ref().and_then(|r| r.budget_tokens),
        Some(2048)
    );
    assert_eq!(c.extra.get("metadata"), Some(&json!({"user_id": "u1"})));
    assert!(c.stream);
    assert!(
        c.notes.iter().any(|n| n.contains("is_error")),
        "{:?}",
        c.notes
    );
}

#[test]
fn images_server_tools_and_odd_blocks() {
    let body = json!({
        "model": "m", "max_tokens": 10,
        "messages": [
            {"role": "user", "content": [
                {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}},
                {"type": "image", "source": {"type": "url", "url": "https://x/y.png"}},
                {"type": "search_result", "source": "s", "title": "t", "content": []}
            ]},
            {"role": "assistant", "content": [
                {"type": "redacted_thinking", "data": "opaque"},
                {"type": "text", "text": "ok"}
            ]}
        ],
        "tools": [
            {"type": "web_search_20250305", "name": "web_search", "max_uses": 3},
            {"type": "bash_20250124", "name": "bash"},
            {"name": "read", "description": "read a file", "input_schema": {"type": "object"}, "strict": true}
        ],
        "tool_choice": {"type": "tool", "name": "web_search"},
        "service_tier": "auto"
    });
    let c = parse_request(&body).unwrap();
    assert_eq!(
        c.messages[0].content,
        vec![
            Part::Image {
                url: "data:image/png;base64,AAAA".into()
            },
            Part::Image {
                url: "https://x/y.png".into()
            },
        ]
    );
    assert_eq!(c.tools.len(), 1);
    assert_eq!(c.tools[0].name, "read");
    assert_eq!(c.tools[0].strict, Some(true));
    let notes = c.notes.join("\n");
    assert!(
        notes.contains("web_search (web_search_20250305)"),
        "{notes}"
    );
    assert!(notes.contains("bash (bash_20250124)"), "{notes}");
    assert!(notes.contains("redacted_thinking"), "{notes}");
    assert!(notes.contains("search_result"), "{notes}");
    assert!(notes.contains("service_tier"), "{notes}");
    assert_eq!(c.tool_choice, Some(ToolChoice::Auto));
    assert_eq!(c.extra.get("service_tier"), Some(&json!("auto")));
}

#[test]
fn bad_inputs_name_their_path() {
    let ok_msgs = json!([{"role": "user", "content": "hi"}]);
    let with = |key: &str, value: Value| {
        let mut b = json!({"model": "m", "max_tokens": 5, "messages": ok_msgs});
        b[key] = value;
        b
    };
    let msgs = |m: Value| json!({"model": "m", "max_tokens": 5, "messages": m});
    let cases: Vec<(Value, &str)> = vec![
        (json!([1]), "body"),
        (json!({"model": "m", "messages": ok_msgs}), "max_tokens"),
        (with("max_tokens", json!("10")), "max_tokens"),
        (with("max_tokens", json!(0)), "max_tokens"),
        (json!({"max_tokens": 5, "messages": ok_msgs}), "model"),
        (with("model", json!(3)), "model"),
        (json!({"model": "m", "max_tokens": 5}), "messages"),
        (with("messages", json!({})), "messages"),
        (
            msgs(json!([{"role": "developer", "content": "x"}])),
            "messages[0].role",
        ),
        (
            msgs(
                json!([{"role": "user", "content": "a"}, {"role": "system", "content": [{"type": "image"}]}]),
            ),
            "messages[1].content[0].type",
        ),
        (
            msgs(json!([{"role": "user", "content": "a"}, {"role": "assistant", "content": 5}])),
            "messages[1].content",
        ),
        (
            msgs(json!([
                {"role": "user", "content": "a"},
                {"role": "assistant", "content": "b"},
                {"role": "user", "content": [{"type": 7}]}
            ])),
            "messages[2].content[0].type",
        ),
        (
            msgs(json!([{"role": "user", "content": [{"type": "text"}]}])),
            "messages[0].content[0].text",
        ),
        (
            msgs(json!([{"role": "user", "content": ["hi"]}])),
            "messages[0].content[0]",
        ),
        (
            msgs(
                json!([{"role": "user", "content": [{"type": "tool_use", "id": "a", "name": "b", "input": {}}]}]),
            ),
            "messages[0].content[0].type",
        ),
        (
            msgs(json!([{"role": "user", "content": [{"type": "tool_result", "content": "x"}]}])),
            "messages[0].content[0].tool_use_id",
        ),
        (
            msgs(
                json!([{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": [{"type": "text", "text": 1}]}]}]),
            ),
            "messages[0].content[0].content[0].text",
        ),
        (
            msgs(
                json!([{"role": "user", "content": [{"type": "image", "source": {"type": "file", "file_id": "f"}}]}]),
            ),
            "messages[0].content[0].source.type",
        ),
        (
            msgs(
                json!([{"role": "user", "content": "a"}, {"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "n", "input": "{}"}]}]),
            ),
            "messages[1].content[0].input",
        ),
        (
            msgs(
                json!([{"role": "user", "content": "a"}, {"role": "assistant", "content": [{"type": "tool_use", "name": "n", "input": {}}]}]),
            ),
            "messages[1].content[0].id",
        ),
        (with("system", json!(5)), "system"),
        (with("system", json!([{"type": "image"}])), "system[0].type"),
        (
            with("tools", json!([{"name": "t"}])),
            "tools[0].input_schema",
        ),
        (
            with("tools", json!([{"input_schema": {}}])),
            "tools[0].name",
        ),
        (
            with(
                "tools",
                json!([{"name": "t", "input_schema": {}, "type": 1}]),
            ),
            "tools[0].type",
        ),
        (
            with("tool_choice", json!({"type": "bogus"})),
            "tool_choice.type",
        ),
        (
            with("tool_choice", json!({"type": "tool"})),
            "tool_choice.name",
        ),
        (
            with(
                "tool_choice",
                json!({"type": "auto", "disable_parallel_tool_use": "yes"}),
            ),
            "tool_choice.disable_parallel_tool_use",
        ),
        (with("temperature", json!("hot")), "temperature"),
        (with("top_k", json!(-1)), "top_k"),
        (with("stop_sequences", json!([1])), "stop_sequences[0]"),
        (
            with("thinking", json!({"type": "enabled"})),
            "thinking.budget_tokens",
        ),
        (
            with("thinking", json!({"type": "sometimes"})),
            "thinking.type",
        ),
        (with("stream", json!("yes")), "stream"),
    ];
    for (body, path) in cases {
        let (param, message) = parse_err(body.clone());
        assert_eq!(param, path, "body {body}");
        assert!(
            message.contains(path),
            "message {message:?} should name {path}"
        );
    }
}

#[test]
fn unknown_keys_and_nulls_are_tolerated() {
    let body = json!({
        "model": "m", "max_tokens": 5, "temperature": null, "tools": null,
        "messages": [{"role": "user", "content": [{"type": "text", "text": "hi", "citations": null, "future": 1}], "extra": true}],
        "some_future_field": {"a": 1}
    });
    let c = parse_request(&body).unwrap();
    assert_eq!(c.messages, vec![Message::text(Role::User, "hi")]);
    assert_eq!(c.extra.get("some_future_field"), Some(&json!({"a": 1})));
}

#[test]
fn render_text_answer() {
    let v = render_answer(&conv(), &answer("Hello!", vec![], Finish::Stop), "msg_1");
    assert_eq!(
        v,
        json!({
            "id": "msg_1", "type": "message", "role": "assistant", "model": "claude-sonnet-4-5",
            "content": [{"type": "text", "text": "Hello!"}],
            "stop_reason": "end_turn", "stop_sequence": null,
            "usage": {"input_tokens": 20, "output_tokens": 7, "cache_read_input_tokens": 100}
        })
    );
}

#[test]
fn render_tool_use_answer() {
    let calls = vec![
        ToolCall {
            id: "call_abc".into(),
            name: "get_weather".into(),
            arguments: r#"{"city": "Paris"}"#.into(),
        },
        ToolCall {
            id: "".into(),
            name: "noop".into(),
            arguments: "".into(),
        },
        ToolCall {
            id: "fc:1/x".into(),
            name: "broken".into(),
            arguments: r#"{"a": "#.into(),
        },
    ];
    let mut a = answer("", calls, Finish::ToolCalls);
    a.reasoning = Some("think".into());
    let v = render_answer(&conv(), &a, "msg_42");
    assert_eq!(v["stop_reason"], "tool_use");
    assert_eq!(
        v["content"],
        json!([
            {"type": "thinking", "thinking": "think", "signature": ""},
            {"type": "tool_use", "id": "call_abc", "name": "get_weather", "input": {"city": "Paris"}},
            {"type": "tool_use", "id": "toolu_42_1", "name": "noop", "input": {}},
            {"type": "tool_use", "id": "toolu_fc_1_x", "name": "broken", "input": {}}
        ])
    );
    // A Chat upstream that says "stop" while calling tools still yields tool_use.
    let a = answer(
        "",
        vec![ToolCall {
            id: "c".into(),
            name: "n".into(),
            arguments: "{}".into(),
        }],
        Finish::Stop,
    );
    assert_eq!(
        render_answer(&conv(), &a, "msg_1")["stop_reason"],
        "tool_use"
    );
}

#[test]
fn render_max_tokens_and_other_finishes() {
    let v = render_answer(&conv(), &answer("trunc", vec![], Finish::Length), "msg_1");
    assert_eq!(v["stop_reason"], "max_tokens");
    let v = render_answer(&conv(), &answer("", vec![], Finish::ContentFilter), "msg_1");
    assert_eq!(v["stop_reason"], "refusal");
    assert_eq!(v["content"], json!([]));
    let mut a = answer("x", vec![], Finish::Stop);
    a.usage = None;
    let v = render_answer(&conv(), &a, "msg_1");
    assert_eq!(v["usage"], json!({"input_tokens": 0, "output_tokens": 0}));
}

#[test]
fn error_bodies() {
    let cases = [
        (
            GatewayError::field("messages", "messages is required"),
            400,
            "invalid_request_error",
        ),
        (
            GatewayError::Unauthorized("bad key".into()),
            401,
            "authentication_error",
        ),
        (
            GatewayError::Forbidden("no".into()),
            403,
            "permission_error",
        ),
        (
            GatewayError::UnknownSession("s".into()),
            404,
            "not_found_error",
        ),
        (
            GatewayError::BodyTooLarge { limit: 10 },
            413,
            "request_too_large",
        ),
        (
            GatewayError::SessionClosed("s".into()),
            409,
            "invalid_request_error",
        ),
        (
            GatewayError::RateLimited {
                scope: "session 'a'".into(),
                retry_after_secs: 2,
            },
            429,
            "rate_limit_error",
        ),
        (GatewayError::Internal("x".into()), 500, "api_error"),
        (
            GatewayError::UpstreamStatus {
                upstream: "u".into(),
                status: 500,
                detail: "d".into(),
            },
            502,
            "api_error",
        ),
        (GatewayError::Record("disk".into()), 503, "overloaded_error"),
        (
            GatewayError::UpstreamTimeout {
                upstream: "u".into(),
                secs: 5,
            },
            504,
            "api_error",
        ),
    ];
    for (err, status, ty) in cases {
        assert_eq!(err.status().as_u16(), status);
        assert_eq!(
            error_body(&err),
            json!({"type": "error", "error": {"type": ty, "message": err.to_string()}})
        );
    }
    let e = GatewayError::UpstreamStream {
        upstream: "u".into(),
        detail: "reset".into(),
    };
    let bytes = error_event(&e);
    let text = std::str::from_utf8(&bytes).unwrap();
    assert!(text.starts_with("event: error\ndata: {"), "{text}");
    assert!(text.ends_with("\n\n"));
    let events = sse_events(std::slice::from_ref(&bytes));
    assert_eq!(events[0].1, error_body(&e));
    let mut a = AnthropicAssembler::new();
    a.push(&events[0].1);
    assert_eq!(a.error().unwrap()["type"], "api_error");
    assert!(a.finish().is_none());
}

#[test]
fn stream_of_a_text_answer_has_anthropic_event_order() {
    let c = conv();
    let mut s = stream(&c, "msg_1");
    let mut out = s.start();
    out.extend(s.push(&Delta::Text("Hel".into())));
    out.extend(s.push(&Delta::Text("lo".into())));
    out.extend(s.finish(&answer("Hello", vec![], Finish::Stop)));
    let events = sse_events(&out);
    let names: Vec<&str> = events.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(
        names,
        [
            "message_start",
            "ping",
            "content_block_start",
            "content_block_delta",
            "content_block_delta",
            "content_block_stop",
            "message_delta",
            "message_stop"
        ]
    );
    assert_eq!(
        events[0].1["message"],
        json!({
            "id": "msg_1", "type": "message", "role": "assistant", "content": [],
            "model": "claude-sonnet-4-5", "stop_reason": null, "stop_sequence": null,
            "usage": {"input_tokens": 0, "output_tokens": 0}
        })
    );
    assert_eq!(
        events[2].1,
        json!({"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}})
    );
    assert_eq!(
        events[3].1,
        json!({"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": "Hel"}})
    );
    assert_eq!(
        events[6].1,
        json!({
            "type": "message_delta",
            "delta": {"stop_reason": "end_turn", "stop_sequence": null},
            "usage": {"input_tokens": 20, "output_tokens": 7, "cache_read_input_tokens": 100}
        })
    );
    check_block_discipline(&events);
    assert_eq!(
        assemble(&events),
        render_answer(&c, &answer("Hello", vec![], Finish::Stop), "msg_1")
    );
}

#[test]
fn stream_handles_interleaved_tool_args_and_an_answer_without_deltas() {
    let c = conv();
    let calls = vec![
        ToolCall {
            id: "call_a".into(),
            name: "f".into(),
            arguments: r#"{"x":1}"#.into(),
        },
        ToolCall {
            id: "call_b".into(),
            name: "g".into(),
            arguments: r#"{"y":2}"#.into(),
        },
    ];
    let a = answer("", calls, Finish::ToolCalls);
    let mut s = stream(&c, "msg_1");
    let mut out = s.start();
    for d in [
        Delta::ToolCallStart {
            index: 0,
            id: "call_a".into(),
            name: "f".into(),
        },
        Delta::ToolCallStart {
            index: 1,
            id: "call_b".into(),
            name: "g".into(),
        },
        Delta::ToolCallArgs {
            index: 0,
            arguments: r#"{"x""#.into(),
        },
        Delta::ToolCallArgs {
            index: 1,
            arguments: r#"{"y":2}"#.into(),
        },
        Delta::ToolCallArgs {
            index: 0,
            arguments: ":1}".into(),
        },
    ] {
        out.extend(s.push(&d));
    }
    out.extend(s.finish(&a));
    let events = sse_events(&out);
    check_block_discipline(&events);
    assert_eq!(assemble(&events), render_answer(&c, &a, "msg_1"));
    assert_eq!(
        events[2].1["content_block"],
        json!({"type": "tool_use", "id": "call_a", "name": "f", "input": {}})
    );

    // No deltas at all (e.g. a non-streamed upstream answer): finish sends everything.
    let mut a = answer("done", vec![], Finish::Stop);
    a.reasoning = Some("hmm".into());
    let mut s = stream(&c, "msg_2");
    let mut out = s.start();
    out.extend(s.finish(&a));
    out.extend(s.finish(&a)); // a second finish emits nothing
    let events = sse_events(&out);
    check_block_discipline(&events);
    assert_eq!(assemble(&events), render_answer(&c, &a, "msg_2"));
}

#[test]
fn tool_use_ids() {
    assert_eq!(tool_use_id("toolu_01A-b", "msg_x", 0), "toolu_01A-b");
    assert_eq!(
        tool_use_id("chatcmpl-tool-9f", "msg_x", 0),
        "chatcmpl-tool-9f"
    );
    assert_eq!(tool_use_id("call 1.2", "msg_x", 0), "toolu_call_1_2");
    assert_eq!(tool_use_id("", "msg_0193ab", 3), "toolu_0193ab_3");
}

#[test]
fn assembler_keeps_signature_citations_and_unparseable_input() {
    let mut a = AnthropicAssembler::new();
    for e in [
        json!({"type": "message_start", "message": {"id": "msg_1", "type": "message", "role": "assistant", "content": [], "model": "claude", "stop_reason": null, "stop_sequence": null, "usage": {"input_tokens": 9, "output_tokens": 1}}}),
        json!({"type": "content_block_start", "index": 0, "content_block": {"type": "thinking", "thinking": "", "signature": ""}}),
        json!({"type": "content_block_delta", "index": 0, "delta": {"type": "thinking_delta", "thinking": "a"}}),
        json!({"type": "content_block_delta", "index": 0, "delta": {"type": "signature_delta", "signature": "SIG"}}),
        json!({"type": "content_block_stop", "index": 0}),
        json!({"type": "content_block_start", "index": 1, "content_block": {"type": "text", "text": ""}}),
        json!({"type": "content_block_delta", "index": 1, "delta": {"type": "citations_delta", "citation": {"cited_text": "c"}}}),
        json!({"type": "content_block_stop", "index": 1}),
        json!({"type": "content_block_start", "index": 2, "content_block": {"type": "tool_use", "id": "t", "name": "n", "input": {}}}),
        json!({"type": "content_block_delta", "index": 2, "delta": {"type": "input_json_delta", "partial_json": "{\"a\": "}}),
        json!({"type": "content_block_stop", "index": 2}),
        json!({"type": "message_delta", "delta": {"stop_reason": "tool_use", "stop_sequence": null}, "usage": {"output_tokens": 30}}),
    ] {
        a.push(&e);
    }
    assert!(!a.is_complete());
    let m = a.finish().unwrap();
    assert_eq!(m["content"][0]["signature"], "SIG");
    assert_eq!(m["content"][1]["citations"], json!([{"cited_text": "c"}]));
    assert_eq!(m["content"][2]["input"], json!("{\"a\": "));
    assert_eq!(m["usage"], json!({"input_tokens": 9, "output_tokens": 30}));
    assert_eq!(m["stop_reason"], "tool_use");
}

// ---- property: deltas chopped anywhere → stream → assembler == render_answer ----

fn leaf() -> impl Strategy<Value = Value> {
    prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::Bool),
        any::<i64>().prop_map(|n| json!(n)),
        "[a-z \"\\\\é😀\n]{0,12}".prop_map(Value::String),
    ]
}

fn json_args() -> impl Strategy<Value = String> {
    let value = leaf().prop_recursive(2, 12, 4, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..4).prop_map(Value::Array),
            prop::collection::btree_map("[a-z_]{1,6}", inner, 0..4)
                .prop_map(|m| Value::Object(m.into_iter().collect())),
        ]
    });
    prop::collection::btree_map("[a-z_]{1,6}", value, 0..4)
        .prop_map(|m| Value::Object(m.into_iter().collect()).to_string())
}

fn arb_answer() -> impl Strategy<Value = Answer> {
    let call = (
        prop_oneof![
            "call_[a-zA-Z0-9]{4,10}".boxed(),
            Just(String::new()).boxed(),
            "fc:[a-z]{1,4}".boxed()
        ],
        "[a-z_]{1,10}",
        json_args(),
    )
        .prop_map(|(id, name, arguments)| ToolCall {
            id,
            name,
            arguments,
        });
    (
        "[a-zA-Z0-9 .,\"\\\\é😀\n]{0,40}",
        prop::option::of("[a-z .é😀\n]{0,30}"),
        prop::collection::vec(call, 0..=3),
        prop_oneof![
            Just(Finish::Stop),
            Just(Finish::Length),
            Just(Finish::ToolCalls),
            Just(Finish::ContentFilter),
            Just(Finish::Error)
        ],
        prop::option::of((0u64..100_000, 0u64..10_000, 0u64..100_000)),
    )
        .prop_map(|(text, reasoning, tool_calls, finish, usage)| Answer {
            id: "chatcmpl-x".into(),
            model: "upstream".into(),
            created: 1,
            text,
            reasoning,
            tool_calls,
            finish,
            usage: usage.map(|(input, output, cached)| TokenUsage {
                input_tokens: input,
                output_tokens: output,
                cached_tokens: cached.min(input),
                reasoning_tokens: 0,
            }),
            logprobs: None,
        })
}

/// Splits `s` into pieces of `sizes[k % len]` chars (an empty piece list for "").
fn chop(s: &str, sizes: &[usize]) -> Vec<String> {
    let chars: Vec<char> = s.chars().collect();
    let mut out = Vec::new();
    let mut at = 0;
    let mut k = 0;
    while at < chars.len() {
        let n = sizes
            .get(k % sizes.len().max(1))
            .copied()
            .unwrap_or(chars.len())
            .max(1);
        let end = (at + n).min(chars.len());
        out.push(chars[at..end].iter().collect());
        at = end;
        k += 1;
    }
    out
}

fn deltas(a: &Answer, sizes: &[usize], interleave: bool) -> Vec<Delta> {
    let mut out = Vec::new();
    if let Some(r) = &a.reasoning {
        out.extend(chop(r, sizes).into_iter().map(Delta::Reasoning));
    }
    out.extend(chop(&a.text, sizes).into_iter().map(Delta::Text));
    let args: Vec<Vec<String>> = a
        .tool_calls
        .iter()
        .map(|c| chop(&c.arguments, sizes))
        .collect();
    if interleave {
        for (index, c) in a.tool_calls.iter().enumerate() {
            out.push(Delta::ToolCallStart {
                index,
                id: c.id.clone(),
                name: c.name.clone(),
            });
        }
        let longest = args.iter().map(Vec::len).max().unwrap_or(0);
        for k in 0..longest {
            for (index, pieces) in args.iter().enumerate() {
                if let Some(p) = pieces.get(k) {
                    out.push(Delta::ToolCallArgs {
                        index,
                        arguments: p.clone(),
                    });
                }
            }
        }
    } else {
        for (index, c) in a.tool_calls.iter().enumerate() {
            out.push(Delta::ToolCallStart {
                index,
                id: c.id.clone(),
                name: c.name.clone(),
            });
            for p in &args[index] {
                out.push(Delta::ToolCallArgs {
                    index,
                    arguments: p.clone(),
                });
            }
        }
    }
    out
}

proptest! {
    #[test]
    fn chopped_stream_reassembles_to_render_answer(
        a in arb_answer(),
        sizes in prop::collection::vec(1usize..8, 1..6),
        interleave in any::<bool>(),
        byte_cut in 1usize..64,
    ) {
        let c = conv();
        let mut s = stream(&c, "msg_prop");
        let mut out = s.start();
        for d in deltas(&a, &sizes, interleave) {
            out.extend(s.push(&d));
        }
        out.extend(s.finish(&a));
        // Re-chunk the bytes at arbitrary boundaries before parsing.
        let all: Vec<u8> = out.iter().flat_map(|b| b.iter().copied()).collect();
        let rechunked: Vec<Bytes> = all.chunks(byte_cut).map(Bytes::copy_from_slice).collect();
        let events = sse_events(&rechunked);
        check_block_discipline(&events);
        let got = assemble(&events);
        let want = render_answer(&c, &a, "msg_prop");
        prop_assert_eq!(&got["content"], &want["content"]);
        prop_assert_eq!(&got["stop_reason"], &want["stop_reason"]);
        prop_assert_eq!(&got["usage"], &want["usage"]);
        prop_assert_eq!(got, want);
    }
}

/// Claude Code 2.1 puts `system` messages between the turns (the agent list after the first
/// user message); they keep their place in the conversation.
#[test]
fn a_system_message_inside_messages_keeps_its_place() {
    let conv = parse_request(&json!({
        "model": "m", "max_tokens": 5, "system": "top",
        "messages": [
            {"role": "user", "content": "hi"},
            {"role": "system", "content": [{"type": "text", "text": "agent types: a, b"}]},
            {"role": "user", "content": "go"}
        ]
    }))
    .unwrap();
    let roles: Vec<Role> = conv.messages.iter().map(|m| m.role).collect();
    assert_eq!(roles, [Role::System, Role::User, Role::System, Role::User]);
    assert_eq!(
        conv.messages[2].content,
        vec![Part::Text {
            text: "agent types: a, b".into()
        }]
    );
}

use serde_json::json;

use super::*;
use crate::dialect::{Conversation, Delta, Finish, Message, Role, ToolCall};

#[test]
fn developer_and_system_lead_join_and_are_noted() {
    let conv = Conversation {
        model: "m".into(),
        messages: vec![
            Message::text(Role::System, "sys"),
            Message::text(Role::Developer, "dev"),
            Message::text(Role::User, "hi"),
        ],
        ..Default::default()
    };
    let (req, notes) = to_request(&conv);
    assert_eq!(
        req["messages"][0],
        json!({"role": "system", "content": "sys\n\ndev"})
    );
    assert_eq!(req["messages"][1], json!({"role": "user", "content": "hi"}));
    assert_eq!(notes.len(), 2, "{notes:?}");
}

#[test]
fn chat_round_trip_keeps_tool_calls_and_results() {
    let body = json!({"model": "m", "messages": [
            {"role": "system", "content": "s"},
            {"role": "user", "content": [{"type": "text", "text": "look"}]},
            {"role": "assistant", "content": null, "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "bash", "arguments": "{\"command\":\"ls\"}"}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "a.txt"}],
            "tools": [{"type": "function", "function": {"name": "bash", "parameters": {"type": "object"}}}],
            "temperature": 0.5, "max_tokens": 10, "stream": true});
    let conv = parse_request(&body).unwrap();
    let (req, _) = to_request(&conv);
    assert_eq!(
        req["messages"][2]["tool_calls"],
        body["messages"][2]["tool_calls"]
    );
    assert_eq!(
        req["messages"][3],
        json!({"role": "tool", "tool_call_id": "c1", "content": "a.txt"})
    );
    assert_eq!(req["tools"], body["tools"]);
    assert_eq!(req["temperature"], 0.5);
    assert_eq!(req["max_tokens"], 10);
    assert_eq!(req["stream_options"]["include_usage"], true);
}

#[test]
fn chunk_reader_yields_deltas_and_the_whole_answer() {
    let chunks = [
        json!({"id":"x","model":"m","created":1,"choices":[{"index":0,"delta":{"role":"assistant","content":"Hi"}}]}),
        json!({"id":"x","choices":[{"index":0,"delta":{"tool_calls":[{"index":0,"id":"c9","type":"function","function":{"name":"f","arguments":"{\"a\""}}]}}]}),
        json!({"id":"x","choices":[{"index":0,"delta":{"tool_calls":[{"index":0,"function":{"arguments":":1}"}}]}}]}),
        json!({"id":"x","choices":[{"index":0,"delta":{},"finish_reason":"tool_calls"}]}),
        json!({"id":"x","choices":[],"usage":{"prompt_tokens":5,"completion_tokens":3,"total_tokens":8}}),
    ];
    let mut r = ChunkReader::new();
    let deltas: Vec<Delta> = chunks.iter().flat_map(|c| r.push(c)).collect();
    assert_eq!(
        deltas,
        vec![
            Delta::Text("Hi".into()),
            Delta::ToolCallStart {
                index: 0,
                id: "c9".into(),
                name: "f".into()
            },
            Delta::ToolCallArgs {
                index: 0,
                arguments: "{\"a\"".into()
            },
            Delta::ToolCallArgs {
                index: 0,
                arguments: ":1}".into()
            },
        ]
    );
    let a = r.answer();
    assert_eq!(a.text, "Hi");
    assert_eq!(a.finish, Finish::ToolCalls);
    assert_eq!(
        a.tool_calls,
        vec![ToolCall {
            id: "c9".into(),
            name: "f".into(),
            arguments: "{\"a\":1}".into()
        }]
    );
    assert_eq!(a.usage.unwrap().input_tokens, 5);
}

#[test]
fn bad_chat_input_names_the_path() {
    let e = parse_request(&json!({"model": "m", "messages": [{"role": "wizard", "content": "x"}]}))
        .unwrap_err();
    assert!(e.to_string().contains("messages[0].role"), "{e}");
    let e = parse_request(
        &json!({"model": "m", "messages": [{"role": "user", "content": [{"type": "audio"}]}]}),
    )
    .unwrap_err();
    assert!(e.to_string().contains("messages[0].content[0].type"), "{e}");
    // Token limits and top_k are non-negative integers (null: not given). A negative limit
    // once parsed as "no limit" and the call decoded to the end of the context.
    for (key, v) in [
        ("max_tokens", json!(-5)),
        ("max_completion_tokens", json!("64")),
        ("max_tokens", json!(1.5)),
        ("top_k", json!(-1)),
    ] {
        let mut body = json!({"model": "m", "messages": [{"role": "user", "content": "x"}]});
        body[key] = v.clone();
        let e = parse_request(&body).unwrap_err();
        assert!(
            e.to_string()
                .contains(&format!("'{key}' must be a non-negative integer, got {v}")),
            "{key}: {e}"
        );
    }
    let ok = parse_request(
        &json!({"model": "m", "messages": [{"role": "user", "content": "x"}],
        "max_tokens": null, "max_completion_tokens": 7}),
    )
    .unwrap();
    assert_eq!(ok.sampling.max_tokens, Some(7));
}

#[test]
fn assembles_content_and_tool_call_arguments() {
    let chunks = [
        json!({"id":"c1","model":"m","created":1,"object":"chat.completion.chunk","choices":[{"index":0,"delta":{"role":"assistant","content":""}}]}),
        json!({"id":"c1","choices":[{"index":0,"delta":{"content":"Hel"}}]}),
        json!({"id":"c1","choices":[{"index":0,"delta":{"content":"lo"}}]}),
        json!({"id":"c1","choices":[{"index":0,"delta":{"tool_calls":[{"index":0,"id":"call_1","type":"function","function":{"name":"bash","arguments":""}}]}}]}),
        json!({"id":"c1","choices":[{"index":0,"delta":{"tool_calls":[{"index":0,"function":{"arguments":"{\"command\":"}}]}}]}),
        json!({"id":"c1","choices":[{"index":0,"delta":{"tool_calls":[{"index":0,"function":{"arguments":"\"ls\"}"}}]}}]}),
        json!({"id":"c1","choices":[{"index":0,"delta":{},"finish_reason":"tool_calls"}]}),
        json!({"id":"c1","choices":[],"usage":{"prompt_tokens":3,"completion_tokens":4,"total_tokens":7}}),
    ];
    let mut a = Assembler::chat();
    for c in &chunks {
        a.push(c);
    }
    let v = a.finish();
    assert_eq!(v["object"], "chat.completion");
    assert_eq!(v["model"], "m");
    assert_eq!(v["choices"][0]["message"]["content"], "Hello");
    assert_eq!(
        v["choices"][0]["message"]["tool_calls"][0]["function"]["arguments"],
        "{\"command\":\"ls\"}"
    );
    assert_eq!(v["choices"][0]["message"]["tool_calls"][0]["id"], "call_1");
    assert_eq!(v["choices"][0]["finish_reason"], "tool_calls");
    assert_eq!(v["usage"]["total_tokens"], 7);
    assert_eq!(a.finish_reason().as_deref(), Some("tool_calls"));
}

#[test]
fn assembles_text_completions() {
    let mut a = Assembler::completions();
    a.push(&json!({"id":"x","object":"text_completion","choices":[{"index":0,"text":"foo "}]}));
    a.push(&json!({"id":"x","object":"text_completion","choices":[{"index":0,"text":"bar","finish_reason":"length"}]}));
    let v = a.finish();
    assert_eq!(v["choices"][0]["text"], "foo bar");
    assert_eq!(v["choices"][0]["finish_reason"], "length");
}

#[test]
fn response_format_survives_the_round_trip_to_a_chat_upstream() {
    let schema = json!({"type": "object", "properties": {"a": {"type": "integer"}}});
    let body = json!({"model": "m", "messages": [{"role": "user", "content": "x"}],
        "response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": schema, "strict": true}}});
    let conv = parse_request(&body).unwrap();
    assert!(
        !conv.extra.contains_key("response_format"),
        "mapped, not kept as extra"
    );
    let (req, _) = to_request(&conv);
    assert_eq!(req["response_format"], body["response_format"]);
    let plain = parse_request(
        &json!({"model": "m", "messages": [{"role": "user", "content": "x"}],
        "response_format": {"type": "text"}}),
    )
    .unwrap();
    assert!(to_request(&plain).0.get("response_format").is_none());
    let err = parse_request(
        &json!({"model": "m", "messages": [{"role": "user", "content": "x"}],
        "response_format": {"type": "yaml"}}),
    )
    .unwrap_err()
    .to_string();
    assert!(err.contains("response_format.type"), "{err}");
}

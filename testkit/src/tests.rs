//! Unit tests of the OpenAI wire shapes, the script rules and the SSE body (moved from the
//! `graft` package's `src/scripted.rs` unchanged).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::time::Duration;

use bytes::Bytes;
use http_body_util::BodyExt;
use hyper::body::Body;
use serde_json::{Value, json};

use crate::answer::SseBody;
use crate::openai::*;
use crate::script::*;

fn meta() -> Meta {
    Meta {
        id: 7,
        created: 1_700_000_000,
        model: "m".to_owned(),
    }
}

/// Parses `data: ...\n\n` events; `None` stands for `[DONE]`.
fn parse(events: &[Bytes]) -> Vec<Option<Value>> {
    events
        .iter()
        .map(|e| {
            let s = std::str::from_utf8(e).unwrap();
            let data = s
                .strip_prefix("data: ")
                .unwrap()
                .strip_suffix("\n\n")
                .unwrap();
            assert!(!data.contains('\n'), "one line per event: {data:?}");
            (data != "[DONE]").then(|| serde_json::from_str(data).unwrap())
        })
        .collect()
}

/// Assembles a chat stream the way the OpenAI SDK does.
fn assemble(chunks: &[Option<Value>]) -> (String, Vec<(String, String, String)>, String) {
    let mut content = String::new();
    let mut calls: Vec<(String, String, String)> = Vec::new();
    let mut finish = String::new();
    for c in chunks.iter().flatten() {
        for choice in c["choices"].as_array().unwrap() {
            let delta = &choice["delta"];
            if let Some(t) = delta["content"].as_str() {
                content.push_str(t);
            }
            for tc in delta["tool_calls"].as_array().into_iter().flatten() {
                let i = tc["index"].as_u64().unwrap() as usize;
                if i == calls.len() {
                    calls.push((
                        tc["id"].as_str().unwrap().to_owned(),
                        tc["function"]["name"].as_str().unwrap().to_owned(),
                        String::new(),
                    ));
                }
                if let Some(a) = tc["function"]["arguments"].as_str() {
                    calls[i].2.push_str(a);
                }
            }
            if let Some(f) = choice["finish_reason"].as_str() {
                finish = f.to_owned();
            }
        }
    }
    (content, calls, finish)
}

fn reply(content: Option<&str>, calls: &[(&str, Value)]) -> Reply {
    Reply {
        reasoning: None,
        content: content.map(str::to_owned),
        tool_calls: calls
            .iter()
            .map(|(n, a)| ScriptToolCall {
                name: (*n).to_owned(),
                arguments: a.clone(),
            })
            .collect(),
        finish_reason: None,
        raw: None,
    }
}

#[test]
fn content_streams_in_several_deltas_that_reassemble_exactly() {
    let text = "Hello there,  world!\nSecond line ";
    let events = parse(&chat_events(&meta(), &reply(Some(text), &[]), None, None));
    assert_eq!(events.last().unwrap(), &None, "ends with [DONE]");
    let first = events[0].as_ref().unwrap();
    assert_eq!(first["object"], "chat.completion.chunk");
    assert_eq!(first["choices"][0]["delta"]["role"], "assistant");
    let content_deltas = events
        .iter()
        .flatten()
        .filter(|c| {
            c["choices"][0]["delta"]["content"]
                .as_str()
                .is_some_and(|s| !s.is_empty())
        })
        .count();
    assert!(
        content_deltas >= 4,
        "content split into several deltas, got {content_deltas}"
    );
    let (content, calls, finish) = assemble(&events);
    assert_eq!(content, text);
    assert!(calls.is_empty());
    assert_eq!(finish, "stop");
    assert!(
        events.iter().flatten().all(|c| c.get("usage").is_none()),
        "no usage unless asked"
    );
}

#[test]
fn tool_calls_stream_header_then_argument_pieces() {
    let args = json!({"command": "ls -la /workspace && echo done"});
    let r = reply(
        None,
        &[("bash", args.clone()), ("read", json!({"path": "a.txt"}))],
    );
    let events = parse(&chat_events(&meta(), &r, None, None));
    let first = events[0].as_ref().unwrap();
    let delta = &first["choices"][0]["delta"];
    assert_eq!(delta["role"], "assistant");
    assert_eq!(delta["content"], Value::Null);
    assert_eq!(delta["tool_calls"][0]["index"], 0);
    assert_eq!(delta["tool_calls"][0]["type"], "function");
    assert_eq!(delta["tool_calls"][0]["function"]["name"], "bash");
    assert_eq!(delta["tool_calls"][0]["function"]["arguments"], "");
    // Argument-only deltas carry neither id nor name.
    let arg_deltas: Vec<&Value> = events
        .iter()
        .flatten()
        .filter_map(|c| c["choices"][0]["delta"]["tool_calls"].get(0))
        .filter(|tc| tc.get("id").is_none())
        .collect();
    assert!(
        arg_deltas.len() >= 5,
        "arguments in several pieces: {arg_deltas:?}"
    );
    assert!(
        arg_deltas
            .iter()
            .all(|tc| tc["function"].get("name").is_none())
    );
    let (content, calls, finish) = assemble(&events);
    assert_eq!(content, "");
    assert_eq!(calls.len(), 2);
    assert_eq!(calls[0].1, "bash");
    assert_eq!(serde_json::from_str::<Value>(&calls[0].2).unwrap(), args);
    assert_eq!(calls[1].1, "read");
    assert_eq!(calls[1].2, r#"{"path":"a.txt"}"#);
    assert_ne!(calls[0].0, calls[1].0, "distinct tool call ids");
    assert_eq!(finish, "tool_calls");
}

#[test]
fn content_and_tool_call_in_one_reply() {
    let r = reply(Some("Let me look."), &[("bash", json!({"command": "ls"}))]);
    let events = parse(&chat_events(&meta(), &r, None, None));
    let (content, calls, finish) = assemble(&events);
    assert_eq!(content, "Let me look.");
    assert_eq!(calls[0].2, r#"{"command":"ls"}"#);
    assert_eq!(finish, "tool_calls");
    assert_eq!(
        events[0].as_ref().unwrap()["choices"][0]["delta"]["content"],
        ""
    );
}

#[test]
fn usage_chunk_has_empty_choices_and_comes_last_before_done() {
    let usage = json!({"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5});
    let events = parse(&chat_events(
        &meta(),
        &reply(Some("a b"), &[]),
        Some(&usage),
        None,
    ));
    let n = events.len();
    assert_eq!(events[n - 1], None);
    let last = events[n - 2].as_ref().unwrap();
    assert_eq!(last["choices"], json!([]));
    assert_eq!(last["usage"], usage);
    let fin = events[n - 3].as_ref().unwrap();
    assert_eq!(fin["choices"][0]["finish_reason"], "stop");
    assert_eq!(fin["usage"], Value::Null);
}

#[test]
fn completion_stream_reassembles() {
    let usage = json!({"prompt_tokens": 1, "completion_tokens": 3, "total_tokens": 4});
    let events = parse(&completion_events(
        &meta(),
        &reply(Some("one two three"), &[]),
        Some(&usage),
        None,
    ));
    let text: String = events
        .iter()
        .flatten()
        .filter_map(|c| {
            c["choices"]
                .get(0)
                .and_then(|ch| ch["text"].as_str())
                .map(str::to_owned)
        })
        .collect();
    assert_eq!(text, "one two three");
    assert!(
        events
            .iter()
            .flatten()
            .all(|c| c["object"] == "text_completion")
    );
    assert_eq!(
        events[events.len() - 2].as_ref().unwrap()["choices"],
        json!([])
    );
}

#[test]
fn split_helpers_lose_nothing() {
    for s in ["", "a", " lead", "trail ", "x  y\tz\n", "héllo wörld ✓"] {
        assert_eq!(split_words(s).concat(), s);
        assert_eq!(split_n(s, 4).concat(), s);
        assert!(split_n(s, 4).len() <= 4);
    }
    assert_eq!(split_words("a b c"), vec!["a", " b", " c"]);
}

fn chat_prompt(body: Value) -> Prompt {
    Prompt::from_chat(&body).unwrap()
}

#[test]
fn rules_match_last_message_text_count_and_tools() {
    let script = Script::parse(
        r#"{"rules":[
            {"match":"DONE","role":"tool","reply":{"content":"finished"}},
            {"messages":2,"tools":true,"reply":{"tool_calls":[{"name":"bash","arguments":{"command":"ls"}}]}},
            {"match":"hello","reply":{"content":"hi"}}
        ]}"#,
    )
    .unwrap();
    let p = chat_prompt(json!({"model":"m","messages":[
        {"role":"system","content":"sys"},
        {"role":"user","content":[{"type":"text","text":"say"},{"type":"text","text":"hello"}]}
    ]}));
    assert_eq!(p.last_text, "say\nhello");
    assert_eq!(script.reply_for(&p).unwrap().content.as_deref(), Some("hi"));

    let p = chat_prompt(
        json!({"model":"m","tools":[{"type":"function"}],"messages":[
            {"role":"system","content":"sys"},{"role":"user","content":"hello"}
        ]}),
    );
    assert_eq!(script.reply_for(&p).unwrap().tool_calls[0].name, "bash");

    let p = chat_prompt(json!({"model":"m","messages":[
        {"role":"user","content":"do it"},
        {"role":"assistant","content":null,"tool_calls":[]},
        {"role":"tool","tool_call_id":"x","content":"DONE here"}
    ]}));
    assert_eq!(
        script.reply_for(&p).unwrap().content.as_deref(),
        Some("finished")
    );
    assert_eq!(p.last_user_text, "do it");

    let p = chat_prompt(json!({"model":"m","messages":[{"role":"user","content":"nothing"}]}));
    assert!(script.reply_for(&p).is_none());
}

#[test]
fn script_with_an_unknown_key_is_rejected() {
    assert!(Script::parse(r#"{"rules":[{"matches":"x","reply":{}}]}"#).is_err());
}

#[test]
fn usage_counts_words() {
    let p = chat_prompt(json!({"model":"m","messages":[
        {"role":"system","content":"you are helpful"},{"role":"user","content":"two words"}
    ]}));
    let u = usage_for(&p, &reply(Some("a b c"), &[]));
    assert_eq!(
        u,
        json!({"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8})
    );
}

#[tokio::test]
async fn reset_body_errors_after_two_chunks() {
    let events = chat_events(&meta(), &reply(Some("a b c d e"), &[]), None, None);
    let mut body = SseBody::new(events, Duration::ZERO, Some(2));
    let mut got = 0;
    loop {
        match body.frame().await {
            Some(Ok(_)) => got += 1,
            Some(Err(_)) => break,
            None => panic!("stream ended cleanly; a reset must end in an error"),
        }
    }
    assert_eq!(got, 2);
}

#[tokio::test]
async fn body_yields_one_frame_per_event_in_order() {
    let events = chat_events(&meta(), &reply(Some("a b"), &[]), None, None);
    let expected = events.clone();
    let mut body = SseBody::new(events, Duration::from_millis(1), None);
    let mut got = Vec::new();
    while let Some(frame) = body.frame().await {
        got.push(frame.unwrap().into_data().unwrap());
    }
    assert_eq!(got, expected);
    assert!(body.is_end_stream());
}

//! Translation round trips on requests real clients sent (`tests/fixtures/captures/`, recorded
//! from openai Python/Node, litellm, mini-swe-agent, Codex and ZeroClaw): request → internal
//! conversation → the Chat Completions request graft would send upstream loses nothing the
//! upstream needs.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use graft_gateway::dialect::{Conversation, Role, anthropic, chat, responses};
use serde_json::Value;

fn captures() -> Vec<(String, Value)> {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/captures");
    let mut out = vec![];
    for e in std::fs::read_dir(&dir).unwrap() {
        let p = e.unwrap().path();
        if p.extension().is_some_and(|x| x == "json") {
            let v: Value = serde_json::from_str(&std::fs::read_to_string(&p).unwrap()).unwrap();
            out.push((p.file_name().unwrap().to_string_lossy().to_string(), v));
        }
    }
    out.sort_by(|a, b| a.0.cmp(&b.0));
    assert!(out.len() >= 10, "the capture fixtures are there");
    out
}

fn parse(path: &str, body: &Value) -> Conversation {
    match path {
        "/v1/chat/completions" => chat::parse_request(body),
        "/v1/responses" => responses::parse_request(body),
        "/v1/messages" => anthropic::parse_request(body),
        other => panic!("no dialect for {other}"),
    }
    .unwrap_or_else(|e| panic!("{path}: {e}"))
}

/// Every string a model would read: message texts, tool-call arguments, tool results.
fn texts(conv: &Conversation) -> Vec<String> {
    let mut out = vec![];
    for m in &conv.messages {
        let t = m.joined_text();
        if !t.is_empty() {
            out.push(t);
        }
        for tc in &m.tool_calls {
            out.push(tc.arguments.clone());
        }
    }
    out
}

fn all_strings(v: &Value, out: &mut Vec<String>) {
    match v {
        Value::String(s) => out.push(s.clone()),
        Value::Array(a) => a.iter().for_each(|x| all_strings(x, out)),
        Value::Object(o) => o.values().for_each(|x| all_strings(x, out)),
        _ => {}
    }
}

#[test]
fn every_capture_translates_to_chat_without_losing_what_the_upstream_needs() {
    for (name, cap) in captures() {
        let path = cap["path"].as_str().unwrap();
        let body = &cap["body"];
        let conv = parse(path, body);
        assert_eq!(conv.model, body["model"].as_str().unwrap(), "{name}: model");
        assert_eq!(
            conv.stream,
            body["stream"].as_bool().unwrap_or(false),
            "{name}: stream"
        );
        assert!(!conv.messages.is_empty(), "{name}: has messages");

        let (req, notes) = chat::to_request(&conv);
        let back = chat::parse_request(&req).unwrap_or_else(|e| {
            panic!("{name}: the chat request graft builds is itself valid chat: {e}")
        });

        // Every text, tool-call argument and tool result reaches the upstream verbatim.
        let mut sent = vec![];
        all_strings(&req, &mut sent);
        for t in texts(&conv) {
            assert!(
                sent.iter().any(|s| s.contains(&t)),
                "{name}: text lost on the way upstream: {:.80}",
                t
            );
        }
        // Non-system turns survive one for one, in order, with their tool calls and ids.
        let turns = |c: &Conversation| {
            c.messages
                .iter()
                .filter(|m| !matches!(m.role, Role::System | Role::Developer))
                .map(|m| {
                    (
                        m.role,
                        m.joined_text(),
                        m.tool_calls.clone(),
                        m.tool_call_id.clone(),
                    )
                })
                .collect::<Vec<_>>()
        };
        assert_eq!(turns(&conv), turns(&back), "{name}: turns");
        // Every tool call has a result with its id, and the ids survive.
        for m in back.messages.iter().filter(|m| m.role == Role::Tool) {
            let id = m.tool_call_id.clone().unwrap_or_default();
            assert!(
                back.messages
                    .iter()
                    .any(|a| a.tool_calls.iter().any(|t| t.id == id)),
                "{name}: tool result {id} has its call"
            );
        }
        // Function tools arrive with their schemas; anything dropped is noted, never silent.
        assert_eq!(conv.tools, back.tools, "{name}: tools");
        let declared = body["tools"].as_array().map(Vec::len).unwrap_or(0);
        let dropped = conv.notes.iter().filter(|n| n.contains("tool")).count();
        assert!(
            conv.tools.len() + dropped >= declared,
            "{name}: {} tools declared, {} translated, notes {:?}",
            declared,
            conv.tools.len(),
            conv.notes
        );
        // Sampling settings are forwarded.
        assert_eq!(
            conv.sampling.max_tokens, back.sampling.max_tokens,
            "{name}: max tokens"
        );
        assert_eq!(
            conv.sampling.temperature, back.sampling.temperature,
            "{name}: temperature"
        );
        // The system turn the upstream sees holds every system/developer text, in order.
        let system: Vec<String> = conv
            .messages
            .iter()
            .take_while(|m| matches!(m.role, Role::System | Role::Developer))
            .map(|m| m.joined_text())
            .collect();
        if !system.is_empty() {
            assert_eq!(back.messages[0].role, Role::System, "{name}");
            assert_eq!(
                back.messages[0].joined_text(),
                system.join("\n\n"),
                "{name}: system turn"
            );
        }
        let _ = notes;
    }
}

#[test]
fn codex_turn_two_carries_its_function_call_and_output() {
    let cap = captures()
        .into_iter()
        .find(|(n, _)| n.starts_with("codex.turn2"))
        .unwrap()
        .1;
    let conv = responses::parse_request(&cap["body"]).unwrap();
    let call = conv
        .messages
        .iter()
        .flat_map(|m| m.tool_calls.iter())
        .next()
        .expect("turn 2 holds the model's function call");
    let output = conv
        .messages
        .iter()
        .find(|m| m.role == Role::Tool)
        .expect("and its output");
    assert_eq!(output.tool_call_id.as_deref(), Some(call.id.as_str()));
    let (req, _) = chat::to_request(&conv);
    let msgs = req["messages"].as_array().unwrap();
    let a = msgs
        .iter()
        .position(|m| m["tool_calls"].is_array())
        .unwrap();
    assert_eq!(msgs[a + 1]["role"], "tool", "the output follows its call");
    assert_eq!(msgs[a + 1]["tool_call_id"], call.id.as_str());
}

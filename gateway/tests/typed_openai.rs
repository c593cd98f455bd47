//! graft's OpenAI wire, checked against async-openai's typed structs (a real typed client's
//! view of the API): what graft renders for Responses clients deserializes into
//! `Response` / `ResponseStreamEvent`, the Chat requests it sends upstream into
//! `CreateChatCompletionRequest`, and what a typed client serializes parses in graft.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use async_openai::types::chat::CreateChatCompletionRequest;
use async_openai::types::responses::{CreateResponse, Response, ResponseStreamEvent};
use graft_gateway::dialect::{
    Answer, Conversation, Delta, Finish, Message, Role, StreamEmitter, TokenUsage, Tool, ToolCall,
    chat, responses,
};
use graft_gateway::sse::Splitter;
use serde_json::{Value, json};

fn conv() -> Conversation {
    Conversation {
        model: "m".into(),
        messages: vec![Message::text(Role::User, "weather?")],
        tools: vec![Tool {
            name: "get_weather".into(),
            description: Some("Weather for a city".into()),
            parameters: json!({"type": "object", "properties": {"city": {"type": "string"}}}),
            strict: None,
        }],
        stream: true,
        ..Default::default()
    }
}

fn answers() -> Vec<Answer> {
    let base = Answer {
        id: "chatcmpl-1".into(),
        model: "m".into(),
        created: 1,
        text: "Let me check.".into(),
        reasoning: None,
        tool_calls: vec![],
        finish: Finish::Stop,
        usage: Some(TokenUsage {
            input_tokens: 12,
            output_tokens: 5,
            ..Default::default()
        }),
        logprobs: None,
    };
    vec![
        base.clone(),
        Answer {
            tool_calls: vec![ToolCall {
                id: "call_1".into(),
                name: "get_weather".into(),
                arguments: "{\"city\":\"Lisbon\"}".into(),
            }],
            finish: Finish::ToolCalls,
            ..base.clone()
        },
        Answer {
            reasoning: Some("thinking about it".into()),
            ..base.clone()
        },
        Answer {
            finish: Finish::Length,
            ..base
        },
    ]
}

fn deltas(a: &Answer) -> Vec<Delta> {
    let mut d = vec![];
    if let Some(r) = &a.reasoning {
        d.push(Delta::Reasoning(r.clone()));
    }
    d.push(Delta::Text(a.text.clone()));
    for (i, t) in a.tool_calls.iter().enumerate() {
        d.push(Delta::ToolCallStart {
            index: i,
            id: t.id.clone(),
            name: t.name.clone(),
        });
        let (x, y) = t.arguments.split_at(t.arguments.len() / 2);
        d.push(Delta::ToolCallArgs {
            index: i,
            arguments: x.into(),
        });
        d.push(Delta::ToolCallArgs {
            index: i,
            arguments: y.into(),
        });
    }
    d
}

#[test]
fn rendered_responses_and_every_stream_event_fit_the_typed_structs() {
    for a in answers() {
        let rendered = responses::render_answer(&conv(), &a, "resp_1");
        serde_json::from_value::<Response>(rendered.clone())
            .unwrap_or_else(|e| panic!("render_answer does not fit Response: {e}\n{rendered}"));

        let mut em = responses::stream(&conv(), "resp_1");
        let mut bytes = vec![];
        for b in em.start() {
            bytes.extend_from_slice(&b);
        }
        for d in deltas(&a) {
            for b in em.push(&d) {
                bytes.extend_from_slice(&b);
            }
        }
        for b in em.finish(&a) {
            bytes.extend_from_slice(&b);
        }
        let mut s = Splitter::default();
        s.push(&bytes);
        let mut n = 0;
        while let Some(ev) = s.next_event(1 << 20).unwrap() {
            let v: Value = serde_json::from_str(ev.data.as_deref().unwrap()).unwrap();
            serde_json::from_value::<ResponseStreamEvent>(v.clone())
                .unwrap_or_else(|e| panic!("event does not fit ResponseStreamEvent: {e}\n{v}"));
            n += 1;
        }
        assert!(n >= 4, "a stream has events");
    }
}

#[test]
fn chat_requests_graft_builds_fit_the_typed_request() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/captures");
    let mut checked = 0;
    for e in std::fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        if p.extension().is_none_or(|x| x != "json") {
            continue;
        }
        let cap: Value = serde_json::from_str(&std::fs::read_to_string(&p).unwrap()).unwrap();
        let conv = match cap["path"].as_str().unwrap() {
            "/v1/responses" => responses::parse_request(&cap["body"]).unwrap(),
            "/v1/chat/completions" => chat::parse_request(&cap["body"]).unwrap(),
            "/v1/messages" => {
                graft_gateway::dialect::anthropic::parse_request(&cap["body"]).unwrap()
            }
            _ => continue,
        };
        let (req, _) = chat::to_request(&conv);
        serde_json::from_value::<CreateChatCompletionRequest>(req.clone())
            .unwrap_or_else(|e| panic!("{}: the upstream request does not fit: {e}", p.display()));
        checked += 1;
    }
    assert!(checked >= 10);
}

#[test]
fn what_a_typed_client_serializes_parses_in_graft() {
    let typed: CreateResponse = serde_json::from_value(json!({
        "model": "m",
        "instructions": "be brief",
        "input": [
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "weather?"}]},
            {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": "{\"city\":\"Lisbon\"}"},
            {"type": "function_call_output", "call_id": "call_1", "output": "18 degrees"}
        ],
        "tools": [{"type": "function", "name": "get_weather", "parameters": {"type": "object"}, "strict": false}],
        "temperature": 0.2,
        "max_output_tokens": 64,
        "stream": true
    }))
    .unwrap();
    let wire = serde_json::to_value(&typed).unwrap();
    let conv = responses::parse_request(&wire).unwrap();
    assert_eq!(conv.messages[0].role, Role::System);
    let call = conv
        .messages
        .iter()
        .flat_map(|m| &m.tool_calls)
        .next()
        .unwrap();
    assert_eq!(call.arguments, "{\"city\":\"Lisbon\"}");
    let out = conv.messages.iter().find(|m| m.role == Role::Tool).unwrap();
    assert_eq!(out.tool_call_id.as_deref(), Some("call_1"));
    assert_eq!(conv.sampling.max_tokens, Some(64));
    assert_eq!(conv.tools.len(), 1);
}

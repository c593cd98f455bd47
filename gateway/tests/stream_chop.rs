//! A Chat Completions stream chopped at random byte boundaries, translated to Responses and
//! to Anthropic events by the gateway's own pipeline (splitter → chunk reader → emitter),
//! assembles to the same final response as the unchopped stream, and tool-call arguments
//! arrive whole whatever the chunking.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use graft_gateway::dialect::chat::ChunkReader;
use graft_gateway::dialect::{Conversation, Message, Role, StreamEmitter, anthropic, responses};
use graft_gateway::sse::Splitter;
use proptest::prelude::*;
use serde_json::{Value, json};

/// A Chat stream: content pieces, then tool calls whose arguments come in pieces.
fn chat_sse(text: &[String], calls: &[(String, Vec<String>)]) -> Vec<u8> {
    let mut out = String::new();
    let mut push = |v: Value| out.push_str(&format!("data: {v}\n\n"));
    push(
        json!({"id": "c1", "model": "m", "created": 1, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}),
    );
    for t in text {
        push(json!({"id": "c1", "choices": [{"index": 0, "delta": {"content": t}}]}));
    }
    for (i, (name, pieces)) in calls.iter().enumerate() {
        push(
            json!({"id": "c1", "choices": [{"index": 0, "delta": {"tool_calls": [{"index": i, "id": format!("call_{i}"), "type": "function", "function": {"name": name, "arguments": ""}}]}}]}),
        );
        for p in pieces {
            push(
                json!({"id": "c1", "choices": [{"index": 0, "delta": {"tool_calls": [{"index": i, "function": {"arguments": p}}]}}]}),
            );
        }
    }
    let finish = if calls.is_empty() {
        "stop"
    } else {
        "tool_calls"
    };
    push(json!({"id": "c1", "choices": [{"index": 0, "delta": {}, "finish_reason": finish}]}));
    push(
        json!({"id": "c1", "choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": 11, "total_tokens": 18}}),
    );
    out.push_str("data: [DONE]\n\n");
    out.into_bytes()
}

/// Runs the bytes, cut into `pieces`, through the translation pipeline; returns the client
/// dialect's SSE bytes.
fn translate(pieces: &[&[u8]], mut em: Box<dyn StreamEmitter>) -> Vec<u8> {
    let mut splitter = Splitter::default();
    let mut reader = ChunkReader::new();
    let mut out: Vec<u8> = vec![];
    for b in em.start() {
        out.extend_from_slice(&b);
    }
    for piece in pieces {
        splitter.push(piece);
        while let Some(ev) = splitter.next_event(1 << 20).unwrap() {
            if ev.is_done() {
                continue;
            }
            let v: Value = serde_json::from_str(ev.data.as_deref().unwrap()).unwrap();
            for d in reader.push(&v) {
                for b in em.push(&d) {
                    out.extend_from_slice(&b);
                }
            }
        }
    }
    for b in em.finish(&reader.answer()) {
        out.extend_from_slice(&b);
    }
    out
}

fn events(bytes: &[u8]) -> Vec<Value> {
    let mut s = Splitter::default();
    s.push(bytes);
    let mut out = vec![];
    while let Some(ev) = s.next_event(1 << 24).unwrap() {
        out.push(serde_json::from_str(ev.data.as_deref().unwrap()).unwrap());
    }
    out
}

fn cut(bytes: &[u8], cuts: &[usize]) -> Vec<Vec<u8>> {
    let mut at: Vec<usize> = cuts.iter().map(|c| c % bytes.len().max(1)).collect();
    at.sort_unstable();
    at.dedup();
    let mut out = vec![];
    let mut prev = 0;
    for c in at {
        out.push(bytes[prev..c].to_vec());
        prev = c;
    }
    out.push(bytes[prev..].to_vec());
    out
}

fn conv() -> Conversation {
    Conversation {
        model: "m".into(),
        messages: vec![Message::text(Role::User, "go")],
        stream: true,
        ..Default::default()
    }
}

/// Responses ids are random per stream: compare everything else.
fn scrub(mut v: Value) -> Value {
    fn walk(v: &mut Value) {
        match v {
            Value::Object(o) => {
                for (k, x) in o.iter_mut() {
                    if k == "id" || k == "item_id" || k == "created_at" {
                        *x = Value::Null;
                    } else {
                        walk(x);
                    }
                }
            }
            Value::Array(a) => a.iter_mut().for_each(walk),
            _ => {}
        }
    }
    walk(&mut v);
    v
}

fn args_strategy() -> impl Strategy<Value = (String, Vec<String>)> {
    (
        "[a-z]{1,8}",
        prop::collection::btree_map("[a-z]{1,5}", "[ -~]{0,12}", 0..4),
    )
        .prop_map(|(name, map)| {
            let args = serde_json::to_string(&map).unwrap();
            // Split the JSON text into 1-4 pieces at char boundaries.
            let chars: Vec<char> = args.chars().collect();
            let n = chars.len();
            let pieces = vec![
                chars[..n / 3].iter().collect::<String>(),
                chars[n / 3..n / 2].iter().collect(),
                chars[n / 2..].iter().collect(),
            ];
            (name, pieces)
        })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(96))]
    #[test]
    fn chopped_streams_assemble_to_the_same_answer(
        text in prop::collection::vec("[ -~]{0,10}", 0..6),
        calls in prop::collection::vec(args_strategy(), 0..3),
        cuts in prop::collection::vec(0usize..100_000, 0..40),
    ) {
        let bytes = chat_sse(&text, &calls);
        let chopped = cut(&bytes, &cuts);
        let chopped: Vec<&[u8]> = chopped.iter().map(Vec::as_slice).collect();
        let whole: Vec<&[u8]> = vec![&bytes];

        // Responses.
        let mut a = responses::ResponsesAssembler::new();
        for e in events(&translate(&chopped, Box::new(responses::stream(&conv(), "resp_1")))) {
            a.push(&e);
        }
        let mut b = responses::ResponsesAssembler::new();
        for e in events(&translate(&whole, Box::new(responses::stream(&conv(), "resp_1")))) {
            b.push(&e);
        }
        let (ra, rb) = (a.finish().unwrap(), b.finish().unwrap());
        prop_assert_eq!(scrub(ra.clone()), scrub(rb));
        let calls_out: Vec<&Value> = ra["output"].as_array().unwrap().iter().filter(|i| i["type"] == "function_call").collect();
        prop_assert_eq!(calls_out.len(), calls.len());
        for (item, (name, pieces)) in calls_out.iter().zip(&calls) {
            prop_assert_eq!(item["name"].as_str().unwrap(), name.as_str());
            prop_assert_eq!(item["arguments"].as_str().unwrap(), pieces.concat());
        }
        prop_assert_eq!(&ra["usage"]["output_tokens"], &json!(11));

        // Anthropic.
        let mut a = anthropic::AnthropicAssembler::new();
        for e in events(&translate(&chopped, Box::new(anthropic::stream(&conv(), "msg_1")))) {
            a.push(&e);
        }
        let mut b = anthropic::AnthropicAssembler::new();
        for e in events(&translate(&whole, Box::new(anthropic::stream(&conv(), "msg_1")))) {
            b.push(&e);
        }
        let (ma, mb) = (a.finish().unwrap(), b.finish().unwrap());
        prop_assert_eq!(&ma, &mb);
        let uses: Vec<&Value> = ma["content"].as_array().unwrap().iter().filter(|c| c["type"] == "tool_use").collect();
        prop_assert_eq!(uses.len(), calls.len());
        for (u, (_, pieces)) in uses.iter().zip(&calls) {
            let want: Value = serde_json::from_str(&pieces.concat()).unwrap();
            prop_assert_eq!(&u["input"], &want);
        }
        let joined: String = text.concat();
        let text_out: String = ma["content"].as_array().unwrap().iter().filter(|c| c["type"] == "text").map(|c| c["text"].as_str().unwrap().to_string()).collect();
        prop_assert_eq!(text_out, joined);
    }
}

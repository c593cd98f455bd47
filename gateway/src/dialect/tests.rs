//! The [`Dialect`] trait over the four dialects: chosen by kind, and each part the same as the
//! dialect's own functions (the passthrough tee's terminal events and finish reasons, error
//! shapes, `include_usage`).

use bytes::Bytes;
use serde_json::{Value, json};

use super::*;
use crate::sse::{Event, Splitter};

const KINDS: [DialectKind; 4] = [
    DialectKind::ChatCompletions,
    DialectKind::Completions,
    DialectKind::Responses,
    DialectKind::AnthropicMessages,
];

fn answer() -> Answer {
    Answer {
        id: "up".into(),
        model: "m".into(),
        created: 1_700_000_000,
        text: "Hi there".into(),
        reasoning: None,
        tool_calls: vec![],
        finish: Finish::Length,
        usage: Some(TokenUsage {
            input_tokens: 4,
            output_tokens: 2,
            cached_tokens: 0,
            reasoning_tokens: 0,
        }),
        logprobs: None,
    }
}

fn request(kind: DialectKind) -> Value {
    match kind {
        DialectKind::ChatCompletions => json!({"model": "m", "stream": true,
            "stream_options": {"include_usage": true}, "messages": [{"role": "user", "content": "hi"}]}),
        DialectKind::Completions => json!({"model": "m", "stream": true,
            "stream_options": {"include_usage": true}, "prompt": "hi"}),
        DialectKind::Responses => json!({"model": "m", "stream": true, "input": "hi"}),
        DialectKind::AnthropicMessages => json!({"model": "m", "stream": true, "max_tokens": 16,
            "messages": [{"role": "user", "content": "hi"}]}),
    }
}

/// Emits `answer()` through the trait's emitter and splits the bytes into events.
fn emitted(d: &dyn Dialect, conv: &Conversation, id: &str) -> Vec<(Event, Option<Value>)> {
    let a = answer();
    let mut e = d.emitter(conv, id, a.created);
    let mut bytes: Vec<Bytes> = e.start();
    bytes.extend(e.push(&Delta::Text("Hi ".into())));
    bytes.extend(e.push(&Delta::Text("there".into())));
    bytes.extend(e.finish(&a));
    let mut s = Splitter::default();
    for b in &bytes {
        s.push(b);
    }
    let mut out = vec![];
    while let Some(ev) = s.next_event(1 << 20).unwrap() {
        let parsed = ev
            .data
            .as_deref()
            .and_then(|d| serde_json::from_str(d).ok());
        out.push((ev, parsed));
    }
    out
}

#[test]
fn each_kind_chooses_its_own_dialect_and_id_prefix() {
    let prefixes = ["chatcmpl-", "cmpl-", "resp_", "msg_"];
    let labels = [
        "chat_completions",
        "completions",
        "responses",
        "anthropic_messages",
    ];
    for ((kind, prefix), label) in KINDS.iter().zip(prefixes).zip(labels) {
        let d = dialect(*kind);
        assert_eq!(d.kind(), *kind);
        assert_eq!(d.id_prefix(), prefix, "{kind:?}");
        assert_eq!(kind.label(), label);
        assert_eq!(
            serde_json::to_value(kind).unwrap(),
            json!(label),
            "config spelling"
        );
    }
    let k: DialectKind = serde_json::from_value(json!("completions")).unwrap();
    assert_eq!(k, DialectKind::Completions);
}

#[test]
fn trait_parse_and_render_are_the_dialects_own() {
    let a = answer();
    for kind in KINDS {
        let d = dialect(kind);
        let body = request(kind);
        let conv = d.parse(&body).unwrap();
        let own = match kind {
            DialectKind::ChatCompletions => chat::parse_request(&body),
            DialectKind::Completions => completions::parse_request(&body),
            DialectKind::Responses => responses::parse_request(&body),
            DialectKind::AnthropicMessages => anthropic::parse_request(&body),
        }
        .unwrap();
        assert_eq!(conv, own, "{kind:?}");
        let rendered = d.render(&conv, &a, "id-1");
        let own = match kind {
            DialectKind::ChatCompletions => chat::render_answer(&a, "id-1"),
            DialectKind::Completions => completions::render_answer(&a, "id-1"),
            DialectKind::Responses => responses::render_answer(&conv, &a, "id-1"),
            DialectKind::AnthropicMessages => anthropic::render_answer(&conv, &a, "id-1"),
        };
        assert_eq!(rendered, own, "{kind:?}");
    }
}

#[test]
fn chat_parse_carries_include_usage_to_the_emitter() {
    let d = dialect(DialectKind::ChatCompletions);
    let with = d.parse(&request(DialectKind::ChatCompletions)).unwrap();
    assert!(with.include_usage);
    let without = d
        .parse(
            &json!({"model": "m", "stream": true, "messages": [{"role": "user", "content": "hi"}]}),
        )
        .unwrap();
    assert!(!without.include_usage);
    let off = d
        .parse(&json!({"model": "m", "stream_options": {"include_usage": false}, "messages": []}))
        .unwrap();
    assert!(!off.include_usage);

    let usage_chunks = |conv: &Conversation| {
        emitted(d, conv, "chatcmpl-1")
            .iter()
            .filter(|(_, p)| {
                p.as_ref()
                    .is_some_and(|p| p["choices"] == json!([]) && p["usage"].is_object())
            })
            .count()
    };
    assert_eq!(usage_chunks(&with), 1);
    assert_eq!(usage_chunks(&without), 0);
}

#[test]
fn conversation_additions_stay_out_of_records_unless_set() {
    let conv = chat::parse_request(&json!({"model": "m", "messages": []})).unwrap();
    let v = serde_json::to_value(&conv).unwrap();
    assert!(
        v.get("include_usage").is_none() && v.get("prompt").is_none(),
        "{v}"
    );
    // A record written before these fields existed still reads.
    let old: Conversation =
        serde_json::from_value(json!({"model": "m", "messages": [], "stream": false})).unwrap();
    assert!(!old.include_usage && old.prompt.is_none());

    let conv = completions::parse_request(&json!({"model": "m", "prompt": [1, 2]})).unwrap();
    let v = serde_json::to_value(&conv).unwrap();
    assert_eq!(v["prompt"], json!({"tokens": [1, 2]}));
    let back: Conversation = serde_json::from_value(v).unwrap();
    assert_eq!(back, conv);
    let conv = completions::parse_request(&json!({"model": "m", "prompt": "once"})).unwrap();
    assert_eq!(
        serde_json::to_value(&conv).unwrap()["prompt"],
        json!({"text": "once"})
    );
}

/// The terminal events and finish reasons the passthrough tee used before the trait:
/// Chat/Completions `data: [DONE]`; Responses `response.completed|incomplete|failed` and the
/// response's `status`; Anthropic `message_stop` and the message's `stop_reason`.
#[test]
fn assemblers_hold_back_the_same_last_word_and_name_the_finish() {
    let want_finish = ["length", "length", "incomplete", "max_tokens"];
    for (kind, want) in KINDS.into_iter().zip(want_finish) {
        let d = dialect(kind);
        let conv = d.parse(&request(kind)).unwrap();
        let evs = emitted(d, &conv, &format!("{}1", d.id_prefix()));
        let mut asm = d.assembler();
        assert!(
            asm.finish().is_none() || kind == DialectKind::Responses,
            "{kind:?}: nothing yet"
        );
        let mut terminal = vec![];
        for (i, (ev, parsed)) in evs.iter().enumerate() {
            if asm.is_terminal(ev, parsed.as_ref()) {
                terminal.push(i);
            }
            if let Some(p) = parsed {
                asm.push(p);
            }
        }
        assert_eq!(
            terminal,
            vec![evs.len() - 1],
            "{kind:?}: only the last event is terminal"
        );
        let last = &evs[evs.len() - 1];
        let ty = last
            .1
            .as_ref()
            .and_then(|v| v.get("type"))
            .and_then(Value::as_str);
        match kind {
            DialectKind::ChatCompletions | DialectKind::Completions => assert!(last.0.is_done()),
            DialectKind::Responses => assert_eq!(ty, Some("response.incomplete")),
            DialectKind::AnthropicMessages => assert_eq!(ty, Some("message_stop")),
        }
        let whole = asm.finish();
        assert!(whole.is_some(), "{kind:?}");
        assert_eq!(
            asm.finish_reason(whole.as_ref()).as_deref(),
            Some(want),
            "{kind:?}"
        );
    }
    // The other terminal kinds of a Responses stream, and what is not terminal.
    let asm = dialect(DialectKind::Responses).assembler();
    let ev = Event {
        raw: Bytes::new(),
        data: None,
    };
    for (ty, term) in [
        ("response.completed", true),
        ("response.failed", true),
        ("response.created", false),
        ("error", false),
    ] {
        assert_eq!(
            asm.is_terminal(&ev, Some(&json!({"type": ty}))),
            term,
            "{ty}"
        );
    }
    let asm = dialect(DialectKind::AnthropicMessages).assembler();
    assert!(!asm.is_terminal(&ev, Some(&json!({"type": "message_delta"}))));
    assert!(
        !dialect(DialectKind::ChatCompletions)
            .assembler()
            .is_terminal(&ev, None)
    );
}

#[test]
fn chat_assembler_without_chunks_assembles_nothing() {
    for kind in [DialectKind::ChatCompletions, DialectKind::Completions] {
        let asm = dialect(kind).assembler();
        assert!(asm.finish().is_none(), "{kind:?}");
        assert!(asm.finish_reason(None).is_none());
    }
}

#[test]
fn error_shapes_are_each_dialects_own() {
    let e = GatewayError::UpstreamTimeout {
        upstream: "http://u".into(),
        secs: 3,
    };
    for kind in KINDS {
        let d = dialect(kind);
        let (body, event) = (d.error_body(&e), d.error_event(&e, "id-7"));
        match kind {
            DialectKind::ChatCompletions | DialectKind::Completions => {
                assert_eq!(body, e.body());
                assert!(body["error"]["message"].is_string());
                assert_eq!(event, e.sse_event());
            }
            DialectKind::Responses => {
                assert_eq!(body, e.body());
                assert_eq!(event, responses::error_event(&e, "id-7"));
            }
            DialectKind::AnthropicMessages => {
                assert_eq!(body, anthropic::error_body(&e));
                assert_eq!(body["type"], "error");
                assert_eq!(event, anthropic::error_event(&e));
            }
        }
    }
}

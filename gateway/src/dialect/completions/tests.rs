use bytes::Bytes;
use serde_json::{Value, json};

use super::*;
use crate::dialect::{
    Answer, Delta, Finish, RawPrompt, StreamEmitter, TokenUsage, ToolCall, dialect,
};
use crate::error::GatewayError;
use crate::sse::Splitter;

fn parse_err(body: Value) -> (String, String) {
    match parse_request(&body) {
        Err(GatewayError::InvalidField { param, message }) => (param, message),
        other => panic!("expected an InvalidField error for {body}, got {other:?}"),
    }
}

fn answer(finish: Finish, usage: Option<TokenUsage>) -> Answer {
    Answer {
        id: "upstream-1".into(),
        model: "m".into(),
        created: 1_700_000_000,
        text: "Hello, world".into(),
        reasoning: None,
        tool_calls: vec![],
        finish,
        usage,
        logprobs: None,
    }
}

fn usage() -> TokenUsage {
    TokenUsage {
        input_tokens: 7,
        output_tokens: 3,
        cached_tokens: 0,
        reasoning_tokens: 0,
    }
}

/// The SSE events of a stream as (raw data text, parsed JSON when it is JSON).
fn events(chunks: &[Bytes]) -> Vec<(crate::sse::Event, Option<Value>)> {
    let mut s = Splitter::default();
    for c in chunks {
        s.push(c);
    }
    let mut out = vec![];
    while let Some(ev) = s.next_event(1 << 20).unwrap() {
        let parsed = ev
            .data
            .as_deref()
            .and_then(|d| serde_json::from_str::<Value>(d).ok());
        out.push((ev, parsed));
    }
    assert_eq!(s.pending(), 0, "the stream ends on an event boundary");
    out
}

fn emit(include_usage: bool, deltas: &[Delta], a: &Answer) -> Vec<Bytes> {
    let mut st = stream("m", "cmpl-1", 1_700_000_000, include_usage);
    let mut out = st.start();
    for d in deltas {
        out.extend(st.push(d));
    }
    out.extend(st.finish(a));
    out
}

#[test]
fn prompt_shapes_parse_into_the_raw_prompt() {
    let text = |p: Value| {
        parse_request(&json!({"model": "m", "prompt": p}))
            .unwrap()
            .prompt
    };
    assert_eq!(
        text(json!("Once upon")),
        Some(RawPrompt::Text("Once upon".into()))
    );
    assert_eq!(text(json!("")), Some(RawPrompt::Text(String::new())));
    assert_eq!(
        text(json!(["Once upon"])),
        Some(RawPrompt::Text("Once upon".into()))
    );
    assert_eq!(
        text(json!([1, 2, 3])),
        Some(RawPrompt::Tokens(vec![1, 2, 3]))
    );
    assert_eq!(text(json!([[4, 5]])), Some(RawPrompt::Tokens(vec![4, 5])));
    let conv = parse_request(&json!({"model": "m", "prompt": "x"})).unwrap();
    assert!(
        conv.messages.is_empty(),
        "a raw prompt is not a conversation"
    );
    assert_eq!(conv.model, "m");
}

#[test]
fn sampling_and_stream_fields_are_mapped() {
    let conv = parse_request(&json!({
        "model": "m", "prompt": "x", "n": 1, "best_of": 1, "echo": false, "suffix": null,
        "max_tokens": 32, "temperature": 0.7, "top_p": 0.9, "top_k": 20, "stop": "\n",
        "seed": 42, "presence_penalty": 0.5, "frequency_penalty": -0.5, "logprobs": 2,
        "stream": true, "stream_options": {"include_usage": true},
        "user": "u1", "logit_bias": {"50256": -100}, "min_p": 0.05,
        "repetition_penalty": 1.1
    }))
    .unwrap();
    let s = &conv.sampling;
    assert_eq!(s.max_tokens, Some(32));
    assert_eq!(s.temperature, Some(0.7));
    assert_eq!(s.top_p, Some(0.9));
    assert_eq!(s.top_k, Some(20));
    assert_eq!(s.stop, vec!["\n".to_string()]);
    assert_eq!(s.seed, Some(42));
    assert_eq!(s.presence_penalty, Some(0.5));
    assert_eq!(s.frequency_penalty, Some(-0.5));
    assert_eq!(s.min_p, Some(0.05));
    assert_eq!(s.repetition_penalty, Some(1.1));
    assert_eq!(
        s.logit_bias.clone().map(Value::Object),
        Some(json!({"50256": -100}))
    );
    assert!(conv.stream);
    assert!(conv.include_usage);
    // Fields the conversation has no place for are kept for the record.
    assert_eq!(conv.extra.get("logprobs"), Some(&json!(2)));
    assert_eq!(conv.extra.get("user"), Some(&json!("u1")));
    for mapped in [
        "logit_bias",
        "min_p",
        "prompt",
        "max_tokens",
        "stop",
        "n",
        "stream_options",
        "echo",
    ] {
        assert!(
            !conv.extra.contains_key(mapped),
            "{mapped} is mapped, not extra"
        );
    }

    let conv =
        parse_request(&json!({"model": "m", "prompt": "x", "stop": ["a", "b"], "top_k": -1}))
            .unwrap();
    assert_eq!(conv.sampling.stop, vec!["a".to_string(), "b".to_string()]);
    assert_eq!(conv.sampling.top_k, None, "-1 means no top-k");
    assert!(!conv.stream);
    assert!(!conv.include_usage);
}

#[test]
fn batches_and_unsupported_options_are_refused_naming_the_field() {
    let (param, msg) = parse_err(json!({"model": "m", "prompt": ["a", "b"]}));
    assert_eq!(param, "prompt");
    assert!(
        msg.contains("2 prompts") && msg.contains("one request per prompt"),
        "{msg}"
    );
    let (param, msg) = parse_err(json!({"model": "m", "prompt": [[1], [2], [3]]}));
    assert_eq!(param, "prompt");
    assert!(msg.contains("3 prompts"), "{msg}");

    let (param, msg) = parse_err(json!({"model": "m", "prompt": "x", "echo": true}));
    assert_eq!(param, "echo");
    assert!(msg.contains("not supported"), "{msg}");
    let (param, msg) = parse_err(json!({"model": "m", "prompt": "x", "best_of": 3}));
    assert_eq!(param, "best_of");
    assert!(msg.contains("'best_of' = 3 is not supported"), "{msg}");
    let (param, msg) = parse_err(json!({"model": "m", "prompt": "x", "suffix": "end"}));
    assert_eq!(param, "suffix");
    assert!(msg.contains("not supported"), "{msg}");
    let (param, msg) = parse_err(json!({"model": "m", "prompt": "x", "n": 2}));
    assert_eq!(param, "n");
    assert!(msg.contains("'n' = 2 is not supported"), "{msg}");
}

#[test]
fn bad_completions_input_names_the_path() {
    let cases = [
        (json!({"model": "m"}), "prompt"),
        (json!({"model": "m", "prompt": null}), "prompt"),
        (json!({"model": "m", "prompt": 5}), "prompt"),
        (json!({"model": "m", "prompt": []}), "prompt"),
        (json!({"model": "m", "prompt": [true]}), "prompt[0]"),
        (json!({"model": "m", "prompt": [1, -2]}), "prompt[1]"),
        (
            json!({"model": "m", "prompt": [1, 4294967296u64]}),
            "prompt[1]",
        ),
        (json!({"model": "m", "prompt": [[1, "a"]]}), "prompt[0][1]"),
        (json!({"model": "m", "prompt": [[]]}), "prompt[0]"),
        (json!({"model": 3, "prompt": "x"}), "model"),
        (
            json!({"model": "m", "prompt": "x", "temperature": "hot"}),
            "temperature",
        ),
        (json!({"model": "m", "prompt": "x", "top_p": []}), "top_p"),
        (json!({"model": "m", "prompt": "x", "top_k": 0.5}), "top_k"),
        (
            json!({"model": "m", "prompt": "x", "max_tokens": -1}),
            "max_tokens",
        ),
        (json!({"model": "m", "prompt": "x", "stop": 5}), "stop"),
        (
            json!({"model": "m", "prompt": "x", "stop": ["a", 1]}),
            "stop[1]",
        ),
        (json!({"model": "m", "prompt": "x", "seed": 1.5}), "seed"),
        (
            json!({"model": "m", "prompt": "x", "presence_penalty": "x"}),
            "presence_penalty",
        ),
        (
            json!({"model": "m", "prompt": "x", "frequency_penalty": true}),
            "frequency_penalty",
        ),
        (
            json!({"model": "m", "prompt": "x", "logprobs": "yes"}),
            "logprobs",
        ),
        (json!({"model": "m", "prompt": "x", "n": 0}), "n"),
        (json!({"model": "m", "prompt": "x", "n": "1"}), "n"),
        (
            json!({"model": "m", "prompt": "x", "best_of": 0}),
            "best_of",
        ),
        (json!({"model": "m", "prompt": "x", "echo": "no"}), "echo"),
        (json!({"model": "m", "prompt": "x", "suffix": 1}), "suffix"),
        (
            json!({"model": "m", "prompt": "x", "stream": "yes"}),
            "stream",
        ),
        (
            json!({"model": "m", "prompt": "x", "stream_options": 1}),
            "stream_options",
        ),
        (
            json!({"model": "m", "prompt": "x", "stream_options": {"include_usage": "y"}}),
            "stream_options.include_usage",
        ),
    ];
    for (body, path) in cases {
        let (param, msg) = parse_err(body.clone());
        assert_eq!(param, path, "{body}: {msg}");
        assert!(msg.contains(path), "the message names '{path}': {msg}");
    }
    assert!(parse_request(&json!(["not an object"])).is_err());
}

#[test]
fn render_is_a_text_completion() {
    let v = render_answer(&answer(Finish::Length, Some(usage())), "cmpl-abc");
    assert_eq!(
        v,
        json!({
            "id": "cmpl-abc",
            "object": "text_completion",
            "created": 1_700_000_000,
            "model": "m",
            "choices": [{"index": 0, "text": "Hello, world", "logprobs": null, "finish_reason": "length"}],
            "usage": {"prompt_tokens": 7, "completion_tokens": 3, "total_tokens": 10},
        })
    );
    let v = render_answer(&answer(Finish::Stop, None), "cmpl-abc");
    assert!(v.get("usage").is_none(), "no usage is made up: {v}");
}

#[test]
fn render_has_the_openai_python_completion_fields() {
    // openai-python `Completion`: id: str, choices: List[CompletionChoice], created: int,
    // model: str, object: "text_completion", usage: Optional[CompletionUsage];
    // `CompletionChoice`: finish_reason: Literal["stop", "length", "content_filter"],
    // index: int, logprobs: Optional[Logprobs] (a key, null here), text: str;
    // `CompletionUsage`: completion_tokens, prompt_tokens, total_tokens: int.
    for (finish, want) in [
        (Finish::Stop, "stop"),
        (Finish::Length, "length"),
        (Finish::ContentFilter, "content_filter"),
        (Finish::ToolCalls, "stop"),
        (Finish::Error, "stop"),
    ] {
        let v = render_answer(&answer(finish, Some(usage())), "cmpl-x");
        assert!(v["id"].is_string());
        assert!(v["created"].is_i64());
        assert!(v["model"].is_string());
        assert_eq!(v["object"], "text_completion");
        let choices = v["choices"].as_array().unwrap();
        assert_eq!(choices.len(), 1);
        let c = choices[0].as_object().unwrap();
        assert!(c["index"].is_u64());
        assert!(c["text"].is_string());
        assert!(c.contains_key("logprobs") && c["logprobs"].is_null());
        assert_eq!(c["finish_reason"], want, "{finish:?}");
        for k in ["completion_tokens", "prompt_tokens", "total_tokens"] {
            assert!(v["usage"][k].is_u64(), "usage.{k}");
        }
    }
}

#[test]
fn stream_chunks_reassemble_into_the_rendered_answer() {
    let a = answer(Finish::Length, Some(usage()));
    let deltas = [
        Delta::Text("Hel".into()),
        Delta::Text("lo, ".into()),
        Delta::Text("world".into()),
    ];
    let evs = events(&emit(true, &deltas, &a));
    // 3 text chunks, the finish chunk, the usage chunk, [DONE].
    assert_eq!(evs.len(), 6, "{evs:?}");
    let mut asm = Completions.assembler();
    for (i, (ev, parsed)) in evs.iter().enumerate() {
        let last = i == evs.len() - 1;
        assert_eq!(asm.is_terminal(ev, parsed.as_ref()), last, "event {i}");
        if last {
            assert!(ev.is_done());
            continue;
        }
        let c = parsed.as_ref().unwrap();
        assert_eq!(c["object"], "text_completion");
        assert_eq!(c["id"], "cmpl-1");
        assert!(
            c.as_object().unwrap().contains_key("usage"),
            "include_usage: usage on every chunk"
        );
        match i {
            0..=2 => {
                assert_eq!(c["choices"][0]["finish_reason"], Value::Null);
                assert_eq!(c["usage"], Value::Null);
            }
            3 => {
                assert_eq!(c["choices"][0]["text"], "");
                assert_eq!(c["choices"][0]["finish_reason"], "length");
            }
            _ => {
                assert_eq!(c["choices"], json!([]));
                assert_eq!(c["usage"]["total_tokens"], 10);
            }
        }
        asm.push(c);
    }
    let mut assembled = asm.finish().unwrap();
    assert_eq!(
        asm.finish_reason(Some(&assembled)).as_deref(),
        Some("length")
    );
    // The assembler leaves out a choice's `logprobs` when no chunk carried any; the whole
    // answer has it as null.
    let choice = assembled["choices"][0].as_object_mut().unwrap();
    assert!(!choice.contains_key("logprobs"));
    choice.insert("logprobs".into(), Value::Null);
    assert_eq!(assembled, render_answer(&a, "cmpl-1"));
}

#[test]
fn stream_without_include_usage_has_no_usage_anywhere() {
    let a = answer(Finish::Stop, Some(usage()));
    let evs = events(&emit(false, &[Delta::Text("Hello, world".into())], &a));
    assert_eq!(evs.len(), 3, "text chunk, finish chunk, [DONE]: {evs:?}");
    for (ev, parsed) in &evs[..2] {
        assert!(!ev.is_done());
        assert!(parsed.as_ref().unwrap().get("usage").is_none());
    }
    assert!(evs[2].0.is_done());
    let mut asm = assembler();
    for (_, p) in &evs[..2] {
        asm.push(p.as_ref().unwrap());
    }
    let v = asm.finish();
    assert_eq!(v["choices"][0]["text"], "Hello, world");
    assert_eq!(v["choices"][0]["finish_reason"], "stop");
    assert!(v.get("usage").is_none());
}

#[test]
fn reasoning_and_tool_calls_are_dropped_not_streamed() {
    let mut a = answer(Finish::ToolCalls, None);
    a.reasoning = Some("thinking".into());
    a.tool_calls = vec![ToolCall {
        id: "c1".into(),
        name: "f".into(),
        arguments: "{}".into(),
    }];
    let deltas = [
        Delta::Reasoning("thinking".into()),
        Delta::Text("Hello, world".into()),
        Delta::ToolCallStart {
            index: 0,
            id: "c1".into(),
            name: "f".into(),
        },
        Delta::ToolCallArgs {
            index: 0,
            arguments: "{}".into(),
        },
    ];
    let evs = events(&emit(false, &deltas, &a));
    assert_eq!(evs.len(), 3, "only the text delta is streamed: {evs:?}");
    let all: String = evs
        .iter()
        .map(|(e, _)| String::from_utf8_lossy(&e.raw).to_string())
        .collect();
    assert!(!all.contains("thinking") && !all.contains("c1"), "{all}");
    let v = render_answer(&a, "cmpl-1");
    assert_eq!(v["choices"][0]["text"], "Hello, world");
    assert_eq!(v["choices"][0]["finish_reason"], "stop");
    assert!(!v.to_string().contains("thinking"));
}

#[test]
fn the_completions_dialect_is_chosen_by_its_kind() {
    let d = dialect(crate::dialect::DialectKind::Completions);
    assert_eq!(d.kind(), crate::dialect::DialectKind::Completions);
    assert_eq!(d.id_prefix(), "cmpl-");
    let conv = d
        .parse(&json!({"model": "m", "prompt": "x", "stream_options": {"include_usage": true}}))
        .unwrap();
    let a = answer(Finish::Stop, Some(usage()));
    assert_eq!(d.render(&conv, &a, "cmpl-9"), render_answer(&a, "cmpl-9"));
    // The trait's emitter carries the conversation's include_usage.
    let mut e = d.emitter(&conv, "cmpl-9", 5);
    let out: Vec<Bytes> = e.finish(&a);
    let text: String = out
        .iter()
        .map(|b| String::from_utf8_lossy(b).to_string())
        .collect();
    assert!(text.contains("\"total_tokens\":10"), "{text}");
    let err = GatewayError::field("prompt", "bad");
    assert_eq!(d.error_body(&err), err.body());
    assert_eq!(d.error_event(&err, "cmpl-9"), err.sse_event());
}

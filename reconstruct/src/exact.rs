//! Exact mode's prompt side: the token ids the policy is asked to continue, built so that
//! what it sampled before is never re-tokenized.
//!
//! A session's calls usually extend each other: the next request is the previous request's
//! messages, the answer the model gave, and something new (tool results, a user message).
//! Re-rendering the whole conversation would re-tokenize the earlier answers from the text
//! the client echoed back, and templates rewrite history (Qwen3 drops the `<think>` block of
//! earlier turns; harnesses re-serialize tool arguments), so the prompt would no longer hold
//! the tokens that were sampled. [`PromptBuilder::prompt`] instead finds the previous call
//! ([`Turn`]) this request extends, keeps that call's prompt and completion ids verbatim, and
//! tokenizes only the new messages and the generation prompt.
//!
//! How the new part is rendered without the history: the template renders a stand-in
//! history (a user message and an assistant message holding a sentinel) followed by the new
//! messages and the generation prompt; the new part is what follows the end-of-turn token
//! after the sentinel. Everything the template puts between turns (the newline after
//! `<|im_end|>`, the `<|im_start|>user` of a tool-response block) is in it. The cut is after a
//! special token, so tokenizing the part alone gives the same ids as tokenizing it in place.
//!
//! [`Detokenizer`] turns completion ids into text incrementally while they stream in.

use std::sync::Arc;

use serde_json::{Map, Value, json};

use crate::retokenize::Model;
use crate::template::TemplateError;

/// The assistant content of the stand-in history. Chosen to be nothing a template or a
/// tokenizer would treat specially.
const SENTINEL: &str = "graft-exact-sentinel-5f0c2a";

/// One finished exact call of a session, as the next call may extend it.
#[derive(Debug, Clone, PartialEq)]
pub struct Turn {
    /// The request's messages in template form (see [`template_messages`]).
    pub messages: Vec<Value>,
    pub tools: Option<Vec<Value>>,
    /// The answer as an assistant message (`content`, `reasoning_content`, `tool_calls`).
    pub answer: Value,
    /// Prompt ids followed by the completion ids the backend returned.
    pub tokens: Vec<u32>,
}

/// How a prompt was built.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PromptKind {
    /// The whole conversation rendered and tokenized (first call, or no earlier call of the
    /// session is extended by this one).
    Full,
    /// `reused` ids taken verbatim from an earlier call (its prompt and what was sampled),
    /// the rest tokenized from the new messages.
    Reused { reused: usize },
}

/// The prompt of one exact call.
#[derive(Debug, Clone, PartialEq)]
pub struct Prompt {
    pub ids: Vec<u32>,
    pub kind: PromptKind,
    /// The prompt ends inside an open `<think>` (the generation prompt opened it), so the
    /// output starts with reasoning.
    pub starts_in_reasoning: bool,
}

/// Renders and tokenizes exact-mode prompts for one model.
pub struct PromptBuilder {
    model: Model,
    eos_id: Option<u32>,
}

impl PromptBuilder {
    pub fn new(model: Model) -> Self {
        let eos_id = model
            .template
            .eos_token()
            .and_then(|t| model.tokenizer.token_id(t));
        PromptBuilder { model, eos_id }
    }

    pub fn model(&self) -> &Model {
        &self.model
    }

    /// The end-of-turn token's id (`<|im_end|>`), when the template names one the tokenizer has.
    pub fn eos_id(&self) -> Option<u32> {
        self.eos_id
    }

    /// The prompt for `messages` (template form) and `tools`. `history` holds the session's
    /// recent calls, most recent first; the first one this request extends is reused.
    pub fn prompt(
        &self,
        messages: &[Value],
        tools: Option<&[Value]>,
        history: &[Arc<Turn>],
    ) -> Result<Prompt, TemplateError> {
        self.prompt_with(messages, tools, history, &self.model.extra)
    }

    /// [`PromptBuilder::prompt`] with the template's extra variables given for this call
    /// (`enable_thinking`, ...: a request's `chat_template_kwargs` over the model's own). An
    /// earlier call is reused whatever variables it was rendered with: its ids are what the
    /// policy saw and sampled; the new part and the generation prompt follow these.
    pub fn prompt_with(
        &self,
        messages: &[Value],
        tools: Option<&[Value]>,
        history: &[Arc<Turn>],
        kwargs: &Map<String, Value>,
    ) -> Result<Prompt, TemplateError> {
        for turn in history {
            if let Some(new) = extension(turn, messages, tools)
                && let Some(p) = self.extend(turn, new, tools, kwargs)?
            {
                return Ok(p);
            }
        }
        self.full_with(messages, tools, kwargs)
    }

    /// The whole conversation, rendered and tokenized.
    pub fn full(
        &self,
        messages: &[Value],
        tools: Option<&[Value]>,
    ) -> Result<Prompt, TemplateError> {
        self.full_with(messages, tools, &self.model.extra)
    }

    fn full_with(
        &self,
        messages: &[Value],
        tools: Option<&[Value]>,
        kwargs: &Map<String, Value>,
    ) -> Result<Prompt, TemplateError> {
        let text = self.model.template.render(messages, tools, true, kwargs)?;
        Ok(Prompt {
            ids: self.model.tokenizer.encode(&text)?,
            kind: PromptKind::Full,
            starts_in_reasoning: opens_reasoning(&text),
        })
    }

    /// `turn`'s tokens, the end-of-turn token when its completion stopped without one, and
    /// the new messages rendered and tokenized. `None` when the template gives no usable cut.
    fn extend(
        &self,
        turn: &Turn,
        new: &[Value],
        tools: Option<&[Value]>,
        kwargs: &Map<String, Value>,
    ) -> Result<Option<Prompt>, TemplateError> {
        let Some(tail) = self.new_part(new, tools, kwargs)? else {
            return Ok(None);
        };
        let mut ids = Vec::with_capacity(turn.tokens.len() + tail.len() / 3 + 2);
        ids.extend_from_slice(&turn.tokens);
        if let Some(eos) = self.eos_id
            && turn.tokens.last() != Some(&eos)
        {
            // Cut off by max_tokens (or a stop string): the template closes the turn.
            ids.push(eos);
        }
        let reused = turn.tokens.len();
        ids.extend(self.model.tokenizer.encode(&tail)?);
        Ok(Some(Prompt {
            ids,
            kind: PromptKind::Reused { reused },
            starts_in_reasoning: opens_reasoning(&tail),
        }))
    }

    /// The text the template writes for `new` messages and the generation prompt after an
    /// assistant turn, found by rendering them after a stand-in history.
    fn new_part(
        &self,
        new: &[Value],
        tools: Option<&[Value]>,
        kwargs: &Map<String, Value>,
    ) -> Result<Option<String>, TemplateError> {
        let Some(eos) = self.model.template.eos_token().filter(|e| !e.is_empty()) else {
            return Ok(None);
        };
        let mut msgs = Vec::with_capacity(new.len() + 2);
        msgs.push(json!({"role": "user", "content": "graft"}));
        msgs.push(json!({"role": "assistant", "content": SENTINEL}));
        msgs.extend(new.iter().cloned());
        let text = self.model.template.render(&msgs, tools, true, kwargs)?;
        let Some(at) = text.find(SENTINEL) else {
            return Ok(None);
        };
        let after = at + SENTINEL.len();
        let Some(end) = text[after..].find(eos) else {
            return Ok(None);
        };
        Ok(Some(text[after + end + eos.len()..].to_string()))
    }
}

/// Whether a rendered prompt ends inside an open `<think>`.
fn opens_reasoning(text: &str) -> bool {
    text.trim_end_matches('\n').ends_with("<think>")
}

/// The new messages of a request that extends `turn` (its messages, then its answer), or
/// `None` when it does not.
fn extension<'a>(
    turn: &Turn,
    messages: &'a [Value],
    tools: Option<&[Value]>,
) -> Option<&'a [Value]> {
    let n = turn.messages.len();
    if messages.len() < n + 2 || turn.tools.as_deref() != tools {
        return None;
    }
    let same_history = turn
        .messages
        .iter()
        .zip(messages)
        .all(|(a, b)| same_message(a, b));
    (same_history && same_message(&turn.answer, &messages[n])).then(|| &messages[n + 1..])
}

/// Messages in the form templates take (see [`crate::retokenize::template_message`]).
pub fn template_messages(messages: &[Value]) -> Vec<Value> {
    messages
        .iter()
        .map(crate::retokenize::template_message)
        .collect()
}

/// Whether two template-form messages say the same thing, as far as a client echoing an
/// answer back is concerned: same role, text (an assistant's trimmed), tool calls (names, and
/// arguments as JSON values: harnesses re-serialize them), tool call id and name. Reasoning
/// is not compared: most clients drop it when they echo a turn back.
pub fn same_message(a: &Value, b: &Value) -> bool {
    let role = |m: &Value| {
        m.get("role")
            .and_then(Value::as_str)
            .unwrap_or("")
            .to_string()
    };
    if role(a) != role(b) {
        return false;
    }
    let assistant = role(a) == "assistant";
    match (
        content_text(a.get("content")),
        content_text(b.get("content")),
    ) {
        (Some(x), Some(y)) => {
            let same = if assistant {
                x.trim() == y.trim()
            } else {
                x == y
            };
            if !same {
                return false;
            }
        }
        // Images or other parts: compare as sent.
        _ => {
            if a.get("content") != b.get("content") {
                return false;
            }
        }
    }
    let field = |m: &Value, k: &str| m.get(k).filter(|v| !v.is_null()).cloned();
    if field(a, "tool_call_id") != field(b, "tool_call_id") || field(a, "name") != field(b, "name")
    {
        return false;
    }
    let calls = |m: &Value| {
        m.get("tool_calls")
            .and_then(Value::as_array)
            .cloned()
            .unwrap_or_default()
    };
    let (ca, cb) = (calls(a), calls(b));
    ca.len() == cb.len() && ca.iter().zip(&cb).all(|(x, y)| same_call(x, y))
}

fn same_call(a: &Value, b: &Value) -> bool {
    let f = |c: &Value| c.get("function").cloned().unwrap_or_else(|| c.clone());
    let (fa, fb) = (f(a), f(b));
    if fa.get("name") != fb.get("name") {
        return false;
    }
    let args = |v: &Value| match v.get("arguments") {
        Some(Value::String(s)) => serde_json::from_str::<Value>(s).unwrap_or_else(|_| json!(s)),
        Some(other) => other.clone(),
        None => json!({}),
    };
    args(&fa) == args(&fb)
}

/// A message's text when its content is a string, `null`, or text parts only.
fn content_text(c: Option<&Value>) -> Option<String> {
    match c {
        None | Some(Value::Null) => Some(String::new()),
        Some(Value::String(s)) => Some(s.clone()),
        Some(Value::Array(parts)) => {
            let mut s = String::new();
            for p in parts {
                match (p.get("type").and_then(Value::as_str), p.get("text")) {
                    (Some("text"), Some(Value::String(t))) => s.push_str(t),
                    _ => return None,
                }
            }
            Some(s)
        }
        Some(_) => None,
    }
}

/// An answer as the assistant message a client would echo back (template form).
pub fn answer_message(
    text: &str,
    reasoning: Option<&str>,
    tool_calls: &[(String, String, String)],
) -> Value {
    let mut m = Map::new();
    m.insert("role".into(), json!("assistant"));
    m.insert("content".into(), json!(text));
    if let Some(r) = reasoning {
        m.insert("reasoning_content".into(), json!(r));
    }
    if !tool_calls.is_empty() {
        m.insert(
            "tool_calls".into(),
            Value::Array(
                tool_calls
                    .iter()
                    .map(|(id, name, args)| {
                        json!({"id": id, "type": "function", "function": {"name": name, "arguments": args}})
                    })
                    .collect(),
            ),
        );
    }
    Value::Object(m)
}

/// Incremental detokenization: completion ids in, the text they certainly stand for out.
/// A token that ends inside a multi-byte character (byte-level BPE) is held back until the
/// character is complete. Special tokens are skipped, as a client sees the text.
#[derive(Debug, Default, Clone)]
pub struct Detokenizer {
    ids: Vec<u32>,
    prefix_offset: usize,
    read_offset: usize,
    /// Special tokens written out ([`crate::template::Tokenizer::decode_visible_keeping`]).
    keep: Vec<u32>,
}

impl Detokenizer {
    pub fn new() -> Self {
        Self::default()
    }

    /// A detokenizer that writes out the special tokens `keep` (all others are skipped).
    pub fn keeping(keep: Vec<u32>) -> Self {
        Self {
            keep,
            ..Self::default()
        }
    }

    /// All ids pushed so far.
    pub fn ids(&self) -> &[u32] {
        &self.ids
    }

    /// Adds ids; returns the text that is now certain.
    pub fn push(
        &mut self,
        tok: &crate::template::Tokenizer,
        ids: &[u32],
    ) -> Result<String, TemplateError> {
        self.ids.extend_from_slice(ids);
        self.emit(tok, false)
    }

    /// End of the completion: whatever is held back, replacement characters included.
    pub fn finish(&mut self, tok: &crate::template::Tokenizer) -> Result<String, TemplateError> {
        self.emit(tok, true)
    }

    fn emit(
        &mut self,
        tok: &crate::template::Tokenizer,
        last: bool,
    ) -> Result<String, TemplateError> {
        if self.read_offset >= self.ids.len() {
            return Ok(String::new());
        }
        let before = tok
            .decode_visible_keeping(&self.ids[self.prefix_offset..self.read_offset], &self.keep)?;
        let now = tok.decode_visible_keeping(&self.ids[self.prefix_offset..], &self.keep)?;
        if !last && now.ends_with('\u{FFFD}') {
            return Ok(String::new());
        }
        let out = match now.get(before.len()..) {
            Some(s) if now.starts_with(&before) => s.to_string(),
            // Decoding in context changed earlier text (rare with byte-level BPE): emit the
            // part after the common prefix.
            _ => {
                let common = now
                    .char_indices()
                    .zip(before.chars())
                    .take_while(|((_, a), b)| a == b)
                    .last()
                    .map_or(0, |((i, c), _)| i + c.len_utf8());
                now[common..].to_string()
            }
        };
        self.prefix_offset = self.read_offset;
        self.read_offset = self.ids.len();
        Ok(out)
    }
}

//! Records without token ids (a passthrough upstream that returned none) re-tokenized with
//! the model's own chat template and tokenizer, so they merge like exact ones; and foreign
//! OpenAI-format conversation logs turned into SFT-style calls. Re-tokenization is an
//! approximation of what the policy saw: the merge detects and classifies every place where
//! a call's prompt does not extend its predecessor (template drift), it is never silent.

use std::path::Path;

use graft_recorder::CallRecord;
use serde_json::{Map, Value, json};

use crate::merge::CallTokens;
use crate::template::{ChatTemplate, TemplateError, Tokenizer};

/// A model's template and tokenizer, loaded from its HF directory.
pub struct Model {
    pub template: ChatTemplate,
    pub tokenizer: Tokenizer,
    /// Extra template variables (e.g. `enable_thinking`).
    pub extra: Map<String, Value>,
}

/// Why a call could not be re-tokenized (it is skipped and counted, never guessed).
#[derive(Debug, Clone, PartialEq)]
pub enum Skip {
    /// Not a chat call (legacy completions, models listing).
    NotChat,
    /// The call failed; there is no answer to train on.
    Failed,
    /// The template's rendering of the answer does not extend the rendered prompt.
    AnswerDoesNotExtendPrompt,
    /// The template failed; its own error text.
    Template(String),
    /// The call holds something a text-only template cannot render (an image, audio, a
    /// file, an unknown content part); says what and where.
    Unsupported(String),
}

impl std::fmt::Display for Skip {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Skip::NotChat => f.write_str("not a chat call"),
            Skip::Failed => f.write_str("failed call"),
            Skip::AnswerDoesNotExtendPrompt => {
                f.write_str("answer does not extend the rendered prompt")
            }
            Skip::Template(e) => write!(f, "template error: {e}"),
            Skip::Unsupported(why) => f.write_str(why),
        }
    }
}

impl Model {
    pub fn from_dir(dir: &Path) -> Result<Self, TemplateError> {
        Ok(Model {
            template: ChatTemplate::from_dir(dir)?,
            tokenizer: Tokenizer::from_dir(dir)?,
            extra: Map::new(),
        })
    }

    /// (tokenizer, template) fingerprints, as samples carry them.
    pub fn fingerprints(&self) -> (String, String) {
        (self.tokenizer.fingerprint(), self.template.fingerprint())
    }

    /// Renders and tokenizes one exchange: `messages` (+ `tools`) as the prompt with the
    /// generation prompt, and `answer` as the completion: the text the template adds for it,
    /// up to and including the end-of-turn token (what follows it is template glue).
    pub fn exchange(
        &self,
        messages: &[Value],
        tools: Option<&[Value]>,
        answer: &Value,
    ) -> Result<(Vec<u32>, Vec<u32>), Skip> {
        renderable(messages)?;
        renderable(std::slice::from_ref(answer))?;
        let messages: Vec<Value> = messages.iter().map(template_message).collect();
        let prompt = self
            .template
            .render(&messages, tools, true, &self.extra)
            .map_err(|e| Skip::Template(e.to_string()))?;
        let mut all = messages;
        all.push(template_message(answer));
        let full = self
            .template
            .render(&all, tools, false, &self.extra)
            .map_err(|e| Skip::Template(e.to_string()))?;
        let Some(mut completion) = full.strip_prefix(&prompt).map(str::to_string) else {
            return Err(Skip::AnswerDoesNotExtendPrompt);
        };
        match self
            .template
            .eos_token()
            .filter(|e| !e.is_empty())
            .and_then(|eos| completion.rfind(eos).map(|at| at + eos.len()))
        {
            Some(end) => completion.truncate(end),
            // No end-of-sequence token in the turn: the newline the template puts after
            // a turn is glue, not something the model sampled.
            None => completion.truncate(completion.trim_end_matches('\n').len()),
        }
        let p = self
            .tokenizer
            .encode(&prompt)
            .map_err(|e| Skip::Template(e.to_string()))?;
        let c = self
            .tokenizer
            .encode(&completion)
            .map_err(|e| Skip::Template(e.to_string()))?;
        Ok((p, c))
    }

    /// A text-only record as tokens: the Chat conversation that reached the model (the
    /// translated upstream request when graft translated, else the client's) and its answer.
    pub fn record_tokens(&self, rec: &CallRecord) -> Result<CallTokens, Skip> {
        if !rec.is_ok() {
            return Err(Skip::Failed);
        }
        let (messages, tools, answer) = chat_view(rec).ok_or(Skip::NotChat)?;
        let (prompt_ids, completion_ids) = self.exchange(&messages, tools.as_deref(), &answer)?;
        Ok(CallTokens {
            call_id: rec.call_id.clone(),
            seq: rec.seq,
            prompt_ids,
            completion_ids,
            completion_logprobs: None,
            logprob_kind: Default::default(),
            weight_version: rec.weight_version.clone(),
            weight_version_spans: rec.weight_version_spans.clone(),
            finish_reason: rec.finish_reason.clone(),
            root: crate::merge::conversation_root(rec),
            reward: None,
            thread: None,
            view: None,
        }
        .with_view(crate::threads::call_view(rec)))
    }
}

/// Content part types that carry text (`{"type": ..., "text": "..."}`).
const TEXT_PARTS: [&str; 3] = ["text", "input_text", "output_text"];

/// The text of content parts that are all text, joined with `\n` (as vLLM joins them for
/// a template that takes string content); `None` when a part is something else.
fn text_of_parts(parts: &[Value]) -> Option<String> {
    let texts: Option<Vec<&str>> = parts
        .iter()
        .map(|p| match p {
            Value::String(s) => Some(s.as_str()),
            _ if p
                .get("type")
                .and_then(Value::as_str)
                .is_some_and(|t| TEXT_PARTS.contains(&t)) =>
            {
                p.get("text").and_then(Value::as_str)
            }
            _ => None,
        })
        .collect();
    Some(texts?.join("\n"))
}

/// A message in the form templates take. HF templates expect `content` to be a string:
/// OpenAI clients send `null` next to `tool_calls`, which the Qwen3 template (like HF
/// itself) cannot render, so a missing or `null` content becomes `""`; content sent as an
/// array of text parts (OpenHands, the OpenAI SDKs' typed messages) becomes its text
/// (Qwen3's template would otherwise render such content as nothing). Other parts are left
/// as they are ([`renderable`] refuses them before rendering).
pub fn template_message(m: &Value) -> Value {
    let mut m = m.clone();
    if let Some(o) = m.as_object_mut() {
        match o.get("content") {
            None | Some(Value::Null) => {
                o.insert("content".into(), json!(""));
            }
            Some(Value::Array(parts)) => {
                if let Some(text) = text_of_parts(parts) {
                    o.insert("content".into(), json!(text));
                }
            }
            _ => {}
        }
    }
    m
}

/// Whether a text-only template can render these messages: every content is a string,
/// null, or text parts. Otherwise says which message holds what.
pub fn renderable(messages: &[Value]) -> Result<(), Skip> {
    for (i, m) in messages.iter().enumerate() {
        let Some(Value::Array(parts)) = m.get("content") else {
            continue;
        };
        if text_of_parts(parts).is_some() {
            continue;
        }
        let role = m.get("role").and_then(Value::as_str).unwrap_or("?");
        let what = parts
            .iter()
            .find_map(|p| match p.get("type").and_then(Value::as_str) {
                Some(t) if TEXT_PARTS.contains(&t) => None,
                Some("image_url" | "input_image" | "image") => Some("an image".to_string()),
                Some("input_audio" | "audio") => Some("audio".to_string()),
                Some("file" | "input_file") => Some("a file".to_string()),
                Some(t) => Some(format!("a '{t}' part")),
                None => Some("a part without a type".to_string()),
            })
            .unwrap_or_else(|| "a part without text".to_string());
        return Err(Skip::Unsupported(format!(
            "message {i} ({role}) holds {what}: the model's chat template renders text only, so the call cannot be re-tokenized (record token ids: exact mode, or upstream.token_ids)"
        )));
    }
    Ok(())
}

/// The Chat-form messages, tools and assistant answer of a record.
pub fn chat_view(rec: &CallRecord) -> Option<(Vec<Value>, Option<Vec<Value>>, Value)> {
    let req = match (&rec.upstream_request, rec.dialect.as_str()) {
        (Some(up), _)
            if rec.upstream_dialect.as_deref() == Some(graft_recorder::wire::CHAT_COMPLETIONS) =>
        {
            up
        }
        (None, "chat_completions") => &rec.request,
        _ => return None,
    };
    let messages = req.get("messages")?.as_array()?.clone();
    let tools = req
        .get("tools")
        .and_then(Value::as_array)
        .filter(|t| !t.is_empty())
        .cloned();
    let answer = match &rec.normalized_response {
        Some(a) => {
            let mut m = Map::new();
            m.insert("role".into(), json!("assistant"));
            m.insert(
                "content".into(),
                a.get("text").cloned().unwrap_or(json!("")),
            );
            if let Some(r) = a.get("reasoning").filter(|r| r.is_string()) {
                m.insert("reasoning_content".into(), r.clone());
            }
            let calls: Vec<Value> = a
                .get("tool_calls")
                .and_then(Value::as_array)
                .map(|c| {
                    c.iter()
                        .map(|t| json!({"id": t["id"], "type": "function", "function": {"name": t["name"], "arguments": t["arguments"]}}))
                        .collect()
                })
                .unwrap_or_default();
            if !calls.is_empty() {
                m.insert("tool_calls".into(), Value::Array(calls));
            }
            Value::Object(m)
        }
        None => rec
            .response
            .as_ref()?
            .pointer("/choices/0/message")?
            .clone(),
    };
    Some((messages, tools, answer))
}

/// An OpenAI-format conversation (a line of a JSONL log: `{"messages": [...], "tools": [...]}`)
/// as calls: one per assistant turn, its prompt everything before it. Logprobs are unknown
/// (SFT-style samples).
pub fn conversation_calls(model: &Model, id: &str, conv: &Value) -> Result<Vec<CallTokens>, Skip> {
    let messages = conv
        .get("messages")
        .and_then(Value::as_array)
        .ok_or(Skip::NotChat)?;
    let tools = conv
        .get("tools")
        .and_then(Value::as_array)
        .filter(|t| !t.is_empty());
    let mut out = vec![];
    for (i, m) in messages.iter().enumerate() {
        if m.get("role").and_then(Value::as_str) != Some("assistant") {
            continue;
        }
        let (prompt_ids, completion_ids) =
            model.exchange(&messages[..i], tools.map(Vec::as_slice), m)?;
        out.push(CallTokens {
            call_id: format!("{id}#{i}"),
            seq: i as u64,
            prompt_ids,
            completion_ids,
            completion_logprobs: None,
            logprob_kind: Default::default(),
            weight_version: None,
            weight_version_spans: None,
            finish_reason: None,
            root: None,
            reward: None,
            thread: None,
            view: None,
        });
    }
    Ok(out)
}

//! Rebuilding whole answers from relayed Chat Completions (and legacy Completions) streams:
//! the [`Assembler`] behind the passthrough tee, and the [`ChunkReader`] that also yields
//! each chunk's deltas (translation reads a Chat upstream with it).

use serde_json::{Map, Value, json};

use super::render::parse_answer;
use crate::dialect::{Answer, Delta, Finish, StreamAssembler};
use crate::sse::Event;

/// Rebuilds a `chat.completion` (or `text_completion`) object from its streamed chunks.
#[derive(Debug, Default)]
pub struct Assembler {
    top: Map<String, Value>,
    choices: Vec<ChoiceAcc>,
    usage: Option<Value>,
    completions: bool,
    pub chunks: u64,
}

#[derive(Debug, Default)]
struct ChoiceAcc {
    role: Option<String>,
    content: Option<String>,
    reasoning: Option<String>,
    text: Option<String>,
    refusal: Option<String>,
    tool_calls: Vec<ToolAcc>,
    finish_reason: Option<Value>,
    logprobs: Vec<Value>,
    token_logprobs: Option<Value>,
    extra_message: Map<String, Value>,
}

#[derive(Debug, Default)]
struct ToolAcc {
    id: Option<String>,
    kind: Option<String>,
    name: Option<String>,
    arguments: String,
}

impl Assembler {
    pub fn chat() -> Self {
        Assembler::default()
    }

    pub fn completions() -> Self {
        Assembler {
            completions: true,
            ..Default::default()
        }
    }

    /// Adds one parsed chunk (`chat.completion.chunk` or `text_completion`).
    pub fn push(&mut self, chunk: &Value) {
        self.chunks += 1;
        let Some(obj) = chunk.as_object() else { return };
        for (k, v) in obj {
            match k.as_str() {
                "choices" | "usage" | "object" => {}
                _ => {
                    if !v.is_null() || !self.top.contains_key(k) {
                        self.top.insert(k.clone(), v.clone());
                    }
                }
            }
        }
        if let Some(u) = obj.get("usage").filter(|u| !u.is_null()) {
            self.usage = Some(u.clone());
        }
        let Some(choices) = obj.get("choices").and_then(Value::as_array) else {
            return;
        };
        for c in choices {
            let idx = c.get("index").and_then(Value::as_u64).unwrap_or(0) as usize;
            if idx > 1024 {
                continue;
            }
            if self.choices.len() <= idx {
                self.choices.resize_with(idx + 1, ChoiceAcc::default);
            }
            let acc = &mut self.choices[idx];
            if let Some(fr) = c.get("finish_reason").filter(|f| !f.is_null()) {
                acc.finish_reason = Some(fr.clone());
            }
            if let Some(t) = c.get("text").and_then(Value::as_str) {
                acc.text.get_or_insert_with(String::new).push_str(t);
            }
            if let Some(lp) = c.get("logprobs").filter(|l| !l.is_null()) {
                if let Some(content) = lp.get("content").and_then(Value::as_array) {
                    acc.logprobs.extend(content.iter().cloned());
                } else {
                    acc.token_logprobs =
                        Some(merge_completion_logprobs(acc.token_logprobs.take(), lp));
                }
            }
            let Some(delta) = c.get("delta").and_then(Value::as_object) else {
                continue;
            };
            for (k, v) in delta {
                match k.as_str() {
                    "role" => {
                        if let Some(r) = v.as_str() {
                            acc.role = Some(r.to_string());
                        }
                    }
                    "content" => {
                        if let Some(s) = v.as_str() {
                            acc.content.get_or_insert_with(String::new).push_str(s);
                        }
                    }
                    "reasoning_content" | "reasoning" => {
                        if let Some(s) = v.as_str() {
                            acc.reasoning.get_or_insert_with(String::new).push_str(s);
                        }
                    }
                    "refusal" => {
                        if let Some(s) = v.as_str() {
                            acc.refusal.get_or_insert_with(String::new).push_str(s);
                        }
                    }
                    "tool_calls" => {
                        for tc in v.as_array().map(Vec::as_slice).unwrap_or(&[]) {
                            let ti = tc.get("index").and_then(Value::as_u64).unwrap_or(0) as usize;
                            if ti > 1024 {
                                continue;
                            }
                            if acc.tool_calls.len() <= ti {
                                acc.tool_calls.resize_with(ti + 1, ToolAcc::default);
                            }
                            let t = &mut acc.tool_calls[ti];
                            if let Some(id) = tc.get("id").and_then(Value::as_str) {
                                t.id = Some(id.to_string());
                            }
                            if let Some(ty) = tc.get("type").and_then(Value::as_str) {
                                t.kind = Some(ty.to_string());
                            }
                            if let Some(f) = tc.get("function") {
                                if let Some(n) = f.get("name").and_then(Value::as_str) {
                                    t.name.get_or_insert_with(String::new).push_str(n);
                                }
                                if let Some(a) = f.get("arguments").and_then(Value::as_str) {
                                    t.arguments.push_str(a);
                                }
                            }
                        }
                    }
                    _ => {
                        if !v.is_null() {
                            acc.extra_message.insert(k.clone(), v.clone());
                        }
                    }
                }
            }
        }
    }

    pub fn usage(&self) -> Option<&Value> {
        self.usage.as_ref()
    }

    pub fn finish_reason(&self) -> Option<String> {
        self.choices
            .first()
            .and_then(|c| c.finish_reason.as_ref())
            .and_then(Value::as_str)
            .map(str::to_string)
    }

    /// The full response as the non-streaming endpoint would have returned it.
    pub fn finish(&self) -> Value {
        let mut out = self.top.clone();
        out.insert(
            "object".into(),
            json!(if self.completions {
                "text_completion"
            } else {
                "chat.completion"
            }),
        );
        let choices: Vec<Value> = self
            .choices
            .iter()
            .enumerate()
            .map(|(i, c)| {
                let mut choice = Map::new();
                choice.insert("index".into(), json!(i));
                if self.completions {
                    choice.insert("text".into(), json!(c.text.clone().unwrap_or_default()));
                    if let Some(lp) = &c.token_logprobs {
                        choice.insert("logprobs".into(), lp.clone());
                    }
                } else {
                    let mut msg = Map::new();
                    msg.insert(
                        "role".into(),
                        json!(c.role.clone().unwrap_or_else(|| "assistant".into())),
                    );
                    msg.insert("content".into(), json!(c.content));
                    if let Some(r) = &c.reasoning {
                        msg.insert("reasoning_content".into(), json!(r));
                    }
                    if let Some(r) = &c.refusal {
                        msg.insert("refusal".into(), json!(r));
                    }
                    if !c.tool_calls.is_empty() {
                        let tcs: Vec<Value> = c
                            .tool_calls
                            .iter()
                            .map(|t| {
                                json!({
                                    "id": t.id,
                                    "type": t.kind.clone().unwrap_or_else(|| "function".into()),
                                    "function": {"name": t.name, "arguments": t.arguments},
                                })
                            })
                            .collect();
                        msg.insert("tool_calls".into(), Value::Array(tcs));
                    }
                    for (k, v) in &c.extra_message {
                        msg.insert(k.clone(), v.clone());
                    }
                    choice.insert("message".into(), Value::Object(msg));
                    if !c.logprobs.is_empty() {
                        choice.insert("logprobs".into(), json!({"content": c.logprobs}));
                    }
                }
                choice.insert(
                    "finish_reason".into(),
                    c.finish_reason.clone().unwrap_or(Value::Null),
                );
                Value::Object(choice)
            })
            .collect();
        out.insert("choices".into(), Value::Array(choices));
        if let Some(u) = &self.usage {
            out.insert("usage".into(), u.clone());
        }
        Value::Object(out)
    }
}

/// The passthrough tee of Chat Completions and Completions streams: they end with `data: [DONE]`.
impl StreamAssembler for Assembler {
    fn push(&mut self, event: &Value) {
        Assembler::push(self, event);
    }

    fn is_terminal(&self, ev: &Event, _parsed: Option<&Value>) -> bool {
        ev.is_done()
    }

    fn finish(&self) -> Option<Value> {
        (self.chunks > 0).then(|| Assembler::finish(self))
    }

    fn finish_reason(&self, _response: Option<&Value>) -> Option<String> {
        Assembler::finish_reason(self)
    }
}

/// Legacy completions logprobs arrive as parallel arrays per chunk: concatenate them.
fn merge_completion_logprobs(prev: Option<Value>, next: &Value) -> Value {
    let Some(mut prev) = prev else {
        return next.clone();
    };
    if let (Some(p), Some(n)) = (prev.as_object_mut(), next.as_object()) {
        for (k, v) in n {
            match (p.get_mut(k), v) {
                (Some(Value::Array(a)), Value::Array(b)) => a.extend(b.iter().cloned()),
                _ => {
                    p.insert(k.clone(), v.clone());
                }
            }
        }
    }
    prev
}

/// Reads a Chat Completions stream chunk by chunk: yields deltas as they arrive and
/// assembles the whole answer (choice 0) at the end.
#[derive(Default)]
pub struct ChunkReader {
    asm: Assembler,
    /// chat tool-call index → our index, in start order.
    started: Vec<(u64, usize)>,
}

impl ChunkReader {
    pub fn new() -> Self {
        ChunkReader {
            asm: Assembler::chat(),
            started: vec![],
        }
    }

    pub fn push(&mut self, chunk: &Value) -> Vec<Delta> {
        self.asm.push(chunk);
        let mut out = vec![];
        let Some(delta) = chunk.pointer("/choices/0/delta") else {
            return out;
        };
        if let Some(r) = delta
            .get("reasoning_content")
            .or_else(|| delta.get("reasoning"))
            .and_then(Value::as_str)
            && !r.is_empty()
        {
            out.push(Delta::Reasoning(r.to_string()));
        }
        if let Some(t) = delta.get("content").and_then(Value::as_str)
            && !t.is_empty()
        {
            out.push(Delta::Text(t.to_string()));
        }
        for tc in delta
            .get("tool_calls")
            .and_then(Value::as_array)
            .map(Vec::as_slice)
            .unwrap_or(&[])
        {
            let chat_index = tc.get("index").and_then(Value::as_u64).unwrap_or(0);
            let index = match self.started.iter().find(|(c, _)| *c == chat_index) {
                Some((_, i)) => *i,
                None => {
                    let i = self.started.len();
                    self.started.push((chat_index, i));
                    out.push(Delta::ToolCallStart {
                        index: i,
                        id: tc
                            .get("id")
                            .and_then(Value::as_str)
                            .map(str::to_string)
                            .unwrap_or_else(|| crate::dialect::new_id("call_")),
                        name: tc
                            .pointer("/function/name")
                            .and_then(Value::as_str)
                            .unwrap_or_default()
                            .to_string(),
                    });
                    i
                }
            };
            if let Some(a) = tc.pointer("/function/arguments").and_then(Value::as_str)
                && !a.is_empty()
            {
                out.push(Delta::ToolCallArgs {
                    index,
                    arguments: a.to_string(),
                });
            }
        }
        out
    }

    pub fn chunks(&self) -> u64 {
        self.asm.chunks
    }

    /// The whole answer so far, ids of tool calls as first streamed.
    pub fn answer(&self) -> Answer {
        let mut a = parse_answer(&self.asm.finish()).unwrap_or_else(|_| Answer {
            id: crate::dialect::new_id("chatcmpl-"),
            model: String::new(),
            created: 0,
            text: String::new(),
            reasoning: None,
            tool_calls: vec![],
            finish: Finish::Error,
            usage: None,
            logprobs: None,
        });
        // Tool calls in start order (the chat indexes may be sparse).
        let mut ordered = Vec::with_capacity(self.started.len());
        for (chat_index, _) in &self.started {
            if let Some(tc) = a.tool_calls.get(*chat_index as usize) {
                ordered.push(tc.clone());
            }
        }
        if ordered.len() == a.tool_calls.len() {
            a.tool_calls = ordered;
        }
        a
    }
}

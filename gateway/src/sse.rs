//! Server-sent events: an incremental splitter that yields whole events as their bytes
//! arrive, and assemblers that rebuild the full response from streamed chunks (the tee).

use bytes::{Bytes, BytesMut};
use serde_json::{Map, Value, json};

/// One complete SSE event: its raw bytes (relayed unchanged) and its joined `data:` payload.
#[derive(Debug, Clone, PartialEq)]
pub struct Event {
    pub raw: Bytes,
    pub data: Option<String>,
}

impl Event {
    pub fn is_done(&self) -> bool {
        self.data.as_deref().map(str::trim) == Some("[DONE]")
    }
}

/// Splits a byte stream into SSE events. Holds at most one unfinished event.
#[derive(Debug, Default)]
pub struct Splitter {
    buf: BytesMut,
    scanned: usize,
}

#[derive(Debug, thiserror::Error, PartialEq)]
pub enum SseError {
    #[error("an SSE event grew past {0} bytes without ending")]
    EventTooLarge(usize),
    #[error("an SSE event is not valid UTF-8")]
    InvalidUtf8,
}

impl Splitter {
    pub fn push(&mut self, chunk: &[u8]) {
        self.buf.extend_from_slice(chunk);
    }

    /// Bytes buffered but not yet part of a complete event.
    pub fn pending(&self) -> usize {
        self.buf.len()
    }

    /// The next complete event, if its terminating blank line has arrived.
    pub fn next_event(&mut self, max_event: usize) -> Result<Option<Event>, SseError> {
        let start = self.scanned.saturating_sub(3);
        let found = find_blank_line(&self.buf[start..]).map(|(i, len)| (start + i, len));
        match found {
            None => {
                self.scanned = self.buf.len();
                if self.buf.len() > max_event {
                    return Err(SseError::EventTooLarge(max_event));
                }
                Ok(None)
            }
            Some((at, len)) => {
                let raw = self.buf.split_to(at + len).freeze();
                self.scanned = 0;
                let text = std::str::from_utf8(&raw[..at]).map_err(|_| SseError::InvalidUtf8)?;
                Ok(Some(Event {
                    data: parse_data(text),
                    raw,
                }))
            }
        }
    }

    /// What is left when the stream ends (an event with no terminating blank line).
    pub fn finish(&mut self) -> Option<Event> {
        if self.buf.iter().all(|b| b.is_ascii_whitespace()) {
            self.buf.clear();
            return None;
        }
        let raw = std::mem::take(&mut self.buf).freeze();
        let text = String::from_utf8_lossy(&raw).to_string();
        Some(Event {
            data: parse_data(&text),
            raw,
        })
    }
}

fn find_blank_line(b: &[u8]) -> Option<(usize, usize)> {
    let mut i = 0;
    while i + 1 < b.len() {
        if b[i] == b'\n' && b[i + 1] == b'\n' {
            return Some((i, 2));
        }
        if b[i] == b'\r' && i + 3 < b.len() && &b[i..i + 4] == b"\r\n\r\n" {
            return Some((i, 4));
        }
        if b[i] == b'\r' && b[i + 1] == b'\r' {
            return Some((i, 2));
        }
        i += 1;
    }
    None
}

fn parse_data(text: &str) -> Option<String> {
    let mut data: Option<String> = None;
    for line in text.lines() {
        let Some(rest) = line.strip_prefix("data:") else {
            continue;
        };
        let rest = rest.strip_prefix(' ').unwrap_or(rest);
        match &mut data {
            Some(d) => {
                d.push('\n');
                d.push_str(rest);
            }
            None => data = Some(rest.to_string()),
        }
    }
    data
}

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

#[cfg(test)]
mod tests {
    use super::*;

    fn drain(s: &mut Splitter) -> Vec<Event> {
        let mut out = vec![];
        while let Some(e) = s.next_event(1 << 20).unwrap() {
            out.push(e);
        }
        out
    }

    #[test]
    fn splits_events_across_arbitrary_chunk_boundaries() {
        let stream = b"data: {\"a\":1}\n\ndata: {\"b\":2}\r\n\r\n: comment\ndata: x\ndata: y\n\ndata: [DONE]\n\n";
        for cut in 1..stream.len() {
            let mut s = Splitter::default();
            s.push(&stream[..cut]);
            let mut evs = drain(&mut s);
            s.push(&stream[cut..]);
            evs.extend(drain(&mut s));
            let datas: Vec<_> = evs.iter().map(|e| e.data.clone().unwrap()).collect();
            assert_eq!(
                datas,
                vec!["{\"a\":1}", "{\"b\":2}", "x\ny", "[DONE]"],
                "cut at {cut}"
            );
            let raw: Vec<u8> = evs.iter().flat_map(|e| e.raw.to_vec()).collect();
            assert_eq!(raw, stream.to_vec(), "raw bytes relayed unchanged");
            assert!(evs[3].is_done());
        }
    }

    #[test]
    fn oversized_event_is_an_error() {
        let mut s = Splitter::default();
        s.push(&[b'a'; 100]);
        assert_eq!(s.next_event(10), Err(SseError::EventTooLarge(10)));
    }

    #[test]
    fn assembles_content_and_tool_call_arguments() {
        let chunks = [
            json!({"id":"c1","model":"m","created":1,"object":"chat.completion.chunk","choices":[{"index":0,"delta":{"role":"assistant","content":""}}]}),
            json!({"id":"c1","choices":[{"index":0,"delta":{"content":"Hel"}}]}),
            json!({"id":"c1","choices":[{"index":0,"delta":{"content":"lo"}}]}),
            json!({"id":"c1","choices":[{"index":0,"delta":{"tool_calls":[{"index":0,"id":"call_1","type":"function","function":{"name":"bash","arguments":""}}]}}]}),
            json!({"id":"c1","choices":[{"index":0,"delta":{"tool_calls":[{"index":0,"function":{"arguments":"{\"command\":"}}]}}]}),
            json!({"id":"c1","choices":[{"index":0,"delta":{"tool_calls":[{"index":0,"function":{"arguments":"\"ls\"}"}}]}}]}),
            json!({"id":"c1","choices":[{"index":0,"delta":{},"finish_reason":"tool_calls"}]}),
            json!({"id":"c1","choices":[],"usage":{"prompt_tokens":3,"completion_tokens":4,"total_tokens":7}}),
        ];
        let mut a = Assembler::chat();
        for c in &chunks {
            a.push(c);
        }
        let v = a.finish();
        assert_eq!(v["object"], "chat.completion");
        assert_eq!(v["model"], "m");
        assert_eq!(v["choices"][0]["message"]["content"], "Hello");
        assert_eq!(
            v["choices"][0]["message"]["tool_calls"][0]["function"]["arguments"],
            "{\"command\":\"ls\"}"
        );
        assert_eq!(v["choices"][0]["message"]["tool_calls"][0]["id"], "call_1");
        assert_eq!(v["choices"][0]["finish_reason"], "tool_calls");
        assert_eq!(v["usage"]["total_tokens"], 7);
        assert_eq!(a.finish_reason().as_deref(), Some("tool_calls"));
    }

    #[test]
    fn assembles_text_completions() {
        let mut a = Assembler::completions();
        a.push(&json!({"id":"x","object":"text_completion","choices":[{"index":0,"text":"foo "}]}));
        a.push(&json!({"id":"x","object":"text_completion","choices":[{"index":0,"text":"bar","finish_reason":"length"}]}));
        let v = a.finish();
        assert_eq!(v["choices"][0]["text"], "foo bar");
        assert_eq!(v["choices"][0]["finish_reason"], "length");
    }
}

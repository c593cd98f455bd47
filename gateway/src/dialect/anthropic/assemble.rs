//! Rebuilding the final `message` object from a relayed Anthropic stream.

use serde_json::{Map, Value, json};

use crate::dialect::StreamAssembler;
use crate::sse::Event;

/// Rebuilds the final `message` object from parsed stream events (the JSON of each `data:`
/// line), the way the Anthropic SDKs accumulate a stream.
#[derive(Debug, Default)]
pub struct AnthropicAssembler {
    message: Option<Map<String, Value>>,
    blocks: Vec<Value>,
    /// Concatenated `input_json_delta` text per block index.
    json: Vec<String>,
    stopped: bool,
    error: Option<Value>,
}

fn append_str(block: &mut Value, key: &str, piece: &str) {
    let Some(o) = block.as_object_mut() else {
        return;
    };
    match o.get_mut(key) {
        Some(Value::String(s)) => s.push_str(piece),
        _ => {
            o.insert(key.to_string(), Value::String(piece.to_string()));
        }
    }
}

impl AnthropicAssembler {
    pub fn new() -> Self {
        Self::default()
    }

    fn index(event: &Value) -> Option<usize> {
        event
            .get("index")
            .and_then(Value::as_u64)
            .and_then(|i| usize::try_from(i).ok())
    }

    pub fn push(&mut self, event: &Value) {
        match event.get("type").and_then(Value::as_str) {
            Some("message_start") => {
                let m = event
                    .get("message")
                    .and_then(Value::as_object)
                    .cloned()
                    .unwrap_or_default();
                self.blocks = m
                    .get("content")
                    .and_then(Value::as_array)
                    .cloned()
                    .unwrap_or_default();
                self.json = vec![String::new(); self.blocks.len()];
                self.message = Some(m);
            }
            Some("content_block_start") => {
                let (Some(i), Some(block)) = (Self::index(event), event.get("content_block"))
                else {
                    return;
                };
                if i >= self.blocks.len() {
                    self.blocks.resize(i + 1, Value::Null);
                    self.json.resize(i + 1, String::new());
                }
                self.blocks[i] = block.clone();
                self.json[i].clear();
            }
            Some("content_block_delta") => {
                let (Some(i), Some(delta)) = (Self::index(event), event.get("delta")) else {
                    return;
                };
                let Some(block) = self.blocks.get_mut(i) else {
                    return;
                };
                let text = |k: &str| delta.get(k).and_then(Value::as_str).unwrap_or("");
                match delta.get("type").and_then(Value::as_str) {
                    Some("text_delta") => append_str(block, "text", text("text")),
                    Some("thinking_delta") => append_str(block, "thinking", text("thinking")),
                    Some("signature_delta") => {
                        if let Some(o) = block.as_object_mut() {
                            o.insert("signature".into(), json!(text("signature")));
                        }
                    }
                    Some("input_json_delta") => {
                        if let Some(buf) = self.json.get_mut(i) {
                            buf.push_str(text("partial_json"));
                        }
                    }
                    Some("citations_delta") => {
                        if let (Some(o), Some(c)) = (block.as_object_mut(), delta.get("citation")) {
                            match o.get_mut("citations") {
                                Some(Value::Array(list)) => list.push(c.clone()),
                                _ => {
                                    o.insert("citations".into(), json!([c]));
                                }
                            }
                        }
                    }
                    _ => {}
                }
            }
            Some("message_delta") => {
                let Some(m) = self.message.as_mut() else {
                    return;
                };
                if let Some(delta) = event.get("delta").and_then(Value::as_object) {
                    for (k, v) in delta {
                        m.insert(k.clone(), v.clone());
                    }
                }
                if let Some(usage) = event.get("usage").and_then(Value::as_object) {
                    let target = m
                        .entry("usage")
                        .or_insert_with(|| Value::Object(Map::new()));
                    if !target.is_object() {
                        *target = Value::Object(Map::new());
                    }
                    if let Some(t) = target.as_object_mut() {
                        for (k, v) in usage.iter().filter(|(_, v)| !v.is_null()) {
                            t.insert(k.clone(), v.clone());
                        }
                    }
                }
            }
            Some("message_stop") => self.stopped = true,
            Some("error") => self.error = event.get("error").cloned(),
            _ => {}
        }
    }

    /// Whether `message_stop` arrived.
    pub fn is_complete(&self) -> bool {
        self.stopped
    }

    /// The `error` object of an `event: error`, if one arrived.
    pub fn error(&self) -> Option<&Value> {
        self.error.as_ref()
    }

    /// The message as accumulated so far (`None` before `message_start`). A tool_use block's
    /// `input` is its streamed JSON parsed; JSON that does not parse is kept as a string.
    pub fn finish(&self) -> Option<Value> {
        let mut m = self.message.clone()?;
        let mut content = Vec::with_capacity(self.blocks.len());
        for (i, block) in self.blocks.iter().enumerate() {
            let mut block = block.clone();
            let buf = self.json.get(i).map(String::as_str).unwrap_or("");
            if !buf.is_empty()
                && let Some(o) = block.as_object_mut()
            {
                let input = serde_json::from_str::<Value>(buf)
                    .unwrap_or_else(|_| Value::String(buf.to_string()));
                o.insert("input".into(), input);
            }
            content.push(block);
        }
        m.insert("content".into(), Value::Array(content));
        Some(Value::Object(m))
    }
}

/// An Anthropic stream's last word is `message_stop`; the finish reason is the message's
/// `stop_reason`.
impl StreamAssembler for AnthropicAssembler {
    fn push(&mut self, event: &Value) {
        AnthropicAssembler::push(self, event);
    }

    fn is_terminal(&self, _ev: &Event, parsed: Option<&Value>) -> bool {
        parsed.and_then(|v| v.get("type")).and_then(Value::as_str) == Some("message_stop")
    }

    fn finish(&self) -> Option<Value> {
        AnthropicAssembler::finish(self)
    }

    fn finish_reason(&self, response: Option<&Value>) -> Option<String> {
        response
            .and_then(|r| r.get("stop_reason"))
            .and_then(Value::as_str)
            .map(str::to_string)
    }
}

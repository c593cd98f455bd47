//! Rebuilding the final `response` object from a relayed Responses stream.

use std::collections::{BTreeMap, HashMap};

use serde_json::{Map, Value, json};

use super::render::output_text_part;
use crate::dialect::StreamAssembler;
use crate::sse::Event;

/// Rebuilds the final response object from Responses stream events (parsed JSON, in order).
#[derive(Debug, Default, Clone)]
pub struct ResponsesAssembler {
    base: Option<Value>,
    terminal: Option<Value>,
    items: BTreeMap<u64, Value>,
    ids: HashMap<String, u64>,
    error: Option<Value>,
}

fn push_str_at(v: &mut Value, key: &str, delta: &str) {
    if let Some(o) = v.as_object_mut() {
        let mut s = o
            .get(key)
            .and_then(Value::as_str)
            .unwrap_or_default()
            .to_string();
        s.push_str(delta);
        o.insert(key.into(), Value::String(s));
    }
}

/// `item[list][index]`, created (as `template`) when missing.
fn part_at<'a>(
    item: &'a mut Value,
    list: &str,
    index: usize,
    template: Value,
) -> Option<&'a mut Value> {
    let o = item.as_object_mut()?;
    let arr = o
        .entry(list.to_string())
        .or_insert_with(|| Value::Array(vec![]));
    if !arr.is_array() {
        *arr = Value::Array(vec![]);
    }
    let arr = arr.as_array_mut()?;
    while arr.len() <= index {
        arr.push(template.clone());
    }
    arr.get_mut(index)
}

impl ResponsesAssembler {
    pub fn new() -> Self {
        Self::default()
    }

    fn index_of(&self, event: &Value) -> Option<u64> {
        event
            .get("output_index")
            .and_then(Value::as_u64)
            .or_else(|| {
                event
                    .get("item_id")
                    .and_then(Value::as_str)
                    .and_then(|id| self.ids.get(id).copied())
            })
    }

    fn item_mut(&mut self, event: &Value) -> Option<&mut Value> {
        let idx = self.index_of(event)?;
        self.items.get_mut(&idx)
    }

    fn set_item(&mut self, event: &Value) {
        let Some(item) = event.get("item") else {
            return;
        };
        let idx = event
            .get("output_index")
            .and_then(Value::as_u64)
            .unwrap_or(self.items.len() as u64);
        if let Some(id) = item.get("id").and_then(Value::as_str) {
            self.ids.insert(id.to_string(), idx);
        }
        self.items.insert(idx, item.clone());
    }

    pub fn push(&mut self, event: &Value) {
        let Some(ty) = event.get("type").and_then(Value::as_str) else {
            return;
        };
        let delta = event
            .get("delta")
            .and_then(Value::as_str)
            .unwrap_or_default();
        let content_index = event
            .get("content_index")
            .and_then(Value::as_u64)
            .unwrap_or(0) as usize;
        match ty {
            "response.created" | "response.in_progress" | "response.queued" => {
                if let Some(r) = event.get("response") {
                    self.base = Some(r.clone());
                }
            }
            "response.completed" | "response.incomplete" | "response.failed" => {
                if let Some(r) = event.get("response") {
                    self.terminal = Some(r.clone());
                }
            }
            "error" => self.error = Some(event.clone()),
            "response.output_item.added" | "response.output_item.done" => self.set_item(event),
            "response.content_part.added" | "response.content_part.done" => {
                if let Some(part) = event.get("part").cloned()
                    && let Some(item) = self.item_mut(event)
                    && let Some(p) = part_at(item, "content", content_index, Value::Null)
                {
                    *p = part;
                }
            }
            "response.reasoning_summary_part.added" | "response.reasoning_summary_part.done" => {
                let si = event
                    .get("summary_index")
                    .and_then(Value::as_u64)
                    .unwrap_or(0) as usize;
                if let Some(part) = event.get("part").cloned()
                    && let Some(item) = self.item_mut(event)
                    && let Some(p) = part_at(item, "summary", si, Value::Null)
                {
                    *p = part;
                }
            }
            "response.output_text.delta" => {
                let template = output_text_part("", &[]);
                if let Some(item) = self.item_mut(event)
                    && let Some(p) = part_at(item, "content", content_index, template)
                {
                    push_str_at(p, "text", delta);
                }
            }
            "response.refusal.delta" => {
                let template = json!({"type": "refusal", "refusal": ""});
                if let Some(item) = self.item_mut(event)
                    && let Some(p) = part_at(item, "content", content_index, template)
                {
                    push_str_at(p, "refusal", delta);
                }
            }
            "response.reasoning_text.delta" => {
                let template = json!({"type": "reasoning_text", "text": ""});
                if let Some(item) = self.item_mut(event)
                    && let Some(p) = part_at(item, "content", content_index, template)
                {
                    push_str_at(p, "text", delta);
                }
            }
            "response.reasoning_summary_text.delta" => {
                let si = event
                    .get("summary_index")
                    .and_then(Value::as_u64)
                    .unwrap_or(0) as usize;
                let template = json!({"type": "summary_text", "text": ""});
                if let Some(item) = self.item_mut(event)
                    && let Some(p) = part_at(item, "summary", si, template)
                {
                    push_str_at(p, "text", delta);
                }
            }
            "response.function_call_arguments.delta" => {
                if let Some(item) = self.item_mut(event) {
                    push_str_at(item, "arguments", delta);
                }
            }
            "response.function_call_arguments.done" => {
                if let Some(args) = event.get("arguments").cloned()
                    && let Some(item) = self.item_mut(event)
                    && let Some(o) = item.as_object_mut()
                {
                    o.insert("arguments".into(), args);
                }
            }
            "response.custom_tool_call_input.delta" => {
                if let Some(item) = self.item_mut(event) {
                    push_str_at(item, "input", delta);
                }
            }
            _ => {}
        }
    }

    /// The final response object: the terminal event's payload when one arrived (with `output`
    /// filled from the items when the server sent it empty), else one built from the events.
    /// `None` when no event described a response at all.
    pub fn finish(&self) -> Option<Value> {
        let items: Vec<Value> = self.items.values().cloned().collect();
        if let Some(t) = &self.terminal {
            let mut t = t.clone();
            if let Some(o) = t.as_object_mut() {
                let empty = o
                    .get("output")
                    .and_then(Value::as_array)
                    .is_none_or(|a| a.is_empty());
                if empty && !items.is_empty() {
                    o.insert("output".into(), Value::Array(items));
                }
            }
            return Some(t);
        }
        if self.base.is_none() && items.is_empty() && self.error.is_none() {
            return None;
        }
        let mut resp = match &self.base {
            Some(Value::Object(b)) => b.clone(),
            _ => {
                let mut m = Map::new();
                m.insert("object".into(), json!("response"));
                m
            }
        };
        resp.insert("output".into(), Value::Array(items));
        match &self.error {
            Some(e) => {
                resp.insert("status".into(), json!("failed"));
                resp.insert(
                    "error".into(),
                    json!({"code": e.get("code"), "message": e.get("message")}),
                );
            }
            // The stream ended without a terminal event: the response never finished.
            None => {
                resp.insert("status".into(), json!("incomplete"));
            }
        }
        Some(Value::Object(resp))
    }
}

/// A Responses stream's last word is its terminal event; the finish reason is the response's
/// `status` (`completed`, `incomplete`, `failed`).
impl StreamAssembler for ResponsesAssembler {
    fn push(&mut self, event: &Value) {
        ResponsesAssembler::push(self, event);
    }

    fn is_terminal(&self, _ev: &Event, parsed: Option<&Value>) -> bool {
        matches!(
            parsed.and_then(|v| v.get("type")).and_then(Value::as_str),
            Some("response.completed" | "response.incomplete" | "response.failed")
        )
    }

    fn finish(&self) -> Option<Value> {
        ResponsesAssembler::finish(self)
    }

    fn finish_reason(&self, response: Option<&Value>) -> Option<String> {
        response
            .and_then(|r| r.get("status"))
            .and_then(Value::as_str)
            .map(str::to_string)
    }
}

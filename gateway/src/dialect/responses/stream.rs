//! The Responses stream emitter and mid-stream failure events.

use std::collections::HashMap;

use bytes::Bytes;
use serde_json::{Map, Value, json};

use super::render::{
    call_item, custom_input, custom_tool_names, finalize, id_suffix, item_id, mark_last_status,
    message_item, output_text_part, reasoning_item, response_skeleton,
};
use crate::dialect::{Answer, Conversation, Delta, EventStream, Finish, sse_named};
use crate::error::GatewayError;

/// The highest integer JavaScript and JSON tooling keep exactly (2^53 - 1). [`error_event`]
/// has no stream state, so it numbers its events just below this: later than anything a
/// stream emitted before it.
const MAX_SAFE_SEQUENCE: u64 = (1 << 53) - 1;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum TextKind {
    Message,
    Reasoning,
}

struct OpenText {
    kind: TextKind,
    output_index: usize,
    id: String,
    text: String,
}

struct OpenCall {
    delta_index: usize,
    output_index: usize,
    id: String,
    call_id: String,
    name: String,
    args: String,
    custom: bool,
}

/// Deltas → Responses SSE events. Message and reasoning items close when a delta of another
/// kind arrives; function-call items stay open until text or reasoning arrives (or the end), so
/// parallel calls whose argument deltas interleave are still each streamed whole.
pub struct ResponsesStream {
    response_id: String,
    suffix: String,
    skeleton: Map<String, Value>,
    seq: u64,
    /// One slot per output index: `None` while the item is open.
    output: Vec<Option<Value>>,
    open_text: Option<OpenText>,
    open_calls: Vec<OpenCall>,
    /// Tool-call delta indices already seen (to ignore duplicates / late arguments).
    seen_calls: HashMap<usize, bool>,
    custom_tools: Vec<String>,
    started: bool,
    finished: bool,
    /// Token logprobs (when asked for) not yet sent with a text delta, and all of them (the
    /// message's `output_text` holds every output token's, as vLLM's does).
    logprobs_pending: Vec<Value>,
    logprobs_all: Vec<Value>,
}

/// A stream emitter for one response.
pub fn stream(conv: &Conversation, response_id: &str) -> ResponsesStream {
    let created_at = chrono::Utc::now().timestamp();
    ResponsesStream {
        response_id: response_id.to_string(),
        suffix: id_suffix(response_id).to_string(),
        skeleton: response_skeleton(conv, response_id, created_at),
        seq: 0,
        output: Vec::new(),
        open_text: None,
        open_calls: Vec::new(),
        seen_calls: HashMap::new(),
        custom_tools: custom_tool_names(conv),
        started: false,
        finished: false,
        logprobs_pending: Vec::new(),
        logprobs_all: Vec::new(),
    }
}

impl ResponsesStream {
    fn event(&mut self, ty: &str, fields: Value) -> Bytes {
        let mut m = Map::new();
        m.insert("type".into(), json!(ty));
        m.insert("sequence_number".into(), json!(self.seq));
        self.seq += 1;
        if let Value::Object(f) = fields {
            m.extend(f);
        }
        sse_named(ty, &Value::Object(m))
    }

    fn ensure_started(&mut self, out: &mut Vec<Bytes>) {
        if !self.started {
            self.started = true;
            let resp = Value::Object(self.skeleton.clone());
            out.push(self.event("response.created", json!({"response": resp})));
            out.push(self.event("response.in_progress", json!({"response": resp})));
        }
    }

    fn close_text(&mut self, out: &mut Vec<Bytes>) {
        let Some(t) = self.open_text.take() else {
            return;
        };
        let (done_ty, part, item) = match t.kind {
            TextKind::Message => (
                "response.output_text.done",
                output_text_part(&t.text, &self.logprobs_all),
                message_item(&t.id, &t.text, "completed", &self.logprobs_all),
            ),
            TextKind::Reasoning => (
                "response.reasoning_text.done",
                json!({"type": "reasoning_text", "text": t.text}),
                reasoning_item(&t.id, &t.text, "completed"),
            ),
        };
        let mut done = json!({
            "item_id": t.id, "output_index": t.output_index, "content_index": 0, "text": t.text,
        });
        if t.kind == TextKind::Message
            && let Some(o) = done.as_object_mut()
        {
            o.insert("logprobs".into(), json!(self.logprobs_all));
        }
        out.push(self.event(done_ty, done));
        out.push(self.event(
            "response.content_part.done",
            json!({"item_id": t.id, "output_index": t.output_index, "content_index": 0, "part": part}),
        ));
        out.push(self.event(
            "response.output_item.done",
            json!({"output_index": t.output_index, "item": item}),
        ));
        if let Some(slot) = self.output.get_mut(t.output_index) {
            *slot = Some(item);
        }
    }

    fn close_calls(&mut self, out: &mut Vec<Bytes>) {
        for c in std::mem::take(&mut self.open_calls) {
            let item = call_item(&c.id, &c.call_id, &c.name, &c.args, c.custom, "completed");
            if c.custom {
                let input = custom_input(&c.args);
                if !input.is_empty() {
                    out.push(self.event(
                        "response.custom_tool_call_input.delta",
                        json!({"item_id": c.id, "output_index": c.output_index, "delta": input}),
                    ));
                }
                out.push(self.event(
                    "response.custom_tool_call_input.done",
                    json!({"item_id": c.id, "output_index": c.output_index, "input": input}),
                ));
            } else {
                out.push(self.event(
                    "response.function_call_arguments.done",
                    json!({"item_id": c.id, "output_index": c.output_index, "name": c.name, "arguments": c.args}),
                ));
            }
            out.push(self.event(
                "response.output_item.done",
                json!({"output_index": c.output_index, "item": item}),
            ));
            if let Some(slot) = self.output.get_mut(c.output_index) {
                *slot = Some(item);
            }
        }
    }

    fn text_delta(&mut self, kind: TextKind, delta: &str, out: &mut Vec<Bytes>) {
        if delta.is_empty() {
            return;
        }
        self.close_calls(out);
        if self.open_text.as_ref().is_some_and(|t| t.kind != kind) {
            self.close_text(out);
        }
        if self.open_text.is_none() {
            let output_index = self.output.len();
            self.output.push(None);
            let (prefix, item, part) = match kind {
                TextKind::Message => (
                    "msg_",
                    json!({"type": "message", "status": "in_progress", "role": "assistant", "content": []}),
                    output_text_part("", &[]),
                ),
                TextKind::Reasoning => (
                    "rs_",
                    json!({"type": "reasoning", "status": "in_progress", "summary": [], "content": []}),
                    json!({"type": "reasoning_text", "text": ""}),
                ),
            };
            let id = item_id(prefix, &self.suffix, output_index);
            let mut item = item;
            if let Some(o) = item.as_object_mut() {
                let mut with_id = Map::new();
                with_id.insert("id".into(), json!(id));
                with_id.extend(std::mem::take(o));
                *o = with_id;
            }
            out.push(self.event(
                "response.output_item.added",
                json!({"output_index": output_index, "item": item}),
            ));
            out.push(self.event(
                "response.content_part.added",
                json!({"item_id": id, "output_index": output_index, "content_index": 0, "part": part}),
            ));
            self.open_text = Some(OpenText {
                kind,
                output_index,
                id,
                text: String::new(),
            });
        }
        let Some(t) = self.open_text.as_mut() else {
            return;
        };
        t.text.push_str(delta);
        let (ty, fields) = match kind {
            TextKind::Message => (
                "response.output_text.delta",
                json!({"item_id": t.id, "output_index": t.output_index, "content_index": 0, "delta": delta,
                    "logprobs": std::mem::take(&mut self.logprobs_pending)}),
            ),
            TextKind::Reasoning => (
                "response.reasoning_text.delta",
                json!({"item_id": t.id, "output_index": t.output_index, "content_index": 0, "delta": delta}),
            ),
        };
        out.push(self.event(ty, fields));
    }

    fn call_start(&mut self, index: usize, call_id: &str, name: &str, out: &mut Vec<Bytes>) {
        if self.seen_calls.contains_key(&index) {
            tracing::warn!(index, "responses stream: duplicate tool call start ignored");
            return;
        }
        self.seen_calls.insert(index, true);
        self.close_text(out);
        let output_index = self.output.len();
        self.output.push(None);
        let custom = self.custom_tools.iter().any(|c| c == name);
        let id = item_id(
            if custom { "ctc_" } else { "fc_" },
            &self.suffix,
            output_index,
        );
        let item = call_item(&id, call_id, name, "", custom, "in_progress");
        out.push(self.event(
            "response.output_item.added",
            json!({"output_index": output_index, "item": item}),
        ));
        self.open_calls.push(OpenCall {
            delta_index: index,
            output_index,
            id,
            call_id: call_id.to_string(),
            name: name.to_string(),
            args: String::new(),
            custom,
        });
    }

    fn call_args(&mut self, index: usize, delta: &str, out: &mut Vec<Bytes>) {
        if delta.is_empty() {
            return;
        }
        let Some(c) = self.open_calls.iter_mut().find(|c| c.delta_index == index) else {
            tracing::warn!(
                index,
                "responses stream: arguments for a tool call that is not open were dropped"
            );
            return;
        };
        c.args.push_str(delta);
        if c.custom {
            // The freeform input is only known once the JSON arguments are whole.
            return;
        }
        let fields = json!({"item_id": c.id, "output_index": c.output_index, "delta": delta});
        out.push(self.event("response.function_call_arguments.delta", fields));
    }

    fn completed_output(&self) -> Vec<Value> {
        self.output.iter().flatten().cloned().collect()
    }

    /// A mid-stream failure with this stream's numbering: an `error` event, then
    /// `response.failed` carrying the items finished so far. See [`error_event`] for why both.
    pub fn fail(&mut self, err: &GatewayError) -> Vec<Bytes> {
        self.step(|s, out| {
            s.finished = true;
            let mut resp = s.skeleton.clone();
            resp.insert("output".into(), Value::Array(s.completed_output()));
            let (error_fields, failed) = error_payloads(err, resp);
            out.push(s.event("error", error_fields));
            out.push(s.event("response.failed", json!({"response": failed})));
        })
    }

    /// The response id this stream was created with.
    pub fn response_id(&self) -> &str {
        &self.response_id
    }
}

impl EventStream for ResponsesStream {
    fn ended(&self) -> bool {
        self.finished
    }

    fn open(&mut self, out: &mut Vec<Bytes>) {
        self.ensure_started(out);
    }

    fn delta(&mut self, delta: &Delta, out: &mut Vec<Bytes>) {
        match delta {
            // Sent with the message's next text delta (they follow the text they belong
            // to), and all of them with the finished `output_text`.
            Delta::Logprobs(tokens) => {
                let items = crate::dialect::logprob_items(tokens);
                self.logprobs_all.extend(items.iter().cloned());
                self.logprobs_pending.extend(items);
            }
            Delta::Text(t) => self.text_delta(TextKind::Message, t, out),
            Delta::Reasoning(t) => self.text_delta(TextKind::Reasoning, t, out),
            Delta::ToolCallStart { index, id, name } => self.call_start(*index, id, name, out),
            Delta::ToolCallArgs { index, arguments } => self.call_args(*index, arguments, out),
        }
    }

    fn close(&mut self, answer: &Answer, out: &mut Vec<Bytes>) {
        self.close_text(out);
        self.close_calls(out);
        self.finished = true;
        let mut output = self.completed_output();
        // The message holds every output token's logprobs, also those sampled after it
        // closed (a tool call's), as in a whole answer.
        if !self.logprobs_all.is_empty()
            && let Some(part) = output
                .iter_mut()
                .find(|i| i["type"] == "message")
                .and_then(|m| m.pointer_mut("/content/0"))
        {
            part["logprobs"] = Value::Array(self.logprobs_all.clone());
        }
        mark_last_status(&mut output, answer.finish);
        let mut resp = self.skeleton.clone();
        finalize(&mut resp, answer, output);
        let ty = match answer.finish {
            Finish::Stop | Finish::ToolCalls => "response.completed",
            Finish::Length | Finish::ContentFilter => "response.incomplete",
            Finish::Error => "response.failed",
        };
        out.push(self.event(ty, json!({"response": resp})));
    }
}

/// The Responses `error.code` for a gateway error. Codex treats `context_length_exceeded` as
/// fatal (and compacts); everything else from `response.failed` it retries.
fn responses_error_code(err: &GatewayError) -> &'static str {
    let text = err.to_string().to_ascii_lowercase();
    if text.contains("context length") || text.contains("context_length") {
        "context_length_exceeded"
    } else {
        err.code()
    }
}

/// The `error` event's fields and the failed response object.
fn error_payloads(err: &GatewayError, mut resp: Map<String, Value>) -> (Value, Value) {
    let body = err.body();
    let inner = body.get("error").cloned().unwrap_or(Value::Null);
    let code = responses_error_code(err);
    let message = err.to_string();
    let param = inner.get("param").cloned().unwrap_or(Value::Null);
    let mut error_obj = inner;
    if let Some(o) = error_obj.as_object_mut() {
        o.insert("code".into(), json!(code));
    }
    let error_fields = json!({
        "code": code,
        "message": message,
        "param": param,
        // A top-level `error` object makes both OpenAI SDKs raise an APIError on this event.
        "error": error_obj,
    });
    resp.insert("status".into(), json!("failed"));
    resp.insert("error".into(), json!({"code": code, "message": message}));
    (error_fields, Value::Object(resp))
}

/// A mid-stream failure without stream state: an `error` event and a `response.failed` event.
///
/// Why both: the OpenAI SDKs (Python and Node) raise an `APIError` for any streamed event whose
/// data has a top-level `error` object, so the `error` event carries one (beside the documented
/// `code`/`message`/`param`); Codex classifies failures from `response.failed` →
/// `response.error.code` (`context_length_exceeded` is fatal, other codes are retried) and
/// older Codex ignores `error` events. Without the state of the stream, the events are numbered
/// just below 2^53 so they still follow every earlier `sequence_number`; prefer
/// [`ResponsesStream::fail`] where the stream is at hand.
pub fn error_event(err: &GatewayError, response_id: &str) -> Bytes {
    let mut resp = Map::new();
    resp.insert("id".into(), json!(response_id));
    resp.insert("object".into(), json!("response"));
    resp.insert("output".into(), json!([]));
    resp.insert("usage".into(), Value::Null);
    let (error_fields, failed) = error_payloads(err, resp);
    let mut error_ev = Map::new();
    error_ev.insert("type".into(), json!("error"));
    error_ev.insert("sequence_number".into(), json!(MAX_SAFE_SEQUENCE - 1));
    if let Value::Object(f) = error_fields {
        error_ev.extend(f);
    }
    let failed_ev = json!({
        "type": "response.failed",
        "sequence_number": MAX_SAFE_SEQUENCE,
        "response": failed,
    });
    let mut buf = Vec::new();
    buf.extend_from_slice(&sse_named("error", &Value::Object(error_ev)));
    buf.extend_from_slice(&sse_named("response.failed", &failed_ev));
    Bytes::from(buf)
}

//! OpenAI Chat Completions: the dialect most inference servers (SGLang, vLLM, `graft serve`)
//! speak, and so the one other dialects are translated to when the upstream speaks nothing
//! else.

use super::kind;
use serde_json::{Map, Value, json};

use super::{
    Answer, Conversation, Delta, Finish, Message, Part, Reasoning, Role, Sampling, TokenUsage,
    Tool, ToolCall, ToolChoice,
};
use crate::error::GatewayError;
use crate::sse::Assembler;

fn role_of(s: &str) -> Option<Role> {
    Some(match s {
        "system" => Role::System,
        "developer" => Role::Developer,
        "user" => Role::User,
        "assistant" => Role::Assistant,
        "tool" | "function" => Role::Tool,
        _ => return None,
    })
}

fn parts(v: &Value, path: &str) -> Result<Vec<Part>, GatewayError> {
    match v {
        Value::Null => Ok(vec![]),
        Value::String(s) => Ok(vec![Part::Text { text: s.clone() }]),
        Value::Array(items) => {
            let mut out = vec![];
            for (i, p) in items.iter().enumerate() {
                match p.get("type").and_then(Value::as_str) {
                    Some("text") | Some("input_text") | Some("output_text") => {
                        let t = p.get("text").and_then(Value::as_str).ok_or_else(|| {
                            GatewayError::field(
                                format!("{path}[{i}].text"),
                                format!("'{path}[{i}].text' must be a string"),
                            )
                        })?;
                        out.push(Part::Text {
                            text: t.to_string(),
                        });
                    }
                    Some("image_url") => {
                        let url = p
                            .pointer("/image_url/url")
                            .or_else(|| p.get("image_url"))
                            .and_then(Value::as_str)
                            .ok_or_else(|| {
                                GatewayError::field(
                                    format!("{path}[{i}].image_url"),
                                    format!("'{path}[{i}].image_url.url' must be a string"),
                                )
                            })?;
                        out.push(Part::Image {
                            url: url.to_string(),
                        });
                    }
                    other => {
                        return Err(GatewayError::field(
                            format!("{path}[{i}].type"),
                            format!(
                                "'{path}[{i}].type' must be 'text' or 'image_url', got {}",
                                other
                                    .map(|o| format!("'{o}'"))
                                    .unwrap_or_else(|| "nothing".into())
                            ),
                        ));
                    }
                }
            }
            Ok(out)
        }
        other => Err(GatewayError::field(
            path.to_string(),
            format!(
                "'{path}' must be a string or an array of parts, got {}",
                kind(other)
            ),
        )),
    }
}

/// Chat Completions request → conversation.
pub fn parse_request(body: &Value) -> Result<Conversation, GatewayError> {
    let obj = body.as_object().ok_or_else(|| {
        GatewayError::field(
            "",
            format!("the request body must be a JSON object, got {}", kind(body)),
        )
    })?;
    let model = match obj.get("model") {
        Some(Value::String(m)) => m.clone(),
        Some(o) => {
            return Err(GatewayError::field(
                "model",
                format!("'model' must be a string, got {}", kind(o)),
            ));
        }
        None => return Err(GatewayError::field("model", "'model' is required")),
    };
    let msgs = obj
        .get("messages")
        .and_then(Value::as_array)
        .ok_or_else(|| GatewayError::field("messages", "'messages' must be an array"))?;
    let mut messages = Vec::with_capacity(msgs.len());
    for (i, m) in msgs.iter().enumerate() {
        let path = format!("messages[{i}]");
        let role = m
            .get("role")
            .and_then(Value::as_str)
            .and_then(role_of)
            .ok_or_else(|| {
                GatewayError::field(
                    format!("{path}.role"),
                    format!(
                        "'{path}.role' must be one of system, developer, user, assistant, tool"
                    ),
                )
            })?;
        let mut tool_calls = vec![];
        if let Some(tcs) = m.get("tool_calls").filter(|t| !t.is_null()) {
            let arr = tcs.as_array().ok_or_else(|| {
                GatewayError::field(
                    format!("{path}.tool_calls"),
                    format!("'{path}.tool_calls' must be an array"),
                )
            })?;
            for (j, tc) in arr.iter().enumerate() {
                let f = tc.get("function").unwrap_or(&Value::Null);
                let name = f.get("name").and_then(Value::as_str).ok_or_else(|| {
                    GatewayError::field(
                        format!("{path}.tool_calls[{j}].function.name"),
                        format!("'{path}.tool_calls[{j}].function.name' must be a string"),
                    )
                })?;
                let arguments = match f.get("arguments") {
                    Some(Value::String(s)) => s.clone(),
                    Some(Value::Null) | None => String::new(),
                    Some(other) => other.to_string(),
                };
                tool_calls.push(ToolCall {
                    id: tc
                        .get("id")
                        .and_then(Value::as_str)
                        .unwrap_or_default()
                        .to_string(),
                    name: name.to_string(),
                    arguments,
                });
            }
        }
        messages.push(Message {
            role,
            content: parts(
                m.get("content").unwrap_or(&Value::Null),
                &format!("{path}.content"),
            )?,
            reasoning: m
                .get("reasoning_content")
                .or_else(|| m.get("reasoning"))
                .and_then(Value::as_str)
                .map(str::to_string),
            tool_calls,
            tool_call_id: m
                .get("tool_call_id")
                .and_then(Value::as_str)
                .map(str::to_string),
            name: m.get("name").and_then(Value::as_str).map(str::to_string),
        });
    }
    let mut tools = vec![];
    let mut notes = vec![];
    if let Some(ts) = obj.get("tools").and_then(Value::as_array) {
        for (i, t) in ts.iter().enumerate() {
            if t.get("type").and_then(Value::as_str) != Some("function") {
                notes.push(format!(
                    "tools[{i}] of type {} dropped: only function tools translate",
                    t.get("type").unwrap_or(&Value::Null)
                ));
                continue;
            }
            let f = t.get("function").unwrap_or(&Value::Null);
            let name = f.get("name").and_then(Value::as_str).ok_or_else(|| {
                GatewayError::field(
                    format!("tools[{i}].function.name"),
                    format!("'tools[{i}].function.name' must be a string"),
                )
            })?;
            tools.push(Tool {
                name: name.to_string(),
                description: f
                    .get("description")
                    .and_then(Value::as_str)
                    .map(str::to_string),
                parameters: f
                    .get("parameters")
                    .cloned()
                    .unwrap_or_else(|| json!({"type": "object", "properties": {}})),
                strict: f.get("strict").and_then(Value::as_bool),
            });
        }
    }
    let tool_choice = match obj.get("tool_choice") {
        Some(Value::String(s)) => match s.as_str() {
            "auto" => Some(ToolChoice::Auto),
            "none" => Some(ToolChoice::None),
            "required" => Some(ToolChoice::Required),
            other => {
                return Err(GatewayError::field(
                    "tool_choice",
                    format!(
                        "'tool_choice' must be auto, none, required or a function, got '{other}'"
                    ),
                ));
            }
        },
        Some(v @ Value::Object(_)) => {
            v.pointer("/function/name")
                .and_then(Value::as_str)
                .map(|n| ToolChoice::Function {
                    name: n.to_string(),
                })
        }
        _ => None,
    };
    let stop = match obj.get("stop") {
        Some(Value::String(s)) => vec![s.clone()],
        Some(Value::Array(a)) => a
            .iter()
            .filter_map(Value::as_str)
            .map(str::to_string)
            .collect(),
        _ => vec![],
    };
    let f64_of = |k: &str| obj.get(k).and_then(Value::as_f64);
    let sampling = Sampling {
        temperature: f64_of("temperature"),
        top_p: f64_of("top_p"),
        top_k: obj.get("top_k").and_then(Value::as_u64),
        max_tokens: obj
            .get("max_completion_tokens")
            .or_else(|| obj.get("max_tokens"))
            .and_then(Value::as_u64),
        stop,
        seed: obj.get("seed").and_then(Value::as_i64),
        presence_penalty: f64_of("presence_penalty"),
        frequency_penalty: f64_of("frequency_penalty"),
    };
    const KNOWN: [&str; 18] = [
        "model",
        "messages",
        "tools",
        "tool_choice",
        "parallel_tool_calls",
        "stream",
        "stream_options",
        "temperature",
        "top_p",
        "top_k",
        "max_tokens",
        "max_completion_tokens",
        "stop",
        "seed",
        "presence_penalty",
        "frequency_penalty",
        "reasoning_effort",
        "n",
    ];
    let extra: Map<String, Value> = obj
        .iter()
        .filter(|(k, _)| !KNOWN.contains(&k.as_str()))
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect();
    Ok(Conversation {
        model,
        messages,
        tools,
        tool_choice,
        parallel_tool_calls: obj.get("parallel_tool_calls").and_then(Value::as_bool),
        sampling,
        reasoning: obj
            .get("reasoning_effort")
            .and_then(Value::as_str)
            .map(|e| Reasoning {
                effort: Some(e.to_string()),
                ..Default::default()
            }),
        stream: obj.get("stream").and_then(Value::as_bool).unwrap_or(false),
        extra,
        notes,
    })
}

fn content_value(parts: &[Part]) -> Value {
    if parts.iter().all(|p| matches!(p, Part::Text { .. })) {
        let mut s = String::new();
        for p in parts {
            if let Part::Text { text } = p {
                s.push_str(text);
            }
        }
        return Value::String(s);
    }
    Value::Array(
        parts
            .iter()
            .map(|p| match p {
                Part::Text { text } => json!({"type": "text", "text": text}),
                Part::Image { url } => json!({"type": "image_url", "image_url": {"url": url}}),
            })
            .collect(),
    )
}

/// Conversation → the Chat Completions request graft sends upstream. Leading system and
/// developer messages become one system message (chat templates of open models accept a
/// single leading system turn); later developer messages become system messages. Every such
/// mapping is noted in the returned list.
pub fn to_request(conv: &Conversation) -> (Value, Vec<String>) {
    let mut notes = vec![];
    let mut messages: Vec<Value> = vec![];
    let mut lead = true;
    let mut lead_text: Vec<String> = vec![];
    for m in &conv.messages {
        if lead && matches!(m.role, Role::System | Role::Developer) {
            if m.role == Role::Developer {
                notes.push(
                    "a leading developer message was sent as (part of) the system message".into(),
                );
            }
            lead_text.push(m.joined_text());
            continue;
        }
        if lead {
            lead = false;
            if !lead_text.is_empty() {
                if lead_text.len() > 1 {
                    notes.push(format!(
                        "{} leading system/developer messages were joined into one system message",
                        lead_text.len()
                    ));
                }
                messages.push(json!({"role": "system", "content": lead_text.join("\n\n")}));
            }
        }
        let mut out = Map::new();
        let role = match m.role {
            Role::System => "system",
            Role::Developer => {
                notes.push(
                    "a developer message after the conversation start was sent as a system message"
                        .into(),
                );
                "system"
            }
            Role::User => "user",
            Role::Assistant => "assistant",
            Role::Tool => "tool",
        };
        out.insert("role".into(), json!(role));
        match m.role {
            Role::Assistant => {
                let text = content_value(&m.content);
                let empty = text.as_str().is_some_and(str::is_empty);
                out.insert(
                    "content".into(),
                    if empty && !m.tool_calls.is_empty() {
                        Value::Null
                    } else {
                        text
                    },
                );
                if let Some(r) = &m.reasoning {
                    out.insert("reasoning_content".into(), json!(r));
                }
                if !m.tool_calls.is_empty() {
                    out.insert(
                        "tool_calls".into(),
                        Value::Array(
                            m.tool_calls
                                .iter()
                                .map(|t| json!({"id": t.id, "type": "function", "function": {"name": t.name, "arguments": t.arguments}}))
                                .collect(),
                        ),
                    );
                }
            }
            Role::Tool => {
                out.insert(
                    "tool_call_id".into(),
                    json!(m.tool_call_id.clone().unwrap_or_default()),
                );
                out.insert("content".into(), content_value(&m.content));
            }
            _ => {
                out.insert("content".into(), content_value(&m.content));
            }
        }
        if let Some(n) = &m.name {
            out.insert("name".into(), json!(n));
        }
        messages.push(Value::Object(out));
    }
    if lead && !lead_text.is_empty() {
        messages.push(json!({"role": "system", "content": lead_text.join("\n\n")}));
    }
    let mut req = Map::new();
    req.insert("model".into(), json!(conv.model));
    req.insert("messages".into(), Value::Array(messages));
    if !conv.tools.is_empty() {
        let tools: Vec<Value> = conv
            .tools
            .iter()
            .map(|t| {
                let mut f = Map::new();
                f.insert("name".into(), json!(t.name));
                if let Some(d) = &t.description {
                    f.insert("description".into(), json!(d));
                }
                f.insert("parameters".into(), t.parameters.clone());
                if let Some(s) = t.strict {
                    f.insert("strict".into(), json!(s));
                }
                json!({"type": "function", "function": f})
            })
            .collect();
        req.insert("tools".into(), Value::Array(tools));
        if let Some(tc) = &conv.tool_choice {
            req.insert(
                "tool_choice".into(),
                match tc {
                    ToolChoice::Auto => json!("auto"),
                    ToolChoice::None => json!("none"),
                    ToolChoice::Required => json!("required"),
                    ToolChoice::Function { name } => {
                        json!({"type": "function", "function": {"name": name}})
                    }
                },
            );
        }
        if let Some(p) = conv.parallel_tool_calls {
            req.insert("parallel_tool_calls".into(), json!(p));
        }
    }
    let s = &conv.sampling;
    let mut put = |k: &str, v: Option<Value>| {
        if let Some(v) = v {
            req.insert(k.into(), v);
        }
    };
    put("temperature", s.temperature.map(|v| json!(v)));
    put("top_p", s.top_p.map(|v| json!(v)));
    put("top_k", s.top_k.map(|v| json!(v)));
    put("max_tokens", s.max_tokens.map(|v| json!(v)));
    put("stop", (!s.stop.is_empty()).then(|| json!(s.stop)));
    put("seed", s.seed.map(|v| json!(v)));
    put("presence_penalty", s.presence_penalty.map(|v| json!(v)));
    put("frequency_penalty", s.frequency_penalty.map(|v| json!(v)));
    if conv.reasoning.is_some() {
        notes.push("reasoning settings are not forwarded to a Chat Completions upstream".into());
    }
    req.insert("stream".into(), json!(conv.stream));
    if conv.stream {
        req.insert("stream_options".into(), json!({"include_usage": true}));
    }
    (Value::Object(req), notes)
}

fn finish_of(s: Option<&str>) -> Finish {
    match s {
        Some("length") => Finish::Length,
        Some("tool_calls") | Some("function_call") => Finish::ToolCalls,
        Some("content_filter") => Finish::ContentFilter,
        _ => Finish::Stop,
    }
}

/// A `chat.completion` object → answer.
pub fn parse_answer(v: &Value) -> Result<Answer, String> {
    let choice = v
        .pointer("/choices/0")
        .ok_or("the response has no choices[0]")?;
    let msg = choice.get("message").ok_or("choices[0] has no message")?;
    let text = match msg.get("content") {
        Some(Value::String(s)) => s.clone(),
        Some(Value::Array(parts)) => parts
            .iter()
            .filter_map(|p| p.get("text").and_then(Value::as_str))
            .collect(),
        _ => String::new(),
    };
    let tool_calls: Vec<ToolCall> = msg
        .get("tool_calls")
        .and_then(Value::as_array)
        .map(|a| {
            a.iter()
                .map(|t| ToolCall {
                    id: t
                        .get("id")
                        .and_then(Value::as_str)
                        .map(str::to_string)
                        .unwrap_or_else(|| super::new_id("call_")),
                    name: t
                        .pointer("/function/name")
                        .and_then(Value::as_str)
                        .unwrap_or_default()
                        .to_string(),
                    arguments: t
                        .pointer("/function/arguments")
                        .and_then(Value::as_str)
                        .unwrap_or_default()
                        .to_string(),
                })
                .collect()
        })
        .unwrap_or_default();
    let usage = v
        .get("usage")
        .filter(|u| u.is_object())
        .map(|u| TokenUsage {
            input_tokens: u.get("prompt_tokens").and_then(Value::as_u64).unwrap_or(0),
            output_tokens: u
                .get("completion_tokens")
                .and_then(Value::as_u64)
                .unwrap_or(0),
            cached_tokens: u
                .pointer("/prompt_tokens_details/cached_tokens")
                .and_then(Value::as_u64)
                .unwrap_or(0),
            reasoning_tokens: u
                .pointer("/completion_tokens_details/reasoning_tokens")
                .and_then(Value::as_u64)
                .unwrap_or(0),
        });
    let mut finish = finish_of(choice.get("finish_reason").and_then(Value::as_str));
    if finish == Finish::Stop && !tool_calls.is_empty() {
        finish = Finish::ToolCalls;
    }
    Ok(Answer {
        id: v
            .get("id")
            .and_then(Value::as_str)
            .map(str::to_string)
            .unwrap_or_else(|| super::new_id("chatcmpl-")),
        model: v
            .get("model")
            .and_then(Value::as_str)
            .unwrap_or_default()
            .to_string(),
        created: v.get("created").and_then(Value::as_i64).unwrap_or(0),
        text,
        reasoning: msg
            .get("reasoning_content")
            .or_else(|| msg.get("reasoning"))
            .and_then(Value::as_str)
            .map(str::to_string),
        tool_calls,
        finish,
        usage,
    })
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
                            .unwrap_or_else(|| super::new_id("call_")),
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
            id: super::new_id("chatcmpl-"),
            model: String::new(),
            created: 0,
            text: String::new(),
            reasoning: None,
            tool_calls: vec![],
            finish: Finish::Error,
            usage: None,
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

// -------------------------------------------------------------------------------------
// Answers in Chat Completions form (exact mode answers Chat clients itself)

fn finish_str(f: Finish) -> &'static str {
    match f {
        Finish::Stop | Finish::Error => "stop",
        Finish::Length => "length",
        Finish::ToolCalls => "tool_calls",
        Finish::ContentFilter => "content_filter",
    }
}

fn usage_value(u: &TokenUsage) -> Value {
    json!({
        "prompt_tokens": u.input_tokens,
        "completion_tokens": u.output_tokens,
        "total_tokens": u.input_tokens + u.output_tokens,
        "prompt_tokens_details": {"cached_tokens": u.cached_tokens},
        "completion_tokens_details": {"reasoning_tokens": u.reasoning_tokens},
    })
}

/// A whole answer as a `chat.completion` object; reasoning goes in `reasoning_content` as
/// SGLang and vLLM write it.
pub fn render_answer(answer: &Answer, id: &str) -> Value {
    let mut msg = Map::new();
    msg.insert("role".into(), json!("assistant"));
    msg.insert(
        "content".into(),
        if answer.text.is_empty() && !answer.tool_calls.is_empty() {
            Value::Null
        } else {
            json!(answer.text)
        },
    );
    if let Some(r) = &answer.reasoning {
        msg.insert("reasoning_content".into(), json!(r));
    }
    if !answer.tool_calls.is_empty() {
        msg.insert(
            "tool_calls".into(),
            Value::Array(
                answer
                    .tool_calls
                    .iter()
                    .map(|t| json!({"id": t.id, "type": "function", "function": {"name": t.name, "arguments": t.arguments}}))
                    .collect(),
            ),
        );
    }
    let mut v = json!({
        "id": id,
        "object": "chat.completion",
        "created": answer.created,
        "model": answer.model,
        "choices": [{"index": 0, "message": msg, "logprobs": null, "finish_reason": finish_str(answer.finish)}],
    });
    if let Some(u) = &answer.usage {
        v["usage"] = usage_value(u);
    }
    v
}

/// Chat Completions SSE, as OpenAI streams it: a first chunk with the role, content and
/// reasoning deltas, each tool call's header then its arguments, a chunk with the finish
/// reason, a usage chunk with `choices: []` when the client asked for
/// `stream_options.include_usage`, then `[DONE]`.
pub struct ChatStream {
    id: String,
    model: String,
    created: i64,
    include_usage: bool,
}

pub fn stream(model: &str, id: &str, created: i64, include_usage: bool) -> ChatStream {
    ChatStream {
        id: id.to_string(),
        model: model.to_string(),
        created,
        include_usage,
    }
}

impl ChatStream {
    fn chunk(&self, delta: Value, finish: Option<&str>) -> bytes::Bytes {
        let mut c = json!({
            "id": self.id,
            "object": "chat.completion.chunk",
            "created": self.created,
            "model": self.model,
            "choices": [{"index": 0, "delta": delta, "logprobs": null, "finish_reason": finish}],
        });
        if self.include_usage {
            c["usage"] = Value::Null;
        }
        bytes::Bytes::from(format!("data: {c}\n\n"))
    }
}

impl super::StreamEmitter for ChatStream {
    fn start(&mut self) -> Vec<bytes::Bytes> {
        vec![self.chunk(json!({"role": "assistant", "content": ""}), None)]
    }

    fn push(&mut self, delta: &Delta) -> Vec<bytes::Bytes> {
        let d = match delta {
            Delta::Text(t) => json!({"content": t}),
            Delta::Reasoning(r) => json!({"reasoning_content": r}),
            Delta::ToolCallStart { index, id, name } => json!({"tool_calls": [
                {"index": index, "id": id, "type": "function", "function": {"name": name, "arguments": ""}}]}),
            Delta::ToolCallArgs { index, arguments } => json!({"tool_calls": [
                {"index": index, "function": {"arguments": arguments}}]}),
        };
        vec![self.chunk(d, None)]
    }

    fn finish(&mut self, answer: &Answer) -> Vec<bytes::Bytes> {
        let mut out = vec![self.chunk(json!({}), Some(finish_str(answer.finish)))];
        if self.include_usage {
            let u = answer.usage.unwrap_or_default();
            let c = json!({
                "id": self.id,
                "object": "chat.completion.chunk",
                "created": self.created,
                "model": self.model,
                "choices": [],
                "usage": usage_value(&u),
            });
            out.push(bytes::Bytes::from(format!("data: {c}\n\n")));
        }
        out.push(bytes::Bytes::from_static(b"data: [DONE]\n\n"));
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn developer_and_system_lead_join_and_are_noted() {
        let conv = Conversation {
            model: "m".into(),
            messages: vec![
                Message::text(Role::System, "sys"),
                Message::text(Role::Developer, "dev"),
                Message::text(Role::User, "hi"),
            ],
            ..Default::default()
        };
        let (req, notes) = to_request(&conv);
        assert_eq!(
            req["messages"][0],
            json!({"role": "system", "content": "sys\n\ndev"})
        );
        assert_eq!(req["messages"][1], json!({"role": "user", "content": "hi"}));
        assert_eq!(notes.len(), 2, "{notes:?}");
    }

    #[test]
    fn chat_round_trip_keeps_tool_calls_and_results() {
        let body = json!({"model": "m", "messages": [
            {"role": "system", "content": "s"},
            {"role": "user", "content": [{"type": "text", "text": "look"}]},
            {"role": "assistant", "content": null, "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "bash", "arguments": "{\"command\":\"ls\"}"}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "a.txt"}],
            "tools": [{"type": "function", "function": {"name": "bash", "parameters": {"type": "object"}}}],
            "temperature": 0.5, "max_tokens": 10, "stream": true});
        let conv = parse_request(&body).unwrap();
        let (req, _) = to_request(&conv);
        assert_eq!(
            req["messages"][2]["tool_calls"],
            body["messages"][2]["tool_calls"]
        );
        assert_eq!(
            req["messages"][3],
            json!({"role": "tool", "tool_call_id": "c1", "content": "a.txt"})
        );
        assert_eq!(req["tools"], body["tools"]);
        assert_eq!(req["temperature"], 0.5);
        assert_eq!(req["max_tokens"], 10);
        assert_eq!(req["stream_options"]["include_usage"], true);
    }

    #[test]
    fn chunk_reader_yields_deltas_and_the_whole_answer() {
        let chunks = [
            json!({"id":"x","model":"m","created":1,"choices":[{"index":0,"delta":{"role":"assistant","content":"Hi"}}]}),
            json!({"id":"x","choices":[{"index":0,"delta":{"tool_calls":[{"index":0,"id":"c9","type":"function","function":{"name":"f","arguments":"{\"a\""}}]}}]}),
            json!({"id":"x","choices":[{"index":0,"delta":{"tool_calls":[{"index":0,"function":{"arguments":":1}"}}]}}]}),
            json!({"id":"x","choices":[{"index":0,"delta":{},"finish_reason":"tool_calls"}]}),
            json!({"id":"x","choices":[],"usage":{"prompt_tokens":5,"completion_tokens":3,"total_tokens":8}}),
        ];
        let mut r = ChunkReader::new();
        let deltas: Vec<Delta> = chunks.iter().flat_map(|c| r.push(c)).collect();
        assert_eq!(
            deltas,
            vec![
                Delta::Text("Hi".into()),
                Delta::ToolCallStart {
                    index: 0,
                    id: "c9".into(),
                    name: "f".into()
                },
                Delta::ToolCallArgs {
                    index: 0,
                    arguments: "{\"a\"".into()
                },
                Delta::ToolCallArgs {
                    index: 0,
                    arguments: ":1}".into()
                },
            ]
        );
        let a = r.answer();
        assert_eq!(a.text, "Hi");
        assert_eq!(a.finish, Finish::ToolCalls);
        assert_eq!(
            a.tool_calls,
            vec![ToolCall {
                id: "c9".into(),
                name: "f".into(),
                arguments: "{\"a\":1}".into()
            }]
        );
        assert_eq!(a.usage.unwrap().input_tokens, 5);
    }

    #[test]
    fn bad_chat_input_names_the_path() {
        let e =
            parse_request(&json!({"model": "m", "messages": [{"role": "wizard", "content": "x"}]}))
                .unwrap_err();
        assert!(e.to_string().contains("messages[0].role"), "{e}");
        let e = parse_request(
            &json!({"model": "m", "messages": [{"role": "user", "content": [{"type": "audio"}]}]}),
        )
        .unwrap_err();
        assert!(e.to_string().contains("messages[0].content[0].type"), "{e}");
    }
}

//! Chat Completions requests: the client's body → [`Conversation`], and a conversation → the
//! Chat request graft sends upstream.

use serde_json::{Map, Value, json};

use crate::dialect::{
    Conversation, Message, Part, Reasoning, Role, Sampling, Tool, ToolCall, ToolChoice,
    json::non_negative_int, kind,
};
use crate::error::GatewayError;

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
/// What every Chat call is checked for before any leg (passthrough relays the body as it
/// is): `messages` an array of objects with a string `role`, `tools` an array.
pub(super) fn check(obj: &Map<String, Value>) -> Result<(), GatewayError> {
    let Some(msgs) = obj.get("messages") else {
        return Err(GatewayError::field("messages", "'messages' is required"));
    };
    let Some(msgs) = msgs.as_array() else {
        return Err(GatewayError::field(
            "messages",
            format!("'messages' must be an array, got {}", kind(msgs)),
        ));
    };
    for (i, m) in msgs.iter().enumerate() {
        match m.get("role") {
            Some(Value::String(_)) => {}
            Some(r) => {
                return Err(GatewayError::field(
                    format!("messages[{i}].role"),
                    format!("'messages[{i}].role' must be a string, got {}", kind(r)),
                ));
            }
            None => {
                return Err(GatewayError::field(
                    format!("messages[{i}]"),
                    format!(
                        "'messages[{i}]' must be an object with a 'role', got {}",
                        kind(m)
                    ),
                ));
            }
        }
    }
    if let Some(t) = obj.get("tools")
        && !t.is_array()
        && !t.is_null()
    {
        return Err(GatewayError::field(
            "tools",
            format!("'tools' must be an array, got {}", kind(t)),
        ));
    }
    Ok(())
}

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
        top_k: non_negative_int(obj, "top_k")?,
        max_tokens: match non_negative_int(obj, "max_completion_tokens")? {
            Some(n) => Some(n),
            None => non_negative_int(obj, "max_tokens")?,
        },
        stop,
        seed: obj.get("seed").and_then(Value::as_i64),
        presence_penalty: f64_of("presence_penalty"),
        frequency_penalty: f64_of("frequency_penalty"),
        min_p: f64_of("min_p"),
        repetition_penalty: f64_of("repetition_penalty"),
        logit_bias: crate::dialect::logit_bias_of(obj.get("logit_bias"))?,
        format: crate::dialect::OutputFormat::from_openai(
            obj.get("response_format"),
            "response_format",
            true,
        )?,
    };
    const KNOWN: [&str; 22] = [
        "response_format",
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
        "min_p",
        "repetition_penalty",
        "logit_bias",
    ];
    // `logprobs: true` asks for the sampled tokens' logprobs, `top_logprobs: n` for the n
    // most likely tokens at each position too (kept in `extra` for the record and a Chat
    // upstream).
    let top_logprobs = crate::dialect::json::non_negative_int(obj, "top_logprobs")?;
    let logprobs = match obj.get("logprobs") {
        None | Some(Value::Null) | Some(Value::Bool(false)) => None,
        Some(Value::Bool(true)) => {
            Some(u32::try_from(top_logprobs.unwrap_or(0)).unwrap_or(u32::MAX))
        }
        Some(v) => {
            return Err(GatewayError::field(
                "logprobs",
                format!(
                    "'logprobs' must be a boolean, got {}",
                    crate::dialect::kind(v)
                ),
            ));
        }
    };
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
        include_usage: obj
            .get("stream_options")
            .and_then(|o| o.get("include_usage"))
            .and_then(Value::as_bool)
            .unwrap_or(false),
        prompt: None,
        logprobs,
        shape: crate::dialect::AnswerShape::OpenAi,
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
    put("min_p", s.min_p.map(|v| json!(v)));
    put("repetition_penalty", s.repetition_penalty.map(|v| json!(v)));
    put("logit_bias", s.logit_bias.clone().map(Value::Object));
    put("response_format", s.format.as_ref().map(|f| f.to_chat()));
    if conv.reasoning.is_some() {
        notes.push("reasoning settings are not forwarded to a Chat Completions upstream".into());
    }
    req.insert("stream".into(), json!(conv.stream));
    if conv.stream {
        req.insert("stream_options".into(), json!({"include_usage": true}));
    }
    (Value::Object(req), notes)
}

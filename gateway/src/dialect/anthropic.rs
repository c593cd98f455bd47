//! Anthropic Messages (`POST /v1/messages`): the request parser, whole-message rendering,
//! the SSE stream emitter, Anthropic-shaped error bodies, and an assembler that rebuilds the
//! final message from a stream's events (for tests and for recording a passthrough stream).
//!
//! Event shapes follow the Messages streaming protocol as the official SDKs type it
//! (`RawMessageStreamEvent`): `message_start`, `content_block_start` / `_delta` / `_stop`,
//! `message_delta` (stop reason and cumulative usage) and `message_stop`, each sent as
//! `event: <type>\ndata: <json>\n\n`.
//!
//! Tool calls are streamed whole: a `tool_use` block is emitted (start, one
//! `input_json_delta`, stop) once the answer is complete, with its input normalized to a JSON
//! object. Streaming the model's raw argument text piece by piece would let malformed JSON
//! from an open-weights model reach the client, and the Anthropic SDKs abort the whole stream
//! on a tool input they cannot parse; it would also break when an upstream interleaves the
//! arguments of parallel calls. Text and thinking stream as they arrive.

use super::kind;
use bytes::Bytes;
use serde_json::{Map, Value, json};

use super::{
    Answer, Conversation, Delta, Finish, Message, Part, Reasoning, Role, StreamEmitter, TokenUsage,
    Tool, ToolCall, ToolChoice, sse_named,
};
use crate::error::GatewayError;

// ---------------------------------------------------------------------------------------------
// Request
// ---------------------------------------------------------------------------------------------

/// Top-level request keys this parser maps; every other key is kept in `Conversation::extra`.
const MAPPED_KEYS: &[&str] = &[
    "model",
    "max_tokens",
    "messages",
    "system",
    "tools",
    "tool_choice",
    "temperature",
    "top_p",
    "top_k",
    "stop_sequences",
    "thinking",
    "stream",
];

/// An invalid-field error whose message starts with the field's path.
fn bad(path: &str, message: impl AsRef<str>) -> GatewayError {
    GatewayError::field(path, format!("{path} {}", message.as_ref()))
}

/// A present, non-null value (absent and `null` both read as "not given").
fn given<'a>(obj: &'a Map<String, Value>, key: &str) -> Option<&'a Value> {
    obj.get(key).filter(|v| !v.is_null())
}

fn req_str<'a>(
    obj: &'a Map<String, Value>,
    key: &str,
    path: &str,
) -> Result<&'a str, GatewayError> {
    match given(obj, key) {
        Some(Value::String(s)) => Ok(s),
        Some(other) => Err(bad(path, format!("must be a string, got {}", kind(other)))),
        None => Err(bad(path, "is required")),
    }
}

fn opt_str<'a>(
    obj: &'a Map<String, Value>,
    key: &str,
    path: &str,
) -> Result<Option<&'a str>, GatewayError> {
    match given(obj, key) {
        Some(Value::String(s)) => Ok(Some(s)),
        Some(other) => Err(bad(path, format!("must be a string, got {}", kind(other)))),
        None => Ok(None),
    }
}

fn opt_bool(obj: &Map<String, Value>, key: &str, path: &str) -> Result<Option<bool>, GatewayError> {
    match given(obj, key) {
        Some(Value::Bool(b)) => Ok(Some(*b)),
        Some(other) => Err(bad(path, format!("must be a boolean, got {}", kind(other)))),
        None => Ok(None),
    }
}

fn opt_f64(obj: &Map<String, Value>, key: &str, path: &str) -> Result<Option<f64>, GatewayError> {
    match given(obj, key) {
        Some(Value::Number(n)) => match n.as_f64() {
            Some(f) => Ok(Some(f)),
            None => Err(bad(path, "must be a finite number")),
        },
        Some(other) => Err(bad(path, format!("must be a number, got {}", kind(other)))),
        None => Ok(None),
    }
}

fn opt_u64(obj: &Map<String, Value>, key: &str, path: &str) -> Result<Option<u64>, GatewayError> {
    match given(obj, key) {
        Some(v @ Value::Number(n)) => match n.as_u64() {
            Some(u) => Ok(Some(u)),
            None => Err(bad(
                path,
                format!("must be a non-negative integer, got {v}"),
            )),
        },
        Some(other) => Err(bad(
            path,
            format!("must be a non-negative integer, got {}", kind(other)),
        )),
        None => Ok(None),
    }
}

fn as_obj<'a>(v: &'a Value, path: &str) -> Result<&'a Map<String, Value>, GatewayError> {
    v.as_object()
        .ok_or_else(|| bad(path, format!("must be an object, got {}", kind(v))))
}

/// Parses an Anthropic Messages request body into the internal conversation.
pub fn parse_request(body: &Value) -> Result<Conversation, GatewayError> {
    let obj = body.as_object().ok_or_else(|| {
        GatewayError::field(
            "body",
            format!("the request body must be a JSON object, got {}", kind(body)),
        )
    })?;
    let mut conv = Conversation::default();

    let model = req_str(obj, "model", "model")?;
    if model.is_empty() {
        return Err(bad("model", "must not be empty"));
    }
    conv.model = model.to_string();

    match opt_u64(obj, "max_tokens", "max_tokens")? {
        Some(0) => return Err(bad("max_tokens", "must be at least 1")),
        Some(n) => conv.sampling.max_tokens = Some(n),
        None => {
            return Err(bad(
                "max_tokens",
                "is required by the Anthropic Messages API (the most tokens the answer may have)",
            ));
        }
    }

    parse_system(obj, &mut conv)?;
    parse_messages(obj, &mut conv)?;
    parse_tools(obj, &mut conv)?;
    parse_tool_choice(obj, &mut conv)?;

    conv.sampling.temperature = opt_f64(obj, "temperature", "temperature")?;
    conv.sampling.top_p = opt_f64(obj, "top_p", "top_p")?;
    conv.sampling.top_k = opt_u64(obj, "top_k", "top_k")?;
    match given(obj, "stop_sequences") {
        Some(Value::Array(items)) => {
            for (k, item) in items.iter().enumerate() {
                match item {
                    Value::String(s) => conv.sampling.stop.push(s.clone()),
                    other => {
                        return Err(bad(
                            &format!("stop_sequences[{k}]"),
                            format!("must be a string, got {}", kind(other)),
                        ));
                    }
                }
            }
        }
        Some(other) => {
            return Err(bad(
                "stop_sequences",
                format!("must be an array of strings, got {}", kind(other)),
            ));
        }
        None => {}
    }

    parse_thinking(obj, &mut conv)?;
    conv.stream = opt_bool(obj, "stream", "stream")?.unwrap_or(false);

    let mut kept = Vec::new();
    for (key, value) in obj {
        if MAPPED_KEYS.contains(&key.as_str()) {
            continue;
        }
        conv.extra.insert(key.clone(), value.clone());
        if key != "metadata" {
            kept.push(key.as_str());
        }
    }
    if !kept.is_empty() {
        conv.notes.push(format!(
            "request fields kept for the record but not forwarded upstream: {}",
            kept.join(", ")
        ));
    }
    Ok(conv)
}

fn parse_system(obj: &Map<String, Value>, conv: &mut Conversation) -> Result<(), GatewayError> {
    let parts = match given(obj, "system") {
        None => return Ok(()),
        Some(Value::String(s)) if s.is_empty() => return Ok(()),
        Some(Value::String(s)) => vec![Part::Text { text: s.clone() }],
        Some(Value::Array(blocks)) => {
            let mut parts = Vec::new();
            for (j, block) in blocks.iter().enumerate() {
                let path = format!("system[{j}]");
                let b = as_obj(block, &path)?;
                let ty = req_str(b, "type", &format!("{path}.type"))?;
                if ty != "text" {
                    return Err(bad(
                        &format!("{path}.type"),
                        format!("must be \"text\", got \"{ty}\""),
                    ));
                }
                let text = req_str(b, "text", &format!("{path}.text"))?;
                parts.push(Part::Text {
                    text: text.to_string(),
                });
            }
            parts
        }
        Some(other) => {
            return Err(bad(
                "system",
                format!(
                    "must be a string or an array of text blocks, got {}",
                    kind(other)
                ),
            ));
        }
    };
    if !parts.is_empty() {
        conv.messages.push(Message {
            role: Role::System,
            content: parts,
            reasoning: None,
            tool_calls: vec![],
            tool_call_id: None,
            name: None,
        });
    }
    Ok(())
}

fn empty_message(role: Role) -> Message {
    Message {
        role,
        content: vec![],
        reasoning: None,
        tool_calls: vec![],
        tool_call_id: None,
        name: None,
    }
}

fn parse_messages(obj: &Map<String, Value>, conv: &mut Conversation) -> Result<(), GatewayError> {
    let messages = match given(obj, "messages") {
        Some(Value::Array(m)) => m,
        Some(other) => {
            return Err(bad(
                "messages",
                format!("must be an array, got {}", kind(other)),
            ));
        }
        None => return Err(bad("messages", "is required")),
    };
    if messages.is_empty() {
        return Err(bad("messages", "must contain at least one message"));
    }
    for (i, message) in messages.iter().enumerate() {
        let path = format!("messages[{i}]");
        let m = as_obj(message, &path)?;
        let role = match req_str(m, "role", &format!("{path}.role"))? {
            "user" => Role::User,
            "assistant" => Role::Assistant,
            other => {
                return Err(bad(
                    &format!("{path}.role"),
                    format!(
                        "must be \"user\" or \"assistant\", got \"{other}\" (system prompts go in the top-level `system` field)"
                    ),
                ));
            }
        };
        match given(m, "content") {
            Some(Value::String(s)) => conv.messages.push(Message::text(role, s.clone())),
            Some(Value::Array(blocks)) => {
                if role == Role::User {
                    parse_user_blocks(blocks, &path, conv)?;
                } else {
                    parse_assistant_blocks(blocks, &path, conv)?;
                }
            }
            Some(other) => {
                return Err(bad(
                    &format!("{path}.content"),
                    format!(
                        "must be a string or an array of content blocks, got {}",
                        kind(other)
                    ),
                ));
            }
            None => return Err(bad(&format!("{path}.content"), "is required")),
        }
    }
    Ok(())
}

/// A block's `type`, required to be a string.
fn block_type<'a>(b: &'a Map<String, Value>, path: &str) -> Result<&'a str, GatewayError> {
    req_str(b, "type", &format!("{path}.type"))
}

fn parse_user_blocks(
    blocks: &[Value],
    path: &str,
    conv: &mut Conversation,
) -> Result<(), GatewayError> {
    let mut results = Vec::new();
    let mut user = empty_message(Role::User);
    for (j, block) in blocks.iter().enumerate() {
        let bpath = format!("{path}.content[{j}]");
        let b = as_obj(block, &bpath)?;
        match block_type(b, &bpath)? {
            "text" => user.content.push(Part::Text {
                text: req_str(b, "text", &format!("{bpath}.text"))?.to_string(),
            }),
            "image" => user.content.push(parse_image(b, &bpath)?),
            "document" => match parse_document(b, &bpath)? {
                Some(part) => user.content.push(part),
                None => conv.notes.push(format!(
                    "{bpath}: a document block with a non-text source was dropped (no equivalent in other dialects)"
                )),
            },
            "tool_result" => results.push(parse_tool_result(b, &bpath, &mut conv.notes)?),
            ty @ ("tool_use" | "thinking" | "redacted_thinking") => {
                return Err(bad(
                    &format!("{bpath}.type"),
                    format!("\"{ty}\" blocks belong in assistant messages, not user messages"),
                ));
            }
            other => conv.notes.push(format!(
                "{bpath}: a \"{other}\" block was dropped (graft has no equivalent for it)"
            )),
        }
    }
    let had_results = !results.is_empty();
    conv.messages.extend(results);
    if !user.content.is_empty() || !had_results {
        conv.messages.push(user);
    }
    Ok(())
}

fn parse_assistant_blocks(
    blocks: &[Value],
    path: &str,
    conv: &mut Conversation,
) -> Result<(), GatewayError> {
    let mut msg = empty_message(Role::Assistant);
    for (j, block) in blocks.iter().enumerate() {
        let bpath = format!("{path}.content[{j}]");
        let b = as_obj(block, &bpath)?;
        match block_type(b, &bpath)? {
            "text" => msg.content.push(Part::Text {
                text: req_str(b, "text", &format!("{bpath}.text"))?.to_string(),
            }),
            "image" => msg.content.push(parse_image(b, &bpath)?),
            "tool_use" => {
                let id = req_str(b, "id", &format!("{bpath}.id"))?;
                let name = req_str(b, "name", &format!("{bpath}.name"))?;
                let arguments = match given(b, "input") {
                    Some(input @ Value::Object(_)) => input.to_string(),
                    Some(other) => {
                        return Err(bad(
                            &format!("{bpath}.input"),
                            format!("must be an object, got {}", kind(other)),
                        ));
                    }
                    None => "{}".to_string(),
                };
                msg.tool_calls.push(ToolCall {
                    id: id.to_string(),
                    name: name.to_string(),
                    arguments,
                });
            }
            "thinking" => {
                let thinking = req_str(b, "thinking", &format!("{bpath}.thinking"))?;
                match &mut msg.reasoning {
                    Some(r) => {
                        r.push('\n');
                        r.push_str(thinking);
                    }
                    None => msg.reasoning = Some(thinking.to_string()),
                }
            }
            "redacted_thinking" => conv.notes.push(format!(
                "{bpath}: a redacted_thinking block was dropped (its reasoning is encrypted; there is no text to keep)"
            )),
            "tool_result" => {
                return Err(bad(
                    &format!("{bpath}.type"),
                    "\"tool_result\" blocks belong in user messages, not assistant messages",
                ));
            }
            other => conv.notes.push(format!(
                "{bpath}: a \"{other}\" block was dropped (graft has no equivalent for it)"
            )),
        }
    }
    conv.messages.push(msg);
    Ok(())
}

fn parse_image(b: &Map<String, Value>, path: &str) -> Result<Part, GatewayError> {
    let spath = format!("{path}.source");
    let source = match given(b, "source") {
        Some(s) => as_obj(s, &spath)?,
        None => return Err(bad(&spath, "is required")),
    };
    match req_str(source, "type", &format!("{spath}.type"))? {
        "base64" => {
            let media_type = req_str(source, "media_type", &format!("{spath}.media_type"))?;
            let data = req_str(source, "data", &format!("{spath}.data"))?;
            Ok(Part::Image {
                url: format!("data:{media_type};base64,{data}"),
            })
        }
        "url" => Ok(Part::Image {
            url: req_str(source, "url", &format!("{spath}.url"))?.to_string(),
        }),
        other => Err(bad(
            &format!("{spath}.type"),
            format!("\"{other}\" image sources are not supported; send \"base64\" or \"url\""),
        )),
    }
}

/// A `document` block with a plain-text source becomes text; other sources (PDF, files)
/// have no equivalent and yield `None`.
fn parse_document(b: &Map<String, Value>, path: &str) -> Result<Option<Part>, GatewayError> {
    let spath = format!("{path}.source");
    let Some(source) = given(b, "source") else {
        return Err(bad(&spath, "is required"));
    };
    let source = as_obj(source, &spath)?;
    if opt_str(source, "type", &format!("{spath}.type"))? == Some("text") {
        let data = req_str(source, "data", &format!("{spath}.data"))?;
        return Ok(Some(Part::Text {
            text: data.to_string(),
        }));
    }
    Ok(None)
}

fn parse_tool_result(
    b: &Map<String, Value>,
    path: &str,
    notes: &mut Vec<String>,
) -> Result<Message, GatewayError> {
    let id = req_str(b, "tool_use_id", &format!("{path}.tool_use_id"))?;
    let mut msg = empty_message(Role::Tool);
    msg.tool_call_id = Some(id.to_string());
    match given(b, "content") {
        None => {}
        Some(Value::String(s)) => msg.content.push(Part::Text { text: s.clone() }),
        Some(Value::Array(blocks)) => {
            for (k, block) in blocks.iter().enumerate() {
                let cpath = format!("{path}.content[{k}]");
                let c = as_obj(block, &cpath)?;
                match block_type(c, &cpath)? {
                    "text" => msg.content.push(Part::Text {
                        text: req_str(c, "text", &format!("{cpath}.text"))?.to_string(),
                    }),
                    "image" => msg.content.push(parse_image(c, &cpath)?),
                    "document" => match parse_document(c, &cpath)? {
                        Some(part) => msg.content.push(part),
                        None => notes.push(format!(
                            "{cpath}: a document block with a non-text source was dropped"
                        )),
                    },
                    other => notes.push(format!(
                        "{cpath}: a \"{other}\" block in a tool_result was dropped"
                    )),
                }
            }
        }
        Some(other) => {
            return Err(bad(
                &format!("{path}.content"),
                format!(
                    "must be a string or an array of content blocks, got {}",
                    kind(other)
                ),
            ));
        }
    }
    if opt_bool(b, "is_error", &format!("{path}.is_error"))? == Some(true) {
        notes.push(format!(
            "{path}: tool_result is_error=true has no equivalent in other dialects; its content was passed on unchanged"
        ));
    }
    Ok(msg)
}

/// Anthropic server tools (run by Anthropic, not the client) have a versioned `type` such as
/// `web_search_20250305`; client tools have no `type`, `"custom"`, or carry an `input_schema`.
fn parse_tools(obj: &Map<String, Value>, conv: &mut Conversation) -> Result<(), GatewayError> {
    let tools = match given(obj, "tools") {
        None => return Ok(()),
        Some(Value::Array(t)) => t,
        Some(other) => {
            return Err(bad(
                "tools",
                format!("must be an array, got {}", kind(other)),
            ));
        }
    };
    let mut dropped = Vec::new();
    for (i, tool) in tools.iter().enumerate() {
        let path = format!("tools[{i}]");
        let t = as_obj(tool, &path)?;
        let ty = opt_str(t, "type", &format!("{path}.type"))?;
        let client = matches!(ty, None | Some("custom")) || given(t, "input_schema").is_some();
        if !client {
            let name = t.get("name").and_then(Value::as_str).unwrap_or("?");
            dropped.push(format!("{name} ({})", ty.unwrap_or("?")));
            continue;
        }
        let name = req_str(t, "name", &format!("{path}.name"))?;
        if name.is_empty() {
            return Err(bad(&format!("{path}.name"), "must not be empty"));
        }
        let description = opt_str(t, "description", &format!("{path}.description"))?;
        let schema = match given(t, "input_schema") {
            Some(s @ Value::Object(_)) => s.clone(),
            Some(other) => {
                return Err(bad(
                    &format!("{path}.input_schema"),
                    format!("must be a JSON Schema object, got {}", kind(other)),
                ));
            }
            None => return Err(bad(&format!("{path}.input_schema"), "is required")),
        };
        conv.tools.push(Tool {
            name: name.to_string(),
            description: description.map(str::to_string),
            parameters: schema,
            strict: opt_bool(t, "strict", &format!("{path}.strict"))?,
        });
    }
    if !dropped.is_empty() {
        conv.notes.push(format!(
            "dropped Anthropic server tools (graft forwards only client tools): {}",
            dropped.join(", ")
        ));
    }
    Ok(())
}

fn parse_tool_choice(
    obj: &Map<String, Value>,
    conv: &mut Conversation,
) -> Result<(), GatewayError> {
    let Some(choice) = given(obj, "tool_choice") else {
        return Ok(());
    };
    let c = as_obj(choice, "tool_choice")?;
    conv.tool_choice = Some(match req_str(c, "type", "tool_choice.type")? {
        "auto" => ToolChoice::Auto,
        "any" => ToolChoice::Required,
        "none" => ToolChoice::None,
        "tool" => {
            let name = req_str(c, "name", "tool_choice.name")?;
            if conv.tools.iter().any(|t| t.name == name) {
                ToolChoice::Function {
                    name: name.to_string(),
                }
            } else {
                conv.notes.push(format!(
                    "tool_choice names \"{name}\", which is not among the forwarded client tools; sent as \"auto\""
                ));
                ToolChoice::Auto
            }
        }
        other => {
            return Err(bad(
                "tool_choice.type",
                format!("must be one of \"auto\", \"any\", \"tool\", \"none\", got \"{other}\""),
            ));
        }
    });
    if let Some(disable) = opt_bool(
        c,
        "disable_parallel_tool_use",
        "tool_choice.disable_parallel_tool_use",
    )? {
        conv.parallel_tool_calls = Some(!disable);
    }
    Ok(())
}

fn parse_thinking(obj: &Map<String, Value>, conv: &mut Conversation) -> Result<(), GatewayError> {
    let Some(thinking) = given(obj, "thinking") else {
        return Ok(());
    };
    let t = as_obj(thinking, "thinking")?;
    match req_str(t, "type", "thinking.type")? {
        "enabled" => {
            let Some(budget) = opt_u64(t, "budget_tokens", "thinking.budget_tokens")? else {
                return Err(bad(
                    "thinking.budget_tokens",
                    "is required when thinking is enabled",
                ));
            };
            conv.reasoning = Some(Reasoning {
                budget_tokens: Some(budget),
                ..Reasoning::default()
            });
        }
        "disabled" => {}
        "adaptive" => {
            conv.reasoning = Some(Reasoning::default());
            conv.notes.push(
                "thinking.type \"adaptive\" forwarded as reasoning with no budget".to_string(),
            );
        }
        other => {
            return Err(bad(
                "thinking.type",
                format!("must be \"enabled\", \"disabled\" or \"adaptive\", got \"{other}\""),
            ));
        }
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// Answer
// ---------------------------------------------------------------------------------------------

/// The tool_use id sent to the client: the model's call id when it is a valid Anthropic id
/// (`[A-Za-z0-9_-]+`), a sanitized `toolu_` form of it otherwise, and a deterministic
/// `toolu_<message>_<n>` when the model gave none (so a whole answer and its stream agree).
fn tool_use_id(raw: &str, message_id: &str, index: usize) -> String {
    let valid = |c: char| c.is_ascii_alphanumeric() || c == '_' || c == '-';
    if !raw.is_empty() && raw.chars().all(valid) {
        return raw.to_string();
    }
    if !raw.is_empty() {
        let clean: String = raw
            .chars()
            .map(|c| if valid(c) { c } else { '_' })
            .collect();
        return format!("toolu_{clean}");
    }
    let base: String = message_id
        .strip_prefix("msg_")
        .unwrap_or(message_id)
        .chars()
        .filter(|c| valid(*c))
        .collect();
    format!("toolu_{base}_{index}")
}

/// A tool call's arguments as the `input` object Anthropic clients expect. Empty, invalid or
/// non-object arguments become `{}` (the raw text stays in the recorded answer).
fn tool_input(arguments: &str) -> Value {
    match serde_json::from_str::<Value>(arguments) {
        Ok(v @ Value::Object(_)) => v,
        _ => Value::Object(Map::new()),
    }
}

fn stop_reason(finish: Finish, has_tool_calls: bool) -> &'static str {
    match finish {
        Finish::Length => "max_tokens",
        Finish::ContentFilter => "refusal",
        Finish::Stop | Finish::ToolCalls if has_tool_calls => "tool_use",
        Finish::Stop | Finish::ToolCalls | Finish::Error => "end_turn",
    }
}

/// Anthropic usage. `TokenUsage::input_tokens` counts the whole prompt (OpenAI's convention,
/// cached tokens included); Anthropic's `input_tokens` excludes cache reads.
fn usage_json(usage: Option<&TokenUsage>) -> Value {
    let u = usage.copied().unwrap_or_default();
    let mut out = Map::new();
    out.insert(
        "input_tokens".into(),
        json!(u.input_tokens.saturating_sub(u.cached_tokens)),
    );
    out.insert("output_tokens".into(), json!(u.output_tokens));
    if u.cached_tokens > 0 {
        out.insert("cache_read_input_tokens".into(), json!(u.cached_tokens));
    }
    Value::Object(out)
}

fn model_name<'a>(conv: &'a Conversation, answer: Option<&'a Answer>) -> &'a str {
    match answer {
        Some(a) if conv.model.is_empty() => &a.model,
        _ => &conv.model,
    }
}

fn tool_use_block(call: &ToolCall, message_id: &str, index: usize) -> Value {
    json!({
        "type": "tool_use",
        "id": tool_use_id(&call.id, message_id, index),
        "name": call.name,
        "input": tool_input(&call.arguments),
    })
}

/// A whole (non-streamed) answer as an Anthropic `message` object.
pub fn render_answer(conv: &Conversation, answer: &Answer, message_id: &str) -> Value {
    let mut content = Vec::new();
    if let Some(r) = answer.reasoning.as_deref().filter(|r| !r.is_empty()) {
        content.push(json!({"type": "thinking", "thinking": r, "signature": ""}));
    }
    if !answer.text.is_empty() {
        content.push(json!({"type": "text", "text": answer.text}));
    }
    for (i, call) in answer.tool_calls.iter().enumerate() {
        content.push(tool_use_block(call, message_id, i));
    }
    json!({
        "id": message_id,
        "type": "message",
        "role": "assistant",
        "model": model_name(conv, Some(answer)),
        "content": content,
        "stop_reason": stop_reason(answer.finish, !answer.tool_calls.is_empty()),
        "stop_sequence": null,
        "usage": usage_json(answer.usage.as_ref()),
    })
}

// ---------------------------------------------------------------------------------------------
// Stream
// ---------------------------------------------------------------------------------------------

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum BlockKind {
    Text,
    Thinking,
}

#[derive(Debug, Default)]
struct PendingTool {
    id: String,
    name: String,
    arguments: String,
}

/// Emits Anthropic SSE events for one streamed answer. See the module docs for why tool_use
/// blocks are sent whole at the end.
pub struct AnthropicStream {
    message_id: String,
    model: String,
    started: bool,
    finished: bool,
    next_index: usize,
    open: Option<(usize, BlockKind)>,
    sent_text: bool,
    sent_thinking: bool,
    /// Tool calls by their delta index, in start order.
    tools: std::collections::BTreeMap<usize, PendingTool>,
    /// Argument pieces buffered since the last keep-alive `ping`.
    buffered_since_ping: usize,
}

/// Argument pieces buffered between two keep-alive pings while tool calls are being written.
const PING_EVERY: usize = 32;

/// A stream emitter for one answer to `conv`; `message_id` is the `msg_…` id sent to the client.
pub fn stream(conv: &Conversation, message_id: &str) -> AnthropicStream {
    AnthropicStream {
        message_id: message_id.to_string(),
        model: model_name(conv, None).to_string(),
        started: false,
        finished: false,
        next_index: 0,
        open: None,
        sent_text: false,
        sent_thinking: false,
        tools: std::collections::BTreeMap::new(),
        buffered_since_ping: 0,
    }
}

fn ping() -> Bytes {
    sse_named("ping", &json!({"type": "ping"}))
}

impl AnthropicStream {
    fn ensure_started(&mut self, out: &mut Vec<Bytes>) {
        if self.started {
            return;
        }
        self.started = true;
        out.push(sse_named(
            "message_start",
            &json!({
                "type": "message_start",
                "message": {
                    "id": self.message_id,
                    "type": "message",
                    "role": "assistant",
                    "content": [],
                    "model": self.model,
                    "stop_reason": null,
                    "stop_sequence": null,
                    "usage": {"input_tokens": 0, "output_tokens": 0},
                },
            }),
        ));
        out.push(ping());
    }

    fn close_open(&mut self, out: &mut Vec<Bytes>) {
        if let Some((index, _)) = self.open.take() {
            out.push(sse_named(
                "content_block_stop",
                &json!({"type": "content_block_stop", "index": index}),
            ));
        }
    }

    fn take_index(&mut self) -> usize {
        let i = self.next_index;
        self.next_index += 1;
        i
    }

    /// Streams a text or thinking piece, opening a block of that kind first if needed.
    fn piece(&mut self, kind: BlockKind, text: &str, out: &mut Vec<Bytes>) {
        if text.is_empty() {
            return;
        }
        let index = match self.open {
            Some((index, k)) if k == kind => index,
            _ => {
                self.close_open(out);
                let index = self.take_index();
                let block = match kind {
                    BlockKind::Text => json!({"type": "text", "text": ""}),
                    BlockKind::Thinking => {
                        json!({"type": "thinking", "thinking": "", "signature": ""})
                    }
                };
                out.push(sse_named(
                    "content_block_start",
                    &json!({"type": "content_block_start", "index": index, "content_block": block}),
                ));
                self.open = Some((index, kind));
                index
            }
        };
        let delta = match kind {
            BlockKind::Text => {
                self.sent_text = true;
                json!({"type": "text_delta", "text": text})
            }
            BlockKind::Thinking => {
                self.sent_thinking = true;
                json!({"type": "thinking_delta", "thinking": text})
            }
        };
        out.push(sse_named(
            "content_block_delta",
            &json!({"type": "content_block_delta", "index": index, "delta": delta}),
        ));
    }

    fn tool_block(&mut self, call: &ToolCall, n: usize, out: &mut Vec<Bytes>) {
        let index = self.take_index();
        let block = tool_use_block(call, &self.message_id, n);
        let input = block.get("input").cloned().unwrap_or_else(|| json!({}));
        let mut start = block;
        if let Some(o) = start.as_object_mut() {
            o.insert("input".into(), json!({}));
        }
        out.push(sse_named(
            "content_block_start",
            &json!({"type": "content_block_start", "index": index, "content_block": start}),
        ));
        out.push(sse_named(
            "content_block_delta",
            &json!({
                "type": "content_block_delta",
                "index": index,
                "delta": {"type": "input_json_delta", "partial_json": input.to_string()},
            }),
        ));
        out.push(sse_named(
            "content_block_stop",
            &json!({"type": "content_block_stop", "index": index}),
        ));
    }
}

impl StreamEmitter for AnthropicStream {
    fn start(&mut self) -> Vec<Bytes> {
        let mut out = Vec::new();
        self.ensure_started(&mut out);
        out
    }

    fn push(&mut self, delta: &Delta) -> Vec<Bytes> {
        let mut out = Vec::new();
        if self.finished {
            return out;
        }
        self.ensure_started(&mut out);
        match delta {
            Delta::Text(t) => self.piece(BlockKind::Text, t, &mut out),
            Delta::Reasoning(t) => self.piece(BlockKind::Thinking, t, &mut out),
            Delta::ToolCallStart { index, id, name } => {
                let tool = self.tools.entry(*index).or_default();
                tool.id.clone_from(id);
                tool.name.clone_from(name);
            }
            Delta::ToolCallArgs { index, arguments } => {
                self.tools
                    .entry(*index)
                    .or_default()
                    .arguments
                    .push_str(arguments);
                self.buffered_since_ping += 1;
                if self.buffered_since_ping >= PING_EVERY {
                    self.buffered_since_ping = 0;
                    out.push(ping());
                }
            }
        }
        out
    }

    fn finish(&mut self, answer: &Answer) -> Vec<Bytes> {
        let mut out = Vec::new();
        if self.finished {
            return out;
        }
        self.ensure_started(&mut out);
        self.finished = true;
        // Whatever the answer has that never arrived as a delta.
        if !self.sent_thinking
            && let Some(r) = answer.reasoning.as_deref()
        {
            self.piece(BlockKind::Thinking, r, &mut out);
        }
        if !self.sent_text {
            self.piece(BlockKind::Text, &answer.text, &mut out);
        }
        self.close_open(&mut out);

        // The assembled answer's calls are authoritative; the buffered deltas are the fallback.
        let buffered: Vec<ToolCall> = std::mem::take(&mut self.tools)
            .into_values()
            .map(|t| ToolCall {
                id: t.id,
                name: t.name,
                arguments: t.arguments,
            })
            .collect();
        let calls = if answer.tool_calls.is_empty() {
            &buffered
        } else {
            &answer.tool_calls
        };
        for (n, call) in calls.iter().enumerate() {
            self.tool_block(call, n, &mut out);
        }

        out.push(sse_named(
            "message_delta",
            &json!({
                "type": "message_delta",
                "delta": {
                    "stop_reason": stop_reason(answer.finish, !calls.is_empty()),
                    "stop_sequence": null,
                },
                "usage": usage_json(answer.usage.as_ref()),
            }),
        ));
        out.push(sse_named("message_stop", &json!({"type": "message_stop"})));
        out
    }
}

// ---------------------------------------------------------------------------------------------
// Errors
// ---------------------------------------------------------------------------------------------

/// Anthropic's `error.type` for an HTTP status (docs.claude.com/en/api/errors).
fn error_type(err: &GatewayError) -> &'static str {
    match err.status().as_u16() {
        401 => "authentication_error",
        403 => "permission_error",
        404 => "not_found_error",
        413 => "request_too_large",
        429 => "rate_limit_error",
        503 | 529 => "overloaded_error",
        s if s >= 500 => "api_error",
        _ => match err.error_type() {
            "rate_limit_error" => "rate_limit_error",
            "not_found_error" => "not_found_error",
            _ => "invalid_request_error",
        },
    }
}

/// The Anthropic error body: `{"type":"error","error":{"type":…,"message":…}}`.
pub fn error_body(err: &GatewayError) -> Value {
    json!({
        "type": "error",
        "error": {"type": error_type(err), "message": err.to_string()},
    })
}

/// The error as a mid-stream SSE event (`event: error`), as Anthropic sends it after a 200.
pub fn error_event(err: &GatewayError) -> Bytes {
    sse_named("error", &error_body(err))
}

// ---------------------------------------------------------------------------------------------
// Assembler
// ---------------------------------------------------------------------------------------------

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

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn parse_err(body: Value) -> (String, String) {
        match parse_request(&body) {
            Err(GatewayError::InvalidField { param, message }) => (param, message),
            other => panic!("expected an InvalidField error, got {other:?}"),
        }
    }

    /// Splits SSE bytes into (event name, data JSON), checking each event's name is its type.
    fn sse_events(chunks: &[Bytes]) -> Vec<(String, Value)> {
        let all: Vec<u8> = chunks.iter().flat_map(|c| c.iter().copied()).collect();
        let text = String::from_utf8(all).unwrap();
        assert!(text.ends_with("\n\n"), "stream must end with a blank line");
        let mut out = Vec::new();
        for raw in text.split("\n\n").filter(|e| !e.is_empty()) {
            let mut name = None;
            let mut data = None;
            for line in raw.lines() {
                if let Some(n) = line.strip_prefix("event: ") {
                    name = Some(n.to_string());
                } else if let Some(d) = line.strip_prefix("data: ") {
                    data = Some(serde_json::from_str::<Value>(d).unwrap());
                } else {
                    panic!("unexpected SSE line {line:?}");
                }
            }
            let (name, data) = (name.unwrap(), data.unwrap());
            assert_eq!(data["type"], name, "event name must equal data.type");
            out.push((name, data));
        }
        out
    }

    /// Block indexes start at 0 and increase by one, at most one block is open, deltas go to
    /// the open block, and every started block is stopped exactly once.
    fn check_block_discipline(events: &[(String, Value)]) {
        assert_eq!(events.first().unwrap().0, "message_start");
        assert_eq!(events.last().unwrap().0, "message_stop");
        assert_eq!(events[events.len() - 2].0, "message_delta");
        let mut next = 0u64;
        let mut open: Option<u64> = None;
        let mut stopped = Vec::new();
        for (name, data) in events {
            let index = data.get("index").and_then(Value::as_u64);
            match name.as_str() {
                "content_block_start" => {
                    assert_eq!(open, None, "a block started while another was open");
                    assert_eq!(index, Some(next), "block indexes must be contiguous");
                    open = index;
                    next += 1;
                }
                "content_block_delta" => assert_eq!(index, open, "delta to a block not open"),
                "content_block_stop" => {
                    assert_eq!(index, open, "stop of a block not open");
                    stopped.push(index.unwrap());
                    open = None;
                }
                "message_delta" | "message_stop" => assert_eq!(open, None),
                "message_start" | "ping" => {}
                other => panic!("unexpected event {other}"),
            }
        }
        assert_eq!(stopped, (0..next).collect::<Vec<_>>());
    }

    fn assemble(events: &[(String, Value)]) -> Value {
        let mut a = AnthropicAssembler::new();
        for (_, data) in events {
            a.push(data);
        }
        assert!(a.is_complete());
        a.finish().unwrap()
    }

    fn answer(text: &str, tool_calls: Vec<ToolCall>, finish: Finish) -> Answer {
        Answer {
            id: "chatcmpl-1".into(),
            model: "upstream-model".into(),
            created: 0,
            text: text.into(),
            reasoning: None,
            tool_calls,
            finish,
            usage: Some(TokenUsage {
                input_tokens: 120,
                output_tokens: 7,
                cached_tokens: 100,
                reasoning_tokens: 0,
            }),
        }
    }

    fn conv() -> Conversation {
        Conversation {
            model: "claude-sonnet-4-5".into(),
            ..Conversation::default()
        }
    }

    #[test]
    fn litellm_capture_parses() {
        // The body of shared/captures/litellm.anthropic-messages.json.
        let body = json!({
            "model": "claude-sonnet-4-5",
            "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
            "tools": [{
                "name": "get_weather",
                "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}},
                "type": "custom"
            }],
            "system": [{"type": "text", "text": "sys"}],
            "max_tokens": 64000
        });
        let c = parse_request(&body).unwrap();
        assert_eq!(c.model, "claude-sonnet-4-5");
        assert_eq!(
            c.messages,
            vec![
                Message::text(Role::System, "sys"),
                Message::text(Role::User, "hi")
            ]
        );
        assert_eq!(
            c.tools,
            vec![Tool {
                name: "get_weather".into(),
                description: None,
                parameters: json!({"type": "object", "properties": {"city": {"type": "string"}}}),
                strict: None,
            }]
        );
        assert_eq!(c.sampling.max_tokens, Some(64000));
        assert!(!c.stream);
        assert!(c.tool_choice.is_none());
        assert!(c.notes.is_empty(), "{:?}", c.notes);
        assert!(c.extra.is_empty());
    }

    #[test]
    fn multi_turn_tool_use_maps_to_tool_calls_and_tool_messages_in_order() {
        let body = json!({
            "model": "m",
            "max_tokens": 100,
            "system": "be brief",
            "messages": [
                {"role": "user", "content": "weather in Paris and Rome?"},
                {"role": "assistant", "content": [
                    {"type": "thinking", "thinking": "two cities", "signature": "sig"},
                    {"type": "text", "text": "Checking."},
                    {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris", "units": "c"}},
                    {"type": "tool_use", "id": "toolu_2", "name": "get_weather", "input": {"city": "Rome"}}
                ]},
                {"role": "user", "content": [
                    {"type": "tool_result", "tool_use_id": "toolu_1", "content": "18C"},
                    {"type": "tool_result", "tool_use_id": "toolu_2", "is_error": true,
                     "content": [{"type": "text", "text": "timeout"}]},
                    {"type": "text", "text": "and tomorrow?", "cache_control": {"type": "ephemeral"}}
                ]}
            ],
            "tool_choice": {"type": "any", "disable_parallel_tool_use": true},
            "temperature": 0.5, "top_p": 0.9, "top_k": 40,
            "stop_sequences": ["END"],
            "thinking": {"type": "enabled", "budget_tokens": 2048},
            "metadata": {"user_id": "u1"},
            "stream": true
        });
        let c = parse_request(&body).unwrap();
        let roles: Vec<Role> = c.messages.iter().map(|m| m.role).collect();
        assert_eq!(
            roles,
            vec![
                Role::System,
                Role::User,
                Role::Assistant,
                Role::Tool,
                Role::Tool,
                Role::User
            ]
        );
        let a = &c.messages[2];
        assert_eq!(a.reasoning.as_deref(), Some("two cities"));
        assert_eq!(a.joined_text(), "Checking.");
        assert_eq!(
            a.tool_calls,
            vec![
                ToolCall {
                    id: "toolu_1".into(),
                    name: "get_weather".into(),
                    arguments: r#"{"city":"Paris","units":"c"}"#.into(),
                },
                ToolCall {
                    id: "toolu_2".into(),
                    name: "get_weather".into(),
                    arguments: r#"{"city":"Rome"}"#.into(),
                },
            ]
        );
        assert_eq!(c.messages[3].tool_call_id.as_deref(), Some("toolu_1"));
        assert_eq!(c.messages[3].joined_text(), "18C");
        assert_eq!(c.messages[4].tool_call_id.as_deref(), Some("toolu_2"));
        assert_eq!(c.messages[4].joined_text(), "timeout");
        assert_eq!(c.messages[5].joined_text(), "and tomorrow?");
        assert_eq!(c.tool_choice, Some(ToolChoice::Required));
        assert_eq!(c.parallel_tool_calls, Some(false));
        assert_eq!(c.sampling.temperature, Some(0.5));
        assert_eq!(c.sampling.top_p, Some(0.9));
        assert_eq!(c.sampling.top_k, Some(40));
        assert_eq!(c.sampling.stop, vec!["END".to_string()]);
        assert_eq!(
            c.reasoning.as_ref().and_then(|r| r.budget_tokens),
            Some(2048)
        );
        assert_eq!(c.extra.get("metadata"), Some(&json!({"user_id": "u1"})));
        assert!(c.stream);
        assert!(
            c.notes.iter().any(|n| n.contains("is_error")),
            "{:?}",
            c.notes
        );
    }

    #[test]
    fn images_server_tools_and_odd_blocks() {
        let body = json!({
            "model": "m", "max_tokens": 10,
            "messages": [
                {"role": "user", "content": [
                    {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}},
                    {"type": "image", "source": {"type": "url", "url": "https://x/y.png"}},
                    {"type": "search_result", "source": "s", "title": "t", "content": []}
                ]},
                {"role": "assistant", "content": [
                    {"type": "redacted_thinking", "data": "opaque"},
                    {"type": "text", "text": "ok"}
                ]}
            ],
            "tools": [
                {"type": "web_search_20250305", "name": "web_search", "max_uses": 3},
                {"type": "bash_20250124", "name": "bash"},
                {"name": "read", "description": "read a file", "input_schema": {"type": "object"}, "strict": true}
            ],
            "tool_choice": {"type": "tool", "name": "web_search"},
            "service_tier": "auto"
        });
        let c = parse_request(&body).unwrap();
        assert_eq!(
            c.messages[0].content,
            vec![
                Part::Image {
                    url: "data:image/png;base64,AAAA".into()
                },
                Part::Image {
                    url: "https://x/y.png".into()
                },
            ]
        );
        assert_eq!(c.tools.len(), 1);
        assert_eq!(c.tools[0].name, "read");
        assert_eq!(c.tools[0].strict, Some(true));
        let notes = c.notes.join("\n");
        assert!(
            notes.contains("web_search (web_search_20250305)"),
            "{notes}"
        );
        assert!(notes.contains("bash (bash_20250124)"), "{notes}");
        assert!(notes.contains("redacted_thinking"), "{notes}");
        assert!(notes.contains("search_result"), "{notes}");
        assert!(notes.contains("service_tier"), "{notes}");
        assert_eq!(c.tool_choice, Some(ToolChoice::Auto));
        assert_eq!(c.extra.get("service_tier"), Some(&json!("auto")));
    }

    #[test]
    fn bad_inputs_name_their_path() {
        let ok_msgs = json!([{"role": "user", "content": "hi"}]);
        let with = |key: &str, value: Value| {
            let mut b = json!({"model": "m", "max_tokens": 5, "messages": ok_msgs});
            b[key] = value;
            b
        };
        let msgs = |m: Value| json!({"model": "m", "max_tokens": 5, "messages": m});
        let cases: Vec<(Value, &str)> = vec![
            (json!([1]), "body"),
            (json!({"model": "m", "messages": ok_msgs}), "max_tokens"),
            (with("max_tokens", json!("10")), "max_tokens"),
            (with("max_tokens", json!(0)), "max_tokens"),
            (json!({"max_tokens": 5, "messages": ok_msgs}), "model"),
            (with("model", json!(3)), "model"),
            (json!({"model": "m", "max_tokens": 5}), "messages"),
            (with("messages", json!({})), "messages"),
            (
                msgs(json!([{"role": "system", "content": "x"}])),
                "messages[0].role",
            ),
            (
                msgs(
                    json!([{"role": "user", "content": "a"}, {"role": "assistant", "content": 5}]),
                ),
                "messages[1].content",
            ),
            (
                msgs(json!([
                    {"role": "user", "content": "a"},
                    {"role": "assistant", "content": "b"},
                    {"role": "user", "content": [{"type": 7}]}
                ])),
                "messages[2].content[0].type",
            ),
            (
                msgs(json!([{"role": "user", "content": [{"type": "text"}]}])),
                "messages[0].content[0].text",
            ),
            (
                msgs(json!([{"role": "user", "content": ["hi"]}])),
                "messages[0].content[0]",
            ),
            (
                msgs(
                    json!([{"role": "user", "content": [{"type": "tool_use", "id": "a", "name": "b", "input": {}}]}]),
                ),
                "messages[0].content[0].type",
            ),
            (
                msgs(
                    json!([{"role": "user", "content": [{"type": "tool_result", "content": "x"}]}]),
                ),
                "messages[0].content[0].tool_use_id",
            ),
            (
                msgs(
                    json!([{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": [{"type": "text", "text": 1}]}]}]),
                ),
                "messages[0].content[0].content[0].text",
            ),
            (
                msgs(
                    json!([{"role": "user", "content": [{"type": "image", "source": {"type": "file", "file_id": "f"}}]}]),
                ),
                "messages[0].content[0].source.type",
            ),
            (
                msgs(
                    json!([{"role": "user", "content": "a"}, {"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "n", "input": "{}"}]}]),
                ),
                "messages[1].content[0].input",
            ),
            (
                msgs(
                    json!([{"role": "user", "content": "a"}, {"role": "assistant", "content": [{"type": "tool_use", "name": "n", "input": {}}]}]),
                ),
                "messages[1].content[0].id",
            ),
            (with("system", json!(5)), "system"),
            (with("system", json!([{"type": "image"}])), "system[0].type"),
            (
                with("tools", json!([{"name": "t"}])),
                "tools[0].input_schema",
            ),
            (
                with("tools", json!([{"input_schema": {}}])),
                "tools[0].name",
            ),
            (
                with(
                    "tools",
                    json!([{"name": "t", "input_schema": {}, "type": 1}]),
                ),
                "tools[0].type",
            ),
            (
                with("tool_choice", json!({"type": "bogus"})),
                "tool_choice.type",
            ),
            (
                with("tool_choice", json!({"type": "tool"})),
                "tool_choice.name",
            ),
            (
                with(
                    "tool_choice",
                    json!({"type": "auto", "disable_parallel_tool_use": "yes"}),
                ),
                "tool_choice.disable_parallel_tool_use",
            ),
            (with("temperature", json!("hot")), "temperature"),
            (with("top_k", json!(-1)), "top_k"),
            (with("stop_sequences", json!([1])), "stop_sequences[0]"),
            (
                with("thinking", json!({"type": "enabled"})),
                "thinking.budget_tokens",
            ),
            (
                with("thinking", json!({"type": "sometimes"})),
                "thinking.type",
            ),
            (with("stream", json!("yes")), "stream"),
        ];
        for (body, path) in cases {
            let (param, message) = parse_err(body.clone());
            assert_eq!(param, path, "body {body}");
            assert!(
                message.contains(path),
                "message {message:?} should name {path}"
            );
        }
    }

    #[test]
    fn unknown_keys_and_nulls_are_tolerated() {
        let body = json!({
            "model": "m", "max_tokens": 5, "temperature": null, "tools": null,
            "messages": [{"role": "user", "content": [{"type": "text", "text": "hi", "citations": null, "future": 1}], "extra": true}],
            "some_future_field": {"a": 1}
        });
        let c = parse_request(&body).unwrap();
        assert_eq!(c.messages, vec![Message::text(Role::User, "hi")]);
        assert_eq!(c.extra.get("some_future_field"), Some(&json!({"a": 1})));
    }

    #[test]
    fn render_text_answer() {
        let v = render_answer(&conv(), &answer("Hello!", vec![], Finish::Stop), "msg_1");
        assert_eq!(
            v,
            json!({
                "id": "msg_1", "type": "message", "role": "assistant", "model": "claude-sonnet-4-5",
                "content": [{"type": "text", "text": "Hello!"}],
                "stop_reason": "end_turn", "stop_sequence": null,
                "usage": {"input_tokens": 20, "output_tokens": 7, "cache_read_input_tokens": 100}
            })
        );
    }

    #[test]
    fn render_tool_use_answer() {
        let calls = vec![
            ToolCall {
                id: "call_abc".into(),
                name: "get_weather".into(),
                arguments: r#"{"city": "Paris"}"#.into(),
            },
            ToolCall {
                id: "".into(),
                name: "noop".into(),
                arguments: "".into(),
            },
            ToolCall {
                id: "fc:1/x".into(),
                name: "broken".into(),
                arguments: r#"{"a": "#.into(),
            },
        ];
        let mut a = answer("", calls, Finish::ToolCalls);
        a.reasoning = Some("think".into());
        let v = render_answer(&conv(), &a, "msg_42");
        assert_eq!(v["stop_reason"], "tool_use");
        assert_eq!(
            v["content"],
            json!([
                {"type": "thinking", "thinking": "think", "signature": ""},
                {"type": "tool_use", "id": "call_abc", "name": "get_weather", "input": {"city": "Paris"}},
                {"type": "tool_use", "id": "toolu_42_1", "name": "noop", "input": {}},
                {"type": "tool_use", "id": "toolu_fc_1_x", "name": "broken", "input": {}}
            ])
        );
        // A Chat upstream that says "stop" while calling tools still yields tool_use.
        let a = answer(
            "",
            vec![ToolCall {
                id: "c".into(),
                name: "n".into(),
                arguments: "{}".into(),
            }],
            Finish::Stop,
        );
        assert_eq!(
            render_answer(&conv(), &a, "msg_1")["stop_reason"],
            "tool_use"
        );
    }

    #[test]
    fn render_max_tokens_and_other_finishes() {
        let v = render_answer(&conv(), &answer("trunc", vec![], Finish::Length), "msg_1");
        assert_eq!(v["stop_reason"], "max_tokens");
        let v = render_answer(&conv(), &answer("", vec![], Finish::ContentFilter), "msg_1");
        assert_eq!(v["stop_reason"], "refusal");
        assert_eq!(v["content"], json!([]));
        let mut a = answer("x", vec![], Finish::Stop);
        a.usage = None;
        let v = render_answer(&conv(), &a, "msg_1");
        assert_eq!(v["usage"], json!({"input_tokens": 0, "output_tokens": 0}));
    }

    #[test]
    fn error_bodies() {
        let cases = [
            (
                GatewayError::field("messages", "messages is required"),
                400,
                "invalid_request_error",
            ),
            (
                GatewayError::Unauthorized("bad key".into()),
                401,
                "authentication_error",
            ),
            (
                GatewayError::Forbidden("no".into()),
                403,
                "permission_error",
            ),
            (
                GatewayError::UnknownSession("s".into()),
                404,
                "not_found_error",
            ),
            (
                GatewayError::BodyTooLarge { limit: 10 },
                413,
                "request_too_large",
            ),
            (
                GatewayError::SessionClosed("s".into()),
                409,
                "invalid_request_error",
            ),
            (
                GatewayError::RateLimited {
                    scope: "session 'a'".into(),
                    retry_after_secs: 2,
                },
                429,
                "rate_limit_error",
            ),
            (GatewayError::Internal("x".into()), 500, "api_error"),
            (
                GatewayError::UpstreamStatus {
                    upstream: "u".into(),
                    status: 500,
                    detail: "d".into(),
                },
                502,
                "api_error",
            ),
            (GatewayError::Record("disk".into()), 503, "overloaded_error"),
            (
                GatewayError::UpstreamTimeout {
                    upstream: "u".into(),
                    secs: 5,
                },
                504,
                "api_error",
            ),
        ];
        for (err, status, ty) in cases {
            assert_eq!(err.status().as_u16(), status);
            assert_eq!(
                error_body(&err),
                json!({"type": "error", "error": {"type": ty, "message": err.to_string()}})
            );
        }
        let e = GatewayError::UpstreamStream {
            upstream: "u".into(),
            detail: "reset".into(),
        };
        let bytes = error_event(&e);
        let text = std::str::from_utf8(&bytes).unwrap();
        assert!(text.starts_with("event: error\ndata: {"), "{text}");
        assert!(text.ends_with("\n\n"));
        let events = sse_events(std::slice::from_ref(&bytes));
        assert_eq!(events[0].1, error_body(&e));
        let mut a = AnthropicAssembler::new();
        a.push(&events[0].1);
        assert_eq!(a.error().unwrap()["type"], "api_error");
        assert!(a.finish().is_none());
    }

    #[test]
    fn stream_of_a_text_answer_has_anthropic_event_order() {
        let c = conv();
        let mut s = stream(&c, "msg_1");
        let mut out = s.start();
        out.extend(s.push(&Delta::Text("Hel".into())));
        out.extend(s.push(&Delta::Text("lo".into())));
        out.extend(s.finish(&answer("Hello", vec![], Finish::Stop)));
        let events = sse_events(&out);
        let names: Vec<&str> = events.iter().map(|(n, _)| n.as_str()).collect();
        assert_eq!(
            names,
            [
                "message_start",
                "ping",
                "content_block_start",
                "content_block_delta",
                "content_block_delta",
                "content_block_stop",
                "message_delta",
                "message_stop"
            ]
        );
        assert_eq!(
            events[0].1["message"],
            json!({
                "id": "msg_1", "type": "message", "role": "assistant", "content": [],
                "model": "claude-sonnet-4-5", "stop_reason": null, "stop_sequence": null,
                "usage": {"input_tokens": 0, "output_tokens": 0}
            })
        );
        assert_eq!(
            events[2].1,
            json!({"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}})
        );
        assert_eq!(
            events[3].1,
            json!({"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": "Hel"}})
        );
        assert_eq!(
            events[6].1,
            json!({
                "type": "message_delta",
                "delta": {"stop_reason": "end_turn", "stop_sequence": null},
                "usage": {"input_tokens": 20, "output_tokens": 7, "cache_read_input_tokens": 100}
            })
        );
        check_block_discipline(&events);
        assert_eq!(
            assemble(&events),
            render_answer(&c, &answer("Hello", vec![], Finish::Stop), "msg_1")
        );
    }

    #[test]
    fn stream_handles_interleaved_tool_args_and_an_answer_without_deltas() {
        let c = conv();
        let calls = vec![
            ToolCall {
                id: "call_a".into(),
                name: "f".into(),
                arguments: r#"{"x":1}"#.into(),
            },
            ToolCall {
                id: "call_b".into(),
                name: "g".into(),
                arguments: r#"{"y":2}"#.into(),
            },
        ];
        let a = answer("", calls, Finish::ToolCalls);
        let mut s = stream(&c, "msg_1");
        let mut out = s.start();
        for d in [
            Delta::ToolCallStart {
                index: 0,
                id: "call_a".into(),
                name: "f".into(),
            },
            Delta::ToolCallStart {
                index: 1,
                id: "call_b".into(),
                name: "g".into(),
            },
            Delta::ToolCallArgs {
                index: 0,
                arguments: r#"{"x""#.into(),
            },
            Delta::ToolCallArgs {
                index: 1,
                arguments: r#"{"y":2}"#.into(),
            },
            Delta::ToolCallArgs {
                index: 0,
                arguments: ":1}".into(),
            },
        ] {
            out.extend(s.push(&d));
        }
        out.extend(s.finish(&a));
        let events = sse_events(&out);
        check_block_discipline(&events);
        assert_eq!(assemble(&events), render_answer(&c, &a, "msg_1"));
        assert_eq!(
            events[2].1["content_block"],
            json!({"type": "tool_use", "id": "call_a", "name": "f", "input": {}})
        );

        // No deltas at all (e.g. a non-streamed upstream answer): finish sends everything.
        let mut a = answer("done", vec![], Finish::Stop);
        a.reasoning = Some("hmm".into());
        let mut s = stream(&c, "msg_2");
        let mut out = s.start();
        out.extend(s.finish(&a));
        out.extend(s.finish(&a)); // a second finish emits nothing
        let events = sse_events(&out);
        check_block_discipline(&events);
        assert_eq!(assemble(&events), render_answer(&c, &a, "msg_2"));
    }

    #[test]
    fn tool_use_ids() {
        assert_eq!(tool_use_id("toolu_01A-b", "msg_x", 0), "toolu_01A-b");
        assert_eq!(
            tool_use_id("chatcmpl-tool-9f", "msg_x", 0),
            "chatcmpl-tool-9f"
        );
        assert_eq!(tool_use_id("call 1.2", "msg_x", 0), "toolu_call_1_2");
        assert_eq!(tool_use_id("", "msg_0193ab", 3), "toolu_0193ab_3");
    }

    #[test]
    fn assembler_keeps_signature_citations_and_unparseable_input() {
        let mut a = AnthropicAssembler::new();
        for e in [
            json!({"type": "message_start", "message": {"id": "msg_1", "type": "message", "role": "assistant", "content": [], "model": "claude", "stop_reason": null, "stop_sequence": null, "usage": {"input_tokens": 9, "output_tokens": 1}}}),
            json!({"type": "content_block_start", "index": 0, "content_block": {"type": "thinking", "thinking": "", "signature": ""}}),
            json!({"type": "content_block_delta", "index": 0, "delta": {"type": "thinking_delta", "thinking": "a"}}),
            json!({"type": "content_block_delta", "index": 0, "delta": {"type": "signature_delta", "signature": "SIG"}}),
            json!({"type": "content_block_stop", "index": 0}),
            json!({"type": "content_block_start", "index": 1, "content_block": {"type": "text", "text": ""}}),
            json!({"type": "content_block_delta", "index": 1, "delta": {"type": "citations_delta", "citation": {"cited_text": "c"}}}),
            json!({"type": "content_block_stop", "index": 1}),
            json!({"type": "content_block_start", "index": 2, "content_block": {"type": "tool_use", "id": "t", "name": "n", "input": {}}}),
            json!({"type": "content_block_delta", "index": 2, "delta": {"type": "input_json_delta", "partial_json": "{\"a\": "}}),
            json!({"type": "content_block_stop", "index": 2}),
            json!({"type": "message_delta", "delta": {"stop_reason": "tool_use", "stop_sequence": null}, "usage": {"output_tokens": 30}}),
        ] {
            a.push(&e);
        }
        assert!(!a.is_complete());
        let m = a.finish().unwrap();
        assert_eq!(m["content"][0]["signature"], "SIG");
        assert_eq!(m["content"][1]["citations"], json!([{"cited_text": "c"}]));
        assert_eq!(m["content"][2]["input"], json!("{\"a\": "));
        assert_eq!(m["usage"], json!({"input_tokens": 9, "output_tokens": 30}));
        assert_eq!(m["stop_reason"], "tool_use");
    }

    // ---- property: deltas chopped anywhere → stream → assembler == render_answer ----

    fn leaf() -> impl Strategy<Value = Value> {
        prop_oneof![
            Just(Value::Null),
            any::<bool>().prop_map(Value::Bool),
            any::<i64>().prop_map(|n| json!(n)),
            "[a-z \"\\\\é😀\n]{0,12}".prop_map(Value::String),
        ]
    }

    fn json_args() -> impl Strategy<Value = String> {
        let value = leaf().prop_recursive(2, 12, 4, |inner| {
            prop_oneof![
                prop::collection::vec(inner.clone(), 0..4).prop_map(Value::Array),
                prop::collection::btree_map("[a-z_]{1,6}", inner, 0..4)
                    .prop_map(|m| Value::Object(m.into_iter().collect())),
            ]
        });
        prop::collection::btree_map("[a-z_]{1,6}", value, 0..4)
            .prop_map(|m| Value::Object(m.into_iter().collect()).to_string())
    }

    fn arb_answer() -> impl Strategy<Value = Answer> {
        let call = (
            prop_oneof![
                "call_[a-zA-Z0-9]{4,10}".boxed(),
                Just(String::new()).boxed(),
                "fc:[a-z]{1,4}".boxed()
            ],
            "[a-z_]{1,10}",
            json_args(),
        )
            .prop_map(|(id, name, arguments)| ToolCall {
                id,
                name,
                arguments,
            });
        (
            "[a-zA-Z0-9 .,\"\\\\é😀\n]{0,40}",
            prop::option::of("[a-z .é😀\n]{0,30}"),
            prop::collection::vec(call, 0..=3),
            prop_oneof![
                Just(Finish::Stop),
                Just(Finish::Length),
                Just(Finish::ToolCalls),
                Just(Finish::ContentFilter),
                Just(Finish::Error)
            ],
            prop::option::of((0u64..100_000, 0u64..10_000, 0u64..100_000)),
        )
            .prop_map(|(text, reasoning, tool_calls, finish, usage)| Answer {
                id: "chatcmpl-x".into(),
                model: "upstream".into(),
                created: 1,
                text,
                reasoning,
                tool_calls,
                finish,
                usage: usage.map(|(input, output, cached)| TokenUsage {
                    input_tokens: input,
                    output_tokens: output,
                    cached_tokens: cached.min(input),
                    reasoning_tokens: 0,
                }),
            })
    }

    /// Splits `s` into pieces of `sizes[k % len]` chars (an empty piece list for "").
    fn chop(s: &str, sizes: &[usize]) -> Vec<String> {
        let chars: Vec<char> = s.chars().collect();
        let mut out = Vec::new();
        let mut at = 0;
        let mut k = 0;
        while at < chars.len() {
            let n = sizes
                .get(k % sizes.len().max(1))
                .copied()
                .unwrap_or(chars.len())
                .max(1);
            let end = (at + n).min(chars.len());
            out.push(chars[at..end].iter().collect());
            at = end;
            k += 1;
        }
        out
    }

    fn deltas(a: &Answer, sizes: &[usize], interleave: bool) -> Vec<Delta> {
        let mut out = Vec::new();
        if let Some(r) = &a.reasoning {
            out.extend(chop(r, sizes).into_iter().map(Delta::Reasoning));
        }
        out.extend(chop(&a.text, sizes).into_iter().map(Delta::Text));
        let args: Vec<Vec<String>> = a
            .tool_calls
            .iter()
            .map(|c| chop(&c.arguments, sizes))
            .collect();
        if interleave {
            for (index, c) in a.tool_calls.iter().enumerate() {
                out.push(Delta::ToolCallStart {
                    index,
                    id: c.id.clone(),
                    name: c.name.clone(),
                });
            }
            let longest = args.iter().map(Vec::len).max().unwrap_or(0);
            for k in 0..longest {
                for (index, pieces) in args.iter().enumerate() {
                    if let Some(p) = pieces.get(k) {
                        out.push(Delta::ToolCallArgs {
                            index,
                            arguments: p.clone(),
                        });
                    }
                }
            }
        } else {
            for (index, c) in a.tool_calls.iter().enumerate() {
                out.push(Delta::ToolCallStart {
                    index,
                    id: c.id.clone(),
                    name: c.name.clone(),
                });
                for p in &args[index] {
                    out.push(Delta::ToolCallArgs {
                        index,
                        arguments: p.clone(),
                    });
                }
            }
        }
        out
    }

    proptest! {
        #[test]
        fn chopped_stream_reassembles_to_render_answer(
            a in arb_answer(),
            sizes in prop::collection::vec(1usize..8, 1..6),
            interleave in any::<bool>(),
            byte_cut in 1usize..64,
        ) {
            let c = conv();
            let mut s = stream(&c, "msg_prop");
            let mut out = s.start();
            for d in deltas(&a, &sizes, interleave) {
                out.extend(s.push(&d));
            }
            out.extend(s.finish(&a));
            // Re-chunk the bytes at arbitrary boundaries before parsing.
            let all: Vec<u8> = out.iter().flat_map(|b| b.iter().copied()).collect();
            let rechunked: Vec<Bytes> = all.chunks(byte_cut).map(Bytes::copy_from_slice).collect();
            let events = sse_events(&rechunked);
            check_block_discipline(&events);
            let got = assemble(&events);
            let want = render_answer(&c, &a, "msg_prop");
            prop_assert_eq!(&got["content"], &want["content"]);
            prop_assert_eq!(&got["stop_reason"], &want["stop_reason"]);
            prop_assert_eq!(&got["usage"], &want["usage"]);
            prop_assert_eq!(got, want);
        }
    }
}

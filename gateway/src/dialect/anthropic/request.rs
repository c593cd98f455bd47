//! Anthropic Messages requests → [`Conversation`].

use serde_json::{Map, Value};

use crate::dialect::json::{Fields, Wording, given};
use crate::dialect::{
    Conversation, Message, Part, Reasoning, Role, Tool, ToolCall, ToolChoice, kind,
};
use crate::error::GatewayError;

const F: Fields = Fields(Wording::Anthropic);

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
    "output_config",
];

/// Parses an Anthropic Messages request body into the internal conversation.
pub fn parse_request(body: &Value) -> Result<Conversation, GatewayError> {
    let obj = body.as_object().ok_or_else(|| {
        GatewayError::field(
            "body",
            format!("the request body must be a JSON object, got {}", kind(body)),
        )
    })?;
    let mut conv = Conversation::default();

    let model = F.req_str(obj, "model", "model")?;
    if model.is_empty() {
        return Err(F.bad("model", "must not be empty"));
    }
    conv.model = model.to_string();

    match F.opt_u64(obj, "max_tokens", "max_tokens")? {
        Some(0) => return Err(F.bad("max_tokens", "must be at least 1")),
        Some(n) => conv.sampling.max_tokens = Some(n),
        None => {
            return Err(F.bad(
                "max_tokens",
                "is required by the Anthropic Messages API (the most tokens the answer may have)",
            ));
        }
    }

    parse_system(obj, &mut conv)?;
    parse_messages(obj, &mut conv)?;
    parse_tools(obj, &mut conv)?;
    parse_tool_choice(obj, &mut conv)?;

    conv.sampling.temperature = F.opt_f64(obj, "temperature", "temperature")?;
    conv.sampling.top_p = F.opt_f64(obj, "top_p", "top_p")?;
    conv.sampling.top_k = F.opt_u64(obj, "top_k", "top_k")?;
    match given(obj, "stop_sequences") {
        Some(Value::Array(items)) => {
            for (k, item) in items.iter().enumerate() {
                match item {
                    Value::String(s) => conv.sampling.stop.push(s.clone()),
                    other => {
                        return Err(F.bad(
                            &format!("stop_sequences[{k}]"),
                            format!("must be a string, got {}", kind(other)),
                        ));
                    }
                }
            }
        }
        Some(other) => {
            return Err(F.bad(
                "stop_sequences",
                format!("must be an array of strings, got {}", kind(other)),
            ));
        }
        None => {}
    }

    parse_thinking(obj, &mut conv)?;
    parse_output_config(obj, &mut conv)?;
    conv.stream = F.opt_bool(obj, "stream", "stream")?.unwrap_or(false);

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

/// `output_config`: its `format` (`{"type": "json_schema", "schema": {...}}`, structured
/// output, e.g. Claude Code's title call) is the conversation's; anything else in it is
/// kept for the record.
fn parse_output_config(
    obj: &Map<String, Value>,
    conv: &mut Conversation,
) -> Result<(), GatewayError> {
    let Some(cfg) = given(obj, "output_config") else {
        return Ok(());
    };
    let cfg = F.as_obj(cfg, "output_config")?;
    if let Some(format) = given(cfg, "format") {
        let f = F.as_obj(format, "output_config.format")?;
        match f.get("type").and_then(Value::as_str) {
            Some("json_schema") => match f.get("schema") {
                Some(s @ (Value::Object(_) | Value::Bool(_))) => {
                    conv.sampling.format = Some(crate::dialect::OutputFormat::JsonSchema {
                        schema: s.clone(),
                        name: None,
                        strict: None,
                    });
                }
                _ => {
                    return Err(F.bad(
                        "output_config.format.schema",
                        "must be a JSON schema (an object)",
                    ));
                }
            },
            other => {
                return Err(F.bad(
                    "output_config.format.type",
                    format!(
                        "must be \"json_schema\", got {}",
                        other.map_or_else(|| "nothing".to_string(), |t| format!("{t:?}"))
                    ),
                ));
            }
        }
    }
    let rest: Map<String, Value> = cfg
        .iter()
        .filter(|(k, _)| k.as_str() != "format")
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect();
    if !rest.is_empty() {
        conv.notes.push(format!(
            "output_config fields kept for the record but not forwarded upstream: {}",
            rest.keys().cloned().collect::<Vec<_>>().join(", ")
        ));
        conv.extra
            .insert("output_config".into(), Value::Object(rest));
    }
    Ok(())
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
                let b = F.as_obj(block, &path)?;
                let ty = F.req_str(b, "type", &format!("{path}.type"))?;
                if ty != "text" {
                    return Err(F.bad(
                        &format!("{path}.type"),
                        format!("must be \"text\", got \"{ty}\""),
                    ));
                }
                let text = F.req_str(b, "text", &format!("{path}.text"))?;
                parts.push(Part::Text {
                    text: text.to_string(),
                });
            }
            parts
        }
        Some(other) => {
            return Err(F.bad(
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
            return Err(F.bad("messages", format!("must be an array, got {}", kind(other))));
        }
        None => return Err(F.bad("messages", "is required")),
    };
    if messages.is_empty() {
        return Err(F.bad("messages", "must contain at least one message"));
    }
    for (i, message) in messages.iter().enumerate() {
        let path = format!("messages[{i}]");
        let m = F.as_obj(message, &path)?;
        let role = match F.req_str(m, "role", &format!("{path}.role"))? {
            "user" => Role::User,
            "assistant" => Role::Assistant,
            // Claude Code (2.1) sends mid-conversation `system` messages (text only), e.g.
            // the list of agent types after the first user turn.
            "system" => {
                conv.messages.push(parse_system_message(m, &path)?);
                continue;
            }
            other => {
                return Err(F.bad(
                    &format!("{path}.role"),
                    format!("must be \"user\", \"assistant\" or \"system\", got \"{other}\""),
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
                return Err(F.bad(
                    &format!("{path}.content"),
                    format!(
                        "must be a string or an array of content blocks, got {}",
                        kind(other)
                    ),
                ));
            }
            None => return Err(F.bad(&format!("{path}.content"), "is required")),
        }
    }
    Ok(())
}

/// A `system` message inside `messages`: a string or text blocks.
fn parse_system_message(m: &Map<String, Value>, path: &str) -> Result<Message, GatewayError> {
    let mut msg = empty_message(Role::System);
    match given(m, "content") {
        Some(Value::String(s)) => msg.content.push(Part::Text { text: s.clone() }),
        Some(Value::Array(blocks)) => {
            for (j, block) in blocks.iter().enumerate() {
                let bpath = format!("{path}.content[{j}]");
                let b = F.as_obj(block, &bpath)?;
                let ty = block_type(b, &bpath)?;
                if ty != "text" {
                    return Err(F.bad(
                        &format!("{bpath}.type"),
                        format!("must be \"text\" in a system message, got \"{ty}\""),
                    ));
                }
                msg.content.push(Part::Text {
                    text: F.req_str(b, "text", &format!("{bpath}.text"))?.to_string(),
                });
            }
        }
        Some(other) => {
            return Err(F.bad(
                &format!("{path}.content"),
                format!(
                    "must be a string or an array of text blocks, got {}",
                    kind(other)
                ),
            ));
        }
        None => return Err(F.bad(&format!("{path}.content"), "is required")),
    }
    Ok(msg)
}

/// A block's `type`, required to be a string.
fn block_type<'a>(b: &'a Map<String, Value>, path: &str) -> Result<&'a str, GatewayError> {
    F.req_str(b, "type", &format!("{path}.type"))
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
        let b = F.as_obj(block, &bpath)?;
        let ty = block_type(b, &bpath)?;
        if push_content_block(ty, b, &bpath, &mut user.content, &mut conv.notes)? {
            continue;
        }
        match ty {
            "tool_result" => results.push(parse_tool_result(b, &bpath, &mut conv.notes)?),
            ty @ ("tool_use" | "thinking" | "redacted_thinking") => {
                return Err(F.bad(
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
        let b = F.as_obj(block, &bpath)?;
        match block_type(b, &bpath)? {
            "text" => msg.content.push(Part::Text {
                text: F.req_str(b, "text", &format!("{bpath}.text"))?.to_string(),
            }),
            "image" => msg.content.push(parse_image(b, &bpath)?),
            "tool_use" => {
                let id = F.req_str(b, "id", &format!("{bpath}.id"))?;
                let name = F.req_str(b, "name", &format!("{bpath}.name"))?;
                let arguments = match given(b, "input") {
                    Some(input @ Value::Object(_)) => input.to_string(),
                    Some(other) => {
                        return Err(F.bad(
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
                let thinking = F.req_str(b, "thinking", &format!("{bpath}.thinking"))?;
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
                return Err(F.bad(
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
        Some(s) => F.as_obj(s, &spath)?,
        None => return Err(F.bad(&spath, "is required")),
    };
    match F.req_str(source, "type", &format!("{spath}.type"))? {
        "base64" => {
            let media_type = F.req_str(source, "media_type", &format!("{spath}.media_type"))?;
            let data = F.req_str(source, "data", &format!("{spath}.data"))?;
            Ok(Part::Image {
                url: format!("data:{media_type};base64,{data}"),
            })
        }
        "url" => Ok(Part::Image {
            url: F
                .req_str(source, "url", &format!("{spath}.url"))?
                .to_string(),
        }),
        other => Err(F.bad(
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
        return Err(F.bad(&spath, "is required"));
    };
    let source = F.as_obj(source, &spath)?;
    if F.opt_str(source, "type", &format!("{spath}.type"))? == Some("text") {
        let data = F.req_str(source, "data", &format!("{spath}.data"))?;
        return Ok(Some(Part::Text {
            text: data.to_string(),
        }));
    }
    Ok(None)
}

/// Adds a `text`, `image` or `document` block (of a user message or a tool result) to
/// `content`; a document whose source has no text is dropped with a note. Returns false,
/// adding nothing, for any other block type.
fn push_content_block(
    ty: &str,
    b: &Map<String, Value>,
    bpath: &str,
    content: &mut Vec<Part>,
    notes: &mut Vec<String>,
) -> Result<bool, GatewayError> {
    match ty {
        "text" => content.push(Part::Text {
            text: F.req_str(b, "text", &format!("{bpath}.text"))?.to_string(),
        }),
        "image" => content.push(parse_image(b, bpath)?),
        "document" => match parse_document(b, bpath)? {
            Some(part) => content.push(part),
            None => notes.push(format!(
                "{bpath}: a document block with a non-text source was dropped (no equivalent in other dialects)"
            )),
        },
        _ => return Ok(false),
    }
    Ok(true)
}

fn parse_tool_result(
    b: &Map<String, Value>,
    path: &str,
    notes: &mut Vec<String>,
) -> Result<Message, GatewayError> {
    let id = F.req_str(b, "tool_use_id", &format!("{path}.tool_use_id"))?;
    let mut msg = empty_message(Role::Tool);
    msg.tool_call_id = Some(id.to_string());
    match given(b, "content") {
        None => {}
        Some(Value::String(s)) => msg.content.push(Part::Text { text: s.clone() }),
        Some(Value::Array(blocks)) => {
            for (k, block) in blocks.iter().enumerate() {
                let cpath = format!("{path}.content[{k}]");
                let c = F.as_obj(block, &cpath)?;
                let ty = block_type(c, &cpath)?;
                if !push_content_block(ty, c, &cpath, &mut msg.content, notes)? {
                    notes.push(format!(
                        "{cpath}: a \"{ty}\" block in a tool_result was dropped"
                    ));
                }
            }
        }
        Some(other) => {
            return Err(F.bad(
                &format!("{path}.content"),
                format!(
                    "must be a string or an array of content blocks, got {}",
                    kind(other)
                ),
            ));
        }
    }
    if F.opt_bool(b, "is_error", &format!("{path}.is_error"))? == Some(true) {
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
            return Err(F.bad("tools", format!("must be an array, got {}", kind(other))));
        }
    };
    let mut dropped = Vec::new();
    for (i, tool) in tools.iter().enumerate() {
        let path = format!("tools[{i}]");
        let t = F.as_obj(tool, &path)?;
        let ty = F.opt_str(t, "type", &format!("{path}.type"))?;
        let client = matches!(ty, None | Some("custom")) || given(t, "input_schema").is_some();
        if !client {
            let name = t.get("name").and_then(Value::as_str).unwrap_or("?");
            dropped.push(format!("{name} ({})", ty.unwrap_or("?")));
            continue;
        }
        let name = F.req_str(t, "name", &format!("{path}.name"))?;
        if name.is_empty() {
            return Err(F.bad(&format!("{path}.name"), "must not be empty"));
        }
        let description = F.opt_str(t, "description", &format!("{path}.description"))?;
        let schema = match given(t, "input_schema") {
            Some(s @ Value::Object(_)) => s.clone(),
            Some(other) => {
                return Err(F.bad(
                    &format!("{path}.input_schema"),
                    format!("must be a JSON Schema object, got {}", kind(other)),
                ));
            }
            None => return Err(F.bad(&format!("{path}.input_schema"), "is required")),
        };
        conv.tools.push(Tool {
            name: name.to_string(),
            description: description.map(str::to_string),
            parameters: schema,
            strict: F.opt_bool(t, "strict", &format!("{path}.strict"))?,
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
    let c = F.as_obj(choice, "tool_choice")?;
    conv.tool_choice = Some(match F.req_str(c, "type", "tool_choice.type")? {
        "auto" => ToolChoice::Auto,
        "any" => ToolChoice::Required,
        "none" => ToolChoice::None,
        "tool" => {
            let name = F.req_str(c, "name", "tool_choice.name")?;
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
            return Err(F.bad(
                "tool_choice.type",
                format!("must be one of \"auto\", \"any\", \"tool\", \"none\", got \"{other}\""),
            ));
        }
    });
    if let Some(disable) = F.opt_bool(
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
    let t = F.as_obj(thinking, "thinking")?;
    match F.req_str(t, "type", "thinking.type")? {
        "enabled" => {
            let Some(budget) = F.opt_u64(t, "budget_tokens", "thinking.budget_tokens")? else {
                return Err(F.bad(
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
            return Err(F.bad(
                "thinking.type",
                format!("must be \"enabled\", \"disabled\" or \"adaptive\", got \"{other}\""),
            ));
        }
    }
    Ok(())
}

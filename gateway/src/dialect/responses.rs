//! The OpenAI Responses API dialect (`POST /v1/responses`), as the OpenAI SDKs and Codex speak it.
//!
//! - [`parse_request`]: a Responses request body → [`Conversation`]. graft is stateless here:
//!   `previous_response_id` / `conversation` are refused (Codex sends `store: false` and the full
//!   history every turn). Hosted and non-function tools are dropped with a note; Codex's freeform
//!   `custom` tools (e.g. `apply_patch` with a grammar) become a function with one string
//!   argument `input`, and calls to them are rendered back as `custom_tool_call` items.
//! - [`render_answer`]: an [`Answer`] → a whole `response` object.
//! - [`ResponsesStream`]: deltas → the SSE events OpenAI's servers send, in their order
//!   (`response.created`, `response.in_progress`, per item `response.output_item.added` … `done`,
//!   then `response.completed` / `response.incomplete` / `response.failed` with `usage`).
//! - [`error_event`] / [`ResponsesStream::fail`]: a mid-stream failure.
//! - [`ResponsesAssembler`]: events → the final `response` object (tests, passthrough recording).
//!
//! Output item ids are derived from the response id (`msg_<id>_<n>`, `fc_<id>_<n>`,
//! `rs_<id>_<n>`, `ctc_<id>_<n>`, with `<n>` the output index), so a streamed and a whole
//! rendering of the same answer agree exactly.

use super::kind;
use std::collections::{BTreeMap, HashMap};

use bytes::Bytes;
use serde_json::{Map, Value, json};

use super::{
    Answer, Conversation, Delta, Finish, Message, Part, Reasoning, Role, StreamEmitter, Tool,
    ToolCall, ToolChoice, sse_named,
};
use crate::error::GatewayError;

/// `conv.extra` key listing the names of Codex freeform (`custom`) tools that were mapped to
/// a function with one string argument, so answers calling them are rendered as
/// `custom_tool_call` items. Not a client field.
pub const CUSTOM_TOOLS_KEY: &str = "graft_custom_tools";

/// Request fields kept in `conv.extra` (for echoing in the response object and for the record).
const EXTRA_FIELDS: &[&str] = &[
    "instructions",
    "text",
    "include",
    "store",
    "prompt_cache_key",
    "prompt_cache_retention",
    "client_metadata",
    "metadata",
    "user",
    "safety_identifier",
    "service_tier",
    "truncation",
    "top_logprobs",
    "max_tool_calls",
    "background",
    "stream_options",
];

/// The highest integer JavaScript and JSON tooling keep exactly (2^53 - 1). [`error_event`]
/// has no stream state, so it numbers its events just below this: later than anything a
/// stream emitted before it.
const MAX_SAFE_SEQUENCE: u64 = (1 << 53) - 1;

// ---------------------------------------------------------------------------------------------
// Request side
// ---------------------------------------------------------------------------------------------

fn wrong(path: &str, expected: &str, got: &Value) -> GatewayError {
    GatewayError::field(
        path,
        format!("{path} must be {expected}, got {}", kind(got)),
    )
}

fn missing(path: &str, expected: &str) -> GatewayError {
    GatewayError::field(path, format!("{path} is required and must be {expected}"))
}

/// A present, non-null field of `obj`.
fn get<'a>(obj: &'a Map<String, Value>, key: &str) -> Option<&'a Value> {
    obj.get(key).filter(|v| !v.is_null())
}

fn opt_str<'a>(
    obj: &'a Map<String, Value>,
    key: &str,
    path: &str,
) -> Result<Option<&'a str>, GatewayError> {
    match get(obj, key) {
        None => Ok(None),
        Some(Value::String(s)) => Ok(Some(s)),
        Some(v) => Err(wrong(path, "a string", v)),
    }
}

fn req_str<'a>(
    obj: &'a Map<String, Value>,
    key: &str,
    path: &str,
) -> Result<&'a str, GatewayError> {
    opt_str(obj, key, path)?.ok_or_else(|| missing(path, "a string"))
}

fn opt_f64(obj: &Map<String, Value>, key: &str) -> Result<Option<f64>, GatewayError> {
    match get(obj, key) {
        None => Ok(None),
        Some(Value::Number(n)) => Ok(n.as_f64()),
        Some(v) => Err(wrong(key, "a number", v)),
    }
}

fn opt_bool(obj: &Map<String, Value>, key: &str) -> Result<Option<bool>, GatewayError> {
    match get(obj, key) {
        None => Ok(None),
        Some(Value::Bool(b)) => Ok(Some(*b)),
        Some(v) => Err(wrong(key, "a boolean", v)),
    }
}

fn opt_u64(obj: &Map<String, Value>, key: &str) -> Result<Option<u64>, GatewayError> {
    match get(obj, key) {
        None => Ok(None),
        Some(Value::Number(n)) => match n.as_u64() {
            Some(u) => Ok(Some(u)),
            None => Err(GatewayError::field(
                key,
                format!("{key} must be a non-negative integer, got {n}"),
            )),
        },
        Some(v) => Err(wrong(key, "a non-negative integer", v)),
    }
}

/// Parses a Responses request body.
pub fn parse_request(body: &Value) -> Result<Conversation, GatewayError> {
    let Some(obj) = body.as_object() else {
        return Err(wrong("body", "a JSON object", body));
    };
    let mut conv = Conversation {
        model: req_str(obj, "model", "model")?.to_string(),
        ..Conversation::default()
    };

    for key in ["previous_response_id", "conversation"] {
        if let Some(v) = get(obj, key) {
            return Err(GatewayError::field(
                key,
                format!(
                    "{key} is not supported (got {}): graft keeps no server-side state; send the whole \
                     history in `input` with `store: false`",
                    kind(v)
                ),
            ));
        }
    }
    if let Some(v) = get(obj, "prompt") {
        return Err(GatewayError::field(
            "prompt",
            format!(
                "prompt (a stored prompt template, got {}) is not supported: send `instructions` and `input` instead",
                kind(v)
            ),
        ));
    }

    let mut parser = InputParser::default();
    match get(obj, "instructions") {
        None => {}
        Some(Value::String(s)) if s.is_empty() => {}
        Some(Value::String(s)) => parser.messages.push(Message::text(Role::System, s.clone())),
        Some(Value::Array(items)) => {
            for (i, item) in items.iter().enumerate() {
                parser.item(item, &format!("instructions[{i}]"))?;
            }
            parser.end_run();
        }
        Some(v) => return Err(wrong("instructions", "a string or an array of items", v)),
    }
    match get(obj, "input") {
        None => return Err(missing("input", "a string or an array of items")),
        Some(Value::String(s)) => parser.messages.push(Message::text(Role::User, s.clone())),
        Some(Value::Array(items)) => {
            for (i, item) in items.iter().enumerate() {
                parser.item(item, &format!("input[{i}]"))?;
            }
        }
        Some(v) => return Err(wrong("input", "a string or an array of items", v)),
    }
    parser.finish();
    conv.messages = parser.messages;
    conv.notes = parser.notes;

    let mut custom_tools = Vec::new();
    match get(obj, "tools") {
        None => {}
        Some(Value::Array(tools)) => {
            for (i, t) in tools.iter().enumerate() {
                parse_tool(t, &format!("tools[{i}]"), &mut conv, &mut custom_tools)?;
            }
        }
        Some(v) => return Err(wrong("tools", "an array", v)),
    }
    if !custom_tools.is_empty() {
        conv.extra.insert(
            CUSTOM_TOOLS_KEY.into(),
            Value::Array(custom_tools.into_iter().map(Value::String).collect()),
        );
    }

    conv.tool_choice = parse_tool_choice(get(obj, "tool_choice"), &mut conv.notes)?;
    conv.parallel_tool_calls = opt_bool(obj, "parallel_tool_calls")?;
    conv.sampling.temperature = opt_f64(obj, "temperature")?;
    conv.sampling.top_p = opt_f64(obj, "top_p")?;
    conv.sampling.max_tokens = opt_u64(obj, "max_output_tokens")?;
    conv.stream = opt_bool(obj, "stream")?.unwrap_or(false);

    match get(obj, "reasoning") {
        None => {}
        Some(Value::Object(r)) => {
            let effort = opt_str(r, "effort", "reasoning.effort")?.map(str::to_string);
            // `generate_summary` is the deprecated spelling of `summary`.
            let summary = match opt_str(r, "summary", "reasoning.summary")? {
                Some(s) => Some(s.to_string()),
                None => opt_str(r, "generate_summary", "reasoning.generate_summary")?
                    .map(str::to_string),
            };
            if effort.is_some() || summary.is_some() {
                conv.reasoning = Some(Reasoning {
                    effort,
                    budget_tokens: None,
                    summary,
                });
            }
        }
        Some(v) => return Err(wrong("reasoning", "an object", v)),
    }

    if let Some(Value::Object(text)) = get(obj, "text")
        && let Some(format) = text.get("format")
        && !format.is_null()
        && format.get("type").and_then(Value::as_str) != Some("text")
    {
        conv.notes.push(
            "text.format (structured output) is kept in extra.text; graft does not enforce it"
                .into(),
        );
    }
    if get(obj, "background") == Some(&Value::Bool(true)) {
        conv.notes
            .push("background: true is not supported; the response is produced inline".into());
    }
    for key in EXTRA_FIELDS {
        if let Some(v) = get(obj, key) {
            conv.extra.insert((*key).to_string(), v.clone());
        }
    }
    Ok(conv)
}

/// Walks `input` items, merging consecutive assistant output (text, function calls) into one
/// assistant message and attaching reasoning items to the next assistant message.
#[derive(Default)]
struct InputParser {
    messages: Vec<Message>,
    notes: Vec<String>,
    /// Reasoning text waiting for the next assistant message.
    pending_reasoning: Option<String>,
    /// Whether the last message is an assistant message still open to more items of its turn.
    in_assistant_run: bool,
    encrypted_reasoning: usize,
}

impl InputParser {
    fn end_run(&mut self) {
        self.in_assistant_run = false;
    }

    fn finish(&mut self) {
        if let Some(r) = self.pending_reasoning.take() {
            self.notes.push(format!(
                "a reasoning item ({} chars) was not followed by assistant output and was dropped",
                r.chars().count()
            ));
        }
        if self.encrypted_reasoning > 0 {
            self.notes.push(format!(
                "{} reasoning item(s) carried encrypted_content, which only OpenAI can decrypt; \
                 the encrypted part was dropped (summaries/text kept)",
                self.encrypted_reasoning
            ));
        }
    }

    /// The assistant message the next assistant item belongs to: the open one when
    /// `merge` allows, else a new one. Pending reasoning is attached either way.
    fn assistant(&mut self, merge: bool) -> &mut Message {
        let reuse = merge
            && self.in_assistant_run
            && self
                .messages
                .last()
                .is_some_and(|m| m.role == Role::Assistant);
        if !reuse {
            self.messages.push(Message {
                role: Role::Assistant,
                content: vec![],
                reasoning: None,
                tool_calls: vec![],
                tool_call_id: None,
                name: None,
            });
        }
        self.in_assistant_run = true;
        let pending = self.pending_reasoning.take();
        let len = self.messages.len();
        let msg = &mut self.messages[len - 1];
        if let Some(r) = pending {
            msg.reasoning = Some(match msg.reasoning.take() {
                Some(prev) => format!("{prev}\n\n{r}"),
                None => r,
            });
        }
        msg
    }

    fn item(&mut self, item: &Value, path: &str) -> Result<(), GatewayError> {
        let Some(obj) = item.as_object() else {
            return Err(wrong(path, "an object (an input item)", item));
        };
        let ty = opt_str(obj, "type", &format!("{path}.type"))?;
        match ty {
            None | Some("message") => {
                if ty.is_none() && get(obj, "role").is_none() {
                    return Err(GatewayError::field(
                        format!("{path}.type"),
                        format!(
                            "{path}.type is missing and there is no `role`: cannot tell what the item is"
                        ),
                    ));
                }
                self.message(obj, path)
            }
            Some("function_call") => {
                let call = ToolCall {
                    id: req_str(obj, "call_id", &format!("{path}.call_id"))?.to_string(),
                    name: req_str(obj, "name", &format!("{path}.name"))?.to_string(),
                    arguments: match get(obj, "arguments") {
                        None => String::new(),
                        Some(Value::String(s)) => s.clone(),
                        // Some clients send the arguments as an object: keep its JSON text.
                        Some(v @ Value::Object(_)) => v.to_string(),
                        Some(v) => {
                            return Err(wrong(&format!("{path}.arguments"), "a JSON string", v));
                        }
                    },
                };
                self.assistant(true).tool_calls.push(call);
                Ok(())
            }
            Some("custom_tool_call") => {
                let input = match get(obj, "input") {
                    None => "",
                    Some(Value::String(s)) => s.as_str(),
                    Some(v) => return Err(wrong(&format!("{path}.input"), "a string", v)),
                };
                let call = ToolCall {
                    id: req_str(obj, "call_id", &format!("{path}.call_id"))?.to_string(),
                    name: req_str(obj, "name", &format!("{path}.name"))?.to_string(),
                    arguments: json!({ "input": input }).to_string(),
                };
                self.assistant(true).tool_calls.push(call);
                Ok(())
            }
            Some("function_call_output") | Some("custom_tool_call_output") => {
                let call_id = req_str(obj, "call_id", &format!("{path}.call_id"))?.to_string();
                let out_path = format!("{path}.output");
                let content = match get(obj, "output") {
                    None => vec![],
                    Some(Value::String(s)) => vec![Part::Text { text: s.clone() }],
                    Some(Value::Array(parts)) => self.parts(parts, &out_path)?,
                    Some(v) => {
                        return Err(wrong(&out_path, "a string or an array of content parts", v));
                    }
                };
                self.end_run();
                self.messages.push(Message {
                    role: Role::Tool,
                    content,
                    reasoning: None,
                    tool_calls: vec![],
                    tool_call_id: Some(call_id),
                    name: None,
                });
                Ok(())
            }
            Some("reasoning") => {
                let text = self.reasoning_text(obj, path)?;
                if !text.is_empty() {
                    self.pending_reasoning = Some(match self.pending_reasoning.take() {
                        Some(prev) => format!("{prev}\n\n{text}"),
                        None => text,
                    });
                }
                Ok(())
            }
            Some("item_reference") => Err(GatewayError::field(
                path,
                format!(
                    "{path} is an item_reference, which needs server-side state graft does not keep; \
                     send the item itself"
                ),
            )),
            Some(other) => {
                // Hosted-tool calls and their outputs (web_search_call, local_shell_call,
                // computer_call, mcp_*, image_generation_call, compaction, ...): their tools are
                // dropped too, so the model never sees them.
                self.notes.push(format!(
                    "{path}: input item of type '{other}' is not supported by chat upstreams and was dropped"
                ));
                Ok(())
            }
        }
    }

    fn message(&mut self, obj: &Map<String, Value>, path: &str) -> Result<(), GatewayError> {
        let role_path = format!("{path}.role");
        let role = match req_str(obj, "role", &role_path)? {
            "user" => Role::User,
            "assistant" => Role::Assistant,
            "system" => Role::System,
            "developer" => Role::Developer,
            other => {
                return Err(GatewayError::field(
                    role_path.clone(),
                    format!(
                        "{role_path} must be one of user, assistant, system, developer, got '{other}'"
                    ),
                ));
            }
        };
        let content_path = format!("{path}.content");
        let content = match get(obj, "content") {
            None => vec![],
            Some(Value::String(s)) => vec![Part::Text { text: s.clone() }],
            Some(Value::Array(parts)) => self.parts(parts, &content_path)?,
            Some(v) => {
                return Err(wrong(
                    &content_path,
                    "a string or an array of content parts",
                    v,
                ));
            }
        };
        if role == Role::Assistant {
            // Text after a tool call of the same turn starts a new message (as it does in the
            // stream); text after text joins it.
            let merge = self
                .messages
                .last()
                .is_some_and(|m| m.role == Role::Assistant && m.tool_calls.is_empty());
            self.assistant(merge).content.extend(content);
        } else {
            self.end_run();
            self.messages.push(Message {
                role,
                content,
                reasoning: None,
                tool_calls: vec![],
                tool_call_id: None,
                name: None,
            });
        }
        Ok(())
    }

    fn parts(&mut self, parts: &[Value], path: &str) -> Result<Vec<Part>, GatewayError> {
        let mut out = Vec::with_capacity(parts.len());
        for (i, p) in parts.iter().enumerate() {
            let ppath = format!("{path}[{i}]");
            let Some(pobj) = p.as_object() else {
                return Err(wrong(&ppath, "an object (a content part)", p));
            };
            let ty = req_str(pobj, "type", &format!("{ppath}.type"))?;
            match ty {
                "input_text" | "output_text" | "text" | "summary_text" | "reasoning_text" => {
                    let text = req_str(pobj, "text", &format!("{ppath}.text"))?;
                    out.push(Part::Text {
                        text: text.to_string(),
                    });
                }
                "refusal" => {
                    let text = req_str(pobj, "refusal", &format!("{ppath}.refusal"))?;
                    out.push(Part::Text {
                        text: text.to_string(),
                    });
                }
                "input_image" => match get(pobj, "image_url") {
                    Some(Value::String(url)) => out.push(Part::Image { url: url.clone() }),
                    // The Chat shape `{image_url: {url}}` turns up from some clients.
                    Some(Value::Object(o)) if o.get("url").is_some_and(Value::is_string) => {
                        let url = o.get("url").and_then(Value::as_str).unwrap_or_default();
                        out.push(Part::Image {
                            url: url.to_string(),
                        });
                    }
                    Some(v) => {
                        return Err(wrong(&format!("{ppath}.image_url"), "a string (URL)", v));
                    }
                    None => self.notes.push(format!(
                        "{ppath}: input_image without image_url (file_id?) cannot be resolved by graft; dropped"
                    )),
                },
                other => self.notes.push(format!(
                    "{ppath}: content part of type '{other}' is not supported and was dropped"
                )),
            }
        }
        Ok(out)
    }

    fn reasoning_text(
        &mut self,
        obj: &Map<String, Value>,
        path: &str,
    ) -> Result<String, GatewayError> {
        if get(obj, "encrypted_content").is_some() {
            self.encrypted_reasoning += 1;
        }
        let texts = |key: &str| -> Result<Vec<String>, GatewayError> {
            let kpath = format!("{path}.{key}");
            match get(obj, key) {
                None => Ok(vec![]),
                Some(Value::Array(parts)) => {
                    let mut out = Vec::new();
                    for (i, p) in parts.iter().enumerate() {
                        let ppath = format!("{kpath}[{i}]");
                        let Some(pobj) = p.as_object() else {
                            return Err(wrong(&ppath, "an object", p));
                        };
                        out.push(req_str(pobj, "text", &format!("{ppath}.text"))?.to_string());
                    }
                    Ok(out)
                }
                Some(v) => Err(wrong(&kpath, "an array", v)),
            }
        };
        // The raw reasoning (`content`) when present, else the summary.
        let content = texts("content")?;
        let summary = texts("summary")?;
        let chosen = if content.iter().any(|t| !t.is_empty()) {
            content
        } else {
            summary
        };
        Ok(chosen.join("\n\n"))
    }
}

fn parse_tool(
    t: &Value,
    path: &str,
    conv: &mut Conversation,
    custom_tools: &mut Vec<String>,
) -> Result<(), GatewayError> {
    let Some(obj) = t.as_object() else {
        return Err(wrong(path, "an object (a tool)", t));
    };
    let ty = req_str(obj, "type", &format!("{path}.type"))?;
    match ty {
        "function" => {
            // Tolerate the Chat Completions shape `{type: function, function: {...}}`.
            let f = match get(obj, "function") {
                Some(Value::Object(f)) if get(obj, "name").is_none() => f,
                _ => obj,
            };
            let parameters = match get(f, "parameters") {
                None => json!({"type": "object", "properties": {}}),
                Some(v @ Value::Object(_)) => v.clone(),
                Some(v) => return Err(wrong(&format!("{path}.parameters"), "an object", v)),
            };
            conv.tools.push(Tool {
                name: req_str(f, "name", &format!("{path}.name"))?.to_string(),
                description: opt_str(f, "description", &format!("{path}.description"))?
                    .map(str::to_string),
                parameters,
                strict: match get(f, "strict") {
                    None => None,
                    Some(Value::Bool(b)) => Some(*b),
                    Some(v) => return Err(wrong(&format!("{path}.strict"), "a boolean", v)),
                },
            });
        }
        "custom" => {
            let name = req_str(obj, "name", &format!("{path}.name"))?.to_string();
            let mut description = opt_str(obj, "description", &format!("{path}.description"))?
                .unwrap_or_default()
                .to_string();
            if let Some(Value::Object(format)) = get(obj, "format")
                && format.get("type").and_then(Value::as_str) == Some("grammar")
                && let Some(def) = format.get("definition").and_then(Value::as_str)
            {
                let syntax = format
                    .get("syntax")
                    .and_then(Value::as_str)
                    .unwrap_or("grammar");
                description.push_str(&format!(
                    "\n\nThe `input` argument must follow this {syntax} grammar:\n{def}"
                ));
            }
            conv.tools.push(Tool {
                name: name.clone(),
                description: Some(description),
                parameters: json!({
                    "type": "object",
                    "properties": {"input": {"type": "string", "description": "The raw input for this freeform tool."}},
                    "required": ["input"],
                    "additionalProperties": false
                }),
                strict: None,
            });
            conv.notes.push(format!(
                "{path}: freeform (custom) tool '{name}' is offered as a function with one string argument `input`; \
                 the grammar is given in the description, not enforced"
            ));
            custom_tools.push(name);
        }
        "namespace" => {
            let name = opt_str(obj, "name", &format!("{path}.name"))?.unwrap_or("?");
            let inner: Vec<&str> = obj
                .get("tools")
                .and_then(Value::as_array)
                .map(|ts| {
                    ts.iter()
                        .filter_map(|t| t.get("name").and_then(Value::as_str))
                        .collect()
                })
                .unwrap_or_default();
            conv.notes.push(format!(
                "{path}: tool namespace '{name}' ({}) was dropped: calls to namespaced tools need a \
                 `namespace` on the call, which chat upstreams cannot produce",
                inner.join(", ")
            ));
        }
        other => conv.notes.push(format!(
            "{path}: tool of type '{other}' is hosted by OpenAI (or not a function) and was dropped; \
             the model cannot call it through graft"
        )),
    }
    Ok(())
}

fn parse_tool_choice(
    v: Option<&Value>,
    notes: &mut Vec<String>,
) -> Result<Option<ToolChoice>, GatewayError> {
    let Some(v) = v else { return Ok(None) };
    match v {
        Value::String(s) => match s.as_str() {
            "auto" => Ok(Some(ToolChoice::Auto)),
            "none" => Ok(Some(ToolChoice::None)),
            "required" => Ok(Some(ToolChoice::Required)),
            other => Err(GatewayError::field(
                "tool_choice",
                format!("tool_choice must be auto, none, required or an object, got '{other}'"),
            )),
        },
        Value::Object(o) => {
            let ty = req_str(o, "type", "tool_choice.type")?;
            match ty {
                "function" | "custom" => {
                    let name = match get(o, "name") {
                        Some(Value::String(n)) => n.clone(),
                        // Chat shape: {type: function, function: {name}}
                        _ => match o
                            .get("function")
                            .and_then(|f| f.get("name"))
                            .and_then(Value::as_str)
                        {
                            Some(n) => n.to_string(),
                            None => return Err(missing("tool_choice.name", "a string")),
                        },
                    };
                    Ok(Some(ToolChoice::Function { name }))
                }
                other => {
                    notes.push(format!(
                        "tool_choice of type '{other}' is not supported and was dropped (the upstream default applies)"
                    ));
                    Ok(None)
                }
            }
        }
        other => Err(wrong("tool_choice", "a string or an object", other)),
    }
}

// ---------------------------------------------------------------------------------------------
// Answer side
// ---------------------------------------------------------------------------------------------

fn id_suffix(response_id: &str) -> &str {
    response_id.strip_prefix("resp_").unwrap_or(response_id)
}

fn item_id(prefix: &str, suffix: &str, output_index: usize) -> String {
    format!("{prefix}{suffix}_{output_index}")
}

fn custom_tool_names(conv: &Conversation) -> Vec<String> {
    conv.extra
        .get(CUSTOM_TOOLS_KEY)
        .and_then(Value::as_array)
        .map(|a| {
            a.iter()
                .filter_map(Value::as_str)
                .map(str::to_string)
                .collect()
        })
        .unwrap_or_default()
}

/// The freeform input of a custom tool call: the `input` string of the function arguments,
/// or the raw arguments when the model wrote something else.
fn custom_input(arguments: &str) -> String {
    match serde_json::from_str::<Value>(arguments) {
        Ok(Value::Object(o)) => match o.get("input") {
            Some(Value::String(s)) => s.clone(),
            _ => arguments.to_string(),
        },
        _ => arguments.to_string(),
    }
}

fn output_text_part(text: &str) -> Value {
    json!({"type": "output_text", "text": text, "annotations": [], "logprobs": []})
}

fn message_item(id: &str, text: &str, status: &str) -> Value {
    json!({
        "id": id,
        "type": "message",
        "status": status,
        "role": "assistant",
        "content": [output_text_part(text)],
    })
}

fn reasoning_item(id: &str, text: &str, status: &str) -> Value {
    json!({
        "id": id,
        "type": "reasoning",
        "status": status,
        "summary": [],
        "content": [{"type": "reasoning_text", "text": text}],
    })
}

fn call_item(id: &str, call_id: &str, name: &str, args: &str, custom: bool, status: &str) -> Value {
    if custom {
        json!({
            "id": id,
            "type": "custom_tool_call",
            "status": status,
            "call_id": call_id,
            "name": name,
            "input": custom_input(args),
        })
    } else {
        json!({
            "id": id,
            "type": "function_call",
            "status": status,
            "call_id": call_id,
            "name": name,
            "arguments": args,
        })
    }
}

fn usage_json(answer: &Answer) -> Value {
    let u = answer.usage.unwrap_or_default();
    json!({
        "input_tokens": u.input_tokens,
        "input_tokens_details": {"cached_tokens": u.cached_tokens},
        "output_tokens": u.output_tokens,
        "output_tokens_details": {"reasoning_tokens": u.reasoning_tokens},
        "total_tokens": u.input_tokens + u.output_tokens,
    })
}

fn tool_json(tool: &Tool, custom: &[String]) -> Value {
    if custom.iter().any(|c| c == &tool.name) {
        return json!({"type": "custom", "name": tool.name, "description": tool.description});
    }
    json!({
        "type": "function",
        "name": tool.name,
        "description": tool.description,
        "parameters": tool.parameters,
        "strict": tool.strict.unwrap_or(false),
    })
}

fn tool_choice_json(tc: Option<&ToolChoice>) -> Value {
    match tc {
        None | Some(ToolChoice::Auto) => json!("auto"),
        Some(ToolChoice::None) => json!("none"),
        Some(ToolChoice::Required) => json!("required"),
        Some(ToolChoice::Function { name }) => json!({"type": "function", "name": name}),
    }
}

/// The response object before any output: status `in_progress`, the request's fields echoed
/// the way OpenAI's servers echo them (defaults where the request was silent).
fn response_skeleton(
    conv: &Conversation,
    response_id: &str,
    created_at: i64,
) -> Map<String, Value> {
    let extra = |k: &str, default: Value| conv.extra.get(k).cloned().unwrap_or(default);
    let custom = custom_tool_names(conv);
    let reasoning = match &conv.reasoning {
        Some(r) => json!({"effort": r.effort, "summary": r.summary}),
        None => json!({"effort": null, "summary": null}),
    };
    let instructions = match conv.extra.get("instructions") {
        Some(v @ Value::String(_)) => v.clone(),
        _ => Value::Null,
    };
    let v = json!({
        "id": response_id,
        "object": "response",
        "created_at": created_at,
        "status": "in_progress",
        "background": false,
        "error": null,
        "incomplete_details": null,
        "instructions": instructions,
        "max_output_tokens": conv.sampling.max_tokens,
        "max_tool_calls": extra("max_tool_calls", Value::Null),
        "model": conv.model,
        "output": [],
        "parallel_tool_calls": conv.parallel_tool_calls.unwrap_or(true),
        "previous_response_id": null,
        "prompt_cache_key": extra("prompt_cache_key", Value::Null),
        "reasoning": reasoning,
        "safety_identifier": extra("safety_identifier", Value::Null),
        "service_tier": extra("service_tier", json!("default")),
        "store": extra("store", json!(true)),
        "temperature": conv.sampling.temperature.unwrap_or(1.0),
        "text": extra("text", json!({"format": {"type": "text"}})),
        "tool_choice": tool_choice_json(conv.tool_choice.as_ref()),
        "tools": conv.tools.iter().map(|t| tool_json(t, &custom)).collect::<Vec<_>>(),
        "top_logprobs": extra("top_logprobs", json!(0)),
        "top_p": conv.sampling.top_p.unwrap_or(1.0),
        "truncation": extra("truncation", json!("disabled")),
        "usage": null,
        "user": extra("user", Value::Null),
        "metadata": extra("metadata", json!({})),
    });
    match v {
        Value::Object(m) => m,
        _ => Map::new(),
    }
}

/// Fills in the terminal fields of a response object from the answer.
fn finalize(resp: &mut Map<String, Value>, answer: &Answer, output: Vec<Value>) {
    let (status, incomplete, error) = match answer.finish {
        Finish::Stop | Finish::ToolCalls => ("completed", Value::Null, Value::Null),
        Finish::Length => (
            "incomplete",
            json!({"reason": "max_output_tokens"}),
            Value::Null,
        ),
        Finish::ContentFilter => (
            "incomplete",
            json!({"reason": "content_filter"}),
            Value::Null,
        ),
        Finish::Error => (
            "failed",
            Value::Null,
            json!({"code": "server_error", "message": "the upstream model server ended the response with an error"}),
        ),
    };
    resp.insert("status".into(), json!(status));
    resp.insert("incomplete_details".into(), incomplete);
    resp.insert("error".into(), error);
    if !answer.model.is_empty() {
        resp.insert("model".into(), json!(answer.model));
    }
    resp.insert("output".into(), Value::Array(output));
    resp.insert("usage".into(), usage_json(answer));
}

/// Marks the last output item `incomplete` when the answer was cut short (as OpenAI does).
fn mark_last_status(output: &mut [Value], finish: Finish) {
    if matches!(finish, Finish::Length | Finish::ContentFilter)
        && let Some(o) = output.last_mut().and_then(Value::as_object_mut)
    {
        o.insert("status".into(), json!("incomplete"));
    }
}

/// A whole `response` object for a non-streamed answer. Output order: reasoning, message,
/// tool calls (the order a stream of the same answer emits them in).
pub fn render_answer(conv: &Conversation, answer: &Answer, response_id: &str) -> Value {
    let suffix = id_suffix(response_id);
    let custom = custom_tool_names(conv);
    let mut output = Vec::new();
    if let Some(r) = answer.reasoning.as_deref().filter(|r| !r.is_empty()) {
        let id = item_id("rs_", suffix, output.len());
        output.push(reasoning_item(&id, r, "completed"));
    }
    if !answer.text.is_empty() {
        let id = item_id("msg_", suffix, output.len());
        output.push(message_item(&id, &answer.text, "completed"));
    }
    for tc in &answer.tool_calls {
        let is_custom = custom.contains(&tc.name);
        let prefix = if is_custom { "ctc_" } else { "fc_" };
        let id = item_id(prefix, suffix, output.len());
        output.push(call_item(
            &id,
            &tc.id,
            &tc.name,
            &tc.arguments,
            is_custom,
            "completed",
        ));
    }
    mark_last_status(&mut output, answer.finish);
    let mut resp = response_skeleton(conv, response_id, answer.created);
    finalize(&mut resp, answer, output);
    Value::Object(resp)
}

// ---------------------------------------------------------------------------------------------
// Streaming
// ---------------------------------------------------------------------------------------------

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
                output_text_part(&t.text),
                message_item(&t.id, &t.text, "completed"),
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
            o.insert("logprobs".into(), json!([]));
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
                    output_text_part(""),
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
                json!({"item_id": t.id, "output_index": t.output_index, "content_index": 0, "delta": delta, "logprobs": []}),
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
        let mut out = Vec::new();
        if self.finished {
            return out;
        }
        self.ensure_started(&mut out);
        self.finished = true;
        let mut resp = self.skeleton.clone();
        resp.insert("output".into(), Value::Array(self.completed_output()));
        let (error_fields, failed) = error_payloads(err, resp);
        out.push(self.event("error", error_fields));
        out.push(self.event("response.failed", json!({"response": failed})));
        out
    }

    /// The response id this stream was created with.
    pub fn response_id(&self) -> &str {
        &self.response_id
    }
}

impl StreamEmitter for ResponsesStream {
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
            Delta::Text(t) => self.text_delta(TextKind::Message, t, &mut out),
            Delta::Reasoning(t) => self.text_delta(TextKind::Reasoning, t, &mut out),
            Delta::ToolCallStart { index, id, name } => self.call_start(*index, id, name, &mut out),
            Delta::ToolCallArgs { index, arguments } => self.call_args(*index, arguments, &mut out),
        }
        out
    }

    fn finish(&mut self, answer: &Answer) -> Vec<Bytes> {
        let mut out = Vec::new();
        if self.finished {
            return out;
        }
        self.ensure_started(&mut out);
        self.close_text(&mut out);
        self.close_calls(&mut out);
        self.finished = true;
        let mut output = self.completed_output();
        mark_last_status(&mut output, answer.finish);
        let mut resp = self.skeleton.clone();
        finalize(&mut resp, answer, output);
        let ty = match answer.finish {
            Finish::Stop | Finish::ToolCalls => "response.completed",
            Finish::Length | Finish::ContentFilter => "response.incomplete",
            Finish::Error => "response.failed",
        };
        out.push(self.event(ty, json!({"response": resp})));
        out
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

// ---------------------------------------------------------------------------------------------
// Assembler
// ---------------------------------------------------------------------------------------------

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
                let template = output_text_part("");
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dialect::TokenUsage;
    use proptest::prelude::*;

    fn capture(name: &str) -> Value {
        // The captures are vendored under tests/fixtures; the shared originals beside the
        // checkout are a fallback, and GRAFT_CAPTURES_DIR overrides both.
        let base = env!("CARGO_MANIFEST_DIR");
        let mut candidates = vec![
            format!("{base}/tests/fixtures/captures/{name}"),
            format!("{base}/../shared/captures/{name}"),
            format!("{base}/../../shared/captures/{name}"),
        ];
        if let Ok(dir) = std::env::var("GRAFT_CAPTURES_DIR") {
            candidates.insert(0, format!("{dir}/{name}"));
        }
        for c in &candidates {
            if let Ok(s) = std::fs::read_to_string(c) {
                let v: Value = serde_json::from_str(&s).unwrap();
                return v["body"].clone();
            }
        }
        panic!("capture {name} not found in {candidates:?}: the shared captures are required");
    }

    fn answer(text: &str, reasoning: Option<&str>, calls: Vec<ToolCall>, finish: Finish) -> Answer {
        Answer {
            id: "up-1".into(),
            model: "m".into(),
            created: 1_700_000_000,
            text: text.into(),
            reasoning: reasoning.map(str::to_string),
            tool_calls: calls,
            finish,
            usage: Some(TokenUsage {
                input_tokens: 10,
                output_tokens: 5,
                cached_tokens: 2,
                reasoning_tokens: 1,
            }),
        }
    }

    /// Splits SSE bytes into (event name, data JSON).
    fn parse_sse(bytes: &[u8]) -> Vec<(String, Value)> {
        let s = std::str::from_utf8(bytes).unwrap();
        let mut out = Vec::new();
        for block in s.split("\n\n").filter(|b| !b.trim().is_empty()) {
            let mut name = String::new();
            let mut data = String::new();
            for line in block.lines() {
                if let Some(n) = line.strip_prefix("event: ") {
                    name = n.to_string();
                } else if let Some(d) = line.strip_prefix("data: ") {
                    data.push_str(d);
                }
            }
            out.push((name, serde_json::from_str(&data).unwrap()));
        }
        out
    }

    #[test]
    fn python_sdk_string_input() {
        let c = parse_request(&capture("openai-python-sdk.responses-stream.json")).unwrap();
        assert_eq!(c.model, "mock-model");
        assert!(c.stream);
        assert_eq!(c.messages, vec![Message::text(Role::User, "hi")]);
        assert!(c.tools.is_empty());
    }

    #[test]
    fn node_sdk_function_tool() {
        let c = parse_request(&capture("openai-node-sdk.responses.json")).unwrap();
        assert!(!c.stream);
        assert_eq!(c.messages, vec![Message::text(Role::User, "hi")]);
        assert_eq!(c.tools.len(), 1);
        assert_eq!(c.tools[0].name, "get_weather");
        assert_eq!(
            c.tools[0].parameters["properties"]["city"]["type"],
            "string"
        );
        assert!(c.notes.is_empty(), "{:?}", c.notes);
    }

    #[test]
    fn codex_turn1() {
        let c = parse_request(&capture("codex.turn1.responses-sse.json")).unwrap();
        assert!(c.stream);
        let roles: Vec<Role> = c.messages.iter().map(|m| m.role).collect();
        assert_eq!(
            roles,
            vec![Role::Developer, Role::Developer, Role::User, Role::User]
        );
        assert!(
            c.messages[0]
                .joined_text()
                .starts_with("You are a coding agent")
        );
        assert_eq!(c.messages[3].joined_text(), "What does hello.py print?");
        let names: Vec<&str> = c.tools.iter().map(|t| t.name.as_str()).collect();
        assert_eq!(
            names,
            [
                "exec_command",
                "write_stdin",
                "request_user_input",
                "view_image",
                "get_goal",
                "create_goal",
                "update_goal"
            ]
        );
        assert_eq!(c.tool_choice, Some(ToolChoice::Auto));
        assert_eq!(c.parallel_tool_calls, Some(true));
        assert_eq!(
            c.reasoning.as_ref().unwrap().summary.as_deref(),
            Some("auto")
        );
        assert_eq!(c.extra["store"], json!(false));
        assert_eq!(c.extra["include"], json!(["reasoning.encrypted_content"]));
        assert!(c.extra.contains_key("prompt_cache_key"));
        assert!(c.extra.contains_key("client_metadata"));
        assert!(
            c.notes
                .iter()
                .any(|n| n.contains("namespace 'multi_agent_v1'"))
        );
        assert!(c.notes.iter().any(|n| n.contains("'web_search'")));
    }

    #[test]
    fn codex_turn2_function_call_and_output() {
        let c = parse_request(&capture("codex.turn2-after-tool.responses-sse.json")).unwrap();
        assert_eq!(c.messages.len(), 6);
        let call = &c.messages[4];
        assert_eq!(call.role, Role::Assistant);
        assert!(call.content.is_empty());
        assert_eq!(
            call.tool_calls,
            vec![ToolCall {
                id: "call_bc249f76".into(),
                name: "exec_command".into(),
                arguments: "{\"cmd\": \"cat hello.py\"}".into(),
            }]
        );
        let out = &c.messages[5];
        assert_eq!(out.role, Role::Tool);
        assert_eq!(out.tool_call_id.as_deref(), Some("call_bc249f76"));
        assert_eq!(
            out.joined_text(),
            "Chunk ID: 428c61\nWall time: 0.1975 seconds\nProcess exited with code 0\nOriginal token count: 3\nOutput:\nprint('hi')\n"
        );
    }

    #[test]
    fn parallel_calls_reasoning_and_instructions() {
        let body = json!({
            "model": "m",
            "instructions": "be brief",
            "input": [
                {"role": "user", "content": "go", "litellm_extra": null},
                {"type": "reasoning", "id": "rs_1", "summary": [{"type": "summary_text", "text": "think"}], "encrypted_content": "xyz"},
                {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "calling"}]},
                {"type": "function_call", "call_id": "a", "name": "f", "arguments": "{}"},
                {"type": "function_call", "call_id": "b", "name": "g", "arguments": "{\"x\":1}"},
                {"type": "function_call_output", "call_id": "a", "output": [{"type": "input_text", "text": "A"}]},
                {"type": "function_call_output", "call_id": "b", "output": "B"},
                {"type": "message", "role": "user", "content": [{"type": "input_image", "image_url": "data:image/png;base64,AA"}]}
            ],
            "max_output_tokens": 50,
            "metadata": {"k": "v"}
        });
        let c = parse_request(&body).unwrap();
        assert_eq!(c.messages[0], Message::text(Role::System, "be brief"));
        assert_eq!(c.messages[1], Message::text(Role::User, "go"));
        let a = &c.messages[2];
        assert_eq!(a.joined_text(), "calling");
        assert_eq!(a.reasoning.as_deref(), Some("think"));
        assert_eq!(a.tool_calls.len(), 2);
        assert_eq!(a.tool_calls[1].arguments, "{\"x\":1}");
        assert_eq!(c.messages[3].tool_call_id.as_deref(), Some("a"));
        assert_eq!(c.messages[4].joined_text(), "B");
        assert_eq!(
            c.messages[5].content,
            vec![Part::Image {
                url: "data:image/png;base64,AA".into()
            }]
        );
        assert_eq!(c.messages.len(), 6);
        assert_eq!(c.sampling.max_tokens, Some(50));
        assert!(c.notes.iter().any(|n| n.contains("encrypted_content")));
        assert_eq!(c.extra["instructions"], "be brief");
        let r = render_answer(&c, &answer("ok", None, vec![], Finish::Stop), "resp_x");
        assert_eq!(r["instructions"], "be brief");
        assert_eq!(r["metadata"], json!({"k": "v"}));
        assert_eq!(r["max_output_tokens"], 50);
        assert_eq!(r["previous_response_id"], Value::Null);
    }

    #[test]
    fn custom_tool_maps_to_function_and_back() {
        let body = json!({
            "model": "m",
            "input": [
                {"type": "custom_tool_call", "call_id": "c1", "name": "apply_patch", "input": "*** Begin Patch"},
                {"type": "custom_tool_call_output", "call_id": "c1", "output": "done"}
            ],
            "tools": [{"type": "custom", "name": "apply_patch", "description": "Patch files.",
                       "format": {"type": "grammar", "syntax": "lark", "definition": "start: x"}}]
        });
        let c = parse_request(&body).unwrap();
        assert_eq!(c.tools[0].name, "apply_patch");
        assert!(
            c.tools[0]
                .description
                .as_deref()
                .unwrap()
                .contains("start: x")
        );
        assert_eq!(
            c.messages[0].tool_calls[0].arguments,
            json!({"input": "*** Begin Patch"}).to_string()
        );
        let call = ToolCall {
            id: "c2".into(),
            name: "apply_patch".into(),
            arguments: json!({"input": "P"}).to_string(),
        };
        let r = render_answer(
            &c,
            &answer("", None, vec![call.clone()], Finish::ToolCalls),
            "resp_1",
        );
        assert_eq!(r["output"][0]["type"], "custom_tool_call");
        assert_eq!(r["output"][0]["input"], "P");
        assert_eq!(r["output"][0]["call_id"], "c2");
        // Streamed the same way.
        let mut s = stream(&c, "resp_1");
        let mut bytes = s.start();
        bytes.extend(s.push(&Delta::ToolCallStart {
            index: 0,
            id: "c2".into(),
            name: "apply_patch".into(),
        }));
        bytes.extend(s.push(&Delta::ToolCallArgs {
            index: 0,
            arguments: call.arguments.clone(),
        }));
        bytes.extend(s.finish(&answer("", None, vec![call], Finish::ToolCalls)));
        let mut asm = ResponsesAssembler::new();
        for b in &bytes {
            for (_, ev) in parse_sse(b) {
                asm.push(&ev);
            }
        }
        assert_eq!(asm.finish().unwrap()["output"], r["output"]);
    }

    #[test]
    fn bad_inputs_name_the_path() {
        let cases: Vec<(Value, &str)> = vec![
            (json!([]), "body"),
            (json!({"input": "x"}), "model"),
            (json!({"model": 3, "input": "x"}), "model"),
            (json!({"model": "m"}), "input"),
            (json!({"model": "m", "input": 5}), "input"),
            (json!({"model": "m", "input": [1]}), "input[0]"),
            (
                json!({"model": "m", "input": [{"foo": 1}]}),
                "input[0].type",
            ),
            (
                json!({"model": "m", "input": ["x", {"role": "user", "content": "a"}, {"role": "user", "content": "b"}, {"role": "user", "content": 7}]}),
                "input[0]",
            ),
            (
                json!({"model": "m", "input": [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}, {"role": "user", "content": "c"}, {"role": "user", "content": 7}]}),
                "input[3].content",
            ),
            (
                json!({"model": "m", "input": [{"role": "robot", "content": "a"}]}),
                "input[0].role",
            ),
            (
                json!({"model": "m", "input": [{"role": "user", "content": [{"type": "input_text", "text": 1}]}]}),
                "input[0].content[0].text",
            ),
            (
                json!({"model": "m", "input": [{"role": "user", "content": [{"type": "input_image", "image_url": 1}]}]}),
                "input[0].content[0].image_url",
            ),
            (
                json!({"model": "m", "input": [{"type": "function_call", "name": "f", "arguments": "{}"}]}),
                "input[0].call_id",
            ),
            (
                json!({"model": "m", "input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": 3}]}),
                "input[0].arguments",
            ),
            (
                json!({"model": "m", "input": [{"type": "function_call_output", "call_id": "c", "output": 3}]}),
                "input[0].output",
            ),
            (
                json!({"model": "m", "input": [{"type": "reasoning", "summary": "s"}]}),
                "input[0].summary",
            ),
            (
                json!({"model": "m", "input": [{"type": "item_reference", "id": "x"}]}),
                "input[0]",
            ),
            (
                json!({"model": "m", "input": "x", "previous_response_id": "resp_1"}),
                "previous_response_id",
            ),
            (json!({"model": "m", "input": "x", "tools": {}}), "tools"),
            (
                json!({"model": "m", "input": "x", "tools": [{"type": "function"}]}),
                "tools[0].name",
            ),
            (
                json!({"model": "m", "input": "x", "tools": [{"type": "function", "name": "f", "parameters": "x"}]}),
                "tools[0].parameters",
            ),
            (
                json!({"model": "m", "input": "x", "tool_choice": "sometimes"}),
                "tool_choice",
            ),
            (
                json!({"model": "m", "input": "x", "temperature": "hot"}),
                "temperature",
            ),
            (
                json!({"model": "m", "input": "x", "max_output_tokens": -1}),
                "max_output_tokens",
            ),
            (
                json!({"model": "m", "input": "x", "stream": "yes"}),
                "stream",
            ),
            (
                json!({"model": "m", "input": "x", "reasoning": {"effort": 1}}),
                "reasoning.effort",
            ),
        ];
        for (body, path) in cases {
            match parse_request(&body) {
                Err(GatewayError::InvalidField { param, message }) => {
                    assert_eq!(param, path, "{body}: {message}");
                    assert!(message.contains(path), "{message} should name {path}");
                }
                other => panic!("{body}: expected an InvalidField error for {path}, got {other:?}"),
            }
        }
    }

    #[test]
    fn unknown_tools_and_nulls_are_tolerated() {
        let body = json!({
            "model": "m", "input": [{"type": "message", "role": "user", "content": "x", "status": null, "id": null}],
            "tools": [{"type": "local_shell"}, {"type": "file_search", "vector_store_ids": []}, {"type": "image_generation"}],
            "tool_choice": {"type": "web_search"},
            "temperature": null, "previous_response_id": null, "store": false, "truncation": "auto"
        });
        let c = parse_request(&body).unwrap();
        assert!(c.tools.is_empty());
        assert_eq!(c.notes.len(), 4, "{:?}", c.notes);
        assert_eq!(c.tool_choice, None);
        let r = render_answer(&c, &answer("x", None, vec![], Finish::Stop), "resp_1");
        assert_eq!(r["store"], false);
        assert_eq!(r["truncation"], "auto");
    }

    #[test]
    fn render_text_and_tool_calls() {
        let c = parse_request(&json!({"model": "m", "input": "hi"})).unwrap();
        let calls = vec![
            ToolCall {
                id: "call_1".into(),
                name: "f".into(),
                arguments: "{\"a\":1}".into(),
            },
            ToolCall {
                id: "call_2".into(),
                name: "g".into(),
                arguments: "{}".into(),
            },
        ];
        let r = render_answer(
            &c,
            &answer("hello", Some("hmm"), calls, Finish::ToolCalls),
            "resp_abc",
        );
        assert_eq!(r["object"], "response");
        assert_eq!(r["id"], "resp_abc");
        assert_eq!(r["status"], "completed");
        assert_eq!(r["model"], "m");
        assert_eq!(r["created_at"], 1_700_000_000);
        let out = r["output"].as_array().unwrap();
        assert_eq!(out.len(), 4);
        assert_eq!(out[0]["type"], "reasoning");
        assert_eq!(out[0]["id"], "rs_abc_0");
        assert_eq!(out[0]["content"][0]["text"], "hmm");
        assert_eq!(out[1]["type"], "message");
        assert_eq!(out[1]["id"], "msg_abc_1");
        assert_eq!(out[1]["content"][0]["type"], "output_text");
        assert_eq!(out[1]["content"][0]["text"], "hello");
        assert_eq!(
            out[2],
            json!({"id": "fc_abc_2", "type": "function_call", "status": "completed", "call_id": "call_1", "name": "f", "arguments": "{\"a\":1}"})
        );
        assert_eq!(out[3]["call_id"], "call_2");
        assert_eq!(
            r["usage"],
            json!({"input_tokens": 10, "input_tokens_details": {"cached_tokens": 2}, "output_tokens": 5,
                   "output_tokens_details": {"reasoning_tokens": 1}, "total_tokens": 15})
        );
        let r = render_answer(&c, &answer("cut", None, vec![], Finish::Length), "resp_abc");
        assert_eq!(r["status"], "incomplete");
        assert_eq!(
            r["incomplete_details"],
            json!({"reason": "max_output_tokens"})
        );
        assert_eq!(r["output"][0]["status"], "incomplete");
    }

    #[test]
    fn stream_event_order_text_then_tool_then_text() {
        let c = parse_request(&json!({"model": "m", "input": "hi"})).unwrap();
        let mut s = stream(&c, "resp_z");
        let mut bytes = s.start();
        bytes.extend(s.push(&Delta::Text("a".into())));
        bytes.extend(s.push(&Delta::ToolCallStart {
            index: 0,
            id: "c".into(),
            name: "f".into(),
        }));
        bytes.extend(s.push(&Delta::ToolCallArgs {
            index: 0,
            arguments: "{}".into(),
        }));
        bytes.extend(s.push(&Delta::Text("b".into())));
        bytes.extend(s.finish(&answer("ab", None, vec![], Finish::Length)));
        let events: Vec<(String, Value)> = bytes.iter().flat_map(|b| parse_sse(b)).collect();
        let names: Vec<&str> = events.iter().map(|(n, _)| n.as_str()).collect();
        assert_eq!(
            names,
            [
                "response.created",
                "response.in_progress",
                "response.output_item.added",
                "response.content_part.added",
                "response.output_text.delta",
                "response.output_text.done",
                "response.content_part.done",
                "response.output_item.done",
                "response.output_item.added",
                "response.function_call_arguments.delta",
                "response.function_call_arguments.done",
                "response.output_item.done",
                "response.output_item.added",
                "response.content_part.added",
                "response.output_text.delta",
                "response.output_text.done",
                "response.content_part.done",
                "response.output_item.done",
                "response.incomplete",
            ]
        );
        for (n, v) in &events {
            assert_eq!(v["type"], n.as_str());
        }
        assert_eq!(events[0].1["response"]["status"], "in_progress");
        let last = &events.last().unwrap().1["response"];
        assert_eq!(last["status"], "incomplete");
        assert_eq!(last["incomplete_details"]["reason"], "max_output_tokens");
        assert_eq!(last["output"][2]["id"], "msg_z_2");
        assert_eq!(last["output"][2]["status"], "incomplete");
        assert_eq!(last["output"][1]["arguments"], "{}");
    }

    #[test]
    fn errors_mid_stream() {
        let err = GatewayError::UpstreamStream {
            upstream: "u".into(),
            detail: "reset".into(),
        };
        let evs = parse_sse(&error_event(&err, "resp_q"));
        assert_eq!(evs.len(), 2);
        assert_eq!(evs[0].0, "error");
        assert_eq!(evs[0].1["code"], "upstream_stream_interrupted");
        assert!(evs[0].1["message"].as_str().unwrap().contains("reset"));
        assert!(evs[0].1["error"].is_object());
        assert_eq!(evs[1].1["response"]["status"], "failed");
        assert_eq!(
            evs[1].1["response"]["error"]["code"],
            "upstream_stream_interrupted"
        );
        assert!(evs[0].1["sequence_number"].as_u64() < evs[1].1["sequence_number"].as_u64());

        let c = parse_request(&json!({"model": "m", "input": "hi"})).unwrap();
        let mut s = stream(&c, "resp_q");
        let mut bytes = s.start();
        bytes.extend(s.push(&Delta::Text("par".into())));
        let ctx = GatewayError::UpstreamStatus {
            upstream: "u".into(),
            status: 400,
            detail: "maximum context length is 8192".into(),
        };
        bytes.extend(s.fail(&ctx));
        assert!(s.finish(&answer("", None, vec![], Finish::Stop)).is_empty());
        let evs: Vec<(String, Value)> = bytes.iter().flat_map(|b| parse_sse(b)).collect();
        let (name, failed) = evs.last().unwrap();
        assert_eq!(name, "response.failed");
        assert_eq!(
            failed["response"]["error"]["code"],
            "context_length_exceeded"
        );
        let mut asm = ResponsesAssembler::new();
        for (_, e) in &evs {
            asm.push(e);
        }
        assert_eq!(asm.finish().unwrap()["status"], "failed");
    }

    #[test]
    fn assembler_builds_from_deltas_without_terminal() {
        let mut asm = ResponsesAssembler::new();
        assert!(asm.finish().is_none());
        for e in [
            json!({"type": "response.created", "response": {"id": "r", "object": "response", "status": "in_progress", "output": []}}),
            json!({"type": "response.output_item.added", "output_index": 0, "item": {"id": "rs", "type": "reasoning", "summary": []}}),
            json!({"type": "response.reasoning_summary_text.delta", "item_id": "rs", "output_index": 0, "summary_index": 0, "delta": "th"}),
            json!({"type": "response.reasoning_summary_text.delta", "item_id": "rs", "output_index": 0, "summary_index": 0, "delta": "ink"}),
            json!({"type": "response.output_item.added", "output_index": 1, "item": {"id": "fc", "type": "function_call", "call_id": "c", "name": "f", "arguments": ""}}),
            json!({"type": "response.function_call_arguments.delta", "item_id": "fc", "delta": "{\"a\""}),
            json!({"type": "response.function_call_arguments.delta", "item_id": "fc", "output_index": 1, "delta": ":1}"}),
        ] {
            asm.push(&e);
        }
        let r = asm.finish().unwrap();
        assert_eq!(r["status"], "incomplete");
        assert_eq!(r["output"][0]["summary"][0]["text"], "think");
        assert_eq!(r["output"][1]["arguments"], "{\"a\":1}");
        // A terminal event with an empty output (as some servers send) gets the items.
        asm.push(&json!({"type": "response.completed", "response": {"id": "r", "status": "completed", "output": [], "usage": {"input_tokens": 1}}}));
        let r = asm.finish().unwrap();
        assert_eq!(r["status"], "completed");
        assert_eq!(r["output"].as_array().unwrap().len(), 2);
    }

    /// Splits `s` into pieces at the given char cut points.
    fn chop(s: &str, cuts: &[usize]) -> Vec<String> {
        let chars: Vec<char> = s.chars().collect();
        let mut points: Vec<usize> = cuts.iter().map(|c| c % (chars.len() + 1)).collect();
        points.push(0);
        points.push(chars.len());
        points.sort_unstable();
        points.dedup();
        points
            .windows(2)
            .map(|w| chars[w[0]..w[1]].iter().collect::<String>())
            .filter(|p| !p.is_empty())
            .collect()
    }

    fn json_args() -> impl Strategy<Value = String> {
        prop::collection::btree_map(
            "[a-z]{1,5}",
            prop_oneof![
                any::<i64>().prop_map(|n| json!(n)),
                "[ -~é😀\\n\"]{0,12}".prop_map(|s| json!(s)),
                any::<bool>().prop_map(|b| json!(b)),
            ],
            0..4,
        )
        .prop_map(|m| serde_json::to_string(&m).unwrap())
    }

    proptest! {
        #[test]
        fn stream_matches_render(
            text in "[ -~é😀\\n]{0,40}",
            reasoning in prop::option::of("[ -~ü\\n]{1,30}"),
            calls in prop::collection::vec(("[a-z_]{1,8}", json_args()), 0..4),
            cuts in prop::collection::vec(any::<usize>(), 0..8),
            finish in prop_oneof![Just(Finish::Stop), Just(Finish::Length), Just(Finish::ToolCalls)],
        ) {
            let conv = parse_request(&json!({"model": "m", "input": "hi", "stream": true})).unwrap();
            let tool_calls: Vec<ToolCall> = calls
                .iter()
                .enumerate()
                .map(|(i, (name, args))| ToolCall { id: format!("call_{i}"), name: name.clone(), arguments: args.clone() })
                .collect();
            let ans = answer(&text, reasoning.as_deref(), tool_calls.clone(), finish);

            let mut deltas = Vec::new();
            if let Some(r) = &reasoning {
                deltas.extend(chop(r, &cuts).into_iter().map(Delta::Reasoning));
            }
            deltas.extend(chop(&text, &cuts).into_iter().map(Delta::Text));
            for (i, tc) in tool_calls.iter().enumerate() {
                deltas.push(Delta::ToolCallStart { index: i, id: tc.id.clone(), name: tc.name.clone() });
                deltas.extend(chop(&tc.arguments, &cuts).into_iter().map(|a| Delta::ToolCallArgs { index: i, arguments: a }));
            }

            let mut s = stream(&conv, "resp_p");
            let mut bytes = s.start();
            for d in &deltas {
                bytes.extend(s.push(d));
            }
            bytes.extend(s.finish(&ans));
            let all: Vec<u8> = bytes.iter().flat_map(|b| b.iter().copied()).collect();
            let events = parse_sse(&all);

            let mut last_seq = None;
            let mut added: HashMap<String, usize> = HashMap::new();
            let mut done: HashMap<String, usize> = HashMap::new();
            let mut asm = ResponsesAssembler::new();
            for (name, ev) in &events {
                prop_assert_eq!(ev["type"].as_str(), Some(name.as_str()));
                let seq = ev["sequence_number"].as_u64().unwrap();
                prop_assert!(last_seq.is_none_or(|l| seq > l));
                last_seq = Some(seq);
                if name == "response.output_item.added" {
                    *added.entry(ev["item"]["id"].as_str().unwrap().to_string()).or_default() += 1;
                }
                if name == "response.output_item.done" {
                    *done.entry(ev["item"]["id"].as_str().unwrap().to_string()).or_default() += 1;
                }
                asm.push(ev);
            }
            prop_assert!(added.values().all(|n| *n == 1));
            prop_assert_eq!(&added, &done);

            let rendered = render_answer(&conv, &ans, "resp_p");
            let assembled = asm.finish().unwrap();
            prop_assert_eq!(&assembled["output"], &rendered["output"]);
            prop_assert_eq!(&assembled["usage"], &rendered["usage"]);
            prop_assert_eq!(&assembled["status"], &rendered["status"]);
            prop_assert_eq!(added.len(), rendered["output"].as_array().unwrap().len());

            // The assembler also rebuilds the same output from the deltas alone.
            let mut from_deltas = ResponsesAssembler::new();
            for (name, ev) in &events {
                if name != "response.output_item.done" && !name.starts_with("response.completed") && !name.starts_with("response.incomplete") {
                    from_deltas.push(ev);
                }
            }
            let partial = from_deltas.finish().unwrap();
            let strip = |v: &Value| -> Vec<Value> {
                v.as_array().unwrap().iter().map(|i| {
                    let mut i = i.clone();
                    i.as_object_mut().unwrap().remove("status");
                    i
                }).collect()
            };
            prop_assert_eq!(strip(&partial["output"]), strip(&rendered["output"]));
        }
    }
}

//! Responses requests → [`Conversation`].

use serde_json::{Map, Value, json};

use crate::dialect::json::{Fields, Wording, given, non_negative_int};
use crate::dialect::{
    Conversation, Message, Part, Reasoning, Role, Tool, ToolCall, ToolChoice, kind,
};
use crate::error::GatewayError;

const F: Fields = Fields(Wording::Plain);

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

/// Parses a Responses request body.
pub fn parse_request(body: &Value) -> Result<Conversation, GatewayError> {
    let Some(obj) = body.as_object() else {
        return Err(F.wrong("body", "a JSON object", body));
    };
    let mut conv = Conversation {
        model: F.req_str(obj, "model", "model")?.to_string(),
        ..Conversation::default()
    };

    for key in ["previous_response_id", "conversation"] {
        if let Some(v) = given(obj, key) {
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
    if let Some(v) = given(obj, "prompt") {
        return Err(GatewayError::field(
            "prompt",
            format!(
                "prompt (a stored prompt template, got {}) is not supported: send `instructions` and `input` instead",
                kind(v)
            ),
        ));
    }

    let mut parser = InputParser::default();
    match given(obj, "instructions") {
        None => {}
        Some(Value::String(s)) if s.is_empty() => {}
        Some(Value::String(s)) => parser.messages.push(Message::text(Role::System, s.clone())),
        Some(Value::Array(items)) => {
            for (i, item) in items.iter().enumerate() {
                parser.item(item, &format!("instructions[{i}]"))?;
            }
            parser.end_run();
        }
        Some(v) => return Err(F.wrong("instructions", "a string or an array of items", v)),
    }
    match given(obj, "input") {
        None => return Err(F.missing("input", "a string or an array of items")),
        Some(Value::String(s)) => parser.messages.push(Message::text(Role::User, s.clone())),
        Some(Value::Array(items)) => {
            for (i, item) in items.iter().enumerate() {
                parser.item(item, &format!("input[{i}]"))?;
            }
        }
        Some(v) => return Err(F.wrong("input", "a string or an array of items", v)),
    }
    parser.finish();
    conv.messages = parser.messages;
    conv.notes = parser.notes;

    let mut custom_tools = Vec::new();
    match given(obj, "tools") {
        None => {}
        Some(Value::Array(tools)) => {
            for (i, t) in tools.iter().enumerate() {
                parse_tool(t, &format!("tools[{i}]"), &mut conv, &mut custom_tools)?;
            }
        }
        Some(v) => return Err(F.wrong("tools", "an array", v)),
    }
    if !custom_tools.is_empty() {
        conv.extra.insert(
            CUSTOM_TOOLS_KEY.into(),
            Value::Array(custom_tools.into_iter().map(Value::String).collect()),
        );
    }

    conv.tool_choice = parse_tool_choice(given(obj, "tool_choice"), &mut conv.notes)?;
    conv.parallel_tool_calls = F.opt_bool(obj, "parallel_tool_calls", "parallel_tool_calls")?;
    conv.sampling.temperature = F.opt_f64(obj, "temperature", "temperature")?;
    conv.sampling.top_p = F.opt_f64(obj, "top_p", "top_p")?;
    conv.sampling.max_tokens = non_negative_int(obj, "max_output_tokens")?;
    conv.stream = F.opt_bool(obj, "stream", "stream")?.unwrap_or(false);
    // `include: ["message.output_text.logprobs"]` asks for the sampled tokens' logprobs,
    // `top_logprobs: n` for the n most likely alternatives of each (OpenAI's and vLLM's
    // Responses; exact mode answers them).
    let top_logprobs = non_negative_int(obj, "top_logprobs")?;
    let include_logprobs = match given(obj, "include") {
        None => false,
        Some(Value::Array(items)) => items
            .iter()
            .any(|i| i.as_str() == Some("message.output_text.logprobs")),
        Some(v) => return Err(F.wrong("include", "an array of strings", v)),
    };
    if include_logprobs {
        conv.logprobs = Some(u32::try_from(top_logprobs.unwrap_or(0)).unwrap_or(u32::MAX));
    }

    match given(obj, "reasoning") {
        None => {}
        Some(Value::Object(r)) => {
            let effort = F
                .opt_str(r, "effort", "reasoning.effort")?
                .map(str::to_string);
            // `generate_summary` is the deprecated spelling of `summary`.
            let summary = match F.opt_str(r, "summary", "reasoning.summary")? {
                Some(s) => Some(s.to_string()),
                None => F
                    .opt_str(r, "generate_summary", "reasoning.generate_summary")?
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
        Some(v) => return Err(F.wrong("reasoning", "an object", v)),
    }

    match given(obj, "text") {
        None | Some(Value::Null) => {}
        Some(Value::Object(text)) => {
            conv.sampling.format = crate::dialect::OutputFormat::from_openai(
                text.get("format"),
                "text.format",
                false,
            )?;
        }
        Some(v) => return Err(F.wrong("text", "an object", v)),
    }
    if given(obj, "background") == Some(&Value::Bool(true)) {
        conv.notes
            .push("background: true is not supported; the response is produced inline".into());
    }
    for key in EXTRA_FIELDS {
        if let Some(v) = given(obj, key) {
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
            return Err(F.wrong(path, "an object (an input item)", item));
        };
        let ty = F.opt_str(obj, "type", &format!("{path}.type"))?;
        match ty {
            None | Some("message") => {
                if ty.is_none() && given(obj, "role").is_none() {
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
                    id: F
                        .req_str(obj, "call_id", &format!("{path}.call_id"))?
                        .to_string(),
                    name: F.req_str(obj, "name", &format!("{path}.name"))?.to_string(),
                    arguments: match given(obj, "arguments") {
                        None => String::new(),
                        Some(Value::String(s)) => s.clone(),
                        // Some clients send the arguments as an object: keep its JSON text.
                        Some(v @ Value::Object(_)) => v.to_string(),
                        Some(v) => {
                            return Err(F.wrong(&format!("{path}.arguments"), "a JSON string", v));
                        }
                    },
                };
                self.assistant(true).tool_calls.push(call);
                Ok(())
            }
            Some("custom_tool_call") => {
                let input = match given(obj, "input") {
                    None => "",
                    Some(Value::String(s)) => s.as_str(),
                    Some(v) => return Err(F.wrong(&format!("{path}.input"), "a string", v)),
                };
                let call = ToolCall {
                    id: F
                        .req_str(obj, "call_id", &format!("{path}.call_id"))?
                        .to_string(),
                    name: F.req_str(obj, "name", &format!("{path}.name"))?.to_string(),
                    arguments: json!({ "input": input }).to_string(),
                };
                self.assistant(true).tool_calls.push(call);
                Ok(())
            }
            Some("function_call_output") | Some("custom_tool_call_output") => {
                let call_id = F
                    .req_str(obj, "call_id", &format!("{path}.call_id"))?
                    .to_string();
                let out_path = format!("{path}.output");
                let content = match given(obj, "output") {
                    None => vec![],
                    Some(Value::String(s)) => vec![Part::Text { text: s.clone() }],
                    Some(Value::Array(parts)) => self.parts(parts, &out_path)?,
                    Some(v) => {
                        return Err(F.wrong(&out_path, "a string or an array of content parts", v));
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
        let role = match F.req_str(obj, "role", &role_path)? {
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
        let content = match given(obj, "content") {
            None => vec![],
            Some(Value::String(s)) => vec![Part::Text { text: s.clone() }],
            Some(Value::Array(parts)) => self.parts(parts, &content_path)?,
            Some(v) => {
                return Err(F.wrong(&content_path, "a string or an array of content parts", v));
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
                return Err(F.wrong(&ppath, "an object (a content part)", p));
            };
            let ty = F.req_str(pobj, "type", &format!("{ppath}.type"))?;
            match ty {
                "input_text" | "output_text" | "text" | "summary_text" | "reasoning_text" => {
                    let text = F.req_str(pobj, "text", &format!("{ppath}.text"))?;
                    out.push(Part::Text {
                        text: text.to_string(),
                    });
                }
                "refusal" => {
                    let text = F.req_str(pobj, "refusal", &format!("{ppath}.refusal"))?;
                    out.push(Part::Text {
                        text: text.to_string(),
                    });
                }
                "input_image" => match given(pobj, "image_url") {
                    Some(Value::String(url)) => out.push(Part::Image { url: url.clone() }),
                    // The Chat shape `{image_url: {url}}` turns up from some clients.
                    Some(Value::Object(o)) if o.get("url").is_some_and(Value::is_string) => {
                        let url = o.get("url").and_then(Value::as_str).unwrap_or_default();
                        out.push(Part::Image {
                            url: url.to_string(),
                        });
                    }
                    Some(v) => {
                        return Err(F.wrong(&format!("{ppath}.image_url"), "a string (URL)", v));
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
        if given(obj, "encrypted_content").is_some() {
            self.encrypted_reasoning += 1;
        }
        let texts = |key: &str| -> Result<Vec<String>, GatewayError> {
            let kpath = format!("{path}.{key}");
            match given(obj, key) {
                None => Ok(vec![]),
                Some(Value::Array(parts)) => {
                    let mut out = Vec::new();
                    for (i, p) in parts.iter().enumerate() {
                        let ppath = format!("{kpath}[{i}]");
                        let Some(pobj) = p.as_object() else {
                            return Err(F.wrong(&ppath, "an object", p));
                        };
                        out.push(
                            F.req_str(pobj, "text", &format!("{ppath}.text"))?
                                .to_string(),
                        );
                    }
                    Ok(out)
                }
                Some(v) => Err(F.wrong(&kpath, "an array", v)),
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
        return Err(F.wrong(path, "an object (a tool)", t));
    };
    let ty = F.req_str(obj, "type", &format!("{path}.type"))?;
    match ty {
        "function" => {
            // Tolerate the Chat Completions shape `{type: function, function: {...}}`.
            let f = match given(obj, "function") {
                Some(Value::Object(f)) if given(obj, "name").is_none() => f,
                _ => obj,
            };
            let parameters = match given(f, "parameters") {
                None => json!({"type": "object", "properties": {}}),
                Some(v @ Value::Object(_)) => v.clone(),
                Some(v) => return Err(F.wrong(&format!("{path}.parameters"), "an object", v)),
            };
            conv.tools.push(Tool {
                name: F.req_str(f, "name", &format!("{path}.name"))?.to_string(),
                description: F.opt_str(f, "description", &format!("{path}.description"))?
                    .map(str::to_string),
                parameters,
                strict: match given(f, "strict") {
                    None => None,
                    Some(Value::Bool(b)) => Some(*b),
                    Some(v) => return Err(F.wrong(&format!("{path}.strict"), "a boolean", v)),
                },
            });
        }
        "custom" => {
            let name = F.req_str(obj, "name", &format!("{path}.name"))?.to_string();
            let mut description = F.opt_str(obj, "description", &format!("{path}.description"))?
                .unwrap_or_default()
                .to_string();
            if let Some(Value::Object(format)) = given(obj, "format")
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
            let name = F.opt_str(obj, "name", &format!("{path}.name"))?.unwrap_or("?");
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
            let ty = F.req_str(o, "type", "tool_choice.type")?;
            match ty {
                "function" | "custom" => {
                    let name = match given(o, "name") {
                        Some(Value::String(n)) => n.clone(),
                        // Chat shape: {type: function, function: {name}}
                        _ => match o
                            .get("function")
                            .and_then(|f| f.get("name"))
                            .and_then(Value::as_str)
                        {
                            Some(n) => n.to_string(),
                            None => return Err(F.missing("tool_choice.name", "a string")),
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
        other => Err(F.wrong("tool_choice", "a string or an object", other)),
    }
}

//! Whole Responses `response` objects, and the item builders the stream shares.

use serde_json::{Map, Value, json};

use super::CUSTOM_TOOLS_KEY;
use crate::dialect::{Answer, Conversation, Finish, Tool, ToolChoice};

pub(super) fn id_suffix(response_id: &str) -> &str {
    response_id.strip_prefix("resp_").unwrap_or(response_id)
}

pub(super) fn item_id(prefix: &str, suffix: &str, output_index: usize) -> String {
    format!("{prefix}{suffix}_{output_index}")
}

pub(super) fn custom_tool_names(conv: &Conversation) -> Vec<String> {
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
pub(super) fn custom_input(arguments: &str) -> String {
    match serde_json::from_str::<Value>(arguments) {
        Ok(Value::Object(o)) => match o.get("input") {
            Some(Value::String(s)) => s.clone(),
            _ => arguments.to_string(),
        },
        _ => arguments.to_string(),
    }
}

/// An `output_text` part; `logprobs`: the answer's tokens when the client asked for them
/// (`include: ["message.output_text.logprobs"]`), as vLLM's Responses server puts every
/// output token's there.
pub(super) fn output_text_part(text: &str, logprobs: &[Value]) -> Value {
    json!({"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs})
}

pub(super) fn message_item(id: &str, text: &str, status: &str, logprobs: &[Value]) -> Value {
    json!({
        "id": id,
        "type": "message",
        "status": status,
        "role": "assistant",
        "content": [output_text_part(text, logprobs)],
    })
}

pub(super) fn reasoning_item(id: &str, text: &str, status: &str) -> Value {
    json!({
        "id": id,
        "type": "reasoning",
        "status": status,
        "summary": [],
        "content": [{"type": "reasoning_text", "text": text}],
    })
}

pub(super) fn call_item(
    id: &str,
    call_id: &str,
    name: &str,
    args: &str,
    custom: bool,
    status: &str,
) -> Value {
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
pub(super) fn response_skeleton(
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

/// The response's `status` for an answer's finish.
pub(super) fn status(f: Finish) -> &'static str {
    match f {
        Finish::Stop | Finish::ToolCalls => "completed",
        Finish::Length | Finish::ContentFilter => "incomplete",
        Finish::Error => "failed",
    }
}

/// Fills in the terminal fields of a response object from the answer.
pub(super) fn finalize(resp: &mut Map<String, Value>, answer: &Answer, output: Vec<Value>) {
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
pub(super) fn mark_last_status(output: &mut [Value], finish: Finish) {
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
        let logprobs = answer
            .logprobs
            .as_deref()
            .map(crate::dialect::logprob_items)
            .unwrap_or_default();
        output.push(message_item(&id, &answer.text, "completed", &logprobs));
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

//! A call's messages as the harness saw them, from the record's normalized conversation
//! (graft's internal form) or, when the call was not normalized, the client's own body.

use serde::Serialize;
use serde_json::Value;

#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct Msg {
    pub role: String,
    pub text: String,
    pub reasoning: Option<String>,
    pub tool_calls: Vec<Call>,
    pub tool_call_id: Option<String>,
}

#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct Call {
    pub name: String,
    pub arguments: String,
}

fn text_of(v: &Value) -> String {
    match v {
        Value::Null => String::new(),
        Value::String(s) => s.clone(),
        Value::Array(parts) => parts
            .iter()
            .filter_map(|p| match p {
                Value::String(s) => Some(s.clone()),
                _ => p
                    .get("text")
                    .and_then(Value::as_str)
                    .map(str::to_owned)
                    .or_else(|| p.get("url").map(|_| "[image]".to_owned()))
                    .or_else(|| p.get("image_url").map(|_| "[image]".to_owned())),
            })
            .collect::<Vec<_>>()
            .join("\n"),
        other => other.to_string(),
    }
}

fn str_field(v: &Value, keys: &[&str]) -> Option<String> {
    keys.iter()
        .find_map(|k| v.get(*k).and_then(Value::as_str))
        .filter(|s| !s.is_empty())
        .map(str::to_owned)
}

fn tool_calls(v: &Value) -> Vec<Call> {
    v.get("tool_calls")
        .and_then(Value::as_array)
        .map(|calls| {
            calls
                .iter()
                .map(|c| {
                    let f = c.get("function").unwrap_or(c);
                    Call {
                        name: str_field(f, &["name"]).unwrap_or_default(),
                        arguments: match f.get("arguments") {
                            Some(Value::String(s)) => s.clone(),
                            Some(other) => other.to_string(),
                            None => String::new(),
                        },
                    }
                })
                .collect()
        })
        .unwrap_or_default()
}

/// One message in either the internal or the Chat Completions shape.
pub fn message(m: &Value) -> Msg {
    Msg {
        role: str_field(m, &["role"]).unwrap_or_else(|| "?".into()),
        text: text_of(m.get("content").unwrap_or(&Value::Null)),
        reasoning: str_field(m, &["reasoning", "reasoning_content"]),
        tool_calls: tool_calls(m),
        tool_call_id: str_field(m, &["tool_call_id"]),
    }
}

/// The messages a call sent: normalized first, else the client's `messages`; a body with
/// neither (e.g. a Completions prompt) becomes one user message of its prompt or JSON.
pub fn request_messages(normalized: Option<&Value>, request: &Value) -> Vec<Msg> {
    let list = normalized
        .and_then(|n| n.get("messages"))
        .or_else(|| request.get("messages"))
        .and_then(Value::as_array);
    match list {
        Some(ms) => ms.iter().map(message).collect(),
        None => vec![Msg {
            role: "user".into(),
            text: request
                .get("prompt")
                .map(text_of)
                .unwrap_or_else(|| request.to_string()),
            reasoning: None,
            tool_calls: vec![],
            tool_call_id: None,
        }],
    }
}

/// The answer: the normalized answer (`text`, `reasoning`, `tool_calls`), else the first
/// choice of a Chat Completions response.
pub fn answer(normalized: Option<&Value>, response: Option<&Value>) -> Option<Msg> {
    if let Some(n) = normalized.filter(|n| n.get("text").is_some()) {
        return Some(Msg {
            role: "assistant".into(),
            text: text_of(n.get("text").unwrap_or(&Value::Null)),
            reasoning: str_field(n, &["reasoning"]),
            tool_calls: tool_calls(n),
            tool_call_id: None,
        });
    }
    let r = response?;
    if let Some(m) = r.pointer("/choices/0/message") {
        return Some(message(m));
    }
    r.pointer("/choices/0/text").map(|t| Msg {
        role: "assistant".into(),
        text: text_of(t),
        reasoning: None,
        tool_calls: vec![],
        tool_call_id: None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn both_shapes_give_text_tool_calls_and_reasoning() {
        let internal = json!({"messages": [
            {"role": "user", "content": [{"type": "text", "text": "hi"}]},
            {"role": "assistant", "reasoning": "think", "tool_calls": [{"id": "c1", "name": "bash", "arguments": "{\"cmd\":\"ls\"}"}]},
            {"role": "tool", "tool_call_id": "c1", "content": [{"type": "text", "text": "a.txt"}]},
        ]});
        let ms = request_messages(Some(&internal), &json!({}));
        assert_eq!(ms.len(), 3);
        assert_eq!(ms[0].text, "hi");
        assert_eq!(ms[1].reasoning.as_deref(), Some("think"));
        assert_eq!(ms[1].tool_calls[0].name, "bash");
        assert_eq!(ms[2].tool_call_id.as_deref(), Some("c1"));
        let chat = json!({"messages": [{"role": "assistant", "content": null, "reasoning_content": "r",
            "tool_calls": [{"id": "x", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}]});
        let ms = request_messages(None, &chat);
        assert_eq!(ms[0].tool_calls[0].name, "f");
        assert_eq!(ms[0].reasoning.as_deref(), Some("r"));
        let a = answer(
            None,
            Some(&json!({"choices": [{"message": {"role": "assistant", "content": "ok"}}]})),
        )
        .unwrap();
        assert_eq!(a.text, "ok");
        assert_eq!(answer(Some(&json!({"text": "t"})), None).unwrap().text, "t");
    }
}

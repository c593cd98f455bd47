//! Redaction of credentials before anything is recorded, logged or exported.

use serde_json::Value;

/// What a redacted value is replaced with.
pub const REDACTED: &str = "[redacted]";

const SENSITIVE_KEYS: [&str; 5] = [
    "authorization",
    "proxy-authorization",
    "api_key",
    "api-key",
    "x-api-key",
];

/// Keys of a model request whose values are secrets a client may send beside the
/// conversation (in `metadata`, `user` objects, provider extras), redacted when the request
/// is recorded (the gateway's `recorder.redact_keys` replaces this list). Compared
/// case-insensitively, with `-` read as `_`.
pub const SECRET_BODY_KEYS: [&str; 12] = [
    "password",
    "passwd",
    "passphrase",
    "secret",
    "client_secret",
    "token",
    "access_token",
    "refresh_token",
    "id_token",
    "session_token",
    "private_key",
    "apikey",
];

/// The top-level fields of a model request that are the conversation and its tools: never
/// redacted by key, since what the model was shown must stay exactly as it was (a tool
/// whose parameter is named `password`, a tool call's own arguments).
const CONVERSATION_FIELDS: [&str; 10] = [
    "messages",
    "input",
    "prompt",
    "system",
    "instructions",
    "tools",
    "tool_choice",
    "functions",
    "response_format",
    "text",
];

/// Replaces with `"[redacted]"` the value of every key in `keys` (see [`SECRET_BODY_KEYS`])
/// anywhere in a model request body, except inside its conversation fields.
pub fn redact_body_keys(body: &mut Value, keys: &[String]) {
    let Value::Object(map) = body else {
        return;
    };
    for (key, v) in map.iter_mut() {
        if CONVERSATION_FIELDS.contains(&key.as_str()) {
            continue;
        }
        if is_listed(key, keys) {
            *v = Value::String(REDACTED.to_owned());
        } else {
            redact_listed(v, keys);
        }
    }
}

fn is_listed(key: &str, keys: &[String]) -> bool {
    let norm = key.replace('-', "_");
    keys.iter().any(|k| k.eq_ignore_ascii_case(&norm))
}

fn redact_listed(value: &mut Value, keys: &[String]) {
    match value {
        Value::Object(map) => {
            for (key, v) in map.iter_mut() {
                if is_listed(key, keys) {
                    *v = Value::String(REDACTED.to_owned());
                } else {
                    redact_listed(v, keys);
                }
            }
        }
        Value::Array(items) => items.iter_mut().for_each(|v| redact_listed(v, keys)),
        _ => {}
    }
}

/// Whether a header or JSON key carries a credential (case-insensitive).
pub fn is_sensitive_key(name: &str) -> bool {
    SENSITIVE_KEYS.iter().any(|k| k.eq_ignore_ascii_case(name))
}

/// Replaces, at any depth, the value of every key named `authorization`,
/// `proxy-authorization`, `api_key`, `api-key` or `x-api-key` (case-insensitive) with
/// `"[redacted]"`.
pub fn redact_json(value: &mut Value) {
    match value {
        Value::Object(map) => {
            for (key, v) in map.iter_mut() {
                if is_sensitive_key(key) {
                    *v = Value::String(REDACTED.to_owned());
                } else {
                    redact_json(v);
                }
            }
        }
        Value::Array(items) => items.iter_mut().for_each(redact_json),
        _ => {}
    }
}

/// Headers as a JSON object (`{"name": "value", ...}`): same rule as [`redact_json`].
pub fn redact_headers(value: &mut Value) {
    redact_json(value);
}

/// Headers as name/value pairs: values of sensitive names become `"[redacted]"`.
pub fn redact_header_pairs(headers: &mut [(String, String)]) {
    for (name, value) in headers {
        if is_sensitive_key(name) {
            REDACTED.clone_into(value);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn body_secrets_are_redacted_outside_the_conversation_only() {
        let keys: Vec<String> = SECRET_BODY_KEYS.iter().map(|k| k.to_string()).collect();
        let mut v = json!({
            "model": "m",
            "metadata": {"Password": "hunter2", "note": "keep", "deep": [{"access-token": "t"}]},
            "user": {"secret": {"nested": 1}},
            "token": "x",
            "messages": [{"role": "assistant", "tool_calls": [], "content": "my password"}],
            "tools": [{"type": "function", "function": {"name": "login", "parameters":
                {"type": "object", "properties": {"password": {"type": "string"}}}}}],
            "input": [{"type": "function_call", "arguments": {"password": "p"}}],
        });
        let want_conversation = (
            v["messages"].clone(),
            v["tools"].clone(),
            v["input"].clone(),
        );
        redact_body_keys(&mut v, &keys);
        assert_eq!(
            v["metadata"],
            json!({"Password": "[redacted]", "note": "keep", "deep": [{"access-token": "[redacted]"}]})
        );
        assert_eq!(v["user"], json!({"secret": "[redacted]"}));
        assert_eq!(v["token"], "[redacted]");
        assert_eq!(v["model"], "m");
        assert_eq!(
            (
                v["messages"].clone(),
                v["tools"].clone(),
                v["input"].clone()
            ),
            want_conversation
        );
        // A list of one's own replaces the default.
        let mut v = json!({"metadata": {"password": "p", "tenant": "t"}});
        redact_body_keys(&mut v, &["tenant".to_string()]);
        assert_eq!(
            v["metadata"],
            json!({"password": "p", "tenant": "[redacted]"})
        );
    }

    #[test]
    fn redacts_credentials_at_any_depth_case_insensitively() {
        let mut v = json!({
            "Authorization": "Bearer sk-1",
            "model": "m",
            "extra": {"API_KEY": "k", "nested": [{"X-Api-Key": "k2", "keep": "me"}]},
            "api-key": {"deep": "object"},
        });
        redact_json(&mut v);
        assert_eq!(
            v,
            json!({
                "Authorization": "[redacted]",
                "model": "m",
                "extra": {"API_KEY": "[redacted]", "nested": [{"X-Api-Key": "[redacted]", "keep": "me"}]},
                "api-key": "[redacted]",
            })
        );
        let mut h = vec![
            ("authorization".to_owned(), "Bearer x".to_owned()),
            ("accept".to_owned(), "*/*".to_owned()),
        ];
        redact_header_pairs(&mut h);
        assert_eq!(h[0].1, REDACTED);
        assert_eq!(h[1].1, "*/*");
    }
}

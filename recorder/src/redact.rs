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

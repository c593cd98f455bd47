//! The credentials graft's servers read: the key a client sent, and a comparison of keys
//! that takes the same time wherever they differ.

use hyper::HeaderMap;
use hyper::header;
use subtle::ConstantTimeEq;

/// The key a request carries: `Authorization: Bearer <key>` (OpenAI clients; a bare value is
/// taken as the key), else `x-api-key` (Anthropic clients). Surrounding space is trimmed.
pub fn bearer(headers: &HeaderMap) -> Option<&str> {
    if let Some(v) = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
    {
        let v = v.trim();
        return Some(
            v.strip_prefix("Bearer ")
                .or_else(|| v.strip_prefix("bearer "))
                .unwrap_or(v)
                .trim(),
        );
    }
    headers
        .get("x-api-key")
        .and_then(|v| v.to_str().ok())
        .map(str::trim)
}

/// Whether `sent` is `key`, compared in constant time (no early exit on the first differing
/// byte; only the lengths' equality shows).
pub fn same_key(sent: &str, key: &str) -> bool {
    sent.as_bytes().ct_eq(key.as_bytes()).into()
}

#[cfg(test)]
mod tests {
    use super::*;
    use hyper::header::HeaderValue;

    #[test]
    fn bearer_reads_authorization_then_x_api_key() {
        let mut h = HeaderMap::new();
        assert_eq!(bearer(&h), None);
        h.insert("x-api-key", HeaderValue::from_static(" ak "));
        assert_eq!(bearer(&h), Some("ak"));
        h.insert(
            header::AUTHORIZATION,
            HeaderValue::from_static("Bearer  k1 "),
        );
        assert_eq!(bearer(&h), Some("k1"));
        h.insert(header::AUTHORIZATION, HeaderValue::from_static("k2"));
        assert_eq!(bearer(&h), Some("k2"));
    }

    #[test]
    fn same_key_is_equality() {
        assert!(same_key("secret", "secret"));
        assert!(!same_key("secreT", "secret"));
        assert!(!same_key("secret1", "secret"));
        assert!(!same_key("", "secret"));
    }
}

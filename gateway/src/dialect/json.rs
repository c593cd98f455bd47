//! The JSON field readers of the dialects' request parsers, once: a field absent or `null` is
//! "not given"; a field of the wrong type is a 400 naming it, in the dialect's own wording
//! ([`Wording`]).

use serde_json::{Map, Value};

use crate::dialect::kind;
use crate::error::GatewayError;

/// How a dialect words a fault in a field.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Wording {
    /// `tools must be an array, got string`; `input is required and must be …` (Responses).
    Plain,
    /// `'prompt' must be …, got …` (Completions, as vLLM words it).
    Quoted,
    /// `max_tokens must be …, got …`; `model is required` (Anthropic).
    Anthropic,
}

/// The readers, in one dialect's wording.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Fields(pub(crate) Wording);

/// A present, non-null field of `obj` (absent and `null` both read as "not given").
pub(crate) fn given<'a>(obj: &'a Map<String, Value>, key: &str) -> Option<&'a Value> {
    obj.get(key).filter(|v| !v.is_null())
}

impl Fields {
    /// `path` is not what it must be.
    pub(crate) fn wrong(self, path: &str, expected: &str, got: &Value) -> GatewayError {
        let got = kind(got);
        let message = match self.0 {
            Wording::Quoted => format!("'{path}' must be {expected}, got {got}"),
            Wording::Plain | Wording::Anthropic => format!("{path} must be {expected}, got {got}"),
        };
        GatewayError::field(path, message)
    }

    /// `path` is required.
    pub(crate) fn missing(self, path: &str, expected: &str) -> GatewayError {
        let message = match self.0 {
            Wording::Quoted => format!("'{path}' is required and must be {expected}"),
            Wording::Plain => format!("{path} is required and must be {expected}"),
            Wording::Anthropic => format!("{path} is required"),
        };
        GatewayError::field(path, message)
    }

    /// A fault in `path` said in words of its own: `{path} {message}`.
    pub(crate) fn bad(self, path: &str, message: impl AsRef<str>) -> GatewayError {
        GatewayError::field(path, format!("{path} {}", message.as_ref()))
    }

    pub(crate) fn opt_str<'a>(
        self,
        obj: &'a Map<String, Value>,
        key: &str,
        path: &str,
    ) -> Result<Option<&'a str>, GatewayError> {
        match given(obj, key) {
            None => Ok(None),
            Some(Value::String(s)) => Ok(Some(s)),
            Some(v) => Err(self.wrong(path, "a string", v)),
        }
    }

    pub(crate) fn req_str<'a>(
        self,
        obj: &'a Map<String, Value>,
        key: &str,
        path: &str,
    ) -> Result<&'a str, GatewayError> {
        self.opt_str(obj, key, path)?
            .ok_or_else(|| self.missing(path, "a string"))
    }

    pub(crate) fn opt_bool(
        self,
        obj: &Map<String, Value>,
        key: &str,
        path: &str,
    ) -> Result<Option<bool>, GatewayError> {
        match given(obj, key) {
            None => Ok(None),
            Some(Value::Bool(b)) => Ok(Some(*b)),
            Some(v) => Err(self.wrong(path, "a boolean", v)),
        }
    }

    pub(crate) fn opt_f64(
        self,
        obj: &Map<String, Value>,
        key: &str,
        path: &str,
    ) -> Result<Option<f64>, GatewayError> {
        match given(obj, key) {
            None => Ok(None),
            Some(Value::Number(n)) => n
                .as_f64()
                .map(Some)
                .ok_or_else(|| self.bad(path, "must be a finite number")),
            Some(v) => Err(self.wrong(path, "a number", v)),
        }
    }

    /// A non-negative integer; a number that is not one is shown as written.
    pub(crate) fn opt_u64(
        self,
        obj: &Map<String, Value>,
        key: &str,
        path: &str,
    ) -> Result<Option<u64>, GatewayError> {
        match given(obj, key) {
            None => Ok(None),
            Some(v @ Value::Number(n)) => n
                .as_u64()
                .map(Some)
                .ok_or_else(|| self.bad(path, format!("must be a non-negative integer, got {v}"))),
            Some(v) => Err(self.wrong(path, "a non-negative integer", v)),
        }
    }

    pub(crate) fn as_obj<'a>(
        self,
        v: &'a Value,
        path: &str,
    ) -> Result<&'a Map<String, Value>, GatewayError> {
        v.as_object()
            .ok_or_else(|| self.wrong(path, "an object", v))
    }
}

/// `obj[key]` as a non-negative integer: absent or null is `None`; anything else (a
/// negative or fractional number, a string) is a 400 naming the field. Shared by the
/// OpenAI dialects (Chat, Completions, Responses), in the quoted wording.
pub(crate) fn non_negative_int(
    obj: &Map<String, Value>,
    key: &str,
) -> Result<Option<u64>, GatewayError> {
    match obj.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(v) => v.as_u64().map(Some).ok_or_else(|| {
            // A scalar as written; a list or an object by its kind (it may be large).
            let got = match v {
                Value::Array(_) | Value::Object(_) => kind(v).to_string(),
                scalar => scalar.to_string(),
            };
            GatewayError::field(
                key,
                format!("'{key}' must be a non-negative integer, got {got}"),
            )
        }),
    }
}

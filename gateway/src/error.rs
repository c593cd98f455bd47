//! Gateway errors: each knows its HTTP status, who caused it, and whether a retry can help.
//! One layer ([`GatewayError::to_response`]) turns them into the dialect's error body.

use bytes::Bytes;
use http::{HeaderValue, Response, StatusCode, header};
use serde_json::json;

/// Who caused an error: the client's request, the upstream model server, or graft itself.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Cause {
    Client,
    Upstream,
    Graft,
}

impl Cause {
    pub fn as_str(self) -> &'static str {
        match self {
            Cause::Client => "client",
            Cause::Upstream => "upstream",
            Cause::Graft => "graft",
        }
    }

    /// The outcome string stored in a `CallRecord`.
    pub fn outcome(self) -> &'static str {
        use graft_recorder::CallOutcome;
        match self {
            Cause::Client => CallOutcome::ClientError,
            Cause::Upstream => CallOutcome::UpstreamError,
            Cause::Graft => CallOutcome::GraftError,
        }
        .as_str()
    }
}

#[derive(Debug, thiserror::Error)]
pub enum GatewayError {
    #[error(
        "request body is not valid UTF-8 (first bad byte at offset {offset}); send JSON encoded as UTF-8"
    )]
    InvalidUtf8 { offset: usize },
    #[error("request body is not valid JSON: {0}")]
    InvalidJson(String),
    #[error("invalid request: {message}")]
    InvalidField { param: String, message: String },
    /// Exact mode: the rendered prompt leaves the model no room for one token (worded as
    /// OpenAI's API words `context_length_exceeded`). `param`: `messages`, or `prompt` for
    /// a Completions call.
    #[error(
        "This model's maximum context length is {context} tokens. However, your {param} resulted in {prompt} tokens, which leaves no room for the completion. Please reduce the length of the {param}."
    )]
    ContextLength {
        context: u64,
        prompt: u64,
        param: &'static str,
    },
    #[error(
        "request body is larger than the limit of {limit} bytes; raise limits.max_body_bytes or send less"
    )]
    BodyTooLarge { limit: usize },
    #[error("the request body did not arrive within {secs} s; the connection was too slow")]
    BodyTimeout { secs: u64 },
    #[error("could not read the request body: {0}")]
    BodyRead(String),
    #[error(
        "no route for {method} {path}; graft serves POST /v1/chat/completions, /v1/completions, /v1/responses, /v1/messages and GET /v1/models (optionally under /s/{{session}}/)"
    )]
    NotFound { method: String, path: String },
    #[error("method {method} is not allowed on {path}")]
    MethodNotAllowed { method: String, path: String },
    #[error("{0}")]
    Unauthorized(String),
    #[error("{0}")]
    Forbidden(String),
    #[error("session '{0}' does not exist; create one with POST /graft/sessions")]
    UnknownSession(String),
    #[error("session '{0}' is closed; open a new one with POST /graft/sessions")]
    SessionClosed(String),
    #[error("session '{0}' already exists; choose another session_id or omit it")]
    SessionExists(String),
    #[error("rate limit exceeded ({scope}); retry after {retry_after_secs} s")]
    RateLimited {
        scope: String,
        retry_after_secs: u64,
    },
    #[error("upstream {upstream} is unreachable: {detail}")]
    UpstreamUnreachable { upstream: String, detail: String },
    #[error("upstream {upstream} did not answer within {secs} s")]
    UpstreamTimeout { upstream: String, secs: u64 },
    #[error("upstream {upstream} answered HTTP {status}: {detail}")]
    UpstreamStatus {
        upstream: String,
        status: u16,
        detail: String,
    },
    #[error("upstream {upstream} refused the request (HTTP {status}): {detail}")]
    UpstreamRefused {
        upstream: String,
        status: u16,
        detail: String,
    },
    #[error("upstream {upstream} returned an invalid response: {detail}")]
    UpstreamInvalid { upstream: String, detail: String },
    #[error("upstream {upstream} failed mid-response: {detail}")]
    UpstreamStream { upstream: String, detail: String },
    #[error(
        "graft could not record the call durably ({0}); the response was withheld so the client retries"
    )]
    Record(String),
    #[error("graft internal error: {0}")]
    Internal(String),
}

impl GatewayError {
    pub fn field(param: impl Into<String>, message: impl Into<String>) -> Self {
        GatewayError::InvalidField {
            param: param.into(),
            message: message.into(),
        }
    }

    pub fn status(&self) -> StatusCode {
        use GatewayError::*;
        match self {
            InvalidUtf8 { .. }
            | InvalidJson(_)
            | InvalidField { .. }
            | ContextLength { .. }
            | BodyRead(_) => StatusCode::BAD_REQUEST,
            BodyTooLarge { .. } => StatusCode::PAYLOAD_TOO_LARGE,
            BodyTimeout { .. } => StatusCode::REQUEST_TIMEOUT,
            NotFound { .. } | UnknownSession(_) => StatusCode::NOT_FOUND,
            MethodNotAllowed { .. } => StatusCode::METHOD_NOT_ALLOWED,
            Unauthorized(_) => StatusCode::UNAUTHORIZED,
            Forbidden(_) => StatusCode::FORBIDDEN,
            SessionClosed(_) | SessionExists(_) => StatusCode::CONFLICT,
            RateLimited { .. } => StatusCode::TOO_MANY_REQUESTS,
            UpstreamUnreachable { .. }
            | UpstreamStatus { .. }
            | UpstreamInvalid { .. }
            | UpstreamStream { .. } => StatusCode::BAD_GATEWAY,
            UpstreamTimeout { .. } => StatusCode::GATEWAY_TIMEOUT,
            UpstreamRefused { status, .. } => {
                StatusCode::from_u16(*status).unwrap_or(StatusCode::BAD_REQUEST)
            }
            Record(_) => StatusCode::SERVICE_UNAVAILABLE,
            Internal(_) => StatusCode::INTERNAL_SERVER_ERROR,
        }
    }

    pub fn cause(&self) -> Cause {
        use GatewayError::*;
        match self {
            UpstreamUnreachable { .. }
            | UpstreamTimeout { .. }
            | UpstreamStatus { .. }
            | UpstreamRefused { .. }
            | UpstreamInvalid { .. }
            | UpstreamStream { .. } => Cause::Upstream,
            Record(_) | Internal(_) => Cause::Graft,
            _ => Cause::Client,
        }
    }

    /// Whether the same request may succeed if retried unchanged.
    pub fn retryable(&self) -> bool {
        use GatewayError::*;
        matches!(
            self,
            RateLimited { .. }
                | UpstreamUnreachable { .. }
                | UpstreamTimeout { .. }
                | UpstreamStream { .. }
                | Record(_)
                | BodyTimeout { .. }
        ) || matches!(self, UpstreamStatus { status, .. } if *status >= 500)
    }

    /// OpenAI's `error.type`.
    pub fn error_type(&self) -> &'static str {
        use GatewayError::*;
        match self {
            Unauthorized(_) => "authentication_error",
            Forbidden(_) => "permission_error",
            RateLimited { .. } => "rate_limit_error",
            UpstreamRefused { .. } => "invalid_request_error",
            UnknownSession(_) | NotFound { .. } => "not_found_error",
            _ => match self.cause() {
                Cause::Client => "invalid_request_error",
                Cause::Upstream => "upstream_error",
                Cause::Graft => "server_error",
            },
        }
    }

    /// OpenAI's `error.code`: a stable machine-readable name.
    pub fn code(&self) -> &'static str {
        use GatewayError::*;
        match self {
            InvalidUtf8 { .. } => "invalid_utf8",
            InvalidJson(_) => "invalid_json",
            InvalidField { .. } => "invalid_value",
            ContextLength { .. } => "context_length_exceeded",
            BodyTooLarge { .. } => "body_too_large",
            BodyTimeout { .. } => "body_timeout",
            BodyRead(_) => "body_read_error",
            NotFound { .. } => "unknown_route",
            MethodNotAllowed { .. } => "method_not_allowed",
            Unauthorized(_) => "invalid_api_key",
            Forbidden(_) => "forbidden",
            UnknownSession(_) => "unknown_session",
            SessionClosed(_) => "session_closed",
            SessionExists(_) => "session_exists",
            RateLimited { .. } => "rate_limit_exceeded",
            UpstreamUnreachable { .. } => "upstream_unreachable",
            UpstreamTimeout { .. } => "upstream_timeout",
            UpstreamStatus { .. } => "upstream_http_error",
            UpstreamRefused { .. } => "upstream_refused",
            UpstreamInvalid { .. } => "upstream_invalid_response",
            UpstreamStream { .. } => "upstream_stream_interrupted",
            Record(_) => "record_failed",
            Internal(_) => "internal_error",
        }
    }

    /// The OpenAI error object (`{"error": {...}}`).
    pub fn body(&self) -> serde_json::Value {
        let param = match self {
            GatewayError::InvalidField { param, .. } => json!(param),
            GatewayError::ContextLength { param, .. } => json!(param),
            _ => serde_json::Value::Null,
        };
        json!({
            "error": {
                "message": self.to_string(),
                "type": self.error_type(),
                "code": self.code(),
                "param": param,
                "cause": self.cause().as_str(),
                "retryable": self.retryable(),
            }
        })
    }

    /// One SSE event carrying the error, as the OpenAI SDKs surface it mid-stream.
    pub fn sse_event(&self) -> Bytes {
        Bytes::from(format!("data: {}\n\n", self.body()))
    }

    pub fn to_response<B: From<Bytes>>(&self) -> Response<B> {
        let body = Bytes::from(self.body().to_string());
        let mut resp = Response::new(B::from(body));
        *resp.status_mut() = self.status();
        resp.headers_mut().insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/json"),
        );
        if let GatewayError::RateLimited {
            retry_after_secs, ..
        } = self
            && let Ok(v) = HeaderValue::from_str(&retry_after_secs.to_string())
        {
            resp.headers_mut().insert(header::RETRY_AFTER, v);
        }
        if matches!(self, GatewayError::Unauthorized(_)) {
            resp.headers_mut()
                .insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
        }
        resp
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rate_limited_carries_retry_after_and_openai_shape() {
        let e = GatewayError::RateLimited {
            scope: "session 'a'".into(),
            retry_after_secs: 2,
        };
        let r: Response<Bytes> = e.to_response();
        assert_eq!(r.status(), StatusCode::TOO_MANY_REQUESTS);
        assert_eq!(r.headers()[header::RETRY_AFTER], "2");
        let v: serde_json::Value = serde_json::from_slice(r.body()).unwrap();
        assert_eq!(v["error"]["type"], "rate_limit_error");
        assert_eq!(v["error"]["code"], "rate_limit_exceeded");
        assert!(
            v["error"]["message"]
                .as_str()
                .unwrap()
                .contains("session 'a'")
        );
    }

    #[test]
    fn upstream_5xx_is_retryable_and_4xx_is_not() {
        let e5 = GatewayError::UpstreamStatus {
            upstream: "u".into(),
            status: 503,
            detail: "x".into(),
        };
        let e4 = GatewayError::UpstreamStatus {
            upstream: "u".into(),
            status: 400,
            detail: "x".into(),
        };
        assert!(e5.retryable());
        assert!(!e4.retryable());
        assert_eq!(e5.cause(), Cause::Upstream);
    }
}

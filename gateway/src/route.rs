//! The routes graft serves model calls on, and the vocabulary they share (a leaf module:
//! it imports nothing else of the gateway but the dialect kinds).

use crate::dialect::DialectKind;

/// The OpenAI-style routes graft serves (each also under `/s/{session}/`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Route {
    ChatCompletions,
    Completions,
    Models,
    Responses,
    Messages,
}

impl Route {
    /// The route of a path (`/v1/...`, the session prefix already removed).
    pub fn from_path(path: &str) -> Option<Route> {
        Some(match path {
            "/v1/chat/completions" => Route::ChatCompletions,
            "/v1/completions" => Route::Completions,
            "/v1/models" => Route::Models,
            "/v1/responses" => Route::Responses,
            "/v1/messages" => Route::Messages,
            _ => return None,
        })
    }

    pub fn label(self) -> &'static str {
        match self {
            Route::ChatCompletions => "chat_completions",
            Route::Completions => "completions",
            Route::Models => "models",
            Route::Responses => "responses",
            Route::Messages => "anthropic_messages",
        }
    }

    /// The dialect a model-call route speaks (`/v1/models` is not a model call).
    pub fn dialect(self) -> Option<DialectKind> {
        match self {
            Route::ChatCompletions => Some(DialectKind::ChatCompletions),
            Route::Completions => Some(DialectKind::Completions),
            Route::Responses => Some(DialectKind::Responses),
            Route::Messages => Some(DialectKind::AnthropicMessages),
            Route::Models => None,
        }
    }

    /// The path under an OpenAI-compatible base URL (`…/v1`).
    pub fn upstream_path(self) -> &'static str {
        match self {
            Route::ChatCompletions => "/chat/completions",
            Route::Completions => "/completions",
            Route::Models => "/models",
            Route::Responses => "/responses",
            Route::Messages => "/messages",
        }
    }

    pub fn endpoint(self) -> &'static str {
        match self {
            Route::ChatCompletions => "/v1/chat/completions",
            Route::Completions => "/v1/completions",
            Route::Models => "/v1/models",
            Route::Responses => "/v1/responses",
            Route::Messages => "/v1/messages",
        }
    }
}

/// What a session (or group) id must be, for error messages.
pub const SESSION_ID_RULE: &str = "1-128 characters of [A-Za-z0-9._:-], and not '.' or '..' (a base URL /s/<id>/v1 with those is rewritten by HTTP clients)";

/// Session ids travel in URL paths and headers: keep them to a safe alphabet, and to
/// path segments that stay themselves (`.` and `..` are dot-segments, which HTTP clients
/// remove: `/s/../v1` reaches `/v1`, the default session).
pub fn valid_session_id(id: &str) -> bool {
    !id.is_empty()
        && id != "."
        && id != ".."
        && id.len() <= 128
        && id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.' | b':'))
}

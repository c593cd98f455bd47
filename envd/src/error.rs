//! envd's errors: each knows its HTTP status and a stable `type`; one function renders
//! them as `{"error": {"message", "type"}}`.

use http::StatusCode;

#[derive(Debug, thiserror::Error)]
pub enum EnvdError {
    #[error(
        "missing or wrong API key; send the key envd was started with (--api-key or GRAFT_ENVD_API_KEY) in the X-API-Key header"
    )]
    Unauthorized,
    #[error("no route for {method} {path}; GET /openapi.json lists every route")]
    NoRoute { method: String, path: String },
    #[error("method {method} is not allowed on {path}; allowed: {allowed}")]
    MethodNotAllowed {
        method: String,
        path: String,
        allowed: &'static str,
    },
    #[error(
        "sandbox '{0}' does not exist (never created, deleted, or reaped after its TTL); create one with POST /sandboxes"
    )]
    SandboxNotFound(String),
    #[error("sandbox '{0}' already exists; choose another id or leave `id` out")]
    SandboxExists(String),
    #[error("sandbox '{0}' is being deleted; create a new one with POST /sandboxes")]
    SandboxDeleting(String),
    #[error(
        "job '{job}' does not exist in sandbox '{sandbox}'; GET /sandboxes/{sandbox}/jobs lists them"
    )]
    JobNotFound { sandbox: String, job: String },
    #[error("snapshot '{0}' does not exist; GET /snapshots lists them")]
    SnapshotNotFound(String),
    #[error("snapshot '{0}' already exists; choose another id or leave `id` out")]
    SnapshotExists(String),
    #[error("snapshot '{id}' is the base of sandboxes {sandboxes}; delete them first")]
    SnapshotInUse { id: String, sandboxes: String },
    #[error("invalid request: {0}")]
    BadRequest(String),
    #[error("request body is not valid JSON for {what}: {err}")]
    BadJson { what: &'static str, err: String },
    #[error("request body is larger than the limit of {limit} bytes; {hint}")]
    TooLarge { limit: usize, hint: &'static str },
    #[error("path '{path}' is refused: {reason}")]
    PathRefused { path: String, reason: String },
    #[error("'{0}' does not exist in the sandbox workspace")]
    FileNotFound(String),
    #[error(
        "'{0}' is a directory; list it with GET /sandboxes/{{id}}/files?dir=PATH or name a file"
    )]
    IsDirectory(String),
    #[error("'{0}' is not a directory; download it with GET /sandboxes/{{id}}/files/PATH")]
    NotDirectory(String),
    #[error(
        "idempotency key '{key}' was already used in sandbox '{sandbox}' for a different request (job '{job}'); send a new key for a new command"
    )]
    IdempotencyConflict {
        key: String,
        sandbox: String,
        job: String,
    },
    #[error("the patch does not apply (git apply exited with {exit_code}): {output}")]
    PatchFailed { exit_code: i64, output: String },
    #[error("{what}: {source}")]
    Io {
        what: String,
        #[source]
        source: std::io::Error,
    },
    #[error("the sandbox backend failed: {0}")]
    Backend(String),
    /// A sandbox that exists but cannot serve now (its Pod is not ready, failed or gone).
    #[error("sandbox '{id}' is not available: {reason}")]
    SandboxUnavailable { id: String, reason: String },
    /// The Kubernetes API answered an error (or could not be reached: `code` None).
    #[error("the Kubernetes API {what}: {message}")]
    Kube {
        what: String,
        code: Option<u16>,
        message: String,
    },
    /// An error the in-sandbox agent answered, with envd's status and type for it.
    #[error("{message}")]
    Agent {
        status: u16,
        kind: &'static str,
        message: String,
    },
}

impl EnvdError {
    pub fn io(what: impl Into<String>, source: std::io::Error) -> Self {
        EnvdError::Io {
            what: what.into(),
            source,
        }
    }

    pub fn status(&self) -> StatusCode {
        use EnvdError::*;
        match self {
            Unauthorized => StatusCode::UNAUTHORIZED,
            NoRoute { .. }
            | SandboxNotFound(_)
            | JobNotFound { .. }
            | FileNotFound(_)
            | SnapshotNotFound(_) => StatusCode::NOT_FOUND,
            MethodNotAllowed { .. } => StatusCode::METHOD_NOT_ALLOWED,
            SandboxExists(_)
            | IdempotencyConflict { .. }
            | SnapshotExists(_)
            | SnapshotInUse { .. } => StatusCode::CONFLICT,
            SandboxDeleting(_) => StatusCode::GONE,
            BadRequest(_) | BadJson { .. } | IsDirectory(_) | NotDirectory(_) => {
                StatusCode::BAD_REQUEST
            }
            TooLarge { .. } => StatusCode::PAYLOAD_TOO_LARGE,
            PathRefused { .. } => StatusCode::FORBIDDEN,
            PatchFailed { .. } => StatusCode::UNPROCESSABLE_ENTITY,
            Io { .. } | Backend(_) => StatusCode::INTERNAL_SERVER_ERROR,
            SandboxUnavailable { .. } => StatusCode::SERVICE_UNAVAILABLE,
            Kube { code, .. } => match code {
                Some(400 | 422) => StatusCode::BAD_REQUEST,
                None | Some(429) | Some(500..) => StatusCode::SERVICE_UNAVAILABLE,
                Some(_) => StatusCode::INTERNAL_SERVER_ERROR,
            },
            Agent { status, .. } => {
                StatusCode::from_u16(*status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR)
            }
        }
    }

    /// The stable `type` of the error body.
    pub fn kind(&self) -> &'static str {
        use EnvdError::*;
        match self {
            Unauthorized => "unauthorized",
            NoRoute { .. } => "no_route",
            MethodNotAllowed { .. } => "method_not_allowed",
            SandboxNotFound(_) => "sandbox_not_found",
            SandboxExists(_) => "sandbox_exists",
            SandboxDeleting(_) => "sandbox_deleting",
            JobNotFound { .. } => "job_not_found",
            SnapshotNotFound(_) => "snapshot_not_found",
            SnapshotExists(_) => "snapshot_exists",
            SnapshotInUse { .. } => "snapshot_in_use",
            BadRequest(_) | BadJson { .. } => "invalid_request",
            TooLarge { .. } => "too_large",
            PathRefused { .. } => "path_outside_sandbox",
            FileNotFound(_) => "file_not_found",
            IsDirectory(_) => "is_a_directory",
            NotDirectory(_) => "not_a_directory",
            IdempotencyConflict { .. } => "idempotency_conflict",
            PatchFailed { .. } => "patch_failed",
            Io { .. } => "io_error",
            Backend(_) => "backend_error",
            SandboxUnavailable { .. } => "sandbox_unavailable",
            Kube { code, .. } => match code {
                Some(400 | 422) => "invalid_request",
                None | Some(429) | Some(500..) => "backend_unavailable",
                Some(_) => "backend_error",
            },
            Agent { kind, .. } => kind,
        }
    }

    /// `{"error": {"message", "type"}}`
    pub fn body(&self) -> serde_json::Value {
        serde_json::json!({"error": {"message": self.to_string(), "type": self.kind()}})
    }
}

/// Why envd could not start.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    #[error("cannot listen on {addr}: {source}")]
    Bind {
        addr: std::net::SocketAddr,
        #[source]
        source: std::io::Error,
    },
    #[error("data dir {dir}: {message}")]
    DataDir { dir: String, message: String },
    #[error("{0}")]
    Config(String),
}

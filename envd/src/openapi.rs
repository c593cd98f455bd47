//! The OpenAPI 3.1 document served at `/openapi.json`. A test checks that every route the
//! server answers is in it.

use serde_json::{Value, json};

/// Every (method, path) the API serves, in the document's spelling.
pub const ROUTES: &[(&str, &str)] = &[
    ("get", "/healthz"),
    ("get", "/openapi.json"),
    ("get", "/metrics"),
    ("get", "/sandboxes"),
    ("post", "/sandboxes"),
    ("get", "/sandboxes/{id}"),
    ("delete", "/sandboxes/{id}"),
    ("get", "/sandboxes/{id}/wait"),
    ("post", "/sandboxes/{id}/heartbeat"),
    ("post", "/sandboxes/{id}/exec"),
    ("get", "/sandboxes/{id}/jobs"),
    ("get", "/sandboxes/{id}/jobs/{job}"),
    ("get", "/sandboxes/{id}/jobs/{job}/wait"),
    ("post", "/sandboxes/{id}/jobs/{job}/kill"),
    ("get", "/sandboxes/{id}/files"),
    ("get", "/sandboxes/{id}/files/{path}"),
    ("put", "/sandboxes/{id}/files/{path}"),
    ("delete", "/sandboxes/{id}/files/{path}"),
    ("post", "/sandboxes/{id}/apply_patch"),
    ("post", "/sandboxes/{id}/snapshot"),
    ("get", "/snapshots"),
    ("get", "/snapshots/{snapshot}"),
    ("delete", "/snapshots/{snapshot}"),
];

fn op(summary: &str, body: Option<Value>, ok: (&str, Value)) -> Value {
    let mut o = json!({
        "summary": summary,
        "responses": {
            ok.0: {"description": "success", "content": {"application/json": {"schema": ok.1}}},
            "default": {"description": "error", "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}}
        }
    });
    if let Some(b) = body {
        o["requestBody"] = b;
    }
    o
}

fn r(name: &str) -> Value {
    json!({"$ref": format!("#/components/schemas/{name}")})
}

fn json_body(name: &str) -> Value {
    json!({"required": true, "content": {"application/json": {"schema": r(name)}}})
}

pub fn document() -> Value {
    let id = json!({"name": "id", "in": "path", "required": true, "schema": {"type": "string"}});
    let job = json!({"name": "job", "in": "path", "required": true, "schema": {"type": "string"}});
    let path = json!({"name": "path", "in": "path", "required": true, "description": "relative to /workspace; '..', absolute paths and symlinks that lead out are refused (403)", "schema": {"type": "string"}});
    let bytes = json!({"required": true, "content": {"application/octet-stream": {"schema": {"type": "string", "format": "binary"}}}});
    json!({
        "openapi": "3.1.0",
        "info": {
            "title": "graft envd",
            "version": env!("CARGO_PKG_VERSION"),
            "description": "Sandboxes for agent harnesses: create, exec (sync, job, or SSE stream), files, apply_patch, TTL + heartbeat. Every route but /healthz and /openapi.json needs the X-API-Key header. Errors are {\"error\": {\"message\", \"type\"}}."
        },
        "components": {
            "securitySchemes": {"apiKey": {"type": "apiKey", "in": "header", "name": "X-API-Key"}},
            "schemas": {
                "Error": {"type": "object", "properties": {"error": {"type": "object", "properties": {"message": {"type": "string"}, "type": {"type": "string"}}}}},
                "CreateSandbox": {"type": "object", "additionalProperties": false, "properties": {
                    "id": {"type": "string", "pattern": "^[A-Za-z0-9_-]{1,64}$"},
                    "image": {"type": "string", "description": "local backend: absolute path to a `docker save` tarball (or its unpacked directory) on the envd host, flattened once (layers + whiteouts) and reused"},
                    "rootfs": {"type": "string", "description": "root filesystem directory on the envd host; default: the host's read-only /usr, /etc, ..."},
                    "cpus": {"type": "number"}, "memory_mb": {"type": "integer"}, "pids": {"type": "integer"},
                    "ttl_secs": {"type": "integer", "description": "idle time to live; any request on the sandbox or a heartbeat renews it"},
                    "env": {"type": "object", "additionalProperties": {"type": "string"}},
                    "network": {"type": "string", "enum": ["gateway", "none"], "description": "no route out either way; gateway adds graft's gateway on the sandbox's loopback"},
                    "labels": {"type": "object", "additionalProperties": {"type": "string"}},
                    "gateway_session": {"type": "object", "properties": {"session_id": {"type": "string"}, "api_key": {"type": "string"}, "model": {"type": "string"}, "harness": {"type": "string", "description": "a harness of harness-configs/ (codex, mini-swe-agent, aider, ...): its variables and config files are filled in"}}, "required": ["session_id"], "description": "fills OPENAI_BASE_URL, OPENAI_API_KEY, ANTHROPIC_BASE_URL, ... for the harness"},
                    "from_snapshot": {"type": "string", "description": "start from a snapshot: the workspace is a copy-on-write overlay of it"},
                    "mounts": {"type": "array", "items": {"type": "object", "required": ["source", "target"], "properties": {"source": {"type": "string"}, "target": {"type": "string"}}}, "description": "read-only bind mounts of host paths (targets outside the root's own directories, e.g. /mnt/tools)"}
                }},
                "Sandbox": {"type": "object", "properties": {
                    "id": {"type": "string"}, "state": {"type": "string", "enum": ["pending", "ready", "failed", "deleting"]}, "backend": {"type": "string", "enum": ["local", "kubernetes"]},
                    "created_at_ms": {"type": "integer"}, "expires_at_ms": {"type": "integer"}, "ttl_secs": {"type": "integer"},
                    "limits": {"type": "object", "properties": {"cpus": {"type": "number"}, "memory_mb": {"type": "integer"}, "pids": {"type": "integer"}}},
                    "limits_enforced": {"type": "boolean"}, "network": {"type": "string"}, "gateway_url": {"type": ["string", "null"]},
                    "workspace": {"type": "string"}, "env": {"type": "object"}, "labels": {"type": "object"}, "mounts": {"type": "array"},
                    "processes": {"type": ["integer", "null"]}, "jobs_running": {"type": "integer"}
                }},
                "ExecRequest": {"type": "object", "additionalProperties": false, "properties": {
                    "command": {"type": "string", "description": "run with /bin/sh -c"},
                    "argv": {"type": "array", "items": {"type": "string"}},
                    "cwd": {"type": "string", "description": "relative to /workspace, or absolute inside the sandbox"},
                    "env": {"type": "object", "additionalProperties": {"type": "string"}},
                    "timeout_secs": {"type": "number", "description": "then SIGTERM to the command's processes, SIGKILL to the whole tree after the grace period"},
                    "stdin": {"type": "string"},
                    "max_output_bytes": {"type": "integer", "description": "cap on stdout and on stderr kept, each"},
                    "background": {"type": "boolean", "description": "answer 202 with the job at once"},
                    "stream": {"type": "boolean", "description": "answer with Server-Sent Events (also: Accept: text/event-stream): job, stdout, stderr, lagged, exit"},
                    "idempotency_key": {"type": "string", "description": "also the Idempotency-Key header; a retry returns the first job and never runs the command twice; the same key with another command is 409"}
                }},
                "Job": {"type": "object", "properties": {
                    "job_id": {"type": "string"}, "sandbox_id": {"type": "string"},
                    "state": {"type": "string", "enum": ["running", "exited", "timed_out", "killed", "failed"]},
                    "exit_code": {"type": ["integer", "null"], "description": "128 + signal when a signal ended it (137: SIGKILL, e.g. the OOM killer)"},
                    "stdout": {"type": "string"}, "stderr": {"type": "string"},
                    "stdout_bytes": {"type": "integer"}, "stderr_bytes": {"type": "integer"},
                    "stdout_truncated": {"type": "boolean"}, "stderr_truncated": {"type": "boolean"}, "max_output_bytes": {"type": "integer"},
                    "timed_out": {"type": "boolean"}, "oom_killed": {"type": "boolean"}, "error": {"type": ["string", "null"]},
                    "started_at_ms": {"type": "integer"}, "finished_at_ms": {"type": ["integer", "null"]}, "duration_ms": {"type": ["integer", "null"]},
                    "idempotency_key": {"type": ["string", "null"]}
                }},
                "Snapshot": {"type": "object", "properties": {"snapshot_id": {"type": "string"}, "source_sandbox": {"type": "string"}, "created_at_ms": {"type": "integer"}, "files": {"type": "integer"}, "bytes": {"type": "integer"}}},
                "ApplyPatch": {"type": "object", "additionalProperties": false, "required": ["patch"], "properties": {
                    "patch": {"type": "string", "description": "a unified diff (git apply)"}, "cwd": {"type": "string"}, "check": {"type": "boolean"}
                }}
            }
        },
        "security": [{"apiKey": []}],
        "paths": {
            "/healthz": {"get": op("liveness (no key needed)", None, ("200", json!({"type": "object"})))},
            "/openapi.json": {"get": op("this document (no key needed)", None, ("200", json!({"type": "object"})))},
            "/metrics": {"get": {"summary": "Prometheus metrics (OpenMetrics text; no key needed): graft_envd_sandboxes, _sandboxes_created, _sandboxes_deleted{reason}, _jobs{state}, _job_seconds, _create_seconds, _oom_kills", "security": [], "responses": {"200": {"description": "metrics", "content": {"text/plain": {"schema": {"type": "string"}}}}}}},
            "/sandboxes": {
                "get": op("list sandboxes", None, ("200", json!({"type": "object", "properties": {"sandboxes": {"type": "array", "items": r("Sandbox")}}}))),
                "post": op("create a sandbox", Some(json_body("CreateSandbox")), ("201", r("Sandbox")))
            },
            "/sandboxes/{id}": {
                "parameters": [id.clone()],
                "get": op("get a sandbox", None, ("200", r("Sandbox"))),
                "delete": op("delete a sandbox (kills its jobs)", None, ("200", json!({"type": "object"})))
            },
            "/sandboxes/{id}/wait": {"parameters": [id.clone(), {"name": "timeout_secs", "in": "query", "schema": {"type": "number"}}], "get": op("wait until the sandbox is ready (a local one is ready once created; a Pod when the watch sees it Running and Ready, up to timeout_secs, else 503 sandbox_unavailable)", None, ("200", r("Sandbox")))},
            "/sandboxes/{id}/heartbeat": {"parameters": [id.clone()], "post": op("renew the TTL", None, ("200", r("Sandbox")))},
            "/sandboxes/{id}/exec": {"parameters": [id.clone()], "post": op("run a command (sync: 200 with the job; background: 202; stream: text/event-stream)", Some(json_body("ExecRequest")), ("200", r("Job")))},
            "/sandboxes/{id}/jobs": {"parameters": [id.clone()], "get": op("list jobs", None, ("200", json!({"type": "object", "properties": {"jobs": {"type": "array", "items": r("Job")}}})))},
            "/sandboxes/{id}/jobs/{job}": {"parameters": [id.clone(), job.clone()], "get": op("a job's state", None, ("200", r("Job")))},
            "/sandboxes/{id}/jobs/{job}/wait": {"parameters": [id.clone(), job.clone(), {"name": "timeout_secs", "in": "query", "schema": {"type": "number"}}], "get": op("wait for a job to end (or timeout_secs; then state is still running)", None, ("200", r("Job")))},
            "/sandboxes/{id}/jobs/{job}/kill": {"parameters": [id.clone(), job], "post": op("kill a job's whole process tree", None, ("200", r("Job")))},
            "/sandboxes/{id}/files": {"parameters": [id.clone(), {"name": "dir", "in": "query", "schema": {"type": "string"}}], "get": op("list a directory of the workspace", None, ("200", json!({"type": "object"})))},
            "/sandboxes/{id}/files/{path}": {
                "parameters": [id.clone(), path],
                "get": {"summary": "download a file (raw bytes)", "responses": {"200": {"description": "the bytes", "content": {"application/octet-stream": {"schema": {"type": "string", "format": "binary"}}}}, "default": {"description": "error"}}},
                "put": op("upload a file (raw bytes; ?mode=755; parents are created; size-capped)", Some(bytes), ("200", json!({"type": "object"}))),
                "delete": op("remove a file (?recursive=true for a directory)", None, ("200", json!({"type": "object"})))
            },
            "/sandboxes/{id}/snapshot": {"parameters": [id.clone()], "post": op("copy the workspace into a snapshot (body: {\"id\"?}); create sandboxes from it with from_snapshot (copy-on-write)", Some(json!({"content": {"application/json": {"schema": {"type": "object", "properties": {"id": {"type": "string"}}}}}})), ("201", r("Snapshot")))},
            "/snapshots": {"get": op("list snapshots", None, ("200", json!({"type": "object", "properties": {"snapshots": {"type": "array", "items": r("Snapshot")}}})))},
            "/snapshots/{snapshot}": {
                "parameters": [{"name": "snapshot", "in": "path", "required": true, "schema": {"type": "string"}}],
                "get": op("a snapshot", None, ("200", r("Snapshot"))),
                "delete": op("delete a snapshot (409 while sandboxes are forked from it)", None, ("200", json!({"type": "object"})))
            },
            "/sandboxes/{id}/apply_patch": {"parameters": [id], "post": op("git apply a unified diff in the workspace (JSON body, or the raw patch as text); 422 when it does not apply", Some(json_body("ApplyPatch")), ("200", json!({"type": "object"})))}
        }
    })
}

#[cfg(test)]
mod tests {
    #[test]
    fn every_route_is_documented() {
        let d = super::document();
        for (m, p) in super::ROUTES {
            assert!(
                d["paths"][p][m].is_object(),
                "{m} {p} is not in the document"
            );
        }
    }
}

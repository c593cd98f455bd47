//! The accept loop, the routing of a request to its wire (the OpenAI routes answered here,
//! the SGLang and vLLM sides in their files), and OpenAI's error answers.

use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use http::{Method, Request, Response, StatusCode, header};
use http_body_util::{BodyExt, Limited};
use hyper::body::Incoming;
use serde_json::{Value, json};

use crate::answer::{Abort, RespBody, SseBody, json_response, sse_response};
use crate::faults::{Fault, garbage};
use crate::openai::{
    Dialect, Meta, chat_events, chat_json, completion_events, completion_json, usage_for,
};
use crate::script::Prompt;
use crate::state::State;
use crate::{MAX_REQUEST_BYTES, sglang, vllm};

pub(crate) async fn serve(
    listener: tokio::net::TcpListener,
    state: Arc<State>,
) -> anyhow::Result<()> {
    // Connection errors are client disconnects and the deliberate `fault-reset` aborts.
    let handler = move |req| handle(Arc::clone(&state), req);
    let shutdown = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    graft_http::serve(
        listener,
        graft_http::Options::new("scripted-upstream"),
        handler,
        shutdown,
    )
    .await;
    Ok(())
}

/// The path of the test log of what the OpenAI routes were sent.
pub(crate) const OPENAI_REQUESTS: &str = "/testkit/openai/requests";

pub(crate) async fn handle(
    state: Arc<State>,
    req: Request<Incoming>,
) -> Result<Response<RespBody>, Abort> {
    let path = req.uri().path().to_owned();
    // vLLM's development routes: its `--api-key` does not guard them.
    if vllm::is_dev_route(&path) {
        let method = req.method().clone();
        let query = req.uri().query().map(str::to_owned);
        let body = match read_json(req.into_body(), true).await {
            Ok(v) => v,
            Err(resp) => return Ok(resp),
        };
        return Ok(vllm::dev_route(
            &state,
            &method,
            &path,
            query.as_deref(),
            &body,
        ));
    }
    if sglang::is_route(&path) {
        let bearer = req
            .headers()
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "));
        if let Some(refused) = sglang_auth(&state, &path, bearer) {
            return Ok(refused);
        }
    } else if let Some(key) = &state.expect_key {
        let ok = req
            .headers()
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "))
            .is_some_and(|got| got == key);
        if !ok {
            return Ok(error(
                StatusCode::UNAUTHORIZED,
                "Incorrect API key provided. The scripted upstream was started with --expect-key; send it as 'Authorization: Bearer KEY'.",
                "invalid_request_error",
                Some("invalid_api_key"),
            ));
        }
    }
    if state.legacy_info_routes && ["/model_info", "/server_info"].contains(&path.as_str()) {
        // FastAPI's answer for a route it does not have.
        return Ok(json_response(
            StatusCode::NOT_FOUND,
            &serde_json::json!({"detail": "Not Found"}),
        ));
    }
    if sglang::is_route(&path) {
        let method = req.method().clone();
        let routing_key = req
            .headers()
            .get("x-smg-routing-key")
            .and_then(|v| v.to_str().ok())
            .map(str::to_string);
        // SGLang's control routes take an empty body as no parameters.
        let body = match read_json(req.into_body(), true).await {
            Ok(v) => v,
            Err(resp) => return Ok(resp),
        };
        if let Some(resp) = sglang::route(&state, &method, &path, &body, routing_key).await? {
            return Ok(resp);
        }
        return Ok(error(
            StatusCode::METHOD_NOT_ALLOWED,
            &format!("method {method} is not allowed on {path}"),
            "invalid_request_error",
            None,
        ));
    }
    let dialect = match (req.method(), path.as_str()) {
        (&Method::GET, "/v1/models") => return Ok(models(&state)),
        (&Method::GET, vllm::REQUESTS) => return Ok(vllm::requests(&state)),
        (&Method::GET, OPENAI_REQUESTS) => {
            let bodies = state
                .openai_bodies
                .lock()
                .map(|v| v.clone())
                .unwrap_or_default();
            return Ok(json_response(
                StatusCode::OK,
                &serde_json::json!({"requests": bodies}),
            ));
        }
        // vLLM's `GET /version`: the release whose wire `src/vllm.rs` plays.
        (&Method::GET, "/version") => {
            return Ok(json_response(
                StatusCode::OK,
                &serde_json::json!({"version": state.vllm_version}),
            ));
        }
        (&Method::POST, "/v1/chat/completions") => Dialect::Chat,
        (&Method::POST, "/v1/completions") => Dialect::Completions,
        (_, "/v1/models" | "/v1/chat/completions" | "/v1/completions") => {
            return Ok(error(
                StatusCode::METHOD_NOT_ALLOWED,
                &format!("method {} is not allowed on {path}", req.method()),
                "invalid_request_error",
                None,
            ));
        }
        _ => {
            return Ok(error(
                StatusCode::NOT_FOUND,
                &format!(
                    "Unknown request URL: {} {path}. The scripted upstream serves POST /v1/chat/completions, POST /v1/completions and GET /v1/models.",
                    req.method()
                ),
                "invalid_request_error",
                Some("unknown_url"),
            ));
        }
    };
    let body = match read_json(req.into_body(), false).await {
        Ok(v) => v,
        Err(resp) => return Ok(resp),
    };
    if let Ok(mut log) = state.openai_bodies.lock() {
        log.push(serde_json::json!({"path": path, "body": body}));
    }
    // A token-id prompt is vLLM's token-in/token-out use of the route.
    if dialect == Dialect::Completions && vllm::is_token_prompt(&body) {
        return vllm::completions(&state, &body).await;
    }
    let parsed = match dialect {
        Dialect::Chat => Prompt::from_chat(&body),
        Dialect::Completions => Prompt::from_completions(&body),
    };
    let prompt = match parsed {
        Ok(p) => p,
        Err(msg) => return Ok(bad_request(&msg)),
    };
    let fault = Fault::from_model(&prompt.model);
    let mut delay = state.chunk_delay;
    match fault {
        Some(Fault::Status500) => {
            return Ok(error(
                StatusCode::INTERNAL_SERVER_ERROR,
                "The server had an error while processing your request (scripted fault-500).",
                "server_error",
                None,
            ));
        }
        Some(Fault::Hang) => {
            tokio::time::sleep(Duration::from_secs(3600)).await;
        }
        Some(Fault::Garbage) => return Ok(garbage(prompt.stream)),
        Some(Fault::Reset) if !prompt.stream => return Err(Abort),
        Some(Fault::Slow) => {
            delay = Duration::from_millis(200);
            if !prompt.stream {
                tokio::time::sleep(delay).await;
            }
        }
        Some(Fault::Reset) | None => {}
    }

    if let Some(status) = state
        .script
        .rule_for(&prompt)
        .and_then(|r| r.first_failure())
    {
        return Ok(error(
            status,
            "The server had an error while processing your request (scripted first_status).",
            "server_error",
            None,
        ));
    }
    if let Some(d) = state.script.rule_for(&prompt).and_then(|r| r.first_delay()) {
        tokio::time::sleep(d).await;
    }
    let reply = state.script.reply_or_echo(&prompt);
    let reply = reply.as_ref();
    let meta = Meta {
        id: state.next_id(),
        created: SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_secs())
            .unwrap_or(0),
        model: prompt.model.clone(),
    };
    let tokens = match &state.model {
        Some(m) => match m.answer(dialect, &body, &meta, reply) {
            Ok(t) => Some(t),
            Err(msg) => return Ok(bad_request(&msg)),
        },
        None => None,
    };
    let usage = match &tokens {
        Some(t) => t.usage(),
        None => usage_for(&prompt, reply),
    };
    let tokens = tokens.as_ref();
    if !prompt.stream {
        let v = match dialect {
            Dialect::Chat => chat_json(&meta, reply, &usage, tokens),
            Dialect::Completions => completion_json(&meta, reply, &usage, tokens),
        };
        return Ok(json_response(StatusCode::OK, &v));
    }
    let usage = prompt.include_usage.then_some(&usage);
    let events = match dialect {
        Dialect::Chat => chat_events(&meta, reply, usage, tokens),
        Dialect::Completions => completion_events(&meta, reply, usage, tokens),
    };
    let abort_after = (fault == Some(Fault::Reset)).then_some(2);
    Ok(sse_response(SseBody::new(events, delay, abort_after)))
}

/// An error in OpenAI's shape: `{"error":{"message","type","param","code"}}`.
/// The request body (at most `MAX_REQUEST_BYTES`) as JSON, or the OpenAI-shaped error to
/// answer with; with `empty_is_null` a body of only whitespace reads as `null`.
async fn read_json(body: Incoming, empty_is_null: bool) -> Result<Value, Response<RespBody>> {
    let bytes = match Limited::new(body, MAX_REQUEST_BYTES).collect().await {
        Ok(c) => c.to_bytes(),
        Err(e) => {
            return Err(error(
                StatusCode::PAYLOAD_TOO_LARGE,
                &format!("cannot read the request body: {e}"),
                "invalid_request_error",
                None,
            ));
        }
    };
    if empty_is_null && bytes.iter().all(u8::is_ascii_whitespace) {
        return Ok(Value::Null);
    }
    serde_json::from_slice(&bytes)
        .map_err(|e| bad_request(&format!("the request body is not valid JSON: {e}")))
}

/// OpenAI's 400 for a request the scripted upstream cannot take.
fn bad_request(message: &str) -> Response<RespBody> {
    error(
        StatusCode::BAD_REQUEST,
        message,
        "invalid_request_error",
        None,
    )
}

pub(crate) fn error(
    status: StatusCode,
    message: &str,
    kind: &str,
    code: Option<&str>,
) -> Response<RespBody> {
    json_response(
        status,
        &json!({"error": {"message": message, "type": kind, "param": null, "code": code}}),
    )
}

pub(crate) fn models(state: &State) -> Response<RespBody> {
    let data: Vec<Value> = state
        .models
        .iter()
        .map(String::as_str)
        .chain(Fault::MODELS)
        .map(|id| json!({"id": id, "object": "model", "created": 1_700_000_000u64, "owned_by": "graft-scripted"}))
        .collect();
    json_response(StatusCode::OK, &json!({"object": "list", "data": data}))
}

/// SGLang's own decision on a native route (`decide_request_auth` in
/// `sglang/srt/utils/auth.py`, `--expect-key` as its `--api-key`, `--admin-key` as its
/// `--admin-api-key`): health routes are open; admin routes want the admin key when there
/// is one, else the API key; the others want the API key when there is one. A refusal is
/// SGLang's `{"error": "Unauthorized"}` with 401.
fn sglang_auth(state: &State, path: &str, bearer: Option<&str>) -> Option<Response<RespBody>> {
    const ADMIN: [&str; 8] = [
        "/pause_generation",
        "/continue_generation",
        "/flush_cache",
        "/update_weights_from_disk",
        "/update_weights_from_tensor",
        "/begin_weight_update",
        "/end_weight_update",
        "/abort_request",
    ];
    if path.starts_with("/health") || path == sglang::REQUESTS {
        return None;
    }
    let (api, admin) = (state.expect_key.as_deref(), state.admin_key.as_deref());
    let want = if ADMIN.contains(&path) {
        admin.or(api)
    } else {
        api
    };
    match want {
        Some(k) if bearer != Some(k) => Some(json_response(
            StatusCode::UNAUTHORIZED,
            &serde_json::json!({"error": "Unauthorized"}),
        )),
        _ => None,
    }
}

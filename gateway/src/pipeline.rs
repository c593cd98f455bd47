//! The call pipeline: every model call, in every mode, takes this one path.
//!
//! ```text
//! route ─► session ─► limits ─► read + validate ─► Dialect::parse ─► Backend::plan (leg)
//!       ─► in-flight guard ─► send ─► events ─► relay (same dialect) or emit (the client
//!       dialect's emitter) ─► tee ─► commit the record ─► release the last event
//! ```
//!
//! A mode is a choice of parts (`backend/`: passthrough, translation, exact mode), not a copy
//! of this path (TensorZero's one `endpoints/inference.rs` over `InferenceProvider`s;
//! pingora's `ProxyHttp` phases ending in `logging`).

use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::{HeaderMap, HeaderValue, Response, StatusCode, header};
use http_body_util::BodyExt;
use hyper::body::Incoming;
use serde_json::Value;
use tokio::sync::mpsc;
use tracing::{Instrument, debug, info_span, warn};

use crate::backend::{Answering, Finished, InFlight, Leg, Piece, Plan, UpBody, Whole};
use crate::body::{GBody, full};
use crate::call::{Call, End};
use crate::dialect::{Conversation, StreamAssembler, StreamEmitter, dialect, kind};
use crate::error::GatewayError;
use crate::outcome::Outcome;
use crate::route::Route;
use crate::sessions::{Session, now_us};
use crate::state::State;
use crate::upstream::upstream_message;
use crate::upstream_events::{Next, UpstreamEvents};

/// Reads a request body within the size and time limits ([`graft_http::read_body`]), its
/// faults in the gateway's words.
pub async fn read_body(
    body: Incoming,
    limit: usize,
    timeout: Duration,
) -> Result<Bytes, GatewayError> {
    graft_http::read_body(body, limit, timeout)
        .await
        .map_err(|e| match e {
            graft_http::BodyError::TooLarge { limit } => GatewayError::BodyTooLarge { limit },
            graft_http::BodyError::TimedOut { timeout } => GatewayError::BodyTimeout {
                secs: timeout.as_secs(),
            },
            graft_http::BodyError::Read(chain) => GatewayError::BodyRead(chain),
        })
}

/// Parses and checks the request body; returns it as JSON.
pub fn parse_request(route: Route, bytes: &[u8]) -> Result<Value, GatewayError> {
    if let Err(e) = std::str::from_utf8(bytes) {
        return Err(GatewayError::InvalidUtf8 {
            offset: e.valid_up_to(),
        });
    }
    let v: Value =
        serde_json::from_slice(bytes).map_err(|e| GatewayError::InvalidJson(e.to_string()))?;
    let Some(obj) = v.as_object() else {
        return Err(GatewayError::field(
            "",
            format!("the request body must be a JSON object, got {}", kind(&v)),
        ));
    };
    match obj.get("model") {
        Some(Value::String(_)) => {}
        Some(other) => {
            return Err(GatewayError::field(
                "model",
                format!("'model' must be a string, got {}", kind(other)),
            ));
        }
        None => return Err(GatewayError::field("model", "'model' is required")),
    }
    if let Some(s) = obj.get("stream")
        && !s.is_boolean()
        && !s.is_null()
    {
        return Err(GatewayError::field(
            "stream",
            format!("'stream' must be a boolean, got {}", kind(s)),
        ));
    }
    if let Some(s) = obj.get("stream_options")
        && !s.is_object()
        && !s.is_null()
    {
        return Err(GatewayError::field(
            "stream_options",
            format!("'stream_options' must be an object, got {}", kind(s)),
        ));
    }
    if let Some(kind) = route.dialect() {
        dialect(kind).check(obj)?;
    }
    Ok(v)
}

/// Handles one call on a `/v1/...` route whose session is already resolved.
pub async fn handle(
    state: Arc<State>,
    route: Route,
    session: Arc<Session>,
    headers: HeaderMap,
    body: Incoming,
    t0: Instant,
) -> Result<Response<GBody>, GatewayError> {
    let Some(kind) = route.dialect() else {
        return models(&state, &headers).await;
    };
    let limits = &state.cfg.limits;
    let bytes = read_body(body, limits.max_body_bytes, limits.body_timeout).await?;
    let request = parse_request(route, &bytes)?;
    let dialect = dialect(kind);
    let call_id = uuid::Uuid::now_v7().to_string();
    let signals = crate::retries::Signals::of(&headers, &bytes);
    let Plan {
        mut leg,
        conv,
        record: plan,
    } = {
        let own = session.sampling();
        let policy = own.as_deref().or(state.cfg.sampling.as_ref());
        state
            .backend
            .plan(
                route,
                dialect,
                &request,
                bytes,
                crate::backend::CallCtx {
                    session: &session.id,
                    call_id: &call_id,
                    policy,
                },
            )
            .await?
    };
    let response_id = crate::dialect::new_id(dialect.id_prefix());
    let mut prompt = None;
    if let Leg::Generate(g) = &mut leg {
        state.metrics.observe_exact_prompt(g.reused, g.render_time);
        g.response_id = response_id.clone();
        prompt = Some(g.prompt_hash());
    }
    // A branch session's call is answered from its parent's record while it matches
    // (`branch.rs`); the record says which.
    let (replay, mut replayed) = match &session.branch {
        Some(b) => {
            crate::branch::answer(b, &mut leg, &request, dialect, conv.as_ref(), plan.stream)
        }
        None => (None, None),
    };
    let link = state.retries.begin(&session.id, &call_id, signals, prompt);
    let mut call = Call {
        call_id,
        client: headers
            .get(header::USER_AGENT)
            .and_then(|v| v.to_str().ok())
            .map(str::to_string),
        headers: recorded_headers(&state.cfg.recorder.record_headers, &headers),
        started_at_us: now_us(),
        state: state.clone(),
        session,
        route,
        dialect,
        request,
        t0,
        plan,
        response_id,
        link,
        replay,
    };
    // Exact mode refuses a prompt that does not fit the model's context before anything is
    // sent; the refusal is recorded like any other.
    if let Leg::Generate(g) = &mut leg
        && let Some((e, tokens)) = g.refused()
    {
        let o = Outcome {
            tokens,
            ..Default::default()
        };
        return Err(call.fail(o, e).await);
    }
    let span = info_span!("call", call_id = %call.call_id, session = %call.session.id, route = route.label(), stream = call.plan.stream, mode = state.cfg.backend.mode().label());
    // The call runs in a task of its own: when the client goes away before its answer has
    // begun (an SDK's timeout), hyper drops this future and `gone`'s sender with it; the task
    // then still records the call, as abandoned, and stops the backend's generation.
    let (_client, mut gone) = tokio::sync::oneshot::channel::<()>();
    let task = tokio::spawn(
        async move {
            let guard =
                InFlight::take(&state.limits, leg.gate(), &state.metrics.upstream_inflight).await?;
            let t_up = Instant::now();
            let sent = tokio::select! {
                sent = async {
                    match replayed.take() {
                        Some(r) => Ok(r),
                        None => leg.send(&state.backend, &headers).await,
                    }
                } => sent,
                _ = &mut gone => {
                    drop(guard);
                    return Err(abandoned(&mut call, t_up).await);
                }
            };
            let resp = match sent {
                Ok(r) => r,
                Err(e) => {
                    drop(guard);
                    let o = Outcome {
                        upstream_time: t_up.elapsed(),
                        ..Default::default()
                    };
                    return Err(call.fail(o, e).await);
                }
            };
            let is_sse = resp
                .headers()
                .get(header::CONTENT_TYPE)
                .and_then(|v| v.to_str().ok())
                .is_some_and(|v| v.starts_with("text/event-stream"));
            if call.plan.stream && leg.answering().streams(resp.status(), is_sse) {
                let (tx, out) = call.sse_response();
                tokio::spawn(
                    async move {
                        relay(
                            &mut call,
                            leg.answering(),
                            conv.as_ref(),
                            resp.into_body(),
                            &tx,
                            t_up,
                        )
                        .await;
                        // The backend's slot (and its pause gate) is held until the record is written.
                        drop(guard);
                    }
                    .in_current_span(),
                );
                return Ok(out);
            }
            let result = if is_sse
                && !leg.answering().relays()
                && leg.answering().streams(resp.status(), is_sse)
            {
                // Exact mode streams from its backend even for a whole answer.
                gather(&mut call, leg.answering(), conv.as_ref(), resp, t_up, gone).await
            } else {
                whole(&mut call, leg.answering(), conv.as_ref(), resp, t_up, gone).await
            };
            drop(guard);
            result
        }
        .instrument(span),
    );
    match task.await {
        Ok(result) => result,
        Err(e) => Err(GatewayError::Internal(format!(
            "the call's task failed: {e}"
        ))),
    }
}

/// A call whose client went away before its answer was complete: recorded as abandoned
/// (with nothing of the answer), the backend told to stop generating it.
async fn abandoned(call: &mut Call, t_up: Instant) -> GatewayError {
    let mut o = Outcome {
        upstream_time: t_up.elapsed(),
        status: StatusCode::OK.as_u16(),
        ..Default::default()
    };
    // Best effort: the client is gone, nothing more can be told to it.
    let _ = call.finish(&mut o, End::ClientGone).await;
    GatewayError::Internal("the client closed the connection before the answer was complete".into())
}

/// Reads a whole upstream body within the response size limit and the upstream timeout.
async fn collect_upstream(call: &Call, resp: Response<UpBody>) -> Result<Bytes, GatewayError> {
    let upstream = call.plan.upstream.clone();
    let limit = call.state.cfg.limits.max_response_bytes;
    let timeout = call.state.backend.timeout();
    let collected = tokio::time::timeout(
        timeout,
        http_body_util::Limited::new(resp.into_body(), limit).collect(),
    )
    .await;
    match collected {
        Err(_) => Err(GatewayError::UpstreamTimeout {
            upstream,
            secs: timeout.as_secs(),
        }),
        Ok(Err(e)) => {
            if e.downcast_ref::<http_body_util::LengthLimitError>()
                .is_some()
            {
                Err(GatewayError::UpstreamInvalid {
                    upstream,
                    detail: format!(
                        "the response is larger than limits.max_response_bytes ({limit} bytes)"
                    ),
                })
            } else {
                Err(GatewayError::UpstreamStream {
                    upstream,
                    detail: crate::upstream::error_chain(e.as_ref()),
                })
            }
        }
        Ok(Ok(c)) => Ok(c.to_bytes()),
    }
}

/// A whole answer (or an upstream error answer to a streamed request): read it, let the
/// leg make it the client's, commit the record, answer.
async fn whole(
    call: &mut Call,
    leg: &mut dyn Answering,
    conv: Option<&Conversation>,
    resp: Response<UpBody>,
    t_up: Instant,
    mut gone: tokio::sync::oneshot::Receiver<()>,
) -> Result<Response<GBody>, GatewayError> {
    let status = resp.status();
    let content_type = resp.headers().get(header::CONTENT_TYPE).cloned();
    let body = tokio::select! {
        body = collect_upstream(call, resp) => body,
        _ = &mut gone => return Err(abandoned(call, t_up).await),
    };
    let mut o = Outcome {
        upstream_time: t_up.elapsed(),
        ..Outcome::ok()
    };
    let result = match body {
        Ok(bytes) => leg.whole(status, content_type, bytes, &mut o),
        Err(e) => Err(e),
    };
    match result {
        Ok(Whole::Raw {
            status,
            content_type,
            bytes,
        }) => {
            let ct = content_type.unwrap_or_else(|| HeaderValue::from_static("application/json"));
            call.answer(&mut o, status, ct, bytes).await
        }
        Ok(Whole::Answer(answer)) => answer_whole(call, o, conv, &answer).await,
        Err(e) => Err(call.fail(o, e).await),
    }
}

/// Renders an answer in the client's dialect, commits the record, answers.
async fn answer_whole(
    call: &mut Call,
    mut o: Outcome,
    conv: Option<&Conversation>,
    answer: &crate::dialect::Answer,
) -> Result<Response<GBody>, GatewayError> {
    let conv = conv.cloned().unwrap_or_default();
    let rendered = call.dialect.render(&conv, answer, &call.response_id);
    let bytes = Bytes::from(rendered.to_string());
    o.response = Some(rendered);
    call.answer(
        &mut o,
        StatusCode::OK,
        HeaderValue::from_static("application/json"),
        bytes,
    )
    .await
}

/// A whole answer assembled from the backend's events (exact mode streams from its backend
/// whatever the client asked): read as the relay reads them, with the same stall timeout
/// between events instead of one timeout on the whole answer, then answered in one piece.
async fn gather(
    call: &mut Call,
    leg: &mut dyn Answering,
    conv: Option<&Conversation>,
    resp: Response<UpBody>,
    t_up: Instant,
    mut gone: tokio::sync::oneshot::Receiver<()>,
) -> Result<Response<GBody>, GatewayError> {
    // The events are read with a channel's closing as the client's leaving; here the
    // client is watched through `gone`, so the channel stays open.
    let (tx, _open) = mpsc::channel::<Bytes>(1);
    let mut up = UpstreamEvents::of(call, resp.into_body());
    let mut o = Outcome::ok();
    let mut error = None;
    loop {
        let next = tokio::select! {
            n = up.next(&tx) => n,
            _ = &mut gone => return Err(abandoned(call, t_up).await),
        };
        let mut ev = match next {
            Next::Event(ev) => ev,
            Next::End => {
                if let Err(e) = leg.end(&mut o, false) {
                    error = Some(e);
                }
                break;
            }
            Next::Failed(e) => {
                error = Some(e);
                break;
            }
            Next::ClientGone => return Err(abandoned(call, t_up).await),
        };
        let mut parsed = match up.parsed(&ev) {
            Ok(p) => p,
            Err(e) => {
                error = Some(e);
                break;
            }
        };
        match leg.event(&mut ev, parsed.as_mut(), &mut o) {
            Ok(Piece::Deltas { progress, .. }) => {
                if progress && o.ttft.is_none() {
                    o.ttft = Some(call.t0.elapsed());
                }
            }
            Ok(Piece::Skip) => {}
            Ok(Piece::Relay { .. }) => {
                error = Some(GatewayError::Internal(
                    "a backend answered in another form than its relay reads".into(),
                ));
                break;
            }
            Err(e) => {
                error = Some(e);
                break;
            }
        }
    }
    o.upstream_time = t_up.elapsed();
    let finished = leg.finish(&mut o, error.is_none());
    match (error, finished) {
        (Some(e), _) => Err(call.fail(o, e).await),
        (None, Some(Finished { answer, .. })) => answer_whole(call, o, conv, &answer).await,
        (None, None) => Err(call
            .fail(
                o,
                GatewayError::Internal("the backend's events made no answer".into()),
            )
            .await),
    }
}

/// What the client's stream is made of: the upstream's own events (with the tee that
/// assembles them for the record), or the client dialect's emitter.
enum Out {
    Relay {
        tee: Box<dyn StreamAssembler>,
        /// The stream's last event, held back until the record is durable.
        held: Vec<Bytes>,
    },
    Emit(Box<dyn StreamEmitter>),
}

/// The one relay: upstream events → relayed or re-emitted → tee → the record committed →
/// the last event released (under sync durability the last byte waits for the fsync).
async fn relay(
    call: &mut Call,
    leg: &mut dyn Answering,
    conv: Option<&Conversation>,
    body: UpBody,
    tx: &mpsc::Sender<Bytes>,
    t_up: Instant,
) {
    let mut up = UpstreamEvents::of(call, body);
    let mut o = Outcome::ok();
    let mut client_gone = false;
    let empty = Conversation::default();
    let conv = conv.unwrap_or(&empty);
    let mut out = if leg.relays() {
        Out::Relay {
            tee: call.dialect.assembler(),
            held: vec![],
        }
    } else {
        let created = now_us() / 1_000_000;
        Out::Emit(call.dialect.emitter(conv, &call.response_id, created))
    };
    if let Out::Emit(em) = &mut out {
        client_gone = !send_all(tx, em.start()).await;
    }
    while !client_gone {
        let mut ev = match up.next(tx).await {
            Next::Event(ev) => ev,
            Next::End => {
                let relayed_terminal = matches!(&out, Out::Relay { held, .. } if !held.is_empty());
                match leg.end(&mut o, relayed_terminal) {
                    Ok(ds) => {
                        if let Out::Emit(em) = &mut out {
                            client_gone = !emit(tx, em.as_mut(), &ds).await;
                        }
                    }
                    Err(e) => o.error = Some(e),
                }
                break;
            }
            Next::Failed(e) => {
                o.error = Some(e);
                break;
            }
            Next::ClientGone => {
                client_gone = true;
                break;
            }
        };
        let mut parsed = match up.parsed(&ev) {
            Ok(p) => p,
            Err(e) => {
                o.error = Some(e);
                break;
            }
        };
        let piece = match leg.event(&mut ev, parsed.as_mut(), &mut o) {
            Ok(p) => p,
            Err(e) => {
                o.error = Some(e);
                break;
            }
        };
        match (&mut out, piece) {
            (Out::Relay { tee, held }, Piece::Relay { answer }) => {
                if answer {
                    if o.ttft.is_none() {
                        o.ttft = Some(call.t0.elapsed());
                    }
                    if let Some(v) = &parsed {
                        tee.push(v);
                    }
                }
                if tee.is_terminal(&ev, parsed.as_ref()) {
                    held.push(ev.raw);
                    continue;
                }
                // Something after the "last" event: relay in order, keep holding only the end.
                let mut pending = std::mem::take(held);
                pending.push(ev.raw);
                client_gone = !send_all(tx, pending).await;
            }
            (Out::Emit(em), Piece::Deltas { deltas, progress }) => {
                if progress && o.ttft.is_none() {
                    o.ttft = Some(call.t0.elapsed());
                }
                client_gone = !emit(tx, em.as_mut(), &deltas).await;
            }
            (_, Piece::Skip) => {}
            (Out::Relay { .. }, Piece::Deltas { .. }) | (Out::Emit(_), Piece::Relay { .. }) => {
                o.error = Some(GatewayError::Internal(
                    "a backend answered in another form than its relay reads".into(),
                ));
                break;
            }
        }
    }
    o.upstream_time = t_up.elapsed();
    let ok = o.error.is_none() && !client_gone;
    let finished = leg.finish(&mut o, ok);
    let last = match (&mut out, finished) {
        (Out::Relay { tee, held }, _) => {
            o.response = tee.finish();
            o.finish_reason = tee.finish_reason(o.response.as_ref());
            std::mem::take(held)
        }
        (Out::Emit(em), Some(Finished { answer, render })) => {
            if render {
                o.response = Some(call.dialect.render(conv, &answer, &call.response_id));
            }
            if ok { em.finish(&answer) } else { vec![] }
        }
        (Out::Emit(_), None) => vec![],
    };
    close_stream(call, &mut o, client_gone, tx, last).await;
}

/// Sends events in order; false once the client is gone.
async fn send_all(tx: &mpsc::Sender<Bytes>, events: Vec<Bytes>) -> bool {
    for b in events {
        if tx.send(b).await.is_err() {
            return false;
        }
    }
    true
}

async fn emit(
    tx: &mpsc::Sender<Bytes>,
    em: &mut dyn StreamEmitter,
    deltas: &[crate::dialect::Delta],
) -> bool {
    for d in deltas {
        if !send_all(tx, em.push(d)).await {
            return false;
        }
    }
    true
}

/// Ends a stream: writes the record (under sync durability this waits for the fsync), then
/// sends the held-back last bytes, or the error event.
async fn close_stream(
    call: &mut Call,
    o: &mut Outcome,
    client_gone: bool,
    tx: &mpsc::Sender<Bytes>,
    last: Vec<Bytes>,
) {
    if let Some(e) = &o.error {
        warn!(error = %e, "stream ended with an error");
    }
    let end = if client_gone {
        End::ClientGone
    } else {
        End::Stream
    };
    if let Err(e) = call.finish(o, end).await {
        if !client_gone {
            let _ = tx.send(call.error_event(&e)).await;
        }
        return;
    }
    if client_gone {
        debug!("client went away mid-stream; partial call recorded");
        return;
    }
    match &o.error {
        Some(e) => {
            let _ = tx.send(call.error_event(e)).await;
        }
        None => {
            send_all(tx, last).await;
        }
    }
}

/// `GET /v1/models`: relayed, not recorded (it is not an inference call).
async fn models(state: &State, headers: &HeaderMap) -> Result<Response<GBody>, GatewayError> {
    let (upstream, resp) = state.backend.models(headers).await?;
    let status = resp.status();
    let bytes = http_body_util::Limited::new(resp.into_body(), state.cfg.limits.max_response_bytes)
        .collect()
        .await
        .map_err(|e| GatewayError::UpstreamStream {
            upstream: upstream.clone(),
            detail: crate::upstream::error_chain(e.as_ref()),
        })?
        .to_bytes();
    if status.is_server_error() {
        return Err(GatewayError::UpstreamStatus {
            upstream,
            status: status.as_u16(),
            detail: upstream_message(&bytes),
        });
    }
    let mut resp = Response::new(full(bytes));
    *resp.status_mut() = status;
    resp.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    Ok(resp)
}

/// The configured headers of a request (values as text; a value that is not text is kept
/// lossily), `None` when it has none of them.
fn recorded_headers(
    names: &[http::HeaderName],
    headers: &http::HeaderMap,
) -> Option<std::collections::BTreeMap<String, String>> {
    let kept: std::collections::BTreeMap<String, String> = names
        .iter()
        .filter_map(|n| {
            let values: Vec<String> = headers
                .get_all(n)
                .iter()
                .map(|v| String::from_utf8_lossy(v.as_bytes()).into_owned())
                .collect();
            (!values.is_empty()).then(|| (n.as_str().to_owned(), values.join(", ")))
        })
        .collect();
    (!kept.is_empty()).then_some(kept)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn wrong_types_name_the_field() {
        let e =
            parse_request(Route::ChatCompletions, br#"{"model": 3, "messages": []}"#).unwrap_err();
        assert!(
            e.to_string()
                .contains("'model' must be a string, got a number"),
            "{e}"
        );
        let e = parse_request(Route::ChatCompletions, br#"{"model": "m", "messages": {}}"#)
            .unwrap_err();
        assert!(e.to_string().contains("'messages' must be an array"), "{e}");
        let e = parse_request(
            Route::ChatCompletions,
            br#"{"model": "m", "messages": [{"content": "x"}]}"#,
        )
        .unwrap_err();
        assert!(e.to_string().contains("messages[0]"), "{e}");
        let e = parse_request(Route::Completions, br#"{"model": "m", "prompt": 1}"#).unwrap_err();
        assert!(
            e.to_string()
                .contains("'prompt' must be a string or an array"),
            "{e}"
        );
        let e = parse_request(
            Route::ChatCompletions,
            br#"{"model": "m", "messages": [], "stream": "yes"}"#,
        )
        .unwrap_err();
        assert!(e.to_string().contains("'stream' must be a boolean"), "{e}");
    }

    #[test]
    fn invalid_utf8_and_json_are_named() {
        let e = parse_request(Route::ChatCompletions, b"{\"model\": \"\xff\"}").unwrap_err();
        assert!(matches!(e, GatewayError::InvalidUtf8 { offset: 11 }), "{e}");
        let e = parse_request(Route::ChatCompletions, b"{\"model\": ").unwrap_err();
        assert!(
            e.to_string().starts_with("request body is not valid JSON"),
            "{e}"
        );
        assert_eq!(e.status(), StatusCode::BAD_REQUEST);
    }

    #[test]
    fn unknown_fields_are_kept() {
        let v = parse_request(
            Route::ChatCompletions,
            br#"{"model":"m","messages":[],"x_custom":{"a":1}}"#,
        )
        .unwrap();
        assert_eq!(v["x_custom"]["a"], 1);
    }
}

//! Translation: a Responses or Anthropic Messages call served by a Chat Completions upstream.
//! The request was converted on the way in (`proxy::handle`); here the answer is converted
//! back, whole or while streaming: each Chat chunk becomes deltas, each delta becomes the
//! client dialect's events as soon as it arrives.

use std::time::Instant;

use bytes::Bytes;
use http::{Response, StatusCode};
use hyper::body::Incoming;
use serde_json::Value;
use tokio::sync::mpsc;

use crate::body::GBody;
use crate::dialect::chat::{self, ChunkReader};
use crate::dialect::{Answer, Conversation, Finish, StreamEmitter, anthropic, responses};
use crate::error::GatewayError;
use crate::proxy::{
    Call, Next, Outcome, Route, UpstreamEvents, close_stream, collect_upstream, finish_capture,
    snippet, upstream_message,
};
use crate::token_ids::Capture;

/// The answer in the client's dialect.
fn render(call: &Call, conv: &Conversation, answer: &Answer) -> Value {
    match call.route {
        Route::Messages => anthropic::render_answer(conv, answer, &call.response_id),
        _ => responses::render_answer(conv, answer, &call.response_id),
    }
}

fn emitter(call: &Call, conv: &Conversation) -> Box<dyn StreamEmitter> {
    match call.route {
        Route::Messages => Box::new(anthropic::stream(conv, &call.response_id)),
        _ => Box::new(responses::stream(conv, &call.response_id)),
    }
}

fn finish_label(f: Finish) -> String {
    serde_json::to_value(f)
        .ok()
        .and_then(|v| v.as_str().map(str::to_string))
        .unwrap_or_default()
}

/// A whole (non-streamed) translated answer.
pub(crate) async fn whole(
    call: &Call,
    conv: &Conversation,
    resp: Response<Incoming>,
    t_up: Instant,
) -> Result<Response<GBody>, GatewayError> {
    let status = resp.status();
    let upstream = call.state.upstream.base_url().to_string();
    let body = collect_upstream(call, resp).await;
    let mut o = Outcome {
        status: StatusCode::OK.as_u16(),
        upstream_time: t_up.elapsed(),
        ..Default::default()
    };
    let result = match body {
        Err(e) => Err(e),
        Ok(bytes) if status.is_success() => match serde_json::from_slice::<Value>(&bytes) {
            Ok(v) => {
                let mut capture = Capture::default();
                capture.push(&v);
                o.tokens = finish_capture(call, capture);
                chat::parse_answer(&v).map_err(|d| GatewayError::UpstreamInvalid {
                    upstream: upstream.clone(),
                    detail: format!("the Chat Completions answer cannot be read: {d}"),
                })
            }
            Err(e) => Err(GatewayError::UpstreamInvalid {
                upstream: upstream.clone(),
                detail: format!("the body is not JSON ({e}): {}", snippet(&bytes)),
            }),
        },
        Ok(bytes) if status.is_client_error() => Err(GatewayError::UpstreamRefused {
            upstream: upstream.clone(),
            status: status.as_u16(),
            detail: upstream_message(&bytes),
        }),
        Ok(bytes) => Err(GatewayError::UpstreamStatus {
            upstream: upstream.clone(),
            status: status.as_u16(),
            detail: upstream_message(&bytes),
        }),
    };
    match result {
        Ok(answer) => {
            let rendered = render(call, conv, &answer);
            o.finish_reason = Some(finish_label(answer.finish));
            o.normalized_response = serde_json::to_value(&answer).ok();
            o.response = Some(rendered);
            call.answer_json(&o).await
        }
        Err(e) => Err(call.fail(o, e).await),
    }
}

/// A streamed translated answer: Chat chunks in, the client dialect's events out, as they
/// arrive. The closing events wait for the record to be durable.
pub(crate) async fn pump(
    call: Call,
    conv: Conversation,
    body: Incoming,
    tx: mpsc::Sender<Bytes>,
    t_up: Instant,
) {
    let mut up = UpstreamEvents::new(&call, body);
    let mut reader = ChunkReader::new();
    let mut em = emitter(&call, &conv);
    let mut o = Outcome {
        status: StatusCode::OK.as_u16(),
        ..Default::default()
    };
    let mut client_gone = false;
    let mut saw_done = false;
    let mut capture = Capture::default();
    for b in em.start() {
        if tx.send(b).await.is_err() {
            client_gone = true;
        }
    }
    'read: while !client_gone {
        let ev = match up.next(&tx).await {
            Next::Event(ev) => ev,
            Next::End => break,
            Next::Failed(e) => {
                o.error = Some(e);
                break;
            }
            Next::ClientGone => {
                client_gone = true;
                break;
            }
        };
        if ev.is_done() {
            saw_done = true;
            continue;
        }
        let Some(data) = ev.data.as_deref() else {
            continue;
        };
        let v = match up.json(data) {
            Ok(v) => v,
            Err(e) => {
                o.error = Some(e);
                break;
            }
        };
        if let Some(err) = v.get("error").filter(|e| !e.is_null()) {
            o.error = Some(GatewayError::UpstreamStream {
                upstream: up.upstream().to_string(),
                detail: format!("the upstream sent an error event: {err}"),
            });
            break;
        }
        if o.ttft.is_none() {
            o.ttft = Some(call.t0.elapsed());
        }
        capture.push(&v);
        for d in reader.push(&v) {
            for b in em.push(&d) {
                if tx.send(b).await.is_err() {
                    client_gone = true;
                    break 'read;
                }
            }
        }
    }
    let answer = reader.answer();
    if o.error.is_none() && !client_gone && !saw_done {
        o.error = Some(GatewayError::UpstreamStream {
            upstream: up.upstream().to_string(),
            detail: format!("the stream ended after {} events without [DONE]", up.events),
        });
    }
    o.upstream_time = t_up.elapsed();
    o.tokens = finish_capture(&call, capture);
    if reader.chunks() > 0 {
        o.response = Some(render(&call, &conv, &answer));
        o.normalized_response = serde_json::to_value(&answer).ok();
        o.finish_reason = Some(finish_label(answer.finish));
    }
    let last = if o.error.is_none() && !client_gone {
        em.finish(&answer)
    } else {
        vec![]
    };
    close_stream(&call, &o, client_gone, &tx, last).await;
}

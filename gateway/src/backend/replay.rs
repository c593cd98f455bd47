//! Replay: a source of backend events beside the live wires. A branch session's call that
//! is answered from its parent's record (`crate::branch`) gets, instead of a backend's
//! answer, that record's answer in the backend's own wire, read by the call's own leg as a
//! live answer would be: exact mode's `/generate` event stream (the recorded completion ids,
//! logprobs, finish reason and weight version, decoded and parsed into the client dialect's
//! events by the same `Generate` leg), or an OpenAI Chat Completions answer (whole, or the
//! chunks of a stream) that the passthrough leg relays and the translation leg re-emits. So
//! every dialect and every stream form is replayed by the code that serves it live.

use bytes::Bytes;
use graft_recorder::CallRecord;
use http::{HeaderValue, Response, header};
use http_body_util::{Either, Full};
use serde_json::{Value, json};

use super::{Leg, UpBody};
use crate::dialect::{Answer, Conversation, Delta, Dialect, chat};

/// The parent's answer in the wire `leg` reads, as the backend's response; Err says why
/// this call cannot be replayed (then it goes live).
pub(crate) fn response(
    leg: &mut Leg,
    parent: &CallRecord,
    conv: Option<&Conversation>,
    stream: bool,
) -> Result<Response<UpBody>, String> {
    let (bytes, sse) = match leg {
        Leg::Generate(g) => {
            let events = generate_events(parent)?;
            g.replay_as(&parent.call_id);
            (events, true)
        }
        Leg::Passthrough(_) | Leg::Translate(_) => chat_answer(parent, conv, stream)?,
    };
    let mut resp = Response::new(Either::Right(Full::new(bytes)));
    let ct = if sse {
        "text/event-stream"
    } else {
        "application/json"
    };
    resp.headers_mut()
        .insert(header::CONTENT_TYPE, HeaderValue::from_static(ct));
    Ok(resp)
}

/// Whether the call's leg can be replayed at all: exact mode, and passthrough or
/// translation over Chat Completions (a passthrough Completions call cannot: its answer
/// has no Chat form to replay).
pub(crate) fn replayable(leg: &Leg, dialect: &'static dyn Dialect) -> Result<(), String> {
    match leg {
        Leg::Passthrough(_) if dialect.kind() == crate::dialect::DialectKind::Completions => Err(
            "a passthrough Completions call cannot be replayed (only Chat-wire answers are): it goes live"
                .into(),
        ),
        _ => Ok(()),
    }
}

/// SGLang's `/generate` stream of the recorded completion: one event with every id (its
/// logprobs, weight versions and finish reason), then `[DONE]`.
fn generate_events(parent: &CallRecord) -> Result<Bytes, String> {
    let ids = parent
        .completion_token_ids
        .as_deref()
        .ok_or("the parent's call has no completion token ids")?;
    let finish = match parent
        .backend_finish_reason
        .as_deref()
        .or(parent.finish_reason.as_deref())
    {
        Some("length") => json!({"type": "length", "length": ids.len()}),
        _ => match &parent.stop_matched {
            Some(m) => json!({"type": "stop", "matched": m}),
            None => json!({"type": "stop"}),
        },
    };
    let mut meta = json!({
        "id": parent.call_id,
        "finish_reason": finish,
        "prompt_tokens": parent.prompt_token_ids.as_ref().map_or(0, Vec::len),
        "completion_tokens": ids.len(),
        "cached_tokens": 0,
    });
    if let Some(lps) = &parent.completion_logprobs
        && lps.len() == ids.len()
    {
        meta["output_token_logprobs"] = lps
            .iter()
            .zip(ids)
            .map(|(l, id)| json!([l, id, null]))
            .collect();
    }
    if let Some(v) = &parent.weight_version {
        meta["weight_version"] = Value::String(v.clone());
    }
    if let Some(spans) = &parent.weight_version_spans {
        meta["weight_versions"] = serde_json::to_value(spans).map_err(|e| e.to_string())?;
    }
    let event = json!({"text": "", "output_ids": ids, "meta_info": meta});
    Ok(Bytes::from(format!("data: {event}\n\ndata: [DONE]\n\n")))
}

/// The parent's answer as the internal [`Answer`]: its normalized answer (translation),
/// else its Chat Completions response.
fn parent_answer(parent: &CallRecord) -> Result<Answer, String> {
    if let Some(a) = parent
        .normalized_response
        .as_ref()
        .and_then(|v| serde_json::from_value::<Answer>(v.clone()).ok())
    {
        return Ok(a);
    }
    if parent.dialect != crate::dialect::DialectKind::ChatCompletions.label() {
        return Err(format!(
            "the parent's {} answer has no Chat form to replay",
            parent.dialect
        ));
    }
    let response = parent
        .response
        .as_ref()
        .ok_or("the parent's call has no recorded answer")?;
    chat::parse_answer(response)
}

/// The parent's answer as a Chat Completions upstream would send it: its recorded body (a
/// whole Chat answer), or the chunks of a stream.
fn chat_answer(
    parent: &CallRecord,
    conv: Option<&Conversation>,
    stream: bool,
) -> Result<(Bytes, bool), String> {
    let answer = parent_answer(parent)?;
    let empty = Conversation::default();
    let conv = conv.unwrap_or(&empty);
    if !stream {
        let whole = match &parent.response {
            Some(r) if parent.dialect == crate::dialect::DialectKind::ChatCompletions.label() => {
                r.clone()
            }
            _ => chat::render_answer(&answer, &answer.id),
        };
        return Ok((Bytes::from(whole.to_string()), false));
    }
    let mut conv = conv.clone();
    conv.model.clone_from(&answer.model);
    let mut em = chat::Chat.emitter(&conv, &answer.id, answer.created);
    let mut out: Vec<Bytes> = em.start();
    if let Some(r) = answer.reasoning.as_deref().filter(|r| !r.is_empty()) {
        out.extend(em.push(&Delta::Reasoning(r.to_owned())));
    }
    if !answer.text.is_empty() {
        out.extend(em.push(&Delta::Text(answer.text.clone())));
    }
    for (index, t) in answer.tool_calls.iter().enumerate() {
        out.extend(em.push(&Delta::ToolCallStart {
            index,
            id: t.id.clone(),
            name: t.name.clone(),
        }));
        out.extend(em.push(&Delta::ToolCallArgs {
            index,
            arguments: t.arguments.clone(),
        }));
    }
    out.extend(em.finish(&answer));
    Ok((out.concat().into(), true))
}

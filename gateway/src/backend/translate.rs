//! Translation: a Responses or Anthropic Messages call served by a Chat Completions
//! upstream. The request was converted on the way in (`openai.rs` plans it); here the
//! answer is read back, whole or chunk by chunk: each Chat chunk becomes deltas, which the
//! relay hands to the client dialect's emitter as soon as they arrive.

use bytes::Bytes;
use http::{HeaderValue, StatusCode};
use serde_json::Value;

use super::{Answering, Finished, Piece, Whole, content_event};
use crate::dialect::Delta;
use crate::dialect::Finish;
use crate::dialect::chat::{self, ChunkReader};
use crate::error::GatewayError;
use crate::outcome::Outcome;
use crate::route::Route;
use crate::sse::Event;
use crate::token_ids::Capture;

pub(crate) struct Translate {
    /// The Chat Completions request graft sends.
    pub(crate) body: Bytes,
    reader: ChunkReader,
    capture: Capture,
    saw_done: bool,
    events: u64,
    upstream: String,
}

impl Translate {
    pub(crate) fn new(body: Bytes, upstream: &str) -> Self {
        Translate {
            body,
            reader: ChunkReader::new(),
            capture: Capture::default(),
            saw_done: false,
            events: 0,
            upstream: upstream.to_string(),
        }
    }

    pub(crate) fn path(&self) -> &'static str {
        Route::ChatCompletions.upstream_path()
    }
}

/// The finish reason as the record writes it (`stop`, `tool_calls`...).
pub(crate) fn finish_label(f: Finish) -> String {
    serde_json::to_value(f)
        .ok()
        .and_then(|v| v.as_str().map(str::to_string))
        .unwrap_or_default()
}

impl Answering for Translate {
    fn relays(&self) -> bool {
        false
    }

    fn event(
        &mut self,
        ev: &mut Event,
        parsed: Option<&mut Value>,
        _o: &mut Outcome,
    ) -> Result<Piece, GatewayError> {
        self.events += 1;
        self.saw_done |= ev.is_done();
        let Some(v) = content_event(ev, parsed, &self.upstream)? else {
            return Ok(Piece::Skip);
        };
        self.capture.push(v);
        Ok(Piece::Deltas {
            deltas: self.reader.push(v),
            progress: true,
        })
    }

    fn end(&mut self, _o: &mut Outcome, _relayed: bool) -> Result<Vec<Delta>, GatewayError> {
        if !self.saw_done {
            return Err(GatewayError::UpstreamStream {
                upstream: self.upstream.clone(),
                detail: format!(
                    "the stream ended after {} events without [DONE]",
                    self.events
                ),
            });
        }
        Ok(vec![])
    }

    fn finish(&mut self, o: &mut Outcome, _ok: bool) -> Option<Finished> {
        o.tokens = std::mem::take(&mut self.capture).into_recorded(false);
        let answer = self.reader.answer();
        let render = self.reader.chunks() > 0;
        if render {
            o.normalized_response = serde_json::to_value(&answer).ok();
            o.finish_reason = Some(finish_label(answer.finish));
        }
        Some(Finished { answer, render })
    }

    fn whole(
        &mut self,
        status: StatusCode,
        _content_type: Option<HeaderValue>,
        bytes: Bytes,
        o: &mut Outcome,
    ) -> Result<Whole, GatewayError> {
        let upstream = self.upstream.clone();
        if status.is_client_error() {
            return Err(GatewayError::UpstreamRefused {
                upstream,
                status: status.as_u16(),
                detail: crate::upstream::upstream_message(&bytes),
            });
        }
        if !status.is_success() {
            return Err(GatewayError::UpstreamStatus {
                upstream,
                status: status.as_u16(),
                detail: crate::upstream::upstream_message(&bytes),
            });
        }
        let v: Value =
            serde_json::from_slice(&bytes).map_err(|e| GatewayError::UpstreamInvalid {
                upstream: upstream.clone(),
                detail: format!(
                    "the body is not JSON ({e}): {}",
                    crate::upstream::snippet(&bytes)
                ),
            })?;
        let mut capture = Capture::default();
        capture.push(&v);
        o.tokens = capture.into_recorded(false);
        let answer = chat::parse_answer(&v).map_err(|d| GatewayError::UpstreamInvalid {
            upstream,
            detail: format!("the Chat Completions answer cannot be read: {d}"),
        })?;
        o.finish_reason = Some(finish_label(answer.finish));
        o.normalized_response = serde_json::to_value(&answer).ok();
        Ok(Whole::Answer(answer))
    }
}

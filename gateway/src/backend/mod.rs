//! Backends: where an accepted call goes and what its answer is turned into. A gateway has
//! one [`Backend`] (its config's `BackendConfig`); each call takes one [`Leg`] of it, chosen
//! once by [`Backend::plan`]:
//!
//! - `openai::Passthrough`: the client's body to an OpenAI-compatible upstream (with the
//!   token-id augment/strip of `upstream.token_ids`), its events relayed as they are;
//! - `translate::Translate`: a Responses or Messages call served by a Chat upstream, the
//!   Chat chunks re-emitted in the client's dialect;
//! - `sglang::Generate`: exact mode, token ids to SGLang's native `/generate` or vLLM's
//!   `/v1/completions` (`exact.wire`, one [`sglang::Wire`] per gateway).
//!
//! Every leg answers through the same [`Answering`] contract, read by the one relay in
//! `pipeline.rs` (whole answers and event streams alike).

pub mod openai;
mod probe;
pub(crate) mod replay;
mod restore;
pub mod sglang;
pub mod translate;

use std::sync::Arc;
use std::time::Duration;

use http::{HeaderMap, Response, StatusCode};
use hyper::body::Incoming;
use prometheus_client::metrics::gauge::Gauge;
use serde_json::Value;
use tokio::sync::{OwnedRwLockReadGuard, OwnedSemaphorePermit, RwLock};

use crate::config::{BackendConfig, GatewayConfig};
use crate::dialect::{Answer, Conversation, Delta, Dialect};
use crate::error::GatewayError;
use crate::outcome::Outcome;
use crate::policy::SamplingPolicy;
use crate::route::Route;
use crate::sse::Event;

/// A backend's answer body as a leg reads it: a live backend's, or a recorded answer
/// replayed in the backend's wire (`replay.rs`).
pub(crate) type UpBody = http_body_util::Either<Incoming, http_body_util::Full<bytes::Bytes>>;

/// The backend a gateway calls, from its config.
pub enum Backend {
    OpenAi(openai::OpenAi),
    Sglang(sglang::Sglang),
}

impl Backend {
    pub fn new(cfg: &GatewayConfig) -> Result<Self, BackendSetupError> {
        Ok(match &cfg.backend {
            BackendConfig::OpenAi(o) => Backend::OpenAi(openai::OpenAi::new(o, &cfg.backend_http)?),
            BackendConfig::Sglang(e) => Backend::Sglang(sglang::Sglang::new(e, &cfg.backend_http)?),
        })
    }

    /// Exact mode's state, for the backend control API.
    pub fn exact(&self) -> Option<&sglang::Sglang> {
        match self {
            Backend::Sglang(s) => Some(s),
            Backend::OpenAi(_) => None,
        }
    }

    /// A closed session's state is dropped.
    pub fn forget(&self, session: &str) {
        if let Backend::Sglang(s) = self {
            s.forget(session);
        }
    }

    /// `GET /v1/models` (relayed, not recorded: it is not a model call).
    pub(crate) async fn models(
        &self,
        headers: &HeaderMap,
    ) -> Result<(String, Response<Incoming>), GatewayError> {
        match self {
            Backend::OpenAi(o) => o.models(headers).await,
            Backend::Sglang(s) => s.models().await,
        }
    }

    /// How long graft waits for a backend between two bytes.
    pub(crate) fn timeout(&self) -> Duration {
        match self {
            Backend::OpenAi(o) => o.timeout(),
            Backend::Sglang(s) => s.timeout(),
        }
    }

    /// Chooses the call's leg and builds what it sends.
    pub(crate) async fn plan(
        &self,
        route: Route,
        dialect: &'static dyn Dialect,
        request: &Value,
        bytes: bytes::Bytes,
        ctx: CallCtx<'_>,
    ) -> Result<Plan, GatewayError> {
        match self {
            Backend::OpenAi(o) => o.plan(route, dialect, request, bytes, ctx.policy),
            Backend::Sglang(s) => {
                s.plan(dialect, request, ctx.session, ctx.call_id, ctx.policy)
                    .await
            }
        }
    }
}

/// Whose call is planned, and the sampling policy it is sampled with.
pub(crate) struct CallCtx<'a> {
    pub(crate) session: &'a str,
    pub(crate) call_id: &'a str,
    pub(crate) policy: Option<&'a SamplingPolicy>,
}

#[derive(Debug, thiserror::Error)]
pub enum BackendSetupError {
    #[error("exact mode cannot load the model's tokenizer and chat template from {dir}: {message}")]
    Model { dir: String, message: String },
    #[error(transparent)]
    Gateway(#[from] GatewayError),
}

/// What a call sends and records, chosen before anything is sent.
pub(crate) struct Plan {
    pub(crate) leg: Leg,
    /// The client's request as a conversation, when it was parsed into one (for the
    /// dialect's renderer and emitter).
    pub(crate) conv: Option<Conversation>,
    /// What the record keeps of the plan (the call holds it until its record is built).
    pub(crate) record: PlanRecord,
}

/// The plan's part of the call's record: where the call went, in which form, and how it
/// was sampled.
pub(crate) struct PlanRecord {
    /// The conversation in graft's own form (dialects other than plain passthrough).
    pub(crate) normalized_request: Option<Value>,
    /// What graft sent upstream when it was not the client's body.
    pub(crate) upstream_request: Option<Value>,
    /// The wire graft spoke upstream when it was not the client's (`chat_completions`,
    /// `sglang_generate`).
    pub(crate) upstream_dialect: Option<&'static str>,
    /// The backend's URL.
    pub(crate) upstream: String,
    pub(crate) model: Option<String>,
    pub(crate) stream: bool,
    /// The record's `sampling` (a policy applied: it, what the client asked, what was sent).
    pub(crate) sampling: Option<Value>,
}

/// One call's way to its backend.
pub(crate) enum Leg {
    Passthrough(openai::Passthrough),
    Translate(translate::Translate),
    Generate(Box<sglang::Generate>),
}

/// What one upstream event became.
pub(crate) enum Piece {
    /// Relay the event to the client as it now is (passthrough). `answer`: it carries
    /// answer content (for the tee and the time to first token), not an error.
    Relay { answer: bool },
    /// Re-emit these deltas in the client's dialect (translation, exact mode); `progress`:
    /// the model produced something (time to first token).
    Deltas { deltas: Vec<Delta>, progress: bool },
    /// Nothing for the client.
    Skip,
}

/// A whole answer from the backend.
pub(crate) enum Whole {
    /// The upstream's bytes, to relay as they are with its status.
    Raw {
        status: StatusCode,
        content_type: Option<http::HeaderValue>,
        bytes: bytes::Bytes,
    },
    /// An answer for the client's dialect to render.
    Answer(Answer),
}

/// The answer a stream ended with.
pub(crate) struct Finished {
    pub(crate) answer: Answer,
    /// Whether the record keeps it rendered in the client's dialect (something was read).
    pub(crate) render: bool,
}

/// The contract every leg keeps; the relay in `pipeline.rs` is its only reader.
pub(crate) trait Answering: Send {
    /// Whether the backend's events go to the client as they are (else the client dialect's
    /// emitter writes the client's events).
    fn relays(&self) -> bool;
    /// Whether an answer with this status and content type is read as an event stream.
    fn streams(&self, status: StatusCode, is_sse: bool) -> bool {
        status.is_success() && is_sse
    }
    /// One upstream event (its JSON parsed unless it is `[DONE]`).
    fn event(
        &mut self,
        ev: &mut Event,
        parsed: Option<&mut Value>,
        o: &mut Outcome,
    ) -> Result<Piece, GatewayError>;
    /// The upstream's body ended and neither side failed: the last deltas, or why the end
    /// is not a proper one (`relayed_terminal`: the relay holds the stream's last event).
    fn end(&mut self, o: &mut Outcome, relayed_terminal: bool) -> Result<Vec<Delta>, GatewayError>;
    /// The stream is over (`ok`: it ended properly and the client is still there): the
    /// record's token fields and finish reason; the answer to close the client's stream with.
    fn finish(&mut self, o: &mut Outcome, ok: bool) -> Option<Finished>;
    /// A whole answer (or an upstream error answer to a streamed request).
    fn whole(
        &mut self,
        status: StatusCode,
        content_type: Option<http::HeaderValue>,
        bytes: bytes::Bytes,
        o: &mut Outcome,
    ) -> Result<Whole, GatewayError>;
}

/// The JSON of an upstream event that carries answer content: `None` for `[DONE]` and for
/// events without data; an error event becomes the error that ends the stream.
pub(crate) fn content_event<'a>(
    ev: &Event,
    parsed: Option<&'a mut Value>,
    upstream: &str,
) -> Result<Option<&'a mut Value>, GatewayError> {
    if ev.is_done() {
        return Ok(None);
    }
    let Some(v) = parsed else {
        return Ok(None);
    };
    if let Some(err) = v.get("error").filter(|e| !e.is_null()) {
        return Err(GatewayError::UpstreamStream {
            upstream: upstream.to_string(),
            detail: format!("the upstream sent an error event: {err}"),
        });
    }
    Ok(Some(v))
}

impl Leg {
    pub(crate) fn answering(&mut self) -> &mut dyn Answering {
        match self {
            Leg::Passthrough(p) => p,
            Leg::Translate(t) => t,
            Leg::Generate(g) => g.as_mut(),
        }
    }

    /// Sends the request; returns once the answer's head has arrived.
    pub(crate) async fn send(
        &self,
        backend: &Backend,
        headers: &HeaderMap,
    ) -> Result<Response<UpBody>, GatewayError> {
        let sent = match (self, backend) {
            (Leg::Passthrough(p), Backend::OpenAi(o)) => {
                o.send(p.path, p.body.clone(), headers).await
            }
            (Leg::Translate(t), Backend::OpenAi(o)) => {
                o.send(t.path(), t.body.clone(), headers).await
            }
            (Leg::Generate(g), Backend::Sglang(s)) => s.send(g).await,
            _ => Err(GatewayError::Internal(
                "a call was planned for another backend than this gateway's".into(),
            )),
        };
        sent.map(|r| r.map(http_body_util::Either::Left))
    }

    /// The gate a backend pause closes (exact mode), held while the backend has the call.
    pub(crate) fn gate(&self) -> Option<Arc<RwLock<()>>> {
        match self {
            Leg::Generate(g) => Some(g.gate.clone()),
            _ => None,
        }
    }
}

/// A call's hold on its backend: the upstream slot, the backend's pause gate and the
/// in-flight gauge, taken together and released together.
pub(crate) struct InFlight {
    _permit: OwnedSemaphorePermit,
    _gate: Option<OwnedRwLockReadGuard<()>>,
    gauge: Gauge,
}

impl InFlight {
    pub(crate) async fn take(
        limits: &crate::limits::Limits,
        gate: Option<Arc<RwLock<()>>>,
        gauge: &Gauge,
    ) -> Result<Self, GatewayError> {
        let permit = limits.upstream_permit().await?;
        let gate = match gate {
            Some(g) => Some(g.read_owned().await),
            None => None,
        };
        gauge.inc();
        Ok(InFlight {
            _permit: permit,
            _gate: gate,
            gauge: gauge.clone(),
        })
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.gauge.dec();
    }
}

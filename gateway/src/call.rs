//! One call from its arrival until its record is written: who made it, what it asked, and
//! the last phase of every call in every mode: the record is committed (under sync
//! durability the last byte waits for the fsync), metrics observed, the answer released.

use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use graft_recorder::{CallOutcome, CallRecord, SCHEMA_VERSION, Usage};
use http::{HeaderValue, Response, header};
use serde_json::Value;
use tokio::sync::mpsc;
use tracing::{Instrument, error};

use crate::backend::PlanRecord;
use crate::body::{GBody, channel_body, full};
use crate::dialect::Dialect;
use crate::error::{Cause, GatewayError};
use crate::outcome::Outcome;
use crate::retries::Link;
use crate::route::Route;
use crate::sessions::{Session, now_us};
use crate::state::State;

/// How a call ended, for [`Call::finish`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum End {
    /// A whole answer or a refusal, sent in one piece.
    Whole,
    /// A stream that ran to its end (time to first token observed).
    Stream,
    /// The client went away before the answer was complete.
    ClientGone,
}

/// What is known about a call from its arrival until its record is written.
pub(crate) struct Call {
    pub(crate) state: Arc<State>,
    pub(crate) call_id: String,
    pub(crate) session: Arc<Session>,
    pub(crate) route: Route,
    /// The client's dialect (`None` only for routes that are not model calls).
    pub(crate) dialect: &'static dyn Dialect,
    pub(crate) request: Value,
    pub(crate) client: Option<String>,
    /// The configured request headers (`recorder.record_headers`) the call came with.
    pub(crate) headers: Option<std::collections::BTreeMap<String, String>>,
    pub(crate) started_at_us: i64,
    pub(crate) t0: Instant,
    /// Where the call went, in which form, how it was sampled ([`Backend::plan`]'s part of
    /// the record).
    ///
    /// [`Backend::plan`]: crate::backend::Backend::plan
    pub(crate) plan: PlanRecord,
    /// The id graft gives the answer in the client's dialect (`resp_…`, `msg_…`).
    pub(crate) response_id: String,
    /// Which attempt of its turn the call is.
    pub(crate) link: Link,
    /// A branch session's call: replayed from its parent's record or live (`branch.rs`).
    pub(crate) replay: Option<graft_recorder::Replay>,
}

impl Call {
    /// The call's record. It moves the request and the answer out of the call and the
    /// outcome (each call is committed once), rather than copying them.
    pub(crate) fn build_record(&mut self, o: &mut Outcome, client_gone: bool) -> CallRecord {
        let usage = usage_of(o);
        let (outcome, error) = match (&o.error, &o.upstream_error_text) {
            _ if client_gone => (
                CallOutcome::ClientDisconnected.as_str().to_string(),
                o.error.as_ref().map(|e| e.to_string()).or(Some(
                    "the client closed the connection before the response ended".into(),
                )),
            ),
            (Some(e), _) => (e.cause().outcome().to_string(), Some(e.to_string())),
            (None, Some(t)) => (Cause::Upstream.outcome().to_string(), Some(t.clone())),
            (None, None) => (CallOutcome::Ok.as_str().to_string(), None),
        };
        let mut request = std::mem::take(&mut self.request);
        graft_recorder::redact_json(&mut request);
        let secrets = &self.state.cfg.recorder.redact_keys;
        graft_recorder::redact_body_keys(&mut request, secrets);
        let plan = &mut self.plan;
        for v in [&mut plan.normalized_request, &mut plan.upstream_request]
            .into_iter()
            .flatten()
        {
            graft_recorder::redact_body_keys(v, secrets);
        }
        let tokens = std::mem::take(&mut o.tokens);
        CallRecord {
            schema_version: SCHEMA_VERSION,
            call_id: self.call_id.clone(),
            session_id: self.session.id.clone(),
            group_id: self.session.group_id.clone(),
            seq: 0,
            started_at_us: self.started_at_us,
            finished_at_us: now_us(),
            dialect: self.route.label().to_string(),
            endpoint: self.route.endpoint().to_string(),
            model: plan.model.clone(),
            upstream: plan.upstream.clone(),
            stream: plan.stream,
            request,
            response: o.response.take(),
            normalized_request: plan.normalized_request.take(),
            normalized_response: o.normalized_response.take(),
            upstream_request: plan.upstream_request.take(),
            upstream_dialect: plan.upstream_dialect.map(str::to_string),
            status: o.status,
            outcome,
            error,
            prompt_token_ids: tokens.prompt_token_ids,
            completion_token_ids: tokens.completion_token_ids,
            completion_logprobs: tokens.completion_logprobs,
            finish_reason: o.finish_reason.take(),
            weight_version: o.weight_version.take(),
            weight_version_spans: o.weight_version_spans.take(),
            usage,
            ttft_ms: o.ttft.map(|d| d.as_secs_f64() * 1e3),
            latency_ms: self.t0.elapsed().as_secs_f64() * 1e3,
            client: self.client.clone(),
            sampling: plan.sampling.clone(),
            attempt: Some(self.link.attempt),
            retry_of: self.link.retry_of.clone(),
            backend_finish_reason: o.backend_finish_reason.take(),
            stop_matched: o.stop_matched.take(),
            headers: self.headers.clone(),
            replay: self.replay.take(),
        }
    }

    /// The last phase of every call, at each of its exits (like pingora's `logging` phase):
    /// a generation whose client went away is told to stop, the record is committed (under
    /// sync durability this returns once it is fsynced) and the metrics observed, each once.
    /// The error is the record's, when it could not be written.
    pub(crate) async fn finish(&mut self, o: &mut Outcome, end: End) -> Result<(), GatewayError> {
        let client_gone = end == End::ClientGone;
        if client_gone {
            self.abort_generation();
        }
        let committed = self.commit(o, client_gone).await;
        let ttft = if end == End::Whole { None } else { o.ttft };
        self.observe(
            o.upstream_time,
            *committed.as_ref().unwrap_or(&Duration::ZERO),
            ttft,
        );
        committed.map(|_| ())
    }

    /// Hands the record to the recorder; under sync durability this returns once it is fsynced.
    async fn commit(
        &mut self,
        o: &mut Outcome,
        client_gone: bool,
    ) -> Result<Duration, GatewayError> {
        let rec = self.build_record(o, client_gone);
        self.state
            .retries
            .settle(&self.session.id, &self.call_id, rec.is_ok());
        let t = Instant::now();
        self.session
            .count_call(rec.outcome == Cause::Upstream.outcome());
        self.state.metrics.records_written.inc();
        let res = self.state.recorder.record(rec).await;
        let waited = t.elapsed();
        self.state.metrics.record_wait.observe(waited.as_secs_f64());
        match res {
            Ok(_) => Ok(waited),
            Err(e) => {
                error!(call_id = %self.call_id, session = %self.session.id, error = %e, "call record could not be written");
                Err(GatewayError::Record(e.to_string()))
            }
        }
    }

    /// Tells an exact-mode backend to stop this call's generation (its client went away);
    /// in the background, so the client's side is not held up.
    fn abort_generation(&self) {
        if !matches!(
            self.plan.upstream_dialect,
            Some(crate::backend::sglang::WIRE | crate::backend::sglang::VLLM_WIRE)
        ) {
            return;
        }
        let state = self.state.clone();
        let (backend, call_id) = (self.plan.upstream.clone(), self.call_id.clone());
        tokio::spawn(
            async move {
                if let Some(exact) = state.backend.exact() {
                    exact.abort(&backend, &call_id).await;
                }
            }
            .in_current_span(),
        );
    }

    /// Records a call that failed with `e` (best effort: the error goes back to the client
    /// either way) and hands the error back.
    pub(crate) async fn fail(&mut self, mut o: Outcome, e: GatewayError) -> GatewayError {
        o.status = e.status().as_u16();
        o.error = Some(e);
        // Best effort: the client gets the call's own error either way.
        let _ = self.finish(&mut o, End::Whole).await;
        o.error
            .take()
            .unwrap_or_else(|| GatewayError::Internal("lost error".into()))
    }

    fn observe(&self, upstream_time: Duration, record_wait: Duration, ttft: Option<Duration>) {
        let m = &self.state.metrics;
        let route = crate::metrics::RouteLabel {
            route: self.route.label(),
        };
        m.upstream_latency
            .get_or_create(&route)
            .observe(upstream_time.as_secs_f64());
        let overhead = self
            .t0
            .elapsed()
            .saturating_sub(upstream_time)
            .saturating_sub(record_wait);
        m.overhead
            .get_or_create(&route)
            .observe(overhead.as_secs_f64());
        if let Some(t) = ttft {
            m.ttft.get_or_create(&route).observe(t.as_secs_f64());
        }
    }

    /// Records a whole answer (under sync durability this waits for the fsync), then hands
    /// `bytes` to the client with `status` and `content_type`.
    pub(crate) async fn answer(
        &mut self,
        o: &mut Outcome,
        status: http::StatusCode,
        content_type: HeaderValue,
        bytes: Bytes,
    ) -> Result<Response<GBody>, GatewayError> {
        self.finish(o, End::Whole).await?;
        let mut resp = Response::new(full(bytes));
        *resp.status_mut() = status;
        resp.headers_mut()
            .insert(header::CONTENT_TYPE, content_type);
        self.headers(&mut resp);
        Ok(resp)
    }

    /// The client's SSE response (its events come through the returned sender).
    pub(crate) fn sse_response(&self) -> (mpsc::Sender<Bytes>, Response<GBody>) {
        let (tx, body) = channel_body(64);
        let mut out = Response::new(body);
        out.headers_mut().insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("text/event-stream"),
        );
        out.headers_mut()
            .insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
        self.headers(&mut out);
        (tx, out)
    }

    fn headers(&self, resp: &mut Response<GBody>) {
        if let Ok(v) = HeaderValue::from_str(&self.call_id) {
            resp.headers_mut().insert("x-graft-call-id", v);
        }
        if let Ok(v) = HeaderValue::from_str(&self.session.id) {
            resp.headers_mut().insert("x-graft-session", v);
        }
    }

    /// The event that ends a failed stream, in the call's dialect.
    pub(crate) fn error_event(&self, e: &GatewayError) -> Bytes {
        self.dialect.error_event(e, &self.response_id)
    }
}

/// Token counts from the internal answer, else from the response in any dialect's shape
/// (`prompt_tokens`/`completion_tokens` or `input_tokens`/`output_tokens`).
fn usage_of(o: &Outcome) -> Option<Usage> {
    if let Some(u) = o
        .normalized_response
        .as_ref()
        .and_then(|a| a.get("usage"))
        .filter(|u| u.is_object())
    {
        let i = u.get("input_tokens").and_then(Value::as_u64);
        let out = u.get("output_tokens").and_then(Value::as_u64);
        return Some(Usage {
            prompt_tokens: i,
            completion_tokens: out,
            total_tokens: i.zip(out).map(|(a, b)| a + b),
        });
    }
    let u = o.response.as_ref()?.get("usage")?.as_object()?;
    let get = |a: &str, b: &str| u.get(a).or_else(|| u.get(b)).and_then(Value::as_u64);
    let prompt = get("prompt_tokens", "input_tokens");
    let completion = get("completion_tokens", "output_tokens");
    Some(Usage {
        prompt_tokens: prompt,
        completion_tokens: completion,
        total_tokens: u
            .get("total_tokens")
            .and_then(Value::as_u64)
            .or(prompt.zip(completion).map(|(a, b)| a + b)),
    })
}

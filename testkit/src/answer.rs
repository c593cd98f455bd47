//! The scripted upstream's answers: the body type, JSON answers, the SSE body with its delay
//! between events and its deliberate reset (`fault-reset`), and the error that aborts a
//! connection.

use std::convert::Infallible;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http::{Response, StatusCode, header};
use http_body_util::{BodyExt, Full};
use hyper::body::{Body, Frame, SizeHint};
use serde_json::Value;

use crate::RESET_FLUSH_PAUSE;

pub(crate) type RespBody = http_body_util::combinators::UnsyncBoxBody<Bytes, std::io::Error>;

/// Returned to hyper to abort the connection (the `fault-reset` fault).
#[derive(Debug)]
pub(crate) struct Abort;

impl std::fmt::Display for Abort {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("scripted-upstream: connection aborted on purpose (fault-reset)")
    }
}
impl std::error::Error for Abort {}

pub(crate) fn full(bytes: impl Into<Bytes>) -> RespBody {
    Full::new(bytes.into())
        .map_err(|never: Infallible| match never {})
        .boxed_unsync()
}

pub(crate) fn json_response(status: StatusCode, v: &Value) -> Response<RespBody> {
    graft_http::json_response(status, v, full)
}

pub(crate) fn sse_response(body: SseBody) -> Response<RespBody> {
    let mut resp = Response::new(body.boxed_unsync());
    let h = resp.headers_mut();
    h.insert(
        header::CONTENT_TYPE,
        header::HeaderValue::from_static("text/event-stream; charset=utf-8"),
    );
    h.insert(
        header::CACHE_CONTROL,
        header::HeaderValue::from_static("no-cache"),
    );
    resp
}

/// An SSE response body: one HTTP chunk per event, `delay` between events, and optionally
/// an error after `abort_after` events, which makes hyper drop the connection without the
/// terminating chunk (the client sees a transport error, as when an upstream dies).
pub(crate) struct SseBody {
    pub(crate) events: std::vec::IntoIter<Bytes>,
    pub(crate) delay: Duration,
    pub(crate) sleep: Option<Pin<Box<tokio::time::Sleep>>>,
    pub(crate) sent: usize,
    pub(crate) abort_after: Option<usize>,
    /// Events that exist only once something happened (a weight update): awaited after
    /// `events` ran out.
    pub(crate) later: Option<LaterEvents>,
}

/// Events produced by a future (see [`SseBody::later`]).
pub(crate) type LaterEvents = Pin<Box<dyn Future<Output = Vec<Bytes>> + Send>>;

impl SseBody {
    pub(crate) fn new(events: Vec<Bytes>, delay: Duration, abort_after: Option<usize>) -> Self {
        SseBody {
            events: events.into_iter(),
            delay,
            sleep: None,
            sent: 0,
            abort_after,
            later: None,
        }
    }

    /// Once `events` are sent, awaits `later` and sends what it gives.
    pub(crate) fn then(mut self, later: LaterEvents) -> Self {
        self.later = Some(later);
        self
    }
}

/// Waits `delay` in a body's `poll_frame`: the timer lives in `sleep` across polls and is
/// cleared once it fired.
fn pause(
    sleep: &mut Option<Pin<Box<tokio::time::Sleep>>>,
    delay: Duration,
    cx: &mut Context<'_>,
) -> Poll<()> {
    let timer = sleep.get_or_insert_with(|| Box::pin(tokio::time::sleep(delay)));
    if timer.as_mut().poll(cx).is_pending() {
        return Poll::Pending;
    }
    *sleep = None;
    Poll::Ready(())
}

impl Body for SseBody {
    type Data = Bytes;
    type Error = std::io::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, std::io::Error>>> {
        let this = &mut *self;
        if this.abort_after.is_some_and(|n| this.sent >= n) {
            // Pause first: hyper flushes what it buffered (headers, the chunks so far) when
            // the body is pending, and drops the buffer when the body fails.
            if pause(&mut this.sleep, RESET_FLUSH_PAUSE, cx).is_pending() {
                return Poll::Pending;
            }
            this.abort_after = None;
            this.events = Vec::new().into_iter();
            return Poll::Ready(Some(Err(std::io::Error::new(
                std::io::ErrorKind::ConnectionAborted,
                Abort,
            ))));
        }
        if this.events.len() == 0
            && let Some(later) = this.later.as_mut()
        {
            let Poll::Ready(more) = later.as_mut().poll(cx) else {
                return Poll::Pending;
            };
            this.later = None;
            this.events = more.into_iter();
        }
        if this.sent > 0
            && !this.delay.is_zero()
            && this.events.len() > 0
            && pause(&mut this.sleep, this.delay, cx).is_pending()
        {
            return Poll::Pending;
        }
        match this.events.next() {
            Some(event) => {
                this.sent += 1;
                Poll::Ready(Some(Ok(Frame::data(event))))
            }
            None => Poll::Ready(None),
        }
    }

    fn is_end_stream(&self) -> bool {
        self.events.len() == 0 && self.abort_after.is_none() && self.later.is_none()
    }

    fn size_hint(&self) -> SizeHint {
        // Unknown on purpose: SSE goes out chunked.
        SizeHint::default()
    }
}

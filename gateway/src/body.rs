//! Response bodies: whole buffers, or a bounded channel the SSE pump writes into (the
//! client's pace sets the upstream's pace: no unbounded buffering).

use std::convert::Infallible;
use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};
use tokio::sync::mpsc;

pub enum GBody {
    Full(Option<Bytes>),
    Channel(mpsc::Receiver<Bytes>),
}

pub fn full(b: impl Into<Bytes>) -> GBody {
    GBody::Full(Some(b.into()))
}

pub fn channel_body(capacity: usize) -> (mpsc::Sender<Bytes>, GBody) {
    let (tx, rx) = mpsc::channel(capacity);
    (tx, GBody::Channel(rx))
}

impl From<Bytes> for GBody {
    fn from(b: Bytes) -> Self {
        full(b)
    }
}

impl Body for GBody {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        match &mut *self {
            GBody::Full(b) => Poll::Ready(b.take().map(|b| Ok(Frame::data(b)))),
            GBody::Channel(rx) => rx.poll_recv(cx).map(|o| o.map(|b| Ok(Frame::data(b)))),
        }
    }

    fn is_end_stream(&self) -> bool {
        matches!(self, GBody::Full(None))
    }

    fn size_hint(&self) -> SizeHint {
        match self {
            GBody::Full(Some(b)) => SizeHint::with_exact(b.len() as u64),
            GBody::Full(None) => SizeHint::with_exact(0),
            GBody::Channel(_) => SizeHint::default(),
        }
    }
}

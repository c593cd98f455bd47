//! An upstream's event stream read as whole server-sent events: the reader under the relay
//! and under `gather` in `pipeline.rs`. It bounds the wait for each read (the backend's
//! timeout: a stalled stream fails as [`GatewayError::UpstreamTimeout`]) and the size of
//! one event, says how a stream that ends inside an event failed, and watches the client's
//! side: once the client's channel is closed the read ends as [`Next::ClientGone`], whatever
//! the upstream does. Generic over [`http_body::Body`], so its tests run on in-memory bodies.

use std::time::Duration;

use bytes::Bytes;
use http_body::Body;
use http_body_util::BodyExt;
use serde_json::Value;
use tokio::sync::mpsc;

use crate::backend::UpBody;
use crate::call::Call;
use crate::error::GatewayError;
use crate::sse::{Event, Splitter};
use crate::upstream::snippet;

/// Reads an upstream SSE body as whole events, watching the client side for disconnects.
pub(crate) struct UpstreamEvents<B> {
    body: B,
    splitter: Splitter,
    upstream: String,
    idle: Duration,
    max_event: usize,
    pending: std::collections::VecDeque<Event>,
    ended: bool,
    events: u64,
}

/// What the next read from the upstream brought.
pub(crate) enum Next {
    Event(Event),
    /// The upstream ended its body; leftovers were handled.
    End,
    Failed(GatewayError),
    ClientGone,
}

impl UpstreamEvents<UpBody> {
    /// A call's upstream body, read within its backend's timeout between two reads and the
    /// response size limit per event.
    pub(crate) fn of(call: &Call, body: UpBody) -> Self {
        UpstreamEvents::new(
            body,
            call.plan.upstream.clone(),
            call.state.backend.timeout(),
            call.state.cfg.limits.max_response_bytes,
        )
    }
}

impl<B> UpstreamEvents<B>
where
    B: Body<Data = Bytes> + Unpin,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    /// `upstream`: the backend, for errors; `idle`: the longest wait for each read;
    /// `max_event`: the largest event read.
    pub(crate) fn new(body: B, upstream: String, idle: Duration, max_event: usize) -> Self {
        UpstreamEvents {
            body,
            splitter: Splitter::default(),
            upstream,
            idle,
            max_event,
            pending: Default::default(),
            ended: false,
            events: 0,
        }
    }

    /// The next whole event; `tx` is the client's side: once it is closed the read ends as
    /// [`Next::ClientGone`].
    pub(crate) async fn next(&mut self, tx: &mpsc::Sender<Bytes>) -> Next {
        loop {
            if let Some(ev) = self.pending.pop_front() {
                self.events += 1;
                return Next::Event(ev);
            }
            if self.ended {
                return Next::End;
            }
            let frame = tokio::select! {
                f = tokio::time::timeout(self.idle, self.body.frame()) => f,
                _ = tx.closed() => return Next::ClientGone,
            };
            let chunk = match frame {
                Err(_) => {
                    return Next::Failed(GatewayError::UpstreamTimeout {
                        upstream: self.upstream.clone(),
                        secs: self.idle.as_secs(),
                    });
                }
                Ok(None) => {
                    self.ended = true;
                    if let Some(rest) = self.splitter.finish() {
                        if rest.is_done() {
                            self.pending.push_back(rest);
                        } else if rest.data.is_none() {
                            return Next::Failed(GatewayError::UpstreamInvalid {
                                upstream: self.upstream.clone(),
                                detail: format!(
                                    "the stream is not server-sent events: {}",
                                    snippet(&rest.raw)
                                ),
                            });
                        } else {
                            return Next::Failed(GatewayError::UpstreamStream {
                                upstream: self.upstream.clone(),
                                detail: format!(
                                    "the stream ended inside an event: {}",
                                    snippet(&rest.raw)
                                ),
                            });
                        }
                    }
                    continue;
                }
                Ok(Some(Err(e))) => {
                    return Next::Failed(GatewayError::UpstreamStream {
                        upstream: self.upstream.clone(),
                        detail: format!(
                            "the connection failed after {} events: {}",
                            self.events,
                            crate::upstream::error_chain(e.into().as_ref())
                        ),
                    });
                }
                Ok(Some(Ok(f))) => match f.into_data() {
                    Ok(d) => d,
                    Err(_) => continue,
                },
            };
            self.splitter.push(&chunk);
            loop {
                match self.splitter.next_event(self.max_event) {
                    Ok(Some(ev)) => self.pending.push_back(ev),
                    Ok(None) => break,
                    Err(e) => {
                        return Next::Failed(GatewayError::UpstreamInvalid {
                            upstream: self.upstream.clone(),
                            detail: e.to_string(),
                        });
                    }
                }
            }
        }
    }

    /// An event's data as JSON (None for `[DONE]` and events without data), or says the
    /// upstream sent something else.
    pub(crate) fn parsed(&self, ev: &Event) -> Result<Option<Value>, GatewayError> {
        match ev.data.as_deref() {
            Some(d) if !ev.is_done() => self.json(d).map(Some),
            _ => Ok(None),
        }
    }

    fn json(&self, data: &str) -> Result<Value, GatewayError> {
        serde_json::from_str(data).map_err(|_| GatewayError::UpstreamInvalid {
            upstream: self.upstream.clone(),
            detail: format!("an SSE event is not JSON: {}", snippet(data.as_bytes())),
        })
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::panic)]
    use std::pin::Pin;
    use std::task::{Context, Poll};

    use http_body::Frame;

    use super::*;

    type Chunk = Result<Bytes, std::io::Error>;

    /// An in-memory upstream body: each chunk sent on its channel is one frame; it is pending
    /// while none is there, and ends when every sender is gone.
    struct Chan(mpsc::UnboundedReceiver<Chunk>);

    impl Body for Chan {
        type Data = Bytes;
        type Error = std::io::Error;

        fn poll_frame(
            mut self: Pin<&mut Self>,
            cx: &mut Context<'_>,
        ) -> Poll<Option<Result<Frame<Bytes>, std::io::Error>>> {
            self.0.poll_recv(cx).map(|c| c.map(|c| c.map(Frame::data)))
        }
    }

    /// A body of these chunks; the sender keeps it open (drop it to end the body).
    fn body(chunks: &[&[u8]]) -> (mpsc::UnboundedSender<Chunk>, Chan) {
        let (tx, rx) = mpsc::unbounded_channel();
        for c in chunks {
            tx.send(Ok(Bytes::copy_from_slice(c))).unwrap();
        }
        (tx, Chan(rx))
    }

    const UPSTREAM: &str = "http://upstream.test";

    fn reader(body: Chan, idle: Duration) -> UpstreamEvents<Chan> {
        UpstreamEvents::new(body, UPSTREAM.into(), idle, 1 << 20)
    }

    /// The next read, or a failed test when the reader never returns (what it guards
    /// against is a read that waits forever).
    async fn next(up: &mut UpstreamEvents<Chan>, client: &mpsc::Sender<Bytes>) -> Next {
        tokio::time::timeout(Duration::from_secs(60), up.next(client))
            .await
            .unwrap_or_else(|_| panic!("the read never returned"))
    }

    /// Every event until the body's end; a failure or a client's leaving fails the test.
    async fn all_events(mut up: UpstreamEvents<Chan>) -> Vec<Event> {
        let (client, _open) = mpsc::channel(1);
        let mut out = vec![];
        loop {
            match next(&mut up, &client).await {
                Next::Event(ev) => out.push(ev),
                Next::End => return out,
                Next::Failed(e) => panic!("the read failed: {e}"),
                Next::ClientGone => panic!("the client is still there"),
            }
        }
    }

    /// Events split across frames at any byte (an `\r\n` pair, a `data:` prefix, a
    /// multi-byte character) read as the same events, their raw bytes unchanged; several
    /// events in one frame all come out; a `[DONE]` with no blank line after it still ends
    /// the stream.
    #[tokio::test]
    async fn a_stream_chopped_at_every_byte_reads_as_the_same_events() {
        let stream = "data: {\"a\":\"é\"}\n\nevent: delta\r\ndata: {\"b\":\r\ndata: 2}\r\n\r\n: keep-alive\n\ndata: [DONE]".as_bytes();
        let want_data = vec![
            Some("{\"a\":\"é\"}".to_string()),
            Some("{\"b\":\n2}".to_string()),
            None,
            Some("[DONE]".to_string()),
        ];
        let mut cuts: Vec<Vec<&[u8]>> = (0..=stream.len())
            .map(|k| vec![&stream[..k], &stream[k..]])
            .collect();
        cuts.push(stream.chunks(1).collect());
        for chunks in cuts {
            let (tx, b) = body(&chunks);
            drop(tx);
            let evs = all_events(reader(b, Duration::from_secs(3600))).await;
            let data: Vec<Option<String>> = evs.iter().map(|e| e.data.clone()).collect();
            assert_eq!(data, want_data, "frames {:?}", chunks.len());
            let raw: Vec<u8> = evs.iter().flat_map(|e| e.raw.to_vec()).collect();
            assert_eq!(raw, stream, "the raw bytes are relayed unchanged");
        }
    }

    /// A stream that ends inside an event failed; the error says so.
    #[tokio::test]
    async fn a_stream_cut_inside_an_event_is_the_upstreams_failure() {
        let (tx, b) = body(&[b"data: {\"a\":1}\n\ndata: {\"b\""]);
        drop(tx);
        let mut up = reader(b, Duration::from_secs(3600));
        let (client, _open) = mpsc::channel(1);
        assert!(matches!(next(&mut up, &client).await, Next::Event(_)));
        match next(&mut up, &client).await {
            Next::Failed(GatewayError::UpstreamStream { upstream, detail }) => {
                assert_eq!(upstream, UPSTREAM);
                assert!(detail.contains("ended inside an event"), "{detail}");
            }
            _ => panic!("a cut stream must fail as the upstream's"),
        }
    }

    /// An upstream that stops sending, between events or inside one, fails the read with
    /// the named timeout (504, a retry can help) instead of holding the call forever.
    #[tokio::test]
    async fn a_stalled_stream_fails_with_the_upstream_timeout() {
        for tail in [&b""[..], b"data: {\"b\""] {
            let (_open_upstream, b) = body(&[b"data: {\"a\":1}\n\n", tail]);
            let mut up = reader(b, Duration::from_millis(50));
            let (client, _open) = mpsc::channel(1);
            assert!(matches!(next(&mut up, &client).await, Next::Event(_)));
            match next(&mut up, &client).await {
                Next::Failed(e @ GatewayError::UpstreamTimeout { .. }) => {
                    assert!(e.to_string().contains(UPSTREAM), "{e}");
                    assert_eq!(e.status(), http::StatusCode::GATEWAY_TIMEOUT);
                }
                Next::Failed(e) => panic!("another error than the timeout: {e}"),
                _ => panic!("a stalled stream must time out"),
            }
        }
    }

    /// A client that goes away mid-stream ends the read at once, while the upstream is
    /// still open and silent (the relay then records the call as abandoned).
    #[tokio::test]
    async fn a_client_leaving_mid_stream_ends_the_read() {
        let (_open_upstream, b) = body(&[b"data: {\"a\":1}\n\n"]);
        let mut up = reader(b, Duration::from_secs(3600));
        let (client, client_side) = mpsc::channel(1);
        assert!(matches!(next(&mut up, &client).await, Next::Event(_)));
        drop(client_side);
        assert!(matches!(next(&mut up, &client).await, Next::ClientGone));
    }

    /// A connection that fails mid-stream is the upstream's failure, counted in events.
    #[tokio::test]
    async fn a_broken_connection_says_after_how_many_events() {
        let (tx, b) = body(&[b"data: {\"a\":1}\n\n"]);
        tx.send(Err(std::io::Error::other("connection reset")))
            .unwrap();
        let mut up = reader(b, Duration::from_secs(3600));
        let (client, _open) = mpsc::channel(1);
        assert!(matches!(next(&mut up, &client).await, Next::Event(_)));
        match next(&mut up, &client).await {
            Next::Failed(GatewayError::UpstreamStream { detail, .. }) => {
                assert!(detail.contains("after 1 events"), "{detail}");
                assert!(detail.contains("connection reset"), "{detail}");
            }
            _ => panic!("a broken connection must fail as the upstream's"),
        }
    }
}

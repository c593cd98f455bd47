//! Reading a request body whole, bounded in size and in time: a server that reads bodies
//! without a limit lets one hostile or broken client exhaust its memory, and one that waits
//! without a deadline lets a client that stops sending hold a task for ever.

use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, LengthLimitError, Limited};
use hyper::body::Body;

/// Why a body could not be read. The caller answers it in its own error shape: `TooLarge`
/// as 413, the others as 400 (`Display` names the fault and the limit).
#[derive(Debug)]
pub enum BodyError {
    /// The body is longer than `limit` bytes (read no further).
    TooLarge { limit: usize },
    /// The whole body did not arrive within `timeout`.
    TimedOut { timeout: Duration },
    /// The connection failed while the body was read (the error and its sources).
    Read(String),
}

impl std::fmt::Display for BodyError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            BodyError::TooLarge { limit } => {
                write!(
                    f,
                    "the request body is larger than this server's limit of {limit} bytes"
                )
            }
            BodyError::TimedOut { timeout } => write!(
                f,
                "the request body did not arrive within {} s",
                timeout.as_secs_f64()
            ),
            BodyError::Read(e) => write!(f, "the request body could not be read: {e}"),
        }
    }
}

impl std::error::Error for BodyError {}

/// The whole body, at most `limit` bytes, within `timeout`.
pub async fn read_body<B>(body: B, limit: usize, timeout: Duration) -> Result<Bytes, BodyError>
where
    B: Body,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    match tokio::time::timeout(timeout, Limited::new(body, limit).collect()).await {
        Err(_) => Err(BodyError::TimedOut { timeout }),
        Ok(Ok(c)) => Ok(c.to_bytes()),
        Ok(Err(e)) if e.is::<LengthLimitError>() => Err(BodyError::TooLarge { limit }),
        Ok(Err(e)) => Err(BodyError::Read(chain(e.as_ref()))),
    }
}

/// An error and its sources in one line, each source once (one whose text the line already
/// holds is not repeated).
fn chain(e: &(dyn std::error::Error + 'static)) -> String {
    let mut line = e.to_string();
    let mut source = e.source();
    while let Some(inner) = source {
        let text = inner.to_string();
        if !line.contains(&text) {
            line.push_str(": ");
            line.push_str(&text);
        }
        source = inner.source();
    }
    line
}

#[cfg(test)]
mod tests {
    use http_body_util::Full;

    use super::*;

    #[tokio::test]
    async fn a_body_past_the_limit_is_refused_and_one_within_it_read() {
        let body = Full::new(Bytes::from(vec![b'x'; 11]));
        let err = read_body(body, 10, Duration::from_secs(1))
            .await
            .unwrap_err();
        assert!(matches!(err, BodyError::TooLarge { limit: 10 }), "{err}");
        assert!(err.to_string().contains("10 bytes"), "{err}");
        let body = Full::new(Bytes::from(vec![b'x'; 10]));
        let got = read_body(body, 10, Duration::from_secs(1)).await;
        assert_eq!(got.map(|b| b.len()).ok(), Some(10));
        // No deadline at all (envd's uploads) is a timeout that never fires.
        let body = Full::new(Bytes::from(vec![b'x'; 3]));
        let got = read_body(body, 10, Duration::MAX).await;
        assert_eq!(got.map(|b| b.len()).ok(), Some(3));
    }

    #[tokio::test]
    async fn a_body_that_stops_arriving_times_out() {
        let err = read_body(Stalled, 10, Duration::from_millis(50))
            .await
            .unwrap_err();
        assert!(matches!(err, BodyError::TimedOut { .. }), "{err}");
    }

    /// A body whose first frame never comes.
    struct Stalled;

    impl Body for Stalled {
        type Data = Bytes;
        type Error = std::convert::Infallible;

        fn poll_frame(
            self: std::pin::Pin<&mut Self>,
            _: &mut std::task::Context<'_>,
        ) -> std::task::Poll<Option<Result<hyper::body::Frame<Bytes>, Self::Error>>> {
            std::task::Poll::Pending
        }
    }
}

//! The one HTTP accept loop of graft's servers (the gateway, envd, `graft serve`, the
//! scripted upstream): accept with a back-off, `TCP_NODELAY`, one hyper-util auto
//! (HTTP/1 + HTTP/2) connection per client, connection errors traced, graceful shutdown.
//!
//! The caller binds the listener (so it can report the bound address and its own bind
//! error), gives a handler (`Fn(Request) -> Future<Result<Response, E>>`, hyper's
//! `service_fn` shape) and a shutdown future. When that future resolves the listener is
//! closed and `serve` returns a [`Draining`]: the caller does its own shutdown work, then
//! `Draining::finish` tells the open connections to end their requests and waits for them
//! within a deadline. Dropping the `Draining` also tells them, without waiting.

pub mod auth;
mod body;

pub use body::{BodyError, read_body};

/// A JSON answer: `v` with `status` and `Content-Type: application/json`, in the server's
/// own body type (`body` makes it from the bytes, e.g. the server's `full`).
pub fn json_response<B>(
    status: hyper::StatusCode,
    v: &serde_json::Value,
    body: impl FnOnce(bytes::Bytes) -> B,
) -> Response<B> {
    let mut r = Response::new(body(bytes::Bytes::from(v.to_string())));
    *r.status_mut() = status;
    r.headers_mut().insert(
        hyper::header::CONTENT_TYPE,
        hyper::header::HeaderValue::from_static("application/json"),
    );
    r
}

/// Resolves on Ctrl-C or SIGTERM: the shutdown future of graft's command-line servers.
pub async fn shutdown_signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        _ = ctrl_c => {},
        _ = term => {},
    }
}

use std::error::Error as StdError;
use std::future::Future;
use std::net::SocketAddr;
use std::time::Duration;

use hyper::body::{Body, Incoming};
use hyper::service::service_fn;
use hyper::{Request, Response};
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto;
use hyper_util::server::graceful::GracefulShutdown;
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::{TcpListener, TcpStream};
use tracing::{debug, warn};

type BoxError = Box<dyn StdError + Send + Sync>;

/// How long the loop waits after a failed `accept` (out of file descriptors and the like)
/// before it tries again, instead of spinning.
const ACCEPT_BACKOFF: Duration = Duration::from_millis(20);

/// The address of the client a request came from, in every request's extensions (for
/// limits kept per client, such as the viewer's login attempts).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Peer(pub SocketAddr);

/// How a server's connections are run.
#[derive(Debug, Clone, Copy)]
pub struct Options {
    name: &'static str,
    header_read_timeout: Option<Duration>,
}

impl Options {
    /// `name` labels the server's log lines (`server = "gateway"`).
    pub fn new(name: &'static str) -> Self {
        Self {
            name,
            header_read_timeout: None,
        }
    }

    /// How long an HTTP/1 client may take to send a request's head before the connection
    /// is closed (slow-loris guard). Without it, hyper waits as long as the client does.
    pub fn header_read_timeout(mut self, timeout: Duration) -> Self {
        self.header_read_timeout = Some(timeout);
        self
    }
}

/// The server after its listener closed: its connections are still open.
pub struct Draining {
    graceful: GracefulShutdown,
}

impl Draining {
    /// How many connections are still open.
    pub fn open(&self) -> usize {
        self.graceful.count()
    }

    /// Tells every open connection to finish its request in flight and close (HTTP/1: no
    /// more keep-alive; HTTP/2: GOAWAY), and waits for them up to `within`. Returns
    /// whether they all closed in time; those that did not are left to end on their own.
    pub async fn finish(self, within: Duration) -> bool {
        tokio::time::timeout(within, self.graceful.shutdown())
            .await
            .is_ok()
    }
}

/// A request handler: hyper's `service_fn` shape (`Fn(Request) -> Future<Output =
/// Result<Response, E>>`, an `Err` aborting the connection), cloned into each connection.
/// Every such closure is one.
pub trait Handler: Clone + Send + 'static {
    type Body: Body<Data: Send, Error: Into<BoxError>> + Send + 'static;
    type Error: Into<BoxError>;
    type Future: Future<Output = Result<Response<Self::Body>, Self::Error>> + Send + 'static;

    fn call(&self, req: Request<Incoming>) -> Self::Future;
}

impl<H, F, B, E> Handler for H
where
    H: Fn(Request<Incoming>) -> F + Clone + Send + 'static,
    F: Future<Output = Result<Response<B>, E>> + Send + 'static,
    E: Into<BoxError>,
    B: Body<Data: Send, Error: Into<BoxError>> + Send + 'static,
{
    type Body = B;
    type Error = E;
    type Future = F;

    fn call(&self, req: Request<Incoming>) -> F {
        self(req)
    }
}

/// Serves plain HTTP on `listener` with `handler` until `shutdown` resolves.
pub async fn serve(
    listener: TcpListener,
    options: Options,
    handler: impl Handler,
    shutdown: impl Future<Output = ()>,
) -> Draining {
    serve_with(
        listener,
        options,
        |stream, _peer| std::future::ready(Some(stream)),
        handler,
        shutdown,
    )
    .await
}

/// [`serve`] with a handshake run on each accepted connection, in that connection's own
/// task (so a slow client holds up no other): it turns the TCP stream into the stream HTTP
/// is spoken over (the gateway's TLS), or gives `None` to drop the connection (it logs why).
pub async fn serve_with<T, TF, IO>(
    listener: TcpListener,
    options: Options,
    handshake: T,
    handler: impl Handler,
    shutdown: impl Future<Output = ()>,
) -> Draining
where
    T: Fn(TcpStream, SocketAddr) -> TF + Clone + Send + 'static,
    TF: Future<Output = Option<IO>> + Send + 'static,
    IO: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let mut builder = auto::Builder::new(TokioExecutor::new());
    if let Some(timeout) = options.header_read_timeout {
        builder
            .http1()
            .timer(TokioTimer::new())
            .header_read_timeout(timeout)
            .keep_alive(true);
    }
    let graceful = GracefulShutdown::new();
    let name = options.name;
    tokio::pin!(shutdown);
    loop {
        let (stream, peer) = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok(conn) => conn,
                Err(e) => {
                    warn!(server = name, error = %e, "accept failed");
                    tokio::time::sleep(ACCEPT_BACKOFF).await;
                    continue;
                }
            },
            () = &mut shutdown => break,
        };
        let _ = stream.set_nodelay(true);
        let builder = builder.clone();
        let watcher = graceful.watcher();
        let handshake = handshake.clone();
        let handler = handler.clone();
        tokio::spawn(async move {
            let Some(io) = handshake(stream, peer).await else {
                return;
            };
            let conn = builder
                .serve_connection(
                    TokioIo::new(io),
                    service_fn(move |mut req: Request<Incoming>| {
                        req.extensions_mut().insert(Peer(peer));
                        handler.call(req)
                    }),
                )
                .into_owned();
            // Client disconnects, resets and timed-out heads: the client's doing, not ours.
            if let Err(e) = watcher.watch(conn).await {
                debug!(server = name, %peer, error = %e, "connection ended with an error");
            }
        });
    }
    drop(listener);
    Draining { graceful }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

    use std::convert::Infallible;
    use std::sync::Arc;

    use bytes::Bytes;
    use http_body_util::{BodyExt, Empty, Full};
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::sync::{Notify, oneshot};

    use super::*;

    async fn bound() -> (TcpListener, SocketAddr) {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        (listener, addr)
    }

    async fn echo_path(req: Request<Incoming>) -> Result<Response<Full<Bytes>>, Infallible> {
        Ok(Response::new(Full::new(Bytes::from(
            req.uri().path().to_owned(),
        ))))
    }

    /// One HTTP/1 request with `Connection: close`; the whole answer as text.
    async fn get(addr: SocketAddr, path: &str) -> String {
        let mut s = TcpStream::connect(addr).await.unwrap();
        s.write_all(
            format!("GET {path} HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n").as_bytes(),
        )
        .await
        .unwrap();
        let mut out = String::new();
        s.read_to_string(&mut out).await.unwrap();
        out
    }

    #[tokio::test]
    async fn answers_http1_then_closes_the_listener_on_shutdown() {
        let (listener, addr) = bound().await;
        let (stop, stopped) = oneshot::channel::<()>();
        let server = tokio::spawn(serve(listener, Options::new("test"), echo_path, async {
            let _ = stopped.await;
        }));
        let answer = get(addr, "/hello").await;
        assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
        assert!(answer.ends_with("/hello"), "{answer}");
        stop.send(()).unwrap();
        let draining = server.await.unwrap();
        assert!(
            TcpStream::connect(addr).await.is_err(),
            "the listener is closed once shutdown resolved"
        );
        assert!(draining.finish(Duration::from_secs(30)).await);
    }

    #[tokio::test]
    async fn answers_http2_with_prior_knowledge() {
        let (listener, addr) = bound().await;
        let server = tokio::spawn(serve(
            listener,
            Options::new("test").header_read_timeout(Duration::from_secs(30)),
            echo_path,
            std::future::pending(),
        ));
        let io = TokioIo::new(TcpStream::connect(addr).await.unwrap());
        let (mut send, conn) = hyper::client::conn::http2::handshake(TokioExecutor::new(), io)
            .await
            .unwrap();
        tokio::spawn(conn);
        let req = Request::get("http://t/two")
            .body(Empty::<Bytes>::new())
            .unwrap();
        let resp = send.send_request(req).await.unwrap();
        assert_eq!(resp.version(), hyper::Version::HTTP_2);
        let body = resp.into_body().collect().await.unwrap().to_bytes();
        assert_eq!(&body[..], b"/two");
        server.abort();
    }

    #[tokio::test]
    async fn a_request_in_flight_finishes_during_the_drain() {
        let (listener, addr) = bound().await;
        let entered = Arc::new(Notify::new());
        let release = Arc::new(Notify::new());
        let handler = {
            let (entered, release) = (entered.clone(), release.clone());
            move |_req: Request<Incoming>| {
                let (entered, release) = (entered.clone(), release.clone());
                async move {
                    entered.notify_one();
                    release.notified().await;
                    Ok::<_, Infallible>(Response::new(Full::new(Bytes::from_static(b"late"))))
                }
            }
        };
        let (stop, stopped) = oneshot::channel::<()>();
        let server = tokio::spawn(serve(listener, Options::new("test"), handler, async {
            let _ = stopped.await;
        }));
        let client = tokio::spawn(get(addr, "/slow"));
        entered.notified().await;
        stop.send(()).unwrap();
        let draining = server.await.unwrap();
        assert_eq!(
            draining.open(),
            1,
            "the request in flight keeps its connection"
        );
        let drained = tokio::spawn(draining.finish(Duration::from_secs(60)));
        release.notify_one();
        let answer = client.await.unwrap();
        assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
        assert!(answer.ends_with("late"), "{answer}");
        assert!(
            drained.await.unwrap(),
            "the drain ends once the answer is out"
        );
    }

    #[tokio::test]
    async fn a_refused_handshake_drops_the_connection_and_the_server_goes_on() {
        let (listener, addr) = bound().await;
        let handshake = |stream: TcpStream, _peer| async move {
            let mut first = [0u8; 1];
            match stream.peek(&mut first).await {
                Ok(1) if first[0] == b'G' => Some(stream),
                _ => None,
            }
        };
        let server = tokio::spawn(serve_with(
            listener,
            Options::new("test"),
            handshake,
            echo_path,
            std::future::pending(),
        ));
        let mut s = TcpStream::connect(addr).await.unwrap();
        s.write_all(b"POST / HTTP/1.1\r\nHost: t\r\n\r\n")
            .await
            .unwrap();
        let mut out = Vec::new();
        // The server closes with the request unread, which may reach us as a reset.
        let _ = s.read_to_end(&mut out).await;
        assert!(out.is_empty(), "refused: no answer, {out:?}");
        let answer = get(addr, "/after").await;
        assert!(answer.ends_with("/after"), "{answer}");
        server.abort();
    }
}

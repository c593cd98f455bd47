//! The listener (plain TCP or rustls), the router, the session API, and the layer that turns
//! every error into OpenAI's error body and logs it once.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use graft_http::auth::{bearer, same_key};
use graft_recorder::{Recorder, RecorderConfig, RecoveryReport, SessionLog};
use http::{HeaderMap, HeaderValue, Method, Request, Response, StatusCode, header};
use hyper::body::Incoming;
use serde_json::{Value, json};
use tokio::net::TcpListener;
use tracing::{debug, error, info, warn};

use crate::backend::Backend;
use crate::body::{GBody, full};
use crate::config::{DurabilityMode, GatewayConfig};
use crate::error::{Cause, GatewayError};
use crate::limits::Limits;
use crate::metrics::{ErrorLabels, Metrics, RequestLabels};
use crate::pipeline::{self, read_body};
use crate::route::{Route, SESSION_ID_RULE, valid_session_id};
use crate::sessions::{CreateRequest, Session, Sessions};
use crate::state::State;

#[derive(Debug, thiserror::Error)]
pub enum StartError {
    #[error("cannot open the recorder in {dir}: {source}")]
    Recorder {
        dir: String,
        source: graft_recorder::RecorderError,
    },
    #[error(
        "the recorder in {dir} could not flush and seal at shutdown: {source}; what it acknowledged is in its WAL and is sealed on the next start"
    )]
    Shutdown {
        dir: String,
        source: graft_recorder::RecorderError,
    },
    #[error("cannot listen on {addr}: {source}")]
    Bind {
        addr: SocketAddr,
        source: std::io::Error,
    },
    #[error(transparent)]
    Open(crate::config::ConfigError),
    #[error(transparent)]
    AdminKey(#[from] crate::admin_key::AdminKeyError),
    #[error("the viewer could not start: {0}")]
    Viewer(String),
    #[error("TLS set-up failed: {0}")]
    Tls(String),
    #[error(transparent)]
    Backend(#[from] crate::backend::BackendSetupError),
    #[error(transparent)]
    Gateway(#[from] GatewayError),
}

/// A bound, ready gateway. `serve` runs it until the shutdown future resolves.
pub struct Gateway {
    state: Arc<State>,
    listener: TcpListener,
    tls: Option<tokio_rustls::TlsAcceptor>,
    recovery: RecoveryReport,
}

impl Gateway {
    pub async fn bind(mut cfg: GatewayConfig) -> Result<Self, StartError> {
        // Closed by default, also for configs built in code (`graft rl`, tests).
        cfg.auth
            .check_listen("the gateway", cfg.server.listen)
            .map_err(StartError::Open)?;
        let metrics = Metrics::new();
        let m = metrics.clone();
        let rs = &cfg.recorder;
        let mut rc = RecorderConfig::new(&rs.data_dir);
        rc.durability = match rs.durability {
            DurabilityMode::Sync => graft_recorder::Durability::Sync,
            DurabilityMode::Async => graft_recorder::Durability::Async {
                max_delay: rs.async_max_delay,
            },
        };
        rc.queue_capacity = rs.queue_capacity;
        rc.segment_max_bytes = rs.segment_max_bytes;
        rc.seal_after = rs.seal_after;
        rc.max_base_sessions = rs.delta_base_sessions;
        rc.preallocate = rs.wal_preallocate;
        rc.on_fsync = Some(Arc::new(move |d, n| m.observe_fsync(d, n)));
        let dir = rs.data_dir.display().to_string();
        let (recorder, recovery) =
            Recorder::open(rc)
                .await
                .map_err(|source| StartError::Recorder {
                    dir: dir.clone(),
                    source,
                })?;
        let (log, events) = SessionLog::open(&rs.data_dir)
            .map_err(|source| StartError::Recorder { dir, source })?;
        // No admin key set: one generated into the data dir, so that no request without it
        // (on loopback either) is an admin. Only the loudly named opt-out leaves it open.
        if cfg.auth.admin_key.is_none() && !cfg.auth.insecure_open_admin {
            let key = crate::admin_key::load_or_create(&rs.data_dir)?;
            let file = crate::admin_key::path(&rs.data_dir);
            info!(file = %file.display(), "no auth.admin_key set: the admin API and /ui take the key in this file");
            cfg.auth.admin_key = Some(key);
            cfg.auth.admin_key_file = Some(file);
        }
        let rs = &cfg.recorder;
        let sessions = Sessions::new(
            log,
            events,
            &recovery.sessions,
            cfg.sessions.default_session.clone(),
        );
        let backend = Backend::new(&cfg)?;
        if let Some(exact) = backend.exact() {
            exact.check_backends();
            exact.restore(rs.data_dir.clone(), sessions.open_ids());
            for (id, url) in sessions.open_backends() {
                if let Err(e) = exact.pin(&id, &url) {
                    warn!(session = %id, backend = %url, error = %e, "a session's own backend could not be restored; the gateway picks one");
                }
            }
        }
        let l = &cfg.limits;
        let limits = Limits::new(
            l.global_rps,
            l.session_rps,
            l.burst,
            l.max_concurrent_upstream,
            l.upstream_queue_timeout,
        );
        let tls = match &cfg.server.tls {
            Some(t) => Some(tls_acceptor(&t.cert, &t.key)?),
            None => None,
        };
        let listener = TcpListener::bind(cfg.server.listen)
            .await
            .map_err(|source| StartError::Bind {
                addr: cfg.server.listen,
                source,
            })?;
        let tokenizer_dir = match &cfg.backend {
            crate::config::BackendConfig::Sglang(e) => Some(e.model_dir.clone()),
            crate::config::BackendConfig::OpenAi(_) => None,
        };
        // Exact mode knows the tokenizer: sample pages then show text (ids without it).
        let viewer = match tokenizer_dir
            .as_deref()
            .map(|d| graft_viewer::Viewer::new(&rs.data_dir, None, Some(d), "/ui"))
        {
            Some(Ok(v)) => v,
            _ => graft_viewer::Viewer::new(&rs.data_dir, None, None, "/ui")
                .map_err(|e| StartError::Viewer(e.to_string()))?,
        };
        let retries =
            crate::retries::Retries::new(cfg.limits.retries).with_metrics(metrics.clone());
        let ui_login = cfg
            .auth
            .admin_key
            .as_deref()
            .map(|k| graft_viewer::login::Login::new(k, "/ui"));
        let viewer = viewer.keyed(ui_login.is_some());
        let state = Arc::new(State {
            ui_login,
            retries,
            cfg,
            recorder,
            sessions,
            limits,
            metrics,
            backend,
            viewer: Arc::new(viewer),
        });
        Ok(Gateway {
            state,
            listener,
            tls,
            recovery,
        })
    }

    pub fn local_addr(&self) -> Option<SocketAddr> {
        self.listener.local_addr().ok()
    }

    pub fn url(&self) -> String {
        let scheme = if self.tls.is_some() { "https" } else { "http" };
        match self.local_addr() {
            Some(a) => format!("{scheme}://{a}"),
            None => format!("{scheme}://{}", self.state.cfg.server.listen),
        }
    }

    pub fn recovery(&self) -> &RecoveryReport {
        &self.recovery
    }

    /// The key the admin API (`/graft/*`) and `/ui` take: `auth.admin_key`, or the one
    /// generated into `<data_dir>/admin.key`; `None` only under `insecure_open_admin`.
    pub fn admin_key(&self) -> Option<&str> {
        self.state.cfg.auth.admin_key.as_deref()
    }

    pub fn recorder(&self) -> Recorder {
        self.state.recorder.clone()
    }

    /// Serves until `shutdown` resolves, then drains connections (up to 30 s) and flushes
    /// and seals the recorder.
    pub async fn serve(
        self,
        shutdown: impl std::future::Future<Output = ()>,
    ) -> Result<(), StartError> {
        let Gateway {
            state,
            listener,
            tls,
            ..
        } = self;
        let housekeeping = {
            let state = state.clone();
            tokio::spawn(async move {
                let mut tick = tokio::time::interval(Duration::from_secs(60));
                loop {
                    tick.tick().await;
                    state.limits.housekeeping();
                }
            })
        };
        let options = graft_http::Options::new("gateway")
            .header_read_timeout(state.cfg.server.header_timeout);
        let handler = {
            let state = state.clone();
            move |req| {
                let state = state.clone();
                async move { Ok::<_, Infallible>(route(state, req).await) }
            }
        };
        let draining = match tls {
            None => graft_http::serve(listener, options, handler, shutdown).await,
            Some(acceptor) => {
                let handshake_timeout = state.cfg.server.header_timeout;
                let handshake = move |stream, peer: SocketAddr| {
                    let acceptor = acceptor.clone();
                    async move {
                        match tokio::time::timeout(handshake_timeout, acceptor.accept(stream)).await
                        {
                            Ok(Ok(s)) => Some(s),
                            Ok(Err(e)) => {
                                debug!(%peer, error = %e, "TLS handshake failed");
                                None
                            }
                            Err(_) => {
                                debug!(%peer, "TLS handshake timed out");
                                None
                            }
                        }
                    }
                };
                graft_http::serve_with(listener, options, handshake, handler, shutdown).await
            }
        };
        info!("shutting down: draining connections");
        if !draining.finish(Duration::from_secs(30)).await {
            warn!("connections still open after 30 s; closing them");
        }
        housekeeping.abort();
        state
            .recorder
            .shutdown()
            .await
            .map_err(|source| StartError::Shutdown {
                dir: state.cfg.recorder.data_dir.display().to_string(),
                source,
            })?;
        info!("recorder flushed and sealed");
        Ok(())
    }
}

fn tls_acceptor(
    cert: &std::path::Path,
    key: &std::path::Path,
) -> Result<tokio_rustls::TlsAcceptor, StartError> {
    use rustls::pki_types::pem::PemObject;
    use rustls::pki_types::{CertificateDer, PrivateKeyDer};
    let certs = CertificateDer::pem_file_iter(cert)
        .and_then(|it| it.collect::<Result<Vec<_>, _>>())
        .map_err(|e| {
            StartError::Tls(format!(
                "cannot read certificates from {}: {e}",
                cert.display()
            ))
        })?;
    if certs.is_empty() {
        return Err(StartError::Tls(format!(
            "{} holds no PEM certificate",
            cert.display()
        )));
    }
    let key = PrivateKeyDer::from_pem_file(key).map_err(|e| {
        StartError::Tls(format!(
            "cannot read a private key from {}: {e}",
            key.display()
        ))
    })?;
    let config = rustls::ServerConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .map_err(|e| StartError::Tls(e.to_string()))?
    .with_no_client_auth()
    .with_single_cert(certs, key)
    .map_err(|e| StartError::Tls(format!("certificate and key do not fit together: {e}")))?;
    let mut config = config;
    config.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
    Ok(tokio_rustls::TlsAcceptor::from(Arc::new(config)))
}

/// Routes one request and turns any error into OpenAI's error body.
async fn route(state: Arc<State>, req: Request<Incoming>) -> Response<GBody> {
    let t0 = Instant::now();
    let (route, label, result) = dispatch(&state, req, t0).await;
    let resp = match result {
        Ok(r) => r,
        Err(e) => {
            let cause = e.cause();
            match cause {
                Cause::Client => debug!(error = %e, "request refused"),
                Cause::Upstream => warn!(error = %e, "upstream failure"),
                Cause::Graft => error!(error = %e, "graft failure"),
            }
            state
                .metrics
                .errors
                .get_or_create(&ErrorLabels {
                    cause: cause.as_str(),
                    code: e.code(),
                })
                .inc();
            // The error body in the client's own dialect.
            let mut r: Response<GBody> = e.to_response();
            if let Some(kind) = route.and_then(Route::dialect) {
                *r.body_mut() = full(Bytes::from(
                    crate::dialect::dialect(kind).error_body(&e).to_string(),
                ));
            }
            r
        }
    };
    state
        .metrics
        .requests
        .get_or_create(&RequestLabels {
            route: label,
            status: resp.status().as_u16(),
        })
        .inc();
    resp
}

async fn dispatch(
    state: &Arc<State>,
    req: Request<Incoming>,
    t0: Instant,
) -> (
    Option<Route>,
    &'static str,
    Result<Response<GBody>, GatewayError>,
) {
    let path = req.uri().path().to_string();
    let method = req.method().clone();
    match path.as_str() {
        "/healthz" => {
            // Ready once the listener serves (the tokenizer and template are loaded before
            // it binds) and, in exact mode, the token histories are rebuilt.
            let body = match state.backend.exact() {
                Some(e) if !e.is_ready() => json_response(
                    StatusCode::SERVICE_UNAVAILABLE,
                    &json!({"status": "starting", "reason": "exact mode is rebuilding token histories from the records; calls wait until it is done"}),
                ),
                _ => json_response(StatusCode::OK, &json!({"status": "ok"})),
            };
            return (None, "healthz", Ok(body));
        }
        "/metrics" => {
            state
                .metrics
                .queue_depth
                .set(state.recorder.queue_depth() as i64);
            let mut r = Response::new(full(state.metrics.encode()));
            r.headers_mut().insert(
                header::CONTENT_TYPE,
                HeaderValue::from_static(
                    "application/openmetrics-text; version=1.0.0; charset=utf-8",
                ),
            );
            return (None, "metrics", Ok(r));
        }
        _ => {}
    }
    if path == "/graft/sessions" || path.starts_with("/graft/sessions/") {
        return (None, "sessions", admin(state, req, &path).await);
    }
    if path == "/ui" || path.starts_with("/ui/") {
        return (None, "ui", ui(state, req, &path).await);
    }
    if path.starts_with("/graft/backend/") {
        return (None, "backend", backend_admin(state, req, &path).await);
    }
    let (url_session, rest) = match path.strip_prefix("/s/") {
        Some(r) => match r.split_once('/') {
            Some((s, rest)) => (Some(s.to_string()), format!("/{rest}")),
            None => (Some(r.to_string()), String::new()),
        },
        None => (None, path.clone()),
    };
    // Connectivity probes: Claude Code sends `HEAD <base url>` (the session root, no `/v1`)
    // before its first call; answer the roots a client may probe instead of a 404.
    if matches!(rest.as_str(), "" | "/" | "/v1" | "/v1/")
        && (method == Method::HEAD || method == Method::GET)
    {
        return (
            None,
            "probe",
            Ok(json_response(
                StatusCode::OK,
                &json!({"status": "ok", "service": "graft gateway"}),
            )),
        );
    }
    let Some(route) = Route::from_path(&rest) else {
        return (
            None,
            "unknown",
            Err(GatewayError::NotFound {
                method: method.to_string(),
                path,
            }),
        );
    };
    let expected = if route == Route::Models {
        Method::GET
    } else {
        Method::POST
    };
    if route == Route::Responses && method == Method::GET {
        // Codex tries a WebSocket upgrade on GET /v1/responses first; refusing it at once
        // makes it fall back to POST + SSE.
        return (Some(route), route.label(), Ok(websocket_refusal()));
    }
    if method != expected {
        return (
            Some(route),
            route.label(),
            Err(GatewayError::MethodNotAllowed {
                method: method.to_string(),
                path,
            }),
        );
    }
    let (parts, body) = req.into_parts();
    let result = async {
        let session = resolve_session(state, url_session, &parts.headers).await?;
        state.limits.check(&session.id)?;
        pipeline::handle(state.clone(), route, session, parts.headers, body, t0).await
    }
    .await;
    (Some(route), route.label(), result)
}

fn websocket_refusal() -> Response<GBody> {
    let body = json!({"error": {
        "message": "graft serves the Responses API over HTTP POST with server-sent events, not WebSocket; use POST /v1/responses",
        "type": "invalid_request_error",
        "code": "websocket_not_supported",
        "param": null,
    }});
    let mut r = json_response(StatusCode::UPGRADE_REQUIRED, &body);
    r.headers_mut()
        .insert(header::CONNECTION, HeaderValue::from_static("close"));
    r
}

/// Which session a call belongs to: the URL prefix, then `x-graft-session`, then a session
/// key, then the default session. A session named by the URL or the header that has its own
/// key needs that key (or the admin key); the default session and auto-created sessions have
/// none, so a call without a key reaches only them.
async fn resolve_session(
    state: &State,
    url_session: Option<String>,
    headers: &HeaderMap,
) -> Result<Arc<Session>, GatewayError> {
    let key = bearer(headers).filter(|k| !k.is_empty());
    let key_session = key.and_then(|k| state.sessions.by_key(k));
    let named = match url_session {
        Some(s) => Some(s),
        None => match headers.get("x-graft-session") {
            Some(v) => Some(
                v.to_str()
                    .map_err(|_| {
                        GatewayError::field(
                            "x-graft-session",
                            "the x-graft-session header is not valid text",
                        )
                    })?
                    .trim()
                    .to_string(),
            ),
            None => None,
        },
    };
    if let Some(n) = &named
        && !valid_session_id(n)
    {
        return Err(GatewayError::field(
            "session",
            format!("session id '{n}' must be {SESSION_ID_RULE}"),
        ));
    }
    let admin = is_admin(state, key);
    if state.cfg.auth.require_client_key && key_session.is_none() && !admin {
        match key {
            None => {
                return Err(GatewayError::Unauthorized(
                    "missing API key; send 'Authorization: Bearer <key>' with a session key from POST /graft/sessions or a configured client key".into(),
                ));
            }
            Some(k) if !state.cfg.auth.client_keys.iter().any(|c| same_key(c, k)) => {
                // Never echoed, not even in part: a refused key may be a real secret
                // sent to the wrong place.
                return Err(GatewayError::Unauthorized(
                    "the API key sent is not valid for this gateway; use a session key from POST /graft/sessions or a configured client key".into(),
                ));
            }
            Some(_) => {}
        }
    }
    let session = match (named, key_session) {
        (Some(n), Some(ks)) if ks.id != n => {
            return Err(GatewayError::Forbidden(format!(
                "the API key belongs to session '{}', not to session '{n}'",
                ks.id
            )));
        }
        (Some(n), ks) => match state.sessions.get(&n) {
            // A session with its own key answers only that key (or the admin key): a
            // harness that dropped its key cannot call into another's session.
            Some(s) if s.keyed && ks.is_none() && !admin => {
                return Err(GatewayError::Unauthorized(format!(
                    "session '{n}' takes only its own API key (the api_key of POST /graft/sessions); {}",
                    if key.is_some() {
                        "the key sent is not it"
                    } else {
                        "send it as 'Authorization: Bearer <key>'"
                    }
                )));
            }
            Some(s) => s,
            None if state.cfg.sessions.auto_create => state.sessions.auto_create(&n).await?,
            None => return Err(GatewayError::UnknownSession(n)),
        },
        (None, Some(ks)) => ks,
        (None, None) => state.sessions.default_session()?,
    };
    if session.is_closed() {
        return Err(GatewayError::SessionClosed(session.id.clone()));
    }
    Ok(session)
}

fn json_response(status: StatusCode, v: &Value) -> Response<GBody> {
    graft_http::json_response(status, v, full)
}

/// The one check in front of every admin route (`/graft/*`) and viewer page (`/ui`): a
/// request without the admin key is refused (401), on every address. The admin key is
/// `auth.admin_key`, or the one the gateway generated into `<data_dir>/admin.key`; only
/// `auth.insecure_open_admin` leaves the surface open. A session's own key is never an admin
/// key (403), so a harness cannot read other sessions, post rewards or pause backends.
pub fn check_admin(state: &State, headers: &HeaderMap, what: &str) -> Result<(), GatewayError> {
    let key = bearer(headers).filter(|k| !k.is_empty());
    let admin = state.cfg.auth.admin_key.as_deref();
    if let Some(k) = key
        && !admin.is_some_and(|a| same_key(k, a))
        && state.sessions.by_key(k).is_some()
    {
        return Err(GatewayError::Forbidden(format!(
            "{what} is not open to session keys: a session's key reaches only its own /v1 calls; use the admin key ({})",
            admin_key_hint(state)
        )));
    }
    if let Some(admin) = admin {
        match key {
            None => {
                return Err(GatewayError::Unauthorized(format!(
                    "{what} needs the admin key: send 'Authorization: Bearer <admin key>' ({})",
                    admin_key_hint(state)
                )));
            }
            Some(k) if !same_key(k, admin) => {
                return Err(GatewayError::Unauthorized(format!(
                    "that key is not the admin key; {what} needs 'Authorization: Bearer <admin key>' ({})",
                    admin_key_hint(state)
                )));
            }
            Some(_) => {}
        }
    }
    Ok(())
}

/// Where the admin key is, for refusals: the setting, or the file it was generated into.
fn admin_key_hint(state: &State) -> String {
    match &state.cfg.auth.admin_key_file {
        Some(f) => format!(
            "no auth.admin_key is set, so the gateway generated one: it is in {} on the gateway's machine",
            f.display()
        ),
        None => "auth.admin_key".into(),
    }
}

/// Whether the request carries the admin key.
fn is_admin(state: &State, key: Option<&str>) -> bool {
    match (key, state.cfg.auth.admin_key.as_deref()) {
        (Some(k), Some(a)) => same_key(k, a),
        _ => false,
    }
}

/// The viewer's pages under `/ui`, behind the admin key like every admin route, with the
/// browser login `graft view` has (`graft_viewer::login`: `POST /ui/login` with the key
/// through a form, rate limited per client, sets an HttpOnly, SameSite=Strict cookie for
/// `/ui`; `POST /ui/logout` ends it); `Authorization: Bearer <admin key>` works too, a
/// session's key never (403). Refusals are viewer pages too (a browser's dialect is HTML).
/// Pages run no script and load nothing from elsewhere.
async fn ui(
    state: &Arc<State>,
    req: Request<Incoming>,
    path: &str,
) -> Result<Response<GBody>, GatewayError> {
    let viewer = state.viewer.clone();
    let answer = |a: graft_viewer::login::Answer| {
        let mut r = page_response(a.page);
        for (name, value) in a.headers {
            if let Ok(v) = HeaderValue::from_str(&value) {
                r.headers_mut().insert(name, v);
            }
        }
        Ok(r)
    };
    match (
        check_admin(state, req.headers(), "the viewer (/ui)"),
        &state.ui_login,
    ) {
        // A session's key: 403, never the login form.
        (Err(e @ GatewayError::Forbidden(_)), _) => {
            return Ok(page_response(
                viewer.error_page(e.status().as_u16(), &e.to_string()),
            ));
        }
        (_, Some(login)) => {
            let cookies: Vec<&str> = req
                .headers()
                .get_all(header::COOKIE)
                .iter()
                .filter_map(|v| v.to_str().ok())
                .collect();
            let step = login.step(
                &viewer,
                graft_viewer::login::Request {
                    method: req.method().as_str(),
                    path,
                    path_and_query: req.uri().path_and_query().map_or(path, |pq| pq.as_str()),
                    cookies: &cookies,
                    bearer: bearer(req.headers()).filter(|k| !k.is_empty()),
                },
            );
            match step {
                graft_viewer::login::Step::ReadForm => {
                    let peer = req.extensions().get::<graft_http::Peer>().map(|p| p.0.ip());
                    let body = read_body(
                        req.into_body(),
                        graft_viewer::login::MAX_FORM_BYTES,
                        state.cfg.limits.body_timeout,
                    )
                    .await?;
                    return answer(login.post_form(&viewer, &body, peer));
                }
                graft_viewer::login::Step::Answer(a) => return answer(a),
                graft_viewer::login::Step::Page => {}
            }
        }
        (Err(e), None) => {
            return Ok(page_response(
                viewer.error_page(e.status().as_u16(), &e.to_string()),
            ));
        }
        (Ok(()), None) => {}
    }
    if req.method() != Method::GET && req.method() != Method::HEAD {
        let e = GatewayError::MethodNotAllowed {
            method: req.method().to_string(),
            path: path.to_string(),
        };
        return Ok(page_response(
            viewer.error_page(e.status().as_u16(), &e.to_string()),
        ));
    }
    let sub = path.trim_start_matches("/ui").to_string();
    let query = req.uri().query().unwrap_or("").to_string();
    let page = tokio::task::spawn_blocking(move || viewer.page(&sub, &query))
        .await
        .map_err(|e| GatewayError::Internal(format!("the viewer task failed: {e}")))?;
    Ok(page_response(page))
}

/// A viewer page as a response, with the viewer's headers.
fn page_response(page: graft_viewer::Page) -> Response<GBody> {
    let mut r = Response::new(full(Bytes::from(page.body)));
    *r.status_mut() =
        StatusCode::from_u16(page.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    let h = r.headers_mut();
    h.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static(page.content_type),
    );
    for (name, value) in graft_viewer::RESPONSE_HEADERS {
        h.insert(name, HeaderValue::from_static(value));
    }
    r
}

/// Exact mode's backend control, for weight updates: `POST /graft/backend/pause` holds new
/// calls and returns once the calls in flight are done; `POST /graft/backend/resume` lets
/// them go; both take an optional `{"backend": URL}` to act on one backend (calls pinned to
/// the others go on); resume takes an optional `"weight_version"`, the version pushed while
/// the backend was paused, recorded on its answers that report none; `GET /graft/backend/status` says which backends there are and which
/// are paused.
async fn backend_admin(
    state: &State,
    req: Request<Incoming>,
    path: &str,
) -> Result<Response<GBody>, GatewayError> {
    check_admin(state, req.headers(), "the backend API")?;
    let Some(ex) = state.backend.exact() else {
        return Err(GatewayError::field(
            "mode",
            "/graft/backend/* is for exact mode (the gateway calls the backend itself); this gateway runs in passthrough mode",
        ));
    };
    let method = req.method().clone();
    // `{"backend": URL}` picks one backend; no body, `{}` or no such key: all of them.
    let mut weight_version: Option<String> = None;
    let target = if method == Method::POST {
        let body = read_body(req.into_body(), 64 * 1024, state.cfg.limits.body_timeout).await?;
        let v: Value = if body.iter().all(u8::is_ascii_whitespace) {
            Value::Null
        } else {
            serde_json::from_slice(&body)
                .map_err(|e| GatewayError::InvalidJson(format!("backend control body: {e}")))?
        };
        weight_version = match v.get("weight_version") {
            None | Some(Value::Null) => None,
            Some(Value::String(w)) if !w.is_empty() => Some(w.clone()),
            Some(other) => {
                return Err(GatewayError::field(
                    "weight_version",
                    format!("'weight_version' must be a non-empty string, got {other}"),
                ));
            }
        };
        match v.get("backend") {
            None | Some(Value::Null) => None,
            Some(Value::String(url)) => Some(ex.backend_index(url).ok_or_else(|| {
                GatewayError::field(
                    "backend",
                    format!(
                        "'{url}' is not one of this gateway's exact-mode backends: {}",
                        ex.backends().join(", ")
                    ),
                )
            })?),
            Some(other) => {
                return Err(GatewayError::field(
                    "backend",
                    format!("'backend' must be a backend URL (a string), got {other}"),
                ));
            }
        }
    } else {
        None
    };
    let which = target
        .and_then(|i| ex.backends().get(i).cloned())
        .unwrap_or_else(|| "all".into());
    match (method, path) {
        (Method::POST, "/graft/backend/pause") => {
            let waited = ex.pause(target).await;
            info!(
                backend = %which,
                waited_ms = waited.as_millis() as u64,
                "exact mode paused: new calls wait"
            );
            Ok(json_response(
                StatusCode::OK,
                &json!({"paused": true, "backend": which, "drained_in_ms": waited.as_secs_f64() * 1e3}),
            ))
        }
        (Method::POST, "/graft/backend/resume") => {
            let resumed = ex.resume(target, weight_version.clone()).await?;
            info!(backend = %which, resumed = ?resumed, weight_version = ?weight_version, "exact mode resumed");
            Ok(json_response(
                StatusCode::OK,
                &json!({"paused": false, "backend": which, "was_paused": !resumed.is_empty(),
                        "resumed": resumed, "weight_version": weight_version}),
            ))
        }
        (Method::GET, "/graft/backend/status") => {
            let paused = ex.paused_backends().await;
            Ok(json_response(
                StatusCode::OK,
                &json!({"paused": !paused.is_empty(), "paused_backends": paused, "backends": ex.backends()}),
            ))
        }
        (m, _) => Err(GatewayError::NotFound {
            method: m.to_string(),
            path: path.to_string(),
        }),
    }
}

/// The session API under `/graft/sessions`, behind the admin key when one is configured.
/// `{"reward": number, "info"?: any}` of a reward post.
fn reward_body(v: Value) -> Result<(f64, Value), GatewayError> {
    let reward = v
        .get("reward")
        .ok_or_else(|| GatewayError::field("reward", "'reward' is required"))?;
    let reward = reward.as_f64().ok_or_else(|| {
        GatewayError::field("reward", format!("'reward' must be a number, got {reward}"))
    })?;
    Ok((reward, v.get("info").cloned().unwrap_or(Value::Null)))
}

async fn admin(
    state: &State,
    req: Request<Incoming>,
    path: &str,
) -> Result<Response<GBody>, GatewayError> {
    check_admin(state, req.headers(), "the session API")?;
    let method = req.method().clone();
    let rest = path
        .trim_start_matches("/graft/sessions")
        .trim_start_matches('/');
    let segments: Vec<&str> = if rest.is_empty() {
        vec![]
    } else {
        rest.split('/').collect()
    };
    let host = req
        .headers()
        .get(header::HOST)
        .and_then(|h| h.to_str().ok())
        .map(str::to_string);
    let body = read_body(req.into_body(), 1024 * 1024, state.cfg.limits.body_timeout).await?;
    let parse = |what: &str| -> Result<Value, GatewayError> {
        if body.iter().all(u8::is_ascii_whitespace) {
            return Ok(Value::Null);
        }
        serde_json::from_slice(&body).map_err(|e| GatewayError::InvalidJson(format!("{what}: {e}")))
    };
    match (method, segments.as_slice()) {
        (Method::POST, []) => {
            let v = parse("session create body")?;
            let mut creq: CreateRequest = if v.is_null() {
                CreateRequest::default()
            } else {
                serde_json::from_value(v).map_err(|e| {
                    GatewayError::field("", format!("invalid session create body: {e}"))
                })?
            };
            if let Some(url) = creq.backend.take() {
                if state.backend.exact().is_none() {
                    return Err(GatewayError::field(
                        "backend",
                        "a session names its own backend in exact mode only (this gateway forwards to its upstream)",
                    ));
                }
                creq.backend = Some(crate::backend::sglang::check_backend_url(&url)?);
            }
            let branch = match creq.branch_of.take() {
                Some(b) => Some(open_branch(state, b).await?),
                None => None,
            };
            let (session, key) = state.sessions.create(creq, branch).await?;
            if let (Some(url), Some(ex)) = (&session.backend, state.backend.exact()) {
                ex.pin(&session.id, url)?;
            }
            let base = match (&state.cfg.server.public_url, host) {
                (Some(u), _) => u.clone(),
                (None, Some(h)) => format!(
                    "{}://{h}",
                    if state.cfg.server.tls.is_some() {
                        "https"
                    } else {
                        "http"
                    }
                ),
                (None, None) => format!("http://{}", state.cfg.server.listen),
            };
            info!(session = %session.id, group = ?session.group_id, "session created");
            Ok(json_response(
                StatusCode::CREATED,
                &json!({
                    "session_id": session.id,
                    "group_id": session.group_id,
                    "base_url": format!("{base}/s/{}/v1", session.id),
                    "api_key": key,
                }),
            ))
        }
        (Method::GET, []) => Ok(json_response(
            StatusCode::OK,
            &json!({"sessions": state.sessions.list()}),
        )),
        (Method::GET, [id]) => {
            let s = state
                .sessions
                .get(id)
                .ok_or_else(|| GatewayError::UnknownSession(id.to_string()))?;
            Ok(json_response(StatusCode::OK, &s.view()))
        }
        (Method::POST, [id, "reward"]) => {
            let (reward, info) = reward_body(parse("reward body")?)?;
            let s = state.sessions.reward(id, reward, info).await?;
            Ok(json_response(StatusCode::OK, &s.view()))
        }
        (Method::POST, [id, "calls", call_id, "reward"]) => {
            let (reward, info) = reward_body(parse("reward body")?)?;
            let s = state
                .sessions
                .call_reward(id, call_id, reward, info)
                .await?;
            Ok(json_response(StatusCode::OK, &s.view()))
        }
        (Method::POST, [id, "sampling"]) => {
            let v = parse("sampling body")?;
            let policy: Option<crate::policy::SamplingPolicy> = if v.is_null() {
                None
            } else {
                Some(serde_json::from_value(v).map_err(|e| {
                    GatewayError::field("sampling", format!("invalid sampling policy: {e}"))
                })?)
            };
            let s = state.sessions.set_sampling(id, policy).await?;
            info!(session = %s.id, sampling = ?s.sampling(), "session sampling policy set");
            Ok(json_response(StatusCode::OK, &s.view()))
        }
        (Method::POST, [id, "close"]) => {
            let s = state.sessions.close(id).await?;
            state.recorder.forget_session(id);
            state.backend.forget(id);
            state.retries.forget(id);
            Ok(json_response(StatusCode::OK, &s.view()))
        }
        (m, _) => Err(GatewayError::NotFound {
            method: m.to_string(),
            path: path.to_string(),
        }),
    }
}

/// The branch a session create asks for, from its parent's records (made durable and read
/// through the recorder's reader first, off the reactor).
async fn open_branch(
    state: &State,
    req: crate::branch::BranchOf,
) -> Result<crate::branch::Branch, GatewayError> {
    if state.sessions.get(&req.session).is_none() {
        let shown: String = req.session.chars().take(80).collect();
        return Err(GatewayError::field(
            "branch_of.session",
            format!("'branch_of.session' names no session of this gateway: '{shown}'"),
        ));
    }
    state
        .recorder
        .flush()
        .await
        .map_err(|e| GatewayError::Record(e.to_string()))?;
    let dir = state.cfg.recorder.data_dir.clone();
    let parent = req.session.clone();
    let records = tokio::task::spawn_blocking(move || graft_recorder::read_session(&dir, &parent))
        .await
        .map_err(|e| GatewayError::Internal(format!("the records task failed: {e}")))?
        .map_err(|e| GatewayError::Record(e.to_string()))?;
    crate::branch::Branch::open(req, records, state.backend.exact().is_some())
}

//! `graft view`: the viewer's pages (`graft-viewer`) over a data dir and optionally an RL
//! run, on their own listener. Closed by default like the gateway: beyond loopback it needs
//! an admin key (from the environment) or the loudly named `--insecure-open-admin`.

use std::convert::Infallible;
use std::io::Write;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;

use anyhow::{Context, bail};
use bytes::Bytes;
use graft_http::auth::{bearer, same_key};
use http::{HeaderValue, Method, Request, Response, StatusCode, header};
use http_body_util::Full;

#[derive(Debug, clap::Args)]
pub struct ViewArgs {
    /// The recorder's data dir (the gateway's `recorder.data_dir`; `graft rl` uses OUT/data).
    #[arg(long)]
    pub data_dir: PathBuf,
    /// A `graft rl` output dir: its steps.jsonl and samples/ (run, group and sample pages).
    #[arg(long)]
    pub run: Option<PathBuf>,
    /// Address to listen on (port 0 picks a free port; the real address is printed).
    #[arg(long, default_value = "127.0.0.1:8401")]
    pub listen: SocketAddr,
    /// A model dir whose tokenizer.json shows sample tokens as text.
    #[arg(long)]
    pub model_dir: Option<PathBuf>,
    /// The environment variable holding the admin key; when it is set, every page needs
    /// `Authorization: Bearer <key>`.
    #[arg(long, default_value = "GRAFT_ADMIN_KEY")]
    pub admin_key_env: String,
    /// Listen beyond loopback with no admin key: anyone who can reach the port reads every
    /// recorded call.
    #[arg(long)]
    pub insecure_open_admin: bool,
}

pub async fn run(a: ViewArgs) -> anyhow::Result<()> {
    let key = std::env::var(&a.admin_key_env)
        .ok()
        .filter(|k| !k.is_empty());
    if !a.listen.ip().is_loopback() && key.is_none() && !a.insecure_open_admin {
        bail!(
            "graft view refuses to listen on {} (beyond loopback) without an admin key: anyone who can reach it could read every recorded call. Export {} with a long random secret (e.g. `export {}=$(openssl rand -hex 32)`) and send it as 'Authorization: Bearer <key>', or listen on 127.0.0.1, or, if the network itself is trusted, pass --insecure-open-admin",
            a.listen,
            a.admin_key_env,
            a.admin_key_env
        );
    }
    let viewer =
        graft_viewer::Viewer::new(&a.data_dir, a.run.as_deref(), a.model_dir.as_deref(), "")?;
    let listener = tokio::net::TcpListener::bind(a.listen)
        .await
        .with_context(|| format!("cannot listen on {}; pick another --listen", a.listen))?;
    let addr = listener.local_addr().context("the bound address")?;
    {
        let mut out = std::io::stdout().lock();
        writeln!(out, "graft view listening on http://{addr}")?;
        out.flush()?;
    }
    let state = Arc::new((viewer, key));
    let handler = move |req| {
        let state = Arc::clone(&state);
        async move { Ok::<_, Infallible>(handle(&state, req).await) }
    };
    graft_http::serve(
        listener,
        graft_http::Options::new("view"),
        handler,
        crate::cli::shutdown_signal(),
    )
    .await;
    Ok(())
}

fn respond(page: graft_viewer::Page) -> Response<Full<Bytes>> {
    let mut r = Response::new(Full::new(Bytes::from(page.body)));
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

/// Answers one request: the admin key first (when one is set), GET only, then the page.
/// Refusals are viewer pages that say why (a browser's dialect is HTML).
async fn handle<B>(
    state: &Arc<(graft_viewer::Viewer, Option<String>)>,
    req: Request<B>,
) -> Response<Full<Bytes>> {
    let (viewer, key) = &**state;
    if let Some(key) = key {
        let sent = bearer(req.headers()).filter(|k| !k.is_empty());
        let reason = match sent {
            None => Some("the viewer needs the admin key: send 'Authorization: Bearer <key>'"),
            Some(s) if !same_key(s, key) => Some(
                "that key is not the admin key; the viewer needs 'Authorization: Bearer <key>'",
            ),
            Some(_) => None,
        };
        if let Some(reason) = reason {
            let mut r = respond(viewer.error_page(401, reason));
            r.headers_mut()
                .insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
            return r;
        }
    }
    if req.method() != Method::GET && req.method() != Method::HEAD {
        let mut r = respond(viewer.error_page(
            405,
            &format!("the viewer answers GET only, not {}", req.method()),
        ));
        r.headers_mut()
            .insert(header::ALLOW, HeaderValue::from_static("GET, HEAD"));
        return r;
    }
    let path = req.uri().path().to_string();
    let query = req.uri().query().unwrap_or("").to_string();
    let st = Arc::clone(state);
    match tokio::task::spawn_blocking(move || st.0.page(&path, &query)).await {
        Ok(p) => respond(p),
        Err(e) => respond(viewer.error_page(500, &format!("the page failed: {e}"))),
    }
}

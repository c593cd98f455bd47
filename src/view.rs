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
use http::{HeaderValue, Method, Request, Response, StatusCode, header};
use http_body_util::Full;
use hyper_util::rt::{TokioExecutor, TokioIo};

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
    let builder = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new());
    let shutdown = crate::cli::shutdown_signal();
    tokio::pin!(shutdown);
    loop {
        let accepted = tokio::select! {
            accepted = listener.accept() => accepted,
            _ = &mut shutdown => return Ok(()),
        };
        let Ok((stream, _)) = accepted else {
            tokio::time::sleep(std::time::Duration::from_millis(20)).await;
            continue;
        };
        let state = Arc::clone(&state);
        let builder = builder.clone();
        tokio::spawn(async move {
            let service = hyper::service::service_fn(move |req| {
                let state = Arc::clone(&state);
                async move { Ok::<_, Infallible>(handle(&state, req).await) }
            });
            let _ = builder
                .serve_connection(TokioIo::new(stream), service)
                .await;
        });
    }
}

fn text(status: StatusCode, msg: &str) -> Response<Full<Bytes>> {
    let mut r = Response::new(Full::new(Bytes::from(format!("{msg}\n"))));
    *r.status_mut() = status;
    r.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/plain; charset=utf-8"),
    );
    r
}

async fn handle<B>(
    state: &Arc<(graft_viewer::Viewer, Option<String>)>,
    req: Request<B>,
) -> Response<Full<Bytes>> {
    if let Some(key) = &state.1 {
        let sent = req
            .headers()
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .map(|v| v.trim().trim_start_matches("Bearer ").trim());
        let ok = sent.is_some_and(|s| {
            s.len() == key.len()
                && s.bytes()
                    .zip(key.bytes())
                    .fold(0u8, |acc, (x, y)| acc | (x ^ y))
                    == 0
        });
        if !ok {
            let mut r = text(
                StatusCode::UNAUTHORIZED,
                "the viewer needs the admin key: send 'Authorization: Bearer <key>'",
            );
            r.headers_mut()
                .insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
            return r;
        }
    }
    if req.method() != Method::GET && req.method() != Method::HEAD {
        return text(
            StatusCode::METHOD_NOT_ALLOWED,
            "the viewer answers GET only",
        );
    }
    let path = req.uri().path().to_string();
    let query = req.uri().query().unwrap_or("").to_string();
    let st = Arc::clone(state);
    let page = match tokio::task::spawn_blocking(move || st.0.page(&path, &query)).await {
        Ok(p) => p,
        Err(e) => return text(StatusCode::INTERNAL_SERVER_ERROR, &format!("{e}")),
    };
    let mut r = Response::new(Full::new(Bytes::from(page.body)));
    *r.status_mut() =
        StatusCode::from_u16(page.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    let h = r.headers_mut();
    h.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static(page.content_type),
    );
    h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
    h.insert(
        header::CONTENT_SECURITY_POLICY,
        HeaderValue::from_static("default-src 'none'; style-src 'unsafe-inline'; img-src data:"),
    );
    r
}

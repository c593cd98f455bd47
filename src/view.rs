//! `graft view`: the viewer's pages (`graft-viewer`) over a data dir, optionally an RL run
//! and samples files, on their own listener. Closed by default like the gateway: every page
//! needs an admin key, from the environment, else the data dir's own `admin.key` (the one a
//! gateway without `auth.admin_key` generated there; `graft view` writes it the same way
//! when there is none), on loopback too; only the loudly named `--insecure-open-admin` opens
//! it. Beyond loopback the key must come from the environment. With a key, a browser logs in through a form (`POST /login`,
//! rate limited per client, which sets an HttpOnly, SameSite=Strict cookie holding a random
//! token of that login, never the key; `POST /logout` ends it: `graft_viewer::login`, which
//! the gateway's `/ui` shares); `Authorization: Bearer <key>` works too.

use std::convert::Infallible;
use std::io::Write;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;

use anyhow::{Context, bail};
use bytes::Bytes;
use graft_http::auth::bearer;
use graft_viewer::login::{self, Login};
use http::{HeaderValue, Method, Request, Response, StatusCode, header};
use http_body_util::{BodyExt, Full, Limited};

#[derive(Debug, clap::Args)]
pub struct ViewArgs {
    /// The recorder's data dir (the gateway's `recorder.data_dir`; `graft rl` uses OUT/data).
    #[arg(long)]
    pub data_dir: PathBuf,
    /// A `graft rl` output dir: its steps.jsonl and samples/ (run, group and sample pages).
    #[arg(long)]
    pub run: Option<PathBuf>,
    /// A samples file written by `graft reconstruct --out FILE` (repeat for more). The
    /// *.parquet files at the top of the data dir and in its samples/ folder are shown
    /// without it.
    #[arg(long = "samples", value_name = "FILE")]
    pub samples: Vec<PathBuf>,
    /// Address to listen on (port 0 picks a free port; the real address is printed).
    #[arg(long, default_value = "127.0.0.1:8401")]
    pub listen: SocketAddr,
    /// A model dir whose tokenizer.json shows sample tokens as text.
    #[arg(long)]
    pub model_dir: Option<PathBuf>,
    /// The environment variable holding the admin key; every page needs it: typed once into
    /// the login form (a browser), or sent as `Authorization: Bearer <key>`. Unset: the data
    /// dir's `admin.key` (the gateway's generated key; made there when missing).
    #[arg(long, default_value = "GRAFT_ADMIN_KEY")]
    pub admin_key_env: String,
    /// No admin key at all: anyone who can reach the port reads every recorded call.
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
    if !a.data_dir.is_dir() {
        bail!(
            "--data-dir {} is not a directory: name the gateway's recorder.data_dir (graft rl writes OUT/data)",
            a.data_dir.display()
        );
    }
    // On loopback with no key given: the data dir's own key, as the gateway keeps it.
    let key = match key {
        Some(k) => Some(k),
        None if a.insecure_open_admin => None,
        None => {
            let k = graft_gateway::admin_key::load_or_create(&a.data_dir).with_context(|| {
                format!(
                    "graft view needs an admin key: export {} or let it use the data dir's admin.key",
                    a.admin_key_env
                )
            })?;
            eprintln!(
                "graft view: every page needs the admin key in {} (a browser logs in with it once; scripts send 'Authorization: Bearer <key>')",
                graft_gateway::admin_key::path(&a.data_dir).display()
            );
            Some(k)
        }
    };
    if let Some(run) = a.run.as_deref().filter(|r| !r.is_dir()) {
        bail!(
            "--run {} is not a directory: name a graft rl output dir (it holds steps.jsonl and samples/)",
            run.display()
        );
    }
    let viewer =
        graft_viewer::Viewer::new(&a.data_dir, a.run.as_deref(), a.model_dir.as_deref(), "")?
            .with_samples(&a.samples)?
            .keyed(key.is_some());
    let listener = tokio::net::TcpListener::bind(a.listen)
        .await
        .with_context(|| format!("cannot listen on {}; pick another --listen", a.listen))?;
    let addr = listener.local_addr().context("the bound address")?;
    {
        let mut out = std::io::stdout().lock();
        writeln!(out, "graft view listening on http://{addr}")?;
        out.flush()?;
    }
    let state = Arc::new((viewer, key.as_deref().map(|k| Login::new(k, ""))));
    let handler = move |req| {
        let state = Arc::clone(&state);
        async move { Ok::<_, Infallible>(handle(&state, req).await) }
    };
    graft_http::serve(
        listener,
        graft_http::Options::new("view"),
        handler,
        graft_http::shutdown_signal(),
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

type State = (graft_viewer::Viewer, Option<Login>);

/// A login's answer (a login page, a refusal, a redirect) as a response.
fn answer(a: login::Answer) -> Response<Full<Bytes>> {
    let mut r = respond(a.page);
    for (name, value) in a.headers {
        if let Ok(v) = HeaderValue::from_str(&value) {
            r.headers_mut().insert(name, v);
        }
    }
    r
}

/// The body of `POST /login`, read up to `login::MAX_FORM_BYTES`, then the login's answer.
async fn post_login<B>(
    viewer: &graft_viewer::Viewer,
    login: &Login,
    req: Request<B>,
) -> Response<Full<Bytes>>
where
    B: hyper::body::Body,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    let peer = req.extensions().get::<graft_http::Peer>().map(|p| p.0.ip());
    match Limited::new(req.into_body(), login::MAX_FORM_BYTES)
        .collect()
        .await
    {
        Ok(b) => answer(login.post_form(viewer, &b.to_bytes(), peer)),
        Err(e) => {
            let mut r = respond(viewer.error_page(
                413,
                &format!(
                    "the login form could not be read ({e}); it is at most {} bytes",
                    login::MAX_FORM_BYTES
                ),
            ));
            r.headers_mut()
                .insert(header::CONNECTION, HeaderValue::from_static("close"));
            r
        }
    }
}

/// Answers one request: with a key set, the login first (`graft_viewer::login`: a login
/// cookie or a Bearer header, `POST /login` for the form, `POST /logout`), GET only, then
/// the page. Refusals are viewer pages that say why (a browser's dialect is HTML).
async fn handle<B>(state: &Arc<State>, req: Request<B>) -> Response<Full<Bytes>>
where
    B: hyper::body::Body,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    let (viewer, login) = &**state;
    if let Some(login) = login {
        let cookies: Vec<&str> = req
            .headers()
            .get_all(header::COOKIE)
            .iter()
            .filter_map(|v| v.to_str().ok())
            .collect();
        let step = login.step(
            viewer,
            login::Request {
                method: req.method().as_str(),
                path: req.uri().path(),
                path_and_query: req.uri().path_and_query().map_or("/", |pq| pq.as_str()),
                cookies: &cookies,
                bearer: bearer(req.headers()).filter(|k| !k.is_empty()),
            },
        );
        match step {
            login::Step::ReadForm => return post_login(viewer, login, req).await,
            login::Step::Answer(a) => return answer(a),
            login::Step::Page => {}
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

//! What exact mode checks of a backend before its first call. vLLM (`exact.wire = "vllm"`):
//! `GET /version`, a warning when it is older than 0.34 (no per-request weight versions).
//! SGLang: `GET /server_info`
//! (`/get_server_info` on servers older than the rename) tells its `version` and how it
//! streams. An SGLang older than [`MIN_VERSION`] is refused (each call to it answers 502
//! naming the version); one that streams cumulatively (started without
//! `--incremental-streaming-output`) is used with one warning, since every streamed event
//! then re-sends every id and logprob so far. `graft serve` says it is graft and is not
//! version-checked; a server with neither route is used as it is, with a warning.
//!
//! The check runs once per backend: at the gateway's start for the configured backends, and
//! before the first call of a backend a session named. A backend that cannot be reached is
//! checked again at its next call.

use std::time::Duration;

use bytes::Bytes;
use graft_wire::sglang::{MIN_VERSION, ServerInfo, parse_version, path};
use http::{Method, Request, StatusCode, header};
use http_body_util::{BodyExt, Full};
use tracing::{info, warn};

use crate::upstream::{HttpClient, error_chain, snippet};

/// What was learnt of a backend that answered.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Verdict {
    /// Calls go to it.
    Fine,
    /// Calls to it are refused with this reason.
    Refused(String),
}

/// How to ask: the client, the API key, how long to wait.
pub(crate) struct Asker<'a> {
    pub(crate) client: &'a HttpClient,
    pub(crate) key: Option<&'a str>,
    pub(crate) timeout: Duration,
}

/// Checks a backend of the given wire.
pub(crate) async fn check_wire(
    ask: &Asker<'_>,
    backend: &str,
    vllm: bool,
) -> Result<Verdict, String> {
    if vllm {
        check_vllm(ask, backend).await
    } else {
        check(ask, backend).await
    }
}

/// A vLLM backend: `GET /version`. Nothing is refused (vLLM ignores fields it does not
/// know); an older vLLM is used with a warning that its records' `weight_version` is null.
async fn check_vllm(ask: &Asker<'_>, backend: &str) -> Result<Verdict, String> {
    let (status, body) = get(
        ask,
        &format!("{backend}{}", graft_wire::vllm::path::VERSION),
    )
    .await?;
    if status == StatusCode::NOT_FOUND {
        warn!(
            backend,
            "exact mode: the backend has no GET /version: it is not vLLM (or not one graft knows); its version is not checked"
        );
        return Ok(Verdict::Fine);
    }
    if !status.is_success() {
        return Err(format!(
            "GET /version answered {status}: {}",
            snippet(&body)
        ));
    }
    let v = serde_json::from_slice::<serde_json::Value>(&body)
        .ok()
        .and_then(|v| v.get("version")?.as_str().map(str::to_string));
    match v.as_deref().map(|s| (s, parse_version(s))) {
        Some((s, Some(_))) if !graft_wire::vllm::reports_weight_versions(s) => warn!(
            backend,
            version = s,
            "exact mode: vLLM before 0.34 does not report which weights sampled each token (return_weight_versions): this backend's records carry the version of the last push graft drove with a drain (graft rl drains such a backend), none before"
        ),
        Some((s, _)) => info!(backend, version = s, "exact mode: backend checked"),
        None => warn!(
            backend,
            "exact mode: the backend's GET /version says no version; it is used unchecked"
        ),
    }
    Ok(Verdict::Fine)
}

/// Reads the backend's server info and judges it (logging one line where there is
/// something to say). Err when the backend cannot be reached or answers neither route
/// with 200 or 404 (checked again later).
pub(crate) async fn check(ask: &Asker<'_>, backend: &str) -> Result<Verdict, String> {
    let Some(info) = server_info(ask, backend).await? else {
        warn!(
            backend,
            "exact mode: the backend answers neither GET /server_info nor GET /get_server_info: it is not SGLang (or not one graft knows), so its version and streaming mode are not checked"
        );
        return Ok(Verdict::Fine);
    };
    let (verdict, warnings) = judge(&info);
    for w in warnings {
        warn!(backend, "exact mode: {w}");
    }
    match &verdict {
        Verdict::Refused(why) => {
            tracing::error!(
                backend,
                "exact mode: calls to this backend are refused: {why}"
            );
        }
        Verdict::Fine => info!(
            backend,
            version = info.version.as_deref().unwrap_or("unknown"),
            graft_serve = info.graft.unwrap_or(false),
            "exact mode: backend checked"
        ),
    }
    Ok(verdict)
}

/// The verdict on a server's info, and what to warn about.
pub(crate) fn judge(info: &ServerInfo) -> (Verdict, Vec<String>) {
    let mut warnings = vec![];
    if info.graft == Some(true) {
        return (Verdict::Fine, warnings);
    }
    let (want_major, want_minor, want_patch) = MIN_VERSION;
    let wanted = format!("{want_major}.{want_minor}.{want_patch}");
    match info.version.as_deref().map(|v| (v, parse_version(v))) {
        Some((v, Some(have))) if have < MIN_VERSION => {
            return (
                Verdict::Refused(format!(
                    "it runs SGLang {v}; graft needs {wanted} or newer (before it, /pause_generation ignores its mode and aborts every request in flight, so a weight push loses the calls it should keep): upgrade the server, or set exact.check_backends = false to call it anyway"
                )),
                warnings,
            );
        }
        Some((_, Some(_))) => {}
        Some((v, None)) => warnings.push(format!(
            "the backend reports version {v:?}, which does not read as an SGLang release; it is used unchecked (graft needs SGLang {wanted} or newer)"
        )),
        None => warnings.push(format!(
            "the backend reports no version; it is used unchecked (graft needs SGLang {wanted} or newer)"
        )),
    }
    if info.incremental_streaming_output == Some(false) {
        warnings.push(
            "the backend streams cumulatively (it was started without --incremental-streaming-output): every streamed event re-sends every id and logprob so far, O(n^2) bytes per call; restart it with --incremental-streaming-output".into(),
        );
    }
    (Verdict::Fine, warnings)
}

/// `GET /server_info`, else `GET /get_server_info`. Ok(None) when both are 404.
async fn server_info(ask: &Asker<'_>, backend: &str) -> Result<Option<ServerInfo>, String> {
    for route in [path::SERVER_INFO, path::GET_SERVER_INFO] {
        let (status, body) = get(ask, &format!("{backend}{route}")).await?;
        if status == StatusCode::NOT_FOUND {
            continue;
        }
        if !status.is_success() {
            return Err(format!("GET {route} answered {status}: {}", snippet(&body)));
        }
        return serde_json::from_slice::<ServerInfo>(&body)
            .map(Some)
            .map_err(|e| {
                format!(
                    "GET {route} is not SGLang's server info ({e}): {}",
                    snippet(&body)
                )
            });
    }
    Ok(None)
}

async fn get(ask: &Asker<'_>, url: &str) -> Result<(StatusCode, Bytes), String> {
    let mut req = Request::builder().method(Method::GET).uri(url);
    if let Some(k) = ask.key {
        req = req.header(header::AUTHORIZATION, format!("Bearer {k}"));
    }
    let req = req
        .body(Full::new(Bytes::new()))
        .map_err(|e| format!("cannot build GET {url}: {e}"))?;
    let fetch = async {
        let resp = ask.client.request(req).await.map_err(|e| error_chain(&e))?;
        let status = resp.status();
        let body = http_body_util::Limited::new(resp.into_body(), 4 << 20)
            .collect()
            .await
            .map_err(|e| error_chain(e.as_ref()))?
            .to_bytes();
        Ok::<_, String>((status, body))
    };
    tokio::time::timeout(ask.timeout, fetch)
        .await
        .map_err(|_| {
            format!(
                "GET {url} did not answer within {} s",
                ask.timeout.as_secs()
            )
        })?
}

#[cfg(test)]
mod tests {
    use super::*;

    fn info(version: Option<&str>, incremental: Option<bool>) -> ServerInfo {
        ServerInfo {
            version: version.map(str::to_string),
            incremental_streaming_output: incremental,
            ..ServerInfo::default()
        }
    }

    #[test]
    fn point4_an_sglang_older_than_the_minimum_is_refused() {
        let (v, _) = judge(&info(Some("0.5.5.post3"), Some(true)));
        let Verdict::Refused(why) = v else {
            panic!("0.5.5 should be refused, got {v:?}");
        };
        assert!(
            why.contains("0.5.5.post3") && why.contains("0.5.6"),
            "{why}"
        );
        assert_eq!(
            judge(&info(Some("0.5.6"), Some(true))),
            (Verdict::Fine, vec![])
        );
        assert_eq!(
            judge(&info(Some("0.5.23"), Some(true))),
            (Verdict::Fine, vec![])
        );
        // graft serve reports graft's own version: not judged as SGLang's.
        let serve = ServerInfo {
            graft: Some(true),
            ..info(Some("0.1.0"), Some(false))
        };
        assert_eq!(judge(&serve), (Verdict::Fine, vec![]));
    }

    #[test]
    fn point1_cumulative_streaming_is_warned_about_once_in_one_line() {
        let (v, w) = judge(&info(Some("0.5.23"), Some(false)));
        assert_eq!(v, Verdict::Fine);
        assert_eq!(w.len(), 1);
        assert!(w[0].contains("--incremental-streaming-output") && !w[0].contains('\n'));
        let (_, w) = judge(&info(None, Some(true)));
        assert!(w[0].contains("no version"), "{w:?}");
    }
}

//! A small real HTTP client for tests that need raw control (bad bytes, odd headers,
//! reading SSE as it was sent). The SDK-level tests use the real SDKs instead.

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use serde_json::Value;

pub struct Resp {
    pub status: u16,
    pub headers: http::HeaderMap,
    pub body: Bytes,
}

impl Resp {
    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).to_string()
    }

    pub fn json(&self) -> Value {
        serde_json::from_slice(&self.body)
            .unwrap_or_else(|e| panic!("not JSON ({e}): {}", self.text()))
    }

    pub fn header(&self, name: &str) -> Option<String> {
        self.headers
            .get(name)
            .and_then(|v| v.to_str().ok())
            .map(str::to_string)
    }

    /// The `data:` payloads of an SSE body, in order.
    pub fn sse_data(&self) -> Vec<String> {
        self.text()
            .split("\n\n")
            .filter_map(|ev| {
                let lines: Vec<&str> = ev
                    .lines()
                    .filter_map(|l| l.strip_prefix("data: "))
                    .collect();
                (!lines.is_empty()).then(|| lines.join("\n"))
            })
            .collect()
    }
}

// -------------------------------------------------------------------------------------
// The keys the helpers carry
//
// A gateway closes its admin API and `/ui` behind a key (the one it generates into
// `<data_dir>/admin.key` when none is set), and a session made by `POST /graft/sessions`
// answers only its own key. Tests act as graft's local tools and orchestrators do: the
// gateway helpers read the admin key from the data dir, and a session's key is taken from
// the answer that created it. `send` then sends the key whose URL prefix matches, unless the
// caller sends a key of its own; [`send_bare`] sends none, for tests of the refusals.

static KEYS: std::sync::Mutex<Vec<(String, String)>> = std::sync::Mutex::new(Vec::new());

/// Sends `key` on every request to a URL that starts with `prefix` (the longest wins).
pub fn carry_key(prefix: &str, key: &str) {
    let mut keys = KEYS.lock().unwrap();
    keys.retain(|(p, _)| p != prefix);
    keys.push((prefix.to_string(), key.to_string()));
}

/// The key carried for `url`, if any.
pub fn carried_key(url: &str) -> Option<String> {
    KEYS.lock()
        .unwrap()
        .iter()
        .filter(|(p, _)| url.starts_with(p.as_str()))
        .max_by_key(|(p, _)| p.len())
        .map(|(_, k)| k.clone())
}

/// Carries the admin key of the gateway at `gateway_url` (its `/graft/*` and `/ui`).
pub fn carry_admin_key(gateway_url: &str, key: &str) {
    carry_key(&format!("{gateway_url}/graft/"), key);
    carry_key(&format!("{gateway_url}/ui"), key);
}

/// Carries the key of a session the gateway at `gateway_url` created (its `/s/{id}/` URLs).
pub fn carry_session_key(gateway_url: &str, session_id: &str, key: &str) {
    carry_key(&format!("{gateway_url}/s/{session_id}/"), key);
}

/// Carries the session keys known for the gateway at `from` to the gateway at `to` too (a
/// restart on the same data dir: the sessions and their keys come back there).
pub fn carry_session_keys_over(from: &str, to: &str) {
    let mut keys = KEYS.lock().unwrap();
    let old = format!("{from}/s/");
    let moved: Vec<(String, String)> = keys
        .iter()
        .filter_map(|(p, k)| {
            p.strip_prefix(&old)
                .map(|rest| (format!("{to}/s/{rest}"), k.clone()))
        })
        .collect();
    for (p, k) in moved {
        keys.retain(|(q, _)| *q != p);
        keys.push((p, k));
    }
}

/// The `Authorization` value carried for `url` (`Bearer <key>`), if any.
pub fn carried_auth(url: &str) -> Option<String> {
    carried_key(url).map(|k| format!("Bearer {k}"))
}

/// Sends the request with the key carried for its URL (see above) unless `headers` hold an
/// `authorization` or `x-api-key` of their own; a `201` from `POST …/graft/sessions` carries
/// the new session's key from then on.
pub async fn send(
    method: &str,
    url: &str,
    headers: &[(&str, &str)],
    body: Vec<u8>,
) -> Result<Resp, String> {
    let own = headers.iter().any(|(k, _)| {
        k.eq_ignore_ascii_case("authorization") || k.eq_ignore_ascii_case("x-api-key")
    });
    let carried = if own { None } else { carried_auth(url) };
    let mut all: Vec<(&str, &str)> = headers.to_vec();
    if let Some(a) = &carried {
        all.push(("authorization", a.as_str()));
    }
    let r = send_bare(method, url, &all, body).await?;
    if method == "POST"
        && r.status == 201
        && let Some(gw) = url.strip_suffix("/graft/sessions")
        && let Ok(v) = serde_json::from_slice::<Value>(&r.body)
        && let (Some(id), Some(key)) = (v["session_id"].as_str(), v["api_key"].as_str())
    {
        carry_session_key(gw, id, key);
    }
    Ok(r)
}

/// Sends exactly the headers given: no carried key.
pub async fn send_bare(
    method: &str,
    url: &str,
    headers: &[(&str, &str)],
    body: Vec<u8>,
) -> Result<Resp, String> {
    let client = Client::builder(TokioExecutor::new()).build_http::<Full<Bytes>>();
    let mut req = http::Request::builder().method(method).uri(url);
    for (k, v) in headers {
        req = req.header(*k, *v);
    }
    if !body.is_empty() {
        req = req.header("content-type", "application/json");
    }
    let req = req
        .body(Full::new(Bytes::from(body)))
        .map_err(|e| e.to_string())?;
    let resp = client.request(req).await.map_err(|e| format!("{e:?}"))?;
    let status = resp.status().as_u16();
    let headers = resp.headers().clone();
    let body = resp
        .into_body()
        .collect()
        .await
        .map_err(|e| format!("{e:?}"))?
        .to_bytes();
    Ok(Resp {
        status,
        headers,
        body,
    })
}

pub async fn try_post_json(
    url: &str,
    headers: &[(&str, &str)],
    body: &Value,
) -> Result<Resp, String> {
    send("POST", url, headers, body.to_string().into_bytes()).await
}

pub async fn post_json(url: &str, headers: &[(&str, &str)], body: &Value) -> Resp {
    try_post_json(url, headers, body)
        .await
        .unwrap_or_else(|e| panic!("POST {url} failed: {e}"))
}

pub async fn post_raw(url: &str, headers: &[(&str, &str)], body: Vec<u8>) -> Resp {
    send("POST", url, headers, body)
        .await
        .unwrap_or_else(|e| panic!("POST {url} failed: {e}"))
}

pub async fn get(url: &str, headers: &[(&str, &str)]) -> Resp {
    send("GET", url, headers, vec![])
        .await
        .unwrap_or_else(|e| panic!("GET {url} failed: {e}"))
}

/// POSTs JSON and returns as soon as the response head arrives; read the body with
/// [`next_sse_data`] to see events as they are sent.
pub async fn post_stream(url: &str, body: &Value) -> hyper::Response<hyper::body::Incoming> {
    let client = Client::builder(TokioExecutor::new()).build_http::<Full<Bytes>>();
    let mut req = http::Request::builder()
        .method("POST")
        .uri(url)
        .header("content-type", "application/json");
    if let Some(a) = carried_auth(url) {
        req = req.header("authorization", a);
    }
    let req = req.body(Full::new(Bytes::from(body.to_string()))).unwrap();
    client
        .request(req)
        .await
        .unwrap_or_else(|e| panic!("POST {url} failed: {e:?}"))
}

/// The next `data:` payload of an SSE body being read (`buf` keeps what arrived past it);
/// `None` at the end of the body.
pub async fn next_sse_data(body: &mut hyper::body::Incoming, buf: &mut String) -> Option<String> {
    loop {
        if let Some(at) = buf.find("\n\n") {
            let ev: String = buf.drain(..at + 2).collect();
            let data: Vec<&str> = ev
                .lines()
                .filter_map(|l| l.strip_prefix("data: "))
                .collect();
            if data.is_empty() {
                continue;
            }
            return Some(data.join("\n"));
        }
        match body.frame().await {
            Some(Ok(f)) => {
                if let Ok(d) = f.into_data() {
                    buf.push_str(&String::from_utf8_lossy(&d));
                }
            }
            _ => return None,
        }
    }
}

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

pub async fn send(
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
    let req = http::Request::builder()
        .method("POST")
        .uri(url)
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(body.to_string())))
        .unwrap();
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

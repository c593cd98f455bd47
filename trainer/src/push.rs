//! Pushing weights to an SGLang-compatible server: write an HF directory (HF names +
//! `config.json`), then `POST /pause_generation {"mode": "retract"}` (running requests go
//! back to the queue, none is aborted) → `POST /flush_cache` →
//! `POST /update_weights_from_disk {model_path, weight_version, load_format: "auto"}` →
//! `POST /continue_generation`. If a step fails after the pause, generation is continued
//! anyway before the error is returned, so a failed push never leaves the server paused.
//!
//! To vLLM ([`push_weights_vllm`], a server started with `VLLM_SERVER_DEV_MODE=1`, whose
//! development routes these are): `POST /pause?mode=keep` (every request is frozen where it
//! is, new ones are queued) → `POST /reset_prefix_cache?reset_running_requests=true` (the
//! running requests are preempted and will be recomputed from their tokens so far, under
//! the new weights; asked again while it answers `success: false`) → `POST /collective_rpc
//! {"method": "reload_weights", "kwargs": {"weights_path": DIR}}` → `POST
//! /update_weight_version {"new_version"}` → `POST /resume`; resumed on every path as well.
//! Older vLLMs get what their routes allow (see [`push_weights_vllm`]).
//!
//! A small blocking HTTP/1.1 client (plain `http://` only, one request per connection)
//! is enough for a few control calls and keeps the trainer free of an async runtime. The
//! bodies and the answers read are `graft-wire`'s SGLang and vLLM types.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpStream, ToSocketAddrs};
use std::path::Path;
use std::time::Duration;

use graft_wire::sglang::{
    self as wire, ContinueGenerationRequest, FlushCacheRequest, PauseGenerationRequest, PauseMode,
    UpdateWeightsFromDiskRequest, UpdateWeightsFromDiskResponse,
};

use graft_wire::vllm::{
    self as vwire, CollectiveRpcRequest, PauseMode as VllmPauseMode, ResetPrefixCacheResponse,
    UpdateWeightVersionRequest,
};

use crate::error::{Result, TrainerError};

/// A server's base URL, split.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ServerUrl {
    pub host: String,
    pub port: u16,
    /// Path prefix without a trailing slash ("" for none).
    pub prefix: String,
    raw: String,
    /// Sent as `Authorization: Bearer` (a server started with `--api-key` or
    /// `--admin-api-key`: its admin routes want the admin key when it has one).
    key: Option<String>,
}

impl ServerUrl {
    pub fn parse(url: &str) -> Result<ServerUrl> {
        let err = |problem: &str| TrainerError::Push {
            url: url.to_owned(),
            problem: problem.to_owned(),
        };
        let rest = url
            .strip_prefix("http://")
            .ok_or_else(|| err("only http:// URLs are supported for the weight push (run it next to the server or through a local tunnel)"))?;
        let (authority, path) = match rest.find('/') {
            Some(i) => (&rest[..i], &rest[i..]),
            None => (rest, ""),
        };
        let (host, port) = match authority.rsplit_once(':') {
            Some((h, p)) if !h.ends_with(']') || h.starts_with('[') => {
                let port = p
                    .parse::<u16>()
                    .map_err(|_| err("the port is not a number"))?;
                (
                    h.trim_start_matches('[').trim_end_matches(']').to_owned(),
                    port,
                )
            }
            _ => (authority.to_owned(), 80),
        };
        if host.is_empty() {
            return Err(err("the URL has no host"));
        }
        Ok(ServerUrl {
            host,
            port,
            prefix: path.trim_end_matches('/').to_owned(),
            raw: url.to_owned(),
            key: None,
        })
    }

    /// The same server, asked with `key`.
    pub fn with_key(mut self, key: Option<&str>) -> ServerUrl {
        self.key = key.map(str::to_owned);
        self
    }
}

/// A response: status and body.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Response {
    pub status: u16,
    pub body: String,
}

/// `POST {prefix}{path}` with a JSON body; reads the whole answer.
pub fn post_json(
    url: &ServerUrl,
    path: &str,
    body: &serde_json::Value,
    timeout: Duration,
) -> Result<Response> {
    exchange(url, "POST", path, Some(body), timeout)
}

fn exchange(
    url: &ServerUrl,
    method: &str,
    path: &str,
    body: Option<&serde_json::Value>,
    timeout: Duration,
) -> Result<Response> {
    let fail = |problem: String| TrainerError::Push {
        url: url.raw.clone(),
        problem,
    };
    let addr = (url.host.as_str(), url.port)
        .to_socket_addrs()
        .map_err(|e| fail(format!("cannot resolve {}: {e}", url.host)))?
        .next()
        .ok_or_else(|| fail(format!("{} resolves to no address", url.host)))?;
    let mut stream = TcpStream::connect_timeout(&addr, Duration::from_secs(10))
        .map_err(|e| fail(format!("cannot connect to {addr}: {e}; is the server up?")))?;
    stream
        .set_read_timeout(Some(timeout))
        .map_err(|e| fail(e.to_string()))?;
    stream
        .set_write_timeout(Some(timeout))
        .map_err(|e| fail(e.to_string()))?;
    let (body, content_type) = match body {
        Some(b) => (b.to_string(), "Content-Type: application/json\r\n"),
        None => (String::new(), ""),
    };
    let host = if url.host.contains(':') {
        format!("[{}]", url.host)
    } else {
        url.host.clone()
    };
    let auth = url
        .key
        .as_deref()
        .map(|k| format!("Authorization: Bearer {k}\r\n"))
        .unwrap_or_default();
    let req = format!(
        "{method} {}{} HTTP/1.1\r\nHost: {}:{}\r\n{auth}{content_type}Content-Length: {}\r\nConnection: close\r\n\r\n{}",
        url.prefix,
        path,
        host,
        url.port,
        body.len(),
        body
    );
    stream
        .write_all(req.as_bytes())
        .map_err(|e| fail(format!("sending {path}: {e}")))?;
    let mut reader = BufReader::new(stream);
    let mut line = String::new();
    reader
        .read_line(&mut line)
        .map_err(|e| fail(format!("reading the answer to {path}: {e}")))?;
    let status = line
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse::<u16>().ok())
        .ok_or_else(|| fail(format!("{path} answered '{}', not HTTP", line.trim())))?;
    let mut chunked = false;
    let mut length: Option<usize> = None;
    loop {
        line.clear();
        reader
            .read_line(&mut line)
            .map_err(|e| fail(format!("reading headers of {path}: {e}")))?;
        let l = line.trim();
        if l.is_empty() {
            break;
        }
        if let Some((k, v)) = l.split_once(':') {
            let (k, v) = (k.trim().to_ascii_lowercase(), v.trim());
            if k == "transfer-encoding" && v.eq_ignore_ascii_case("chunked") {
                chunked = true;
            } else if k == "content-length" {
                length = v.parse().ok();
            }
        }
    }
    let mut bytes = Vec::new();
    if chunked {
        loop {
            line.clear();
            reader
                .read_line(&mut line)
                .map_err(|e| fail(e.to_string()))?;
            let size = usize::from_str_radix(line.trim().split(';').next().unwrap_or("0"), 16)
                .map_err(|_| fail(format!("bad chunk size '{}' from {path}", line.trim())))?;
            if size == 0 {
                break;
            }
            let mut chunk = vec![0; size + 2];
            reader
                .read_exact(&mut chunk)
                .map_err(|e| fail(e.to_string()))?;
            chunk.truncate(size);
            bytes.extend(chunk);
        }
    } else if let Some(n) = length {
        bytes.resize(n, 0);
        reader
            .read_exact(&mut bytes)
            .map_err(|e| fail(format!("reading the body of {path}: {e}")))?;
    } else {
        reader
            .read_to_end(&mut bytes)
            .map_err(|e| fail(e.to_string()))?;
    }
    Ok(Response {
        status,
        body: String::from_utf8_lossy(&bytes).into_owned(),
    })
}

fn expect_ok(url: &ServerUrl, path: &str, r: Response) -> Result<Response> {
    if (200..300).contains(&r.status) {
        Ok(r)
    } else {
        Err(TrainerError::Push {
            url: url.raw.clone(),
            problem: format!("{path} answered {}: {}", r.status, r.body.trim()),
        })
    }
}

/// Tells the server at `url` to load the HF directory `model_path` (a path the server
/// can read) as `weight_version`, pausing generation around the swap. `key`: the server's
/// admin key (else its API key) when it was started with one.
pub fn push_weights(
    url: &str,
    model_path: &Path,
    weight_version: &str,
    key: Option<&str>,
) -> Result<()> {
    let url = ServerUrl::parse(url)?.with_key(key);
    let short = Duration::from_secs(60);
    let pause = post_json(
        &url,
        wire::path::PAUSE_GENERATION,
        &body(&PauseGenerationRequest {
            mode: Some(PauseMode::Retract),
        }),
        short,
    )?;
    expect_ok(&url, wire::path::PAUSE_GENERATION, pause)?;
    let swapped = (|| -> Result<()> {
        flush_cache(&url, short)?;
        let update = UpdateWeightsFromDiskRequest {
            model_path: model_path.to_string_lossy().into_owned(),
            weight_version: Some(weight_version.to_owned()),
            // RL launches often start SGLang with `--load-format dummy` (random weights,
            // no download); without a load format the update inherits it and is refused.
            load_format: Some("auto".to_owned()),
            ..UpdateWeightsFromDiskRequest::default()
        };
        let r = expect_ok(
            &url,
            wire::path::UPDATE_WEIGHTS_FROM_DISK,
            post_json(
                &url,
                wire::path::UPDATE_WEIGHTS_FROM_DISK,
                &body(&update),
                Duration::from_secs(1800),
            )?,
        )?;
        // An answer that is not the wire's (a server that says nothing) is not a refusal.
        if let Ok(answer) = serde_json::from_str::<UpdateWeightsFromDiskResponse>(&r.body)
            && !answer.success
        {
            return Err(TrainerError::Push {
                url: url.raw.clone(),
                problem: format!(
                    "update_weights_from_disk refused '{}': {}",
                    model_path.display(),
                    if answer.message.is_empty() {
                        "(no message)"
                    } else {
                        answer.message.as_str()
                    }
                ),
            });
        }
        Ok(())
    })();
    let resumed = post_json(
        &url,
        wire::path::CONTINUE_GENERATION,
        &body(&ContinueGenerationRequest::default()),
        short,
    )
    .and_then(|r| expect_ok(&url, wire::path::CONTINUE_GENERATION, r));
    swapped?;
    resumed?;
    tracing::info!(url = %url.raw, version = weight_version, path = %model_path.display(), "weights pushed");
    Ok(())
}

/// How long a push keeps asking `/flush_cache` while the server still has requests.
const FLUSH_PATIENCE: Duration = Duration::from_secs(60);

/// `POST /flush_cache`, asked again with backoff (0.1 s doubling to 2 s, up to
/// [`FLUSH_PATIENCE`]) while SGLang answers 400: it refuses to flush while requests are
/// queued or running ("Cache not flushed because there are pending requests"), which
/// retracted requests briefly are after a pause. slime retries it the same way.
fn flush_cache(url: &ServerUrl, timeout: Duration) -> Result<()> {
    let start = std::time::Instant::now();
    let mut wait = Duration::from_millis(100);
    let mut refusals = 0u32;
    loop {
        let r = post_json(
            url,
            wire::path::FLUSH_CACHE,
            &body(&FlushCacheRequest::default()),
            timeout,
        )?;
        if r.status != 400 || start.elapsed() + wait > FLUSH_PATIENCE {
            if refusals > 0 && (200..300).contains(&r.status) {
                tracing::info!(url = %url.raw, refusals, "flush_cache succeeded after the server's pending requests drained");
            }
            return expect_ok(url, wire::path::FLUSH_CACHE, r)
                .map(|_| ())
                .map_err(|e| match e {
                    TrainerError::Push { url, problem } if refusals > 0 => TrainerError::Push {
                        url,
                        problem: format!(
                            "{problem} (after {refusals} refusals over {:.0} s)",
                            start.elapsed().as_secs_f64()
                        ),
                    },
                    e => e,
                });
        }
        refusals += 1;
        std::thread::sleep(wait);
        wait = (wait * 2).min(Duration::from_secs(2));
    }
}

/// Tells the vLLM server at `url` (started with `VLLM_SERVER_DEV_MODE=1`) to reload its
/// weights from the HF directory `model_path` (a path the server can read) and to stamp
/// `weight_version` on what it samples from then on, pausing generation in place around
/// the swap (see the module doc). No request is aborted: those in flight go on after the
/// resume under the new weights, and their weight-version spans say which tokens each
/// version sampled. `key`: sent as `Authorization: Bearer` (vLLM's `--api-key` does not
/// guard these routes, a proxy in front may). A failed step still resumes the server; the
/// error names the step and quotes vLLM's message.
///
/// Older vLLMs are pushed as far as their routes allow (read from 0.11.0's source): one
/// without `/pause` (404 in dev mode) cannot pause in place, so the caller must have
/// drained it (graft rl does for a vLLM that reports no weight versions); one whose
/// `reload_weights` takes no `weights_path` is pointed at the directory with
/// `update_config` first; one without `/update_weight_version` cannot stamp the version,
/// which the gateway then records itself (`docs/BACKENDS.md`).
pub fn push_weights_vllm(
    url: &str,
    model_path: &Path,
    weight_version: &str,
    key: Option<&str>,
) -> Result<()> {
    let url = ServerUrl::parse(url)?.with_key(key);
    let short = Duration::from_secs(60);
    let empty = serde_json::json!({});
    let pause = VllmPauseMode::Keep.path();
    let paused = post_json(&url, &pause, &empty, short)?;
    // No /pause: a vLLM from before it (or one not in dev mode, which the next step tells).
    let can_pause = paused.status != 404;
    if can_pause {
        vllm_step(&url, "pause", &pause, paused)?;
    } else {
        tracing::info!(url = %url.raw, "vLLM has no /pause: pushing without a pause (the caller drained it)");
    }
    let swapped = (|| -> Result<()> {
        reset_prefix_cache(&url, short)?;
        reload_weights(&url, &model_path.to_string_lossy(), !can_pause)?;
        let r = post_json(
            &url,
            vwire::path::UPDATE_WEIGHT_VERSION,
            &body(&UpdateWeightVersionRequest {
                new_version: weight_version.to_owned(),
            }),
            short,
        )?;
        if r.status == 404 {
            tracing::info!(url = %url.raw, version = weight_version, "vLLM has no /update_weight_version: its answers carry no weight version; the gateway labels them");
            return Ok(());
        }
        vllm_step(
            &url,
            "update_weight_version",
            vwire::path::UPDATE_WEIGHT_VERSION,
            r,
        )?;
        Ok(())
    })();
    let resumed = if can_pause {
        post_json(&url, vwire::path::RESUME, &empty, short)
            .and_then(|r| vllm_step(&url, "resume", vwire::path::RESUME, r))
            .map(|_| ())
    } else {
        Ok(())
    };
    swapped?;
    resumed?;
    tracing::info!(url = %url.raw, version = weight_version, path = %model_path.display(), "weights pushed to vLLM");
    Ok(())
}

/// `reload_weights(weights_path=dir)`, else (`legacy`: a vLLM without `/pause`, or one
/// whose `reload_weights` fails on the keyword: a `TypeError` in a worker reaches the client
/// as Starlette's bare 500, 0.11's `reload_weights` takes no arguments) `update_config`
/// pointing `model_config.model` at `dir`, then `reload_weights()`, which every vLLM since
/// 0.11 has.
fn reload_weights(url: &ServerUrl, dir: &str, legacy: bool) -> Result<()> {
    let long = Duration::from_secs(1800);
    let rpc = vwire::path::COLLECTIVE_RPC;
    if !legacy {
        let r = post_json(
            url,
            rpc,
            &body(&CollectiveRpcRequest::reload_weights(dir)),
            long,
        )?;
        let keyword_refused = r.status == 500
            && (r.body.contains(vwire::WEIGHTS_PATH)
                || serde_json::from_str::<serde_json::Value>(&r.body).is_err());
        if !keyword_refused {
            vllm_step(url, "reload_weights", rpc, r)?;
            return Ok(());
        }
    }
    tracing::info!(url = %url.raw, "an older vLLM: pointing its model_config at the directory, then reloading");
    vllm_step(
        url,
        "update_config",
        rpc,
        post_json(
            url,
            rpc,
            &body(&CollectiveRpcRequest::point_model_at(dir)),
            long,
        )?,
    )?;
    vllm_step(
        url,
        "reload_weights",
        rpc,
        post_json(
            url,
            rpc,
            &body(&CollectiveRpcRequest::reload_in_place()),
            long,
        )?,
    )?;
    Ok(())
}

/// A vLLM push step's answer: Ok for 2xx, else an error naming the step, the status and
/// vLLM's message (a 404 with [`vwire::DEV_MODE_HINT`]).
fn vllm_step(url: &ServerUrl, step: &str, path: &str, r: Response) -> Result<Response> {
    if (200..300).contains(&r.status) {
        return Ok(r);
    }
    let message = vwire::error_message(&r.body);
    let hint = if r.status == 404 {
        format!("; {}", vwire::DEV_MODE_HINT)
    } else if message.contains("`dummy` format") {
        format!("; {}", vwire::DUMMY_LOAD_FORMAT_HINT)
    } else {
        String::new()
    };
    Err(TrainerError::Push {
        url: url.raw.clone(),
        problem: format!(
            "the vLLM push's {step} step (POST {path}) answered {}: {message}{hint}",
            r.status
        ),
    })
}

/// How often a push asks `/reset_prefix_cache` while vLLM answers `success: false`.
const RESET_TRIES: u32 = 5;

/// `POST /reset_prefix_cache?reset_running_requests=true`, asked again (0.2 s apart, up to
/// [`RESET_TRIES`] times) while vLLM answers `{"success": false}`: blocks still held, e.g.
/// by in-flight KV offload transfers. A cache that is never reset would serve prefixes
/// computed with the old weights, so that fails the push.
fn reset_prefix_cache(url: &ServerUrl, timeout: Duration) -> Result<()> {
    let path = vwire::RESET_PREFIX_CACHE_PREEMPTING;
    for attempt in 1..=RESET_TRIES {
        let r = vllm_step(
            url,
            "reset_prefix_cache",
            path,
            post_json(url, path, &serde_json::json!({}), timeout)?,
        )?;
        // An answer without `success` (not vLLM's) is not a refusal.
        match serde_json::from_str::<ResetPrefixCacheResponse>(&r.body) {
            Ok(a) if !a.success => {
                tracing::info!(url = %url.raw, attempt, "vLLM did not reset its prefix cache yet; asking again");
                if attempt < RESET_TRIES {
                    std::thread::sleep(Duration::from_millis(200));
                }
            }
            _ => return Ok(()),
        }
    }
    Err(TrainerError::Push {
        url: url.raw.clone(),
        problem: format!(
            "the vLLM push's reset_prefix_cache step (POST {path}) answered success: false {RESET_TRIES} times: vLLM still holds cache blocks (KV transfers in flight?), and the new weights would reuse prefixes computed with the old ones"
        ),
    })
}

/// A control body as JSON (the wire types are plain data, which serde_json always
/// serializes).
fn body(v: &impl serde::Serialize) -> serde_json::Value {
    serde_json::to_value(v).unwrap_or(serde_json::Value::Null)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_split_into_host_port_and_prefix() {
        let u = ServerUrl::parse("http://127.0.0.1:30000").unwrap();
        assert_eq!(
            (u.host.as_str(), u.port, u.prefix.as_str()),
            ("127.0.0.1", 30000, "")
        );
        let u = ServerUrl::parse("http://gpu-box/sglang/").unwrap();
        assert_eq!(
            (u.host.as_str(), u.port, u.prefix.as_str()),
            ("gpu-box", 80, "/sglang")
        );
        let u = ServerUrl::parse("http://[::1]:8000").unwrap();
        assert_eq!((u.host.as_str(), u.port), ("::1", 8000));
        assert!(
            ServerUrl::parse("https://x")
                .unwrap_err()
                .to_string()
                .contains("only http://")
        );
    }
}

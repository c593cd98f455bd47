//! The weight push against stand-in SGLang and vLLM control APIs on a local port: the
//! calls, in order, with their bodies; a refused or failed step still resumes generation,
//! and the error names the step and the server's words. (The vLLM push against the scripted
//! upstream's vLLM side, mid-stream through the gateway: `tests/exact_vllm.rs`.)

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpListener;
use std::sync::{Arc, Mutex};

use graft_trainer::push;

type Log = Arc<Mutex<Vec<(String, serde_json::Value)>>>;

/// Answers `n` requests: 200 with `{"success": true}` unless `refuse_update`.
fn serve(
    n: usize,
    refuse_update: bool,
) -> anyhow::Result<(String, Log, std::thread::JoinHandle<()>)> {
    serve_with(n, refuse_update, 0)
}

/// As [`serve`], and the first `busy_flushes` calls of `/flush_cache` get SGLang's 400 for
/// a server with pending requests.
fn serve_with(
    n: usize,
    refuse_update: bool,
    busy_flushes: usize,
) -> anyhow::Result<(String, Log, std::thread::JoinHandle<()>)> {
    let mut busy = busy_flushes;
    serve_by(n, move |path| {
        if refuse_update && path == "/update_weights_from_disk" {
            (
                "200 OK",
                r#"{"success": false, "message": "no such directory"}"#.into(),
            )
        } else if path == "/flush_cache" && busy > 0 {
            busy -= 1;
            (
                "400 Bad Request",
                "Cache not flushed because there are pending requests. #queue-req: 2, #running-req: 0".into(),
            )
        } else {
            ("200 OK", r#"{"success": true, "message": "ok"}"#.into())
        }
    })
}

/// Answers `n` requests with what `answer` gives for each one's path (with its query);
/// logs each path and JSON body.
fn serve_by(
    n: usize,
    mut answer: impl FnMut(&str) -> (&'static str, String) + Send + 'static,
) -> anyhow::Result<(String, Log, std::thread::JoinHandle<()>)> {
    let listener = TcpListener::bind("127.0.0.1:0")?;
    let url = format!("http://{}", listener.local_addr()?);
    let log: Log = Arc::default();
    let seen = log.clone();
    let handle = std::thread::spawn(move || {
        for _ in 0..n {
            let Ok((stream, _)) = listener.accept() else {
                return;
            };
            let mut reader = BufReader::new(stream);
            let mut line = String::new();
            let _ = reader.read_line(&mut line);
            let path = line.split_whitespace().nth(1).unwrap_or("").to_owned();
            let mut len = 0;
            loop {
                let mut h = String::new();
                let _ = reader.read_line(&mut h);
                if h.trim().is_empty() {
                    break;
                }
                if let Some(v) = h.to_ascii_lowercase().strip_prefix("content-length:") {
                    len = v.trim().parse().unwrap_or(0);
                }
            }
            let mut body = vec![0; len];
            let _ = reader.read_exact(&mut body);
            let json = serde_json::from_slice(&body).unwrap_or(serde_json::Value::Null);
            if let Ok(mut log) = seen.lock() {
                log.push((path.clone(), json));
            }
            let (status, answer) = answer(&path);
            let mut stream = reader.into_inner();
            let _ = write!(
                stream,
                "HTTP/1.1 {status}\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{}",
                answer.len(),
                answer
            );
        }
    });
    Ok((url, log, handle))
}

#[test]
fn push_pauses_flushes_updates_and_continues_in_order() -> anyhow::Result<()> {
    let (url, log, h) = serve(4, false)?;
    push::push_weights(&url, std::path::Path::new("/models/step-3"), "step-3", None)?;
    h.join().map_err(|_| anyhow::anyhow!("server thread"))?;
    let log = log.lock().unwrap();
    let paths: Vec<&str> = log.iter().map(|(p, _)| p.as_str()).collect();
    assert_eq!(
        paths,
        [
            "/pause_generation",
            "/flush_cache",
            "/update_weights_from_disk",
            "/continue_generation"
        ]
    );
    assert_eq!(
        log[0].1["mode"], "retract",
        "in-flight generations are retracted, not aborted"
    );
    assert_eq!(log[2].1["model_path"], "/models/step-3");
    assert_eq!(log[2].1["weight_version"], "step-3");
    Ok(())
}

/// SGLang point 3: a server started with `--load-format dummy` refuses an update that names
/// no load format (it inherits the dummy one); the push says `auto`.
#[test]
fn point3_push_names_load_format_auto() -> anyhow::Result<()> {
    let (url, log, h) = serve(4, false)?;
    push::push_weights(&url, std::path::Path::new("/models/step-4"), "step-4", None)?;
    h.join().map_err(|_| anyhow::anyhow!("server thread"))?;
    let log = log.lock().unwrap();
    let update = log
        .iter()
        .find(|(p, _)| p == "/update_weights_from_disk")
        .map(|(_, b)| b.clone())
        .unwrap_or_default();
    assert_eq!(update["load_format"], "auto", "{update}");
    Ok(())
}

#[test]
fn a_flush_refused_while_requests_are_pending_is_asked_again() -> anyhow::Result<()> {
    let (url, log, h) = serve_with(6, false, 2)?;
    push::push_weights(&url, std::path::Path::new("/models/step-4"), "step-4", None)?;
    h.join().map_err(|_| anyhow::anyhow!("server thread"))?;
    let log = log.lock().unwrap();
    let paths: Vec<&str> = log.iter().map(|(p, _)| p.as_str()).collect();
    assert_eq!(
        paths,
        [
            "/pause_generation",
            "/flush_cache",
            "/flush_cache",
            "/flush_cache",
            "/update_weights_from_disk",
            "/continue_generation"
        ]
    );
    Ok(())
}

#[test]
fn a_refused_update_still_continues_generation_and_reports_why() -> anyhow::Result<()> {
    let (url, log, h) = serve(4, true)?;
    let err = push::push_weights(&url, std::path::Path::new("/nope"), "v2", None)
        .unwrap_err()
        .to_string();
    h.join().map_err(|_| anyhow::anyhow!("server thread"))?;
    assert!(err.contains("no such directory"), "{err}");
    let log = log.lock().unwrap();
    assert_eq!(
        log.last().map(|(p, _)| p.as_str()),
        Some("/continue_generation")
    );
    Ok(())
}

#[test]
fn an_unreachable_server_is_named() {
    let err = push::push_weights("http://127.0.0.1:1", std::path::Path::new("/m"), "v", None)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("127.0.0.1:1") && err.contains("is the server up"),
        "{err}"
    );
}

/// vLLM's answers to the push's routes (`graft-wire`'s `vllm` module cites them).
fn vllm_answer(path: &str) -> (&'static str, String) {
    let body = match path.split('?').next().unwrap_or_default() {
        "/pause" => r#"{"status": "paused"}"#,
        "/resume" => r#"{"status": "resumed"}"#,
        "/reset_prefix_cache" => r#"{"success": true}"#,
        "/collective_rpc" => r#"{"results": [null]}"#,
        "/update_weight_version" => r#"{"success": true, "new_version": "step-3"}"#,
        _ => return ("404 Not Found", r#"{"detail": "Not Found"}"#.into()),
    };
    ("200 OK", body.into())
}

const VLLM_PUSH: [&str; 5] = [
    "/pause?mode=keep",
    "/reset_prefix_cache?reset_running_requests=true",
    "/collective_rpc",
    "/update_weight_version",
    "/resume",
];

#[test]
fn vllm_push_pauses_in_place_resets_the_cache_reloads_versions_and_resumes_in_order()
-> anyhow::Result<()> {
    let (url, log, h) = serve_by(5, vllm_answer)?;
    push::push_weights_vllm(&url, std::path::Path::new("/models/step-3"), "step-3", None)?;
    h.join().map_err(|_| anyhow::anyhow!("server thread"))?;
    let log = log.lock().unwrap();
    let paths: Vec<&str> = log.iter().map(|(p, _)| p.as_str()).collect();
    assert_eq!(paths, VLLM_PUSH);
    assert_eq!(
        log[2].1,
        serde_json::json!({"method": "reload_weights", "kwargs": {"weights_path": "/models/step-3"}})
    );
    assert_eq!(log[3].1, serde_json::json!({"new_version": "step-3"}));
    Ok(())
}

/// vLLM 0.11 (read from its source): no `/pause`, `/resume` or `/update_weight_version`
/// (404 in dev mode too), an empty 200 from `/reset_prefix_cache`, and a `reload_weights`
/// without arguments. The push (for a backend the caller drained) resets the cache, points
/// `model_config.model` at the directory and reloads.
#[test]
fn vllm_0_11_is_pushed_without_a_pause_through_update_config_and_reload() -> anyhow::Result<()> {
    let (url, log, h) = serve_by(5, |path| match path.split('?').next().unwrap_or_default() {
        "/reset_prefix_cache" => ("200 OK", String::new()),
        "/collective_rpc" => ("200 OK", r#"{"results": [null]}"#.into()),
        _ => ("404 Not Found", r#"{"detail": "Not Found"}"#.into()),
    })?;
    push::push_weights_vllm(&url, std::path::Path::new("/models/step-3"), "step-3", None)?;
    h.join().map_err(|_| anyhow::anyhow!("server thread"))?;
    let log = log.lock().unwrap();
    let paths: Vec<&str> = log.iter().map(|(p, _)| p.as_str()).collect();
    assert_eq!(
        paths,
        [
            "/pause?mode=keep",
            "/reset_prefix_cache?reset_running_requests=true",
            "/collective_rpc",
            "/collective_rpc",
            "/update_weight_version"
        ]
    );
    assert_eq!(
        log[2].1,
        serde_json::json!({"method": "update_config", "kwargs": {"overrides": {"model_config": {"model": "/models/step-3"}}}})
    );
    assert_eq!(log[3].1, serde_json::json!({"method": "reload_weights"}));
    Ok(())
}

/// A vLLM with `/pause` whose `reload_weights` takes no `weights_path`: the worker's
/// `TypeError` arrives as Starlette's bare 500; the push falls back to `update_config` and
/// `reload_weights()` and still resumes.
#[test]
fn vllm_reload_without_weights_path_falls_back_and_resumes() -> anyhow::Result<()> {
    let mut first = true;
    let (url, log, h) = serve_by(7, move |path| {
        if path == "/collective_rpc" && std::mem::take(&mut first) {
            return ("500 Internal Server Error", "Internal Server Error".into());
        }
        vllm_answer(path)
    })?;
    push::push_weights_vllm(&url, std::path::Path::new("/models/step-3"), "step-3", None)?;
    h.join().map_err(|_| anyhow::anyhow!("server thread"))?;
    let log = log.lock().unwrap();
    let paths: Vec<&str> = log.iter().map(|(p, _)| p.as_str()).collect();
    assert_eq!(
        paths,
        [
            "/pause?mode=keep",
            "/reset_prefix_cache?reset_running_requests=true",
            "/collective_rpc",
            "/collective_rpc",
            "/collective_rpc",
            "/update_weight_version",
            "/resume"
        ]
    );
    assert_eq!(log[3].1["method"], "update_config");
    assert_eq!(log[4].1, serde_json::json!({"method": "reload_weights"}));
    Ok(())
}

#[test]
fn vllm_reset_prefix_cache_refused_is_asked_again() -> anyhow::Result<()> {
    let mut refusals = 2;
    let (url, log, h) = serve_by(7, move |path| {
        if path.starts_with("/reset_prefix_cache") && refusals > 0 {
            refusals -= 1;
            return ("200 OK", r#"{"success": false}"#.into());
        }
        vllm_answer(path)
    })?;
    push::push_weights_vllm(&url, std::path::Path::new("/models/step-3"), "step-3", None)?;
    h.join().map_err(|_| anyhow::anyhow!("server thread"))?;
    let log = log.lock().unwrap();
    let resets = log
        .iter()
        .filter(|(p, _)| p.starts_with("/reset_prefix_cache"))
        .count();
    assert_eq!(resets, 3);
    assert_eq!(log.last().map(|(p, _)| p.as_str()), Some("/resume"));
    Ok(())
}

/// A reload that fails in the worker (vLLM's 500 with the exception's message) still
/// resumes the server, and the error names the step and quotes vLLM.
#[test]
fn vllm_failed_reload_still_resumes_and_names_the_step_and_vllms_message() -> anyhow::Result<()> {
    let (url, log, h) = serve_by(4, |path| {
        if path == "/collective_rpc" {
            return (
                "500 Internal Server Error",
                r#"{"error": {"message": "No safetensors found in /nope", "type": "InternalServerError", "param": null, "code": 500}}"#.into(),
            );
        }
        vllm_answer(path)
    })?;
    let err = push::push_weights_vllm(&url, std::path::Path::new("/nope"), "v2", None)
        .unwrap_err()
        .to_string();
    h.join().map_err(|_| anyhow::anyhow!("server thread"))?;
    assert!(
        err.contains("reload_weights") && err.contains("No safetensors found in /nope"),
        "{err}"
    );
    let log = log.lock().unwrap();
    let paths: Vec<&str> = log.iter().map(|(p, _)| p.as_str()).collect();
    assert_eq!(
        paths,
        [VLLM_PUSH[0], VLLM_PUSH[1], VLLM_PUSH[2], VLLM_PUSH[4]]
    );
    Ok(())
}

/// A vLLM without `VLLM_SERVER_DEV_MODE=1` has none of the routes: a missing `/pause` alone
/// may be an older vLLM, but a missing `/reset_prefix_cache` (which 0.11 has in dev mode)
/// is not; the push says how to start vLLM and calls nothing more.
#[test]
fn vllm_without_dev_mode_is_told_to_start_with_it() -> anyhow::Result<()> {
    let (url, log, h) = serve_by(2, |_| {
        ("404 Not Found", r#"{"detail": "Not Found"}"#.into())
    })?;
    let err = push::push_weights_vllm(&url, std::path::Path::new("/m"), "v", None)
        .unwrap_err()
        .to_string();
    h.join().map_err(|_| anyhow::anyhow!("server thread"))?;
    assert!(
        err.contains("VLLM_SERVER_DEV_MODE=1") && err.contains("reset_prefix_cache"),
        "{err}"
    );
    assert_eq!(log.lock().unwrap().len(), 2);
    Ok(())
}

/// vLLM reloads with its own `--load-format`: a server started with `dummy` refuses every
/// reload, and the push says to start it without.
#[test]
fn vllm_reload_refused_for_a_dummy_load_format_says_to_start_without_it() -> anyhow::Result<()> {
    let (url, _log, h) = serve_by(4, |path| {
        if path == "/collective_rpc" {
            return (
                "500 Internal Server Error",
                r#"{"error": {"message": "Model reloading with `dummy` format", "type": "InternalServerError", "param": null, "code": 500}}"#.into(),
            );
        }
        vllm_answer(path)
    })?;
    let err = push::push_weights_vllm(&url, std::path::Path::new("/w"), "v2", None)
        .unwrap_err()
        .to_string();
    h.join().map_err(|_| anyhow::anyhow!("server thread"))?;
    assert!(err.contains("without --load-format dummy"), "{err}");
    Ok(())
}

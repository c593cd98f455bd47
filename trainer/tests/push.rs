//! The weight push against a stand-in SGLang control API on a local port: the calls, in
//! order, with their bodies; a refused update still resumes generation.

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
            let (status, answer) = if refuse_update && path == "/update_weights_from_disk" {
                (
                    "200 OK",
                    r#"{"success": false, "message": "no such directory"}"#,
                )
            } else if path == "/flush_cache" && busy > 0 {
                busy -= 1;
                (
                    "400 Bad Request",
                    "Cache not flushed because there are pending requests. #queue-req: 2, #running-req: 0",
                )
            } else {
                ("200 OK", r#"{"success": true, "message": "ok"}"#)
            };
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

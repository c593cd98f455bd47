//! How much memory sealing one WAL segment takes: records shaped like the gateway's (a chat
//! completion request in one session and its answer) are written until the segment is past
//! `--segment-mib`, then `seal_now` seals it; the process's VmHWM (peak RSS) is read from
//! `/proc/self/status` before and after the seal. Not a test: nothing is asserted.
//!
//! `cargo run --release -p graft-recorder --example seal_memory -- [--segment-mib 64]`
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::time::{Duration, Instant};

use graft_recorder::{CallRecord, Durability, Recorder, RecorderConfig, SCHEMA_VERSION, Usage};
use serde_json::json;

fn vm_kb(field: &str) -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .unwrap_or_default()
        .lines()
        .find_map(|l| l.strip_prefix(field))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap_or(0)
}

fn mb(kb: u64) -> f64 {
    kb as f64 / 1024.0
}

fn record(i: u64) -> CallRecord {
    let now = 1_750_000_000_000_000 + i as i64 * 150;
    CallRecord {
        schema_version: SCHEMA_VERSION,
        call_id: format!("0190a000-0000-7000-8000-{i:012}"),
        session_id: "default".to_owned(),
        started_at_us: now,
        finished_at_us: now + 140,
        dialect: "chat_completions".to_owned(),
        endpoint: "/v1/chat/completions".to_owned(),
        model: Some("bench".to_owned()),
        upstream: "http://127.0.0.1:1/v1".to_owned(),
        request: json!({
            "model": "bench",
            "messages": [
                {"role": "system", "content": "You are a careful coding assistant working in a git repository. Answer briefly and cite file paths."},
                {"role": "user", "content": "The test suite fails with 'connection reset by peer' when the gateway restarts. Which component should retry, and why?"},
            ],
            "temperature": 0.2,
            "max_tokens": 256,
        }),
        response: Some(json!({
            "id": format!("chatcmpl-{i}"),
            "object": "chat.completion",
            "created": 1_750_000_000u64 + i / 1000,
            "model": "bench",
            "choices": [{
                "index": 0,
                "message": {"role": "assistant", "content": format!("The client should retry: the gateway closes idle connections on restart, so a request sent on a stale keep-alive connection is reset. Retrying idempotent calls once on a fresh connection is enough. ({i})")},
                "finish_reason": "stop",
            }],
            "usage": {"prompt_tokens": 52, "completion_tokens": 41, "total_tokens": 93},
        })),
        status: 200,
        outcome: "ok".to_owned(),
        finish_reason: Some("stop".to_owned()),
        usage: Some(Usage {
            prompt_tokens: Some(52),
            completion_tokens: Some(41),
            total_tokens: Some(93),
        }),
        ttft_ms: Some(0.9),
        latency_ms: 1.1,
        client: Some("load/1".to_owned()),
        ..CallRecord::default()
    }
}

#[tokio::main]
async fn main() {
    let mut args = std::env::args().skip(1);
    let mut segment_mib = 64u64;
    while let Some(a) = args.next() {
        match a.as_str() {
            "--segment-mib" => segment_mib = args.next().and_then(|v| v.parse().ok()).unwrap(),
            "--bench" => {}
            other => panic!("unknown argument {other}"),
        }
    }
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = RecorderConfig::new(dir.path());
    cfg.durability = Durability::Async {
        max_delay: Duration::from_millis(50),
    };
    // Rotation (and with it a background seal) only at the end, by seal_now.
    cfg.segment_max_bytes = u64::MAX;
    cfg.seal_after = Duration::from_secs(3600);
    let (rec, _) = Recorder::open(cfg).await.unwrap();
    let wal = dir.path().join("wal");
    let wal_bytes = || -> u64 {
        std::fs::read_dir(&wal)
            .map(|d| {
                d.flatten()
                    .filter_map(|e| e.metadata().ok())
                    .map(|m| m.len())
                    .sum()
            })
            .unwrap_or(0)
    };
    let mut n = 0u64;
    while wal_bytes() < segment_mib << 20 {
        for _ in 0..5_000 {
            rec.record(record(n)).await.unwrap();
            n += 1;
        }
        rec.flush().await.unwrap();
    }
    let segment = wal_bytes();
    let (rss0, hwm0) = (vm_kb("VmRSS:"), vm_kb("VmHWM:"));
    let t = Instant::now();
    rec.seal_now().await.unwrap();
    let secs = t.elapsed().as_secs_f64();
    let (rss1, hwm1) = (vm_kb("VmRSS:"), vm_kb("VmHWM:"));
    rec.shutdown().await.unwrap();
    let parquet: u64 = walk(&dir.path().join("records"));
    println!(
        "sealed {n} records, WAL segment {:.1} MiB -> parquet {:.1} MiB in {secs:.2} s; \
         before the seal RSS {:.1} MB (peak {:.1}); after RSS {:.1} MB, peak {:.1} MB: \
         the seal raised the peak by {:.1} MB",
        segment as f64 / 1048576.0,
        parquet as f64 / 1048576.0,
        mb(rss0),
        mb(hwm0),
        mb(rss1),
        mb(hwm1),
        mb(hwm1.saturating_sub(hwm0.max(rss0))),
    );
}

fn walk(dir: &std::path::Path) -> u64 {
    std::fs::read_dir(dir)
        .map(|d| {
            d.flatten()
                .map(|e| match e.metadata() {
                    Ok(m) if m.is_dir() => walk(&e.path()),
                    Ok(m) => m.len(),
                    Err(_) => 0,
                })
                .sum()
        })
        .unwrap_or(0)
}

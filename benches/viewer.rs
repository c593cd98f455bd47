#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
//! Viewer benchmark (not a test): writes N generated calls (default 100 000; 5 calls per
//! session, 4 sessions per group) through the real recorder (async durability, sealed to
//! Parquet), then times the viewer's pages over that data dir and reports the process's
//! peak RSS while rendering (VmHWM, reset after the write phase via /proc/self/clear_refs).
//! The baseline measured in the same run is the recorder's whole reader, `read_records`
//! (every call resolved into memory: what a viewer without paged readers costs); the pages
//! read through `list_sessions` (summary columns only) and `read_session` (one session's
//! rows). Results and the command go in docs/BENCHMARKS.md.
//!
//! cargo bench --bench viewer -- [N]

use std::time::{Duration, Instant};

use graft_recorder::{CallRecord, Durability, Recorder, RecorderConfig, Usage};
use serde_json::json;

fn vm(field: &str) -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .unwrap_or_default()
        .lines()
        .find_map(|l| l.strip_prefix(field))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
        .unwrap_or(0)
}

fn median(f: impl Fn() -> usize, n: usize) -> (Duration, usize) {
    let mut times = vec![];
    let mut size = 0;
    for _ in 0..n {
        let t = Instant::now();
        size = f();
        times.push(t.elapsed());
    }
    times.sort();
    (times[n / 2], size)
}

fn main() {
    let n: usize = std::env::args()
        .skip(1)
        .find(|a| !a.starts_with('-'))
        .and_then(|a| a.parse().ok())
        .unwrap_or(100_000);
    let dir = tempfile::tempdir().unwrap();
    let t = Instant::now();
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let mut cfg = RecorderConfig::new(dir.path());
        cfg.durability = Durability::Async {
            max_delay: Duration::from_millis(10),
        };
        let (rec, _) = Recorder::open(cfg).await.unwrap();
        let mut pending = vec![];
        for i in 0..n {
            let session = i / 5;
            let turn = i % 5;
            let messages: Vec<_> = (0..=turn)
                .map(|k| json!({"role": "user", "content": format!("turn {k} of session {session}: do the task")}))
                .collect();
            let r = CallRecord {
                schema_version: graft_recorder::SCHEMA_VERSION,
                call_id: format!("c{i:07}"),
                session_id: format!("s{session:06}"),
                group_id: Some(format!("g{:05}", session / 4)),
                started_at_us: 1_750_000_000_000_000 + i as i64 * 1000,
                finished_at_us: 1_750_000_000_000_000 + i as i64 * 1000 + 800,
                dialect: "chat_completions".into(),
                endpoint: "/v1/chat/completions".into(),
                model: Some("m".into()),
                request: json!({"model": "m", "messages": messages}),
                response: Some(json!({"choices": [{"message": {"role": "assistant", "content": format!("answer {i}")}}]})),
                status: 200,
                outcome: if i % 97 == 0 { "upstream_error" } else { "ok" }.into(),
                completion_token_ids: Some(vec![1, 2, 3, 4]),
                usage: Some(Usage { prompt_tokens: Some(40), completion_tokens: Some(4), total_tokens: Some(44) }),
                latency_ms: 5.0,
                weight_version: Some(format!("v{}", i / 20_000)),
                ..CallRecord::default()
            };
            let rec = rec.clone();
            pending.push(tokio::spawn(async move { rec.record(r).await }));
            if pending.len() >= 512 {
                for p in pending.drain(..) {
                    p.await.unwrap().unwrap();
                }
            }
        }
        for p in pending {
            p.await.unwrap().unwrap();
        }
        rec.shutdown().await.unwrap();
    });
    drop(rt);
    let write = t.elapsed();
    let data_bytes: u64 = walk(dir.path());
    println!(
        "wrote {n} calls ({} sessions) in {:.1} s; data dir {:.1} MiB",
        n / 5,
        write.as_secs_f64(),
        data_bytes as f64 / 1048576.0
    );
    // Peak RSS from here on only.
    let _ = std::fs::write("/proc/self/clear_refs", "5");
    let rss0 = vm("VmRSS:");
    let viewer = graft_viewer::Viewer::new(dir.path(), None, None, "").unwrap();
    let page = |p: &str, q: &str| {
        let r = viewer.page(p, q);
        assert_eq!(r.status, 200, "{p}?{q}: {}", r.body);
        r.body.len()
    };
    let rows: Vec<(&str, &str, &str)> = vec![
        ("sessions, first page", "/", ""),
        ("sessions, page 200 of 50", "/sessions", "page=200&per=50"),
        ("sessions, filter group", "/sessions", "group=g00042"),
        ("sessions, filter errors", "/sessions", "outcome=errors"),
        ("groups, first page", "/groups", ""),
        ("groups, page 50 of 50", "/groups", "page=50&per=50"),
        ("one session", "/session/s000123", ""),
    ];
    let timed: Vec<_> = rows
        .into_iter()
        .map(|(name, p, q)| (name, median(|| page(p, q), 3)))
        .collect();
    let hwm_pages = vm("VmHWM:");
    let (_, sessions) = median(
        || graft_recorder::list_sessions(dir.path()).unwrap().len(),
        1,
    );
    let _ = std::fs::write("/proc/self/clear_refs", "5");
    let (base, calls) = median(
        || graft_recorder::read_records(dir.path()).unwrap().len(),
        3,
    );
    let hwm_base = vm("VmHWM:");
    println!(
        "baseline read_records ({calls} calls, {} sessions): {:.0} ms",
        sessions,
        base.as_secs_f64() * 1e3
    );
    println!("| page | median of 3 | × baseline | HTML bytes |");
    println!("|---|---:|---:|---:|");
    for (name, (d, size)) in timed {
        println!(
            "| {name} | {:.0} ms | {:.3} | {size} |",
            d.as_secs_f64() * 1e3,
            d.as_secs_f64() / base.as_secs_f64()
        );
    }
    println!(
        "RSS before reading: {:.0} MiB; peak over all pages: {:.0} MiB; peak while read_records: {:.0} MiB",
        rss0 as f64 / 1024.0,
        hwm_pages as f64 / 1024.0,
        hwm_base as f64 / 1024.0
    );
}

fn walk(p: &std::path::Path) -> u64 {
    std::fs::read_dir(p)
        .map(|rd| {
            rd.flatten()
                .map(|e| match e.file_type() {
                    Ok(t) if t.is_dir() => walk(&e.path()),
                    _ => e.metadata().map(|m| m.len()).unwrap_or(0),
                })
                .sum()
        })
        .unwrap_or(0)
}

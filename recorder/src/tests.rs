//! Recorder tests against real files in temp directories.

use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use proptest::prelude::*;
use serde_json::{Value, json};

use crate::*;

const DAY_US: i64 = 86_400_000_000;
const T0: i64 = 1_750_000_000_000_000; // 2025-06-15

fn call(session: &str, turn: usize, messages: Vec<Value>) -> CallRecord {
    CallRecord {
        schema_version: SCHEMA_VERSION,
        call_id: format!("{session}-{turn:04}"),
        session_id: session.to_owned(),
        group_id: Some("g1".to_owned()),
        seq: 0,
        started_at_us: T0 + turn as i64 * 1_000,
        finished_at_us: T0 + turn as i64 * 1_000 + 500,
        dialect: "chat_completions".to_owned(),
        endpoint: "/v1/chat/completions".to_owned(),
        model: Some("qwen".to_owned()),
        upstream: "http://127.0.0.1:1".to_owned(),
        stream: turn.is_multiple_of(2),
        request: json!({"model": "qwen", "messages": messages.clone(), "temperature": 1.0}),
        response: Some(
            json!({"choices": [{"message": {"role": "assistant", "content": format!("answer {turn}")}}]}),
        ),
        status: 200,
        outcome: if turn % 7 == 6 {
            "upstream_error"
        } else {
            "ok"
        }
        .to_owned(),
        error: None,
        prompt_token_ids: Some(vec![1, 2, 3, turn as u32]),
        completion_token_ids: Some(vec![9, 8]),
        completion_logprobs: Some(vec![Some(-0.5), None]),
        finish_reason: Some("stop".to_owned()),
        weight_version: Some("v3".to_owned()),
        usage: Some(Usage {
            prompt_tokens: Some(4),
            completion_tokens: Some(2),
            total_tokens: None,
        }),
        ttft_ms: (!turn.is_multiple_of(3)).then_some(12.5),
        latency_ms: 40.0,
        client: Some("test/1.0".to_owned()),
        normalized_request: Some(json!({
            "model": "qwen",
            "messages": messages.clone(),
            "tools": [],
            "sampling": {"temperature": 1.0},
            "notes": [],
        })),
        normalized_response: Some(
            json!({"role": "assistant", "content": [{"type": "text", "text": format!("answer {turn}")}]}),
        ),
        // Translated on most turns; every third one is passthrough.
        upstream_request: (turn % 3 != 1).then(
            || json!({"model": "qwen", "system": "s", "messages": messages, "max_tokens": 64}),
        ),
        upstream_dialect: Some(
            if turn % 3 != 1 {
                "anthropic_messages"
            } else {
                "chat_completions"
            }
            .to_owned(),
        ),
        weight_version_spans: (turn % 2 == 1).then(|| {
            vec![
                WeightSpan {
                    version: "v2".to_owned(),
                    start: 0,
                    end: 1,
                },
                WeightSpan {
                    version: "v3".to_owned(),
                    start: 1,
                    end: 2,
                },
            ]
        }),
        // The additive fields on some turns (every store must keep them, and their absence).
        sampling: turn.is_multiple_of(2).then(|| {
            json!({"policy": {"mode": "enforce", "temperature": 1.0},
                   "requested": {"temperature": 0.0}, "sent": {"temperature": 1.0}})
        }),
        attempt: (!turn.is_multiple_of(3)).then_some(1 + (turn % 2) as u32),
        retry_of: (turn % 2 == 1).then(|| format!("{session}-first-{turn}")),
        backend_finish_reason: turn.is_multiple_of(2).then(|| "stop".to_owned()),
        stop_matched: turn.is_multiple_of(4).then(|| json!("Observation:")),
        headers: turn.is_multiple_of(3).then(|| {
            [(
                "x-codex-turn-metadata".to_owned(),
                format!("{{\"turn\": {turn}}}"),
            )]
            .into()
        }),
        replay: turn.is_multiple_of(5).then(|| crate::Replay {
            branch_of: format!("{session}-parent"),
            at_call: 2,
            policy: "tolerant".to_owned(),
            position: turn as u64 + 1,
            replayed_from: (turn < 2).then(|| format!("{session}-parent-{turn}")),
            parent_seq: (turn < 2).then_some(turn as u64 + 1),
            live: (turn >= 2).then(|| "the branch point was reached".to_owned()),
            differences: vec![crate::Difference {
                at: "messages[0].content".to_owned(),
                kind: "timestamp".to_owned(),
                parent: "2026-01-01T00:00:00Z".to_owned(),
                branch: "2026-01-02T00:00:00Z".to_owned(),
            }],
        }),
    }
}

/// `turns` calls per session, each extending the previous conversation.
fn sessions(ids: &[&str], turns: usize) -> Vec<CallRecord> {
    let mut out = Vec::new();
    for (s, id) in ids.iter().enumerate() {
        let mut msgs = vec![json!({"role": "system", "content": "be brief"})];
        for t in 0..turns {
            msgs.push(json!({"role": "user", "content": format!("q{s}.{t}")}));
            out.push(call(id, t, msgs.clone()));
            msgs.push(json!({"role": "assistant", "content": format!("a{s}.{t}")}));
        }
    }
    out
}

/// What readers return: seq assigned in per-session order, sorted by (session, seq).
fn expected(mut recs: Vec<CallRecord>) -> Vec<CallRecord> {
    let mut counters = std::collections::HashMap::new();
    for r in &mut recs {
        let c = counters.entry(r.session_id.clone()).or_insert(0u64);
        *c += 1;
        r.seq = *c;
    }
    recs.sort_by(|a, b| (&a.session_id, a.seq).cmp(&(&b.session_id, b.seq)));
    recs
}

fn manifests(dir: &Path) -> usize {
    std::fs::read_dir(dir.join("records/_sealed")).map_or(0, |d| d.count())
}

fn wal_files(dir: &Path) -> Vec<std::path::PathBuf> {
    crate::wal::list_segments(dir)
        .unwrap()
        .into_iter()
        .map(|(_, p)| p)
        .collect()
}

#[tokio::test]
async fn sync_round_trip_then_sealed_parquet_reads_back_identical() {
    let dir = tempfile::tempdir().unwrap();
    let (rec, report) = Recorder::open(RecorderConfig::new(dir.path()))
        .await
        .unwrap();
    assert_eq!(report.recovered_records, 0);
    let input = sessions(&["s-a", "s-b", "s-c"], 6);
    for r in &input {
        rec.record(r.clone()).await.unwrap();
    }
    let want = expected(input);
    assert_eq!(read_records(dir.path()).unwrap(), want, "from the WAL");

    rec.seal_now().await.unwrap();
    assert!(wal_files(dir.path()).is_empty(), "sealed WAL deleted");
    assert_eq!(manifests(dir.path()), 1);
    assert_eq!(read_records(dir.path()).unwrap(), want, "from parquet");

    // seq continues across restarts, from the manifests.
    rec.shutdown().await.unwrap();
    assert!(
        rec.record(call("s-a", 99, vec![])).await.is_err(),
        "closed after shutdown"
    );
    let (rec, report) = Recorder::open(RecorderConfig::new(dir.path()))
        .await
        .unwrap();
    assert_eq!(report.sessions["s-a"].last_seq, 6);
    assert_eq!(report.sessions["s-b"].records, 6);
    assert_eq!(
        rec.record(call(
            "s-a",
            6,
            vec![json!({"role": "user", "content": "x"})]
        ))
        .await
        .unwrap(),
        7
    );
    rec.shutdown().await.unwrap();
    assert_eq!(read_records(dir.path()).unwrap().len(), 19);
}

#[tokio::test]
async fn async_durability_round_trip_and_timed_fsync() {
    let dir = tempfile::tempdir().unwrap();
    let fsyncs = Arc::new(AtomicUsize::new(0));
    let mut cfg = RecorderConfig::new(dir.path());
    cfg.durability = Durability::Async {
        max_delay: Duration::from_millis(20),
    };
    let counter = fsyncs.clone();
    cfg.on_fsync = Some(Arc::new(move |_, n| {
        counter.fetch_add(n, Ordering::SeqCst);
    }));
    let (rec, _) = Recorder::open(cfg).await.unwrap();
    let input = sessions(&["a", "b"], 5);
    for (i, r) in input.iter().enumerate() {
        let seq = rec.record(r.clone()).await.unwrap();
        assert_eq!(seq, (i % 5) as u64 + 1);
    }
    // The writer fsyncs by itself within max_delay.
    for _ in 0..100 {
        if fsyncs.load(Ordering::SeqCst) == 10 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(fsyncs.load(Ordering::SeqCst), 10);
    assert_eq!(read_records(dir.path()).unwrap(), expected(input.clone()));
    rec.shutdown().await.unwrap();
    assert_eq!(read_records(dir.path()).unwrap(), expected(input));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn group_commit_uses_far_fewer_fsyncs_than_records() {
    let dir = tempfile::tempdir().unwrap();
    let fsyncs = Arc::new(AtomicUsize::new(0));
    let covered = Arc::new(AtomicUsize::new(0));
    let mut cfg = RecorderConfig::new(dir.path());
    let (f, c) = (fsyncs.clone(), covered.clone());
    cfg.on_fsync = Some(Arc::new(move |_, n| {
        f.fetch_add(1, Ordering::SeqCst);
        c.fetch_add(n, Ordering::SeqCst);
    }));
    let (rec, _) = Recorder::open(cfg).await.unwrap();
    let tasks: Vec<_> = (0..200)
        .map(|i| {
            let rec = rec.clone();
            let r = call(
                &format!("s{}", i % 10),
                i,
                vec![json!({"role": "user", "content": i})],
            );
            tokio::spawn(async move { rec.record(r).await })
        })
        .collect();
    for t in tasks {
        t.await.unwrap().unwrap();
    }
    let n = fsyncs.load(Ordering::SeqCst);
    assert_eq!(covered.load(Ordering::SeqCst), 200);
    assert_eq!(rec.queue_depth(), 0);
    assert!(n < 50, "{n} fsyncs for 200 records");
    let all = read_records(dir.path()).unwrap();
    assert_eq!(all.len(), 200);
    for s in 0..10 {
        let seqs: Vec<u64> = all
            .iter()
            .filter(|r| r.session_id == format!("s{s}"))
            .map(|r| r.seq)
            .collect();
        assert_eq!(seqs, (1..=20).collect::<Vec<_>>());
    }
    rec.shutdown().await.unwrap();
}

#[tokio::test]
async fn fifty_turn_session_stores_linear_not_quadratic_bytes() {
    let dir = tempfile::tempdir().unwrap();
    let (rec, _) = Recorder::open(RecorderConfig::new(dir.path()))
        .await
        .unwrap();
    let tools: Vec<Value> = (0..44)
        .map(|i| json!({"type": "function", "function": {"name": format!("tool_{i}"), "description": "d".repeat(420)}}))
        .collect();
    assert!(serde_json::to_vec(&tools).unwrap().len() > 20_000);
    let mut msgs = vec![json!({"role": "user", "content": "fix the bug"})];
    let mut new_content = 0u64;
    for turn in 0..50 {
        let mut r = call("long", turn, vec![]);
        r.request =
            json!({"model": "qwen", "messages": msgs.clone(), "tools": tools, "stream": true});
        r.normalized_request = None;
        r.upstream_request = None;
        let added = if turn == 0 {
            serde_json::to_vec(&r.request).unwrap().len()
        } else {
            2 * 1_050
        };
        new_content += added as u64;
        rec.record(r).await.unwrap();
        msgs.push(json!({"role": "assistant", "content": "x".repeat(500), "tool_calls": [{"id": format!("c{turn}"), "function": {"name": "tool_1", "arguments": "{}"}}]}));
        msgs.push(
            json!({"role": "tool", "tool_call_id": format!("c{turn}"), "content": "y".repeat(980)}),
        );
    }
    rec.seal_now().await.unwrap();
    let bytes = stored_bytes(dir.path()).unwrap();
    let s = &bytes.sessions["long"];
    assert_eq!(s.records, 50);
    assert!(
        s.request_delta_bytes < 3 * new_content,
        "{} vs new content {new_content}",
        s.request_delta_bytes
    );
    assert!(
        s.full_request_bytes > 20 * s.request_delta_bytes,
        "full {} vs stored {}",
        s.full_request_bytes,
        s.request_delta_bytes
    );
    let recs = read_records(dir.path()).unwrap();
    assert_eq!(recs[49].request["messages"].as_array().unwrap().len(), 99);
    assert_eq!(recs[49].request["tools"], json!(tools));
    let summary = list_sessions(dir.path()).unwrap();
    assert_eq!(summary[0].stored_request_bytes, s.request_delta_bytes);
    rec.shutdown().await.unwrap();
}

/// The Responses client's request, the internal conversation and the Chat Completions
/// request sent upstream all grow by one turn per call: each is stored as a delta, so the
/// stored bytes (deltas and whole WAL alike) stay linear in what the session added.
#[tokio::test]
async fn fifty_turn_translated_session_stores_all_three_requests_linearly() {
    let dir = tempfile::tempdir().unwrap();
    let (rec, _) = Recorder::open(RecorderConfig::new(dir.path()))
        .await
        .unwrap();
    let desc = "d".repeat(420);
    let resp_tools: Vec<Value> = (0..44)
        .map(|i| json!({"type": "function", "name": format!("tool_{i}"), "description": desc, "parameters": {}}))
        .collect();
    let internal_tools: Vec<Value> = (0..44)
        .map(|i| json!({"name": format!("tool_{i}"), "description": desc, "input_schema": {}}))
        .collect();
    let chat_tools: Vec<Value> = (0..44)
        .map(|i| json!({"type": "function", "function": {"name": format!("tool_{i}"), "description": desc, "parameters": {}}}))
        .collect();
    let mut input = vec![json!({"type": "message", "role": "user", "content": "fix the bug"})];
    let mut internal =
        vec![json!({"role": "user", "content": [{"type": "text", "text": "fix the bug"}]})];
    let mut chat = vec![json!({"role": "user", "content": "fix the bug"})];
    let len = |v: &Value| serde_json::to_vec(v).unwrap().len() as u64;
    let mut new_content = 0u64;
    let mut added: Vec<Value> = Vec::new();
    let mut sent = Vec::new();
    for turn in 0..50 {
        let mut r = call("tr", turn, vec![]);
        r.dialect = "responses".to_owned();
        r.endpoint = "/v1/responses".to_owned();
        r.request = json!({"model": "qwen", "input": input.clone(), "tools": resp_tools, "stream": true, "store": false});
        r.normalized_request = Some(
            json!({"model": "qwen", "messages": internal.clone(), "tools": internal_tools, "sampling": {"temperature": 1.0}, "notes": []}),
        );
        r.upstream_request = Some(
            json!({"model": "qwen", "messages": chat.clone(), "tools": chat_tools, "stream": true}),
        );
        r.upstream_dialect = Some("chat_completions".to_owned());
        new_content += if turn == 0 {
            len(&r.request)
                + len(r.normalized_request.as_ref().unwrap())
                + len(r.upstream_request.as_ref().unwrap())
        } else {
            added.iter().map(len).sum::<u64>()
        };
        rec.record(r.clone()).await.unwrap();
        sent.push(r);

        let (id, text, out) = (format!("c{turn}"), "x".repeat(500), "y".repeat(980));
        added.clear();
        let resp_items = [
            json!({"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": text}]}),
            json!({"type": "function_call", "call_id": id, "name": "tool_1", "arguments": "{}"}),
            json!({"type": "function_call_output", "call_id": id, "output": out}),
        ];
        let internal_items = [
            json!({"role": "assistant", "content": [{"type": "text", "text": text}, {"type": "tool_call", "id": id, "name": "tool_1", "arguments": "{}"}]}),
            json!({"role": "tool", "content": [{"type": "tool_result", "tool_call_id": id, "content": out}]}),
        ];
        let chat_items = [
            json!({"role": "assistant", "content": text, "tool_calls": [{"id": id, "type": "function", "function": {"name": "tool_1", "arguments": "{}"}}]}),
            json!({"role": "tool", "tool_call_id": id, "content": out}),
        ];
        input.extend(resp_items.iter().cloned());
        internal.extend(internal_items.iter().cloned());
        chat.extend(chat_items.iter().cloned());
        added.extend(
            resp_items
                .into_iter()
                .chain(internal_items)
                .chain(chat_items),
        );
    }
    let want = expected(sent);
    assert_eq!(read_records(dir.path()).unwrap(), want, "from the WAL");
    let wal_bytes: u64 = wal_files(dir.path())
        .iter()
        .map(|p| crate::wal::measure_segment(p).unwrap().valid_len)
        .sum();
    assert!(
        wal_bytes < 3 * new_content,
        "WAL holds {wal_bytes} bytes vs new content {new_content}"
    );

    rec.seal_now().await.unwrap();
    let bytes = stored_bytes(dir.path()).unwrap();
    let s = &bytes.sessions["tr"];
    assert_eq!(s.records, 50);
    assert_eq!(&bytes.total, s);
    assert!(
        s.delta_bytes() < 3 * new_content,
        "{} vs new content {new_content}",
        s.delta_bytes()
    );
    for (what, full, stored) in [
        ("request", s.full_request_bytes, s.request_delta_bytes),
        (
            "normalized_request",
            s.full_normalized_request_bytes,
            s.normalized_request_delta_bytes,
        ),
        (
            "upstream_request",
            s.full_upstream_request_bytes,
            s.upstream_request_delta_bytes,
        ),
    ] {
        assert!(full > 20 * stored, "{what}: full {full} vs stored {stored}");
    }
    let recs = read_records(dir.path()).unwrap();
    assert_eq!(recs, want, "from parquet");
    assert_eq!(recs[49].request["input"].as_array().unwrap().len(), 148);
    assert_eq!(
        recs[49].normalized_request.as_ref().unwrap()["messages"]
            .as_array()
            .unwrap()
            .len(),
        99
    );
    let summary = list_sessions(dir.path()).unwrap();
    assert_eq!(summary[0].stored_request_bytes, s.delta_bytes());
    let pq = dir.path().join("out/tr.parquet");
    export_parquet(&recs, &pq).unwrap();
    assert_eq!(read_export_parquet(&pq).unwrap(), want);
    rec.shutdown().await.unwrap();
}

#[tokio::test]
async fn delta_bases_are_kept_for_a_bounded_number_of_sessions() {
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = RecorderConfig::new(dir.path());
    cfg.max_base_sessions = 2;
    let (rec, _) = Recorder::open(cfg).await.unwrap();
    let input = sessions(&["a", "b", "c"], 3);
    let (a, b, c) = (&input[0..3], &input[3..6], &input[6..9]);
    // a and b within the bound: a's second call is stored against its first.
    for r in [&a[0], &b[0], &a[1]] {
        rec.record(r.clone()).await.unwrap();
    }
    // c makes three sessions: b (the least recently written) loses its bases; a, written
    // since, keeps them.
    for r in [&c[0], &a[2], &b[1]] {
        rec.record(r.clone()).await.unwrap();
    }
    rec.shutdown().await.unwrap();
    let stored = crate::reader::read_stored(dir.path()).unwrap();
    let base = |id: &str| {
        stored
            .iter()
            .find(|r| r.call_id == id)
            .unwrap()
            .request_delta
            .base
            .clone()
    };
    assert_eq!(base(&a[1].call_id), Some(a[0].call_id.clone()));
    assert_eq!(base(&a[2].call_id), Some(a[1].call_id.clone()));
    assert_eq!(base(&b[1].call_id), None, "b's bases were dropped");
    // Every call reads back whole, whichever way it was stored.
    let back = read_records(dir.path()).unwrap();
    assert_eq!(back.len(), 6);
    for r in &back {
        let want = input.iter().find(|i| i.call_id == r.call_id).unwrap();
        assert_eq!(r.request, want.request, "{}", r.call_id);
    }
}

#[tokio::test]
async fn forget_session_stores_the_next_call_whole() {
    let dir = tempfile::tempdir().unwrap();
    let (rec, _) = Recorder::open(RecorderConfig::new(dir.path()))
        .await
        .unwrap();
    let input = sessions(&["s"], 3);
    rec.record(input[0].clone()).await.unwrap();
    rec.record(input[1].clone()).await.unwrap();
    rec.forget_session("s");
    rec.record(input[2].clone()).await.unwrap();
    let stored = crate::reader::read_stored(dir.path()).unwrap();
    let bases: Vec<Option<String>> = stored
        .iter()
        .map(|r| r.request_delta.base.clone())
        .collect();
    assert_eq!(bases, vec![None, Some("s-0000".to_owned()), None]);
    assert_eq!(read_records(dir.path()).unwrap(), expected(input));
    rec.shutdown().await.unwrap();
}

#[tokio::test]
async fn rotation_by_size_and_age_seals_in_the_background_and_partitions_by_day() {
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = RecorderConfig::new(dir.path());
    cfg.segment_max_bytes = 2_000;
    cfg.seal_after = Duration::from_millis(100);
    let (rec, _) = Recorder::open(cfg).await.unwrap();
    let mut input = sessions(&["a", "b"], 8);
    for (i, r) in input.iter_mut().enumerate() {
        r.started_at_us += (i as i64 % 2) * DAY_US; // two days
        rec.record(r.clone()).await.unwrap();
    }
    // Size rotation happened; the age timer seals the rest.
    let mut sealed_all = false;
    for _ in 0..100 {
        tokio::time::sleep(Duration::from_millis(20)).await;
        if wal_files(dir.path()).is_empty() {
            sealed_all = true;
            break;
        }
    }
    assert!(sealed_all, "WAL left: {:?}", wal_files(dir.path()));
    assert!(manifests(dir.path()) > 1);
    assert!(dir.path().join("records/date=2025-06-15").is_dir());
    assert!(dir.path().join("records/date=2025-06-16").is_dir());
    assert_eq!(read_records(dir.path()).unwrap(), expected(input));
    rec.shutdown().await.unwrap();
}

#[tokio::test]
async fn export_redacts_and_parquet_export_reads_back() {
    let dir = tempfile::tempdir().unwrap();
    let (rec, _) = Recorder::open(RecorderConfig::new(dir.path()))
        .await
        .unwrap();
    let mut r = call("s", 0, vec![json!({"role": "user", "content": "hi"})]);
    r.request["api_key"] = json!("sk-secret");
    r.normalized_request.as_mut().unwrap()["notes"] = json!([{"Authorization": "Bearer sk-norm"}]);
    r.normalized_response.as_mut().unwrap()["api-key"] = json!("sk-nresp");
    r.upstream_request.as_mut().unwrap()["x-api-key"] = json!("sk-upstream");
    r.usage = None;
    r.prompt_token_ids = None;
    rec.record(r).await.unwrap();
    rec.record(call("s", 1, vec![])).await.unwrap();
    rec.shutdown().await.unwrap();
    let recs = read_records(dir.path()).unwrap();
    assert_eq!(
        recs[0].request["api_key"], "sk-secret",
        "the recorder stores what the caller gave"
    );

    let jsonl = dir.path().join("out/calls.jsonl");
    export_jsonl(&recs, &jsonl).unwrap();
    let text = std::fs::read_to_string(&jsonl).unwrap();
    assert!(!text.contains("sk-secret"));
    let back: Vec<CallRecord> = text
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(back[0].request["api_key"], REDACTED);
    for secret in ["sk-norm", "sk-nresp", "sk-upstream"] {
        assert!(!text.contains(secret), "{secret} in the JSONL export");
    }
    let b = &back[0];
    assert_eq!(
        b.normalized_request.as_ref().unwrap()["notes"][0]["Authorization"],
        REDACTED
    );
    assert_eq!(b.normalized_response.as_ref().unwrap()["api-key"], REDACTED);
    assert_eq!(b.upstream_request.as_ref().unwrap()["x-api-key"], REDACTED);
    assert_eq!(
        b.upstream_dialect.as_deref(),
        Some("anthropic_messages"),
        "exports carry the v2 fields"
    );
    let mut manual = recs[0].clone();
    manual.redact_credentials();
    assert_eq!(&manual, b);

    let pq = dir.path().join("out/calls.parquet");
    export_parquet(&recs, &pq).unwrap();
    assert_eq!(read_export_parquet(&pq).unwrap(), back);
    let cols: Vec<String> = parquet::arrow::arrow_reader::ParquetRecordBatchReaderBuilder::try_new(
        std::fs::File::open(&pq).unwrap(),
    )
    .unwrap()
    .schema()
    .fields()
    .iter()
    .map(|f| f.name().clone())
    .collect();
    for c in [
        "request",
        "normalized_request",
        "normalized_response",
        "upstream_request",
        "upstream_dialect",
        "sampling",
        "attempt",
        "retry_of",
        "headers",
        "backend_finish_reason",
        "stop_matched",
        "replay",
    ] {
        assert!(cols.iter().any(|x| x == c), "export column {c}: {cols:?}");
    }
}

#[tokio::test]
async fn list_sessions_joins_records_and_events() {
    let dir = tempfile::tempdir().unwrap();
    let (log, _) = SessionLog::open(dir.path()).unwrap();
    log.append(&SessionEvent::Created {
        session_id: "s-a".into(),
        group_id: Some("grp".into()),
        key_sha256: None,
        metadata: json!({}),
        sampling: None,
        backend: None,
        at_us: T0 - 10,
    })
    .await
    .unwrap();
    log.append(&SessionEvent::Created {
        session_id: "idle".into(),
        group_id: None,
        key_sha256: None,
        metadata: json!({}),
        sampling: None,
        backend: None,
        at_us: T0 + 5,
    })
    .await
    .unwrap();
    log.append(&SessionEvent::Reward {
        session_id: "s-a".into(),
        reward: 1.0,
        info: json!({}),
        at_us: T0 + DAY_US,
    })
    .await
    .unwrap();
    log.append(&SessionEvent::Closed {
        session_id: "s-a".into(),
        at_us: T0 + DAY_US,
    })
    .await
    .unwrap();
    let (rec, _) = Recorder::open(RecorderConfig::new(dir.path()))
        .await
        .unwrap();
    for r in sessions(&["s-a"], 7) {
        rec.record(r).await.unwrap();
    }
    rec.shutdown().await.unwrap();
    let list = list_sessions(dir.path()).unwrap();
    assert_eq!(list.len(), 2);
    let a = &list[0];
    assert_eq!(
        (a.session_id.as_str(), a.calls, a.errors, a.closed),
        ("s-a", 7, 1, true)
    );
    assert_eq!(
        (a.group_id.as_deref(), a.reward, a.first_us),
        (Some("grp"), Some(1.0), T0 - 10)
    );
    assert_eq!((list[1].session_id.as_str(), list[1].calls), ("idle", 0));
}

#[tokio::test]
async fn read_session_reads_one_session_from_sealed_and_unsealed_segments() {
    let dir = tempfile::tempdir().unwrap();
    let (log, _) = SessionLog::open(dir.path()).unwrap();
    log.append(&SessionEvent::Created {
        session_id: "s-b".into(),
        group_id: Some("grp".into()),
        key_sha256: None,
        metadata: json!({"harness": "codex", "task_id": "t1"}),
        sampling: None,
        backend: None,
        at_us: T0 - 10,
    })
    .await
    .unwrap();
    let (rec, _) = Recorder::open(RecorderConfig::new(dir.path()))
        .await
        .unwrap();
    // Interleaved sessions, half sealed to Parquet, the rest left in the WAL.
    let mut input = sessions(&["s-a", "s-b", "s-c"], 8);
    input.sort_by_key(|r| (r.started_at_us, r.session_id.clone()));
    for (i, r) in input.iter_mut().enumerate() {
        if r.session_id == "s-b" && i % 2 == 0 {
            r.weight_version = Some("v4".into());
        }
    }
    let (first, rest) = input.split_at(input.len() / 2);
    for r in first {
        rec.record(r.clone()).await.unwrap();
    }
    rec.seal_now().await.unwrap();
    for r in rest {
        rec.record(r.clone()).await.unwrap();
    }
    // Stopped as a crash would leave it: the second half stays unsealed.
    rec.halt().await;
    assert_eq!(manifests(dir.path()), 1, "half of it sealed");
    assert!(!wal_files(dir.path()).is_empty(), "the rest in the WAL");

    let all = read_records(dir.path()).unwrap();
    for id in ["s-a", "s-b", "s-c"] {
        let want: Vec<_> = all.iter().filter(|r| r.session_id == id).cloned().collect();
        assert_eq!(want.len(), 8);
        assert_eq!(read_session(dir.path(), id).unwrap(), want, "session {id}");
    }
    assert!(read_session(dir.path(), "nobody").unwrap().is_empty());

    let list = list_sessions(dir.path()).unwrap();
    let b = list.iter().find(|s| s.session_id == "s-b").unwrap();
    assert_eq!(b.harness.as_deref(), Some("codex"));
    assert_eq!(b.client.as_deref(), Some("test/1.0"));
    assert_eq!(b.weight_versions, vec!["v3".to_owned(), "v4".to_owned()]);
    let a = list.iter().find(|s| s.session_id == "s-a").unwrap();
    assert_eq!((a.harness.as_deref(), a.calls, a.errors), (None, 8, 1));
    assert_eq!(a.weight_versions, vec!["v3".to_owned()]);
}

/// Records written and fsynced, then the writer stopped as a crash would leave it.
async fn crashed_dir(dir: &Path, input: &[CallRecord]) {
    let (rec, _) = Recorder::open(RecorderConfig::new(dir)).await.unwrap();
    for r in input {
        rec.record(r.clone()).await.unwrap();
    }
    rec.halt().await;
}

#[tokio::test]
async fn a_sealed_segment_whose_wal_survived_is_not_duplicated() {
    let dir = tempfile::tempdir().unwrap();
    let input = sessions(&["a", "b"], 4);
    crashed_dir(dir.path(), &input).await;
    let wal = wal_files(dir.path());
    assert_eq!(wal.len(), 1);
    let wal_bytes = std::fs::read(&wal[0]).unwrap();

    // Crash after the manifest, before the WAL delete.
    let (rec, report) = Recorder::open(RecorderConfig::new(dir.path()))
        .await
        .unwrap();
    assert_eq!(
        (
            report.recovered_records,
            report.sealed_segments,
            report.torn_bytes_dropped
        ),
        (8, 1, 0)
    );
    rec.shutdown().await.unwrap();
    std::fs::write(&wal[0], &wal_bytes).unwrap();
    assert_eq!(read_records(dir.path()).unwrap(), expected(input.clone()));
    let (rec, report) = Recorder::open(RecorderConfig::new(dir.path()))
        .await
        .unwrap();
    assert_eq!((report.recovered_records, report.sealed_segments), (0, 0));
    assert!(!wal[0].exists());
    rec.shutdown().await.unwrap();
    assert_eq!(read_records(dir.path()).unwrap(), expected(input.clone()));

    // Crash after the parquet rename, before the manifest: the WAL wins, then re-seals.
    std::fs::write(&wal[0], &wal_bytes).unwrap();
    std::fs::remove_file(dir.path().join("records/_sealed/seg-00000001.json")).unwrap();
    assert_eq!(read_records(dir.path()).unwrap(), expected(input.clone()));
    let (rec, report) = Recorder::open(RecorderConfig::new(dir.path()))
        .await
        .unwrap();
    assert_eq!((report.recovered_records, report.sealed_segments), (8, 1));
    rec.shutdown().await.unwrap();
    assert_eq!(read_records(dir.path()).unwrap(), expected(input));
}

#[tokio::test]
async fn a_missing_base_is_an_error_naming_both_calls() {
    let dir = tempfile::tempdir().unwrap();
    let input = sessions(&["a"], 3);
    let (rec, _) = Recorder::open(RecorderConfig::new(dir.path()))
        .await
        .unwrap();
    rec.record(input[0].clone()).await.unwrap();
    rec.seal_now().await.unwrap();
    rec.record(input[1].clone()).await.unwrap();
    rec.shutdown().await.unwrap();
    let first = crate::seal::list_parquet(dir.path()).unwrap()[0].1.clone();
    std::fs::remove_file(first).unwrap();
    let err = read_records(dir.path()).unwrap_err().to_string();
    assert!(err.contains("a-0001") && err.contains("a-0000"), "{err}");
}

struct Fixture {
    input: Vec<CallRecord>,
    wal: Vec<u8>,
    /// End offset of each frame, in WAL order (== input order).
    ends: Vec<usize>,
}

fn fixture() -> &'static Fixture {
    static FIXTURE: std::sync::OnceLock<Fixture> = std::sync::OnceLock::new();
    FIXTURE.get_or_init(|| {
        let dir = tempfile::tempdir().unwrap();
        let mut input = sessions(&["a", "b"], 6);
        // Interleave sessions, as concurrent rollouts do.
        input.sort_by_key(|r| (r.started_at_us, r.session_id.clone()));
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(crashed_dir(dir.path(), &input));
        let wal = std::fs::read(&wal_files(dir.path())[0]).unwrap();
        let mut ends = Vec::new();
        let mut pos = 0;
        while pos < wal.len() {
            let len = u32::from_le_bytes(wal[pos..pos + 4].try_into().unwrap()) as usize;
            if len == 0 {
                // The writer's zero-filled lead.
                assert!(wal[pos..].iter().all(|&b| b == 0));
                break;
            }
            pos += 8 + len;
            ends.push(pos);
        }
        let wal = wal[..pos].to_vec();
        assert_eq!(ends.len(), input.len());
        Fixture { input, wal, ends }
    })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 40, ..ProptestConfig::default() })]

    #[test]
    fn torn_wal_tails_are_dropped_and_every_complete_record_survives_once(
        cut in any::<prop::sample::Index>(),
        garbage in prop::collection::vec(any::<u8>(), 0..40),
        flip in any::<Option<prop::sample::Index>>(),
    ) {
        let fx = fixture();
        let mut bytes = fx.wal[..cut.index(fx.wal.len() + 1)].to_vec();
        let mut intact = bytes.len();
        // Optionally corrupt one byte: everything from its frame on is a tail.
        if let Some(flip) = flip.filter(|_| !bytes.is_empty()) {
            let at = flip.index(bytes.len());
            bytes[at] ^= 0x5a;
            intact = intact.min(at);
        }
        bytes.extend_from_slice(&garbage);
        let complete = fx.ends.iter().filter(|&&e| e <= intact).count();
        let valid_len = if complete == 0 { 0 } else { fx.ends[complete - 1] };

        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(dir.path().join("wal")).unwrap();
        std::fs::write(dir.path().join("wal/00000001.wal"), &bytes).unwrap();
        // What readers see before recovery: the same prefix.
        let want = expected(fx.input[..complete].to_vec());
        prop_assert_eq!(&read_records(dir.path()).unwrap(), &want);

        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        rt.block_on(async {
            let (rec, report) = Recorder::open(RecorderConfig::new(dir.path())).await.unwrap();
            assert_eq!(report.recovered_records, complete as u64);
            // Zeros at the very end are a zero-filled lead, not torn data.
            let torn_end = bytes[valid_len..].iter().rposition(|&b| b != 0).map_or(valid_len, |i| valid_len + i + 1);
            assert_eq!(report.torn_bytes_dropped, (torn_end - valid_len) as u64);
            assert_eq!(report.sealed_segments, u64::from(complete > 0));
            let last_a = want.iter().filter(|r| r.session_id == "a").count() as u64;
            let seq = rec.record(call("a", 100, vec![])).await.unwrap();
            assert_eq!(seq, last_a + 1);
            rec.shutdown().await.unwrap();
        });
        let mut all = read_records(dir.path()).unwrap();
        all.retain(|r| r.call_id != "a-0100");
        prop_assert_eq!(&all, &want);
        let rt2 = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        let report = rt2.block_on(async {
            let (rec, report) = Recorder::open(RecorderConfig::new(dir.path())).await.unwrap();
            rec.shutdown().await.unwrap();
            report
        });
        prop_assert_eq!(report.recovered_records, 0);
    }
}

#[tokio::test]
async fn v2_values_of_any_shape_round_trip_through_wal_and_parquet() {
    let dir = tempfile::tempdir().unwrap();
    let (rec, _) = Recorder::open(RecorderConfig::new(dir.path()))
        .await
        .unwrap();
    let mut input = sessions(&["odd"], 6);
    input[0].normalized_request = Some(Value::Null);
    input[0].normalized_response = Some(Value::Null);
    let long = format!("héllo {}", "w".repeat(300));
    input[1].normalized_request = Some(json!({"prompt": long}));
    input[2].normalized_request = Some(json!({"prompt": format!("{long} wörld"), "model": "m"}));
    input[3].normalized_request = None;
    input[3].normalized_response = None;
    input[3].upstream_dialect = None;
    input[4].normalized_request = Some(json!({"prompt": format!("{long} wörld!")}));
    input[5].upstream_request = Some(json!([1, 2]));
    for r in &input {
        rec.record(r.clone()).await.unwrap();
    }
    let want = expected(input);
    assert_eq!(read_records(dir.path()).unwrap(), want, "from the WAL");
    let stored = crate::reader::read_stored(dir.path()).unwrap();
    let base = stored[4].normalized_request_delta.as_ref().unwrap();
    assert_eq!(
        (base.base.as_deref(), base.field.as_deref()),
        (Some("odd-0002"), Some("prompt")),
        "skips call 3, which has no normalized request"
    );
    rec.shutdown().await.unwrap();
    assert_eq!(read_records(dir.path()).unwrap(), want, "from parquet");
}

#[test]
fn a_delta_against_a_base_without_that_value_is_an_error_naming_it() {
    let dir = tempfile::tempdir().unwrap();
    let mut first = call("s", 0, vec![]);
    first.normalized_request = None;
    let mut second = call("s", 1, vec![json!({"role": "user", "content": "hi"})]);
    first.seq = 1;
    second.seq = 2;
    let none = crate::record::Deltas {
        request: delta::encode(None, &first.request),
        normalized_request: None,
        upstream_request: None,
        prompt_token_ids: None,
    };
    let base = json!({"model": "qwen", "messages": []});
    let bad = crate::record::Deltas {
        request: delta::encode(Some(("s-0000", &first.request)), &second.request),
        normalized_request: Some(delta::encode(
            Some(("s-0000", &base)),
            second.normalized_request.as_ref().unwrap(),
        )),
        upstream_request: None,
        prompt_token_ids: None,
    };
    let mut buf = Vec::new();
    for (r, d) in [(first, none), (second, bad)] {
        let (stored, _) = crate::record::StoredRecord::from_call(r, d);
        crate::wal::append_frame(&serde_json::to_vec(&stored).unwrap(), &mut buf);
    }
    std::fs::create_dir_all(dir.path().join("wal")).unwrap();
    std::fs::write(dir.path().join("wal/00000001.wal"), buf).unwrap();
    let err = read_records(dir.path()).unwrap_err().to_string();
    assert!(
        err.contains("s-0001") && err.contains("normalized_request"),
        "{err}"
    );
}

/// Stored prompt ids of `stored` (whole or appended), and how many were stored as deltas.
fn stored_prompt_ids(stored: &[crate::record::StoredRecord]) -> (usize, usize) {
    let mut ids = 0;
    let mut deltas = 0;
    for r in stored {
        ids += r.prompt_token_ids.as_ref().map_or(0, Vec::len);
        if let Some(d) = &r.prompt_token_ids_delta {
            assert!(r.prompt_token_ids.is_none(), "{}", r.call_id);
            ids += d.append.len();
            deltas += 1;
        }
    }
    (ids, deltas)
}

#[tokio::test]
async fn fifty_turn_session_stores_prompt_token_ids_linearly() {
    let dir = tempfile::tempdir().unwrap();
    let (rec, _) = Recorder::open(RecorderConfig::new(dir.path()))
        .await
        .unwrap();
    let mut prompt: Vec<u32> = (0..2_000).collect();
    let mut new_tokens = prompt.len();
    let mut input = Vec::new();
    for turn in 0..50u32 {
        let mut r = call("ids", turn as usize, vec![]);
        let completion: Vec<u32> = (0..60).map(|i| 100_000 + turn * 100 + i).collect();
        r.prompt_token_ids = Some(prompt.clone());
        r.completion_token_ids = Some(completion.clone());
        input.push(r.clone());
        rec.record(r).await.unwrap();
        // Next prompt: this one, its completion, then a new user turn. Every 7th turn the
        // completion's last 5 ids are re-tokenized differently (longest common prefix).
        prompt.extend_from_slice(&completion);
        if turn % 7 == 3 {
            prompt.truncate(prompt.len() - 5);
            prompt.extend(200_000 + turn * 10..200_000 + turn * 10 + 5);
            new_tokens += 5;
        }
        let user: Vec<u32> = (0..40).map(|i| 300_000 + turn * 100 + i).collect();
        prompt.extend_from_slice(&user);
        if turn < 49 {
            new_tokens += 60 + 40;
        }
    }
    let want = expected(input);

    let stored = crate::reader::read_stored(dir.path()).unwrap();
    let (ids, deltas) = stored_prompt_ids(&stored);
    assert_eq!(deltas, 49);
    assert!(ids < 3 * new_tokens, "{ids} stored vs {new_tokens} new");
    let full: usize = want
        .iter()
        .map(|r| r.prompt_token_ids.as_ref().unwrap().len())
        .sum();
    assert!(full > 20 * ids, "full {full} vs stored {ids}");
    let wal_bytes: u64 = wal_files(dir.path())
        .iter()
        .map(|p| crate::wal::measure_segment(p).unwrap().valid_len)
        .sum();
    // ~7 bytes of JSON per id; the full prompts would be > 1.7M ids.
    assert!(wal_bytes < 1_000_000, "WAL is {wal_bytes} bytes");
    assert_eq!(read_records(dir.path()).unwrap(), want, "from the WAL");

    rec.seal_now().await.unwrap();
    assert!(wal_files(dir.path()).is_empty());
    let stored = crate::reader::read_stored(dir.path()).unwrap();
    assert_eq!(
        stored_prompt_ids(&stored),
        (ids, deltas),
        "sealed as stored"
    );
    assert_eq!(read_records(dir.path()).unwrap(), want, "from parquet");

    let out = dir.path().join("export/ids.parquet");
    export_parquet(&want, &out).unwrap();
    let back = read_export_parquet(&out).unwrap();
    assert_eq!(back[49].prompt_token_ids, want[49].prompt_token_ids);
    rec.shutdown().await.unwrap();
}

#[tokio::test]
async fn an_unrelated_prompt_is_stored_whole() {
    let dir = tempfile::tempdir().unwrap();
    let (rec, _) = Recorder::open(RecorderConfig::new(dir.path()))
        .await
        .unwrap();
    let mut a = call("u", 0, vec![]);
    a.prompt_token_ids = Some((1..100).collect());
    let mut b = call("u", 1, vec![]);
    b.prompt_token_ids = Some((500..600).collect());
    let mut c = call("u", 2, vec![]);
    c.prompt_token_ids = None;
    let mut d = call("u", 3, vec![]);
    d.prompt_token_ids = Some((1..50).chain(700..710).collect());
    let input = vec![a, b, c, d];
    for r in &input {
        rec.record(r.clone()).await.unwrap();
    }
    let check = |stored: Vec<crate::record::StoredRecord>| {
        let mut stored = stored;
        stored.sort_by_key(|r| r.seq);
        assert!(stored[0].prompt_token_ids_delta.is_none());
        assert!(stored[1].prompt_token_ids_delta.is_none());
        assert_eq!(stored[1].prompt_token_ids, input[1].prompt_token_ids);
        assert!(stored[2].prompt_token_ids.is_none() && stored[2].prompt_token_ids_delta.is_none());
        // Against the first call (longest common prefix), not the most recent one.
        let delta = stored[3].prompt_token_ids_delta.clone().unwrap();
        assert_eq!((delta.base.as_str(), delta.keep), ("u-0000", 49));
        assert_eq!(delta.append, (700..710).collect::<Vec<u32>>());
    };
    check(crate::reader::read_stored(dir.path()).unwrap());
    assert_eq!(read_records(dir.path()).unwrap(), expected(input.clone()));
    rec.seal_now().await.unwrap();
    check(crate::reader::read_stored(dir.path()).unwrap());
    assert_eq!(read_records(dir.path()).unwrap(), expected(input.clone()));
    rec.shutdown().await.unwrap();
}

#[test]
fn a_prompt_ids_delta_with_a_missing_base_is_an_error_naming_it() {
    let dir = tempfile::tempdir().unwrap();
    let mut r = call("m", 0, vec![]);
    r.seq = 1;
    let deltas = crate::record::Deltas {
        request: delta::encode(None, &r.request),
        normalized_request: None,
        upstream_request: None,
        prompt_token_ids: Some(delta::TokenIdsDelta {
            base: "gone-call".to_owned(),
            keep: 2,
            append: vec![7],
        }),
    };
    r.normalized_request = None;
    r.upstream_request = None;
    let (stored, _) = crate::record::StoredRecord::from_call(r, deltas);
    let mut buf = Vec::new();
    crate::wal::append_frame(&serde_json::to_vec(&stored).unwrap(), &mut buf);
    std::fs::create_dir_all(dir.path().join("wal")).unwrap();
    std::fs::write(dir.path().join("wal/00000001.wal"), buf).unwrap();
    let err = read_records(dir.path()).unwrap_err().to_string();
    assert!(err.contains("gone-call") && err.contains("m-0000"), "{err}");

    // A base whose sequence is shorter than `keep` is damaged data, not a panic.
    let ok = delta::decode_ids(
        &[1, 2],
        &delta::TokenIdsDelta {
            base: "b".to_owned(),
            keep: 3,
            append: vec![],
        },
    );
    assert!(ok.is_err());
}

/// Row groups and rows of a parquet file.
fn row_groups(path: &Path) -> (usize, i64) {
    use parquet::file::reader::{FileReader, SerializedFileReader};
    let reader = SerializedFileReader::new(std::fs::File::open(path).unwrap()).unwrap();
    let meta = reader.metadata();
    (meta.num_row_groups(), meta.file_metadata().num_rows())
}

#[tokio::test]
async fn a_segment_larger_than_the_seal_budget_streams_into_row_groups_and_reads_back() {
    use crate::columnar::RowGroups;
    use crate::seal::{SealLimits, seal_segment_with};

    let dir = tempfile::tempdir().unwrap();
    let mut input = sessions(&["a", "b", "c"], 40);
    // Interleaved sessions, and two days in one segment: two day files written side by side.
    input.sort_by_key(|r| (r.started_at_us, r.session_id.clone()));
    for (i, r) in input.iter_mut().enumerate() {
        r.started_at_us += i64::from(i % 3 == 0) * DAY_US;
    }
    crashed_dir(dir.path(), &input).await;
    assert_eq!(wal_files(dir.path()).len(), 1);
    let limits = SealLimits {
        batch_rows: 7,
        batch_bytes: 4_000,
        row_groups: RowGroups {
            max_rows: 10,
            max_bytes: 1 << 20,
        },
    };
    let (manifest, stats) = seal_segment_with(dir.path(), 1, limits).unwrap();
    let manifest = manifest.unwrap();
    assert_eq!(manifest.records, 120);
    assert_eq!(manifest.files.len(), 2);
    assert!(wal_files(dir.path()).is_empty());
    // Never more than one batch per day file was held: not the segment's 120 rows.
    assert!((1..=2 * 7).contains(&stats.max_pending_rows), "{stats:?}");
    assert!(stats.max_pending_bytes < 2 * (4_000 + 2_000), "{stats:?}");
    let mut rows = 0;
    for file in &manifest.files {
        let (groups, n) = row_groups(&dir.path().join("records").join(file));
        assert_eq!(groups, (n as usize).div_ceil(10), "{file}: {n} rows");
        rows += n;
    }
    assert_eq!(rows, 120);
    assert_eq!(read_records(dir.path()).unwrap(), expected(input.clone()));
    // And the recorder opens it as sealed, nothing to recover.
    let (rec, report) = Recorder::open(RecorderConfig::new(dir.path()))
        .await
        .unwrap();
    assert_eq!((report.recovered_records, report.sealed_segments), (0, 0));
    assert_eq!(report.sessions["a"].last_seq, 40);
    rec.shutdown().await.unwrap();
    assert_eq!(read_records(dir.path()).unwrap(), expected(input));
}

#[tokio::test]
async fn a_segment_past_one_row_group_seals_with_the_default_budget_and_reads_back() {
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = RecorderConfig::new(dir.path());
    cfg.durability = Durability::Async {
        max_delay: Duration::from_millis(50),
    };
    let (rec, _) = Recorder::open(cfg).await.unwrap();
    // 20 000 small records in 500 sessions: past the default row group (16 384 rows) and
    // many seal batches.
    let input: Vec<CallRecord> = (0..20_000)
        .map(|i| CallRecord {
            schema_version: SCHEMA_VERSION,
            call_id: format!("c{i:05}"),
            session_id: format!("s{:03}", i % 500),
            started_at_us: T0 + i as i64,
            finished_at_us: T0 + i as i64 + 1,
            dialect: "chat_completions".to_owned(),
            endpoint: "/v1/chat/completions".to_owned(),
            request: json!({"model": "m", "messages": [{"role": "user", "content": i}]}),
            response: Some(json!({"choices": [{"message": {"content": format!("a{i}")}}]})),
            status: 200,
            outcome: "ok".to_owned(),
            completion_token_ids: Some(vec![i as u32, 2]),
            latency_ms: 1.0,
            ..CallRecord::default()
        })
        .collect();
    for r in &input {
        rec.record(r.clone()).await.unwrap();
    }
    rec.shutdown().await.unwrap();
    let files = crate::seal::list_parquet(dir.path()).unwrap();
    assert_eq!(files.len(), 1);
    assert_eq!(row_groups(&files[0].1), (2, 20_000));
    let got = read_records(dir.path()).unwrap();
    assert_eq!(got.len(), 20_000);
    assert_eq!(got, expected(input));
}

#[tokio::test]
async fn a_crash_between_the_parquet_tmp_and_its_rename_recovers_every_record_once() {
    let dir = tempfile::tempdir().unwrap();
    let mut input = sessions(&["a", "b"], 6);
    for (i, r) in input.iter_mut().enumerate() {
        r.started_at_us += (i as i64 % 2) * DAY_US; // two day files
    }
    crashed_dir(dir.path(), &input).await;
    let wal = wal_files(dir.path());
    let wal_bytes = std::fs::read(&wal[0]).unwrap();

    // Seal once to get real parquet files, then put the directory back the way a crash
    // during the seal leaves it: the first day renamed, the second day still a (torn)
    // dot-tmp, no manifest, the WAL still there.
    crate::seal::seal_segment(dir.path(), 1).unwrap().unwrap();
    std::fs::remove_file(dir.path().join("records/_sealed/seg-00000001.json")).unwrap();
    std::fs::write(&wal[0], &wal_bytes).unwrap();
    let day2 = dir.path().join("records/date=2025-06-16");
    let full = std::fs::read(day2.join("seg-00000001.parquet")).unwrap();
    std::fs::remove_file(day2.join("seg-00000001.parquet")).unwrap();
    let tmp = day2.join(".seg-00000001.parquet.tmp");
    std::fs::write(&tmp, &full[..full.len() / 2]).unwrap();
    // Readers see the WAL (the renamed day file has no manifest) and skip the tmp.
    assert_eq!(read_records(dir.path()).unwrap(), expected(input.clone()));

    let (rec, report) = Recorder::open(RecorderConfig::new(dir.path()))
        .await
        .unwrap();
    assert_eq!(
        (
            report.recovered_records,
            report.sealed_segments,
            report.torn_bytes_dropped
        ),
        (12, 1, 0)
    );
    assert!(!tmp.exists());
    assert!(wal_files(dir.path()).is_empty());
    let seq = rec.record(call("a", 100, vec![])).await.unwrap();
    assert_eq!(seq, 7);
    rec.shutdown().await.unwrap();
    let mut all = read_records(dir.path()).unwrap();
    all.retain(|r| r.call_id != "a-0100");
    assert_eq!(all, expected(input));
    assert_eq!(crate::seal::list_parquet(dir.path()).unwrap().len(), 3);
}

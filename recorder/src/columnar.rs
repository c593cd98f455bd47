//! Records as Arrow record batches in Parquet (zstd): one row per call, one column per
//! `CallRecord` field; `usage` as three nullable UInt64 columns; JSON values as JSON text:
//! the growing ones as deltas in sealed segments (`request_delta`,
//! `normalized_request_delta`, `upstream_request_delta`) and full in exports (`request`,
//! `normalized_request`, `upstream_request`); `response` and `normalized_response` as is.
//! Columns added by later schema versions come after the older ones and are nullable; a
//! file without them (written by an older version) reads them as null.

use std::fs::File;
use std::path::Path;
use std::sync::Arc;

use arrow_array::BooleanArray;
use arrow_array::builder::{
    BooleanBuilder, Float32Builder, Float64Builder, Int64Builder, ListBuilder, StringBuilder,
    UInt16Builder, UInt32Builder, UInt64Builder,
};
use arrow_array::cast::AsArray;
use arrow_array::types::{Float32Type, Float64Type, Int64Type, UInt16Type, UInt32Type, UInt64Type};
use arrow_array::{Array, ArrayRef, ArrowPrimitiveType, PrimitiveArray, RecordBatch, StringArray};
use arrow_schema::ArrowError;
use arrow_schema::{DataType, Field, Schema, SchemaRef};
use parquet::arrow::arrow_reader::{ArrowPredicateFn, ParquetRecordBatchReaderBuilder, RowFilter};
use parquet::arrow::{ArrowWriter, ProjectionMask};
use parquet::basic::{Compression, ZstdLevel};
use parquet::file::properties::WriterProperties;

use crate::error::{RecorderError, Result};
use crate::record::{StoredRecord, Usage};

/// Names of the columns holding the growing JSON values: deltas or full values.
#[derive(Debug, Clone, Copy)]
pub(crate) struct JsonColumns {
    pub request: &'static str,
    pub normalized_request: &'static str,
    pub upstream_request: &'static str,
}

/// Sealed segments: deltas.
pub(crate) const DELTA_COLUMNS: JsonColumns = JsonColumns {
    request: "request_delta",
    normalized_request: "normalized_request_delta",
    upstream_request: "upstream_request_delta",
};

/// Exports: full values.
pub(crate) const FULL_COLUMNS: JsonColumns = JsonColumns {
    request: "request",
    normalized_request: "normalized_request",
    upstream_request: "upstream_request",
};

const BATCH_ROWS: usize = 4096;
const ROW_GROUP_ROWS: usize = 16 * 1024;
/// Estimated encoded bytes; the row group in progress is held in memory (compressed) until
/// it is closed.
const ROW_GROUP_BYTES: usize = 32 * 1024 * 1024;
const ZSTD_LEVEL: i32 = 3;

pub(crate) fn schema(json: JsonColumns) -> SchemaRef {
    let list = |name: &str, item: DataType| {
        Field::new(
            name,
            DataType::List(Arc::new(Field::new_list_field(item, true))),
            true,
        )
    };
    Arc::new(Schema::new(vec![
        Field::new("schema_version", DataType::UInt32, false),
        Field::new("call_id", DataType::Utf8, false),
        Field::new("session_id", DataType::Utf8, false),
        Field::new("group_id", DataType::Utf8, true),
        Field::new("seq", DataType::UInt64, false),
        Field::new("started_at_us", DataType::Int64, false),
        Field::new("finished_at_us", DataType::Int64, false),
        Field::new("dialect", DataType::Utf8, false),
        Field::new("endpoint", DataType::Utf8, false),
        Field::new("model", DataType::Utf8, true),
        Field::new("upstream", DataType::Utf8, false),
        Field::new("stream", DataType::Boolean, false),
        Field::new(json.request, DataType::Utf8, false),
        Field::new("response", DataType::Utf8, true),
        Field::new("status", DataType::UInt16, false),
        Field::new("outcome", DataType::Utf8, false),
        Field::new("error", DataType::Utf8, true),
        list("prompt_token_ids", DataType::UInt32),
        list("completion_token_ids", DataType::UInt32),
        list("completion_logprobs", DataType::Float32),
        Field::new("finish_reason", DataType::Utf8, true),
        Field::new("weight_version", DataType::Utf8, true),
        Field::new("usage_prompt_tokens", DataType::UInt64, true),
        Field::new("usage_completion_tokens", DataType::UInt64, true),
        Field::new("usage_total_tokens", DataType::UInt64, true),
        Field::new("ttft_ms", DataType::Float64, true),
        Field::new("latency_ms", DataType::Float64, false),
        Field::new("client", DataType::Utf8, true),
        // v2
        Field::new(json.normalized_request, DataType::Utf8, true),
        Field::new("normalized_response", DataType::Utf8, true),
        Field::new(json.upstream_request, DataType::Utf8, true),
        Field::new("upstream_dialect", DataType::Utf8, true),
        // Additive, no version of its own: JSON `{"base", "keep", "append"}`; null in exports.
        Field::new("prompt_token_ids_delta", DataType::Utf8, true),
        // v3: JSON `[{"version", "start", "end"}]`.
        Field::new("weight_version_spans", DataType::Utf8, true),
        // Additive: the sampling policy applied (JSON), the attempt and its first attempt.
        Field::new("sampling", DataType::Utf8, true),
        Field::new("attempt", DataType::UInt32, true),
        Field::new("retry_of", DataType::Utf8, true),
        Field::new("headers", DataType::Utf8, true),
        // Additive: exact mode's backend finish reason and what a stop matched (JSON).
        Field::new("backend_finish_reason", DataType::Utf8, true),
        Field::new("stop_matched", DataType::Utf8, true),
        // Additive: a branch session's call, replayed or live (JSON `Replay`).
        Field::new("replay", DataType::Utf8, true),
    ]))
}

/// A row to write: the record's fields plus the text of its JSON columns (deltas or full
/// values, as the file's [`JsonColumns`] say).
pub(crate) struct Row<'a> {
    pub rec: &'a StoredRecord,
    pub text: &'a RowText,
}

/// JSON text of a row's JSON columns.
#[derive(Debug, Clone, Default)]
pub(crate) struct RowText {
    pub request: String,
    pub response: Option<String>,
    pub normalized_request: Option<String>,
    pub normalized_response: Option<String>,
    pub upstream_request: Option<String>,
    /// `prompt_token_ids_delta` (sealed segments only).
    pub prompt_token_ids_delta: Option<String>,
}

fn build_batch(schema: &SchemaRef, rows: &[Row<'_>], path: &Path) -> Result<RecordBatch> {
    let n = rows.len();
    let mut schema_version = UInt32Builder::with_capacity(n);
    let mut call_id = StringBuilder::new();
    let mut session_id = StringBuilder::new();
    let mut group_id = StringBuilder::new();
    let mut seq = UInt64Builder::with_capacity(n);
    let mut started = Int64Builder::with_capacity(n);
    let mut finished = Int64Builder::with_capacity(n);
    let mut dialect = StringBuilder::new();
    let mut endpoint = StringBuilder::new();
    let mut model = StringBuilder::new();
    let mut upstream = StringBuilder::new();
    let mut stream = BooleanBuilder::with_capacity(n);
    let mut request = StringBuilder::new();
    let mut response = StringBuilder::new();
    let mut status = UInt16Builder::with_capacity(n);
    let mut outcome = StringBuilder::new();
    let mut error = StringBuilder::new();
    let mut prompt_ids = ListBuilder::new(UInt32Builder::new());
    let mut completion_ids = ListBuilder::new(UInt32Builder::new());
    let mut logprobs = ListBuilder::new(Float32Builder::new());
    let mut finish_reason = StringBuilder::new();
    let mut weight_version = StringBuilder::new();
    let mut usage_prompt = UInt64Builder::with_capacity(n);
    let mut usage_completion = UInt64Builder::with_capacity(n);
    let mut usage_total = UInt64Builder::with_capacity(n);
    let mut ttft = Float64Builder::with_capacity(n);
    let mut latency = Float64Builder::with_capacity(n);
    let mut client = StringBuilder::new();
    let mut normalized_request = StringBuilder::new();
    let mut normalized_response = StringBuilder::new();
    let mut upstream_request = StringBuilder::new();
    let mut upstream_dialect = StringBuilder::new();
    let mut prompt_ids_delta = StringBuilder::new();
    let mut spans = StringBuilder::new();
    let mut sampling = StringBuilder::new();
    let mut attempt = UInt32Builder::with_capacity(n);
    let mut retry_of = StringBuilder::new();
    let mut headers = StringBuilder::new();
    let mut backend_finish = StringBuilder::new();
    let mut stop_matched = StringBuilder::new();
    let mut replay = StringBuilder::new();

    for row in rows {
        let r = row.rec;
        schema_version.append_value(r.schema_version);
        call_id.append_value(&r.call_id);
        session_id.append_value(&r.session_id);
        group_id.append_option(r.group_id.as_deref());
        seq.append_value(r.seq);
        started.append_value(r.started_at_us);
        finished.append_value(r.finished_at_us);
        dialect.append_value(&r.dialect);
        endpoint.append_value(&r.endpoint);
        model.append_option(r.model.as_deref());
        upstream.append_value(&r.upstream);
        stream.append_value(r.stream);
        request.append_value(&row.text.request);
        response.append_option(row.text.response.as_deref());
        status.append_value(r.status);
        outcome.append_value(&r.outcome);
        error.append_option(r.error.as_deref());
        for (builder, ids) in [
            (&mut prompt_ids, &r.prompt_token_ids),
            (&mut completion_ids, &r.completion_token_ids),
        ] {
            match ids {
                Some(ids) => {
                    builder.values().append_slice(ids);
                    builder.append(true);
                }
                None => builder.append(false),
            }
        }
        match &r.completion_logprobs {
            Some(lp) => {
                for &x in lp {
                    logprobs.values().append_option(x);
                }
                logprobs.append(true);
            }
            None => logprobs.append(false),
        }
        finish_reason.append_option(r.finish_reason.as_deref());
        weight_version.append_option(r.weight_version.as_deref());
        let usage = r.usage.as_ref();
        usage_prompt.append_option(usage.and_then(|u| u.prompt_tokens));
        usage_completion.append_option(usage.and_then(|u| u.completion_tokens));
        usage_total.append_option(usage.and_then(|u| u.total_tokens));
        ttft.append_option(r.ttft_ms);
        latency.append_value(r.latency_ms);
        client.append_option(r.client.as_deref());
        normalized_request.append_option(row.text.normalized_request.as_deref());
        normalized_response.append_option(row.text.normalized_response.as_deref());
        upstream_request.append_option(row.text.upstream_request.as_deref());
        upstream_dialect.append_option(r.upstream_dialect.as_deref());
        prompt_ids_delta.append_option(row.text.prompt_token_ids_delta.as_deref());
        match &r.weight_version_spans {
            Some(s) => spans.append_value(serde_json::to_string(s).map_err(|source| {
                RecorderError::Encode {
                    call_id: r.call_id.clone(),
                    source,
                }
            })?),
            None => spans.append_null(),
        }
        sampling.append_option(r.sampling.as_ref().map(|v| v.to_string()));
        attempt.append_option(r.attempt);
        retry_of.append_option(r.retry_of.as_deref());
        headers.append_option(
            r.headers
                .as_ref()
                .and_then(|h| serde_json::to_string(h).ok()),
        );
        backend_finish.append_option(r.backend_finish_reason.as_deref());
        stop_matched.append_option(r.stop_matched.as_ref().map(|v| v.to_string()));
        replay.append_option(
            r.replay
                .as_ref()
                .and_then(|v| serde_json::to_string(v).ok()),
        );
    }

    let columns: Vec<ArrayRef> = vec![
        Arc::new(schema_version.finish()),
        Arc::new(call_id.finish()),
        Arc::new(session_id.finish()),
        Arc::new(group_id.finish()),
        Arc::new(seq.finish()),
        Arc::new(started.finish()),
        Arc::new(finished.finish()),
        Arc::new(dialect.finish()),
        Arc::new(endpoint.finish()),
        Arc::new(model.finish()),
        Arc::new(upstream.finish()),
        Arc::new(stream.finish()),
        Arc::new(request.finish()),
        Arc::new(response.finish()),
        Arc::new(status.finish()),
        Arc::new(outcome.finish()),
        Arc::new(error.finish()),
        Arc::new(prompt_ids.finish()),
        Arc::new(completion_ids.finish()),
        Arc::new(logprobs.finish()),
        Arc::new(finish_reason.finish()),
        Arc::new(weight_version.finish()),
        Arc::new(usage_prompt.finish()),
        Arc::new(usage_completion.finish()),
        Arc::new(usage_total.finish()),
        Arc::new(ttft.finish()),
        Arc::new(latency.finish()),
        Arc::new(client.finish()),
        Arc::new(normalized_request.finish()),
        Arc::new(normalized_response.finish()),
        Arc::new(upstream_request.finish()),
        Arc::new(upstream_dialect.finish()),
        Arc::new(prompt_ids_delta.finish()),
        Arc::new(spans.finish()),
        Arc::new(sampling.finish()),
        Arc::new(attempt.finish()),
        Arc::new(retry_of.finish()),
        Arc::new(headers.finish()),
        Arc::new(backend_finish.finish()),
        Arc::new(stop_matched.finish()),
        Arc::new(replay.finish()),
    ];
    RecordBatch::try_new(schema.clone(), columns).map_err(|source| RecorderError::Arrow {
        path: path.to_owned(),
        source,
    })
}

/// Writes `rows` to a new parquet file at `path` and fsyncs it.
pub(crate) fn write_parquet(path: &Path, rows: &[Row<'_>], json: JsonColumns) -> Result<()> {
    let mut sink = ParquetSink::create(path, json, RowGroups::default())?;
    sink.write(rows)?;
    sink.finish()
}

/// When the writer closes a row group (whichever limit is reached first).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct RowGroups {
    pub max_rows: usize,
    /// Estimated encoded bytes of the row group in progress.
    pub max_bytes: usize,
}

impl Default for RowGroups {
    fn default() -> Self {
        RowGroups {
            max_rows: ROW_GROUP_ROWS,
            max_bytes: ROW_GROUP_BYTES,
        }
    }
}

/// A parquet file being written a batch at a time: [`ParquetSink::write`] encodes rows
/// into the row group in progress (closed once it reaches its [`RowGroups`] limit), so a
/// caller that hands it bounded batches holds only those plus one encoded row group.
pub(crate) struct ParquetSink {
    path: std::path::PathBuf,
    schema: SchemaRef,
    writer: ArrowWriter<File>,
}

impl ParquetSink {
    /// Creates (truncates) `path`.
    pub fn create(path: &Path, json: JsonColumns, groups: RowGroups) -> Result<Self> {
        let schema = schema(json);
        let level = ZstdLevel::try_new(ZSTD_LEVEL).map_err(|e| RecorderError::parquet(path, e))?;
        let props = WriterProperties::builder()
            .set_compression(Compression::ZSTD(level))
            .set_max_row_group_row_count(Some(groups.max_rows.max(1)))
            .set_max_row_group_bytes(Some(groups.max_bytes.max(1)))
            .set_created_by(format!("graft-recorder {}", env!("CARGO_PKG_VERSION")))
            .build();
        let file = File::create(path).map_err(|e| RecorderError::io("creating", path, e))?;
        let writer = ArrowWriter::try_new(file, schema.clone(), Some(props))
            .map_err(|e| RecorderError::parquet(path, e))?;
        Ok(ParquetSink {
            path: path.to_owned(),
            schema,
            writer,
        })
    }

    pub fn write(&mut self, rows: &[Row<'_>]) -> Result<()> {
        for chunk in rows.chunks(BATCH_ROWS) {
            let batch = build_batch(&self.schema, chunk, &self.path)?;
            self.writer
                .write(&batch)
                .map_err(|e| RecorderError::parquet(&self.path, e))?;
        }
        Ok(())
    }

    /// Closes the last row group, writes the footer and fsyncs the file.
    pub fn finish(self) -> Result<()> {
        let path = self.path;
        let file = self
            .writer
            .into_inner()
            .map_err(|e| RecorderError::parquet(&path, e))?;
        file.sync_all()
            .map_err(|e| RecorderError::io("fsyncing", &path, e))
    }
}

/// A row read back: the record (its deltas are placeholders: `request_delta` full `null`,
/// the others `None`) and the raw text of the growing values' columns.
pub(crate) struct ReadRow {
    pub rec: StoredRecord,
    pub request_text: String,
    pub normalized_request_text: Option<String>,
    pub upstream_request_text: Option<String>,
}

struct Cols<'a> {
    batch: &'a RecordBatch,
    path: &'a Path,
}

impl<'a> Cols<'a> {
    fn get(&self, name: &str) -> Option<&'a ArrayRef> {
        self.batch.column_by_name(name)
    }

    fn bad(&self, name: &str, problem: impl Into<String>) -> RecorderError {
        RecorderError::Schema {
            path: self.path.to_owned(),
            column: name.to_owned(),
            problem: problem.into(),
        }
    }

    fn string(&self, name: &str) -> Result<Option<&'a StringArray>> {
        self.get(name)
            .map(|c| {
                c.as_string_opt::<i32>().ok_or_else(|| {
                    self.bad(name, format!("has type {}, expected Utf8", c.data_type()))
                })
            })
            .transpose()
    }

    fn prim<T: ArrowPrimitiveType>(&self, name: &str) -> Result<Option<&'a PrimitiveArray<T>>> {
        self.get(name)
            .map(|c| {
                c.as_primitive_opt::<T>().ok_or_else(|| {
                    self.bad(
                        name,
                        format!("has type {}, expected {}", c.data_type(), T::DATA_TYPE),
                    )
                })
            })
            .transpose()
    }

    fn required<T>(&self, name: &str, col: Option<T>) -> Result<T> {
        col.ok_or_else(|| self.bad(name, "is missing"))
    }

    fn list<T: ArrowPrimitiveType>(
        &self,
        name: &str,
        row: usize,
    ) -> Result<Option<Vec<T::Native>>> {
        let Some(col) = self.get(name) else {
            return Ok(None);
        };
        let list = col.as_list_opt::<i32>().ok_or_else(|| {
            self.bad(
                name,
                format!("has type {}, expected a List", col.data_type()),
            )
        })?;
        if list.is_null(row) {
            return Ok(None);
        }
        let values = list.value(row);
        let values = values.as_primitive_opt::<T>().ok_or_else(|| {
            self.bad(
                name,
                format!("holds {}, expected {}", values.data_type(), T::DATA_TYPE),
            )
        })?;
        Ok(Some(values.values().to_vec()))
    }

    /// A list column whose items may be null (a null item reads as `None`).
    fn nullable_list<T: ArrowPrimitiveType>(
        &self,
        name: &str,
        row: usize,
    ) -> Result<Option<Vec<Option<T::Native>>>> {
        let Some(col) = self.get(name) else {
            return Ok(None);
        };
        let list = col.as_list_opt::<i32>().ok_or_else(|| {
            self.bad(
                name,
                format!("has type {}, expected a List", col.data_type()),
            )
        })?;
        if list.is_null(row) {
            return Ok(None);
        }
        let values = list.value(row);
        let values = values.as_primitive_opt::<T>().ok_or_else(|| {
            self.bad(
                name,
                format!("holds {}, expected {}", values.data_type(), T::DATA_TYPE),
            )
        })?;
        Ok(Some(values.iter().collect()))
    }
}

/// The JSON in one cell of a text column, parsed; `None` for a null cell or no column.
fn json_cell<T: serde::de::DeserializeOwned>(
    col: Option<&StringArray>,
    row: usize,
    path: &Path,
    column: &'static str,
) -> Result<Option<T>> {
    opt_str(col, row)
        .map(|text| {
            serde_json::from_str(&text).map_err(|source| RecorderError::ColumnJson {
                path: path.to_owned(),
                column,
                row,
                source,
            })
        })
        .transpose()
}

fn opt_str(col: Option<&StringArray>, row: usize) -> Option<String> {
    col.filter(|c| !c.is_null(row))
        .map(|c| c.value(row).to_owned())
}

fn opt_prim<T: ArrowPrimitiveType>(
    col: Option<&PrimitiveArray<T>>,
    row: usize,
) -> Option<T::Native> {
    col.filter(|c| !c.is_null(row)).map(|c| c.value(row))
}

/// A reader over `path`'s row groups, as `setup` configures it.
fn open_reader(
    path: &Path,
    setup: impl FnOnce(ParquetRecordBatchReaderBuilder<File>) -> ParquetRecordBatchReaderBuilder<File>,
) -> Result<impl Iterator<Item = Result<RecordBatch>>> {
    let file = File::open(path).map_err(|e| RecorderError::io("opening", path, e))?;
    let builder = ParquetRecordBatchReaderBuilder::try_new(file)
        .map_err(|e| RecorderError::parquet(path, e))?
        .with_batch_size(BATCH_ROWS);
    let reader = setup(builder)
        .build()
        .map_err(|e| RecorderError::parquet(path, e))?;
    let path = path.to_owned();
    Ok(reader.map(move |b| {
        b.map_err(|source| RecorderError::Arrow {
            path: path.clone(),
            source,
        })
    }))
}

/// Reads every row of a parquet file written by [`write_parquet`] (or an older version of
/// it: missing nullable columns read as null).
pub(crate) fn read_parquet(path: &Path, json: JsonColumns) -> Result<Vec<ReadRow>> {
    read_parquet_where(path, json, None)
}

/// The rows of one session only (`Some(id)`), or every row (`None`). The session filter
/// reads the `session_id` column first and decodes the other columns only for the rows it
/// keeps, so one session's page costs its own rows, not the file's.
pub(crate) fn read_parquet_where(
    path: &Path,
    json: JsonColumns,
    session: Option<&str>,
) -> Result<Vec<ReadRow>> {
    let reader = open_reader(path, |builder| match session {
        None => builder,
        Some(id) => {
            let id = id.to_owned();
            let mask = ProjectionMask::columns(builder.parquet_schema(), ["session_id"]);
            let predicate = ArrowPredicateFn::new(mask, move |batch: RecordBatch| {
                let col = batch
                    .column_by_name("session_id")
                    .and_then(|c| c.as_string_opt::<i32>())
                    .ok_or_else(|| {
                        ArrowError::SchemaError("session_id is missing or not Utf8".into())
                    })?;
                Ok(col
                    .iter()
                    .map(|v| Some(v == Some(id.as_str())))
                    .collect::<BooleanArray>())
            });
            builder.with_row_filter(RowFilter::new(vec![Box::new(predicate)]))
        }
    })?;
    let mut out = Vec::new();
    for batch in reader {
        let batch = batch?;
        let c = Cols {
            batch: &batch,
            path,
        };
        let schema_version = c.prim::<UInt32Type>("schema_version")?;
        let call_id = c.required("call_id", c.string("call_id")?)?;
        let session_id = c.required("session_id", c.string("session_id")?)?;
        let group_id = c.string("group_id")?;
        let seq = c.required("seq", c.prim::<UInt64Type>("seq")?)?;
        let started = c.required("started_at_us", c.prim::<Int64Type>("started_at_us")?)?;
        let finished = c.prim::<Int64Type>("finished_at_us")?;
        let dialect = c.string("dialect")?;
        let endpoint = c.string("endpoint")?;
        let model = c.string("model")?;
        let upstream = c.string("upstream")?;
        let stream = c
            .get("stream")
            .map(|col| {
                col.as_boolean_opt()
                    .ok_or_else(|| c.bad("stream", "is not Boolean"))
            })
            .transpose()?;
        let request = c.required(json.request, c.string(json.request)?)?;
        let response = c.string("response")?;
        let status = c.prim::<UInt16Type>("status")?;
        let outcome = c.string("outcome")?;
        let error = c.string("error")?;
        let finish_reason = c.string("finish_reason")?;
        let weight_version = c.string("weight_version")?;
        let usage_prompt = c.prim::<UInt64Type>("usage_prompt_tokens")?;
        let usage_completion = c.prim::<UInt64Type>("usage_completion_tokens")?;
        let usage_total = c.prim::<UInt64Type>("usage_total_tokens")?;
        let ttft = c.prim::<Float64Type>("ttft_ms")?;
        let latency = c.prim::<Float64Type>("latency_ms")?;
        let client = c.string("client")?;
        let normalized_request = c.string(json.normalized_request)?;
        let normalized_response = c.string("normalized_response")?;
        let upstream_request = c.string(json.upstream_request)?;
        let upstream_dialect = c.string("upstream_dialect")?;
        let prompt_ids_delta = c.string("prompt_token_ids_delta")?;
        let spans = c.string("weight_version_spans")?;
        let sampling = c.string("sampling")?;
        let attempt = c.prim::<UInt32Type>("attempt")?;
        let retry_of = c.string("retry_of")?;
        let headers = c.string("headers")?;
        let backend_finish = c.string("backend_finish_reason")?;
        let stop_matched = c.string("stop_matched")?;
        let replay = c.string("replay")?;

        for row in 0..batch.num_rows() {
            let response = json_cell(response, row, path, "response")?;
            let normalized_response =
                json_cell(normalized_response, row, path, "normalized_response")?;
            let sampling = json_cell(sampling, row, path, "sampling")?;
            let prompt_token_ids_delta =
                json_cell(prompt_ids_delta, row, path, "prompt_token_ids_delta")?;
            let headers = json_cell(headers, row, path, "headers")?;
            let stop_matched = json_cell(stop_matched, row, path, "stop_matched")?;
            let replay = json_cell(replay, row, path, "replay")?;
            let weight_version_spans = json_cell(spans, row, path, "weight_version_spans")?;
            let usage = Usage {
                prompt_tokens: opt_prim(usage_prompt, row),
                completion_tokens: opt_prim(usage_completion, row),
                total_tokens: opt_prim(usage_total, row),
            };
            let usage = (usage.prompt_tokens.is_some()
                || usage.completion_tokens.is_some()
                || usage.total_tokens.is_some())
            .then_some(usage);
            let rec = StoredRecord {
                schema_version: opt_prim(schema_version, row).unwrap_or(1),
                call_id: call_id.value(row).to_owned(),
                session_id: session_id.value(row).to_owned(),
                group_id: opt_str(group_id, row),
                seq: seq.value(row),
                started_at_us: started.value(row),
                finished_at_us: opt_prim(finished, row).unwrap_or_else(|| started.value(row)),
                dialect: opt_str(dialect, row).unwrap_or_default(),
                endpoint: opt_str(endpoint, row).unwrap_or_default(),
                model: opt_str(model, row),
                upstream: opt_str(upstream, row).unwrap_or_default(),
                stream: stream.is_some_and(|s| !s.is_null(row) && s.value(row)),
                request_delta: crate::delta::encode(None, &serde_json::Value::Null),
                response,
                status: opt_prim(status, row).unwrap_or(0),
                outcome: opt_str(outcome, row).unwrap_or_default(),
                error: opt_str(error, row),
                prompt_token_ids: c.list::<UInt32Type>("prompt_token_ids", row)?,
                completion_token_ids: c.list::<UInt32Type>("completion_token_ids", row)?,
                completion_logprobs: c.nullable_list::<Float32Type>("completion_logprobs", row)?,
                finish_reason: opt_str(finish_reason, row),
                weight_version: opt_str(weight_version, row),
                usage,
                ttft_ms: opt_prim(ttft, row),
                latency_ms: opt_prim(latency, row).unwrap_or(0.0),
                client: opt_str(client, row),
                normalized_request_delta: None,
                normalized_response,
                upstream_request_delta: None,
                upstream_dialect: opt_str(upstream_dialect, row),
                prompt_token_ids_delta,
                weight_version_spans,
                sampling,
                attempt: opt_prim(attempt, row),
                retry_of: opt_str(retry_of, row),
                backend_finish_reason: opt_str(backend_finish, row),
                stop_matched,
                headers,
                replay,
            };
            out.push(ReadRow {
                rec,
                request_text: request.value(row).to_owned(),
                normalized_request_text: opt_str(normalized_request, row),
                upstream_request_text: opt_str(upstream_request, row),
            });
        }
    }
    Ok(out)
}

/// The columns of a row that a session summary needs, borrowed from the batch.
pub(crate) struct SummaryRow<'a> {
    pub session_id: &'a str,
    pub group_id: Option<&'a str>,
    pub started_at_us: i64,
    pub finished_at_us: i64,
    pub ok: bool,
    pub client: Option<&'a str>,
    pub weight_version: Option<&'a str>,
    /// Bytes of the stored request, normalized request and upstream request columns (their
    /// JSON text as written).
    pub request_bytes: u64,
}

fn opt_str_ref(col: Option<&StringArray>, row: usize) -> Option<&str> {
    col.filter(|c| !c.is_null(row)).map(|c| c.value(row))
}

/// Calls `f` for every row of a parquet file, reading only the columns a session summary
/// needs (no JSON is parsed, no row is kept): memory is one batch, whatever the file's size.
pub(crate) fn scan_summaries(
    path: &Path,
    json: JsonColumns,
    mut f: impl FnMut(SummaryRow<'_>),
) -> Result<()> {
    let reader = open_reader(path, |builder| {
        let mask = ProjectionMask::columns(
            builder.parquet_schema(),
            [
                "session_id",
                "group_id",
                "started_at_us",
                "finished_at_us",
                "outcome",
                "client",
                "weight_version",
                json.request,
                json.normalized_request,
                json.upstream_request,
            ],
        );
        builder.with_projection(mask)
    })?;
    for batch in reader {
        let batch = batch?;
        let c = Cols {
            batch: &batch,
            path,
        };
        let session_id = c.required("session_id", c.string("session_id")?)?;
        let group_id = c.string("group_id")?;
        let started = c.required("started_at_us", c.prim::<Int64Type>("started_at_us")?)?;
        let finished = c.prim::<Int64Type>("finished_at_us")?;
        let outcome = c.string("outcome")?;
        let client = c.string("client")?;
        let weight_version = c.string("weight_version")?;
        let texts = [
            c.string(json.request)?,
            c.string(json.normalized_request)?,
            c.string(json.upstream_request)?,
        ];
        for row in 0..batch.num_rows() {
            let started_at_us = started.value(row);
            f(SummaryRow {
                session_id: session_id.value(row),
                group_id: opt_str_ref(group_id, row),
                started_at_us,
                finished_at_us: opt_prim(finished, row).unwrap_or(started_at_us),
                ok: opt_str_ref(outcome, row).unwrap_or_default()
                    == crate::CallOutcome::Ok.as_str(),
                client: opt_str_ref(client, row),
                weight_version: opt_str_ref(weight_version, row),
                request_bytes: texts
                    .iter()
                    .map(|t| opt_str_ref(*t, row).map_or(0, |v| v.len() as u64))
                    .sum(),
            });
        }
    }
    Ok(())
}

//! Synchronous readers over a data directory (sealed parquet + unsealed WAL), and export.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::io::{BufWriter, Write};
use std::path::Path;

use serde_json::Value;

use crate::columnar::{self, DELTA_COLUMNS, FULL_COLUMNS, Row, RowText};
use crate::delta::{self, RequestDelta, TokenIdsDelta};
use crate::error::{RecorderError, Result};
use crate::record::{CallRecord, Deltas, Requests, StoredRecord};
use crate::seal;
use crate::session_log::{SessionEvent, read_session_events};
use crate::wal;

/// Every stored record, sealed or not, each exactly once (in no particular order).
///
/// Parquet of segment N is read when N has a manifest (sealed) or when WAL segment N is
/// gone; otherwise WAL segment N is read (its torn tail, e.g. a write in progress, is
/// skipped without modifying the file). Safe to run beside a live recorder: a segment
/// sealed while we read is retried.
pub(crate) fn read_stored(dir: &Path) -> Result<Vec<StoredRecord>> {
    read_stored_where(dir, None)
}

/// [`read_stored`], of one session only when `session` is given.
fn read_stored_where(dir: &Path, session: Option<&str>) -> Result<Vec<StoredRecord>> {
    retry_vanished(|| try_read_stored(dir, session))
}

/// Runs `read` again (up to 3 times) when a file it listed vanished under it: a segment
/// sealed, or a WAL deleted, while we read.
fn retry_vanished<T>(mut read: impl FnMut() -> Result<T>) -> Result<T> {
    let mut attempt = 0;
    loop {
        match read() {
            Err(RecorderError::Io { source, .. })
                if source.kind() == std::io::ErrorKind::NotFound && attempt < 3 =>
            {
                attempt += 1;
            }
            other => return other,
        }
    }
}

fn try_read_stored(dir: &Path, session: Option<&str>) -> Result<Vec<StoredRecord>> {
    // Order matters against a concurrent seal (parquet, then manifest, then WAL delete):
    // list the WAL first so a segment is seen either as WAL or as sealed.
    let segments = wal::list_segments(dir)?;
    let manifests = seal::read_manifests(dir)?;
    let parquet = seal::list_parquet(dir)?;
    let in_wal: HashSet<u64> = segments.iter().map(|(n, _)| *n).collect();

    let mut out = Vec::new();
    for (segment, path) in &parquet {
        if !manifests.contains_key(segment) && in_wal.contains(segment) {
            continue; // interrupted seal: the WAL is the source of truth
        }
        for (row_no, row) in columnar::read_parquet_where(path, DELTA_COLUMNS, session)?
            .into_iter()
            .enumerate()
        {
            let parse = |text: &str, column: &'static str| {
                serde_json::from_str::<RequestDelta>(text).map_err(|source| {
                    RecorderError::ColumnJson {
                        path: path.clone(),
                        column,
                        row: row_no,
                        source,
                    }
                })
            };
            let request_delta = parse(&row.request_text, DELTA_COLUMNS.request)?;
            let normalized_request_delta = row
                .normalized_request_text
                .as_deref()
                .map(|t| parse(t, DELTA_COLUMNS.normalized_request))
                .transpose()?;
            let upstream_request_delta = row
                .upstream_request_text
                .as_deref()
                .map(|t| parse(t, DELTA_COLUMNS.upstream_request))
                .transpose()?;
            out.push(StoredRecord {
                request_delta,
                normalized_request_delta,
                upstream_request_delta,
                ..row.rec
            });
        }
    }
    for (segment, path) in &segments {
        if manifests.contains_key(segment) {
            continue;
        }
        let records = wal::scan_segment(path)?;
        match session {
            None => out.extend(records),
            Some(id) => out.extend(records.into_iter().filter(|r| r.session_id == id)),
        }
    }
    Ok(out)
}

/// Resolves one delta of `rec` (its `what` value) against the same value of its base call
/// among `resolved` (earlier calls of the session, by call_id).
fn resolve_one(
    rec: &StoredRecord,
    what: &str,
    delta: &RequestDelta,
    resolved: &HashMap<String, Requests>,
    pick: fn(&Requests) -> Option<&Value>,
) -> Result<Value> {
    let bad = |base: &str, reason: String| RecorderError::BadDelta {
        call_id: rec.call_id.clone(),
        base: base.to_owned(),
        reason: format!("{what}: {reason}"),
    };
    let base = match &delta.base {
        None => None,
        Some(b) => {
            let call = resolved.get(b).ok_or_else(|| RecorderError::MissingBase {
                call_id: rec.call_id.clone(),
                session_id: rec.session_id.clone(),
                seq: rec.seq,
                base: b.clone(),
            })?;
            Some(pick(call).ok_or_else(|| bad(b, format!("the base call has no {what}")))?)
        }
    };
    delta::decode(base, delta).map_err(|reason| bad(delta.base.as_deref().unwrap_or(""), reason))
}

/// Resolves `rec`'s prompt token ids delta against its base call's token sequence.
fn resolve_ids(
    rec: &StoredRecord,
    d: &TokenIdsDelta,
    resolved: &HashMap<String, Requests>,
) -> Result<Vec<u32>> {
    let call = resolved
        .get(&d.base)
        .ok_or_else(|| RecorderError::MissingBase {
            call_id: rec.call_id.clone(),
            session_id: rec.session_id.clone(),
            seq: rec.seq,
            base: d.base.clone(),
        })?;
    let bad = |reason: String| RecorderError::BadDelta {
        call_id: rec.call_id.clone(),
        base: d.base.clone(),
        reason: format!("prompt_token_ids: {reason}"),
    };
    let base = call
        .token_ids
        .as_deref()
        .ok_or_else(|| bad("the base call has no prompt_token_ids".to_owned()))?;
    delta::decode_ids(base, d).map_err(bad)
}

/// Resolves deltas into full values. Input in any order; output sorted by
/// (session_id, seq).
fn resolve(mut stored: Vec<StoredRecord>) -> Result<Vec<CallRecord>> {
    stored.sort_by(|a, b| {
        (&a.session_id, a.seq, &a.call_id).cmp(&(&b.session_id, b.seq, &b.call_id))
    });
    stored.dedup_by(|b, a| {
        let dup = a.call_id == b.call_id;
        if dup {
            tracing::warn!(call_id = %a.call_id, "call stored twice; reading it once");
        }
        dup
    });
    let mut out = Vec::with_capacity(stored.len());
    let mut resolved: HashMap<String, Requests> = HashMap::new();
    let mut session: Option<String> = None;
    for mut rec in stored {
        if session.as_deref() != Some(rec.session_id.as_str()) {
            // Bases are always earlier calls of the same session.
            resolved.clear();
            session = Some(rec.session_id.clone());
        }
        let deltas = Deltas {
            request: std::mem::replace(&mut rec.request_delta, delta::encode(None, &Value::Null)),
            normalized_request: rec.normalized_request_delta.take(),
            upstream_request: rec.upstream_request_delta.take(),
            prompt_token_ids: rec.prompt_token_ids_delta.take(),
        };
        let prompt_ids = deltas
            .prompt_token_ids
            .as_ref()
            .map(|d| resolve_ids(&rec, d, &resolved))
            .transpose()?;
        let token_ids = delta::token_sequence(
            prompt_ids.as_deref().or(rec.prompt_token_ids.as_deref()),
            rec.completion_token_ids.as_deref(),
        );
        let full = Requests {
            request: resolve_one(&rec, "request", &deltas.request, &resolved, |r| {
                Some(&r.request)
            })?,
            normalized_request: deltas
                .normalized_request
                .as_ref()
                .map(|d| {
                    resolve_one(&rec, "normalized_request", d, &resolved, |r| {
                        r.normalized_request.as_ref()
                    })
                })
                .transpose()?,
            upstream_request: deltas
                .upstream_request
                .as_ref()
                .map(|d| {
                    resolve_one(&rec, "upstream_request", d, &resolved, |r| {
                        r.upstream_request.as_ref()
                    })
                })
                .transpose()?,
            token_ids,
        };
        resolved.insert(rec.call_id.clone(), full.clone());
        out.push(rec.into_call(full, prompt_ids));
    }
    Ok(out)
}

/// All records of `dir` (sealed parquet + unsealed WAL) with FULL requests, sorted by
/// (session_id, seq).
pub fn read_records(dir: &Path) -> Result<Vec<CallRecord>> {
    resolve(read_stored(dir)?)
}

/// The records of one session, with FULL requests, in seq order. Reads only that session's
/// rows of each sealed segment (deltas resolve within a session, so nothing else is
/// needed); an unknown session reads as no records.
pub fn read_session(dir: &Path, session_id: &str) -> Result<Vec<CallRecord>> {
    resolve(read_stored_where(dir, Some(session_id))?)
}

/// Stored bytes of one session's growing values: what is on disk against what full
/// values would take.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct SessionBytes {
    pub records: u64,
    /// Bytes of the stored request deltas (what is on disk, before compression).
    pub request_delta_bytes: u64,
    /// Bytes the full requests would take (JSON text).
    pub full_request_bytes: u64,
    /// Same for `normalized_request` (calls without one count 0).
    pub normalized_request_delta_bytes: u64,
    pub full_normalized_request_bytes: u64,
    /// Same for `upstream_request` (calls without one count 0).
    pub upstream_request_delta_bytes: u64,
    pub full_upstream_request_bytes: u64,
}

impl SessionBytes {
    /// Stored delta bytes of the request, normalized request and upstream request.
    pub fn delta_bytes(&self) -> u64 {
        self.request_delta_bytes
            + self.normalized_request_delta_bytes
            + self.upstream_request_delta_bytes
    }

    fn add_stored(&mut self, r: &StoredRecord) {
        self.records += 1;
        self.request_delta_bytes += json_len(&r.request_delta);
        self.normalized_request_delta_bytes += opt_json_len(r.normalized_request_delta.as_ref());
        self.upstream_request_delta_bytes += opt_json_len(r.upstream_request_delta.as_ref());
    }

    fn add_full(&mut self, r: &CallRecord) {
        self.full_request_bytes += json_len(&r.request);
        self.full_normalized_request_bytes += opt_json_len(r.normalized_request.as_ref());
        self.full_upstream_request_bytes += opt_json_len(r.upstream_request.as_ref());
    }
}

/// How much request payload is stored, per session, against what full values would take.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct StoredBytes {
    pub sessions: BTreeMap<String, SessionBytes>,
    pub total_request_delta_bytes: u64,
    pub total_full_request_bytes: u64,
    /// All sessions together, every field summed.
    pub total: SessionBytes,
}

fn json_len(v: &impl serde::Serialize) -> u64 {
    serde_json::to_vec(v).map_or(0, |b| b.len() as u64)
}

fn opt_json_len(v: Option<&impl serde::Serialize>) -> u64 {
    v.map_or(0, json_len)
}

pub fn stored_bytes(dir: &Path) -> Result<StoredBytes> {
    let stored = read_stored(dir)?;
    let mut out = StoredBytes::default();
    for r in &stored {
        out.sessions
            .entry(r.session_id.clone())
            .or_default()
            .add_stored(r);
        out.total.add_stored(r);
    }
    for r in resolve(stored)? {
        if let Some(s) = out.sessions.get_mut(&r.session_id) {
            s.add_full(&r);
        }
        out.total.add_full(&r);
    }
    out.total_request_delta_bytes = out.total.request_delta_bytes;
    out.total_full_request_bytes = out.total.full_request_bytes;
    Ok(out)
}

/// One session as seen from its records and its events.
#[derive(Debug, Clone, PartialEq)]
pub struct SessionSummary {
    pub session_id: String,
    pub group_id: Option<String>,
    pub calls: u64,
    /// Calls whose outcome is not "ok".
    pub errors: u64,
    /// Earliest call start (or creation time when there are no calls), unix micros.
    pub first_us: i64,
    /// Latest call finish (or latest event), unix micros.
    pub last_us: i64,
    /// The last reward reported.
    pub reward: Option<f64>,
    /// Call rewards posted (process rewards; a call rewarded twice counts twice).
    pub call_rewards: u64,
    pub closed: bool,
    /// Stored delta bytes of the request, normalized request and upstream request
    /// ([`SessionBytes::delta_bytes`]).
    pub stored_request_bytes: u64,
    /// The harness that ran the session, as its creator named it in the session's
    /// metadata (`"harness"`; `graft rl` sets it).
    pub harness: Option<String>,
    /// The client of its first call (its `User-Agent`).
    pub client: Option<String>,
    /// The weight versions that answered its calls, sorted, each once.
    pub weight_versions: Vec<String>,
}

/// Sessions of `dir`, from its records and `sessions.log`, sorted by first_us then id.
///
/// Sealed segments are scanned through the summary columns only (no JSON parsed, no record
/// kept), so memory grows with the number of sessions, not of calls.
pub fn list_sessions(dir: &Path) -> Result<Vec<SessionSummary>> {
    fn entry<'a>(
        by_id: &'a mut HashMap<String, SessionSummary>,
        id: &str,
        at: i64,
    ) -> &'a mut SessionSummary {
        let s = by_id
            .entry(id.to_owned())
            .or_insert_with(|| SessionSummary {
                session_id: id.to_owned(),
                group_id: None,
                calls: 0,
                errors: 0,
                first_us: at,
                last_us: at,
                reward: None,
                call_rewards: 0,
                closed: false,
                stored_request_bytes: 0,
                harness: None,
                client: None,
                weight_versions: vec![],
            });
        s.first_us = s.first_us.min(at);
        s.last_us = s.last_us.max(at);
        s
    }
    fn add_call(by_id: &mut HashMap<String, SessionSummary>, r: columnar::SummaryRow<'_>) {
        let s = entry(by_id, r.session_id, r.started_at_us);
        s.last_us = s.last_us.max(r.finished_at_us);
        // The first call by start time names the client.
        if (s.calls == 0 || r.started_at_us <= s.first_us)
            && let Some(c) = r.client
        {
            s.client = Some(c.to_owned());
        }
        s.calls += 1;
        s.errors += u64::from(!r.ok);
        s.stored_request_bytes += r.request_bytes;
        if s.group_id.is_none() {
            s.group_id = r.group_id.map(str::to_owned);
        }
        if let Some(v) = r.weight_version
            && let Err(at) = s.weight_versions.binary_search_by(|w| w.as_str().cmp(v))
        {
            s.weight_versions.insert(at, v.to_owned());
        }
    }
    let mut by_id: HashMap<String, SessionSummary> = HashMap::new();
    retry_vanished(|| {
        by_id.clear();
        let segments = wal::list_segments(dir)?;
        let manifests = seal::read_manifests(dir)?;
        let parquet = seal::list_parquet(dir)?;
        let in_wal: HashSet<u64> = segments.iter().map(|(n, _)| *n).collect();
        for (segment, path) in &parquet {
            if !manifests.contains_key(segment) && in_wal.contains(segment) {
                continue; // interrupted seal: the WAL is the source of truth
            }
            columnar::scan_summaries(path, DELTA_COLUMNS, |r| add_call(&mut by_id, r))?;
        }
        for (segment, path) in &segments {
            if manifests.contains_key(segment) {
                continue;
            }
            for r in wal::scan_segment(path)? {
                add_call(
                    &mut by_id,
                    columnar::SummaryRow {
                        session_id: &r.session_id,
                        group_id: r.group_id.as_deref(),
                        started_at_us: r.started_at_us,
                        finished_at_us: r.finished_at_us,
                        ok: r.outcome == crate::CallOutcome::Ok.as_str(),
                        client: r.client.as_deref(),
                        weight_version: r.weight_version.as_deref(),
                        request_bytes: json_len(&r.request_delta)
                            + opt_json_len(r.normalized_request_delta.as_ref())
                            + opt_json_len(r.upstream_request_delta.as_ref()),
                    },
                );
            }
        }
        Ok(())
    })?;
    for ev in read_session_events(dir)? {
        match ev {
            SessionEvent::Created {
                session_id,
                group_id,
                metadata,
                at_us,
                ..
            } => {
                let s = entry(&mut by_id, &session_id, at_us);
                if group_id.is_some() {
                    s.group_id = group_id;
                }
                if let Some(h) = metadata.get("harness").and_then(Value::as_str) {
                    s.harness = Some(h.to_owned());
                }
            }
            SessionEvent::Reward {
                session_id,
                reward,
                at_us,
                ..
            } => entry(&mut by_id, &session_id, at_us).reward = Some(reward),
            SessionEvent::Closed { session_id, at_us } => {
                entry(&mut by_id, &session_id, at_us).closed = true
            }
            SessionEvent::CallReward {
                session_id, at_us, ..
            } => entry(&mut by_id, &session_id, at_us).call_rewards += 1,
            SessionEvent::Sampling { .. } => {}
        }
    }
    let mut out: Vec<_> = by_id.into_values().collect();
    out.sort_by(|a, b| (a.first_us, &a.session_id).cmp(&(b.first_us, &b.session_id)));
    Ok(out)
}

fn redacted(rec: &CallRecord) -> CallRecord {
    let mut rec = rec.clone();
    rec.redact_credentials();
    rec
}

fn create_parent(out: &Path) -> Result<()> {
    match out.parent() {
        Some(p) if !p.as_os_str().is_empty() => wal::create_dir_all(p),
        _ => Ok(()),
    }
}

/// Writes one JSON record per line (full requests, credentials redacted).
pub fn export_jsonl(records: &[CallRecord], out: &Path) -> Result<()> {
    create_parent(out)?;
    let file = std::fs::File::create(out).map_err(|e| RecorderError::io("creating", out, e))?;
    let mut w = BufWriter::new(file);
    for rec in records {
        let rec = redacted(rec);
        serde_json::to_writer(&mut w, &rec).map_err(|source| RecorderError::Encode {
            call_id: rec.call_id.clone(),
            source,
        })?;
        w.write_all(b"\n")
            .map_err(|e| RecorderError::io("writing", out, e))?;
    }
    let file = w
        .into_inner()
        .map_err(|e| RecorderError::io("writing", out, e.into_error()))?;
    file.sync_all()
        .map_err(|e| RecorderError::io("fsyncing", out, e))
}

/// Writes a zstd parquet file with one row per record and FULL values as JSON text in
/// columns `request`, `normalized_request` and `upstream_request` (credentials redacted);
/// other columns as in sealed segments.
pub fn export_parquet(records: &[CallRecord], out: &Path) -> Result<()> {
    create_parent(out)?;
    let mut stored = Vec::with_capacity(records.len());
    for rec in records {
        let rec = redacted(rec);
        let encode = |v: &Value| {
            serde_json::to_string(v).map_err(|source| RecorderError::Encode {
                call_id: rec.call_id.clone(),
                source,
            })
        };
        let text = RowText {
            request: encode(&rec.request)?,
            response: rec.response.as_ref().map(encode).transpose()?,
            normalized_request: rec.normalized_request.as_ref().map(encode).transpose()?,
            normalized_response: rec.normalized_response.as_ref().map(encode).transpose()?,
            upstream_request: rec.upstream_request.as_ref().map(encode).transpose()?,
            prompt_token_ids_delta: None,
        };
        let placeholder = Deltas {
            request: delta::encode(None, &Value::Null),
            normalized_request: None,
            upstream_request: None,
            prompt_token_ids: None,
        };
        let (s, _) = StoredRecord::from_call(rec, placeholder);
        stored.push((s, text));
    }
    let rows: Vec<Row<'_>> = stored.iter().map(|(rec, text)| Row { rec, text }).collect();
    columnar::write_parquet(out, &rows, FULL_COLUMNS)
}

/// Reads a file written by [`export_parquet`] (by this or an earlier schema version).
pub fn read_export_parquet(path: &Path) -> Result<Vec<CallRecord>> {
    columnar::read_parquet(path, FULL_COLUMNS)?
        .into_iter()
        .enumerate()
        .map(|(row_no, row)| {
            let parse = |text: &str, column: &'static str| {
                serde_json::from_str::<Value>(text).map_err(|source| RecorderError::ColumnJson {
                    path: path.to_owned(),
                    column,
                    row: row_no,
                    source,
                })
            };
            let full = Requests {
                request: parse(&row.request_text, FULL_COLUMNS.request)?,
                normalized_request: row
                    .normalized_request_text
                    .as_deref()
                    .map(|t| parse(t, FULL_COLUMNS.normalized_request))
                    .transpose()?,
                upstream_request: row
                    .upstream_request_text
                    .as_deref()
                    .map(|t| parse(t, FULL_COLUMNS.upstream_request))
                    .transpose()?,
                token_ids: None,
            };
            Ok(row.rec.into_call(full, None))
        })
        .collect()
}

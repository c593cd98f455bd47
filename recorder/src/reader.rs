//! Synchronous readers over a data directory (sealed parquet + unsealed WAL), and export.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::io::{BufWriter, Write};
use std::path::Path;

use serde_json::Value;

use crate::columnar::{self, DELTA_COLUMN, REQUEST_COLUMN, Row};
use crate::delta::{self, RequestDelta};
use crate::error::{RecorderError, Result};
use crate::record::{CallRecord, StoredRecord};
use crate::redact::redact_json;
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
    let mut attempt = 0;
    loop {
        match try_read_stored(dir) {
            Err(RecorderError::Io { source, .. })
                if source.kind() == std::io::ErrorKind::NotFound && attempt < 3 =>
            {
                attempt += 1;
            }
            other => return other,
        }
    }
}

fn try_read_stored(dir: &Path) -> Result<Vec<StoredRecord>> {
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
        for (row_no, row) in columnar::read_parquet(path, DELTA_COLUMN)?
            .into_iter()
            .enumerate()
        {
            let delta: RequestDelta =
                serde_json::from_str(&row.request_text).map_err(|source| {
                    RecorderError::ColumnJson {
                        path: path.clone(),
                        column: DELTA_COLUMN,
                        row: row_no,
                        source,
                    }
                })?;
            out.push(StoredRecord {
                request_delta: delta,
                ..row.rec
            });
        }
    }
    for (segment, path) in &segments {
        if manifests.contains_key(segment) {
            continue;
        }
        out.extend(wal::scan_segment(path)?.records);
    }
    Ok(out)
}

/// Resolves deltas into full requests. Input in any order; output sorted by
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
    let mut requests: HashMap<String, Value> = HashMap::new();
    let mut session: Option<String> = None;
    for rec in stored {
        if session.as_deref() != Some(rec.session_id.as_str()) {
            // Bases are always earlier calls of the same session.
            requests.clear();
            session = Some(rec.session_id.clone());
        }
        let base = match &rec.request_delta.base {
            None => None,
            Some(b) => Some(requests.get(b).ok_or_else(|| RecorderError::MissingBase {
                call_id: rec.call_id.clone(),
                session_id: rec.session_id.clone(),
                seq: rec.seq,
                base: b.clone(),
            })?),
        };
        let request =
            delta::decode(base, &rec.request_delta).map_err(|reason| RecorderError::BadDelta {
                call_id: rec.call_id.clone(),
                base: rec.request_delta.base.clone().unwrap_or_default(),
                reason,
            })?;
        requests.insert(rec.call_id.clone(), request.clone());
        out.push(rec.into_call(request));
    }
    Ok(out)
}

/// All records of `dir` (sealed parquet + unsealed WAL) with FULL requests, sorted by
/// (session_id, seq).
pub fn read_records(dir: &Path) -> Result<Vec<CallRecord>> {
    resolve(read_stored(dir)?)
}

/// Stored request bytes of one session.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct SessionBytes {
    pub records: u64,
    /// Bytes of the stored request deltas (what is on disk, before compression).
    pub request_delta_bytes: u64,
    /// Bytes the full requests would take (JSON text).
    pub full_request_bytes: u64,
}

/// How much request payload is stored, per session, against what full requests would take.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct StoredBytes {
    pub sessions: BTreeMap<String, SessionBytes>,
    pub total_request_delta_bytes: u64,
    pub total_full_request_bytes: u64,
}

fn json_len(v: &impl serde::Serialize) -> u64 {
    serde_json::to_vec(v).map_or(0, |b| b.len() as u64)
}

pub fn stored_bytes(dir: &Path) -> Result<StoredBytes> {
    let stored = read_stored(dir)?;
    let mut out = StoredBytes::default();
    for r in &stored {
        let s = out.sessions.entry(r.session_id.clone()).or_default();
        let n = json_len(&r.request_delta);
        s.records += 1;
        s.request_delta_bytes += n;
        out.total_request_delta_bytes += n;
    }
    for r in resolve(stored)? {
        let n = json_len(&r.request);
        if let Some(s) = out.sessions.get_mut(&r.session_id) {
            s.full_request_bytes += n;
        }
        out.total_full_request_bytes += n;
    }
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
    pub closed: bool,
    pub stored_request_bytes: u64,
}

/// Sessions of `dir`, from its records and `sessions.log`, sorted by first_us then id.
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
                closed: false,
                stored_request_bytes: 0,
            });
        s.first_us = s.first_us.min(at);
        s.last_us = s.last_us.max(at);
        s
    }
    let mut by_id: HashMap<String, SessionSummary> = HashMap::new();
    for r in read_stored(dir)? {
        let s = entry(&mut by_id, &r.session_id, r.started_at_us);
        s.last_us = s.last_us.max(r.finished_at_us);
        s.calls += 1;
        s.errors += u64::from(r.outcome != "ok");
        s.stored_request_bytes += json_len(&r.request_delta);
        if s.group_id.is_none() {
            s.group_id = r.group_id;
        }
    }
    for ev in read_session_events(dir)? {
        match ev {
            SessionEvent::Created {
                session_id,
                group_id,
                at_us,
                ..
            } => {
                let s = entry(&mut by_id, &session_id, at_us);
                if group_id.is_some() {
                    s.group_id = group_id;
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
        }
    }
    let mut out: Vec<_> = by_id.into_values().collect();
    out.sort_by(|a, b| (a.first_us, &a.session_id).cmp(&(b.first_us, &b.session_id)));
    Ok(out)
}

fn redacted(rec: &CallRecord) -> CallRecord {
    let mut rec = rec.clone();
    redact_json(&mut rec.request);
    if let Some(resp) = rec.response.as_mut() {
        redact_json(resp);
    }
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

/// Writes a zstd parquet file with one row per record and the FULL request as JSON text
/// in column `request` (credentials redacted); other columns as in sealed segments.
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
        let request = encode(&rec.request)?;
        let response = rec.response.as_ref().map(encode).transpose()?;
        let (s, _) = StoredRecord::from_call(rec, delta::encode(None, &Value::Null));
        stored.push((s, request, response));
    }
    let rows: Vec<Row<'_>> = stored
        .iter()
        .map(|(rec, request, response)| Row {
            rec,
            request_text: request,
            response_text: response.as_deref(),
        })
        .collect();
    columnar::write_parquet(out, &rows, REQUEST_COLUMN)
}

/// Reads a file written by [`export_parquet`].
pub fn read_export_parquet(path: &Path) -> Result<Vec<CallRecord>> {
    columnar::read_parquet(path, REQUEST_COLUMN)?
        .into_iter()
        .enumerate()
        .map(|(row_no, row)| {
            let request = serde_json::from_str(&row.request_text).map_err(|source| {
                RecorderError::ColumnJson {
                    path: path.to_owned(),
                    column: REQUEST_COLUMN,
                    row: row_no,
                    source,
                }
            })?;
            Ok(row.rec.into_call(request))
        })
        .collect()
}

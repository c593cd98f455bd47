//! Sealing closed WAL segments into day-partitioned parquet, and recovery on open.
//!
//! Sealing segment N: for each UTC day (of `started_at_us`) present in it, write
//! `records/date=YYYY-MM-DD/.seg-N.parquet.tmp`, fsync, rename to `seg-N.parquet`, fsync
//! the directory; then write the manifest `records/_sealed/seg-N.json` the same way; then
//! delete `wal/N.wal`. The manifest is the commit point: a segment with a manifest is
//! sealed (its WAL file, if still there, is ignored and deleted); a segment without one
//! is read from its WAL (any parquet already written for it is ignored and rewritten).
//! Temporary files start with a dot so pyarrow and DuckDB globs skip them.

use std::collections::{BTreeMap, HashMap};
use std::fs;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::columnar::{DELTA_COLUMNS, ParquetSink, Row, RowGroups, RowText};
use crate::error::{RecorderError, Result};
use crate::record::{SCHEMA_VERSION, StoredRecord};
use crate::wal;
use crate::{RecoveryReport, SessionState};

pub(crate) const RECORDS_DIR: &str = "records";
pub(crate) const SEALED_DIR: &str = "_sealed";

pub(crate) fn records_dir(dir: &Path) -> PathBuf {
    dir.join(RECORDS_DIR)
}

fn sealed_dir(dir: &Path) -> PathBuf {
    records_dir(dir).join(SEALED_DIR)
}

fn manifest_path(dir: &Path, segment: u64) -> PathBuf {
    sealed_dir(dir).join(format!("seg-{segment:08}.json"))
}

fn parquet_name(segment: u64) -> String {
    format!("seg-{segment:08}.parquet")
}

/// `seg-00000012.parquet` / `seg-00000012.json` → 12.
fn parse_seg_name(name: &str, ext: &str) -> Option<u64> {
    let digits = name.strip_prefix("seg-")?.strip_suffix(ext)?;
    if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    digits.parse().ok()
}

/// Per-session counts of one sealed segment.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub(crate) struct ManifestSession {
    pub last_seq: u64,
    pub records: u64,
}

/// Commit record of one sealed segment.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(crate) struct Manifest {
    pub schema_version: u32,
    pub segment: u64,
    pub records: u64,
    /// Parquet files, relative to `records/`.
    pub files: Vec<String>,
    pub sessions: BTreeMap<String, ManifestSession>,
}

fn day_of(started_at_us: i64) -> String {
    match chrono::DateTime::from_timestamp_micros(started_at_us) {
        Some(t) => t.date_naive().format("%Y-%m-%d").to_string(),
        None => {
            tracing::warn!(
                started_at_us,
                "record start time out of range; filed under 1970-01-01"
            );
            "1970-01-01".to_owned()
        }
    }
}

/// Writes `bytes` to `path` atomically and durably (dot-tmp, fsync, rename, fsync dir).
fn write_atomic(path: &Path, bytes: &[u8]) -> Result<()> {
    let parent = path.parent().unwrap_or(Path::new("."));
    let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("file");
    let tmp = parent.join(format!(".{name}.tmp"));
    fs::File::create(&tmp)
        .and_then(|mut f| {
            std::io::Write::write_all(&mut f, bytes)?;
            f.sync_all()
        })
        .map_err(|e| RecorderError::io("writing", &tmp, e))?;
    fs::rename(&tmp, path).map_err(|e| RecorderError::io("renaming into place", path, e))?;
    wal::fsync_dir(parent)
}

/// How much of a segment sealing holds in memory at once: records are read from the WAL
/// one frame at a time and handed to the day's parquet writer in batches of at most
/// `batch_rows` rows or `batch_bytes` bytes of WAL payload, whichever comes first; the
/// writer closes a row group at `row_groups`. A segment's records are never all in memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct SealLimits {
    pub batch_rows: usize,
    pub batch_bytes: usize,
    pub row_groups: RowGroups,
}

impl Default for SealLimits {
    fn default() -> Self {
        SealLimits {
            batch_rows: 1024,
            batch_bytes: 4 * 1024 * 1024,
            row_groups: RowGroups::default(),
        }
    }
}

/// Seals WAL segment `segment` of `dir`. Returns its manifest, or `None` when the segment
/// held no record (it is then just deleted).
pub(crate) fn seal_segment(dir: &Path, segment: u64) -> Result<Option<Manifest>> {
    seal_segment_with(dir, segment, SealLimits::default()).map(|(manifest, _)| manifest)
}

/// What one seal held in memory at most: rows parsed but not yet handed to a parquet
/// writer, summed over the day files (their WAL payload bytes).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct SealStats {
    pub max_pending_rows: usize,
    pub max_pending_bytes: usize,
}

pub(crate) fn seal_segment_with(
    dir: &Path,
    segment: u64,
    limits: SealLimits,
) -> Result<(Option<Manifest>, SealStats)> {
    let wal_path = wal::segment_path(dir, segment);
    let mut reader = wal::SegmentReader::open(&wal_path)?;
    let mut sealer = SegmentSealer::new(dir, segment, limits);
    let manifest = match sealer.run(&mut reader) {
        Ok(manifest) => manifest,
        Err(e) => {
            sealer.abandon();
            return Err(e);
        }
    };
    let torn = wal::torn_len(&wal_path, reader.valid_len())?;
    if torn > 0 {
        tracing::warn!(
            path = %wal_path.display(),
            torn_bytes = torn,
            "sealed a WAL segment with a torn tail; only its valid frames were sealed"
        );
    }
    let records = manifest.as_ref().map_or(0, |m| m.records);
    fs::remove_file(&wal_path)
        .map_err(|e| RecorderError::io("deleting sealed WAL segment", &wal_path, e))?;
    wal::fsync_dir(&wal::wal_dir(dir))?;
    tracing::debug!(
        segment,
        records,
        max_pending_rows = sealer.stats.max_pending_rows,
        "sealed WAL segment"
    );
    Ok((manifest, sealer.stats))
}

/// JSON text of `value`; the error names the call.
fn to_text(call_id: &str, value: &impl Serialize) -> Result<String> {
    serde_json::to_string(value).map_err(|source| RecorderError::Encode {
        call_id: call_id.to_owned(),
        source,
    })
}

fn opt_text(call_id: &str, value: Option<&impl Serialize>) -> Result<Option<String>> {
    value.map(|v| to_text(call_id, v)).transpose()
}

/// The record as a parquet row: the text of its JSON columns, and the record with those
/// values dropped (the row is written from the text; the parsed trees are the bulk of a
/// record's memory).
fn into_row(mut r: StoredRecord) -> Result<(StoredRecord, RowText)> {
    let id = r.call_id.as_str();
    let text = RowText {
        request: to_text(id, &r.request_delta)?,
        response: opt_text(id, r.response.as_ref())?,
        normalized_request: opt_text(id, r.normalized_request_delta.as_ref())?,
        normalized_response: opt_text(id, r.normalized_response.as_ref())?,
        upstream_request: opt_text(id, r.upstream_request_delta.as_ref())?,
        prompt_token_ids_delta: opt_text(id, r.prompt_token_ids_delta.as_ref())?,
    };
    r.request_delta = crate::delta::encode(None, &serde_json::Value::Null);
    r.response = None;
    r.normalized_request_delta = None;
    r.normalized_response = None;
    r.upstream_request_delta = None;
    r.prompt_token_ids_delta = None;
    Ok((r, text))
}

/// One day's parquet file of the segment being sealed, written under its dot-tmp name.
struct DayFile {
    /// Relative to `records/`: `date=YYYY-MM-DD/seg-N.parquet`.
    name: String,
    day_dir: PathBuf,
    tmp: PathBuf,
    dest: PathBuf,
    sink: ParquetSink,
    pending: Vec<(StoredRecord, RowText)>,
    pending_bytes: usize,
}

impl DayFile {
    fn flush(&mut self) -> Result<()> {
        if self.pending.is_empty() {
            return Ok(());
        }
        let rows: Vec<Row<'_>> = self
            .pending
            .iter()
            .map(|(rec, text)| Row { rec, text })
            .collect();
        self.sink.write(&rows)?;
        self.pending.clear();
        self.pending_bytes = 0;
        Ok(())
    }
}

/// Streams one WAL segment into its day files and manifest.
struct SegmentSealer<'a> {
    dir: &'a Path,
    segment: u64,
    limits: SealLimits,
    days: BTreeMap<String, DayFile>,
    sessions: BTreeMap<String, ManifestSession>,
    records: u64,
    /// Rows and payload bytes pending over all day files now, and their maxima.
    pending: (usize, usize),
    stats: SealStats,
}

impl<'a> SegmentSealer<'a> {
    fn new(dir: &'a Path, segment: u64, limits: SealLimits) -> Self {
        SegmentSealer {
            dir,
            segment,
            limits,
            days: BTreeMap::new(),
            sessions: BTreeMap::new(),
            records: 0,
            pending: (0, 0),
            stats: SealStats::default(),
        }
    }

    fn run(
        &mut self,
        reader: &mut wal::SegmentReader<impl std::io::Read>,
    ) -> Result<Option<Manifest>> {
        while let Some((record, payload_len)) = reader.next_record()? {
            self.push(record, payload_len)?;
        }
        if self.records == 0 {
            return Ok(None);
        }
        self.commit().map(Some)
    }

    fn push(&mut self, r: StoredRecord, payload_len: usize) -> Result<()> {
        let s = self.sessions.entry(r.session_id.clone()).or_default();
        s.last_seq = s.last_seq.max(r.seq);
        s.records += 1;
        self.records += 1;
        let day = day_of(r.started_at_us);
        let file = match self.days.entry(day) {
            std::collections::btree_map::Entry::Occupied(e) => e.into_mut(),
            std::collections::btree_map::Entry::Vacant(e) => {
                let file = open_day_file(self.dir, self.segment, e.key(), self.limits)?;
                e.insert(file)
            }
        };
        file.pending.push(into_row(r)?);
        file.pending_bytes += payload_len;
        self.pending.0 += 1;
        self.pending.1 += payload_len;
        self.stats.max_pending_rows = self.stats.max_pending_rows.max(self.pending.0);
        self.stats.max_pending_bytes = self.stats.max_pending_bytes.max(self.pending.1);
        if file.pending.len() >= self.limits.batch_rows
            || file.pending_bytes >= self.limits.batch_bytes
        {
            self.pending.0 -= file.pending.len();
            self.pending.1 -= file.pending_bytes;
            file.flush()?;
        }
        Ok(())
    }

    /// Each day file: last batch, footer, fsync, rename, fsync dir; then the manifest (the
    /// commit point) the same way.
    fn commit(&mut self) -> Result<Manifest> {
        let mut files = Vec::with_capacity(self.days.len());
        for (_, mut day) in std::mem::take(&mut self.days) {
            let finished = day.flush().and_then(|()| day.sink.finish());
            if let Err(e) = finished {
                remove_quietly(&day.tmp);
                return Err(e);
            }
            fs::rename(&day.tmp, &day.dest)
                .map_err(|e| RecorderError::io("renaming into place", &day.dest, e))?;
            wal::fsync_dir(&day.day_dir)?;
            files.push(day.name);
        }
        let manifest = Manifest {
            schema_version: SCHEMA_VERSION,
            segment: self.segment,
            records: self.records,
            files,
            sessions: std::mem::take(&mut self.sessions),
        };
        let bytes =
            serde_json::to_vec_pretty(&manifest).map_err(|source| RecorderError::Encode {
                call_id: format!("manifest of segment {}", self.segment),
                source,
            })?;
        wal::create_dir_all(&sealed_dir(self.dir))?;
        write_atomic(&manifest_path(self.dir, self.segment), &bytes)?;
        Ok(manifest)
    }

    /// After a failure: removes the temporaries not yet renamed. The WAL stays the truth;
    /// a day file already renamed is ignored without a manifest and rewritten next time.
    fn abandon(&mut self) {
        for (_, day) in std::mem::take(&mut self.days) {
            drop(day.sink);
            remove_quietly(&day.tmp);
        }
    }
}

fn open_day_file(dir: &Path, segment: u64, day: &str, limits: SealLimits) -> Result<DayFile> {
    let day_dir = records_dir(dir).join(format!("date={day}"));
    wal::create_dir_all(&day_dir)?;
    let name = parquet_name(segment);
    let tmp = day_dir.join(format!(".{name}.tmp"));
    let sink = ParquetSink::create(&tmp, DELTA_COLUMNS, limits.row_groups)?;
    Ok(DayFile {
        name: format!("date={day}/{name}"),
        dest: day_dir.join(&name),
        day_dir,
        tmp,
        sink,
        pending: Vec::with_capacity(limits.batch_rows.min(4096)),
        pending_bytes: 0,
    })
}

fn remove_quietly(path: &Path) {
    if let Err(e) = fs::remove_file(path)
        && e.kind() != std::io::ErrorKind::NotFound
    {
        tracing::warn!(path = %path.display(), error = %e, "could not remove the temporary file of a failed seal; it is removed at the next open");
    }
}

/// Manifests of all sealed segments, by segment number.
pub(crate) fn read_manifests(dir: &Path) -> Result<BTreeMap<u64, Manifest>> {
    let sealed = sealed_dir(dir);
    let entries = match fs::read_dir(&sealed) {
        Ok(e) => e,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(BTreeMap::new()),
        Err(e) => return Err(RecorderError::io("listing", sealed, e)),
    };
    let mut out = BTreeMap::new();
    for entry in entries {
        let entry = entry.map_err(|e| RecorderError::io("listing", &sealed, e))?;
        let Some(segment) = entry
            .file_name()
            .to_str()
            .and_then(|n| parse_seg_name(n, ".json"))
        else {
            continue;
        };
        let path = entry.path();
        let bytes = fs::read(&path).map_err(|e| RecorderError::io("reading manifest", &path, e))?;
        let manifest: Manifest =
            serde_json::from_slice(&bytes).map_err(|source| RecorderError::WalPayload {
                path: path.clone(),
                offset: 0,
                source,
            })?;
        out.insert(segment, manifest);
    }
    Ok(out)
}

/// Parquet segment files under `records/date=*/`, as (segment, path).
pub(crate) fn list_parquet(dir: &Path) -> Result<Vec<(u64, PathBuf)>> {
    let records = records_dir(dir);
    let entries = match fs::read_dir(&records) {
        Ok(e) => e,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(RecorderError::io("listing", records, e)),
    };
    let mut out = Vec::new();
    for day in entries {
        let day = day.map_err(|e| RecorderError::io("listing", &records, e))?;
        let is_day = day
            .file_name()
            .to_str()
            .is_some_and(|n| n.starts_with("date="));
        if !is_day || !day.path().is_dir() {
            continue;
        }
        let day_path = day.path();
        let files =
            fs::read_dir(&day_path).map_err(|e| RecorderError::io("listing", &day_path, e))?;
        for f in files {
            let f = f.map_err(|e| RecorderError::io("listing", &day_path, e))?;
            if let Some(segment) = f
                .file_name()
                .to_str()
                .and_then(|n| parse_seg_name(n, ".parquet"))
            {
                out.push((segment, f.path()));
            }
        }
    }
    out.sort();
    Ok(out)
}

/// Removes leftover dot-tmp files of interrupted seals.
fn remove_tmp_files(dir: &Path) -> Result<()> {
    let records = records_dir(dir);
    let mut dirs = vec![sealed_dir(dir)];
    if let Ok(entries) = fs::read_dir(&records) {
        dirs.extend(entries.flatten().map(|e| e.path()).filter(|p| p.is_dir()));
    }
    for d in dirs {
        let Ok(entries) = fs::read_dir(&d) else {
            continue;
        };
        for e in entries.flatten() {
            let name = e.file_name();
            let name = name.to_string_lossy();
            if name.starts_with('.') && name.ends_with(".tmp") {
                let path = e.path();
                fs::remove_file(&path)
                    .map_err(|err| RecorderError::io("removing leftover", &path, err))?;
                tracing::info!(path = %path.display(), "removed leftover temporary file of an interrupted seal");
            }
        }
    }
    Ok(())
}

/// Brings `dir` to a clean state: sealed segments' leftover WAL files deleted, every other
/// WAL segment's torn tail truncated and the segment sealed. Returns the report and the
/// next free segment number.
pub(crate) fn recover(dir: &Path) -> Result<(RecoveryReport, u64)> {
    wal::create_dir_all(&wal::wal_dir(dir))?;
    wal::create_dir_all(&sealed_dir(dir))?;
    remove_tmp_files(dir)?;

    let mut manifests = read_manifests(dir)?;
    let segments = wal::list_segments(dir)?;
    let parquet = list_parquet(dir)?;
    let max_seen = manifests
        .keys()
        .chain(segments.iter().map(|(n, _)| n))
        .chain(parquet.iter().map(|(n, _)| n))
        .copied()
        .max()
        .unwrap_or(0);

    let mut report = RecoveryReport::default();
    for (segment, path) in &segments {
        if manifests.contains_key(segment) {
            tracing::info!(segment, path = %path.display(), "WAL segment was already sealed; deleting it");
            fs::remove_file(path)
                .map_err(|e| RecorderError::io("deleting sealed WAL segment", path, e))?;
            wal::fsync_dir(&wal::wal_dir(dir))?;
            continue;
        }
        let scan = wal::measure_segment(path)?;
        if scan.torn_bytes > 0 {
            tracing::warn!(
                path = %path.display(),
                valid_bytes = scan.valid_len,
                torn_bytes = scan.torn_bytes,
                "WAL segment has a torn tail (crash while writing); truncating it at the last good frame"
            );
            report.torn_bytes_dropped += scan.torn_bytes;
        }
        if scan.file_len > scan.valid_len {
            wal::truncate(path, scan.valid_len)?;
        }
        report.recovered_records += scan.records;
        // Parquet of an interrupted seal of this segment is rewritten below.
        for (_, stale) in parquet.iter().filter(|(n, _)| n == segment) {
            fs::remove_file(stale)
                .map_err(|e| RecorderError::io("removing partial parquet of", stale, e))?;
        }
        if let Some(manifest) = seal_segment(dir, *segment)? {
            manifests.insert(*segment, manifest);
            report.sealed_segments += 1;
        }
    }
    report.sessions = session_states(manifests.values());
    Ok((report, max_seen + 1))
}

pub(crate) fn session_states<'a>(
    manifests: impl Iterator<Item = &'a Manifest>,
) -> HashMap<String, SessionState> {
    let mut out: HashMap<String, SessionState> = HashMap::new();
    for m in manifests {
        for (id, s) in &m.sessions {
            let st = out.entry(id.clone()).or_default();
            st.last_seq = st.last_seq.max(s.last_seq);
            st.records += s.records;
        }
    }
    out
}

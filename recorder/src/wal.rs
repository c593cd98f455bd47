//! Write-ahead log segments: `wal/00000001.wal`, a sequence of frames
//! `[u32 LE payload_len][u32 LE crc32(payload)][payload]`, payload = one [`StoredRecord`]
//! as JSON.
//!
//! Crash model: a frame with an impossible length, a bad checksum or a short read ends
//! the valid part of a segment. Everything from there on is a torn tail — including
//! valid-looking frames after a corrupt one, since the writer only ever appends and a
//! corrupt frame in the middle means the bytes after it cannot be trusted to be ours.
//! Recovery truncates the segment at the last good frame and counts the dropped bytes.

use std::fs::{self, File, OpenOptions};
use std::io::{BufReader, Read};
use std::path::{Path, PathBuf};

use crate::error::{RecorderError, Result};
use crate::record::{SCHEMA_VERSION, StoredRecord};

pub(crate) const WAL_DIR: &str = "wal";
const EXT: &str = "wal";
const HEADER: usize = 8;
/// Larger frames are treated as garbage (a torn length field).
pub(crate) const MAX_FRAME: u32 = 1 << 30;
/// Read buffer of a [`SegmentReader`].
const READ_BUFFER: usize = 256 * 1024;

pub(crate) fn wal_dir(dir: &Path) -> PathBuf {
    dir.join(WAL_DIR)
}

pub(crate) fn segment_path(dir: &Path, segment: u64) -> PathBuf {
    wal_dir(dir).join(format!("{segment:08}.{EXT}"))
}

fn parse_segment_name(name: &str) -> Option<u64> {
    let stem = name.strip_suffix(".wal")?;
    if stem.is_empty() || !stem.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    stem.parse().ok()
}

/// WAL segments under `dir/wal`, sorted by number. A missing `wal/` is empty.
pub(crate) fn list_segments(dir: &Path) -> Result<Vec<(u64, PathBuf)>> {
    let wal = wal_dir(dir);
    let entries = match fs::read_dir(&wal) {
        Ok(e) => e,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(RecorderError::io("listing", wal, e)),
    };
    let mut out = Vec::new();
    for entry in entries {
        let entry = entry.map_err(|e| RecorderError::io("listing", &wal, e))?;
        if let Some(n) = entry.file_name().to_str().and_then(parse_segment_name) {
            out.push((n, entry.path()));
        }
    }
    out.sort_unstable_by_key(|(n, _)| *n);
    Ok(out)
}

/// Appends one frame whose payload `write` puts straight into `out` (no copy of the
/// payload). `Err(size)` when the payload is over [`MAX_FRAME`]; the caller truncates
/// `out` back on any error.
pub(crate) fn frame_into<T>(
    out: &mut Vec<u8>,
    write: impl FnOnce(&mut Vec<u8>) -> T,
) -> Result<T, usize> {
    let start = out.len();
    out.extend_from_slice(&[0; 8]);
    let r = write(out);
    let len = out.len() - start - 8;
    let Ok(len32) = u32::try_from(len) else {
        return Err(len);
    };
    if len32 > MAX_FRAME {
        return Err(len);
    }
    let crc = crc32fast::hash(&out[start + 8..]);
    out[start..start + 4].copy_from_slice(&len32.to_le_bytes());
    out[start + 4..start + 8].copy_from_slice(&crc.to_le_bytes());
    Ok(r)
}

#[cfg_attr(not(test), allow(dead_code))]
pub(crate) fn append_frame(payload: &[u8], out: &mut Vec<u8>) {
    // Payloads are bounded by MAX_FRAME at the call site; saturate rather than wrap.
    let len = u32::try_from(payload.len()).unwrap_or(u32::MAX);
    out.extend_from_slice(&len.to_le_bytes());
    out.extend_from_slice(&crc32fast::hash(payload).to_le_bytes());
    out.extend_from_slice(payload);
}

/// Reads a segment frame by frame, holding one frame's payload at a time (sealing and
/// recovery never hold a whole segment). It stops at the first bad frame (the torn tail);
/// a frame with a valid checksum whose JSON does not parse is an error (a format
/// mismatch, not a crash).
pub(crate) struct SegmentReader<R> {
    path: PathBuf,
    input: R,
    payload: Vec<u8>,
    /// Bytes of valid frames read so far.
    valid_len: u64,
    /// The input's length when the reader was made; frames appended later are not read.
    file_len: u64,
    done: bool,
}

impl SegmentReader<BufReader<File>> {
    pub fn open(path: &Path) -> Result<Self> {
        let file =
            File::open(path).map_err(|e| RecorderError::io("reading WAL segment", path, e))?;
        let file_len = file
            .metadata()
            .map_err(|e| RecorderError::io("reading WAL segment", path, e))?
            .len();
        Ok(Self::new(
            path,
            BufReader::with_capacity(READ_BUFFER, file),
            file_len,
        ))
    }
}

impl<R: Read> SegmentReader<R> {
    pub fn new(path: &Path, input: R, file_len: u64) -> Self {
        SegmentReader {
            path: path.to_owned(),
            input,
            payload: Vec::new(),
            valid_len: 0,
            file_len,
            done: false,
        }
    }

    /// The next valid frame's record and its payload size; `None` at the end of the valid
    /// part.
    pub fn next_record(&mut self) -> Result<Option<(StoredRecord, usize)>> {
        if self.done {
            return Ok(None);
        }
        let Some(len) = self.next_payload()? else {
            self.done = true;
            return Ok(None);
        };
        let record = parse_payload(&self.path, self.valid_len, &self.payload[..len])?;
        self.valid_len += (HEADER + len) as u64;
        Ok(Some((record, len)))
    }

    /// Reads the next frame into `self.payload` and checks it; `None` when it is torn.
    fn next_payload(&mut self) -> Result<Option<usize>> {
        let mut header = [0u8; HEADER];
        if self.read_full(&mut header)? < HEADER {
            return Ok(None);
        }
        let len = u32::from_le_bytes([header[0], header[1], header[2], header[3]]);
        let crc = u32::from_le_bytes([header[4], header[5], header[6], header[7]]);
        let left = self.file_len.saturating_sub(self.valid_len + HEADER as u64);
        // A torn length field must not make us allocate: the frame has to fit the file.
        if len == 0 || len > MAX_FRAME || u64::from(len) > left {
            return Ok(None);
        }
        let len = len as usize;
        if self.payload.len() < len {
            self.payload.resize(len, 0);
        }
        let mut payload = std::mem::take(&mut self.payload);
        let read = self.read_full(&mut payload[..len]);
        self.payload = payload;
        if read? < len || crc32fast::hash(&self.payload[..len]) != crc {
            return Ok(None);
        }
        Ok(Some(len))
    }

    /// Fills `buf` unless the input ends first; returns the bytes read.
    fn read_full(&mut self, buf: &mut [u8]) -> Result<usize> {
        let mut n = 0;
        while n < buf.len() {
            match self.input.read(&mut buf[n..]) {
                Ok(0) => break,
                Ok(k) => n += k,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => return Err(RecorderError::io("reading WAL segment", &self.path, e)),
            }
        }
        Ok(n)
    }

    /// Bytes of valid frames read so far (after the last `None`: the valid part).
    pub fn valid_len(&self) -> u64 {
        self.valid_len
    }

    pub fn file_len(&self) -> u64 {
        self.file_len
    }
}

/// Reads every valid frame of a segment into memory (readers; sealing and recovery use
/// [`SegmentReader`]). Torn tails are not an error; a frame with a valid checksum whose
/// JSON does not parse is.
pub(crate) fn scan_segment(path: &Path) -> Result<Vec<StoredRecord>> {
    let mut reader = SegmentReader::open(path)?;
    let mut records = Vec::new();
    while let Some((record, _)) = reader.next_record()? {
        records.push(record);
    }
    Ok(records)
}

/// A segment's valid records counted, one frame at a time.
#[derive(Debug, Default)]
pub(crate) struct SegmentExtent {
    pub records: u64,
    pub valid_len: u64,
    pub file_len: u64,
    /// Bytes after the valid part up to the last non-zero byte: what a crash tore. The
    /// zeros after it are the writer's zero-filled lead (`prealloc`), not data.
    pub torn_bytes: u64,
}

/// Counts a segment's valid records and measures its valid part without holding them.
pub(crate) fn measure_segment(path: &Path) -> Result<SegmentExtent> {
    let mut reader = SegmentReader::open(path)?;
    let mut records = 0u64;
    while reader.next_record()?.is_some() {
        records += 1;
    }
    let (valid_len, file_len) = (reader.valid_len(), reader.file_len());
    Ok(SegmentExtent {
        records,
        valid_len,
        file_len,
        torn_bytes: torn_len(path, valid_len)?,
    })
}

/// Bytes of `path` from `valid_len` up to its last non-zero byte (0 when everything after
/// the valid part is zeros: a zero-filled lead, or nothing).
pub(crate) fn torn_len(path: &Path, valid_len: u64) -> Result<u64> {
    use std::io::{Seek, SeekFrom};
    let mut file =
        File::open(path).map_err(|e| RecorderError::io("reading WAL segment", path, e))?;
    file.seek(SeekFrom::Start(valid_len))
        .map_err(|e| RecorderError::io("reading WAL segment", path, e))?;
    let mut input = BufReader::with_capacity(READ_BUFFER, file);
    let mut buf = vec![0u8; READ_BUFFER];
    let (mut at, mut last_nonzero) = (0u64, 0u64);
    loop {
        let n = match input.read(&mut buf) {
            Ok(0) => return Ok(last_nonzero),
            Ok(n) => n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(RecorderError::io("reading WAL segment", path, e)),
        };
        if let Some(i) = buf[..n].iter().rposition(|&b| b != 0) {
            last_nonzero = at + i as u64 + 1;
        }
        at += n as u64;
    }
}

/// What a segment holds up to its first bad frame.
#[cfg(test)]
#[derive(Debug, Default)]
pub(crate) struct SegmentScan {
    pub records: Vec<StoredRecord>,
    /// Bytes of valid frames from the start of the file.
    pub valid_len: u64,
    /// The file's length; `file_len - valid_len` bytes are a torn tail.
    pub file_len: u64,
}

#[cfg(test)]
impl SegmentScan {
    pub fn torn_bytes(&self) -> u64 {
        self.file_len - self.valid_len
    }
}

#[cfg(test)]
pub(crate) fn scan_bytes(path: &Path, bytes: &[u8]) -> Result<SegmentScan> {
    let mut reader = SegmentReader::new(path, bytes, bytes.len() as u64);
    let mut records = Vec::new();
    while let Some((record, _)) = reader.next_record()? {
        records.push(record);
    }
    Ok(SegmentScan {
        records,
        valid_len: reader.valid_len(),
        file_len: reader.file_len(),
    })
}

fn parse_payload(path: &Path, offset: u64, payload: &[u8]) -> Result<StoredRecord> {
    serde_json::from_slice(payload).map_err(|source| {
        #[derive(serde::Deserialize)]
        struct Version {
            schema_version: u32,
        }
        match serde_json::from_slice::<Version>(payload) {
            Ok(v) if v.schema_version > SCHEMA_VERSION => RecorderError::UnsupportedSchema {
                path: path.to_owned(),
                found: v.schema_version,
                supported: SCHEMA_VERSION,
            },
            _ => RecorderError::WalPayload {
                path: path.to_owned(),
                offset,
                source,
            },
        }
    })
}

/// Cuts a torn tail off and makes the cut durable.
pub(crate) fn truncate(path: &Path, len: u64) -> Result<()> {
    let file = OpenOptions::new()
        .write(true)
        .open(path)
        .map_err(|e| RecorderError::io("opening WAL segment to truncate", path, e))?;
    file.set_len(len)
        .and_then(|()| file.sync_all())
        .map_err(|e| RecorderError::io("truncating torn tail of", path, e))
}

/// fsyncs a directory so that renames, creations and deletions in it are durable.
pub(crate) fn fsync_dir(path: &Path) -> Result<()> {
    #[cfg(unix)]
    {
        File::open(path)
            .and_then(|d| d.sync_all())
            .map_err(|e| RecorderError::io("fsyncing directory", path, e))?;
    }
    #[cfg(not(unix))]
    let _ = path;
    Ok(())
}

pub(crate) fn create_dir_all(path: &Path) -> Result<()> {
    fs::create_dir_all(path).map_err(|e| RecorderError::io("creating directory", path, e))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn segment_names_round_trip_and_ignore_strangers() {
        let p = segment_path(Path::new("/d"), 7);
        assert_eq!(p, Path::new("/d/wal/00000007.wal"));
        assert_eq!(parse_segment_name("00000007.wal"), Some(7));
        assert_eq!(parse_segment_name("123456789.wal"), Some(123_456_789));
        assert_eq!(parse_segment_name("x.wal"), None);
        assert_eq!(parse_segment_name("00000007.wal.tmp"), None);
    }

    #[test]
    fn the_reader_reads_frame_by_frame_and_stops_at_a_frame_longer_than_the_file() {
        let rec = |i: u64| StoredRecord {
            schema_version: SCHEMA_VERSION,
            call_id: format!("c{i}"),
            session_id: "s".to_owned(),
            group_id: None,
            seq: i,
            started_at_us: 0,
            finished_at_us: 0,
            dialect: "chat_completions".to_owned(),
            endpoint: "/v1/chat/completions".to_owned(),
            model: None,
            upstream: String::new(),
            stream: false,
            request_delta: crate::delta::encode(None, &serde_json::json!({"i": i})),
            response: None,
            status: 200,
            outcome: "ok".to_owned(),
            error: None,
            prompt_token_ids: None,
            completion_token_ids: None,
            completion_logprobs: None,
            finish_reason: None,
            weight_version: None,
            usage: None,
            ttft_ms: None,
            latency_ms: 1.0,
            client: None,
            normalized_request_delta: None,
            normalized_response: None,
            upstream_request_delta: None,
            upstream_dialect: None,
            prompt_token_ids_delta: None,
            weight_version_spans: None,
            sampling: None,
            attempt: None,
            retry_of: None,
            backend_finish_reason: None,
            stop_matched: None,
            headers: None,
            replay: None,
        };
        let mut bytes = Vec::new();
        for i in 1..=3 {
            append_frame(&serde_json::to_vec(&rec(i)).unwrap(), &mut bytes);
        }
        let valid = bytes.len() as u64;
        // A torn header claiming a frame far past the end of the file (not allocated).
        bytes.extend_from_slice(&(MAX_FRAME - 1).to_le_bytes());
        bytes.extend_from_slice(&[0, 0, 0, 0, b'{']);
        let scan = scan_bytes(Path::new("x"), &bytes).unwrap();
        let seqs: Vec<u64> = scan.records.iter().map(|r| r.seq).collect();
        assert_eq!(seqs, [1, 2, 3]);
        assert_eq!((scan.valid_len, scan.torn_bytes()), (valid, 9));
        assert_eq!(scan.records[2], rec(3));
    }

    #[test]
    fn garbage_and_short_frames_end_the_valid_part() {
        let mut bytes = Vec::new();
        append_frame(b"not json but crc ok", &mut bytes);
        // A valid-checksum frame with bad JSON is a hard error, not a torn tail.
        assert!(scan_bytes(Path::new("x"), &bytes).is_err());

        let mut bytes = Vec::new();
        append_frame(b"{}", &mut bytes);
        bytes.truncate(bytes.len() - 1);
        let scan = scan_bytes(Path::new("x"), &bytes).unwrap();
        assert_eq!((scan.valid_len, scan.torn_bytes()), (0, 9));
        let scan = scan_bytes(Path::new("x"), &[0xff; 5]).unwrap();
        assert_eq!(scan.torn_bytes(), 5);
    }
}

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
use std::io::Read;
use std::path::{Path, PathBuf};

use crate::error::{RecorderError, Result};
use crate::record::{SCHEMA_VERSION, StoredRecord};

pub(crate) const WAL_DIR: &str = "wal";
const EXT: &str = "wal";
const HEADER: usize = 8;
/// Larger frames are treated as garbage (a torn length field).
pub(crate) const MAX_FRAME: u32 = 1 << 30;

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

pub(crate) fn append_frame(payload: &[u8], out: &mut Vec<u8>) {
    // Payloads are bounded by MAX_FRAME at the call site; saturate rather than wrap.
    let len = u32::try_from(payload.len()).unwrap_or(u32::MAX);
    out.extend_from_slice(&len.to_le_bytes());
    out.extend_from_slice(&crc32fast::hash(payload).to_le_bytes());
    out.extend_from_slice(payload);
}

/// What a segment holds up to its first bad frame.
#[derive(Debug, Default)]
pub(crate) struct SegmentScan {
    pub records: Vec<StoredRecord>,
    /// Bytes of valid frames from the start of the file.
    pub valid_len: u64,
    /// The file's length; `file_len - valid_len` bytes are a torn tail.
    pub file_len: u64,
}

impl SegmentScan {
    pub fn torn_bytes(&self) -> u64 {
        self.file_len - self.valid_len
    }
}

/// Reads every valid frame of a segment. Torn tails are not an error; a frame with a
/// valid checksum whose JSON does not parse is (it means a format mismatch, not a crash).
pub(crate) fn scan_segment(path: &Path) -> Result<SegmentScan> {
    let mut bytes = Vec::new();
    File::open(path)
        .and_then(|mut f| f.read_to_end(&mut bytes))
        .map_err(|e| RecorderError::io("reading WAL segment", path, e))?;
    scan_bytes(path, &bytes)
}

pub(crate) fn scan_bytes(path: &Path, bytes: &[u8]) -> Result<SegmentScan> {
    let mut scan = SegmentScan {
        file_len: bytes.len() as u64,
        ..SegmentScan::default()
    };
    let mut pos = 0usize;
    while let Some(header) = bytes.get(pos..pos + HEADER) {
        let len = u32::from_le_bytes([header[0], header[1], header[2], header[3]]);
        let crc = u32::from_le_bytes([header[4], header[5], header[6], header[7]]);
        if len == 0 || len > MAX_FRAME {
            break;
        }
        let start = pos + HEADER;
        let Some(payload) = bytes.get(start..start + len as usize) else {
            break;
        };
        if crc32fast::hash(payload) != crc {
            break;
        }
        let record = parse_payload(path, pos as u64, payload)?;
        scan.records.push(record);
        pos = start + len as usize;
        scan.valid_len = pos as u64;
    }
    Ok(scan)
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

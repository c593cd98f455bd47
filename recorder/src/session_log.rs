//! Durable session event log: `<dir>/sessions.log`, one JSON event per line, fsynced per
//! append. A failed append (a full disk, an I/O error) is cut back to the last whole line
//! at once, and if even that fails, before the next append writes anything: an event can
//! never be glued onto a torn one. A crash can only tear the last line (no trailing
//! newline); it is dropped on open and reported. A bad line in the middle is a named error
//! with its byte offset, and [`repair`] (`graft records repair`) keeps every whole event.

use std::fs::File;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, PoisonError};

use serde::{Deserialize, Serialize};

use crate::error::{RecorderError, Result};
use crate::lines::LineFile;
use crate::wal;

pub(crate) const SESSION_LOG: &str = "sessions.log";

/// What happened to a session, in the order it happened.
///
/// Strict: a field this build does not know is an error, not ignored, so a line whose field
/// name was damaged (`key_sha256` → `key_shXXa256`) never loads as a session without its
/// key; the error names the line and its byte offset, and `graft records repair` drops the
/// line (keeping it in the original beside the log). Fields are only ever added, so every
/// log an older graft wrote still reads (`tests/fixtures/v*/sessions.log`); a log written by
/// a newer graft with a field this one lacks is refused by name instead of half-read.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "event", rename_all = "snake_case", deny_unknown_fields)]
pub enum SessionEvent {
    Created {
        session_id: String,
        group_id: Option<String>,
        key_sha256: Option<String>,
        metadata: serde_json::Value,
        /// The session's sampling policy, as the gateway wrote it (absent: none).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        sampling: Option<serde_json::Value>,
        /// The exact-mode backend the session named for itself (absent: the gateway picks).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        backend: Option<String>,
        at_us: i64,
    },
    /// The session's sampling policy was set (`null`: removed).
    Sampling {
        session_id: String,
        policy: Option<serde_json::Value>,
        at_us: i64,
    },
    Reward {
        session_id: String,
        reward: f64,
        info: serde_json::Value,
        at_us: i64,
    },
    /// A reward for one call of the session (a process reward for that turn), beside the
    /// session's own; the last one posted for a call counts. The call is named by its id
    /// or by its `seq` in the session (one of the two).
    CallReward {
        session_id: String,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        call_id: Option<String>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        seq: Option<u64>,
        reward: f64,
        info: serde_json::Value,
        at_us: i64,
    },
    Closed {
        session_id: String,
        at_us: i64,
    },
}

impl SessionEvent {
    pub fn session_id(&self) -> &str {
        match self {
            Self::Created { session_id, .. }
            | Self::Sampling { session_id, .. }
            | Self::Reward { session_id, .. }
            | Self::CallReward { session_id, .. }
            | Self::Closed { session_id, .. } => session_id,
        }
    }
}

/// Appender for `sessions.log`.
#[derive(Debug, Clone)]
pub struct SessionLog {
    path: PathBuf,
    file: Arc<Mutex<LineFile>>,
}

struct Parsed {
    events: Vec<SessionEvent>,
    /// Bytes of complete lines.
    valid_len: u64,
    file_len: u64,
}

fn parse(path: &Path, bytes: &[u8]) -> Result<Parsed> {
    let mut events = Vec::new();
    let mut offset = 0usize;
    let mut line_no = 0usize;
    while let Some(nl) = bytes[offset..].iter().position(|&b| b == b'\n') {
        line_no += 1;
        let line = &bytes[offset..offset + nl];
        if !line.iter().all(u8::is_ascii_whitespace) {
            let ev =
                serde_json::from_slice(line).map_err(|source| RecorderError::SessionLogLine {
                    path: path.to_owned(),
                    line: line_no,
                    offset: offset as u64,
                    source,
                })?;
            events.push(ev);
        }
        offset += nl + 1;
    }
    Ok(Parsed {
        events,
        valid_len: offset as u64,
        file_len: bytes.len() as u64,
    })
}

fn read_log(path: &Path) -> Result<Parsed> {
    match std::fs::read(path) {
        Ok(bytes) => parse(path, &bytes),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(Parsed {
            events: Vec::new(),
            valid_len: 0,
            file_len: 0,
        }),
        Err(e) => Err(RecorderError::io("reading session log", path, e)),
    }
}

impl SessionLog {
    /// Opens (creating) `<dir>/sessions.log`, drops a torn last line and returns the
    /// events it holds.
    pub fn open(dir: &Path) -> Result<(SessionLog, Vec<SessionEvent>)> {
        wal::create_dir_all(dir)?;
        let path = dir.join(SESSION_LOG);
        let parsed = read_log(&path)?;
        let torn = parsed.file_len - parsed.valid_len;
        if torn > 0 {
            tracing::warn!(
                path = %path.display(),
                torn_bytes = torn,
                "session log ends in a torn line (crash while appending); dropping it"
            );
        }
        let file = LineFile::open_whole(&path, parsed.valid_len)
            .map_err(|e| RecorderError::io("opening session log", &path, e))?;
        wal::fsync_dir(dir)?;
        let log = SessionLog {
            path,
            file: Arc::new(Mutex::new(file)),
        };
        Ok((log, parsed.events))
    }

    /// Appends one event and fsyncs it.
    pub async fn append(&self, ev: &SessionEvent) -> Result<()> {
        let mut line = serde_json::to_vec(ev).map_err(|source| RecorderError::Encode {
            call_id: format!("session event of '{}'", ev.session_id()),
            source,
        })?;
        line.push(b'\n');
        let file = self.file.clone();
        let path = self.path.clone();
        tokio::task::spawn_blocking(move || {
            let mut f = file.lock().unwrap_or_else(PoisonError::into_inner);
            f.append(&line)
                .map_err(|e| RecorderError::io("appending to session log", &path, e))
        })
        .await
        .map_err(|e| RecorderError::Task {
            message: e.to_string(),
        })?
    }

    pub fn path(&self) -> &Path {
        &self.path
    }
}

/// Reads `<dir>/sessions.log` without modifying it (a torn last line is skipped).
pub fn read_session_events(dir: &Path) -> Result<Vec<SessionEvent>> {
    Ok(read_log(&dir.join(SESSION_LOG))?.events)
}

/// What [`repair`] did.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct Repair {
    /// Events kept (whole ones, including those recovered from glued lines).
    pub kept: usize,
    /// Events recovered from the end of a line that began with a torn event (a line written
    /// right after a failed append by a graft that did not cut the log back).
    pub recovered: usize,
    /// `(byte offset, length)` of each stretch dropped: torn events and other bytes that
    /// are no whole event.
    pub dropped: Vec<(u64, u64)>,
    /// Where the original file was kept (None when there was nothing to repair).
    pub original: Option<PathBuf>,
}

/// Rewrites `<dir>/sessions.log` keeping every whole event, in order: lines that parse;
/// from a line that does not, the event that starts after a torn one (the first
/// `{"event":` from which the rest parses); a torn last line is dropped. The original is
/// kept beside it as `sessions.log.broken-<unix seconds>`; the new file replaces it
/// atomically. The gateway must not be running on the data dir.
pub fn repair(dir: &Path) -> Result<Repair> {
    let path = dir.join(SESSION_LOG);
    let bytes = match std::fs::read(&path) {
        Ok(b) => b,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Repair::default()),
        Err(e) => return Err(RecorderError::io("reading session log", &path, e)),
    };
    let mut out = Vec::with_capacity(bytes.len());
    let mut report = Repair::default();
    let mut offset = 0usize;
    while offset < bytes.len() {
        let (line, next) = match bytes[offset..].iter().position(|&b| b == b'\n') {
            Some(nl) => (&bytes[offset..offset + nl], offset + nl + 1),
            None => (&bytes[offset..], bytes.len()),
        };
        let whole = next <= bytes.len() && bytes.get(next - 1) == Some(&b'\n');
        if line.iter().all(u8::is_ascii_whitespace) {
            offset = next;
            continue;
        }
        if whole && serde_json::from_slice::<SessionEvent>(line).is_ok() {
            out.extend_from_slice(line);
            out.push(b'\n');
            report.kept += 1;
        } else {
            let start = whole.then(|| salvage(line)).flatten();
            let cut = start.unwrap_or(line.len());
            if cut > 0 {
                report.dropped.push((offset as u64, cut as u64));
            }
            if let Some(at) = start {
                out.extend_from_slice(&line[at..]);
                out.push(b'\n');
                report.kept += 1;
                report.recovered += 1;
            }
        }
        offset = next;
    }
    if report.dropped.is_empty() {
        return Ok(report);
    }
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    let original = dir.join(format!("{SESSION_LOG}.broken-{now}"));
    let tmp = dir.join(format!("{SESSION_LOG}.repair-tmp"));
    let write = || -> std::io::Result<()> {
        let mut f = File::create(&tmp)?;
        f.write_all(&out)?;
        f.sync_all()?;
        std::fs::hard_link(&path, &original)?;
        std::fs::rename(&tmp, &path)
    };
    write().map_err(|e| RecorderError::io("rewriting session log", &path, e))?;
    wal::fsync_dir(dir)?;
    report.original = Some(original);
    Ok(report)
}

/// Where a whole event starts inside a line that is not one: the first `{"event":` after
/// the line's start from which the rest of the line parses.
fn salvage(line: &[u8]) -> Option<usize> {
    const START: &[u8] = br#"{"event":"#;
    (1..line.len().saturating_sub(START.len() - 1))
        .filter(|&i| line[i..].starts_with(START))
        .find(|&i| serde_json::from_slice::<SessionEvent>(&line[i..]).is_ok())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::lines::{Appender, LogFile};
    use serde_json::json;
    use std::fs::OpenOptions;

    fn created(id: &str) -> SessionEvent {
        SessionEvent::Created {
            session_id: id.into(),
            group_id: Some("g".into()),
            key_sha256: None,
            metadata: json!({"task": 1}),
            sampling: None,
            backend: None,
            at_us: 5,
        }
    }

    #[tokio::test]
    async fn replays_events_and_drops_a_torn_last_line() {
        let dir = tempfile::tempdir().unwrap();
        let (log, evs) = SessionLog::open(dir.path()).unwrap();
        assert!(evs.is_empty());
        let all = vec![
            created("a"),
            SessionEvent::Reward {
                session_id: "a".into(),
                reward: 0.5,
                info: json!({}),
                at_us: 6,
            },
            SessionEvent::Closed {
                session_id: "a".into(),
                at_us: 7,
            },
        ];
        for e in &all {
            log.append(e).await.unwrap();
        }
        drop(log);
        let path = dir.path().join(SESSION_LOG);
        let text = std::fs::read_to_string(&path).unwrap();
        assert!(
            text.lines()
                .next()
                .unwrap()
                .contains(r#""event":"created""#)
        );

        // Torn append: half a line, no newline.
        let mut f = OpenOptions::new().append(true).open(&path).unwrap();
        f.write_all(br#"{"event":"closed","sess"#).unwrap();
        drop(f);
        assert_eq!(read_session_events(dir.path()).unwrap(), all);
        let (log, evs) = SessionLog::open(dir.path()).unwrap();
        assert_eq!(evs, all);
        assert_eq!(
            std::fs::read_to_string(&path).unwrap(),
            text,
            "torn line truncated"
        );
        log.append(&created("b")).await.unwrap();
        let (_, evs) = SessionLog::open(dir.path()).unwrap();
        assert_eq!(evs.len(), 4);
    }

    /// A file whose writes fail after `budget` more bytes (writing those first, as a full
    /// disk does) and whose `set_len` fails while `stuck`.
    struct Faulty {
        file: File,
        budget: Option<usize>,
        stuck: bool,
    }

    impl Write for Faulty {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            match self.budget {
                Some(0) => Err(std::io::Error::from_raw_os_error(28)),
                Some(n) => {
                    let k = n.min(buf.len());
                    self.budget = Some(n - k);
                    self.file.write(&buf[..k])
                }
                None => self.file.write(buf),
            }
        }
        fn flush(&mut self) -> std::io::Result<()> {
            self.file.flush()
        }
    }

    impl LogFile for Faulty {
        fn set_len(&self, len: u64) -> std::io::Result<()> {
            if self.stuck {
                return Err(std::io::Error::from_raw_os_error(5));
            }
            self.file.set_len(len)
        }
        fn sync_data(&self) -> std::io::Result<()> {
            self.file.sync_data()
        }
    }

    fn line(e: &SessionEvent) -> Vec<u8> {
        let mut l = serde_json::to_vec(e).unwrap();
        l.push(b'\n');
        l
    }

    /// A full disk partway through an append: the append fails, the file is cut back to
    /// its whole lines at once; when even the cut fails, the next append cuts first. The
    /// next append lands on its own line and every acknowledged event reads back.
    #[test]
    fn a_failed_append_never_leaves_a_torn_line_for_the_next_one() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join(SESSION_LOG);
        let file = OpenOptions::new()
            .create(true)
            .append(true)
            .open(&path)
            .unwrap();
        let mut a = Appender {
            file: Faulty {
                file,
                budget: None,
                stuck: false,
            },
            len: 0,
            torn: false,
        };
        a.append(&line(&created("a"))).unwrap();
        // Half of b is written, then the disk is full: cut back at once.
        a.file.budget = Some(10);
        let err = a.append(&line(&created("b"))).unwrap_err();
        assert_eq!(err.raw_os_error(), Some(28));
        assert_eq!(std::fs::read(&path).unwrap(), line(&created("a")));
        assert!(!a.torn);
        // Half of c, and the cut fails too: the torn bytes stay until the next append.
        a.file.budget = Some(10);
        a.file.stuck = true;
        a.append(&line(&created("c"))).unwrap_err();
        assert!(a.torn);
        assert_eq!(
            std::fs::read(&path).unwrap().len(),
            line(&created("a")).len() + 10
        );
        // While the cut keeps failing, nothing is written.
        a.file.budget = None;
        a.append(&line(&created("d"))).unwrap_err();
        assert_eq!(
            std::fs::read(&path).unwrap().len(),
            line(&created("a")).len() + 10
        );
        // Space and the cut are back: d lands on its own line after a.
        a.file.stuck = false;
        a.append(&line(&created("d"))).unwrap();
        let mut want = line(&created("a"));
        want.extend(line(&created("d")));
        assert_eq!(std::fs::read(&path).unwrap(), want);
        assert_eq!(
            read_session_events(dir.path()).unwrap(),
            vec![created("a"), created("d")]
        );
    }

    /// A log written by a graft that did not cut back (an event glued onto a torn one, a
    /// line of garbage, a torn tail): opening it is a named error with the byte offset and
    /// the repair command; the repair keeps every whole event, the glued one included,
    /// keeps the original beside it, and the log then opens.
    #[test]
    fn repair_keeps_every_whole_event_of_a_log_with_a_glued_line() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join(SESSION_LOG);
        let torn = &line(&created("b"))[..17];
        let mut bytes = line(&created("a"));
        let glued_at = bytes.len();
        bytes.extend_from_slice(torn);
        bytes.extend(line(&created("c")));
        bytes.extend_from_slice(b"not an event\n");
        bytes.extend(line(&created("d")));
        bytes.extend_from_slice(br#"{"event":"clo"#);
        std::fs::write(&path, &bytes).unwrap();
        let err = SessionLog::open(dir.path()).unwrap_err().to_string();
        assert!(
            err.contains("line 2")
                && err.contains(&format!("byte {glued_at}"))
                && err.contains("graft records repair"),
            "{err}"
        );
        let r = repair(dir.path()).unwrap();
        assert_eq!((r.kept, r.recovered), (3, 1), "{r:?}");
        assert_eq!(r.dropped.len(), 3, "{r:?}");
        assert_eq!(r.dropped[0], (glued_at as u64, 17));
        assert_eq!(std::fs::read(r.original.unwrap()).unwrap(), bytes);
        let (_, evs) = SessionLog::open(dir.path()).unwrap();
        assert_eq!(evs, vec![created("a"), created("c"), created("d")]);
        // A whole log is left as it is.
        let again = repair(dir.path()).unwrap();
        assert!(
            again.dropped.is_empty() && again.original.is_none(),
            "{again:?}"
        );
    }

    /// Issue 32: a line whose field name was damaged (`key_sha256` → `key_shXXa256`) is no
    /// event: opening the log names the line, its byte offset and the field; the repair drops
    /// that line only (the original is kept beside the log). Every event kind, as written,
    /// still reads, also without the fields older grafts did not write.
    #[test]
    fn a_damaged_field_name_is_a_named_error_never_a_session_without_its_key() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join(SESSION_LOG);
        let mut keyed = created("k");
        if let SessionEvent::Created { key_sha256, .. } = &mut keyed {
            *key_sha256 = Some("ab".repeat(32));
        }
        let mut bytes = line(&created("a"));
        let at = bytes.len();
        let damaged = String::from_utf8(line(&keyed))
            .unwrap()
            .replace("key_sha256", "key_shXXa256");
        bytes.extend_from_slice(damaged.as_bytes());
        bytes.extend(line(&created("c")));
        std::fs::write(&path, &bytes).unwrap();
        let err = SessionLog::open(dir.path()).unwrap_err().to_string();
        assert!(
            err.contains("line 2")
                && err.contains(&format!("byte {at}"))
                && err.contains("key_shXXa256")
                && err.contains("graft records repair"),
            "{err}"
        );
        assert!(read_session_events(dir.path()).is_err());
        let r = repair(dir.path()).unwrap();
        assert_eq!((r.kept, r.recovered), (2, 0), "{r:?}");
        assert_eq!(r.dropped, vec![(at as u64, damaged.len() as u64 - 1)]);
        let (_, evs) = SessionLog::open(dir.path()).unwrap();
        assert_eq!(evs, vec![created("a"), created("c")]);

        // Every kind as this build writes it, and as the first graft wrote them (no
        // sampling, backend, call_id or seq), reads back.
        let all = [
            keyed,
            SessionEvent::Sampling {
                session_id: "k".into(),
                policy: None,
                at_us: 1,
            },
            SessionEvent::CallReward {
                session_id: "k".into(),
                call_id: Some("c1".into()),
                seq: Some(2),
                reward: 1.0,
                info: json!({"any": {"nested": "keys"}}),
                at_us: 2,
            },
        ];
        for e in &all {
            let back: SessionEvent = serde_json::from_slice(&line(e)).unwrap();
            assert_eq!(&back, e);
        }
        for old in [
            r#"{"event":"created","session_id":"o","group_id":null,"key_sha256":null,"metadata":{},"at_us":1}"#,
            r#"{"event":"reward","session_id":"o","reward":0.5,"info":null,"at_us":2}"#,
            r#"{"event":"call_reward","session_id":"o","reward":0.5,"info":null,"at_us":2}"#,
            r#"{"event":"closed","session_id":"o","at_us":3}"#,
        ] {
            serde_json::from_str::<SessionEvent>(old).unwrap_or_else(|e| panic!("{old}: {e}"));
        }
        for damaged in [
            r#"{"event":"closed","session_id":"o","at_us":3,"extra":1}"#,
            r#"{"event":"reward","session_id":"o","reward":0.5,"inf0":null,"info":null,"at_us":2}"#,
        ] {
            assert!(
                serde_json::from_str::<SessionEvent>(damaged).is_err(),
                "{damaged}"
            );
        }
    }

    #[test]
    fn a_bad_line_in_the_middle_is_an_error_naming_the_line() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(
            dir.path().join(SESSION_LOG),
            "{\"event\":\"closed\",\"session_id\":\"a\",\"at_us\":1}\nnot json\n",
        )
        .unwrap();
        let err = SessionLog::open(dir.path()).unwrap_err().to_string();
        assert!(err.contains("line 2"), "{err}");
    }
}

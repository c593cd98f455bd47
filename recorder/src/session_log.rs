//! Durable session event log: `<dir>/sessions.log`, one JSON event per line, fsynced per
//! append. A crash can only tear the last line (no trailing newline); it is dropped on
//! open. A bad line in the middle is an error (an operator must look at it).

use std::fs::{File, OpenOptions};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, PoisonError};

use serde::{Deserialize, Serialize};

use crate::error::{RecorderError, Result};
use crate::wal;

pub(crate) const SESSION_LOG: &str = "sessions.log";

/// What happened to a session, in the order it happened.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "event", rename_all = "snake_case")]
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
    file: Arc<Mutex<File>>,
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
        let file = OpenOptions::new()
            .create(true)
            .append(true)
            .open(&path)
            .map_err(|e| RecorderError::io("opening session log", &path, e))?;
        let torn = parsed.file_len - parsed.valid_len;
        if torn > 0 {
            tracing::warn!(
                path = %path.display(),
                torn_bytes = torn,
                "session log ends in a torn line (crash while appending); dropping it"
            );
            file.set_len(parsed.valid_len)
                .and_then(|()| file.sync_all())
                .map_err(|e| RecorderError::io("truncating torn line of session log", &path, e))?;
        }
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
            f.write_all(&line)
                .and_then(|()| f.sync_data())
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

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

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

//! Files of whole lines that graft appends to (the session log, `graft rl`'s
//! `steps.jsonl`): each append is written and fsynced; one that fails (a full disk, an I/O
//! error) is cut back to the last whole line at once, or, if even the cut fails, before the
//! next append writes anything, so a line never lands glued onto a torn one. Opening cuts
//! a torn last line (a crash mid-append).

use std::fs::{File, OpenOptions};
use std::io::Write;
use std::path::Path;

/// What [`Appender`] needs of its file (a trait so tests can make it fail).
pub(crate) trait LogFile: Write {
    fn set_len(&self, len: u64) -> std::io::Result<()>;
    fn sync_data(&self) -> std::io::Result<()>;
}

impl LogFile for File {
    fn set_len(&self, len: u64) -> std::io::Result<()> {
        File::set_len(self, len)
    }
    fn sync_data(&self) -> std::io::Result<()> {
        File::sync_data(self)
    }
}

/// The open file (in append mode), the length of its whole lines, and whether a failed
/// append may have left bytes past it that could not be cut yet.
#[derive(Debug)]
pub(crate) struct Appender<F = File> {
    pub(crate) file: F,
    pub(crate) len: u64,
    pub(crate) torn: bool,
}

impl<F: LogFile> Appender<F> {
    /// Writes and fsyncs `line` (one whole line); on failure cuts the file back to its
    /// whole lines, or remembers to before the next write.
    pub(crate) fn append(&mut self, line: &[u8]) -> std::io::Result<()> {
        if self.torn {
            self.cut()?;
        }
        let written = self
            .file
            .write_all(line)
            .and_then(|()| self.file.sync_data());
        match written {
            Ok(()) => {
                self.len += line.len() as u64;
                Ok(())
            }
            Err(e) => {
                if let Err(cut) = self.cut() {
                    self.torn = true;
                    tracing::error!(error = %cut, "a log could not be cut back after a failed append; the next append cuts it first");
                }
                Err(e)
            }
        }
    }

    /// Cuts the file back to its whole lines.
    fn cut(&mut self) -> std::io::Result<()> {
        self.file.set_len(self.len)?;
        self.file.sync_data()?;
        self.torn = false;
        Ok(())
    }
}

/// An append-only file of whole lines (see the module doc).
#[derive(Debug)]
pub struct LineFile(Appender);

impl LineFile {
    /// Opens (creating) `path` for appending; a torn last line (no trailing newline) is
    /// cut. Returns the file and how many torn bytes were cut.
    pub fn open(path: &Path) -> std::io::Result<(LineFile, u64)> {
        let whole = match std::fs::read(path) {
            Ok(bytes) => bytes.iter().rposition(|&b| b == b'\n').map_or(0, |i| i + 1) as u64,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => 0,
            Err(e) => return Err(e),
        };
        let len = std::fs::metadata(path).map_or(0, |m| m.len());
        let file = Self::open_whole(path, whole)?;
        Ok((file, len.saturating_sub(whole)))
    }

    /// Opens (creating) `path` whose first `whole` bytes are whole lines, cutting anything
    /// after them.
    pub fn open_whole(path: &Path, whole: u64) -> std::io::Result<LineFile> {
        let file = OpenOptions::new().create(true).append(true).open(path)?;
        if file.metadata()?.len() > whole {
            file.set_len(whole)?;
            file.sync_all()?;
        }
        Ok(LineFile(Appender {
            file,
            len: whole,
            torn: false,
        }))
    }

    /// Appends `line` (ending in a newline) and fsyncs it; see the module doc for a failure.
    pub fn append(&mut self, line: &[u8]) -> std::io::Result<()> {
        self.0.append(line)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A torn last line is cut on open and reported; appends then land on their own lines.
    #[test]
    fn open_cuts_a_torn_tail_and_appends_whole_lines() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("steps.jsonl");
        std::fs::write(&path, b"{\"step\":0}\n{\"step\":1,\"re").unwrap();
        let (mut f, torn) = LineFile::open(&path).unwrap();
        assert_eq!(torn, 13);
        f.append(b"{\"step\":1}\n").unwrap();
        assert_eq!(
            std::fs::read_to_string(&path).unwrap(),
            "{\"step\":0}\n{\"step\":1}\n"
        );
        let (_, torn) = LineFile::open(&path).unwrap();
        assert_eq!(torn, 0);
        let (_, torn) = LineFile::open(&dir.path().join("new.jsonl")).unwrap();
        assert_eq!(torn, 0);
    }
}

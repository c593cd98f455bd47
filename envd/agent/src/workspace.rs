//! The agent's files API over the sandbox workspace (Kubernetes backend), confined to it:
//! the lexical check of [`crate::path::clean_relative`] first, then every open resolves
//! beneath the workspace's directory handle with `openat2(RESOLVE_BENEATH |
//! RESOLVE_NO_MAGICLINKS)` — the primitive cap-std uses for envd's own files API — so a
//! symlink that points out of the workspace (or an absolute one) is refused, not followed.
//! Needs Linux 5.6 or later (openat2); older kernels get a clear error, never a fallback
//! that follows links.

use std::ffi::OsStr;
use std::io::{Read, Write};
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};

use rustix::fs::{AtFlags, FileType, Mode, OFlags, ResolveFlags};
use rustix::io::Errno;

/// A refused or failed files operation: the HTTP status, envd's error `type`, a message.
#[derive(Debug, Clone, PartialEq)]
pub struct FsError {
    pub status: u16,
    pub kind: &'static str,
    pub message: String,
}

impl FsError {
    fn new(status: u16, kind: &'static str, message: String) -> Self {
        FsError {
            status,
            kind,
            message,
        }
    }

    pub fn refused(path: &str, reason: &str) -> Self {
        Self::new(
            403,
            "path_outside_sandbox",
            format!("path '{path}' is refused: {reason}"),
        )
    }

    pub fn bad_request(message: String) -> Self {
        Self::new(400, "invalid_request", message)
    }
}

impl std::fmt::Display for FsError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.message)
    }
}

fn map_errno(path: &Path, what: &str, e: Errno) -> FsError {
    let shown = path.display().to_string();
    match e {
        Errno::XDEV => FsError::refused(
            &shown,
            "it resolves outside the sandbox workspace (a symlink pointing out, or an absolute symlink)",
        ),
        Errno::LOOP => FsError::refused(&shown, "too many levels of symlinks"),
        Errno::NOENT => FsError::new(
            404,
            "file_not_found",
            format!("'{shown}' does not exist in the sandbox workspace"),
        ),
        Errno::ISDIR => FsError::new(
            400,
            "is_a_directory",
            format!("'{shown}' is a directory; list it or name a file"),
        ),
        Errno::NOTDIR => FsError::new(
            400,
            "not_a_directory",
            format!("'{shown}' is not a directory"),
        ),
        Errno::NOSYS => FsError::new(
            500,
            "io_error",
            "this kernel has no openat2 (Linux 5.6+ is needed to confine paths to the workspace)"
                .to_owned(),
        ),
        e => FsError::new(
            500,
            "io_error",
            format!("{what} '{shown}' in the sandbox workspace: {e}"),
        ),
    }
}

/// One entry of a directory listing.
#[derive(Debug, Clone, PartialEq)]
pub struct Entry {
    pub name: String,
    /// `file`, `dir`, `symlink`, `other`
    pub kind: &'static str,
    pub size: u64,
    pub mode: u32,
}

/// The workspace directory handle every operation resolves beneath.
pub struct Workspace {
    root: OwnedFd,
}

const BENEATH: ResolveFlags = ResolveFlags::BENEATH.union(ResolveFlags::NO_MAGICLINKS);

impl Workspace {
    pub fn open(path: &Path) -> std::io::Result<Self> {
        let root = rustix::fs::open(
            path,
            OFlags::RDONLY | OFlags::DIRECTORY | OFlags::CLOEXEC,
            Mode::empty(),
        )?;
        Ok(Workspace { root })
    }

    /// Opens `rel` (resolved beneath the workspace; the empty path is the workspace).
    fn open_beneath(&self, rel: &Path, flags: OFlags, mode: Mode) -> Result<OwnedFd, Errno> {
        let p: &Path = if rel.as_os_str().is_empty() {
            Path::new(".")
        } else {
            rel
        };
        loop {
            match rustix::fs::openat2(self.root.as_fd(), p, flags | OFlags::CLOEXEC, mode, BENEATH)
            {
                // openat2 asks to retry when a rename raced the lookup.
                Err(Errno::AGAIN) => continue,
                r => return r,
            }
        }
    }

    /// The parent directory of `rel` (opened beneath) and its last component.
    fn parent<'a>(&self, rel: &'a Path, raw: &str) -> Result<(OwnedFd, &'a OsStr), FsError> {
        let name = rel.file_name().ok_or_else(|| {
            FsError::bad_request(format!("'{raw}': name a file below the workspace"))
        })?;
        let parent = rel.parent().unwrap_or(Path::new(""));
        let fd = self
            .open_beneath(parent, OFlags::RDONLY | OFlags::DIRECTORY, Mode::empty())
            .map_err(|e| map_errno(parent, "cannot open", e))?;
        Ok((fd, name))
    }

    fn make_parents(&self, rel: &Path) -> Result<(), FsError> {
        let Some(parent) = rel.parent() else {
            return Ok(());
        };
        let mut prefix = PathBuf::new();
        for c in parent.components() {
            let dir = self
                .open_beneath(&prefix, OFlags::RDONLY | OFlags::DIRECTORY, Mode::empty())
                .map_err(|e| map_errno(&prefix, "cannot open", e))?;
            prefix.push(c);
            match rustix::fs::mkdirat(&dir, c.as_os_str(), Mode::from_raw_mode(0o755)) {
                Ok(()) | Err(Errno::EXIST) => {}
                Err(e) => return Err(map_errno(&prefix, "cannot create directory", e)),
            }
        }
        Ok(())
    }

    /// Writes `data` to `rel` (`raw` is the path as the request gave it, for messages):
    /// atomically (temp file + rename) for a new or regular file; through a symlink only
    /// when it resolves inside the workspace.
    pub fn write(&self, raw: &str, data: &[u8], mode: u32) -> Result<u64, FsError> {
        let rel = crate::path::clean_relative(raw).map_err(|r| FsError::refused(raw, r))?;
        if rel.file_name().is_none() {
            return Err(FsError::bad_request(
                "a file path is required, e.g. src/main.py".to_owned(),
            ));
        }
        self.make_parents(&rel)?;
        let (dir, name) = self.parent(&rel, raw)?;
        let mode = Mode::from_raw_mode(mode & 0o7777);
        match rustix::fs::statat(&dir, name, AtFlags::SYMLINK_NOFOLLOW) {
            Ok(st) if FileType::from_raw_mode(st.st_mode) == FileType::Symlink => {
                // Follow it, but only beneath the workspace.
                let fd = self
                    .open_beneath(&rel, OFlags::WRONLY | OFlags::TRUNC, Mode::empty())
                    .map_err(|e| map_errno(&rel, "cannot open", e))?;
                let mut f = std::fs::File::from(fd);
                f.write_all(data)
                    .map_err(|e| io_err(&rel, "cannot write", e))?;
                return Ok(data.len() as u64);
            }
            Ok(st) if FileType::from_raw_mode(st.st_mode) == FileType::Directory => {
                return Err(map_errno(&rel, "cannot write", Errno::ISDIR));
            }
            _ => {}
        }
        let mut tmp = b".".to_vec();
        tmp.extend_from_slice(name.as_bytes());
        tmp.extend_from_slice(format!(".envd-upload-{}", std::process::id()).as_bytes());
        tmp.extend_from_slice(format!("-{}", unique()).as_bytes());
        let tmp = OsStr::from_bytes(&tmp);
        let fd = rustix::fs::openat(
            &dir,
            tmp,
            OFlags::WRONLY | OFlags::CREATE | OFlags::EXCL | OFlags::NOFOLLOW | OFlags::CLOEXEC,
            mode,
        )
        .map_err(|e| map_errno(&rel, "cannot create", e))?;
        let written = (|| {
            let mut f = std::fs::File::from(fd);
            f.write_all(data)
                .map_err(|e| io_err(&rel, "cannot write", e))?;
            rustix::fs::fchmod(&f, mode).map_err(|e| map_errno(&rel, "cannot chmod", e))?;
            rustix::fs::renameat(&dir, tmp, &dir, name)
                .map_err(|e| map_errno(&rel, "cannot move the upload into place at", e))
        })();
        if written.is_err() {
            let _ = rustix::fs::unlinkat(&dir, tmp, AtFlags::empty());
        }
        written?;
        Ok(data.len() as u64)
    }

    /// Reads a regular file, refusing one larger than `limit`.
    pub fn read(&self, raw: &str, limit: u64) -> Result<Vec<u8>, FsError> {
        let rel = crate::path::clean_relative(raw).map_err(|r| FsError::refused(raw, r))?;
        let fd = self
            .open_beneath(&rel, OFlags::RDONLY, Mode::empty())
            .map_err(|e| map_errno(&rel, "cannot open", e))?;
        let st = rustix::fs::fstat(&fd).map_err(|e| map_errno(&rel, "cannot stat", e))?;
        if FileType::from_raw_mode(st.st_mode) == FileType::Directory {
            return Err(map_errno(&rel, "cannot read", Errno::ISDIR));
        }
        let too_large = || {
            FsError::new(
                413,
                "too_large",
                format!(
                    "'{}' is larger than the files API's limit of {limit} bytes; read it in parts with exec (e.g. `split`, `head -c`)",
                    rel.display()
                ),
            )
        };
        if st.st_size as u64 > limit {
            return Err(too_large());
        }
        let mut out = Vec::new();
        std::fs::File::from(fd)
            .take(limit + 1)
            .read_to_end(&mut out)
            .map_err(|e| io_err(&rel, "cannot read", e))?;
        if out.len() as u64 > limit {
            return Err(too_large());
        }
        Ok(out)
    }

    /// Lists a directory (the workspace for the empty path), sorted by name.
    pub fn list(&self, raw: &str) -> Result<Vec<Entry>, FsError> {
        let rel = crate::path::clean_relative(raw).map_err(|r| FsError::refused(raw, r))?;
        let fd = self
            .open_beneath(&rel, OFlags::RDONLY | OFlags::DIRECTORY, Mode::empty())
            .map_err(|e| map_errno(&rel, "cannot list", e))?;
        let dir = rustix::fs::Dir::read_from(&fd).map_err(|e| map_errno(&rel, "cannot list", e))?;
        let mut out = Vec::new();
        for entry in dir {
            let entry = entry.map_err(|e| map_errno(&rel, "cannot list", e))?;
            let name = entry.file_name().to_bytes();
            if name == b"." || name == b".." {
                continue;
            }
            let (kind, size, mode) =
                match rustix::fs::statat(&fd, entry.file_name(), AtFlags::SYMLINK_NOFOLLOW) {
                    Ok(st) => (
                        kind_of(FileType::from_raw_mode(st.st_mode)),
                        st.st_size as u64,
                        st.st_mode & 0o7777,
                    ),
                    Err(_) => (kind_of(entry.file_type()), 0, 0),
                };
            out.push(Entry {
                name: String::from_utf8_lossy(name).into_owned(),
                kind,
                size,
                mode,
            });
        }
        out.sort_by(|a, b| a.name.cmp(&b.name));
        Ok(out)
    }

    /// Removes a file, a symlink (not its target), or with `recursive` a directory tree.
    pub fn remove(&self, raw: &str, recursive: bool) -> Result<(), FsError> {
        let rel = crate::path::clean_relative(raw).map_err(|r| FsError::refused(raw, r))?;
        if rel.as_os_str().is_empty() {
            return Err(FsError::bad_request(
                "the workspace itself cannot be removed; delete the sandbox instead".to_owned(),
            ));
        }
        let (dir, name) = self.parent(&rel, raw)?;
        let st = rustix::fs::statat(&dir, name, AtFlags::SYMLINK_NOFOLLOW)
            .map_err(|e| map_errno(&rel, "cannot stat", e))?;
        if FileType::from_raw_mode(st.st_mode) == FileType::Directory {
            if !recursive {
                return Err(FsError::bad_request(format!(
                    "'{}' is a directory; add ?recursive=true to remove it with everything in it",
                    rel.display()
                )));
            }
            remove_tree(&dir, name).map_err(|e| map_errno(&rel, "cannot remove", e))
        } else {
            rustix::fs::unlinkat(&dir, name, AtFlags::empty())
                .map_err(|e| map_errno(&rel, "cannot remove", e))
        }
    }
}

fn io_err(path: &Path, what: &str, e: std::io::Error) -> FsError {
    match e.raw_os_error() {
        Some(n) => map_errno(path, what, Errno::from_raw_os_error(n)),
        None => FsError::new(500, "io_error", format!("{what} '{}': {e}", path.display())),
    }
}

fn kind_of(t: FileType) -> &'static str {
    match t {
        FileType::Symlink => "symlink",
        FileType::Directory => "dir",
        FileType::RegularFile => "file",
        _ => "other",
    }
}

/// Removes the directory `name` in `parent` with everything below it, never following a
/// symlink (each level is opened with `O_NOFOLLOW` relative to its parent's handle).
fn remove_tree(parent: &OwnedFd, name: &OsStr) -> Result<(), Errno> {
    let fd = rustix::fs::openat(
        parent,
        name,
        OFlags::RDONLY | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC,
        Mode::empty(),
    )?;
    let mut names = Vec::new();
    for entry in rustix::fs::Dir::read_from(&fd)? {
        let entry = entry?;
        let n = entry.file_name().to_bytes();
        if n != b"." && n != b".." {
            names.push(n.to_vec());
        }
    }
    for n in names {
        let n = OsStr::from_bytes(&n);
        let st = rustix::fs::statat(&fd, n, AtFlags::SYMLINK_NOFOLLOW)?;
        if FileType::from_raw_mode(st.st_mode) == FileType::Directory {
            remove_tree(&fd, n)?;
        } else {
            rustix::fs::unlinkat(&fd, n, AtFlags::empty())?;
        }
    }
    rustix::fs::unlinkat(parent, name, AtFlags::REMOVEDIR)
}

/// A number unique within this process (temp file names).
fn unique() -> u64 {
    use std::sync::atomic::{AtomicU64, Ordering};
    static N: AtomicU64 = AtomicU64::new(0);
    let t = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(0);
    t ^ N.fetch_add(1, Ordering::Relaxed).rotate_left(40)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn write_read_list_remove_and_escapes() {
        let t = tempfile::tempdir().unwrap();
        let outside = tempfile::tempdir().unwrap();
        std::fs::write(outside.path().join("secret"), b"host").unwrap();
        let w = Workspace::open(t.path()).unwrap();
        w.write("a/b/c.bin", b"\0\xffdata", 0o600).unwrap();
        assert_eq!(w.read("a/b/c.bin", 100).unwrap(), b"\0\xffdata");
        let l = w.list("a/b").unwrap();
        assert_eq!(l.len(), 1, "no temp file left: {l:?}");
        assert_eq!((l[0].kind, l[0].size, l[0].mode), ("file", 6, 0o600));
        assert_eq!(w.read("a/b/c.bin", 3).unwrap_err().status, 413);
        assert_eq!(w.read("a", 100).unwrap_err().kind, "is_a_directory");
        assert_eq!(w.read("nope", 100).unwrap_err().status, 404);
        for bad in ["../x", "/etc/passwd", "a/../../x"] {
            assert_eq!(w.read(bad, 100).unwrap_err().status, 403, "{bad}");
        }
        std::os::unix::fs::symlink(outside.path().join("secret"), t.path().join("abs")).unwrap();
        std::os::unix::fs::symlink("../../../../../../../../etc/passwd", t.path().join("rel"))
            .unwrap();
        std::os::unix::fs::symlink(outside.path(), t.path().join("dir")).unwrap();
        for p in ["abs", "rel", "dir/secret"] {
            let e = w.read(p, 1 << 20).unwrap_err();
            assert_eq!(e.kind, "path_outside_sandbox", "{p}: {e}");
        }
        assert_eq!(w.write("dir/new", b"x", 0o644).unwrap_err().status, 403);
        assert_eq!(w.write("abs", b"mine", 0o644).unwrap_err().status, 403);
        assert_eq!(
            std::fs::read(outside.path().join("secret")).unwrap(),
            b"host"
        );
        assert!(!outside.path().join("new").exists());
        assert_eq!(w.list("dir").unwrap_err().status, 403);
        // Removing a symlink removes the link, never its target.
        w.remove("dir", true).unwrap();
        assert!(outside.path().join("secret").exists());
        assert_eq!(w.remove("a", false).unwrap_err().status, 400);
        w.remove("a", true).unwrap();
        assert_eq!(w.read("a/b/c.bin", 100).unwrap_err().status, 404);
    }
}

//! The files API over a sandbox's workspace, confined to it.
//!
//! Two layers refuse escapes. First the path itself: it must be relative, without `..`
//! and without NUL (a lexical check with a message that says what to send instead). Then
//! every open goes through `cap-std`, which resolves the path beneath the workspace
//! directory handle (`openat2(RESOLVE_BENEATH)` where the kernel has it, a component walk
//! otherwise): a symlink the sandbox planted that points out of the workspace (or an
//! absolute one) is refused instead of followed, also when it is swapped in between two
//! calls.

use std::io::{Read, Write};
use std::os::unix::fs::PermissionsExt as _;
use std::path::{Path, PathBuf};

use cap_std::fs::{Dir, OpenOptions};

use crate::error::EnvdError;
use crate::model::DirEntry;

/// Owner given to what the files API creates, so the sandbox's processes can change it.
#[derive(Debug, Clone, Copy)]
pub struct Owner {
    pub uid: u32,
    pub gid: u32,
}

/// Checks a path from a request: relative, no `..`, no NUL. `.` and empty components are
/// dropped. The empty path is the workspace itself. (The agent crate holds the check, so
/// the Kubernetes backend's in-sandbox agent applies the same rule.)
pub fn clean_path(raw: &str) -> Result<PathBuf, EnvdError> {
    graft_envd_agent::path::clean_relative(raw).map_err(|reason| EnvdError::PathRefused {
        path: raw.to_owned(),
        reason: reason.to_owned(),
    })
}

fn map_io(path: &Path, what: &str, e: std::io::Error) -> EnvdError {
    let shown = path.display().to_string();
    let escape = e.raw_os_error() == Some(18) // EXDEV from RESOLVE_BENEATH
        || e.to_string().contains("outside of the filesystem");
    if escape {
        return EnvdError::PathRefused {
            path: shown,
            reason: "it resolves outside the sandbox workspace (a symlink pointing out, or an absolute symlink)".to_owned(),
        };
    }
    match e.kind() {
        std::io::ErrorKind::NotFound => EnvdError::FileNotFound(shown),
        std::io::ErrorKind::IsADirectory => EnvdError::IsDirectory(shown),
        std::io::ErrorKind::NotADirectory => EnvdError::NotDirectory(shown),
        _ if e.raw_os_error() == Some(40) => EnvdError::PathRefused {
            path: shown,
            reason: "too many levels of symlinks".to_owned(),
        },
        _ => EnvdError::io(format!("{what} '{shown}' in the sandbox workspace"), e),
    }
}

/// The workspace directory handle every operation resolves beneath.
pub struct Workspace {
    dir: Dir,
    owner: Option<Owner>,
}

impl Workspace {
    pub fn open(path: &Path, owner: Option<Owner>) -> Result<Self, EnvdError> {
        let dir = Dir::open_ambient_dir(path, cap_std::ambient_authority()).map_err(|e| {
            EnvdError::io(format!("cannot open the workspace {}", path.display()), e)
        })?;
        Ok(Workspace { dir, owner })
    }

    fn chown(&self, fd: impl std::os::fd::AsFd, rel: &Path) -> Result<(), EnvdError> {
        if let Some(o) = self.owner {
            std::os::unix::fs::fchown(fd, Some(o.uid), Some(o.gid))
                .map_err(|e| map_io(rel, "cannot set the owner of", e))?;
        }
        Ok(())
    }

    /// Creates the missing parent directories of `rel` (owned by the sandbox's user).
    fn make_parents(&self, rel: &Path) -> Result<(), EnvdError> {
        let Some(parent) = rel.parent() else {
            return Ok(());
        };
        let mut prefix = PathBuf::new();
        for c in parent.components() {
            prefix.push(c);
            match self.dir.create_dir(&prefix) {
                Ok(()) => {
                    // Opened for reading (cap-std's `open_dir` gives an O_PATH handle,
                    // which fchown refuses).
                    let mut o = OpenOptions::new();
                    o.read(true);
                    let d = self
                        .dir
                        .open_with(&prefix, &o)
                        .map_err(|e| map_io(&prefix, "cannot open", e))?;
                    self.chown(&d, &prefix)?;
                }
                Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {
                    let m = self
                        .dir
                        .metadata(&prefix)
                        .map_err(|e| map_io(&prefix, "cannot stat", e))?;
                    if !m.is_dir() {
                        return Err(EnvdError::NotDirectory(prefix.display().to_string()));
                    }
                }
                Err(e) => return Err(map_io(&prefix, "cannot create directory", e)),
            }
        }
        Ok(())
    }

    /// Writes `data` to `rel` atomically (temp file + rename; a symlink at `rel` is
    /// replaced, never followed). Returns the bytes written.
    pub fn write(&self, rel: &Path, data: &[u8], mode: u32) -> Result<u64, EnvdError> {
        if rel.file_name().is_none() {
            return Err(EnvdError::BadRequest(
                "a file path is required after /files/, e.g. /files/src/main.py".to_owned(),
            ));
        };
        self.make_parents(rel)?;
        // A symlink is written through when it stays inside (and refused when it leads
        // out): resolve it beneath the workspace first.
        let resolved;
        let rel = match self.dir.symlink_metadata(rel) {
            Ok(m) if m.is_symlink() => {
                resolved = self
                    .dir
                    .canonicalize(rel)
                    .map_err(|e| map_io(rel, "cannot resolve", e))?;
                resolved.as_path()
            }
            Ok(m) if m.is_dir() => return Err(EnvdError::IsDirectory(rel.display().to_string())),
            _ => rel,
        };
        let Some(name) = rel.file_name() else {
            return Err(EnvdError::IsDirectory(rel.display().to_string()));
        };
        let tmp_name = format!(
            ".{}.envd-upload-{}",
            name.to_string_lossy(),
            uuid::Uuid::new_v4().simple()
        );
        let tmp = rel.with_file_name(tmp_name);
        let mut opts = OpenOptions::new();
        opts.write(true).create_new(true);
        let file = self
            .dir
            .open_with(&tmp, &opts)
            .map_err(|e| map_io(rel, "cannot create", e))?;
        let mut std_file = file.into_std();
        let written = (|| -> Result<(), EnvdError> {
            std_file
                .write_all(data)
                .map_err(|e| map_io(rel, "cannot write", e))?;
            std_file
                .set_permissions(std::fs::Permissions::from_mode(mode & 0o7777))
                .map_err(|e| map_io(rel, "cannot set the mode of", e))?;
            self.chown(&std_file, rel)?;
            self.dir
                .rename(&tmp, &self.dir, rel)
                .map_err(|e| map_io(rel, "cannot move the upload into place at", e))
        })();
        if written.is_err() {
            let _ = self.dir.remove_file(&tmp);
        }
        written?;
        Ok(data.len() as u64)
    }

    /// Reads a regular file, refusing one larger than `limit`.
    pub fn read(&self, rel: &Path, limit: usize) -> Result<Vec<u8>, EnvdError> {
        let file = self
            .dir
            .open(rel)
            .map_err(|e| map_io(rel, "cannot open", e))?;
        let meta = file.metadata().map_err(|e| map_io(rel, "cannot stat", e))?;
        if meta.is_dir() {
            return Err(EnvdError::IsDirectory(rel.display().to_string()));
        }
        if meta.len() > limit as u64 {
            return Err(EnvdError::TooLarge {
                limit,
                hint: "the file is larger than the files API's limit (--max-file-bytes); read it in parts with exec (e.g. `split`, `head -c`)",
            });
        }
        let mut out = Vec::with_capacity(meta.len() as usize);
        file.into_std()
            .take(limit as u64 + 1)
            .read_to_end(&mut out)
            .map_err(|e| map_io(rel, "cannot read", e))?;
        if out.len() > limit {
            return Err(EnvdError::TooLarge {
                limit,
                hint: "the file grew past the files API's limit while it was read",
            });
        }
        Ok(out)
    }

    /// Lists a directory (the workspace for the empty path), sorted by name.
    pub fn list(&self, rel: &Path) -> Result<Vec<DirEntry>, EnvdError> {
        let rd = if rel.as_os_str().is_empty() {
            self.dir.entries()
        } else {
            let m = self
                .dir
                .metadata(rel)
                .map_err(|e| map_io(rel, "cannot stat", e))?;
            if !m.is_dir() {
                return Err(EnvdError::NotDirectory(rel.display().to_string()));
            }
            self.dir.read_dir(rel)
        }
        .map_err(|e| map_io(rel, "cannot list", e))?;
        let mut out = Vec::new();
        for entry in rd {
            let entry = entry.map_err(|e| map_io(rel, "cannot list", e))?;
            let name = entry.file_name().to_string_lossy().into_owned();
            let ft = entry
                .file_type()
                .map_err(|e| map_io(rel, "cannot list", e))?;
            let kind = if ft.is_symlink() {
                "symlink"
            } else if ft.is_dir() {
                "dir"
            } else if ft.is_file() {
                "file"
            } else {
                "other"
            };
            let (size, mode) = match entry.metadata() {
                Ok(m) => (m.len(), cap_std::fs::PermissionsExt::mode(&m.permissions())),
                Err(_) => (0, 0),
            };
            out.push(DirEntry {
                name,
                kind,
                size,
                mode: mode & 0o7777,
            });
        }
        out.sort_by(|a, b| a.name.cmp(&b.name));
        Ok(out)
    }

    /// Removes a file, a symlink (not its target), or with `recursive` a directory tree.
    pub fn remove(&self, rel: &Path, recursive: bool) -> Result<(), EnvdError> {
        if rel.as_os_str().is_empty() {
            return Err(EnvdError::BadRequest(
                "the workspace itself cannot be removed; delete the sandbox instead".to_owned(),
            ));
        }
        let m = self
            .dir
            .symlink_metadata(rel)
            .map_err(|e| map_io(rel, "cannot stat", e))?;
        if m.is_dir() {
            if !recursive {
                return Err(EnvdError::BadRequest(format!(
                    "'{}' is a directory; add ?recursive=true to remove it with everything in it",
                    rel.display()
                )));
            }
            self.dir
                .remove_dir_all(rel)
                .map_err(|e| map_io(rel, "cannot remove", e))
        } else {
            self.dir
                .remove_file(rel)
                .map_err(|e| map_io(rel, "cannot remove", e))
        }
    }

    /// Whether `rel` is a directory inside the workspace (for an exec's `cwd`).
    pub fn is_dir(&self, rel: &Path) -> Result<bool, EnvdError> {
        if rel.as_os_str().is_empty() {
            return Ok(true);
        }
        match self.dir.metadata(rel) {
            Ok(m) => Ok(m.is_dir()),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(false),
            Err(e) => Err(map_io(rel, "cannot stat", e)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ws() -> (tempfile::TempDir, Workspace) {
        let t = tempfile::tempdir().unwrap();
        let w = Workspace::open(t.path(), None).unwrap();
        (t, w)
    }

    #[test]
    fn clean_path_refuses_parent_absolute_and_nul() {
        for bad in ["../x", "a/../../x", "a/..", "/etc/passwd", "a\0b"] {
            let e = clean_path(bad).unwrap_err();
            assert!(matches!(e, EnvdError::PathRefused { .. }), "{bad}: {e}");
        }
        assert_eq!(clean_path("./a//b/").unwrap(), PathBuf::from("a/b"));
        assert_eq!(clean_path("").unwrap(), PathBuf::new());
    }

    #[test]
    fn write_read_list_remove_round_trip() {
        let (_t, w) = ws();
        let data = b"\0binary\xffbytes".to_vec();
        w.write(Path::new("a/b/c.bin"), &data, 0o644).unwrap();
        assert_eq!(w.read(Path::new("a/b/c.bin"), 1024).unwrap(), data);
        let l = w.list(Path::new("a/b")).unwrap();
        assert_eq!(l.len(), 1, "no temp file left behind: {l:?}");
        assert_eq!(l[0].name, "c.bin");
        assert_eq!(l[0].size, data.len() as u64);
        assert!(matches!(
            w.read(Path::new("a"), 1024),
            Err(EnvdError::IsDirectory(_))
        ));
        assert!(matches!(
            w.read(Path::new("a/b/c.bin"), 3),
            Err(EnvdError::TooLarge { .. })
        ));
        w.remove(Path::new("a"), true).unwrap();
        assert!(matches!(
            w.read(Path::new("a/b/c.bin"), 1024),
            Err(EnvdError::FileNotFound(_))
        ));
    }

    #[test]
    fn symlinks_pointing_out_are_refused() {
        let outside = tempfile::tempdir().unwrap();
        std::fs::write(outside.path().join("secret"), b"host secret").unwrap();
        let (t, w) = ws();
        std::os::unix::fs::symlink(outside.path().join("secret"), t.path().join("abs")).unwrap();
        std::os::unix::fs::symlink("../../../../../../../../etc/passwd", t.path().join("rel"))
            .unwrap();
        std::os::unix::fs::symlink(outside.path(), t.path().join("dir")).unwrap();
        for p in ["abs", "rel", "dir/secret"] {
            let e = w.read(Path::new(p), 1 << 20).unwrap_err();
            assert!(matches!(e, EnvdError::PathRefused { .. }), "{p}: {e}");
        }
        let e = w.write(Path::new("dir/new"), b"x", 0o644).unwrap_err();
        assert!(matches!(e, EnvdError::PathRefused { .. }), "{e}");
        assert!(!outside.path().join("new").exists());
        // Writing to a symlink that points out is refused; the target is untouched.
        let e = w.write(Path::new("abs"), b"mine", 0o644).unwrap_err();
        assert!(matches!(e, EnvdError::PathRefused { .. }), "{e}");
        assert_eq!(
            std::fs::read(outside.path().join("secret")).unwrap(),
            b"host secret"
        );
        // A symlink that stays inside is followed.
        std::fs::create_dir(t.path().join("real")).unwrap();
        std::fs::write(t.path().join("real/f"), b"in").unwrap();
        std::os::unix::fs::symlink("real", t.path().join("inside")).unwrap();
        assert_eq!(w.read(Path::new("inside/f"), 10).unwrap(), b"in");
        // ... also for writing: through the link, to its target inside.
        std::os::unix::fs::symlink("real/f", t.path().join("link_f")).unwrap();
        w.write(Path::new("link_f"), b"through", 0o644).unwrap();
        assert_eq!(std::fs::read(t.path().join("real/f")).unwrap(), b"through");
        assert!(
            std::fs::symlink_metadata(t.path().join("link_f"))
                .unwrap()
                .is_symlink()
        );
    }
}

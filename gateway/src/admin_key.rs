//! The admin key of a gateway that was given none: generated once, kept in the data dir.
//!
//! Without `auth.admin_key` the gateway still closes its admin surface (`/graft/*`, `/ui`):
//! at its first start it writes a random key to `<data_dir>/admin.key` (mode 0600, created
//! whole or not at all) and from then on reads it back, so the key survives restarts. A
//! request without that key (or with a session's key) is then no admin, on loopback too:
//! a harness that drops its session key reaches nothing beyond the default session. graft's
//! own tools on the same machine (`graft demo`, scripts, the tests) read the key from the
//! file; a user sends it as `Authorization: Bearer $(cat <data_dir>/admin.key)`.

use std::io::Write;
use std::path::{Path, PathBuf};

use rand::Rng;

/// The file's name inside the data dir.
pub const FILE: &str = "admin.key";

#[derive(Debug, thiserror::Error)]
pub enum AdminKeyError {
    #[error(
        "cannot {what} the gateway's admin key file {path}: {source}; set auth.admin_key in graft.toml to give the gateway its key instead"
    )]
    Io {
        what: &'static str,
        path: String,
        source: std::io::Error,
    },
    #[error(
        "the gateway's admin key file {path} holds no key; delete it (a new key is generated at the next start) or set auth.admin_key"
    )]
    Empty { path: String },
}

/// `<data_dir>/admin.key`.
pub fn path(data_dir: &Path) -> PathBuf {
    data_dir.join(FILE)
}

/// The key in `<data_dir>/admin.key`, if the file is there (what a local tool sends when it
/// was given no key). `Ok(None)`: no file (the gateway never started there without a key).
pub fn read(data_dir: &Path) -> Result<Option<String>, AdminKeyError> {
    let p = path(data_dir);
    match std::fs::read_to_string(&p) {
        Ok(s) => {
            let key = s.trim();
            if key.is_empty() {
                return Err(AdminKeyError::Empty {
                    path: p.display().to_string(),
                });
            }
            Ok(Some(key.to_string()))
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(source) => Err(AdminKeyError::Io {
            what: "read",
            path: p.display().to_string(),
            source,
        }),
    }
}

/// The key in `<data_dir>/admin.key`, written first if there is none: 32 random bytes as
/// hex, in a file only its owner may read, published under its name only once it is whole
/// and on disk (a crash leaves either no file or the whole key; two starts racing end with
/// one key).
pub fn load_or_create(data_dir: &Path) -> Result<String, AdminKeyError> {
    if let Some(k) = read(data_dir)? {
        return Ok(k);
    }
    let p = path(data_dir);
    let io = |what: &'static str| {
        let path = p.display().to_string();
        move |source| AdminKeyError::Io { what, path, source }
    };
    std::fs::create_dir_all(data_dir).map_err(io("create the folder of"))?;
    let bytes: [u8; 32] = rand::rng().random();
    let key = format!(
        "gk-admin-{}",
        bytes.iter().map(|b| format!("{b:02x}")).collect::<String>()
    );
    let tmp = data_dir.join(format!(".{FILE}.{}.tmp", std::process::id()));
    let written = (|| -> std::io::Result<()> {
        let mut o = std::fs::OpenOptions::new();
        o.write(true).create_new(true);
        #[cfg(unix)]
        std::os::unix::fs::OpenOptionsExt::mode(&mut o, 0o600);
        let mut f = o.open(&tmp)?;
        f.write_all(key.as_bytes())?;
        f.write_all(b"\n")?;
        f.sync_all()
    })();
    if let Err(e) = written {
        let _ = std::fs::remove_file(&tmp);
        return Err(io("write")(e));
    }
    // A hard link publishes the whole file and never replaces one that appeared meanwhile.
    let linked = std::fs::hard_link(&tmp, &p);
    let _ = std::fs::remove_file(&tmp);
    match linked {
        Ok(()) => {
            if let Ok(d) = std::fs::File::open(data_dir) {
                let _ = d.sync_all();
            }
            Ok(key)
        }
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {
            read(data_dir)?.ok_or_else(|| AdminKeyError::Empty {
                path: p.display().to_string(),
            })
        }
        Err(e) => Err(io("write")(e)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_key_is_made_once_kept_private_and_read_back() {
        let dir = tempfile::tempdir().unwrap();
        let data = dir.path().join("data");
        assert!(read(&data).unwrap().is_none());
        let k = load_or_create(&data).unwrap();
        assert!(k.starts_with("gk-admin-") && k.len() == 9 + 64, "{k}");
        assert_eq!(load_or_create(&data).unwrap(), k, "reused across starts");
        assert_eq!(read(&data).unwrap().as_deref(), Some(k.as_str()));
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt;
            let mode = std::fs::metadata(path(&data)).unwrap().permissions().mode();
            assert_eq!(mode & 0o777, 0o600, "{mode:o}");
        }
        // No temp file is left beside it.
        let names: Vec<_> = std::fs::read_dir(&data)
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(names, vec![std::ffi::OsString::from(FILE)]);
        // Another data dir gets another key.
        assert_ne!(load_or_create(&dir.path().join("other")).unwrap(), k);
    }

    #[test]
    fn an_empty_key_file_is_a_named_error_not_an_empty_key() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(path(dir.path()), " \n").unwrap();
        let e = load_or_create(dir.path()).unwrap_err().to_string();
        assert!(e.contains("admin.key") && e.contains("holds no key"), "{e}");
    }
}

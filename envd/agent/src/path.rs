//! The lexical half of path confinement, shared by envd's files API (local backend) and
//! the agent's (Kubernetes backend): a path from a request must be relative, without `..`
//! and without NUL. The other half, resolving it beneath the workspace so that a symlink
//! pointing out is refused, is done by each side's open (`openat2(RESOLVE_BENEATH)`).

use std::path::{Component, Path, PathBuf};

/// Checks a path from a request: relative, no `..`, no NUL. `.` and empty components are
/// dropped; the empty path is the workspace itself. The error says why it was refused.
pub fn clean_relative(raw: &str) -> Result<PathBuf, &'static str> {
    if raw.contains('\0') {
        return Err("it contains a NUL byte");
    }
    if raw.starts_with('/') {
        return Err(
            "absolute paths are not accepted; paths are relative to the sandbox workspace (/workspace), e.g. 'src/main.py'",
        );
    }
    let mut out = PathBuf::new();
    for c in Path::new(raw).components() {
        match c {
            Component::Normal(p) => out.push(p),
            Component::CurDir => {}
            Component::ParentDir => {
                return Err("'..' is not accepted; name the file by its path below the workspace");
            }
            Component::RootDir | Component::Prefix(_) => {
                return Err("absolute paths are not accepted");
            }
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn refuses_parent_absolute_and_nul() {
        for bad in ["../x", "a/../../x", "a/..", "/etc/passwd", "a\0b"] {
            assert!(clean_relative(bad).is_err(), "{bad}");
        }
        assert_eq!(clean_relative("./a//b/").unwrap(), PathBuf::from("a/b"));
        assert_eq!(clean_relative("").unwrap(), PathBuf::new());
    }
}

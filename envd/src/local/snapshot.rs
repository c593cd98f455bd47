//! Snapshots of a local sandbox's workspace, and forks that branch from one.
//!
//! A snapshot is a copy of the workspace under `<data>/snapshots/<id>/tree` (file data
//! reflinked where the filesystem can, copied otherwise), read through cap-std so a symlink
//! the sandbox planted never makes envd copy a host file. A fork's workspace is an overlay
//! mount (lower: the snapshot, upper: the fork's own directory): creating k forks copies
//! nothing, and each fork's writes stay its own (copy-on-write per file).

use std::io::Read;
use std::os::unix::fs::PermissionsExt as _;
use std::path::{Path, PathBuf};

use cap_std::fs::Dir;

use crate::error::EnvdError;

/// Totals of a copied tree.
#[derive(Debug, Clone, Copy, Default)]
pub struct Copied {
    pub files: u64,
    pub bytes: u64,
}

fn io(what: String) -> impl FnOnce(std::io::Error) -> EnvdError {
    move |e| EnvdError::io(what, e)
}

fn finish(path: &Path, mode: u32, owner: Option<(u32, u32)>) -> Result<(), EnvdError> {
    if let Some((u, g)) = owner {
        std::os::unix::fs::lchown(path, Some(u), Some(g))
            .map_err(io(format!("cannot chown {}", path.display())))?;
    }
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode & 0o7777))
        .map_err(io(format!("cannot chmod {}", path.display())))
}

/// Copies the directory `src` (a handle: nothing below it can lead out) into the new
/// directory `dst`. Symlinks are copied as links; fifos, sockets and devices are skipped.
pub fn copy_tree(src: &Dir, dst: &Path, owner: Option<(u32, u32)>) -> Result<Copied, EnvdError> {
    let mut total = Copied::default();
    copy_dir(src, dst, owner, &mut total)?;
    Ok(total)
}

fn copy_dir(
    src: &Dir,
    dst: &Path,
    owner: Option<(u32, u32)>,
    total: &mut Copied,
) -> Result<(), EnvdError> {
    std::fs::create_dir(dst).map_err(io(format!("cannot create {}", dst.display())))?;
    let entries = src.entries().map_err(io(format!(
        "cannot list the workspace for {}",
        dst.display()
    )))?;
    for entry in entries {
        let entry = entry.map_err(io("cannot list the workspace".to_owned()))?;
        let name = entry.file_name();
        let to = dst.join(&name);
        let ft = entry
            .file_type()
            .map_err(io(format!("cannot stat {}", to.display())))?;
        if ft.is_symlink() {
            let target = src
                .read_link_contents(&name)
                .map_err(io(format!("cannot read the link {}", to.display())))?;
            std::os::unix::fs::symlink(&target, &to)
                .map_err(io(format!("cannot create the link {}", to.display())))?;
            if let Some((u, g)) = owner {
                let _ = std::os::unix::fs::lchown(&to, Some(u), Some(g));
            }
        } else if ft.is_dir() {
            let sub = entry
                .open_dir()
                .map_err(io(format!("cannot open {}", to.display())))?;
            copy_dir(&sub, &to, owner, total)?;
        } else if ft.is_file() {
            let mut from = entry
                .open()
                .map_err(io(format!("cannot open {}", to.display())))?
                .into_std();
            let mode = from
                .metadata()
                .map(|m| m.permissions().mode())
                .unwrap_or(0o644);
            let mut out = std::fs::OpenOptions::new()
                .write(true)
                .create_new(true)
                .open(&to)
                .map_err(io(format!("cannot create {}", to.display())))?;
            let bytes = if rustix::fs::ioctl_ficlone(&out, &from).is_ok() {
                out.metadata().map(|m| m.len()).unwrap_or(0)
            } else {
                let mut r = (&mut from).take(u64::MAX);
                std::io::copy(&mut r, &mut out)
                    .map_err(io(format!("cannot copy into {}", to.display())))?
            };
            finish(&to, mode, owner)?;
            total.files += 1;
            total.bytes += bytes;
        }
    }
    let mode = src
        .dir_metadata()
        .map(|m| cap_std::fs::PermissionsExt::mode(&m.permissions()))
        .unwrap_or(0o755);
    finish(dst, mode, owner)
}

/// Mounts `lower` (read-only) + `upper` (the fork's writes) as an overlay on `target`.
pub fn mount_overlay(
    lower: &Path,
    upper: &Path,
    work: &Path,
    target: &Path,
) -> Result<(), EnvdError> {
    for p in [lower, upper, work] {
        let s = p.to_string_lossy();
        if s.contains(',') || s.contains(':') || s.contains('\\') {
            return Err(EnvdError::Backend(format!(
                "cannot mount an overlay with {s}: overlay options cannot hold ',', ':' or '\\'; choose a --data-dir without them"
            )));
        }
    }
    let data = format!(
        "lowerdir={},upperdir={},workdir={}",
        lower.display(),
        upper.display(),
        work.display()
    );
    let data = std::ffi::CString::new(data)
        .map_err(|_| EnvdError::Backend("overlay options contain a NUL byte".to_owned()))?;
    rustix::mount::mount(
        "overlay",
        target,
        "overlay",
        rustix::mount::MountFlags::NOSUID | rustix::mount::MountFlags::NODEV,
        data.as_c_str(),
    )
    .map_err(|e| {
        EnvdError::Backend(format!(
            "cannot mount the fork's overlay on {}: {e} (envd needs root and overlayfs)",
            target.display()
        ))
    })
}

/// Unmounts `target` if something is mounted there.
pub fn unmount(target: &Path) {
    let _ = rustix::mount::unmount(target, rustix::mount::UnmountFlags::DETACH);
}

/// Mount points below `dir` (from /proc/self/mountinfo), deepest first.
pub fn mounts_below(dir: &Path) -> Vec<PathBuf> {
    let info = std::fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
    let mut out: Vec<PathBuf> = info
        .lines()
        .filter_map(|l| l.split(' ').nth(4))
        .map(|p| PathBuf::from(p.replace("\\040", " ")))
        .filter(|p| p.starts_with(dir) && p != dir)
        .collect();
    out.sort_by_key(|p| std::cmp::Reverse(p.components().count()));
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn copy_tree_keeps_links_modes_and_never_follows_out() {
        let outside = tempfile::tempdir().unwrap();
        std::fs::write(outside.path().join("secret"), b"host").unwrap();
        let src = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(src.path().join("a/b")).unwrap();
        std::fs::write(src.path().join("a/b/f"), b"data").unwrap();
        std::fs::set_permissions(
            src.path().join("a/b/f"),
            std::fs::Permissions::from_mode(0o751),
        )
        .unwrap();
        std::os::unix::fs::symlink(outside.path(), src.path().join("out")).unwrap();
        std::os::unix::fs::symlink("a/b/f", src.path().join("in")).unwrap();
        let dst_parent = tempfile::tempdir().unwrap();
        let dst = dst_parent.path().join("tree");
        let dir = Dir::open_ambient_dir(src.path(), cap_std::ambient_authority()).unwrap();
        let c = copy_tree(&dir, &dst, None).unwrap();
        assert_eq!((c.files, c.bytes), (1, 4));
        assert_eq!(std::fs::read(dst.join("a/b/f")).unwrap(), b"data");
        assert_eq!(
            std::fs::metadata(dst.join("a/b/f"))
                .unwrap()
                .permissions()
                .mode()
                & 0o777,
            0o751
        );
        // Links are copied as links, never followed (the host file is not copied).
        assert_eq!(std::fs::read_link(dst.join("out")).unwrap(), outside.path());
        assert!(!dst.join("secret").exists());
        assert_eq!(
            std::fs::read_link(dst.join("in")).unwrap(),
            Path::new("a/b/f")
        );
    }
}

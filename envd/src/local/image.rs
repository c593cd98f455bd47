//! Container images as a local sandbox's root: a `docker save` tarball (or the directory
//! it unpacks to, including Docker's OCI-layout flavour: both carry `manifest.json`) is
//! flattened once into `<data>/images/<hash of its manifest>/rootfs` and reused.
//!
//! Layers are applied in order with OCI whiteouts (`.wh.NAME` removes NAME from the lower
//! layers, `.wh..wh..opq` empties its directory of them). Unpacking never leaves the target
//! (the tar crate checks every entry's parent, and whiteouts are checked the same way);
//! device nodes and fifos are skipped and setuid/setgid bits dropped, so an image cannot
//! smuggle either into a sandbox.

use std::io::{BufReader, Read};
use std::path::{Path, PathBuf};

use sha2::{Digest, Sha256};

use crate::error::EnvdError;
use crate::files::clean_path;

fn bad(image: &Path, m: impl std::fmt::Display) -> EnvdError {
    EnvdError::BadRequest(format!("image {}: {m}", image.display()))
}

fn io(what: String) -> impl FnOnce(std::io::Error) -> EnvdError {
    move |e| EnvdError::io(what, e)
}

/// A layer stream, gunzipped when it starts with the gzip magic.
fn open_layer(path: &Path) -> Result<Box<dyn Read>, EnvdError> {
    let mut f = BufReader::new(
        std::fs::File::open(path).map_err(io(format!("cannot open {}", path.display())))?,
    );
    let mut magic = [0u8; 2];
    let n = {
        use std::io::BufRead;
        let buf = f
            .fill_buf()
            .map_err(io(format!("cannot read {}", path.display())))?;
        let n = buf.len().min(2);
        magic[..n].copy_from_slice(&buf[..n]);
        n
    };
    if n == 2 && magic == [0x1f, 0x8b] {
        Ok(Box::new(flate2::read::GzDecoder::new(f)))
    } else {
        Ok(Box::new(f))
    }
}

/// `inside` resolved must stay below `root` (both canonical).
fn inside(root: &Path, p: &Path) -> bool {
    p.canonicalize().is_ok_and(|c| c.starts_with(root))
}

/// Applies the whiteouts of one layer to `root` (the lower layers so far).
fn apply_whiteouts(layer: &Path, root: &Path) -> Result<(), EnvdError> {
    let mut ar = tar::Archive::new(open_layer(layer)?);
    let entries = ar
        .entries()
        .map_err(io(format!("cannot read the layer {}", layer.display())))?;
    for e in entries {
        let e = e.map_err(io(format!("cannot read the layer {}", layer.display())))?;
        let path = e
            .path()
            .map_err(io(format!("a bad path in {}", layer.display())))?
            .into_owned();
        let Some(name) = path.file_name().and_then(|n| n.to_str()) else {
            continue;
        };
        let Some(hidden) = name.strip_prefix(".wh.") else {
            continue;
        };
        let Ok(rel) = clean_path(&path.to_string_lossy()) else {
            continue;
        };
        let parent = root.join(rel.parent().unwrap_or(Path::new("")));
        if !parent.exists() || !inside(root, &parent) {
            continue;
        }
        if hidden == ".wh..opq" {
            for child in std::fs::read_dir(&parent)
                .map_err(io(format!("cannot list {}", parent.display())))?
                .flatten()
            {
                remove(&child.path())?;
            }
        } else {
            let target = parent.join(hidden);
            if target.symlink_metadata().is_ok() {
                remove(&target)?;
            }
        }
    }
    Ok(())
}

fn remove(p: &Path) -> Result<(), EnvdError> {
    let m = p
        .symlink_metadata()
        .map_err(io(format!("cannot stat {}", p.display())))?;
    if m.is_dir() {
        std::fs::remove_dir_all(p)
    } else {
        std::fs::remove_file(p)
    }
    .map_err(io(format!("cannot remove {}", p.display())))
}

/// Unpacks one layer's files (not its whiteouts) into `root`.
fn unpack_layer(layer: &Path, root: &Path) -> Result<(), EnvdError> {
    let mut ar = tar::Archive::new(open_layer(layer)?);
    ar.set_preserve_permissions(true);
    ar.set_overwrite(true);
    let entries = ar
        .entries()
        .map_err(io(format!("cannot read the layer {}", layer.display())))?;
    for e in entries {
        let mut e = e.map_err(io(format!("cannot read the layer {}", layer.display())))?;
        let kind = e.header().entry_type();
        if matches!(
            kind,
            tar::EntryType::Char | tar::EntryType::Block | tar::EntryType::Fifo
        ) {
            continue;
        }
        let is_whiteout = e
            .path()
            .ok()
            .and_then(|p| {
                p.file_name()
                    .map(|n| n.to_string_lossy().starts_with(".wh."))
            })
            .unwrap_or(false);
        if is_whiteout {
            continue;
        }
        e.set_mask(0o6000);
        let shown = e
            .path()
            .map(|p| p.display().to_string())
            .unwrap_or_default();
        e.unpack_in(root).map_err(|err| {
            bad(
                layer,
                format!(
                    "cannot unpack '{shown}' from layer {}: {err}",
                    layer.display()
                ),
            )
        })?;
    }
    Ok(())
}

#[derive(serde::Deserialize)]
#[serde(rename_all = "PascalCase")]
struct ManifestEntry {
    layers: Vec<String>,
}

/// The flattened root filesystem of `image` (a `docker save` tarball or its unpacked
/// directory), made under `cache` on first use.
pub fn rootfs(image: &Path, cache: &Path) -> Result<PathBuf, EnvdError> {
    if !image.is_absolute() || !image.exists() {
        return Err(bad(
            image,
            "give an absolute path on the envd host to a `docker save` tarball or its unpacked directory (the local backend pulls nothing)",
        ));
    }
    std::fs::create_dir_all(cache).map_err(io(format!("cannot create {}", cache.display())))?;
    let work = cache.join(format!(".unpack-{}", uuid::Uuid::new_v4().simple()));
    std::fs::create_dir(&work).map_err(io(format!("cannot create {}", work.display())))?;
    let r = (|| {
        let dir = if image.is_dir() {
            image.to_path_buf()
        } else {
            let d = work.join("image");
            std::fs::create_dir(&d).map_err(io(format!("cannot create {}", d.display())))?;
            let f = std::fs::File::open(image)
                .map_err(io(format!("cannot open {}", image.display())))?;
            let mut ar = tar::Archive::new(BufReader::new(f));
            ar.unpack(&d)
                .map_err(|e| bad(image, format!("is not a readable tar archive: {e}")))?;
            d
        };
        let manifest_bytes = std::fs::read(dir.join("manifest.json")).map_err(|e| {
            bad(
                image,
                format!("has no readable manifest.json ({e}); save it with `docker save IMAGE -o FILE.tar`"),
            )
        })?;
        let manifest: Vec<ManifestEntry> =
            serde_json::from_slice(&manifest_bytes).map_err(|e| {
                bad(
                    image,
                    format!("manifest.json is not a docker save manifest: {e}"),
                )
            })?;
        let [entry] = manifest.as_slice() else {
            return Err(bad(
                image,
                format!(
                    "manifest.json lists {} images; save exactly one",
                    manifest.len()
                ),
            ));
        };
        let key: String = Sha256::digest(&manifest_bytes)
            .iter()
            .take(12)
            .map(|b| format!("{b:02x}"))
            .collect();
        let done = cache.join(&key);
        if done.join("rootfs").is_dir() {
            return Ok(done.join("rootfs"));
        }
        let root = work.join("rootfs");
        std::fs::create_dir(&root).map_err(io(format!("cannot create {}", root.display())))?;
        let canon_root = root
            .canonicalize()
            .map_err(io(format!("cannot resolve {}", root.display())))?;
        for layer in &entry.layers {
            let rel = clean_path(layer)
                .map_err(|_| bad(image, format!("layer path '{layer}' leaves the image")))?;
            let path = dir.join(rel);
            apply_whiteouts(&path, &canon_root)?;
            unpack_layer(&path, &canon_root)?;
        }
        let staged = work.join("done");
        std::fs::create_dir(&staged).map_err(io(format!("cannot create {}", staged.display())))?;
        std::fs::rename(&root, staged.join("rootfs"))
            .map_err(io(format!("cannot move {}", root.display())))?;
        // Another create may have flattened the same image meanwhile: either copy is fine.
        match std::fs::rename(&staged, &done) {
            Ok(()) => {}
            Err(_) if done.join("rootfs").is_dir() => {}
            Err(e) => {
                return Err(EnvdError::io(
                    format!("cannot move into {}", done.display()),
                    e,
                ));
            }
        }
        Ok(done.join("rootfs"))
    })();
    let _ = std::fs::remove_dir_all(&work);
    r
}

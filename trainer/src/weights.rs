//! HF safetensors in and out: a model directory's weights (one `model.safetensors`, or
//! shards listed by `model.safetensors.index.json`), and writing a directory that HF
//! transformers and SGLang load (HF names, `config.json`, `{"format": "pt"}` metadata,
//! sharded with an index past a size).

use std::borrow::Cow;
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::path::{Path, PathBuf};

use safetensors::tensor::{Dtype, SafeTensors, View};
use tch::{Kind, Tensor};

use crate::error::{Result, TrainerError};

const INDEX: &str = "model.safetensors.index.json";
const SINGLE: &str = "model.safetensors";

fn bad(path: &Path, problem: impl Into<String>) -> TrainerError {
    TrainerError::Weights {
        path: path.to_path_buf(),
        problem: problem.into(),
    }
}

fn kind_of(dtype: Dtype, path: &Path, name: &str) -> Result<Kind> {
    Ok(match dtype {
        Dtype::F32 => Kind::Float,
        Dtype::F16 => Kind::Half,
        Dtype::BF16 => Kind::BFloat16,
        Dtype::F64 => Kind::Double,
        Dtype::I64 => Kind::Int64,
        Dtype::I32 => Kind::Int,
        Dtype::I16 => Kind::Int16,
        Dtype::I8 => Kind::Int8,
        Dtype::U8 => Kind::Uint8,
        Dtype::BOOL => Kind::Bool,
        other => {
            return Err(bad(
                path,
                format!("tensor '{name}' has dtype {other:?}, which graft does not read"),
            ));
        }
    })
}

fn dtype_of(kind: Kind) -> Result<Dtype> {
    Ok(match kind {
        Kind::Float => Dtype::F32,
        Kind::Half => Dtype::F16,
        Kind::BFloat16 => Dtype::BF16,
        Kind::Double => Dtype::F64,
        Kind::Int64 => Dtype::I64,
        Kind::Int => Dtype::I32,
        Kind::Int16 => Dtype::I16,
        Kind::Int8 => Dtype::I8,
        Kind::Uint8 => Dtype::U8,
        Kind::Bool => Dtype::BOOL,
        other => {
            return Err(TrainerError::invalid(format!(
                "cannot write a {other:?} tensor to safetensors"
            )));
        }
    })
}

/// Every tensor of one safetensors file, on the CPU, in its stored dtype.
pub fn read_file(path: &Path) -> Result<BTreeMap<String, Tensor>> {
    let bytes = std::fs::read(path).map_err(|e| TrainerError::io("reading", path, e))?;
    let st = SafeTensors::deserialize(&bytes)
        .map_err(|e| bad(path, format!("not a safetensors file: {e}")))?;
    let mut out = BTreeMap::new();
    for (name, view) in st.tensors() {
        let kind = kind_of(view.dtype(), path, &name)?;
        let shape: Vec<i64> = view.shape().iter().map(|&d| d as i64).collect();
        let t = Tensor::f_from_data_size(view.data(), &shape, kind)?;
        out.insert(name, t);
    }
    Ok(out)
}

/// Every tensor of an HF model directory: the shards `model.safetensors.index.json`
/// lists, else `model.safetensors`.
pub fn read_dir(dir: &Path) -> Result<BTreeMap<String, Tensor>> {
    let index = dir.join(INDEX);
    let files: Vec<PathBuf> = if index.exists() {
        let text =
            std::fs::read_to_string(&index).map_err(|e| TrainerError::io("reading", &index, e))?;
        let v: serde_json::Value =
            serde_json::from_str(&text).map_err(|e| bad(&index, format!("not valid JSON: {e}")))?;
        let map = v
            .get("weight_map")
            .and_then(|m| m.as_object())
            .ok_or_else(|| bad(&index, "has no weight_map object"))?;
        let names: BTreeSet<&str> = map.values().filter_map(|f| f.as_str()).collect();
        names.into_iter().map(|f| dir.join(f)).collect()
    } else if dir.join(SINGLE).exists() {
        vec![dir.join(SINGLE)]
    } else {
        return Err(bad(
            dir,
            format!(
                "holds neither {SINGLE} nor {INDEX}; point --model at an HF model directory with safetensors weights"
            ),
        ));
    };
    let mut out = BTreeMap::new();
    for f in files {
        for (name, t) in read_file(&f)? {
            if out.insert(name.clone(), t).is_some() {
                return Err(bad(
                    &f,
                    format!("tensor '{name}' appears in more than one shard"),
                ));
            }
        }
    }
    Ok(out)
}

/// A tensor's bytes, ready for safetensors.
struct Bytes {
    dtype: Dtype,
    shape: Vec<usize>,
    data: Vec<u8>,
}

impl View for &Bytes {
    fn dtype(&self) -> Dtype {
        self.dtype
    }
    fn shape(&self) -> &[usize] {
        &self.shape
    }
    fn data(&self) -> Cow<'_, [u8]> {
        Cow::Borrowed(&self.data)
    }
    fn data_len(&self) -> usize {
        self.data.len()
    }
}

fn to_bytes(t: &Tensor, kind: Option<Kind>) -> Result<Bytes> {
    let t = t.f_detach()?.f_to_device(tch::Device::Cpu)?;
    let t = match kind {
        Some(k)
            if matches!(
                t.kind(),
                Kind::Float | Kind::Half | Kind::BFloat16 | Kind::Double
            ) =>
        {
            t.f_to_kind(k)?
        }
        _ => t,
    }
    .f_contiguous()?;
    let numel = t.numel();
    let mut data = vec![0u8; numel * t.kind().elt_size_in_bytes()];
    t.f_copy_data_u8(&mut data, numel)?;
    Ok(Bytes {
        dtype: dtype_of(t.kind())?,
        shape: t.size().iter().map(|&d| d as usize).collect(),
        data,
    })
}

fn metadata() -> Option<HashMap<String, String>> {
    Some(HashMap::from([("format".to_owned(), "pt".to_owned())]))
}

/// Writes named tensors to one safetensors file (floating tensors cast to `kind` when
/// given), with `{"format": "pt"}` metadata, atomically (tmp + rename).
pub fn write_file(tensors: &[(String, Tensor)], kind: Option<Kind>, path: &Path) -> Result<()> {
    let bytes: Vec<(String, Bytes)> = tensors
        .iter()
        .map(|(n, t)| Ok((n.clone(), to_bytes(t, kind)?)))
        .collect::<Result<_>>()?;
    let tmp = path.with_extension("safetensors.tmp");
    safetensors::tensor::serialize_to_file(
        bytes.iter().map(|(n, b)| (n.as_str(), b)),
        metadata(),
        &tmp,
    )
    .map_err(|e| bad(path, format!("cannot write: {e}")))?;
    // Readable by the inference server, which may run as another user.
    {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&tmp, std::fs::Permissions::from_mode(0o644))
            .map_err(|e| TrainerError::io("setting permissions of", &tmp, e))?;
    }
    std::fs::rename(&tmp, path).map_err(|e| TrainerError::io("renaming into", path, e))
}

/// Writes an HF model directory: `config.json` (with `torch_dtype`/`dtype` set to what is
/// written) and the weights, in one file or, past `shard_bytes`, in shards with
/// `model.safetensors.index.json`.
pub fn write_dir(
    dir: &Path,
    config: &serde_json::Value,
    tensors: &[(String, Tensor)],
    kind: Kind,
    shard_bytes: usize,
) -> Result<()> {
    std::fs::create_dir_all(dir).map_err(|e| TrainerError::io("creating", dir, e))?;
    let dtype_name = match kind {
        Kind::BFloat16 => "bfloat16",
        Kind::Half => "float16",
        _ => "float32",
    };
    let mut config = config.clone();
    if let Some(obj) = config.as_object_mut() {
        let key = if obj.contains_key("torch_dtype") {
            "torch_dtype"
        } else {
            "dtype"
        };
        obj.insert(key.to_owned(), serde_json::Value::from(dtype_name));
    }
    let text =
        serde_json::to_string_pretty(&config).map_err(|e| TrainerError::invalid(e.to_string()))?;
    let cfg = dir.join("config.json");
    std::fs::write(&cfg, text + "\n").map_err(|e| TrainerError::io("writing", &cfg, e))?;

    let elt = kind.elt_size_in_bytes();
    let mut shards: Vec<Vec<(String, Tensor)>> = vec![Vec::new()];
    let mut size = 0usize;
    let mut total = 0usize;
    for (n, t) in tensors {
        let bytes = t.numel() * elt;
        if size > 0 && size + bytes > shard_bytes {
            shards.push(Vec::new());
            size = 0;
        }
        size += bytes;
        total += bytes;
        if let Some(last) = shards.last_mut() {
            last.push((n.clone(), t.shallow_clone()));
        }
    }
    // Drop what an earlier push left (other shard counts), so the directory is exactly this.
    if let Ok(entries) = std::fs::read_dir(dir) {
        for e in entries.flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            if name.ends_with(".safetensors") || name == INDEX {
                let _ = std::fs::remove_file(e.path());
            }
        }
    }
    if shards.len() == 1 {
        return write_file(&shards[0], Some(kind), &dir.join(SINGLE));
    }
    let n = shards.len();
    let mut weight_map = serde_json::Map::new();
    for (i, shard) in shards.iter().enumerate() {
        let file = format!("model-{:05}-of-{:05}.safetensors", i + 1, n);
        write_file(shard, Some(kind), &dir.join(&file))?;
        for (name, _) in shard {
            weight_map.insert(name.clone(), serde_json::Value::from(file.clone()));
        }
    }
    let index =
        serde_json::json!({ "metadata": { "total_size": total }, "weight_map": weight_map });
    let path = dir.join(INDEX);
    let text =
        serde_json::to_string_pretty(&index).map_err(|e| TrainerError::invalid(e.to_string()))?;
    std::fs::write(&path, text + "\n").map_err(|e| TrainerError::io("writing", &path, e))
}

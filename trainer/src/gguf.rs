//! GGUF (llama.cpp's model file, version 2 and 3) to an HF model directory, for Llama
//! checkpoints such as SmolLM2: metadata, tensors dequantized from F32 / F16 / BF16 / Q4_0
//! / Q4_1 / Q8_0 to f32, llama.cpp's names mapped back to HF's, and the q/k rows that
//! llama.cpp's converter permutes for its RoPE layout put back in HF's rotate-half order.
//! For GPT-2-style BPE vocabularies (`tokenizer.ggml.model = "gpt2"`, e.g. SmolLM2) it
//! also writes `tokenizer.json` (byte-level BPE from the GGUF's tokens and merges, the
//! pre-tokenizer llama.cpp's `tokenizer.ggml.pre` names, control tokens as special added
//! tokens) and `tokenizer_config.json` (chat template, bos/eos).

use std::collections::BTreeMap;
use std::path::Path;

use tch::{Kind, Tensor};

use crate::error::{Result, TrainerError};

/// A metadata value.
#[derive(Debug, Clone, PartialEq)]
pub enum Value {
    Int(i64),
    Float(f64),
    Bool(bool),
    Str(String),
    Array(Vec<Value>),
}

impl Value {
    pub fn as_i64(&self) -> Option<i64> {
        match self {
            Value::Int(i) => Some(*i),
            _ => None,
        }
    }
    pub fn as_f64(&self) -> Option<f64> {
        match self {
            Value::Float(f) => Some(*f),
            Value::Int(i) => Some(*i as f64),
            _ => None,
        }
    }
    pub fn as_str(&self) -> Option<&str> {
        match self {
            Value::Str(s) => Some(s),
            _ => None,
        }
    }
}

struct TensorInfo {
    name: String,
    /// ggml order: dims[0] is the innermost.
    dims: Vec<u64>,
    ggml_type: u32,
    offset: u64,
}

/// A parsed GGUF file (kept in memory).
pub struct Gguf {
    pub metadata: BTreeMap<String, Value>,
    infos: Vec<TensorInfo>,
    bytes: Vec<u8>,
    data_start: usize,
    path: std::path::PathBuf,
}

impl std::fmt::Debug for Gguf {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Gguf")
            .field("path", &self.path)
            .field("tensors", &self.infos.len())
            .finish()
    }
}

struct Cursor<'a> {
    b: &'a [u8],
    pos: usize,
}

impl Cursor<'_> {
    fn take(&mut self, n: usize) -> Option<&[u8]> {
        let s = self.b.get(self.pos..self.pos.checked_add(n)?)?;
        self.pos += n;
        Some(s)
    }
    fn u32(&mut self) -> Option<u32> {
        self.take(4)
            .and_then(|s| s.try_into().ok())
            .map(u32::from_le_bytes)
    }
    fn u64(&mut self) -> Option<u64> {
        self.take(8)
            .and_then(|s| s.try_into().ok())
            .map(u64::from_le_bytes)
    }
    fn string(&mut self) -> Option<String> {
        let n = usize::try_from(self.u64()?).ok()?;
        self.take(n)
            .map(|s| String::from_utf8_lossy(s).into_owned())
    }
    fn value(&mut self, ty: u32, depth: usize) -> Option<Value> {
        let le = |s: &[u8]| -> [u8; 8] {
            let mut a = [0u8; 8];
            a[..s.len()].copy_from_slice(s);
            a
        };
        Some(match ty {
            0 => Value::Int(i64::from(self.take(1)?[0])),
            1 => Value::Int(i64::from(self.take(1)?[0] as i8)),
            2 => Value::Int(i64::from(u16::from_le_bytes(
                self.take(2)?.try_into().ok()?,
            ))),
            3 => Value::Int(i64::from(i16::from_le_bytes(
                self.take(2)?.try_into().ok()?,
            ))),
            4 => Value::Int(i64::from(self.u32()?)),
            5 => Value::Int(i64::from(i32::from_le_bytes(
                self.take(4)?.try_into().ok()?,
            ))),
            6 => Value::Float(f64::from(f32::from_le_bytes(
                self.take(4)?.try_into().ok()?,
            ))),
            7 => Value::Bool(self.take(1)?[0] != 0),
            8 => Value::Str(self.string()?),
            9 if depth < 4 => {
                let item = self.u32()?;
                let n = usize::try_from(self.u64()?).ok()?;
                let mut v = Vec::with_capacity(n.min(1 << 20));
                for _ in 0..n {
                    v.push(self.value(item, depth + 1)?);
                }
                Value::Array(v)
            }
            10 => Value::Int(self.u64()? as i64),
            11 => Value::Int(i64::from_le_bytes(le(self.take(8)?))),
            12 => Value::Float(f64::from_le_bytes(self.take(8)?.try_into().ok()?)),
            _ => return None,
        })
    }
}

/// (elements per block, bytes per block) of the ggml types read here.
fn block(ggml_type: u32) -> Option<(usize, usize)> {
    Some(match ggml_type {
        0 => (1, 4),   // F32
        1 => (1, 2),   // F16
        30 => (1, 2),  // BF16
        2 => (32, 18), // Q4_0
        3 => (32, 20), // Q4_1
        8 => (32, 34), // Q8_0
        _ => return None,
    })
}

fn f16(b: &[u8]) -> f32 {
    half::f16::from_le_bytes([b[0], b[1]]).to_f32()
}

fn dequantize(ggml_type: u32, data: &[u8], n: usize) -> Vec<f32> {
    let mut out = Vec::with_capacity(n);
    match ggml_type {
        0 => out.extend(
            data.chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])),
        ),
        1 => out.extend(data.chunks_exact(2).map(f16)),
        30 => out.extend(
            data.chunks_exact(2)
                .map(|c| half::bf16::from_le_bytes([c[0], c[1]]).to_f32()),
        ),
        2 => {
            for b in data.chunks_exact(18) {
                let d = f16(&b[0..2]);
                let qs = &b[2..18];
                out.extend(qs.iter().map(|q| (f32::from(q & 0x0F) - 8.0) * d));
                out.extend(qs.iter().map(|q| (f32::from(q >> 4) - 8.0) * d));
            }
        }
        3 => {
            for b in data.chunks_exact(20) {
                let (d, m) = (f16(&b[0..2]), f16(&b[2..4]));
                let qs = &b[4..20];
                out.extend(qs.iter().map(|q| f32::from(q & 0x0F) * d + m));
                out.extend(qs.iter().map(|q| f32::from(q >> 4) * d + m));
            }
        }
        8 => {
            for b in data.chunks_exact(34) {
                let d = f16(&b[0..2]);
                out.extend(b[2..34].iter().map(|&q| f32::from(q as i8) * d));
            }
        }
        _ => {}
    }
    out.truncate(n);
    out
}

impl Gguf {
    pub fn open(path: &Path) -> Result<Gguf> {
        let bytes = std::fs::read(path).map_err(|e| TrainerError::io("reading", path, e))?;
        let bad = |p: &str| TrainerError::Weights {
            path: path.to_path_buf(),
            problem: p.to_owned(),
        };
        let mut c = Cursor { b: &bytes, pos: 0 };
        if c.take(4) != Some(b"GGUF".as_slice()) {
            return Err(bad("is not a GGUF file (no GGUF magic)"));
        }
        let version = c.u32().ok_or_else(|| bad("is truncated"))?;
        if !(2..=3).contains(&version) {
            return Err(bad(&format!(
                "is GGUF version {version}; graft reads versions 2 and 3"
            )));
        }
        let n_tensors = c.u64().ok_or_else(|| bad("is truncated"))?;
        let n_kv = c.u64().ok_or_else(|| bad("is truncated"))?;
        let mut metadata = BTreeMap::new();
        for _ in 0..n_kv {
            let key = c
                .string()
                .ok_or_else(|| bad("has a truncated metadata key"))?;
            let ty = c.u32().ok_or_else(|| bad("is truncated"))?;
            let v = c
                .value(ty, 0)
                .ok_or_else(|| bad(&format!("has an unreadable value for '{key}'")))?;
            metadata.insert(key, v);
        }
        let mut infos = Vec::new();
        for _ in 0..n_tensors {
            let name = c
                .string()
                .ok_or_else(|| bad("has a truncated tensor name"))?;
            let nd = c.u32().ok_or_else(|| bad("is truncated"))?;
            let dims = (0..nd)
                .map(|_| c.u64())
                .collect::<Option<Vec<_>>>()
                .ok_or_else(|| bad("is truncated"))?;
            let ggml_type = c.u32().ok_or_else(|| bad("is truncated"))?;
            let offset = c.u64().ok_or_else(|| bad("is truncated"))?;
            infos.push(TensorInfo {
                name,
                dims,
                ggml_type,
                offset,
            });
        }
        let align = metadata
            .get("general.alignment")
            .and_then(Value::as_i64)
            .unwrap_or(32)
            .max(1) as usize;
        let data_start = c.pos.div_ceil(align) * align;
        Ok(Gguf {
            metadata,
            infos,
            bytes,
            data_start,
            path: path.to_path_buf(),
        })
    }

    fn meta_i64(&self, key: &str) -> Result<i64> {
        self.metadata
            .get(key)
            .and_then(Value::as_i64)
            .ok_or_else(|| TrainerError::Weights {
                path: self.path.clone(),
                problem: format!("has no integer metadata '{key}'"),
            })
    }

    /// The vocabulary (`tokenizer.ggml.tokens`), id order.
    pub fn tokens(&self) -> Vec<String> {
        match self.metadata.get("tokenizer.ggml.tokens") {
            Some(Value::Array(a)) => a
                .iter()
                .map(|v| v.as_str().unwrap_or("").to_owned())
                .collect(),
            _ => Vec::new(),
        }
    }

    /// One tensor as f32 in PyTorch's shape order.
    fn tensor(&self, info: &TensorInfo) -> Result<Tensor> {
        let bad = |p: String| TrainerError::Weights {
            path: self.path.clone(),
            problem: p,
        };
        let (per, size) = block(info.ggml_type).ok_or_else(|| {
            bad(format!(
                "tensor '{}' has ggml type {}, which graft cannot dequantize",
                info.name, info.ggml_type
            ))
        })?;
        let n: u64 = info.dims.iter().product();
        let n = usize::try_from(n).map_err(|_| bad("a tensor is too large".to_owned()))?;
        let nbytes = n.div_ceil(per) * size;
        let start = self.data_start
            + usize::try_from(info.offset).map_err(|_| bad("bad offset".to_owned()))?;
        let data = self.bytes.get(start..start + nbytes).ok_or_else(|| {
            bad(format!(
                "tensor '{}' runs past the end of the file",
                info.name
            ))
        })?;
        let values = dequantize(info.ggml_type, data, n);
        let shape: Vec<i64> = info.dims.iter().rev().map(|&d| d as i64).collect();
        Ok(Tensor::from_slice(&values).f_reshape(&shape)?)
    }

    /// The HF `config.json` of a Llama GGUF.
    pub fn llama_config(&self) -> Result<serde_json::Value> {
        let arch = self
            .metadata
            .get("general.architecture")
            .and_then(Value::as_str)
            .unwrap_or("");
        if arch != "llama" {
            return Err(TrainerError::Weights {
                path: self.path.clone(),
                problem: format!(
                    "architecture '{arch}' cannot be imported; graft imports llama GGUFs"
                ),
            });
        }
        let heads = self.meta_i64("llama.attention.head_count")?;
        let hidden = self.meta_i64("llama.embedding_length")?;
        let tied = !self.infos.iter().any(|t| t.name == "output.weight");
        let vocab = self
            .metadata
            .get("llama.vocab_size")
            .and_then(Value::as_i64)
            .unwrap_or(self.tokens().len() as i64);
        Ok(serde_json::json!({
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "hidden_size": hidden,
            "intermediate_size": self.meta_i64("llama.feed_forward_length")?,
            "num_hidden_layers": self.meta_i64("llama.block_count")?,
            "num_attention_heads": heads,
            "num_key_value_heads": self.metadata.get("llama.attention.head_count_kv").and_then(Value::as_i64).unwrap_or(heads),
            "head_dim": hidden / heads,
            "rms_norm_eps": self.metadata.get("llama.attention.layer_norm_rms_epsilon").and_then(Value::as_f64).unwrap_or(1e-5),
            "rope_theta": self.metadata.get("llama.rope.freq_base").and_then(Value::as_f64).unwrap_or(10000.0),
            "max_position_embeddings": self.metadata.get("llama.context_length").and_then(Value::as_i64).unwrap_or(2048),
            "vocab_size": vocab,
            "tie_word_embeddings": tied,
            "hidden_act": "silu",
            "bos_token_id": self.metadata.get("tokenizer.ggml.bos_token_id").and_then(Value::as_i64),
            "eos_token_id": self.metadata.get("tokenizer.ggml.eos_token_id").and_then(Value::as_i64),
            "torch_dtype": "float32",
        }))
    }

    /// Every tensor under its HF name, f32, q/k rows back in HF's order.
    pub fn hf_tensors(&self) -> Result<Vec<(String, Tensor)>> {
        let heads = self.meta_i64("llama.attention.head_count")?;
        let kv_heads = self
            .metadata
            .get("llama.attention.head_count_kv")
            .and_then(Value::as_i64)
            .unwrap_or(heads);
        let mut out = Vec::with_capacity(self.infos.len());
        for info in &self.infos {
            let Some(name) = hf_name(&info.name) else {
                tracing::warn!(tensor = %info.name, "gguf import: tensor not used");
                continue;
            };
            let mut t = self.tensor(info)?;
            if name.ends_with("q_proj.weight") {
                t = unpermute(&t, heads)?;
            } else if name.ends_with("k_proj.weight") {
                t = unpermute(&t, kv_heads)?;
            }
            out.push((name, t));
        }
        Ok(out)
    }

    /// Writes an HF directory (`config.json` + `model.safetensors`, in `kind`; plus
    /// `tokenizer.json` and `tokenizer_config.json` for a GPT-2-style BPE vocabulary).
    pub fn write_hf_dir(&self, dir: &Path, kind: Kind) -> Result<()> {
        let config = self.llama_config()?;
        let tensors = self.hf_tensors()?;
        crate::weights::write_dir(dir, &config, &tensors, kind, 4 << 30)?;
        match self.tokenizer_files() {
            Ok((tokenizer, tokenizer_config)) => {
                for (name, v) in [
                    ("tokenizer.json", tokenizer),
                    ("tokenizer_config.json", tokenizer_config),
                ] {
                    let path = dir.join(name);
                    let text = serde_json::to_string(&v)
                        .map_err(|e| TrainerError::invalid(e.to_string()))?;
                    std::fs::write(&path, text)
                        .map_err(|e| TrainerError::io("writing", &path, e))?;
                }
            }
            Err(e) => tracing::warn!(error = %e, "gguf import: no tokenizer.json written"),
        }
        Ok(())
    }

    fn strings(&self, key: &str) -> Vec<String> {
        match self.metadata.get(key) {
            Some(Value::Array(a)) => a
                .iter()
                .map(|v| v.as_str().unwrap_or("").to_owned())
                .collect(),
            _ => Vec::new(),
        }
    }

    /// `tokenizer.json` and `tokenizer_config.json` for a GPT-2-style BPE vocabulary.
    pub fn tokenizer_files(&self) -> Result<(serde_json::Value, serde_json::Value)> {
        let bad = |p: String| TrainerError::Weights {
            path: self.path.clone(),
            problem: p,
        };
        let model = self
            .metadata
            .get("tokenizer.ggml.model")
            .and_then(Value::as_str)
            .unwrap_or("");
        if model != "gpt2" {
            return Err(bad(format!(
                "tokenizer model '{model}' is not converted (only gpt2-style BPE)"
            )));
        }
        let pre = self
            .metadata
            .get("tokenizer.ggml.pre")
            .and_then(Value::as_str)
            .unwrap_or("default");
        let byte_level = serde_json::json!({"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true});
        let pre_tokenizer = match pre {
            // llama.cpp: "\\p{N}" then the GPT-2 regex.
            "smollm" => serde_json::json!({"type": "Sequence", "pretokenizers": [
                {"type": "Digits", "individual_digits": true}, byte_level]}),
            "default" | "gpt-2" | "gpt2" => byte_level,
            other => {
                return Err(bad(format!(
                    "pre-tokenizer '{other}' is not converted (smollm, gpt-2)"
                )));
            }
        };
        let tokens = self.tokens();
        let types: Vec<i64> = match self.metadata.get("tokenizer.ggml.token_type") {
            Some(Value::Array(a)) => a.iter().map(|v| v.as_i64().unwrap_or(1)).collect(),
            _ => vec![1; tokens.len()],
        };
        let vocab: serde_json::Map<String, serde_json::Value> = tokens
            .iter()
            .enumerate()
            .map(|(i, t)| (t.clone(), serde_json::json!(i)))
            .collect();
        // Control (3) and user-defined (4) tokens are matched before the model, as HF's
        // added tokens; control tokens are special.
        let added: Vec<serde_json::Value> = tokens
            .iter()
            .zip(&types)
            .enumerate()
            .filter(|(_, (_, ty))| **ty == 3 || **ty == 4)
            .map(|(i, (t, ty))| {
                serde_json::json!({"id": i, "content": t, "single_word": false,
                "lstrip": false, "rstrip": false, "normalized": false, "special": *ty == 3})
            })
            .collect();
        let tokenizer = serde_json::json!({
            "version": "1.0", "truncation": null, "padding": null, "added_tokens": added,
            "normalizer": null, "pre_tokenizer": pre_tokenizer,
            "post_processor": {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": false, "use_regex": true},
            "decoder": {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true, "use_regex": true},
            "model": {"type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": null,
                "end_of_word_suffix": null, "fuse_unk": false, "byte_fallback": false, "ignore_merges": false,
                "vocab": vocab, "merges": self.strings("tokenizer.ggml.merges")}
        });
        let token = |key: &str| {
            self.metadata
                .get(key)
                .and_then(Value::as_i64)
                .and_then(|i| tokens.get(usize::try_from(i).ok()?).cloned())
        };
        let mut config = serde_json::json!({
            "tokenizer_class": "GPT2Tokenizer",
            "add_bos_token": self.metadata.get("tokenizer.ggml.add_bos_token").map(|v| *v == Value::Bool(true)).unwrap_or(false),
            "model_max_length": self.metadata.get("llama.context_length").and_then(Value::as_i64).unwrap_or(2048),
            "bos_token": token("tokenizer.ggml.bos_token_id"),
            "eos_token": token("tokenizer.ggml.eos_token_id"),
            "unk_token": token("tokenizer.ggml.unknown_token_id"),
            "pad_token": token("tokenizer.ggml.padding_token_id"),
        });
        if let Some(t) = self
            .metadata
            .get("tokenizer.chat_template")
            .and_then(Value::as_str)
        {
            config["chat_template"] = serde_json::json!(t);
        }
        Ok((tokenizer, config))
    }
}

/// llama.cpp's tensor names → HF's.
fn hf_name(gguf: &str) -> Option<String> {
    match gguf {
        "token_embd.weight" => return Some("model.embed_tokens.weight".to_owned()),
        "output_norm.weight" => return Some("model.norm.weight".to_owned()),
        "output.weight" => return Some("lm_head.weight".to_owned()),
        _ => {}
    }
    let rest = gguf.strip_prefix("blk.")?;
    let (layer, part) = rest.split_once('.')?;
    let layer: u32 = layer.parse().ok()?;
    let hf = match part {
        "attn_norm.weight" => "input_layernorm.weight",
        "ffn_norm.weight" => "post_attention_layernorm.weight",
        "attn_q.weight" => "self_attn.q_proj.weight",
        "attn_k.weight" => "self_attn.k_proj.weight",
        "attn_v.weight" => "self_attn.v_proj.weight",
        "attn_output.weight" => "self_attn.o_proj.weight",
        "attn_q.bias" => "self_attn.q_proj.bias",
        "attn_k.bias" => "self_attn.k_proj.bias",
        "attn_v.bias" => "self_attn.v_proj.bias",
        "ffn_gate.weight" => "mlp.gate_proj.weight",
        "ffn_up.weight" => "mlp.up_proj.weight",
        "ffn_down.weight" => "mlp.down_proj.weight",
        _ => return None,
    };
    Some(format!("model.layers.{layer}.{hf}"))
}

/// Undoes llama.cpp's `permute(w, n_head)`: `[heads, 2, d/2, ..] → [heads, d/2, 2, ..]`
/// on export, so here `[heads, d/2, 2, ..] → [heads, 2, d/2, ..]`.
fn unpermute(t: &Tensor, heads: i64) -> Result<Tensor> {
    let size = t.size();
    let rows = size.first().copied().unwrap_or(0);
    let mut shape = vec![heads, rows / heads / 2, 2];
    shape.extend(&size[1..]);
    Ok(t.f_reshape(&shape)?
        .f_transpose(1, 2)?
        .f_contiguous()?
        .f_reshape(&size)?)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn q4_1_and_q8_0_blocks_dequantize() {
        // Q4_1: d = 0.5, m = -1, nibbles 0..16 low and 15..0 high.
        let mut b = Vec::new();
        b.extend(half::f16::from_f32(0.5).to_le_bytes());
        b.extend(half::f16::from_f32(-1.0).to_le_bytes());
        b.extend((0u8..16).map(|j| j | ((15 - j) << 4)));
        let v = dequantize(3, &b, 32);
        assert_eq!(v[0], -1.0);
        assert_eq!(v[15], 15.0 * 0.5 - 1.0);
        assert_eq!(v[16], 15.0 * 0.5 - 1.0);
        assert_eq!(v[31], -1.0);
        // Q8_0: d = 0.25, values -16..16.
        let mut b = Vec::new();
        b.extend(half::f16::from_f32(0.25).to_le_bytes());
        b.extend((-16i8..16).map(|q| q as u8));
        let v = dequantize(8, &b, 32);
        assert_eq!(v[0], -4.0);
        assert_eq!(v[31], 15.0 * 0.25);
    }

    #[test]
    fn unpermute_inverts_llama_cpp_permute() {
        // llama.cpp: w.reshape(h, 2, d/2, c).swapaxes(1, 2).reshape(w.shape)
        let heads = 3;
        let w = Tensor::arange(3 * 8 * 2, (Kind::Float, tch::Device::Cpu)).reshape([24, 2]);
        let permuted = w
            .reshape([heads, 2, 4, 2])
            .transpose(1, 2)
            .contiguous()
            .reshape([24, 2]);
        let back = unpermute(&permuted, heads).unwrap();
        assert_eq!(
            back.sum(Kind::Float).double_value(&[]),
            w.sum(Kind::Float).double_value(&[])
        );
        assert!(back.equal(&w));
    }

    #[test]
    fn names_map_to_hf() {
        assert_eq!(
            hf_name("blk.12.attn_q.weight").as_deref(),
            Some("model.layers.12.self_attn.q_proj.weight")
        );
        assert_eq!(
            hf_name("blk.0.ffn_norm.weight").as_deref(),
            Some("model.layers.0.post_attention_layernorm.weight")
        );
        assert_eq!(
            hf_name("token_embd.weight").as_deref(),
            Some("model.embed_tokens.weight")
        );
        assert_eq!(hf_name("rope_freqs.weight"), None);
    }
}

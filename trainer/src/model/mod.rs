//! Decoder-only transformers from HF checkpoints: [`llama`], [`qwen2`] and [`qwen3`] each
//! hold a `Config` that mirrors their HF `config.json` and turn it into a [`Spec`]; the
//! layers they share (RMSNorm, rotate-half RoPE, GQA attention over a KV cache, SwiGLU
//! MLP) live here. Parameters keep their HF names, so a checkpoint loads as it is and
//! [`crate::weights`] writes one HF and SGLang read back.

pub mod checkpoint;
pub mod llama;
pub mod qwen2;
pub mod qwen3;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use tch::{Device, Kind, Tensor};

use crate::error::{Result, TrainerError};

/// Which family a checkpoint is, from `config.json`'s `model_type`.
#[derive(Debug, Clone, PartialEq)]
pub enum ModelConfig {
    Llama(llama::Config),
    Qwen2(qwen2::Config),
    Qwen3(qwen3::Config),
}

/// The shape of a model, whatever its family: what the shared layers need.
#[derive(Debug, Clone, PartialEq)]
pub struct Spec {
    pub vocab_size: i64,
    pub hidden_size: i64,
    pub intermediate_size: i64,
    pub num_layers: i64,
    pub num_heads: i64,
    pub num_kv_heads: i64,
    pub head_dim: i64,
    pub rms_norm_eps: f64,
    pub rope_theta: f64,
    pub tie_word_embeddings: bool,
    /// Biases on q/k/v projections (Qwen2: always; Llama: `attention_bias`).
    pub qkv_bias: bool,
    /// Bias on the output projection (Llama's `attention_bias`).
    pub o_bias: bool,
    /// Biases on the MLP projections (Llama's `mlp_bias`).
    pub mlp_bias: bool,
    /// RMSNorm on each head of q and k before RoPE (Qwen3).
    pub qk_norm: bool,
}

impl ModelConfig {
    /// Reads `config.json` from a model directory.
    pub fn load(dir: &Path) -> Result<(ModelConfig, serde_json::Value)> {
        let path = dir.join("config.json");
        let text =
            std::fs::read_to_string(&path).map_err(|e| TrainerError::io("reading", &path, e))?;
        let raw: serde_json::Value =
            serde_json::from_str(&text).map_err(|e| TrainerError::Config {
                path: path.clone(),
                problem: format!("not valid JSON: {e}"),
            })?;
        let config = ModelConfig::from_json(&raw).map_err(|problem| TrainerError::Config {
            path: path.clone(),
            problem,
        })?;
        Ok((config, raw))
    }

    /// Parses an HF config by its `model_type`.
    pub fn from_json(raw: &serde_json::Value) -> Result<ModelConfig, String> {
        let model_type = raw.get("model_type").and_then(|v| v.as_str()).unwrap_or("");
        let parse = |what: &str| format!("is not a valid {what} config");
        match model_type {
            "llama" => serde_json::from_value(raw.clone())
                .map(ModelConfig::Llama)
                .map_err(|e| format!("{}: {e}", parse("Llama"))),
            "qwen2" => serde_json::from_value(raw.clone())
                .map(ModelConfig::Qwen2)
                .map_err(|e| format!("{}: {e}", parse("Qwen2"))),
            "qwen3" => serde_json::from_value(raw.clone())
                .map(ModelConfig::Qwen3)
                .map_err(|e| format!("{}: {e}", parse("Qwen3"))),
            other => Err(format!(
                "model_type '{other}' is not supported; graft's trainer runs llama, qwen2 and qwen3 (dense) checkpoints"
            )),
        }
    }

    pub fn spec(&self) -> Result<Spec, String> {
        match self {
            ModelConfig::Llama(c) => c.spec(),
            ModelConfig::Qwen2(c) => c.spec(),
            ModelConfig::Qwen3(c) => c.spec(),
        }
    }
}

/// `rope_theta` from a config: top level (transformers 4) or inside `rope_parameters`
/// (transformers 5); refuses rope scaling, which these models do not implement.
pub(crate) fn rope_theta(
    top: Option<f64>,
    params: &Option<serde_json::Value>,
    scaling: &Option<serde_json::Value>,
) -> Result<f64, String> {
    for p in [params, scaling].into_iter().flatten() {
        if p.is_null() {
            continue;
        }
        let kind = p
            .get("rope_type")
            .or_else(|| p.get("type"))
            .and_then(|v| v.as_str())
            .unwrap_or("default");
        if kind != "default" {
            return Err(format!(
                "rope scaling '{kind}' is not supported; use a checkpoint without rope_scaling"
            ));
        }
    }
    let nested = params
        .as_ref()
        .and_then(|p| p.get("rope_theta"))
        .and_then(|v| v.as_f64());
    top.or(nested)
        .ok_or_else(|| "has neither rope_theta nor rope_parameters.rope_theta".to_owned())
}

pub(crate) fn check_act(act: &str) -> Result<(), String> {
    if act == "silu" {
        Ok(())
    } else {
        Err(format!("hidden_act '{act}' is not supported (only silu)"))
    }
}

impl Spec {
    pub(crate) fn validate(self) -> Result<Spec, String> {
        if self.num_heads <= 0 || self.num_kv_heads <= 0 || self.num_heads % self.num_kv_heads != 0
        {
            return Err(format!(
                "num_attention_heads {} must be a positive multiple of num_key_value_heads {}",
                self.num_heads, self.num_kv_heads
            ));
        }
        if self.head_dim <= 0 || self.head_dim % 2 != 0 {
            return Err(format!(
                "head_dim {} must be positive and even (RoPE)",
                self.head_dim
            ));
        }
        if self.vocab_size <= 0 || self.hidden_size <= 0 || self.num_layers <= 0 {
            return Err(
                "vocab_size, hidden_size and num_hidden_layers must be positive".to_owned(),
            );
        }
        Ok(self)
    }

    /// Every parameter by HF name, with its shape and how a fresh model initialises it.
    pub fn parameters(&self) -> Vec<(String, Vec<i64>, Init)> {
        let h = self.hidden_size;
        let q = self.num_heads * self.head_dim;
        let kv = self.num_kv_heads * self.head_dim;
        let i = self.intermediate_size;
        let mut out = vec![(
            "model.embed_tokens.weight".to_owned(),
            vec![self.vocab_size, h],
            Init::Normal,
        )];
        for l in 0..self.num_layers {
            let p = format!("model.layers.{l}");
            let mut push =
                |name: String, shape: Vec<i64>, init: Init| out.push((name, shape, init));
            push(format!("{p}.input_layernorm.weight"), vec![h], Init::Ones);
            for (n, rows) in [("q", q), ("k", kv), ("v", kv)] {
                push(
                    format!("{p}.self_attn.{n}_proj.weight"),
                    vec![rows, h],
                    Init::Normal,
                );
                if self.qkv_bias {
                    push(
                        format!("{p}.self_attn.{n}_proj.bias"),
                        vec![rows],
                        Init::Zeros,
                    );
                }
            }
            push(
                format!("{p}.self_attn.o_proj.weight"),
                vec![h, q],
                Init::Normal,
            );
            if self.o_bias {
                push(format!("{p}.self_attn.o_proj.bias"), vec![h], Init::Zeros);
            }
            if self.qk_norm {
                push(
                    format!("{p}.self_attn.q_norm.weight"),
                    vec![self.head_dim],
                    Init::Ones,
                );
                push(
                    format!("{p}.self_attn.k_norm.weight"),
                    vec![self.head_dim],
                    Init::Ones,
                );
            }
            push(
                format!("{p}.post_attention_layernorm.weight"),
                vec![h],
                Init::Ones,
            );
            for (n, shape) in [
                ("gate", vec![i, h]),
                ("up", vec![i, h]),
                ("down", vec![h, i]),
            ] {
                let rows = shape[0];
                push(format!("{p}.mlp.{n}_proj.weight"), shape, Init::Normal);
                if self.mlp_bias {
                    push(format!("{p}.mlp.{n}_proj.bias"), vec![rows], Init::Zeros);
                }
            }
        }
        out.push(("model.norm.weight".to_owned(), vec![h], Init::Ones));
        if !self.tie_word_embeddings {
            out.push((
                "lm_head.weight".to_owned(),
                vec![self.vocab_size, h],
                Init::Normal,
            ));
        }
        out
    }

    /// Parameter count (tied embeddings counted once).
    pub fn num_parameters(&self) -> i64 {
        self.parameters()
            .iter()
            .map(|(_, s, _)| s.iter().product::<i64>())
            .sum()
    }
}

/// How a fresh parameter starts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Init {
    /// N(0, 0.02), HF's `initializer_range` default.
    Normal,
    Ones,
    Zeros,
}

/// Keys and values of every layer for the tokens seen so far (batch-major:
/// `[batch, kv_heads, seq, head_dim]`).
///
/// Each layer's keys and values live in a buffer with room to spare along `seq`: a decode
/// step writes its position in place and attends over a view of the filled part, so a step
/// copies nothing of what is cached (a cache grown by concatenation copies all of it, every
/// layer, every step: at a few thousand positions that is most of a step). When the room
/// runs out the buffer grows by half (amortised: each position is copied O(1) times).
#[derive(Debug, Default)]
pub struct KvCache {
    layers: Vec<Option<LayerKv>>,
}

/// One layer's cache: `k` and `v` are `[batch, kv_heads, capacity, head_dim]`, the first
/// `len` positions filled.
#[derive(Debug)]
struct LayerKv {
    k: Tensor,
    v: Tensor,
    len: i64,
}

impl LayerKv {
    /// A layer whose buffers are exactly `k` and `v` (full: the next append grows them).
    fn whole(k: Tensor, v: Tensor) -> LayerKv {
        let len = k.size().get(2).copied().unwrap_or(0);
        LayerKv { k, v, len }
    }

    fn capacity(&self) -> i64 {
        self.k.size().get(2).copied().unwrap_or(0)
    }

    /// The filled part of the keys and values (views of the buffers).
    fn filled(&self) -> Result<(Tensor, Tensor)> {
        Ok((
            self.k.f_narrow(2, 0, self.len)?,
            self.v.f_narrow(2, 0, self.len)?,
        ))
    }

    /// Writes `k` and `v` (`[batch, kv_heads, t, head_dim]`) after the filled part and
    /// returns the filled part with them (views of the buffers).
    fn append(&mut self, k: &Tensor, v: &Tensor) -> Result<(Tensor, Tensor)> {
        let t = k.size().get(2).copied().unwrap_or(0);
        let need = self.len + t;
        if need > self.capacity() {
            let grow = |old: &Tensor| -> Result<Tensor> {
                let mut size = old.size();
                size[2] = need + need / 2 + 16;
                let buf = Tensor::f_empty(&size, (old.kind(), old.device()))?;
                buf.f_narrow(2, 0, self.len)?
                    .f_copy_(&old.f_narrow(2, 0, self.len)?)?;
                Ok(buf)
            };
            self.k = grow(&self.k)?;
            self.v = grow(&self.v)?;
        }
        self.k.f_narrow(2, self.len, t)?.f_copy_(k)?;
        self.v.f_narrow(2, self.len, t)?.f_copy_(v)?;
        self.len = need;
        self.filled()
    }
}

impl KvCache {
    pub fn new() -> KvCache {
        KvCache::default()
    }

    fn first(&self) -> Option<&LayerKv> {
        self.layers.first().and_then(|l| l.as_ref())
    }

    /// How many positions the cache holds.
    pub fn len(&self) -> i64 {
        self.first().map(|l| l.len).unwrap_or(0)
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Rows (batch entries) the cache holds.
    pub fn rows(&self) -> i64 {
        self.first()
            .map(|l| l.k.size().first().copied().unwrap_or(0))
            .unwrap_or(0)
    }
}

/// The serving engine's cache: per layer, keys and values of a set of row slots,
/// `[slots, kv_heads, positions, head_dim]`, zero-initialised. Slot `i` holds its row's
/// positions from column 0 (position p at column p), however long the other rows are:
/// newcomers are prefilled straight into free slots ([`Model::prefill_slots`]), a decode
/// step writes each row's new position in place ([`Model::decode_slots`]), and a row that
/// leaves frees its slot (the caller may move another row into it with
/// [`SlotCache::move_row`]: one row's copy). Nothing is re-padded or concatenated.
#[derive(Debug, Default)]
pub struct SlotCache {
    k: Vec<Tensor>,
    v: Vec<Tensor>,
}

impl SlotCache {
    pub fn new() -> SlotCache {
        SlotCache::default()
    }

    /// (slots, positions) there is room for.
    pub fn capacity(&self) -> (i64, i64) {
        match self.k.first() {
            Some(k) => {
                let s = k.size();
                (s[0], s[2])
            }
            None => (0, 0),
        }
    }

    /// Copies the first `len` positions of slot `from` into slot `to`.
    pub fn move_row(&mut self, from: i64, to: i64, len: i64) -> Result<()> {
        if from == to || len == 0 {
            return Ok(());
        }
        for t in self.k.iter().chain(&self.v) {
            let src = t.f_narrow(0, from, 1)?.f_narrow(2, 0, len)?;
            t.f_narrow(0, to, 1)?.f_narrow(2, 0, len)?.f_copy_(&src)?;
        }
        Ok(())
    }
}

struct Linear {
    weight: Tensor,
    bias: Option<Tensor>,
}

impl Linear {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        linear(x, &self.weight, self.bias.as_ref())
    }
}

/// Inputs with at most this many rows (decode steps, short prefills) may take the
/// weight-major product on the CPU; see [`linear`].
const FEW_ROWS: i64 = 128;

/// Whether the weight-major product is the faster one on this CPU, measured once, on the
/// first few-row product the process makes (its own weight, 2 rows, both forms timed
/// alternately after a warm-up; it must win by 10%). `GRAFT_CPU_WEIGHT_MAJOR=1|0` decides
/// instead. Which form MKL runs faster depends on the CPU: on one 2-core VM of this
/// project's build machines the weight-major form decoded SmolLM2 1.4-1.9x faster, on
/// another (AVX-512) 1.8x slower.
fn weight_major_wins(weight: &Tensor) -> bool {
    static WINS: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *WINS.get_or_init(|| {
        if let Ok(v) = std::env::var("GRAFT_CPU_WEIGHT_MAJOR") {
            return v == "1";
        }
        let wins = tch::no_grad(|| calibrate(weight)).unwrap_or(false);
        tracing::debug!(
            weight_major = wins,
            "model: few-row CPU products calibrated"
        );
        wins
    })
}

fn calibrate(weight: &Tensor) -> Result<bool> {
    let inner = weight.size().get(1).copied().unwrap_or(1);
    let x = Tensor::f_randn([2, inner], (Kind::Float, Device::Cpu))?;
    let (mut plain, mut major) = (f64::INFINITY, f64::INFINITY);
    for round in 0..6 {
        let t = std::time::Instant::now();
        let _ = x.f_linear(weight, None::<&Tensor>)?;
        let a = t.elapsed().as_secs_f64();
        let t = std::time::Instant::now();
        let _ = weight.f_matmul(&x.f_tr()?)?.f_tr()?.f_contiguous()?;
        let b = t.elapsed().as_secs_f64();
        if round > 0 {
            plain = plain.min(a);
            major = major.min(b);
        }
    }
    Ok(major < 0.9 * plain)
}

/// `x @ weight^T (+ bias)` for `x` of shape `[.., in]`.
///
/// On the CPU in f32 with few rows it may compute `(weight @ x^T)^T` instead: the same sums
/// in another blocking order (f32 either way, no narrower weights). On some CPUs MKL's
/// sgemm in the `x @ w^T` form copies (packs) the whole weight on every call, which at a
/// handful of rows costs as much as the product itself; with the weight as the left
/// operand it is read in place. A single row is doubled, because MKL's gemv reads the
/// weight slower than its two-row sgemm does. Whether it pays is measured once per process
/// ([`weight_major_wins`]).
fn linear(x: &Tensor, weight: &Tensor, bias: Option<&Tensor>) -> Result<Tensor> {
    let size = x.size();
    let (Some(&inner), Some(&out)) = (size.last(), weight.size().first()) else {
        return Ok(x.f_linear(weight, bias)?);
    };
    let rows = if inner > 0 {
        x.numel() as i64 / inner
    } else {
        0
    };
    if x.device() != Device::Cpu
        || x.kind() != Kind::Float
        || weight.kind() != Kind::Float
        || rows == 0
        || rows > FEW_ROWS
        || !weight_major_wins(weight)
    {
        return Ok(x.f_linear(weight, bias)?);
    }
    let flat = x.f_reshape([rows, inner])?;
    let flat = if rows == 1 {
        Tensor::f_cat(&[&flat, &flat], 0)?
    } else {
        flat
    };
    let y = weight.f_matmul(&flat.f_tr()?)?.f_tr()?;
    let y = if rows == 1 { y.f_narrow(0, 0, 1)? } else { y };
    let mut out_size = size;
    if let Some(last) = out_size.last_mut() {
        *last = out;
    }
    let y = y.f_contiguous()?.f_view(out_size.as_slice())?;
    Ok(match bias {
        Some(b) => y.f_add(b)?,
        None => y,
    })
}

/// HF's RMSNorm (normalise in f32, cast back, then scale) as libtorch's `rms_norm`: the
/// same ops on the CPU, one fused kernel (forward and backward) on CUDA.
fn rms_norm(x: &Tensor, weight: &Tensor, eps: f64) -> Result<Tensor> {
    let d = x.size().last().copied().unwrap_or(0);
    Ok(x.f_rms_norm([d], Some(weight), eps)?)
}

/// RoPE tables for a batch of positions ([`Model::rope_for`]): `cos` and `sin` shaped
/// `[batch or 1, 1, seq, head_dim]`; `sin`'s first half is negated, so the rotation is
/// `x * cos + roll(x, head_dim / 2) * sin`, which is HF's `x * cos + rotate_half(x) * sin`
/// to the bit (negation is exact) in one kernel less.
pub struct Rope {
    cos: Tensor,
    sin: Tensor,
}

impl Rope {
    fn apply(&self, x: &Tensor) -> Result<Tensor> {
        let d = x.size().last().copied().unwrap_or(0);
        let rolled = x.f_roll([d / 2], [-1])?;
        Ok(x.f_mul(&self.cos)?.f_add(&rolled.f_mul(&self.sin)?)?)
    }
}

struct Attention {
    q: Linear,
    k: Linear,
    v: Linear,
    o: Linear,
    q_norm: Option<Tensor>,
    k_norm: Option<Tensor>,
    /// q, k and v as one product ([`Model::fuse_projections`]); `q`, `k`, `v` are then
    /// views of it.
    qkv: Option<Linear>,
}

struct Mlp {
    gate: Linear,
    up: Linear,
    down: Linear,
    /// gate and up as one product ([`Model::fuse_projections`]).
    gate_up: Option<Linear>,
}

/// One weight (and bias, when all have one) holding `parts` stacked by rows; each part's
/// weight and bias become views of it, so writing a part writes the whole.
fn stack_rows(parts: &mut [&mut Linear]) -> Result<Linear> {
    let weights: Vec<&Tensor> = parts.iter().map(|l| &l.weight).collect();
    let weight = Tensor::f_cat(&weights, 0)?;
    let bias = if parts.iter().all(|l| l.bias.is_some()) {
        let biases: Vec<&Tensor> = parts.iter().filter_map(|l| l.bias.as_ref()).collect();
        Some(Tensor::f_cat(&biases, 0)?)
    } else {
        None
    };
    let mut at = 0;
    for l in parts.iter_mut() {
        let rows = l.weight.size().first().copied().unwrap_or(0);
        l.weight = weight.f_narrow(0, at, rows)?;
        if let Some(b) = &bias {
            l.bias = Some(b.f_narrow(0, at, rows)?);
        }
        at += rows;
    }
    Ok(Linear { weight, bias })
}

struct Layer {
    input_norm: Tensor,
    attn: Attention,
    post_norm: Tensor,
    mlp: Mlp,
}

/// A loaded model: HF-named parameters plus the layers built over them (sharing storage).
pub struct Model {
    config: ModelConfig,
    raw_config: serde_json::Value,
    spec: Spec,
    device: Device,
    kind: Kind,
    /// Every parameter, by HF name; `lm_head.weight` is absent when tied.
    params: BTreeMap<String, Tensor>,
    embed: Tensor,
    layers: Vec<Layer>,
    norm: Tensor,
    lm_head: Tensor,
    inv_freq: Tensor,
}

impl std::fmt::Debug for Model {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Model")
            .field("spec", &self.spec)
            .field("device", &self.device)
            .field("kind", &self.kind)
            .finish_non_exhaustive()
    }
}

impl Model {
    /// Loads `config.json` and the safetensors weights (single file or sharded with
    /// `model.safetensors.index.json`) of an HF model directory onto `device`, in `kind`.
    pub fn load(dir: &Path, device: Device, kind: Kind) -> Result<Model> {
        let (config, raw) = ModelConfig::load(dir)?;
        let spec = config.spec().map_err(|problem| TrainerError::Config {
            path: dir.join("config.json"),
            problem,
        })?;
        let tensors = crate::weights::read_dir(dir)?;
        let mut params = BTreeMap::new();
        let mut missing = Vec::new();
        let mut tensors = tensors;
        for (name, shape, _) in spec.parameters() {
            match tensors.remove(&name) {
                None => missing.push(name),
                Some(t) => {
                    if t.size() != shape {
                        return Err(TrainerError::Weights {
                            path: dir.to_path_buf(),
                            problem: format!(
                                "tensor '{name}' has shape {:?}, config.json implies {shape:?}",
                                t.size()
                            ),
                        });
                    }
                    let t = t.f_to_device(device)?.f_to_kind(kind)?;
                    params.insert(name, t);
                }
            }
        }
        if !missing.is_empty() {
            let n = missing.len();
            missing.truncate(5);
            return Err(TrainerError::Weights {
                path: dir.to_path_buf(),
                problem: format!(
                    "{n} tensors that config.json implies are missing, e.g. {}; is this a {} checkpoint with HF names?",
                    missing.join(", "),
                    raw.get("model_type")
                        .and_then(|v| v.as_str())
                        .unwrap_or("?")
                ),
            });
        }
        let unused: Vec<&String> = tensors
            .keys()
            .filter(|k| !(spec.tie_word_embeddings && k.as_str() == "lm_head.weight"))
            .filter(|k| !k.ends_with("rotary_emb.inv_freq"))
            .collect();
        if !unused.is_empty() {
            tracing::warn!(count = unused.len(), first = %unused[0], "model: checkpoint tensors not used");
        }
        Model::from_params(config, raw, spec, params, device, kind)
    }

    /// A freshly initialised model (N(0, 0.02) weights, unit norms, zero biases) from a
    /// config, seeded by `seed`.
    pub fn random(
        raw_config: serde_json::Value,
        device: Device,
        kind: Kind,
        seed: i64,
    ) -> Result<Model> {
        let config =
            ModelConfig::from_json(&raw_config).map_err(|problem| TrainerError::Config {
                path: PathBuf::from("<config>"),
                problem,
            })?;
        let spec = config.spec().map_err(|problem| TrainerError::Config {
            path: PathBuf::from("<config>"),
            problem,
        })?;
        tch::manual_seed(seed);
        let mut params = BTreeMap::new();
        let opts = (Kind::Float, device);
        for (name, shape, init) in spec.parameters() {
            let t = match init {
                Init::Normal => Tensor::f_randn(&shape, opts)?.f_mul_scalar(0.02)?,
                Init::Ones => Tensor::f_ones(&shape, opts)?,
                Init::Zeros => Tensor::f_zeros(&shape, opts)?,
            };
            params.insert(name, t.f_to_kind(kind)?);
        }
        Model::from_params(config, raw_config, spec, params, device, kind)
    }

    fn from_params(
        config: ModelConfig,
        raw_config: serde_json::Value,
        spec: Spec,
        params: BTreeMap<String, Tensor>,
        device: Device,
        kind: Kind,
    ) -> Result<Model> {
        let get = |name: &str| -> Result<Tensor> {
            params
                .get(name)
                .map(Tensor::shallow_clone)
                .ok_or_else(|| TrainerError::invalid(format!("parameter '{name}' is missing")))
        };
        let opt = |name: &str| params.get(name).map(Tensor::shallow_clone);
        let linear = |prefix: &str| -> Result<Linear> {
            Ok(Linear {
                weight: get(&format!("{prefix}.weight"))?,
                bias: opt(&format!("{prefix}.bias")),
            })
        };
        let mut layers = Vec::new();
        for l in 0..spec.num_layers {
            let p = format!("model.layers.{l}");
            layers.push(Layer {
                input_norm: get(&format!("{p}.input_layernorm.weight"))?,
                attn: Attention {
                    q: linear(&format!("{p}.self_attn.q_proj"))?,
                    k: linear(&format!("{p}.self_attn.k_proj"))?,
                    v: linear(&format!("{p}.self_attn.v_proj"))?,
                    o: linear(&format!("{p}.self_attn.o_proj"))?,
                    q_norm: opt(&format!("{p}.self_attn.q_norm.weight")),
                    k_norm: opt(&format!("{p}.self_attn.k_norm.weight")),
                    qkv: None,
                },
                post_norm: get(&format!("{p}.post_attention_layernorm.weight"))?,
                mlp: Mlp {
                    gate: linear(&format!("{p}.mlp.gate_proj"))?,
                    up: linear(&format!("{p}.mlp.up_proj"))?,
                    down: linear(&format!("{p}.mlp.down_proj"))?,
                    gate_up: None,
                },
            });
        }
        let embed = get("model.embed_tokens.weight")?;
        let lm_head = if spec.tie_word_embeddings {
            embed.shallow_clone()
        } else {
            get("lm_head.weight")?
        };
        // HF: 1 / theta^(arange(0, d, 2) / d), in f32.
        let inv_freq = Tensor::f_arange_start_step(0, spec.head_dim, 2, (Kind::Int64, device))?
            .f_to_kind(Kind::Float)?
            .f_div_scalar(spec.head_dim as f64)?;
        let inv_freq = Tensor::f_pow_scalar(spec.rope_theta, &inv_freq)?.f_reciprocal()?;
        Ok(Model {
            norm: get("model.norm.weight")?,
            config,
            raw_config,
            spec,
            device,
            kind,
            params,
            embed,
            layers,
            lm_head,
            inv_freq,
        })
    }

    pub fn spec(&self) -> &Spec {
        &self.spec
    }

    pub fn config(&self) -> &ModelConfig {
        &self.config
    }

    /// The `config.json` the model came from (written back next to pushed weights).
    pub fn raw_config(&self) -> &serde_json::Value {
        &self.raw_config
    }

    pub fn device(&self) -> Device {
        self.device
    }

    pub fn kind(&self) -> Kind {
        self.kind
    }

    /// Every parameter by HF name (shallow clones: they share storage with the model).
    /// A tied `lm_head` is not listed (it is `model.embed_tokens.weight`).
    pub fn named_parameters(&self) -> Vec<(String, Tensor)> {
        self.params
            .iter()
            .map(|(n, t)| (n.clone(), t.shallow_clone()))
            .collect()
    }

    /// For serving: q/k/v and gate/up each become one product over one stacked weight (one
    /// library call instead of three and two per layer and step); the parameters become
    /// views of the stacked weights, so [`Model::copy_params_from`] still updates them in
    /// place. Not for training: the parameters are no longer leaves of their own.
    pub fn fuse_projections(&mut self) -> Result<()> {
        for (l, layer) in self.layers.iter_mut().enumerate() {
            let p = format!("model.layers.{l}");
            let a = &mut layer.attn;
            if a.qkv.is_none() {
                a.qkv = Some(stack_rows(&mut [&mut a.q, &mut a.k, &mut a.v])?);
            }
            let m = &mut layer.mlp;
            if m.gate_up.is_none() {
                m.gate_up = Some(stack_rows(&mut [&mut m.gate, &mut m.up])?);
            }
            let views = [
                ("self_attn.q_proj", &a.q),
                ("self_attn.k_proj", &a.k),
                ("self_attn.v_proj", &a.v),
                ("mlp.gate_proj", &m.gate),
                ("mlp.up_proj", &m.up),
            ];
            for (name, lin) in views {
                self.params
                    .insert(format!("{p}.{name}.weight"), lin.weight.shallow_clone());
                if let Some(b) = &lin.bias {
                    self.params
                        .insert(format!("{p}.{name}.bias"), b.shallow_clone());
                }
            }
        }
        Ok(())
    }

    /// Copies `params` (HF names, every parameter of this model, same shapes; any dtype
    /// and device) into this model's own tensors in place: the in-process weight handoff
    /// from a trainer. Nothing is copied unless every name and shape fits.
    pub fn copy_params_from(&mut self, params: &[(String, Tensor)]) -> Result<()> {
        if params.len() != self.params.len() {
            return Err(TrainerError::invalid(format!(
                "the new weights have {} tensors, the served model {}",
                params.len(),
                self.params.len()
            )));
        }
        for (name, t) in params {
            let Some(dst) = self.params.get(name) else {
                return Err(TrainerError::invalid(format!(
                    "the new weights have '{name}', which the served model does not"
                )));
            };
            if dst.size() != t.size() {
                return Err(TrainerError::invalid(format!(
                    "'{name}' has shape {:?} in the new weights, {:?} in the served model",
                    t.size(),
                    dst.size()
                )));
            }
        }
        tch::no_grad(|| -> Result<()> {
            for (name, t) in params {
                if let Some(dst) = self.params.get_mut(name) {
                    dst.f_copy_(&t.f_detach()?)?;
                }
            }
            Ok(())
        })
    }

    /// RoPE tables for `positions` (`[batch or 1, seq]`, Int64), shaped to broadcast over
    /// `[batch, heads, seq, head_dim]`, in the compute dtype (computed in f32, as HF does).
    pub fn rope_for(&self, positions: &Tensor) -> Result<Rope> {
        let freqs = positions
            .f_to_kind(Kind::Float)?
            .f_unsqueeze(-1)?
            .f_mul(&self.inv_freq)?;
        let emb = Tensor::f_cat(&[&freqs, &freqs], -1)?;
        let sin = freqs.f_sin()?;
        Ok(Rope {
            cos: emb.f_cos()?.f_to_kind(self.kind)?.f_unsqueeze(1)?,
            sin: Tensor::f_cat(&[&sin.f_neg()?, &sin], -1)?
                .f_to_kind(self.kind)?
                .f_unsqueeze(1)?,
        })
    }

    /// The token embeddings of `ids` (`[batch, seq]`): the first layer's input.
    pub fn embed(&self, ids: &Tensor) -> Result<Tensor> {
        Ok(Tensor::f_embedding(&self.embed, ids, -1, false, false)?)
    }

    pub fn num_layers(&self) -> usize {
        self.layers.len()
    }

    /// Decoder layer `li` on `x` (`[batch, seq, hidden]`), causal over `seq`, no cache: the
    /// training forward one layer at a time (activation checkpointing recomputes with it).
    pub fn layer(&self, li: usize, x: &Tensor, rope: &Rope) -> Result<Tensor> {
        let layer = self
            .layers
            .get(li)
            .ok_or_else(|| TrainerError::invalid(format!("no layer {li}")))?;
        self.block(layer, x, rope, |q, k, v| self.causal_attention(&q, &k, &v))
    }

    /// SDPA over `q`, `k`, `v` of one sequence each, causal (no mask: the kernel takes
    /// causality itself), GQA in the kernel.
    fn causal_attention(&self, q: &Tensor, k: &Tensor, v: &Tensor) -> Result<Tensor> {
        let t = q.size().get(2).copied().unwrap_or(0);
        Ok(Tensor::f_scaled_dot_product_attention(
            q,
            k,
            v,
            None::<&Tensor>,
            0.0,
            t > 1,
            None,
            self.spec.num_heads != self.spec.num_kv_heads,
        )?)
    }

    /// The final RMSNorm: the last layer's output to the lm_head's input.
    pub fn final_norm(&self, x: &Tensor) -> Result<Tensor> {
        rms_norm(x, &self.norm, self.spec.rms_norm_eps)
    }

    /// One decoder layer on `x` (`[b, t, hidden]`): norms, projections and RoPE here;
    /// `attend(q, k, v)` (q `[b, heads, t, head_dim]`, k and v `[b, kv_heads, t, head_dim]`,
    /// RoPE applied) does the attention (and any cache) and returns `[b, heads, t, head_dim]`.
    fn block(
        &self,
        layer: &Layer,
        x: &Tensor,
        rope: &Rope,
        attend: impl FnOnce(Tensor, Tensor, Tensor) -> Result<Tensor>,
    ) -> Result<Tensor> {
        let s = &self.spec;
        let size = x.size();
        let [b, t, _] = size[..] else {
            return Err(TrainerError::invalid(format!(
                "a layer's input must be [batch, seq, hidden], got {size:?}"
            )));
        };
        let h = rms_norm(x, &layer.input_norm, s.rms_norm_eps)?;
        let a = &layer.attn;
        let (nq, nkv) = (s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim);
        let heads = |y: Tensor, n: i64, norm: &Option<Tensor>| -> Result<Tensor> {
            let y = y.f_reshape([b, t, n, s.head_dim])?;
            Ok(match norm {
                Some(w) => rms_norm(&y, w, s.rms_norm_eps)?,
                None => y,
            })
        };
        let (nh, nkv_h) = (s.num_heads, s.num_kv_heads);
        let (q, k, v) = match &a.qkv {
            // Stacked projections (serving): q and k share one RoPE pass (half the kernels
            // of a decode step's rotation), and stay views of it.
            Some(qkv) => {
                let y = qkv.forward(&h)?;
                let qk = match (&a.q_norm, &a.k_norm) {
                    (Some(_), _) | (_, Some(_)) => Tensor::f_cat(
                        &[
                            heads(y.f_narrow(-1, 0, nq)?, nh, &a.q_norm)?,
                            heads(y.f_narrow(-1, nq, nkv)?, nkv_h, &a.k_norm)?,
                        ],
                        2,
                    )?,
                    (None, None) => {
                        y.f_narrow(-1, 0, nq + nkv)?
                            .f_reshape([b, t, nh + nkv_h, s.head_dim])?
                    }
                };
                let qk = rope.apply(&qk.f_transpose(1, 2)?)?;
                (
                    qk.f_narrow(1, 0, nh)?,
                    qk.f_narrow(1, nh, nkv_h)?,
                    heads(y.f_narrow(-1, nq + nkv, nkv)?, nkv_h, &None)?.f_transpose(1, 2)?,
                )
            }
            None => (
                rope.apply(&heads(a.q.forward(&h)?, nh, &a.q_norm)?.f_transpose(1, 2)?)?,
                rope.apply(&heads(a.k.forward(&h)?, nkv_h, &a.k_norm)?.f_transpose(1, 2)?)?,
                heads(a.v.forward(&h)?, nkv_h, &None)?.f_transpose(1, 2)?,
            ),
        };
        let y = attend(q, k, v)?
            .f_transpose(1, 2)?
            .f_reshape([b, t, s.num_heads * s.head_dim])?;
        let x = x.f_add(&a.o.forward(&y)?)?;
        let h = rms_norm(&x, &layer.post_norm, s.rms_norm_eps)?;
        let m = &layer.mlp;
        let (g, u) = match &m.gate_up {
            Some(gu) => {
                let y = gu.forward(&h)?;
                let i = s.intermediate_size;
                (y.f_narrow(-1, 0, i)?, y.f_narrow(-1, i, i)?)
            }
            None => (m.gate.forward(&h)?, m.up.forward(&h)?),
        };
        let y = m.down.forward(&g.f_silu()?.f_mul(&u)?)?;
        Ok(x.f_add(&y)?)
    }

    /// Final hidden states `[batch, seq, hidden]` for `ids` (`[batch, seq]`, Int64),
    /// causal. With a cache, `ids` continue the cached positions and the cache grows.
    pub fn forward_hidden(&self, ids: &Tensor, cache: Option<&mut KvCache>) -> Result<Tensor> {
        self.forward_inner(ids, cache, None)
    }

    /// Like [`Model::forward_hidden`] for a batch of rows of different lengths, padded on
    /// the left: `left_pad[i]` positions at the start of row `i` (counted from the start
    /// of the cache) are padding. They are masked out of attention and do not count as
    /// positions, so each row computes exactly what it would alone.
    pub fn forward_hidden_padded(
        &self,
        ids: &Tensor,
        left_pad: &[i64],
        cache: Option<&mut KvCache>,
    ) -> Result<Tensor> {
        self.forward_inner(ids, cache, Some(left_pad))
    }

    fn forward_inner(
        &self,
        ids: &Tensor,
        mut cache: Option<&mut KvCache>,
        left_pad: Option<&[i64]>,
    ) -> Result<Tensor> {
        let size = ids.size();
        let [b, t] = size[..] else {
            return Err(TrainerError::invalid(format!(
                "model input must be [batch, seq] token ids, got shape {size:?}"
            )));
        };
        let past = cache.as_ref().map(|c| c.len()).unwrap_or(0);
        if let Some(c) = cache.as_deref_mut()
            && c.layers.len() != self.layers.len()
        {
            c.layers = (0..self.layers.len()).map(|_| None).collect();
        }
        let dev = self.device;
        let abs = Tensor::f_arange_start(past, past + t, (Kind::Int64, dev))?;
        let (rope, mask, is_causal) = match left_pad {
            None => {
                let rope = self.rope_for(&abs.f_unsqueeze(0)?)?;
                // Causal mask only where SDPA's is_causal (top-left aligned) would be wrong.
                let mask = if past > 0 && t > 1 {
                    let i = abs.f_unsqueeze(1)?;
                    let j = Tensor::f_arange(past + t, (Kind::Int64, dev))?.f_unsqueeze(0)?;
                    Some(j.f_le_tensor(&i)?)
                } else {
                    None
                };
                (rope, mask, past == 0 && t > 1)
            }
            Some(pad) => {
                if pad.len() as i64 != b {
                    return Err(TrainerError::invalid(format!(
                        "left_pad has {} entries for a batch of {b}",
                        pad.len()
                    )));
                }
                let pad = Tensor::from_slice(pad).f_to_device(dev)?.f_view([b, 1])?;
                let pos = abs.f_unsqueeze(0)?.f_sub(&pad)?.f_clamp_min(0)?;
                let rope = self.rope_for(&pos)?;
                // [b, 1, t, S]: causal, not padding; a padding query sees itself (no NaN).
                let q = abs.f_view([1, t, 1])?;
                let k = Tensor::f_arange(past + t, (Kind::Int64, dev))?.f_view([1, 1, past + t])?;
                let causal = k.f_le_tensor(&q)?;
                let real = k.f_ge_tensor(&pad.f_view([b, 1, 1])?)?;
                let mask = causal
                    .f_logical_and(&real)?
                    .f_logical_or(&k.f_eq_tensor(&q)?)?;
                (rope, Some(mask.f_unsqueeze(1)?), false)
            }
        };
        let gqa = self.spec.num_heads != self.spec.num_kv_heads;
        let mut x = self.embed(ids)?;
        for (li, layer) in self.layers.iter().enumerate() {
            let slot = cache.as_deref_mut().and_then(|c| c.layers.get_mut(li));
            x = self.block(layer, &x, &rope, |q, mut k, mut v| {
                if let Some(slot) = slot {
                    match slot {
                        Some(layer) => (k, v) = layer.append(&k, &v)?,
                        None => *slot = Some(LayerKv::whole(k.shallow_clone(), v.shallow_clone())),
                    }
                }
                Ok(Tensor::f_scaled_dot_product_attention(
                    &q,
                    &k,
                    &v,
                    mask.as_ref(),
                    0.0,
                    is_causal,
                    None,
                    gqa,
                )?)
            })?;
        }
        self.final_norm(&x)
    }

    /// Prefills `ids` (`[n, t]`, rows padded on the right; row `i`'s real length
    /// `lens[i]`) into slots `first..first + n` of `cache` from position 0, and returns the
    /// final hidden state at each row's last real position (`[n, hidden]`). Causal, no
    /// mask: a real position never sees the padding after it, and what the padding writes
    /// into the cache lies past the row's length (masked by [`Model::decode_slots`], then
    /// overwritten).
    pub fn prefill_slots(
        &self,
        ids: &Tensor,
        lens: &[i64],
        cache: &mut SlotCache,
        first: i64,
    ) -> Result<Tensor> {
        let size = ids.size();
        let [n, t] = size[..] else {
            return Err(TrainerError::invalid(format!(
                "prefill input must be [rows, seq] token ids, got shape {size:?}"
            )));
        };
        if lens.len() as i64 != n || lens.iter().any(|&l| l < 1 || l > t) {
            return Err(TrainerError::invalid(format!(
                "prefill lengths {lens:?} do not fit a [{n}, {t}] input"
            )));
        }
        self.ensure_slots(cache, first + n, t)?;
        let rope =
            self.rope_for(&Tensor::f_arange(t, (Kind::Int64, self.device))?.f_unsqueeze(0)?)?;
        let mut x = self.embed(ids)?;
        for (li, layer) in self.layers.iter().enumerate() {
            let (ck, cv) = (&cache.k[li], &cache.v[li]);
            x = self.block(layer, &x, &rope, |q, k, v| {
                ck.f_narrow(0, first, n)?.f_narrow(2, 0, t)?.f_copy_(&k)?;
                cv.f_narrow(0, first, n)?.f_narrow(2, 0, t)?.f_copy_(&v)?;
                self.causal_attention(&q, &k, &v)
            })?;
        }
        let last: Vec<i64> = lens
            .iter()
            .enumerate()
            .map(|(i, &l)| i as i64 * t + l - 1)
            .collect();
        let idx = Tensor::from_slice(&last).f_to_device(self.device)?;
        let x = x.f_reshape([n * t, -1])?.f_index_select(0, &idx)?;
        self.final_norm(&x)
    }

    /// One decode step for slots `0..b` of `cache`: `ids` (`[b]`) are the next token of
    /// each row, `lens` (`[b]`, Int64, on the model's device) how many positions each row
    /// has cached (its new token's position), `longest` the largest of them. Each row's
    /// keys and values are written at its own position and it attends to its own
    /// positions only; nothing of the cache is copied. Returns the final hidden states
    /// `[b, hidden]`.
    pub fn decode_slots(
        &self,
        ids: &Tensor,
        lens: &Tensor,
        longest: i64,
        cache: &mut SlotCache,
    ) -> Result<Tensor> {
        let b = ids.size().first().copied().unwrap_or(0);
        self.ensure_slots(cache, b, longest + 1)?;
        let s = &self.spec;
        let dev = self.device;
        let span = longest + 1;
        let rope = self.rope_for(&lens.f_view([b, 1])?)?;
        // [b, 1, 1, span]: 0 where a row has a position (its new one included), -inf past it.
        let cols = Tensor::f_arange(span, (Kind::Int64, dev))?.f_view([1, span])?;
        let past = cols.f_gt_tensor(&lens.f_view([b, 1])?)?;
        let group = s.num_heads / s.num_kv_heads;
        // One copy per kv head and query head of a group, as the batched product wants it.
        let mask = Tensor::f_zeros([b, span], (self.kind, dev))?
            .f_masked_fill(&past, f64::NEG_INFINITY)?
            .f_view([b, 1, 1, span])?
            .f_expand([b, s.num_kv_heads, group, span], false)?
            .f_reshape([b * s.num_kv_heads, group, span])?;
        let rows = Tensor::f_arange(b, (Kind::Int64, dev))?;
        let scale = 1.0 / (s.head_dim as f64).sqrt();
        let mut x = self.embed(&ids.f_view([b, 1])?)?;
        for (li, layer) in self.layers.iter().enumerate() {
            let (mut ck, mut cv) = (cache.k[li].shallow_clone(), cache.v[li].shallow_clone());
            x = self.block(layer, &x, &rope, |q, k, v| {
                let at = [Some(rows.shallow_clone()), None, Some(lens.shallow_clone())];
                let _ = ck.f_index_put_(&at, &k.f_squeeze_dim(2)?, false)?;
                let _ = cv.f_index_put_(&at, &v.f_squeeze_dim(2)?, false)?;
                let k = ck.f_narrow(0, 0, b)?.f_narrow(2, 0, span)?;
                let v = cv.f_narrow(0, 0, b)?.f_narrow(2, 0, span)?;
                // GQA without repeating keys: each kv head's query heads become its
                // "positions" (one query token each, all seeing the same keys). Written
                // out (scores, mask and scale in one batched product, a softmax accumulated
                // in f32, a second product) rather than through SDPA: on CUDA, SDPA may pick
                // cuDNN's attention, which plans anew for every key length, i.e. every
                // decode step (~50 ms each on an H200). The cache's views flatten to
                // [b·kv_heads, len, head_dim] without a copy.
                let q = q.f_reshape([b * s.num_kv_heads, group, s.head_dim])?;
                let k = k.f_reshape([b * s.num_kv_heads, span, s.head_dim])?;
                let v = v.f_reshape([b * s.num_kv_heads, span, s.head_dim])?;
                let scores = mask.f_baddbmm(&q, &k.f_transpose(1, 2)?, 1.0, scale)?;
                let y = scores.f_softmax(-1, self.kind)?.f_bmm(&v)?;
                Ok(y.f_reshape([b, s.num_heads, 1, s.head_dim])?)
            })?;
        }
        self.final_norm(&x.f_view([b, -1])?)
    }

    /// Makes room in `cache` for `rows` slots of `cols` positions; growing copies what is
    /// there (rows double, positions grow by half: amortised O(1) per position).
    fn ensure_slots(&self, cache: &mut SlotCache, rows: i64, cols: i64) -> Result<()> {
        let (have_rows, have_cols) = cache.capacity();
        if rows <= have_rows && cols <= have_cols && cache.k.len() == self.layers.len() {
            return Ok(());
        }
        let new_rows = if rows > have_rows {
            rows.max(have_rows * 2)
        } else {
            have_rows
        };
        let new_cols = if cols > have_cols {
            (cols + cols / 2 + 15) / 16 * 16
        } else {
            have_cols
        };
        let s = &self.spec;
        let shape = [new_rows, s.num_kv_heads, new_cols, s.head_dim];
        let grow = |old: Option<&Tensor>| -> Result<Tensor> {
            let buf = Tensor::f_zeros(shape, (self.kind, self.device))?;
            if let Some(old) = old {
                buf.f_narrow(0, 0, have_rows)?
                    .f_narrow(2, 0, have_cols)?
                    .f_copy_(old)?;
            }
            Ok(buf)
        };
        let n = self.layers.len();
        let keep = cache.k.len() == n;
        cache.k = (0..n)
            .map(|l| grow(if keep { cache.k.get(l) } else { None }))
            .collect::<Result<_>>()?;
        cache.v = (0..n)
            .map(|l| grow(if keep { cache.v.get(l) } else { None }))
            .collect::<Result<_>>()?;
        Ok(())
    }

    /// Logits `[.., vocab]` for hidden states, in the compute dtype.
    pub fn logits(&self, hidden: &Tensor) -> Result<Tensor> {
        linear(hidden, &self.lm_head, None)
    }

    /// The lm_head weight `[vocab, hidden]` (the embedding when tied).
    pub fn lm_head(&self) -> &Tensor {
        &self.lm_head
    }

    /// Full-sequence forward (training): logits `[batch, seq, vocab]`, causal.
    pub fn forward(&self, ids: &Tensor) -> Result<Tensor> {
        self.logits(&self.forward_hidden(ids, None)?)
    }

    /// Incremental forward (generation): `ids` continue what `cache` holds; returns their
    /// logits and extends the cache.
    pub fn forward_step(&self, ids: &Tensor, cache: &mut KvCache) -> Result<Tensor> {
        self.logits(&self.forward_hidden(ids, Some(cache))?)
    }
}

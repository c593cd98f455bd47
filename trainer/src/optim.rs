//! AdamW over fp32 master weights. The model computes in its own dtype (bf16 on CUDA);
//! the optimizer keeps an fp32 copy of every parameter and its moments, updates those,
//! and copies the result back into the model. Gradients are clipped by their global norm;
//! a step whose gradients are not finite is skipped (nothing changes, the step is counted
//! as skipped). State is saved to and restored from safetensors, one entry per parameter.
//!
//! Layout: the parameters of one dtype and device live end to end in one flat buffer
//! ([`Flat`]), and so do their gradients, fp32 masters and moments; every parameter, its
//! gradient and its slices of the state are views of those. [`AdamW::new`] moves each
//! parameter's storage there with `set_data` (the tensors handed in, and every shallow
//! clone of them such as the model's own, keep their identity and values), and the first
//! gradients autograd allocates are moved there the same way (autograd then accumulates
//! into them in place). So one step is a fixed handful of element-wise kernels per chunk
//! of `CHUNK` elements (about 11), not a dozen per parameter, and the gradient norm is
//! one reduction per buffer with one host sync. Parameters that take weight decay come
//! first in their buffer, so decay is one multiply over that region.
//!
//! The update is PyTorch's AdamW (decoupled decay, bias-corrected moments) in fp32:
//! `m ← β1·m + (1−β1)·g`, `v ← β2·v + (1−β2)·g²`, `w ← w·(1 − lr·wd)` (matrices),
//! `w ← w − lr·(m / (1−β1^t)) / (√(v / (1−β2^t)) + eps)`. A parameter whose gradient was
//! never computed counts as a zero gradient (its moments decay, weight decay applies).

use std::path::Path;

use tch::{Device, Kind, Tensor};

use crate::error::{Result, TrainerError};

/// Elements per chunk of the update: bounds its fp32 scratch (one chunk, 128 MiB) while
/// keeping each kernel large enough that launches do not count.
const CHUNK: i64 = 1 << 25;

/// Each parameter starts at a multiple of this many elements of its buffer (256 bytes at
/// bf16), so its view is as aligned as a tensor of its own for the matmul libraries.
const ALIGN: i64 = 128;

/// AdamW's knobs.
#[derive(Debug, Clone, PartialEq)]
pub struct AdamWConfig {
    pub lr: f64,
    pub beta1: f64,
    pub beta2: f64,
    pub eps: f64,
    /// Decoupled weight decay, applied to matrices only (not norms, biases).
    pub weight_decay: f64,
    /// Global gradient-norm clip (0: off).
    pub max_grad_norm: f64,
}

impl Default for AdamWConfig {
    fn default() -> Self {
        AdamWConfig {
            lr: 1e-6,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 0.01,
            max_grad_norm: 1.0,
        }
    }
}

/// The parameters of one dtype and device laid end to end, with their gradients and
/// state in the same layout.
struct Flat {
    /// The parameters' storage (their dtype).
    params: Tensor,
    /// Their gradients (their dtype).
    grads: Tensor,
    /// fp32 masters and moments.
    master: Tensor,
    m: Tensor,
    v: Tensor,
    /// `[0, decay_end)` holds the parameters that take weight decay.
    decay_end: i64,
    len: i64,
}

/// One parameter: views of its [`Flat`].
struct Slot {
    name: String,
    /// The model's tensor (its storage is a view of `Flat::params`).
    param: Tensor,
    /// Where its gradient lives once adopted.
    grad: Tensor,
    master: Tensor,
    m: Tensor,
    v: Tensor,
}

/// What one [`AdamW::step`] did.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct StepOutcome {
    /// Global L2 norm of the gradients before clipping.
    pub grad_norm: f64,
    /// True when the gradients were not finite and nothing was updated.
    pub skipped: bool,
}

/// AdamW with fp32 master weights over a model's named parameters.
pub struct AdamW {
    pub config: AdamWConfig,
    flats: Vec<Flat>,
    slots: Vec<Slot>,
    /// Updates applied so far (skipped steps not counted).
    pub steps: i64,
    /// Steps skipped for non-finite gradients.
    pub skipped: i64,
}

impl std::fmt::Debug for AdamW {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AdamW")
            .field("config", &self.config)
            .field("params", &self.slots.len())
            .field("buffers", &self.flats.len())
            .field("steps", &self.steps)
            .finish_non_exhaustive()
    }
}

fn round_up(n: i64) -> i64 {
    (n + ALIGN - 1) / ALIGN * ALIGN
}

impl AdamW {
    /// Takes the parameters to train (they get `requires_grad`, and their storage moves
    /// into the optimizer's flat buffer: values, shapes and tensor identity stay).
    pub fn new(params: Vec<(String, Tensor)>, config: AdamWConfig) -> Result<AdamW> {
        // Grouped by dtype and device, in order; within a group decayed ones first.
        type Member = (String, Tensor, bool);
        let mut groups: Vec<(Kind, Device, Vec<Member>)> = Vec::new();
        for (name, p) in params {
            let p = p.set_requires_grad(true);
            let decay = p.dim() >= 2 && !name.contains("embed_tokens");
            let key = (p.kind(), p.device());
            match groups.iter_mut().find(|g| (g.0, g.1) == key) {
                Some(g) => g.2.push((name, p, decay)),
                None => groups.push((key.0, key.1, vec![(name, p, decay)])),
            }
        }
        let mut flats = Vec::with_capacity(groups.len());
        let mut slots = Vec::new();
        for (kind, device, mut members) in groups {
            members.sort_by_key(|(_, _, decay)| !decay);
            let mut offsets = Vec::with_capacity(members.len());
            let (mut len, mut decay_end) = (0i64, 0i64);
            for (_, p, decay) in &members {
                let at = round_up(len);
                offsets.push(at);
                len = at + p.numel() as i64;
                if *decay {
                    decay_end = len;
                }
            }
            let zeros = |k: Kind| Tensor::f_zeros([len], (k, device));
            let flat = Flat {
                params: zeros(kind)?,
                grads: zeros(kind)?,
                master: zeros(Kind::Float)?,
                m: zeros(Kind::Float)?,
                v: zeros(Kind::Float)?,
                decay_end,
                len,
            };
            for ((name, mut p, _), at) in members.into_iter().zip(offsets) {
                let (shape, numel) = (p.size(), p.numel() as i64);
                let view = |t: &Tensor| -> Result<Tensor> {
                    Ok(t.f_narrow(0, at, numel)?.f_view(shape.as_slice())?)
                };
                let (param, master) = (view(&flat.params)?, view(&flat.master)?);
                tch::no_grad(|| -> Result<()> {
                    let value = p.f_detach()?;
                    param.shallow_clone().f_copy_(&value)?;
                    master.shallow_clone().f_copy_(&value)?;
                    Ok(())
                })?;
                p.f_set_data(&param)?;
                slots.push(Slot {
                    name,
                    param: p,
                    grad: view(&flat.grads)?,
                    master,
                    m: view(&flat.m)?,
                    v: view(&flat.v)?,
                });
            }
            flats.push(flat);
        }
        Ok(AdamW {
            config,
            flats,
            slots,
            steps: 0,
            skipped: 0,
        })
    }

    /// Moves gradients autograd allocated on its own (the first backward, or one with
    /// `create_graph`) into the flat buffer, copying their values when `keep`.
    fn adopt_grads(&self, keep: bool) -> Result<()> {
        for s in &self.slots {
            let mut g = s.param.grad();
            if !g.defined() || g.data_ptr() == s.grad.data_ptr() {
                continue;
            }
            if keep {
                tch::no_grad(|| s.grad.shallow_clone().f_copy_(&g))?;
            }
            g.f_set_data(&s.grad)?;
        }
        Ok(())
    }

    /// Clears every gradient.
    pub fn zero_grad(&mut self) -> Result<()> {
        self.adopt_grads(false)?;
        for f in &self.flats {
            let _ = f.grads.shallow_clone().f_zero_()?;
        }
        Ok(())
    }

    /// Global L2 norm of the current gradients, in f64.
    pub fn grad_norm(&self) -> Result<f64> {
        self.adopt_grads(true)?;
        let mut total = 0.0f64;
        for f in &self.flats {
            let n = f
                .grads
                .f_norm_scalaropt_dtype(2.0, Kind::Float)?
                .f_double_value(&[])?;
            total += n * n;
        }
        Ok(total.sqrt())
    }

    /// Clips and applies the accumulated gradients, then clears them. Non-finite
    /// gradients skip the update.
    pub fn step(&mut self) -> Result<StepOutcome> {
        let grad_norm = self.grad_norm()?;
        if !grad_norm.is_finite() {
            self.skipped += 1;
            self.zero_grad()?;
            tracing::warn!(
                step = self.steps,
                "optimizer: non-finite gradients, step skipped"
            );
            return Ok(StepOutcome {
                grad_norm,
                skipped: true,
            });
        }
        let c = self.config.clone();
        let scale = if c.max_grad_norm > 0.0 && grad_norm > c.max_grad_norm {
            c.max_grad_norm / (grad_norm + 1e-6)
        } else {
            1.0
        };
        self.steps += 1;
        let t = self.steps as f64;
        let bc1 = 1.0 - c.beta1.powf(t);
        let bc2 = 1.0 - c.beta2.powf(t);
        tch::no_grad(|| -> Result<()> {
            for f in &self.flats {
                f.update(&c, scale, bc1, bc2)?;
            }
            Ok(())
        })?;
        self.zero_grad()?;
        Ok(StepOutcome {
            grad_norm,
            skipped: false,
        })
    }

    /// Saves masters, moments and counters to `path` (one safetensors file).
    pub fn save(&self, path: &Path) -> Result<()> {
        let mut tensors = Vec::with_capacity(self.slots.len() * 3 + 1);
        for s in &self.slots {
            tensors.push((format!("master/{}", s.name), s.master.shallow_clone()));
            tensors.push((format!("m/{}", s.name), s.m.shallow_clone()));
            tensors.push((format!("v/{}", s.name), s.v.shallow_clone()));
        }
        tensors.push((
            "steps".to_owned(),
            Tensor::from_slice(&[self.steps, self.skipped]),
        ));
        crate::weights::write_file(&tensors, None, path)
    }

    /// Restores what [`AdamW::save`] wrote, and copies the masters into the model.
    pub fn load(&mut self, path: &Path) -> Result<()> {
        let mut t = crate::weights::read_file(path)?;
        let bad = |problem: String| TrainerError::Weights {
            path: path.to_path_buf(),
            problem,
        };
        for s in &self.slots {
            for (prefix, dst) in [("master", &s.master), ("m", &s.m), ("v", &s.v)] {
                let key = format!("{prefix}/{}", s.name);
                let src = t
                    .remove(&key)
                    .ok_or_else(|| bad(format!("has no '{key}'; was it saved from this model?")))?;
                if src.size() != dst.size() {
                    return Err(bad(format!(
                        "'{key}' has shape {:?}, the model {:?}",
                        src.size(),
                        dst.size()
                    )));
                }
                tch::no_grad(|| dst.shallow_clone().f_copy_(&src))?;
            }
        }
        tch::no_grad(|| -> Result<()> {
            for f in &self.flats {
                f.params.shallow_clone().f_copy_(&f.master)?;
            }
            Ok(())
        })?;
        let steps = t
            .remove("steps")
            .ok_or_else(|| bad("has no 'steps'".to_owned()))?;
        self.steps = steps.f_int64_value(&[0])?;
        self.skipped = steps.f_int64_value(&[1])?;
        Ok(())
    }
}

impl Flat {
    /// One AdamW update of the whole buffer (see the module doc), chunk by chunk, under
    /// `no_grad`. Leaves garbage in `grads` (the caller zeroes them).
    fn update(&self, c: &AdamWConfig, scale: f64, bc1: f64, bc2: f64) -> Result<()> {
        let regions = [(0, self.decay_end, true), (self.decay_end, self.len, false)];
        for (start, end, decay) in regions {
            let mut at = start;
            while at < end {
                let n = CHUNK.min(end - at);
                let view = |t: &Tensor| t.f_narrow(0, at, n);
                let grad = view(&self.grads)?;
                // The fp32 gradient; an f32 model's own (it is zeroed after the step).
                let mut g = if grad.kind() == Kind::Float {
                    grad
                } else {
                    grad.f_to_kind(Kind::Float)?
                };
                if scale != 1.0 {
                    let _ = g.f_mul_scalar_(scale)?;
                }
                let mut m = view(&self.m)?;
                let _ = m.f_lerp_(&g, 1.0 - c.beta1)?;
                let _ = g.f_square_()?;
                let mut v = view(&self.v)?;
                let _ = v.f_lerp_(&g, 1.0 - c.beta2)?;
                let mut master = view(&self.master)?;
                if decay && c.weight_decay != 0.0 {
                    let _ = master.f_mul_scalar_(1.0 - c.lr * c.weight_decay)?;
                }
                if c.lr != 0.0 {
                    // d = −(√v / √bc2 + eps) · bc1 / lr, so that
                    // w + m / d = w − lr · (m / bc1) / (√(v / bc2) + eps).
                    let _ = v.f_sqrt_out(&g)?;
                    let _ = g.f_mul_scalar_(-bc1 / (c.lr * bc2.sqrt()))?;
                    let _ = g.f_add_scalar_(-c.eps * bc1 / c.lr)?;
                    let _ = master.f_addcdiv_(&m, &g)?;
                }
                view(&self.params)?.f_copy_(&master)?;
                at += n;
            }
        }
        Ok(())
    }
}

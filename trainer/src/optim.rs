//! AdamW over fp32 master weights. The model computes in its own dtype (bf16 on CUDA);
//! the optimizer keeps an fp32 copy of every parameter and its moments, updates those,
//! and copies the result back into the model. Gradients are clipped by their global norm;
//! a step whose gradients are not finite is skipped (nothing changes, the step is counted
//! as skipped). State is saved to and restored from safetensors.

use std::path::Path;

use tch::{Kind, Tensor};

use crate::error::{Result, TrainerError};

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

struct Slot {
    name: String,
    param: Tensor,
    master: Tensor,
    m: Tensor,
    v: Tensor,
    decay: bool,
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
            .field("steps", &self.steps)
            .finish_non_exhaustive()
    }
}

impl AdamW {
    /// Takes the parameters to train (they get `requires_grad`).
    pub fn new(params: Vec<(String, Tensor)>, config: AdamWConfig) -> Result<AdamW> {
        let mut slots = Vec::with_capacity(params.len());
        for (name, p) in params {
            let p = p.set_requires_grad(true);
            // A fresh copy: the master must not share storage with an f32 parameter.
            let master = tch::no_grad(|| -> Result<Tensor> {
                let mut m = Tensor::f_empty(p.size(), (Kind::Float, p.device()))?;
                m.f_copy_(&p.f_detach()?)?;
                Ok(m)
            })?;
            let m = Tensor::f_zeros_like(&master)?;
            let v = Tensor::f_zeros_like(&master)?;
            let decay = p.dim() >= 2 && !name.contains("embed_tokens");
            slots.push(Slot {
                name,
                param: p,
                master,
                m,
                v,
                decay,
            });
        }
        Ok(AdamW {
            config,
            slots,
            steps: 0,
            skipped: 0,
        })
    }

    /// Clears every gradient.
    pub fn zero_grad(&mut self) -> Result<()> {
        for s in &mut self.slots {
            let mut g = s.param.grad();
            if g.defined() {
                let _ = g.f_zero_()?;
            }
        }
        Ok(())
    }

    /// Global L2 norm of the current gradients, in f64.
    pub fn grad_norm(&self) -> Result<f64> {
        let mut total = 0.0f64;
        for s in &self.slots {
            let g = s.param.grad();
            if g.defined() {
                let n = g.f_to_kind(Kind::Float)?.f_norm()?.f_double_value(&[])?;
                total += n * n;
            }
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
            for s in &mut self.slots {
                let g = s.param.grad();
                if !g.defined() {
                    continue;
                }
                let g = g.f_to_kind(Kind::Float)?.f_mul_scalar(scale)?;
                s.m =
                    s.m.f_mul_scalar(c.beta1)?
                        .f_add(&g.f_mul_scalar(1.0 - c.beta1)?)?;
                s.v =
                    s.v.f_mul_scalar(c.beta2)?
                        .f_add(&g.f_square()?.f_mul_scalar(1.0 - c.beta2)?)?;
                if s.decay && c.weight_decay != 0.0 {
                    s.master = s.master.f_mul_scalar(1.0 - c.lr * c.weight_decay)?;
                }
                let denom = s.v.f_div_scalar(bc2)?.f_sqrt()?.f_add_scalar(c.eps)?;
                let update = s.m.f_div_scalar(bc1)?.f_div(&denom)?.f_mul_scalar(c.lr)?;
                s.master = s.master.f_sub(&update)?;
                s.param.f_copy_(&s.master.f_to_kind(s.param.kind())?)?;
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
        for s in &mut self.slots {
            for (prefix, dst) in [("master", &mut s.master), ("m", &mut s.m), ("v", &mut s.v)] {
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
                *dst = src.f_to_kind(Kind::Float)?.f_to_device(dst.device())?;
            }
            tch::no_grad(|| s.param.f_copy_(&s.master.f_to_kind(s.param.kind())?))?;
        }
        let steps = t
            .remove("steps")
            .ok_or_else(|| bad("has no 'steps'".to_owned()))?;
        self.steps = steps.f_int64_value(&[0])?;
        self.skipped = steps.f_int64_value(&[1])?;
        Ok(())
    }
}

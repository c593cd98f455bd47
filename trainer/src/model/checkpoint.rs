//! Activation checkpointing by decoder layer: the training forward keeps only each layer's
//! input, and the backward recomputes one layer at a time from it.
//!
//! libtorch's C++ API has no `torch.utils.checkpoint` and tch no custom autograd function,
//! so the backward is driven by hand:
//! 1. [`Model::forward_checkpointed`]: the embedding and every layer under `no_grad`,
//!    keeping each layer's input (`[batch, seq, hidden]`, the compute dtype); the last
//!    layer's output becomes a leaf that requires grad ([`Checkpointed::last`]).
//! 2. The caller builds the final norm, the head and the loss on that leaf with autograd and
//!    calls `backward()`: the head's parameters get their gradients, the leaf its own.
//! 3. [`Checkpointed::backward`]: from the last layer to the first, the layer is recomputed
//!    from its saved input (detached, requiring grad) and `Σ out · grad_out` is
//!    backpropagated, so the layer's parameters accumulate their gradients and the input's
//!    gradient becomes the next `grad_out`; then the embedding the same way.
//!
//! Memory: one `[batch, seq, hidden]` tensor per layer plus one layer's activations at a
//! time, instead of every layer's activations. Cost: the layers' forward runs twice. The
//! gradients are the plain backward's: the same kernels on the same inputs (only the order
//! in which a tied embedding's two gradients add up can differ).

use tch::{Kind, Tensor};

use super::{Model, Rope};
use crate::error::{Result, TrainerError};

/// A forward that kept only the layers' inputs ([`Model::forward_checkpointed`]).
pub struct Checkpointed {
    ids: Tensor,
    rope: Rope,
    /// Layer `i`'s input (`inputs[0]`: the embeddings), without autograd history.
    inputs: Vec<Tensor>,
    /// The last layer's output: a leaf that requires grad.
    last: Tensor,
}

impl std::fmt::Debug for Checkpointed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Checkpointed")
            .field("layers", &self.inputs.len())
            .field("last", &self.last.size())
            .finish_non_exhaustive()
    }
}

impl Model {
    /// The layers of the training forward over `ids` (`[batch, seq]`, causal, no cache)
    /// without autograd, keeping each layer's input for [`Checkpointed::backward`]. The
    /// final norm and the head are the caller's, on [`Checkpointed::last`].
    pub fn forward_checkpointed(&self, ids: &Tensor) -> Result<Checkpointed> {
        let size = ids.size();
        let [_, t] = size[..] else {
            return Err(TrainerError::invalid(format!(
                "model input must be [batch, seq] token ids, got shape {size:?}"
            )));
        };
        let positions = Tensor::f_arange(t, (Kind::Int64, self.device()))?.f_unsqueeze(0)?;
        let rope = self.rope_for(&positions)?;
        let (inputs, last) = tch::no_grad(|| -> Result<(Vec<Tensor>, Tensor)> {
            let mut x = self.embed(ids)?;
            let mut inputs = Vec::with_capacity(self.num_layers());
            for li in 0..self.num_layers() {
                let y = self.layer(li, &x, &rope)?;
                inputs.push(x);
                x = y;
            }
            Ok((inputs, x))
        })?;
        Ok(Checkpointed {
            ids: ids.shallow_clone(),
            rope,
            inputs,
            last: last.f_set_requires_grad(true)?,
        })
    }
}

impl Checkpointed {
    /// The last layer's output (`[batch, seq, hidden]`, before the final norm): the leaf
    /// the head and the loss build on.
    pub fn last(&self) -> &Tensor {
        &self.last
    }

    /// After the loss's `backward()` reached [`Checkpointed::last`]: recomputes each layer
    /// and backpropagates through it, last to first, then through the embedding; the
    /// model's parameters accumulate their gradients as a plain backward would.
    pub fn backward(mut self, model: &Model) -> Result<()> {
        let mut grad = self.last.grad();
        if !grad.defined() {
            return Err(TrainerError::invalid(
                "checkpointed backward: the last hidden state has no gradient; call backward() on a loss built on Checkpointed::last first",
            ));
        }
        while let Some(saved) = self.inputs.pop() {
            let li = self.inputs.len();
            let x = saved.f_detach()?.f_set_requires_grad(true)?;
            drop(saved);
            let y = model.layer(li, &x, &self.rope)?;
            y.f_mul(&grad)?.f_sum(Kind::Float)?.f_backward()?;
            grad = x.grad();
        }
        let e = model.embed(&self.ids)?;
        if e.requires_grad() {
            e.f_mul(&grad)?.f_sum(Kind::Float)?.f_backward()?;
        }
        Ok(())
    }
}

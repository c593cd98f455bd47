//! Sampling with the KV cache: a batch of equal-length prompts, temperature sampling,
//! and the logprob of each sampled token under the sampling distribution (what an
//! inference engine returns as `output_token_logprobs`).

use tch::{Kind, Tensor};

use crate::error::{Result, TrainerError};
use crate::model::{KvCache, Model};

/// What [`sample`] produced per prompt.
#[derive(Debug, Clone, PartialEq)]
pub struct Generation {
    pub tokens: Vec<i64>,
    /// `log_softmax(logits / temperature)` of each sampled token, f32.
    pub logprobs: Vec<f32>,
}

/// Samples `max_new` tokens after each prompt (all prompts the same length) at
/// `temperature` (0: greedy), using tch's global RNG (seed it with `tch::manual_seed`).
pub fn sample(
    model: &Model,
    prompts: &[Vec<i64>],
    max_new: usize,
    temperature: f64,
) -> Result<Vec<Generation>> {
    let Some(first) = prompts.first() else {
        return Ok(Vec::new());
    };
    if prompts
        .iter()
        .any(|p| p.len() != first.len() || p.is_empty())
    {
        return Err(TrainerError::invalid(
            "sample() needs non-empty prompts of equal length",
        ));
    }
    let b = prompts.len() as i64;
    let flat: Vec<i64> = prompts.iter().flatten().copied().collect();
    let mut input = Tensor::from_slice(&flat)
        .f_reshape([b, first.len() as i64])?
        .f_to_device(model.device())?;
    let mut cache = KvCache::new();
    let mut out: Vec<Generation> = (0..b)
        .map(|_| Generation {
            tokens: Vec::new(),
            logprobs: Vec::new(),
        })
        .collect();
    tch::no_grad(|| -> Result<()> {
        for _ in 0..max_new {
            let logits = model.forward_step(&input, &mut cache)?;
            let last = logits.f_select(1, -1)?.f_to_kind(Kind::Float)?;
            let (next, lp) = if temperature > 0.0 {
                let lp = last
                    .f_div_scalar(temperature)?
                    .f_log_softmax(-1, Kind::Float)?;
                let next = lp.f_exp()?.f_multinomial(1, true)?;
                (next.shallow_clone(), lp.f_gather(-1, &next, false)?)
            } else {
                let lp = last.f_log_softmax(-1, Kind::Float)?;
                let next = last.f_argmax(-1, true)?;
                (next.shallow_clone(), lp.f_gather(-1, &next, false)?)
            };
            let ids: Vec<i64> =
                Vec::try_from(next.f_reshape([-1])?.f_to_device(tch::Device::Cpu)?)?;
            let lps: Vec<f32> = Vec::try_from(lp.f_reshape([-1])?.f_to_device(tch::Device::Cpu)?)?;
            for (g, (id, l)) in out.iter_mut().zip(ids.into_iter().zip(lps)) {
                g.tokens.push(id);
                g.logprobs.push(l);
            }
            input = next;
        }
        Ok(())
    })?;
    Ok(out)
}

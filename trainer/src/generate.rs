//! Sampling parameters, and the trainer's own sampler: a batch of prompts of any lengths
//! through the serving engine's batch ([`crate::batch`], [`crate::sampler`]), stop tokens,
//! and the logprob of each sampled token under `log_softmax((logits + bias) /
//! temperature)` (before top-k/top-p/min-p truncation), which is what the trainer
//! computes for the same token when there is no bias. [`sample_row`] is the same
//! distribution for one row, op by op, without batching: the reference the batched
//! sampler is tested against.

use tch::{Kind, Tensor};

use crate::batch::{Clock, Entry, Running};
use crate::error::{Result, TrainerError};
use crate::model::Model;

/// How to sample.
#[derive(Debug, Clone, PartialEq)]
pub struct SamplingParams {
    /// 0: greedy.
    pub temperature: f64,
    /// 1.0: off.
    pub top_p: f64,
    /// 0 or less: off.
    pub top_k: i64,
    /// Drops tokens less probable than `min_p` × the most probable one; 0: off.
    pub min_p: f64,
    /// (token id, bias) added to the logits before anything else (OpenAI's and SGLang's
    /// `logit_bias`); the logprobs are those of the biased distribution, the one sampled.
    pub logit_bias: Vec<(i64, f32)>,
    pub max_new_tokens: usize,
    /// Generation of a row ends after it samples one of these (it is kept in the output).
    pub stop_token_ids: Vec<i64>,
    /// Subtracted once per time a token was sampled in this request's output; 0: off.
    pub frequency_penalty: f64,
    /// Subtracted from tokens sampled at least once in the output; 0: off.
    pub presence_penalty: f64,
    /// Tokens seen in the prompt or the output: positive logits divided by it, negative
    /// ones multiplied; 1: off.
    pub repetition_penalty: f64,
    /// A seed makes the draw a function of (seed, tokens sampled so far, token id):
    /// the same tokens alone or batched with anything ([`crate::sampler`]).
    pub seed: Option<u64>,
}

impl Default for SamplingParams {
    fn default() -> Self {
        SamplingParams {
            temperature: 1.0,
            top_p: 1.0,
            top_k: 0,
            min_p: 0.0,
            logit_bias: Vec::new(),
            max_new_tokens: 128,
            stop_token_ids: Vec::new(),
            frequency_penalty: 0.0,
            presence_penalty: 0.0,
            repetition_penalty: 1.0,
            seed: None,
        }
    }
}

/// Why a row stopped.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Finish {
    /// It sampled a stop token.
    Stop,
    /// It reached `max_new_tokens`.
    Length,
}

/// What [`sample`] produced per prompt.
#[derive(Debug, Clone, PartialEq)]
pub struct Generation {
    pub tokens: Vec<i64>,
    /// `log_softmax(logits / temperature)` of each sampled token, f32 (plain
    /// `log_softmax(logits)` when greedy).
    pub logprobs: Vec<f32>,
    pub finish: Finish,
}

/// Samples `max_new` tokens after each prompt at `temperature` (0: greedy), using tch's
/// global RNG (seed it with `tch::manual_seed`).
pub fn sample(
    model: &Model,
    prompts: &[Vec<i64>],
    max_new: usize,
    temperature: f64,
) -> Result<Vec<Generation>> {
    let params = SamplingParams {
        temperature,
        max_new_tokens: max_new,
        ..SamplingParams::default()
    };
    sample_with(model, prompts, &params)
}

/// Keeps the top-k logits and the smallest set whose probability reaches top-p; the rest
/// become -inf.
fn truncate(logits: &Tensor, p: &SamplingParams) -> Result<Tensor> {
    let (top_k, top_p) = (p.top_k, p.top_p);
    let mut l = logits.shallow_clone();
    let vocab = l.size().last().copied().unwrap_or(0);
    if top_k > 0 && top_k < vocab {
        let (kth, _) = l.f_topk(top_k, -1, true, true)?;
        let floor = kth.f_narrow(-1, top_k - 1, 1)?;
        l = l.f_masked_fill(&l.f_lt_tensor(&floor)?, f64::NEG_INFINITY)?;
    }
    if top_p < 1.0 {
        let (sorted, idx) = l.f_sort(-1, true)?;
        let probs = sorted.f_softmax(-1, Kind::Float)?;
        let before = probs.f_cumsum(-1, Kind::Float)?.f_sub(&probs)?;
        let drop_sorted = before.f_gt(top_p)?;
        let drop = drop_sorted.f_scatter(-1, &idx, &drop_sorted)?;
        l = l.f_masked_fill(&drop, f64::NEG_INFINITY)?;
    }
    if p.min_p > 0.0 {
        // p_i < min_p · p_max  ⇔  l_i < l_max + ln(min_p).
        let (max, _) = l.f_max_dim(-1, true)?;
        let floor = max.f_add_scalar(p.min_p.ln())?;
        l = l.f_masked_fill(&l.f_lt_tensor(&floor)?, f64::NEG_INFINITY)?;
    }
    Ok(l)
}

/// The logits with `p.logit_bias` added (on every row).
fn biased(logits: &Tensor, p: &SamplingParams) -> Result<Tensor> {
    if p.logit_bias.is_empty() {
        return Ok(logits.shallow_clone());
    }
    let vocab = logits.size().last().copied().unwrap_or(0);
    let mut bias = vec![0f32; usize::try_from(vocab).unwrap_or(0)];
    for &(id, b) in &p.logit_bias {
        match usize::try_from(id).ok().and_then(|i| bias.get_mut(i)) {
            Some(x) => *x += b,
            None => {
                return Err(TrainerError::invalid(format!(
                    "logit_bias names token {id}, outside the vocabulary (0..{vocab})"
                )));
            }
        }
    }
    let bias = Tensor::from_slice(&bias)
        .f_to_device(logits.device())?
        .f_to_kind(logits.kind())?;
    Ok(logits.f_add(&bias)?)
}

/// One sampling step on logits `[.., vocab]` (f32): the next token(s) `[.., 1]` and the
/// logprob(s) of each under the distribution sampled from.
fn step(logits: &Tensor, p: &SamplingParams) -> Result<(Tensor, Tensor)> {
    let logits = biased(logits, p)?;
    let (next, lp) = if p.temperature > 0.0 {
        let scaled = logits.f_div_scalar(p.temperature)?;
        let lp = scaled.f_log_softmax(-1, Kind::Float)?;
        let probs = truncate(&scaled, p)?.f_softmax(-1, Kind::Float)?;
        (probs.f_multinomial(1, true)?, lp)
    } else {
        let lp = logits.f_log_softmax(-1, Kind::Float)?;
        (logits.f_argmax(-1, true)?, lp)
    };
    let chosen = lp.f_gather(-1, &next, false)?;
    Ok((next, chosen))
}

/// Samples one token from one row of logits (`[vocab]`, f32): the token and its
/// logprob under `log_softmax((logits + bias) / temperature)`.
pub fn sample_row(logits: &Tensor, p: &SamplingParams) -> Result<(i64, f32)> {
    let (next, chosen) = step(logits, p)?;
    Ok((
        next.f_int64_value(&[0])?,
        chosen.f_double_value(&[0])? as f32,
    ))
}

/// Samples after each prompt (any lengths) with the serving engine's batch
/// ([`crate::batch::Running`]): prompts prefilled together into cache slots, every row
/// sampled in one batched pass ([`crate::sampler`]); a row that stops leaves the batch.
pub fn sample_with(
    model: &Model,
    prompts: &[Vec<i64>],
    p: &SamplingParams,
) -> Result<Vec<Generation>> {
    if prompts.is_empty() {
        return Ok(Vec::new());
    }
    if prompts.iter().any(|p| p.is_empty()) {
        return Err(TrainerError::invalid("sample() needs non-empty prompts"));
    }
    let mut out: Vec<Generation> = (0..prompts.len())
        .map(|_| Generation {
            tokens: Vec::new(),
            logprobs: Vec::new(),
            finish: Finish::Length,
        })
        .collect();
    if p.max_new_tokens == 0 {
        return Ok(out);
    }
    tch::no_grad(|| -> Result<()> {
        let mut batch: Running<usize> = Running::new(model);
        let mut clock = Clock::start(false, model.device());
        let rows = prompts
            .iter()
            .enumerate()
            .map(|(i, prompt)| Entry {
                prompt: prompt.clone(),
                out: Vec::new(),
                params: p.clone(),
                tag: i,
            })
            .collect();
        let mut drawn = batch.admit(model, rows, &mut clock)?;
        loop {
            let mut keep = Vec::with_capacity(drawn.len());
            for (row, &(id, lp)) in batch.rows().iter().zip(&drawn) {
                let g = &mut out[row.tag];
                g.tokens.push(id);
                g.logprobs.push(lp);
                let stop = p.stop_token_ids.contains(&id);
                if stop {
                    g.finish = Finish::Stop;
                }
                keep.push(!stop && g.tokens.len() < p.max_new_tokens);
            }
            batch.retain(&keep)?;
            if batch.is_empty() {
                return Ok(());
            }
            drawn = batch.decode(model, &mut clock)?;
        }
    })?;
    Ok(out)
}

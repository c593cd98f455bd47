//! The GRPO objective: group-normalised advantages, the PPO ratio with an asymmetric clip,
//! a truncated importance weight between the trainer's π_old and the rollout engine's
//! logprobs (per token or per sequence), rejection of tokens or whole samples whose
//! trainer/rollout ratio leaves a bound (slime's TIS / MIS), an optional k3 KL to a
//! reference, and the token-mean over a whole optimizer step. Logprobs come from a temperature-scaled fp32 log-softmax computed in chunks of
//! positions.
//!
//! Rollout logprobs are compared like with like: a rollout engine that reports
//! pre-temperature logprobs (vLLM's default `raw_logprobs`) is compared with the trainer's
//! logprobs at temperature 1 ([`TokenInputs::compare_logp`]); the objective itself (the
//! PPO ratio's numerator, π_old in recompute mode, the KL term) stays at the run's
//! temperature.
//!
//! Alignment: every per-token tensor here is `[batch, seq]` aligned to the tokens, like a
//! `Sample`'s `logprobs`: entry `i` is about token `i` (its logprob given tokens `..i`);
//! entry 0 is never trained (it has no prefix).

use std::collections::HashMap;

use tch::{Kind, Tensor};

use crate::error::{Result, TrainerError};
use crate::model::Model;

/// Where π_old comes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PolicyMode {
    /// π_old = the rollout engine's logprobs (one optimizer step per batch, no extra
    /// forward); no importance weight.
    Bypass,
    /// π_old = the trainer's own logprobs before the step (a no-grad forward), and each
    /// token's loss is weighted by `min(exp(logp_old − logp_rollout), tis_cap)` to correct
    /// for the rollout engine's numerical drift.
    Recompute,
}

/// The objective's knobs.
#[derive(Debug, Clone, PartialEq)]
pub struct GrpoConfig {
    pub clip_low: f64,
    pub clip_high: f64,
    /// Cap of the truncated importance weight.
    pub tis_cap: f64,
    /// k3 KL coefficient (0: off, no reference needed).
    pub kl_coef: f64,
    /// Sampling temperature of the rollouts: logits are divided by it.
    pub temperature: f64,
    /// Positions per chunk of the fp32 log-softmax.
    pub logprob_chunk: i64,
    pub mode: PolicyMode,
    /// What the truncated importance weight is computed over (recompute mode only: in
    /// bypass mode the PPO ratio is already taken against the rollout logprobs).
    pub tis_level: Level,
    /// Rejection (masking) of tokens or samples whose trainer/rollout ratio lies outside
    /// `[low, high]`; `None`: nothing is rejected.
    pub reject: Option<Reject>,
}

/// Token level (each token its own ratio) or sequence level (one ratio per sample: the
/// geometric mean of its tokens' ratios, as slime's `geometric` mode).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Level {
    Token,
    Sequence,
}

/// The mismatch bound beyond which tokens (or samples) are left out of the loss.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Reject {
    pub level: Level,
    pub low: f64,
    pub high: f64,
}

impl Default for GrpoConfig {
    fn default() -> Self {
        GrpoConfig {
            clip_low: 0.2,
            clip_high: 0.28,
            tis_cap: 2.0,
            kl_coef: 0.0,
            temperature: 1.0,
            logprob_chunk: 1024,
            mode: PolicyMode::Bypass,
            tis_level: Level::Token,
            reject: None,
        }
    }
}

/// GRPO advantages: each reward minus its group's mean, over the group's standard
/// deviation (Bessel-corrected, as TRL and verl do) plus `eps`. A group of one, or one
/// whose rewards are all equal, gets 0 for every member (no signal).
pub fn group_advantages<G: AsRef<str>>(rewards: &[f64], groups: &[G], eps: f64) -> Vec<f64> {
    let mut by_group: HashMap<&str, Vec<usize>> = HashMap::new();
    for (i, g) in groups.iter().enumerate() {
        by_group.entry(g.as_ref()).or_default().push(i);
    }
    let mut adv = vec![0.0; rewards.len()];
    for members in by_group.values() {
        let n = members.len();
        if n < 2 {
            continue;
        }
        let mean = members.iter().map(|&i| rewards[i]).sum::<f64>() / n as f64;
        let var = members
            .iter()
            .map(|&i| (rewards[i] - mean).powi(2))
            .sum::<f64>()
            / (n - 1) as f64;
        let std = var.sqrt();
        if std == 0.0 {
            continue;
        }
        for &i in members {
            adv[i] = (rewards[i] - mean) / (std + eps);
        }
    }
    adv
}

/// Logprobs of `ids` (`[batch, seq]`) under `model`, aligned to the tokens (column 0 is
/// 0): `log_softmax(logits / temperature)` in fp32, computed `chunk` positions at a time.
pub fn token_logprobs(model: &Model, ids: &Tensor, temperature: f64, chunk: i64) -> Result<Tensor> {
    let hidden = model.forward_hidden(ids, None)?;
    hidden_logprobs(model, &hidden, ids, temperature, chunk)
}

/// [`token_logprobs`] from the final hidden states `hidden` (`[batch, seq, hidden]`, after
/// the final norm) of `ids`: the lm_head and the log-softmax, `chunk` positions at a time.
///
/// Per chunk the logits are upcast to fp32 once, divided by the temperature in place, and
/// go through libtorch's fused log-softmax, whose output is the one `[rows, chunk, vocab]`
/// fp32 tensor autograd keeps; the token's entry is gathered from it. (`gather(x) −
/// logsumexp(x)` is the same maths in more passes: libtorch's logsumexp is not one kernel,
/// its backward neither, and its input is kept instead; about 1.4× slower on the CPU.)
pub fn hidden_logprobs(
    model: &Model,
    hidden: &Tensor,
    ids: &Tensor,
    temperature: f64,
    chunk: i64,
) -> Result<Tensor> {
    let size = ids.size();
    let [b, t] = size[..] else {
        return Err(TrainerError::invalid(format!(
            "token ids must be [batch, seq], got {size:?}"
        )));
    };
    let zeros = Tensor::f_zeros([b, 1], (Kind::Float, ids.device()))?;
    if t < 2 {
        return Ok(zeros);
    }
    let h = hidden.f_narrow(1, 0, t - 1)?;
    let targets = ids.f_narrow(1, 1, t - 1)?;
    let w = model.lm_head().f_tr()?;
    let chunk = chunk.max(1);
    let mut parts = vec![zeros];
    let mut start = 0;
    while start < t - 1 {
        let len = chunk.min(t - 1 - start);
        let mut logits = h
            .f_narrow(1, start, len)?
            .f_matmul(&w)?
            .f_to_kind(Kind::Float)?;
        if temperature != 1.0 {
            let _ = logits.f_div_scalar_(temperature)?;
        }
        let lp = logits.f_log_softmax(-1, Kind::Float)?;
        let tgt = targets.f_narrow(1, start, len)?.f_unsqueeze(-1)?;
        parts.push(lp.f_gather(-1, &tgt, false)?.f_squeeze_dim(-1)?);
        start += len;
    }
    Ok(Tensor::f_cat(&parts, 1)?)
}

/// One micro-batch's per-token inputs, `[batch, seq]` f32, aligned to the tokens.
#[derive(Debug)]
pub struct TokenInputs<'a> {
    /// The trainer's current logprobs (with grad).
    pub logp: &'a Tensor,
    /// π_old: the rollout logprobs in bypass mode, the trainer's pre-step ones otherwise.
    pub old_logp: &'a Tensor,
    /// The rollout engine's logprobs.
    pub rollout_logp: &'a Tensor,
    /// The trainer's logprobs in the rollout logprobs' own convention (detached), the
    /// side `rollout_logp` is compared with (the truncated importance weight, rejection,
    /// `abs_gap`, `mismatch_kl`): at temperature 1 where the rollout engine reported
    /// pre-temperature logprobs (vLLM's `raw_logprobs`), at the run's temperature
    /// elsewhere. `None`: every rollout logprob is at the run's temperature, so the
    /// comparison side is π_old in recompute mode, the current policy (detached) in
    /// bypass mode.
    pub compare_logp: Option<&'a Tensor>,
    /// 1.0 where the rollout engine's logprob is known, 0.0 where it is not (the sample
    /// carried `None`); `None`: every one is known. The rollout/trainer statistics
    /// (`abs_gap`, `mismatch_kl`) are taken over known tokens only.
    pub known: Option<&'a Tensor>,
    /// Each token's advantage (its sequence's).
    pub advantages: &'a Tensor,
    /// 1.0 on trained tokens, 0.0 elsewhere.
    pub mask: &'a Tensor,
    /// Reference-policy logprobs, for the KL term.
    pub ref_logp: Option<&'a Tensor>,
}

/// Sums over a micro-batch's trained tokens, to be added up over the step.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct LossStats {
    pub tokens: f64,
    /// Trained tokens whose rollout logprob is known (the denominator of `abs_gap` and
    /// `mismatch_kl`).
    pub known: f64,
    /// Tokens whose clipped term was the active one (the min), on either side.
    pub clipped: f64,
    /// Σ |logp_old − logp_rollout| over trained tokens with a known rollout logprob (0 in
    /// bypass mode).
    pub abs_gap: f64,
    /// Σ k3 KL (when a reference is given).
    pub kl: f64,
    /// Σ importance weights.
    pub tis_weight: f64,
    /// Σ k3 estimate of KL(π_rollout ‖ π_trainer) over trained tokens with a known rollout
    /// logprob: `ρ − 1 − ln ρ` with
    /// `ρ = π_trainer / π_rollout` (π_trainer: π_old in recompute mode, the current
    /// policy, detached, in bypass mode, the same thing in a single-step update).
    pub mismatch_kl: f64,
    /// Trained tokens left out by the rejection bound.
    pub masked: f64,
    /// Rows (samples) with trained tokens, and those whose every trained token was
    /// rejected.
    pub rows: f64,
    pub masked_rows: f64,
}

impl LossStats {
    pub fn add(&mut self, o: &LossStats) {
        self.tokens += o.tokens;
        self.known += o.known;
        self.clipped += o.clipped;
        self.abs_gap += o.abs_gap;
        self.kl += o.kl;
        self.tis_weight += o.tis_weight;
        self.mismatch_kl += o.mismatch_kl;
        self.masked += o.masked;
        self.rows += o.rows;
        self.masked_rows += o.masked_rows;
    }
}

/// The GRPO loss of one micro-batch: `Σ_tokens loss / step_tokens`, where `step_tokens`
/// is the trained-token count of the whole optimizer step (counted before splitting into
/// micro-batches), so the micro-batches' losses add up to the step's token mean.
pub fn grpo_loss(
    cfg: &GrpoConfig,
    x: &TokenInputs<'_>,
    step_tokens: f64,
) -> Result<(Tensor, LossStats)> {
    let (loss, pending) = grpo_loss_pending(cfg, x, step_tokens)?;
    let (_, stats) = pending.read()?;
    Ok((loss, stats))
}

/// [`grpo_loss`] without the host sync: the statistics stay on the device until
/// [`PendingStats::read`].
pub fn grpo_loss_pending(
    cfg: &GrpoConfig,
    x: &TokenInputs<'_>,
    step_tokens: f64,
) -> Result<(Tensor, PendingStats)> {
    if step_tokens <= 0.0 {
        return Err(TrainerError::invalid(
            "a GRPO step needs at least one trained token",
        ));
    }
    let old = x.old_logp.f_detach()?;
    let adv = x.advantages.f_detach()?;
    let ratio = x.logp.f_sub(&old)?.f_exp()?;
    let s1 = ratio.f_mul(&adv)?;
    let s2 = ratio
        .f_clamp(1.0 - cfg.clip_low, 1.0 + cfg.clip_high)?
        .f_mul(&adv)?;
    let mut per_token = s1.f_minimum(&s2)?.f_neg()?;
    let mask = x.mask;
    // The trainer/rollout log-ratio per token: π_old's in recompute mode; in bypass mode the
    // current policy's (detached), which equals π_old in a single-step update; each in the
    // rollout logprobs' convention (`compare_logp`).
    let trainer_logp = match (x.compare_logp, cfg.mode) {
        (Some(c), _) => c.f_detach()?,
        (None, PolicyMode::Bypass) => x.logp.f_detach()?,
        (None, PolicyMode::Recompute) => old.shallow_clone(),
    };
    let diff = trainer_logp
        .f_sub(&x.rollout_logp.f_detach()?)?
        .f_mul(mask)?;
    // Per row: the mean log-ratio over its trained tokens (the log of the geometric mean).
    let row_tokens = mask.f_sum_dim_intlist([-1i64].as_slice(), true, Kind::Float)?;
    let row_mean = diff
        .f_sum_dim_intlist([-1i64].as_slice(), true, Kind::Float)?
        .f_div(&row_tokens.f_clamp_min(1.0)?)?;
    let level_ratio = |level: Level| -> Result<Tensor> {
        Ok(match level {
            Level::Token => diff.f_exp()?,
            Level::Sequence => row_mean.f_exp()?.f_expand_as(&diff)?,
        })
    };
    let (weight, gap) = match cfg.mode {
        PolicyMode::Bypass => (None, None),
        PolicyMode::Recompute => {
            let w = level_ratio(cfg.tis_level)?.f_clamp_max(cfg.tis_cap)?;
            (Some(w), Some(diff.f_abs()?))
        }
    };
    if let Some(w) = &weight {
        per_token = per_token.f_mul(w)?;
    }
    let keep = match &cfg.reject {
        Some(r) => {
            let ratio = level_ratio(r.level)?;
            let k = ratio
                .f_ge(r.low)?
                .f_logical_and(&ratio.f_le(r.high)?)?
                .f_to_kind(Kind::Float)?;
            per_token = per_token.f_mul(&k)?;
            Some(k)
        }
        None => None,
    };
    let kl = match (x.ref_logp, cfg.kl_coef) {
        (Some(r), c) if c != 0.0 => {
            let d = r.f_detach()?.f_sub(x.logp)?;
            let k3 = d.f_exp()?.f_sub(&d)?.f_sub_scalar(1.0)?;
            per_token = per_token.f_add(&k3.f_mul_scalar(c)?)?;
            Some(k3)
        }
        _ => None,
    };
    let loss = per_token
        .f_mul(mask)?
        .f_sum(Kind::Float)?
        .f_div_scalar(step_tokens)?;
    // Each statistic is a 0-dim tensor; they are read back together, once (PendingStats).
    let sum = |t: &Tensor| -> Result<Tensor> { Ok(t.f_detach()?.f_mul(mask)?.f_sum(Kind::Float)?) };
    // The rollout/trainer comparison counts only tokens whose rollout logprob is known: an
    // unknown one has no gap to measure (its rollout logprob stands in as π_old's).
    let known_mask = match x.known {
        Some(k) => k.f_mul(mask)?,
        None => mask.shallow_clone(),
    };
    let sum_known = |t: &Tensor| -> Result<Tensor> {
        Ok(t.f_detach()?.f_mul(&known_mask)?.f_sum(Kind::Float)?)
    };
    let zero = || Tensor::f_zeros([], (Kind::Float, mask.device()));
    let clipped = s2.f_lt_tensor(&s1)?.f_to_kind(Kind::Float)?;
    let rows = row_tokens.f_gt(0.0)?;
    // In LossStats' field order (PendingStats::read).
    let values = [
        mask.f_sum(Kind::Float)?,
        known_mask.f_sum(Kind::Float)?,
        sum(&clipped)?,
        match &gap {
            Some(g) => sum_known(g)?,
            None => zero()?,
        },
        match &kl {
            Some(k) => sum(k)?,
            None => zero()?,
        },
        match &weight {
            Some(w) => sum(w)?,
            None => sum(&Tensor::f_ones_like(mask)?)?,
        },
        sum_known(&diff.f_exp()?.f_sub_scalar(1.0)?.f_sub(&diff)?)?,
        match &keep {
            Some(k) => sum(&k.f_neg()?.f_add_scalar(1.0)?)?,
            None => zero()?,
        },
        rows.f_sum(Kind::Float)?,
        match &keep {
            Some(k) => {
                let kept =
                    k.f_mul(mask)?
                        .f_sum_dim_intlist([-1i64].as_slice(), true, Kind::Float)?;
                rows.f_logical_and(&kept.f_eq(0.0)?)?.f_sum(Kind::Float)?
            }
            None => zero()?,
        },
        loss.f_detach()?,
    ];
    let pending = PendingStats {
        values: Tensor::f_stack(&values, 0)?,
    };
    Ok((loss, pending))
}

/// A micro-batch's [`LossStats`] and loss value, still on the device: reading them is a
/// host sync, which a training step does once, after the backward is queued.
#[derive(Debug)]
pub struct PendingStats {
    values: Tensor,
}

impl PendingStats {
    /// The loss value and the statistics (one device-to-host copy).
    pub fn read(&self) -> Result<(f64, LossStats)> {
        let v = Vec::<f64>::try_from(
            self.values
                .f_to_kind(Kind::Double)?
                .f_to_device(tch::Device::Cpu)?,
        )?;
        let [
            tokens,
            known,
            clipped,
            abs_gap,
            kl,
            tis_weight,
            mismatch_kl,
            masked,
            rows,
            masked_rows,
            loss,
        ] = v[..]
        else {
            return Err(TrainerError::invalid(format!(
                "GRPO statistics: expected 11 values, got {}",
                v.len()
            )));
        };
        let stats = LossStats {
            tokens,
            known,
            clipped,
            abs_gap,
            kl,
            tis_weight,
            mismatch_kl,
            masked,
            rows,
            masked_rows,
        };
        Ok((loss, stats))
    }
}

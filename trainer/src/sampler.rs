//! Batched sampling on the model's device: every row of a batch has its own
//! [`SamplingParams`], and one pass of tensor ops over `[rows, vocab]` applies them all
//! (penalties, logit bias, temperature, top-k, top-p, min-p, greedy rows, seeded rows);
//! the host sees only the chosen ids and their logprobs, in one transfer.
//!
//! The semantics are [`crate::generate::sample_row`]'s, row by row: the logprob of the
//! chosen token is under `log_softmax((penalised logits + bias) / temperature)`, before
//! truncation (plain `log_softmax` when greedy). The draw is by the inverse CDF of
//! `softmax(truncated)`: one uniform per row (not one per token: the Gumbel race needs a
//! vocabulary of random numbers per row, which costs more than the forward on a CPU).
//! Unseeded rows take it from libtorch's generator; a row with a seed from a counter-based
//! hash of (seed, how many tokens the request has sampled), so a seeded request samples
//! the same tokens whatever else is in the batch, alone or batched, before or after a
//! retraction.

use tch::{Device, Kind, Tensor};

use crate::error::{Result, TrainerError};
use crate::generate::SamplingParams;

/// What a row brings to the sampler: its parameters, the tokens it has sampled so far
/// (penalties; their count is the seed's counter) and its prompt (the repetition penalty).
pub struct RowState<'a> {
    pub params: &'a SamplingParams,
    pub prompt: &'a [i64],
    pub out: &'a [i64],
}

/// The penalties' state on the device: output token counts and the tokens seen (prompt or
/// output), per row.
struct Penalties {
    counts: Tensor,
    seen: Tensor,
    frequency: Tensor,
    presence: Tensor,
    repetition: Tensor,
}

/// The sampling state of a batch's rows, as device tensors: built when the rows change
/// ([`Sampler::new`]), then each step is a fixed number of tensor ops whatever the batch.
pub struct Sampler {
    rows: i64,
    vocab: i64,
    device: Device,
    /// `[rows, 1]`: the temperature (1 for greedy rows).
    temperature: Tensor,
    /// `[rows]`: greedy rows; None when no row is greedy; all greedy skips the draw.
    greedy: Option<Tensor>,
    all_greedy: bool,
    /// (`[rows, 1]` index of the k-th largest, k - 1; `[rows, 1]` rows with top-k; the
    /// largest k).
    top_k: Option<(Tensor, Tensor, i64)>,
    /// `[rows, 1]`: top-p (2 for rows without: never reached).
    top_p: Option<Tensor>,
    /// `[rows, 1]`: ln(min-p) (-inf for rows without).
    min_p: Option<Tensor>,
    /// `[rows, vocab]` f32 logit bias.
    bias: Option<Tensor>,
    /// (`[seeded]` row indices, `[seeded, 1]` seeds).
    seeded: Option<(Tensor, Tensor)>,
    /// `[rows]`: tokens each row has sampled (the seeds' counter).
    pos: Tensor,
    penalties: Option<Penalties>,
}

/// The chosen ids (`[rows]`, Int64) and their logprobs (`[rows]`, f32) on the host, in one
/// transfer.
pub fn to_host(ids: &Tensor, logprobs: &Tensor) -> Result<Vec<(i64, f32)>> {
    let n = ids.size().first().copied().unwrap_or(0) as usize;
    let both = Tensor::f_cat(
        &[
            ids.f_to_kind(Kind::Double)?,
            logprobs.f_reshape([-1])?.f_to_kind(Kind::Double)?,
        ],
        0,
    )?
    .f_to_device(Device::Cpu)?;
    let both: Vec<f64> = Vec::try_from(&both)?;
    Ok((0..n)
        .map(|i| (both[i] as i64, both[n + i] as f32))
        .collect())
}

fn per_row(v: Vec<f32>, device: Device) -> Result<Tensor> {
    let n = v.len() as i64;
    Ok(Tensor::from_slice(&v).f_view([n, 1])?.f_to_device(device)?)
}

impl Sampler {
    /// The sampler of `rows` (in batch order) over a vocabulary of `vocab` tokens.
    pub fn new(rows: &[RowState<'_>], vocab: i64, device: Device) -> Result<Sampler> {
        let n = rows.len() as i64;
        let greedy_rows: Vec<bool> = rows.iter().map(|r| r.params.temperature <= 0.0).collect();
        let temperature = per_row(
            rows.iter()
                .map(|r| {
                    if r.params.temperature > 0.0 {
                        r.params.temperature as f32
                    } else {
                        1.0
                    }
                })
                .collect(),
            device,
        )?;
        let any_greedy = greedy_rows.iter().any(|&g| g);
        let all_greedy = greedy_rows.iter().all(|&g| g);
        let greedy = if any_greedy && !all_greedy {
            let g: Vec<i64> = greedy_rows.iter().map(|&g| g as i64).collect();
            Some(
                Tensor::from_slice(&g)
                    .f_to_device(device)?
                    .f_to_kind(Kind::Bool)?,
            )
        } else {
            None
        };
        // Truncation only matters for rows that draw.
        let draws = |r: &RowState<'_>| r.params.temperature > 0.0;
        let k_of = |r: &RowState<'_>| {
            let k = r.params.top_k;
            (draws(r) && k > 0 && k < vocab).then_some(k)
        };
        let kmax = rows.iter().filter_map(k_of).max();
        let top_k = match kmax {
            Some(kmax) => {
                let idx: Vec<i64> = rows.iter().map(|r| k_of(r).unwrap_or(1) - 1).collect();
                let has: Vec<i64> = rows.iter().map(|r| k_of(r).is_some() as i64).collect();
                Some((
                    Tensor::from_slice(&idx)
                        .f_view([n, 1])?
                        .f_to_device(device)?,
                    Tensor::from_slice(&has)
                        .f_view([n, 1])?
                        .f_to_device(device)?
                        .f_to_kind(Kind::Bool)?,
                    kmax,
                ))
            }
            None => None,
        };
        let top_p = if rows.iter().any(|r| draws(r) && r.params.top_p < 1.0) {
            Some(per_row(
                rows.iter()
                    .map(|r| {
                        if draws(r) && r.params.top_p < 1.0 {
                            r.params.top_p as f32
                        } else {
                            2.0
                        }
                    })
                    .collect(),
                device,
            )?)
        } else {
            None
        };
        let min_p = if rows.iter().any(|r| draws(r) && r.params.min_p > 0.0) {
            Some(per_row(
                rows.iter()
                    .map(|r| {
                        if draws(r) && r.params.min_p > 0.0 {
                            r.params.min_p.ln() as f32
                        } else {
                            f32::NEG_INFINITY
                        }
                    })
                    .collect(),
                device,
            )?)
        } else {
            None
        };
        let bias = if rows.iter().any(|r| !r.params.logit_bias.is_empty()) {
            let (mut ri, mut ti, mut vals) = (Vec::new(), Vec::new(), Vec::new());
            for (i, r) in rows.iter().enumerate() {
                for &(id, b) in &r.params.logit_bias {
                    if !(0..vocab).contains(&id) {
                        return Err(TrainerError::invalid(format!(
                            "logit_bias names token {id}, outside the vocabulary (0..{vocab})"
                        )));
                    }
                    ri.push(i as i64);
                    ti.push(id);
                    vals.push(b);
                }
            }
            let mut dense = Tensor::f_zeros([n, vocab], (Kind::Float, device))?;
            let at = [
                Some(Tensor::from_slice(&ri).f_to_device(device)?),
                Some(Tensor::from_slice(&ti).f_to_device(device)?),
            ];
            let _ =
                dense.f_index_put_(&at, &Tensor::from_slice(&vals).f_to_device(device)?, true)?;
            Some(dense)
        } else {
            None
        };
        let seeded_rows: Vec<(i64, u64)> = rows
            .iter()
            .enumerate()
            .filter_map(|(i, r)| Some((i as i64, r.params.seed?)).filter(|_| draws(r)))
            .collect();
        let seeded = if seeded_rows.is_empty() {
            None
        } else {
            let idx: Vec<i64> = seeded_rows.iter().map(|&(i, _)| i).collect();
            let seeds: Vec<i64> = seeded_rows.iter().map(|&(_, s)| s as i64).collect();
            let s = seeds.len() as i64;
            Some((
                Tensor::from_slice(&idx).f_to_device(device)?,
                Tensor::from_slice(&seeds)
                    .f_view([s, 1])?
                    .f_to_device(device)?,
            ))
        };
        let pos: Vec<i64> = rows.iter().map(|r| r.out.len() as i64).collect();
        let pos = Tensor::from_slice(&pos).f_to_device(device)?;
        let penalties = if rows.iter().any(|r| has_penalty(r.params)) {
            Some(Penalties::new(rows, vocab, device)?)
        } else {
            None
        };
        Ok(Sampler {
            rows: n,
            vocab,
            device,
            temperature,
            greedy,
            all_greedy,
            top_k,
            top_p,
            min_p,
            bias,
            seeded,
            pos,
            penalties,
        })
    }

    pub fn rows(&self) -> i64 {
        self.rows
    }

    /// Chooses each row's next token from `logits` (`[rows, vocab]`, any float dtype, on
    /// the sampler's device), then counts it (seeds' counters, penalties). Returns the ids
    /// (`[rows]`) and their logprobs (`[rows]`), on the device ([`to_host`] brings them).
    pub fn sample(&mut self, logits: &Tensor) -> Result<(Tensor, Tensor)> {
        let size = logits.size();
        if size != [self.rows, self.vocab] {
            return Err(TrainerError::invalid(format!(
                "the sampler holds {} rows of {} tokens, the logits are {size:?}",
                self.rows, self.vocab
            )));
        }
        let mut l = logits.f_to_kind(Kind::Float)?;
        if let Some(p) = &self.penalties {
            l = p.apply(&l)?;
        }
        if let Some(b) = &self.bias {
            l = l.f_add(b)?;
        }
        let scaled = l.f_div(&self.temperature)?;
        let lp = scaled.f_log_softmax(-1, Kind::Float)?;
        let ids = if self.all_greedy {
            l.f_argmax(-1, false)?
        } else {
            let probs = if self.truncates() {
                self.truncate(&scaled)?.f_softmax(-1, Kind::Float)?
            } else {
                lp.f_exp()?
            };
            let drawn = self.draw(&probs)?;
            match &self.greedy {
                Some(g) => drawn.f_where_self(&g.f_logical_not()?, &l.f_argmax(-1, false)?)?,
                None => drawn,
            }
        };
        let chosen = lp
            .f_gather(1, &ids.f_view([self.rows, 1])?, false)?
            .f_view([self.rows])?;
        self.pos = self.pos.f_add_scalar(1)?;
        if let Some(p) = &mut self.penalties {
            p.count(&ids)?;
        }
        Ok((ids, chosen))
    }

    /// Top-k, then top-p, then min-p, per row: what is cut becomes -inf.
    fn truncate(&self, scaled: &Tensor) -> Result<Tensor> {
        let mut l = scaled.shallow_clone();
        if let Some((idx, has, kmax)) = &self.top_k {
            let (top, _) = l.f_topk(*kmax, -1, true, true)?;
            let kth = top.f_gather(1, idx, false)?;
            let floor = kth.f_masked_fill(&has.f_logical_not()?, f64::NEG_INFINITY)?;
            l = l.f_masked_fill(&l.f_lt_tensor(&floor)?, f64::NEG_INFINITY)?;
        }
        if let Some(p) = &self.top_p {
            let (sorted, idx) = l.f_sort(-1, true)?;
            let probs = sorted.f_softmax(-1, Kind::Float)?;
            let before = probs.f_cumsum(-1, Kind::Float)?.f_sub(&probs)?;
            let drop_sorted = before.f_gt_tensor(p)?;
            let drop = drop_sorted.f_scatter(-1, &idx, &drop_sorted)?;
            l = l.f_masked_fill(&drop, f64::NEG_INFINITY)?;
        }
        if let Some(m) = &self.min_p {
            // p_i < min_p · p_max  ⇔  l_i < l_max + ln(min_p).
            let (max, _) = l.f_max_dim(-1, true)?;
            l = l.f_masked_fill(&l.f_lt_tensor(&max.f_add(m)?)?, f64::NEG_INFINITY)?;
        }
        Ok(l)
    }

    fn truncates(&self) -> bool {
        self.top_k.is_some() || self.top_p.is_some() || self.min_p.is_some()
    }

    /// One token per row from `probs` (`[rows, vocab]`, rows summing to about 1) by the
    /// inverse CDF: the first token whose cumulative probability exceeds `u · total`, one
    /// uniform `u` per row (libtorch's generator, or the seeded hash).
    fn draw(&self, probs: &Tensor) -> Result<Tensor> {
        let cdf = probs.f_cumsum(-1, Kind::Float)?;
        let total = cdf.f_narrow(-1, self.vocab - 1, 1)?;
        let mut u = Tensor::f_rand([self.rows, 1], (Kind::Float, self.device))?;
        if let Some((idx, seeds)) = &self.seeded {
            let pos = self.pos.f_index_select(0, idx)?.f_unsqueeze(1)?;
            u = u.f_index_copy(0, idx, &seeded_uniform(seeds, &pos)?)?;
        }
        Ok(u.f_mul(&total)?
            .f_searchsorted(&cdf, false, true, "right", None::<&Tensor>)?
            .f_view([self.rows])?
            .f_clamp_max(self.vocab - 1)?)
    }
}

/// One uniform in (0, 1) per row (`[rows, 1]` f32) from a counter-based hash
/// (splitmix64's finaliser) of the row's seed and its counter: 24 bits.
fn seeded_uniform(seeds: &Tensor, pos: &Tensor) -> Result<Tensor> {
    // Wrapping 64-bit arithmetic on Int64 tensors; `>>` is arithmetic, so logical shifts
    // mask the sign-extended bits away.
    let lsr = |z: &Tensor, k: i64| -> Result<Tensor> {
        Ok(z.f_bitwise_right_shift_tensor_scalar(k)?
            .f_bitwise_and((1i64 << (64 - k)) - 1)?)
    };
    let mut z = seeds.f_mul_scalar(0x9e37_79b9_7f4a_7c15u64 as i64)?.f_add(
        &pos.f_add_scalar(1)?
            .f_mul_scalar(0x632b_e59b_d9b4_e019u64 as i64)?,
    )?;
    for (k, m) in [
        (30, 0xbf58_476d_1ce4_e5b9u64 as i64),
        (27, 0x94d0_49bb_1331_11ebu64 as i64),
    ] {
        z = z.f_bitwise_xor_tensor(&lsr(&z, k)?)?.f_mul_scalar(m)?;
    }
    z = z.f_bitwise_xor_tensor(&lsr(&z, 31)?)?;
    Ok(lsr(&z, 40)?
        .f_to_kind(Kind::Float)?
        .f_add_scalar(0.5)?
        .f_div_scalar((1u64 << 24) as f64)?)
}

fn has_penalty(p: &SamplingParams) -> bool {
    p.frequency_penalty != 0.0 || p.presence_penalty != 0.0 || p.repetition_penalty != 1.0
}

impl Penalties {
    fn new(rows: &[RowState<'_>], vocab: i64, device: Device) -> Result<Penalties> {
        let n = rows.len() as i64;
        let flat = |prompt: bool| -> Result<(Tensor, Tensor)> {
            let (mut r, mut t) = (Vec::new(), Vec::new());
            for (i, row) in rows.iter().enumerate() {
                for &id in if prompt { row.prompt } else { row.out } {
                    if (0..vocab).contains(&id) {
                        r.push(i as i64);
                        t.push(id);
                    }
                }
            }
            Ok((
                Tensor::from_slice(&r).f_to_device(device)?,
                Tensor::from_slice(&t).f_to_device(device)?,
            ))
        };
        let mut counts = Tensor::f_zeros([n, vocab], (Kind::Float, device))?;
        let (r, t) = flat(false)?;
        let ones = Tensor::f_ones([r.size()[0]], (Kind::Float, device))?;
        let _ = counts.f_index_put_(&[Some(r), Some(t)], &ones, true)?;
        let mut seen = counts.f_gt(0.0)?;
        let (r, t) = flat(true)?;
        let _ = seen.f_index_put_(
            &[Some(r), Some(t)],
            &Tensor::f_ones([1], (Kind::Bool, device))?,
            false,
        )?;
        let col = |f: &dyn Fn(&SamplingParams) -> f64| {
            per_row(rows.iter().map(|r| f(r.params) as f32).collect(), device)
        };
        Ok(Penalties {
            counts,
            seen,
            frequency: col(&|p| p.frequency_penalty)?,
            presence: col(&|p| p.presence_penalty)?,
            repetition: col(&|p| p.repetition_penalty)?,
        })
    }

    /// Repetition (tokens seen in the prompt or the output: positive logits divided by it,
    /// negative ones multiplied), then frequency and presence (output tokens), as vLLM and
    /// HF apply them.
    fn apply(&self, l: &Tensor) -> Result<Tensor> {
        let scaled = l
            .f_div(&self.repetition)?
            .f_where_self(&l.f_gt(0.0)?, &l.f_mul(&self.repetition)?)?;
        let l = scaled.f_where_self(&self.seen, l)?;
        let present = self.counts.f_gt(0.0)?.f_to_kind(Kind::Float)?;
        Ok(l.f_sub(&self.counts.f_mul(&self.frequency)?)?
            .f_sub(&present.f_mul(&self.presence)?)?)
    }

    fn count(&mut self, ids: &Tensor) -> Result<()> {
        let n = ids.size()[0];
        let rows = Tensor::f_arange(n, (Kind::Int64, ids.device()))?;
        let at = [Some(rows), Some(ids.shallow_clone())];
        let ones = Tensor::f_ones([n], (Kind::Float, ids.device()))?;
        let _ = self.counts.f_index_put_(&at, &ones, true)?;
        let _ = self.seen.f_index_put_(
            &at,
            &Tensor::f_ones([1], (Kind::Bool, ids.device()))?,
            false,
        )?;
        Ok(())
    }
}

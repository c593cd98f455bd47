//! One GRPO optimizer step over token-masked samples, the selection of samples from a
//! samples file (groups, advantages, Balanced Adaptive Rollout), checkpoints.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::Path;
use std::time::Instant;

use graft_reconstruct::sample::{LogprobKind, Sample};
use tch::Tensor;

use crate::bar::{self, BarConfig, BarDecision};
use crate::error::{Result, TrainerError};
use crate::grpo::{self, GrpoConfig, LossStats, PolicyMode, TokenInputs};
use crate::model::Model;
use crate::optim::{AdamW, AdamWConfig};

/// One sequence to train on.
#[derive(Debug, Clone, PartialEq)]
pub struct TrainSample {
    pub tokens: Vec<i64>,
    /// 1 on trained (sampled) tokens.
    pub loss_mask: Vec<u8>,
    /// The rollout engine's logprobs, aligned to `tokens`, `None` items where unknown;
    /// `None` when no sampled token's is known (re-tokenized text). A trained token whose
    /// rollout logprob is unknown needs π_old recomputed and gets no importance weight
    /// (its rollout logprob is taken to be π_old's: weight 1), see [`Trainer::step`].
    pub rollout_logprobs: Option<Vec<Option<f32>>>,
    /// Which distribution `rollout_logprobs` come from: post-temperature ones are compared
    /// with the trainer's logprobs at the run's temperature, pre-temperature ones (vLLM's
    /// `raw_logprobs`) with the trainer's at temperature 1 (see [`Trainer::step`]).
    pub logprob_kind: LogprobKind,
    /// The sequence's advantage (its session reward's), on every token.
    pub advantage: f64,
    /// Aligned to `tokens`: a per-turn term added to `advantage` (from call rewards: the
    /// group-normalised reward of the call that sampled the token, 0 elsewhere); `None`
    /// without call rewards.
    pub turn_advantages: Option<Vec<f32>>,
    pub reward: f64,
}

/// Everything a training run is configured by.
#[derive(Debug, Clone, PartialEq)]
pub struct TrainConfig {
    pub grpo: GrpoConfig,
    pub optim: AdamWConfig,
    /// Padded tokens per micro-batch (rows × longest row).
    pub micro_batch_tokens: usize,
    /// Balanced Adaptive Rollout; `None` trains on every group with signal.
    pub bar: Option<BarConfig>,
    pub advantage_eps: f64,
    /// Activation checkpointing: keep only each decoder layer's input in the forward and
    /// recompute the layer in the backward ([`crate::model::checkpoint`]): less memory per
    /// token, one more forward of the layers. Same gradients.
    pub checkpoint_layers: bool,
}

impl Default for TrainConfig {
    fn default() -> Self {
        TrainConfig {
            grpo: GrpoConfig::default(),
            optim: AdamWConfig::default(),
            micro_batch_tokens: 16 * 1024,
            bar: None,
            advantage_eps: 1e-6,
            checkpoint_layers: false,
        }
    }
}

/// What one optimizer step did (the per-step log line).
#[derive(Debug, Clone, PartialEq)]
pub struct StepStats {
    pub step: i64,
    pub loss: f64,
    pub mean_reward: f64,
    pub tokens: f64,
    pub clip_fraction: f64,
    /// Mean |logp_old − logp_rollout| over trained tokens whose rollout logprob is known
    /// (0 in bypass mode, and when none is).
    pub logprob_gap: f64,
    /// Trained tokens without a rollout logprob (the sample carried `None`: re-tokenized
    /// text, a backend that sent none). They train against the recomputed π_old and are
    /// left out of `logprob_gap` and `mismatch_kl`.
    pub tokens_without_logprob: f64,
    /// Mean k3 KL to the reference over trained tokens (0 without one).
    pub kl: f64,
    pub grad_norm: f64,
    pub skipped: bool,
    pub micro_batches: usize,
    pub tokens_per_s: f64,
    /// Mean k3 estimate of KL(π_rollout ‖ π_trainer) per trained token whose rollout
    /// logprob is known (the rollout engine's mismatch: numerics, and staleness when the
    /// rollouts are behind).
    pub mismatch_kl: f64,
    /// Share of trained tokens left out by the rejection bound (0 without one).
    pub masked_share: f64,
    /// Samples whose every trained token was rejected.
    pub masked_samples: usize,
}

/// Which samples of a file train, and why the others do not.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Selection {
    pub samples: Vec<TrainSample>,
    pub groups: usize,
    pub groups_dropped: usize,
    pub groups_relaxed: usize,
    pub sessions_without_reward: usize,
}

/// Turns reconstructed samples into training samples: sessions are grouped by
/// `group_id` (a session without one is its own group, so it carries no signal), each
/// session's reward gives its group-normalised advantage, every sample of a session
/// carries it. With `bar`, each group's sessions are chosen by Balanced Adaptive Rollout
/// (a file holds no more rollouts than it holds, so a group short of the band is relaxed
/// or dropped at once).
///
/// Call rewards (process rewards for single turns, [`Sample::call_rewards`]) add a per-turn
/// term: each rewarded call's reward normalised over the rewarded calls of its group's
/// chosen sessions, added to the advantage of the tokens that call sampled. A session with
/// call rewards and no session reward takes part with a session term of 0 (BAR chooses
/// among the sessions with a session reward only), and so does a side-thread sample kept
/// for its own call rewards (`thread = "side"`, no reward). A group trains when some term
/// is not 0.
pub fn select_samples(samples: &[Sample], bar_cfg: Option<&BarConfig>, eps: f64) -> Selection {
    let mut sel = Selection::default();
    // Sessions in first-seen order, per group.
    let mut groups: BTreeMap<String, Vec<String>> = BTreeMap::new();
    let mut reward: HashMap<&str, f64> = HashMap::new();
    let mut call_rewarded: HashSet<&str> = HashSet::new();
    let mut without = HashSet::new();
    for s in samples {
        let has_call_rewards = s.call_rewards.iter().any(|r| r.is_some_and(f64::is_finite));
        if has_call_rewards {
            call_rewarded.insert(s.session_id.as_str());
        }
        match s.reward {
            Some(r) => {
                reward.insert(s.session_id.as_str(), r);
            }
            None if has_call_rewards => {}
            None => {
                without.insert(s.session_id.as_str());
                continue;
            }
        }
        let g = s
            .group_id
            .clone()
            .unwrap_or_else(|| format!("session:{}", s.session_id));
        let members = groups.entry(g).or_default();
        if !members.contains(&s.session_id) {
            members.push(s.session_id.clone());
        }
    }
    // A session whose other sample carries a call reward is not without one.
    without.retain(|s| !call_rewarded.contains(s) && !reward.contains_key(s));
    sel.sessions_without_reward = without.len();
    sel.groups = groups.len();
    let mut advantage: HashMap<String, f64> = HashMap::new();
    let mut turn: HashMap<(&str, &str), f64> = HashMap::new();
    // Each session's samples, so a group's turn term reads only its own (not every sample
    // once per group).
    let mut by_session: HashMap<&str, Vec<&Sample>> = HashMap::new();
    for s in samples {
        by_session.entry(s.session_id.as_str()).or_default().push(s);
    }
    for members in groups.values() {
        let rewarded: Vec<usize> = (0..members.len())
            .filter(|&i| reward.contains_key(members[i].as_str()))
            .collect();
        let rewards: Vec<f64> = rewarded
            .iter()
            .map(|&i| reward[members[i].as_str()])
            .collect();
        let chosen: Vec<usize> = match bar_cfg {
            Some(cfg) if !rewards.is_empty() => {
                let cfg = BarConfig {
                    n_max: rewards.len().max(cfg.n),
                    ..cfg.clone()
                };
                match bar::select(&rewards, &cfg) {
                    BarDecision::Select { indices, relaxed } => {
                        if relaxed {
                            sel.groups_relaxed += 1;
                        }
                        indices
                    }
                    BarDecision::Drop => Vec::new(),
                    // Fewer rollouts than n in the file: train on them all.
                    BarDecision::NeedMore(_) => (0..rewards.len()).collect(),
                }
            }
            _ => (0..rewards.len()).collect(),
        };
        if chosen.is_empty() && !rewards.is_empty() && bar_cfg.is_some() {
            // BAR dropped the group.
            sel.groups_dropped += 1;
            continue;
        }
        let r: Vec<f64> = chosen.iter().map(|&i| rewards[i]).collect();
        let same = vec!["g"; r.len()];
        let mut group_adv: Vec<(String, f64)> = chosen
            .iter()
            .zip(grpo::group_advantages(&r, &same, eps))
            .map(|(&i, a)| (members[rewarded[i]].clone(), a))
            .collect();
        // Sessions with call rewards only: a session term of 0.
        for m in members {
            if !reward.contains_key(m.as_str()) {
                group_adv.push((m.clone(), 0.0));
            }
        }
        // The turn term: over the rewarded calls of the chosen sessions.
        let mut calls: Vec<((&str, &str), f64)> = Vec::new();
        for s in group_adv
            .iter()
            .flat_map(|(m, _)| by_session.get(m.as_str()).into_iter().flatten())
        {
            for (c, r) in s.call_ids.iter().zip(&s.call_rewards) {
                if let Some(r) = r.filter(|r| r.is_finite()) {
                    calls.push(((s.session_id.as_str(), c.as_str()), r));
                }
            }
        }
        let call_r: Vec<f64> = calls.iter().map(|(_, r)| *r).collect();
        let call_adv = grpo::group_advantages(&call_r, &vec!["g"; call_r.len()], eps);
        if group_adv.iter().all(|(_, a)| *a == 0.0) && call_adv.iter().all(|a| *a == 0.0) {
            sel.groups_dropped += 1;
            continue;
        }
        for ((key, _), a) in calls.into_iter().zip(call_adv) {
            turn.insert(key, a);
        }
        advantage.extend(group_adv);
    }
    for s in samples {
        let Some(&a) = advantage.get(&s.session_id) else {
            continue;
        };
        let known = s
            .loss_mask
            .iter()
            .zip(&s.logprobs)
            .any(|(&m, l)| m == 1 && l.is_some());
        let by_call: Vec<f32> = s
            .call_ids
            .iter()
            .map(|c| {
                turn.get(&(s.session_id.as_str(), c.as_str()))
                    .copied()
                    .unwrap_or(0.0) as f32
            })
            .collect();
        let turn_advantages = by_call.iter().any(|a| *a != 0.0).then(|| {
            (0..s.tokens.len())
                .map(|i| match s.token_calls.get(i).copied().flatten() {
                    Some(c) => by_call.get(c as usize).copied().unwrap_or(0.0),
                    None => 0.0,
                })
                .collect()
        });
        let mean_call = || {
            let r: Vec<f64> = s.call_rewards.iter().flatten().copied().collect();
            r.iter().sum::<f64>() / r.len().max(1) as f64
        };
        // A side thread kept for its own call rewards (`--side-threads own`: no reward of
        // its own) takes no part in the session's outcome: its turn term alone.
        let a = if s.thread == "side" && s.reward.is_none() {
            0.0
        } else {
            a
        };
        sel.samples.push(TrainSample {
            tokens: s.tokens.iter().map(|&t| i64::from(t)).collect(),
            loss_mask: s.loss_mask.clone(),
            rollout_logprobs: known.then(|| s.logprobs.clone()),
            logprob_kind: s.logprob_kind,
            advantage: a,
            turn_advantages,
            reward: s.reward.unwrap_or_else(mean_call),
        });
    }
    sel
}

/// The model and its optimizer (and the frozen reference policy of the KL term, if any).
pub struct Trainer {
    pub model: Model,
    pub optimizer: AdamW,
    pub config: TrainConfig,
    /// π_ref of the k3 KL term (`grpo.kl_coef` ≠ 0); see [`Trainer::with_reference`].
    pub reference: Option<Model>,
}

impl std::fmt::Debug for Trainer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Trainer")
            .field("model", &self.model)
            .field("optimizer", &self.optimizer)
            .finish()
    }
}

/// Greedy packing into micro-batches of at most `budget` padded tokens (a longer row
/// gets a micro-batch of its own).
fn micro_batches(batch: &[TrainSample], budget: usize) -> Vec<Vec<usize>> {
    let mut out: Vec<Vec<usize>> = Vec::new();
    let mut cur: Vec<usize> = Vec::new();
    let mut longest = 0;
    for (i, s) in batch.iter().enumerate() {
        let l = s.tokens.len().max(longest);
        if !cur.is_empty() && l * (cur.len() + 1) > budget {
            out.push(std::mem::take(&mut cur));
            longest = 0;
        }
        longest = longest.max(s.tokens.len());
        cur.push(i);
    }
    if !cur.is_empty() {
        out.push(cur);
    }
    out
}

struct Micro {
    ids: Tensor,
    mask: Tensor,
    rollout: Tensor,
    /// 1 where the rollout logprob is known, per token.
    known: Tensor,
    adv: Tensor,
    /// `[rows, 1]`: 1 on rows whose rollout logprobs are pre-temperature; `None` when no
    /// row's are.
    pre: Option<Tensor>,
}

impl TrainSample {
    /// Whether every trained token (mask 1, past the first token) has a known rollout
    /// logprob: what bypass mode (π_old = the rollout's) needs.
    pub fn rollout_complete(&self) -> bool {
        let Some(lp) = &self.rollout_logprobs else {
            return false;
        };
        self.loss_mask
            .iter()
            .enumerate()
            .skip(1)
            .all(|(j, &m)| m == 0 || lp.get(j).is_some_and(Option::is_some))
    }
}

fn build_micro(batch: &[TrainSample], rows: &[usize], device: tch::Device) -> Result<Micro> {
    let len = rows
        .iter()
        .map(|&i| batch[i].tokens.len())
        .max()
        .unwrap_or(0);
    let n = rows.len();
    let mut ids = vec![0i64; n * len];
    let mut mask = vec![0f32; n * len];
    let mut rollout = vec![0f32; n * len];
    let mut known = vec![0f32; n * len];
    let mut adv = vec![0f32; n * len];
    let pre: Vec<f32> = rows
        .iter()
        .map(|&i| {
            f32::from(u8::from(
                batch[i].logprob_kind == LogprobKind::PreTemperature,
            ))
        })
        .collect();
    for (r, &i) in rows.iter().enumerate() {
        let s = &batch[i];
        if s.loss_mask.len() != s.tokens.len() {
            return Err(TrainerError::invalid(format!(
                "a sample has {} tokens but a loss mask of {}",
                s.tokens.len(),
                s.loss_mask.len()
            )));
        }
        ids[r * len..r * len + s.tokens.len()].copy_from_slice(&s.tokens);
        for (j, &m) in s.loss_mask.iter().enumerate().skip(1) {
            mask[r * len + j] = f32::from(m.min(1));
        }
        if let Some(lp) = &s.rollout_logprobs {
            for (j, l) in lp.iter().enumerate().take(s.tokens.len()) {
                if let Some(l) = *l {
                    rollout[r * len + j] = l;
                    known[r * len + j] = 1.0;
                }
            }
        }
        let row = &mut adv[r * len..r * len + s.tokens.len()];
        row.fill(s.advantage as f32);
        if let Some(t) = &s.turn_advantages {
            for (a, t) in row.iter_mut().zip(t) {
                *a += t;
            }
        }
    }
    let shape = [n as i64, len as i64];
    let t = |v: &[f32]| -> Result<Tensor> {
        Ok(Tensor::from_slice(v)
            .f_reshape(shape)?
            .f_to_device(device)?)
    };
    Ok(Micro {
        ids: Tensor::from_slice(&ids)
            .f_reshape(shape)?
            .f_to_device(device)?,
        mask: t(&mask)?,
        rollout: t(&rollout)?,
        known: t(&known)?,
        adv: t(&adv)?,
        pre: if pre.contains(&1.0) {
            Some(
                Tensor::from_slice(&pre)
                    .f_reshape([n as i64, 1])?
                    .f_to_device(device)?,
            )
        } else {
            None
        },
    })
}

impl Trainer {
    pub fn new(model: Model, config: TrainConfig) -> Result<Trainer> {
        let optimizer = AdamW::new(model.named_parameters(), config.optim.clone())?;
        Ok(Trainer {
            model,
            optimizer,
            config,
            reference: None,
        })
    }

    /// Sets the frozen reference policy the k3 KL term pulls toward.
    pub fn with_reference(mut self, reference: Model) -> Result<Trainer> {
        if reference.spec() != self.model.spec() {
            return Err(TrainerError::invalid(
                "the reference model has another architecture than the trained one",
            ));
        }
        self.reference = Some(reference);
        Ok(self)
    }

    /// One optimizer step over `batch`: the token mean is over all of its trained tokens
    /// (counted here, before the micro-batches), gradients accumulate over the
    /// micro-batches, then AdamW steps (clipped; skipped when not finite).
    ///
    /// Rollout logprobs are compared like with like: a sample's pre-temperature ones
    /// ([`LogprobKind::PreTemperature`], vLLM's `raw_logprobs`) with the trainer's at
    /// temperature 1 (the importance weight, the rejection bound, the statistics; in bypass
    /// mode the PPO ratio's value), post-temperature ones with the trainer's at the run's
    /// temperature. The objective (the ratio's gradient, π_old in recompute mode, the KL
    /// term) stays at the run's temperature.
    pub fn step(&mut self, batch: &[TrainSample]) -> Result<StepStats> {
        let start = Instant::now();
        let total: f64 = batch
            .iter()
            .map(|s| s.loss_mask.iter().skip(1).filter(|&&m| m == 1).count() as f64)
            .sum();
        if total == 0.0 {
            return Err(TrainerError::invalid(
                "the batch has no trained tokens (loss_mask is all 0)",
            ));
        }
        let cfg = self.config.grpo.clone();
        if cfg.mode == PolicyMode::Bypass && !batch.iter().all(TrainSample::rollout_complete) {
            return Err(TrainerError::invalid(
                "some trained tokens have no rollout logprob (re-tokenized text, or a backend that sent none), so bypass mode has no π_old for them; train with the recompute policy mode",
            ));
        }
        let device = self.model.device();
        let mut stats = LossStats::default();
        let mut loss_sum = 0.0;
        let mut pending = Vec::new();
        let groups = micro_batches(batch, self.config.micro_batch_tokens);
        self.optimizer.zero_grad()?;
        for rows in &groups {
            let m = build_micro(batch, rows, device)?;
            // Rows whose rollout logprobs are pre-temperature are compared with the
            // trainer's at temperature 1 (the same raw distribution); at temperature 1
            // both conventions are one.
            let pre = m.pre.as_ref().filter(|_| cfg.temperature != 1.0);
            // The trainer's logprobs in each row's rollout convention: `scaled` (the run's
            // temperature) on post-temperature rows, `raw` on pre-temperature ones.
            let compare = |scaled: &Tensor, raw: &Tensor, pre: &Tensor| -> Result<Tensor> {
                Ok(scaled.f_add(&raw.f_sub(scaled)?.f_mul(pre)?)?)
            };
            // Recompute: π_old at the run's temperature, and its comparison side.
            let recomputed = match cfg.mode {
                PolicyMode::Bypass => None,
                PolicyMode::Recompute => {
                    Some(tch::no_grad(|| -> Result<(Tensor, Option<Tensor>)> {
                        let hidden = self.model.forward_hidden(&m.ids, None)?;
                        let old = grpo::hidden_logprobs(
                            &self.model,
                            &hidden,
                            &m.ids,
                            cfg.temperature,
                            cfg.logprob_chunk,
                        )?;
                        let cmp = match pre {
                            Some(p) => {
                                let raw = grpo::hidden_logprobs(
                                    &self.model,
                                    &hidden,
                                    &m.ids,
                                    1.0,
                                    cfg.logprob_chunk,
                                )?;
                                Some(compare(&old, &raw, p)?)
                            }
                            None => None,
                        };
                        Ok((old, cmp))
                    })?)
                }
            };
            // With checkpointing the layers ran without autograd; the head and the loss
            // build on the last layer's output, a leaf.
            let layers = if self.config.checkpoint_layers {
                Some(self.model.forward_checkpointed(&m.ids)?)
            } else {
                None
            };
            let hidden = match &layers {
                Some(c) => self.model.final_norm(c.last())?,
                None => self.model.forward_hidden(&m.ids, None)?,
            };
            let logp = grpo::hidden_logprobs(
                &self.model,
                &hidden,
                &m.ids,
                cfg.temperature,
                cfg.logprob_chunk,
            )?;
            let (old, compare_logp) = match recomputed {
                Some(r) => r,
                // Bypass: π_old = the rollout logprobs. A pre-temperature row has none at
                // the run's temperature; its π_old is the current policy's (detached) less
                // the raw trainer/rollout log-ratio, so its PPO ratio is that raw ratio
                // (exact when both ran the same weights: then 1), and its gradient the
                // policy's at the run's temperature.
                None => match pre {
                    Some(p) => {
                        let scaled = logp.f_detach()?;
                        let raw = tch::no_grad(|| {
                            grpo::hidden_logprobs(
                                &self.model,
                                &hidden,
                                &m.ids,
                                1.0,
                                cfg.logprob_chunk,
                            )
                        })?;
                        let cmp = compare(&scaled, &raw, p)?;
                        let old = m.rollout.f_add(&scaled.f_sub(&cmp)?)?;
                        (old, Some(cmp))
                    }
                    None => (m.rollout.shallow_clone(), None),
                },
            };
            // Unknown rollout logprobs, per token: weight 1 (rollout := the trainer's side
            // of the comparison), so a token whose sampler's logprob is unknown is left out
            // of the importance correction but still trained against the recomputed π_old.
            let side = compare_logp.as_ref().unwrap_or(&old);
            let rollout = m
                .rollout
                .f_mul(&m.known)?
                .f_add(&side.f_mul(&m.known.f_neg()?.f_add_scalar(1.0)?)?)?;
            let adv = m.adv.f_expand_as(&m.mask)?;
            let ref_logp = match (&self.reference, cfg.kl_coef != 0.0) {
                (Some(r), true) => Some(tch::no_grad(|| {
                    grpo::token_logprobs(r, &m.ids, cfg.temperature, cfg.logprob_chunk)
                })?),
                (None, true) => {
                    return Err(TrainerError::invalid(
                        "kl_coef is set but the trainer has no reference model (Trainer::with_reference)",
                    ));
                }
                _ => None,
            };
            let x = TokenInputs {
                logp: &logp,
                old_logp: &old,
                rollout_logp: &rollout,
                compare_logp: compare_logp.as_ref(),
                known: Some(&m.known),
                advantages: &adv,
                mask: &m.mask,
                ref_logp: ref_logp.as_ref(),
            };
            let (loss, s) = grpo::grpo_loss_pending(&cfg, &x, total)?;
            loss.f_backward()?;
            if let Some(c) = layers {
                c.backward(&self.model)?;
            }
            pending.push(s);
        }
        // Read after every micro-batch's backward is queued: the first read waits for the
        // device, the others are ready by then.
        for p in &pending {
            let (loss, s) = p.read()?;
            loss_sum += loss;
            stats.add(&s);
        }
        let outcome = self.optimizer.step()?;
        let secs = start.elapsed().as_secs_f64().max(1e-9);
        let padded: usize = batch.iter().map(|s| s.tokens.len()).sum();
        Ok(StepStats {
            step: self.optimizer.steps,
            loss: loss_sum,
            mean_reward: batch.iter().map(|s| s.reward).sum::<f64>() / batch.len() as f64,
            tokens: stats.tokens,
            clip_fraction: stats.clipped / stats.tokens.max(1.0),
            logprob_gap: stats.abs_gap / stats.known.max(1.0),
            tokens_without_logprob: stats.tokens - stats.known,
            kl: stats.kl / stats.tokens.max(1.0),
            grad_norm: outcome.grad_norm,
            skipped: outcome.skipped,
            micro_batches: groups.len(),
            tokens_per_s: padded as f64 / secs,
            mismatch_kl: stats.mismatch_kl / stats.known.max(1.0),
            masked_share: stats.masked / stats.tokens.max(1.0),
            masked_samples: stats.masked_rows as usize,
        })
    }

    /// Writes the model as an HF directory (HF names, `config.json`), in the model's
    /// dtype, sharded past 4 GiB.
    pub fn export(&self, dir: &Path) -> Result<()> {
        crate::weights::write_dir(
            dir,
            self.model.raw_config(),
            &self.model.named_parameters(),
            self.model.kind(),
            4 << 30,
        )
    }

    /// Saves a checkpoint: the HF model directory plus the optimizer state
    /// (`optimizer.safetensors`: fp32 masters, moments, step counters).
    pub fn save_checkpoint(&self, dir: &Path) -> Result<()> {
        self.export(dir)?;
        self.optimizer.save(&dir.join("optimizer.safetensors"))
    }

    /// Resumes from [`Trainer::save_checkpoint`]: load the model from `dir` first
    /// (`Model::load`), build the trainer, then call this.
    pub fn resume(&mut self, dir: &Path) -> Result<()> {
        self.optimizer.load(&dir.join("optimizer.safetensors"))
    }
}

/// Logs a step as one structured line.
pub fn log_step(s: &StepStats) {
    tracing::info!(
        step = s.step,
        loss = s.loss,
        reward = s.mean_reward,
        clip_fraction = s.clip_fraction,
        logprob_gap = s.logprob_gap,
        tokens_without_logprob = s.tokens_without_logprob,
        kl = s.kl,
        grad_norm = s.grad_norm,
        tokens = s.tokens,
        tokens_per_s = s.tokens_per_s,
        skipped = s.skipped,
        "train step"
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ts(len: usize) -> TrainSample {
        TrainSample {
            tokens: vec![1; len],
            loss_mask: vec![1; len],
            rollout_logprobs: None,
            logprob_kind: LogprobKind::PostTemperature,
            advantage: 0.0,
            turn_advantages: None,
            reward: 0.0,
        }
    }

    #[test]
    fn micro_batches_respect_the_token_budget() {
        let batch: Vec<_> = [4, 4, 4, 10, 2, 2].iter().map(|&l| ts(l)).collect();
        assert_eq!(
            micro_batches(&batch, 12),
            vec![vec![0, 1, 2], vec![3], vec![4, 5]]
        );
        assert_eq!(
            micro_batches(&batch, 1),
            vec![vec![0], vec![1], vec![2], vec![3], vec![4], vec![5]]
        );
    }

    fn sample(session: &str, group: Option<&str>, reward: Option<f64>) -> Sample {
        Sample {
            session_id: session.to_owned(),
            group_id: group.map(str::to_owned),
            tokens: vec![1, 2, 3],
            loss_mask: vec![0, 1, 1],
            logprobs: vec![None, Some(-0.5), Some(-0.25)],
            reward,
            ..Sample::default()
        }
    }

    #[test]
    fn selection_groups_sessions_and_drops_groups_without_signal() {
        let samples = vec![
            sample("a", Some("g1"), Some(1.0)),
            sample("a", Some("g1"), Some(1.0)), // a second sample (a fork) of session a
            sample("b", Some("g1"), Some(0.0)),
            sample("c", Some("g2"), Some(1.0)),
            sample("d", Some("g2"), Some(1.0)),
            sample("e", None, Some(1.0)),
            sample("f", Some("g1"), None),
        ];
        let sel = select_samples(&samples, None, 1e-6);
        assert_eq!(sel.groups, 3);
        assert_eq!(sel.groups_dropped, 2, "g2 is flat, e is alone");
        assert_eq!(sel.sessions_without_reward, 1);
        assert_eq!(sel.samples.len(), 3);
        let a = sel.samples[0].advantage;
        assert!(a > 0.0 && (sel.samples[1].advantage - a).abs() < 1e-12);
        assert!(sel.samples[2].advantage < 0.0);
        assert!(sel.samples[0].rollout_logprobs.is_some());
    }

    /// Two turns per session: tokens 1-2 sampled by call 0, 4-5 by call 1.
    fn two_turns(session: &str, reward: Option<f64>, calls: [Option<f64>; 2]) -> Sample {
        Sample {
            session_id: session.to_owned(),
            group_id: Some("g".into()),
            tokens: vec![1, 2, 3, 4, 5, 6],
            loss_mask: vec![0, 1, 1, 0, 1, 1],
            logprobs: vec![None, Some(-0.5), Some(-0.5), None, Some(-0.5), Some(-0.5)],
            call_ids: vec![format!("{session}-c0"), format!("{session}-c1")],
            token_calls: vec![None, Some(0), Some(0), None, Some(1), Some(1)],
            call_rewards: calls.to_vec(),
            reward,
            ..Sample::default()
        }
    }

    #[test]
    fn a_side_thread_kept_for_its_call_rewards_gets_no_share_of_the_sessions_outcome() {
        let mut side = two_turns("a", None, [None, Some(1.0)]);
        side.thread = "side".into();
        side.sample_id = "a/1".into();
        let mut main = two_turns("a", Some(1.0), [None, None]);
        main.thread = "main".into();
        let sel = select_samples(
            &[
                main,
                side,
                two_turns("b", Some(0.0), [None, None]),
                two_turns("b", None, [None, Some(0.0)]),
            ],
            None,
            1e-6,
        );
        let adv: Vec<f64> = sel.samples.iter().map(|s| s.advantage).collect();
        assert!(
            adv[0] > 0.0,
            "the main sample: the session's advantage: {adv:?}"
        );
        assert_eq!(adv[1], 0.0, "the side sample: its turn term only");
        let t = sel.samples[1]
            .turn_advantages
            .as_ref()
            .expect("its turn term");
        assert!(t[4] > 0.0, "{t:?}");
    }

    #[test]
    fn call_rewards_add_a_per_turn_term_on_the_tokens_each_call_sampled() -> Result<()> {
        // Session rewards alone: no turn term.
        let plain = select_samples(
            &[
                two_turns("a", Some(1.0), [None, None]),
                two_turns("b", Some(0.0), [None, None]),
            ],
            None,
            1e-6,
        );
        assert!(plain.samples.iter().all(|s| s.turn_advantages.is_none()));
        // Equal session rewards (no session signal), call rewards that differ: the group
        // trains on the turn term alone, + on the good turns, − on the bad ones.
        let sel = select_samples(
            &[
                two_turns("a", Some(1.0), [Some(1.0), Some(0.0)]),
                two_turns("b", Some(1.0), [Some(1.0), None]),
            ],
            None,
            1e-6,
        );
        assert_eq!((sel.groups, sel.groups_dropped), (1, 0));
        let a = &sel.samples[0];
        assert_eq!(a.advantage, 0.0);
        let t = a.turn_advantages.as_ref().expect("a turn term");
        assert_eq!((t[0], t[3]), (0.0, 0.0), "mask-0 tokens get none");
        assert!(
            t[1] > 0.0 && t[1] == t[2],
            "call 0 was rewarded above the mean: {t:?}"
        );
        assert!(t[4] < 0.0 && t[4] == t[5], "call 1 below it: {t:?}");
        let b = sel.samples[1].turn_advantages.as_ref().expect("b's call 0");
        assert_eq!(b[1], t[1], "normalised over the group's rewarded calls");
        assert_eq!(b[4], 0.0, "an unrewarded call adds nothing");
        // The micro-batch's advantage is the sum, per token.
        let m = build_micro(&sel.samples, &[0], tch::Device::Cpu)?;
        let adv = Vec::<f32>::try_from(m.adv.f_flatten(0, -1)?)?;
        assert_eq!(adv, *t);
        // Call rewards without a session reward: the session takes part (session term 0).
        let only = select_samples(
            &[
                two_turns("a", None, [Some(1.0), Some(0.0)]),
                two_turns("b", None, [Some(0.0), Some(0.0)]),
            ],
            None,
            1e-6,
        );
        assert_eq!((only.samples.len(), only.sessions_without_reward), (2, 0));
        assert!(only.samples[0].turn_advantages.as_ref().unwrap()[1] > 0.0);
        Ok(())
    }

    #[test]
    fn unknown_rollout_logprobs_are_masked_per_token() -> Result<()> {
        let with = |lps: Vec<Option<f32>>| {
            let mut s = sample("a", Some("g"), Some(1.0));
            s.logprobs = lps;
            let mut t = sample("b", Some("g"), Some(0.0));
            t.logprobs = s.logprobs.clone();
            select_samples(&[s, t], None, 1e-6).samples
        };
        // One sampled token known, one not (the backend sent null for it).
        let part = with(vec![None, Some(-0.5), None]);
        assert_eq!(part[0].rollout_logprobs, Some(vec![None, Some(-0.5), None]));
        assert!(
            !part[0].rollout_complete(),
            "bypass has no π_old for token 2"
        );
        let m = build_micro(&part, &[0], tch::Device::Cpu)?;
        let known: Vec<f32> = Vec::<f32>::try_from(m.known.f_flatten(0, -1)?)?;
        assert_eq!(known, vec![0.0, 1.0, 0.0]);
        // None known: no rollout logprobs at all; all known: complete.
        assert_eq!(with(vec![None, None, None])[0].rollout_logprobs, None);
        assert!(with(vec![None, Some(-0.5), Some(0.0)])[0].rollout_complete());
        Ok(())
    }

    /// A tiny random Qwen3 for steps on CPU.
    fn tiny() -> Result<crate::model::Model> {
        let cfg = serde_json::json!({
            "model_type": "qwen3", "vocab_size": 16, "hidden_size": 16, "intermediate_size": 32,
            "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1,
            "head_dim": 8, "rope_theta": 10000.0, "rms_norm_eps": 1e-6,
            "tie_word_embeddings": true
        });
        crate::model::Model::random(cfg, tch::Device::Cpu, tch::Kind::Float, 3)
    }

    #[test]
    fn logprob_gap_is_over_tokens_whose_sampler_logprob_is_known() -> Result<()> {
        let model = tiny()?;
        let tokens = vec![1i64, 5, 7, 9];
        // π_old, recomputed, for the one token whose sampler logprob is known (position 1).
        let ids = Tensor::from_slice(&tokens).f_reshape([1, 4])?;
        let old = tch::no_grad(|| grpo::token_logprobs(&model, &ids, 1.0, 1024))?;
        let old1 = old.f_double_value(&[0, 1])?;
        let sampled = -6.0f32;
        let want = (old1 - f64::from(sampled)).abs();
        assert!(want > 1.0, "a gap that cannot hide: {want}");
        let row = |advantage: f64| TrainSample {
            tokens: tokens.clone(),
            loss_mask: vec![0, 1, 1, 1],
            // Positions 2 and 3 were trained without a sampler logprob.
            rollout_logprobs: Some(vec![None, Some(sampled), None, None]),
            logprob_kind: LogprobKind::PostTemperature,
            advantage,
            turn_advantages: None,
            reward: advantage,
        };
        let config = TrainConfig {
            grpo: GrpoConfig {
                mode: PolicyMode::Recompute,
                ..GrpoConfig::default()
            },
            ..TrainConfig::default()
        };
        let mut trainer = Trainer::new(model, config)?;
        let s = trainer.step(&[row(1.0), row(-1.0)])?;
        assert_eq!(s.tokens, 6.0);
        assert_eq!(s.tokens_without_logprob, 4.0);
        // Averaged over the 6 trained tokens (the unknown ones as gap 0) it would be a third.
        assert!(
            (s.logprob_gap - want).abs() < 1e-4,
            "logprob_gap {} over the known tokens, want {want}",
            s.logprob_gap
        );
        Ok(())
    }
}

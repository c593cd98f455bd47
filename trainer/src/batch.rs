//! The running batch of a decoder, shared by the serving engine ([`crate::engine`]) and
//! the trainer's own sampler ([`crate::generate`]): rows live in the slots of a
//! [`SlotCache`] (row `i` in slot `i`), newcomers are prefilled together straight into free
//! slots, each decode step feeds every row the token it sampled last (kept on the device)
//! and samples the next with one [`Sampler`] pass, and rows that leave are compacted by
//! moving the last rows into their slots (one row's copy each; nothing else moves). The
//! host's work per decode step is a fixed number of tensor ops plus one transfer of the
//! batch's ids and logprobs.

use std::time::Instant;

use tch::{Device, Tensor};

use crate::error::Result;
use crate::generate::SamplingParams;
use crate::model::{Model, SlotCache};
use crate::sampler::{RowState, Sampler};

/// Where the steps of one kind spend their time (seconds, summed).
#[derive(Debug, Clone, Copy, Default, PartialEq, serde::Serialize)]
pub struct Phases {
    pub steps: u64,
    /// Rows that got a token, summed over the steps (mean batch = rows / steps).
    pub rows: u64,
    /// The model's forward pass, the lm_head included.
    pub forward_s: f64,
    /// Choosing the next tokens from the logits (penalties, bias, temperature,
    /// truncation, the draw, the logprobs).
    pub sample_s: f64,
    /// The sampled ids and logprobs brought to the host (one transfer a step).
    pub transfer_s: f64,
    /// Newcomers joining the running batch (their slots, the merge of the batch state).
    pub join_s: f64,
    /// Finished rows leaving (slots compacted, the batch state re-indexed).
    pub leave_s: f64,
    /// The rest: per-row bookkeeping, events sent, stop checks.
    pub bookkeeping_s: f64,
    /// The steps' wall time.
    pub wall_s: f64,
}

impl Phases {
    pub fn add(&mut self, o: &Phases) {
        self.steps += o.steps;
        self.rows += o.rows;
        self.forward_s += o.forward_s;
        self.sample_s += o.sample_s;
        self.transfer_s += o.transfer_s;
        self.join_s += o.join_s;
        self.leave_s += o.leave_s;
        self.bookkeeping_s += o.bookkeeping_s;
        self.wall_s += o.wall_s;
    }

    /// `self - before`, phase by phase.
    pub fn since(&self, before: &Phases) -> Phases {
        Phases {
            steps: self.steps - before.steps,
            rows: self.rows - before.rows,
            forward_s: self.forward_s - before.forward_s,
            sample_s: self.sample_s - before.sample_s,
            transfer_s: self.transfer_s - before.transfer_s,
            join_s: self.join_s - before.join_s,
            leave_s: self.leave_s - before.leave_s,
            bookkeeping_s: self.bookkeeping_s - before.bookkeeping_s,
            wall_s: self.wall_s - before.wall_s,
        }
    }
}

/// Times the phases of a step: [`Clock::lap`] adds the time since the last lap to a
/// phase, synchronizing a CUDA device first when asked (so queued kernels count where
/// they ran, not where they were queued).
pub struct Clock {
    sync: Option<i64>,
    started: Instant,
    at: Instant,
    pub phases: Phases,
}

impl Clock {
    pub fn start(sync: bool, device: Device) -> Clock {
        let sync = match device {
            Device::Cuda(i) if sync => Some(i as i64),
            _ => None,
        };
        let now = Instant::now();
        Clock {
            sync,
            started: now,
            at: now,
            phases: Phases::default(),
        }
    }

    pub fn lap(&mut self, phase: fn(&mut Phases) -> &mut f64) {
        if let Some(i) = self.sync {
            tch::Cuda::synchronize(i);
        }
        let now = Instant::now();
        *phase(&mut self.phases) += (now - self.at).as_secs_f64();
        self.at = now;
    }

    /// The step's phases, its wall time set.
    pub fn finish(mut self, rows: usize) -> Phases {
        self.phases.steps = 1;
        self.phases.rows = rows as u64;
        self.phases.wall_s = self.started.elapsed().as_secs_f64();
        self.phases
    }
}

/// One row: what it was asked, what it has sampled, and the caller's own `tag`.
pub struct Entry<T> {
    pub prompt: Vec<i64>,
    pub out: Vec<i64>,
    pub params: SamplingParams,
    pub tag: T,
}

impl<T> Entry<T> {
    fn state(&self) -> RowState<'_> {
        RowState {
            params: &self.params,
            prompt: &self.prompt,
            out: &self.out,
        }
    }

    /// What the model must have seen before the row's next token: the prompt, then every
    /// token sampled but the last (which is the next input).
    fn context_len(&self) -> i64 {
        (self.prompt.len() + self.out.len()) as i64
    }
}

/// The running batch.
pub struct Running<T> {
    rows: Vec<Entry<T>>,
    cache: SlotCache,
    /// Positions each row has cached (host and device copies).
    lens: Vec<i64>,
    lens_t: Option<Tensor>,
    /// `[rows]`: each row's next input (the token it sampled last), on the device.
    next: Option<Tensor>,
    /// Rebuilt when rows join or leave.
    sampler: Option<Sampler>,
    device: Device,
    vocab: i64,
}

impl<T> Running<T> {
    pub fn new(model: &Model) -> Running<T> {
        Running {
            rows: Vec::new(),
            cache: SlotCache::new(),
            lens: Vec::new(),
            lens_t: None,
            next: None,
            sampler: None,
            device: model.device(),
            vocab: model.spec().vocab_size,
        }
    }

    pub fn rows(&self) -> &[Entry<T>] {
        &self.rows
    }

    pub fn len(&self) -> usize {
        self.rows.len()
    }

    pub fn is_empty(&self) -> bool {
        self.rows.is_empty()
    }

    /// Prefills `new` rows (their prompt and anything they sampled before, e.g. after a
    /// retraction) into the next free slots, samples one token for each (pushed onto its
    /// `out`) and adds them to the batch. Returns (id, logprob) per new row.
    pub fn admit(
        &mut self,
        model: &Model,
        new: Vec<Entry<T>>,
        clock: &mut Clock,
    ) -> Result<Vec<(i64, f32)>> {
        if new.is_empty() {
            return Ok(Vec::new());
        }
        let lens: Vec<i64> = new.iter().map(Entry::context_len).collect();
        let longest = lens.iter().copied().max().unwrap_or(1);
        let mut flat = Vec::with_capacity(new.len() * longest as usize);
        for e in &new {
            flat.extend(e.prompt.iter().chain(&e.out));
            flat.extend(std::iter::repeat_n(
                0i64,
                (longest - e.context_len()) as usize,
            ));
        }
        let ids = Tensor::from_slice(&flat)
            .f_view([new.len() as i64, longest])?
            .f_to_device(self.device)?;
        clock.lap(|p| &mut p.transfer_s);
        let first = self.rows.len() as i64;
        let hidden = model.prefill_slots(&ids, &lens, &mut self.cache, first)?;
        let logits = model.logits(&hidden)?;
        clock.lap(|p| &mut p.forward_s);
        let states: Vec<RowState<'_>> = new.iter().map(Entry::state).collect();
        let mut sampler = Sampler::new(&states, self.vocab, self.device)?;
        let (next, chosen) = sampler.sample(&logits)?;
        clock.lap(|p| &mut p.sample_s);
        let host = crate::sampler::to_host(&next, &chosen)?;
        clock.lap(|p| &mut p.transfer_s);
        let mut new = new;
        for (e, &(id, _)) in new.iter_mut().zip(&host) {
            e.out.push(id);
        }
        self.next = Some(match self.next.take() {
            Some(old) if !self.rows.is_empty() => Tensor::f_cat(&[&old, &next], 0)?,
            _ => next,
        });
        self.rows.extend(new);
        self.lens.extend(lens);
        self.lens_t = None;
        self.sampler = None;
        clock.lap(|p| &mut p.join_s);
        Ok(host)
    }

    /// One decode step: every row gets one token (pushed onto its `out`). Returns
    /// (id, logprob) per row.
    pub fn decode(&mut self, model: &Model, clock: &mut Clock) -> Result<Vec<(i64, f32)>> {
        let (Some(next), false) = (&self.next, self.rows.is_empty()) else {
            return Ok(Vec::new());
        };
        let mut sampler = match self.sampler.take() {
            Some(s) => s,
            None => {
                let states: Vec<RowState<'_>> = self.rows.iter().map(Entry::state).collect();
                Sampler::new(&states, self.vocab, self.device)?
            }
        };
        let lens_t = match self.lens_t.take() {
            Some(t) => t,
            None => Tensor::from_slice(&self.lens).f_to_device(self.device)?,
        };
        clock.lap(|p| &mut p.join_s);
        let longest = self.lens.iter().copied().max().unwrap_or(0);
        let hidden = model.decode_slots(next, &lens_t, longest, &mut self.cache)?;
        let logits = model.logits(&hidden)?;
        clock.lap(|p| &mut p.forward_s);
        let (ids, chosen) = sampler.sample(&logits)?;
        self.sampler = Some(sampler);
        clock.lap(|p| &mut p.sample_s);
        let host = crate::sampler::to_host(&ids, &chosen)?;
        clock.lap(|p| &mut p.transfer_s);
        for (e, &(id, _)) in self.rows.iter_mut().zip(&host) {
            e.out.push(id);
        }
        self.lens.iter_mut().for_each(|l| *l += 1);
        self.lens_t = Some(lens_t.f_add_scalar(1)?);
        self.next = Some(ids);
        Ok(host)
    }

    /// Keeps the rows for which `keep` says so and returns the others (in batch order).
    /// The last kept rows move into the freed slots.
    pub fn retain(&mut self, keep: &[bool]) -> Result<Vec<Entry<T>>> {
        let n = self.rows.len();
        if keep.len() != n || keep.iter().all(|&k| k) {
            return Ok(Vec::new());
        }
        // new_order[slot] = the row's old slot: rows below `kept` stay, each hole below
        // `kept` takes one of the kept rows above it (there are as many of those).
        let kept = keep.iter().filter(|&&k| k).count();
        let mut tail = (kept..n).filter(|&i| keep[i]);
        let mut new_order: Vec<usize> = (0..kept).collect();
        for hole in (0..kept).filter(|&i| !keep[i]) {
            if let Some(from) = tail.next() {
                self.cache
                    .move_row(from as i64, hole as i64, self.lens[from])?;
                new_order[hole] = from;
            }
        }
        let mut old: Vec<Option<Entry<T>>> = std::mem::take(&mut self.rows)
            .into_iter()
            .map(Some)
            .collect();
        self.rows = new_order.iter().filter_map(|&i| old[i].take()).collect();
        let gone: Vec<Entry<T>> = old.into_iter().flatten().collect();
        self.lens = new_order.iter().map(|&i| self.lens[i]).collect();
        if let Some(next) = &self.next
            && kept > 0
        {
            let idx: Vec<i64> = new_order.iter().map(|&i| i as i64).collect();
            let idx = Tensor::from_slice(&idx).f_to_device(self.device)?;
            self.next = Some(next.f_index_select(0, &idx)?);
        } else {
            self.next = None;
        }
        self.lens_t = None;
        self.sampler = None;
        Ok(gone)
    }

    /// Takes every row out (their cache slots are free again; the buffers stay).
    pub fn clear(&mut self) -> Vec<Entry<T>> {
        self.lens.clear();
        self.lens_t = None;
        self.next = None;
        self.sampler = None;
        std::mem::take(&mut self.rows)
    }
}

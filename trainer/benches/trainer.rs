//! Trainer and sampler throughput on model shapes with random weights.
//!
//! For each `--shape`: GRPO optimizer steps (forward, backward, AdamW over fp32 masters)
//! on random sequences → trained tokens/s and, with `--peak-tflops`, MFU (FLOPs per token
//! = 6 × matmul parameters + 6 × layers × seq × attention width, causal); then KV-cache
//! sampling → generated tokens/s. The baseline, measured in the same run, is a bare
//! forward + backward of the same batch (no GRPO loss, no optimizer): `step / bare` is
//! what the loss and AdamW over fp32 masters cost on top. Then the per-step path against
//! the resident trainer (`graft rl`'s `trainer.resident = false | true`): a step plus the
//! checkpoint write and reload the per-step path adds, against the step alone; and the
//! in-process weight handoff (a copy of every parameter into a served model on the same
//! device). `optim s` is AdamW's step alone (gradient norm, clip, update of the fp32
//! masters and moments, copy into the model). `peak mem`: on CUDA the device memory the
//! process holds after the timed steps (nvidia-smi's `used_memory` for this process: the
//! caching allocator's reserve plus the CUDA context; a running maximum over the process,
//! since freed blocks stay cached, so measure one shape per process for exact figures);
//! on the CPU the process's peak resident set during the steps (VmHWM, reset per shape).
//! Prints a Markdown table (and writes it to `--out`) and, as each shape finishes, one
//! JSON line with the same figures on stdout (`grep '^{'`).
//!
//! cargo bench -p graft-trainer --bench trainer -- [--shape NAME]... [--batch B] [--seq T]
//!     [--steps N] [--gen-batch B] [--gen-tokens N] [--peak-tflops F] [--checkpoint-layers]
//!     [--skip-per-step] [--out FILE]
//! `--checkpoint-layers` trains with activation checkpointing (the bare baseline keeps
//! every activation, as before). `--skip-per-step` leaves out the per-step path (a
//! checkpoint of a large shape is many GB written and read back); the handoff stays.
//! Shapes: tiny, qwen3-0.6b, qwen3-1.7b, qwen3-4b (Qwen3 dense configs; vocab 151936).

#[path = "common/shapes.rs"]
mod shapes;

use std::time::Instant;

use graft_trainer::generate;
use graft_trainer::grpo::{GrpoConfig, PolicyMode};
use graft_trainer::model::Model;
use graft_trainer::optim::AdamWConfig;
use graft_trainer::train::{TrainConfig, TrainSample, Trainer};
use shapes::shape;
use tch::Device;

struct Args {
    shapes: Vec<String>,
    batch: usize,
    seq: usize,
    steps: usize,
    gen_batch: usize,
    gen_tokens: usize,
    peak_tflops: Option<f64>,
    checkpoint_layers: bool,
    skip_per_step: bool,
    out: Option<String>,
}

fn args() -> anyhow::Result<Args> {
    let mut a = Args {
        shapes: Vec::new(),
        batch: 4,
        seq: 512,
        steps: 3,
        gen_batch: 8,
        gen_tokens: 64,
        peak_tflops: None,
        checkpoint_layers: false,
        skip_per_step: false,
        out: None,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        if flag == "--bench" {
            continue;
        }
        if flag == "--checkpoint-layers" {
            a.checkpoint_layers = true;
            continue;
        }
        if flag == "--skip-per-step" {
            a.skip_per_step = true;
            continue;
        }
        let mut val = || {
            it.next()
                .ok_or_else(|| anyhow::anyhow!("{flag} needs a value"))
        };
        match flag.as_str() {
            "--shape" => a.shapes.push(val()?),
            "--batch" => a.batch = val()?.parse()?,
            "--seq" => a.seq = val()?.parse()?,
            "--steps" => a.steps = val()?.parse()?,
            "--gen-batch" => a.gen_batch = val()?.parse()?,
            "--gen-tokens" => a.gen_tokens = val()?.parse()?,
            "--peak-tflops" => a.peak_tflops = Some(val()?.parse()?),
            "--out" => a.out = Some(val()?),
            other => anyhow::bail!("unknown flag {other}"),
        }
    }
    if a.shapes.is_empty() {
        a.shapes.push("tiny".to_owned());
    }
    Ok(a)
}

/// Starts a new peak-memory window (the CPU's VmHWM; CUDA's reading cannot be reset).
fn reset_peak_memory(device: Device) {
    if device == Device::Cpu {
        // "5" resets the peak resident set size (Linux 4.0+); where it fails, the peak is
        // the process's since it started.
        let _ = std::fs::write("/proc/self/clear_refs", "5");
    }
}

/// The peak memory of this process in GiB, and what it is (see the module doc).
fn peak_memory_gib(device: Device) -> Option<(f64, &'static str)> {
    match device {
        Device::Cuda(_) => {
            let out = std::process::Command::new("nvidia-smi")
                .args([
                    "--query-compute-apps=pid,used_memory",
                    "--format=csv,noheader,nounits",
                ])
                .output()
                .ok()?;
            let text = String::from_utf8_lossy(&out.stdout);
            let rows: Vec<(u32, f64)> = text
                .lines()
                .filter_map(|l| {
                    let (pid, mib) = l.split_once(',')?;
                    Some((pid.trim().parse().ok()?, mib.trim().parse().ok()?))
                })
                .collect();
            let me = std::process::id();
            match rows.iter().find(|(pid, _)| *pid == me) {
                Some((_, mib)) => Some((mib / 1024.0, "gpu process")),
                // Another PID namespace (a container): every process on the GPU.
                None if !rows.is_empty() => Some((
                    rows.iter().map(|(_, m)| m).sum::<f64>() / 1024.0,
                    "gpu all processes",
                )),
                None => None,
            }
        }
        _ => {
            let status = std::fs::read_to_string("/proc/self/status").ok()?;
            let kib: f64 = status
                .lines()
                .find_map(|l| l.strip_prefix("VmHWM:"))?
                .trim()
                .trim_end_matches("kB")
                .trim()
                .parse()
                .ok()?;
            Some((kib / (1024.0 * 1024.0), "cpu max rss"))
        }
    }
}

fn sync(device: Device) {
    if let Device::Cuda(i) = device {
        tch::Cuda::synchronize(i as i64);
    }
}

fn main() -> anyhow::Result<()> {
    let a = args()?;
    let dev = graft_trainer::device::init();
    let kind = dev.compute_kind();
    let threads = tch::get_num_threads();
    let mut table = String::new();
    table.push_str(&format!(
        "device: {:?} ({kind:?}){}; libtorch threads: {threads}; batch {} × seq {}, {} timed steps after 1 warm-up{}; sampling {} × {} new tokens\n\n",
        dev.device,
        if dev.cpu_reason.is_some() { ", no CUDA" } else { "" },
        a.batch,
        a.seq,
        a.steps,
        if a.checkpoint_layers {
            ", activation checkpointing"
        } else {
            ""
        },
        a.gen_batch,
        a.gen_tokens
    ));
    table.push_str("| shape | params | GRPO step tokens/s | step s | bare fwd+bwd s | step / bare | optim s | peak mem GiB | TFLOP/s | MFU | sample tokens/s | per-step path s | resident / per-step | handoff s |\n|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n");
    for name in &a.shapes {
        let config = shape(name).ok_or_else(|| anyhow::anyhow!("unknown shape {name}"))?;
        let model = Model::random(config, dev.device, kind, 0)?;
        let spec = model.spec().clone();
        let params = spec.num_parameters();
        // Matmul parameters: everything but the embedding lookup and norms, plus the lm_head.
        // (The embedding lookup is no matmul; tied, it is counted once, as the lm_head.)
        let norms = (2 * spec.num_layers + 1) * spec.hidden_size
            + if spec.qk_norm {
                2 * spec.num_layers * spec.head_dim
            } else {
                0
            };
        let lookup = if spec.tie_word_embeddings {
            0
        } else {
            spec.vocab_size * spec.hidden_size
        };
        let matmul = params - norms - lookup;
        let attn = 6 * spec.num_layers * a.seq as i64 * spec.num_heads * spec.head_dim;
        let flops_per_token = (6 * matmul + attn) as f64;
        let config = TrainConfig {
            grpo: GrpoConfig {
                mode: PolicyMode::Bypass,
                ..GrpoConfig::default()
            },
            optim: AdamWConfig {
                lr: 1e-6,
                ..AdamWConfig::default()
            },
            micro_batch_tokens: a.batch * a.seq,
            checkpoint_layers: a.checkpoint_layers,
            ..TrainConfig::default()
        };
        let mut trainer = Trainer::new(model, config)?;
        tch::manual_seed(1);
        let batch: Vec<TrainSample> = (0..a.batch)
            .map(|i| {
                let tokens: Vec<i64> = Vec::try_from(tch::Tensor::randint(
                    spec.vocab_size,
                    [a.seq as i64],
                    (tch::Kind::Int64, Device::Cpu),
                ))
                .unwrap_or_default();
                TrainSample {
                    tokens,
                    loss_mask: vec![1; a.seq],
                    rollout_logprobs: Some(vec![Some(-(spec.vocab_size as f32).ln()); a.seq]),
                    logprob_kind: Default::default(),
                    advantage: if i % 2 == 0 { 1.0 } else { -1.0 },
                    turn_advantages: None,
                    reward: (i % 2) as f64,
                }
            })
            .collect();
        reset_peak_memory(dev.device);
        trainer.step(&batch)?;
        sync(dev.device);
        let start = Instant::now();
        for _ in 0..a.steps {
            trainer.step(&batch)?;
        }
        sync(dev.device);
        let secs = start.elapsed().as_secs_f64() / a.steps.max(1) as f64;
        let peak = peak_memory_gib(dev.device);
        let tokens = (a.batch * a.seq) as f64;
        // Baseline, same run: a bare forward + backward of the same batch (a mean of the
        // log-softmax, no GRPO loss, no optimizer, no micro-batching). It keeps every
        // activation and the whole batch's logits: where that does not fit (a large shape
        // trained with checkpointing) it is reported as n/a.
        let ids: Vec<i64> = batch.iter().flat_map(|s| s.tokens.clone()).collect();
        let ids = tch::Tensor::from_slice(&ids)
            .reshape([a.batch as i64, a.seq as i64])
            .to_device(dev.device);
        let bare = |m: &Model| -> anyhow::Result<()> {
            let lp = m.forward(&ids)?.f_log_softmax(-1, tch::Kind::Float)?;
            lp.f_mean(tch::Kind::Float)?.f_backward()?;
            Ok(())
        };
        let bare_secs = (|| -> anyhow::Result<f64> {
            bare(&trainer.model)?;
            sync(dev.device);
            let start = Instant::now();
            for _ in 0..a.steps {
                bare(&trainer.model)?;
            }
            sync(dev.device);
            Ok(start.elapsed().as_secs_f64() / a.steps.max(1) as f64)
        })()
        .map_err(|e| eprintln!("{name}: the bare forward + backward failed: {e}"))
        .ok();
        // AdamW's step alone, on the gradients the bare passes left (then on zeros: the
        // same work).
        let start = Instant::now();
        for _ in 0..a.steps {
            trainer.optimizer.step()?;
        }
        sync(dev.device);
        let optim_secs = start.elapsed().as_secs_f64() / a.steps.max(1) as f64;
        trainer.optimizer.zero_grad()?;
        let tflops = flops_per_token * tokens / secs / 1e12;
        let mfu = a.peak_tflops.map(|p| 100.0 * tflops / p);
        // The per-step path (what `graft rl` does with trainer.resident = false, and `graft
        // train`): every step also writes a checkpoint (weights + optimizer state) and loads
        // it back (model + optimizer). Side by side: the resident step alone. Handoff: the
        // in-process copy of the weights into a second (served) model on the same device.
        let per_step = if a.skip_per_step {
            None
        } else {
            let tmp = tempfile::tempdir()?;
            let ckpt = tmp.path().join("ckpt");
            let start = Instant::now();
            trainer.save_checkpoint(&ckpt)?;
            let reloaded = Model::load(&ckpt, dev.device, kind)?;
            let mut again = Trainer::new(reloaded, trainer.config.clone())?;
            again.resume(&ckpt)?;
            sync(dev.device);
            Some(secs + start.elapsed().as_secs_f64())
        };
        let handoff = {
            let mut served = Model::random(shape(name).unwrap_or_default(), dev.device, kind, 1)?;
            let start = Instant::now();
            served.copy_params_from(&trainer.model.named_parameters())?;
            sync(dev.device);
            Some(start.elapsed().as_secs_f64())
        };
        let prompts: Vec<Vec<i64>> = (0..a.gen_batch).map(|i| vec![1 + i as i64; 16]).collect();
        let _ = generate::sample(&trainer.model, &prompts, 4, 1.0)?;
        let start = Instant::now();
        let _ = generate::sample(&trainer.model, &prompts, a.gen_tokens, 1.0)?;
        let sampled = (a.gen_batch * a.gen_tokens) as f64 / start.elapsed().as_secs_f64();
        let or_na = |v: Option<String>| v.unwrap_or_else(|| "n/a".to_owned());
        let row = format!(
            "| {name} | {:.1}M | {:.0} | {secs:.3} | {} | {} | {optim_secs:.4} | {} | {tflops:.2} | {} | {sampled:.0} | {} | {} | {} |\n",
            params as f64 / 1e6,
            tokens / secs,
            or_na(bare_secs.map(|b| format!("{b:.3}"))),
            or_na(bare_secs.map(|b| format!("{:.2}×", secs / b))),
            or_na(peak.map(|(g, _)| format!("{g:.2}"))),
            or_na(mfu.map(|m| format!("{m:.1}%"))),
            or_na(per_step.map(|p| format!("{p:.3}"))),
            or_na(per_step.map(|p| format!("{:.2}×", secs / p))),
            or_na(handoff.map(|h| format!("{h:.3}"))),
        );
        eprint!("{row}");
        table.push_str(&row);
        let json = serde_json::json!({
            "shape": name,
            "device": format!("{:?}", dev.device),
            "kind": format!("{kind:?}"),
            "params": params,
            "batch": a.batch,
            "seq": a.seq,
            "steps": a.steps,
            "checkpoint_layers": a.checkpoint_layers,
            "step_tokens_per_s": tokens / secs,
            "step_s": secs,
            "bare_fwd_bwd_s": bare_secs,
            "step_over_bare": bare_secs.map(|b| secs / b),
            "optim_s": optim_secs,
            "peak_mem_gib": peak.map(|(g, _)| g),
            "peak_mem_kind": peak.map(|(_, k)| k),
            "tflops": tflops,
            "mfu_pct": mfu,
            "sample_tokens_per_s": sampled,
            "per_step_path_s": per_step,
            "handoff_s": handoff,
        });
        println!("{json}");
    }
    println!("{table}");
    if let Some(out) = a.out {
        std::fs::write(&out, &table)?;
    }
    Ok(())
}

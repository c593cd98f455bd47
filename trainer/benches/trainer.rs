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
//! device). Prints a Markdown table (and writes it to `--out`).
//!
//! cargo bench -p graft-trainer --bench trainer -- [--shape NAME]... [--batch B] [--seq T]
//!     [--steps N] [--gen-batch B] [--gen-tokens N] [--peak-tflops F] [--out FILE]
//! Shapes: tiny, qwen3-0.6b, qwen3-1.7b (Qwen3 dense configs; vocab 151936).

use std::time::Instant;

use graft_trainer::generate;
use graft_trainer::grpo::{GrpoConfig, PolicyMode};
use graft_trainer::model::Model;
use graft_trainer::optim::AdamWConfig;
use graft_trainer::train::{TrainConfig, TrainSample, Trainer};
use tch::Device;

fn shape(name: &str) -> Option<serde_json::Value> {
    let (hidden, inter, layers, heads, kv, head_dim, vocab) = match name {
        "tiny" => (256, 768, 4, 4, 2, 64, 4096),
        "qwen3-0.6b" => (1024, 3072, 28, 16, 8, 128, 151936),
        "qwen3-1.7b" => (2048, 6144, 28, 16, 8, 128, 151936),
        _ => return None,
    };
    Some(serde_json::json!({
        "model_type": "qwen3", "vocab_size": vocab, "hidden_size": hidden,
        "intermediate_size": inter, "num_hidden_layers": layers, "num_attention_heads": heads,
        "num_key_value_heads": kv, "head_dim": head_dim, "rope_theta": 1000000.0,
        "rms_norm_eps": 1e-6, "tie_word_embeddings": true
    }))
}

struct Args {
    shapes: Vec<String>,
    batch: usize,
    seq: usize,
    steps: usize,
    gen_batch: usize,
    gen_tokens: usize,
    peak_tflops: Option<f64>,
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
        out: None,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        if flag == "--bench" {
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

fn main() -> anyhow::Result<()> {
    let a = args()?;
    let dev = graft_trainer::device::init();
    let kind = dev.compute_kind();
    let threads = tch::get_num_threads();
    let mut table = String::new();
    table.push_str(&format!(
        "device: {:?} ({kind:?}){}; libtorch threads: {threads}; batch {} × seq {}, {} timed steps after 1 warm-up; sampling {} × {} new tokens\n\n",
        dev.device,
        if dev.cpu_reason.is_some() { ", no CUDA" } else { "" },
        a.batch,
        a.seq,
        a.steps,
        a.gen_batch,
        a.gen_tokens
    ));
    table.push_str("| shape | params | GRPO step tokens/s | step s | bare fwd+bwd s | step / bare | TFLOP/s | MFU | sample tokens/s | per-step path s | resident / per-step | handoff s |\n|---|---|---|---|---|---|---|---|---|---|---|---|\n");
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
                    advantage: if i % 2 == 0 { 1.0 } else { -1.0 },
                    turn_advantages: None,
                    reward: (i % 2) as f64,
                }
            })
            .collect();
        trainer.step(&batch)?;
        if let Device::Cuda(_) = dev.device {
            tch::Cuda::synchronize(0);
        }
        let start = Instant::now();
        for _ in 0..a.steps {
            trainer.step(&batch)?;
        }
        if let Device::Cuda(_) = dev.device {
            tch::Cuda::synchronize(0);
        }
        let secs = start.elapsed().as_secs_f64() / a.steps.max(1) as f64;
        let tokens = (a.batch * a.seq) as f64;
        // Baseline, same run: a bare forward + backward of the same batch (a mean of the
        // log-softmax, no GRPO loss, no optimizer, no micro-batching).
        let ids: Vec<i64> = batch.iter().flat_map(|s| s.tokens.clone()).collect();
        let ids = tch::Tensor::from_slice(&ids)
            .reshape([a.batch as i64, a.seq as i64])
            .to_device(dev.device);
        let bare = |m: &Model| -> anyhow::Result<()> {
            let lp = m.forward(&ids)?.log_softmax(-1, tch::Kind::Float);
            lp.mean(tch::Kind::Float).backward();
            Ok(())
        };
        bare(&trainer.model)?;
        if let Device::Cuda(_) = dev.device {
            tch::Cuda::synchronize(0);
        }
        let start = Instant::now();
        for _ in 0..a.steps {
            bare(&trainer.model)?;
        }
        if let Device::Cuda(_) = dev.device {
            tch::Cuda::synchronize(0);
        }
        let bare_secs = start.elapsed().as_secs_f64() / a.steps.max(1) as f64;
        trainer.optimizer.zero_grad()?;
        let tflops = flops_per_token * tokens / secs / 1e12;
        let mfu = a
            .peak_tflops
            .map(|p| format!("{:.1}%", 100.0 * tflops / p))
            .unwrap_or_else(|| "n/a".to_owned());
        // The per-step path (what `graft rl` does with trainer.resident = false, and `graft
        // train`): every step also writes a checkpoint (weights + optimizer state) and loads
        // it back (model + optimizer). Side by side: the resident step alone. Handoff: the
        // in-process copy of the weights into a second (served) model on the same device.
        let tmp = tempfile::tempdir()?;
        let ckpt = tmp.path().join("ckpt");
        let start = Instant::now();
        trainer.save_checkpoint(&ckpt)?;
        let reloaded = Model::load(&ckpt, dev.device, kind)?;
        let mut again = Trainer::new(reloaded, trainer.config.clone())?;
        again.resume(&ckpt)?;
        if let Device::Cuda(_) = dev.device {
            tch::Cuda::synchronize(0);
        }
        let per_step = secs + start.elapsed().as_secs_f64();
        drop(again);
        let mut served = Model::random(shape(name).unwrap_or_default(), dev.device, kind, 1)?;
        let start = Instant::now();
        served.copy_params_from(&trainer.model.named_parameters())?;
        if let Device::Cuda(_) = dev.device {
            tch::Cuda::synchronize(0);
        }
        let handoff = start.elapsed().as_secs_f64();
        drop(served);
        let prompts: Vec<Vec<i64>> = (0..a.gen_batch).map(|i| vec![1 + i as i64; 16]).collect();
        let _ = generate::sample(&trainer.model, &prompts, 4, 1.0)?;
        let start = Instant::now();
        let _ = generate::sample(&trainer.model, &prompts, a.gen_tokens, 1.0)?;
        let sampled = (a.gen_batch * a.gen_tokens) as f64 / start.elapsed().as_secs_f64();
        let row = format!(
            "| {name} | {:.1}M | {:.0} | {secs:.3} | {bare_secs:.3} | {:.2}× | {tflops:.2} | {mfu} | {sampled:.0} | {per_step:.3} | {:.2}× | {handoff:.3} |\n",
            params as f64 / 1e6,
            tokens / secs,
            secs / bare_secs,
            secs / per_step
        );
        eprint!("{row}");
        table.push_str(&row);
    }
    println!("{table}");
    if let Some(out) = a.out {
        std::fs::write(&out, &table)?;
    }
    Ok(())
}

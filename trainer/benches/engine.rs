//! Where a step of the serving engine (`graft serve`'s) spends its time, by batch size.
//!
//! For each `--batch` B: an engine on a random model of `--shape` (max batch B) takes B
//! requests at once (random `--prompt`-token prompts, `--tokens` new tokens each, EOS
//! ignored, sampled at `--temperature` with `--top-p`), and the engine's own step timing
//! ([`graft_trainer::engine::StepTiming`]) over that run is printed per decode step: the
//! forward, sampling, transfers, joining, leaving and the rest. A short warm-up run comes
//! first. Prints a Markdown table and one JSON object per batch (`--json FILE` appends
//! them there too).
//!
//! cargo bench -p graft-trainer --bench engine -- [--shape NAME] [--batch B]...
//!     [--tokens N] [--prompt P] [--temperature T] [--top-p P] [--json FILE]
//! Shapes: tiny-qwen3-vocab (2 layers, hidden 128, Qwen3's 151,936-token vocabulary:
//! the host's share shows), tiny (vocab 4096), qwen3-0.6b, qwen3-1.7b.

#[path = "common/shapes.rs"]
mod shapes;

use std::io::Write;
use std::time::Instant;

use graft_trainer::engine::{Engine, Event, Request};
use graft_trainer::generate::SamplingParams;
use graft_trainer::model::Model;
use shapes::shape;

struct Args {
    shape: String,
    batches: Vec<usize>,
    tokens: usize,
    prompt: usize,
    temperature: f64,
    top_p: f64,
    json: Option<String>,
}

fn args() -> anyhow::Result<Args> {
    let mut a = Args {
        shape: "tiny-qwen3-vocab".to_owned(),
        batches: Vec::new(),
        tokens: 32,
        prompt: 64,
        temperature: 1.0,
        top_p: 1.0,
        json: None,
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
            "--shape" => a.shape = val()?,
            "--batch" => a.batches.push(val()?.parse()?),
            "--tokens" => a.tokens = val()?.parse()?,
            "--prompt" => a.prompt = val()?.parse()?,
            "--temperature" => a.temperature = val()?.parse()?,
            "--top-p" => a.top_p = val()?.parse()?,
            "--json" => a.json = Some(val()?),
            other => anyhow::bail!("unknown flag {other}"),
        }
    }
    if a.batches.is_empty() {
        a.batches = vec![1, 32, 128];
    }
    Ok(a)
}

/// Runs `b` requests through the engine at once and waits for all of them.
fn run(engine: &Engine, a: &Args, b: usize, tokens: usize, vocab: i64) -> anyhow::Result<()> {
    let mut rxs = Vec::with_capacity(b);
    for i in 0..b {
        let input_ids = (0..a.prompt)
            .map(|j| 1 + ((i * 7919 + j * 104_729) as i64 % (vocab - 1)))
            .collect();
        let params = SamplingParams {
            temperature: a.temperature,
            top_p: a.top_p,
            max_new_tokens: tokens,
            ..SamplingParams::default()
        };
        let (_, rx) = engine.generate(Request {
            input_ids,
            params,
            ignore_eos: true,
        })?;
        rxs.push(rx);
    }
    for rx in rxs {
        loop {
            match rx.recv()? {
                Event::Done { .. } => break,
                Event::Token { .. } => {}
            }
        }
    }
    Ok(())
}

fn main() -> anyhow::Result<()> {
    let a = args()?;
    let dev = graft_trainer::device::init();
    let (device, kind) = (dev.device, dev.compute_kind());
    let config = shape(&a.shape).ok_or_else(|| anyhow::anyhow!("unknown shape '{}'", a.shape))?;
    let vocab = config["vocab_size"].as_i64().unwrap_or(2);
    println!(
        "device: {device:?} ({kind:?}); libtorch threads: {}; shape {}; prompt {} tokens, {} new each; temperature {}, top_p {}",
        tch::get_num_threads(),
        a.shape,
        a.prompt,
        a.tokens,
        a.temperature,
        a.top_p
    );
    println!();
    println!(
        "| batch | decode steps | ms / decode step | forward | sampling | transfers | join | leave | bookkeeping | host share | ms / prefill step | tokens/s |"
    );
    println!("|---|---|---|---|---|---|---|---|---|---|---|---|");
    let mut json = match &a.json {
        Some(p) => Some(
            std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(p)?,
        ),
        None => None,
    };
    for &b in &a.batches {
        let model = Model::random(config.clone(), device, kind, 7)?;
        let engine = Engine::start(model, "bench".to_owned(), b)?;
        run(&engine, &a, b.min(4), 4, vocab)?;
        let before = engine.info()?.timing;
        let t0 = Instant::now();
        run(&engine, &a, b, a.tokens, vocab)?;
        let wall = t0.elapsed().as_secs_f64();
        let after = engine.info()?.timing;
        let t = after.decode.since(&before.decode);
        let p = after.prefill.since(&before.prefill);
        let n = t.steps.max(1) as f64;
        let ms = |s: f64| s * 1e3 / n;
        let host = 1.0 - t.forward_s / t.wall_s.max(f64::MIN_POSITIVE);
        let prefill = p.wall_s * 1e3 / p.steps.max(1) as f64;
        let tok_s = (b * a.tokens) as f64 / wall;
        println!(
            "| {b} | {} | {:.2} | {:.2} | {:.2} | {:.2} | {:.2} | {:.2} | {:.2} | {:.0}% | {prefill:.1} | {tok_s:.0} |",
            t.steps,
            ms(t.wall_s),
            ms(t.forward_s),
            ms(t.sample_s),
            ms(t.transfer_s),
            ms(t.join_s),
            ms(t.leave_s),
            ms(t.bookkeeping_s),
            host * 100.0,
        );
        if let Some(f) = json.as_mut() {
            let line = serde_json::json!({
                "what": "engine_step", "shape": a.shape, "batch": b, "device": format!("{device:?}"),
                "tokens": a.tokens, "prompt": a.prompt, "tokens_s": tok_s, "decode": t, "prefill": p,
            });
            writeln!(f, "{line}")?;
        }
    }
    Ok(())
}

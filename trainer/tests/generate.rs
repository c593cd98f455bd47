//! Sampling: a left-padded batch computes exactly what each row computes alone; stop
//! tokens; top-k 1 is greedy.

use std::path::PathBuf;

use graft_trainer::generate::{self, Finish, SamplingParams};
use graft_trainer::model::Model;
use tch::{Device, Kind, Tensor};

fn model(name: &str) -> anyhow::Result<Model> {
    graft_trainer::device::init();
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/models")
        .join(name);
    Ok(Model::load(&dir, Device::Cpu, Kind::Float)?)
}

fn prompts() -> Vec<Vec<i64>> {
    vec![
        vec![5, 9, 13],
        vec![1, 2, 3, 4, 5, 6, 7],
        vec![100, 42, 7, 7, 30],
    ]
}

#[test]
fn padded_forward_equals_each_row_alone() -> anyhow::Result<()> {
    for name in ["llama", "qwen2", "qwen3"] {
        let m = model(name)?;
        let rows = prompts();
        let longest = rows.iter().map(Vec::len).max().unwrap_or(0);
        let pad: Vec<i64> = rows.iter().map(|r| (longest - r.len()) as i64).collect();
        let mut flat = Vec::new();
        for (r, &n) in rows.iter().zip(&pad) {
            flat.extend(std::iter::repeat_n(0i64, n as usize));
            flat.extend(r);
        }
        let ids = Tensor::from_slice(&flat).reshape([rows.len() as i64, longest as i64]);
        let batched = tch::no_grad(|| m.forward_hidden_padded(&ids, &pad, None))?;
        for (i, r) in rows.iter().enumerate() {
            let alone =
                tch::no_grad(|| m.forward_hidden(&Tensor::from_slice(r).unsqueeze(0), None))?;
            let got = batched
                .get(i as i64)
                .narrow(0, pad[i], r.len() as i64)
                .unsqueeze(0);
            let diff = (got - alone).abs().max().double_value(&[]);
            assert!(diff < 1e-4, "{name} row {i}: {diff}");
        }
    }
    Ok(())
}

#[test]
fn batched_greedy_generation_equals_one_prompt_at_a_time() -> anyhow::Result<()> {
    for name in ["llama", "qwen2", "qwen3"] {
        let m = model(name)?;
        let batched = generate::sample(&m, &prompts(), 6, 0.0)?;
        for (i, p) in prompts().iter().enumerate() {
            let alone = generate::sample(&m, std::slice::from_ref(p), 6, 0.0)?;
            assert_eq!(batched[i].tokens, alone[0].tokens, "{name} prompt {i}");
            for (a, b) in batched[i].logprobs.iter().zip(&alone[0].logprobs) {
                assert!((a - b).abs() < 1e-4, "{name} prompt {i}: {a} vs {b}");
            }
        }
    }
    Ok(())
}

#[test]
fn a_stop_token_ends_its_row_only() -> anyhow::Result<()> {
    let m = model("qwen3")?;
    let free = generate::sample(&m, &prompts(), 5, 0.0)?;
    let stop = free[0].tokens[1];
    let params = SamplingParams {
        temperature: 0.0,
        max_new_tokens: 5,
        stop_token_ids: vec![stop],
        ..SamplingParams::default()
    };
    let out = generate::sample_with(&m, &prompts(), &params)?;
    let first = free[0]
        .tokens
        .iter()
        .position(|&t| t == stop)
        .unwrap_or(usize::MAX);
    assert_eq!(out[0].tokens, free[0].tokens[..=first]);
    assert_eq!(out[0].finish, Finish::Stop);
    for (o, f) in out.iter().zip(&free).skip(1) {
        if !f.tokens.contains(&stop) {
            assert_eq!(o.tokens, f.tokens);
            assert_eq!(o.finish, Finish::Length);
        }
    }
    Ok(())
}

#[test]
fn top_k_one_is_greedy() -> anyhow::Result<()> {
    let m = model("llama")?;
    tch::manual_seed(3);
    let params = SamplingParams {
        temperature: 1.0,
        top_k: 1,
        max_new_tokens: 6,
        ..SamplingParams::default()
    };
    let k1 = generate::sample_with(&m, &prompts(), &params)?;
    let greedy = generate::sample(&m, &prompts(), 6, 0.0)?;
    for (a, b) in k1.iter().zip(&greedy) {
        assert_eq!(a.tokens, b.tokens);
    }
    // A tiny top-p keeps only the most likely token too.
    let params = SamplingParams {
        top_p: 1e-6,
        ..params
    };
    let p = generate::sample_with(&m, &prompts(), &params)?;
    for (a, b) in p.iter().zip(&greedy) {
        assert_eq!(a.tokens, b.tokens);
    }
    Ok(())
}

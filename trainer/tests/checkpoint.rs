//! Activation checkpointing (`graft_trainer::model::checkpoint`): the gradients of a loss
//! over the logprobs, with the layers recomputed in the backward, equal the plain
//! backward's; a training step with it reports the same loss and gradient norm.

use std::path::PathBuf;

use graft_trainer::grpo::{self, GrpoConfig, PolicyMode};
use graft_trainer::model::Model;
use graft_trainer::train::{TrainConfig, TrainSample, Trainer};
use tch::{Device, Kind, Tensor};

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/models")
        .join(name)
}

/// A tiny random Qwen3 with tied embeddings (the embedding takes gradients from both ends).
/// libtorch's generator is global and the tests of this file run in parallel: each holds
/// this while it draws (a model from a seed, random ids), so the draws are its own.
static RNG: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn tied() -> anyhow::Result<Model> {
    let cfg = serde_json::json!({
        "model_type": "qwen3", "vocab_size": 48, "hidden_size": 32, "intermediate_size": 64,
        "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 8, "rope_theta": 10000.0, "rms_norm_eps": 1e-6,
        "tie_word_embeddings": true
    });
    Ok(Model::random(cfg, Device::Cpu, Kind::Float, 5)?)
}

/// Every parameter's gradient of `Σ w · logprob` (temperature 0.8, chunks of 5
/// positions), plainly or checkpointed; the gradients are cleared after.
fn gradients(
    model: &Model,
    ids: &Tensor,
    w: &Tensor,
    checkpointed: bool,
) -> anyhow::Result<(f64, Vec<(String, Tensor)>)> {
    let params = model.named_parameters();
    for (_, p) in &params {
        let _ = p.set_requires_grad(true);
    }
    let loss = if checkpointed {
        let layers = model.forward_checkpointed(ids)?;
        let hidden = model.final_norm(layers.last())?;
        let logp = grpo::hidden_logprobs(model, &hidden, ids, 0.8, 5)?;
        let loss = (logp * w).sum(Kind::Float);
        loss.backward();
        layers.backward(model)?;
        loss
    } else {
        let logp = grpo::token_logprobs(model, ids, 0.8, 5)?;
        let loss = (logp * w).sum(Kind::Float);
        loss.backward();
        loss
    };
    let grads = params
        .into_iter()
        .map(|(n, mut p)| {
            let g = p.grad().copy();
            p.zero_grad();
            (n, g)
        })
        .collect();
    Ok((loss.double_value(&[]), grads))
}

#[test]
fn checkpointed_gradients_equal_the_plain_backward() -> anyhow::Result<()> {
    let _rng = RNG.lock().unwrap_or_else(|e| e.into_inner());
    let mut models = vec![("tied qwen3".to_owned(), tied()?)];
    for family in ["qwen3", "qwen2", "llama"] {
        models.push((
            family.to_owned(),
            Model::load(&fixture(family), Device::Cpu, Kind::Float)?,
        ));
    }
    for (name, model) in &models {
        tch::manual_seed(3);
        let vocab = model.spec().vocab_size;
        let ids = Tensor::randint(vocab, [2, 12], (Kind::Int64, Device::Cpu));
        let w = Tensor::randn([2, 12], (Kind::Float, Device::Cpu));
        let (plain_loss, plain) = gradients(model, &ids, &w, false)?;
        let (ckpt_loss, ckpt) = gradients(model, &ids, &w, true)?;
        assert!(
            (plain_loss - ckpt_loss).abs() < 1e-6,
            "{name}: loss {plain_loss} vs {ckpt_loss}"
        );
        assert_eq!(plain.len(), ckpt.len());
        for ((n, a), (_, b)) in plain.iter().zip(&ckpt) {
            assert!(a.defined() && b.defined(), "{name}: {n} has no gradient");
            let diff = (a - b).abs().max().double_value(&[]);
            let scale = a.abs().max().double_value(&[]);
            assert!(
                scale > 0.0,
                "{name}: {n}'s gradient is zero: the test shows nothing"
            );
            assert!(
                diff <= 1e-5,
                "{name}: {n} differs by {diff} (gradient scale {scale})"
            );
        }
    }
    Ok(())
}

#[test]
fn a_checkpointed_step_reports_the_plain_steps_loss_and_gradient_norm() -> anyhow::Result<()> {
    let _rng = RNG.lock().unwrap_or_else(|e| e.into_inner());
    let batch: Vec<TrainSample> = (0..3)
        .map(|i| {
            let tokens: Vec<i64> = (0..10).map(|j| (7 * i + 3 * j + 1) % 48).collect();
            TrainSample {
                loss_mask: (0..10).map(|j| u8::from(j >= 3)).collect(),
                rollout_logprobs: Some(vec![Some(-3.5); tokens.len()]),
                logprob_kind: Default::default(),
                tokens,
                advantage: [1.0, -0.5, -0.5][i as usize],
                turn_advantages: None,
                reward: i as f64,
            }
        })
        .collect();
    let run = |checkpoint_layers: bool| -> anyhow::Result<Vec<(f64, f64)>> {
        let config = TrainConfig {
            grpo: GrpoConfig {
                mode: PolicyMode::Recompute,
                logprob_chunk: 4,
                ..GrpoConfig::default()
            },
            // Two micro-batches: gradients accumulate across them.
            micro_batch_tokens: 20,
            checkpoint_layers,
            ..TrainConfig::default()
        };
        let mut trainer = Trainer::new(tied()?, config)?;
        (0..2)
            .map(|_| {
                let s = trainer.step(&batch)?;
                assert_eq!(s.micro_batches, 2);
                Ok((s.loss, s.grad_norm))
            })
            .collect()
    };
    let (plain, ckpt) = (run(false)?, run(true)?);
    for ((l0, g0), (l1, g1)) in plain.iter().zip(&ckpt) {
        assert!((l0 - l1).abs() < 1e-6, "loss {l0} vs {l1}");
        assert!(
            (g0 - g1).abs() < 1e-5 * g0.max(1.0),
            "grad norm {g0} vs {g1}"
        );
    }
    Ok(())
}

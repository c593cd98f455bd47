//! GRPO learns: a tiny random Qwen3 on a toy verifiable task (answer with tokens from a
//! target band) raises its mean reward clearly over a few dozen steps, on CPU, seeded.
//! Rollouts are sampled with the KV cache; π_old is recomputed by the trainer, and its
//! logprobs match the sampler's.

use graft_trainer::generate;
use graft_trainer::grpo::{self, GrpoConfig, PolicyMode};
use graft_trainer::model::Model;
use graft_trainer::optim::AdamWConfig;
use graft_trainer::train::{TrainConfig, TrainSample, Trainer};
use tch::{Device, Kind};

const VOCAB: i64 = 32;
const TARGET: std::ops::Range<i64> = 20..25;

fn tiny_qwen3() -> serde_json::Value {
    serde_json::json!({
        "model_type": "qwen3", "vocab_size": VOCAB, "hidden_size": 32, "intermediate_size": 64,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
        "rope_theta": 10000.0, "rms_norm_eps": 1e-6, "tie_word_embeddings": true
    })
}

/// libtorch's RNG is global: the two runs take turns, so each is reproducible.
static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn reward(tokens: &[i64]) -> f64 {
    tokens.iter().filter(|t| TARGET.contains(t)).count() as f64 / tokens.len() as f64
}

#[test]
fn grpo_raises_reward_on_a_toy_task() -> anyhow::Result<()> {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    graft_trainer::device::init();
    let model = Model::random(tiny_qwen3(), Device::Cpu, Kind::Float, 7)?;
    let config = TrainConfig {
        grpo: GrpoConfig {
            mode: PolicyMode::Recompute,
            ..GrpoConfig::default()
        },
        optim: AdamWConfig {
            lr: 3e-3,
            weight_decay: 0.0,
            ..AdamWConfig::default()
        },
        ..TrainConfig::default()
    };
    let mut trainer = Trainer::new(model, config)?;
    tch::manual_seed(11);
    let (groups, per_group, new_tokens) = (4usize, 8usize, 3usize);
    let mut curve = Vec::new();
    for step in 0..30 {
        let prompts: Vec<Vec<i64>> = (0..groups * per_group)
            .map(|i| vec![1, 2 + ((step * groups + i / per_group) as i64 % 16)])
            .collect();
        let gens = generate::sample(&trainer.model, &prompts, new_tokens, 1.0)?;
        let rewards: Vec<f64> = gens.iter().map(|g| reward(&g.tokens)).collect();
        let group_ids: Vec<usize> = (0..prompts.len()).map(|i| i / per_group).collect();
        let names: Vec<String> = group_ids.iter().map(|g| g.to_string()).collect();
        let adv = grpo::group_advantages(&rewards, &names, 1e-6);
        let batch: Vec<TrainSample> = prompts
            .iter()
            .zip(&gens)
            .zip(adv.iter().zip(&rewards))
            .map(|((p, g), (&a, &r))| {
                let mut tokens = p.clone();
                tokens.extend(&g.tokens);
                let mut mask = vec![0u8; p.len()];
                mask.extend(std::iter::repeat_n(1u8, g.tokens.len()));
                let mut lps = vec![None; p.len()];
                lps.extend(g.logprobs.iter().map(|&l| Some(l)));
                TrainSample {
                    tokens,
                    loss_mask: mask,
                    rollout_logprobs: Some(lps),
                    logprob_kind: Default::default(),
                    advantage: a,
                    turn_advantages: None,
                    reward: r,
                }
            })
            .collect();
        let stats = trainer.step(&batch)?;
        assert!(!stats.skipped);
        // The trainer's π_old and the sampler's logprobs are the same model in f32.
        assert!(
            stats.logprob_gap < 1e-4,
            "step {step}: trainer/rollout logprob gap {}",
            stats.logprob_gap
        );
        curve.push(stats.mean_reward);
    }
    let first: f64 = curve[..5].iter().sum::<f64>() / 5.0;
    let last: f64 = curve[curve.len() - 5..].iter().sum::<f64>() / 5.0;
    eprintln!("mean reward per step: {curve:.2?}");
    assert!(
        last > first + 0.3 && last > 0.5,
        "mean reward went from {first:.3} (first 5 steps) to {last:.3} (last 5): GRPO did not learn"
    );
    Ok(())
}

/// The same task with the serving engine in the loop: rollouts come from the engine
/// (batched), and after every step the trainer writes its weights as an HF directory that
/// the engine reloads. The engine's logprobs must equal the trainer's π_old at every step
/// (so the served weights are the trained ones), and the reward must rise.
#[test]
fn grpo_learns_through_the_engine_with_a_weight_reload_every_step() -> anyhow::Result<()> {
    use graft_trainer::engine::{Engine, Event, PauseMode, Request};
    use graft_trainer::generate::SamplingParams;

    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    graft_trainer::device::init();
    let tmp = tempfile::tempdir()?;
    let model = Model::random(tiny_qwen3(), Device::Cpu, Kind::Float, 7)?;
    let config = TrainConfig {
        grpo: GrpoConfig {
            mode: PolicyMode::Recompute,
            ..GrpoConfig::default()
        },
        optim: AdamWConfig {
            lr: 3e-3,
            weight_decay: 0.0,
            ..AdamWConfig::default()
        },
        ..TrainConfig::default()
    };
    let mut trainer = Trainer::new(model, config)?;
    let v0 = tmp.path().join("v0");
    trainer.export(&v0)?;
    let engine = Engine::start(
        Model::load(&v0, Device::Cpu, Kind::Float)?,
        "v0".to_owned(),
        64,
    )?;
    tch::manual_seed(11);
    let (groups, per_group) = (4usize, 8usize);
    let mut curve = Vec::new();
    for step in 0..30usize {
        let prompts: Vec<Vec<i64>> = (0..groups * per_group)
            .map(|i| vec![1, 2 + ((step * groups + i / per_group) as i64 % 16)])
            .collect();
        engine.pause(PauseMode::InPlace)?;
        let rxs = prompts
            .iter()
            .map(|p| {
                engine.generate(Request {
                    input_ids: p.clone(),
                    params: SamplingParams {
                        temperature: 1.0,
                        max_new_tokens: 3,
                        ..SamplingParams::default()
                    },
                    ignore_eos: true,
                })
            })
            .collect::<Result<Vec<_>, _>>()?;
        engine.resume()?;
        let mut batch = Vec::new();
        let mut rewards = Vec::new();
        for (p, (_, rx)) in prompts.iter().zip(rxs) {
            let (mut toks, mut lps) = (Vec::new(), Vec::new());
            loop {
                match rx.recv()? {
                    Event::Token { id, logprob, .. } => {
                        toks.push(id);
                        lps.push(logprob);
                    }
                    Event::Done { weight_version, .. } => {
                        let want = if step == 0 {
                            "v0".to_owned()
                        } else {
                            format!("step-{step}")
                        };
                        assert_eq!(weight_version, want);
                        break;
                    }
                }
            }
            rewards.push(reward(&toks));
            let mut tokens = p.clone();
            tokens.extend(&toks);
            let mut mask = vec![0u8; p.len()];
            mask.extend(std::iter::repeat_n(1u8, toks.len()));
            let mut rollout = vec![None; p.len()];
            rollout.extend(lps.iter().map(|&l| Some(l)));
            batch.push(TrainSample {
                tokens,
                loss_mask: mask,
                rollout_logprobs: Some(rollout),
                logprob_kind: Default::default(),
                advantage: 0.0,
                turn_advantages: None,
                reward: 0.0,
            });
        }
        let names: Vec<String> = (0..prompts.len())
            .map(|i| (i / per_group).to_string())
            .collect();
        for ((s, a), r) in batch
            .iter_mut()
            .zip(grpo::group_advantages(&rewards, &names, 1e-6))
            .zip(&rewards)
        {
            s.advantage = a;
            s.reward = *r;
        }
        let stats = trainer.step(&batch)?;
        assert!(
            stats.logprob_gap < 1e-4,
            "step {step}: served and trained logprobs differ by {}",
            stats.logprob_gap
        );
        curve.push(stats.mean_reward);
        let dir = tmp.path().join(format!("step-{}", step + 1));
        trainer.export(&dir)?;
        engine.update_weights(dir, format!("step-{}", step + 1))?;
    }
    let first: f64 = curve[..5].iter().sum::<f64>() / 5.0;
    let last: f64 = curve[curve.len() - 5..].iter().sum::<f64>() / 5.0;
    eprintln!("mean reward per step (engine): {curve:.2?}");
    assert!(
        last > first + 0.3 && last > 0.5,
        "mean reward went from {first:.3} to {last:.3}"
    );
    Ok(())
}

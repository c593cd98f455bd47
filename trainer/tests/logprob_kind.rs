//! Rollout logprobs are compared like with like: pre-temperature ones (vLLM's default
//! `raw_logprobs`) with the trainer's logprobs at temperature 1, post-temperature ones with
//! the trainer's at the run's temperature, in every place they enter a step (bypass π_old,
//! the recompute mode's importance weight, the rejection bound, the mismatch statistics),
//! while the objective stays at the run's temperature. Expectations come from the tiny
//! fixture model itself.

use std::path::PathBuf;

use graft_reconstruct::sample::LogprobKind;
use graft_trainer::grpo::{self, GrpoConfig, Level, PolicyMode, Reject};
use graft_trainer::model::Model;
use graft_trainer::optim::AdamWConfig;
use graft_trainer::train::{StepStats, TrainConfig, TrainSample, Trainer};
use tch::{Device, Kind, Tensor};

const TEMPERATURE: f64 = 0.5;
const TOKENS: [i64; 10] = [3, 17, 99, 4, 150, 8, 60, 1, 42, 77];
/// The prompt's length: the tokens after it are trained.
const PROMPT: usize = 3;
/// The rejection bound: tighter than any real mismatch, looser than float noise.
const BOUND: (f64, f64) = (0.999, 1.001);

fn fixture_model() -> anyhow::Result<Model> {
    graft_trainer::device::init();
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/models/qwen2");
    Ok(Model::load(&dir, Device::Cpu, Kind::Float)?)
}

/// The model's own logprobs of `TOKENS` at `temperature`, aligned to the tokens.
fn own_logprobs(model: &Model, temperature: f64) -> anyhow::Result<Vec<f64>> {
    let ids = Tensor::from_slice(&TOKENS).reshape([1, TOKENS.len() as i64]);
    let lp = tch::no_grad(|| grpo::token_logprobs(model, &ids, temperature, 1024))?;
    Ok(Vec::<f64>::try_from(
        lp.flatten(0, -1).to_kind(Kind::Double),
    )?)
}

/// One step on a group of two rollouts of `TOKENS` (advantages +1 and −0.5: the gradient does not cancel) whose rollout
/// logprobs are `rollout`, labelled `kind`.
fn step(
    mode: PolicyMode,
    rollout: &[f64],
    kind: LogprobKind,
) -> anyhow::Result<(StepStats, Vec<Tensor>)> {
    let model = fixture_model()?;
    let config = TrainConfig {
        grpo: GrpoConfig {
            mode,
            temperature: TEMPERATURE,
            reject: Some(Reject {
                level: Level::Token,
                low: BOUND.0,
                high: BOUND.1,
            }),
            ..GrpoConfig::default()
        },
        // A step large enough to see.
        optim: AdamWConfig {
            lr: 1e-3,
            ..AdamWConfig::default()
        },
        ..TrainConfig::default()
    };
    let row = |advantage: f64| TrainSample {
        tokens: TOKENS.to_vec(),
        loss_mask: (0..TOKENS.len()).map(|j| u8::from(j >= PROMPT)).collect(),
        rollout_logprobs: Some(
            (0..TOKENS.len())
                .map(|j| (j >= PROMPT).then_some(rollout[j] as f32))
                .collect(),
        ),
        logprob_kind: kind,
        advantage,
        turn_advantages: None,
        reward: advantage,
    };
    let mut trainer = Trainer::new(model, config)?;
    let stats = trainer.step(&[row(1.0), row(-0.5)])?;
    let weights = trainer
        .model
        .named_parameters()
        .into_iter()
        .map(|(_, t)| t.detach().copy())
        .collect();
    Ok((stats, weights))
}

fn max_diff(a: &[Tensor], b: &[Tensor]) -> f64 {
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs().max().double_value(&[]))
        .fold(0.0, f64::max)
}

#[test]
fn pre_temperature_rollout_logprobs_are_compared_at_temperature_one() -> anyhow::Result<()> {
    let model = fixture_model()?;
    let raw = own_logprobs(&model, 1.0)?;
    let scaled = own_logprobs(&model, TEMPERATURE)?;
    drop(model);
    // What labelling the raw logprobs post-temperature would make of them: per trained
    // token the trainer/rollout log-ratio `scaled − raw`.
    let trained = PROMPT..TOKENS.len();
    let n = trained.len() as f64;
    let log_ratio: Vec<f64> = trained.clone().map(|j| scaled[j] - raw[j]).collect();
    let gap = log_ratio.iter().map(|d| d.abs()).sum::<f64>() / n;
    let k3 = log_ratio.iter().map(|d| d.exp() - 1.0 - d).sum::<f64>() / n;
    let outside = log_ratio
        .iter()
        .filter(|d| !(BOUND.0..=BOUND.1).contains(&d.exp()))
        .count() as f64;
    // Bypass: the PPO ratio is the trainer/rollout ratio; with advantage +1 a token is
    // clipped above 1.28, with −1 below 0.8 (the two rows of the group).
    let clipped = log_ratio
        .iter()
        .map(|d| f64::from(u8::from(d.exp() > 1.28)) + f64::from(u8::from(d.exp() < 0.8)))
        .sum::<f64>()
        / (2.0 * n);
    assert!(
        gap > 0.05 && outside > 0.0 && clipped > 0.0,
        "temperature {TEMPERATURE} must move this model's logprobs visibly: gap {gap}, outside {outside}, clipped {clipped}"
    );

    for mode in [PolicyMode::Bypass, PolicyMode::Recompute] {
        // The model's own raw logprobs, labelled pre-temperature: on-policy, ratio 1.
        let (pre, _) = step(mode, &raw, LogprobKind::PreTemperature)?;
        assert_eq!(pre.tokens, 2.0 * n);
        assert_eq!(pre.clip_fraction, 0.0, "{mode:?}: no ratio clipped");
        assert_eq!(
            pre.masked_share, 0.0,
            "{mode:?}: no token outside {BOUND:?}"
        );
        assert!(
            pre.mismatch_kl.abs() < 1e-6,
            "{mode:?}: {}",
            pre.mismatch_kl
        );
        assert!(pre.logprob_gap < 1e-5, "{mode:?}: {}", pre.logprob_gap);

        // The same numbers labelled post-temperature: compared at the run's temperature.
        let (post, _) = step(mode, &raw, LogprobKind::PostTemperature)?;
        let close = |got: f64, want: f64| (got - want).abs() <= 1e-4 * want.abs().max(1.0);
        assert!(
            close(post.mismatch_kl, k3),
            "{mode:?}: mismatch_kl {} want {k3}",
            post.mismatch_kl
        );
        assert_eq!(post.masked_share, outside / n, "{mode:?}");
        match mode {
            PolicyMode::Bypass => {
                assert_eq!(post.clip_fraction, clipped, "bypass: the ratio is off 1");
                assert_eq!(post.logprob_gap, 0.0, "no π_old to compare in bypass");
            }
            PolicyMode::Recompute => {
                assert_eq!(post.clip_fraction, 0.0, "recompute: π_old is the trainer's");
                assert!(
                    close(post.logprob_gap, gap),
                    "recompute: gap {} want {gap}",
                    post.logprob_gap
                );
            }
        }
    }
    Ok(())
}

/// The objective stays at the run's temperature: on-policy rollouts reported raw
/// (pre-temperature) train the weights exactly as the same rollouts reported at the run's
/// temperature (post-temperature), in either policy mode.
#[test]
fn the_objective_stays_at_the_run_temperature_whatever_the_rollout_convention() -> anyhow::Result<()>
{
    // One intra-op thread: the two steps then reduce in the same order, so the comparison
    // below is exact arithmetic, not a race between thread pools. With several threads on a
    // loaded machine, an element whose gradient is ~0 can take opposite signs in the two
    // runs, and AdamW's first step moves it by a whole learning rate either way.
    tch::set_num_threads(1);
    let model = fixture_model()?;
    let raw = own_logprobs(&model, 1.0)?;
    let scaled = own_logprobs(&model, TEMPERATURE)?;
    let before: Vec<Tensor> = model
        .named_parameters()
        .into_iter()
        .map(|(_, t)| t.detach().copy())
        .collect();
    drop(model);
    for mode in [PolicyMode::Bypass, PolicyMode::Recompute] {
        let (pre, w_pre) = step(mode, &raw, LogprobKind::PreTemperature)?;
        let (post, w_post) = step(mode, &scaled, LogprobKind::PostTemperature)?;
        assert!(!pre.skipped && !post.skipped);
        assert!(
            max_diff(&w_pre, &before) > 1e-6,
            "{mode:?}: the step moved nothing"
        );
        let d = max_diff(&w_pre, &w_post);
        assert!(d < 1e-6, "{mode:?}: weights differ by {d}");
        assert!((pre.loss - post.loss).abs() < 1e-6, "{mode:?}");
        assert!((pre.grad_norm - post.grad_norm).abs() < 1e-5 * post.grad_norm.max(1.0));
    }
    Ok(())
}

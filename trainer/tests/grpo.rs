//! The GRPO objective against hand-computed values.

use std::path::PathBuf;

use graft_trainer::grpo::{self, GrpoConfig, PolicyMode, TokenInputs};
use graft_trainer::model::Model;
use tch::{Device, Kind, Tensor};

fn t(v: &[f64]) -> Tensor {
    Tensor::from_slice(v).to_kind(Kind::Float).unsqueeze(0)
}

fn close(a: f64, b: f64) -> bool {
    (a - b).abs() < 1e-5
}

/// Five trained tokens with ratios 1.5, 0.5, 1.1, 0.5, 1.5 and advantages +1, −1, +1, +1,
/// −1: the first is clipped high (1.28), the second clipped low (0.8), the rest not.
#[test]
fn ppo_clip_on_both_sides() -> anyhow::Result<()> {
    let old = [-1.0, -2.0, -0.5, -1.5, -3.0, -0.7];
    let ratios = [1.0, 1.5, 0.5, 1.1, 0.5, 1.5];
    let logp_v: Vec<f64> = old
        .iter()
        .zip(ratios)
        .map(|(o, r)| o + f64::ln(r))
        .collect();
    let logp = t(&logp_v).set_requires_grad(true);
    let old_t = t(&old);
    let adv = t(&[0.0, 1.0, -1.0, 1.0, 1.0, -1.0]);
    let mask = t(&[0.0, 1.0, 1.0, 1.0, 1.0, 1.0]);
    let cfg = GrpoConfig::default();
    let x = TokenInputs {
        logp: &logp,
        old_logp: &old_t,
        rollout_logp: &old_t,
        compare_logp: None,
        known: None,
        advantages: &adv,
        mask: &mask,
        ref_logp: None,
    };
    let (loss, stats) = grpo::grpo_loss(&cfg, &x, 5.0)?;
    // −1.28 + 0.8 − 1.1 − 0.5 + 1.5 = −0.58, over 5 tokens.
    let l = loss.double_value(&[]);
    assert!(close(l, -0.116), "loss {l}");
    assert_eq!(stats.tokens, 5.0);
    assert_eq!(stats.clipped, 2.0);
    loss.backward();
    let g: Vec<f64> = Vec::try_from(logp.grad().squeeze().to_kind(Kind::Double))?;
    // d/dlogp of −r·A/5 = −r·A/5 where unclipped, 0 where the clipped term is active.
    let want = [0.0, 0.0, 0.0, -1.1 / 5.0, -0.5 / 5.0, 1.5 / 5.0];
    for (i, (a, b)) in g.iter().zip(want).enumerate() {
        assert!(close(*a, b), "grad[{i}] = {a}, want {b}");
    }
    Ok(())
}

/// Recompute mode weights each token by min(exp(logp_old − logp_rollout), 2).
#[test]
fn truncated_importance_weight() -> anyhow::Result<()> {
    let old = t(&[0.0, -1.0, -1.0, -1.0]);
    let rollout = t(&[
        0.0,
        -1.0 - f64::ln(1.5),
        -1.0 - f64::ln(3.0),
        -1.0 + f64::ln(2.0),
    ]);
    let logp = old.copy().set_requires_grad(true);
    let adv = t(&[0.0, 1.0, 1.0, 1.0]);
    let mask = t(&[0.0, 1.0, 1.0, 1.0]);
    let cfg = GrpoConfig {
        mode: PolicyMode::Recompute,
        ..GrpoConfig::default()
    };
    let x = TokenInputs {
        logp: &logp,
        old_logp: &old,
        rollout_logp: &rollout,
        compare_logp: None,
        known: None,
        advantages: &adv,
        mask: &mask,
        ref_logp: None,
    };
    let (loss, stats) = grpo::grpo_loss(&cfg, &x, 3.0)?;
    // Weights 1.5, 2 (3 capped), 0.5; ratio 1, advantage 1.
    assert!(close(loss.double_value(&[]), -(1.5 + 2.0 + 0.5) / 3.0));
    assert!(close(stats.tis_weight, 4.0));
    assert!(close(
        stats.abs_gap,
        f64::ln(1.5) + f64::ln(3.0) + f64::ln(2.0)
    ));
    // Bypass ignores the rollout/old difference.
    let bypass = GrpoConfig::default();
    let (loss, stats) = grpo::grpo_loss(&bypass, &x, 3.0)?;
    assert!(close(loss.double_value(&[]), -1.0));
    assert_eq!(stats.abs_gap, 0.0);
    Ok(())
}

#[test]
fn k3_kl_term() -> anyhow::Result<()> {
    let logp = t(&[0.0, -1.0]).set_requires_grad(true);
    let reference = t(&[0.0, -1.0 + f64::ln(2.0)]);
    let zero = t(&[0.0, 0.0]);
    let mask = t(&[0.0, 1.0]);
    let cfg = GrpoConfig {
        kl_coef: 0.5,
        ..GrpoConfig::default()
    };
    let x = TokenInputs {
        logp: &logp,
        old_logp: &logp,
        rollout_logp: &logp,
        compare_logp: None,
        known: None,
        advantages: &zero,
        mask: &mask,
        ref_logp: Some(&reference),
    };
    let (loss, stats) = grpo::grpo_loss(&cfg, &x, 1.0)?;
    let k3 = 2.0 - f64::ln(2.0) - 1.0;
    assert!(close(stats.kl, k3));
    assert!(close(loss.double_value(&[]), 0.5 * k3));
    Ok(())
}

#[test]
fn group_normalised_advantages() {
    let rewards = [1.0, 0.0, 0.0, 1.0, 5.0, 2.0, 2.0];
    let groups = ["a", "a", "a", "a", "b", "c", "c"];
    let adv = grpo::group_advantages(&rewards, &groups, 0.0);
    let std = (1.0f64 / 3.0).sqrt(); // Bessel: 4 × 0.25 / 3
    assert!(close(adv[0], 0.5 / std) && close(adv[1], -0.5 / std));
    assert!(close(adv[3], 0.5 / std));
    assert_eq!(
        &adv[4..],
        &[0.0, 0.0, 0.0],
        "single or flat groups carry no signal"
    );
}

fn fixture_model() -> anyhow::Result<Model> {
    graft_trainer::device::init();
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/models/qwen2");
    Ok(Model::load(&dir, Device::Cpu, Kind::Float)?)
}

/// Chunked, temperature-scaled logprobs equal log_softmax(logits / T) of the full forward.
#[test]
fn chunked_logprobs_equal_full_log_softmax() -> anyhow::Result<()> {
    let model = fixture_model()?;
    let ids = Tensor::from_slice(&[3i64, 17, 99, 4, 150, 8, 8, 60, 1, 2]).reshape([2, 5]);
    let temp = 0.7;
    let got = tch::no_grad(|| grpo::token_logprobs(&model, &ids, temp, 3))?;
    let logits = tch::no_grad(|| model.forward(&ids))?;
    let lp = (logits / temp).log_softmax(-1, Kind::Float);
    let want = lp
        .narrow(1, 0, 4)
        .gather(-1, &ids.narrow(1, 1, 4).unsqueeze(-1), false)
        .squeeze_dim(-1);
    assert_eq!(got.size(), vec![2, 5]);
    assert_eq!(
        got.narrow(1, 0, 1).abs().sum(Kind::Float).double_value(&[]),
        0.0
    );
    let diff = (got.narrow(1, 1, 4) - want).abs().max().double_value(&[]);
    assert!(diff < 1e-5, "{diff}");
    Ok(())
}

fn grads(model: &Model) -> Vec<Tensor> {
    model
        .named_parameters()
        .iter()
        .map(|(_, p)| {
            let g = p.grad();
            let out = g.copy();
            let mut g = g;
            let _ = g.zero_();
            out
        })
        .collect()
}

/// The token mean is over the whole step: two micro-batches, each divided by the step's
/// token count, give the same loss and gradients as one batch; dividing each by its own
/// count does not.
#[test]
fn token_mean_across_micro_batches_equals_one_batch() -> anyhow::Result<()> {
    let model = fixture_model()?;
    for (_, p) in model.named_parameters() {
        let _ = p.set_requires_grad(true);
    }
    tch::manual_seed(3);
    let ids = Tensor::randint(160, [4, 9], (Kind::Int64, Device::Cpu));
    // Different numbers of trained tokens per row: 6, 2, 4, 1.
    let mask_rows: [&[f64]; 4] = [
        &[0., 0., 0., 1., 1., 1., 1., 1., 1.],
        &[0., 0., 0., 0., 0., 0., 0., 1., 1.],
        &[0., 0., 1., 1., 0., 0., 1., 1., 0.],
        &[0., 0., 0., 0., 0., 0., 0., 0., 1.],
    ];
    let mask = Tensor::stack(
        &mask_rows
            .iter()
            .map(|r| Tensor::from_slice(r).to_kind(Kind::Float))
            .collect::<Vec<_>>(),
        0,
    );
    let adv = Tensor::from_slice(&[1.0f32, -0.5, 2.0, -1.5])
        .unsqueeze(1)
        .expand([4, 9], false);
    let old = tch::no_grad(|| grpo::token_logprobs(&model, &ids, 1.0, 1024))? - 0.1;
    let cfg = GrpoConfig::default();
    let total = mask.sum(Kind::Float).double_value(&[]);
    assert_eq!(total, 13.0);
    let run = |rows: std::ops::Range<i64>, denom: Option<f64>| -> anyhow::Result<f64> {
        let n = rows.end - rows.start;
        let ids = ids.narrow(0, rows.start, n);
        let logp = grpo::token_logprobs(&model, &ids, 1.0, 4)?;
        let m = mask.narrow(0, rows.start, n);
        let o = old.narrow(0, rows.start, n);
        let a = adv.narrow(0, rows.start, n);
        let x = TokenInputs {
            logp: &logp,
            old_logp: &o,
            rollout_logp: &o,
            compare_logp: None,
            known: None,
            advantages: &a,
            mask: &m,
            ref_logp: None,
        };
        let d = denom.unwrap_or_else(|| m.sum(Kind::Float).double_value(&[]));
        let (loss, _) = grpo::grpo_loss(&cfg, &x, d)?;
        loss.backward();
        Ok(loss.double_value(&[]))
    };
    let one = run(0..4, Some(total))?;
    let g_one = grads(&model);
    let split = run(0..3, Some(total))? + run(3..4, Some(total))?;
    let g_split = grads(&model);
    assert!((one - split).abs() < 1e-6, "{one} vs {split}");
    let mut max_diff = 0.0f64;
    for (a, b) in g_one.iter().zip(&g_split) {
        max_diff = max_diff.max((a - b).abs().max().double_value(&[]));
    }
    assert!(max_diff < 1e-6, "gradients differ by {max_diff}");
    // Per-micro-batch means weight the single-token row 13× too much: a different loss.
    let naive = run(0..3, None)? + run(3..4, None)?;
    let _ = grads(&model);
    assert!(
        (naive - one).abs() > 1e-3,
        "the test cannot tell the two means apart"
    );
    Ok(())
}

/// The inputs of [`mismatch_rows`]: every rollout logprob known, no reference.
fn inputs<'a>(
    logp: &'a Tensor,
    old: &'a Tensor,
    rollout: &'a Tensor,
    adv: &'a Tensor,
    mask: &'a Tensor,
) -> TokenInputs<'a> {
    TokenInputs {
        logp,
        old_logp: old,
        rollout_logp: rollout,
        compare_logp: None,
        known: None,
        advantages: adv,
        mask,
        ref_logp: None,
    }
}

/// Two rows of two trained tokens each (position 0 untrained), logp = π_old (ratio 1),
/// advantage 1, with these log(π_old / π_rollout) per trained token.
fn mismatch_rows(gaps: [[f64; 2]; 2]) -> [Tensor; 5] {
    let old = Tensor::from_slice(&[0.0f32, -1.0, -1.0, 0.0, -1.0, -1.0]).reshape([2, 3]);
    let rollout: Vec<f32> = gaps
        .iter()
        .flat_map(|g| [0.0, -1.0 - g[0] as f32, -1.0 - g[1] as f32])
        .collect();
    let rollout = Tensor::from_slice(&rollout).reshape([2, 3]);
    let mask = Tensor::from_slice(&[0.0f32, 1.0, 1.0, 0.0, 1.0, 1.0]).reshape([2, 3]);
    let adv = Tensor::ones([2, 3], (Kind::Float, Device::Cpu));
    let logp = old.copy().set_requires_grad(true);
    [logp, old, rollout, adv, mask]
}

/// Sequence-level truncated importance weight: one weight per sample, the geometric mean of
/// its tokens' ratios (capped), on each of its tokens.
#[test]
fn sequence_level_importance_weight_is_the_geometric_mean_per_sample() -> anyhow::Result<()> {
    let [logp, old, rollout, adv, mask] =
        mismatch_rows([[f64::ln(1.2), f64::ln(1.5)], [f64::ln(0.5), 0.0]]);
    let x = inputs(&logp, &old, &rollout, &adv, &mask);
    let cfg = GrpoConfig {
        mode: PolicyMode::Recompute,
        tis_level: grpo::Level::Sequence,
        ..GrpoConfig::default()
    };
    let (loss, stats) = grpo::grpo_loss(&cfg, &x, 4.0)?;
    let (wa, wb) = (f64::sqrt(1.2 * 1.5), f64::sqrt(0.5));
    let l = loss.double_value(&[]);
    assert!(close(l, -(2.0 * wa + 2.0 * wb) / 4.0), "loss {l}");
    assert!(close(stats.tis_weight, 2.0 * wa + 2.0 * wb), "{stats:?}");
    // Token level weighs each token by its own ratio: a different loss.
    let token = GrpoConfig {
        tis_level: grpo::Level::Token,
        ..cfg
    };
    let (lt, _) = grpo::grpo_loss(&token, &x, 4.0)?;
    let want = -(1.2 + 1.5 + 0.5 + 1.0) / 4.0;
    assert!(
        close(lt.double_value(&[]), want),
        "{}",
        lt.double_value(&[])
    );
    // The cap holds per sample: a geometric mean of 3 is cut to tis_cap = 2.
    let [logp, old, rollout, adv, mask] = mismatch_rows([[f64::ln(3.0); 2], [0.0; 2]]);
    let x = inputs(&logp, &old, &rollout, &adv, &mask);
    let (lc, _) = grpo::grpo_loss(&cfg, &x, 4.0)?;
    assert!(close(lc.double_value(&[]), -(2.0 * 2.0 + 2.0) / 4.0));
    Ok(())
}

/// Rejection leaves tokens (token level) or whole samples (sequence level) whose
/// trainer/rollout ratio lies outside the bound out of the loss, and counts them.
#[test]
fn rejection_masks_tokens_or_samples_beyond_the_mismatch_bound() -> anyhow::Result<()> {
    // Ratios: row A 1.5 (kept), 3.0 (out); row B 0.4 (out), 1.0 (kept).
    let [logp, old, rollout, adv, mask] =
        mismatch_rows([[f64::ln(1.5), f64::ln(3.0)], [f64::ln(0.4), 0.0]]);
    let x = inputs(&logp, &old, &rollout, &adv, &mask);
    let reject = |level| GrpoConfig {
        mode: PolicyMode::Recompute,
        reject: Some(grpo::Reject {
            level,
            low: 0.5,
            high: 2.0,
        }),
        ..GrpoConfig::default()
    };
    let (loss, stats) = grpo::grpo_loss(&reject(grpo::Level::Token), &x, 4.0)?;
    // Kept: 1.5 (weight 1.5) and 1.0 (weight 1); the step's token count stays 4.
    assert!(close(loss.double_value(&[]), -(1.5 + 1.0) / 4.0));
    assert_eq!(
        (stats.masked, stats.masked_rows, stats.rows),
        (2.0, 0.0, 2.0)
    );
    loss.backward();
    let g: Vec<f64> = Vec::try_from(logp.grad().flatten(0, -1).to_kind(Kind::Double))?;
    assert_eq!(
        (g[2], g[4]),
        (0.0, 0.0),
        "rejected tokens get no gradient: {g:?}"
    );
    assert!(g[1] < 0.0 && g[5] < 0.0, "kept tokens do: {g:?}");
    // Sequence level: row A's geometric mean √4.5 ≈ 2.12 is out, row B's √0.4 ≈ 0.63 in.
    let [logp, ..] = mismatch_rows([[0.0; 2]; 2]);
    let x = TokenInputs { logp: &logp, ..x };
    let (loss, stats) = grpo::grpo_loss(&reject(grpo::Level::Sequence), &x, 4.0)?;
    assert_eq!((stats.masked, stats.masked_rows), (2.0, 1.0), "{stats:?}");
    assert!(close(loss.double_value(&[]), -(0.4 + 1.0) / 4.0));
    // No bound: nothing is rejected.
    let (_, none) = grpo::grpo_loss(
        &GrpoConfig {
            reject: None,
            ..reject(grpo::Level::Token)
        },
        &x,
        4.0,
    )?;
    assert_eq!((none.masked, none.masked_rows), (0.0, 0.0));
    Ok(())
}

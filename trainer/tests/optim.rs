//! AdamW with fp32 master weights: the first step by hand, clipping, skipping non-finite
//! steps, and checkpoint round trips.

use graft_trainer::optim::{AdamW, AdamWConfig};
use tch::{Kind, Tensor};

fn param(v: &[f32]) -> (String, Tensor) {
    (
        "w".to_owned(),
        Tensor::from_slice(v).reshape([1, v.len() as i64]),
    )
}

fn set_grad(p: &Tensor, g: &[f32]) {
    // A loss whose gradient w.r.t. p is g: sum(p * g).
    let g = Tensor::from_slice(g).reshape(p.size());
    (p * g).sum(Kind::Float).backward();
}

fn values(p: &Tensor) -> Vec<f32> {
    Vec::try_from(p.detach().reshape([-1])).unwrap_or_default()
}

#[test]
fn first_step_matches_hand_computation() -> anyhow::Result<()> {
    let (name, p) = param(&[1.0, -2.0]);
    let cfg = AdamWConfig {
        lr: 0.1,
        weight_decay: 0.5,
        max_grad_norm: 0.0,
        ..AdamWConfig::default()
    };
    let mut opt = AdamW::new(vec![(name, p.shallow_clone())], cfg)?;
    set_grad(&p, &[0.3, -4.0]);
    let out = opt.step()?;
    assert!(!out.skipped);
    assert!((out.grad_norm - (0.09f64 + 16.0).sqrt()).abs() < 1e-5);
    // Step 1: m̂ = g, v̂ = g², update = lr · g / (|g| + eps) = ±lr; decay first: w(1 − lr·wd).
    let want = [1.0 * 0.95 - 0.1, -2.0 * 0.95 + 0.1];
    for (a, b) in values(&p).iter().zip(want) {
        assert!((*a as f64 - b).abs() < 1e-6, "{a} vs {b}");
    }
    Ok(())
}

/// With a huge eps the update is lr·m̂/eps, linear in the gradient, so clipping shows.
#[test]
fn gradients_are_clipped_to_the_global_norm() -> anyhow::Result<()> {
    let (name, p) = param(&[0.0, 0.0]);
    let cfg = AdamWConfig {
        lr: 1e6,
        eps: 1e6,
        weight_decay: 0.0,
        max_grad_norm: 1.0,
        ..AdamWConfig::default()
    };
    let mut opt = AdamW::new(vec![(name, p.shallow_clone())], cfg)?;
    set_grad(&p, &[3.0, 4.0]);
    let out = opt.step()?;
    assert!((out.grad_norm - 5.0).abs() < 1e-5);
    let v = values(&p);
    // Clipped gradient (0.6, 0.8); sqrt(v̂) ≪ eps.
    assert!(
        (v[0] + 0.6).abs() < 1e-3 && (v[1] + 0.8).abs() < 1e-3,
        "{v:?}"
    );
    Ok(())
}

#[test]
fn non_finite_gradients_skip_the_step() -> anyhow::Result<()> {
    let (name, p) = param(&[1.0, 2.0]);
    let mut opt = AdamW::new(
        vec![(name, p.shallow_clone())],
        AdamWConfig {
            lr: 0.1,
            ..AdamWConfig::default()
        },
    )?;
    set_grad(&p, &[f32::NAN, 1.0]);
    let out = opt.step()?;
    assert!(out.skipped);
    assert_eq!(values(&p), vec![1.0, 2.0]);
    assert_eq!((opt.steps, opt.skipped), (0, 1));
    // The next finite step goes through as step 1.
    set_grad(&p, &[1.0, 1.0]);
    assert!(!opt.step()?.skipped);
    assert_eq!(opt.steps, 1);
    Ok(())
}

/// A bf16 parameter is updated through its fp32 master: many steps smaller than bf16's
/// resolution still add up.
#[test]
fn fp32_master_weights_accumulate_small_updates() -> anyhow::Result<()> {
    let p = Tensor::from_slice(&[1.0f32])
        .reshape([1, 1])
        .to_kind(Kind::BFloat16);
    let cfg = AdamWConfig {
        lr: 1e-3,
        weight_decay: 0.0,
        max_grad_norm: 0.0,
        ..AdamWConfig::default()
    };
    let mut opt = AdamW::new(vec![("w".to_owned(), p.shallow_clone())], cfg)?;
    for _ in 0..10 {
        // bf16 spacing at 1.0 is 2^-7 ≈ 0.0078: each 1e-3 step alone would round away.
        (&p * Tensor::from_slice(&[1.0f32]).to_kind(Kind::BFloat16))
            .sum(Kind::Float)
            .backward();
        opt.step()?;
    }
    let v = p.to_kind(Kind::Float).double_value(&[0, 0]);
    assert!((v - 0.9902).abs() < 0.005, "bf16 parameter ended at {v}");
    Ok(())
}

#[test]
fn checkpoint_round_trip_restores_parameters_and_moments() -> anyhow::Result<()> {
    let tmp = tempfile::tempdir()?;
    let path = tmp.path().join("optim.safetensors");
    let cfg = AdamWConfig {
        lr: 0.05,
        ..AdamWConfig::default()
    };
    let (name, p) = param(&[0.5, -0.5, 2.0]);
    let mut opt = AdamW::new(vec![(name.clone(), p.shallow_clone())], cfg.clone())?;
    set_grad(&p, &[1.0, -2.0, 0.5]);
    opt.step()?;
    opt.save(&path)?;
    set_grad(&p, &[0.2, 0.1, -0.3]);
    opt.step()?;
    let after_two = values(&p);

    let (_, q) = param(&[9.0, 9.0, 9.0]);
    let mut resumed = AdamW::new(vec![(name, q.shallow_clone())], cfg)?;
    resumed.load(&path)?;
    assert_eq!(resumed.steps, 1);
    set_grad(&q, &[0.2, 0.1, -0.3]);
    resumed.step()?;
    assert_eq!(values(&q), after_two);
    Ok(())
}

/// The old per-parameter AdamW in f64, the reference of the flat one.
struct Reference {
    w: Vec<f64>,
    m: Vec<f64>,
    v: Vec<f64>,
    decay: bool,
}

impl Reference {
    fn step(&mut self, g: &[f64], scale: f64, t: f64, c: &AdamWConfig) {
        let (bc1, bc2) = (1.0 - c.beta1.powf(t), 1.0 - c.beta2.powf(t));
        for i in 0..self.w.len() {
            let g = g[i] * scale;
            self.m[i] = c.beta1 * self.m[i] + (1.0 - c.beta1) * g;
            self.v[i] = c.beta2 * self.v[i] + (1.0 - c.beta2) * g * g;
            if self.decay {
                self.w[i] *= 1.0 - c.lr * c.weight_decay;
            }
            self.w[i] -= c.lr * (self.m[i] / bc1) / ((self.v[i] / bc2).sqrt() + c.eps);
        }
    }
}

/// Matrices (decayed), a vector and the embedding (not decayed), and a bf16 matrix (a
/// buffer of its own), three clipped steps: every parameter follows the per-parameter
/// formula.
#[test]
fn flat_update_matches_the_per_parameter_formula() -> anyhow::Result<()> {
    let shapes: [(&str, Vec<i64>, Kind); 4] = [
        ("layers.0.w", vec![3, 4], Kind::Float),
        ("norm.weight", vec![5], Kind::Float),
        ("model.embed_tokens.weight", vec![4, 2], Kind::Float),
        ("layers.1.w", vec![2, 3], Kind::BFloat16),
    ];
    tch::manual_seed(7);
    let params: Vec<(String, Tensor)> = shapes
        .iter()
        .map(|(n, s, k)| {
            (
                (*n).to_owned(),
                Tensor::randn(s.as_slice(), (*k, tch::Device::Cpu)),
            )
        })
        .collect();
    let mut reference: Vec<Reference> = params
        .iter()
        .map(|(n, p)| Reference {
            w: Vec::<f64>::try_from(p.to_kind(Kind::Double).reshape([-1])).unwrap_or_default(),
            m: vec![0.0; p.numel()],
            v: vec![0.0; p.numel()],
            decay: p.dim() >= 2 && !n.contains("embed_tokens"),
        })
        .collect();
    let cfg = AdamWConfig {
        lr: 0.01,
        weight_decay: 0.1,
        max_grad_norm: 2.0,
        ..AdamWConfig::default()
    };
    let handles: Vec<Tensor> = params.iter().map(|(_, p)| p.shallow_clone()).collect();
    let mut opt = AdamW::new(params, cfg.clone())?;
    for step in 1..=3 {
        let grads: Vec<Tensor> = handles
            .iter()
            .map(|p| Tensor::randn(p.size(), (p.kind(), tch::Device::Cpu)))
            .collect();
        let g64: Vec<Vec<f64>> = grads
            .iter()
            .map(|g| {
                Vec::<f64>::try_from(g.to_kind(Kind::Double).reshape([-1])).unwrap_or_default()
            })
            .collect();
        let norm = g64.iter().flatten().map(|x| x * x).sum::<f64>().sqrt();
        let loss = handles
            .iter()
            .zip(&grads)
            .map(|(p, g)| (p * g).sum(Kind::Float))
            .fold(Tensor::from(0.0f32), |a, b| a + b);
        loss.backward();
        let out = opt.step()?;
        assert!(
            (out.grad_norm - norm).abs() < 1e-4 * norm,
            "{} vs {norm}",
            out.grad_norm
        );
        let scale = if norm > cfg.max_grad_norm {
            cfg.max_grad_norm / (norm + 1e-6)
        } else {
            1.0
        };
        for (r, g) in reference.iter_mut().zip(&g64) {
            r.step(g, scale, step as f64, &cfg);
        }
        for ((p, r), (name, _, kind)) in handles.iter().zip(&reference).zip(&shapes) {
            let got = Vec::<f64>::try_from(p.to_kind(Kind::Double).reshape([-1]))?;
            // bf16 parameters are the fp32 master rounded: within bf16's half-ulp.
            let tol = if *kind == Kind::BFloat16 { 1e-2 } else { 1e-5 };
            for (a, b) in got.iter().zip(&r.w) {
                assert!(
                    (a - b).abs() <= tol * b.abs().max(1.0),
                    "{name} step {step}: {a} vs {b}"
                );
            }
        }
    }
    Ok(())
}

/// Gradients from several backward passes (micro-batches) add up in the optimizer's
/// buffer, also after the first step moved them there.
#[test]
fn gradients_of_several_backward_passes_add_up() -> anyhow::Result<()> {
    let cfg = AdamWConfig {
        lr: 0.1,
        max_grad_norm: 0.0,
        ..AdamWConfig::default()
    };
    let (name, p) = param(&[1.0, -1.0, 0.5]);
    let (_, q) = param(&[1.0, -1.0, 0.5]);
    let mut split = AdamW::new(vec![(name.clone(), p.shallow_clone())], cfg.clone())?;
    let mut whole = AdamW::new(vec![(name, q.shallow_clone())], cfg)?;
    for _ in 0..3 {
        set_grad(&p, &[0.25, -1.0, 2.0]);
        set_grad(&p, &[0.5, 0.5, -1.0]);
        split.step()?;
        set_grad(&q, &[0.75, -0.5, 1.0]);
        whole.step()?;
        assert_eq!(values(&p), values(&q));
    }
    Ok(())
}

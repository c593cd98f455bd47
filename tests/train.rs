//! `graft train` end to end: rollouts sampled from a tiny Qwen3 (the trainer's HF
//! fixture), written as a samples Parquet the way `graft reconstruct` writes it, trained by
//! the real binary. The written weights load back and score the rewarded completions
//! higher and the others lower (Σ advantage × logprob rises).
#![cfg(feature = "trainer")]

use std::path::{Path, PathBuf};
use std::process::Command;

use graft_reconstruct::sample::{SAMPLE_SCHEMA_VERSION, Sample, write_samples_parquet};
use graft_trainer::generate;
use graft_trainer::grpo;
use graft_trainer::model::Model;
use graft_trainer::tch::{self, Device, Kind, Tensor};

fn fixture() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("trainer/tests/fixtures/models/qwen3")
}

/// Σ over samples of advantage × (sum of the completion's logprobs) under `model`.
fn objective(model: &Model, samples: &[Sample], adv: &[f64]) -> anyhow::Result<f64> {
    let mut total = 0.0;
    for (s, a) in samples.iter().zip(adv) {
        let ids: Vec<i64> = s.tokens.iter().map(|&t| i64::from(t)).collect();
        let ids = Tensor::from_slice(&ids).unsqueeze(0);
        let lp = tch::no_grad(|| grpo::token_logprobs(model, &ids, 1.0, 64))?;
        let lp: Vec<f32> = Vec::try_from(lp.squeeze_dim(0))?;
        let sum: f64 = lp
            .iter()
            .zip(&s.loss_mask)
            .filter(|(_, m)| **m == 1)
            .map(|(l, _)| f64::from(*l))
            .sum();
        total += a * sum;
    }
    Ok(total)
}

fn rollouts() -> anyhow::Result<(Vec<Sample>, Vec<f64>)> {
    graft_trainer::device::init();
    let model = Model::load(&fixture(), Device::Cpu, Kind::Float)?;
    // libtorch's RNG is global: the tests of this file sample one at a time.
    static RNG: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let _guard = RNG.lock().unwrap_or_else(|e| e.into_inner());
    tch::manual_seed(5);
    let prompts: Vec<Vec<i64>> = (0..32).map(|i| vec![1, 3 + (i / 8) as i64, 7]).collect();
    let gens = generate::sample(&model, &prompts, 4, 1.0)?;
    let mut samples = Vec::new();
    for (i, (p, g)) in prompts.iter().zip(&gens).enumerate() {
        let reward = g.tokens.iter().filter(|&&t| t < 80).count() as f64 / 4.0;
        let mut tokens: Vec<u32> = p.iter().map(|&t| t as u32).collect();
        tokens.extend(g.tokens.iter().map(|&t| t as u32));
        let mut loss_mask = vec![0u8; p.len()];
        loss_mask.extend([1u8; 4]);
        let mut logprobs = vec![None; p.len()];
        logprobs.extend(g.logprobs.iter().map(|&l| Some(l)));
        samples.push(Sample {
            sample_id: format!("s{i}/0"),
            session_id: format!("s{i}"),
            group_id: Some(format!("task-{}", i / 8)),
            tokens,
            loss_mask,
            logprobs,
            reward: Some(reward),
            weight_versions: vec!["v0".to_owned()],
            token_weight_versions: [vec![None; p.len()], vec![Some(0); 4]].concat(),
            call_ids: vec![format!("call-{i}")],
            fork_reason: None,
            events: Vec::new(),
            token_calls: Vec::new(),
            call_rewards: Vec::new(),
            tokenizer_fingerprint: "test".to_owned(),
            template_fingerprint: "test".to_owned(),
            schema_version: SAMPLE_SCHEMA_VERSION,
            logprob_kind: Default::default(),
            ..Sample::default()
        });
    }
    let rewards: Vec<f64> = samples.iter().filter_map(|s| s.reward).collect();
    let groups: Vec<String> = samples.iter().filter_map(|s| s.group_id.clone()).collect();
    let adv = grpo::group_advantages(&rewards, &groups, 1e-6);
    Ok((samples, adv))
}

#[test]
fn graft_train_writes_weights_that_move_toward_rewarded_completions() -> anyhow::Result<()> {
    let (samples, adv) = rollouts()?;
    assert!(
        adv.iter().any(|a| *a > 0.0) && adv.iter().any(|a| *a < 0.0),
        "the rollouts carry no signal"
    );
    let tmp = tempfile::tempdir()?;
    let parquet = tmp.path().join("samples.parquet");
    write_samples_parquet(&samples, &parquet)?;
    let out = tmp.path().join("step-1");
    let run = Command::new(env!("CARGO_BIN_EXE_graft"))
        .args(["train", "--samples"])
        .arg(&parquet)
        .arg("--model")
        .arg(fixture())
        .arg("--out")
        .arg(&out)
        .args(["--lr", "0.01"])
        .env("GRAFT_DEVICE", "cpu")
        .output()?;
    let stdout = String::from_utf8_lossy(&run.stdout);
    let stderr = String::from_utf8_lossy(&run.stderr);
    assert!(
        run.status.success(),
        "graft train failed:\n{stdout}\n{stderr}"
    );
    assert!(stdout.contains("step 1 loss"), "{stdout}");
    assert!(stderr.contains("32 samples train"), "{stderr}");
    for f in ["config.json", "model.safetensors", "optimizer.safetensors"] {
        assert!(out.join(f).exists(), "{f} was not written");
    }
    let before = Model::load(&fixture(), Device::Cpu, Kind::Float)?;
    let after = Model::load(&out, Device::Cpu, Kind::Float)?;
    let (b, a) = (
        objective(&before, &samples, &adv)?,
        objective(&after, &samples, &adv)?,
    );
    assert!(
        a > b + 0.1,
        "Σ advantage × logprob went from {b:.4} to {a:.4}"
    );

    // A second iteration resumes the optimizer from the directory the first wrote.
    let out2 = tmp.path().join("step-2");
    let run = Command::new(env!("CARGO_BIN_EXE_graft"))
        .args(["train", "--samples"])
        .arg(&parquet)
        .arg("--model")
        .arg(&out)
        .arg("--out")
        .arg(&out2)
        .env("GRAFT_DEVICE", "cpu")
        .output()?;
    let stdout = String::from_utf8_lossy(&run.stdout);
    assert!(
        run.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&run.stderr)
    );
    assert!(
        stdout.contains("step 2 loss"),
        "the optimizer state was not resumed: {stdout}"
    );
    Ok(())
}

#[test]
fn graft_train_refuses_samples_without_signal() -> anyhow::Result<()> {
    let (mut samples, _) = rollouts()?;
    for s in &mut samples {
        s.reward = Some(1.0);
    }
    let tmp = tempfile::tempdir()?;
    let parquet = tmp.path().join("flat.parquet");
    write_samples_parquet(&samples, &parquet)?;
    let run = Command::new(env!("CARGO_BIN_EXE_graft"))
        .args(["train", "--samples"])
        .arg(&parquet)
        .arg("--model")
        .arg(fixture())
        .arg("--out")
        .arg(tmp.path().join("out"))
        .output()?;
    assert!(!run.status.success());
    let stderr = String::from_utf8_lossy(&run.stderr);
    assert!(
        stderr.contains("no sample has a learning signal"),
        "{stderr}"
    );
    Ok(())
}

/// With a KL term the second iteration is pulled toward the reference: its step reports a
/// positive KL (the policy has moved from the reference after the first step), and
/// --kl-coef without --ref-model is refused with the fix.
#[test]
fn graft_train_with_a_kl_term_reports_the_distance_to_the_reference() -> anyhow::Result<()> {
    let (samples, _) = rollouts()?;
    let tmp = tempfile::tempdir()?;
    let parquet = tmp.path().join("samples.parquet");
    write_samples_parquet(&samples, &parquet)?;
    let train =
        |model: &Path, out: &Path, extra: &[&str]| -> anyhow::Result<std::process::Output> {
            Ok(Command::new(env!("CARGO_BIN_EXE_graft"))
                .args(["train", "--lr", "0.01", "--samples"])
                .arg(&parquet)
                .arg("--model")
                .arg(model)
                .arg("--out")
                .arg(out)
                .args(extra)
                .env("GRAFT_DEVICE", "cpu")
                .output()?)
        };
    let refused = train(&fixture(), &tmp.path().join("x"), &["--kl-coef", "0.1"])?;
    assert!(!refused.status.success());
    assert!(String::from_utf8_lossy(&refused.stderr).contains("--ref-model"));
    let step1 = tmp.path().join("step-1");
    assert!(train(&fixture(), &step1, &[])?.status.success());
    let fixture = fixture();
    let fixture = fixture.to_string_lossy();
    let run = train(
        &step1,
        &tmp.path().join("step-2"),
        &["--kl-coef", "0.1", "--ref-model", &fixture],
    )?;
    let stdout = String::from_utf8_lossy(&run.stdout);
    assert!(
        run.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&run.stderr)
    );
    let kl: f64 = stdout
        .split_whitespace()
        .skip_while(|w| *w != "kl")
        .nth(1)
        .and_then(|v| v.parse().ok())
        .ok_or_else(|| anyhow::anyhow!("no kl in: {stdout}"))?;
    assert!(kl > 0.0, "{stdout}");
    Ok(())
}

/// The resident trainer (what `graft rl` keeps in memory across steps) resumed from a
/// checkpoint continues exactly as an unbroken one: four steps in one go, and two steps +
/// checkpoint + a fresh load + two steps, give bitwise the same losses, gradient norms and
/// weights (same ops on the same CPU threads; the checkpoint holds the fp32 masters and both
/// AdamW moments as f32, so nothing is rounded). The per-step path (`run_step`: load, step,
/// checkpoint, each step) is the same computation, so it matches too.
#[test]
fn resident_trainer_resumed_from_a_checkpoint_matches_an_unbroken_one_step_for_step()
-> anyhow::Result<()> {
    use graft_trainer::step::{PolicyChoice, Resident, StepRequest, run_step};
    let (samples, _) = rollouts()?;
    let tmp = tempfile::tempdir()?;
    let parquet = tmp.path().join("samples.parquet");
    write_samples_parquet(&samples, &parquet)?;
    let req = |model: &Path, out: PathBuf| {
        let mut r = StepRequest::new(vec![parquet.clone()], model.to_path_buf(), out);
        r.lr = 0.01;
        // Recompute: π_old and the importance weight come from the trainer's own forward.
        r.policy = PolicyChoice::Recompute;
        r
    };
    let figures = |r: &graft_trainer::step::StepReport| -> Vec<(f64, f64, f64)> {
        r.steps
            .iter()
            .map(|s| (s.loss, s.grad_norm, s.mismatch_kl))
            .collect()
    };
    let params = |r: &Resident| -> Vec<(String, Tensor)> {
        r.parameters()
            .into_iter()
            .map(|(n, t)| (n, t.detach().copy()))
            .collect()
    };
    // Unbroken: four steps.
    let mut unbroken = Resident::load(&req(&fixture(), PathBuf::new()), |_| {})?;
    let mut want = vec![];
    for step in 0..4 {
        want.extend(figures(&unbroken.train(
            std::slice::from_ref(&parquet),
            step,
            |_| {},
        )?));
    }
    assert_eq!(unbroken.optimizer_steps(), 4);
    // Broken: two steps, a checkpoint, the process's trainer gone, two more from the disk.
    let ckpt = tmp.path().join("ckpt");
    let mut got = vec![];
    {
        let mut first = Resident::load(&req(&fixture(), PathBuf::new()), |_| {})?;
        for step in 0..2 {
            got.extend(figures(&first.train(
                std::slice::from_ref(&parquet),
                step,
                |_| {},
            )?));
        }
        first.checkpoint(&ckpt)?;
    }
    let mut second = Resident::load(&req(&ckpt, PathBuf::new()), |_| {})?;
    assert_eq!(
        second.optimizer_steps(),
        2,
        "the optimizer state was resumed"
    );
    for step in 2..4 {
        got.extend(figures(&second.train(
            std::slice::from_ref(&parquet),
            step,
            |_| {},
        )?));
    }
    assert_eq!(got, want, "(loss, grad_norm, mismatch_kl) per step");
    assert!(want[1].0 != want[3].0, "the steps differ: {want:?}");
    for ((n, a), (_, b)) in params(&unbroken).iter().zip(params(&second)) {
        assert!(a.equal(&b), "{n} differs after the resume");
    }
    // The per-step path: four loads and four checkpoints, the same figures.
    let mut policy = fixture();
    let mut per_step = vec![];
    for step in 0..4 {
        let out = tmp.path().join(format!("step-{step}"));
        let mut r = req(&policy, out.clone());
        r.seed = step;
        per_step.extend(figures(&run_step(&r, |_| {})?));
        policy = out;
    }
    assert_eq!(per_step, want, "per-step path against the resident trainer");
    Ok(())
}

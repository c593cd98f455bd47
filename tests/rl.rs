//! `graft rl` collecting: the example task set (`examples/rl/`) run by the example agent (a
//! real openai-SDK program with one tool) inside envd sandboxes, through the gateway in
//! exact mode, against the scripted backend that plays the model's text with real Qwen3 ids.
//! Checks what the run wrote (step log, samples, rewards), that nothing was left open, and
//! that a second invocation resumes after the last finished step.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::path::Path;
use std::process::{Command, Stdio};

use common::{TestEnv, graft_bin, repo_root};
use graft_reconstruct::sample::read_samples_parquet;
use serde_json::Value;

fn config(dir: &Path, env: &TestEnv, steps: usize) -> std::path::PathBuf {
    let ex = repo_root().join("examples/rl");
    let text = format!(
        r#"[run]
out_dir = "{out}"
steps = {steps}

[tasks]
file = "{tasks}"

[harness]
command = "/mnt/py/bin/python /mnt/harness/agent.py"
timeout_secs = 120
env = {{ AGENT_MAX_STEPS = "4" }}
mounts = {{ "/mnt/harness" = "{harness}", "/mnt/py" = "{venv}" }}

[backend]
model_dir = "{model}"
scripted = "{script}"

[rollout]
tasks_per_step = 2
group_size = 2
max_group_size = 2
concurrency = 2

[trainer]
enabled = false
"#,
        out = dir.join("out").display(),
        tasks = ex.join("tasks.jsonl").display(),
        harness = ex.display(),
        venv = env
            .sandbox_python()
            .parent()
            .unwrap()
            .parent()
            .unwrap()
            .display(),
        model = env.qwen3_dir().display(),
        script = ex.join("scripted.json").display(),
    );
    let p = dir.join("rl.toml");
    std::fs::write(&p, text).unwrap();
    p
}

fn rl(args: &[&str]) -> (bool, String) {
    let o = Command::new(graft_bin())
        .arg("rl")
        .args(args)
        .env("GRAFT_LOG", "warn")
        .stdin(Stdio::null())
        .output()
        .unwrap();
    let text = format!(
        "{}\n{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );
    (o.status.success(), text)
}

fn steps(out: &Path) -> Vec<Value> {
    std::fs::read_to_string(out.join("steps.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

#[test]
fn rl_collects_rewarded_samples_in_sandboxes_and_resumes_after_the_last_step() {
    let env = TestEnv::get();
    let dir = tempfile::tempdir().unwrap();
    let cfg = config(dir.path(), &env, 1);
    let cfg_s = cfg.to_str().unwrap();

    let (ok, out) = rl(&["--config", cfg_s, "--dry-run"]);
    assert!(ok, "{out}");
    assert!(
        out.contains("plan: 1 steps × 2 tasks × 2–2 rollouts"),
        "{out}"
    );
    assert!(out.contains("dry run: every component answers"), "{out}");
    assert!(
        !dir.path().join("out/steps.jsonl").exists(),
        "a dry run runs nothing"
    );

    let (ok, out) = rl(&["--config", cfg_s]);
    assert!(ok, "{out}");
    let out_dir = dir.path().join("out");
    let log = steps(&out_dir);
    assert_eq!(log.len(), 1, "{log:#?}");
    let s = &log[0];
    assert_eq!(s["rollouts"], 4, "{s:#}");
    assert_eq!(s["scored"], 4, "{s:#}");
    // The scripted model solves the addition and miscounts the lines.
    assert_eq!(s["reward_mean"], 0.5, "{s:#}");
    assert_eq!(s["sandboxes_open"], 0, "{s:#}");
    assert_eq!(s["sessions_open"], 0, "{s:#}");
    assert_eq!(s["drift_events"], 0, "{s:#}");
    assert_eq!(s["samples"], 4, "one sample per rollout: {s:#}");

    // The samples carry the rewards of their sessions, per task.
    let samples = read_samples_parquet(Path::new(s["samples_file"].as_str().unwrap())).unwrap();
    assert_eq!(samples.len(), 4);
    for x in &samples {
        let group = x.group_id.clone().unwrap();
        let want = if group.ends_with("add-17-25") {
            1.0
        } else {
            0.0
        };
        assert_eq!(x.reward, Some(want), "{group}");
        assert!(x.loss_mask.iter().filter(|m| **m == 1).count() > 10);
    }
    // The agent really ran in the sandbox: two model calls per rollout (tool call, answer).
    let recs = common::records_show(&out_dir.join("data"));
    assert_eq!(recs.len(), 8, "{recs:#?}");
    assert!(
        recs.iter()
            .all(|r| r["upstream_dialect"] == "sglang_generate")
    );

    // Resume: a run with more steps continues after the finished one.
    let cfg = config(dir.path(), &env, 2);
    let (ok, out) = rl(&["--config", cfg.to_str().unwrap()]);
    assert!(ok, "{out}");
    assert!(out.contains("resuming at step 1"), "{out}");
    let log = steps(&out_dir);
    assert_eq!(log.len(), 2, "{log:#?}");
    assert_eq!(log[1]["step"], 1);
    assert_eq!(common::records_show(&out_dir.join("data")).len(), 16);
}

#[test]
fn rl_refuses_a_bad_config_with_the_reason() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("rl.toml");
    std::fs::write(
        &p,
        "[run]\nout_dir = \"o\"\nsteps = 1\n[tasks]\nfile = \"t.jsonl\"\n[harness]\ncommand = \"true\"\n[backend]\nmodel_dir = \"m\"\nurls = [\"http://127.0.0.1:9\"]\n[rollout]\ngroup_size = 8\nmax_group_size = 4\n",
    )
    .unwrap();
    let (ok, out) = rl(&["--config", p.to_str().unwrap()]);
    assert!(!ok);
    assert!(out.contains("rollout.group_size (8)"), "{out}");
    std::fs::write(&p, "[run]\nout_dir = \"o\"\nsteps = 1\nbogus = 2\n").unwrap();
    let (ok, out) = rl(&["--config", p.to_str().unwrap()]);
    assert!(!ok);
    assert!(out.contains("bogus"), "{out}");
}

/// A tiny random Qwen3 on the real Qwen3 vocabulary (so it can train on the ids the scripted
/// backend produced), written as an HF directory.
#[cfg(feature = "trainer")]
fn tiny_qwen3(dir: &Path) {
    use graft_trainer::model::Model;
    use graft_trainer::tch::{Device, Kind};
    let config = serde_json::json!({
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3",
        "vocab_size": 151936, "hidden_size": 32, "intermediate_size": 64,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 16, "max_position_embeddings": 8192, "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0, "tie_word_embeddings": true, "attention_bias": false,
        "hidden_act": "silu", "bos_token_id": 151643, "eos_token_id": 151645, "dtype": "float32"
    });
    let m = Model::random(config.clone(), Device::Cpu, Kind::Float, 7).unwrap();
    graft_trainer::weights::write_dir(dir, &config, &m.named_parameters(), Kind::Float, 1 << 30)
        .unwrap();
}

#[cfg(feature = "trainer")]
#[test]
fn rl_trains_each_step_and_the_next_step_samples_the_pushed_weights() {
    let env = TestEnv::get();
    let dir = tempfile::tempdir().unwrap();
    let model = dir.path().join("tiny-qwen3");
    tiny_qwen3(&model);
    // A verifier that passes every other rollout of a group: each group is balanced, so
    // Balanced Adaptive Rollout selects it and GRPO gets a signal. (Learning itself is the
    // trainer's tests' business; this checks the loop.)
    let tasks = dir.path().join("tasks.jsonl");
    std::fs::write(
        &tasks,
        "{\"id\": \"alternate\", \"prompt\": \"graft-rl-add: write the sum of 17 and 25 into answer.txt.\", \"reward\": {\"command\": \"[ $((GRAFT_ROLLOUT_INDEX % 2)) -eq 0 ]\"}}\n",
    )
    .unwrap();
    let cfg = config(dir.path(), &env, 2);
    let text = std::fs::read_to_string(&cfg)
        .unwrap()
        .replace(
            &format!("file = \"{}\"", repo_root().join("examples/rl/tasks.jsonl").display()),
            &format!("file = \"{}\"", tasks.display()),
        )
        .replace(
            "tasks_per_step = 2\ngroup_size = 2\nmax_group_size = 2\n",
            "tasks_per_step = 1\ngroup_size = 4\nmax_group_size = 8\nstride = 2\nmin_positive = 0.25\nmax_positive = 0.75\n",
        )
        .replace(
            "[trainer]\nenabled = false\n",
            &format!("[trainer]\nenabled = true\nmodel = \"{}\"\nlr = 0.0001\n", model.display()),
        );
    std::fs::write(&cfg, text).unwrap();
    let (ok, out) = rl(&["--config", cfg.to_str().unwrap()]);
    assert!(ok, "{out}");
    let out_dir = dir.path().join("out");
    let log = steps(&out_dir);
    assert_eq!(log.len(), 2, "{log:#?}");
    for (i, s) in log.iter().enumerate() {
        assert_eq!(s["groups"][0]["decision"], "balanced", "{s:#}");
        assert_eq!(s["groups"][0]["selected"], 4, "{s:#}");
        assert_eq!(s["samples"], 4, "{s:#}");
        let train = &s["train"];
        let lines = train["log"]
            .as_array()
            .unwrap_or_else(|| panic!("no training: {s:#}"));
        assert!(
            !lines.is_empty() && lines[0].as_str().unwrap().contains("loss"),
            "{s:#}"
        );
        let version = format!("step-{i:05}");
        assert_eq!(train["weight_version"], version.as_str());
        assert_eq!(s["weight_version"], version.as_str());
        let ckpt = Path::new(train["checkpoint"].as_str().unwrap());
        assert!(ckpt.join("config.json").exists(), "{}", ckpt.display());
        assert_eq!(s["sandboxes_open"], 0);
        assert_eq!(s["sessions_open"], 0);
        assert!(s["secs"]["train"].as_f64().unwrap() > 0.0);
        assert!(s["secs"]["push"].as_f64().unwrap() > 0.0);
    }
    // The calls of step 1 were served by the weights step 0 pushed.
    let recs = common::records_show(&out_dir.join("data"));
    for r in &recs {
        let want = if r["group_id"].as_str().unwrap().starts_with("step0-") {
            "default"
        } else {
            "step-00000"
        };
        assert_eq!(r["weight_version"], want, "{r:#}");
    }
    let state: Value =
        serde_json::from_str(&std::fs::read_to_string(out_dir.join("state.json")).unwrap())
            .unwrap();
    assert_eq!(state["next_step"], 2);
    assert!(state["policy"].as_str().unwrap().ends_with("step-00001"));
}

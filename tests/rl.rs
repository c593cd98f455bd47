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

/// The example run's config (see [`common::rl_example_config`]).
fn config(dir: &Path, env: &TestEnv, steps: usize) -> std::path::PathBuf {
    common::rl_example_config(dir, env, steps)
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
    // Each rollout's session samples at the trainer's temperature (an enforced policy),
    // whatever the agent asks for; the record holds both.
    for r in &recs {
        assert_eq!(r["sampling"]["policy"]["mode"], "enforce", "{r:#}");
        assert_eq!(r["sampling"]["policy"]["temperature"], 1.0, "{r:#}");
        assert_eq!(r["sampling"]["sent"]["temperature"], 1.0, "{r:#}");
        assert!(r["sampling"]["requested"].is_object(), "{r:#}");
    }

    // Resume: a run with more steps continues after the finished one.
    let cfg = config(dir.path(), &env, 2);
    let (ok, out) = rl(&["--config", cfg.to_str().unwrap()]);
    assert!(ok, "{out}");
    assert!(out.contains("resuming at step 1"), "{out}");
    let log = steps(&out_dir);
    assert_eq!(log.len(), 2, "{log:#?}");
    assert_eq!(log[1]["step"], 1);
    let recs = common::records_show(&out_dir.join("data"));
    assert_eq!(recs.len(), 16);

    // report.html: the run page, self-contained, one point per step.
    let report = std::fs::read_to_string(out_dir.join("report.html")).unwrap();
    assert_eq!(
        report
            .matches("<circle class=\"point\" data-series=\"reward mean\"")
            .count(),
        2
    );
    assert!(!report.contains("<script") && !report.contains("src="));
    // The viewer on this run, in headless Chromium: every session, a group's rollouts, a
    // sample with exactly its loss-mask-1 tokens marked, one point per step.
    let qwen3 = env.qwen3_dir();
    let view = common::Proc::spawn_env(
        "view",
        &[
            "view",
            "--data-dir",
            out_dir.join("data").to_str().unwrap(),
            "--run",
            out_dir.to_str().unwrap(),
            "--model-dir",
            qwen3.to_str().unwrap(),
            "--listen",
            "127.0.0.1:0",
        ],
        &[],
        "graft view listening on",
        None,
    );
    let file = Path::new(log[1]["samples_file"].as_str().unwrap());
    let samples = read_samples_parquet(file).unwrap();
    let x = &samples[0];
    let group = x.group_id.clone().unwrap();
    let pages = serde_json::json!([
        {"name": "sessions", "path": "/?per=500"},
        {"name": "group", "path": format!("/group/{group}")},
        {"name": "sample", "path": format!("/sample?file={}&id={}",
            file.file_name().unwrap().to_str().unwrap(), x.sample_id.replace('/', "%2F"))},
        {"name": "run", "path": "/run"},
    ]);
    let shots = std::path::PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("viewer-rl-screenshots");
    let seen = env.browse(&view.url, &pages, &shots);
    let ids = |v: &Value| -> std::collections::BTreeSet<String> {
        v.as_array()
            .unwrap()
            .iter()
            .map(|s| s.as_str().unwrap().to_owned())
            .collect()
    };
    let recorded: std::collections::BTreeSet<String> = recs
        .iter()
        .map(|r| r["session_id"].as_str().unwrap().to_owned())
        .collect();
    assert!(
        ids(&seen["sessions"]["sessions"]).is_superset(&recorded),
        "{seen}"
    );
    let in_group: std::collections::BTreeSet<String> = recs
        .iter()
        .filter(|r| r["group_id"] == group.as_str())
        .map(|r| r["session_id"].as_str().unwrap().to_owned())
        .collect();
    assert_eq!(ids(&seen["group"]["members"]), in_group);
    let marked: Vec<u64> = seen["sample"]["trained"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_u64().unwrap())
        .collect();
    let mask1: Vec<u64> = (0..x.loss_mask.len())
        .filter(|i| x.loss_mask[*i] == 1)
        .map(|i| i as u64)
        .collect();
    assert_eq!(marked, mask1);
    assert_eq!(seen["run"]["points"], 2);
    assert_eq!(seen["run"]["steps"], 2);
}

/// `harness.name` picks an entry of `harness-configs/`: envd writes its config into each
/// rollout's sandbox, pointed at that rollout's session (here Codex's `config.toml` under
/// `CODEX_HOME`, and its key variable), and the harness command finds it there.
#[test]
fn rl_fills_a_named_harness_config_for_each_rollout() {
    let env = TestEnv::get();
    let dir = tempfile::tempdir().unwrap();
    let tasks = "{\"id\": \"configured\", \"prompt\": \"check\", \"reward\": {\"command\": \"test \\\"$(cat answer.txt)\\\" = ok\"}}\n";
    let command = r#"f="$CODEX_HOME/config.toml"; grep -q "model_provider = \"graft\"" "$f" && grep -q "/s/$GRAFT_SESSION_ID/v1" "$f" && [ -n "$GRAFT_API_KEY" ] && echo ok > answer.txt; cat "$f""#;
    let cfg = fault_config(dir.path(), &env, tasks, command, "");
    let text = std::fs::read_to_string(&cfg)
        .unwrap()
        .replace("[backend]", "name = \"codex\"\n\n[backend]");
    std::fs::write(&cfg, text).unwrap();
    let (ok, out) = rl(&["--config", cfg.to_str().unwrap()]);
    assert!(ok, "{out}");
    let s = &steps(&dir.path().join("out"))[0];
    assert_eq!(s["reward_mean"], 1.0, "{s:#}");

    // An unknown harness is refused before anything starts, naming the known ones.
    let text = std::fs::read_to_string(&cfg)
        .unwrap()
        .replace("name = \"codex\"", "name = \"nonesuch\"");
    std::fs::write(&cfg, text).unwrap();
    let (ok, out) = rl(&["--config", cfg.to_str().unwrap()]);
    assert!(!ok);
    assert!(
        out.contains("harness.name = \"nonesuch\"") && out.contains("codex"),
        "{out}"
    );
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
    std::fs::write(
        &p,
        "[run]\nout_dir = \"o\"\nsteps = 1\n[tasks]\nfile = \"t.jsonl\"\n[harness]\ncommand = \"true\"\n[backend]\nmodel_dir = \"m\"\nurls = [\"http://127.0.0.1:9\"]\n[trainer]\ntemperature = 0.0\n",
    )
    .unwrap();
    let (ok, out) = rl(&["--config", p.to_str().unwrap()]);
    assert!(!ok);
    assert!(out.contains("trainer.temperature = 0"), "{out}");
    std::fs::write(&p, "[run]\nout_dir = \"o\"\nsteps = 1\nbogus = 2\n").unwrap();
    let (ok, out) = rl(&["--config", p.to_str().unwrap()]);
    assert!(!ok);
    assert!(out.contains("bogus"), "{out}");
}

/// A tiny random Qwen3 (2 layers, hidden 32) with `vocab_size` tokens and the given special
/// ids, written as an HF directory (weights and config.json).
#[cfg(feature = "trainer")]
fn write_tiny_qwen3(dir: &Path, vocab_size: u32, bos: u32, eos: u32) {
    use graft_trainer::model::Model;
    use graft_trainer::tch::{Device, Kind};
    let config = serde_json::json!({
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3",
        "vocab_size": vocab_size, "hidden_size": 32, "intermediate_size": 64,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 16, "max_position_embeddings": 8192, "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0, "tie_word_embeddings": true, "attention_bias": false,
        "hidden_act": "silu", "bos_token_id": bos, "eos_token_id": eos, "dtype": "float32"
    });
    let m = Model::random(config.clone(), Device::Cpu, Kind::Float, 7).unwrap();
    graft_trainer::weights::write_dir(dir, &config, &m.named_parameters(), Kind::Float, 1 << 30)
        .unwrap();
}

/// A tiny random Qwen3 on the real Qwen3 vocabulary (so it can train on the ids the scripted
/// backend produced).
#[cfg(feature = "trainer")]
fn tiny_qwen3(dir: &Path) {
    write_tiny_qwen3(dir, 151936, 151643, 151645);
}

/// A training run on the scripted backend: one task whose verifier passes every other
/// rollout of a group (each group is balanced, so Balanced Adaptive Rollout selects it and
/// GRPO gets a signal), a tiny random Qwen3 as the policy, `trainer` lines added to the
/// `[trainer]` section and `rollout` lines to `[rollout]`.
#[cfg(feature = "trainer")]
fn training_config(
    dir: &Path,
    env: &TestEnv,
    steps: usize,
    rollout: &str,
    trainer: &str,
) -> std::path::PathBuf {
    let model = dir.join("tiny-qwen3");
    if !model.exists() {
        tiny_qwen3(&model);
    }
    let tasks = dir.join("tasks.jsonl");
    std::fs::write(
        &tasks,
        "{\"id\": \"alternate\", \"prompt\": \"graft-rl-add: write the sum of 17 and 25 into answer.txt.\", \"reward\": {\"command\": \"[ $((GRAFT_ROLLOUT_INDEX % 2)) -eq 0 ]\"}}\n",
    )
    .unwrap();
    let cfg = config(dir, env, steps);
    let text = std::fs::read_to_string(&cfg)
        .unwrap()
        .replace(
            &format!("file = \"{}\"", repo_root().join("examples/rl/tasks.jsonl").display()),
            &format!("file = \"{}\"", tasks.display()),
        )
        .replace(
            "tasks_per_step = 2\ngroup_size = 2\nmax_group_size = 2\n",
            &format!("tasks_per_step = 1\ngroup_size = 4\nmax_group_size = 8\nstride = 2\nmin_positive = 0.25\nmax_positive = 0.75\n{rollout}"),
        )
        .replace(
            "[trainer]\nenabled = false\n",
            &format!("[trainer]\nenabled = true\nmodel = \"{}\"\nlr = 0.0001\n{trainer}", model.display()),
        );
    std::fs::write(&cfg, text).unwrap();
    cfg
}

/// Two harnesses in one run: the example agent (openai SDK, Chat Completions) and Claude Code
/// (Anthropic Messages, streamed, with its side calls), as root in their sandboxes. The task
/// names neither, so its group takes them in turn (rollout i in harness i mod 2); both write
/// the file with their shell tool, and the reward pays rollouts 0 and 1 of every 4, so each
/// harness has a rewarded and an unrewarded rollout and the group trains. The step log
/// reports rollouts, calls and rewards per harness; the sessions carry their harness.
#[cfg(feature = "trainer")]
#[test]
fn rl_trains_on_two_harnesses_in_one_run_and_reports_each() {
    let env = TestEnv::get();
    let claude = env.root.join("claude");
    assert!(
        claude
            .join("node_modules/@anthropic-ai/claude-code/bin/claude.exe")
            .exists(),
        "Claude Code is not installed; run `bash scripts/setup-test-env.sh`"
    );
    let dir = tempfile::tempdir().unwrap();
    std::fs::set_permissions(
        dir.path(),
        std::os::unix::fs::PermissionsExt::from_mode(0o755),
    )
    .unwrap();
    let cfg = training_config(dir.path(), &env, 1, "", "");
    // The model's text for both: the harness rules (matched anywhere in the prompt, tool
    // loops only) first, then the example's.
    let rules = |p: &Path| -> Vec<Value> {
        let v: Value = serde_json::from_str(&std::fs::read_to_string(p).unwrap()).unwrap();
        v["rules"].as_array().unwrap().clone()
    };
    // The example agent declares `bash`, Claude Code `Bash`: a call to a function the
    // request did not declare is no call (SGLang's parser drops it), so the agent's own
    // model text names its own tool.
    let mut all = vec![serde_json::json!({
        "match": "graft-task-claude-code",
        "match_prompt": "with the bash tool",
        "tools": true,
        "reply": {
            "reasoning": "One shell command writes the file.",
            "content": "I will write the file.",
            "tool_calls": [{"name": "bash", "arguments": {"command": "echo graft-done-claude-code > graft_done.txt && echo graft-wrote-claude-code"}}]
        }
    })];
    all.extend(rules(
        &repo_root().join("tests/clients/harnesses/script.json"),
    ));
    all.extend(rules(&repo_root().join("examples/rl/scripted.json")));
    let script = dir.path().join("script.json");
    std::fs::write(&script, serde_json::json!({"rules": all}).to_string()).unwrap();
    // The config's task file (training_config wrote one task there), replaced.
    std::fs::write(
        dir.path().join("tasks.jsonl"),
        "{\"id\": \"write-file\", \"prompt\": \"graft-task-claude-code: create the file graft_done.txt in the current directory containing the word graft-done-claude-code, with one shell command, then stop.\", \"reward\": {\"command\": \"grep -qs graft-done-claude-code graft_done.txt && [ $((GRAFT_ROLLOUT_INDEX % 4)) -lt 2 ]\"}}\n",
    )
    .unwrap();
    let text = std::fs::read_to_string(&cfg).unwrap();
    let text = text
        .replace("[harness]\n", "[[harness]]\nlabel = \"agent\"\n")
        .replace(
            "[backend]\n",
            &format!(
                "[[harness]]\nname = \"claude-code\"\ncommand = \"/mnt/h/node_modules/@anthropic-ai/claude-code/bin/claude.exe -p \\\"$GRAFT_TASK_PROMPT\\\" --dangerously-skip-permissions\"\ntimeout_secs = 300\nmounts = {{ \"/mnt/h\" = \"{}\" }}\n\n[envd]\nsandbox_uid = 0\nmemory_mb = 4096\n\n[backend]\n",
                claude.display()
            ),
        )
        .replace(
            &format!("scripted = \"{}\"", repo_root().join("examples/rl/scripted.json").display()),
            &format!("scripted = \"{}\"", script.display()),
        );
    assert!(
        text.contains("[[harness]]\nname = \"claude-code\""),
        "{text}"
    );
    std::fs::write(&cfg, &text).unwrap();
    let (ok, out) = rl(&["--config", cfg.to_str().unwrap()]);
    assert!(ok, "{out}");
    assert!(
        out.contains("agent (") && out.contains("claude-code ("),
        "{out}"
    );
    let log = steps(&dir.path().join("out"));
    assert_eq!(log.len(), 1, "{log:#?}");
    let s = &log[0];
    assert_eq!(s["groups"][0]["decision"], "balanced", "{s:#}");
    let h = &s["harnesses"];
    for name in ["agent", "claude-code"] {
        assert_eq!(h[name]["rollouts"], 2, "{name}: {s:#}");
        assert_eq!(h[name]["scored"], 2, "{name}: {s:#}");
        assert_eq!(h[name]["reward_mean"], 0.5, "{name}: {s:#}");
        // A tool call and the answer at least (Claude Code adds its side calls).
        assert!(h[name]["calls"].as_u64().unwrap() >= 4, "{name}: {s:#}");
    }
    for r in s["rollout_list"].as_array().unwrap() {
        assert!(
            r["harness"] == "agent" || r["harness"] == "claude-code",
            "{r}"
        );
    }
    // It trained on both harnesses' samples.
    assert!(s["samples"].as_u64().unwrap() >= 4, "{s:#}");
    assert!(s["trained_tokens"].as_u64().unwrap() > 0, "{s:#}");
    assert!(!s["train"]["steps"].as_array().unwrap().is_empty(), "{s:#}");
    // Each session names its harness, for the viewer's filter.
    let sessions = graft_recorder::list_sessions(&dir.path().join("out/data")).unwrap();
    let mut by: std::collections::BTreeMap<String, usize> = Default::default();
    for x in sessions.iter().filter(|x| x.session_id != "default") {
        *by.entry(x.harness.clone().unwrap_or_default()).or_default() += 1;
    }
    assert_eq!(by.get("agent"), Some(&2), "{by:?}");
    assert_eq!(by.get("claude-code"), Some(&2), "{by:?}");
}

/// The resident trainer (the default) on an SGLang-wire backend: each step trains in memory,
/// writes the weights for the file push (`<out>/weights/step-N`) and pushes them; the
/// checkpoint (weights + optimizer state) is written after the run's last step only
/// (`trainer.checkpoint_every` = 10 by default), and state.json names it.
#[cfg(feature = "trainer")]
#[test]
fn rl_trains_each_step_and_the_next_step_samples_the_pushed_weights() {
    let env = TestEnv::get();
    let dir = tempfile::tempdir().unwrap();
    let cfg = training_config(dir.path(), &env, 2, "", "");
    let (ok, out) = rl(&["--config", cfg.to_str().unwrap()]);
    assert!(ok, "{out}");
    assert!(out.contains("trainer: resident"), "{out}");
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
        assert_eq!(train["trainer"], "resident", "{s:#}");
        // The optimizer's update count goes on across steps: the trainer stayed in memory.
        assert_eq!(train["steps"][0]["step"], i + 1, "{s:#}");
        // Exact mode: every trained token has its sampler's logprob, so the gap is over all.
        assert_eq!(train["steps"][0]["tokens_without_logprob"], 0.0, "{s:#}");
        assert!(train["steps"][0]["logprob_gap"].is_f64(), "{s:#}");
        let version = format!("step-{i:05}");
        assert_eq!(train["weight_version"], version.as_str());
        assert_eq!(s["weight_version"], version.as_str());
        let weights = Path::new(train["weights"].as_str().unwrap());
        assert!(
            weights.join("config.json").exists(),
            "{}",
            weights.display()
        );
        if i == 1 {
            let ckpt = Path::new(train["checkpoint"].as_str().unwrap());
            assert!(
                ckpt.join("optimizer.safetensors").exists(),
                "{}",
                ckpt.display()
            );
        } else {
            assert!(train["checkpoint"].is_null(), "no checkpoint due: {s:#}");
        }
        assert_eq!(s["sandboxes_open"], 0);
        assert_eq!(s["sessions_open"], 0);
        assert!(s["secs"]["train"].as_f64().unwrap() > 0.0);
        assert!(s["secs"]["push"].as_f64().unwrap() > 0.0);
        assert_eq!(s["max_call_staleness"], 0, "{s:#}");
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
    assert!(
        state["policy"]
            .as_str()
            .unwrap()
            .ends_with("checkpoints/step-00001")
    );
}

/// `backend.wire = "vllm"` through the whole loop: the scripted backend plays vLLM (its
/// development routes on, as `VLLM_SERVER_DEV_MODE=1`), the gateway calls
/// `/v1/completions` with token ids, each step's weights are pushed with vLLM's routes
/// (pause in place, prefix-cache reset, `reload_weights`, `update_weight_version`, resume),
/// and the next step's calls are served by the pushed version.
#[cfg(feature = "trainer")]
#[test]
fn rl_over_the_vllm_wire_pushes_with_vllms_routes_and_the_next_step_samples_the_pushed_weights() {
    let env = TestEnv::get();
    let dir = tempfile::tempdir().unwrap();
    let cfg = training_config(dir.path(), &env, 2, "", "");
    let text = std::fs::read_to_string(&cfg).unwrap();
    let text = text.replace("[rollout]\n", "wire = \"vllm\"\n\n[rollout]\n");
    assert!(text.contains("wire = \"vllm\""), "{text}");
    std::fs::write(&cfg, text).unwrap();
    let (ok, out) = rl(&["--config", cfg.to_str().unwrap()]);
    assert!(ok, "{out}");
    let out_dir = dir.path().join("out");
    let log = steps(&out_dir);
    assert_eq!(log.len(), 2, "{log:#?}");
    for (i, s) in log.iter().enumerate() {
        // The example agent in its envd sandbox, over the vLLM wire: one sample per
        // rollout's session, no drift.
        assert_eq!(s["samples"], 4, "{s:#}");
        assert_eq!(s["rollouts"], 4, "{s:#}");
        assert_eq!(s["drift_events"], 0, "{s:#}");
        assert_eq!(
            s["weight_version"],
            format!("step-{i:05}").as_str(),
            "{s:#}"
        );
        assert!(s["secs"]["push"].as_f64().unwrap() > 0.0, "{s:#}");
        assert_eq!(s["backend_events"], serde_json::json!([]), "{s:#}");
    }
    let recs = common::records_show(&out_dir.join("data"));
    assert!(!recs.is_empty());
    for r in &recs {
        assert_eq!(r["upstream_dialect"], "vllm_completions", "{r:#}");
        let want = if r["group_id"].as_str().unwrap().starts_with("step0-") {
            "default"
        } else {
            "step-00000"
        };
        assert_eq!(r["weight_version"], want, "{r:#}");
    }
}

/// The per-step figures (loss, gradient norm) of every step's training.
#[cfg(feature = "trainer")]
fn train_figures(log: &[Value]) -> Vec<(f64, f64)> {
    log.iter()
        .map(|s| {
            let f = &s["train"]["steps"][0];
            (
                f["loss"].as_f64().unwrap(),
                f["grad_norm"].as_f64().unwrap(),
            )
        })
        .collect()
}

/// A resident run stopped after two steps (a checkpoint at its end: weights, fp32 masters,
/// AdamW moments) and resumed for a third trains like an unbroken three-step run, step for
/// step. The scripted backend plays the same text whatever the weights, so both runs train
/// on the same tokens; the figures agree to 1e-6 relative rather than bitwise because the
/// samples' order in a step's file follows the order the concurrent rollouts finished in,
/// which changes the order of the floating-point sums.
#[cfg(feature = "trainer")]
#[test]
fn rl_resumed_from_its_checkpoint_trains_like_an_unbroken_run() {
    let env = TestEnv::get();
    let unbroken = tempfile::tempdir().unwrap();
    let cfg = training_config(unbroken.path(), &env, 3, "", "checkpoint_every = 0\n");
    let (ok, out) = rl(&["--config", cfg.to_str().unwrap()]);
    assert!(ok, "{out}");
    let want = train_figures(&steps(&unbroken.path().join("out")));
    let broken = tempfile::tempdir().unwrap();
    let cfg = training_config(broken.path(), &env, 3, "", "checkpoint_every = 0\n");
    let (ok, out) = rl(&["--config", cfg.to_str().unwrap(), "--steps", "2"]);
    assert!(ok, "{out}");
    let (ok, out) = rl(&["--config", cfg.to_str().unwrap()]);
    assert!(ok, "{out}");
    assert!(out.contains("optimizer state resumed at update 2"), "{out}");
    let log = steps(&broken.path().join("out"));
    assert_eq!(log.len(), 3, "{log:#?}");
    assert_eq!(log[2]["train"]["steps"][0]["step"], 3, "{:#}", log[2]);
    let got = train_figures(&log);
    eprintln!("unbroken {want:?}\nresumed  {got:?}");
    for (i, (a, b)) in want.iter().zip(&got).enumerate() {
        let close = |x: f64, y: f64| (x - y).abs() <= 1e-6 * x.abs().max(y.abs()).max(1e-12);
        assert!(
            close(a.0, b.0) && close(a.1, b.1),
            "step {i}: unbroken {a:?}, resumed {b:?}"
        );
    }
}

/// `rollout.max_staleness = 3`: up to three steps train while a step's rollouts run. Every
/// call of step s is sampled by weights no older than step s − 4's (checked on the records),
/// and the step log's per-call staleness never exceeds 3. The scripted backend's logprobs
/// (`-(id % 97) / 100`) are far from the tiny policy's (about ln(1/151936) ≈ −11.9), so a
/// rejection bound on the trainer/rollout ratio masks them: with a wide bound nothing is
/// masked, with a tight one (0.5 to 2) nearly every trained token is, and the step log says
/// so.
#[cfg(feature = "trainer")]
#[test]
fn rl_max_staleness_3_bounds_every_calls_staleness_and_a_tight_rejection_bound_masks() {
    let env = TestEnv::get();
    let steps_n = 5;
    let run = |rollout: &str, trainer: &str| {
        let dir = tempfile::tempdir().unwrap();
        let cfg = training_config(dir.path(), &env, steps_n, rollout, trainer);
        let (ok, out) = rl(&["--config", cfg.to_str().unwrap()]);
        assert!(ok, "{out}");
        let out_dir = dir.path().join("out");
        (
            steps(&out_dir),
            common::records_show(&out_dir.join("data")),
            dir,
        )
    };
    let (log, recs, _keep) = run(
        "max_staleness = 3\n",
        "policy = \"recompute\"\nreject = { low = 0.0, high = 1e30 }\n",
    );
    assert_eq!(log.len(), steps_n);
    let version_step = |v: &str| -> i64 {
        if v == "default" {
            -1
        } else {
            v.trim_start_matches("step-").parse().unwrap()
        }
    };
    for s in 0..steps_n as i64 {
        for r in recs.iter().filter(|r| {
            r["group_id"]
                .as_str()
                .unwrap()
                .starts_with(&format!("step{s}-"))
        }) {
            let v = version_step(r["weight_version"].as_str().unwrap());
            assert!(v >= s - 4 && v < s, "a call of step {s} was sampled by {v}");
        }
    }
    for s in &log {
        let per_call = s["call_staleness"].as_object().unwrap();
        let calls: u64 = s["call_weight_versions"]
            .as_object()
            .unwrap()
            .values()
            .map(|n| n.as_u64().unwrap())
            .sum();
        assert_eq!(
            per_call.values().map(|n| n.as_u64().unwrap()).sum::<u64>(),
            calls,
            "{s:#}"
        );
        for k in per_call.keys() {
            let n: u64 = k.parse().unwrap_or_else(|_| panic!("staleness {k}: {s:#}"));
            assert!(n <= 3, "{s:#}");
        }
        assert!(s["max_call_staleness"].as_u64().unwrap() <= 3, "{s:#}");
        let t = &s["train"];
        assert_eq!(t["policy"], "recompute", "{s:#}");
        assert_eq!(t["masked_share"], 0.0, "{s:#}");
        assert!(t["mismatch_kl"].as_f64().unwrap() > 1.0, "{s:#}");
    }
    eprintln!(
        "staleness per step: {:?}",
        log.iter().map(|s| &s["call_staleness"]).collect::<Vec<_>>()
    );
    let (tight, _, _keep) = run(
        "",
        "policy = \"recompute\"\nreject = { low = 0.5, high = 2.0 }\n",
    );
    for s in &tight {
        let t = &s["train"];
        assert!(t["masked_share"].as_f64().unwrap() > 0.9, "{s:#}");
        assert!(t["masked_samples"].as_u64().unwrap() >= 1, "{s:#}");
    }
}

/// A run config with its own task file and harness command (collect mode, one rollout per
/// task per step).
fn fault_config(
    dir: &Path,
    env: &TestEnv,
    tasks: &str,
    command: &str,
    extra: &str,
) -> std::path::PathBuf {
    let ex = repo_root().join("examples/rl");
    let tasks_path = dir.join("tasks.jsonl");
    std::fs::write(&tasks_path, tasks).unwrap();
    let n = tasks.lines().filter(|l| !l.trim().is_empty()).count();
    let text = format!(
        r#"[run]
out_dir = "{out}"
steps = 1

[tasks]
file = "{tasks}"

[harness]
command = '''{command}'''
timeout_secs = 60
env = {{ AGENT_MAX_STEPS = "4" }}
mounts = {{ "/mnt/harness" = "{harness}", "/mnt/py" = "{venv}" }}

[backend]
model_dir = "{model}"
scripted = "{script}"

[rollout]
tasks_per_step = {n}
group_size = 1
max_group_size = 1
concurrency = 2
reward_timeout_secs = 3
{extra}
[trainer]
enabled = false
"#,
        out = dir.join("out").display(),
        tasks = tasks_path.display(),
        harness = ex.display(),
        venv = env.sandbox_venv().display(),
        model = env.qwen3_dir().display(),
        script = ex.join("scripted.json").display(),
    );
    let p = dir.join("rl.toml");
    std::fs::write(&p, text).unwrap();
    p
}

const ADD: &str = "graft-rl-add: write the sum of 17 and 25 into answer.txt.";

#[test]
fn rl_survives_a_crashing_harness_an_oom_and_a_hanging_reward_and_reports_them() {
    let env = TestEnv::get();
    let dir = tempfile::tempdir().unwrap();
    let check = r#"test \"$(cat answer.txt 2>/dev/null)\" = 42"#;
    let tasks = format!(
        "{{\"id\": \"ok\", \"prompt\": \"{ADD}\", \"reward\": {{\"command\": \"{check}\"}}}}\n\
         {{\"id\": \"crash\", \"prompt\": \"{ADD}\", \"reward\": {{\"command\": \"{check}\"}}}}\n\
         {{\"id\": \"oom\", \"prompt\": \"{ADD}\", \"reward\": {{\"command\": \"{check}\"}}}}\n\
         {{\"id\": \"hang\", \"prompt\": \"{ADD}\", \"reward\": {{\"command\": \"sleep 300\"}}}}\n"
    );
    // The harness crashes on one task and outgrows the sandbox's memory on another.
    let command = r#"case "$GRAFT_TASK_ID" in
  crash) echo "harness crashed" >&2; exit 3 ;;
  oom) /mnt/py/bin/python -c "x = bytearray(768 << 20); print(len(x))" ;;
  *) /mnt/py/bin/python /mnt/harness/agent.py ;;
esac"#;
    let cfg = fault_config(dir.path(), &env, &tasks, command, "");
    std::fs::write(
        &cfg,
        std::fs::read_to_string(&cfg)
            .unwrap()
            .replace("[trainer]", "[envd]\nmemory_mb = 256\n\n[trainer]"),
    )
    .unwrap();
    let (ok, out) = rl(&["--config", cfg.to_str().unwrap()]);
    assert!(ok, "{out}");
    let log = steps(&dir.path().join("out"));
    let s = &log[0];
    assert_eq!(s["rollouts"], 4, "{s:#}");
    // The crash and the OOM are scored by the verifier (0); the hanging reward is excluded.
    assert_eq!(s["scored"], 3, "{s:#}");
    assert_eq!(s["reward_failed"], 1, "{s:#}");
    assert_eq!(s["reward_mean"], 1.0 / 3.0, "{s:#}");
    let problems = s["problems"].as_array().unwrap();
    let by_task = |t: &str| {
        problems
            .iter()
            .find(|p| p["task"] == t)
            .unwrap_or_else(|| panic!("{t}: {s:#}"))
    };
    assert_eq!(by_task("crash")["harness_exit"], 3);
    assert!(
        by_task("crash")["harness_tail"]
            .as_str()
            .unwrap()
            .contains("harness crashed")
    );
    assert_eq!(by_task("oom")["harness_oom"], true, "{s:#}");
    assert!(
        by_task("hang")["outcome"]
            .as_str()
            .unwrap()
            .contains("did not finish within 3 s"),
        "{s:#}"
    );
    assert_eq!(s["sandboxes_open"], 0, "{s:#}");
    assert_eq!(s["sessions_open"], 0, "{s:#}");
}

/// `reward.parse = "json"`: the reward command's last line gives the rollout's reward and
/// per-call rewards; graft rl posts them to the gateway, and the step's samples carry them
/// on the calls they name. A reward for a call the session does not have excludes the
/// rollout, with the gateway's reason.
#[test]
fn rl_json_reward_command_posts_call_rewards_into_the_samples() {
    let env = TestEnv::get();
    let dir = tempfile::tempdir().unwrap();
    let task = |id: &str, line: &str| {
        serde_json::json!({"id": id, "prompt": ADD,
            "reward": {"command": format!("echo scoring; echo '{line}'"), "parse": "json"}})
        .to_string()
    };
    let tasks = format!(
        "{}\n{}\n",
        task("calls", r#"{"reward": 1, "calls": {"2": 0.5}}"#),
        task(
            "nocall",
            r#"{"reward": 1, "calls": [null, null, null, 0.25]}"#
        ),
    );
    let cfg = fault_config(
        dir.path(),
        &env,
        &tasks,
        "/mnt/py/bin/python /mnt/harness/agent.py",
        "",
    );
    let (ok, out) = rl(&["--config", cfg.to_str().unwrap()]);
    assert!(ok, "{out}");
    let log = steps(&dir.path().join("out"));
    let s = &log[0];
    assert_eq!(s["rollouts"], 2, "{s:#}");
    assert_eq!(s["scored"], 1, "{s:#}");
    assert_eq!(s["reward_failed"], 1, "{s:#}");
    let problem = &s["problems"].as_array().unwrap()[0];
    assert_eq!(problem["task"], "nocall", "{s:#}");
    let why = problem["outcome"].as_str().unwrap();
    assert!(
        why.contains("call 4 was refused") && why.contains("has no call 4"),
        "{why}"
    );
    let samples = read_samples_parquet(Path::new(s["samples_file"].as_str().unwrap())).unwrap();
    assert_eq!(samples.len(), 1, "{samples:#?}");
    let x = &samples[0];
    assert_eq!(x.reward, Some(1.0));
    // The agent's two calls (tool call, answer), the second one rewarded.
    assert_eq!(x.call_ids.len(), 2, "{x:#?}");
    assert_eq!(x.call_rewards, vec![None, Some(0.5)]);
    let second: Vec<usize> = (0..x.tokens.len())
        .filter(|i| x.token_calls[*i] == Some(1))
        .collect();
    assert!(
        !second.is_empty() && second.iter().all(|i| x.loss_mask[*i] == 1),
        "the rewarded call's tokens are sampled tokens of the sample"
    );
}

#[test]
fn rl_killed_mid_step_resumes_and_keeps_the_rollouts_that_finished() {
    let env = TestEnv::get();
    let dir = tempfile::tempdir().unwrap();
    let tasks = format!(
        "{{\"id\": \"slow\", \"prompt\": \"{ADD}\", \"reward\": {{\"command\": \"test \\\"$(cat answer.txt 2>/dev/null)\\\" = 42\"}}}}\n"
    );
    // Rollout 0 is quick; the others take long enough to be cut off by the kill.
    let command =
        r#"[ "$GRAFT_ROLLOUT_INDEX" = 0 ] || sleep 20; /mnt/py/bin/python /mnt/harness/agent.py"#;
    let cfg = fault_config(dir.path(), &env, &tasks, command, "");
    let text = std::fs::read_to_string(&cfg)
        .unwrap()
        .replace(
            "group_size = 1\nmax_group_size = 1\n",
            "group_size = 3\nmax_group_size = 6\n",
        )
        .replace("concurrency = 2", "concurrency = 3");
    std::fs::write(&cfg, text).unwrap();
    let out_dir = dir.path().join("out");
    let mut child = Command::new(graft_bin())
        .args(["rl", "--config", cfg.to_str().unwrap()])
        .env("GRAFT_LOG", "warn")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    // Wait until rollout 0 has its reward, then kill -9 graft rl mid-step.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(120);
    loop {
        let log = std::fs::read_to_string(out_dir.join("data/sessions.log")).unwrap_or_default();
        if log.contains("\"reward\"") {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "no reward within 120 s"
        );
        std::thread::sleep(std::time::Duration::from_millis(200));
    }
    child.kill().unwrap();
    child.wait().unwrap();
    assert!(
        std::fs::read_to_string(out_dir.join("steps.jsonl"))
            .unwrap_or_default()
            .trim()
            .is_empty(),
        "the step did not finish"
    );
    let first = common::records_show(&out_dir.join("data")).len();
    assert!(first >= 2, "rollout 0's calls are recorded");

    let (ok, out) = rl(&["--config", cfg.to_str().unwrap()]);
    assert!(ok, "{out}");
    assert!(
        out.contains("finished before the restart are kept"),
        "{out}"
    );
    let log = steps(&out_dir);
    assert_eq!(log.len(), 1, "{log:#?}");
    let s = &log[0];
    // Rollout 0 from the killed run counts; the two it cut off are failed attempts; two new
    // rollouts fill the group to 3 scored.
    assert_eq!(s["scored"], 3, "{s:#}");
    assert_eq!(s["sessions_open"], 0, "{s:#}");
    assert_eq!(s["sandboxes_open"], 0, "{s:#}");
    let interrupted = s["problems"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|p| p["outcome"].as_str().unwrap().contains("interrupted"))
        .count();
    assert_eq!(interrupted, 2, "{s:#}");
}

/// A tiny random Qwen3 over a byte-level vocabulary (256 byte tokens, no merges, ChatML's
/// special tokens), with a ChatML template: any text is tokenized exactly, the model is small
/// enough to train dozens of steps on CPU in seconds, and `graft serve` runs it.
#[cfg(feature = "trainer")]
fn tiny_byte_model(dir: &Path) {
    use serde_json::json;
    // GPT-2's byte → printable character map, as the ByteLevel pre-tokenizer uses it.
    let mut bytes: Vec<u32> = (0x21..=0x7E)
        .chain(0xA1..=0xAC)
        .chain(0xAE..=0xFF)
        .collect();
    let mut chars = bytes.clone();
    let mut extra = 0;
    for b in 0..256 {
        if !bytes.contains(&b) {
            bytes.push(b);
            chars.push(256 + extra);
            extra += 1;
        }
    }
    let mut vocab = serde_json::Map::new();
    for (b, c) in bytes.iter().zip(&chars) {
        vocab.insert(char::from_u32(*c).unwrap().to_string(), json!(b));
    }
    let specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"];
    let added: Vec<Value> = specials
        .iter()
        .enumerate()
        .map(|(i, t)| {
            json!({"id": 256 + i, "content": t, "single_word": false, "lstrip": false,
                   "rstrip": false, "normalized": false, "special": true})
        })
        .collect();
    let level = json!({"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true});
    let tokenizer = json!({
        "version": "1.0", "truncation": null, "padding": null, "added_tokens": added,
        "normalizer": null, "pre_tokenizer": level, "post_processor": null, "decoder": level,
        "model": {"type": "BPE", "dropout": null, "unk_token": null,
                  "continuing_subword_prefix": null, "end_of_word_suffix": null,
                  "fuse_unk": false, "byte_fallback": false, "ignore_merges": false,
                  "vocab": vocab, "merges": []}
    });
    let template = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}";
    write_tiny_qwen3(dir, 259, 256, 258);
    std::fs::write(dir.join("tokenizer.json"), tokenizer.to_string()).unwrap();
    std::fs::write(
        dir.join("tokenizer_config.json"),
        json!({"chat_template": template, "eos_token": "<|im_end|>", "bos_token": null,
               "pad_token": "<|endoftext|>"})
        .to_string(),
    )
    .unwrap();
}

/// GRPO learns through the whole loop: `graft rl` with the embedded `graft serve` (no
/// backend URL, no script) sampling a tiny random model, a real HTTP client (python's
/// urllib) in envd sandboxes, the gateway in exact mode, reconstruct, the resident trainer
/// and in-memory weight handoffs to the embedded backend. The
/// task is verifiable and graded: the reward is the share of lowercase ASCII letters among
/// the 12 bytes the model may answer with (about 1 in 10 at random). The mean reward of the
/// last steps must clearly exceed that of the first. Rollouts of a step overlap the previous
/// step's training (`max_staleness = 1`), so the records also show calls served by two
/// weight versions within a step.
#[cfg(feature = "trainer")]
#[test]
fn rl_learns_a_toy_task_through_graft_serve_exact_mode_and_reconstruct() {
    let env = TestEnv::get();
    let dir = tempfile::tempdir().unwrap();
    let model = dir.path().join("tiny-bytes");
    tiny_byte_model(&model);
    // The harness: one chat completion over plain HTTP (python's standard library: the
    // openai SDK's import alone would dominate this test's time); the answer goes to a file.
    let harness = r#"import json, os, urllib.request

body = {
    "model": os.environ["GRAFT_MODEL"],
    "messages": [{"role": "user", "content": os.environ["GRAFT_TASK_PROMPT"]}],
    "max_tokens": 12,
    "temperature": 1.0,
}
req = urllib.request.Request(
    os.environ["OPENAI_BASE_URL"].rstrip("/") + "/chat/completions",
    data=json.dumps(body).encode(),
    headers={"content-type": "application/json",
             "authorization": "Bearer " + os.environ.get("OPENAI_API_KEY", "")},
)
answer = json.load(urllib.request.urlopen(req, timeout=60))["choices"][0]["message"]["content"]
open("answer.txt", "w").write(answer or "")
"#;
    std::fs::write(dir.path().join("harness.py"), harness).unwrap();
    let reward = "/mnt/py/bin/python -c 'b = open(\\\"answer.txt\\\", \\\"rb\\\").read(); print(min(1.0, sum(97 <= c <= 122 for c in b) / 12))'";
    let tasks: String = ["a word", "another word", "a name", "a greeting"]
        .iter()
        .enumerate()
        .map(|(i, what)| {
            format!(
                "{{\"id\": \"letters-{i}\", \"prompt\": \"Write {what}.\", \"reward\": {{\"command\": \"{reward}\", \"parse\": \"stdout\"}}}}\n"
            )
        })
        .collect();
    std::fs::write(dir.path().join("tasks.jsonl"), tasks).unwrap();
    let steps_n = 30;
    let cfg = dir.path().join("rl.toml");
    std::fs::write(
        &cfg,
        format!(
            r#"[run]
out_dir = "out"
steps = {steps_n}
seed = 3

[tasks]
file = "tasks.jsonl"

[harness]
command = "/mnt/py/bin/python /mnt/rl/harness.py"
timeout_secs = 60
mounts = {{ "/mnt/py" = "{venv}" }}

[backend]
model_dir = "{model}"

[rollout]
tasks_per_step = 4
group_size = 8
max_group_size = 8
concurrency = 8
selection = "group"
max_staleness = 1

[trainer]
lr = 0.005
"#,
            venv = env.sandbox_venv().display(),
            model = model.display(),
        ),
    )
    .unwrap();
    let (ok, out) = rl(&["--config", cfg.to_str().unwrap()]);
    assert!(ok, "{out}");
    assert!(out.contains("embedded backend: graft serve"), "{out}");
    let out_dir = dir.path().join("out");
    let log = steps(&out_dir);
    assert_eq!(log.len(), steps_n, "{out}");
    let rewards: Vec<f64> = log
        .iter()
        .map(|s| s["reward_mean"].as_f64().unwrap())
        .collect();
    let mean = |r: &[f64]| r.iter().sum::<f64>() / r.len() as f64;
    let (first, last) = (mean(&rewards[..5]), mean(&rewards[steps_n - 5..]));
    eprintln!("reward per step: {rewards:.3?}");
    assert!(
        last > first + 0.25,
        "the mean reward did not rise clearly: first 5 steps {first:.3}, last 5 {last:.3}: {rewards:.3?}"
    );
    for (i, s) in log.iter().enumerate() {
        assert_eq!(s["step"], i);
        assert_eq!(s["scored"], 32, "{s:#}");
        assert_eq!(s["sandboxes_open"], 0, "{s:#}");
        assert_eq!(s["sessions_open"], 0, "{s:#}");
        assert_eq!(s["drift_events"], 0, "{s:#}");
        if s["samples"] != 0 {
            assert_eq!(
                s["train"]["weight_version"],
                format!("step-{i:05}"),
                "{s:#}"
            );
        }
    }
    // Bounded staleness: every call of step s was served by the weights of step s-2 or s-1
    // (the previous step trains while step s runs).
    let recs = common::records_show(&out_dir.join("data"));
    assert_eq!(recs.len(), 32 * steps_n);
    let version_step = |v: &str| -> i64 {
        if v == "default" {
            -1
        } else {
            v.trim_start_matches("step-").parse().unwrap()
        }
    };
    let mut mixed = 0;
    for s in 1..steps_n as i64 {
        let vs: std::collections::BTreeSet<i64> = recs
            .iter()
            .filter(|r| {
                r["group_id"]
                    .as_str()
                    .unwrap()
                    .starts_with(&format!("step{s}-"))
            })
            .map(|r| version_step(r["weight_version"].as_str().unwrap()))
            .collect();
        assert!(
            vs.iter().all(|v| *v == s - 2 || *v == s - 1),
            "step {s} sampled by {vs:?}"
        );
        mixed += usize::from(vs.len() > 1);
    }
    eprintln!(
        "{mixed} of {} steps sampled by two weight versions",
        steps_n - 1
    );
    // The resident trainer handed every version to the embedded graft serve in memory and
    // wrote a checkpoint every 10 steps (trainer.checkpoint_every's default) and after the
    // last; old ones are pruned (run.keep_checkpoints = 2 by default); the policy stays.
    for s in log.iter().filter(|s| s["samples"] != 0) {
        assert_eq!(s["train"]["trainer"], "resident", "{s:#}");
        assert!(
            s["train"]["handoff"]
                .as_str()
                .unwrap()
                .starts_with("in memory"),
            "{s:#}"
        );
        assert!(s["train"]["weights"].is_null(), "no weights file: {s:#}");
    }
    assert!(!out_dir.join("weights").exists());
    let mut kept: Vec<String> = std::fs::read_dir(out_dir.join("checkpoints"))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    kept.sort();
    assert_eq!(
        kept,
        [
            format!("step-{:05}", steps_n - 11),
            format!("step-{:05}", steps_n - 1)
        ]
    );
    // The samples trained on are exactly what the backend produced: loss tokens and their
    // logprobs are the recorded completion ids and logprobs.
    let samples = read_samples_parquet(Path::new(
        log[steps_n - 1]["samples_file"].as_str().unwrap(),
    ))
    .unwrap();
    assert_eq!(samples.len(), 32);
    for x in &samples {
        let rec = recs
            .iter()
            .find(|r| r["session_id"] == x.session_id.as_str())
            .unwrap();
        let ids: Vec<u32> = rec["completion_token_ids"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_u64().unwrap() as u32)
            .collect();
        let trained = common::trained_ids(x);
        assert_eq!(trained, ids, "{}", x.sample_id);
    }
}

/// The backend restarts mid-step: `graft rl` notices (its health watchdog), holds the
/// gateway's new calls while the backend is away, pushes the policy's current weights to it
/// again once it is back (it restarts on its start-up weights), and excludes the rollout
/// whose call was in flight when the backend died (not the policy's doing). Nothing
/// finished is lost; the step log reports it all.
#[cfg(feature = "trainer")]
#[test]
fn rl_survives_the_backend_restarting_mid_step_and_repushes_the_weights() {
    use std::io::BufRead as _;
    let env = TestEnv::get();
    let dir = tempfile::tempdir().unwrap();
    let model = dir.path().join("tiny-qwen3");
    tiny_qwen3(&model);
    // The example script, plus a prompt the backend never answers: rollout 0 of step 1 sends
    // it, so a call is surely in flight when the backend is killed.
    let mut script: Value = serde_json::from_str(
        &std::fs::read_to_string(repo_root().join("examples/rl/scripted.json")).unwrap(),
    )
    .unwrap();
    script["rules"].as_array_mut().unwrap().insert(
        0,
        serde_json::json!({"match": "graft-rl-hang", "role": "user", "fault": "hang",
                           "reply": {"content": "never sent"}}),
    );
    let script_path = dir.path().join("script.json");
    std::fs::write(&script_path, script.to_string()).unwrap();
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let listen = format!("127.0.0.1:{port}");
    let qwen3 = env.qwen3_dir();
    let backend_args = [
        "scripted-upstream",
        "--listen",
        listen.as_str(),
        "--script",
        script_path.to_str().unwrap(),
        "--tokenizer",
        qwen3.to_str().unwrap(),
    ];
    let start_backend = || {
        common::Proc::spawn_env(
            "upstream",
            &backend_args,
            &[],
            "graft scripted-upstream listening on",
            None,
        )
    };
    let mut backend = start_backend();
    let tasks = format!(
        "{{\"id\": \"alternate\", \"prompt\": \"{ADD}\", \"reward\": {{\"command\": \"[ $((GRAFT_ROLLOUT_INDEX % 2)) -eq 0 ]\"}}}}\n"
    );
    // In step 1 (step 0's line is in the step log, visible under /mnt/rl/out), rollout 0
    // asks the question the backend hangs on.
    let command = r#"if [ "$GRAFT_ROLLOUT_INDEX" = 0 ] && [ -s /mnt/rl/out/steps.jsonl ]; then export GRAFT_TASK_PROMPT="graft-rl-hang: wait"; fi; /mnt/py/bin/python /mnt/harness/agent.py"#;
    let cfg = fault_config(dir.path(), &env, &tasks, command, "");
    let text = std::fs::read_to_string(&cfg)
        .unwrap()
        .replace("steps = 1", "steps = 2")
        .replace(
            &format!(
                "scripted = \"{}\"",
                repo_root().join("examples/rl/scripted.json").display()
            ),
            &format!("urls = [\"http://{listen}\"]\nhealth_interval_secs = 0.2\nrestart_wait_secs = 60"),
        )
        .replace(
            "group_size = 1\nmax_group_size = 1\n",
            "group_size = 4\nmax_group_size = 8\nstride = 2\nmin_positive = 0.25\nmax_positive = 0.75\n",
        )
        .replace(
            "[trainer]\nenabled = false\n",
            &format!("[trainer]\nenabled = true\nmodel = \"{}\"\nlr = 0.0001\n", model.display()),
        );
    assert!(text.contains("urls = "), "{text}");
    std::fs::write(&cfg, text).unwrap();
    let mut child = Command::new(graft_bin())
        .args(["rl", "--config", cfg.to_str().unwrap()])
        .env("GRAFT_LOG", "warn")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let stdout = std::io::BufReader::new(child.stdout.take().unwrap());
    let (tx, rx) = std::sync::mpsc::channel::<String>();
    std::thread::spawn(move || {
        for line in stdout.lines().map_while(Result::ok) {
            let _ = tx.send(line);
        }
    });
    let mut printed = vec![];
    let mut gateway = None;
    while gateway.is_none() {
        let line = rx
            .recv_timeout(std::time::Duration::from_secs(120))
            .unwrap_or_else(|e| panic!("graft rl printed no components line ({e}): {printed:#?}"));
        if let Some(rest) = line.split("; gateway ").nth(1) {
            gateway = rest.split_whitespace().next().map(str::to_string);
        }
        printed.push(line);
    }
    let gateway = gateway.unwrap();
    // Wait for step 1's hanging call to be in flight at the gateway, then kill the backend.
    let rt = tokio::runtime::Runtime::new().unwrap();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(180);
    loop {
        let metrics = rt
            .block_on(common::http::get(&format!("{gateway}/metrics"), &[]))
            .text();
        if metrics.lines().any(|l| l == "graft_upstream_inflight 1")
            && std::fs::read_to_string(dir.path().join("out/steps.jsonl"))
                .is_ok_and(|s| !s.trim().is_empty())
        {
            // Step 1's calls other than the hanging one end in milliseconds: make sure the
            // one in flight is the hanging one.
            std::thread::sleep(std::time::Duration::from_millis(300));
            let again = rt
                .block_on(common::http::get(&format!("{gateway}/metrics"), &[]))
                .text();
            if again.lines().any(|l| l == "graft_upstream_inflight 1") {
                break;
            }
        }
        assert!(
            std::time::Instant::now() < deadline,
            "step 1's hanging call never started"
        );
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
    backend.kill9();
    std::thread::sleep(std::time::Duration::from_secs(2));
    let _backend = start_backend();
    let status = child.wait().unwrap();
    let mut err = String::new();
    std::io::Read::read_to_string(&mut child.stderr.take().unwrap(), &mut err).unwrap();
    assert!(status.success(), "{err}");
    let out_dir = dir.path().join("out");
    let log = steps(&out_dir);
    assert_eq!(log.len(), 2, "{log:#?}");
    let s = &log[1];
    assert!(s["backend_failed"].as_u64().unwrap() >= 1, "{s:#}");
    assert_eq!(s["groups"][0]["selected"], 4, "{s:#}");
    assert_eq!(s["sandboxes_open"], 0, "{s:#}");
    assert_eq!(s["sessions_open"], 0, "{s:#}");
    let events = s["backend_events"].as_array().unwrap();
    assert!(
        events
            .iter()
            .any(|e| e["event"] == "restarted" && e["repushed"] == "step-00000"),
        "{s:#}"
    );
    let hung = s["problems"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["outcome"].as_str().unwrap().starts_with("BackendFailed"))
        .unwrap_or_else(|| panic!("{s:#}"));
    // Every call of step 1 the backend answered was served by step 0's weights: before the
    // restart, and after it because they were pushed again.
    let recs = common::records_show(&out_dir.join("data"));
    let step1: Vec<&Value> = recs
        .iter()
        .filter(|r| r["group_id"].as_str().unwrap().starts_with("step1-"))
        .collect();
    assert!(
        step1
            .iter()
            .any(|r| r["session_id"] == hung["session"] && r["outcome"] == "upstream_error"),
        "the failed call is recorded: {step1:#?}"
    );
    let answered: Vec<&&Value> = step1.iter().filter(|r| r["outcome"] == "ok").collect();
    assert!(answered.len() >= 8, "{step1:#?}");
    for r in answered {
        assert_eq!(r["weight_version"], "step-00000", "{r:#}");
    }
}

/// `trainer.resident = false`: the per-step path (the benchmark's baseline) still works:
/// each step loads the policy from the previous step's checkpoint (its optimizer state
/// resumed), writes a checkpoint, and pushes that checkpoint as files.
#[cfg(feature = "trainer")]
#[test]
fn rl_per_step_trainer_checkpoints_and_pushes_every_step() {
    let env = TestEnv::get();
    let dir = tempfile::tempdir().unwrap();
    let cfg = training_config(dir.path(), &env, 2, "", "resident = false\n");
    let (ok, out) = rl(&["--config", cfg.to_str().unwrap()]);
    assert!(ok, "{out}");
    assert!(!out.contains("trainer: resident"), "{out}");
    let out_dir = dir.path().join("out");
    let log = steps(&out_dir);
    assert_eq!(log.len(), 2, "{log:#?}");
    for (i, s) in log.iter().enumerate() {
        let train = &s["train"];
        assert_eq!(train["trainer"], "per step", "{s:#}");
        assert_eq!(
            train["steps"][0]["step"],
            i + 1,
            "optimizer state resumed: {s:#}"
        );
        let ckpt = Path::new(train["checkpoint"].as_str().unwrap());
        assert!(
            ckpt.join("optimizer.safetensors").exists(),
            "{}",
            ckpt.display()
        );
        assert_eq!(
            train["weights"].as_str(),
            train["checkpoint"].as_str(),
            "{s:#}"
        );
        assert!(
            train["handoff"].as_str().unwrap().starts_with("file"),
            "{s:#}"
        );
        assert_eq!(s["weight_version"], format!("step-{i:05}"));
    }
    assert!(!out_dir.join("weights").exists());
}

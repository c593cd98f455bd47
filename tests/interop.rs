//! graft's samples in other RL frameworks' layouts: a real `graft rl` run (the example agent
//! in envd sandboxes, exact mode, the scripted backend with real Qwen3 ids) makes the
//! samples; the `graft_rl` Python package (`python/`) reads them with pyarrow.
//!
//! - `python/tests/test_properties.py` (hypothesis) on generated samples and on these;
//! - `graft export --to NAME` for every layout, checked here against graft's own Rust reader;
//! - ignored (the heavier tier, `--ignored`): `python/tests/test_frameworks.py`, each
//!   framework's tests in its own `rlfw/NAME` venv, the real verl / TRL / SkyRL / OpenRLHF /
//!   Tinker types, and the rollout service behind each trainer's own extension point (`graft_rl.adapters`: verl's
//!   `AgentLoopWorker`, a SkyRL generator, an OpenRLHF agent executor, a slime rollout
//!   function; TRL's `rollout_func`).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use common::{TestEnv, graft_bin, repo_root};
use graft_reconstruct::sample::{Sample, read_samples_parquet};
use serde_json::Value;

/// A venv of the test env by name, or a failure that says how to install it.
fn venv_python(env: &TestEnv, name: &str, how: &str) -> PathBuf {
    let p = env.root.join(name).join("bin").join("python");
    assert!(
        p.exists(),
        "{} is missing: run `{how}` from the repository root",
        p.display()
    );
    p
}

/// One framework's install, from `scripts/test-env/frameworks.txt`: the Python its venv is
/// made with, the arguments of `pip install`, and those installed `--no-deps` after.
struct Framework {
    name: String,
    python: String,
    args: String,
    no_deps: Option<String>,
}

impl Framework {
    /// The line a user runs (docs/INTEGRATIONS.md): a venv named after the framework.
    fn line(&self) -> String {
        let n = &self.name;
        let mut line = format!(
            "{} -m venv {n} && {n}/bin/pip install {}",
            self.python, self.args
        );
        if let Some(nd) = &self.no_deps {
            line.push_str(&format!(" && {n}/bin/pip install --no-deps {nd}"));
        }
        line
    }
}

/// The frameworks of `scripts/test-env/frameworks.txt`, in its order.
fn frameworks() -> Vec<Framework> {
    let path = repo_root().join("scripts/test-env/frameworks.txt");
    let text = std::fs::read_to_string(&path).unwrap();
    let mut out: Vec<Framework> = vec![];
    for line in text
        .lines()
        .filter(|l| !l.starts_with('#') && !l.trim().is_empty())
    {
        let mut words = line.split_whitespace();
        let (name, python) = (words.next().unwrap(), words.next().unwrap());
        let args = words.collect::<Vec<_>>().join(" ");
        if python == "--no-deps" {
            let fw = out.iter_mut().find(|f| f.name == name).unwrap_or_else(|| {
                panic!("{}: --no-deps before {name}'s venv line", path.display())
            });
            assert!(fw.no_deps.is_none(), "{name}: two --no-deps lines");
            fw.no_deps = Some(args);
        } else {
            assert!(out.iter().all(|f| f.name != name), "{name}: two venv lines");
            out.push(Framework {
                name: name.to_owned(),
                python: python.to_owned(),
                args,
                no_deps: None,
            });
        }
    }
    out
}

/// The `graft rl` config of these tests: the example's, one step.
fn rl_config(env: &TestEnv, dir: &Path) -> PathBuf {
    common::rl_example_config(dir, env, 1)
}

/// `graft rl`, one step of 2 tasks × 2 rollouts, collecting only; returns its samples file.
fn graft_rl_samples(env: &TestEnv, dir: &Path) -> PathBuf {
    let p = rl_config(env, dir);
    let o = Command::new(graft_bin())
        .args(["rl", "--config", p.to_str().unwrap()])
        .env("GRAFT_LOG", "warn")
        .stdin(Stdio::null())
        .output()
        .unwrap();
    assert!(
        o.status.success(),
        "graft rl failed\n{}\n{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );
    let f = dir.join("out/samples/step-00000.parquet");
    assert!(f.is_file(), "graft rl wrote no samples file");
    f
}

/// pytest on one file of `python/tests` with the samples real graft made; fails with its
/// output unless every test passed.
fn pytest(python: &Path, file: &str, samples: &Path) -> String {
    pytest_env(python, file, samples, &[])
}

fn pytest_env(python: &Path, file: &str, samples: &Path, envs: &[(&str, &str)]) -> String {
    pytest_env_k(python, file, None, samples, envs)
}

/// [`pytest_env`] of the tests whose names match `k` (pytest's `-k`) only.
fn pytest_env_k(
    python: &Path,
    file: &str,
    k: Option<&str>,
    samples: &Path,
    envs: &[(&str, &str)],
) -> String {
    let o = Command::new(python)
        .args(["-m", "pytest", "-q", "-p", "no:cacheprovider"])
        .args(k.map(|k| ["-k", k]).into_iter().flatten())
        .arg(repo_root().join("python/tests").join(file))
        .env("PYTHONPATH", repo_root().join("python/src"))
        .env("GRAFT_SAMPLES", samples)
        .env("PYTHONDONTWRITEBYTECODE", "1")
        .env(
            "HYPOTHESIS_STORAGE_DIRECTORY",
            samples.with_file_name("hypothesis"),
        )
        .envs(envs.iter().copied())
        .current_dir(samples.parent().unwrap())
        .stdin(Stdio::null())
        .output()
        .unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );
    assert!(o.status.success(), "pytest {file} failed:\n{text}");
    assert!(
        text.contains(" passed") && !text.contains("failed") && !text.contains("skipped"),
        "{text}"
    );
    text
}

/// `graft export` with `python` (the package from this checkout on its path).
fn export(python: &Path, args: &[&str]) -> (bool, String, String) {
    let o = Command::new(graft_bin())
        .arg("export")
        .args(args)
        .arg("--python")
        .arg(python)
        .env("PYTHONPATH", repo_root().join("python/src"))
        .stdin(Stdio::null())
        .output()
        .unwrap();
    (
        o.status.success(),
        String::from_utf8_lossy(&o.stdout).into_owned(),
        String::from_utf8_lossy(&o.stderr).into_owned(),
    )
}

fn jsonl(p: &Path) -> Vec<Value> {
    std::fs::read_to_string(p)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

fn ints(v: &Value) -> Vec<u64> {
    v.as_array()
        .unwrap_or_else(|| panic!("not a list: {v}"))
        .iter()
        .map(|x| x.as_u64().unwrap())
        .collect()
}

/// The tokens of `ids` where `mask` is 1.
fn masked(ids: &Value, mask: &Value) -> Vec<u64> {
    ints(ids)
        .into_iter()
        .zip(ints(mask))
        .filter(|(_, m)| *m == 1)
        .map(|(t, _)| t)
        .collect()
}

fn sampled(s: &Sample) -> Vec<u64> {
    s.tokens
        .iter()
        .zip(&s.loss_mask)
        .filter(|(_, m)| **m == 1)
        .map(|(t, _)| u64::from(*t))
        .collect()
}

fn by_id<'a>(samples: &'a [Sample], id: &Value) -> &'a Sample {
    samples
        .iter()
        .find(|s| id.as_str() == Some(s.sample_id.as_str()))
        .unwrap_or_else(|| panic!("no sample {id}"))
}

#[test]
fn graft_rl_samples_pass_every_exporters_properties_and_graft_export_writes_each_layout() {
    let env = TestEnv::get();
    let py = venv_python(&env, "interop", "bash scripts/setup-test-env.sh");
    let dir = tempfile::tempdir().unwrap();
    let file = graft_rl_samples(&env, dir.path());
    let samples = read_samples_parquet(&file).unwrap();
    assert_eq!(samples.len(), 4);

    let out = pytest(&py, "test_properties.py", &file);
    assert!(out.contains("13 passed"), "{out}");

    let f = file.to_str().unwrap();
    for to in graft::export::FORMATS {
        let dest = dir.path().join(format!("{to}.jsonl"));
        let (ok, stdout, stderr) = export(
            &py,
            &["--to", to, "--samples", f, "--out", dest.to_str().unwrap()],
        );
        assert!(ok, "graft export --to {to}: {stderr}");
        let summary: Value = serde_json::from_str(stdout.lines().last().unwrap()).unwrap();
        assert_eq!(summary["samples"], 4, "{summary}");
        let rows = jsonl(&dest);
        assert_eq!(rows.len(), 4, "{to}");
        for (i, r) in rows.iter().enumerate() {
            // What each layout trains on, read back from its own field names, must be the
            // sampled tokens graft's Rust reader sees.
            let (got, s) = match to {
                "verl" => (
                    masked(&r["response_ids"], &r["response_mask"]),
                    by_id(&samples, &r["graft_sample_id"]),
                ),
                "trl" => (
                    masked(&r["completion_ids"], &r["env_mask"]),
                    by_id(&samples, &r["graft_sample_id"]),
                ),
                "trl-sft" => (masked(&r["input_ids"], &r["assistant_masks"]), &samples[i]),
                "skyrl" => (masked(&r["response_ids"], &r["loss_masks"]), &samples[i]),
                "openrlhf" => {
                    let obs = ints(&r["observation_tokens"]);
                    let got = r["action_ranges"]
                        .as_array()
                        .unwrap()
                        .iter()
                        .flat_map(|ab| {
                            let ab = ints(ab);
                            obs[ab[0] as usize..ab[1] as usize].to_vec()
                        })
                        .collect();
                    (got, by_id(&samples, &r["graft_sample_id"]))
                }
                "slime" => {
                    let toks = ints(&r["tokens"]);
                    let n = r["response_length"].as_u64().unwrap() as usize;
                    let resp = Value::from(toks[toks.len() - n..].to_vec());
                    (
                        masked(&resp, &r["loss_mask"]),
                        by_id(&samples, &r["metadata"]["graft_sample_id"]),
                    )
                }
                "tinker" => (
                    masked(
                        &r["loss_fn_inputs"]["target_tokens"],
                        &Value::from(
                            r["loss_fn_inputs"]["mask"]
                                .as_array()
                                .unwrap()
                                .iter()
                                .map(|m| m.as_f64().unwrap() as u64)
                                .collect::<Vec<_>>(),
                        ),
                    ),
                    by_id(&samples, &r["graft_sample_id"]),
                ),
                other => panic!("a layout without a check: {other}"),
            };
            assert_eq!(got, sampled(s), "{to} row {i}");
        }
    }
    // The reward sits on the last response token of verl's layout, in its group.
    let verl = jsonl(&dir.path().join("verl.jsonl"));
    for r in &verl {
        let s = by_id(&samples, &r["graft_sample_id"]);
        assert_eq!(r["reward_score"].as_f64(), s.reward);
        assert_eq!(r["uid"].as_str(), s.group_id.as_deref());
        assert_eq!(
            r["response_logprobs"].as_array().unwrap().len(),
            r["response_ids"].as_array().unwrap().len()
        );
    }

    // A Python without the package: the error says how to install it.
    let (ok, _, stderr) = {
        let o = Command::new(graft_bin())
            .args(["export", "--to", "trl", "--samples", f, "--out"])
            .arg(dir.path().join("x.jsonl"))
            .arg("--python")
            .arg(&py)
            .env_remove("PYTHONPATH")
            .output()
            .unwrap();
        (
            o.status.success(),
            String::new(),
            String::from_utf8_lossy(&o.stderr).into_owned(),
        )
    };
    assert!(!ok);
    assert!(stderr.contains("pip install ./python"), "{stderr}");
}

/// The heavier tier: `bash scripts/setup-test-env.sh rlfw` (each framework in a venv of its
/// own, made by its line of `scripts/test-env/frameworks.txt`: torch and the framework from
/// PyPI, several GB each), then `cargo test -p graft --features testkit --test interop --
/// --ignored`. Each framework's tests in `python/tests/test_frameworks.py` (`test_NAME_*`)
/// run in its own venv; one `graft rollouts serve` answers TRL's, verl's, SkyRL's,
/// OpenRLHF's and slime's adapters in turn (4 rollouts each).
#[test]
#[ignore = "needs the rlfw venvs (bash scripts/setup-test-env.sh rlfw); run with --ignored"]
fn graft_rl_samples_load_into_verl_trl_skyrl_openrlhf_and_tinker_types() {
    let env = TestEnv::get();
    let dir = tempfile::tempdir().unwrap();
    let file = graft_rl_samples(&env, dir.path());
    // The rollout service, for TRL's rollout_func driving real rollouts.
    let svc_dir = tempfile::tempdir().unwrap();
    let cfg = rl_config(&env, svc_dir.path());
    let svc = common::Proc::spawn_env(
        "rollouts",
        &["rollouts", "serve", "--config", cfg.to_str().unwrap()],
        &[],
        "graft rollouts listening on",
        None,
    );
    let tasks = repo_root().join("examples/rl/tasks.jsonl");
    let mut passed = 0;
    for fw in frameworks() {
        let py = venv_python(
            &env,
            &format!("rlfw/{}", fw.name),
            "bash scripts/setup-test-env.sh rlfw",
        );
        let out = pytest_env_k(
            &py,
            "test_frameworks.py",
            Some(&format!("test_{}_", fw.name)),
            &file,
            &[
                ("GRAFT_QWEN3_DIR", env.qwen3_dir().to_str().unwrap()),
                ("GRAFT_ROLLOUTS_URL", svc.url.as_str()),
                ("GRAFT_TASKS", tasks.to_str().unwrap()),
                ("GRAFT_BIN", graft_bin().to_str().unwrap()),
            ],
        );
        let n: usize = out
            .split(" passed")
            .next()
            .and_then(|t| t.rsplit(|c: char| !c.is_ascii_digit()).next())
            .and_then(|n| n.parse().ok())
            .unwrap_or_else(|| panic!("{}: no count of passed tests: {out}", fw.name));
        passed += n;
    }
    assert_eq!(
        passed, 14,
        "every test of test_frameworks.py, each in its framework's venv"
    );

    let py = venv_python(&env, "rlfw/verl", "bash scripts/setup-test-env.sh rlfw");
    // graft export --format native: verl's own DataProto file, loaded back by verl.
    let dest = dir.path().join("batch.dp");
    let (ok, _, stderr) = export(
        &py,
        &[
            "--to",
            "verl",
            "--format",
            "native",
            "--samples",
            file.to_str().unwrap(),
            "--out",
            dest.to_str().unwrap(),
        ],
    );
    assert!(ok, "{stderr}");
    let o = Command::new(&py)
        .args([
            "-c",
            "import sys; from verl import DataProto; d = DataProto.load_from_disk(sys.argv[1]); d.check_consistency(); print(len(d), sorted(set(d.non_tensor_batch['uid'])))",
        ])
        .arg(&dest)
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&o.stdout);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert!(text.starts_with("4 ["), "{text}");
}

/// The trainer's own SGLang-compatible server: a scripted upstream (the example's script,
/// `rule_extra` merged into its first rule) serving `version`.
fn own_backend(
    env: &TestEnv,
    dir: &Path,
    name: &str,
    version: &str,
    rule_extra: Value,
) -> common::Proc {
    let mut script: Value = serde_json::from_str(
        &std::fs::read_to_string(repo_root().join("examples/rl/scripted.json")).unwrap(),
    )
    .unwrap();
    for (k, v) in rule_extra.as_object().unwrap() {
        script["rules"][0][k] = v.clone();
    }
    let path = dir.join(format!("{name}.json"));
    std::fs::write(&path, script.to_string()).unwrap();
    let q = env.qwen3_dir();
    let up = common::Proc::scripted_upstream(&[
        "--script",
        path.to_str().unwrap(),
        "--tokenizer",
        q.to_str().unwrap(),
    ]);
    set_version(&up.url, version);
    up
}

fn set_version(url: &str, version: &str) {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let r = rt.block_on(common::http::post_json(
        &format!("{url}/update_weights_from_disk"),
        &[],
        &serde_json::json!({"model_path": "/trainer/step-9", "weight_version": version}),
    ));
    assert_eq!(r.status, 200, "{}", r.text());
}

/// A client script of graft's Python package (`python -c SCRIPT SERVICE TASKS BACKENDS...`)
/// against the rollout service; its last JSON line.
fn service_client(py: &Path, script: &str, svc: &str, backends: &[&str], secs: u64) -> Value {
    let mut cmd = Command::new(py);
    cmd.args(["-c", script])
        .arg(svc)
        .arg(repo_root().join("examples/rl/tasks.jsonl"))
        .args(backends)
        .env("PYTHONPATH", repo_root().join("python/src"));
    common::run_client(cmd, std::time::Duration::from_secs(secs))
}

/// A `graft rollouts serve` on the example's config, the interop venv's python, and a temp
/// dir for both.
fn service_setup() -> (TestEnv, PathBuf, tempfile::TempDir, PathBuf) {
    let env = TestEnv::get();
    let py = venv_python(&env, "interop", "bash scripts/setup-test-env.sh");
    let dir = tempfile::tempdir().unwrap();
    let cfg = rl_config(&env, dir.path());
    (env, py, dir, cfg)
}

fn rollout_service(cfg: &Path) -> common::Proc {
    rollout_service_with(cfg, &[])
}

fn rollout_service_with(cfg: &Path, extra: &[&str]) -> common::Proc {
    let mut args = vec!["rollouts", "serve", "--config", cfg.to_str().unwrap()];
    args.extend_from_slice(extra);
    common::Proc::spawn_env("rollouts", &args, &[], "graft rollouts listening on", None)
}

/// `graft rollouts serve` over real HTTP: graft's Python client posts two tasks with a group
/// size of 2, the trainer's own server (not the config's backend) and weight version, and a
/// sampling policy; the groups stream back as NDJSON lines with their rollouts, rewards and
/// token-level samples, every call answered by the trainer's server under that policy. A
/// weight version the backends do not serve is refused before anything runs; bad batches
/// get a 400 that says what is wrong, a body past `--max-body-bytes` a 413 (and the service
/// goes on).
#[test]
fn the_rollout_service_streams_each_group_with_rewards_and_samples() {
    let (env, py, dir, cfg) = service_setup();
    let own = own_backend(&env, dir.path(), "own", "trainer-v9", serde_json::json!({}));
    let svc = rollout_service_with(&cfg, &["--max-body-bytes", "65536"]);
    // Bodies that are no batch, or a wrong one, are refused with what is wrong.
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let task = serde_json::json!({"id": "t", "prompt": "p", "reward": {"command": "true"}});
    for (body, want) in [
        (serde_json::json!({"task": []}), "group_size"),
        (
            serde_json::json!({"tasks": [task], "harness": "nope"}),
            "names harness 'nope'",
        ),
        (
            serde_json::json!({"tasks": [task], "backends": ["ftp://x"]}),
            "http(s) URL",
        ),
        (
            serde_json::json!({"tasks": [task], "backends": []}),
            "'backends' is empty",
        ),
        (
            serde_json::json!({"tasks": [task], "temperature": 1.0, "sampling": {"mode": "enforce"}}),
            "not both",
        ),
        (
            serde_json::json!({"tasks": [task], "sampling": {"mode": "enforce", "temperature": "hot"}}),
            "not a sampling policy",
        ),
        (serde_json::json!({"tasks": [task, task]}), "given twice"),
    ] {
        let r = rt.block_on(common::http::post_json(
            &format!("{}/rollouts", svc.url),
            &[],
            &body,
        ));
        assert_eq!(r.status, 400, "{body}: {}", r.text());
        assert!(r.text().contains(want), "{body}: {}", r.text());
    }
    let huge = serde_json::json!({"tasks": [{"id": "t", "prompt": "p".repeat(100_000),
        "reward": {"command": "true"}}]});
    let r = rt.block_on(common::http::post_json(
        &format!("{}/rollouts", svc.url),
        &[],
        &huge,
    ));
    assert_eq!(r.status, 413, "{}", r.text());
    assert!(r.text().contains("65536 bytes"), "{}", r.text());

    let script = r#"
import json, sys, time
from graft_rl.service import RolloutClient
from graft_rl import verl_layout, SampleError
tasks = [json.loads(l) for l in open(sys.argv[2])][:2]
own = sys.argv[3]
c = RolloutClient(sys.argv[1])
# The config's backend serves "default": a batch for the trainer's version is refused there.
try:
    list(c.groups(tasks, group_size=2, weight_version="trainer-v9"))
    refused = None
except SampleError as e:
    refused = str(e)
out = []
policy = {"mode": "enforce", "temperature": 0.7, "top_p": 0.9}
for g in c.groups(tasks, group_size=2, weight_version="trainer-v9", backends=[own], sampling=policy):
    b = verl_layout(g.samples)
    out.append({"task": g.task_id, "rewards": [r["reward"] for r in g.rollouts],
                "outcomes": [r["outcome"] for r in g.rollouts],
                "backends": [r["backend"] for r in g.rollouts],
                "samples": len(g.samples), "groups": sorted({s.group_id for s in g.samples}),
                "sampled": [s.sampled_tokens() for s in g.samples],
                "verl_trained": [int(x) for x in b["response_mask"].sum(axis=1)],
                "known": all(s.sampled_logprobs_known() for s in g.samples),
                "versions": sorted({v for s in g.samples for v in s.token_weight_versions if v}),
                "stops": [r["stop_reason"] for r in g.rollouts],
                "sample_stops": g.stop_reasons,
                "stale": g.stale_calls, "stale_samples": g.stale_samples,
                "calls": sum(g.calls_by_weight_version.values())})
print(json.dumps({"groups": out, "summary": c.last_summary, "refused": refused}))
"#;
    let v = service_client(&py, script, &svc.url, &[&own.url], 240);
    let refused = v["refused"].as_str().unwrap_or_default();
    assert!(
        refused.contains("HTTP 409")
            && refused.contains("serves weight version 'default'")
            && refused.contains("'trainer-v9'"),
        "{v}"
    );
    assert_eq!(v["summary"]["groups"], 2, "{v}");
    assert_eq!(v["summary"]["rollouts"], 4, "{v}");
    let groups = v["groups"].as_array().unwrap();
    assert_eq!(groups.len(), 2, "{v}");
    for g in groups {
        // The scripted model solves the addition and miscounts the lines (as in tests/rl.rs).
        let want = if g["task"] == "add-17-25" { 1.0 } else { 0.0 };
        assert_eq!(g["rewards"], serde_json::json!([want, want]), "{g}");
        assert_eq!(
            g["outcomes"],
            serde_json::json!(["scored", "scored"]),
            "{g}"
        );
        assert_eq!(g["backends"], serde_json::json!([own.url, own.url]), "{g}");
        assert_eq!(g["samples"], 2, "one sample per rollout: {g}");
        // The example agent's last call ends its turn: each rollout and sample stopped there.
        assert_eq!(g["stops"], serde_json::json!(["stop", "stop"]), "{g}");
        assert_eq!(
            g["sample_stops"],
            serde_json::json!(["stop", "stop"]),
            "{g}"
        );
        assert_eq!(g["groups"].as_array().unwrap().len(), 1, "{g}");
        assert_eq!(g["known"], true, "exact mode records every logprob: {g}");
        // Every call was answered by the trainer's server, with the trainer's weights.
        assert!(g["calls"].as_u64().unwrap() >= 4, "{g}");
        assert_eq!(g["stale"], 0, "{g}");
        assert_eq!(g["stale_samples"], 0, "{g}");
        assert_eq!(g["versions"], serde_json::json!(["trainer-v9"]), "{g}");
        for (sampled, trained) in g["sampled"]
            .as_array()
            .unwrap()
            .iter()
            .zip(g["verl_trained"].as_array().unwrap())
        {
            assert!(sampled.as_array().unwrap().len() > 10, "{g}");
            assert_eq!(
                sampled.as_array().unwrap().len() as u64,
                trained.as_u64().unwrap()
            );
        }
    }
    // The service's sessions are the gateway's: their records are in the run's data dir,
    // every call sent to the trainer's server with the batch's policy enforced.
    let recs = common::records_show(&dir.path().join("out/data"));
    assert_eq!(recs.len(), 8, "two model calls per rollout");
    for r in &recs {
        assert_eq!(r["upstream"], own.url.as_str(), "{r:#}");
        assert_eq!(r["sampling"]["sent"]["temperature"], 0.7, "{r:#}");
        assert_eq!(r["sampling"]["sent"]["top_p"], 0.9, "{r:#}");
    }
}

/// The same service answering in Arrow IPC (read by pyarrow in graft's Python client), and
/// the trainer's weight version enforced mid-batch: the trainer's server takes new weights
/// while the first call of each rollout is generating (the scripted server holds that call
/// until the update), so those samples hold tokens of two versions; they are left out and
/// counted, or kept with each token's version when the batch allows stale samples.
#[test]
fn the_rollout_service_answers_in_arrow_and_leaves_out_samples_of_other_weights() {
    let (env, py, dir, cfg) = service_setup();
    let own = own_backend(&env, dir.path(), "own", "trainer-v9", serde_json::json!({}));
    let held = own_backend(
        &env,
        dir.path(),
        "held",
        "trainer-v9",
        serde_json::json!({"weight_update_after": 3}),
    );
    let svc = rollout_service(&cfg);
    let script = r#"
import json, sys, threading, time, urllib.request
from graft_rl.service import RolloutClient
tasks = [json.loads(l) for l in open(sys.argv[2])][:1]
own, held = sys.argv[3], sys.argv[4]
c = RolloutClient(sys.argv[1])
def view(groups):
    return [{"task": g.task_id, "rewards": [r["reward"] for r in g.rollouts],
             "outcomes": [r["outcome"] for r in g.rollouts],
             "backends": [r["backend"] for r in g.rollouts],
             "samples": len(g.samples), "sampled": [len(s.sampled_tokens()) for s in g.samples],
             "versions": [sorted({v for v in s.token_weight_versions if v}) for s in g.samples],
             "sample_stops": g.stop_reasons, "stale": g.stale_calls,
             "stale_samples": g.stale_samples, "calls": sum(g.calls_by_weight_version.values())}
            for g in groups]
out = {}
out["arrow"] = view(c.groups(tasks, group_size=2, weight_version="trainer-v9", backends=[own], arrow=True))
out["arrow_summary"] = c.last_summary
out["json"] = view(c.groups(tasks, group_size=2, weight_version="trainer-v9", backends=[own]))
def update(version):
    time.sleep(3)  # the batch's version check is long done; its first calls are held
    body = json.dumps({"model_path": "/trainer/step-10", "weight_version": version}).encode()
    urllib.request.urlopen(urllib.request.Request(held + "/update_weights_from_disk", data=body,
        headers={"content-type": "application/json"}, method="POST")).read()
for name, old, new, allow in (("stale", "trainer-v9", "trainer-v10", False),
                              ("allowed", "trainer-v10", "trainer-v11", True)):
    t = threading.Thread(target=update, args=(new,))
    t.start()
    out[name] = view(c.groups(tasks, group_size=2, weight_version=old, backends=[held],
                              allow_stale=allow, arrow=True))
    t.join()
print(json.dumps(out))
"#;
    let v = service_client(&py, script, &svc.url, &[&own.url, &held.url], 300);
    // Arrow and NDJSON give the same groups.
    assert_eq!(v["arrow"], v["json"], "{v:#}");
    assert_eq!(v["arrow_summary"]["groups"], 1, "{v}");
    let g = &v["arrow"][0];
    assert_eq!(g["task"], "add-17-25", "{g}");
    assert_eq!(g["rewards"], serde_json::json!([1.0, 1.0]), "{g}");
    assert_eq!(
        g["outcomes"],
        serde_json::json!(["scored", "scored"]),
        "{g}"
    );
    assert_eq!(g["backends"], serde_json::json!([own.url, own.url]), "{g}");
    assert_eq!(g["samples"], 2, "{g}");
    assert_eq!(
        g["sample_stops"],
        serde_json::json!(["stop", "stop"]),
        "{g}"
    );
    assert_eq!(
        g["versions"],
        serde_json::json!([["trainer-v9"], ["trainer-v9"]]),
        "{g}"
    );
    assert!(
        g["sampled"]
            .as_array()
            .unwrap()
            .iter()
            .all(|n| n.as_u64().unwrap() > 10),
        "{g}"
    );
    // The trainer's server changed weights mid-call: both samples are left out, counted.
    let g = &v["stale"][0];
    assert_eq!(
        g["rewards"],
        serde_json::json!([1.0, 1.0]),
        "scored all the same: {g}"
    );
    assert_eq!(g["samples"], 0, "{g}");
    assert_eq!(g["stale_samples"], 2, "{g}");
    assert_eq!(
        g["stale"], g["calls"],
        "every call ended under the new weights: {g}"
    );
    // Allowed: kept, each holding tokens of both versions.
    let g = &v["allowed"][0];
    assert_eq!(g["samples"], 2, "{g}");
    assert_eq!(g["stale_samples"], 0, "{g}");
    assert_eq!(
        g["versions"],
        serde_json::json!([
            ["trainer-v10", "trainer-v11"],
            ["trainer-v10", "trainer-v11"]
        ]),
        "{g}"
    );
}

/// `graft rollouts serve` takes what its docs say: `graft rl`'s config without `run.steps`
/// or `[tasks]` (tasks come with each request) starts and answers; `graft rl` refuses that
/// config naming what it lacks; and a `[tasks]` file that does not exist is refused at start
/// by both, naming the key and the path, instead of being accepted unread.
#[test]
fn the_rollout_service_takes_a_config_without_steps_or_tasks_and_refuses_a_missing_file() {
    let env = TestEnv::get();
    let dir = tempfile::tempdir().unwrap();
    let full = std::fs::read_to_string(rl_config(&env, dir.path())).unwrap();
    let tasks = repo_root().join("examples/rl/tasks.jsonl");
    let tasks_section = format!("[tasks]\nfile = \"{}\"\n", tasks.display());
    assert!(full.contains(&tasks_section) && full.contains("steps = 1\n"));
    let lean = dir.path().join("lean.toml");
    std::fs::write(
        &lean,
        full.replace(&tasks_section, "").replace("steps = 1\n", ""),
    )
    .unwrap();
    let run = |args: &[&str]| {
        let o = Command::new(graft_bin())
            .args(args)
            .env("GRAFT_LOG", "warn")
            .stdin(Stdio::null())
            .output()
            .unwrap();
        (
            o.status.success(),
            String::from_utf8_lossy(&o.stderr).into_owned(),
        )
    };
    {
        let svc = rollout_service(&lean);
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let r = rt.block_on(common::http::get(&format!("{}/health", svc.url), &[]));
        assert_eq!(r.status, 200, "{}", r.text());
    }
    let l = lean.to_str().unwrap();
    let (ok, stderr) = run(&["rl", "--config", l]);
    assert!(!ok && stderr.contains("run.steps is missing"), "{stderr}");
    let (ok, stderr) = run(&["rl", "--config", l, "--steps", "1"]);
    assert!(!ok && stderr.contains("[tasks] is missing"), "{stderr}");

    let gone = dir.path().join("no-such-tasks.jsonl");
    let missing = dir.path().join("missing.toml");
    std::fs::write(
        &missing,
        full.replace(
            &tasks_section,
            &format!("[tasks]\nfile = \"{}\"\n", gone.display()),
        ),
    )
    .unwrap();
    let m = missing.to_str().unwrap();
    for args in [
        &["rollouts", "serve", "--config", m][..],
        &["rl", "--config", m][..],
    ] {
        let (ok, stderr) = run(args);
        assert!(!ok, "{args:?} started with a task file that does not exist");
        assert!(
            stderr.contains(&format!("tasks.file = {}: no such file", gone.display())),
            "{args:?}: {stderr}"
        );
    }
}

/// `graft export --format native` in a Python without the framework (the interop venv has
/// graft_rl, pyarrow and numpy, no verl, SkyRL or torch): the error names the missing
/// package and its install line instead of a traceback, and nothing is written (SkyRL used
/// to leave an empty file), not even a temp file beside it.
/// docs/INTEGRATIONS.md's install lines are the ones the interop tier runs: its block under
/// "Installing a framework" is `scripts/test-env/frameworks.txt` rendered, line for line, and
/// names every framework the tier's tests cover (`test_NAME_*` in test_frameworks.py).
#[test]
fn integrations_doc_shows_the_install_lines_the_interop_tier_runs() {
    let fws = frameworks();
    let want: Vec<String> = fws.iter().map(Framework::line).collect();
    let doc = std::fs::read_to_string(repo_root().join("docs/INTEGRATIONS.md")).unwrap();
    let section = doc
        .split("\n## Installing a framework\n")
        .nth(1)
        .expect("docs/INTEGRATIONS.md has a section \"## Installing a framework\"");
    let block = section
        .split("\n```sh\n")
        .nth(1)
        .and_then(|b| b.split("\n```").next())
        .expect("its install lines in a ```sh block");
    let got: Vec<&str> = block.lines().collect();
    assert_eq!(
        got,
        want,
        "docs/INTEGRATIONS.md's install lines differ from scripts/test-env/frameworks.txt; \
         the block should read:\n{}",
        want.join("\n")
    );
    let names: Vec<&str> = fws.iter().map(|f| f.name.as_str()).collect();
    assert_eq!(
        names,
        ["verl", "trl", "skyrl", "openrlhf", "slime", "tinker"],
        "one venv per framework"
    );
    let tests =
        std::fs::read_to_string(repo_root().join("python/tests/test_frameworks.py")).unwrap();
    for f in &fws {
        assert!(
            tests.contains(&format!("def test_{}_", f.name)),
            "no test_{}_* in test_frameworks.py runs in its venv",
            f.name
        );
        assert!(
            f.args.starts_with("./python "),
            "{}: graft's package first",
            f.line()
        );
    }
}

#[test]
fn export_native_without_the_framework_names_the_package_and_writes_nothing() {
    let env = TestEnv::get();
    let py = venv_python(&env, "interop", "bash scripts/setup-test-env.sh");
    let dir = tempfile::tempdir().unwrap();
    let file = graft_rl_samples(&env, dir.path());
    let f = file.to_str().unwrap();
    let outdir = dir.path().join("native");
    for (to, needs) in [
        ("skyrl", "skyrl==0.4.0"),
        ("verl", "verl==0.9.1"),
        ("slime", "pip install torch"),
    ] {
        let dest = outdir.join(format!("{to}.pkl"));
        let (ok, stdout, stderr) = export(
            &py,
            &[
                "--to",
                to,
                "--format",
                "native",
                "--samples",
                f,
                "--out",
                dest.to_str().unwrap(),
            ],
        );
        assert!(!ok, "{to}: exported without the framework: {stdout}");
        assert!(
            stderr.contains(&format!("--format native --to {to} needs"))
                && stderr.contains("cannot import")
                && stderr.contains(needs)
                && stderr.contains("--format jsonl"),
            "{to}: {stderr}"
        );
        assert!(!stderr.contains("Traceback"), "{to}: {stderr}");
        let left: Vec<_> = std::fs::read_dir(&outdir)
            .map(|d| d.map(|e| e.unwrap().file_name()).collect())
            .unwrap_or_default();
        assert!(left.is_empty(), "{to}: a failed export left {left:?}");
    }
}

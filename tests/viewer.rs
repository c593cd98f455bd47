//! The viewer's pages in a real headless Chromium (Debian's package, driven by
//! playwright-core from `.graft-test-env/playwright`), on a data dir made by the real openai
//! Python SDK through the gateway and samples made by `graft reconstruct` from it.
//! Screenshots go to `$CARGO_TARGET_TMPDIR/viewer-screenshots` (docs/screenshots/ holds a
//! copy, linked from the README).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;

use common::{Proc, Stack, TestEnv, graft, http};
use graft_reconstruct::sample::{EventKind, Sample};
use serde_json::{Value, json};

#[test]
fn every_page_loads_in_chromium_with_the_expected_content() {
    let env = TestEnv::get();
    let stack = Stack::start();
    let rt = tokio::runtime::Runtime::new().unwrap();
    let gw = stack.gateway.url.clone();
    for (id, group) in [
        ("s-one", "g1"),
        ("s-two", "g1"),
        ("s-three", "g2"),
        ("s-drift", "g2"),
    ] {
        let r = rt.block_on(http::post_json(
            &format!("{gw}/graft/sessions"),
            &[],
            &json!({"session_id": id, "group_id": group}),
        ));
        assert_eq!(r.status, 201, "{}", r.text());
    }
    // Real client sessions: the openai SDK, plain and streamed with a tool call.
    for (session, mode) in [
        ("s-one", "chat"),
        ("s-one", "chat-stream-tools"),
        ("s-two", "chat"),
        ("s-three", "chat-stream-tools"),
        // Its second turn re-sends the first reply rewritten: a drift, then a fork.
        ("s-drift", "chat-drift"),
    ] {
        env.py_client("openai_sdk.py", &[mode], &stack.target(Some(session), None));
    }
    for (id, reward) in [("s-one", 1.0), ("s-two", 0.0)] {
        let r = rt.block_on(http::post_json(
            &format!("{gw}/graft/sessions/{id}/reward"),
            &[],
            &json!({"reward": reward}),
        ));
        assert_eq!(r.status, 200, "{}", r.text());
    }
    let records = stack.records();
    let mut calls: BTreeMap<String, usize> = BTreeMap::new();
    for r in &records {
        *calls
            .entry(r["session_id"].as_str().unwrap().to_owned())
            .or_default() += 1;
    }
    assert_eq!(calls["s-one"], 2, "{records:?}");

    // Samples from those records (real tokenizer and template), as a run's step 0; the
    // run's steps.jsonl has three steps (as `graft rl` writes them) pointing at it.
    let run = stack.dir.path().join("run");
    let samples = run.join("samples").join("step-00000.parquet");
    std::fs::create_dir_all(samples.parent().unwrap()).unwrap();
    let qwen3 = env.qwen3_dir();
    graft(&[
        "reconstruct",
        "--data-dir",
        stack.data_dir.to_str().unwrap(),
        "--tokenizer",
        qwen3.to_str().unwrap(),
        "--out",
        samples.to_str().unwrap(),
        "--allow-skips",
    ]);
    let all = graft_reconstruct::sample::read_samples_parquet(&samples).unwrap();
    let sample = all.iter().find(|s| s.session_id == "s-one").unwrap();
    assert!(sample.trained_tokens() > 0);
    let mut steps = String::new();
    for step in 0..3 {
        steps.push_str(
            &json!({"step": step, "rollouts": 3, "scored": 2, "reward_mean": 0.25 * step as f64,
                "trained_tokens": sample.trained_tokens() * (step + 1), "samples": all.len(),
                "weight_version": format!("v{step}"), "call_weight_versions": {format!("v{step}"): 4},
                "samples_file": samples, "groups": [
                    {"group": "g1", "rollouts": 2, "decision": {"kind": "keep"}, "selected": 2},
                    {"group": "g2", "rollouts": 1, "decision": {"kind": "drop"}, "selected": 0}],
                "secs": {"step": 2.0, "rollout": 1.0, "reconstruct": 0.2, "train": 0.6, "push": 0.2},
                "rollout_list": [{"reward": 1.0}, {"reward": 0.0}]})
            .to_string(),
        );
        steps.push('\n');
    }
    std::fs::write(run.join("steps.jsonl"), steps).unwrap();

    let view = Proc::spawn_env(
        "view",
        &[
            "view",
            "--data-dir",
            stack.data_dir.to_str().unwrap(),
            "--run",
            run.to_str().unwrap(),
            "--model-dir",
            qwen3.to_str().unwrap(),
            "--listen",
            "127.0.0.1:0",
        ],
        &[],
        "graft view listening on",
        None,
    );
    let drifted: Vec<&Sample> = all.iter().filter(|s| s.session_id == "s-drift").collect();
    assert_eq!(drifted.len(), 2, "the rewritten turn forks: {drifted:#?}");
    assert!(
        drifted[0].events.iter().any(|e| e.kind == EventKind::Drift),
        "{:?}",
        drifted[0].events
    );
    assert_eq!(drifted[1].events[0].kind, EventKind::Fork);
    assert_eq!(
        Some(&drifted[1].events[0].reason),
        drifted[1].fork_reason.as_ref()
    );
    let sample_q = sample.sample_id.replace('/', "%2F");
    let pages = json!([
        {"name": "sessions", "path": "/"},
        {"name": "groups", "path": "/groups"},
        {"name": "group", "path": "/group/g1"},
        {"name": "session", "path": "/session/s-one"},
        {"name": "sample", "path": format!("/sample?file=step-00000.parquet&id={sample_q}")},
        {"name": "run", "path": "/run"},
        {"name": "drifted", "path": format!("/sample?file=step-00000.parquet&id={}", drifted[0].sample_id.replace('/', "%2F"))},
        {"name": "forked", "path": format!("/sample?file=step-00000.parquet&id={}", drifted[1].sample_id.replace('/', "%2F"))},
    ]);
    let shots = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("viewer-screenshots");
    let out = env.browse(&view.url, &pages, &shots);
    let names = |v: &Value| -> BTreeSet<String> {
        v.as_array()
            .unwrap()
            .iter()
            .map(|s| s.as_str().unwrap().to_owned())
            .collect()
    };
    let s = &out["sessions"];
    assert_eq!(
        names(&s["sessions"]),
        calls.keys().cloned().collect(),
        "{s}"
    );
    let shown: BTreeMap<String, usize> = s["sessions"]
        .as_array()
        .unwrap()
        .iter()
        .zip(s["session_calls"].as_array().unwrap())
        .map(|(n, c)| (n.as_str().unwrap().to_owned(), c.as_u64().unwrap() as usize))
        .collect();
    assert_eq!(shown, calls);
    assert_eq!(names(&out["groups"]["groups"]), names(&json!(["g1", "g2"])));
    let g = &out["group"];
    assert_eq!(names(&g["members"]), names(&json!(["s-one", "s-two"])));
    assert!(g["text"].as_str().unwrap().contains("keep"), "{g}");
    let expected_samples: BTreeSet<String> = all
        .iter()
        .filter(|x| x.group_id.as_deref() == Some("g1"))
        .map(|x| x.sample_id.clone())
        .collect();
    assert_eq!(names(&g["samples"]), expected_samples);
    let sess = &out["session"];
    assert_eq!(sess["calls"], 2, "{sess}");
    assert!(sess["tool_calls"].as_u64().unwrap() >= 1, "{sess}");
    assert!(
        sess["text"]
            .as_str()
            .unwrap()
            .contains("graft-chat: hello there")
    );
    // The sample view marks exactly the loss-mask-1 tokens.
    let sp = &out["sample"];
    assert_eq!(sp["tokens"], sample.tokens.len(), "{sp}");
    let marked: Vec<u64> = sp["trained"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_u64().unwrap())
        .collect();
    let mask1: Vec<u64> = sample
        .loss_mask
        .iter()
        .enumerate()
        .filter(|(_, m)| **m == 1)
        .map(|(i, _)| i as u64)
        .collect();
    assert_eq!(marked, mask1);
    // Forks and drift events stand before the token where they happen, with their reason.
    for (page, x) in [("drifted", drifted[0]), ("forked", drifted[1])] {
        let p = &out[page];
        let expected: Vec<Value> = x
            .events
            .iter()
            .map(|e| {
                let before = (e.at as usize) < x.tokens.len();
                json!({"kind": e.kind.as_str(), "at": e.at, "reason": e.reason,
                    "before": before.then_some(e.at)})
            })
            .collect();
        assert_eq!(p["events"], json!(expected), "{page}: {p}");
        assert_eq!(p["event_rows"], x.events.len(), "{page}");
    }
    // The run page: one point per step.
    assert_eq!(out["run"]["points"], 3);
    assert_eq!(out["run"]["steps"], 3);
}

/// `graft view` on its own listener, closed by default: beyond loopback without a key it
/// refuses to start and says how to set one; with a key, every page without it (or with
/// another) is a 401 viewer page, other methods a 405, and the key itself opens the pages.
#[test]
fn graft_view_is_closed_by_default() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    std::fs::create_dir_all(&data).unwrap();
    let o = std::process::Command::new(common::graft_bin())
        .args([
            "view",
            "--data-dir",
            data.to_str().unwrap(),
            "--listen",
            "0.0.0.0:0",
        ])
        .env_remove("GRAFT_ADMIN_KEY")
        .stdin(std::process::Stdio::null())
        .output()
        .unwrap();
    assert!(!o.status.success());
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        err.contains("beyond loopback") && err.contains("GRAFT_ADMIN_KEY"),
        "{err}"
    );

    let key = "view-key-0123456789abcdef";
    let view = Proc::spawn_env(
        "view-keyed",
        &[
            "view",
            "--data-dir",
            data.to_str().unwrap(),
            "--listen",
            "127.0.0.1:0",
        ],
        &[("GRAFT_ADMIN_KEY", key)],
        "graft view listening on",
        None,
    );
    let rt = tokio::runtime::Runtime::new().unwrap();
    let good = format!("Bearer {key}");
    for path in ["/", "/groups", "/session/s-one", "/run"] {
        let url = format!("{}{path}", view.url);
        for headers in [vec![], vec![("authorization", "Bearer not-the-key")]] {
            let r = rt.block_on(http::get(&url, &headers));
            assert_eq!(r.status, 401, "{path}: {}", r.text());
            assert!(r.header("content-type").unwrap().starts_with("text/html"));
            assert!(r.header("www-authenticate").is_some());
            assert!(r.text().contains("admin key"), "{}", r.text());
            assert!(!r.text().contains("not-the-key") && !r.text().contains(key));
        }
        let r = rt
            .block_on(http::send(
                "POST",
                &url,
                &[("authorization", &good)],
                vec![],
            ))
            .unwrap();
        assert_eq!(r.status, 405, "{path}: {}", r.text());
    }
    let r = rt.block_on(http::get(
        &format!("{}/", view.url),
        &[("authorization", &good)],
    ));
    assert_eq!(r.status, 200, "{}", r.text());
    assert!(
        r.text().contains("<span id=\"total\">0</span>"),
        "{}",
        r.text()
    );
    assert!(!r.text().contains(key));
}

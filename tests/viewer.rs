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
    let rt = tokio::runtime::Runtime::new().unwrap();

    // Issue 32, hole 3, for the viewer too: on loopback with no key given it is not open
    // to whatever runs on the host (a harness): it takes the data dir's own admin key, as
    // a gateway without `auth.admin_key` keeps it (written here, there being none yet).
    let own = Proc::spawn_env(
        "view-own-key",
        &[
            "view",
            "--data-dir",
            data.to_str().unwrap(),
            "--listen",
            "127.0.0.1:0",
        ],
        &[],
        "graft view listening on",
        None,
    );
    let file_key = common::admin_key(&data).expect("graft view keeps a key in the data dir");
    let r = rt
        .block_on(http::send_bare(
            "GET",
            &format!("{}/", own.url),
            &[],
            vec![],
        ))
        .unwrap();
    assert_eq!(r.status, 401, "{}", r.text());
    assert!(!r.text().contains(&file_key));
    let bearer = format!("Bearer {file_key}");
    let r = rt
        .block_on(http::send_bare(
            "GET",
            &format!("{}/", own.url),
            &[("authorization", &bearer)],
            vec![],
        ))
        .unwrap();
    assert_eq!(r.status, 200, "{}", r.text());
    assert!(own.stderr().contains("admin.key"), "{}", own.stderr());
    drop(own);
    std::fs::remove_file(data.join("admin.key")).unwrap();

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

    // Issue 32, hole 6: the login form. A wrong key is the form again (401), not echoed.
    let login = format!("{}/login", view.url);
    let post = |body: String| {
        rt.block_on(http::send("POST", &login, &[], body.into_bytes()))
            .unwrap()
    };
    let r = post("key=wrong-key-zzz&next=%2Fgroups".into());
    assert_eq!(r.status, 401, "{}", r.text());
    assert!(r.text().contains("not the admin key") && r.text().contains("type=\"password\""));
    assert!(!r.text().contains("wrong-key-zzz") && !r.text().contains(key));
    assert!(r.header("set-cookie").is_none());
    assert_eq!(post("next=%2F".into()).status, 401);
    // The right key: a cookie (a token, not the key) and back to where the browser was going.
    let r = post(format!("key={key}&next=%2Fgroups%3Fper%3D5"));
    assert_eq!(r.status, 303, "{}", r.text());
    assert_eq!(r.header("location").as_deref(), Some("/groups?per=5"));
    let cookie = r.header("set-cookie").unwrap();
    assert!(
        cookie.starts_with("graft_view=")
            && cookie.contains("; HttpOnly")
            && cookie.contains("; SameSite=Strict")
            && cookie.contains("; Path=/"),
        "{cookie}"
    );
    assert!(!cookie.contains(key), "{cookie}");
    let pair = cookie.split(';').next().unwrap().to_owned();
    let r = rt.block_on(http::get(
        &format!("{}/groups", view.url),
        &[("cookie", &pair)],
    ));
    assert_eq!(r.status, 200, "{}", r.text());
    let forged = format!("{}0", pair);
    let r = rt.block_on(http::get(
        &format!("{}/groups", view.url),
        &[("cookie", &forged)],
    ));
    assert_eq!(r.status, 401, "{}", r.text());
    // Never to another site after a login.
    let r = post(format!("key={key}&next=%2F%2Fevil.example%2F"));
    assert_eq!(r.header("location").as_deref(), Some("/"));
    // An oversized form is refused; the viewer stays up.
    if let Ok(r) = rt.block_on(http::send(
        "POST",
        &login,
        &[],
        format!("key={}", "k".repeat(20_000)).into_bytes(),
    )) {
        assert_eq!(r.status, 413, "{}", r.text());
    }
    let r = rt.block_on(http::get(
        &format!("{}/", view.url),
        &[("authorization", &good)],
    ));
    assert_eq!(r.status, 200);
}

/// Writes `n` calls of one session with the recorder's own writer (the gateway's), fast: all
/// queued at once, so one fsync covers many. Call 0 carries a 3,000-character word.
fn write_long_session(data_dir: &std::path::Path, session: &str, n: u64) {
    use graft_recorder::{CallRecord, Recorder, RecorderConfig};
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let (rec, _) = Recorder::open(RecorderConfig::new(data_dir)).await.unwrap();
        let t0 = 1_760_000_000_000_000i64;
        let mk = |i: u64| {
            let at = t0 + i64::try_from(i).unwrap() * 1000;
            let question = if i == 0 {
                format!("a long word: {}", "x".repeat(3000))
            } else {
                format!("question {i}")
            };
            CallRecord {
                schema_version: graft_recorder::SCHEMA_VERSION,
                call_id: format!("long-call-{i:05}"),
                session_id: session.into(),
                started_at_us: at,
                finished_at_us: at + 400,
                dialect: "chat_completions".into(),
                endpoint: "/v1/chat/completions".into(),
                model: Some("scripted".into()),
                request: json!({"model": "scripted", "messages": [{"role": "user", "content": question}]}),
                response: Some(json!({"choices": [{"message": {"role": "assistant", "content": format!("answer {i}")}, "finish_reason": "stop"}]})),
                finish_reason: Some("stop".into()),
                status: 200,
                outcome: "ok".into(),
                latency_ms: 0.4,
                ..CallRecord::default()
            }
        };
        for chunk in (0..n).collect::<Vec<u64>>().chunks(500) {
            let writes = chunk.iter().map(|i| rec.record(mk(*i)));
            for r in futures_util::future::join_all(writes).await {
                r.unwrap();
            }
        }
        rec.shutdown().await.unwrap();
    });
}

/// Issue 32, hole 6, in a browser: a keyed `graft view` is opened by typing the admin key
/// into its login form (a wrong key first: the form again, 401, the key not echoed); the
/// samples of a plain `graft reconstruct` output (no RL run) are listed and open, linked
/// from their sessions and back; a session of 5,000 calls is paged 200 a page and walked
/// through its next/last/previous/first links; no page runs past the window's edge, and a
/// call id reads as recorded.
#[test]
fn keyed_viewer_logs_in_through_the_form_shows_reconstruct_samples_and_pages_a_long_session() {
    let env = TestEnv::get();
    let stack = Stack::start();
    let rt = tokio::runtime::Runtime::new().unwrap();
    let gw = stack.gateway.url.clone();
    for (id, group) in [("s-chat", "g1"), ("s-tools", "g1")] {
        let r = rt.block_on(http::post_json(
            &format!("{gw}/graft/sessions"),
            &[],
            &json!({"session_id": id, "group_id": group}),
        ));
        assert_eq!(r.status, 201, "{}", r.text());
    }
    env.py_client(
        "openai_sdk.py",
        &["chat"],
        &stack.target(Some("s-chat"), None),
    );
    env.py_client(
        "openai_sdk.py",
        &["tool-session"],
        &stack.target(Some("s-tools"), None),
    );
    let records = stack.records();
    let tool_records: Vec<&Value> = records
        .iter()
        .filter(|r| r["session_id"] == "s-tools")
        .collect();
    assert_eq!(tool_records.len(), 2, "{records:?}");
    let tool_call_id = tool_records
        .iter()
        .flat_map(|r| r["request"]["messages"].as_array().unwrap())
        .find_map(|m| m["tool_call_id"].as_str())
        .expect("the tool result names its call")
        .to_owned();
    // The gateway stops; the same data dir then gets a session of 5,000 calls from the
    // recorder's own writer.
    let Stack {
        mut gateway,
        upstream: _upstream,
        data_dir,
        dir,
    } = stack;
    gateway.stop();

    // A plain reconstruct of the two SDK sessions, no RL run anywhere.
    let qwen3 = env.qwen3_dir();
    let samples = dir.path().join("reconstructed.parquet");
    graft(&[
        "reconstruct",
        "--data-dir",
        data_dir.to_str().unwrap(),
        "--tokenizer",
        qwen3.to_str().unwrap(),
        "--out",
        samples.to_str().unwrap(),
    ]);
    let all = graft_reconstruct::sample::read_samples_parquet(&samples).unwrap();
    let sessions: BTreeSet<&str> = all.iter().map(|s| s.session_id.as_str()).collect();
    assert_eq!(sessions, BTreeSet::from(["s-chat", "s-tools"]), "{all:#?}");
    let chat_sample = all.iter().find(|s| s.session_id == "s-chat").unwrap();
    write_long_session(&data_dir, "long", 5000);

    let key = "browser-key-0123456789abcdef";
    let view = Proc::spawn_env(
        "view-login",
        &[
            "view",
            "--data-dir",
            data_dir.to_str().unwrap(),
            "--samples",
            samples.to_str().unwrap(),
            "--model-dir",
            qwen3.to_str().unwrap(),
            "--listen",
            "127.0.0.1:0",
        ],
        &[("GRAFT_ADMIN_KEY", key)],
        "graft view listening on",
        None,
    );
    let q = |id: &str| id.replace('/', "%2F");
    let pages = json!([
        {"name": "login-sessions", "path": "/"},
        {"name": "samples-files", "path": "/samples"},
        {"name": "samples-reconstructed", "path": "/samples?file=reconstructed.parquet"},
        {"name": "session-with-sample", "path": "/session/s-chat"},
        {"name": "session-tools", "path": "/session/s-tools"},
        {"name": "sample-reconstructed", "path": format!("/sample?file=reconstructed.parquet&id={}", q(&chat_sample.sample_id))},
        {"name": "session-long", "path": "/session/long", "full": false,
         "follow": ["#pager-top a.next", "#pager-top a.last", "#pager-top a.prev", "#pager-top a.first"]},
        {"name": "session-long-last", "path": "/session/long?page=25", "full": false},
    ]);
    let shots = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("viewer-screenshots");
    let out = env.browse_with_login(&view.url, Some(key), &pages, &shots);

    // The login: the form, a wrong key refused with the form again, then the pages.
    let l = &out["_login"];
    assert_eq!(l["first_status"], 401, "{l}");
    assert_eq!(
        (&l["form"], &l["password"]),
        (&json!(true), &json!(true)),
        "{l}"
    );
    assert_eq!(l["wrong_status"], 401, "{l}");
    assert_eq!(l["wrong"]["form"], true, "{l}");
    assert!(
        l["wrong"]["error"]
            .as_str()
            .unwrap()
            .contains("not the admin key"),
        "{l}"
    );
    assert!(
        !l["wrong"]["text"]
            .as_str()
            .unwrap()
            .contains("not-the-admin-key")
    );
    assert_eq!(l["after_status"], 200, "{l}");
    assert!(l["after_url"].as_str().unwrap().ends_with('/'), "{l}");
    assert_eq!(l["after_h1"], "sessions", "{l}");
    let cookies = l["cookies"].as_array().unwrap();
    assert_eq!(cookies.len(), 1, "{l}");
    let c = &cookies[0];
    assert_eq!(c["name"], "graft_view");
    assert_eq!(
        (&c["httpOnly"], &c["sameSite"], &c["path"]),
        (&json!(true), &json!("Strict"), &json!("/"))
    );
    assert_ne!(c["value"], key);
    assert!(!c["value"].as_str().unwrap().contains(key));

    let names = |v: &Value| -> BTreeSet<String> {
        v.as_array()
            .unwrap()
            .iter()
            .map(|s| s.as_str().unwrap().to_owned())
            .collect()
    };
    assert_eq!(
        names(&out["login-sessions"]["sessions"]),
        names(&json!(["s-chat", "s-tools", "long"]))
    );
    // The reconstruct output: listed, its samples listed and opened.
    assert!(
        out["samples-files"]["text"]
            .as_str()
            .unwrap()
            .contains("reconstructed.parquet"),
        "{}",
        out["samples-files"]
    );
    assert_eq!(
        names(&out["samples-reconstructed"]["samples"]),
        all.iter().map(|s| s.sample_id.clone()).collect()
    );
    // A session links to its sample; the sample's page marks its trained tokens.
    assert_eq!(
        names(&out["session-with-sample"]["samples"]),
        names(&json!([chat_sample.sample_id]))
    );
    let sp = &out["sample-reconstructed"];
    assert_eq!(sp["tokens"], chat_sample.tokens.len(), "{sp}");
    assert_eq!(
        sp["trained"].as_array().unwrap().len(),
        chat_sample.trained_tokens()
    );
    assert!(
        sp["text"].as_str().unwrap().contains("session s-chat"),
        "{sp}"
    );
    // Call ids read as recorded, the tool result's too (not upper-cased by the role label).
    let st = &out["session-tools"];
    let recorded_ids: Vec<String> = tool_records
        .iter()
        .map(|r| r["call_id"].as_str().unwrap().to_owned())
        .collect();
    assert_eq!(st["callids"], json!(recorded_ids), "{st}");
    assert!(
        st["text"]
            .as_str()
            .unwrap()
            .contains(&format!("result of {tool_call_id}")),
        "{tool_call_id}: {st}"
    );
    // 5,000 calls, 200 a page, walked by the links.
    let long = &out["session-long"];
    assert_eq!(long["calls"], 200, "{}", long["range"]);
    assert_eq!(long["range"], "1–200");
    assert!(
        long["text"].as_str().unwrap().contains("5000 calls"),
        "{}",
        long["range"]
    );
    let walked: Vec<(String, u64)> = long["followed"]
        .as_array()
        .unwrap()
        .iter()
        .map(|f| {
            (
                f["range"].as_str().unwrap().to_owned(),
                f["calls"].as_u64().unwrap(),
            )
        })
        .collect();
    assert_eq!(
        walked,
        [
            ("201–400".to_owned(), 200),
            ("4801–5000".to_owned(), 200),
            ("4601–4800".to_owned(), 200),
            ("1–200".to_owned(), 200),
        ]
    );
    assert_eq!(out["session-long-last"]["range"], "4801–5000");
    // Nothing runs past the window: the 3,000-character word on page 1 wraps.
    for (name, p) in out.as_object().unwrap() {
        if !name.starts_with('_') {
            assert_eq!(p["overflow"], false, "{name} is wider than the window");
        }
    }
    assert!(
        long["followed"]
            .as_array()
            .unwrap()
            .iter()
            .all(|f| f["overflow"] == false)
    );
}

/// Issue 32, the gateway's `/ui` in a browser: no key is the same login form as `graft
/// view` (shared code), the admin key the gateway generated into its data dir logs in and
/// sets an HttpOnly, SameSite=Strict cookie for `/ui` (a token, not the key); over HTTP, a
/// logout ends that login, wrong keys past the limit get 429 with `Retry-After`, a session's
/// key is still 403, and a damaged samples file is a 422 page naming it, not a 500.
#[test]
fn gateway_ui_logs_in_through_the_form_logs_out_limits_attempts_and_names_a_corrupt_file() {
    let env = TestEnv::get();
    let stack = Stack::start();
    let gw = stack.gateway.url.clone();
    let key = common::admin_key(&stack.data_dir).unwrap();
    let session = stack.open_session("s-ui");
    env.py_client(
        "openai_sdk.py",
        &["chat"],
        &stack.target(Some("s-ui"), None),
    );
    std::fs::write(
        stack.data_dir.join("broken.parquet"),
        b"PAR1 not really parquet",
    )
    .unwrap();
    let shots = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("gateway-ui-screenshots");
    let pages =
        json!([{"name": "ui-sessions", "path": "/"}, {"name": "ui-groups", "path": "/groups"}]);
    let out = env.browse_with_login(&format!("{gw}/ui"), Some(&key), &pages, &shots);
    let l = &out["_login"];
    assert_eq!(l["first_status"], 401, "{l}");
    assert_eq!(
        (&l["form"], &l["password"]),
        (&json!(true), &json!(true)),
        "{l}"
    );
    assert_eq!(l["wrong_status"], 401, "{l}");
    assert_eq!(l["after_status"], 200, "{l}");
    assert!(l["after_url"].as_str().unwrap().ends_with("/ui/"), "{l}");
    assert_eq!(l["after_h1"], "sessions", "{l}");
    let cookies = l["cookies"].as_array().unwrap();
    assert_eq!(cookies.len(), 1, "{l}");
    let c = &cookies[0];
    assert_eq!(
        (&c["name"], &c["httpOnly"], &c["sameSite"], &c["path"]),
        (
            &json!("graft_view"),
            &json!(true),
            &json!("Strict"),
            &json!("/ui")
        )
    );
    assert_ne!(c["value"], key.as_str());
    assert!(
        out["ui-sessions"]["sessions"]
            .as_array()
            .unwrap()
            .contains(&json!("s-ui")),
        "{out}"
    );

    // Over HTTP: log in, use the cookie, log out.
    let rt = tokio::runtime::Runtime::new().unwrap();
    let form = |k: &str| format!("key={k}&next=%2Fui%2Fgroups").into_bytes();
    let ct = ("content-type", "application/x-www-form-urlencoded");
    let r = rt
        .block_on(http::send_bare(
            "POST",
            &format!("{gw}/ui/login"),
            &[ct],
            form(&key),
        ))
        .unwrap();
    assert_eq!(r.status, 303, "{}", r.text());
    assert_eq!(r.header("location").as_deref(), Some("/ui/groups"));
    let set = r.header("set-cookie").unwrap();
    assert!(
        !set.contains(&key) && set.contains("HttpOnly") && set.contains("Path=/ui"),
        "{set}"
    );
    let cookie = set.split(';').next().unwrap().to_string();
    let with_cookie = [("cookie", cookie.as_str())];
    let page = rt
        .block_on(http::send_bare(
            "GET",
            &format!("{gw}/ui/groups"),
            &with_cookie,
            vec![],
        ))
        .unwrap();
    assert_eq!(page.status, 200, "{}", page.text());
    assert!(
        page.text().contains("id=\"logout\""),
        "a keyed page offers a log-out"
    );
    // The damaged samples file: 422, named.
    let bad = rt
        .block_on(http::send_bare(
            "GET",
            &format!("{gw}/ui/samples?file=broken.parquet"),
            &with_cookie,
            vec![],
        ))
        .unwrap();
    assert_eq!(bad.status, 422, "{}", bad.text());
    assert!(bad.text().contains("broken.parquet") && bad.text().contains("not a samples file"));
    let out = rt
        .block_on(http::send_bare(
            "POST",
            &format!("{gw}/ui/logout"),
            &with_cookie,
            vec![],
        ))
        .unwrap();
    assert_eq!(out.status, 303);
    assert!(out.header("set-cookie").unwrap().contains("Max-Age=0"));
    let after = rt
        .block_on(http::send_bare(
            "GET",
            &format!("{gw}/ui/groups"),
            &with_cookie,
            vec![],
        ))
        .unwrap();
    assert_eq!(after.status, 401, "the logged-out cookie opens nothing");
    // A session's key is no admin, with or without the login.
    let sk = format!("Bearer {}", session["api_key"].as_str().unwrap());
    let r = rt
        .block_on(http::send_bare(
            "GET",
            &format!("{gw}/ui/groups"),
            &[("authorization", &sk)],
            vec![],
        ))
        .unwrap();
    assert_eq!(r.status, 403, "{}", r.text());
    // Wrong keys: the form again, then 429 with Retry-After (the right key too, then).
    let mut limited = None;
    for _ in 0..20 {
        let r = rt
            .block_on(http::send_bare(
                "POST",
                &format!("{gw}/ui/login"),
                &[ct],
                form("wrong"),
            ))
            .unwrap();
        if r.status == 429 {
            limited = Some(r);
            break;
        }
        assert_eq!(r.status, 401, "{}", r.text());
    }
    let r = limited.expect("no 429 after 20 wrong keys");
    assert!(r.header("retry-after").is_some());
    assert!(r.text().contains("too many login attempts"), "{}", r.text());
    let r = rt
        .block_on(http::send_bare(
            "POST",
            &format!("{gw}/ui/login"),
            &[ct],
            form(&key),
        ))
        .unwrap();
    assert_eq!(r.status, 429, "{}", r.text());
}

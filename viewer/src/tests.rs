#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use super::*;
use graft_recorder::{Recorder, RecorderConfig, SessionEvent, SessionLog};

/// A data dir written by the real recorder: group g1 (s-a rewarded 1.0, s-b 0.0), group g2
/// (s-c, one failed call, no reward); s-a has two turns with a tool call and its result.
fn data_dir() -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let (rec, _) = Recorder::open(RecorderConfig::new(dir.path())).await.unwrap();
        let user = json!({"role": "user", "content": "list files <b>now</b>"});
        let call = json!({"role": "assistant", "content": null,
            "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "bash", "arguments": "{\"cmd\":\"ls\"}"}}]});
        let result = json!({"role": "tool", "tool_call_id": "c1", "content": "a.txt"});
        let mk = |session: &str, group: &str, turn: i64, messages: Vec<Value>, response: Value, outcome: &str| CallRecord {
            schema_version: graft_recorder::SCHEMA_VERSION,
            call_id: format!("{session}-{turn}"),
            session_id: session.into(),
            group_id: Some(group.into()),
            started_at_us: 1_750_000_000_000_000 + turn * 1000,
            finished_at_us: 1_750_000_000_000_000 + turn * 1000 + 500,
            dialect: "chat_completions".into(),
            endpoint: "/v1/chat/completions".into(),
            request: json!({"model": "m", "messages": messages}),
            response: Some(response),
            status: if outcome == "ok" { 200 } else { 502 },
            outcome: outcome.into(),
            latency_ms: 12.5,
            weight_version: Some("v7".into()),
            client: Some("openai-python/1.0".into()),
            ..CallRecord::default()
        };
        let mut first = mk("s-a", "g1", 1, vec![user.clone()],
            json!({"choices": [{"message": call.clone()}]}), "ok");
        first.finish_reason = Some("tool_calls".into());
        rec.record(first).await.unwrap();
        rec.record(mk("s-a", "g1", 2, vec![user.clone(), call.clone(), result.clone()],
            json!({"choices": [{"message": {"role": "assistant", "content": "there is a.txt"}}]}), "ok")).await.unwrap();
        let mut b = mk("s-b", "g1", 3, vec![user.clone()],
            json!({"choices": [{"message": {"role": "assistant", "content": "no"}}]}), "ok");
        b.weight_version = Some("v8".into());
        rec.record(b).await.unwrap();
        rec.record(mk("s-c", "g2", 4, vec![user.clone()], Value::Null, "upstream_error")).await.unwrap();
        rec.shutdown().await.unwrap();
        let (log, _) = SessionLog::open(dir.path()).unwrap();
        log.append(&SessionEvent::Created { session_id: "s-a".into(), group_id: Some("g1".into()), key_sha256: None,
            metadata: json!({"harness": "mini-swe-agent"}), sampling: None, backend: None, at_us: 1_750_000_000_000_000 })
            .await
            .unwrap();
        log.append(&SessionEvent::CallReward { session_id: "s-a".into(), call_id: Some("s-a-1".into()), seq: None,
            reward: 0.25, info: Value::Null, at_us: 1_750_000_000_050_000 })
            .await
            .unwrap();
        for (s, r) in [("s-a", 1.0), ("s-b", 0.0)] {
            log.append(&SessionEvent::Reward { session_id: s.into(), reward: r, info: Value::Null, at_us: 1_750_000_000_100_000 })
                .await
                .unwrap();
        }
    });
    dir
}

fn rows(body: &str, class: &str) -> usize {
    body.matches(&format!("<tr class=\"{class}\"")).count()
}

#[test]
fn sessions_page_filters_and_pages() {
    let d = data_dir();
    let v = Viewer::new(d.path(), None, None, "/ui").unwrap();
    let p = v.page("/", "");
    assert_eq!(p.status, 200, "{}", p.body);
    assert_eq!(rows(&p.body, "session"), 3, "{}", p.body);
    // minijinja escapes '/' in values as &#x2f; (the browser reads it back as '/').
    assert!(
        p.body.contains("href=\"&#x2f;ui/session/s-a\""),
        "{}",
        p.body
    );
    let only = |q: &str| {
        let p = v.page("/sessions", q);
        assert_eq!(p.status, 200, "{q}: {}", p.body);
        rows(&p.body, "session")
    };
    assert_eq!(only("group=g1"), 2);
    assert_eq!(only("group=g2&outcome=errors"), 1);
    assert_eq!(only("outcome=ok"), 2);
    assert_eq!(only("reward_min=0.5"), 1);
    assert_eq!(only("reward_max=0.5"), 1);
    // Harness: the name graft rl gave the session, else a part of its client's User-Agent.
    assert_eq!(only("harness=mini-swe-agent"), 1);
    assert_eq!(only("harness=OpenAI-Python"), 2);
    assert_eq!(only("harness=codex"), 0);
    assert_eq!(only("weight=v8"), 1);
    assert_eq!(only("weight=v7"), 2);
    assert_eq!(only("weight=v7&group=g1"), 1);
    let p = v.page("/sessions", "harness=mini-swe-agent");
    assert!(
        p.body.contains("<td class=\"harness\">mini-swe-agent</td>"),
        "{}",
        p.body
    );
    // Paging: 2 per page, the second page holds the rest and links back.
    let p = v.page("/sessions", "per=2&page=2");
    assert_eq!(rows(&p.body, "session"), 1);
    assert!(p.body.contains("id=\"prev\"") && !p.body.contains("id=\"next\""));
    // Bad input is a 400 page that names the value.
    let p = v.page("/sessions", "reward_min=lots");
    assert_eq!(p.status, 400);
    assert!(p.body.contains("reward_min") && p.body.contains("lots"));
    assert_eq!(v.page("/nope", "").status, 404);
}

#[test]
fn session_page_shows_the_conversation_escaped() {
    let d = data_dir();
    let v = Viewer::new(d.path(), None, None, "").unwrap();
    let p = v.page("/session/s-a", "");
    assert_eq!(p.status, 200, "{}", p.body);
    assert!(p.body.contains("call-1") && p.body.contains("call-2"));
    // The user's text is escaped, never markup.
    assert!(
        p.body.contains("list files &lt;b&gt;now&lt;&#x2f;b&gt;"),
        "{}",
        p.body
    );
    assert!(!p.body.contains("<b>now</b>"));
    // Turn 2 shows only what it added: the tool result and the answer.
    assert_eq!(p.body.matches("list files").count(), 1, "{}", p.body);
    assert!(p.body.contains("→ bash("));
    // A call id reads as recorded: never inside the upper-cased role label.
    assert!(
        p.body.contains("<span class=\"role\">tool</span> <span class=\"callref\">result of <code>c1</code></span>"),
        "{}",
        p.body
    );
    assert!(p.body.contains("there is a.txt"));
    assert!(p.body.contains("weights v7") && p.body.contains("openai-python&#x2f;1.0"));
    let p = v.page("/session/s-c", "");
    assert!(p.body.contains("502"));
    assert_eq!(v.page("/session/zzz", "").status, 404);
}

#[test]
fn groups_and_group_pages() {
    let d = data_dir();
    let v = Viewer::new(d.path(), None, None, "").unwrap();
    let p = v.page("/groups", "");
    assert_eq!(rows(&p.body, "group"), 2, "{}", p.body);
    // Paged like the sessions page.
    let p = v.page("/groups", "per=1&page=2");
    assert_eq!(rows(&p.body, "group"), 1, "{}", p.body);
    assert!(p.body.contains("href=\"/group/g2\""), "{}", p.body);
    assert!(p.body.contains("id=\"prev\"") && !p.body.contains("id=\"next\""));
    assert_eq!(v.page("/groups", "page=two").status, 400);
    let p = v.page("/group/g1", "");
    assert_eq!(rows(&p.body, "member"), 2, "{}", p.body);
    assert_eq!(v.page("/run", "").status, 404);
}

#[test]
fn run_page_draws_one_point_per_step_and_sample_page_marks_trained_tokens() {
    let d = data_dir();
    let run = tempfile::tempdir().unwrap();
    std::fs::create_dir_all(run.path().join("samples")).unwrap();
    let sample = Sample {
        sample_id: "s-a/0".into(),
        session_id: "s-a".into(),
        group_id: Some("g1".into()),
        tokens: vec![10, 11, 12, 13, 14],
        loss_mask: vec![0, 0, 1, 1, 0],
        logprobs: vec![None, None, Some(-0.1), None, None],
        reward: Some(1.0),
        weight_versions: vec!["v7".into()],
        token_weight_versions: vec![None, None, Some(0), Some(0), None],
        call_ids: vec!["s-a-1".into()],
        token_calls: vec![None, None, Some(0), Some(0), None],
        call_rewards: vec![Some(0.5)],
        fork_reason: None,
        events: Vec::new(),
        tokenizer_fingerprint: "t".into(),
        template_fingerprint: "t".into(),
        schema_version: graft_reconstruct::sample::SAMPLE_SCHEMA_VERSION,
        logprob_kind: Default::default(),
        ..Sample::default()
    };
    let samples = run.path().join("samples/step-00000.parquet");
    graft_reconstruct::sample::write_samples_parquet(&[sample], &samples).unwrap();
    let mut lines = String::new();
    for step in 0..3 {
        lines.push_str(
            &json!({"step": step, "rollouts": 2, "scored": 2, "reward_mean": 0.5 + 0.1 * step as f64,
                "trained_tokens": 2 + step, "weight_version": format!("v{step}"),
                "call_weight_versions": {format!("v{step}"): 3},
                "samples_file": samples, "groups": [{"group": "g1", "rollouts": 2, "decision": {"keep": "all"}, "selected": 2}],
                "secs": {"step": 3.0, "rollout": 1.0, "reconstruct": 0.5, "train": 1.0, "push": 0.5},
                "rollout_list": [{"reward": 0.0}, {"reward": 1.0}]})
            .to_string(),
        );
        lines.push('\n');
    }
    std::fs::write(run.path().join("steps.jsonl"), lines).unwrap();
    let v = Viewer::new(d.path(), Some(run.path()), None, "").unwrap();
    let p = v.page("/run", "");
    assert_eq!(p.status, 200, "{}", p.body);
    // Two line charts (reward, trained tokens), one point per step each.
    assert_eq!(
        p.body
            .matches("<circle class=\"point\" data-series=\"reward mean\"")
            .count(),
        3
    );
    assert_eq!(
        p.body
            .matches("<circle class=\"point\" data-series=\"trained tokens\"")
            .count(),
        3
    );
    assert_eq!(rows(&p.body, "step"), 3);
    let report = v.run_report().unwrap();
    // Self-contained: no script, nothing loaded from elsewhere.
    assert!(
        !report.contains("<script") && !report.contains("src=") && !report.contains("href=\"http")
    );
    assert_eq!(report.matches("<circle class=\"point\"").count(), 6);
    let p = v.page("/group/g1", "");
    assert!(
        p.body.contains("id=\"decision\"") && p.body.contains("keep"),
        "{}",
        p.body
    );
    assert_eq!(rows(&p.body, "sample"), 1);
    let p = v.page("/sample", "file=step-00000.parquet&id=s-a%2F0");
    assert_eq!(p.status, 200, "{}", p.body);
    assert_eq!(
        p.body.matches("class=\"tok trained\"").count(),
        2,
        "{}",
        p.body
    );
    assert_eq!(p.body.matches("class=\"tok\"").count(), 3);
    assert!(p.body.contains("hsl(109,70%,82%)"), "{}", p.body);
    // The call's process reward, in the summary and on the tokens it sampled.
    assert!(
        p.body.contains("call rewards: 0.5 (call s-a-1)"),
        "{}",
        p.body
    );
    assert_eq!(p.body.matches(" call reward 0.5\"").count(), 2);
    // No path tricks.
    assert_eq!(v.page("/sample", "file=..%2Fsteps.jsonl&id=x").status, 400);
    // Issue 32, hole 6: a missing samples file is a 404 and a NUL in its name a 400,
    // not a 500.
    assert_eq!(
        v.page("/sample", "file=step-09999.parquet&id=x").status,
        404
    );
    assert_eq!(v.page("/sample", "file=a%00b.parquet&id=x").status, 400);
    // A run dir with no steps.jsonl yet: the run page says so with a 404.
    let empty = tempfile::tempdir().unwrap();
    let v = Viewer::new(d.path(), Some(empty.path()), None, "").unwrap();
    let p = v.page("/run", "");
    assert_eq!(p.status, 404, "{}", p.body);
    assert!(p.body.contains("no steps.jsonl"), "{}", p.body);
}

#[test]
fn the_run_page_counts_calls_on_older_weights_only_where_a_step_names_its_weights() {
    let d = data_dir();
    let run = tempfile::tempdir().unwrap();
    let steps = [
        // Nothing pushed yet: the step names no weights, so there is no staleness to show.
        json!({"step": 0, "rollouts": 2, "call_weight_versions": {"default": 8}}),
        // 3 of the step's 8 calls were answered by the weights before v2.
        json!({"step": 1, "rollouts": 2, "weight_version": "v2", "call_weight_versions": {"v1": 3, "v2": 5}}),
    ];
    let text: String = steps.iter().map(|s| format!("{s}\n")).collect();
    std::fs::write(run.path().join("steps.jsonl"), text).unwrap();
    let v = Viewer::new(d.path(), Some(run.path()), None, "/ui").unwrap();
    let page = v.page("/run", "");
    assert_eq!(page.status, 200, "{}", page.body);
    let cells: Vec<&str> = page
        .body
        .split("<tr class=\"step\">")
        .skip(1)
        .map(|row| row.split("<td>").nth(8).unwrap_or_default())
        .collect();
    assert_eq!(cells.len(), 2, "{}", page.body);
    assert!(cells[0].starts_with("</td>"), "step 0: {}", cells[0]);
    assert!(cells[1].starts_with("3</td>"), "step 1: {}", cells[1]);
}

/// The labels of a chart's y (or x) ticks.
fn tick_labels(svg: &str, axis: &str) -> Vec<String> {
    svg.split(&format!("class=\"tick {axis}\""))
        .skip(1)
        .map(|t| t[t.find('>').unwrap() + 1..t.find("</text>").unwrap()].to_owned())
        .collect()
}

/// Issue 32, hole 6: chart axes read "-0.500" and "66.778". Ticks are 1, 2 or 5 × 10^k
/// apart, with the decimals their step needs, and a step axis counts in whole steps.
#[test]
fn chart_ticks_are_nice_numbers_and_steps_are_whole() {
    for (lo, hi) in [
        (0.0, 1.0),
        (-0.3, 0.9),
        (0.0, 66.778),
        (0.0, 0.0),
        (3.0, 3.0),
        (-12.5, -12.5),
        (0.001, 0.0042),
        (0.0, 123_456.0),
    ] {
        let (ticks, step) = svg::nice_ticks(lo, hi, 5, false);
        let mantissa = step / 10f64.powf(step.log10().floor());
        assert!(
            [1.0, 2.0, 5.0].iter().any(|m| (mantissa - m).abs() < 1e-9),
            "{lo}..{hi}: step {step}"
        );
        assert!(
            ticks.len() >= 2 && ticks.len() <= 7,
            "{lo}..{hi}: {ticks:?}"
        );
        assert!(
            ticks[0] <= lo && *ticks.last().unwrap() >= hi,
            "{lo}..{hi}: {ticks:?}"
        );
        for t in &ticks {
            let label = svg::tick_label(*t, step);
            assert!(
                !label.starts_with("-0") || label.starts_with("-0."),
                "{label}"
            );
            assert_ne!(label, "-0", "{lo}..{hi}");
            // Never more decimals than the step has.
            let decimals = label.split('.').nth(1).map_or(0, str::len);
            assert!(decimals <= 3, "{lo}..{hi}: {label}");
            let back: f64 = label
                .trim_end_matches('k')
                .parse()
                .unwrap_or_else(|_| panic!("{label}"));
            let scale = if label.ends_with('k') { 1e3 } else { 1.0 };
            assert!((back * scale - t).abs() < step / 100.0, "{label} for {t}");
        }
    }
    assert_eq!(svg::nice_ticks(0.0, 1.0, 5, false).0, vec![0.0, 0.5, 1.0]);
    let (t, step) = svg::nice_ticks(0.0, 66.778, 5, false);
    assert_eq!((t.clone(), step), (vec![0.0, 20.0, 40.0, 60.0, 80.0], 20.0));
    let labels: Vec<String> = t.iter().map(|v| svg::tick_label(*v, step)).collect();
    assert_eq!(labels, ["0", "20", "40", "60", "80"]);
    let (t, step) = svg::nice_ticks(-0.3, 0.9, 5, false);
    let labels: Vec<String> = t.iter().map(|v| svg::tick_label(*v, step)).collect();
    assert_eq!(labels, ["-0.5", "0.0", "0.5", "1.0"]);
    // Every value zero: 0..1, not -0.5..0.5.
    assert_eq!(svg::nice_ticks(0.0, 0.0, 5, false).0[0], 0.0);
    assert_eq!(svg::tick_label(20_000.0, 5000.0), "20k");
    // A step axis of 3 steps counts 0, 1, 2: never 0.5.
    assert_eq!(
        svg::nice_ticks(0.0, 2.0, 8, true),
        (vec![0.0, 1.0, 2.0], 1.0)
    );
    assert_eq!(svg::nice_ticks(0.0, 999.0, 8, true).1, 200.0);

    // In a drawn chart: x ticks are whole steps inside the steps drawn, y ticks nice.
    let chart = svg::line_chart(
        "r",
        "step",
        &[svg::Series {
            name: "mean",
            points: (0..9)
                .map(|i| (f64::from(i), Some(66.778 * f64::from(i) / 8.0)))
                .collect(),
            band: None,
        }],
    );
    assert_eq!(tick_labels(&chart, "xtick"), ["0", "2", "4", "6", "8"]);
    assert_eq!(tick_labels(&chart, "ytick"), ["0", "20", "40", "60", "80"]);
    let bars = svg::stacked_bars("t", "step", &[0.0, 1.0, 2.0], &[("a", vec![0.3, 1.7, 2.2])]);
    assert_eq!(tick_labels(&bars, "xtick"), ["0", "1", "2"]);
    assert_eq!(tick_labels(&bars, "ytick"), ["0", "1", "2", "3"]);
}

/// A data dir with one session of `n` calls (the real recorder).
fn long_session(n: u64) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let (rec, _) = Recorder::open(RecorderConfig::new(dir.path())).await.unwrap();
        for i in 0..n {
            let i64_i = i64::try_from(i).unwrap();
            rec.record(CallRecord {
                schema_version: graft_recorder::SCHEMA_VERSION,
                call_id: format!("call-{i:05}"),
                session_id: "long".into(),
                started_at_us: 1_750_000_000_000_000 + i64_i * 1000,
                finished_at_us: 1_750_000_000_000_000 + i64_i * 1000 + 500,
                dialect: "chat_completions".into(),
                endpoint: "/v1/chat/completions".into(),
                request: json!({"model": "m", "messages": [{"role": "user", "content": format!("question {i}")}]}),
                response: Some(json!({"choices": [{"message": {"role": "assistant", "content": format!("answer {i}")}}]})),
                status: 200,
                outcome: "ok".into(),
                ..CallRecord::default()
            })
            .await
            .unwrap();
        }
        rec.shutdown().await.unwrap();
    });
    dir
}

/// Issue 32, hole 6: a session of thousands of calls was one multi-MB page. It is paged,
/// 200 calls a page, with first/previous/next/last links and the call count.
#[test]
fn a_long_session_is_paged() {
    let d = long_session(450);
    let v = Viewer::new(d.path(), None, None, "").unwrap();
    let calls = |body: &str| body.matches("<div class=\"call\"").count();
    let p = v.page("/session/long", "");
    assert_eq!(p.status, 200, "{}", p.body);
    assert_eq!(calls(&p.body), CALLS_PER_PAGE);
    assert!(
        p.body
            .contains("calls <span class=\"range\">1–200</span> of 450 · page 1 of 3"),
        "{}",
        p.body
    );
    assert!(
        p.body.contains("call-00000")
            && p.body.contains("call-00199")
            && !p.body.contains("call-00200")
    );
    assert!(
        p.body
            .contains("class=\"next\" href=\"/session/long?page=2\""),
        "{}",
        p.body
    );
    assert!(
        p.body
            .contains("class=\"last\" href=\"/session/long?page=3\"")
    );
    assert!(!p.body.contains("class=\"prev\"") && !p.body.contains("class=\"first\""));
    let p = v.page("/session/long", "page=3");
    assert_eq!(calls(&p.body), 50, "{}", p.body);
    assert!(
        p.body
            .contains("<span class=\"range\">401–450</span> of 450 · page 3 of 3"),
        "{}",
        p.body
    );
    assert!(p.body.contains("call-00449") && !p.body.contains("call-00399"));
    assert!(p.body.contains("class=\"prev\"") && p.body.contains("class=\"first\""));
    assert!(!p.body.contains("class=\"next\"") && !p.body.contains("class=\"last\""));
    // The first call of a page shows its own question (nothing taken as already seen).
    let p = v.page("/session/long", "page=2");
    assert!(p.body.contains("question 200") && p.body.contains("answer 200"));
    let p = v.page("/session/long", "per=100&page=5");
    assert_eq!(calls(&p.body), 50);
    assert!(
        p.body.contains("?per=100&amp;page=4") || p.body.contains("?per=100&page=4"),
        "{}",
        p.body
    );
    for (query, status) in [
        ("page=4", 404),
        ("page=0", 400),
        ("page=two", 400),
        ("per=-1", 400),
    ] {
        let p = v.page("/session/long", query);
        assert_eq!(p.status, status, "{query}: {}", p.body);
        assert!(p.body.contains("id=\"error\""));
    }
    // The sessions page stays small too: one row.
    assert_eq!(rows(&v.page("/", "").body, "session"), 1);
}

/// A samples file as `graft reconstruct` writes it: one sample of s-a (trained tokens), one
/// of s-b.
fn write_samples(path: &Path) {
    let mk = |id: &str, session: &str, reward: f64| Sample {
        sample_id: id.into(),
        session_id: session.into(),
        group_id: Some("g1".into()),
        tokens: vec![10, 11, 12, 13],
        loss_mask: vec![0, 0, 1, 1],
        logprobs: vec![None, None, Some(-0.1), Some(-0.2)],
        reward: Some(reward),
        weight_versions: vec![],
        token_weight_versions: vec![None; 4],
        call_ids: vec![format!("{session}-1")],
        token_calls: vec![None, None, Some(0), Some(0)],
        call_rewards: vec![None],
        fork_reason: None,
        events: Vec::new(),
        tokenizer_fingerprint: "t".into(),
        template_fingerprint: "t".into(),
        schema_version: graft_reconstruct::sample::SAMPLE_SCHEMA_VERSION,
        logprob_kind: Default::default(),
        ..Sample::default()
    };
    graft_reconstruct::sample::write_samples_parquet(
        &[mk("s-a/0", "s-a", 1.0), mk("s-b/0", "s-b", 0.0)],
        path,
    )
    .unwrap();
}

/// Issue 32, hole 6: a user who ran `graft reconstruct` and no RL run could not see its
/// samples. A samples file given with --samples, or one written into the data dir, is
/// listed, its samples open, a session links to its samples and a sample back.
#[test]
fn reconstruct_output_is_shown_without_a_run_and_sessions_link_to_samples() {
    let d = data_dir();
    let v = Viewer::new(d.path(), None, None, "").unwrap();
    // No samples yet: the list says how to make them, the session says it has none.
    let p = v.page("/samples", "");
    assert_eq!(p.status, 200, "{}", p.body);
    assert!(p.body.contains("id=\"no-files\""), "{}", p.body);
    assert!(
        v.page("/session/s-a", "")
            .body
            .contains("id=\"no-samples\"")
    );
    assert_eq!(v.page("/samples", "file=samples.parquet").status, 404);

    // Written into the data dir (next to records/, which the viewer never lists).
    write_samples(&d.path().join("samples.parquet"));
    let p = v.page("/samples", "");
    assert_eq!(rows(&p.body, "file"), 1, "{}", p.body);
    assert!(
        p.body.contains("href=\"/samples?file=samples.parquet\""),
        "{}",
        p.body
    );
    let p = v.page("/samples", "file=samples.parquet");
    assert_eq!(p.status, 200, "{}", p.body);
    assert_eq!(rows(&p.body, "sample"), 2, "{}", p.body);
    // Session → its sample, sample → its session.
    let p = v.page("/session/s-a", "");
    assert_eq!(rows(&p.body, "sample"), 1, "{}", p.body);
    assert!(
        p.body
            .contains("href=\"/sample?file=samples.parquet&amp;id=s-a%2F0\""),
        "{}",
        p.body
    );
    let p = v.page("/sample", "file=samples.parquet&id=s-a%2F0");
    assert_eq!(p.status, 200, "{}", p.body);
    assert!(
        p.body.contains("id=\"session-link\" href=\"/session/s-a\""),
        "{}",
        p.body
    );
    assert_eq!(p.body.matches("class=\"tok trained\"").count(), 2);
    // The group page lists them too, without a run.
    assert_eq!(rows(&v.page("/group/g1", "").body, "sample"), 2);

    // Given by path (anywhere), by its file name in the pages.
    let elsewhere = tempfile::tempdir().unwrap();
    let file = elsewhere.path().join("mine.parquet");
    write_samples(&file);
    let v = Viewer::new(d.path(), None, None, "")
        .unwrap()
        .with_samples(std::slice::from_ref(&file))
        .unwrap();
    let p = v.page("/samples", "");
    assert_eq!(rows(&p.body, "file"), 2, "{}", p.body);
    assert_eq!(
        v.page("/sample", "file=mine.parquet&id=s-b%2F0").status,
        200
    );
    // A file given that is not there, or two of one name, stop the start with the reason.
    let err = Viewer::new(d.path(), None, None, "")
        .unwrap()
        .with_samples(&[elsewhere.path().join("nope.parquet")])
        .err()
        .unwrap();
    assert!(err.to_string().contains("nope.parquet"), "{err}");
    assert!(
        Viewer::new(d.path(), None, None, "")
            .unwrap()
            .with_samples(&[file.clone(), file.clone()])
            .is_err()
    );
}

/// Issue 32, hole 6: a missing or badly named file is a 404 or a 400 on every page that
/// names one, never a 500, and the page says what was wrong.
#[test]
fn missing_or_bad_names_are_404_or_400_everywhere() {
    let d = data_dir();
    write_samples(&d.path().join("samples.parquet"));
    let v = Viewer::new(d.path(), None, None, "").unwrap();
    for (path, query, status) in [
        ("/samples", "file=nope.parquet", 404),
        ("/samples", "file=..%2Fsessions.log", 400),
        ("/samples", "file=a%00b.parquet", 400),
        ("/samples", "file=samples.parquet&page=x", 400),
        ("/sample", "file=nope.parquet&id=x", 404),
        ("/sample", "file=samples.parquet&id=nope", 404),
        ("/sample", "file=samples.parquet", 400),
        ("/sample", "id=s-a%2F0", 400),
        ("/sample", "file=%2Fetc%2Fpasswd&id=x", 400),
        ("/sample", "file=a%0Ab.parquet&id=x", 400),
        ("/session/a%00b", "", 400),
        ("/session/nope", "", 404),
        ("/group/a%01b", "", 400),
        ("/group/nope", "", 404),
        ("/run", "", 404),
        ("/groups", "per=lots", 400),
        ("/nowhere", "", 404),
    ] {
        let p = v.page(path, query);
        assert_eq!(p.status, status, "{path}?{query}: {}", p.body);
        assert!(
            p.body.contains("id=\"error\""),
            "{path}?{query}: {}",
            p.body
        );
    }
    // A samples file deleted after the start is a 404 too.
    std::fs::remove_file(d.path().join("samples.parquet")).unwrap();
    assert_eq!(
        v.page("/sample", "file=samples.parquet&id=s-a%2F0").status,
        404
    );
}

/// Issue 32, hole 6: once a key was set no browser could get in. The login form posts the
/// key; the cookie it sets is a random token of that login (never the key), HttpOnly,
/// SameSite=Strict, scoped to the pages' base; only a live login's token opens the pages,
/// and a logout ends that login alone.
#[test]
fn login_cookie_is_a_token_not_the_key() {
    let key = "admin-key-0123456789";
    let l = login::Login::new(key, "");
    assert!(l.key_matches(key));
    assert!(!l.key_matches("admin-key-012345678"));
    assert!(!l.key_matches(""));
    let set = l.start();
    assert!(!set.contains(key), "{set}");
    assert!(
        set.contains("; HttpOnly") && set.contains("; SameSite=Strict") && set.contains("; Path=/")
    );
    let pair = set.split(';').next().unwrap();
    let (name, token) = pair.split_once('=').unwrap();
    assert_eq!(name, login::COOKIE);
    assert_eq!(token.len(), 64);
    assert!(l.cookie_matches(&[pair]));
    assert!(l.cookie_matches(&["theme=dark", &format!("a=1; {pair}; other=1")]));
    assert!(!l.cookie_matches(&[&format!("{}=x{token}", login::COOKIE)]));
    assert!(!l.cookie_matches(&[&format!("{}={key}", login::COOKIE)]));
    assert!(!l.cookie_matches(&[&format!("other={token}")]));
    assert!(!l.cookie_matches(&[""]));
    // A second browser gets its own token; logging one out leaves the other in.
    let other = l.start();
    let other_pair = other.split(';').next().unwrap();
    assert_ne!(other_pair, pair);
    let gone = l.end(&[pair]);
    assert!(gone.contains("Max-Age=0") && gone.starts_with(&format!("{}=;", login::COOKIE)));
    assert!(!l.cookie_matches(&[pair]));
    assert!(l.cookie_matches(&[other_pair]));
    // Another login (a restarted viewer) knows none of them; under /ui the cookie is /ui's.
    let again = login::Login::new(key, "/ui");
    assert!(!again.cookie_matches(&[other_pair]));
    assert!(again.start().ends_with("; Path=/ui"));
    // The form: the key and where to go next, never another site.
    let f = login::Login::form(b"key=a+b%26c&next=%2Fsession%2Fs-a%3Fpage%3D2");
    assert_eq!(f.key.as_deref(), Some("a b&c"));
    assert_eq!(f.next, "/session/s-a?page=2");
    for evil in [
        "%2F%2Fevil.example",
        "https%3A%2F%2Fevil.example",
        "%2F%5Cevil",
        "%2Fa%0Db",
        "",
    ] {
        let f = login::Login::form(format!("key=k&next={evil}").as_bytes());
        assert_eq!(f.next, "/", "{evil}");
    }
    assert_eq!(login::Login::form(b"next=%2F").key, None);
    // The page: a password field posting to /login, the reason, no key.
    let d = data_dir();
    let v = Viewer::new(d.path(), None, None, "").unwrap();
    let p = v.login_page("that is not the admin key", "/groups");
    assert_eq!(p.status, 401);
    assert!(
        p.body
            .contains("<form id=\"login\" method=\"post\" action=\"/login\">"),
        "{}",
        p.body
    );
    assert!(p.body.contains("type=\"password\" name=\"key\""));
    assert!(
        p.body.contains("name=\"next\" value=\"&#x2f;groups\""),
        "{}",
        p.body
    );
    assert!(p.body.contains("that is not the admin key"));
    assert!(!p.body.contains(key));
}

/// The login's steps, as a server takes them: no key or cookie is the login page (401,
/// `WWW-Authenticate`); the form with the right key is a redirect that sets a cookie; the
/// cookie or the Bearer key opens pages; a logout deletes it; past the attempts' limit a
/// client gets a 429 page with `Retry-After`, and another client does not.
#[test]
fn login_steps_form_cookie_logout_and_the_attempts_limit() {
    let d = data_dir();
    let v = Viewer::new(d.path(), None, None, "/ui")
        .unwrap()
        .keyed(true);
    let key = "k-0123456789abcdef";
    let l = login::Login::new(key, "/ui");
    let req = |method, path, cookies: &'static [&'static str], bearer| login::Request {
        method,
        path,
        path_and_query: path,
        cookies,
        bearer,
    };
    let header = |a: &login::Answer, name: &str| {
        a.headers
            .iter()
            .find(|(n, _)| *n == name)
            .map(|(_, v)| v.clone())
    };
    let login::Step::Answer(a) = l.step(&v, req("GET", "/ui/groups", &[], None)) else {
        panic!("no key: the login page")
    };
    assert_eq!(a.page.status, 401);
    assert_eq!(header(&a, "www-authenticate").as_deref(), Some("Bearer"));
    assert!(
        a.page.body.contains("action=\"&#x2f;ui/login\""),
        "{}",
        a.page.body
    );
    assert!(matches!(
        l.step(&v, req("GET", "/ui/groups", &[], Some(key))),
        login::Step::Page
    ));
    assert!(matches!(
        l.step(&v, req("POST", "/ui/login", &[], None)),
        login::Step::ReadForm
    ));
    let peer = Some(std::net::IpAddr::from([10, 0, 0, 1]));
    let a = l.post_form(
        &v,
        format!("key={key}&next=%2Fui%2Fgroups").as_bytes(),
        peer,
    );
    assert_eq!(a.page.status, 303);
    assert_eq!(header(&a, "location").as_deref(), Some("/ui/groups"));
    let set = header(&a, "set-cookie").unwrap();
    let pair: &'static str = Box::leak(set.split(';').next().unwrap().to_owned().into_boxed_str());
    let cookies: &'static [&'static str] = Box::leak(Box::new([pair]));
    assert!(matches!(
        l.step(&v, req("GET", "/ui/groups", cookies, None)),
        login::Step::Page
    ));
    // The pages of a keyed viewer offer a log-out.
    assert!(
        v.page("/groups", "")
            .body
            .contains("action=\"&#x2f;ui/logout\"")
    );
    let login::Step::Answer(out) = l.step(&v, req("POST", "/ui/logout", cookies, None)) else {
        panic!("logout answers")
    };
    assert_eq!(out.page.status, 303);
    assert!(header(&out, "set-cookie").unwrap().contains("Max-Age=0"));
    assert!(matches!(
        l.step(&v, req("GET", "/ui/groups", cookies, None)),
        login::Step::Answer(_)
    ));
    // Wrong keys from one address: the form again, then 429 (even for the right key).
    let mut limited = None;
    for _ in 0..(login::LOGIN_BURST * 4) {
        let a = l.post_form(&v, b"key=wrong", peer);
        assert!(!a.page.body.contains(key));
        if a.page.status == 429 {
            limited = Some(a);
            break;
        }
        assert_eq!(a.page.status, 401);
    }
    let a = limited.expect("the attempts' limit never answered 429");
    assert!(
        a.page.body.contains("too many login attempts"),
        "{}",
        a.page.body
    );
    assert!(header(&a, "retry-after").is_some());
    assert_eq!(
        l.post_form(&v, format!("key={key}").as_bytes(), peer)
            .page
            .status,
        429
    );
    let elsewhere = Some(std::net::IpAddr::from([10, 0, 0, 2]));
    assert_eq!(
        l.post_form(&v, format!("key={key}").as_bytes(), elsewhere)
            .page
            .status,
        303
    );
}

/// Issue 32, hole 6: a samples file that is there but is no samples file (damaged, or
/// another program's Parquet) is a 422 page naming the file and the fault, never a 500.
#[test]
fn a_corrupt_samples_file_is_a_422_page_naming_it() {
    let d = data_dir();
    std::fs::write(d.path().join("broken.parquet"), b"PAR1 this is not parquet").unwrap();
    let v = Viewer::new(d.path(), None, None, "").unwrap();
    for (path, query) in [
        ("/samples", "file=broken.parquet"),
        ("/sample", "file=broken.parquet&id=s-a%2F0"),
    ] {
        let p = v.page(path, query);
        assert_eq!(p.status, 422, "{path}?{query}: {}", p.body);
        assert!(
            p.body.contains("broken.parquet")
                && p.body.contains("is not a samples file graft can read"),
            "{}",
            p.body
        );
    }
    // The list still shows it, and a session's page names it as unreadable.
    assert_eq!(v.page("/samples", "").status, 200);
    assert_eq!(v.page("/session/s-a", "").status, 200);
}

/// Issue 32, hole 6: the session page showed no finish reason or call reward.
#[test]
fn session_page_shows_call_ids_finish_reasons_and_call_rewards() {
    let d = data_dir();
    let v = Viewer::new(d.path(), None, None, "").unwrap();
    let p = v.page("/session/s-a", "");
    assert!(
        p.body.contains("call <code class=\"callid\">s-a-1</code>"),
        "{}",
        p.body
    );
    assert!(
        p.body
            .contains("finish <span class=\"finish\">tool_calls</span>"),
        "{}",
        p.body
    );
    assert_eq!(
        p.body
            .matches("call reward <b class=\"callreward\">0.25</b>")
            .count(),
        1,
        "{}",
        p.body
    );
    // The second call has neither.
    assert!(p.body.contains("finish <span class=\"finish\">–</span>"));
}

/// A side sample's page names its thread and links its parent; a forked sample's page lists
/// what the harness rewrote, with both sides' excerpts.
#[test]
fn sample_page_names_the_thread_links_the_parent_and_lists_rewrites() {
    use graft_reconstruct::threads::{Rewrite, RewriteKind};
    let d = data_dir();
    let run = tempfile::tempdir().unwrap();
    std::fs::create_dir_all(run.path().join("samples")).unwrap();
    let base = Sample {
        session_id: "s-a".into(),
        tokens: vec![1, 2],
        loss_mask: vec![0, 1],
        logprobs: vec![None, None],
        token_weight_versions: vec![None, None],
        call_ids: vec!["c1".into()],
        token_calls: vec![None, Some(0)],
        call_rewards: vec![None],
        schema_version: graft_reconstruct::sample::SAMPLE_SCHEMA_VERSION,
        ..Sample::default()
    };
    let main = Sample {
        sample_id: "s-a/0".into(),
        thread: "main".into(),
        rewrites: vec![Rewrite {
            kind: RewriteKind::AssistantReserialized,
            call_id: "c1".into(),
            against_call: "c0".into(),
            message: 2,
            role: "assistant".into(),
            before: "shell({\"command\": \"ls\"})".into(),
            after: "Calling tools: [...]".into(),
        }],
        ..base.clone()
    };
    let side = Sample {
        sample_id: "s-a/1".into(),
        thread: "side".into(),
        thread_id: "0123456789ab".into(),
        thread_name: "Generate a title (0 tools)".into(),
        parent_sample: Some("s-a/0".into()),
        ..base
    };
    let samples = run.path().join("samples/step-00000.parquet");
    graft_reconstruct::sample::write_samples_parquet(&[main, side], &samples).unwrap();
    let v = Viewer::new(d.path(), Some(run.path()), None, "").unwrap();
    let p = v.page("/sample", "file=step-00000.parquet&id=s-a%2F1");
    assert_eq!(p.status, 200, "{}", p.body);
    assert!(p.body.contains("data-thread=\"side\""), "{}", p.body);
    assert!(p.body.contains("Generate a title (0 tools)"), "{}", p.body);
    assert!(
        p.body
            .contains("id=\"parent-link\" href=\"/sample?file=step-00000.parquet&amp;id=s-a%2F0\""),
        "{}",
        p.body
    );
    let p = v.page("/sample", "file=step-00000.parquet&id=s-a%2F0");
    assert!(p.body.contains("data-thread=\"main\""), "{}", p.body);
    assert!(!p.body.contains("parent-link"), "{}", p.body);
    assert_eq!(rows(&p.body, "rewriterow"), 1, "{}", p.body);
    assert!(p.body.contains("data-kind=\"assistant_reserialized\""));
    assert!(p.body.contains("Calling tools: [...]"), "{}", p.body);
    assert!(
        p.body
            .contains("shell({&quot;command&quot;: &quot;ls&quot;})"),
        "{}",
        p.body
    );
}

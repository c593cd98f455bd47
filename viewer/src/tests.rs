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
        rec.record(mk("s-a", "g1", 1, vec![user.clone()],
            json!({"choices": [{"message": call.clone()}]}), "ok")).await.unwrap();
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
    assert!(p.body.contains("result of c1"));
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

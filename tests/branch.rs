//! Branch sessions (`POST /graft/sessions` with `branch_of: {session, at_call, policy}`):
//! a recorded rollout is re-run by the test's own small client (the harness stand-in: a
//! deterministic agent loop that echoes each answer back), its first `at_call` calls are
//! answered from the parent's records (no upstream request: the scripted upstream's logs
//! say so), its later ones sampled live; every branch record says which, and
//! `graft reconstruct` gives the replayed part mask 0 in the branch while the parent trains
//! it. Exact mode (Qwen3 over the scripted SGLang side) and passthrough (the scripted Chat
//! upstream), Chat whole and streamed, Anthropic Messages in exact mode.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::path::{Path, PathBuf};

use common::{Proc, TestEnv, http, ids};
use graft_reconstruct::sample::read_samples_parquet;
use serde_json::{Value, json};

const SCRIPT: &str = r#"{"rules": [
  {"role": "tool", "reply": {"reasoning": "The listing is in.", "content": "The directory holds a.txt and b.txt."}},
  {"match": "list the files", "reply": {"reasoning": "I need to look at the directory.", "content": "Let me look.", "tool_calls": [{"name": "bash", "arguments": {"command": "ls -la"}}]}},
  {"match": "and count them", "reply": {"reasoning": "Two files were listed.", "content": "There are 2 files."}}
]}"#;

const T1: &str = "2026-01-01T10:00:00Z";
const T2: &str = "2026-02-03T11:22:33Z";

struct Setup {
    gateway: Proc,
    upstream: Proc,
    data: PathBuf,
    model: PathBuf,
    exact: bool,
    dir: tempfile::TempDir,
}

fn start(exact: bool) -> Setup {
    let model = TestEnv::get().qwen3_dir();
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let script = dir.path().join("script.json");
    std::fs::write(&script, SCRIPT).unwrap();
    let q = model.to_str().unwrap();
    let mut up = vec!["--script", script.to_str().unwrap()];
    if exact {
        up.extend(["--tokenizer", q]);
    }
    let upstream = Proc::scripted_upstream(&up);
    let gw: Vec<&str> = if exact {
        vec!["--mode", "exact", "--model-dir", q]
    } else {
        vec![]
    };
    let gateway = Proc::gateway_with(&upstream.url, &data, &gw, &[]);
    Setup {
        gateway,
        upstream,
        data,
        model,
        exact,
        dir,
    }
}

impl Setup {
    fn model_name(&self) -> &'static str {
        if self.exact { "qwen3" } else { "scripted" }
    }

    /// Requests that reached the upstream's generation routes so far.
    async fn upstream_calls(&self) -> usize {
        if self.exact {
            let v = http::get(&format!("{}/testkit/requests", self.upstream.url), &[])
                .await
                .json();
            v["generate"].as_array().unwrap().len()
        } else {
            let v = http::get(
                &format!("{}/testkit/openai/requests", self.upstream.url),
                &[],
            )
            .await
            .json();
            v["requests"].as_array().unwrap().len()
        }
    }

    /// A session made through the session API (`branch_of` when given): (id, base URL).
    async fn session(&self, branch_of: Option<Value>) -> (String, String) {
        let mut body = json!({"group_id": "g"});
        if let Some(b) = branch_of {
            body["branch_of"] = b;
        }
        let r = http::post_json(&format!("{}/graft/sessions", self.gateway.url), &[], &body).await;
        assert_eq!(r.status, 201, "{}", r.text());
        let v = r.json();
        (
            v["session_id"].as_str().unwrap().to_owned(),
            v["base_url"].as_str().unwrap().to_owned(),
        )
    }

    /// The session's records, in seq order.
    fn records(&self, sid: &str, n: usize) -> Vec<Value> {
        let mut recs: Vec<Value> = Vec::new();
        for _ in 0..100 {
            recs = common::records_show(&self.data)
                .into_iter()
                .filter(|r| r["session_id"] == sid)
                .collect();
            if recs.len() >= n {
                break;
            }
            std::thread::sleep(std::time::Duration::from_millis(100));
        }
        assert_eq!(recs.len(), n, "session {sid}: {recs:#?}");
        recs.sort_by_key(|r| r["seq"].as_u64().unwrap());
        recs
    }

    async fn view(&self, sid: &str) -> Value {
        http::get(&format!("{}/graft/sessions/{sid}", self.gateway.url), &[])
            .await
            .json()
    }
}

/// The test's own small client: the three-call conversation of [`SCRIPT`] (a tool call,
/// the answer to its result, a second user turn), with `system` as its system prompt and
/// `first` as its first user turn, in Chat Completions (`chat`, whole or streamed) or
/// Anthropic Messages (`messages`, whole). Each answer is echoed back (without its
/// reasoning, as most clients do). Returns each call's answer as the client got it: its
/// text and tool calls `(id, name, arguments)`.
struct Client<'a> {
    dialect: &'static str,
    stream: bool,
    system: &'a str,
    first: &'a str,
}

impl Client<'_> {
    fn chat(stream: bool) -> Self {
        Client {
            dialect: "chat",
            stream,
            system: "You run shell commands.",
            first: "list the files please",
        }
    }

    async fn run(&self, s: &Setup, base: &str) -> Vec<Value> {
        match self.dialect {
            "chat" => self.run_chat(s, base).await,
            _ => self.run_messages(s, base).await,
        }
    }

    async fn run_chat(&self, s: &Setup, base: &str) -> Vec<Value> {
        let tools = json!([{"type": "function", "function": {"name": "bash", "description": "Run a shell command",
            "parameters": {"type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]}}}]);
        let mut messages = vec![
            json!({"role": "system", "content": self.system}),
            json!({"role": "user", "content": self.first}),
        ];
        let mut answers = vec![];
        for turn in 0..3 {
            let mut body = json!({"model": s.model_name(), "tools": tools, "messages": messages});
            if self.stream {
                body["stream"] = json!(true);
                body["stream_options"] = json!({"include_usage": true});
            }
            let r = http::post_json(&format!("{base}/chat/completions"), &[], &body).await;
            assert_eq!(r.status, 200, "turn {turn}: {}", r.text());
            assert_eq!(
                r.header("content-type")
                    .unwrap()
                    .starts_with("text/event-stream"),
                self.stream,
                "turn {turn}: the answer comes in the form the client asked for"
            );
            let mut msg = common::chat_message(&r);
            let o = msg.as_object_mut().unwrap();
            o.remove("finish_reason");
            o.remove("reasoning_content");
            let calls: Vec<Value> = o
                .get("tool_calls")
                .and_then(Value::as_array)
                .into_iter()
                .flatten()
                .map(|c| json!([c["id"], c["function"]["name"], c["function"]["arguments"]]))
                .collect();
            answers.push(
                json!({"text": o.get("content").cloned().unwrap_or(Value::Null), "calls": calls}),
            );
            messages.push(msg.clone());
            if let Some(call) = msg["tool_calls"].get(0) {
                messages.push(
                    json!({"role": "tool", "tool_call_id": call["id"], "content": "a.txt b.txt"}),
                );
            } else if turn == 1 {
                messages.push(json!({"role": "user", "content": "and count them"}));
            }
        }
        answers
    }

    async fn run_messages(&self, s: &Setup, base: &str) -> Vec<Value> {
        let tools = json!([{"name": "bash", "description": "Run a shell command",
            "input_schema": {"type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]}}]);
        let mut messages = vec![json!({"role": "user", "content": self.first})];
        let mut answers = vec![];
        for turn in 0..3 {
            let body = json!({"model": s.model_name(), "max_tokens": 512, "system": self.system,
                "tools": tools, "messages": messages});
            let r = http::post_json(
                &format!("{base}/messages"),
                &[("anthropic-version", "2023-06-01")],
                &body,
            )
            .await;
            assert_eq!(r.status, 200, "turn {turn}: {}", r.text());
            let v = r.json();
            assert_eq!(v["type"], "message", "{v}");
            let blocks: Vec<Value> = v["content"]
                .as_array()
                .unwrap()
                .iter()
                .filter(|b| b["type"] != "thinking")
                .cloned()
                .collect();
            let text: String = blocks
                .iter()
                .filter(|b| b["type"] == "text")
                .map(|b| b["text"].as_str().unwrap().to_owned())
                .collect();
            let uses: Vec<&Value> = blocks.iter().filter(|b| b["type"] == "tool_use").collect();
            answers.push(json!({"text": text, "calls": uses.iter()
                .map(|u| json!([u["id"], u["name"], u["input"].to_string()])).collect::<Vec<_>>()}));
            messages.push(json!({"role": "assistant", "content": blocks.clone()}));
            if let Some(u) = uses.first() {
                messages.push(json!({"role": "user", "content": [
                    {"type": "tool_result", "tool_use_id": u["id"], "content": "a.txt b.txt"}]}));
            } else if turn == 1 {
                messages.push(json!({"role": "user", "content": "and count them"}));
            }
        }
        answers
    }
}

fn reconstruct(s: &Setup, out: &Path) -> Value {
    let text = common::graft(&[
        "reconstruct",
        "--data-dir",
        s.data.to_str().unwrap(),
        "--tokenizer",
        s.model.to_str().unwrap(),
        "--out",
        out.to_str().unwrap(),
        "--json",
    ]);
    serde_json::from_str(text.lines().last().unwrap()).unwrap_or_else(|e| panic!("{e}: {text}"))
}

/// A recorded three-call session branched at call 2 into three branches (each in its own
/// form): each branch's first two calls are answered with the parent's answers and tokens,
/// and never reach the upstream; its third is sampled live; the records say which.
async fn three_branches_at_call_2(
    s: &Setup,
    parent_client: &Client<'_>,
    branches: [Client<'_>; 3],
) {
    let (parent, base) = s.session(None).await;
    let parent_answers = parent_client.run(s, &base).await;
    let before = s.upstream_calls().await;
    assert_eq!(before, 3, "the parent's calls reach the upstream");
    let prec = s.records(&parent, 3);
    let mut sids = vec![];
    for (i, c) in branches.iter().enumerate() {
        let (sid, base) = s
            .session(Some(json!({"session": parent, "at_call": 2})))
            .await;
        let answers = c.run(s, &base).await;
        assert_eq!(
            answers, parent_answers,
            "branch {i} ({} stream={}): the same answers (the live third one too: the script is deterministic)",
            c.dialect, c.stream
        );
        assert_eq!(
            s.upstream_calls().await,
            before + i + 1,
            "branch {i}: only its third call reached the upstream"
        );
        let recs = s.records(&sid, 3);
        for (k, r) in recs.iter().enumerate() {
            assert_eq!(r["outcome"], "ok", "{r:#}");
            let replay = &r["replay"];
            assert_eq!(replay["branch_of"], parent.as_str(), "{replay}");
            assert_eq!(replay["at_call"], 2, "{replay}");
            assert_eq!(replay["position"], k + 1, "{replay}");
            if k < 2 {
                assert_eq!(
                    replay["replayed_from"], prec[k]["call_id"],
                    "call {k}: {replay}"
                );
                assert!(replay.get("live").is_none(), "{replay}");
                assert!(replay.get("differences").is_none(), "matched: {replay}");
                if s.exact {
                    assert_eq!(r["completion_token_ids"], prec[k]["completion_token_ids"]);
                    assert_eq!(r["completion_logprobs"], prec[k]["completion_logprobs"]);
                    assert_eq!(r["prompt_token_ids"], prec[k]["prompt_token_ids"]);
                }
            } else {
                assert!(replay.get("replayed_from").is_none(), "{replay}");
                assert!(
                    replay["live"]
                        .as_str()
                        .unwrap()
                        .contains("past the branch point"),
                    "{replay}"
                );
            }
        }
        let view = s.view(&sid).await;
        let b = &view["branch"];
        assert_eq!(
            (&b["of"], &b["calls"], &b["replayed"], &b["live_at"]),
            (&json!(parent), &json!(3), &json!(2), &json!(3)),
            "{view}"
        );
        sids.push(sid);
    }
    if !s.exact {
        return;
    }
    // Training: the branch's first tokens are the parent's up to the branch point, context
    // (mask 0) in the branch, trained (mask 1) in the parent.
    let out = s.dir.path().join("samples.parquet");
    let summary = reconstruct(s, &out);
    assert_eq!(summary["samples"], 4, "one sample per session: {summary}");
    let samples = read_samples_parquet(&out).unwrap();
    let of = |sid: &str| samples.iter().find(|x| x.session_id == sid).unwrap();
    let p = of(&parent);
    assert_eq!((&p.branch_of, p.branch_at), (&None, None));
    let point =
        ids(&prec[1]["prompt_token_ids"]).len() + ids(&prec[1]["completion_token_ids"]).len();
    let parent_trained = p.loss_mask[..point].iter().filter(|&&m| m == 1).count();
    let sampled =
        ids(&prec[0]["completion_token_ids"]).len() + ids(&prec[1]["completion_token_ids"]).len();
    assert_eq!(
        parent_trained, sampled,
        "the parent trains its first two calls"
    );
    for sid in &sids {
        let b = of(sid);
        assert_eq!(b.branch_of.as_deref(), Some(parent.as_str()));
        assert_eq!(b.branch_at, Some(2));
        assert_eq!(b.tokens[..point], p.tokens[..point], "branch {sid}");
        assert!(
            b.loss_mask[..point].iter().all(|&m| m == 0),
            "branch {sid}: the replayed calls are context"
        );
        assert!(b.logprobs[..point].iter().all(Option::is_none));
        let live = b.loss_mask[point..].iter().filter(|&&m| m == 1).count();
        assert_eq!(
            live,
            ids(&prec[2]["completion_token_ids"]).len(),
            "branch {sid}: its live call is trained"
        );
        assert_eq!(
            b.tokens, p.tokens,
            "the live call sampled what the parent did"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn exact_branches_replay_the_parents_tokens_and_sample_after_the_branch_point() {
    let s = start(true);
    three_branches_at_call_2(
        &s,
        &Client::chat(false),
        [Client::chat(true), Client::chat(false), Client::chat(true)],
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn exact_messages_branches_replay_through_the_messages_dialect() {
    let s = start(true);
    let m = || Client {
        dialect: "messages",
        ..Client::chat(false)
    };
    three_branches_at_call_2(&s, &m(), [m(), m(), m()]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn passthrough_branches_replay_the_recorded_answers_and_go_live_after_the_branch_point() {
    let s = start(false);
    three_branches_at_call_2(
        &s,
        &Client::chat(false),
        [Client::chat(true), Client::chat(false), Client::chat(true)],
    )
    .await;
}

/// A client whose system prompt carries a timestamp: `tolerant` replays through it and
/// records the difference; `strict` goes live at the first call and says so; a changed
/// user turn goes live under both.
async fn volatile_and_changed_turns(s: &Setup, stream: bool) {
    let sys = |t: &str| format!("You run shell commands. The time is {t}.");
    let (s1, s2) = (sys(T1), sys(T2));
    let (parent, base) = s.session(None).await;
    let c = Client {
        system: &s1,
        ..Client::chat(stream)
    };
    let parent_answers = c.run(s, &base).await;
    let prec = s.records(&parent, 3);

    // Tolerant (the default): the timestamp is volatile.
    let before = s.upstream_calls().await;
    let (sid, base) = s
        .session(Some(json!({"session": parent, "at_call": 2})))
        .await;
    let c = Client {
        system: &s2,
        ..Client::chat(stream)
    };
    assert_eq!(c.run(s, &base).await, parent_answers);
    assert_eq!(
        s.upstream_calls().await,
        before + 1,
        "tolerant replays calls 1 and 2"
    );
    let recs = s.records(&sid, 3);
    for k in 0..2 {
        let replay = &recs[k]["replay"];
        assert_eq!(replay["replayed_from"], prec[k]["call_id"], "{replay}");
        let diffs = replay["differences"].as_array().unwrap();
        let ts = diffs
            .iter()
            .find(|d| d["at"].as_str().unwrap().starts_with("messages[0].content"))
            .unwrap_or_else(|| panic!("the system prompt's difference is recorded: {replay}"));
        assert_eq!(ts["kind"], "timestamp", "{ts}");
        assert!(ts["parent"].as_str().unwrap().contains(T1), "{ts}");
        assert!(ts["branch"].as_str().unwrap().contains(T2), "{ts}");
        assert!(diffs.iter().all(|d| d["kind"] != "turn"), "{replay}");
        if s.exact {
            assert!(
                diffs.iter().any(|d| d["kind"] == "tokens"),
                "the prompt ids differ too: {replay}"
            );
        }
    }
    assert_eq!(s.view(&sid).await["branch"]["tolerated"], 2);

    // Strict: the first differing call goes live, and every call after it.
    let before = s.upstream_calls().await;
    let (sid, base) = s
        .session(Some(
            json!({"session": parent, "at_call": 2, "policy": "strict"}),
        ))
        .await;
    c.run(s, &base).await;
    assert_eq!(
        s.upstream_calls().await,
        before + 3,
        "strict samples every call"
    );
    let recs = s.records(&sid, 3);
    let first = &recs[0]["replay"];
    assert!(first.get("replayed_from").is_none(), "{first}");
    assert!(
        first["live"].as_str().unwrap().starts_with("strict:"),
        "{first}"
    );
    assert_eq!(first["policy"], "strict");
    assert!(
        first["differences"]
            .as_array()
            .unwrap()
            .iter()
            .any(|d| d["kind"] == if s.exact { "tokens" } else { "timestamp" }),
        "{first}"
    );
    for r in &recs[1..] {
        assert!(
            r["replay"]["live"]
                .as_str()
                .unwrap()
                .contains("went live at its call 1"),
            "{r:#}"
        );
    }
    let view = s.view(&sid).await;
    assert_eq!(view["branch"]["live_at"], 1, "{view}");
    assert!(
        view["branch"]["live_reason"]
            .as_str()
            .unwrap()
            .starts_with("strict:")
    );

    // A changed user turn goes live under both policies.
    for policy in ["tolerant", "strict"] {
        let before = s.upstream_calls().await;
        let (sid, base) = s
            .session(Some(
                json!({"session": parent, "at_call": 2, "policy": policy}),
            ))
            .await;
        let c = Client {
            system: &s1,
            first: "list the files in here please",
            ..Client::chat(stream)
        };
        c.run(s, &base).await;
        assert_eq!(
            s.upstream_calls().await,
            before + 3,
            "{policy}: every call is live"
        );
        let first = &s.records(&sid, 3)[0]["replay"];
        assert!(first.get("replayed_from").is_none(), "{policy}: {first}");
        let turn = first["differences"]
            .as_array()
            .unwrap()
            .iter()
            .find(|d| d["kind"] == "turn")
            .unwrap_or_else(|| panic!("{policy}: the changed turn is named: {first}"));
        assert!(
            turn["at"]
                .as_str()
                .unwrap()
                .starts_with("messages[1].content"),
            "{turn}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn exact_tolerant_replays_through_a_timestamp_strict_does_not_and_a_changed_turn_goes_live() {
    volatile_and_changed_turns(&start(true), true).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn passthrough_tolerant_replays_through_a_timestamp_strict_does_not_and_a_changed_turn_goes_live()
 {
    volatile_and_changed_turns(&start(false), false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_branch_of_an_unknown_session_or_past_its_calls_is_refused_by_name() {
    let s = start(false);
    let (parent, base) = s.session(None).await;
    Client::chat(false).run(&s, &base).await;
    let url = format!("{}/graft/sessions", s.gateway.url);
    for (branch_of, needle) in [
        (
            json!({"session": "nope", "at_call": 1}),
            "'branch_of.session' names no session",
        ),
        (
            json!({"session": parent, "at_call": 4}),
            "has 3 answered calls",
        ),
        (
            json!({"session": parent, "at_call": 0}),
            "must be at least 1",
        ),
        (
            json!({"session": parent, "at_call": 1, "policy": "lenient"}),
            "unknown variant",
        ),
    ] {
        let r = http::post_json(&url, &[], &json!({"branch_of": branch_of})).await;
        assert_eq!(r.status, 400, "{branch_of}: {}", r.text());
        assert!(r.text().contains(needle), "{branch_of}: {}", r.text());
    }
}

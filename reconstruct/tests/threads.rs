//! Threads of a session: which calls are the main agent's, which are side threads (titles,
//! sub-agents), their parents, and what each side-thread policy keeps.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use graft_reconstruct::merge::{CallTokens, MergeOptions, merge_session_with};
use graft_reconstruct::threads::{CallView, Msg, SideThreads};

const FP: (&str, &str) = ("tok", "tpl");

fn msg(role: &str, text: &str) -> Msg {
    Msg {
        role: role.into(),
        text: text.into(),
        ..Msg::default()
    }
}

/// A call of the conversation whose system prompt is `system` (offering `tools`), whose
/// prompt is `prompt` (token ids) and which sampled `completion`.
fn call(
    seq: u64,
    system: &str,
    tools: &[&str],
    first_user: &str,
    prompt: Vec<u32>,
    completion: Vec<u32>,
) -> CallTokens {
    let view = CallView {
        messages: vec![msg("system", system), msg("user", first_user)],
        answer: Some(msg("assistant", "ok")),
        tools: tools.iter().map(|t| t.to_string()).collect(),
    };
    CallTokens {
        call_id: format!("c{seq}"),
        seq,
        prompt_ids: prompt,
        completion_ids: completion,
        root: Some(format!("{system}|{first_user}")),
        ..CallTokens::default()
    }
    .with_view(Some(view))
}

/// Claude Code's shape: a title call that races the first turn (seq 0), the agent's turns
/// (all its tools), a Task sub-agent between two of them (its own prompt, fewer tools).
fn session() -> Vec<CallTokens> {
    let agent = "You are Claude Code.\nYou help with software tasks.";
    let tools = ["Bash", "Read", "Task"];
    let sub = "You are Claude Code.\nYou are a sub-agent: search the repository.";
    vec![
        call(
            0,
            "You are Claude Code.\nGenerate a concise title.",
            &[],
            "do it",
            vec![900, 901],
            vec![902],
        ),
        call(1, agent, &tools, "do it", vec![1, 2, 3], vec![10, 11]),
        call(
            2,
            agent,
            &tools,
            "do it",
            vec![1, 2, 3, 10, 11, 4],
            vec![12],
        ),
        call(3, sub, &["Read"], "find x", vec![500, 501], vec![510]),
        call(
            4,
            sub,
            &["Read"],
            "find x",
            vec![500, 501, 510, 502],
            vec![511],
        ),
        call(
            5,
            agent,
            &tools,
            "do it",
            vec![1, 2, 3, 10, 11, 4, 12, 5],
            vec![13],
        ),
    ]
}

#[test]
fn the_agent_with_every_tool_is_main_and_titles_and_sub_agents_are_side_threads_with_parents() {
    let opts = MergeOptions {
        side_threads: SideThreads::Session,
        ..MergeOptions::default()
    };
    let r = merge_session_with("s", Some("g"), &session(), Some(1.0), FP, opts);
    assert_eq!(r.samples.len(), 3, "{:#?}", r.samples);
    let by_id = |id: &str| r.samples.iter().find(|s| s.sample_id == id).unwrap();
    // The title (first by seq) is s/0, the agent's turns are one sample s/1.
    let title = by_id("s/0");
    let main = by_id("s/1");
    let sub = by_id("s/2");
    assert_eq!(main.thread, "main");
    assert_eq!(main.call_ids, ["c1", "c2", "c5"]);
    assert_eq!(main.parent_sample, None);
    assert_eq!(title.thread, "side");
    assert_eq!(title.thread_name, "Generate a concise title. (0 tools)");
    // Started before any main call: its parent is the first main sample.
    assert_eq!(title.parent_sample.as_deref(), Some("s/1"));
    assert_eq!(sub.thread, "side");
    assert_eq!(sub.call_ids, ["c3", "c4"]);
    assert_eq!(
        sub.thread_name,
        "You are a sub-agent: search the repository. (1 tool)"
    );
    assert_eq!(sub.parent_sample.as_deref(), Some("s/1"));
    assert_ne!(sub.thread_id, title.thread_id);
    assert_ne!(sub.thread_id, main.thread_id);
    // Under `session` every sample has the session's reward.
    assert!(r.samples.iter().all(|s| s.reward == Some(1.0)));
    assert_eq!(r.threads[0].kind, "main");
    assert_eq!(r.threads.len(), 3);
    assert!(r.side_left_out.is_empty());
}

#[test]
fn side_threads_are_left_out_by_default_unless_a_call_of_theirs_was_rewarded() {
    // Default (`own`): no call reward posted, only the main sample is kept.
    let r = merge_session_with(
        "s",
        None,
        &session(),
        Some(1.0),
        FP,
        MergeOptions::default(),
    );
    assert_eq!(r.samples.len(), 1);
    assert_eq!(r.samples[0].thread, "main");
    assert_eq!(r.samples[0].reward, Some(1.0));
    assert_eq!(r.side_left_out.len(), 2);
    assert!(
        r.threads[1..]
            .iter()
            .all(|t| !t.trained && t.kind == "side")
    );
    assert_eq!(r.threads[0].samples, ["s/1"]);

    // A reward posted for the sub-agent's last call keeps its sample, on that reward only.
    let mut calls = session();
    calls[4].reward = Some(0.25);
    let r = merge_session_with("s", None, &calls, Some(1.0), FP, MergeOptions::default());
    assert_eq!(r.samples.len(), 2);
    let sub = r.samples.iter().find(|s| s.thread == "side").unwrap();
    assert_eq!(sub.call_ids, ["c3", "c4"]);
    assert_eq!(sub.reward, None, "not the session's reward");
    assert_eq!(sub.call_rewards, [None, Some(0.25)]);

    // `leave-out` drops it even so.
    let opts = MergeOptions {
        side_threads: SideThreads::LeaveOut,
        ..MergeOptions::default()
    };
    let r = merge_session_with("s", None, &calls, Some(1.0), FP, opts);
    assert_eq!(r.samples.len(), 1);
    assert_eq!(r.side_left_out.len(), 2);
}

#[test]
fn a_new_conversation_with_the_agents_shape_stays_in_the_main_thread() {
    // The same system prompt and tools, another first user message (a harness's second
    // task in one session, or its history restarted after compaction): one thread.
    let a = "agent";
    let calls = vec![
        call(1, a, &["Bash"], "task one", vec![1, 2], vec![3]),
        call(2, a, &["Bash"], "task two", vec![7, 8], vec![9]),
    ];
    let r = merge_session_with("s", None, &calls, Some(0.0), FP, MergeOptions::default());
    assert_eq!(r.samples.len(), 2);
    assert!(r.samples.iter().all(|s| s.thread == "main"));
    assert_eq!(r.samples[1].fork_reason.as_deref(), Some("new_root"));
    assert_eq!(r.threads.len(), 1);
}

/// A fork whose prompt the harness rewrote names the change on the new sample and in the
/// result, and a rule-4 fork so explained is `rewritten`, not `other`.
#[test]
fn a_fork_names_what_the_harness_rewrote_and_is_rewritten_not_other() {
    let view = |messages: Vec<Msg>, answer: Option<Msg>| CallView {
        messages,
        answer,
        tools: vec!["shell".into()],
    };
    let task = || vec![msg("system", "You are an agent."), msg("user", "do it")];
    let first = CallTokens {
        call_id: "c1".into(),
        seq: 1,
        prompt_ids: vec![1, 2, 3, 4],
        completion_ids: vec![50, 51, 52, 53],
        root: Some("r".into()),
        ..CallTokens::default()
    }
    .with_view(Some(view(
        task(),
        Some(Msg {
            role: "assistant".into(),
            tool_calls: vec![("shell".into(), r#"{"command": "ls"}"#.into())],
            ..Msg::default()
        }),
    )));
    let mut again = task();
    again.push(msg(
        "assistant",
        "Calling tools:\n[{'id': 'call_1', 'type': 'function', 'function': {'name': 'shell', 'arguments': {'command': 'ls'}}}]",
    ));
    again.push(msg("user", "Observation:\na.txt"));
    let second = CallTokens {
        call_id: "c2".into(),
        seq: 2,
        // The start, then other tokens where the sampled tool call was.
        prompt_ids: vec![1, 2, 3, 4, 90, 91, 92, 93, 94, 95, 96],
        completion_ids: vec![60],
        root: Some("r".into()),
        ..CallTokens::default()
    }
    .with_view(Some(view(again, None)));
    let r = merge_session_with(
        "s",
        None,
        &[first, second],
        Some(1.0),
        FP,
        MergeOptions::default(),
    );
    assert_eq!(r.samples.len(), 2);
    assert_eq!(r.samples[1].fork_reason.as_deref(), Some("rewritten"));
    let kinds: Vec<&str> = r.samples[1]
        .rewrites
        .iter()
        .map(|w| w.kind.as_str())
        .collect();
    assert_eq!(kinds, ["assistant_reserialized", "tool_result_rewrapped"]);
    assert_eq!(r.rewrites.len(), 2);
    assert_eq!(r.drift.len(), 1);
    assert_eq!(r.rewrites[0].against_call, "c1");
    assert!(r.samples.iter().all(|s| s.thread == "main"));
}

//! Threads of a session, and the history rewrites a harness makes between its calls.
//!
//! # Threads
//!
//! A harness makes more than the agent's own calls: Claude Code asks for a session title
//! (its own system prompt, no tools) and runs sub-agents through its Task tool (their own
//! system prompt, a subset of its tools); qwen-code runs a memory-extraction sub-agent after
//! a turn that ends without a tool call (its own system prompt, the same model, seven
//! tools, no header that tells it apart); OpenHands' condenser, opencode's titles and
//! summaries, smolagents' planning steps are the same kind of call. None of them continues
//! the agent's conversation, and none of them is the task the session's reward scores.
//!
//! The rule: every call is in exactly one **thread**.
//! - A call that continues a sample, or forks from one by drift, reordering, a parallel
//!   branch or compaction (rules 1-4 of [`crate::merge`]), is in that sample's thread: a
//!   harness that changes its tool set or rewrites its history mid-run stays one thread.
//! - A call that starts a conversation of its own (rule 0, `new_root`) is in the thread of
//!   its **shape** ([`ThreadKey`]): its system prompt and the names of the tools it offers.
//!   The same shape is the same agent (Codex after compaction, a harness's second task in
//!   one session, every title request of a session); a different system prompt or tool set
//!   is another agent: a side thread.
//! - The **main** thread is the one offering the most tools (the agent is given the
//!   harness's whole tool set; sub-agents get a subset, side calls none), then the one with
//!   the most calls, then the one that started first. Neither "first call" nor "last call"
//!   would do: Claude Code's title call races the first turn, and qwen-code's memory agent
//!   runs after the last one.
//!
//! Every other thread is a **side** thread. Its samples carry `thread = "side"`, the
//! thread's id (a fingerprint of its shape, the same in every session of the same harness
//! and prompt) and name (the first line of its system prompt that the main thread's lacks),
//! and `parent_sample`: the main sample holding the last main call that started before the
//! side sample's first call (the call that spawned it), else the first main sample.
//! What a side thread trains on is [`SideThreads`].
//!
//! # Rewrites
//!
//! A fork or drift event says which message of which call changed and how
//! ([`RewriteKind`]): the earlier call's messages and answer ([`CallView`]) are compared
//! with the later call's messages, message by message ([`rewrites`]).

use serde_json::Value;

/// What a side thread's samples train on (`--side-threads`, `graft rl`'s
/// `[run] side_threads`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum SideThreads {
    /// Kept with the session's reward, like the main thread.
    Session,
    /// Never kept.
    LeaveOut,
    /// Kept only when a reward was posted for one of their calls (the sample's reward is
    /// then the last one posted, its `call_rewards` the per-call ones); else left out.
    #[default]
    Own,
}

impl SideThreads {
    pub const ALL: [SideThreads; 3] = [
        SideThreads::Session,
        SideThreads::LeaveOut,
        SideThreads::Own,
    ];

    /// `session` | `leave-out` | `own`.
    pub fn as_str(self) -> &'static str {
        match self {
            SideThreads::Session => "session",
            SideThreads::LeaveOut => "leave-out",
            SideThreads::Own => "own",
        }
    }

    pub fn parse(name: &str) -> Option<SideThreads> {
        SideThreads::ALL.into_iter().find(|s| s.as_str() == name)
    }

    /// What the policy does, for the summary.
    pub fn describe(self) -> &'static str {
        match self {
            SideThreads::Session => "trained with the session's reward",
            SideThreads::LeaveOut => "left out of training",
            SideThreads::Own => {
                "left out of training unless a reward was posted for one of their calls"
            }
        }
    }
}

/// The shape of a call: its system prompt and the names of the tools it offers.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct ThreadKey {
    /// 12 hex digits of SHA-256 over the system prompt and the sorted tool names.
    pub id: String,
    /// The system prompt's text (system and developer messages, joined).
    pub system: String,
    /// Names of the tools offered, sorted.
    pub tools: Vec<String>,
}

impl ThreadKey {
    pub fn new(system: String, mut tools: Vec<String>) -> ThreadKey {
        use sha2::{Digest, Sha256};
        tools.sort();
        let key = serde_json::json!([system, tools]).to_string();
        let digest = Sha256::digest(key.as_bytes());
        ThreadKey {
            id: digest.iter().take(6).map(|b| format!("{b:02x}")).collect(),
            system,
            tools,
        }
    }

    /// A short name: the first line of its system prompt that `main`'s lacks (else the
    /// first), at most 80 characters, with the number of tools.
    pub fn name(&self, main: Option<&ThreadKey>) -> String {
        let lines = || self.system.lines().map(str::trim).filter(|l| !l.is_empty());
        let own = lines()
            .find(|l| main.is_none_or(|m| !m.system.contains(l)))
            .or_else(|| lines().next());
        let tools = match self.tools.len() {
            1 => "1 tool".to_owned(),
            n => format!("{n} tools"),
        };
        match own {
            Some(l) => format!("{} ({tools})", excerpt(l, 80)),
            None => format!("(no system prompt) ({tools})"),
        }
    }
}

/// One message as the rewrite comparison sees it, whatever dialect it came in.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Msg {
    /// `system`, `developer`, `user`, `assistant` or `tool`.
    pub role: String,
    pub text: String,
    pub reasoning: Option<String>,
    /// (name, arguments) of each tool call.
    pub tool_calls: Vec<(String, String)>,
    pub tool_call_id: Option<String>,
}

impl Msg {
    /// Content equal (role, text, tool calls with arguments compared as JSON), reasoning
    /// and ids aside.
    fn same(&self, o: &Msg) -> bool {
        self.role == o.role
            && self.text.trim() == o.text.trim()
            && self.tool_calls.len() == o.tool_calls.len()
            && self
                .tool_calls
                .iter()
                .zip(&o.tool_calls)
                .all(|(a, b)| a.0 == b.0 && same_json(&a.1, &b.1))
    }

    /// The message as one line: its text, then its tool calls.
    fn shown(&self) -> String {
        let mut s = self.text.trim().to_owned();
        for (name, args) in &self.tool_calls {
            if !s.is_empty() {
                s.push(' ');
            }
            s.push_str(&format!("{name}({args})"));
        }
        s.split_whitespace().collect::<Vec<_>>().join(" ")
    }
}

fn same_json(a: &str, b: &str) -> bool {
    a == b
        || matches!(
            (serde_json::from_str::<Value>(a), serde_json::from_str::<Value>(b)),
            (Ok(x), Ok(y)) if x == y
        )
}

/// Characters of a rewrite's excerpt, each side.
pub const EXCERPT_CHARS: usize = 120;

/// Excerpts of two versions of a message (one line each): from a little before where they
/// first differ (`…` where cut), so the change is in view.
fn excerpts(before: &str, after: &str) -> (String, String) {
    let (b, a): (Vec<char>, Vec<char>) = (before.chars().collect(), after.chars().collect());
    let same = b.iter().zip(&a).take_while(|(x, y)| x == y).count();
    let from = if same > EXCERPT_CHARS / 2 && b != a && !b.is_empty() && !a.is_empty() {
        same - EXCERPT_CHARS / 4
    } else {
        0
    };
    let cut = |c: &[char]| {
        let rest: String = c[from.min(c.len())..].iter().collect();
        let text = excerpt(&rest, EXCERPT_CHARS - usize::from(from > 0));
        if from > 0 { format!("…{text}") } else { text }
    };
    (cut(&b), cut(&a))
}

/// `text` on one line, at most `max` characters (`…` when cut).
pub fn excerpt(text: &str, max: usize) -> String {
    let one: String = text.split_whitespace().collect::<Vec<_>>().join(" ");
    if one.chars().count() <= max {
        one
    } else {
        let mut s: String = one.chars().take(max.saturating_sub(1)).collect();
        s.push('…');
        s
    }
}

/// A call's conversation: the messages of its request and the answer it got.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct CallView {
    pub messages: Vec<Msg>,
    pub answer: Option<Msg>,
    /// Names of the tools offered.
    pub tools: Vec<String>,
}

impl CallView {
    /// The call's thread key (its system prompt and tools). Lines that change from request
    /// to request of one agent are not part of it: Claude Code starts its system prompt
    /// with a billing line holding a per-request checksum (`x-anthropic-billing-header:
    /// cc_version=2.1.197.127; ...`).
    pub fn key(&self) -> ThreadKey {
        let system: Vec<&str> = self
            .messages
            .iter()
            .filter(|m| matches!(m.role.as_str(), "system" | "developer"))
            .flat_map(|m| m.text.lines())
            .filter(|l| !VOLATILE_LINES.iter().any(|p| l.trim_start().starts_with(p)))
            .collect();
        ThreadKey::new(system.join("\n"), self.tools.clone())
    }
}

/// Starts of system-prompt lines that differ between requests of one agent.
const VOLATILE_LINES: [&str; 1] = ["x-anthropic-billing-header:"];

fn text_of(content: Option<&Value>) -> String {
    match content {
        Some(Value::String(s)) => s.clone(),
        Some(Value::Array(parts)) => parts
            .iter()
            .filter_map(|p| {
                p.as_str()
                    .or_else(|| p.get("text").and_then(Value::as_str))
                    .or_else(|| p.get("content").and_then(Value::as_str))
            })
            .collect::<Vec<_>>()
            .join("\n"),
        _ => String::new(),
    }
}

/// A message of graft's internal form (`normalized_request`) or of the Chat wire.
fn msg(m: &Value) -> Msg {
    let s = |k: &str| m.get(k).and_then(Value::as_str).map(str::to_owned);
    let tool_calls = m
        .get("tool_calls")
        .and_then(Value::as_array)
        .map(|calls| {
            calls
                .iter()
                .map(|c| {
                    let f = c.get("function").unwrap_or(c);
                    let name = f.get("name").and_then(Value::as_str).unwrap_or("");
                    let args = match f.get("arguments") {
                        Some(Value::String(a)) => a.clone(),
                        Some(v) => v.to_string(),
                        None => String::new(),
                    };
                    (name.to_owned(), args)
                })
                .collect()
        })
        .unwrap_or_default();
    Msg {
        role: s("role").unwrap_or_default(),
        text: text_of(m.get("content")),
        reasoning: s("reasoning")
            .or_else(|| s("reasoning_content"))
            .filter(|r| !r.is_empty()),
        tool_calls,
        tool_call_id: s("tool_call_id"),
    }
}

/// The conversation of a record: its normalized request and answer (every dialect, exact
/// mode and translation), else its Chat request and answer; `None` for anything else.
pub fn call_view(rec: &graft_recorder::CallRecord) -> Option<CallView> {
    let (req, answer) = match &rec.normalized_request {
        Some(n) if n.get("messages").is_some() => {
            let answer = rec.normalized_response.as_ref().map(msg).map(|mut a| {
                a.role = "assistant".into();
                if a.text.is_empty() {
                    a.text = rec
                        .normalized_response
                        .as_ref()
                        .and_then(|r| r.get("text"))
                        .and_then(Value::as_str)
                        .unwrap_or("")
                        .to_owned();
                }
                a
            });
            (n, answer)
        }
        _ => {
            let (messages, tools, answer) = crate::retokenize::chat_view(rec)?;
            let tools = tools
                .unwrap_or_default()
                .iter()
                .filter_map(tool_name)
                .collect();
            return Some(CallView {
                messages: messages.iter().map(msg).collect(),
                answer: Some(msg(&answer)),
                tools,
            });
        }
    };
    let messages = req.get("messages")?.as_array()?.iter().map(msg).collect();
    let tools = req
        .get("tools")
        .and_then(Value::as_array)
        .map(|t| t.iter().filter_map(tool_name).collect())
        .unwrap_or_default();
    Some(CallView {
        messages,
        answer,
        tools,
    })
}

fn tool_name(t: &Value) -> Option<String> {
    t.get("name")
        .or_else(|| t.pointer("/function/name"))
        .and_then(Value::as_str)
        .map(str::to_owned)
}

/// How a harness changed its history between two calls.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum RewriteKind {
    /// Its own assistant turn re-sent in another form: tool calls written as text
    /// (smolagents' "Calling tools: [...]"), text or arguments changed.
    AssistantReserialized,
    /// A tool result re-sent in another wrapper: as a user message (smolagents'
    /// "Observation: ..."), or with text around it.
    ToolResultRewrapped,
    /// A tool result moved to another position.
    ToolResultMoved,
    /// A message moved to another position (OpenClaw keeps its context message last).
    Reordered,
    /// An assistant turn re-sent without its reasoning.
    ThinkingDropped,
    /// A system (or developer) message inserted into the history.
    SystemInserted,
    /// A message's text changed in place (a date, a counter in a system prompt).
    Edited,
    /// Messages of the history left out.
    Removed,
    /// The same messages, rendered into other tokens by the chat template (Qwen3 drops
    /// the reasoning of earlier turns).
    Rerendered,
    /// None of these.
    Other,
}

impl RewriteKind {
    pub const ALL: [RewriteKind; 10] = [
        RewriteKind::AssistantReserialized,
        RewriteKind::ToolResultRewrapped,
        RewriteKind::ToolResultMoved,
        RewriteKind::Reordered,
        RewriteKind::ThinkingDropped,
        RewriteKind::SystemInserted,
        RewriteKind::Edited,
        RewriteKind::Removed,
        RewriteKind::Rerendered,
        RewriteKind::Other,
    ];

    /// The name stored in a sample's `rewrites`.
    pub fn as_str(self) -> &'static str {
        match self {
            RewriteKind::AssistantReserialized => "assistant_reserialized",
            RewriteKind::ToolResultRewrapped => "tool_result_rewrapped",
            RewriteKind::ToolResultMoved => "tool_result_moved",
            RewriteKind::Reordered => "reordered",
            RewriteKind::ThinkingDropped => "thinking_dropped",
            RewriteKind::SystemInserted => "system_inserted",
            RewriteKind::Edited => "edited",
            RewriteKind::Removed => "removed",
            RewriteKind::Rerendered => "rerendered",
            RewriteKind::Other => "other",
        }
    }

    pub fn parse(name: &str) -> Option<RewriteKind> {
        RewriteKind::ALL.into_iter().find(|k| k.as_str() == name)
    }

    /// Whether the harness changed its messages (not the template's rendering).
    pub fn by_harness(self) -> bool {
        !matches!(self, RewriteKind::Rerendered | RewriteKind::Other)
    }
}

impl std::fmt::Display for RewriteKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// One change a call made to the history an earlier call of its thread had.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Rewrite {
    pub kind: RewriteKind,
    /// The call whose request holds the change.
    pub call_id: String,
    /// The earlier call it is compared with (the last call of the sample it forked from).
    pub against_call: String,
    /// Index of the changed message in `call_id`'s request messages (for a removed or
    /// moved message: where it was).
    pub message: u32,
    /// Role of the message as the earlier call had it.
    pub role: String,
    /// Excerpt of the message as the earlier call had it (its answer for the last one).
    pub before: String,
    /// Excerpt of the message as `call_id` sends it; empty when removed.
    pub after: String,
}

impl std::fmt::Display for Rewrite {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} at call {} message {} ({}): was «{}» now «{}»",
            self.kind, self.call_id, self.message, self.role, self.before, self.after
        )
    }
}

/// The rewrites between `prev` (an earlier call: its messages, then its answer) and `next`
/// (a later call's messages). Empty when `next` holds `prev`'s history unchanged (it just
/// continues it); `[rerendered]` (or `[thinking_dropped]` when an earlier assistant turn had
/// reasoning) when the messages are the same and only their tokens differ.
pub fn rewrites(prev: &CallView, prev_id: &str, next: &CallView, next_id: &str) -> Vec<Rewrite> {
    let expected: Vec<&Msg> = prev.messages.iter().chain(prev.answer.as_ref()).collect();
    let got: Vec<&Msg> = next.messages.iter().collect();
    let mut out = Vec::new();
    let mk = |kind, message: usize, before: Option<&Msg>, after: Option<&Msg>| {
        let (b, a) = excerpts(
            &before.map(Msg::shown).unwrap_or_default(),
            &after.map(Msg::shown).unwrap_or_default(),
        );
        Rewrite {
            kind,
            call_id: next_id.to_owned(),
            against_call: prev_id.to_owned(),
            message: u32::try_from(message).unwrap_or(u32::MAX),
            role: before.or(after).map(|m| m.role.clone()).unwrap_or_default(),
            before: b,
            after: a,
        }
    };
    macro_rules! push {
        ($($a:expr),*) => { out.push(mk($($a),*)) };
    }
    // Reasoning dropped from an assistant turn that is otherwise the same.
    let same = expected
        .iter()
        .zip(&got)
        .take_while(|(e, g)| e.same(g))
        .count();
    for i in 0..same {
        if expected[i].reasoning.is_some() && got[i].reasoning.is_none() {
            push!(
                RewriteKind::ThinkingDropped,
                i,
                Some(expected[i]),
                Some(got[i])
            );
        }
    }
    if same == expected.len() {
        if out.is_empty() {
            let kind = if expected.iter().any(|m| m.reasoning.is_some()) {
                RewriteKind::ThinkingDropped
            } else {
                RewriteKind::Rerendered
            };
            let last = expected.len().saturating_sub(1);
            push!(
                kind,
                last,
                expected.get(last).copied(),
                got.get(last).copied()
            );
        }
        return out;
    }
    // Walk the rest: each expected message is found unchanged (maybe elsewhere), changed in
    // place, or gone.
    let (mut i, mut j) = (same, same);
    let mut used = vec![false; got.len()];
    for u in used.iter_mut().take(same) {
        *u = true;
    }
    let mut last_calls = false;
    while i < expected.len() {
        let e = expected[i];
        if j < got.len() && e.same(got[j]) {
            used[j] = true;
            last_calls = !e.tool_calls.is_empty();
            i += 1;
            j += 1;
            continue;
        }
        // A system message inserted before it.
        if j < got.len()
            && matches!(got[j].role.as_str(), "system" | "developer")
            && !matches!(e.role.as_str(), "system" | "developer")
        {
            push!(RewriteKind::SystemInserted, j, None, Some(got[j]));
            used[j] = true;
            j += 1;
            continue;
        }
        // Moved: found unchanged at another place.
        if let Some(k) = (0..got.len()).find(|&k| !used[k] && k != j && e.same(got[k])) {
            let kind = if e.role == "tool" {
                RewriteKind::ToolResultMoved
            } else {
                RewriteKind::Reordered
            };
            push!(kind, k, Some(e), Some(got[k]));
            used[k] = true;
            i += 1;
            continue;
        }
        let Some(g) = got.get(j).copied() else {
            push!(RewriteKind::Removed, i, Some(e), None);
            i += 1;
            continue;
        };
        let kind = match (e.role.as_str(), g.role.as_str()) {
            ("assistant", "assistant") => RewriteKind::AssistantReserialized,
            ("tool", _) if contains_text(g, e) => RewriteKind::ToolResultRewrapped,
            (a, b) if a == b => RewriteKind::Edited,
            _ => RewriteKind::Other,
        };
        push!(kind, j, Some(e), Some(g));
        used[j] = true;
        last_calls = !e.tool_calls.is_empty()
            || (kind == RewriteKind::AssistantReserialized && calls_as_text(g));
        i += 1;
        j += 1;
    }
    // After an assistant turn with tool calls (sampled as such, or written into its text
    // when re-sent), their results should come as tool messages: one sent as a user message
    // is re-wrapped (smolagents' "Observation: ...").
    if last_calls
        && let Some(g) = got.get(j)
        && g.role == "user"
    {
        let tool = Msg {
            role: "tool".into(),
            text: "(the result of the tool call)".into(),
            ..Msg::default()
        };
        push!(RewriteKind::ToolResultRewrapped, j, Some(&tool), Some(g));
    }
    out
}

/// Whether an assistant message's text holds tool calls written as text: OpenAI tool-call
/// objects (`{'id': ..., 'type': 'function', 'function': {...}}`, as smolagents writes its
/// "Calling tools: [...]", whatever its agent sampled).
fn calls_as_text(m: &Msg) -> bool {
    m.text.contains("'type': 'function'") || m.text.contains("\"type\": \"function\"")
}

/// Whether `g`'s text holds `e`'s (a re-wrapped tool result), or shares a long stretch.
fn contains_text(g: &Msg, e: &Msg) -> bool {
    let (gt, et) = (g.text.trim(), e.text.trim());
    !et.is_empty() && (gt.contains(et) || et.lines().any(|l| l.len() >= 16 && gt.contains(l)))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn m(role: &str, text: &str) -> Msg {
        Msg {
            role: role.into(),
            text: text.into(),
            ..Msg::default()
        }
    }

    fn calls(text: &str, name: &str, args: &str) -> Msg {
        Msg {
            role: "assistant".into(),
            text: text.into(),
            tool_calls: vec![(name.into(), args.into())],
            ..Msg::default()
        }
    }

    #[test]
    fn smolagents_tool_calls_as_text_and_observation_as_user_are_named() {
        let prev = CallView {
            messages: vec![
                m("system", "You are an expert assistant"),
                m("user", "New task: list"),
            ],
            answer: Some(calls("", "python_interpreter", r#"{"code": "print(1)"}"#)),
            tools: vec![],
        };
        let next = CallView {
            messages: vec![
                m("system", "You are an expert assistant"),
                m("user", "New task: list"),
                m(
                    "assistant",
                    "Calling tools:\n[{'id': 'call_1', 'type': 'function', 'function': {'name': 'python_interpreter', 'arguments': {'code': 'print(1)'}}}]",
                ),
                m("user", "Observation:\n1"),
            ],
            answer: None,
            tools: vec![],
        };
        let r = rewrites(&prev, "c1", &next, "c2");
        let kinds: Vec<_> = r.iter().map(|r| r.kind).collect();
        assert_eq!(
            kinds,
            [
                RewriteKind::AssistantReserialized,
                RewriteKind::ToolResultRewrapped
            ]
        );
        assert_eq!(r[0].message, 2);
        assert!(r[0].before.starts_with("python_interpreter("), "{}", r[0]);
        assert!(r[0].after.starts_with("Calling tools:"), "{}", r[0]);
        assert_eq!(r[1].message, 3);
        assert!(r[1].after.starts_with("Observation:"), "{}", r[1]);
    }

    #[test]
    fn a_code_agents_text_turn_with_calling_tools_appended_and_its_observation_are_named() {
        let code = "Thought: write it.\n<code>\nprint(shell(command='echo x'))\n</code>";
        let prev = CallView {
            messages: vec![
                m("system", "You are an expert assistant"),
                m("user", "New task"),
            ],
            answer: Some(m("assistant", code)),
            tools: vec![],
        };
        let next = CallView {
            messages: vec![
                m("system", "You are an expert assistant"),
                m("user", "New task"),
                m(
                    "assistant",
                    &format!(
                        "{code}\nCalling tools:\n[{{'id': 'call_1', 'type': 'function', 'function': {{'name': 'python_interpreter', 'arguments': \"print(shell(command='echo x'))\"}}}}]"
                    ),
                ),
                m(
                    "user",
                    "Observation:\nExecution logs:\nx\nLast output from code snippet:\nNone",
                ),
            ],
            answer: None,
            tools: vec![],
        };
        let kinds: Vec<_> = rewrites(&prev, "a", &next, "b")
            .iter()
            .map(|r| r.kind)
            .collect();
        assert_eq!(
            kinds,
            [
                RewriteKind::AssistantReserialized,
                RewriteKind::ToolResultRewrapped
            ]
        );
    }

    #[test]
    fn a_context_message_moved_to_the_end_is_reordered() {
        let prev = CallView {
            messages: vec![m("system", "s"), m("user", "task"), m("user", "<context>")],
            answer: Some(calls("", "exec", "{}")),
            tools: vec![],
        };
        let mut tool = m("tool", "done");
        tool.tool_call_id = Some("c".into());
        let next = CallView {
            messages: vec![
                m("system", "s"),
                m("user", "task"),
                calls("", "exec", "{}"),
                tool,
                m("user", "<context>"),
            ],
            answer: None,
            tools: vec![],
        };
        let r = rewrites(&prev, "a", &next, "b");
        assert_eq!(r.len(), 1, "{r:?}");
        assert_eq!(r[0].kind, RewriteKind::Reordered);
        assert_eq!(r[0].message, 4);
        assert_eq!(r[0].before, "<context>");
    }

    #[test]
    fn unchanged_messages_are_a_rerender_or_dropped_thinking() {
        let mut answer = calls("", "exec", r#"{"a": 1}"#);
        let prev = CallView {
            messages: vec![m("user", "task")],
            answer: Some(answer.clone()),
            tools: vec![],
        };
        let next = CallView {
            messages: vec![
                m("user", "task"),
                calls("", "exec", r#"{ "a":1 }"#),
                m("tool", "x"),
            ],
            answer: None,
            tools: vec![],
        };
        let r = rewrites(&prev, "a", &next, "b");
        assert_eq!(
            r.iter().map(|r| r.kind).collect::<Vec<_>>(),
            [RewriteKind::Rerendered]
        );
        answer.reasoning = Some("think".into());
        let prev = CallView {
            answer: Some(answer),
            ..prev
        };
        let r = rewrites(&prev, "a", &next, "b");
        assert_eq!(
            r.iter().map(|r| r.kind).collect::<Vec<_>>(),
            [RewriteKind::ThinkingDropped]
        );
    }

    #[test]
    fn an_inserted_system_message_and_an_edited_one_are_named() {
        let prev = CallView {
            messages: vec![m("system", "date: monday"), m("user", "task")],
            answer: Some(m("assistant", "ok")),
            tools: vec![],
        };
        let next = CallView {
            messages: vec![
                m("system", "date: tuesday"),
                m("user", "task"),
                m("system", "reminder"),
                m("assistant", "ok"),
            ],
            answer: None,
            tools: vec![],
        };
        let r = rewrites(&prev, "a", &next, "b");
        let kinds: Vec<_> = r.iter().map(|r| r.kind).collect();
        assert_eq!(kinds, [RewriteKind::Edited, RewriteKind::SystemInserted]);
        assert_eq!(r[0].before, "date: monday");
        assert_eq!(r[0].after, "date: tuesday");
    }

    #[test]
    fn the_thread_name_is_the_first_line_the_main_thread_lacks() {
        let main = ThreadKey::new(
            "You are Claude Code.\nBe terse.".into(),
            vec!["Bash".into()],
        );
        let side = ThreadKey::new(
            "You are Claude Code.\nGenerate a concise title for the conversation.".into(),
            vec![],
        );
        assert_eq!(
            side.name(Some(&main)),
            "Generate a concise title for the conversation. (0 tools)"
        );
        assert_ne!(side.id, main.id);
        assert_eq!(main.id.len(), 12);
    }
}

//! Exact mode's token histories rebuilt from the records after a restart. A session's
//! recent calls are what its next prompt reuses verbatim (`graft_reconstruct::exact`); they
//! live in memory, so without this the first call of every open session after a restart
//! would be tokenized in full and could drift from what the policy sampled.
//!
//! On start the gateway reads its data dir once (sealed Parquet and WAL, through
//! `graft_recorder`'s readers, off the reactor) and keeps, for every session that is not
//! closed, its last answered chat calls made in exact mode: the conversation as the record
//! normalized it (rendered to template messages the same way a live call is), the tools,
//! the answer, and the prompt + completion ids. A session's first call after the start takes
//! them (and its backend pin, by the record's `upstream`).

use std::collections::{HashMap, HashSet};
use std::sync::Arc;

use graft_reconstruct::exact::{Turn, answer_message, template_messages};
use graft_recorder::CallRecord;
use serde_json::Value;

use crate::dialect::{Answer, Conversation};

/// One session's restored calls, most recent first, and the backend its calls went to.
pub(crate) struct Restored {
    pub(crate) backend: String,
    pub(crate) turns: Vec<Arc<Turn>>,
}

/// The turn a live call would have remembered, from its record; `None` for calls that are
/// not remembered (failed, abandoned, raw-prompt completions, other modes).
pub(crate) fn turn_of(rec: &CallRecord) -> Option<Turn> {
    if !rec.is_ok()
        || rec.upstream_dialect.as_deref() != Some(graft_recorder::wire::SGLANG_GENERATE)
    {
        return None;
    }
    let conv: Conversation = serde_json::from_value(rec.normalized_request.clone()?).ok()?;
    if conv.prompt.is_some() {
        return None;
    }
    let answer: Answer = serde_json::from_value(rec.normalized_response.clone()?).ok()?;
    let (chat_req, _) = crate::dialect::chat::to_request(&conv);
    let messages = template_messages(
        chat_req
            .get("messages")
            .and_then(Value::as_array)
            .map_or(&[][..], Vec::as_slice),
    );
    let tools: Option<Vec<Value>> = chat_req
        .get("tools")
        .and_then(Value::as_array)
        .filter(|t| !t.is_empty())
        .cloned();
    let calls: Vec<(String, String, String)> = answer
        .tool_calls
        .iter()
        .map(|t| (t.id.clone(), t.name.clone(), t.arguments.clone()))
        .collect();
    let mut tokens = rec.prompt_token_ids.clone()?;
    tokens.extend_from_slice(rec.completion_token_ids.as_deref()?);
    Some(Turn {
        messages,
        tools,
        answer: answer_message(&answer.text, answer.reasoning.as_deref(), &calls),
        tokens,
    })
}

/// The restored histories of the `open` sessions: each one's last `per_session` remembered
/// calls (records come in per-session sequence order).
pub(crate) fn histories(
    records: Vec<CallRecord>,
    open: &HashSet<String>,
    per_session: usize,
) -> HashMap<String, Restored> {
    let mut records = records;
    records.sort_by(|a, b| (&a.session_id, a.seq).cmp(&(&b.session_id, b.seq)));
    let mut out: HashMap<String, Restored> = HashMap::new();
    for rec in records {
        if !open.contains(&rec.session_id) {
            continue;
        }
        let Some(turn) = turn_of(&rec) else {
            continue;
        };
        let r = out
            .entry(rec.session_id.clone())
            .or_insert_with(|| Restored {
                backend: rec.upstream.clone(),
                turns: vec![],
            });
        r.backend = rec.upstream.clone();
        r.turns.insert(0, Arc::new(turn));
        r.turns.truncate(per_session);
    }
    out
}

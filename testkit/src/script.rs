//! The script file (rules tried in order, the first that matches answers) and what a rule
//! looks at in a request ([`Prompt`]).

use anyhow::Context as _;
use serde::Deserialize;
use serde_json::Value;

/// The deterministic logprob the scripted model reports for a token.
pub fn scripted_logprob(id: u32) -> f64 {
    -f64::from(id % 97) / 100.0
}

/// The script file: rules tried in order, the first that matches answers.
#[derive(Debug, Default, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Script {
    #[serde(default)]
    pub rules: Vec<Rule>,
}

/// One rule. Every condition that is set must hold; a rule with none always matches.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Rule {
    /// Substring of the text of the LAST message (chat) or of the prompt (completions).
    /// System messages after the last turn (Claude Code sends one) are skipped.
    #[serde(default, rename = "match")]
    pub pattern: Option<String>,
    /// Substring of the text of ANY message (chat) or of the prompt (completions), for
    /// harnesses whose last message is context of their own (OpenClaw appends one after the
    /// user's task).
    #[serde(default)]
    pub match_prompt: Option<String>,
    /// Role of the last message (`user`, `tool`, ...).
    #[serde(default)]
    pub role: Option<String>,
    /// Exact number of messages in the request.
    #[serde(default)]
    pub messages: Option<usize>,
    /// At least this many messages.
    #[serde(default)]
    pub min_messages: Option<usize>,
    /// At most this many messages.
    #[serde(default)]
    pub max_messages: Option<usize>,
    /// Whether the request offers tools (a non-empty `tools` array).
    #[serde(default)]
    pub tools: Option<bool>,
    /// The request's `model` field, exactly.
    #[serde(default)]
    pub model: Option<String>,
    #[serde(default)]
    pub reply: Reply,
    /// SGLang `/generate` only (it has no model field to pick faults by): fail instead of
    /// answering: `500`, `garbage`, `reset` (mid-stream), `hang`, `abort` (finish_reason
    /// abort).
    #[serde(default)]
    pub fault: Option<String>,
    /// SGLang `/generate` and vLLM `/v1/completions` with token ids: after this many output
    /// tokens the generation waits (up to a minute) until the weights change
    /// (`/update_weights_from_disk`, or vLLM's `/update_weight_version`, from an outside
    /// controller) and samples the rest with the new ones; the answer reports both spans
    /// (`meta_info.weight_versions`; vLLM: the last chunk's `weight_versions`).
    #[serde(default)]
    pub weight_update_after: Option<usize>,
    /// The first request this rule answers waits this long before its answer begins (a
    /// slow first attempt, for clients that time out and retry); later ones do not wait.
    #[serde(default)]
    pub first_delay_ms: Option<u64>,
    /// Whether the first delay was spent.
    #[serde(skip)]
    pub(crate) delayed: std::sync::Arc<std::sync::atomic::AtomicBool>,
    /// The first request this rule answers fails with this HTTP status (an error body in
    /// its wire's shape) before any answer; later ones answer (a failed first attempt, for
    /// clients that retry 5xx).
    #[serde(default)]
    pub first_status: Option<u16>,
    /// Whether the first failure was spent.
    #[serde(skip)]
    pub(crate) failed: std::sync::Arc<std::sync::atomic::AtomicBool>,
}

impl Rule {
    /// The wait before this answer: `first_delay_ms` for the rule's first request only.
    pub(crate) fn first_delay(&self) -> Option<std::time::Duration> {
        let ms = self.first_delay_ms?;
        (!self.delayed.swap(true, std::sync::atomic::Ordering::SeqCst))
            .then(|| std::time::Duration::from_millis(ms))
    }

    /// The status this request fails with: `first_status` for the rule's first request only
    /// (a status that is not a valid HTTP status is a 500).
    pub(crate) fn first_failure(&self) -> Option<http::StatusCode> {
        let status = self.first_status?;
        (!self.failed.swap(true, std::sync::atomic::Ordering::SeqCst)).then(|| {
            http::StatusCode::from_u16(status).unwrap_or(http::StatusCode::INTERNAL_SERVER_ERROR)
        })
    }
}

/// What the model says.
#[derive(Debug, Clone, Default, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct Reply {
    #[serde(default)]
    pub content: Option<String>,
    #[serde(default)]
    pub tool_calls: Vec<ScriptToolCall>,
    /// Overrides the finish reason (default: `tool_calls` when there are tool calls, else `stop`).
    #[serde(default)]
    pub finish_reason: Option<String>,
    /// Reasoning the model writes first, in `<think>` (SGLang `/generate` answers only).
    #[serde(default)]
    pub reasoning: Option<String>,
    /// The model's whole output verbatim, before its end-of-turn token: nothing is added
    /// (no think block, no call markup) and `content`, `reasoning` and `tool_calls` are not
    /// read. The token-id sides only (SGLang's `/generate`, vLLM's `/v1/completions`).
    #[serde(default)]
    pub raw: Option<String>,
}

#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct ScriptToolCall {
    pub name: String,
    /// A JSON object (serialized for the wire) or an already-serialized string.
    #[serde(default)]
    pub arguments: Value,
}

impl ScriptToolCall {
    pub(crate) fn arguments_string(&self) -> String {
        match &self.arguments {
            Value::String(s) => s.clone(),
            Value::Null => "{}".to_owned(),
            other => other.to_string(),
        }
    }
}

impl Script {
    pub fn load(path: &std::path::Path) -> anyhow::Result<Self> {
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("cannot read the script '{}'", path.display()))?;
        Self::parse(&text).with_context(|| format!("script '{}' is not valid", path.display()))
    }

    pub fn parse(text: &str) -> anyhow::Result<Self> {
        serde_json::from_str(text).context(
            r#"expected {"rules":[{"match":"substring","reply":{"content":"...","tool_calls":[{"name":"bash","arguments":{...}}]}}]}"#,
        )
    }

    /// The reply for a request, or `None` when no rule matches.
    pub(crate) fn reply_for(&self, req: &Prompt) -> Option<&Reply> {
        self.rule_for(req).map(|rule| &rule.reply)
    }

    /// The reply for a request; when no rule matches, an echo of the last user text
    /// ("You said: ...").
    pub(crate) fn reply_or_echo(&self, req: &Prompt) -> std::borrow::Cow<'_, Reply> {
        match self.reply_for(req) {
            Some(r) => std::borrow::Cow::Borrowed(r),
            None => std::borrow::Cow::Owned(Reply {
                content: Some(format!("You said: {}", req.last_user_text)),
                ..Reply::default()
            }),
        }
    }

    pub(crate) fn rule_for(&self, req: &Prompt) -> Option<&Rule> {
        self.rules.iter().find(|rule| rule.matches(req))
    }
}

impl Rule {
    pub(crate) fn matches(&self, req: &Prompt) -> bool {
        if let Some(p) = &self.pattern
            && !req.last_text.contains(p.as_str())
        {
            return false;
        }
        if let Some(p) = &self.match_prompt
            && !req.prompt_text.contains(p.as_str())
        {
            return false;
        }
        if let Some(role) = &self.role
            && req.last_role.as_deref() != Some(role.as_str())
        {
            return false;
        }
        if self.messages.is_some_and(|n| req.message_count != n)
            || self.min_messages.is_some_and(|n| req.message_count < n)
            || self.max_messages.is_some_and(|n| req.message_count > n)
            || self.tools.is_some_and(|t| req.has_tools != t)
        {
            return false;
        }
        if let Some(m) = &self.model
            && req.model != *m
        {
            return false;
        }
        true
    }
}

// ---------------------------------------------------------------------------------------
// Requests

/// What the script looks at in a request.
#[derive(Debug, Default)]
pub(crate) struct Prompt {
    pub(crate) model: String,
    pub(crate) stream: bool,
    pub(crate) include_usage: bool,
    /// Text of the last message (chat) or the prompt (completions).
    pub(crate) last_text: String,
    pub(crate) last_role: Option<String>,
    /// Text of the last user message (chat) or the prompt (completions), for the echo.
    pub(crate) last_user_text: String,
    pub(crate) message_count: usize,
    pub(crate) has_tools: bool,
    /// The text of every message (chat) or the prompt (completions), for `match_prompt`.
    pub(crate) prompt_text: String,
    /// Whitespace-separated words of the whole prompt (see [`count_words`]).
    pub(crate) prompt_words: u64,
}

/// The text of a message's `content`: a string, or a list of `{type: text, text}` parts.
pub(crate) fn content_text(content: Option<&Value>) -> String {
    match content {
        Some(Value::String(s)) => s.clone(),
        Some(Value::Array(parts)) => parts
            .iter()
            .filter_map(|p| match p {
                Value::String(s) => Some(s.as_str()),
                Value::Object(o) => o.get("text").and_then(Value::as_str),
                _ => None,
            })
            .collect::<Vec<_>>()
            .join("\n"),
        _ => String::new(),
    }
}

/// Usage numbers count whitespace-separated words. A real tokenizer arrives with a later
/// issue (reconstruct's tokenizer); until then, words are a stable, cheap stand-in.
pub(crate) fn count_words(text: &str) -> u64 {
    text.split_whitespace().count() as u64
}

impl Prompt {
    pub(crate) fn common(body: &Value) -> Self {
        Prompt {
            model: body
                .get("model")
                .and_then(Value::as_str)
                .unwrap_or_default()
                .to_owned(),
            stream: body.get("stream").and_then(Value::as_bool).unwrap_or(false),
            include_usage: body
                .pointer("/stream_options/include_usage")
                .and_then(Value::as_bool)
                .unwrap_or(false),
            has_tools: body
                .get("tools")
                .and_then(Value::as_array)
                .is_some_and(|t| !t.is_empty()),
            ..Prompt::default()
        }
    }

    pub(crate) fn from_chat(body: &Value) -> Result<Self, String> {
        let mut p = Self::common(body);
        let messages = body
            .get("messages")
            .and_then(Value::as_array)
            .ok_or_else(|| "'messages' must be an array of messages".to_owned())?;
        p.message_count = messages.len();
        let mut words = 0;
        for m in messages {
            let text = content_text(m.get("content"));
            words += count_words(&text);
            p.prompt_text.push_str(&text);
            p.prompt_text.push('\n');
            if let Some(calls) = m.get("tool_calls").and_then(Value::as_array) {
                for c in calls {
                    if let Some(a) = c.pointer("/function/arguments").and_then(Value::as_str) {
                        words += count_words(a);
                    }
                }
            }
        }
        p.prompt_words = words;
        // The last turn: system messages after it (Claude Code puts one after the user's
        // message) are instructions, not turns.
        let last = messages
            .iter()
            .rev()
            .find(|m| m.get("role").and_then(Value::as_str) != Some("system"))
            .or(messages.last());
        if let Some(last) = last {
            p.last_text = content_text(last.get("content"));
            p.last_role = last.get("role").and_then(Value::as_str).map(str::to_owned);
        }
        p.last_user_text = messages
            .iter()
            .rev()
            .find(|m| m.get("role").and_then(Value::as_str) == Some("user"))
            .map(|m| content_text(m.get("content")))
            .unwrap_or_default();
        Ok(p)
    }

    pub(crate) fn from_completions(body: &Value) -> Result<Self, String> {
        let mut p = Self::common(body);
        let prompt = match body.get("prompt") {
            Some(Value::String(s)) => s.clone(),
            Some(Value::Array(items)) => items
                .iter()
                .filter_map(Value::as_str)
                .collect::<Vec<_>>()
                .join("\n"),
            _ => return Err("'prompt' must be a string or an array of strings".to_owned()),
        };
        p.prompt_words = count_words(&prompt);
        p.prompt_text = prompt.clone();
        p.last_text = prompt.clone();
        p.last_user_text = prompt;
        Ok(p)
    }
}

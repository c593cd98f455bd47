//! Dialects: the wire formats harnesses speak (OpenAI Chat Completions, OpenAI Completions,
//! OpenAI Responses, Anthropic Messages). Each folder converts between its dialect and the one
//! internal conversation type here, so a client in any dialect can be served by an upstream
//! that speaks another (usually Chat Completions), streaming included.
//!
//! Every dialect has the same parts, one file each: `request` (dialect JSON → [`Conversation`],
//! errors name the field), `render` (an [`Answer`] → the dialect's whole response), `stream`
//! (a [`StreamEmitter`] turning [`Delta`]s into the dialect's SSE events), `assemble` (the
//! dialect's own relayed events → its whole response) and `tests`. The [`Dialect`] trait is the
//! one face the call pipeline sees; [`dialect`] is the one place a dialect is chosen.

pub mod anthropic;
pub mod chat;
pub mod completions;
pub(crate) mod json;
pub mod responses;

#[cfg(test)]
mod tests;

use bytes::Bytes;
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

use crate::error::GatewayError;

/// The wire format of a request or an upstream.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum DialectKind {
    ChatCompletions,
    /// OpenAI's legacy Completions (`/v1/completions`): a raw prompt, no messages.
    Completions,
    Responses,
    AnthropicMessages,
}

impl DialectKind {
    pub fn label(self) -> &'static str {
        match self {
            DialectKind::ChatCompletions => "chat_completions",
            DialectKind::Completions => "completions",
            DialectKind::Responses => "responses",
            DialectKind::AnthropicMessages => "anthropic_messages",
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Role {
    System,
    Developer,
    User,
    Assistant,
    Tool,
}

/// One piece of message content.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum Part {
    Text {
        text: String,
    },
    /// An image by URL (`data:` URLs included).
    Image {
        url: String,
    },
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ToolCall {
    pub id: String,
    pub name: String,
    /// The arguments as the model wrote them: a JSON text, kept byte for byte.
    pub arguments: String,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Message {
    pub role: Role,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub content: Vec<Part>,
    /// Assistant reasoning (`reasoning_content`, Responses reasoning items, Anthropic thinking).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reasoning: Option<String>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tool_calls: Vec<ToolCall>,
    /// For `Role::Tool`: the call this is the result of.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_call_id: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
}

impl Message {
    pub fn text(role: Role, text: impl Into<String>) -> Self {
        Message {
            role,
            content: vec![Part::Text { text: text.into() }],
            reasoning: None,
            tool_calls: vec![],
            tool_call_id: None,
            name: None,
        }
    }

    /// All text parts joined.
    pub fn joined_text(&self) -> String {
        let mut s = String::new();
        for p in &self.content {
            if let Part::Text { text } = p {
                s.push_str(text);
            }
        }
        s
    }
}

/// A function tool the model may call.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Tool {
    pub name: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub description: Option<String>,
    /// JSON Schema of the arguments.
    pub parameters: Value,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub strict: Option<bool>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ToolChoice {
    Auto,
    None,
    Required,
    Function { name: String },
}

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Sampling {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub temperature: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub top_p: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub top_k: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_tokens: Option<u64>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub stop: Vec<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub seed: Option<i64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub presence_penalty: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub frequency_penalty: Option<f64>,
    /// vLLM's and SGLang's `min_p` (an extension of the OpenAI wire).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub min_p: Option<f64>,
    /// vLLM's and SGLang's `repetition_penalty` (an extension of the OpenAI wire).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub repetition_penalty: Option<f64>,
    /// OpenAI's `logit_bias`: token id (as a string) → bias.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub logit_bias: Option<Map<String, Value>>,
    /// Structured output: Chat `response_format`, Responses `text.format`, Anthropic
    /// `output_config.format`; the backend constrains the decode to it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub format: Option<OutputFormat>,
}

impl Sampling {
    /// The first value the backend would refuse, as SGLang's `SamplingParams.verify` and
    /// vLLM's `SamplingParams._verify_args` refuse them (the same ranges, but SGLang also
    /// caps `repetition_penalty` at 2: `sglang`): its key and why. Exact mode refuses such
    /// a call by name before the backend sees it.
    pub fn out_of_range(&self, sglang: bool) -> Option<(&'static str, String)> {
        let finite = |v: f64| v.is_finite();
        if let Some(t) = self.temperature
            && (!finite(t) || t < 0.0)
        {
            return Some((
                "temperature",
                format!("must be a finite number >= 0 (0: greedy), got {t}"),
            ));
        }
        if let Some(p) = self.top_p
            && !(p > 0.0 && p <= 1.0)
        {
            return Some(("top_p", format!("must be in (0, 1], got {p}")));
        }
        if let Some(p) = self.min_p
            && !(0.0..=1.0).contains(&p)
        {
            return Some(("min_p", format!("must be in [0, 1], got {p}")));
        }
        for (key, v) in [
            ("presence_penalty", self.presence_penalty),
            ("frequency_penalty", self.frequency_penalty),
        ] {
            if let Some(v) = v
                && !(-2.0..=2.0).contains(&v)
            {
                return Some((key, format!("must be in [-2, 2], got {v}")));
            }
        }
        if let Some(r) = self.repetition_penalty {
            if sglang && !(r > 0.0 && r <= 2.0) {
                return Some(("repetition_penalty", format!("must be in (0, 2], got {r}")));
            }
            if !(r > 0.0 && r.is_finite()) {
                return Some(("repetition_penalty", format!("must be > 0, got {r}")));
            }
        }
        None
    }
}

/// A structured-output constraint: the answer is any JSON object, or JSON that matches a
/// schema. SGLang's chat server turns both into its `json_schema` sampling parameter
/// (`{"type": "object"}` for the first; `ChatCompletionRequest.to_sampling_params` in
/// `sglang/srt/entrypoints/openai/protocol.py`), vLLM's into `structured_outputs`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum OutputFormat {
    JsonObject,
    JsonSchema {
        schema: Value,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        name: Option<String>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        strict: Option<bool>,
    },
}

impl OutputFormat {
    /// An OpenAI format object at `field`: `{"type": "text"}` (or absent, null) is none;
    /// `{"type": "json_object"}`; `{"type": "json_schema", ...}` with the schema, name and
    /// strict under `json_schema` (Chat, `nested`) or beside `type` (Responses).
    pub(crate) fn from_openai(
        v: Option<&Value>,
        field: &str,
        nested: bool,
    ) -> Result<Option<OutputFormat>, GatewayError> {
        let obj = match v {
            None | Some(Value::Null) => return Ok(None),
            Some(Value::Object(o)) => o,
            Some(other) => {
                return Err(GatewayError::field(
                    field,
                    format!("'{field}' must be an object, got {}", kind(other)),
                ));
            }
        };
        match obj.get("type").and_then(Value::as_str) {
            Some("text") => Ok(None),
            Some("json_object") => Ok(Some(OutputFormat::JsonObject)),
            Some("json_schema") => {
                let (inner, at) = if nested {
                    match obj.get("json_schema") {
                        Some(Value::Object(o)) => (o, format!("{field}.json_schema")),
                        _ => {
                            return Err(GatewayError::field(
                                field,
                                format!(
                                    "'{field}.json_schema' must be an object holding the schema when '{field}.type' is \"json_schema\""
                                ),
                            ));
                        }
                    }
                } else {
                    (obj, field.to_string())
                };
                let schema = match inner.get("schema") {
                    Some(s @ (Value::Object(_) | Value::Bool(_))) => s.clone(),
                    _ => {
                        return Err(GatewayError::field(
                            field,
                            format!(
                                "'{at}.schema' must be a JSON schema (an object) when '{field}.type' is \"json_schema\""
                            ),
                        ));
                    }
                };
                Ok(Some(OutputFormat::JsonSchema {
                    schema,
                    name: inner
                        .get("name")
                        .and_then(Value::as_str)
                        .map(str::to_string),
                    strict: inner.get("strict").and_then(Value::as_bool),
                }))
            }
            other => Err(GatewayError::field(
                field,
                format!(
                    "'{field}.type' must be \"text\", \"json_object\" or \"json_schema\", got {}",
                    other.map_or_else(|| "nothing".to_string(), |t| format!("{t:?}"))
                ),
            )),
        }
    }

    /// The schema the decode is constrained to (`{"type": "object"}` for any object).
    pub fn schema(&self) -> Value {
        match self {
            OutputFormat::JsonObject => serde_json::json!({"type": "object"}),
            OutputFormat::JsonSchema { schema, .. } => schema.clone(),
        }
    }

    /// As Chat's `response_format`.
    pub fn to_chat(&self) -> Value {
        match self {
            OutputFormat::JsonObject => serde_json::json!({"type": "json_object"}),
            OutputFormat::JsonSchema {
                schema,
                name,
                strict,
            } => {
                let mut js = serde_json::json!({
                    "name": name.clone().unwrap_or_else(|| "response".into()),
                    "schema": schema,
                });
                if let Some(s) = strict {
                    js["strict"] = Value::Bool(*s);
                }
                serde_json::json!({"type": "json_schema", "json_schema": js})
            }
        }
    }
}

/// OpenAI's `logit_bias` (`{"token id": bias}`), checked: an object of numbers. `None` when
/// absent or `null`.
pub(crate) fn logit_bias_of(v: Option<&Value>) -> Result<Option<Map<String, Value>>, GatewayError> {
    match v {
        None | Some(Value::Null) => Ok(None),
        Some(Value::Object(m)) => {
            if let Some((k, b)) = m.iter().find(|(_, b)| b.as_f64().is_none()) {
                return Err(GatewayError::field(
                    format!("logit_bias.{k}"),
                    format!("'logit_bias.{k}' must be a number, got {}", kind(b)),
                ));
            }
            Ok(Some(m.clone()))
        }
        Some(v) => Err(GatewayError::field(
            "logit_bias",
            format!(
                "'logit_bias' must be an object of token id → bias, got {}",
                kind(v)
            ),
        )),
    }
}

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Reasoning {
    /// OpenAI's `effort` ("minimal", "low", "medium", "high").
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub effort: Option<String>,
    /// Anthropic's thinking budget.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub budget_tokens: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub summary: Option<String>,
}

/// One request, whatever dialect it came in.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Conversation {
    pub model: String,
    pub messages: Vec<Message>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tools: Vec<Tool>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_choice: Option<ToolChoice>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub parallel_tool_calls: Option<bool>,
    #[serde(default)]
    pub sampling: Sampling,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reasoning: Option<Reasoning>,
    pub stream: bool,
    /// Fields of the client's request that no other dialect has (kept for the record and for
    /// echoing back, e.g. Responses' `metadata`, `prompt_cache_key`, `store`).
    #[serde(default, skip_serializing_if = "Map::is_empty")]
    pub extra: Map<String, Value>,
    /// What was dropped or mapped on the way in, and why (never silent).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub notes: Vec<String>,
    /// Chat Completions (and Completions) `stream_options.include_usage`: the stream ends with
    /// a usage chunk.
    #[serde(default, skip_serializing_if = "is_false")]
    pub include_usage: bool,
    /// A Completions request's raw prompt (such a conversation has no messages).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prompt: Option<RawPrompt>,
    /// The sampled tokens' logprobs were asked for (Chat `logprobs: true`, Completions
    /// `logprobs: n`), with this many most likely alternatives per token (Chat
    /// `top_logprobs`, Completions' `n`). Exact mode answers them.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub logprobs: Option<u32>,
    /// Whose chat endpoint a Chat Completions answer to this request imitates (exact mode sets
    /// its backend's); not part of the request, so not recorded with it.
    #[serde(skip)]
    pub shape: AnswerShape,
}

/// The shape of a Chat Completions answer: the model servers' own chat endpoints differ from
/// OpenAI's, and exact mode answers as its backend's endpoint would.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum AnswerShape {
    /// OpenAI's: `content` null when the message is only tool calls; reasoning in
    /// `reasoning_content` (as DeepSeek's API and SGLang name it).
    #[default]
    OpenAi,
    /// SGLang 0.5's `serving_chat.py`: `content` always a string (`""` when empty: "content
    /// should not be None but empty string to make sure retokenize consistency"); reasoning
    /// in `reasoning_content`.
    Sglang,
    /// vLLM 0.34's (`ChatMessage`, `assemble_chat_message_fields`): `content` null when the
    /// parser left none, `""` at least when the request forces a call (`required` or a named
    /// function); reasoning in `reasoning`, streamed too.
    Vllm,
}

impl AnswerShape {
    /// The key of the message's (and a streamed delta's) reasoning.
    pub fn reasoning_key(self) -> &'static str {
        match self {
            Self::OpenAi | Self::Sglang => "reasoning_content",
            Self::Vllm => "reasoning",
        }
    }
}

/// The prompt of a Completions request, as the client sent it: text (a string or a one-element
/// array of strings) or token ids (an array of ids, or a one-element array of such arrays).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RawPrompt {
    Text(String),
    Tokens(Vec<u32>),
}

fn is_false(b: &bool) -> bool {
    !*b
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Finish {
    Stop,
    Length,
    ToolCalls,
    ContentFilter,
    /// The stream or call ended with an error.
    Error,
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct TokenUsage {
    pub input_tokens: u64,
    pub output_tokens: u64,
    #[serde(default)]
    pub cached_tokens: u64,
    #[serde(default)]
    pub reasoning_tokens: u64,
}

/// A whole answer from the model.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Answer {
    /// The upstream's response id.
    pub id: String,
    pub model: String,
    pub created: i64,
    pub text: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reasoning: Option<String>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tool_calls: Vec<ToolCall>,
    pub finish: Finish,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub usage: Option<TokenUsage>,
    /// The sampled tokens' logprobs, when the client asked for them (exact mode). Not part
    /// of the normalized answer a record keeps: the record has them as
    /// `completion_logprobs`.
    #[serde(skip)]
    pub logprobs: Option<Vec<TokenLogprob>>,
}

/// One sampled token as a client that asked for logprobs gets it.
#[derive(Debug, Clone, PartialEq)]
pub struct TokenLogprob {
    /// The token's text (the id decoded alone).
    pub token: String,
    /// `None` where the backend sent none (answered as null).
    pub logprob: Option<f32>,
    /// The most likely tokens at this position, `(text, logprob)`, most likely first.
    pub top: Vec<(String, Option<f32>)>,
    /// Where the token starts in the answer's text, in characters (Completions'
    /// `text_offset`).
    pub offset: usize,
}

/// One streamed piece of an answer, in arrival order. Tool calls are numbered by `index`
/// (the order they started in); `ToolCallStart` always precedes that call's arguments.
#[derive(Debug, Clone, PartialEq)]
pub enum Delta {
    Text(String),
    Reasoning(String),
    ToolCallStart {
        index: usize,
        id: String,
        name: String,
    },
    ToolCallArgs {
        index: usize,
        arguments: String,
    },
    /// The logprobs of the tokens sampled since the last one (only when the client asked:
    /// Chat and Completions answer them, the other dialects have no place for them).
    Logprobs(Vec<TokenLogprob>),
}

/// OpenAI's logprob value: a number, or JSON null where unknown (never a made-up 0).
pub(crate) fn logprob_value(l: Option<f32>) -> Value {
    l.map_or(Value::Null, |x| Value::from(f64::from(x)))
}

/// Chat's `logprobs` object: `{"content": [{token, logprob, bytes, top_logprobs}]}`.
pub(crate) fn chat_logprobs(tokens: &[TokenLogprob]) -> Value {
    serde_json::json!({"content": logprob_items(tokens), "refusal": null})
}

/// One `{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}` per token: Chat's
/// `logprobs.content` and Responses' `output_text.logprobs` alike.
pub(crate) fn logprob_items(tokens: &[TokenLogprob]) -> Vec<Value> {
    let entry = |t: &str, l: Option<f32>| serde_json::json!({"token": t, "logprob": logprob_value(l), "bytes": t.as_bytes()});
    tokens
        .iter()
        .map(|t| {
            let mut e = entry(&t.token, t.logprob);
            e["top_logprobs"] = t.top.iter().map(|(s, l)| entry(s, *l)).collect();
            e
        })
        .collect()
}

/// Completions' `logprobs` object: `{tokens, token_logprobs, top_logprobs, text_offset}`.
pub(crate) fn completions_logprobs(tokens: &[TokenLogprob], top: bool) -> Value {
    serde_json::json!({
        "tokens": tokens.iter().map(|t| t.token.clone()).collect::<Vec<_>>(),
        "token_logprobs": tokens.iter().map(|t| logprob_value(t.logprob)).collect::<Vec<_>>(),
        "top_logprobs": if top {
            tokens
                .iter()
                .map(|t| {
                    t.top
                        .iter()
                        .map(|(s, l)| (s.clone(), logprob_value(*l)))
                        .collect::<Map<String, Value>>()
                        .into()
                })
                .collect::<Vec<Value>>()
        } else {
            tokens.iter().map(|_| Value::Null).collect()
        },
        "text_offset": tokens.iter().map(|t| t.offset).collect::<Vec<_>>(),
    })
}

/// Turns deltas into one dialect's SSE events. `start` is called once before the first
/// delta, `push` per delta, and `finish` once with the assembled answer (its finish reason
/// and usage), which must close every open block/item and end the response.
pub trait StreamEmitter: Send {
    fn start(&mut self) -> Vec<Bytes>;
    fn push(&mut self, delta: &Delta) -> Vec<Bytes>;
    fn finish(&mut self, answer: &Answer) -> Vec<Bytes>;
}

/// The lifecycle the named-event emitters (Responses, Anthropic) share: their opening events
/// go out once, before any other, and nothing goes out once the stream has ended (finished
/// or failed). Implementing it gives the [`StreamEmitter`], with those guards.
pub trait EventStream: Send {
    /// Whether the stream has ended.
    fn ended(&self) -> bool;
    /// The opening events, the first time it is called; nothing after that.
    fn open(&mut self, out: &mut Vec<Bytes>);
    /// One delta's events.
    fn delta(&mut self, delta: &Delta, out: &mut Vec<Bytes>);
    /// The closing events for the assembled answer; the stream has ended after it.
    fn close(&mut self, answer: &Answer, out: &mut Vec<Bytes>);

    /// Runs `step` after the opening events, unless the stream has ended.
    fn step(&mut self, step: impl FnOnce(&mut Self, &mut Vec<Bytes>)) -> Vec<Bytes>
    where
        Self: Sized,
    {
        let mut out = Vec::new();
        if !self.ended() {
            self.open(&mut out);
            step(self, &mut out);
        }
        out
    }
}

impl<T: EventStream> StreamEmitter for T {
    fn start(&mut self) -> Vec<Bytes> {
        self.step(|_, _| {})
    }

    fn push(&mut self, delta: &Delta) -> Vec<Bytes> {
        self.step(|s, out| s.delta(delta, out))
    }

    fn finish(&mut self, answer: &Answer) -> Vec<Bytes> {
        self.step(|s, out| s.close(answer, out))
    }
}

/// How a JSON value's type reads in an error message ("a string", "an array"...).
pub fn kind(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

/// Formats one SSE event with an `event:` line (Responses and Anthropic both name events).
pub fn sse_named(event: &str, data: &Value) -> Bytes {
    Bytes::from(format!("event: {event}\ndata: {data}\n\n"))
}

/// A fresh id with a dialect's prefix (`resp_`, `msg_`, `fc_`, `toolu_`...).
pub fn new_id(prefix: &str) -> String {
    format!("{prefix}{}", uuid::Uuid::now_v7().simple())
}

/// One wire format clients speak. A fourth dialect = one folder + one `DialectKind` arm.
pub trait Dialect: Send + Sync {
    fn kind(&self) -> DialectKind;
    /// The shape checks made on every call of this dialect before anything else, whatever
    /// the leg: passthrough relays Chat and Completions bodies without parsing them, so what
    /// would make the upstream fail in its own words is refused here in graft's. Default:
    /// none ([`Dialect::parse`] checks field by field).
    fn check(&self, _body: &Map<String, Value>) -> Result<(), GatewayError> {
        Ok(())
    }
    /// Whether an OpenAI-compatible upstream speaks this dialect itself, so a passthrough
    /// sends its bodies as they are (Chat, Completions); otherwise they are parsed and
    /// translated.
    fn upstream_speaks(&self) -> bool {
        false
    }
    /// Validates a request body (already known to be a JSON object with a string `model`)
    /// and converts it into the internal conversation; errors name the JSON path.
    fn parse(&self, body: &Value) -> Result<Conversation, GatewayError>;
    /// A whole answer in this dialect (`id` = the response id graft gives it).
    fn render(&self, conv: &Conversation, answer: &Answer, id: &str) -> Value;
    /// The stream emitter for one answer.
    fn emitter(&self, conv: &Conversation, id: &str, created: i64) -> Box<dyn StreamEmitter>;
    /// Rebuilds a whole answer (this dialect's JSON) from its own relayed SSE events (the
    /// passthrough tee).
    fn assembler(&self) -> Box<dyn StreamAssembler>;
    /// The error body of a refused call: OpenAI's `{"error": {...}}` unless the dialect has
    /// its own shape.
    fn error_body(&self, e: &GatewayError) -> Value {
        e.body()
    }
    /// The SSE event that ends a failed stream: OpenAI's error chunk unless the dialect has
    /// its own event.
    fn error_event(&self, e: &GatewayError, _response_id: &str) -> Bytes {
        e.sse_event()
    }
    /// Prefix of the response ids graft makes (`chatcmpl-`, `resp_`, `msg_`, `cmpl-`).
    fn id_prefix(&self) -> &'static str;
    /// How the answer's end reads to this dialect's client, the words a passthrough record
    /// keeps (what [`StreamAssembler::finish_reason`] reads from the relayed answer): Chat's
    /// `finish_reason`, Anthropic's `stop_reason`, Responses' `status`.
    fn finish_reason(&self, answer: &Answer) -> &'static str;
}

/// Rebuilds one dialect's whole response from the events of a stream relayed in that dialect.
pub trait StreamAssembler: Send {
    /// Adds one event's parsed `data:` JSON.
    fn push(&mut self, event: &Value);
    /// Whether this relayed event is the stream's last word (the pipeline holds it back until
    /// the record is durable).
    fn is_terminal(&self, ev: &crate::sse::Event, parsed: Option<&Value>) -> bool;
    /// The assembled answer (None when nothing was assembled).
    fn finish(&self) -> Option<Value>;
    /// The finish reason to record, in the dialect's own words; `response` is what
    /// [`StreamAssembler::finish`] returned.
    fn finish_reason(&self, response: Option<&Value>) -> Option<String>;
}

/// The one place a dialect is chosen.
pub fn dialect(kind: DialectKind) -> &'static dyn Dialect {
    match kind {
        DialectKind::ChatCompletions => &chat::Chat,
        DialectKind::Completions => &completions::Completions,
        DialectKind::Responses => &responses::Responses,
        DialectKind::AnthropicMessages => &anthropic::Anthropic,
    }
}

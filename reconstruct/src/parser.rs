//! Parse a model's decoded output back into text, reasoning and tool calls, streaming.
//!
//! [`OutputParser`] is a small state machine fed decoded text in chunks of any size (a chunk
//! may end in the middle of a tag such as `<tool_` … `call>`). It returns only [`Piece`]s that
//! are certain; anything that might still turn into a tag, or whitespace whose fate depends on
//! what follows, is held back until it is decided or [`OutputParser::finish`] is called. The
//! result never depends on how the text was chunked: the concatenated pieces of any chunking
//! equal [`parse_whole`] of the whole text (a property test checks this).
//!
//! # Formats
//! - Reasoning [`ReasoningFormat::Think`]: `<think>…</think>`. `<think>` opens reasoning only
//!   when nothing but whitespace came before it and no reasoning block was seen yet. A parser
//!   that starts inside reasoning (`starts_in_reasoning`: the prompt opened the block, or the
//!   request's [`crate::parse_rule::ParseRule`] forces reasoning as SGLang's `force_reasoning`
//!   does) drops a leading `<think>` the model writes anyway, then looks only for the end.
//!   Reasoning ends at `</think>` or at `<tool_call>`, whichever comes first: SGLang's
//!   `Qwen3Detector` (`srt/parser/reasoning_parser.py`, `tool_start_token`) treats a
//!   `<tool_call>` before `</think>` as the implicit end of reasoning, and the call (or, when
//!   the request parses no calls, its text) is the answer. SGLang's whole-text path does this
//!   only when no `</think>` follows anywhere; its streaming path, like graft, cannot look
//!   ahead. Only one reasoning block per output; a later `<think>` is text. A stray
//!   `</think>` outside reasoning is text too (the output is not reclassified after the fact,
//!   which streaming cannot do).
//! - Tool calls [`ToolCallFormat::Hermes`] (Qwen2.5/Qwen3):
//!   `<tool_call>\n{"name": …, "arguments": {…}}\n</tool_call>`; `arguments` may be an object,
//!   a string holding a JSON object, or absent (`{}`); `parameters` is accepted as a synonym.
//! - Tool calls [`ToolCallFormat::Qwen3Coder`]:
//!   `<tool_call>\n<function=NAME>\n<parameter=P>\nVALUE\n</parameter>\n…</function>\n</tool_call>`.
//!   One leading and one trailing `\n` of VALUE are removed (as vLLM and SGLang do). Values are
//!   typed by the tool's JSON schema when [`OutputParser::with_schemas`] knows the function,
//!   following vLLM's `_convert_param_value`: string types stay strings, integer/number/boolean
//!   /object/array are converted and fall back to the raw string when they do not parse,
//!   `null`/`None` becomes null for non-string or nullable types, a parameter missing from the
//!   schema stays a string. Differences from vLLM: no Python `ast.literal_eval` fallback, and a
//!   non-boolean value of a boolean parameter stays a string instead of becoming `false`.
//!   Without a schema for the function (vLLM and SGLang keep strings there), a heuristic is
//!   used: a value that parses as JSON and is not a JSON string (number, boolean, null, object,
//!   array) keeps its type, anything else is the raw string.
//!   Each format falls back to the other's body syntax when its own fails to parse (Qwen3-Coder
//!   models sometimes emit the JSON form and vice versa).
//!
//! - Tool calls [`ToolCallFormat::Llama3`] (Llama 3.1/3.2 JSON tool calling; SGLang's `llama3`
//!   parser, `Llama32Detector`, vLLM's `llama3_json`): the calls are everything after
//!   `<|python_tag|>` (a special token: the gateway keeps it in the decoded text when the
//!   request parses calls, as both servers decode with `skip_special_tokens=False` then), or
//!   the whole output when it starts with `{` (Llama 3.2 writes bare JSON). They are JSON
//!   objects `{"name": …, "parameters": {…}}` (`arguments` accepted) separated by `;`,
//!   read when the output ends, as SGLang's `detect_and_parse` reads them (`raw_decode` one
//!   object after another; after one that does not parse, the next `{"name":`). Text after
//!   the last object is content. An object that is not a call (no name, an undeclared
//!   function) is content with a note, where SGLang drops it.
//!
//! A tool call is emitted whole ([`Piece::ToolCallStart`] then one [`Piece::ToolCallArgs`]
//! with the complete JSON object) when its `</tool_call>` arrives: arguments are never
//! streamed partially, so a call that turns out malformed never has to be retracted. The
//! arguments are written as both servers write them whole: Python's `json.dumps(args,
//! ensure_ascii=False)` (`{"city": "Paris"}`), so a client sees the same string.
//!
//! # Whitespace
//! Chosen so that feeding the parsed message back through the Qwen3 chat templates reproduces
//! the output (the templates strip the same whitespace when they render history):
//! - reasoning: leading and trailing `\n` are removed (Qwen3's template renders
//!   `<think>\n` + reasoning.strip("\n") + `\n</think>\n\n`);
//! - text right after `</think>`: leading `\n` are removed (the template does
//!   `content.lstrip("\n")`; HF's Qwen3 model card does `.strip("\n")`). SGLang's and vLLM's
//!   current qwen3 reasoning parsers return the content raw, `"\n\n"` included;
//! - text right before a tool call: trailing whitespace is removed (the templates insert
//!   `\n` (Qwen3) or `\n\n` (Qwen3-Coder) there; SGLang strips the text before a call too);
//! - text right after a tool call: leading whitespace is removed (the `\n` between parallel
//!   calls, and after the last one);
//! - other text, including trailing whitespace at the end of the output, is kept verbatim.
//!
//! # Errors
//! Nothing is lost: a tool call whose body does not parse is emitted as text, tags included,
//! and a note explains why. At [`OutputParser::finish`], an unterminated `<tool_call>` (no
//! `</tool_call>`, e.g. cut by `max_tokens`) is accepted as a call when its body is complete
//! (Hermes: the JSON parses; Qwen3-Coder: `</function>` was seen), as vLLM's parsers do, with
//! a note; otherwise it is emitted as text with a note. Unterminated reasoning stays reasoning.

use std::collections::HashMap;

use serde_json::{Map, Value};

use crate::vllm_engine::{EngineRequest, Out as EngineOut, VllmEngine};

const THINK_OPEN: &str = "<think>";
const THINK_CLOSE: &str = "</think>";
const TOOL_OPEN: &str = "<tool_call>";
const TOOL_CLOSE: &str = "</tool_call>";
const FUNCTION_OPEN: &str = "<function=";
const FUNCTION_CLOSE: &str = "</function>";
const PARAM_OPEN: &str = "<parameter=";
const PARAM_CLOSE: &str = "</parameter>";
const PYTHON_TAG: &str = "<|python_tag|>";

/// How a model writes tool calls.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Deserialize, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum ToolCallFormat {
    /// Qwen2.5/Qwen3: `<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>`.
    Hermes,
    /// Qwen3-Coder: `<tool_call>\n<function=NAME>\n<parameter=P>\nVALUE\n</parameter>\n...
    /// </function>\n</tool_call>`.
    Qwen3Coder,
    /// Llama 3.1/3.2: `<|python_tag|>` or a bare `{` at the output's start, then `{"name": ...,
    /// "parameters": {...}}` objects separated by `;` (SGLang's `llama3`, vLLM's
    /// `llama3_json`).
    Llama3,
    /// No tool calls: `<tool_call>` is plain text.
    None,
}

/// How a model writes reasoning.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Deserialize, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum ReasoningFormat {
    /// `<think>...</think>`; Qwen3 may start inside an open `<think>` when the prompt ends
    /// with `"<think>\n"`.
    Think,
    /// No reasoning: `<think>` is plain text.
    None,
}

/// A certain part of the output, in order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Piece {
    /// Visible text (adjacent `Text` pieces concatenate).
    Text(String),
    /// Reasoning text (adjacent `Reasoning` pieces concatenate).
    Reasoning(String),
    /// A tool call begins; always followed by its [`Piece::ToolCallArgs`].
    ToolCallStart {
        index: usize,
        id: String,
        name: String,
    },
    /// Arguments of the call `index`: the whole JSON object text (Python `json.dumps` form), sent once.
    ToolCallArgs { index: usize, arguments: String },
}

/// One parsed tool call.
#[derive(Debug, Clone, PartialEq, Eq, Default, serde::Deserialize, serde::Serialize)]
pub struct ParsedToolCall {
    pub id: String,
    pub name: String,
    /// JSON object text, as Python's `json.dumps(args, ensure_ascii=False)` writes it.
    pub arguments: String,
}

/// Everything parsed so far.
#[derive(Debug, Clone, PartialEq, Eq, Default, serde::Deserialize, serde::Serialize)]
pub struct Parsed {
    pub text: String,
    /// `None` when there was no reasoning, or it was empty.
    pub reasoning: Option<String>,
    pub tool_calls: Vec<ParsedToolCall>,
    /// Human-readable notes about malformed or truncated parts.
    pub notes: Vec<String>,
}

/// Calls a request forces the way vLLM's chat server reads them (`_extract_tool_calls` in
/// `vllm/parser/abstract_parser.py`, 0.34): the decode was constrained to JSON, so the answer
/// (after any reasoning) is not parsed for tool-call markup but read as a whole at the end,
/// and it is never content.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ForcedCalls {
    /// A named function: the whole answer is its arguments (no call when it is blank).
    Named(String),
    /// `required`: the answer is a JSON list of `{"name", "parameters"}` (vLLM's
    /// `TypeAdapter(list[FunctionDefinition])`; any element that does not fit and there is no
    /// call at all), each call's arguments its `parameters` as Python's `json.dumps` writes
    /// them.
    Required,
}

/// The message vLLM's chat server makes of a Hermes output (`--tool-call-parser hermes`,
/// `vllm/tool_parsers/hermes_tool_parser.py`, 0.34), whose whole and streamed paths differ.
/// Both: the content is the text before the first `<tool_call>`, calls to undeclared
/// functions are calls, text between and after the calls is not in the message.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum VllmHermes {
    /// `extract_tool_calls`: every `<tool_call>` region (to `</tool_call>` or the end) must be
    /// a JSON object with a string `name` and an `arguments` key (`parameters` is not read),
    /// or nothing is a call and the whole answer is content; arguments are
    /// `json.dumps(arguments)`.
    Whole,
    /// `extract_tool_calls_streaming`: each region's name is the first `"name": "…"` in it
    /// (a region without one ends the calls), its arguments the raw text after
    /// `"arguments":` (without the object's closing `}` once the region is complete), as the
    /// client accumulates them; nothing is reclassified.
    Streamed,
}

/// Which characters a [`Lane`] trims.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Trim {
    Nothing,
    Newlines,
    Whitespace,
}

impl Trim {
    fn matches(self, c: char) -> bool {
        match self {
            Trim::Nothing => false,
            Trim::Newlines => c == '\n',
            Trim::Whitespace => c.is_whitespace(),
        }
    }
}

/// A stream of text (visible or reasoning) that drops leading characters of kind `lead` and
/// holds back a trailing run of `hold` characters until it knows what follows them.
#[derive(Debug, Clone)]
struct Lane {
    lead: Trim,
    hold: Trim,
    pending: String,
}

impl Lane {
    fn new(lead: Trim, hold: Trim) -> Self {
        Self {
            lead,
            hold,
            pending: String::new(),
        }
    }

    /// Feeds a segment; returns the part that is now certain.
    fn feed(&mut self, seg: &str) -> String {
        let lead = self.lead;
        let seg = if lead == Trim::Nothing {
            seg
        } else {
            let rest = seg.trim_start_matches(|c| lead.matches(c));
            if rest.is_empty() {
                return String::new();
            }
            self.lead = Trim::Nothing;
            rest
        };
        self.pending.push_str(seg);
        let hold = self.hold;
        let keep = self.pending.trim_end_matches(|c| hold.matches(c)).len();
        let tail = self.pending.split_off(keep);
        std::mem::replace(&mut self.pending, tail)
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Mode {
    Text,
    Reasoning,
    ToolCall,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Tag {
    ThinkOpen,
    ToolOpen,
}

/// Streaming parser of one model output. See the module documentation for the rules.
#[derive(Debug, Clone)]
pub struct OutputParser {
    tools: ToolCallFormat,
    reasoning_format: ReasoningFormat,
    /// Function name → properties of its parameter schema.
    schemas: HashMap<String, Map<String, Value>>,
    id_prefix: String,
    next_id: usize,
    mode: Mode,
    /// Unprocessed input (in text and reasoning mode: at most a possible partial tag).
    buf: String,
    text: Lane,
    reasoning: Lane,
    /// Body of the tool call being read (after `<tool_call>`).
    call_body: String,
    /// Where to resume searching `</tool_call>` in `call_body`.
    call_scan: usize,
    /// Non-whitespace text or a tool call was emitted: `<think>` is no longer recognised.
    seen_content: bool,
    /// A reasoning block was opened.
    reasoning_seen: bool,
    /// Started inside reasoning and nothing but whitespace came yet: a `<think>` here is
    /// dropped (the model opened the block the prompt already opened).
    think_open_pending: bool,
    /// Hermes calls must name a function of [`OutputParser::with_schemas`].
    declared_only: bool,
    /// SGLang's message shape ([`OutputParser::sglang_message`]): after the first tool-call
    /// tag only calls are kept.
    sglang_message: bool,
    /// A tool-call tag was met (the calls began).
    calls_began: bool,
    /// vLLM's Hermes message ([`OutputParser::vllm_hermes`]).
    vllm_hermes: Option<VllmHermes>,
    /// [`VllmHermes::Streamed`]: a region without a name ended the calls.
    calls_ended: bool,
    /// Text dropped for [`OutputParser::sglang_message`], for the note.
    dropped: String,
    parsed: Parsed,
    reasoning_text: String,
    /// Set: the answer's text is gathered in `forced_text` and read as calls at the end.
    forced: Option<ForcedCalls>,
    forced_text: String,
    /// Nothing of the output has been looked at yet (Llama 3: a bare `{` here starts calls).
    at_start: bool,
    /// vLLM's engine-based parsers read the output ([`OutputParser::vllm_engine`]).
    vllm_engine: Option<Box<VllmEngine>>,
    /// [`OutputParser::first_call_only`].
    first_call_only: bool,
}

impl OutputParser {
    /// A parser for one output. `starts_in_reasoning`: the prompt ended inside an open
    /// `<think>` (ignored unless `reasoning` is [`ReasoningFormat::Think`]).
    pub fn new(
        tools: ToolCallFormat,
        reasoning: ReasoningFormat,
        starts_in_reasoning: bool,
    ) -> Self {
        let mut parser = Self {
            tools,
            reasoning_format: reasoning,
            schemas: HashMap::new(),
            id_prefix: "call_".to_owned(),
            next_id: 0,
            mode: Mode::Text,
            buf: String::new(),
            text: Lane::new(Trim::Nothing, Trim::Whitespace),
            reasoning: Lane::new(Trim::Newlines, Trim::Newlines),
            call_body: String::new(),
            call_scan: 0,
            seen_content: false,
            reasoning_seen: false,
            think_open_pending: false,
            declared_only: false,
            sglang_message: false,
            calls_began: false,
            vllm_hermes: None,
            calls_ended: false,
            dropped: String::new(),
            parsed: Parsed::default(),
            reasoning_text: String::new(),
            forced: None,
            forced_text: String::new(),
            at_start: true,
            vllm_engine: None,
            first_call_only: false,
        };
        if starts_in_reasoning && reasoning == ReasoningFormat::Think {
            parser.enter_reasoning();
            parser.think_open_pending = true;
        }
        parser
    }

    /// A Hermes (JSON) call whose `name` is not among the functions given to
    /// [`OutputParser::with_schemas`] is not a call: it is kept as text, with a note. SGLang's
    /// `BaseFormatDetector.parse_base_json` (used by its `hermes`, `qwen25` and `llama3`
    /// detectors) skips such calls unless `SGLANG_FORWARD_UNKNOWN_TOOLS` is set; its
    /// `qwen3_coder` detector keeps them, and so does graft for that body syntax.
    #[must_use]
    pub fn declared_only(mut self) -> Self {
        self.declared_only = true;
        self
    }

    /// The message SGLang's chat server makes of the output (`_process_tool_calls` with the
    /// detectors' `detect_and_parse`): the content is the text before the first tool-call tag
    /// (Llama 3: and the text after the last JSON object), then only the calls that parse and
    /// name a declared function; a malformed or undeclared call, and text between or after
    /// the calls, are dropped from the message, with a note. Without it (the default) they
    /// stay content.
    #[must_use]
    pub fn sglang_message(mut self) -> Self {
        self.sglang_message = true;
        self
    }

    /// The message vLLM's Hermes parser makes of the output ([`VllmHermes`]); only for
    /// [`ToolCallFormat::Hermes`] (other formats are unchanged).
    #[must_use]
    pub fn vllm_hermes(mut self, how: VllmHermes) -> Self {
        if self.tools == ToolCallFormat::Hermes {
            self.vllm_hermes = Some(how);
            if how == VllmHermes::Whole {
                // The answer is read as a whole at the end, like forced calls.
                self.tools = ToolCallFormat::None;
            }
        }
        self
    }

    /// The message vLLM 0.34's engine-based parsers make of the output (`qwen3_coder` with the
    /// `qwen3` reasoning parser, `llama3_json`; [`crate::vllm_engine`]), whole or streamed as
    /// `request` says; it replaces this parser's own reading.
    #[must_use]
    pub fn vllm_engine(mut self, request: EngineRequest) -> Self {
        self.vllm_engine = Some(Box::new(VllmEngine::new(request)));
        self
    }

    /// Tool definitions (as in a request's `tools`: OpenAI `{"type": "function", "function":
    /// {"name", "parameters"}}`, or bare `{"name", "parameters" | "input_schema"}`) used to
    /// type Qwen3-Coder parameters. Entries without a name are ignored.
    #[must_use]
    pub fn with_schemas(mut self, tools: &[Value]) -> Self {
        for tool in tools {
            let function = tool.get("function").unwrap_or(tool);
            let Some(name) = function.get("name").and_then(Value::as_str) else {
                continue;
            };
            let params = function
                .get("parameters")
                .or_else(|| function.get("input_schema"));
            let properties = params
                .and_then(|p| p.get("properties"))
                .and_then(Value::as_object)
                .cloned()
                .unwrap_or_default();
            self.schemas.insert(name.to_owned(), properties);
        }
        self
    }

    /// The request forces calls as vLLM reads them ([`ForcedCalls`]): no tool-call markup is
    /// looked for, and the answer's text becomes the calls when the output ends.
    #[must_use]
    pub fn with_forced(mut self, forced: Option<ForcedCalls>) -> Self {
        if forced.is_some() {
            self.tools = ToolCallFormat::None;
        }
        self.forced = forced;
        self
    }

    /// Tool call ids are `{prefix}{n}`, n counting from 0 in this parser (default prefix
    /// `call_`). Give a prefix unique to the request when ids must be unique in a session.
    #[must_use]
    pub fn with_id_prefix(mut self, prefix: impl Into<String>) -> Self {
        self.id_prefix = prefix.into();
        self
    }

    /// Feed decoded text as it arrives (any chunking, even mid-tag); returns the pieces that
    /// are certain. Text that might be the start of a tag, and whitespace whose fate depends
    /// on what follows, is held back until it is decided.
    pub fn push(&mut self, text: &str) -> Vec<Piece> {
        let mut out = Vec::new();
        if let Some(engine) = self.vllm_engine.as_mut() {
            let got = engine.push(text);
            self.engine_out(got, &mut out);
        } else {
            self.buf.push_str(text);
            self.drain(&mut out, false);
        }
        self.keep_first_call(&mut out);
        out
    }

    /// End of output: flushes everything held back. An unterminated tool call is parsed if
    /// its body is complete, else emitted as text; either way with a note.
    pub fn finish(&mut self) -> Vec<Piece> {
        let mut out = self.finish_inner();
        self.keep_first_call(&mut out);
        if self.first_call_only && self.parsed.tool_calls.len() > 1 {
            let dropped: Vec<&str> = self.parsed.tool_calls[1..]
                .iter()
                .map(|c| c.name.as_str())
                .collect();
            self.parsed.notes.push(format!(
                "parallel_tool_calls is false: only the first call is in the message (vLLM's \
                 maybe_filter_parallel_tool_calls); left out: {}",
                dropped.join(", ")
            ));
        }
        out
    }

    /// Under [`OutputParser::first_call_only`], the pieces of calls after the first leave.
    fn keep_first_call(&self, out: &mut Vec<Piece>) {
        if self.first_call_only {
            out.retain(|p| match p {
                Piece::ToolCallStart { index, .. } | Piece::ToolCallArgs { index, .. } => {
                    *index == 0
                }
                Piece::Text(_) | Piece::Reasoning(_) => true,
            });
        }
    }

    /// Only the first call reaches the message: vLLM's chat server under
    /// `parallel_tool_calls: false` (`maybe_filter_parallel_tool_calls`, whole and streamed:
    /// the calls of index 0); the rest is parsed (and counted in [`OutputParser::finish`]'s
    /// note), not shown. SGLang applies the flag in its decode constraint only.
    #[must_use]
    pub fn first_call_only(mut self, on: bool) -> Self {
        self.first_call_only = on;
        self
    }

    fn finish_inner(&mut self) -> Vec<Piece> {
        let mut out = Vec::new();
        if let Some(engine) = self.vllm_engine.as_mut() {
            let got = engine.finish();
            self.engine_out(got, &mut out);
            return out;
        }
        self.drain(&mut out, true);
        match self.mode {
            Mode::ToolCall if self.tools == ToolCallFormat::Llama3 => {
                let body = std::mem::take(&mut self.call_body);
                self.mode = Mode::Text;
                self.close_llama_calls(&body, &mut out);
            }
            Mode::ToolCall => {
                let body = std::mem::take(&mut self.call_body);
                self.mode = Mode::Text;
                self.close_call(&body, false, &mut out);
            }
            Mode::Reasoning => {
                self.reasoning.pending.clear();
            }
            Mode::Text => {}
        }
        let rest = std::mem::take(&mut self.text.pending);
        if self.forced.is_some() {
            self.forced_text.push_str(&rest);
            self.close_forced(&mut out);
        } else if self.vllm_hermes == Some(VllmHermes::Whole) {
            self.forced_text.push_str(&rest);
            self.close_vllm_whole(&mut out);
        } else if self.drops_after_calls() && self.calls_began {
            self.dropped.push_str(&rest);
        } else if !rest.is_empty() {
            self.parsed.text.push_str(&rest);
            push_piece(&mut out, Piece::Text(rest));
        }
        let dropped = std::mem::take(&mut self.dropped);
        if !dropped.trim().is_empty() {
            self.parsed.notes.push(format!(
                "not in the message ({} keeps only the calls after the first tool-call tag): {:?}",
                if self.vllm_hermes.is_some() {
                    "vLLM"
                } else {
                    "SGLang"
                },
                head(dropped.trim())
            ));
        }
        out
    }

    /// What vLLM's engine added to the message, as pieces.
    fn engine_out(&mut self, got: Vec<EngineOut>, out: &mut Vec<Piece>) {
        for o in got {
            match o {
                EngineOut::Text(t) => {
                    self.parsed.text.push_str(&t);
                    push_piece(out, Piece::Text(t));
                }
                EngineOut::Reasoning(r) => {
                    self.reasoning_text.push_str(&r);
                    push_piece(out, Piece::Reasoning(r));
                }
                EngineOut::Call { name, arguments } => self.push_call(name, arguments, out),
            }
        }
    }

    /// The forced calls out of the gathered answer ([`ForcedCalls`]).
    fn close_forced(&mut self, out: &mut Vec<Piece>) {
        let text = std::mem::take(&mut self.forced_text);
        let calls: Vec<(String, String)> = match self.forced.take() {
            None => return,
            Some(ForcedCalls::Named(name)) => {
                if text.trim().is_empty() {
                    vec![]
                } else {
                    vec![(name, text)]
                }
            }
            Some(ForcedCalls::Required) => match required_calls(&text) {
                Some(calls) => calls,
                None => {
                    self.parsed.notes.push(
                        "tool_choice required: the answer is not a JSON list of {\"name\", \"parameters\"}; no call"
                            .to_owned(),
                    );
                    vec![]
                }
            },
        };
        for (name, arguments) in calls {
            self.push_call(name, arguments, out);
        }
    }

    /// Emits a parsed call (its start and its arguments) and keeps it.
    fn push_call(&mut self, name: String, arguments: String, out: &mut Vec<Piece>) {
        let index = self.parsed.tool_calls.len();
        let id = format!("{}{}", self.id_prefix, self.next_id);
        self.next_id += 1;
        out.push(Piece::ToolCallStart {
            index,
            id: id.clone(),
            name: name.clone(),
        });
        out.push(Piece::ToolCallArgs {
            index,
            arguments: arguments.clone(),
        });
        self.parsed.tool_calls.push(ParsedToolCall {
            id,
            name,
            arguments,
        });
    }

    /// The special tokens this parser must see in the decoded text (Llama 3's
    /// `<|python_tag|>` when it parses calls); a decoder skips every other special token.
    pub fn special_tokens(&self) -> &'static [&'static str] {
        match self.tools {
            ToolCallFormat::Llama3 => &[PYTHON_TAG],
            _ => &[],
        }
    }

    /// Everything parsed so far, as a whole.
    pub fn parsed(&self) -> Parsed {
        let mut parsed = self.parsed.clone();
        if self.first_call_only {
            parsed.tool_calls.truncate(1);
        }
        if !self.reasoning_text.is_empty() {
            parsed.reasoning = Some(self.reasoning_text.clone());
        }
        parsed
    }

    fn enter_reasoning(&mut self) {
        self.mode = Mode::Reasoning;
        self.reasoning_seen = true;
        self.reasoning = Lane::new(Trim::Newlines, Trim::Newlines);
    }

    /// Whether `<think>` at byte `at` of `buf` would open reasoning.
    fn think_opens_at(&self, at: usize) -> bool {
        self.reasoning_format == ReasoningFormat::Think
            && !self.reasoning_seen
            && !self.seen_content
            && self.text.pending.chars().all(char::is_whitespace)
            && self
                .buf
                .get(..at)
                .is_some_and(|s| s.chars().all(char::is_whitespace))
    }

    fn drain(&mut self, out: &mut Vec<Piece>, at_end: bool) {
        loop {
            match self.mode {
                Mode::Text => {
                    if self.at_start && !self.buf.is_empty() {
                        self.at_start = false;
                        // Llama 3.2 answers with bare JSON: an output that starts with `{` is
                        // calls (SGLang's `Llama32Detector.has_tool_call`: `text.startswith`).
                        if self.tools == ToolCallFormat::Llama3 && self.buf.starts_with('{') {
                            self.mode = Mode::ToolCall;
                            self.calls_began = true;
                            self.call_body.clear();
                            continue;
                        }
                    }
                    let mut found: Option<(usize, Tag)> = None;
                    if self.tools != ToolCallFormat::None {
                        found = self.buf.find(self.tool_open()).map(|i| (i, Tag::ToolOpen));
                    }
                    if let Some(i) = self.buf.find(THINK_OPEN)
                        && found.is_none_or(|(j, _)| i < j)
                        && self.think_opens_at(i)
                    {
                        found = Some((i, Tag::ThinkOpen));
                    }
                    match found {
                        Some((i, tag)) => {
                            let tag_len = match tag {
                                Tag::ThinkOpen => THINK_OPEN.len(),
                                Tag::ToolOpen => self.tool_open().len(),
                            };
                            let rest = self.buf.split_off(i + tag_len);
                            self.buf.truncate(i);
                            let before = std::mem::replace(&mut self.buf, rest);
                            self.emit_text(&before, out);
                            match tag {
                                Tag::ThinkOpen => {
                                    self.text.pending.clear();
                                    self.enter_reasoning();
                                }
                                Tag::ToolOpen => {
                                    self.mode = Mode::ToolCall;
                                    self.calls_began = true;
                                    self.call_body.clear();
                                    self.call_scan = 0;
                                    if self.tools == ToolCallFormat::Llama3 {
                                        // Whitespace before the calls is the template's.
                                        self.text.pending.clear();
                                    }
                                }
                            }
                        }
                        None => {
                            let hold = if at_end { 0 } else { self.text_hold() };
                            let rest = self.buf.split_off(self.buf.len() - hold);
                            let seg = std::mem::replace(&mut self.buf, rest);
                            self.emit_text(&seg, out);
                            return;
                        }
                    }
                }
                Mode::Reasoning => {
                    if self.think_open_pending {
                        let rest = self.buf.trim_start();
                        let lead = self.buf.len() - rest.len();
                        if rest.starts_with(THINK_OPEN) {
                            self.buf.drain(lead..lead + THINK_OPEN.len());
                            self.think_open_pending = false;
                            continue;
                        }
                        if !at_end && THINK_OPEN.starts_with(rest) {
                            return;
                        }
                        self.think_open_pending = false;
                    }
                    // `</think>` ends reasoning; so does `<tool_call>` (SGLang's Qwen3Detector
                    // `tool_start_token`: "Qwen3.5 sometimes opens <tool_call> without closing
                    // </think>"), which then starts the text.
                    let close = self.buf.find(THINK_CLOSE);
                    let tool = self.buf.find(TOOL_OPEN);
                    let end = match (close, tool) {
                        (Some(c), Some(t)) if t < c => Some((t, 0)),
                        (Some(c), _) => Some((c, THINK_CLOSE.len())),
                        (None, Some(t)) => Some((t, 0)),
                        (None, None) => None,
                    };
                    match end {
                        Some((i, tag_len)) => {
                            let rest = self.buf.split_off(i + tag_len);
                            self.buf.truncate(i);
                            let before = std::mem::replace(&mut self.buf, rest);
                            self.emit_reasoning(&before, out);
                            self.reasoning.pending.clear();
                            self.mode = Mode::Text;
                            self.text.lead = Trim::Newlines;
                        }
                        None => {
                            let hold = if at_end {
                                0
                            } else {
                                partial_suffix(&self.buf, &[THINK_CLOSE, TOOL_OPEN])
                            };
                            let rest = self.buf.split_off(self.buf.len() - hold);
                            let seg = std::mem::replace(&mut self.buf, rest);
                            self.emit_reasoning(&seg, out);
                            return;
                        }
                    }
                }
                Mode::ToolCall if self.tools == ToolCallFormat::Llama3 => {
                    // The calls run to the end of the output: read them at `finish`.
                    self.call_body.push_str(&self.buf);
                    self.buf.clear();
                    return;
                }
                Mode::ToolCall => {
                    self.call_body.push_str(&self.buf);
                    self.buf.clear();
                    let from = floor_char_boundary(&self.call_body, self.call_scan);
                    let hit = self
                        .call_body
                        .get(from..)
                        .and_then(|s| s.find(TOOL_CLOSE))
                        .map(|i| from + i);
                    match hit {
                        Some(i) => {
                            self.buf = self.call_body.split_off(i + TOOL_CLOSE.len());
                            self.call_body.truncate(i);
                            let body = std::mem::take(&mut self.call_body);
                            self.mode = Mode::Text;
                            self.close_call(&body, true, out);
                        }
                        None => {
                            self.call_scan =
                                self.call_body.len().saturating_sub(TOOL_CLOSE.len() - 1);
                            return;
                        }
                    }
                }
            }
        }
    }

    /// Length of the suffix of `buf` that may still become a tag, in text mode.
    fn text_hold(&self) -> usize {
        let mut tags: Vec<&str> = Vec::with_capacity(2);
        if self.tools != ToolCallFormat::None {
            tags.push(self.tool_open());
        }
        let held = partial_suffix(&self.buf, &tags);
        let think = partial_suffix(&self.buf, &[THINK_OPEN]);
        if think > held && self.think_opens_at(self.buf.len() - think) {
            think
        } else {
            held
        }
    }

    fn emit_text(&mut self, seg: &str, out: &mut Vec<Piece>) {
        let certain = self.text.feed(seg);
        if self.forced.is_some() || self.vllm_hermes == Some(VllmHermes::Whole) {
            self.seen_content |= !certain.is_empty();
            self.forced_text.push_str(&certain);
            return;
        }
        if self.drops_after_calls() && self.calls_began {
            self.dropped.push_str(&certain);
            return;
        }
        if !certain.is_empty() {
            self.seen_content = true;
            self.parsed.text.push_str(&certain);
            push_piece(out, Piece::Text(certain));
        }
    }

    fn emit_reasoning(&mut self, seg: &str, out: &mut Vec<Piece>) {
        let certain = self.reasoning.feed(seg);
        if !certain.is_empty() {
            self.reasoning_text.push_str(&certain);
            push_piece(out, Piece::Reasoning(certain));
        }
    }

    fn close_call(&mut self, body: &str, terminated: bool, out: &mut Vec<Piece>) {
        if self.vllm_hermes == Some(VllmHermes::Streamed) {
            self.close_vllm_streamed(body, terminated, out);
            return;
        }
        let number = self.parsed.tool_calls.len();
        let result = if !terminated
            && self.tools == ToolCallFormat::Qwen3Coder
            && body.trim_start().starts_with(FUNCTION_OPEN)
            && !body.contains(FUNCTION_CLOSE)
        {
            Err("truncated: no </function>".to_owned())
        } else {
            self.parse_call(body)
        };
        match result {
            Ok((name, arguments)) => {
                // Whitespace before the call belongs to the template, not the text.
                self.text.pending.clear();
                self.text.lead = Trim::Whitespace;
                self.seen_content = true;
                if !terminated {
                    self.parsed.notes.push(format!(
                        "tool call {number} ({name}) was not closed by {TOOL_CLOSE}; parsed anyway"
                    ));
                }
                self.push_call(name, arguments, out);
            }
            Err(why) => {
                let close = if terminated { TOOL_CLOSE } else { "" };
                let raw = format!("{TOOL_OPEN}{body}{close}");
                let what = if terminated {
                    "malformed tool call"
                } else {
                    "unterminated tool call at end of output"
                };
                let fate = if self.sglang_message {
                    "dropped from the message, as SGLang drops it"
                } else {
                    "kept as text"
                };
                self.parsed.notes.push(format!(
                    "{what} (after {number} parsed calls) {fate}: {why}"
                ));
                if self.sglang_message {
                    // Not content: SGLang's message holds the calls that parse, nothing else.
                    self.text.pending.clear();
                } else {
                    self.emit_text(&raw, out);
                }
            }
        }
    }

    /// Whether text after the first tool-call tag is left out of the message (SGLang's
    /// message, vLLM's Hermes streamed one).
    fn drops_after_calls(&self) -> bool {
        self.sglang_message || self.vllm_hermes == Some(VllmHermes::Streamed)
    }

    /// One `<tool_call>` region as vLLM's streaming Hermes parser leaves it with the client
    /// ([`VllmHermes::Streamed`]).
    fn close_vllm_streamed(&mut self, body: &str, terminated: bool, out: &mut Vec<Piece>) {
        // Whitespace before the call belongs to the template, not the text.
        self.text.pending.clear();
        self.text.lead = Trim::Whitespace;
        self.seen_content = true;
        let number = self.parsed.tool_calls.len();
        if self.calls_ended {
            self.dropped.push_str(&format!("{TOOL_OPEN}{body}"));
            return;
        }
        // An unterminated region loses what may be the start of `</tool_call>`.
        let body = if terminated {
            body
        } else {
            &body[..body.len() - partial_suffix(body, &[TOOL_CLOSE])]
        };
        let json = body.trim();
        let complete = terminated || serde_json::from_str::<Value>(json).is_ok();
        let Some(name) = vllm_region_name(json) else {
            self.calls_ended = true;
            self.parsed.notes.push(format!(
                "tool call {number} has no \"name\": \"…\"; vLLM's streaming Hermes parser sends no call from here on"
            ));
            self.dropped.push_str(&format!("{TOOL_OPEN}{body}"));
            return;
        };
        let arguments = vllm_region_args(json, complete).unwrap_or_default();
        if serde_json::from_str::<Value>(&arguments).is_err() {
            self.parsed.notes.push(format!(
                "tool call {number} ({name}): its arguments as vLLM streams them are not JSON: {:?}",
                head(&arguments)
            ));
        }
        if !terminated {
            self.parsed.notes.push(format!(
                "tool call {number} ({name}) was not closed by {TOOL_CLOSE}; sent as vLLM streams it"
            ));
        }
        self.push_call(name, arguments, out);
    }

    /// The gathered answer as vLLM's whole-answer Hermes parser reads it
    /// ([`VllmHermes::Whole`]).
    fn close_vllm_whole(&mut self, out: &mut Vec<Piece>) {
        let text = std::mem::take(&mut self.forced_text);
        let (content, calls) = match vllm_hermes_whole(&text) {
            Ok(Some((content, calls))) => (content, calls),
            Ok(None) => (text, vec![]),
            Err(why) => {
                self.parsed.notes.push(format!(
                    "no tool call: vLLM's Hermes parser reads none when one fails ({why}); the whole answer is content"
                ));
                (text, vec![])
            }
        };
        let content = if calls.is_empty() {
            content
        } else {
            content.trim_end().to_owned()
        };
        if !content.is_empty() {
            self.seen_content = true;
            self.parsed.text.push_str(&content);
            push_piece(out, Piece::Text(content));
        }
        for (name, arguments) in calls {
            self.push_call(name, arguments, out);
        }
    }

    /// The tag that opens tool calls in this format.
    fn tool_open(&self) -> &'static str {
        match self.tools {
            ToolCallFormat::Llama3 => PYTHON_TAG,
            _ => TOOL_OPEN,
        }
    }

    /// Llama 3's calls: `;`-separated JSON objects read as SGLang's
    /// `Llama32Detector.detect_and_parse` reads them; what is not a call stays content.
    fn close_llama_calls(&mut self, body: &str, out: &mut Vec<Piece>) {
        let mut kept = String::new();
        let mut at = 0;
        // Past the last JSON value read (SGLang's `safe_idx`): what follows it is content.
        let mut safe = 0;
        // Text that is not JSON, by where it starts.
        let mut skipped_at: Vec<(usize, String)> = Vec::new();
        while at < body.len() {
            let rest = &body[at..];
            let lead = rest.len() - rest.trim_start().len();
            let mut objects =
                serde_json::Deserializer::from_str(&rest[lead..]).into_iter::<Value>();
            match objects.next() {
                Some(Ok(value)) => {
                    let end = at + lead + objects.byte_offset();
                    // One separator (`;`) after each object, whitespace around it.
                    let after = body[end..].trim_start();
                    let after = after.strip_prefix(';').unwrap_or(after);
                    let next = body.len() - after.len();
                    safe = next;
                    match self.llama_call(value) {
                        Ok((name, arguments)) => {
                            self.seen_content = true;
                            self.push_call(name, arguments, out);
                        }
                        Err(why) => {
                            let number = self.parsed.tool_calls.len();
                            let fate = if self.sglang_message {
                                "dropped from the message, as SGLang drops it"
                            } else {
                                "kept as text"
                            };
                            self.parsed.notes.push(format!(
                                "JSON object after {number} parsed calls {fate}: {why}"
                            ));
                            let raw = body[at + lead..next].trim_end();
                            if self.sglang_message {
                                self.dropped.push_str(raw);
                            } else {
                                append_text(&mut kept, raw);
                            }
                        }
                    }
                    at = next;
                }
                _ if let Some((value, end)) = python_dict(body, at) => {
                    // A call written as a Python dict: SGLang reads it with `literal_eval`
                    // (`Llama32Detector._convert_python_dict_to_json`).
                    let after = body[end..].trim_start();
                    let after = after.strip_prefix(';').unwrap_or(after);
                    let next = body.len() - after.len();
                    safe = next;
                    match self.llama_call(value) {
                        Ok((name, arguments)) => {
                            self.seen_content = true;
                            self.push_call(name, arguments, out);
                        }
                        Err(why) => {
                            let number = self.parsed.tool_calls.len();
                            self.parsed.notes.push(format!(
                                "Python dict after {number} parsed calls is not a call: {why}"
                            ));
                            let raw = body[at..next].trim();
                            if self.sglang_message {
                                self.dropped.push_str(raw);
                            } else {
                                append_text(&mut kept, raw);
                            }
                        }
                    }
                    at = next;
                }
                _ => {
                    // Not JSON here: SGLang looks for the next `{"name":`, and the text up to
                    // it is lost there; graft keeps it as content.
                    let from = at + body[at..].chars().next().map_or(1, char::len_utf8);
                    let next = body[from..].find("{\"name\":").map(|i| from + i);
                    let stop = next.unwrap_or(body.len());
                    let skipped = body[at..stop].trim();
                    if !skipped.is_empty() && self.sglang_message {
                        skipped_at.push((at, skipped.to_owned()));
                    } else if !skipped.is_empty() {
                        self.parsed.notes.push(format!(
                            "text in the tool calls that is not a call kept as text: {:?}",
                            head(skipped)
                        ));
                        append_text(&mut kept, skipped);
                    }
                    at = stop;
                }
            }
        }
        if self.sglang_message {
            // SGLang: the text after the last JSON value read (all of it when none was) is
            // content; what lay before it and is not a call is dropped.
            for (_, text) in skipped_at.iter().filter(|(start, _)| *start < safe) {
                self.dropped.push_str(text);
            }
            kept = body[safe..].trim().to_owned();
        }
        if !kept.is_empty() {
            self.text.lead = Trim::Nothing;
            self.seen_content = true;
            self.parsed.text.push_str(&kept);
            push_piece(out, Piece::Text(kept));
        }
    }

    /// One Llama 3 JSON object as a call: a non-empty string `name` (declared, when
    /// [`OutputParser::declared_only`]), arguments from `parameters` or `arguments` (SGLang:
    /// `act.get("parameters") or act.get("arguments", {})`).
    fn llama_call(&self, value: Value) -> Result<(String, String), String> {
        let Value::Object(mut object) = value else {
            return Err("not a JSON object".to_owned());
        };
        let name = match object.get("name") {
            Some(Value::String(name)) if !name.trim().is_empty() => name.clone(),
            _ => return Err("missing or empty \"name\"".to_owned()),
        };
        if self.declared_only && !self.schemas.contains_key(&name) {
            return Err(format!("{name:?} is not among the request's tools"));
        }
        let params = object.remove("parameters").filter(|p| match p {
            Value::Null => false,
            Value::Object(m) => !m.is_empty(),
            Value::String(s) => !s.is_empty(),
            _ => true,
        });
        let arguments = match params.or_else(|| object.remove("arguments")) {
            None | Some(Value::Null) => Map::new(),
            Some(Value::Object(map)) => map,
            Some(Value::String(s)) if s.trim().is_empty() => Map::new(),
            Some(Value::String(s)) => match serde_json::from_str::<Value>(&s) {
                Ok(Value::Object(map)) => map,
                _ => return Err("the arguments are a string that is not a JSON object".to_owned()),
            },
            Some(_) => return Err("the arguments are not an object".to_owned()),
        };
        Ok((name, python_json(arguments)))
    }

    /// Parses a tool call body: the configured format first, then the other as a fallback.
    fn parse_call(&self, body: &str) -> Result<(String, String), String> {
        let xml_like = body.trim_start().starts_with(FUNCTION_OPEN);
        let json = match self.tools {
            ToolCallFormat::Qwen3Coder => !xml_like && body.trim_start().starts_with('{'),
            _ => !xml_like,
        };
        if !json {
            return parse_qwen3_coder(body, &self.schemas);
        }
        let (name, arguments) = parse_hermes(body)?;
        if self.declared_only && !self.schemas.contains_key(&name) {
            return Err(format!("{name:?} is not among the request's tools"));
        }
        Ok((name, arguments))
    }
}

/// A call's arguments as both servers write them: Python's `json.dumps(arguments,
/// ensure_ascii=False)` (`", "` and `": "` between items, keys in the model's order), as
/// SGLang's `parse_base_json` and Qwen3-Coder detector and vLLM's Hermes parser do.
fn python_json(arguments: Map<String, Value>) -> String {
    crate::template::json_dumps(&Value::Object(arguments))
}

/// SGLang's Python-dict fallback at byte `at` of Llama 3's calls: the text up to the `}`
/// that closes the first `{` (braces counted as characters, as SGLang counts them), read with
/// [`crate::pyliteral::literal_eval`]; the dict and where it ends.
fn python_dict(body: &str, at: usize) -> Option<(Value, usize)> {
    let mut depth = 0usize;
    for (i, c) in body[at..].char_indices() {
        match c {
            '{' => depth += 1,
            '}' if depth > 0 => {
                depth -= 1;
                if depth == 0 {
                    let end = at + i + 1;
                    let value = crate::pyliteral::literal_eval(&body[at..end])?;
                    return value.is_object().then_some((value, end));
                }
            }
            _ => {}
        }
    }
    None
}

/// vLLM's `Hermes2ProToolParser._extract_tool_name`: the first `"name": "…"` of a region.
fn vllm_region_name(json: &str) -> Option<String> {
    let mut rest = json;
    while let Some(i) = rest.find("\"name\"") {
        let after = rest[i + 6..].trim_start();
        if let Some(value) = after.strip_prefix(':').map(str::trim_start)
            && let Some(value) = value.strip_prefix('"')
            && let Some(end) = value.find('"')
            && end > 0
        {
            return Some(value[..end].to_owned());
        }
        rest = &rest[i + 6..];
    }
    None
}

/// vLLM's `Hermes2ProToolParser._extract_tool_args`: the raw text after the first
/// `"arguments":`, without the object's closing `}` when the region is complete.
fn vllm_region_args(json: &str, complete: bool) -> Option<String> {
    let mut rest = json;
    let raw = loop {
        let i = rest.find("\"arguments\"")?;
        rest = &rest[i + 11..];
        if let Some(raw) = rest.trim_start().strip_prefix(':') {
            break raw.trim_start();
        }
    };
    if !complete {
        return Some(raw.to_owned());
    }
    let raw = raw.trim_end();
    Some(raw.strip_suffix('}').map_or(raw, str::trim_end).to_owned())
}

type VllmWhole = (String, Vec<(String, String)>);

/// vLLM's `Hermes2ProToolParser.extract_tool_calls`: `Ok(None)` without `<tool_call>`; else
/// the text before the first tag and every region's call, or `Err` when one region is not a
/// JSON object with a string `name` and an `arguments` key (vLLM then reads no call at all).
fn vllm_hermes_whole(text: &str) -> Result<Option<VllmWhole>, String> {
    let Some(first) = text.find(TOOL_OPEN) else {
        return Ok(None);
    };
    let mut calls = Vec::new();
    let mut rest = &text[first..];
    while let Some(start) = rest.find(TOOL_OPEN) {
        let body_at = start + TOOL_OPEN.len();
        let (body, next) = match rest[body_at..].find(TOOL_CLOSE) {
            Some(end) => (
                &rest[body_at..body_at + end],
                &rest[body_at + end + TOOL_CLOSE.len()..],
            ),
            None => (&rest[body_at..], ""),
        };
        let value: Value = serde_json::from_str(body.trim())
            .map_err(|e| format!("call {}: invalid JSON: {e}", calls.len()))?;
        let name = match value.get("name") {
            Some(Value::String(name)) => name.clone(),
            _ => return Err(format!("call {}: no string \"name\"", calls.len())),
        };
        let arguments = value
            .get("arguments")
            .ok_or_else(|| format!("call {}: no \"arguments\"", calls.len()))?;
        calls.push((name, crate::template::json_dumps(arguments)));
        rest = next;
    }
    Ok(Some((text[..first].to_owned(), calls)))
}

/// Parses a whole output at once (same rules as streaming).
pub fn parse_whole(
    text: &str,
    tools: ToolCallFormat,
    reasoning: ReasoningFormat,
    starts_in_reasoning: bool,
) -> Parsed {
    let mut parser = OutputParser::new(tools, reasoning, starts_in_reasoning);
    parser.push(text);
    parser.finish();
    parser.parsed()
}

/// vLLM's reading of a `required` answer: `TypeAdapter(list[FunctionDefinition])` (each
/// element an object with a string `name`, an optional object `parameters`, optional
/// `description` (a string), `strict` and `defer_loading` (booleans); other keys ignored;
/// one bad element fails them all), each call's
/// arguments `json.dumps(parameters, ensure_ascii=False)`.
fn required_calls(text: &str) -> Option<Vec<(String, String)>> {
    let Ok(Value::Array(items)) = serde_json::from_str::<Value>(text) else {
        return None;
    };
    items
        .iter()
        .map(|item| {
            let o = item.as_object()?;
            let name = o.get("name")?.as_str()?.to_owned();
            let fits = |key: &str, ok: fn(&Value) -> bool| o.get(key).is_none_or(ok);
            if !fits("description", |v| v.is_null() || v.is_string())
                || !fits("strict", |v| v.is_null() || v.is_boolean())
                || !fits("defer_loading", |v| v.is_null() || v.is_boolean())
            {
                return None;
            }
            let parameters = match o.get("parameters") {
                None | Some(Value::Null) => Value::Null,
                Some(p @ Value::Object(_)) => p.clone(),
                Some(_) => return None,
            };
            Some((name, crate::template::json_dumps(&parameters)))
        })
        .collect()
}

/// Appends a piece, merging it into the previous one when both are text or both reasoning.
fn push_piece(out: &mut Vec<Piece>, piece: Piece) {
    match (out.last_mut(), piece) {
        (Some(Piece::Text(prev)), Piece::Text(s)) => prev.push_str(&s),
        (Some(Piece::Reasoning(prev)), Piece::Reasoning(s)) => prev.push_str(&s),
        (_, piece) => out.push(piece),
    }
}

/// Length of the longest suffix of `s` that is a proper prefix of one of `tags` (all ASCII,
/// starting with `<`).
fn partial_suffix(s: &str, tags: &[&str]) -> usize {
    let longest = tags.iter().map(|t| t.len()).max().unwrap_or(0);
    if longest == 0 {
        return 0;
    }
    let start = s.len().saturating_sub(longest - 1);
    for (i, c) in s.char_indices() {
        if i < start || c != '<' {
            continue;
        }
        let suffix = &s[i..];
        if tags
            .iter()
            .any(|t| t.len() > suffix.len() && t.starts_with(suffix))
        {
            return s.len() - i;
        }
    }
    0
}

fn floor_char_boundary(s: &str, mut i: usize) -> usize {
    if i >= s.len() {
        return s.len();
    }
    while i > 0 && !s.is_char_boundary(i) {
        i -= 1;
    }
    i
}

/// `{"name": ..., "arguments": {...}}` → (name, arguments).
fn parse_hermes(body: &str) -> Result<(String, String), String> {
    let value: Value =
        serde_json::from_str(body.trim()).map_err(|e| format!("invalid JSON: {e}"))?;
    let Value::Object(mut object) = value else {
        return Err("not a JSON object".to_owned());
    };
    let name = match object.remove("name") {
        Some(Value::String(name)) if !name.trim().is_empty() => name,
        _ => return Err("missing or empty \"name\"".to_owned()),
    };
    let arguments = match object
        .remove("arguments")
        .or_else(|| object.remove("parameters"))
    {
        None | Some(Value::Null) => Map::new(),
        Some(Value::Object(map)) => map,
        Some(Value::String(s)) if s.trim().is_empty() => Map::new(),
        Some(Value::String(s)) => match serde_json::from_str::<Value>(&s) {
            Ok(Value::Object(map)) => map,
            _ => return Err("\"arguments\" is a string that is not a JSON object".to_owned()),
        },
        Some(_) => return Err("\"arguments\" is not an object".to_owned()),
    };
    Ok((name, python_json(arguments)))
}

/// `<function=NAME>\n<parameter=P>\nVALUE\n</parameter>\n</function>` → (name,
/// arguments). A missing `</function>` is tolerated; a missing `</parameter>` is not.
fn parse_qwen3_coder(
    body: &str,
    schemas: &HashMap<String, Map<String, Value>>,
) -> Result<(String, String), String> {
    let rest = body
        .trim_start()
        .strip_prefix(FUNCTION_OPEN)
        .ok_or_else(|| format!("expected {FUNCTION_OPEN}NAME>"))?;
    let gt = rest
        .find('>')
        .ok_or_else(|| "unterminated <function=".to_owned())?;
    let name = rest[..gt].trim();
    if name.is_empty() || name.contains(['\n', '<']) {
        return Err(format!("bad function name {name:?}"));
    }
    let properties = schemas.get(name);
    let mut arguments = Map::new();
    let mut rest = &rest[gt + 1..];
    loop {
        rest = rest.trim_start();
        if rest.is_empty() {
            break;
        }
        if let Some(after) = rest.strip_prefix(FUNCTION_CLOSE) {
            if !after.trim().is_empty() {
                return Err(format!("text after {FUNCTION_CLOSE}"));
            }
            break;
        }
        let after = rest
            .strip_prefix(PARAM_OPEN)
            .ok_or_else(|| format!("unexpected text in function body: {:?}", head(rest)))?;
        let gt = after
            .find('>')
            .ok_or_else(|| "unterminated <parameter=".to_owned())?;
        let param = after[..gt].trim();
        if param.is_empty() || param.contains(['\n', '<']) {
            return Err(format!("bad parameter name {param:?}"));
        }
        let after = &after[gt + 1..];
        let end = after
            .find(PARAM_CLOSE)
            .ok_or_else(|| format!("parameter {param:?} has no {PARAM_CLOSE}"))?;
        let mut value = &after[..end];
        value = value.strip_prefix('\n').unwrap_or(value);
        value = value.strip_suffix('\n').unwrap_or(value);
        let typed = convert_param(value, properties.map(|p| p.get(param)));
        arguments.insert(param.to_owned(), typed);
        rest = &after[end + PARAM_CLOSE.len()..];
    }
    Ok((name.to_owned(), python_json(arguments)))
}

/// Appends `s` to `kept`, a space between two parts.
fn append_text(kept: &mut String, s: &str) {
    if !kept.is_empty() {
        kept.push(' ');
    }
    kept.push_str(s);
}

fn head(s: &str) -> String {
    s.chars().take(40).collect()
}

/// Types a Qwen3-Coder parameter value. `schema`: `None` when the function has no known
/// schema (heuristic), `Some(None)` when the parameter is not in it (string).
fn convert_param(raw: &str, schema: Option<Option<&Value>>) -> Value {
    let Some(schema) = schema else {
        return match serde_json::from_str::<Value>(raw.trim()) {
            Ok(Value::String(_)) | Err(_) => Value::String(raw.to_owned()),
            Ok(value) => value,
        };
    };
    let Some(schema) = schema else {
        return Value::String(raw.to_owned());
    };
    let (ty, nullable) = schema_type(schema);
    let trimmed = raw.trim();
    let is_null = matches!(trimmed.to_ascii_lowercase().as_str(), "null" | "none");
    if nullable && is_null {
        return Value::Null;
    }
    if matches!(
        ty.as_str(),
        "string" | "str" | "text" | "varchar" | "char" | "enum"
    ) {
        return Value::String(raw.to_owned());
    }
    if is_null {
        return Value::Null;
    }
    let parsed = serde_json::from_str::<Value>(trimmed).ok();
    let converted = if ["int", "uint", "long", "short", "unsigned"]
        .iter()
        .any(|p| ty.starts_with(p))
    {
        parsed.filter(|v| v.is_i64() || v.is_u64())
    } else if ty.starts_with("num") || ty.starts_with("float") {
        parsed.filter(Value::is_number)
    } else if matches!(ty.as_str(), "boolean" | "bool" | "binary") {
        match trimmed.to_ascii_lowercase().as_str() {
            "true" => Some(Value::Bool(true)),
            "false" => Some(Value::Bool(false)),
            _ => None,
        }
    } else if matches!(ty.as_str(), "object" | "array" | "arr")
        || ty.starts_with("dict")
        || ty.starts_with("list")
    {
        parsed.filter(|v| v.is_object() || v.is_array())
    } else {
        parsed.filter(|v| !v.is_string())
    };
    converted.unwrap_or_else(|| Value::String(raw.to_owned()))
}

/// The (lower-cased) first non-null type of a property schema, and whether null is allowed.
fn schema_type(schema: &Value) -> (String, bool) {
    let lower = |v: &Value| v.as_str().map(|s| s.trim().to_ascii_lowercase());
    match schema.get("type") {
        Some(Value::String(s)) => {
            let ty = s.trim().to_ascii_lowercase();
            let nullable = ty == "null";
            return (ty, nullable);
        }
        Some(Value::Array(types)) => {
            let types: Vec<String> = types.iter().filter_map(lower).collect();
            let nullable = types.iter().any(|t| t == "null");
            let ty = types
                .into_iter()
                .find(|t| t != "null")
                .unwrap_or_else(|| "string".to_owned());
            return (ty, nullable);
        }
        _ => {}
    }
    let options = schema
        .get("anyOf")
        .or_else(|| schema.get("oneOf"))
        .and_then(Value::as_array);
    if let Some(options) = options {
        let types: Vec<String> = options
            .iter()
            .filter_map(|o| o.get("type").and_then(lower))
            .collect();
        let nullable = types.iter().any(|t| t == "null");
        let ty = types
            .into_iter()
            .find(|t| t != "null")
            .unwrap_or_else(|| "string".to_owned());
        return (ty, nullable);
    }
    ("string".to_owned(), false)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use serde_json::json;

    const H: ToolCallFormat = ToolCallFormat::Hermes;
    const X: ToolCallFormat = ToolCallFormat::Qwen3Coder;
    const L: ToolCallFormat = ToolCallFormat::Llama3;
    const T: ReasoningFormat = ReasoningFormat::Think;

    /// Folds pieces into a `Parsed` (notes left empty), checking their order.
    fn fold(pieces: &[Piece]) -> Parsed {
        let mut parsed = Parsed::default();
        let mut reasoning = String::new();
        let mut open: Option<(usize, String, String)> = None;
        for piece in pieces {
            match piece {
                Piece::Text(s) => {
                    assert!(open.is_none(), "text inside a call");
                    assert!(!s.is_empty(), "empty text piece");
                    parsed.text.push_str(s);
                }
                Piece::Reasoning(s) => {
                    assert!(open.is_none(), "reasoning inside a call");
                    assert!(!s.is_empty(), "empty reasoning piece");
                    reasoning.push_str(s);
                }
                Piece::ToolCallStart { index, id, name } => {
                    assert!(open.is_none());
                    assert_eq!(*index, parsed.tool_calls.len());
                    open = Some((*index, id.clone(), name.clone()));
                }
                Piece::ToolCallArgs { index, arguments } => {
                    let Some((i, id, name)) = open.take() else {
                        panic!("args without start");
                    };
                    assert_eq!(i, *index);
                    parsed.tool_calls.push(ParsedToolCall {
                        id,
                        name,
                        arguments: arguments.clone(),
                    });
                }
            }
        }
        assert!(open.is_none(), "start without args");
        if !reasoning.is_empty() {
            parsed.reasoning = Some(reasoning);
        }
        parsed
    }

    fn stream(
        chunks: &[&str],
        tools: ToolCallFormat,
        reasoning: ReasoningFormat,
        starts: bool,
    ) -> (Vec<Piece>, Parsed) {
        let mut parser = OutputParser::new(tools, reasoning, starts);
        let mut pieces = Vec::new();
        for chunk in chunks {
            pieces.extend(parser.push(chunk));
        }
        pieces.extend(parser.finish());
        (pieces, parser.parsed())
    }

    fn call(id: &str, name: &str, arguments: &str) -> ParsedToolCall {
        ParsedToolCall {
            id: id.to_owned(),
            name: name.to_owned(),
            arguments: arguments.to_owned(),
        }
    }

    #[test]
    fn hermes_text_reasoning_two_parallel_calls() {
        let out = "<think>\nLet me look.\n</think>\n\nI'll check both.\n<tool_call>\n\
                   {\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\", \"days\": 2}}\n\
                   </tool_call>\n<tool_call>\n{\"name\": \"get_time\", \"arguments\": \"{\\\"tz\\\": \\\"CET\\\"}\"}\n</tool_call>";
        let parsed = parse_whole(out, H, T, false);
        assert_eq!(parsed.text, "I'll check both.");
        assert_eq!(parsed.reasoning.as_deref(), Some("Let me look."));
        assert_eq!(
            parsed.tool_calls,
            vec![
                call("call_0", "get_weather", r#"{"city": "Paris", "days": 2}"#),
                call("call_1", "get_time", r#"{"tz": "CET"}"#),
            ]
        );
        assert!(parsed.notes.is_empty());
        // Streamed one char at a time: same result, pieces in order.
        let chars: Vec<String> = out.chars().map(String::from).collect();
        let chunks: Vec<&str> = chars.iter().map(String::as_str).collect();
        let (pieces, streamed) = stream(&chunks, H, T, false);
        assert_eq!(streamed, parsed);
        assert_eq!(fold(&pieces), parsed);
    }

    #[test]
    fn qwen3_coder_text_reasoning_two_parallel_calls() {
        let out = "<think>\nplan\n</think>\n\nRunning.\n\n<tool_call>\n<function=run>\n\
                   <parameter=cmd>\nls -la <dir> \"x\"\n</parameter>\n<parameter=timeout>\n30\n</parameter>\n\
                   </function>\n</tool_call>\n<tool_call>\n<function=write>\n<parameter=path>\na.py\n</parameter>\n\
                   <parameter=content>\n\ndef f():\n    return 1\n\n</parameter>\n</function>\n</tool_call>";
        let parsed = parse_whole(out, X, T, false);
        assert_eq!(parsed.text, "Running.");
        assert_eq!(parsed.reasoning.as_deref(), Some("plan"));
        assert_eq!(
            parsed.tool_calls,
            vec![
                call(
                    "call_0",
                    "run",
                    r#"{"cmd": "ls -la <dir> \"x\"", "timeout": 30}"#
                ),
                call(
                    "call_1",
                    "write",
                    r#"{"path": "a.py", "content": "\ndef f():\n    return 1\n"}"#
                ),
            ]
        );
        assert!(parsed.notes.is_empty());
    }

    #[test]
    fn qwen3_coder_schema_types_and_no_schema_heuristics() {
        let tools = vec![
            json!({"type": "function", "function": {"name": "f", "parameters": {
            "type": "object", "properties": {
                "s": {"type": "string"}, "n": {"type": "integer"}, "x": {"type": "number"},
                "b": {"type": "boolean"}, "o": {"type": "object"}, "a": {"type": "array"},
                "opt": {"anyOf": [{"type": "string"}, {"type": "null"}]},
                "bad_int": {"type": "integer"}, "maybe": {"type": ["integer", "null"]}
            }}}}),
        ];
        let body = |params: &[(&str, &str)]| {
            let mut s = String::from("<tool_call>\n<function=f>\n");
            for (k, v) in params {
                s.push_str(&format!("<parameter={k}>\n{v}\n</parameter>\n"));
            }
            s.push_str("</function>\n</tool_call>");
            s
        };
        let out = body(&[
            ("s", "42"),
            ("n", "7"),
            ("x", "1.5"),
            ("b", "True"),
            ("o", r#"{"k": [1, 2]}"#),
            ("a", "[\"p\"]"),
            ("opt", "None"),
            ("bad_int", "seven"),
            ("maybe", "null"),
            ("extra", "5"),
        ]);
        let mut parser = OutputParser::new(X, ReasoningFormat::None, false).with_schemas(&tools);
        parser.push(&out);
        parser.finish();
        let parsed = parser.parsed();
        let args: Value = serde_json::from_str(&parsed.tool_calls[0].arguments).unwrap();
        assert_eq!(
            args,
            json!({"s": "42", "n": 7, "x": 1.5, "b": true, "o": {"k": [1, 2]}, "a": ["p"],
                   "opt": null, "bad_int": "seven", "maybe": null, "extra": "5"})
        );
        // No schema: JSON-looking values keep their type, the rest are strings.
        let parsed = parse_whole(&out, X, ReasoningFormat::None, false);
        let args: Value = serde_json::from_str(&parsed.tool_calls[0].arguments).unwrap();
        assert_eq!(
            args,
            json!({"s": 42, "n": 7, "x": 1.5, "b": "True", "o": {"k": [1, 2]}, "a": ["p"],
                   "opt": "None", "bad_int": "seven", "maybe": null, "extra": 5})
        );
    }

    #[test]
    fn starts_in_reasoning() {
        let out = "The user wants X.\n</think>\n\nHere is X.";
        let parsed = parse_whole(out, H, T, true);
        assert_eq!(parsed.reasoning.as_deref(), Some("The user wants X."));
        assert_eq!(parsed.text, "Here is X.");
        // Without the flag, a bare </think> is text.
        let parsed = parse_whole(out, H, T, false);
        assert_eq!(parsed.reasoning, None);
        assert_eq!(parsed.text, out);
        // Truncated inside reasoning: all reasoning, trailing newlines dropped.
        let parsed = parse_whole("still thinking\n\n", H, T, true);
        assert_eq!(parsed.reasoning.as_deref(), Some("still thinking"));
        assert_eq!(parsed.text, "");
        // Empty reasoning (the disabled-thinking shape) is None.
        let parsed = parse_whole("\n\n</think>\n\nHi", H, T, true);
        assert_eq!(parsed.reasoning, None);
        assert_eq!(parsed.text, "Hi");
        // <think> inside reasoning is literal; <tool_call> ends reasoning (SGLang's
        // Qwen3Detector tool_start_token) and is the answer's start.
        let parsed = parse_whole("a <think> <tool_call>{}</tool_call></think>b", H, T, true);
        assert_eq!(parsed.reasoning.as_deref(), Some("a <think> "));
        assert_eq!(parsed.text, "<tool_call>{}</tool_call></think>b");
        assert!(parsed.tool_calls.is_empty());
        let out = "plan\n<tool_call>\n{\"name\": \"f\", \"arguments\": {}}\n</tool_call>";
        let parsed = parse_whole(out, H, T, true);
        assert_eq!(parsed.reasoning.as_deref(), Some("plan"));
        assert_eq!(parsed.tool_calls, vec![call("call_0", "f", "{}")]);
        // Forced reasoning drops the <think> the model writes itself, in any chunking.
        let out = "\n<think>\nwhy\n</think>\n\nHi";
        let whole = parse_whole(out, H, T, true);
        assert_eq!(whole.reasoning.as_deref(), Some("why"));
        assert_eq!(whole.text, "Hi");
        for cut in 0..out.len() {
            let (_, parsed) = stream(&[&out[..cut], &out[cut..]], H, T, true);
            assert_eq!(parsed, whole, "cut at {cut}");
        }
    }

    #[test]
    fn think_only_opens_at_start() {
        let parsed = parse_whole("Hi <think>x</think> y", H, T, false);
        assert_eq!(parsed.text, "Hi <think>x</think> y");
        assert_eq!(parsed.reasoning, None);
        let parsed = parse_whole("\n <think>x</think>y<think>z</think>", H, T, false);
        assert_eq!(parsed.reasoning.as_deref(), Some("x"));
        assert_eq!(parsed.text, "y<think>z</think>");
        let parsed = parse_whole("<think>x</think>y", H, ReasoningFormat::None, false);
        assert_eq!(parsed.text, "<think>x</think>y");
        // "Hi" came first, so "<thi" is not held back.
        let (pieces, _) = stream(&["Hi <thi", "nk>"], H, T, false);
        let texts = [
            Piece::Text("Hi <thi".to_owned()),
            Piece::Text("nk>".to_owned()),
        ];
        assert_eq!(pieces, texts);
    }

    #[test]
    fn malformed_calls_become_text_with_notes() {
        let bad = "<tool_call>\n{\"name\": \"f\", \"arguments\": {oops}}\n</tool_call>";
        let out = format!("Trying.\n{bad}\n<tool_call>\n{{\"name\": \"g\"}}\n</tool_call>");
        let parsed = parse_whole(&out, H, T, false);
        assert_eq!(parsed.text, format!("Trying.\n{bad}"));
        assert_eq!(parsed.tool_calls, vec![call("call_0", "g", "{}")]);
        assert_eq!(parsed.notes.len(), 1);
        assert!(parsed.notes[0].contains("malformed"), "{:?}", parsed.notes);

        let bad = "<tool_call>\n<function=f>\n<parameter=a>\nno end\n</function>\n</tool_call>";
        let parsed = parse_whole(bad, X, ReasoningFormat::None, false);
        assert_eq!(parsed.text, bad);
        assert!(parsed.tool_calls.is_empty());
        assert_eq!(parsed.notes.len(), 1);

        for bad in [
            "<tool_call>[1]</tool_call>",
            "<tool_call>{\"arguments\": {}}</tool_call>",
            "<tool_call>{\"name\": \"f\", \"arguments\": 3}</tool_call>",
            "<tool_call>{\"name\": \"f\", \"arguments\": \"nope\"}</tool_call>",
        ] {
            let parsed = parse_whole(bad, H, T, false);
            assert_eq!(parsed.text, bad);
            assert_eq!(parsed.notes.len(), 1, "{bad}");
        }
    }

    #[test]
    fn unterminated_calls_at_end() {
        // Complete body, no </tool_call>: parsed, with a note.
        let parsed = parse_whole(
            "<tool_call>\n{\"name\": \"f\", \"arguments\": {}}\n",
            H,
            T,
            false,
        );
        assert_eq!(parsed.tool_calls, vec![call("call_0", "f", "{}")]);
        assert_eq!(parsed.notes.len(), 1);
        // Cut mid-JSON: text, with a note.
        let out = "ok\n<tool_call>\n{\"name\": \"f\", \"argu";
        let parsed = parse_whole(out, H, T, false);
        assert_eq!(parsed.text, out);
        assert!(parsed.tool_calls.is_empty());
        assert_eq!(parsed.notes.len(), 1);
        // Qwen3-Coder cut before </function>: text.
        let out = "<tool_call>\n<function=f>\n<parameter=a>\n1\n</parameter>\n";
        let parsed = parse_whole(out, X, T, false);
        assert_eq!(parsed.text, out);
        assert_eq!(parsed.notes.len(), 1);
        let out = "<tool_call>\n<function=f>\n<parameter=a>\n1\n</parameter>\n</function>";
        let parsed = parse_whole(out, X, T, false);
        assert_eq!(parsed.tool_calls, vec![call("call_0", "f", r#"{"a": 1}"#)]);
    }

    #[test]
    fn format_fallbacks_and_none() {
        let json_call = "<tool_call>\n{\"name\": \"f\", \"arguments\": {\"a\": 1}}\n</tool_call>";
        let parsed = parse_whole(json_call, X, T, false);
        assert_eq!(parsed.tool_calls, vec![call("call_0", "f", r#"{"a": 1}"#)]);
        let xml_call =
            "<tool_call>\n<function=f>\n<parameter=a>\n1\n</parameter>\n</function>\n</tool_call>";
        let parsed = parse_whole(xml_call, H, T, false);
        assert_eq!(parsed.tool_calls, vec![call("call_0", "f", r#"{"a": 1}"#)]);
        let parsed = parse_whole(json_call, ToolCallFormat::None, T, false);
        assert_eq!(parsed.text, json_call);
        assert!(parsed.tool_calls.is_empty());
    }

    #[test]
    fn holds_back_partial_tags_and_whitespace() {
        let mut parser = OutputParser::new(H, T, false).with_id_prefix("call_abc_");
        assert_eq!(parser.push("Hello"), vec![Piece::Text("Hello".to_owned())]);
        assert_eq!(parser.push(" <tool_"), vec![]);
        assert_eq!(parser.push("x"), vec![Piece::Text(" <tool_x".to_owned())]);
        assert_eq!(parser.push("\n"), vec![]);
        assert_eq!(parser.push("<tool_"), vec![]);
        assert_eq!(
            parser.push("call>{\"name\": \"f\", \"arguments\": {}}"),
            vec![]
        );
        assert_eq!(
            parser.push("</tool_call>\nDone \n"),
            vec![
                Piece::ToolCallStart {
                    index: 0,
                    id: "call_abc_0".to_owned(),
                    name: "f".to_owned()
                },
                Piece::ToolCallArgs {
                    index: 0,
                    arguments: "{}".to_owned()
                },
                Piece::Text("Done".to_owned()),
            ]
        );
        assert_eq!(parser.finish(), vec![Piece::Text(" \n".to_owned())]);
        assert_eq!(parser.parsed().text, "Hello <tool_xDone \n");
        // A held partial tag that never completes is text at the end.
        let mut parser = OutputParser::new(H, T, false);
        assert_eq!(parser.push("a <tool_ca"), vec![Piece::Text("a".to_owned())]);
        assert_eq!(parser.finish(), vec![Piece::Text(" <tool_ca".to_owned())]);
        let (pieces, parsed) = stream(&["x", "</thin"], H, T, true);
        assert_eq!(fold(&pieces).reasoning.as_deref(), Some("x</thin"));
        assert_eq!(parsed.reasoning.as_deref(), Some("x</thin"));
    }

    /// vLLM's reading of forced calls: the answer after the reasoning is the calls, never
    /// content; chunking does not matter.
    #[test]
    fn forced_calls_read_the_answer_as_vllm_does() {
        let read = |out: &str, forced: ForcedCalls| {
            let whole = {
                let mut p = OutputParser::new(H, T, false).with_forced(Some(forced.clone()));
                p.push(out);
                p.finish();
                p.parsed()
            };
            for cut in (0..=out.len()).filter(|&c| out.is_char_boundary(c)) {
                let mut p = OutputParser::new(H, T, false).with_forced(Some(forced.clone()));
                let mut pieces = p.push(&out[..cut]);
                pieces.extend(p.push(&out[cut..]));
                pieces.extend(p.finish());
                let mut folded = fold(&pieces);
                folded.notes.clone_from(&whole.notes);
                assert_eq!(folded, whole, "cut at {cut}");
            }
            whole
        };
        let named = ForcedCalls::Named("get_weather".into());
        let p = read(
            "<think>\nParis.\n</think>\n\n{\"city\": \"Paris\"}",
            named.clone(),
        );
        assert_eq!(p.reasoning.as_deref(), Some("Paris."));
        assert_eq!(p.text, "");
        assert_eq!(p.tool_calls.len(), 1);
        assert_eq!(p.tool_calls[0].name, "get_weather");
        assert_eq!(p.tool_calls[0].arguments, "{\"city\": \"Paris\"}");
        // Blank: no call. Markup is not parsed: the whole text is the arguments.
        assert!(
            read("<think>\nx\n</think>\n\n  ", named.clone())
                .tool_calls
                .is_empty()
        );
        let p = read("<tool_call>\n{\"name\": \"f\"}\n</tool_call>", named);
        assert_eq!(
            p.tool_calls[0].arguments,
            "<tool_call>\n{\"name\": \"f\"}\n</tool_call>"
        );

        // `required`: a JSON list; arguments as Python's json.dumps writes `parameters`.
        let p = read(
            "<think>\nTwo.\n</think>\n\n[{\"name\":\"a\",\"parameters\":{\"z\":1,\"y\":[1.5,\"é\"]}},{\"name\":\"b\"}]",
            ForcedCalls::Required,
        );
        assert_eq!(p.text, "");
        let calls: Vec<(&str, &str)> = p
            .tool_calls
            .iter()
            .map(|c| (c.name.as_str(), c.arguments.as_str()))
            .collect();
        assert_eq!(
            calls,
            [("a", "{\"z\": 1, \"y\": [1.5, \"é\"]}"), ("b", "null")]
        );
        assert_eq!(p.tool_calls[1].id, "call_1");
        // One element that does not fit and there is no call, and no content either.
        for bad in [
            "[{\"name\": \"a\"}, {\"parameters\": {}}]",
            "[{\"name\": 3}]",
            "[{\"name\": \"a\", \"parameters\": [1]}]",
            "{\"name\": \"a\"}",
            "[{\"name\": \"a\"}] trailing",
            "I will not call.",
        ] {
            let p = read(bad, ForcedCalls::Required);
            assert!(p.tool_calls.is_empty(), "{bad}");
            assert_eq!(p.text, "", "{bad}");
            assert_eq!(p.notes.len(), 1, "{bad}");
        }
    }

    #[test]
    fn unicode_across_chunks() {
        let out = "<think>\n漢字 😀\n</think>\n\né <tool_call>{\"name\": \"f\", \"arguments\": {\"q\": \"<é>\"}}</tool_call>";
        let whole = parse_whole(out, H, T, false);
        assert_eq!(whole.text, "é");
        assert_eq!(whole.tool_calls[0].arguments, r#"{"q": "<é>"}"#);
        for cut in 0..out.len() {
            if out.is_char_boundary(cut) {
                let (pieces, parsed) = stream(&[&out[..cut], &out[cut..]], H, T, false);
                assert_eq!(parsed, whole);
                assert_eq!(fold(&pieces), whole);
            }
        }
    }

    // ---- property test ----

    #[derive(Debug, Clone)]
    struct Call {
        name: String,
        args: Vec<(String, Value)>,
    }

    #[derive(Debug, Clone)]
    struct Output {
        starts_in_reasoning: bool,
        reasoning: Option<String>,
        text: String,
        calls: Vec<Call>,
    }

    fn atoms() -> impl Strategy<Value = String> {
        let atoms = vec![
            "a",
            "Z",
            " ",
            "  ",
            "\n",
            "\t",
            "<",
            ">",
            "\"",
            "'",
            "\\",
            "{",
            "}",
            "[",
            "]",
            ":",
            ",",
            "=",
            "é",
            "漢",
            "😀",
            "<tool",
            "all>",
            "</thin",
            "<thin",
            "<function",
            "/",
            "</",
            "_",
            "0",
            "7",
        ];
        prop::collection::vec(prop::sample::select(atoms), 0..12).prop_map(|v| v.concat())
    }

    fn value() -> impl Strategy<Value = (char, Value)> {
        prop_oneof![
            atoms().prop_map(|s| ('s', Value::String(s))),
            any::<i32>().prop_map(|n| ('i', json!(n))),
            any::<bool>().prop_map(|b| ('b', json!(b))),
            prop::collection::vec(atoms(), 0..3).prop_map(|v| ('a', json!(v))),
        ]
    }

    fn tool_call() -> impl Strategy<Value = Call> {
        (
            "[a-z][a-z_]{0,7}",
            prop::collection::vec(("[a-z][a-z0-9_]{0,5}", value()), 0..4),
        )
            .prop_map(|(name, raw)| {
                let mut args: Vec<(String, Value)> = Vec::new();
                for (key, (ty, v)) in raw {
                    // The key's first letter fixes its type, so schemas agree across calls.
                    let key = format!("{ty}{key}");
                    if !args.iter().any(|(k, _)| *k == key) {
                        args.push((key, v));
                    }
                }
                Call { name, args }
            })
    }

    fn output() -> impl Strategy<Value = Output> {
        (
            any::<bool>(),
            prop::option::of(atoms()),
            atoms(),
            prop::collection::vec(tool_call(), 0..4),
        )
            .prop_map(|(starts_in_reasoning, reasoning, text, calls)| {
                let reasoning = reasoning
                    .map(|r| r.trim_matches('\n').to_owned())
                    .or_else(|| starts_in_reasoning.then(String::new));
                Output {
                    starts_in_reasoning,
                    reasoning,
                    text,
                    calls,
                }
            })
    }

    fn args_object(call: &Call) -> Value {
        Value::Object(call.args.iter().cloned().collect())
    }

    /// Renders like the Qwen3 (Hermes) and Qwen3-Coder chat templates render history.
    fn render(out: &Output, format: ToolCallFormat) -> String {
        let mut s = String::new();
        if let Some(r) = &out.reasoning {
            if !out.starts_in_reasoning {
                s.push_str("<think>\n");
            }
            s.push_str(r);
            s.push_str("\n</think>\n\n");
        }
        s.push_str(&out.text);
        for (i, call) in out.calls.iter().enumerate() {
            match format {
                ToolCallFormat::Qwen3Coder => {
                    if i > 0 {
                        s.push('\n');
                    } else if !out.text.trim().is_empty() {
                        s.push_str("\n\n");
                    }
                    s.push_str(&format!("<tool_call>\n<function={}>\n", call.name));
                    for (k, v) in &call.args {
                        let v = match v {
                            Value::String(v) => v.clone(),
                            Value::Bool(true) => "True".to_owned(),
                            Value::Bool(false) => "False".to_owned(),
                            other => other.to_string(),
                        };
                        s.push_str(&format!("<parameter={k}>\n{v}\n</parameter>\n"));
                    }
                    s.push_str("</function>\n</tool_call>");
                }
                _ => {
                    if i > 0 || !out.text.is_empty() {
                        s.push('\n');
                    }
                    let body = json!({"name": call.name, "arguments": args_object(call)});
                    s.push_str(&format!("<tool_call>\n{body}\n</tool_call>"));
                }
            }
        }
        s
    }

    /// One tool definition per name, typing each key by its first letter.
    fn schemas(out: &Output) -> Vec<Value> {
        let mut by_name: Vec<(String, Map<String, Value>)> = Vec::new();
        for c in &out.calls {
            let at = match by_name.iter().position(|(n, _)| *n == c.name) {
                Some(at) => at,
                None => {
                    by_name.push((c.name.clone(), Map::new()));
                    by_name.len() - 1
                }
            };
            for (k, _) in &c.args {
                let ty = match k.chars().next() {
                    Some('i') => "integer",
                    Some('b') => "boolean",
                    Some('a') => "array",
                    _ => "string",
                };
                by_name[at].1.insert(k.clone(), json!({"type": ty}));
            }
        }
        by_name
            .into_iter()
            .map(|(name, props)| {
                json!({"type": "function", "function": {"name": name,
                       "parameters": {"type": "object", "properties": props}}})
            })
            .collect()
    }

    fn expected(out: &Output) -> Parsed {
        let mut text = out.text.as_str();
        if out.reasoning.is_some() {
            text = text.trim_start_matches('\n');
        }
        if !out.calls.is_empty() {
            text = text.trim_end();
        }
        Parsed {
            text: text.to_owned(),
            reasoning: out.reasoning.clone().filter(|r| !r.is_empty()),
            tool_calls: out
                .calls
                .iter()
                .enumerate()
                .map(|(i, c)| ParsedToolCall {
                    id: format!("call_{i}"),
                    name: c.name.clone(),
                    arguments: crate::template::json_dumps(&args_object(c)),
                })
                .collect(),
            notes: Vec::new(),
        }
    }

    /// SGLang's message: the text before the first tool-call tag, then only the calls that
    /// parse and are declared; everything else is dropped, with notes.
    #[test]
    fn sglang_message_keeps_only_the_text_before_the_calls_and_the_calls() {
        let n = ReasoningFormat::None;
        let text = "I'll check.\n<tool_call>\n{\"name\": \"a\", \"arguments\": {}}\n</tool_call>\n<tool_call>\n{\"name\": \"zz\", \"arguments\": {}}\n</tool_call>\n<tool_call>\nnot json\n</tool_call>\nDone.";
        let run = |sglang: bool| {
            let p = OutputParser::new(H, n, false)
                .with_schemas(&[json!({"name": "a", "parameters": {}})])
                .declared_only();
            let mut p = if sglang { p.sglang_message() } else { p };
            p.push(text);
            p.finish();
            p.parsed()
        };
        let p = run(true);
        assert_eq!(p.text, "I'll check.");
        assert_eq!(p.tool_calls.len(), 1);
        assert_eq!(p.notes.len(), 3, "{:?}", p.notes);
        let kept = run(false);
        assert!(
            kept.text.contains("zz")
                && kept.text.contains("not json")
                && kept.text.ends_with("Done.")
        );
        assert_eq!(kept.tool_calls.len(), 1);
    }

    /// Llama 3: bare JSON at the start, or calls after `<|python_tag|>` with text before
    /// them; `;` separates calls; what is not a call stays content (SGLang drops it).
    #[test]
    fn llama3_calls() {
        let n = ReasoningFormat::None;
        let call = |p: &Parsed, i: usize| {
            (
                p.tool_calls[i].name.clone(),
                p.tool_calls[i].arguments.clone(),
            )
        };
        let p = parse_whole(
            r#"{"name": "get_weather", "parameters": {"city": "Paris"}}"#,
            L,
            n,
            false,
        );
        assert_eq!(p.text, "");
        assert_eq!(
            call(&p, 0),
            ("get_weather".into(), r#"{"city": "Paris"}"#.into())
        );
        let p = parse_whole(
            "Let me check.\n<|python_tag|>{\"name\": \"a\", \"arguments\": {\"x\": 1}}; {\"name\": \"b\", \"parameters\": {}}",
            L,
            n,
            false,
        );
        assert_eq!(p.text, "Let me check.");
        assert_eq!(p.tool_calls.len(), 2);
        assert_eq!(call(&p, 0), ("a".into(), r#"{"x": 1}"#.into()));
        assert_eq!(call(&p, 1), ("b".into(), "{}".into()));
        // Leading whitespace: not calls (SGLang's `text.startswith("{")`).
        let p = parse_whole(" {\"name\": \"a\", \"parameters\": {}}", L, n, false);
        assert!(p.tool_calls.is_empty());
        assert_eq!(p.text, " {\"name\": \"a\", \"parameters\": {}}");
        // A JSON answer that is not a call, and an undeclared function: content, noted.
        let p = parse_whole(r#"{"answer": 42}"#, L, n, false);
        assert!(p.tool_calls.is_empty());
        assert_eq!(p.text, r#"{"answer": 42}"#);
        assert_eq!(p.notes.len(), 1, "{:?}", p.notes);
        let mut parser = OutputParser::new(L, n, false)
            .with_schemas(&[json!({"name": "a", "parameters": {}})])
            .declared_only();
        parser.push(r#"<|python_tag|>{"name": "zz", "parameters": {}};{"name": "a", "parameters": {"k": "v"}} trailing"#);
        parser.finish();
        let p = parser.parsed();
        assert_eq!(p.tool_calls.len(), 1);
        assert_eq!(call(&p, 0), ("a".into(), r#"{"k": "v"}"#.into()));
        assert_eq!(p.text, r#"{"name": "zz", "parameters": {}}; trailing"#);
        // `<tool_call>` means nothing to Llama 3; `<|python_tag|>` nothing to Hermes.
        let p = parse_whole("<tool_call>\n{\"name\": \"a\"}\n</tool_call>", L, n, false);
        assert!(p.tool_calls.is_empty());
        let p = parse_whole("<|python_tag|>{\"name\": \"a\"}", H, n, false);
        assert!(p.tool_calls.is_empty());
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(512))]
        #[test]
        fn chopped_streaming_equals_whole_and_recovers(
            out in output(),
            xml in any::<bool>(),
            cuts in prop::collection::vec(any::<prop::sample::Index>(), 0..12),
        ) {
            let format = if xml { X } else { H };
            let rendered = render(&out, format);
            let tools = schemas(&out);
            let mut whole_parser =
                OutputParser::new(format, T, out.starts_in_reasoning).with_schemas(&tools);
            whole_parser.push(&rendered);
            whole_parser.finish();
            let whole = whole_parser.parsed();
            prop_assert_eq!(&whole, &expected(&out), "rendered: {:?}", rendered);

            let mut points: Vec<usize> = cuts
                .iter()
                .map(|ix| ix.index(rendered.len() + 1))
                .filter(|&p| rendered.is_char_boundary(p))
                .collect();
            points.push(0);
            points.push(rendered.len());
            points.sort_unstable();
            points.dedup();
            let mut parser =
                OutputParser::new(format, T, out.starts_in_reasoning).with_schemas(&tools);
            let mut pieces = Vec::new();
            for pair in points.windows(2) {
                pieces.extend(parser.push(&rendered[pair[0]..pair[1]]));
            }
            pieces.extend(parser.finish());
            prop_assert_eq!(&fold(&pieces), &whole);
            prop_assert_eq!(&parser.parsed(), &whole);
        }
    }

    fn soup() -> impl Strategy<Value = String> {
        let atoms = vec![
            "<tool_call>",
            "</tool_call>",
            "<|python_tag|>",
            "<|pyth",
            ";",
            "{\"name\": \"g\", \"parameters\": {\"a\": 1}}",
            "<think>",
            "</think>",
            "<function=f>",
            "</function>",
            "<parameter=p>",
            "</parameter>",
            "{\"name\": \"f\"}",
            "{\"arguments\": 1}",
            "\n",
            " ",
            "x",
            "1",
            "<",
            "<tool",
            "</thi",
            "é",
            "😀",
            "{",
            "}",
            "\"",
        ];
        prop::collection::vec(prop::sample::select(atoms), 0..24).prop_map(|v| v.concat())
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(512))]
        /// Any text, well-formed or not: chunking never changes the result.
        #[test]
        fn chopping_never_changes_anything(
            text in soup(),
            fmt in 0..3u8,
            think in any::<bool>(),
            starts in any::<bool>(),
            sglang in any::<bool>(),
            cuts in prop::collection::vec(any::<prop::sample::Index>(), 0..12),
        ) {
            let format = [H, X, L][usize::from(fmt)];
            let reasoning = if think { T } else { ReasoningFormat::None };
            let parser_of = || {
                let p = OutputParser::new(format, reasoning, starts);
                if sglang { p.sglang_message() } else { p }
            };
            let mut whole_parser = parser_of();
            whole_parser.push(&text);
            whole_parser.finish();
            let whole = whole_parser.parsed();
            let mut points: Vec<usize> = cuts
                .iter()
                .map(|ix| ix.index(text.len() + 1))
                .filter(|&p| text.is_char_boundary(p))
                .collect();
            points.push(0);
            points.push(text.len());
            points.sort_unstable();
            points.dedup();
            let mut parser = parser_of();
            let mut pieces = Vec::new();
            for pair in points.windows(2) {
                pieces.extend(parser.push(&text[pair[0]..pair[1]]));
            }
            pieces.extend(parser.finish());
            let mut folded = fold(&pieces);
            folded.notes.clone_from(&whole.notes);
            prop_assert_eq!(&folded, &whole);
            prop_assert_eq!(&parser.parsed(), &whole);
            // Nothing is lost: every non-whitespace char of the input is accounted for
            // unless it belongs to a tag, a parsed call or trimmed whitespace.
            let no_reasoning = !think || (!starts && !text.contains("<think>"));
            if whole.tool_calls.is_empty() && no_reasoning && !sglang {
                let squeeze = |s: &str| s.chars().filter(|c| !c.is_whitespace()).collect::<String>();
                // Llama 3's first `<|python_tag|>` opens the calls and is not kept (unless the
                // output opened them with a bare `{`).
                let input = if format == L && !text.starts_with('{') {
                    text.replacen(PYTHON_TAG, "", 1)
                } else {
                    text.clone()
                };
                prop_assert_eq!(squeeze(&whole.text), squeeze(&input));
            }
        }
    }
}

//! vLLM 0.34's engine-based parsers, transcribed: `--tool-call-parser qwen3_coder` (with
//! `--reasoning-parser qwen3`) and `--tool-call-parser llama3_json`, as vLLM's chat server
//! runs them (`vllm/parser/abstract_parser.py` `DelegatingParser.parse` / `parse_delta`,
//! `entrypoints/openai/chat_completion/message_assembly.py`, `stream_processor.py`).
//!
//! The engine (`vllm/parser/engine/`) lexes the text into terminals (longest literal at each
//! position, a possible prefix held back: `incremental_lexer.py`) and drives a state machine
//! whose transitions a config declares (`vllm/parser/qwen3.py` `qwen3_config`,
//! `vllm/parser/llama_json.py` `llama_json_config`); text in a state is reasoning, content, a
//! call's name or its raw arguments, or nothing (between the tags of a call). Around it:
//! - **Reasoning** (Qwen3 with a reasoning parser and a thinking request): a first pass from
//!   the reasoning state, tool tags being text, to the first `</think>` (consumed) or
//!   `<tool_call>` (which starts the content); a `<think>` inside is dropped; no end: all
//!   reasoning. Whole, `</think>` is then removed from the rest (that pass drops it in
//!   content); streamed, the rest goes to the tool pass as it is. Reasoning is kept raw.
//! - **Tool pass** from the content state. Qwen3: `<tool_call>` (or a bare `<function=`)
//!   starts a call, the name runs to `>`, the arguments are the raw text to `</function>`
//!   (`</tool_call>` and other tags inside are argument text), `</think>` in content is dropped.
//!   Llama: `<|python_tag|>` (or a `{` that starts the output) starts `;`-separated JSON objects,
//!   one call each; anything else ends them and is content.
//! - **Calls**, whole (`_build_extracted_result`): Qwen3's arguments are
//!   `json.dumps({param: value})` of the closed `<parameter=…>` values (one wrapping `\n`
//!   trimmed); Llama's the verbatim text of the `arguments` / `parameters` object; the name
//!   the text after `<function=` (Qwen3) or the first `"name": "…"` (Llama). Then the values
//!   are typed by the tool's schema (`_fix_arg_types`: `coerce_to_schema_type`, which
//!   re-dumps only when something changed). Any non-empty name is a call
//!   (`validate_tool_names` is off). Llama first checks the whole output
//!   (`_validate_complete_tool_output`): one that starts as calls but is not a sequence of
//!   objects with a name and arguments is all content.
//! - **Content**, whole: the text before the first call (text after it is kept only when no
//!   call got a name), whitespace-only dropped when calls follow, stripped when there are
//!   calls. Streamed: all the text, leading whitespace dropped when a call comes first; a
//!   call's arguments as streamed (`_compute_arg_delta` / `_flush_arg_converter`: the last
//!   prefix-safe partial conversion, extended by the final one only where it extends it, so
//!   a truncated call keeps what was streamed).
//! - **`tool_choice`**: `none` with tools suppresses the calls but the engine still runs, so
//!   the markup is gone from the content; without tools (vLLM's default choice is then
//!   `none`) calls are parsed and left out of the message.

use serde_json::{Map, Value};

/// Which of vLLM's engine configs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EngineFormat {
    /// `qwen3_coder` (`Qwen3Parser`, `vllm/parser/qwen3.py`).
    Qwen3,
    /// `llama3_json` (`LlamaJsonParser`, `vllm/parser/llama_json.py`).
    LlamaJson,
}

/// The request as the engine sees it.
#[derive(Debug, Clone)]
pub struct EngineRequest {
    pub format: EngineFormat,
    /// The server runs a reasoning parser (`--reasoning-parser qwen3`).
    pub reasoning_parser: bool,
    /// The output starts in reasoning (a reasoning parser, and `enable_thinking` not false).
    pub thinking: bool,
    /// The request's tools (Chat form); empty: none.
    pub tools: Vec<Value>,
    /// `tool_choice: none` with tools: calls suppressed.
    pub suppress: bool,
    /// The message keeps the calls (`keeps_tool_calls`: auto, required or named, with tools).
    pub keep_calls: bool,
    /// The client streams.
    pub streamed: bool,
}

/// What the engine adds to the message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Out {
    Text(String),
    Reasoning(String),
    Call { name: String, arguments: String },
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    Content,
    ToolPreamble,
    ToolName,
    ToolArgs,
    ToolBetween,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Term {
    ThinkStart,
    ThinkEnd,
    ToolStart,
    ToolEnd,
    FuncPrefix,
    FuncEnd,
    ParamStart,
    ParamEnd,
    CloseAngle,
}

const QWEN3_TERMS: [(&str, Term); 9] = [
    ("<think>", Term::ThinkStart),
    ("</think>", Term::ThinkEnd),
    ("<tool_call>", Term::ToolStart),
    ("</tool_call>", Term::ToolEnd),
    ("<function=", Term::FuncPrefix),
    ("</function>", Term::FuncEnd),
    ("<parameter=", Term::ParamStart),
    ("</parameter>", Term::ParamEnd),
    (">", Term::CloseAngle),
];
const LLAMA_TERMS: [(&str, Term); 1] = [("<|python_tag|>", Term::ToolStart)];
const PYTHON_TAG: &str = "<|python_tag|>";
const LLAMA_END_TOKENS: [&str; 3] = ["<|eom_id|>", "<|eot_id|>", "<|end_of_text|>"];

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Ev {
    /// `REASONING_END`.
    ReasoningEnd,
    /// `TOOL_CALL_START`.
    Start,
    /// `ARG_VALUE_CHUNK` of the terminal's own text.
    ArgTerm,
    /// `TOOL_CALL_END`.
    End,
}

/// `qwen3_config`'s transitions.
fn qwen3_transition(state: State, term: Term) -> Option<(State, &'static [Ev])> {
    use Ev::{ArgTerm, End, ReasoningEnd, Start};
    use State::{Content, ToolArgs, ToolBetween, ToolName, ToolPreamble};
    // The reasoning state's own transitions are the reasoning pass ([`VllmEngine::stream`]).
    Some(match (state, term) {
        (Content, Term::ThinkEnd) => (Content, &[]),
        (Content, Term::ToolStart) => (ToolPreamble, &[ReasoningEnd, Start]),
        (Content, Term::FuncPrefix) => (ToolName, &[Start]),
        (ToolPreamble, Term::ToolEnd) => (Content, &[End]),
        (ToolPreamble, Term::FuncPrefix) => (ToolName, &[]),
        (ToolName, Term::CloseAngle) => (ToolArgs, &[]),
        (ToolName, Term::FuncEnd) => (ToolBetween, &[End]),
        (ToolName, Term::ToolEnd) => (Content, &[End]),
        (ToolName, Term::ToolStart) => (ToolPreamble, &[End, Start]),
        (ToolName, Term::FuncPrefix) => (ToolName, &[End, Start]),
        (ToolArgs, Term::FuncEnd) => (ToolBetween, &[End]),
        (ToolArgs, Term::FuncPrefix) => (ToolName, &[End, Start]),
        (ToolArgs, Term::ParamStart | Term::ParamEnd) => (ToolArgs, &[ArgTerm]),
        (ToolBetween, Term::ToolEnd) => (Content, &[]),
        (ToolBetween, Term::ToolStart) => (ToolPreamble, &[Start]),
        (ToolBetween, Term::FuncPrefix) => (ToolName, &[Start]),
        _ => return None,
    })
}

/// The incremental lexer: longest literal at each position; text that may still become one
/// is held back until more comes or the end.
#[derive(Debug, Clone)]
struct Lexer {
    terms: &'static [(&'static str, Term)],
    buf: String,
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum Tok {
    Text(String),
    Term(Term, &'static str),
}

impl Lexer {
    fn feed(&mut self, text: &str, last: bool) -> Vec<Tok> {
        self.buf.push_str(text);
        let mut out = Vec::new();
        let mut text_from = 0;
        let mut at = 0;
        let buf = std::mem::take(&mut self.buf);
        while at < buf.len() {
            let rest = &buf[at..];
            let best = self
                .terms
                .iter()
                .filter(|(lit, _)| rest.starts_with(lit))
                .max_by_key(|(lit, _)| lit.len());
            if let Some(&(lit, term)) = best {
                if text_from < at {
                    out.push(Tok::Text(buf[text_from..at].to_owned()));
                }
                out.push(Tok::Term(term, lit));
                at += lit.len();
                text_from = at;
                continue;
            }
            if !last && self.terms.iter().any(|(lit, _)| lit.starts_with(rest)) {
                break;
            }
            at += rest.chars().next().map_or(1, char::len_utf8);
        }
        if text_from < at {
            out.push(Tok::Text(buf[text_from..at].to_owned()));
        }
        self.buf = buf[at..].to_owned();
        out
    }
}

/// One call being read (`ToolCallSlot`).
#[derive(Debug, Clone, Default)]
struct Slot {
    name: String,
    args: String,
    ended: bool,
}

/// The tool pass (`StreamingParserEngine` from the content state, with `ParserEngine`'s
/// handling of its events).
#[derive(Debug, Clone)]
struct ToolPass {
    format: EngineFormat,
    suppress: bool,
    /// No reasoning parser: `<think>` / `</think>` are text (`skip_reasoning_parsing`).
    think_is_text: bool,
    lexer: Lexer,
    state: State,
    slots: Vec<Slot>,
    /// Text before the first call event, and after it.
    head: String,
    tail: String,
    tool_event_seen: bool,
    at_output_start: bool,
    // Llama's JSON sequence (`_feed_json_collection_char`).
    in_element: bool,
    had_element: bool,
    separator_seen: bool,
    depth: i64,
    in_string: bool,
    escape: bool,
}

impl ToolPass {
    fn new(format: EngineFormat, suppress: bool, think_is_text: bool) -> Self {
        Self {
            format,
            suppress,
            think_is_text,
            lexer: Lexer {
                terms: match format {
                    EngineFormat::Qwen3 => &QWEN3_TERMS,
                    EngineFormat::LlamaJson => &LLAMA_TERMS,
                },
                buf: String::new(),
            },
            state: State::Content,
            slots: Vec::new(),
            head: String::new(),
            tail: String::new(),
            tool_event_seen: false,
            at_output_start: true,
            in_element: false,
            had_element: false,
            separator_seen: false,
            depth: 0,
            in_string: false,
            escape: false,
        }
    }

    /// Feeds text; returns the content text it made, in order, and the calls it closed.
    fn feed(&mut self, text: &str, last: bool, out: &mut Vec<PassOut>) {
        let mut text = std::borrow::Cow::Borrowed(text);
        if self.at_output_start && !text.is_empty() {
            // `LlamaJsonParser._preprocess_feed`: Llama 3.2 writes bare JSON.
            self.at_output_start = false;
            if self.format == EngineFormat::LlamaJson && !self.suppress && text.starts_with('{') {
                text = std::borrow::Cow::Owned(format!("{PYTHON_TAG}{text}"));
            }
        }
        for tok in self.lexer.feed(&text, last) {
            match tok {
                Tok::Text(t) => self.emit_for_state(&t, out),
                Tok::Term(term, lit) => self.on_terminal(term, lit, out),
            }
        }
        if last {
            self.finish(out);
        }
    }

    fn transition(&self, term: Term) -> Option<(State, &'static [Ev])> {
        match self.format {
            EngineFormat::Qwen3 => qwen3_transition(self.state, term),
            EngineFormat::LlamaJson => match (self.state, term) {
                (State::Content, Term::ToolStart) => Some((State::ToolArgs, &[])),
                _ => None,
            },
        }
    }

    fn on_terminal(&mut self, term: Term, lit: &str, out: &mut Vec<PassOut>) {
        let Some((next, events)) = self.transition(term) else {
            return self.emit_for_state(lit, out);
        };
        if self.think_is_text && matches!(term, Term::ThinkStart | Term::ThinkEnd) {
            return self.emit_for_state(lit, out);
        }
        self.state = next;
        for ev in events {
            match ev {
                Ev::ReasoningEnd => {}
                Ev::Start => {
                    self.slots.push(Slot::default());
                    self.tool_event();
                    if !self.suppress {
                        out.push(PassOut::CallStarted);
                    }
                }
                Ev::ArgTerm => self.arg_chunk(lit),
                Ev::End => self.end_call(out),
            }
        }
        if self.state == State::ToolArgs {
            self.depth = 0;
            self.in_string = false;
            self.escape = false;
            self.in_element = false;
            self.had_element = false;
            self.separator_seen = false;
        }
    }

    fn tool_event(&mut self) {
        if !self.suppress {
            self.tool_event_seen = true;
        }
    }

    fn arg_chunk(&mut self, text: &str) {
        self.tool_event();
        if let Some(slot) = self.slots.last_mut() {
            slot.args.push_str(text);
        }
    }

    fn end_call(&mut self, out: &mut Vec<PassOut>) {
        self.tool_event();
        if let Some(slot) = self.slots.last_mut()
            && !slot.ended
        {
            slot.ended = true;
            if !self.suppress {
                out.push(PassOut::CallEnded(self.slots.len() - 1));
            }
        }
    }

    fn text(&mut self, text: &str, out: &mut Vec<PassOut>) {
        if text.is_empty() {
            return;
        }
        if self.tool_event_seen {
            self.tail.push_str(text);
        } else {
            self.head.push_str(text);
        }
        out.push(PassOut::Text(text.to_owned()));
    }

    fn emit_for_state(&mut self, text: &str, out: &mut Vec<PassOut>) {
        match self.state {
            State::Content => self.text(text, out),
            State::ToolName => {
                self.tool_event();
                if let Some(slot) = self.slots.last_mut() {
                    slot.name.push_str(text);
                }
            }
            State::ToolArgs => match self.format {
                EngineFormat::Qwen3 => self.arg_chunk(text),
                EngineFormat::LlamaJson => {
                    for (i, c) in text.char_indices() {
                        if self.state != State::ToolArgs {
                            self.text(&text[i..], out);
                            break;
                        }
                        self.json_char(c, out);
                    }
                }
            },
            State::ToolPreamble | State::ToolBetween => {}
        }
    }

    /// `_feed_json_collection_char` for `SEMICOLON_SEQUENCE`.
    fn json_char(&mut self, c: char, out: &mut Vec<PassOut>) {
        if self.in_element {
            let mut buf = [0; 4];
            self.arg_chunk(c.encode_utf8(&mut buf));
            if self.escape {
                self.escape = false;
            } else if self.in_string {
                match c {
                    '\\' => self.escape = true,
                    '"' => self.in_string = false,
                    _ => {}
                }
            } else {
                match c {
                    '"' => self.in_string = true,
                    '{' | '[' => self.depth += 1,
                    '}' | ']' => {
                        if self.depth > 0 {
                            self.depth -= 1;
                        }
                        if c == '}' && self.depth == 0 {
                            self.in_element = false;
                            self.had_element = true;
                            self.end_call(out);
                        }
                    }
                    _ => {}
                }
            }
            return;
        }
        if matches!(c, ' ' | '\t' | '\r' | '\n') {
            return;
        }
        let between = self.had_element && !self.separator_seen;
        match c {
            ';' if between => self.separator_seen = true,
            '{' if !between => {
                self.separator_seen = false;
                self.slots.push(Slot::default());
                self.tool_event();
                if !self.suppress {
                    out.push(PassOut::CallStarted);
                }
                self.in_element = true;
                self.depth = 0;
                self.in_string = false;
                self.escape = false;
                self.json_char(c, out);
            }
            _ => {
                // `_bail_json_collection_to_content`.
                self.state = State::Content;
                self.had_element = false;
                self.separator_seen = false;
                let mut buf = [0; 4];
                self.text(c.encode_utf8(&mut buf), out);
            }
        }
    }

    fn finish(&mut self, out: &mut Vec<PassOut>) {
        if matches!(
            self.state,
            State::ToolPreamble | State::ToolArgs | State::ToolName | State::ToolBetween
        ) {
            let open = self.format == EngineFormat::Qwen3 || self.in_element;
            if open && !self.slots.is_empty() {
                self.end_call(out);
            }
            self.state = State::Content;
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum PassOut {
    Text(String),
    CallStarted,
    CallEnded(usize),
}

/// vLLM's parse of one output, fed as it arrives.
#[derive(Debug, Clone)]
pub struct VllmEngine {
    req: EngineRequest,
    /// In the first (reasoning) pass.
    reasoning: bool,
    reasoning_lexer: Lexer,
    tools: ToolPass,
    /// Whole: everything, read at the end.
    whole_text: String,
    /// Streamed: whitespace held until non-whitespace content comes (`_content_has_nonws`).
    held_ws: String,
    content_started: bool,
}

impl VllmEngine {
    pub fn new(req: EngineRequest) -> Self {
        let reasoning = req.format == EngineFormat::Qwen3 && req.reasoning_parser && req.thinking;
        let think_is_text = !req.reasoning_parser;
        Self {
            reasoning,
            reasoning_lexer: Lexer {
                terms: &QWEN3_TERMS,
                buf: String::new(),
            },
            tools: ToolPass::new(req.format, req.suppress, think_is_text),
            whole_text: String::new(),
            held_ws: String::new(),
            content_started: false,
            req,
        }
    }

    /// Feeds decoded text; streamed, returns what is now certain.
    pub fn push(&mut self, text: &str) -> Vec<Out> {
        if !self.req.streamed {
            self.whole_text.push_str(text);
            return Vec::new();
        }
        let mut out = Vec::new();
        self.stream(text, false, &mut out);
        out
    }

    /// The end of the output: the rest (streamed) or the whole message (whole).
    pub fn finish(&mut self) -> Vec<Out> {
        if !self.req.streamed {
            let text = std::mem::take(&mut self.whole_text);
            return self.whole(&text);
        }
        let mut out = Vec::new();
        self.stream("", true, &mut out);
        if !self.tools.slots.is_empty() {
            self.held_ws.clear();
        } else if !self.held_ws.is_empty() {
            out.push(Out::Text(std::mem::take(&mut self.held_ws)));
        }
        out
    }

    fn stream(&mut self, text: &str, last: bool, out: &mut Vec<Out>) {
        let mut rest = String::new();
        if self.reasoning {
            let toks = self.reasoning_lexer.feed(text, last);
            let mut toks = toks.into_iter();
            for tok in toks.by_ref() {
                match tok {
                    Tok::Term(Term::ThinkStart, _) => {}
                    Tok::Term(Term::ThinkEnd, _) => {
                        self.reasoning = false;
                        break;
                    }
                    Tok::Term(Term::ToolStart, lit) => {
                        self.reasoning = false;
                        rest.push_str(lit);
                        break;
                    }
                    Tok::Term(_, t) => push_out(out, Out::Reasoning(t.to_owned())),
                    Tok::Text(t) => push_out(out, Out::Reasoning(t)),
                }
            }
            if self.reasoning {
                return;
            }
            for tok in toks {
                match tok {
                    Tok::Term(_, t) => rest.push_str(t),
                    Tok::Text(t) => rest.push_str(&t),
                }
            }
            rest.push_str(&std::mem::take(&mut self.reasoning_lexer.buf));
        } else {
            rest.push_str(text);
        }
        let mut pass = Vec::new();
        self.tools.feed(&rest, last, &mut pass);
        for p in pass {
            match p {
                PassOut::Text(t) => {
                    if self.content_started {
                        push_out(out, Out::Text(t));
                    } else if t.trim().is_empty() {
                        self.held_ws.push_str(&t);
                    } else {
                        self.content_started = true;
                        let held = std::mem::take(&mut self.held_ws);
                        push_out(out, Out::Text(held + &t));
                    }
                }
                PassOut::CallStarted => {
                    if !self.content_started {
                        self.held_ws.clear();
                    }
                }
                PassOut::CallEnded(i) => {
                    if let Some(call) = self.streamed_call(i)
                        && self.req.keep_calls
                    {
                        out.push(call);
                    }
                }
            }
        }
    }

    /// A call as the client accumulated it from the stream (`_handle_arg_chunk`,
    /// `_handle_tool_end`): its name the text after `<function=`, or the first `"name": "…"`
    /// of its arguments; its arguments what was streamed.
    fn streamed_call(&self, i: usize) -> Option<Out> {
        let slot = self.tools.slots.get(i)?;
        let name = if slot.name.is_empty() {
            first_name(&slot.args)?
        } else {
            slot.name.clone()
        };
        let tools = &self.req.tools;
        let final_json = match self.req.format {
            EngineFormat::Qwen3 => Some(qwen3_args(&slot.args, false)),
            EngineFormat::LlamaJson => llama_args(&slot.args, false),
        }
        .map(|j| fix_arg_types(&j, &name, tools));
        // The prefix streamed before the end (`_compute_arg_delta`); Llama streams none.
        let streamed = match self.req.format {
            EngineFormat::Qwen3 => {
                let partial = fix_arg_types(&qwen3_args(&slot.args, true), &name, tools);
                safe_arg_prefix(&partial, string_keys(tools, &name).as_ref())
            }
            EngineFormat::LlamaJson => String::new(),
        };
        let arguments = match final_json {
            Some(f) if !f.is_empty() && f.len() > streamed.len() && f.starts_with(&streamed) => f,
            _ => streamed,
        };
        Some(Out::Call { name, arguments })
    }

    /// The whole answer's message (`DelegatingParser.parse`, `_extract_tool_calls`,
    /// `assemble_chat_message_fields`).
    fn whole(&mut self, text: &str) -> Vec<Out> {
        let mut out = Vec::new();
        let mut content_text = std::borrow::Cow::Borrowed(text);
        if self.reasoning {
            let mut lexer = self.reasoning_lexer.clone();
            let mut reasoning = String::new();
            let mut rest = String::new();
            let mut ended = false;
            for tok in lexer.feed(text, true) {
                if ended {
                    match tok {
                        Tok::Term(Term::ThinkEnd, _) => {}
                        Tok::Term(_, t) => rest.push_str(t),
                        Tok::Text(t) => rest.push_str(&t),
                    }
                    continue;
                }
                match tok {
                    Tok::Term(Term::ThinkStart, _) => {}
                    Tok::Term(Term::ThinkEnd, _) => ended = true,
                    Tok::Term(Term::ToolStart, lit) => {
                        ended = true;
                        rest.push_str(lit);
                    }
                    Tok::Term(_, t) => reasoning.push_str(t),
                    Tok::Text(t) => reasoning.push_str(&t),
                }
            }
            if !reasoning.is_empty() {
                out.push(Out::Reasoning(reasoning));
            }
            content_text = std::borrow::Cow::Owned(rest);
        }
        let (content, calls) = self.whole_tool_pass(&content_text);
        if let Some(content) = content.filter(|c| !c.is_empty()) {
            out.push(Out::Text(content));
        }
        if self.req.keep_calls {
            for (name, arguments) in calls {
                out.push(Out::Call { name, arguments });
            }
        }
        out
    }

    /// The tool pass over the whole content (`_single_pass_parse`, `_build_extracted_result`
    /// and the serving layer's choice of content).
    fn whole_tool_pass(&mut self, text: &str) -> (Option<String>, Vec<(String, String)>) {
        if self.req.format == EngineFormat::LlamaJson && validate_llama(text) == Some(false) {
            return (Some(text.to_owned()), Vec::new());
        }
        let mut pass = Vec::new();
        self.tools.feed(text, true, &mut pass);
        let tools = &self.tools;
        let named = tools
            .slots
            .iter()
            .any(|s| !s.name.is_empty() || first_name(&s.args).is_some());
        let mut content = tools.head.clone();
        if self.req.suppress || !named {
            content.push_str(&tools.tail);
        }
        if !content.is_empty()
            && content.trim().is_empty()
            && !self.req.suppress
            && !tools.slots.is_empty()
        {
            content.clear();
        }
        let mut calls = Vec::new();
        if !self.req.suppress {
            for slot in &tools.slots {
                if slot.name.is_empty() && slot.args.is_empty() {
                    continue;
                }
                // `_events_to_delta` already set the name of a call it could name.
                let name = if slot.name.is_empty() {
                    first_name(&slot.args).unwrap_or_default()
                } else {
                    slot.name.clone()
                };
                let name = name.trim().to_owned();
                let args = if name.is_empty() && !slot.args.trim().is_empty() {
                    let (n, a) = name_and_args(&slot.args);
                    if n.is_empty() {
                        continue;
                    }
                    calls.push((n.clone(), fix_arg_types(&a, &n, &self.req.tools)));
                    continue;
                } else if !slot.args.trim().is_empty() {
                    let converted = match self.req.format {
                        EngineFormat::Qwen3 => Some(qwen3_args(&slot.args, false)),
                        EngineFormat::LlamaJson => llama_args(&slot.args, false),
                    };
                    converted.unwrap_or_else(|| name_and_args(&slot.args).1)
                } else {
                    "{}".to_owned()
                };
                if name.is_empty() {
                    continue;
                }
                let args = fix_arg_types(&args, &name, &self.req.tools);
                calls.push((name, args));
            }
        }
        let content = if calls.is_empty() {
            content
        } else {
            content.trim().to_owned()
        };
        (Some(content).filter(|c| !c.is_empty()), calls)
    }
}

fn push_out(out: &mut Vec<Out>, o: Out) {
    match (out.last_mut(), o) {
        (Some(Out::Text(a)), Out::Text(b)) | (Some(Out::Reasoning(a)), Out::Reasoning(b)) => {
            a.push_str(&b);
        }
        (_, o) => out.push(o),
    }
}

/// `ParserEngine._NAME_RE`: the first `"name"\s*:\s*"([^"]*)"`, non-empty.
fn first_name(args: &str) -> Option<String> {
    let mut from = 0;
    while let Some(i) = args[from..].find("\"name\"") {
        let at = from + i + "\"name\"".len();
        let rest = args[at..].trim_start_matches(py_space);
        if let Some(rest) = rest.strip_prefix(':') {
            let rest = rest.trim_start_matches(py_space);
            if let Some(rest) = rest.strip_prefix('"')
                && let Some(end) = rest.find('"')
            {
                let name = &rest[..end];
                return (!name.is_empty()).then(|| name.to_owned());
            }
        }
        from = from + i + 1;
    }
    None
}

fn py_space(c: char) -> bool {
    c.is_whitespace()
}

/// `_extract_name_and_args`: the body as a JSON object, its `name` and its `arguments` /
/// `parameters` (a string as it is, else `json.dumps`); the rest of the object when it has
/// neither; `("", body)` when it is not an object.
fn name_and_args(body: &str) -> (String, String) {
    let body = body.trim();
    let Ok(Value::Object(parsed)) = serde_json::from_str::<Value>(body) else {
        return (String::new(), body.to_owned());
    };
    // A name that is not a string fails vLLM's `FunctionCall`: no call here.
    let name = parsed
        .get("name")
        .and_then(Value::as_str)
        .unwrap_or_default()
        .to_owned();
    for key in ["arguments", "parameters"] {
        if let Some(v) = parsed.get(key) {
            return (
                name,
                match v {
                    Value::String(s) => s.clone(),
                    v => crate::template::json_dumps(v),
                },
            );
        }
    }
    let rest: Map<String, Value> = parsed.into_iter().filter(|(k, _)| k != "name").collect();
    (name, crate::template::json_dumps(&Value::Object(rest)))
}

/// `_llama_arg_converter`: the verbatim `arguments` (else `parameters`) object of the body;
/// `None` where vLLM's converter raises (the member is not an object).
fn llama_args(raw: &str, partial: bool) -> Option<String> {
    let found = match member_object(raw, "arguments") {
        Ok(None) => member_object(raw, "parameters"),
        other => other,
    };
    match found {
        Err(()) => None,
        Ok(Some(s)) => Some(s),
        Ok(None) => Some(if partial {
            String::new()
        } else {
            "{}".to_owned()
        }),
    }
}

/// `vllm/parser/utils.py` `extract_json_member_object`.
fn member_object(raw: &str, key: &str) -> Result<Option<String>, ()> {
    let mut depth = 0i64;
    let mut in_string = false;
    let mut escape = false;
    let mut string_start = 0;
    let mut last_string: Option<&str> = None;
    for (i, ch) in raw.char_indices() {
        if escape {
            escape = false;
            continue;
        }
        if in_string {
            if ch == '\\' {
                escape = true;
            } else if ch == '"' {
                in_string = false;
                if depth == 1 {
                    last_string = Some(&raw[string_start + 1..i]);
                }
            }
            continue;
        }
        match ch {
            '"' => {
                in_string = true;
                string_start = i;
            }
            ':' if depth == 1 && last_string == Some(key) => {
                let value = raw[i + 1..].trim_start_matches([' ', '\t', '\r', '\n']);
                if value.is_empty() {
                    return Ok(None);
                }
                if !value.starts_with('{') {
                    return Err(());
                }
                return Ok(Some(match object_end(value) {
                    Some(end) => value[..end].to_owned(),
                    None => value.to_owned(),
                }));
            }
            '{' | '[' => depth += 1,
            '}' | ']' => depth -= 1,
            _ => {}
        }
    }
    Ok(None)
}

/// `scan_json_object_end`.
fn object_end(raw: &str) -> Option<usize> {
    let mut depth = 0i64;
    let mut in_string = false;
    let mut escape = false;
    for (i, ch) in raw.char_indices() {
        if escape {
            escape = false;
            continue;
        }
        if in_string {
            match ch {
                '\\' => escape = true,
                '"' => in_string = false,
                _ => {}
            }
            continue;
        }
        match ch {
            '"' => in_string = true,
            '{' => depth += 1,
            '}' => {
                depth -= 1;
                if depth == 0 {
                    return Some(i + 1);
                }
            }
            _ => {}
        }
    }
    None
}

/// `_validate_complete_tool_output`: `None` when the output does not start as calls;
/// `Some(false)` when it does and is not a `;`-separated sequence of objects with a `name`
/// and `arguments` / `parameters` (an end token may close it).
fn validate_llama(text: &str) -> Option<bool> {
    let text = if let Some(t) = text.strip_prefix(PYTHON_TAG) {
        t
    } else if text.starts_with('{') {
        text
    } else {
        return None;
    };
    let mut at = 0;
    let mut found = false;
    loop {
        at += text[at..].len() - text[at..].trim_start().len();
        if at == text.len() {
            return Some(found);
        }
        let mut stream = serde_json::Deserializer::from_str(&text[at..]).into_iter::<Value>();
        let Some(Ok(value)) = stream.next() else {
            return Some(false);
        };
        let end = at + stream.byte_offset();
        let ok = value.as_object().is_some_and(|o| {
            o.contains_key("name") && (o.contains_key("arguments") || o.contains_key("parameters"))
        });
        if !ok {
            return Some(false);
        }
        found = true;
        at = end;
        at += text[at..].len() - text[at..].trim_start().len();
        if at == text.len() {
            return Some(true);
        }
        if LLAMA_END_TOKENS.iter().any(|t| {
            text[at..]
                .strip_prefix(t)
                .is_some_and(|r| r.trim().is_empty())
        }) {
            return Some(true);
        }
        if !text[at..].starts_with(';') {
            return Some(false);
        }
        at += 1;
    }
}

/// `_qwen3_arg_converter`: `json.dumps` of the closed `<parameter=NAME>VALUE</parameter>`
/// values (a value also ends at the next `<parameter=`; one wrapping `\n` trimmed), and with
/// `partial` the open trailing one.
fn qwen3_args(raw: &str, partial: bool) -> String {
    let mut params: Map<String, Value> = Map::new();
    let mut outside = String::new();
    let mut pos = 0;
    let mut search = 0;
    while let Some(i) = raw[search..].find('<').map(|i| search + i) {
        match param_at(raw, i) {
            Some((name, value, end)) => {
                outside.push_str(&raw[pos..i]);
                params.insert(
                    name,
                    Value::String(trim_wrapping_newlines(value).to_owned()),
                );
                pos = end;
                search = end;
            }
            None => search = i + 1,
        }
        if search >= raw.len() {
            break;
        }
    }
    if partial {
        let tail = outside + &raw[pos..];
        if let Some((name, value)) = open_param(&tail) {
            params.insert(
                name,
                Value::String(trim_wrapping_newlines(value).to_owned()),
            );
        }
    }
    crate::template::json_dumps(&Value::Object(params))
}

fn trim_wrapping_newlines(v: &str) -> &str {
    let v = v.strip_prefix('\n').unwrap_or(v);
    v.strip_suffix('\n').unwrap_or(v)
}

/// `<\s*parameter\s*=\s*` at `at`: the byte after it.
fn opener_at(s: &str, at: usize) -> Option<usize> {
    let rest = s[at..].strip_prefix('<')?;
    let rest = rest.trim_start_matches(py_space);
    let rest = rest.strip_prefix("parameter")?;
    let rest = rest.trim_start_matches(py_space);
    let rest = rest.strip_prefix('=')?;
    let rest = rest.trim_start_matches(py_space);
    Some(s.len() - rest.len())
}

/// `<\s*/\s*parameter\s*>` at `at`: the byte after it.
fn closer_at(s: &str, at: usize) -> Option<usize> {
    let rest = s[at..].strip_prefix('<')?;
    let rest = rest.trim_start_matches(py_space).strip_prefix('/')?;
    let rest = rest
        .trim_start_matches(py_space)
        .strip_prefix("parameter")?;
    let rest = rest.trim_start_matches(py_space).strip_prefix('>')?;
    Some(s.len() - rest.len())
}

/// `_PARAM_RE` matched at `at`: name, value, end.
fn param_at(s: &str, at: usize) -> Option<(String, &str, usize)> {
    let name_at = opener_at(s, at)?;
    let gt = s[name_at..].find('>')? + name_at;
    let value_at = gt + 1;
    let mut i = value_at;
    while let Some(j) = s[i..].find('<').map(|j| i + j) {
        if let Some(end) = closer_at(s, j) {
            return Some((s[name_at..gt].to_owned(), &s[value_at..j], end));
        }
        if opener_at(s, j).is_some() {
            return Some((s[name_at..gt].to_owned(), &s[value_at..j], j));
        }
        i = j + 1;
    }
    None
}

/// `_PARTIAL_PARAM_RE.search`: the first `<parameter=NAME>` (a non-empty name) and the rest.
fn open_param(s: &str) -> Option<(String, &str)> {
    let mut search = 0;
    while let Some(i) = s[search..].find('<').map(|i| search + i) {
        if let Some(name_at) = opener_at(s, i)
            && let Some(gt) = s[name_at..].find('>').map(|g| name_at + g)
            && gt > name_at
        {
            return Some((s[name_at..gt].to_owned(), &s[gt + 1..]));
        }
        search = i + 1;
    }
    None
}

/// `ParserEngine._safe_arg_prefix`: the JSON up to its last top-level value, that value
/// included only as far as it is a string of a key in `string_keys` (all keys: `None`).
fn safe_arg_prefix(json: &str, string_keys: Option<&Vec<String>>) -> String {
    let mut last_colon: Option<usize> = None;
    let mut last_key: Option<String> = None;
    let mut pending_key: Option<String> = None;
    let mut in_string = false;
    let mut escape = false;
    let mut string_start = 0;
    let mut depth = 0i64;
    for (i, c) in json.char_indices() {
        if escape {
            escape = false;
            continue;
        }
        if in_string {
            if c == '\\' {
                escape = true;
            } else if c == '"' {
                in_string = false;
                if depth == 1 {
                    pending_key = Some(json[string_start + 1..i].to_owned());
                }
            }
            continue;
        }
        match c {
            '"' => {
                in_string = true;
                string_start = i;
            }
            '{' | '[' => depth += 1,
            '}' | ']' => depth -= 1,
            ':' if depth == 1 => {
                last_colon = Some(i);
                last_key = pending_key.take();
            }
            _ => {}
        }
    }
    let Some(colon) = last_colon else {
        return String::new();
    };
    let mut end = colon + 1;
    let bytes = json.as_bytes();
    while end < bytes.len() && matches!(bytes[end], b' ' | b'\t' | b'\n' | b'\r') {
        end += 1;
    }
    if end >= bytes.len() || bytes[end] != b'"' {
        return json[..end].to_owned();
    }
    if let Some(keys) = string_keys
        && !last_key.as_ref().is_some_and(|k| keys.contains(k))
    {
        return json[..end].to_owned();
    }
    let mut escape = false;
    for (i, c) in json[end + 1..].char_indices() {
        if escape {
            escape = false;
            continue;
        }
        if c == '\\' {
            escape = true;
            continue;
        }
        if c == '"' {
            return json[..end + 1 + i].to_owned();
        }
    }
    json.to_owned()
}

/// The properties of the parameter schema of the first tool named `name`.
fn tool_properties<'a>(tools: &'a [Value], name: &str) -> Option<&'a Map<String, Value>> {
    let tool = tools.iter().find(|t| {
        let f = t.get("function").unwrap_or(t);
        f.get("name").and_then(Value::as_str) == Some(name)
    })?;
    let f = tool.get("function").unwrap_or(tool);
    f.get("parameters")
        .or_else(|| f.get("input_schema"))
        .and_then(|p| p.get("properties"))
        .and_then(Value::as_object)
}

/// `_streamable_string_keys`: `None` without properties, else the keys typed only `string`.
fn string_keys(tools: &[Value], name: &str) -> Option<Vec<String>> {
    let props = tool_properties(tools, name).filter(|p| !p.is_empty())?;
    Some(
        props
            .iter()
            .filter(|(_, s)| {
                let t = schema_types(s);
                t.len() == 1 && t[0] == "string"
            })
            .map(|(k, _)| k.clone())
            .collect(),
    )
}

/// `ParserEngine._fix_arg_types`: the values typed by the tool's schema, re-dumped only when
/// one changed.
fn fix_arg_types(args: &str, name: &str, tools: &[Value]) -> String {
    if tools.is_empty() || name.is_empty() {
        return args.to_owned();
    }
    let Ok(Value::Object(mut parsed)) = serde_json::from_str::<Value>(args) else {
        return args.to_owned();
    };
    let Some(props) = tool_properties(tools, name).filter(|p| !p.is_empty()) else {
        return args.to_owned();
    };
    if coerce_dict(&mut parsed, props) {
        crate::template::json_dumps(&Value::Object(parsed))
    } else {
        args.to_owned()
    }
}

fn coerce_dict(args: &mut Map<String, Value>, props: &Map<String, Value>) -> bool {
    let mut changed = false;
    for (key, value) in args.iter_mut() {
        if let Some(schema @ Value::Object(_)) = props.get(key) {
            changed |= coerce_value(value, schema);
        }
    }
    changed
}

/// `ParserEngine._coerce_value`, in place; whether it changed.
fn coerce_value(value: &mut Value, schema: &Value) -> bool {
    match value {
        Value::String(s) => match coerce_to_schema_type(s, &schema_types(schema)) {
            Some(v) => {
                *value = v;
                true
            }
            None => false,
        },
        Value::Object(m) => match schema.get("properties") {
            Some(Value::Object(p)) => coerce_dict(m, p),
            _ => false,
        },
        Value::Array(items) => match schema.get("items") {
            Some(items_schema @ Value::Object(_)) => {
                let mut changed = false;
                for item in items.iter_mut() {
                    changed |= coerce_value(item, items_schema);
                }
                changed
            }
            _ => false,
        },
        other => {
            let as_str = crate::template::json_dumps(other);
            let coerced = coerce_to_schema_type(&as_str, &schema_types(schema))
                .unwrap_or(Value::String(as_str));
            if py_type(&coerced) != py_type(other) || !py_eq(&coerced, other) {
                *other = coerced;
                true
            } else {
                false
            }
        }
    }
}

fn py_type(v: &Value) -> u8 {
    match v {
        Value::Null => 0,
        Value::Bool(_) => 1,
        Value::Number(n) if n.is_f64() => 3,
        Value::Number(_) => 2,
        Value::String(_) => 4,
        Value::Array(_) => 5,
        Value::Object(_) => 6,
    }
}

fn py_eq(a: &Value, b: &Value) -> bool {
    match (a, b) {
        (Value::Number(x), Value::Number(y)) => x.as_f64() == y.as_f64(),
        _ => a == b,
    }
}

/// `extract_types_from_schema`.
fn schema_types(schema: &Value) -> Vec<String> {
    let Value::Object(s) = schema else {
        return vec!["string".to_owned()];
    };
    let mut types: Vec<String> = Vec::new();
    let mut add = |t: &str| {
        if !types.iter().any(|x| x == t) {
            types.push(t.to_owned());
        }
    };
    match s.get("type") {
        Some(Value::String(t)) => add(t),
        Some(Value::Array(ts)) => ts.iter().filter_map(Value::as_str).for_each(&mut add),
        _ => {}
    }
    if let Some(Value::Array(values)) = s.get("enum") {
        for v in values {
            add(match v {
                Value::Null => "null",
                Value::Bool(_) => "boolean",
                Value::Number(n) if n.is_f64() => "number",
                Value::Number(_) => "integer",
                Value::String(_) => "string",
                Value::Array(_) => "array",
                Value::Object(_) => "object",
            });
        }
    }
    for field in ["anyOf", "oneOf", "allOf"] {
        if let Some(Value::Array(choices)) = s.get(field) {
            for c in choices {
                for t in schema_types(c) {
                    add(&t);
                }
            }
        }
    }
    if types.is_empty() {
        types.push("string".to_owned());
    }
    types
}

/// `coerce_to_schema_type`: `None` where it returns the value itself (unchanged).
fn coerce_to_schema_type(value: &str, types: &[String]) -> Option<Value> {
    let norm: Vec<String> = types
        .iter()
        .map(|t| {
            let t = t.trim().to_lowercase();
            match t.as_str() {
                "str" | "text" | "varchar" | "char" | "enum" => "string".to_owned(),
                "int" | "int32" | "int64" | "uint" | "uint32" | "uint64" | "long" | "short"
                | "unsigned" => "integer".to_owned(),
                "float" | "float32" | "float64" | "double" => "number".to_owned(),
                "bool" => "boolean".to_owned(),
                "dict" => "object".to_owned(),
                "arr" | "list" | "sequence" => "array".to_owned(),
                _ => t,
            }
        })
        .collect();
    let has = |t: &str| norm.iter().any(|n| n == t);
    for candidate in [
        "null", "integer", "number", "boolean", "object", "array", "string",
    ] {
        if !has(candidate) {
            continue;
        }
        match candidate {
            "null" => {
                if value.to_lowercase() == "null" {
                    return Some(Value::Null);
                }
            }
            "string" => return None,
            "integer" => {
                if let Some(i) = py_int(value) {
                    return Some(i);
                }
            }
            "number" => {
                if let Some(i) = py_int(value) {
                    return Some(i);
                }
                if let Some(f) = py_float(value).filter(|f| f.is_finite()) {
                    return Some(if f.fract() == 0.0 && f.abs() < 9.0e15 {
                        Value::from(f as i64)
                    } else {
                        Value::from(f)
                    });
                }
            }
            "boolean" => match value.trim().to_lowercase().as_str() {
                "true" | "1" => return Some(Value::Bool(true)),
                "false" | "0" => return Some(Value::Bool(false)),
                _ => {}
            },
            _ => {
                if let Ok(v) = serde_json::from_str::<Value>(value) {
                    return Some(v);
                }
            }
        }
    }
    serde_json::from_str::<Value>(value).ok()
}

/// Python's `int(str)`: surrounding whitespace, a sign, digits with single `_` between.
fn py_int(s: &str) -> Option<Value> {
    let t = s.trim();
    let digits = t.strip_prefix(['+', '-']).unwrap_or(t);
    if digits.is_empty()
        || digits.starts_with('_')
        || digits.ends_with('_')
        || digits.contains("__")
        || !digits.chars().all(|c| c.is_ascii_digit() || c == '_')
    {
        return None;
    }
    let clean: String = t.chars().filter(|&c| c != '_').collect();
    clean
        .parse::<i64>()
        .map(Value::from)
        .or_else(|_| clean.parse::<u64>().map(Value::from))
        .ok()
}

/// Python's `float(str)` for the shapes a model writes.
fn py_float(s: &str) -> Option<f64> {
    let t = s.trim();
    if t.contains("__") || t.starts_with('_') || t.ends_with('_') {
        return None;
    }
    t.replace('_', "").parse::<f64>().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn qwen3_params_close_at_the_next_opener_and_partial_keeps_the_open_one() {
        let raw = "\n<parameter=a>\n1\n</parameter>\n<parameter=b>x<parameter=c>\nhal";
        assert_eq!(qwen3_args(raw, false), r#"{"a": "1", "b": "x"}"#);
        assert_eq!(qwen3_args(raw, true), r#"{"a": "1", "b": "x", "c": "hal"}"#);
    }

    #[test]
    fn safe_prefix_stops_before_a_trailing_value_that_is_not_a_streamed_string() {
        assert_eq!(
            safe_arg_prefix(r#"{"a": "x", "b": 3}"#, None),
            r#"{"a": "x", "b": "#
        );
        assert_eq!(safe_arg_prefix(r#"{"a": "xy"}"#, None), r#"{"a": "xy"#);
        let keys = vec!["z".to_owned()];
        assert_eq!(safe_arg_prefix(r#"{"a": "xy"}"#, Some(&keys)), r#"{"a": "#);
    }

    #[test]
    fn values_are_typed_as_vllm_types_them() {
        let s = |t: &str| vec![t.to_owned()];
        assert_eq!(
            coerce_to_schema_type(" 7 ", &s("integer")),
            Some(Value::from(7))
        );
        assert_eq!(
            coerce_to_schema_type("3.0", &s("float")),
            Some(Value::from(3))
        );
        assert_eq!(coerce_to_schema_type("yes", &s("boolean")), None);
        assert_eq!(
            coerce_to_schema_type("true", &s("integer")),
            Some(Value::Bool(true))
        );
        assert_eq!(coerce_to_schema_type("42", &s("string")), None);
    }
}

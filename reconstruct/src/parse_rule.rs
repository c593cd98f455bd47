//! Which parsing one call's output gets, decided from its request the way SGLang's chat
//! server decides it (graft's exact backend is SGLang; where vLLM differs it is said below).
//!
//! # The rule (SGLang 0.5.23, `srt/entrypoints/openai/serving_chat.py`)
//! - **Tool calls are parsed** only when the server has a tool-call parser, the request
//!   declares tools, and `tool_choice` is not `"none"` (`_tool_call_parsing_active`; with no
//!   tools "tool_choice only holds its default and limits nothing", and no hermes / qwen25 /
//!   qwen3_coder / llama3 detector `parses_without_tools`). Otherwise the model's
//!   `<tool_call>` text is left in the content as it is (`FunctionCallParser.has_tool_call`
//!   and `parse_non_stream` return the text untouched without tools).
//! - **`"auto"`** (and a request with tools but no `tool_choice`): the family's detector.
//! - **`"required"` and a named function**: SGLang constrains the decode (for these formats
//!   a structural tag in the model's own `<tool_call>` syntax with `at_least_one`,
//!   `FunctionCallParser.get_structure_constraint` → `get_legacy_structural_tag`, or the
//!   xgrammar `qwen_3_coder` tag) and then parses the output with the same detector
//!   (`_process_tool_calls`: `owns_tool_format()` is true because the detector
//!   `supports_structural_tag`); when no call parses, the text stays content. Only formats
//!   without a structural tag (e.g. `pythonic`) fall back to a JSON-schema constraint whose
//!   output is read as a JSON list of `{"name", "parameters"}`. So the parse side of
//!   `required` / named equals `auto` here. graft's exact mode sends the same structural
//!   tags to `/generate`: the legacy one for the `hermes` and `llama3` formats, xgrammar's
//!   built-in `qwen_3_coder` tag for `qwen3_coder` (`gateway/src/sglang.rs`).
//! - **Calls to undeclared functions** (Hermes and Llama 3 JSON bodies) are not calls
//!   (`BaseFormatDetector.parse_base_json` skips them). SGLang's message holds the text before
//!   the first tool-call tag and the calls that parse, nothing else
//!   (`_process_tool_calls`, the detectors' `detect_and_parse`); so does graft's for the
//!   SGLang rule, with a note for each thing dropped (the recorded ids keep everything).
//! - **Reasoning** (`--reasoning-parser qwen3`, `Qwen3Detector`): `force_reasoning` is on
//!   when the template opens the think block itself or thinking is on for the request
//!   (`_get_reasoning_from_request`: `chat_template_kwargs.enable_thinking` is not `false`,
//!   the Qwen3 templates' default). Forced, the output is reasoning from its first character
//!   (a leading `<think>` is dropped) until `</think>` or `<tool_call>`; with no end at all it
//!   is all reasoning ("assume reasoning was truncated"). Not forced, only a `<think>` opens
//!   reasoning; an output without one is all content.
//!
//! # vLLM (0.34, `vllm/parser/abstract_parser.py` `_extract_tool_calls`)
//! - `"none"`: no calls; its engine-based parsers (Qwen3) still run and strip the tool-call
//!   markup from the content, where SGLang leaves it.
//! - `"required"` and a named function: with `VLLM_ENFORCE_STRICT_TOOL_CALLING` (on by
//!   default) the parsers graft's formats map to (`hermes`, `qwen3_coder`, `llama3_json`) have
//!   a structural tag and `supports_required_and_named = False`: the decode is constrained in
//!   the model's own syntax and the output is parsed like `auto`. With it off: guided JSON,
//!   the output read as a JSON list of `{"name", "parameters"}` under `required`
//!   (`TypeAdapter(list[FunctionDefinition])`) or as the named function's arguments, content
//!   `None` ([`ForcedCalls`]).
//! - `"auto"` requires `--enable-auto-tool-choice`; without tools no parsing.
//! - **Hermes** (`--tool-call-parser hermes`, Qwen2.5 / Qwen3): calls to undeclared functions
//!   are calls; the content is the text before the first `<tool_call>`; the whole answer and
//!   the streamed one differ ([`VllmHermes`]: whole, one region that does not parse leaves
//!   the whole answer as content; streamed, each region is sent as far as it reads, its
//!   arguments as the model wrote them). The reference is vLLM's own parser run on the
//!   fixtures (`scripts/vllm-parse-fixtures.py`).
//! - **Reasoning** (`--reasoning-parser qwen3`, the engine-based `Qwen3Parser`): it starts in
//!   reasoning when the request thinks (`chat_template_kwargs.enable_thinking` not `false`,
//!   whatever the template: a template without the toggle thinks too), as SGLang's forced
//!   reasoning, and looks for no reasoning at all when it does not.
//! - **`parallel_tool_calls: false`** (Anthropic: `disable_parallel_tool_use`): only the first
//!   call is in the message, whole and streamed (`maybe_filter_parallel_tool_calls`); SGLang
//!   applies the flag to its decode constraint only and shows every call parsed.
//! - **Engine-based** `qwen3_coder` and `llama3_json` (`vllm/parser/qwen3.py`,
//!   `llama_json.py`): transcribed in [`crate::vllm_engine`], run on every answer of these
//!   formats (also without tools and under `none`, as vLLM runs it), unless the decode was
//!   held to vLLM's JSON ([`ForcedCalls`]). Reference: vLLM's own engine run on the fixtures
//!   (`scripts/vllm-engine-parse-fixtures.py`).
//!
//! [`ParseRule::as_vllm`] gives these their vLLM reading.

use serde_json::Value;

use crate::parser::{ForcedCalls, OutputParser, ReasoningFormat, ToolCallFormat, VllmHermes};
use crate::vllm_engine::{EngineFormat, EngineRequest};

/// A request's `tool_choice`, in Chat Completions form.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ToolChoice {
    /// `"auto"`, or absent.
    Auto,
    /// `"none"`.
    None,
    /// `"required"`.
    Required,
    /// `{"type": "function", "function": {"name": ...}}`.
    Function(String),
}

impl ToolChoice {
    /// Reads a Chat Completions `tool_choice` (absent or unknown shapes are `Auto`, the
    /// servers' default when tools are given).
    pub fn from_chat(value: Option<&Value>) -> Self {
        match value {
            Some(Value::String(s)) if s == "none" => Self::None,
            Some(Value::String(s)) if s == "required" => Self::Required,
            Some(Value::Object(o)) => o
                .get("function")
                .and_then(|f| f.get("name"))
                .or_else(|| o.get("name"))
                .and_then(Value::as_str)
                .map_or(Self::Auto, |n| Self::Function(n.to_owned())),
            _ => Self::Auto,
        }
    }
}

/// How one call's output is parsed: the configured formats narrowed by its request.
#[derive(Debug, Clone)]
pub struct ParseRule {
    /// The format calls are parsed in; [`ToolCallFormat::None`] when this request parses none.
    pub tool_format: ToolCallFormat,
    /// The server's tool-call parser, whatever this request does with it (vLLM's engine
    /// runs it on every answer).
    configured_format: ToolCallFormat,
    pub reasoning_format: ReasoningFormat,
    /// The output starts inside reasoning (SGLang's `force_reasoning`).
    pub force_reasoning: bool,
    pub tool_choice: ToolChoice,
    tools: Vec<Value>,
    /// vLLM's reading of forced calls ([`ParseRule::as_vllm`]).
    pub forced: Option<ForcedCalls>,
    /// The rule is vLLM's ([`ParseRule::as_vllm`]); else SGLang's.
    vllm: bool,
    /// The client streams ([`ParseRule::streamed`]).
    streamed: bool,
    /// The request sent `parallel_tool_calls: false` ([`ParseRule::parallel_tool_calls`]).
    single_call: bool,
}

impl ParseRule {
    /// `format` / `reasoning`: the server's parsers (graft's `exact.tool_call_format` and
    /// `exact.reasoning_format`). `tools`: the request's tool definitions (Chat form);
    /// `tool_choice`: its choice ([`ToolChoice::from_chat`] reads the Chat form). Reasoning
    /// starts unforced; see [`ParseRule::with_thinking`].
    pub fn new(
        format: ToolCallFormat,
        reasoning: ReasoningFormat,
        tools: &[Value],
        tool_choice: ToolChoice,
    ) -> Self {
        let parses =
            format != ToolCallFormat::None && !tools.is_empty() && tool_choice != ToolChoice::None;
        Self {
            tool_format: if parses { format } else { ToolCallFormat::None },
            configured_format: format,
            reasoning_format: reasoning,
            force_reasoning: false,
            tool_choice,
            tools: tools.to_vec(),
            forced: None,
            vllm: false,
            streamed: false,
            single_call: false,
        }
    }

    /// The rule of vLLM's chat server where it differs. `strict_tool_calling`: the server's
    /// `VLLM_ENFORCE_STRICT_TOOL_CALLING` (vLLM's default: on). On, the formats graft parses
    /// all have a structural tag, so `required` and a named function are constrained to the
    /// model's own markup and parsed like `auto` (`supports_required_and_named` is off). Off,
    /// vLLM constrains them to JSON and reads the answer as calls ([`ForcedCalls`]) instead
    /// of parsing the model's tool-call markup.
    #[must_use]
    pub fn as_vllm(mut self, strict_tool_calling: bool) -> Self {
        self.vllm = true;
        if self.parses_tool_calls() && !strict_tool_calling {
            self.forced = match &self.tool_choice {
                ToolChoice::Required => Some(ForcedCalls::Required),
                ToolChoice::Function(name) => Some(ForcedCalls::Named(name.clone())),
                ToolChoice::Auto | ToolChoice::None => None,
            };
        }
        self
    }

    /// `thinking`: the request thinks (`enable_thinking` not `false`) or the prompt opened the
    /// think block; with a `think` reasoning parser the output then starts in reasoning.
    #[must_use]
    pub fn with_thinking(mut self, thinking: bool) -> Self {
        self.force_reasoning = thinking && self.reasoning_format == ReasoningFormat::Think;
        self
    }

    /// The client streams the answer. vLLM's Hermes parser makes a different message of the
    /// same output whole and streamed ([`crate::parser::VllmHermes`]); SGLang's does not.
    #[must_use]
    pub fn streamed(mut self, streamed: bool) -> Self {
        self.streamed = streamed;
        self
    }

    /// The request's `parallel_tool_calls` (Chat and Responses; Anthropic's
    /// `disable_parallel_tool_use` read as its negation, as vLLM's Messages endpoint reads it).
    /// `false` on vLLM: only the first call reaches the message
    /// ([`OutputParser::first_call_only`]); SGLang only constrains the decode with it.
    #[must_use]
    pub fn parallel_tool_calls(mut self, parallel: Option<bool>) -> Self {
        self.single_call = parallel == Some(false);
        self
    }

    /// Whether this request's output is parsed for tool calls at all.
    pub fn parses_tool_calls(&self) -> bool {
        self.tool_format != ToolCallFormat::None
    }

    /// The streaming parser for this call (tool schemas known, undeclared JSON calls not
    /// calls). SGLang's rule gives SGLang's message ([`OutputParser::sglang_message`]: after
    /// the first tool-call tag only the calls that parse); vLLM's keeps what is not a call as
    /// content, with a note (vLLM's own handling is not transcribed here).
    pub fn parser(&self) -> OutputParser {
        let single = self.vllm && self.single_call;
        if let Some(engine) = self.vllm_engine() {
            return OutputParser::new(self.tool_format, ReasoningFormat::None, false)
                .vllm_engine(engine)
                .first_call_only(single);
        }
        // vLLM's Qwen3 parser does not look for reasoning at all when the request does not
        // think (`Qwen3Parser.extract_reasoning` returns the whole output as content).
        let reasoning = if self.vllm && !self.force_reasoning {
            ReasoningFormat::None
        } else {
            self.reasoning_format
        };
        let parser = OutputParser::new(self.tool_format, reasoning, self.force_reasoning)
            .with_schemas(&self.tools)
            .declared_only()
            .with_forced(self.forced.clone());
        if self.vllm {
            parser
                .vllm_hermes(if self.streamed {
                    VllmHermes::Streamed
                } else {
                    VllmHermes::Whole
                })
                .first_call_only(single)
        } else {
            parser.sglang_message()
        }
    }
}

impl ParseRule {
    /// vLLM's engine-based parsers read this request's answer: the `qwen3_coder` and `llama3`
    /// formats on the vLLM wire, unless the decode was held to vLLM's JSON ([`ForcedCalls`]).
    fn vllm_engine(&self) -> Option<EngineRequest> {
        if !self.vllm || self.forced.is_some() {
            return None;
        }
        let format = match self.configured_format {
            ToolCallFormat::Qwen3Coder => EngineFormat::Qwen3,
            ToolCallFormat::Llama3 => EngineFormat::LlamaJson,
            ToolCallFormat::Hermes | ToolCallFormat::None => return None,
        };
        let reasoning_parser = self.reasoning_format == ReasoningFormat::Think;
        Some(EngineRequest {
            format,
            reasoning_parser,
            thinking: reasoning_parser && self.force_reasoning,
            tools: self.tools.clone(),
            suppress: self.tool_choice == ToolChoice::None && !self.tools.is_empty(),
            keep_calls: self.parses_tool_calls(),
            streamed: self.streamed,
        })
    }
}

/// Whether a request thinks, as SGLang reads it for templates with an `enable_thinking`
/// toggle that defaults to on (Qwen3): anything but an explicit `false`.
pub fn thinking_enabled(template_kwargs: Option<&serde_json::Map<String, Value>>) -> bool {
    template_kwargs
        .and_then(|k| k.get("enable_thinking"))
        .and_then(Value::as_bool)
        != Some(false)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn tool_choice_shapes() {
        assert_eq!(ToolChoice::from_chat(None), ToolChoice::Auto);
        assert_eq!(
            ToolChoice::from_chat(Some(&json!("none"))),
            ToolChoice::None
        );
        assert_eq!(
            ToolChoice::from_chat(Some(&json!("required"))),
            ToolChoice::Required
        );
        assert_eq!(
            ToolChoice::from_chat(Some(
                &json!({"type": "function", "function": {"name": "f"}})
            )),
            ToolChoice::Function("f".into())
        );
    }

    #[test]
    fn parsing_needs_tools_a_parser_and_a_choice_other_than_none() {
        let tools = [json!({"type": "function", "function": {"name": "f"}})];
        let h = ToolCallFormat::Hermes;
        let t = ReasoningFormat::Think;
        assert!(!ParseRule::new(h, t, &[], ToolChoice::Auto).parses_tool_calls());
        assert!(!ParseRule::new(h, t, &[], ToolChoice::Required).parses_tool_calls());
        assert!(!ParseRule::new(h, t, &tools, ToolChoice::None).parses_tool_calls());
        assert!(
            !ParseRule::new(ToolCallFormat::None, t, &tools, ToolChoice::Auto).parses_tool_calls()
        );
        for choice in [None, Some(json!("auto")), Some(json!("required"))] {
            let choice = ToolChoice::from_chat(choice.as_ref());
            assert!(ParseRule::new(h, t, &tools, choice).parses_tool_calls());
        }
        assert!(thinking_enabled(None));
        let off = json!({"enable_thinking": false});
        assert!(!thinking_enabled(off.as_object()));
        assert!(
            !ParseRule::new(h, ReasoningFormat::None, &tools, ToolChoice::Auto)
                .with_thinking(true)
                .force_reasoning
        );
    }
}

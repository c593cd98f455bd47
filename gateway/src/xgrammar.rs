//! xgrammar's structural-tag formats as JSON, the way its pydantic models dump
//! (`xgrammar/structural_tag.py`, `model_dump()`: every field in declaration order, defaults
//! included), and xgrammar's built-in tags of the call formats graft parses
//! (`builtin_structural_tag.py`, reasoning disabled). Both servers' chat endpoints send these:
//! SGLang 0.5.23 pins xgrammar 0.2.7 ([`crate::sglang`]), vLLM 0.34.0 pins 0.2.8
//! ([`crate::vllm`]), whose `json_schema` format has one more field (`excludes`).

use serde_json::{Value, json};

/// The xgrammar release whose models write the JSON.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Release {
    /// SGLang 0.5.23's.
    V0_2_7,
    /// vLLM 0.34.0's: `JSONSchemaFormat.excludes` added.
    V0_2_8,
}

/// `JSONSchemaFormat`: arguments held to `schema` (`true`: any JSON) in `style` (`json`,
/// `qwen_xml`, ...).
pub fn json_schema(schema: Value, style: &str, release: Release) -> Value {
    let mut f = json!({
        "type": "json_schema",
        "json_schema": schema,
        "style": style,
        "any_order": false,
        "max_whitespace_cnt": null,
    });
    if release == Release::V0_2_8
        && let Some(o) = f.as_object_mut()
    {
        o.insert("excludes".into(), json!([]));
    }
    f
}

/// `TagFormat`.
pub fn tag(begin: String, content: Value, end: &str) -> Value {
    json!({"type": "tag", "begin": begin, "content": content, "end": end})
}

/// `TriggeredTagsFormat`: free text where any trigger opens one of the tags.
pub fn triggered_tags(
    triggers: &[&str],
    tags: Vec<Value>,
    at_least_one: bool,
    stop_after_first: bool,
    excludes: &[&str],
) -> Value {
    json!({
        "type": "triggered_tags",
        "triggers": triggers,
        "tags": tags,
        "at_least_one": at_least_one,
        "stop_after_first": stop_after_first,
        "excludes": excludes,
    })
}

/// `TagsWithSeparatorFormat`: only tags, `separator` between them.
pub fn tags_with_separator(
    tags: Vec<Value>,
    separator: &str,
    at_least_one: bool,
    stop_after_first: bool,
) -> Value {
    json!({
        "type": "tags_with_separator",
        "tags": tags,
        "separator": separator,
        "at_least_one": at_least_one,
        "stop_after_first": stop_after_first,
    })
}

/// `OrFormat`.
pub fn or(elements: Vec<Value>) -> Value {
    json!({"type": "or", "elements": elements})
}

/// `StructuralTag`, the top of every tag.
pub fn structural_tag(format: Value) -> Value {
    json!({"type": "structural_tag", "format": format})
}

/// `normalize_tool_choice`'s simplified choice.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Choice<'a> {
    Auto,
    Required,
    /// A named function: its tag alone.
    Forced(&'a str),
}

/// A function tool as a tag builder sees it: its name and the schema its arguments are held
/// to (`true` for any; `_get_function_parameters` gives `true` where the tool is
/// `strict: false` or has no parameters).
#[derive(Debug, Clone)]
pub struct Function<'a> {
    pub name: &'a str,
    pub schema: Value,
}

/// A built-in model tag of xgrammar's (`register_model_structural_tag`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Builtin {
    /// `qwen_3_coder` (`get_qwen_3_5_structural_tag`): `<tool_call>\n<function=NAME>\n` …
    /// `\n</function>\n</tool_call>`, arguments in Qwen's XML style.
    Qwen3Coder,
    /// `llama` (`get_llama_structural_tag`): `{"name": "NAME", "parameters": ` … `}`.
    Llama,
}

/// The format of a built-in tag with reasoning disabled (no think prefix), for `tools`
/// under `choice`: under `auto` and `required` triggered tags, one per tool
/// (`at_least_one` under `required`, `stop_after_first` without parallel calls); under a
/// forced name that tool's tag alone. `None` without tools or for an undeclared name
/// (where xgrammar raises).
pub fn builtin(
    model: Builtin,
    tools: &[Function],
    choice: Choice,
    parallel_tool_calls: bool,
    release: Release,
) -> Option<Value> {
    const THINK: [&str; 2] = ["<think>", "</think>"];
    let (prefix, suffix, end, trigger, style) = match model {
        Builtin::Qwen3Coder => (
            "<tool_call>\n<function=",
            ">\n",
            "\n</function>\n</tool_call>",
            "<tool_call>\n<function=",
            "qwen_xml",
        ),
        Builtin::Llama => (
            "{\"name\": \"",
            "\", \"parameters\": ",
            "}",
            "{\"name\": ",
            "json",
        ),
    };
    let one = |t: &Function| {
        tag(
            format!("{prefix}{}{suffix}", t.name),
            json_schema(t.schema.clone(), style, release),
            end,
        )
    };
    if tools.is_empty() {
        return None;
    }
    let at_least_one = match choice {
        Choice::Forced(name) => return tools.iter().find(|t| t.name == name).map(one),
        Choice::Required => true,
        Choice::Auto => false,
    };
    Some(triggered_tags(
        &[trigger],
        tools.iter().map(one).collect(),
        at_least_one,
        !parallel_tool_calls,
        &THINK,
    ))
}

//! vLLM's token-in/token-out surface, exact mode's other backend wire (`exact.wire =
//! "vllm"`): `POST /v1/completions` with the prompt as token ids, `return_token_ids`,
//! `logprobs: 0` (the sampled token's logprob only) and `return_weight_versions`. The
//! types, the route chosen and vLLM's own semantics (read from vLLM 0.34.0's source) are in
//! [`graft_wire::vllm`].
//!
//! A Chat request's decode constraint is the `structured_outputs` vLLM's own chat server
//! would give its engine for it ([`structured_outputs`]: the response format, or the
//! tool-call constraint of vLLM's tool parser, a structural tag under vLLM's default
//! `VLLM_ENFORCE_STRICT_TOOL_CALLING`), held to vLLM's own output by
//! `tests/fixtures/vllm_structured_outputs.json`.
//!
//! The answers feed the same [`Progress`] as SGLang's: a streamed chunk carries the new ids
//! and their logprobs (vLLM streams deltas only), the last one `finish_reason`,
//! `stop_reason` and the weight-version spans over the whole output; a usage chunk with no
//! choices follows when `stream_options.include_usage` was asked. graft decodes the ids
//! itself: vLLM's `text` (which drops a stop token's text and trails the ids by up to a stop
//! string while streaming) is not read.

use graft_reconstruct::parser::ToolCallFormat;
use graft_recorder::WeightSpan;
use graft_wire::vllm::{
    self as wire, CompletionRequest, CompletionResponse, StopReason, StructuredOutputs,
};
use serde::Deserialize as _;
use serde_json::{Value, json};

use crate::dialect::{OutputFormat, Sampling, Tool, ToolChoice};
use crate::sglang::{FinishReason, Progress};
use crate::xgrammar::{self, Builtin, Choice, Function, Release};

/// The sampling keys of a `/v1/completions` body. `max_tokens` is always set: vLLM's own
/// default is 16.
pub fn sampling(s: &Sampling, default_max_tokens: u64) -> Value {
    let r = CompletionRequest {
        max_tokens: Some(s.max_tokens.unwrap_or(default_max_tokens)),
        temperature: s.temperature,
        top_p: s.top_p,
        // vLLM reads 0 and -1 as "no top-k"; absent says the same on every version.
        top_k: s
            .top_k
            .filter(|&k| k > 0)
            .map(|k| i64::try_from(k).unwrap_or(i64::MAX)),
        min_p: s.min_p,
        seed: s.seed,
        stop: s.stop.clone(),
        presence_penalty: s.presence_penalty,
        frequency_penalty: s.frequency_penalty,
        repetition_penalty: s.repetition_penalty,
        logit_bias: s.logit_bias.clone(),
        // The text vLLM sends is not read, but kept like SGLang's (`no_stop_trim`,
        // special tokens shown) so a record's body says what the ids decode to.
        include_stop_str_in_output: Some(true),
        skip_special_tokens: Some(false),
        // The response format's constraint; a Chat request's tools may replace it
        // ([`structured_outputs`]).
        structured_outputs: s.format.as_ref().map(response_format),
        ..CompletionRequest::default()
    };
    let mut v = serde_json::to_value(&r).unwrap_or(Value::Null);
    if let Some(o) = v.as_object_mut() {
        o.remove("prompt");
    }
    v
}

/// What vLLM's own chat server makes of `response_format`
/// (`structured_outputs_from_response_format`).
fn response_format(f: &OutputFormat) -> StructuredOutputs {
    match f {
        OutputFormat::JsonObject => StructuredOutputs {
            json_object: Some(true),
            ..Default::default()
        },
        OutputFormat::JsonSchema { schema, .. } => StructuredOutputs {
            json: Some(schema.clone()),
            ..Default::default()
        },
    }
}

/// The `structured_outputs` vLLM 0.34.0's chat server gives its engine for a Chat request,
/// run with `--enable-auto-tool-choice --tool-call-parser P` (P: `hermes`, `qwen3_coder` or
/// `llama3_json`, graft's three formats) and no `--tool-strict-level`: its
/// `DelegatingParser.adjust_request` (`vllm/parser/abstract_parser.py`:
/// `_apply_structural_tag`, then the tool parser's `adjust_request`), then
/// `extract_structured_outputs`. `strict_tool_calling` is the server's
/// `VLLM_ENFORCE_STRICT_TOOL_CALLING` (`exact.vllm_strict_tool_calling`, default on, as
/// vLLM's):
///
/// - On, each of these parsers has a structural-tag model (`hermes`: vLLM's own
///   `_hermes_style_structural_tag`; `qwen_3_coder` and `llama`: xgrammar's built-ins with
///   reasoning off) and `supports_required_and_named` is off, so the decode is held to the
///   model's own call syntax (`tool_parsers/structural_tag_registry.py`). Under `required`
///   and a named function always; under `auto` only when a tool is `strict: true` or
///   `parallel_tool_calls` is false (the strict level is raised to `function` for a single
///   call, except under `auto` with a response format). A tool's arguments are held to its
///   schema only where it is `strict: true` (`resolve_tool_strictness`; any JSON otherwise).
///   `parallel_tool_calls: false` stops every call list after its first call
///   (`limit_to_single_tool_call`). Under `auto` with a response format the tag is the
///   `required` one OR the format's schema (xgrammar is assumed to compile the schema;
///   vLLM keeps the format alone where it cannot, `_xgrammar_supports`); under `required` /
///   named the tag replaces the format. Sent as `json.dumps(tag.model_dump())` ([`py_dumps`]).
/// - Off: `required` / named get the JSON-schema constraint of [`tool_call_schema`] in
///   place of the format; `auto` keeps the format.
///
/// Without tools, under `none` or without a call format: the response format's constraint.
/// `None`: no constraint.
pub fn structured_outputs(
    format: ToolCallFormat,
    strict_tool_calling: bool,
    tools: &[Tool],
    choice: Option<&ToolChoice>,
    parallel_tool_calls: Option<bool>,
    output: Option<&OutputFormat>,
) -> Option<StructuredOutputs> {
    let plain = output.map(response_format);
    // vLLM's `check_tool_usage`: tools without a choice are `auto`.
    let choice = choice.unwrap_or(&ToolChoice::Auto);
    if format == ToolCallFormat::None || tools.is_empty() || *choice == ToolChoice::None {
        return plain;
    }
    if !strict_tool_calling {
        return match tool_call_schema(tools, Some(choice), parallel_tool_calls) {
            Some(schema) => Some(StructuredOutputs {
                json: Some(schema),
                ..Default::default()
            }),
            None => plain,
        };
    }
    let auto = *choice == ToolChoice::Auto;
    let single_call = parallel_tool_calls == Some(false);
    let strict = |t: &Tool| t.strict == Some(true);
    // `resolve_tool_strictness` at level `auto`: no tag for `auto` without a strict tool.
    let function_level = single_call && !(auto && output.is_some());
    if auto && !function_level && !tools.iter().any(strict) {
        return plain;
    }
    let functions: Vec<Function> = tools
        .iter()
        .map(|t| Function {
            name: &t.name,
            schema: match &t.parameters {
                p @ Value::Object(_) if strict(t) => p.clone(),
                _ => Value::Bool(true),
            },
        })
        .collect();
    // `auto` with a response format: the `required` tag, or the format.
    let or_output = output
        .filter(|_| auto)
        .map(|f| xgrammar::json_schema(f.schema(), "json", Release::V0_2_8));
    let tag_choice = match choice {
        _ if or_output.is_some() => Choice::Required,
        ToolChoice::Function { name } => Choice::Forced(name),
        ToolChoice::Required => Choice::Required,
        ToolChoice::Auto | ToolChoice::None => Choice::Auto,
    };
    let mut tag = match format {
        ToolCallFormat::Hermes => hermes_tag(&functions, tag_choice)?,
        ToolCallFormat::Qwen3Coder => xgrammar::builtin(
            Builtin::Qwen3Coder,
            &functions,
            tag_choice,
            true,
            Release::V0_2_8,
        )?,
        ToolCallFormat::Llama3 => xgrammar::builtin(
            Builtin::Llama,
            &functions,
            tag_choice,
            true,
            Release::V0_2_8,
        )?,
        ToolCallFormat::None => return plain,
    };
    if single_call {
        limit_to_single_tool_call(&mut tag);
    }
    if let Some(o) = or_output {
        tag = xgrammar::or(vec![tag, o]);
    }
    Some(StructuredOutputs {
        structural_tag: Some(py_dumps(&xgrammar::structural_tag(tag))),
        ..Default::default()
    })
}

/// vLLM's own `hermes` tag (`get_hermes_structural_tag` →
/// `_hermes_style_structural_tag`): two tags per tool, `<tool_call>\n{"name": "NAME",
/// "arguments": ` … `}\n</tool_call>` and the same without the newlines; under `auto`
/// triggered by `<tool_call>`, under `required` only calls (at least one), under a named
/// function that tool's call alone. `None` for an undeclared name.
fn hermes_tag(functions: &[Function], choice: Choice) -> Option<Value> {
    const FORMS: [(&str, &str); 2] = [
        ("<tool_call>\n{\"name\": \"", "}\n</tool_call>"),
        ("<tool_call>{\"name\": \"", "}</tool_call>"),
    ];
    let named = match choice {
        Choice::Forced(name) => Some(name),
        Choice::Auto | Choice::Required => None,
    };
    let tags: Vec<Value> = functions
        .iter()
        .filter(|f| named.is_none_or(|n| f.name == n))
        .flat_map(|f| {
            FORMS.map(|(begin, end)| {
                xgrammar::tag(
                    format!("{begin}{}\", \"arguments\": ", f.name),
                    xgrammar::json_schema(f.schema.clone(), "json", Release::V0_2_8),
                    end,
                )
            })
        })
        .collect();
    if tags.is_empty() {
        return None;
    }
    Some(match choice {
        Choice::Auto => xgrammar::triggered_tags(&["<tool_call>"], tags, false, false, &[]),
        Choice::Forced(_) => xgrammar::tags_with_separator(tags, "", true, true),
        Choice::Required => xgrammar::tags_with_separator(tags, "", true, false),
    })
}

/// vLLM's `limit_to_single_tool_call`: every call list of the tag (`triggered_tags`,
/// `token_triggered_tags`, `tags_with_separator`) stops after its first call. Argument
/// schemas are data, not formats: not entered.
fn limit_to_single_tool_call(format: &mut Value) {
    match format {
        Value::Object(o) => {
            if matches!(
                o.get("type").and_then(Value::as_str),
                Some("triggered_tags" | "token_triggered_tags" | "tags_with_separator")
            ) {
                o.insert("stop_after_first".into(), Value::Bool(true));
            }
            for (k, v) in o.iter_mut() {
                if k != "json_schema" {
                    limit_to_single_tool_call(v);
                }
            }
        }
        Value::Array(a) => a.iter_mut().for_each(limit_to_single_tool_call),
        _ => {}
    }
}

/// `json.dumps(v)` as Python writes it, so the string is the one vLLM sends: `", "` and
/// `": "` between items, everything outside printable ASCII as `\uXXXX` (UTF-16, lowercase
/// hex), floats as `repr` writes them (`1e-05`, `1e+16`, `100.0`).
pub fn py_dumps(v: &Value) -> String {
    use serde::Serialize as _;
    use std::io::{self, Write};
    struct Python;
    impl serde_json::ser::Formatter for Python {
        fn begin_array_value<W: ?Sized + Write>(
            &mut self,
            w: &mut W,
            first: bool,
        ) -> io::Result<()> {
            if first { Ok(()) } else { w.write_all(b", ") }
        }
        fn begin_object_key<W: ?Sized + Write>(
            &mut self,
            w: &mut W,
            first: bool,
        ) -> io::Result<()> {
            if first { Ok(()) } else { w.write_all(b", ") }
        }
        fn begin_object_value<W: ?Sized + Write>(&mut self, w: &mut W) -> io::Result<()> {
            w.write_all(b": ")
        }
        fn write_string_fragment<W: ?Sized + Write>(
            &mut self,
            w: &mut W,
            fragment: &str,
        ) -> io::Result<()> {
            for c in fragment.chars() {
                if (' '..='~').contains(&c) {
                    w.write_all(&[c as u8])?;
                } else {
                    for unit in c.encode_utf16(&mut [0; 2]) {
                        write!(w, "\\u{unit:04x}")?;
                    }
                }
            }
            Ok(())
        }
        fn write_f64<W: ?Sized + Write>(&mut self, w: &mut W, value: f64) -> io::Result<()> {
            w.write_all(py_float(value).as_bytes())
        }
    }
    let mut out = Vec::new();
    let mut ser = serde_json::Serializer::with_formatter(&mut out, Python);
    // A `Value` always serializes; the output is ASCII.
    let _ = v.serialize(&mut ser);
    String::from_utf8(out).unwrap_or_default()
}

/// A finite float as Python's `repr`: positional for exponents -4..16 (at least one
/// decimal), else `d.ddde±XX`; the digits are the shortest that round-trip, as in Rust.
fn py_float(x: f64) -> String {
    let sci = format!("{x:e}");
    let (mantissa, exp) = sci.split_once('e').unwrap_or((&sci, "0"));
    let exp: i32 = exp.parse().unwrap_or(0);
    if (-4..16).contains(&exp) {
        if x.fract() == 0.0 {
            format!("{x:.1}")
        } else {
            format!("{x}")
        }
    } else {
        format!(
            "{mantissa}e{}{:02}",
            if exp < 0 { '-' } else { '+' },
            exp.abs()
        )
    }
}

/// The JSON schema vLLM's chat server constrains a forced call with when it runs with
/// `VLLM_ENFORCE_STRICT_TOOL_CALLING=0` (`get_json_schema_from_tools` in `vllm/tool_parsers/utils.py`, 0.34): under `required` a
/// non-empty list of `{"name": <one of the tools>, "parameters": <its schema>}` (at most one
/// with `parallel_tool_calls: false`, the tools' `$defs` gathered at the top); under a named
/// function that function's parameters. A tool without parameters takes an empty object's
/// schema. `None` for `auto`, `none`, or no tools.
pub fn tool_call_schema(
    tools: &[Tool],
    choice: Option<&ToolChoice>,
    parallel_tool_calls: Option<bool>,
) -> Option<Value> {
    let params = |t: &Tool| match &t.parameters {
        Value::Object(o) if !o.is_empty() => t.parameters.clone(),
        _ => json!({"type": "object", "properties": {}}),
    };
    if tools.is_empty() {
        return None;
    }
    match choice? {
        ToolChoice::Function { name } => tools.iter().find(|t| &t.name == name).map(params),
        ToolChoice::Required => {
            let mut defs = serde_json::Map::new();
            let any_of: Vec<Value> = tools
                .iter()
                .map(|t| {
                    let mut p = params(t);
                    if let Some(Value::Object(d)) =
                        p.as_object_mut().and_then(|o| o.remove("$defs"))
                    {
                        defs.extend(d);
                    }
                    json!({
                        "properties": {
                            "name": {"type": "string", "enum": [t.name]},
                            "parameters": p,
                        },
                        "required": ["name", "parameters"],
                    })
                })
                .collect();
            let mut schema = json!({
                "type": "array",
                "minItems": 1,
                "items": {"type": "object", "anyOf": any_of},
            });
            if parallel_tool_calls == Some(false) {
                schema["maxItems"] = json!(1);
            }
            if !defs.is_empty() {
                schema["$defs"] = Value::Object(defs);
            }
            Some(schema)
        }
        ToolChoice::Auto | ToolChoice::None => None,
    }
}

/// The `/v1/completions` body: the prompt ids, the sampling keys (as given, so nothing is
/// dropped), and what exact mode needs back.
/// `top`: the most likely alternatives the client asked for per token (`0`: the sampled
/// token's logprob only); they come back keyed by id (`return_tokens_as_token_ids`).
pub fn completions_body(
    input_ids: &[u32],
    sampling: Value,
    stream: bool,
    request_id: &str,
    top: u32,
) -> Value {
    // No `model`: vLLM then serves its own model (`_is_model_supported(None)`), while the
    // client's model name (a harness's "gpt-5") would be a 404 there.
    let req = CompletionRequest {
        prompt: input_ids.to_vec(),
        logprobs: Some(i64::from(top)),
        return_tokens_as_token_ids: (top > 0).then_some(true),
        return_token_ids: Some(true),
        return_weight_versions: Some(true),
        stream: Some(stream),
        // `stream_options` without `stream: true` is a 400 on vLLM.
        stream_options: stream.then_some(wire::StreamOptions {
            include_usage: Some(true),
            continuous_usage_stats: None,
        }),
        request_id: Some(request_id.to_string()),
        ..CompletionRequest::default()
    };
    let mut body = serde_json::to_value(&req).unwrap_or(Value::Null);
    if let (Some(o), Value::Object(s)) = (body.as_object_mut(), sampling) {
        o.extend(s);
    }
    body
}

/// `finish_reason` as exact mode reads it.
fn finish(reason: &str) -> Result<FinishReason, String> {
    match reason {
        "stop" => Ok(FinishReason::Stop),
        "length" => Ok(FinishReason::Length),
        "abort" => Ok(FinishReason::Abort(
            "vLLM aborted the request (finish_reason 'abort')".into(),
        )),
        other => Err(format!(
            "finish_reason {other:?} is not one exact mode asked for (vLLM sends one of {:?})",
            wire::FINISH_REASONS
        )),
    }
}

impl Progress {
    /// Takes one `/v1/completions` answer or streamed chunk; returns the ids that are new.
    pub fn push_vllm(&mut self, v: &Value) -> Result<Vec<u32>, String> {
        let answer = CompletionResponse::deserialize(v)
            .map_err(|e| format!("the answer is not vLLM's /v1/completions answer: {e}"))?;
        if let Some(u) = &answer.usage {
            self.prompt_tokens = Some(u.prompt_tokens);
            if let Some(d) = &u.prompt_tokens_details {
                self.cached_tokens = Some(d.cached_tokens);
            }
        }
        if !answer.id.is_empty() {
            self.id = Some(answer.id.clone());
        }
        if answer.choices.len() > 1 {
            return Err(format!(
                "{} choices for a request of one",
                answer.choices.len()
            ));
        }
        let Some(choice) = answer.choices.into_iter().next() else {
            // The usage chunk.
            return Ok(vec![]);
        };
        let Some(ids) = choice.token_ids else {
            return Err(
                "a choice has no 'token_ids': the server ignored return_token_ids (an older vLLM, or not vLLM): exact mode needs the sampled ids".into(),
            );
        };
        let before = self.output_ids.len() as u64;
        match choice.logprobs {
            Some(l) if l.token_logprobs.len() == ids.len() => {
                self.logprobs
                    .extend(l.token_logprobs.iter().map(|x| x.map(|x| x as f32)));
                // The candidates, in vLLM's order (the sampled token first), when asked for.
                if l.top_logprobs.iter().flatten().any(|m| !m.is_empty()) {
                    self.top_logprobs
                        .resize(before as usize, crate::sglang::TopLogprobs::new());
                    for m in &l.top_logprobs {
                        let mut top = crate::sglang::TopLogprobs::new();
                        for (k, v) in m.iter().flatten() {
                            let id = wire::token_id_of(k).ok_or_else(|| {
                                format!(
                                    "a top_logprobs key {k:?} is not 'token_id:N': the server ignored return_tokens_as_token_ids"
                                )
                            })?;
                            top.push((id, v.as_f64().map(|x| x as f32)));
                        }
                        self.top_logprobs.push(top);
                    }
                }
            }
            Some(l) => {
                return Err(format!(
                    "{} logprobs for {} token ids in one choice",
                    l.token_logprobs.len(),
                    ids.len()
                ));
            }
            // No logprobs: the count then disagrees and the record keeps none.
            None => {}
        }
        self.output_ids.extend_from_slice(&ids);
        if let Some(r) = &choice.finish_reason {
            self.finish = Some(finish(r)?);
            self.stop_reason = choice.stop_reason.clone().map(|s| match s {
                StopReason::Token(id) => Value::from(id),
                StopReason::Text(t) => Value::from(t),
            });
        }
        if let Some(spans) = choice.weight_versions {
            let spans: Vec<WeightSpan> = spans
                .into_iter()
                .map(|s| WeightSpan {
                    version: s.version,
                    start: s.start,
                    end: s.end,
                })
                .collect();
            if let Some(last) = spans.last() {
                self.weight_version = Some(last.version.clone());
            }
            self.report_spans(spans);
        }
        Ok(self.output_ids[before as usize..].to_vec())
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use serde_json::json;

    fn chunk(ids: &[u32], lps: &[f64], finish: Option<&str>, extra: Value) -> Value {
        let mut c = json!({"index": 0, "text": "x", "token_ids": ids,
            "logprobs": {"token_logprobs": lps, "tokens": ids.iter().map(|_| "t").collect::<Vec<_>>(),
                "text_offset": [], "top_logprobs": []},
            "finish_reason": finish, "stop_reason": null});
        if let (Some(o), Value::Object(e)) = (c.as_object_mut(), extra) {
            o.extend(e);
        }
        json!({"id": "cmpl-a-0", "object": "text_completion", "created": 1, "model": "m", "choices": [c]})
    }

    #[test]
    fn top_logprobs_keyed_by_id_are_read_in_vllms_order_and_text_keys_are_refused() {
        let with_top = |top: Value| {
            let mut c = chunk(&[5, 6], &[-0.5, -0.25], None, json!({}));
            c["choices"][0]["logprobs"]["top_logprobs"] = top;
            c
        };
        let mut p = Progress::default();
        // The sampled token first, then the candidates in rank order (a likelier one after it).
        let top = json!([{"token_id:5": -0.5, "token_id:9": -0.1}, {"token_id:6": -0.25, "token_id:7": -2.0}]);
        p.push_vllm(&with_top(top)).unwrap();
        assert_eq!(
            p.top_logprobs,
            vec![
                vec![(5, Some(-0.5)), (9, Some(-0.1))],
                vec![(6, Some(-0.25)), (7, Some(-2.0))]
            ]
        );
        // Empty maps (`logprobs: 0`) leave no candidates.
        let mut q = Progress::default();
        q.push_vllm(&with_top(json!([{}, {}]))).unwrap();
        assert!(q.top_logprobs.is_empty());
        // Keys by text: the server ignored `return_tokens_as_token_ids`.
        let e = Progress::default()
            .push_vllm(&with_top(json!([{"Code": -0.5}, {":": -0.2}])))
            .unwrap_err();
        assert!(e.contains("return_tokens_as_token_ids"), "{e}");
    }

    #[test]
    fn vllm_stream_deltas_add_up_with_stop_reason_spans_and_usage() {
        let mut p = Progress::default();
        assert_eq!(
            p.push_vllm(&chunk(
                &[5, 6],
                &[-0.5, -0.25],
                None,
                json!({"prompt_token_ids": [1, 2, 3]})
            ))
            .unwrap(),
            vec![5, 6]
        );
        let last = chunk(
            &[151645],
            &[-1.0],
            Some("stop"),
            json!({"stop_reason": 151645, "weight_versions": [{"version": "v0", "start": 0, "end": 1}, {"version": "v1", "start": 1, "end": 3}]}),
        );
        assert_eq!(p.push_vllm(&last).unwrap(), vec![151645]);
        let usage = json!({"id": "cmpl-a-0", "object": "text_completion", "created": 1, "model": "m", "choices": [],
            "usage": {"prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6, "prompt_tokens_details": {"cached_tokens": 2}}});
        assert!(p.push_vllm(&usage).unwrap().is_empty());
        assert_eq!(p.output_ids, [5, 6, 151645]);
        assert_eq!(
            p.aligned_logprobs(),
            Some(vec![Some(-0.5), Some(-0.25), Some(-1.0)])
        );
        assert_eq!(p.finish, Some(FinishReason::Stop));
        assert_eq!(p.stop_reason, Some(json!(151645)));
        assert_eq!(p.weight_version.as_deref(), Some("v1"));
        assert_eq!(p.weight_version_spans().map(|s| s.len()), Some(2));
        assert_eq!((p.prompt_tokens, p.cached_tokens), (Some(3), Some(2)));
    }

    #[test]
    fn vllm_answers_graft_cannot_use_are_named() {
        let mut p = Progress::default();
        let no_ids = json!({"choices": [{"index": 0, "text": "hi", "finish_reason": "stop"}]});
        assert!(
            p.push_vllm(&no_ids)
                .unwrap_err()
                .contains("return_token_ids")
        );
        let odd = chunk(&[1], &[-0.1], Some("repetition"), json!({}));
        assert!(p.push_vllm(&odd).unwrap_err().contains("repetition"));
        let short = chunk(&[1, 2], &[-0.1], None, json!({}));
        assert!(
            p.push_vllm(&short)
                .unwrap_err()
                .contains("1 logprobs for 2")
        );
        let two =
            json!({"choices": [{"index": 0, "token_ids": []}, {"index": 1, "token_ids": []}]});
        assert!(p.push_vllm(&two).unwrap_err().contains("2 choices"));
    }

    /// Every case of `tests/fixtures/vllm_structured_outputs.json` (made by running vLLM
    /// 0.34.0's and xgrammar 0.2.8's own code: scripts/vllm-structural-tag-fixtures.py):
    /// the request read by graft's Chat dialect gives the same `structured_outputs`, the
    /// structural tag byte for byte, for each format, `VLLM_ENFORCE_STRICT_TOOL_CALLING` on
    /// and off, every tool choice, `parallel_tool_calls` and response format.
    #[test]
    fn structured_outputs_equal_vllms_own() {
        let doc: Value = serde_json::from_str(include_str!(
            "../tests/fixtures/vllm_structured_outputs.json"
        ))
        .unwrap();
        let chat = crate::dialect::dialect(crate::dialect::DialectKind::ChatCompletions);
        let cases = doc["cases"].as_array().unwrap();
        assert_eq!(cases.len(), 204);
        let mut tags = 0;
        for case in cases {
            let mut request = json!({"model": "m", "messages": [{"role": "user", "content": "hi"}],
                "tools": doc["toolsets"][case["tools"].as_str().unwrap()]});
            let o = request.as_object_mut().unwrap();
            o.extend(case["request"].as_object().unwrap().clone());
            let conv = chat.parse(&request).unwrap();
            let format: ToolCallFormat =
                serde_json::from_value(case["tool_call_format"].clone()).unwrap();
            let got = structured_outputs(
                format,
                case["strict_tool_calling"].as_bool().unwrap(),
                &conv.tools,
                conv.tool_choice.as_ref(),
                conv.parallel_tool_calls,
                conv.sampling.format.as_ref(),
            );
            let want: Option<StructuredOutputs> =
                serde_json::from_value(case["structured_outputs"].clone()).unwrap();
            assert_eq!(got, want, "{}", case["name"]);
            tags += usize::from(want.is_some_and(|w| w.structural_tag.is_some()));
        }
        // 84 of the 108 strict cases carry a tag (the others: `auto` with no strict tool).
        assert_eq!(tags, 84);
    }

    #[test]
    fn python_json_dumps_spacing_escapes_and_floats() {
        let v = json!({"a": [1, 2.5, 1e-5, 1e16, 100.0, -0.0], "é\u{7f}": "x\u{1F600}\n\""});
        assert_eq!(
            py_dumps(&v),
            r#"{"a": [1, 2.5, 1e-05, 1e+16, 100.0, -0.0], "\u00e9\u007f": "x\ud83d\ude00\n\""}"#
        );
    }

    #[test]
    fn vllm_body_always_sets_max_tokens_and_stream_options_only_when_streaming() {
        let s = Sampling {
            top_k: Some(0),
            temperature: Some(0.7),
            ..Default::default()
        };
        let whole = completions_body(&[1, 2], sampling(&s, 77), false, "c1", 0);
        assert_eq!(whole["max_tokens"], 77);
        assert_eq!(whole["prompt"], json!([1, 2]));
        assert_eq!(whole["logprobs"], 0);
        assert!(whole.get("return_tokens_as_token_ids").is_none(), "{whole}");
        assert_eq!(whole["return_token_ids"], true);
        assert_eq!(whole["request_id"], "c1");
        assert!(whole.get("top_k").is_none() && whole.get("stream_options").is_none());
        assert!(
            whole.get("model").is_none(),
            "the served model answers: {whole}"
        );
        let streamed = completions_body(&[1], sampling(&s, 77), true, "c1", 3);
        assert_eq!(streamed["stream_options"]["include_usage"], true);
        // Alternatives asked for come keyed by id.
        assert_eq!(streamed["logprobs"], 3);
        assert_eq!(streamed["return_tokens_as_token_ids"], true);
    }
}

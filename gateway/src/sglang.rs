//! SGLang's native generation API, the backend wire of exact mode (token ids in, token ids
//! and logprobs out). `graft serve` speaks the same wire. The bodies and answers are
//! `graft-wire`'s types ([`graft_wire::sglang`], with the SGLang source files they follow).
//!
//! `POST /generate` with `{"input_ids": [...], "sampling_params": {...}, "return_logprob":
//! true, "logprob_start_len": -1, "stream": bool}` answers `{"text", "output_ids",
//! "meta_info": {"id", "finish_reason": {"type": "stop"|"length"|"abort", "matched"?,
//! "length"?, "message"?}, "prompt_tokens", "completion_tokens", "cached_tokens",
//! "output_token_logprobs": [[logprob, id, text|null], ...], "weight_version"}}`. Streamed, it
//! sends `data: {...}` events of the same shape and `data: [DONE]`; by default each event
//! holds everything so far (`output_ids`, logprobs), with `--incremental-streaming-output`
//! only the new part. [`Progress`] accepts both: an event whose `output_ids` are as many as
//! `meta_info.completion_tokens` is cumulative.

use graft_reconstruct::parser::ToolCallFormat;
use graft_recorder::WeightSpan;
use graft_wire::sglang::{self as wire, FinishKind, GenerateRequest, GenerateResponse};
use serde::Deserialize as _;
use serde_json::Value;

use crate::dialect::{Finish, Sampling, Tool, ToolChoice};

/// The sampling parameters of a request, in SGLang's names. `max_new_tokens` is always set
/// (SGLang's own default is 128).
pub fn sampling_params(s: &Sampling, default_max_new_tokens: u64) -> Value {
    let p = wire::SamplingParams {
        temperature: s.temperature,
        top_p: s.top_p,
        // `top_k: 0` is "off" to OpenAI-style clients and vLLM; SGLang refuses it (400:
        // -1 or at least 1), so it goes as absent.
        top_k: s
            .top_k
            .filter(|&k| k > 0)
            .map(|k| i64::try_from(k).unwrap_or(i64::MAX)),
        max_new_tokens: Some(s.max_tokens.unwrap_or(default_max_new_tokens)),
        stop: (!s.stop.is_empty()).then(|| wire::Stop::Many(s.stop.clone())),
        sampling_seed: s.seed,
        presence_penalty: s.presence_penalty,
        frequency_penalty: s.frequency_penalty,
        min_p: s.min_p,
        repetition_penalty: s.repetition_penalty,
        logit_bias: s.logit_bias.clone(),
        // Structured output as SGLang's chat server passes it: the schema as a JSON string
        // (`{"type": "object"}` for any object).
        json_schema: s.format.as_ref().map(|f| f.schema().to_string()),
        // Output ids must hold everything sampled, the stop string included.
        no_stop_trim: Some(true),
        skip_special_tokens: Some(false),
        ..wire::SamplingParams::default()
    };
    to_value(&p)
}

/// The decode constraint SGLang's chat server adds for a request's tool calls
/// (`FunctionCallParser.get_structure_constraint`, SGLang 0.5.23), as the `structural_tag`
/// sampling parameter (a JSON string); `None` where it adds none.
///
/// For graft's `hermes` format (SGLang's `qwen25` detector, Qwen's own
/// `<tool_call>\n{"name": ..., "arguments": ...}\n</tool_call>`) that is the legacy structural
/// tag (`get_legacy_structural_tag`): under `tool_choice` `"required"` or a named function
/// one structure per declared tool, all of them (SGLang builds the parser from every tool,
/// also under a named choice), with `at_least_one`; under `"auto"` only when a tool is
/// `strict`, without it. A tool's schema is constrained only when it is `strict` (OpenAI's
/// meaning); otherwise its arguments are any JSON. No constraint without tools, under
/// `"none"`, or with no tool-call parser. The `llama3` format (SGLang's `Llama32Detector`)
/// gets the same tag in its own syntax: `<|python_tag|>{"name":"NAME", "arguments":` … `}`,
/// triggered by `<|python_tag|>`. The `qwen3_coder` format's is xgrammar's built-in
/// `qwen_3_coder` tag ([`qwen3_coder_tag`]), under the same conditions.
pub fn tool_call_constraint(
    format: ToolCallFormat,
    tools: &[Tool],
    choice: Option<&ToolChoice>,
    parallel_tool_calls: bool,
) -> Option<String> {
    if format == ToolCallFormat::Qwen3Coder {
        return qwen3_coder_tag(tools, choice, parallel_tool_calls).map(|t| t.to_string());
    }
    // (begin before the name, begin after it, end, trigger): `structure_info` of each detector.
    let (open, after_name, end, trigger) = match format {
        ToolCallFormat::Hermes => (
            "<tool_call>\n{\"name\":\"",
            "\", \"arguments\":",
            "}\n</tool_call>",
            "<tool_call>",
        ),
        ToolCallFormat::Llama3 => (
            "<|python_tag|>{\"name\":\"",
            "\", \"arguments\":",
            "}",
            "<|python_tag|>",
        ),
        ToolCallFormat::Qwen3Coder | ToolCallFormat::None => return None,
    };
    if tools.is_empty() {
        return None;
    }
    let required = match choice {
        Some(ToolChoice::None) => return None,
        Some(ToolChoice::Required | ToolChoice::Function { .. }) => true,
        None | Some(ToolChoice::Auto) => false,
    };
    let strict = |t: &Tool| t.strict == Some(true);
    if !required && !tools.iter().any(strict) {
        return None;
    }
    let structures: Vec<Value> = tools
        .iter()
        .map(|t| {
            let schema = match &t.parameters {
                Value::Object(_) if strict(t) => t.parameters.clone(),
                _ => Value::Object(serde_json::Map::new()),
            };
            serde_json::json!({
                "begin": format!("{open}{}{after_name}", t.name),
                "schema": schema,
                "end": end,
            })
        })
        .collect();
    let tag = serde_json::json!({
        "type": "structural_tag",
        "structures": structures,
        "triggers": [trigger],
        "at_least_one": required,
    });
    Some(tag.to_string())
}

/// xgrammar 0.2.7's built-in `qwen_3_coder` structural tag
/// (`builtin_structural_tag.get_qwen_3_5_structural_tag`), as SGLang 0.5.23 asks for it
/// (`BaseFormatDetector.get_structural_tag` with `reasoning` off, since `--reasoning-parser`
/// owns the think prefix; sent as `model_dump(by_alias=True)`): under `"required"` (and
/// `"auto"` with a strict tool) triggered tags `<tool_call>\n<function=NAME>\n` … `\n</function>\n</tool_call>`,
/// one per tool, their arguments held to the tool's schema in Qwen's XML style (any
/// arguments where the tool is `strict: false` or has no schema), `at_least_one` under
/// `"required"`, `stop_after_first` without `parallel_tool_calls`; a named function gets its
/// one tag alone. `None` where SGLang adds no constraint.
pub fn qwen3_coder_tag(
    tools: &[Tool],
    choice: Option<&ToolChoice>,
    parallel_tool_calls: bool,
) -> Option<Value> {
    use crate::xgrammar::{self, Builtin, Choice, Function, Release};
    // SGLang hands xgrammar the tools as the request has them: a tool's schema holds unless
    // it is `strict: false` or has none.
    let functions: Vec<Function> = tools
        .iter()
        .map(|t| Function {
            name: &t.name,
            schema: match (&t.parameters, t.strict) {
                (_, Some(false)) | (Value::Null, _) => Value::Bool(true),
                (p, _) => p.clone(),
            },
        })
        .collect();
    let choice = match choice {
        Some(ToolChoice::None) => return None,
        Some(ToolChoice::Function { name }) => Choice::Forced(name),
        Some(ToolChoice::Required) => Choice::Required,
        None | Some(ToolChoice::Auto) if tools.iter().any(|t| t.strict == Some(true)) => {
            Choice::Auto
        }
        None | Some(ToolChoice::Auto) => return None,
    };
    xgrammar::builtin(
        Builtin::Qwen3Coder,
        &functions,
        choice,
        parallel_tool_calls,
        Release::V0_2_7,
    )
    .map(xgrammar::structural_tag)
}

/// The `/generate` body.
pub fn generate_body(
    input_ids: &[u32],
    sampling_params: Value,
    stream: bool,
    top_logprobs: u32,
) -> Value {
    let req = GenerateRequest {
        input_ids: Some(input_ids.to_vec()),
        return_logprob: Some(true),
        // Asked only when the client wants them (`meta_info.output_top_logprobs`).
        top_logprobs_num: (top_logprobs > 0).then_some(top_logprobs),
        logprob_start_len: Some(-1),
        stream: Some(stream),
        ..GenerateRequest::default()
    };
    let mut body = to_value(&req);
    // The caller's parameters go as given (they are `sampling_params`' output, maybe with
    // more keys), not through the typed struct, so nothing is dropped.
    if let Some(o) = body.as_object_mut() {
        o.insert("sampling_params".into(), sampling_params);
    }
    body
}

/// A wire value as JSON. The wire types are plain data (strings, numbers, lists, maps with
/// string keys), which serde_json always serializes.
fn to_value(v: &impl serde::Serialize) -> Value {
    serde_json::to_value(v).unwrap_or(Value::Null)
}

/// How generation ended, from `meta_info.finish_reason`.
#[derive(Debug, Clone, PartialEq)]
pub enum FinishReason {
    Stop,
    Length,
    /// The backend aborted the request (`message` says why).
    Abort(String),
}

impl FinishReason {
    fn from_wire(f: &wire::FinishReason) -> Option<FinishReason> {
        match &f.kind {
            FinishKind::Stop => Some(FinishReason::Stop),
            FinishKind::Length => Some(FinishReason::Length),
            FinishKind::Abort => Some(FinishReason::Abort(
                f.message.clone().unwrap_or_else(|| "aborted".to_string()),
            )),
            FinishKind::Other(_) => None,
        }
    }

    pub fn finish(&self) -> Finish {
        match self {
            FinishReason::Stop => Finish::Stop,
            FinishReason::Length => Finish::Length,
            FinishReason::Abort(_) => Finish::Error,
        }
    }
}

/// One position's most likely tokens, `(id, logprob)`, most likely first.
pub type TopLogprobs = Vec<(u32, Option<f32>)>;

/// Everything a generation brought so far.
#[derive(Debug, Default, Clone)]
pub struct Progress {
    pub output_ids: Vec<u32>,
    /// One per output token so far; `None` where the backend sent a null logprob.
    pub logprobs: Vec<Option<f32>>,
    pub finish: Option<FinishReason>,
    pub prompt_tokens: Option<u64>,
    pub cached_tokens: Option<u64>,
    pub weight_version: Option<String>,
    pub id: Option<String>,
    /// What a `stop` finish matched: SGLang's `finish_reason.matched`, vLLM's `stop_reason`
    /// (a stop token id, several, or a stop string; vLLM says null for EOS).
    pub stop_reason: Option<Value>,
    /// Per output token (when asked for): the most likely tokens there.
    pub top_logprobs: Vec<TopLogprobs>,
    /// `meta_info.weight_versions` as reported (spans over the output tokens).
    reported_spans: Vec<WeightSpan>,
    /// The output tokens labelled by the `weight_version` of the event that brought them.
    seen_spans: Vec<WeightSpan>,
}

/// Adds `start..end` of `version` to `spans`, merged with the last span when it continues it.
fn push_span(spans: &mut Vec<WeightSpan>, version: &str, start: u64, end: u64) {
    if end <= start {
        return;
    }
    match spans.last_mut() {
        Some(last) if last.version == version && last.end == start => last.end = end,
        _ => spans.push(WeightSpan {
            version: version.to_owned(),
            start,
            end,
        }),
    }
}

/// Why an answer does not read as SGLang's `/generate` answer, in the words the gateway has
/// always used for the common cases.
fn unreadable(v: &Value, e: &serde_json::Error) -> String {
    match v.get("output_ids") {
        Some(Value::Array(ids))
            if ids
                .iter()
                .any(|x| x.as_u64().and_then(|n| u32::try_from(n).ok()).is_none()) =>
        {
            "'output_ids' holds something that is not a token id".to_string()
        }
        Some(Value::Array(_)) => format!("the answer is not SGLang's /generate answer: {e}"),
        _ => "the answer has no 'output_ids' array".to_string(),
    }
}

impl Progress {
    /// Takes one answer (or streamed event); returns the ids that are new.
    pub fn push(&mut self, v: &Value) -> Result<Vec<u32>, String> {
        let answer = GenerateResponse::deserialize(v).map_err(|e| unreadable(v, &e))?;
        let ids = answer.output_ids;
        let meta = answer.meta_info;
        let total = meta.completion_tokens;
        let logprobs: Vec<Option<f32>> = meta
            .output_token_logprobs
            .map(|a| a.iter().map(|e| e.logprob().map(|x| x as f32)).collect())
            .unwrap_or_default();
        let top: Option<Vec<TopLogprobs>> = meta.output_top_logprobs.map(|a| {
            a.iter()
                .map(|pos| {
                    pos.iter()
                        .flatten()
                        .map(|e| (e.token_id(), e.logprob().map(|x| x as f32)))
                        .collect()
                })
                .collect()
        });
        let before = self.output_ids.len() as u64;
        let cumulative = match total {
            Some(t) => ids.len() as u64 == t && ids.starts_with(&self.output_ids),
            None => ids.starts_with(&self.output_ids) && ids.len() >= self.output_ids.len(),
        };
        // Logprobs are judged by their own length: SGLang before sglang#21583 streamed
        // incremental ids with cumulative logprobs.
        let logprobs_cumulative = match total {
            Some(t) => logprobs.len() as u64 == t && logprobs.len() >= self.logprobs.len(),
            None => cumulative,
        };
        if logprobs_cumulative {
            if logprobs.len() >= self.logprobs.len() {
                self.logprobs = logprobs;
            }
        } else {
            self.logprobs.extend(logprobs);
        }
        if let Some(top) = top {
            let cumulative_top = total.is_some_and(|t| top.len() as u64 == t);
            if cumulative_top {
                if top.len() >= self.top_logprobs.len() {
                    self.top_logprobs = top;
                }
            } else {
                self.top_logprobs.extend(top);
            }
        }
        let new = if cumulative {
            let new = ids[self.output_ids.len()..].to_vec();
            self.output_ids = ids;
            new
        } else {
            self.output_ids.extend_from_slice(&ids);
            ids
        };
        if let Some(f) = &meta.finish_reason {
            self.stop_reason = f.matched.as_ref().map(|m| match m {
                wire::Matched::Token(id) => Value::from(*id),
                wire::Matched::Tokens(ids) => Value::from(ids.clone()),
                wire::Matched::Text(t) => Value::from(t.clone()),
            });
            self.finish = Some(FinishReason::from_wire(f).ok_or_else(|| {
                format!(
                    "unknown finish_reason {}",
                    v.pointer("/meta_info/finish_reason")
                        .cloned()
                        .unwrap_or(Value::Null)
                )
            })?);
        }
        if let Some(p) = meta.prompt_tokens {
            self.prompt_tokens = Some(p);
        }
        if let Some(c) = meta.cached_tokens {
            self.cached_tokens = Some(c);
        }
        if let Some(w) = meta.weight_version {
            push_span(
                &mut self.seen_spans,
                &w,
                before,
                self.output_ids.len() as u64,
            );
            self.weight_version = Some(w);
        }
        if let Some(spans) = meta.weight_versions {
            self.report_spans(
                spans
                    .into_iter()
                    .map(|s| WeightSpan {
                        version: s.version,
                        start: s.start,
                        end: s.end,
                    })
                    .collect(),
            );
        }
        if let Some(id) = meta.id {
            self.id = Some(id);
        }
        Ok(new)
    }

    /// Weight-version spans the backend reported. Spans are over the whole output: a later
    /// report replaces what it covers.
    pub(crate) fn report_spans(&mut self, spans: Vec<WeightSpan>) {
        let Some(from) = spans.first().map(|s| s.start) else {
            return;
        };
        self.reported_spans.retain(|s| s.start < from);
        if let Some(last) = self.reported_spans.last_mut() {
            last.end = last.end.min(from);
        }
        for s in spans {
            push_span(&mut self.reported_spans, &s.version, s.start, s.end);
        }
    }

    /// Logprobs aligned to the output ids, or `None` when the backend sent another count.
    pub fn aligned_logprobs(&self) -> Option<Vec<Option<f32>>> {
        (self.logprobs.len() == self.output_ids.len()).then(|| self.logprobs.clone())
    }

    /// Which weights sampled which output tokens: the backend's `weight_versions` when it
    /// reported them, else the versions its events carried when they changed during the
    /// call; `None` when one version (`weight_version`) sampled everything.
    /// A lone span over the whole output (what SGLang reports for every answer since
    /// sglang#35926) is `None` too: the records promise null when one version sampled it all.
    pub fn weight_version_spans(&self) -> Option<Vec<WeightSpan>> {
        if !self.reported_spans.is_empty() {
            let whole = matches!(&self.reported_spans[..], [s]
                if s.start == 0 && s.end >= self.output_ids.len() as u64);
            return (!whole).then(|| self.reported_spans.clone());
        }
        (self.seen_spans.len() > 1).then(|| self.seen_spans.clone())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn ev(ids: &[u32], lps: &[f32], total: usize, finish: Option<Value>) -> Value {
        json!({"text": "", "output_ids": ids, "meta_info": {
            "id": "r1", "completion_tokens": total, "prompt_tokens": 7, "weight_version": "v3",
            "output_token_logprobs": lps.iter().zip(ids).map(|(l, i)| json!([l, i, null])).collect::<Vec<_>>(),
            "finish_reason": finish}})
    }

    #[test]
    fn cumulative_and_incremental_streams_give_the_same_ids() {
        let mut a = Progress::default();
        assert_eq!(a.push(&ev(&[5], &[-0.5], 1, None)).unwrap(), vec![5]);
        assert_eq!(
            a.push(&ev(&[5, 5], &[-0.5, -0.25], 2, None)).unwrap(),
            vec![5]
        );
        let fin = json!({"type": "stop", "matched": 9});
        assert_eq!(
            a.push(&ev(&[5, 5, 9], &[-0.5, -0.25, -1.0], 3, Some(fin.clone())))
                .unwrap(),
            vec![9]
        );
        let mut b = Progress::default();
        b.push(&ev(&[5], &[-0.5], 1, None)).unwrap();
        // Incremental: only the new id, though it equals the previous one.
        assert_eq!(b.push(&ev(&[5], &[-0.25], 2, None)).unwrap(), vec![5]);
        b.push(&ev(&[9], &[-1.0], 3, Some(fin))).unwrap();
        assert_eq!(a.output_ids, b.output_ids);
        assert_eq!(a.aligned_logprobs(), b.aligned_logprobs());
        assert_eq!(a.finish, Some(FinishReason::Stop));
        assert_eq!(a.weight_version.as_deref(), Some("v3"));
        assert_eq!(a.prompt_tokens, Some(7));
    }

    #[test]
    fn weight_versions_are_kept_per_span_and_null_logprobs_stay_unknown() {
        let with = |ids: &[u32], total: usize, version: &str, spans: Value| {
            json!({"output_ids": ids, "meta_info": {
                "completion_tokens": total, "weight_version": version,
                "output_token_logprobs": ids.iter().map(|i| json!([null, i, null])).collect::<Vec<_>>(),
                "weight_versions": spans}})
        };
        // Reported spans, cumulative events: the last event's spans cover everything.
        let mut p = Progress::default();
        p.push(&with(
            &[1, 2],
            2,
            "a",
            json!([{"version": "a", "start": 0, "end": 2}]),
        ))
        .unwrap();
        p.push(&with(
            &[1, 2, 3],
            3,
            "b",
            json!([{"version": "a", "start": 0, "end": 2}, {"version": "b", "start": 2, "end": 3}]),
        ))
        .unwrap();
        let spans = p.weight_version_spans().unwrap();
        let got: Vec<_> = spans
            .iter()
            .map(|s| (s.version.as_str(), s.start, s.end))
            .collect();
        assert_eq!(got, vec![("a", 0, 2), ("b", 2, 3)]);
        assert_eq!(p.weight_version.as_deref(), Some("b"));
        assert_eq!(p.aligned_logprobs(), Some(vec![None, None, None]));

        // No spans reported: the versions the events carried label their new tokens.
        let mut q = Progress::default();
        q.push(&with(&[1, 2], 2, "a", Value::Null)).unwrap();
        q.push(&with(&[1, 2, 3, 4], 4, "b", Value::Null)).unwrap();
        let got: Vec<_> = q
            .weight_version_spans()
            .unwrap()
            .iter()
            .map(|s| (s.version.clone(), s.start, s.end))
            .collect();
        assert_eq!(got, vec![("a".into(), 0, 2), ("b".into(), 2, 4)]);

        // One version throughout: no spans.
        let mut r = Progress::default();
        r.push(&with(&[1], 1, "a", Value::Null)).unwrap();
        r.push(&with(&[1, 2], 2, "a", Value::Null)).unwrap();
        assert_eq!(r.weight_version_spans(), None);
    }

    #[test]
    fn bad_answers_are_named() {
        let mut p = Progress::default();
        assert!(
            p.push(&json!({"text": "x"}))
                .unwrap_err()
                .contains("output_ids")
        );
        assert!(
            p.push(&json!({"output_ids": [-1]}))
                .unwrap_err()
                .contains("token id")
        );
        let e = p
            .push(&json!({"output_ids": [], "meta_info": {"finish_reason": {"type": "odd"}}}))
            .unwrap_err();
        assert!(e.contains("finish_reason"), "{e}");
    }

    /// SGLang point 2: before sglang#21583, `--incremental-streaming-output` sent the new
    /// ids only but every logprob so far; each is judged by its own length, so no logprob
    /// of the call is lost (before: all were dropped, the counts disagreeing).
    #[test]
    fn point2_incremental_ids_with_cumulative_logprobs_keep_every_logprob() {
        let ev = |ids: &[u32], lps: &[f32], total: usize| {
            json!({"output_ids": ids, "meta_info": {"completion_tokens": total,
                "output_token_logprobs": lps.iter().map(|l| json!([l, 0, null])).collect::<Vec<_>>()}})
        };
        let mut p = Progress::default();
        p.push(&ev(&[5], &[-0.5], 1)).unwrap();
        p.push(&ev(&[6], &[-0.5, -0.25], 2)).unwrap();
        p.push(&ev(&[7], &[-0.5, -0.25, -1.0], 3)).unwrap();
        assert_eq!(p.output_ids, [5, 6, 7]);
        assert_eq!(
            p.aligned_logprobs(),
            Some(vec![Some(-0.5), Some(-0.25), Some(-1.0)])
        );
        // Incremental both (SGLang since then) reads the same.
        let mut q = Progress::default();
        q.push(&ev(&[5], &[-0.5], 1)).unwrap();
        q.push(&ev(&[6], &[-0.25], 2)).unwrap();
        q.push(&ev(&[7], &[-1.0], 3)).unwrap();
        assert_eq!(q.aligned_logprobs(), p.aligned_logprobs());
    }

    /// SGLang point 7: a client's `top_k: 0` ("off" for OpenAI-style clients and vLLM)
    /// would be refused by SGLang; it goes as absent, and a real k goes as it is.
    fn tool(name: &str, strict: Option<bool>) -> Tool {
        Tool {
            name: name.into(),
            description: None,
            parameters: json!({"type": "object", "properties": {"city": {"type": "string"}}}),
            strict,
        }
    }

    /// SGLang 0.5.23's `get_legacy_structural_tag` with the `qwen25` detector's
    /// `structure_info`: one structure per declared tool, the schema only where `strict`.
    #[test]
    fn required_and_named_tool_choices_constrain_the_decode_as_sglang_does() {
        let tools = [tool("get_weather", None), tool("get_time", Some(true))];
        let tag = |choice: Option<ToolChoice>| {
            tool_call_constraint(ToolCallFormat::Hermes, &tools, choice.as_ref(), true)
                .map(|t| serde_json::from_str::<Value>(&t).unwrap())
        };
        let structures = json!([
            {"begin": "<tool_call>\n{\"name\":\"get_weather\", \"arguments\":", "schema": {},
             "end": "}\n</tool_call>"},
            {"begin": "<tool_call>\n{\"name\":\"get_time\", \"arguments\":",
             "schema": {"type": "object", "properties": {"city": {"type": "string"}}},
             "end": "}\n</tool_call>"},
        ]);
        let required = json!({"type": "structural_tag", "structures": structures,
            "triggers": ["<tool_call>"], "at_least_one": true});
        assert_eq!(tag(Some(ToolChoice::Required)), Some(required.clone()));
        // A named choice: SGLang's parser holds every tool, so every structure is there.
        let named = ToolChoice::Function {
            name: "get_weather".into(),
        };
        assert_eq!(tag(Some(named)), Some(required));
        // `auto` with a strict tool: the same structures, no call forced.
        let auto = json!({"type": "structural_tag", "structures": structures,
            "triggers": ["<tool_call>"], "at_least_one": false});
        assert_eq!(tag(Some(ToolChoice::Auto)), Some(auto.clone()));
        assert_eq!(tag(None), Some(auto));
        assert_eq!(tag(Some(ToolChoice::None)), None);
        // `auto` without a strict tool, no tools, or no call format: no constraint.
        let loose = [tool("get_weather", Some(false))];
        assert_eq!(
            tool_call_constraint(
                ToolCallFormat::Hermes,
                &loose,
                Some(&ToolChoice::Auto),
                true
            ),
            None
        );
        assert_eq!(
            tool_call_constraint(
                ToolCallFormat::Hermes,
                &[],
                Some(&ToolChoice::Required),
                true
            ),
            None
        );
        assert_eq!(
            tool_call_constraint(
                ToolCallFormat::None,
                &tools,
                Some(&ToolChoice::Required),
                true
            ),
            None
        );
        // Llama 3 (`Llama32Detector.structure_info`): its own begin, end and trigger.
        let llama: Value = serde_json::from_str(
            &tool_call_constraint(
                ToolCallFormat::Llama3,
                &tools,
                Some(&ToolChoice::Required),
                true,
            )
            .unwrap(),
        )
        .unwrap();
        assert_eq!(llama["triggers"], json!(["<|python_tag|>"]));
        assert_eq!(
            llama["structures"][0]["begin"],
            "<|python_tag|>{\"name\":\"get_weather\", \"arguments\":"
        );
        assert_eq!(llama["structures"][0]["end"], "}");
        assert_eq!(llama["at_least_one"], true);
    }

    /// The `qwen_3_coder` tag equals what xgrammar 0.2.7's own code builds for SGLang
    /// (`tests/fixtures/xgrammar_qwen_3_coder.json`, made by running its
    /// `get_model_structural_tag` on SGLang's dumped tools), for every tool choice and both
    /// `parallel_tool_calls`; under `none`, without tools or for an undeclared name, none.
    #[test]
    fn qwen3_coder_forced_calls_get_xgrammars_own_tag() {
        let doc: Value =
            serde_json::from_str(include_str!("../tests/fixtures/xgrammar_qwen_3_coder.json"))
                .unwrap();
        let tools: Vec<Tool> = doc["tools"]
            .as_array()
            .unwrap()
            .iter()
            .map(|t| {
                let f = &t["function"];
                Tool {
                    name: f["name"].as_str().unwrap().into(),
                    description: f["description"].as_str().map(Into::into),
                    parameters: f["parameters"].clone(),
                    strict: f["strict"].as_bool(),
                }
            })
            .collect();
        let cases = doc["cases"].as_array().unwrap();
        assert_eq!(cases.len(), 5);
        for case in cases {
            let choice = match &case["tool_choice"] {
                Value::String(s) if s == "required" => ToolChoice::Required,
                Value::String(s) if s == "auto" => ToolChoice::Auto,
                named => ToolChoice::Function {
                    name: named["function"]["name"].as_str().unwrap().into(),
                },
            };
            let parallel = case["parallel_tool_calls"].as_bool().unwrap();
            let got =
                tool_call_constraint(ToolCallFormat::Qwen3Coder, &tools, Some(&choice), parallel)
                    .map(|t| serde_json::from_str::<Value>(&t).unwrap());
            assert_eq!(got.as_ref(), Some(&case["structural_tag"]), "{case:#}");
        }
        assert_eq!(qwen3_coder_tag(&tools, Some(&ToolChoice::None), true), None);
        assert_eq!(
            qwen3_coder_tag(&[], Some(&ToolChoice::Required), true),
            None
        );
        let undeclared = ToolChoice::Function {
            name: "nope".into(),
        };
        assert_eq!(qwen3_coder_tag(&tools, Some(&undeclared), true), None);
        // `auto` with no strict tool: unconstrained.
        assert_eq!(
            qwen3_coder_tag(&tools[..1], Some(&ToolChoice::Auto), true),
            None
        );
    }

    #[test]
    fn point7_top_k_zero_is_sent_as_absent() {
        let p = sampling_params(
            &Sampling {
                top_k: Some(0),
                ..Default::default()
            },
            16,
        );
        assert!(p.get("top_k").is_none(), "{p}");
        let p = sampling_params(
            &Sampling {
                top_k: Some(20),
                ..Default::default()
            },
            16,
        );
        assert_eq!(p["top_k"], 20);
    }

    /// SGLang point 8: a lone `weight_versions` span over the whole output (SGLang reports
    /// one for every answer since sglang#35926) is stored as null, as the records doc says
    /// for one version; two spans, or one that covers part of the output, stay.
    #[test]
    fn point8_lone_full_weight_span_is_stored_as_null() {
        let answer = |spans: Value| {
            json!({"output_ids": [1, 2, 3], "meta_info": {
                "completion_tokens": 3, "weight_version": "v1",
                "output_token_logprobs": [[-0.1, 1, null], [-0.2, 2, null], [-0.3, 3, null]],
                "weight_versions": spans}})
        };
        let mut p = Progress::default();
        p.push(&answer(json!([{"version": "v1", "start": 0, "end": 3}])))
            .unwrap();
        assert_eq!(p.weight_version_spans(), None);
        assert_eq!(p.weight_version.as_deref(), Some("v1"));
        let mut p = Progress::default();
        p.push(&answer(json!([{"version": "v0", "start": 0, "end": 1}, {"version": "v1", "start": 1, "end": 3}])))
            .unwrap();
        assert_eq!(p.weight_version_spans().map(|s| s.len()), Some(2));
        let mut p = Progress::default();
        p.push(&answer(json!([{"version": "v1", "start": 1, "end": 3}])))
            .unwrap();
        assert_eq!(p.weight_version_spans().map(|s| s.len()), Some(1));
    }

    #[test]
    fn sampling_maps_to_sglang_names() {
        let s = Sampling {
            temperature: Some(0.7),
            max_tokens: None,
            stop: vec!["END".into()],
            seed: Some(3),
            min_p: Some(0.05),
            repetition_penalty: Some(1.1),
            logit_bias: json!({"42": -100}).as_object().cloned(),
            ..Default::default()
        };
        let p = sampling_params(&s, 512);
        assert_eq!(p["min_p"], 0.05);
        assert_eq!(p["repetition_penalty"], 1.1);
        assert_eq!(p["logit_bias"], json!({"42": -100}));
        assert_eq!(p["max_new_tokens"], 512);
        assert_eq!(p["temperature"], 0.7);
        assert_eq!(p["stop"], json!(["END"]));
        assert_eq!(p["sampling_seed"], 3);
        assert!(p.get("top_k").is_none());
    }
}

//! vLLM's token-in/token-out surface, exact mode's other backend wire (`exact.wire =
//! "vllm"`): `POST /v1/completions` with the prompt as token ids, `return_token_ids`,
//! `logprobs: 0` (the sampled token's logprob only) and `return_weight_versions`. The
//! types, the route chosen and vLLM's own semantics (read from vLLM 0.34.0's source) are in
//! [`graft_wire::vllm`].
//!
//! The answers feed the same [`Progress`] as SGLang's: a streamed chunk carries the new ids
//! and their logprobs (vLLM streams deltas only), the last one `finish_reason`,
//! `stop_reason` and the weight-version spans over the whole output; a usage chunk with no
//! choices follows when `stream_options.include_usage` was asked. graft decodes the ids
//! itself: vLLM's `text` (which drops a stop token's text and trails the ids by up to a stop
//! string while streaming) is not read.

use graft_recorder::WeightSpan;
use graft_wire::vllm::{self as wire, CompletionRequest, CompletionResponse, StopReason};
use serde::Deserialize as _;
use serde_json::{Value, json};

use crate::dialect::{OutputFormat, Sampling, Tool, ToolChoice};
use crate::sglang::{FinishReason, Progress};

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
        // What vLLM's own chat server makes of `response_format`
        // (`structured_outputs_from_response_format`).
        structured_outputs: s.format.as_ref().map(|f| match f {
            OutputFormat::JsonObject => graft_wire::vllm::StructuredOutputs {
                json_object: Some(true),
                ..Default::default()
            },
            OutputFormat::JsonSchema { schema, .. } => graft_wire::vllm::StructuredOutputs {
                json: Some(schema.clone()),
                ..Default::default()
            },
        }),
        ..CompletionRequest::default()
    };
    let mut v = serde_json::to_value(&r).unwrap_or(Value::Null);
    if let Some(o) = v.as_object_mut() {
        o.remove("prompt");
    }
    v
}

/// The JSON schema vLLM's chat server constrains a forced call with
/// (`get_json_schema_from_tools` in `vllm/tool_parsers/utils.py`, 0.34): under `required` a
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
pub fn completions_body(
    input_ids: &[u32],
    sampling: Value,
    stream: bool,
    request_id: &str,
) -> Value {
    // No `model`: vLLM then serves its own model (`_is_model_supported(None)`), while the
    // client's model name (a harness's "gpt-5") would be a 404 there.
    let req = CompletionRequest {
        prompt: input_ids.to_vec(),
        logprobs: Some(0),
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
            Some(l) if l.token_logprobs.len() == ids.len() => self
                .logprobs
                .extend(l.token_logprobs.iter().map(|x| x.map(|x| x as f32))),
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

    #[test]
    fn vllm_body_always_sets_max_tokens_and_stream_options_only_when_streaming() {
        let s = Sampling {
            top_k: Some(0),
            temperature: Some(0.7),
            ..Default::default()
        };
        let whole = completions_body(&[1, 2], sampling(&s, 77), false, "c1");
        assert_eq!(whole["max_tokens"], 77);
        assert_eq!(whole["prompt"], json!([1, 2]));
        assert_eq!(whole["logprobs"], 0);
        assert_eq!(whole["return_token_ids"], true);
        assert_eq!(whole["request_id"], "c1");
        assert!(whole.get("top_k").is_none() && whole.get("stream_options").is_none());
        assert!(
            whole.get("model").is_none(),
            "the served model answers: {whole}"
        );
        let streamed = completions_body(&[1], sampling(&s, 77), true, "c1");
        assert_eq!(streamed["stream_options"]["include_usage"], true);
    }
}

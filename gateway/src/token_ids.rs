//! Passthrough token ids (`upstream.token_ids`): graft asks a vLLM or SGLang
//! OpenAI-compatible upstream for the token ids and logprobs of each call, records them,
//! and gives the client the answer it would have got without the added fields.
//!
//! # Wire fields relied on
//!
//! **vLLM** (`vllm/entrypoints/openai/chat_completion/protocol.py` and the completion
//! protocol; `return_token_ids` exists since vLLM 0.10.2):
//! - request `return_token_ids: true` (Chat Completions and Completions);
//! - Chat, JSON: top-level `prompt_token_ids` (the full prompt as the engine saw it) and
//!   per-choice `choices[i].token_ids`;
//! - Chat, SSE: `prompt_token_ids` top-level on the first chunk only, `choices[i].token_ids`
//!   the ids generated since the previous chunk;
//! - Completions (JSON and SSE): `choices[i].prompt_token_ids` (first chunk) and
//!   `choices[i].token_ids` (per chunk);
//! - logprobs: Chat `logprobs: true` → `choices[i].logprobs.content[].logprob`, one per
//!   generated token; Completions `logprobs: 0` (the sampled token only) →
//!   `choices[i].logprobs.token_logprobs[]`.
//!
//! **SGLang** (sgl-project/sglang PR #30917, merged 2026-07): request `return_token_ids:
//! true` → per-choice `choices[i].prompt_token_ids` and `choices[i].token_ids` on
//! Completions (JSON and SSE) and on Chat Completions **JSON only**: SGLang refuses
//! `return_token_ids` on a streamed chat request (HTTP 400), so graft adds nothing to those
//! and their records stay text-only. Logprobs use the OpenAI shapes above. (SGLang's later
//! response-level `sglext.input_ids`/`output_ids`, PR #34488, is not used.)
//!
//! The parser reads both shapes in either mode: prompt ids from the top level or from the
//! choice, completion ids from the choice. Only choice 0 is recorded (like `finish_reason`).
//!
//! # What the client gets
//!
//! graft only adds a field the client did not set (`return_token_ids`; `logprobs` only when
//! the client did not mention logprobs, whatever its value: the client's choice stands).
//! The answer is relayed as the upstream sent it except that the outputs of what graft added
//! are removed, from the JSON body and from every SSE chunk: `prompt_token_ids` and
//! `token_ids` (top level and per choice), and `logprobs` (set to `null`, the value an
//! upstream sends when none were asked for) when graft asked for them. A chunk that changed
//! is re-serialized (same key order; number formatting may differ from the upstream's); one
//! that did not is relayed byte for byte. The record's `request` is the client's body, its
//! `upstream_request` the body graft actually sent, its `response` what the client got.

use serde::Deserialize;
use serde_json::Value;
use tracing::{debug, warn};

use crate::route::Route;

/// `upstream.token_ids`: which upstream's way of returning token ids to use.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum TokenIdsMode {
    /// Forward request bodies unchanged; records carry ids only if the upstream sends them.
    #[default]
    Off,
    Vllm,
    Sglang,
}

/// What graft added to a forwarded request (and so removes from the answer).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Added {
    pub return_token_ids: bool,
    pub logprobs: bool,
}

impl Added {
    pub fn any(self) -> bool {
        self.return_token_ids || self.logprobs
    }
}

/// Adds the fields that make the upstream return ids and logprobs to `body` (a Chat
/// Completions or Completions request), where the client did not set them. Returns what was
/// added; `None` when nothing was (mode off, another route, or a combination the upstream
/// refuses).
pub fn augment(mode: TokenIdsMode, route: Route, stream: bool, body: &mut Value) -> Option<Added> {
    if mode == TokenIdsMode::Off {
        return None;
    }
    if !matches!(route, Route::ChatCompletions | Route::Completions) {
        return None;
    }
    if mode == TokenIdsMode::Sglang && route == Route::ChatCompletions && stream {
        // SGLang answers 400 to return_token_ids on a streamed chat request.
        return None;
    }
    let obj = body.as_object_mut()?;
    let mut added = Added::default();
    if obj.get("return_token_ids").is_none_or(Value::is_null) {
        obj.insert("return_token_ids".into(), Value::Bool(true));
        added.return_token_ids = true;
    }
    if obj.get("logprobs").is_none_or(Value::is_null) {
        let v = match route {
            Route::Completions => Value::from(0),
            _ => Value::Bool(true),
        };
        obj.insert("logprobs".into(), v);
        added.logprobs = true;
    }
    added.any().then_some(added)
}

/// Removes the outputs of what graft added from one answer object (a whole response or one
/// SSE chunk). Returns whether anything changed.
pub fn strip(v: &mut Value, added: Added) -> bool {
    let mut changed = false;
    let Some(obj) = v.as_object_mut() else {
        return false;
    };
    if added.return_token_ids {
        changed |= obj.shift_remove("prompt_token_ids").is_some();
    }
    if let Some(choices) = obj.get_mut("choices").and_then(Value::as_array_mut) {
        for c in choices.iter_mut().filter_map(Value::as_object_mut) {
            if added.return_token_ids {
                changed |= c.shift_remove("token_ids").is_some();
                changed |= c.shift_remove("prompt_token_ids").is_some();
            }
            if added.logprobs
                && let Some(lp) = c.get_mut("logprobs")
                && !lp.is_null()
            {
                *lp = Value::Null;
                changed = true;
            }
        }
    }
    changed
}

/// Token ids and logprobs of choice 0, gathered from a whole answer or from its chunks.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Capture {
    pub prompt_ids: Option<Vec<u32>>,
    pub completion_ids: Option<Vec<u32>>,
    /// `None` items: the upstream sent a null logprob (unknown).
    pub logprobs: Option<Vec<Option<f32>>>,
    /// `usage.prompt_tokens` / `usage.completion_tokens`, to check the ids against.
    usage: (Option<u64>, Option<u64>),
    /// An id that is not a u32, or a logprob that is not a number.
    malformed: bool,
}

/// What goes into the record.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Recorded {
    pub prompt_token_ids: Option<Vec<u32>>,
    pub completion_token_ids: Option<Vec<u32>>,
    pub completion_logprobs: Option<Vec<Option<f32>>>,
}

fn ids(v: &Value) -> Option<Result<Vec<u32>, ()>> {
    let a = v.as_array()?;
    Some(
        a.iter()
            .map(|x| x.as_u64().and_then(|n| u32::try_from(n).ok()).ok_or(()))
            .collect(),
    )
}

impl Capture {
    /// Adds a whole answer or one chunk (the upstream's, before [`strip`]).
    pub fn push(&mut self, v: &Value) {
        if let Some(u) = v.get("usage").filter(|u| u.is_object()) {
            self.usage = (
                u.get("prompt_tokens").and_then(Value::as_u64),
                u.get("completion_tokens").and_then(Value::as_u64),
            );
        }
        if let Some(p) = v.get("prompt_token_ids").and_then(ids) {
            self.set_prompt(p);
        }
        let Some(choices) = v.get("choices").and_then(Value::as_array) else {
            return;
        };
        for c in choices {
            if c.get("index").and_then(Value::as_u64).unwrap_or(0) != 0 {
                continue;
            }
            if let Some(p) = c.get("prompt_token_ids").and_then(ids) {
                self.set_prompt(p);
            }
            if let Some(t) = c.get("token_ids").and_then(ids) {
                match t {
                    Ok(t) => self.completion_ids.get_or_insert_with(Vec::new).extend(t),
                    Err(()) => self.malformed = true,
                }
            }
            let Some(lp) = c.get("logprobs").filter(|l| !l.is_null()) else {
                continue;
            };
            // A null logprob is unknown; anything else that is not a number is malformed.
            let number = |v: Option<&Value>| match v {
                None | Some(Value::Null) => Ok(None),
                Some(v) => v.as_f64().map(|x| Some(x as f32)).ok_or(()),
            };
            let values: Vec<Result<Option<f32>, ()>> =
                if let Some(content) = lp.get("content").and_then(Value::as_array) {
                    content.iter().map(|e| number(e.get("logprob"))).collect()
                } else if let Some(tl) = lp.get("token_logprobs").and_then(Value::as_array) {
                    tl.iter().map(|v| number(Some(v))).collect()
                } else {
                    continue;
                };
            let out = self.logprobs.get_or_insert_with(Vec::new);
            for x in values {
                match x {
                    Ok(x) => out.push(x),
                    Err(()) => self.malformed = true,
                }
            }
        }
    }

    fn set_prompt(&mut self, p: Result<Vec<u32>, ()>) {
        match p {
            Ok(p) => self.prompt_ids = Some(p),
            Err(()) => self.malformed = true,
        }
    }

    /// The record's token fields ([`Capture::finish`]), with why they are missing logged;
    /// `asked`: graft asked the upstream for them (`upstream.token_ids`).
    pub fn into_recorded(self, asked: bool) -> Recorded {
        let (recorded, note) = self.finish();
        if let Some(note) = note {
            warn!("passthrough token ids: {note}");
        } else if asked && recorded.prompt_token_ids.is_none() {
            debug!("passthrough token ids were asked for but none came; the record is text-only");
        }
        recorded
    }

    /// The record's token fields, checked: ids are recorded only when both the prompt and
    /// the completion ids came, none is malformed, and their counts agree with `usage` where
    /// the upstream reported it; logprobs only when there is one per completion id. Anything
    /// else leaves the record text-only and says why.
    pub fn finish(self) -> (Recorded, Option<String>) {
        let (Some(prompt), Some(completion)) = (self.prompt_ids, self.completion_ids) else {
            return (Recorded::default(), None);
        };
        if self.malformed {
            return (
                Recorded::default(),
                Some("the upstream sent token ids or logprobs that are not numbers".into()),
            );
        }
        if let Some(n) = self.usage.0
            && n != prompt.len() as u64
        {
            return (
                Recorded::default(),
                Some(format!(
                    "usage.prompt_tokens is {n} but the upstream sent {} prompt token ids",
                    prompt.len()
                )),
            );
        }
        if let Some(n) = self.usage.1
            && n != completion.len() as u64
        {
            return (
                Recorded::default(),
                Some(format!(
                    "usage.completion_tokens is {n} but the upstream sent {} completion token ids",
                    completion.len()
                )),
            );
        }
        let mut note = None;
        let logprobs = match self.logprobs {
            Some(l) if l.len() == completion.len() => Some(l),
            Some(l) => {
                note = Some(format!(
                    "{} logprobs for {} completion token ids; logprobs not recorded",
                    l.len(),
                    completion.len()
                ));
                None
            }
            None => None,
        };
        (
            Recorded {
                prompt_token_ids: Some(prompt),
                completion_token_ids: Some(completion),
                completion_logprobs: logprobs,
            },
            note,
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn augment_adds_only_what_the_client_did_not_set() {
        let mut b = json!({"model": "m", "messages": []});
        let a = augment(TokenIdsMode::Vllm, Route::ChatCompletions, false, &mut b).unwrap();
        assert_eq!(
            a,
            Added {
                return_token_ids: true,
                logprobs: true
            }
        );
        assert_eq!(b["return_token_ids"], true);
        assert_eq!(b["logprobs"], true);

        let mut b = json!({"model": "m", "messages": [], "logprobs": false});
        let a = augment(TokenIdsMode::Vllm, Route::ChatCompletions, true, &mut b).unwrap();
        assert_eq!(
            a,
            Added {
                return_token_ids: true,
                logprobs: false
            }
        );
        assert_eq!(b["logprobs"], false, "the client's choice stands");

        let mut b = json!({"model": "m", "prompt": "x"});
        augment(TokenIdsMode::Vllm, Route::Completions, false, &mut b).unwrap();
        assert_eq!(b["logprobs"], 0);

        let mut b =
            json!({"model": "m", "messages": [], "return_token_ids": true, "logprobs": true});
        assert_eq!(
            augment(TokenIdsMode::Vllm, Route::ChatCompletions, false, &mut b),
            None
        );

        let mut b = json!({"model": "m", "messages": []});
        assert_eq!(
            augment(TokenIdsMode::Off, Route::ChatCompletions, false, &mut b),
            None
        );
        assert_eq!(
            augment(TokenIdsMode::Sglang, Route::ChatCompletions, true, &mut b),
            None
        );
        assert_eq!(b, json!({"model": "m", "messages": []}));
        assert!(augment(TokenIdsMode::Sglang, Route::ChatCompletions, false, &mut b).is_some());
        let mut b = json!({"model": "m", "input": []});
        assert_eq!(
            augment(TokenIdsMode::Vllm, Route::Responses, false, &mut b),
            None
        );
    }

    #[test]
    fn strip_removes_only_added_outputs() {
        let orig = json!({"id": "x", "prompt_token_ids": [1, 2], "choices": [{"index": 0, "message": {"content": "hi"}, "logprobs": {"content": [{"token": "hi", "logprob": -0.5}]}, "token_ids": [3], "finish_reason": "stop"}]});
        let mut v = orig.clone();
        assert!(strip(
            &mut v,
            Added {
                return_token_ids: true,
                logprobs: true
            }
        ));
        assert_eq!(
            v,
            json!({"id": "x", "choices": [{"index": 0, "message": {"content": "hi"}, "logprobs": null, "finish_reason": "stop"}]})
        );
        let mut v = orig.clone();
        assert!(strip(
            &mut v,
            Added {
                return_token_ids: true,
                logprobs: false
            }
        ));
        assert_eq!(v["choices"][0]["logprobs"]["content"][0]["logprob"], -0.5);
        let mut v = json!({"choices": [{"index": 0, "delta": {}, "logprobs": null}]});
        assert!(!strip(
            &mut v,
            Added {
                return_token_ids: true,
                logprobs: true
            }
        ));
    }

    #[test]
    fn capture_accumulates_chunks_and_checks_usage() {
        let mut c = Capture::default();
        c.push(&json!({"prompt_token_ids": [1, 2, 3], "choices": [{"index": 0, "delta": {"role": "assistant"}, "token_ids": []}]}));
        c.push(&json!({"choices": [{"index": 0, "delta": {"content": "a"}, "token_ids": [7], "logprobs": {"content": [{"logprob": -0.25}]}}]}));
        c.push(&json!({"choices": [{"index": 1, "delta": {"content": "b"}, "token_ids": [9]}]}));
        c.push(&json!({"choices": [{"index": 0, "delta": {}, "token_ids": [8], "logprobs": {"content": [{"logprob": -1.0}]}, "finish_reason": "stop"}]}));
        c.push(&json!({"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 2}}));
        let (r, note) = c.finish();
        assert_eq!(note, None);
        assert_eq!(r.prompt_token_ids, Some(vec![1, 2, 3]));
        assert_eq!(r.completion_token_ids, Some(vec![7, 8]));
        assert_eq!(r.completion_logprobs, Some(vec![Some(-0.25), Some(-1.0)]));

        let mut c = Capture::default();
        c.push(&json!({"choices": [{"index": 0, "prompt_token_ids": [1], "token_ids": [2, 3], "logprobs": {"token_logprobs": [-0.5]}}], "usage": {"prompt_tokens": 1, "completion_tokens": 2}}));
        let (r, note) = c.finish();
        assert_eq!(r.completion_token_ids, Some(vec![2, 3]));
        assert_eq!(r.completion_logprobs, None);
        assert!(note.unwrap().contains("1 logprobs for 2"));

        let mut c = Capture::default();
        c.push(&json!({"prompt_token_ids": [1], "choices": [{"index": 0, "token_ids": [2]}], "usage": {"prompt_tokens": 5}}));
        let (r, note) = c.finish();
        assert_eq!(r, Recorded::default());
        assert!(note.unwrap().contains("prompt_tokens is 5"));

        let (r, note) = Capture::default().finish();
        assert_eq!((r, note), (Recorded::default(), None));
    }

    #[test]
    fn a_null_logprob_is_recorded_unknown_not_zero() {
        let mut c = Capture::default();
        c.push(&json!({"choices": [{"index": 0, "prompt_token_ids": [1], "token_ids": [2, 3, 4], "logprobs": {"token_logprobs": [null, 0.0, -0.5]}}]}));
        let (r, note) = c.finish();
        assert_eq!(note, None);
        assert_eq!(
            r.completion_logprobs,
            Some(vec![None, Some(0.0), Some(-0.5)])
        );

        let mut c = Capture::default();
        c.push(&json!({"choices": [{"index": 0, "prompt_token_ids": [1], "token_ids": [2], "logprobs": {"token_logprobs": ["x"]}}]}));
        let (r, note) = c.finish();
        assert_eq!(r, Recorded::default());
        assert!(note.unwrap().contains("not numbers"));
    }
}

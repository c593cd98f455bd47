//! Completions requests → [`Conversation`]: no messages, the raw prompt in
//! [`Conversation::prompt`].

use serde_json::{Map, Value};

use crate::dialect::json::{Fields, Wording, given, non_negative_int};
use crate::dialect::{Conversation, RawPrompt, Sampling, kind};
use crate::error::GatewayError;

const F: Fields = Fields(Wording::Quoted);

/// Top-level keys this parser maps or refuses; every other key (`logprobs`, `user`, server
/// extensions) is kept in `Conversation::extra`.
const MAPPED_KEYS: &[&str] = &[
    "model",
    "prompt",
    "response_format",
    "stream",
    "stream_options",
    "temperature",
    "top_p",
    "top_k",
    "max_tokens",
    "stop",
    "seed",
    "presence_penalty",
    "frequency_penalty",
    "min_p",
    "repetition_penalty",
    "logit_bias",
    "n",
    "best_of",
    "echo",
    "suffix",
];

const PROMPT_SHAPES: &str = "a string, an array with one string, or an array of token ids";

/// `n` and `best_of`: at least 1; more than 1 is refused (`why` says why).
fn one_at_most(obj: &Map<String, Value>, key: &str, why: &str) -> Result<(), GatewayError> {
    match non_negative_int(obj, key)? {
        None | Some(1) => Ok(()),
        Some(0) => Err(GatewayError::field(
            key,
            format!("'{key}' must be at least 1, got 0"),
        )),
        Some(n) => Err(GatewayError::field(
            key,
            format!("'{key}' = {n} is not supported: {why}"),
        )),
    }
}

fn token_ids(items: &[Value], path: &str) -> Result<Vec<u32>, GatewayError> {
    if items.is_empty() {
        return Err(GatewayError::field(
            path,
            format!("'{path}' is an empty list of token ids: send at least one token"),
        ));
    }
    items
        .iter()
        .enumerate()
        .map(|(i, v)| {
            v.as_u64()
                .and_then(|n| u32::try_from(n).ok())
                .ok_or_else(|| {
                    GatewayError::field(
                        format!("{path}[{i}]"),
                        format!(
                            "'{path}[{i}]' must be a token id (an integer from 0 to {}), got {v}",
                            u32::MAX
                        ),
                    )
                })
        })
        .collect()
}

fn parse_prompt(v: Option<&Value>) -> Result<RawPrompt, GatewayError> {
    let items = match v {
        None => {
            return Err(GatewayError::field(
                "prompt",
                format!("'prompt' is required: {PROMPT_SHAPES}"),
            ));
        }
        Some(Value::String(s)) => return Ok(RawPrompt::Text(s.clone())),
        Some(Value::Array(items)) => items,
        Some(other) => return Err(F.wrong("prompt", PROMPT_SHAPES, other)),
    };
    match items.as_slice() {
        [] => Err(GatewayError::field(
            "prompt",
            format!("'prompt' is an empty array: send {PROMPT_SHAPES} (\"\" for an empty prompt)"),
        )),
        [Value::String(s)] => Ok(RawPrompt::Text(s.clone())),
        [Value::Array(ids)] => Ok(RawPrompt::Tokens(token_ids(ids, "prompt[0]")?)),
        [Value::Number(_), ..] => Ok(RawPrompt::Tokens(token_ids(items, "prompt")?)),
        [Value::String(_) | Value::Array(_), ..] => Err(GatewayError::field(
            "prompt",
            format!(
                "'prompt' holds {} prompts (a batch), which graft does not take: it records one \
                 completion of one prompt per call; send one request per prompt",
                items.len()
            ),
        )),
        [other, ..] => Err(F.wrong(
            "prompt[0]",
            "a string, a token id or an array of token ids",
            other,
        )),
    }
}

fn parse_stop(v: Option<&Value>) -> Result<Vec<String>, GatewayError> {
    match v {
        None => Ok(vec![]),
        Some(Value::String(s)) => Ok(vec![s.clone()]),
        Some(Value::Array(items)) => items
            .iter()
            .enumerate()
            .map(|(i, s)| match s {
                Value::String(s) => Ok(s.clone()),
                other => Err(F.wrong(&format!("stop[{i}]"), "a string", other)),
            })
            .collect(),
        Some(other) => Err(F.wrong("stop", "a string or an array of strings", other)),
    }
}

/// Completions request → conversation (no messages; the raw prompt in `prompt`).
/// What every Completions call is checked for before any leg (passthrough relays the body
/// as it is): a `prompt`, a string or an array.
pub(super) fn check(obj: &Map<String, Value>) -> Result<(), GatewayError> {
    match obj.get("prompt") {
        Some(Value::String(_)) | Some(Value::Array(_)) => {}
        Some(p) => {
            return Err(GatewayError::field(
                "prompt",
                format!("'prompt' must be a string or an array, got {}", kind(p)),
            ));
        }
        None => return Err(GatewayError::field("prompt", "'prompt' is required")),
    }
    Ok(())
}

pub fn parse_request(body: &Value) -> Result<Conversation, GatewayError> {
    let Some(obj) = body.as_object() else {
        return Err(GatewayError::field(
            "",
            format!("the request body must be a JSON object, got {}", kind(body)),
        ));
    };
    let model = match obj.get("model") {
        Some(Value::String(m)) => m.clone(),
        Some(o) => return Err(F.wrong("model", "a string", o)),
        None => return Err(GatewayError::field("model", "'model' is required")),
    };
    let prompt = parse_prompt(given(obj, "prompt"))?;

    if F.opt_bool(obj, "echo", "echo")? == Some(true) {
        return Err(GatewayError::field(
            "echo",
            "'echo': true is not supported: graft answers with the completion only; drop `echo` \
             (the prompt is the one you sent)",
        ));
    }
    match given(obj, "suffix") {
        None => {}
        Some(Value::String(s)) if s.is_empty() => {}
        Some(Value::String(_)) => {
            return Err(GatewayError::field(
                "suffix",
                "'suffix' (insertion) is not supported: the model continues the prompt; drop \
                 `suffix` or put the text in the prompt",
            ));
        }
        Some(v) => return Err(F.wrong("suffix", "a string", v)),
    }
    one_at_most(
        obj,
        "best_of",
        "the candidates the server would discard are never returned, so graft could not record \
         what was sampled; drop `best_of`",
    )?;
    one_at_most(
        obj,
        "n",
        "graft records one completion per call; send n requests",
    )?;
    if let Some(v) = given(obj, "logprobs")
        && v.as_u64().is_none()
    {
        return Err(F.wrong("logprobs", "a non-negative integer", v));
    }

    let include_usage = match given(obj, "stream_options") {
        None => false,
        Some(Value::Object(o)) => F
            .opt_bool(o, "include_usage", "stream_options.include_usage")?
            .unwrap_or(false),
        Some(v) => return Err(F.wrong("stream_options", "an object", v)),
    };
    let top_k = match given(obj, "top_k") {
        None => None,
        // vLLM's -1 (and SGLang's) means "no top-k".
        Some(Value::Number(n)) if n.as_i64() == Some(-1) => None,
        Some(Value::Number(n)) if n.as_u64().is_some() => n.as_u64(),
        Some(v) => return Err(F.wrong("top_k", "a non-negative integer (or -1 for none)", v)),
    };
    let seed = match given(obj, "seed") {
        None => None,
        Some(Value::Number(n)) if n.as_i64().is_some() => n.as_i64(),
        Some(v) => return Err(F.wrong("seed", "an integer", v)),
    };
    let sampling = Sampling {
        temperature: F.opt_f64(obj, "temperature", "temperature")?,
        top_p: F.opt_f64(obj, "top_p", "top_p")?,
        top_k,
        max_tokens: non_negative_int(obj, "max_tokens")?,
        stop: parse_stop(given(obj, "stop"))?,
        seed,
        presence_penalty: F.opt_f64(obj, "presence_penalty", "presence_penalty")?,
        frequency_penalty: F.opt_f64(obj, "frequency_penalty", "frequency_penalty")?,
        min_p: F.opt_f64(obj, "min_p", "min_p")?,
        repetition_penalty: F.opt_f64(obj, "repetition_penalty", "repetition_penalty")?,
        logit_bias: crate::dialect::logit_bias_of(given(obj, "logit_bias"))?,
        // SGLang's and vLLM's Completions take Chat's `response_format` too.
        format: crate::dialect::OutputFormat::from_openai(
            given(obj, "response_format"),
            "response_format",
            true,
        )?,
    };
    let extra: Map<String, Value> = obj
        .iter()
        .filter(|(k, _)| !MAPPED_KEYS.contains(&k.as_str()))
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect();
    Ok(Conversation {
        model,
        messages: vec![],
        sampling,
        stream: F.opt_bool(obj, "stream", "stream")?.unwrap_or(false),
        extra,
        include_usage,
        prompt: Some(prompt),
        // `logprobs: n`: the sampled tokens' logprobs and the n most likely at each position.
        logprobs: given(obj, "logprobs")
            .and_then(Value::as_u64)
            .map(|n| u32::try_from(n).unwrap_or(u32::MAX)),
        ..Conversation::default()
    })
}

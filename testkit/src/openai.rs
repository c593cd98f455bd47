//! The OpenAI wire shapes the scripted upstream answers in: Chat Completions and
//! Completions, whole (JSON) and streamed (SSE, split the way a tokenizer-driven stream
//! arrives), with token ids and logprobs as vLLM sends them when asked (`--tokenizer`).

use bytes::Bytes;
use serde_json::{Value, json};

use crate::ARGUMENT_PIECES;
use crate::script::{Prompt, Reply, ScriptToolCall, count_words, scripted_logprob};

/// The two OpenAI routes the scripted upstream answers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Dialect {
    Chat,
    Completions,
}

pub(crate) struct Meta {
    pub(crate) id: u64,
    pub(crate) created: u64,
    pub(crate) model: String,
}

impl Meta {
    pub(crate) fn chat_id(&self) -> String {
        format!("chatcmpl-scripted{:012x}", self.id)
    }
    pub(crate) fn completion_id(&self) -> String {
        format!("cmpl-scripted{:012x}", self.id)
    }
    pub(crate) fn tool_call_id(&self, index: usize) -> String {
        format!("call_scripted{:08x}x{index}", self.id)
    }
}

pub(crate) fn finish_reason(reply: &Reply) -> &str {
    match &reply.finish_reason {
        Some(r) => r,
        None if reply.tool_calls.is_empty() => "stop",
        None => "tool_calls",
    }
}

pub(crate) fn usage_for(prompt: &Prompt, reply: &Reply) -> Value {
    let completion = count_words(reply.content.as_deref().unwrap_or_default())
        + reply
            .tool_calls
            .iter()
            .map(|c| count_words(&c.arguments_string()))
            .sum::<u64>();
    json!({
        "prompt_tokens": prompt.prompt_words,
        "completion_tokens": completion,
        "total_tokens": prompt.prompt_words + completion,
    })
}

pub(crate) fn chat_json(
    meta: &Meta,
    reply: &Reply,
    usage: &Value,
    tokens: Option<&TokenAnswer>,
) -> Value {
    let mut message = json!({
        "role": "assistant",
        "content": reply.content,
        "refusal": null,
    });
    if !reply.tool_calls.is_empty() {
        let calls: Vec<Value> = reply
            .tool_calls
            .iter()
            .enumerate()
            .map(|(i, c)| {
                json!({
                    "id": meta.tool_call_id(i),
                    "type": "function",
                    "function": {"name": c.name, "arguments": c.arguments_string()},
                })
            })
            .collect();
        message["tool_calls"] = Value::Array(calls);
    }
    let mut v = json!({
        "id": meta.chat_id(),
        "object": "chat.completion",
        "created": meta.created,
        "model": meta.model,
        "choices": [{
            "index": 0,
            "message": message,
            "logprobs": null,
            "finish_reason": finish_reason(reply),
        }],
        "usage": usage,
        "system_fingerprint": "fp_graft_scripted",
    });
    if let Some(t) = tokens {
        let all: Vec<usize> = (0..t.completion.len()).collect();
        if t.want_logprobs {
            v["choices"][0]["logprobs"] = t.chat_logprobs(&all);
        }
        if t.want_ids {
            v["choices"][0]["token_ids"] = json!(t.completion);
            v["prompt_token_ids"] = json!(t.prompt);
        }
    }
    v
}

pub(crate) fn completion_json(
    meta: &Meta,
    reply: &Reply,
    usage: &Value,
    tokens: Option<&TokenAnswer>,
) -> Value {
    let mut v = json!({
        "id": meta.completion_id(),
        "object": "text_completion",
        "created": meta.created,
        "model": meta.model,
        "choices": [{
            "text": reply.content.as_deref().unwrap_or_default(),
            "index": 0,
            "logprobs": null,
            "finish_reason": finish_reason(reply),
        }],
        "usage": usage,
    });
    if let Some(t) = tokens {
        let all: Vec<usize> = (0..t.completion.len()).collect();
        if t.want_logprobs {
            v["choices"][0]["logprobs"] = t.completion_logprobs(&all, 0);
        }
        if t.want_ids {
            v["choices"][0]["prompt_token_ids"] = json!(t.prompt);
            v["choices"][0]["token_ids"] = json!(t.completion);
        }
    }
    v
}

/// One SSE event: `data: {json}\n\n`.
pub(crate) fn sse(v: &Value) -> Bytes {
    Bytes::from(format!("data: {v}\n\n"))
}

pub(crate) const DONE: &[u8] = b"data: [DONE]\n\n";

/// Splits text into word-sized deltas (each word keeps the whitespace before it), the way
/// a tokenizer-driven stream arrives. Concatenating the pieces gives back `text` exactly.
pub(crate) fn split_words(text: &str) -> Vec<&str> {
    let mut pieces = Vec::new();
    let mut start = 0;
    let mut in_word = false;
    for (i, ch) in text.char_indices() {
        if ch.is_whitespace() {
            if in_word {
                pieces.push(&text[start..i]);
                start = i;
                in_word = false;
            }
        } else {
            in_word = true;
        }
    }
    if start < text.len() {
        pieces.push(&text[start..]);
    }
    pieces
}

/// Splits a string into at most `n` non-empty pieces on char boundaries.
pub(crate) fn split_n(text: &str, n: usize) -> Vec<&str> {
    let chars = text.chars().count();
    if chars == 0 {
        return Vec::new();
    }
    let per = chars.div_ceil(n.max(1));
    let mut pieces = Vec::new();
    let mut start = 0;
    for (count, (i, _)) in text.char_indices().enumerate() {
        if count > 0 && count % per == 0 {
            pieces.push(&text[start..i]);
            start = i;
        }
    }
    pieces.push(&text[start..]);
    pieces
}

/// One chunk of a streamed answer before it is rendered: its delta (chat) or text piece,
/// its finish reason, and the text of the completion it stands for (what the model
/// generated, special tokens included; used to split the token ids along the chunks).
pub(crate) struct Piece {
    pub(crate) delta: Value,
    pub(crate) finish: Option<String>,
    pub(crate) text: String,
}

/// The chunks of a chat answer, in order. `eos` is the end-of-turn token the model ends
/// with (empty without a tokenizer).
pub(crate) fn chat_pieces(meta: &Meta, reply: &Reply, eos: &str) -> Vec<Piece> {
    let piece = |delta: Value, text: String| Piece {
        delta,
        finish: None,
        text,
    };
    let tool_header = |i: usize, call: &ScriptToolCall| {
        json!([{
            "index": i,
            "id": meta.tool_call_id(i),
            "type": "function",
            "function": {"name": call.name, "arguments": ""},
        }])
    };
    let content = reply.content.as_deref().unwrap_or_default();
    // The Hermes form of a tool call as Qwen3's template writes it in history: a newline
    // before it unless it opens the turn, the arguments verbatim, then `}` and the tag.
    let header_text = |i: usize, call: &ScriptToolCall| {
        format!(
            "{}<tool_call>\n{{\"name\": \"{}\", \"arguments\": ",
            if i > 0 || !content.is_empty() {
                "\n"
            } else {
                ""
            },
            call.name
        )
    };
    let mut out = Vec::new();
    let mut calls = reply.tool_calls.iter().enumerate().peekable();
    if content.is_empty() && calls.peek().is_some() {
        // Tool calls only: the role arrives with the first tool call's header, content null.
        if let Some((i, call)) = calls.next() {
            out.push(piece(
                json!({"role": "assistant", "content": null, "tool_calls": tool_header(i, call)}),
                header_text(i, call),
            ));
            push_arguments(&mut out, i, call);
        }
    } else {
        out.push(piece(
            json!({"role": "assistant", "content": "", "refusal": null}),
            String::new(),
        ));
        for p in split_words(content) {
            out.push(piece(json!({"content": p}), p.to_owned()));
        }
    }
    for (i, call) in calls {
        out.push(piece(
            json!({"tool_calls": tool_header(i, call)}),
            header_text(i, call),
        ));
        push_arguments(&mut out, i, call);
    }
    out.push(Piece {
        delta: json!({}),
        finish: Some(finish_reason(reply).to_owned()),
        text: eos.to_owned(),
    });
    out
}

/// The chat SSE stream exactly as OpenAI sends it: a first delta with the role, the content
/// in several deltas, each tool call's header (index, id, type, name, empty arguments)
/// followed by its arguments in pieces, a final chunk with `finish_reason`, a usage chunk
/// with `choices: []` iff `stream_options.include_usage`, then `[DONE]`. With `tokens`, as
/// vLLM streams `return_token_ids`/`logprobs`: `prompt_token_ids` on the first chunk, each
/// chunk's new `token_ids` and `logprobs` in its choice.
pub(crate) fn chat_events(
    meta: &Meta,
    reply: &Reply,
    usage: Option<&Value>,
    tokens: Option<&TokenAnswer>,
) -> Vec<Bytes> {
    let id = meta.chat_id();
    let pieces = chat_pieces(meta, reply, tokens.map_or("", |t| t.eos.as_str()));
    let split = tokens.map(|t| t.split(&pieces));
    let mut events = Vec::new();
    for (k, p) in pieces.iter().enumerate() {
        let mut c = json!({
            "id": id,
            "object": "chat.completion.chunk",
            "created": meta.created,
            "model": meta.model,
            "system_fingerprint": "fp_graft_scripted",
            "choices": [{"index": 0, "delta": p.delta, "logprobs": null, "finish_reason": p.finish}],
        });
        if usage.is_some() {
            // With include_usage every chunk carries `usage: null` but the last one.
            c["usage"] = Value::Null;
        }
        if let (Some(t), Some(split)) = (tokens, &split) {
            let idx = &split[k];
            if t.want_logprobs && !idx.is_empty() {
                c["choices"][0]["logprobs"] = t.chat_logprobs(idx);
            }
            if t.want_ids {
                c["choices"][0]["token_ids"] = json!(t.ids_of(idx));
                if k == 0 {
                    c["prompt_token_ids"] = json!(t.prompt);
                }
            }
        }
        events.push(sse(&c));
    }
    if let Some(usage) = usage {
        events.push(sse(&json!({
            "id": id,
            "object": "chat.completion.chunk",
            "created": meta.created,
            "model": meta.model,
            "system_fingerprint": "fp_graft_scripted",
            "choices": [],
            "usage": usage,
        })));
    }
    events.push(Bytes::from_static(DONE));
    events
}

pub(crate) fn push_arguments(out: &mut Vec<Piece>, index: usize, call: &ScriptToolCall) {
    let args = call.arguments_string();
    let pieces = split_n(&args, ARGUMENT_PIECES);
    let n = pieces.len();
    for (j, piece) in pieces.into_iter().enumerate() {
        let mut text = piece.to_owned();
        if j + 1 == n {
            text.push_str("}\n</tool_call>");
        }
        out.push(Piece {
            delta: json!({"tool_calls": [{"index": index, "function": {"arguments": piece}}]}),
            finish: None,
            text,
        });
    }
    if n == 0
        && let Some(last) = out.last_mut()
    {
        last.text.push_str("}\n</tool_call>");
    }
}

/// The pieces of a completions answer: the text in word-sized pieces, then the finish.
pub(crate) fn completion_pieces(reply: &Reply, eos: &str) -> Vec<Piece> {
    let mut out: Vec<Piece> = split_words(reply.content.as_deref().unwrap_or_default())
        .into_iter()
        .map(|p| Piece {
            delta: json!(p),
            finish: None,
            text: p.to_owned(),
        })
        .collect();
    out.push(Piece {
        delta: json!(""),
        finish: Some(finish_reason(reply).to_owned()),
        text: eos.to_owned(),
    });
    out
}

/// The completions SSE stream: `text_completion` chunks with the text in pieces, a final
/// chunk with `finish_reason`, the usage chunk iff `include_usage`, then `[DONE]`.
pub(crate) fn completion_events(
    meta: &Meta,
    reply: &Reply,
    usage: Option<&Value>,
    tokens: Option<&TokenAnswer>,
) -> Vec<Bytes> {
    let id = meta.completion_id();
    let pieces = completion_pieces(reply, tokens.map_or("", |t| t.eos.as_str()));
    let split = tokens.map(|t| t.split(&pieces));
    let mut events = Vec::new();
    let mut offset = 0;
    for (k, p) in pieces.iter().enumerate() {
        let mut c = json!({
            "id": id,
            "object": "text_completion",
            "created": meta.created,
            "model": meta.model,
            "choices": [{"text": p.delta, "index": 0, "logprobs": null, "finish_reason": p.finish}],
        });
        if usage.is_some() {
            c["usage"] = Value::Null;
        }
        if let (Some(t), Some(split)) = (tokens, &split) {
            let idx = &split[k];
            if t.want_logprobs && !idx.is_empty() {
                c["choices"][0]["logprobs"] = t.completion_logprobs(idx, offset);
            }
            if t.want_ids {
                c["choices"][0]["token_ids"] = json!(t.ids_of(idx));
                if k == 0 {
                    c["choices"][0]["prompt_token_ids"] = json!(t.prompt);
                }
            }
        }
        offset += p.delta.as_str().map_or(0, str::len);
        events.push(sse(&c));
    }
    if let Some(usage) = usage {
        events.push(sse(&json!({
            "id": id,
            "object": "text_completion",
            "created": meta.created,
            "model": meta.model,
            "choices": [],
            "usage": usage,
        })));
    }
    events.push(Bytes::from_static(DONE));
    events
}

/// One answer's tokens.
pub(crate) struct TokenAnswer {
    pub(crate) eos: String,
    pub(crate) prompt: Vec<u32>,
    pub(crate) completion: Vec<u32>,
    /// Byte offset in the completion text where each completion token's text ends.
    pub(crate) ends: Vec<usize>,
    /// Each completion token's text.
    pub(crate) tokens: Vec<String>,
    pub(crate) want_ids: bool,
    pub(crate) want_logprobs: bool,
}

impl TokenAnswer {
    pub(crate) fn usage(&self) -> Value {
        let (p, c) = (self.prompt.len(), self.completion.len());
        json!({"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c})
    }

    /// The completion tokens each piece carries: a token goes with the piece in which its
    /// text ends (the text of a chunk and its ids stay together; a token that straddles two
    /// pieces goes with the later one). Concatenated, the pieces' ids are the completion.
    pub(crate) fn split(&self, pieces: &[Piece]) -> Vec<Vec<usize>> {
        let mut out = vec![Vec::new(); pieces.len()];
        let mut bound = 0;
        let mut k = 0;
        for (i, end) in self.ends.iter().enumerate() {
            while k + 1 < pieces.len() && {
                let b = bound + pieces[k].text.len();
                *end > b
            } {
                bound += pieces[k].text.len();
                k += 1;
            }
            if let Some(slot) = out.get_mut(k) {
                slot.push(i);
            }
        }
        out
    }

    pub(crate) fn ids_of(&self, idx: &[usize]) -> Vec<u32> {
        idx.iter()
            .filter_map(|&i| self.completion.get(i).copied())
            .collect()
    }

    /// Chat logprobs (`{"content": [{token, logprob, bytes, top_logprobs}]}`).
    pub(crate) fn chat_logprobs(&self, idx: &[usize]) -> Value {
        let content: Vec<Value> = idx
            .iter()
            .filter_map(|&i| {
                let id = *self.completion.get(i)?;
                let tok = self.tokens.get(i)?;
                Some(json!({
                    "token": tok,
                    "logprob": scripted_logprob(id),
                    "bytes": tok.as_bytes(),
                    "top_logprobs": [],
                }))
            })
            .collect();
        json!({ "content": content })
    }

    /// Completions logprobs (parallel arrays), text offsets from `offset`.
    pub(crate) fn completion_logprobs(&self, idx: &[usize], offset: usize) -> Value {
        let mut tokens = vec![];
        let mut lps = vec![];
        let mut offsets = vec![];
        let mut at = offset;
        for &i in idx {
            let (Some(id), Some(tok)) = (self.completion.get(i), self.tokens.get(i)) else {
                continue;
            };
            tokens.push(json!(tok));
            lps.push(json!(scripted_logprob(*id)));
            offsets.push(json!(at));
            at += tok.len();
        }
        let top: Vec<Value> = tokens.iter().map(|_| json!({})).collect();
        json!({"tokens": tokens, "token_logprobs": lps, "top_logprobs": top, "text_offset": offsets})
    }
}

//! Token ids (`--tokenizer`): a model's chat template and tokenizer, for answering like vLLM
//! with `return_token_ids` / `logprobs`, and for the SGLang side's `/generate`.

use anyhow::Context as _;
use serde_json::{Value, json};

use crate::openai::{Meta, Piece, chat_pieces, completion_pieces};
use crate::script::Reply;
use crate::server::Dialect;

/// A model's chat template and tokenizer, for answering like vLLM with token ids.
pub struct TokenModel {
    pub(crate) template: graft_reconstruct::template::ChatTemplate,
    pub(crate) tokenizer: graft_reconstruct::template::Tokenizer,
    /// The end-of-turn token every completion ends with (`<|im_end|>` for Qwen3).
    pub(crate) eos: String,
}

/// The deterministic logprob the scripted model reports for a token.
pub fn scripted_logprob(id: u32) -> f64 {
    -f64::from(id % 97) / 100.0
}

impl TokenModel {
    pub fn load(dir: &std::path::Path) -> anyhow::Result<Self> {
        let template = graft_reconstruct::template::ChatTemplate::from_dir(dir)
            .with_context(|| format!("cannot load the chat template from {}", dir.display()))?;
        let tokenizer = graft_reconstruct::template::Tokenizer::from_dir(dir)
            .with_context(|| format!("cannot load the tokenizer from {}", dir.display()))?;
        let eos = template.eos_token().unwrap_or_default().to_owned();
        Ok(TokenModel {
            template,
            tokenizer,
            eos,
        })
    }

    /// Whether the model opens its own think block after `prompt`: a hybrid thinking
    /// template (Qwen3's, with its `enable_thinking` toggle) whose generation prompt leaves
    /// thinking on (it ends at `<|im_start|>assistant\n`, without the empty `<think>` block the
    /// template adds when thinking is off, or an open one). Real Qwen3 writes `<think>` then.
    pub(crate) fn thinks_after(&self, prompt: &str) -> bool {
        self.template.has_thinking_toggle() && prompt.ends_with("<|im_start|>assistant\n")
    }

    /// The prompt ids of a request: chat messages (+ tools) rendered with the generation
    /// prompt (as vLLM applies the template; `chat_template_kwargs` are passed on), or the
    /// completions prompt, tokenized.
    pub(crate) fn prompt_ids(&self, dialect: Dialect, body: &Value) -> Result<Vec<u32>, String> {
        let text = match dialect {
            Dialect::Chat => {
                let messages = graft_reconstruct::exact::template_messages(
                    body.get("messages")
                        .and_then(Value::as_array)
                        .map_or(&[][..], Vec::as_slice),
                );
                let tools = body
                    .get("tools")
                    .and_then(Value::as_array)
                    .filter(|t| !t.is_empty())
                    .map(Vec::as_slice);
                let extra = body
                    .get("chat_template_kwargs")
                    .and_then(Value::as_object)
                    .cloned()
                    .unwrap_or_default();
                self.template
                    .render(&messages, tools, true, &extra)
                    .map_err(|e| format!("cannot apply the chat template: {e}"))?
            }
            Dialect::Completions => match body.get("prompt") {
                Some(Value::Array(items)) if items.iter().all(Value::is_u64) => {
                    return Ok(items
                        .iter()
                        .filter_map(Value::as_u64)
                        .filter_map(|n| u32::try_from(n).ok())
                        .collect());
                }
                Some(Value::Array(items)) => items
                    .iter()
                    .filter_map(Value::as_str)
                    .collect::<Vec<_>>()
                    .join("\n"),
                Some(Value::String(p)) => p.clone(),
                _ => String::new(),
            },
        };
        self.tokenizer
            .encode(&text)
            .map_err(|e| format!("cannot tokenize the prompt: {e}"))
    }

    /// Tokenizes the prompt and the reply, and notes what the request asked for.
    pub(crate) fn answer(
        &self,
        dialect: Dialect,
        body: &Value,
        meta: &Meta,
        reply: &Reply,
    ) -> Result<TokenAnswer, String> {
        let prompt = self.prompt_ids(dialect, body)?;
        let pieces = match dialect {
            Dialect::Chat => chat_pieces(meta, reply, &self.eos),
            Dialect::Completions => completion_pieces(reply, &self.eos),
        };
        let text: String = pieces.iter().map(|p| p.text.as_str()).collect();
        let completion = self
            .tokenizer
            .encode(&text)
            .map_err(|e| format!("cannot tokenize the completion: {e}"))?;
        // Where each token's text ends in the completion text (decoding the prefix).
        let mut ends = Vec::with_capacity(completion.len());
        let mut tokens = Vec::with_capacity(completion.len());
        for i in 0..completion.len() {
            let prefix = self
                .tokenizer
                .decode(&completion[..=i])
                .map_err(|e| format!("cannot decode the completion: {e}"))?;
            ends.push(prefix.len());
            tokens.push(
                self.tokenizer
                    .decode(&completion[i..=i])
                    .map_err(|e| format!("cannot decode the completion: {e}"))?,
            );
        }
        let want_logprobs = match dialect {
            Dialect::Chat => body.get("logprobs").and_then(Value::as_bool) == Some(true),
            Dialect::Completions => body.get("logprobs").is_some_and(Value::is_u64),
        };
        Ok(TokenAnswer {
            eos: self.eos.clone(),
            prompt,
            completion,
            ends,
            tokens,
            want_ids: body.get("return_token_ids").and_then(Value::as_bool) == Some(true),
            want_logprobs,
        })
    }
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

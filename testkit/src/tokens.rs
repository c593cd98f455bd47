//! Token ids (`--tokenizer`): a model's chat template and tokenizer, for answering like vLLM
//! with `return_token_ids` / `logprobs`, and for the SGLang side's `/generate`.

use anyhow::Context as _;
use serde_json::Value;

use crate::openai::{Dialect, Meta, TokenAnswer, chat_pieces, completion_pieces};
use crate::script::Reply;

/// A model's chat template and tokenizer, for answering like vLLM with token ids.
pub struct TokenModel {
    pub(crate) template: graft_reconstruct::template::ChatTemplate,
    pub(crate) tokenizer: graft_reconstruct::template::Tokenizer,
    /// The end-of-turn token every completion ends with (`<|im_end|>` for Qwen3).
    pub(crate) eos: String,
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

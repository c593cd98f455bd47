//! Qwen3 (dense): RMSNorm on each q and k head before RoPE, no biases (unless
//! `attention_bias`), an explicit `head_dim`. Mirrors HF `Qwen3Config`
//! (transformers `models/qwen3/configuration_qwen3.py`).

use serde::Deserialize;

use super::Spec;

#[derive(Debug, Clone, PartialEq, Deserialize)]
pub struct Config {
    pub vocab_size: i64,
    pub hidden_size: i64,
    pub intermediate_size: i64,
    pub num_hidden_layers: i64,
    pub num_attention_heads: i64,
    #[serde(default)]
    pub num_key_value_heads: Option<i64>,
    /// HF's default is 128 (not `hidden / heads`).
    #[serde(default = "default_head_dim")]
    pub head_dim: i64,
    #[serde(default = "default_eps")]
    pub rms_norm_eps: f64,
    #[serde(default)]
    pub rope_theta: Option<f64>,
    #[serde(default)]
    pub rope_parameters: Option<serde_json::Value>,
    #[serde(default)]
    pub rope_scaling: Option<serde_json::Value>,
    #[serde(default)]
    pub tie_word_embeddings: bool,
    #[serde(default)]
    pub attention_bias: bool,
    #[serde(default = "default_act")]
    pub hidden_act: String,
    #[serde(default)]
    pub use_sliding_window: bool,
    #[serde(default)]
    pub max_position_embeddings: Option<i64>,
}

fn default_head_dim() -> i64 {
    128
}

fn default_eps() -> f64 {
    1e-6
}

fn default_act() -> String {
    "silu".to_owned()
}

impl Config {
    pub fn spec(&self) -> Result<Spec, String> {
        super::check_act(&self.hidden_act)?;
        if self.use_sliding_window {
            return Err("use_sliding_window = true is not supported".to_owned());
        }
        Spec {
            vocab_size: self.vocab_size,
            hidden_size: self.hidden_size,
            intermediate_size: self.intermediate_size,
            num_layers: self.num_hidden_layers,
            num_heads: self.num_attention_heads,
            num_kv_heads: self.num_key_value_heads.unwrap_or(self.num_attention_heads),
            head_dim: self.head_dim,
            rms_norm_eps: self.rms_norm_eps,
            rope_theta: super::rope_theta(
                self.rope_theta,
                &self.rope_parameters,
                &self.rope_scaling,
            )?,
            tie_word_embeddings: self.tie_word_embeddings,
            qkv_bias: self.attention_bias,
            o_bias: self.attention_bias,
            mlp_bias: false,
            qk_norm: true,
        }
        .validate()
    }
}

//! The Qwen3-shaped configs the trainer and engine benches build random models from.

/// An HF Qwen3 `config.json` for `name`: `tiny-qwen3-vocab` (2 layers, hidden 128, Qwen3's
/// 151,936-token vocabulary), `tiny` (vocab 4096), and the real `qwen3-0.6b`, `qwen3-1.7b`,
/// `qwen3-4b` shapes. Token 0 is the end-of-sequence token.
pub fn shape(name: &str) -> Option<serde_json::Value> {
    let (hidden, inter, layers, heads, kv, head_dim, vocab) = match name {
        "tiny-qwen3-vocab" => (128, 384, 2, 4, 2, 32, 151936),
        "tiny" => (256, 768, 4, 4, 2, 64, 4096),
        "qwen3-0.6b" => (1024, 3072, 28, 16, 8, 128, 151936),
        "qwen3-1.7b" => (2048, 6144, 28, 16, 8, 128, 151936),
        "qwen3-4b" => (2560, 9728, 36, 32, 8, 128, 151936),
        _ => return None,
    };
    Some(serde_json::json!({
        "model_type": "qwen3", "vocab_size": vocab, "hidden_size": hidden,
        "intermediate_size": inter, "num_hidden_layers": layers, "num_attention_heads": heads,
        "num_key_value_heads": kv, "head_dim": head_dim, "rope_theta": 1000000.0,
        "rms_norm_eps": 1e-6, "tie_word_embeddings": true, "eos_token_id": 0
    }))
}

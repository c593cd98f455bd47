//! Sampling policy: the sampling parameters a rollout is sampled with, whatever the harness
//! sends. A harness that asks for `temperature: 0` (aider does) or its own `top_p` would
//! otherwise give greedy, identical rollouts in a group, and logprobs from another
//! distribution than the trainer assumes.
//!
//! A policy comes from `[sampling]` in graft.toml, or per session (`sampling` on `POST
//! /graft/sessions`, `POST /graft/sessions/{id}/sampling`; a session's policy replaces the
//! gateway's). `enforce` overrides what the client sent; `default` fills only what it left
//! out. `max_new_tokens` is a cap in both modes. Exact mode and token-id passthrough apply it;
//! the record's `sampling` keeps the policy, what the client asked for and what was sent.

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value, json};

use crate::dialect::Sampling;

/// Whether the policy overrides the client or only fills its gaps.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum PolicyMode {
    /// The policy's values replace the client's.
    #[default]
    Enforce,
    /// The policy's values are used where the client sent none.
    Default,
}

/// A sampling policy (`[sampling]`, or a session's `sampling`).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SamplingPolicy {
    #[serde(default)]
    pub mode: PolicyMode,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub temperature: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub top_p: Option<f64>,
    /// `0` or absent: no top-k.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub top_k: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub min_p: Option<f64>,
    /// A cap on new tokens: a larger (or absent) request limit becomes this.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_new_tokens: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub seed: Option<i64>,
}

impl SamplingPolicy {
    /// Why the policy cannot be used (the key and what is wrong with it), if it cannot.
    pub fn check(&self) -> Result<(), (&'static str, String)> {
        // The ranges any backend samples with (the same as a client's values are held to).
        let as_sampling = Sampling {
            temperature: self.temperature,
            top_p: self.top_p,
            min_p: self.min_p,
            ..Sampling::default()
        };
        if let Some(bad) = as_sampling.out_of_range(false) {
            return Err(bad);
        }
        if self.max_new_tokens == Some(0) {
            return Err(("max_new_tokens", "must be at least 1, got 0".into()));
        }
        Ok(())
    }

    fn pick<T: Copy>(&self, policy: Option<T>, client: Option<T>) -> Option<T> {
        match (self.mode, policy) {
            (_, None) => client,
            (PolicyMode::Enforce, Some(p)) => Some(p),
            (PolicyMode::Default, Some(p)) => client.or(Some(p)),
        }
    }

    /// The sampling parameters to send for a call that asked for `asked`.
    pub fn apply(&self, asked: &Sampling) -> Sampling {
        let mut s = asked.clone();
        s.temperature = self.pick(self.temperature, asked.temperature);
        s.top_p = self.pick(self.top_p, asked.top_p);
        s.top_k = self.pick(self.top_k, asked.top_k);
        s.min_p = self.pick(self.min_p, asked.min_p);
        s.seed = self.pick(self.seed, asked.seed);
        if let Some(cap) = self.max_new_tokens {
            s.max_tokens = Some(asked.max_tokens.map_or(cap, |m| m.min(cap)));
        }
        s
    }

    /// Applies the policy to an OpenAI Chat Completions or Completions body in place (token-id
    /// passthrough: vLLM and SGLang take `top_k` and `min_p` there too). Returns whether the
    /// body changed.
    pub fn apply_openai_body(&self, body: &mut Value) -> bool {
        let Some(o) = body.as_object_mut() else {
            return false;
        };
        let before = o.clone();
        let f64_of = |o: &Map<String, Value>, k: &str| o.get(k).and_then(Value::as_f64);
        let set = |o: &mut Map<String, Value>, k: &str, v: Option<Value>| {
            if let Some(v) = v {
                o.insert(k.to_string(), v);
            }
        };
        let t = self.pick(self.temperature, f64_of(o, "temperature"));
        set(o, "temperature", t.map(|v| json!(v)));
        let p = self.pick(self.top_p, f64_of(o, "top_p"));
        set(o, "top_p", p.map(|v| json!(v)));
        let k = self.pick(self.top_k, o.get("top_k").and_then(Value::as_u64));
        set(o, "top_k", k.map(|v| json!(v)));
        let m = self.pick(self.min_p, f64_of(o, "min_p"));
        set(o, "min_p", m.map(|v| json!(v)));
        let seed = self.pick(self.seed, o.get("seed").and_then(Value::as_i64));
        set(o, "seed", seed.map(|v| json!(v)));
        if let Some(cap) = self.max_new_tokens {
            let key = if o.contains_key("max_completion_tokens") {
                "max_completion_tokens"
            } else {
                "max_tokens"
            };
            let asked = o.get(key).and_then(Value::as_u64);
            o.insert(key.into(), json!(asked.map_or(cap, |m| m.min(cap))));
        }
        *o != before
    }
}

/// The record's `sampling`: the policy, what the client asked for, what was sent.
pub fn record_value(policy: &SamplingPolicy, asked: Value, sent: Value) -> Value {
    json!({
        "policy": policy,
        "requested": asked,
        "sent": sent,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn asked() -> Sampling {
        Sampling {
            temperature: Some(0.0),
            top_p: Some(0.5),
            max_tokens: Some(4096),
            ..Default::default()
        }
    }

    #[test]
    fn enforce_overrides_the_client_and_caps_new_tokens() {
        let p = SamplingPolicy {
            temperature: Some(1.0),
            top_p: Some(1.0),
            max_new_tokens: Some(1024),
            seed: Some(7),
            ..Default::default()
        };
        let s = p.apply(&asked());
        assert_eq!(s.temperature, Some(1.0));
        assert_eq!(s.top_p, Some(1.0));
        assert_eq!(s.max_tokens, Some(1024));
        assert_eq!(s.seed, Some(7));
        // A smaller client limit stays; an absent one becomes the cap.
        let s = p.apply(&Sampling {
            max_tokens: Some(10),
            ..Default::default()
        });
        assert_eq!(s.max_tokens, Some(10));
        assert_eq!(p.apply(&Sampling::default()).max_tokens, Some(1024));
    }

    #[test]
    fn default_fills_only_what_the_client_left_out() {
        let p = SamplingPolicy {
            mode: PolicyMode::Default,
            temperature: Some(1.0),
            top_k: Some(20),
            ..Default::default()
        };
        let s = p.apply(&asked());
        assert_eq!(s.temperature, Some(0.0));
        assert_eq!(s.top_k, Some(20));
        assert_eq!(s.top_p, Some(0.5));
    }

    #[test]
    fn openai_bodies_are_rewritten_the_same_way() {
        let p = SamplingPolicy {
            temperature: Some(0.8),
            max_new_tokens: Some(100),
            ..Default::default()
        };
        let mut b = json!({"model": "m", "temperature": 0, "max_completion_tokens": 500});
        assert!(p.apply_openai_body(&mut b));
        assert_eq!(b["temperature"], 0.8);
        assert_eq!(b["max_completion_tokens"], 100);
        assert!(b.get("max_tokens").is_none());
        assert!(
            !p.apply_openai_body(&mut b),
            "applying twice changes nothing"
        );
    }

    #[test]
    fn bad_policies_are_named() {
        let bad = |p: SamplingPolicy| p.check().unwrap_err().0;
        assert_eq!(
            bad(SamplingPolicy {
                temperature: Some(-0.5),
                ..Default::default()
            }),
            "temperature"
        );
        assert_eq!(
            bad(SamplingPolicy {
                top_p: Some(0.0),
                ..Default::default()
            }),
            "top_p"
        );
        assert_eq!(
            bad(SamplingPolicy {
                max_new_tokens: Some(0),
                ..Default::default()
            }),
            "max_new_tokens"
        );
        assert!(SamplingPolicy::default().check().is_ok());
        let unknown = serde_json::from_value::<SamplingPolicy>(json!({"temprature": 1}));
        assert!(unknown.unwrap_err().to_string().contains("temprature"));
    }
}

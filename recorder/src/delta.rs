//! Linear-per-trajectory storage: a call's request (and, since schema v2, its normalized
//! and upstream requests, each on its own) is stored as what it adds to the same value of
//! an earlier call of the same session.
//!
//! A delta is a JSON object
//! `{"base": <call_id|null>, "field": "messages", "keep": k, "append": [...], "set": {...}, "unset": [...]}`:
//! the request is the base request, with its conversation field (`messages`, `input` or
//! `prompt`, named by `field`) cut to its first `keep` entries (bytes for a string prompt)
//! followed by `append`; every other top-level field in `set` replaced or added and every
//! field in `unset` removed. Optional extras: `order` (the top-level key order when it
//! differs from what the rules above produce) and `whole` (a request that is not a JSON
//! object, stored as is). Without a base, `set` holds the whole request.
//!
//! Requests compare as JSON values: the kept part of a conversation keeps the key order of
//! the base request.

use serde::{Deserialize, Deserializer, Serialize};
use serde_json::{Map, Value};

/// Top-level fields that hold the growing conversation, in order of preference.
pub const CONVERSATION_FIELDS: [&str; 3] = ["messages", "input", "prompt"];

/// A request stored relative to an earlier request of the same session.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RequestDelta {
    /// `call_id` of the base call, or `None` when `set` (or `whole`) is the full request.
    pub base: Option<String>,
    /// The conversation field `keep` and `append` apply to.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub field: Option<String>,
    /// Entries (array) or bytes (string) of the base conversation kept.
    #[serde(default)]
    pub keep: u64,
    /// Appended entries (array) or text (string); `[]` when there is no `field`.
    #[serde(default = "empty_array")]
    pub append: Value,
    /// Top-level fields that differ from the base or are new.
    #[serde(default)]
    pub set: Map<String, Value>,
    /// Top-level fields of the base that are gone.
    #[serde(default)]
    pub unset: Vec<String>,
    /// Top-level key order, present only when the rules above would give another order.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub order: Option<Vec<String>>,
    /// A request that is not a JSON object (e.g. `null` for GET /v1/models), stored whole.
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        deserialize_with = "present_value"
    )]
    pub whole: Option<Value>,
}

fn empty_array() -> Value {
    Value::Array(Vec::new())
}

/// `"whole": null` means a `null` request, not an absent field.
pub(crate) fn present_value<'de, D: Deserializer<'de>>(d: D) -> Result<Option<Value>, D::Error> {
    Value::deserialize(d).map(Some)
}

impl RequestDelta {
    fn full(request: &Value) -> Self {
        match request {
            Value::Object(map) => Self {
                base: None,
                field: None,
                keep: 0,
                append: empty_array(),
                set: map.clone(),
                unset: Vec::new(),
                order: None,
                whole: None,
            },
            other => Self {
                base: None,
                field: None,
                keep: 0,
                append: empty_array(),
                set: Map::new(),
                unset: Vec::new(),
                order: None,
                whole: Some(other.clone()),
            },
        }
    }

    /// Size of the delta as stored (its JSON text).
    pub fn stored_len(&self) -> usize {
        json_len(self)
    }

    /// What [`RequestDelta::stored_len`] of the full form of `request` would be, without
    /// building it (that copies the whole request).
    pub fn full_stored_len(request: &Value) -> usize {
        let empty = match request {
            Value::Object(_) => Value::Object(Map::new()),
            _ => Value::Null,
        };
        // The full form is `request` inside a fixed frame of other fields.
        Self::full(&empty)
            .stored_len()
            .saturating_sub(json_len(&empty))
            .saturating_add(json_len(request))
    }
}

/// Length of `value`'s compact JSON text, counted without building it.
fn json_len<T: Serialize + ?Sized>(value: &T) -> usize {
    struct Count(usize);
    impl std::io::Write for Count {
        fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
            self.0 += b.len();
            Ok(b.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }
    let mut c = Count(0);
    match serde_json::to_writer(&mut c, value) {
        Ok(()) => c.0,
        Err(_) => usize::MAX,
    }
}

/// Encodes `request` against `base` (`(call_id, full request)` of an earlier call).
pub fn encode(base: Option<(&str, &Value)>, request: &Value) -> RequestDelta {
    let (Some((base_id, Value::Object(prev))), Value::Object(next)) = (base, request) else {
        return RequestDelta::full(request);
    };

    let mut field = None;
    let mut keep = 0u64;
    let mut append = empty_array();
    for name in CONVERSATION_FIELDS {
        match (prev.get(name), next.get(name)) {
            (Some(Value::Array(a)), Some(Value::Array(b))) => {
                let k = a.iter().zip(b).take_while(|(x, y)| x == y).count();
                field = Some(name);
                keep = k as u64;
                append = Value::Array(b[k..].to_vec());
                break;
            }
            (Some(Value::String(a)), Some(Value::String(b))) => {
                let k = common_prefix_on_char_boundary(a, b);
                field = Some(name);
                keep = k as u64;
                append = Value::String(b[k..].to_owned());
                break;
            }
            _ => {}
        }
    }

    let mut set = Map::new();
    for (key, value) in next {
        if Some(key.as_str()) != field && prev.get(key) != Some(value) {
            set.insert(key.clone(), value.clone());
        }
    }
    let unset: Vec<String> = prev
        .keys()
        .filter(|k| Some(k.as_str()) != field && !next.contains_key(k.as_str()))
        .cloned()
        .collect();

    // Key order the decoder produces: base keys minus removed ones, then new keys.
    let mut order: Vec<&str> = prev
        .keys()
        .map(String::as_str)
        .filter(|k| !unset.iter().any(|u| u == k))
        .collect();
    order.extend(
        set.keys()
            .map(String::as_str)
            .filter(|k| !prev.contains_key(*k)),
    );
    let order = if order.iter().copied().eq(next.keys().map(String::as_str)) {
        None
    } else {
        Some(next.keys().cloned().collect())
    };

    RequestDelta {
        base: Some(base_id.to_owned()),
        field: field.map(str::to_owned),
        keep,
        append,
        set,
        unset,
        order,
        whole: None,
    }
}

fn common_prefix_on_char_boundary(a: &str, b: &str) -> usize {
    let mut k = a.bytes().zip(b.bytes()).take_while(|(x, y)| x == y).count();
    while !b.is_char_boundary(k) {
        k -= 1;
    }
    k
}

/// Applies `delta` to `base` (the base call's full request; `None` when `delta.base` is
/// `None`). The error is a reason for [`crate::RecorderError::BadDelta`].
pub fn decode(base: Option<&Value>, delta: &RequestDelta) -> Result<Value, String> {
    if let Some(whole) = &delta.whole {
        return Ok(whole.clone());
    }
    let mut out = match (&delta.base, base) {
        (None, _) => Map::new(),
        (Some(_), Some(Value::Object(prev))) => prev.clone(),
        (Some(_), Some(other)) => {
            return Err(format!(
                "the base request is not a JSON object but {}",
                kind(other)
            ));
        }
        (Some(_), None) => return Err("the base request is missing".to_owned()),
    };
    for key in &delta.unset {
        out.shift_remove(key);
    }
    if let Some(name) = &delta.field {
        let keep =
            usize::try_from(delta.keep).map_err(|_| format!("keep {} is too large", delta.keep))?;
        let merged = match (out.get(name), &delta.append) {
            (Some(Value::Array(prev)), Value::Array(extra)) => {
                let head = prev.get(..keep).ok_or_else(|| {
                    format!(
                        "keep {keep} exceeds the {} entries of '{name}' in the base",
                        prev.len()
                    )
                })?;
                let mut items = Vec::with_capacity(keep + extra.len());
                items.extend_from_slice(head);
                items.extend(extra.iter().cloned());
                Value::Array(items)
            }
            (Some(Value::String(prev)), Value::String(extra)) => {
                let head = prev.get(..keep).ok_or_else(|| {
                    format!(
                        "keep {keep} is not a char boundary within the {} bytes of '{name}'",
                        prev.len()
                    )
                })?;
                Value::String(format!("{head}{extra}"))
            }
            (prev, extra) => {
                return Err(format!(
                    "field '{name}' is {} in the base but the delta appends {}",
                    prev.map_or("absent", kind),
                    kind(extra)
                ));
            }
        };
        out.insert(name.clone(), merged);
    }
    for (key, value) in &delta.set {
        out.insert(key.clone(), value.clone());
    }
    if let Some(order) = &delta.order {
        if order.len() != out.len() {
            return Err(format!(
                "'order' names {} keys but the request has {}",
                order.len(),
                out.len()
            ));
        }
        let mut ordered = Map::new();
        for key in order {
            let value = out
                .get(key)
                .ok_or_else(|| format!("'order' names key '{key}' that the request lacks"))?;
            ordered.insert(key.clone(), value.clone());
        }
        out = ordered;
    }
    Ok(Value::Object(out))
}

/// A call's `prompt_token_ids` stored against an earlier call of the session: the base
/// call's token sequence (its `prompt_token_ids` followed by its `completion_token_ids`)
/// cut to its first `keep` ids, followed by `append`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TokenIdsDelta {
    /// `call_id` of the base call.
    pub base: String,
    /// Ids of the base call's sequence kept.
    pub keep: u64,
    /// Ids that follow them.
    #[serde(default)]
    pub append: Vec<u32>,
}

/// The token sequence a later call's prompt may extend: `prompt ++ completion`, `None`
/// when the call has no prompt ids.
pub fn token_sequence(prompt: Option<&[u32]>, completion: Option<&[u32]>) -> Option<Vec<u32>> {
    let prompt = prompt?;
    let mut out = Vec::with_capacity(prompt.len() + completion.map_or(0, <[u32]>::len));
    out.extend_from_slice(prompt);
    out.extend_from_slice(completion.unwrap_or_default());
    Some(out)
}

/// Encodes `ids` against whichever of `bases` (call_id, that call's token sequence) shares
/// the longest common prefix with it; `None` (store whole) when none shares any.
pub fn encode_ids<'a>(
    ids: &[u32],
    bases: impl Iterator<Item = (&'a str, Option<&'a [u32]>)>,
) -> Option<TokenIdsDelta> {
    let mut best: Option<(&str, usize)> = None;
    for (call_id, seq) in bases {
        let Some(seq) = seq else { continue };
        let k = seq.iter().zip(ids).take_while(|(a, b)| a == b).count();
        if k > 0 && best.is_none_or(|(_, bk)| k > bk) {
            best = Some((call_id, k));
        }
    }
    let (base, keep) = best?;
    Some(TokenIdsDelta {
        base: base.to_owned(),
        keep: keep as u64,
        append: ids.get(keep..).unwrap_or_default().to_vec(),
    })
}

/// Applies `delta` to `base` (the base call's token sequence). The error is a reason for
/// [`crate::RecorderError::BadDelta`].
pub fn decode_ids(base: &[u32], delta: &TokenIdsDelta) -> Result<Vec<u32>, String> {
    let keep =
        usize::try_from(delta.keep).map_err(|_| format!("keep {} is too large", delta.keep))?;
    let head = base.get(..keep).ok_or_else(|| {
        format!(
            "keep {keep} exceeds the {} token ids of the base",
            base.len()
        )
    })?;
    let mut out = Vec::with_capacity(keep + delta.append.len());
    out.extend_from_slice(head);
    out.extend_from_slice(&delta.append);
    Ok(out)
}

fn kind(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use serde_json::json;

    fn roundtrip(base: Option<&Value>, req: &Value) -> RequestDelta {
        let delta = encode(base.map(|b| ("base-id", b)), req);
        // Through JSON text, as on disk.
        let text = serde_json::to_string(&delta).unwrap();
        let back: RequestDelta = serde_json::from_str(&text).unwrap();
        assert_eq!(back, delta);
        let decoded = decode(base, &back).unwrap();
        assert_eq!(&decoded, req);
        let dk: Vec<_> = decoded
            .as_object()
            .map(|m| m.keys().cloned().collect())
            .unwrap_or_default();
        let rk: Vec<_> = req
            .as_object()
            .map(|m| m.keys().cloned().collect())
            .unwrap_or_default();
        assert_eq!(dk, rk, "top-level key order");
        delta
    }

    #[test]
    fn chat_turn_stores_only_the_new_messages_and_changed_fields() {
        let tools = json!([{"type": "function", "function": {"name": "ls"}}]);
        let a =
            json!({"model": "m", "messages": [{"role": "user", "content": "hi"}], "tools": tools});
        let b = json!({"model": "m", "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}], "tools": tools, "temperature": 0.5});
        let d = roundtrip(Some(&a), &b);
        assert_eq!(d.keep, 1);
        assert_eq!(d.append, json!([{"role": "assistant", "content": "yo"}]));
        assert_eq!(
            d.set,
            json!({"temperature": 0.5}).as_object().unwrap().clone()
        );
        assert!(d.unset.is_empty());
    }

    #[test]
    fn prompt_string_keeps_a_char_boundary() {
        let a = json!({"prompt": "héllo wörld"});
        let b = json!({"prompt": "héllo wöw"});
        let d = roundtrip(Some(&a), &b);
        assert_eq!(d.field.as_deref(), Some("prompt"));
        assert!("héllo wöw".is_char_boundary(d.keep as usize));
    }

    #[test]
    fn null_and_non_object_requests_are_stored_whole() {
        let d = roundtrip(None, &Value::Null);
        assert_eq!(d.whole, Some(Value::Null));
        roundtrip(Some(&json!({"a": 1})), &json!([1, 2]));
        roundtrip(Some(&Value::Null), &json!({"a": 1}));
    }

    #[test]
    fn removed_fields_and_reordered_keys_round_trip() {
        let a = json!({"a": 1, "b": 2, "messages": [], "c": 3});
        let b = json!({"c": 3, "messages": [1], "a": 1, "d": 4});
        let d = roundtrip(Some(&a), &b);
        assert_eq!(d.unset, vec!["b".to_owned()]);
        assert!(d.order.is_some());
    }

    #[test]
    fn delta_against_a_wrong_base_is_an_error_not_a_panic() {
        let a = json!({"messages": [1, 2, 3]});
        let b = json!({"messages": [1, 2, 3, 4]});
        let d = encode(Some(("x", &a)), &b);
        assert!(decode(Some(&json!({"messages": [1]})), &d).is_err());
        assert!(decode(Some(&json!({"messages": "s"})), &d).is_err());
        assert!(decode(None, &d).is_err());
    }

    fn leaf() -> impl Strategy<Value = Value> {
        prop_oneof![
            Just(Value::Null),
            any::<bool>().prop_map(Value::Bool),
            any::<i32>().prop_map(|n| json!(n)),
            "[a-zé€ ]{0,6}".prop_map(Value::String),
        ]
    }

    fn message() -> impl Strategy<Value = Value> {
        (
            prop_oneof![Just("user"), Just("assistant"), Just("tool")],
            "[a-zé ]{0,8}",
            leaf(),
        )
            .prop_map(
                |(role, content, extra)| json!({"role": role, "content": content, "x": extra}),
            )
    }

    /// A session: each step keeps a random prefix of the previous conversation, appends
    /// new messages, and randomly changes, adds or removes other fields.
    fn session() -> impl Strategy<Value = Vec<Value>> {
        let step = (
            any::<prop::sample::Index>(),
            prop::collection::vec(message(), 0..4),
            prop::collection::btree_map("[a-f]", leaf(), 0..4),
            prop::collection::vec("[a-f]", 0..3),
            any::<bool>(),
            0u8..4,
        );
        (
            prop::collection::vec(message(), 0..4),
            prop::collection::vec(step, 1..8),
        )
            .prop_map(|(first, steps)| {
                let mut out = Vec::new();
                let mut cur = json!({"model": "m", "messages": first, "tools": [{"name": "t"}]});
                out.push(cur.clone());
                for (cut, add, set, unset, shuffle, conv) in steps {
                    let map = cur.as_object_mut().unwrap();
                    let conv_name = CONVERSATION_FIELDS[usize::from(conv % 3)];
                    if conv == 3 {
                        // A string prompt that grows and is sometimes edited.
                        let p = map
                            .get("prompt")
                            .and_then(Value::as_str)
                            .unwrap_or("")
                            .to_owned();
                        let mut cut_at = cut.index(p.len() + 1);
                        while !p.is_char_boundary(cut_at) {
                            cut_at -= 1;
                        }
                        let tail: String = add
                            .iter()
                            .map(|m| m["content"].as_str().unwrap_or(""))
                            .collect();
                        map.insert(
                            "prompt".into(),
                            Value::String(format!("{}{tail}", &p[..cut_at])),
                        );
                    } else {
                        let mut msgs = map
                            .get(conv_name)
                            .and_then(Value::as_array)
                            .cloned()
                            .unwrap_or_default();
                        msgs.truncate(cut.index(msgs.len() + 1));
                        msgs.extend(add);
                        map.insert(conv_name.into(), Value::Array(msgs));
                    }
                    for (k, v) in set {
                        map.insert(k, v);
                    }
                    for k in unset {
                        map.shift_remove(&k);
                    }
                    if shuffle {
                        let mut entries: Vec<_> = std::mem::take(map).into_iter().collect();
                        entries.reverse();
                        map.extend(entries);
                    }
                    out.push(cur.clone());
                }
                out
            })
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(256))]
        #[test]
        fn encode_then_decode_returns_the_exact_request(reqs in session()) {
            let mut prev: Option<Value> = None;
            for req in &reqs {
                let delta = encode(prev.as_ref().map(|p| ("b", p)), req);
                let text = serde_json::to_string(&delta).unwrap();
                let back: RequestDelta = serde_json::from_str(&text).unwrap();
                let decoded = decode(prev.as_ref(), &back).unwrap();
                prop_assert_eq!(&decoded, req);
                let dk: Vec<_> = decoded.as_object().unwrap().keys().cloned().collect();
                let rk: Vec<_> = req.as_object().unwrap().keys().cloned().collect();
                prop_assert_eq!(dk, rk);
                prev = Some(decoded);
            }
        }
    }
}

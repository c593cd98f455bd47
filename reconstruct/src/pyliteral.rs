//! Python literals as JSON values: what `ast.literal_eval` reads for the shapes a model writes
//! when it writes a tool call as a Python dict (`{'name': 'f', 'parameters': {'x': True}}`).
//! SGLang's Llama 3 detector falls back to `literal_eval` where JSON does not parse
//! (`Llama32Detector._convert_python_dict_to_json`).
//!
//! Read: dicts with string keys, lists and tuples (as lists), strings in `'` or `"` (with the
//! escapes `\\ \' \" \n \r \t \0 \xhh \uhhhh \Uhhhhhhhh`, an unknown escape kept with its
//! backslash as CPython keeps it), integers and floats with an optional sign, `True`,
//! `False`, `None`. Anything else (names, calls, sets, triple-quoted, prefixed or adjacent
//! strings, complex numbers, non-string keys) is not read, so the text stays what it was.

use serde_json::{Map, Number, Value};

/// `text` (surrounding whitespace allowed) as a JSON value, or `None`.
pub(crate) fn literal_eval(text: &str) -> Option<Value> {
    let mut r = Reader {
        s: text.as_bytes(),
        at: 0,
        text,
    };
    let v = r.value(0)?;
    r.space();
    (r.at == r.s.len()).then_some(v)
}

struct Reader<'a> {
    s: &'a [u8],
    at: usize,
    text: &'a str,
}

impl Reader<'_> {
    fn space(&mut self) {
        while self.at < self.s.len() && self.s[self.at].is_ascii_whitespace() {
            self.at += 1;
        }
    }

    fn eat(&mut self, c: u8) -> bool {
        self.space();
        if self.s.get(self.at) == Some(&c) {
            self.at += 1;
            true
        } else {
            false
        }
    }

    fn value(&mut self, depth: usize) -> Option<Value> {
        if depth > 128 {
            return None;
        }
        self.space();
        match *self.s.get(self.at)? {
            b'{' => {
                self.at += 1;
                let mut map = Map::new();
                loop {
                    if self.eat(b'}') {
                        return Some(Value::Object(map));
                    }
                    let Value::String(key) = self.value(depth + 1)? else {
                        return None;
                    };
                    if !self.eat(b':') {
                        return None;
                    }
                    let v = self.value(depth + 1)?;
                    map.insert(key, v);
                    if !self.eat(b',') {
                        return self.eat(b'}').then_some(Value::Object(map));
                    }
                }
            }
            open @ (b'[' | b'(') => {
                let close = if open == b'[' { b']' } else { b')' };
                self.at += 1;
                let mut items = Vec::new();
                loop {
                    if self.eat(close) {
                        return Some(Value::Array(items));
                    }
                    items.push(self.value(depth + 1)?);
                    if !self.eat(b',') {
                        return self.eat(close).then_some(Value::Array(items));
                    }
                }
            }
            q @ (b'\'' | b'"') => self.string(q).map(Value::String),
            _ => self.scalar(),
        }
    }

    fn string(&mut self, quote: u8) -> Option<String> {
        if self.s.get(self.at..self.at + 3) == Some(&[quote; 3][..]) {
            return None;
        }
        self.at += 1;
        let mut out = String::new();
        loop {
            let rest = self.text.get(self.at..)?;
            let c = rest.chars().next()?;
            self.at += c.len_utf8();
            match c {
                '\n' => return None,
                c if c as u32 == u32::from(quote) => return Some(out),
                '\\' => {
                    let e = self.text.get(self.at..)?.chars().next()?;
                    self.at += e.len_utf8();
                    match e {
                        '\\' | '\'' | '"' => out.push(e),
                        'n' => out.push('\n'),
                        'r' => out.push('\r'),
                        't' => out.push('\t'),
                        '0' => out.push('\0'),
                        '\n' => {}
                        'x' => out.push(self.hex(2)?),
                        'u' => out.push(self.hex(4)?),
                        'U' => out.push(self.hex(8)?),
                        other => {
                            out.push('\\');
                            out.push(other);
                        }
                    }
                }
                c => out.push(c),
            }
        }
    }

    fn hex(&mut self, n: usize) -> Option<char> {
        let digits = self.text.get(self.at..self.at + n)?;
        self.at += n;
        char::from_u32(u32::from_str_radix(digits, 16).ok()?)
    }

    fn scalar(&mut self) -> Option<Value> {
        let start = self.at;
        while self.at < self.s.len()
            && (self.s[self.at].is_ascii_alphanumeric() || b"+-._".contains(&self.s[self.at]))
        {
            self.at += 1;
        }
        let word = &self.text[start..self.at];
        match word {
            "True" => return Some(Value::Bool(true)),
            "False" => return Some(Value::Bool(false)),
            "None" => return Some(Value::Null),
            _ => {}
        }
        let plain = word.replace('_', "");
        let digits = plain.trim_start_matches(['+', '-']);
        if digits.is_empty() || !digits.starts_with(|c: char| c.is_ascii_digit() || c == '.') {
            return None;
        }
        let sign = if plain.starts_with('-') { "-" } else { "" };
        if plain.len() - digits.len() > 1 {
            return None;
        }
        if digits.bytes().all(|b| b.is_ascii_digit()) {
            if digits.len() > 1 && digits.starts_with('0') && digits.bytes().any(|b| b != b'0') {
                return None;
            }
            let n: Number = format!("{sign}{digits}").parse().ok()?;
            return Some(Value::Number(n));
        }
        let f: f64 = format!("{sign}{digits}").parse().ok()?;
        Number::from_f64(f).map(Value::Number)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn reads_what_models_write_as_python_dicts() {
        assert_eq!(
            literal_eval(
                "{'name': 'f', 'parameters': {'q': \"it's\", 'n': -2, 'x': 1.5, 'b': True, 'z': None, 'l': [1, (2, 3)], 'e': {}}}"
            ),
            Some(
                json!({"name": "f", "parameters": {"q": "it's", "n": -2, "x": 1.5, "b": true, "z": null, "l": [1, [2, 3]], "e": {}}})
            )
        );
        assert_eq!(
            literal_eval(" {'a': 'x\\ny\\'\\u00e9\\d',} "),
            Some(json!({"a": "x\ny'é\\d"}))
        );
        assert_eq!(literal_eval("{\"a\": 1_000}"), Some(json!({"a": 1000})));
    }

    #[test]
    fn refuses_what_literal_eval_refuses() {
        for bad in [
            "{'a': open('x')}",
            "{'a': true}",
            "{'a': 1",
            "{1: 'a'}",
            "{'a': '''x'''}",
            "{'a': 007}",
            "{'a': 1} trailing",
            "{'a': x}",
            "",
        ] {
            assert_eq!(literal_eval(bad), None, "{bad}");
        }
    }
}

//! A model's chat template and tokenizer, loaded from its directory (the files HF ships:
//! `tokenizer.json`, `tokenizer_config.json`, `chat_template.jinja`).
//!
//! [`ChatTemplate::render`] reproduces `transformers` (5.x) `apply_chat_template(...,
//! tokenize=False)` byte for byte. What that takes beyond plain minijinja:
//! - the Jinja environment HF builds: `trim_blocks` + `lstrip_blocks`, no autoescape, a
//!   trailing newline of the template source dropped, `raise_exception`, `strftime_now`, and
//!   HF's own `tojson` (`json.dumps(x, ensure_ascii=False)`: Python's `", "`/`": "`
//!   separators, no HTML escaping, Python's float repr; `indent`, `separators`,
//!   `sort_keys`, `ensure_ascii` keyword arguments);
//! - Python string/dict methods (`.startswith`, `.split`, `.strip('\n')`, `.items()`, ...)
//!   through `minijinja_contrib::pycompat`, with Python's no-argument `strip` whitespace set;
//! - values printed as Python prints them (`True`, `None`, `{'a': 1}`), not as minijinja does;
//! - HF's preprocessing of the messages: keys whose value is `null` are dropped from each
//!   message, and a message's reasoning (`reasoning_content`, else `thinking`, else
//!   `reasoning`) is aliased to both `reasoning_content` and `thinking`;
//! - the context HF passes: `messages`, `tools` (`none` when not given, so `tools is defined`
//!   holds), `documents` (`none`), `add_generation_prompt`, the special tokens that are set
//!   (`bos_token`, `eos_token`, ...), then the caller's extra variables, which win.
//!
//! [`Tokenizer`] wraps the `tokenizers` crate on `tokenizer.json`; it encodes a rendered
//! template as HF does (`add_special_tokens=False`: special tokens in the text are matched as
//! added tokens, none are added around it).

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use minijinja::syntax::SyntaxConfig;
use minijinja::value::{Kwargs, Serde, ValueKind};
use minijinja::{AutoEscape, Environment, Error as JinjaError, ErrorKind, State, Value as JValue};
use serde_json::{Map, Value};
use sha2::{Digest, Sha256};

/// What can go wrong loading or rendering a template, or loading or using a tokenizer.
/// Messages name the file and, for template errors, the template line.
#[derive(Debug, thiserror::Error)]
pub enum TemplateError {
    #[error("cannot read {}: {source}", path.display())]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{} is not valid JSON: {source}", path.display())]
    Json {
        path: PathBuf,
        #[source]
        source: serde_json::Error,
    },
    #[error("no chat template in {}: {detail}", dir.display())]
    NoTemplate { dir: PathBuf, detail: String },
    /// The template does not compile.
    #[error("chat template {name}, line {line}: {message}")]
    Syntax {
        name: String,
        line: usize,
        message: String,
    },
    /// Rendering failed: `raise_exception` in the template, or an operation on the wrong
    /// types (as Jinja in Python would fail too).
    #[error("rendering chat template {name}, line {line}: {message}")]
    Render {
        name: String,
        line: usize,
        message: String,
    },
    #[error("tokenizer {}: {message}", path.display())]
    Tokenizer { path: PathBuf, message: String },
}

/// The name under which HF picks a template when tools are given, if the model has one.
const TOOL_USE: &str = "tool_use";
const DEFAULT: &str = "default";

/// A model's chat template, compiled, with the special tokens HF passes to it.
pub struct ChatTemplate {
    env: Environment<'static>,
    /// template name → the name it was registered under in `env` (names the source file).
    names: BTreeMap<String, String>,
    sources: BTreeMap<String, String>,
    special_tokens: Map<String, Value>,
    fingerprint: String,
}

impl std::fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChatTemplate")
            .field("templates", &self.names)
            .field("special_tokens", &self.special_tokens)
            .field("fingerprint", &self.fingerprint)
            .finish()
    }
}

impl ChatTemplate {
    /// From a model dir: `chat_template.jinja` (plus `additional_chat_templates/*.jinja`) if
    /// present, else `tokenizer_config.json`'s `chat_template` (a string, or the list form of
    /// `{name, template}` where `default` is used, and `tool_use` when tools are given);
    /// special tokens (bos/eos/unk/pad/...) from `tokenizer_config.json`.
    pub fn from_dir(dir: &Path) -> Result<Self, TemplateError> {
        let config_path = dir.join("tokenizer_config.json");
        let config: Option<Value> = if config_path.exists() {
            Some(read_json(&config_path)?)
        } else {
            None
        };
        let special_tokens = config.as_ref().map(special_tokens_of).unwrap_or_default();

        // (template name, display name naming the file, source)
        let mut templates: Vec<(String, String, String)> = Vec::new();
        let jinja = dir.join("chat_template.jinja");
        if jinja.exists() {
            templates.push((DEFAULT.into(), "chat_template.jinja".into(), read(&jinja)?));
            let extra_dir = dir.join("additional_chat_templates");
            if extra_dir.is_dir() {
                let entries =
                    std::fs::read_dir(&extra_dir).map_err(|source| TemplateError::Io {
                        path: extra_dir.clone(),
                        source,
                    })?;
                let mut paths: Vec<PathBuf> = entries
                    .filter_map(|e| e.ok().map(|e| e.path()))
                    .filter(|p| p.extension().is_some_and(|x| x == "jinja"))
                    .collect();
                paths.sort();
                for path in paths {
                    let Some(stem) = path.file_stem().and_then(|s| s.to_str()) else {
                        continue;
                    };
                    let display = format!("additional_chat_templates/{stem}.jinja");
                    templates.push((stem.to_string(), display, read(&path)?));
                }
            }
        } else {
            let field = config.as_ref().and_then(|c| c.get("chat_template"));
            match field {
                Some(Value::String(s)) => templates.push((
                    DEFAULT.into(),
                    "tokenizer_config.json:chat_template".into(),
                    s.clone(),
                )),
                Some(Value::Array(list)) => {
                    for item in list {
                        let (Some(name), Some(src)) = (
                            item.get("name").and_then(Value::as_str),
                            item.get("template").and_then(Value::as_str),
                        ) else {
                            return Err(TemplateError::NoTemplate {
                                dir: dir.to_path_buf(),
                                detail: "tokenizer_config.json's chat_template list has an entry \
                                         without a string `name` and `template`"
                                    .into(),
                            });
                        };
                        templates.push((
                            name.to_string(),
                            format!("tokenizer_config.json:chat_template[{name}]"),
                            src.to_string(),
                        ));
                    }
                }
                Some(other) => {
                    return Err(TemplateError::NoTemplate {
                        dir: dir.to_path_buf(),
                        detail: format!(
                            "tokenizer_config.json's chat_template is neither a string nor a list \
                             (it is {})",
                            json_type(other)
                        ),
                    });
                }
                None => {}
            }
        }
        if templates.is_empty() {
            return Err(TemplateError::NoTemplate {
                dir: dir.to_path_buf(),
                detail:
                    "neither chat_template.jinja nor a `chat_template` in tokenizer_config.json"
                        .into(),
            });
        }
        if templates.len() > 1 && !templates.iter().any(|(n, _, _)| n == DEFAULT) {
            let names: Vec<&str> = templates.iter().map(|(n, _, _)| n.as_str()).collect();
            return Err(TemplateError::NoTemplate {
                dir: dir.to_path_buf(),
                detail: format!(
                    "several chat templates ({}) and none named `default`",
                    names.join(", ")
                ),
            });
        }
        if templates.len() == 1 {
            // A single template is the default whatever it is called.
            templates[0].0 = DEFAULT.into();
        }
        Self::build(templates, special_tokens)
    }

    /// From a template's source; `bos`/`eos` are passed to it as `bos_token`/`eos_token`.
    #[allow(clippy::should_implement_trait)] // the brief's name; FromStr cannot take bos/eos
    pub fn from_str(
        source: &str,
        bos: Option<String>,
        eos: Option<String>,
    ) -> Result<Self, TemplateError> {
        let mut special_tokens = Map::new();
        if let Some(b) = bos {
            special_tokens.insert("bos_token".into(), Value::String(b));
        }
        if let Some(e) = eos {
            special_tokens.insert("eos_token".into(), Value::String(e));
        }
        Self::build(
            vec![(DEFAULT.into(), "<inline>".into(), source.to_string())],
            special_tokens,
        )
    }

    fn build(
        templates: Vec<(String, String, String)>,
        special_tokens: Map<String, Value>,
    ) -> Result<Self, TemplateError> {
        let mut env = Environment::new();
        let syntax = SyntaxConfig::builder()
            .trim_blocks(true)
            .lstrip_blocks(true)
            .keep_trailing_newline(false)
            .build()
            .map_err(|e| TemplateError::Syntax {
                name: "<environment>".into(),
                line: 0,
                message: describe(&e),
            })?;
        env.set_syntax(syntax);
        env.set_auto_escape_callback(|_| AutoEscape::None);
        env.set_formatter(python_formatter);
        env.set_unknown_method_callback(python_methods);
        env.add_filter("tojson", tojson_filter);
        env.add_function("raise_exception", raise_exception);
        env.add_function("strftime_now", strftime_now);

        let fingerprint = if templates.len() == 1 {
            sha256_hex(templates[0].2.as_bytes())
        } else {
            let mut h = Sha256::new();
            for (name, _, src) in &templates {
                h.update(name.as_bytes());
                h.update([0u8]);
                h.update(src.as_bytes());
                h.update([0u8]);
            }
            hex(&h.finalize())
        };

        let mut names = BTreeMap::new();
        let mut sources = BTreeMap::new();
        for (name, display, source) in templates {
            env.add_template_owned(display.clone(), source.clone())
                .map_err(|e| TemplateError::Syntax {
                    name: display.clone(),
                    line: e.line().unwrap_or(0),
                    message: describe(&e),
                })?;
            names.insert(name.clone(), display);
            sources.insert(name, source);
        }
        Ok(ChatTemplate {
            env,
            names,
            sources,
            special_tokens,
            fingerprint,
        })
    }

    /// Renders `messages` (and `tools`) in OpenAI Chat form as HF `apply_chat_template(messages,
    /// tools=tools, add_generation_prompt=..., tokenize=False, **extra)` does. `extra` holds
    /// further template variables, e.g. `enable_thinking`; they override the special tokens.
    pub fn render(
        &self,
        messages: &[Value],
        tools: Option<&[Value]>,
        add_generation_prompt: bool,
        extra: &Map<String, Value>,
    ) -> Result<String, TemplateError> {
        let which = if tools.is_some() && self.names.contains_key(TOOL_USE) {
            TOOL_USE
        } else {
            DEFAULT
        };
        let name = self
            .names
            .get(which)
            .map(String::as_str)
            .unwrap_or("<inline>");
        let render_err = |message: String| TemplateError::Render {
            name: name.to_string(),
            line: 0,
            message,
        };
        if messages.is_empty() {
            return Err(render_err(
                "cannot apply a chat template to an empty conversation".into(),
            ));
        }
        let template = self
            .env
            .get_template(name)
            .map_err(|e| render_err(describe(&e)))?;

        let messages: Vec<Value> = messages.iter().map(hf_message).collect();
        let mut ctx: Map<String, Value> = self.special_tokens.clone();
        ctx.insert("messages".into(), Value::Array(messages));
        ctx.insert(
            "tools".into(),
            tools.map_or(Value::Null, |t| Value::Array(t.to_vec())),
        );
        ctx.insert("documents".into(), Value::Null);
        ctx.insert(
            "add_generation_prompt".into(),
            Value::Bool(add_generation_prompt),
        );
        for (k, v) in extra {
            ctx.insert(k.clone(), v.clone());
        }
        template
            .render(JValue::from(Serde(&ctx)))
            .map_err(|e| TemplateError::Render {
                name: name.to_string(),
                line: e.line().unwrap_or(0),
                message: describe(&e),
            })
    }

    /// sha256 (hex) of the template source (of all named sources, when the model has several).
    pub fn fingerprint(&self) -> String {
        self.fingerprint.clone()
    }

    /// The default template's source.
    pub fn source(&self) -> &str {
        self.sources.get(DEFAULT).map(String::as_str).unwrap_or("")
    }

    /// The template has a thinking toggle (`enable_thinking`, Qwen3's hybrid templates):
    /// thinking is on unless a request turns it off. SGLang's chat server infers the same from
    /// the template (`template_detection.py`, `enable_thinking_default_true`) to decide
    /// whether a request's output starts in reasoning.
    pub fn has_thinking_toggle(&self) -> bool {
        self.source().contains("enable_thinking")
    }

    /// `bos_token`, as the template sees it.
    pub fn bos_token(&self) -> Option<&str> {
        self.special_tokens.get("bos_token").and_then(Value::as_str)
    }

    /// `eos_token`, as the template sees it.
    pub fn eos_token(&self) -> Option<&str> {
        self.special_tokens.get("eos_token").and_then(Value::as_str)
    }
}

/// A model's tokenizer (`tokenizer.json`).
pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    path: PathBuf,
    fingerprint: String,
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tokenizer")
            .field("path", &self.path)
            .field("fingerprint", &self.fingerprint)
            .finish()
    }
}

impl Tokenizer {
    /// Loads `<dir>/tokenizer.json`.
    pub fn from_dir(dir: &Path) -> Result<Self, TemplateError> {
        let path = dir.join("tokenizer.json");
        let bytes = std::fs::read(&path).map_err(|source| TemplateError::Io {
            path: path.clone(),
            source,
        })?;
        let inner =
            tokenizers::Tokenizer::from_bytes(&bytes).map_err(|e| TemplateError::Tokenizer {
                path: path.clone(),
                message: e.to_string(),
            })?;
        Ok(Tokenizer {
            inner,
            fingerprint: sha256_hex(&bytes),
            path,
        })
    }

    /// Token ids of `text` as HF tokenizes a rendered template (`add_special_tokens=False`).
    pub fn encode(&self, text: &str) -> Result<Vec<u32>, TemplateError> {
        self.inner
            .encode_fast(text, false)
            .map(|e| e.get_ids().to_vec())
            .map_err(|e| self.err(e))
    }

    /// The text of `ids`, special tokens included (`skip_special_tokens=False`).
    pub fn decode(&self, ids: &[u32]) -> Result<String, TemplateError> {
        self.inner.decode(ids, false).map_err(|e| self.err(e))
    }

    /// The text of `ids` as a client sees it: special tokens (`<|im_end|>`) skipped, added
    /// tokens that are not special (Qwen3's `<think>`, `<tool_call>`) kept.
    pub fn decode_visible(&self, ids: &[u32]) -> Result<String, TemplateError> {
        self.inner.decode(ids, true).map_err(|e| self.err(e))
    }

    /// [`Tokenizer::decode_visible`], except that the special tokens `keep` are written out:
    /// the servers decode with `skip_special_tokens=False` where a tool parser needs a special
    /// token (Llama 3's `<|python_tag|>`), and the end-of-turn token is not in their text.
    pub fn decode_visible_keeping(
        &self,
        ids: &[u32],
        keep: &[u32],
    ) -> Result<String, TemplateError> {
        if !ids.iter().any(|i| keep.contains(i)) {
            return self.decode_visible(ids);
        }
        let mut out = String::new();
        let mut from = 0;
        for (at, id) in ids.iter().enumerate() {
            if keep.contains(id) {
                out.push_str(&self.decode_visible(&ids[from..at])?);
                out.push_str(&self.inner.id_to_token(*id).unwrap_or_default());
                from = at + 1;
            }
        }
        out.push_str(&self.decode_visible(&ids[from..])?);
        Ok(out)
    }

    /// The id of a token (e.g. `<|im_end|>`), if the vocabulary or added tokens have it.
    pub fn token_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    /// The token of an id.
    pub fn id_token(&self, id: u32) -> Option<String> {
        self.inner.id_to_token(id)
    }

    /// sha256 (hex) of `tokenizer.json`.
    pub fn fingerprint(&self) -> String {
        self.fingerprint.clone()
    }

    fn err(&self, e: tokenizers::Error) -> TemplateError {
        TemplateError::Tokenizer {
            path: self.path.clone(),
            message: e.to_string(),
        }
    }
}

// -------------------------------------------------------------------------------------
// Loading

fn read(path: &Path) -> Result<String, TemplateError> {
    std::fs::read_to_string(path).map_err(|source| TemplateError::Io {
        path: path.to_path_buf(),
        source,
    })
}

fn read_json(path: &Path) -> Result<Value, TemplateError> {
    serde_json::from_str(&read(path)?).map_err(|source| TemplateError::Json {
        path: path.to_path_buf(),
        source,
    })
}

/// HF's `special_tokens_map`: the named special tokens that are set, as strings (a token may
/// be written as `{"content": ..., "__type": "AddedToken"}`).
fn special_tokens_of(config: &Value) -> Map<String, Value> {
    const NAMES: [&str; 7] = [
        "bos_token",
        "eos_token",
        "unk_token",
        "sep_token",
        "pad_token",
        "cls_token",
        "mask_token",
    ];
    let mut out = Map::new();
    for name in NAMES {
        let token = match config.get(name) {
            Some(Value::String(s)) => Some(s.clone()),
            Some(Value::Object(o)) => o.get("content").and_then(Value::as_str).map(String::from),
            _ => None,
        };
        if let Some(t) = token {
            out.insert(name.into(), Value::String(t));
        }
    }
    out
}

fn json_type(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "a list",
        Value::Object(_) => "an object",
    }
}

/// What `apply_chat_template` does to each message before rendering: drop the keys whose
/// value is None, and alias the reasoning (first set of `reasoning_content`, `thinking`,
/// `reasoning`) as `{"thinking": r, **message, "reasoning_content": r}`.
fn hf_message(message: &Value) -> Value {
    let Value::Object(m) = message else {
        return message.clone();
    };
    let m: Map<String, Value> = m
        .iter()
        .filter(|(_, v)| !v.is_null())
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect();
    let reasoning = ["reasoning_content", "thinking", "reasoning"]
        .iter()
        .find_map(|k| m.get(*k))
        .cloned();
    let Some(r) = reasoning else {
        return Value::Object(m);
    };
    let mut out = Map::new();
    out.insert("thinking".into(), r.clone());
    for (k, v) in m {
        out.insert(k, v);
    }
    out.insert("reasoning_content".into(), r);
    Value::Object(out)
}

fn sha256_hex(bytes: &[u8]) -> String {
    hex(&Sha256::digest(bytes))
}

fn hex(bytes: &[u8]) -> String {
    let mut s = String::with_capacity(bytes.len() * 2);
    for b in bytes {
        let _ = write!(s, "{b:02x}");
    }
    s
}

/// minijinja's message (kind: detail) without the `(in name:line)` suffix, which the
/// [`TemplateError`] variants carry themselves; with the causes of a wrapped error.
fn describe(e: &JinjaError) -> String {
    let mut msg = match e.detail() {
        Some(d) => format!("{}: {d}", e.kind()),
        None => e.kind().to_string(),
    };
    let mut source = std::error::Error::source(e);
    while let Some(s) = source {
        let _ = write!(msg, "; caused by: {s}");
        source = s.source();
    }
    msg
}

// -------------------------------------------------------------------------------------
// The Jinja environment HF builds

fn raise_exception(message: String) -> Result<JValue, JinjaError> {
    Err(JinjaError::new(ErrorKind::InvalidOperation, message))
}

/// Python's `str.isspace` set, for `strip()`/`lstrip()`/`rstrip()` without arguments.
fn py_space(c: char) -> bool {
    matches!(c, '\t'..='\r' | '\x1c'..='\x1f' | ' ' | '\u{85}' | '\u{a0}')
        || (c as u32 > 0xff && c.is_whitespace())
}

/// pycompat's methods, with Python's whitespace for the no-argument strips.
fn python_methods(
    state: &mut State,
    value: &JValue,
    method: &str,
    args: &[JValue],
) -> Result<JValue, JinjaError> {
    if args.is_empty()
        && let Some(s) = value.as_str()
    {
        match method {
            "strip" => return Ok(JValue::from(s.trim_matches(py_space))),
            "lstrip" => return Ok(JValue::from(s.trim_start_matches(py_space))),
            "rstrip" => return Ok(JValue::from(s.trim_end_matches(py_space))),
            _ => {}
        }
    }
    minijinja_contrib::pycompat::unknown_method_callback(state, value, method, args)
}

/// Prints `{{ value }}` as Jinja in Python does: strings as they are, `None`, `True`/`False`,
/// Python's float repr, lists and dicts as their Python repr; undefined as nothing.
fn python_formatter(
    out: &mut minijinja::Output,
    _state: &mut State,
    value: &JValue,
) -> Result<(), JinjaError> {
    let text = match value.kind() {
        ValueKind::Undefined => return Ok(()),
        ValueKind::String => {
            return out
                .write_str(value.as_str().unwrap_or(""))
                .map_err(JinjaError::from);
        }
        ValueKind::None | ValueKind::Bool | ValueKind::Number | ValueKind::Seq | ValueKind::Map => {
            match to_json(value) {
                Ok(j) => {
                    let mut s = String::new();
                    py_repr(&j, &mut s);
                    s
                }
                Err(_) => value.to_string(),
            }
        }
        _ => value.to_string(),
    };
    out.write_str(&text).map_err(JinjaError::from)
}

fn to_json(value: &JValue) -> Result<Value, JinjaError> {
    serde_json::to_value(value).map_err(|e| {
        JinjaError::new(
            ErrorKind::InvalidOperation,
            format!("cannot serialize value: {e}"),
        )
    })
}

/// Python's `repr` of a JSON value (as Jinja prints a list or dict).
fn py_repr(v: &Value, out: &mut String) {
    match v {
        Value::Null => out.push_str("None"),
        Value::Bool(true) => out.push_str("True"),
        Value::Bool(false) => out.push_str("False"),
        Value::Number(n) => py_number(n, out),
        Value::String(s) => py_str_repr(s, out),
        Value::Array(items) => {
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(", ");
                }
                py_repr(item, out);
            }
            out.push(']');
        }
        Value::Object(map) => {
            out.push('{');
            for (i, (k, item)) in map.iter().enumerate() {
                if i > 0 {
                    out.push_str(", ");
                }
                py_str_repr(k, out);
                out.push_str(": ");
                py_repr(item, out);
            }
            out.push('}');
        }
    }
}

fn py_str_repr(s: &str, out: &mut String) {
    let quote = if s.contains('\'') && !s.contains('"') {
        '"'
    } else {
        '\''
    };
    out.push(quote);
    for c in s.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if c == quote => {
                out.push('\\');
                out.push(c);
            }
            c if (c as u32) < 0x20 || c == '\x7f' => {
                let _ = write!(out, "\\x{:02x}", c as u32);
            }
            c => out.push(c),
        }
    }
    out.push(quote);
}

fn py_number(n: &serde_json::Number, out: &mut String) {
    if let Some(i) = n.as_i64() {
        let _ = write!(out, "{i}");
    } else if let Some(u) = n.as_u64() {
        let _ = write!(out, "{u}");
    } else if let Some(f) = n.as_f64() {
        py_float(f, out);
    }
}

/// Python's `repr(float)` (which `json.dumps` uses too): the shortest digits that round-trip,
/// in positional notation for exponents -4..16, else `d.ddde+XX`.
fn py_float(f: f64, out: &mut String) {
    if f.is_nan() {
        out.push_str("NaN");
        return;
    }
    if f.is_infinite() {
        out.push_str(if f > 0.0 { "Infinity" } else { "-Infinity" });
        return;
    }
    // Rust's `{:e}` gives the shortest round-trip digits: "-1.2345e-7", "1e16".
    let sci = format!("{f:e}");
    let (mantissa, exp) = sci.split_once('e').unwrap_or((sci.as_str(), "0"));
    let exp: i32 = exp.parse().unwrap_or(0);
    let (neg, mantissa) = match mantissa.strip_prefix('-') {
        Some(m) => (true, m),
        None => (false, mantissa),
    };
    let digits: String = mantissa.chars().filter(|c| *c != '.').collect();
    if neg {
        out.push('-');
    }
    if (-4..16).contains(&exp) {
        let len = digits.len() as i32;
        if exp < 0 {
            out.push_str("0.");
            for _ in 0..(-exp - 1) {
                out.push('0');
            }
            out.push_str(&digits);
        } else if exp + 1 >= len {
            out.push_str(&digits);
            for _ in 0..(exp + 1 - len) {
                out.push('0');
            }
            out.push_str(".0");
        } else {
            let (a, b) = digits.split_at((exp + 1) as usize);
            out.push_str(a);
            out.push('.');
            out.push_str(b);
        }
    } else {
        out.push_str(mantissa);
        let _ = write!(
            out,
            "e{}{:02}",
            if exp < 0 { '-' } else { '+' },
            exp.unsigned_abs()
        );
    }
}

/// HF's `tojson`: `json.dumps(x, ensure_ascii=False, indent=None, separators=None,
/// sort_keys=False)`, keyword arguments as in Python.
fn tojson_filter(value: &JValue, kwargs: Kwargs) -> Result<JValue, JinjaError> {
    let ensure_ascii: Option<bool> = kwargs.get("ensure_ascii")?;
    let indent: Option<JValue> = kwargs.get("indent")?;
    let separators: Option<JValue> = kwargs.get("separators")?;
    let sort_keys: Option<bool> = kwargs.get("sort_keys")?;
    kwargs.assert_all_used()?;

    let indent = match indent {
        None => None,
        Some(v) if v.is_none() => None,
        Some(v) => match v.as_str() {
            Some(s) => Some(s.to_string()),
            None => {
                let n = i64::try_from(v.clone()).map_err(|_| {
                    JinjaError::new(
                        ErrorKind::InvalidOperation,
                        "tojson: indent must be an integer or a string",
                    )
                })?;
                Some(" ".repeat(n.max(0) as usize))
            }
        },
    };
    let (item_sep, key_sep) = match separators {
        Some(v) if !v.is_none() => {
            let parts: Vec<String> = v
                .try_iter()?
                .map(|p| p.as_str().map(String::from))
                .collect::<Option<Vec<_>>>()
                .unwrap_or_default();
            match <[String; 2]>::try_from(parts) {
                Ok([a, b]) => (a, b),
                Err(_) => {
                    return Err(JinjaError::new(
                        ErrorKind::InvalidOperation,
                        "tojson: separators must be a pair of strings",
                    ));
                }
            }
        }
        // Python: (', ', ': ') without indent, (',', ': ') with one.
        _ if indent.is_some() => (",".into(), ": ".into()),
        _ => (", ".into(), ": ".into()),
    };
    let opts = JsonOpts {
        ensure_ascii: ensure_ascii.unwrap_or(false),
        indent,
        item_sep,
        key_sep,
        sort_keys: sort_keys.unwrap_or(false),
    };
    let json = to_json(value)?;
    let mut out = String::new();
    py_json(&json, &opts, 0, &mut out);
    Ok(JValue::from(out))
}

/// Python's `json.dumps(v, ensure_ascii=False)` (`", "` and `": "`, keys in their order).
pub(crate) fn json_dumps(v: &Value) -> String {
    let opts = JsonOpts {
        ensure_ascii: false,
        indent: None,
        item_sep: ", ".into(),
        key_sep: ": ".into(),
        sort_keys: false,
    };
    let mut out = String::new();
    py_json(v, &opts, 0, &mut out);
    out
}

struct JsonOpts {
    ensure_ascii: bool,
    indent: Option<String>,
    item_sep: String,
    key_sep: String,
    sort_keys: bool,
}

fn py_json(v: &Value, o: &JsonOpts, depth: usize, out: &mut String) {
    let newline = |out: &mut String, depth: usize| {
        if let Some(ind) = &o.indent {
            out.push('\n');
            for _ in 0..depth {
                out.push_str(ind);
            }
        }
    };
    match v {
        Value::Null => out.push_str("null"),
        Value::Bool(b) => out.push_str(if *b { "true" } else { "false" }),
        Value::Number(n) => py_number(n, out),
        Value::String(s) => py_json_str(s, o.ensure_ascii, out),
        Value::Array(items) => {
            if items.is_empty() {
                out.push_str("[]");
                return;
            }
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(&o.item_sep);
                }
                newline(out, depth + 1);
                py_json(item, o, depth + 1, out);
            }
            newline(out, depth);
            out.push(']');
        }
        Value::Object(map) => {
            if map.is_empty() {
                out.push_str("{}");
                return;
            }
            let mut entries: Vec<(&String, &Value)> = map.iter().collect();
            if o.sort_keys {
                entries.sort_by(|a, b| a.0.cmp(b.0));
            }
            out.push('{');
            for (i, (k, item)) in entries.into_iter().enumerate() {
                if i > 0 {
                    out.push_str(&o.item_sep);
                }
                newline(out, depth + 1);
                py_json_str(k, o.ensure_ascii, out);
                out.push_str(&o.key_sep);
                py_json(item, o, depth + 1, out);
            }
            newline(out, depth);
            out.push('}');
        }
    }
}

fn py_json_str(s: &str, ensure_ascii: bool, out: &mut String) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{8}' => out.push_str("\\b"),
            '\u{c}' => out.push_str("\\f"),
            c if (c as u32) < 0x20 => {
                let _ = write!(out, "\\u{:04x}", c as u32);
            }
            c if ensure_ascii && (c as u32) > 0x7e => {
                let mut buf = [0u16; 2];
                for unit in c.encode_utf16(&mut buf) {
                    let _ = write!(out, "\\u{unit:04x}");
                }
            }
            c => out.push(c),
        }
    }
    out.push('"');
}

/// HF's `strftime_now(format)`: the current time (UTC here; Python uses local time, which is
/// UTC in the containers graft runs in) formatted with the common `strftime` directives.
fn strftime_now(format: String) -> Result<JValue, JinjaError> {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs() as i64)
        .unwrap_or(0);
    Ok(JValue::from(strftime(&format, secs)))
}

fn strftime(format: &str, unix: i64) -> String {
    const MONTHS: [&str; 12] = [
        "January",
        "February",
        "March",
        "April",
        "May",
        "June",
        "July",
        "August",
        "September",
        "October",
        "November",
        "December",
    ];
    const DAYS: [&str; 7] = [
        "Monday",
        "Tuesday",
        "Wednesday",
        "Thursday",
        "Friday",
        "Saturday",
        "Sunday",
    ];
    let days = unix.div_euclid(86_400);
    let secs = unix.rem_euclid(86_400);
    let (h, mi, s) = (secs / 3600, secs % 3600 / 60, secs % 60);
    // Howard Hinnant's civil_from_days.
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy_mar = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy_mar + 2) / 153;
    let d = doy_mar - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    let weekday = (days + 3).rem_euclid(7) as usize; // 1970-01-01 was a Thursday (3)
    let leap = (y % 4 == 0 && y % 100 != 0) || y % 400 == 0;
    let cum = [0, 31, 59, 90, 120, 151, 181, 212, 243, 273, 304, 334];
    let yday = cum[(m - 1) as usize] + d + i64::from(leap && m > 2);
    let month = MONTHS[(m - 1) as usize];
    let day = DAYS[weekday];

    let mut out = String::new();
    let mut chars = format.chars();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        let _ = match chars.next() {
            Some('Y') => write!(out, "{y}"),
            Some('y') => write!(out, "{:02}", y.rem_euclid(100)),
            Some('m') => write!(out, "{m:02}"),
            Some('d') => write!(out, "{d:02}"),
            Some('e') => write!(out, "{d:>2}"),
            Some('-') => match chars.next() {
                Some('d') => write!(out, "{d}"),
                Some('m') => write!(out, "{m}"),
                Some('H') => write!(out, "{h}"),
                Some('I') => write!(out, "{}", (h + 11) % 12 + 1),
                Some(other) => write!(out, "%-{other}"),
                None => write!(out, "%-"),
            },
            Some('H') => write!(out, "{h:02}"),
            Some('I') => write!(out, "{:02}", (h + 11) % 12 + 1),
            Some('M') => write!(out, "{mi:02}"),
            Some('S') => write!(out, "{s:02}"),
            Some('p') => write!(out, "{}", if h < 12 { "AM" } else { "PM" }),
            Some('B') => write!(out, "{month}"),
            Some('b') | Some('h') => write!(out, "{}", &month[..3]),
            Some('A') => write!(out, "{day}"),
            Some('a') => write!(out, "{}", &day[..3]),
            Some('j') => write!(out, "{yday:03}"),
            Some('F') => write!(out, "{y}-{m:02}-{d:02}"),
            Some('T') => write!(out, "{h:02}:{mi:02}:{s:02}"),
            Some('%') => write!(out, "%"),
            Some(other) => write!(out, "%{other}"),
            None => write!(out, "%"),
        };
    }
    out
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

    use super::*;
    use serde_json::json;

    fn render(src: &str, ctx: Value) -> Result<String, TemplateError> {
        let t = ChatTemplate::from_str(src, Some("<s>".into()), Some("</s>".into()))?;
        let extra = ctx.as_object().cloned().unwrap_or_default();
        t.render(
            &[json!({"role": "user", "content": "hi"})],
            None,
            false,
            &extra,
        )
    }

    #[test]
    fn tojson_is_pythons_json_dumps() {
        let out = render(
            "{{ x | tojson }}",
            json!({"x": {"b": "'<>&\"é\n", "a": [1, 2.5, 1e20, 0.0001, 1e-5, true, null], "c": {}}}),
        )
        .unwrap();
        assert_eq!(
            out,
            r#"{"b": "'<>&\"é\n", "a": [1, 2.5, 1e+20, 0.0001, 1e-05, true, null], "c": {}}"#
        );
        let out = render(
            "{{ x | tojson(indent=2, sort_keys=true) }}",
            json!({"x": {"b": [1, {}], "a": "ü"}}),
        )
        .unwrap();
        assert_eq!(
            out,
            "{\n  \"a\": \"ü\",\n  \"b\": [\n    1,\n    {}\n  ]\n}"
        );
        let out = render(
            "{{ x | tojson(ensure_ascii=true, separators=(',', ':')) }}",
            json!({"x": {"k": "é😀"}}),
        )
        .unwrap();
        assert_eq!(out, r#"{"k":"\u00e9\ud83d\ude00"}"#);
    }

    #[test]
    fn python_floats() {
        let cases = [
            (1.0, "1.0"),
            (0.1, "0.1"),
            (-2.5, "-2.5"),
            (1e16, "1e+16"),
            (1e15, "1000000000000000.0"),
            (123456.789, "123456.789"),
            (1.5e-7, "1.5e-07"),
            (0.001, "0.001"),
            (1.2345678901234567e300, "1.2345678901234567e+300"),
        ];
        for (f, want) in cases {
            let mut s = String::new();
            py_float(f, &mut s);
            assert_eq!(s, want, "{f}");
        }
    }

    #[test]
    fn prints_values_as_python_does() {
        let out = render(
            "{{ t }} {{ f }} {{ n }} {{ l }} {{ d }} [{{ undefined_thing }}] {{ bos_token }}{{ eos_token }}",
            json!({"t": true, "f": false, "n": null, "l": [1, "a'b", "x"], "d": {"k": 1.0}}),
        )
        .unwrap();
        assert_eq!(
            out,
            r#"True False None [1, "a'b", 'x'] {'k': 1.0} [] <s></s>"#
        );
    }

    #[test]
    fn python_string_methods_and_whitespace_control() {
        let src = "{% for m in messages %}\n  {{ m.content.strip().upper() }}|{{ '\\n\\nx\\n'.strip('\\n') }}|{{ 'a,b'.split(',')[-1] }}|{{ 'abc'.startswith('ab') }}\n{% endfor %}\n";
        let t = ChatTemplate::from_str(src, None, None).unwrap();
        let out = t
            .render(
                &[json!({"role": "user", "content": " hi\u{1c}"})],
                None,
                false,
                &Map::new(),
            )
            .unwrap();
        assert_eq!(out, "  HI|x|b|True\n"); // as Jinja2 3.1.6 renders it
    }

    #[test]
    fn hf_message_preprocessing() {
        let src = "{% for m in messages %}{{ m | tojson }}\n{% endfor %}";
        let t = ChatTemplate::from_str(src, None, None).unwrap();
        let out = t
            .render(
                &[
                    json!({"role": "assistant", "content": null, "reasoning": "r"}),
                    json!({"role": "assistant", "reasoning_content": "x", "content": "c"}),
                ],
                None,
                false,
                &Map::new(),
            )
            .unwrap();
        assert_eq!(
            out,
            "{\"thinking\": \"r\", \"role\": \"assistant\", \"reasoning\": \"r\", \"reasoning_content\": \"r\"}\n\
             {\"thinking\": \"x\", \"role\": \"assistant\", \"reasoning_content\": \"x\", \"content\": \"c\"}\n"
        );
    }

    #[test]
    fn tools_and_documents_are_defined_as_none() {
        let src = "{{ tools is defined }} {{ tools is none }} {{ documents is none }} {{ add_generation_prompt }} {{ enable_thinking }}";
        let t = ChatTemplate::from_str(src, None, None).unwrap();
        let mut extra = Map::new();
        extra.insert("enable_thinking".into(), json!(false));
        let out = t
            .render(
                &[json!({"role": "user", "content": "x"})],
                None,
                true,
                &extra,
            )
            .unwrap();
        assert_eq!(out, "True True True True False");
    }

    #[test]
    fn raise_exception_names_the_line() {
        let src = "a\n{% if messages[0].role != 'system' %}\n{{ raise_exception('Conversation must start with a system message') }}\n{% endif %}";
        let err = render(src, json!({})).unwrap_err();
        let msg = err.to_string();
        assert!(
            matches!(err, TemplateError::Render { line: 3, .. }),
            "{msg}"
        );
        assert!(
            msg.contains("line 3") && msg.contains("Conversation must start with a system message"),
            "{msg}"
        );
    }

    #[test]
    fn syntax_errors_name_the_line() {
        let err = ChatTemplate::from_str("ok\n{% if x %}\n{{ y }", None, None).unwrap_err();
        assert!(
            matches!(err, TemplateError::Syntax { line: 3, .. }),
            "{err}"
        );
        assert!(err.to_string().contains("<inline>, line 3"), "{err}");
    }

    #[test]
    fn missing_dir_names_the_file() {
        let dir = std::env::temp_dir().join("graft-template-missing-dir");
        let err = ChatTemplate::from_dir(&dir).unwrap_err();
        assert!(matches!(err, TemplateError::NoTemplate { .. }), "{err}");
        let err = Tokenizer::from_dir(&dir).unwrap_err();
        assert!(err.to_string().contains("tokenizer.json"), "{err}");
    }

    #[test]
    fn list_form_picks_tool_use_with_tools() {
        let dir = std::env::temp_dir().join(format!("graft-template-list-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(
            dir.join("tokenizer_config.json"),
            json!({
                "bos_token": {"content": "<B>", "__type": "AddedToken"},
                "eos_token": "<E>",
                "chat_template": [
                    {"name": "default", "template": "D{{ bos_token }}{{ eos_token }}"},
                    {"name": "tool_use", "template": "T{{ tools | length }}"},
                ]
            })
            .to_string(),
        )
        .unwrap();
        let t = ChatTemplate::from_dir(&dir).unwrap();
        let msgs = [json!({"role": "user", "content": "x"})];
        assert_eq!(
            t.render(&msgs, None, false, &Map::new()).unwrap(),
            "D<B><E>"
        );
        let tools = [json!({"type": "function"})];
        assert_eq!(
            t.render(&msgs, Some(&tools), false, &Map::new()).unwrap(),
            "T1"
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn shareable_across_threads() {
        fn assert_send_sync<T: Send + Sync>() {}
        assert_send_sync::<ChatTemplate>();
        assert_send_sync::<Tokenizer>();
    }

    #[test]
    fn strftime_formats() {
        // 2024-02-29 13:05:09 UTC, a Thursday.
        let t = 1_709_211_909;
        assert_eq!(
            strftime("%Y-%m-%d %H:%M:%S %a %A %b %B %j %y %I%p %-d %%", t),
            "2024-02-29 13:05:09 Thu Thursday Feb February 060 24 01PM 29 %"
        );
        assert_eq!(strftime("%d %b %Y", 0), "01 Jan 1970");
    }
}

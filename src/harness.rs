//! `graft harness`: how to point an unmodified agent harness at a graft session.
//!
//! The templates live in the repository's `harness-configs/<name>/` (one folder per harness:
//! an `env` file of `NAME=template` lines, the config file templates, a README) and are
//! compiled into the binary with `include_str!`, so `graft harness` works anywhere.
//! Placeholders: `{{base_url}}` (the session URL ending in `/v1`), `{{base_url_root}}` (the
//! same without `/v1`, for Anthropic clients that append `/v1/messages`), `{{api_key}}`,
//! `{{model}}`.

use anyhow::{Context, bail};

/// `graft harness ...`
#[derive(Debug, clap::Subcommand)]
pub enum HarnessCommand {
    /// List the harnesses graft has configs for.
    List,
    /// Print `export VAR=...` lines that point a harness at a session.
    Env(RenderArgs),
    /// Print a harness's filled config file(s), each under the path it belongs at.
    Config(RenderArgs),
}

#[derive(Debug, Clone, clap::Args)]
pub struct RenderArgs {
    /// Harness name (see `graft harness list`).
    pub name: String,
    /// The session's base URL, as `POST /graft/sessions` returned it
    /// (`http://HOST:PORT/s/<id>/v1`; the trailing `/v1` may be left out).
    #[arg(long)]
    pub session: String,
    /// API key the harness sends (the session's `api_key`; graft never forwards it upstream).
    #[arg(long, default_value = "graft")]
    pub api_key: String,
    /// Model name the harness asks for (what the upstream serves).
    #[arg(long, default_value = "default")]
    pub model: String,
}

/// One config file of a harness.
#[derive(Debug, Clone, Copy)]
pub struct ConfigFile {
    /// Where the filled file belongs (shell-style, e.g. `$CODEX_HOME/config.toml`).
    pub path: &'static str,
    pub template: &'static str,
}

/// One harness: its env template, config file templates and README.
#[derive(Debug, Clone, Copy)]
pub struct Harness {
    pub name: &'static str,
    pub summary: &'static str,
    /// `NAME=template` lines (blank lines and `#` comments ignored).
    pub env: &'static str,
    pub files: &'static [ConfigFile],
    pub readme: &'static str,
}

/// One file of `harness-configs/<dir>/`, compiled in.
macro_rules! tpl {
    ($dir:literal, $file:literal) => {
        include_str!(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/harness-configs/",
            $dir,
            "/",
            $file
        ))
    };
}

/// A harness whose folder is `harness-configs/<name>/`: its `env`, its `README.md`, and each
/// config file as (where it belongs, its file in the folder).
macro_rules! harness {
    ($name:literal, $summary:literal, [$(($path:literal, $file:literal)),+ $(,)?]) => {
        Harness {
            name: $name,
            summary: $summary,
            env: tpl!($name, "env"),
            files: &[$(ConfigFile { path: $path, template: tpl!($name, $file) }),+],
            readme: tpl!($name, "README.md"),
        }
    };
}

/// Every harness graft has configs for, in `graft harness list` order.
pub const HARNESSES: &[Harness] = &[
    harness!(
        "codex",
        "Codex CLI: Responses API (SSE); a [model_providers.graft] block in $CODEX_HOME/config.toml",
        [("$CODEX_HOME/config.toml", "config.toml")]
    ),
    harness!(
        "mini-swe-agent",
        "mini-swe-agent (litellm): Chat Completions; OPENAI_BASE_URL + -m openai/<model>",
        [("graft.yaml (mini -c mini.yaml -c graft.yaml)", "graft.yaml")]
    ),
    harness!(
        "aider",
        "aider (litellm): Chat Completions, streaming; --openai-api-base / .aider.conf.yml",
        [("<repo root>/.aider.conf.yml", ".aider.conf.yml")]
    ),
    harness!(
        "openhands-sdk",
        "OpenHands SDK (litellm): Chat Completions; LLM(base_url=..., api_key=...) or LLM_* env",
        [(
            "graft_llm.py (import llm from your agent script)",
            "graft_llm.py"
        )]
    ),
    harness!(
        "zeroclaw",
        "ZeroClaw (0.8): Chat Completions; schema-3 [providers.models.openai.graft] + [agents.graft] in ~/.zeroclaw/config.toml",
        [("~/.zeroclaw/config.toml", "config.toml")]
    ),
    harness!(
        "claude-code",
        "Claude Code: Anthropic Messages (SSE); ANTHROPIC_BASE_URL (no /v1) + ANTHROPIC_MODEL, or ~/.claude/settings.json env",
        [("~/.claude/settings.json", "settings.json")]
    ),
    harness!(
        "pi",
        "pi (pi-coding-agent): Chat Completions (SSE); a \"graft\" provider in ~/.pi/agent/models.json",
        [("~/.pi/agent/models.json", "models.json")]
    ),
    harness!(
        "opencode",
        "opencode: Chat Completions (SSE) through its openai-compatible provider; ~/.config/opencode/opencode.json",
        [("~/.config/opencode/opencode.json", "opencode.json")]
    ),
    harness!(
        "openclaw",
        "OpenClaw: Chat Completions (SSE); a \"graft\" provider in ~/.openclaw/openclaw.json; openclaw agent exec",
        [("~/.openclaw/openclaw.json", "openclaw.json")]
    ),
    harness!(
        "hermes",
        "Hermes Agent: Chat Completions (SSE); provider custom + base_url in ~/.hermes/config.yaml",
        [("~/.hermes/config.yaml", "config.yaml")]
    ),
    harness!(
        "litellm-anthropic",
        "Anthropic Messages (/v1/messages): anthropic SDK or litellm anthropic/; base URL without /v1",
        [
            (
                "graft_anthropic.py (example client code)",
                "graft_anthropic.py"
            ),
            (
                "litellm-config.yaml (litellm --config litellm-config.yaml)",
                "litellm-config.yaml"
            ),
        ]
    ),
];

/// The values the placeholders take.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Values {
    /// Session URL ending in `/v1`.
    pub base_url: String,
    /// Session URL without `/v1`.
    pub base_url_root: String,
    pub api_key: String,
    pub model: String,
}

impl Values {
    /// Normalizes the session URL (trailing `/`, optional `/v1`) and checks that every value
    /// can go into a quoted TOML/YAML/Python string or a shell word unescaped.
    pub fn new(session: &str, api_key: &str, model: &str) -> anyhow::Result<Values> {
        let trimmed = session.trim().trim_end_matches('/');
        if !(trimmed.starts_with("http://") || trimmed.starts_with("https://")) {
            bail!(
                "--session must be an http(s) URL like http://HOST:PORT/s/<id>/v1, got {session:?}"
            );
        }
        let root = trimmed.strip_suffix("/v1").unwrap_or(trimmed);
        let values = Values {
            base_url: format!("{root}/v1"),
            base_url_root: root.to_owned(),
            api_key: api_key.to_owned(),
            model: model.to_owned(),
        };
        for (what, v) in [
            ("--session", values.base_url.as_str()),
            ("--api-key", values.api_key.as_str()),
            ("--model", values.model.as_str()),
        ] {
            if v.is_empty() {
                bail!("{what} must not be empty");
            }
            if let Some(c) = v.chars().find(|c| {
                c.is_whitespace() || c.is_control() || matches!(c, '"' | '\'' | '\\' | '`' | '$')
            }) {
                bail!("{what} {v:?} contains {c:?}, which the config files cannot hold unescaped");
            }
        }
        Ok(values)
    }
}

/// The harness called `name`, or an error listing the known ones.
pub fn find(name: &str) -> anyhow::Result<&'static Harness> {
    HARNESSES.iter().find(|h| h.name == name).with_context(|| {
        let known: Vec<&str> = HARNESSES.iter().map(|h| h.name).collect();
        format!("unknown harness {name:?}; known: {}", known.join(", "))
    })
}

/// Fills every `{{placeholder}}`; an unknown or unclosed placeholder is an error.
pub fn render(template: &str, v: &Values) -> anyhow::Result<String> {
    let mut out = String::with_capacity(template.len() + 64);
    let mut rest = template;
    while let Some(start) = rest.find("{{") {
        out.push_str(&rest[..start]);
        let after = &rest[start + 2..];
        let Some(end) = after.find("}}") else {
            bail!("unclosed placeholder in template: {:?}", &rest[start..]);
        };
        let value = match after[..end].trim() {
            "base_url" => &v.base_url,
            "base_url_root" => &v.base_url_root,
            "api_key" => &v.api_key,
            "model" => &v.model,
            other => bail!("unknown placeholder {{{{{other}}}}} in template"),
        };
        out.push_str(value);
        rest = &after[end + 2..];
    }
    out.push_str(rest);
    Ok(out)
}

/// `(NAME, value)` pairs of a harness's env template, filled.
pub fn env_vars(h: &Harness, v: &Values) -> anyhow::Result<Vec<(String, String)>> {
    let mut vars = Vec::new();
    for line in h.env.lines().map(str::trim) {
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let Some((name, tpl)) = line.split_once('=') else {
            bail!("harness-configs/{}/env: line without '=': {line:?}", h.name);
        };
        vars.push((name.trim().to_owned(), render(tpl.trim(), v)?));
    }
    Ok(vars)
}

/// `export NAME='value'` lines.
pub fn render_env(h: &Harness, v: &Values) -> anyhow::Result<String> {
    let mut out = String::new();
    for (name, value) in env_vars(h, v)? {
        out.push_str(&format!("export {name}='{value}'\n"));
    }
    Ok(out)
}

/// Every config file, filled, each preceded by a `# ==> PATH <==` line.
pub fn render_config(h: &Harness, v: &Values) -> anyhow::Result<String> {
    let mut out = String::new();
    for (i, f) in h.files.iter().enumerate() {
        if i > 0 {
            out.push('\n');
        }
        out.push_str(&format!("# ==> {} <==\n", f.path));
        let body = render(f.template, v)?;
        out.push_str(&body);
        if !body.ends_with('\n') {
            out.push('\n');
        }
    }
    Ok(out)
}

pub fn list() -> String {
    let width = HARNESSES.iter().map(|h| h.name.len()).max().unwrap_or(0);
    HARNESSES
        .iter()
        .map(|h| format!("{:width$}  {}\n", h.name, h.summary))
        .collect()
}

pub fn run(cmd: HarnessCommand) -> anyhow::Result<()> {
    let text = match cmd {
        HarnessCommand::List => list(),
        HarnessCommand::Env(a) => {
            let h = find(&a.name)?;
            render_env(h, &Values::new(&a.session, &a.api_key, &a.model)?)?
        }
        HarnessCommand::Config(a) => {
            let h = find(&a.name)?;
            render_config(h, &Values::new(&a.session, &a.api_key, &a.model)?)?
        }
    };
    print!("{text}");
    Ok(())
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
mod tests {
    use super::*;

    fn values() -> Values {
        Values::new(
            "http://127.0.0.1:8400/s/rollout-1/v1/",
            "gk-abc",
            "my-model",
        )
        .unwrap()
    }

    #[test]
    fn session_url_is_normalized_with_and_without_v1() {
        let a = Values::new("http://h:1/s/x/v1", "k", "m").unwrap();
        let b = Values::new("http://h:1/s/x/", "k", "m").unwrap();
        assert_eq!(a, b);
        assert_eq!(a.base_url, "http://h:1/s/x/v1");
        assert_eq!(a.base_url_root, "http://h:1/s/x");
        assert!(Values::new("h:1/s/x", "k", "m").is_err());
        assert!(Values::new("http://h:1/s/x", "k\"", "m").is_err());
        assert!(Values::new("http://h:1/s/x", "k", "").is_err());
    }

    #[test]
    fn every_harness_renders_env_and_config_with_no_placeholder_left() {
        let v = values();
        assert!(HARNESSES.len() >= 6);
        for h in HARNESSES {
            let env = render_env(h, &v).unwrap_or_else(|e| panic!("{}: {e:#}", h.name));
            let config = render_config(h, &v).unwrap_or_else(|e| panic!("{}: {e:#}", h.name));
            for text in [&env, &config] {
                assert!(
                    !text.contains("{{") && !text.contains("}}"),
                    "{}: {text}",
                    h.name
                );
            }
            // Harnesses whose config file holds everything (ZeroClaw, OpenClaw, Hermes) have
            // no variables.
            assert!(env.lines().all(|l| l.starts_with("export ")), "{env}");
            assert!(!h.files.is_empty(), "{} has no config file", h.name);
            // Every harness is pointed at the session with its key.
            assert!(
                config.contains("127.0.0.1:8400/s/rollout-1")
                    && (env.contains("gk-abc") || config.contains("gk-abc")),
                "{}:\n{env}\n{config}",
                h.name
            );
            assert!(h.readme.lines().count() > 2, "{} README", h.name);
        }
    }

    #[test]
    fn codex_config_is_valid_toml_with_a_responses_provider() {
        let h = find("codex").unwrap();
        let text = render(h.files[0].template, &values()).unwrap();
        let doc: toml_check::Doc = toml_check::parse(&text);
        assert_eq!(doc.get("model_provider"), Some("graft"));
        assert_eq!(doc.get("model"), Some("my-model"));
        assert_eq!(doc.get("model_providers.graft.wire_api"), Some("responses"));
        assert_eq!(
            doc.get("model_providers.graft.base_url"),
            Some("http://127.0.0.1:8400/s/rollout-1/v1")
        );
        assert_eq!(
            doc.get("model_providers.graft.env_key"),
            Some("GRAFT_API_KEY")
        );
        let env = env_vars(h, &values()).unwrap();
        assert_eq!(env, vec![("GRAFT_API_KEY".to_owned(), "gk-abc".to_owned())]);
    }

    #[test]
    fn anthropic_clients_get_the_url_without_v1() {
        let h = find("litellm-anthropic").unwrap();
        let env = env_vars(h, &values()).unwrap();
        assert!(env.contains(&(
            "ANTHROPIC_BASE_URL".to_owned(),
            "http://127.0.0.1:8400/s/rollout-1".to_owned()
        )));
    }

    #[test]
    fn unknown_name_lists_the_known_ones() {
        let err = format!("{:#}", find("nope").unwrap_err());
        for h in HARNESSES {
            assert!(err.contains(h.name), "{err}");
        }
    }

    #[test]
    fn unknown_or_unclosed_placeholders_are_errors() {
        assert!(render("a {{nope}} b", &values()).is_err());
        assert!(render("a {{model b", &values()).is_err());
        assert_eq!(render("{{ model }}!", &values()).unwrap(), "my-model!");
    }

    /// A tiny reader for the flat `key = "string"` / `[table]` TOML the codex template uses
    /// (the graft package has no TOML dependency of its own).
    mod toml_check {
        use std::collections::HashMap;

        pub struct Doc(HashMap<String, String>);

        impl Doc {
            pub fn get(&self, k: &str) -> Option<&str> {
                self.0.get(k).map(String::as_str)
            }
        }

        pub fn parse(text: &str) -> Doc {
            let mut table = String::new();
            let mut map = HashMap::new();
            for line in text.lines().map(str::trim) {
                if line.is_empty() || line.starts_with('#') {
                    continue;
                }
                if let Some(t) = line.strip_prefix('[') {
                    table = t.trim_end_matches(']').to_owned();
                    continue;
                }
                let (k, v) = line
                    .split_once('=')
                    .unwrap_or_else(|| panic!("bad line {line:?}"));
                let key = if table.is_empty() {
                    k.trim().to_owned()
                } else {
                    format!("{table}.{}", k.trim())
                };
                map.insert(key, v.trim().trim_matches('"').to_owned());
            }
            Doc(map)
        }
    }
}

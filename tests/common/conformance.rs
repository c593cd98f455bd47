//! The conformance check (issue 35, point 10): bodies graft sent to an inference server,
//! judged by that server's own request models in the pinned packages
//! (`tests/conformance/check_bodies.py` over `.graft-test-env/servers/src`, which
//! `bash scripts/setup-test-env.sh` extracts from the `sglang` and `vllm` wheels).
//!
//! For any test that captures what graft sends: collect [`Sent`] bodies (the scripted
//! upstream keeps every SGLang body under `GET /testkit/requests` → `bodies`; a vLLM test
//! builds them from what its stand-in received) and assert every [`check`] verdict is `ok`.

use std::fmt;
use std::io::Write;
use std::path::PathBuf;
use std::process::{Command, Stdio};

use serde::{Deserialize, Serialize};
use serde_json::{Value, json};

use super::{TestEnv, repo_root};

/// One body graft sent: to which server (`sglang` or `vllm`), on which route.
#[derive(Debug, Clone, Serialize)]
pub struct Sent {
    pub server: String,
    pub path: String,
    pub body: Value,
}

impl Sent {
    pub fn sglang(path: &str, body: Value) -> Sent {
        Sent {
            server: "sglang".into(),
            path: path.into(),
            body,
        }
    }
    pub fn vllm(path: &str, body: Value) -> Sent {
        Sent {
            server: "vllm".into(),
            path: path.into(),
            body,
        }
    }
}

/// The server's verdict on one body: the model it was judged by and what does not fit.
#[derive(Debug, Clone, Deserialize)]
pub struct Verdict {
    pub server: String,
    pub path: String,
    pub model: Option<String>,
    pub ok: bool,
    pub errors: Vec<String>,
}

impl fmt::Display for Verdict {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} {} ({}): {}",
            self.server,
            self.path,
            self.model.as_deref().unwrap_or("-"),
            if self.ok {
                "ok".to_owned()
            } else {
                self.errors.join("; ")
            }
        )
    }
}

/// The servers' files and the Python that reads them.
pub struct Servers {
    pub python: PathBuf,
    pub src: PathBuf,
}

impl Servers {
    /// Fails, never skips, when the `servers` part of the test env is missing.
    pub fn get() -> Servers {
        let root = TestEnv::root();
        let s = Servers {
            python: root.join("servers").join("bin").join("python"),
            src: root.join("servers").join("src"),
        };
        let missing: Vec<String> = [
            s.python.clone(),
            s.src.join("sglang/api/v1/api_types.py"),
            s.src.join("vllm/entrypoints/openai/completion/protocol.py"),
            s.src.join("vllm/sampling_params.py"),
            s.src.join("xgrammar/libxgrammar_bindings.so"),
        ]
        .into_iter()
        .filter(|p| !p.exists())
        .map(|p| p.display().to_string())
        .collect();
        assert!(
            missing.is_empty(),
            "the servers' request models are not installed (missing: {}).\n\
             Run `bash scripts/setup-test-env.sh servers` from the repository root \
             (or point GRAFT_TEST_ENV at an environment it made).",
            missing.join(", ")
        );
        s
    }

    fn run(&self, args: &[&str], input: &Value) -> Value {
        let script = repo_root().join("tests/conformance/check_bodies.py");
        let mut child = Command::new(&self.python)
            .arg(&script)
            .arg(&self.src)
            .args(args)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap_or_else(|e| panic!("cannot run {}: {e}", self.python.display()));
        child
            .stdin
            .take()
            .unwrap()
            .write_all(input.to_string().as_bytes())
            .unwrap();
        let out = child.wait_with_output().unwrap();
        assert!(
            out.status.success(),
            "{} failed: {}",
            script.display(),
            String::from_utf8_lossy(&out.stderr)
        );
        serde_json::from_slice(&out.stdout).unwrap()
    }

    /// Every string literal of a file of the servers' sources (implicit concatenation
    /// joined), to compare messages with the server's own.
    pub fn strings(&self, file: &str) -> Vec<String> {
        serde_json::from_value(self.run(&["--strings", file], &json!({}))["strings"].clone())
            .unwrap()
    }
}

/// The verdict on each body, in order.
pub fn check(servers: &Servers, bodies: &[Sent]) -> Vec<Verdict> {
    let out = servers.run(&[], &json!({ "bodies": bodies }));
    let v: Vec<Verdict> = serde_json::from_value(out["verdicts"].clone()).unwrap();
    assert_eq!(v.len(), bodies.len());
    v
}

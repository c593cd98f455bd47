//! What the agent's integration tests share.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::path::PathBuf;
use std::process::{Command, Stdio};

/// The `envd-agent` example binary, built by cargo (fast: the library is already built).
pub fn agent_exe() -> PathBuf {
    static EXE: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();
    EXE.get_or_init(|| {
        let out = Command::new(env!("CARGO"))
            .args([
                "build",
                "-p",
                "graft-envd-agent",
                "--example",
                "envd-agent",
                "--message-format=json",
            ])
            .current_dir(env!("CARGO_MANIFEST_DIR"))
            .stderr(Stdio::inherit())
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "building the envd-agent example failed"
        );
        let text = String::from_utf8_lossy(&out.stdout);
        let exe = text
            .lines()
            .filter(|l| {
                l.contains("\"compiler-artifact\"") && l.contains("\"name\":\"envd-agent\"")
            })
            .find_map(|l| {
                let rest = &l[l.find("\"executable\":\"")? + 14..];
                Some(PathBuf::from(&rest[..rest.find('"')?]))
            })
            .unwrap_or_else(|| panic!("cargo did not name the envd-agent executable:\n{text}"));
        assert!(exe.is_file(), "{}", exe.display());
        exe
    })
    .clone()
}

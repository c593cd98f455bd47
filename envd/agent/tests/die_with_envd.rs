//! `--die-with-envd` for real: the `envd-agent` binary runs a command with its stdout on a
//! pipe this test reads, as envd reads every local exec's; closing the read end (what
//! envd's death does, kill -9 included) ends the agent and the command with it.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// Whether `pid` is gone or a zombie (killed, not yet reaped by whoever adopted it).
fn dead(pid: i32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Err(_) => true,
        Ok(s) => s
            .rfind(')')
            .and_then(|i| s[i + 1..].split_whitespace().next())
            .is_some_and(|state| state == "Z" || state == "X"),
    }
}

#[test]
fn the_agent_and_its_command_end_when_envd_stops_reading() {
    let mut agent = Command::new(common::agent_exe())
        .args([
            "--die-with-envd",
            "--",
            "sh",
            "-c",
            "echo $$; exec sleep 1000",
        ])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut out = BufReader::new(agent.stdout.take().unwrap());
    let mut line = String::new();
    out.read_line(&mut line).unwrap();
    let command: i32 = line.trim().parse().unwrap();
    assert!(!dead(command), "the command runs while envd reads");
    assert!(agent.try_wait().unwrap().is_none(), "so does the agent");

    drop(out);
    let deadline = Instant::now() + Duration::from_secs(30);
    let status = loop {
        if let Some(status) = agent.try_wait().unwrap() {
            break status;
        }
        if Instant::now() >= deadline {
            let _ = agent.kill();
            let _ = agent.wait();
            if let Some(p) = rustix::process::Pid::from_raw(command) {
                let _ = rustix::process::kill_process(p, rustix::process::Signal::KILL);
            }
            panic!("the agent kept running after its stdout's reader was gone");
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    assert_eq!(status.code(), Some(137), "{status:?}");
    while !dead(command) {
        assert!(
            Instant::now() < deadline,
            "the command (pid {command}) outlived the agent"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

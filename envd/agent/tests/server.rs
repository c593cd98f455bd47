//! The agent's server mode for real: the `envd-agent` example binary (which `cargo test`
//! builds with the tests) serves on loopback and is called over HTTP, as envd's Kubernetes
//! backend calls it on the Pod IP.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::io::{Read, Write};
use std::net::TcpStream;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

mod common;

use common::agent_exe;
use graft_envd_agent::server::{ExecResult, ExecSpec, FRAME_RESULT, FRAME_STDERR, FRAME_STDOUT};

const TOKEN: &str = "test-token-0123456789abcdef";

struct Agent {
    child: Child,
    addr: String,
    ws: tempfile::TempDir,
}

impl Drop for Agent {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn start() -> Agent {
    let ws = tempfile::tempdir().unwrap();
    let mut child = Command::new(agent_exe())
        .args(["serve", "--listen", "127.0.0.1:0", "--workspace"])
        .arg(ws.path())
        .args(["--sandbox-id", "sb-test"])
        .env("GRAFT_ENVD_AGENT_TOKEN", TOKEN)
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut out = child.stdout.take().unwrap();
    let mut line = Vec::new();
    let mut b = [0u8; 1];
    while out.read(&mut b).unwrap() == 1 && b[0] != b'\n' {
        line.push(b[0]);
    }
    let line = String::from_utf8(line).unwrap();
    let addr = line
        .strip_prefix("envd-agent listening on ")
        .unwrap_or_else(|| panic!("unexpected first line {line:?}"))
        .to_owned();
    Agent { child, addr, ws }
}

/// One HTTP/1.1 request; returns (status, body) read to the connection's end.
fn call(
    a: &Agent,
    method: &str,
    target: &str,
    token: Option<&str>,
    headers: &[(&str, String)],
    body: &[u8],
) -> (u16, Vec<u8>) {
    let mut c = TcpStream::connect(&a.addr).unwrap();
    let mut head = format!(
        "{method} {target} HTTP/1.1\r\nhost: agent\r\ncontent-length: {}\r\n",
        body.len()
    );
    if let Some(t) = token {
        head.push_str(&format!("authorization: Bearer {t}\r\n"));
    }
    for (k, v) in headers {
        head.push_str(&format!("{k}: {v}\r\n"));
    }
    head.push_str("\r\n");
    c.write_all(head.as_bytes()).unwrap();
    c.write_all(body).unwrap();
    let mut resp = Vec::new();
    c.read_to_end(&mut resp).unwrap();
    let end = resp.windows(4).position(|w| w == b"\r\n\r\n").unwrap();
    let status_line = String::from_utf8_lossy(&resp[..end]).into_owned();
    let status: u16 = status_line.split(' ').nth(1).unwrap().parse().unwrap();
    (status, resp[end + 4..].to_vec())
}

struct Exec {
    stdout: Vec<u8>,
    stderr: Vec<u8>,
    result: ExecResult,
}

fn exec(a: &Agent, job: &str, argv: &[&str], timeout_ms: u64, max_output: usize) -> Exec {
    let spec = ExecSpec {
        argv: argv.iter().map(|s| s.to_string()).collect(),
        env: vec![("MARK".to_owned(), job.to_owned())],
        cwd: "/".to_owned(),
        timeout: Duration::from_millis(timeout_ms),
        grace: Duration::from_millis(300),
        max_output,
        stdin: None,
    };
    let (status, body) = call(
        a,
        "POST",
        &format!("/exec?job={job}"),
        Some(TOKEN),
        &[
            ("x-envd-timeout-ms", timeout_ms.to_string()),
            ("x-envd-grace-ms", "300".to_owned()),
            ("x-envd-max-output", max_output.to_string()),
            ("x-envd-cwd", "/".to_owned()),
        ],
        &spec.encode_body(),
    );
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&body));
    let mut e = Exec {
        stdout: Vec::new(),
        stderr: Vec::new(),
        result: ExecResult::default(),
    };
    let mut rest = &body[..];
    let mut got_result = false;
    while rest.len() >= 5 {
        let len = u32::from_be_bytes(rest[1..5].try_into().unwrap()) as usize;
        let data = &rest[5..5 + len];
        match rest[0] {
            FRAME_STDOUT => e.stdout.extend_from_slice(data),
            FRAME_STDERR => e.stderr.extend_from_slice(data),
            FRAME_RESULT => {
                e.result = ExecResult::decode(std::str::from_utf8(data).unwrap()).unwrap();
                got_result = true;
            }
            k => panic!("unknown frame {k}"),
        }
        rest = &rest[5 + len..];
    }
    assert!(got_result, "no result frame");
    e
}

/// Processes whose environment carries MARK=<mark> (the exec's env is inherited by every
/// process of its tree unless one clears it; the test's processes do not).
fn marked(mark: &str) -> Vec<i32> {
    let needle = format!("MARK={mark}\0");
    std::fs::read_dir("/proc")
        .unwrap()
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<i32>().ok())
        .filter(|pid| {
            std::fs::read(format!("/proc/{pid}/environ"))
                .map(|env| env.windows(needle.len()).any(|w| w == needle.as_bytes()))
                .unwrap_or(false)
        })
        // A zombie has no environ left; only live ones count.
        .collect()
}

#[test]
fn every_route_but_healthz_refuses_a_missing_or_wrong_token() {
    let a = start();
    assert_eq!(call(&a, "GET", "/healthz", None, &[], b"").0, 200);
    for (m, t) in [
        ("POST", "/exec?job=j"),
        ("GET", "/files?path=x"),
        ("PUT", "/files?path=x"),
        ("GET", "/list?path="),
        ("POST", "/kill?job=j"),
    ] {
        for token in [None, Some("wrong-token-0123456789abcdef"), Some("")] {
            let (status, body) = call(&a, m, t, token, &[], b"data");
            assert_eq!(status, 401, "{m} {t} {token:?}");
            assert!(String::from_utf8_lossy(&body).starts_with("unauthorized\n"));
        }
    }
    assert!(!a.ws.path().join("x").exists(), "an unauthorized PUT wrote");
}

#[test]
fn exec_runs_the_command_with_the_env_and_caps_output() {
    let a = start();
    let e = exec(
        &a,
        "j1",
        &["/bin/sh", "-c", "echo out-$MARK; echo err >&2; exit 3"],
        10_000,
        1 << 20,
    );
    assert_eq!(String::from_utf8_lossy(&e.stdout), "out-j1\n");
    assert_eq!(String::from_utf8_lossy(&e.stderr), "err\n");
    assert_eq!(e.result.exit_code, Some(3));
    assert!(!e.result.timed_out);
    let e = exec(
        &a,
        "j2",
        &["/bin/sh", "-c", "head -c 100000 /dev/zero"],
        10_000,
        1000,
    );
    assert_eq!(e.stdout.len(), 1000);
    assert_eq!(e.result.stdout_bytes, 100_000);
    let e = exec(&a, "j3", &["/nonexistent/program"], 10_000, 1000);
    assert_eq!(e.result.exit_code, Some(127));
    assert!(String::from_utf8_lossy(&e.stderr).contains("cannot run"));
    // The token is not in the command's environment.
    let e = exec(&a, "j4", &["/bin/sh", "-c", "env"], 10_000, 1 << 20);
    assert!(!String::from_utf8_lossy(&e.stdout).contains(TOKEN));
}

#[test]
fn timeout_kills_the_whole_tree_including_setsid_double_forks_ignoring_sigterm() {
    let a = start();
    let job = format!("tree{}", std::process::id());
    let script =
        "trap '' TERM; (setsid sh -c \"trap '' TERM; sleep 300\" &); (sleep 300 &); sleep 300";
    let started = Instant::now();
    let e = exec(&a, &job, &["/bin/sh", "-c", script], 700, 1000);
    assert!(e.result.timed_out, "{:?}", e.result);
    assert!(
        started.elapsed() < Duration::from_secs(30),
        "the exec did not end after its timeout"
    );
    // Nothing of the exec is left running (zombies awaiting their reaper are gone too
    // within a moment).
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let left = marked(&job);
        if left.is_empty() {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "processes left after the timeout: {left:?}"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    // And a command that ends normally takes its background processes with it.
    let job2 = format!("bg{}", std::process::id());
    let e = exec(
        &a,
        &job2,
        &["/bin/sh", "-c", "(setsid sleep 300 &); echo done"],
        10_000,
        1000,
    );
    assert_eq!(e.result.exit_code, Some(0));
    let deadline = Instant::now() + Duration::from_secs(5);
    while !marked(&job2).is_empty() {
        assert!(
            Instant::now() < deadline,
            "a background process outlived its exec"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn kill_route_ends_a_running_exec() {
    let a = start();
    let job = format!("kill{}", std::process::id());
    std::thread::scope(|s| {
        let h = s.spawn(|| exec(&a, &job, &["/bin/sh", "-c", "sleep 300"], 60_000, 1000));
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let (status, _) = call(
                &a,
                "POST",
                &format!("/kill?job={job}"),
                Some(TOKEN),
                &[],
                b"",
            );
            if status == 200 {
                break;
            }
            assert!(Instant::now() < deadline, "the job never became killable");
            std::thread::sleep(Duration::from_millis(50));
        }
        let e = h.join().unwrap();
        assert!(e.result.killed);
        assert_eq!(e.result.exit_code, Some(137));
    });
    let (status, body) = call(&a, "POST", "/kill?job=nope", Some(TOKEN), &[], b"");
    assert_eq!(status, 404, "{}", String::from_utf8_lossy(&body));
}

#[test]
fn files_are_confined_to_the_workspace() {
    let a = start();
    let outside = tempfile::tempdir().unwrap();
    std::fs::write(outside.path().join("secret"), b"host secret").unwrap();
    let put = |path: &str, body: &[u8]| {
        call(
            &a,
            "PUT",
            &format!("/files?path={path}&mode=755"),
            Some(TOKEN),
            &[],
            body,
        )
    };
    let get = |path: &str| {
        call(
            &a,
            "GET",
            &format!("/files?path={path}"),
            Some(TOKEN),
            &[],
            b"",
        )
    };
    assert_eq!(put("src/a%20b.sh", b"#!/bin/sh\n").0, 200);
    assert_eq!(get("src/a%20b.sh"), (200, b"#!/bin/sh\n".to_vec()));
    let (status, list) = call(&a, "GET", "/list?path=src", Some(TOKEN), &[], b"");
    assert_eq!(status, 200);
    assert_eq!(list, b"file\x0010\x00755\x00a b.sh\x00".to_vec());
    for bad in ["../x", "%2Fetc%2Fpasswd", "src/../../x"] {
        let (status, body) = get(bad);
        assert_eq!(status, 403, "{bad}: {}", String::from_utf8_lossy(&body));
        assert!(String::from_utf8_lossy(&body).starts_with("path_outside_sandbox\n"));
        assert_eq!(put(bad, b"x").0, 403, "{bad}");
    }
    std::os::unix::fs::symlink(outside.path(), a.ws.path().join("out")).unwrap();
    std::os::unix::fs::symlink(outside.path().join("secret"), a.ws.path().join("s")).unwrap();
    assert_eq!(get("out/secret").0, 403);
    assert_eq!(get("s").0, 403);
    assert_eq!(put("out/new", b"x").0, 403);
    assert_eq!(put("s", b"overwrite").0, 403);
    assert!(!outside.path().join("new").exists());
    assert_eq!(
        std::fs::read(outside.path().join("secret")).unwrap(),
        b"host secret"
    );
    assert_eq!(get("missing").0, 404);
    let (status, _) = call(
        &a,
        "DELETE",
        "/files?path=src&recursive=1",
        Some(TOKEN),
        &[],
        b"",
    );
    assert_eq!(status, 200);
    assert!(!a.ws.path().join("src").exists());
}

//! `envd-agent`: the first process of every exec inside a local sandbox.
//!
//! It runs as the sandbox's user inside the sandbox's namespaces (no network but loopback)
//! as pid 1 of the sandbox's PID namespace (bubblewrap's `--as-pid-1`: it reaps every
//! orphan, and when it exits the kernel kills everything left in the namespace) and does
//! two things: opens the gateway forward — a TCP listener on the sandbox's
//! loopback whose connections it relays to a unix socket that envd bind-mounted in and
//! serves on the host side, connected to graft's gateway — and runs the command, exiting
//! with its status (`128 + signal` when a signal ended it). No process outlives its exec.
//!
//! Usage: `envd-agent [--forward 127.0.0.1:PORT=/path/to.sock] -- PROGRAM [ARGS...]`
//!
//! std + rustix only: `cargo build --release -p graft-envd-agent --example envd-agent
//! --target x86_64-unknown-linux-musl` gives a static binary for any root filesystem.

use std::net::{SocketAddr, TcpListener, TcpStream};
use std::os::unix::net::UnixStream;
use std::path::PathBuf;

#[derive(Debug, Clone, PartialEq)]
pub struct AgentArgs {
    pub forward: Option<(SocketAddr, PathBuf)>,
    pub argv: Vec<String>,
}

/// Parses the agent's arguments (the ones after `envd-agent` or `graft envd agent`).
pub fn parse_args(args: &[String]) -> Result<AgentArgs, String> {
    let mut forward = None;
    let mut it = args.iter();
    while let Some(a) = it.next() {
        match a.as_str() {
            "--forward" => {
                let v = it
                    .next()
                    .ok_or("--forward needs a value: 127.0.0.1:PORT=/path/to.sock")?;
                let (addr, sock) = v
                    .split_once('=')
                    .ok_or_else(|| format!("--forward '{v}': expected ADDR=SOCKET"))?;
                let addr: SocketAddr = addr
                    .parse()
                    .map_err(|e| format!("--forward '{v}': '{addr}' is not an address: {e}"))?;
                forward = Some((addr, PathBuf::from(sock)));
            }
            "--" => {
                let argv: Vec<String> = it.cloned().collect();
                if argv.is_empty() {
                    return Err("no command after --".to_owned());
                }
                return Ok(AgentArgs { forward, argv });
            }
            other => {
                return Err(format!(
                    "unknown argument '{other}'; usage: envd-agent [--forward ADDR=SOCKET] -- PROGRAM [ARGS...]"
                ));
            }
        }
    }
    Err("no command; usage: envd-agent [--forward ADDR=SOCKET] -- PROGRAM [ARGS...]".to_owned())
}

fn relay(tcp: TcpStream, sock: &std::path::Path) {
    let unix = match UnixStream::connect(sock) {
        Ok(u) => u,
        Err(e) => {
            eprintln!(
                "envd-agent: the gateway forward {} is unreachable: {e}",
                sock.display()
            );
            return;
        }
    };
    let (Ok(mut tcp_r), Ok(mut unix_r)) = (tcp.try_clone(), unix.try_clone()) else {
        return;
    };
    let (mut tcp_w, mut unix_w) = (tcp, unix);
    let up = std::thread::spawn(move || {
        let _ = std::io::copy(&mut tcp_r, &mut unix_w);
        let _ = unix_w.shutdown(std::net::Shutdown::Write);
    });
    let _ = std::io::copy(&mut unix_r, &mut tcp_w);
    let _ = tcp_w.shutdown(std::net::Shutdown::Write);
    let _ = up.join();
}

fn start_forward(addr: SocketAddr, sock: PathBuf) {
    let listener = match TcpListener::bind(addr) {
        Ok(l) => l,
        Err(e) => {
            eprintln!("envd-agent: cannot listen on {addr} for the gateway forward: {e}");
            return;
        }
    };
    std::thread::spawn(move || {
        for conn in listener.incoming() {
            let Ok(conn) = conn else { continue };
            let sock = sock.clone();
            std::thread::spawn(move || relay(conn, &sock));
        }
    });
}

/// Runs the agent; returns the exit code to exit with.
pub fn run(args: AgentArgs) -> i32 {
    if let Some((addr, sock)) = args.forward {
        start_forward(addr, sock);
    }
    let Some((prog, rest)) = args.argv.split_first() else {
        return 127;
    };
    let child = match std::process::Command::new(prog).args(rest).spawn() {
        Ok(c) => c,
        Err(e) => {
            eprintln!("envd-agent: cannot run '{prog}': {e}");
            return if e.kind() == std::io::ErrorKind::NotFound {
                127
            } else {
                126
            };
        }
    };
    let main_pid = child.id() as i32;
    // As the sandbox's pid 1 the agent is the reaper of every orphan: wait for any child
    // (so orphans never pile up as zombies against the pids limit) until the command's.
    loop {
        match rustix::process::wait(rustix::process::WaitOptions::empty()) {
            Ok(Some((pid, status))) if pid.as_raw_nonzero().get() == main_pid => {
                return match (status.exit_status(), status.terminating_signal()) {
                    (Some(c), _) => c,
                    (None, Some(sig)) => 128 + sig,
                    (None, None) => 1,
                };
            }
            Ok(_) => {}
            Err(rustix::io::Errno::INTR) => {}
            Err(e) => {
                eprintln!("envd-agent: waiting for '{prog}' failed: {e}");
                return 1;
            }
        }
    }
}

/// `main` of the standalone binary and of `graft envd agent`.
pub fn main_with(args: &[String]) -> i32 {
    match parse_args(args) {
        Ok(a) => run(a),
        Err(e) => {
            eprintln!("envd-agent: {e}");
            2
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn s(v: &[&str]) -> Vec<String> {
        v.iter().map(|x| x.to_string()).collect()
    }

    #[test]
    fn parses_forward_and_command() {
        let a = parse_args(&s(&[
            "--forward",
            "127.0.0.1:4000=/run/g.sock",
            "--",
            "sh",
            "-c",
            "echo --forward",
        ]))
        .unwrap();
        assert_eq!(a.argv, s(&["sh", "-c", "echo --forward"]));
        assert_eq!(
            a.forward,
            Some((
                "127.0.0.1:4000".parse().unwrap(),
                PathBuf::from("/run/g.sock")
            ))
        );
        assert!(parse_args(&s(&["--"])).is_err());
        assert!(parse_args(&s(&["--forward", "nope", "--", "x"])).is_err());
        assert!(parse_args(&s(&["x"])).is_err());
    }

    #[test]
    fn exit_status_and_signals_are_reported() {
        assert_eq!(
            run(parse_args(&s(&["--", "sh", "-c", "exit 7"])).unwrap()),
            7
        );
        assert_eq!(
            run(parse_args(&s(&["--", "sh", "-c", "kill -9 $$"])).unwrap()),
            137
        );
        assert_eq!(
            run(parse_args(&s(&["--", "/nonexistent/prog"])).unwrap()),
            127
        );
    }

    #[test]
    fn forward_relays_tcp_to_the_unix_socket() {
        use std::io::{Read, Write};
        let dir = tempfile::tempdir().unwrap();
        let sock = dir.path().join("g.sock");
        let ul = std::os::unix::net::UnixListener::bind(&sock).unwrap();
        std::thread::spawn(move || {
            let (mut c, _) = ul.accept().unwrap();
            let mut buf = [0u8; 5];
            c.read_exact(&mut buf).unwrap();
            c.write_all(&buf.iter().rev().copied().collect::<Vec<_>>())
                .unwrap();
        });
        // Pick a free port, then forward it.
        let port = TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let addr: SocketAddr = format!("127.0.0.1:{port}").parse().unwrap();
        start_forward(addr, sock);
        let mut c = TcpStream::connect(addr).unwrap();
        c.write_all(b"hello").unwrap();
        let mut out = [0u8; 5];
        c.read_exact(&mut out).unwrap();
        assert_eq!(&out, b"olleh");
    }
}

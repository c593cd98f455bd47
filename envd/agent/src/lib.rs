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
//! Usage: `envd-agent [--forward 127.0.0.1:PORT=/path/to.sock] [--die-with-envd] -- PROGRAM [ARGS...]`
//!
//! `--die-with-envd` (the local backend passes it) ends the exec when envd is gone: the
//! agent's stdout is a pipe only envd reads, so when envd dies (even by SIGKILL, even before
//! bubblewrap could arm `--die-with-parent`, whose parent-death signal only fires for a
//! parent alive when it was set) the pipe's write end reports an error and the agent exits,
//! which takes the sandbox's PID namespace down with it.
//!
//! In the Kubernetes backend the same binary is the sandbox container's entrypoint in
//! server mode (`envd-agent serve`, see [`server`]): it answers envd over HTTP on the
//! Pod IP, authenticated by the sandbox's own token, and runs each exec under itself in
//! shim mode (`envd-agent --subreaper -- PROGRAM ...`: a child subreaper that gathers the
//! exec's orphans and kills whatever is left when the command ends). An init container
//! puts it into the Pod with `envd-agent install DEST`.
//!
//! std + rustix only: `cargo build --release -p graft-envd-agent --example envd-agent
//! --target x86_64-unknown-linux-musl` gives a static binary for any root filesystem.

use std::net::{SocketAddr, TcpListener, TcpStream};
use std::os::unix::net::UnixStream;
use std::path::PathBuf;

pub mod path;
pub mod server;
pub mod tree;
pub mod workspace;

/// Where the gateway forward relays to: envd's unix socket (local backend) or the
/// gateway's address (Kubernetes backend, allowed by the sandbox's NetworkPolicy).
#[derive(Debug, Clone, PartialEq)]
pub enum ForwardTarget {
    Unix(PathBuf),
    Tcp(SocketAddr),
}

impl ForwardTarget {
    /// `/path/to.sock` or `HOST_IP:PORT`.
    pub fn parse(v: &str) -> Result<Self, String> {
        if v.starts_with('/') {
            return Ok(ForwardTarget::Unix(PathBuf::from(v)));
        }
        v.parse().map(ForwardTarget::Tcp).map_err(|e| {
            format!("'{v}' is neither a socket path (/...) nor an IP:PORT address: {e}")
        })
    }
}

#[derive(Debug, Clone, PartialEq)]
pub struct AgentArgs {
    pub forward: Option<(SocketAddr, ForwardTarget)>,
    /// Shim mode: become a child subreaper and kill what is left of the command's
    /// process tree when it ends (when the agent is not a PID namespace's pid 1).
    pub subreaper: bool,
    /// Exit (and so end the sandbox's PID namespace) once the reader of this process's
    /// stdout, envd, is gone.
    pub die_with_envd: bool,
    pub argv: Vec<String>,
}

/// `ADDR=TARGET` of `--forward`.
pub fn parse_forward(v: &str) -> Result<(SocketAddr, ForwardTarget), String> {
    let (addr, target) = v
        .split_once('=')
        .ok_or_else(|| format!("--forward '{v}': expected ADDR=SOCKET or ADDR=IP:PORT"))?;
    let addr: SocketAddr = addr
        .parse()
        .map_err(|e| format!("--forward '{v}': '{addr}' is not an address: {e}"))?;
    let target = ForwardTarget::parse(target).map_err(|e| format!("--forward '{v}': {e}"))?;
    Ok((addr, target))
}

/// Parses the agent's arguments (the ones after `envd-agent` or `graft envd agent`).
pub fn parse_args(args: &[String]) -> Result<AgentArgs, String> {
    let mut forward = None;
    let mut subreaper = false;
    let mut die_with_envd = false;
    let mut it = args.iter();
    while let Some(a) = it.next() {
        match a.as_str() {
            "--forward" => {
                let v = it
                    .next()
                    .ok_or("--forward needs a value: 127.0.0.1:PORT=/path/to.sock")?;
                forward = Some(parse_forward(v)?);
            }
            "--subreaper" => subreaper = true,
            "--die-with-envd" => die_with_envd = true,
            "--" => {
                let argv: Vec<String> = it.cloned().collect();
                if argv.is_empty() {
                    return Err("no command after --".to_owned());
                }
                return Ok(AgentArgs {
                    forward,
                    subreaper,
                    die_with_envd,
                    argv,
                });
            }
            other => {
                return Err(format!(
                    "unknown argument '{other}'; usage: envd-agent [--forward ADDR=SOCKET] [--die-with-envd] -- PROGRAM [ARGS...]"
                ));
            }
        }
    }
    Err("no command; usage: envd-agent [--forward ADDR=SOCKET] [--die-with-envd] -- PROGRAM [ARGS...]".to_owned())
}

/// A stream the forward relays to, split into halves.
trait Duplex: std::io::Read + std::io::Write + Send + Sized + 'static {
    fn split(&self) -> std::io::Result<Self>;
    fn close_write(&self);
}

impl Duplex for TcpStream {
    fn split(&self) -> std::io::Result<Self> {
        self.try_clone()
    }
    fn close_write(&self) {
        let _ = self.shutdown(std::net::Shutdown::Write);
    }
}

impl Duplex for UnixStream {
    fn split(&self) -> std::io::Result<Self> {
        self.try_clone()
    }
    fn close_write(&self) {
        let _ = self.shutdown(std::net::Shutdown::Write);
    }
}

fn pipe<S: Duplex>(tcp: TcpStream, out: S) {
    let (Ok(mut tcp_r), Ok(mut out_r)) = (tcp.try_clone(), out.split()) else {
        return;
    };
    let (mut tcp_w, mut out_w) = (tcp, out);
    let up = std::thread::spawn(move || {
        let _ = std::io::copy(&mut tcp_r, &mut out_w);
        out_w.close_write();
    });
    let _ = std::io::copy(&mut out_r, &mut tcp_w);
    tcp_w.close_write();
    let _ = up.join();
}

fn relay(tcp: TcpStream, target: &ForwardTarget) {
    let r = match target {
        ForwardTarget::Unix(sock) => UnixStream::connect(sock).map(|u| pipe(tcp, u)),
        ForwardTarget::Tcp(addr) => TcpStream::connect(addr).map(|t| {
            let _ = t.set_nodelay(true);
            pipe(tcp, t)
        }),
    };
    if let Err(e) = r {
        eprintln!("envd-agent: the gateway forward to {target:?} is unreachable: {e}");
    }
}

fn start_forward(addr: SocketAddr, target: ForwardTarget) {
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
            let target = target.clone();
            std::thread::spawn(move || relay(conn, &target));
        }
    });
}

/// Whether the pipe behind `fd` has lost its last reader (or `fd` is closed): a pipe's write
/// end polls as `POLLERR` once no process holds its read end. Blocks until then when
/// `wait`, else answers at once.
pub fn reader_gone(fd: std::os::fd::BorrowedFd<'_>, wait: bool) -> bool {
    use rustix::event::{PollFd, PollFlags, Timespec};
    let now = Timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    loop {
        // No events asked for: poll reports only the error and hang-up conditions.
        let mut fds = [PollFd::from_borrowed_fd(fd, PollFlags::empty())];
        match rustix::event::poll(&mut fds, if wait { None } else { Some(&now) }) {
            Ok(_) => {
                let got = fds[0].revents();
                return got.intersects(PollFlags::ERR | PollFlags::HUP | PollFlags::NVAL);
            }
            Err(rustix::io::Errno::INTR) => {}
            // Not pollable: nothing to watch.
            Err(_) => return false,
        }
    }
}

/// `--die-with-envd`: a thread that waits for envd (the only reader of stdout) to be gone,
/// then kills the agent's descendants and exits (as the sandbox's pid 1 the exit alone
/// would end them; the kill also covers an agent that is not). Nothing is printed:
/// stderr's reader is gone too.
fn watch_envd() {
    std::thread::spawn(|| {
        use std::os::fd::AsFd;
        let stdout = std::io::stdout();
        if reader_gone(stdout.as_fd(), true) {
            let me = rustix::process::getpid().as_raw_nonzero().get();
            tree::kill_descendants(me, &|| {});
            std::process::exit(128 + 9);
        }
    });
}

/// Runs the agent; returns the exit code to exit with.
pub fn run(args: AgentArgs) -> i32 {
    if args.die_with_envd {
        watch_envd();
    }
    if let Some((addr, target)) = args.forward {
        start_forward(addr, target);
    }
    if args.subreaper {
        // Orphans of the command are reparented to this process (not to the container's
        // pid 1), so they can be found and killed when the command ends.
        if let Err(e) = rustix::process::set_child_subreaper(Some(rustix::process::getpid())) {
            eprintln!("envd-agent: cannot become a child subreaper: {e}");
            return 125;
        }
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
                let code = match (status.exit_status(), status.terminating_signal()) {
                    (Some(c), _) => c,
                    (None, Some(sig)) => 128 + sig,
                    (None, None) => 1,
                };
                if args.subreaper {
                    // No process outlives its exec (as with a PID namespace's pid 1).
                    let me = rustix::process::getpid().as_raw_nonzero().get();
                    tree::kill_descendants(me, &|| {
                        while let Ok(Some(_)) =
                            rustix::process::wait(rustix::process::WaitOptions::NOHANG)
                        {
                        }
                    });
                }
                return code;
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

/// `main` of the standalone binary and of `graft envd agent`: `serve ...` (server mode),
/// `install DEST` (copy this binary, for an init container), or the exec mode.
pub fn main_with(args: &[String]) -> i32 {
    match args.first().map(String::as_str) {
        Some("serve") => return server::main(&args[1..]),
        Some("install") => return install(&args[1..]),
        _ => {}
    }
    match parse_args(args) {
        Ok(a) => run(a),
        Err(e) => {
            eprintln!("envd-agent: {e}");
            2
        }
    }
}

/// `install DEST`: copies this executable to DEST (mode 755, atomically). The Kubernetes
/// backend's init container runs it from the agent image (which needs no shell or `cp`)
/// to put the agent into the Pod's `emptyDir`.
fn install(args: &[String]) -> i32 {
    let [dest] = args else {
        eprintln!("envd-agent: usage: envd-agent install DEST");
        return 2;
    };
    let dest = PathBuf::from(dest);
    let tmp = dest.with_extension("envd-agent-tmp");
    let r = std::env::current_exe()
        .and_then(|me| std::fs::copy(me, &tmp))
        .and_then(|_| {
            use std::os::unix::fs::PermissionsExt;
            std::fs::set_permissions(&tmp, std::fs::Permissions::from_mode(0o755))
        })
        .and_then(|()| std::fs::rename(&tmp, &dest));
    match r {
        Ok(()) => 0,
        Err(e) => {
            eprintln!("envd-agent: cannot install to {}: {e}", dest.display());
            1
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
                ForwardTarget::Unix(PathBuf::from("/run/g.sock"))
            ))
        );
        assert!(!a.subreaper);
        let a = parse_args(&s(&[
            "--subreaper",
            "--forward",
            "127.0.0.1:4000=10.0.0.7:8400",
            "--",
            "x",
        ]))
        .unwrap();
        assert!(a.subreaper);
        assert!(!a.die_with_envd);
        assert!(
            parse_args(&s(&["--die-with-envd", "--", "x"]))
                .unwrap()
                .die_with_envd
        );
        assert_eq!(
            a.forward.unwrap().1,
            ForwardTarget::Tcp("10.0.0.7:8400".parse().unwrap())
        );
        assert!(parse_args(&s(&["--"])).is_err());
        assert!(parse_args(&s(&["--forward", "nope", "--", "x"])).is_err());
        assert!(parse_args(&s(&["x"])).is_err());
    }

    #[test]
    fn a_pipe_whose_reader_is_gone_is_noticed() {
        use std::os::fd::AsFd;
        let (reader, writer) = std::io::pipe().unwrap();
        assert!(
            !reader_gone(writer.as_fd(), false),
            "the reader is still open"
        );
        drop(reader);
        assert!(reader_gone(writer.as_fd(), false));
        assert!(reader_gone(writer.as_fd(), true), "waiting returns at once");
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
        start_forward(addr, ForwardTarget::Unix(sock));
        let mut c = TcpStream::connect(addr).unwrap();
        c.write_all(b"hello").unwrap();
        let mut out = [0u8; 5];
        c.read_exact(&mut out).unwrap();
        assert_eq!(&out, b"olleh");
    }

    #[test]
    fn forward_relays_tcp_to_a_tcp_gateway() {
        use std::io::{Read, Write};
        // The Kubernetes backend's case: the gateway is an IP:PORT the Pod may reach.
        let gw = TcpListener::bind("127.0.0.1:0").unwrap();
        let target = ForwardTarget::parse(&gw.local_addr().unwrap().to_string()).unwrap();
        std::thread::spawn(move || {
            let (mut c, _) = gw.accept().unwrap();
            let mut buf = [0u8; 4];
            c.read_exact(&mut buf).unwrap();
            c.write_all(&buf.map(|b| b.to_ascii_uppercase())).unwrap();
        });
        let port = TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let addr: SocketAddr = format!("127.0.0.1:{port}").parse().unwrap();
        start_forward(addr, target);
        let mut c = TcpStream::connect(addr).unwrap();
        c.write_all(b"ping").unwrap();
        let mut out = [0u8; 4];
        c.read_exact(&mut out).unwrap();
        assert_eq!(&out, b"PING");
        assert!(ForwardTarget::parse("gateway.svc:80").is_err());
    }
}

//! Server mode (`envd-agent serve`): the agent as the entrypoint of a Kubernetes sandbox
//! Pod, answering envd over HTTP/1.1 on the Pod IP. Every route but `/healthz` needs the
//! sandbox's own token (`Authorization: Bearer TOKEN`; the token comes from an environment
//! variable, never from argv). std + rustix only: one thread per connection, one request
//! per connection, bodies sized by `Content-Length`.
//!
//! Routes (envd is the only client; the formats avoid needing JSON):
//! - `GET /healthz` → `ok` (the Pod's readiness probe).
//! - `POST /exec?job=ID` — headers `x-envd-timeout-ms`, `x-envd-grace-ms`,
//!   `x-envd-max-output`, `x-envd-cwd` (percent-encoded), `x-envd-stdin: 1`; body: the
//!   argv count, the args, the env count and `K=V` pairs, each NUL-terminated, then the
//!   stdin bytes. The answer streams frames `[kind u8][len u32 BE][bytes]` until the
//!   connection closes: 1 stdout, 2 stderr (each at most `max-output` bytes in all), 3 the
//!   result (`key=value` lines: `exit_code`, `stdout_bytes`, `stderr_bytes`, `timed_out`,
//!   `killed`, `error`). On timeout the command's tree gets SIGTERM, then after the grace
//!   SIGKILL until none is left; the result is sent only then.
//! - `POST /kill?job=ID` — kill a running exec now.
//! - `GET|PUT|DELETE /files?path=REL` (`max=` bytes for GET, `mode=` octal for PUT,
//!   `recursive=1` for DELETE), `GET /list?path=REL` (records of four NUL-terminated
//!   fields: kind, size, mode (octal), name). Errors are `TYPE\nMESSAGE` with the status envd should answer with.

use std::collections::{HashMap, HashSet};
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::workspace::{FsError, Workspace};

/// The environment variable that holds the token, unless `--token-env` names another.
pub const TOKEN_ENV: &str = "GRAFT_ENVD_AGENT_TOKEN";
const PATH_IN: &str = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";
const MAX_HEAD: usize = 64 * 1024;

pub const FRAME_STDOUT: u8 = 1;
pub const FRAME_STDERR: u8 = 2;
pub const FRAME_RESULT: u8 = 3;

#[derive(Debug, Clone)]
pub struct ServeOptions {
    pub listen: SocketAddr,
    pub workspace: PathBuf,
    pub token: String,
    /// This binary, run in shim mode for every exec.
    pub exe: PathBuf,
    pub sandbox_id: String,
    pub forward: Option<(SocketAddr, crate::ForwardTarget)>,
    pub max_body_bytes: usize,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// Parses `serve` arguments; the token is read from the environment.
pub fn parse_serve_args(
    args: &[String],
    env: &dyn Fn(&str) -> Option<String>,
) -> Result<ServeOptions, String> {
    let usage = "usage: envd-agent serve --listen ADDR --workspace DIR [--sandbox-id ID] [--forward ADDR=TARGET] [--token-env NAME] [--max-body-bytes N]";
    let mut listen = None;
    let mut workspace = None;
    let mut sandbox_id = String::new();
    let mut forward = None;
    let mut token_env = TOKEN_ENV.to_owned();
    let mut max_body_bytes = 64 << 20;
    let mut it = args.iter();
    while let Some(a) = it.next() {
        let mut val = || {
            it.next()
                .cloned()
                .ok_or_else(|| format!("{a} needs a value; {usage}"))
        };
        match a.as_str() {
            "--listen" => {
                let v = val()?;
                listen = Some(
                    v.parse::<SocketAddr>()
                        .map_err(|e| format!("--listen '{v}': {e}"))?,
                );
            }
            "--workspace" => workspace = Some(PathBuf::from(val()?)),
            "--sandbox-id" => sandbox_id = val()?,
            "--forward" => forward = Some(crate::parse_forward(&val()?)?),
            "--token-env" => token_env = val()?,
            "--max-body-bytes" => {
                let v = val()?;
                max_body_bytes = v
                    .parse()
                    .map_err(|e| format!("--max-body-bytes '{v}': {e}"))?;
            }
            other => return Err(format!("unknown argument '{other}'; {usage}")),
        }
    }
    let token = env(&token_env).unwrap_or_default();
    if token.len() < 16 {
        return Err(format!(
            "the token in ${token_env} is missing or shorter than 16 characters; envd puts the sandbox's token there"
        ));
    }
    Ok(ServeOptions {
        listen: listen.ok_or_else(|| format!("--listen is required; {usage}"))?,
        workspace: workspace.ok_or_else(|| format!("--workspace is required; {usage}"))?,
        token,
        exe: std::env::current_exe().map_err(|e| format!("cannot find this executable: {e}"))?,
        sandbox_id,
        forward,
        max_body_bytes,
    })
}

/// `envd-agent serve ...`
pub fn main(args: &[String]) -> i32 {
    let opts = match parse_serve_args(args, &|k| std::env::var(k).ok()) {
        Ok(o) => o,
        Err(e) => {
            eprintln!("envd-agent: {e}");
            return 2;
        }
    };
    let listener = match TcpListener::bind(opts.listen) {
        Ok(l) => l,
        Err(e) => {
            eprintln!("envd-agent: cannot listen on {}: {e}", opts.listen);
            return 1;
        }
    };
    match Server::new(opts) {
        Ok(s) => {
            if let Ok(a) = listener.local_addr() {
                println!("envd-agent listening on {a}");
                let _ = std::io::stdout().flush();
            }
            s.serve(listener);
            0
        }
        Err(e) => {
            eprintln!("envd-agent: {e}");
            1
        }
    }
}

struct Job {
    kill: mpsc::Sender<Msg>,
}

enum Msg {
    Exited(Option<std::process::ExitStatus>),
    Kill,
}

/// The agent's state: the workspace handle and the running execs.
pub struct Server {
    opts: ServeOptions,
    ws: Workspace,
    jobs: Mutex<HashMap<String, Job>>,
    /// Shims being waited for by their exec threads (the zombie reaper leaves them).
    shims: Mutex<HashSet<i32>>,
}

impl Server {
    pub fn new(opts: ServeOptions) -> Result<Arc<Self>, String> {
        let ws = Workspace::open(&opts.workspace).map_err(|e| {
            format!(
                "cannot open the workspace {}: {e}",
                opts.workspace.display()
            )
        })?;
        // An exec's shim killed before its children would leave them to the container's
        // pid 1; as a subreaper they come here instead, and are reaped below.
        let _ = rustix::process::set_child_subreaper(Some(rustix::process::getpid()));
        Ok(Arc::new(Server {
            opts,
            ws,
            jobs: Mutex::new(HashMap::new()),
            shims: Mutex::new(HashSet::new()),
        }))
    }

    /// Accepts connections forever (one thread each).
    pub fn serve(self: Arc<Self>, listener: TcpListener) {
        if let Some((addr, target)) = self.opts.forward.clone() {
            crate::start_forward(addr, target);
        }
        {
            let me = self.clone();
            std::thread::spawn(move || {
                loop {
                    std::thread::sleep(Duration::from_millis(500));
                    let shims = lock(&me.shims);
                    crate::tree::reap_zombies_except(&|p| shims.contains(&p));
                }
            });
        }
        for conn in listener.incoming() {
            let Ok(conn) = conn else { continue };
            let me = self.clone();
            std::thread::spawn(move || me.connection(conn));
        }
    }

    fn connection(&self, mut conn: TcpStream) {
        let _ = conn.set_nodelay(true);
        let _ = conn.set_read_timeout(Some(Duration::from_secs(60)));
        let req = match read_request(&mut conn, self.opts.max_body_bytes) {
            Ok(r) => r,
            Err((status, msg)) => {
                respond_error(&mut conn, status, "invalid_request", &msg);
                return;
            }
        };
        if req.method == "GET" && req.path == "/healthz" {
            respond(&mut conn, 200, "text/plain", b"ok");
            return;
        }
        if !self.authorized(&req) {
            respond_error(
                &mut conn,
                401,
                "unauthorized",
                "missing or wrong sandbox token (Authorization: Bearer TOKEN)",
            );
            return;
        }
        let r = match (req.method.as_str(), req.path.as_str()) {
            ("POST", "/exec") => {
                self.exec(req, conn);
                return;
            }
            ("POST", "/kill") => {
                let job = req.query("job").unwrap_or_default();
                match lock(&self.jobs).get(&job) {
                    Some(j) => {
                        let _ = j.kill.send(Msg::Kill);
                        Ok((200, "text/plain", b"killed".to_vec()))
                    }
                    None => Err(FsError {
                        status: 404,
                        kind: "job_not_found",
                        message: format!("no running job '{job}' in this sandbox"),
                    }),
                }
            }
            ("GET", "/files") => {
                let max = req
                    .query("max")
                    .and_then(|m| m.parse().ok())
                    .unwrap_or(self.opts.max_body_bytes as u64);
                self.ws
                    .read(&req.query("path").unwrap_or_default(), max)
                    .map(|d| (200, "application/octet-stream", d))
            }
            ("PUT", "/files") => {
                let mode = match req.query("mode") {
                    None => Ok(0o644),
                    Some(m) => u32::from_str_radix(&m, 8)
                        .ok()
                        .filter(|m| *m <= 0o7777)
                        .ok_or_else(|| FsError::bad_request(format!("mode '{m}' is not octal"))),
                };
                mode.and_then(|mode| {
                    self.ws
                        .write(&req.query("path").unwrap_or_default(), &req.body, mode)
                })
                .map(|n| (200, "text/plain", n.to_string().into_bytes()))
            }
            ("DELETE", "/files") => {
                let recursive = req
                    .query("recursive")
                    .is_some_and(|v| v == "1" || v == "true");
                self.ws
                    .remove(&req.query("path").unwrap_or_default(), recursive)
                    .map(|()| (200, "text/plain", b"deleted".to_vec()))
            }
            ("GET", "/list") => {
                self.ws
                    .list(&req.query("path").unwrap_or_default())
                    .map(|entries| {
                        let mut out = Vec::new();
                        for e in entries {
                            out.extend_from_slice(
                                format!("{}\0{}\0{:o}\0{}\0", e.kind, e.size, e.mode, e.name)
                                    .as_bytes(),
                            );
                        }
                        (200, "application/octet-stream", out)
                    })
            }
            (m, p) => Err(FsError {
                status: 404,
                kind: "no_route",
                message: format!("the agent has no route {m} {p}"),
            }),
        };
        match r {
            Ok((status, ct, body)) => respond(&mut conn, status, ct, &body),
            Err(e) => respond_error(&mut conn, e.status, e.kind, &e.message),
        }
    }

    fn authorized(&self, req: &Request) -> bool {
        let Some(got) = req
            .header("authorization")
            .and_then(|v| v.strip_prefix("Bearer ").map(str::to_owned))
        else {
            return false;
        };
        let (a, b) = (got.as_bytes(), self.opts.token.as_bytes());
        // Length leaks; the bytes do not (no early exit).
        a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
    }

    fn exec(&self, req: Request, mut conn: TcpStream) {
        let spec = match ExecSpec::decode(&req) {
            Ok(s) => s,
            Err(e) => {
                respond_error(&mut conn, 400, "invalid_request", &e);
                return;
            }
        };
        let job = req.query("job").unwrap_or_default();
        let head = "HTTP/1.1 200 OK\r\ncontent-type: application/x-envd-frames\r\nconnection: close\r\n\r\n";
        if conn.write_all(head.as_bytes()).is_err() {
            return;
        }
        let out = Arc::new(Mutex::new(conn));
        let result = self.run(&job, spec, &out);
        let _ = write_frame(&out, FRAME_RESULT, result.encode().as_bytes());
        let _ = lock(&out).shutdown(std::net::Shutdown::Both);
    }

    /// A path inside the sandbox with `/workspace` standing for the workspace directory
    /// (the same in a Pod; a temporary directory in tests).
    fn in_sandbox(&self, p: &str) -> PathBuf {
        match p.strip_prefix("/workspace") {
            Some(rest) if rest.is_empty() || rest.starts_with('/') => {
                self.opts.workspace.join(rest.trim_start_matches('/'))
            }
            _ => PathBuf::from(p),
        }
    }

    fn run(&self, job: &str, mut spec: ExecSpec, out: &Arc<Mutex<TcpStream>>) -> ExecResult {
        let mut result = ExecResult::default();
        let cwd = self.in_sandbox(&spec.cwd);
        if !cwd.is_dir() {
            result.exit_code = Some(126);
            result.error = Some(format!(
                "cwd '{}' is not a directory in the sandbox; create it first (e.g. exec `mkdir -p`)",
                spec.cwd
            ));
            return result;
        }
        let mut env: Vec<(String, String)> = vec![
            ("PATH".into(), PATH_IN.into()),
            (
                "HOME".into(),
                self.in_sandbox("/workspace").display().to_string(),
            ),
            ("LANG".into(), "C.UTF-8".into()),
            ("GRAFT_SANDBOX_ID".into(), self.opts.sandbox_id.clone()),
        ];
        env.extend(spec.env.iter().cloned());
        let mut cmd = Command::new(&self.opts.exe);
        cmd.arg("--subreaper")
            .arg("--")
            .args(&spec.argv)
            .env_clear()
            .envs(env)
            .current_dir(&cwd)
            .stdin(if spec.stdin.is_some() {
                Stdio::piped()
            } else {
                Stdio::null()
            })
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        let started = Instant::now();
        let (tx, rx) = mpsc::channel();
        let mut child: Child = {
            let mut shims = lock(&self.shims);
            match cmd.spawn() {
                Ok(c) => {
                    shims.insert(c.id() as i32);
                    c
                }
                Err(e) => {
                    result.exit_code = Some(126);
                    result.error = Some(format!("cannot start the exec: {e}"));
                    return result;
                }
            }
        };
        let shim = child.id() as i32;
        lock(&self.jobs).insert(job.to_owned(), Job { kill: tx.clone() });
        if let (Some(mut w), Some(data)) = (child.stdin.take(), spec.stdin.take()) {
            std::thread::spawn(move || {
                let _ = w.write_all(&data);
            });
        }
        let gone = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let (done_tx, done_rx) = mpsc::channel::<()>();
        let pump = |r: Option<Box<dyn Read + Send>>, kind: u8| {
            let out = out.clone();
            let gone = gone.clone();
            let tx = tx.clone();
            let done = done_tx.clone();
            let total = Arc::new(AtomicU64::new(0));
            let counted = total.clone();
            let cap = spec.max_output;
            std::thread::spawn(move || {
                let mut kept = 0usize;
                if let Some(mut r) = r {
                    let mut buf = vec![0u8; 64 * 1024];
                    loop {
                        let n = match r.read(&mut buf) {
                            Ok(0) | Err(_) => break,
                            Ok(n) => n,
                        };
                        counted.fetch_add(n as u64, Ordering::SeqCst);
                        if kept < cap {
                            let take = n.min(cap - kept);
                            kept += take;
                            if write_frame(&out, kind, &buf[..take]).is_err()
                                && !gone.swap(true, Ordering::SeqCst)
                            {
                                // envd went away: nobody can collect the result.
                                let _ = tx.send(Msg::Kill);
                            }
                        }
                    }
                }
                let _ = done.send(());
            });
            total
        };
        let out_total = pump(
            child
                .stdout
                .take()
                .map(|r| Box::new(r) as Box<dyn Read + Send>),
            FRAME_STDOUT,
        );
        let err_total = pump(
            child
                .stderr
                .take()
                .map(|r| Box::new(r) as Box<dyn Read + Send>),
            FRAME_STDERR,
        );
        drop(done_tx);
        let waiter = {
            let tx = tx.clone();
            std::thread::spawn(move || {
                let s = child.wait().ok();
                let _ = tx.send(Msg::Exited(s));
            })
        };
        drop(tx);
        let deadline = started + spec.timeout;
        let left = deadline.saturating_duration_since(Instant::now());
        let status = match rx.recv_timeout(left) {
            Ok(Msg::Exited(s)) => s,
            Ok(Msg::Kill) => {
                result.killed = true;
                terminate(shim, Duration::ZERO, &rx)
            }
            Err(mpsc::RecvTimeoutError::Timeout) => {
                result.timed_out = true;
                terminate(shim, spec.grace, &rx)
            }
            Err(mpsc::RecvTimeoutError::Disconnected) => None,
        };
        let _ = waiter.join();
        lock(&self.shims).remove(&shim);
        lock(&self.jobs).remove(job);
        // The pipes close when the tree is gone; a process that escaped it (it cannot,
        // short of ptrace) would hold them open: wait a bounded time, then answer anyway.
        let until = Instant::now() + Duration::from_secs(5);
        for _ in 0..2 {
            if done_rx
                .recv_timeout(until.saturating_duration_since(Instant::now()))
                .is_err()
            {
                result.error = Some(
                    "the exec's output pipes stayed open after it ended; output may be incomplete"
                        .to_owned(),
                );
                break;
            }
        }
        result.stdout_bytes = out_total.load(Ordering::SeqCst);
        result.stderr_bytes = err_total.load(Ordering::SeqCst);
        result.exit_code = status.map(|s| {
            use std::os::unix::process::ExitStatusExt;
            match (s.code(), s.signal()) {
                (Some(c), _) => i64::from(c),
                (None, Some(sig)) => 128 + i64::from(sig),
                _ => -1,
            }
        });
        result
    }
}

/// SIGTERM to the exec's processes (not the shim, which must stay to gather orphans),
/// `grace` for them to end, then SIGKILL to all of them until none is left, then the shim.
/// Returns the shim's status once the waiter has it.
fn terminate(
    shim: i32,
    grace: Duration,
    rx: &mpsc::Receiver<Msg>,
) -> Option<std::process::ExitStatus> {
    use crate::tree;
    use rustix::process::Signal;
    if !grace.is_zero() {
        for p in tree::descendants(shim) {
            tree::signal(p, Signal::TERM);
        }
        let until = Instant::now() + grace;
        if let Ok(Msg::Exited(s)) = rx.recv_timeout(until.saturating_duration_since(Instant::now()))
        {
            return s;
        }
    }
    tree::kill_descendants(shim, &|| {});
    tree::signal(shim, Signal::KILL);
    loop {
        match rx.recv_timeout(Duration::from_secs(10)) {
            Ok(Msg::Exited(s)) => return s,
            Ok(Msg::Kill) => continue,
            Err(_) => return None,
        }
    }
}

fn write_frame(out: &Arc<Mutex<TcpStream>>, kind: u8, data: &[u8]) -> std::io::Result<()> {
    let mut frame = Vec::with_capacity(5 + data.len());
    frame.push(kind);
    frame.extend_from_slice(&(data.len() as u32).to_be_bytes());
    frame.extend_from_slice(data);
    lock(out).write_all(&frame)
}

/// An exec as envd sends it.
#[derive(Debug, Clone, PartialEq)]
pub struct ExecSpec {
    pub argv: Vec<String>,
    pub env: Vec<(String, String)>,
    pub cwd: String,
    pub timeout: Duration,
    pub grace: Duration,
    pub max_output: usize,
    pub stdin: Option<Vec<u8>>,
}

impl ExecSpec {
    /// The request body (see the module docs); the scalars go in headers.
    pub fn encode_body(&self) -> Vec<u8> {
        let mut b = Vec::new();
        b.extend_from_slice(format!("{}\0", self.argv.len()).as_bytes());
        for a in &self.argv {
            b.extend_from_slice(a.as_bytes());
            b.push(0);
        }
        b.extend_from_slice(format!("{}\0", self.env.len()).as_bytes());
        for (k, v) in &self.env {
            b.extend_from_slice(format!("{k}={v}\0").as_bytes());
        }
        if let Some(s) = &self.stdin {
            b.extend_from_slice(s);
        }
        b
    }

    fn decode(req: &Request) -> Result<Self, String> {
        let num = |h: &str| -> Result<u64, String> {
            req.header(h)
                .ok_or_else(|| format!("header {h} is missing"))?
                .parse()
                .map_err(|e| format!("header {h}: {e}"))
        };
        let mut rest: &[u8] = &req.body;
        let mut field = || -> Result<String, String> {
            let end = rest
                .iter()
                .position(|&c| c == 0)
                .ok_or("the exec body ends early")?;
            let s = String::from_utf8(rest[..end].to_vec())
                .map_err(|_| "the exec body is not UTF-8".to_owned())?;
            rest = &rest[end + 1..];
            Ok(s)
        };
        let argc: usize = field()?.parse().map_err(|_| "bad argv count")?;
        let mut argv = Vec::new();
        for _ in 0..argc {
            argv.push(field()?);
        }
        let envc: usize = field()?.parse().map_err(|_| "bad env count")?;
        let mut env = Vec::new();
        for _ in 0..envc {
            let kv = field()?;
            let (k, v) = kv.split_once('=').ok_or("an env entry has no '='")?;
            env.push((k.to_owned(), v.to_owned()));
        }
        if argv.is_empty() {
            return Err("argv is empty".to_owned());
        }
        let stdin = (req.header("x-envd-stdin") == Some("1")).then(|| rest.to_vec());
        Ok(ExecSpec {
            argv,
            env,
            cwd: percent_decode(req.header("x-envd-cwd").unwrap_or("/workspace"))?,
            timeout: Duration::from_millis(num("x-envd-timeout-ms")?),
            grace: Duration::from_millis(num("x-envd-grace-ms").unwrap_or(2000)),
            max_output: num("x-envd-max-output")? as usize,
            stdin,
        })
    }
}

/// How an exec ended, as the result frame carries it.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ExecResult {
    pub exit_code: Option<i64>,
    pub stdout_bytes: u64,
    pub stderr_bytes: u64,
    pub timed_out: bool,
    pub killed: bool,
    pub error: Option<String>,
}

impl ExecResult {
    pub fn encode(&self) -> String {
        let mut s = String::new();
        if let Some(c) = self.exit_code {
            s.push_str(&format!("exit_code={c}\n"));
        }
        s.push_str(&format!(
            "stdout_bytes={}\nstderr_bytes={}\ntimed_out={}\nkilled={}\n",
            self.stdout_bytes, self.stderr_bytes, self.timed_out as u8, self.killed as u8
        ));
        if let Some(e) = &self.error {
            s.push_str(&format!("error={}\n", e.replace('\n', " ")));
        }
        s
    }

    pub fn decode(s: &str) -> Result<Self, String> {
        let mut r = ExecResult::default();
        for line in s.lines() {
            let (k, v) = line
                .split_once('=')
                .ok_or_else(|| format!("bad result line '{line}'"))?;
            let n = || v.parse::<u64>().map_err(|e| format!("{k}={v}: {e}"));
            match k {
                "exit_code" => r.exit_code = Some(v.parse().map_err(|e| format!("{k}: {e}"))?),
                "stdout_bytes" => r.stdout_bytes = n()?,
                "stderr_bytes" => r.stderr_bytes = n()?,
                "timed_out" => r.timed_out = v == "1",
                "killed" => r.killed = v == "1",
                "error" => r.error = Some(v.to_owned()),
                _ => {}
            }
        }
        Ok(r)
    }
}

struct Request {
    method: String,
    path: String,
    query: Vec<(String, String)>,
    headers: Vec<(String, String)>,
    body: Vec<u8>,
}

impl Request {
    fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.as_str())
    }

    fn query(&self, name: &str) -> Option<String> {
        self.query
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.clone())
    }
}

/// Percent-decoding (`+` is a space only in queries; the caller replaces it).
pub fn percent_decode(s: &str) -> Result<String, String> {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'%' {
            let hex = b
                .get(i + 1..i + 3)
                .and_then(|h| std::str::from_utf8(h).ok())
                .and_then(|h| u8::from_str_radix(h, 16).ok())
                .ok_or_else(|| format!("'{s}' has a bad percent escape"))?;
            out.push(hex);
            i += 3;
        } else {
            out.push(b[i]);
            i += 1;
        }
    }
    String::from_utf8(out).map_err(|_| format!("'{s}' is not UTF-8 once decoded"))
}

/// Percent-encodes everything but unreserved characters and `/`.
pub fn percent_encode(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for &b in s.as_bytes() {
        if b.is_ascii_alphanumeric() || b"-._~/".contains(&b) {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

fn read_request(conn: &mut TcpStream, max_body: usize) -> Result<Request, (u16, String)> {
    let mut buf = Vec::with_capacity(4096);
    let mut chunk = [0u8; 4096];
    let head_end = loop {
        if let Some(p) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            break p;
        }
        if buf.len() > MAX_HEAD {
            return Err((431, "the request head is too large".to_owned()));
        }
        let n = conn
            .read(&mut chunk)
            .map_err(|e| (400, format!("cannot read the request: {e}")))?;
        if n == 0 {
            return Err((
                400,
                "the connection closed before the request head".to_owned(),
            ));
        }
        buf.extend_from_slice(&chunk[..n]);
    };
    let head = std::str::from_utf8(&buf[..head_end])
        .map_err(|_| (400, "the request head is not UTF-8".to_owned()))?;
    let mut lines = head.split("\r\n");
    let first = lines.next().unwrap_or_default();
    let mut parts = first.split(' ');
    let (Some(method), Some(target)) = (parts.next(), parts.next()) else {
        return Err((400, format!("bad request line '{first}'")));
    };
    let mut headers = Vec::new();
    for l in lines {
        if let Some((k, v)) = l.split_once(':') {
            headers.push((k.trim().to_ascii_lowercase(), v.trim().to_owned()));
        }
    }
    let (path, q) = target.split_once('?').unwrap_or((target, ""));
    let mut query = Vec::new();
    for pair in q.split('&').filter(|p| !p.is_empty()) {
        let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
        query.push((
            k.to_owned(),
            percent_decode(&v.replace('+', " ")).map_err(|e| (400, e))?,
        ));
    }
    let mut req = Request {
        method: method.to_owned(),
        path: path.to_owned(),
        query,
        headers,
        body: Vec::new(),
    };
    if req.header("transfer-encoding").is_some() {
        return Err((411, "send the body with a Content-Length".to_owned()));
    }
    let len: usize = match req.header("content-length") {
        None => 0,
        Some(v) => v
            .parse()
            .map_err(|_| (400, format!("bad Content-Length '{v}'")))?,
    };
    if len > max_body {
        return Err((
            413,
            format!("the body is larger than the agent's limit of {max_body} bytes"),
        ));
    }
    let mut body = buf[head_end + 4..].to_vec();
    if body.len() < len {
        let mut rest = vec![0u8; len - body.len()];
        conn.read_exact(&mut rest)
            .map_err(|e| (400, format!("cannot read the body: {e}")))?;
        body.extend_from_slice(&rest);
    }
    body.truncate(len);
    req.body = body;
    Ok(req)
}

fn reason(status: u16) -> &'static str {
    match status {
        200 => "OK",
        400 => "Bad Request",
        401 => "Unauthorized",
        403 => "Forbidden",
        404 => "Not Found",
        411 => "Length Required",
        413 => "Payload Too Large",
        431 => "Request Header Fields Too Large",
        _ => "Error",
    }
}

fn respond(conn: &mut TcpStream, status: u16, content_type: &str, body: &[u8]) {
    let head = format!(
        "HTTP/1.1 {status} {}\r\ncontent-type: {content_type}\r\ncontent-length: {}\r\nconnection: close\r\n\r\n",
        reason(status),
        body.len()
    );
    let _ = conn.write_all(head.as_bytes());
    let _ = conn.write_all(body);
    let _ = conn.flush();
}

fn respond_error(conn: &mut TcpStream, status: u16, kind: &str, message: &str) {
    respond(
        conn,
        status,
        "text/plain",
        format!("{kind}\n{message}").as_bytes(),
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn serve_args_need_a_token_of_16_characters() {
        let args: Vec<String> = ["--listen", "127.0.0.1:0", "--workspace", "/tmp"]
            .iter()
            .map(|s| s.to_string())
            .collect();
        let e = parse_serve_args(&args, &|_| None).unwrap_err();
        assert!(e.contains(TOKEN_ENV), "{e}");
        let e = parse_serve_args(&args, &|_| Some("short".to_owned())).unwrap_err();
        assert!(e.contains("16"), "{e}");
        let o = parse_serve_args(&args, &|_| Some("0123456789abcdef".to_owned())).unwrap();
        assert_eq!(o.token, "0123456789abcdef");
        assert!(parse_serve_args(&args[..2], &|_| Some("0123456789abcdef".into())).is_err());
    }

    #[test]
    fn result_and_cwd_round_trip() {
        let r = ExecResult {
            exit_code: Some(137),
            stdout_bytes: 5,
            stderr_bytes: 0,
            timed_out: true,
            killed: false,
            error: Some("two\nlines".to_owned()),
        };
        let back = ExecResult::decode(&r.encode()).unwrap();
        assert_eq!(back.error.as_deref(), Some("two lines"));
        assert_eq!((back.exit_code, back.timed_out), (Some(137), true));
        let p = "/workspace/dir with spaces/ü%";
        assert_eq!(percent_decode(&percent_encode(p)).unwrap(), p);
    }
}

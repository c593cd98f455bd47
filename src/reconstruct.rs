//! `graft reconstruct`: recorded calls (or a foreign OpenAI-format JSONL log) → token-masked
//! training samples in Parquet, with a summary of what was merged, forked and skipped.

use std::collections::BTreeMap;
use std::io::BufRead;
use std::path::PathBuf;

use anyhow::Context;
use graft_reconstruct::merge::{MergeOptions, MergeResult, OnDrift, Summary, merge_session_with};
use graft_reconstruct::records::{
    FromRecords, HeaderRule, LeaveOut, Reconstruction, samples_from_records, skip_reason,
    write_results,
};
use graft_reconstruct::retokenize::{Model, conversation_calls};
use graft_reconstruct::threads::SideThreads;
use serde_json::Value;

#[derive(Debug, clap::Args)]
pub struct ReconstructArgs {
    /// The gateway's data dir (records and session rewards).
    #[arg(
        long,
        conflicts_with = "from_jsonl",
        required_unless_present = "from_jsonl"
    )]
    pub data_dir: Option<PathBuf>,
    /// Instead of records: an OpenAI-format JSONL of conversations
    /// (`{"messages": [...], "tools": [...], "reward": 1.0}` per line) → SFT-style samples.
    #[arg(long)]
    pub from_jsonl: Option<PathBuf>,
    /// The model's HF directory: tokenizer.json and tokenizer_config.json / chat_template.jinja.
    #[arg(long)]
    pub tokenizer: PathBuf,
    /// Where the samples go (Parquet, zstd).
    #[arg(long)]
    pub out: PathBuf,
    /// Template variable `enable_thinking` (Qwen3), when set.
    #[arg(long)]
    pub enable_thinking: Option<bool>,
    /// Print the summary as one JSON object.
    #[arg(long)]
    pub json: bool,
    /// Succeed even when a session yields no sample (every call of it skipped, or left out
    /// by a `--leave-out-*` rule); by default that is an error, after the summary and the
    /// skip reasons.
    #[arg(long)]
    pub allow_skips: bool,
    /// What a call whose prompt drifted from its sample (re-rendered history) does:
    /// `fork` starts a new sample; `realign` continues the sample with the prompt's own
    /// tokens, mask 0 where they were rewritten (as slime does), counted in the summary.
    #[arg(long, default_value = "fork", value_parser = ["fork", "realign"])]
    pub on_drift: String,
    /// Leave calls to this model out of training (exact name, or a prefix ending in `*`;
    /// repeatable): the side calls a harness makes with a small second model.
    #[arg(long = "leave-out-model", value_name = "MODEL")]
    pub leave_out_models: Vec<String>,
    /// Leave calls that offer no tools out of training (a harness's title and summary
    /// calls beside a tool-using rollout). An agent that never offers tools (smolagents'
    /// CodeAgent, aider) has no call left: its sessions yield no sample, an error unless
    /// --allow-skips.
    #[arg(long)]
    pub leave_out_without_tools: bool,
    /// Leave calls out by a request header the gateway recorded (`recorder.record_headers`):
    /// `NAME` (present), `NAME=VALUE`, `NAME~TEXT` (contains) or `NAME!~TEXT` (present,
    /// does not contain); repeatable. E.g. Codex's sub-agents:
    /// `--leave-out-header 'x-codex-turn-metadata!~"agent_name":"/root"'`.
    #[arg(long = "leave-out-header", value_name = "RULE")]
    pub leave_out_headers: Vec<String>,
    /// What side threads train on: the calls that start a conversation of their own with
    /// another system prompt or tool set than the main agent's (session titles, sub-agents,
    /// memory extraction; each sample names its `thread` and `parent_sample`). `own`: only
    /// a side sample with a reward posted for one of its calls is kept (trained on that
    /// reward, not the session's); `leave-out`: none is kept; `session`: all are kept with
    /// the session's reward.
    #[arg(long, default_value = "own", value_parser = ["own", "leave-out", "session"])]
    pub side_threads: String,
}

fn count(skipped: &mut BTreeMap<String, u64>, why: &str) {
    *skipped.entry(why.to_string()).or_default() += 1;
}

pub fn run(a: ReconstructArgs) -> anyhow::Result<()> {
    let mut model = Model::from_dir(&a.tokenizer).with_context(|| {
        format!(
            "loading the model's template and tokenizer from {}",
            a.tokenizer.display()
        )
    })?;
    if let Some(t) = a.enable_thinking {
        model.extra.insert("enable_thinking".into(), Value::Bool(t));
    }
    let done = if let Some(path) = &a.from_jsonl {
        let options = MergeOptions {
            on_drift: OnDrift::parse(&a.on_drift).unwrap_or_default(),
            side_threads: SideThreads::parse(&a.side_threads).unwrap_or_default(),
        };
        from_jsonl(&model, path, &a.out, options)?
    } else if let Some(dir) = &a.data_dir {
        anyhow::ensure!(dir.is_dir(), "data dir {} does not exist", dir.display());
        let leave_out = LeaveOut {
            models: a.leave_out_models.clone(),
            without_tools: a.leave_out_without_tools,
            headers: a
                .leave_out_headers
                .iter()
                .map(|r| HeaderRule::parse(r))
                .collect::<Result<_, _>>()
                .map_err(|e| anyhow::anyhow!("--leave-out-header: {e}"))?,
        };
        let how = FromRecords {
            on_drift: OnDrift::parse(&a.on_drift).unwrap_or_default(),
            leave_out: Some(&leave_out),
            side_threads: SideThreads::parse(&a.side_threads).unwrap_or_default(),
            ..FromRecords::all()
        };
        samples_from_records(&model, dir, how, &a.out)?
    } else {
        anyhow::bail!("give --data-dir or --from-jsonl")
    };
    let Reconstruction {
        summary,
        exact_calls,
        retokenized_calls,
        skipped,
        sessions_without_samples,
        sessions_left_out,
        call_rewards,
        call_rewards_unmatched,
        ..
    } = done;
    if a.json {
        println!(
            "{}",
            serde_json::json!({
                "sessions": summary.sessions,
                "samples": summary.samples,
                "forks_by_reason": summary.forks_by_reason,
                "trained_tokens": summary.trained_tokens,
                "total_tokens": summary.total_tokens,
                "drift_events": summary.drift_events,
                "realigned": summary.realigned,
                "realigned_untrained_tokens": summary.realigned_untrained_tokens,
                "exact_calls": exact_calls,
                "retokenized_calls": retokenized_calls,
                "skipped": skipped,
                "sessions_without_samples": sessions_without_samples,
                "sessions_left_out": sessions_left_out,
                "call_rewards": call_rewards,
                "call_rewards_unmatched": call_rewards_unmatched,
                "threads": {
                    "main": summary.main_threads,
                    "side": summary.side_threads,
                    "side_policy": summary.side_policy.as_str(),
                    "side_samples_trained": summary.side_samples_trained,
                    "side_samples_left_out": summary.side_samples_left_out,
                    "side_calls_left_out": summary.side_calls_left_out,
                    "side_threads": summary.side_thread_examples.iter().map(|(session, t)| serde_json::json!({
                        "session_id": session,
                        "thread_id": t.id,
                        "name": t.name,
                        "calls": t.calls,
                        "samples": t.samples,
                        "parent_samples": t.parents,
                        "trained": t.trained,
                    })).collect::<Vec<_>>(),
                },
                "rewrites_by_kind": summary.rewrites_by_kind,
                "rewrites": summary.rewrite_examples.iter().map(|r| serde_json::json!({
                    "kind": r.kind.as_str(),
                    "call_id": r.call_id,
                    "against_call": r.against_call,
                    "message": r.message,
                    "role": r.role,
                    "before": r.before,
                    "after": r.after,
                })).collect::<Vec<_>>(),
                "out": a.out,
            })
        );
    } else {
        println!("{summary}");
        println!("calls: {exact_calls} with recorded token ids, {retokenized_calls} re-tokenized");
        for (why, n) in &skipped {
            println!("skipped: {n} ({why})");
        }
        if call_rewards > 0 || !call_rewards_unmatched.is_empty() {
            println!(
                "call rewards: {call_rewards} attached, {} naming no merged call{}",
                call_rewards_unmatched.len(),
                match call_rewards_unmatched.first() {
                    Some(c) => format!(" (first: {c})"),
                    None => String::new(),
                }
            );
        }
        println!("samples written to {}", a.out.display());
    }
    if !sessions_without_samples.is_empty() && !a.allow_skips {
        let (ruled, skipped): (Vec<&String>, Vec<&String>) = sessions_without_samples
            .iter()
            .partition(|s| sessions_left_out.contains(s));
        let mut why = Vec::new();
        if !skipped.is_empty() {
            why.push(format!(
                "{} session(s) yielded no sample ({}): every call of theirs was skipped, for the reasons printed above; fix the records",
                skipped.len(),
                shown(&skipped)
            ));
        }
        if !ruled.is_empty() {
            why.push(format!(
                "{} session(s) yielded no sample ({}): every call of theirs was left out by {} (the 'left out' lines above); an agent that never offers tools (smolagents' CodeAgent, aider) keeps nothing under --leave-out-without-tools: drop the rule that matches its calls",
                ruled.len(),
                shown(&ruled),
                rules_given(&a)
            ));
        }
        anyhow::bail!(
            "{}; or pass --allow-skips to accept sessions without samples",
            why.join("; ")
        );
    }
    Ok(())
}

/// Up to ten session ids, comma-separated, `...` after them when there are more.
fn shown(ids: &[&String]) -> String {
    let mut text = ids
        .iter()
        .take(10)
        .map(|s| s.as_str())
        .collect::<Vec<_>>()
        .join(", ");
    if ids.len() > 10 {
        text.push_str(", ...");
    }
    text
}

/// The `--leave-out-*` flags given, as a user typed them.
fn rules_given(a: &ReconstructArgs) -> String {
    let mut rules: Vec<String> = Vec::new();
    if a.leave_out_without_tools {
        rules.push("--leave-out-without-tools".into());
    }
    rules.extend(
        a.leave_out_models
            .iter()
            .map(|m| format!("--leave-out-model {m}")),
    );
    rules.extend(
        a.leave_out_headers
            .iter()
            .map(|h| format!("--leave-out-header {h}")),
    );
    rules.join(", ")
}

/// An OpenAI-format JSONL of conversations → SFT-style samples written to `out`.
fn from_jsonl(
    model: &Model,
    path: &std::path::Path,
    out: &std::path::Path,
    options: MergeOptions,
) -> anyhow::Result<Reconstruction> {
    let (tok_fp, tpl_fp) = model.fingerprints();
    let mut results: Vec<MergeResult> = vec![];
    let mut done = Reconstruction::default();
    let file = std::fs::File::open(path).with_context(|| format!("opening {}", path.display()))?;
    for (i, line) in std::io::BufReader::new(file).lines().enumerate() {
        let line = line?;
        if line.trim().is_empty() {
            continue;
        }
        let conv: Value = serde_json::from_str(&line)
            .with_context(|| format!("{} line {}: not JSON", path.display(), i + 1))?;
        let id = conv
            .get("id")
            .and_then(Value::as_str)
            .map(str::to_string)
            .unwrap_or_else(|| format!("line-{}", i + 1));
        match conversation_calls(model, &id, &conv) {
            Ok(calls) if calls.is_empty() => {
                count(&mut done.skipped, "conversation without an assistant turn");
            }
            Ok(calls) => {
                done.retokenized_calls += calls.len() as u64;
                let reward = conv.get("reward").and_then(Value::as_f64);
                results.push(merge_session_with(
                    &id,
                    None,
                    &calls,
                    reward,
                    (&tok_fp, &tpl_fp),
                    options,
                ));
            }
            Err(s) => {
                count(&mut done.skipped, &skip_reason(&s));
                done.sessions_without_samples.push(id);
            }
        }
    }
    write_results(&results, out)?;
    done.summary = Summary::of(&results);
    Ok(done)
}

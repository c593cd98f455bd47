//! `graft reconstruct`: recorded calls (or a foreign OpenAI-format JSONL log) → token-masked
//! training samples in Parquet, with a summary of what was merged, forked and skipped.

use std::collections::BTreeMap;
use std::io::BufRead;
use std::path::PathBuf;

use anyhow::Context;
use graft_reconstruct::merge::{MergeResult, Summary, merge_session};
use graft_reconstruct::records::{
    FromRecords, Reconstruction, samples_from_records, skip_reason, write_results,
};
use graft_reconstruct::retokenize::{Model, conversation_calls};
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
        from_jsonl(&model, path, &a.out)?
    } else if let Some(dir) = &a.data_dir {
        anyhow::ensure!(dir.is_dir(), "data dir {} does not exist", dir.display());
        samples_from_records(&model, dir, FromRecords::all(), &a.out)?
    } else {
        anyhow::bail!("give --data-dir or --from-jsonl")
    };
    let Reconstruction {
        summary,
        exact_calls,
        retokenized_calls,
        skipped,
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
                "exact_calls": exact_calls,
                "retokenized_calls": retokenized_calls,
                "skipped": skipped,
                "out": a.out,
            })
        );
    } else {
        println!("{summary}");
        println!("calls: {exact_calls} with recorded token ids, {retokenized_calls} re-tokenized");
        for (why, n) in &skipped {
            println!("skipped: {n} ({why})");
        }
        println!("samples written to {}", a.out.display());
    }
    Ok(())
}

/// An OpenAI-format JSONL of conversations → SFT-style samples written to `out`.
fn from_jsonl(
    model: &Model,
    path: &std::path::Path,
    out: &std::path::Path,
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
                results.push(merge_session(&id, None, &calls, reward, (&tok_fp, &tpl_fp)));
            }
            Err(s) => count(&mut done.skipped, skip_reason(&s)),
        }
    }
    write_results(&results, out)?;
    done.summary = Summary::of(&results);
    Ok(done)
}

//! `graft records`: read back what the recorder stored.

use std::io::Write;
use std::path::PathBuf;

use anyhow::Context;
use clap::ValueEnum;
use graft_recorder::CallRecord;

#[derive(Debug, clap::Args)]
pub struct SessionsArgs {
    #[arg(long)]
    pub data_dir: PathBuf,
    /// One JSON object per line instead of a table.
    #[arg(long)]
    pub json: bool,
}

#[derive(Debug, clap::Args)]
pub struct RepairArgs {
    #[arg(long)]
    pub data_dir: PathBuf,
}

#[derive(Debug, clap::Args)]
pub struct ShowArgs {
    #[arg(long)]
    pub data_dir: PathBuf,
    /// Only this session.
    #[arg(long)]
    pub session: Option<String>,
    /// One full record per line as JSON instead of a summary line per call.
    #[arg(long)]
    pub json: bool,
}

#[derive(Debug, Clone, Copy, ValueEnum)]
pub enum Format {
    Parquet,
    Jsonl,
}

#[derive(Debug, clap::Args)]
pub struct ExportArgs {
    #[arg(long)]
    pub data_dir: PathBuf,
    #[arg(long, value_enum)]
    pub format: Format,
    #[arg(long)]
    pub out: PathBuf,
    /// Only this session.
    #[arg(long)]
    pub session: Option<String>,
}

fn load(data_dir: &std::path::Path, session: Option<&str>) -> anyhow::Result<Vec<CallRecord>> {
    anyhow::ensure!(
        data_dir.is_dir(),
        "data dir {} does not exist",
        data_dir.display()
    );
    let mut recs = graft_recorder::read_records(data_dir)
        .with_context(|| format!("reading records from {}", data_dir.display()))?;
    if let Some(s) = session {
        recs.retain(|r| r.session_id == s);
    }
    for r in &mut recs {
        r.redact_credentials();
    }
    Ok(recs)
}

/// Rewrites the data dir's session log keeping every whole event (see
/// `graft_recorder::repair_session_log`); prints what it kept and dropped as one JSON line.
/// Stop the gateway on that data dir first.
pub fn repair(a: RepairArgs) -> anyhow::Result<()> {
    anyhow::ensure!(
        a.data_dir.is_dir(),
        "data dir {} does not exist",
        a.data_dir.display()
    );
    let r = graft_recorder::repair_session_log(&a.data_dir)?;
    if r.dropped.is_empty() {
        println!("{}", serde_json::json!({"repaired": false, "kept": r.kept}));
        eprintln!("graft: the session log holds only whole events; nothing to repair");
    } else {
        println!(
            "{}",
            serde_json::json!({"repaired": true, "kept": r.kept, "recovered": r.recovered,
                "dropped": r.dropped.iter().map(|(at, n)| serde_json::json!({"offset": at, "bytes": n})).collect::<Vec<_>>(),
                "original": r.original})
        );
    }
    Ok(())
}

pub fn sessions(a: SessionsArgs) -> anyhow::Result<()> {
    anyhow::ensure!(
        a.data_dir.is_dir(),
        "data dir {} does not exist",
        a.data_dir.display()
    );
    let list = graft_recorder::list_sessions(&a.data_dir)?;
    let mut out = std::io::stdout().lock();
    if a.json {
        for s in &list {
            writeln!(
                out,
                "{}",
                serde_json::json!({
                    "session_id": s.session_id, "group_id": s.group_id, "calls": s.calls,
                    "errors": s.errors, "first_us": s.first_us, "last_us": s.last_us,
                    "reward": s.reward, "closed": s.closed, "stored_request_bytes": s.stored_request_bytes,
                })
            )?;
        }
        return Ok(());
    }
    writeln!(
        out,
        "{:<40} {:<16} {:>6} {:>6} {:>8} {:>6} {:>12}",
        "session", "group", "calls", "errors", "reward", "closed", "stored_bytes"
    )?;
    for s in &list {
        writeln!(
            out,
            "{:<40} {:<16} {:>6} {:>6} {:>8} {:>6} {:>12}",
            s.session_id,
            s.group_id.as_deref().unwrap_or("-"),
            s.calls,
            s.errors,
            s.reward
                .map(|r| format!("{r:.3}"))
                .unwrap_or_else(|| "-".into()),
            if s.closed { "yes" } else { "no" },
            s.stored_request_bytes
        )?;
    }
    Ok(())
}

pub fn show(a: ShowArgs) -> anyhow::Result<()> {
    let recs = load(&a.data_dir, a.session.as_deref())?;
    let mut out = std::io::stdout().lock();
    for r in &recs {
        if a.json {
            writeln!(out, "{}", serde_json::to_string(r)?)?;
        } else {
            writeln!(
                out,
                "{} {:<24} #{:<4} {:<17} {:<6} {:>3} {:<19} {:>8.1} ms  {}",
                r.call_id,
                r.session_id,
                r.seq,
                r.dialect,
                if r.stream { "sse" } else { "json" },
                r.status,
                r.outcome,
                r.latency_ms,
                r.error.as_deref().unwrap_or("")
            )?;
        }
    }
    Ok(())
}

pub fn export(a: ExportArgs) -> anyhow::Result<()> {
    let recs = load(&a.data_dir, a.session.as_deref())?;
    match a.format {
        Format::Parquet => graft_recorder::export_parquet(&recs, &a.out)?,
        Format::Jsonl => graft_recorder::export_jsonl(&recs, &a.out)?,
    }
    eprintln!("exported {} records to {}", recs.len(), a.out.display());
    Ok(())
}

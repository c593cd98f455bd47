//! `graft export --to NAME`: a samples Parquet in a training framework's own layout (verl,
//! TRL, SkyRL, OpenRLHF, slime, Tinker), written by the `graft_rl` Python package
//! (`python/` in the repository): JSONL in the framework's field names, or with
//! `--format native` the framework's own file (verl `DataProto`, slime debug rollout data,
//! a SkyRL `GeneratorOutput`), which needs that framework installed next to the package.

use std::path::PathBuf;
use std::process::Command;

use anyhow::{Context, bail};

/// The layouts `graft_rl export` writes.
pub const FORMATS: [&str; 7] = [
    "verl", "trl", "trl-sft", "skyrl", "openrlhf", "slime", "tinker",
];

#[derive(Debug, clap::Args)]
pub struct ExportArgs {
    /// The framework: verl, trl (GRPO rollout_func), trl-sft, skyrl, openrlhf, slime, tinker.
    #[arg(long = "to", value_parser = FORMATS)]
    pub to: String,
    /// A samples Parquet written by `graft reconstruct` or `graft rl` (repeatable).
    #[arg(long, required = true)]
    pub samples: Vec<PathBuf>,
    /// Where the export goes.
    #[arg(long)]
    pub out: PathBuf,
    /// jsonl: one object per sample in the framework's field names (pyarrow + numpy only);
    /// native: the framework's own file (verl, slime, skyrl; needs the framework).
    #[arg(long, default_value = "jsonl", value_parser = ["jsonl", "native"])]
    pub format: String,
    /// Reward for samples whose session has none (by default they are refused).
    #[arg(long)]
    pub missing_reward: Option<f64>,
    /// The Python that has the `graft_rl` package (`pip install ./python`).
    #[arg(long, env = "GRAFT_PYTHON", default_value = "python3")]
    pub python: PathBuf,
}

pub fn run(a: ExportArgs) -> anyhow::Result<()> {
    for s in &a.samples {
        anyhow::ensure!(s.is_file(), "samples file {} does not exist", s.display());
    }
    let mut cmd = Command::new(&a.python);
    cmd.args([
        "-m", "graft_rl", "export", "--to", &a.to, "--format", &a.format,
    ])
    .arg("--out")
    .arg(&a.out);
    for s in &a.samples {
        cmd.arg("--samples").arg(s);
    }
    if let Some(r) = a.missing_reward {
        cmd.args(["--missing-reward", &r.to_string()]);
    }
    let out = cmd.output().with_context(|| {
        format!(
            "cannot run {} (give --python or GRAFT_PYTHON: a Python with `pip install ./python` from graft's repository)",
            a.python.display()
        )
    })?;
    let stderr = String::from_utf8_lossy(&out.stderr);
    if !out.status.success() {
        if stderr.contains("No module named graft_rl") {
            bail!(
                "{} has no graft_rl package: install it with `{} -m pip install ./python` from graft's repository, or point --python at a Python that has it",
                a.python.display(),
                a.python.display()
            );
        }
        bail!(
            "graft_rl export --to {} failed ({}): {}",
            a.to,
            out.status,
            stderr.trim()
        );
    }
    print!("{}", String::from_utf8_lossy(&out.stdout));
    Ok(())
}

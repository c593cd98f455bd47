//! The run's state (`<out_dir>/state.json`): which step is next, the policy and weight
//! version the backends serve, the newest checkpoint; read at start, written atomically after
//! every step.

use std::io::Write as _;
use std::path::{Path, PathBuf};

use anyhow::Context;

#[derive(serde::Serialize, serde::Deserialize, Default)]
pub(super) struct State {
    /// The first step not finished (trained and logged); step s runs tasks from
    /// s × tasks_per_step on.
    pub(super) next_step: usize,
    /// The policy's current weights (the last step's checkpoint); None: the starting model.
    #[serde(default)]
    pub(super) policy: Option<PathBuf>,
    /// The weight_version the backends serve.
    #[serde(default)]
    pub(super) weight_version: Option<String>,
    /// The run's steps up to the newest checkpoint (`policy`): a resident trainer's run
    /// resumes there (None, in a state.json written before resident trainers: `next_step`).
    #[serde(default)]
    pub(super) checkpoint_next: Option<usize>,
    /// The weight_version of the newest checkpoint.
    #[serde(default)]
    pub(super) checkpoint_version: Option<String>,
    /// The weight versions served so far, oldest first ("default" or the resumed policy's
    /// first): a call's staleness is how many of them lie between its version and the
    /// trainer's.
    #[serde(default)]
    pub(super) versions: Vec<String>,
}

pub(super) fn read_state(out: &Path) -> anyhow::Result<State> {
    let p = out.join("state.json");
    match std::fs::read(&p) {
        Ok(b) => serde_json::from_slice(&b).with_context(|| format!("{} is damaged", p.display())),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(State::default()),
        Err(e) => Err(e).with_context(|| format!("reading {}", p.display())),
    }
}

pub(super) fn write_state(out: &Path, s: &State) -> anyhow::Result<()> {
    let p = out.join("state.json");
    let tmp = out.join("state.json.tmp");
    let mut f = std::fs::File::create(&tmp)?;
    f.write_all(&serde_json::to_vec(s)?)?;
    f.sync_all()?;
    std::fs::rename(&tmp, &p)?;
    Ok(())
}

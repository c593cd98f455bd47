//! `rl.toml`: what `graft rl` runs. Strict (unknown keys are errors), validated once at start;
//! relative paths are relative to the config file's folder.

use std::path::{Path, PathBuf};

use anyhow::{Context, bail};
use graft_gateway::config::{ExactWire, LogprobsMode};
use serde::Deserialize;

/// Why a config naming `backend.scripted` is refused by a graft built without the scripted
/// upstream.
pub const SCRIPTED_NEEDS_TESTKIT: &str = "backend.scripted needs the scripted upstream, which this graft was built without; rebuild with `cargo build --features testkit` (or give backend.urls)";

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RlConfig {
    pub run: RunSection,
    /// `graft rl`'s task file; `graft rollouts serve` takes its tasks per request and does
    /// not read it (a file it names must still exist: [`RlConfig::check_files`]).
    #[serde(default)]
    pub tasks: Option<TasksSection>,
    /// One harness (`[harness]`) or several (`[[harness]]`, each with a `label`): a task that
    /// names one (`"harness": LABEL`) runs all its rollouts in it; the others' groups mix
    /// them, rollout i of a group in harness i mod n.
    #[serde(deserialize_with = "one_or_many")]
    pub harness: Vec<HarnessSection>,
    pub backend: BackendSection,
    #[serde(default)]
    pub envd: EnvdSection,
    #[serde(default)]
    pub rollout: RolloutSection,
    #[serde(default)]
    pub trainer: TrainerSection,
    /// The config file's folder (absolute): `GRAFT_RL_DIR` in the harness's environment.
    #[serde(skip)]
    pub dir: PathBuf,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RunSection {
    /// Where the run keeps everything: records, samples, checkpoints, the step log.
    pub out_dir: PathBuf,
    /// Optimizer steps to run: `graft rl` needs it (here or `--steps`); `graft rollouts
    /// serve` does not read it.
    #[serde(default)]
    pub steps: Option<usize>,
    #[serde(default)]
    pub seed: u64,
    /// Checkpoints kept in `<out_dir>/checkpoints` (each holds the weights and the optimizer
    /// state); older ones are deleted once a newer step is finished. The current policy is
    /// always kept. 0: keep every one.
    #[serde(default = "default_keep_checkpoints")]
    pub keep_checkpoints: usize,
    /// What side threads train on (a harness's titles, sub-agents, memory extraction:
    /// `graft reconstruct --side-threads`): `own` (the default: only side samples with a
    /// reward posted for one of their calls, on that reward), `leave-out` or `session`.
    #[serde(default)]
    pub side_threads: SideThreadsPolicy,
}

/// `[run] side_threads`, as [`graft_reconstruct::threads::SideThreads`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum SideThreadsPolicy {
    #[default]
    Own,
    LeaveOut,
    Session,
}

impl SideThreadsPolicy {
    pub fn policy(self) -> graft_reconstruct::threads::SideThreads {
        use graft_reconstruct::threads::SideThreads;
        match self {
            SideThreadsPolicy::Own => SideThreads::Own,
            SideThreadsPolicy::LeaveOut => SideThreads::LeaveOut,
            SideThreadsPolicy::Session => SideThreads::Session,
        }
    }
}

fn default_keep_checkpoints() -> usize {
    2
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TasksSection {
    /// JSONL, one task per line (see `tasks.rs`).
    pub file: PathBuf,
}

/// `[harness]` (one table) or `[[harness]]` (an array of them), with the table's own error
/// (an unknown key, a missing `command`) when one is wrong.
fn one_or_many<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Vec<HarnessSection>, D::Error> {
    use serde::de::Error;
    let v = toml::Value::deserialize(d)?;
    if v.is_array() {
        Vec::<HarnessSection>::deserialize(v).map_err(D::Error::custom)
    } else {
        HarnessSection::deserialize(v)
            .map(|h| vec![h])
            .map_err(D::Error::custom)
    }
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HarnessSection {
    /// What the step log, the session's metadata and a task's `harness` call this harness
    /// (default: its `name`, else "harness" when it is the only one, else "harness-N").
    #[serde(default)]
    pub label: Option<String>,
    /// The harness's command line, run with `/bin/sh -c` in the task's sandbox (working
    /// directory `/workspace`). The gateway session's variables are set (`OPENAI_BASE_URL`,
    /// `OPENAI_API_KEY`, `ANTHROPIC_BASE_URL`, ...), and `GRAFT_TASK_ID`, `GRAFT_TASK_PROMPT`,
    /// `GRAFT_ROLLOUT_INDEX` (the rollout's number in its group), `GRAFT_RL_DIR`.
    pub command: String,
    /// Wall-clock budget of one rollout; a rollout past it is aborted and excluded.
    #[serde(default = "default_harness_timeout")]
    pub timeout_secs: f64,
    /// Extra environment for the harness.
    #[serde(default)]
    pub env: std::collections::BTreeMap<String, String>,
    /// Host folders the sandbox sees read-only, target → source (`{ "/mnt/py" = "venv" }`):
    /// the harness's program and its interpreter. The config's own folder is always at
    /// `/mnt/rl` (`GRAFT_RL_DIR`).
    #[serde(default)]
    pub mounts: std::collections::BTreeMap<String, PathBuf>,
    /// The model name the harness is told to use.
    #[serde(default = "default_model_name")]
    pub model: String,
    /// An entry of `harness-configs/` (`codex`, `mini-swe-agent`, `aider`, ...): envd sets
    /// its variables and writes its config files into the sandbox's workspace, pointed at the
    /// rollout's session (e.g. Codex's `config.toml` under `CODEX_HOME`). `command` still
    /// starts it.
    #[serde(default)]
    pub name: Option<String>,
}

fn default_harness_timeout() -> f64 {
    300.0
}

fn default_model_name() -> String {
    "policy".into()
}

/// The inference backend: exact mode needs SGLang's native `/generate`.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BackendSection {
    /// The model's HF directory: its tokenizer and chat template (and, with `serve`, its
    /// weights).
    pub model_dir: PathBuf,
    /// Inference servers already running (`http://host:30000`), speaking `wire`. Empty:
    /// graft runs one itself, in process (`scripted` for tests, otherwise `graft serve` on
    /// the policy's weights: `trainer.model`, else `model_dir`).
    #[serde(default)]
    pub urls: Vec<String>,
    /// What the servers are: `"sglang"` (SGLang, `graft serve`; the default) or `"vllm"`
    /// (vLLM 0.34+: the gateway's `exact.wire`; weight pushes need vLLM started with
    /// `VLLM_SERVER_DEV_MODE=1`, docs/BACKENDS.md). The embedded `graft serve` speaks
    /// SGLang's wire, so `"vllm"` needs `urls` (or `scripted`).
    #[serde(default)]
    pub wire: ExactWire,
    /// vLLM only: the `--logprobs-mode` the servers run with (`raw_logprobs`, vLLM's
    /// default: before temperature; `processed_logprobs`: after it), the gateway's
    /// `exact.logprobs_mode`.
    #[serde(default)]
    pub logprobs_mode: Option<LogprobsMode>,
    /// A scripted upstream's script (tests and demos: the model's text is played, the ids
    /// are real): graft runs the scripted upstream (`graft-testkit`) in process with
    /// `--tokenizer model_dir --script FILE`. Needs a graft built with `--features testkit`.
    #[serde(default)]
    pub scripted: Option<PathBuf>,
    #[serde(default = "default_true")]
    pub exact: bool,
    /// How often graft rl checks that every backend answers `GET /health`. A backend that
    /// stops answering (restarting, crashed) is waited for: the gateway holds new calls
    /// meanwhile, and once it is back the policy's current weights are pushed to it again
    /// if it lost them (its `weight_version` differs).
    #[serde(default = "default_health_interval")]
    pub health_interval_secs: f64,
    /// How long a backend may stay away before the run gives up on it (calls then fail and
    /// their rollouts are excluded).
    #[serde(default = "default_restart_wait")]
    pub restart_wait_secs: f64,
    /// The key of servers started with `--api-key` (`env::NAME` reads it from the
    /// environment): sent on generations and info probes.
    #[serde(default)]
    pub api_key: Option<String>,
    /// The key of servers started with `--admin-api-key`: SGLang wants it, not the API key,
    /// on pauses, aborts and weight updates. Default: `api_key`.
    #[serde(default)]
    pub admin_api_key: Option<String>,
    /// Drain a backend before each weight push (the gateway holds its new calls and waits
    /// for those in flight) instead of letting the server pause in place. Off by default:
    /// SGLang (>= 0.5.6), vLLM (>= 0.34) and `graft serve` keep their calls across an
    /// update. A vLLM older than 0.34 is drained whatever this says (see `docs/BACKENDS.md`).
    #[serde(default)]
    pub drain_on_push: bool,
}

fn default_health_interval() -> f64 {
    1.0
}

fn default_restart_wait() -> f64 {
    300.0
}

fn default_true() -> bool {
    true
}

#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EnvdSection {
    /// A running envd (`http://host:7070`) and its key (`env::NAME` reads it from the
    /// environment); empty: an embedded local envd.
    pub url: Option<String>,
    pub api_key: Option<String>,
    /// The host uid (and gid) the embedded envd runs sandboxed processes as, when graft rl
    /// runs as root [default: envd's, 100000]. 0 runs harnesses as root inside their sandbox,
    /// for those that want it (Claude Code, with `IS_SANDBOX=1`); bubblewrap still isolates.
    pub sandbox_uid: Option<u32>,
    /// Sandbox limits.
    pub memory_mb: Option<u64>,
    pub pids: Option<u64>,
    pub cpus: Option<f64>,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RolloutSection {
    /// Tasks (groups) per step.
    #[serde(default = "default_tasks_per_step")]
    pub tasks_per_step: usize,
    /// Rollouts trained on per group (BAR's N).
    #[serde(default = "default_n")]
    pub group_size: usize,
    /// Most rollouts per group (BAR's N_max).
    #[serde(default = "default_n_max")]
    pub max_group_size: usize,
    /// Rollouts added at a time while the group is not balanced.
    #[serde(default = "default_stride")]
    pub stride: usize,
    /// Rollouts running at once.
    #[serde(default = "default_concurrency")]
    pub concurrency: usize,
    /// Reward command budget.
    #[serde(default = "default_reward_timeout")]
    pub reward_timeout_secs: f64,
    /// Balanced Adaptive Rollout's band: the fraction of positive rollouts a group is
    /// trained with (3 to 5 of 8 by default).
    #[serde(default = "default_min_positive")]
    pub min_positive: f64,
    #[serde(default = "default_max_positive")]
    pub max_positive: f64,
    /// A rollout counts as positive for the band when its reward is above this.
    #[serde(default)]
    pub positive_above: f64,
    /// Which rollouts of a group are trained on: `bar` (Balanced Adaptive Rollout, for
    /// pass/fail rewards) or `group` (the first `group_size` scored rollouts, for graded
    /// rewards; a group whose rewards are all equal has no signal and is dropped).
    #[serde(default)]
    pub selection: Selection,
    /// How many weight versions the rollouts may lag behind the trainer. 0: each step's
    /// rollouts wait for the previous step's weights. N: step s's rollouts start once the
    /// training of step s − 1 − N is done, so up to N steps train while they run (each
    /// call's `weight_version` is recorded; the step log has every call's staleness: the
    /// versions between the one that sampled it and the one the trainer held when it
    /// trained on it, never more than N).
    #[serde(default)]
    pub max_staleness: usize,
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Selection {
    #[default]
    Bar,
    Group,
}

fn default_min_positive() -> f64 {
    0.375
}
fn default_max_positive() -> f64 {
    0.625
}

fn default_tasks_per_step() -> usize {
    2
}
fn default_n() -> usize {
    8
}
fn default_n_max() -> usize {
    16
}
fn default_stride() -> usize {
    4
}
fn default_concurrency() -> usize {
    4
}
fn default_reward_timeout() -> f64 {
    60.0
}

impl Default for RolloutSection {
    fn default() -> Self {
        RolloutSection {
            tasks_per_step: default_tasks_per_step(),
            group_size: default_n(),
            max_group_size: default_n_max(),
            stride: default_stride(),
            concurrency: default_concurrency(),
            reward_timeout_secs: default_reward_timeout(),
            min_positive: default_min_positive(),
            max_positive: default_max_positive(),
            positive_above: 0.0,
            selection: Selection::Bar,
            max_staleness: 0,
        }
    }
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TrainerSection {
    /// false: collect rollouts, rewards and samples only (evaluation, data collection).
    #[serde(default = "default_true")]
    pub enabled: bool,
    /// The policy's weights (HF directory) at the start; default `backend.model_dir`.
    #[serde(default)]
    pub model: Option<PathBuf>,
    #[serde(default = "default_lr")]
    pub lr: f64,
    /// The rollouts' sampling temperature (for the trainer's log-softmax).
    #[serde(default = "default_temperature")]
    pub temperature: f64,
    /// Push each step's weights to the backends: in memory to the embedded `graft serve`
    /// (a tensor copy), as files to SGLang backends (pause → flush → update → continue).
    #[serde(default = "default_true")]
    pub push: bool,
    /// true: the trainer stays in memory across steps (model, fp32 masters, AdamW moments)
    /// and writes a checkpoint every `checkpoint_every` steps and after the last. false: each
    /// step loads the policy from the previous step's checkpoint and writes a new one (the
    /// per-step path; `graft train`'s, and the benchmark's baseline).
    #[serde(default = "default_true")]
    pub resident: bool,
    /// A resident trainer writes a checkpoint (weights + optimizer state, under
    /// `<out_dir>/checkpoints`) after every this many steps and after the run's last step;
    /// 0: after the last only. A run resumed after a crash continues from the newest
    /// checkpoint and runs the steps after it again (their finished rollouts are kept).
    #[serde(default = "default_checkpoint_every")]
    pub checkpoint_every: usize,
    /// Where π_old comes from: `auto` (the rollout logprobs for a single optimizer step per
    /// batch), `bypass`, or `recompute` (a forward of the trainer before the step, with the
    /// truncated importance weight against the rollout logprobs).
    #[serde(default)]
    pub policy: PolicyChoice,
    /// What the truncated importance weight is over (recompute): `token` or `sequence` (the
    /// geometric mean of a sample's token ratios).
    #[serde(default)]
    pub tis_level: Level,
    /// Cap of the truncated importance weight.
    #[serde(default = "default_tis_cap")]
    pub tis_cap: f64,
    /// Rejection: tokens (or whole samples) whose trainer/rollout ratio lies outside
    /// `[low, high]` are left out of the loss; the step log has the masked share.
    #[serde(default)]
    pub reject: Option<RejectSection>,
    /// Activation checkpointing: recompute each decoder layer's activations in the
    /// backward instead of keeping them (less memory, one more forward of the layers).
    #[serde(default)]
    pub checkpoint_layers: bool,
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum PolicyChoice {
    #[default]
    Auto,
    Bypass,
    Recompute,
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Level {
    #[default]
    Token,
    Sequence,
}

#[derive(Debug, Clone, Copy, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RejectSection {
    #[serde(default)]
    pub level: Level,
    pub low: f64,
    pub high: f64,
}

fn default_checkpoint_every() -> usize {
    10
}

fn default_tis_cap() -> f64 {
    2.0
}

fn default_lr() -> f64 {
    1e-6
}

fn default_temperature() -> f64 {
    1.0
}

impl Default for TrainerSection {
    fn default() -> Self {
        TrainerSection {
            enabled: true,
            model: None,
            lr: default_lr(),
            temperature: default_temperature(),
            push: true,
            resident: true,
            checkpoint_every: default_checkpoint_every(),
            policy: PolicyChoice::Auto,
            tis_level: Level::Token,
            tis_cap: default_tis_cap(),
            reject: None,
            checkpoint_layers: false,
        }
    }
}

impl HarnessSection {
    /// Its label (set for every harness by [`RlConfig::load`]).
    pub fn label(&self) -> &str {
        self.label
            .as_deref()
            .or(self.name.as_deref())
            .unwrap_or("harness")
    }
}

impl RlConfig {
    /// The harness rollout `index` of a group of `task` runs in: the one the task names, else
    /// the group's rollouts take the harnesses in turn.
    pub fn harness_for(&self, task_harness: Option<&str>, index: usize) -> &HarnessSection {
        task_harness
            .and_then(|l| self.harness.iter().find(|h| h.label() == l))
            .unwrap_or_else(|| &self.harness[index % self.harness.len()])
    }

    /// Checks that every task's `harness` names one of the config's.
    pub fn check_task_harness(&self, task_id: &str, harness: Option<&str>) -> anyhow::Result<()> {
        match harness {
            Some(l) if !self.harness.iter().any(|h| h.label() == l) => bail!(
                "task '{task_id}' names harness '{l}', which the config does not have (it has: {})",
                self.harness
                    .iter()
                    .map(HarnessSection::label)
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
            _ => Ok(()),
        }
    }

    /// `run.steps` (`graft rl` checks at start that it is set: [`RlConfig::for_rl`]).
    pub fn steps(&self) -> usize {
        self.run.steps.unwrap_or(0)
    }

    /// What `graft rl` needs beyond what the rollout service does: `run.steps` (or the
    /// `--steps` given) and `[tasks]`; returns the task file.
    pub fn for_rl(&mut self, steps: Option<usize>) -> anyhow::Result<PathBuf> {
        let Some(steps) = steps.or(self.run.steps) else {
            bail!(
                "run.steps is missing: graft rl needs the number of steps, in [run] (steps = N) or as --steps N"
            );
        };
        self.run.steps = Some(steps);
        match &self.tasks {
            Some(t) => Ok(t.file.clone()),
            None => bail!(
                "[tasks] is missing: graft rl needs a task file ([tasks] file = \"tasks.jsonl\", one task per line); only graft rollouts serve, which takes its tasks per request, goes without"
            ),
        }
    }

    /// Every file and folder the config names exists (the task file, `backend.model_dir`,
    /// `backend.scripted`, `trainer.model`, each harness's mounts), checked at start so a
    /// wrong path is one clear error, not a failure on the first rollout.
    pub fn check_files(&self) -> anyhow::Result<()> {
        let mut named: Vec<(String, &Path, bool)> = Vec::new();
        if let Some(t) = &self.tasks {
            named.push(("tasks.file".into(), &t.file, false));
        }
        named.push(("backend.model_dir".into(), &self.backend.model_dir, true));
        if let Some(s) = &self.backend.scripted {
            named.push(("backend.scripted".into(), s, false));
        }
        if let Some(m) = &self.trainer.model {
            named.push(("trainer.model".into(), m, true));
        }
        for h in &self.harness {
            for (target, src) in &h.mounts {
                named.push((
                    format!("harness '{}' mounts.\"{target}\"", h.label()),
                    src,
                    false,
                ));
            }
        }
        for (key, path, dir) in named {
            let what = if dir { "folder" } else { "file" };
            let ok = if dir { path.is_dir() } else { path.exists() };
            if !ok {
                bail!(
                    "{key} = {}: no such {what} (relative paths are relative to the config's folder, {})",
                    path.display(),
                    self.dir.display()
                );
            }
        }
        Ok(())
    }

    pub fn load(path: &Path) -> anyhow::Result<RlConfig> {
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("cannot read the run config {}", path.display()))?;
        let mut c: RlConfig = toml::from_str(&text)
            .with_context(|| format!("{} is not a valid graft rl config", path.display()))?;
        let base = path.parent().unwrap_or(Path::new("."));
        let base = if base.as_os_str().is_empty() {
            Path::new(".")
        } else {
            base
        };
        let base =
            std::path::absolute(base).with_context(|| format!("resolving {}", base.display()))?;
        let base = base.as_path();
        c.dir = base.to_path_buf();
        let fix = |p: &mut PathBuf| {
            if p.is_relative() {
                *p = base.join(&*p);
            }
        };
        fix(&mut c.run.out_dir);
        if let Some(t) = &mut c.tasks {
            fix(&mut t.file);
        }
        fix(&mut c.backend.model_dir);
        let n = c.harness.len();
        for (i, h) in c.harness.iter_mut().enumerate() {
            for src in h.mounts.values_mut() {
                fix(src);
            }
            if h.label.is_none() {
                h.label = Some(match (&h.name, n) {
                    (Some(name), _) => name.clone(),
                    (None, 1) => "harness".into(),
                    (None, _) => format!("harness-{i}"),
                });
            }
        }
        if let Some(s) = &mut c.backend.scripted {
            fix(s);
        }
        if let Some(m) = &mut c.trainer.model {
            fix(m);
        }
        c.validate()?;
        Ok(c)
    }

    fn validate(&self) -> anyhow::Result<()> {
        let r = &self.rollout;
        if r.group_size == 0 || r.max_group_size < r.group_size {
            bail!(
                "rollout.group_size ({}) must be at least 1 and at most rollout.max_group_size ({})",
                r.group_size,
                r.max_group_size
            );
        }
        if r.stride == 0 || r.concurrency == 0 || r.tasks_per_step == 0 {
            bail!(
                "rollout.stride, rollout.concurrency and rollout.tasks_per_step must be at least 1"
            );
        }
        let positive = |x: f64| x.is_finite() && x > 0.0;
        if self.harness.is_empty() {
            bail!("no harness: give [harness] (or one [[harness]] table per harness)");
        }
        let mut labels = std::collections::BTreeSet::new();
        for h in &self.harness {
            if !positive(h.timeout_secs) || !positive(r.reward_timeout_secs) {
                bail!("harness.timeout_secs and rollout.reward_timeout_secs must be positive");
            }
            if let Some(name) = &h.name {
                crate::harness::find(name).with_context(|| format!("harness.name = \"{name}\""))?;
            }
            if !labels.insert(h.label()) {
                bail!(
                    "two harnesses are labelled '{}': give each [[harness]] its own label",
                    h.label()
                );
            }
        }
        if !self.backend.exact {
            bail!(
                "backend.exact = false: graft rl trains on exact token ids; passthrough records would be re-tokenized"
            );
        }
        if self.backend.scripted.is_some() && !cfg!(feature = "testkit") {
            bail!("{SCRIPTED_NEEDS_TESTKIT}");
        }
        if self.trainer.enabled && !cfg!(feature = "trainer") {
            bail!(
                "trainer.enabled = true, but this graft was built without the 'trainer' feature (libtorch); rebuild with default features or set trainer.enabled = false"
            );
        }
        if !(self.trainer.temperature.is_finite() && self.trainer.temperature > 0.0) {
            bail!(
                "trainer.temperature = {}: the rollouts are sampled at it (an enforced session policy) and the trainer divides logits by it; use a number > 0",
                self.trainer.temperature
            );
        }
        if !(r.min_positive >= 0.0 && r.min_positive <= r.max_positive && r.max_positive <= 1.0) {
            bail!(
                "rollout.min_positive ({}) and rollout.max_positive ({}) must satisfy 0 <= min <= max <= 1",
                r.min_positive,
                r.max_positive
            );
        }
        let t = &self.trainer;
        if !(t.tis_cap.is_finite() && t.tis_cap > 0.0) {
            bail!("trainer.tis_cap = {}: use a number > 0", t.tis_cap);
        }
        if let Some(b) = &t.reject
            && !(b.low.is_finite() && b.high.is_finite() && 0.0 <= b.low && b.low < b.high)
        {
            bail!(
                "trainer.reject = {{ low = {}, high = {} }}: the bound on the trainer/rollout ratio needs 0 <= low < high (e.g. low = 0.5, high = 2.0)",
                b.low,
                b.high
            );
        }
        if !r.positive_above.is_finite() {
            bail!("rollout.positive_above must be a number");
        }
        let b = &self.backend;
        if !positive(b.health_interval_secs) || !positive(b.restart_wait_secs) {
            bail!("backend.health_interval_secs and backend.restart_wait_secs must be positive");
        }
        // vLLM's raw logprobs (its default) are recorded `pre_temperature`; the trainer
        // compares them with its own at temperature 1 (docs/trainer.md).
        if b.wire == ExactWire::Sglang && b.logprobs_mode.is_some() {
            bail!(
                "backend.logprobs_mode is vLLM's --logprobs-mode and needs backend.wire = \"vllm\"; SGLang's logprobs are after temperature: remove it"
            );
        }
        if b.wire == ExactWire::Vllm && b.urls.is_empty() && b.scripted.is_none() {
            bail!(
                "backend.wire = \"vllm\" needs backend.urls (vLLM servers, started with VLLM_SERVER_DEV_MODE=1 for weight pushes) or backend.scripted: the embedded backend (graft serve) speaks SGLang's wire; remove backend.wire to use it"
            );
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    /// `backend.scripted` loads only in a graft built with the scripted upstream; without it
    /// the load fails and says how to build one that has it.
    #[test]
    fn backend_scripted_needs_the_testkit_feature() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("rl.toml");
        std::fs::write(
            &p,
            "[run]\nout_dir = \"out\"\nsteps = 1\n[tasks]\nfile = \"tasks.jsonl\"\n[harness]\ncommand = \"true\"\n[backend]\nmodel_dir = \"m\"\nscripted = \"s.json\"\n[trainer]\nenabled = false\n",
        )
        .unwrap();
        let loaded = RlConfig::load(&p);
        if cfg!(feature = "testkit") {
            let c = loaded.unwrap();
            assert!(c.backend.scripted.unwrap().ends_with("s.json"));
        } else {
            let e = format!("{:#}", loaded.unwrap_err());
            assert!(e.contains("--features testkit"), "{e}");
        }
    }

    /// `[run] side_threads`: `own` by default, `leave-out` and `session` by name, nothing else.
    #[test]
    fn run_side_threads_defaults_to_own_and_takes_the_reconstruct_names() {
        use graft_reconstruct::threads::SideThreads;
        let run = |extra: &str| toml::from_str::<RunSection>(&format!("out_dir = \"o\"\n{extra}"));
        assert_eq!(run("").unwrap().side_threads.policy(), SideThreads::Own);
        for p in SideThreads::ALL {
            let r = run(&format!("side_threads = \"{}\"", p.as_str())).unwrap();
            assert_eq!(r.side_threads.policy(), p);
        }
        let e = run("side_threads = \"all\"").unwrap_err().to_string();
        assert!(e.contains("leave-out"), "{e}");
    }

    #[test]
    fn one_harness_or_several_each_with_a_label() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("rl.toml");
        let head = "[run]\nout_dir = \"out\"\nsteps = 1\n[tasks]\nfile = \"tasks.jsonl\"\n";
        let tail = "[backend]\nmodel_dir = \"m\"\nurls = [\"http://127.0.0.1:9\"]\n";
        let load = |harness: &str| {
            std::fs::write(&p, format!("{head}{harness}{tail}")).unwrap();
            RlConfig::load(&p).map_err(|e| format!("{e:#}"))
        };
        let one = load("[harness]\ncommand = \"true\"\nmounts = { \"/mnt/x\" = \"x\" }\n").unwrap();
        assert_eq!(one.harness.len(), 1);
        assert_eq!(one.harness[0].label(), "harness");
        assert!(one.harness[0].mounts["/mnt/x"].is_absolute());
        let two = load(
            "[[harness]]\nlabel = \"a\"\ncommand = \"true\"\n[[harness]]\nname = \"codex\"\ncommand = \"codex\"\n[[harness]]\ncommand = \"x\"\n",
        )
        .unwrap();
        let labels: Vec<&str> = two.harness.iter().map(HarnessSection::label).collect();
        assert_eq!(labels, ["a", "codex", "harness-2"]);
        // A task that names one gets it for every rollout; the others take them in turn.
        assert_eq!(two.harness_for(Some("codex"), 0).label(), "codex");
        assert_eq!(two.harness_for(Some("codex"), 2).label(), "codex");
        let turns: Vec<&str> = (0..4).map(|i| two.harness_for(None, i).label()).collect();
        assert_eq!(turns, ["a", "codex", "harness-2", "a"]);
        assert!(two.check_task_harness("t", Some("a")).is_ok());
        let e = format!("{:#}", two.check_task_harness("t", Some("zz")).unwrap_err());
        assert!(
            e.contains("'zz'") && e.contains("a, codex, harness-2"),
            "{e}"
        );
        // The table's own error comes through; duplicate labels are refused.
        let e = load("[harness]\ncommand = \"true\"\nbogus = 1\n").unwrap_err();
        assert!(e.contains("bogus"), "{e}");
        let e = load(
            "[[harness]]\ncommand = \"a\"\n[[harness]]\nlabel = \"harness-0\"\ncommand = \"b\"\n",
        )
        .unwrap_err();
        assert!(e.contains("two harnesses are labelled 'harness-0'"), "{e}");
    }

    /// `backend.wire` defaults to SGLang's; `"vllm"` needs servers to call (the embedded
    /// `graft serve` speaks SGLang's wire), and raw vLLM logprobs need temperature 1.
    #[test]
    fn backend_wire_vllm_needs_urls_and_logprobs_that_match_the_trainer() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("rl.toml");
        let head = "[run]\nout_dir = \"out\"\nsteps = 1\n[tasks]\nfile = \"tasks.jsonl\"\n[harness]\ncommand = \"true\"\n[backend]\nmodel_dir = \"m\"\n";
        let load = |rest: &str| {
            std::fs::write(&p, format!("{head}{rest}")).unwrap();
            RlConfig::load(&p).map_err(|e| format!("{e:#}"))
        };
        let urls = "urls = [\"http://127.0.0.1:8000\"]\n";
        assert_eq!(load(urls).unwrap().backend.wire, ExactWire::Sglang);
        let v = load(&format!("{urls}wire = \"vllm\"\n")).unwrap();
        assert_eq!(v.backend.wire, ExactWire::Vllm);
        let e = load("wire = \"vllm\"\n").unwrap_err();
        assert!(
            e.contains("backend.urls") && e.contains("graft serve"),
            "{e}"
        );
        let e = load(&format!("{urls}logprobs_mode = \"raw_logprobs\"\n")).unwrap_err();
        assert!(e.contains("backend.wire = \"vllm\""), "{e}");
        // Raw (pre-temperature) logprobs at a temperature other than 1 are the trainer's to
        // compare like with like, not a refusal.
        for mode in ["raw_logprobs", "processed_logprobs"] {
            load(&format!(
                "{urls}wire = \"vllm\"\nlogprobs_mode = \"{mode}\"\n[trainer]\ntemperature = 0.7\n"
            ))
            .unwrap();
        }
    }

    #[test]
    fn the_example_configs_are_valid() {
        let ex = Path::new(env!("CARGO_MANIFEST_DIR")).join("examples/rl");
        let cpu = RlConfig::load(&ex.join("rl.toml")).unwrap();
        assert!(cpu.backend.urls.is_empty() && cpu.backend.scripted.is_none());
        assert!(cpu.backend.model_dir.ends_with("models/smollm2"));
        assert_eq!(cpu.harness[0].mounts.len(), 1);
        let cluster = RlConfig::load(&ex.join("rl-cluster.toml")).unwrap();
        assert_eq!(cluster.backend.urls.len(), 4);
        assert_eq!(
            cluster.envd.api_key.as_deref(),
            Some("env::GRAFT_ENVD_API_KEY")
        );
        // Both read the same task file.
        assert_eq!(cpu.tasks.map(|t| t.file), cluster.tasks.map(|t| t.file));
    }
}

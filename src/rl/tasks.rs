//! The task set: JSONL, one task per line:
//!
//! ```json
//! {"id": "add-17-25", "prompt": "Write 17+25 into answer.txt.",
//!  "setup": ["echo 17 25 > numbers.txt"],
//!  "reward": {"command": "test \"$(cat answer.txt)\" = 42"},
//!  "rootfs": null}
//! ```
//!
//! `prompt` (or `instruction`) is what the harness is asked to do (`GRAFT_TASK_PROMPT`);
//! `setup` commands run in the sandbox before the harness; `reward.command` runs after it:
//! exit 0 → reward 1, else 0, unless `reward.parse = "stdout"`, when the last line of its
//! stdout is the reward (a number). `rootfs`/`image` pick the sandbox's filesystem.

use std::path::Path;

use anyhow::{Context, bail};
use serde::Deserialize;

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Task {
    pub id: String,
    #[serde(default, alias = "instruction")]
    pub prompt: String,
    #[serde(default)]
    pub setup: Vec<String>,
    pub reward: Reward,
    #[serde(default)]
    pub rootfs: Option<String>,
    #[serde(default)]
    pub image: Option<String>,
    /// The label of the harness all this task's rollouts run in (default: its group takes
    /// the config's harnesses in turn).
    #[serde(default)]
    pub harness: Option<String>,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Reward {
    pub command: String,
    #[serde(default)]
    pub parse: RewardParse,
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RewardParse {
    /// 1 when the command exits 0, else 0.
    #[default]
    ExitCode,
    /// The last non-empty line of stdout, as a number.
    Stdout,
}

impl Reward {
    /// The reward from the command's outcome, or why there is none.
    pub fn score(&self, exit_code: Option<i64>, stdout: &str) -> Result<f64, String> {
        match self.parse {
            RewardParse::ExitCode => match exit_code {
                Some(0) => Ok(1.0),
                Some(_) => Ok(0.0),
                None => Err("the reward command did not exit".into()),
            },
            RewardParse::Stdout => {
                let last = stdout
                    .lines()
                    .rev()
                    .find(|l| !l.trim().is_empty())
                    .unwrap_or_default()
                    .trim();
                last.parse::<f64>()
                    .ok()
                    .filter(|r| r.is_finite())
                    .ok_or_else(|| {
                        format!("the reward command's last line is not a number: '{last}'")
                    })
            }
        }
    }
}

pub fn load(path: &Path) -> anyhow::Result<Vec<Task>> {
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("cannot read the task file {}", path.display()))?;
    let mut tasks = vec![];
    let mut ids = std::collections::HashSet::new();
    for (i, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let t: Task = serde_json::from_str(line)
            .with_context(|| format!("{} line {}: not a task", path.display(), i + 1))?;
        if t.id.is_empty()
            || !t
                .id
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c))
        {
            bail!(
                "{} line {}: task id '{}' must be non-empty [A-Za-z0-9._-]",
                path.display(),
                i + 1,
                t.id
            );
        }
        if t.prompt.trim().is_empty() {
            bail!(
                "{} line {}: task '{}' has no prompt",
                path.display(),
                i + 1,
                t.id
            );
        }
        if !ids.insert(t.id.clone()) {
            bail!(
                "{} line {}: task id '{}' appears twice",
                path.display(),
                i + 1,
                t.id
            );
        }
        tasks.push(t);
    }
    if tasks.is_empty() {
        bail!("{} holds no task", path.display());
    }
    Ok(tasks)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn rewards_from_exit_codes_and_stdout() {
        let r = Reward {
            command: "true".into(),
            parse: RewardParse::ExitCode,
        };
        assert_eq!(r.score(Some(0), ""), Ok(1.0));
        assert_eq!(r.score(Some(3), ""), Ok(0.0));
        assert!(r.score(None, "").is_err());
        let r = Reward {
            command: "x".into(),
            parse: RewardParse::Stdout,
        };
        assert_eq!(r.score(Some(0), "log\n0.25\n\n"), Ok(0.25));
        assert!(r.score(Some(0), "nan").is_err());
        assert!(r.score(Some(0), "done").unwrap_err().contains("'done'"));
    }

    #[test]
    fn task_files_are_checked() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("t.jsonl");
        std::fs::write(
            &p,
            "{\"id\": \"a\", \"prompt\": \"p\", \"reward\": {\"command\": \"true\"}}\n\n{\"id\": \"b\", \"instruction\": \"q\", \"reward\": {\"command\": \"true\", \"parse\": \"stdout\"}}\n",
        )
        .unwrap();
        let t = load(&p).unwrap();
        assert_eq!(t.len(), 2);
        assert_eq!(t[1].prompt, "q");
        std::fs::write(&p, "{\"id\": \"a\", \"prompt\": \"p\", \"reward\": {\"command\": \"true\"}}\n{\"id\": \"a\", \"prompt\": \"p\", \"reward\": {\"command\": \"true\"}}\n").unwrap();
        assert!(load(&p).unwrap_err().to_string().contains("twice"));
        std::fs::write(
            &p,
            "{\"id\": \"a b\", \"prompt\": \"p\", \"reward\": {\"command\": \"true\"}}\n",
        )
        .unwrap();
        assert!(load(&p).unwrap_err().to_string().contains("'a b'"));
        std::fs::write(
            &p,
            "{\"id\": \"a\", \"prompt\": \"p\", \"reward\": {\"command\": \"true\"}, \"x\": 1}\n",
        )
        .unwrap();
        assert!(format!("{:#}", load(&p).unwrap_err()).contains("unknown field"));
    }
}

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
//! stdout is the reward (a number), or `reward.parse = "json"`, when the last line of its
//! stdout is `{"reward": 1.0, "calls": {"2": 0.5}}`: the rollout's reward plus process rewards
//! for single calls, each named by its seq in the session (1 for the harness's first model
//! call) or its call id, or `"calls": [0.1, null, 0.5]` (entry i is call i + 1; null: none).
//! `rootfs`/`image` pick the sandbox's filesystem.

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
    /// The last non-empty line of stdout, a JSON object: `reward` (a number) and optional
    /// `calls`, per-call rewards by call seq or call id.
    Json,
}

/// What a reward command gave: the rollout's reward and the per-call (process) rewards,
/// each with the call's name as the gateway's call-reward route takes it (a seq or an id).
#[derive(Debug, Clone, PartialEq)]
pub struct Score {
    pub reward: f64,
    pub calls: Vec<(String, f64)>,
}

impl From<f64> for Score {
    fn from(reward: f64) -> Self {
        Score {
            reward,
            calls: vec![],
        }
    }
}

fn finite(v: &serde_json::Value, what: &str) -> Result<f64, String> {
    v.as_f64()
        .filter(|x| x.is_finite())
        .ok_or_else(|| format!("{what} is not a finite number: {v}"))
}

fn json_score(line: &str) -> Result<Score, String> {
    let shown: String = line.chars().take(200).collect();
    let v: serde_json::Value = serde_json::from_str(line).map_err(|e| {
        format!("the reward command's last line is not a JSON object ({e}): '{shown}'")
    })?;
    let obj = v
        .as_object()
        .ok_or_else(|| format!("the reward command's last line is not a JSON object: '{shown}'"))?;
    if let Some(k) = obj.keys().find(|k| *k != "reward" && *k != "calls") {
        return Err(format!(
            "the reward command's JSON has an unknown key '{k}' (it takes \"reward\" and \"calls\")"
        ));
    }
    let reward = finite(
        obj.get("reward")
            .ok_or("the reward command's JSON has no \"reward\"")?,
        "\"reward\"",
    )?;
    let mut calls = vec![];
    match obj.get("calls") {
        None | Some(serde_json::Value::Null) => {}
        Some(serde_json::Value::Array(a)) => {
            for (i, x) in a.iter().enumerate() {
                if !x.is_null() {
                    calls.push(((i + 1).to_string(), finite(x, &format!("calls[{i}]"))?));
                }
            }
        }
        Some(serde_json::Value::Object(m)) => {
            for (k, x) in m {
                let named =
                    k.parse::<u64>().is_ok_and(|n| n > 0) || uuid::Uuid::parse_str(k).is_ok();
                if !named {
                    return Err(format!(
                        "calls key '{}' names no call: use its seq in the session (1, 2, ...) or its call id",
                        k.chars().take(80).collect::<String>()
                    ));
                }
                if !x.is_null() {
                    calls.push((k.clone(), finite(x, &format!("calls[\"{k}\"]"))?));
                }
            }
        }
        Some(other) => {
            return Err(format!(
                "\"calls\" must be an object (call seq or id → reward) or a list (by seq), not {other}"
            ));
        }
    }
    Ok(Score { reward, calls })
}

impl Reward {
    /// The reward from the command's outcome, or why there is none.
    pub fn score(&self, exit_code: Option<i64>, stdout: &str) -> Result<Score, String> {
        let last = stdout
            .lines()
            .rev()
            .find(|l| !l.trim().is_empty())
            .unwrap_or_default()
            .trim();
        match self.parse {
            RewardParse::ExitCode => match exit_code {
                Some(0) => Ok(1.0.into()),
                Some(_) => Ok(0.0.into()),
                None => Err("the reward command did not exit".into()),
            },
            RewardParse::Json => json_score(last),
            RewardParse::Stdout => last
                .parse::<f64>()
                .ok()
                .filter(|r| r.is_finite())
                .map(Score::from)
                .ok_or_else(|| format!("the reward command's last line is not a number: '{last}'")),
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
        assert_eq!(r.score(Some(0), ""), Ok(1.0.into()));
        assert_eq!(r.score(Some(3), ""), Ok(0.0.into()));
        assert!(r.score(None, "").is_err());
        let r = Reward {
            command: "x".into(),
            parse: RewardParse::Stdout,
        };
        assert_eq!(r.score(Some(0), "log\n0.25\n\n"), Ok(0.25.into()));
        assert!(r.score(Some(0), "nan").is_err());
        assert!(r.score(Some(0), "done").unwrap_err().contains("'done'"));
    }

    #[test]
    fn json_rewards_carry_per_call_rewards_by_seq_or_id() {
        let r = Reward {
            command: "x".into(),
            parse: RewardParse::Json,
        };
        let id = "0193b1c2-0000-7000-8000-000000000001";
        let s = r
            .score(
                Some(0),
                &format!("log\n{{\"reward\": 0.5, \"calls\": {{\"2\": 1, \"{id}\": -0.25}}}}\n"),
            )
            .unwrap();
        assert_eq!(s.reward, 0.5);
        let mut calls = s.calls.clone();
        calls.sort_by(|a, b| a.0.cmp(&b.0));
        assert_eq!(calls, vec![(id.to_string(), -0.25), ("2".to_string(), 1.0)]);
        let s = r
            .score(Some(1), "{\"reward\": 1, \"calls\": [0.1, null, 0.3]}")
            .unwrap();
        assert_eq!(
            s.calls,
            vec![("1".to_string(), 0.1), ("3".to_string(), 0.3)]
        );
        assert_eq!(r.score(Some(0), "{\"reward\": 2}").unwrap(), 2.0.into());
        for (bad, says) in [
            ("0.5", "not a JSON object"),
            ("{\"calls\": []}", "no \"reward\""),
            ("{\"reward\": \"1\"}", "not a finite number"),
            ("{\"reward\": 1, \"call\": []}", "unknown key 'call'"),
            (
                "{\"reward\": 1, \"calls\": {\"0\": 1}}",
                "'0' names no call",
            ),
            (
                "{\"reward\": 1, \"calls\": {\"first\": 1}}",
                "'first' names no call",
            ),
            ("{\"reward\": 1, \"calls\": [1, \"x\"]}", "calls[1]"),
            ("{\"reward\": 1, \"calls\": 3}", "must be an object"),
        ] {
            let e = r.score(Some(0), bad).unwrap_err();
            assert!(e.contains(says), "{bad}: {e}");
        }
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

//! A batch checked before anything runs: its tasks and harnesses, its sampling policy, the
//! trainer's servers; and the weight version every backend of the batch must serve.

use std::collections::HashSet;
use std::sync::Arc;

use graft_gateway::policy::SamplingPolicy;
use http::StatusCode;
use serde::Deserialize;
use serde_json::Value;

use crate::rl::config::RlConfig;
use crate::rl::tasks::Task;

/// One request: the tasks, how many rollouts per task, and what the trainer decides for
/// this batch (its weight version, harness, sampling policy, servers).
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct Batch {
    tasks: Vec<Task>,
    #[serde(default = "one")]
    group_size: usize,
    #[serde(default)]
    weight_version: Option<String>,
    /// Keep samples with tokens of another weight version than `weight_version`.
    #[serde(default)]
    allow_stale: bool,
    /// The temperature the sessions sample at (enforced); the config's by default.
    #[serde(default)]
    temperature: Option<f64>,
    /// The sessions' whole sampling policy, as the gateway takes it (instead of
    /// `temperature`).
    #[serde(default)]
    sampling: Option<Value>,
    /// The harness of the tasks that name none: a label of the config's `[[harness]]`.
    #[serde(default)]
    harness: Option<String>,
    /// The trainer's own SGLang-compatible servers; the config's backends by default.
    #[serde(default)]
    backends: Option<Vec<String>>,
}

fn one() -> usize {
    1
}

/// A checked batch: what each rollout runs with.
pub(super) struct Plan {
    pub(super) tasks: Vec<Task>,
    pub(super) group_size: usize,
    pub(super) weight_version: Option<String>,
    pub(super) allow_stale: bool,
    pub(super) cfg: Arc<RlConfig>,
    pub(super) sampling: Option<SamplingPolicy>,
    /// The batch's own servers (each session pinned to one), or none: the gateway's.
    pub(super) own_backends: Vec<String>,
    /// Every backend the batch's calls may reach (for the version check).
    pub(super) backends: Vec<String>,
}

/// Checks a batch before anything runs; the error says what is wrong with it.
///
/// `config`: the service's; `backends`: the config's (what the gateway pins sessions to by
/// default).
pub(super) fn plan(
    config: &RlConfig,
    backends: &[String],
    mut batch: Batch,
) -> Result<Plan, String> {
    if batch.tasks.is_empty() || batch.group_size == 0 {
        return Err("a batch needs at least one task and group_size >= 1".into());
    }
    let mut ids = HashSet::new();
    for t in &batch.tasks {
        if !ids.insert(t.id.as_str()) {
            return Err(format!(
                "task id '{}' is given twice; the answer has one group per task id",
                t.id
            ));
        }
    }
    let mut cfg = config.clone();
    if let Some(h) = &batch.harness {
        config
            .check_task_harness("(the batch's harness)", Some(h))
            .map_err(|e| format!("{e:#}"))?;
        for t in &mut batch.tasks {
            t.harness.get_or_insert_with(|| h.clone());
        }
    }
    for t in &batch.tasks {
        config
            .check_task_harness(&t.id, t.harness.as_deref())
            .map_err(|e| format!("{e:#}"))?;
    }
    let sampling = match (batch.sampling, batch.temperature) {
        (Some(_), Some(_)) => {
            return Err(
                "give the sampling policy as 'sampling' or only a 'temperature', not both".into(),
            );
        }
        (Some(p), None) => {
            let mut policy: SamplingPolicy = serde_json::from_value(p)
                .map_err(|e| format!("'sampling' is not a sampling policy: {e}"))?;
            match policy.temperature {
                // The trainer's log-softmax assumes the temperature sampled at.
                Some(t) => cfg.trainer.temperature = t,
                // Never the harness's own (aider sends 0): the config's, as without a policy.
                None => policy.temperature = Some(cfg.trainer.temperature),
            }
            Some(policy)
        }
        (None, Some(t)) => {
            if !t.is_finite() || t < 0.0 {
                return Err(format!("'temperature' must be a number >= 0, got {t}"));
            }
            cfg.trainer.temperature = t;
            None
        }
        (None, None) => None,
    };
    let own_backends = match batch.backends {
        None => vec![],
        Some(b) if b.is_empty() => {
            return Err(
                "'backends' is empty: name the trainer's servers, or leave it out for the config's"
                    .into(),
            );
        }
        Some(b) => b
            .iter()
            .map(|u| {
                graft_gateway::backend::sglang::check_backend_url(u).map_err(|e| e.to_string())
            })
            .collect::<Result<Vec<_>, _>>()?,
    };
    let backends = if own_backends.is_empty() {
        backends.to_vec()
    } else {
        own_backends.clone()
    };
    Ok(Plan {
        tasks: batch.tasks,
        group_size: batch.group_size,
        weight_version: batch.weight_version,
        allow_stale: batch.allow_stale,
        cfg: Arc::new(cfg),
        sampling,
        own_backends,
        backends,
    })
}

/// Every backend must report `version` (`GET /model_info`), else the batch is refused
/// before any rollout runs: 409 when one serves another version, 502 when one cannot say.
pub(super) async fn check_versions(
    backends: &[String],
    version: &str,
    keys: &crate::rl::backends::Keys,
) -> Result<(), (StatusCode, String)> {
    for b in backends {
        let info = crate::rl::backends::model_info(&keys.api(b))
            .await
            .ok_or_else(|| {
                (
                    StatusCode::BAD_GATEWAY,
                    format!("the backend {b} cannot say which weights it serves (GET /model_info and GET /get_model_info answer no model info)"),
                )
            })?;
        let serves = info.get("weight_version").and_then(Value::as_str);
        if serves != Some(version) {
            return Err((
                StatusCode::CONFLICT,
                format!(
                    "the backend {b} serves weight version {}, the batch asks for '{version}': update its weights first, or leave 'weight_version' out",
                    serves.map_or_else(|| "(none reported)".to_string(), |s| format!("'{s}'"))
                ),
            ));
        }
    }
    Ok(())
}

//! One rollout: a gateway session, a sandbox with the harness pointed at it, setup, the
//! harness run within its wall-clock budget, the reward command, the reward posted to the
//! session, the sandbox deleted and the session closed, whatever happened on the way.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use bytes::Bytes;
use graft_envd::model::{CreateSandbox, ExecRequest, GatewaySession, Mount, NetworkPolicy};
use graft_gateway::policy::SamplingPolicy;
use graft_gateway::sessions::CreateRequest;
use http::{Method, Request, header};
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use serde_json::{Value, json};

use super::config::{HarnessSection, RlConfig};
use super::tasks::Task;

/// A small JSON-over-HTTP client for the gateway's and envd's APIs.
#[derive(Clone)]
pub struct Api {
    client: Client<HttpConnector, Full<Bytes>>,
    base: String,
    /// (header, value) sent with every request.
    auth: Option<(&'static str, String)>,
}

impl Api {
    pub fn new(base: &str, auth: Option<(&'static str, String)>) -> Api {
        Api {
            client: Client::builder(TokioExecutor::new()).build_http(),
            base: base.trim_end_matches('/').to_string(),
            auth,
        }
    }

    pub fn base_url(&self) -> &str {
        &self.base
    }

    pub async fn call(
        &self,
        method: Method,
        path: &str,
        body: Option<&Value>,
    ) -> anyhow::Result<(u16, Value)> {
        let url = format!("{}{path}", self.base);
        let mut req = Request::builder().method(method.clone()).uri(&url);
        if let Some((h, v)) = &self.auth {
            req = req.header(*h, v.as_str());
        }
        let bytes = match body {
            Some(b) => {
                req = req.header(header::CONTENT_TYPE, "application/json");
                Bytes::from(b.to_string())
            }
            None => Bytes::new(),
        };
        let resp = self
            .client
            .request(req.body(Full::new(bytes))?)
            .await
            .with_context(|| format!("{method} {url} failed"))?;
        let status = resp.status().as_u16();
        let body = resp.into_body().collect().await?.to_bytes();
        let v = if body.is_empty() {
            Value::Null
        } else {
            serde_json::from_slice(&body)
                .unwrap_or_else(|_| json!({"raw": String::from_utf8_lossy(&body)}))
        };
        Ok((status, v))
    }

    /// A call that must succeed (2xx); its error names the call and the server's message.
    pub async fn ok(
        &self,
        method: Method,
        path: &str,
        body: Option<&Value>,
    ) -> anyhow::Result<Value> {
        let (status, v) = self.call(method.clone(), path, body).await?;
        if !(200..300).contains(&status) {
            let msg = v
                .pointer("/error/message")
                .and_then(Value::as_str)
                .map(str::to_string)
                .unwrap_or_else(|| v.to_string());
            bail!("{method} {}{path} answered HTTP {status}: {msg}", self.base);
        }
        Ok(v)
    }
}

/// How a rollout ended.
#[derive(Debug, Clone, PartialEq)]
pub enum Outcome {
    /// Rewarded: it can be trained on.
    Scored(f64),
    /// Past the harness's wall-clock budget: aborted, excluded.
    TimedOut,
    /// The harness ran but the reward command failed or hung: excluded.
    RewardFailed(String),
    /// Some of the session's model calls failed at the backend (it went away mid-call): not
    /// the policy's doing, so the rollout is excluded and not scored.
    BackendFailed(String),
    /// Set-up or the harness itself could not run: excluded.
    Failed(String),
}

#[derive(Debug, Clone)]
pub struct Rollout {
    pub task_id: String,
    pub group_id: String,
    pub session_id: String,
    /// The label of the harness it ran in.
    pub harness: String,
    pub outcome: Outcome,
    /// The harness's exit code (None when it timed out or never ran).
    pub harness_exit: Option<i64>,
    /// The sandbox's memory limit killed a process of the harness.
    pub harness_oom: bool,
    pub harness_secs: f64,
    pub reward_secs: f64,
    /// The tail of the harness's output, for the step log when it failed.
    pub harness_tail: String,
}

impl Rollout {
    pub fn reward(&self) -> Option<f64> {
        match self.outcome {
            Outcome::Scored(r) => Some(r),
            _ => None,
        }
    }
}

fn tail(s: &str, n: usize) -> String {
    let start = s.len().saturating_sub(n);
    let mut i = start;
    while !s.is_char_boundary(i) {
        i += 1;
    }
    s[i..].to_string()
}

/// What a rollout's gateway session gets beyond `graft rl`'s defaults (the rollout
/// service's per-request settings).
#[derive(Debug, Clone, Default)]
pub struct SessionOptions {
    /// The session's sampling policy; default: enforce the trainer's temperature.
    pub sampling: Option<SamplingPolicy>,
    /// The backend the session's calls go to (a trainer's own server); default: the
    /// gateway picks among its configured ones.
    pub backend: Option<String>,
}

/// Runs one rollout of `task` in group `group_id`. Never leaves its sandbox or its session
/// open: both are cleaned up on every path.
pub async fn run(
    cfg: &RlConfig,
    gateway: &Api,
    envd: &Api,
    task: &Task,
    group_id: &str,
    index: usize,
    opts: &SessionOptions,
) -> anyhow::Result<Rollout> {
    let h = cfg.harness_for(task.harness.as_deref(), index);
    let create = CreateRequest {
        group_id: Some(group_id.to_owned()),
        metadata: json!({"task_id": task.id, "rollout": index, "harness": h.label()}),
        // The rollouts sample at the temperature the trainer's log-softmax assumes,
        // whatever the harness asks for.
        sampling: Some(opts.sampling.clone().unwrap_or_else(|| SamplingPolicy {
            temperature: Some(cfg.trainer.temperature),
            ..SamplingPolicy::default()
        })),
        backend: opts.backend.clone(),
        ..CreateRequest::default()
    };
    let s = gateway
        .ok(
            Method::POST,
            "/graft/sessions",
            Some(&serde_json::to_value(&create)?),
        )
        .await
        .context("opening a gateway session")?;
    let session_id = s["session_id"]
        .as_str()
        .context("no session_id from the gateway")?
        .to_string();
    let api_key = s["api_key"].as_str().map(str::to_string);
    let mut r = Rollout {
        task_id: task.id.clone(),
        group_id: group_id.to_string(),
        session_id: session_id.clone(),
        harness: h.label().to_owned(),
        outcome: Outcome::Failed("not started".into()),
        harness_exit: None,
        harness_oom: false,
        harness_secs: 0.0,
        reward_secs: 0.0,
        harness_tail: String::new(),
    };
    let sandbox = create_sandbox(cfg, envd, task, &session_id, api_key.as_deref(), index).await;
    match sandbox {
        Err(e) => r.outcome = Outcome::Failed(format!("{e:#}")),
        Ok(sb) => {
            r.outcome =
                match in_sandbox(cfg, h, gateway, &session_id, envd, task, &sb, &mut r).await {
                    Ok(o) => o,
                    Err(e) => Outcome::Failed(format!("{e:#}")),
                };
            if let Err(e) = envd
                .ok(Method::DELETE, &format!("/sandboxes/{sb}"), None)
                .await
            {
                tracing::warn!(sandbox = %sb, error = %format!("{e:#}"), "could not delete a sandbox (envd's TTL reaps it)");
            }
        }
    }
    if let Outcome::Scored(reward) = r.outcome {
        gateway
            .ok(
                Method::POST,
                &format!("/graft/sessions/{session_id}/reward"),
                Some(&json!({"reward": reward, "info": {"task_id": task.id}})),
            )
            .await
            .context("posting the reward")?;
    }
    gateway
        .ok(
            Method::POST,
            &format!("/graft/sessions/{session_id}/close"),
            Some(&json!({})),
        )
        .await
        .context("closing the session")?;
    Ok(r)
}

/// envd's create body for one rollout's sandbox, built from envd's own types
/// (`graft_envd::model`): a test checks that it reads back as a `CreateSandbox`.
fn create_body(
    cfg: &RlConfig,
    task: &Task,
    session_id: &str,
    api_key: Option<&str>,
    index: usize,
) -> CreateSandbox {
    let h = cfg.harness_for(task.harness.as_deref(), index);
    let mut env = h.env.clone();
    env.insert("GRAFT_TASK_ID".into(), task.id.clone());
    env.insert("GRAFT_TASK_PROMPT".into(), task.prompt.clone());
    env.insert("GRAFT_MODEL".into(), h.model.clone());
    env.insert("GRAFT_HARNESS".into(), h.label().to_owned());
    env.insert("GRAFT_ROLLOUT_INDEX".into(), index.to_string());
    env.insert("GRAFT_RL_DIR".into(), "/mnt/rl".into());
    let mount = |source: &std::path::Path, target: &str| Mount {
        source: source.to_string_lossy().into_owned(),
        target: target.to_owned(),
    };
    let mut mounts = vec![mount(&cfg.dir, "/mnt/rl")];
    for (target, source) in &h.mounts {
        mounts.push(mount(source, target));
    }
    let session = GatewaySession {
        session_id: session_id.to_owned(),
        api_key: api_key.map(str::to_owned),
        model: Some(h.model.clone()),
        harness: h.name.clone(),
    };
    let labels: BTreeMap<String, String> = [("task".to_owned(), task.id.clone())].into();
    let e = &cfg.envd;
    CreateSandbox {
        network: Some(NetworkPolicy::Gateway),
        env,
        labels,
        ttl_secs: Some((h.timeout_secs + cfg.rollout.reward_timeout_secs + 120.0) as u64),
        gateway_session: Some(session),
        mounts,
        rootfs: task.rootfs.clone(),
        image: task.image.clone(),
        memory_mb: e.memory_mb,
        pids: e.pids,
        cpus: e.cpus,
        ..CreateSandbox::default()
    }
}

async fn create_sandbox(
    cfg: &RlConfig,
    envd: &Api,
    task: &Task,
    session_id: &str,
    api_key: Option<&str>,
    index: usize,
) -> anyhow::Result<String> {
    let body = serde_json::to_value(create_body(cfg, task, session_id, api_key, index))?;
    let v = envd
        .ok(Method::POST, "/sandboxes", Some(&body))
        .await
        .context("creating the sandbox")?;
    v["id"]
        .as_str()
        .map(str::to_string)
        .context("envd answered no sandbox id")
}

async fn exec(envd: &Api, sb: &str, command: &str, timeout: f64) -> anyhow::Result<Value> {
    let req = ExecRequest {
        command: Some(command.to_owned()),
        timeout_secs: Some(timeout),
        ..ExecRequest::default()
    };
    envd.ok(
        Method::POST,
        &format!("/sandboxes/{sb}/exec"),
        Some(&serde_json::to_value(&req)?),
    )
    .await
}

#[allow(clippy::too_many_arguments)]
async fn in_sandbox(
    cfg: &RlConfig,
    h: &HarnessSection,
    gateway: &Api,
    session_id: &str,
    envd: &Api,
    task: &Task,
    sb: &str,
    r: &mut Rollout,
) -> anyhow::Result<Outcome> {
    for (i, cmd) in task.setup.iter().enumerate() {
        let j = exec(envd, sb, cmd, h.timeout_secs).await?;
        if j["exit_code"].as_i64() != Some(0) {
            return Ok(Outcome::Failed(format!(
                "setup command {} ('{cmd}') failed ({}): {}",
                i + 1,
                j["state"],
                tail(j["stderr"].as_str().unwrap_or_default(), 400)
            )));
        }
    }
    let t = Instant::now();
    let j = exec(envd, sb, &h.command, h.timeout_secs).await?;
    r.harness_secs = t.elapsed().as_secs_f64();
    r.harness_exit = j["exit_code"].as_i64();
    r.harness_oom = j["oom_killed"].as_bool() == Some(true);
    r.harness_tail = tail(
        &format!(
            "{}{}",
            j["stdout"].as_str().unwrap_or_default(),
            j["stderr"].as_str().unwrap_or_default()
        ),
        800,
    );
    if j["timed_out"].as_bool() == Some(true) {
        return Ok(Outcome::TimedOut);
    }
    let session = gateway
        .ok(Method::GET, &format!("/graft/sessions/{session_id}"), None)
        .await
        .context("reading the session's call counts")?;
    if let Some(n) = session["upstream_errors"].as_u64().filter(|n| *n > 0) {
        return Ok(Outcome::BackendFailed(format!(
            "{n} of the session's {} model calls failed at the backend",
            session["calls"]
        )));
    }
    // A harness that crashed still gets scored: the reward command decides.
    let t = Instant::now();
    let rj = exec(
        envd,
        sb,
        &task.reward.command,
        cfg.rollout.reward_timeout_secs,
    )
    .await?;
    r.reward_secs = t.elapsed().as_secs_f64();
    if rj["timed_out"].as_bool() == Some(true) {
        return Ok(Outcome::RewardFailed(format!(
            "the reward command did not finish within {} s",
            cfg.rollout.reward_timeout_secs
        )));
    }
    let score = match task.reward.score(
        rj["exit_code"].as_i64(),
        rj["stdout"].as_str().unwrap_or_default(),
    ) {
        Ok(s) => s,
        Err(e) => return Ok(Outcome::RewardFailed(e)),
    };
    // Per-call (process) rewards go in before the rollout's own reward, which is what
    // makes the rollout trainable (and what a restart of `graft rl` takes as "finished"). A
    // call the session does not have is the reward command's mistake: the gateway names
    // it, and the rollout is excluded rather than trained with part of its rewards.
    for (call, x) in &score.calls {
        if let Err(e) = gateway
            .ok(
                Method::POST,
                &format!("/graft/sessions/{session_id}/calls/{call}/reward"),
                Some(&json!({"reward": x, "info": {"task_id": task.id}})),
            )
            .await
        {
            return Ok(Outcome::RewardFailed(format!(
                "the reward command's reward for call {call} was refused: {e:#}"
            )));
        }
    }
    Ok(Outcome::Scored(score.reward))
}

/// Waits until `url` answers `path` with a 2xx, or fails after `within`.
pub async fn wait_ready(api: &Api, path: &str, within: Duration) -> anyhow::Result<()> {
    let deadline = Instant::now() + within;
    loop {
        match api.call(Method::GET, path, None).await {
            Ok((s, _)) if (200..300).contains(&s) => return Ok(()),
            Ok((s, v)) if Instant::now() > deadline => {
                bail!("{}{path} answered HTTP {s}: {v}", api.base)
            }
            Err(e) if Instant::now() > deadline => return Err(e),
            _ => tokio::time::sleep(Duration::from_millis(100)).await,
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    /// envd rejects unknown keys: the body as sent must read back as its `CreateSandbox`,
    /// with every field where envd looks for it.
    #[test]
    fn the_create_body_is_an_envd_create_sandbox() {
        let ex = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("examples/rl/rl.toml");
        let mut cfg = RlConfig::load(&ex).unwrap();
        cfg.envd.memory_mb = Some(512);
        cfg.envd.pids = Some(64);
        cfg.envd.cpus = Some(1.5);
        cfg.harness[0].name = Some("codex".into());
        let task = Task {
            id: "t1".into(),
            prompt: "do it".into(),
            setup: vec![],
            reward: serde_json::from_value(json!({"command": "true"})).unwrap(),
            rootfs: Some("/rootfs".into()),
            image: None,
            harness: None,
        };
        let body =
            serde_json::to_value(create_body(&cfg, &task, "sess-1", Some("key-1"), 3)).unwrap();
        let c: CreateSandbox = serde_json::from_value(body).unwrap();
        assert_eq!(c.network, Some(NetworkPolicy::Gateway));
        assert_eq!(c.memory_mb, Some(512));
        assert_eq!(c.pids, Some(64));
        assert_eq!(c.cpus, Some(1.5));
        assert_eq!(c.rootfs.as_deref(), Some("/rootfs"));
        assert_eq!(c.image, None);
        assert_eq!(c.labels["task"], "t1");
        assert_eq!(c.env["GRAFT_ROLLOUT_INDEX"], "3");
        assert_eq!(c.env["GRAFT_TASK_PROMPT"], "do it");
        let gs = c.gateway_session.unwrap();
        assert_eq!(gs.session_id, "sess-1");
        assert_eq!(gs.api_key.as_deref(), Some("key-1"));
        assert_eq!(gs.harness.as_deref(), Some("codex"));
        assert_eq!(c.mounts[0].target, "/mnt/rl");
        assert_eq!(c.mounts.len(), 1 + cfg.harness[0].mounts.len());
        assert_eq!(
            c.ttl_secs,
            Some((cfg.harness[0].timeout_secs + cfg.rollout.reward_timeout_secs + 120.0) as u64)
        );
    }

    #[test]
    fn the_exec_body_is_an_envd_exec_request() {
        let req = ExecRequest {
            command: Some("echo hi".into()),
            timeout_secs: Some(5.0),
            ..ExecRequest::default()
        };
        let v = serde_json::to_value(&req).unwrap();
        let back: ExecRequest = serde_json::from_value(v).unwrap();
        assert_eq!(back, req);
    }
}

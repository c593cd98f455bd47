//! Start-up: the run's components in this process (the backend: given URLs, the scripted
//! upstream or an embedded `graft serve`; the exact-mode gateway; envd, given or local) and
//! their stop. `graft rollouts serve` starts the same components (`super::start`).

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use graft_gateway::{BackendConfig, ExactConfig, Gateway, GatewayConfig};

use super::backends::{self, Shared};
use super::config::RlConfig;
use super::rollout::{self, Api};

/// The running components.
pub(crate) struct Components {
    pub(crate) gateway: Api,
    pub(crate) gateway_url: String,
    pub(crate) envd: Api,
    pub(crate) backends: Vec<String>,
    /// The backends' health and weights, shared by the step loop and the watchdog.
    pub(super) shared: Arc<Shared>,
    stops: Vec<tokio::sync::oneshot::Sender<()>>,
    tasks: Vec<tokio::task::JoinHandle<()>>,
    /// Servers without a stop signal (the scripted backend): aborted at the end.
    aborts: Vec<tokio::task::JoinHandle<()>>,
    /// The embedded `graft serve`'s engine (new weights are handed to it in memory).
    pub(super) engine: Option<EngineHandle>,
}

#[cfg(feature = "trainer")]
pub(super) type EngineHandle = Arc<graft_trainer::engine::Engine>;
#[cfg(not(feature = "trainer"))]
pub(super) type EngineHandle = ();

impl Components {
    /// Stops the gateway and envd (they drain and flush), then whatever has no stop signal.
    pub(crate) async fn stop(self) {
        for s in self.stops {
            let _ = s.send(());
        }
        for mut t in self.tasks {
            if tokio::time::timeout(Duration::from_secs(30), &mut t)
                .await
                .is_err()
            {
                t.abort();
            }
        }
        for t in self.aborts {
            t.abort();
        }
    }
}

/// `graft serve` on the policy's weights, in this process: the embedded backend.
#[cfg(feature = "trainer")]
async fn start_serve(
    cfg: &RlConfig,
    aborts: &mut Vec<tokio::task::JoinHandle<()>>,
) -> anyhow::Result<(Vec<String>, Option<EngineHandle>)> {
    let model = cfg
        .trainer
        .model
        .clone()
        .unwrap_or_else(|| cfg.backend.model_dir.clone());
    let serve_cfg = crate::serve::ServeConfig {
        max_batch: cfg.rollout.concurrency.max(1),
        ..crate::serve::ServeConfig::new(model, ([127, 0, 0, 1], 0).into())
    };
    let (addr, device, engine, serve) = crate::serve::start(&serve_cfg).await?;
    println!("embedded backend: graft serve on {device:?}");
    aborts.push(tokio::spawn(async move {
        if let Err(e) = serve.await {
            tracing::error!(error = %format!("{e:#}"), "the embedded graft serve stopped");
        }
    }));
    Ok((vec![format!("http://{addr}")], Some(engine)))
}

#[cfg(not(feature = "trainer"))]
async fn start_serve(
    _cfg: &RlConfig,
    _aborts: &mut Vec<tokio::task::JoinHandle<()>>,
) -> anyhow::Result<(Vec<String>, Option<EngineHandle>)> {
    anyhow::bail!(
        "no backend: give backend.urls (SGLang-compatible servers); the embedded `graft serve` needs a graft built with the 'trainer' feature"
    )
}

/// The scripted upstream in this process (`backend.scripted`): it goes away with it,
/// whatever happens.
#[cfg(feature = "testkit")]
async fn start_scripted(
    cfg: &RlConfig,
    script: &Path,
    aborts: &mut Vec<tokio::task::JoinHandle<()>>,
) -> anyhow::Result<Vec<String>> {
    // It wants the keys the config gives, as an SGLang started with them would.
    let keys = backends::Keys::of(&cfg.backend)?;
    let args = graft_testkit::ScriptedArgs {
        listen: ([127, 0, 0, 1], 0).into(),
        script: Some(script.to_path_buf()),
        expect_key: keys.api,
        admin_key: keys.admin,
        sglang_version: "0.5.23".into(),
        legacy_info_routes: false,
        vllm_version: "0.34.0".into(),
        // It plays the wire the config names; a vLLM one can take pushes.
        vllm_dev_mode: cfg.backend.wire == graft_gateway::config::ExactWire::Vllm,
        chunk_delay_ms: 0,
        models: vec!["scripted".into()],
        tokenizer: Some(cfg.backend.model_dir.clone()),
    };
    let (addr, serve) = graft_testkit::start(&args).await?;
    aborts.push(tokio::spawn(async move {
        if let Err(e) = serve.await {
            tracing::error!(error = %format!("{e:#}"), "the scripted backend stopped");
        }
    }));
    Ok(vec![format!("http://{addr}")])
}

/// Without the `testkit` feature there is no scripted upstream; the config's validation
/// already refused `backend.scripted`.
#[cfg(not(feature = "testkit"))]
async fn start_scripted(
    _cfg: &RlConfig,
    _script: &Path,
    _aborts: &mut Vec<tokio::task::JoinHandle<()>>,
) -> anyhow::Result<Vec<String>> {
    anyhow::bail!("{}", super::config::SCRIPTED_NEEDS_TESTKIT)
}

pub(crate) async fn start(cfg: &RlConfig) -> anyhow::Result<Components> {
    let mut stops = vec![];
    let mut tasks = vec![];
    let mut aborts = vec![];
    // The backend.
    let mut engine = None;
    let backends = if !cfg.backend.urls.is_empty() {
        cfg.backend.urls.clone()
    } else if let Some(script) = &cfg.backend.scripted {
        start_scripted(cfg, script, &mut aborts).await?
    } else {
        let (urls, e) = start_serve(cfg, &mut aborts).await?;
        engine = e;
        urls
    };
    let keys = backends::Keys::of(&cfg.backend)?;
    for b in &backends {
        rollout::wait_ready(&keys.api(b), "/health", Duration::from_secs(30))
            .await
            .with_context(|| format!("the backend {b} does not answer GET /health"))?;
        // Pushes to vLLM need its development routes: say so now, not after a step.
        if cfg.trainer.enabled {
            backends::check_pushable(cfg.backend.wire, b, &keys).await?;
        }
    }
    // The gateway, exact mode, in this process.
    let data_dir = cfg.run.out_dir.join("data");
    let mut exact = ExactConfig::new(cfg.backend.model_dir.clone(), backends.clone())?;
    exact.backend_api_key = keys.api.clone();
    exact.admin_api_key = keys.admin.clone();
    exact.wire = cfg.backend.wire;
    exact.logprobs = cfg.backend.wire.logprob_kind(cfg.backend.logprobs_mode);
    let mut gcfg = GatewayConfig::new(BackendConfig::Sglang(exact))?;
    gcfg.server.listen = ([127, 0, 0, 1], 0).into();
    gcfg.recorder.data_dir = data_dir;
    // Closed: the admin API behind the key the gateway keeps in OUT/data/admin.key (where an
    // operator finds it for /ui), model calls behind each session's key.
    gcfg.auth.require_client_key = true;
    let gw = Gateway::bind(gcfg).await?;
    let gateway_url = gw.url();
    let admin = gw
        .admin_key()
        .context("the run's gateway has no admin key")?
        .to_string();
    let (tx, rx) = tokio::sync::oneshot::channel::<()>();
    stops.push(tx);
    tasks.push(tokio::spawn(async move {
        if let Err(e) = gw
            .serve(async {
                let _ = rx.await;
            })
            .await
        {
            tracing::error!(error = %e, "the gateway stopped");
        }
    }));
    let gateway = Api::new(
        &gateway_url,
        Some(("authorization", format!("Bearer {admin}"))),
    );
    // envd: given, or local in this process.
    let envd = match &cfg.envd.url {
        Some(u) => {
            let key = match cfg.envd.api_key.as_deref() {
                Some(k) => Some(match k.strip_prefix("env::") {
                    Some(var) => std::env::var(var).with_context(|| {
                        format!(
                            "envd.api_key names the environment variable {var}, which is not set"
                        )
                    })?,
                    None => k.to_string(),
                }),
                None => None,
            };
            Api::new(u, key.map(|k| ("x-api-key", k)))
        }
        None => {
            // A local envd in this process: its sandboxes die with it (bubblewrap
            // --die-with-parent), so a killed run leaves nothing running.
            let key = format!("envd-{}", uuid::Uuid::new_v4().simple());
            let gw_addr: std::net::SocketAddr = gateway_url
                .trim_start_matches("http://")
                .parse()
                .context("the gateway's address")?;
            let mut ecfg = graft_envd::EnvdConfig::new(
                ([127, 0, 0, 1], 0).into(),
                cfg.run.out_dir.join("envd"),
                key.clone(),
                crate::envd::agent_command(None)?,
            );
            ecfg.gateway = Some(gw_addr);
            ecfg.harnesses = Some(crate::envd::harness_renderer());
            if let Some(uid) = cfg.envd.sandbox_uid {
                ecfg.sandbox_uid = uid;
                ecfg.sandbox_gid = uid;
            }
            if let Some(m) = cfg.envd.memory_mb {
                ecfg.defaults.memory_mb = m;
            }
            if let Some(p) = cfg.envd.pids {
                ecfg.defaults.pids = p;
            }
            if let Some(c) = cfg.envd.cpus {
                ecfg.defaults.cpus = c;
            }
            let envd = graft_envd::Envd::bind(ecfg)
                .await
                .context("envd could not start")?;
            let url = envd.url();
            let (tx, rx) = tokio::sync::oneshot::channel::<()>();
            stops.push(tx);
            tasks.push(tokio::spawn(async move {
                envd.serve(async {
                    let _ = rx.await;
                })
                .await;
            }));
            Api::new(&url, Some(("x-api-key", key)))
        }
    };
    rollout::wait_ready(&envd, "/healthz", Duration::from_secs(30))
        .await
        .context("envd does not answer GET /healthz")?;
    let shared = Arc::new(Shared::new(keys));
    aborts.push(tokio::spawn(backends::watch(
        cfg.clone(),
        gateway.clone(),
        backends.clone(),
        shared.clone(),
    )));
    Ok(Components {
        gateway,
        gateway_url,
        envd,
        backends,
        shared,
        stops,
        tasks,
        aborts,
        engine,
    })
}

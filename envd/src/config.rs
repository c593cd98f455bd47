//! envd's runtime configuration (the CLI fills it from flags and environment).

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

/// What a harness needs to be pointed at a gateway session from inside a sandbox.
#[derive(Debug, Clone)]
pub struct HarnessRequest {
    pub harness: String,
    /// The session's base URL as the sandbox sees it (`http://127.0.0.1:PORT/s/<id>/v1`).
    pub base_url: String,
    pub api_key: String,
    pub model: String,
}

/// A harness's variables and config files (paths relative to the workspace), filled.
#[derive(Debug, Clone, Default)]
pub struct RenderedHarness {
    pub env: Vec<(String, String)>,
    pub files: Vec<(String, String)>,
}

type RenderFn = dyn Fn(&HarnessRequest) -> Result<RenderedHarness, String> + Send + Sync;

/// Fills a harness's templates. envd knows no harness: the CLI wires this to the
/// repository's `harness-configs/`.
#[derive(Clone)]
pub struct HarnessRenderer(pub Arc<RenderFn>);

impl std::fmt::Debug for HarnessRenderer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("HarnessRenderer")
    }
}

/// How to start the in-sandbox agent: an executable on the host (bind-mounted read-only
/// into every sandbox) and the arguments that select the agent mode (`["envd", "agent"]`
/// for the `graft` binary, none for the standalone `envd-agent`).
#[derive(Debug, Clone)]
pub struct AgentCommand {
    pub exe: PathBuf,
    pub args: Vec<String>,
}

/// Limits a sandbox gets when its create request names none.
#[derive(Debug, Clone, Copy)]
pub struct DefaultLimits {
    pub memory_mb: u64,
    pub pids: u64,
    pub cpus: f64,
}

/// Where sandboxes run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum BackendKind {
    /// bubblewrap + cgroups on this host (the default).
    Local,
    /// A Pod per sandbox on a Kubernetes cluster (`[kubernetes]` settings).
    Kubernetes,
}

/// The Kubernetes backend's settings (`[kubernetes]` in envd.toml).
#[derive(Debug, Clone)]
pub struct KubeConfig {
    /// Namespace of the sandbox Pods; the client's default namespace when unset (in a Pod:
    /// envd's own).
    pub namespace: Option<String>,
    /// Tells this envd's Pods from another envd's in the same namespace (label
    /// `graft.dev/envd`); the reaper deletes every Pod with this label that it does not
    /// know.
    pub instance: String,
    /// Image holding the static `envd-agent` (the init container copies it into the Pod).
    pub agent_image: String,
    /// Path of the agent binary inside `agent_image`.
    pub agent_image_path: String,
    pub agent_port: u16,
    /// `imagePullPolicy` of both containers (`Always`, `IfNotPresent`, `Never`); unset:
    /// Kubernetes' default.
    pub image_pull_policy: Option<String>,
    /// Image of a sandbox whose create request names none; unset: `image` is required.
    pub default_image: Option<String>,
    /// How long exec and files calls wait for a new sandbox's Pod to become ready.
    pub ready_timeout: Duration,
    /// How often the cluster is listed for Pods and NetworkPolicies no sandbox owns.
    pub reconcile_interval: Duration,
    /// Labels of envd's own Pods: the only peers allowed to reach a sandbox's agent port.
    /// Empty: any source may connect (the per-sandbox token still guards every call).
    pub envd_pod_labels: BTreeMap<String, String>,
    /// The gateway as a NetworkPolicy peer: its Pods' labels (and namespace labels).
    /// Empty: an ipBlock of the gateway's address (`gateway`), which works for a gateway
    /// outside the cluster but not for a Service IP.
    pub gateway_pod_labels: BTreeMap<String, String>,
    pub gateway_namespace_labels: BTreeMap<String, String>,
    pub run_as_user: Option<i64>,
    /// `runtimeClassName` of sandbox Pods (gVisor, Kata: a stronger boundary than runc).
    pub runtime_class: Option<String>,
    /// Drop every Linux capability in the sandbox container (a root process inside
    /// cannot chown, setuid, bind low ports, ...). On by default.
    pub drop_all_capabilities: bool,
    /// `sizeLimit` of the workspace `emptyDir`.
    pub workspace_size_mb: Option<u64>,
}

impl Default for KubeConfig {
    fn default() -> Self {
        KubeConfig {
            namespace: None,
            instance: "envd".to_owned(),
            agent_image: String::new(),
            agent_image_path: "/envd-agent".to_owned(),
            agent_port: 7071,
            image_pull_policy: None,
            default_image: None,
            ready_timeout: Duration::from_secs(300),
            reconcile_interval: Duration::from_secs(30),
            envd_pod_labels: BTreeMap::from([(
                "app.kubernetes.io/name".to_owned(),
                "graft-envd".to_owned(),
            )]),
            gateway_pod_labels: BTreeMap::new(),
            gateway_namespace_labels: BTreeMap::new(),
            run_as_user: None,
            runtime_class: None,
            drop_all_capabilities: true,
            workspace_size_mb: None,
        }
    }
}

#[derive(Debug, Clone)]
pub struct EnvdConfig {
    pub listen: SocketAddr,
    pub backend: BackendKind,
    pub kubernetes: KubeConfig,
    pub data_dir: PathBuf,
    /// The key every request but `/healthz` and `/openapi.json` must send in `X-API-Key`.
    pub api_key: String,
    /// graft's gateway (`host:port`); sandboxes with network policy `gateway` reach it as
    /// `127.0.0.1:{sandbox_gateway_port}` inside. `None`: no sandbox can reach it.
    pub gateway: Option<SocketAddr>,
    pub sandbox_gateway_port: u16,
    /// Host uid/gid the sandboxed processes run as (when envd runs as root).
    pub sandbox_uid: u32,
    pub sandbox_gid: u32,
    pub bwrap: PathBuf,
    pub agent: AgentCommand,
    pub defaults: DefaultLimits,
    pub default_ttl: Duration,
    pub max_ttl: Duration,
    pub reap_interval: Duration,
    /// Largest file the files API accepts (and the largest request body).
    pub max_file_bytes: usize,
    /// Default (and largest) stdout/stderr kept per exec, each.
    pub max_output_bytes: usize,
    pub default_exec_timeout: Duration,
    pub max_exec_timeout: Duration,
    /// Time between SIGTERM and SIGKILL when an exec times out.
    pub kill_grace: Duration,
    /// Fills `gateway_session.harness` on create; `None`: naming a harness is an error.
    pub harnesses: Option<HarnessRenderer>,
}

impl EnvdConfig {
    /// A config with the defaults, for `listen`, `data_dir`, `api_key` and the agent.
    pub fn new(
        listen: SocketAddr,
        data_dir: PathBuf,
        api_key: String,
        agent: AgentCommand,
    ) -> Self {
        EnvdConfig {
            listen,
            backend: BackendKind::Local,
            kubernetes: KubeConfig::default(),
            data_dir,
            api_key,
            gateway: None,
            sandbox_gateway_port: 4000,
            sandbox_uid: 100_000,
            sandbox_gid: 100_000,
            bwrap: PathBuf::from("bwrap"),
            agent,
            defaults: DefaultLimits {
                memory_mb: 2048,
                pids: 512,
                cpus: 1.0,
            },
            default_ttl: Duration::from_secs(600),
            max_ttl: Duration::from_secs(24 * 3600),
            reap_interval: Duration::from_secs(1),
            max_file_bytes: 64 << 20,
            max_output_bytes: 1 << 20,
            default_exec_timeout: Duration::from_secs(600),
            max_exec_timeout: Duration::from_secs(24 * 3600),
            kill_grace: Duration::from_secs(2),
            harnesses: None,
        }
    }
}

/// `envd.toml`: every setting of `graft envd` (flags override it). Unknown keys are errors;
/// the API key may be a reference `env::NAME` to an environment variable.
/// `envd/envd.example.toml` lists every key with its default.
#[derive(Debug, Clone, Default, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FileConfig {
    pub listen: Option<SocketAddr>,
    pub backend: Option<BackendKind>,
    pub data_dir: Option<PathBuf>,
    pub api_key: Option<String>,
    /// graft's gateway: `HOST:PORT` or `http://HOST:PORT`.
    pub gateway: Option<String>,
    pub sandbox_gateway_port: Option<u16>,
    pub sandbox_uid: Option<u32>,
    pub sandbox_gid: Option<u32>,
    pub bwrap: Option<PathBuf>,
    pub agent: Option<PathBuf>,
    #[serde(default)]
    pub defaults: FileDefaults,
    #[serde(default)]
    pub limits: FileLimits,
    #[serde(default)]
    pub kubernetes: FileKube,
}

#[derive(Debug, Clone, Default, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FileKube {
    pub namespace: Option<String>,
    pub instance: Option<String>,
    pub agent_image: Option<String>,
    pub agent_image_path: Option<String>,
    pub agent_port: Option<u16>,
    pub image_pull_policy: Option<String>,
    pub default_image: Option<String>,
    pub ready_timeout_secs: Option<u64>,
    pub reconcile_interval_secs: Option<u64>,
    pub envd_pod_labels: Option<BTreeMap<String, String>>,
    pub gateway_pod_labels: Option<BTreeMap<String, String>>,
    pub gateway_namespace_labels: Option<BTreeMap<String, String>>,
    pub run_as_user: Option<i64>,
    pub runtime_class: Option<String>,
    pub drop_all_capabilities: Option<bool>,
    pub workspace_size_mb: Option<u64>,
}

impl FileKube {
    fn apply(&self, k: &mut KubeConfig) {
        let FileKube {
            namespace,
            instance,
            agent_image,
            agent_image_path,
            agent_port,
            image_pull_policy,
            default_image,
            ready_timeout_secs,
            reconcile_interval_secs,
            envd_pod_labels,
            gateway_pod_labels,
            gateway_namespace_labels,
            run_as_user,
            runtime_class,
            drop_all_capabilities,
            workspace_size_mb,
        } = self.clone();
        k.namespace = namespace.or(k.namespace.take());
        k.instance = instance.unwrap_or(std::mem::take(&mut k.instance));
        k.agent_image = agent_image.unwrap_or(std::mem::take(&mut k.agent_image));
        k.agent_image_path = agent_image_path.unwrap_or(std::mem::take(&mut k.agent_image_path));
        k.agent_port = agent_port.unwrap_or(k.agent_port);
        k.image_pull_policy = image_pull_policy.or(k.image_pull_policy.take());
        k.default_image = default_image.or(k.default_image.take());
        if let Some(v) = ready_timeout_secs {
            k.ready_timeout = Duration::from_secs(v);
        }
        if let Some(v) = reconcile_interval_secs {
            k.reconcile_interval = Duration::from_secs(v.max(1));
        }
        if let Some(v) = envd_pod_labels {
            k.envd_pod_labels = v;
        }
        if let Some(v) = gateway_pod_labels {
            k.gateway_pod_labels = v;
        }
        if let Some(v) = gateway_namespace_labels {
            k.gateway_namespace_labels = v;
        }
        k.run_as_user = run_as_user.or(k.run_as_user);
        k.runtime_class = runtime_class.or(k.runtime_class.take());
        k.drop_all_capabilities = drop_all_capabilities.unwrap_or(k.drop_all_capabilities);
        k.workspace_size_mb = workspace_size_mb.or(k.workspace_size_mb);
    }
}

#[derive(Debug, Clone, Default, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FileDefaults {
    pub memory_mb: Option<u64>,
    pub pids: Option<u64>,
    pub cpus: Option<f64>,
    pub ttl_secs: Option<u64>,
    pub exec_timeout_secs: Option<f64>,
}

#[derive(Debug, Clone, Default, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FileLimits {
    pub max_ttl_secs: Option<u64>,
    pub max_exec_timeout_secs: Option<f64>,
    pub max_file_bytes: Option<usize>,
    pub max_output_bytes: Option<usize>,
    pub kill_grace_secs: Option<f64>,
    pub reap_interval_ms: Option<u64>,
}

impl FileConfig {
    pub fn load(path: &std::path::Path) -> Result<Self, crate::StartError> {
        let err = |m: String| crate::StartError::Config(format!("{}: {m}", path.display()));
        let text =
            std::fs::read_to_string(path).map_err(|e| err(format!("cannot read it: {e}")))?;
        toml::from_str(&text).map_err(|e| err(e.to_string()))
    }

    /// The API key, with `env::NAME` resolved.
    pub fn resolved_api_key(&self) -> Result<Option<String>, crate::StartError> {
        match self.api_key.as_deref() {
            None => Ok(None),
            Some(k) => match k.strip_prefix("env::") {
                Some(var) => std::env::var(var).map(Some).map_err(|_| {
                    crate::StartError::Config(format!(
                        "api_key refers to the environment variable {var}, which is not set; export it or put the key in the file"
                    ))
                }),
                None => Ok(Some(k.to_owned())),
            },
        }
    }

    /// Applies the file's settings on top of `cfg` (flags are applied after this).
    pub fn apply(&self, cfg: &mut EnvdConfig) -> Result<(), crate::StartError> {
        fn secs(v: f64, key: &str) -> Result<Duration, crate::StartError> {
            if v.is_finite() && (0.0..=30.0 * 86_400.0).contains(&v) {
                Ok(Duration::from_secs_f64(v))
            } else {
                Err(crate::StartError::Config(format!(
                    "{key} = {v}: give a number of seconds from 0 to 2592000"
                )))
            }
        }
        if let Some(v) = self.listen {
            cfg.listen = v;
        }
        if let Some(v) = self.backend {
            cfg.backend = v;
        }
        self.kubernetes.apply(&mut cfg.kubernetes);
        if let Some(v) = &self.data_dir {
            cfg.data_dir = v.clone();
        }
        if let Some(k) = self.resolved_api_key()? {
            cfg.api_key = k;
        }
        if let Some(g) = &self.gateway {
            cfg.gateway = Some(parse_gateway(g).map_err(crate::StartError::Config)?);
        }
        if let Some(v) = self.sandbox_gateway_port {
            cfg.sandbox_gateway_port = v;
        }
        if let Some(v) = self.sandbox_uid {
            cfg.sandbox_uid = v;
            cfg.sandbox_gid = v;
        }
        if let Some(v) = self.sandbox_gid {
            cfg.sandbox_gid = v;
        }
        if let Some(v) = &self.bwrap {
            cfg.bwrap = v.clone();
        }
        if let Some(v) = &self.agent {
            cfg.agent = AgentCommand {
                exe: v.clone(),
                args: vec![],
            };
        }
        let d = &self.defaults;
        if let Some(v) = d.memory_mb {
            cfg.defaults.memory_mb = v;
        }
        if let Some(v) = d.pids {
            cfg.defaults.pids = v;
        }
        if let Some(v) = d.cpus {
            cfg.defaults.cpus = v;
        }
        if let Some(v) = d.ttl_secs {
            cfg.default_ttl = Duration::from_secs(v);
        }
        if let Some(v) = d.exec_timeout_secs {
            cfg.default_exec_timeout = secs(v, "defaults.exec_timeout_secs")?;
        }
        let l = &self.limits;
        if let Some(v) = l.max_ttl_secs {
            cfg.max_ttl = Duration::from_secs(v);
        }
        if let Some(v) = l.max_exec_timeout_secs {
            cfg.max_exec_timeout = secs(v, "limits.max_exec_timeout_secs")?;
        }
        if let Some(v) = l.max_file_bytes {
            cfg.max_file_bytes = v;
        }
        if let Some(v) = l.max_output_bytes {
            cfg.max_output_bytes = v;
        }
        if let Some(v) = l.kill_grace_secs {
            cfg.kill_grace = secs(v, "limits.kill_grace_secs")?;
        }
        if let Some(v) = l.reap_interval_ms {
            cfg.reap_interval = Duration::from_millis(v.max(10));
        }
        Ok(())
    }
}

/// `HOST:PORT` or `http://HOST:PORT` of graft's gateway.
pub fn parse_gateway(s: &str) -> Result<SocketAddr, String> {
    use std::net::ToSocketAddrs;
    if s.starts_with("https://") {
        return Err(format!(
            "gateway {s}: envd forwards plain TCP to the gateway; give its http:// address"
        ));
    }
    let hostport = s
        .strip_prefix("http://")
        .unwrap_or(s)
        .split('/')
        .next()
        .unwrap_or_default();
    hostport
        .to_socket_addrs()
        .map_err(|e| format!("gateway {s}: expected HOST:PORT or http://HOST:PORT ({e})"))?
        .next()
        .ok_or_else(|| format!("gateway {s}: the name resolves to no address"))
}

impl EnvdConfig {
    /// Checks the settings once, at start.
    pub fn validate(&self) -> Result<(), crate::StartError> {
        let bad = |m: String| Err(crate::StartError::Config(m));
        if self.api_key.is_empty() {
            return bad("no API key: pass --api-key KEY, set GRAFT_ENVD_API_KEY, or put api_key in the config file (clients send it in X-API-Key)".to_owned());
        }
        if !(self.defaults.cpus > 0.0 && self.defaults.cpus.is_finite()) {
            return bad(format!(
                "default cpus {} must be above 0",
                self.defaults.cpus
            ));
        }
        if self.default_ttl.is_zero() || self.default_ttl > self.max_ttl {
            return bad(format!(
                "the default TTL ({} s) must be between 1 s and the max TTL ({} s)",
                self.default_ttl.as_secs(),
                self.max_ttl.as_secs()
            ));
        }
        if self.default_exec_timeout.is_zero() || self.default_exec_timeout > self.max_exec_timeout
        {
            return bad(format!(
                "the default exec timeout ({:?}) must be above 0 and at most the max ({:?})",
                self.default_exec_timeout, self.max_exec_timeout
            ));
        }
        if self.max_file_bytes == 0 || self.max_output_bytes == 0 {
            return bad("max_file_bytes and max_output_bytes must be above 0".to_owned());
        }
        if self.backend == BackendKind::Kubernetes {
            let k = &self.kubernetes;
            if k.agent_image.is_empty() {
                return bad("the kubernetes backend needs [kubernetes] agent_image: an image holding the static envd-agent (deploy/kubernetes/README.md says how to build it)".to_owned());
            }
            if !label_value_ok(&k.instance) {
                return bad(format!(
                    "[kubernetes] instance '{}' must be a Kubernetes label value (1 to 63 of A-Z a-z 0-9 - _ ., starting and ending alphanumeric)",
                    k.instance
                ));
            }
            if let Some(p) = &k.image_pull_policy
                && !["Always", "IfNotPresent", "Never"].contains(&p.as_str())
            {
                return bad(format!(
                    "[kubernetes] image_pull_policy '{p}': give Always, IfNotPresent or Never"
                ));
            }
            if k.ready_timeout.is_zero() {
                return bad("[kubernetes] ready_timeout_secs must be above 0".to_owned());
            }
        }
        Ok(())
    }
}

/// A Kubernetes label value: at most 63 of `A-Za-z0-9-_.`, alphanumeric at both ends.
fn label_value_ok(v: &str) -> bool {
    let b = v.as_bytes();
    !b.is_empty()
        && b.len() <= 63
        && b.iter()
            .all(|c| c.is_ascii_alphanumeric() || b"-_.".contains(c))
        && b[0].is_ascii_alphanumeric()
        && b[b.len() - 1].is_ascii_alphanumeric()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn base() -> EnvdConfig {
        EnvdConfig::new(
            "127.0.0.1:0".parse().unwrap(),
            PathBuf::from("d"),
            String::new(),
            AgentCommand {
                exe: PathBuf::from("a"),
                args: vec![],
            },
        )
    }

    #[test]
    fn label_values_follow_kubernetes_rules() {
        assert!(label_value_ok("envd-1.a_b"));
        for bad in ["", "-x", "x.", &"x".repeat(64)] {
            assert!(!label_value_ok(bad), "{bad}");
        }
    }

    #[test]
    fn the_example_config_is_valid_and_complete() {
        let text = include_str!("../envd.example.toml");
        let f: FileConfig = toml::from_str(text).unwrap();
        // Every key is present in the example (so it documents them all).
        for key in [
            "listen",
            "data_dir",
            "api_key",
            "gateway",
            "sandbox_gateway_port",
            "sandbox_uid",
            "sandbox_gid",
            "bwrap",
            "agent",
            "memory_mb",
            "pids",
            "cpus",
            "ttl_secs",
            "exec_timeout_secs",
            "max_ttl_secs",
            "max_exec_timeout_secs",
            "max_file_bytes",
            "max_output_bytes",
            "kill_grace_secs",
            "reap_interval_ms",
            "backend",
            "namespace",
            "instance",
            "agent_image",
            "agent_image_path",
            "agent_port",
            "image_pull_policy",
            "default_image",
            "ready_timeout_secs",
            "reconcile_interval_secs",
            "envd_pod_labels",
            "gateway_pod_labels",
            "gateway_namespace_labels",
            "run_as_user",
            "runtime_class",
            "drop_all_capabilities",
            "workspace_size_mb",
        ] {
            assert!(
                text.lines()
                    .any(|l| l.trim_start().starts_with(&format!("{key} ="))
                        || l.trim_start().starts_with(&format!("# {key} ="))),
                "envd.example.toml does not show {key}"
            );
        }
        // The example refers to GRAFT_ENVD_API_KEY; apply it with a literal key instead.
        let mut cfg = base();
        let f = FileConfig {
            api_key: Some("literal-key".to_owned()),
            ..f
        };
        f.apply(&mut cfg).unwrap();
        cfg.validate().unwrap();
        assert_eq!(cfg.api_key, "literal-key");
        assert_eq!(cfg.defaults.memory_mb, 2048);
        assert_eq!(cfg.kill_grace, Duration::from_secs(2));
        assert_eq!(cfg.backend, BackendKind::Local);
        assert_eq!(cfg.kubernetes.agent_port, 7071);
        // Switched to kubernetes, the example's [kubernetes] section is valid too.
        cfg.backend = BackendKind::Kubernetes;
        cfg.validate().unwrap();
    }

    #[test]
    fn kubernetes_settings_are_checked_at_start() {
        let mut c = base();
        c.api_key = "k".to_owned();
        c.backend = BackendKind::Kubernetes;
        let e = c.validate().unwrap_err().to_string();
        assert!(e.contains("agent_image"), "{e}");
        let f: FileConfig = toml::from_str(
            "backend = \"kubernetes\"\n[kubernetes]\nagent_image = \"reg/agent:1\"\ninstance = \"-bad\"\n",
        )
        .unwrap();
        f.apply(&mut c).unwrap();
        assert_eq!(c.kubernetes.agent_image, "reg/agent:1");
        let e = c.validate().unwrap_err().to_string();
        assert!(e.contains("instance '-bad'"), "{e}");
        let e = toml::from_str::<FileConfig>("[kubernetes]\nagent_imag = \"x\"\n")
            .unwrap_err()
            .to_string();
        assert!(e.contains("agent_imag"), "{e}");
    }

    #[test]
    fn unknown_keys_and_unset_env_references_are_errors_that_name_them() {
        let e = toml::from_str::<FileConfig>("listen = \"127.0.0.1:1\"\nmemroy_mb = 3\n")
            .unwrap_err()
            .to_string();
        assert!(e.contains("memroy_mb"), "{e}");
        let e = toml::from_str::<FileConfig>("[limits]\nmax_file_byte = 3\n")
            .unwrap_err()
            .to_string();
        assert!(e.contains("max_file_byte"), "{e}");
        let f = FileConfig {
            api_key: Some("env::GRAFT_ENVD_SURELY_UNSET_VAR".to_owned()),
            ..FileConfig::default()
        };
        let e = f.apply(&mut base()).unwrap_err().to_string();
        assert!(e.contains("GRAFT_ENVD_SURELY_UNSET_VAR"), "{e}");
        let mut c = base();
        assert!(c.validate().unwrap_err().to_string().contains("API key"));
        c.api_key = "k".to_owned();
        c.default_ttl = Duration::from_secs(10 * 24 * 3600);
        assert!(c.validate().unwrap_err().to_string().contains("TTL"));
        assert!(parse_gateway("https://x:1").is_err());
        assert_eq!(
            parse_gateway("http://127.0.0.1:8400/v1").unwrap(),
            "127.0.0.1:8400".parse::<SocketAddr>().unwrap()
        );
    }
}

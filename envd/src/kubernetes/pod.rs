//! The objects of one sandbox on the cluster: its Pod (init container installing the agent,
//! the task's image running it in server mode) and its NetworkPolicy, the rules its id and
//! labels follow, and what the watch reads from a Pod's status.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::time::Duration;

use k8s_openapi::api::core::v1::Pod;
use serde_json::json;

use super::{INSTANCE_LABEL, KubeBackend, MANAGED_BY, SANDBOX_LABEL};
use crate::error::EnvdError;
use crate::model::{Limits, NetworkPolicy, WORKSPACE};

const AGENT_DIR: &str = "/.graft/bin";
const AGENT_IN_POD: &str = "/.graft/bin/envd-agent";
const TOKEN_ENV: &str = graft_envd_agent::server::TOKEN_ENV;

/// A sandbox id that makes a valid Pod name and label: `graft-sbx-<id>` is a DNS label.
pub fn check_id(id: &str) -> Result<(), EnvdError> {
    let b = id.as_bytes();
    let ok = !b.is_empty()
        && b.len() <= 53
        && b.iter()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || *c == b'-')
        && b[0] != b'-'
        && b[b.len() - 1] != b'-';
    if ok {
        Ok(())
    } else {
        Err(EnvdError::BadRequest(format!(
            "id '{id}': on the kubernetes backend an id names a Pod, so use 1 to 53 of a-z, 0-9 and '-', not starting or ending with '-' (or leave `id` out)"
        )))
    }
}

pub fn pod_name(id: &str) -> String {
    format!("graft-sbx-{id}")
}

/// What the watch last saw of a sandbox's Pod.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct PodState {
    pub phase: String,
    pub ready: bool,
    pub ip: Option<String>,
    /// Why it is not running (image pull errors, a failed init container, eviction).
    pub reason: Option<String>,
    /// Deleted from the cluster.
    pub gone: bool,
}

impl PodState {
    pub(super) fn of(pod: &Pod) -> Self {
        let Some(st) = &pod.status else {
            return PodState {
                phase: "Pending".to_owned(),
                ..PodState::default()
            };
        };
        let ready = st
            .conditions
            .as_ref()
            .is_some_and(|c| c.iter().any(|c| c.type_ == "Ready" && c.status == "True"));
        let mut reasons = Vec::new();
        if let Some(r) = &st.reason {
            reasons.push(format!("{r}: {}", st.message.clone().unwrap_or_default()));
        }
        let statuses = st
            .init_container_statuses
            .iter()
            .flatten()
            .chain(st.container_statuses.iter().flatten());
        for cs in statuses {
            let Some(state) = &cs.state else { continue };
            if let Some(w) = &state.waiting
                && let Some(r) = &w.reason
                && r != "ContainerCreating"
                && r != "PodInitializing"
            {
                reasons.push(format!(
                    "container {} is waiting: {r} {}",
                    cs.name,
                    w.message.clone().unwrap_or_default()
                ));
            }
            if let Some(t) = &state.terminated
                && t.exit_code != 0
            {
                reasons.push(format!(
                    "container {} exited with {} ({})",
                    cs.name,
                    t.exit_code,
                    t.reason.clone().unwrap_or_default()
                ));
            }
        }
        PodState {
            phase: st.phase.clone().unwrap_or_else(|| "Pending".to_owned()),
            ready,
            ip: st.pod_ip.clone().filter(|ip| !ip.is_empty()),
            reason: (!reasons.is_empty()).then(|| reasons.join("; ").trim().to_owned()),
            gone: false,
        }
    }

    pub(super) fn terminal(&self) -> bool {
        self.gone || self.phase == "Failed" || self.phase == "Succeeded"
    }

    /// `pending`, `ready` or `failed`, as the API reports a sandbox.
    pub fn api_state(&self) -> &'static str {
        if self.terminal() {
            "failed"
        } else if self.ready && self.ip.is_some() {
            "ready"
        } else {
            "pending"
        }
    }

    pub(super) fn describe(&self) -> String {
        let mut s = if self.gone {
            "its Pod was deleted from the cluster".to_owned()
        } else {
            format!("its Pod is {}", self.phase)
        };
        if let Some(r) = &self.reason {
            s.push_str(&format!(" ({r})"));
        }
        s
    }
}

/// What a create needs from the service.
pub struct KubeCreate<'a> {
    pub id: &'a str,
    pub image: &'a str,
    pub limits: &'a Limits,
    pub network: NetworkPolicy,
    pub ttl: Duration,
}

impl KubeBackend {
    fn labels(&self, id: &str) -> BTreeMap<String, String> {
        BTreeMap::from([
            (MANAGED_BY.to_owned(), "graft-envd".to_owned()),
            (INSTANCE_LABEL.to_owned(), self.kcfg().instance.clone()),
            (SANDBOX_LABEL.to_owned(), id.to_owned()),
        ])
    }

    /// The sandbox's Pod.
    pub fn pod_spec(&self, c: &KubeCreate<'_>, token: &str) -> serde_json::Value {
        let k = self.kcfg();
        let cpu = format!("{}m", ((c.limits.cpus * 1000.0).round() as u64).max(1));
        let memory = format!("{}Mi", c.limits.memory_mb);
        let resources = json!({
            "requests": {"cpu": cpu, "memory": memory},
            "limits": {"cpu": cpu, "memory": memory},
        });
        let mut container_sc = json!({"allowPrivilegeEscalation": false});
        if k.drop_all_capabilities {
            container_sc["capabilities"] = json!({"drop": ["ALL"]});
        }
        let mut args = vec![
            AGENT_IN_POD.to_owned(),
            "serve".to_owned(),
            "--listen".to_owned(),
            format!("0.0.0.0:{}", k.agent_port),
            "--workspace".to_owned(),
            WORKSPACE.to_owned(),
            "--sandbox-id".to_owned(),
            c.id.to_owned(),
            "--max-body-bytes".to_owned(),
            (self.cfg.max_file_bytes + 64 * 1024 + self.cfg.max_output_bytes).to_string(),
        ];
        if c.network == NetworkPolicy::Gateway
            && let Some(gw) = self.cfg.gateway
        {
            args.push("--forward".to_owned());
            args.push(format!("127.0.0.1:{}={gw}", self.cfg.sandbox_gateway_port));
        }
        let mut workspace = json!({"name": "workspace", "emptyDir": {}});
        if let Some(mb) = k.workspace_size_mb {
            workspace["emptyDir"]["sizeLimit"] = json!(format!("{mb}Mi"));
        }
        let mut pod_sc = json!({"seccompProfile": {"type": "RuntimeDefault"}});
        if let Some(uid) = k.run_as_user {
            pod_sc["runAsUser"] = json!(uid);
        }
        let mut init = json!({
            "name": "envd-agent-install",
            "image": k.agent_image,
            "command": [k.agent_image_path, "install", AGENT_IN_POD],
            "resources": resources,
            "securityContext": container_sc,
            "volumeMounts": [{"name": "graft-agent", "mountPath": AGENT_DIR}],
        });
        let mut main = json!({
            "name": "sandbox",
            "image": c.image,
            "command": args,
            "workingDir": WORKSPACE,
            "env": [{"name": TOKEN_ENV, "value": token}],
            "ports": [{"name": "envd-agent", "containerPort": k.agent_port, "protocol": "TCP"}],
            "readinessProbe": {
                "httpGet": {"path": "/healthz", "port": k.agent_port},
                "periodSeconds": 1,
                "failureThreshold": 3,
            },
            "resources": resources,
            "securityContext": container_sc,
            "volumeMounts": [
                {"name": "graft-agent", "mountPath": AGENT_DIR, "readOnly": true},
                {"name": "workspace", "mountPath": WORKSPACE},
            ],
        });
        if let Some(p) = &k.image_pull_policy {
            init["imagePullPolicy"] = json!(p);
            main["imagePullPolicy"] = json!(p);
        }
        let mut spec = json!({
            "restartPolicy": "Never",
            "automountServiceAccountToken": false,
            "enableServiceLinks": false,
            "terminationGracePeriodSeconds": 1,
            "hostname": "sandbox",
            "securityContext": pod_sc,
            "initContainers": [init],
            "containers": [main],
            "volumes": [{"name": "graft-agent", "emptyDir": {}}, workspace],
        });
        if let Some(rc) = &k.runtime_class {
            spec["runtimeClassName"] = json!(rc);
        }
        json!({
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {
                "name": pod_name(c.id),
                "labels": self.labels(c.id),
                "annotations": {"graft.dev/ttl-secs": c.ttl.as_secs().to_string()},
            },
            "spec": spec,
        })
    }

    /// The sandbox's NetworkPolicy: ingress to the agent port from envd only; egress to the
    /// gateway's port (network "gateway") or nowhere (network "none").
    pub fn network_policy(&self, id: &str, network: NetworkPolicy) -> serde_json::Value {
        let k = self.kcfg();
        let mut ingress = json!({"ports": [{"protocol": "TCP", "port": k.agent_port}]});
        if !k.envd_pod_labels.is_empty() {
            ingress["from"] = json!([{"podSelector": {"matchLabels": k.envd_pod_labels}}]);
        }
        let egress = match (network, self.cfg.gateway) {
            (NetworkPolicy::Gateway, Some(gw)) => {
                let peer = if k.gateway_pod_labels.is_empty() {
                    json!({"ipBlock": {"cidr": cidr(gw)}})
                } else {
                    let mut p = json!({"podSelector": {"matchLabels": k.gateway_pod_labels}});
                    if !k.gateway_namespace_labels.is_empty() {
                        p["namespaceSelector"] = json!({"matchLabels": k.gateway_namespace_labels});
                    }
                    p
                };
                json!([{"to": [peer], "ports": [{"protocol": "TCP", "port": gw.port()}]}])
            }
            _ => json!([]),
        };
        json!({
            "apiVersion": "networking.k8s.io/v1",
            "kind": "NetworkPolicy",
            "metadata": {"name": pod_name(id), "labels": self.labels(id)},
            "spec": {
                "podSelector": {"matchLabels": {
                    INSTANCE_LABEL: k.instance,
                    SANDBOX_LABEL: id,
                }},
                "policyTypes": ["Ingress", "Egress"],
                "ingress": [ingress],
                "egress": egress,
            },
        })
    }
}

fn cidr(a: SocketAddr) -> String {
    match a {
        SocketAddr::V4(v) => format!("{}/32", v.ip()),
        SocketAddr::V6(v) => format!("{}/128", v.ip()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_follow_kubernetes_rules() {
        for ok in ["a", "sb-1", "0123456789abcdef0123456789abcdef"] {
            assert!(check_id(ok).is_ok(), "{ok}");
        }
        for bad in ["", "-a", "a-", "A", "a_b", "a.b", &"a".repeat(54)] {
            assert!(check_id(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn pod_state_reads_readiness_and_reasons_from_the_status() {
        let pod = |status: serde_json::Value| -> Pod {
            serde_json::from_value(serde_json::json!({"metadata": {"name": "p"}, "status": status}))
                .unwrap()
        };
        let s = PodState::of(&pod(serde_json::json!({
            "phase": "Running", "podIP": "10.1.2.3",
            "conditions": [{"type": "Ready", "status": "True"}]
        })));
        assert_eq!(
            (s.api_state(), s.ip.as_deref()),
            ("ready", Some("10.1.2.3"))
        );
        let s = PodState::of(&pod(serde_json::json!({
            "phase": "Running", "podIP": "10.1.2.3",
            "conditions": [{"type": "Ready", "status": "False"}]
        })));
        assert_eq!(s.api_state(), "pending");
        let s = PodState::of(&pod(
            serde_json::json!({"phase": "Failed", "reason": "Evicted", "message": "low on memory"}),
        ));
        assert_eq!(s.api_state(), "failed");
        assert!(
            s.describe().contains("Evicted: low on memory"),
            "{}",
            s.describe()
        );
    }
}

//! The backends a sandbox can run on, chosen by `--backend`: the service, jobs,
//! idempotency keys and TTLs are the same for both.

use crate::kubernetes::KubeBackend;
use crate::local::LocalBackend;

pub enum Backend {
    /// bubblewrap + cgroups on this host.
    Local(LocalBackend),
    /// A Pod per sandbox.
    Kubernetes(Box<KubeBackend>),
}

impl Backend {
    pub fn name(&self) -> &'static str {
        match self {
            Backend::Local(_) => "local",
            Backend::Kubernetes(_) => "kubernetes",
        }
    }

    /// Whether cpu and memory limits are enforced: cgroups here, the kubelet for Pods
    /// (requests = limits; a pids limit is a node setting there, not a Pod's).
    pub fn limits_enforced(&self) -> bool {
        match self {
            Backend::Local(l) => l.cgroups.enforced(),
            Backend::Kubernetes(_) => true,
        }
    }

    pub fn local(&self) -> Option<&LocalBackend> {
        match self {
            Backend::Local(l) => Some(l),
            Backend::Kubernetes(_) => None,
        }
    }

    /// What is left to clean once every sandbox is deleted.
    pub fn shutdown(&self) {
        if let Backend::Local(l) = self {
            l.cgroups.remove_group();
        }
    }
}

//! Prometheus metrics served at `/metrics` (OpenMetrics text, no key needed).

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct StateLabel {
    /// A job's end state (`exited`, `timed_out`, `killed`, `failed`).
    pub state: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ReasonLabel {
    /// Why a sandbox went: `request`, `ttl`, `shutdown`.
    pub reason: &'static str,
}

pub struct Metrics {
    registry: Registry,
    pub sandboxes: Gauge,
    pub created: Counter,
    pub deleted: Family<ReasonLabel, Counter>,
    pub jobs: Family<StateLabel, Counter>,
    pub job_seconds: Histogram,
    pub create_seconds: Histogram,
    pub oom_kills: Counter,
}

impl Metrics {
    pub fn new() -> Self {
        let mut registry = Registry::with_prefix("graft_envd");
        let m = Metrics {
            sandboxes: Gauge::default(),
            created: Counter::default(),
            deleted: Family::default(),
            jobs: Family::default(),
            // 1 ms … ~9 h
            job_seconds: Histogram::new(exponential_buckets(0.001, 2.0, 25)),
            create_seconds: Histogram::new(exponential_buckets(0.0001, 2.0, 20)),
            oom_kills: Counter::default(),
            registry: Registry::default(),
        };
        registry.register("sandboxes", "Sandboxes alive now", m.sandboxes.clone());
        registry.register("sandboxes_created", "Sandboxes created", m.created.clone());
        registry.register(
            "sandboxes_deleted",
            "Sandboxes deleted, by reason",
            m.deleted.clone(),
        );
        registry.register("jobs", "Jobs (execs) ended, by state", m.jobs.clone());
        registry.register(
            "job_seconds",
            "Job duration from start to the last process gone",
            m.job_seconds.clone(),
        );
        registry.register(
            "create_seconds",
            "Time to create a sandbox (until it is ready)",
            m.create_seconds.clone(),
        );
        registry.register(
            "oom_kills",
            "Jobs during which the OOM killer killed in their sandbox",
            m.oom_kills.clone(),
        );
        Metrics { registry, ..m }
    }

    pub fn encode(&self) -> String {
        let mut out = String::new();
        if prometheus_client::encoding::text::encode(&mut out, &self.registry).is_err() {
            out.clear();
        }
        out
    }
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

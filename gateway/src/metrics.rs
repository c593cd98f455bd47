//! Prometheus metrics served at `/metrics`.

use std::sync::Arc;
use std::time::Duration;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RequestLabels {
    pub route: &'static str,
    pub status: u16,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ErrorLabels {
    pub cause: &'static str,
    pub code: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RouteLabel {
    pub route: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct PromptLabel {
    /// `reused` (the session's earlier tokens kept, only new messages tokenized) or `full`.
    pub kind: &'static str,
}

pub struct Metrics {
    registry: Registry,
    pub requests: Family<RequestLabels, Counter>,
    pub errors: Family<ErrorLabels, Counter>,
    pub upstream_latency: Family<RouteLabel, Histogram>,
    pub overhead: Family<RouteLabel, Histogram>,
    pub ttft: Family<RouteLabel, Histogram>,
    pub fsync_latency: Histogram,
    pub fsync_batch: Histogram,
    pub record_wait: Histogram,
    pub queue_depth: Gauge,
    pub upstream_inflight: Gauge,
    pub records_written: Counter,
    /// Exact mode: time to render and tokenize a prompt, by how it was built.
    pub exact_prompt: Family<PromptLabel, Histogram>,
    /// The retry bookkeeping (`retries.rs`): attempts and bytes held, attempts forgotten.
    pub retry_memory_attempts: Gauge,
    pub retry_memory_bytes: Gauge,
    pub retry_memory_forgotten: Counter,
}

fn latency_buckets() -> impl Iterator<Item = f64> {
    // 10 µs … ~84 s
    exponential_buckets(0.000_01, 2.0, 24)
}

impl Metrics {
    pub fn new() -> Arc<Self> {
        let mut registry = Registry::with_prefix("graft");
        let requests = Family::<RequestLabels, Counter>::default();
        let errors = Family::<ErrorLabels, Counter>::default();
        let upstream_latency = Family::<RouteLabel, Histogram>::new_with_constructor(|| {
            Histogram::new(latency_buckets())
        });
        let overhead = Family::<RouteLabel, Histogram>::new_with_constructor(|| {
            Histogram::new(latency_buckets())
        });
        let ttft = Family::<RouteLabel, Histogram>::new_with_constructor(|| {
            Histogram::new(latency_buckets())
        });
        let fsync_latency = Histogram::new(latency_buckets());
        let fsync_batch = Histogram::new(exponential_buckets(1.0, 2.0, 14));
        let record_wait = Histogram::new(latency_buckets());
        let queue_depth = Gauge::default();
        let upstream_inflight = Gauge::default();
        let records_written = Counter::default();
        let exact_prompt = Family::<PromptLabel, Histogram>::new_with_constructor(|| {
            Histogram::new(latency_buckets())
        });
        registry.register(
            "exact_prompt_seconds",
            "Exact mode: rendering and tokenizing one prompt (kind=reused: earlier tokens kept; kind=full: whole conversation)",
            exact_prompt.clone(),
        );
        registry.register(
            "requests",
            "Requests answered, by route and HTTP status",
            requests.clone(),
        );
        registry.register(
            "errors",
            "Errors, by cause (client, upstream, graft) and code",
            errors.clone(),
        );
        registry.register(
            "upstream_latency_seconds",
            "Time from sending a request upstream to its last byte",
            upstream_latency.clone(),
        );
        registry.register(
            "overhead_seconds",
            "graft's own time per call: total minus upstream time minus waiting for the record fsync",
            overhead.clone(),
        );
        registry.register(
            "ttft_seconds",
            "Time to first streamed event, as seen by graft",
            ttft.clone(),
        );
        registry.register(
            "recorder_fsync_seconds",
            "WAL fsync latency",
            fsync_latency.clone(),
        );
        registry.register(
            "recorder_fsync_batch_records",
            "Records covered by one WAL fsync (group commit)",
            fsync_batch.clone(),
        );
        registry.register(
            "recorder_wait_seconds",
            "Time a response waited for its record to be durable (sync durability)",
            record_wait.clone(),
        );
        registry.register(
            "recorder_queue_depth",
            "Records queued for the WAL writer",
            queue_depth.clone(),
        );
        registry.register(
            "upstream_inflight",
            "Requests in flight to the upstream",
            upstream_inflight.clone(),
        );
        registry.register(
            "records",
            "Call records handed to the recorder",
            records_written.clone(),
        );
        let retry_memory_attempts = Gauge::default();
        let retry_memory_bytes = Gauge::default();
        let retry_memory_forgotten = Counter::default();
        registry.register(
            "retry_memory_attempts",
            "Attempts remembered to link retries, over all sessions (at most limits.retry_memory_attempts)",
            retry_memory_attempts.clone(),
        );
        registry.register(
            "retry_memory_bytes",
            "Bytes of request bodies and Idempotency-Keys remembered to link retries (at most limits.retry_memory_bytes)",
            retry_memory_bytes.clone(),
        );
        registry.register(
            "retry_memory_forgotten",
            "Attempts forgotten past limits.retry_memory_* (a later retry of one is a new turn)",
            retry_memory_forgotten.clone(),
        );
        Arc::new(Metrics {
            registry,
            requests,
            errors,
            upstream_latency,
            overhead,
            ttft,
            fsync_latency,
            fsync_batch,
            record_wait,
            queue_depth,
            upstream_inflight,
            records_written,
            exact_prompt,
            retry_memory_attempts,
            retry_memory_bytes,
            retry_memory_forgotten,
        })
    }

    pub fn observe_exact_prompt(&self, reused: bool, d: Duration) {
        self.exact_prompt
            .get_or_create(&PromptLabel {
                kind: if reused { "reused" } else { "full" },
            })
            .observe(d.as_secs_f64());
    }

    pub fn observe_fsync(&self, d: Duration, records: usize) {
        self.fsync_latency.observe(d.as_secs_f64());
        self.fsync_batch.observe(records as f64);
    }

    pub fn encode(&self) -> String {
        let mut out = String::new();
        if prometheus_client::encoding::text::encode(&mut out, &self.registry).is_err() {
            out.push_str("# encoding failed\n");
        }
        out
    }
}

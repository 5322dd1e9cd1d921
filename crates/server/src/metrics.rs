//! Prometheus metrics (DESIGN.md §9): names start with `kvfence_`, carry
//! their unit, counters end in `_total`. Labels are tenant names, reasons and
//! states — never request text (I10).

use std::sync::Mutex;

use kvfence_engine::EngineStats;
use kvfence_pool::PoolStats;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

use crate::admission::Capacity;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ReasonLabel {
    reason: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct RequestLabels {
    tenant: String,
    endpoint: String,
    status: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct PoolLabels {
    role: String,
    state: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct RoleLabel {
    role: String,
}

/// Pool counters last seen, to turn the pool's totals into counter increments.
#[derive(Default)]
struct Seen {
    stale: u64,
    foreign: u64,
    reads_refused: u64,
    quarantined: u64,
    generated: u64,
    prompt: u64,
    granted: u64,
    refused: u64,
    cancelled: u64,
    committed: u64,
    failed: u64,
    checksum_failures: u64,
    handoff_bytes: u64,
}

/// Every metric the server exports.
pub struct Metrics {
    registry: Registry,
    requests: Family<RequestLabels, Counter>,
    rejections: Family<ReasonLabel, Counter>,
    ttft: Histogram,
    duration: Histogram,
    pool_pages: Family<PoolLabels, Gauge>,
    queue_depth: Gauge,
    running: Gauge,
    stale_writes: Counter,
    foreign_writes: Counter,
    reads_refused: Counter,
    quarantined_total: Counter,
    generated_tokens: Counter,
    prompt_tokens: Counter,
    leases_granted: Counter,
    leases_refused: Counter,
    cancelled: Counter,
    handoffs: Family<ReasonLabel, Counter>,
    handoff_checksum_failures: Counter,
    handoff_bytes: Counter,
    tenant_labels: bool,
    seen: Mutex<Seen>,
}

impl std::fmt::Debug for Metrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Metrics")
    }
}

impl Metrics {
    /// Registers every metric; `capacity` and each role's pool size are
    /// fixed at start-up. Without `tenant_labels`, request counters carry an
    /// empty tenant label: a scrape does not list the tenants.
    pub fn new(
        capacity: &Capacity,
        roles: &[(&'static str, usize)],
        tenant_labels: bool,
    ) -> Metrics {
        let mut registry = Registry::with_prefix("kvfence");
        let requests = Family::<RequestLabels, Counter>::default();
        registry.register(
            "requests",
            "HTTP requests ended, by tenant, endpoint and status (an HTTP status, or cancelled when the client left first)",
            requests.clone(),
        );
        let rejections = Family::<ReasonLabel, Counter>::default();
        registry.register(
            "rejections",
            "Requests refused, by reason",
            rejections.clone(),
        );
        let ttft = Histogram::new(exponential_buckets(0.001, 2.0, 16));
        registry.register(
            "time_to_first_token_seconds",
            "Time from request to its first token",
            ttft.clone(),
        );
        let duration = Histogram::new(exponential_buckets(0.001, 2.0, 18));
        registry.register(
            "request_duration_seconds",
            "Time from request to its last byte",
            duration.clone(),
        );
        let pool_pages = Family::<PoolLabels, Gauge>::default();
        registry.register(
            "pool_pages",
            "KV pages by role and state",
            pool_pages.clone(),
        );
        let capacity_tokens = Family::<RoleLabel, Gauge>::default();
        registry.register(
            "capacity_tokens",
            "Tokens of KV each role's pool really holds",
            capacity_tokens.clone(),
        );
        let max_context: Gauge = Gauge::default();
        registry.register(
            "max_context_tokens",
            "Context advertised and enforced (I6)",
            max_context.clone(),
        );
        let context_clamped: Gauge = Gauge::default();
        registry.register(
            "context_clamped",
            "1 if --max-context was lowered to the real capacity",
            context_clamped.clone(),
        );
        let queue_depth = Gauge::default();
        registry.register(
            "queue_depth",
            "Requests waiting for KV pages",
            queue_depth.clone(),
        );
        let running = Gauge::default();
        registry.register(
            "running_requests",
            "Requests holding KV pages",
            running.clone(),
        );
        let stale_writes = Counter::default();
        registry.register(
            "handoff_stale_writes",
            "KV writes refused for a stale generation (I3)",
            stale_writes.clone(),
        );
        let foreign_writes = Counter::default();
        registry.register(
            "pool_foreign_writes",
            "KV writes refused for naming a page outside the lease (I1)",
            foreign_writes.clone(),
        );
        let reads_refused = Counter::default();
        registry.register(
            "pool_reads_refused",
            "KV reads refused for missing coverage (I2)",
            reads_refused.clone(),
        );
        let quarantined_total = Counter::default();
        registry.register(
            "pool_pages_quarantined",
            "Pages ever sent to quarantine (I4)",
            quarantined_total.clone(),
        );
        let generated_tokens = Counter::default();
        registry.register(
            "generated_tokens",
            "Completion tokens generated",
            generated_tokens.clone(),
        );
        let prompt_tokens = Counter::default();
        registry.register(
            "prompt_tokens",
            "Prompt tokens prefilled",
            prompt_tokens.clone(),
        );
        let handoffs = Family::<ReasonLabel, Counter>::default();
        registry.register(
            "handoffs",
            "KV hand-offs ended, by outcome (committed, failed)",
            handoffs.clone(),
        );
        let handoff_checksum_failures = Counter::default();
        registry.register(
            "handoff_checksum_failures",
            "Hand-off chunks refused for a bad checksum (I7)",
            handoff_checksum_failures.clone(),
        );
        let handoff_bytes = Counter::default();
        registry.register(
            "handoff_bytes",
            "KV bytes accepted through hand-offs",
            handoff_bytes.clone(),
        );
        let cancelled = Counter::default();
        registry.register(
            "requests_cancelled",
            "Requests cancelled by their client (disconnects)",
            cancelled.clone(),
        );
        let leases_granted = Counter::default();
        registry.register(
            "pool_leases_granted",
            "KV leases granted",
            leases_granted.clone(),
        );
        let leases_refused = Counter::default();
        registry.register(
            "pool_leases_refused",
            "KV leases refused (too large or pool full)",
            leases_refused.clone(),
        );

        max_context.set(capacity.max_context as i64);
        context_clamped.set(i64::from(capacity.clamped));
        for (role, tokens) in roles {
            capacity_tokens
                .get_or_create(&RoleLabel {
                    role: (*role).into(),
                })
                .set(*tokens as i64);
        }
        Metrics {
            registry,
            requests,
            rejections,
            ttft,
            duration,
            pool_pages,
            queue_depth,
            running,
            stale_writes,
            foreign_writes,
            reads_refused,
            quarantined_total,
            generated_tokens,
            prompt_tokens,
            leases_granted,
            leases_refused,
            cancelled,
            handoffs,
            handoff_checksum_failures,
            handoff_bytes,
            tenant_labels,
            seen: Mutex::new(Seen::default()),
        }
    }

    /// Counts one answered request.
    /// `status` is the HTTP status code, or `cancelled` for a request whose
    /// client left before it ended.
    pub fn request(&self, tenant: &str, endpoint: &str, status: &str) {
        self.requests
            .get_or_create(&RequestLabels {
                tenant: if self.tenant_labels {
                    tenant.into()
                } else {
                    String::new()
                },
                endpoint: endpoint.into(),
                status: status.into(),
            })
            .inc();
    }

    /// Counts one refusal.
    pub fn rejection(&self, reason: &str) {
        self.rejections
            .get_or_create(&ReasonLabel {
                reason: reason.into(),
            })
            .inc();
    }

    /// Records a time to first token.
    pub fn first_token(&self, seconds: f64) {
        self.ttft.observe(seconds);
    }

    /// Records a request's total duration.
    pub fn finished(&self, seconds: f64) {
        self.duration.observe(seconds);
    }

    /// Renders the exposition text, refreshing pool and engine gauges first.
    /// `pools` holds every worker's pool by role.
    pub fn render(&self, pools: &[(&'static str, PoolStats)], engine: &EngineStats) -> String {
        for (role, stats) in pools {
            let states = [
                ("free", stats.free_pages),
                ("leased", stats.leased_pages),
                ("quarantined", stats.quarantined_pages),
            ];
            for (state, value) in states {
                let labels = PoolLabels {
                    role: (*role).into(),
                    state: state.into(),
                };
                self.pool_pages.get_or_create(&labels).set(value as i64);
            }
        }
        let total = |field: fn(&PoolStats) -> u64| pools.iter().map(|(_, s)| field(s)).sum::<u64>();
        self.queue_depth.set(engine.queued as i64);
        self.running.set(engine.running as i64);
        let mut seen = self
            .seen
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        // Sources are monotonic totals; counters advance by the difference.
        let advance = |counter: &Counter, last: &mut u64, now: u64| {
            counter.inc_by(now.saturating_sub(*last));
            *last = now.max(*last);
        };
        let stale = total(|s| s.stale_writes_rejected) + engine.handoff_stale_messages;
        advance(&self.stale_writes, &mut seen.stale, stale);
        advance(
            &self.foreign_writes,
            &mut seen.foreign,
            total(|s| s.foreign_writes_rejected),
        );
        advance(
            &self.reads_refused,
            &mut seen.reads_refused,
            total(|s| s.reads_refused),
        );
        advance(
            &self.quarantined_total,
            &mut seen.quarantined,
            total(|s| s.pages_quarantined_total),
        );
        advance(
            &self.generated_tokens,
            &mut seen.generated,
            engine.generated_tokens,
        );
        advance(&self.prompt_tokens, &mut seen.prompt, engine.prompt_tokens);
        advance(
            &self.leases_granted,
            &mut seen.granted,
            total(|s| s.leases_granted),
        );
        advance(
            &self.leases_refused,
            &mut seen.refused,
            total(|s| s.leases_refused),
        );
        advance(&self.cancelled, &mut seen.cancelled, engine.cancelled);
        let outcome = |name: &str| {
            self.handoffs
                .get_or_create(&ReasonLabel {
                    reason: name.into(),
                })
                .clone()
        };
        advance(
            &outcome("committed"),
            &mut seen.committed,
            engine.handoffs_committed,
        );
        advance(&outcome("failed"), &mut seen.failed, engine.handoffs_failed);
        advance(
            &self.handoff_checksum_failures,
            &mut seen.checksum_failures,
            engine.handoff_checksum_failures,
        );
        advance(
            &self.handoff_bytes,
            &mut seen.handoff_bytes,
            engine.handoff_bytes,
        );
        drop(seen);
        let mut out = String::new();
        prometheus_client::encoding::text::encode(&mut out, &self.registry)
            .expect("writing to a String cannot fail");
        out
    }
}

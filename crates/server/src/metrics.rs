//! Prometheus metrics (`docs/architecture.md`): names start with `kvfence_`, carry
//! their unit, counters end in `_total`. Labels are tenant names, reasons and
//! states — never request text (I10).

use std::sync::{Arc, Mutex};

use kvfence_engine::{WaitHistogram, WorkerSnapshot};
use kvfence_pool::PoolStats;
use prometheus_client::collector::Collector;
use prometheus_client::encoding::{
    DescriptorEncoder, EncodeLabelSet, EncodeMetric, MetricEncoder, NoLabelSet,
};
use prometheus_client::metrics::MetricType;
use prometheus_client::metrics::counter::{ConstCounter, Counter};
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::{ConstGauge, Gauge};
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
struct RoleLabel {
    role: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct WorkerLabel {
    worker: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct WorkerPoolLabels {
    worker: String,
    role: String,
    state: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct WorkerReasonLabels {
    worker: String,
    reason: String,
}

fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// The pools and counters workers report, exported as they stand at each
/// scrape: counters are the workers' own totals (one that restarts starts
/// again from zero, which Prometheus reads as a counter reset), gauges
/// their current values. They are the workers' numbers, not this process's,
/// so they are encoded from the snapshot rather than kept here.
#[derive(Debug, Default)]
struct WorkerMetrics {
    latest: Mutex<Vec<WorkerSnapshot>>,
    /// Label queue waits with tenant names (else one series per worker).
    tenant_labels: bool,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct WorkerTenantLabels {
    worker: String,
    tenant: String,
}

/// A histogram a worker counted, encoded as it reported it.
#[derive(Debug)]
struct ReportedHistogram(WaitHistogram);

impl EncodeMetric for ReportedHistogram {
    fn encode(&self, mut encoder: MetricEncoder) -> Result<(), std::fmt::Error> {
        encoder.encode_histogram::<NoLabelSet>(
            self.0.sum_seconds(),
            self.0.count(),
            &self.0.buckets(),
            None,
        )
    }

    fn metric_type(&self) -> MetricType {
        MetricType::Histogram
    }
}

/// A counter every worker reports: its name, help and value.
type CounterOf = (&'static str, &'static str, fn(&WorkerSnapshot) -> u64);

/// A gauge every worker reports: its name, help and value.
type GaugeOf = (&'static str, &'static str, fn(&WorkerSnapshot) -> usize);

const WORKER_GAUGES: [GaugeOf; 2] = [
    ("queue_depth", "Requests waiting for KV pages.", |w| {
        w.engine.queued
    }),
    ("running_requests", "Requests holding KV pages.", |w| {
        w.engine.running
    }),
];

const WORKER_COUNTERS: [CounterOf; 19] = [
    (
        "handoff_stale_writes",
        "KV writes and hand-off messages refused for a stale generation or epoch (I3).",
        |w| pools_total(w, |s| s.stale_writes_rejected) + w.engine.handoff_stale_messages,
    ),
    (
        "pool_foreign_writes",
        "KV writes refused for naming a page outside the lease (I1).",
        |w| pools_total(w, |s| s.foreign_writes_rejected),
    ),
    (
        "pool_reads_refused",
        "KV reads refused for missing coverage (I2).",
        |w| pools_total(w, |s| s.reads_refused),
    ),
    (
        "pool_pages_quarantined",
        "Pages ever sent to quarantine (I4).",
        |w| pools_total(w, |s| s.pages_quarantined_total),
    ),
    ("generated_tokens", "Completion tokens generated.", |w| {
        w.engine.generated_tokens
    }),
    ("prompt_tokens", "Prompt tokens prefilled.", |w| {
        w.engine.prompt_tokens
    }),
    (
        "handoff_checksum_failures",
        "Hand-off chunks refused for a bad checksum (I7).",
        |w| w.engine.handoff_checksum_failures,
    ),
    (
        "handoff_bytes",
        "KV bytes accepted through hand-offs.",
        |w| w.engine.handoff_bytes,
    ),
    (
        "requests_preempted",
        "Running requests that gave their pages back when the pool ran out and were recomputed from their cached prefix later (never failed).",
        |w| w.engine.preempted,
    ),
    (
        "express_steps",
        "Steps run for newly arrived prompts of tenants with no work in the step in flight, while that step paused between two layers.",
        |w| w.engine.express_steps,
    ),
    (
        "requests_queue_timed_out",
        "Requests refused (503) after waiting in a worker's queue past --max-queue-wait-ms.",
        |w| w.engine.queue_timeouts,
    ),
    (
        "requests_shed",
        "Sheddable requests (negative priority) refused (503, or 429 at a half-full queue) to make way for others.",
        |w| w.engine.shed,
    ),
    (
        "requests_cancelled",
        "Requests cancelled by their client (disconnects).",
        |w| w.engine.cancelled,
    ),
    ("pool_leases_granted", "KV leases granted.", |w| {
        pools_total(w, |s| s.leases_granted)
    }),
    (
        "pool_leases_refused",
        "KV leases refused (too large or pool full).",
        |w| pools_total(w, |s| s.leases_refused),
    ),
    (
        "prefix_cache_lookups",
        "Leases that looked their prompt up in the prefix cache (totals only: never per prefix or tenant).",
        |w| pools_total(w, |s| s.cache_lookups),
    ),
    (
        "prefix_cache_hits",
        "Lookups that found a cached prefix in the request's own namespace.",
        |w| pools_total(w, |s| s.cache_hits),
    ),
    (
        "prefix_cache_hit_tokens",
        "Prompt tokens read from the prefix cache instead of computed.",
        |w| pools_total(w, |s| s.cache_hit_tokens),
    ),
    (
        "prefix_cache_evictions",
        "Shared pages evicted from the prefix cache.",
        |w| pools_total(w, |s| s.cache_evictions),
    ),
];

fn pools_total(worker: &WorkerSnapshot, field: fn(&PoolStats) -> u64) -> u64 {
    worker.pools.iter().map(|(_, s)| field(s)).sum()
}

impl Collector for WorkerMetrics {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let workers = lock(&self.latest).clone();
        let label = |w: &WorkerSnapshot| WorkerLabel {
            worker: w.worker.clone(),
        };
        {
            let mut family = encoder.encode_descriptor(
                "pool_pages",
                "KV pages by worker, role and state (shared: cached pages some request reads; cached: cached pages nobody reads, evictable; public: pinned pages of the public system prompts).",
                None,
                MetricType::Gauge,
            )?;
            for w in &workers {
                for (role, stats) in &w.pools {
                    for (state, pages) in [
                        ("free", stats.free_pages),
                        ("leased", stats.leased_pages),
                        ("quarantined", stats.quarantined_pages),
                        (
                            "shared",
                            stats.shared_pages
                                - stats.idle_shared_pages
                                - stats.pinned_shared_pages,
                        ),
                        ("cached", stats.idle_shared_pages),
                        ("public", stats.pinned_shared_pages),
                    ] {
                        let labels = WorkerPoolLabels {
                            worker: w.worker.clone(),
                            role: (*role).into(),
                            state: state.into(),
                        };
                        ConstGauge::new(pages as i64).encode(family.encode_family(&labels)?)?;
                    }
                }
            }
        }
        for (name, help, value) in WORKER_GAUGES {
            let mut family = encoder.encode_descriptor(name, help, None, MetricType::Gauge)?;
            for w in &workers {
                ConstGauge::new(value(w) as i64).encode(family.encode_family(&label(w))?)?;
            }
        }
        for (name, help, value) in WORKER_COUNTERS {
            let mut family = encoder.encode_descriptor(name, help, None, MetricType::Counter)?;
            for w in &workers {
                ConstCounter::new(value(w)).encode(family.encode_family(&label(w))?)?;
            }
        }
        {
            let mut family = encoder.encode_descriptor(
                "queue_wait_seconds",
                "Time client requests waited in a worker's queue before admission, by worker (and tenant with --metrics-tenant-labels).",
                None,
                MetricType::Histogram,
            )?;
            for w in &workers {
                let mut by_tenant: std::collections::BTreeMap<&str, WaitHistogram> =
                    std::collections::BTreeMap::new();
                for (tenant, waits) in &w.engine.queue_waits {
                    let shown = if self.tenant_labels {
                        tenant.as_str()
                    } else {
                        ""
                    };
                    by_tenant.entry(shown).or_default().merge(waits);
                }
                for (tenant, waits) in by_tenant {
                    let labels = WorkerTenantLabels {
                        worker: w.worker.clone(),
                        tenant: tenant.into(),
                    };
                    ReportedHistogram(waits).encode(family.encode_family(&labels)?)?;
                }
            }
        }
        if let Some(gauges) = ProcessGauges::of(&workers) {
            gauges.encode(&mut encoder)?;
        }
        let mut family = encoder.encode_descriptor(
            "handoffs",
            "KV hand-offs ended, by worker and outcome (committed, failed).",
            None,
            MetricType::Counter,
        )?;
        for w in &workers {
            for (reason, value) in [
                ("committed", w.engine.handoffs_committed),
                ("failed", w.engine.handoffs_failed),
            ] {
                let labels = WorkerReasonLabels {
                    worker: w.worker.clone(),
                    reason: reason.into(),
                };
                ConstCounter::new(value).encode(family.encode_family(&labels)?)?;
            }
        }
        Ok(())
    }
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct CacheInfoLabels {
    /// Token slots per KV page (vLLM's label name, which endpoint pickers
    /// parse).
    block_size: String,
    /// KV pages in those pools (vLLM's label name).
    num_gpu_blocks: String,
}

/// One unlabelled series per gauge for this process as a whole, as the
/// Gateway API Inference Extension's endpoint picker scrapes a model
/// server (docs/deployment.md): requests waiting, requests running, the
/// fraction of KV pages in use and the KV pages' shape. The KV figures
/// are over the pools that hold requests while they decode (decode and
/// colocated pools), or, on a prefill worker, its own pool.
struct ProcessGauges {
    waiting: usize,
    running: usize,
    usage: f64,
    page_size: usize,
    pages: usize,
}

impl ProcessGauges {
    /// None when no worker reported (unreachable): no series, rather than
    /// zeros nobody measured.
    fn of(workers: &[WorkerSnapshot]) -> Option<ProcessGauges> {
        if workers.is_empty() {
            return None;
        }
        let pools: Vec<&PoolStats> = workers
            .iter()
            .flat_map(|w| &w.pools)
            .map(|(_, s)| s)
            .collect();
        let decoding: Vec<&PoolStats> = workers
            .iter()
            .flat_map(|w| &w.pools)
            .filter(|(role, _)| *role != "prefill")
            .map(|(_, s)| s)
            .collect();
        let pools = if decoding.is_empty() { pools } else { decoding };
        let pages: usize = pools.iter().map(|s| s.num_pages).sum();
        // Cached pages nobody reads are evicted the moment a lease needs
        // them: free, for a picker's purposes.
        let in_use: usize = pools
            .iter()
            .map(|s| s.num_pages - s.free_pages - s.idle_shared_pages)
            .sum();
        Some(ProcessGauges {
            waiting: workers.iter().map(|w| w.engine.queued).sum(),
            running: workers.iter().map(|w| w.engine.running).sum(),
            usage: if pages == 0 {
                0.0
            } else {
                in_use as f64 / pages as f64
            },
            page_size: pools.first().map_or(0, |s| s.page_size),
            pages,
        })
    }

    fn encode(&self, encoder: &mut DescriptorEncoder) -> Result<(), std::fmt::Error> {
        for (name, help, value) in [
            (
                "requests_waiting",
                "Requests waiting for KV pages, over every worker this process reports (an endpoint picker's queue depth).",
                self.waiting,
            ),
            (
                "requests_running",
                "Requests holding KV pages, over every worker this process reports.",
                self.running,
            ),
        ] {
            let family = encoder.encode_descriptor(name, help, None, MetricType::Gauge)?;
            ConstGauge::new(value as i64).encode(family)?;
        }
        let family = encoder.encode_descriptor(
            "kv_cache_usage_ratio",
            "Fraction of KV pages in use (0 to 1) in the pools that hold decoding requests (a prefill worker: its own); evictable cached pages count as free.",
            None,
            MetricType::Gauge,
        )?;
        ConstGauge::new(self.usage).encode(family)?;
        let mut family = encoder.encode_descriptor(
            "kv_cache_info",
            "The KV pages' shape, in labels as endpoint pickers read them: block_size is tokens per page, num_gpu_blocks the pages in those pools (memory, not a GPU's). Always 1.",
            None,
            MetricType::Gauge,
        )?;
        let labels = CacheInfoLabels {
            block_size: self.page_size.to_string(),
            num_gpu_blocks: self.pages.to_string(),
        };
        ConstGauge::new(1).encode(family.encode_family(&labels)?)?;
        Ok(())
    }
}

/// Log lines this process dropped because stderr did not take them
/// ([`crate::logging`]): a reader of the log that fell behind.
#[derive(Debug)]
struct LogLinesDropped;

impl Collector for LogLinesDropped {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let family = encoder.encode_descriptor(
            "log_lines_dropped",
            "Log lines this process dropped because stderr did not take them (its reader fell behind); requests never wait for the log.",
            None,
            MetricType::Counter,
        )?;
        ConstCounter::new(crate::logging::log_lines_dropped()).encode(family)
    }
}

/// Every metric the server exports.
pub struct Metrics {
    registry: Registry,
    requests: Family<RequestLabels, Counter>,
    rejections: Family<ReasonLabel, Counter>,
    unkept: Counter,
    ttft: Histogram,
    duration: Histogram,
    /// Every worker's pools and counters, as last read.
    workers: Arc<WorkerMetrics>,
    tenant_labels: bool,
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
        let unkept = Counter::default();
        registry.register(
            "responses_unkept",
            "Answers that asked to be stored, or to join a conversation, and could not be (the store failed or was full); each answer says so",
            unkept.clone(),
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
        let workers = Arc::new(WorkerMetrics {
            latest: Mutex::default(),
            tenant_labels,
        });
        registry.register_collector(Box::new(Arc::clone(&workers)));
        registry.register_collector(Box::new(LogLinesDropped));

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
            unkept,
            ttft,
            duration,
            workers,
            tenant_labels,
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

    /// Counts an answer the store could not keep as it asked.
    pub fn unkept(&self) {
        self.unkept.inc();
    }

    /// Records a time to first token.
    pub fn first_token(&self, seconds: f64) {
        self.ttft.observe(seconds);
    }

    /// Records a request's total duration.
    pub fn finished(&self, seconds: f64) {
        self.duration.observe(seconds);
    }

    /// Renders the exposition text with `workers` as every worker's
    /// pools and counters now: each series carries its worker's label, and
    /// a worker missing from `workers` (unreachable) has no series at all —
    /// absent, never a stale value or a zero it did not report.
    pub fn render(&self, workers: &[WorkerSnapshot]) -> String {
        *lock(&self.workers.latest) = workers.to_vec();
        // Two scrapes at once may each encode the other's snapshot: both
        // are current, and each is encoded whole under the collector's lock.
        let mut out = String::new();
        prometheus_client::encoding::text::encode(&mut out, &self.registry)
            .expect("writing to a String cannot fail");
        out
    }
}

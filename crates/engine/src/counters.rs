//! What a worker counts: [`Counters`], kept by the scheduler as it goes,
//! and [`EngineStats`], a snapshot of them for metrics and the wire.

use std::collections::BTreeMap;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::Duration;

/// Counters a scheduler keeps as it goes; read as [`EngineStats`].
#[derive(Debug, Default)]
pub(crate) struct Counters {
    pub(crate) queued: AtomicUsize,
    pub(crate) running: AtomicUsize,
    pub(crate) finished: AtomicU64,
    pub(crate) failed: AtomicU64,
    pub(crate) cancelled: AtomicU64,
    pub(crate) preempted: AtomicU64,
    pub(crate) prompt_tokens: AtomicU64,
    pub(crate) generated_tokens: AtomicU64,
    pub(crate) steps: AtomicU64,
    pub(crate) express_steps: AtomicU64,
    pub(crate) handoffs_committed: AtomicU64,
    pub(crate) handoffs_failed: AtomicU64,
    pub(crate) handoff_stale_messages: AtomicU64,
    pub(crate) handoff_checksum_failures: AtomicU64,
    pub(crate) handoff_bytes: AtomicU64,
    /// Hand-off messages from a link their grant was not sent to, dropped
    /// before the receiver saw them.
    pub(crate) handoff_misrouted: AtomicU64,
    /// Requests refused for waiting past `max_queue_wait`.
    pub(crate) queue_timeouts: AtomicU64,
    /// Sheddable requests refused to make way for others.
    pub(crate) shed: AtomicU64,
    /// Queue waits of admitted client requests, by tenant.
    pub(crate) queue_waits: Mutex<BTreeMap<String, WaitHistogram>>,
}

impl Counters {
    fn queue_waits(&self) -> std::sync::MutexGuard<'_, BTreeMap<String, WaitHistogram>> {
        // Counts only: a count a panicking thread left is still a count.
        self.queue_waits.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Counts a client request of `tenant` admitted after `wait` in the queue.
    pub(crate) fn queue_wait(&self, tenant: &str, wait: Duration) {
        let mut waits = self.queue_waits();
        match waits.get_mut(tenant) {
            Some(histogram) => histogram.observe(wait),
            None => waits.entry(tenant.to_string()).or_default().observe(wait),
        }
    }
    pub(crate) fn snapshot(&self) -> EngineStats {
        EngineStats {
            queued: self.queued.load(Ordering::Acquire),
            running: self.running.load(Ordering::Acquire),
            finished: self.finished.load(Ordering::Relaxed),
            failed: self.failed.load(Ordering::Relaxed),
            cancelled: self.cancelled.load(Ordering::Relaxed),
            preempted: self.preempted.load(Ordering::Relaxed),
            prompt_tokens: self.prompt_tokens.load(Ordering::Relaxed),
            generated_tokens: self.generated_tokens.load(Ordering::Relaxed),
            steps: self.steps.load(Ordering::Relaxed),
            express_steps: self.express_steps.load(Ordering::Relaxed),
            handoffs_committed: self.handoffs_committed.load(Ordering::Relaxed),
            handoffs_failed: self.handoffs_failed.load(Ordering::Relaxed),
            handoff_stale_messages: self.handoff_stale_messages.load(Ordering::Relaxed),
            handoff_checksum_failures: self.handoff_checksum_failures.load(Ordering::Relaxed),
            handoff_bytes: self.handoff_bytes.load(Ordering::Relaxed),
            queue_timeouts: self.queue_timeouts.load(Ordering::Relaxed),
            shed: self.shed.load(Ordering::Relaxed),
            queue_waits: self.queue_waits().clone(),
        }
    }

    /// Mirrors the receiver's totals, for metrics.
    pub(crate) fn record_handoff(&self, stats: &kvfence_handoff::ReceiverStats) {
        self.handoffs_committed
            .store(stats.committed, Ordering::Relaxed);
        self.handoffs_failed.store(stats.failed, Ordering::Relaxed);
        // Misrouted messages are stale too: they belong to no grant of
        // the link they came on.
        self.handoff_stale_messages.store(
            stats.stale_messages + self.handoff_misrouted.load(Ordering::Relaxed),
            Ordering::Relaxed,
        );
        self.handoff_checksum_failures
            .store(stats.checksum_failures, Ordering::Relaxed);
        self.handoff_bytes.store(stats.bytes, Ordering::Relaxed);
    }
}

/// A snapshot of the engine's counters.
#[derive(Debug, Clone, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
pub struct EngineStats {
    /// Requests waiting for pages.
    pub queued: usize,
    /// Requests holding pages.
    pub running: usize,
    /// Requests that finished normally.
    pub finished: u64,
    /// Requests that ended with an error.
    pub failed: u64,
    /// Requests cancelled by their client.
    pub cancelled: u64,
    /// Running requests preempted for pages (recomputed later, never failed).
    #[serde(default)]
    pub preempted: u64,
    /// Prompt tokens prefilled.
    pub prompt_tokens: u64,
    /// Tokens generated.
    pub generated_tokens: u64,
    /// Forward passes run.
    pub steps: u64,
    /// Of those, express steps: another tenant's prompts run while a step
    /// was paused between two layers.
    #[serde(default)]
    pub express_steps: u64,
    /// Hand-offs committed (decode role).
    pub handoffs_committed: u64,
    /// Hand-offs failed (decode role).
    pub handoffs_failed: u64,
    /// Hand-off messages for revoked or unknown grants, dropped.
    pub handoff_stale_messages: u64,
    /// Hand-off chunks that failed their checksum.
    pub handoff_checksum_failures: u64,
    /// KV bytes received through hand-offs.
    pub handoff_bytes: u64,
    /// Requests refused for waiting in the queue past `max_queue_wait`.
    #[serde(default)]
    pub queue_timeouts: u64,
    /// Sheddable requests (negative priority) refused under pressure.
    #[serde(default)]
    pub shed: u64,
    /// How long admitted client requests waited in this worker's queue,
    /// by tenant (the empty name: work of no tenant).
    #[serde(default)]
    pub queue_waits: BTreeMap<String, WaitHistogram>,
}

/// Upper bounds, in seconds, of the queue-wait histogram's buckets (the
/// last, unbounded one is implied): from a request admitted in its first
/// step to one waiting the default `max_queue_wait`.
pub const QUEUE_WAIT_BOUNDS: [f64; 14] = [
    0.001, 0.005, 0.025, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0,
];

/// A histogram of waits: a count per bucket of [`QUEUE_WAIT_BOUNDS`] (not
/// cumulative; one more for waits beyond the last bound) and their sum.
#[derive(Debug, Clone, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
pub struct WaitHistogram {
    counts: Vec<u64>,
    sum_micros: u64,
}

impl WaitHistogram {
    /// Counts one wait.
    pub fn observe(&mut self, wait: Duration) {
        if self.counts.len() != QUEUE_WAIT_BOUNDS.len() + 1 {
            self.counts = vec![0; QUEUE_WAIT_BOUNDS.len() + 1];
        }
        let seconds = wait.as_secs_f64();
        let bucket = QUEUE_WAIT_BOUNDS
            .iter()
            .position(|bound| seconds <= *bound)
            .unwrap_or(QUEUE_WAIT_BOUNDS.len());
        self.counts[bucket] += 1;
        self.sum_micros = self
            .sum_micros
            .saturating_add(u64::try_from(wait.as_micros()).unwrap_or(u64::MAX));
    }

    /// Waits counted.
    pub fn count(&self) -> u64 {
        self.counts.iter().sum()
    }

    /// Their sum, in seconds.
    pub fn sum_seconds(&self) -> f64 {
        self.sum_micros as f64 / 1e6
    }

    /// `(upper bound, count)` per bucket, not cumulative, the last bound
    /// infinite; a peer's histogram of another shape reads as empty.
    pub fn buckets(&self) -> Vec<(f64, u64)> {
        let bounds = QUEUE_WAIT_BOUNDS.iter().copied().chain([f64::INFINITY]);
        match self.counts.len() == QUEUE_WAIT_BOUNDS.len() + 1 {
            true => bounds.zip(self.counts.iter().copied()).collect(),
            false => bounds.map(|b| (b, 0)).collect(),
        }
    }

    /// Adds `other`'s waits to these.
    pub fn merge(&mut self, other: &WaitHistogram) {
        if other.counts.len() != QUEUE_WAIT_BOUNDS.len() + 1 {
            return;
        }
        if self.counts.len() != other.counts.len() {
            self.counts = vec![0; other.counts.len()];
        }
        for (mine, theirs) in self.counts.iter_mut().zip(&other.counts) {
            *mine += theirs;
        }
        self.sum_micros = self.sum_micros.saturating_add(other.sum_micros);
    }
}

/// One worker's pools and counters at one moment, named for metrics.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WorkerSnapshot {
    /// Which worker: `local` for this process's own, else the address a
    /// router reaches it at.
    pub worker: String,
    /// Its pools' counters, by role label.
    pub pools: Vec<(&'static str, kvfence_pool::PoolStats)>,
    /// Its scheduler's counters.
    pub engine: EngineStats,
}

impl WorkerSnapshot {
    /// The name of this process's own worker.
    pub const LOCAL: &'static str = "local";

    /// This process's own worker's snapshot, as the one entry of a list.
    pub fn local(
        pools: Vec<(&'static str, kvfence_pool::PoolStats)>,
        engine: EngineStats,
    ) -> Vec<WorkerSnapshot> {
        vec![WorkerSnapshot {
            worker: Self::LOCAL.into(),
            pools,
            engine,
        }]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn waits_fall_in_their_buckets_and_merge() {
        let mut a = WaitHistogram::default();
        a.observe(Duration::from_micros(500));
        a.observe(Duration::from_millis(300));
        a.observe(Duration::from_secs(1000));
        let buckets = a.buckets();
        assert_eq!(buckets.len(), QUEUE_WAIT_BOUNDS.len() + 1);
        assert_eq!(buckets[0], (0.001, 1));
        assert_eq!(buckets[5], (0.5, 1), "300 ms is at most 0.5 s");
        assert_eq!(buckets[QUEUE_WAIT_BOUNDS.len()], (f64::INFINITY, 1));
        assert!((a.sum_seconds() - 1000.3005).abs() < 1e-9);
        let mut total = WaitHistogram::default();
        total.merge(&a);
        total.merge(&a);
        assert_eq!(total.count(), 6);
        // A peer's histogram of another shape adds nothing.
        total.merge(&WaitHistogram {
            counts: vec![1],
            sum_micros: 5,
        });
        assert_eq!(total.count(), 6);
    }
}

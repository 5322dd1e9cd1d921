//! What a worker counts: [`Counters`], kept by the scheduler as it goes,
//! and [`EngineStats`], a snapshot of them for metrics and the wire.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};

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
}

impl Counters {
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
            handoffs_committed: self.handoffs_committed.load(Ordering::Relaxed),
            handoffs_failed: self.handoffs_failed.load(Ordering::Relaxed),
            handoff_stale_messages: self.handoff_stale_messages.load(Ordering::Relaxed),
            handoff_checksum_failures: self.handoff_checksum_failures.load(Ordering::Relaxed),
            handoff_bytes: self.handoff_bytes.load(Ordering::Relaxed),
            queue_timeouts: self.queue_timeouts.load(Ordering::Relaxed),
            shed: self.shed.load(Ordering::Relaxed),
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
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
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

//! [`PrefillWorker`]: a prefill scheduler serving every decode worker that
//! links to it, at once. Each link is a [`Port`] with a [`PeerId`] of its
//! own, and the scheduler keeps every order under the link it came on, so
//! hand-off ids — each decode worker's own numbering — never meet: an abort
//! from one decode worker cannot touch another's transfer, and KV goes back
//! only on the link its grant arrived on. What carries the links (the
//! fleet's TLS listener) is not here.

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, mpsc};
use std::thread::JoinHandle;

use kvfence_model::LoadedModel;
use kvfence_pool::{Pool, PoolStats};

use crate::config::{EngineConfig, Role};
use crate::counters::{Counters, EngineStats, WorkerSnapshot};
use crate::error::EngineError;
use crate::port::{Facing, Port};
use crate::request::LinkGrammars;
use crate::scheduler::{Command, PeerId, Scheduler, Shell};

/// A running prefill scheduler, taking orders only from the decode workers
/// linked to it.
pub struct PrefillWorker {
    commands: mpsc::Sender<Command>,
    model: Arc<LoadedModel>,
    pool: Pool,
    counters: Arc<Counters>,
    /// Links open now.
    links: Arc<AtomicUsize>,
    /// The next link's name.
    next_link: AtomicU64,
    admitting: AtomicBool,
    scheduler: Option<JoinHandle<()>>,
}

impl std::fmt::Debug for PrefillWorker {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PrefillWorker")
            .field("decode_links", &self.decode_links())
            .finish()
    }
}

impl PrefillWorker {
    /// Starts the scheduler over `pool`, with no decode worker linked yet.
    pub fn start(
        model: Arc<LoadedModel>,
        pool: Pool,
        config: EngineConfig,
    ) -> Result<PrefillWorker, EngineError> {
        let (commands, inbox) = mpsc::channel();
        let counters = Arc::new(Counters::default());
        let scheduler = Scheduler::new(
            Role::Prefill,
            Arc::clone(&model),
            pool.clone(),
            config,
            Arc::clone(&counters),
        );
        let shell = Shell::new(scheduler, inbox);
        let scheduler = std::thread::Builder::new()
            .name("kvfence-prefill".into())
            .spawn(move || shell.run())
            .map_err(|e| EngineError::Internal {
                reason: format!("starting the prefill scheduler: {e}"),
            })?;
        Ok(PrefillWorker {
            commands,
            model,
            pool,
            counters,
            links: Arc::default(),
            next_link: AtomicU64::new(0),
            admitting: AtomicBool::new(true),
            scheduler: Some(scheduler),
        })
    }

    /// A new link from the decode worker `name` (its address): its orders
    /// are served from now on, their grammars compiled as they arrive, and
    /// its hand-offs dropped when the port's inbound side drops.
    /// `ShuttingDown` once the worker has stopped.
    pub fn link_decode(&self, name: String) -> Result<Port, EngineError> {
        let peer = PeerId(self.next_link.fetch_add(1, Ordering::Relaxed));
        let facing = Facing::Decode(LinkGrammars::new(Arc::clone(&self.model)));
        self.links.fetch_add(1, Ordering::AcqRel);
        let links = Arc::clone(&self.links);
        let on_end = Box::new(move || {
            let before = links.fetch_sub(1, Ordering::AcqRel);
            assert!(before > 0, "a link ends once, after it was counted");
        });
        Port::open(self.commands.clone(), peer, name, 0, facing, Some(on_end)).inspect_err(|_| {
            self.links.fetch_sub(1, Ordering::AcqRel);
        })
    }

    /// Decode workers linked now.
    pub fn decode_links(&self) -> usize {
        self.links.load(Ordering::Acquire)
    }

    /// The model it runs.
    pub fn model(&self) -> &Arc<LoadedModel> {
        &self.model
    }

    /// Its KV pool.
    pub fn pool(&self) -> &Pool {
        &self.pool
    }

    /// The pool's and the scheduler's counters.
    pub fn snapshot(&self) -> (Vec<(&'static str, PoolStats)>, EngineStats) {
        let pools = vec![(Role::Prefill.label(), self.pool.stats())];
        (pools, self.counters.snapshot())
    }

    /// Drains: takes no new decode workers, and tells those linked to send
    /// new orders to other prefill workers; what they sent is still served.
    pub fn stop_admitting(&self) {
        self.admitting.store(false, Ordering::Release);
        let _ = self.commands.send(Command::Drain);
    }

    /// Whether it takes new decode workers.
    pub fn is_admitting(&self) -> bool {
        self.admitting.load(Ordering::Acquire)
    }

    /// Orders queued or being prefilled.
    pub fn in_flight(&self) -> usize {
        let stats = self.counters.snapshot();
        stats.queued + stats.running
    }
}

/// What a prefill worker's status listener reads. It takes work only from
/// decode workers, over its links.
impl crate::Status for PrefillWorker {
    fn capacities(&self) -> Vec<(&'static str, usize)> {
        vec![(Role::Prefill.label(), self.pool.capacity_tokens())]
    }

    fn snapshot(&self) -> Vec<WorkerSnapshot> {
        let (pools, engine) = PrefillWorker::snapshot(self);
        WorkerSnapshot::local(pools, engine)
    }

    fn is_ready(&self) -> bool {
        self.is_admitting()
    }
}

/// How a prefill worker drains: it stops taking orders and finishes the
/// ones it holds.
impl crate::Drain for PrefillWorker {
    fn stop_admitting(&self) {
        PrefillWorker::stop_admitting(self)
    }

    fn in_flight(&self) -> usize {
        PrefillWorker::in_flight(self)
    }
}

impl Drop for PrefillWorker {
    /// Stops the scheduler: orders still queued or running are rejected,
    /// and every lease is returned.
    fn drop(&mut self) {
        let _ = self.commands.send(Command::Shutdown);
        if let Some(thread) = self.scheduler.take() {
            let _ = thread.join();
        }
    }
}

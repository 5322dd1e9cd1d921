//! `kvfence prefill` as a process: one prefill scheduler serving every
//! decode worker that connects, at once. Each link is a [`PeerId`] of its
//! own and the scheduler keeps every order under the link it came on, so
//! hand-off ids — each decode worker's own numbering — never meet: an
//! abort from one decode worker cannot touch another's transfer, and KV
//! goes back only on the link its grant arrived on.

use std::net::TcpListener;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, mpsc};
use std::thread::JoinHandle;

use kvfence_handoff::tls::{Credentials, Role as LinkRole};
use kvfence_model::LoadedModel;
use kvfence_pool::{Pool, PoolStats};
use tracing::{info, warn};

use super::io;
use super::wire::{Control, Hello, ModelFingerprint, PROTOCOL, PageLayout, send_control};
use crate::config::EngineConfig;
use crate::config::Role;
use crate::counters::{Counters, EngineStats, WorkerSnapshot};
use crate::error::EngineError;
use crate::link::bridge;
use crate::net::{self, ListenLimits};
use crate::request::LinkGrammars;
use crate::scheduler::{Command, PeerId, Scheduler};

/// Decode workers one prefill worker serves at once.
pub const MAX_DECODE_LINKS: usize = 64;

/// A running prefill worker: its scheduler and the listener feeding it.
pub struct PrefillWorker {
    commands: mpsc::Sender<Command>,
    pool: Pool,
    counters: Arc<Counters>,
    links: Arc<AtomicUsize>,
    admitting: Arc<AtomicBool>,
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
    /// Starts the scheduler and accepts decode workers on `listener` (only
    /// certificates of the decode role), each greeted with a `Hello`.
    pub fn start(
        model: Arc<LoadedModel>,
        pool: Pool,
        config: EngineConfig,
        listener: TcpListener,
        credentials: &Credentials,
    ) -> Result<PrefillWorker, EngineError> {
        let accepted = net::accept(
            listener,
            credentials,
            &[LinkRole::Decode],
            ListenLimits::new(MAX_DECODE_LINKS),
        )?;
        let (commands, inbox) = mpsc::channel();
        let counters = Arc::new(Counters::default());
        let hello = Hello {
            protocol: PROTOCOL,
            role: Role::Prefill.label().into(),
            model: ModelFingerprint::of(&model),
            page_size: pool.geometry().page_size,
            kv_dtype: pool.geometry().elem.name().into(),
            layer_groups: PageLayout::of(&pool).layer_groups,
            tokens: pool.capacity_tokens(),
            prefills: Vec::new(),
        };
        let link_model = Arc::clone(&model);
        let scheduler = Scheduler::new(
            Role::Prefill,
            model,
            pool.clone(),
            config,
            Arc::clone(&counters),
            inbox,
        );
        let scheduler = std::thread::Builder::new()
            .name("kvfence-prefill".into())
            .spawn(move || scheduler.run())
            .map_err(io)?;
        let links = Arc::new(AtomicUsize::new(0));
        let admitting = Arc::new(AtomicBool::new(true));
        let (inbox, count, open) = (commands.clone(), Arc::clone(&links), Arc::clone(&admitting));
        std::thread::Builder::new()
            .name("kvfence-prefill-accept".into())
            .spawn(move || {
                let mut next = 0u64;
                for link in accepted {
                    if !open.load(Ordering::Acquire) {
                        // Draining: no new decode workers.
                        continue;
                    }
                    let (address, role) = (link.address, link.peer);
                    if !send_control(&link.tx, &Control::Hello(hello.clone())) {
                        continue;
                    }
                    let peer = PeerId(next);
                    next += 1;
                    let announce = Some((address.to_string(), 0));
                    let grammars = Some(LinkGrammars::new(Arc::clone(&link_model)));
                    match bridge(link, inbox.clone(), peer, "kvfence-prefill-link", announce, grammars) {
                        Ok((_, reader)) => {
                            info!(%address, %role, %peer, "decode worker connected");
                            count.fetch_add(1, Ordering::AcqRel);
                            let count = Arc::clone(&count);
                            std::thread::spawn(move || {
                                let _ = reader.join();
                                count.fetch_sub(1, Ordering::AcqRel);
                                info!(%address, %peer, "decode worker gone; its hand-offs were dropped");
                            });
                        }
                        Err(error) => warn!(%address, %error, "could not start a link"),
                    }
                }
            })
            .map_err(io)?;
        Ok(PrefillWorker {
            commands,
            pool,
            counters,
            links,
            admitting,
            scheduler: Some(scheduler),
        })
    }

    /// Decode workers linked now.
    pub fn decode_links(&self) -> usize {
        self.links.load(Ordering::Acquire)
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

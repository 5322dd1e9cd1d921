//! The scheduler: continuous batching over one model and one pool, in one
//! of three roles — a batching core here (queue, admission, plan, step,
//! finish), the prefill role's part in [`prefill`], the decode role's in
//! [`decode`].
//!
//! The core is a state machine without IO: [`Scheduler::handle`] takes one
//! command, [`Scheduler::poll`] does what is due at the time it is given,
//! and what it sends leaves through peers' and clients' channels.
//! [`Scheduler::run`] is the thin shell that blocks on the inbox and reads
//! the wall clock; the fleet simulator (`crate::sim`) runs many schedulers
//! on one virtual clock instead.
//!
//! Each step it (1) takes commands — new requests, prefill orders, hand-off
//! frames — and drops cancelled requests, (2) admits waiting requests whose
//! first reservation can be leased now (all or nothing, arrival order), (3)
//! grows every decoding request by the page its next token needs,
//! preempting the most recently admitted request when the pool is out of
//! pages, (4) builds one batch of every decoding request's next token plus
//! prefill chunks up to the step's token budget, (5) runs it and acts on
//! the results.
//!
//! Pages grow lazily: a request first leases its prompt and one page of
//! room, then a page at a time as it decodes, so shared prefixes and
//! short answers leave the rest of the pool to others. A request that can
//! never fit (prompt plus `max_tokens` beyond the pool) is still refused at
//! admission (I6). A preempted request seals what it wrote into the cache,
//! gives back its pages and waits at the front of the queue with its
//! sampler and text intact; when it comes back it recomputes from its
//! cached prefix and goes on exactly where it stopped. Running requests
//! are preempted, never failed, for lack of pages.
//!
//! - **Colocated**: does both phases.
//! - **Decode**: reserves the prompt and room to grow, grants the prompt's pages
//!   to the prefill worker through the hand-off [`Receiver`], and decodes only
//!   after the receiver commits (I2, I7). Until then the lease is the
//!   receiver's, not the batch's.
//! - **Prefill**: fills a grant. It leases the prompt only, prefills, samples
//!   the first token, ships the KV as pages fill (`Streaming`) and a `Done`
//!   built from its proof (I5), and answers `Reject` when it cannot.
//!
//! A request's lease lives inside its `Active` entry — `Kv::Held` — or, while
//! a decode worker awaits its hand-off (`Kv::Awaited`), in the receiver, so
//! finishing, failing or cancelling it is what returns its pages (I8).

#[cfg(test)]
mod cache_tests;
#[cfg(test)]
mod deadline_tests;
mod decode;
mod fair;
#[cfg(test)]
mod fair_tests;
mod grammar;
mod prefill;

use std::cmp::Reverse;
use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc;
use std::time::Instant;

use bytes::Bytes;
use kvfence_handoff::{HandoffId, Message, Receiver, RejectReason, Streaming};
use kvfence_model::{
    Constraint, DrawContext, LoadedModel, Logits, Sampler, Sequence, TokenLogprobs,
};
use kvfence_pool::mutation::Mutation;
use kvfence_pool::{Lease, Pool, PoolError, RequestId, Window, WindowKey};
use tokio::sync::mpsc as tokio_mpsc;
use tracing::{debug, trace, warn};

use crate::config::EngineConfig;
use crate::counters::Counters;
use crate::request::{
    CacheScope, Event, FailureKind, FinishReason, GenerationRequest, RequestHandle, Usage,
};
use crate::text::TextStream;
use fair::{FairQueue, split_budget};
use grammar::GrammarCache;

/// What a scheduler does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    /// Prefill and decode on one worker.
    Colocated,
    /// Prefill only; KV goes to a decode worker.
    Prefill,
    /// Decode only; KV comes from a prefill worker.
    Decode,
}

impl Role {
    /// The role a label names (`colocated` for anything unknown).
    pub fn from_label(label: &str) -> Role {
        match label {
            "prefill" => Role::Prefill,
            "decode" => Role::Decode,
            _ => Role::Colocated,
        }
    }

    /// The label used in metrics.
    pub fn label(self) -> &'static str {
        match self {
            Role::Colocated => "colocated",
            Role::Prefill => "prefill",
            Role::Decode => "decode",
        }
    }
}

/// Names one link to a peer worker, as the scheduler at this end knows it.
/// A prefill worker keeps every order under the link it came on, so each
/// link is its own namespace of hand-off ids: two decode workers that both
/// number their hand-offs 1, 2, 3… can never reach each other's.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub(crate) struct PeerId(pub(crate) u64);

impl std::fmt::Display for PeerId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "link-{}", self.0)
    }
}

/// The sending end of a link to a peer worker: its inbox (in-process) or a
/// bridge onto a TCP link. `stamp` is the name the peer knows this end by,
/// put on every command so the peer's scheduler can tell its links apart.
#[derive(Debug, Clone)]
pub(crate) struct PeerTx {
    tx: mpsc::Sender<Command>,
    stamp: PeerId,
}

impl PeerTx {
    pub(crate) fn new(tx: mpsc::Sender<Command>, stamp: PeerId) -> PeerTx {
        PeerTx { tx, stamp }
    }

    /// Sends one hand-off message; false once the link is gone.
    fn message(&self, message: &Message) -> bool {
        self.frame(message.to_frame().into())
    }

    fn frame(&self, frame: Bytes) -> bool {
        let peer = self.stamp;
        self.tx.send(Command::Frame { peer, frame }).is_ok()
    }

    /// Says this worker drains.
    fn draining(&self) -> bool {
        self.tx.send(Command::PeerDraining(self.stamp)).is_ok()
    }

    fn order(&self, order: PrefillOrder) -> bool {
        let (peer, order) = (self.stamp, Box::new(order));
        self.tx.send(Command::Prefill { peer, order }).is_ok()
    }
}

/// A link coming up: who is at the other end.
#[derive(Debug)]
pub(crate) struct PeerUp {
    pub(crate) peer: PeerId,
    pub(crate) tx: PeerTx,
    /// How the operator named the peer (its address), for routing hints.
    pub(crate) name: String,
    /// Tokens of KV the peer's pool holds (a decode worker's prefill
    /// peers; 0 where it does not matter).
    pub(crate) tokens: usize,
}

pub(crate) enum Command {
    /// A client request (colocated, decode).
    Submit(Box<Pending>),
    /// A grant to fill, with the prompt it is for (prefill).
    Prefill {
        peer: PeerId,
        order: Box<PrefillOrder>,
    },
    /// One hand-off frame from a peer worker (shared, so a chunk's payload
    /// is decoded as a view of it rather than copied).
    Frame {
        peer: PeerId,
        frame: Bytes,
    },
    /// A link to a peer worker came up.
    PeerUp(Box<PeerUp>),
    /// The link to a peer worker is gone.
    PeerLost(PeerId),
    /// The peer on this link drains: send it nothing new if another can
    /// take it.
    PeerDraining(PeerId),
    /// This worker drains: tell every peer (prefill role).
    Drain,
    Shutdown,
}

/// What a decode worker asks of a prefill worker.
pub(crate) struct PrefillOrder {
    /// The `Grant` frame.
    pub(crate) grant: Vec<u8>,
    pub(crate) request: GenerationRequest,
    /// For a one-sided (shared-memory) grant: the window into decode's
    /// pages and the key that opens it.
    pub(crate) window: Option<(Window, WindowKey)>,
}

/// Who is waiting for a request's results.
pub(crate) enum Origin {
    /// A client, through its `RequestHandle`.
    Client {
        events: tokio_mpsc::UnboundedSender<Event>,
        cancelled: Arc<AtomicBool>,
    },
    /// A decode worker, through a grant (prefill role).
    Handoff {
        /// The link the order came on: where its KV and answers go.
        peer: PeerId,
        /// The decode worker's name for the hand-off, unique on that link.
        id: HandoffId,
        /// The transfer; taken when the last page ships.
        streaming: Option<Streaming>,
        aborted: bool,
        /// When the decode worker was last told this order is being
        /// worked on (`Progress`); `None` until the first report.
        reported_at: Option<Instant>,
        window: Option<(Window, WindowKey)>,
    },
}

/// A request waiting for pages.
pub(crate) struct Pending {
    pub(crate) id: RequestId,
    pub(crate) request: GenerationRequest,
    pub(crate) origin: Origin,
    /// Decode role: the prefill worker the router chose, by name; another
    /// live one is used if it is gone.
    pub(crate) prefill: Option<String>,
    /// Decode role: its hand-off was already moved once to another prefill
    /// worker after losing one. A second loss fails it: a prompt that
    /// kills every prefill worker it reaches must not take down the fleet.
    pub(crate) moved: bool,
    /// A preempted request's progress, to go on from when it is admitted
    /// again.
    pub(crate) resume: Option<Box<Resume>>,
    /// When the first poll after its arrival saw it waiting (commands
    /// carry no clock): its queue deadline counts from here.
    pub(crate) waiting_since: Option<Instant>,
}

/// Where a preempted request stopped: everything but its pages.
pub(crate) struct Resume {
    sampler: Sampler,
    constraint: Option<Constraint>,
    text: TextStream,
    generated: Vec<u32>,
    cached: usize,
}

impl Pending {
    /// A client's request, and the handle the client reads it through.
    pub(crate) fn for_client(
        id: RequestId,
        request: GenerationRequest,
        prefill: Option<String>,
    ) -> (Pending, RequestHandle) {
        let (events, receiver) = tokio_mpsc::unbounded_channel();
        let cancelled = Arc::new(AtomicBool::new(false));
        let handle = RequestHandle::new(id, receiver, Arc::clone(&cancelled));
        let pending = Pending {
            id,
            request,
            origin: Origin::Client { events, cancelled },
            prefill,
            moved: false,
            resume: None,
            waiting_since: None,
        };
        (pending, handle)
    }

    fn is_cancelled(&self) -> bool {
        match &self.origin {
            Origin::Client { events, cancelled } => {
                cancelled.load(Ordering::Acquire) || events.is_closed()
            }
            Origin::Handoff { aborted, .. } => *aborted,
        }
    }

    /// Tells the client `event` — unless it cancelled: from then on it
    /// hears nothing, even what a hand-off message handled before the next
    /// poll releases the request would say.
    fn send(&self, event: Event) {
        if let Origin::Client { events, cancelled } = &self.origin
            && !cancelled.load(Ordering::Acquire)
        {
            let _ = events.send(event);
        }
    }

    fn handoff_id(&self) -> HandoffId {
        HandoffId(self.id.0)
    }
}

/// Decode role: a grant out to a prefill worker, and when that worker last
/// showed it was at work on it.
struct Awaiting {
    /// The link the grant went on; only its messages may touch the lease.
    prefill: PeerId,
    /// When the grant went out: the whole-life deadline counts from here.
    granted_at: Instant,
    /// When a chunk or progress report for it was last taken in: the
    /// silence deadline counts from here.
    heard_at: Instant,
    /// A chunk or progress report arrived since the last poll, which moves
    /// `heard_at` to its own time (commands carry no clock).
    news: bool,
}

impl Awaiting {
    /// When this grant fails for silence, or for taking too long in all.
    fn deadline(&self, config: &EngineConfig, prompt: usize) -> Instant {
        (self.heard_at + config.handoff_timeout)
            .min(self.granted_at + config.handoff_deadline(prompt))
    }
}

/// Where a running request's KV is.
enum Kv {
    /// Decode role: granted to a prefill worker, which is filling it. The
    /// lease is the hand-off receiver's until it commits.
    Awaited(Awaiting),
    /// In this worker's hands — prefilled here, or committed — and computed
    /// on by its steps.
    Held(Lease),
}

impl Kv {
    fn lease(&self) -> Option<&Lease> {
        match self {
            Kv::Held(lease) => Some(lease),
            Kv::Awaited(_) => None,
        }
    }

    fn lease_mut(&mut self) -> Option<&mut Lease> {
        match self {
            Kv::Held(lease) => Some(lease),
            Kv::Awaited(_) => None,
        }
    }

    /// The link filling it, while it is awaited.
    fn awaited_from(&self) -> Option<PeerId> {
        match self {
            Kv::Awaited(awaiting) => Some(awaiting.prefill),
            Kv::Held(_) => None,
        }
    }
}

/// A request holding pages.
struct Active {
    pending: Pending,
    kv: Kv,
    sampler: Sampler,
    /// The grammar's state, if the request has one: it has accepted every
    /// generated token.
    constraint: Option<Constraint>,
    text: TextStream,
    /// Positions of its context (the prompt, then the completion) whose KV
    /// is written.
    written: usize,
    /// Prompt tokens that came from the tenant's prefix cache, as reported
    /// in its usage.
    cached: usize,
    generated: Vec<u32>,
    /// When it was admitted, in admission order: the latest is preempted
    /// first.
    admitted: u64,
}

impl Active {
    /// Positions whose KV the next token needs: the prompt and every
    /// generated token but the last (which is the next input).
    fn kv_target(&self) -> usize {
        self.pending.request.prompt.len() + self.generated.len().saturating_sub(1)
    }

    /// Whether no prompt (or, after a preemption, recomputation) is left to
    /// prefill.
    fn prefill_done(&self) -> bool {
        self.written >= self.kv_target()
    }

    /// The tokens at `range` of the request's context: its prompt followed
    /// by what it generated.
    fn context(&self, range: std::ops::Range<usize>) -> Vec<u32> {
        let prompt = &self.pending.request.prompt;
        prompt
            .iter()
            .chain(&self.generated)
            .skip(range.start)
            .take(range.len())
            .copied()
            .collect()
    }

    /// A finished request seals the full pages of its prompt and of the
    /// completion written so far (every generated token but the last,
    /// whose KV was never computed): a chat's next turn starts with them.
    /// The public namespace holds what the operator declared and nothing
    /// more: a public request's completion is never sealed.
    fn seal_conversation(&mut self) {
        if self.pending.request.cache == Some(CacheScope::Public) {
            return;
        }
        let tokens = self.context(0..self.written);
        if let Some(lease) = self.kv.lease_mut() {
            lease.seal(&tokens);
        }
    }
}

/// What one request contributes to one step.
struct Work {
    index: usize,
    past: usize,
    tokens: Vec<u32>,
    logits: Logits,
}

/// How a request ended.
enum End {
    Finished(Event),
    Failed(FailureKind, String),
    /// A prefill worker shipped the KV; nothing more to do here.
    Shipped,
}

/// A peer worker this scheduler has a link to.
struct Peer {
    tx: PeerTx,
    name: String,
    tokens: usize,
    /// It said it drains: it finishes what it has and takes nothing new
    /// if another peer can (decode role).
    draining: bool,
}

pub(crate) struct Scheduler {
    role: Role,
    model: Arc<LoadedModel>,
    pool: Pool,
    config: EngineConfig,
    counters: Arc<Counters>,
    inbox: mpsc::Receiver<Command>,
    /// The workers on the other side: a decode worker's prefill workers, a
    /// prefill worker's decode workers. Ordered, so choices are
    /// deterministic.
    peers: BTreeMap<PeerId, Peer>,
    receiver: Receiver,
    /// Requests waiting for pages, one queue per tenant, admitted in fair
    /// order (I11).
    waiting: FairQueue,
    active: Vec<Active>,
    stopping: bool,
    /// Prefill role: names this worker's own leases (hand-off ids are only
    /// unique per link).
    next_local_id: u64,
    /// Decode role: grant one-sided windows (shared memory) instead of
    /// taking chunks.
    one_sided: bool,
    /// Requests admitted so far (each admission's order).
    admissions: u64,
    /// Compiles requests' grammars, once for a request's choices.
    grammars: GrammarCache,
}

impl Scheduler {
    pub(crate) fn new(
        role: Role,
        model: Arc<LoadedModel>,
        pool: Pool,
        config: EngineConfig,
        counters: Arc<Counters>,
        inbox: mpsc::Receiver<Command>,
    ) -> Self {
        Scheduler {
            role,
            model,
            pool,
            config,
            counters,
            inbox,
            peers: BTreeMap::new(),
            receiver: Receiver::new(),
            waiting: FairQueue::new(),
            active: Vec::new(),
            stopping: false,
            next_local_id: 1,
            one_sided: false,
            admissions: 0,
            grammars: GrammarCache::default(),
        }
    }

    /// Decode role over a one-sided transport.
    pub(crate) fn with_one_sided_grants(mut self, one_sided: bool) -> Self {
        self.one_sided = one_sided;
        self
    }

    /// The shell around the core: blocks on the inbox while there is
    /// nothing to compute (until a command arrives or the next hand-off
    /// deadline), feeds every command to [`Scheduler::handle`], and polls
    /// with the wall clock, until told to stop. The core below takes its
    /// inputs and its time from here — or from the simulator, which runs
    /// many schedulers on one virtual clock.
    pub(crate) fn run(mut self) {
        loop {
            if !self.has_work() {
                let received = match self.next_deadline() {
                    None => self.inbox.recv().map_err(|_| true),
                    Some(deadline) => {
                        let wait = deadline.saturating_duration_since(Instant::now());
                        self.inbox
                            .recv_timeout(wait)
                            .map_err(|e| e == mpsc::RecvTimeoutError::Disconnected)
                    }
                };
                match received {
                    Ok(command) => self.handle(command),
                    Err(disconnected) => self.stopping |= disconnected,
                }
            }
            while let Ok(command) = self.inbox.try_recv() {
                self.handle(command);
            }
            if self.stopping {
                break;
            }
            self.poll(Instant::now());
        }
        self.fail_everything();
        // Requests that raced the shutdown.
        while let Ok(command) = self.inbox.try_recv() {
            if let Command::Submit(pending) = command {
                self.counters.queued.fetch_sub(1, Ordering::AcqRel);
                self.refuse(
                    &pending,
                    FailureKind::ShuttingDown,
                    "the server is shutting down".into(),
                );
            }
        }
    }

    /// Does what is due at `now`: aborts hand-offs past their deadline,
    /// drops cancelled requests, admits what fits, and runs one step if any
    /// request has pages to compute (admitting again after it, since the
    /// step may have freed pages). Returns whether a step ran.
    pub(crate) fn poll(&mut self, now: Instant) -> bool {
        self.expire_handoffs(now);
        self.report_progress(now);
        self.drop_cancelled();
        self.expire_waits(now);
        self.admit(now);
        let stepped = self.has_work();
        if stepped {
            self.step();
            self.admit(now);
        }
        self.check_counts();
        stepped
    }

    /// The counters the metrics read agree with the state they count:
    /// every active request is counted running, and every waiting one
    /// queued (the queued count also covers submissions still in the
    /// inbox, counted before they were sent).
    fn check_counts(&self) {
        debug_assert_eq!(
            self.counters.running.load(Ordering::Acquire),
            self.active.len(),
            "the running count is the number of active requests"
        );
        debug_assert!(
            self.counters.queued.load(Ordering::Acquire) >= self.waiting.len(),
            "every waiting request is counted queued"
        );
    }

    /// Whether some request holds pages to compute: `poll` would step.
    pub(crate) fn has_work(&self) -> bool {
        self.active.iter().any(|a| a.kv.lease().is_some())
    }

    /// When `poll` is next due even if nothing arrives: a decode worker's
    /// first hand-off deadline, a prefill worker's next progress report.
    pub(crate) fn next_deadline(&self) -> Option<Instant> {
        let handoffs = self.active.iter().filter_map(|a| match &a.kv {
            Kv::Awaited(awaiting) => {
                Some(awaiting.deadline(&self.config, a.pending.request.prompt.len()))
            }
            Kv::Held(_) => None,
        });
        handoffs.chain(self.next_progress_report()).min()
    }

    /// Feeds one command. No IO and no clock: what it sends goes into the
    /// peers' and clients' channels, which the shell or the simulator
    /// drain.
    pub(crate) fn handle(&mut self, command: Command) {
        match command {
            Command::Submit(pending) => self.enqueue(*pending),
            Command::Prefill { peer, order } => self.take_order(peer, *order),
            Command::Frame { peer, frame } => self.take_frame(peer, &frame),
            Command::PeerUp(up) => {
                debug!(role = self.role.label(), peer = %up.peer, "peer link up");
                let peer = Peer {
                    tx: up.tx,
                    name: up.name,
                    tokens: up.tokens,
                    draining: false,
                };
                let replaced = self.peers.insert(up.peer, peer);
                assert!(
                    replaced.is_none(),
                    "a link id names one link for the process's life"
                );
            }
            Command::PeerLost(peer) => self.lose_peer(peer),
            Command::PeerDraining(peer) => {
                if let Some(p) = self.peers.get_mut(&peer) {
                    debug!(%peer, name = %p.name, "peer drains");
                    p.draining = true;
                }
            }
            Command::Drain => {
                for p in self.peers.values() {
                    let _ = p.tx.draining();
                }
            }
            Command::Shutdown => self.stopping = true,
        }
    }

    /// A new request (or prefill order) joins its tenant's queue.
    fn enqueue(&mut self, pending: Pending) {
        let running: BTreeSet<&str> = self
            .active
            .iter()
            .map(|a| a.pending.request.share.tenant.as_str())
            .collect();
        self.waiting
            .push_back(pending, |tenant| running.contains(tenant));
    }

    /// Sends one hand-off message on the link `peer`, if it is still up.
    fn to_peer(&self, peer: PeerId, message: &Message) {
        if let Some(p) = self.peers.get(&peer) {
            let _ = p.tx.message(message);
        }
    }

    /// A hand-off frame from the peer on link `peer`.
    fn take_frame(&mut self, peer: PeerId, frame: &Bytes) {
        let message = match Message::decode_shared(frame) {
            Ok(Some((message, _))) => message,
            Ok(None) | Err(_) => {
                warn!("malformed hand-off frame dropped");
                return;
            }
        };
        match self.role {
            Role::Prefill => {
                if let Message::Abort { id, epoch } = message {
                    self.abort_order(peer, id);
                    // Fault injection: a writer that never acknowledges.
                    fail::fail_point!("prefill-no-abort-ack", |_| {});
                    // This worker writes only from its own thread, so no
                    // write of this hand-off is still in flight now.
                    self.to_peer(peer, &Message::AbortAck { id, epoch });
                }
            }
            Role::Decode => self.receive_kv(peer, message),
            Role::Colocated => {}
        }
    }

    fn position(&self, id: RequestId) -> Option<usize> {
        self.active.iter().position(|a| a.pending.id == id)
    }

    fn drop_cancelled(&mut self) {
        let dropped_waiting = self.waiting.retain(|p| !p.is_cancelled());
        self.counters
            .queued
            .fetch_sub(dropped_waiting, Ordering::AcqRel);
        let mut dropped_active = 0;
        for index in (0..self.active.len()).rev() {
            if self.active[index].pending.is_cancelled() {
                let active = self.active.swap_remove(index);
                if let Some(peer) = active.kv.awaited_from()
                    && let Some(abort) = self.receiver.abort(active.pending.handoff_id())
                {
                    // The reservation is freed now; tell prefill to stop.
                    self.to_peer(peer, &abort);
                }
                dropped_active += 1;
            }
        }
        self.counters
            .running
            .fetch_sub(dropped_active, Ordering::AcqRel);
        let dropped = dropped_waiting + dropped_active;
        if dropped > 0 {
            self.counters
                .cancelled
                .fetch_add(dropped as u64, Ordering::Relaxed);
            debug!(dropped, "cancelled requests released");
        }
    }

    /// Refuses (503) every client request that has waited in the queue
    /// longer than `max_queue_wait` without being admitted: it cost nothing
    /// yet, and its client learns to retry instead of hanging. A request
    /// that already streamed tokens (preempted) or a prefill worker's order
    /// (its decode worker keeps the deadlines) is never expired here.
    fn expire_waits(&mut self, now: Instant) {
        let limit = self.config.max_queue_wait;
        for pending in self.waiting.iter_mut() {
            pending.waiting_since.get_or_insert(now);
        }
        let expired = self.waiting.take_where(|p| {
            matches!(p.origin, Origin::Client { .. })
                && p.resume.is_none()
                && p.waiting_since.is_some_and(|since| now >= since + limit)
        });
        for pending in expired {
            self.counters.queued.fetch_sub(1, Ordering::AcqRel);
            self.counters.queue_timeouts.fetch_add(1, Ordering::Relaxed);
            debug!(request = %pending.id, "waited past --max-queue-wait; refused");
            let message = format!(
                "the request waited {} s in the queue without being admitted; retry later",
                limit.as_secs_f64()
            );
            self.refuse(&pending, FailureKind::Unavailable, message);
        }
    }

    /// Under pressure — the next request to admit waits for room — every
    /// sheddable client request still waiting (negative priority, none of
    /// its tokens sent yet) is refused with 503 if the one that waits is
    /// not sheddable itself: bands keep them behind it, and their clients
    /// learn at once to retry later or elsewhere instead of holding queue
    /// places. Sheddable work waits only behind other sheddable work.
    fn shed_for(&mut self, blocked_is_sheddable: bool) {
        if blocked_is_sheddable {
            return;
        }
        let shed = self.waiting.take_where(|p| {
            p.request.share.sheddable()
                && matches!(p.origin, Origin::Client { .. })
                && p.resume.is_none()
        });
        for pending in shed {
            self.counters.queued.fetch_sub(1, Ordering::AcqRel);
            self.counters.shed.fetch_add(1, Ordering::Relaxed);
            debug!(request = %pending.id, priority = pending.request.share.priority(), "sheddable request shed");
            self.refuse(
                &pending,
                FailureKind::Unavailable,
                "the worker is full and this request is sheddable (negative priority); retry later"
                    .into(),
            );
        }
    }

    /// What a request leases when it is admitted: its context so far (the
    /// prompt, or after a preemption the prompt and what it generated but
    /// its last token) and, where it decodes, one page of room to grow. A
    /// prefill worker leases the prompt alone.
    fn first_lease(&self, pending: &Pending) -> (usize, Vec<u32>) {
        let request = &pending.request;
        let mut context = request.prompt.clone();
        if let Some(resume) = &pending.resume {
            let written = resume.generated.len().saturating_sub(1);
            context.extend_from_slice(&resume.generated[..written]);
        }
        let room = match self.role {
            Role::Prefill => 0,
            Role::Colocated | Role::Decode => {
                let page_size = self.pool.geometry().page_size;
                let left = request.kv_tokens().saturating_sub(context.len());
                left.min(page_size)
            }
        };
        (context.len() + room, context)
    }

    /// The link `peer` is gone. A decode worker fails every hand-off that
    /// link was filling (their reservations freed) and sends new grants to
    /// its other prefill workers; a prefill worker drops that link's orders.
    fn lose_peer(&mut self, peer: PeerId) {
        let Some(lost) = self.peers.remove(&peer) else {
            return;
        };
        warn!(role = self.role.label(), %peer, name = %lost.name, "peer link lost; failing its hand-offs");
        match self.role {
            Role::Decode => self.move_handoffs_of(peer),
            Role::Prefill | Role::Colocated => self.drop_orders_of(peer),
        }
    }

    /// Leases a request's first pages (see [`Scheduler::first_lease`]),
    /// starting with the longest prefix of its context its tenant has
    /// cached here: a colocated or prefill worker then computes only the
    /// rest, a decode worker is sent only the pages it lacks. (A one-sided
    /// writer is never given shared pages: shared-memory grants lease
    /// plainly.)
    fn lease_for(&self, pending: &Pending) -> Result<Lease, PoolError> {
        let (tokens, context) = self.first_lease(pending);
        let one_sided_grant =
            self.role == Role::Decode && self.one_sided && pending.resume.is_none();
        match &pending.request.cache {
            Some(scope) if !one_sided_grant && self.pool.has_prefix_cache() => {
                let namespace = match scope {
                    CacheScope::Tenant(scope) => {
                        self.pool
                            .namespace(&scope.tenant, scope.salt.as_deref(), &self.model.name)
                    }
                    CacheScope::Public => self.pool.public_namespace(&self.model.name),
                };
                self.pool
                    .lease_with_prefix(pending.id, tokens, &namespace, &context)
            }
            _ => self.pool.lease(pending.id, tokens),
        }
    }

    /// Whether a request must be refused because it can never fit this
    /// worker's pool, however long it waits (I6): for a prefill worker its
    /// prompt, for the others prompt plus `max_tokens`, since pages grow as
    /// it decodes.
    fn can_never_fit(&self, pending: &Pending) -> Option<String> {
        let needed = match self.role {
            Role::Prefill => pending.request.prompt.len(),
            Role::Colocated | Role::Decode => pending.request.kv_tokens(),
        };
        let capacity = self.pool.capacity_tokens();
        (needed > capacity).then(|| {
            PoolError::LargerThanPool {
                owner: pending.id,
                needed,
                capacity,
            }
            .to_string()
        })
    }

    /// Whether admitting a request that needs `pages` new pages leaves
    /// every running request a page to grow by: admission stops short of
    /// the point where the next step would have to preempt.
    fn leaves_room_to_grow(&self, pages: usize) -> bool {
        if self.role == Role::Prefill || self.active.is_empty() {
            return true;
        }
        self.pool.stats().available_pages() >= pages + self.active.len()
    }

    /// Tenants admitted no more for now: they hold
    /// [`fair::MAX_POOL_SHARE`] of this worker's pool while it knows other
    /// tenants (I11). Held pages count by capacity; a grant awaiting its
    /// hand-off by its prompt.
    /// Pool tokens each tenant's running requests hold (a grant awaiting
    /// its KV holds its prompt's pages), with the tenant's weight.
    fn held_by_tenant(&self) -> BTreeMap<&str, (u32, usize)> {
        let mut held: BTreeMap<&str, (u32, usize)> = BTreeMap::new();
        for a in &self.active {
            let tokens = match &a.kv {
                Kv::Held(lease) => lease.capacity_tokens(),
                Kv::Awaited(_) => a.pending.request.prompt.len(),
            };
            let share = &a.pending.request.share;
            let entry = held.entry(share.tenant.as_str()).or_default();
            entry.0 = share.weight();
            entry.1 += tokens;
        }
        held
    }

    /// Tenants holding more of the pool than their weighted share of it
    /// among the tenants holding pages (none while only one does).
    fn tenants_over_their_share(&self) -> BTreeSet<String> {
        let held = self.held_by_tenant();
        if held.len() < 2 {
            return BTreeSet::new();
        }
        let weights: u64 = held.values().map(|(w, _)| u64::from(*w)).sum();
        let pool = self.pool.capacity_tokens() as u64;
        held.into_iter()
            .filter(|(_, (weight, tokens))| *tokens as u64 * weights > pool * u64::from(*weight))
            .map(|(tenant, _)| tenant.to_string())
            .collect()
    }

    /// Tenants admitted no more while the worker knows another: those
    /// holding [`fair::MAX_POOL_SHARE`] of the pool.
    fn tenants_at_their_cap(&self) -> BTreeSet<String> {
        if self.waiting.named_tenants() < 2 {
            return BTreeSet::new();
        }
        let (num, den) = fair::MAX_POOL_SHARE;
        let cap = self.pool.capacity_tokens() * num / den;
        self.held_by_tenant()
            .into_iter()
            .filter(|&(_, (_, tokens))| tokens >= cap)
            .map(|(tenant, _)| tenant.to_string())
            .collect()
    }

    fn admit(&mut self, now: Instant) {
        // Incident replay (l): cached tokens read off the pool-wide counter
        // across an admission pass, other tenants' hits included.
        let pass_hits = Mutation::ForeignCachedCount
            .active()
            .then(|| self.pool.stats().cache_hit_tokens);
        loop {
            let capped = self.tenants_at_their_cap();
            let eligible = |tenant: &str| !capped.contains(tenant);
            let Some(pending) = self.waiting.front(eligible) else {
                break;
            };
            if self.active.len() >= self.config.max_running {
                self.shed_for(pending.request.share.sheddable());
                break;
            }
            if let Some(message) = self.can_never_fit(pending) {
                let pending = self.waiting.pop_front(eligible).expect("the front exists");
                self.counters.queued.fetch_sub(1, Ordering::AcqRel);
                self.refuse(&pending, FailureKind::TooLong, message);
                continue;
            }
            let page_size = self.pool.geometry().page_size;
            if !self.leaves_room_to_grow(self.first_lease(pending).0.div_ceil(page_size)) {
                self.shed_for(pending.request.share.sheddable());
                break;
            }
            // A preempted request comes back to this worker's own pages and
            // recomputes here; only a new one is granted to prefill.
            let granting = self.role == Role::Decode && pending.resume.is_none();
            let prefill = if granting {
                match self.choose_prefill(pending) {
                    Ok(peer) => Some(peer),
                    Err((kind, message)) => {
                        let pending = self.waiting.pop_front(eligible).expect("the front exists");
                        self.counters.queued.fetch_sub(1, Ordering::AcqRel);
                        self.refuse(&pending, kind, message);
                        continue;
                    }
                }
            } else {
                None
            };
            let lease = match self.lease_for(pending) {
                Ok(lease) => lease,
                // Pages will come back as running requests end; keep order.
                Err(PoolError::Exhausted { .. }) => {
                    self.shed_for(pending.request.share.sheddable());
                    break;
                }
                Err(error) => {
                    let pending = self.waiting.pop_front(eligible).expect("the front exists");
                    self.counters.queued.fetch_sub(1, Ordering::AcqRel);
                    self.refuse(&pending, FailureKind::TooLong, error.to_string());
                    continue;
                }
            };
            let mut pending = self.waiting.pop_front(eligible).expect("the front exists");
            self.counters.queued.fetch_sub(1, Ordering::AcqRel);
            if matches!(pending.origin, Origin::Client { .. }) && pending.resume.is_none() {
                let waited = pending
                    .waiting_since
                    .map_or(std::time::Duration::ZERO, |since| {
                        now.saturating_duration_since(since)
                    });
                self.counters
                    .queue_wait(&pending.request.share.tenant, waited);
            }
            self.admissions += 1;
            let admitted = self.admissions;
            if let Some(resume) = pending.resume.take() {
                let Resume {
                    sampler,
                    constraint,
                    text,
                    generated,
                    cached,
                } = *resume;
                debug!(request = %pending.id, written = lease.cached_tokens(), "preempted request resumes");
                self.counters.running.fetch_add(1, Ordering::AcqRel);
                self.active.push(Active {
                    written: lease.cached_tokens(),
                    pending,
                    kv: Kv::Held(lease),
                    sampler,
                    constraint,
                    text,
                    cached,
                    generated,
                    admitted,
                });
                continue;
            }
            let sampler = match Sampler::new(pending.request.sampling.clone()) {
                Ok(sampler) => sampler,
                Err(error) => {
                    self.refuse(&pending, FailureKind::Internal, error.to_string());
                    continue;
                }
            };
            let constraint = match self.constraint_for(&pending.request) {
                Ok(constraint) => constraint,
                Err(error) => {
                    // The front door compiled this grammar before; failing
                    // here is the grammar's limits, never its text (I10).
                    warn!(request = %pending.id, "the request's grammar did not compile");
                    self.refuse(&pending, FailureKind::Internal, error.to_string());
                    continue;
                }
            };
            // A decode worker's cached pages only spare the link; its
            // request counts as written when the hand-off commits.
            let written = match self.role {
                Role::Decode => 0,
                Role::Colocated | Role::Prefill => lease.cached_tokens(),
            };
            let cached = match pass_hits {
                Some(before) => (self.pool.stats().cache_hit_tokens - before) as usize,
                None => written,
            };
            let kv = if granting {
                let prompt = pending.request.prompt.len();
                let granted = if self.one_sided {
                    self.receiver
                        .grant_one_sided(pending.handoff_id(), lease, prompt)
                        .map(|(grant, window)| (grant, Some((window.clone(), window.key()))))
                } else {
                    self.receiver
                        .grant(pending.handoff_id(), lease, prompt)
                        .map(|grant| (grant, None))
                };
                match granted {
                    Ok((grant, window)) => {
                        let peer = prefill.expect("a decode worker chose a prefill worker");
                        // Its prompt is computed for this worker's tenant
                        // elsewhere: charged here, or this worker's
                        // admission — which decides whose prompts the
                        // prefill workers get — would see only decode
                        // rows and admit in arrival order (I11).
                        self.waiting.charge(&pending.request.share, prompt);
                        self.send_order(peer, grant, &pending.request, window);
                        Kv::Awaited(Awaiting {
                            prefill: peer,
                            granted_at: now,
                            heard_at: now,
                            news: false,
                        })
                    }
                    Err(error) => {
                        self.refuse(&pending, FailureKind::Internal, error.to_string());
                        continue;
                    }
                }
            } else {
                Kv::Held(lease)
            };
            let text = TextStream::new(pending.request.stop.clone());
            self.counters.running.fetch_add(1, Ordering::AcqRel);
            self.active.push(Active {
                pending,
                kv,
                sampler,
                constraint,
                text,
                written,
                cached,
                generated: Vec::new(),
                admitted,
            });
        }
    }

    /// Gives every decoding request room for the position its next token
    /// writes, higher priorities and older requests first. One that cannot
    /// grow takes the pages of another request holding pages — the lowest
    /// priority, then one of a tenant over its weighted share of the pool,
    /// then the most recently admitted — or, if that is itself, steps back itself:
    /// a running request is preempted, never failed, for lack of pages,
    /// and the oldest requests keep going.
    fn make_room(&mut self) {
        let mut order: Vec<(Reverse<i32>, u64, RequestId)> = self
            .active
            .iter()
            .filter(|a| a.kv.lease().is_some() && a.prefill_done())
            .map(|a| {
                let priority = a.pending.request.share.priority();
                (Reverse(priority), a.admitted, a.pending.id)
            })
            .collect();
        order.sort_unstable();
        for (_, _, id) in order {
            while let Some(index) = self.position(id) {
                let active = &mut self.active[index];
                let need = active.written + 1;
                let lease = active.kv.lease_mut().expect("chosen for holding a lease");
                if lease.capacity_tokens() >= need || lease.grow(1).is_ok() {
                    break;
                }
                // The lowest priority first, then a tenant holding more
                // than its weighted share of the pool (I11: growth must
                // not let one tenant push another out), then the newest.
                let over_share = self.tenants_over_their_share();
                let victim = self
                    .active
                    .iter()
                    .enumerate()
                    .filter(|(_, a)| a.kv.lease().is_some())
                    .max_by_key(|(_, a)| {
                        let share = &a.pending.request.share;
                        (
                            Reverse(share.priority()),
                            over_share.contains(&share.tenant),
                            a.admitted,
                        )
                    })
                    .map(|(i, _)| i)
                    .expect("the request itself holds a lease");
                self.preempt(victim);
            }
        }
    }

    /// Takes request `index`'s pages back and puts it at the front of the
    /// queue with its progress. What it wrote is sealed into the cache
    /// first, so coming back costs little more than its last page.
    fn preempt(&mut self, index: usize) {
        let mut active = self.active.swap_remove(index);
        assert!(
            matches!(active.pending.origin, Origin::Client { .. }),
            "only a decoding request grows, so only one is preempted"
        );
        active.seal_conversation();
        let Active {
            mut pending,
            kv,
            sampler,
            constraint,
            text,
            generated,
            cached,
            ..
        } = active;
        drop(kv);
        debug!(request = %pending.id, generated = generated.len(), "preempted for pages");
        pending.resume = Some(Box::new(Resume {
            sampler,
            constraint,
            text,
            generated,
            cached,
        }));
        self.counters.running.fetch_sub(1, Ordering::AcqRel);
        self.counters.queued.fetch_add(1, Ordering::AcqRel);
        self.counters.preempted.fetch_add(1, Ordering::Relaxed);
        self.waiting.push_front(pending);
    }

    /// Tokens this step may process: `step_tokens`, or once this worker
    /// serves more than one tenant the shorter `shared_step_tokens` (I11).
    /// A tenant's request that arrives waits for the step in flight — which
    /// may be another tenant's alone — and then its own, so their length is
    /// its latency; measured, the shorter steps cost a few percent of
    /// prefill throughput, and a worker of one tenant keeps the long ones.
    fn step_budget(&self) -> usize {
        if self.waiting.named_tenants() > 1 {
            self.config.shared_step_tokens.min(self.config.step_tokens)
        } else {
            self.config.step_tokens
        }
    }

    /// Decode tokens first (one per decoding request), then prefill chunks
    /// with what is left of the budget, split between the tenants with
    /// prompt tokens to compute by weight ([`split_budget`]) and, within a
    /// tenant, given in admission order: one tenant's long prompts cannot
    /// hold back another's short one by more than a step. Prefill always
    /// gets some room so a full decode batch cannot starve new requests.
    fn plan(&self) -> Vec<Work> {
        let mut work = Vec::new();
        for (index, a) in self.active.iter().enumerate() {
            if a.kv.lease().is_some() && a.prefill_done() {
                let last = *a
                    .generated
                    .last()
                    .expect("a decoding request has sampled a token");
                debug_assert_eq!(
                    a.written,
                    a.kv_target(),
                    "a decoding request's KV is complete"
                );
                work.push(Work {
                    index,
                    past: a.written,
                    tokens: vec![last],
                    logits: Logits::Last,
                });
            }
        }
        let rows = work.len();
        let budget = self.step_budget().saturating_sub(rows).max(16);
        let mut prefilling: Vec<usize> = (0..self.active.len())
            .filter(|&i| self.active[i].kv.lease().is_some() && !self.active[i].prefill_done())
            .collect();
        prefilling.sort_unstable_by_key(|&i| self.active[i].admitted);
        let mut claims: BTreeMap<&str, (u32, usize)> = BTreeMap::new();
        for &i in &prefilling {
            let a = &self.active[i];
            let share = &a.pending.request.share;
            let claim = claims
                .entry(share.tenant.as_str())
                .or_insert((share.weight(), 0));
            claim.1 += a.kv_target() - a.written;
        }
        let split = split_budget(budget, &claims.values().copied().collect::<Vec<_>>());
        let mut allowance: BTreeMap<&str, usize> = claims.keys().copied().zip(split).collect();
        for index in prefilling {
            let a = &self.active[index];
            let left = allowance
                .get_mut(a.pending.request.share.tenant.as_str())
                .expect("every prefilling request's tenant has a claim");
            if *left == 0 {
                continue;
            }
            let target = a.kv_target();
            let take = (target - a.written).min(*left);
            *left -= take;
            let end = a.written + take;
            // A fresh prompt's last chunk samples the first token; a
            // preempted request's recomputation samples nothing (its next
            // input is the token it had already generated).
            let logits = if end == target && a.generated.is_empty() {
                Logits::Last
            } else {
                Logits::None
            };
            work.push(Work {
                index,
                past: a.written,
                tokens: a.context(a.written..end),
                logits,
            });
        }
        debug_assert!(
            work.iter().map(|w| w.tokens.len()).sum::<usize>() <= rows + budget,
            "a step stays within its token budget"
        );
        work
    }

    fn step(&mut self) {
        self.make_room();
        let work = self.plan();
        if work.is_empty() {
            return;
        }
        trace!(
            role = self.role.label(),
            sequences = work.len(),
            tokens = work.iter().map(|w| w.tokens.len()).sum::<usize>(),
            "step"
        );
        if self.role == Role::Decode {
            // Fault injection: a slow or crashing decode step.
            fail::fail_point!("decode-step", crash_or_stall);
        }
        let result = {
            let mut leases: Vec<Option<&mut Lease>> =
                self.active.iter_mut().map(|a| a.kv.lease_mut()).collect();
            let mut batch: Vec<Sequence<'_>> = work
                .iter()
                .map(|w| Sequence {
                    lease: leases[w.index]
                        .take()
                        .expect("planned work has a lease, one piece per request"),
                    past: w.past,
                    tokens: &w.tokens,
                    logits: w.logits,
                })
                .collect();
            self.model.model.forward_each(&mut batch)
        };
        self.counters.steps.fetch_add(1, Ordering::Relaxed);
        self.compute_masks(&work);
        let mut ended: Vec<(usize, End)> = Vec::new();
        for (w, row) in work.iter().zip(result) {
            let row = match row {
                Ok(row) => row,
                Err(error) => {
                    // Fail closed (I7), and alone: this request ends with an
                    // error and no token from this step; the rest of the
                    // batch goes on, its rows untouched by this one.
                    warn!(request = %self.active[w.index].pending.id, %error, "a sequence failed its forward pass");
                    ended.push((
                        w.index,
                        End::Failed(FailureKind::Internal, error.to_string()),
                    ));
                    continue;
                }
            };
            let active = &mut self.active[w.index];
            self.waiting
                .charge(&active.pending.request.share, w.tokens.len());
            let prefilling = !active.prefill_done();
            active.written += w.tokens.len();
            if prefilling {
                self.counters
                    .prompt_tokens
                    .fetch_add(w.tokens.len() as u64, Ordering::Relaxed);
                if active.prefill_done()
                    && active.generated.is_empty()
                    && let Some(lease) = active.kv.lease_mut()
                {
                    // The prompt's full pages serve the tenant's next
                    // requests from now on, this one's siblings included.
                    lease.seal(&active.pending.request.prompt);
                }
                if !active.prefill_done()
                    && let Err(error) = self.ship_ready_pages(w.index)
                {
                    ended.push((
                        w.index,
                        End::Failed(FailureKind::Internal, error.to_string()),
                    ));
                    continue;
                }
            }
            if w.logits == Logits::Last
                && let Some(end) = self.advance(w.index, &row)
            {
                ended.push((w.index, end));
            }
        }
        ended.sort_unstable_by_key(|(index, _)| *index);
        for (index, end) in ended.into_iter().rev() {
            self.end(index, end);
        }
    }

    /// The token masks this step's draws need, computed together on the
    /// compute pool rather than one after another on this thread: a large
    /// schema's mask takes milliseconds, and every row of the batch waits
    /// for the last. A mask that fails is computed again, and its error
    /// reported, where the request draws.
    fn compute_masks(&mut self, work: &[Work]) {
        let drawing: BTreeSet<usize> = work
            .iter()
            .filter(|w| w.logits == Logits::Last)
            .map(|w| w.index)
            .collect();
        let constraints: Vec<&mut Constraint> = self
            .active
            .iter_mut()
            .enumerate()
            .filter(|(index, _)| drawing.contains(index))
            .filter_map(|(_, active)| active.constraint.as_mut())
            .collect();
        if constraints.len() > 1 {
            use rayon::prelude::*;
            constraints.into_par_iter().for_each(|constraint| {
                let _ = constraint.mask();
            });
        }
    }

    /// Removes request `index`, dropping its lease (I8), and tells whoever waits.
    fn end(&mut self, index: usize, end: End) {
        let mut active = self.active.swap_remove(index);
        self.counters.running.fetch_sub(1, Ordering::AcqRel);
        match end {
            End::Finished(event) => {
                active.seal_conversation();
                self.counters.finished.fetch_add(1, Ordering::Relaxed);
                active.pending.send(event);
            }
            End::Failed(kind, message) => self.refuse(&active.pending, kind, message),
            End::Shipped => {
                self.counters.finished.fetch_add(1, Ordering::Relaxed);
            }
        }
    }

    fn refuse(&self, pending: &Pending, kind: FailureKind, message: String) {
        self.counters.failed.fetch_add(1, Ordering::Relaxed);
        match &pending.origin {
            Origin::Client { .. } => pending.send(Event::Failed { kind, message }),
            Origin::Handoff { peer, id, .. } => {
                let reason = if kind == FailureKind::TooLong {
                    RejectReason::TooLong
                } else {
                    RejectReason::Failed
                };
                self.to_peer(*peer, &Message::Reject { id: *id, reason });
            }
        }
    }

    /// A fresh constraint for `request`'s grammar, if it has one: a copy
    /// of the start state the front door compiled, or — for a request
    /// that came over a link — compiled here.
    fn constraint_for(
        &mut self,
        request: &GenerationRequest,
    ) -> Result<Option<Constraint>, kvfence_model::ModelError> {
        let Some(constrained) = &request.constraint else {
            return Ok(None);
        };
        match constrained.start() {
            Some(start) => Ok(Some(start)),
            None => self
                .grammars
                .constraint(&self.model, &constrained.grammar)
                .map(Some),
        }
    }

    /// Samples the next token of one request and acts on it.
    fn advance(&mut self, index: usize, logits: &[f32]) -> Option<End> {
        let active = &mut self.active[index];
        let mask = match active.constraint.as_mut().map(Constraint::mask).transpose() {
            Ok(mask) => mask,
            Err(error) => return Some(End::Failed(FailureKind::Internal, error.to_string())),
        };
        let allows = mask.map(|mask| move |token: u32| mask.allows(token));
        let context = DrawContext {
            prompt: &active.pending.request.prompt,
            generated: &active.generated,
            allowed: allows.as_ref().map(|f| f as &dyn Fn(u32) -> bool),
        };
        let draw = match active.sampler.draw(logits, context) {
            Ok(draw) => draw,
            Err(error) => return Some(End::Failed(FailureKind::Internal, error.to_string())),
        };
        if matches!(self.active[index].pending.origin, Origin::Handoff { .. }) {
            return Some(self.ship(index, draw.token, draw.logprobs));
        }
        self.accept(index, draw.token, draw.logprobs)
    }

    /// Records a generated token, streams its text, and says whether the
    /// request is done.
    fn accept(&mut self, index: usize, token: u32, logprobs: Option<TokenLogprobs>) -> Option<End> {
        let eos = &self.model.model.config().eos_token_ids;
        let tokenizer = &self.model.tokenizer;
        let active = &mut self.active[index];
        active.generated.push(token);
        if let Some(constraint) = &mut active.constraint
            && let Err(error) = constraint.accept(token)
        {
            return Some(End::Failed(FailureKind::Internal, error.to_string()));
        }
        self.counters
            .generated_tokens
            .fetch_add(1, Ordering::Relaxed);
        let request = &active.pending.request;
        let usage = Usage {
            prompt_tokens: request.prompt.len(),
            completion_tokens: active.generated.len(),
            cached_tokens: active.cached,
        };
        let finish = |reason| Some(End::Finished(Event::Finished { reason, usage }));
        let flush = |active: &mut Active| match active.text.flush(tokenizer) {
            Ok(rest) => {
                if !rest.is_empty() {
                    active.pending.send(Event::Token {
                        text: rest,
                        logprobs: None,
                    });
                }
                None
            }
            Err(error) => Some(End::Failed(FailureKind::Internal, error.to_string())),
        };
        if !request.ignore_eos && eos.contains(&token) {
            active.pending.send(Event::Token {
                text: String::new(),
                logprobs: None,
            });
            return flush(active).or_else(|| finish(FinishReason::Stop));
        }
        let pushed = match active.text.push(tokenizer, token) {
            Ok(pushed) => pushed,
            Err(error) => return Some(End::Failed(FailureKind::Internal, error.to_string())),
        };
        active.pending.send(Event::Token {
            text: pushed.delta,
            logprobs,
        });
        if pushed.stopped {
            return finish(FinishReason::Stop);
        }
        if active
            .constraint
            .as_ref()
            .is_some_and(Constraint::is_finished)
        {
            // The grammar is complete: nothing but the end may follow.
            return flush(active).or_else(|| finish(FinishReason::Stop));
        }
        if active.generated.len() == active.pending.request.max_tokens {
            return flush(active).or_else(|| finish(FinishReason::Length));
        }
        None
    }

    /// Ends every request queued or running with `ShuttingDown`, giving
    /// back every page.
    pub(crate) fn fail_everything(&mut self) {
        let reason = || {
            (
                FailureKind::ShuttingDown,
                "the server is shutting down".to_string(),
            )
        };
        for pending in self.waiting.take_all() {
            self.counters.queued.fetch_sub(1, Ordering::AcqRel);
            let (kind, message) = reason();
            self.refuse(&pending, kind, message);
        }
        for active in std::mem::take(&mut self.active) {
            self.counters.running.fetch_sub(1, Ordering::AcqRel);
            let (kind, message) = reason();
            self.refuse(&active.pending, kind, message);
        }
    }
}

/// What a `return(ARG)` failpoint does: `crash` ends the process the way a
/// crash would — no clean-up, nothing said to peers; anything else makes
/// the caller drop what it was doing (a stall, or a lost message).
#[cfg(feature = "failpoints")]
fn crash_or_stall(arg: Option<String>) {
    if arg.as_deref() == Some("crash") {
        std::process::exit(86);
    }
}

#[cfg(test)]
impl Scheduler {
    /// What is queued and running, for a failing simulation's report.
    pub(crate) fn describe(&self) -> String {
        let waiting: Vec<String> = self
            .waiting
            .iter()
            .map(|p| {
                format!(
                    "{} (prompt {}, max {}, resumed {})",
                    p.id,
                    p.request.prompt.len(),
                    p.request.max_tokens,
                    p.resume.is_some()
                )
            })
            .collect();
        let active: Vec<String> = self
            .active
            .iter()
            .map(|a| {
                let kv = match &a.kv {
                    Kv::Awaited(_) => "awaited".to_string(),
                    Kv::Held(lease) => format!("held {} tokens", lease.capacity_tokens()),
                };
                format!(
                    "{} (written {}, target {}, generated {}, {kv})",
                    a.pending.id,
                    a.written,
                    a.kv_target(),
                    a.generated.len()
                )
            })
            .collect();
        format!(
            "waiting {waiting:?}, active {active:?}, pool {:?}",
            self.pool.stats()
        )
    }
}

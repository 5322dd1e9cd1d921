//! The scheduler: continuous batching over one model and one pool, in one
//! of three roles — the core here (its state, commands, peers, the counts
//! checked against that state), who gets pages and who gives them back in
//! [`admission`], the batch plan and forward pass in [`step`], the prefill
//! role's part in [`prefill`], the decode role's in [`decode`].
//!
//! The core is a state machine without IO: [`Scheduler::handle`] takes one
//! command and returns its [`Effect`]s (events to clients, frames, orders
//! and notices to peers), [`Scheduler::poll`] does what is due at the time
//! it is given and hands its effects to an [`Outside`] — before each
//! forward pass and at its end — which it also asks, between a pass's
//! layers, whether a command waits. The core holds addresses but sends
//! through none. It reads the clock only to measure what compute cost (a
//! grammar mask's time, charged to its tenant in tokens), never to decide
//! what is due. [`Shell`] is the thin shell of a running worker: it blocks
//! on the inbox, reads the wall clock and delivers; the fleet simulator
//! (the `sim` module) runs many cores on one virtual clock instead and
//! routes their effects over its virtual links.
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

mod admission;
#[cfg(test)]
mod cache_tests;
#[cfg(test)]
mod deadline_tests;
mod decode;
mod effects;
#[cfg(test)]
mod express_tests;
mod fair;
#[cfg(test)]
mod fair_tests;
mod grammar;
mod prefill;
mod shell;
mod step;
mod turn;

#[cfg(test)]
pub(crate) use effects::Deliver;
use effects::Outbox;
pub(crate) use effects::{ClientTx, Effect, Outside, PeerTx, ToPeer};
pub(crate) use shell::Shell;

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;

use bytes::Bytes;
use kvfence_handoff::{FRAME_SHELF_BYTES, FrameShelf, HandoffId, Message, Receiver, Streaming};
use kvfence_model::{Constraint, LoadedModel, Logits, Pass, PromptLogprob, Sampler};
use kvfence_pool::{Keep, Lease, Pool, RequestId, Window, WindowKey};
use tokio::sync::mpsc as tokio_mpsc;
use tracing::{debug, warn};

use crate::config::EngineConfig;
pub(crate) use crate::config::Role;
use crate::counters::Counters;
use crate::request::{CacheScope, Event, FailureKind, GenerationRequest, RequestHandle};
use crate::text::TextStream;
use crate::trace::Timeline;
use fair::FairQueue;
use grammar::GrammarCache;
pub(crate) use turn::ComputeTurn;

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
    Client(ClientTx),
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
    /// Its time on this worker, if it is traced; recorded when it leaves.
    pub(crate) timeline: Timeline,
    /// The prompt's scores, if it asked for them. Kept here so a request
    /// preempted while prefilling does not score a position twice.
    pub(crate) prompt_scores: PromptScores,
}

/// Where scoring a request's prompt stands.
#[derive(Debug, Default)]
pub(crate) enum PromptScores {
    /// Not asked for, or already handed on (to the client, or in `Done`).
    #[default]
    None,
    /// Computed so far: the score of prompt token `i + 1` at `i`.
    Scoring(Vec<PromptLogprob>),
}

impl PromptScores {
    /// Where a request asking for `asked` starts.
    fn start(asked: Option<usize>) -> PromptScores {
        match asked {
            Some(_) => PromptScores::Scoring(Vec::new()),
            None => PromptScores::None,
        }
    }

    /// The scores so far, and scoring no more.
    fn take(&mut self) -> Vec<PromptLogprob> {
        match std::mem::take(self) {
            PromptScores::Scoring(scores) => scores,
            PromptScores::None => Vec::new(),
        }
    }
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
        let timeline = Timeline::start(request.trace);
        let request_scores = request.sampling.prompt_logprobs;
        let pending = Pending {
            id,
            request,
            origin: Origin::Client(ClientTx::new(events, cancelled)),
            prefill,
            moved: false,
            resume: None,
            waiting_since: None,
            timeline,
            prompt_scores: PromptScores::start(request_scores),
        };
        (pending, handle)
    }

    /// Whether its prompt is being scored: its chunks need every row's
    /// logits, and none of its prompt may come from the prefix cache.
    fn scores_prompt(&self) -> bool {
        matches!(self.prompt_scores, PromptScores::Scoring(_))
    }

    fn is_cancelled(&self) -> bool {
        match &self.origin {
            Origin::Client(client) => client.is_cancelled(),
            Origin::Handoff { aborted, .. } => *aborted,
        }
    }

    /// Tells the client `event` — unless it cancelled: from then on it
    /// hears nothing, even what a hand-off message handled before the next
    /// poll releases the request would say.
    fn tell(&self, outbox: &mut Outbox, event: Event) {
        if let Origin::Client(client) = &self.origin {
            outbox.client(client, event);
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
    /// `All` for a chunk of a prompt being scored, `Last` when it draws,
    /// else `None`.
    logits: Logits,
    /// Whether its last row's logits draw the request's next token.
    draws: bool,
}

/// A step whose forward pass stopped between two layers for a command
/// (see [`Scheduler::step`]). Its requests are named by id, since requests
/// ended meanwhile move the others in `active`; none of its own is ended,
/// preempted or aborted until it ends.
struct InFlight {
    pass: Pass,
    work: Vec<Work>,
    /// The request of each piece of `work`.
    ids: Vec<RequestId>,
    /// Express work run ahead of it so far, in tokens (see
    /// [`Scheduler::step`]).
    express_tokens: usize,
    /// How long its pass has computed so far, pauses not counted.
    computing: std::time::Duration,
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
    /// Most rows of prompts being scored one pass may hold, all such
    /// prompts together: each returns a whole vocabulary of logits
    /// ([`step::SCORING_LOGITS_BYTES`]).
    scoring_rows: usize,
    /// The compute pool's turn, shared with the other worker of this
    /// process if there is one: a pass computes only while it holds it.
    turn: Arc<ComputeTurn>,
    /// Times the passes and grammar masks charged to tenants.
    stopwatch: step::Stopwatch,
    /// The step whose pass paused for a command, if one did.
    in_flight: Option<InFlight>,
    /// What it sent and its caller has not yet taken.
    outbox: Outbox,
    /// Prefill role: the buffers of chunk frames, back from the transport
    /// once it has sent them, for the next ones.
    frames: FrameShelf,
    /// Commands that could end or abort a request of the step in flight,
    /// taken when it ends.
    held_back: Vec<Command>,
    /// Empty, always — except in a build with an incident replay of batch
    /// rows switched on (mutations (n) and (o)), where it keeps the last
    /// ended request's grammar and tokens as a row left unreset would.
    /// Every row's grammar, sampler and penalty history belong to its
    /// [`Active`], made from its own request and dropped with it.
    left_in_row: LeftInRow,
}

/// What a planted bug keeps of an ended request: see
/// [`Scheduler::left_in_row`].
#[derive(Default)]
struct LeftInRow {
    constraint: Option<Constraint>,
    generated: Vec<u32>,
}

impl Scheduler {
    pub(crate) fn new(
        role: Role,
        model: Arc<LoadedModel>,
        pool: Pool,
        config: EngineConfig,
        counters: Arc<Counters>,
    ) -> Self {
        let groups = pool.layer_groups();
        assert!(
            (0..groups.len()).all(|g| match groups.keep(g) {
                Keep::All => true,
                Keep::Window { max_run, .. } => max_run >= config.longest_write(),
            }),
            "a pool's windows hold the longest write of a step"
        );
        let vocab = model.model.config().vocab_size;
        Scheduler {
            scoring_rows: (step::SCORING_LOGITS_BYTES / (vocab * std::mem::size_of::<f32>()))
                .max(1),
            role,
            model,
            pool,
            config,
            counters,
            peers: BTreeMap::new(),
            receiver: Receiver::new(),
            waiting: FairQueue::new(),
            active: Vec::new(),
            stopping: false,
            next_local_id: 1,
            one_sided: false,
            admissions: 0,
            grammars: GrammarCache::default(),
            turn: Arc::default(),
            stopwatch: step::Stopwatch::default(),
            in_flight: None,
            outbox: Outbox::default(),
            frames: FrameShelf::new(FRAME_SHELF_BYTES),
            held_back: Vec::new(),
            left_in_row: LeftInRow::default(),
        }
    }

    /// Takes turns on the compute pool with the other workers holding
    /// `turn`: those of the same process.
    pub(crate) fn sharing_turn(mut self, turn: Arc<ComputeTurn>) -> Self {
        self.turn = turn;
        self
    }

    /// Decode role over a one-sided transport.
    pub(crate) fn with_one_sided_grants(mut self, one_sided: bool) -> Self {
        assert!(
            !one_sided || self.pool.layer_groups().len() == 1,
            "a one-sided writer stores into pools of one layer group"
        );
        self.one_sided = one_sided;
        self
    }

    /// Whether it was told to stop (or its inbox closed).
    pub(crate) fn is_stopping(&self) -> bool {
        self.stopping
    }

    /// Stops: the shell's inbox is gone.
    pub(crate) fn stop(&mut self) {
        self.stopping = true;
    }

    /// A stopping worker's last words: every request it holds fails with
    /// `ShuttingDown`, giving back its pages, and so does every submission
    /// in `raced` (commands that arrived after it was told to stop).
    pub(crate) fn shut_down(&mut self, raced: Vec<Command>) -> Vec<Effect> {
        self.fail_everything();
        for command in raced {
            if let Command::Submit(mut pending) = command {
                self.counters.queued.fetch_sub(1, Ordering::AcqRel);
                self.refuse(
                    &mut pending,
                    FailureKind::ShuttingDown,
                    "the server is shutting down".into(),
                );
            }
        }
        self.outbox.take()
    }

    /// Does what is due at `now`: aborts hand-offs past their deadline,
    /// drops cancelled requests, admits what fits, and runs one step if any
    /// request has pages to compute (admitting again after it, since the
    /// step may have freed pages). Returns whether a step ran.
    ///
    /// What it sends goes to `outside`: before each forward pass (which may
    /// be long) and at the end. Between a pass's layers it asks `outside`
    /// whether a command waits, and if one does the pass pauses there
    /// until the next poll (see [`Scheduler::step`]).
    pub(crate) fn poll(&mut self, now: Instant, outside: &mut (dyn Outside + Send)) -> bool {
        self.expire_handoffs(now);
        self.report_progress(now);
        self.drop_cancelled();
        self.expire_waits(now);
        self.admit(now);
        let stepped = self.has_work();
        if stepped {
            self.step(outside);
            self.admit(now);
        }
        self.check_counts();
        outside.send(self.outbox.take());
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

    /// Whether this worker serves more than one tenant: it was told so
    /// ([`EngineConfig::shared`], or by a request's
    /// [`Share::shared`](crate::Share::shared)) or
    /// two named tenants have sent it work.
    fn shared(&self) -> bool {
        self.config.shared || self.waiting.serves_several()
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

    /// Feeds one command and returns what that sends. No IO and no clock
    /// (the times a command starts are set by the next poll).
    #[must_use = "effects are the core's only way out"]
    pub(crate) fn handle(&mut self, command: Command) -> Vec<Effect> {
        self.take(command);
        self.check_counts();
        self.outbox.take()
    }

    fn take(&mut self, command: Command) {
        if self.in_flight.is_some()
            && self.role == Role::Prefill
            && matches!(command, Command::Frame { .. })
        {
            // An `Abort` is acknowledged as it is taken, promising that no
            // write of its hand-off follows; the step in flight may still
            // ship that order's pages when it ends. So it waits for the end.
            self.held_back.push(command);
            return;
        }
        match command {
            Command::Submit(mut pending) => {
                pending.timeline.taken_by(self.role);
                self.enqueue(*pending)
            }
            Command::Prefill { peer, order } if self.role == Role::Prefill => {
                self.take_order(peer, *order)
            }
            Command::Prefill { peer, .. } => {
                // Its links refuse orders before they get here; defence in
                // depth against a worker prefilling for a peer it serves.
                warn!(%peer, role = self.role.label(), "an order to a worker that does not prefill for peers, dropped");
            }
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
                    self.outbox.peer(&p.tx, ToPeer::Draining);
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
    fn send_to_peer(&mut self, peer: PeerId, message: &Message) {
        if let Some(p) = self.peers.get(&peer) {
            self.outbox.message(&p.tx, message);
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
                    self.send_to_peer(peer, &Message::AbortAck { id, epoch });
                }
            }
            Role::Decode => self.receive_kv(peer, message),
            Role::Colocated => {}
        }
    }

    fn position(&self, id: RequestId) -> Option<usize> {
        self.active.iter().position(|a| a.pending.id == id)
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
    /// A client's request, counted queued as the engine counts it before
    /// it sends it, then handled.
    pub(crate) fn submit(&mut self, pending: Pending) {
        self.counters.queued.fetch_add(1, Ordering::AcqRel);
        self.feed(Command::Submit(Box::new(pending)));
    }

    /// Handles `command`, delivering what it sends.
    pub(crate) fn feed(&mut self, command: Command) {
        self.handle(command).into_iter().for_each(Effect::deliver);
    }

    /// Polls at `now`, delivering at once and never pausing a pass.
    pub(crate) fn poll_delivering(&mut self, now: Instant) -> bool {
        self.poll(now, &mut Deliver)
    }

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

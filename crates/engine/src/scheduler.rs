//! The scheduler loop: continuous batching over one model and one pool, in
//! one of three roles.
//!
//! Each step it (1) takes commands — new requests, prefill orders, hand-off
//! frames — and drops cancelled requests, (2) admits waiting requests whose
//! whole reservation can be leased now (all or nothing, arrival order), (3)
//! builds one batch of every decoding request's next token plus prefill
//! chunks up to the step's token budget, (4) runs it and acts on the results.
//!
//! - **Colocated**: does both phases; a request's reservation is prompt plus
//!   `max_tokens`.
//! - **Decode**: reserves prompt plus `max_tokens`, grants the prompt's pages
//!   to the prefill worker through the hand-off [`Receiver`], and decodes only
//!   after the receiver commits (I2, I7). Until then the lease is the
//!   receiver's, not the batch's.
//! - **Prefill**: fills a grant. It leases the prompt only, prefills, samples
//!   the first token, ships the KV with [`send_kv`] and a `Done` built from
//!   its proof (I5), and answers `Reject` when it cannot.
//!
//! A request's lease lives inside its `Active` entry (or the receiver), so
//! finishing, failing or cancelling it is what returns its pages (I8).

use std::collections::VecDeque;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc;
use std::time::Instant;

use bytes::Bytes;
use kvfence_handoff::{
    ChunkFrames, Grant, HandoffId, Message, Outcome, Receiver, RejectReason, Streaming,
    WindowWrites,
};
use kvfence_model::{LoadedModel, Logits, Sampler, Sequence};
use kvfence_pool::mutation::Mutation;
use kvfence_pool::{Lease, Pool, PoolError, RequestId, Window, WindowKey};
use tokio::sync::mpsc as tokio_mpsc;
use tracing::{debug, trace, warn};

use crate::engine::{Counters, EngineConfig};
use crate::request::{Event, FailureKind, FinishReason, GenerationRequest, Usage};
use crate::text::TextStream;

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

pub(crate) enum Command {
    /// A client request (colocated, decode).
    Submit(Box<Pending>),
    /// A grant to fill, with the prompt it is for (prefill).
    Prefill(Box<PrefillOrder>),
    /// One hand-off frame from the peer worker (shared, so a chunk's
    /// payload is decoded as a view of it rather than copied).
    Frame(Bytes),
    /// The connection to the peer worker is gone.
    PeerLost,
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
        id: HandoffId,
        /// The transfer; taken when the last page ships.
        streaming: Option<Streaming>,
        aborted: bool,
        window: Option<(Window, WindowKey)>,
    },
}

/// A request waiting for pages.
pub(crate) struct Pending {
    pub(crate) id: RequestId,
    pub(crate) request: GenerationRequest,
    pub(crate) origin: Origin,
}

impl Pending {
    fn is_cancelled(&self) -> bool {
        match &self.origin {
            Origin::Client { events, cancelled } => {
                cancelled.load(Ordering::Acquire) || events.is_closed()
            }
            Origin::Handoff { aborted, .. } => *aborted,
        }
    }

    fn send(&self, event: Event) {
        if let Origin::Client { events, .. } = &self.origin {
            let _ = events.send(event);
        }
    }

    fn handoff_id(&self) -> HandoffId {
        HandoffId(self.id.0)
    }
}

/// A request holding pages.
struct Active {
    pending: Pending,
    /// `None` while a decode worker waits for the hand-off to commit.
    lease: Option<Lease>,
    sampler: Sampler,
    text: TextStream,
    /// Prompt tokens already in the KV cache.
    prefilled: usize,
    generated: Vec<u32>,
    /// When the decode worker granted this request's pages.
    granted_at: Instant,
}

impl Active {
    fn prefill_done(&self) -> bool {
        self.prefilled == self.pending.request.prompt.len()
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

/// Sends one hand-off message to the peer worker, if there is one.
fn frame_to(peer: &Option<mpsc::Sender<Command>>, message: &Message) {
    if let Some(peer) = peer {
        let _ = peer.send(Command::Frame(message.to_frame().into()));
    }
}

pub(crate) struct Scheduler {
    role: Role,
    model: Arc<LoadedModel>,
    pool: Pool,
    config: EngineConfig,
    counters: Arc<Counters>,
    inbox: mpsc::Receiver<Command>,
    /// The other worker of a disaggregated pair.
    peer: Option<mpsc::Sender<Command>>,
    receiver: Receiver,
    waiting: VecDeque<Pending>,
    active: Vec<Active>,
    stopping: bool,
    /// The peer worker is unreachable: no hand-off can complete.
    peer_lost: bool,
    /// Decode role: grant one-sided windows (shared memory) instead of
    /// taking chunks.
    one_sided: bool,
}

impl Scheduler {
    pub(crate) fn new(
        role: Role,
        model: Arc<LoadedModel>,
        pool: Pool,
        config: EngineConfig,
        counters: Arc<Counters>,
        inbox: mpsc::Receiver<Command>,
        peer: Option<mpsc::Sender<Command>>,
    ) -> Self {
        Scheduler {
            role,
            model,
            pool,
            config,
            counters,
            inbox,
            peer,
            receiver: Receiver::new(),
            waiting: VecDeque::new(),
            active: Vec::new(),
            stopping: false,
            peer_lost: false,
            one_sided: false,
        }
    }

    /// Decode role over a one-sided transport.
    pub(crate) fn with_one_sided_grants(mut self, one_sided: bool) -> Self {
        self.one_sided = one_sided;
        self
    }

    pub(crate) fn run(mut self) {
        while !self.stopping {
            self.receive();
            self.expire_handoffs();
            self.drop_cancelled();
            self.admit();
            if self.active.iter().any(|a| a.lease.is_some()) {
                self.step();
                // The step may have ended requests and freed their pages:
                // admit the queue now, before `receive` decides whether to
                // sleep. Otherwise a worker whose last request just ended
                // would sleep with requests queued and pages free, until
                // some unrelated message woke it.
                self.admit();
            }
        }
        self.fail_everything();
    }

    fn receive(&mut self) {
        let idle = !self.active.iter().any(|a| a.lease.is_some());
        if idle {
            // Nothing to compute: sleep until a command arrives, or until the
            // oldest hand-off in flight would time out.
            let deadline = self
                .active
                .iter()
                .map(|a| a.granted_at + self.config.handoff_timeout)
                .min();
            let received = match deadline {
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
    }

    fn handle(&mut self, command: Command) {
        match command {
            Command::Submit(pending) => self.waiting.push_back(*pending),
            Command::Prefill(order) => self.take_order(*order),
            Command::Frame(frame) => self.take_frame(&frame),
            Command::PeerLost => self.lose_peer(),
            Command::Shutdown => self.stopping = true,
        }
    }

    fn to_peer(&self, message: &Message) {
        frame_to(&self.peer, message);
    }

    /// Prefill role: queue a grant to fill, or reject it at once.
    fn take_order(&mut self, order: PrefillOrder) {
        let grant = match Message::decode(&order.grant) {
            Ok(Some((message, _))) => Grant::from_message(&message),
            _ => None,
        };
        let Some(grant) = grant else {
            warn!("malformed prefill order dropped");
            return;
        };
        // Fault injection: the prefill worker stalls on, or crashes at, a grant.
        fail::fail_point!("handoff-grant", crash_or_stall);
        let needed = order.request.prompt.len();
        let reject = if needed != grant.tokens {
            Some(RejectReason::Failed)
        } else if needed > self.pool.capacity_tokens() {
            // Defence in depth (I6): the router should never have sent it.
            Some(RejectReason::TooLong)
        } else {
            None
        };
        if let Some(reason) = reject {
            if reason == RejectReason::TooLong && Mutation::PlaceholderDone.active() {
                // Incident replay (a): claim a one-token placeholder was sent.
                self.to_peer(&Message::Done {
                    id: grant.id,
                    epoch: grant.epoch,
                    tokens: 1,
                    digest: 0,
                    first_token: 0,
                });
                return;
            }
            self.to_peer(&Message::Reject {
                id: grant.id,
                reason,
            });
            return;
        }
        let id = RequestId(grant.id.0);
        debug!(handoff = %grant.id, tokens = grant.tokens, "prefill order queued");
        self.counters.queued.fetch_add(1, Ordering::AcqRel);
        self.waiting.push_back(Pending {
            id,
            request: order.request,
            origin: Origin::Handoff {
                id: grant.id,
                streaming: Some(Streaming::new(grant)),
                aborted: false,
                window: order.window,
            },
        });
    }

    /// A hand-off frame from the peer.
    fn take_frame(&mut self, frame: &Bytes) {
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
                    self.abort_order(id);
                    // Fault injection: a writer that never acknowledges.
                    fail::fail_point!("prefill-no-abort-ack", |_| {});
                    // This worker writes only from its own thread, so no
                    // write of this hand-off is still in flight now.
                    self.to_peer(&Message::AbortAck { id, epoch });
                }
            }
            Role::Decode => self.receive_kv(message),
            Role::Colocated => {}
        }
    }

    fn abort_order(&mut self, id: HandoffId) {
        for pending in self
            .waiting
            .iter_mut()
            .chain(self.active.iter_mut().map(|a| &mut a.pending))
        {
            if let Origin::Handoff {
                id: handoff,
                aborted,
                ..
            } = &mut pending.origin
                && *handoff == id
            {
                *aborted = true;
            }
        }
    }

    /// Decode role: one message for the receiver.
    fn receive_kv(&mut self, message: Message) {
        if matches!(message, Message::Done { .. }) {
            // Fault injection: decode stalls on, or crashes at, a `Done`
            // before committing it.
            fail::fail_point!("handoff-before-commit", crash_or_stall);
        }
        let outcome = self.receiver.handle(message);
        self.counters.record_handoff(&self.receiver.stats());
        match outcome {
            Outcome::Accepted | Outcome::Ignored => {}
            Outcome::Released { id, pages } => {
                debug!(handoff = %id, pages, "quarantined pages released after the writer's ack")
            }
            Outcome::Committed(committed) => {
                debug!(handoff = %committed.id(), tokens = committed.tokens(), "hand-off committed");
                let Some(index) = self.position(RequestId(committed.id().0)) else {
                    return;
                };
                let first_token = committed.first_token();
                let active = &mut self.active[index];
                active.prefilled = committed.tokens();
                active.lease = Some(committed.into_lease());
                active.sampler.resume_after(1);
                self.counters
                    .prompt_tokens
                    .fetch_add(active.prefilled as u64, Ordering::Relaxed);
                if let Some(end) = self.accept(index, first_token) {
                    self.end(index, end);
                }
            }
            Outcome::Failed { id, error, reply } => {
                if let Some(reply) = reply {
                    self.to_peer(&reply);
                }
                let Some(index) = self.position(RequestId(id.0)) else {
                    return;
                };
                let kind = match error {
                    kvfence_handoff::HandoffError::Rejected {
                        reason: RejectReason::TooLong,
                        ..
                    } => FailureKind::TooLong,
                    kvfence_handoff::HandoffError::Rejected {
                        reason: RejectReason::Busy,
                        ..
                    } => FailureKind::Unavailable,
                    _ => FailureKind::Internal,
                };
                warn!(request = %RequestId(id.0), %error, "hand-off failed");
                self.end(index, End::Failed(kind, error.to_string()));
            }
        }
    }

    /// Decode role: a grant that has not committed in time is aborted — its
    /// pages freed, or quarantined behind a revoked window until the writer
    /// acknowledges (I4) — and its client gets an error, never a late answer.
    fn expire_handoffs(&mut self) {
        if self.role != Role::Decode {
            return;
        }
        let now = Instant::now();
        for index in (0..self.active.len()).rev() {
            let active = &self.active[index];
            if active.lease.is_none() && now >= active.granted_at + self.config.handoff_timeout {
                let id = active.pending.handoff_id();
                warn!(handoff = %id, "hand-off timed out; aborting the grant");
                if let Some(abort) = self.receiver.abort(id) {
                    self.to_peer(&abort);
                }
                if Mutation::ReleaseOnTimeout.active() {
                    // Incident replay (e): free the pages without the writer's ack.
                    let _ = self.pool.drain(active.pending.id);
                }
                let message = "the prefill worker did not deliver the KV in time".to_string();
                self.end(index, End::Failed(FailureKind::Unavailable, message));
            }
        }
    }

    fn position(&self, id: RequestId) -> Option<usize> {
        self.active.iter().position(|a| a.pending.id == id)
    }

    fn drop_cancelled(&mut self) {
        let before = self.waiting.len();
        self.waiting.retain(|p| !p.is_cancelled());
        let dropped_waiting = before - self.waiting.len();
        self.counters
            .queued
            .fetch_sub(dropped_waiting, Ordering::AcqRel);
        let mut dropped_active = 0;
        for index in (0..self.active.len()).rev() {
            if self.active[index].pending.is_cancelled() {
                let active = self.active.swap_remove(index);
                if active.lease.is_none()
                    && let Some(abort) = self.receiver.abort(active.pending.handoff_id())
                {
                    // The reservation is freed now; tell prefill to stop.
                    self.to_peer(&abort);
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

    /// Tokens of KV a request reserves on this worker.
    fn reservation(&self, request: &GenerationRequest) -> usize {
        match self.role {
            Role::Prefill => request.prompt.len(),
            Role::Colocated | Role::Decode => request.kv_tokens(),
        }
    }

    /// The other worker is gone: every hand-off in flight fails now (its
    /// reservation freed), and new work is refused until a restart.
    fn lose_peer(&mut self) {
        if self.peer_lost || self.role == Role::Colocated {
            return;
        }
        self.peer_lost = true;
        warn!(
            role = self.role.label(),
            "the peer worker is unreachable; failing in-flight hand-offs"
        );
        match self.role {
            Role::Decode => {
                for index in (0..self.active.len()).rev() {
                    if self.active[index].lease.is_none() {
                        self.receiver.abort(self.active[index].pending.handoff_id());
                        self.end(
                            index,
                            End::Failed(
                                FailureKind::Unavailable,
                                "the prefill worker is unreachable".into(),
                            ),
                        );
                    }
                }
            }
            Role::Prefill | Role::Colocated => {
                // A prefill worker serves one decode worker; without it there
                // is nothing left to do here.
                self.stopping = true;
                for pending in self
                    .waiting
                    .iter_mut()
                    .chain(self.active.iter_mut().map(|a| &mut a.pending))
                {
                    if let Origin::Handoff { aborted, .. } = &mut pending.origin {
                        *aborted = true;
                    }
                }
            }
        }
    }

    fn admit(&mut self) {
        if self.peer_lost && self.role == Role::Decode {
            for pending in std::mem::take(&mut self.waiting) {
                self.counters.queued.fetch_sub(1, Ordering::AcqRel);
                self.refuse(
                    &pending,
                    FailureKind::Unavailable,
                    "the prefill worker is unreachable".into(),
                );
            }
            return;
        }
        while self.active.len() < self.config.max_running {
            let Some(pending) = self.waiting.front() else {
                break;
            };
            let lease = match self
                .pool
                .lease(pending.id, self.reservation(&pending.request))
            {
                Ok(lease) => lease,
                // Pages will come back as running requests end; keep order.
                Err(PoolError::Exhausted { .. }) => break,
                Err(error) => {
                    let pending = self.waiting.pop_front().expect("front exists");
                    self.counters.queued.fetch_sub(1, Ordering::AcqRel);
                    self.refuse(&pending, FailureKind::TooLong, error.to_string());
                    continue;
                }
            };
            let pending = self.waiting.pop_front().expect("front exists");
            self.counters.queued.fetch_sub(1, Ordering::AcqRel);
            let sampler = match Sampler::new(pending.request.sampling) {
                Ok(sampler) => sampler,
                Err(error) => {
                    self.refuse(&pending, FailureKind::Internal, error.to_string());
                    continue;
                }
            };
            let lease = if self.role == Role::Decode {
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
                        self.send_order(grant, &pending.request, window);
                        None
                    }
                    Err(error) => {
                        self.refuse(&pending, FailureKind::Internal, error.to_string());
                        continue;
                    }
                }
            } else {
                Some(lease)
            };
            let text = TextStream::new(pending.request.stop.clone());
            self.counters.running.fetch_add(1, Ordering::AcqRel);
            self.active.push(Active {
                pending,
                lease,
                sampler,
                text,
                prefilled: 0,
                generated: Vec::new(),
                granted_at: Instant::now(),
            });
        }
    }

    fn send_order(
        &self,
        grant: Message,
        request: &GenerationRequest,
        window: Option<(Window, WindowKey)>,
    ) {
        if let Some(peer) = &self.peer {
            let order = PrefillOrder {
                grant: grant.to_frame(),
                request: request.clone(),
                window,
            };
            let _ = peer.send(Command::Prefill(Box::new(order)));
        }
    }

    /// Decode tokens first (one per decoding request), then prefill chunks in
    /// admission order with what is left of the budget. Prefill always gets
    /// some room so a full decode batch cannot starve new requests.
    fn plan(&self) -> Vec<Work> {
        let mut work = Vec::new();
        for (index, a) in self.active.iter().enumerate() {
            if a.lease.is_some() && a.prefill_done() {
                let last = *a
                    .generated
                    .last()
                    .expect("a decoding request has sampled a token");
                let past = a.prefilled + a.generated.len() - 1;
                work.push(Work {
                    index,
                    past,
                    tokens: vec![last],
                    logits: Logits::Last,
                });
            }
        }
        let mut budget = self.config.step_tokens.saturating_sub(work.len()).max(16);
        for (index, a) in self.active.iter().enumerate() {
            if a.lease.is_none() || a.prefill_done() || budget == 0 {
                continue;
            }
            let prompt = &a.pending.request.prompt;
            let take = (prompt.len() - a.prefilled).min(budget);
            budget -= take;
            let end = a.prefilled + take;
            let logits = if end == prompt.len() {
                Logits::Last
            } else {
                Logits::None
            };
            work.push(Work {
                index,
                past: a.prefilled,
                tokens: prompt[a.prefilled..end].to_vec(),
                logits,
            });
        }
        work
    }

    fn step(&mut self) {
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
                self.active.iter_mut().map(|a| a.lease.as_mut()).collect();
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
            if !active.prefill_done() {
                active.prefilled += w.tokens.len();
                self.counters
                    .prompt_tokens
                    .fetch_add(w.tokens.len() as u64, Ordering::Relaxed);
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

    /// Removes request `index`, dropping its lease (I8), and tells whoever waits.
    fn end(&mut self, index: usize, end: End) {
        let active = self.active.swap_remove(index);
        self.counters.running.fetch_sub(1, Ordering::AcqRel);
        match end {
            End::Finished(event) => {
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
            Origin::Handoff { id, .. } => {
                let reason = if kind == FailureKind::TooLong {
                    RejectReason::TooLong
                } else {
                    RejectReason::Failed
                };
                self.to_peer(&Message::Reject { id: *id, reason });
            }
        }
    }

    /// Samples the next token of one request and acts on it.
    fn advance(&mut self, index: usize, logits: &[f32]) -> Option<End> {
        let token = match self.active[index].sampler.sample(logits) {
            Ok(token) => token,
            Err(error) => return Some(End::Failed(FailureKind::Internal, error.to_string())),
        };
        if matches!(self.active[index].pending.origin, Origin::Handoff { .. }) {
            return Some(self.ship(index, token));
        }
        self.accept(index, token)
    }

    /// Prefill role: send the prompt's KV and the first token to decode.
    fn ship(&mut self, index: usize, first_token: u32) -> End {
        // Fault injection: a writer that goes silent instead of shipping.
        fail::fail_point!("prefill-stall", |_| End::Shipped);
        let active = &mut self.active[index];
        let lease = active
            .lease
            .as_ref()
            .expect("a prefilled request holds its lease");
        let Origin::Handoff {
            streaming, window, ..
        } = &mut active.pending.origin
        else {
            unreachable!("ship is called for hand-off requests only");
        };
        let streaming = streaming.take().expect("a hand-off ships once");
        let grant = streaming.grant().clone();
        let peer = self.peer.clone();
        let sent = match window {
            Some((window, key)) => streaming.finish(lease, &mut WindowWrites::new(window, *key)),
            None => streaming.finish(
                lease,
                &mut ChunkFrames::new(&grant, |chunk| send_chunk(&peer, chunk)),
            ),
        };
        match sent {
            Ok(proof) => {
                frame_to(&peer, &proof.done(first_token));
                End::Shipped
            }
            Err(error) => End::Failed(FailureKind::Internal, error.to_string()),
        }
    }

    /// Prefill role: ships the pages the last step completed, so the
    /// transfer overlaps the rest of the prefill.
    fn ship_ready_pages(&mut self, index: usize) -> Result<(), kvfence_handoff::HandoffError> {
        let peer = self.peer.clone();
        let active = &mut self.active[index];
        let (
            Some(lease),
            Origin::Handoff {
                streaming: Some(streaming),
                window,
                ..
            },
        ) = (&active.lease, &mut active.pending.origin)
        else {
            return Ok(());
        };
        match window {
            Some((window, key)) => streaming.send_ready(
                lease,
                active.prefilled,
                &mut WindowWrites::new(window, *key),
            ),
            None => {
                let grant = streaming.grant().clone();
                streaming.send_ready(
                    lease,
                    active.prefilled,
                    &mut ChunkFrames::new(&grant, |chunk| send_chunk(&peer, chunk)),
                )
            }
        }
    }

    /// Records a generated token, streams its text, and says whether the
    /// request is done.
    fn accept(&mut self, index: usize, token: u32) -> Option<End> {
        let eos = &self.model.model.config().eos_token_ids;
        let tokenizer = &self.model.tokenizer;
        let active = &mut self.active[index];
        active.generated.push(token);
        self.counters
            .generated_tokens
            .fetch_add(1, Ordering::Relaxed);
        let request = &active.pending.request;
        let usage = Usage {
            prompt_tokens: request.prompt.len(),
            completion_tokens: active.generated.len(),
        };
        let finish = |reason| Some(End::Finished(Event::Finished { reason, usage }));
        let flush = |active: &mut Active| match active.text.flush(tokenizer) {
            Ok(rest) => {
                if !rest.is_empty() {
                    active.pending.send(Event::Token { text: rest });
                }
                None
            }
            Err(error) => Some(End::Failed(FailureKind::Internal, error.to_string())),
        };
        if !request.ignore_eos && eos.contains(&token) {
            active.pending.send(Event::Token {
                text: String::new(),
            });
            return flush(active).or_else(|| finish(FinishReason::Stop));
        }
        let pushed = match active.text.push(tokenizer, token) {
            Ok(pushed) => pushed,
            Err(error) => return Some(End::Failed(FailureKind::Internal, error.to_string())),
        };
        active.pending.send(Event::Token { text: pushed.delta });
        if pushed.stopped {
            return finish(FinishReason::Stop);
        }
        if active.generated.len() == active.pending.request.max_tokens {
            return flush(active).or_else(|| finish(FinishReason::Length));
        }
        None
    }

    fn fail_everything(&mut self) {
        let reason = || {
            (
                FailureKind::ShuttingDown,
                "the server is shutting down".to_string(),
            )
        };
        for pending in std::mem::take(&mut self.waiting) {
            self.counters.queued.fetch_sub(1, Ordering::AcqRel);
            let (kind, message) = reason();
            self.refuse(&pending, kind, message);
        }
        for active in std::mem::take(&mut self.active) {
            self.counters.running.fetch_sub(1, Ordering::AcqRel);
            let (kind, message) = reason();
            self.refuse(&active.pending, kind, message);
        }
        // Commands that raced the shutdown.
        while let Ok(command) = self.inbox.try_recv() {
            if let Command::Submit(pending) = command {
                self.counters.queued.fetch_sub(1, Ordering::AcqRel);
                let (kind, message) = reason();
                self.refuse(&pending, kind, message);
            }
        }
    }
}

/// Sends one KV chunk's frame to the decode worker.
fn send_chunk(peer: &Option<mpsc::Sender<Command>>, chunk: Vec<u8>) {
    // Fault injection between chunks: a delay, a lost chunk (`stall`), or a
    // crash partway through a transfer.
    fail::fail_point!("handoff-mid-chunk", crash_or_stall);
    if let Some(peer) = peer {
        let _ = peer.send(Command::Frame(chunk.into()));
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

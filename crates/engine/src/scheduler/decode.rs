//! The decode role: granting a request's pages to a prefill worker,
//! taking the hand-off only from the link the grant went to, committing it
//! through the receiver (I2, I7), aborting grants past their deadline, and
//! moving or failing what a lost link was filling.

use std::sync::atomic::Ordering;
use std::time::Instant;

use kvfence_handoff::{Message, Outcome, PromptScore, RejectReason};
use kvfence_model::{PromptLogprob, TokenLogprobs};
use kvfence_pool::mutation::Mutation;
use kvfence_pool::{RequestId, Window, WindowKey};
use tracing::{debug, trace, warn};

#[cfg(feature = "failpoints")]
use super::crash_or_stall;
use super::{End, FailureKind, Kv, Peer, PeerId, Pending, PrefillOrder, Role, Scheduler, ToPeer};
use crate::request::{Event, GenerationRequest};

impl Scheduler {
    /// Decode role: one message from the prefill worker on link `peer`.
    pub(super) fn receive_kv(&mut self, peer: PeerId, message: Message) {
        // A grant is filled by the prefill worker it was sent to; another
        // link's messages for it (a confused or hostile peer) are dropped
        // before the receiver sees them.
        if let Some(active) = self
            .position(RequestId(message.id().0))
            .map(|index| &self.active[index])
            && active.kv.awaited_from().is_some_and(|from| from != peer)
        {
            warn!(%peer, handoff = %message.id(), "hand-off message from a link the grant was not sent to, dropped");
            self.counters
                .handoff_misrouted
                .fetch_add(1, Ordering::Relaxed);
            self.counters.record_handoff(&self.receiver.stats());
            return;
        }
        if matches!(message, Message::Done { .. }) {
            // Fault injection: decode stalls on, or crashes at, a `Done`
            // before committing it.
            fail::fail_point!("handoff-before-commit", crash_or_stall);
        }
        let id = RequestId(message.id().0);
        if let Message::Progress { computed, .. } = &message {
            trace!(handoff = %message.id(), computed, "prefill progress");
        }
        let outcome = self.receiver.handle(message);
        self.counters.record_handoff(&self.receiver.stats());
        match outcome {
            Outcome::Accepted => {
                // A chunk or a progress report from the grant's own link:
                // the prefill worker is at work on it.
                if let Some(index) = self.position(id)
                    && let Kv::Awaited(awaiting) = &mut self.active[index].kv
                {
                    awaiting.news = true;
                }
            }
            Outcome::Ignored => {}
            Outcome::Released { id, pages } => {
                debug!(handoff = %id, pages, "quarantined pages released after the writer's ack")
            }
            Outcome::Committed(mut committed) => {
                debug!(handoff = %committed.id(), tokens = committed.tokens(), "hand-off committed");
                let Some(index) = self.position(RequestId(committed.id().0)) else {
                    return;
                };
                let scores = committed.take_prompt_logprobs();
                if let Err(end) = self.hand_on_prompt_scores(index, scores) {
                    self.end(index, end);
                    return;
                }
                let first_token = committed.first_token();
                let logprobs =
                    committed
                        .first_logprobs()
                        .split_first()
                        .map(|(&(token, logprob), top)| TokenLogprobs {
                            token,
                            logprob,
                            top: top.to_vec(),
                        });
                let active = &mut self.active[index];
                active.pending.timeline.kv_ready();
                active.written = committed.tokens();
                active.cached = committed.cached_tokens();
                let mut lease = committed.into_lease();
                // Verified KV of the tenant's prompt: its full pages serve
                // the tenant's next hand-offs here without crossing the link.
                lease.seal(&active.pending.request.prompt);
                active.kv = Kv::Held(lease);
                active.sampler.resume_after(1);
                self.counters
                    .prompt_tokens
                    .fetch_add(active.written as u64, Ordering::Relaxed);
                if let Some(end) = self.accept(index, first_token, logprobs) {
                    self.end(index, end);
                }
            }
            Outcome::Failed { id, error, reply } => {
                if let Some(reply) = reply {
                    self.send_to_peer(peer, &reply);
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

    /// Decode role: tells the client the prompt's scores a committed
    /// hand-off carried, if the request asked for them — after checking
    /// that each scores the prompt's own token (the receiver checked their
    /// count and shape, but never sees the prompt).
    fn hand_on_prompt_scores(&mut self, index: usize, scores: Vec<PromptScore>) -> Result<(), End> {
        let pending = &mut self.active[index].pending;
        if pending.request.sampling.prompt_logprobs.is_none() {
            debug_assert!(scores.is_empty(), "the receiver refuses unasked scores");
            return Ok(());
        }
        let prompt = &pending.request.prompt;
        let mut logprobs = Vec::with_capacity(scores.len());
        for (score, &token) in scores.into_iter().zip(&prompt[1..]) {
            let mut entries = score.logprobs.into_iter();
            match entries.next() {
                Some((scored, logprob)) if scored == token => logprobs.push(PromptLogprob {
                    logprobs: TokenLogprobs {
                        token,
                        logprob,
                        top: entries.collect(),
                    },
                    rank: score.rank,
                }),
                _ => {
                    return Err(End::Failed(
                        FailureKind::Internal,
                        "the prefill worker scored tokens that are not the prompt's".into(),
                    ));
                }
            }
        }
        pending.prompt_scores.take();
        pending.tell(&mut self.outbox, Event::Prompt { logprobs });
        Ok(())
    }

    /// Decode role: a grant whose prefill worker has gone silent for the
    /// silence deadline, or that has not committed within its whole-life
    /// deadline (which scales with the prompt), is aborted — its pages
    /// freed, or quarantined behind a revoked window until the writer
    /// acknowledges (I4) — and its client gets an error, never a late
    /// answer. A prefill worker that keeps sending chunks or progress
    /// reports is alive, however long the prompt takes.
    pub(super) fn expire_handoffs(&mut self, now: Instant) {
        if self.role != Role::Decode {
            return;
        }
        for index in (0..self.active.len()).rev() {
            let prompt = self.active[index].pending.request.prompt.len();
            let (id, owner) = (
                self.active[index].pending.handoff_id(),
                self.active[index].pending.id,
            );
            let Kv::Awaited(awaiting) = &mut self.active[index].kv else {
                continue;
            };
            if awaiting.news {
                awaiting.heard_at = awaiting.heard_at.max(now);
                awaiting.news = false;
            }
            if now < awaiting.deadline(&self.config, prompt) {
                continue;
            }
            let prefill = awaiting.prefill;
            let silent = now >= awaiting.heard_at + self.config.handoff_timeout;
            warn!(handoff = %id, silent, "hand-off past its deadline; aborting the grant");
            if let Some(abort) = self.receiver.abort(id) {
                self.send_to_peer(prefill, &abort);
            }
            if Mutation::ReleaseOnTimeout.active() {
                // Incident replay (e): free the pages without the writer's ack.
                let _ = self.pool.drain(owner);
            }
            let message = if silent {
                "the prefill worker went silent before delivering the KV"
            } else {
                "the prefill worker did not deliver the KV within the prompt's deadline"
            };
            self.end(
                index,
                End::Failed(FailureKind::Unavailable, message.to_string()),
            );
        }
    }

    /// Decode role: the prefill worker for `pending` — the one the router
    /// chose if its link is up and its pool holds the prompt, else the
    /// linked one with the fewest grants outstanding among those whose pool
    /// holds it (I6 per pair). If none holds it, the largest gets it anyway
    /// and must refuse it itself: a prefill worker never trusts a decode
    /// worker's idea of its capacity (I5, the incident). `Err` only when no
    /// prefill worker is linked.
    pub(super) fn choose_prefill(
        &self,
        pending: &Pending,
    ) -> Result<PeerId, (FailureKind, String)> {
        let prompt = pending.request.prompt.len();
        let fits = |p: &Peer| p.tokens >= prompt && !p.draining;
        if let Some(name) = &pending.prefill
            && let Some((&id, _)) = self.peers.iter().find(|(_, p)| &p.name == name && fits(p))
        {
            return Ok(id);
        }
        let outstanding = |id: PeerId| {
            self.active
                .iter()
                .filter(|a| a.kv.awaited_from() == Some(id))
                .count()
        };
        self.peers
            .iter()
            .filter(|(_, p)| fits(p))
            .min_by_key(|(id, _)| outstanding(**id))
            .or_else(|| self.peers.iter().max_by_key(|(_, p)| p.tokens))
            .map(|(&id, _)| id)
            .ok_or_else(|| {
                (
                    FailureKind::Unavailable,
                    "no prefill worker is reachable".into(),
                )
            })
    }

    pub(super) fn send_order(
        &mut self,
        peer: PeerId,
        grant: Message,
        pending: &Pending,
        window: Option<(Window, WindowKey)>,
    ) {
        if let Some(p) = self.peers.get(&peer) {
            let request = GenerationRequest {
                // The prefill worker's spans hang under this worker's.
                trace: pending.timeline.context_for_peer(pending.request.trace),
                ..pending.request.clone()
            };
            let order = PrefillOrder {
                grant: grant.to_frame(),
                request,
                window,
            };
            self.outbox.peer(&p.tx, ToPeer::Order(Box::new(order)));
        }
    }

    /// The link `peer` is gone: what it was filling moves or fails.
    pub(super) fn move_handoffs_of(&mut self, peer: PeerId) {
        // Hand-offs the link was filling: the grant is revoked (its
        // pages freed; late frames cannot come from a closed link).
        // Nothing was sent to the client yet, and prefill is
        // deterministic, so the request goes back to the front of
        // the queue once, to be granted to another prefill worker
        // and give the same answer; on a second loss it fails.
        let mut requeue = Vec::new();
        for index in (0..self.active.len()).rev() {
            let active = &self.active[index];
            if active.kv.awaited_from() == Some(peer) {
                self.receiver.abort(active.pending.handoff_id());
                if active.pending.moved || self.peers.is_empty() {
                    self.end(
                        index,
                        End::Failed(
                            FailureKind::Unavailable,
                            "the prefill worker is unreachable".into(),
                        ),
                    );
                } else {
                    let mut pending = self.active.swap_remove(index).pending;
                    self.counters.running.fetch_sub(1, Ordering::AcqRel);
                    pending.moved = true;
                    pending.prefill = None;
                    requeue.push(pending);
                }
            }
        }
        // Oldest first at the front, as they were admitted.
        requeue.sort_unstable_by_key(|p| p.id);
        for pending in requeue.into_iter().rev() {
            self.counters.queued.fetch_add(1, Ordering::AcqRel);
            self.waiting.push_front(pending);
        }
    }
}

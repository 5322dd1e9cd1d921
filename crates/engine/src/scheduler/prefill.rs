//! The prefill role: taking a decode worker's orders, each under the link
//! it came on, and shipping their KV back on that link as the prefill
//! fills pages, then `Done` from the sender's proof (I5).

use std::sync::atomic::Ordering;
use std::time::Instant;

use bytes::Bytes;
use kvfence_handoff::{
    ChunkFrames, Grant, HandoffId, Message, PromptScore, RejectReason, Streaming, WindowWrites,
};
use kvfence_pool::RequestId;
use kvfence_pool::mutation::Mutation;
use tracing::{debug, warn};

#[cfg(feature = "failpoints")]
use super::crash_or_stall;
use super::{
    End, FailureKind, Origin, Outbox, PeerId, PeerTx, Pending, PrefillOrder, PromptScores, Role,
    Scheduler, ToPeer,
};
use crate::trace::{Outcome, Timeline};

impl Scheduler {
    /// Prefill role: queue a grant to fill, or reject it at once.
    pub(super) fn take_order(&mut self, peer: PeerId, order: PrefillOrder) {
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
        // Recorded however the order leaves, a rejection at once included.
        let mut timeline = Timeline::start(order.request.trace);
        timeline.taken_by(Role::Prefill);
        let needed = order.request.prompt.len();
        let reject = if needed != grant.tokens {
            Some(RejectReason::Failed)
        } else if needed > self.pool.capacity_tokens() {
            // Defence in depth (I6): the router should never have sent it.
            Some(RejectReason::TooLong)
        } else if self.orders_from(peer) >= self.config.max_queue + self.config.max_running {
            // One decode worker cannot make this one hold more orders than
            // it could queue and run itself; the decode worker reports the
            // request as unavailable, and another prefill worker may do.
            Some(RejectReason::Busy)
        } else {
            None
        };
        if let Some(reason) = reject {
            timeline.ends(
                Outcome::Failed(match reason {
                    RejectReason::TooLong => FailureKind::TooLong,
                    RejectReason::Busy => FailureKind::Unavailable,
                    RejectReason::Failed | RejectReason::Aborted => FailureKind::Internal,
                }),
                None,
            );
            if reason == RejectReason::TooLong && Mutation::PlaceholderDone.active() {
                // Incident replay (a): claim a one-token placeholder was sent.
                self.send_to_peer(
                    peer,
                    &Message::Done {
                        id: grant.id,
                        epoch: grant.epoch,
                        tokens: 1,
                        digest: 0,
                        first_token: 0,
                        cached: 0,
                        first_logprobs: Vec::new(),
                        prompt_logprobs: Vec::new(),
                    },
                );
                return;
            }
            self.send_to_peer(
                peer,
                &Message::Reject {
                    id: grant.id,
                    reason,
                },
            );
            return;
        }
        if Mutation::SharedHandoffIds.active() {
            // Incident replay (g): routes kept by hand-off id alone, as if
            // ids were unique across decode workers: a newer order with the
            // same id takes over the older one's route.
            for pending in self.orders_mut() {
                if let Origin::Handoff {
                    peer: route, id, ..
                } = &mut pending.origin
                    && *id == grant.id
                {
                    *route = peer;
                }
            }
        }
        let id = RequestId(self.next_local_id);
        self.next_local_id += 1;
        debug!(%peer, handoff = %grant.id, tokens = grant.tokens, "prefill order queued");
        self.counters.queued.fetch_add(1, Ordering::AcqRel);
        let scores = order.request.sampling.prompt_logprobs;
        self.enqueue(Pending {
            id,
            request: order.request,
            origin: Origin::Handoff {
                peer,
                id: grant.id,
                streaming: Some(Streaming::new(grant)),
                aborted: false,
                reported_at: None,
                window: order.window,
            },
            prefill: None,
            moved: false,
            resume: None,
            prompt_scores: PromptScores::start(scores),
            waiting_since: None,
            timeline,
        });
    }

    /// Prefill role: orders from link `peer` waiting or running.
    pub(super) fn orders_from(&self, peer: PeerId) -> usize {
        self.waiting
            .iter()
            .chain(self.active.iter().map(|a| &a.pending))
            .filter(|p| matches!(p.origin, Origin::Handoff { peer: route, .. } if route == peer))
            .count()
    }

    /// Every request waiting or running.
    pub(super) fn orders_mut(&mut self) -> impl Iterator<Item = &mut Pending> {
        self.waiting
            .iter_mut()
            .chain(self.active.iter_mut().map(|a| &mut a.pending))
    }

    /// Prefill role: drops the order `id` that came on link `peer`.
    pub(super) fn abort_order(&mut self, peer: PeerId, id: HandoffId) {
        for pending in self.orders_mut() {
            if let Origin::Handoff {
                peer: route,
                id: handoff,
                aborted,
                ..
            } = &mut pending.origin
                && *handoff == id
                && *route == peer
            {
                *aborted = true;
            }
        }
    }

    /// Prefill role: send the prompt's KV and the first token to decode.
    pub(super) fn ship(
        &mut self,
        index: usize,
        first_token: u32,
        logprobs: Option<kvfence_model::TokenLogprobs>,
    ) -> End {
        // Fault injection: a writer that goes silent instead of shipping.
        fail::fail_point!("prefill-stall", |_| End::Shipped);
        let active = &mut self.active[index];
        let cached = active.cached;
        let prompt_logprobs = active
            .pending
            .prompt_scores
            .take()
            .into_iter()
            .map(|score| PromptScore {
                rank: score.rank,
                logprobs: std::iter::once((score.logprobs.token, score.logprobs.logprob))
                    .chain(score.logprobs.top)
                    .collect(),
            })
            .collect();
        let lease = active
            .kv
            .lease()
            .expect("a prefilled request holds its lease");
        let Origin::Handoff {
            peer,
            streaming,
            window,
            ..
        } = &mut active.pending.origin
        else {
            unreachable!("ship is called for hand-off requests only");
        };
        let streaming = streaming.take().expect("a hand-off ships once");
        let grant = streaming.grant().clone();
        let Some(peer) = self.peers.get(peer).map(|p| &p.tx) else {
            // The decode worker left; nobody is waiting for this KV.
            return End::Shipped;
        };
        let (outbox, frames) = (&mut self.outbox, &self.frames);
        let sent = match window {
            Some((window, key)) => streaming.finish(lease, &mut WindowWrites::new(window, *key)),
            None => streaming.finish(
                lease,
                &mut ChunkFrames::new(&grant, frames, |chunk| send_chunk(outbox, peer, chunk)),
            ),
        };
        match sent {
            Ok(proof) => {
                let first_logprobs = logprobs
                    .map(|l| std::iter::once((l.token, l.logprob)).chain(l.top).collect())
                    .unwrap_or_default();
                outbox.message(
                    peer,
                    &proof.done_with_logprobs(first_token, cached, first_logprobs, prompt_logprobs),
                );
                End::Shipped
            }
            Err(error) => End::Failed(FailureKind::Internal, error.to_string()),
        }
    }

    /// Prefill role: ships the pages the last step completed, so the
    /// transfer overlaps the rest of the prefill.
    pub(super) fn ship_ready_pages(
        &mut self,
        index: usize,
    ) -> Result<(), kvfence_handoff::HandoffError> {
        let active = &mut self.active[index];
        let (
            Some(lease),
            Origin::Handoff {
                peer,
                streaming: Some(streaming),
                window,
                ..
            },
        ) = (active.kv.lease(), &mut active.pending.origin)
        else {
            return Ok(());
        };
        let Some(peer) = self.peers.get(peer).map(|p| &p.tx) else {
            return Ok(());
        };
        let (outbox, frames) = (&mut self.outbox, &self.frames);
        match window {
            Some((window, key)) => {
                streaming.send_ready(lease, active.written, &mut WindowWrites::new(window, *key))
            }
            None => {
                let grant = streaming.grant().clone();
                streaming.send_ready(
                    lease,
                    active.written,
                    &mut ChunkFrames::new(&grant, frames, |chunk| send_chunk(outbox, peer, chunk)),
                )
            }
        }
    }

    /// Prefill role: tells each order's decode worker, at least every
    /// [`EngineConfig::progress_interval`], that the order is still held —
    /// queued, or this many prompt tokens computed — so its silence
    /// deadline measures this worker's life, not the prompt's length.
    ///
    /// [`EngineConfig::progress_interval`]: crate::config::EngineConfig::progress_interval
    pub(super) fn report_progress(&mut self, now: Instant) {
        if self.role != Role::Prefill {
            return;
        }
        let interval = self.config.progress_interval();
        let mut reports = Vec::new();
        let queued = self.waiting.iter_mut().map(|pending| (pending, 0));
        let running = self.active.iter_mut().map(|a| (&mut a.pending, a.written));
        for (pending, computed) in queued.chain(running) {
            if let Origin::Handoff {
                peer,
                streaming: Some(streaming),
                aborted: false,
                reported_at,
                ..
            } = &mut pending.origin
                && reported_at.is_none_or(|at| now >= at + interval)
            {
                *reported_at = Some(now);
                reports.push((*peer, streaming.progress(computed)));
            }
        }
        for (peer, report) in reports {
            self.send_to_peer(peer, &report);
        }
    }

    /// Prefill role: when the next progress report falls due (orders never
    /// reported are due at the next poll, which follows their arrival).
    pub(super) fn next_progress_report(&self) -> Option<Instant> {
        if self.role != Role::Prefill {
            return None;
        }
        let interval = self.config.progress_interval();
        self.waiting
            .iter()
            .chain(self.active.iter().map(|a| &a.pending))
            .filter_map(|pending| match &pending.origin {
                Origin::Handoff {
                    streaming: Some(_),
                    aborted: false,
                    reported_at: Some(at),
                    ..
                } => Some(*at + interval),
                _ => None,
            })
            .min()
    }

    /// The link `peer` is gone: its orders are dropped at the next step.
    pub(super) fn drop_orders_of(&mut self, peer: PeerId) {
        for pending in self.orders_mut() {
            if let Origin::Handoff {
                peer: route,
                aborted,
                ..
            } = &mut pending.origin
                && *route == peer
            {
                *aborted = true;
            }
        }
    }
}

/// Sends one KV chunk's frame to the decode worker.
fn send_chunk(outbox: &mut Outbox, peer: &PeerTx, chunk: Bytes) {
    outbox.peer(peer, ToPeer::Chunk(chunk));
}

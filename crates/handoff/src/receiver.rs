//! The decode side: reserve, grant, validate every incoming write, commit
//! only on full coverage.
//!
//! [`Receiver`] is a pure state machine: it takes messages and returns
//! [`Outcome`]s; it never touches sockets, clocks or threads. A [`Committed`]
//! hand-off — the only way to get the lease back for decoding — exists only
//! after `Done` matched the grant's token count, every granted page arrived
//! intact, coverage spans every granted slot of every layer group in the
//! lease's current generation, and the digest matched (I2, I3, I7).
//!
//! Two-sided grants (in-process, TCP) see every byte in a `Chunk`, so a
//! failed or aborted grant frees its pages at once. One-sided grants
//! (shared memory) hand the writer a [`Window`] into the pages; a failed or
//! aborted grant revokes it and leaves the pages quarantined until the writer
//! acknowledges (`AbortAck`, or `Reject`) and the window has drained (I4).

use std::collections::HashMap;

use kvfence_pool::{Lease, Window};

use crate::error::HandoffError;
use crate::id::{Epoch, HandoffId, RejectReason};
use crate::sender::{chunk_checksum, digest};
use crate::wire::{GrantedGroup, MAX_FIRST_LOGPROBS, Message, PromptScore};

/// A hand-off whose KV is complete and verified. The lease now holds the
/// prompt's KV; decoding may start at position `tokens`.
#[derive(Debug)]
pub struct Committed {
    id: HandoffId,
    lease: Lease,
    tokens: usize,
    first_token: u32,
    cached: usize,
    first_logprobs: Vec<(u32, f32)>,
    prompt_logprobs: Vec<PromptScore>,
}

impl Committed {
    /// Prompt tokens the sender read from its prefix cache (for usage).
    pub fn cached_tokens(&self) -> usize {
        self.cached
    }

    /// Hand-off.
    pub fn id(&self) -> HandoffId {
        self.id
    }

    /// Prompt tokens now in the lease.
    pub fn tokens(&self) -> usize {
        self.tokens
    }

    /// The first generated token.
    pub fn first_token(&self) -> u32 {
        self.first_token
    }

    /// The first token's log-probability and its alternatives', if the
    /// request asked (its entry first); empty otherwise.
    pub fn first_logprobs(&self) -> &[(u32, f32)] {
        &self.first_logprobs
    }

    /// The score of every prompt token after the first, if the grant asked
    /// for them ([`Receiver::expect_prompt_logprobs`]); empty otherwise.
    pub fn take_prompt_logprobs(&mut self) -> Vec<PromptScore> {
        std::mem::take(&mut self.prompt_logprobs)
    }

    /// The lease, for decoding.
    pub fn into_lease(self) -> Lease {
        self.lease
    }
}

/// What handling one message led to.
#[derive(Debug)]
pub enum Outcome {
    /// Accepted — a chunk, or the sender's word that it is still at
    /// work — and the hand-off goes on: the sender is alive.
    Accepted,
    /// Not for a live hand-off or epoch (late, duplicate, after abort):
    /// dropped and counted, harmlessly.
    Ignored,
    /// The hand-off completed and verified.
    Committed(Committed),
    /// The hand-off failed; its reservation was freed (two-sided) or
    /// quarantined until the writer acknowledges (one-sided). Tell the client
    /// an error, and the sender `reply` if present.
    Failed {
        /// Hand-off.
        id: HandoffId,
        /// Why.
        error: HandoffError,
        /// A message for the sender, if one is due.
        reply: Option<Message>,
    },
    /// A one-sided writer acknowledged and its window drained: the
    /// quarantined pages of an earlier failure or abort are free again.
    Released {
        /// Hand-off.
        id: HandoffId,
        /// Pages freed.
        pages: usize,
    },
}

/// Counters of hand-off traffic.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct ReceiverStats {
    /// Hand-offs committed.
    pub committed: u64,
    /// Hand-offs failed.
    pub failed: u64,
    /// Messages for unknown hand-offs or revoked epochs.
    pub stale_messages: u64,
    /// Chunks whose bytes failed their checksum.
    pub checksum_failures: u64,
    /// KV bytes accepted.
    pub bytes: u64,
}

struct Incoming {
    epoch: Epoch,
    lease: Lease,
    tokens: usize,
    page_size: usize,
    /// Each layer group's share of the grant.
    groups: Vec<IncomingGroup>,
    /// The writer's window (one-sided).
    window: Option<Window>,
    /// Alternatives per prompt score `Done` must carry, if the request
    /// asked for the prompt's log-probabilities.
    prompt_logprobs: Option<usize>,
}

/// One layer group's granted pages as the receiver tracks them.
struct IncomingGroup {
    /// The number of the first granted page (counted from position 0).
    first_page: usize,
    /// Leading granted pages the lease already holds (shared prefix-cache
    /// pages): no chunk may name them, and the digest leaves them out.
    present: usize,
    /// Per granted page: the checksum of the chunk received (two-sided).
    checksums: Vec<Option<u64>>,
}

/// The decode worker's half of the protocol.
#[derive(Default)]
pub struct Receiver {
    live: HashMap<HandoffId, Incoming>,
    /// Revoked one-sided windows whose pages wait in quarantine.
    draining: HashMap<HandoffId, Window>,
    next_epoch: u32,
    stats: ReceiverStats,
}

impl std::fmt::Debug for Receiver {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Receiver")
            .field("live", &self.live.len())
            .field("draining", &self.draining.len())
            .field("stats", &self.stats)
            .finish()
    }
}

impl Receiver {
    /// A receiver with no hand-off in flight.
    pub fn new() -> Self {
        Receiver::default()
    }

    /// Counters so far.
    pub fn stats(&self) -> ReceiverStats {
        self.stats
    }

    /// Hand-offs granted and not yet committed or failed.
    pub fn in_flight(&self) -> usize {
        self.live.len()
    }

    /// One-sided hand-offs whose pages wait in quarantine for the writer.
    pub fn draining(&self) -> usize {
        self.draining.len()
    }

    /// Whether `lease` can receive a grant of `tokens` prompt positions:
    /// every group holds its pages from its first position (a windowed
    /// group slid to where the first pass reads) to position `tokens`.
    fn check_grant(id: HandoffId, lease: &Lease, tokens: usize) -> Result<u32, HandoffError> {
        let too_large = || HandoffError::GrantTooLarge {
            id,
            tokens,
            capacity: lease.capacity_tokens(),
        };
        let page_size = lease.page_size();
        let holds = (0..lease.layer_groups().len()).all(|g| {
            let first = lease.group_first_position(g);
            tokens <= first + lease.group_pages(g).len() * page_size
        });
        if tokens == 0 || tokens > lease.capacity_tokens() || !holds {
            return Err(too_large());
        }
        u32::try_from(tokens).map_err(|_| too_large())
    }

    fn insert(
        &mut self,
        id: HandoffId,
        lease: Lease,
        tokens: u32,
        window: Option<Window>,
    ) -> Message {
        self.next_epoch = self.next_epoch.wrapping_add(1);
        let epoch = Epoch(self.next_epoch);
        let page_size = lease.page_size();
        let pages = (tokens as usize).div_ceil(page_size);
        let mut granted = Vec::new();
        let mut incoming = Vec::new();
        for g in 0..lease.layer_groups().len() {
            let first_page = lease.group_first_position(g) / page_size;
            let count = pages.saturating_sub(first_page);
            let present = lease
                .group_leading_shared_pages(g)
                .min(count.saturating_sub(1));
            granted.push(GrantedGroup {
                layers: lease
                    .layer_groups()
                    .members(g)
                    .iter()
                    .map(|&layer| u32::try_from(layer).expect("a model has few layers"))
                    .collect(),
                first_page: u32::try_from(first_page).expect("a granted page number fits u32"),
                present: present as u32,
                pages: lease.group_pages(g)[..count].to_vec(),
            });
            incoming.push(IncomingGroup {
                first_page,
                present,
                checksums: vec![None; count],
            });
        }
        let message = Message::Grant {
            id,
            epoch,
            page_size: page_size as u32,
            tokens,
            groups: granted,
        };
        self.live.insert(
            id,
            Incoming {
                epoch,
                lease,
                tokens: tokens as usize,
                page_size,
                groups: incoming,
                window,
                prompt_logprobs: None,
            },
        );
        message
    }

    /// Grants the first `tokens` positions of `lease` (reserved all or
    /// nothing by the caller) to hand-off `id`; returns the `Grant` to send.
    /// The sender answers with `Chunk`s. A sliding-window layer group is
    /// first slid to where the lease's first pass, at position `tokens`,
    /// reads: it is granted only its window's pages, so the positions
    /// behind the window never cross the link.
    pub fn grant(
        &mut self,
        id: HandoffId,
        mut lease: Lease,
        tokens: usize,
    ) -> Result<Message, HandoffError> {
        lease.slide_windows(tokens)?;
        let tokens = Self::check_grant(id, &lease, tokens)?;
        Ok(self.insert(id, lease, tokens, None))
    }

    /// Grants like [`Receiver::grant`], but for a one-sided writer: returns
    /// the `Grant` and the [`Window`] through which the writer stores the KV
    /// directly (hand the writer `window.key()` with it).
    /// A one-sided writer stores into leases of one layer group.
    pub fn grant_one_sided(
        &mut self,
        id: HandoffId,
        mut lease: Lease,
        tokens: usize,
    ) -> Result<(Message, Window), HandoffError> {
        if lease.layer_groups().len() != 1 {
            return Err(HandoffError::LayerGroupsMismatch {
                id,
                reason: "a one-sided writer stores into leases of one layer group",
            });
        }
        let tokens = Self::check_grant(id, &lease, tokens)?;
        let window = lease.open_window();
        Ok((self.insert(id, lease, tokens, Some(window.clone())), window))
    }

    /// Makes live hand-off `id` commit only with the score of every prompt
    /// token after the first, each with its token and at most `top`
    /// alternatives; without this call a `Done` carrying scores fails.
    pub fn expect_prompt_logprobs(&mut self, id: HandoffId, top: usize) {
        let incoming = self
            .live
            .get_mut(&id)
            .expect("prompt scores are asked for a hand-off just granted");
        assert!(
            top < MAX_FIRST_LOGPROBS,
            "at most twenty alternatives per prompt token"
        );
        incoming.prompt_logprobs = Some(top);
    }

    /// Revokes hand-off `id` at once (the client left, or a timeout).
    /// Two-sided: the pages are freed now; late chunks find no live grant.
    /// One-sided: the window is revoked and the pages stay quarantined until
    /// the writer's `AbortAck`. Returns the `Abort` to send, if it was live.
    pub fn abort(&mut self, id: HandoffId) -> Option<Message> {
        let incoming = self.live.remove(&id)?;
        let epoch = incoming.epoch;
        self.retire(id, incoming);
        Some(Message::Abort { id, epoch })
    }

    /// Drops a grant's lease: freed if two-sided, quarantined behind a
    /// revoked window if one-sided.
    fn retire(&mut self, id: HandoffId, incoming: Incoming) {
        if let Some(window) = incoming.window
            && incoming.lease.is_exposed()
        {
            window.revoke();
            drop(incoming.lease);
            self.draining.insert(id, window);
        }
        // Otherwise the lease drops here: two-sided, or a window already
        // closed (revoked and drained), so no write can arrive.
    }

    /// Handles one message from the sender.
    pub fn handle(&mut self, message: Message) -> Outcome {
        let id = message.id();
        match message {
            Message::AbortAck { .. } => return self.acknowledged(id),
            Message::Reject { reason, .. } => {
                let Some(incoming) = self.live.remove(&id) else {
                    // A writer rejecting after an abort also says it stopped.
                    return self.acknowledged(id);
                };
                self.retire(id, incoming);
                self.stats.failed += 1;
                // A writer that rejects has stopped writing: a one-sided
                // grant's pages are released now if the window drained.
                let _ = self.acknowledged(id);
                return Outcome::Failed {
                    id,
                    error: HandoffError::Rejected { id, reason },
                    reply: None,
                };
            }
            _ => {}
        }
        let Some(incoming) = self.live.get_mut(&id) else {
            self.stats.stale_messages += 1;
            return Outcome::Ignored;
        };
        match message {
            Message::Chunk {
                epoch,
                page,
                slot_start,
                slot_end,
                checksum,
                bytes,
                ..
            } => {
                if epoch != incoming.epoch {
                    self.stats.stale_messages += 1;
                    return Outcome::Ignored;
                }
                if incoming.window.is_some() {
                    return self.fail(
                        id,
                        HandoffError::ChunkOutsideGrant {
                            id,
                            reason: "a one-sided grant takes no chunks",
                        },
                    );
                }
                let found = incoming.groups.iter().enumerate().find_map(|(g, group)| {
                    let granted = &incoming.lease.group_pages(g)[..group.checksums.len()];
                    let index = granted.iter().position(|p| p.id == page.id)?;
                    Some((g, index))
                });
                let Some((g, index)) = found else {
                    return self.fail(
                        id,
                        HandoffError::ChunkOutsideGrant {
                            id,
                            reason: "page is not in the grant",
                        },
                    );
                };
                let group = &incoming.groups[g];
                if index < group.present {
                    return self.fail(
                        id,
                        HandoffError::ChunkOutsideGrant {
                            id,
                            reason: "page is already present",
                        },
                    );
                }
                let number = group.first_page + index;
                let slots = slot_start as usize..slot_end as usize;
                let expected = 0..incoming
                    .page_size
                    .min(incoming.tokens - number * incoming.page_size);
                if slots != expected {
                    return self.fail(
                        id,
                        HandoffError::ChunkOutsideGrant {
                            id,
                            reason: "a chunk must carry its page's granted slots",
                        },
                    );
                }
                if chunk_checksum(std::iter::once(&bytes[..])) != checksum {
                    self.stats.checksum_failures += 1;
                    return self.fail(id, HandoffError::ChecksumMismatch { id, page: number });
                }
                // The pool checks ownership and the page's generation (I3).
                if let Err(error) = incoming.lease.write_group_slots_raw(g, page, slots, &bytes) {
                    return self.fail(id, error.into());
                }
                incoming.groups[g].checksums[index] = Some(checksum);
                self.stats.bytes += bytes.len() as u64;
                Outcome::Accepted
            }
            Message::Done {
                epoch,
                tokens,
                digest: claimed,
                first_token,
                cached,
                first_logprobs,
                prompt_logprobs,
                ..
            } => {
                if epoch != incoming.epoch {
                    self.stats.stale_messages += 1;
                    return Outcome::Ignored;
                }
                if let Err(reason) = check_prompt_logprobs(
                    incoming.prompt_logprobs,
                    incoming.tokens,
                    &prompt_logprobs,
                ) {
                    return self.fail(id, HandoffError::PromptLogprobsMismatch { id, reason });
                }
                match self.verify(id, tokens as usize, claimed) {
                    Ok(written_in_place) => {
                        let incoming = self.live.remove(&id).expect("verified a live hand-off");
                        self.stats.committed += 1;
                        self.stats.bytes += written_in_place;
                        Outcome::Committed(Committed {
                            id,
                            lease: incoming.lease,
                            tokens: incoming.tokens,
                            first_token,
                            cached: (cached as usize).min(incoming.tokens),
                            first_logprobs,
                            prompt_logprobs,
                        })
                    }
                    Err(error) => self.fail(id, error),
                }
            }
            Message::Progress {
                epoch, computed, ..
            } => {
                // A sender that says it computed more than was granted is
                // confused or hostile: the request fails rather than
                // waiting on it.
                if epoch != incoming.epoch {
                    self.stats.stale_messages += 1;
                    return Outcome::Ignored;
                }
                if computed as usize > incoming.tokens {
                    let granted = incoming.tokens;
                    return self.fail(
                        id,
                        HandoffError::ProgressBeyondGrant {
                            id,
                            claimed: computed as usize,
                            granted,
                        },
                    );
                }
                Outcome::Accepted
            }
            // Grant and Abort never travel this way.
            _ => {
                self.stats.stale_messages += 1;
                Outcome::Ignored
            }
        }
    }

    /// The commit test for `Done` (I2, I7). Returns the bytes a one-sided
    /// writer stored in place (0 for two-sided: chunks were counted on arrival).
    fn verify(&mut self, id: HandoffId, tokens: usize, claimed: u64) -> Result<u64, HandoffError> {
        let incoming = self.live.get_mut(&id).expect("called for a live hand-off");
        if tokens != incoming.tokens {
            return Err(HandoffError::TokenCountMismatch {
                id,
                claimed: tokens,
                granted: incoming.tokens,
            });
        }
        let mut written_in_place = 0;
        if let Some(window) = &incoming.window {
            // Close the window first: from here on nothing can change the
            // bytes being verified, and the lease releases normally later.
            // (A one-sided grant is of one group, from position 0.)
            incoming.lease.close_window(window)?;
            let view = incoming.lease.read_view_raw(incoming.tokens)?;
            let checksums = &mut incoming.groups[0].checksums;
            for (index, checksum) in checksums.iter_mut().enumerate() {
                let slots = 0..incoming
                    .page_size
                    .min(incoming.tokens - index * incoming.page_size);
                let runs = view.slot_runs(index, slots);
                written_in_place += runs.clone().map(|run| run.len() as u64).sum::<u64>();
                // Hashed where the writer put them: no copy.
                *checksum = Some(chunk_checksum(runs));
            }
        }
        let shipped = || {
            incoming
                .groups
                .iter()
                .flat_map(|group| &group.checksums[group.present..])
        };
        let pages = shipped().count();
        let missing = shipped().filter(|c| c.is_none()).count();
        if missing > 0 {
            return Err(HandoffError::Incomplete { id, missing, pages });
        }
        // Present pages are covered too: every group proves every granted
        // slot, whichever way it was written (I2).
        for (g, group) in incoming.groups.iter().enumerate() {
            let start = group.first_page * incoming.page_size;
            incoming
                .lease
                .check_group_covered(g, start, incoming.tokens)?;
        }
        if digest(shipped().flatten().copied()) != claimed {
            return Err(HandoffError::DigestMismatch { id });
        }
        Ok(written_in_place)
    }

    /// The writer of an aborted or failed one-sided grant says it stopped.
    fn acknowledged(&mut self, id: HandoffId) -> Outcome {
        let Some(window) = self.draining.get(&id) else {
            self.stats.stale_messages += 1;
            return Outcome::Ignored;
        };
        match window.release() {
            Ok(pages) => {
                self.draining.remove(&id);
                Outcome::Released { id, pages }
            }
            // Still writing, or nothing quarantined yet: keep waiting.
            Err(_) => Outcome::Ignored,
        }
    }

    fn fail(&mut self, id: HandoffId, error: HandoffError) -> Outcome {
        let incoming = self.live.remove(&id).expect("failing a live hand-off");
        let epoch = incoming.epoch;
        let one_sided = incoming.window.is_some();
        // Two-sided: every byte came through this receiver, so dropping the
        // lease frees the pages safely. One-sided: quarantine and ask the
        // writer to stop and acknowledge.
        self.retire(id, incoming);
        self.stats.failed += 1;
        let reply = if one_sided {
            Message::Abort { id, epoch }
        } else {
            Message::Reject {
                id,
                reason: RejectReason::Failed,
            }
        };
        Outcome::Failed {
            id,
            error,
            reply: Some(reply),
        }
    }
}

/// Whether `scores` are what a grant of `tokens` asking for `asked`
/// alternatives per prompt token must carry: none when it did not ask, else
/// one per token after the first, each its token's finite log-probability,
/// a rank of at least 1, and at most `asked` alternatives. (Whether each
/// names the prompt's own token is the caller's check: the receiver never
/// sees the prompt.)
fn check_prompt_logprobs(
    asked: Option<usize>,
    tokens: usize,
    scores: &[PromptScore],
) -> Result<(), &'static str> {
    let Some(top) = asked else {
        return match scores.is_empty() {
            true => Ok(()),
            false => Err("scores the grant did not ask for"),
        };
    };
    if scores.len() + 1 != tokens {
        return Err("not one score per prompt token after the first");
    }
    for score in scores {
        if score.rank == 0 || !(1..=top + 1).contains(&score.logprobs.len()) {
            return Err("a score of the wrong shape");
        }
        if score
            .logprobs
            .iter()
            .any(|(_, logprob)| !logprob.is_finite())
        {
            return Err("a log-probability that is not a number");
        }
    }
    Ok(())
}

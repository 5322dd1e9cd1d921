//! The decode side: reserve, grant, validate every incoming write, commit
//! only on full coverage.
//!
//! [`Receiver`] is a pure state machine: it takes messages and returns
//! [`Outcome`]s; it never touches sockets, clocks or threads. A [`Committed`]
//! hand-off — the only way to get the lease back for decoding — exists only
//! after `Done` matched the grant's token count, every granted page arrived
//! with a valid checksum, coverage spans every granted slot in the lease's
//! current generation, and the digest matched (I2, I3, I7).

use std::collections::HashMap;

use kvfence_pool::Lease;
use xxhash_rust::xxh3::xxh3_64;

use crate::error::HandoffError;
use crate::sender::digest;
use crate::wire::{Epoch, HandoffId, Message, RejectReason};

/// A hand-off whose KV is complete and verified. The lease now holds the
/// prompt's KV; decoding may start at position `tokens`.
#[derive(Debug)]
pub struct Committed {
    id: HandoffId,
    lease: Lease,
    tokens: usize,
    first_token: u32,
}

impl Committed {
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

    /// The lease, for decoding.
    pub fn into_lease(self) -> Lease {
        self.lease
    }
}

/// What handling one message led to.
#[derive(Debug)]
pub enum Outcome {
    /// Accepted; the hand-off goes on.
    Accepted,
    /// Not for a live hand-off or epoch (late, duplicate, after abort):
    /// dropped and counted, harmlessly.
    Ignored,
    /// The hand-off completed and verified.
    Committed(Committed),
    /// The hand-off failed; its lease was dropped (pages freed, I8). Tell the
    /// client an error, and the sender `reply` if present.
    Failed {
        /// Hand-off.
        id: HandoffId,
        /// Why.
        error: HandoffError,
        /// A message for the sender, if one is due.
        reply: Option<Message>,
    },
}

/// Counters of refused hand-off traffic.
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
    checksums: Vec<Option<u64>>,
}

/// The decode worker's half of the protocol.
#[derive(Default)]
pub struct Receiver {
    live: HashMap<HandoffId, Incoming>,
    next_epoch: u32,
    stats: ReceiverStats,
}

impl std::fmt::Debug for Receiver {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Receiver")
            .field("live", &self.live.len())
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

    /// Grants the first `tokens` positions of `lease` (reserved all or
    /// nothing by the caller) to hand-off `id`; returns the `Grant` to send.
    pub fn grant(
        &mut self,
        id: HandoffId,
        lease: Lease,
        tokens: usize,
    ) -> Result<Message, HandoffError> {
        if tokens == 0 || tokens > lease.capacity_tokens() {
            return Err(HandoffError::GrantTooLarge {
                id,
                tokens,
                capacity: lease.capacity_tokens(),
            });
        }
        self.next_epoch = self.next_epoch.wrapping_add(1);
        let epoch = Epoch(self.next_epoch);
        let page_size = lease.page_size();
        let pages = lease.pages()[..tokens.div_ceil(page_size)].to_vec();
        let message = Message::Grant {
            id,
            epoch,
            page_size: page_size as u32,
            tokens: u32::try_from(tokens).map_err(|_| HandoffError::GrantTooLarge {
                id,
                tokens,
                capacity: lease.capacity_tokens(),
            })?,
            pages: pages.clone(),
        };
        self.live.insert(
            id,
            Incoming {
                epoch,
                lease,
                tokens,
                page_size,
                checksums: vec![None; pages.len()],
            },
        );
        Ok(message)
    }

    /// Revokes hand-off `id` at once (the client left, or a timeout). On a
    /// two-sided transport every byte passes [`Receiver::handle`], so the
    /// pages are freed now; late chunks find no live grant and are ignored.
    /// Returns the `Abort` to send, if the hand-off was live.
    pub fn abort(&mut self, id: HandoffId) -> Option<Message> {
        self.live.remove(&id).map(|incoming| Message::Abort {
            id,
            epoch: incoming.epoch,
        })
    }

    /// Handles one message from the sender.
    pub fn handle(&mut self, message: Message) -> Outcome {
        let id = message.id();
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
                let Some(index) = incoming
                    .lease
                    .pages()
                    .iter()
                    .take(incoming.checksums.len())
                    .position(|p| p.id == page.id)
                else {
                    return self.fail(
                        id,
                        HandoffError::ChunkOutsideGrant {
                            id,
                            reason: "page is not in the grant",
                        },
                    );
                };
                let slots = slot_start as usize..slot_end as usize;
                let expected = 0..incoming
                    .page_size
                    .min(incoming.tokens - index * incoming.page_size);
                if slots != expected {
                    return self.fail(
                        id,
                        HandoffError::ChunkOutsideGrant {
                            id,
                            reason: "a chunk must carry its page's granted slots",
                        },
                    );
                }
                if xxh3_64(&bytes) != checksum {
                    self.stats.checksum_failures += 1;
                    return self.fail(id, HandoffError::ChecksumMismatch { id, page: index });
                }
                // The pool checks ownership and the page's generation (I3).
                if let Err(error) = incoming.lease.write_slots_raw(page, slots, &bytes) {
                    return self.fail(id, error.into());
                }
                incoming.checksums[index] = Some(checksum);
                self.stats.bytes += bytes.len() as u64;
                Outcome::Accepted
            }
            Message::Done {
                epoch,
                tokens,
                digest: claimed,
                first_token,
                ..
            } => {
                if epoch != incoming.epoch {
                    self.stats.stale_messages += 1;
                    return Outcome::Ignored;
                }
                let granted = incoming.tokens;
                if tokens as usize != granted {
                    return self.fail(
                        id,
                        HandoffError::TokenCountMismatch {
                            id,
                            claimed: tokens as usize,
                            granted,
                        },
                    );
                }
                let pages = incoming.checksums.len();
                let missing = incoming.checksums.iter().filter(|c| c.is_none()).count();
                if missing > 0 {
                    return self.fail(id, HandoffError::Incomplete { id, missing, pages });
                }
                if let Err(error) = incoming.lease.check_covered(incoming.tokens) {
                    return self.fail(id, error.into());
                }
                if digest(incoming.checksums.iter().flatten().copied()) != claimed {
                    return self.fail(id, HandoffError::DigestMismatch { id });
                }
                let incoming = self.live.remove(&id).expect("checked live above");
                self.stats.committed += 1;
                Outcome::Committed(Committed {
                    id,
                    lease: incoming.lease,
                    tokens: incoming.tokens,
                    first_token,
                })
            }
            Message::Reject { reason, .. } => {
                self.live.remove(&id);
                self.stats.failed += 1;
                Outcome::Failed {
                    id,
                    error: HandoffError::Rejected { id, reason },
                    reply: None,
                }
            }
            // AbortAck matters only to one-sided transports; Grant and Abort
            // never travel this way.
            Message::AbortAck { .. } | Message::Grant { .. } | Message::Abort { .. } => {
                self.stats.stale_messages += 1;
                Outcome::Ignored
            }
        }
    }

    fn fail(&mut self, id: HandoffId, error: HandoffError) -> Outcome {
        // Dropping the lease frees the pages: every byte came through this
        // receiver (two-sided), so nothing can still land in them.
        self.live.remove(&id);
        self.stats.failed += 1;
        Outcome::Failed {
            id,
            error,
            reply: Some(Message::Reject {
                id,
                reason: RejectReason::Failed,
            }),
        }
    }
}

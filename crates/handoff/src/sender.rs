//! The prefill side: ship a fully written prompt's KV into a grant.
//!
//! [`send_kv`] is the only way to obtain an [`AllSent`], and [`AllSent::done`]
//! the only way to build a `Done` message. `send_kv` refuses a source that
//! cannot prove every granted token was written, so a rejected or truncated
//! prompt — the incident's one-token placeholder — has no path to `Done` (I5).

use kvfence_pool::{Lease, PageRef, Window, WindowKey};
use xxhash_rust::xxh3::xxh3_64;

use crate::error::HandoffError;
use crate::wire::{Epoch, HandoffId, Message};

/// A grant as the sender holds it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Grant {
    /// Hand-off.
    pub id: HandoffId,
    /// Grant generation.
    pub epoch: Epoch,
    /// Slots per page.
    pub page_size: usize,
    /// Prompt tokens granted.
    pub tokens: usize,
    /// Target pages, in token order.
    pub pages: Vec<PageRef>,
}

impl Grant {
    /// The grant carried by a `Grant` message.
    pub fn from_message(message: &Message) -> Option<Grant> {
        match message {
            Message::Grant {
                id,
                epoch,
                page_size,
                tokens,
                pages,
            } => Some(Grant {
                id: *id,
                epoch: *epoch,
                page_size: *page_size as usize,
                tokens: *tokens as usize,
                pages: pages.clone(),
            }),
            _ => None,
        }
    }

    /// Slots of page `index` that hold granted tokens.
    pub fn slots(&self, index: usize) -> std::ops::Range<usize> {
        0..self.page_size.min(self.tokens - index * self.page_size)
    }
}

/// Proof that every granted slot was sent. Private fields: only [`send_kv`]
/// makes one.
#[derive(Debug)]
#[must_use = "without Done the receiver never commits"]
pub struct AllSent {
    id: HandoffId,
    epoch: Epoch,
    tokens: usize,
    digest: u64,
}

impl AllSent {
    /// The `Done` message this proof allows.
    pub fn done(self, first_token: u32) -> Message {
        Message::Done {
            id: self.id,
            epoch: self.epoch,
            tokens: u32::try_from(self.tokens).expect("grants fit u32 tokens"),
            digest: self.digest,
            first_token,
        }
    }
}

/// The digest over per-page chunk checksums, in page order; both sides
/// compute it the same way.
pub(crate) fn digest(checksums: impl Iterator<Item = u64>) -> u64 {
    let bytes: Vec<u8> = checksums.flat_map(u64::to_le_bytes).collect();
    xxh3_64(&bytes)
}

/// Sends one chunk per granted page from `source`, which must hold every
/// granted token written in every layer. Returns the proof for `Done`.
pub fn send_kv(
    grant: &Grant,
    source: &Lease,
    mut send: impl FnMut(Message),
) -> Result<AllSent, HandoffError> {
    ship(grant, source, |index, page, slots, bytes, checksum| {
        let _ = index;
        send(Message::Chunk {
            id: grant.id,
            epoch: grant.epoch,
            page,
            slot_start: slots.start as u16,
            slot_end: slots.end as u16,
            checksum,
            bytes,
        });
        Ok(())
    })
}

/// Writes every granted page from `source` straight into the receiver's
/// pages through its one-sided `window` (the shared-memory transport), with
/// the `key` that came with the grant. A revoked window stops the transfer:
/// no proof, so no `Done`.
pub fn send_kv_one_sided(
    grant: &Grant,
    source: &Lease,
    window: &Window,
    key: WindowKey,
) -> Result<AllSent, HandoffError> {
    ship(grant, source, |index, _, slots, bytes, _| {
        Ok(window.write(key, index, slots, &bytes)?)
    })
}

/// The shared part of both transfers: check the source, export each granted
/// page, hand it to `put`, and fold the checksums into the proof.
fn ship(
    grant: &Grant,
    source: &Lease,
    mut put: impl FnMut(
        usize,
        PageRef,
        std::ops::Range<usize>,
        Vec<u8>,
        u64,
    ) -> Result<(), HandoffError>,
) -> Result<AllSent, HandoffError> {
    if grant.page_size != source.page_size() {
        return Err(HandoffError::PageSizeMismatch {
            id: grant.id,
            grant: grant.page_size,
            source_size: source.page_size(),
        });
    }
    if grant.pages.len() != grant.tokens.div_ceil(grant.page_size) {
        return Err(HandoffError::ChunkOutsideGrant {
            id: grant.id,
            reason: "grant pages do not match its token count",
        });
    }
    source
        .check_covered(grant.tokens)
        .map_err(|_| HandoffError::SourceIncomplete {
            id: grant.id,
            need: grant.tokens,
            have: (0..=grant.tokens)
                .rev()
                .find(|&n| source.check_covered(n).is_ok())
                .unwrap_or(0),
        })?;
    let view = source.read_view_raw(grant.tokens)?;
    let mut checksums = Vec::with_capacity(grant.pages.len());
    for (index, page) in grant.pages.iter().enumerate() {
        let slots = grant.slots(index);
        let bytes = view.export_slots(index, slots.clone());
        let checksum = xxh3_64(&bytes);
        checksums.push(checksum);
        put(index, *page, slots, bytes, checksum)?;
    }
    Ok(AllSent {
        id: grant.id,
        epoch: grant.epoch,
        tokens: grant.tokens,
        digest: digest(checksums.into_iter()),
    })
}

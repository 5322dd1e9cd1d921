//! The prefill side: ship a fully written prompt's KV into a grant.
//!
//! [`send_kv`] is the only way to obtain an [`AllSent`], and [`AllSent::done`]
//! the only way to build a `Done` message. `send_kv` refuses a source that
//! cannot prove every granted token was written, so a rejected or truncated
//! prompt — the incident's one-token placeholder — has no path to `Done` (I5).
//! Pages ship layer group by layer group, each from the source's group of
//! the same layers, and a grant whose groups are not the source's is refused
//! before a byte moves.

use std::hash::Hasher as _;

use bytes::Bytes;
use kvfence_pool::{Lease, PageRef, Window, WindowKey};
use twox_hash::XxHash3_64;

use crate::error::HandoffError;
use crate::id::{Epoch, HandoffId};
use crate::shelf::FrameShelf;
use crate::wire::{GrantedGroup, Message, PromptScore, chunk_frame};

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
    /// Each layer group's pages, in the receiver pool's group order.
    pub groups: Vec<GrantedGroup>,
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
                groups,
            } => Some(Grant {
                id: *id,
                epoch: *epoch,
                page_size: *page_size as usize,
                tokens: *tokens as usize,
                groups: groups.clone(),
            }),
            _ => None,
        }
    }

    /// Slots of page `page` (counted from position 0) that hold granted
    /// tokens.
    pub fn slots(&self, page: usize) -> std::ops::Range<usize> {
        0..self.page_size.min(self.tokens - page * self.page_size)
    }

    /// Pages every group is granted, present ones included.
    pub fn pages(&self) -> usize {
        self.groups.iter().map(|g| g.pages.len()).sum()
    }

    /// Pages the sender ships: every group's after its present ones.
    pub fn pages_to_ship(&self) -> usize {
        self.groups
            .iter()
            .map(|g| g.pages.len().saturating_sub(g.present as usize))
            .sum()
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
    /// The `Done` message this proof allows; `cached` prompt tokens came
    /// from the sender's prefix cache.
    pub fn done(self, first_token: u32, cached: usize) -> Message {
        self.done_with_logprobs(first_token, cached, Vec::new(), Vec::new())
    }

    /// [`AllSent::done`], carrying the first token's log-probability and
    /// its alternatives' (`first_token`'s entry first) and, if the request
    /// asked, the score of every prompt token after the first.
    pub fn done_with_logprobs(
        self,
        first_token: u32,
        cached: usize,
        first_logprobs: Vec<(u32, f32)>,
        prompt_logprobs: Vec<PromptScore>,
    ) -> Message {
        assert!(
            first_logprobs.len() <= crate::wire::MAX_FIRST_LOGPROBS
                && first_logprobs
                    .first()
                    .is_none_or(|&(t, _)| t == first_token),
            "the first token's log-probability leads, and at most twenty alternatives follow"
        );
        assert!(
            prompt_logprobs.is_empty() || prompt_logprobs.len() + 1 == self.tokens,
            "a scored prompt has a score for every token after the first"
        );
        let tokens = u32::try_from(self.tokens).expect("grants fit u32 tokens");
        assert!(
            cached < self.tokens.max(1),
            "a cached prefix leaves a token to compute"
        );
        Message::Done {
            id: self.id,
            epoch: self.epoch,
            tokens,
            digest: self.digest,
            first_token,
            cached: cached as u32,
            first_logprobs,
            prompt_logprobs,
        }
    }
}

/// The checksum of one chunk: xxh3 of the concatenation of `runs`, hashed
/// where they lie (a chunk's bytes in a message, or a page's
/// [`kvfence_pool::ReadView::slot_runs`]). Both sides compute it this way.
pub(crate) fn chunk_checksum<'b>(runs: impl Iterator<Item = &'b [u8]>) -> u64 {
    let mut hasher = XxHash3_64::new();
    for run in runs {
        hasher.write(run);
    }
    hasher.finish()
}

/// The digest over per-page chunk checksums, in page order; both sides
/// compute it the same way.
pub(crate) fn digest(checksums: impl Iterator<Item = u64>) -> u64 {
    let bytes: Vec<u8> = checksums.flat_map(u64::to_le_bytes).collect();
    XxHash3_64::oneshot(&bytes)
}

/// A transfer in progress: ships each granted page as soon as every slot of
/// it is written, so the transfer overlaps the rest of the prefill.
/// [`Streaming::finish`] ships what is left and is the only way to the
/// `AllSent` proof.
#[derive(Debug)]
pub struct Streaming {
    grant: Grant,
    /// For each group, each granted page's shipped chunk's checksum.
    checksums: Vec<Vec<Option<u64>>>,
}

/// Where a transfer puts each page: a `Chunk` message (two-sided) or a
/// write through a window (one-sided).
pub trait Put {
    /// Delivers granted page `index` (counted from position 0) of one
    /// group, `page`: its `slots`, the chunk's
    /// bytes as the source page's `runs` (concatenated in order), and its
    /// checksum.
    fn put<'b>(
        &mut self,
        index: usize,
        page: PageRef,
        slots: std::ops::Range<usize>,
        runs: impl Iterator<Item = &'b [u8]> + Clone,
        checksum: u64,
    ) -> Result<(), HandoffError>;
}

/// Two-sided: every page becomes one chunk handed to `send`, in the form
/// `Form` names: a [`Message`] ([`Chunks`]) or its encoded frame
/// ([`ChunkFrames`]).
pub struct TwoSided<F, Form> {
    id: HandoffId,
    epoch: Epoch,
    send: F,
    form: Form,
}

/// Chunks as [`Message`]s (tests and simulations look inside them).
pub type Chunks<F> = TwoSided<F, AsMessage>;

/// Chunks as encoded frames, for a transport that moves frames: each is
/// written straight from the source page into a buffer from a
/// [`FrameShelf`] (one copy, where a message and then its frame would take
/// two; and no fresh memory once the shelf holds a few). What the engine
/// sends.
pub type ChunkFrames<'s, F> = TwoSided<F, AsFrame<'s>>;

/// [`TwoSided`]'s form for [`Chunks`].
#[derive(Debug, Clone, Copy)]
pub struct AsMessage;

/// [`TwoSided`]'s form for [`ChunkFrames`]: where frame buffers come from.
#[derive(Debug, Clone, Copy)]
pub struct AsFrame<'s>(&'s FrameShelf);

impl<F: FnMut(Message)> Chunks<F> {
    /// Chunks for `grant`, delivered by `send`.
    pub fn new(grant: &Grant, send: F) -> Self {
        TwoSided {
            id: grant.id,
            epoch: grant.epoch,
            send,
            form: AsMessage,
        }
    }
}

impl<'s, F: FnMut(Bytes)> ChunkFrames<'s, F> {
    /// Chunk frames for `grant` in buffers from `shelf`, delivered by
    /// `send`.
    pub fn new(grant: &Grant, shelf: &'s FrameShelf, send: F) -> Self {
        TwoSided {
            id: grant.id,
            epoch: grant.epoch,
            send,
            form: AsFrame(shelf),
        }
    }
}

impl<F: FnMut(Message)> Put for Chunks<F> {
    fn put<'b>(
        &mut self,
        _: usize,
        page: PageRef,
        slots: std::ops::Range<usize>,
        runs: impl Iterator<Item = &'b [u8]> + Clone,
        checksum: u64,
    ) -> Result<(), HandoffError> {
        // A message owns its bytes: the one copy a two-sided chunk needs.
        let mut bytes = Vec::with_capacity(runs.clone().map(<[u8]>::len).sum());
        for run in runs {
            bytes.extend_from_slice(run);
        }
        (self.send)(Message::Chunk {
            id: self.id,
            epoch: self.epoch,
            page,
            slot_start: slots.start as u16,
            slot_end: slots.end as u16,
            checksum,
            bytes: bytes.into(),
        });
        Ok(())
    }
}

impl<F: FnMut(Bytes)> Put for ChunkFrames<'_, F> {
    fn put<'b>(
        &mut self,
        _: usize,
        page: PageRef,
        slots: std::ops::Range<usize>,
        runs: impl Iterator<Item = &'b [u8]> + Clone,
        checksum: u64,
    ) -> Result<(), HandoffError> {
        let AsFrame(shelf) = self.form;
        let slots = slots.start as u16..slots.end as u16;
        let frame = chunk_frame(self.id, self.epoch, page, slots, checksum, runs, shelf);
        (self.send)(frame);
        Ok(())
    }
}

/// One-sided: every page is written through the receiver's window.
pub struct WindowWrites<'a> {
    window: &'a Window,
    key: WindowKey,
}

impl<'a> WindowWrites<'a> {
    /// Writes through `window` with the `key` that came with the grant.
    pub fn new(window: &'a Window, key: WindowKey) -> Self {
        WindowWrites { window, key }
    }
}

impl Put for WindowWrites<'_> {
    fn put<'b>(
        &mut self,
        index: usize,
        _: PageRef,
        slots: std::ops::Range<usize>,
        runs: impl Iterator<Item = &'b [u8]> + Clone,
        _: u64,
    ) -> Result<(), HandoffError> {
        // Page to page, one copy, no staging buffer.
        Ok(self.window.write_runs(self.key, index, slots, runs)?)
    }
}

impl Streaming {
    /// Starts a transfer into `grant`.
    pub fn new(grant: Grant) -> Streaming {
        let checksums = grant
            .groups
            .iter()
            .map(|group| vec![None; group.pages.len()])
            .collect();
        Streaming { grant, checksums }
    }

    /// The grant being filled.
    pub fn grant(&self) -> &Grant {
        &self.grant
    }

    /// The `Progress` message that tells the receiver this grant is still
    /// being worked on, `computed` prompt tokens in. It resets the
    /// receiver's silence deadline and proves nothing: only
    /// [`Streaming::finish`] leads to `Done`.
    pub fn progress(&self, computed: usize) -> Message {
        Message::Progress {
            id: self.grant.id,
            epoch: self.grant.epoch,
            computed: u32::try_from(computed.min(self.grant.tokens))
                .expect("a grant's token count fits its u32 field"),
        }
    }

    /// Ships every not-yet-shipped page whose granted slots all lie within
    /// the first `written` tokens of `source` (proven by its coverage),
    /// group by group.
    pub fn send_ready(
        &mut self,
        source: &Lease,
        written: usize,
        out: &mut impl Put,
    ) -> Result<(), HandoffError> {
        self.check_shape(source)?;
        let written = written.min(self.grant.tokens);
        let page_size = self.grant.page_size;
        for (g, group) in self.grant.groups.iter().enumerate() {
            let first = group.first_page as usize;
            let ready: Vec<usize> = (group.present as usize..group.pages.len())
                .filter(|&i| {
                    let page = first + i;
                    self.checksums[g][i].is_none()
                        && page * page_size + self.grant.slots(page).end <= written
                })
                .collect();
            if ready.is_empty() {
                continue;
            }
            // A sliding-window group of the source still holds its pages
            // from the grant's first: it slid only to where its last write
            // read, never past where the receiver's first pass reads.
            source.check_group_covered(g, first * page_size, written)?;
            let view = source.read_group_raw(g, first * page_size, written)?;
            for i in ready {
                let page = first + i;
                let slots = self.grant.slots(page);
                let runs = view.slot_runs(page, slots.clone());
                let checksum = chunk_checksum(runs.clone());
                out.put(page, group.pages[i], slots, runs, checksum)?;
                self.checksums[g][i] = Some(checksum);
            }
        }
        Ok(())
    }

    /// Ships what is left; refuses (`SourceIncomplete`) unless `source`
    /// proves every granted token written in every group. Returns the
    /// proof for `Done`.
    pub fn finish(mut self, source: &Lease, out: &mut impl Put) -> Result<AllSent, HandoffError> {
        self.check_shape(source)?;
        let need = self.grant.tokens;
        if !self.source_covers(source, need) {
            return Err(HandoffError::SourceIncomplete {
                id: self.grant.id,
                need,
                have: (0..need)
                    .rev()
                    .find(|&n| self.source_covers(source, n))
                    .unwrap_or(0),
            });
        }
        self.send_ready(source, need, out)?;
        let checksums: Vec<u64> = self
            .grant
            .groups
            .iter()
            .zip(&self.checksums)
            .flat_map(|(group, sums)| &sums[group.present as usize..])
            .map(|c| c.expect("every page shipped once the source is complete"))
            .collect();
        Ok(AllSent {
            id: self.grant.id,
            epoch: self.grant.epoch,
            tokens: need,
            digest: digest(checksums.into_iter()),
        })
    }

    /// Whether `source` holds the first `len` granted positions of every
    /// group written.
    fn source_covers(&self, source: &Lease, len: usize) -> bool {
        self.grant.groups.iter().enumerate().all(|(g, group)| {
            let start = group.first_page as usize * self.grant.page_size;
            source.check_group_covered(g, start, len).is_ok()
        })
    }

    fn check_shape(&self, source: &Lease) -> Result<(), HandoffError> {
        let grant = &self.grant;
        let id = grant.id;
        if grant.page_size != source.page_size() {
            return Err(HandoffError::PageSizeMismatch {
                id,
                grant: grant.page_size,
                source_size: source.page_size(),
            });
        }
        let groups = source.layer_groups();
        if grant.groups.len() != groups.len()
            || grant.groups.iter().enumerate().any(|(g, group)| {
                !group
                    .layers
                    .iter()
                    .map(|&layer| layer as usize)
                    .eq(groups.members(g).iter().copied())
            })
        {
            return Err(HandoffError::LayerGroupsMismatch {
                id,
                reason: "the grant's groups hold other layers than the source's",
            });
        }
        let pages = grant.tokens.div_ceil(grant.page_size);
        if grant
            .groups
            .iter()
            .any(|group| group.pages.len() != pages.saturating_sub(group.first_page as usize))
        {
            return Err(HandoffError::ChunkOutsideGrant {
                id,
                reason: "grant pages do not match its token count",
            });
        }
        // The receiver keeps at least the last page to be written: a
        // hand-off that ships nothing proves nothing.
        if grant.pages_to_ship() == 0 {
            return Err(HandoffError::ChunkOutsideGrant {
                id,
                reason: "a grant leaves no page to ship",
            });
        }
        Ok(())
    }
}

/// Sends one chunk per granted page from `source`, which must hold every
/// granted token written in every layer. Returns the proof for `Done`.
pub fn send_kv(
    grant: &Grant,
    source: &Lease,
    send: impl FnMut(Message),
) -> Result<AllSent, HandoffError> {
    Streaming::new(grant.clone()).finish(source, &mut Chunks::new(grant, send))
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
    Streaming::new(grant.clone()).finish(source, &mut WindowWrites::new(window, key))
}

#[cfg(test)]
mod tests {
    use super::chunk_checksum;

    /// A chunk checksum is XXH3-64 with the default seed, as the wire
    /// format says, whatever the pieces its bytes arrive in: the values are
    /// the reference implementation's (Python `xxhash.xxh3_64_intdigest`).
    /// A peer built with another XXH3 library agrees with this one.
    #[test]
    fn chunk_checksums_are_xxh3_64_of_the_joined_pieces() {
        let pinned = [
            (0, 0x2d06800538d394c2),
            (1, 0x4c5cca45d0f4811f),
            (240, 0x22f28cbbfaf0447f),
            (241, 0x07525dbc14902c7f),
            (1024, 0xe2898655db7bc9ee),
            (737_280, 0x90a8a685bcce7ba3),
        ];
        for (len, expected) in pinned {
            let data: Vec<u8> = (0..len).map(|i| ((i * 31 + 7) % 251) as u8).collect();
            assert_eq!(
                chunk_checksum(std::iter::once(&data[..])),
                expected,
                "{len} bytes"
            );
            for cut in [1, 63, 64, 4096] {
                assert_eq!(
                    chunk_checksum(data.chunks(cut)),
                    expected,
                    "{len} bytes in pieces of {cut}"
                );
            }
        }
    }
}

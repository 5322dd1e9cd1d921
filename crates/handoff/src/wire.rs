//! The hand-off messages and their binary frames.
//!
//! A frame is `len: u32` (bytes after this field) `type: u8` then fixed
//! little-endian fields; chunk payloads and page lists carry their own counts.
//! [`Message::decode`] rejects anything malformed with an error — wrong
//! length, unknown type, counts that overrun the frame, trailing bytes,
//! oversized frames — and never panics: peers are untrusted input.
//!
//! A chunk's payload is most of the bytes a hand-off moves, so the codec
//! avoids copying it: [`chunk_frame`] encodes straight from the source
//! page's runs, and [`Message::decode_shared`] hands out the payload as a
//! view of the received frame.

use bytes::Bytes;
use kvfence_pool::{Generation, PageId, PageRef};

use crate::error::HandoffError;
use crate::id::{Epoch, HandoffId, RejectReason};
use crate::shelf::FrameShelf;

/// Most log-probabilities a `Done` carries: the first token's and twenty
/// alternatives' (OpenAI's largest `top_logprobs`).
pub const MAX_FIRST_LOGPROBS: usize = 21;

/// One prompt token's score, sent in `Done` when the request asked for
/// the prompt's log-probabilities: its rank under the model's distribution
/// at the position before it, then `(token, logprob)` pairs — the prompt's
/// token first, then at most twenty most likely alternatives.
#[derive(Debug, Clone, PartialEq)]
pub struct PromptScore {
    /// 1 + how many tokens were more likely than the prompt's.
    pub rank: u32,
    /// The prompt's token and its log-probability, then the alternatives'.
    pub logprobs: Vec<(u32, f32)>,
}

/// Bytes of a [`PromptScore`] with no alternatives on the wire: the
/// smallest a score can be, which bounds how many a frame can hold.
const PROMPT_SCORE_MIN_BYTES: usize = 4 + 1 + 8;

/// One layer group's share of a grant: the pages that receive its
/// layers' KV. A group that keeps every position is granted every page of
/// the prompt; a sliding-window group only those from where the
/// receiver's first pass reads (`first_page`), so the positions behind its
/// window never cross the link.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GrantedGroup {
    /// The model layers each of its pages holds, in the order a page
    /// stores them: the sender's group must hold the same, or its bytes
    /// would land in other layers.
    pub layers: Vec<u32>,
    /// The number of the first granted page, counted from position 0: it
    /// holds positions from `first_page * page_size`.
    pub first_page: u32,
    /// Leading granted pages the receiver already holds (its prefix
    /// cache): the sender ships none of them.
    pub present: u32,
    /// The pages, in token order.
    pub pages: Vec<PageRef>,
}

/// One protocol message (`docs/architecture.md`, "The KV hand-off").
#[derive(Debug, Clone, PartialEq)]
pub enum Message {
    /// decode → prefill: pages reserved for exactly `tokens` prompt tokens.
    Grant {
        /// Hand-off.
        id: HandoffId,
        /// Grant generation.
        epoch: Epoch,
        /// Token slots per page; sender and receiver must agree.
        page_size: u32,
        /// Prompt tokens granted.
        tokens: u32,
        /// The receiver's layer groups, in its pool's order, each with the
        /// pages granted to it.
        groups: Vec<GrantedGroup>,
    },
    /// prefill → decode: every layer's KV for `slots` of one granted page.
    Chunk {
        /// Hand-off.
        id: HandoffId,
        /// Grant generation.
        epoch: Epoch,
        /// Target page (fencing token).
        page: PageRef,
        /// First slot.
        slot_start: u16,
        /// One past the last slot.
        slot_end: u16,
        /// xxh3-64 of `bytes`.
        checksum: u64,
        /// The KV bytes.
        bytes: Bytes,
    },
    /// prefill → decode: every granted token was sent.
    Done {
        /// Hand-off.
        id: HandoffId,
        /// Grant generation.
        epoch: Epoch,
        /// Tokens sent.
        tokens: u32,
        /// Digest over the chunk checksums, in page order.
        digest: u64,
        /// The first generated token, sampled by prefill.
        first_token: u32,
        /// Prompt tokens the sender read from its prefix cache instead of
        /// computing: reported in usage, no part of the commit test.
        cached: u32,
        /// If the request asked for log-probabilities: the first token's
        /// (`first_token`, its log-probability), then the most likely
        /// alternatives with theirs; at most [`MAX_FIRST_LOGPROBS`]
        /// entries. Empty when it did not ask.
        first_logprobs: Vec<(u32, f32)>,
        /// If the request asked for the prompt's log-probabilities: the
        /// score of every prompt token after the first, in order (so one
        /// fewer than `tokens`); part of the commit test. Empty otherwise.
        prompt_logprobs: Vec<PromptScore>,
    },
    /// either way: this hand-off will never complete.
    Reject {
        /// Hand-off.
        id: HandoffId,
        /// Why.
        reason: RejectReason,
    },
    /// decode → prefill: stop; the grant is revoked.
    Abort {
        /// Hand-off.
        id: HandoffId,
        /// The epoch being revoked.
        epoch: Epoch,
    },
    /// prefill → decode: the sender's writes for `epoch` have drained.
    AbortAck {
        /// Hand-off.
        id: HandoffId,
        /// The revoked epoch.
        epoch: Epoch,
    },
    /// prefill → decode: the sender still holds this grant — queued, or
    /// computing the prompt — and is alive. It resets the receiver's
    /// silence deadline and proves nothing about the KV: only `Done`
    /// commits.
    Progress {
        /// Hand-off.
        id: HandoffId,
        /// Grant generation.
        epoch: Epoch,
        /// Prompt tokens computed so far (0 while queued).
        computed: u32,
    },
}

/// Largest frame accepted: a chunk of one page of a large model fits easily.
pub const MAX_FRAME: usize = 64 << 20;

const GRANT: u8 = 1;
const CHUNK: u8 = 2;
const DONE: u8 = 3;
const REJECT: u8 = 4;
const ABORT: u8 = 5;
const ABORT_ACK: u8 = 6;
const PROGRESS: u8 = 7;

const PAGE_REF_BYTES: usize = 12;
/// Bytes of a [`GrantedGroup`] with no layers and no pages: its three
/// counts and two fields.
const GRANTED_GROUP_MIN_BYTES: usize = 4 * 4;
/// A `Chunk` frame's type and fields before its payload.
const CHUNK_HEADER_BYTES: usize = 1 + 8 + 4 + PAGE_REF_BYTES + 2 + 2 + 8 + 4;

impl Message {
    /// The hand-off this message belongs to.
    pub fn id(&self) -> HandoffId {
        match self {
            Message::Grant { id, .. }
            | Message::Chunk { id, .. }
            | Message::Done { id, .. }
            | Message::Reject { id, .. }
            | Message::Abort { id, .. }
            | Message::AbortAck { id, .. }
            | Message::Progress { id, .. } => *id,
        }
    }

    /// Appends this message's frame to `out`.
    pub fn encode(&self, out: &mut Vec<u8>) {
        framed(out, |out| match self {
            Message::Grant {
                id,
                epoch,
                page_size,
                tokens,
                groups,
            } => {
                out.push(GRANT);
                put_u64(out, id.0);
                put_u32(out, epoch.0);
                put_u32(out, *page_size);
                put_u32(out, *tokens);
                put_len(out, groups.len());
                for group in groups {
                    put_len(out, group.layers.len());
                    for &layer in &group.layers {
                        put_u32(out, layer);
                    }
                    put_u32(out, group.first_page);
                    put_u32(out, group.present);
                    put_len(out, group.pages.len());
                    for page in &group.pages {
                        put_u32(out, page.id.0);
                        put_u64(out, page.generation.0);
                    }
                }
            }
            Message::Chunk {
                id,
                epoch,
                page,
                slot_start,
                slot_end,
                checksum,
                bytes,
            } => {
                let header = ChunkHeader {
                    id: *id,
                    epoch: *epoch,
                    page: *page,
                    slots: *slot_start..*slot_end,
                    checksum: *checksum,
                };
                header.encode(out, bytes.len());
                out.extend_from_slice(bytes);
            }
            Message::Done {
                id,
                epoch,
                tokens,
                digest,
                first_token,
                cached,
                first_logprobs,
                prompt_logprobs,
            } => {
                out.push(DONE);
                put_u64(out, id.0);
                put_u32(out, epoch.0);
                put_u32(out, *tokens);
                put_u64(out, *digest);
                put_u32(out, *first_token);
                put_u32(out, *cached);
                let count = u8::try_from(first_logprobs.len())
                    .ok()
                    .filter(|&n| usize::from(n) <= MAX_FIRST_LOGPROBS)
                    .expect("a Done carries at most MAX_FIRST_LOGPROBS log-probabilities");
                out.push(count);
                for &(token, logprob) in first_logprobs {
                    put_u32(out, token);
                    put_u32(out, logprob.to_bits());
                }
                put_u32(
                    out,
                    u32::try_from(prompt_logprobs.len())
                        .expect("a prompt has fewer than 2^32 tokens"),
                );
                for score in prompt_logprobs {
                    put_u32(out, score.rank);
                    let count = u8::try_from(score.logprobs.len())
                        .ok()
                        .filter(|&n| (1..=MAX_FIRST_LOGPROBS).contains(&usize::from(n)))
                        .expect("a prompt score holds its token and at most twenty alternatives");
                    out.push(count);
                    for &(token, logprob) in &score.logprobs {
                        put_u32(out, token);
                        put_u32(out, logprob.to_bits());
                    }
                }
            }
            Message::Reject { id, reason } => {
                out.push(REJECT);
                put_u64(out, id.0);
                out.push(reason.code());
            }
            Message::Abort { id, epoch } | Message::AbortAck { id, epoch } => {
                out.push(if matches!(self, Message::Abort { .. }) {
                    ABORT
                } else {
                    ABORT_ACK
                });
                put_u64(out, id.0);
                put_u32(out, epoch.0);
            }
            Message::Progress {
                id,
                epoch,
                computed,
            } => {
                out.push(PROGRESS);
                put_u64(out, id.0);
                put_u32(out, epoch.0);
                put_u32(out, *computed);
            }
        })
    }

    /// This message as one frame.
    pub fn to_frame(&self) -> Vec<u8> {
        let mut out = Vec::new();
        self.encode(&mut out);
        out
    }

    /// Decodes the first frame of `buf`. `Ok(None)`: more bytes are needed.
    /// `Ok(Some((message, used)))`: one message and the bytes it took.
    /// A chunk's payload is copied out of `buf`.
    pub fn decode(buf: &[u8]) -> Result<Option<(Message, usize)>, HandoffError> {
        Self::decode_with(buf, Bytes::copy_from_slice)
    }

    /// [`Message::decode`] without copying a chunk's payload: it stays a
    /// view of `buf`, which lives as long as the message does.
    pub fn decode_shared(buf: &Bytes) -> Result<Option<(Message, usize)>, HandoffError> {
        Self::decode_with(buf, |payload| buf.slice_ref(payload))
    }

    /// Decodes the first frame of `buf`, turning a chunk's payload (a
    /// subslice of `buf`) into the message's bytes with `payload`.
    fn decode_with(
        buf: &[u8],
        payload: impl FnOnce(&[u8]) -> Bytes,
    ) -> Result<Option<(Message, usize)>, HandoffError> {
        let Some(len_bytes) = buf.get(..4) else {
            return Ok(None);
        };
        let len = u32::from_le_bytes(len_bytes.try_into().expect("4 bytes")) as usize;
        if len > MAX_FRAME {
            return Err(HandoffError::FrameTooLarge {
                len,
                max: MAX_FRAME,
            });
        }
        let Some(body) = buf.get(4..4 + len) else {
            return Ok(None);
        };
        let mut r = Reader {
            buf: body,
            kind: "empty",
        };
        let message = match r.u8()? {
            GRANT => {
                r.kind = "Grant";
                let (id, epoch, page_size, tokens) =
                    (HandoffId(r.u64()?), Epoch(r.u32()?), r.u32()?, r.u32()?);
                // Every count is checked against the bytes left before
                // anything is allocated for it: counts are the peer's word.
                let count = r.count(
                    GRANTED_GROUP_MIN_BYTES,
                    "more layer groups than the frame holds",
                )?;
                let mut groups = Vec::with_capacity(count);
                for _ in 0..count {
                    let layers = r.count(4, "more layers than the frame holds")?;
                    let layers = (0..layers).map(|_| r.u32()).collect::<Result<_, _>>()?;
                    let (first_page, present) = (r.u32()?, r.u32()?);
                    let pages = r.count(PAGE_REF_BYTES, "more pages than the frame holds")?;
                    let pages = (0..pages)
                        .map(|_| {
                            Ok(PageRef {
                                id: PageId(r.u32()?),
                                generation: Generation(r.u64()?),
                            })
                        })
                        .collect::<Result<Vec<_>, HandoffError>>()?;
                    if present as usize > pages.len() {
                        return Err(r.malformed("more pages present than granted"));
                    }
                    groups.push(GrantedGroup {
                        layers,
                        first_page,
                        present,
                        pages,
                    });
                }
                Message::Grant {
                    id,
                    epoch,
                    page_size,
                    tokens,
                    groups,
                }
            }
            CHUNK => {
                r.kind = "Chunk";
                let (id, epoch) = (HandoffId(r.u64()?), Epoch(r.u32()?));
                let page = PageRef {
                    id: PageId(r.u32()?),
                    generation: Generation(r.u64()?),
                };
                let (slot_start, slot_end) = (r.u16()?, r.u16()?);
                let checksum = r.u64()?;
                let count = r.u32()? as usize;
                if count != r.buf.len() {
                    return Err(r.malformed("byte count does not match the frame length"));
                }
                let bytes = payload(r.take(count)?);
                Message::Chunk {
                    id,
                    epoch,
                    page,
                    slot_start,
                    slot_end,
                    checksum,
                    bytes,
                }
            }
            DONE => {
                r.kind = "Done";
                Message::Done {
                    id: HandoffId(r.u64()?),
                    epoch: Epoch(r.u32()?),
                    tokens: r.u32()?,
                    digest: r.u64()?,
                    first_token: r.u32()?,
                    cached: r.u32()?,
                    first_logprobs: {
                        let count = usize::from(r.u8()?);
                        if count > MAX_FIRST_LOGPROBS {
                            return Err(
                                r.malformed("more log-probabilities than a request may ask for")
                            );
                        }
                        (0..count)
                            .map(|_| Ok((r.u32()?, f32::from_bits(r.u32()?))))
                            .collect::<Result<Vec<_>, HandoffError>>()?
                    },
                    prompt_logprobs: {
                        let count = r.u32()? as usize;
                        // Checked before anything is allocated for them:
                        // the count is the peer's word.
                        if count > r.buf.len() / PROMPT_SCORE_MIN_BYTES {
                            return Err(r.malformed("more prompt scores than the frame holds"));
                        }
                        let mut scores = Vec::with_capacity(count);
                        for _ in 0..count {
                            let rank = r.u32()?;
                            let entries = usize::from(r.u8()?);
                            if !(1..=MAX_FIRST_LOGPROBS).contains(&entries) {
                                return Err(r.malformed(
                                    "a prompt score holds its token and at most twenty alternatives",
                                ));
                            }
                            let logprobs = (0..entries)
                                .map(|_| Ok((r.u32()?, f32::from_bits(r.u32()?))))
                                .collect::<Result<Vec<_>, HandoffError>>()?;
                            scores.push(PromptScore { rank, logprobs });
                        }
                        scores
                    },
                }
            }
            REJECT => {
                r.kind = "Reject";
                let id = HandoffId(r.u64()?);
                let reason = RejectReason::from_code(r.u8()?)
                    .ok_or_else(|| r.malformed("unknown reject reason"))?;
                Message::Reject { id, reason }
            }
            ABORT => {
                r.kind = "Abort";
                Message::Abort {
                    id: HandoffId(r.u64()?),
                    epoch: Epoch(r.u32()?),
                }
            }
            ABORT_ACK => {
                r.kind = "AbortAck";
                Message::AbortAck {
                    id: HandoffId(r.u64()?),
                    epoch: Epoch(r.u32()?),
                }
            }
            PROGRESS => {
                r.kind = "Progress";
                Message::Progress {
                    id: HandoffId(r.u64()?),
                    epoch: Epoch(r.u32()?),
                    computed: r.u32()?,
                }
            }
            other => return Err(HandoffError::UnknownType(other)),
        };
        if !r.buf.is_empty() {
            return Err(r.malformed("trailing bytes after the last field"));
        }
        Ok(Some((message, 4 + len)))
    }
}

/// The fields of a `Chunk` frame before its payload.
struct ChunkHeader {
    id: HandoffId,
    epoch: Epoch,
    page: PageRef,
    slots: std::ops::Range<u16>,
    checksum: u64,
}

impl ChunkHeader {
    /// Appends the frame's type and fields, up to the payload of `len` bytes.
    fn encode(&self, out: &mut Vec<u8>, len: usize) {
        out.push(CHUNK);
        put_u64(out, self.id.0);
        put_u32(out, self.epoch.0);
        put_u32(out, self.page.id.0);
        put_u64(out, self.page.generation.0);
        out.extend_from_slice(&self.slots.start.to_le_bytes());
        out.extend_from_slice(&self.slots.end.to_le_bytes());
        put_u64(out, self.checksum);
        put_u32(out, u32::try_from(len).expect("chunks are far below 4 GiB"));
    }
}

/// The frame of `Message::Chunk` whose payload is the concatenation of
/// `runs`, written straight from them into a buffer from `shelf`: one copy
/// of the payload, where building the message and then its frame takes
/// two.
pub(crate) fn chunk_frame<'b>(
    id: HandoffId,
    epoch: Epoch,
    page: PageRef,
    slots: std::ops::Range<u16>,
    checksum: u64,
    runs: impl Iterator<Item = &'b [u8]> + Clone,
    shelf: &FrameShelf,
) -> Bytes {
    let len: usize = runs.clone().map(<[u8]>::len).sum();
    let mut out = shelf.take(4 + CHUNK_HEADER_BYTES + len);
    let header = ChunkHeader {
        id,
        epoch,
        page,
        slots,
        checksum,
    };
    framed(&mut out, |out| {
        header.encode(out, len);
        for run in runs {
            out.extend_from_slice(run);
        }
    });
    shelf.freeze(out)
}

/// Appends the frame whose body `body` writes: its length, then the body.
fn framed(out: &mut Vec<u8>, body: impl FnOnce(&mut Vec<u8>)) {
    let start = out.len();
    out.extend_from_slice(&[0; 4]);
    body(out);
    let len = u32::try_from(out.len() - start - 4).expect("frames are far below 4 GiB");
    out[start..start + 4].copy_from_slice(&len.to_le_bytes());
}

fn put_u32(out: &mut Vec<u8>, v: u32) {
    out.extend_from_slice(&v.to_le_bytes());
}

/// A count of things in a frame, which is far below 4 GiB.
fn put_len(out: &mut Vec<u8>, len: usize) {
    put_u32(
        out,
        u32::try_from(len).expect("a frame counts far fewer than 2^32 things"),
    );
}

fn put_u64(out: &mut Vec<u8>, v: u64) {
    out.extend_from_slice(&v.to_le_bytes());
}

struct Reader<'a> {
    buf: &'a [u8],
    kind: &'static str,
}

impl<'a> Reader<'a> {
    fn malformed(&self, reason: &'static str) -> HandoffError {
        HandoffError::Malformed {
            kind: self.kind,
            reason,
        }
    }

    fn take(&mut self, n: usize) -> Result<&'a [u8], HandoffError> {
        if self.buf.len() < n {
            return Err(self.malformed("frame ends inside a field"));
        }
        let (head, tail) = self.buf.split_at(n);
        self.buf = tail;
        Ok(head)
    }

    /// A count of things of at least `each` bytes, refused (`reason`)
    /// when the bytes left cannot hold that many.
    fn count(&mut self, each: usize, reason: &'static str) -> Result<usize, HandoffError> {
        let count = self.u32()? as usize;
        if count > self.buf.len() / each {
            return Err(self.malformed(reason));
        }
        Ok(count)
    }

    fn u8(&mut self) -> Result<u8, HandoffError> {
        Ok(self.take(1)?[0])
    }

    fn u16(&mut self) -> Result<u16, HandoffError> {
        Ok(u16::from_le_bytes(
            self.take(2)?.try_into().expect("2 bytes"),
        ))
    }

    fn u32(&mut self) -> Result<u32, HandoffError> {
        Ok(u32::from_le_bytes(
            self.take(4)?.try_into().expect("4 bytes"),
        ))
    }

    fn u64(&mut self) -> Result<u64, HandoffError> {
        Ok(u64::from_le_bytes(
            self.take(8)?.try_into().expect("8 bytes"),
        ))
    }
}

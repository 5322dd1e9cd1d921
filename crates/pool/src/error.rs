//! The one error type of the pool crate.
//!
//! Every refusal names the page, generation, layer or position involved so a
//! caller (or an operator reading a log) can tell what was refused and why.
//! Nothing here ever carries KV contents or request text.

use crate::element::ElemType;
use crate::page::{Generation, PageId, RequestId};

/// Why the pool refused an operation. A refusal never changes pool state:
/// nothing is allocated, written or released by a call that returns an error.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum PoolError {
    /// The pool specification cannot describe a usable pool.
    #[error("invalid pool spec: {reason}")]
    InvalidSpec {
        /// What is wrong with the spec.
        reason: String,
    },
    /// A lease of zero tokens was asked for; every request holds at least one.
    #[error("request {owner} asked to lease zero tokens")]
    EmptyLease {
        /// The request that asked.
        owner: RequestId,
    },
    /// The request can never fit, however empty the pool is.
    #[error("request {owner} needs {needed} tokens but the whole pool holds {capacity}")]
    LargerThanPool {
        /// The request that asked.
        owner: RequestId,
        /// Tokens asked for.
        needed: usize,
        /// Tokens the whole pool holds.
        capacity: usize,
    },
    /// The request would fit an empty pool, but not enough pages are free now.
    #[error("request {owner} needs {needed_pages} pages but only {free_pages} are free")]
    Exhausted {
        /// The request that asked.
        owner: RequestId,
        /// Pages asked for.
        needed_pages: usize,
        /// Pages free at the time of the call.
        free_pages: usize,
    },
    /// A write or read named a page that this lease does not hold (I1, I3).
    #[error("page {page} is not held by the lease of request {owner}")]
    PageNotInLease {
        /// The page named.
        page: PageId,
        /// The lease's request.
        owner: RequestId,
    },
    /// A write carried a generation other than the page's current one (I3).
    #[error("write to page {page} carried generation {got}, page is at {current}")]
    StaleGeneration {
        /// The page named.
        page: PageId,
        /// The generation the write carried.
        got: Generation,
        /// The page's current generation.
        current: Generation,
    },
    /// A slot range that is empty or runs past the end of a page.
    #[error("slots {start}..{end} are not a non-empty range inside a page of {page_size} slots")]
    SlotsOutOfRange {
        /// First slot of the range.
        start: usize,
        /// One past the last slot of the range.
        end: usize,
        /// Slots per page.
        page_size: usize,
    },
    /// A layer index past the model's layer count.
    #[error("layer {layer} does not exist; the pool holds {layers} layers")]
    LayerOutOfRange {
        /// The layer named.
        layer: usize,
        /// Layers in the pool.
        layers: usize,
    },
    /// Token positions past the end of what the lease holds.
    #[error(
        "positions up to {end} asked for, but the lease of request {owner} holds {capacity} tokens"
    )]
    BeyondLease {
        /// The lease's request.
        owner: RequestId,
        /// One past the last position asked for.
        end: usize,
        /// Tokens the lease holds.
        capacity: usize,
    },
    /// Positions a sliding-window lease gave back to the pool: their pages
    /// now hold another generation, maybe another request's (I2, I7).
    #[error(
        "position {position} asked for, but the lease of request {owner} slid past it: it holds positions from {first_held}"
    )]
    Released {
        /// The lease's request.
        owner: RequestId,
        /// The first position asked for.
        position: usize,
        /// The first position the lease still holds.
        first_held: usize,
    },
    /// Input buffers of the wrong length for the slots being written.
    #[error("expected {expected} elements for the K (and V) buffer, got {got}")]
    ShapeMismatch {
        /// Elements the write needs.
        expected: usize,
        /// Elements given.
        got: usize,
    },
    /// A typed access with an element type other than the pool's.
    #[error("the pool stores {pool:?} but the access used {asked:?}")]
    ElemMismatch {
        /// The pool's element type.
        pool: ElemType,
        /// The element type of the access.
        asked: ElemType,
    },
    /// A read of a slot that was not written in the page's current
    /// generation (I2). The read is refused; nothing is computed from it.
    #[error(
        "read of {len} tokens refused: layer {layer} position {position} was not written in this generation"
    )]
    NotCovered {
        /// Tokens the read asked for.
        len: usize,
        /// The first layer with a gap.
        layer: usize,
        /// The first unwritten position in that layer.
        position: usize,
    },
    /// A one-sided write through a revoked window (I3, I4).
    #[error("write window of request {owner} is revoked")]
    WindowRevoked {
        /// The request whose window it was.
        owner: RequestId,
    },
    /// Pages cannot be released while one-sided writes are still in flight (I4).
    #[error("request {owner} still has {in_flight} one-sided writes in flight")]
    StillWriting {
        /// The request.
        owner: RequestId,
        /// Writes in flight.
        in_flight: usize,
    },
    /// `drain` named a request that has no quarantined pages.
    #[error("request {owner} has no quarantined pages")]
    NothingQuarantined {
        /// The request named.
        owner: RequestId,
    },
}

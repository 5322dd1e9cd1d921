//! What names a hand-off and its outcome, shared by the wire codec and the
//! errors: the hand-off's id, its grant's epoch, and why one was rejected
//! (with the byte each reason has on the wire).

use std::fmt;

/// Identifies one hand-off (one request) between a prefill and a decode worker.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct HandoffId(pub u64);

impl fmt::Display for HandoffId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "h{}", self.0)
    }
}

/// The grant's generation: bumped on abort, so messages of a revoked grant
/// are recognisably stale.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Epoch(pub u32);

/// Why a hand-off will never complete.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RejectReason {
    /// The prompt can never fit the rejecting worker's pool.
    TooLong,
    /// The worker cannot take it now; a retry may succeed.
    Busy,
    /// The worker failed while working on it.
    Failed,
    /// The hand-off was aborted.
    Aborted,
}

impl RejectReason {
    pub(crate) fn code(self) -> u8 {
        match self {
            RejectReason::TooLong => 1,
            RejectReason::Busy => 2,
            RejectReason::Failed => 3,
            RejectReason::Aborted => 4,
        }
    }

    pub(crate) fn from_code(code: u8) -> Option<Self> {
        Some(match code {
            1 => RejectReason::TooLong,
            2 => RejectReason::Busy,
            3 => RejectReason::Failed,
            4 => RejectReason::Aborted,
            _ => return None,
        })
    }
}

//! The one error type of the hand-off crate.

use kvfence_pool::PoolError;

use crate::id::{HandoffId, RejectReason};

/// Why a frame could not be decoded, or a hand-off failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum HandoffError {
    /// A frame larger than the protocol allows.
    #[error("frame of {len} bytes exceeds the {max}-byte limit")]
    FrameTooLarge {
        /// Declared length.
        len: usize,
        /// Limit.
        max: usize,
    },
    /// A frame whose contents do not parse.
    #[error("malformed {kind} frame: {reason}")]
    Malformed {
        /// Frame type, as far as it was read.
        kind: &'static str,
        /// What is wrong.
        reason: &'static str,
    },
    /// A frame type byte no message has.
    #[error("unknown frame type {0}")]
    UnknownType(u8),
    /// The sender's source does not hold every granted token (I5: no proof, no `Done`).
    #[error("hand-off {id}: the source holds {have} written tokens, the grant needs {need}")]
    SourceIncomplete {
        /// Hand-off.
        id: HandoffId,
        /// Tokens the grant covers.
        need: usize,
        /// Tokens the source could prove written.
        have: usize,
    },
    /// Sender and receiver disagree on page size.
    #[error("hand-off {id}: grant pages hold {grant} tokens, the source's hold {source_size}")]
    PageSizeMismatch {
        /// Hand-off.
        id: HandoffId,
        /// Grant's page size.
        grant: usize,
        /// Source's page size.
        source_size: usize,
    },
    /// The grant's layer groups are not the source's, or not what the
    /// transport can move: the bytes of one group's page would land in
    /// another's layers.
    #[error("hand-off {id}: the grant's layer groups do not fit: {reason}")]
    LayerGroupsMismatch {
        /// Hand-off.
        id: HandoffId,
        /// What differs.
        reason: &'static str,
    },
    /// A chunk's bytes do not match its checksum (I7).
    #[error("hand-off {id}: checksum mismatch on page {page}")]
    ChecksumMismatch {
        /// Hand-off.
        id: HandoffId,
        /// Page index in the grant.
        page: usize,
    },
    /// A chunk named a page outside the grant, or not whole granted slots.
    #[error("hand-off {id}: chunk does not match the grant: {reason}")]
    ChunkOutsideGrant {
        /// Hand-off.
        id: HandoffId,
        /// What is wrong.
        reason: &'static str,
    },
    /// `Progress` claimed more computed tokens than the grant holds.
    #[error("hand-off {id}: progress reports {claimed} tokens, the grant is for {granted}")]
    ProgressBeyondGrant {
        /// Hand-off.
        id: HandoffId,
        /// Tokens the sender said it computed.
        claimed: usize,
        /// Tokens granted.
        granted: usize,
    },
    /// `Done`'s prompt scores are not what the grant asked for: missing,
    /// unasked, of the wrong count or shape (I7: a request that asked to
    /// see its prompt scored never decodes without every score).
    #[error("hand-off {id}: the prompt's log-probabilities do not match the grant: {reason}")]
    PromptLogprobsMismatch {
        /// Hand-off.
        id: HandoffId,
        /// What was wrong.
        reason: &'static str,
    },
    /// `Done` claimed a token count other than the grant's (I7; the incident's
    /// one-token placeholder).
    #[error("hand-off {id}: Done claims {claimed} tokens, the grant is for {granted}")]
    TokenCountMismatch {
        /// Hand-off.
        id: HandoffId,
        /// Tokens claimed.
        claimed: usize,
        /// Tokens granted.
        granted: usize,
    },
    /// `Done` arrived before every granted page was received.
    #[error("hand-off {id}: Done arrived with {missing} of {pages} granted pages never received")]
    Incomplete {
        /// Hand-off.
        id: HandoffId,
        /// Pages never received.
        missing: usize,
        /// Pages granted.
        pages: usize,
    },
    /// `Done`'s digest does not match the chunks received (I7).
    #[error("hand-off {id}: digest mismatch")]
    DigestMismatch {
        /// Hand-off.
        id: HandoffId,
    },
    /// The other side rejected the hand-off.
    #[error("hand-off {id} rejected by the peer: {reason:?}")]
    Rejected {
        /// Hand-off.
        id: HandoffId,
        /// Why.
        reason: RejectReason,
    },
    /// The lease cannot hold what the grant would cover.
    #[error("hand-off {id}: a lease of {capacity} tokens cannot hold a grant of {tokens}")]
    GrantTooLarge {
        /// Hand-off.
        id: HandoffId,
        /// Tokens to grant.
        tokens: usize,
        /// Lease capacity.
        capacity: usize,
    },
    /// The peer is not a member of the cluster in a role this end accepts.
    #[error("peer authentication failed: {reason}")]
    AuthFailed {
        /// What went wrong.
        reason: String,
    },
    /// TLS could not be set up, or a link's TLS failed (handshake, a record
    /// that fails its integrity check).
    #[error("TLS: {0}")]
    Tls(String),
    /// Cluster credentials could not be read or written.
    #[error("cluster credentials {path}: {reason}")]
    Credentials {
        /// The file or directory.
        path: String,
        /// What is wrong (never key material).
        reason: String,
    },
    /// The connection failed.
    #[error("transport: {0}")]
    Io(String),
    /// The pool refused a write or a coverage check (I2, I3).
    #[error(transparent)]
    Pool(#[from] PoolError),
}

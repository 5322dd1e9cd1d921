//! The one error type of the engine crate.

use kvfence_model::ModelError;
use kvfence_pool::PoolError;

/// Why the engine refused or ended a request.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum EngineError {
    /// The admission queue is at its bound; the client should retry later.
    #[error("the admission queue is full ({capacity} requests waiting)")]
    QueueFull {
        /// The queue's bound.
        capacity: usize,
    },
    /// The request can never fit this worker's KV pool (I6, defence in depth).
    #[error("request needs {needed} tokens of KV but this worker's pool holds {capacity}")]
    TooLong {
        /// Prompt plus maximum completion tokens.
        needed: usize,
        /// Tokens the pool holds.
        capacity: usize,
    },
    /// The request was malformed (no prompt tokens, zero max tokens).
    #[error("invalid request: {reason}")]
    Invalid {
        /// What is wrong.
        reason: String,
    },
    /// A worker this one depends on is unreachable; retrying later may work.
    #[error("worker unavailable: {reason}")]
    Unavailable {
        /// What is unreachable.
        reason: String,
    },
    /// The engine is stopping and takes no more work.
    #[error("the engine is shutting down")]
    ShuttingDown,
    /// A worker in another process failed the request for an internal
    /// reason (the same failure a local engine reports as its own error).
    #[error("the worker failed: {reason}")]
    Internal {
        /// What failed (never request text).
        reason: String,
    },
    /// The model failed.
    #[error(transparent)]
    Model(#[from] ModelError),
    /// The hand-off transport could not be set up.
    #[error(transparent)]
    Handoff(#[from] kvfence_handoff::HandoffError),
    /// The KV pool refused an operation.
    #[error(transparent)]
    Pool(#[from] PoolError),
}

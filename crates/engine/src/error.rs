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
    /// A public system prompt's text is empty.
    #[error("the public system prompt is empty")]
    PublicPromptEmpty,
    /// A public system prompt was given for a model without a chat template.
    #[error("model {model} has no chat template, so no chat can begin with a system message")]
    NoChatTemplate {
        /// The model's name.
        model: String,
    },
    /// A public system prompt fills fewer tokens of whole pages than a
    /// public prefix must cover, so no prompt could ever read it.
    #[error(
        "its {tokens} tokens fill {whole} tokens of whole {page_size}-token pages, fewer than \
         the {min_tokens} a public prefix must cover, so no prompt could ever read it"
    )]
    PublicPromptTooShort {
        /// Tokens of the encoded prompt.
        tokens: usize,
        /// Of those, tokens in whole pages.
        whole: usize,
        /// Token slots per page.
        page_size: usize,
        /// Tokens a public prefix must cover.
        min_tokens: usize,
    },
    /// A worker that computes prompts kept fewer of a public system
    /// prompt's pages than it has: its prefix cache's quota ran out.
    #[error(
        "the {role} worker's pool kept {kept} of its {whole} tokens; public system prompts may \
         fill only the prefix cache's tenant quota of a pool"
    )]
    PublicPromptNotKept {
        /// The worker's role.
        role: &'static str,
        /// Tokens it kept in public pages.
        kept: usize,
        /// Tokens of the prompt's whole pages.
        whole: usize,
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

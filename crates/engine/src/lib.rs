//! kvfence's engine: a colocated worker that runs many requests over one
//! model and one fenced KV pool with continuous batching.
//!
//! - [`Engine`]: start it over a model and a pool, [`Engine::submit`]
//!   requests, read [`Event`]s from the [`RequestHandle`]; dropping the
//!   handle cancels the request and frees its pages at the next step.
//! - Back-pressure: a bounded queue; a full queue refuses at once.
//! - Every request reserves its whole KV need (prompt + `max_tokens`) up
//!   front, all or nothing, so a running request never runs out of pages
//!   and nothing is ever truncated silently.

mod engine;
mod error;
mod link;
mod request;
mod scheduler;
mod text;

pub use engine::{Engine, EngineConfig, EngineStats};
pub use error::EngineError;
pub use link::Transport;
pub use request::{Event, FailureKind, FinishReason, GenerationRequest, RequestHandle, Usage};
pub use scheduler::Role;
pub use text::{Pushed, TextStream};

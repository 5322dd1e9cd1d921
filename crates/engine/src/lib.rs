//! kvfence's engine: the workers. Each runs many requests over one model
//! and one fenced KV pool with continuous batching, through a scheduler
//! that is a state machine without IO (`scheduler`: inputs are commands —
//! a request, an order, a hand-off frame, a link up, lost or draining —
//! and a clock tick; `poll(now)` does what is due). This crate opens no
//! socket and depends on no networking crate; `kvfence-fleet` carries its
//! links between processes.
//!
//! - [`Engine`]: a colocated worker, a prefill/decode pair in one process
//!   ([`Engine::start_disaggregated`] over a [`Transport`]), or a decode
//!   worker whose prefill workers link to it ([`Engine::start_decode`],
//!   [`PrefillLinks`]). [`Engine::submit`] requests, read [`Event`]s from
//!   the [`RequestHandle`]; dropping the handle cancels the request and
//!   frees its pages at the next step.
//! - [`PrefillWorker`]: a prefill scheduler taking orders from the decode
//!   workers linked to it ([`PrefillWorker::link_decode`]).
//! - [`Port`]: one link as a worker sees it — frames in, frames out — and
//!   the codec of what crosses it; whatever carries the bytes holds one.
//! - Back-pressure: a bounded queue; a full queue refuses at once, and a
//!   request that could never fit the pool is refused before it waits (I6).
//! - Pages are leased as a request needs them — its prompt, then a page at
//!   a time as it decodes — admission keeping every running request room to
//!   grow; when the pool runs out a running request is preempted (its pages
//!   given back, its progress kept to resume), never failed or truncated.

mod config;
mod counters;
mod engine;
mod error;
mod port;
mod prefill_worker;
mod request;
mod scheduler;
#[cfg(test)]
mod sim;
#[cfg(test)]
mod testing;
mod text;
pub mod trace;
mod trace_context;

pub use config::EngineConfig;
pub use config::Role;
pub use counters::{EngineStats, QUEUE_WAIT_BOUNDS, WaitHistogram, WorkerSnapshot};
pub use engine::{Engine, PrefillLinks, PrefillPeer, PublicPrompt, Relaying};
pub use error::EngineError;
pub use port::{CONTROL, Connector, Inbound, Outbound, Port, Transport, decode_frame};
pub use prefill_worker::PrefillWorker;
pub use request::{
    CacheScope, Canceller, Constrained, Event, FailureKind, FinishReason, GenerationRequest,
    LinkGrammars, RequestHandle, Share, TenantScope, Usage,
};
pub use text::{Pushed, TextStream};

/// A submission's answer, to be awaited.
pub type Submitted<'a> = std::pin::Pin<
    Box<dyn std::future::Future<Output = Result<RequestHandle, EngineError>> + Send + 'a>,
>;

/// What every worker and every serving stack shows its operator (a status
/// listener's `/metrics` and `/ready`): its pools, its counters, whether it
/// can take work.
pub trait Status: Send + Sync + std::fmt::Debug {
    /// Tokens of KV each worker's pool really holds, by role label (I6).
    fn capacities(&self) -> Vec<(&'static str, usize)>;
    /// Every worker's pool counters by role label and engine counters, as
    /// they stand now; a worker that cannot be read is left out.
    fn snapshot(&self) -> Vec<WorkerSnapshot>;
    /// Whether it can take work now (for readiness probes): it admits, and
    /// the workers it depends on are linked.
    fn is_ready(&self) -> bool;
}

/// A worker process's way out on SIGTERM: stop taking work, then wait
/// for what it holds. A decode worker ([`Engine`]) and a prefill worker
/// ([`PrefillWorker`]) both drain so.
pub trait Drain: Status {
    /// Takes no new work; what it holds goes on.
    fn stop_admitting(&self);
    /// Requests it still holds (or, a decode worker, still relays).
    fn in_flight(&self) -> usize;
}

/// What serves generation requests: a local [`Engine`], a [`RemoteEngine`]
/// (a decode worker in another process) or a [`Fleet`] of them. The HTTP
/// server holds one of these and does not care which. (A prefill worker is
/// none: it takes work from decode workers only, over its links.)
pub trait Backend: Status {
    /// Queues a request (see [`Engine::submit`]). Resolves once it is
    /// accepted — its events follow on the handle — or refused; it never
    /// blocks the calling thread: a worker in another process is awaited.
    fn submit(&self, request: GenerationRequest) -> Submitted<'_>;
    /// Stops taking work; in-flight requests end with an error.
    fn shutdown(&self);
}

/// A shared worker shows what the worker itself shows (a worker's status
/// listener and its links hold the same engine).
impl<T: Status + ?Sized> Status for std::sync::Arc<T> {
    fn capacities(&self) -> Vec<(&'static str, usize)> {
        (**self).capacities()
    }

    fn snapshot(&self) -> Vec<WorkerSnapshot> {
        (**self).snapshot()
    }

    fn is_ready(&self) -> bool {
        (**self).is_ready()
    }
}

/// A shared backend serves like the backend itself.
impl<T: Backend + ?Sized> Backend for std::sync::Arc<T> {
    fn submit(&self, request: GenerationRequest) -> Submitted<'_> {
        (**self).submit(request)
    }

    fn shutdown(&self) {
        (**self).shutdown()
    }
}

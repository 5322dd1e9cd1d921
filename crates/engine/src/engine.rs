//! [`Engine`]: a colocated worker. One scheduler thread owns every running
//! request and their leases; clients talk to it through [`Engine::submit`]
//! and the returned [`RequestHandle`].

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::mpsc;
use std::thread::JoinHandle;

use kvfence_model::LoadedModel;
use kvfence_pool::{Pool, RequestId};
use tokio::sync::mpsc as tokio_mpsc;

use crate::error::EngineError;
use crate::request::{GenerationRequest, RequestHandle};
use crate::scheduler::{Command, Pending, Scheduler};

/// Scheduling limits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EngineConfig {
    /// Requests decoding or prefilling at once.
    pub max_running: usize,
    /// Requests waiting for pages at most; more are refused (back-pressure).
    pub max_queue: usize,
    /// Tokens one forward pass may process (decode tokens plus prefill chunks).
    pub step_tokens: usize,
}

impl Default for EngineConfig {
    fn default() -> Self {
        EngineConfig {
            max_running: 64,
            max_queue: 256,
            step_tokens: 256,
        }
    }
}

/// Counters the engine keeps; read with [`Engine::stats`].
#[derive(Debug, Default)]
pub(crate) struct Counters {
    pub(crate) queued: AtomicUsize,
    pub(crate) running: AtomicUsize,
    pub(crate) finished: AtomicU64,
    pub(crate) failed: AtomicU64,
    pub(crate) cancelled: AtomicU64,
    pub(crate) prompt_tokens: AtomicU64,
    pub(crate) generated_tokens: AtomicU64,
    pub(crate) steps: AtomicU64,
}

/// A snapshot of the engine's counters.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EngineStats {
    /// Requests waiting for pages.
    pub queued: usize,
    /// Requests holding pages.
    pub running: usize,
    /// Requests that finished normally.
    pub finished: u64,
    /// Requests that ended with an error.
    pub failed: u64,
    /// Requests cancelled by their client.
    pub cancelled: u64,
    /// Prompt tokens prefilled.
    pub prompt_tokens: u64,
    /// Tokens generated.
    pub generated_tokens: u64,
    /// Forward passes run.
    pub steps: u64,
}

/// A running colocated worker.
pub struct Engine {
    commands: mpsc::Sender<Command>,
    counters: Arc<Counters>,
    pool: Pool,
    config: EngineConfig,
    next_id: AtomicU64,
    thread: Option<JoinHandle<()>>,
}

impl Engine {
    /// Starts the scheduler thread over `model` and `pool`.
    pub fn start(model: Arc<LoadedModel>, pool: Pool, config: EngineConfig) -> Engine {
        let (commands, inbox) = mpsc::channel();
        let counters = Arc::new(Counters::default());
        let scheduler = Scheduler::new(model, pool.clone(), config, Arc::clone(&counters), inbox);
        let thread = std::thread::Builder::new()
            .name("kvfence-scheduler".into())
            .spawn(move || scheduler.run())
            .expect("the OS can start the scheduler thread");
        Engine {
            commands,
            counters,
            pool,
            config,
            next_id: AtomicU64::new(1),
            thread: Some(thread),
        }
    }

    /// Queues a request. Refused at once, holding nothing, if it can never
    /// fit the pool or the queue is full.
    pub fn submit(&self, request: GenerationRequest) -> Result<RequestHandle, EngineError> {
        if request.prompt.is_empty() || request.max_tokens == 0 {
            return Err(EngineError::Invalid {
                reason: "a request needs prompt tokens and max_tokens of at least 1".into(),
            });
        }
        let capacity = self.pool.capacity_tokens();
        if request.kv_tokens() > capacity {
            return Err(EngineError::TooLong {
                needed: request.kv_tokens(),
                capacity,
            });
        }
        let bound = self.config.max_queue;
        self.counters
            .queued
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |q| {
                (q < bound).then_some(q + 1)
            })
            .map_err(|_| EngineError::QueueFull { capacity: bound })?;
        let id = RequestId(self.next_id.fetch_add(1, Ordering::Relaxed));
        let (events, receiver) = tokio_mpsc::unbounded_channel();
        let cancelled = Arc::new(AtomicBool::new(false));
        let pending = Pending {
            id,
            request,
            events,
            cancelled: Arc::clone(&cancelled),
        };
        if self
            .commands
            .send(Command::Submit(Box::new(pending)))
            .is_err()
        {
            self.counters.queued.fetch_sub(1, Ordering::AcqRel);
            return Err(EngineError::ShuttingDown);
        }
        Ok(RequestHandle::new(id, receiver, cancelled))
    }

    /// Stops the scheduler now: queued and running requests end with a
    /// `ShuttingDown` failure and give their pages back; new ones are refused.
    pub fn shutdown(&self) {
        let _ = self.commands.send(Command::Shutdown);
    }

    /// The worker's KV pool.
    pub fn pool(&self) -> &Pool {
        &self.pool
    }

    /// Current counters.
    pub fn stats(&self) -> EngineStats {
        let c = &self.counters;
        EngineStats {
            queued: c.queued.load(Ordering::Acquire),
            running: c.running.load(Ordering::Acquire),
            finished: c.finished.load(Ordering::Relaxed),
            failed: c.failed.load(Ordering::Relaxed),
            cancelled: c.cancelled.load(Ordering::Relaxed),
            prompt_tokens: c.prompt_tokens.load(Ordering::Relaxed),
            generated_tokens: c.generated_tokens.load(Ordering::Relaxed),
            steps: c.steps.load(Ordering::Relaxed),
        }
    }
}

impl Drop for Engine {
    /// Stops the scheduler: requests still queued or running get a
    /// `ShuttingDown` failure, and every lease is returned.
    fn drop(&mut self) {
        let _ = self.commands.send(Command::Shutdown);
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

impl std::fmt::Debug for Engine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Engine")
            .field("config", &self.config)
            .field("stats", &self.stats())
            .finish()
    }
}

//! The scheduler loop: continuous batching over one model and one pool.
//!
//! Each step it (1) takes new requests and drops cancelled ones, (2) admits
//! waiting requests whose whole reservation — prompt plus `max_tokens` —
//! can be leased now (all or nothing, in arrival order), (3) builds one
//! batch of every decoding request's next token plus prefill chunks up to the
//! step's token budget, (4) runs it and streams the results. A request's
//! lease lives inside its `Active` entry, so finishing, failing or cancelling
//! the request is what returns its pages (I8).

use std::collections::VecDeque;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc;

use kvfence_model::{LoadedModel, Logits, Sampler, Sequence};
use kvfence_pool::{Lease, Pool, PoolError, RequestId};
use tokio::sync::mpsc as tokio_mpsc;
use tracing::{debug, warn};

use crate::engine::{Counters, EngineConfig};
use crate::request::{Event, FailureKind, FinishReason, GenerationRequest, Usage};
use crate::text::TextStream;

pub(crate) enum Command {
    Submit(Box<Pending>),
    Shutdown,
}

/// A request waiting for pages.
pub(crate) struct Pending {
    pub(crate) id: RequestId,
    pub(crate) request: GenerationRequest,
    pub(crate) events: tokio_mpsc::UnboundedSender<Event>,
    pub(crate) cancelled: Arc<AtomicBool>,
}

impl Pending {
    fn is_cancelled(&self) -> bool {
        self.cancelled.load(Ordering::Acquire) || self.events.is_closed()
    }
}

/// A request holding pages.
struct Active {
    pending: Pending,
    lease: Lease,
    sampler: Sampler,
    text: TextStream,
    /// Prompt tokens already in the KV cache.
    prefilled: usize,
    generated: Vec<u32>,
}

impl Active {
    fn prefill_done(&self) -> bool {
        self.prefilled == self.pending.request.prompt.len()
    }
}

/// What one request contributes to one step.
struct Work {
    index: usize,
    past: usize,
    tokens: Vec<u32>,
    logits: Logits,
}

pub(crate) struct Scheduler {
    model: Arc<LoadedModel>,
    pool: Pool,
    config: EngineConfig,
    counters: Arc<Counters>,
    inbox: mpsc::Receiver<Command>,
    waiting: VecDeque<Pending>,
    active: Vec<Active>,
    stopping: bool,
}

impl Scheduler {
    pub(crate) fn new(
        model: Arc<LoadedModel>,
        pool: Pool,
        config: EngineConfig,
        counters: Arc<Counters>,
        inbox: mpsc::Receiver<Command>,
    ) -> Self {
        Scheduler {
            model,
            pool,
            config,
            counters,
            inbox,
            waiting: VecDeque::new(),
            active: Vec::new(),
            stopping: false,
        }
    }

    pub(crate) fn run(mut self) {
        while !self.stopping {
            self.receive();
            self.drop_cancelled();
            self.admit();
            if !self.active.is_empty() {
                self.step();
            }
        }
        self.fail_everything();
    }

    fn receive(&mut self) {
        let idle = self.active.is_empty();
        if idle {
            // Nothing to compute: sleep until a command arrives. With
            // requests waiting but none admitted, pages are held by nobody
            // and a new arrival or shutdown is the only thing that helps.
            match self.inbox.recv() {
                Ok(command) => self.handle(command),
                Err(_) => self.stopping = true,
            }
        }
        while let Ok(command) = self.inbox.try_recv() {
            self.handle(command);
        }
    }

    fn handle(&mut self, command: Command) {
        match command {
            Command::Submit(pending) => self.waiting.push_back(*pending),
            Command::Shutdown => self.stopping = true,
        }
    }

    fn drop_cancelled(&mut self) {
        let before = self.waiting.len();
        self.waiting.retain(|p| !p.is_cancelled());
        let dropped_waiting = before - self.waiting.len();
        self.counters
            .queued
            .fetch_sub(dropped_waiting, Ordering::AcqRel);
        let before = self.active.len();
        self.active.retain(|a| !a.pending.is_cancelled());
        let dropped_active = before - self.active.len();
        self.counters
            .running
            .fetch_sub(dropped_active, Ordering::AcqRel);
        let dropped = dropped_waiting + dropped_active;
        if dropped > 0 {
            self.counters
                .cancelled
                .fetch_add(dropped as u64, Ordering::Relaxed);
            debug!(dropped, "cancelled requests released");
        }
    }

    fn admit(&mut self) {
        while self.active.len() < self.config.max_running {
            let Some(pending) = self.waiting.front() else {
                break;
            };
            let lease = match self.pool.lease(pending.id, pending.request.kv_tokens()) {
                Ok(lease) => lease,
                // Pages will come back as running requests end; keep order.
                Err(PoolError::Exhausted { .. }) => break,
                Err(error) => {
                    let pending = self.waiting.pop_front().expect("front exists");
                    self.counters.queued.fetch_sub(1, Ordering::AcqRel);
                    self.fail(&pending, error.to_string());
                    continue;
                }
            };
            let pending = self.waiting.pop_front().expect("front exists");
            self.counters.queued.fetch_sub(1, Ordering::AcqRel);
            let sampler = match Sampler::new(pending.request.sampling) {
                Ok(sampler) => sampler,
                Err(error) => {
                    self.fail(&pending, error.to_string());
                    continue;
                }
            };
            let text = TextStream::new(pending.request.stop.clone());
            self.counters.running.fetch_add(1, Ordering::AcqRel);
            self.active.push(Active {
                pending,
                lease,
                sampler,
                text,
                prefilled: 0,
                generated: Vec::new(),
            });
        }
    }

    /// Decode tokens first (one per decoding request), then prefill chunks in
    /// admission order with what is left of the budget. Prefill always gets
    /// some room so a full decode batch cannot starve new requests.
    fn plan(&self) -> Vec<Work> {
        let mut work = Vec::new();
        for (index, a) in self.active.iter().enumerate() {
            if a.prefill_done() {
                let last = *a
                    .generated
                    .last()
                    .expect("a decoding request has sampled a token");
                let past = a.prefilled + a.generated.len() - 1;
                work.push(Work {
                    index,
                    past,
                    tokens: vec![last],
                    logits: Logits::Last,
                });
            }
        }
        let mut budget = self.config.step_tokens.saturating_sub(work.len()).max(16);
        for (index, a) in self.active.iter().enumerate() {
            if a.prefill_done() || budget == 0 {
                continue;
            }
            let prompt = &a.pending.request.prompt;
            let take = (prompt.len() - a.prefilled).min(budget);
            budget -= take;
            let end = a.prefilled + take;
            let logits = if end == prompt.len() {
                Logits::Last
            } else {
                Logits::None
            };
            work.push(Work {
                index,
                past: a.prefilled,
                tokens: prompt[a.prefilled..end].to_vec(),
                logits,
            });
        }
        work
    }

    fn step(&mut self) {
        let work = self.plan();
        let result = {
            let mut leases: Vec<Option<&mut Lease>> =
                self.active.iter_mut().map(|a| Some(&mut a.lease)).collect();
            let mut batch: Vec<Sequence<'_>> = work
                .iter()
                .map(|w| Sequence {
                    lease: leases[w.index]
                        .take()
                        .expect("one piece of work per request per step"),
                    past: w.past,
                    tokens: &w.tokens,
                    logits: w.logits,
                })
                .collect();
            self.model.model.forward(&mut batch)
        };
        self.counters.steps.fetch_add(1, Ordering::Relaxed);
        let rows = match result {
            Ok(rows) => rows,
            Err(error) => {
                // Fail closed (I7): every request in the batch ends with an
                // error and no token from this step.
                warn!(%error, requests = work.len(), "forward pass failed");
                let mut failed: Vec<usize> = work.iter().map(|w| w.index).collect();
                failed.sort_unstable();
                for &index in failed.iter().rev() {
                    let active = self.active.swap_remove(index);
                    self.counters.running.fetch_sub(1, Ordering::AcqRel);
                    self.fail(&active.pending, error.to_string());
                }
                return;
            }
        };
        let mut finished = Vec::new();
        for (w, row) in work.iter().zip(rows) {
            let active = &mut self.active[w.index];
            if !active.prefill_done() {
                active.prefilled += w.tokens.len();
                self.counters
                    .prompt_tokens
                    .fetch_add(w.tokens.len() as u64, Ordering::Relaxed);
            }
            if w.logits == Logits::Last {
                if let Some(outcome) = self.advance(w.index, &row) {
                    finished.push((w.index, outcome));
                }
            }
        }
        finished.sort_unstable_by_key(|(index, _)| *index);
        for (index, outcome) in finished.into_iter().rev() {
            let active = self.active.swap_remove(index);
            self.counters.running.fetch_sub(1, Ordering::AcqRel);
            match outcome {
                Ok(event) => {
                    self.counters.finished.fetch_add(1, Ordering::Relaxed);
                    let _ = active.pending.events.send(event);
                }
                Err(message) => self.fail(&active.pending, message),
            }
            // `active` drops here, and with it the lease (I8).
        }
    }

    /// Samples the next token of one request and streams it. Returns the
    /// closing event when the request is done.
    fn advance(&mut self, index: usize, logits: &[f32]) -> Option<Result<Event, String>> {
        let eos = &self.model.model.config().eos_token_ids;
        let tokenizer = &self.model.tokenizer;
        let active = &mut self.active[index];
        let token = match active.sampler.sample(logits) {
            Ok(token) => token,
            Err(error) => return Some(Err(error.to_string())),
        };
        active.generated.push(token);
        self.counters
            .generated_tokens
            .fetch_add(1, Ordering::Relaxed);
        let request = &active.pending.request;
        let usage = Usage {
            prompt_tokens: request.prompt.len(),
            completion_tokens: active.generated.len(),
        };
        let finish = |reason| Some(Ok(Event::Finished { reason, usage }));
        if !request.ignore_eos && eos.contains(&token) {
            return match active.text.flush(tokenizer) {
                Ok(rest) => {
                    let _ = active.pending.events.send(Event::Token { text: rest });
                    finish(FinishReason::Stop)
                }
                Err(error) => Some(Err(error.to_string())),
            };
        }
        let pushed = match active.text.push(tokenizer, token) {
            Ok(pushed) => pushed,
            Err(error) => return Some(Err(error.to_string())),
        };
        let _ = active
            .pending
            .events
            .send(Event::Token { text: pushed.delta });
        if pushed.stopped {
            return finish(FinishReason::Stop);
        }
        if active.generated.len() == request.max_tokens {
            return match active.text.flush(tokenizer) {
                Ok(rest) => {
                    if !rest.is_empty() {
                        let _ = active.pending.events.send(Event::Token { text: rest });
                    }
                    finish(FinishReason::Length)
                }
                Err(error) => Some(Err(error.to_string())),
            };
        }
        None
    }

    fn fail(&self, pending: &Pending, message: String) {
        self.counters.failed.fetch_add(1, Ordering::Relaxed);
        let _ = pending.events.send(Event::Failed {
            kind: FailureKind::Internal,
            message,
        });
    }

    fn fail_everything(&mut self) {
        let shutting_down = || Event::Failed {
            kind: FailureKind::ShuttingDown,
            message: "the server is shutting down".into(),
        };
        for pending in self.waiting.drain(..) {
            self.counters.queued.fetch_sub(1, Ordering::AcqRel);
            let _ = pending.events.send(shutting_down());
        }
        for active in self.active.drain(..) {
            self.counters.running.fetch_sub(1, Ordering::AcqRel);
            let _ = active.pending.events.send(shutting_down());
        }
        // Commands that raced the shutdown.
        while let Ok(Command::Submit(pending)) = self.inbox.try_recv() {
            self.counters.queued.fetch_sub(1, Ordering::AcqRel);
            let _ = pending.events.send(shutting_down());
        }
    }
}

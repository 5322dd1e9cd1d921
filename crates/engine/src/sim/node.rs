//! One simulated worker process: its scheduler while it runs, its inbox,
//! and what it shows the scheduler while it polls.

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvfence_pool::Pool;

use super::Kv;
use crate::config::{EngineConfig, Role};
use crate::counters::Counters;
use crate::scheduler::{Command, Effect, Outside, Scheduler};

/// One worker process: its scheduler while it runs.
pub(super) struct Node {
    pub(super) role: Role,
    pub(super) kv: Kv,
    pub(super) tokens: usize,
    pub(super) config: EngineConfig,
    pub(super) live: Option<Live>,
    /// When a crashed worker comes back.
    pub(super) restart_at: Option<Duration>,
}

pub(super) struct Live {
    pub(super) scheduler: Scheduler,
    pub(super) pool: Pool,
    pub(super) counters: Arc<Counters>,
    /// Decode role: the next request id (each incarnation numbers from 1,
    /// as a real decode worker does).
    pub(super) next_id: u64,
    /// What the network delivered and the scheduler has not taken yet: a
    /// step may find a command here mid-pass, as a real worker's does.
    pub(super) inbox: VecDeque<Command>,
}

impl Live {
    /// Feeds the scheduler what arrived, keeping what it sends in `sent`.
    pub(super) fn take_commands(&mut self, sent: &mut Vec<Effect>) {
        while let Some(command) = self.inbox.pop_front() {
            sent.extend(self.scheduler.handle(command));
        }
    }

    pub(super) fn poll(&mut self, now: Instant, sent: &mut Vec<Effect>) {
        let mut outside = Wire {
            inbox: &self.inbox,
            sent,
        };
        self.scheduler.poll(now, &mut outside);
    }
}

/// What a scheduler in the simulation sees around it while it polls: what
/// it sends is kept for the network, and its pass pauses when its inbox
/// holds something.
struct Wire<'a> {
    inbox: &'a VecDeque<Command>,
    sent: &'a mut Vec<Effect>,
}

impl Outside for Wire<'_> {
    fn send(&mut self, effects: Vec<Effect>) {
        self.sent.extend(effects);
    }

    fn command_waiting(&mut self) -> bool {
        !self.inbox.is_empty()
    }
}

impl Node {
    pub(super) fn start(&mut self) {
        let model = self.kv.model();
        let pool = self.kv.pool(self.tokens, &self.config);
        let counters = Arc::new(Counters::default());
        let scheduler = Scheduler::new(
            self.role,
            model,
            pool.clone(),
            self.config,
            Arc::clone(&counters),
        );
        self.live = Some(Live {
            scheduler,
            pool,
            counters,
            next_id: 1,
            inbox: VecDeque::new(),
        });
        self.restart_at = None;
    }
}

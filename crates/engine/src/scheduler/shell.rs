//! The shell around a scheduler's core in a running worker: it owns the
//! inbox, blocks on it while there is nothing to compute (until a command
//! arrives or the core's next deadline), feeds every command to
//! [`Scheduler::handle`], polls with the wall clock, and delivers what the
//! core sends. The core takes its inputs and its time from here — or from
//! the fleet simulator, which runs many cores on one virtual clock and
//! routes their effects itself.

use std::sync::mpsc;
use std::time::Instant;

use super::effects::{Effect, Outside};
use super::{Command, Scheduler};

pub(crate) struct Shell {
    pub(crate) core: Scheduler,
    inbox: mpsc::Receiver<Command>,
    /// The command that paused the core's pass, taken off the inbox to see
    /// it came; handled first by the next [`Shell::take_commands`].
    arrived: Option<Command>,
}

/// The outside a running worker's core sees while it polls.
struct Wire<'a> {
    inbox: &'a mut mpsc::Receiver<Command>,
    arrived: &'a mut Option<Command>,
}

impl Outside for Wire<'_> {
    fn send(&mut self, effects: Vec<Effect>) {
        effects.into_iter().for_each(Effect::deliver);
    }

    fn command_waiting(&mut self) -> bool {
        if self.arrived.is_none() {
            *self.arrived = self.inbox.try_recv().ok();
        }
        self.arrived.is_some()
    }
}

impl Shell {
    pub(crate) fn new(core: Scheduler, inbox: mpsc::Receiver<Command>) -> Shell {
        Shell {
            core,
            inbox,
            arrived: None,
        }
    }

    /// Runs the worker until it is told to stop or every sender of its
    /// inbox is gone; then fails what it holds and refuses what raced the
    /// shutdown.
    pub(crate) fn run(mut self) {
        loop {
            if !self.core.has_work() {
                let received = match self.core.next_deadline() {
                    None => self.inbox.recv().map_err(|_| true),
                    Some(deadline) => {
                        let wait = deadline.saturating_duration_since(Instant::now());
                        self.inbox
                            .recv_timeout(wait)
                            .map_err(|e| e == mpsc::RecvTimeoutError::Disconnected)
                    }
                };
                match received {
                    Ok(command) => self.handle(command),
                    Err(true) => self.core.stop(),
                    Err(false) => {}
                }
            }
            self.take_commands();
            if self.core.is_stopping() {
                break;
            }
            self.poll(Instant::now());
        }
        let raced: Vec<Command> = self
            .arrived
            .take()
            .into_iter()
            .chain(self.inbox.try_iter())
            .collect();
        deliver(self.core.shut_down(raced));
    }

    fn handle(&mut self, command: Command) {
        deliver(self.core.handle(command));
    }

    /// Feeds the core every command waiting in the inbox, the one that
    /// paused its pass first.
    pub(crate) fn take_commands(&mut self) {
        if let Some(command) = self.arrived.take() {
            self.handle(command);
        }
        while let Ok(command) = self.inbox.try_recv() {
            self.handle(command);
        }
    }

    /// Polls the core at `now`, delivering what it sends as it sends it;
    /// returns whether a step ran.
    pub(crate) fn poll(&mut self, now: Instant) -> bool {
        let mut wire = Wire {
            inbox: &mut self.inbox,
            arrived: &mut self.arrived,
        };
        self.core.poll(now, &mut wire)
    }
}

fn deliver(effects: Vec<Effect>) {
    effects.into_iter().for_each(Effect::deliver);
}

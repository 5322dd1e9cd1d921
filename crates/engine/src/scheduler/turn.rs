//! Turns on the compute pool for the workers of one process (I11).
//!
//! The default mode runs a prefill and a decode worker in one process, and
//! both compute on the process's one rayon pool. Left to themselves their
//! passes ran side by side, and worse, one on top of the other: a pool
//! thread waiting inside one pass's parallel region takes whatever job is
//! queued, the other worker's whole pass included, and runs it on its own
//! stack above the pass it was waiting in. That pass could then neither
//! pause for a command nor end until the other one ended — a short chat's
//! first token held up by another tenant's prefill for a hundred
//! milliseconds and more (`bench/noisy_neighbour.py`, p90 3–5× alone).
//!
//! So a worker computes only while it holds the turn ([`ComputeTurn`]):
//! passes never overlap, each runs on every core, and none runs above
//! another. Tickets make it fair — whoever asked first goes next — and a
//! pass that has held the turn for [`QUANTUM`] while the other worker
//! waits stops at its next layer boundary ([`ComputeTurn::wanted`]) and
//! goes on at its next turn, so either worker waits about a quantum and a
//! layer at most. A worker alone in its process never waits and is never
//! asked to stop.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Condvar, Mutex};
use std::time::{Duration, Instant};

/// How long a pass keeps the turn while another worker waits for it: a few
/// layers of a decode step, so the other worker's first token waits about
/// this long, and the switches (a futex wake and the pool's threads
/// finding the next pass's jobs) stay a small part of the time.
pub(crate) const QUANTUM: Duration = Duration::from_millis(4);

/// The compute pool's turn, shared by the workers of one process.
#[derive(Debug)]
pub(crate) struct ComputeTurn {
    tickets: Mutex<Tickets>,
    next: Condvar,
    /// Workers blocked in [`ComputeTurn::take`].
    waiting: AtomicUsize,
    /// When the holder took the turn, in nanoseconds after `epoch`.
    taken_at: AtomicU64,
    epoch: Instant,
    /// How long the holder keeps it while another worker waits.
    quantum: Duration,
}

#[derive(Debug, Default)]
struct Tickets {
    /// Tickets handed out so far.
    issued: u64,
    /// The ticket whose holder may compute; the ones below it are done.
    serving: u64,
}

/// The turn, held: the pool is this worker's until it is dropped.
#[derive(Debug)]
#[must_use = "the turn is given back when this is dropped"]
pub(crate) struct Turn<'a> {
    of: &'a ComputeTurn,
    ticket: u64,
}

impl Default for ComputeTurn {
    fn default() -> Self {
        ComputeTurn {
            tickets: Mutex::default(),
            next: Condvar::new(),
            waiting: AtomicUsize::new(0),
            taken_at: AtomicU64::new(0),
            epoch: Instant::now(),
            quantum: QUANTUM,
        }
    }
}

impl ComputeTurn {
    /// Waits for the turn, after every worker that asked before.
    pub(crate) fn take(&self) -> Turn<'_> {
        self.waiting.fetch_add(1, Ordering::AcqRel);
        let mut tickets = self.tickets.lock().unwrap_or_else(|p| p.into_inner());
        let ticket = tickets.issued;
        tickets.issued += 1;
        while tickets.serving != ticket {
            tickets = self.next.wait(tickets).unwrap_or_else(|p| p.into_inner());
        }
        drop(tickets);
        self.waiting.fetch_sub(1, Ordering::AcqRel);
        self.taken_at.store(self.now(), Ordering::Release);
        Turn { of: self, ticket }
    }

    /// Whether the holder should stop at its next layer boundary: another
    /// worker waits and the holder has had its quantum.
    pub(crate) fn wanted(&self) -> bool {
        self.waiting.load(Ordering::Acquire) > 0
            && self
                .now()
                .saturating_sub(self.taken_at.load(Ordering::Acquire))
                >= self.quantum.as_nanos() as u64
    }

    /// A turn some other worker always waits for, with no quantum: its
    /// holder is asked to stop at every layer boundary (tests).
    #[cfg(test)]
    pub(crate) fn always_wanted() -> ComputeTurn {
        ComputeTurn {
            waiting: AtomicUsize::new(1),
            quantum: Duration::ZERO,
            ..ComputeTurn::default()
        }
    }

    fn now(&self) -> u64 {
        u64::try_from(self.epoch.elapsed().as_nanos()).unwrap_or(u64::MAX)
    }
}

impl Turn<'_> {
    /// Whether its holder should stop at its next layer boundary
    /// ([`ComputeTurn::wanted`]).
    pub(crate) fn wanted(&self) -> bool {
        self.of.wanted()
    }
}

impl Drop for Turn<'_> {
    fn drop(&mut self) {
        let mut tickets = self.of.tickets.lock().unwrap_or_else(|p| p.into_inner());
        assert_eq!(
            tickets.serving, self.ticket,
            "only the ticket being served holds the turn"
        );
        tickets.serving += 1;
        drop(tickets);
        self.of.next.notify_all();
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use std::sync::{Arc, Mutex};

    use super::*;

    /// Blocks until a worker waits for the turn.
    fn until_one_waits(turn: &ComputeTurn) {
        while turn.waiting.load(Ordering::Acquire) == 0 {
            std::thread::yield_now();
        }
    }

    #[test]
    fn a_worker_alone_is_never_asked_to_stop() {
        let turn = ComputeTurn::default();
        for _ in 0..3 {
            let held = turn.take();
            std::thread::sleep(QUANTUM);
            assert!(!turn.wanted(), "nobody waits");
            drop(held);
        }
    }

    #[test]
    fn a_waiting_worker_asks_the_holder_to_stop_after_its_quantum() {
        let turn = Arc::new(ComputeTurn::default());
        let held = turn.take();
        let other = {
            let turn = Arc::clone(&turn);
            std::thread::spawn(move || drop(turn.take()))
        };
        until_one_waits(&turn);
        std::thread::sleep(QUANTUM);
        assert!(
            turn.wanted(),
            "the other worker waits and the quantum is spent"
        );
        drop(held);
        other.join().unwrap();
        assert!(!turn.wanted(), "nobody waits any more");
    }

    #[test]
    fn workers_take_turns_in_the_order_they_asked() {
        let turn = Arc::new(ComputeTurn::default());
        let order = Arc::new(Mutex::new(Vec::new()));
        let held = turn.take();
        let other = {
            let (turn, order) = (Arc::clone(&turn), Arc::clone(&order));
            std::thread::spawn(move || {
                let _turn = turn.take();
                order.lock().unwrap().push("other");
            })
        };
        until_one_waits(&turn);
        // The holder gives the turn back and asks again at once: the worker
        // that waited goes first.
        drop(held);
        let again = turn.take();
        order.lock().unwrap().push("holder");
        drop(again);
        other.join().unwrap();
        assert_eq!(*order.lock().unwrap(), ["other", "holder"]);
    }
}

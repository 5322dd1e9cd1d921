//! The compute pool's other workers, kept awake through a forward pass.
//!
//! A decode step is some 150 short parallel regions (each matmul, each
//! layer's attention), tens of microseconds apiece, with a few
//! microseconds of serial work between them. Left to rayon, the idle worker
//! falls asleep in every gap and is woken by a futex for the next region:
//! on a two-core VM that was 10–14 % of a step spent in the kernel's
//! scheduler (see `docs/performance.md`).
//!
//! [`kept_awake`] runs a pass with a *helper* per other worker: a rayon job
//! that polls the pool for work ([`rayon::yield_now`]) instead of sleeping,
//! so each region's jobs are stolen by a thread that is already running.
//! Everything still goes through rayon — its deques, its joins, its latches
//! — so results keep their bits and a region never depends on a helper
//! being there. A helper is a guest and leaves:
//!
//! - when the pass ends (at once, even if the pass panics; the pass never
//!   waits for its helpers to go);
//! - when its thread leads a pass of its own (it declines at once: helping
//!   would stall that pass, which sits below it on the thread's stack,
//!   until this one ends — a decode step would wait out a whole prefill.
//!   The engine's workers take turns on the pool so their passes never
//!   overlap, but a pass does not rely on its callers for this);
//! - after [`LINGER`] without finding work (a long serial stretch);
//! - after [`BUDGET`] in all: rayon may have started it under some other
//!   job that is waiting, and that job's wait must stay short.
//!
//! Between layers the pass calls [`Awake::rearm`], which sends a new helper
//! for each one that left; while one is still there it costs two atomic
//! loads.
//!
//! A helper keeps a worker awake between regions, not inside one: a
//! parallel iterator's join that waits for its stolen half still sleeps
//! after a few dozen yields. [`each_job`] runs a region of a few long jobs
//! (a decode row's attention) without such waits.

use std::cell::Cell;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

/// How long a helper stays without finding work: longer than any gap
/// between two regions of a pass, short enough that a pass with a long
/// serial stretch gives the core back.
pub(crate) const LINGER: Duration = Duration::from_millis(1);

/// How long a helper stays at most: bounds how long it can hold up a job
/// rayon started it under.
pub(crate) const BUDGET: Duration = Duration::from_millis(8);

/// Polls for work between two reads of the clock.
const POLLS_PER_CLOCK: u32 = 32;

/// Spin-loop hints after a poll that found nothing (about a microsecond on
/// Intel cores): each poll reads the other workers' deques, whose cache
/// lines their owners write at every push and pop. Measured against one
/// hint: inside the noise, never slower.
const IDLE_PAUSES: u32 = 16;

thread_local! {
    /// Passes this thread is leading (nested passes count each).
    static LEADING: Cell<usize> = const { Cell::new(0) };
}

/// Why a helper left.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Leave {
    /// Its thread leads a pass; it never started.
    Declined,
    /// The pass it helped ended.
    PassEnded,
    /// It found no work for [`LINGER`].
    Idle,
    /// It spent its [`BUDGET`].
    BudgetSpent,
}

/// A helper's clock: when it must leave, from what it found when.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Stay {
    arrived: Instant,
    last_work: Instant,
}

impl Stay {
    pub(crate) fn new(now: Instant) -> Stay {
        Stay {
            arrived: now,
            last_work: now,
        }
    }

    /// Records a poll at `now` that did (`worked`) or did not find work;
    /// `Some` when the helper must leave.
    pub(crate) fn after_poll(&mut self, now: Instant, worked: bool) -> Option<Leave> {
        debug_assert!(now >= self.last_work, "a helper's clock runs forward");
        if worked {
            self.last_work = now;
        }
        if now.duration_since(self.arrived) >= BUDGET {
            Some(Leave::BudgetSpent)
        } else if now.duration_since(self.last_work) >= LINGER {
            Some(Leave::Idle)
        } else {
            None
        }
    }
}

/// What a pass and its helpers share.
#[derive(Debug)]
struct Shared {
    /// Set when the pass returns or unwinds.
    ended: AtomicBool,
    /// Helpers sent and not yet gone (queued or polling).
    present: AtomicUsize,
    /// Helpers a pass wants: one per other worker.
    wanted: usize,
}

/// A pass's handle on its helpers. Helpers are detached jobs holding their
/// own reference: the pass never waits for one (a helper whose thread the
/// OS has just preempted would otherwise hold the pass's end until it runs
/// again). Dropping the handle — however the pass leaves, a panic
/// included — tells them to go.
pub(crate) struct Awake {
    shared: Arc<Shared>,
}

impl Awake {
    /// Sends a helper for each one that left since the last call.
    pub(crate) fn rearm(&self) {
        while self.shared.present.load(Ordering::Acquire) < self.shared.wanted {
            self.shared.present.fetch_add(1, Ordering::AcqRel);
            let shared = Arc::clone(&self.shared);
            rayon::spawn(move || {
                help(&shared);
            });
        }
    }
}

impl Drop for Awake {
    fn drop(&mut self) {
        self.shared.ended.store(true, Ordering::Release);
    }
}

/// Counts this thread as leading a pass while it lives.
struct Leading;

impl Leading {
    fn start() -> Leading {
        LEADING.set(LEADING.get() + 1);
        Leading
    }
}

impl Drop for Leading {
    fn drop(&mut self) {
        let leading = LEADING.get();
        assert!(leading > 0, "a pass stops leading only once");
        LEADING.set(leading - 1);
    }
}

/// Runs `pass` on this thread with the pool's other workers kept awake
/// (see the module docs). Call from a thread of the pool; elsewhere, or in
/// a pool of one thread, `pass` runs with no helpers.
pub(crate) fn kept_awake<R>(pass: impl FnOnce(&Awake) -> R) -> R {
    let awake = Awake {
        shared: Arc::new(Shared {
            ended: AtomicBool::new(false),
            present: AtomicUsize::new(0),
            wanted: if rayon::current_thread_index().is_some() {
                rayon::current_num_threads() - 1
            } else {
                0
            },
        }),
    };
    let _leading = Leading::start();
    awake.rearm();
    pass(&awake)
}

/// How long a region's leader spins for the other workers' last jobs
/// before it waits the way rayon waits (which sleeps after a few dozen
/// yields): longer than any one job of a decode step.
const FINISH_SPIN: Duration = Duration::from_millis(1);

/// Runs `job(i)` for every `i < jobs` on this thread and the pool's other
/// workers, and returns the results in order of `i`.
///
/// A parallel iterator's join waits for a stolen half the way rayon
/// waits: a few dozen yields, then asleep on a futex until the half's
/// thread wakes it. At the end of a region of a few 20 µs jobs the
/// leader often waited that long, and a decode step after 4,096 positions
/// slept and was woken some ten times. Here each thread takes the next job
/// from a shared counter, and the leader, out of jobs, spins until the
/// others finish theirs before it leaves the scope. Every job still runs
/// as a rayon job or on this thread — a region never depends on another
/// worker being there — and each result goes to its own slot, so the
/// results do not depend on who ran what.
pub(crate) fn each_job<T: Send>(jobs: usize, job: impl Fn(usize) -> T + Sync) -> Vec<T> {
    let next = AtomicUsize::new(0);
    let finished = AtomicUsize::new(0);
    let results: Vec<Mutex<Option<T>>> = (0..jobs).map(|_| Mutex::new(None)).collect();
    let work = || {
        loop {
            let i = next.fetch_add(1, Ordering::Relaxed);
            if i >= jobs {
                break;
            }
            let value = job(i);
            *results[i].lock().unwrap_or_else(PoisonError::into_inner) = Some(value);
            finished.fetch_add(1, Ordering::Release);
        }
    };
    rayon::in_place_scope(|scope| {
        for _ in 1..rayon::current_num_threads().min(jobs) {
            scope.spawn(|_| work());
        }
        work();
        let started = Instant::now();
        let mut spins = 0u32;
        while finished.load(Ordering::Acquire) < jobs {
            std::hint::spin_loop();
            spins += 1;
            // A job that panicked never finishes: rayon's wait below
            // takes the panic to the caller.
            if spins.is_multiple_of(64) && started.elapsed() >= FINISH_SPIN {
                break;
            }
        }
    });
    results
        .into_iter()
        .map(|slot| {
            slot.into_inner()
                .unwrap_or_else(PoisonError::into_inner)
                .expect("every job ran before its scope ended")
        })
        .collect()
}

/// One helper's stay: polls the pool until it must leave.
fn help(shared: &Shared) -> Leave {
    let leave = stay(shared);
    shared.present.fetch_sub(1, Ordering::AcqRel);
    leave
}

fn stay(shared: &Shared) -> Leave {
    if LEADING.get() > 0 {
        return Leave::Declined;
    }
    let mut clock = Stay::new(Instant::now());
    let mut worked = false;
    let mut polls = 0u32;
    loop {
        if shared.ended.load(Ordering::Acquire) {
            return Leave::PassEnded;
        }
        match rayon::yield_now() {
            Some(rayon::Yield::Executed) => worked = true,
            Some(rayon::Yield::Idle) => (0..IDLE_PAUSES).for_each(|_| std::hint::spin_loop()),
            // Not on a pool thread: nothing to poll.
            None => return Leave::Idle,
        }
        polls += 1;
        if worked || polls == POLLS_PER_CLOCK {
            if let Some(leave) = clock.after_poll(Instant::now(), worked) {
                return leave;
            }
            (worked, polls) = (false, 0);
        }
    }
}

#[cfg(test)]
mod tests;

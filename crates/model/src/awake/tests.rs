use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use rayon::prelude::*;

use super::*;

fn pool(threads: usize) -> rayon::ThreadPool {
    rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .build()
        .expect("a test pool starts")
}

fn shared() -> Shared {
    Shared {
        ended: AtomicBool::new(false),
        present: AtomicUsize::new(1),
        wanted: 1,
    }
}

#[test]
fn a_helper_that_finds_work_stays_until_its_budget() {
    let t0 = Instant::now();
    let mut stay = Stay::new(t0);
    let step = LINGER / 2;
    let mut now = t0;
    while now + step < t0 + BUDGET {
        now += step;
        assert_eq!(stay.after_poll(now, true), None, "at {:?}", now - t0);
    }
    assert_eq!(stay.after_poll(t0 + BUDGET, true), Some(Leave::BudgetSpent));
}

#[test]
fn a_helper_without_work_leaves_after_lingering() {
    let t0 = Instant::now();
    let mut stay = Stay::new(t0);
    assert_eq!(stay.after_poll(t0 + LINGER / 2, false), None);
    // Work found resets the wait; the budget still counts from arrival.
    assert_eq!(stay.after_poll(t0 + LINGER / 2, true), None);
    assert_eq!(stay.after_poll(t0 + LINGER, false), None);
    assert_eq!(
        stay.after_poll(t0 + LINGER / 2 + LINGER, false),
        Some(Leave::Idle)
    );
}

#[test]
fn a_helper_runs_the_pools_jobs_until_the_pass_ends() {
    const JOBS: usize = 10;
    let shared = shared();
    let ran = AtomicUsize::new(0);
    // One thread: the jobs wait in its own queue until the helper polls.
    let leave = pool(1).install(|| {
        rayon::scope(|s| {
            for _ in 0..JOBS {
                s.spawn(|_| {
                    if ran.fetch_add(1, Ordering::AcqRel) + 1 == JOBS {
                        shared.ended.store(true, Ordering::Release);
                    }
                });
            }
            help(&shared)
        })
    });
    assert_eq!(leave, Leave::PassEnded);
    assert_eq!(ran.load(Ordering::Acquire), JOBS);
    assert_eq!(
        shared.present.load(Ordering::Acquire),
        0,
        "a helper that left is not present"
    );
}

#[test]
fn a_thread_leading_a_pass_declines_to_help() {
    // Were it to help, the pass below it on this thread's stack would wait
    // until the other pass ended.
    let other = shared();
    let leave = pool(2).install(|| kept_awake(|_| help(&other)));
    assert_eq!(leave, Leave::Declined);
    assert_eq!(other.present.load(Ordering::Acquire), 0);
}

#[test]
fn outside_the_pool_a_pass_runs_without_helpers() {
    assert!(rayon::current_thread_index().is_none());
    let sum = kept_awake(|awake| {
        assert_eq!(awake.shared.wanted, 0);
        awake.rearm();
        (0..1000u64).into_par_iter().sum::<u64>()
    });
    assert_eq!(sum, 999 * 1000 / 2);
}

/// A pass of many short regions with serial gaps between them, as a decode
/// step is; the sum of every region's results.
fn regions(awake: &Awake, regions: usize, gap: Duration) -> u64 {
    let mut total = 0;
    for region in 0..regions as u64 {
        total = (0..64u64)
            .into_par_iter()
            .map(|i| (0..2_000u64).fold(region + i, |a, b| a.wrapping_mul(31).wrapping_add(b)))
            .fold(|| 0u64, |a, b| a.wrapping_add(b))
            .reduce(|| 0, |a, b| a.wrapping_add(b))
            .wrapping_add(total);
        let until = Instant::now() + gap;
        while Instant::now() < until {
            std::hint::spin_loop();
        }
        awake.rearm();
    }
    total
}

fn regions_alone(count: usize) -> u64 {
    (0..count as u64)
        .map(|region| {
            (0..64u64)
                .map(|i| (0..2_000u64).fold(region + i, |a, b| a.wrapping_mul(31).wrapping_add(b)))
                .fold(0u64, |a, b| a.wrapping_add(b))
        })
        .fold(0, |a, b| a.wrapping_add(b))
}

#[test]
fn passes_on_both_workers_at_once_both_finish_with_their_results() {
    // The default mode's shape: a prefill pass and a decode pass entering
    // the pool from two threads at once, each sending a helper that may
    // land on the thread leading the other.
    let pool = pool(2);
    let expected = regions_alone(300);
    std::thread::scope(|s| {
        let runs: Vec<_> = (0..2)
            .map(|_| {
                s.spawn(|| {
                    pool.install(|| {
                        kept_awake(|awake| regions(awake, 300, Duration::from_micros(20)))
                    })
                })
            })
            .collect();
        for run in runs {
            assert_eq!(run.join().expect("a pass returns"), expected);
        }
    });
}

#[test]
fn a_panicking_pass_panics_to_its_caller_and_leaves_the_pool_working() {
    let pool = pool(2);
    let caught = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        pool.install(|| {
            kept_awake(|awake| {
                regions(awake, 3, Duration::ZERO);
                panic!("a kernel's invariant broke");
            })
        })
    }));
    assert!(caught.is_err());
    assert_eq!(
        pool.install(|| kept_awake(|awake| regions(awake, 20, Duration::ZERO))),
        regions_alone(20)
    );
}

#[test]
fn a_pass_ends_without_waiting_for_its_helpers() {
    // The helper on the other worker picks up a job that blocks until a
    // thread releases it a second later; the pass must return before that
    // (a helper's thread preempted by the OS is the same case, shorter).
    let released = Arc::new(AtomicBool::new(false));
    let (release, blocked) = std::sync::mpsc::channel::<()>();
    let started = Arc::new(AtomicBool::new(false));
    let releaser = {
        let released = Arc::clone(&released);
        std::thread::spawn(move || {
            std::thread::sleep(Duration::from_secs(1));
            released.store(true, Ordering::Release);
            let _ = release.send(());
        })
    };
    let returned_before_release = pool(2).install(|| {
        let value = kept_awake(|_| {
            let job_started = Arc::clone(&started);
            rayon::spawn(move || {
                job_started.store(true, Ordering::Release);
                let _ = blocked.recv();
            });
            while !started.load(Ordering::Acquire) {
                std::hint::spin_loop();
            }
            7
        });
        assert_eq!(value, 7);
        !released.load(Ordering::Acquire)
    });
    releaser.join().expect("the releaser ends");
    assert!(returned_before_release);
}

/// A job whose length depends on its index, so the threads finish theirs
/// at different times.
fn uneven_job(i: usize) -> u64 {
    (0..(i % 7 + 1) as u64 * 3_000).fold(i as u64, |a, b| a.wrapping_mul(31).wrapping_add(b))
}

#[test]
fn each_job_returns_every_result_in_order_whoever_ran_it() {
    let expected: Vec<u64> = (0..100).map(uneven_job).collect();
    for threads in [1, 2, 3] {
        let got = pool(threads).install(|| kept_awake(|_| each_job(100, uneven_job)));
        assert_eq!(got, expected, "{threads} threads");
    }
    // Outside any pass, and outside the pool.
    assert_eq!(pool(2).install(|| each_job(100, uneven_job)), expected);
    assert_eq!(each_job(100, uneven_job), expected);
    assert!(each_job(0, uneven_job).is_empty());
}

#[test]
fn each_job_runs_each_job_once() {
    let runs: Vec<AtomicUsize> = (0..64).map(|_| AtomicUsize::new(0)).collect();
    pool(2).install(|| {
        kept_awake(|_| {
            each_job(runs.len(), |i| runs[i].fetch_add(1, Ordering::Relaxed));
        })
    });
    assert!(runs.iter().all(|r| r.load(Ordering::Relaxed) == 1));
}

#[test]
fn a_panicking_job_panics_to_the_caller_and_leaves_the_pool_working() {
    let pool = pool(2);
    let caught = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        pool.install(|| {
            kept_awake(|_| {
                each_job(16, |i| {
                    assert!(i != 11, "a kernel's invariant broke");
                    uneven_job(i)
                })
            })
        })
    }));
    assert!(caught.is_err());
    let expected: Vec<u64> = (0..16).map(uneven_job).collect();
    assert_eq!(
        pool.install(|| kept_awake(|_| each_job(16, uneven_job))),
        expected
    );
}

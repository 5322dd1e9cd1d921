//! Many threads leasing, writing, reading, quarantining and draining one
//! pool at once. Each thread writes values only it could produce and checks
//! it reads back exactly those (I1, I2 under contention); at the end every
//! counter adds up and the pool is back at baseline (I8).

// In a test, a panic is the failure report.
#![allow(clippy::unwrap_used)]

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Barrier};
use std::thread;

use kvfence_pool::{
    ElemType, KvShape, PageId, PageState, Pool, PoolError, PoolSize, PoolSpec, RequestId,
    ReusePolicy,
};

const SHAPE: KvShape = KvShape {
    layers: 2,
    kv_heads: 1,
    head_dim: 4,
};
const PAGE: usize = 4;
const PAGES: usize = 24;
const THREADS: u64 = 8;
const ROUNDS: u64 = 5000;

/// A tiny deterministic generator so the test needs no RNG crate.
fn next(state: &mut u64) -> u64 {
    *state ^= *state << 13;
    *state ^= *state >> 7;
    *state ^= *state << 17;
    *state
}

#[test]
fn concurrent_leases_keep_ownership_and_counters_consistent() {
    let spec = PoolSpec::new(SHAPE, PAGE, ElemType::F32, PoolSize::Pages(PAGES))
        .with_reuse(ReusePolicy::NewestFreedFirst);
    let pool = Pool::new(&spec).unwrap();
    let attempts = Arc::new(AtomicU64::new(0));
    let barrier = Arc::new(Barrier::new(THREADS as usize + 1));

    let workers: Vec<_> = (0..THREADS)
        .map(|t| {
            let (pool, attempts, barrier) = (pool.clone(), attempts.clone(), barrier.clone());
            thread::spawn(move || {
                barrier.wait();
                let mut rng = 0x9E37_79B9_7F4A_7C15 ^ (t + 1);
                for round in 0..ROUNDS {
                    let owner = RequestId(t * ROUNDS + round + 1);
                    let tokens = 1 + (next(&mut rng) % 14) as usize;
                    attempts.fetch_add(1, Ordering::Relaxed);
                    let Ok(mut lease) = pool.lease(owner, tokens) else {
                        continue;
                    };
                    let mark = owner.0 as f32;
                    let k = vec![mark; tokens * 4];
                    let v = vec![-mark; tokens * 4];
                    for layer in 0..SHAPE.layers {
                        lease.write_positions(layer, 0, &k, &v).unwrap();
                    }
                    {
                        let view = lease.read_view::<f32>(tokens).unwrap();
                        for page in 0..view.num_pages() {
                            for layer in 0..SHAPE.layers {
                                assert!(
                                    view.keys(page, layer, 0)
                                        .to_rows()
                                        .iter()
                                        .all(|&x| x == mark),
                                    "I2: foreign key data"
                                );
                                assert!(
                                    view.values(page, layer, 0).iter().all(|&x| x == -mark),
                                    "I2: foreign value data"
                                );
                            }
                        }
                    }
                    if next(&mut rng).is_multiple_of(5) {
                        lease.expose_to_one_sided_writer();
                        drop(lease);
                        if next(&mut rng).is_multiple_of(2) {
                            // The drainer thread may have been first.
                            match pool.drain(owner) {
                                Ok(_) | Err(PoolError::NothingQuarantined { .. }) => {}
                                Err(other) => panic!("drain failed: {other}"),
                            }
                        }
                    }
                    let stats = pool.stats();
                    assert_eq!(
                        stats.free_pages + stats.leased_pages + stats.quarantined_pages,
                        PAGES
                    );
                }
            })
        })
        .collect();
    // A drainer racing the workers, like a transport acking late.
    let drainer = {
        let pool = pool.clone();
        let barrier = barrier.clone();
        thread::spawn(move || {
            barrier.wait();
            for _ in 0..2000 {
                for owner in pool.quarantined_owners() {
                    // The owning worker may have drained it first; both are fine.
                    let _ = pool.drain(owner);
                }
                thread::yield_now();
            }
        })
    };
    for w in workers {
        w.join().unwrap();
    }
    drainer.join().unwrap();
    for owner in pool.quarantined_owners() {
        pool.drain(owner).unwrap();
    }

    let stats = pool.stats();
    assert_eq!(stats.free_pages, PAGES, "I8: pool back at baseline");
    assert_eq!(stats.leased_pages + stats.quarantined_pages, 0);
    assert_eq!(
        stats.leases_granted + stats.leases_refused,
        attempts.load(Ordering::Relaxed)
    );
    assert!(stats.leases_granted > 0 && stats.pages_quarantined_total > 0);
    assert_eq!(
        stats.stale_writes_rejected + stats.foreign_writes_rejected + stats.reads_refused,
        0
    );
    for i in 0..PAGES {
        assert_eq!(pool.page_state(PageId(i as u32)), Some(PageState::Free));
    }
}

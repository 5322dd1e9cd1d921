//! Pools of several layer groups: global layers keep every position,
//! sliding-window layers only their window, in pages of one size from one
//! arena. What must hold: every read a pass makes (from
//! [`Lease::read_start`]) returns exactly what this request wrote, also
//! while other requests take the pages windows gave back (I1, I2); a read
//! behind a window is refused (I7); a request holds the pages its
//! positions need and no more, and the pool returns to baseline (I6, I8);
//! every group of a lease starts from one cached prefix, a window's from
//! the pages behind its end (I9).

// In a test, a panic is the failure report.
#![allow(clippy::unwrap_used)]

use kvfence_pool::{
    ElemType, Keep, KvShape, LayerGroups, Lease, Pool, PoolError, PoolSize, PoolSpec, RequestId,
    ReusePolicy,
};
use proptest::prelude::*;

const LAYERS: usize = 4;
const SHAPE: KvShape = KvShape {
    layers: LAYERS,
    kv_heads: 1,
    head_dim: 2,
};
const PAGE: usize = 4;
const WINDOW: usize = 8;
const ALIGN: usize = 4;
const MAX_RUN: usize = 4;
/// A windowed group's pages: ⌈(4 + 8 + 4 − 2) / 4⌉ + 1.
const WINDOW_PAGES: usize = 5;

/// Layers 0 and 2 attend through the window, 1 and 3 to everything: a
/// group of each, two layers a page.
fn groups() -> LayerGroups {
    LayerGroups::of_windows(&[Some(WINDOW), None, Some(WINDOW), None], ALIGN, MAX_RUN).unwrap()
}

fn spec(size: PoolSize) -> PoolSpec {
    PoolSpec::new(SHAPE, PAGE, ElemType::F32, size)
        .with_layer_groups(groups())
        .with_reuse(ReusePolicy::NewestFreedFirst)
}

/// What request `seed` writes at `position` of `layer`.
fn value(seed: u64, layer: usize, position: usize) -> [f32; 2] {
    let base = (seed * 1_000_000 + layer as u64 * 10_000 + position as u64) as f32;
    [base, -base]
}

/// Writes `start..start + run` of every layer, as a forward pass does.
fn write_run(lease: &mut Lease, seed: u64, start: usize, run: usize) -> Result<(), PoolError> {
    for layer in 0..LAYERS {
        let values: Vec<f32> = (start..start + run)
            .flat_map(|p| value(seed, layer, p))
            .collect();
        lease.write_positions(layer, start, &values, &values)?;
    }
    Ok(())
}

/// Reads what a pass of rows `past..end` reads of every layer and checks
/// it is exactly what request `seed` wrote.
fn reads_own(lease: &Lease, seed: u64, past: usize, end: usize) -> bool {
    (0..LAYERS).all(|layer| {
        let start = lease.read_start(layer, past);
        let view = lease.read_layer_from::<f32>(layer, start, end).unwrap();
        (view.first_page() * PAGE..end).all(|p| {
            let (page, slot) = (p / PAGE, p % PAGE);
            view.keys(page, layer, 0).to_rows()[slot * 2..slot * 2 + 2] == value(seed, layer, p)
                && view.values(page, layer, 0)[slot * 2..slot * 2 + 2] == value(seed, layer, p)
        })
    })
}

#[test]
fn a_long_request_holds_its_global_layers_and_a_window_of_the_rest() {
    let pool = Pool::new(&spec(PoolSize::Tokens(64))).unwrap();
    assert_eq!(pool.capacity_tokens(), 64);
    // 16 pages of global layers and a window of five for the others.
    assert_eq!(pool.geometry().num_pages, 16 + WINDOW_PAGES);
    assert_eq!(pool.pages_for(64), 21);
    assert_eq!(pool.pages_for(8), 4, "a short request: every group whole");
    assert!(matches!(
        pool.lease(RequestId(9), 65),
        Err(PoolError::LargerThanPool { capacity: 64, .. })
    ));

    let mut lease = pool.lease(RequestId(1), 4).unwrap();
    assert_eq!((lease.capacity_tokens(), lease.held_pages()), (4, 2));
    let mut past = 0;
    for run in [4, 1, 3, 4, 2, 2, 4, 4, 1, 1, 1, 1, 4, 4, 4, 4, 4, 4, 4, 4] {
        while lease.capacity_tokens() < past + run {
            lease.grow(1).unwrap();
        }
        write_run(&mut lease, 1, past, run).unwrap();
        assert!(reads_own(&lease, 1, past, past + run), "at {past}");
        past += run;
        assert!(lease.held_pages() <= past.div_ceil(PAGE) + WINDOW_PAGES);
        assert_eq!(pool.stats().leased_pages, lease.held_pages());
    }
    assert_eq!(past, 60);
    // A global layer reads everything; a windowed one nothing behind its
    // window, whatever the page now holds.
    assert!(lease.read_layer::<f32>(1, past).is_ok());
    assert!(matches!(
        lease.read_layer::<f32>(0, past),
        Err(PoolError::Released { .. })
    ));
    assert_eq!(lease.held_pages(), 15 + WINDOW_PAGES);
    drop(lease);
    assert!(pool.stats().at_baseline(), "I8");
    assert_eq!(pool.stats().free_pages, 21);
}

#[test]
fn a_run_longer_than_the_groups_were_sized_for_is_refused_not_misplaced() {
    let pool = Pool::new(&spec(PoolSize::Tokens(64))).unwrap();
    let mut lease = pool.lease(RequestId(1), 64).unwrap();
    for start in (0..40).step_by(MAX_RUN) {
        write_run(&mut lease, 1, start, MAX_RUN).unwrap();
    }
    write_run(&mut lease, 1, 40, 1).unwrap();
    // Twelve positions at once from 41 need 32..53: six pages, one more
    // than a window holds.
    assert!(matches!(
        write_run(&mut lease, 1, 41, 12),
        Err(PoolError::BeyondLease { .. })
    ));
    assert!(reads_own(&lease, 1, 40, 41));
}

#[test]
fn every_group_of_a_lease_starts_from_one_cached_prefix() {
    let spec = spec(PoolSize::Tokens(256)).with_prefix_cache(64);
    let pool = Pool::new(&spec).unwrap();
    let namespace = pool.namespace("tenant", None, "model");
    // Eight tokens: within the window, so the windowed group seals too.
    let prompt: Vec<u32> = (0..8).collect();
    let mut first = pool
        .lease_with_prefix(RequestId(1), 9, &namespace, &prompt)
        .unwrap();
    write_run(&mut first, 7, 0, 4).unwrap();
    write_run(&mut first, 7, 4, 4).unwrap();
    assert_eq!(first.seal(&prompt), 4, "two pages in each of two groups");
    drop(first);

    let asked: Vec<u32> = (0..9).collect();
    let mut second = pool
        .lease_with_prefix(RequestId(2), 12, &namespace, &asked)
        .unwrap();
    assert_eq!(second.cached_tokens(), 8);
    assert_eq!(second.shared_pages(), 4);
    write_run(&mut second, 7, 8, 1).unwrap();
    assert!(
        reads_own(&second, 7, 8, 9),
        "a hit reads what a miss computes"
    );
    drop(second);

    // A prompt longer than a window's pages: the windowed group seals the
    // pages it slides past before they go, and the rest at the end; a
    // later lease starts from the whole prefix — its global pages from
    // position 0, its window's pages behind the end — and reads what a
    // miss would compute.
    let long: Vec<u32> = (100..132).collect();
    let mut third = pool
        .lease_with_prefix(RequestId(3), 32, &namespace, &long)
        .unwrap();
    for start in (0..32).step_by(MAX_RUN) {
        write_run(&mut third, 8, start, MAX_RUN).unwrap();
    }
    assert_eq!(
        third.seal(&long),
        8 + 3,
        "every global page, the window's last three"
    );
    drop(third);
    let mut longer = long.clone();
    longer.push(7);
    let mut fourth = pool
        .lease_with_prefix(RequestId(4), 33, &namespace, &longer)
        .unwrap();
    assert_eq!(fourth.cached_tokens(), 32);
    // The window of a row at 32 reads from 24: pages 6 and 7.
    assert_eq!(fourth.shared_pages(), 8 + 2);
    write_run(&mut fourth, 8, 32, 1).unwrap();
    assert!(
        reads_own(&fourth, 8, 32, 33),
        "a hit reads what a miss computes"
    );
    drop(fourth);
    // Another tenant reads none of it (I9).
    let stranger = pool.namespace("stranger", None, "model");
    let fifth = pool
        .lease_with_prefix(RequestId(5), 33, &stranger, &longer)
        .unwrap();
    assert_eq!(fifth.cached_tokens(), 0);
    drop(fifth);
    assert!(pool.stats().at_baseline());
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(200))]

    /// Two requests interleave runs of random length in a pool just large
    /// enough, with immediate reuse of freed pages: every pass reads
    /// exactly its own request's values, and each holds what its positions
    /// need.
    #[test]
    fn interleaved_windows_read_only_their_own_values(
        runs in proptest::collection::vec((any::<bool>(), 1..=MAX_RUN), 1..60),
    ) {
        let pool = Pool::new(&spec(PoolSize::Pages(2 * (30 + WINDOW_PAGES)))).unwrap();
        let mut leases = [
            (pool.lease(RequestId(1), 1).unwrap(), 0usize),
            (pool.lease(RequestId(2), 1).unwrap(), 0usize),
        ];
        for (which, run) in runs {
            let seed = u64::from(which) + 1;
            let (lease, past) = &mut leases[usize::from(which)];
            if *past + run > 120 {
                continue;
            }
            while lease.capacity_tokens() < *past + run {
                lease.grow(1).unwrap();
            }
            write_run(lease, seed, *past, run).unwrap();
            prop_assert!(reads_own(lease, seed, *past, *past + run));
            *past += run;
            prop_assert_eq!(
                lease.held_pages(),
                past.div_ceil(PAGE).max(1) + past.div_ceil(PAGE).clamp(1, WINDOW_PAGES)
            );
        }
        let held: usize = leases.iter().map(|(l, _)| l.held_pages()).sum();
        prop_assert_eq!(pool.stats().leased_pages, held);
        drop(leases);
        prop_assert!(pool.stats().at_baseline());
    }
}

#[test]
fn keep_window_reads_start_where_the_kernel_reads() {
    let keep = Keep::Window {
        window: WINDOW,
        align: ALIGN,
        max_run: MAX_RUN,
    };
    let pool = Pool::new(&spec(PoolSize::Tokens(64))).unwrap();
    let lease = pool.lease(RequestId(1), 8).unwrap();
    for past in 0..40 {
        assert_eq!(lease.read_start(0, past), keep.read_start(past));
        assert_eq!(lease.read_start(1, past), 0);
    }
}

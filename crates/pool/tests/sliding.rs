//! Sliding-window leases: [`Lease::slide`] gives the pages behind a window
//! back to the pool while the request runs. What must hold: a position the
//! lease slid past is never read or written again through it — not after
//! its page went to another request either (I1, I2, I7) —, the lease keeps
//! its page count, shared prefix pages are let go like any reader's, and
//! the pool returns to its baseline (I8).

// In a test, a panic is the failure report.
#![allow(clippy::unwrap_used)]

use kvfence_pool::{
    ElemType, KvShape, Lease, PageState, Pool, PoolError, PoolSize, PoolSpec, RequestId,
    ReusePolicy,
};

const SHAPE: KvShape = KvShape {
    layers: 2,
    kv_heads: 1,
    head_dim: 2,
};
const PAGE: usize = 4;
const PER_TOKEN: usize = 2;

fn pool(pages: usize, reuse: ReusePolicy) -> Pool {
    Pool::new(&PoolSpec::new(SHAPE, PAGE, ElemType::F32, PoolSize::Pages(pages)).with_reuse(reuse))
        .unwrap()
}

/// Writes positions `from..to` of every layer with values that name the
/// writer (`seed`) and the position.
fn write(lease: &mut Lease, from: usize, to: usize, seed: f32) {
    let values: Vec<f32> = (from..to)
        .flat_map(|p| [seed + p as f32, seed - p as f32])
        .collect();
    for layer in 0..SHAPE.layers {
        lease
            .write_positions(layer, from, &values, &values)
            .unwrap();
    }
}

/// Whether `lease` reads back, in layer 0 from the page holding `from` to
/// `to`, exactly what `write` stored with `seed`.
fn reads_own(lease: &Lease, from: usize, to: usize, seed: f32) -> bool {
    let view = lease.read_layer_from::<f32>(0, from, to).unwrap();
    (view.first_page() * PAGE..to).all(|p| {
        let (page, slot) = (p / PAGE, p % PAGE);
        view.keys(page, 0, 0).to_rows()[slot * PER_TOKEN..(slot + 1) * PER_TOKEN]
            == [seed + p as f32, seed - p as f32]
    })
}

/// The incident this replays (mutation `p`): a window's page goes back to
/// the pool, another request leases and writes it, and the first request's
/// page table still points there. Its next read of the old position must
/// be refused, never served with the other request's KV.
#[test]
fn i7_a_released_window_page_is_never_read_after_reuse() {
    // Oldest freed first: the slide's replacement is the spare page, so the
    // page it gave back is the next request's.
    let pool = pool(3, ReusePolicy::OldestFreedFirst);
    let mut windowed = pool.lease(RequestId(1), 2 * PAGE).unwrap();
    write(&mut windowed, 0, 2 * PAGE, 100.0);
    let behind = windowed.pages()[0];

    assert_eq!(windowed.slide(PAGE + 1), Ok(1));
    assert_eq!(windowed.first_position(), PAGE);
    assert_eq!(windowed.pages().len(), 2, "a slide keeps the page count");
    assert_eq!(windowed.capacity_tokens(), 3 * PAGE);

    let mut other = pool.lease(RequestId(2), PAGE).unwrap();
    assert_eq!(
        other.pages()[0].id,
        behind.id,
        "the released page is reused"
    );
    assert!(other.pages()[0].generation > behind.generation);
    write(&mut other, 0, PAGE, -500.0);

    let refused = pool.stats().reads_refused;
    assert_eq!(
        windowed.read_layer_from::<f32>(0, 0, 2 * PAGE).unwrap_err(),
        PoolError::Released {
            owner: RequestId(1),
            position: 0,
            first_held: PAGE
        }
    );
    assert!(matches!(
        windowed.read_layer::<f32>(1, PAGE),
        Err(PoolError::Released { .. })
    ));
    assert!(matches!(
        windowed.check_covered(2 * PAGE),
        Err(PoolError::Released { .. })
    ));
    assert_eq!(pool.stats().reads_refused, refused + 3);
    assert!(reads_own(&windowed, PAGE, 2 * PAGE, 100.0));
    assert!(reads_own(&other, 0, PAGE, -500.0));

    // The old reference fences nothing (I3), and positions behind the
    // window are not written through the lease either.
    let values = vec![0.0; PER_TOKEN];
    assert!(matches!(
        windowed.write(behind, 0, 0..1, &values, &values),
        Err(PoolError::PageNotInLease { .. })
    ));
    assert!(matches!(
        windowed.write_positions(0, PAGE - 1, &values, &values),
        Err(PoolError::Released { .. })
    ));
    assert!(reads_own(&other, 0, PAGE, -500.0));

    // The window moves on: the new end is written and read like any page.
    write(&mut windowed, 2 * PAGE, 3 * PAGE, 100.0);
    assert!(reads_own(&windowed, 2 * PAGE - 1, 3 * PAGE, 100.0));
    drop((windowed, other));
    assert!(pool.stats().free_pages == 3, "I8: back at baseline");
}

#[test]
fn a_slide_gives_back_only_whole_pages_behind_the_window() {
    let pool = pool(4, ReusePolicy::NewestFreedFirst);
    let mut lease = pool.lease(RequestId(1), 3 * PAGE).unwrap();
    write(&mut lease, 0, 3 * PAGE, 1.0);
    assert_eq!(
        lease.slide(PAGE - 1),
        Ok(0),
        "page 0 still holds position 3"
    );
    assert_eq!(lease.slide(0), Ok(0));
    assert_eq!(lease.first_position(), 0);
    assert_eq!(lease.slide(2 * PAGE), Ok(2));
    assert_eq!(lease.slide(PAGE), Ok(0), "a window never moves back");
    assert_eq!(lease.first_position(), 2 * PAGE);
    assert!(reads_own(&lease, 2 * PAGE, 3 * PAGE, 1.0));
    // The fresh pages are unwritten: reading them is refused (I2).
    assert!(matches!(
        lease.read_layer_from::<f32>(0, 2 * PAGE, 3 * PAGE + 1),
        Err(PoolError::NotCovered { .. })
    ));
    // Far past the end: every page is replaced, the count stays, and the
    // lease holds the positions from where it was asked to keep (a
    // receiver's window jumps to a long prompt's end at once).
    assert_eq!(lease.slide(100 * PAGE), Ok(3));
    assert_eq!(lease.first_position(), 100 * PAGE);
    assert_eq!(lease.capacity_tokens(), 103 * PAGE);
    assert_eq!(lease.pages().len(), 3);
    let stats = pool.stats();
    assert_eq!((stats.leased_pages, stats.free_pages), (3, 1));
    for page in lease.pages() {
        assert!(matches!(
            pool.page_state(page.id),
            Some(PageState::Leased {
                owner: RequestId(1),
                ..
            })
        ));
    }
    drop(lease);
    assert_eq!(pool.stats().free_pages, 4, "I8: back at baseline");
}

#[test]
fn a_slid_lease_lets_go_of_its_shared_prefix_and_seals_its_blocks_where_they_belong() {
    let spec = PoolSpec::new(SHAPE, PAGE, ElemType::F32, PoolSize::Pages(4))
        .with_prefix_cache(4)
        .with_reuse(ReusePolicy::NewestFreedFirst);
    let pool = Pool::new(&spec).unwrap();
    let namespace = pool.namespace("tenant", None, "model");
    let prompt: Vec<u32> = (0..2 * PAGE as u32).collect();

    let mut first = pool
        .lease_with_prefix(RequestId(1), 2 * PAGE, &namespace, &prompt)
        .unwrap();
    write(&mut first, 0, 2 * PAGE, 7.0);
    assert_eq!(first.seal(&prompt), 2);
    drop(first);

    // One more token than the cached pages: both pages are a hit.
    let asked: Vec<u32> = (0..2 * PAGE as u32 + 1).collect();
    let mut second = pool
        .lease_with_prefix(RequestId(2), 3 * PAGE, &namespace, &asked)
        .unwrap();
    assert_eq!(second.shared_pages(), 2);
    // Another reader of the same pages takes the last free page: nothing
    // can replace the two, and the refusal changes nothing.
    let third = pool
        .lease_with_prefix(RequestId(3), asked.len(), &namespace, &asked)
        .unwrap();
    assert_eq!((third.shared_pages(), pool.stats().free_pages), (2, 0));
    assert!(matches!(
        second.slide(2 * PAGE),
        Err(PoolError::Exhausted { .. })
    ));
    assert_eq!(second.first_position(), 0);
    assert_eq!(second.shared_pages(), 2);
    assert!(reads_own(&second, 0, 2 * PAGE, 7.0));
    drop(third);

    assert_eq!(second.slide(2 * PAGE), Ok(2));
    assert_eq!(second.shared_pages(), 0);
    write(&mut second, 2 * PAGE, 5 * PAGE, 7.0);
    let longer: Vec<u32> = (0..5 * PAGE as u32).collect();
    // Its page 0 holds block 2 now: the chain runs through the blocks it
    // gave back, so each page is keyed by the block it holds.
    assert_eq!(second.seal(&longer), 3);
    drop(second);
    let stats = pool.stats();
    assert_eq!(stats.leased_pages, 0, "I8: nothing held");
    assert_eq!(stats.free_pages + stats.shared_pages, 4);
}

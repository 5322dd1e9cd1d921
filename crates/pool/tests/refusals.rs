//! One test per refusal and per lifecycle rule of the pool, named for the
//! behaviour and the invariant it pins.

// In a test, a panic is the failure report.
#![allow(clippy::unwrap_used)]

use kvfence_pool::{
    ElemType, Generation, KvShape, PageId, PageRef, PageState, Pool, PoolError, PoolSize, PoolSpec,
    RequestId, ReusePolicy, Scrub,
};

const SHAPE: KvShape = KvShape {
    layers: 2,
    kv_heads: 2,
    head_dim: 4,
};
const PAGE: usize = 8;
const PER_TOKEN: usize = 8;

fn pool(pages: usize) -> Pool {
    let spec = PoolSpec::new(SHAPE, PAGE, ElemType::F32, PoolSize::Pages(pages))
        .with_reuse(ReusePolicy::NewestFreedFirst);
    Pool::new(&spec).unwrap()
}

fn values(tokens: usize, seed: f32) -> Vec<f32> {
    (0..tokens * PER_TOKEN).map(|i| seed + i as f32).collect()
}

fn fill(lease: &mut kvfence_pool::Lease, tokens: usize, seed: f32) {
    for layer in 0..SHAPE.layers {
        let k = values(tokens, seed);
        lease.write_positions(layer, 0, &k, &k).unwrap();
    }
}

#[test]
fn i3_write_with_stale_generation_is_rejected_and_counted() {
    let pool = pool(1);
    let first = pool.lease(RequestId(1), 4).unwrap();
    let old = first.pages()[0];
    drop(first);
    let mut second = pool.lease(RequestId(2), 4).unwrap();
    let current = second.pages()[0];
    assert_eq!(current.id, old.id);
    assert_eq!(current.generation, Generation(old.generation.0 + 1));

    let k = values(1, 0.0);
    let err = second.write(old, 0, 0..1, &k, &k).unwrap_err();
    assert_eq!(
        err,
        PoolError::StaleGeneration {
            page: old.id,
            got: old.generation,
            current: current.generation
        }
    );
    assert_eq!(pool.stats().stale_writes_rejected, 1);
    assert!(
        second.read_layer::<f32>(0, 1).is_err(),
        "the refused write must not land"
    );
}

#[test]
fn i1_write_to_page_outside_the_lease_is_rejected_and_counted() {
    let pool = pool(2);
    let mut mine = pool.lease(RequestId(1), 4).unwrap();
    let theirs = pool.lease(RequestId(2), 4).unwrap();
    let k = values(1, 0.0);
    // The other lease's exact, current fencing token: ownership must still stop it.
    let err = mine.write(theirs.pages()[0], 0, 0..1, &k, &k).unwrap_err();
    assert_eq!(
        err,
        PoolError::PageNotInLease {
            page: theirs.pages()[0].id,
            owner: RequestId(1)
        }
    );
    let outside = PageRef {
        id: PageId(99),
        generation: Generation(1),
    };
    assert!(matches!(
        mine.write(outside, 0, 0..1, &k, &k),
        Err(PoolError::PageNotInLease { .. })
    ));
    assert_eq!(pool.stats().foreign_writes_rejected, 2);
    assert!(
        theirs.read_layer::<f32>(0, 1).is_err(),
        "nothing landed in the other lease"
    );
}

#[test]
fn i2_read_past_coverage_is_refused_and_counted() {
    let pool = pool(2);
    let mut lease = pool.lease(RequestId(1), 12).unwrap();
    let k = values(10, 0.0);
    lease.write_positions(0, 0, &k, &k).unwrap();
    assert_eq!(lease.read_layer::<f32>(0, 10).unwrap().len(), 10);
    assert_eq!(
        lease.read_layer::<f32>(0, 11).unwrap_err(),
        PoolError::NotCovered {
            len: 11,
            layer: 0,
            position: 10
        }
    );
    // Layer 1 was never written: a whole-model view is refused.
    assert_eq!(
        lease.read_view::<f32>(1).unwrap_err(),
        PoolError::NotCovered {
            len: 1,
            layer: 1,
            position: 0
        }
    );
    assert_eq!(pool.stats().reads_refused, 2);
}

#[test]
fn i2_gap_in_the_middle_of_written_positions_is_refused() {
    let pool = pool(2);
    let mut lease = pool.lease(RequestId(1), 16).unwrap();
    let k = values(4, 0.0);
    lease.write_positions(0, 0, &k, &k).unwrap();
    lease.write_positions(0, 5, &k, &k).unwrap();
    assert_eq!(
        lease.read_layer::<f32>(0, 9).unwrap_err(),
        PoolError::NotCovered {
            len: 9,
            layer: 0,
            position: 4
        }
    );
}

#[test]
fn read_beyond_the_lease_is_refused() {
    let pool = pool(4);
    let lease = pool.lease(RequestId(1), 8).unwrap();
    assert_eq!(
        lease.read_layer::<f32>(0, 9).unwrap_err(),
        PoolError::BeyondLease {
            owner: RequestId(1),
            end: 9,
            capacity: 8
        }
    );
}

#[test]
fn i2_next_tenant_cannot_read_what_the_previous_one_wrote() {
    let pool = pool(1);
    let mut first = pool.lease(RequestId(1), PAGE).unwrap();
    fill(&mut first, PAGE, 1000.0);
    drop(first);
    let mut second = pool.lease(RequestId(2), PAGE).unwrap();
    assert!(matches!(
        second.read_view::<f32>(1),
        Err(PoolError::NotCovered { .. })
    ));
    // Writing one slot opens exactly that slot, with the new values.
    let k = values(1, 7.0);
    for layer in 0..SHAPE.layers {
        second.write_positions(layer, 0, &k, &k).unwrap();
    }
    let view = second.read_view::<f32>(1).unwrap();
    assert_eq!(view.keys(0, 0, 0).to_rows(), &k[..4]);
    // Keys are stored as columns, each spanning the page: every column
    // handed out holds the one written slot and none of the first
    // tenant's.
    let keys = view.keys(0, 0, 0);
    assert!(keys.columns().all(|column| column.len() == 1));
    assert_eq!(
        keys.columns().map(|column| column[0]).collect::<Vec<_>>(),
        &k[..4]
    );
    drop(view);
    assert!(second.read_view::<f32>(2).is_err());
}

#[test]
fn lease_larger_than_the_whole_pool_is_refused_and_allocates_nothing() {
    let pool = pool(4);
    let err = pool.lease(RequestId(7), 33).unwrap_err();
    assert_eq!(
        err,
        PoolError::LargerThanPool {
            owner: RequestId(7),
            needed: 33,
            capacity: 32
        }
    );
    let message = err.to_string();
    assert!(
        message.contains("33") && message.contains("32"),
        "{message}"
    );
    let stats = pool.stats();
    assert_eq!(
        (stats.free_pages, stats.leased_pages, stats.leases_refused),
        (4, 0, 1)
    );
}

#[test]
fn exhausted_pool_refuses_and_allocates_nothing() {
    let pool = pool(4);
    let held = pool.lease(RequestId(1), 24).unwrap();
    let err = pool.lease(RequestId(2), 9).unwrap_err();
    assert_eq!(
        err,
        PoolError::Exhausted {
            owner: RequestId(2),
            needed_pages: 2,
            free_pages: 1
        }
    );
    assert_eq!(pool.stats().free_pages, 1, "a refused lease takes nothing");
    drop(held);
    assert!(
        pool.lease(RequestId(2), 9).is_ok(),
        "room again once the holder is gone"
    );
}

#[test]
fn empty_lease_is_refused() {
    assert_eq!(
        pool(1).lease(RequestId(3), 0).unwrap_err(),
        PoolError::EmptyLease {
            owner: RequestId(3)
        }
    );
}

#[test]
fn i8_dropping_a_lease_returns_every_page() {
    let pool = pool(4);
    let lease = pool.lease(RequestId(1), 30).unwrap();
    assert_eq!(pool.stats().leased_pages, 4);
    drop(lease);
    let stats = pool.stats();
    assert_eq!((stats.free_pages, stats.leased_pages), (4, 0));
}

#[test]
fn generation_grows_every_time_a_page_is_leased() {
    let pool = pool(1);
    let mut last = Generation(0);
    for owner in 1..=5 {
        let lease = pool.lease(RequestId(owner), 1).unwrap();
        assert!(lease.pages()[0].generation > last);
        last = lease.pages()[0].generation;
    }
}

#[test]
fn i4_one_sided_pages_stay_quarantined_until_drained() {
    let pool = pool(2);
    let mut lease = pool.lease(RequestId(5), 16).unwrap();
    let pages = lease.pages().to_vec();
    lease.expose_to_one_sided_writer();
    drop(lease);
    for page in &pages {
        assert_eq!(
            pool.page_state(page.id),
            Some(PageState::Quarantined {
                owner: RequestId(5),
                generation: page.generation
            })
        );
    }
    assert!(
        matches!(
            pool.lease(RequestId(6), 1),
            Err(PoolError::Exhausted { .. })
        ),
        "quarantined pages are not leasable"
    );
    assert_eq!(pool.stats().quarantined_pages, 2);
    assert_eq!(pool.quarantined_owners(), vec![RequestId(5)]);

    assert_eq!(pool.drain(RequestId(5)), Ok(2));
    assert_eq!(pool.stats().free_pages, 2);
    assert_eq!(pool.stats().pages_quarantined_total, 2);
    assert_eq!(
        pool.drain(RequestId(5)),
        Err(PoolError::NothingQuarantined {
            owner: RequestId(5)
        })
    );
}

#[test]
fn capacity_reports_whole_pages_actually_allocated() {
    // One page: 2 layers * 2 (K,V) * 2 heads * 8 slots * 4 dims * 4 bytes = 1024 bytes.
    let by_bytes = PoolSpec::new(SHAPE, PAGE, ElemType::F32, PoolSize::Bytes(3000));
    assert_eq!(
        Pool::new(&by_bytes).unwrap().capacity_tokens(),
        16,
        "2 whole pages fit in 3000 bytes"
    );
    let by_tokens = PoolSpec::new(SHAPE, PAGE, ElemType::F16, PoolSize::Tokens(17));
    assert_eq!(
        Pool::new(&by_tokens).unwrap().capacity_tokens(),
        24,
        "rounds up to whole pages"
    );
    let too_small = PoolSpec::new(SHAPE, PAGE, ElemType::F32, PoolSize::Bytes(1000));
    assert!(matches!(
        Pool::new(&too_small),
        Err(PoolError::InvalidSpec { .. })
    ));
    let no_heads = PoolSpec::new(
        KvShape {
            kv_heads: 0,
            ..SHAPE
        },
        PAGE,
        ElemType::F32,
        PoolSize::Pages(1),
    );
    assert!(matches!(
        Pool::new(&no_heads),
        Err(PoolError::InvalidSpec { .. })
    ));
}

#[test]
fn malformed_writes_are_refused_without_effect() {
    let pool = pool(2);
    let mut lease = pool.lease(RequestId(1), 16).unwrap();
    let page = lease.pages()[0];
    let k = values(1, 0.0);
    assert!(matches!(
        lease.write(page, 2, 0..1, &k, &k),
        Err(PoolError::LayerOutOfRange {
            layer: 2,
            layers: 2
        })
    ));
    assert!(matches!(
        lease.write(page, 0, 7..9, &k, &k),
        Err(PoolError::SlotsOutOfRange { .. })
    ));
    assert!(matches!(
        lease.write(page, 0, 3..3, &k, &k),
        Err(PoolError::SlotsOutOfRange { .. })
    ));
    assert!(matches!(
        lease.write(page, 0, 0..2, &k, &k),
        Err(PoolError::ShapeMismatch {
            expected: 16,
            got: 8
        })
    ));
    let halves = vec![half::f16::ZERO; PER_TOKEN];
    assert!(matches!(
        lease.write(page, 0, 0..1, &halves, &halves),
        Err(PoolError::ElemMismatch { .. })
    ));
    assert!(matches!(
        lease.write_positions(0, 15, &values(2, 0.0), &values(2, 0.0)),
        Err(PoolError::BeyondLease { .. })
    ));
    assert!(lease.read_layer::<f32>(0, 1).is_err(), "nothing landed");
}

#[test]
fn writes_across_page_boundaries_land_in_token_order() {
    let pool = Pool::new(
        &PoolSpec::new(SHAPE, PAGE, ElemType::F32, PoolSize::Pages(3)).with_scrub(Scrub::Zero),
    )
    .unwrap();
    let mut lease = pool.lease(RequestId(1), 20).unwrap();
    let k = values(20, 0.0);
    let v: Vec<f32> = k.iter().map(|x| -x).collect();
    lease
        .write_positions(1, 0, &k[..5 * PER_TOKEN], &v[..5 * PER_TOKEN])
        .unwrap();
    lease
        .write_positions(1, 5, &k[5 * PER_TOKEN..], &v[5 * PER_TOKEN..])
        .unwrap();
    let view = lease.read_layer::<f32>(1, 20).unwrap();
    assert_eq!(view.num_pages(), 3);
    assert_eq!(view.slots_in_page(2), 4);
    for pos in 0..20 {
        for head in 0..2 {
            let (page, slot) = (pos / PAGE, pos % PAGE);
            let want = &k[pos * PER_TOKEN + head * 4..][..4];
            assert_eq!(&view.keys(page, 1, head).to_rows()[slot * 4..][..4], want);
            let want_v = &v[pos * PER_TOKEN + head * 4..][..4];
            assert_eq!(&view.values(page, 1, head)[slot * 4..][..4], want_v);
        }
    }
}

#[test]
fn raw_export_and_fenced_raw_import_move_kv_between_pools_exactly() {
    let source = pool(2);
    let target = pool(2);
    let mut from = source.lease(RequestId(1), 12).unwrap();
    fill(&mut from, 12, 3.0);
    let mut to = target.lease(RequestId(2), 12).unwrap();
    let view = from.read_view::<f32>(12).unwrap();
    for (index, page) in to.pages().to_vec().into_iter().enumerate() {
        let slots = 0..view.slots_in_page(index);
        to.write_slots_raw(page, slots.clone(), &view.export_slots(index, slots))
            .unwrap();
    }
    let copied = to.read_view::<f32>(12).unwrap();
    for page in 0..2 {
        for layer in 0..SHAPE.layers {
            for head in 0..SHAPE.kv_heads {
                assert_eq!(
                    copied.keys(page, layer, head).to_rows(),
                    view.keys(page, layer, head).to_rows()
                );
                assert_eq!(
                    copied.values(page, layer, head),
                    view.values(page, layer, head)
                );
            }
        }
    }
    drop(copied);
    // The same bytes under a stale token, or into someone else's page, never land.
    let bytes = view.export_slots(0, 0..1);
    let stale = PageRef {
        id: to.pages()[0].id,
        generation: Generation(0),
    };
    assert!(matches!(
        to.write_slots_raw(stale, 0..1, &bytes),
        Err(PoolError::StaleGeneration { .. })
    ));
    assert!(matches!(
        to.write_slots_raw(to.pages()[0], 0..2, &bytes),
        Err(PoolError::ShapeMismatch { .. })
    ));
}

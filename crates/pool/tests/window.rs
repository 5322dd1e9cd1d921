//! One-sided write windows (I4): pages a one-sided writer may still reach
//! are never reused before the window is revoked and drained.

#![allow(clippy::unwrap_used)]

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use kvfence_pool::{ElemType, KvShape, PageState, Pool, PoolError, PoolSize, PoolSpec, RequestId};

const SHAPE: KvShape = KvShape {
    layers: 2,
    kv_heads: 1,
    head_dim: 4,
};
const PAGE: usize = 4;
/// Bytes of one full page: layers * (K, V) * kv heads * slots * head dim * 4 bytes.
const PAGE_BYTES: usize = SHAPE.layers * 2 * SHAPE.kv_heads * PAGE * SHAPE.head_dim * 4;

fn pool(pages: usize) -> Pool {
    Pool::new(&PoolSpec::new(
        SHAPE,
        PAGE,
        ElemType::F32,
        PoolSize::Pages(pages),
    ))
    .unwrap()
}

#[test]
fn i4_an_exposed_lease_is_quarantined_until_its_window_drains() {
    let pool = pool(2);
    let mut lease = pool.lease(RequestId(1), 8).unwrap();
    let window = lease.open_window();
    let key = window.key();
    window.write(key, 0, 0..PAGE, &[7u8; PAGE_BYTES]).unwrap();
    assert!(
        lease.check_covered(PAGE).is_ok(),
        "one-sided writes count as written"
    );
    drop(lease);
    let ids: Vec<_> = (0..2u32).map(kvfence_pool::PageId).collect();
    for id in &ids {
        assert!(matches!(
            pool.page_state(*id),
            Some(PageState::Quarantined {
                owner: RequestId(1),
                ..
            })
        ));
    }
    assert!(
        matches!(
            pool.lease(RequestId(2), 1),
            Err(PoolError::Exhausted { .. })
        ),
        "I4: not reusable yet"
    );
    assert_eq!(window.release(), Ok(2));
    assert_eq!(pool.stats().free_pages, 2);
}

#[test]
fn i3_a_write_through_a_revoked_window_is_refused_and_counted() {
    let pool = pool(1);
    let mut lease = pool.lease(RequestId(1), 4).unwrap();
    let window = lease.open_window();
    let key = window.key();
    window.revoke();
    assert_eq!(
        window.write(key, 0, 0..PAGE, &[1u8; PAGE_BYTES]),
        Err(PoolError::WindowRevoked {
            owner: RequestId(1)
        })
    );
    assert_eq!(pool.stats().stale_writes_rejected, 1);
    assert!(lease.check_covered(1).is_err(), "nothing landed");
    // A new key does not revive an old writer's token.
    assert!(
        window
            .write(key, 0, 0..1, &[1u8; PAGE_BYTES / PAGE])
            .is_err()
    );
}

#[test]
fn closing_a_drained_window_returns_the_lease_to_ordinary_release() {
    let pool = pool(1);
    let mut lease = pool.lease(RequestId(1), 4).unwrap();
    let window = lease.open_window();
    window
        .write(window.key(), 0, 0..2, &[3u8; PAGE_BYTES / 2])
        .unwrap();
    lease.close_window(&window).unwrap();
    drop(lease);
    assert_eq!(
        pool.stats().free_pages,
        1,
        "no quarantine after a clean close"
    );
}

#[test]
fn i4_no_write_lands_after_revoke_and_drain_even_under_contention() {
    for round in 0..50u64 {
        let pool = pool(1);
        let mut lease = pool.lease(RequestId(round), 4).unwrap();
        let window = lease.open_window();
        let key = window.key();
        let stop = Arc::new(AtomicBool::new(false));
        let landed = Arc::new(AtomicU64::new(0));
        let writer = {
            let (window, stop, landed) = (window.clone(), Arc::clone(&stop), Arc::clone(&landed));
            std::thread::spawn(move || {
                let mut n = 0u8;
                while !stop.load(Ordering::Relaxed) {
                    n = n.wrapping_add(1);
                    if window.write(key, 0, 0..PAGE, &[n; PAGE_BYTES]).is_ok() {
                        landed.fetch_add(1, Ordering::Relaxed);
                    }
                }
            })
        };
        while landed.load(Ordering::Relaxed) < 3 {
            std::hint::spin_loop();
        }
        window.revoke();
        while !window.is_drained() {
            std::hint::spin_loop();
        }
        let snapshot = lease.read_view_raw(PAGE).unwrap().export_slots(0, 0..PAGE);
        std::thread::sleep(std::time::Duration::from_millis(2));
        stop.store(true, Ordering::Relaxed);
        writer.join().unwrap();
        // Every write changes the bytes, so equal bytes mean nothing landed
        // after the drain. (The `landed` counter may trail a write that
        // finished before the drain, so it is no evidence either way.)
        assert_eq!(
            lease.read_view_raw(PAGE).unwrap().export_slots(0, 0..PAGE),
            snapshot,
            "a write landed after the window drained"
        );
        drop(lease);
        assert_eq!(window.release(), Ok(1));
    }
}

proptest::proptest! {
    #![proptest_config(proptest::prelude::ProptestConfig::with_cases(200))]

    /// A chunk handed over as pieces cut anywhere (the sender's page runs,
    /// say) lands exactly as the same chunk in one slice: the same bytes in
    /// the same places of the page, and nothing else touched.
    #[test]
    fn a_chunk_cut_anywhere_lands_as_the_same_bytes(
        start in 0..PAGE,
        width in 1..=PAGE,
        cuts in proptest::collection::vec(0..PAGE_BYTES, 0..12),
        seed in proptest::prelude::any::<u8>(),
    ) {
        let slots = start..(start + width).min(PAGE);
        let len = PAGE_BYTES / PAGE * slots.len();
        let chunk: Vec<u8> = (0..len).map(|i| (i as u8).wrapping_mul(31) ^ seed).collect();
        let mut cuts: Vec<usize> = cuts.into_iter().map(|c| c % (len + 1)).collect();
        cuts.extend([0, len]);
        cuts.sort_unstable();
        let pieces = cuts.windows(2).map(|w| &chunk[w[0]..w[1]]);

        let pool = pool(2);
        let mut lease = pool.lease(RequestId(1), 2 * PAGE).unwrap();
        let window = lease.open_window();
        let key = window.key();
        let background = [0xA5u8; PAGE_BYTES];
        for page in 0..2 {
            window.write(key, page, 0..PAGE, &background).unwrap();
        }
        window.write(key, 0, slots.clone(), &chunk).unwrap();
        window.write_runs(key, 1, slots.clone(), pieces).unwrap();
        lease.close_window(&window).unwrap();

        let view = lease.read_view_raw(2 * PAGE).unwrap();
        proptest::prop_assert_eq!(view.export_slots(1, 0..PAGE), view.export_slots(0, 0..PAGE));
        proptest::prop_assert_eq!(&view.export_slots(1, slots.clone()), &chunk);
        let joined: Vec<u8> = view.slot_runs(1, slots.clone()).flatten().copied().collect();
        proptest::prop_assert_eq!(joined, view.export_slots(1, slots.clone()));
        drop(view);

        // And where the model reads them: run `(layer, K|V, head)` of the
        // chunk is those slots of that head's keys or values.
        let view = lease.read_view::<f32>(2 * PAGE).unwrap();
        let run = slots.len() * SHAPE.head_dim;
        let mut runs = chunk.chunks_exact(run * 4);
        for layer in 0..SHAPE.layers {
            for kv in 0..2 {
                for head in 0..SHAPE.kv_heads {
                    // Keys travel as the slots of one dimension after
                    // another, values as the slots' rows.
                    let stored: Vec<f32> = if kv == 0 {
                        let keys = view.keys(1, layer, head);
                        keys.columns().flat_map(|column| &column[slots.clone()]).copied().collect()
                    } else {
                        view.values(1, layer, head)[slots.start * SHAPE.head_dim..][..run].to_vec()
                    };
                    let sent: Vec<f32> = runs
                        .next()
                        .unwrap()
                        .chunks_exact(4)
                        .map(|b| f32::from_ne_bytes(b.try_into().unwrap()))
                        .collect();
                    proptest::prop_assert_eq!(
                        stored.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                        sent.iter().map(|v| v.to_bits()).collect::<Vec<_>>()
                    );
                }
            }
        }
    }
}

#[test]
fn a_chunk_of_the_wrong_length_is_refused_before_any_byte_lands() {
    let pool = pool(1);
    let mut lease = pool.lease(RequestId(1), PAGE).unwrap();
    let window = lease.open_window();
    let chunk = [9u8; PAGE_BYTES];
    for runs in [
        vec![&chunk[..PAGE_BYTES - 1]],
        vec![&chunk[..], &chunk[..1]],
        vec![&chunk[..8], &chunk[8..16]],
    ] {
        let got: usize = runs.iter().map(|r| r.len()).sum();
        assert_eq!(
            window.write_runs(window.key(), 0, 0..PAGE, runs.into_iter()),
            Err(PoolError::ShapeMismatch {
                expected: PAGE_BYTES,
                got
            })
        );
    }
    assert!(
        lease.check_covered(1).is_err(),
        "nothing was marked written"
    );
    lease.close_window(&window).unwrap();
}

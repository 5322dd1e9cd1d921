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

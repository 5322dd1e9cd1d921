//! The one-sided (shared-memory) hand-off: the writer stores KV straight into
//! the receiver's pages through a window. Commit needs the same proofs as
//! two-sided; an abort or failure quarantines the pages until the writer
//! acknowledges and the window drains (I4), and never frees them earlier.

#![allow(clippy::unwrap_used)]

use kvfence_handoff::{
    Grant, HandoffError, HandoffId, Message, Outcome, Receiver, send_kv_one_sided,
};
use kvfence_pool::{
    ElemType, KvShape, Lease, Pool, PoolError, PoolSize, PoolSpec, RequestId, Window,
};

const SHAPE: KvShape = KvShape {
    layers: 2,
    kv_heads: 2,
    head_dim: 4,
};
const PAGE: usize = 4;
const TOKENS: usize = 10;
const ID: HandoffId = HandoffId(3);

fn pool(pages: usize) -> Pool {
    Pool::new(&PoolSpec::new(
        SHAPE,
        PAGE,
        ElemType::F32,
        PoolSize::Pages(pages),
    ))
    .unwrap()
}

fn source(prefill: &Pool) -> Lease {
    let mut lease = prefill.lease(RequestId(1), TOKENS).unwrap();
    for layer in 0..SHAPE.layers {
        let k: Vec<f32> = (0..TOKENS * 8).map(|i| (layer * 100 + i) as f32).collect();
        lease.write_positions(layer, 0, &k, &k).unwrap();
    }
    lease
}

impl Setup {
    /// The key the writer was handed with the grant.
    fn grant_key(&self) -> kvfence_pool::WindowKey {
        self.key
    }
}

struct Setup {
    key: kvfence_pool::WindowKey,
    decode: Pool,
    receiver: Receiver,
    grant: Grant,
    window: Window,
    source: Lease,
    _prefill: Pool,
}

fn setup() -> Setup {
    let (prefill, decode) = (pool(4), pool(4));
    let mut receiver = Receiver::new();
    let lease = decode.lease(RequestId(ID.0), TOKENS + 2).unwrap();
    let (grant, window) = receiver.grant_one_sided(ID, lease, TOKENS).unwrap();
    let grant = Grant::from_message(&grant).unwrap();
    let key = window.key();
    Setup {
        key,
        source: source(&prefill),
        _prefill: prefill,
        decode,
        receiver,
        grant,
        window,
    }
}

#[test]
fn a_one_sided_transfer_commits_and_then_releases_normally() {
    let mut s = setup();
    let proof = send_kv_one_sided(&s.grant, &s.source, &s.window, s.key).unwrap();
    let Outcome::Committed(committed) = s.receiver.handle(proof.done(5, 0)) else {
        panic!("no commit")
    };
    let lease = committed.into_lease();
    assert_eq!(
        lease
            .read_view::<f32>(TOKENS)
            .unwrap()
            .keys(2, 1, 1)
            .to_rows(),
        s.source
            .read_view::<f32>(TOKENS)
            .unwrap()
            .keys(2, 1, 1)
            .to_rows()
    );
    // The window closed at commit: the writer's key no longer opens it.
    let bytes = s
        .source
        .read_view_raw(TOKENS)
        .unwrap()
        .export_slots(0, 0..PAGE);
    assert!(matches!(
        s.window.write(s.grant_key(), 0, 0..PAGE, &bytes),
        Err(PoolError::WindowRevoked { .. })
    ));
    drop(lease);
    assert_eq!(
        s.decode.stats().free_pages,
        4,
        "no quarantine after a clean commit"
    );
}

#[test]
fn i4_abort_mid_transfer_quarantines_the_pages_until_the_writer_acks() {
    let mut s = setup();
    let key = s.window.key();
    let bytes = s
        .source
        .read_view_raw(TOKENS)
        .unwrap()
        .export_slots(0, 0..PAGE);
    s.window.write(key, 0, 0..PAGE, &bytes).unwrap();
    let Some(Message::Abort { id, epoch }) = s.receiver.abort(ID) else {
        panic!("no abort")
    };
    let stats = s.decode.stats();
    assert_eq!(
        (stats.quarantined_pages, stats.free_pages),
        (3, 1),
        "I4: not free before the ack"
    );
    assert!(
        matches!(
            s.decode.lease(RequestId(50), 13),
            Err(PoolError::Exhausted { .. })
        ),
        "pages not reusable"
    );
    // The writer's late write is refused by the revoked window.
    assert!(matches!(
        s.window.write(key, 1, 0..PAGE, &bytes),
        Err(PoolError::WindowRevoked { .. })
    ));
    assert!(s.decode.stats().stale_writes_rejected >= 1);
    let outcome = s.receiver.handle(Message::AbortAck { id, epoch });
    assert!(
        matches!(outcome, Outcome::Released { pages: 3, .. }),
        "{outcome:?}"
    );
    assert_eq!(s.decode.stats().free_pages, 4);
    assert_eq!(s.receiver.draining(), 0);
}

#[test]
fn i4_a_writer_that_never_acks_leaves_its_pages_quarantined() {
    let mut s = setup();
    s.receiver.abort(ID).unwrap();
    for _ in 0..3 {
        assert!(matches!(
            s.receiver.handle(Message::Done {
                id: ID,
                epoch: s.grant.epoch,
                tokens: TOKENS as u32,
                digest: 0,
                first_token: 0,
                cached: 0,
                first_logprobs: Vec::new(),
                prompt_logprobs: Vec::new(),
            }),
            Outcome::Ignored
        ));
    }
    let stats = s.decode.stats();
    assert_eq!(
        stats.quarantined_pages, 3,
        "quarantined, counted, never silently freed"
    );
    assert_eq!(s.receiver.draining(), 1);
}

#[test]
fn i7_a_one_sided_done_over_missing_pages_fails_and_quarantines() {
    let mut s = setup();
    let key = s.window.key();
    let view = s.source.read_view_raw(TOKENS).unwrap();
    s.window
        .write(key, 0, 0..PAGE, &view.export_slots(0, 0..PAGE))
        .unwrap();
    drop(view);
    let done = Message::Done {
        id: ID,
        epoch: s.grant.epoch,
        tokens: TOKENS as u32,
        digest: 1,
        first_token: 0,
        cached: 0,
        first_logprobs: Vec::new(),
        prompt_logprobs: Vec::new(),
    };
    let Outcome::Failed { error, reply, .. } = s.receiver.handle(done) else {
        panic!("committed over missing pages")
    };
    assert!(
        matches!(error, HandoffError::Pool(PoolError::NotCovered { .. })),
        "{error}"
    );
    assert!(
        matches!(reply, Some(Message::Abort { .. })),
        "the writer is asked to stop and ack"
    );
    // The receiver closed the window (revoked and drained) before checking,
    // so no write can still arrive: freeing at once is safe (I4).
    assert_eq!((s.decode.stats().free_pages, s.receiver.draining()), (4, 0));
}

#[test]
fn i5_a_placeholder_done_fails_a_one_sided_grant_too() {
    let mut s = setup();
    let done = Message::Done {
        id: ID,
        epoch: s.grant.epoch,
        tokens: 1,
        digest: 0,
        first_token: 0,
        cached: 0,
        first_logprobs: Vec::new(),
        prompt_logprobs: Vec::new(),
    };
    assert!(matches!(
        s.receiver.handle(done),
        Outcome::Failed {
            error: HandoffError::TokenCountMismatch { .. },
            ..
        }
    ));
}

#[test]
fn a_reject_from_a_one_sided_writer_releases_the_drained_pages() {
    let mut s = setup();
    let outcome = s.receiver.handle(Message::Reject {
        id: ID,
        reason: kvfence_handoff::RejectReason::TooLong,
    });
    assert!(matches!(
        outcome,
        Outcome::Failed {
            error: HandoffError::Rejected { .. },
            ..
        }
    ));
    assert_eq!(
        s.decode.stats().free_pages,
        4,
        "the writer stopped and nothing was in flight"
    );
}

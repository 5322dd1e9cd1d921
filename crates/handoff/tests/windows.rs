//! The hand-off between pools of several layer groups, where some layers
//! attend through a sliding window: the receiver grants each group the
//! pages its first pass reads — every prompt page of the global layers,
//! only the window of the others — so the positions behind a window never
//! cross the link, and the commit still proves every granted slot of every
//! group (I2, I5, I7). A sender whose layers are grouped otherwise is
//! refused before a byte moves; both pools return to baseline (I8).

// In a test, a panic is the failure report.
#![allow(clippy::unwrap_used)]

use kvfence_handoff::{
    Chunks, Grant, HandoffError, HandoffId, Message, Outcome, Receiver, Streaming, send_kv,
};
use kvfence_pool::{
    ElemType, KvShape, LayerGroups, Lease, Pool, PoolError, PoolSize, PoolSpec, RequestId,
};

const LAYERS: usize = 4;
const SHAPE: KvShape = KvShape {
    layers: LAYERS,
    kv_heads: 1,
    head_dim: 2,
};
const PAGE: usize = 4;
const WINDOW: usize = 6;
const ALIGN: usize = 2;
const STEP: usize = 4;
/// Prompt positions: six pages, of which a pass at 22 reads, in a
/// windowed layer, from align_down(22 + 1 − 6, 2) = 16 on: pages 4 and 5.
const TOKENS: usize = 22;
const ID: HandoffId = HandoffId(3);

/// Layers 0 and 2 attend through the window, 1 and 3 to everything.
fn windowed() -> LayerGroups {
    LayerGroups::of_windows(&[Some(WINDOW), None, Some(WINDOW), None], ALIGN, STEP).unwrap()
}

fn pool(groups: LayerGroups) -> Pool {
    Pool::new(
        &PoolSpec::new(SHAPE, PAGE, ElemType::F32, PoolSize::Pages(64)).with_layer_groups(groups),
    )
    .unwrap()
}

fn wire(message: &Message) -> Message {
    let frame = message.to_frame();
    Message::decode(&frame).unwrap().unwrap().0
}

/// What the prompt's KV is at `position` of `layer`.
fn value(layer: usize, position: usize) -> [f32; 2] {
    let base = (layer * 1000 + position) as f32;
    [base, -base]
}

/// Writes positions `start..end` of every layer, as a prefill step does
/// (a windowed group slides as it is written).
fn write(lease: &mut Lease, start: usize, end: usize) -> Result<(), PoolError> {
    for layer in 0..LAYERS {
        let values: Vec<f32> = (start..end).flat_map(|p| value(layer, p)).collect();
        lease.write_positions(layer, start, &values, &values)?;
    }
    Ok(())
}

/// A prefill lease of `prefill` holding `tokens` prompt positions, written
/// a step at a time.
fn prefilled(prefill: &Pool, tokens: usize) -> Lease {
    let mut source = prefill.lease(RequestId(1), tokens).unwrap();
    for start in (0..tokens).step_by(STEP) {
        write(&mut source, start, (start + STEP).min(tokens)).unwrap();
    }
    source
}

/// A decode lease granted TOKENS prompt positions, and the grant.
fn granted(decode: &Pool, receiver: &mut Receiver) -> Grant {
    granted_of(decode, receiver, TOKENS)
}

/// A decode lease granted `tokens` prompt positions, and the grant.
fn granted_of(decode: &Pool, receiver: &mut Receiver, tokens: usize) -> Grant {
    let reservation = decode.lease(RequestId(100), tokens + 2).unwrap();
    Grant::from_message(&wire(&receiver.grant(ID, reservation, tokens).unwrap())).unwrap()
}

/// What the lease's next pass, at `past`, reads of every layer is the
/// prompt's KV.
fn reads_the_prompt(lease: &Lease, past: usize) {
    for layer in 0..LAYERS {
        let start = lease.read_start(layer, past);
        let view = lease.read_layer_from::<f32>(layer, start, past).unwrap();
        for p in view.first_page() * PAGE..past {
            let (page, slot) = (p / PAGE, p % PAGE);
            assert_eq!(
                view.keys(page, layer, 0).to_rows()[slot * 2..slot * 2 + 2],
                value(layer, p),
                "layer {layer} position {p}"
            );
        }
    }
}

fn at_baseline(pool: &Pool) -> bool {
    let stats = pool.stats();
    (stats.leased_pages, stats.quarantined_pages) == (0, 0)
}

#[test]
fn only_the_window_crosses_the_link_and_the_commit_reads_exactly_the_prompt() {
    let (prefill, decode) = (pool(windowed()), pool(windowed()));
    let mut receiver = Receiver::new();
    let grant = granted(&decode, &mut receiver);
    let firsts: Vec<u32> = grant.groups.iter().map(|g| g.first_page).collect();
    let pages: Vec<usize> = grant.groups.iter().map(|g| g.pages.len()).collect();
    assert_eq!(firsts, [0, 4], "the window's group is granted from page 4");
    assert_eq!(pages, [6, 2], "every prompt page, and the window's two");

    // The prefill streams as it computes, and its own window slides: the
    // pages the grant names are never behind it.
    let mut source = prefill.lease(RequestId(1), TOKENS).unwrap();
    let mut streaming = Streaming::new(grant.clone());
    let mut sent = Vec::new();
    for start in (0..TOKENS).step_by(STEP) {
        let end = (start + STEP).min(TOKENS);
        write(&mut source, start, end).unwrap();
        streaming
            .send_ready(&source, end, &mut Chunks::new(&grant, |m| sent.push(m)))
            .unwrap();
    }
    assert_eq!(source.group_first_position(1), 12, "the source slid too");
    let proof = streaming
        .finish(&source, &mut Chunks::new(&grant, |m| sent.push(m)))
        .unwrap();
    assert_eq!(
        sent.len(),
        8,
        "six pages of the global layers, two of the window"
    );
    for chunk in sent {
        assert!(matches!(receiver.handle(wire(&chunk)), Outcome::Accepted));
    }
    let Outcome::Committed(committed) = receiver.handle(wire(&proof.done(9, 0))) else {
        panic!("no commit")
    };
    // A page: two layers' K and V of one head of two f32s, four slots.
    let slot_bytes = (2 * 2 * SHAPE.kv_heads * SHAPE.head_dim * 4) as u64;
    assert_eq!(
        receiver.stats().bytes,
        (8 * PAGE as u64 - 2 * 2) * slot_bytes,
        "eight pages, the last of each group two slots short"
    );
    let mut lease = committed.into_lease();
    reads_the_prompt(&lease, TOKENS);
    // Behind the window nothing is held: a read there is refused (I7).
    assert!(matches!(
        lease.read_layer_from::<f32>(0, 0, TOKENS),
        Err(PoolError::Released { .. })
    ));
    // Decoding goes on from the prompt's end as on a colocated worker.
    write(&mut lease, TOKENS, TOKENS + 1).unwrap();
    reads_the_prompt(&lease, TOKENS + 1);
    drop((lease, source));
    assert!(at_baseline(&prefill) && at_baseline(&decode), "I8");
}

#[test]
fn i5_a_source_whose_window_lacks_a_granted_position_produces_no_done() {
    let (prefill, decode) = (pool(windowed()), pool(windowed()));
    let mut receiver = Receiver::new();
    let grant = granted(&decode, &mut receiver);
    let mut source = prefill.lease(RequestId(1), TOKENS).unwrap();
    for start in (0..TOKENS - 2).step_by(STEP) {
        write(&mut source, start, (start + STEP).min(TOKENS - 2)).unwrap();
    }
    // The global layers of the last two positions, not the windowed ones.
    for layer in [1, 3] {
        let values: Vec<f32> = (TOKENS - 2..TOKENS).flat_map(|p| value(layer, p)).collect();
        source
            .write_positions(layer, TOKENS - 2, &values, &values)
            .unwrap();
    }
    let error = send_kv(&grant, &source, |_| {}).unwrap_err();
    assert!(
        matches!(error, HandoffError::SourceIncomplete { need: TOKENS, have, .. } if have == TOKENS - 2),
        "{error}"
    );
}

#[test]
fn i7_done_before_the_windows_pages_arrived_fails_and_frees_them() {
    let (prefill, decode) = (pool(windowed()), pool(windowed()));
    let mut receiver = Receiver::new();
    let grant = granted(&decode, &mut receiver);
    let source = prefilled(&prefill, TOKENS);
    let mut sent = Vec::new();
    let proof = send_kv(&grant, &source, |m| sent.push(m)).unwrap();
    // Every chunk of the global layers, none of the window's.
    let global: Vec<_> = grant.groups[0].pages.iter().map(|p| p.id).collect();
    for chunk in sent {
        if let Message::Chunk { page, .. } = &chunk
            && global.contains(&page.id)
        {
            assert!(matches!(receiver.handle(chunk), Outcome::Accepted));
        }
    }
    let Outcome::Failed { error, .. } = receiver.handle(proof.done(9, 0)) else {
        panic!("committed without the window")
    };
    assert!(
        matches!(
            error,
            HandoffError::Incomplete {
                missing: 2,
                pages: 8,
                ..
            }
        ),
        "{error}"
    );
    drop(source);
    assert!(at_baseline(&prefill) && at_baseline(&decode), "I8");
}

#[test]
fn a_source_whose_layers_are_grouped_otherwise_is_refused_before_a_byte_moves() {
    let decode = pool(windowed());
    let mut receiver = Receiver::new();
    let grant = granted(&decode, &mut receiver);
    // A prefill that keeps every position (one group of four layers a
    // page), and one that groups the same layers in another order.
    let everything = Pool::new(&PoolSpec::new(
        SHAPE,
        PAGE,
        ElemType::F32,
        PoolSize::Pages(64),
    ))
    .unwrap();
    let swapped = pool(
        LayerGroups::of_windows(&[None, Some(WINDOW), None, Some(WINDOW)], ALIGN, STEP).unwrap(),
    );
    for prefill in [everything, swapped] {
        let source = prefilled(&prefill, TOKENS);
        let mut sent = 0;
        let error = send_kv(&grant, &source, |_| sent += 1).unwrap_err();
        assert!(
            matches!(error, HandoffError::LayerGroupsMismatch { .. }),
            "{error}"
        );
        assert_eq!(sent, 0);
    }
}

#[test]
fn a_one_sided_writer_is_not_granted_a_lease_of_several_groups() {
    let decode = pool(windowed());
    let mut receiver = Receiver::new();
    let reservation = decode.lease(RequestId(100), TOKENS).unwrap();
    let error = receiver
        .grant_one_sided(ID, reservation, TOKENS)
        .unwrap_err();
    assert!(
        matches!(error, HandoffError::LayerGroupsMismatch { .. }),
        "{error}"
    );
    assert!(
        at_baseline(&decode),
        "I8: the refused lease's pages are back"
    );
}

/// A prompt many windows long: the decode lease's windowed group, which
/// holds four pages, jumps straight to the window's last pages (page 13 of
/// a 61-token prompt) instead of stopping four pages in; only they cross.
#[test]
fn a_prompt_many_windows_long_is_granted_only_its_last_window() {
    const LONG: usize = 61;
    let (prefill, decode) = (pool(windowed()), pool(windowed()));
    let mut receiver = Receiver::new();
    let grant = granted_of(&decode, &mut receiver, LONG);
    // A pass at 61 reads from align_down(61 + 1 − 6, 2) = 56: page 14.
    let firsts: Vec<u32> = grant.groups.iter().map(|g| g.first_page).collect();
    let pages: Vec<usize> = grant.groups.iter().map(|g| g.pages.len()).collect();
    assert_eq!((firsts, pages), (vec![0, 14], vec![16, 2]));
    let source = prefilled(&prefill, LONG);
    let mut sent = Vec::new();
    let proof = send_kv(&grant, &source, |m| sent.push(m)).unwrap();
    assert_eq!(sent.len(), 18);
    for chunk in sent {
        assert!(matches!(receiver.handle(wire(&chunk)), Outcome::Accepted));
    }
    let Outcome::Committed(committed) = receiver.handle(wire(&proof.done(9, 0))) else {
        panic!("no commit")
    };
    let lease = committed.into_lease();
    reads_the_prompt(&lease, LONG);
    drop((lease, source));
    assert!(at_baseline(&prefill) && at_baseline(&decode), "I8");
}

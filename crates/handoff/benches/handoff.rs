//! What the hand-off's checks cost, against plain copies of the same bytes.
//!
//! Shape: `builtin:small`'s KV (30 layers, 3 KV heads, head dim 64, f32),
//! 16-token pages; one 512-token prompt is 23.6 MB. Compared in one run:
//! - baseline: export each page's bytes and copy them into another pool's
//!   pages with no checks (the least any transfer must do);
//! - two-sided: chunk frames encoded from the source pages (`ChunkFrames`),
//!   decoded in place (`Message::decode_shared`) into a `Receiver` that
//!   checks epoch, grant, generation and checksum, then verifies coverage
//!   and digest at commit: the engine's in-process path, minus the channel;
//! - one-sided: `send_kv_one_sided` through a window, then the commit check
//!   (which re-reads and hashes every page);
//! - the codec alone on one page-sized chunk.
//!
//! The link between processes, TLS and sockets included, is measured in
//! `kvfence-fleet`'s `link` bench.

use std::hint::black_box;
use std::time::Duration;

use bytes::Bytes;
use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use kvfence_handoff::{
    ChunkFrames, FRAME_SHELF_BYTES, FrameShelf, Grant, HandoffId, Message, Outcome, Receiver,
    Streaming, send_kv_one_sided,
};
use kvfence_pool::RequestId;

#[path = "support/prompt.rs"]
mod prompt;
use prompt::{BYTES, TOKENS, pool, source};

/// Hands `frame` to `receiver` as the engine does: decoded in place.
fn receive(receiver: &mut Receiver, frame: Bytes) -> bool {
    let (m, _) = Message::decode_shared(&frame)
        .expect("valid frame")
        .expect("whole frame");
    match receiver.handle(m) {
        Outcome::Committed(c) => {
            black_box(c.into_lease());
            true
        }
        _ => false,
    }
}

fn bench(c: &mut Criterion) {
    let (prefill, decode) = (pool(), pool());
    let src = source(&prefill);
    let shelf = FrameShelf::new(FRAME_SHELF_BYTES);
    let bytes = BYTES as u64;
    let mut group = c.benchmark_group("hand-off 512 tokens");
    group
        .throughput(Throughput::Bytes(bytes))
        .sample_size(20)
        .measurement_time(Duration::from_secs(6));

    group.bench_function("baseline: unchecked page copy", |b| {
        b.iter(|| {
            let mut dst = decode.lease(RequestId(2), TOKENS).expect("room");
            let view = src.read_view_raw(TOKENS).expect("covered");
            let pages = dst.pages().to_vec();
            for (i, page) in pages.into_iter().enumerate() {
                let slots = 0..view.slots_in_page(i);
                dst.write_slots_raw(page, slots.clone(), &view.export_slots(i, slots))
                    .expect("own page");
            }
            black_box(dst)
        })
    });
    group.bench_function("two-sided: chunk frames + every check", |b| {
        let mut receiver = Receiver::new();
        let mut id = 0;
        b.iter(|| {
            id += 1;
            let lease = decode.lease(RequestId(2), TOKENS).expect("room");
            let grant =
                Grant::from_message(&receiver.grant(HandoffId(id), lease, TOKENS).expect("grant"))
                    .expect("grant");
            // Each frame is received as soon as it is made, as the decode
            // worker takes them off its channel while prefill sends more.
            let proof = Streaming::new(grant.clone())
                .finish(
                    &src,
                    &mut ChunkFrames::new(&grant, &shelf, |frame| {
                        receive(&mut receiver, frame);
                    }),
                )
                .expect("complete source");
            assert!(receive(&mut receiver, proof.done(0, 0).to_frame().into()));
        })
    });
    group.bench_function("one-sided: window writes + commit check", |b| {
        let mut receiver = Receiver::new();
        let mut id = 0;
        b.iter(|| {
            id += 1;
            let lease = decode.lease(RequestId(2), TOKENS).expect("room");
            let (grant, window) = receiver
                .grant_one_sided(HandoffId(id), lease, TOKENS)
                .expect("grant");
            let grant = Grant::from_message(&grant).expect("grant");
            let proof =
                send_kv_one_sided(&grant, &src, &window, window.key()).expect("live window");
            receive(&mut receiver, proof.done(0, 0).to_frame().into());
        })
    });
    group.finish();

    let view = src.read_view_raw(16).expect("covered");
    let chunk = Message::Chunk {
        id: HandoffId(1),
        epoch: kvfence_handoff::Epoch(1),
        page: src.pages()[0],
        slot_start: 0,
        slot_end: 16,
        checksum: 0,
        bytes: view.export_slots(0, 0..16).into(),
    };
    drop(view);
    let mut codec = c.benchmark_group("codec");
    codec.throughput(Throughput::Bytes(chunk.to_frame().len() as u64));
    codec.bench_function("encode + decode one 737 KB page chunk", |b| {
        b.iter(|| {
            let frame = black_box(&chunk).to_frame();
            black_box(Message::decode(&frame).expect("valid").expect("whole"))
        })
    });
    codec.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);

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

use std::hint::black_box;
use std::time::Duration;

use bytes::Bytes;
use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use kvfence_handoff::{
    ChunkFrames, Grant, HandoffId, Message, Outcome, Receiver, Streaming, send_kv_one_sided,
};
use kvfence_pool::{ElemType, KvShape, Lease, Pool, PoolSize, PoolSpec, RequestId, Scrub};

const SHAPE: KvShape = KvShape {
    layers: 30,
    kv_heads: 3,
    head_dim: 64,
};
const TOKENS: usize = 512;

fn pool() -> Pool {
    Pool::new(
        &PoolSpec::new(SHAPE, 16, ElemType::F32, PoolSize::Tokens(2 * TOKENS))
            .with_scrub(Scrub::Off),
    )
    .expect("bench pool")
}

fn source(pool: &Pool) -> Lease {
    let mut lease = pool.lease(RequestId(1), TOKENS).expect("room");
    let values: Vec<f32> = (0..TOKENS * SHAPE.kv_heads * SHAPE.head_dim)
        .map(|i| i as f32)
        .collect();
    for layer in 0..SHAPE.layers {
        lease
            .write_positions(layer, 0, &values, &values)
            .expect("in range");
    }
    lease
}

/// Every frame of one two-sided transfer of `source` into `grant`, `Done` last.
fn frames(grant: &Grant, source: &Lease) -> Vec<Vec<u8>> {
    let mut frames = Vec::new();
    let proof = Streaming::new(grant.clone())
        .finish(source, &mut ChunkFrames::new(grant, |f| frames.push(f)))
        .expect("complete source");
    frames.push(proof.done(0, 0).to_frame());
    frames
}

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
    let bytes = (TOKENS * SHAPE.layers * 2 * SHAPE.kv_heads * SHAPE.head_dim * 4) as u64;
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
                    &mut ChunkFrames::new(&grant, |frame| {
                        receive(&mut receiver, frame.into());
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

/// TCP: the link as the engine runs it — TLS 1.3 with mutual certificates
/// (AES-GCM), link frames, codec, receiver checks — against a plain loopback
/// socket moving the same bytes, one connection each.
fn tcp(c: &mut Criterion) {
    use std::io::{Read, Write};
    use std::net::{TcpListener, TcpStream};

    use kvfence_handoff::tcp::{read_link_frame, write_link_frame};
    use kvfence_handoff::tls::{ClusterCa, Role};

    let ca = ClusterCa::generate().expect("a CA");
    let decode_tls = ca.credentials(Role::Decode).expect("credentials");
    let prefill_tls = ca.credentials(Role::Prefill).expect("credentials");
    let prefill = pool();
    let src = source(&prefill);
    let bytes = (TOKENS * SHAPE.layers * 2 * SHAPE.kv_heads * SHAPE.head_dim * 4) as u64;
    let mut group = c.benchmark_group("tcp 512 tokens");
    group
        .throughput(Throughput::Bytes(bytes))
        .sample_size(20)
        .measurement_time(Duration::from_secs(6));

    // Raw: the decode side reads exactly `bytes` and answers one byte.
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
    let address = listener.local_addr().expect("address");
    std::thread::spawn(move || {
        let (mut s, _) = listener.accept().expect("accept");
        let mut buf = vec![0u8; 1 << 20];
        loop {
            let mut left = bytes as usize;
            while left > 0 {
                let n = s.read(&mut buf[..left.min(1 << 20)]).expect("read");
                if n == 0 {
                    return;
                }
                left -= n;
            }
            s.write_all(&[1]).expect("ack");
        }
    });
    let mut raw = TcpStream::connect(address).expect("connect");
    raw.set_nodelay(true).expect("nodelay");
    let view = src.read_view_raw(TOKENS).expect("covered");
    let pages: Vec<Vec<u8>> = (0..view.num_pages())
        .map(|i| view.export_slots(i, 0..view.slots_in_page(i)))
        .collect();
    drop(view);
    group.bench_function("baseline: raw loopback socket, same bytes", |b| {
        b.iter(|| {
            for page in &pages {
                raw.write_all(page).expect("write");
            }
            let mut ack = [0u8];
            raw.read_exact(&mut ack).expect("ack");
        })
    });

    // Link: the decode side grants, then receives and checks every frame.
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
    let address = listener.local_addr().expect("address");
    std::thread::spawn(move || {
        let (s, _) = listener.accept().expect("accept");
        s.set_nodelay(true).expect("nodelay");
        let tls = rustls::ServerConnection::new(decode_tls.server_config()).expect("tls");
        // rustls reads the socket 4 KiB at a time; as the engine's links
        // do, read it through a larger buffer.
        let s = Buffered(std::io::BufReader::with_capacity(256 << 10, s));
        let mut s = rustls::StreamOwned::new(tls, s);
        let decode = pool();
        let mut receiver = Receiver::new();
        for id in 1.. {
            let lease = decode.lease(RequestId(2), TOKENS).expect("room");
            let grant = receiver.grant(HandoffId(id), lease, TOKENS).expect("grant");
            if write_link_frame(&mut s, &grant.to_frame()).is_err() || s.flush().is_err() {
                return;
            }
            loop {
                let Ok(Some(frame)) = read_link_frame(&mut s) else {
                    return;
                };
                if receive(&mut receiver, frame.into()) {
                    break;
                }
            }
        }
    });
    let tcp = TcpStream::connect(address).expect("connect");
    tcp.set_nodelay(true).expect("nodelay");
    let tls =
        rustls::ClientConnection::new(prefill_tls.client_config(), Role::Decode.server_name())
            .expect("tls");
    let mut link = rustls::StreamOwned::new(tls, tcp);
    group.bench_function("link: TLS 1.3 frames + every check", |b| {
        b.iter(|| {
            let frame = read_link_frame(&mut link).expect("grant").expect("grant");
            let (grant, _) = Message::decode(&frame).expect("valid").expect("whole");
            let grant = Grant::from_message(&grant).expect("a grant");
            for frame in frames(&grant, &src) {
                write_link_frame(&mut link, &frame).expect("write");
            }
            link.flush().expect("flush");
        })
    });
    group.finish();
}

/// A socket read through a buffer and written directly.
struct Buffered(std::io::BufReader<std::net::TcpStream>);

impl std::io::Read for Buffered {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        std::io::Read::read(&mut self.0, buf)
    }
}

impl std::io::Write for Buffered {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        std::io::Write::write(self.0.get_mut(), buf)
    }
    fn flush(&mut self) -> std::io::Result<()> {
        std::io::Write::flush(self.0.get_mut())
    }
}

criterion_group!(benches, bench, tcp);
criterion_main!(benches);

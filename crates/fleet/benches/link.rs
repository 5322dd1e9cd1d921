//! The fleet's TLS link carrying a hand-off, against a plain loopback
//! socket moving the same bytes.
//!
//! Shape: `builtin:small`'s KV (30 layers, 3 KV heads, head dim 64, f32),
//! 16-token pages; one 512-token prompt is 23.6 MB. Compared in one run:
//! - raw: the prompt's page bytes, exported beforehand, written to a plain
//!   loopback socket and read on the other side (the least any transfer
//!   between processes must do);
//! - link: the carrier `serve --handoff tcp` runs — two ends joined by
//!   TLS 1.3 with mutual certificates over loopback, on the process's link
//!   runtime. The decode end grants; the prefill end builds chunk frames
//!   from its pages and queues each as it is made, as its scheduler does;
//!   the decode end decodes each frame in place, checks it and copies it
//!   into its pool, and commits (coverage and digest) before granting the
//!   next. Both ends' encryption runs on the one link thread, as in that
//!   mode;
//! - link across two processes: the same, with the decode end in a child
//!   process (this bench binary again, told so by its environment), as the
//!   fleet runs: each end's TLS on its own process's link thread.

use std::hint::black_box;
use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::time::Duration;

use criterion::{Criterion, Throughput, criterion_group};
use kvfence_fleet::LinkEnd;
use kvfence_handoff::tls::{ClusterCa, Credentials, Role};
use kvfence_handoff::{
    ChunkFrames, FRAME_SHELF_BYTES, FrameShelf, Grant, HandoffId, Message, Outcome, Receiver,
    Streaming,
};
use kvfence_pool::RequestId;

#[path = "../../handoff/benches/support/prompt.rs"]
mod prompt;
use prompt::{BYTES, TOKENS, pool, source};

/// The allocator the `kvfence` binary runs with (its `main.rs` says why).
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// The decode end: grants, receives and checks every frame, commits, and
/// grants again, until the link closes.
fn decode_end(link: LinkEnd) {
    let decode = pool();
    let mut receiver = Receiver::new();
    for id in 1.. {
        let lease = decode.lease(RequestId(2), TOKENS).expect("room");
        let grant = receiver.grant(HandoffId(id), lease, TOKENS).expect("grant");
        if !link.send(vec![grant.to_frame().into()]) {
            return;
        }
        loop {
            let Some(frame) = link.recv() else {
                return;
            };
            let (message, _) = Message::decode_shared(&frame)
                .expect("valid frame")
                .expect("whole frame");
            if let Outcome::Committed(committed) = receiver.handle(message) {
                black_box(committed.into_lease());
                break;
            }
        }
    }
}

fn link(c: &mut Criterion) {
    let prefill = pool();
    let src = source(&prefill);
    let mut group = c.benchmark_group("link 512 tokens");
    group
        .throughput(Throughput::Bytes(BYTES as u64))
        .sample_size(20)
        .measurement_time(Duration::from_secs(6));

    // Raw: the reading side reads exactly the prompt's bytes and answers one.
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
    let address = listener.local_addr().expect("address");
    std::thread::spawn(move || {
        let (mut s, _) = listener.accept().expect("accept");
        let mut buf = vec![0u8; 1 << 20];
        loop {
            let mut left = BYTES;
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

    let shelf = FrameShelf::new(FRAME_SHELF_BYTES);
    // One prompt sent over `prefill_end`: wait for the grant, stream the
    // chunk frames as they are made, then `Done`.
    let hand_off = |prefill_end: &LinkEnd| {
        let frame = prefill_end.recv().expect("a grant");
        let (grant, _) = Message::decode(&frame).expect("valid").expect("whole");
        let grant = Grant::from_message(&grant).expect("a grant");
        let proof = Streaming::new(grant.clone())
            .finish(
                &src,
                &mut ChunkFrames::new(&grant, &shelf, |frame| {
                    assert!(prefill_end.send(vec![frame]), "link up");
                }),
            )
            .expect("complete source");
        assert!(
            prefill_end.send(vec![proof.done(0, 0).to_frame().into()]),
            "link up"
        );
    };
    let (prefill_end, decode) = LinkEnd::loopback_pair().expect("a TLS link over loopback");
    std::thread::spawn(move || decode_end(decode));
    group.bench_function("link: TLS 1.3, frames as made, every check", |b| {
        b.iter(|| hand_off(&prefill_end))
    });
    drop(prefill_end);

    let (prefill_end, mut child) = link_to_a_child_process();
    group.bench_function(
        "link across two processes: the same, each end its own link thread",
        |b| b.iter(|| hand_off(&prefill_end)),
    );
    drop(prefill_end);
    // The child's link closes with ours; it exits then.
    let _ = child.wait();
    group.finish();
}

/// Where the child process finds its credentials and the prefill end.
const CHILD_CERTS: &str = "KVFENCE_LINK_BENCH_CERTS";
const CHILD_DIALS: &str = "KVFENCE_LINK_BENCH_DIALS";

/// Starts this bench binary again as a decode end in its own process and
/// returns the prefill end of the link it dials, with the child.
fn link_to_a_child_process() -> (LinkEnd, std::process::Child) {
    let certs = tempfile::tempdir().expect("a temporary directory");
    let ca = ClusterCa::generate().expect("a cluster CA");
    ca.write_dir(certs.path()).expect("credentials written");
    let prefill = ca.credentials(Role::Prefill).expect("prefill credentials");
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
    let address = listener.local_addr().expect("address");
    let child = std::process::Command::new(std::env::current_exe().expect("this binary"))
        .env(CHILD_CERTS, certs.path())
        .env(CHILD_DIALS, address.to_string())
        .spawn()
        .expect("the decode end's process starts");
    let prefill_end = LinkEnd::accept_decode(listener, &prefill).expect("the child dials");
    (prefill_end, child)
}

/// The child process: the decode end, until the link closes.
fn child_decode_end(certs: &std::ffi::OsStr, dials: &str) {
    let credentials =
        Credentials::load(std::path::Path::new(certs), Role::Decode).expect("credentials");
    let address = dials.parse().expect("an address");
    decode_end(LinkEnd::dial_prefill(address, &credentials).expect("the link comes up"));
}

criterion_group!(benches, link);

fn main() {
    if let (Some(certs), Some(dials)) = (
        std::env::var_os(CHILD_CERTS),
        std::env::var(CHILD_DIALS).ok(),
    ) {
        child_decode_end(&certs, &dials);
        return;
    }
    benches();
    Criterion::default().configure_from_args().final_summary();
}

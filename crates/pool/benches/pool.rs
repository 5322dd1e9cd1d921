//! Pool hot paths: lease + drop of 16 pages, fenced writes, checked reads.
//!
//! Shape: SmolLM2-135M's KV (30 layers, 3 KV heads, head dim 64), f32,
//! 16-token pages, scrub off (the release default).

use std::hint::black_box;

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use kvfence_pool::{ElemType, KvShape, Pool, PoolSize, PoolSpec, RequestId, Scrub};

const SHAPE: KvShape = KvShape {
    layers: 30,
    kv_heads: 3,
    head_dim: 64,
};
const PAGE: usize = 16;

fn pool() -> Pool {
    let spec = PoolSpec::new(SHAPE, PAGE, ElemType::F32, PoolSize::Tokens(64 * 1024))
        .with_scrub(Scrub::Off);
    Pool::new(&spec).expect("bench spec is valid")
}

fn lease_and_drop(c: &mut Criterion) {
    let pool = pool();
    c.bench_function("lease+drop 16 pages", |b| {
        b.iter(|| {
            let lease = pool.lease(RequestId(1), 16 * PAGE).expect("pool has room");
            black_box(lease.pages().len())
        })
    });
}

fn write_and_read(c: &mut Criterion) {
    let pool = pool();
    let tokens = 256;
    let per_token = SHAPE.kv_heads * SHAPE.head_dim;
    let k = vec![0.5f32; tokens * per_token];
    let v = vec![0.25f32; tokens * per_token];
    let mut lease = pool.lease(RequestId(1), tokens).expect("pool has room");

    let mut group = c.benchmark_group("kv");
    // K and V of one layer for 256 tokens.
    group.throughput(Throughput::Bytes((2 * k.len() * 4) as u64));
    group.bench_function("write_positions 256 tokens x 1 layer", |b| {
        b.iter(|| {
            lease
                .write_positions(black_box(7), 0, &k, &v)
                .expect("write is in range")
        })
    });
    for layer in 0..SHAPE.layers {
        lease
            .write_positions(layer, 0, &k, &v)
            .expect("write is in range");
    }
    group.bench_function("read_layer 256 tokens + sum keys", |b| {
        b.iter(|| {
            let view = lease.read_layer::<f32>(7, tokens).expect("covered");
            let mut sum = 0.0f32;
            for page in 0..view.num_pages() {
                for head in 0..SHAPE.kv_heads {
                    sum += view.keys(page, 7, head).columns().flatten().sum::<f32>();
                    sum += view.values(page, 7, head).iter().sum::<f32>();
                }
            }
            black_box(sum)
        })
    });
    group.throughput(Throughput::Elements(1));
    group.bench_function("read_view 256 tokens x 30 layers (check only)", |b| {
        b.iter(|| black_box(lease.read_view::<f32>(tokens).expect("covered").num_pages()))
    });
    group.finish();
}

criterion_group!(benches, lease_and_drop, write_and_read);
criterion_main!(benches);

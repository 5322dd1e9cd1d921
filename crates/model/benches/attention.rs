//! The paged attention kernel alone: one decode token's attention over a
//! context read page by page through a coverage-checked view, at SmolLM2's
//! shape (9 query heads, 3 KV heads, head dim 64). Throughput is KV bytes
//! read per second, to compare with the machine's memory bandwidth.

use std::hint::black_box;
use std::time::Duration;

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use kvfence_model::forward::attend_row;
use kvfence_model::{Builtin, Model};
use kvfence_pool::{ElemType, Pool, PoolSize, PoolSpec, RequestId, Scrub};

fn bench(c: &mut Criterion) {
    // builtin:small has SmolLM2's attention shape; only its config is used.
    let config = Builtin::Small.config();
    let shape = Model::kv_shape_of(&config);
    let longest = 2048;
    let spec =
        PoolSpec::new(shape, 16, ElemType::F32, PoolSize::Tokens(longest)).with_scrub(Scrub::Off);
    let pool = Pool::new(&spec).expect("bench pool");
    let mut lease = pool.lease(RequestId(1), longest).expect("room");
    let per_token = config.kv_dim();
    let values: Vec<f32> = (0..longest * per_token)
        .map(|i| ((i * 7919) % 1000) as f32 / 1000.0 - 0.5)
        .collect();
    lease
        .write_positions(0, 0, &values, &values)
        .expect("fill layer 0");
    let q: Vec<f32> = (0..config.q_dim())
        .map(|i| ((i * 104_729) % 1000) as f32 / 1000.0 - 0.5)
        .collect();
    let mut out = vec![0.0f32; config.q_dim()];

    let mut group = c.benchmark_group("paged attention");
    group
        .sample_size(20)
        .warm_up_time(Duration::from_secs(1))
        .measurement_time(Duration::from_secs(3));
    for context in [128usize, 512, 2048] {
        group.throughput(Throughput::Bytes((context * per_token * 2 * 4) as u64));
        group.bench_function(format!("one token over {context} positions"), |b| {
            b.iter(|| {
                let view = lease.read_layer::<f32>(0, context).expect("covered");
                attend_row(&config, &q, &view, 0, context, &mut out);
                black_box(&out);
            })
        });
    }
    group.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);

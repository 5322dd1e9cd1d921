//! One activation row through a quantized matrix on one thread, at
//! SmolLM2-135M's shapes: the kernel a batch-one decode step spends most
//! of its compute in, without the pool's other thread or the rest of the
//! step around it. Weights are random, quantized once; the matrices fit in
//! a core's L2 (the 49,152-row output matrix excepted), so this measures
//! the tile's arithmetic and its per-row work rather than memory.

use std::hint::black_box;
use std::time::Duration;

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use kvfence_model::quant::{QuantFormat, QuantMatrix, quantize_row};

/// `rows` × `k` random weights in `format`.
fn matrix(format: QuantFormat, rows: usize, k: usize) -> QuantMatrix {
    let mut state = 0x9E37_79B9_u32;
    let mut data = Vec::with_capacity(rows * format.row_bytes(k));
    for _ in 0..rows {
        let row: Vec<f32> = (0..k)
            .map(|_| {
                state = state.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
                (state >> 8) as f32 / (1 << 24) as f32 - 0.5
            })
            .collect();
        data.extend(quantize_row(format, &row).expect("Q4_1 and Q8_0 quantize"));
    }
    QuantMatrix::new(format, rows, k, data)
}

fn bench(c: &mut Criterion) {
    let one_thread = rayon::ThreadPoolBuilder::new()
        .num_threads(1)
        .build()
        .expect("a one-thread pool");
    let mut group = c.benchmark_group("one-row matmul, one thread");
    group.warm_up_time(Duration::from_secs(1));
    group.measurement_time(Duration::from_secs(3));
    for (format, rows, k, what) in [
        (QuantFormat::Q4_1, 1536, 576, "gate/up"),
        (QuantFormat::Q4_1, 576, 576, "q/o"),
        (QuantFormat::Q4_1, 576, 1536, "down"),
        (QuantFormat::Q8_0, 49152, 576, "output"),
    ] {
        let w = matrix(format, rows, k);
        let x: Vec<f32> = (0..k).map(|i| (i as f32 * 0.01).sin()).collect();
        let mut out = vec![0.0; rows];
        // Throughput in 32-weight blocks (of one row each) a second.
        group.throughput(Throughput::Elements((rows * k / 32) as u64));
        group.bench_function(format!("{format:?} {rows}x{k} ({what})"), |b| {
            one_thread.install(|| b.iter(|| w.matmul(black_box(&x), 1, &mut out)));
        });
    }
    group.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);

//! Attention alone, at SmolLM2's shape (9 query heads, 3 KV heads, head dim
//! 64), read page by page through coverage-checked views: one decode row
//! over contexts of 512 to 8,192 positions (throughput: KV bytes read per
//! second, to compare with the machine's memory bandwidth) and a 512-row
//! prefill tile set over a 2,048-position prefix, for f32 and f16 KV; and
//! the f16 decode rows again with pages of one layer each (layer groups of
//! one), where a head's keys are a run in a page of that layer alone rather
//! than a run in a page of every layer. Then a decode step's attention over
//! all 30 layers at 4,096 positions in both layouts: 94 MB of f16 KV, read
//! from memory as a served step reads it, where one layer alone stays in
//! cache. Last, the same bytes only read (summed, no attention), in the
//! runs the step reads them in and as one run per layer: what the memory
//! gives each access pattern, the kernel's ceiling in this layout.

use std::hint::black_box;
use std::time::Duration;

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use kvfence_model::attention::{KvValue, SequenceQueries, attend};
use kvfence_model::{Builtin, Model, ModelConfig};
use kvfence_pool::{Keep, LayerGroups, Lease, Pool, PoolSize, PoolSpec, RequestId, Scrub};
use rayon::prelude::*;

/// The serving binary's allocator, so the pool's pages are allocated as a
/// served step finds them (mimalloc maps its arenas on transparent huge
/// pages where the kernel allows; measured here, the step reads as fast
/// either way).
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

const LONGEST: usize = 8192;

/// How the pool's pages hold the layers.
#[derive(Clone, Copy)]
enum Layout {
    /// A page holds every layer (the pool of one layer group).
    EveryLayer,
    /// A page holds one layer (a layer group each).
    LayerAlone,
}

fn filled<E: KvValue>(config: &ModelConfig, layout: Layout) -> (Pool, Lease) {
    filled_layers::<E>(config, layout, LONGEST, 1)
}

fn run<E: KvValue>(c: &mut Criterion, name: &str, layout: Layout) {
    // builtin:small has SmolLM2's attention shape; only its config is used.
    let config = Builtin::Small.config();
    let (_pool, lease) = filled::<E>(&config, layout);
    let q_dim = config.q_dim();
    let queries: Vec<f32> = (0..512 * q_dim)
        .map(|i| ((i * 104_729) % 1000) as f32 / 1000.0 - 0.5)
        .collect();
    let mut out = vec![0.0f32; 512 * q_dim];
    let elem_bytes = std::mem::size_of::<E>();
    let mut group = c.benchmark_group(format!("attention {name}"));
    group
        .sample_size(10)
        .warm_up_time(Duration::from_secs(1))
        .measurement_time(Duration::from_secs(3));
    for context in [512usize, 2048, 8192] {
        group.throughput(Throughput::Bytes(
            (context * config.kv_dim() * 2 * elem_bytes) as u64,
        ));
        group.bench_function(format!("decode row over {context} positions"), |b| {
            b.iter(|| {
                let view = lease.read_layer::<E>(0, context).expect("covered");
                let part = SequenceQueries {
                    view: &view,
                    past: context - 1,
                    queries: &queries[..q_dim],
                    stride: q_dim,
                    rows: 1,
                };
                attend(&config, 0, &[Some(part)], &[1], &mut out[..q_dim]);
                black_box(&out);
            })
        });
    }
    if let Layout::LayerAlone = layout {
        group.finish();
        return;
    }
    group.throughput(Throughput::Elements(512));
    group.bench_function("512 prefill rows after 1,536 positions", |b| {
        b.iter(|| {
            let view = lease.read_layer::<E>(0, 2048).expect("covered");
            let part = SequenceQueries {
                view: &view,
                past: 1536,
                queries: &queries,
                stride: q_dim,
                rows: 512,
            };
            attend(&config, 0, &[Some(part)], &[512], &mut out);
            black_box(&out);
        })
    });
    group.finish();
}

/// One decode step's attention over every layer at `context` positions:
/// what a served step reads, 30 layers' KV from memory rather than one
/// layer's from cache.
fn step(c: &mut Criterion, name: &str, layout: Layout) {
    let config = Builtin::Small.config();
    let context = 4096;
    let (_pool, lease) = filled_layers::<half::f16>(&config, layout, context, config.num_layers);
    let q_dim = config.q_dim();
    let queries: Vec<f32> = (0..q_dim)
        .map(|i| ((i * 104_729) % 1000) as f32 / 1000.0 - 0.5)
        .collect();
    let mut out = vec![0.0f32; q_dim];
    let mut group = c.benchmark_group(format!("attention step {name}"));
    group
        .sample_size(10)
        .warm_up_time(Duration::from_secs(1))
        .measurement_time(Duration::from_secs(3))
        .throughput(Throughput::Bytes(
            (config.num_layers * context * config.kv_dim() * 2 * 2) as u64,
        ));
    group.bench_function(
        format!("decode row, every layer, {context} positions"),
        |b| {
            b.iter(|| {
                for layer in 0..config.num_layers {
                    let view = lease
                        .read_layer::<half::f16>(layer, context)
                        .expect("covered");
                    let part = SequenceQueries {
                        view: &view,
                        past: context - 1,
                        queries: &queries,
                        stride: q_dim,
                        rows: 1,
                    };
                    attend(&config, layer, &[Some(part)], &[1], &mut out);
                }
                black_box(&out);
            })
        },
    );
    group.finish();
}

/// The step's 94 MB only read (summed as words, no attention), layer after
/// layer as the step reads them: first in its runs — each KV head's pages
/// split over the threads as `attend` splits a decode row, a page's key
/// block and then its value block, 2 KB each, a page's layers 368 KB
/// apart — then the same byte count as one contiguous run per layer. What
/// the memory gives each pattern: the ceiling for the kernel in that
/// layout, and what a layout with longer runs could reach.
fn reads(c: &mut Criterion) {
    let config = Builtin::Small.config();
    let context = 4096;
    let layers = config.num_layers;
    let (_pool, lease) = filled_layers::<half::f16>(&config, Layout::EveryLayer, context, layers);
    let view = lease.read_view_raw(context).expect("covered");
    let shape = Model::kv_shape_of(&config);
    // One head's K (or V) block of a 16-slot page, in bytes of f16.
    let block = 16 * shape.head_dim * 2;
    let pages = view.num_pages();
    let runs = rayon::current_num_threads() * 4;
    let per_run = (pages * shape.kv_heads).div_ceil(runs);
    let bytes = layers * context * config.kv_dim() * 2 * 2;
    let mut group = c.benchmark_group(format!("KV reads f16, {context} positions"));
    group
        .sample_size(10)
        .warm_up_time(Duration::from_secs(1))
        .measurement_time(Duration::from_secs(3))
        .throughput(Throughput::Bytes(bytes as u64));
    group.bench_function("every layer, in the step's runs", |b| {
        b.iter(|| {
            let mut total = 0u64;
            for layer in 0..layers {
                let tasks: Vec<(usize, usize)> = (0..shape.kv_heads)
                    .flat_map(|head| (0..pages).step_by(per_run).map(move |p| (head, p)))
                    .collect();
                let sum = |&(head, first): &(usize, usize)| {
                    let mut sum = 0u64;
                    for page in first..(first + per_run).min(pages) {
                        let run = view.slot_runs(page, 0..16).next().expect("a whole page");
                        for kv in 0..2 {
                            let at = ((layer * 2 + kv) * shape.kv_heads + head) * block;
                            sum = sum.wrapping_add(word_sum(&run[at..at + block]));
                        }
                    }
                    sum
                };
                let layer_sum = tasks.par_iter().map(sum).reduce(|| 0, u64::wrapping_add);
                total = total.wrapping_add(layer_sum);
            }
            black_box(total);
        })
    });
    let flat = vec![1u8; bytes];
    group.bench_function("every layer, one run per layer", |b| {
        b.iter(|| {
            let mut total = 0u64;
            for layer in flat.chunks_exact(bytes / layers) {
                let piece = layer.len().div_ceil(runs);
                let layer_sum = layer
                    .par_chunks(piece)
                    .map(word_sum)
                    .reduce(|| 0, u64::wrapping_add);
                total = total.wrapping_add(layer_sum);
            }
            black_box(total);
        })
    });
    group.finish();
}

/// A wrapping sum of `bytes` as 64-bit words: every byte read and little
/// else done, so it runs at the memory's speed rather than the core's.
fn word_sum(bytes: &[u8]) -> u64 {
    let (head, words, tail) = bytemuck::pod_align_to::<u8, u64>(bytes);
    let edges = head.iter().chain(tail).map(|&b| u64::from(b)).sum::<u64>();
    words.iter().fold(edges, |sum, &w| sum.wrapping_add(w))
}

/// A pool of `tokens` positions whose first `layers` layers are written.
fn filled_layers<E: KvValue>(
    config: &ModelConfig,
    layout: Layout,
    tokens: usize,
    layers: usize,
) -> (Pool, Lease) {
    let shape = Model::kv_shape_of(config);
    let mut spec =
        PoolSpec::new(shape, 16, E::ELEM, PoolSize::Tokens(tokens)).with_scrub(Scrub::Off);
    if let Layout::LayerAlone = layout {
        let groups = (0..shape.layers).map(|l| (vec![l], Keep::All)).collect();
        spec = spec.with_layer_groups(LayerGroups::new(groups).expect("a group a layer"));
    }
    let pool = Pool::new(&spec).expect("bench pool");
    let mut lease = pool.lease(RequestId(1), tokens).expect("room");
    let values: Vec<f32> = (0..tokens * config.kv_dim())
        .map(|i| ((i * 7919) % 1000) as f32 / 1000.0 - 0.5)
        .collect();
    let values = E::narrow(&values);
    for layer in 0..layers {
        lease
            .write_positions::<E>(layer, 0, &values, &values)
            .expect("fill a layer");
    }
    (pool, lease)
}

fn bench(c: &mut Criterion) {
    run::<f32>(c, "f32 KV", Layout::EveryLayer);
    run::<half::f16>(c, "f16 KV", Layout::EveryLayer);
    run::<half::f16>(c, "f16 KV, a page a layer", Layout::LayerAlone);
    step(c, "f16 KV", Layout::EveryLayer);
    step(c, "f16 KV, a page a layer", Layout::LayerAlone);
    reads(c);
}

criterion_group!(benches, bench);
criterion_main!(benches);

//! Forward-pass throughput on `builtin:small` (SmolLM2-135M's shape, f32)
//! and on the real SmolLM2-135M-Instruct (Q4_1 GGUF) and Gemma 3 270M
//! (Q4_K_M GGUF: Q8_0, Q5_0, Q4_K and Q6_K matrices), both fetched into the
//! model cache on first use: prefill tokens/s and decode tokens/s at batch
//! 1, 8 and 32; and SmolLM2's decode step at a 4,096-token context with
//! f16 KV, the step the memory roofline in `docs/performance.md` is for.

use std::cell::OnceCell;
use std::hint::black_box;
use std::time::Duration;

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use kvfence_model::{Builtin, LoadedModel, Logits, Model, ModelCache, Sequence};
use kvfence_pool::{Checks, ElemType, Lease, Pool, PoolSize, PoolSpec, RequestId, Scrub};

/// The allocator the `kvfence` binary runs with (its `main.rs` says why):
/// a prefill's activations are allocated layer after layer.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

const CONTEXT: usize = 128;
/// The long context of the decode step measured against its roofline.
const LONG_CONTEXT: usize = 4096;

fn pool_for(model: &Model) -> Pool {
    pool_with(model, Checks::On)
}

fn pool_with(model: &Model, checks: Checks) -> Pool {
    let spec = PoolSpec::new(
        model.kv_shape(),
        16,
        ElemType::F32,
        PoolSize::Tokens(40 * 1024),
    )
    .with_scrub(Scrub::Off)
    .with_checks(checks);
    Pool::new(&spec).expect("bench pool")
}

fn prompt(seed: usize, len: usize) -> Vec<u32> {
    (0..len)
        .map(|i| ((i * 31 + seed * 17) % 256) as u32)
        .collect()
}

fn prefilled(model: &Model, pool: &Pool, owner: u64) -> Lease {
    prefilled_to(model, pool, owner, CONTEXT)
}

fn prefilled_to(model: &Model, pool: &Pool, owner: u64, context: usize) -> Lease {
    let mut lease = pool.lease(RequestId(owner), context + 1).expect("room");
    let tokens = prompt(owner as usize, context);
    model
        .forward(&mut [Sequence {
            lease: &mut lease,
            past: 0,
            tokens: &tokens,
            logits: Logits::None,
        }])
        .expect("prefill");
    lease
}

fn bench(c: &mut Criterion) {
    let small = Lazily::new(|| {
        Model::from_tensors(Builtin::Small.config(), &Builtin::Small.tensors())
            .expect("builtin loads")
    });
    bench_model(c, "builtin:small", &|| small.get());
    let smollm2 = Lazily::new(|| fetched("smollm2"));
    let smollm2 = || &smollm2.get().model;
    bench_model(c, "smollm2", &smollm2);
    bench_long_decode(c, &smollm2);
    bench_checks(c, &smollm2);
    let gemma = Lazily::new(|| fetched("gemma3-270m"));
    bench_model(c, "gemma3-270m", &|| &gemma.get().model);
}

/// What a benchmark needs, made the first time one that is run asks for
/// it: a filtered run (`-- "long context"`) loads and prefills only what
/// its own benchmarks read, in seconds, where making everything first took
/// a minute.
struct Lazily<T> {
    cell: OnceCell<T>,
    make: fn() -> T,
}

impl<T> Lazily<T> {
    fn new(make: fn() -> T) -> Self {
        Lazily {
            cell: OnceCell::new(),
            make,
        }
    }

    fn get(&self) -> &T {
        self.cell.get_or_init(self.make)
    }
}

/// A known model, fetched into the model cache on first use.
fn fetched(name: &str) -> LoadedModel {
    LoadedModel::load_or_fetch(name, &ModelCache::from_env(), &mut |m| eprintln!("{m}"))
        .unwrap_or_else(|e| panic!("{name} loads (fetched on first use): {e}"))
}

/// One prefill of `tokens` into a fresh lease, logits of the last token.
fn prefill_once(model: &Model, pool: &Pool, tokens: &[u32]) -> Vec<Vec<f32>> {
    let mut lease = pool.lease(RequestId(1), tokens.len()).expect("room");
    let mut batch = [Sequence {
        lease: &mut lease,
        past: 0,
        tokens,
        logits: Logits::Last,
    }];
    model.forward(&mut batch).expect("prefill")
}

/// One decode step for every lease. Each step rewrites position CONTEXT:
/// a constant-context decode step.
fn decode_step(model: &Model, leases: &mut [Lease]) -> Vec<Vec<f32>> {
    decode_step_at(model, leases, CONTEXT)
}

/// [`decode_step`] after `past` positions.
fn decode_step_at(model: &Model, leases: &mut [Lease], past: usize) -> Vec<Vec<f32>> {
    let mut batch: Vec<Sequence<'_>> = leases
        .iter_mut()
        .map(|lease| Sequence {
            lease,
            past,
            tokens: &[65],
            logits: Logits::Last,
        })
        .collect();
    model.forward(&mut batch).expect("decode")
}

fn group<'a>(
    c: &'a mut Criterion,
    name: &str,
) -> criterion::BenchmarkGroup<'a, criterion::measurement::WallTime> {
    let mut group = c.benchmark_group(name);
    group
        .sample_size(10)
        .warm_up_time(Duration::from_secs(2))
        .measurement_time(Duration::from_secs(8));
    group
}

/// The same decode steps and prefill with the pool's isolation checks on
/// and off (`Checks::Off` exists only in this measurement build), measured
/// alternately in one run.
fn bench_checks<'m>(c: &mut Criterion, model: &dyn Fn() -> &'m Model) {
    let mut group = group(c, "smollm2 isolation checks");
    for (label, checks) in [("on", Checks::On), ("off", Checks::Off)] {
        let pool = OnceCell::new();
        let pool = || pool.get_or_init(|| pool_with(model(), checks));
        let tokens = prompt(0, CONTEXT);
        group.throughput(Throughput::Elements(CONTEXT as u64));
        group.bench_function(format!("prefill {CONTEXT} tokens, checks {label}"), |b| {
            let (model, pool) = (model(), pool());
            b.iter(|| black_box(prefill_once(model, pool, &tokens)))
        });
        let mut leases: Option<Vec<Lease>> = None;
        group.throughput(Throughput::Elements(8));
        group.bench_function(format!("decode batch 8, checks {label}"), |b| {
            let (model, pool) = (model(), pool());
            let leases = leases
                .get_or_insert_with(|| (0..8).map(|i| prefilled(model, pool, 10 + i)).collect());
            b.iter(|| black_box(decode_step(model, leases)))
        });
    }
    group.finish();
}

/// One sequence's decode step after [`LONG_CONTEXT`] positions of f16 KV,
/// as served by default: the whole step (30 layers' matmuls, attention over
/// 94 MB of KV, the logits), with nothing of the server around it.
fn bench_long_decode<'m>(c: &mut Criterion, model: &dyn Fn() -> &'m Model) {
    // The lease before its pool, so it is dropped first.
    let mut made: Option<([Lease; 1], Pool)> = None;
    let mut group = group(c, "smollm2 long context");
    group.throughput(Throughput::Elements(1));
    group.bench_function(
        format!("decode batch 1 at context {LONG_CONTEXT}, f16 KV"),
        |b| {
            let model = model();
            let (leases, _) = made.get_or_insert_with(|| {
                let spec = PoolSpec::new(
                    model.kv_shape(),
                    16,
                    ElemType::F16,
                    PoolSize::Tokens(LONG_CONTEXT + 16),
                )
                .with_scrub(Scrub::Off);
                let pool = Pool::new(&spec).expect("bench pool");
                ([prefilled_to(model, &pool, 1, LONG_CONTEXT)], pool)
            });
            b.iter(|| black_box(decode_step_at(model, leases, LONG_CONTEXT)))
        },
    );
    group.finish();
}

fn bench_model<'m>(c: &mut Criterion, name: &str, model: &dyn Fn() -> &'m Model) {
    let pool = OnceCell::new();
    let pool = || pool.get_or_init(|| pool_for(model()));
    let mut group = group(c, name);
    for len in [128usize, 512] {
        let tokens = prompt(0, len);
        group.throughput(Throughput::Elements(len as u64));
        group.bench_function(format!("prefill {len} tokens"), |b| {
            let (model, pool) = (model(), pool());
            b.iter(|| black_box(prefill_once(model, pool, &tokens)))
        });
    }
    for batch_size in [1usize, 8, 32] {
        let mut leases: Option<Vec<Lease>> = None;
        group.throughput(Throughput::Elements(batch_size as u64));
        group.bench_function(
            format!("decode batch {batch_size} at context {CONTEXT}"),
            |b| {
                let (model, pool) = (model(), pool());
                let leases = leases.get_or_insert_with(|| {
                    (0..batch_size)
                        .map(|i| prefilled(model, pool, 10 + i as u64))
                        .collect()
                });
                b.iter(|| black_box(decode_step(model, leases)))
            },
        );
    }
    group.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);

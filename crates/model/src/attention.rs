//! Causal attention over pool pages, tiled: blocks of query rows against
//! chunks of keys, with the softmax carried across chunks (the CPU form of
//! "flash" attention). It reads K and V only through coverage-checked
//! [`ReadView`]s (I2), in whatever element type the pool stores.
//!
//! # What every row computes, bit for bit
//!
//! For a query head `q` of a row at position `p` (it attends to `0..=p`, or
//! on a sliding-window layer of window `w` to `p + 1 − w..=p`):
//!
//! 1. `q' = q · (1/√head_dim)`, element by element.
//! 2. Positions are cut into chunks of [`CHUNK`] by absolute position. In
//!    each chunk `c` that holds positions the row attends to, over those
//!    positions `j`:
//!    `s_j` is the fused multiply-add chain of `q'[d] · k_j[d]` over `d`
//!    ascending, from zero; `m_c = max s_j`; `e_j = exp(s_j − m_c)` with
//!    this module's [`exp`]; `l_c` is the 8-lane sum of the `e_j`; and
//!    `a_c[d]` is the fused chain of `e_j · v_j[d]` over `j` ascending.
//! 3. The chunks are folded in ascending order: the first is the state;
//!    each next one rescales both sides to the larger maximum
//!    (`M' = max(M, m_c)`, `num = a_c·exp(m_c − M') + num·exp(M − M')`, and
//!    the same for the denominator).
//! 4. `out = num · (1/den)`.
//!
//! Nothing in that list depends on which other rows share the pass, the
//! tile a row lands in, where a chunked prefill cut the prompt, the page
//! size, the thread count or the instruction set (fused multiply-adds round
//! once, exactly, everywhere). So a row is the same alone or batched,
//! prefilled in one pass or in pieces, colocated or after a hand-off — the
//! property every isolation check in this project compares against.
//!
//! # How it is computed
//!
//! A *task* is one KV head of one tile of up to [`TILE_ROWS`] consecutive
//! rows of one sequence, over a range of chunks. For each chunk it stages
//! the chunk's keys as columns (`[head_dim][CHUNK]`, so scores vectorise
//! across keys; pages store keys as columns, [`Keys`], so this only
//! widens) and its values (`[CHUNK][head_dim]`) as f32 in scratch
//! owned by the worker thread, then runs the score, softmax and value
//! kernels for all `rows × group` query heads at once: every staged key is
//! read from L1/L2 by every query head of the group instead of from memory
//! once per row. Staging fills every scratch cell a kernel reads, so the
//! scratch never carries another chunk's — or another request's — data
//! into a result.
//!
//! On a CPU with AVX-512F or AVX2 the kernels are hand-written
//! (`attention/avx512.rs`, `attention/avx2.rs`): values are read (and
//! widened) straight from their page runs instead of being staged, and so
//! are keys when the chunk's pages hold whole 16-slot blocks
//! (`attention/blocks.rs`; a partial last page is staged). Each *job*
//! (one task, or a decode row's tasks of every KV head over the same
//! chunks) lists its KV runs in the order the kernel reads them, and the
//! kernel asks for them a few blocks ahead of its reads
//! (`attention/ahead.rs`), so misses overlap instead of each run waiting
//! for the hardware prefetcher. The operations and their order are the
//! portable kernel's, so the bits are too.
//!
//! Prefill tiles fold their chunks as they go. A sequence with a single
//! tile (decode steps) and several chunks is split instead: a few runs of
//! consecutive chunks per worker thread, in parallel, each one job for
//! every KV head (so a page's blocks of a layer are read together),
//! each recording its
//! chunks' own states, which are folded afterwards one chunk at a time in
//! ascending order — the same operations as folding in place, so the same
//! bits, and a single long-context decode uses every core. (A run may not
//! fold its own chunks first: `a ⊕ (b ⊕ c)` rounds differently from
//! `(a ⊕ b) ⊕ c`.)

use std::borrow::Cow;

use half::slice::HalfFloatSliceExt;
use half::{bf16, f16};
use kvfence_pool::{Keys, KvElement, ReadView};

use crate::config::ModelConfig;
#[cfg(target_arch = "x86_64")]
use crate::isa::{IsaCap, per_isa};
use crate::kernels::exp;

#[cfg(target_arch = "x86_64")]
mod ahead;
#[cfg(target_arch = "x86_64")]
mod avx2;
#[cfg(target_arch = "x86_64")]
mod avx512;
#[cfg(target_arch = "x86_64")]
mod blocks;

/// What the SIMD paths need of an element type: loading 8 (AVX2) or 16
/// (AVX-512) of them as f32. Public only as a sealed supertrait of
/// [`KvValue`].
#[cfg(target_arch = "x86_64")]
pub trait Stage: avx2::Widen8 + avx512::Widen16 {}
#[cfg(target_arch = "x86_64")]
impl<T: avx2::Widen8 + avx512::Widen16> Stage for T {}

/// Nothing to stage by SIMD off x86-64: the portable loop does it all.
#[cfg(not(target_arch = "x86_64"))]
mod portable {
    pub trait Stage {}
    impl Stage for f32 {}
    impl Stage for half::f16 {}
    impl Stage for half::bf16 {}
}
#[cfg(not(target_arch = "x86_64"))]
use portable::Stage;

/// Positions per key chunk: the unit of staging and of the exact softmax.
pub const CHUNK: usize = 128;
/// Query rows of one sequence per tile.
pub const TILE_ROWS: usize = 16;
/// Keys per score microkernel step (two 8-lane vectors).
const KEY_STEP: usize = 16;
/// Query heads per score and value microkernel step: 6 × 16 f32
/// accumulators fill 12 of AVX2's 16 vector registers.
const QUERY_STEP: usize = 6;
/// Lanes of the softmax denominator's sum.
const SUM_LANES: usize = 8;
/// Multiply-adds below which a pass's attention stays on the calling
/// thread.
const PARALLEL_MIN_MACS: usize = 1 << 16;
/// Jobs per worker thread a single-tile sequence's chunks are split into:
/// enough that the threads finish together, few enough that each job runs
/// several chunks back to back (a job's fixed cost is paid once per run
/// rather than per chunk).
const DECODE_JOBS_PER_THREAD: usize = 4;

/// A K/V element type attention can read and the forward pass can write.
pub trait KvValue: KvElement + Stage {
    /// Converts `src` into `dst` (same length).
    fn widen(src: &[Self], dst: &mut [f32]);
    /// Converts `src` into this type, rounding to nearest even.
    fn narrow(src: &[f32]) -> Cow<'_, [Self]>;
}

impl KvValue for f32 {
    fn widen(src: &[f32], dst: &mut [f32]) {
        dst.copy_from_slice(src);
    }
    fn narrow(src: &[f32]) -> Cow<'_, [f32]> {
        Cow::Borrowed(src)
    }
}

impl KvValue for f16 {
    fn widen(src: &[f16], dst: &mut [f32]) {
        // `half` picks F16C (x86) or FP16 (aarch64) at run time.
        src.convert_to_f32_slice(dst);
    }
    fn narrow(src: &[f32]) -> Cow<'_, [f16]> {
        let mut out = vec![f16::ZERO; src.len()];
        out.convert_from_f32_slice(src);
        Cow::Owned(out)
    }
}

impl KvValue for bf16 {
    fn widen(src: &[bf16], dst: &mut [f32]) {
        src.convert_to_f32_slice(dst);
    }
    fn narrow(src: &[f32]) -> Cow<'_, [bf16]> {
        let mut out = vec![bf16::ZERO; src.len()];
        out.convert_from_f32_slice(src);
        Cow::Owned(out)
    }
}

/// One sequence's part of a pass: `rows` query rows at positions
/// `past..past + rows`, each row `[num_heads][head_dim]` at the start of a
/// `stride`-wide line of `queries`, attending through `view`.
pub struct SequenceQueries<'a, 'v, E> {
    /// Positions `0..past + rows` of the layer, coverage-checked.
    pub view: &'a ReadView<'v, E>,
    /// Positions already in the cache before these rows.
    pub past: usize,
    /// Rows, `stride` apart; each starts with its `[num_heads][head_dim]`.
    pub queries: &'a [f32],
    /// Distance between rows of `queries`.
    pub stride: usize,
    /// Query rows.
    pub rows: usize,
}

/// Running softmax state of a block of query heads: per head its maximum
/// score, denominator, and `head_dim` unnormalised outputs.
#[derive(Debug, Clone)]
struct State {
    max: Vec<f32>,
    den: Vec<f32>,
    num: Vec<f32>,
    /// Whether head `h` has folded a chunk yet: its first is taken as is.
    seen: Vec<bool>,
}

impl State {
    fn new(heads: usize, head_dim: usize) -> State {
        State {
            max: vec![0.0; heads],
            den: vec![0.0; heads],
            num: vec![0.0; heads * head_dim],
            seen: vec![false; heads],
        }
    }

    /// Folds a later chunk's head `h` into this state's head `h`, or takes
    /// it as is when it is the head's first.
    fn fold(&mut self, h: usize, max: f32, den: f32, num: &[f32]) {
        let hd = num.len();
        let dst = &mut self.num[h * hd..(h + 1) * hd];
        if !self.seen[h] {
            self.seen[h] = true;
            self.max[h] = max;
            self.den[h] = den;
            dst.copy_from_slice(num);
            return;
        }
        let top = self.max[h].max(max);
        let (keep, add) = fold_weights(self.max[h] - top, max - top);
        self.max[h] = top;
        self.den[h] = den.mul_add(add, self.den[h] * keep);
        rescale_add(dst, keep, num, add);
    }
}

/// Each chunk's own softmax state, as a split tile's task computed them:
/// chunk-major, `heads` per chunk.
#[derive(Debug, Clone)]
struct ChunkStates {
    heads: usize,
    head_dim: usize,
    max: Vec<f32>,
    den: Vec<f32>,
    num: Vec<f32>,
}

impl ChunkStates {
    fn new(chunks: usize, heads: usize, head_dim: usize) -> ChunkStates {
        ChunkStates {
            heads,
            head_dim,
            max: vec![0.0; chunks * heads],
            den: vec![0.0; chunks * heads],
            num: vec![0.0; chunks * heads * head_dim],
        }
    }

    /// Records chunk `i`'s kernel output for every head.
    fn record(&mut self, i: usize, max: &[f32], den: &[f32], num: &[f32]) {
        let (heads, hd) = (self.heads, self.head_dim);
        self.max[i * heads..(i + 1) * heads].copy_from_slice(&max[..heads]);
        self.den[i * heads..(i + 1) * heads].copy_from_slice(&den[..heads]);
        self.num[i * heads * hd..(i + 1) * heads * hd].copy_from_slice(&num[..heads * hd]);
    }

    /// Chunk `i`'s head `h`: its maximum, denominator and numerators.
    fn head(&self, i: usize, h: usize) -> (f32, f32, &[f32]) {
        let at = i * self.heads + h;
        let hd = self.head_dim;
        (
            self.max[at],
            self.den[at],
            &self.num[at * hd..(at + 1) * hd],
        )
    }
}

/// What a task hands back.
#[derive(Debug)]
enum TaskOutput {
    /// Its chunks folded in order: the tile's whole state.
    Folded(State),
    /// Each chunk's own state, for the fold after every task of the split
    /// tile is done.
    Chunks(ChunkStates),
}

per_isa! {
    /// `(e^a, e^b)`, compiled per instruction set so `exp`'s rounding and
    /// multiply-adds are instructions, not library calls.
    fn fold_weights(a: f32, b: f32) -> (f32, f32) {
        (exp(a), exp(b))
    }
}

per_isa! {
    /// `dst = add_weight · add + dst · keep`, element by element.
    fn rescale_add(dst: &mut [f32], keep: f32, add: &[f32], add_weight: f32) {
        for (d, &n) in dst.iter_mut().zip(add) {
            *d = n.mul_add(add_weight, *d * keep);
        }
    }
}

/// Per-thread staging and score buffers, reused across tasks.
struct Scratch {
    /// Keys as columns, `[head_dim][CHUNK]`.
    keys: Vec<f32>,
    /// Values, `[CHUNK][head_dim]`.
    values: Vec<f32>,
    /// Scores then weights, `[query head][CHUNK]`.
    scores: Vec<f32>,
    /// The tile's scaled queries, `[query head][head_dim]`.
    queries: Vec<f32>,
    /// One chunk's unnormalised outputs, `[query head][head_dim]`.
    chunk_out: Vec<f32>,
    /// One chunk's maximum score per query head.
    chunk_max: Vec<f32>,
    /// One chunk's softmax denominator per query head.
    chunk_den: Vec<f32>,
    /// A job's KV runs in read order (the allocation of
    /// [`ahead::Ahead`]'s list, kept between jobs).
    runs: Vec<(usize, usize)>,
}

thread_local! {
    /// Each compute thread's scratch, grown to the largest model it served.
    static SCRATCH: std::cell::RefCell<Scratch> = const {
        std::cell::RefCell::new(Scratch {
            keys: Vec::new(),
            values: Vec::new(),
            scores: Vec::new(),
            queries: Vec::new(),
            chunk_out: Vec::new(),
            chunk_max: Vec::new(),
            chunk_den: Vec::new(),
            runs: Vec::new(),
        })
    };
}

impl Scratch {
    /// Makes every buffer at least as large as a tile of `query_heads`
    /// heads of `head_dim` needs. Contents are whatever the last chunk
    /// left: staging and the kernels write every cell they later read.
    fn fit(&mut self, head_dim: usize, query_heads: usize) {
        let grow = |v: &mut Vec<f32>, len: usize| {
            if v.len() < len {
                v.resize(len, 0.0);
            }
        };
        grow(&mut self.keys, head_dim * CHUNK);
        grow(&mut self.values, CHUNK * head_dim);
        grow(&mut self.scores, query_heads * CHUNK);
        grow(&mut self.queries, query_heads * head_dim);
        grow(&mut self.chunk_out, query_heads * head_dim);
        grow(&mut self.chunk_max, query_heads);
        grow(&mut self.chunk_den, query_heads);
    }
}

/// One unit of parallel work (see the module docs).
#[derive(Debug, Clone, Copy)]
struct Task {
    seq: usize,
    /// First row of the tile, within its sequence.
    row: usize,
    rows: usize,
    kv_head: usize,
    /// Chunks `chunks.0..chunks.1`, in order.
    chunks: (usize, usize),
    /// Whether this task is one run of a split tile: it records each
    /// chunk's own state for the fold after every task is done, rather than
    /// folding its chunks itself (which would fold in another order).
    split: bool,
}

/// Attention of every row of every sequence for one `layer`, written to
/// `out` as `[row][num_heads][head_dim]` rows in batch order. `None`
/// sequences failed earlier: their rows are zeros.
pub fn attend<E: KvValue>(
    config: &ModelConfig,
    layer: usize,
    batch: &[Option<SequenceQueries<'_, '_, E>>],
    rows_of: &[usize],
    out: &mut [f32],
) {
    let hd = config.head_dim;
    let group = config.num_heads / config.num_kv_heads;
    let q_dim = config.q_dim();
    let window = config.attention_window(layer).unwrap_or(usize::MAX);
    assert!(window > 0, "a row always sees its own position");
    assert_eq!(
        out.len(),
        rows_of.iter().sum::<usize>() * q_dim,
        "attention output must hold every row of the pass"
    );
    let mut tasks = Vec::new();
    // Tasks run together, one job to a thread at a time: ranges of `tasks`.
    let mut jobs: Vec<std::ops::Range<usize>> = Vec::new();
    let mut macs = 0usize;
    for (seq, part) in batch.iter().enumerate() {
        let Some(part) = part else { continue };
        assert_eq!(
            part.rows, rows_of[seq],
            "a sequence's rows must match the pass's"
        );
        assert!(
            part.view.len() >= part.past + part.rows,
            "the view must cover every position the rows attend to"
        );
        assert!(
            part.view.first_page() * part.view.page_size()
                <= visible(part.past, window).start / CHUNK * CHUNK,
            "the view must start by the first chunk the rows read"
        );
        let single_tile = part.rows <= TILE_ROWS;
        for row in (0..part.rows).step_by(TILE_ROWS) {
            let rows = TILE_ROWS.min(part.rows - row);
            let end = part.past + row + rows;
            // Chunks wholly before the tile's first row's window are skipped.
            let first = visible(part.past + row, window).start / CHUNK;
            let chunks = end.div_ceil(CHUNK);
            macs += rows * (end - first * CHUNK).min(window) * q_dim * 2;
            if single_tile && chunks > first + 1 {
                // A decode row: runs of chunks over the threads, each run
                // one job for every KV head, so a job reads each page's
                // blocks of a layer together.
                for (c, end) in job_chunks(first..chunks) {
                    let start = tasks.len();
                    tasks.extend((0..config.num_kv_heads).map(|kv_head| Task {
                        seq,
                        row,
                        rows,
                        kv_head,
                        chunks: (c, end),
                        split: true,
                    }));
                    jobs.push(start..tasks.len());
                }
            } else {
                for kv_head in 0..config.num_kv_heads {
                    jobs.push(tasks.len()..tasks.len() + 1);
                    tasks.push(Task {
                        seq,
                        row,
                        rows,
                        kv_head,
                        chunks: (first, chunks),
                        split: false,
                    });
                }
            }
        }
    }
    let run = |job: &std::ops::Range<usize>| {
        let job = &tasks[job.clone()];
        let part = batch[job[0].seq]
            .as_ref()
            .expect("tasks exist only for live sequences");
        let outputs = SCRATCH.with_borrow_mut(|scratch| {
            scratch.fit(hd, TILE_ROWS * group * job.len());
            run_job(config, layer, part, job, scratch)
        });
        job.iter().copied().zip(outputs).collect::<Vec<_>>()
    };
    let mut results: Vec<(Task, TaskOutput)> = if macs >= PARALLEL_MIN_MACS {
        crate::awake::each_job(jobs.len(), |j| run(&jobs[j]))
            .into_iter()
            .flatten()
            .collect()
    } else {
        jobs.iter().flat_map(run).collect()
    };
    // The fold below wants each (tile, KV head)'s tasks adjacent, in chunk
    // order.
    results.sort_by_key(|(t, _)| (t.seq, t.row, t.kv_head, t.chunks.0));

    // Row offsets of each sequence in `out`.
    let mut first_row = Vec::with_capacity(rows_of.len());
    let mut next = 0;
    for &n in rows_of {
        first_row.push(next);
        next += n;
    }
    for (seq, part) in batch.iter().enumerate() {
        if part.is_none() {
            let rows = first_row[seq]..first_row[seq] + rows_of[seq];
            out[rows.start * q_dim..rows.end * q_dim].fill(0.0);
        }
    }
    // Tasks of one (tile, KV head) are adjacent and in chunk order: a
    // folded task is the tile's whole state; a split tile's runs are folded
    // here chunk by chunk, in order, exactly as one task would have.
    let mut results = results.into_iter().peekable();
    while let Some((task, output)) = results.next() {
        let part = batch[task.seq]
            .as_ref()
            .expect("tasks exist only for live sequences");
        let state = match output {
            TaskOutput::Folded(state) => state,
            TaskOutput::Chunks(first) => {
                let mut state = State::new(task.rows * group, hd);
                let mut fold = |task: &Task, chunks: &ChunkStates| {
                    for (i, c) in (task.chunks.0..task.chunks.1).enumerate() {
                        for r in 0..task.rows {
                            if !sees_chunk(part.past + task.row + r, window, c * CHUNK) {
                                continue;
                            }
                            for h in r * group..(r + 1) * group {
                                let (max, den, num) = chunks.head(i, h);
                                state.fold(h, max, den, num);
                            }
                        }
                    }
                };
                fold(&task, &first);
                while let Some((later, output)) = results.next_if(|(t, _)| {
                    (t.seq, t.row, t.kv_head) == (task.seq, task.row, task.kv_head)
                }) {
                    let TaskOutput::Chunks(chunks) = output else {
                        unreachable!("a split tile's tasks all record their chunks")
                    };
                    fold(&later, &chunks);
                }
                state
            }
        };
        for r in 0..task.rows {
            let line = (first_row[task.seq] + task.row + r) * q_dim;
            let heads = &mut out[line + task.kv_head * group * hd..][..group * hd];
            for g in 0..group {
                let h = r * group + g;
                assert!(state.seen[h], "every row attends to its own position");
                let inv = 1.0 / state.den[h];
                for (o, &n) in heads[g * hd..(g + 1) * hd]
                    .iter_mut()
                    .zip(&state.num[h * hd..(h + 1) * hd])
                {
                    *o = n * inv;
                }
            }
        }
    }
}

/// Runs one job: tasks of one tile over the same chunks, one per KV head,
/// chunk by chunk and within a chunk head by head (so a page's blocks of
/// this layer are read together). Each task's query heads of its KV group
/// are folded in order, or each chunk's state recorded for a split tile.
/// Heads of rows that see none of a chunk skip it.
fn run_job<E: KvValue>(
    config: &ModelConfig,
    layer: usize,
    part: &SequenceQueries<'_, '_, E>,
    job: &[Task],
    scratch: &mut Scratch,
) -> Vec<TaskOutput> {
    let first = job[0];
    assert!(
        job.iter().all(|t| (t.seq, t.row, t.rows, t.chunks, t.split)
            == (first.seq, first.row, first.rows, first.chunks, first.split)),
        "a job's tasks share their tile and chunks"
    );
    let hd = config.head_dim;
    let group = config.num_heads / config.num_kv_heads;
    let heads = first.rows * group;
    let window = config.attention_window(layer).unwrap_or(usize::MAX);
    let scale = 1.0 / (hd as f32).sqrt();
    // Task k's scaled queries start at row k · heads.
    for (k, task) in job.iter().enumerate() {
        for r in 0..task.rows {
            let line = &part.queries[(task.row + r) * part.stride..];
            let src = &line[task.kv_head * group * hd..(task.kv_head + 1) * group * hd];
            let at = (k * heads + r * group) * hd;
            for (d, &q) in scratch.queries[at..at + group * hd].iter_mut().zip(src) {
                *d = q * scale;
            }
        }
    }
    let mut outputs: Vec<TaskOutput> = job
        .iter()
        .map(|task| {
            if task.split {
                TaskOutput::Chunks(ChunkStates::new(task.chunks.1 - task.chunks.0, heads, hd))
            } else {
                TaskOutput::Folded(State::new(heads, hd))
            }
        })
        .collect();
    // Under a SIMD kernel the job's KV is asked for a few blocks ahead of
    // its reads: each chunk's key blocks then value rows, head by
    // head, in the order the kernel reads them.
    #[cfg(target_arch = "x86_64")]
    let mut chunk_offsets = Vec::new();
    #[cfg(target_arch = "x86_64")]
    let mut ahead = match simd_kernel(hd) {
        Some(_) => {
            let mut ahead = ahead::Ahead::new(std::mem::take(&mut scratch.runs));
            for c in first.chunks.0..first.chunks.1 {
                let (start, len) = chunk_span(part, &first, c);
                for task in job {
                    chunk_offsets.push(ahead.len());
                    for (page, slot, run, _) in page_runs(part.view.page_size(), start, len) {
                        ahead
                            .push_keys(part.view.keys(page, layer, task.kv_head), slot..slot + run);
                    }
                    for (page, slot, run, _) in page_runs(part.view.page_size(), start, len) {
                        let values = part.view.values(page, layer, task.kv_head);
                        ahead.push(&values[slot * hd..(slot + run) * hd]);
                    }
                }
            }
            Some(ahead)
        }
        None => None,
    };
    for c in first.chunks.0..first.chunks.1 {
        for (k, (task, output)) in job.iter().zip(&mut outputs).enumerate() {
            let (start, len) = chunk_span(part, task, c);
            let simd = simd_kernel(hd);
            let key_runs = || {
                page_runs(part.view.page_size(), start, len).map(|(page, slot, run, _)| {
                    (part.view.keys(page, layer, task.kv_head), slot..slot + run)
                })
            };
            #[cfg(target_arch = "x86_64")]
            if let Some(ahead) = ahead.as_mut() {
                ahead.reached(chunk_offsets[(c - task.chunks.0) * job.len() + k]);
            }
            // The SIMD kernels read whole 16-slot blocks of keys where they
            // lie; a chunk with a partial block (the last page, odd page
            // sizes) is staged instead.
            #[cfg(target_arch = "x86_64")]
            let in_pages = simd.and_then(|_| blocks::KeyBlocks::from_pages(key_runs()));
            #[cfg(not(target_arch = "x86_64"))]
            let in_pages: Option<std::convert::Infallible> = {
                let _ = key_runs;
                None
            };
            if in_pages.is_none() {
                stage(
                    part.view,
                    layer,
                    task.kv_head,
                    start,
                    len,
                    hd,
                    scratch,
                    simd.is_none(),
                );
            }
            let Scratch {
                keys,
                values,
                scores,
                queries,
                chunk_out,
                chunk_max,
                chunk_den,
                ..
            } = scratch;
            let cols = len.next_multiple_of(KEY_STEP);
            let shape = ChunkShape {
                heads,
                group,
                head_dim: hd,
                cols,
                start,
                first_row_end: part.past + task.row + 1,
                window,
                len,
            };
            // One kernel call per chunk; a macro because the kernels take
            // keys and values of different types.
            macro_rules! data {
                ($keys:expr, $values:expr) => {
                    ChunkData {
                        queries: &queries[k * heads * hd..(k + 1) * heads * hd],
                        keys: $keys,
                        values: $values,
                        scores,
                        out: chunk_out,
                        max: chunk_max,
                        den: chunk_den,
                    }
                };
            }
            match simd {
                #[cfg(target_arch = "x86_64")]
                Some(simd) => {
                    let mut runs = [&[] as &[E]; CHUNK];
                    let mut count = 0;
                    for (page, slot, run, _) in page_runs(part.view.page_size(), start, len) {
                        runs[count] = &part.view.values(page, layer, task.kv_head)
                            [slot * hd..(slot + run) * hd];
                        count += 1;
                    }
                    let runs = &runs[..count];
                    // Four calls for two kernels and two key sources, each its
                    // own monomorphisation.
                    let ahead = ahead.as_mut().expect("a SIMD job has its plan");
                    match (simd, in_pages) {
                        (Simd::Avx512(cpu), Some(in_pages)) => {
                            avx512::chunk(cpu, data!(in_pages, runs), shape, ahead)
                        }
                        (Simd::Avx2(cpu), Some(in_pages)) => {
                            avx2::chunk(cpu, data!(in_pages, runs), shape, ahead)
                        }
                        (Simd::Avx512(cpu), None) => {
                            let staged = blocks::KeyBlocks::staged(keys, hd, cols);
                            avx512::chunk(cpu, data!(staged, runs), shape, ahead);
                        }
                        (Simd::Avx2(cpu), None) => {
                            let staged = blocks::KeyBlocks::staged(keys, hd, cols);
                            avx2::chunk(cpu, data!(staged, runs), shape, ahead);
                        }
                    }
                }
                _ => chunk_kernel(data!(keys, &values[..]), shape),
            }
            let state = match output {
                TaskOutput::Chunks(chunks) => {
                    chunks.record(c - task.chunks.0, chunk_max, chunk_den, chunk_out);
                    continue;
                }
                TaskOutput::Folded(state) => state,
            };
            for r in 0..task.rows {
                if !sees_chunk(part.past + task.row + r, window, start) {
                    continue;
                }
                for g in 0..group {
                    let h = r * group + g;
                    state.fold(
                        h,
                        chunk_max[h],
                        chunk_den[h],
                        &chunk_out[h * hd..(h + 1) * hd],
                    );
                }
            }
        }
    }
    #[cfg(target_arch = "x86_64")]
    if let Some(ahead) = ahead {
        scratch.runs = ahead.into_runs();
    }
    outputs
}

/// The first position and length of chunk `c` of `task`'s tile: a whole
/// [`CHUNK`], or the part of the last one up to the tile's last row.
fn chunk_span<E: KvValue>(
    part: &SequenceQueries<'_, '_, E>,
    task: &Task,
    c: usize,
) -> (usize, usize) {
    let start = c * CHUNK;
    let tile_end = part.past + task.row + task.rows;
    (start, CHUNK.min(tile_end - start))
}

/// A single-tile sequence's `chunks` split across the worker threads: as
/// many runs as [`DECODE_JOBS_PER_THREAD`] asks (fewer if there are fewer
/// chunks), of sizes that differ by at most one chunk, so the threads
/// finish together (runs of a fixed size left 33 chunks as six runs of
/// five and one of three: one thread did a third more).
fn job_chunks(chunks: std::ops::Range<usize>) -> impl Iterator<Item = (usize, usize)> {
    let total = chunks.len();
    let jobs = (rayon::current_num_threads() * DECODE_JOBS_PER_THREAD).clamp(1, total.max(1));
    let at = move |i: usize| chunks.start + i * total / jobs;
    (0..jobs)
        .map(move |i| (at(i), at(i + 1)))
        .filter(|(c, end)| c < end)
}

/// The positions a row at `position` attends to with a window of `window`
/// positions (`usize::MAX`: all before it).
fn visible(position: usize, window: usize) -> std::ops::Range<usize> {
    (position + 1).saturating_sub(window)..position + 1
}

/// Whether a row at `position` attends to any position of the chunk that
/// starts at `start`.
fn sees_chunk(position: usize, window: usize, start: usize) -> bool {
    let seen = visible(position, window);
    start < seen.end && seen.start < start + CHUNK
}

/// A hand-written chunk kernel: AVX-512's where the CPU has it, else
/// AVX2's.
#[cfg(target_arch = "x86_64")]
#[derive(Debug, Clone, Copy)]
enum Simd {
    Avx512(avx512::Cpu),
    Avx2(avx2::Avx2),
}

/// The widest hand-written chunk kernel the CPU (and
/// [`crate::isa::widest_isa`]) allows for heads of `hd`; `None` means the
/// portable [`chunk_kernel`]. All give the same bits.
#[cfg(target_arch = "x86_64")]
fn simd_kernel(hd: usize) -> Option<Simd> {
    let wide = avx512::Cpu::detect()
        .filter(|_| avx512::handles(hd) && wide_enough(IsaCap::Avx512))
        .map(Simd::Avx512);
    wide.or_else(|| {
        avx2::Avx2::detect()
            .filter(|_| avx2::handles(hd) && wide_enough(IsaCap::Avx2))
            .map(Simd::Avx2)
    })
}

/// Whether [`crate::isa::widest_isa`] allows hand-written kernels of
/// `isa`.
#[cfg(target_arch = "x86_64")]
fn wide_enough(isa: IsaCap) -> bool {
    crate::isa::widest_isa() >= isa
}

#[cfg(not(target_arch = "x86_64"))]
fn simd_kernel(_hd: usize) -> Option<std::convert::Infallible> {
    None
}

/// The runs of consecutive slots within one page that positions
/// `start..start + len` fall into, in order, as `(page, slot, run, j)`;
/// `j` is the run's first position counted from `start`.
fn page_runs(
    page_size: usize,
    start: usize,
    len: usize,
) -> impl Iterator<Item = (usize, usize, usize, usize)> {
    let end = start + len;
    let mut pos = start;
    std::iter::from_fn(move || {
        (pos < end).then(|| {
            let (page, slot) = (pos / page_size, pos % page_size);
            let run = (page_size - slot).min(end - pos);
            let item = (page, slot, run, pos - start);
            pos += run;
            item
        })
    })
}

/// Copies positions `start..start + len` of one KV head into the scratch:
/// keys as `[head_dim][CHUNK]` columns zero-padded to a whole
/// [`KEY_STEP`], and values as rows when `with_values` (the SIMD kernels
/// read them from the pages). Pages store keys as columns already, so
/// staging only widens.
#[allow(clippy::too_many_arguments)]
fn stage<E: KvValue>(
    view: &ReadView<'_, E>,
    layer: usize,
    kv_head: usize,
    start: usize,
    len: usize,
    hd: usize,
    scratch: &mut Scratch,
    with_values: bool,
) {
    debug_assert!(len > 0 && len <= CHUNK);
    for (page, slot, run, j) in page_runs(view.page_size(), start, len) {
        if with_values {
            let values = &view.values(page, layer, kv_head)[slot * hd..(slot + run) * hd];
            widen_fast(values, &mut scratch.values[j * hd..(j + run) * hd]);
        }
        let keys = view.keys(page, layer, kv_head);
        let fast = stage_columns_fast(keys, slot..slot + run, &mut scratch.keys, j);
        if fast < run {
            for (d, column) in keys.columns().enumerate() {
                let dst = &mut scratch.keys[d * CHUNK + j + fast..d * CHUNK + j + run];
                E::widen(&column[slot + fast..slot + run], dst);
            }
        }
    }
    for d in 0..hd {
        scratch.keys[d * CHUNK + len..d * CHUNK + len.next_multiple_of(KEY_STEP)].fill(0.0);
    }
}

/// Stages what it can of `slots` of every key column by SIMD (whole blocks
/// of 8 slots) into column `first..` of the scratch rows, and returns how
/// many slots; the portable loop stages the rest.
fn stage_columns_fast<E: KvValue>(
    keys: Keys<'_, E>,
    slots: std::ops::Range<usize>,
    scratch: &mut [f32],
    first: usize,
) -> usize {
    #[cfg(target_arch = "x86_64")]
    if let Some(cpu) = avx2::Avx2::detect().filter(|_| wide_enough(IsaCap::Avx2)) {
        return avx2::stage_columns(cpu, keys, slots, scratch, CHUNK, first);
    }
    let _ = (keys, slots, scratch, first);
    0
}

/// Widens `src` into `dst` by SIMD where there is one.
fn widen_fast<E: KvValue>(src: &[E], dst: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if let Some(cpu) = avx2::Avx2::detect().filter(|_| wide_enough(IsaCap::Avx2)) {
        let done = avx2::widen(cpu, src, dst);
        E::widen(&src[done..], &mut dst[done..]);
        return;
    }
    E::widen(src, dst);
}

/// Sizes of one chunk's kernel call.
#[derive(Debug, Clone, Copy)]
struct ChunkShape {
    /// Query heads (tile rows × group), row-major.
    heads: usize,
    group: usize,
    head_dim: usize,
    /// Staged key columns, a multiple of [`KEY_STEP`].
    cols: usize,
    /// The chunk's first position.
    start: usize,
    /// The tile's first row sees positions `< first_row_end`; row `r`, `r`
    /// more.
    first_row_end: usize,
    /// Each row sees only the last `window` of those (`usize::MAX`: all).
    window: usize,
    /// Staged positions.
    len: usize,
}

/// The buffers of one chunk's kernel call. Values are staged rows for the
/// portable kernel, page runs for the SIMD ones.
struct ChunkData<'a, V: ?Sized = [f32], K = &'a [f32]> {
    /// Scaled queries, `[head][head_dim]`.
    queries: &'a [f32],
    /// Staged keys, `[head_dim][CHUNK]`, or for the SIMD kernels
    /// [`blocks::KeyBlocks`] (staged, or where they lie in the pages).
    keys: K,
    /// Values: staged `[CHUNK][head_dim]`, or runs of `[slot][head_dim]`
    /// covering the chunk's positions in order.
    values: &'a V,
    /// Scores, then weights, `[head][CHUNK]`.
    scores: &'a mut [f32],
    /// Unnormalised outputs, `[head][head_dim]`.
    out: &'a mut [f32],
    /// Maximum score per head.
    max: &'a mut [f32],
    /// Softmax denominator per head.
    den: &'a mut [f32],
}

per_isa! {
    /// Scores, softmax and weighted values of one chunk for a tile's query
    /// heads: per head its maximum, denominator and unnormalised output. Heads
    /// whose row sees no position of the chunk are left as they were.
    ///
    /// Compiled per instruction set ([`per_isa!`]); every product-and-sum
    /// is `f32::mul_add`, rounded once, so every variant gives the same
    /// bits.
    fn chunk_kernel<'a>(data: ChunkData<'a>, shape: ChunkShape) {
        let ChunkData {
            queries,
            keys,
            values,
            scores,
            out,
            max: maxes,
            den: dens,
        } = data;
        let ChunkShape {
            heads,
            head_dim: hd,
            cols,
            ..
        } = shape;
        // Scores: up to QUERY_STEP heads × KEY_STEP keys in registers.
        let mut h = 0;
        while h < heads {
            let step = QUERY_STEP.min(heads - h);
            let q = &queries[h * hd..(h + step) * hd];
            let s = &mut scores[h * CHUNK..(h + step) * CHUNK];
            match step {
                6 => score_step::<6>(q, keys, hd, cols, s),
                5 => score_step::<5>(q, keys, hd, cols, s),
                4 => score_step::<4>(q, keys, hd, cols, s),
                3 => score_step::<3>(q, keys, hd, cols, s),
                2 => score_step::<2>(q, keys, hd, cols, s),
                _ => score_step::<1>(q, keys, hd, cols, s),
            }
            h += step;
        }
        softmax_rows(scores, maxes, dens, shape);
        // Weighted values. Heads that see the same positions share each loaded
        // value row: every head of the tile when the whole chunk lies before
        // its first row (and within its last row's window), else the heads of
        // one row.
        for (first, end, n) in value_groups(shape) {
            let mut h = first;
            while h < end {
                let step = QUERY_STEP.min(end - h);
                let w = &scores[h * CHUNK..(h + step) * CHUNK];
                let o = &mut out[h * hd..(h + step) * hd];
                match step {
                    6 => value_step::<6>(w, values, hd, n, o),
                    5 => value_step::<5>(w, values, hd, n, o),
                    4 => value_step::<4>(w, values, hd, n, o),
                    3 => value_step::<3>(w, values, hd, n, o),
                    2 => value_step::<2>(w, values, hd, n, o),
                    _ => value_step::<1>(w, values, hd, n, o),
                }
                h += step;
            }
        }
    }
}

/// Softmax within the chunk, per head over the positions its row sees;
/// positions before its window weigh exactly zero. Replaces each head's
/// scores by its weights and sets its maximum and denominator; heads that
/// see none of the chunk are left as they were. Inlined into each kernel
/// that does not vectorise it itself.
#[inline(always)]
fn softmax_rows(scores: &mut [f32], maxes: &mut [f32], dens: &mut [f32], shape: ChunkShape) {
    let ChunkShape {
        heads,
        group,
        start,
        first_row_end,
        window,
        len,
        ..
    } = shape;
    for h in 0..heads {
        let (lo, n) = seen_in_chunk(first_row_end + h / group, window, start, len);
        if lo == n {
            continue;
        }
        let row = &mut scores[h * CHUNK..(h + 1) * CHUNK];
        let max = row[lo..n].iter().copied().fold(f32::NEG_INFINITY, f32::max);
        for s in &mut row[lo..n] {
            *s = exp(*s - max);
        }
        row[..lo].fill(0.0);
        let padded = n.next_multiple_of(SUM_LANES);
        row[n..padded].fill(0.0);
        let mut lanes = [0.0f32; SUM_LANES];
        for block in row[..padded].chunks_exact(SUM_LANES) {
            for (l, &e) in lanes.iter_mut().zip(block) {
                *l += e;
            }
        }
        maxes[h] = max;
        dens[h] = lanes.iter().sum::<f32>();
    }
}

/// Of a chunk's `len` staged positions from `start`, the range `lo..n` a
/// row that sees positions below `upto` with a window of `window` attends
/// to, relative to the chunk; empty when it sees none of them.
#[inline(always)]
fn seen_in_chunk(upto: usize, window: usize, start: usize, len: usize) -> (usize, usize) {
    let n = upto.saturating_sub(start).min(len);
    let lo = upto.saturating_sub(window).saturating_sub(start).min(n);
    (lo, n)
}

/// The heads that share one weighted sum of values, as `(first head, end
/// head, positions)`: every head of the tile over all `len` positions when
/// the whole chunk lies before its first row (and within its last row's
/// window), else the heads of each row that sees part of the chunk, over
/// the positions up to its own. Every kernel groups them so.
#[inline(always)]
fn value_groups(shape: ChunkShape) -> impl Iterator<Item = (usize, usize, usize)> {
    let ChunkShape {
        heads,
        group,
        start,
        first_row_end,
        window,
        len,
        ..
    } = shape;
    let whole = whole_chunk(shape);
    let rows = if whole { 0 } else { heads / group };
    let all = whole.then_some((0, heads, len));
    all.into_iter().chain((0..rows).filter_map(move |r| {
        let (lo, n) = seen_in_chunk(first_row_end + r, window, start, len);
        (lo < n).then_some((r * group, (r + 1) * group, n))
    }))
}

/// Whether every row of the tile attends to every position of the chunk
/// it stages, or to ones before them that weigh zero — one weighted sum
/// over all `len` positions serves all its heads.
#[inline(always)]
fn whole_chunk(shape: ChunkShape) -> bool {
    let last_row_end = shape.first_row_end + shape.heads / shape.group - 1;
    shape.first_row_end >= shape.start + shape.len
        && last_row_end.saturating_sub(shape.window) < shape.start + shape.len
}

/// Scores of `Q` heads against every staged key column: each the fused
/// chain over `d` ascending. Inlined into each instruction-set variant.
#[inline(always)]
fn score_step<const Q: usize>(
    queries: &[f32],
    keys: &[f32],
    hd: usize,
    cols: usize,
    scores: &mut [f32],
) {
    for j in (0..cols).step_by(KEY_STEP) {
        let mut acc = [[0.0f32; KEY_STEP]; Q];
        for d in 0..hd {
            let k: &[f32; KEY_STEP] = keys[d * CHUNK + j..][..KEY_STEP]
                .try_into()
                .expect("a key step is KEY_STEP wide");
            for (i, acc) in acc.iter_mut().enumerate() {
                let q = queries[i * hd + d];
                for (a, &kk) in acc.iter_mut().zip(k) {
                    *a = q.mul_add(kk, *a);
                }
            }
        }
        for (i, acc) in acc.iter().enumerate() {
            scores[i * CHUNK + j..][..KEY_STEP].copy_from_slice(acc);
        }
    }
}

/// Dimensions of the value accumulators kept in registers at once.
const DIM_STEP: usize = 16;

/// Unnormalised outputs of `Q` heads over the first `n` staged values: per
/// element the fused chain over positions ascending.
#[inline(always)]
fn value_step<const Q: usize>(
    weights: &[f32],
    values: &[f32],
    hd: usize,
    n: usize,
    out: &mut [f32],
) {
    let mut d = 0;
    while d < hd {
        let width = DIM_STEP.min(hd - d);
        if width == DIM_STEP {
            let mut acc = [[0.0f32; DIM_STEP]; Q];
            for j in 0..n {
                let v: &[f32; DIM_STEP] = values[j * hd + d..][..DIM_STEP]
                    .try_into()
                    .expect("a value step is DIM_STEP wide");
                for (i, acc) in acc.iter_mut().enumerate() {
                    let e = weights[i * CHUNK + j];
                    for (a, &x) in acc.iter_mut().zip(v) {
                        *a = e.mul_add(x, *a);
                    }
                }
            }
            for (i, acc) in acc.iter().enumerate() {
                out[i * hd + d..][..DIM_STEP].copy_from_slice(acc);
            }
        } else {
            for i in 0..Q {
                for dd in d..d + width {
                    let mut a = 0.0f32;
                    for j in 0..n {
                        a = weights[i * CHUNK + j].mul_add(values[j * hd + dd], a);
                    }
                    out[i * hd + dd] = a;
                }
            }
        }
        d += width;
    }
}

#[cfg(test)]
mod tests;

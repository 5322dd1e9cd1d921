//! AVX2 kernels. With AVX2 but no AVX-512, [`chunk`] is the chunk kernel:
//! the AVX-512 one's structure in 8-lane vectors, reading keys and values
//! where they lie in the pages, with the portable kernel's operations in
//! its order, so the same bits. And on any CPU with AVX2, the staging of a
//! chunk's keys and values when a kernel needs them staged: page columns
//! and rows widened to f32, 8 elements at a time. Staging only moves and
//! widens values — every f16 and bf16 value is exact in f32 — so this path
//! and the portable one store the same bits.
//!
//! The intrinsics are `unsafe` only because they must not run on a CPU
//! without AVX2, FMA and F16C. That obligation lives in one type: an
//! [`Avx2`] exists only where detection found all three, and every entry
//! point takes one.

#![allow(unsafe_code)]

use std::arch::x86_64::*;
use std::ops::Range;

use half::{bf16, f16};
use kvfence_pool::Keys;

use super::ahead::Ahead;
use super::blocks::{BLOCK, KeyBlocks};
use super::{CHUNK, ChunkData, ChunkShape, QUERY_STEP};

/// Lanes of one vector.
const LANES: usize = 8;

/// Proof that this CPU has AVX2, FMA and F16C: only [`Avx2::detect`]
/// makes one.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Avx2(());

impl Avx2 {
    /// `Some` where the CPU runs this module's code.
    pub(crate) fn detect() -> Option<Avx2> {
        (is_x86_feature_detected!("avx2")
            && is_x86_feature_detected!("fma")
            && is_x86_feature_detected!("f16c"))
        .then_some(Avx2(()))
    }
}

/// Loads 8 consecutive elements as f32. Public only as a sealed supertrait
/// of [`super::KvValue`].
pub trait Widen8: Copy {
    /// # Safety
    /// `src` must be valid for reading 8 elements, and the CPU must have
    /// AVX2 and F16C.
    unsafe fn load8(src: *const Self) -> __m256;
}

impl Widen8 for f32 {
    #[inline(always)]
    unsafe fn load8(src: *const f32) -> __m256 {
        // SAFETY: the caller guarantees 8 readable elements.
        unsafe { _mm256_loadu_ps(src) }
    }
}

impl Widen8 for f16 {
    #[inline(always)]
    unsafe fn load8(src: *const f16) -> __m256 {
        // SAFETY: the caller guarantees 8 readable elements (16 bytes) and F16C.
        unsafe { _mm256_cvtph_ps(_mm_loadu_si128(src.cast())) }
    }
}

impl Widen8 for bf16 {
    #[inline(always)]
    unsafe fn load8(src: *const bf16) -> __m256 {
        // SAFETY: the caller guarantees 8 readable elements (16 bytes) and AVX2.
        unsafe {
            let wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(src.cast()));
            _mm256_castsi256_ps(_mm256_slli_epi32::<16>(wide))
        }
    }
}

/// `keys[d * stride + first + j] = columns.column(d)[slots.start + j]` for
/// every dimension `d` and the whole 8-element blocks of `slots`; returns
/// how many slots it staged (a multiple of 8), leaving the rest to the
/// caller. Keys are stored as columns, so this is a widening copy: no
/// transpose.
pub(crate) fn stage_columns<E: Widen8>(
    _cpu: Avx2,
    columns: Keys<'_, E>,
    slots: Range<usize>,
    keys: &mut [f32],
    stride: usize,
    first: usize,
) -> usize {
    let hd = columns.head_dim();
    let whole = slots.len() - slots.len() % 8;
    assert!(
        slots.end <= columns.slots(),
        "the slots are valid slots of the page"
    );
    assert!(
        hd == 0 || keys.len() >= (hd - 1) * stride + first + whole,
        "every staged column fits in the key scratch"
    );
    // SAFETY: `_cpu` proves AVX2 and F16C; the asserts above bound every
    // read (`slots.start + i + 8 <= slots.end` of a column) and write.
    unsafe {
        stage_column_blocks(
            columns,
            slots.start,
            whole,
            keys.as_mut_ptr(),
            stride,
            first,
        )
    };
    whole
}

#[target_feature(enable = "avx2,f16c")]
unsafe fn stage_column_blocks<E: Widen8>(
    columns: Keys<'_, E>,
    slot: usize,
    whole: usize,
    keys: *mut f32,
    stride: usize,
    first: usize,
) {
    for (d, column) in columns.columns().enumerate() {
        let src = column[slot..].as_ptr();
        for i in (0..whole).step_by(8) {
            // SAFETY: slot + i + 8 <= the column's length, and column
            // first + i.. + 8 of row d lies in the scratch (both checked by
            // `stage_columns`).
            unsafe { _mm256_storeu_ps(keys.add(d * stride + first + i), E::load8(src.add(i))) };
        }
    }
}

/// `dst[i] = src[i]` as f32 for the whole 8-element blocks; returns how
/// many elements it wrote, leaving the rest to the caller.
pub(crate) fn widen<E: Widen8>(_cpu: Avx2, src: &[E], dst: &mut [f32]) -> usize {
    assert_eq!(src.len(), dst.len(), "widening keeps the length");
    let whole = src.len() - src.len() % 8;
    // SAFETY: `_cpu` proves AVX2 and F16C; `whole <= len` bounds every
    // 8-element read and write.
    unsafe { widen_blocks(src.as_ptr(), dst.as_mut_ptr(), whole) };
    whole
}

#[target_feature(enable = "avx2,f16c")]
unsafe fn widen_blocks<E: Widen8>(src: *const E, dst: *mut f32, whole: usize) {
    for i in (0..whole).step_by(8) {
        // SAFETY: i + 8 <= whole, inside both slices (checked by `widen`).
        unsafe { _mm256_storeu_ps(dst.add(i), E::load8(src.add(i))) };
    }
}

/// Whether [`chunk`] handles heads of `head_dim` (whole vectors only).
pub(crate) fn handles(head_dim: usize) -> bool {
    head_dim > 0 && head_dim.is_multiple_of(LANES)
}

/// [`super::chunk_kernel`], bit for bit, for a `head_dim` that [`handles`]
/// accepts: scores read keys through [`KeyBlocks`] (staged, or where they
/// lie in the pages) and weighted values read their page runs (each
/// `[slot][head_dim]`, in position order), so nothing is staged when the
/// chunk's pages hold whole blocks. The softmax is the portable code's,
/// compiled here with AVX2 and FMA. It tells `ahead` what it is about to
/// read, block by block.
pub(crate) fn chunk<E: Widen8, K: Widen8>(
    _cpu: Avx2,
    data: ChunkData<'_, [&[E]], KeyBlocks<'_, K>>,
    shape: ChunkShape,
    ahead: &mut Ahead,
) {
    assert!(
        handles(shape.head_dim),
        "head_dim {} is not whole vectors",
        shape.head_dim
    );
    data.check(shape);
    // SAFETY: `_cpu` proves AVX2, FMA and F16C; the asserts above bound
    // every read and write the kernel makes (see each loop's bounds).
    unsafe { chunk_avx2(data, shape, ahead) }
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn chunk_avx2<E: Widen8, K: Widen8>(
    data: ChunkData<'_, [&[E]], KeyBlocks<'_, K>>,
    shape: ChunkShape,
    ahead: &mut Ahead,
) {
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
        ..
    } = shape;
    // Scores: QUERY_STEP heads × one block (two vectors) at a time.
    let mut h = 0;
    while h < heads {
        let step = QUERY_STEP.min(heads - h);
        let q = queries[h * hd..].as_ptr();
        let s = scores[h * CHUNK..].as_mut_ptr();
        let block_bytes = BLOCK * hd * std::mem::size_of::<K>();
        for b in 0..keys.count() {
            // Only the first heads read the keys from memory.
            if h == 0 {
                ahead.reading(block_bytes);
            }
            // SAFETY: heads h..h + step have hd queries and CHUNK scores
            // each; block b < count.
            unsafe {
                match step {
                    6 => score_block::<K, 6>(q, &keys, b, s),
                    5 => score_block::<K, 5>(q, &keys, b, s),
                    4 => score_block::<K, 4>(q, &keys, b, s),
                    3 => score_block::<K, 3>(q, &keys, b, s),
                    2 => score_block::<K, 2>(q, &keys, b, s),
                    _ => score_block::<K, 1>(q, &keys, b, s),
                }
            }
        }
        h += step;
    }
    super::softmax_rows(scores, maxes, dens, shape);
    // Weighted values, grouped as the portable kernel groups them.
    let mut first_read = true;
    for (first, end, n) in super::value_groups(shape) {
        let mut h = first;
        while h < end {
            let step = QUERY_STEP.min(end - h);
            // Only the first heads read the values from memory.
            let ahead = std::mem::take(&mut first_read).then_some(&mut *ahead);
            let w = scores[h * CHUNK..].as_ptr();
            let o = out[h * hd..].as_mut_ptr();
            // SAFETY: heads h..h + step have CHUNK weights and hd outputs;
            // the runs hold at least n ≤ len positions of hd values.
            unsafe {
                match step {
                    6 => value_heads::<E, 6>(w, values, hd, n, o, ahead),
                    5 => value_heads::<E, 5>(w, values, hd, n, o, ahead),
                    4 => value_heads::<E, 4>(w, values, hd, n, o, ahead),
                    3 => value_heads::<E, 3>(w, values, hd, n, o, ahead),
                    2 => value_heads::<E, 2>(w, values, hd, n, o, ahead),
                    _ => value_heads::<E, 1>(w, values, hd, n, o, ahead),
                }
            }
            h += step;
        }
    }
}

/// `scores[i][16 · b + l] = Σ_d q_i[d] · k[d][l]` of key block `b`, as one
/// fused chain over `d` ascending from zero, for `Q` heads: 2 · Q
/// accumulators, at most 12 of the 16 registers.
///
/// # Safety
/// AVX2 and FMA; `queries` holds `Q × head_dim` floats, `scores` `Q` rows
/// of [`CHUNK`]; `b < keys.count()`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn score_block<K: Widen8, const Q: usize>(
    queries: *const f32,
    keys: &KeyBlocks<'_, K>,
    b: usize,
    scores: *mut f32,
) {
    let hd = keys.head_dim();
    let mut acc = [[_mm256_setzero_ps(); 2]; Q];
    for d in 0..hd {
        // SAFETY: b < count, d < hd: 16 elements the maker checked.
        let column = unsafe { keys.column(b, d) };
        // SAFETY: lanes 0..8 and 8..16 of those 16.
        let k = unsafe { [K::load8(column), K::load8(column.add(LANES))] };
        for (i, acc) in acc.iter_mut().enumerate() {
            // SAFETY: head i < Q, dimension d < hd.
            let q = _mm256_set1_ps(unsafe { *queries.add(i * hd + d) });
            for (a, &k) in acc.iter_mut().zip(&k) {
                *a = _mm256_fmadd_ps(q, k, *a);
            }
        }
    }
    for (i, acc) in acc.iter().enumerate() {
        for (half, &a) in acc.iter().enumerate() {
            // SAFETY: head i < Q, columns 16b + 8·half.. + 8 <= cols <= CHUNK.
            unsafe { _mm256_storeu_ps(scores.add(i * CHUNK + b * BLOCK + half * LANES), a) };
        }
    }
}

/// Unnormalised outputs of `Q` heads over the first `n` positions of the
/// value runs, two blocks of 8 dimensions at a time, then one.
///
/// # Safety
/// AVX2 and FMA; `weights` holds `Q` rows of [`CHUNK`] with `n` valid,
/// `out` `Q` rows of `hd`; `hd` is whole vectors, each run whole rows of
/// `hd`, and the runs hold at least `n` rows.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn value_heads<E: Widen8, const Q: usize>(
    weights: *const f32,
    runs: &[&[E]],
    hd: usize,
    n: usize,
    out: *mut f32,
    mut ahead: Option<&mut Ahead>,
) {
    let mut d = 0;
    while d + 2 * LANES <= hd {
        // SAFETY: forwarded; d + 16 <= hd.
        unsafe { value_block::<E, Q, 2>(weights, runs, hd, n, d, out, ahead.take()) };
        d += 2 * LANES;
    }
    while d < hd {
        // SAFETY: forwarded; d + 8 <= hd (hd is whole vectors).
        unsafe { value_block::<E, Q, 1>(weights, runs, hd, n, d, out, ahead.take()) };
        d += LANES;
    }
}

/// `out[i][d + l] = Σ_j w_i[j] · v[j][d + l]` as one fused chain over
/// positions ascending from zero, for `Q` heads and `B` blocks of 8
/// dimensions, telling `ahead` (when this is the first pass over the runs)
/// of each run before it.
///
/// # Safety
/// As [`value_heads`], with `d + 8 · B <= hd`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn value_block<E: Widen8, const Q: usize, const B: usize>(
    weights: *const f32,
    runs: &[&[E]],
    hd: usize,
    n: usize,
    d: usize,
    out: *mut f32,
    mut ahead: Option<&mut Ahead>,
) {
    let mut acc = [[_mm256_setzero_ps(); B]; Q];
    let mut j = 0;
    'runs: for run in runs {
        if let Some(ahead) = ahead.as_deref_mut() {
            ahead.reading(std::mem::size_of_val(*run));
        }
        for row in run.chunks_exact(hd) {
            if j == n {
                break 'runs;
            }
            let mut v = [_mm256_setzero_ps(); B];
            for (b, v) in v.iter_mut().enumerate() {
                // SAFETY: dimensions d + 8b.. + 8 <= hd, the row's length.
                *v = unsafe { E::load8(row.as_ptr().add(d + b * LANES)) };
            }
            for (i, acc) in acc.iter_mut().enumerate() {
                // SAFETY: head i < Q, position j < n <= CHUNK.
                let w = _mm256_set1_ps(unsafe { *weights.add(i * CHUNK + j) });
                for (a, &v) in acc.iter_mut().zip(&v) {
                    *a = _mm256_fmadd_ps(w, v, *a);
                }
            }
            j += 1;
        }
    }
    for (i, acc) in acc.iter().enumerate() {
        for (b, &a) in acc.iter().enumerate() {
            // SAFETY: head i < Q, dimensions d + 8b.. + 8 <= hd.
            unsafe { _mm256_storeu_ps(out.add(i * hd + d + b * LANES), a) };
        }
    }
}

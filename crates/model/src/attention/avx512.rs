//! AVX-512 version of [`super::chunk_kernel`], written with intrinsics
//! because the compiler keeps the portable kernel's accumulators in too
//! few registers: a decode row has only its group's three query heads, so
//! the portable score loop runs three dependent multiply-add chains (one
//! per head) and waits on their latency, with a bounds check per
//! multiply-add. Here each step keeps up to 6 heads × 4 key (or dimension)
//! blocks of 16 lanes in flight.
//!
//! Every function performs the portable kernel's operations in its order,
//! sixteen lanes at a time: the same fused multiply-add chains over `d`
//! (scores) and over positions (values), the same [`super::exp`] built from
//! the same roundings, the same 8-lane denominator summed the same way.
//! The tests in [`super::tests`] compare the two bit for bit over random
//! shapes and contents, poisoned ones included.
//!
//! The intrinsics are `unsafe` only because they must not run on a CPU
//! without AVX-512F. That obligation lives in one type: a [`Cpu`] exists
//! only where detection found AVX-512F, and [`chunk`] takes one.

#![allow(unsafe_code)]

use std::arch::x86_64::*;

use half::{bf16, f16};

use super::ahead::Ahead;
use super::blocks::KeyBlocks;

use super::{CHUNK, ChunkData, ChunkShape, KEY_STEP, QUERY_STEP, SUM_LANES};

/// Lanes of one vector: one key step, one block of dimensions.
const LANES: usize = 16;
/// Key blocks scored together, so a head's chains are independent.
const KEY_BLOCKS: usize = 4;
/// Dimension blocks accumulated together over a chunk's values.
const DIM_BLOCKS: usize = 4;

const _: () = assert!(KEY_STEP == LANES && SUM_LANES == 8 && CHUNK.is_multiple_of(LANES));

/// Proof that this CPU has AVX-512F: only [`Cpu::detect`] makes one.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Cpu(());

impl Cpu {
    /// `Some` where the CPU runs this module's code.
    pub(crate) fn detect() -> Option<Cpu> {
        is_x86_feature_detected!("avx512f").then_some(Cpu(()))
    }
}

/// Loads 16 consecutive elements as f32 (exactly: every f16 and bf16 is
/// an f32). Public only as a sealed supertrait of [`super::KvValue`].
pub trait Widen16: Copy {
    /// # Safety
    /// `src` must be valid for reading 16 elements, and the CPU must have
    /// AVX-512F.
    unsafe fn load16(src: *const Self) -> __m512;
}

impl Widen16 for f32 {
    #[inline(always)]
    unsafe fn load16(src: *const f32) -> __m512 {
        // SAFETY: the caller guarantees 16 readable elements and AVX-512F.
        unsafe { _mm512_loadu_ps(src) }
    }
}

impl Widen16 for f16 {
    #[inline(always)]
    unsafe fn load16(src: *const f16) -> __m512 {
        // SAFETY: the caller guarantees 16 readable elements (32 bytes) and
        // AVX-512F (which has the 16-lane half-to-single conversion).
        unsafe { _mm512_cvtph_ps(_mm256_loadu_si256(src.cast())) }
    }
}

impl Widen16 for bf16 {
    #[inline(always)]
    unsafe fn load16(src: *const bf16) -> __m512 {
        // SAFETY: the caller guarantees 16 readable elements (32 bytes) and
        // AVX-512F.
        unsafe {
            let wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(src.cast()));
            _mm512_castsi512_ps(_mm512_slli_epi32::<16>(wide))
        }
    }
}

/// Whether [`chunk`] handles heads of `head_dim` (whole vectors only).
pub(crate) fn handles(head_dim: usize) -> bool {
    head_dim > 0 && head_dim.is_multiple_of(LANES)
}

/// [`super::chunk_kernel`], bit for bit, for a `head_dim` that
/// [`handles`] accepts, reading keys through [`KeyBlocks`] (staged, or
/// where they lie in the pages) and values straight from their page runs
/// (each `[slot][head_dim]`, in position order) instead of a staged copy.
/// It tells `ahead` what it is about to read, block by block.
pub(crate) fn chunk<E: Widen16, K: Widen16>(
    _cpu: Cpu,
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
    // SAFETY: `_cpu` proves AVX-512F; the asserts above bound every read
    // and write the kernel makes (see each loop's bounds).
    unsafe { chunk_avx512(data, shape, ahead) }
}

#[target_feature(enable = "avx512f")]
unsafe fn chunk_avx512<E: Widen16, K: Widen16>(
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
        group,
        head_dim: hd,
        start,
        first_row_end,
        window,
        len,
        ..
    } = shape;
    // Scores: QUERY_STEP heads × KEY_BLOCKS key blocks at a time.
    let mut h = 0;
    while h < heads {
        let step = QUERY_STEP.min(heads - h);
        let q = queries[h * hd..].as_ptr();
        let s = scores[h * CHUNK..].as_mut_ptr();
        // Only the first heads read the keys from memory.
        let ahead = (h == 0).then_some(&mut *ahead);
        // SAFETY: heads h..h + step have hd queries and CHUNK scores each;
        // `keys` holds `cols / 16` blocks of hd dimensions (its makers
        // checked every one).
        unsafe {
            match step {
                6 => score_heads::<K, 6>(q, &keys, s, ahead),
                5 => score_heads::<K, 5>(q, &keys, s, ahead),
                4 => score_heads::<K, 4>(q, &keys, s, ahead),
                3 => score_heads::<K, 3>(q, &keys, s, ahead),
                2 => score_heads::<K, 2>(q, &keys, s, ahead),
                _ => score_heads::<K, 1>(q, &keys, s, ahead),
            }
        }
        h += step;
    }
    // Softmax within the chunk, per head over the positions its row sees.
    for h in 0..heads {
        let (lo, n) = super::seen_in_chunk(first_row_end + h / group, window, start, len);
        if lo == n {
            continue;
        }
        let row = &mut scores[h * CHUNK..(h + 1) * CHUNK];
        let (max, den) = softmax(row, lo, n);
        maxes[h] = max;
        dens[h] = den;
    }
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

/// Scores of `Q` heads against every key block, in runs of
/// [`KEY_BLOCKS`] blocks and then single blocks, telling `ahead` (when
/// these heads are the first to read the keys) of each run before it.
///
/// # Safety
/// AVX-512F; `queries` holds `Q × head_dim` floats, `scores` `Q` rows of
/// [`CHUNK`].
#[inline]
#[target_feature(enable = "avx512f")]
unsafe fn score_heads<K: Widen16, const Q: usize>(
    queries: *const f32,
    keys: &KeyBlocks<'_, K>,
    scores: *mut f32,
    mut ahead: Option<&mut Ahead>,
) {
    let block_bytes = LANES * keys.head_dim() * std::mem::size_of::<K>();
    let mut b = 0;
    while b + KEY_BLOCKS <= keys.count() {
        if let Some(ahead) = ahead.as_deref_mut() {
            ahead.reading(KEY_BLOCKS * block_bytes);
        }
        // SAFETY: forwarded; blocks b..b + 4 exist.
        unsafe { score_block::<K, Q, KEY_BLOCKS>(queries, keys, b, scores) };
        b += KEY_BLOCKS;
    }
    while b < keys.count() {
        if let Some(ahead) = ahead.as_deref_mut() {
            ahead.reading(block_bytes);
        }
        // SAFETY: forwarded; block b exists.
        unsafe { score_block::<K, Q, 1>(queries, keys, b, scores) };
        b += 1;
    }
}

/// `scores[i][16 · (first + b) + l] = Σ_d q_i[d] · k[d][l]` of block
/// `first + b`, as one fused chain over `d` ascending from zero, for `Q`
/// heads and `B` blocks of 16 keys.
///
/// # Safety
/// As [`score_heads`], with blocks `first..first + B` in `keys`.
#[inline]
#[target_feature(enable = "avx512f")]
unsafe fn score_block<K: Widen16, const Q: usize, const B: usize>(
    queries: *const f32,
    keys: &KeyBlocks<'_, K>,
    first: usize,
    scores: *mut f32,
) {
    let hd = keys.head_dim();
    let mut acc = [[_mm512_setzero_ps(); B]; Q];
    for d in 0..hd {
        let mut k = [_mm512_setzero_ps(); B];
        for (b, k) in k.iter_mut().enumerate() {
            // SAFETY: block first + b < count (the caller's), d < hd.
            *k = unsafe { K::load16(keys.column(first + b, d)) };
        }
        for (i, acc) in acc.iter_mut().enumerate() {
            // SAFETY: head i < Q, dimension d < hd.
            let q = _mm512_set1_ps(unsafe { *queries.add(i * hd + d) });
            for (a, &k) in acc.iter_mut().zip(&k) {
                *a = _mm512_fmadd_ps(q, k, *a);
            }
        }
    }
    for (i, acc) in acc.iter().enumerate() {
        for (b, &a) in acc.iter().enumerate() {
            let column = (first + b) * LANES;
            // SAFETY: head i < Q, columns column.. + 16 <= cols <= CHUNK.
            unsafe { _mm512_storeu_ps(scores.add(i * CHUNK + column), a) };
        }
    }
}

/// Lanes `0..n` of a 16-lane block (all when `n >= 16`).
#[inline]
fn lanes_below(n: usize) -> __mmask16 {
    if n >= LANES { !0 } else { (1u16 << n) - 1 }
}

/// Lanes of the 16-lane block at `b` whose positions lie in `lo..n`.
#[inline]
fn lanes_between(lo: usize, n: usize, b: usize) -> __mmask16 {
    lanes_below(n.saturating_sub(b)) & !lanes_below(lo.saturating_sub(b))
}

/// Replaces `row[lo..n]` by its exponentials against their maximum and
/// `row[..lo]` by zeros, and returns `(maximum, denominator)`: the
/// portable kernel's fold with `f32::max` (NaN scores ignored),
/// [`super::exp`], and 8-lane sum.
#[inline]
#[target_feature(enable = "avx512f")]
fn softmax(row: &mut [f32], lo: usize, n: usize) -> (f32, f32) {
    assert!(lo < n && n <= row.len() && row.len() >= n.next_multiple_of(LANES));
    let floor = _mm512_set1_ps(f32::NEG_INFINITY);
    let mut top = floor;
    for b in (0..n).step_by(LANES) {
        // SAFETY: b + 16 <= row.len() (checked above).
        let x =
            unsafe { _mm512_mask_loadu_ps(floor, lanes_between(lo, n, b), row.as_ptr().add(b)) };
        // `vmaxps` returns its second operand when either is NaN: the
        // running maximum, which never is — `f32::max`'s rule.
        top = _mm512_max_ps(x, top);
    }
    let max = _mm512_reduce_max_ps(top);
    let mut lanes = _mm256_setzero_ps();
    for b in (0..n).step_by(LANES) {
        let keep = lanes_between(lo, n, b);
        // SAFETY: as above.
        let s = unsafe { _mm512_loadu_ps(row.as_ptr().add(b)) };
        let e = _mm512_maskz_mov_ps(keep, exp16(_mm512_sub_ps(s, _mm512_set1_ps(max))));
        // SAFETY: as above.
        unsafe { _mm512_storeu_ps(row.as_mut_ptr().add(b), e) };
        // Blocks of 8 in order, as the portable sum; zeros past `n` add
        // nothing (the lanes are never −0).
        lanes = _mm256_add_ps(lanes, _mm512_castps512_ps256(e));
        lanes = _mm256_add_ps(
            lanes,
            _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(e))),
        );
    }
    let mut sum = [0.0f32; SUM_LANES];
    // SAFETY: `sum` holds 8 floats.
    unsafe { _mm256_storeu_ps(sum.as_mut_ptr(), lanes) };
    (max, sum.iter().sum::<f32>())
}

/// [`super::exp`] of 16 lanes: the same operations in the same order.
#[inline]
#[target_feature(enable = "avx512f")]
fn exp16(x: __m512) -> __m512 {
    const LOG2_E: f32 = std::f32::consts::LOG2_E;
    const LN2_HI: f32 = 0.693_359_4;
    const LN2_LO: f32 = -2.121_944_4e-4;
    let floor = _mm512_set1_ps(-87.0);
    // `if x < -87 { -87 } else { x }`: NaN compares false and stays.
    let x = _mm512_mask_blend_ps(_mm512_cmp_ps_mask::<_CMP_LT_OQ>(x, floor), x, floor);
    let n = _mm512_roundscale_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(
        _mm512_mul_ps(x, _mm512_set1_ps(LOG2_E)),
    );
    let r = _mm512_fmadd_ps(
        n,
        _mm512_set1_ps(-LN2_LO),
        _mm512_fmadd_ps(n, _mm512_set1_ps(-LN2_HI), x),
    );
    let mut p = _mm512_set1_ps(1.987_569_2e-4);
    for c in [
        1.398_199_9e-3,
        8.333_452e-3,
        4.166_579_6e-2,
        1.666_666_5e-1,
        0.5,
    ] {
        p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(c));
    }
    let e = _mm512_add_ps(
        _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), r),
        _mm512_set1_ps(1.0),
    );
    // 2^n from the exponent field. A NaN lane converts to i32::MIN here and
    // to 0 in Rust; both shift to the bits of 1.0, and NaN · 1 is the NaN.
    let n = _mm512_cvtps_epi32(n);
    let scale = _mm512_castsi512_ps(_mm512_slli_epi32::<23>(_mm512_add_epi32(
        n,
        _mm512_set1_epi32(127),
    )));
    _mm512_mul_ps(e, scale)
}

/// Unnormalised outputs of `Q` heads over the first `n` positions of the
/// value runs, in runs of [`DIM_BLOCKS`] blocks of dimensions and then
/// single blocks.
///
/// # Safety
/// AVX-512F; `weights` holds `Q` rows of [`CHUNK`] with `n` valid, `out`
/// `Q` rows of `hd`; `hd` is whole vectors, each run whole rows of `hd`,
/// and the runs hold at least `n` rows.
#[inline]
#[target_feature(enable = "avx512f")]
unsafe fn value_heads<E: Widen16, const Q: usize>(
    weights: *const f32,
    runs: &[&[E]],
    hd: usize,
    n: usize,
    out: *mut f32,
    mut ahead: Option<&mut Ahead>,
) {
    let mut d = 0;
    while d + DIM_BLOCKS * LANES <= hd {
        // SAFETY: forwarded; d + 64 <= hd.
        unsafe { value_block::<E, Q, DIM_BLOCKS>(weights, runs, hd, n, d, out, ahead.take()) };
        d += DIM_BLOCKS * LANES;
    }
    while d < hd {
        // SAFETY: forwarded; d + 16 <= hd (hd is whole vectors).
        unsafe { value_block::<E, Q, 1>(weights, runs, hd, n, d, out, ahead.take()) };
        d += LANES;
    }
}

/// `out[i][d + l] = Σ_j w_i[j] · v[j][d + l]` as one fused chain over
/// positions ascending from zero, for `Q` heads and `B` blocks of 16
/// dimensions, telling `ahead` (when this is the first pass over the
/// runs) of each run before it.
///
/// # Safety
/// As [`value_heads`], with `d + 16 · B <= hd`.
#[inline]
#[target_feature(enable = "avx512f")]
unsafe fn value_block<E: Widen16, const Q: usize, const B: usize>(
    weights: *const f32,
    runs: &[&[E]],
    hd: usize,
    n: usize,
    d: usize,
    out: *mut f32,
    mut ahead: Option<&mut Ahead>,
) {
    let mut acc = [[_mm512_setzero_ps(); B]; Q];
    let mut j = 0;
    'runs: for run in runs {
        if let Some(ahead) = ahead.as_deref_mut() {
            ahead.reading(std::mem::size_of_val(*run));
        }
        for row in run.chunks_exact(hd) {
            if j == n {
                break 'runs;
            }
            let mut v = [_mm512_setzero_ps(); B];
            for (b, v) in v.iter_mut().enumerate() {
                // SAFETY: dimensions d + 16b.. + 16 <= hd, the row's length.
                *v = unsafe { E::load16(row.as_ptr().add(d + b * LANES)) };
            }
            for (i, acc) in acc.iter_mut().enumerate() {
                // SAFETY: head i < Q, position j < n <= CHUNK.
                let w = _mm512_set1_ps(unsafe { *weights.add(i * CHUNK + j) });
                for (a, &v) in acc.iter_mut().zip(&v) {
                    *a = _mm512_fmadd_ps(w, v, *a);
                }
            }
            j += 1;
        }
    }
    for (i, acc) in acc.iter().enumerate() {
        for (b, &a) in acc.iter().enumerate() {
            // SAFETY: head i < Q, dimensions d + 16b.. + 16 <= hd.
            unsafe { _mm512_storeu_ps(out.add(i * hd + d + b * LANES), a) };
        }
    }
}

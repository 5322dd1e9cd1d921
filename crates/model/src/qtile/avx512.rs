//! AVX-512 versions of [`super::tile`] and of block decoding, written with
//! intrinsics because the compiler's auto-vectorisation of the portable
//! code decodes nibbles in narrow vectors and cannot keep multi-row tiles
//! in registers (SmolLM2 on 2 cores, portable vs this module: decode
//! 85 vs 142 tok/s at one sequence, 147 vs 321 at eight; see
//! `docs/performance.md`).
//!
//! Every function performs the portable code's operations in the portable
//! code's order, sixteen lanes at a time: the nibble decode is
//! `q * scale + offset` exactly rounded, the accumulation one exactly
//! rounded multiply-add per element, the lane sum the same tree as
//! [`super::sum_lanes`]. The property tests in `qtile` compare the two bit
//! for bit.
//!
//! The intrinsics are `unsafe` only because they must not run on a CPU
//! without AVX-512F. That obligation lives in one type: a [`Cpu`] exists
//! only where detection found AVX-512F, and every entry point takes one,
//! so the rest of the crate calls them safely.

#![allow(unsafe_code)]

use std::arch::x86_64::*;

use super::avx2::Block256;
use super::{
    BLOCK, Bytes, Decoded, FiveBits, Nibbles, Scale, SixBits, SixBitsBlock, WIDENED_BLOCKS, Widened,
};

/// How far ahead of the block being decoded each weight row is prefetched.
/// A tile reads up to four rows at once, interleaved streams the hardware
/// prefetcher follows too closely: waiting on those loads was most of the
/// kernel's time. Prefetching 4 KiB ahead was measured on SmolLM2 decode
/// at one sequence (2 cores): none 96 tok/s, 256 B 107, 1 KiB 117,
/// 2 KiB 136, 4 KiB 142, 8 KiB and 16 KiB 138.
const PREFETCH_BYTES: usize = 4096;

/// Proof that this CPU has AVX-512F: only [`Cpu::detect`] makes one.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Cpu(());

impl Cpu {
    /// `Some` where the CPU runs this module's code.
    pub(crate) fn detect() -> Option<Cpu> {
        is_x86_feature_detected!("avx512f").then_some(Cpu(()))
    }
}

/// A weight row read as AVX-512 vectors (AVX-512F implies F16C, which
/// widens scales kept as f16), by the same operations as its
/// [`super::BlockRow::block`]. Every such row is an AVX2 one too: its
/// prefetches and its widened block parameters are [`Block256`]'s. Bounds
/// are checked once per row ([`super::BlockRow::check`]) rather than once
/// per block: per-block checks were measured to cost as many instructions
/// as the arithmetic.
pub(crate) trait Block512: Block256 {
    /// Weights `0..16` and `16..32` of block `b`.
    ///
    /// # Safety
    /// The CPU must support AVX-512F, and [`super::BlockRow::check`] must
    /// have passed for some `blocks > b`.
    unsafe fn block512(self, b: usize) -> (__m512, __m512);

    /// [`Block512::block512`] of block `b`, the `i`-th of the blocks
    /// [`Block256::widen`] widened into `widened`: the same values.
    ///
    /// # Safety
    /// As [`Block512::block512`]; `widened` holds what `widen` wrote for
    /// the blocks from `b - i` on.
    #[inline(always)]
    unsafe fn block512_widened(self, b: usize, _widened: &Widened, _i: usize) -> (__m512, __m512) {
        // SAFETY: the caller's obligations are `block512`'s.
        unsafe { self.block512(b) }
    }
}

impl Block512 for Decoded<'_> {
    #[inline(always)]
    unsafe fn block512(self, b: usize) -> (__m512, __m512) {
        // SAFETY: the caller guarantees AVX-512F and `32 b + 32 <= len`.
        unsafe { load_block(self.0.as_ptr().add(b * BLOCK)) }
    }
}

impl<S: Scale> Block512 for Nibbles<'_, S> {
    #[inline(always)]
    unsafe fn block512(self, b: usize) -> (__m512, __m512) {
        // SAFETY: the caller guarantees AVX-512F and that block `b` is in
        // bounds of all three arrays.
        unsafe {
            decode_nibbles(
                self.quants.as_ptr().add(b * 16),
                broadcast(*self.scales.get_unchecked(b)),
                broadcast(*self.offsets.get_unchecked(b)),
            )
        }
    }

    #[inline(always)]
    unsafe fn block512_widened(self, b: usize, widened: &Widened, i: usize) -> (__m512, __m512) {
        if !S::HALF {
            // SAFETY: the caller's obligations are `block512`'s.
            return unsafe { self.block512(b) };
        }
        // SAFETY: the caller guarantees AVX-512F, block `b` in bounds and
        // `i < WIDENED_BLOCKS`.
        unsafe {
            decode_nibbles(
                self.quants.as_ptr().add(b * 16),
                _mm512_set1_ps(*widened.scales.get_unchecked(i)),
                _mm512_set1_ps(*widened.offsets.get_unchecked(i)),
            )
        }
    }
}

impl<S: Scale> Block512 for Bytes<'_, S> {
    #[inline(always)]
    unsafe fn block512(self, b: usize) -> (__m512, __m512) {
        // SAFETY: the caller guarantees AVX-512F and that block `b` is in
        // bounds of both arrays.
        unsafe {
            decode_bytes(
                self.quants.as_ptr().add(b * BLOCK),
                broadcast(*self.scales.get_unchecked(b)),
            )
        }
    }

    #[inline(always)]
    unsafe fn block512_widened(self, b: usize, widened: &Widened, i: usize) -> (__m512, __m512) {
        if !S::HALF {
            // SAFETY: the caller's obligations are `block512`'s.
            return unsafe { self.block512(b) };
        }
        // SAFETY: the caller guarantees AVX-512F, block `b` in bounds and
        // `i < WIDENED_BLOCKS`.
        unsafe {
            decode_bytes(
                self.quants.as_ptr().add(b * BLOCK),
                _mm512_set1_ps(*widened.scales.get_unchecked(i)),
            )
        }
    }
}

impl Block512 for FiveBits<'_> {
    #[inline(always)]
    unsafe fn block512(self, b: usize) -> (__m512, __m512) {
        // SAFETY: the caller guarantees AVX-512F and that block `b` is in
        // bounds of all three arrays.
        unsafe {
            decode_five_bits(
                self.quants.as_ptr().add(b * 16),
                *self.high.get_unchecked(b),
                broadcast(*self.scales.get_unchecked(b)),
            )
        }
    }
}

impl Block512 for SixBits<'_> {
    #[inline(always)]
    unsafe fn block512(self, b: usize) -> (__m512, __m512) {
        // SAFETY: the caller guarantees the CPU's features and that block
        // `b` is in bounds (its super-block's 210 bytes hold every piece).
        unsafe { decode_six_bits(self.0.as_ptr(), SixBits::at(b)) }
    }
}

/// A block's scale or offset in every lane: an f16 broadcast and then
/// widened by F16C (exact, as [`Scale::value`]; a load and two
/// instructions, where a scalar conversion and a broadcast took four),
/// an f32 broadcast as it is.
///
/// # Safety
/// The CPU must support AVX-512F (which implies F16C).
#[inline]
#[target_feature(enable = "avx512f")]
unsafe fn broadcast<S: Scale>(scale: S) -> __m512 {
    if S::HALF {
        _mm512_cvtph_ps(_mm256_set1_epi16(scale.bits() as i16))
    } else {
        _mm512_set1_ps(f32::from_bits(scale.bits()))
    }
}

/// The 32 floats at `values`.
///
/// # Safety
/// The CPU must support AVX-512F; `values` must point to 32 floats.
#[inline]
#[target_feature(enable = "avx512f")]
unsafe fn load_block(values: *const f32) -> (__m512, __m512) {
    // SAFETY: the caller guarantees 32 readable floats.
    unsafe { (_mm512_loadu_ps(values), _mm512_loadu_ps(values.add(16))) }
}

/// [`super::decode_nibbles`] of the 16 bytes at `quants`: low nibbles are
/// weights 0..16, high 16..32.
///
/// A block's 32 weights take only 16 values, `q * scale + offset` for
/// `q` in `0..16`: those are computed once, each exactly rounded as the
/// reference rounds it, into one vector, and each weight is looked up by
/// its nibble (`vpermps` reads only an index's low four bits, so the low
/// nibbles need no mask). Two permutes and one multiply-add replace two
/// conversions, two multiply-adds and a mask: at one activation row the
/// decode is most of the tile's work (SmolLM2 decode at batch one 8 %
/// faster; see `docs/performance.md`).
///
/// # Safety
/// The CPU must support AVX-512F; `quants` must point to 16 bytes.
#[inline]
#[target_feature(enable = "avx512f")]
unsafe fn decode_nibbles(quants: *const u8, scale: __m512, offset: __m512) -> (__m512, __m512) {
    // SAFETY: the caller guarantees 16 readable bytes.
    let bytes = unsafe { _mm_loadu_si128(quants.cast()) };
    let wide = _mm512_cvtepu8_epi32(bytes);
    let nibbles = _mm512_setr_ps(
        0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0, 10.0, 11.0, 12.0, 13.0, 14.0, 15.0,
    );
    let values = _mm512_fmadd_ps(nibbles, scale, offset);
    (
        _mm512_permutexvar_ps(wide, values),
        _mm512_permutexvar_ps(_mm512_srli_epi32::<4>(wide), values),
    )
}

/// [`super::decode_five_bits`] of the 16 bytes of nibbles at `quants` and
/// the fifth bits `high`: a nibble gains 16 where its bit is set.
///
/// # Safety
/// The CPU must support AVX-512F; `quants` must point to 16 bytes.
#[inline]
#[target_feature(enable = "avx512f")]
unsafe fn decode_five_bits(quants: *const u8, high: u32, scale: __m512) -> (__m512, __m512) {
    // SAFETY: the caller guarantees 16 readable bytes.
    let bytes = unsafe { _mm_loadu_si128(quants.cast()) };
    let wide = _mm512_cvtepu8_epi32(bytes);
    let sixteen = _mm512_set1_epi32(16);
    let low = _mm512_and_si512(wide, _mm512_set1_epi32(0x0F));
    let low = _mm512_mask_or_epi32(low, high as __mmask16, low, sixteen);
    let upper = _mm512_srli_epi32::<4>(wide);
    let upper = _mm512_mask_or_epi32(upper, (high >> 16) as __mmask16, upper, sixteen);
    // Exact: a power of two times an f16's value.
    let offset = _mm512_mul_ps(scale, _mm512_set1_ps(-16.0));
    (
        _mm512_fmadd_ps(_mm512_cvtepi32_ps(low), scale, offset),
        _mm512_fmadd_ps(_mm512_cvtepi32_ps(upper), scale, offset),
    )
}

/// [`super::SixBits`]'s block `at` of the row at `row`: 32 bytes of low
/// nibbles and 32 of bit pairs shifted into place (on 16-bit lanes; the
/// masks drop what crosses from the neighbouring byte), each weight
/// `(q - 32) · (d · scale)`, weights `0..16` with the first run's scale and
/// `16..32` with the second's.
///
/// # Safety
/// The CPU must support AVX-512F; every offset of `at` must lie inside the
/// row's bytes (32 bytes at `low` and at `high`).
#[inline]
#[target_feature(enable = "avx512f")]
unsafe fn decode_six_bits(row: *const u8, at: SixBitsBlock) -> (__m512, __m512) {
    // SAFETY: the caller guarantees that `at` lies inside `row`'s bytes;
    // AVX-512F implies the AVX2, FMA and F16C the shared part needs.
    let (q, d, scales) = unsafe {
        (
            super::avx2::six_bit_quants(row, at),
            _mm512_cvtph_ps(_mm256_set1_epi16(
                row.add(at.d).cast::<i16>().read_unaligned(),
            )),
            [*row.add(at.scales) as i8, *row.add(at.scales + 1) as i8],
        )
    };
    // `d · scale`, exact, in every lane.
    let scale = |s: i8| _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_set1_epi32(i32::from(s))));
    let (first, second) = (scale(scales[0]), scale(scales[1]));
    let centre = _mm512_set1_epi32(32);
    let weight = |bytes: __m128i, scale: __m512| {
        let q = _mm512_sub_epi32(_mm512_cvtepu8_epi32(bytes), centre);
        _mm512_mul_ps(_mm512_cvtepi32_ps(q), scale)
    };
    (
        weight(_mm256_castsi256_si128(q), first),
        weight(_mm256_extracti128_si256::<1>(q), second),
    )
}

/// [`super::decode_bytes`] of the 32 signed bytes at `quants`.
///
/// # Safety
/// The CPU must support AVX-512F; `quants` must point to 32 bytes.
#[inline]
#[target_feature(enable = "avx512f")]
unsafe fn decode_bytes(quants: *const u8, scale: __m512) -> (__m512, __m512) {
    // SAFETY: the caller guarantees 32 readable bytes.
    let (first, second) = unsafe {
        (
            _mm_loadu_si128(quants.cast()),
            _mm_loadu_si128(quants.add(16).cast()),
        )
    };
    (
        _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(first)), scale),
        _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(second)), scale),
    )
}

/// [`super::sum_lanes`] of the 32 lanes `low ++ high`: the same tree.
#[inline]
#[target_feature(enable = "avx512f")]
fn sum_lanes(low: __m512, high: __m512) -> f32 {
    let s16 = _mm512_add_ps(low, high);
    let upper8 = _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(s16)));
    let s8 = _mm256_add_ps(_mm512_castps512_ps256(s16), upper8);
    let s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps::<1>(s8));
    let s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
    let s1 = _mm_add_ss(s2, _mm_shuffle_ps::<0x55>(s2, s2));
    _mm_cvtss_f32(s1)
}

/// [`super::dots_of`] on this instruction set: the whole loop over tiles
/// compiled with its features, so every [`tile`] inlines into it. Called
/// from code without them, each tile was a call that spilled its rows'
/// slices and returned its sums through the stack (9 % of a Gemma 3
/// prefill profile sat on those calls' edges).
pub(crate) fn dots<W: super::Source>(
    cpu: Cpu,
    rows: W,
    count: usize,
    x: &[f32],
    k: usize,
    stride: usize,
    out: &mut [f32],
) {
    // SAFETY: a `Cpu` exists only where AVX-512F was detected.
    unsafe { dots_avx512(cpu, rows, count, x, k, stride, out) }
}

#[target_feature(enable = "avx512f")]
unsafe fn dots_avx512<W: super::Source>(
    cpu: Cpu,
    rows: W,
    count: usize,
    x: &[f32],
    k: usize,
    stride: usize,
    out: &mut [f32],
) {
    super::dots(super::Isa::Avx512(cpu), rows, count, x, k, stride, out)
}

/// [`super::decode_rows`]: the first `out.len() / k` rows into `out`.
pub(crate) fn decode_rows<W: Block512>(_cpu: Cpu, rows: W, k: usize, out: &mut [f32]) {
    // SAFETY: a `Cpu` exists only where AVX-512F was detected.
    unsafe { decode_rows_avx512(rows, k, out) }
}

#[target_feature(enable = "avx512f")]
unsafe fn decode_rows_avx512<W: Block512>(rows: W, k: usize, out: &mut [f32]) {
    let whole = out.len() / k * k;
    rows.check(whole / BLOCK);
    for (b, chunk) in out[..whole].chunks_exact_mut(BLOCK).enumerate() {
        rows.prefetch(b, PREFETCH_BYTES);
        // SAFETY: AVX-512F is enabled for this function; block `b` was
        // checked; `chunk` holds exactly 32 floats, the two stores' 16 each.
        unsafe {
            let (low, high) = rows.block512(b);
            _mm512_storeu_ps(chunk.as_mut_ptr(), low);
            _mm512_storeu_ps(chunk.as_mut_ptr().add(16), high);
        }
    }
}

/// [`super::tile`]: `out[r][c] = x[r] · w[c]`, with two 16-lane
/// accumulators per output so the decoded block and the activation block
/// stay in registers across the whole tile.
/// `widened` is scratch for the rows' block parameters, at least `R` of
/// them, made once by the caller for all its tiles.
pub(crate) fn tile<const M: usize, const R: usize, W: Block512>(
    _cpu: Cpu,
    x: [&[f32]; M],
    w: [W; R],
    widened: &mut [Widened],
) -> [[f32; R]; M] {
    // SAFETY: a `Cpu` exists only where AVX-512F was detected.
    unsafe { tile_avx512(x, w, widened) }
}

#[inline]
#[target_feature(enable = "avx512f")]
unsafe fn tile_avx512<const M: usize, const R: usize, W: Block512>(
    x: [&[f32]; M],
    w: [W; R],
    widened: &mut [Widened],
) -> [[f32; R]; M] {
    let blocks = super::tile_blocks(x, w);
    let zero = _mm512_setzero_ps();
    let mut acc = [[[zero; 2]; R]; M];
    let widened = &mut widened[..R];
    let mut first = 0;
    while first < blocks {
        let n = WIDENED_BLOCKS.min(blocks - first);
        for (into, row) in widened.iter_mut().zip(w) {
            // SAFETY: AVX-512F (which implies AVX2, FMA and F16C) is
            // enabled for this function; every row was checked for
            // `blocks >= first + n` blocks.
            unsafe { Block256::widen(row, first, n, into) };
        }
        for i in 0..n {
            let b = first + i;
            let mut values = [[zero; 2]; R];
            for ((v, row), widened) in values.iter_mut().zip(w).zip(widened.iter()) {
                row.prefetch(b, PREFETCH_BYTES);
                // SAFETY: as above, `blocks > b`; `widened` holds this
                // group's parameters, `i < n`.
                let (low, high) = unsafe { row.block512_widened(b, widened, i) };
                *v = [low, high];
            }
            for (acc_row, x_row) in acc.iter_mut().zip(x) {
                // SAFETY: as above; every activation row holds `blocks` blocks.
                let (x_low, x_high) = unsafe { load_block(x_row.as_ptr().add(b * BLOCK)) };
                for (lanes, v) in acc_row.iter_mut().zip(&values) {
                    lanes[0] = _mm512_fmadd_ps(x_low, v[0], lanes[0]);
                    lanes[1] = _mm512_fmadd_ps(x_high, v[1], lanes[1]);
                }
            }
        }
        first += n;
    }
    let mut sums = [[0.0f32; R]; M];
    for (s_row, acc_row) in sums.iter_mut().zip(acc) {
        for (s, lanes) in s_row.iter_mut().zip(acc_row) {
            *s = sum_lanes(lanes[0], lanes[1]);
        }
    }
    sums
}

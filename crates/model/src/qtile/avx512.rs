//! AVX-512 versions of [`super::tile`] and of block decoding, written with
//! intrinsics because the compiler's auto-vectorisation of the portable
//! code was measured to use 4-wide vectors for nibble decoding (decode at
//! one sequence: 29 tok/s portable on SmolLM2, see `docs/performance.md`).
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

use super::{BLOCK, Bytes, Decoded, Nibbles};

/// Proof that this CPU has AVX-512F: only [`Cpu::detect`] makes one.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Cpu(());

impl Cpu {
    /// `Some` where the CPU runs this module's code.
    pub(crate) fn detect() -> Option<Cpu> {
        is_x86_feature_detected!("avx512f").then_some(Cpu(()))
    }
}

/// A weight row read as AVX-512 vectors, by the same operations as its
/// [`super::BlockRow::block`].
pub(crate) trait Block512: Copy {
    /// Weights `0..16` and `16..32` of block `b`.
    ///
    /// # Safety
    /// The CPU must support AVX-512F.
    unsafe fn block512(self, b: usize) -> (__m512, __m512);
}

impl Block512 for Decoded<'_> {
    #[inline(always)]
    unsafe fn block512(self, b: usize) -> (__m512, __m512) {
        // SAFETY: the caller guarantees AVX-512F.
        unsafe { load_block(&self.0[b * BLOCK..][..BLOCK]) }
    }
}

impl Block512 for Nibbles<'_> {
    #[inline(always)]
    unsafe fn block512(self, b: usize) -> (__m512, __m512) {
        let quants = <&[u8; 16]>::try_from(&self.quants[b * 16..][..16])
            .expect("a 4-bit block holds 16 bytes");
        // SAFETY: the caller guarantees AVX-512F.
        unsafe { decode_nibbles(quants, self.scales[b], self.offsets[b]) }
    }
}

impl Block512 for Bytes<'_> {
    #[inline(always)]
    unsafe fn block512(self, b: usize) -> (__m512, __m512) {
        let quants = <&[u8; BLOCK]>::try_from(&self.quants[b * BLOCK..][..BLOCK])
            .expect("an 8-bit block holds 32 bytes");
        // SAFETY: the caller guarantees AVX-512F.
        unsafe { decode_bytes(quants, self.scales[b]) }
    }
}

/// Weights `0..16` and `16..32` of a decoded block.
///
/// # Safety
/// The CPU must support AVX-512F.
#[inline]
#[target_feature(enable = "avx512f")]
unsafe fn load_block(values: &[f32]) -> (__m512, __m512) {
    assert!(values.len() >= BLOCK, "a block is 32 values");
    // SAFETY: `values` holds at least 32 floats (asserted).
    unsafe {
        (
            _mm512_loadu_ps(values.as_ptr()),
            _mm512_loadu_ps(values.as_ptr().add(16)),
        )
    }
}

/// [`super::decode_nibbles`]: low nibbles are weights 0..16, high 16..32.
///
/// # Safety
/// The CPU must support AVX-512F.
#[inline]
#[target_feature(enable = "avx512f")]
unsafe fn decode_nibbles(quants: &[u8; 16], scale: f32, offset: f32) -> (__m512, __m512) {
    // SAFETY: reads exactly the 16 bytes of `quants`.
    let bytes = unsafe { _mm_loadu_si128(quants.as_ptr().cast()) };
    let wide = _mm512_cvtepu8_epi32(bytes);
    let low = _mm512_and_si512(wide, _mm512_set1_epi32(0x0F));
    let high = _mm512_srli_epi32::<4>(wide);
    let (scale, offset) = (_mm512_set1_ps(scale), _mm512_set1_ps(offset));
    (
        _mm512_fmadd_ps(_mm512_cvtepi32_ps(low), scale, offset),
        _mm512_fmadd_ps(_mm512_cvtepi32_ps(high), scale, offset),
    )
}

/// [`super::decode_bytes`]: signed bytes times the scale.
///
/// # Safety
/// The CPU must support AVX-512F.
#[inline]
#[target_feature(enable = "avx512f")]
unsafe fn decode_bytes(quants: &[u8; BLOCK], scale: f32) -> (__m512, __m512) {
    // SAFETY: reads bytes 0..16 and 16..32 of `quants`.
    let (first, second) = unsafe {
        (
            _mm_loadu_si128(quants.as_ptr().cast()),
            _mm_loadu_si128(quants.as_ptr().add(16).cast()),
        )
    };
    let scale = _mm512_set1_ps(scale);
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

/// [`super::tile`]: `out[r][c] = x[r] · w[c]`, with two 16-lane
/// accumulators per output so the decoded block and the activation block
/// stay in registers across the whole tile.
pub(crate) fn tile<const M: usize, const R: usize, W: Block512>(
    _cpu: Cpu,
    x: [&[f32]; M],
    w: [W; R],
) -> [[f32; R]; M] {
    // SAFETY: a `Cpu` exists only where AVX-512F was detected.
    unsafe { tile_avx512(x, w) }
}

#[inline]
#[target_feature(enable = "avx512f")]
unsafe fn tile_avx512<const M: usize, const R: usize, W: Block512>(
    x: [&[f32]; M],
    w: [W; R],
) -> [[f32; R]; M] {
    let blocks = x[0].len() / BLOCK;
    let zero = _mm512_setzero_ps();
    let mut acc = [[[zero; 2]; R]; M];
    for b in 0..blocks {
        let mut values = [[zero; 2]; R];
        for (v, row) in values.iter_mut().zip(w) {
            // SAFETY: AVX-512F is enabled for this function.
            let (low, high) = unsafe { row.block512(b) };
            *v = [low, high];
        }
        for (acc_row, x_row) in acc.iter_mut().zip(x) {
            // SAFETY: AVX-512F is enabled for this function.
            let (x_low, x_high) = unsafe { load_block(&x_row[b * BLOCK..][..BLOCK]) };
            for (lanes, v) in acc_row.iter_mut().zip(&values) {
                lanes[0] = _mm512_fmadd_ps(x_low, v[0], lanes[0]);
                lanes[1] = _mm512_fmadd_ps(x_high, v[1], lanes[1]);
            }
        }
    }
    let mut sums = [[0.0f32; R]; M];
    for (s_row, acc_row) in sums.iter_mut().zip(acc) {
        for (s, lanes) in s_row.iter_mut().zip(acc_row) {
            *s = sum_lanes(lanes[0], lanes[1]);
        }
    }
    sums
}

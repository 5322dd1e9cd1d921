//! AVX2 staging of a chunk's keys: 8 × 8 blocks widened to f32 and
//! transposed in registers. Portable code does the same one element at a
//! time (`perf`: 27 % of a long-context decode step was that loop). Staging
//! only moves and widens values — every f16 and bf16 value is exact in
//! f32 — so this path and the portable one store the same bits.
//!
//! The intrinsics are `unsafe` only because they must not run on a CPU
//! without AVX2 and F16C. That obligation lives in one type: an [`Avx2`]
//! exists only where detection found both, and every entry point takes one.

#![allow(unsafe_code)]

use std::arch::x86_64::*;

use half::{bf16, f16};

/// Proof that this CPU has AVX2 and F16C: only [`Avx2::detect`] makes one.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Avx2(());

impl Avx2 {
    /// `Some` where the CPU runs this module's code.
    pub(crate) fn detect() -> Option<Avx2> {
        (is_x86_feature_detected!("avx2") && is_x86_feature_detected!("f16c")).then_some(Avx2(()))
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

/// `keys[d * stride + first + j] = run[j * hd + d]` for `j < n` and every
/// `d`, for the whole 8-key, 8-dimension blocks of `run`; returns how many
/// keys it staged (a multiple of 8), leaving the rest to the caller.
pub(crate) fn transpose<E: Widen8>(
    _cpu: Avx2,
    run: &[E],
    n: usize,
    hd: usize,
    keys: &mut [f32],
    stride: usize,
    first: usize,
) -> usize {
    if !hd.is_multiple_of(8) {
        return 0;
    }
    let whole = n - n % 8;
    assert!(run.len() >= n * hd, "the run holds n keys of hd elements");
    assert!(
        hd == 0 || keys.len() >= (hd - 1) * stride + first + whole,
        "every staged column fits in the key scratch"
    );
    // SAFETY: `_cpu` proves AVX2 and F16C; the asserts above bound every
    // read (`j + 8 <= whole <= n` keys of `hd`) and every write.
    unsafe { transpose_blocks(run.as_ptr(), whole, hd, keys.as_mut_ptr(), stride, first) };
    whole
}

#[target_feature(enable = "avx2,f16c")]
unsafe fn transpose_blocks<E: Widen8>(
    run: *const E,
    whole: usize,
    hd: usize,
    keys: *mut f32,
    stride: usize,
    first: usize,
) {
    for j in (0..whole).step_by(8) {
        for d in (0..hd).step_by(8) {
            // SAFETY (whole block): rows j..j+8 and columns d..d+8 are inside
            // the run and the scratch (checked by `transpose`).
            unsafe {
                let row = |i: usize| run.add((j + i) * hd + d);
                let r = [
                    E::load8(row(0)),
                    E::load8(row(1)),
                    E::load8(row(2)),
                    E::load8(row(3)),
                    E::load8(row(4)),
                    E::load8(row(5)),
                    E::load8(row(6)),
                    E::load8(row(7)),
                ];
                let t0 = _mm256_unpacklo_ps(r[0], r[1]);
                let t1 = _mm256_unpackhi_ps(r[0], r[1]);
                let t2 = _mm256_unpacklo_ps(r[2], r[3]);
                let t3 = _mm256_unpackhi_ps(r[2], r[3]);
                let t4 = _mm256_unpacklo_ps(r[4], r[5]);
                let t5 = _mm256_unpackhi_ps(r[4], r[5]);
                let t6 = _mm256_unpacklo_ps(r[6], r[7]);
                let t7 = _mm256_unpackhi_ps(r[6], r[7]);
                let u0 = _mm256_shuffle_ps::<0x44>(t0, t2);
                let u1 = _mm256_shuffle_ps::<0xEE>(t0, t2);
                let u2 = _mm256_shuffle_ps::<0x44>(t1, t3);
                let u3 = _mm256_shuffle_ps::<0xEE>(t1, t3);
                let u4 = _mm256_shuffle_ps::<0x44>(t4, t6);
                let u5 = _mm256_shuffle_ps::<0xEE>(t4, t6);
                let u6 = _mm256_shuffle_ps::<0x44>(t5, t7);
                let u7 = _mm256_shuffle_ps::<0xEE>(t5, t7);
                let out = [
                    _mm256_permute2f128_ps::<0x20>(u0, u4),
                    _mm256_permute2f128_ps::<0x20>(u1, u5),
                    _mm256_permute2f128_ps::<0x20>(u2, u6),
                    _mm256_permute2f128_ps::<0x20>(u3, u7),
                    _mm256_permute2f128_ps::<0x31>(u0, u4),
                    _mm256_permute2f128_ps::<0x31>(u1, u5),
                    _mm256_permute2f128_ps::<0x31>(u2, u6),
                    _mm256_permute2f128_ps::<0x31>(u3, u7),
                ];
                for (i, v) in out.into_iter().enumerate() {
                    _mm256_storeu_ps(keys.add((d + i) * stride + first + j), v);
                }
            }
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

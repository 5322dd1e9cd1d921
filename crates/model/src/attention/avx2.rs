//! AVX2 staging of a chunk's keys and values: page columns and rows
//! widened to f32, 8 elements at a time. Portable code does the same one
//! run at a time. Staging only moves and widens values — every f16 and
//! bf16 value is exact in f32 — so this path and the portable one store
//! the same bits.
//!
//! The intrinsics are `unsafe` only because they must not run on a CPU
//! without AVX2 and F16C. That obligation lives in one type: an [`Avx2`]
//! exists only where detection found both, and every entry point takes one.

#![allow(unsafe_code)]

use std::arch::x86_64::*;

use std::ops::Range;

use half::{bf16, f16};
use kvfence_pool::Keys;

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

//! AVX2 versions of [`super::tile`] and of block decoding, for x86-64 CPUs
//! without AVX-512 (many AMD EPYCs). The portable code compiled for AVX2
//! keeps one activation row per tile and decodes nibbles in narrow
//! vectors; here a 32-lane accumulator is four `ymm` registers, and a tile
//! is one activation row by two weight rows or two by one, so that its
//! eight accumulators, a decoded block and the activation loads fit
//! AVX2's sixteen registers.
//!
//! Every function performs the portable code's operations in the portable
//! code's order, eight lanes at a time: the nibble decode is
//! `q * scale + offset` exactly rounded, the accumulation one exactly
//! rounded multiply-add per element, the lane sum the same tree as
//! [`super::sum_lanes`]. The property tests in `qtile` compare them bit
//! for bit.
//!
//! The intrinsics are `unsafe` only because they must not run on a CPU
//! without AVX2, FMA and F16C. That obligation lives in one type: a [`Cpu`]
//! exists only where detection found both, and every entry point takes
//! one, so the rest of the crate calls them safely.

#![allow(unsafe_code)]

use std::arch::x86_64::*;

use super::lanes::{GROUP_ROWS, GROUP_VECTORS, TILE_WEIGHTS};
use super::{
    BLOCK, BlockRow, Bytes, Decoded, FiveBits, Nibbles, Scale, SixBits, SixBitsBlock,
    WIDENED_BLOCKS, Widened,
};

/// How far ahead of the block being decoded each weight row is prefetched
/// (the AVX-512 kernels' measured best; the access pattern is the same).
const PREFETCH_BYTES: usize = 4096;

/// One 32-weight block as four 8-lane vectors.
type Block = [__m256; 4];

/// Proof that this CPU has AVX2, FMA and F16C (block scales kept as f16):
/// only [`Cpu::detect`] makes one.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Cpu(());

impl Cpu {
    /// `Some` where the CPU runs this module's code.
    pub(crate) fn detect() -> Option<Cpu> {
        (is_x86_feature_detected!("avx2")
            && is_x86_feature_detected!("fma")
            && is_x86_feature_detected!("f16c"))
        .then_some(Cpu(()))
    }
}

/// A weight row read as AVX2 vectors, by the same operations as its
/// [`super::BlockRow::block`]. Bounds are checked once per row.
pub(crate) trait Block256: BlockRow {
    /// Weights `0..32` of block `b`, eight at a time.
    ///
    /// # Safety
    /// The CPU must support AVX2, FMA and F16C, and [`BlockRow::check`] must
    /// have passed for some `blocks > b`.
    unsafe fn block256(self, b: usize) -> Block;

    /// Asks for the bytes `distance` past block `b` to be brought to L1.
    #[inline(always)]
    fn prefetch(self, _b: usize, _distance: usize) {}

    /// Widens the f16 parameters of blocks `b..b + n` (`n` at most
    /// [`WIDENED_BLOCKS`]) into `into`, for [`Block256::block256_widened`];
    /// rows without f16 parameters leave it as it is.
    ///
    /// # Safety
    /// The CPU must support AVX2, FMA and F16C, and [`BlockRow::check`]
    /// must have passed for some `blocks >= b + n`.
    #[inline(always)]
    unsafe fn widen(self, _b: usize, _n: usize, _into: &mut Widened) {}

    /// [`Block256::block256`] of block `b`, the `i`-th of the blocks
    /// [`Block256::widen`] widened into `widened`: the same values.
    ///
    /// # Safety
    /// As [`Block256::block256`]; `widened` holds what `widen` wrote for
    /// the blocks from `b - i` on.
    #[inline(always)]
    unsafe fn block256_widened(self, b: usize, _widened: &Widened, _i: usize) -> Block {
        // SAFETY: the caller's obligations are `block256`'s.
        unsafe { self.block256(b) }
    }
}

impl Block256 for Decoded<'_> {
    #[inline(always)]
    unsafe fn block256(self, b: usize) -> Block {
        // SAFETY: the caller guarantees AVX2 and `32 b + 32 <= len`.
        unsafe { load_block(self.0.as_ptr().add(b * BLOCK)) }
    }
}

impl<S: Scale> Block256 for Nibbles<'_, S> {
    #[inline(always)]
    fn prefetch(self, b: usize, distance: usize) {
        prefetch_past(self.quants, b * 16 + distance);
    }

    #[inline(always)]
    unsafe fn block256(self, b: usize) -> Block {
        // SAFETY: the caller guarantees AVX2, FMA and F16C and that block `b` is
        // in bounds of all three arrays.
        unsafe {
            decode_nibbles(
                self.quants.as_ptr().add(b * 16),
                broadcast(*self.scales.get_unchecked(b)),
                broadcast(*self.offsets.get_unchecked(b)),
            )
        }
    }

    #[inline(always)]
    unsafe fn widen(self, b: usize, n: usize, into: &mut Widened) {
        if S::HALF {
            // SAFETY: the caller guarantees the CPU's features and blocks
            // `b..b + n`.
            unsafe {
                widen_halves(self.scales, b, n, PREFETCH_BYTES / 16, &mut into.scales);
                widen_halves(self.offsets, b, n, PREFETCH_BYTES / 16, &mut into.offsets);
            }
        }
    }

    #[inline(always)]
    unsafe fn block256_widened(self, b: usize, widened: &Widened, i: usize) -> Block {
        if !S::HALF {
            // SAFETY: the caller's obligations are `block256`'s.
            return unsafe { self.block256(b) };
        }
        // SAFETY: the caller guarantees the CPU's features, block `b` in
        // bounds and `i < WIDENED_BLOCKS`.
        unsafe {
            decode_nibbles(
                self.quants.as_ptr().add(b * 16),
                _mm256_set1_ps(*widened.scales.get_unchecked(i)),
                _mm256_set1_ps(*widened.offsets.get_unchecked(i)),
            )
        }
    }
}

impl<S: Scale> Block256 for Bytes<'_, S> {
    #[inline(always)]
    fn prefetch(self, b: usize, distance: usize) {
        prefetch_past(self.quants, b * BLOCK + distance);
    }

    #[inline(always)]
    unsafe fn block256(self, b: usize) -> Block {
        // SAFETY: the caller guarantees AVX2, FMA and F16C and that block `b` is in
        // bounds of both arrays.
        unsafe {
            decode_bytes(
                self.quants.as_ptr().add(b * BLOCK),
                broadcast(*self.scales.get_unchecked(b)),
            )
        }
    }

    #[inline(always)]
    unsafe fn widen(self, b: usize, n: usize, into: &mut Widened) {
        if S::HALF {
            // SAFETY: the caller guarantees the CPU's features and blocks
            // `b..b + n`.
            unsafe { widen_halves(self.scales, b, n, PREFETCH_BYTES / BLOCK, &mut into.scales) };
        }
    }

    #[inline(always)]
    unsafe fn block256_widened(self, b: usize, widened: &Widened, i: usize) -> Block {
        if !S::HALF {
            // SAFETY: the caller's obligations are `block256`'s.
            return unsafe { self.block256(b) };
        }
        // SAFETY: the caller guarantees the CPU's features, block `b` in
        // bounds and `i < WIDENED_BLOCKS`.
        unsafe {
            decode_bytes(
                self.quants.as_ptr().add(b * BLOCK),
                _mm256_set1_ps(*widened.scales.get_unchecked(i)),
            )
        }
    }
}

impl Block256 for FiveBits<'_> {
    #[inline(always)]
    fn prefetch(self, b: usize, distance: usize) {
        prefetch_past(self.quants, b * 16 + distance);
    }

    #[inline(always)]
    unsafe fn block256(self, b: usize) -> Block {
        // SAFETY: the caller guarantees AVX2, FMA and F16C and that block `b` is
        // in bounds of all three arrays.
        unsafe {
            decode_five_bits(
                self.quants.as_ptr().add(b * 16),
                *self.high.get_unchecked(b),
                broadcast(*self.scales.get_unchecked(b)),
            )
        }
    }
}

impl Block256 for SixBits<'_> {
    #[inline(always)]
    fn prefetch(self, b: usize, distance: usize) {
        prefetch_past(self.0, SixBits::at(b).low + distance);
    }

    #[inline(always)]
    unsafe fn block256(self, b: usize) -> Block {
        // SAFETY: the caller guarantees the CPU's features and that block
        // `b` is in bounds (its super-block's 210 bytes hold every piece).
        unsafe { decode_six_bits(self.0.as_ptr(), SixBits::at(b)) }
    }
}

/// Asks for the byte `offset` into `bytes` to be brought to L1. A
/// prefetch is a hint: an address past the end is never read.
#[inline(always)]
fn prefetch_past(bytes: &[u8], offset: usize) {
    let at = bytes.as_ptr().wrapping_add(offset);
    // SAFETY: prefetching has no effect on memory, valid or not.
    unsafe { _mm_prefetch::<_MM_HINT_T0>(at.cast()) };
}

/// A block's scale or offset in every lane: an f16 broadcast and then
/// widened by F16C (exact, as [`Scale::value`]; a load and two
/// instructions, where a scalar conversion and a broadcast took four),
/// an f32 broadcast as it is.
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn broadcast<S: Scale>(scale: S) -> __m256 {
    if S::HALF {
        _mm256_cvtph_ps(_mm_set1_epi16(scale.bits() as i16))
    } else {
        _mm256_set1_ps(f32::from_bits(scale.bits()))
    }
}

/// `halves[b..b + n]`, f16 bits ([`Scale::HALF`]), widened exactly into
/// `into[..n]` by F16C, sixteen by two conversions; a shorter run (a row's
/// last blocks) too where the slice holds sixteen from `b`, else one by
/// one — no call, which would spill the tile's accumulators. Asks for the
/// parameters `ahead` blocks on, as the tiles ask for the quants: waiting
/// on them here, at the head of each group, was a stall per group. Through
/// [`Block256::widen`] the AVX-512 tiles use it too.
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C; `S` must be an f16, and
/// `n <= WIDENED_BLOCKS`, `b + n <= halves.len()`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn widen_halves<S: Scale>(
    halves: &[S],
    b: usize,
    n: usize,
    ahead: usize,
    into: &mut [f32; WIDENED_BLOCKS],
) {
    debug_assert!(S::HALF && std::mem::size_of::<S>() == 2);
    debug_assert!(n <= WIDENED_BLOCKS && b + n <= halves.len());
    let at = halves.as_ptr().wrapping_add(b + ahead);
    // A hint: an address past the end is never read.
    _mm_prefetch::<_MM_HINT_T0>(at.cast());
    // A row's last blocks (fewer than sixteen) are widened sixteen at a
    // time too where the slice goes on past them (the next rows'
    // parameters: read, widened, never used), which every row but a
    // matrix's last has. One by one they cost as much as the other sixteen
    // blocks' arithmetic at SmolLM2's widths (eighteen blocks a row).
    if n == WIDENED_BLOCKS || b + WIDENED_BLOCKS <= halves.len() {
        // SAFETY: sixteen f16s (two bytes each: `Half` is a transparent
        // `u16`) from `b` are in bounds: by the caller's guarantee, or as
        // just checked; `into` holds sixteen floats.
        unsafe {
            let bits: *const __m128i = halves.as_ptr().add(b).cast();
            _mm256_storeu_ps(into.as_mut_ptr(), _mm256_cvtph_ps(_mm_loadu_si128(bits)));
            _mm256_storeu_ps(
                into.as_mut_ptr().add(8),
                _mm256_cvtph_ps(_mm_loadu_si128(bits.add(1))),
            );
        }
    } else {
        for (j, value) in into[..n].iter_mut().enumerate() {
            // SAFETY: `b + j < b + n`, in bounds by the caller's guarantee.
            let bits = unsafe { halves.get_unchecked(b + j) }.bits() as i32;
            *value = _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(bits)));
        }
    }
}

/// The 32 floats at `values`.
///
/// # Safety
/// The CPU must support AVX2; `values` must point to 32 floats.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn load_block(values: *const f32) -> Block {
    // SAFETY: the caller guarantees 32 readable floats.
    unsafe {
        [
            _mm256_loadu_ps(values),
            _mm256_loadu_ps(values.add(8)),
            _mm256_loadu_ps(values.add(16)),
            _mm256_loadu_ps(values.add(24)),
        ]
    }
}

/// [`super::decode_nibbles`] of the 16 bytes at `quants`: low nibbles are
/// weights 0..16, high 16..32.
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C; `quants` must point to 16 bytes.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn decode_nibbles(quants: *const u8, scale: __m256, offset: __m256) -> Block {
    // SAFETY: the caller guarantees 16 readable bytes.
    let bytes = unsafe { _mm_loadu_si128(quants.cast()) };
    let first = _mm256_cvtepu8_epi32(bytes);
    let second = _mm256_cvtepu8_epi32(_mm_unpackhi_epi64(bytes, bytes));
    let mask = _mm256_set1_epi32(0x0F);
    let weight = |q: __m256i| _mm256_fmadd_ps(_mm256_cvtepi32_ps(q), scale, offset);
    [
        weight(_mm256_and_si256(first, mask)),
        weight(_mm256_and_si256(second, mask)),
        weight(_mm256_srli_epi32::<4>(first)),
        weight(_mm256_srli_epi32::<4>(second)),
    ]
}

/// [`super::decode_five_bits`] of the 16 bytes of nibbles at `quants` and
/// the fifth bits `high`: a nibble gains 16 where its bit is set (weights
/// `8 g .. 8 g + 8` take bits `8 g .. 8 g + 8`).
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C; `quants` must point to 16 bytes.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn decode_five_bits(quants: *const u8, high: u32, scale: __m256) -> Block {
    // SAFETY: the caller guarantees 16 readable bytes.
    let bytes = unsafe { _mm_loadu_si128(quants.cast()) };
    let first = _mm256_cvtepu8_epi32(bytes);
    let second = _mm256_cvtepu8_epi32(_mm_unpackhi_epi64(bytes, bytes));
    let mask = _mm256_set1_epi32(0x0F);
    let lane_bits = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
    let sixteen = _mm256_set1_epi32(16);
    // Exact: a power of two times an f16's value.
    let offset = _mm256_mul_ps(scale, _mm256_set1_ps(-16.0));
    let weight = |q: __m256i, group: u32| {
        let bits = _mm256_set1_epi32((high >> (8 * group)) as i32);
        let set = _mm256_cmpeq_epi32(_mm256_and_si256(bits, lane_bits), lane_bits);
        let q = _mm256_or_si256(q, _mm256_and_si256(set, sixteen));
        _mm256_fmadd_ps(_mm256_cvtepi32_ps(q), scale, offset)
    };
    [
        weight(_mm256_and_si256(first, mask), 0),
        weight(_mm256_and_si256(second, mask), 1),
        weight(_mm256_srli_epi32::<4>(first), 2),
        weight(_mm256_srli_epi32::<4>(second), 3),
    ]
}

/// The 32 six-bit values `q` (in `0..64`, one a byte) of [`super::SixBits`]'s
/// block `at` of the row at `row`: 32 bytes of low nibbles and 32 of bit
/// pairs shifted into place (on 16-bit lanes; the masks drop what crosses
/// from the neighbouring byte). The AVX-512 decode shares it.
///
/// # Safety
/// The CPU must support AVX2; 32 bytes at `at.low` and at `at.high` must
/// lie inside the row's bytes.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn six_bit_quants(row: *const u8, at: SixBitsBlock) -> __m256i {
    // SAFETY: the caller guarantees 32 readable bytes at each offset.
    let (low, high) = unsafe {
        (
            _mm256_loadu_si256(row.add(at.low).cast()),
            _mm256_loadu_si256(row.add(at.high).cast()),
        )
    };
    let shift = |n: u32| _mm_cvtsi32_si128(n as i32);
    let low = _mm256_and_si256(
        _mm256_srl_epi16(low, shift(at.low_shift)),
        _mm256_set1_epi8(0x0F),
    );
    let high = _mm256_and_si256(
        _mm256_srl_epi16(high, shift(at.high_shift)),
        _mm256_set1_epi8(3),
    );
    _mm256_or_si256(low, _mm256_slli_epi16::<4>(high))
}

/// [`super::SixBits`]'s block `at` of the row at `row` (see the AVX-512
/// version), eight weights at a time.
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C; every offset of `at` must lie
/// inside the row's bytes (32 bytes at `low` and at `high`).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn decode_six_bits(row: *const u8, at: SixBitsBlock) -> Block {
    // SAFETY: the caller guarantees that `at` lies inside `row`'s bytes.
    let (q, d, scales) = unsafe {
        (
            six_bit_quants(row, at),
            _mm256_cvtph_ps(_mm_set1_epi16(row.add(at.d).cast::<i16>().read_unaligned())),
            [*row.add(at.scales) as i8, *row.add(at.scales + 1) as i8],
        )
    };
    // `d · scale`, exact, in every lane.
    let scale = |s: i8| _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_set1_epi32(i32::from(s))));
    let (first, second) = (scale(scales[0]), scale(scales[1]));
    let (front, back) = (_mm256_castsi256_si128(q), _mm256_extracti128_si256::<1>(q));
    let centre = _mm256_set1_epi32(32);
    let weight = |bytes: __m128i, scale: __m256| {
        let q = _mm256_sub_epi32(_mm256_cvtepu8_epi32(bytes), centre);
        _mm256_mul_ps(_mm256_cvtepi32_ps(q), scale)
    };
    [
        weight(front, first),
        weight(_mm_unpackhi_epi64(front, front), first),
        weight(back, second),
        weight(_mm_unpackhi_epi64(back, back), second),
    ]
}

/// [`super::decode_bytes`] of the 32 signed bytes at `quants`.
///
/// # Safety
/// The CPU must support AVX2; `quants` must point to 32 bytes.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn decode_bytes(quants: *const u8, scale: __m256) -> Block {
    // SAFETY: the caller guarantees 32 readable bytes.
    let (low, high) = unsafe {
        (
            _mm_loadu_si128(quants.cast()),
            _mm_loadu_si128(quants.add(16).cast()),
        )
    };
    let weight = |q: __m128i| _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q)), scale);
    [
        weight(low),
        weight(_mm_unpackhi_epi64(low, low)),
        weight(high),
        weight(_mm_unpackhi_epi64(high, high)),
    ]
}

/// [`super::sum_lanes`] of the 32 lanes `block[0] ++ … ++ block[3]`: the
/// same tree.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn sum_lanes(block: Block) -> f32 {
    let s16 = [
        _mm256_add_ps(block[0], block[2]),
        _mm256_add_ps(block[1], block[3]),
    ];
    let s8 = _mm256_add_ps(s16[0], s16[1]);
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
    // SAFETY: a `Cpu` exists only where AVX2, FMA and F16C were detected.
    unsafe { dots_avx2(cpu, rows, count, x, k, stride, out) }
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dots_avx2<W: super::Source>(
    cpu: Cpu,
    rows: W,
    count: usize,
    x: &[f32],
    k: usize,
    stride: usize,
    out: &mut [f32],
) {
    super::dots(super::Isa::Avx2(cpu), rows, count, x, k, stride, out)
}

/// [`super::decode_rows`]: the first `out.len() / k` rows into `out`.
pub(crate) fn decode_rows<W: Block256>(_cpu: Cpu, rows: W, k: usize, out: &mut [f32]) {
    // SAFETY: a `Cpu` exists only where AVX2, FMA and F16C were detected.
    unsafe { decode_rows_avx2(rows, k, out) }
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn decode_rows_avx2<W: Block256>(rows: W, k: usize, out: &mut [f32]) {
    let whole = out.len() / k * k;
    rows.check(whole / BLOCK);
    for (b, chunk) in out[..whole].chunks_exact_mut(BLOCK).enumerate() {
        rows.prefetch(b, PREFETCH_BYTES);
        // SAFETY: AVX2, FMA and F16C are enabled for this function; block `b` was
        // checked; `chunk` holds exactly 32 floats, the four stores' 8 each.
        unsafe {
            for (i, v) in rows.block256(b).into_iter().enumerate() {
                _mm256_storeu_ps(chunk.as_mut_ptr().add(8 * i), v);
            }
        }
    }
}

/// [`super::tile`]: `out[r][c] = x[r] · w[c]`, with four 8-lane
/// accumulators per output. `M × R` should be at most 2 (see the module
/// docs), or the accumulators leave the registers.
/// The widened block parameters are the tile's own: a buffer made once by
/// the caller, as the AVX-512 tiles take it, measured 5–10 % slower in
/// these register-tight loops.
pub(crate) fn tile<const M: usize, const R: usize, W: Block256>(
    _cpu: Cpu,
    x: [&[f32]; M],
    w: [W; R],
) -> [[f32; R]; M] {
    // SAFETY: a `Cpu` exists only where AVX2, FMA and F16C were detected.
    unsafe { tile_avx2(x, w) }
}

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn tile_avx2<const M: usize, const R: usize, W: Block256>(
    x: [&[f32]; M],
    w: [W; R],
) -> [[f32; R]; M] {
    let blocks = super::tile_blocks(x, w);
    let zero = _mm256_setzero_ps();
    let mut acc = [[[zero; 4]; R]; M];
    let mut widened = [Widened::EMPTY; R];
    let mut first = 0;
    while first < blocks {
        let n = WIDENED_BLOCKS.min(blocks - first);
        for (into, row) in widened.iter_mut().zip(w) {
            // SAFETY: AVX2, FMA and F16C are enabled for this function;
            // every row was checked for `blocks >= first + n` blocks.
            unsafe { row.widen(first, n, into) };
        }
        for i in 0..n {
            let b = first + i;
            for (c, (row, widened)) in w.into_iter().zip(&widened).enumerate() {
                row.prefetch(b, PREFETCH_BYTES);
                // SAFETY: as above, `blocks > b`; `widened` holds this
                // group's parameters, `i < n`.
                let values = unsafe { row.block256_widened(b, widened, i) };
                for (acc_row, x_row) in acc.iter_mut().zip(x) {
                    let lanes = &mut acc_row[c];
                    for (l, (lane, &v)) in lanes.iter_mut().zip(&values).enumerate() {
                        // SAFETY: every activation row holds `blocks` blocks.
                        let xs = unsafe { _mm256_loadu_ps(x_row.as_ptr().add(b * BLOCK + 8 * l)) };
                        *lane = _mm256_fmadd_ps(xs, v, *lane);
                    }
                }
            }
        }
        first += n;
    }
    let mut sums = [[0.0f32; R]; M];
    for (s_row, acc_row) in sums.iter_mut().zip(acc) {
        for (s, lanes) in s_row.iter_mut().zip(acc_row) {
            *s = sum_lanes(lanes);
        }
    }
    sums
}

/// [`super::lanes`]' kernel: `out[r * stride + c] = x[r] · w[c]` for the
/// `m` activation rows of the lane-major `groups` and the `count` weight
/// rows of the lane-major `tiles`, each `blocks` blocks wide. Every chain
/// is one lane of [`super::reference_dot`] (the same exactly rounded
/// multiply-adds in the same order), and the 32 lanes are added in
/// [`super::sum_lanes`]'s tree, eight rows at a time.
#[allow(clippy::too_many_arguments)] // the shapes of both layouts and of the output
pub(crate) fn lane_dots(
    _cpu: Cpu,
    groups: &[f32],
    m: usize,
    tiles: &[f32],
    count: usize,
    blocks: usize,
    stride: usize,
    out: &mut [f32],
) {
    let (group_len, tile_len) = (BLOCK * blocks * GROUP_ROWS, BLOCK * blocks * TILE_WEIGHTS);
    assert!(
        groups.len() >= m.div_ceil(GROUP_ROWS) * group_len
            && tiles.len() >= count.div_ceil(TILE_WEIGHTS) * tile_len,
        "lane-major groups or tiles shorter than their rows"
    );
    assert!(
        m == 0 || count == 0 || out.len() >= (m - 1) * stride + count,
        "output shorter than its rows"
    );
    // SAFETY: a `Cpu` exists only where AVX2, FMA and F16C were detected;
    // every group and tile read is inside the slices (checked above).
    unsafe { lane_dots_avx2(groups, m, tiles, count, blocks, stride, out) }
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn lane_dots_avx2(
    groups: &[f32],
    m: usize,
    tiles: &[f32],
    count: usize,
    blocks: usize,
    stride: usize,
    out: &mut [f32],
) {
    let (group_len, tile_len) = (BLOCK * blocks * GROUP_ROWS, BLOCK * blocks * TILE_WEIGHTS);
    let zero = _mm256_setzero_ps();
    // Each lane's chains run to the end before the next lane's start; the
    // 32 results wait here for the tree.
    let mut lanes = [[[zero; GROUP_VECTORS]; TILE_WEIGHTS]; BLOCK];
    let mut sums = [[0.0f32; GROUP_ROWS]; TILE_WEIGHTS];
    for g in 0..m.div_ceil(GROUP_ROWS) {
        let group = groups[g * group_len..].as_ptr();
        let rows = GROUP_ROWS.min(m - g * GROUP_ROWS);
        for t in 0..count.div_ceil(TILE_WEIGHTS) {
            let tile = tiles[t * tile_len..].as_ptr();
            for (j, lane) in lanes.iter_mut().enumerate() {
                let mut acc = [[zero; GROUP_VECTORS]; TILE_WEIGHTS];
                for b in 0..blocks {
                    // SAFETY: the caller guarantees `BLOCK * blocks` steps of
                    // GROUP_ROWS floats a group and of TILE_WEIGHTS a tile.
                    unsafe {
                        let xs = group.add((j * blocks + b) * GROUP_ROWS);
                        let ws = tile.add((j * blocks + b) * TILE_WEIGHTS);
                        let mut x = [zero; GROUP_VECTORS];
                        for (v, x) in x.iter_mut().enumerate() {
                            *x = _mm256_loadu_ps(xs.add(8 * v));
                        }
                        for (c, acc) in acc.iter_mut().enumerate() {
                            let w = _mm256_broadcast_ss(&*ws.add(c));
                            for (acc, &x) in acc.iter_mut().zip(&x) {
                                *acc = _mm256_fmadd_ps(x, w, *acc);
                            }
                        }
                    }
                }
                *lane = acc;
            }
            let mut width = BLOCK;
            while width > 1 {
                width /= 2;
                for j in 0..width {
                    #[allow(clippy::needless_range_loop)] // indexes two lanes alike
                    for c in 0..TILE_WEIGHTS {
                        for v in 0..GROUP_VECTORS {
                            lanes[j][c][v] = _mm256_add_ps(lanes[j][c][v], lanes[j + width][c][v]);
                        }
                    }
                }
            }
            for (s, sum) in sums.iter_mut().zip(&lanes[0]) {
                for (v, &vector) in sum.iter().enumerate() {
                    // SAFETY: `s` holds GROUP_ROWS = 8 * GROUP_VECTORS floats.
                    unsafe { _mm256_storeu_ps(s.as_mut_ptr().add(8 * v), vector) };
                }
            }
            let first = t * TILE_WEIGHTS;
            let columns = TILE_WEIGHTS.min(count - first);
            for r in 0..rows {
                let row = &mut out[(g * GROUP_ROWS + r) * stride + first..][..columns];
                for (c, o) in row.iter_mut().enumerate() {
                    *o = sums[c][r];
                }
            }
        }
    }
}

/// [`super::lanes::interleave_group`]: up to [`GROUP_ROWS`] rows of `k`
/// (`rows`) into one lane-major group `out`, zero past the last row. Eight
/// rows by eight lanes at a time, transposed in registers.
pub(crate) fn interleave_group(_cpu: Cpu, rows: &[f32], k: usize, out: &mut [f32]) {
    assert!(
        out.len() == GROUP_ROWS * k && rows.len() <= out.len() && k.is_multiple_of(BLOCK),
        "a lane-major group is {GROUP_ROWS} rows of whole blocks"
    );
    // SAFETY: a `Cpu` exists only where AVX2, FMA and F16C were detected;
    // the shapes were checked above.
    unsafe { interleave_group_avx2(rows, k, out) }
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn interleave_group_avx2(rows: &[f32], k: usize, out: &mut [f32]) {
    let blocks = k / BLOCK;
    let present = rows.len() / k;
    let zero = _mm256_setzero_ps();
    for first in (0..GROUP_ROWS).step_by(8) {
        for b in 0..blocks {
            for j0 in (0..BLOCK).step_by(8) {
                let mut v = [zero; 8];
                for (p, v) in v.iter_mut().enumerate() {
                    if first + p < present {
                        let at = (first + p) * k + b * BLOCK + j0;
                        // SAFETY: row `first + p` is present, and `at + 8 <= k` past its start.
                        *v = unsafe { _mm256_loadu_ps(rows.as_ptr().add(at)) };
                    }
                }
                for (j, column) in transpose8(v).into_iter().enumerate() {
                    let at = ((j0 + j) * blocks + b) * GROUP_ROWS + first;
                    // SAFETY: `at + 8 <= GROUP_ROWS * k = out.len()` (checked by the caller).
                    unsafe { _mm256_storeu_ps(out.as_mut_ptr().add(at), column) };
                }
            }
        }
    }
}

/// [`super::lanes::interleave_tiles`]: rows of `k` decoded back to back
/// into tiles of [`TILE_WEIGHTS`], zero past the last row. Four rows by
/// eight lanes at a time, transposed in registers.
pub(crate) fn interleave_tiles(_cpu: Cpu, decoded: &[f32], k: usize, out: &mut [f32]) {
    let count = decoded.len() / k;
    assert!(
        out.len() == count.next_multiple_of(TILE_WEIGHTS) * k && k.is_multiple_of(BLOCK),
        "whole tiles of whole blocks"
    );
    // SAFETY: a `Cpu` exists only where AVX2, FMA and F16C were detected;
    // the shapes were checked above.
    unsafe { interleave_tiles_avx2(decoded, k, out) }
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn interleave_tiles_avx2(decoded: &[f32], k: usize, out: &mut [f32]) {
    const { assert!(TILE_WEIGHTS == 4, "the transpose below takes four rows") };
    let blocks = k / BLOCK;
    let count = decoded.len() / k;
    let zero = _mm256_setzero_ps();
    for (t, tile) in out.chunks_exact_mut(TILE_WEIGHTS * k).enumerate() {
        for b in 0..blocks {
            for j0 in (0..BLOCK).step_by(8) {
                let mut v = [zero; 4];
                for (c, v) in v.iter_mut().enumerate() {
                    let row = t * TILE_WEIGHTS + c;
                    if row < count {
                        // SAFETY: row `row` is present, and block `b` lies inside it.
                        *v = unsafe {
                            _mm256_loadu_ps(decoded.as_ptr().add(row * k + b * BLOCK + j0))
                        };
                    }
                }
                // [r0 r1 r2 r3] of lanes j0 + i and j0 + i + 4 in each half.
                let (t0, t1) = (
                    _mm256_unpacklo_ps(v[0], v[1]),
                    _mm256_unpackhi_ps(v[0], v[1]),
                );
                let (t2, t3) = (
                    _mm256_unpacklo_ps(v[2], v[3]),
                    _mm256_unpackhi_ps(v[2], v[3]),
                );
                let quads = [
                    _mm256_shuffle_ps::<0x44>(t0, t2),
                    _mm256_shuffle_ps::<0xEE>(t0, t2),
                    _mm256_shuffle_ps::<0x44>(t1, t3),
                    _mm256_shuffle_ps::<0xEE>(t1, t3),
                ];
                for (i, quad) in quads.into_iter().enumerate() {
                    let low = (j0 + i) * blocks + b;
                    let high = (j0 + i + 4) * blocks + b;
                    // SAFETY: both steps are below `BLOCK * blocks`, whose
                    // TILE_WEIGHTS floats each lie inside `tile`.
                    unsafe {
                        _mm_storeu_ps(
                            tile.as_mut_ptr().add(low * TILE_WEIGHTS),
                            _mm256_castps256_ps128(quad),
                        );
                        _mm_storeu_ps(
                            tile.as_mut_ptr().add(high * TILE_WEIGHTS),
                            _mm256_extractf128_ps::<1>(quad),
                        );
                    }
                }
            }
        }
    }
}

/// The 8 × 8 transpose: lane `j` of result `i` is lane `i` of row `j`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn transpose8(r: [__m256; 8]) -> [__m256; 8] {
    let t = [
        _mm256_unpacklo_ps(r[0], r[1]),
        _mm256_unpackhi_ps(r[0], r[1]),
        _mm256_unpacklo_ps(r[2], r[3]),
        _mm256_unpackhi_ps(r[2], r[3]),
        _mm256_unpacklo_ps(r[4], r[5]),
        _mm256_unpackhi_ps(r[4], r[5]),
        _mm256_unpacklo_ps(r[6], r[7]),
        _mm256_unpackhi_ps(r[6], r[7]),
    ];
    let u = [
        _mm256_shuffle_ps::<0x44>(t[0], t[2]),
        _mm256_shuffle_ps::<0xEE>(t[0], t[2]),
        _mm256_shuffle_ps::<0x44>(t[1], t[3]),
        _mm256_shuffle_ps::<0xEE>(t[1], t[3]),
        _mm256_shuffle_ps::<0x44>(t[4], t[6]),
        _mm256_shuffle_ps::<0xEE>(t[4], t[6]),
        _mm256_shuffle_ps::<0x44>(t[5], t[7]),
        _mm256_shuffle_ps::<0xEE>(t[5], t[7]),
    ];
    [
        _mm256_permute2f128_ps::<0x20>(u[0], u[4]),
        _mm256_permute2f128_ps::<0x20>(u[1], u[5]),
        _mm256_permute2f128_ps::<0x20>(u[2], u[6]),
        _mm256_permute2f128_ps::<0x20>(u[3], u[7]),
        _mm256_permute2f128_ps::<0x31>(u[0], u[4]),
        _mm256_permute2f128_ps::<0x31>(u[1], u[5]),
        _mm256_permute2f128_ps::<0x31>(u[2], u[6]),
        _mm256_permute2f128_ps::<0x31>(u[3], u[7]),
    ]
}

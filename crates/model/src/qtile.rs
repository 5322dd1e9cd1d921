//! Register-tiled micro-kernels for quantized matmuls: the hot loop where
//! weight rows meet activation rows.
//!
//! A weight row is read one 32-weight block at a time through [`BlockRow`]:
//! decoded in registers from the repacked 4-bit ([`Nibbles`]) or 8-bit
//! ([`Bytes`]) layout or from the file's own 5-bit ([`FiveBits`]) and
//! 6-bit ([`SixBits`]) blocks, or loaded from a row decoded earlier
//! ([`Decoded`]).
//! [`tile`] multiplies up to four activation rows by up to four weight rows
//! (four with one or two activation rows, else two, so the accumulators fit
//! the registers; six activation rows over [`Decoded`] rows on AVX-512; the
//! portable code takes one activation row at a time):
//! each decoded block serves every activation row and each activation block
//! every weight row while it is in a register. Over many activation rows
//! on AVX2, [`lanes`] regroups both sides so an accumulator holds one lane
//! of eight rows instead of one row's 32 lanes.
//!
//! # One sequence of operations
//!
//! Every output element is one [`reference_dot`]: lane `j` of a 32-lane
//! accumulator takes element `j` of each block with an exactly rounded
//! multiply-add (`f32::mul_add`), blocks in ascending order, then
//! [`sum_lanes`] adds the lanes as a fixed tree. Which source a weight
//! row comes from, how many rows share its tile, which instruction set the
//! dispatcher picked and which thread ran it change the speed, never the
//! bits: a request's logits are the same alone or batched (batch
//! invariance), and every vector variant equals the scalar reference
//! exactly (property tests below).

#[cfg(target_arch = "x86_64")]
pub(crate) mod avx2;
#[cfg(target_arch = "x86_64")]
pub(crate) mod avx512;
pub(crate) mod lanes;

use crate::isa::per_isa;

/// Weights per block: the block size of Q4_0, Q4_1 and Q8_0, and the lanes
/// of every accumulator.
pub(crate) const BLOCK: usize = 32;
/// Activation rows in the largest tile (of the AVX-512 kernels, over rows
/// decoded earlier).
pub(crate) const MAX_TILE_ROWS: usize = 6;
/// Blocks whose f16 scales and offsets a vector tile widens together,
/// before it decodes them ([`Widened`]).
pub(crate) const WIDENED_BLOCKS: usize = 16;

/// One weight row's block scales and offsets for up to [`WIDENED_BLOCKS`]
/// consecutive blocks, widened from f16 to f32 (exactly) by one conversion
/// each, so that a block's decode broadcasts its pair with a plain load.
/// Widening and broadcasting each block's pair on its own cost about four
/// shuffle µops a block: on Intel cores those share one port with the
/// nibble lookups, and the tile waited on that port rather than on memory.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Widened {
    pub scales: [f32; WIDENED_BLOCKS],
    pub offsets: [f32; WIDENED_BLOCKS],
}

impl Widened {
    /// Nothing widened yet.
    pub(crate) const EMPTY: Widened = Widened {
        scales: [0.0; WIDENED_BLOCKS],
        offsets: [0.0; WIDENED_BLOCKS],
    };
}

/// Weight rows stored back to back that yield their f32 values one block
/// at a time.
pub(crate) trait BlockRow: Copy {
    /// The values of block `b` (weights `32 b .. 32 b + 32` of the first row).
    fn block(self, b: usize) -> [f32; BLOCK];

    /// The rows from row `i` on, rows being `blocks` blocks wide.
    fn skip(self, i: usize, blocks: usize) -> Self;

    /// Panics unless the first row holds at least `blocks` blocks: the one
    /// bounds check the vector kernels make per row, not per block.
    fn check(self, blocks: usize);

    /// Whether a block is loaded as it is rather than decoded: then a tile
    /// has the registers a decode would take for two more activation rows.
    const LOADED: bool = false;
}

/// A weight row every implementation of [`tile`] can read.
#[cfg(target_arch = "x86_64")]
pub(crate) trait Source: BlockRow + avx512::Block512 + avx2::Block256 {}
#[cfg(target_arch = "x86_64")]
impl<T: BlockRow + avx512::Block512 + avx2::Block256> Source for T {}
/// A weight row every implementation of [`tile`] can read.
#[cfg(not(target_arch = "x86_64"))]
pub(crate) trait Source: BlockRow {}
#[cfg(not(target_arch = "x86_64"))]
impl<T: BlockRow> Source for T {}

/// A block's scale or offset as a matrix keeps it: `f32`, or the file's
/// own f16 bits ([`Half`]) where the file's value is an f16 (Q4_1, Q8_0).
/// Both widen to f32 exactly, so which one a matrix keeps changes the
/// bytes a step reads, never a result.
pub(crate) trait Scale: Copy + std::fmt::Debug {
    /// Whether [`Scale::bits`] are an f16's (else an f32's): the vector
    /// kernels widen an f16 with one F16C instruction.
    const HALF: bool;

    /// The value, exactly.
    fn value(self) -> f32;

    /// The stored bits, widened to 32.
    fn bits(self) -> u32;
}

impl Scale for f32 {
    const HALF: bool = false;

    #[inline(always)]
    fn value(self) -> f32 {
        self
    }

    #[inline(always)]
    fn bits(self) -> u32 {
        self.to_bits()
    }
}

/// The bits of an IEEE half-precision value, as GGUF stores block scales.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(transparent)]
pub(crate) struct Half(pub u16);

impl Scale for Half {
    const HALF: bool = true;

    #[inline(always)]
    fn value(self) -> f32 {
        half::f16::from_bits(self.0).to_f32()
    }

    #[inline(always)]
    fn bits(self) -> u32 {
        u32::from(self.0)
    }
}

/// Rows already decoded to f32.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Decoded<'a>(pub &'a [f32]);

impl BlockRow for Decoded<'_> {
    const LOADED: bool = true;

    #[inline(always)]
    fn block(self, b: usize) -> [f32; BLOCK] {
        *<&[f32; BLOCK]>::try_from(&self.0[b * BLOCK..][..BLOCK])
            .expect("a decoded row is whole blocks")
    }

    #[inline(always)]
    fn skip(self, i: usize, blocks: usize) -> Self {
        Decoded(&self.0[i * blocks * BLOCK..])
    }

    fn check(self, blocks: usize) {
        assert!(
            self.0.len() >= blocks * BLOCK,
            "row shorter than its blocks"
        );
    }
}

/// 4-bit rows (Q4_0, Q4_1, Q4_K) repacked: per block 16 bytes of nibbles
/// (low nibbles are weights 0..16, high nibbles 16..32, as in ggml), a
/// scale and an offset, each weight being `q * scale + offset`.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Nibbles<'a, S: Scale = f32> {
    /// `k / 2` bytes a row.
    pub quants: &'a [u8],
    /// `k / 32` scales a row.
    pub scales: &'a [S],
    /// `k / 32` offsets a row (Q4_0: `-8 * scale`).
    pub offsets: &'a [S],
}

impl<S: Scale> BlockRow for Nibbles<'_, S> {
    #[inline(always)]
    fn block(self, b: usize) -> [f32; BLOCK] {
        let quants = <&[u8; 16]>::try_from(&self.quants[b * 16..][..16])
            .expect("a 4-bit block holds 16 bytes");
        decode_nibbles(quants, self.scales[b].value(), self.offsets[b].value())
    }

    #[inline(always)]
    fn skip(self, i: usize, blocks: usize) -> Self {
        Nibbles {
            quants: &self.quants[i * blocks * 16..],
            scales: &self.scales[i * blocks..],
            offsets: &self.offsets[i * blocks..],
        }
    }

    fn check(self, blocks: usize) {
        assert!(
            self.quants.len() >= blocks * 16
                && self.scales.len() >= blocks
                && self.offsets.len() >= blocks,
            "row shorter than its blocks"
        );
    }
}

/// 8-bit rows (Q8_0) repacked: per block 32 signed bytes and a scale.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Bytes<'a, S: Scale = Half> {
    /// `k` bytes a row, each an `i8`.
    pub quants: &'a [u8],
    /// `k / 32` scales a row.
    pub scales: &'a [S],
}

impl<S: Scale> BlockRow for Bytes<'_, S> {
    #[inline(always)]
    fn block(self, b: usize) -> [f32; BLOCK] {
        let quants = <&[u8; BLOCK]>::try_from(&self.quants[b * BLOCK..][..BLOCK])
            .expect("an 8-bit block holds 32 bytes");
        decode_bytes(quants, self.scales[b].value())
    }

    #[inline(always)]
    fn skip(self, i: usize, blocks: usize) -> Self {
        Bytes {
            quants: &self.quants[i * blocks * BLOCK..],
            scales: &self.scales[i * blocks..],
        }
    }

    fn check(self, blocks: usize) {
        assert!(
            self.quants.len() >= blocks * BLOCK && self.scales.len() >= blocks,
            "row shorter than its blocks"
        );
    }
}

/// 5-bit rows (Q5_0) as the file holds them: per block
/// 16 bytes of low nibbles (weights `j` and `j + 16` in byte `j`, as
/// [`Nibbles`]), a word of fifth bits (bit `j` for weight `j`) and the
/// file's f16 scale. Each weight is `q * scale - 16 * scale`, `q` in `0..32`: one
/// rounding of the exact `(q - 16) * scale` (`16 * scale` is exact), so
/// the same bits as the file's definition. 22 bytes a block, as the file,
/// where signed bytes and an f32 scale took 36.
#[derive(Debug, Clone, Copy)]
pub(crate) struct FiveBits<'a> {
    /// `k / 2` bytes a row.
    pub quants: &'a [u8],
    /// `k / 32` words of fifth bits a row.
    pub high: &'a [u32],
    /// `k / 32` scales a row.
    pub scales: &'a [Half],
}

impl BlockRow for FiveBits<'_> {
    #[inline(always)]
    fn block(self, b: usize) -> [f32; BLOCK] {
        let quants = <&[u8; 16]>::try_from(&self.quants[b * 16..][..16])
            .expect("a 5-bit block holds 16 bytes of nibbles");
        decode_five_bits(quants, self.high[b], self.scales[b].value())
    }

    #[inline(always)]
    fn skip(self, i: usize, blocks: usize) -> Self {
        FiveBits {
            quants: &self.quants[i * blocks * 16..],
            high: &self.high[i * blocks..],
            scales: &self.scales[i * blocks..],
        }
    }

    fn check(self, blocks: usize) {
        assert!(
            self.quants.len() >= blocks * 16
                && self.high.len() >= blocks
                && self.scales.len() >= blocks,
            "row shorter than its blocks"
        );
    }
}

/// Weights in one Q6_K super-block.
pub(crate) const SIX_BITS_SUPER: usize = 256;
/// Bytes of one Q6_K super-block: 128 of low nibbles, 64 of high bit
/// pairs, 16 signed scales, the f16 super-scale.
pub(crate) const SIX_BITS_SUPER_BYTES: usize = 210;

/// 6-bit rows (Q6_K) as the file holds them, read in place: no repacking,
/// so a step reads the file's 210 bytes per 256 weights. Weight `l` of
/// 32-weight block `b` is `(q - 32) · (d · scale)`, `q` in `0..64` put
/// together from a nibble and a bit pair, `scale` the block's 16-weight
/// run's signed byte: `d · scale` is exact (an f16 times an `i8` holds at
/// most 19 significant bits), so there is one rounding, as in the file's
/// definition (`quant::dequantize_row`), and the same bits.
#[derive(Debug, Clone, Copy)]
pub(crate) struct SixBits<'a>(pub &'a [u8]);

/// Where the pieces of one 32-weight block of a [`SixBits`] row lie.
#[derive(Debug, Clone, Copy)]
pub(crate) struct SixBitsBlock {
    /// Offset of the 32 bytes holding the block's low nibbles.
    pub low: usize,
    /// Shift that brings them to the bottom of each byte (0 or 4).
    pub low_shift: u32,
    /// Offset of the 32 bytes holding the block's high bit pairs.
    pub high: usize,
    /// Shift that brings them to the bottom of each byte (0, 2, 4 or 6).
    pub high_shift: u32,
    /// Offset of the two signed scales (weights `0..16`, `16..32`).
    pub scales: usize,
    /// Offset of the super-block's f16 scale.
    pub d: usize,
}

impl SixBits<'_> {
    /// The layout llama.cpp gives a super-block: block `i` of eight is
    /// quarter `i % 4` of half `i / 4`; a quarter takes the low or high
    /// nibbles of one 32-byte run of its half's 64 bytes and bit pair
    /// `i % 4` of its half's 32 bytes of high bits.
    #[inline(always)]
    pub(crate) fn at(b: usize) -> SixBitsBlock {
        let base = b / 8 * SIX_BITS_SUPER_BYTES;
        let (half, quarter) = (b % 8 / 4, b % 4);
        SixBitsBlock {
            low: base + 64 * half + 32 * (quarter % 2),
            low_shift: 4 * (quarter / 2) as u32,
            high: base + 128 + 32 * half,
            high_shift: 2 * quarter as u32,
            scales: base + 192 + 8 * half + 2 * quarter,
            d: base + 208,
        }
    }

    /// The two 16-weight runs' scales of block `b`, `d · scale` (exact).
    #[inline(always)]
    pub(crate) fn scales(self, at: &SixBitsBlock) -> [f32; 2] {
        let d = half::f16::from_le_bytes([self.0[at.d], self.0[at.d + 1]]).to_f32();
        [
            d * f32::from(self.0[at.scales] as i8),
            d * f32::from(self.0[at.scales + 1] as i8),
        ]
    }
}

impl BlockRow for SixBits<'_> {
    #[inline(always)]
    fn block(self, b: usize) -> [f32; BLOCK] {
        let at = Self::at(b);
        let scales = self.scales(&at);
        let mut out = [0.0f32; BLOCK];
        for (j, o) in out.iter_mut().enumerate() {
            let low = (self.0[at.low + j] >> at.low_shift) & 0x0F;
            let high = (self.0[at.high + j] >> at.high_shift) & 3;
            *o = scales[j / 16] * f32::from((low | high << 4) as i8 - 32);
        }
        out
    }

    #[inline(always)]
    fn skip(self, i: usize, blocks: usize) -> Self {
        SixBits(&self.0[i * blocks / 8 * SIX_BITS_SUPER_BYTES..])
    }

    fn check(self, blocks: usize) {
        assert!(
            (blocks * BLOCK).is_multiple_of(SIX_BITS_SUPER)
                && self.0.len() >= blocks / 8 * SIX_BITS_SUPER_BYTES,
            "row shorter than its blocks"
        );
    }
}

/// The value of each weight of a 5-bit block (see [`FiveBits`]).
#[inline(always)]
pub(crate) fn decode_five_bits(quants: &[u8; 16], high: u32, scale: f32) -> [f32; BLOCK] {
    let offset = -16.0 * scale;
    let fifth = |j: usize| (((high >> j) & 1) as u8) << 4;
    let mut out = [0.0f32; BLOCK];
    for j in 0..16 {
        out[j] = f32::from(quants[j] & 0x0F | fifth(j)).mul_add(scale, offset);
        out[j + 16] = f32::from(quants[j] >> 4 | fifth(j + 16)).mul_add(scale, offset);
    }
    out
}

/// The value of each weight of a 4-bit block: the one definition, shared
/// by the matmul and by row decoding (embedding lookups, tests).
#[inline(always)]
pub(crate) fn decode_nibbles(quants: &[u8; 16], scale: f32, offset: f32) -> [f32; BLOCK] {
    let mut out = [0.0f32; BLOCK];
    for j in 0..16 {
        out[j] = f32::from(quants[j] & 0x0F).mul_add(scale, offset);
        out[j + 16] = f32::from(quants[j] >> 4).mul_add(scale, offset);
    }
    out
}

/// The value of each weight of an 8-bit block.
#[inline(always)]
pub(crate) fn decode_bytes(quants: &[u8; BLOCK], scale: f32) -> [f32; BLOCK] {
    let mut out = [0.0f32; BLOCK];
    for (o, &q) in out.iter_mut().zip(quants) {
        *o = f32::from(q as i8) * scale;
    }
    out
}

/// Sums 32 lanes as a fixed tree (halves added pairwise), so the order is
/// the same everywhere and vectorises to a few shuffles.
#[inline(always)]
pub(crate) fn sum_lanes(mut lanes: [f32; BLOCK]) -> f32 {
    let mut width = BLOCK;
    while width > 1 {
        width /= 2;
        for j in 0..width {
            lanes[j] += lanes[j + width];
        }
    }
    lanes[0]
}

/// The blocks of a tile's activation rows, after checking once that every
/// weight and activation row holds that many: every [`tile`] variant's
/// bounds check.
#[inline(always)]
pub(crate) fn tile_blocks<const M: usize, const R: usize, W: BlockRow>(
    x: [&[f32]; M],
    w: [W; R],
) -> usize {
    let blocks = x[0].len() / BLOCK;
    for row in w {
        row.check(blocks);
    }
    for x_row in x {
        assert!(
            x_row.len() >= blocks * BLOCK,
            "activation row shorter than k"
        );
    }
    blocks
}

/// `out[r][c] = x[r] · w[c]` for `M` activation rows and `R` weight rows,
/// each element computed exactly as [`reference_dot`] does.
#[inline(always)]
pub(crate) fn tile<const M: usize, const R: usize, W: BlockRow>(
    x: [&[f32]; M],
    w: [W; R],
) -> [[f32; R]; M] {
    let blocks = tile_blocks(x, w);
    let mut acc = [[[0.0f32; BLOCK]; R]; M];
    for b in 0..blocks {
        // Explicit loops, not `array::from_fn` or `map`: those are not
        // always inlined, and out of line they lose the caller's target
        // features (`mul_add` becomes a libm call).
        let mut values = [[0.0f32; BLOCK]; R];
        for (v, row) in values.iter_mut().zip(w) {
            *v = row.block(b);
        }
        for (acc_row, x_row) in acc.iter_mut().zip(x) {
            let xs = <&[f32; BLOCK]>::try_from(&x_row[b * BLOCK..][..BLOCK])
                .expect("activation rows are whole blocks");
            for (lanes, v) in acc_row.iter_mut().zip(&values) {
                for j in 0..BLOCK {
                    lanes[j] = xs[j].mul_add(v[j], lanes[j]);
                }
            }
        }
    }
    let mut sums = [[0.0f32; R]; M];
    for (s_row, acc_row) in sums.iter_mut().zip(acc) {
        for (s, lanes) in s_row.iter_mut().zip(acc_row) {
            *s = sum_lanes(lanes);
        }
    }
    sums
}

/// Which implementation of [`tile`] a driver calls.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Isa {
    /// The portable code, compiled per instruction set ([`per_isa!`]).
    Portable,
    /// Hand-written AVX2 ([`avx2::tile`]), on an x86-64 CPU without
    /// AVX-512.
    #[cfg(target_arch = "x86_64")]
    Avx2(avx2::Cpu),
    /// Hand-written AVX-512 ([`avx512::tile`]), on a CPU that has it.
    #[cfg(target_arch = "x86_64")]
    Avx512(avx512::Cpu),
}

impl Isa {
    /// Activation rows per tile. The portable code takes one: with more,
    /// LLVM keeps the accumulators on the stack and runs them as scalars
    /// (measured on this crate's SmolLM2 bench, portable code on an AVX-512
    /// CPU: batch 8 decode 29 tok/s with four rows, 147 with one).
    /// AVX-512 takes six over rows decoded earlier (24 accumulators, two
    /// weight and two activation vectors: 28 of its 32 registers) and four
    /// where blocks are decoded in registers, whose masks, scales and
    /// offsets would not fit beside six. Measured on this machine's Zen 5,
    /// alternated pairs: Gemma 3's 512-token prefill 529 / 565 ms with four
    /// rows, 496 / 524 with six; SmolLM2's decode at batch 8 with six rows
    /// for its decoded-in-registers Q4_1 was 11 % slower.
    fn max_tile_rows<W: BlockRow>(self) -> usize {
        match self {
            Isa::Portable => 1,
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2(_) => 2,
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512(_) if W::LOADED => MAX_TILE_ROWS,
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512(_) => 4,
        }
    }

    /// Weight rows per tile of `m` activation rows: as many as keep the
    /// accumulators (32 lanes per output) in registers.
    fn weight_rows(self, m: usize) -> usize {
        match self {
            #[cfg(target_arch = "x86_64")]
            // Measured at 8 concurrent: four by one or two by two (sixteen
            // accumulators) spill and run at two thirds of the speed.
            Isa::Avx2(_) => 2 / m.max(1),
            _ if m <= 2 => 4,
            _ => 2,
        }
    }
}

/// The widest hand-written tiles this process runs (`Portable`: none).
pub(crate) fn hand_written() -> crate::isa::IsaCap {
    match best_isa() {
        Isa::Portable => crate::isa::IsaCap::Portable,
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2(_) => crate::isa::IsaCap::Avx2,
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512(_) => crate::isa::IsaCap::Avx512,
    }
}

/// `out[r * stride + c] = x[r] · rows[c]` for every activation row of `x`
/// (rows of `k`) and each of the first `count` weight rows: tiles of up to
/// [`Isa::max_tile_rows`] activation rows by two or four weight rows.
#[inline(always)]
fn dots<W: Source>(
    isa: Isa,
    rows: W,
    count: usize,
    x: &[f32],
    k: usize,
    stride: usize,
    out: &mut [f32],
) {
    let m = x.len() / k;
    let max_rows = isa.max_tile_rows::<W>();
    let mut first = 0;
    while first < m {
        let take = max_rows.min(m - first);
        let x = &x[first * k..(first + take) * k];
        let out = &mut out[first * stride..];
        match take {
            6 => tile_rows::<6, W>(isa, rows, count, x, k, stride, out),
            5 => tile_rows::<5, W>(isa, rows, count, x, k, stride, out),
            4 => tile_rows::<4, W>(isa, rows, count, x, k, stride, out),
            3 => tile_rows::<3, W>(isa, rows, count, x, k, stride, out),
            2 => tile_rows::<2, W>(isa, rows, count, x, k, stride, out),
            _ => tile_rows::<1, W>(isa, rows, count, x, k, stride, out),
        }
        first += take;
    }
}

/// [`dots`] for exactly `M` activation rows.
#[inline(always)]
fn tile_rows<const M: usize, W: Source>(
    isa: Isa,
    rows: W,
    count: usize,
    x: &[f32],
    k: usize,
    stride: usize,
    out: &mut [f32],
) {
    let blocks = k / BLOCK;
    let mut rows_x: [&[f32]; M] = [&[]; M];
    for (r, row) in rows_x.iter_mut().enumerate() {
        *row = &x[r * k..(r + 1) * k];
    }
    let x = rows_x;
    // The AVX-512 tiles' widened block parameters, made once here: made
    // (and so zeroed) in every tile, they cost a sixth of a one-row matmul
    // at SmolLM2's widths.
    let mut widened = [Widened::EMPTY; 4];
    let mut c = 0;
    // Few activation rows leave registers for four weight rows at a time
    // (more independent work per loaded activation block).
    let widest = isa.weight_rows(M);
    if widest >= 4 {
        while c + 4 <= count {
            let quad = [
                rows.skip(c, blocks),
                rows.skip(c + 1, blocks),
                rows.skip(c + 2, blocks),
                rows.skip(c + 3, blocks),
            ];
            store(
                &tile_with::<M, 4, W>(isa, x, quad, &mut widened),
                c,
                stride,
                out,
            );
            c += 4;
        }
    }
    while widest >= 2 && c + 2 <= count {
        let pair = [rows.skip(c, blocks), rows.skip(c + 1, blocks)];
        store(
            &tile_with::<M, 2, W>(isa, x, pair, &mut widened),
            c,
            stride,
            out,
        );
        c += 2;
    }
    while c < count {
        store(
            &tile_with::<M, 1, W>(isa, x, [rows.skip(c, blocks)], &mut widened),
            c,
            stride,
            out,
        );
        c += 1;
    }
}

/// Writes a tile's sums at column `c` of rows `stride` apart.
#[inline(always)]
fn store<const M: usize, const R: usize>(
    sums: &[[f32; R]; M],
    c: usize,
    stride: usize,
    out: &mut [f32],
) {
    for (r, s) in sums.iter().enumerate() {
        out[r * stride + c..][..R].copy_from_slice(s);
    }
}

#[inline(always)]
fn tile_with<const M: usize, const R: usize, W: Source>(
    isa: Isa,
    x: [&[f32]; M],
    w: [W; R],
    widened: &mut [Widened],
) -> [[f32; R]; M] {
    match isa {
        Isa::Portable => {
            // Only the AVX-512 tiles take the buffer (`avx2::tile` says why
            // its tiles keep their own); named here for targets without them.
            let _ = widened;
            tile::<M, R, W>(x, w)
        }
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2(cpu) => avx2::tile::<M, R, W>(cpu, x, w),
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512(cpu) => avx512::tile::<M, R, W>(cpu, x, w, widened),
    }
}

/// The fastest implementation this CPU runs, within
/// [`crate::isa::widest_isa`].
fn best_isa() -> Isa {
    #[cfg(target_arch = "x86_64")]
    {
        use crate::isa::{IsaCap, widest_isa};
        let cap = widest_isa();
        if let Some(cpu) = avx512::Cpu::detect().filter(|_| cap >= IsaCap::Avx512) {
            return Isa::Avx512(cpu);
        }
        if let Some(cpu) = avx2::Cpu::detect().filter(|_| cap >= IsaCap::Avx2) {
            return Isa::Avx2(cpu);
        }
    }
    Isa::Portable
}

/// `out[r * stride + c] = x[r] · rows[c]` for every activation row of `x`
/// (rows of `k`) and the first `count` rows of `rows`, by the fastest
/// implementation this CPU runs.
pub(crate) fn dots_of<W: Source>(
    rows: W,
    count: usize,
    x: &[f32],
    k: usize,
    stride: usize,
    out: &mut [f32],
) {
    match best_isa() {
        Isa::Portable => portable_dots(rows, count, x, k, stride, out),
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2(cpu) => avx2::dots(cpu, rows, count, x, k, stride, out),
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512(cpu) => avx512::dots(cpu, rows, count, x, k, stride, out),
    }
}

/// [`dots_of`] rows decoded earlier, back to back in `decoded`.
pub(crate) fn dots_decoded(decoded: &[f32], x: &[f32], k: usize, stride: usize, out: &mut [f32]) {
    dots_of(Decoded(decoded), decoded.len() / k, x, k, stride, out);
}

// The portable drivers, each compiled per instruction set and picked at
// run time within `KVFENCE_MAX_ISA`'s cap.

per_isa! {
    fn portable_dots<W: Source>(
        rows: W,
        count: usize,
        x: &[f32],
        k: usize,
        stride: usize,
        out: &mut [f32],
    ) {
        dots(Isa::Portable, rows, count, x, k, stride, out)
    }
}

/// Decodes the first `out.len() / k` rows of `rows` into `out`, back to
/// back, by the fastest implementation this CPU runs.
pub(crate) fn decode_rows_of<W: Source>(rows: W, k: usize, out: &mut [f32]) {
    match best_isa() {
        Isa::Portable => portable_decode_rows(rows, k, out),
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2(cpu) => avx2::decode_rows(cpu, rows, k, out),
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512(cpu) => avx512::decode_rows(cpu, rows, k, out),
    }
}

per_isa! {
    fn portable_decode_rows<W: BlockRow>(rows: W, k: usize, out: &mut [f32]) {
        decode_rows(rows, k, out)
    }
}

/// Rows are back to back, so block `b` of the set is block `b` of `out`.
#[inline(always)]
fn decode_rows<W: BlockRow>(rows: W, k: usize, out: &mut [f32]) {
    let whole = out.len() / k * k;
    for (b, chunk) in out[..whole].chunks_exact_mut(BLOCK).enumerate() {
        chunk.copy_from_slice(&rows.block(b));
    }
}

/// The scalar definition every kernel variant must match bit for bit:
/// 32 lanes of exactly rounded multiply-adds over whole blocks, summed by
/// [`sum_lanes`].
#[cfg(test)]
pub(crate) fn reference_dot(x: &[f32], w: &[f32]) -> f32 {
    assert_eq!(x.len(), w.len(), "dot of rows of different widths");
    assert_eq!(x.len() % BLOCK, 0, "rows are whole blocks");
    let mut lanes = [0.0f32; BLOCK];
    for (xs, ws) in x.chunks_exact(BLOCK).zip(w.chunks_exact(BLOCK)) {
        for j in 0..BLOCK {
            lanes[j] = xs[j].mul_add(ws[j], lanes[j]);
        }
    }
    sum_lanes(lanes)
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use proptest::prelude::*;

    /// Deterministic pseudo-random values in [-1, 1] (xorshift).
    pub(crate) fn floats(seed: u64, len: usize) -> Vec<f32> {
        let mut s = seed | 1;
        (0..len)
            .map(|_| {
                s ^= s << 13;
                s ^= s >> 7;
                s ^= s << 17;
                (s % 20001) as f32 / 10000.0 - 1.0
            })
            .collect()
    }

    fn bytes(seed: u64, len: usize) -> Vec<u8> {
        floats(seed, len)
            .iter()
            .map(|v| (v * 127.5 + 127.5) as u8)
            .collect()
    }

    /// Every implementation this CPU runs, dispatched and portable, and the
    /// reference, over one weight source.
    fn check_all<W: Source>(
        rows: W,
        count: usize,
        m: usize,
        k: usize,
        seed: u64,
        portable: fn(W, usize, &[f32], usize, usize, &mut [f32]),
    ) -> Result<(), TestCaseError> {
        let x = floats(seed, m * k);
        let mut decoded = vec![0.0; count * k];
        decode_rows(rows, k, &mut decoded);
        let stride = count + 3;
        let mut results = vec![("portable", vec![f32::NAN; m * stride])];
        portable(rows, count, &x, k, stride, &mut results[0].1);
        #[cfg(target_arch = "x86_64")]
        if let Some(cpu) = avx512::Cpu::detect() {
            let mut vector_decoded = vec![f32::NAN; count * k];
            avx512::decode_rows(cpu, rows, k, &mut vector_decoded);
            let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
            prop_assert_eq!(bits(&vector_decoded), bits(&decoded));
            let mut out = vec![f32::NAN; m * stride];
            avx512::dots(cpu, rows, count, &x, k, stride, &mut out);
            results.push(("avx512", out));
        }
        #[cfg(target_arch = "x86_64")]
        if let Some(cpu) = avx2::Cpu::detect() {
            let mut vector_decoded = vec![f32::NAN; count * k];
            avx2::decode_rows(cpu, rows, k, &mut vector_decoded);
            let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
            prop_assert_eq!(bits(&vector_decoded), bits(&decoded));
            let mut out = vec![f32::NAN; m * stride];
            avx2::dots(cpu, rows, count, &x, k, stride, &mut out);
            results.push(("avx2", out));
        }
        for (name, out) in &results {
            for r in 0..m {
                for c in 0..count {
                    let want = reference_dot(&x[r * k..(r + 1) * k], &decoded[c * k..(c + 1) * k]);
                    let got = out[r * stride + c];
                    prop_assert_eq!(
                        got.to_bits(),
                        want.to_bits(),
                        "{} ({}, {}): {} vs {}",
                        name,
                        r,
                        c,
                        got,
                        want
                    );
                }
            }
        }
        Ok(())
    }

    proptest! {
        #[test]
        fn every_kernel_variant_equals_the_scalar_reference_bit_for_bit(
            m in 1usize..11, count in 1usize..20,
            // Rows of a few blocks, and rows past one and two groups of
            // widened scales (`WIDENED_BLOCKS`), whole or with a tail.
            blocks in prop_oneof![1usize..6, 15usize..18, 31usize..34],
            seed in any::<u64>(),
        ) {
            let k = blocks * BLOCK;
            let scales = floats(seed ^ 1, count * blocks);
            let offsets = floats(seed ^ 2, count * blocks);
            let nibble_quants = bytes(seed ^ 3, count * k / 2);
            let nibbles = Nibbles { quants: &nibble_quants, scales: &scales, offsets: &offsets };
            check_all(nibbles, count, m, k, seed, portable_dots)?;
            // Scales kept as the file's f16 bits (every finite f16 and
            // subnormals among them).
            let halves = |values: &[f32]| -> Vec<Half> {
                values.iter().map(|&v| Half(half::f16::from_f32(v * 1e-3).to_bits())).collect()
            };
            let (half_scales, half_offsets) = (halves(&scales), halves(&offsets));
            let nibbles = Nibbles { quants: &nibble_quants, scales: &half_scales, offsets: &half_offsets };
            check_all(nibbles, count, m, k, seed, portable_dots)?;
            let byte_quants = bytes(seed ^ 4, count * k);
            let signed = Bytes { quants: &byte_quants, scales: &scales };
            check_all(signed, count, m, k, seed, portable_dots)?;
            let signed = Bytes { quants: &byte_quants, scales: &half_scales };
            check_all(signed, count, m, k, seed, portable_dots)?;
            let high: Vec<u32> = bytes(seed ^ 6, count * blocks * 4)
                .chunks_exact(4)
                .map(|w| u32::from_le_bytes([w[0], w[1], w[2], w[3]]))
                .collect();
            let five = FiveBits { quants: &nibble_quants, high: &high, scales: &half_scales };
            check_all(five, count, m, k, seed, portable_dots)?;
            let values = floats(seed ^ 5, count * k);
            check_all(Decoded(&values), count, m, k, seed, portable_dots)?;
        }

        #[test]
        fn six_bit_rows_equal_the_scalar_reference_in_every_variant(
            m in 1usize..7, count in 1usize..12, supers in 1usize..3, seed in any::<u64>(),
        ) {
            let k = supers * SIX_BITS_SUPER;
            let mut rows = bytes(seed, count * supers * SIX_BITS_SUPER_BYTES);
            // Finite super-scales of every magnitude an f16 holds.
            for (i, block) in rows.chunks_exact_mut(SIX_BITS_SUPER_BYTES).enumerate() {
                let d = half::f16::from_f32(floats(seed ^ i as u64, 1)[0] * 0.01);
                block[208..].copy_from_slice(&d.to_le_bytes());
            }
            check_all(SixBits(&rows), count, m, k, seed, portable_dots)?;
            // The portable decode is the file's definition.
            let mut reference = vec![0.0; k];
            let mut decoded = vec![0.0; k];
            for (row, bytes) in rows.chunks_exact(supers * SIX_BITS_SUPER_BYTES).enumerate() {
                crate::quant::dequantize_row(crate::quant::QuantFormat::Q6_K, bytes, &mut reference);
                decode_rows(SixBits(bytes), k, &mut decoded);
                let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
                prop_assert_eq!(bits(&decoded), bits(&reference), "row {}", row);
            }
        }

    }

    #[test]
    fn lanes_sum_as_a_tree() {
        let mut lanes = [0.0f32; BLOCK];
        // 1e8 absorbs a 1.0 added to it: the tree pairs lane 0 with 16,
        // so the two large lanes cancel before the small ones are added.
        lanes[0] = 1e8;
        lanes[16] = -1e8;
        lanes[1] = 1.0;
        assert_eq!(sum_lanes(lanes), 1.0);
    }
}

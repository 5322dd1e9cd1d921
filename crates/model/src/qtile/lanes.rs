//! Lane-major tiles, for matmuls over many activation rows (prefill, large
//! batches): one accumulator holds one lane of many rows, not all 32 lanes
//! of one row.
//!
//! [`super::tile`] keeps every output's 32-lane accumulator in registers,
//! so a tile holds few outputs: on AVX2 (sixteen 8-lane registers, four a
//! 32-lane accumulator) one activation row by two weight rows, and each
//! multiply-add needs a load of its own. Here the same arithmetic is
//! regrouped. Lane `j` of output `(r, c)` is the chain
//! `acc = x[r][32 b + j] · w[c][32 b + j] + acc` over blocks `b` in
//! ascending order; the chains of [`GROUP_VECTORS`] × 8 activation rows
//! for one lane and one weight row sit side by side in a few registers,
//! and one weight value, broadcast, feeds a whole register of rows. A tile
//! runs lane `j`'s chains to the end for [`TILE_WEIGHTS`] weight rows at
//! once (eight accumulators, two activation loads and four broadcasts for
//! eight multiply-adds), keeps the 32 lanes' results, then adds them in
//! [`super::sum_lanes`]'s tree. Every output gets the operations of
//! [`super::reference_dot`] in its order, so the bits are the same as
//! every other path's (property tests below). AVX2 only: on AVX-512 the
//! same kernel was slower than the register tiles (`docs/performance.md`,
//! "Lane-major tiles for AVX2 prefill and large batches").
//!
//! That takes two layouts, written once per matmul (activations) and once
//! per task (its decoded weight rows): a group of activation rows as
//! `[lane j][block b][row p]` ([`LaneKernel::interleave_group`]) and a
//! tile of weight rows as `[lane j][block b][row c]`
//! ([`LaneKernel::interleave_tiles`]), so that each
//! chain reads both contiguously.

use super::BLOCK;

/// Weight rows per lane-major tile.
pub(crate) const TILE_WEIGHTS: usize = 4;

/// Eight-lane vectors of activation rows per group (AVX2): two, so a
/// tile's chains take eight of the sixteen registers. Three (twelve
/// accumulators) spilled one to the stack; measured in
/// `docs/performance.md`.
pub(crate) const GROUP_VECTORS: usize = 2;

/// Activation rows per lane-major group: [`GROUP_VECTORS`] vectors of eight.
pub(crate) const GROUP_ROWS: usize = 8 * GROUP_VECTORS;

/// The lane-major kernel this CPU runs, if any: the portable code keeps
/// [`super::dots_of`]'s tiles.
#[derive(Debug, Clone, Copy)]
pub(crate) enum LaneKernel {
    /// [`super::avx2::lane_dots`], on AVX2 (also where AVX-512 is capped
    /// to AVX2).
    #[cfg(target_arch = "x86_64")]
    Avx2(super::avx2::Cpu),
}

impl LaneKernel {
    /// The kernel for this CPU within [`crate::isa::widest_isa`]: AVX2
    /// where that is the widest hand-written set.
    pub(crate) fn detect() -> Option<LaneKernel> {
        #[cfg(target_arch = "x86_64")]
        if let super::Isa::Avx2(cpu) = super::best_isa() {
            return Some(LaneKernel::Avx2(cpu));
        }
        None
    }

    /// Writes up to [`GROUP_ROWS`] activation rows (`rows`, each `k` wide)
    /// as one lane-major group: `out[(j · blocks + b) · GROUP_ROWS + p]` is
    /// element `32 b + j` of row `p`, zero for rows past the last.
    pub(crate) fn interleave_group(self, rows: &[f32], k: usize, out: &mut [f32]) {
        match self {
            #[cfg(target_arch = "x86_64")]
            LaneKernel::Avx2(cpu) => super::avx2::interleave_group(cpu, rows, k, out),
        }
    }

    /// Writes weight rows decoded back to back (`decoded`, each `k` wide)
    /// as tiles of [`TILE_WEIGHTS`]: tile `t` at `out[t · TILE_WEIGHTS · k..]`,
    /// `[(j · blocks + b) · TILE_WEIGHTS + c]` being element `32 b + j` of
    /// row `t · TILE_WEIGHTS + c`, zero for rows past the last.
    pub(crate) fn interleave_tiles(self, decoded: &[f32], k: usize, out: &mut [f32]) {
        match self {
            #[cfg(target_arch = "x86_64")]
            LaneKernel::Avx2(cpu) => super::avx2::interleave_tiles(cpu, decoded, k, out),
        }
    }

    /// `out[r * stride + c] = x[r] · w[c]` for the `m` activation rows of
    /// groups written by [`LaneKernel::interleave_group`] and the `count`
    /// weight rows of tiles written by [`LaneKernel::interleave_tiles`], all `k` wide.
    #[allow(clippy::too_many_arguments)] // the shapes of both layouts and of the output
    pub(crate) fn dots(
        self,
        groups: &[f32],
        m: usize,
        tiles: &[f32],
        count: usize,
        k: usize,
        stride: usize,
        out: &mut [f32],
    ) {
        match self {
            #[cfg(target_arch = "x86_64")]
            LaneKernel::Avx2(cpu) => {
                super::avx2::lane_dots(cpu, groups, m, tiles, count, k / BLOCK, stride, out)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::qtile::reference_dot;
    use crate::qtile::tests::floats;
    use proptest::prelude::*;

    /// The layouts' definitions, element by element.
    /// Writes up to [`GROUP_ROWS`] activation rows (`rows`, each `k` wide) as
    /// one lane-major group: `out[(j · blocks + b) · GROUP_ROWS + p]` is
    /// element `32 b + j` of row `p`, zero for rows past the last.
    fn interleave_group(rows: &[f32], k: usize, out: &mut [f32]) {
        let blocks = k / BLOCK;
        assert_eq!(out.len(), GROUP_ROWS * k, "a group is {GROUP_ROWS} rows");
        assert!(rows.len() <= out.len(), "at most {GROUP_ROWS} rows a group");
        let present = rows.len() / k;
        for (p, row) in rows.chunks_exact(k).enumerate() {
            for (b, block) in row.chunks_exact(BLOCK).enumerate() {
                for (j, &value) in block.iter().enumerate() {
                    out[(j * blocks + b) * GROUP_ROWS + p] = value;
                }
            }
        }
        if present < GROUP_ROWS {
            for chain in out.chunks_exact_mut(GROUP_ROWS) {
                chain[present..].fill(0.0);
            }
        }
    }

    /// Writes weight rows decoded back to back (`decoded`, each `k` wide) as
    /// tiles of [`TILE_WEIGHTS`]: tile `t` at `out[t · TILE_WEIGHTS · k..]`,
    /// `[(j · blocks + b) · TILE_WEIGHTS + c]` being element `32 b + j` of
    /// row `t · TILE_WEIGHTS + c`, zero for rows past the last.
    fn interleave_tiles(decoded: &[f32], k: usize, out: &mut [f32]) {
        let blocks = k / BLOCK;
        let count = decoded.len() / k;
        assert_eq!(
            out.len(),
            count.next_multiple_of(TILE_WEIGHTS) * k,
            "whole tiles"
        );
        for (tile, rows) in out
            .chunks_exact_mut(TILE_WEIGHTS * k)
            .zip(decoded.chunks(TILE_WEIGHTS * k))
        {
            let present = rows.len() / k;
            for (c, row) in rows.chunks_exact(k).enumerate() {
                for (b, block) in row.chunks_exact(BLOCK).enumerate() {
                    for (j, &value) in block.iter().enumerate() {
                        tile[(j * blocks + b) * TILE_WEIGHTS + c] = value;
                    }
                }
            }
            if present < TILE_WEIGHTS {
                for chain in tile.chunks_exact_mut(TILE_WEIGHTS) {
                    chain[present..].fill(0.0);
                }
            }
        }
    }

    /// The lane-major kernel this CPU runs, whatever `KVFENCE_MAX_ISA` says.
    fn kernel() -> Option<LaneKernel> {
        #[cfg(target_arch = "x86_64")]
        return super::super::avx2::Cpu::detect().map(LaneKernel::Avx2);
        #[cfg(not(target_arch = "x86_64"))]
        None
    }

    proptest! {
        #[test]
        fn lane_major_dots_equal_the_scalar_reference_bit_for_bit(
            m in 1usize..60, count in 1usize..20, blocks in 1usize..5, seed in any::<u64>(),
        ) {
            let k = blocks * BLOCK;
            let x = floats(seed, m * k);
            let w = floats(seed ^ 7, count * k);
            let groups = m.div_ceil(GROUP_ROWS);
            let mut want_groups = vec![f32::NAN; groups * GROUP_ROWS * k];
            for (g, group) in want_groups.chunks_exact_mut(GROUP_ROWS * k).enumerate() {
                interleave_group(&x[g * GROUP_ROWS * k..x.len().min((g + 1) * GROUP_ROWS * k)], k, group);
            }
            let mut want_tiles = vec![f32::NAN; count.next_multiple_of(TILE_WEIGHTS) * k];
            interleave_tiles(&w, k, &mut want_tiles);
            let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
            if let Some(kernel) = kernel() {
                let mut got_groups = vec![f32::NAN; want_groups.len()];
                for (g, group) in got_groups.chunks_exact_mut(GROUP_ROWS * k).enumerate() {
                    kernel.interleave_group(&x[g * GROUP_ROWS * k..x.len().min((g + 1) * GROUP_ROWS * k)], k, group);
                }
                prop_assert_eq!(bits(&got_groups), bits(&want_groups));
                let mut got_tiles = vec![f32::NAN; want_tiles.len()];
                kernel.interleave_tiles(&w, k, &mut got_tiles);
                prop_assert_eq!(bits(&got_tiles), bits(&want_tiles));
                let stride = count + 3;
                let mut out = vec![f32::NAN; m * stride];
                kernel.dots(&got_groups, m, &got_tiles, count, k, stride, &mut out);
                for r in 0..m {
                    for c in 0..count {
                        let want = reference_dot(&x[r * k..(r + 1) * k], &w[c * k..(c + 1) * k]);
                        prop_assert_eq!(out[r * stride + c].to_bits(), want.to_bits(), "({}, {})", r, c);
                    }
                    // Columns past `count` are left alone.
                    prop_assert!(out[r * stride + count..(r * stride + stride).min(out.len())].iter().all(|v| v.is_nan()));
                }
            }
        }
    }
}

//! [`KeyBlocks`]: where the SIMD score kernels find a chunk's keys, and
//! the checks that let them read keys where they lie in the pages and
//! trust every buffer of a call ([`ChunkData::check`]).
//!
//! A block is 16 key positions ([`BLOCK`], one AVX-512 vector or two AVX2
//! ones); a kernel loads dimension `d` of a block's 16 keys from one
//! address. That is true of the staged scratch (`[head_dim][CHUNK]`) and,
//! since pages store keys as columns ([`Keys`]), of 16 slots of one page.

#![allow(unsafe_code)]

use std::marker::PhantomData;
use std::ops::Range;

use kvfence_pool::Keys;

use super::{CHUNK, ChunkData, ChunkShape, KEY_STEP};

/// Key positions per block.
pub(crate) const BLOCK: usize = 16;

const _: () = assert!(BLOCK == KEY_STEP && CHUNK.is_multiple_of(BLOCK));

/// Where the score kernel finds a chunk's keys: for each block of 16 key
/// positions, the address of dimension 0 of those 16 keys, dimension `d`
/// lying `d · stride` elements further. Made only by [`KeyBlocks::staged`]
/// and [`KeyBlocks::from_pages`], which check that every element the
/// kernel reads lies in a slice they were given — for pages, in the valid
/// slots of a [`Keys`] (I2): a block is read from a page only when all 16
/// of its slots were written.
pub(crate) struct KeyBlocks<'a, K> {
    blocks: [*const K; CHUNK / BLOCK],
    count: usize,
    stride: usize,
    head_dim: usize,
    keys: PhantomData<&'a [K]>,
}

impl<'a> KeyBlocks<'a, f32> {
    /// The staged keys, `[head_dim][CHUNK]` with the first `cols` columns
    /// written (a whole number of blocks).
    pub(crate) fn staged(keys: &'a [f32], head_dim: usize, cols: usize) -> Self {
        assert!(
            head_dim > 0
                && cols.is_multiple_of(BLOCK)
                && cols <= CHUNK
                && keys.len() >= (head_dim - 1) * CHUNK + cols,
            "staged keys must hold {cols} columns of {head_dim} dimensions"
        );
        let mut blocks = [std::ptr::null(); CHUNK / BLOCK];
        for (b, block) in blocks.iter_mut().take(cols / BLOCK).enumerate() {
            *block = keys[b * BLOCK..].as_ptr();
        }
        KeyBlocks {
            blocks,
            count: cols / BLOCK,
            stride: CHUNK,
            head_dim,
            keys: PhantomData,
        }
    }
}

impl<'a, E: Copy> KeyBlocks<'a, E> {
    /// A chunk's keys where they lie in its pages — `runs` are `(keys,
    /// slots)` of each page in position order — when every run is whole
    /// blocks of 16 valid slots; `None` otherwise (a partial last page,
    /// pages of other sizes), and the caller stages them.
    pub(crate) fn from_pages(
        runs: impl IntoIterator<Item = (Keys<'a, E>, Range<usize>)>,
    ) -> Option<Self> {
        let mut blocks = [std::ptr::null(); CHUNK / BLOCK];
        let (mut count, mut shape) = (0, None);
        for (keys, slots) in runs {
            let hd = keys.head_dim();
            if hd == 0
                || !slots.len().is_multiple_of(BLOCK)
                || slots.end > keys.slots()
                || *shape.get_or_insert((keys.stride(), hd)) != (keys.stride(), hd)
            {
                return None;
            }
            let (first, last) = (keys.column(0), keys.column(hd - 1));
            // Columns are `stride` apart in one block: the last one lying
            // where that puts it bounds every column between.
            assert_eq!(
                last.as_ptr(),
                first.as_ptr().wrapping_add((hd - 1) * keys.stride()),
                "a page's key columns are stride apart"
            );
            for slot in slots.step_by(BLOCK) {
                if count == blocks.len() {
                    return None;
                }
                // Slots `slot..slot + 16` are valid in every column.
                blocks[count] = first[slot..slot + BLOCK].as_ptr();
                count += 1;
            }
        }
        let (stride, head_dim) = shape?;
        Some(KeyBlocks {
            blocks,
            count,
            stride,
            head_dim,
            keys: PhantomData,
        })
    }
}

impl<K> KeyBlocks<'_, K> {
    /// Blocks of the chunk.
    pub(crate) fn count(&self) -> usize {
        self.count
    }

    /// Dimensions of every key.
    pub(crate) fn head_dim(&self) -> usize {
        self.head_dim
    }

    /// The address of dimension `d` of block `b`'s 16 keys.
    ///
    /// # Safety
    /// `b < self.count()` and `d < self.head_dim()`; then the 16 elements
    /// there are ones a maker checked.
    #[inline(always)]
    pub(crate) unsafe fn column(&self, b: usize, d: usize) -> *const K {
        debug_assert!(b < self.count && d < self.head_dim);
        // SAFETY: in bounds by the caller's promise and the maker's checks.
        unsafe { self.blocks[b].add(d * self.stride) }
    }
}

impl<E, K> ChunkData<'_, [&[E]], KeyBlocks<'_, K>> {
    /// Panics unless every buffer of a SIMD kernel's call holds `shape`:
    /// what the kernels' unchecked reads and writes rely on.
    pub(crate) fn check(&self, shape: ChunkShape) {
        let ChunkShape {
            heads,
            head_dim: hd,
            cols,
            len,
            ..
        } = shape;
        assert!(
            cols.is_multiple_of(KEY_STEP) && len <= cols && cols <= CHUNK,
            "key columns must be whole key steps of one chunk"
        );
        assert!(
            self.queries.len() >= heads * hd
                && self.keys.head_dim() == hd
                && self.keys.count() * BLOCK == cols
                && self.values.iter().all(|run| run.len().is_multiple_of(hd))
                && self.values.iter().map(|run| run.len()).sum::<usize>() >= len * hd
                && self.scores.len() >= heads * CHUNK
                && self.out.len() >= heads * hd
                && self.max.len() >= heads
                && self.den.len() >= heads,
            "every buffer must hold the chunk's shape"
        );
    }
}

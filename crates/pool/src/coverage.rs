//! Per-page record of which `(layer, slot)` cells were written in the page's
//! current generation. This is the fact I2 is checked against: a read is
//! allowed only over cells marked here, and the marks are wiped whenever the
//! page changes generation.

use std::ops::Range;

/// One bit per `(layer, slot)` of a page, layer-major.
#[derive(Debug, Clone)]
pub(crate) struct Coverage {
    page_size: usize,
    words: Box<[u64]>,
}

impl Coverage {
    pub(crate) fn new(layers: usize, page_size: usize) -> Self {
        Coverage {
            page_size,
            words: vec![0; (layers * page_size).div_ceil(64)].into_boxed_slice(),
        }
    }

    /// Forgets every mark: the page starts a new generation.
    pub(crate) fn clear(&mut self) {
        self.words.fill(0);
    }

    /// Marks `slots` of `layer` as written.
    pub(crate) fn mark(&mut self, layer: usize, slots: Range<usize>) {
        debug_assert!(slots.end <= self.page_size);
        let base = layer * self.page_size;
        for bit in base + slots.start..base + slots.end {
            self.words[bit / 64] |= 1 << (bit % 64);
        }
    }

    /// The first slot in `0..upto` of `layer` that is not written, if any.
    pub(crate) fn first_gap(&self, layer: usize, upto: usize) -> Option<usize> {
        debug_assert!(upto <= self.page_size);
        let base = layer * self.page_size;
        let (mut bit, end) = (base, base + upto);
        while bit < end {
            let word = self.words[bit / 64] >> (bit % 64);
            let span = (64 - bit % 64).min(end - bit);
            let missing = (!word).trailing_zeros() as usize;
            if missing < span {
                return Some(bit + missing - base);
            }
            bit += span;
        }
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gaps_are_found_across_word_boundaries_and_layers() {
        let mut c = Coverage::new(3, 100);
        assert_eq!(c.first_gap(1, 100), Some(0));
        c.mark(1, 0..70);
        assert_eq!(c.first_gap(1, 70), None);
        assert_eq!(c.first_gap(1, 71), Some(70));
        assert_eq!(c.first_gap(0, 1), Some(0), "marks stay in their layer");
        assert_eq!(c.first_gap(2, 1), Some(0), "marks stay in their layer");
        c.mark(1, 71..100);
        assert_eq!(c.first_gap(1, 100), Some(70));
        c.mark(1, 70..71);
        assert_eq!(c.first_gap(1, 100), None);
        c.clear();
        assert_eq!(c.first_gap(1, 1), Some(0));
    }
}

//! [`ReadView`]: proof that a range of positions was written in the current
//! generation, and the only way to read KV out of the pool.
//!
//! A view exists only if the coverage check passed when it was made (I2);
//! it holds the pages' read locks for its whole life, so nothing can change
//! them while it is read.

use std::marker::PhantomData;
use std::ops::Range;

use parking_lot::RwLockReadGuard;

use crate::element::KvElement;
use crate::ledger::Page;
use crate::spec::Geometry;

/// Read access to positions `first_page * page_size..len` of some layers
/// of one lease (`first_page` is 0 except in a sliding-window layer's
/// view). Page numbers in its methods count from position 0.
pub struct ReadView<'a, E> {
    geometry: &'a Geometry,
    /// The layers readable, as the caller numbers them (the model's).
    layers: Range<usize>,
    /// Where `layers.start` lies in a page (its index in the layer group).
    page_layer: usize,
    first_page: usize,
    len: usize,
    guards: Vec<RwLockReadGuard<'a, Page>>,
    elem: PhantomData<E>,
}

impl<'a, E> ReadView<'a, E> {
    pub(crate) fn new(
        geometry: &'a Geometry,
        layers: Range<usize>,
        first_page: usize,
        len: usize,
        guards: Vec<RwLockReadGuard<'a, Page>>,
    ) -> Self {
        assert_eq!(
            first_page + guards.len(),
            len.div_ceil(geometry.page_size),
            "a view holds every page from its first to the one holding position len - 1"
        );
        ReadView {
            geometry,
            page_layer: layers.start,
            layers,
            first_page,
            len,
            guards,
            elem: PhantomData,
        }
    }
}

impl<E> ReadView<'_, E> {
    /// The same one-layer view, its layer called `layer`: a layer group's
    /// page holds the model's layer `layer` at the view's index.
    pub(crate) fn named(mut self, layer: usize) -> Self {
        assert_eq!(self.layers.len(), 1, "only a one-layer view is renamed");
        self.layers = layer..layer + 1;
        self
    }

    /// One past the last position covered by the view.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the view covers no position.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Token slots per page.
    pub fn page_size(&self) -> usize {
        self.geometry.page_size
    }

    /// One past the last page the view spans: pages
    /// `first_page()..num_pages()` are readable.
    pub fn num_pages(&self) -> usize {
        self.first_page + self.guards.len()
    }

    /// The first page the view spans (it begins at that page's first
    /// position); earlier positions are not part of it.
    pub fn first_page(&self) -> usize {
        self.first_page
    }

    /// Valid slots in page `page` of the view (the last may be partial).
    pub fn slots_in_page(&self, page: usize) -> usize {
        self.guard(page);
        self.geometry
            .page_size
            .min(self.len - page * self.geometry.page_size)
    }

    /// The held page `page` (counted from position 0). A page before the
    /// view's first is a position a sliding window gave back: reading it
    /// would read whatever the page holds now (I2).
    fn guard(&self, page: usize) -> &Page {
        assert!(
            page >= self.first_page && page < self.num_pages(),
            "I2: page {page} is outside the view's pages {}..{}",
            self.first_page,
            self.num_pages()
        );
        &self.guards[page - self.first_page]
    }

    /// Every layer's K and V of `slots` of page `page` as raw bytes, in the
    /// page's layout over just those slots
    /// ([`crate::Geometry::chunk_runs`]): what a hand-off chunk carries.
    /// Needs a view of every layer.
    pub fn export_slots(&self, page: usize, slots: Range<usize>) -> Vec<u8> {
        let mut out = Vec::with_capacity(self.geometry.chunk_bytes(slots.len()));
        for run in self.slot_runs(page, slots) {
            out.extend_from_slice(run);
        }
        out
    }

    /// The bytes of [`ReadView::export_slots`] where they lie in the page,
    /// without copying: one run per layer, K or V and KV head, in chunk
    /// order. Hashing or copying these costs one pass over the bytes where
    /// exporting first would cost two.
    pub fn slot_runs(
        &self,
        page: usize,
        slots: Range<usize>,
    ) -> impl Iterator<Item = &[u8]> + Clone + '_ {
        let g = self.geometry;
        assert!(
            self.layers == (0..g.shape.layers),
            "export needs a view of every layer"
        );
        assert!(
            slots.start < slots.end && slots.end <= self.slots_in_page(page),
            "slots {slots:?} are outside the view's page {page}"
        );
        let data: &[u8] = bytemuck::cast_slice(&self.guard(page).data);
        g.chunk_runs(slots).map(move |bytes| &data[bytes])
    }
}

impl<E: KvElement> ReadView<'_, E> {
    /// Keys of one head for the valid slots of one page, as columns (see
    /// [`Keys`]).
    pub fn keys(&self, page: usize, layer: usize, head: usize) -> Keys<'_, E> {
        let (block, slots) = self.block(page, layer, 0, head);
        Keys {
            block,
            page_size: self.geometry.page_size,
            head_dim: self.geometry.shape.head_dim,
            slots,
        }
    }

    /// Values of one head for the valid slots of one page:
    /// `[slot][head_dim]`, contiguous.
    pub fn values(&self, page: usize, layer: usize, head: usize) -> &[E] {
        let (block, slots) = self.block(page, layer, 1, head);
        &block[..slots * self.geometry.shape.head_dim]
    }

    /// The whole K or V block of one head of one page, and how many of its
    /// slots are valid: callers hand out only those.
    fn block(&self, page: usize, layer: usize, kv: usize, head: usize) -> (&[E], usize) {
        assert!(
            self.layers.contains(&layer),
            "layer {layer} is outside the view's layers {:?}",
            self.layers
        );
        assert!(
            head < self.geometry.shape.kv_heads,
            "kv head {head} does not exist"
        );
        let slots = self.slots_in_page(page);
        let data: &[E] = bytemuck::cast_slice(&self.guard(page).data);
        let start =
            self.geometry
                .block_offset(layer - self.layers.start + self.page_layer, kv, head);
        (&data[start..start + self.geometry.head_block()], slots)
    }
}

/// One head's keys for the valid slots of one page, stored as columns:
/// dimension `d` of every slot is one contiguous run ([`Keys::column`]),
/// so a score over many keys loads one vector per dimension. Only the
/// valid slots are reachable (I2): a partial page's later slots hold
/// whatever the page held before.
#[derive(Clone, Copy)]
pub struct Keys<'a, E> {
    /// The head's whole key block, `[dim][page_size]`.
    block: &'a [E],
    page_size: usize,
    head_dim: usize,
    slots: usize,
}

impl<'a, E: Copy> Keys<'a, E> {
    /// Valid slots: the length of every column.
    pub fn slots(&self) -> usize {
        self.slots
    }

    /// Dimensions: the number of columns.
    pub fn head_dim(&self) -> usize {
        self.head_dim
    }

    /// Elements from the start of one column to the next: column `d`
    /// begins `d · stride` elements after column 0, all in one block. What
    /// SIMD code that walks the columns by address relies on.
    pub fn stride(&self) -> usize {
        self.page_size
    }

    /// Dimension `dim` of every valid slot, in slot order.
    pub fn column(&self, dim: usize) -> &'a [E] {
        assert!(
            dim < self.head_dim,
            "dimension {dim} is outside the head's {}",
            self.head_dim
        );
        &self.block[dim * self.page_size..][..self.slots]
    }

    /// The columns in dimension order.
    pub fn columns(&self) -> impl Iterator<Item = &'a [E]> + '_ {
        (0..self.head_dim).map(|d| self.column(d))
    }

    /// The keys as rows, `[slot][head_dim]`: a copy, for callers that want
    /// one key's elements together.
    pub fn to_rows(&self) -> Vec<E> {
        let mut rows = Vec::with_capacity(self.slots * self.head_dim);
        for slot in 0..self.slots {
            rows.extend(self.columns().map(|column| column[slot]));
        }
        rows
    }
}

impl<E> std::fmt::Debug for Keys<'_, E> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Keys")
            .field("slots", &self.slots)
            .field("head_dim", &self.head_dim)
            .finish()
    }
}

impl<E> std::fmt::Debug for ReadView<'_, E> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ReadView")
            .field("layers", &self.layers)
            .field("first_page", &self.first_page)
            .field("len", &self.len)
            .field("pages", &self.guards.len())
            .finish()
    }
}

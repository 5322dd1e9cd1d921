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

    /// Every layer's K and V of `slots` of page `page` as raw bytes, laid
    /// out `[layer][K|V][kv_head][slot][head_dim]` over just those slots:
    /// what a hand-off chunk carries. Needs a view of every layer.
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
    /// Keys of one head for the valid slots of one page:
    /// `[slot][head_dim]`, contiguous.
    pub fn keys(&self, page: usize, layer: usize, head: usize) -> &[E] {
        self.block(page, layer, 0, head)
    }

    /// Values of one head for the valid slots of one page:
    /// `[slot][head_dim]`, contiguous.
    pub fn values(&self, page: usize, layer: usize, head: usize) -> &[E] {
        self.block(page, layer, 1, head)
    }

    fn block(&self, page: usize, layer: usize, kv: usize, head: usize) -> &[E] {
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
        &data[start..start + slots * self.geometry.shape.head_dim]
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

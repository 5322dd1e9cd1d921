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

/// Read access to positions `0..len` of some layers of one lease.
pub struct ReadView<'a, E> {
    geometry: &'a Geometry,
    layers: Range<usize>,
    len: usize,
    guards: Vec<RwLockReadGuard<'a, Page>>,
    elem: PhantomData<E>,
}

impl<'a, E> ReadView<'a, E> {
    pub(crate) fn new(
        geometry: &'a Geometry,
        layers: Range<usize>,
        len: usize,
        guards: Vec<RwLockReadGuard<'a, Page>>,
    ) -> Self {
        ReadView {
            geometry,
            layers,
            len,
            guards,
            elem: PhantomData,
        }
    }
}

impl<E> ReadView<'_, E> {
    /// Positions covered by the view.
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

    /// Pages the view spans.
    pub fn num_pages(&self) -> usize {
        self.guards.len()
    }

    /// Valid slots in page `page` of the view (the last may be partial).
    pub fn slots_in_page(&self, page: usize) -> usize {
        assert!(page < self.guards.len(), "page {page} is outside the view");
        self.geometry
            .page_size
            .min(self.len - page * self.geometry.page_size)
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
        let data: &[u8] = bytemuck::cast_slice(&self.guards[page].data);
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
        let data: &[E] = bytemuck::cast_slice(&self.guards[page].data);
        let start = self.geometry.block_offset(layer, kv, head);
        &data[start..start + slots * self.geometry.shape.head_dim]
    }
}

impl<E> std::fmt::Debug for ReadView<'_, E> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ReadView")
            .field("layers", &self.layers)
            .field("len", &self.len)
            .field("pages", &self.guards.len())
            .finish()
    }
}

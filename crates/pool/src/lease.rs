//! [`Lease`]: a request's pages — one run of pages per layer group — and
//! the only way to write into them.
//!
//! A lease is not `Clone`; dropping it is what gives its pages back (I8).
//! It holds one [`GroupLease`] per layer group of the pool
//! ([`crate::LayerGroups`]); a layer's reads and writes go to its group's,
//! fenced there (I1–I3). A pool of one group — every model without
//! sliding windows — has leases of one group, and the page-level calls
//! (the hand-off's chunks, one-sided windows, views of every layer) are
//! for those alone.
//!
//! A sliding-window group keeps only what its next rows read: each write
//! to one of its layers first slides its pages forward to
//! [`Keep::read_start`] of the written position, giving the pages behind
//! it back to the pool (I8 while the request runs); a read behind the
//! window is refused as released (I2, I7). [`Lease::read_start`] says where
//! a pass's reads of a layer begin.
//!
//! A lease made with [`crate::Pool::lease_with_prefix`] starts with pages
//! of the prefix cache: shared, read through the same coverage-checked
//! views, never written (a write to one is refused like a foreign page's).
//! Every group starts from the same cached prefix. [`Lease::seal`] turns
//! the lease's own full pages into shared ones.

use std::ops::Range;
use std::sync::Arc;

use crate::element::{ElemType, KvElement};
use crate::error::PoolError;
use crate::group::GroupLease;
use crate::layers::{Keep, LayerGroups};
use crate::ledger::Shared;
use crate::page::{PageRef, RequestId};
use crate::view::ReadView;
use crate::window::Window;

/// Pages leased to one request: one [`GroupLease`] per layer group.
pub struct Lease {
    shared: Arc<Shared>,
    groups: Vec<GroupLease>,
    tokens: usize,
    /// Positions written before the lease was granted, in every group.
    cached: usize,
}

impl Lease {
    pub(crate) fn new(
        shared: Arc<Shared>,
        groups: Vec<GroupLease>,
        tokens: usize,
        cached: usize,
    ) -> Self {
        assert_eq!(
            groups.len(),
            shared.groups.len(),
            "a lease holds one run of pages per layer group"
        );
        assert!(
            groups.iter().all(|g| g.owner() == groups[0].owner()),
            "I1: one owner for every group of a lease"
        );
        let lease = Lease {
            shared,
            groups,
            tokens,
            cached,
        };
        lease.assert_windows_sized();
        lease
    }

    /// The request that holds this lease.
    pub fn owner(&self) -> RequestId {
        self.groups[0].owner()
    }

    /// Tokens asked for when the lease was granted.
    pub fn tokens(&self) -> usize {
        self.tokens
    }

    /// The element type the pool stores K and V in.
    pub fn elem(&self) -> ElemType {
        self.shared.geometry.elem
    }

    /// Token slots per page.
    pub fn page_size(&self) -> usize {
        self.shared.geometry.page_size
    }

    /// Prompt positions `0..n` that were already written when the lease was
    /// granted — a prefix found in the cache — and need no computing.
    pub fn cached_tokens(&self) -> usize {
        self.cached
    }

    /// Pages of this lease, every group's, that are shared (read, never
    /// written by it).
    pub fn shared_pages(&self) -> usize {
        self.groups.iter().map(GroupLease::shared_pages).sum()
    }

    /// Pages this lease holds, every group's.
    pub fn held_pages(&self) -> usize {
        self.groups.iter().map(|g| g.pages().len()).sum()
    }

    /// One past the last position the lease can store: what its groups
    /// that keep every position hold (a windowed group always has room for
    /// its next write, as it slides).
    pub fn capacity_tokens(&self) -> usize {
        self.kept_groups()
            .map(|g| self.groups[g].capacity_tokens())
            .min()
            .expect("a pool has a group that keeps every position")
    }

    /// Adds room for `pages` more pages of positions, all or nothing: a
    /// page to every group that keeps every position, and to each
    /// windowed group until it holds its window. A request grows as it
    /// decodes instead of holding its whole completion's room from the
    /// start. Idle shared pages are evicted to make room; `Exhausted` when
    /// even that is not enough (the caller preempts someone). Never for a
    /// lease a one-sided writer may reach.
    pub fn grow(&mut self, pages: usize) -> Result<(), PoolError> {
        let page_size = self.page_size();
        let kept = self.groups[self.kept_groups().next().expect("a kept group")]
            .pages()
            .len();
        let wanted: Vec<usize> = (0..self.groups.len())
            .map(|g| {
                let most = LayerGroups::window_pages(self.shared.groups.keep(g), page_size);
                let target = most.map_or(kept + pages, |most| most.min(kept + pages));
                target.saturating_sub(self.groups[g].pages().len())
            })
            .collect();
        let mut ids = self
            .shared
            .take(self.owner(), wanted.iter().sum())?
            .into_iter();
        let owner = self.owner();
        for (group, count) in self.groups.iter_mut().zip(wanted) {
            let mine: Vec<_> = ids.by_ref().take(count).collect();
            group.extend(self.shared.stamp(mine, group.id(), owner));
        }
        self.assert_windows_sized();
        Ok(())
    }

    /// Seals every full page of `tokens` — the tokens whose KV this lease
    /// holds at positions `0..tokens.len()` — into the prefix cache, each
    /// group's into its own namespace, so later leases of that namespace
    /// read them instead of computing them. A sealed page is never written
    /// again, this lease included (I1). Pages already cached elsewhere, not
    /// fully written, over the tenant's quota, or of a windowed group that
    /// slid stay the lease's own. Returns how many pages were sealed.
    pub fn seal(&mut self, tokens: &[u32]) -> usize {
        self.groups.iter_mut().map(|g| g.seal(tokens)).sum()
    }

    /// The first position a pass whose rows start at `past` reads in
    /// `layer`: 0, or a windowed layer's [`Keep::read_start`].
    pub fn read_start(&self, layer: usize, past: usize) -> usize {
        self.shared.groups.place(layer).map_or(0, |(group, _)| {
            self.shared.groups.keep(group).read_start(past)
        })
    }

    /// Writes K and V of `layer` for `slots` of one page, fenced by `page`.
    ///
    /// `k` and `v` are token-major: `[slot][kv_head][head_dim]`. Refused,
    /// counted and without effect if the page is not held by this lease's
    /// group of that layer or `page.generation` is not its current
    /// generation (I3).
    pub fn write<E: KvElement>(
        &mut self,
        page: PageRef,
        layer: usize,
        slots: Range<usize>,
        k: &[E],
        v: &[E],
    ) -> Result<(), PoolError> {
        let (group, index) = self.place(layer)?;
        self.groups[group].write(page, index, slots, k, v)
    }

    /// Writes K and V of `layer` for consecutive token positions starting at
    /// `start`, across page boundaries. `k` and `v` are token-major as in
    /// [`Lease::write`]; the fencing tokens are this lease's own. A windowed
    /// layer's group first slides to where reads from `start` begin.
    pub fn write_positions<E: KvElement>(
        &mut self,
        layer: usize,
        start: usize,
        k: &[E],
        v: &[E],
    ) -> Result<(), PoolError> {
        let (group, index) = self.place(layer)?;
        let keep = self.shared.groups.keep(group);
        if let Keep::Window { .. } = keep {
            self.groups[group].slide(keep.read_start(start))?;
        }
        self.groups[group].write_positions(index, start, k, v)
    }

    /// A view of positions `0..len` of one layer, refused unless each of them
    /// was written in the current generation and is still held (I2).
    /// Attention reads through this while later layers of the same tokens
    /// are not yet computed.
    pub fn read_layer<E: KvElement>(
        &self,
        layer: usize,
        len: usize,
    ) -> Result<ReadView<'_, E>, PoolError> {
        self.read_layer_from(layer, 0, len)
    }

    /// A view of one layer from the page holding position `start` to
    /// position `len`: what a pass reads, from [`Lease::read_start`]. The
    /// view starts at that page's first position
    /// ([`ReadView::first_page`]); refused if a position it spans was
    /// given back by a slide or not written in the current generation (I2).
    pub fn read_layer_from<E: KvElement>(
        &self,
        layer: usize,
        start: usize,
        len: usize,
    ) -> Result<ReadView<'_, E>, PoolError> {
        let (group, index) = self.place(layer)?;
        Ok(self.groups[group]
            .read_layer_from(index, start, len)?
            .named(layer))
    }

    /// Whether a one-sided writer may still reach these pages (an open,
    /// unclosed window): if so, dropping the lease quarantines them.
    pub fn is_exposed(&self) -> bool {
        self.groups.iter().any(GroupLease::is_exposed)
    }

    // Page-level access by layer group: the hand-off moves each group's
    // pages from one lease into another of the same groups.

    /// The pool's layer groups, which this lease holds a run of pages in
    /// each of.
    pub fn layer_groups(&self) -> &LayerGroups {
        &self.shared.groups
    }

    /// Group `group`'s pages, in token order: page `i` holds positions from
    /// `group_first_position(group) + i * page_size`.
    pub fn group_pages(&self, group: usize) -> &[PageRef] {
        self.groups[group].pages()
    }

    /// The first position group `group` still holds: 0 unless it slid.
    pub fn group_first_position(&self, group: usize) -> usize {
        self.groups[group].first_position()
    }

    /// Group `group`'s leading pages that are shared (written and sealed).
    pub fn group_leading_shared_pages(&self, group: usize) -> usize {
        self.groups[group].leading_shared_pages()
    }

    /// Slides every windowed group to where a pass whose rows start at
    /// `past` reads ([`Keep::read_start`]), as its first write there would:
    /// a lease about to receive a prompt of `past` positions holds only
    /// the pages its next pass reads. All or nothing per group
    /// (`Exhausted` when the fresh pages for shared ones run short).
    pub fn slide_windows(&mut self, past: usize) -> Result<(), PoolError> {
        for (g, group) in self.groups.iter_mut().enumerate() {
            let keep = self.shared.groups.keep(g);
            if let Keep::Window { .. } = keep {
                group.slide(keep.read_start(past))?;
            }
        }
        self.assert_windows_sized();
        Ok(())
    }

    /// Checks, without reading, that every position of group `group`'s
    /// pages from the one holding `start` to position `len` was written in
    /// the current generation and is still held, in each of its layers
    /// (I2): the hand-off's commit test, group by group.
    pub fn check_group_covered(
        &self,
        group: usize,
        start: usize,
        len: usize,
    ) -> Result<(), PoolError> {
        self.groups[group].check_covered_from(start, len)
    }

    /// A view of every layer of group `group` from the page holding
    /// `start` to position `len`, for raw byte export; refused unless
    /// covered and held (I2).
    pub fn read_group_raw(
        &self,
        group: usize,
        start: usize,
        len: usize,
    ) -> Result<ReadView<'_, u8>, PoolError> {
        self.groups[group].read_view_raw_from(start, len)
    }

    /// [`Lease::write_slots_raw`] into group `group`'s page `page`.
    pub fn write_group_slots_raw(
        &mut self,
        group: usize,
        page: PageRef,
        slots: Range<usize>,
        bytes: &[u8],
    ) -> Result<(), PoolError> {
        self.groups[group].write_slots_raw(page, slots, bytes)
    }

    // Page-level access for leases of one layer group: a one-sided writer
    // stores into such leases' pages, and tests look at them whole.

    /// The pages held, in token order: page `i` holds positions from
    /// `first_position() + i * page_size`. One group only.
    pub fn pages(&self) -> &[PageRef] {
        self.only().pages()
    }

    /// Leading pages that are shared: positions
    /// `0..leading_shared_pages() * page_size` are written and sealed, so a
    /// hand-off into this lease need not carry them. One group only.
    pub fn leading_shared_pages(&self) -> usize {
        self.only().leading_shared_pages()
    }

    /// Gives back every page wholly before position `keep_from` and takes as
    /// many fresh pages at the end, all or nothing (see the group's
    /// `slide`): for a lease of one group whose every layer reads only from
    /// `keep_from` on. (Windowed groups of a grouped lease slide on their
    /// own as they are written.) Returns how many pages slid.
    pub fn slide(&mut self, keep_from: usize) -> Result<usize, PoolError> {
        self.only_mut().slide(keep_from)
    }

    /// The first position the lease still holds: 0 until it slides. One
    /// group only.
    pub fn first_position(&self) -> usize {
        self.only().first_position()
    }

    /// From now on, a one-sided writer may store into these pages behind the
    /// pool's back. When the lease is dropped its pages go to `Quarantined`,
    /// not `Free`, until [`crate::Pool::drain`] is called for this request
    /// (I4). One group only.
    pub fn expose_to_one_sided_writer(&mut self) {
        self.only_mut().expose_to_one_sided_writer();
    }

    /// Opens a one-sided write window over this lease's pages and marks the
    /// lease as exposed: when it is dropped its pages are quarantined until
    /// [`Window::release`] finds the window drained (I4). Close it with
    /// [`Lease::close_window`] once the writer is done to release normally.
    /// One group only.
    pub fn open_window(&mut self) -> Window {
        self.only_mut().open_window()
    }

    /// Revokes `window` and, if no write is still in flight, returns this
    /// lease to ordinary release. Refused while writes are in flight.
    pub fn close_window(&mut self, window: &Window) -> Result<(), PoolError> {
        self.only_mut().close_window(window)
    }

    /// Writes every layer's K and V for `slots` of one page from the raw
    /// bytes of a hand-off chunk, laid out as [`ReadView::export_slots`]
    /// produces them. Fenced exactly like [`Lease::write`] (I3); on success
    /// the slots are covered in every layer. One group only.
    pub fn write_slots_raw(
        &mut self,
        page: PageRef,
        slots: Range<usize>,
        bytes: &[u8],
    ) -> Result<(), PoolError> {
        self.only_mut().write_slots_raw(page, slots, bytes)
    }

    /// Checks, without reading, that positions `0..len` of every layer were
    /// written in the current generation (I2): the hand-off's commit test.
    /// One group only.
    pub fn check_covered(&self, len: usize) -> Result<(), PoolError> {
        self.only().check_covered(len)
    }

    /// A view of positions `0..len` of every layer, refused unless every one
    /// of them was written in the current generation (I2). One group only.
    pub fn read_view<E: KvElement>(&self, len: usize) -> Result<ReadView<'_, E>, PoolError> {
        self.only().read_view(len)
    }

    /// A view of positions `0..len` of every layer for raw byte export,
    /// whatever the element type; refused unless covered (I2). One group
    /// only.
    pub fn read_view_raw(&self, len: usize) -> Result<ReadView<'_, u8>, PoolError> {
        self.only().read_view_raw(len)
    }

    /// `layer`'s group and its index there.
    fn place(&self, layer: usize) -> Result<(usize, usize), PoolError> {
        self.shared
            .groups
            .place(layer)
            .ok_or(PoolError::LayerOutOfRange {
                layer,
                layers: self.shared.groups.layers(),
            })
    }

    /// Groups that keep every position.
    fn kept_groups(&self) -> impl Iterator<Item = usize> + '_ {
        (0..self.groups.len()).filter(|&g| self.shared.groups.keep(g) == Keep::All)
    }

    fn only(&self) -> &GroupLease {
        assert_eq!(
            self.groups.len(),
            1,
            "page-level access (hand-off, one-sided windows, views of every layer) is for pools of one layer group"
        );
        &self.groups[0]
    }

    fn only_mut(&mut self) -> &mut GroupLease {
        assert_eq!(
            self.groups.len(),
            1,
            "page-level access (hand-off, one-sided windows, views of every layer) is for pools of one layer group"
        );
        &mut self.groups[0]
    }

    /// Every group that keeps everything holds as many pages; a windowed
    /// one as many, or its window if fewer (so its next write fits).
    fn assert_windows_sized(&self) {
        let page_size = self.page_size();
        let kept = self.groups[self.kept_groups().next().expect("a kept group")]
            .pages()
            .len();
        for (g, group) in self.groups.iter().enumerate() {
            let most = LayerGroups::window_pages(self.shared.groups.keep(g), page_size);
            assert_eq!(
                group.pages().len(),
                most.map_or(kept, |most| most.min(kept)),
                "a lease's group {g} holds the pages its positions need"
            );
        }
    }
}

impl std::fmt::Debug for Lease {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Lease")
            .field("tokens", &self.tokens)
            .field("cached", &self.cached)
            .field("groups", &self.groups)
            .finish()
    }
}

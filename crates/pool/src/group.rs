//! [`GroupLease`]: one layer group's pages of a request ([`crate::Lease`]
//! holds one per group), the single owner of them and the only way to
//! write into them.
//!
//! A lease is not `Clone`; dropping it is what gives its pages back (I8).
//! Every write is fenced by a [`PageRef`]: the page must be held by *this*
//! lease and carry the generation it was leased in (I3). Writes need
//! `&mut GroupLease`, reads `&GroupLease`, so the borrow checker keeps a caller from
//! writing into pages it is still reading through a [`ReadView`].
//!
//! A lease made with [`crate::Pool::lease_with_prefix`] starts with pages
//! of the prefix cache: shared, read through the same coverage-checked
//! views, never written (a write to one is refused like a foreign page's).
//! [`GroupLease::seal`] turns the lease's own full pages into shared ones.
//!
//! A lease of a sliding-window layer group needs only the last `window`
//! positions: [`GroupLease::slide`] gives the pages wholly behind a position back
//! to the pool and takes as many fresh ones for its end, so the lease holds
//! a constant number of pages however long the request runs. Positions it
//! slid past are released: a read or write of one is refused (I2, I7),
//! never served from a page that now belongs to another generation.

use std::ops::Range;
use std::sync::Arc;

use crate::element::KvElement;
use crate::error::PoolError;
use crate::ledger::{Counters, Holder, Shared};
use crate::mutation::Mutation;
use crate::page::{LeaseId, PageRef, RequestId};
use crate::prefix::{BlockHash, Namespace, block_hash};
use crate::view::ReadView;
use crate::window::Window;

/// Pages leased to one request.
pub(crate) struct GroupLease {
    shared: Arc<Shared>,
    id: LeaseId,
    owner: RequestId,
    pages: Vec<PageRef>,
    /// Whether each page is a shared (prefix-cache) page this lease reads
    /// rather than one of its own.
    is_shared: Vec<bool>,
    /// The namespace its prompt was looked up in; only such a lease seals.
    namespace: Option<Namespace>,
    /// Pages given back from the front by [`GroupLease::slide`]: `pages[0]`
    /// holds positions from `released * page_size`.
    released: usize,
    /// The prompt the lease was granted for, when it has a namespace: a
    /// slide seals the prompt's full pages it gives back before they go,
    /// so a window's pages stay in the cache behind it.
    prompt: Option<Arc<[u32]>>,
    /// The block hashes of the namespace's chain computed so far, with
    /// the tokens each was computed from: `(hash of block k, block k)`.
    chain: Vec<(BlockHash, Box<[u32]>)>,
    one_sided: bool,
}

impl GroupLease {
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn new(
        shared: Arc<Shared>,
        id: LeaseId,
        owner: RequestId,
        pages: Vec<PageRef>,
        is_shared: Vec<bool>,
        namespace: Option<Namespace>,
        released: usize,
        prompt: Option<Arc<[u32]>>,
    ) -> Self {
        assert_eq!(pages.len(), is_shared.len(), "one flag per page");
        GroupLease {
            shared,
            id,
            owner,
            pages,
            is_shared,
            namespace,
            released,
            prompt,
            chain: Vec::new(),
            one_sided: false,
        }
    }

    /// Pages of this lease that are shared (read, never written by it).
    pub fn shared_pages(&self) -> usize {
        self.is_shared.iter().filter(|s| **s).count()
    }

    /// [`crate::Lease::leading_shared_pages`] of this group.
    pub fn leading_shared_pages(&self) -> usize {
        self.is_shared.iter().take_while(|s| **s).count()
    }

    /// Adds `pages` — fresh pages stamped for this lease — at its end:
    /// a request grows as it decodes instead of holding its whole
    /// completion's room from the start. Never for a lease a one-sided
    /// writer may reach.
    pub(crate) fn extend(&mut self, pages: Vec<PageRef>) {
        assert!(
            !self.one_sided,
            "a lease exposed to a one-sided writer keeps its pages"
        );
        self.is_shared
            .extend(std::iter::repeat_n(false, pages.len()));
        self.pages.extend(pages);
    }

    /// This lease's id in the pool's ledger.
    pub(crate) fn id(&self) -> LeaseId {
        self.id
    }

    /// Gives back every page wholly before position `keep_from` — what a
    /// sliding-window layer no longer reads — and takes as many fresh pages
    /// at the end, all or nothing: the lease's page count never changes,
    /// its positions move forward. Own pages go back to the pool scrubbed
    /// (their next lease stamps a new generation, so this lease's old
    /// references fence nothing, I3); shared prefix pages lose a reader and
    /// only their replacements can run short (`Exhausted`, nothing changed).
    /// Returns how many pages slid. Never for a lease a one-sided writer
    /// may reach: its pages are released only by draining (I4).
    pub fn slide(&mut self, keep_from: usize) -> Result<usize, PoolError> {
        assert!(
            !self.one_sided,
            "a lease exposed to a one-sided writer keeps its pages until drained"
        );
        let page_size = self.shared.geometry.page_size;
        // Pages of positions to move past; a window asked to keep from
        // farther than the lease reaches (a receiver's, jumping to a long
        // prompt's end) gives back every page and starts at `keep_from`.
        let skip = (keep_from / page_size).saturating_sub(self.released);
        let count = skip.min(self.pages.len());
        if count == 0 {
            return Ok(0);
        }
        // The prompt's full pages behind the window are cached before they
        // go: a later prompt that begins with this one reads its window
        // from them.
        if let Some(prompt) = self.prompt.clone() {
            let end = prompt.len().min((self.released + count) * page_size);
            self.seal(&prompt[..end]);
        }
        let (own, shared): (Vec<_>, Vec<_>) = self.pages[..count]
            .iter()
            .zip(&self.is_shared[..count])
            .partition(|(_, shared)| !**shared);
        let own: Vec<PageRef> = own.into_iter().map(|(p, _)| *p).collect();
        let shared: Vec<PageRef> = shared.into_iter().map(|(p, _)| *p).collect();
        let fresh = self.shared.slide(self.id, self.owner, &own, &shared)?;
        assert_eq!(
            fresh.len(),
            count,
            "a slide replaces every page it gives back"
        );
        // Incident replay (p): the page table keeps the references it gave
        // back, as if the window never moved.
        if Mutation::KeepReleasedPages.active() {
            return Ok(count);
        }
        let before = self.capacity_tokens();
        self.pages.drain(..count);
        self.is_shared.drain(..count);
        self.pages.extend(fresh);
        self.is_shared.extend(std::iter::repeat_n(false, count));
        self.released += skip;
        assert_eq!(
            self.capacity_tokens(),
            before + skip * page_size,
            "a slide moves the lease's end by the pages it moved past"
        );
        assert!(
            self.first_position() <= keep_from,
            "a slide keeps the page holding keep_from"
        );
        Ok(count)
    }

    /// The first position the lease still holds: 0 until it slides.
    pub fn first_position(&self) -> usize {
        self.released * self.shared.geometry.page_size
    }

    /// Seals every full page of `tokens` — the tokens whose KV this lease
    /// holds at positions `0..tokens.len()` — into the prefix cache of the
    /// lease's namespace, so later leases of that namespace read them
    /// instead of computing them. A sealed page is never written again,
    /// this lease included (I1). Pages already cached elsewhere, not fully
    /// written, or over the tenant's quota stay the lease's own. Returns how
    /// many pages were sealed; a lease without a namespace or one a
    /// one-sided writer may reach seals none. Positions a slide gave back
    /// are not sealed here (the slide sealed what it could).
    pub fn seal(&mut self, tokens: &[u32]) -> usize {
        let Some(mut namespace) = self.namespace.clone() else {
            return 0;
        };
        // Incident replay (m): a lease that began with public pages seals
        // the rest into the public namespace as well.
        if Mutation::SealIntoPublic.active()
            && let Some(public) = namespace.public_namespace()
            && self
                .pages
                .first()
                .is_some_and(|page| self.shared.holds_shared(*page, public.id()))
        {
            namespace = public;
        }
        if self.one_sided {
            return 0;
        }
        let page_size = self.shared.geometry.page_size;
        let weak = match &self.shared.ledger.lock().cache {
            Some(cache) => cache.weak_hashes(),
            None => return 0,
        };
        // The chain is remembered for this lease's own namespace only.
        let remember = Some(&namespace) == self.namespace.as_ref();
        let mut parent = namespace.root();
        let mut sealed = 0;
        for (block_index, block) in tokens.chunks_exact(page_size).enumerate() {
            let hash = match self.chain.get(block_index) {
                Some((hash, seen)) if remember && **seen == *block => *hash,
                _ => {
                    let hash = block_hash(parent, block, weak);
                    if remember {
                        self.chain.truncate(block_index);
                        self.chain.push((hash, block.into()));
                    }
                    hash
                }
            };
            // Blocks behind a window are hashed for the chain, not sealed.
            if let Some(index) = block_index.checked_sub(self.released) {
                if index >= self.pages.len() {
                    break;
                }
                if !self.is_shared[index]
                    && self
                        .shared
                        .seal(self.id, self.pages[index], &namespace, hash, parent, block)
                {
                    self.is_shared[index] = true;
                    sealed += 1;
                }
            }
            parent = hash;
        }
        sealed
    }

    /// The request that holds this lease.
    pub fn owner(&self) -> RequestId {
        self.owner
    }

    /// The pages held, in token order: page `i` holds positions from
    /// `first_position() + i * page_size`.
    pub fn pages(&self) -> &[PageRef] {
        &self.pages
    }

    /// One past the last position the held pages can store (whole pages;
    /// a lease that slid holds only the positions from `first_position()`).
    pub fn capacity_tokens(&self) -> usize {
        (self.released + self.pages.len()) * self.shared.geometry.page_size
    }

    /// [`crate::Lease::expose_to_one_sided_writer`] for this group.
    pub fn expose_to_one_sided_writer(&mut self) {
        assert_eq!(
            self.shared_pages(),
            0,
            "a one-sided writer is never given shared pages"
        );
        self.one_sided = true;
    }

    /// [`crate::Lease::write`] into this group's pages (`layer` indexes the group).
    pub fn write<E: KvElement>(
        &mut self,
        page: PageRef,
        layer: usize,
        slots: Range<usize>,
        k: &[E],
        v: &[E],
    ) -> Result<(), PoolError> {
        let geometry = &self.shared.geometry;
        self.check_elem::<E>()?;
        self.check_layer(layer)?;
        if slots.start >= slots.end || slots.end > geometry.page_size {
            return Err(PoolError::SlotsOutOfRange {
                start: slots.start,
                end: slots.end,
                page_size: geometry.page_size,
            });
        }
        let expected = slots.len() * geometry.token_elements();
        if let Some(got) = [k.len(), v.len()].into_iter().find(|&n| n != expected) {
            return Err(PoolError::ShapeMismatch { expected, got });
        }
        let mut guard = self.fenced_page(page)?;
        let head_dim = geometry.shape.head_dim;
        let data: &mut [E] = bytemuck::cast_slice_mut(&mut guard.data);
        let kv_heads = geometry.shape.kv_heads;
        for head in 0..kv_heads {
            // Keys go in as columns, one dimension of the slots at a time.
            for dim in 0..head_dim {
                let column = geometry.key_offset(layer, head, slots.start, dim);
                for (t, key) in data[column..column + slots.len()].iter_mut().enumerate() {
                    *key = k[(t * kv_heads + head) * head_dim + dim];
                }
            }
            for (t, slot) in slots.clone().enumerate() {
                let src = (t * kv_heads + head) * head_dim;
                let dst = geometry.block_offset(layer, 1, head) + slot * head_dim;
                data[dst..dst + head_dim].copy_from_slice(&v[src..src + head_dim]);
            }
        }
        if self.shared.checks {
            guard.coverage.mark(layer, slots);
        }
        Ok(())
    }

    /// [`crate::Lease::write_slots_raw`] into this group's pages.
    pub fn write_slots_raw(
        &mut self,
        page: PageRef,
        slots: Range<usize>,
        bytes: &[u8],
    ) -> Result<(), PoolError> {
        let mut guard = self.fenced_page(page)?;
        self.shared
            .copy_slots_in(&mut guard, slots, std::iter::once(bytes))
    }

    /// [`crate::Lease::open_window`] over this group's pages.
    pub fn open_window(&mut self) -> Window {
        assert_eq!(
            self.shared_pages(),
            0,
            "a one-sided writer is never given shared pages"
        );
        self.one_sided = true;
        Window::open(
            Arc::clone(&self.shared),
            self.owner,
            self.pages.iter().map(|p| p.id).collect(),
        )
    }

    /// [`crate::Lease::is_exposed`] for this group.
    pub fn is_exposed(&self) -> bool {
        self.one_sided
    }

    /// [`crate::Lease::close_window`] for this group.
    pub fn close_window(&mut self, window: &Window) -> Result<(), PoolError> {
        assert_eq!(
            window.owner(),
            self.owner,
            "a window closes only on its own lease"
        );
        window.revoke();
        match window.in_flight() {
            0 => {
                self.one_sided = false;
                Ok(())
            }
            in_flight => Err(PoolError::StillWriting {
                owner: self.owner,
                in_flight,
            }),
        }
    }

    /// Locks `page` for writing if this lease holds it in the generation
    /// the token names; refusals are counted (I1, I3).
    fn fenced_page(
        &self,
        page: PageRef,
    ) -> Result<parking_lot::RwLockWriteGuard<'_, crate::ledger::Page>, PoolError> {
        let foreign = || {
            Counters::bump(&self.shared.counters.foreign_writes_rejected);
            PoolError::PageNotInLease {
                page: page.id,
                owner: self.owner,
            }
        };
        let cell = self.shared.pages.get(page.id.index()).ok_or_else(foreign)?;
        let guard = cell.write();
        if !self.shared.checks {
            return Ok(guard);
        }
        match guard.holder {
            Holder::Leased { lease, .. } if lease == self.id => {}
            // Incident replay (k): a shared page this lease reads is
            // written like its own.
            Holder::Shared { .. }
                if Mutation::WriteShared.active()
                    && self
                        .pages
                        .iter()
                        .zip(&self.is_shared)
                        .any(|(p, s)| *s && p.id == page.id) => {}
            _ => return Err(foreign()),
        }
        if guard.generation != page.generation && !Mutation::IgnoreGenerations.active() {
            Counters::bump(&self.shared.counters.stale_writes_rejected);
            return Err(PoolError::StaleGeneration {
                page: page.id,
                got: page.generation,
                current: guard.generation,
            });
        }
        Ok(guard)
    }

    /// Writes K and V of `layer` for consecutive token positions starting at
    /// `start`, across page boundaries. `k` and `v` are token-major as in
    /// [`GroupLease::write`]; the fencing tokens are this lease's own.
    pub fn write_positions<E: KvElement>(
        &mut self,
        layer: usize,
        start: usize,
        k: &[E],
        v: &[E],
    ) -> Result<(), PoolError> {
        let geometry = self.shared.geometry;
        let per_token = geometry.token_elements();
        if k.len() != v.len() || !k.len().is_multiple_of(per_token) {
            return Err(PoolError::ShapeMismatch {
                expected: k.len().div_ceil(per_token) * per_token,
                got: if !k.len().is_multiple_of(per_token) {
                    k.len()
                } else {
                    v.len()
                },
            });
        }
        let end = start + k.len() / per_token;
        if start < self.first_position() {
            return Err(PoolError::Released {
                owner: self.owner,
                position: start,
                first_held: self.first_position(),
            });
        }
        if end > self.capacity_tokens() {
            return Err(PoolError::BeyondLease {
                owner: self.owner,
                end,
                capacity: self.capacity_tokens(),
            });
        }
        let mut pos = start;
        while pos < end {
            let (index, slot) = (
                pos / geometry.page_size - self.released,
                pos % geometry.page_size,
            );
            let run = (geometry.page_size - slot).min(end - pos);
            let from = (pos - start) * per_token;
            let to = from + run * per_token;
            let page = self.pages[index];
            self.write(page, layer, slot..slot + run, &k[from..to], &v[from..to])?;
            pos += run;
        }
        Ok(())
    }

    /// [`crate::Lease::check_covered`] over this group's layers.
    pub fn check_covered(&self, len: usize) -> Result<(), PoolError> {
        self.check_covered_from(0, len)
    }

    /// Checks, without reading, that every position of the pages from the
    /// one holding `start` to position `len` is written in every layer of
    /// this group in the current generation and still held (I2).
    pub fn check_covered_from(&self, start: usize, len: usize) -> Result<(), PoolError> {
        let page_size = self.shared.geometry.page_size;
        self.check_held(start, len)?;
        if len > self.capacity_tokens() {
            Counters::bump(&self.shared.counters.reads_refused);
            return Err(PoolError::BeyondLease {
                owner: self.owner,
                end: len,
                capacity: self.capacity_tokens(),
            });
        }
        let spanned = self.pages_spanned(start, len);
        if spanned.is_empty() {
            return Ok(());
        }
        // check_held: no spanned page lies before the held ones.
        let held = spanned.start - self.released..spanned.end - self.released;
        for (index, page_ref) in spanned.zip(&self.pages[held]) {
            let guard = self.shared.pages[page_ref.id.index()].read();
            let slots = page_size.min(len - index * page_size);
            for layer in 0..self.shared.geometry.shape.layers {
                if let Some(gap) = guard.coverage.first_gap(layer, slots) {
                    Counters::bump(&self.shared.counters.reads_refused);
                    return Err(PoolError::NotCovered {
                        len,
                        layer,
                        position: index * page_size + gap,
                    });
                }
            }
        }
        Ok(())
    }

    /// [`crate::Lease::read_view`] of this group's layers.
    pub fn read_view<E: KvElement>(&self, len: usize) -> Result<ReadView<'_, E>, PoolError> {
        self.read(0..self.shared.geometry.shape.layers, 0, len)
    }

    /// A view of one layer from the page holding position `start` to
    /// position `len`: what a sliding-window layer reads, its window
    /// beginning at `start`. The view starts at that page's first position
    /// ([`ReadView::first_page`]); refused if a position it spans was given
    /// back by [`GroupLease::slide`] or not written in the current generation
    /// (I2).
    pub fn read_layer_from<E: KvElement>(
        &self,
        layer: usize,
        start: usize,
        len: usize,
    ) -> Result<ReadView<'_, E>, PoolError> {
        self.check_layer(layer)?;
        self.read(layer..layer + 1, start, len)
    }

    /// [`crate::Lease::read_view_raw`] of this group's layers.
    pub fn read_view_raw(&self, len: usize) -> Result<ReadView<'_, u8>, PoolError> {
        self.read_view_raw_from(0, len)
    }

    /// A raw view of every layer of this group from the page holding
    /// `start` to position `len`, refused unless covered and held (I2).
    pub fn read_view_raw_from(
        &self,
        start: usize,
        len: usize,
    ) -> Result<ReadView<'_, u8>, PoolError> {
        self.read_unchecked_elem(0..self.shared.geometry.shape.layers, start, len)
    }

    fn read<E: KvElement>(
        &self,
        layers: Range<usize>,
        start: usize,
        len: usize,
    ) -> Result<ReadView<'_, E>, PoolError> {
        self.check_elem::<E>()?;
        self.read_unchecked_elem(layers, start, len)
    }

    /// The pages a view of `start..len` spans: whole pages from the one
    /// holding `start` (none when the range is empty).
    fn pages_spanned(&self, start: usize, len: usize) -> Range<usize> {
        let page_size = self.shared.geometry.page_size;
        let end = len.div_ceil(page_size);
        (start / page_size).min(end)..end
    }

    /// Refuses (and counts) an access to `start..len` that spans a page the
    /// lease slid past.
    fn check_held(&self, start: usize, len: usize) -> Result<(), PoolError> {
        let spanned = self.pages_spanned(start, len);
        if !spanned.is_empty() && spanned.start < self.released {
            Counters::bump(&self.shared.counters.reads_refused);
            return Err(PoolError::Released {
                owner: self.owner,
                position: start,
                first_held: self.first_position(),
            });
        }
        Ok(())
    }

    fn read_unchecked_elem<E>(
        &self,
        layers: Range<usize>,
        start: usize,
        len: usize,
    ) -> Result<ReadView<'_, E>, PoolError> {
        let refuse = |error: PoolError| {
            Counters::bump(&self.shared.counters.reads_refused);
            Err(error)
        };
        self.check_held(start, len)?;
        if len > self.capacity_tokens() {
            return refuse(PoolError::BeyondLease {
                owner: self.owner,
                end: len,
                capacity: self.capacity_tokens(),
            });
        }
        let page_size = self.shared.geometry.page_size;
        let spanned = self.pages_spanned(start, len);
        let first_page = spanned.start;
        let held = if spanned.is_empty() {
            0..0
        } else {
            // check_held: no spanned page lies before the held ones.
            spanned.start - self.released..spanned.end - self.released
        };
        let mut guards = Vec::with_capacity(held.len());
        for (index, page_ref) in (first_page..).zip(&self.pages[held]) {
            let guard = self.shared.pages[page_ref.id.index()].read();
            if !self.shared.checks {
                guards.push(guard);
                continue;
            }
            let held = if self.is_shared[index - self.released] {
                matches!(guard.holder, Holder::Shared { .. })
            } else {
                matches!(guard.holder, Holder::Leased { lease, .. } if lease == self.id)
            };
            assert!(
                held && (guard.generation == page_ref.generation || Mutation::StaleIndex.active()),
                "I1: page {page_ref} changed hands while leased to {}",
                self.owner
            );
            let slots = page_size.min(len - index * page_size);
            for layer in layers.clone() {
                if Mutation::SkipCoverage.active() {
                    break;
                }
                if let Some(gap) = guard.coverage.first_gap(layer, slots) {
                    return refuse(PoolError::NotCovered {
                        len,
                        layer,
                        position: index * page_size + gap,
                    });
                }
            }
            guards.push(guard);
        }
        Ok(ReadView::new(
            &self.shared.geometry,
            layers,
            first_page,
            len,
            guards,
        ))
    }

    fn check_elem<E: KvElement>(&self) -> Result<(), PoolError> {
        let pool = self.shared.geometry.elem;
        if E::ELEM == pool {
            Ok(())
        } else {
            Err(PoolError::ElemMismatch {
                pool,
                asked: E::ELEM,
            })
        }
    }

    fn check_layer(&self, layer: usize) -> Result<(), PoolError> {
        let layers = self.shared.geometry.shape.layers;
        if layer < layers {
            Ok(())
        } else {
            Err(PoolError::LayerOutOfRange { layer, layers })
        }
    }
}

impl Drop for GroupLease {
    fn drop(&mut self) {
        let (shared, own): (Vec<_>, Vec<_>) = std::mem::take(&mut self.pages)
            .into_iter()
            .zip(std::mem::take(&mut self.is_shared))
            .partition(|(_, shared)| *shared);
        let quarantine = self.one_sided && !Mutation::FreeBeforeDrain.active();
        self.shared.give_back(
            self.id,
            self.owner,
            own.into_iter().map(|(p, _)| p).collect(),
            quarantine,
        );
        let shared: Vec<PageRef> = shared.into_iter().map(|(p, _)| p).collect();
        self.shared.stop_reading(&shared);
    }
}

impl std::fmt::Debug for GroupLease {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GroupLease")
            .field("owner", &self.owner)
            .field("pages", &self.pages.len())
            .field("shared_pages", &self.shared_pages())
            .field("released", &self.released)
            .field("one_sided", &self.one_sided)
            .finish()
    }
}

#[cfg(all(test, feature = "unchecked-for-measurement"))]
mod measurement_tests {
    use crate::{Checks, ElemType, KvShape, Pool, PoolError, PoolSize, PoolSpec, RequestId};

    #[test]
    fn the_measurement_switch_really_removes_the_checks() {
        let shape = KvShape {
            layers: 2,
            kv_heads: 1,
            head_dim: 4,
        };
        let spec = PoolSpec::new(shape, 4, ElemType::F32, PoolSize::Tokens(16));
        let checked = Pool::new(&spec).expect("pool");
        let lease = checked.lease(RequestId(1), 4).expect("room");
        assert!(matches!(
            lease.read_view::<f32>(4),
            Err(PoolError::NotCovered { .. })
        ));
        let unchecked = Pool::new(&spec.with_checks(Checks::Off)).expect("pool");
        let lease = unchecked.lease(RequestId(1), 4).expect("room");
        assert!(
            lease.read_view::<f32>(4).is_ok(),
            "Checks::Off must skip the coverage proof, or measuring it means nothing"
        );
    }
}

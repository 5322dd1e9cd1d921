//! The arena of pages and the ledger of who holds them: what a [`crate::Pool`],
//! its leases, read views and windows share.
//!
//!
//! # Locking
//!
//! Two kinds of lock, never held one inside the other on the lease and
//! release paths:
//!
//! - one `Mutex<Ledger>` for the free list, the page counts by state and the
//!   quarantine groups. It is held only for list pushes and pops, never while
//!   page memory is touched, so leasing stays cheap under contention;
//! - one `RwLock<Page>` per page for its holder, generation, coverage and
//!   data. A lease locks only its own pages, so requests on different pages
//!   never contend, and readers of one lease share the read lock.
//!
//! `drain` (rare) holds the ledger while it locks quarantined pages; nothing
//! else locks the ledger while holding a page lock, so the order
//! ledger → page is the only nested order and cannot deadlock.
//!
//! A page id sits in the free list only when its holder is `Free`; a page
//! popped from the list is invisible to everyone else until the new lease has
//! stamped it. That is what makes I1 hold without one global lock.
//!
//! The prefix cache's ledger ([`crate::prefix`]) lives under the same
//! ledger lock: sealing, attaching, reader counts and eviction are list
//! operations too. A shared page's holder changes only with both the ledger
//! and the page's write lock held (sealing, eviction), so either one is
//! enough to read it.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};

use parking_lot::{Mutex, RwLock};

use crate::coverage::Coverage;
use crate::element::poison_word;
use crate::error::PoolError;
use crate::layers::LayerGroups;
use crate::mutation::Mutation;
use crate::page::{Generation, LeaseId, NamespaceId, PageId, PageRef, RequestId};
use crate::prefix::{CacheLedger, Namespace};
use crate::spec::{Geometry, PoolSpec, ReusePolicy, Scrub};

/// Who holds a page, as the page itself records it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Holder {
    Free,
    Leased { lease: LeaseId, owner: RequestId },
    Shared { namespace: NamespaceId },
    Quarantined { owner: RequestId },
}

/// One page: its bookkeeping and its memory, under one lock.
pub(crate) struct Page {
    pub(crate) holder: Holder,
    pub(crate) generation: Generation,
    pub(crate) coverage: Coverage,
    /// Backing words; typed views are cast from these (8-byte alignment
    /// suits every [`crate::KvElement`]).
    pub(crate) data: Box<[u64]>,
}

pub(crate) struct Ledger {
    free: VecDeque<PageId>,
    pub(crate) leased: usize,
    quarantined: HashMap<RequestId, Vec<PageRef>>,
    quarantined_pages: usize,
    /// The prefix cache, when the pool has one.
    pub(crate) cache: Option<CacheLedger>,
}

impl Ledger {
    /// Pages on the free list.
    pub(crate) fn free_pages(&self) -> usize {
        self.free.len()
    }

    /// Pages in quarantine, all owners together.
    pub(crate) fn quarantined_pages(&self) -> usize {
        self.quarantined_pages
    }

    /// Requests that have pages in quarantine.
    pub(crate) fn quarantined_owners(&self) -> Vec<RequestId> {
        self.quarantined.keys().copied().collect()
    }
}

#[derive(Default)]
pub(crate) struct Counters {
    pub(crate) leases_granted: AtomicU64,
    pub(crate) leases_refused: AtomicU64,
    pub(crate) stale_writes_rejected: AtomicU64,
    pub(crate) foreign_writes_rejected: AtomicU64,
    pub(crate) reads_refused: AtomicU64,
    pub(crate) pages_quarantined: AtomicU64,
    pub(crate) cache_lookups: AtomicU64,
    pub(crate) cache_hits: AtomicU64,
    pub(crate) cache_hit_tokens: AtomicU64,
    pub(crate) cache_evictions: AtomicU64,
}

impl Counters {
    pub(crate) fn bump(counter: &AtomicU64) {
        counter.fetch_add(1, Ordering::Relaxed);
    }
}

pub(crate) struct Shared {
    pub(crate) geometry: Geometry,
    /// How the model's layers share pages.
    pub(crate) groups: LayerGroups,
    scrub: Scrub,
    reuse: ReusePolicy,
    /// False only in measurement builds asked to skip the checks.
    pub(crate) checks: bool,
    pub(crate) pages: Box<[RwLock<Page>]>,
    pub(crate) ledger: Mutex<Ledger>,
    pub(crate) counters: Counters,
    next_lease: AtomicU64,
}

impl Shared {
    /// Builds the arena and touches every page, so the memory the pool
    /// reports is memory the process really holds (I6), not a lazily
    /// mapped promise.
    /// A lease id never given before in this pool.
    pub(crate) fn next_lease_id(&self) -> LeaseId {
        LeaseId(self.next_lease.fetch_add(1, Ordering::Relaxed))
    }

    pub(crate) fn new(spec: &PoolSpec) -> Result<Shared, PoolError> {
        let geometry = spec.geometry()?;
        let words = geometry.page_bytes.div_ceil(8);
        let fill = match spec.scrub {
            Scrub::Poison => poison_word(geometry.elem),
            Scrub::Off | Scrub::Zero => 0,
        };
        let pages = (0..geometry.num_pages)
            .map(|_| {
                let mut data = vec![0u64; words].into_boxed_slice();
                // An explicit fill commits the pages even when the
                // allocator handed back untouched zeroed memory.
                data.fill(fill);
                RwLock::new(Page {
                    holder: Holder::Free,
                    generation: Generation(0),
                    coverage: Coverage::new(geometry.shape.layers, geometry.page_size),
                    data,
                })
            })
            .collect();
        let free = (0..geometry.num_pages)
            .map(|i| PageId(u32::try_from(i).expect("geometry caps page count at u32::MAX")))
            .collect();
        Ok(Shared {
            geometry,
            groups: spec.layer_groups(),
            scrub: spec.scrub,
            reuse: spec.reuse,
            checks: spec.checks == crate::spec::Checks::On,
            pages,
            ledger: Mutex::new(Ledger {
                free,
                leased: 0,
                quarantined: HashMap::new(),
                quarantined_pages: 0,
                cache: spec.cache.map(|c| {
                    CacheLedger::new(
                        c.tenant_quota_pages,
                        c.public_min_tokens,
                        c.colliding_hashes,
                    )
                }),
            }),
            counters: Counters::default(),
            next_lease: AtomicU64::new(1),
        })
    }

    /// Frees `owner`'s quarantined pages; see [`Pool::drain`].
    pub(crate) fn drain(&self, owner: RequestId) -> Result<usize, PoolError> {
        let shared = self;
        let mut ledger = shared.ledger.lock();
        let group = ledger
            .quarantined
            .remove(&owner)
            .ok_or(PoolError::NothingQuarantined { owner })?;
        for page_ref in &group {
            let mut page = shared.pages[page_ref.id.index()].write();
            assert!(
                page.holder == Holder::Quarantined { owner }
                    && page.generation == page_ref.generation,
                "I4: quarantined page {page_ref} of {owner} changed hands while quarantined"
            );
            shared.scrub_and_free(&mut page);
        }
        ledger.quarantined_pages -= group.len();
        ledger.free.extend(group.iter().map(|r| r.id));
        Ok(group.len())
    }

    /// Takes `needed` pages off the free list, evicting idle shared pages
    /// (the largest tenant's first) when it runs short; the caller has
    /// checked that free and idle pages together suffice. The pages stay
    /// invisible to everyone until [`Shared::stamp`] gives them an owner.
    pub(crate) fn take_free(&self, ledger: &mut Ledger, needed: usize) -> Vec<PageId> {
        while ledger.free.len() < needed {
            let victim = ledger
                .cache
                .as_ref()
                .and_then(|c| c.victim(None))
                .expect("the evictable pages were counted by the caller");
            self.evict(ledger, victim);
        }
        ledger.leased += needed;
        match self.reuse {
            ReusePolicy::OldestFreedFirst => ledger.free.drain(..needed).collect(),
            ReusePolicy::NewestFreedFirst => {
                let at = ledger.free.len() - needed;
                ledger.free.drain(at..).rev().collect()
            }
        }
    }

    /// Gives pages just taken off the free list to `lease`: a new
    /// generation each, coverage wiped (I2).
    pub(crate) fn stamp(&self, ids: Vec<PageId>, lease: LeaseId, owner: RequestId) -> Vec<PageRef> {
        ids.into_iter()
            .map(|id| {
                let mut page = self.pages[id.index()].write();
                assert_eq!(
                    page.holder,
                    Holder::Free,
                    "I1: page {id} came off the free list while held"
                );
                page.generation = Generation(page.generation.0 + 1);
                page.holder = Holder::Leased { lease, owner };
                page.coverage.clear();
                PageRef {
                    id,
                    generation: page.generation,
                }
            })
            .collect()
    }

    /// `pages` more pages for `owner`'s leases, all or nothing, from free
    /// and idle shared pages; `Exhausted` when there are not enough. They
    /// stay invisible until [`Shared::stamp`] gives them to a lease.
    pub(crate) fn take(&self, owner: RequestId, pages: usize) -> Result<Vec<PageId>, PoolError> {
        let mut ledger = self.ledger.lock();
        let available = ledger.free.len() + ledger.cache.as_ref().map_or(0, |c| c.idle_pages());
        if available < pages {
            drop(ledger);
            Counters::bump(&self.counters.leases_refused);
            return Err(PoolError::Exhausted {
                owner,
                needed_pages: pages,
                free_pages: available,
            });
        }
        Ok(self.take_free(&mut ledger, pages))
    }

    /// Gives `own` and `shared` — the front pages of a sliding-window lease,
    /// behind its window — back to the pool and takes as many fresh pages
    /// for the lease's end, all or nothing, under one ledger lock: the own
    /// pages are scrubbed and freed (their next lease stamps a new
    /// generation, so no write or read through an old reference reaches
    /// them, I3), the shared ones lose a reader. The lease never holds more
    /// pages than before, and only the shared pages' replacements can run
    /// short (`Exhausted`, nothing changed).
    pub(crate) fn slide(
        &self,
        lease: LeaseId,
        owner: RequestId,
        own: &[PageRef],
        shared: &[PageRef],
    ) -> Result<Vec<PageRef>, PoolError> {
        let wanted = own.len() + shared.len();
        let ids = {
            let mut ledger = self.ledger.lock();
            // The shared pages this lease lets go of can serve too once no
            // one else reads them (the eviction in `take_free` finds them).
            let available = ledger.free.len()
                + ledger
                    .cache
                    .as_ref()
                    .map_or(0, |c| c.idle_pages() + c.idle_once_unread(shared))
                + own.len();
            if available < wanted {
                drop(ledger);
                Counters::bump(&self.counters.leases_refused);
                return Err(PoolError::Exhausted {
                    owner,
                    needed_pages: wanted,
                    free_pages: available,
                });
            }
            // Ledger → page is the one nested lock order (see the module doc).
            for page_ref in own {
                let mut page = self.pages[page_ref.id.index()].write();
                assert!(
                    page.holder == Holder::Leased { lease, owner }
                        && page.generation == page_ref.generation,
                    "I1: page {page_ref} of {owner} was not held by its lease when it slid out"
                );
                self.scrub_and_free(&mut page);
            }
            ledger.leased -= own.len();
            ledger.free.extend(own.iter().map(|r| r.id));
            if !shared.is_empty() {
                let cache = ledger
                    .cache
                    .as_mut()
                    .expect("a lease reads shared pages only from a pool with a cache");
                for page in shared {
                    cache.remove_reader(page.id);
                }
            }
            self.take_free(&mut ledger, wanted)
        };
        Ok(self.stamp(ids, lease, owner))
    }

    /// Asserts that `page_ref` is a shared page `namespace` may read, in
    /// the generation the index named (I1): the ledger said so, and the
    /// page itself must agree.
    pub(crate) fn check_shared(&self, page_ref: PageRef, namespace: Option<&Namespace>) {
        let page = self.pages[page_ref.id.index()].read();
        let stale_ok = Mutation::StaleIndex.active();
        assert!(
            matches!(page.holder, Holder::Shared { namespace: ns } if namespace.is_some_and(|n| n.reads(ns)))
                && (page.generation == page_ref.generation || stale_ok),
            "I1: the index resolved {page_ref} to a page that is not that namespace's shared page"
        );
    }

    /// Whether `page_ref` is a shared page of namespace `ns`.
    pub(crate) fn holds_shared(&self, page_ref: PageRef, ns: NamespaceId) -> bool {
        let page = self.pages[page_ref.id.index()].read();
        matches!(page.holder, Holder::Shared { namespace } if namespace == ns)
    }

    /// Copies every layer's K and V of the first `slots` slots of shared
    /// page `source` into the fresh page `target` of a new lease and marks
    /// them covered: the copy in copy on write.
    pub(crate) fn copy_page_prefix(&self, source: PageRef, target: PageRef, slots: usize) {
        assert_ne!(source.id, target.id, "a page is never copied onto itself");
        let from = self.pages[source.id.index()].read();
        let mut to = self.pages[target.id.index()].write();
        let g = self.geometry;
        let data: &[u8] = bytemuck::cast_slice(&from.data);
        for layer in 0..g.shape.layers {
            assert_eq!(
                from.coverage.first_gap(layer, slots),
                None,
                "I2: a sealed page is written in full"
            );
        }
        self.copy_slots_in(&mut to, 0..slots, g.chunk_runs(0..slots).map(|r| &data[r]))
            .expect("a page's own slot runs have a chunk's length");
    }

    /// Evicts idle shared page `id`: out of the index, its generation moved
    /// on (so no entry that outlived it can resolve to its next contents),
    /// scrubbed and free.
    pub(crate) fn evict(&self, ledger: &mut Ledger, id: PageId) {
        ledger
            .cache
            .as_mut()
            .expect("only a pool with a cache evicts")
            .evict(id);
        let mut page = self.pages[id.index()].write();
        assert!(
            matches!(page.holder, Holder::Shared { .. }),
            "I1: evicted page {id} was not shared"
        );
        page.generation = Generation(page.generation.0 + 1);
        self.scrub_and_free(&mut page);
        drop(page);
        ledger.free.push_back(id);
        Counters::bump(&self.counters.cache_evictions);
    }

    /// Turns leased page `page_ref` of `lease` into a shared page of
    /// `namespace` holding the block `hash`: never written again, read by
    /// this lease. Refused (false) when the tenant is at its quota and none
    /// of its own idle pages can make room, or the page is not fully
    /// written.
    pub(crate) fn seal(
        &self,
        lease: LeaseId,
        page_ref: PageRef,
        namespace: &Namespace,
        hash: crate::prefix::BlockHash,
        parent: crate::prefix::BlockHash,
        tokens: &[u32],
    ) -> bool {
        let mut ledger = self.ledger.lock();
        let Some(cache) = ledger.cache.as_ref() else {
            return false;
        };
        if cache.holds(&hash) {
            return false;
        }
        if !cache.under_quota(namespace.tenant()) {
            match cache.victim(Some(namespace.tenant())) {
                Some(victim) => self.evict(&mut ledger, victim),
                None => return false,
            }
        }
        let mut page = self.pages[page_ref.id.index()].write();
        assert!(
            matches!(page.holder, Holder::Leased { lease: l, .. } if l == lease)
                && page.generation == page_ref.generation,
            "I1: page {page_ref} is sealed only by the lease that wrote it"
        );
        let layers = self.geometry.shape.layers;
        if (0..layers).any(|layer| {
            page.coverage
                .first_gap(layer, self.geometry.page_size)
                .is_some()
        }) {
            return false;
        }
        page.holder = Holder::Shared {
            namespace: namespace.id(),
        };
        drop(page);
        ledger.leased -= 1;
        ledger
            .cache
            .as_mut()
            .expect("checked above")
            .insert(namespace, page_ref, hash, parent, tokens);
        true
    }

    /// Takes back the shared pages of a dropped lease: one reader fewer
    /// each; at none they wait, evictable, in least-recently-used order.
    pub(crate) fn stop_reading(&self, pages: &[PageRef]) {
        if pages.is_empty() {
            return;
        }
        let mut ledger = self.ledger.lock();
        let cache = ledger
            .cache
            .as_mut()
            .expect("a lease reads shared pages only from a pool with a cache");
        for page in pages {
            cache.remove_reader(page.id);
        }
    }

    /// Takes back the pages of a dropped lease: to `Free`, or to
    /// `Quarantined` when a one-sided writer may still store into them (I4).
    pub(crate) fn give_back(
        &self,
        lease: LeaseId,
        owner: RequestId,
        pages: Vec<PageRef>,
        one_sided: bool,
    ) {
        for page_ref in &pages {
            let mut page = self.pages[page_ref.id.index()].write();
            assert!(
                page.holder == Holder::Leased { lease, owner }
                    && page.generation == page_ref.generation,
                "I1: page {page_ref} of {owner} was not held by its lease at release"
            );
            if one_sided {
                page.holder = Holder::Quarantined { owner };
            } else {
                self.scrub_and_free(&mut page);
            }
        }
        let mut ledger = self.ledger.lock();
        ledger.leased -= pages.len();
        if one_sided {
            ledger.quarantined_pages += pages.len();
            self.counters
                .pages_quarantined
                .fetch_add(pages.len() as u64, Ordering::Relaxed);
            ledger.quarantined.entry(owner).or_default().extend(pages);
        } else {
            ledger.free.extend(pages.iter().map(|r| r.id));
        }
    }

    /// Copies every layer's K and V for `slots` from hand-off bytes (the
    /// page's layout over those slots, [`crate::Geometry::chunk_runs`])
    /// into `page` and marks them covered. The chunk comes as `runs` whose concatenation is those
    /// bytes, cut anywhere (one slice, or [`ReadView::slot_runs`] of
    /// another page); nothing is written unless their total length is the
    /// chunk's. The caller has checked who may write.
    pub(crate) fn copy_slots_in<'b>(
        &self,
        page: &mut Page,
        slots: std::ops::Range<usize>,
        runs: impl Iterator<Item = &'b [u8]> + Clone,
    ) -> Result<(), PoolError> {
        let g = self.geometry;
        if slots.start >= slots.end || slots.end > g.page_size {
            return Err(PoolError::SlotsOutOfRange {
                start: slots.start,
                end: slots.end,
                page_size: g.page_size,
            });
        }
        let expected = g.chunk_bytes(slots.len());
        let got = runs.clone().map(<[u8]>::len).sum();
        if got != expected {
            return Err(PoolError::ShapeMismatch { expected, got });
        }
        let data: &mut [u8] = bytemuck::cast_slice_mut(&mut page.data);
        // Source runs and page runs need not line up: each page run is
        // filled from as many source runs as it takes.
        let (mut runs, mut run): (_, &[u8]) = (runs, &[]);
        for bytes in g.chunk_runs(slots.clone()) {
            let mut target = &mut data[bytes];
            while !target.is_empty() {
                if run.is_empty() {
                    run = runs.next().expect("the lengths were checked above");
                }
                let n = run.len().min(target.len());
                let (filled, rest) = target.split_at_mut(n);
                filled.copy_from_slice(&run[..n]);
                (target, run) = (rest, &run[n..]);
            }
        }
        for layer in 0..g.shape.layers {
            page.coverage.mark(layer, slots.clone());
        }
        Ok(())
    }

    fn scrub_and_free(&self, page: &mut Page) {
        match self.scrub {
            Scrub::Off => {}
            Scrub::Zero => page.data.fill(0),
            Scrub::Poison => page.data.fill(poison_word(self.geometry.elem)),
        }
        page.coverage.clear();
        page.holder = Holder::Free;
    }
}

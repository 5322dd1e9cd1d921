//! The arena of pages and the ledger of who holds them.
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
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use parking_lot::{Mutex, RwLock};

use crate::coverage::Coverage;
use crate::element::poison_word;
use crate::error::PoolError;
use crate::lease::{Lease, LeaseId};
use crate::mutation::Mutation;
use crate::page::{Generation, PageId, PageRef, PageState, RequestId};
use crate::prefix::{CacheLedger, Found, Namespace, NamespaceId};
use crate::spec::{Geometry, PoolSpec, ReusePolicy, Scrub};

/// A fenced KV page pool. Cheap to clone: clones share one arena.
#[derive(Clone)]
pub struct Pool {
    shared: Arc<Shared>,
}

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
    scrub: Scrub,
    reuse: ReusePolicy,
    /// False only in measurement builds asked to skip the checks.
    pub(crate) checks: bool,
    pub(crate) pages: Box<[RwLock<Page>]>,
    pub(crate) ledger: Mutex<Ledger>,
    pub(crate) counters: Counters,
    next_lease: AtomicU64,
}

/// A consistent snapshot of the pool's counters.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PoolStats {
    /// Pages in the arena.
    pub num_pages: usize,
    /// Token slots per page.
    pub page_size: usize,
    /// Pages in `Free`.
    pub free_pages: usize,
    /// Pages in `Leased`.
    pub leased_pages: usize,
    /// Pages in `Quarantined`.
    pub quarantined_pages: usize,
    /// Pages in `Shared` (sealed prefix-cache pages, read or idle).
    pub shared_pages: usize,
    /// Shared pages no lease reads: evicted, least recently used first,
    /// when a lease needs the room.
    pub idle_shared_pages: usize,
    /// Shared pages of the public namespace: pinned, read or not, never
    /// evicted (never counted in `idle_shared_pages`).
    pub pinned_shared_pages: usize,
    /// Leases granted since the pool was built.
    pub leases_granted: u64,
    /// Leases refused (too large, exhausted, empty).
    pub leases_refused: u64,
    /// Writes refused for a stale generation (I3).
    pub stale_writes_rejected: u64,
    /// Writes refused for naming a page outside the lease (I1, I3).
    pub foreign_writes_rejected: u64,
    /// Reads refused for missing coverage or range (I2).
    pub reads_refused: u64,
    /// Pages ever sent to quarantine.
    pub pages_quarantined_total: u64,
    /// Leases that looked their prompt up in the prefix cache.
    pub cache_lookups: u64,
    /// Lookups that found a cached prefix.
    pub cache_hits: u64,
    /// Prompt tokens served from the cache instead of computed.
    pub cache_hit_tokens: u64,
    /// Shared pages evicted.
    pub cache_evictions: u64,
}

impl PoolStats {
    /// Tokens the whole pool holds.
    pub fn capacity_tokens(&self) -> usize {
        self.num_pages * self.page_size
    }

    /// Pages a new lease can have now: free ones and idle shared ones
    /// (which the lease would evict).
    pub fn available_pages(&self) -> usize {
        self.free_pages + self.idle_shared_pages
    }

    /// Whether nothing is held: no page leased, read or quarantined. Idle
    /// and pinned shared pages are the cache, not a holding (I8's
    /// baseline); a lease that reads a pinned page holds a page of its own
    /// too, so is seen.
    pub fn at_baseline(&self) -> bool {
        self.leased_pages == 0
            && self.quarantined_pages == 0
            && self.shared_pages == self.idle_shared_pages + self.pinned_shared_pages
    }
}

impl Pool {
    /// Builds the pool and touches every page, so the memory it reports is
    /// memory the process really holds (I6), not a lazily mapped promise.
    pub fn new(spec: &PoolSpec) -> Result<Pool, PoolError> {
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
        Ok(Pool {
            shared: Arc::new(Shared {
                geometry,
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
            }),
        })
    }

    /// The pool's real dimensions.
    pub fn geometry(&self) -> &Geometry {
        &self.shared.geometry
    }

    /// Tokens a request can be given: what was allocated (not what was
    /// asked), less the pages public prefixes pin.
    pub fn capacity_tokens(&self) -> usize {
        let pinned = self.stats().pinned_shared_pages;
        self.shared.geometry.capacity_tokens() - pinned * self.shared.geometry.page_size
    }

    /// Leases pages for `tokens` tokens to `owner`, all or nothing.
    ///
    /// Each page's generation is bumped and its coverage wiped, so nothing
    /// written under an earlier lease is readable through this one (I2).
    pub fn lease(&self, owner: RequestId, tokens: usize) -> Result<Lease, PoolError> {
        self.lease_pages(owner, tokens, None)
    }

    /// The namespace of `tenant` (the one the gateway authenticated; `salt`
    /// only subdivides it) on `model` with this pool's KV layout: what every
    /// prefix-cache key is built from.
    pub fn namespace(&self, tenant: &str, salt: Option<&str>, model: &str) -> Namespace {
        Namespace::new(tenant, salt, model, &self.shared.geometry)
    }

    /// The public namespace of `model` with this pool's KV layout: prefixes
    /// the operator declared common to every tenant. A lease of it seals
    /// pages that every tenant's lookups read (when they cover the public
    /// minimum) and that nothing evicts. Nothing a request sends may be
    /// leased into it: only what the operator declared.
    pub fn public_namespace(&self, model: &str) -> Namespace {
        Namespace::public(model, &self.shared.geometry)
    }

    /// Leading tokens of `prompt` that `model`'s public namespace holds in
    /// whole pages (0 without a prefix cache). Read-only: nothing is
    /// leased, counted or touched.
    pub fn public_prefix_tokens(&self, model: &str, prompt: &[u32]) -> usize {
        let public = self.public_namespace(model);
        let ledger = self.shared.ledger.lock();
        ledger.cache.as_ref().map_or(0, |cache| {
            cache.public_tokens(&public, prompt, self.shared.geometry.page_size)
        })
    }

    /// Whether this pool has a prefix cache.
    pub fn has_prefix_cache(&self) -> bool {
        self.shared.ledger.lock().cache.is_some()
    }

    /// Leases pages for `tokens` tokens to `owner` like [`Pool::lease`], but
    /// starts the lease with the longest prefix of `prompt` cached in
    /// `namespace`: whole pages shared read-only, and a match that ends
    /// inside a page copied into a page of the lease's own (copy on write).
    /// [`Lease::cached_tokens`] says how many positions are already written;
    /// at least one token of the prompt is always left to compute. Idle
    /// shared pages are evicted to make room, the largest tenant's first.
    pub fn lease_with_prefix(
        &self,
        owner: RequestId,
        tokens: usize,
        namespace: &Namespace,
        prompt: &[u32],
    ) -> Result<Lease, PoolError> {
        assert!(
            prompt.len() <= tokens,
            "a lease holds its whole prompt ({} > {tokens})",
            prompt.len()
        );
        self.lease_pages(owner, tokens, Some((namespace, prompt)))
    }

    fn lease_pages(
        &self,
        owner: RequestId,
        tokens: usize,
        prefix: Option<(&Namespace, &[u32])>,
    ) -> Result<Lease, PoolError> {
        let shared = &self.shared;
        let geometry = &shared.geometry;
        let page_size = geometry.page_size;
        let refuse = |error: PoolError| {
            Counters::bump(&shared.counters.leases_refused);
            Err(error)
        };
        if tokens == 0 {
            return refuse(PoolError::EmptyLease { owner });
        }
        if tokens > geometry.capacity_tokens() {
            return refuse(PoolError::LargerThanPool {
                owner,
                needed: tokens,
                capacity: geometry.capacity_tokens(),
            });
        }
        let total = tokens.div_ceil(page_size);
        let (found, ids) = {
            let mut ledger = shared.ledger.lock();
            let mut found = match (prefix, &ledger.cache) {
                (Some((namespace, prompt)), Some(cache)) => {
                    Counters::bump(&shared.counters.cache_lookups);
                    cache.find(namespace, prompt, page_size)
                }
                _ => Found::default(),
            };
            let needed = total - found.full.len();
            let idle =
                |page: &PageRef| ledger.cache.as_ref().and_then(|c| c.readers(page.id)) == Some(0);
            let idle_pages = ledger.cache.as_ref().map_or(0, |c| c.idle_pages());
            // Attaching an idle page takes it out of what may be evicted:
            // a whole page also takes one off what is needed, a page only
            // copied from does not. When the pool is that tight, copy nothing.
            let mut available =
                ledger.free.len() + idle_pages - found.full.iter().filter(|p| idle(p)).count();
            if let Some((source, _)) = found.partial
                && idle(&source)
                && available < needed + 1
            {
                found.partial = None;
            } else if found.partial.is_some_and(|(source, _)| idle(&source)) {
                available -= 1;
            }
            if available < needed {
                drop(ledger);
                return refuse(PoolError::Exhausted {
                    owner,
                    needed_pages: needed,
                    free_pages: available,
                });
            }
            let attached = found
                .full
                .iter()
                .chain(found.partial.iter().map(|(p, _)| p));
            if let Some(cache) = &mut ledger.cache {
                for page in attached {
                    cache.add_reader(page.id);
                }
            }
            (found, shared.take_free(&mut ledger, needed))
        };
        let lease = LeaseId(shared.next_lease.fetch_add(1, Ordering::Relaxed));
        let namespace = prefix.map(|(namespace, _)| namespace);
        let mut pages: Vec<PageRef> = Vec::with_capacity(total);
        for page_ref in &found.full {
            shared.check_shared(*page_ref, namespace);
            pages.push(*page_ref);
        }
        pages.extend(shared.stamp(ids, lease, owner));
        let mut shared_flags = vec![true; found.full.len()];
        shared_flags.resize(total, false);
        let mut cached = found.full.len() * page_size;
        if let Some((source, slots)) = found.partial {
            shared.check_shared(source, namespace);
            let at = found.full.len();
            if Mutation::WriteShared.active() {
                // Incident replay (k): the shared page itself goes into the
                // lease where its copy belongs, and the lease writes on.
                let own = std::mem::replace(&mut pages[at], source);
                shared_flags[at] = true;
                shared.give_back(lease, owner, vec![own], false);
            } else {
                shared.copy_page_prefix(source, pages[at], slots);
                shared
                    .ledger
                    .lock()
                    .cache
                    .as_mut()
                    .expect("a partial match comes from the cache")
                    .remove_reader(source.id);
            }
            cached += slots;
        }
        if cached > 0 {
            Counters::bump(&shared.counters.cache_hits);
            shared
                .counters
                .cache_hit_tokens
                .fetch_add(cached as u64, Ordering::Relaxed);
        }
        Counters::bump(&shared.counters.leases_granted);
        Ok(Lease::new(
            Arc::clone(shared),
            lease,
            owner,
            tokens,
            pages,
            shared_flags,
            namespace.cloned(),
            cached,
        ))
    }

    /// Frees the pages quarantined for `owner` once its one-sided writer has
    /// acknowledged that every write drained, or the transport proved no
    /// write can arrive (I4). Returns how many pages were freed.
    pub fn drain(&self, owner: RequestId) -> Result<usize, PoolError> {
        self.shared.drain(owner)
    }

    /// Requests that have pages in quarantine, for operators and timers.
    pub fn quarantined_owners(&self) -> Vec<RequestId> {
        self.shared
            .ledger
            .lock()
            .quarantined
            .keys()
            .copied()
            .collect()
    }

    /// The state of one page (I1 as an observable fact), or `None` for an id
    /// outside the arena.
    pub fn page_state(&self, id: PageId) -> Option<PageState> {
        let page = self.shared.pages.get(id.index())?.read();
        let (holder, generation) = (page.holder, page.generation);
        drop(page);
        Some(match holder {
            Holder::Free => PageState::Free,
            Holder::Leased { owner, .. } => PageState::Leased { owner, generation },
            Holder::Shared { namespace } => PageState::Shared {
                namespace,
                generation,
                readers: self
                    .shared
                    .ledger
                    .lock()
                    .cache
                    .as_ref()
                    .and_then(|c| c.readers(id))
                    .unwrap_or(0),
            },
            Holder::Quarantined { owner } => PageState::Quarantined { owner, generation },
        })
    }

    /// A consistent snapshot of page counts and counters.
    pub fn stats(&self) -> PoolStats {
        let shared = &self.shared;
        let ledger = shared.ledger.lock();
        let load = |c: &AtomicU64| c.load(Ordering::Relaxed);
        let counters = &shared.counters;
        PoolStats {
            num_pages: shared.geometry.num_pages,
            page_size: shared.geometry.page_size,
            free_pages: ledger.free.len(),
            leased_pages: ledger.leased,
            quarantined_pages: ledger.quarantined_pages,
            shared_pages: ledger.cache.as_ref().map_or(0, CacheLedger::shared_pages),
            idle_shared_pages: ledger.cache.as_ref().map_or(0, CacheLedger::idle_pages),
            pinned_shared_pages: ledger.cache.as_ref().map_or(0, CacheLedger::pinned_pages),
            leases_granted: load(&counters.leases_granted),
            leases_refused: load(&counters.leases_refused),
            stale_writes_rejected: load(&counters.stale_writes_rejected),
            foreign_writes_rejected: load(&counters.foreign_writes_rejected),
            reads_refused: load(&counters.reads_refused),
            pages_quarantined_total: load(&counters.pages_quarantined),
            cache_lookups: load(&counters.cache_lookups),
            cache_hits: load(&counters.cache_hits),
            cache_hit_tokens: load(&counters.cache_hit_tokens),
            cache_evictions: load(&counters.cache_evictions),
        }
    }
}

impl std::fmt::Debug for Pool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Pool")
            .field("geometry", &self.shared.geometry)
            .field("stats", &self.stats())
            .finish()
    }
}

impl Shared {
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
    fn take_free(&self, ledger: &mut Ledger, needed: usize) -> Vec<PageId> {
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
    fn stamp(&self, ids: Vec<PageId>, lease: LeaseId, owner: RequestId) -> Vec<PageRef> {
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

    /// `pages` more pages for `lease`, all or nothing, from free and idle
    /// shared pages; `Exhausted` when there are not enough.
    pub(crate) fn grow(
        &self,
        lease: LeaseId,
        owner: RequestId,
        pages: usize,
    ) -> Result<Vec<PageRef>, PoolError> {
        let ids = {
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
            self.take_free(&mut ledger, pages)
        };
        Ok(self.stamp(ids, lease, owner))
    }

    /// Asserts that `page_ref` is a shared page `namespace` may read, in
    /// the generation the index named (I1): the ledger said so, and the
    /// page itself must agree.
    fn check_shared(&self, page_ref: PageRef, namespace: Option<&Namespace>) {
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
    fn copy_page_prefix(&self, source: PageRef, target: PageRef, slots: usize) {
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

    /// Copies every layer's K and V for `slots` from hand-off bytes
    /// (`[layer][K|V][kv_head][slot][head_dim]`) into `page` and marks them
    /// covered. The chunk comes as `runs` whose concatenation is those
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::spec::{ElemType, KvShape, PoolSize};

    fn pool_with(scrub: Scrub) -> Pool {
        let shape = KvShape {
            layers: 1,
            kv_heads: 1,
            head_dim: 2,
        };
        Pool::new(&PoolSpec::new(shape, 2, ElemType::F32, PoolSize::Pages(1)).with_scrub(scrub))
            .expect("valid spec")
    }

    fn page_words(pool: &Pool) -> Vec<u64> {
        pool.shared.pages[0].read().data.to_vec()
    }

    #[test]
    fn scrub_policy_decides_what_a_released_page_holds() {
        for (scrub, expect) in [
            (Scrub::Zero, Some(0)),
            (Scrub::Poison, Some(poison_word(ElemType::F32))),
            (Scrub::Off, None),
        ] {
            let pool = pool_with(scrub);
            let mut lease = pool.lease(RequestId(1), 2).expect("room");
            lease
                .write_positions(0, 0, &[1.0f32; 4], &[2.0; 4])
                .expect("in range");
            drop(lease);
            let words = page_words(&pool);
            match expect {
                Some(word) => assert!(words.iter().all(|&w| w == word), "{scrub:?}: {words:x?}"),
                None => assert!(words.iter().any(|&w| w != 0), "Off keeps old bytes"),
            }
        }
    }

    #[test]
    fn drained_pages_are_scrubbed_before_reuse() {
        let pool = pool_with(Scrub::Poison);
        let mut lease = pool.lease(RequestId(1), 2).expect("room");
        lease
            .write_positions(0, 0, &[1.0f32; 4], &[2.0; 4])
            .expect("in range");
        lease.expose_to_one_sided_writer();
        drop(lease);
        assert!(
            page_words(&pool)
                .iter()
                .any(|&w| w != poison_word(ElemType::F32)),
            "not yet scrubbed"
        );
        pool.drain(RequestId(1)).expect("quarantined");
        assert!(
            page_words(&pool)
                .iter()
                .all(|&w| w == poison_word(ElemType::F32))
        );
    }
}

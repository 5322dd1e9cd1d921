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

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use parking_lot::{Mutex, RwLock};

use crate::coverage::Coverage;
use crate::element::poison_word;
use crate::error::PoolError;
use crate::lease::{Lease, LeaseId};
use crate::page::{Generation, PageId, PageRef, PageState, RequestId};
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

struct Ledger {
    free: VecDeque<PageId>,
    leased: usize,
    quarantined: HashMap<RequestId, Vec<PageRef>>,
    quarantined_pages: usize,
}

#[derive(Default)]
pub(crate) struct Counters {
    pub(crate) leases_granted: AtomicU64,
    pub(crate) leases_refused: AtomicU64,
    pub(crate) stale_writes_rejected: AtomicU64,
    pub(crate) foreign_writes_rejected: AtomicU64,
    pub(crate) reads_refused: AtomicU64,
    pub(crate) pages_quarantined: AtomicU64,
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
    ledger: Mutex<Ledger>,
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
}

impl PoolStats {
    /// Tokens the whole pool holds.
    pub fn capacity_tokens(&self) -> usize {
        self.num_pages * self.page_size
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

    /// Tokens the whole pool holds: what was allocated, not what was asked.
    pub fn capacity_tokens(&self) -> usize {
        self.shared.geometry.capacity_tokens()
    }

    /// Leases pages for `tokens` tokens to `owner`, all or nothing.
    ///
    /// Each page's generation is bumped and its coverage wiped, so nothing
    /// written under an earlier lease is readable through this one (I2).
    pub fn lease(&self, owner: RequestId, tokens: usize) -> Result<Lease, PoolError> {
        let shared = &self.shared;
        let geometry = &shared.geometry;
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
        let needed = tokens.div_ceil(geometry.page_size);
        let ids: Vec<PageId> = {
            let mut ledger = shared.ledger.lock();
            if ledger.free.len() < needed {
                let free_pages = ledger.free.len();
                drop(ledger);
                return refuse(PoolError::Exhausted {
                    owner,
                    needed_pages: needed,
                    free_pages,
                });
            }
            ledger.leased += needed;
            match shared.reuse {
                ReusePolicy::OldestFreedFirst => ledger.free.drain(..needed).collect(),
                ReusePolicy::NewestFreedFirst => {
                    let at = ledger.free.len() - needed;
                    ledger.free.drain(at..).rev().collect()
                }
            }
        };
        let lease = LeaseId(shared.next_lease.fetch_add(1, Ordering::Relaxed));
        let pages = ids
            .into_iter()
            .map(|id| {
                let mut page = shared.pages[id.index()].write();
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
            .collect();
        Counters::bump(&shared.counters.leases_granted);
        Ok(Lease::new(Arc::clone(shared), lease, owner, tokens, pages))
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
        let generation = page.generation;
        Some(match page.holder {
            Holder::Free => PageState::Free,
            Holder::Leased { owner, .. } => PageState::Leased { owner, generation },
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
            leases_granted: load(&counters.leases_granted),
            leases_refused: load(&counters.leases_refused),
            stale_writes_rejected: load(&counters.stale_writes_rejected),
            foreign_writes_rejected: load(&counters.foreign_writes_rejected),
            reads_refused: load(&counters.reads_refused),
            pages_quarantined_total: load(&counters.pages_quarantined),
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

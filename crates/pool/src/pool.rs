//! [`Pool`]: the handle to one arena of fenced pages — leasing, the prefix
//! cache's lookups, drain and counters. The arena itself and its ledger
//! live in [`crate::ledger`].

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use crate::error::PoolError;
use crate::group::GroupLease;
use crate::layers::{Keep, LayerGroups};
use crate::lease::Lease;
use crate::ledger::{Counters, Holder, Shared};
use crate::mutation::Mutation;
use crate::page::{PageId, PageRef, PageState, RequestId};
use crate::prefix::{CacheLedger, Found, Namespace};
use crate::spec::{Geometry, PoolSpec};

/// A prefix whose windows the windowed layer groups hold behind its end
/// ([`Pool::window_match`]).
struct WindowMatch {
    /// The prefix's end (whole pages).
    end: usize,
    /// The window's first page.
    base: usize,
    /// Each windowed group's pages `base..end / page_size`.
    windows: Vec<(usize, Vec<PageRef>)>,
}

/// A fenced KV page pool. Cheap to clone: clones share one arena.
#[derive(Clone)]
pub struct Pool {
    shared: Arc<Shared>,
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
        Ok(Pool {
            shared: Arc::new(Shared::new(spec)?),
        })
    }

    /// The pool's real dimensions.
    pub fn geometry(&self) -> &Geometry {
        &self.shared.geometry
    }

    /// Tokens a request can be given: what was allocated (not what was
    /// asked), less the pages public prefixes pin, for the longest request
    /// its layer groups' pages hold.
    pub fn capacity_tokens(&self) -> usize {
        let pinned = self.stats().pinned_shared_pages;
        let geometry = &self.shared.geometry;
        self.shared
            .groups
            .capacity_tokens(geometry.num_pages - pinned, geometry.page_size)
    }

    /// How the model's layers share this pool's pages.
    pub fn layer_groups(&self) -> &LayerGroups {
        &self.shared.groups
    }

    /// Pages a lease of `tokens` positions holds, every layer group's.
    pub fn pages_for(&self, tokens: usize) -> usize {
        self.shared
            .groups
            .pages_for(tokens, self.shared.geometry.page_size)
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
        // Every layer group must hold the prefix for a lease to start from it.
        ledger.cache.as_ref().map_or(0, |cache| {
            (0..self.shared.groups.len())
                .map(|g| {
                    cache.public_tokens(&public.group(g), prompt, self.shared.geometry.page_size)
                })
                .min()
                .unwrap_or(0)
        })
    }

    /// Whether this pool has a prefix cache.
    pub fn has_prefix_cache(&self) -> bool {
        self.shared.ledger.lock().cache.is_some()
    }

    /// Prompt tokens a match in the public namespace must cover before a
    /// lease reads it ([`crate::CacheSpec::public_min_tokens`]); `None`
    /// without a prefix cache.
    pub fn public_min_tokens(&self) -> Option<usize> {
        let ledger = self.shared.ledger.lock();
        ledger.cache.as_ref().map(|cache| cache.public_min_tokens())
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
        let capacity = shared.groups.capacity_tokens(geometry.num_pages, page_size);
        if tokens > capacity {
            return refuse(PoolError::LargerThanPool {
                owner,
                needed: tokens,
                capacity,
            });
        }
        let per_group = shared.groups.pages_per_group(tokens, page_size);
        let namespaces: Vec<Option<Namespace>> = (0..per_group.len())
            .map(|g| prefix.map(|(namespace, _)| namespace.group(g)))
            .collect();
        let (mut found, released, ids) = {
            let mut ledger = shared.ledger.lock();
            let mut found: Vec<Found> = match (prefix, &ledger.cache) {
                (Some((_, prompt)), Some(cache)) => {
                    Counters::bump(&shared.counters.cache_lookups);
                    namespaces
                        .iter()
                        .map(|n| {
                            cache.find(n.as_ref().expect("a prefix names one"), prompt, page_size)
                        })
                        .collect()
                }
                _ => per_group.iter().map(|_| Found::default()).collect(),
            };
            // Every group starts from one prefix: the shortest match, within
            // what each group's pages hold.
            let mut common = found
                .iter()
                .zip(&per_group)
                .map(|(f, &pages)| f.tokens(page_size).min(pages * page_size))
                .min()
                .unwrap_or(0);
            // Where a window's group holds only the pages behind a longer
            // match, the lease starts with that window, slid to it.
            let mut released = vec![0; per_group.len()];
            if let (Some((_, prompt)), Some(cache)) = (prefix, &ledger.cache)
                && let Some(window) = self.window_match(cache, &found, &namespaces, prompt, common)
            {
                for (g, pages) in window.windows {
                    found[g] = Found {
                        full: pages,
                        partial: None,
                    };
                    released[g] = window.base;
                }
                common = window.end;
            }
            for (f, &base) in found.iter_mut().zip(&released) {
                f.truncate(common - base * page_size, page_size);
            }
            let needed: usize = per_group
                .iter()
                .zip(&found)
                .map(|(pages, f)| pages - f.full.len())
                .sum();
            let idle =
                |page: &PageRef| ledger.cache.as_ref().and_then(|c| c.readers(page.id)) == Some(0);
            let idle_pages = ledger.cache.as_ref().map_or(0, |c| c.idle_pages());
            // Attaching an idle page takes it out of what may be evicted:
            // a whole page also takes one off what is needed, a page only
            // copied from does not. When the pool is that tight, copy nothing.
            let attached_idle: usize = found
                .iter()
                .map(|f| f.full.iter().filter(|p| idle(p)).count())
                .sum();
            let mut available = ledger.free_pages() + idle_pages - attached_idle;
            let idle_sources = found
                .iter()
                .filter(|f| f.partial.is_some_and(|(source, _)| idle(&source)))
                .count();
            if idle_sources > 0 && available < needed + idle_sources {
                // Every group starts from the same prefix: none copies.
                for f in &mut found {
                    f.partial = None;
                }
            } else {
                available -= idle_sources;
            }
            if available < needed {
                drop(ledger);
                return refuse(PoolError::Exhausted {
                    owner,
                    needed_pages: needed,
                    free_pages: available,
                });
            }
            if let Some(cache) = &mut ledger.cache {
                for f in &found {
                    for page in f.full.iter().chain(f.partial.iter().map(|(p, _)| p)) {
                        cache.add_reader(page.id);
                    }
                }
            }
            (found, released, shared.take_free(&mut ledger, needed))
        };
        let mut ids = ids.into_iter();
        let cached = found
            .iter()
            .zip(&released)
            .map(|(f, base)| base * page_size + f.tokens(page_size))
            .min()
            .unwrap_or(0);
        let prompt: Option<Arc<[u32]>> = prefix.map(|(_, prompt)| prompt.into());
        let groups = found
            .iter_mut()
            .zip(&per_group)
            .zip(namespaces)
            .zip(released)
            .map(|(((found, &total), namespace), base)| {
                let own: Vec<_> = ids.by_ref().take(total - found.full.len()).collect();
                let prompt = namespace.as_ref().and(prompt.clone());
                self.lease_group(owner, total, found, own, namespace, base, prompt)
            })
            .collect();
        if cached > 0 {
            Counters::bump(&shared.counters.cache_hits);
            shared
                .counters
                .cache_hit_tokens
                .fetch_add(cached as u64, Ordering::Relaxed);
        }
        Counters::bump(&shared.counters.leases_granted);
        Ok(Lease::new(Arc::clone(shared), groups, tokens, cached))
    }

    /// The longest prefix of `prompt` past `contiguous` (the match every
    /// group holds from position 0) that the groups keeping every position
    /// hold from 0 and every windowed group holds behind its end — the
    /// pages a window reads there, from [`Keep::read_start`]: the prefix's
    /// end, the window's first page, and each windowed group's pages.
    fn window_match(
        &self,
        cache: &CacheLedger,
        found: &[Found],
        namespaces: &[Option<Namespace>],
        prompt: &[u32],
        contiguous: usize,
    ) -> Option<WindowMatch> {
        let groups = &self.shared.groups;
        let page_size = self.shared.geometry.page_size;
        let windowed: Vec<usize> = (0..groups.len())
            .filter(|&g| groups.keep(g) != Keep::All)
            .collect();
        let keep = groups.keep(*windowed.first()?);
        // Whole pages only: a window's pages are never copied from.
        let kept = (0..groups.len())
            .filter(|&g| groups.keep(g) == Keep::All)
            .map(|g| found[g].full.len())
            .min()?;
        if kept * page_size <= contiguous {
            return None;
        }
        let cached: Vec<Vec<Option<PageRef>>> = windowed
            .iter()
            .map(|&g| {
                let namespace = namespaces[g].as_ref().expect("a prefix names one");
                cache.window_pages(namespace, prompt, kept * page_size, page_size)
            })
            .collect();
        (1..=kept)
            .rev()
            .take_while(|&end| end * page_size > contiguous)
            .find_map(|end| {
                let base = keep.read_start(end * page_size) / page_size;
                let windows: Option<Vec<_>> = windowed
                    .iter()
                    .zip(&cached)
                    .map(|(&g, pages)| {
                        Some((
                            g,
                            pages[base..end]
                                .iter()
                                .copied()
                                .collect::<Option<Vec<_>>>()?,
                        ))
                    })
                    .collect();
                Some(WindowMatch {
                    end: end * page_size,
                    base,
                    windows: windows?,
                })
            })
    }

    /// One layer group's run of `total` pages: the shared pages `found`
    /// matched, then `own` (taken off the free list), the first of them
    /// copied from `found`'s partial page when there is one; the run
    /// starts at page `released` (a window's first).
    #[allow(clippy::too_many_arguments)]
    fn lease_group(
        &self,
        owner: RequestId,
        total: usize,
        found: &Found,
        own: Vec<PageId>,
        namespace: Option<Namespace>,
        released: usize,
        prompt: Option<Arc<[u32]>>,
    ) -> GroupLease {
        let shared = &self.shared;
        let lease = shared.next_lease_id();
        let mut pages: Vec<PageRef> = Vec::with_capacity(total);
        for page_ref in &found.full {
            shared.check_shared(*page_ref, namespace.as_ref());
            pages.push(*page_ref);
        }
        pages.extend(shared.stamp(own, lease, owner));
        assert_eq!(
            pages.len(),
            total,
            "a group's run holds every page it needs"
        );
        let mut shared_flags = vec![true; found.full.len()];
        shared_flags.resize(total, false);
        if let Some((source, slots)) = found.partial {
            shared.check_shared(source, namespace.as_ref());
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
        }
        GroupLease::new(
            Arc::clone(shared),
            lease,
            owner,
            pages,
            shared_flags,
            namespace,
            released,
            prompt,
        )
    }

    /// Frees the pages quarantined for `owner` once its one-sided writer has
    /// acknowledged that every write drained, or the transport proved no
    /// write can arrive (I4). Returns how many pages were freed.
    pub fn drain(&self, owner: RequestId) -> Result<usize, PoolError> {
        self.shared.drain(owner)
    }

    /// Requests that have pages in quarantine, for operators and timers.
    pub fn quarantined_owners(&self) -> Vec<RequestId> {
        self.shared.ledger.lock().quarantined_owners()
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
            free_pages: ledger.free_pages(),
            leased_pages: ledger.leased,
            quarantined_pages: ledger.quarantined_pages(),
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::element::ElemType;
    use crate::element::poison_word;
    use crate::spec::{KvShape, PoolSize, Scrub};

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

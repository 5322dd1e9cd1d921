//! What a pool is built from ([`PoolSpec`]) and the geometry derived from it.
//!
//! The spec says what the caller wants; [`Geometry`] says what was actually
//! allocated. Capacity is always reported from the geometry, never from the
//! request, because admission (I6) must be computed from real memory.

use std::ops::Range;

use crate::element::ElemType;
use crate::error::PoolError;
use crate::layers::LayerGroups;

/// The per-token shape of a model's KV cache.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KvShape {
    /// Decoder layers.
    pub layers: usize,
    /// Key/value heads per layer (after grouped-query sharing).
    pub kv_heads: usize,
    /// Elements per head.
    pub head_dim: usize,
}

/// How large the pool should be.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PoolSize {
    /// Exactly this many pages.
    Pages(usize),
    /// As many whole pages as fit in this many bytes.
    Bytes(usize),
    /// Enough whole pages for one request of at least this many tokens
    /// (every layer group's pages of it).
    Tokens(usize),
}

impl std::fmt::Display for PoolSize {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            PoolSize::Pages(n) => write!(f, "{n} pages"),
            PoolSize::Bytes(n) => write!(f, "{n} bytes"),
            PoolSize::Tokens(n) => write!(f, "{n} tokens"),
        }
    }
}

/// What happens to a page's contents when it returns to `Free`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Scrub {
    /// Leave old contents in place (fastest; isolation rests on the checks).
    Off,
    /// Overwrite with zeros.
    Zero,
    /// Overwrite with a NaN pattern, so any read that slipped past the checks
    /// would show up as NaN in outputs.
    Poison,
}

impl Scrub {
    /// Poison in debug builds (tests), off in release builds, so tests catch a read of unwritten KV (I2).
    pub fn default_for_build() -> Scrub {
        if cfg!(debug_assertions) {
            Scrub::Poison
        } else {
            Scrub::Off
        }
    }
}

/// Which free page a lease gets first.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReusePolicy {
    /// Least recently freed first: freed pages rest as long as possible.
    OldestFreedFirst,
    /// Most recently freed first: reuse is immediate, the harshest setting
    /// for isolation tests.
    NewestFreedFirst,
}

/// Everything needed to build a [`crate::Pool`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PoolSpec {
    /// Per-token KV shape of the whole model (every layer).
    pub shape: KvShape,
    /// How the layers share pages: one group of every layer unless
    /// [`PoolSpec::with_layer_groups`] says otherwise.
    pub groups: Option<LayerGroups>,
    /// Token slots per page.
    pub page_size: usize,
    /// Element type of stored K/V.
    pub elem: ElemType,
    /// Requested size.
    pub size: PoolSize,
    /// Scrub policy on release.
    pub scrub: Scrub,
    /// Free-page reuse order.
    pub reuse: ReusePolicy,
    /// Whether the isolation checks run (always, outside measurement builds).
    pub checks: Checks,
    /// The prefix cache: sealed pages shared within a namespace. Off
    /// unless asked for.
    pub cache: Option<CacheSpec>,
}

/// [`CacheSpec::public_min_tokens`] unless the spec says otherwise.
pub const DEFAULT_PUBLIC_MIN_TOKENS: usize = 64;

/// How the prefix cache of a pool behaves.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CacheSpec {
    /// Shared pages one tenant may hold at most, so no tenant can push
    /// another's entries out by flooding the cache.
    pub tenant_quota_pages: usize,
    /// Prompt tokens a match in the public namespace must cover before a
    /// lease reads it; shorter overlaps are computed in the tenant's own
    /// namespace, so pages cross tenants only where they save real work.
    pub public_min_tokens: usize,
    /// Test hook: block hashes leave token values out, so every page of a
    /// length after the same parent collides. It exists to show that a hit
    /// is taken only after comparing tokens; nothing else sets it.
    pub colliding_hashes: bool,
}

/// Whether the pool enforces its isolation checks: the write fence (I3) and
/// read coverage (I2). Only `On` exists unless the crate is built with the
/// `unchecked-for-measurement` feature, which benchmarks enable to measure
/// what the checks cost; the `kvfence` binary never does.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Checks {
    /// Every write is fenced and every read proven covered.
    #[default]
    On,
    /// Writes skip the fence and coverage marking, reads skip the coverage
    /// proof. Measurement only: isolation is not enforced.
    #[cfg(feature = "unchecked-for-measurement")]
    Off,
}

/// Largest page the pool accepts; coverage bitmaps and chunk frames assume
/// pages of modest size.
pub const MAX_PAGE_SIZE: usize = 4096;

/// Most layers a pool holds KV for: eight times the deepest open models'
/// (126). A pool sizes per-layer tables by the count, so one a file or a
/// flag makes up (2^40) is refused rather than allocated.
pub const MAX_LAYERS: usize = 1024;

impl PoolSpec {
    /// A spec with the build's default scrub policy and oldest-first reuse.
    ///
    /// In debug builds, `KVFENCE_HARSH_POOLS=1` makes every pool reuse the
    /// most recently freed page first and never scrub: CI runs the whole
    /// test suite a second time that way, so what keeps requests apart is
    /// the checks, not resting pages or poisoned memory. Release builds
    /// ignore the variable.
    pub fn new(shape: KvShape, page_size: usize, elem: ElemType, size: PoolSize) -> Self {
        let harsh = cfg!(debug_assertions) && std::env::var_os("KVFENCE_HARSH_POOLS").is_some();
        PoolSpec {
            shape,
            groups: None,
            page_size,
            elem,
            size,
            scrub: if harsh {
                Scrub::Off
            } else {
                Scrub::default_for_build()
            },
            reuse: if harsh {
                ReusePolicy::NewestFreedFirst
            } else {
                ReusePolicy::OldestFreedFirst
            },
            checks: Checks::On,
            cache: None,
        }
    }

    /// Same spec with a prefix cache whose tenants may each hold
    /// `tenant_quota_pages` shared pages.
    pub fn with_prefix_cache(mut self, tenant_quota_pages: usize) -> Self {
        self.cache = Some(CacheSpec {
            tenant_quota_pages,
            public_min_tokens: DEFAULT_PUBLIC_MIN_TOKENS,
            colliding_hashes: false,
        });
        self
    }

    /// Same spec with another minimum for public-namespace matches (see
    /// [`CacheSpec::public_min_tokens`]); no effect without a prefix cache.
    pub fn with_public_min_tokens(mut self, tokens: usize) -> Self {
        if let Some(cache) = &mut self.cache {
            cache.public_min_tokens = tokens;
        }
        self
    }

    /// Test hook: the prefix cache's block hashes collide for every page of
    /// equal length after the same parent (see [`CacheSpec`]).
    #[doc(hidden)]
    pub fn with_colliding_hashes(mut self) -> Self {
        if let Some(cache) = &mut self.cache {
            cache.colliding_hashes = true;
        }
        self
    }

    /// Same spec with its layers in `groups`: a page holds one group's
    /// layers, a lease one run of pages per group, and sliding-window
    /// groups keep only their window (see [`LayerGroups`]).
    pub fn with_layer_groups(mut self, groups: LayerGroups) -> Self {
        self.groups = Some(groups);
        self
    }

    /// The layer groups, one of every layer unless the spec names others.
    pub fn layer_groups(&self) -> LayerGroups {
        self.groups
            .clone()
            .unwrap_or_else(|| LayerGroups::single(self.shape.layers))
    }

    /// Same spec with another scrub policy.
    pub fn with_scrub(mut self, scrub: Scrub) -> Self {
        self.scrub = scrub;
        self
    }

    /// Same spec with another reuse order.
    pub fn with_reuse(mut self, reuse: ReusePolicy) -> Self {
        self.reuse = reuse;
        self
    }

    /// The same spec with the isolation checks switched (measurement builds only).
    #[cfg(feature = "unchecked-for-measurement")]
    pub fn with_checks(mut self, checks: Checks) -> Self {
        self.checks = checks;
        self
    }

    /// Checks the spec and computes what will actually be allocated.
    pub fn geometry(&self) -> Result<Geometry, PoolError> {
        let invalid = |reason: String| PoolError::InvalidSpec { reason };
        let KvShape {
            layers,
            kv_heads,
            head_dim,
        } = self.shape;
        if layers == 0 || kv_heads == 0 || head_dim == 0 {
            return Err(invalid(format!(
                "layers ({layers}), kv heads ({kv_heads}) and head dim ({head_dim}) must all be positive"
            )));
        }
        if layers > MAX_LAYERS {
            return Err(invalid(format!(
                "{layers} layers are more than a pool holds ({MAX_LAYERS})"
            )));
        }
        let groups = self.layer_groups();
        if groups.layers() != layers {
            return Err(invalid(format!(
                "the layer groups place {} layers, the model has {layers}",
                groups.layers()
            )));
        }
        // A page holds one group's layers.
        let shape = KvShape {
            layers: groups.group_size(),
            ..self.shape
        };
        let layers = shape.layers;
        if self.page_size == 0 || self.page_size > MAX_PAGE_SIZE {
            return Err(invalid(format!(
                "page size {} must be between 1 and {MAX_PAGE_SIZE} tokens",
                self.page_size
            )));
        }
        let elements = [layers, 2, kv_heads, self.page_size, head_dim]
            .iter()
            .try_fold(1usize, |acc, &n| acc.checked_mul(n))
            .ok_or_else(|| invalid("page size in elements overflows".into()))?;
        let page_bytes = elements
            .checked_mul(self.elem.size_bytes())
            .ok_or_else(|| invalid("page size in bytes overflows".into()))?;
        let num_pages = match self.size {
            PoolSize::Pages(n) => n,
            PoolSize::Bytes(budget) => budget / page_bytes,
            PoolSize::Tokens(tokens) => groups.pages_for(tokens, self.page_size),
        };
        if num_pages == 0 {
            return Err(invalid(format!(
                "a pool of {} leaves room for no page of {page_bytes} bytes ({} tokens)",
                self.size, self.page_size
            )));
        }
        if num_pages > u32::MAX as usize {
            return Err(invalid(format!(
                "{num_pages} pages exceed the page id range"
            )));
        }
        Ok(Geometry {
            shape,
            page_size: self.page_size,
            elem: self.elem,
            num_pages,
            page_elements: elements,
            page_bytes,
        })
    }
}

/// The pool's real dimensions, derived from a validated [`PoolSpec`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Geometry {
    /// Per-token KV shape of one page: one layer group's layers.
    pub shape: KvShape,
    /// Token slots per page.
    pub page_size: usize,
    /// Element type.
    pub elem: ElemType,
    /// Pages allocated.
    pub num_pages: usize,
    /// Elements in one page (all layers, K and V).
    pub page_elements: usize,
    /// Bytes in one page.
    pub page_bytes: usize,
}

impl Geometry {
    /// Token slots of every page together (one layer group's positions
    /// each: a request's context is [`crate::Pool::capacity_tokens`]).
    pub fn slots(&self) -> usize {
        self.num_pages * self.page_size
    }

    /// Bytes of KV the whole pool holds.
    pub fn capacity_bytes(&self) -> usize {
        self.num_pages * self.page_bytes
    }

    /// Elements of one K (or V) block: one layer, one head, every slot.
    pub fn head_block(&self) -> usize {
        self.page_size * self.shape.head_dim
    }

    /// Offset of the first element of `(layer, kv, head)` in a page, where
    /// `kv` is 0 for K and 1 for V. A page is laid out
    /// `[layer][K|V][kv_head]`, and within that one head's block:
    ///
    /// - keys as columns, `[dim][slot]`: dimension `d` of every slot of the
    ///   page is contiguous, so attention scores 16 keys with one vector
    ///   load per dimension and never transposes;
    /// - values as rows, `[slot][dim]`: the weighted sum over positions
    ///   reads one row per position.
    pub fn block_offset(&self, layer: usize, kv: usize, head: usize) -> usize {
        ((layer * 2 + kv) * self.shape.kv_heads + head) * self.head_block()
    }

    /// Offset of key dimension `dim` of `slot` in the key block of
    /// `(layer, head)` (see [`Geometry::block_offset`]).
    pub fn key_offset(&self, layer: usize, head: usize, slot: usize, dim: usize) -> usize {
        self.block_offset(layer, 0, head) + dim * self.page_size + slot
    }

    /// Where the bytes of a hand-off chunk of `slots` lie in a page: the
    /// page's own order restricted to those slots, in byte ranges. Per
    /// `(layer, K|V, kv_head)` block: keys as one run of the slots per
    /// dimension, values as one run of rows. A whole page is one run: its
    /// blocks lie back to back, so the chunk is the page's bytes as they
    /// are, copied and hashed in one pass each.
    pub fn chunk_runs(&self, slots: Range<usize>) -> ChunkRuns {
        assert!(
            slots.start <= slots.end && slots.end <= self.page_size,
            "slots {slots:?} are outside a page of {}",
            self.page_size
        );
        ChunkRuns {
            geometry: *self,
            slots,
            block: 0,
            piece: 0,
        }
    }

    /// Bytes of a hand-off chunk of `slots` slots: every layer's K and V.
    pub fn chunk_bytes(&self, slots: usize) -> usize {
        slots
            * self.shape.head_dim
            * self.elem.size_bytes()
            * self.shape.layers
            * 2
            * self.shape.kv_heads
    }

    /// Elements one token contributes to one layer's K (or V): all heads.
    pub fn token_elements(&self) -> usize {
        self.shape.kv_heads * self.shape.head_dim
    }
}

/// The byte ranges of a hand-off chunk in its page, in the page's order
/// ([`Geometry::chunk_runs`]).
#[derive(Debug, Clone)]
pub struct ChunkRuns {
    geometry: Geometry,
    slots: Range<usize>,
    /// The next `(layer, K|V, kv_head)` block, counted in page order.
    block: usize,
    /// The next run within that block (key blocks of a partial page have
    /// one per dimension).
    piece: usize,
}

impl ChunkRuns {
    fn blocks(&self) -> usize {
        let shape = self.geometry.shape;
        shape.layers * 2 * shape.kv_heads
    }

    fn whole_page(&self) -> bool {
        self.slots.len() == self.geometry.page_size
    }

    /// Runs in one block: one for values, one per dimension for keys.
    fn pieces(&self, block: usize) -> usize {
        let is_key = (block / self.geometry.shape.kv_heads).is_multiple_of(2);
        if is_key {
            self.geometry.shape.head_dim
        } else {
            1
        }
    }
}

impl Iterator for ChunkRuns {
    type Item = Range<usize>;

    fn next(&mut self) -> Option<Range<usize>> {
        let g = self.geometry;
        let elem = g.elem.size_bytes();
        if self.slots.is_empty() || self.block >= self.blocks() {
            return None;
        }
        if self.whole_page() {
            self.block = self.blocks();
            return Some(0..self.blocks() * g.head_block() * elem);
        }
        let (block, piece) = (self.block, self.piece);
        let start = block * g.head_block();
        let is_key = self.pieces(block) > 1;
        let run = if is_key {
            // Dimension `piece` of the chunk's slots.
            let at = start + piece * g.page_size + self.slots.start;
            at..at + self.slots.len()
        } else {
            let hd = g.shape.head_dim;
            start + self.slots.start * hd..start + self.slots.end * hd
        };
        self.piece += 1;
        if self.piece == self.pieces(block) {
            (self.block, self.piece) = (block + 1, 0);
        }
        Some(run.start * elem..run.end * elem)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A size that leaves room for no page says so in the operator's words.
    #[test]
    fn a_size_with_room_for_no_page_is_named_in_units() {
        let shape = KvShape {
            layers: 2,
            kv_heads: 1,
            head_dim: 4,
        };
        for (size, says) in [
            (PoolSize::Tokens(0), "0 tokens"),
            (PoolSize::Bytes(10), "10 bytes"),
            (PoolSize::Pages(0), "0 pages"),
        ] {
            let error = PoolSpec::new(shape, 16, ElemType::F32, size)
                .geometry()
                .unwrap_err()
                .to_string();
            assert!(error.contains(says), "{error}");
            assert!(
                !error.contains("Tokens(") && !error.contains("Bytes("),
                "{error}"
            );
        }
    }

    /// Layer counts no model has are refused before anything is sized by
    /// them: a spec of 2^40 layers used to build a table of 2^40 entries
    /// (`kvfence pool plan --layers 4294967295` ran until memory ran out).
    #[test]
    fn more_layers_than_a_pool_holds_are_refused_by_count() {
        for layers in [MAX_LAYERS + 1, 1 << 40, usize::MAX] {
            let shape = KvShape {
                layers,
                kv_heads: 1,
                head_dim: 4,
            };
            let error = PoolSpec::new(shape, 16, ElemType::F32, PoolSize::Pages(4))
                .geometry()
                .unwrap_err()
                .to_string();
            assert!(
                error.contains(&format!("{layers} layers")) && error.contains("1024"),
                "{error}"
            );
        }
        let deepest = KvShape {
            layers: MAX_LAYERS,
            kv_heads: 1,
            head_dim: 4,
        };
        let geometry = PoolSpec::new(deepest, 16, ElemType::F32, PoolSize::Pages(4))
            .geometry()
            .unwrap();
        assert_eq!(geometry.page_bytes, MAX_LAYERS * 2 * 16 * 4 * 4);
    }

    /// Runs in both of CI's test passes: plain, and with
    /// `KVFENCE_HARSH_POOLS=1`, where the defaults must really change — in
    /// debug builds. A release build keeps its own defaults (no scrub,
    /// oldest first) and ignores the variable.
    #[test]
    fn the_harsh_pools_variable_switches_the_test_defaults() {
        let shape = KvShape {
            layers: 1,
            kv_heads: 1,
            head_dim: 2,
        };
        let spec = PoolSpec::new(shape, 4, ElemType::F32, PoolSize::Tokens(8));
        let harsh = std::env::var_os("KVFENCE_HARSH_POOLS").is_some();
        let expected = if !cfg!(debug_assertions) {
            (Scrub::Off, ReusePolicy::OldestFreedFirst)
        } else if harsh {
            (Scrub::Off, ReusePolicy::NewestFreedFirst)
        } else {
            (Scrub::Poison, ReusePolicy::OldestFreedFirst)
        };
        assert_eq!((spec.scrub, spec.reuse), expected);
    }

    /// A chunk's runs, joined, are the page's elements of those slots in
    /// the page's own order, each once: checked element by element against
    /// `key_offset` and the value rows, for whole and partial pages. A
    /// whole page is one run.
    #[test]
    fn chunk_runs_cover_exactly_the_slots_in_page_order() {
        for (page_size, elem) in [(16, ElemType::F32), (5, ElemType::F16), (24, ElemType::F16)] {
            let shape = KvShape {
                layers: 3,
                kv_heads: 2,
                head_dim: 4,
            };
            let spec = PoolSpec::new(shape, page_size, elem, PoolSize::Pages(1));
            let g = spec.geometry().unwrap();
            let size = elem.size_bytes();
            for start in 0..page_size {
                for end in start + 1..=page_size {
                    let mut expected = Vec::new();
                    for layer in 0..shape.layers {
                        for head in 0..shape.kv_heads {
                            for dim in 0..shape.head_dim {
                                expected.extend(
                                    (start..end).map(|s| g.key_offset(layer, head, s, dim)),
                                );
                            }
                        }
                        for head in 0..shape.kv_heads {
                            let block = g.block_offset(layer, 1, head);
                            expected.extend(block + start * 4..block + end * 4);
                        }
                    }
                    let runs: Vec<Range<usize>> = g.chunk_runs(start..end).collect();
                    let got: Vec<usize> = runs
                        .iter()
                        .flat_map(|run| {
                            assert_eq!(run.start % size, 0, "runs start on an element");
                            assert_eq!(run.len() % size, 0, "runs hold whole elements");
                            (run.start / size)..(run.end / size)
                        })
                        .collect();
                    assert_eq!(got, expected, "slots {start}..{end} of {page_size}");
                    assert_eq!(got.len() * size, g.chunk_bytes(end - start));
                    if end - start == page_size {
                        assert_eq!(runs, vec![0..g.page_bytes], "a whole page is one run");
                    }
                }
            }
        }
    }
}

//! Property test: the pool against a plain reference model.
//!
//! Random sequences of lease / write / stale write / foreign write / read /
//! slide / drop / one-sided drop / drain run on a real pool and on a model
//! made of maps and vectors. After every step the page states, counts and
//! counters must agree (I1, I8); every read must succeed exactly when the
//! model says every position was written in this generation and is still
//! held (a slid lease's window), and return exactly the values this lease
//! wrote (I2, I7); every fenced write that should fail fails and leaves no
//! trace (I3).

// In a test, a panic is the failure report.
#![allow(clippy::unwrap_used)]

use std::collections::HashMap;

use kvfence_pool::{
    ElemType, KvShape, Lease, PageId, PageRef, PageState, Pool, PoolError, PoolSize, PoolSpec,
    RequestId, ReusePolicy, Scrub,
};
use proptest::prelude::*;

const SHAPE: KvShape = KvShape {
    layers: 2,
    kv_heads: 2,
    head_dim: 2,
};
const PAGE: usize = 4;
const PAGES: usize = 6;
const SLOTS: usize = 4;
const PER_TOKEN: usize = 4; // kv_heads * head_dim

#[derive(Debug, Clone)]
enum Op {
    Lease {
        slot: usize,
        tokens: usize,
    },
    Write {
        slot: usize,
        start: usize,
        len: usize,
        layer: usize,
    },
    WriteStale {
        slot: usize,
        page: usize,
    },
    WriteForeign {
        slot: usize,
        page: u32,
    },
    Read {
        slot: usize,
        start: usize,
        len: usize,
        layer: Option<usize>,
    },
    Slide {
        slot: usize,
        keep_from: usize,
    },
    Drop {
        slot: usize,
        one_sided: bool,
    },
    Drain {
        pick: usize,
    },
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        3 => (0..SLOTS, 0..=PAGES * PAGE + 2).prop_map(|(slot, tokens)| Op::Lease { slot, tokens }),
        6 => (0..SLOTS, 0..3 * PAGES * PAGE, 1..=PAGE + 3, 0..SHAPE.layers)
            .prop_map(|(slot, start, len, layer)| Op::Write { slot, start, len, layer }),
        1 => (0..SLOTS, 0..PAGES).prop_map(|(slot, page)| Op::WriteStale { slot, page }),
        1 => (0..SLOTS, 0..PAGES as u32 + 2).prop_map(|(slot, page)| Op::WriteForeign { slot, page }),
        4 => (0..SLOTS, 0..=PAGES * PAGE + 1, proptest::option::of(0..SHAPE.layers))
            .prop_map(|(slot, len, layer)| Op::Read { slot, start: 0, len, layer }),
        3 => (0..SLOTS, 0..=3 * PAGES * PAGE, 0..=3 * PAGES * PAGE, 0..SHAPE.layers)
            .prop_map(|(slot, start, len, layer)| Op::Read { slot, start, len, layer: Some(layer) }),
        2 => (0..SLOTS, 0..=3 * PAGES * PAGE).prop_map(|(slot, keep_from)| Op::Slide { slot, keep_from }),
        2 => (0..SLOTS, any::<bool>()).prop_map(|(slot, one_sided)| Op::Drop { slot, one_sided }),
        1 => (0..8usize).prop_map(|pick| Op::Drain { pick }),
    ]
}

/// What the model knows about one live lease.
struct ModelLease {
    owner: RequestId,
    pages: Vec<PageRef>,
    /// The position `pages[0]` starts at: 0 until the lease slides.
    first: usize,
    /// (layer, position) -> the K and V values last written there.
    written: HashMap<(usize, usize), (Vec<f32>, Vec<f32>)>,
}

#[derive(Default)]
struct Model {
    /// Per page: state and current generation.
    states: Vec<PageState>,
    generations: Vec<u64>,
    quarantined: HashMap<RequestId, Vec<PageRef>>,
    granted: u64,
    refused: u64,
    stale: u64,
    foreign: u64,
    reads_refused: u64,
}

impl Model {
    fn count(&self, pred: impl Fn(&PageState) -> bool) -> usize {
        self.states.iter().filter(|s| pred(s)).count()
    }
}

struct Harness {
    pool: Pool,
    model: Model,
    live: Vec<Option<(Lease, ModelLease)>>,
    next_owner: u64,
    next_value: f32,
}

impl Harness {
    fn new(scrub: Scrub, reuse: ReusePolicy) -> Self {
        let spec = PoolSpec::new(SHAPE, PAGE, ElemType::F32, PoolSize::Pages(PAGES))
            .with_scrub(scrub)
            .with_reuse(reuse);
        Harness {
            pool: Pool::new(&spec).unwrap(),
            model: Model {
                states: vec![PageState::Free; PAGES],
                generations: vec![0; PAGES],
                ..Model::default()
            },
            live: (0..SLOTS).map(|_| None).collect(),
            next_owner: 1,
            next_value: 1.0,
        }
    }

    fn fresh_values(&mut self, n: usize) -> Vec<f32> {
        (0..n)
            .map(|_| {
                self.next_value += 1.0;
                self.next_value
            })
            .collect()
    }

    fn apply(&mut self, op: &Op) {
        match *op {
            Op::Lease { slot, tokens } => self.lease(slot, tokens),
            Op::Write {
                slot,
                start,
                len,
                layer,
            } => self.write(slot, start, len, layer),
            Op::WriteStale { slot, page } => self.write_stale(slot, page),
            Op::WriteForeign { slot, page } => self.write_foreign(slot, page),
            Op::Read {
                slot,
                start,
                len,
                layer,
            } => self.read(slot, start, len, layer),
            Op::Slide { slot, keep_from } => self.slide(slot, keep_from),
            Op::Drop { slot, one_sided } => self.drop_lease(slot, one_sided),
            Op::Drain { pick } => self.drain(pick),
        }
    }

    fn lease(&mut self, slot: usize, tokens: usize) {
        if self.live[slot].is_some() {
            return;
        }
        let owner = RequestId(self.next_owner);
        self.next_owner += 1;
        let free = self.model.count(|s| *s == PageState::Free);
        let result = self.pool.lease(owner, tokens);
        let needed = tokens.div_ceil(PAGE);
        match result {
            Ok(lease) => {
                assert!(
                    tokens > 0 && needed <= free,
                    "lease of {tokens} granted with {free} free pages"
                );
                assert_eq!(
                    lease.pages().len(),
                    needed,
                    "all or nothing: exactly the pages needed"
                );
                for page in lease.pages() {
                    let i = page.id.index();
                    assert_eq!(
                        self.model.states[i],
                        PageState::Free,
                        "I1: leased a page that was not free"
                    );
                    assert!(
                        page.generation.0 > self.model.generations[i],
                        "generation must grow on lease"
                    );
                    self.model.generations[i] = page.generation.0;
                    self.model.states[i] = PageState::Leased {
                        owner,
                        generation: page.generation,
                    };
                }
                self.model.granted += 1;
                let pages = lease.pages().to_vec();
                self.live[slot] = Some((
                    lease,
                    ModelLease {
                        owner,
                        pages,
                        first: 0,
                        written: HashMap::new(),
                    },
                ));
            }
            Err(error) => {
                self.model.refused += 1;
                let expected_kind = if tokens == 0 {
                    matches!(error, PoolError::EmptyLease { .. })
                } else if tokens > PAGES * PAGE {
                    matches!(error, PoolError::LargerThanPool { .. })
                } else {
                    assert!(
                        needed > free,
                        "lease of {tokens} refused with {free} free pages: {error}"
                    );
                    matches!(error, PoolError::Exhausted { .. })
                };
                assert!(expected_kind, "wrong refusal for {tokens} tokens: {error}");
            }
        }
    }

    fn write(&mut self, slot: usize, start: usize, len: usize, layer: usize) {
        let k = self.fresh_values(len * PER_TOKEN);
        let v = self.fresh_values(len * PER_TOKEN);
        let Some((lease, model)) = self.live[slot].as_mut() else {
            return;
        };
        let result = lease.write_positions(layer, start, &k, &v);
        if start < model.first {
            assert!(
                matches!(result, Err(PoolError::Released { .. })),
                "I7: a write behind the window: {result:?}"
            );
            return;
        }
        if start + len > model.first + model.pages.len() * PAGE {
            assert!(
                matches!(result, Err(PoolError::BeyondLease { .. })),
                "{result:?}"
            );
            return;
        }
        result.unwrap();
        for t in 0..len {
            let span = t * PER_TOKEN..(t + 1) * PER_TOKEN;
            model.written.insert(
                (layer, start + t),
                (k[span.clone()].to_vec(), v[span].to_vec()),
            );
        }
    }

    fn write_stale(&mut self, slot: usize, page: usize) {
        let Some((lease, model)) = self.live[slot].as_mut() else {
            return;
        };
        let Some(&current) = model.pages.get(page % model.pages.len().max(1)) else {
            return;
        };
        let stale = PageRef {
            id: current.id,
            generation: kvfence_pool::Generation(current.generation.0 - 1),
        };
        let values = vec![-1.0; PER_TOKEN];
        let result = lease.write(stale, 0, 0..1, &values, &values);
        assert!(
            matches!(result, Err(PoolError::StaleGeneration { .. })),
            "I3: {result:?}"
        );
        self.model.stale += 1;
    }

    fn write_foreign(&mut self, slot: usize, page: u32) {
        let Some((lease, model)) = self.live[slot].as_mut() else {
            return;
        };
        if model.pages.iter().any(|p| p.id == PageId(page)) {
            return;
        }
        // Use the page's true current generation: ownership, not the token
        // alone, must stop the write.
        let generation = self
            .model
            .generations
            .get(page as usize)
            .copied()
            .unwrap_or(0);
        let foreign = PageRef {
            id: PageId(page),
            generation: kvfence_pool::Generation(generation),
        };
        let values = vec![-1.0; PER_TOKEN];
        let result = lease.write(foreign, 0, 0..1, &values, &values);
        assert!(
            matches!(result, Err(PoolError::PageNotInLease { .. })),
            "I1/I3: {result:?}"
        );
        self.model.foreign += 1;
    }

    fn slide(&mut self, slot: usize, keep_from: usize) {
        let Some((lease, model)) = self.live[slot].as_mut() else {
            return;
        };
        // Every page before keep_from's goes, the lease then holding from
        // there even if that is past all it held.
        let skip = (keep_from / PAGE).saturating_sub(model.first / PAGE);
        let count = skip.min(model.pages.len());
        // These leases read no shared pages: a slide cannot run short.
        assert_eq!(lease.slide(keep_from), Ok(count));
        for page in model.pages.drain(..count) {
            self.model.states[page.id.index()] = PageState::Free;
        }
        let fresh = &lease.pages()[lease.pages().len() - count..];
        for page in fresh {
            let i = page.id.index();
            assert_eq!(
                self.model.states[i],
                PageState::Free,
                "I1: a slide took a page that was not free"
            );
            assert!(
                page.generation.0 > self.model.generations[i],
                "I3: a page re-leased by a slide keeps its old generation"
            );
            self.model.generations[i] = page.generation.0;
            self.model.states[i] = PageState::Leased {
                owner: model.owner,
                generation: page.generation,
            };
        }
        model.pages.extend_from_slice(fresh);
        model.first += skip * PAGE;
        let first = model.first;
        model.written.retain(|&(_, position), _| position >= first);
        assert_eq!(lease.first_position(), model.first);
        assert_eq!(lease.pages(), model.pages.as_slice());
    }

    fn read(&mut self, slot: usize, start: usize, len: usize, layer: Option<usize>) {
        let Some((lease, model)) = self.live[slot].as_ref() else {
            return;
        };
        let layers: Vec<usize> = match layer {
            Some(l) => vec![l],
            None => (0..SHAPE.layers).collect(),
        };
        let result = match layer {
            Some(l) => lease.read_layer_from::<f32>(l, start, len),
            None => lease.read_view::<f32>(len),
        };
        // A view spans whole pages, from the one holding `start`.
        let end_page = len.div_ceil(PAGE);
        let spanned = (start / PAGE).min(end_page)..end_page;
        let released = !spanned.is_empty() && spanned.start * PAGE < model.first;
        let beyond = len > model.first + model.pages.len() * PAGE;
        let positions = spanned.start * PAGE..len;
        let covered = !released
            && !beyond
            && layers.iter().all(|&l| {
                positions
                    .clone()
                    .all(|p| model.written.contains_key(&(l, p)))
            });
        match result {
            Ok(view) => {
                assert!(
                    covered,
                    "I2: read of {start}..{len} allowed over unwritten or released positions"
                );
                assert_eq!(view.first_page(), spanned.start);
                for &l in &layers {
                    for pos in positions.clone() {
                        let (page, s) = (pos / PAGE, pos % PAGE);
                        let (k, v) = &model.written[&(l, pos)];
                        for head in 0..SHAPE.kv_heads {
                            let d = SHAPE.head_dim;
                            let got_k = &view.keys(page, l, head).to_rows()[s * d..(s + 1) * d];
                            let got_v = &view.values(page, l, head)[s * d..(s + 1) * d];
                            assert_eq!(
                                got_k,
                                &k[head * d..(head + 1) * d],
                                "I2: key bytes differ at {l}/{pos}"
                            );
                            assert_eq!(
                                got_v,
                                &v[head * d..(head + 1) * d],
                                "I2: value bytes differ at {l}/{pos}"
                            );
                        }
                    }
                }
            }
            Err(error) => {
                assert!(!covered, "read of {len} refused although covered: {error}");
                assert_eq!(
                    released,
                    matches!(error, PoolError::Released { .. }),
                    "I7: a read behind the window is refused as released: {error}"
                );
                self.model.reads_refused += 1;
            }
        }
    }

    fn drop_lease(&mut self, slot: usize, one_sided: bool) {
        let Some((mut lease, model)) = self.live[slot].take() else {
            return;
        };
        if one_sided {
            lease.expose_to_one_sided_writer();
        }
        drop(lease);
        for page in &model.pages {
            self.model.states[page.id.index()] = if one_sided {
                PageState::Quarantined {
                    owner: model.owner,
                    generation: page.generation,
                }
            } else {
                PageState::Free
            };
        }
        if one_sided {
            self.model
                .quarantined
                .entry(model.owner)
                .or_default()
                .extend(model.pages);
        }
    }

    fn drain(&mut self, pick: usize) {
        let mut owners: Vec<RequestId> = self.model.quarantined.keys().copied().collect();
        owners.sort();
        // Sometimes an owner with nothing in quarantine.
        let owner = owners
            .get(pick)
            .copied()
            .unwrap_or(RequestId(10_000 + pick as u64));
        let result = self.pool.drain(owner);
        match self.model.quarantined.remove(&owner) {
            Some(pages) => {
                assert_eq!(result, Ok(pages.len()));
                for page in pages {
                    self.model.states[page.id.index()] = PageState::Free;
                }
            }
            None => assert_eq!(result, Err(PoolError::NothingQuarantined { owner })),
        }
    }

    /// I1 and I8 as facts: every page in the state the model says, the
    /// counts add up, the counters match.
    fn check(&self) {
        for (i, expected) in self.model.states.iter().enumerate() {
            let actual = self.pool.page_state(PageId(i as u32)).unwrap();
            assert_eq!(&actual, expected, "I1: page {i} state");
        }
        let stats = self.pool.stats();
        assert_eq!(
            stats.free_pages,
            self.model.count(|s| *s == PageState::Free)
        );
        assert_eq!(
            stats.leased_pages,
            self.model.count(|s| matches!(s, PageState::Leased { .. }))
        );
        assert_eq!(
            stats.quarantined_pages,
            self.model
                .count(|s| matches!(s, PageState::Quarantined { .. }))
        );
        assert_eq!(
            stats.free_pages + stats.leased_pages + stats.quarantined_pages,
            PAGES
        );
        assert_eq!(stats.leases_granted, self.model.granted);
        assert_eq!(stats.leases_refused, self.model.refused);
        assert_eq!(stats.stale_writes_rejected, self.model.stale);
        assert_eq!(stats.foreign_writes_rejected, self.model.foreign);
        assert_eq!(stats.reads_refused, self.model.reads_refused);
    }

    /// I8: ending everything returns the pool to its baseline.
    fn finish(mut self) {
        for slot in 0..SLOTS {
            self.drop_lease(slot, false);
        }
        for owner in self.pool.quarantined_owners() {
            self.pool.drain(owner).unwrap();
        }
        let stats = self.pool.stats();
        assert_eq!(stats.free_pages, PAGES, "I8: pool not back at baseline");
        assert_eq!(stats.leased_pages + stats.quarantined_pages, 0);
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(1000))]

    #[test]
    fn pool_matches_reference_model(
        ops in proptest::collection::vec(op(), 1..60),
        newest_first in any::<bool>(),
        scrub in prop_oneof![Just(Scrub::Off), Just(Scrub::Zero), Just(Scrub::Poison)],
    ) {
        let reuse = if newest_first { ReusePolicy::NewestFreedFirst } else { ReusePolicy::OldestFreedFirst };
        let mut harness = Harness::new(scrub, reuse);
        for op in &ops {
            harness.apply(op);
            harness.check();
        }
        harness.finish();
    }
}

//! The prefix cache's shared pages (I1's `Shared` state) and walls (I9).
//!
//! Every value written is a function of the namespace and of the whole
//! token prefix up to its position — what a model would compute — so a
//! lease that reads anything other than what *its own* prompt would have
//! produced (another tenant's pages, a colliding block, an evicted page's
//! next contents, a shared page written in place) fails an exact compare.

// In a test, a panic is the failure report.
#![allow(clippy::unwrap_used)]

use std::sync::{Arc, Barrier};
use std::thread;

use kvfence_pool::{
    ElemType, KvShape, Lease, Namespace, PageState, Pool, PoolError, PoolSize, PoolSpec, RequestId,
    ReusePolicy,
};
use proptest::prelude::*;

const SHAPE: KvShape = KvShape {
    layers: 2,
    kv_heads: 1,
    head_dim: 2,
};
const PAGE: usize = 4;
const MODEL: &str = "test-model";

fn pool(pages: usize, quota: usize) -> Pool {
    Pool::new(
        &PoolSpec::new(SHAPE, PAGE, ElemType::F32, PoolSize::Pages(pages))
            .with_prefix_cache(quota)
            .with_reuse(ReusePolicy::NewestFreedFirst),
    )
    .unwrap()
}

/// What "the model" writes at `position` of `layer` (K or V, one dim) for
/// this tenant's prompt: a hash of the tenant and every token up to there.
fn value(
    tenant: &str,
    prompt: &[u32],
    position: usize,
    layer: usize,
    kv: usize,
    dim: usize,
) -> f32 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    let mut mix = |x: u64| {
        h ^= x;
        h = h.wrapping_mul(0x0100_0000_01b3);
    };
    tenant.bytes().for_each(|b| mix(u64::from(b)));
    prompt[..=position]
        .iter()
        .for_each(|&t| mix(u64::from(t) + 7));
    [layer, kv, dim].iter().for_each(|&x| mix(x as u64 + 1));
    (h >> 40) as f32
}

/// Writes positions `from..prompt.len()` as the tenant's model would.
fn compute(lease: &mut Lease, tenant: &str, prompt: &[u32], from: usize) {
    for layer in 0..SHAPE.layers {
        let (mut k, mut v) = (Vec::new(), Vec::new());
        for position in from..prompt.len() {
            for dim in 0..SHAPE.head_dim {
                k.push(value(tenant, prompt, position, layer, 0, dim));
                v.push(value(tenant, prompt, position, layer, 1, dim));
            }
        }
        lease.write_positions(layer, from, &k, &v).unwrap();
    }
}

/// Reads back every position of the prompt and compares it with what this
/// tenant's prompt must hold there.
fn holds_own_prompt(lease: &Lease, tenant: &str, prompt: &[u32]) -> bool {
    holds(lease, prompt, |_| tenant)
}

/// Reads back every position of the prompt and compares it with what the
/// prompt must hold there as computed by `writer(position)`.
fn holds<'a>(lease: &Lease, prompt: &[u32], writer: impl Fn(usize) -> &'a str) -> bool {
    let view = lease.read_view::<f32>(prompt.len()).unwrap();
    (0..view.num_pages()).all(|page| {
        (0..SHAPE.layers).all(|layer| {
            let (keys, values) = (
                view.keys(page, layer, 0).to_rows(),
                view.values(page, layer, 0),
            );
            (0..view.slots_in_page(page)).all(|slot| {
                let position = page * PAGE + slot;
                let tenant = writer(position);
                (0..SHAPE.head_dim).all(|dim| {
                    keys[slot * SHAPE.head_dim + dim]
                        == value(tenant, prompt, position, layer, 0, dim)
                        && values[slot * SHAPE.head_dim + dim]
                            == value(tenant, prompt, position, layer, 1, dim)
                })
            })
        })
    })
}

/// One request's whole life in the cache: lease with its prefix, compute
/// what is missing, check it reads its own prompt, seal.
fn run(pool: &Pool, id: u64, ns: &Namespace, tenant: &str, prompt: &[u32]) -> (Lease, usize) {
    let mut lease = pool
        .lease_with_prefix(RequestId(id), prompt.len() + 2, ns, prompt)
        .unwrap();
    let cached = lease.cached_tokens();
    assert!(
        cached < prompt.len(),
        "at least one token is left to compute"
    );
    compute(&mut lease, tenant, prompt, cached);
    // Positions on the public namespace's pages hold what "public" wrote.
    let public = pool.public_namespace(MODEL).id();
    let on_public_page = |position: usize| {
        matches!(
            pool.page_state(lease.pages()[position / PAGE].id),
            Some(PageState::Shared { namespace, .. }) if namespace == public
        )
    };
    assert!(
        holds(&lease, prompt, |p| if on_public_page(p) {
            "public"
        } else {
            tenant
        }),
        "request {id} read KV that is not its prompt's"
    );
    lease.seal(prompt);
    (lease, cached)
}

fn counts_add_up(pool: &Pool) {
    let s = pool.stats();
    assert_eq!(
        s.free_pages + s.leased_pages + s.shared_pages + s.quarantined_pages,
        s.num_pages,
        "I1: every page is in exactly one state: {s:?}"
    );
}

#[test]
fn i1_a_sealed_prefix_is_shared_read_only_within_its_namespace() {
    let pool = pool(16, 16);
    let ns = pool.namespace("a", None, MODEL);
    let prompt: Vec<u32> = (1..=10).collect();
    let (first, cached) = run(&pool, 1, &ns, "a", &prompt);
    assert_eq!(cached, 0);
    drop(first);
    assert!(pool.stats().at_baseline());
    assert_eq!(
        pool.stats().shared_pages,
        2,
        "the prompt's two full pages are sealed"
    );

    let (mut second, cached) = run(&pool, 2, &ns, "a", &prompt);
    assert_eq!(cached, 8, "two whole pages come from the cache");
    assert_eq!(second.shared_pages(), 2);
    let shared = second.pages()[0];
    assert!(matches!(
        pool.page_state(shared.id),
        Some(PageState::Shared { readers: 1, .. })
    ));
    // Nobody writes a shared page, not even a lease that reads it.
    let refused = second.write(shared, 0, 0..1, &[0.0; 2], &[0.0; 2]);
    assert!(
        matches!(refused, Err(PoolError::PageNotInLease { .. })),
        "{refused:?}"
    );
    assert!(holds_own_prompt(&second, "a", &prompt));
    let stats = pool.stats();
    assert_eq!((stats.cache_hits, stats.cache_hit_tokens), (1, 8));
    counts_add_up(&pool);
    drop(second);
    assert!(pool.stats().at_baseline());
}

#[test]
fn i9_another_tenant_or_salt_never_hits() {
    let pool = pool(16, 16);
    let prompt: Vec<u32> = (1..=10).collect();
    let a = pool.namespace("a", None, MODEL);
    drop(run(&pool, 1, &a, "a", &prompt));
    for (id, (tenant, salt, model)) in [
        ("b", None, MODEL),
        ("a", Some("s"), MODEL),
        ("a", None, "other"),
    ]
    .into_iter()
    .enumerate()
    {
        let ns = pool.namespace(tenant, salt, model);
        assert_ne!(ns.id(), a.id());
        let (lease, cached) = run(&pool, 10 + id as u64, &ns, tenant, &prompt);
        assert_eq!(cached, 0, "{tenant}/{salt:?}/{model} hit tenant a's prefix");
        drop(lease);
    }
    // The tenant's own salt subdivides: a salted prefix serves the salt only.
    let salted = pool.namespace("a", Some("s"), MODEL);
    assert_eq!(run(&pool, 20, &salted, "a", &prompt).1, 8);
}

#[test]
fn i9_a_colliding_hash_is_not_a_hit_unless_the_tokens_match() {
    let pool = Pool::new(
        &PoolSpec::new(SHAPE, PAGE, ElemType::F32, PoolSize::Pages(16))
            .with_prefix_cache(16)
            .with_colliding_hashes(),
    )
    .unwrap();
    let ns = pool.namespace("a", None, MODEL);
    drop(run(&pool, 1, &ns, "a", &[1, 2, 3, 4, 5, 6, 7, 8, 9]));
    // Same length, same parent, different tokens: the hash collides.
    let (_, cached) = run(&pool, 2, &ns, "a", &[9, 9, 9, 9, 5, 6, 7, 8, 9]);
    assert_eq!(
        cached, 0,
        "a hash match without equal tokens was taken as a hit"
    );
}

#[test]
fn i1_a_match_ending_inside_a_page_copies_it_and_the_original_stays_intact() {
    let pool = pool(16, 16);
    let ns = pool.namespace("a", None, MODEL);
    let first: Vec<u32> = (1..=9).collect();
    drop(run(&pool, 1, &ns, "a", &first));
    // Shares page 0, then matches two tokens of page 1 and diverges.
    let second = [1, 2, 3, 4, 5, 6, 70, 80, 90];
    let mut lease = pool
        .lease_with_prefix(RequestId(2), 10, &ns, &second)
        .unwrap();
    assert_eq!(lease.cached_tokens(), 6);
    assert_eq!(
        lease.shared_pages(),
        1,
        "the partly matched page is a copy of its own"
    );
    compute(&mut lease, "a", &second, 6);
    assert!(holds_own_prompt(&lease, "a", &second));
    drop(lease);
    // The original's second page still holds the first prompt.
    let (lease, cached) = run(&pool, 3, &ns, "a", &first);
    assert_eq!(cached, 8);
    drop(lease);
    counts_add_up(&pool);
}

#[test]
fn i1_an_evicted_page_is_never_reached_through_the_index() {
    // Four pages: a 9-token prompt with 2 extra tokens needs three.
    let pool = pool(4, 4);
    let ns = pool.namespace("a", None, MODEL);
    let first: Vec<u32> = (1..=9).collect();
    drop(run(&pool, 1, &ns, "a", &first));
    assert_eq!(pool.stats().shared_pages, 2);
    // A different prompt needs three pages: one free, two evicted.
    let other: Vec<u32> = (100..109).collect();
    drop(run(&pool, 2, &ns, "a", &other));
    assert!(pool.stats().cache_evictions >= 1);
    // The first prompt's entries are gone with their pages, even though the
    // pages now hold the other prompt's sealed blocks.
    let (lease, cached) = run(&pool, 3, &ns, "a", &first);
    assert!(cached <= 4, "an evicted block was served: {cached} tokens");
    drop(lease);
    counts_add_up(&pool);
}

#[test]
fn i9_a_tenant_flooding_the_cache_evicts_its_own_entries_not_anothers() {
    let pool = pool(32, 4);
    let b = pool.namespace("b", None, MODEL);
    let b_prompt: Vec<u32> = (1..=9).collect();
    drop(run(&pool, 1, &b, "b", &b_prompt));
    let a = pool.namespace("a", None, MODEL);
    for i in 0..20u32 {
        let prompt: Vec<u32> = (0..9).map(|t| 1000 + i * 10 + t).collect();
        drop(run(&pool, 10 + u64::from(i), &a, "a", &prompt));
        assert!(
            pool.stats().shared_pages <= 4 + 2,
            "a tenant exceeded its quota"
        );
    }
    assert_eq!(
        run(&pool, 99, &b, "b", &b_prompt).1,
        8,
        "b's entries were pushed out"
    );
}

#[test]
fn i6_a_lease_evicts_idle_pages_but_never_read_ones() {
    let pool = pool(4, 4);
    let ns = pool.namespace("a", None, MODEL);
    let prompt: Vec<u32> = (1..=9).collect();
    let (reader, _) = run(&pool, 1, &ns, "a", &prompt);
    // Two pages are shared and read, one is the reader's own: one free.
    let refused = pool.lease(RequestId(2), 8);
    assert!(
        matches!(refused, Err(PoolError::Exhausted { .. })),
        "{refused:?}"
    );
    assert!(holds_own_prompt(&reader, "a", &prompt));
    drop(reader);
    let lease = pool.lease(RequestId(3), 16).unwrap();
    assert_eq!(pool.stats().shared_pages, 0, "idle pages make room");
    drop(lease);
    assert!(pool.stats().at_baseline());
}

/// A pool whose public matches count from 8 tokens (two pages), holding
/// the public prefix `1..=12` (three pages) computed as "public" would.
fn pool_with_public_prefix(pages: usize, quota: usize) -> (Pool, Vec<u32>) {
    let pool = Pool::new(
        &PoolSpec::new(SHAPE, PAGE, ElemType::F32, PoolSize::Pages(pages))
            .with_prefix_cache(quota)
            .with_public_min_tokens(8)
            .with_reuse(ReusePolicy::NewestFreedFirst),
    )
    .unwrap();
    let public = pool.public_namespace(MODEL);
    assert!(public.is_public());
    let prefix: Vec<u32> = (1..=12).collect();
    // A lease holds the prefix plus one token, so all three pages seal.
    let mut with_end = prefix.clone();
    with_end.push(99);
    let (mut lease, cached) = run(&pool, 1, &public, "public", &with_end);
    assert_eq!(cached, 0);
    assert_eq!(lease.seal(&prefix), 0, "run sealed every full page already");
    drop(lease);
    (pool, prefix)
}

#[test]
fn i9_public_prefix_pages_are_read_by_every_tenant_and_never_take_their_pages() {
    let (pool, prefix) = pool_with_public_prefix(32, 8);
    let stats = pool.stats();
    assert_eq!(stats.pinned_shared_pages, 3);
    assert_eq!(stats.idle_shared_pages, 0, "public pages are not evictable");
    assert!(stats.at_baseline(), "{stats:?}");
    assert_eq!(
        pool.capacity_tokens(),
        (32 - 3) * PAGE,
        "pinned pages are not capacity a request can have"
    );
    let mut prompt = prefix.clone();
    prompt.extend([100, 101, 102, 103, 104]);
    let from_public = |position: usize| if position < 12 { "public" } else { "" };
    for (id, tenant) in [(10, "a"), (11, "b")] {
        let ns = pool.namespace(tenant, None, MODEL);
        let mut lease = pool
            .lease_with_prefix(RequestId(id), prompt.len() + 1, &ns, &prompt)
            .unwrap();
        assert_eq!(
            lease.cached_tokens(),
            12,
            "{tenant} reads the public prefix"
        );
        compute(&mut lease, tenant, &prompt, 12);
        assert!(holds(&lease, &prompt, |p| match from_public(p) {
            "" => tenant,
            public => public,
        }));
        // What the tenant sealed after the public pages is its own.
        assert_eq!(lease.seal(&prompt), 1);
        let own = lease.pages()[3];
        assert!(
            matches!(pool.page_state(own.id), Some(PageState::Shared { namespace, .. }) if namespace == ns.id()),
            "a tenant's page went into another namespace"
        );
    }
    // A tenant's own page goes on from the public ones, for it alone.
    let a = pool.namespace("a", None, MODEL);
    let (lease, cached) = run(&pool, 20, &pool.namespace("c", None, MODEL), "c", &prompt);
    assert_eq!(
        cached, 12,
        "tenant c got another tenant's page after the public ones"
    );
    drop(lease);
    let mut lease = pool
        .lease_with_prefix(RequestId(21), prompt.len() + 1, &a, &prompt)
        .unwrap();
    assert_eq!(lease.cached_tokens(), 16);
    compute(&mut lease, "a", &prompt, 16);
    assert!(holds(&lease, &prompt, |p| if p < 12 {
        "public"
    } else {
        "a"
    }));
    drop(lease);

    // A flood evicts idle pages, never the public ones.
    let flood = pool.namespace("flood", None, MODEL);
    for i in 0..40u32 {
        let prompt: Vec<u32> = (0..9).map(|t| 5000 + i * 10 + t).collect();
        drop(run(&pool, 100 + u64::from(i), &flood, "flood", &prompt));
    }
    assert!(
        pool.stats().cache_evictions > 0,
        "the flood evicted nothing"
    );
    assert_eq!(pool.stats().pinned_shared_pages, 3);
    let (lease, cached) = run(&pool, 200, &pool.namespace("d", None, MODEL), "d", &prompt);
    assert_eq!(cached, 12);
    drop(lease);
    counts_add_up(&pool);
    assert!(pool.stats().at_baseline());
}

#[test]
fn i9_a_public_match_shorter_than_the_minimum_is_computed_privately() {
    let (pool, _) = pool_with_public_prefix(32, 8);
    let ns = pool.namespace("a", None, MODEL);
    // Seven tokens of the public prefix (one page and three slots), then not.
    let prompt = [1, 2, 3, 4, 5, 6, 7, 50, 51, 52];
    let (lease, cached) = run(&pool, 10, &ns, "a", &prompt);
    assert_eq!(cached, 0, "a public match under the minimum was taken");
    drop(lease);
    // What it computed is its own cache now, and only its own.
    assert_eq!(run(&pool, 11, &ns, "a", &prompt).1, 8);
    let b = pool.namespace("b", None, MODEL);
    assert_eq!(run(&pool, 12, &b, "b", &prompt).1, 0);
}

#[test]
fn i9_the_public_namespace_is_no_tenants_and_has_a_quota() {
    let (pool, prefix) = pool_with_public_prefix(32, 4);
    let public = pool.public_namespace(MODEL);
    for tenant in ["", "public"] {
        assert_ne!(pool.namespace(tenant, None, MODEL).id(), public.id());
        assert!(!pool.namespace(tenant, None, MODEL).is_public());
    }
    // The quota is four pages: a second public prefix seals one more.
    let second: Vec<u32> = (200..=216).collect();
    let (lease, _) = run(&pool, 2, &public, "public", &second);
    drop(lease);
    assert_eq!(pool.stats().pinned_shared_pages, 4);
    let ns = pool.namespace("a", None, MODEL);
    let mut prompt = prefix;
    prompt.push(7);
    assert_eq!(run(&pool, 3, &ns, "a", &prompt).1, 12);
}

#[derive(Debug, Clone)]
enum Op {
    Lease {
        tenant: usize,
        prompt: Vec<u32>,
        extra: usize,
    },
    Drop(usize),
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        3 => (0..2usize, prop::collection::vec(0..3u32, 1..14), 0..4usize)
            .prop_map(|(tenant, prompt, extra)| Op::Lease { tenant, prompt, extra }),
        2 => (0..8usize).prop_map(Op::Drop),
    ]
}

proptest! {
    /// Random lease / seal / share / evict sequences over a small pool with
    /// two tenants and a three-letter alphabet (so prefixes repeat): every
    /// lease reads exactly its own prompt's values, pages add up, and the
    /// pool is back at baseline at the end (I1, I2, I8, I9).
    #[test]
    fn shared_pages_match_the_reference(ops in prop::collection::vec(op(), 1..60)) {
        let pool = pool(12, 6);
        let tenants = ["a", "b"];
        let spaces: Vec<Namespace> = tenants.iter().map(|t| pool.namespace(t, None, MODEL)).collect();
        let mut held: Vec<(Lease, usize, Vec<u32>)> = Vec::new();
        for (n, op) in ops.into_iter().enumerate() {
            match op {
                Op::Lease { tenant, prompt, extra } => {
                    let lease = pool.lease_with_prefix(RequestId(n as u64 + 1), prompt.len() + extra, &spaces[tenant], &prompt);
                    let Ok(mut lease) = lease else { continue };
                    let cached = lease.cached_tokens();
                    // The reference: a hit never exceeds the longest prefix
                    // some same-tenant prompt ever had in full pages.
                    prop_assert!(cached < prompt.len());
                    compute(&mut lease, tenants[tenant], &prompt, cached);
                    prop_assert!(holds_own_prompt(&lease, tenants[tenant], &prompt));
                    lease.seal(&prompt);
                    held.push((lease, tenant, prompt));
                }
                Op::Drop(i) if i < held.len() => { held.swap_remove(i); }
                Op::Drop(_) => {}
            }
            for (lease, tenant, prompt) in &held {
                prop_assert!(holds_own_prompt(lease, tenants[*tenant], prompt));
            }
            counts_add_up(&pool);
            prop_assert!(pool.stats().shared_pages <= 12);
        }
        drop(held);
        prop_assert!(pool.stats().at_baseline());
    }
}

#[test]
fn concurrent_readers_and_evictors_each_read_their_own_prompt() {
    let pool = pool(24, 12);
    let threads = 6;
    let barrier = Arc::new(Barrier::new(threads));
    let workers: Vec<_> = (0..threads)
        .map(|t| {
            let (pool, barrier) = (pool.clone(), Arc::clone(&barrier));
            thread::spawn(move || {
                let tenant = ["a", "b"][t % 2];
                let ns = pool.namespace(tenant, None, MODEL);
                barrier.wait();
                let mut state = 0x9E37_79B9u64 + t as u64;
                for round in 0..2000u64 {
                    state ^= state << 13;
                    state ^= state >> 7;
                    state ^= state << 17;
                    // Twelve families of prompts: they repeat, so pages are
                    // shared, and they outgrow the pool, so pages are
                    // evicted while other threads read others.
                    let len = 5 + (state % 8) as usize;
                    let family = (state >> 8) as u32 % 12;
                    let prompt: Vec<u32> =
                        (0..len as u32).map(|i| (i * 5 + family * 3) % 7).collect();
                    let id = RequestId((t as u64) << 32 | round);
                    let Ok(mut lease) = pool.lease_with_prefix(id, len + 1, &ns, &prompt) else {
                        continue;
                    };
                    let cached = lease.cached_tokens();
                    compute(&mut lease, tenant, &prompt, cached);
                    assert!(
                        holds_own_prompt(&lease, tenant, &prompt),
                        "thread {t} read another prompt's KV"
                    );
                    lease.seal(&prompt);
                    assert!(holds_own_prompt(&lease, tenant, &prompt));
                }
            })
        })
        .collect();
    for worker in workers {
        worker.join().unwrap();
    }
    let stats = pool.stats();
    assert!(stats.at_baseline(), "{stats:?}");
    assert!(
        stats.cache_hits > 0 && stats.cache_evictions > 0,
        "the test shared and evicted: {stats:?}"
    );
    counts_add_up(&pool);
}

#[test]
fn i1_a_lease_grows_page_by_page_evicting_idle_pages_and_never_read_ones() {
    let pool = pool(4, 4);
    let ns = pool.namespace("a", None, MODEL);
    let prompt: Vec<u32> = (1..=9).collect();
    drop(run(&pool, 1, &ns, "a", &prompt));
    // Two idle shared pages, two free ones.
    let mut lease = pool.lease(RequestId(2), 4).unwrap();
    lease.grow(1).unwrap();
    assert_eq!(lease.capacity_tokens(), 8);
    lease.write_positions(0, 4, &[1.0; 8], &[2.0; 8]).unwrap();
    // The rest comes from the cache, evicted.
    lease.grow(2).unwrap();
    assert_eq!(pool.stats().shared_pages, 0);
    assert!(matches!(lease.grow(1), Err(PoolError::Exhausted { .. })));
    counts_add_up(&pool);
    drop(lease);
    assert!(pool.stats().at_baseline());
}

#[test]
fn i6_a_copy_source_never_keeps_a_lease_out_of_a_tight_pool() {
    let first: Vec<u32> = (1..=13).collect();
    // Matches the first cached page whole and two tokens of the second.
    let second: Vec<u32> = [&first[..6], &[50; 10][..]].concat();
    for (pages, cached) in [(8, 6), (4, 4)] {
        let pool = pool(pages, pages);
        let ns = pool.namespace("a", None, MODEL);
        drop(run(&pool, 1, &ns, "a", &first));
        // With room, the second page is copied from; with every page but
        // one idle in the cache, copying would leave the lease a page
        // short, so it copies nothing and still gets its pages.
        let lease = pool
            .lease_with_prefix(RequestId(2), 16, &ns, &second)
            .unwrap();
        assert_eq!(lease.cached_tokens(), cached, "{pages} pages");
        drop(lease);
        counts_add_up(&pool);
    }
}

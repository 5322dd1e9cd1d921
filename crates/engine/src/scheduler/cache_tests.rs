//! The prefix cache through the scheduler, driven command by command: with
//! the cache, every answer is bit-identical to the answer without it (batch
//! and chunk invariance make that exact), whatever is shared, copied or
//! evicted; and what a request reports as cached is its own tenant's.

// In a test, a panic is the failure report.
#![allow(clippy::unwrap_used)]

use std::sync::Arc;
use std::time::Instant;

use kvfence_model::LoadedModel;
use kvfence_pool::{ElemType, Pool, PoolSize, PoolSpec, RequestId, ReusePolicy, Scrub};

use super::{Pending, Role, Scheduler};
use crate::config::EngineConfig;
use crate::counters::Counters;
use crate::request::{CacheScope, Event, GenerationRequest, RequestHandle, Share, Usage};

const PAGE: usize = 16;

use crate::testing::tiny_model as model;

/// How the pool under test is built.
#[derive(Clone, Copy)]
enum Cache {
    Off,
    On,
    /// Every block hash of a length after the same parent collides.
    Colliding,
}

struct Worker {
    scheduler: Scheduler,
    pool: Pool,
    next_id: u64,
}

fn worker(cache: Cache, tokens: usize, step_tokens: usize) -> Worker {
    worker_of(model(), Keep::Everything, cache, tokens, step_tokens)
}

/// What the pool keeps of sliding-window layers.
#[derive(Clone, Copy)]
enum Keep {
    Everything,
    Windows,
}

fn worker_of(
    model: Arc<LoadedModel>,
    keep: Keep,
    cache: Cache,
    tokens: usize,
    step_tokens: usize,
) -> Worker {
    let config = EngineConfig {
        step_tokens,
        ..EngineConfig::default()
    };
    let mut spec = PoolSpec::new(
        model.model.kv_shape(),
        PAGE,
        ElemType::F32,
        PoolSize::Tokens(tokens),
    )
    .with_scrub(Scrub::Poison)
    .with_reuse(ReusePolicy::NewestFreedFirst);
    if let Keep::Windows = keep {
        spec = spec.with_layer_groups(model.model.layer_groups(config.longest_write()).unwrap());
    }
    let pages = spec.geometry().unwrap().num_pages;
    spec = match cache {
        Cache::Off => spec,
        Cache::On => spec.with_prefix_cache(pages),
        Cache::Colliding => spec.with_prefix_cache(pages).with_colliding_hashes(),
    };
    let pool = Pool::new(&spec).unwrap();
    let scheduler = Scheduler::new(
        Role::Colocated,
        model,
        pool.clone(),
        config,
        Arc::new(Counters::default()),
    );
    Worker {
        scheduler,
        pool,
        next_id: 1,
    }
}

fn request(tenant: &str, prompt: Vec<u32>, max_tokens: usize) -> GenerationRequest {
    GenerationRequest {
        ignore_eos: true,
        cache: Some(CacheScope::tenant(tenant, None)),
        share: Share::new(tenant, 1),
        ..GenerationRequest::greedy(prompt, max_tokens)
    }
}

impl Worker {
    /// Requests preempted so far.
    fn preempted(&self) -> u64 {
        self.scheduler
            .counters
            .preempted
            .load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Submits every request in one go (they meet in one admission pass)
    /// and steps until all have ended; their texts and usage, in order.
    fn run(&mut self, requests: &[GenerationRequest]) -> Vec<(String, Usage)> {
        self.run_counting_peak(requests).0
    }

    /// [`Worker::run`], also saying how many requests ran at once at most.
    fn run_counting_peak(
        &mut self,
        requests: &[GenerationRequest],
    ) -> (Vec<(String, Usage)>, usize) {
        let mut peak = 0;
        let mut handles: Vec<RequestHandle> = requests
            .iter()
            .map(|request| {
                let id = RequestId(self.next_id);
                self.next_id += 1;
                let (pending, handle) = Pending::for_client(id, request.clone(), None);
                self.scheduler.submit(pending);
                handle
            })
            .collect();
        let mut answers: Vec<Option<(String, Usage)>> = vec![None; requests.len()];
        let mut texts = vec![String::new(); requests.len()];
        for _ in 0..10_000 {
            self.scheduler.poll_delivering(Instant::now());
            peak = peak.max(self.scheduler.active.len());
            for (i, handle) in handles.iter_mut().enumerate() {
                while let Ok(event) = handle.try_next() {
                    match event {
                        Event::Token { text, .. } => texts[i].push_str(&text),
                        Event::Finished { usage, .. } => {
                            answers[i] = Some((std::mem::take(&mut texts[i]), usage));
                        }
                        Event::Failed { message, .. } => panic!("request {i} failed: {message}"),
                        Event::Prompt { .. } => panic!("request {i} did not ask for scores"),
                    }
                }
            }
            if answers.iter().all(Option::is_some) {
                let stats = self.pool.stats();
                assert!(stats.at_baseline(), "I8: {stats:?}");
                return (answers.into_iter().map(Option::unwrap).collect(), peak);
            }
        }
        panic!("requests never finished");
    }
}

/// Prompts that share prefixes in every way the cache distinguishes: a
/// long common system prompt, matches ending on and inside page
/// boundaries, exact repeats, a prompt that is all cached pages, and a
/// conversation's next turn (the last answer's tokens followed by more).
fn family() -> Vec<Vec<u32>> {
    let system: Vec<u32> = (0..40).map(|i| (i * 11 + 3) % 250).collect();
    let with = |tail: &[u32]| [system.as_slice(), tail].concat();
    vec![
        with(&[1, 2, 3]),
        with(&[1, 2, 3]),
        with(&[1, 2, 9, 9, 9, 9, 9, 9, 9, 9]),
        system[..32].to_vec(),
        system[..32].to_vec(),
        with(&(0..30).collect::<Vec<_>>()),
        with(
            &(0..30)
                .map(|t| if t == 20 { 99 } else { t })
                .collect::<Vec<_>>(),
        ),
        system[..5].to_vec(),
        with(&(0..30).collect::<Vec<_>>()),
    ]
}

fn answers(
    cache: Cache,
    pool_tokens: usize,
    step_tokens: usize,
    tenant_of: impl Fn(usize) -> &'static str,
) -> Vec<(String, Usage)> {
    let mut worker = worker(cache, pool_tokens, step_tokens);
    let prompts = family();
    let mut out = Vec::new();
    // One at a time (each sees everything sealed before), then all at once.
    for (i, prompt) in prompts.iter().enumerate() {
        out.extend(worker.run(&[request(tenant_of(i), prompt.clone(), 12)]));
    }
    let all: Vec<_> = prompts
        .iter()
        .enumerate()
        .map(|(i, p)| request(tenant_of(i), p.clone(), 12))
        .collect();
    out.extend(worker.run(&all));
    out
}

fn texts(answers: &[(String, Usage)]) -> Vec<&str> {
    answers.iter().map(|(t, _)| t.as_str()).collect()
}

#[test]
fn i2_answers_with_the_prefix_cache_are_bit_identical_to_answers_without_it() {
    let reference = answers(Cache::Off, 4096, 256, |_| "a");
    assert!(reference.iter().all(|(_, u)| u.cached_tokens == 0));
    // A roomy pool, prompts prefilled in small chunks.
    let cached = answers(Cache::On, 4096, 7, |_| "a");
    assert_eq!(texts(&cached), texts(&reference));
    let hits: usize = cached.iter().map(|(_, u)| u.cached_tokens).sum();
    assert!(hits > 200, "the cache was hardly used: {hits} tokens");
    // A pool so small that cached pages are evicted and reused all along.
    let tight = answers(Cache::On, 16 * 16, 256, |_| "a");
    assert_eq!(texts(&tight), texts(&reference));
}

#[test]
fn i1_evicted_pages_are_never_read_through_a_stale_entry() {
    // Distinct prompts cycling through a pool of 12 pages: every page is
    // cached, evicted, re-leased and sealed with other tokens over and over,
    // and each prompt comes back after its pages have moved on.
    let prompts: Vec<Vec<u32>> = (0..6u32)
        .map(|k| (0..40).map(|i| (i * 13 + k * 29 + 1) % 250).collect())
        .collect();
    let run = |cache| {
        let mut worker = worker(cache, 12 * PAGE, 256);
        let mut out = Vec::new();
        for round in 0..3 {
            for k in 0..prompts.len() {
                // Forwards, backwards, forwards: every reuse order.
                let k = if round == 1 { prompts.len() - 1 - k } else { k };
                out.extend(worker.run(&[request("a", prompts[k].clone(), 12)]));
            }
        }
        (out, worker.pool.stats())
    };
    let (reference, _) = run(Cache::Off);
    let (cached, stats) = run(Cache::On);
    assert!(
        stats.cache_evictions > 10 && stats.cache_hits > 0,
        "{stats:?}"
    );
    assert_eq!(texts(&cached), texts(&reference));
}

#[test]
fn i9_a_hit_is_taken_only_after_comparing_tokens() {
    let reference = answers(Cache::Off, 4096, 256, |_| "a");
    let colliding = answers(Cache::Colliding, 4096, 256, |_| "a");
    assert_eq!(texts(&colliding), texts(&reference));
}

#[test]
fn i9_tenants_never_read_each_others_prefixes() {
    let mut worker = worker(Cache::On, 4096, 256);
    let prompt = family()[5].clone();
    let a = worker.run(&[request("a", prompt.clone(), 4)]);
    assert_eq!(a[0].1.cached_tokens, 0);
    let b = worker.run(&[request("b", prompt.clone(), 4)]);
    assert_eq!(b[0].1.cached_tokens, 0, "tenant b hit tenant a's prefix");
    let again = worker.run(&[request("a", prompt.clone(), 4)]);
    assert_eq!(again[0].1.cached_tokens, 64, "the tenant's own repeat hits");
    let mut salted = request("a", prompt, 4);
    salted.cache = Some(CacheScope::tenant("a", Some("s".into())));
    assert_eq!(
        worker.run(&[salted])[0].1.cached_tokens,
        0,
        "a salt subdivides the tenant"
    );
}

#[test]
fn i9_cached_tokens_count_only_the_requests_own_hits() {
    let mut worker = worker(Cache::On, 4096, 256);
    let prompt = family()[5].clone();
    worker.run(&[request("a", prompt.clone(), 4)]);
    // Tenant a's repeat and tenant b's fresh prompt meet in one admission
    // pass: b must see none of a's hit.
    let fresh: Vec<u32> = (0..70).map(|i| (i * 5 + 1) % 250).collect();
    let both = worker.run(&[request("a", prompt, 4), request("b", fresh, 4)]);
    assert_eq!(both[0].1.cached_tokens, 64);
    assert_eq!(both[1].1.cached_tokens, 0, "b's usage counted a's hit");
}

/// An 80-token system prompt (five pages) every tenant's prompt begins with.
fn system_prompt() -> Vec<u32> {
    (0..80).map(|i| (i * 11 + 3) % 250).collect()
}

fn public_request(prompt: Vec<u32>, max_tokens: usize) -> GenerationRequest {
    GenerationRequest {
        cache: Some(CacheScope::Public),
        ..request("", prompt, max_tokens)
    }
}

#[test]
fn i9_a_public_prefix_serves_every_tenant_and_answers_stay_bit_identical() {
    let system = system_prompt();
    let asks = |tenant: &str, tail: u32| {
        let own = (0..12).map(|t| (t * 13 + tail) % 250);
        request(tenant, system.iter().copied().chain(own).collect(), 6)
    };
    let mut worker = worker(Cache::On, 4096, 256);
    worker.run(&[public_request(system.clone(), 1)]);
    assert_eq!(worker.pool.public_prefix_tokens(&model().name, &system), 80);
    assert_eq!(worker.pool.stats().pinned_shared_pages, 5);
    let got = worker.run(&[asks("a", 1), asks("b", 2)]);
    for (_, usage) in &got {
        assert_eq!(
            usage.cached_tokens, 80,
            "every tenant reads the public pages"
        );
    }
    let want = answers_of(Cache::Off, &[asks("a", 1), asks("b", 2)]);
    assert_eq!(texts(&got), texts(&want));
    // What tenant a sealed after the public pages is a's alone.
    let again = worker.run(&[asks("a", 1), asks("c", 1)]);
    assert_eq!(again[0].1.cached_tokens, 80 + 12 - 1);
    assert_eq!(again[1].1.cached_tokens, 80, "c read a's page");
    assert_eq!(texts(&again), [texts(&want)[0]; 2]);
}

#[test]
fn i9_a_public_request_seals_its_prompt_and_never_its_completion() {
    let mut worker = worker(Cache::On, 4096, 256);
    // 70 tokens: four full pages; with 30 completion tokens the whole
    // conversation would fill six.
    let prompt: Vec<u32> = (0..70).map(|i| (i * 3 + 2) % 250).collect();
    worker.run(&[public_request(prompt, 30)]);
    let stats = worker.pool.stats();
    assert_eq!((stats.pinned_shared_pages, stats.shared_pages), (4, 4));
}

/// What a fresh worker with `cache` answers to `requests`, all at once.
fn answers_of(cache: Cache, requests: &[GenerationRequest]) -> Vec<(String, Usage)> {
    worker(cache, 4096, 256).run(requests)
}

#[test]
fn a_finished_request_seals_its_completion_for_the_next_turn() {
    let mut worker = worker(Cache::On, 4096, 256);
    let prompt: Vec<u32> = (0..20).map(|i| (i * 3 + 2) % 250).collect();
    worker.run(&[request("a", prompt.clone(), 1)]);
    // 20 prompt tokens: one full page.
    assert_eq!(worker.pool.stats().shared_pages, 1);
    let other: Vec<u32> = (0..20).map(|i| (i * 7 + 1) % 250).collect();
    worker.run(&[request("a", other, 30)]);
    // 20 prompt tokens and 29 written completion tokens (the last one's KV
    // is never computed): three more full pages, ready for a next turn
    // that repeats the conversation so far.
    assert_eq!(worker.pool.stats().shared_pages, 1 + 3);
}

/// Eight requests of a 20-token prompt and `max_tokens` completion tokens
/// each, greedy and sampled.
fn crowd(max_tokens: usize) -> Vec<GenerationRequest> {
    (0..8u32)
        .map(|i| {
            let prompt = (0..20).map(|t| (t * 7 + i * 31) % 250).collect();
            let mut request = request("a", prompt, max_tokens);
            if i % 2 == 1 {
                request.sampling.temperature = 0.8;
                request.sampling.seed = u64::from(i);
            }
            request
        })
        .collect()
}

#[test]
fn i8_a_pool_too_small_for_everyone_grows_lazily_preempts_and_answers_exactly() {
    // 60 completion tokens each: five pages, all reserved up front, so
    // twelve pages would hold two at once.
    let mut reference = worker(Cache::Off, 4096, 256);
    let expected = reference.run(&crowd(60));
    for cache in [Cache::Off, Cache::On] {
        let mut small = worker(cache, 12 * PAGE, 256);
        let (got, peak) = small.run_counting_peak(&crowd(60));
        assert_eq!(
            texts(&got),
            texts(&expected),
            "a preempted request answered differently"
        );
        assert!(
            got.iter().all(|(_, u)| u.completion_tokens == 60),
            "every request ran to its end"
        );
        assert!(small.preempted() > 0, "the pool was meant to run out");
        assert!(
            peak > 2,
            "lazy growth ran {peak} at once, what up-front reservation allows"
        );
    }
}

/// A model with sliding-window layers on a pool that keeps only their
/// windows: every answer — prompts longer than the window, prefilled in
/// small or large chunks, alone and together, with and without the prefix
/// cache — is the answer of a pool that keeps every position, and the pool
/// ends at baseline (I8). A prompt cached past the window starts from its
/// global pages and the window's pages behind the match.
#[test]
fn i2_windows_only_answer_bit_for_bit_as_full_kv_does() {
    let model = crate::testing::windowed_model();
    let run = |keep: Keep, cache: Cache, step_tokens: usize| {
        let mut worker = worker_of(Arc::clone(&model), keep, cache, 4096, step_tokens);
        let mut prompts = family();
        // Longer than the window (40), an attention chunk (128) and the
        // pages a window's group holds (448 positions at 256 a step).
        prompts.push((0..600).map(|i| (i * 7 + 1) % 250).collect());
        prompts.push((0..600).map(|i| (i * 7 + 1) % 250).collect());
        let mut out = Vec::new();
        for prompt in &prompts {
            out.extend(worker.run(&[request("a", prompt.clone(), 50)]));
        }
        let all: Vec<_> = prompts
            .iter()
            .map(|p| request("a", p.clone(), 50))
            .collect();
        out.extend(worker.run(&all));
        out
    };
    let reference = run(Keep::Everything, Cache::Off, 256);
    for (cache, step_tokens) in [
        (Cache::Off, 256),
        (Cache::Off, 7),
        (Cache::On, 256),
        (Cache::On, 7),
    ] {
        let windowed = run(Keep::Windows, cache, step_tokens);
        assert_eq!(texts(&windowed), texts(&reference), "step of {step_tokens}");
        let hits: usize = windowed.iter().map(|(_, u)| u.cached_tokens).sum();
        assert_eq!(hits > 0, matches!(cache, Cache::On), "{hits} cached tokens");
        // The second long prompt reads the first's pages: its global layers
        // from position 0, its windows behind the match's end.
        let long = family().len() + 1;
        assert_eq!(
            windowed[long].1.cached_tokens > 500,
            matches!(cache, Cache::On),
            "{:?}",
            windowed[long].1
        );
        for ((_, got), (_, want)) in windowed.iter().zip(&reference) {
            assert_eq!(
                (got.prompt_tokens, got.completion_tokens),
                (want.prompt_tokens, want.completion_tokens)
            );
        }
    }
}

/// The same memory holds a longer context when windows keep only what
/// they read: a pool of 4,096 tokens of full KV advertises more, and a
/// request of that length runs to the end.
#[test]
fn i6_windows_only_advertise_the_context_their_pages_hold() {
    let model = crate::testing::windowed_model();
    let full = worker_of(Arc::clone(&model), Keep::Everything, Cache::Off, 1024, 256);
    let bytes = full.pool.geometry().capacity_bytes();
    let config = EngineConfig::default();
    let spec = PoolSpec::new(
        model.model.kv_shape(),
        PAGE,
        ElemType::F32,
        PoolSize::Bytes(bytes),
    )
    .with_layer_groups(model.model.layer_groups(config.longest_write()).unwrap());
    let pool = Pool::new(&spec).unwrap();
    assert!(pool.geometry().capacity_bytes() <= bytes);
    assert_eq!(full.pool.capacity_tokens(), 1024);
    assert!(
        pool.capacity_tokens() > 1024 * 3 / 2,
        "{} tokens in the memory of 1,024",
        pool.capacity_tokens()
    );
    let pages = pool.geometry().num_pages;
    assert!(pool.pages_for(pool.capacity_tokens()) <= pages);
    assert!(
        pool.pages_for(pool.capacity_tokens() + PAGE) > pages,
        "the capacity is the longest context the pages hold"
    );
}

/// Windows that slide while a pool too small for everyone preempts: eight
/// requests of 320 positions (past the 256 a window's pages hold at
/// 64-token steps) over 80 pages, which hold two of them grown whole. Each
/// preempted request gives its windows back, comes back through the
/// prefix cache or recomputes, and answers what it answers alone on full
/// KV; the pool ends at baseline (I8).
#[test]
fn i8_sliding_windows_preempted_and_resumed_answer_exactly() {
    let model = crate::testing::windowed_model();
    let crowd = crowd(300);
    let mut reference = worker_of(Arc::clone(&model), Keep::Everything, Cache::Off, 4096, 16);
    let expected = reference.run(&crowd);
    for cache in [Cache::Off, Cache::On] {
        let mut small = worker_of(Arc::clone(&model), Keep::Windows, cache, 1024, 16);
        assert_eq!(small.pool.geometry().num_pages, 80);
        let got = small.run(&crowd);
        assert_eq!(
            texts(&got),
            texts(&expected),
            "a preempted request answered differently"
        );
        assert!(small.preempted() > 0, "the pool was meant to run out");
    }
}

//! Disaggregated prefill/decode in one process over the in-process transport:
//! outputs equal colocated bit for bit; the incident — a prompt that fits
//! decode but not prefill — ends in an error, never a token; cancellations
//! and failures leave both pools at baseline (I5, I6, I7, I8).

#![allow(clippy::unwrap_used)]

use std::sync::Arc;
use std::time::{Duration, Instant};

use kvfence_engine::{
    Engine, EngineConfig, Event, FailureKind, GenerationRequest, RequestHandle, Role, Share,
    Transport,
};
use kvfence_model::{
    Grammar, LoadedModel, Logits, PromptLogprob, SamplingParams, Sequence, StopStrings,
    prompt_logprob,
};
use kvfence_pool::{ElemType, Pool, PoolSize, PoolSpec, RequestId, ReusePolicy, Scrub};

fn model() -> Arc<LoadedModel> {
    Arc::new(LoadedModel::load("builtin:tiny").unwrap())
}

/// `tokens` of f32 KV for `model`, in 16-token pages.
fn spec(model: &LoadedModel, tokens: usize) -> PoolSpec {
    PoolSpec::new(
        model.model.kv_shape(),
        16,
        ElemType::F32,
        PoolSize::Tokens(tokens),
    )
}

fn pool(model: &LoadedModel, tokens: usize, scrub: Scrub, reuse: ReusePolicy) -> Pool {
    Pool::new(&spec(model, tokens).with_scrub(scrub).with_reuse(reuse)).unwrap()
}

/// Every scenario runs over every transport: in-process and TCP (two-sided)
/// and shared memory (one-sided).
fn transports() -> [Transport; 3] {
    [
        Transport::InProcess,
        Transport::SharedMemory,
        kvfence_fleet::TlsLoopback::transport(),
    ]
}

fn config() -> EngineConfig {
    EngineConfig {
        max_running: 16,
        max_queue: 256,
        step_tokens: 96,
        ..EngineConfig::default()
    }
}

fn request(i: usize, temperature: f32) -> GenerationRequest {
    GenerationRequest {
        prompt: (0..5 + (i * 11) % 50)
            .map(|j| ((j * 7 + i * 13) % 256) as u32)
            .collect(),
        max_tokens: 10,
        sampling: SamplingParams {
            temperature,
            top_k: 0,
            top_p: 0.95,
            seed: i as u64,
            ..SamplingParams::greedy()
        },
        stop: StopStrings::default(),
        ignore_eos: true,
        cache: None,
        constraint: None,
        share: Share::default(),
        trace: None,
    }
}

fn collect(mut handle: RequestHandle) -> (String, Event) {
    let mut text = String::new();
    loop {
        match handle.blocking_next().unwrap() {
            Event::Token { text: t, .. } => text.push_str(&t),
            closing => return (text, closing),
        }
    }
}

fn run_all(engine: &Engine, requests: &[GenerationRequest]) -> Vec<(String, Event)> {
    let handles: Vec<_> = requests
        .iter()
        .map(|r| engine.submit(r.clone()).unwrap())
        .collect();
    handles.into_iter().map(collect).collect()
}

fn wait_for_baseline(engine: &Engine) {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let busy: usize = engine
            .pools()
            .iter()
            .map(|(_, p)| p.stats().leased_pages + p.stats().quarantined_pages)
            .sum();
        if busy == 0 && engine.stats().running == 0 {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "I8: pools not at baseline: {:?}",
            engine
                .pools()
                .iter()
                .map(|(r, p)| (*r, p.stats()))
                .collect::<Vec<_>>()
        );
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// A disaggregated engine with pools roomy enough for every scenario,
/// newest-freed pages reused first and freed pages poisoned.
fn roomy_disaggregated(model: &Arc<LoadedModel>, transport: &Transport) -> Engine {
    Engine::start_disaggregated(
        Arc::clone(model),
        pool(model, 4096, Scrub::Poison, ReusePolicy::NewestFreedFirst),
        pool(model, 8192, Scrub::Poison, ReusePolicy::NewestFreedFirst),
        config(),
        transport,
    )
    .unwrap()
}

#[test]
fn sixty_four_concurrent_requests_equal_colocated_bit_for_bit() {
    for transport in transports() {
        sixty_four_concurrent_requests_equal_colocated_bit_for_bit_over(&transport);
    }
}

fn sixty_four_concurrent_requests_equal_colocated_bit_for_bit_over(transport: &Transport) {
    let transport = transport.clone();
    let model = model();
    let colocated = Engine::start(
        Arc::clone(&model),
        pool(&model, 8192, Scrub::Poison, ReusePolicy::OldestFreedFirst),
        config(),
    );
    let disaggregated = roomy_disaggregated(&model, &transport);
    assert_eq!(disaggregated.role(), Role::Decode);
    // Greedy and sampled: the sampler's draws do not depend on which worker makes them.
    let requests: Vec<GenerationRequest> = (0..64)
        .map(|i| request(i, if i % 2 == 0 { 0.0 } else { 0.8 }))
        .collect();
    let expected = run_all(&colocated, &requests);
    let got = run_all(&disaggregated, &requests);
    assert_eq!(got, expected);
    assert!(matches!(expected[0].1, Event::Finished { .. }));
    let stats = disaggregated.stats();
    assert_eq!(stats.handoffs_committed, 64);
    assert!(stats.handoff_bytes > 0);
    assert_eq!(stats.handoff_checksum_failures + stats.handoffs_failed, 0);
    wait_for_baseline(&disaggregated);
}

/// Every event of a request, logprobs included.
fn events(mut handle: RequestHandle) -> Vec<Event> {
    let mut events = Vec::new();
    loop {
        let event = handle.blocking_next().unwrap();
        let last = !matches!(event, Event::Token { .. } | Event::Prompt { .. });
        events.push(event);
        if last {
            return events;
        }
    }
}

#[test]
fn constraints_penalties_and_logprobs_equal_colocated_bit_for_bit() {
    let model = model();
    let colocated = Engine::start(
        Arc::clone(&model),
        pool(&model, 8192, Scrub::Poison, ReusePolicy::OldestFreedFirst),
        config(),
    );
    let requests: Vec<GenerationRequest> = (0..12)
        .map(|i| {
            let mut r = request(i, if i % 2 == 0 { 0.0 } else { 0.9 });
            r.max_tokens = 16;
            r.sampling.presence_penalty = 0.5;
            r.sampling.frequency_penalty = 0.3;
            r.sampling.repetition_penalty = 1.2;
            r.sampling.logit_bias = vec![(u32::from(b'b'), 3.0)];
            r.sampling.logprobs = Some(3);
            if i % 3 != 2 {
                r.constraint = Some(Grammar::Regex("[a-d]{3,9}-[0-9]{2}".into()).into());
            }
            r
        })
        .collect();
    let run = |engine: &Engine| -> Vec<Vec<Event>> {
        let handles: Vec<_> = requests
            .iter()
            .map(|r| engine.submit(r.clone()).unwrap())
            .collect();
        handles.into_iter().map(events).collect()
    };
    let expected = run(&colocated);
    for (request, events) in requests.iter().zip(&expected) {
        let text: String = events
            .iter()
            .filter_map(|e| match e {
                Event::Token { text, .. } => Some(text.as_str()),
                _ => None,
            })
            .collect();
        let tokens = events
            .iter()
            .filter(|e| {
                matches!(
                    e,
                    Event::Token {
                        logprobs: Some(_),
                        ..
                    }
                )
            })
            .count();
        assert!(tokens > 0, "every token carries its logprobs");
        if request.constraint.is_some() {
            let (letters, digits) = text.split_once('-').unwrap_or_else(|| panic!("{text:?}"));
            assert!((3..=9).contains(&letters.len()), "{text:?}");
            assert!(
                letters.bytes().all(|b| (b'a'..=b'd').contains(&b)),
                "{text:?}"
            );
            assert!(
                digits.len() == 2 && digits.bytes().all(|b| b.is_ascii_digit()),
                "{text:?}"
            );
            assert!(matches!(
                events.last(),
                Some(Event::Finished {
                    reason: kvfence_engine::FinishReason::Stop,
                    ..
                })
            ));
        }
    }
    for transport in transports() {
        let disaggregated = roomy_disaggregated(&model, &transport);
        assert_eq!(run(&disaggregated), expected, "{transport:?}");
        wait_for_baseline(&disaggregated);
    }
}

/// The prompt's scores straight from the model: one pass over the whole
/// prompt with every row's logits, each row scoring the next token.
fn scores_alone(model: &LoadedModel, prompt: &[u32], top: usize) -> Vec<PromptLogprob> {
    let pool = pool(model, 4096, Scrub::Zero, ReusePolicy::OldestFreedFirst);
    let mut lease = pool.lease(RequestId(1), prompt.len()).unwrap();
    let mut batch = [Sequence {
        lease: &mut lease,
        past: 0,
        tokens: prompt,
        logits: Logits::All,
    }];
    let logits = model.model.forward(&mut batch).unwrap().remove(0);
    let vocab = model.model.config().vocab_size;
    logits
        .chunks_exact(vocab)
        .zip(&prompt[1..])
        .map(|(row, &next)| prompt_logprob(row, next, top))
        .collect()
}

/// A pool with a prefix cache, newest-freed pages first, poisoned.
fn cached_pool(model: &LoadedModel, tokens: usize) -> Pool {
    let spec = spec(model, tokens)
        .with_prefix_cache(tokens / 16)
        .with_scrub(Scrub::Poison)
        .with_reuse(ReusePolicy::NewestFreedFirst);
    Pool::new(&spec).unwrap()
}

#[test]
fn prompt_scores_are_the_models_own_in_every_mode_and_change_no_answer() {
    let model = model();
    let colocated = Engine::start(Arc::clone(&model), cached_pool(&model, 8192), config());
    // One token (nothing to score), a page and one, and prompts that take
    // several steps of 96 tokens; each twice, the second time with its
    // tenant's prefix cache warm, which a scored prompt must not use.
    let mut requests = Vec::new();
    for (i, (len, top)) in [(1, 2), (17, 0), (150, 20), (300, 3)]
        .into_iter()
        .enumerate()
    {
        let mut r = request(i, if i % 2 == 0 { 0.0 } else { 0.8 });
        r.prompt = (0..len).map(|j| ((j * 5 + i * 3) % 256) as u32).collect();
        r.cache = Some(kvfence_engine::CacheScope::tenant("t", None));
        r.sampling.prompt_logprobs = Some(top);
        requests.push(r.clone());
        requests.push(r);
    }
    let run = |engine: &Engine| -> Vec<Vec<Event>> {
        requests
            .iter()
            .map(|r| events(engine.submit(r.clone()).unwrap()))
            .collect()
    };
    let expected = run(&colocated);
    for (request, events) in requests.iter().zip(&expected) {
        let top = request.sampling.prompt_logprobs.unwrap();
        let Event::Prompt { logprobs } = &events[0] else {
            panic!("the scores come first: {:?}", events[0]);
        };
        assert_eq!(*logprobs, scores_alone(&model, &request.prompt, top));
        assert!(logprobs.iter().all(|s| s.logprobs.top.len() == top));
        let mut unscored = request.clone();
        unscored.sampling.prompt_logprobs = None;
        let mut plain = self::events(colocated.submit(unscored).unwrap());
        // The plain run may read its prompt from the cache; a scored one
        // computes every position.
        if let Some(Event::Finished { usage, .. }) = plain.last_mut() {
            usage.cached_tokens = 0;
        }
        assert_eq!(events[1..], plain[..], "scoring changes no token");
        assert!(
            !events[1..]
                .iter()
                .any(|e| matches!(e, Event::Prompt { .. })),
            "scores come once"
        );
    }
    for transport in transports() {
        let disaggregated = Engine::start_disaggregated(
            Arc::clone(&model),
            cached_pool(&model, 4096),
            cached_pool(&model, 8192),
            config(),
            &transport,
        )
        .unwrap();
        assert_eq!(run(&disaggregated), expected, "{transport:?}");
        wait_for_baseline(&disaggregated);
    }
    wait_for_baseline(&colocated);
}

#[test]
fn the_checks_not_luck_keep_requests_apart_with_immediate_reuse_and_no_scrub() {
    for transport in transports() {
        the_checks_not_luck_keep_requests_apart_with_immediate_reuse_and_no_scrub_over(&transport);
    }
}

fn the_checks_not_luck_keep_requests_apart_with_immediate_reuse_and_no_scrub_over(
    transport: &Transport,
) {
    let transport = transport.clone();
    let model = model();
    let colocated = Engine::start(
        Arc::clone(&model),
        pool(&model, 8192, Scrub::Off, ReusePolicy::OldestFreedFirst),
        config(),
    );
    // Small pools and newest-first reuse: pages change hands constantly.
    let disaggregated = Engine::start_disaggregated(
        Arc::clone(&model),
        pool(&model, 256, Scrub::Off, ReusePolicy::NewestFreedFirst),
        pool(&model, 512, Scrub::Off, ReusePolicy::NewestFreedFirst),
        config(),
        &transport,
    )
    .unwrap();
    let requests: Vec<GenerationRequest> = (0..24).map(|i| request(i, 0.0)).collect();
    assert_eq!(
        run_all(&disaggregated, &requests),
        run_all(&colocated, &requests)
    );
    wait_for_baseline(&disaggregated);
}

#[test]
fn the_incident_a_prompt_that_fits_decode_but_not_prefill_gets_an_error_and_no_token() {
    for transport in transports() {
        the_incident_a_prompt_that_fits_decode_but_not_prefill_gets_an_error_and_no_token_over(
            &transport,
        );
    }
}

fn the_incident_a_prompt_that_fits_decode_but_not_prefill_gets_an_error_and_no_token_over(
    transport: &Transport,
) {
    let transport = transport.clone();
    let model = model();
    // Prefill holds 64 tokens; decode holds 4096. The router would refuse
    // this request (min capacity); calling the engine directly bypasses it,
    // so only the workers' own checks stand in the way.
    let engine = Engine::start_disaggregated(
        Arc::clone(&model),
        pool(&model, 64, Scrub::Poison, ReusePolicy::NewestFreedFirst),
        pool(&model, 4096, Scrub::Poison, ReusePolicy::NewestFreedFirst),
        config(),
        &transport,
    )
    .unwrap();
    let mut long = request(1, 0.0);
    long.prompt = (0..200).map(|i| (i % 256) as u32).collect();
    let (text, closing) = collect(engine.submit(long).unwrap());
    assert_eq!(text, "", "I5: no token from a rejected prompt");
    assert!(
        matches!(
            closing,
            Event::Failed {
                kind: FailureKind::TooLong,
                ..
            }
        ),
        "{closing:?}"
    );
    let stats = engine.stats();
    assert_eq!(
        (
            stats.generated_tokens,
            stats.steps,
            stats.handoffs_committed
        ),
        (0, 0, 0),
        "decode never decoded"
    );
    wait_for_baseline(&engine);
    // The workers still serve requests that fit.
    let (_, closing) = collect(engine.submit(request(2, 0.0)).unwrap());
    assert!(matches!(closing, Event::Finished { .. }));
}

#[test]
fn cancelling_during_the_hand_off_frees_both_pools() {
    for transport in transports() {
        cancelling_during_the_hand_off_frees_both_pools_over(&transport);
    }
}

fn cancelling_during_the_hand_off_frees_both_pools_over(transport: &Transport) {
    let transport = transport.clone();
    let model = model();
    let engine = Engine::start_disaggregated(
        Arc::clone(&model),
        pool(&model, 4096, Scrub::Poison, ReusePolicy::NewestFreedFirst),
        pool(&model, 4096, Scrub::Poison, ReusePolicy::NewestFreedFirst),
        config(),
        &transport,
    )
    .unwrap();
    for i in 0..20 {
        let mut r = request(i, 0.0);
        r.prompt = (0..300).map(|j| (j % 256) as u32).collect();
        r.max_tokens = 500;
        let handle = engine.submit(r).unwrap();
        // Drop at varying moments: before the grant, mid-prefill, mid-decode.
        std::thread::sleep(Duration::from_micros((i as u64 % 5) * 400));
        drop(handle);
    }
    wait_for_baseline(&engine);
    let (_, closing) = collect(engine.submit(request(3, 0.0)).unwrap());
    assert!(
        matches!(closing, Event::Finished { .. }),
        "the pair still works after the aborts"
    );
}

#[test]
fn losing_the_prefill_worker_fails_in_flight_requests_and_refuses_new_ones() {
    let model = model();
    let transport = kvfence_fleet::TlsLoopback::transport();
    let engine = Engine::start_disaggregated(
        Arc::clone(&model),
        pool(&model, 4096, Scrub::Poison, ReusePolicy::NewestFreedFirst),
        pool(&model, 8192, Scrub::Poison, ReusePolicy::NewestFreedFirst),
        EngineConfig {
            max_running: 4,
            max_queue: 64,
            step_tokens: 32,
            ..EngineConfig::default()
        },
        &transport,
    )
    .unwrap();
    let handles: Vec<_> = (0..12)
        .map(|i| {
            let mut r = request(i, 0.0);
            r.prompt = (0..400).map(|j| (j % 256) as u32).collect();
            r.max_tokens = 50;
            engine.submit(r).unwrap()
        })
        .collect();
    engine.shutdown_prefill();
    let outcomes: Vec<Event> = handles.into_iter().map(|h| collect(h).1).collect();
    assert!(
        outcomes.iter().any(|e| matches!(e, Event::Failed { .. })),
        "some requests were still waiting for KV"
    );
    for e in &outcomes {
        assert!(
            matches!(e, Event::Finished { .. } | Event::Failed { .. }),
            "{e:?}"
        );
    }
    wait_for_baseline(&engine);
    // Once the link is gone, new requests fail fast instead of hanging.
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let (_, closing) = collect(engine.submit(request(99, 0.0)).unwrap());
        if matches!(
            closing,
            Event::Failed {
                kind: FailureKind::Unavailable,
                ..
            }
        ) {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "new requests still accepted: {closing:?}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    wait_for_baseline(&engine);
}

//! The colocated engine end to end on `builtin:tiny`: outputs, batch
//! invariance under concurrency, cancellation, back-pressure, refusals and
//! shutdown — each ending with the pool back at its baseline (I8).

#![allow(clippy::unwrap_used)]

use std::sync::Arc;
use std::time::{Duration, Instant};

use kvfence_engine::{
    Engine, EngineConfig, EngineError, Event, FailureKind, FinishReason, GenerationRequest,
};
use kvfence_model::{LoadedModel, StopStrings};
use kvfence_pool::{ElemType, Pool, PoolSize, PoolSpec, ReusePolicy, Scrub};

fn engine(pool_tokens: usize, config: EngineConfig) -> Engine {
    let model = Arc::new(LoadedModel::load("builtin:tiny").unwrap());
    let spec = PoolSpec::new(
        model.model.kv_shape(),
        16,
        ElemType::F32,
        PoolSize::Tokens(pool_tokens),
    )
    .with_scrub(Scrub::Poison)
    .with_reuse(ReusePolicy::NewestFreedFirst);
    Engine::start(model, Pool::new(&spec).unwrap(), config)
}

fn request(prompt_seed: u32, len: usize, max_tokens: usize) -> GenerationRequest {
    GenerationRequest {
        ignore_eos: true,
        ..GenerationRequest::greedy(
            (0..len as u32)
                .map(|i| (i * 13 + prompt_seed * 7) % 256)
                .collect(),
            max_tokens,
        )
    }
}

/// Collects a request's text and its closing event.
fn collect(mut handle: kvfence_engine::RequestHandle) -> (String, Event) {
    let mut text = String::new();
    loop {
        match handle
            .blocking_next()
            .expect("the engine always closes a request with an event")
        {
            Event::Token { text: t, .. } => text.push_str(&t),
            closing => return (text, closing),
        }
    }
}

fn wait_for_baseline(engine: &Engine) {
    let deadline = Instant::now() + Duration::from_secs(20);
    while engine.pool().stats().leased_pages != 0 || engine.stats().running != 0 {
        assert!(
            Instant::now() < deadline,
            "I8: pool did not return to baseline: {:?}",
            engine.pool().stats()
        );
        std::thread::sleep(Duration::from_millis(5));
    }
}

#[test]
fn a_request_runs_to_max_tokens_and_reports_usage() {
    let engine = engine(4096, EngineConfig::default());
    let (_, closing) = collect(engine.submit(request(1, 10, 7)).unwrap());
    assert_eq!(
        closing,
        Event::Finished {
            reason: FinishReason::Length,
            usage: kvfence_engine::Usage {
                prompt_tokens: 10,
                completion_tokens: 7,
                cached_tokens: 0,
            }
        }
    );
    wait_for_baseline(&engine);
}

#[test]
fn concurrent_requests_give_the_same_text_as_alone() {
    let engine = engine(
        16 * 1024,
        EngineConfig {
            max_running: 8,
            max_queue: 64,
            step_tokens: 64,
            ..EngineConfig::default()
        },
    );
    let requests: Vec<GenerationRequest> = (0..24)
        .map(|i| request(i, 5 + (i as usize * 7) % 40, 12))
        .collect();
    let alone: Vec<String> = requests
        .iter()
        .map(|r| collect(engine.submit(r.clone()).unwrap()).0)
        .collect();
    let handles: Vec<_> = requests
        .iter()
        .map(|r| engine.submit(r.clone()).unwrap())
        .collect();
    let together: Vec<String> = handles.into_iter().map(|h| collect(h).0).collect();
    assert_eq!(together, alone, "batching changed some output");
    assert!(alone.iter().any(|t| !t.is_empty()));
    wait_for_baseline(&engine);
}

#[test]
fn dropping_the_handle_cancels_and_frees_the_pages() {
    let engine = engine(8192, EngineConfig::default());
    let mut handle = engine.submit(request(3, 20, 3000)).unwrap();
    assert!(matches!(handle.blocking_next(), Some(Event::Token { .. })));
    assert!(engine.pool().stats().leased_pages > 0);
    drop(handle);
    wait_for_baseline(&engine);
    assert_eq!(engine.stats().cancelled, 1);
}

#[test]
fn a_full_queue_refuses_at_once() {
    // One running request holds the whole pool; one may wait; the third is refused.
    let engine = engine(
        1024,
        EngineConfig {
            max_running: 4,
            max_queue: 1,
            step_tokens: 64,
            ..EngineConfig::default()
        },
    );
    let running = engine.submit(request(1, 10, 1000)).unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    while engine.stats().running == 0 {
        assert!(Instant::now() < deadline);
        std::thread::sleep(Duration::from_millis(2));
    }
    let waiting = engine.submit(request(2, 10, 1000)).unwrap();
    assert!(matches!(
        engine.submit(request(3, 10, 10)),
        Err(EngineError::QueueFull { capacity: 1 })
    ));
    drop(running);
    let (_, closing) = collect(waiting);
    assert!(
        matches!(
            closing,
            Event::Finished {
                reason: FinishReason::Length,
                ..
            }
        ),
        "the waiting request runs once pages free up"
    );
    wait_for_baseline(&engine);
}

#[test]
fn a_request_larger_than_the_pool_is_refused_before_any_page_is_leased() {
    let engine = engine(256, EngineConfig::default());
    let err = engine.submit(request(1, 200, 100)).unwrap_err();
    assert!(
        matches!(
            err,
            EngineError::TooLong {
                needed: 300,
                capacity: 256
            }
        ),
        "{err}"
    );
    assert_eq!(engine.pool().stats().leases_granted, 0);
    assert!(matches!(
        engine.submit(request(1, 0, 1)),
        Err(EngineError::Invalid { .. })
    ));
}

#[test]
fn stop_strings_end_the_completion_with_stop() {
    let engine = engine(4096, EngineConfig::default());
    let (full, _) = collect(engine.submit(request(5, 8, 40)).unwrap());
    // Stop at a piece of what greedy decoding will produce anyway.
    let chars: Vec<char> = full.chars().collect();
    let stop: String = chars[chars.len() / 2..chars.len() / 2 + 2].iter().collect();
    let cut = full.find(&stop).unwrap();
    let mut req = request(5, 8, 40);
    req.stop = StopStrings::new(vec![stop]).unwrap();
    let (text, closing) = collect(engine.submit(req).unwrap());
    assert_eq!(text, full[..cut]);
    assert!(matches!(
        closing,
        Event::Finished {
            reason: FinishReason::Stop,
            ..
        }
    ));
}

#[test]
fn shutdown_fails_in_flight_requests_and_returns_every_page() {
    let engine = engine(4096, EngineConfig::default());
    let pool = engine.pool().clone();
    let mut handle = engine.submit(request(1, 10, 4000)).unwrap();
    assert!(matches!(handle.blocking_next(), Some(Event::Token { .. })));
    drop(engine);
    let closing =
        std::iter::from_fn(|| handle.blocking_next()).find(|e| !matches!(e, Event::Token { .. }));
    assert!(
        matches!(
            closing,
            Some(Event::Failed {
                kind: FailureKind::ShuttingDown,
                ..
            })
        ),
        "{closing:?}"
    );
    assert_eq!(pool.stats().leased_pages, 0);
}

/// Requests queued because the pool was full must start as soon as pages
/// come back — also when the last running request has just ended and the
/// worker has nothing else to wake it.
#[test]
fn queued_requests_start_when_the_last_running_one_frees_its_pages() {
    // 256 tokens hold two of these (100 + 20 tokens, 8 pages each) at once.
    let engine = engine(256, EngineConfig::default());
    let handles: Vec<_> = (0..4)
        .map(|i| engine.submit(request(i, 100, 20)).unwrap())
        .collect();
    let (done, finished) = std::sync::mpsc::channel();
    for handle in handles {
        let done = done.clone();
        std::thread::spawn(move || done.send(collect(handle)).unwrap());
    }
    for _ in 0..4 {
        let (_, closing) = finished
            .recv_timeout(Duration::from_secs(20))
            .expect("a queued request never started: the worker slept with pages free");
        assert!(matches!(closing, Event::Finished { .. }), "{closing:?}");
    }
    wait_for_baseline(&engine);
}

/// Every path into the engine (HTTP, a router's link) is validated at
/// `submit`, once: token ids outside the vocabulary, a `max_tokens` whose
/// reservation overflows, and a reach past the model's positions are
/// refused at once, holding nothing, before they could share a batch.
#[test]
fn submit_refuses_what_could_fail_a_batch() {
    // A pool larger than the model's 4,096 positions: only the model's
    // limit refuses the third request.
    let engine = engine(16384, EngineConfig::default());
    let mut bad_token = request(1, 8, 4);
    bad_token.prompt[3] = 1_000_000;
    assert!(matches!(
        engine.submit(bad_token),
        Err(EngineError::Invalid { .. })
    ));
    let overflow = GenerationRequest {
        max_tokens: usize::MAX,
        ..request(2, 8, 4)
    };
    assert!(matches!(
        engine.submit(overflow),
        Err(EngineError::TooLong { .. })
    ));
    let past_the_model = GenerationRequest {
        max_tokens: 5000,
        ..request(3, 8, 4)
    };
    assert!(matches!(
        engine.submit(past_the_model),
        Err(EngineError::TooLong { .. })
    ));
    assert_eq!(engine.pool().stats().leased_pages, 0);
    let (_, end) = collect(engine.submit(request(4, 8, 4)).unwrap());
    assert!(matches!(end, Event::Finished { .. }), "{end:?}");
}

//! Batch rows are fenced like pages (I9): a request's grammar, penalty
//! history, logit bias and sampler belong to it alone. A request that takes
//! a row after another — or shares a step with others of every kind —
//! draws exactly the tokens it draws alone on a fresh engine. The mutation
//! check's replays (n) (a grammar row outlives its request) and (o)
//! (penalty history carried over) must fail these tests.

#![allow(clippy::unwrap_used)]

use std::sync::Arc;

use kvfence_engine::{Engine, EngineConfig, Event, FinishReason, GenerationRequest, Share};
use kvfence_model::{Grammar, LoadedModel, SamplingParams, StopStrings};
use kvfence_pool::{ElemType, Pool, PoolSize, PoolSpec, Scrub};

fn engine(max_running: usize) -> Engine {
    let model = Arc::new(LoadedModel::load("builtin:tiny").unwrap());
    let spec = PoolSpec::new(
        model.model.kv_shape(),
        16,
        ElemType::F32,
        PoolSize::Tokens(4096),
    )
    .with_scrub(Scrub::Poison);
    let config = EngineConfig {
        max_running,
        step_tokens: 64,
        ..EngineConfig::default()
    };
    Engine::start(model, Pool::new(&spec).unwrap(), config)
}

fn request(seed: u32, sampling: SamplingParams) -> GenerationRequest {
    GenerationRequest {
        prompt: (0..12u32).map(|i| (i * 11 + seed * 29) % 256).collect(),
        max_tokens: 8,
        sampling: SamplingParams {
            logprobs: Some(0),
            ..sampling
        },
        stop: StopStrings::default(),
        ignore_eos: true,
        cache: None,
        constraint: None,
        share: Share::new(format!("tenant-{seed}"), 1),
        trace: None,
    }
}

fn constrained(seed: u32, regex: &str) -> GenerationRequest {
    GenerationRequest {
        ignore_eos: false,
        constraint: Some(Grammar::Regex(regex.into()).into()),
        ..request(seed, SamplingParams::greedy())
    }
}

fn penalised(seed: u32) -> GenerationRequest {
    request(
        seed,
        SamplingParams {
            presence_penalty: 2.0,
            frequency_penalty: 2.0,
            repetition_penalty: 1.5,
            ..SamplingParams::greedy()
        },
    )
}

/// The tokens a request drew, and how it ended.
fn tokens(mut handle: kvfence_engine::RequestHandle) -> (Vec<u32>, Event) {
    let mut drawn = Vec::new();
    loop {
        match handle.blocking_next().unwrap() {
            Event::Token { logprobs, .. } => drawn.extend(logprobs.map(|l| l.token)),
            end => return (drawn, end),
        }
    }
}

fn alone(request: &GenerationRequest) -> (Vec<u32>, Event) {
    tokens(engine(1).submit(request.clone()).unwrap())
}

#[test]
fn a_grammar_ends_with_its_request() {
    let engine = engine(1);
    let (digits, end) = tokens(engine.submit(constrained(1, "[0-9]{2}")).unwrap());
    assert!(
        matches!(
            end,
            Event::Finished {
                reason: FinishReason::Stop,
                ..
            }
        ),
        "{end:?}"
    );
    assert!(!digits.is_empty());
    // The next request in that row has no grammar: nothing constrains it.
    let free = request(2, SamplingParams::greedy());
    assert_eq!(tokens(engine.submit(free.clone()).unwrap()), alone(&free));
}

#[test]
fn penalties_count_only_their_own_request_s_tokens() {
    let later = penalised(3);
    let (expected, _) = alone(&later);
    // The request before it draws, eight times, the very token the later
    // one draws first: any history carried over would push that token down.
    let first = expected[0];
    let before = request(
        4,
        SamplingParams {
            logit_bias: vec![(first, 100.0)],
            ..SamplingParams::greedy()
        },
    );
    let engine = engine(1);
    let (repeated, _) = tokens(engine.submit(before).unwrap());
    assert_eq!(repeated, vec![first; 8]);
    assert_eq!(tokens(engine.submit(later).unwrap()).0, expected);
}

#[test]
fn rows_of_every_kind_in_one_batch_draw_what_they_draw_alone() {
    let requests = [
        constrained(5, "[a-z]{3,5}"),
        request(6, SamplingParams::greedy()),
        penalised(7),
        request(8, SamplingParams::seeded(1.0, 42)),
        constrained(9, "(yes|no)"),
        request(
            10,
            SamplingParams {
                logit_bias: vec![(65, 100.0)],
                ..SamplingParams::greedy()
            },
        ),
        penalised(11),
        request(12, SamplingParams::greedy()),
    ];
    let expected: Vec<_> = requests.iter().map(alone).collect();
    // Three rows for eight requests: most take a row another just left.
    let engine = engine(3);
    let handles: Vec<_> = requests
        .iter()
        .map(|r| engine.submit(r.clone()).unwrap())
        .collect();
    for (i, (handle, expected)) in handles.into_iter().zip(&expected).enumerate() {
        assert_eq!(&tokens(handle), expected, "request {i}");
    }
}

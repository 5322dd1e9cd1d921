//! Fair shares through the scheduler, driven step by step (I11): one
//! tenant's flood does not hold back another's request, weights divide the
//! compute, and idling banks no credit.

// In a test, a panic is the failure report.
#![allow(clippy::unwrap_used)]

use std::sync::Arc;
use std::time::{Duration, Instant};

use kvfence_pool::{ElemType, Pool, PoolSize, PoolSpec, RequestId, Scrub};

use super::step::Stopwatch;
use super::{Pending, Role, Scheduler};
use crate::config::EngineConfig;
use crate::counters::Counters;
use crate::request::{Event, FailureKind, GenerationRequest, RequestHandle, Share};

use crate::testing::tiny_model as model;

struct Worker {
    scheduler: Scheduler,
    next_id: u64,
    steps: usize,
}

/// A colocated worker over a pool of `tokens`, taking `step_tokens` a step
/// and running `max_running` requests at once.
fn worker(tokens: usize, step_tokens: usize, max_running: usize) -> Worker {
    worker_with(
        tokens,
        EngineConfig {
            step_tokens,
            max_running,
            ..EngineConfig::default()
        },
    )
}

fn worker_with(tokens: usize, config: EngineConfig) -> Worker {
    let model = model();
    let spec = PoolSpec::new(
        model.model.kv_shape(),
        16,
        ElemType::F32,
        PoolSize::Tokens(tokens),
    )
    .with_scrub(Scrub::Poison);
    let scheduler = Scheduler::new(
        Role::Colocated,
        model,
        Pool::new(&spec).unwrap(),
        config,
        Arc::new(Counters::default()),
    );
    Worker {
        scheduler,
        next_id: 1,
        steps: 0,
    }
}

/// A request of `tenant` at `weight`: a prompt of `len` tokens (distinct
/// per `seed`) and one token to generate, so it ends with its prefill.
fn request(tenant: &str, weight: u32, seed: u32, len: usize) -> GenerationRequest {
    GenerationRequest {
        ignore_eos: true,
        share: Share::new(tenant, weight),
        ..GenerationRequest::greedy(
            (0..len as u32).map(|i| (i * 7 + seed * 31) % 250).collect(),
            1,
        )
    }
}

/// A submitted request and when it ended, in steps.
struct Tracked {
    tenant: String,
    handle: RequestHandle,
    ended_at: Option<usize>,
}

impl Worker {
    fn submit(&mut self, request: GenerationRequest) -> Tracked {
        let id = RequestId(self.next_id);
        self.next_id += 1;
        let tenant = request.share.tenant.clone();
        let (pending, handle) = Pending::for_client(id, request, None);
        self.scheduler.submit(pending);
        Tracked {
            tenant,
            handle,
            ended_at: None,
        }
    }

    /// One poll (a step when there is work); marks what ended.
    fn step(&mut self, tracked: &mut [Tracked]) {
        if self.scheduler.poll_delivering(Instant::now()) {
            self.steps += 1;
        }
        for t in tracked.iter_mut().filter(|t| t.ended_at.is_none()) {
            while let Ok(event) = t.handle.try_next() {
                match event {
                    Event::Finished { .. } => t.ended_at = Some(self.steps),
                    Event::Failed { message, .. } => panic!("a request failed: {message}"),
                    Event::Token { .. } | Event::Prompt { .. } => {}
                }
            }
        }
    }

    fn run_until_ended(&mut self, tracked: &mut [Tracked]) {
        for _ in 0..100_000 {
            if tracked.iter().all(|t| t.ended_at.is_some()) {
                return;
            }
            self.step(tracked);
        }
        panic!("requests never ended");
    }
}

/// How many of the first `count` requests to end were tenant b's.
fn b_among_first(tracked: &[Tracked], count: usize) -> usize {
    let mut order: Vec<(usize, &str)> = tracked
        .iter()
        .map(|t| (t.ended_at.unwrap(), t.tenant.as_str()))
        .collect();
    order.sort_unstable();
    order.iter().take(count).filter(|(_, t)| *t == "b").count()
}

#[test]
fn i11_a_short_prompt_is_not_held_back_by_another_tenants_long_ones() {
    let mut w = worker(16_384, 64, 64);
    let mut flood: Vec<Tracked> = (0..8).map(|i| w.submit(request("a", 1, i, 600))).collect();
    // The flood is under way when the victim arrives.
    for _ in 0..3 {
        w.step(&mut flood);
    }
    let arrived = w.steps;
    let mut victim = [w.submit(request("b", 1, 99, 20))];
    w.run_until_ended(&mut victim);
    let waited = victim[0].ended_at.unwrap() - arrived;
    // One shared step computes the victim's whole prompt: half the budget
    // is its, and it asks for less. In arrival order it would wait for
    // 4,800 prompt tokens, 75 steps.
    assert_eq!(waited, 1, "the victim's prompt took {waited} steps");
    w.run_until_ended(&mut flood);
}

#[test]
fn i11_weights_divide_the_compute_between_busy_tenants() {
    let mut w = worker(16_384, 64, 64);
    let mut tracked: Vec<Tracked> = Vec::new();
    for i in 0..24 {
        tracked.push(w.submit(request("light", 1, i, 64)));
        tracked.push(w.submit(request("heavy", 3, 100 + i, 64)));
    }
    for _ in 0..32 {
        w.step(&mut tracked);
    }
    let done = |tenant: &str| {
        tracked
            .iter()
            .filter(|t| t.tenant == tenant && t.ended_at.is_some())
            .count()
    };
    // 32 steps of 64 prompt tokens: 2,048 tokens, a quarter of them the
    // light tenant's (8 prompts of 64), three quarters the heavy one's
    // (24, all of them).
    let (light, heavy) = (done("light"), done("heavy"));
    assert!(
        (7..=9).contains(&light) && heavy >= 22,
        "light {light}, heavy {heavy}"
    );
    w.run_until_ended(&mut tracked);
}

#[test]
fn i11_admission_alternates_between_tenants_when_slots_are_scarce() {
    // One request runs at a time: admission alone decides who goes next.
    let mut w = worker(4_096, 64, 1);
    let mut tracked: Vec<Tracked> = (0..10).map(|i| w.submit(request("a", 1, i, 32))).collect();
    tracked.extend((0..5).map(|i| w.submit(request("b", 1, 50 + i, 32))));
    w.run_until_ended(&mut tracked);
    // b arrived behind ten of a's requests, and gets every other slot.
    assert_eq!(b_among_first(&tracked, 10), 5);
}

#[test]
fn i11_an_idle_tenant_banks_no_credit() {
    let mut w = worker(4_096, 64, 1);
    // a runs alone for a while: its virtual time grows, b's stays at 0.
    let mut alone: Vec<Tracked> = (0..6).map(|i| w.submit(request("a", 1, i, 64))).collect();
    w.run_until_ended(&mut alone);
    // Then both are busy: b starts at a's virtual time, not at 0, so the
    // slots alternate instead of b taking the next six.
    let mut tracked: Vec<Tracked> = (0..6)
        .map(|i| w.submit(request("a", 1, 10 + i, 64)))
        .collect();
    tracked.extend((0..6).map(|i| w.submit(request("b", 1, 50 + i, 64))));
    w.run_until_ended(&mut tracked);
    let b = b_among_first(&tracked, 6);
    assert!((2..=4).contains(&b), "b ended {b} of the first six");
}

#[test]
fn i11_a_tenant_cannot_fill_the_pool_while_the_worker_knows_another() {
    let mut w = worker(4_096, 64, 64);
    // b has used this worker before: it is a tenant the worker knows.
    let mut earlier = [w.submit(request("b", 1, 98, 20))];
    w.run_until_ended(&mut earlier);
    // a's eight long requests would hold all but a few of the pool's 256
    // pages for 200 decode steps; it is admitted up to three quarters of
    // the pool and the rest of its requests wait.
    let waited = steps_b_waits_during_a_flood(&mut w, false);
    // Without the cap it would wait for a's first request to end (200
    // steps at least).
    assert!(waited <= 12, "the victim's prompt took {waited} steps");
}

/// Tenant a floods `w` with eight requests of 500 tokens and 200 to
/// generate — from a front door that says it serves several tenants if
/// `told` — then b sends a 300-token prompt: the steps b waits.
fn steps_b_waits_during_a_flood(w: &mut Worker, told: bool) -> usize {
    let mut flood: Vec<Tracked> = (0..8)
        .map(|i| {
            let request = request("a", 1, i, 500);
            w.submit(GenerationRequest {
                max_tokens: 200,
                share: request.share.clone().on_shared_workers(told),
                ..request
            })
        })
        .collect();
    w.step(&mut flood);
    let arrived = w.steps;
    let mut victim = [w.submit(request("b", 1, 99, 300))];
    w.run_until_ended(&mut victim);
    w.run_until_ended(&mut flood);
    victim[0].ended_at.unwrap() - arrived
}

#[test]
fn i11_a_worker_told_it_is_shared_caps_the_first_tenant_before_another_arrives() {
    let mut w = worker_with(
        4_096,
        EngineConfig {
            step_tokens: 64,
            shared: true,
            ..EngineConfig::default()
        },
    );
    // A fresh worker: a is the first tenant it ever sees, and floods it.
    let waited = steps_b_waits_during_a_flood(&mut w, false);
    // Not told, the worker lets a hold the whole pool and b waits for a's
    // first request to end (200 steps at least).
    assert!(waited <= 12, "the victim's prompt took {waited} steps");
}

#[test]
fn i11_a_request_saying_its_front_door_serves_several_tenants_makes_a_fresh_worker_shared() {
    // A fleet's worker process reads no tenants file: what it knows of
    // the tenants comes with the work.
    let fresh = || worker(4_096, 64, 64);
    let waited = steps_b_waits_during_a_flood(&mut fresh(), true);
    assert!(waited <= 12, "the victim's prompt took {waited} steps");
    // Not told, the first tenant holds the whole pool until its first
    // request ends.
    let untold = steps_b_waits_during_a_flood(&mut fresh(), false);
    assert!(
        untold >= 100,
        "untold, the victim waited only {untold} steps"
    );
}

#[test]
fn i11_a_tenants_grammar_masks_are_charged_to_its_share() {
    let mut w = worker(4_096, 64, 64);
    // Every pass and every mask reads as taking as long, whatever else the
    // machine runs meanwhile: a draw's mask costs its tenant what the step
    // before it computed.
    w.scheduler.stopwatch = Stopwatch::Fixed(Duration::from_millis(1));
    let schema = serde_json::json!({
        "type": "object",
        "properties": {"name": {"type": "string"}, "age": {"type": "integer"}}
    });
    let mut run_alone = |request: GenerationRequest| {
        let mut handle = w.submit(request).handle;
        loop {
            w.scheduler.poll_delivering(Instant::now());
            match handle.try_next() {
                Ok(Event::Finished { usage, .. }) => break usage,
                Ok(Event::Failed { message, .. }) => panic!("{message}"),
                _ => {}
            }
        }
    };
    // Its prompt and a row for every token but the last.
    let rows =
        |usage: crate::request::Usage| (usage.prompt_tokens + usage.completion_tokens - 1) as u128;
    let constrained = run_alone(GenerationRequest {
        max_tokens: 16,
        constraint: Some(kvfence_model::Grammar::JsonSchema(schema).into()),
        ..request("a", 1, 1, 20)
    });
    let plain = run_alone(GenerationRequest {
        max_tokens: 16,
        ..request("b", 1, 1, 20)
    });
    assert!(constrained.completion_tokens > 1, "a's draws were masked");
    let (a, b) = (
        w.scheduler.waiting.charged("a"),
        w.scheduler.waiting.charged("b"),
    );
    assert_eq!(a, 2 * rows(constrained), "a pays for its rows and masks");
    assert_eq!(b, rows(plain), "b draws unmasked and pays for its rows");
}

#[test]
fn a_prompt_being_scored_is_charged_for_its_logits_too() {
    // Two tenants, the same prompt; only b's is scored.
    let mut w = worker(4_096, 512, 4);
    let mut scored = request("b", 1, 3, 100);
    scored.sampling.prompt_logprobs = Some(2);
    let mut tracked = vec![w.submit(request("a", 1, 3, 100)), w.submit(scored)];
    w.run_until_ended(&mut tracked);
    let config = w.scheduler.model.model.config().clone();
    let (plain, scored) = (
        w.scheduler.waiting.charged("a"),
        w.scheduler.waiting.charged("b"),
    );
    // Every row's logits on top of the row itself, at what they cost
    // next to the layers (rounded up per chunk).
    let logits =
        (100 * config.logit_macs_per_token()).div_ceil(config.layer_macs_per_token()) as u128;
    assert!(logits > 0);
    assert!(
        (plain + logits..plain + logits + 8).contains(&scored),
        "{plain} plain, {scored} scored, {logits} for the logits"
    );
}

#[test]
fn one_pass_holds_the_logits_of_so_many_scored_rows_in_all() {
    let mut w = worker(4_096, 512, 8);
    w.scheduler.scoring_rows = 8;
    let mut handles = Vec::new();
    for (i, tenant) in ["a", "b", "c"].into_iter().enumerate() {
        let mut scored = request(tenant, 1, i as u32, 30);
        scored.sampling.prompt_logprobs = Some(1);
        handles.push(w.submit(scored).handle);
    }
    w.submit(request("d", 1, 9, 30));
    w.scheduler.admit(Instant::now());
    let work = w.scheduler.plan();
    let scored: Vec<usize> = work
        .iter()
        .filter(|w| w.logits == kvfence_model::Logits::All)
        .map(|w| w.tokens.len())
        .collect();
    // Split between their tenants: one tenant's long scored prompt does
    // not take every scoring row of every step until it is done.
    assert_eq!(scored.iter().sum::<usize>(), 8, "{scored:?}");
    assert_eq!(scored.len(), 3, "{scored:?}");
    // The plain prompt gets its tenant's share of the step as ever (a
    // quarter of the shared step's budget).
    let share = w.scheduler.step_budget() / 4;
    assert!(
        work.iter()
            .any(|w| w.logits == kvfence_model::Logits::None && w.tokens.len() == share),
        "a plain prompt is held back by them: {:?}",
        work.iter()
            .map(|w| (w.tokens.len(), w.logits))
            .collect::<Vec<_>>()
    );
    // Every scored prompt still gets all its scores, in its turn.
    for mut handle in handles {
        let scores = loop {
            w.scheduler.poll_delivering(Instant::now());
            match handle.try_next() {
                Ok(Event::Prompt { logprobs }) => break logprobs,
                Ok(other) => panic!("{other:?} before the scores"),
                Err(_) => {}
            }
        };
        assert_eq!(scores.len(), 29);
    }
}

#[test]
fn a_request_waiting_past_the_queue_deadline_is_refused_as_unavailable() {
    let mut w = worker_with(
        4_096,
        EngineConfig {
            max_running: 1,
            max_queue_wait: Duration::from_millis(100),
            ..EngineConfig::default()
        },
    );
    // One slot: a's long request holds it for 60 steps, b's waits.
    let running = w.submit(GenerationRequest {
        max_tokens: 60,
        ..request("a", 1, 1, 16)
    });
    let mut waiting = w.submit(request("b", 1, 2, 16));
    let start = Instant::now();
    let mut b_end = None;
    for i in 0..60u32 {
        w.scheduler
            .poll_delivering(start + Duration::from_millis(10) * i);
        while let Ok(event) = waiting.handle.try_next() {
            b_end.get_or_insert((event, i));
        }
    }
    let Some((Event::Failed { kind, message }, at)) = b_end else {
        panic!("the waiting request was not refused: {b_end:?}")
    };
    assert_eq!(kind, FailureKind::Unavailable);
    assert!(message.contains("waited"), "{message}");
    // Stamped at the first poll (0 ms), refused at the first poll past 100 ms.
    assert_eq!(at, 10);
    // The running request is untouched, and the queue's count is right.
    assert!(running.ended_at.is_none());
    assert_eq!(
        w.scheduler
            .counters
            .queue_timeouts
            .load(std::sync::atomic::Ordering::Relaxed),
        1
    );
}

#[test]
fn a_requests_choices_share_one_compiled_grammar_and_each_starts_fresh() {
    let mut w = worker(4_096, 64, 64);
    let constrained = |seed| GenerationRequest {
        max_tokens: 12,
        constraint: Some(kvfence_model::Grammar::Regex("[a-z]{3,8}".into()).into()),
        ..request("a", 1, seed, 24)
    };
    // Four choices of one prompt and grammar, as the server submits `n`.
    let mut handles: Vec<RequestHandle> = (0..4).map(|_| w.submit(constrained(1)).handle).collect();
    let mut texts = vec![String::new(); handles.len()];
    let mut ended = vec![false; handles.len()];
    for _ in 0..1_000 {
        w.scheduler.poll_delivering(Instant::now());
        for (i, handle) in handles.iter_mut().enumerate() {
            while let Ok(event) = handle.try_next() {
                match event {
                    Event::Token { text, .. } => texts[i].push_str(&text),
                    Event::Finished { .. } => ended[i] = true,
                    Event::Failed { message, .. } => panic!("a choice failed: {message}"),
                    Event::Prompt { .. } => panic!("no choice asked for scores"),
                }
            }
        }
        if ended.iter().all(|e| *e) {
            break;
        }
    }
    assert!(ended.iter().all(|e| *e));
    // Greedy and alike: every choice matched the grammar from its start,
    // none inherited another's progress through it.
    assert!(texts.iter().all(|t| t == &texts[0]), "{texts:?}");
    assert!(
        (3..=8).contains(&texts[0].len()) && texts[0].bytes().all(|b| b.is_ascii_lowercase()),
        "{:?}",
        texts[0]
    );
    assert_eq!(
        w.scheduler.grammars.compiled(),
        1,
        "compiled once for four choices"
    );
    let mut other = [w.submit(GenerationRequest {
        constraint: Some(kvfence_model::Grammar::Regex("[0-9]{2}".into()).into()),
        ..constrained(2)
    })];
    w.run_until_ended(&mut other);
    assert_eq!(w.scheduler.grammars.compiled(), 2);

    // Compiled where the request was made (the front door, off this
    // thread): the scheduler only copies it.
    let model = model();
    let config = model.model.config();
    let grammars =
        kvfence_model::Grammars::new(&model.tokenizer, config.vocab_size, &config.eos_token_ids)
            .unwrap();
    let grammar = kvfence_model::Grammar::Regex("[x-z]{4}".into());
    let start = grammars.compile(&grammar).unwrap();
    let mut handle = w
        .submit(GenerationRequest {
            constraint: Some(crate::Constrained::compiled(grammar, start)),
            ..constrained(3)
        })
        .handle;
    let mut text = String::new();
    for _ in 0..1_000 {
        w.scheduler.poll_delivering(Instant::now());
        match handle.try_next() {
            Ok(Event::Token { text: delta, .. }) => text.push_str(&delta),
            Ok(Event::Finished { .. }) => break,
            Ok(Event::Failed { message, .. }) => panic!("{message}"),
            Ok(Event::Prompt { .. }) => panic!("it did not ask for scores"),
            Err(_) => {}
        }
    }
    assert!(
        text.len() == 4 && text.bytes().all(|b| (b'x'..=b'z').contains(&b)),
        "{text:?}"
    );
    assert_eq!(w.scheduler.grammars.compiled(), 2, "not compiled again");
}

#[test]
fn i11_steps_are_short_once_the_worker_serves_more_than_one_tenant() {
    let mut w = worker_with(
        16_384,
        EngineConfig {
            step_tokens: 256,
            shared_step_tokens: 32,
            ..EngineConfig::default()
        },
    );
    let written = |w: &Worker| -> usize { w.scheduler.active.iter().map(|a| a.written).sum() };
    let mut tracked = vec![w.submit(request("a", 1, 1, 2_000))];
    w.step(&mut tracked);
    // Alone, a tenant's prompt goes at the full step.
    assert_eq!(written(&w), 256);
    tracked.push(w.submit(request("b", 1, 2, 2_000)));
    w.step(&mut tracked);
    // Two tenants: 32 tokens in all, 16 each.
    assert_eq!(written(&w), 256 + 32);
    assert!(w.scheduler.active.iter().all(|a| a.written % 16 == 0));
    w.run_until_ended(&mut tracked);
}

/// `request` at `priority`.
fn at_priority(tenant: &str, priority: i32, seed: u32) -> GenerationRequest {
    let mut request = request(tenant, 1, seed, 32);
    request.share = request.share.with_priority(priority);
    request
}

#[test]
fn a_higher_band_is_admitted_first_and_shares_hold_within_a_band() {
    // One slot: admission alone decides the order.
    let mut w = worker(4_096, 64, 1);
    let mut tracked: Vec<Tracked> = (0..4).map(|i| w.submit(at_priority("a", 0, i))).collect();
    tracked.extend((0..2).map(|i| w.submit(at_priority("b", 5, 10 + i))));
    // a's own urgent request passes its earlier ones, not b's.
    tracked.push(w.submit(at_priority("a", 5, 20)));
    w.run_until_ended(&mut tracked);
    let mut order: Vec<(usize, usize)> = tracked
        .iter()
        .enumerate()
        .map(|(i, t)| (t.ended_at.unwrap(), i))
        .collect();
    order.sort_unstable();
    let order: Vec<usize> = order.into_iter().map(|(_, i)| i).collect();
    // Band 5 first (b, a, b: fair shares within it; b's first is the
    // oldest on a tie), then band 0 in arrival order.
    assert_eq!(order, vec![4, 6, 5, 0, 1, 2, 3]);
}

#[test]
fn sheddable_work_is_refused_when_other_work_waits_and_only_then() {
    let mut w = worker(4_096, 64, 1);
    let outcome = |t: &mut Tracked| {
        let mut last = None;
        while let Ok(event) = t.handle.try_next() {
            last = Some(event);
        }
        last
    };
    let mut running = w.submit(GenerationRequest {
        max_tokens: 20,
        ..at_priority("a", 0, 1)
    });
    // Sheddable work behind sheddable work waits: nothing else needs room.
    let mut batch: Vec<Tracked> = (0..2)
        .map(|i| w.submit(at_priority("a", -1, 2 + i)))
        .collect();
    for _ in 0..3 {
        w.step(std::slice::from_mut(&mut running));
    }
    assert!(batch.iter_mut().all(|t| outcome(t).is_none()), "not shed");
    // Work that is not sheddable arrives and must wait for the slot: the
    // sheddable requests are refused at once, as unavailable.
    let mut urgent = [w.submit(at_priority("b", 0, 9))];
    w.step(std::slice::from_mut(&mut running));
    for t in &mut batch {
        match outcome(t) {
            Some(Event::Failed { kind, message }) => {
                assert_eq!(kind, FailureKind::Unavailable);
                assert!(message.contains("sheddable"), "{message}");
            }
            other => panic!("a sheddable request was not shed: {other:?}"),
        }
    }
    assert_eq!(
        w.scheduler
            .counters
            .shed
            .load(std::sync::atomic::Ordering::Relaxed),
        2
    );
    w.run_until_ended(&mut urgent);
    w.scheduler.check_counts();
}

#[test]
fn i11_growth_preempts_the_tenant_over_its_share_not_the_newcomer() {
    let mut w = worker(4_096, 256, 64);
    // b has used this worker before: the worker knows two tenants.
    let mut earlier = [w.submit(request("b", 1, 98, 20))];
    w.run_until_ended(&mut earlier);
    // a's two long requests hold 178 of the 256 pages once prefilled, under
    // its three-quarter cap (192), and grow a page every 16 tokens.
    let long = |seed| GenerationRequest {
        max_tokens: 900,
        ..request("a", 1, seed, 1_400)
    };
    let mut tracked = vec![w.submit(long(1)), w.submit(long(2))];
    for _ in 0..12 {
        w.step(&mut tracked);
    }
    // b's request arrives last and fills the rest of the pool.
    let newcomer = w.submit(GenerationRequest {
        max_tokens: 400,
        ..request("b", 1, 99, 900)
    });
    let b_id = RequestId(w.next_id - 1);
    tracked.push(newcomer);
    let preempted = |w: &Worker| {
        w.scheduler
            .counters
            .preempted
            .load(std::sync::atomic::Ordering::Relaxed)
    };
    for _ in 0..2_000 {
        w.step(&mut tracked);
        if preempted(&w) > 0 {
            break;
        }
    }
    assert!(preempted(&w) > 0, "the pool never ran out");
    // a holds three quarters of the pool, over its half; its newest
    // request gave its pages back, and b's — the most recently admitted —
    // kept running.
    assert!(
        w.scheduler.active.iter().any(|a| a.pending.id == b_id),
        "b's request was preempted"
    );
    assert!(
        w.scheduler
            .waiting
            .iter()
            .all(|p| p.request.share.tenant == "a")
    );
    w.run_until_ended(&mut tracked);
}

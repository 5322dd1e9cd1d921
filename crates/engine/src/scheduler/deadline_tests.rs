//! Hand-off deadlines on a virtual clock: a decode worker measures its
//! prefill worker's silence, not the prompt's length. A prompt that takes
//! far longer than the silence deadline to prefill still commits while the
//! prefill worker sends chunks or progress reports — queued behind others
//! included —, a worker that goes silent still fails the request within the
//! silence deadline, and one that keeps talking but never finishes fails at
//! the grant's whole-life deadline, which scales with the prompt (I4's
//! paths are unchanged: the abort is the same).

// In a test, a panic is the failure report.
#![allow(clippy::unwrap_used)]

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::sync::mpsc;
use std::time::{Duration, Instant};

use kvfence_pool::{ElemType, Pool, PoolSize, PoolSpec, RequestId, Scrub};

use super::{Command, PeerId, PeerTx, PeerUp, Pending, Role, Scheduler};
use crate::config::EngineConfig;
use crate::counters::Counters;
use crate::request::{Event, FailureKind, GenerationRequest, RequestHandle};

const SILENCE: Duration = Duration::from_millis(50);
/// A 400-token grant's whole life: 50 ms + 400 × 2 ms = 850 ms.
const PER_TOKEN: Duration = Duration::from_millis(2);

use crate::testing::tiny_model as model;

/// A decode and a prefill scheduler joined by channels, on one virtual
/// clock; every prefill step takes `step_time`.
struct Pair {
    decode: Scheduler,
    prefill: Scheduler,
    decode_counters: Arc<Counters>,
    to_prefill: mpsc::Receiver<Command>,
    to_decode: mpsc::Receiver<Command>,
    base: Instant,
    now: Duration,
    step_time: Duration,
    next_id: u64,
}

fn scheduler(role: Role, max_running: usize) -> (Scheduler, Arc<Counters>) {
    let model = model();
    let spec = PoolSpec::new(
        model.model.kv_shape(),
        16,
        ElemType::F32,
        PoolSize::Tokens(8_192),
    )
    .with_scrub(Scrub::Poison);
    let config = EngineConfig {
        max_running,
        step_tokens: 16,
        handoff_timeout: SILENCE,
        handoff_time_per_token: PER_TOKEN,
        ..EngineConfig::default()
    };
    let counters = Arc::new(Counters::default());
    let scheduler = Scheduler::new(
        role,
        model,
        Pool::new(&spec).unwrap(),
        config,
        Arc::clone(&counters),
    );
    (scheduler, counters)
}

impl Pair {
    /// `prefill_running`: orders the prefill worker computes at once.
    fn new(prefill_running: usize, step_time: Duration) -> Pair {
        let (mut decode, decode_counters) = scheduler(Role::Decode, 8);
        let (mut prefill, _) = scheduler(Role::Prefill, prefill_running);
        let (to_prefill_tx, to_prefill) = mpsc::channel();
        let (to_decode_tx, to_decode) = mpsc::channel();
        decode.feed(Command::PeerUp(Box::new(PeerUp {
            peer: PeerId(1),
            tx: PeerTx::new(to_prefill_tx, PeerId(2)),
            name: "prefill".into(),
            tokens: 8_192,
        })));
        prefill.feed(Command::PeerUp(Box::new(PeerUp {
            peer: PeerId(2),
            tx: PeerTx::new(to_decode_tx, PeerId(1)),
            name: "decode".into(),
            tokens: 0,
        })));
        Pair {
            decode,
            prefill,
            decode_counters,
            to_prefill,
            to_decode,
            base: Instant::now(),
            now: Duration::ZERO,
            step_time,
            next_id: 1,
        }
    }

    fn submit(&mut self, prompt_tokens: usize) -> RequestHandle {
        let request = GenerationRequest {
            ignore_eos: true,
            ..GenerationRequest::greedy(
                (0..prompt_tokens as u32).map(|i| (i * 13) % 250).collect(),
                2,
            )
        };
        let id = RequestId(self.next_id);
        self.next_id += 1;
        let (pending, handle) = Pending::for_client(id, request, None);
        self.decode_counters.queued.fetch_add(1, Ordering::AcqRel);
        self.decode.feed(Command::Submit(Box::new(pending)));
        handle
    }

    /// Delivers what each side sent, then polls both; the prefill side only
    /// if `prefill_alive`. A prefill step moves the clock by `step_time`.
    fn round(&mut self, prefill_alive: bool) {
        for command in self.to_prefill.try_iter() {
            if prefill_alive {
                self.prefill.feed(command);
            }
        }
        for command in self.to_decode.try_iter() {
            self.decode.feed(command);
        }
        let now = self.base + self.now;
        if prefill_alive && self.prefill.poll_delivering(now) {
            self.now += self.step_time;
        } else {
            self.now += Duration::from_millis(1);
        }
        self.decode.poll_delivering(self.base + self.now);
    }

    /// Runs until every handle ended; each request's ending and when.
    fn run(
        &mut self,
        handles: &mut [RequestHandle],
        prefill_alive: bool,
    ) -> Vec<(Event, Duration)> {
        let mut ended: Vec<Option<(Event, Duration)>> = vec![None; handles.len()];
        while self.now < Duration::from_secs(60) {
            self.round(prefill_alive);
            for (handle, end) in handles.iter_mut().zip(&mut ended) {
                while end.is_none()
                    && let Ok(event) = handle.try_next()
                {
                    if !matches!(event, Event::Token { .. }) {
                        *end = Some((event, self.now));
                    }
                }
            }
            if ended.iter().all(Option::is_some) {
                return ended.into_iter().map(Option::unwrap).collect();
            }
        }
        panic!("requests never ended");
    }
}

#[test]
fn a_prompt_longer_than_the_silence_deadline_commits_while_its_prefill_worker_talks() {
    // Two prompts of 400 tokens, 16 a step, 10 ms a step: 250 ms each, five
    // times the silence deadline. The prefill worker computes one at a time,
    // so the second waits 250 ms in its queue with no chunk to show: only
    // progress reports keep its grant alive.
    let mut pair = Pair::new(1, Duration::from_millis(10));
    let mut handles = [pair.submit(400), pair.submit(400)];
    let ended = pair.run(&mut handles, true);
    for (event, at) in &ended {
        assert!(
            matches!(event, Event::Finished { .. }),
            "{event:?} at {at:?}"
        );
    }
    assert!(ended[1].1 > SILENCE * 9, "the second took {:?}", ended[1].1);
}

#[test]
fn a_silent_prefill_worker_fails_the_request_within_the_silence_deadline() {
    let mut pair = Pair::new(1, Duration::from_millis(10));
    let mut handles = [pair.submit(400)];
    let ended = pair.run(&mut handles, false);
    let (Event::Failed { kind, message }, at) = &ended[0] else {
        panic!("{:?}", ended[0])
    };
    assert_eq!(*kind, FailureKind::Unavailable);
    assert!(message.contains("went silent"), "{message}");
    assert!(
        *at >= SILENCE && *at <= SILENCE + Duration::from_millis(2),
        "{at:?}"
    );
    assert_eq!(pair.decode.pool.stats().leased_pages, 0, "I8");
}

#[test]
fn a_talking_prefill_worker_that_never_finishes_fails_at_the_prompts_deadline() {
    // 40 ms a step keeps every report inside the silence deadline, but 25
    // steps take 1 s, past the grant's whole life.
    let mut pair = Pair::new(1, Duration::from_millis(40));
    let mut handles = [pair.submit(400)];
    let ended = pair.run(&mut handles, true);
    let (Event::Failed { kind, message }, at) = &ended[0] else {
        panic!("{:?}", ended[0])
    };
    assert_eq!(*kind, FailureKind::Unavailable);
    assert!(message.contains("the prompt's deadline"), "{message}");
    let deadline = SILENCE + PER_TOKEN * 400;
    assert!(
        *at >= deadline && *at <= deadline + Duration::from_millis(41),
        "{at:?}"
    );
    assert_eq!(pair.decode.pool.stats().leased_pages, 0, "I8");
}

//! A step paused between two layers (I11): a command that arrives during a
//! step is taken before the step ends, another tenant's new prompt runs in
//! an express step of its own, and the paused step then ends exactly as it
//! would have — while nothing ends one of its requests under it.

// In a test, a panic is the failure report.
#![allow(clippy::unwrap_used)]

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::sync::mpsc;
use std::time::Instant;

use kvfence_handoff::Message;
use kvfence_pool::{ElemType, Pool, PoolSize, PoolSpec, RequestId, Scrub};

use super::{Command, ComputeTurn, PeerId, PeerTx, PeerUp, Pending, Role, Scheduler, Shell};
use crate::config::EngineConfig;
use crate::counters::Counters;
use crate::request::{Event, GenerationRequest, RequestHandle, Share};
use crate::testing::tiny_model;

struct Worker {
    scheduler: Shell,
    counters: Arc<Counters>,
    /// The scheduler's inbox, as the shell's clients and peers reach it.
    inbox: mpsc::Sender<Command>,
    next_id: u64,
}

fn worker() -> Worker {
    worker_sharing(Arc::default())
}

/// A worker taking turns on the compute pool by `turn`.
fn worker_sharing(turn: Arc<ComputeTurn>) -> Worker {
    let model = tiny_model();
    let spec = PoolSpec::new(
        model.model.kv_shape(),
        16,
        ElemType::F32,
        PoolSize::Tokens(2048),
    )
    .with_scrub(Scrub::Poison);
    let (inbox, receiver) = mpsc::channel();
    let counters = Arc::new(Counters::default());
    let config = EngineConfig {
        step_tokens: 64,
        ..EngineConfig::default()
    };
    let scheduler = Shell::new(
        Scheduler::new(
            Role::Colocated,
            model,
            Pool::new(&spec).unwrap(),
            config,
            Arc::clone(&counters),
        )
        .sharing_turn(turn),
        receiver,
    );
    Worker {
        scheduler,
        counters,
        inbox,
        next_id: 1,
    }
}

fn request(tenant: &str, seed: u32, len: usize, max_tokens: usize) -> GenerationRequest {
    GenerationRequest {
        ignore_eos: true,
        share: Share::new(tenant, 1),
        ..GenerationRequest::greedy(
            (0..len as u32).map(|i| (i * 7 + seed * 31) % 250).collect(),
            max_tokens,
        )
    }
}

impl Worker {
    /// A client's request as the shell gets it: through the inbox, seen by
    /// the step in flight between two of its layers.
    fn send(&mut self, request: GenerationRequest) -> RequestHandle {
        let id = RequestId(self.next_id);
        self.next_id += 1;
        let (pending, handle) = Pending::for_client(id, request, None);
        self.counters.queued.fetch_add(1, Ordering::AcqRel);
        self.inbox.send(Command::Submit(Box::new(pending))).unwrap();
        handle
    }

    /// What the shell does each turn: take the commands, then poll.
    fn turn(&mut self) {
        self.scheduler.take_commands();
        self.scheduler.poll(Instant::now());
    }

    /// A poll with a command still in the inbox, as when one arrives
    /// during the step the poll runs.
    fn poll_while_it_arrives(&mut self) {
        self.scheduler.poll(Instant::now());
    }

    fn paused(&self) -> bool {
        self.scheduler.core.in_flight.is_some()
    }

    /// Turns until `handle`'s request ends: its text after `text`.
    fn finish(&mut self, handle: &mut RequestHandle, mut text: String) -> String {
        for _ in 0..1000 {
            if drain(handle, &mut text) {
                return text;
            }
            self.turn();
        }
        panic!("the request never ended");
    }
}

/// The tokens a handle has received, and whether it finished.
fn drain(handle: &mut RequestHandle, text: &mut String) -> bool {
    let mut finished = false;
    while let Ok(event) = handle.try_next() {
        match event {
            Event::Token { text: piece, .. } => text.push_str(&piece),
            Event::Finished { .. } => finished = true,
            Event::Failed { message, .. } => panic!("a request failed: {message}"),
            Event::Prompt { .. } => panic!("no request asked for scores"),
        }
    }
    finished
}

/// Runs one request alone to its end: its text.
fn alone(request: GenerationRequest) -> String {
    let mut w = worker();
    let mut handle = w.send(request);
    w.finish(&mut handle, String::new())
}

#[test]
fn another_tenants_prompt_runs_in_a_pause_of_the_step_in_flight() {
    let long = request("a", 1, 200, 4);
    let short = request("b", 2, 9, 3);
    let (long_alone, short_alone) = (alone(long.clone()), alone(short.clone()));

    let mut w = worker();
    let mut a = w.send(long);
    w.turn();
    assert!(!w.paused(), "with nothing arriving, a step runs whole");
    let steps = w.counters.steps.load(Ordering::Relaxed);

    // B's request arrives while a's next chunk is computed: the pass stops
    // after its first layer with the command taken off the inbox.
    let mut b = w.send(short);
    w.poll_while_it_arrives();
    assert!(w.paused(), "the step paused for the arrival");
    assert_eq!(w.counters.steps.load(Ordering::Relaxed), steps);

    // The next turn takes it, runs b's prompt in an express step — b's
    // first token is out before a's step ends — and ends a's step.
    let (mut a_text, mut b_text) = (String::new(), String::new());
    w.turn();
    assert!(!w.paused());
    assert_eq!(w.counters.express_steps.load(Ordering::Relaxed), 1);
    assert_eq!(w.counters.steps.load(Ordering::Relaxed), steps + 2);
    drain(&mut b, &mut b_text);
    assert!(
        !b_text.is_empty(),
        "b's first token came from the express step"
    );

    let mut a_done = false;
    let mut b_done = false;
    for _ in 0..1000 {
        a_done |= drain(&mut a, &mut a_text);
        b_done |= drain(&mut b, &mut b_text);
        if a_done && b_done {
            break;
        }
        w.turn();
    }
    assert!(a_done && b_done);
    // Pausing, and another prompt's pass in the pause, change no bit.
    assert_eq!(a_text, long_alone);
    assert_eq!(b_text, short_alone);
}

#[test]
fn a_tenant_with_work_in_the_paused_step_gets_no_express_step() {
    let mut w = worker();
    let mut first = w.send(request("a", 1, 200, 1));
    w.turn();
    let mut second = w.send(request("a", 2, 9, 1));
    w.poll_while_it_arrives();
    assert!(w.paused());
    w.turn();
    assert_eq!(w.counters.express_steps.load(Ordering::Relaxed), 0);
    let mut text = String::new();
    for _ in 0..1000 {
        if drain(&mut first, &mut text) & drain(&mut second, &mut text) {
            return;
        }
        w.turn();
    }
    panic!("the requests never ended");
}

#[test]
fn a_request_cancelled_during_its_paused_step_is_released_after_the_step() {
    let mut w = worker();
    let a = w.send(request("a", 1, 200, 4));
    w.turn();
    let _b = w.send(request("b", 2, 9, 1));
    w.poll_while_it_arrives();
    assert!(w.paused());
    // a's client goes away while its pass holds a's positions.
    drop(a);
    w.turn();
    assert!(!w.paused());
    w.turn();
    assert_eq!(w.counters.cancelled.load(Ordering::Relaxed), 1);
    assert_eq!(
        w.scheduler.core.pool.stats().leased_pages,
        0,
        "every page came back"
    );
}

#[test]
fn a_prompt_whose_last_chunk_is_due_runs_before_another_tenants_chunks() {
    let short = request("b", 2, 9, 3);
    let short_alone = alone(short.clone());
    let mut w = worker();
    let _a = w.send(request("a", 1, 200, 4));
    w.turn();
    let steps = w.counters.steps.load(Ordering::Relaxed);
    // B arrives between two steps: the next one would hold b's whole
    // prompt and a's next chunk; b's runs first, alone.
    let mut b = w.send(short);
    w.turn();
    assert_eq!(w.counters.express_steps.load(Ordering::Relaxed), 1);
    assert_eq!(w.counters.steps.load(Ordering::Relaxed), steps + 2);
    let mut text = String::new();
    drain(&mut b, &mut text);
    assert!(!text.is_empty(), "b's first token came from its own step");
    assert_eq!(w.finish(&mut b, text), short_alone);
}

#[test]
fn a_short_prompt_goes_first_when_another_tenants_prompts_also_end_in_the_step() {
    // The flood of short prompts: a's chunks in the next step are last
    // chunks too, so "finishing" alone does not set b's apart from them.
    let short = request("b", 2, 4, 3);
    let short_alone = alone(short.clone());
    let mut w = worker();
    let _a: Vec<RequestHandle> = (0..3).map(|i| w.send(request("a", 10 + i, 8, 2))).collect();
    let mut b = w.send(short);
    w.turn();
    assert_eq!(
        w.counters.express_steps.load(Ordering::Relaxed),
        1,
        "b's 4 tokens ran apart from a's 24"
    );
    assert_eq!(w.counters.steps.load(Ordering::Relaxed), 2);
    assert_eq!(
        w.finish(&mut b, String::new()),
        short_alone,
        "going first changed none of b's bits"
    );
}

#[test]
fn the_shorter_tenants_go_first_and_never_all_of_the_step() {
    let mut w = worker();
    // Three tenants' prompts end in the next step: 5, 6 and 20 tokens.
    // Shortest first while they stay the shorter part: b and c (11 ≤ 20)
    // in one express step, then a's alone.
    let _a = w.send(request("a", 1, 20, 2));
    let _b = w.send(request("b", 2, 5, 2));
    let _c = w.send(request("c", 3, 6, 2));
    w.turn();
    assert_eq!(w.counters.express_steps.load(Ordering::Relaxed), 1);
    assert_eq!(w.counters.steps.load(Ordering::Relaxed), 2);
    // Two tenants with one prompt each of the same length: one of them
    // goes first (the step is split in two equal halves, never emptied).
    let mut w = worker();
    let _a = w.send(request("a", 1, 8, 2));
    let _b = w.send(request("b", 2, 8, 2));
    w.turn();
    assert_eq!(w.counters.express_steps.load(Ordering::Relaxed), 1);
    assert_eq!(w.counters.steps.load(Ordering::Relaxed), 2);
}

#[test]
fn a_pass_gives_the_pool_to_the_other_worker_between_layers_and_keeps_its_bits() {
    let long = request("a", 1, 40, 4);
    let expected = alone(long.clone());
    // The process's other worker waits for the pool all along.
    let mut w = worker_sharing(Arc::new(ComputeTurn::always_wanted()));
    let mut a = w.send(long);
    let mut text = String::new();
    let mut pauses = 0;
    for _ in 0..1000 {
        w.turn();
        pauses += usize::from(w.paused());
        if drain(&mut a, &mut text) {
            assert!(
                pauses >= 4,
                "every pass stopped at its layer boundaries: {pauses} pauses"
            );
            assert_eq!(text, expected, "a pass in turns computes the same bits");
            return;
        }
    }
    panic!("a never ended");
}

/// A prefill worker's view of one link: what it sends back to the decode
/// worker, in order, by kind.
fn kinds_sent(to_decode: &mpsc::Receiver<Command>) -> Vec<&'static str> {
    to_decode
        .try_iter()
        .filter_map(|command| match command {
            Command::Frame { frame, .. } => Message::decode(&frame).ok().flatten(),
            _ => None,
        })
        .map(|(message, _)| match message {
            Message::Chunk { .. } => "chunk",
            Message::Done { .. } => "done",
            Message::Abort { .. } => "abort",
            Message::AbortAck { .. } => "abort-ack",
            Message::Progress { .. } => "progress",
            Message::Reject { .. } => "reject",
            Message::Grant { .. } => "grant",
        })
        .collect()
}

#[test]
fn an_abort_that_arrives_during_a_step_is_acknowledged_after_the_step_ships() {
    // A decode worker whose orders and aborts reach the prefill worker's
    // inbox, where its step in flight sees them arrive.
    let model = tiny_model();
    let pool = || {
        let spec = PoolSpec::new(
            model.model.kv_shape(),
            16,
            ElemType::F32,
            PoolSize::Tokens(2048),
        );
        Pool::new(&spec).unwrap()
    };
    let config = EngineConfig {
        step_tokens: 64,
        ..EngineConfig::default()
    };
    let (prefill_inbox, prefill_receiver) = mpsc::channel();
    let (decode_inbox, decode_receiver) = mpsc::channel();
    let mut prefill = Shell::new(
        Scheduler::new(
            Role::Prefill,
            Arc::clone(&model),
            pool(),
            config,
            Arc::new(Counters::default()),
        ),
        prefill_receiver,
    );
    let decode_counters = Arc::new(Counters::default());
    let mut decode = Scheduler::new(
        Role::Decode,
        Arc::clone(&model),
        pool(),
        config,
        Arc::clone(&decode_counters),
    );
    decode.feed(Command::PeerUp(Box::new(PeerUp {
        peer: PeerId(1),
        tx: PeerTx::new(prefill_inbox.clone(), PeerId(2)),
        name: "prefill".into(),
        tokens: 2048,
    })));
    prefill_inbox
        .send(Command::PeerUp(Box::new(PeerUp {
            peer: PeerId(2),
            tx: PeerTx::new(decode_inbox.clone(), PeerId(1)),
            name: "decode".into(),
            tokens: 0,
        })))
        .unwrap();
    let (pending, handle) = Pending::for_client(RequestId(1), request("a", 1, 300, 2), None);
    decode_counters.queued.fetch_add(1, Ordering::AcqRel);
    decode.feed(Command::Submit(Box::new(pending)));
    decode.poll_delivering(Instant::now());
    prefill.take_commands();
    prefill.poll(Instant::now());
    assert!(prefill.core.in_flight.is_none(), "the first step ran whole");

    // The client goes away; decode aborts the grant while prefill computes
    // its next chunk, whose pages it ships when the step ends.
    drop(handle);
    decode.poll_delivering(Instant::now());
    prefill.poll(Instant::now());
    assert!(
        prefill.core.in_flight.is_some(),
        "the abort paused the step"
    );
    prefill.take_commands();
    assert!(
        !kinds_sent(&decode_receiver).contains(&"abort-ack"),
        "no acknowledgement while the step may still ship"
    );
    prefill.poll(Instant::now());
    assert!(prefill.core.in_flight.is_none());
    let sent = kinds_sent(&decode_receiver);
    assert_eq!(
        sent.last(),
        Some(&"abort-ack"),
        "the acknowledgement is the last word on the hand-off: {sent:?}"
    );
    assert!(sent.contains(&"chunk"), "the step shipped pages: {sent:?}");
}

#[test]
fn only_a_prompt_that_ends_within_what_is_left_of_the_paused_step_goes_express() {
    let mut w = worker();
    let _a = w.send(request("a", 1, 12, 50));
    w.turn();
    // a decodes, a row a step; b's prompt, within a step's budget but
    // longer than a row, arrives during one of them.
    let _b = w.send(request("b", 2, 40, 1));
    w.poll_while_it_arrives();
    assert!(w.paused());
    w.turn();
    assert_eq!(
        w.counters.express_steps.load(Ordering::Relaxed),
        0,
        "a one-row step is not held up for 40 tokens"
    );
}

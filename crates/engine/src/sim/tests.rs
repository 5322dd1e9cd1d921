//! The fleet simulator's runs: many seeded worlds of full KV and of
//! sliding windows, each checked for every invariant, and two worlds made
//! by hand (a prefill worker's bound on one link's orders; tenants'
//! weighted shares across the fleet, I11).

use super::*;

fn run_seed(seed: u64, kv: Kv) -> Result<(), (String, Vec<String>)> {
    let mut world = World::new(seed, kv);
    world.run().map_err(|error| (error, world.log.clone()))
}

/// Runs `default_seeds` worlds whose workers keep `kv` (or the seeds the
/// environment names) and checks every invariant in each.
fn run_worlds(kv: Kv, default_seeds: u64) {
    let replay = |seed| {
        format!(
            "KVFENCE_FLEET_SIM_SEED={seed} cargo test -p kvfence-engine --lib sim:: -- --nocapture"
        )
    };
    if let Ok(seed) = std::env::var("KVFENCE_FLEET_SIM_SEED") {
        let seed: u64 = seed.parse().expect("KVFENCE_FLEET_SIM_SEED is a number");
        if let Err((error, log)) = run_seed(seed, kv) {
            panic!("{kv:?} seed {seed}: {error}\n{}", log.join("\n"));
        }
        return;
    }
    // The simulator's pools are harsh already (newest freed page first,
    // poisoned on free): CI's harsh-pools pass adds nothing here but time.
    let default_seeds = if std::env::var_os("KVFENCE_HARSH_POOLS").is_some() {
        default_seeds / 10
    } else {
        default_seeds
    };
    let seeds: u64 = std::env::var("KVFENCE_FLEET_SIM_SEEDS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(default_seeds);
    let (mut finished, mut faulty, mut past_windows) = (0usize, 0usize, 0usize);
    for seed in 0..seeds {
        let mut world = World::new(seed, kv);
        if let Err(error) = world.run() {
            panic!("{kv:?} seed {seed}: {error}\nreplay: {}", replay(seed));
        }
        faulty += usize::from(world.faulty);
        let done = || {
            world
                .clients
                .iter()
                .filter(|c| c.ended == Some(Ending::Finished))
        };
        finished += done().count();
        // Prompts whose windowed layers read from past position 0 (the
        // window, 40, ends past the first 128-position chunk).
        past_windows += done().filter(|c| c.request.prompt.len() > 168).count();
    }
    if kv == Kv::Windows {
        assert!(
            past_windows as u64 > seeds / 2,
            "{past_windows} prompts past a window finished in {seeds} seeds"
        );
    }
    // The runs really exercised something.
    assert!(
        finished as u64 > seeds * 2,
        "{finished} requests finished in {seeds} seeds"
    );
    assert!(
        faulty as u64 > seeds / 2,
        "{faulty} of {seeds} seeds had faults"
    );
}

#[test]
fn the_whole_fleet_holds_every_invariant_under_crashes_partitions_and_aborts() {
    run_worlds(Kv::Full, 2_000);
}

/// The same worlds over a model with sliding-window layers, every worker
/// keeping only the windows: prompts run past the window, hand-offs carry
/// each window alone, and every answer is still the full-KV answer.
#[test]
fn a_fleet_keeping_only_sliding_windows_holds_every_invariant_too() {
    run_worlds(Kv::Windows, 200);
}

/// One decode link cannot make a prefill worker hold more orders than it
/// could queue and run: the one past that is rejected as busy at once, and
/// another link's orders are still taken.
#[test]
fn a_prefill_worker_bounds_the_orders_one_link_may_hold() {
    use kvfence_handoff::{Message, Receiver, RejectReason};

    use crate::scheduler::{PrefillOrder, ToPeer};

    let model = model();
    let config = EngineConfig {
        max_running: 1,
        max_queue: 2,
        step_tokens: 16,
        shared_step_tokens: 16,
        handoff_timeout: HANDOFF_TIMEOUT,
        handoff_time_per_token: STEP,
        max_queue_wait: DEADLINE * 2,
        shared: false,
    };
    let mut prefill = Scheduler::new(
        Role::Prefill,
        Arc::clone(&model),
        pool(&model, 1024, Scrub::Poison, false),
        config,
        Arc::new(Counters::default()),
    );
    let decode_pool = pool(&model, 1024, Scrub::Poison, false);
    let mut receiver = Receiver::new();
    // The decode end of link n is named 10 × n: the stamp on what the
    // prefill worker sends says which link it goes on.
    for link in [PeerId(1), PeerId(2)] {
        let sent = prefill.handle(Command::PeerUp(Box::new(PeerUp {
            peer: link,
            tx: PeerTx::routed(PeerId(10 * link.0)),
            name: format!("decode-{}", link.0),
            tokens: 0,
        })));
        assert!(sent.is_empty());
    }
    let order = |receiver: &mut Receiver, id: u64| {
        let lease = decode_pool.lease(RequestId(id), 8).unwrap();
        let grant = receiver
            .grant(kvfence_handoff::HandoffId(id), lease, 4)
            .unwrap();
        let request = GenerationRequest {
            ignore_eos: true,
            ..GenerationRequest::greedy(vec![1, 2, 3, 4], 1)
        };
        Box::new(PrefillOrder {
            grant: grant.to_frame(),
            request,
            window: None,
        })
    };
    // Three orders fill link 1's share (queue 2 + running 1); the fourth
    // is refused, and link 2's first is taken.
    let mut sent = Vec::new();
    for id in 1..=4 {
        let order = order(&mut receiver, id);
        sent.extend(prefill.handle(Command::Prefill {
            peer: PeerId(1),
            order,
        }));
    }
    let order_2 = order(&mut receiver, 5);
    sent.extend(prefill.handle(Command::Prefill {
        peer: PeerId(2),
        order: order_2,
    }));
    let rejected: Vec<(PeerId, u64, RejectReason)> = sent
        .into_iter()
        .map(|effect| match effect {
            Effect::Peer {
                to,
                message: ToPeer::Frame(frame),
            } => match Message::decode(&frame) {
                Ok(Some((Message::Reject { id, reason }, _))) => (to.stamp(), id.0, reason),
                other => panic!("only a rejection is sent at once, not {other:?}"),
            },
            _ => panic!("only a rejection is sent at once"),
        })
        .collect();
    assert_eq!(
        rejected,
        vec![(PeerId(10), 4, RejectReason::Busy)],
        "link 1's fourth order is refused, link 2's first is taken"
    );
}

/// A fleet without faults where two tenants of weights 1 and 2 each send
/// 24 prompt-heavy requests at once, the lighter tenant's first: halfway
/// through, the heavier tenant has had about twice the lighter one's
/// share on every worker together (I11), not the arrival order's none.
#[test]
fn i11_a_fleet_shares_its_workers_between_tenants_by_weight() {
    for seed in 0..8 {
        let mut world = World::new(seed, Kv::Full);
        world.faults.clear();
        world.faulty = false;
        let client = |tenant: &str, weight: u32, i: usize, arrives: u64| {
            let request = GenerationRequest {
                prompt: (0..40).map(|j| ((j * 11 + i * 37) % 256) as u32).collect(),
                max_tokens: 1,
                share: Share::new(tenant, weight),
                cache: Some(CacheScope::tenant(tenant, None)),
                ..request_from(&mut ChaCha8Rng::seed_from_u64(0), Kv::Full)
            };
            Client::new(request, Duration::from_micros(arrives), None)
        };
        world.clients = (0..24)
            .map(|i| client("light", 1, i, 0))
            .chain((0..24).map(|i| client("heavy", 2, 100 + i, 1)))
            .collect();
        let finished = |world: &World, tenant: &str| {
            world
                .clients
                .iter()
                .filter(|c| c.request.share.tenant == tenant && c.ended == Some(Ending::Finished))
                .count()
        };
        let (light, heavy) = loop {
            world.round().unwrap();
            let (light, heavy) = (finished(&world, "light"), finished(&world, "heavy"));
            if light + heavy >= 24 {
                break (light, heavy);
            }
            world.t = world.next_due().expect("work left");
            assert!(world.t < DEADLINE, "seed {seed}: stuck");
        };
        assert!(
            (12..=20).contains(&heavy),
            "seed {seed}: of the first {} requests done, {heavy} were the heavier tenant's and {light} the lighter's",
            light + heavy
        );
    }
}

//! A deterministic simulation of a whole fleet: a router, prefill and
//! decode workers — the real schedulers, with real pools and the real
//! `builtin:tiny` model — and the links between them, on one virtual clock,
//! driven from a seed.
//!
//! The schedulers are state machines fed through [`Scheduler::handle`] and
//! [`Scheduler::poll`]; this simulation reads the effects they return,
//! hands clients their events and carries peers' messages over its links
//! after a latency, in order per link direction (as TCP does), into each
//! worker's inbox — where a step in flight may see them between two layers. The world has crashes and restarts of either kind of worker (a
//! restarted one has a fresh pool and fresh links), partitions (a link
//! breaks and is dialled again later, under new link ids), slow links
//! (long enough for hand-off timeouts), client aborts and the incident's
//! prompt — one that fits a decode pool but no prefill pool. Two decode
//! workers number their requests the same way (1, 2, 3…), as real ones do,
//! so hand-off ids collide on a shared prefill worker.
//!
//! Every worker keeps a prefix cache and requests come from two tenants
//! whose prompts share prefixes, so shared pages are sealed, read, copied,
//! evicted and skipped by hand-offs through all of the above.
//!
//! A second run of worlds serves a model with sliding-window layers
//! ([`Kv::Windows`]): every worker keeps only the windows, prompts run past
//! them, and hand-offs carry only what decode reads.
//!
//! After every event it checks:
//! - I1/I8: every live pool's pages add up (free + leased + shared +
//!   quarantined);
//! - I9: a request reports no more cached tokens than its own tenant's
//!   prompts routed before it ended share with it;
//! - I2/I5/I7: a request that finishes produced exactly the text and token
//!   count it produces alone on a colocated engine — a foreign, stale or
//!   missing page would change it;
//! - I5/I7: no request fails with an internal error (a check caught a bug:
//!   a placeholder `Done`, a chunk for someone else's grant); without
//!   faults, a request fails only as too long, and only if its prompt fits
//!   no prefill pool; no event follows a request's end;
//! - liveness: once the world heals, every request ends, and every pool is
//!   back at baseline with nothing queued or running.
//!
//! `cargo test -p kvfence-engine --lib sim::` runs 2,000 seeds of full KV
//! and 200 of windows; `KVFENCE_FLEET_SIM_SEEDS=N` runs N of each;
//! `KVFENCE_FLEET_SIM_SEED=S` replays one (of both).

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use kvfence_model::{LoadedModel, PromptLogprob, SamplingParams, StopStrings};
use kvfence_pool::{
    ElemType, LayerGroups, Pool, PoolSize, PoolSpec, RequestId, ReusePolicy, Scrub,
};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use crate::Engine;
use crate::config::EngineConfig;
use crate::config::Role;
use crate::counters::Counters;
use crate::request::{CacheScope, Event, FailureKind, GenerationRequest, RequestHandle, Share};
use crate::scheduler::{Command, Effect, PeerId, PeerTx, PeerUp, Pending, Scheduler};
use crate::trace::TraceContext;
use node::Node;

const PAGE: usize = 16;
const HANDOFF_TIMEOUT: Duration = Duration::from_millis(300);
/// Virtual time one forward pass takes.
const STEP: Duration = Duration::from_millis(1);
/// Faults and arrivals happen before this; then the world heals.
const CHAOS: Duration = Duration::from_millis(400);
/// Everything must have ended by then.
const DEADLINE: Duration = Duration::from_secs(30);

use crate::testing::tiny_model as model;

/// What the workers of a world keep of their KV.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
enum Kv {
    /// `builtin:tiny`, every position.
    Full,
    /// A tiny model whose every other layer attends through a window of
    /// 40 positions; every pool keeps only the windows.
    Windows,
}

impl Kv {
    fn model(self) -> Arc<LoadedModel> {
        match self {
            Kv::Full => model(),
            Kv::Windows => crate::testing::windowed_model(),
        }
    }

    /// A worker's pool of `tokens` for this model, its layers grouped as
    /// a worker of `config` groups them.
    fn pool(self, tokens: usize, config: &EngineConfig) -> Pool {
        let model = self.model();
        let groups = match self {
            Kv::Full => None,
            Kv::Windows => Some(model.model.layer_groups(config.longest_write()).unwrap()),
        };
        pool_of(&model, tokens, Scrub::Poison, true, groups)
    }
}

/// What a request produces alone on a colocated engine that keeps every
/// position of `kv`'s model: its text and completion tokens. Cached
/// across seeds (requests come from a small family, so most repeat).
fn reference(kv: Kv, request: &GenerationRequest) -> Reference {
    type Key = (Kv, Vec<u32>, usize, u32, u64, Option<usize>);
    static ENGINES: OnceLock<Mutex<HashMap<Kv, Arc<Engine>>>> = OnceLock::new();
    static CACHE: OnceLock<Mutex<HashMap<Key, Reference>>> = OnceLock::new();
    let key = (
        kv,
        request.prompt.clone(),
        request.max_tokens,
        request.sampling.temperature.to_bits(),
        request.sampling.seed,
        request.sampling.prompt_logprobs,
    );
    let cache = CACHE.get_or_init(Mutex::default);
    if let Some(hit) = cache.lock().unwrap().get(&key) {
        return hit.clone();
    }
    let engine = Arc::clone(
        ENGINES
            .get_or_init(Mutex::default)
            .lock()
            .unwrap()
            .entry(kv)
            .or_insert_with(|| {
                let model = kv.model();
                let pool = pool(&model, 1024, Scrub::Zero, false);
                Arc::new(Engine::start(model, pool, EngineConfig::default()))
            }),
    );
    let mut handle = engine.submit(request.clone()).unwrap();
    let mut text = String::new();
    let mut scores = None;
    let answer = loop {
        match handle.blocking_next().unwrap() {
            Event::Prompt { logprobs } => scores = Some(logprobs),
            Event::Token { text: t, .. } => text.push_str(&t),
            Event::Finished { usage, .. } => break (text, usage.completion_tokens, scores),
            failed => panic!("the reference run failed: {failed:?}"),
        }
    };
    cache.lock().unwrap().insert(key, answer.clone());
    answer
}

/// What a request gives alone: its text, its token count, and its
/// prompt's scores if it asked.
type Reference = (String, usize, Option<Vec<PromptLogprob>>);

fn pool(model: &LoadedModel, tokens: usize, scrub: Scrub, cache: bool) -> Pool {
    pool_of(model, tokens, scrub, cache, None)
}

/// [`pool`], its layers in `groups` if given.
fn pool_of(
    model: &LoadedModel,
    tokens: usize,
    scrub: Scrub,
    cache: bool,
    groups: Option<LayerGroups>,
) -> Pool {
    let mut spec = PoolSpec::new(
        model.model.kv_shape(),
        PAGE,
        ElemType::F32,
        PoolSize::Tokens(tokens),
    )
    .with_scrub(scrub)
    .with_reuse(ReusePolicy::NewestFreedFirst);
    if let Some(groups) = groups {
        spec = spec.with_layer_groups(groups);
    }
    if cache {
        // Half the pool per tenant: two tenants can fill it together.
        spec = spec.with_prefix_cache(tokens.div_ceil(PAGE) / 2);
    }
    Pool::new(&spec).unwrap()
}

/// A message on its way along one direction of a link.
struct InFlight {
    at: Duration,
    command: Command,
}

/// The link between decode worker `decode` and prefill worker `prefill`.
struct Link {
    decode: usize,
    prefill: usize,
    /// The ids each end knows this link by, while it is up.
    up: Option<(PeerId, PeerId)>,
    to_prefill: VecDeque<InFlight>,
    to_decode: VecDeque<InFlight>,
    latency: Duration,
    /// Until when the link stays broken after a partition.
    broken_until: Option<Duration>,
    slow_until: Option<Duration>,
}

/// A client of the router.
struct Client {
    request: GenerationRequest,
    arrives: Duration,
    abort_at: Option<Duration>,
    /// The decode worker it went to, and that worker's incarnation.
    on: Option<(usize, u64)>,
    handle: Option<RequestHandle>,
    text: String,
    tokens: usize,
    /// Its prompt's scores, once they came.
    scores: Option<Vec<PromptLogprob>>,
    ended: Option<Ending>,
    /// The most prompt tokens it may find cached: the longest prefix it
    /// shares with a prompt its tenant sent before it ended (I9).
    cacheable: usize,
}

impl Client {
    /// A client that sends `request` at `arrives` (and aborts it at
    /// `abort_at`), not yet routed.
    fn new(request: GenerationRequest, arrives: Duration, abort_at: Option<Duration>) -> Client {
        Client {
            request,
            arrives,
            abort_at,
            on: None,
            handle: None,
            text: String::new(),
            tokens: 0,
            scores: None,
            ended: None,
            cacheable: 0,
        }
    }
}

#[derive(Debug, Clone, PartialEq)]
enum Ending {
    Finished,
    Failed(FailureKind, String),
    /// Its decode worker crashed: the router reports it unavailable.
    LostWithWorker,
    Aborted,
}

#[derive(Debug, Clone, Copy)]
enum Fault {
    CrashPrefill(usize),
    CrashDecode(usize),
    Partition(usize),
    Slow(usize),
}

struct World {
    kv: Kv,
    rng: ChaCha8Rng,
    base: Instant,
    t: Duration,
    prefills: Vec<Node>,
    decodes: Vec<Node>,
    /// Incarnation of each decode worker (bumped at each crash).
    decode_lives: Vec<u64>,
    links: Vec<Link>,
    clients: Vec<Client>,
    faults: Vec<(Duration, Fault)>,
    next_link_id: u64,
    /// What the workers sent since the network last carried it.
    sent: Vec<Effect>,
    faulty: bool,
    /// What happened, for a failing seed's report.
    log: Vec<String>,
}

fn request_from(rng: &mut ChaCha8Rng, kv: Kv) -> GenerationRequest {
    let family = rng.random_range(0..8usize);
    let len = match kv {
        Kv::Full => [3, 9, 17, 30, 45, 70, 100][rng.random_range(0..7)],
        // Past the window (40) and the chunk a windowed read starts on
        // (128), so windows slide while a prompt is computed and decoded.
        Kv::Windows => [9, 45, 100, 150, 200, 300][rng.random_range(0..6)],
    };
    let greedy = rng.random_bool(0.6);
    // Tenant b weighs twice tenant a on every worker.
    let (tenant, weight) = [("a", 1), ("b", 2)][rng.random_range(0..2)];
    GenerationRequest {
        prompt: (0..len)
            .map(|j| ((j * 7 + family * 13) % 256) as u32)
            .collect(),
        max_tokens: [1, 3, 6][rng.random_range(0..3)],
        sampling: SamplingParams {
            temperature: if greedy { 0.0 } else { 0.8 },
            top_k: 0,
            top_p: 0.95,
            seed: family as u64,
            // A quarter of the prompts are scored, with 0 to 2 alternatives.
            prompt_logprobs: (family % 4 == 1).then_some(len % 3),
            ..SamplingParams::greedy()
        },
        stop: StopStrings::default(),
        ignore_eos: true,
        cache: Some(CacheScope::tenant(tenant, None)),
        constraint: None,
        share: Share::new(tenant, weight),
        // Half the requests are traced (no exporter here: the timelines'
        // marks and drops run on every path the world takes).
        trace: if family % 2 == 0 {
            TraceContext::new(family as u128 + 1, len as u64)
        } else {
            None
        },
    }
}

/// Tokens `a` and `b` share from the start.
fn common_prefix(a: &[u32], b: &[u32]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

impl World {
    fn new(seed: u64, kv: Kv) -> World {
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        let config = |rng: &mut ChaCha8Rng| EngineConfig {
            max_running: [2, 4, 8][rng.random_range(0..3)],
            max_queue: 64,
            step_tokens: [16, 48][rng.random_range(0..2)],
            shared_step_tokens: 16,
            handoff_timeout: HANDOFF_TIMEOUT,
            handoff_time_per_token: STEP,
            // Past the run's end: no request waits long enough to expire.
            max_queue_wait: DEADLINE * 2,
            // Workers learn their tenants from the work, as fleet workers
            // do (and, in half the worlds, from what requests say).
            shared: false,
        };
        // Windowed worlds hold longer prompts: the incident's prompt fits
        // a decode pool and no prefill pool there too.
        let scale: usize = match kv {
            Kv::Full => 1,
            Kv::Windows => 2,
        };
        let node = |role, tokens, config| Node {
            role,
            kv,
            tokens: tokens * scale,
            config,
            live: None,
            restart_at: None,
        };
        let prefills: Vec<Node> = (0..rng.random_range(1..=2))
            .map(|_| {
                let tokens = [64, 128][rng.random_range(0..2)];
                node(Role::Prefill, tokens, config(&mut rng))
            })
            .collect();
        let decodes: Vec<Node> = (0..rng.random_range(1..=2))
            .map(|_| {
                let tokens = [128, 256][rng.random_range(0..2)];
                node(Role::Decode, tokens, config(&mut rng))
            })
            .collect();
        let mut links = Vec::new();
        for decode in 0..decodes.len() {
            for prefill in 0..prefills.len() {
                links.push(Link {
                    decode,
                    prefill,
                    up: None,
                    to_prefill: VecDeque::new(),
                    to_decode: VecDeque::new(),
                    latency: Duration::from_micros(rng.random_range(50..2000)),
                    broken_until: None,
                    slow_until: None,
                });
            }
        }
        let clients = (0..rng.random_range(4..=12))
            .map(|_| {
                let request = request_from(&mut rng, kv);
                let arrives = Duration::from_micros(rng.random_range(0..CHAOS.as_micros() as u64));
                let abort_at = rng
                    .random_bool(0.15)
                    .then(|| Duration::from_micros(rng.random_range(0..CHAOS.as_micros() as u64)));
                Client::new(request, arrives, abort_at)
            })
            .collect();
        let faulty = rng.random_bool(0.7);
        let mut faults = Vec::new();
        if faulty {
            for _ in 0..rng.random_range(1..=4) {
                let at = Duration::from_micros(rng.random_range(0..CHAOS.as_micros() as u64));
                let fault = match rng.random_range(0..4) {
                    0 => Fault::CrashPrefill(rng.random_range(0..prefills.len())),
                    1 => Fault::CrashDecode(rng.random_range(0..decodes.len())),
                    2 => Fault::Partition(rng.random_range(0..links.len())),
                    _ => Fault::Slow(rng.random_range(0..links.len())),
                };
                faults.push((at, fault));
            }
            faults.sort_by_key(|(at, _)| *at);
        }
        // In half the worlds the requests say their front door serves
        // several tenants, so workers share themselves from the first
        // (drawn last: the rest of a seed's world stays as it was).
        let told_shared = rng.random_bool(0.5);
        let mut clients: Vec<Client> = clients;
        for client in &mut clients {
            client.request.share = client.request.share.clone().on_shared_workers(told_shared);
        }
        let decode_lives = vec![0; decodes.len()];
        let mut world = World {
            kv,
            rng,
            base: Instant::now(),
            t: Duration::ZERO,
            prefills,
            decodes,
            decode_lives,
            links,
            clients,
            faults,
            next_link_id: 0,
            sent: Vec::new(),
            faulty,
            log: Vec::new(),
        };
        for node in world.prefills.iter_mut().chain(&mut world.decodes) {
            node.start();
        }
        for link in 0..world.links.len() {
            world.connect(link);
        }
        world
    }

    fn now(&self) -> Instant {
        self.base + self.t
    }

    fn note(&mut self, what: String) {
        self.log
            .push(format!("{:>9.3} ms  {what}", self.t.as_secs_f64() * 1e3));
    }

    /// Brings link `index` up, if both ends run: fresh ids at both ends.
    fn connect(&mut self, index: usize) {
        let link = &self.links[index];
        let (d, p) = (link.decode, link.prefill);
        if link.up.is_some()
            || link.broken_until.is_some()
            || self.decodes[d].live.is_none()
            || self.prefills[p].live.is_none()
        {
            return;
        }
        let decode_end = PeerId(self.next_link_id);
        let prefill_end = PeerId(self.next_link_id + 1);
        self.next_link_id += 2;
        let tokens = self.prefills[p].tokens;
        let decode = &mut self.decodes[d].live.as_mut().unwrap().scheduler;
        self.sent
            .extend(decode.handle(Command::PeerUp(Box::new(PeerUp {
                peer: decode_end,
                tx: PeerTx::routed(prefill_end),
                name: format!("prefill-{p}"),
                tokens,
            }))));
        let prefill = &mut self.prefills[p].live.as_mut().unwrap().scheduler;
        self.sent
            .extend(prefill.handle(Command::PeerUp(Box::new(PeerUp {
                peer: prefill_end,
                tx: PeerTx::routed(decode_end),
                name: format!("decode-{d}"),
                tokens: 0,
            }))));
        self.links[index].up = Some((decode_end, prefill_end));
        self.note(format!("link d{d}-p{p} up"));
    }

    /// Breaks link `index`: what was on the wire is lost, and each live end
    /// learns the link is gone.
    fn disconnect(&mut self, index: usize) {
        let link = &mut self.links[index];
        let Some((decode_end, prefill_end)) = link.up.take() else {
            return;
        };
        let (d, p) = (link.decode, link.prefill);
        link.to_prefill.clear();
        link.to_decode.clear();
        if let Some(live) = self.decodes[d].live.as_mut() {
            (self.sent).extend(live.scheduler.handle(Command::PeerLost(decode_end)));
        }
        if let Some(live) = self.prefills[p].live.as_mut() {
            (self.sent).extend(live.scheduler.handle(Command::PeerLost(prefill_end)));
        }
        self.note(format!("link d{d}-p{p} down"));
    }

    fn apply(&mut self, fault: Fault) {
        let restart = Duration::from_micros(self.rng.random_range(10_000..400_000));
        match fault {
            Fault::CrashPrefill(p) => {
                if self.prefills[p].live.take().is_some() {
                    self.note(format!("prefill {p} crashed"));
                    self.prefills[p].restart_at = Some(self.t + restart);
                    for index in self.links_of(|l| l.prefill == p) {
                        self.disconnect(index);
                    }
                }
            }
            Fault::CrashDecode(d) => {
                if self.decodes[d].live.take().is_some() {
                    self.note(format!("decode {d} crashed"));
                    self.decode_lives[d] += 1;
                    self.decodes[d].restart_at = Some(self.t + restart);
                    for index in self.links_of(|l| l.decode == d) {
                        self.disconnect(index);
                    }
                }
            }
            Fault::Partition(index) => {
                self.disconnect(index);
                self.links[index].broken_until = Some(self.t + restart);
            }
            Fault::Slow(index) => {
                self.note(format!("link {index} slow"));
                self.links[index].slow_until = Some(self.t + restart);
            }
        }
    }

    fn links_of(&self, keep: impl Fn(&Link) -> bool) -> Vec<usize> {
        (0..self.links.len())
            .filter(|&i| keep(&self.links[i]))
            .collect()
    }

    /// The router: a request goes to the live decode worker with the fewest
    /// requests in flight, naming a prefill worker it is linked to (the
    /// decode worker falls back to another if that one cannot hold it).
    fn route(&mut self, index: usize) {
        let in_flight = |d: usize, clients: &[Client]| {
            clients
                .iter()
                .filter(|c| c.ended.is_none() && c.on.is_some_and(|(on, _)| on == d))
                .count()
        };
        let request = self.clients[index].request.clone();
        let tenant = request.cache.clone();
        self.clients[index].cacheable = self
            .clients
            .iter()
            .filter(|c| c.on.is_some() && c.request.cache == tenant)
            .map(|c| common_prefix(&c.request.prompt, &request.prompt))
            .max()
            .unwrap_or(0);
        // Workers admit each tenant's requests fairly, not in the order the
        // router sent them (and links differ in latency): a request routed
        // later may be computed first and share its prefix with those of
        // its tenant still running.
        for other in &mut self.clients {
            if other.on.is_some() && other.ended.is_none() && other.request.cache == tenant {
                let shared = common_prefix(&other.request.prompt, &request.prompt);
                other.cacheable = other.cacheable.max(shared);
            }
        }
        let target = (0..self.decodes.len())
            .filter(|&d| {
                self.decodes[d].live.is_some() && self.decodes[d].tokens >= request.kv_tokens()
            })
            .min_by_key(|&d| in_flight(d, &self.clients));
        let Some(d) = target else {
            self.clients[index].ended = Some(Ending::Failed(
                FailureKind::Unavailable,
                "no decode worker".into(),
            ));
            return;
        };
        let linked: Vec<usize> = self
            .links
            .iter()
            .filter(|l| l.decode == d && l.up.is_some())
            .map(|l| l.prefill)
            .collect();
        let hint = (!linked.is_empty())
            .then(|| format!("prefill-{}", linked[self.rng.random_range(0..linked.len())]));
        let live = self.decodes[d].live.as_mut().unwrap();
        let id = RequestId(live.next_id);
        live.next_id += 1;
        let (pending, handle) = Pending::for_client(id, request, hint);
        live.counters
            .queued
            .fetch_add(1, std::sync::atomic::Ordering::AcqRel);
        (self.sent).extend(live.scheduler.handle(Command::Submit(Box::new(pending))));
        let client = &mut self.clients[index];
        client.on = Some((d, self.decode_lives[d]));
        client.handle = Some(handle);
        let (tenant, prompt) = (
            self.clients[index].request.share.tenant.clone(),
            self.clients[index].request.prompt.len(),
        );
        self.note(format!(
            "client {index} ({tenant}, {prompt} tokens) → decode {d} as {id}"
        ));
    }

    /// Carries what the workers sent, then delivers what is due off the
    /// wire into their inboxes.
    fn network(&mut self) {
        self.carry();
        let t = self.t;
        for link in &mut self.links {
            let (d, p) = (link.decode, link.prefill);
            let mut due_prefill = Vec::new();
            while link.to_prefill.front().is_some_and(|m| m.at <= t) {
                due_prefill.push(link.to_prefill.pop_front().unwrap().command);
            }
            let mut due_decode = Vec::new();
            while link.to_decode.front().is_some_and(|m| m.at <= t) {
                due_decode.push(link.to_decode.pop_front().unwrap().command);
            }
            if let Some(live) = self.prefills[p].live.as_mut() {
                live.inbox.extend(due_prefill);
            }
            if let Some(live) = self.decodes[d].live.as_mut() {
                live.inbox.extend(due_decode);
            }
        }
    }

    /// Hands clients their events and moves what the workers sent to
    /// peers onto the wire (a message on a link that is down is lost).
    fn carry(&mut self) {
        let slow = Duration::from_millis(self.rng.random_range(50..400));
        let t = self.t;
        for effect in std::mem::take(&mut self.sent) {
            let (to, message) = match effect {
                Effect::Client { .. } => {
                    effect.deliver();
                    continue;
                }
                Effect::Peer { to, message } => (to, message),
            };
            // The address names the link as its far end knows it.
            let stamp = to.stamp();
            let Some(link) = self.links.iter_mut().find(|l| {
                l.up.is_some_and(|(decode_end, prefill_end)| {
                    stamp == decode_end || stamp == prefill_end
                })
            }) else {
                continue;
            };
            let latency = if link.slow_until.is_some_and(|until| t < until) {
                slow
            } else {
                link.latency
            };
            let queue = if link.up.is_some_and(|(_, prefill_end)| stamp == prefill_end) {
                &mut link.to_prefill
            } else {
                &mut link.to_decode
            };
            // In order per direction, as on a TCP stream.
            let at = queue
                .back()
                .map_or(t + latency, |last| last.at.max(t + latency));
            let command = message.into_command(stamp);
            queue.push_back(InFlight { at, command });
        }
    }

    /// Reads every client's events and checks them.
    fn clients(&mut self) -> Result<(), String> {
        let lives = self.decode_lives.clone();
        let kv = self.kv;
        for index in 0..self.clients.len() {
            let client = &mut self.clients[index];
            if client.ended.is_some() {
                if let Some(handle) = client.handle.as_mut()
                    && let Ok(event) = handle.try_next()
                {
                    return Err(format!(
                        "client {index}: {event:?} after its end ({:?})",
                        client.ended
                    ));
                }
                continue;
            }
            let Some(handle) = client.handle.as_mut() else {
                continue;
            };
            loop {
                match handle.try_next() {
                    Ok(Event::Prompt { logprobs }) => {
                        // Once, before any token, and only if asked.
                        if client.request.sampling.prompt_logprobs.is_none()
                            || client.scores.is_some()
                            || client.tokens > 0
                        {
                            return Err(format!(
                                "client {index}: prompt scores it should not get now"
                            ));
                        }
                        client.scores = Some(logprobs);
                    }
                    Ok(Event::Token { text, .. }) => {
                        if client.request.sampling.prompt_logprobs.is_some()
                            && client.scores.is_none()
                        {
                            return Err(format!(
                                "client {index}: a token before its prompt's scores"
                            ));
                        }
                        client.text.push_str(&text);
                        client.tokens += 1;
                    }
                    Ok(Event::Finished { usage, .. }) => {
                        let (text, tokens, scores) = reference(kv, &client.request);
                        if client.text != text || usage.completion_tokens != tokens {
                            return Err(format!(
                                "client {index}: finished with {:?} ({} tokens), alone it gives {text:?} ({tokens})",
                                client.text, usage.completion_tokens
                            ));
                        }
                        // Bit for bit: however its prompt was chunked,
                        // preempted, handed off or moved (I7).
                        if client.scores != scores {
                            return Err(format!(
                                "client {index}: prompt scores differ from its scores alone"
                            ));
                        }
                        // In a faulty world a hand-off may be moved after
                        // the first prefill worker sealed the prompt, and
                        // the second attempt finds the request's own pages.
                        let own = if self.faulty {
                            client.request.prompt.len()
                        } else {
                            0
                        };
                        if usage.cached_tokens > client.cacheable.max(own) {
                            return Err(format!(
                                "client {index}: {} cached tokens, but its tenant sent at most {} of its prompt before",
                                usage.cached_tokens, client.cacheable
                            ));
                        }
                        client.ended = Some(Ending::Finished);
                        break;
                    }
                    Ok(Event::Failed { kind, message }) => {
                        client.ended = Some(Ending::Failed(kind, message));
                        break;
                    }
                    Err(mpsc_error) => {
                        if mpsc_error == tokio::sync::mpsc::error::TryRecvError::Disconnected {
                            // Only a crash drops a request without an end.
                            let (d, life) = client.on.expect("a routed client");
                            if lives[d] == life {
                                return Err(format!(
                                    "client {index}: its channel closed with no end"
                                ));
                            }
                            client.ended = Some(Ending::LostWithWorker);
                        }
                        break;
                    }
                }
            }
            let client = &self.clients[index];
            if let Some(Ending::Failed(kind, message)) = &client.ended {
                let prompt = client.request.prompt.len();
                let fits_a_prefill = self.prefills.iter().any(|p| p.tokens >= prompt);
                match kind {
                    FailureKind::Internal => {
                        return Err(format!("client {index}: internal failure: {message}"));
                    }
                    // With faults, the larger prefill worker may be the
                    // one that is down; the router's pair choice avoids
                    // that, this one's hint does not.
                    FailureKind::TooLong if fits_a_prefill && !self.faulty => {
                        return Err(format!(
                            "client {index}: too long ({message}) though a prefill pool holds {prompt} tokens"
                        ));
                    }
                    FailureKind::Unavailable if !self.faulty && fits_a_prefill => {
                        return Err(format!(
                            "client {index}: unavailable in a world without faults: {message}"
                        ));
                    }
                    _ => {}
                }
            }
        }
        Ok(())
    }

    /// I1/I8: every live pool's pages add up.
    fn pools_add_up(&self) -> Result<(), String> {
        for (role, node) in self
            .prefills
            .iter()
            .map(|n| ("prefill", n))
            .chain(self.decodes.iter().map(|n| ("decode", n)))
        {
            if let Some(live) = &node.live {
                let s = live.pool.stats();
                if s.free_pages + s.leased_pages + s.shared_pages + s.quarantined_pages
                    != s.num_pages
                {
                    return Err(format!("{role} pool does not add up: {s:?}"));
                }
            }
        }
        Ok(())
    }

    /// One round: arrivals, aborts, faults, restarts, the network, every
    /// worker's poll, the clients. Returns the time of the next thing due.
    fn round(&mut self) -> Result<(), String> {
        let now = self.now();
        for index in 0..self.clients.len() {
            let client = &self.clients[index];
            if client.handle.is_none() && client.ended.is_none() && client.arrives <= self.t {
                self.route(index);
            }
            let client = &mut self.clients[index];
            if client.ended.is_none() && client.abort_at.is_some_and(|at| at <= self.t) {
                if let Some(handle) = &client.handle {
                    handle.canceller().cancel();
                }
                client.ended = Some(Ending::Aborted);
            }
        }
        while self.faults.first().is_some_and(|(at, _)| *at <= self.t) {
            let (_, fault) = self.faults.remove(0);
            self.apply(fault);
        }
        for node in self.prefills.iter_mut().chain(&mut self.decodes) {
            if node.restart_at.is_some_and(|at| at <= self.t) {
                node.start();
            }
        }
        for index in 0..self.links.len() {
            let link = &mut self.links[index];
            if link.broken_until.is_some_and(|until| until <= self.t) {
                link.broken_until = None;
            }
            if link.slow_until.is_some_and(|until| until <= self.t) {
                link.slow_until = None;
            }
            self.connect(index);
        }
        self.network();
        for node in self.prefills.iter_mut().chain(&mut self.decodes) {
            if let Some(live) = node.live.as_mut() {
                // Half the time a busy worker's commands are still in its
                // inbox when it polls: they arrived during its step, which
                // pauses between layers for them (and may run an express
                // step when they are taken).
                if !live.scheduler.has_work() || self.rng.random_bool(0.5) {
                    live.take_commands(&mut self.sent);
                }
                live.poll(now, &mut self.sent);
            }
        }
        self.network();
        // What arrived by now is taken before time moves on.
        for node in self.prefills.iter_mut().chain(&mut self.decodes) {
            if let Some(live) = node.live.as_mut() {
                live.take_commands(&mut self.sent);
            }
        }
        self.carry();
        self.clients()?;
        self.pools_add_up()
    }

    /// When something is next due, if the world is idle until then.
    fn next_due(&self) -> Option<Duration> {
        let busy = self
            .prefills
            .iter()
            .chain(&self.decodes)
            .any(|n| n.live.as_ref().is_some_and(|l| l.scheduler.has_work()));
        if busy {
            return Some(self.t + STEP);
        }
        let mut due: Vec<Duration> = Vec::new();
        for client in &self.clients {
            if client.ended.is_none() {
                if client.handle.is_none() {
                    due.push(client.arrives);
                }
                due.extend(client.abort_at);
            }
        }
        due.extend(self.faults.iter().map(|(at, _)| *at));
        for node in self.prefills.iter().chain(&self.decodes) {
            due.extend(node.restart_at);
            if let Some(deadline) = node.live.as_ref().and_then(|l| l.scheduler.next_deadline()) {
                due.push(deadline.saturating_duration_since(self.base));
            }
        }
        for link in &self.links {
            due.extend(link.broken_until);
            due.extend(link.slow_until);
            due.extend(link.to_prefill.front().map(|m| m.at));
            due.extend(link.to_decode.front().map(|m| m.at));
        }
        due.into_iter()
            .min()
            .map(|at| at.max(self.t + Duration::from_micros(1)))
    }

    fn run(&mut self) -> Result<(), String> {
        loop {
            self.round()?;
            let Some(next) = self.next_due() else {
                break;
            };
            if next > DEADLINE {
                break;
            }
            self.t = next;
        }
        // The world has healed: every request must have ended, and every
        // pool be back at baseline.
        for (index, client) in self.clients.iter().enumerate() {
            if client.ended.is_none() {
                let workers: Vec<String> = self
                    .prefills
                    .iter()
                    .chain(&self.decodes)
                    .filter_map(|n| n.live.as_ref())
                    .map(|l| l.scheduler.describe())
                    .collect();
                return Err(format!("client {index} never ended; workers: {workers:#?}"));
            }
        }
        for node in self.prefills.iter().chain(&self.decodes) {
            let live = node.live.as_ref().expect("every worker restarted");
            let s = live.pool.stats();
            let c = live.counters.snapshot();
            if !s.at_baseline() || c.queued != 0 || c.running != 0 {
                return Err(format!(
                    "{} not at baseline: {s:?}, {} queued, {} running",
                    node.role.label(),
                    c.queued,
                    c.running
                ));
            }
        }
        Ok(())
    }
}

mod node;
#[cfg(test)]
mod tests;

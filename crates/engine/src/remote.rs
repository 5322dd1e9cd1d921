//! Workers in separate processes: a prefill worker serving decode workers
//! over the authenticated hand-off link, a decode worker serving routers,
//! and [`RemoteEngine`], the router's client of a decode worker.
//!
//! ```text
//! router ──control link──▶ decode worker ──hand-off link──▶ prefill worker
//! ```
//!
//! Both links are TLS 1.3 with mutual, role-bound certificates
//! ([`crate::net`]): a prefill worker accepts only decode workers, a decode
//! worker only routers, and each dialler checks it reached the role it
//! meant. They carry length-delimited frames. Hand-off frames stay binary; the control plane between
//! router and decode worker (`Hello`, `Submit`, `Accepted`/`Refused`,
//! `Event`, `Cancel`, `Stats`) is small JSON, none of it logged (I10). A
//! lost link fails what depended on it instead of hanging: the decode worker
//! fails hand-offs waiting for KV; the router fails requests in flight.

use std::collections::HashMap;
use std::net::{SocketAddr, TcpListener};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, mpsc};
use std::time::Duration;

use bytes::Bytes;
use kvfence_handoff::HandoffError;
use kvfence_handoff::tls::{Credentials, Role as LinkRole};
use kvfence_model::{LoadedModel, SamplingParams, StopStrings};
use kvfence_pool::{Pool, PoolStats, RequestId};
use serde::{Deserialize, Serialize};
use tokio::sync::mpsc as tokio_mpsc;
use tracing::{info, warn};

use crate::engine::{Counters, EngineConfig, EngineStats};
use crate::error::EngineError;
use crate::link::{CONTROL, bridge};
use crate::net::{self, Link, LinkTx, ListenLimits};
use crate::request::{
    Canceller, Event, FailureKind, FinishReason, GenerationRequest, RequestHandle, Usage,
};
use crate::scheduler::{Role, Scheduler};
use crate::{Backend, Engine};

const HELLO_TIMEOUT: Duration = Duration::from_secs(10);
const REPLY_TIMEOUT: Duration = Duration::from_secs(10);
/// Routers one decode worker serves at once.
const MAX_ROUTER_LINKS: usize = 64;

fn io(e: std::io::Error) -> EngineError {
    EngineError::Handoff(HandoffError::Io(e.to_string()))
}

/// What a worker tells whoever connects to it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Hello {
    /// The worker's role label.
    pub role: String,
    /// Model fingerprint: layers, KV heads, head dim, vocabulary.
    pub model: (usize, usize, usize, usize),
    /// Token slots per KV page.
    pub page_size: usize,
    /// Tokens of KV each role's pool really holds, by role label.
    pub capacities: Vec<(String, usize)>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
enum Refusal {
    QueueFull { capacity: usize },
    TooLong { needed: usize, capacity: usize },
    Invalid { reason: String },
    ShuttingDown,
    Internal { message: String },
}

#[derive(Debug, Clone, Serialize, Deserialize)]
enum WireEvent {
    Token(String),
    Finished {
        stop: bool,
        prompt_tokens: usize,
        completion_tokens: usize,
    },
    Failed {
        kind: u8,
        message: String,
    },
}

/// One pool's counters on the wire: every field of [`PoolStats`], by name,
/// so no counter a worker keeps arrives as a zero it never reported.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct WirePool {
    role: String,
    num_pages: usize,
    page_size: usize,
    free_pages: usize,
    leased_pages: usize,
    quarantined_pages: usize,
    leases_granted: u64,
    leases_refused: u64,
    stale_writes_rejected: u64,
    foreign_writes_rejected: u64,
    reads_refused: u64,
    pages_quarantined_total: u64,
}

impl WirePool {
    fn new(role: &str, s: &PoolStats) -> WirePool {
        WirePool {
            role: role.to_string(),
            num_pages: s.num_pages,
            page_size: s.page_size,
            free_pages: s.free_pages,
            leased_pages: s.leased_pages,
            quarantined_pages: s.quarantined_pages,
            leases_granted: s.leases_granted,
            leases_refused: s.leases_refused,
            stale_writes_rejected: s.stale_writes_rejected,
            foreign_writes_rejected: s.foreign_writes_rejected,
            reads_refused: s.reads_refused,
            pages_quarantined_total: s.pages_quarantined_total,
        }
    }

    fn stats(&self) -> PoolStats {
        PoolStats {
            num_pages: self.num_pages,
            page_size: self.page_size,
            free_pages: self.free_pages,
            leased_pages: self.leased_pages,
            quarantined_pages: self.quarantined_pages,
            leases_granted: self.leases_granted,
            leases_refused: self.leases_refused,
            stale_writes_rejected: self.stale_writes_rejected,
            foreign_writes_rejected: self.foreign_writes_rejected,
            reads_refused: self.reads_refused,
            pages_quarantined_total: self.pages_quarantined_total,
        }
    }
}

#[derive(Debug, Clone, Serialize, Deserialize)]
struct WireStats {
    pools: Vec<WirePool>,
    engine: EngineStats,
}

#[derive(Debug, Serialize, Deserialize)]
enum Control {
    Hello(Hello),
    Submit {
        id: u64,
        prompt: Vec<u32>,
        max_tokens: usize,
        sampling: (f32, usize, f32, u64),
        stop: Vec<String>,
        ignore_eos: bool,
    },
    Accepted {
        id: u64,
    },
    Refused {
        id: u64,
        refusal: Refusal,
    },
    Event {
        id: u64,
        event: WireEvent,
    },
    Cancel {
        id: u64,
    },
    /// Answered by the `Stats` with the same id: concurrent scrapes each
    /// get their own answer.
    StatsRequest {
        id: u64,
    },
    Stats {
        id: u64,
        stats: WireStats,
    },
}

fn send_control(out: &LinkTx, control: &Control) -> bool {
    let body = serde_json::to_vec(control).expect("control messages always serialise");
    out.send(vec![Bytes::from_static(&[CONTROL]), body.into()])
}

fn parse_control(frame: &[u8]) -> Result<Control, HandoffError> {
    match frame.split_first() {
        Some((&CONTROL, body)) => {
            serde_json::from_slice(body).map_err(|_| HandoffError::Malformed {
                kind: "control",
                reason: "not a control message",
            })
        }
        _ => Err(HandoffError::Malformed {
            kind: "control",
            reason: "expected a control frame",
        }),
    }
}

/// The next control message; `Ok(None)` once the link is gone.
fn read_control(input: &mpsc::Receiver<Bytes>) -> Result<Option<Control>, HandoffError> {
    match input.recv() {
        Ok(frame) => parse_control(&frame).map(Some),
        Err(_) => Ok(None),
    }
}

fn fingerprint(model: &LoadedModel) -> (usize, usize, usize, usize) {
    let c = model.model.config();
    (c.num_layers, c.num_kv_heads, c.head_dim, c.vocab_size)
}

/// Connects to a worker of role `role`, authenticates both ways, and reads
/// the `Hello` it opens with.
fn dial(
    address: SocketAddr,
    role: LinkRole,
    credentials: &Credentials,
    peer: &'static str,
) -> Result<(Link, Hello), EngineError> {
    let link = net::dial(address, role, credentials)?;
    let no_hello = || {
        EngineError::Handoff(HandoffError::Malformed {
            kind: "control",
            reason: peer,
        })
    };
    let frame = link
        .rx
        .recv_timeout(HELLO_TIMEOUT)
        .map_err(|_| no_hello())?;
    let Control::Hello(hello) = parse_control(&frame)? else {
        return Err(no_hello());
    };
    Ok((link, hello))
}

/// Runs a prefill worker: accepts one decode worker at a time on
/// `listener` (only certificates of the decode role), fills its grants, and
/// waits for the next when it leaves. Returns only on a listener error.
pub fn serve_prefill(
    model: Arc<LoadedModel>,
    pool: Pool,
    config: EngineConfig,
    listener: TcpListener,
    credentials: &Credentials,
) -> Result<(), EngineError> {
    // One decode worker at a time: a second one is refused at once rather
    // than left waiting.
    let links = net::accept(
        listener,
        credentials,
        &[LinkRole::Decode],
        ListenLimits::new(1),
    )?;
    loop {
        let link = links.recv().map_err(|_| EngineError::ShuttingDown)?;
        let (peer, role) = (link.address, link.peer);
        let hello = Hello {
            role: Role::Prefill.label().into(),
            model: fingerprint(&model),
            page_size: pool.geometry().page_size,
            capacities: vec![(Role::Prefill.label().into(), pool.capacity_tokens())],
        };
        if !send_control(&link.tx, &Control::Hello(hello)) {
            continue;
        }
        info!(%peer, %role, "decode worker connected");
        let (inbox_tx, inbox) = mpsc::channel();
        let to_decode = bridge(link, inbox_tx, "kvfence-prefill-link").map_err(io)?;
        let scheduler = Scheduler::new(
            Role::Prefill,
            Arc::clone(&model),
            pool.clone(),
            config,
            Arc::new(Counters::default()),
            inbox,
            Some(to_decode),
        );
        scheduler.run();
        info!(%peer, "decode worker gone; its hand-offs were dropped");
    }
}

impl Engine {
    /// A decode worker whose prefill worker is another process at
    /// `prefill`: connects, authenticates, checks that both run the same
    /// model with the same page size, and starts decoding.
    pub fn start_decode_worker(
        model: Arc<LoadedModel>,
        pool: Pool,
        config: EngineConfig,
        prefill: SocketAddr,
        credentials: &Credentials,
    ) -> Result<Engine, EngineError> {
        let (link, hello) = dial(
            prefill,
            LinkRole::Prefill,
            credentials,
            "the prefill worker sent no Hello",
        )?;
        if hello.model != fingerprint(&model) || hello.page_size != pool.geometry().page_size {
            return Err(EngineError::Invalid {
                reason: format!(
                    "the prefill worker runs another model or page size ({:?}, page {})",
                    hello.model, hello.page_size
                ),
            });
        }
        let prefill_tokens = hello.capacities.iter().map(|(_, t)| *t).min().unwrap_or(0);
        let (inbox_tx, inbox) = mpsc::channel();
        let to_prefill = bridge(link, inbox_tx.clone(), "kvfence-decode-link").map_err(io)?;
        let link = crate::engine::DecodeLink {
            inbox_tx,
            inbox,
            to_prefill,
        };
        Ok(Engine::decode_over_link(
            model,
            pool,
            config,
            link,
            Some(prefill_tokens),
            false,
        ))
    }
}

/// Serves routers on `listener` (only certificates of the router role) for
/// a running decode worker. Returns only on a listener error.
pub fn serve_routers(
    engine: Arc<Engine>,
    listener: TcpListener,
    credentials: &Credentials,
) -> Result<(), EngineError> {
    let links = net::accept(
        listener,
        credentials,
        &[LinkRole::Router],
        ListenLimits::new(MAX_ROUTER_LINKS),
    )?;
    loop {
        let link = links.recv().map_err(|_| EngineError::ShuttingDown)?;
        let engine = Arc::clone(&engine);
        std::thread::spawn(move || {
            let peer = link.address;
            if let Err(error) = serve_router(&engine, link) {
                warn!(%peer, %error, "router connection ended");
            }
        });
    }
}

/// Requests one router link may have in flight: as many as the engine can
/// hold queued and running, so one router cannot make the decode worker
/// keep more forwarding state than its own limits allow.
fn in_flight_limit(engine: &Engine) -> usize {
    let config = engine.config();
    config.max_queue + config.max_running
}

fn serve_router(engine: &Engine, link: Link) -> Result<(), EngineError> {
    let capacities = engine
        .capacities()
        .into_iter()
        .map(|(role, tokens)| (role.into(), tokens))
        .collect();
    let hello = Hello {
        role: engine.role().label().into(),
        model: engine.fingerprint(),
        page_size: engine.pool().geometry().page_size,
        capacities,
    };
    let Link { tx, rx, .. } = link;
    if !send_control(&tx, &Control::Hello(hello)) {
        return Ok(());
    }
    let (out_tx, out_rx) = mpsc::channel::<Control>();
    std::thread::spawn(move || {
        for control in out_rx {
            if !send_control(&tx, &control) {
                break;
            }
        }
    });
    let limit = in_flight_limit(engine);
    let cancellers: Arc<Mutex<HashMap<u64, Canceller>>> = Arc::default();
    let result = loop {
        match read_control(&rx) {
            Ok(Some(Control::Submit {
                id,
                prompt,
                max_tokens,
                sampling,
                stop,
                ignore_eos,
            })) => {
                let stop = match StopStrings::new(stop) {
                    Ok(stop) => stop,
                    Err(error) => {
                        let _ = out_tx.send(Control::Refused {
                            id,
                            refusal: Refusal::Invalid {
                                reason: error.to_string(),
                            },
                        });
                        continue;
                    }
                };
                if lock(&cancellers).len() >= limit {
                    let _ = out_tx.send(Control::Refused {
                        id,
                        refusal: Refusal::QueueFull { capacity: limit },
                    });
                    continue;
                }
                let (temperature, top_k, top_p, seed) = sampling;
                let request = GenerationRequest {
                    prompt,
                    max_tokens,
                    sampling: SamplingParams {
                        temperature,
                        top_k,
                        top_p,
                        seed,
                    },
                    stop,
                    ignore_eos,
                };
                match engine.submit(request) {
                    Ok(handle) => {
                        lock(&cancellers).insert(id, handle.canceller());
                        let _ = out_tx.send(Control::Accepted { id });
                        let (out, cancellers) = (out_tx.clone(), Arc::clone(&cancellers));
                        std::thread::spawn(move || forward(id, handle, &out, &cancellers));
                    }
                    Err(error) => {
                        let _ = out_tx.send(Control::Refused {
                            id,
                            refusal: refusal(error),
                        });
                    }
                }
            }
            Ok(Some(Control::Cancel { id })) => {
                if let Some(canceller) = lock(&cancellers).remove(&id) {
                    canceller.cancel();
                }
            }
            Ok(Some(Control::StatsRequest { id })) => {
                let _ = out_tx.send(Control::Stats {
                    id,
                    stats: wire_stats(engine),
                });
            }
            Ok(Some(_)) => {
                break Err(EngineError::Handoff(HandoffError::Malformed {
                    kind: "control",
                    reason: "unexpected message from a router",
                }));
            }
            Ok(None) => break Ok(()),
            Err(error) => break Err(error.into()),
        }
    };
    // The router is gone: nobody will read these answers; free their pages.
    for (_, canceller) in lock(&cancellers).drain() {
        canceller.cancel();
    }
    result
}

fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

fn forward(
    id: u64,
    mut handle: RequestHandle,
    out: &mpsc::Sender<Control>,
    cancellers: &Mutex<HashMap<u64, Canceller>>,
) {
    while let Some(event) = handle.blocking_next() {
        let terminal = !matches!(event, Event::Token { .. });
        let event = match event {
            Event::Token { text } => WireEvent::Token(text),
            Event::Finished { reason, usage } => WireEvent::Finished {
                stop: reason == FinishReason::Stop,
                prompt_tokens: usage.prompt_tokens,
                completion_tokens: usage.completion_tokens,
            },
            Event::Failed { kind, message } => WireEvent::Failed {
                kind: failure_code(kind),
                message,
            },
        };
        if out.send(Control::Event { id, event }).is_err() || terminal {
            break;
        }
    }
    lock(cancellers).remove(&id);
}

fn failure_code(kind: FailureKind) -> u8 {
    match kind {
        FailureKind::TooLong => 1,
        FailureKind::Unavailable => 2,
        FailureKind::ShuttingDown => 3,
        _ => 0,
    }
}

fn failure_kind(code: u8) -> FailureKind {
    match code {
        1 => FailureKind::TooLong,
        2 => FailureKind::Unavailable,
        3 => FailureKind::ShuttingDown,
        _ => FailureKind::Internal,
    }
}

fn refusal(error: EngineError) -> Refusal {
    match error {
        EngineError::QueueFull { capacity } => Refusal::QueueFull { capacity },
        EngineError::TooLong { needed, capacity } => Refusal::TooLong { needed, capacity },
        EngineError::Invalid { reason } => Refusal::Invalid { reason },
        EngineError::ShuttingDown => Refusal::ShuttingDown,
        other => Refusal::Internal {
            message: other.to_string(),
        },
    }
}

fn wire_stats(engine: &Engine) -> WireStats {
    let (pools, engine) = engine.snapshot();
    WireStats {
        pools: pools
            .iter()
            .map(|(role, s)| WirePool::new(role, s))
            .collect(),
        engine,
    }
}

struct InFlight {
    events: tokio_mpsc::UnboundedSender<Event>,
    cancelled: Arc<AtomicBool>,
}

#[derive(Default)]
struct RemoteShared {
    in_flight: Mutex<HashMap<u64, InFlight>>,
    replies: Mutex<HashMap<u64, mpsc::Sender<Result<(), Refusal>>>>,
    /// Stats requests waiting for their answer, by id.
    stats: Mutex<HashMap<u64, mpsc::Sender<WireStats>>>,
    alive: AtomicBool,
}

/// A router's client of a decode worker in another process. Implements
/// [`Backend`], so the HTTP server serves it exactly like a local engine.
pub struct RemoteEngine {
    out: mpsc::Sender<Control>,
    shared: Arc<RemoteShared>,
    hello: Hello,
    next_id: AtomicU64,
}

impl std::fmt::Debug for RemoteEngine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RemoteEngine")
            .field("hello", &self.hello)
            .finish()
    }
}

impl RemoteEngine {
    /// Connects to the decode worker at `address`; both ends authenticate
    /// with certificates from the cluster CA, and the worker must prove the
    /// decode role.
    pub fn connect(
        address: SocketAddr,
        credentials: &Credentials,
    ) -> Result<RemoteEngine, EngineError> {
        let (link, hello) = dial(
            address,
            LinkRole::Decode,
            credentials,
            "the decode worker sent no Hello",
        )?;
        let Link { tx, rx: stream, .. } = link;
        let shared = Arc::new(RemoteShared {
            alive: AtomicBool::new(true),
            ..RemoteShared::default()
        });
        let (out, out_rx) = mpsc::channel::<Control>();
        std::thread::spawn(move || {
            for control in out_rx {
                if !send_control(&tx, &control) {
                    break;
                }
            }
            // Dropping the link's sender closes it.
        });
        let reader_shared = Arc::clone(&shared);
        std::thread::spawn(move || read_decode_worker(stream, &reader_shared));
        // Cancelled handles (a client that went away) become Cancel messages.
        let (watch_shared, watch_out) = (Arc::clone(&shared), out.clone());
        std::thread::spawn(move || {
            while watch_shared.alive.load(Ordering::Acquire) {
                std::thread::sleep(Duration::from_millis(10));
                let mut in_flight = lock(&watch_shared.in_flight);
                let gone: Vec<u64> = in_flight
                    .iter()
                    .filter(|(_, f)| f.cancelled.load(Ordering::Acquire) || f.events.is_closed())
                    .map(|(id, _)| *id)
                    .collect();
                for id in gone {
                    in_flight.remove(&id);
                    if watch_out.send(Control::Cancel { id }).is_err() {
                        return;
                    }
                }
            }
        });
        Ok(RemoteEngine {
            out,
            shared,
            hello,
            next_id: AtomicU64::new(1),
        })
    }

    /// What the decode worker reported when it was connected.
    pub fn hello(&self) -> &Hello {
        &self.hello
    }

    fn remote_stats(&self) -> Option<WireStats> {
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let (tx, rx) = mpsc::channel();
        lock(&self.shared.stats).insert(id, tx);
        let answer = self
            .out
            .send(Control::StatsRequest { id })
            .ok()
            .and_then(|()| rx.recv_timeout(Duration::from_secs(1)).ok());
        lock(&self.shared.stats).remove(&id);
        answer
    }
}

fn read_decode_worker(stream: mpsc::Receiver<Bytes>, shared: &RemoteShared) {
    loop {
        match read_control(&stream) {
            Ok(Some(Control::Accepted { id })) => {
                if let Some(reply) = lock(&shared.replies).remove(&id) {
                    let _ = reply.send(Ok(()));
                }
            }
            Ok(Some(Control::Refused { id, refusal })) => {
                if let Some(reply) = lock(&shared.replies).remove(&id) {
                    let _ = reply.send(Err(refusal));
                }
            }
            Ok(Some(Control::Event { id, event })) => {
                let terminal = !matches!(event, WireEvent::Token(_));
                let event = match event {
                    WireEvent::Token(text) => Event::Token { text },
                    WireEvent::Finished {
                        stop,
                        prompt_tokens,
                        completion_tokens,
                    } => Event::Finished {
                        reason: if stop {
                            FinishReason::Stop
                        } else {
                            FinishReason::Length
                        },
                        usage: Usage {
                            prompt_tokens,
                            completion_tokens,
                        },
                    },
                    WireEvent::Failed { kind, message } => Event::Failed {
                        kind: failure_kind(kind),
                        message,
                    },
                };
                let mut in_flight = lock(&shared.in_flight);
                if let Some(entry) = in_flight.get(&id) {
                    let _ = entry.events.send(event);
                }
                if terminal {
                    in_flight.remove(&id);
                }
            }
            Ok(Some(Control::Stats { id, stats })) => {
                if let Some(reply) = lock(&shared.stats).remove(&id) {
                    let _ = reply.send(stats);
                }
            }
            Ok(Some(_)) | Ok(None) | Err(_) => break,
        }
    }
    // The decode worker is gone: every request in flight ends with an error.
    shared.alive.store(false, Ordering::Release);
    for (_, entry) in lock(&shared.in_flight).drain() {
        let _ = entry.events.send(Event::Failed {
            kind: FailureKind::Unavailable,
            message: "the decode worker is unreachable".into(),
        });
    }
    lock(&shared.replies).clear();
    lock(&shared.stats).clear();
}

impl Backend for RemoteEngine {
    fn submit(&self, request: GenerationRequest) -> Result<RequestHandle, EngineError> {
        if !self.shared.alive.load(Ordering::Acquire) {
            return Err(EngineError::Unavailable {
                reason: "the decode worker is unreachable".into(),
            });
        }
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let (reply_tx, reply_rx) = mpsc::channel();
        lock(&self.shared.replies).insert(id, reply_tx);
        let (events, receiver) = tokio_mpsc::unbounded_channel();
        let cancelled = Arc::new(AtomicBool::new(false));
        // Registered before sending, so no event can arrive unrouted.
        lock(&self.shared.in_flight).insert(
            id,
            InFlight {
                events,
                cancelled: Arc::clone(&cancelled),
            },
        );
        let s = request.sampling;
        let submit = Control::Submit {
            id,
            prompt: request.prompt,
            max_tokens: request.max_tokens,
            sampling: (s.temperature, s.top_k, s.top_p, s.seed),
            stop: request.stop.strings().to_vec(),
            ignore_eos: request.ignore_eos,
        };
        let unreachable = || EngineError::Unavailable {
            reason: "the decode worker is unreachable".into(),
        };
        self.out.send(submit).map_err(|_| unreachable())?;
        let answer = reply_rx.recv_timeout(REPLY_TIMEOUT);
        let forget = || {
            lock(&self.shared.in_flight).remove(&id);
        };
        match answer {
            Ok(Ok(())) => Ok(RequestHandle::new(RequestId(id), receiver, cancelled)),
            Ok(Err(refusal)) => {
                forget();
                Err(match refusal {
                    Refusal::QueueFull { capacity } => EngineError::QueueFull { capacity },
                    Refusal::TooLong { needed, capacity } => {
                        EngineError::TooLong { needed, capacity }
                    }
                    Refusal::Invalid { reason } => EngineError::Invalid { reason },
                    Refusal::ShuttingDown => EngineError::ShuttingDown,
                    // The same status as the same failure in one process.
                    Refusal::Internal { message } => EngineError::Internal { reason: message },
                })
            }
            Err(_) => {
                forget();
                Err(unreachable())
            }
        }
    }

    fn capacities(&self) -> Vec<(&'static str, usize)> {
        self.hello
            .capacities
            .iter()
            .map(|(role, tokens)| (Role::from_label(role).label(), *tokens))
            .collect()
    }

    fn snapshot(&self) -> (Vec<(&'static str, PoolStats)>, EngineStats) {
        let Some(stats) = self.remote_stats() else {
            return (Vec::new(), EngineStats::default());
        };
        let pools = stats
            .pools
            .iter()
            .map(|pool| (Role::from_label(&pool.role).label(), pool.stats()))
            .collect();
        (pools, stats.engine)
    }

    fn shutdown(&self) {
        self.shared.alive.store(false, Ordering::Release);
    }
}

impl RemoteEngine {
    /// Requests this router has in flight on this worker.
    pub fn in_flight(&self) -> usize {
        lock(&self.shared.in_flight).len()
    }

    /// Whether the link to the worker is up.
    pub fn is_alive(&self) -> bool {
        self.shared.alive.load(Ordering::Acquire)
    }
}

/// Several decode workers behind one router: each request goes to the live
/// worker with the fewest requests in flight. The advertised context is the
/// smallest any worker can hold, since any worker may get any request (I6).
#[derive(Debug)]
pub struct Fleet {
    workers: Vec<RemoteEngine>,
}

impl Fleet {
    /// A fleet of connected workers (at least one).
    pub fn new(workers: Vec<RemoteEngine>) -> Result<Fleet, EngineError> {
        if workers.is_empty() {
            return Err(EngineError::Invalid {
                reason: "a router needs at least one decode worker".into(),
            });
        }
        Ok(Fleet { workers })
    }

    /// Requests in flight on each worker, in the order given.
    pub fn load(&self) -> Vec<usize> {
        self.workers.iter().map(RemoteEngine::in_flight).collect()
    }
}

impl Backend for Fleet {
    fn submit(&self, request: GenerationRequest) -> Result<RequestHandle, EngineError> {
        let worker = self
            .workers
            .iter()
            .filter(|w| w.is_alive())
            .min_by_key(|w| w.in_flight())
            .ok_or_else(|| EngineError::Unavailable {
                reason: "no decode worker is reachable".into(),
            })?;
        worker.submit(request)
    }

    fn capacities(&self) -> Vec<(&'static str, usize)> {
        let mut least: Vec<(&'static str, usize)> = Vec::new();
        for (role, tokens) in self.workers.iter().flat_map(RemoteEngine::capacities) {
            match least.iter_mut().find(|(r, _)| *r == role) {
                Some(entry) => entry.1 = entry.1.min(tokens),
                None => least.push((role, tokens)),
            }
        }
        least
    }

    fn snapshot(&self) -> (Vec<(&'static str, PoolStats)>, EngineStats) {
        let mut pools: Vec<(&'static str, PoolStats)> = Vec::new();
        let mut total = EngineStats::default();
        for worker in &self.workers {
            let (worker_pools, e) = worker.snapshot();
            for (role, s) in worker_pools {
                match pools.iter_mut().find(|(r, _)| *r == role) {
                    Some((_, sum)) => {
                        sum.num_pages += s.num_pages;
                        sum.free_pages += s.free_pages;
                        sum.leased_pages += s.leased_pages;
                        sum.quarantined_pages += s.quarantined_pages;
                        sum.leases_granted += s.leases_granted;
                        sum.leases_refused += s.leases_refused;
                        sum.stale_writes_rejected += s.stale_writes_rejected;
                        sum.foreign_writes_rejected += s.foreign_writes_rejected;
                        sum.reads_refused += s.reads_refused;
                        sum.pages_quarantined_total += s.pages_quarantined_total;
                    }
                    None => pools.push((role, s)),
                }
            }
            let t = &mut total;
            t.queued += e.queued;
            t.running += e.running;
            t.finished += e.finished;
            t.failed += e.failed;
            t.cancelled += e.cancelled;
            t.prompt_tokens += e.prompt_tokens;
            t.generated_tokens += e.generated_tokens;
            t.steps += e.steps;
            t.handoffs_committed += e.handoffs_committed;
            t.handoffs_failed += e.handoffs_failed;
            t.handoff_stale_messages += e.handoff_stale_messages;
            t.handoff_checksum_failures += e.handoff_checksum_failures;
            t.handoff_bytes += e.handoff_bytes;
        }
        (pools, total)
    }

    fn shutdown(&self) {
        for worker in &self.workers {
            worker.shutdown();
        }
    }
}

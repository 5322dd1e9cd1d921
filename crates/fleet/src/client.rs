//! [`RemoteEngine`]: a router's client of one decode worker in another
//! process.
//!
//! A keeper thread owns the link: it dials (with backoff while the worker
//! is unreachable), checks the worker's `Hello`, installs the connection,
//! and every [`POLL`] asks the worker for its counters, which are the
//! router's view of that worker — its free pages, whether it admits, which
//! prefill workers it is linked to. A worker that stops answering drops out
//! of that view within [`STALE`], so the router stops choosing it even if
//! its socket stays open (unless no other worker can take a request: then
//! the request waits a little for it, see `Fleet`); when the link breaks, requests in flight on it
//! fail (503) and the keeper dials again, so a restarted worker rejoins.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, mpsc};
use std::time::{Duration, Instant};

use bytes::Bytes;
use kvfence_handoff::tls::{Credentials, Role as LinkRole};
use kvfence_pool::RequestId;
use tokio::sync::{mpsc as tokio_mpsc, oneshot};
use tracing::{info, warn};

use super::wire::{
    Control, Hello, ModelFingerprint, PUBLIC_OVER_A_LINK, Refusal, WireStats, parse_control,
    send_control,
};
use super::{Backoff, dial, io, lock};
use crate::error::FleetError;
use crate::net::Link;
use kvfence_engine::EngineError;
use kvfence_engine::PrefillPeer;
use kvfence_engine::Role;
use kvfence_engine::WorkerSnapshot;
use kvfence_engine::{CacheScope, Event, FailureKind, GenerationRequest, RequestHandle};

/// How long a submit waits for the worker's `Accepted` or `Refused`.
const REPLY_TIMEOUT: Duration = Duration::from_secs(10);
/// How often the keeper refreshes its view of the worker.
pub(crate) const POLL: Duration = Duration::from_millis(250);
/// A view older than this is not used for routing: the worker is not
/// answering.
const STALE: Duration = Duration::from_secs(2);
/// How long one stats question waits for its answer.
const STATS_TIMEOUT: Duration = Duration::from_secs(1);

struct InFlight {
    events: tokio_mpsc::UnboundedSender<Event>,
    /// The prefill worker the router chose for it, for load accounting.
    prefill: Option<String>,
}

/// One live link to the worker; replaced by a new one after a reconnect.
#[derive(Default)]
struct Connection {
    /// The writer's queue; taken to close the link (the writer ends, and
    /// dropping its half of the link closes it).
    out: Mutex<Option<mpsc::Sender<Control>>>,
    in_flight: Mutex<HashMap<u64, InFlight>>,
    replies: Mutex<HashMap<u64, oneshot::Sender<Result<(), Refusal>>>>,
    /// Stats requests waiting for their answer, by id.
    stats: Mutex<HashMap<u64, mpsc::Sender<WireStats>>>,
    alive: AtomicBool,
}

impl Connection {
    fn send(&self, control: Control) -> bool {
        lock(&self.out)
            .as_ref()
            .is_some_and(|out| out.send(control).is_ok())
    }

    /// Ends the link from this side: nothing more is sent, and the worker
    /// sees it close.
    fn close(&self) {
        self.alive.store(false, Ordering::Release);
        lock(&self.out).take();
    }

    fn is_alive(&self) -> bool {
        self.alive.load(Ordering::Acquire)
    }
}

/// What the router knows of the worker, refreshed by the keeper.
#[derive(Debug, Clone)]
pub(crate) struct View {
    pub(crate) hello: Hello,
    pub(crate) stats: Option<WireStats>,
    pub(crate) at: Instant,
}

#[derive(Default)]
struct State {
    connection: Mutex<Option<Arc<Connection>>>,
    view: Mutex<Option<View>>,
    /// The smallest prefill pool this worker was ever linked to: the
    /// advertised context may not promise more than any pair could hold.
    least_prefill: Mutex<Option<usize>>,
    next_id: AtomicU64,
    stop: AtomicBool,
}

impl State {
    fn connection(&self) -> Option<Arc<Connection>> {
        lock(&self.connection).clone()
    }

    fn id(&self) -> u64 {
        self.next_id.fetch_add(1, Ordering::Relaxed) + 1
    }

    fn remember_prefills(&self, prefills: &[PrefillPeer]) {
        let mut least = lock(&self.least_prefill);
        for p in prefills {
            *least = Some(least.map_or(p.tokens, |t| t.min(p.tokens)));
        }
    }
}

/// A router's client of a decode worker in another process. Implements
/// [`kvfence_engine::Backend`], so the HTTP server serves it exactly like a local
/// engine.
pub struct RemoteEngine {
    address: SocketAddr,
    state: Arc<State>,
}

impl std::fmt::Debug for RemoteEngine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RemoteEngine")
            .field("address", &self.address)
            .field("alive", &self.is_alive())
            .finish()
    }
}

impl RemoteEngine {
    /// A client of the decode worker at `address`, which must prove the
    /// decode role with a certificate from the cluster CA and run `model`.
    /// Dialled once now: a certificate, role or model that can never work
    /// is an error; an unreachable worker is dialled again in the
    /// background, as is a link that drops later.
    pub fn connect(
        address: SocketAddr,
        credentials: &Credentials,
        model: ModelFingerprint,
    ) -> Result<RemoteEngine, FleetError> {
        let state = Arc::new(State::default());
        let keeper = Keeper {
            address,
            credentials: credentials.clone(),
            model,
            state: Arc::clone(&state),
        };
        match keeper.dial() {
            Ok(link) => keeper.install(link),
            Err(error) if error.is_transient() => {
                warn!(%address, %error, "decode worker unreachable; dialling again in the background");
            }
            Err(error) => return Err(error),
        }
        std::thread::Builder::new()
            .name("kvfence-decode-keeper".into())
            .spawn(move || keeper.run())
            .map_err(io)?;
        Ok(RemoteEngine { address, state })
    }

    /// The address it was told to reach the worker at.
    pub fn address(&self) -> SocketAddr {
        self.address
    }

    /// Whether the link to the worker is up.
    pub fn is_alive(&self) -> bool {
        self.state.connection().is_some_and(|c| c.is_alive())
    }

    /// Requests this router has in flight on this worker.
    pub fn in_flight(&self) -> usize {
        self.state
            .connection()
            .map_or(0, |c| lock(&c.in_flight).len())
    }

    /// Requests this router has in flight on this worker whose prefill
    /// worker is `prefill`.
    pub(crate) fn in_flight_on(&self, prefill: &str) -> usize {
        self.state.connection().map_or(0, |c| {
            lock(&c.in_flight)
                .values()
                .filter(|f| f.prefill.as_deref() == Some(prefill))
                .count()
        })
    }

    /// The last `Hello` and counters, if the link is up and the worker has
    /// answered within [`STALE`].
    pub(crate) fn fresh_view(&self) -> Option<View> {
        if !self.is_alive() {
            return None;
        }
        lock(&self.state.view)
            .clone()
            .filter(|view| view.at.elapsed() < STALE)
    }

    /// Whether the link is up but the worker has not answered within
    /// [`STALE`]: busy or paused, not gone (a gone worker's link breaks).
    pub(crate) fn is_silent(&self) -> bool {
        self.is_alive() && self.fresh_view().is_none()
    }

    /// The worker's `Hello`, once it has ever answered.
    pub(crate) fn hello(&self) -> Option<Hello> {
        lock(&self.state.view).as_ref().map(|v| v.hello.clone())
    }

    /// The smallest prefill pool this worker was ever linked to.
    pub(crate) fn least_prefill_tokens(&self) -> Option<usize> {
        *lock(&self.state.least_prefill)
    }

    fn remote_stats(&self) -> Option<WireStats> {
        self.state
            .connection()
            .and_then(|c| ask_stats(&self.state, &c))
    }

    /// Queues a request on the worker, naming the prefill worker it should
    /// use; resolves once the worker has accepted or refused it (or
    /// [`REPLY_TIMEOUT`] passed, or the link broke), without blocking a
    /// thread meanwhile.
    pub(crate) async fn submit_to(
        &self,
        request: GenerationRequest,
        prefill: Option<String>,
    ) -> Result<RequestHandle, EngineError> {
        let unreachable = || EngineError::Unavailable {
            reason: "the decode worker is unreachable".into(),
        };
        // The public namespace is filled by a worker's own start-up, never
        // over a link (the decode worker refuses it too).
        if request.cache == Some(CacheScope::Public) {
            return Err(EngineError::Invalid {
                reason: PUBLIC_OVER_A_LINK.into(),
            });
        }
        let connection = self
            .state
            .connection()
            .filter(|c| c.is_alive())
            .ok_or_else(unreachable)?;
        let id = self.state.id();
        let (reply_tx, reply_rx) = oneshot::channel();
        lock(&connection.replies).insert(id, reply_tx);
        let (events, receiver) = tokio_mpsc::unbounded_channel();
        let cancelled = Arc::new(AtomicBool::new(false));
        // Registered before sending, so no event can arrive unrouted.
        lock(&connection.in_flight).insert(
            id,
            InFlight {
                events: events.clone(),
                prefill: prefill.clone(),
            },
        );
        let submit = Control::Submit {
            id,
            request: Box::new(request),
            prefill,
        };
        let forget = || {
            lock(&connection.in_flight).remove(&id);
            lock(&connection.replies).remove(&id);
        };
        if !connection.send(submit) {
            forget();
            return Err(unreachable());
        }
        match tokio::time::timeout(REPLY_TIMEOUT, reply_rx).await {
            Ok(Ok(Ok(()))) => {
                watch_for_cancel(id, events, &connection);
                Ok(RequestHandle::new(RequestId(id), receiver, cancelled))
            }
            Ok(Ok(Err(refusal))) => {
                forget();
                Err(match refusal {
                    Refusal::QueueFull { capacity } => EngineError::QueueFull { capacity },
                    Refusal::TooLong { needed, capacity } => {
                        EngineError::TooLong { needed, capacity }
                    }
                    Refusal::Invalid { reason } => EngineError::Invalid { reason },
                    Refusal::Unavailable { reason } => EngineError::Unavailable { reason },
                    Refusal::ShuttingDown => EngineError::ShuttingDown,
                    // The same status as the same failure in one process.
                    Refusal::Internal { message } => EngineError::Internal { reason: message },
                })
            }
            // The link broke first: the worker is gone with the request.
            Ok(Err(_)) => {
                forget();
                Err(unreachable())
            }
            // No answer in time from a link still up: the worker may yet
            // take it, so it is told to cancel — the caller may send the
            // request elsewhere, and nothing should run twice.
            Err(_) => {
                forget();
                connection.send(Control::Cancel { id });
                Err(unreachable())
            }
        }
    }
}

/// Once the client drops the request's handle (it left), tells the worker
/// to cancel it, if it has not ended by then: a task that sleeps until
/// then, on the link runtime, instead of anything polling.
fn watch_for_cancel(
    id: u64,
    events: tokio_mpsc::UnboundedSender<Event>,
    connection: &Arc<Connection>,
) {
    let connection = Arc::downgrade(connection);
    crate::net::runtime().spawn(async move {
        events.closed().await;
        let Some(connection) = connection.upgrade() else {
            return;
        };
        let still_running = lock(&connection.in_flight).remove(&id).is_some();
        if still_running {
            connection.send(Control::Cancel { id });
        }
    });
}

impl Drop for RemoteEngine {
    fn drop(&mut self) {
        self.state.stop.store(true, Ordering::Release);
        if let Some(connection) = self.state.connection() {
            connection.close();
        }
    }
}

fn ask_stats(state: &State, connection: &Connection) -> Option<WireStats> {
    let id = state.id();
    let (tx, rx) = mpsc::channel();
    lock(&connection.stats).insert(id, tx);
    let answer = connection
        .send(Control::StatsRequest { id })
        .then(|| rx.recv_timeout(STATS_TIMEOUT).ok())
        .flatten();
    lock(&connection.stats).remove(&id);
    answer
}

/// Owns the link to one decode worker for a [`RemoteEngine`].
struct Keeper {
    address: SocketAddr,
    credentials: Credentials,
    model: ModelFingerprint,
    state: Arc<State>,
}

impl Keeper {
    fn dial(&self) -> Result<(Link, Hello), FleetError> {
        let (link, hello) = dial(self.address, LinkRole::Decode, &self.credentials)?;
        hello
            .check(self.model, None)
            .map_err(|why| FleetError::Refused {
                reason: format!(
                    "the decode worker at {} does not match: {why}",
                    self.address
                ),
            })?;
        Ok((link, hello))
    }

    /// Makes `link` the worker's connection: a writer, and a reader that
    /// routes answers and events.
    fn install(&self, (link, hello): (Link, Hello)) {
        let Link { tx, rx, .. } = link;
        let (out, out_rx) = mpsc::channel::<Control>();
        let connection = Arc::new(Connection {
            out: Mutex::new(Some(out)),
            alive: AtomicBool::new(true),
            ..Connection::default()
        });
        std::thread::spawn(move || {
            for control in out_rx {
                if !send_control(&tx, &control) {
                    break;
                }
            }
            // Dropping the link's sender closes it.
        });
        let reader = Arc::clone(&connection);
        std::thread::spawn(move || read_decode_worker(&rx, &reader));
        self.state.remember_prefills(&hello.prefills);
        *lock(&self.state.view) = Some(View {
            hello,
            stats: None,
            at: Instant::now(),
        });
        *lock(&self.state.connection) = Some(connection);
        info!(address = %self.address, "linked to a decode worker");
    }

    fn run(self) {
        let address = self.address;
        let mut backoff = Backoff::new();
        while !self.state.stop.load(Ordering::Acquire) {
            if let Some(connection) = self.state.connection() {
                if connection.is_alive() {
                    if let Some(stats) = ask_stats(&self.state, &connection) {
                        self.state.remember_prefills(&stats.prefills);
                        if let Some(view) = lock(&self.state.view).as_mut() {
                            view.hello.prefills = stats.prefills.clone();
                            view.stats = Some(stats);
                            view.at = Instant::now();
                        }
                    }
                    std::thread::sleep(POLL);
                    continue;
                }
                *lock(&self.state.connection) = None;
                warn!(%address, "link to the decode worker lost; dialling again");
                backoff.wait();
            }
            match self.dial() {
                Ok(link) => {
                    self.install(link);
                    backoff.reset();
                }
                Err(error) => {
                    if error.is_transient() {
                        tracing::debug!(%address, %error, "decode worker still unreachable");
                    } else {
                        warn!(%address, %error, "decode worker refused");
                    }
                    backoff.wait();
                }
            }
        }
    }
}

fn read_decode_worker(stream: &mpsc::Receiver<Bytes>, connection: &Connection) {
    while let Ok(frame) = stream.recv() {
        match parse_control(&frame) {
            Ok(Control::Accepted { id }) => {
                if let Some(reply) = lock(&connection.replies).remove(&id) {
                    let _ = reply.send(Ok(()));
                }
            }
            Ok(Control::Refused { id, refusal }) => {
                if let Some(reply) = lock(&connection.replies).remove(&id) {
                    let _ = reply.send(Err(refusal));
                }
            }
            Ok(Control::Event { id, event }) => {
                let terminal = !matches!(event, Event::Token { .. } | Event::Prompt { .. });
                let mut in_flight = lock(&connection.in_flight);
                if let Some(entry) = in_flight.get(&id) {
                    let _ = entry.events.send(event);
                }
                if terminal {
                    in_flight.remove(&id);
                }
            }
            Ok(Control::Stats { id, stats }) => {
                if let Some(reply) = lock(&connection.stats).remove(&id) {
                    let _ = reply.send(stats);
                }
            }
            Ok(_) | Err(_) => break,
        }
    }
    // The decode worker is gone: every request in flight ends with an error.
    connection.alive.store(false, Ordering::Release);
    for (_, entry) in lock(&connection.in_flight).drain() {
        let _ = entry.events.send(Event::Failed {
            kind: FailureKind::Unavailable,
            message: "the decode worker is unreachable".into(),
        });
    }
    lock(&connection.replies).clear();
    lock(&connection.stats).clear();
}

impl kvfence_engine::Status for RemoteEngine {
    fn capacities(&self) -> Vec<(&'static str, usize)> {
        let mut out = Vec::new();
        if let Some(hello) = self.hello() {
            out.push((Role::Decode.label(), hello.tokens));
        }
        if let Some(tokens) = self.least_prefill_tokens() {
            out.push((Role::Prefill.label(), tokens));
        }
        out
    }

    fn snapshot(&self) -> Vec<WorkerSnapshot> {
        // Unreachable: no numbers at all, rather than old ones or zeros.
        let Some(stats) = self.remote_stats() else {
            return Vec::new();
        };
        let pools = stats
            .pools
            .iter()
            .map(|pool| (Role::from_label(&pool.role).label(), pool.stats()))
            .collect();
        vec![WorkerSnapshot {
            worker: self.address.to_string(),
            pools,
            engine: stats.engine,
        }]
    }

    fn is_ready(&self) -> bool {
        self.fresh_view().is_some_and(|view| {
            view.stats.as_ref().is_none_or(|s| s.admitting) && !view.hello.prefills.is_empty()
        })
    }
}

impl kvfence_engine::Backend for RemoteEngine {
    fn submit(&self, request: GenerationRequest) -> kvfence_engine::Submitted<'_> {
        Box::pin(self.submit_to(request, None))
    }

    fn shutdown(&self) {
        self.state.stop.store(true, Ordering::Release);
        if let Some(connection) = self.state.connection() {
            connection.close();
        }
    }
}

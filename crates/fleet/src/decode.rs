//! `kvfence decode` as a process: a decode worker with links to its
//! prefill workers, serving routers.
//!
//! Each prefill address has a keeper thread that dials it, checks its
//! `Hello` (protocol, model, page size), hands the link to the scheduler
//! (a [`Port`](crate::Port)), waits for the link to end, and dials again with backoff.
//! The addresses are what the prefill names ([`PeerNames`]) resolve to,
//! again every few seconds: a new address gets a keeper; a keeper whose
//! address left the names keeps its link while it lasts (hand-offs in
//! flight finish) and ends instead of dialling again. The
//! scheduler fails only the hand-offs the lost link was filling and sends
//! new grants to the prefill workers still linked; with none, requests are
//! refused as unavailable and the worker reports not ready.

use std::collections::{BTreeSet, HashMap};
use std::net::{SocketAddr, TcpListener};
use std::sync::{Arc, Mutex, mpsc};

use kvfence_handoff::HandoffError;
use kvfence_handoff::tls::{Credentials, Role as LinkRole};
use kvfence_model::LoadedModel;
use kvfence_pool::Pool;
use tracing::{info, warn};

use super::discovery::{Membership, PeerNames};
use super::wire::{
    Control, Hello, ModelFingerprint, PROTOCOL, PUBLIC_OVER_A_LINK, PageLayout, Refusal, WirePool,
    WireStats, parse_control, send_control,
};
use super::{Backoff, dial, io, lock};
use crate::error::FleetError;
use crate::link::bridge;
use crate::net::{self, Link, ListenLimits};
use kvfence_engine::EngineConfig;
use kvfence_engine::EngineError;
use kvfence_engine::{CacheScope, Canceller, Event, LinkGrammars, RequestHandle};
use kvfence_engine::{Engine, PrefillLinks, PrefillPeer, Relaying};

/// Routers one decode worker serves at once.
const MAX_ROUTER_LINKS: usize = 64;

/// A decode worker whose prefill workers are other processes at the
/// addresses `prefills` resolve to. Each is dialled now: a certificate or
/// model that can never work is an error here; one that is merely
/// unreachable is dialled again in the background, as is any link that
/// drops later, and the names are resolved again in the background.
pub fn start_decode_worker(
    model: Arc<LoadedModel>,
    pool: Pool,
    config: EngineConfig,
    prefills: PeerNames,
    credentials: &Credentials,
) -> Result<Engine, FleetError> {
    let layout = PageLayout::of(&pool);
    let engine = Engine::start_decode(model, pool, config);
    let keepers = Keepers {
        template: KeeperTemplate {
            credentials: credentials.clone(),
            model: ModelFingerprint::of(engine.model()),
            layout,
            links: engine.prefill_links(),
        },
        wanted: Arc::default(),
    };
    let every = prefills.resolve_every();
    let mut membership = Membership::new(prefills);
    for address in membership.refresh() {
        keepers.keep(address, true)?;
    }
    std::thread::Builder::new()
        .name("kvfence-prefill-discovery".into())
        .spawn(move || discover_prefills(&keepers, &mut membership, every))
        .map_err(io)?;
    Ok(engine)
}

/// Resolves the prefill names every `every` and keeps exactly their
/// addresses, for as long as the decode worker lives.
fn discover_prefills(keepers: &Keepers, membership: &mut Membership, every: std::time::Duration) {
    loop {
        std::thread::sleep(every);
        if keepers.template.links.is_closed() {
            return;
        }
        let wanted = membership.refresh();
        keepers.release_all_but(&wanted);
        for address in wanted {
            if let Err(error) = keepers.keep(address, false) {
                warn!(%address, %error, "a prefill worker the names resolve to was refused");
            }
        }
    }
}

/// What every prefill keeper of one decode worker shares.
#[derive(Clone)]
struct KeeperTemplate {
    credentials: Credentials,
    model: ModelFingerprint,
    layout: PageLayout,
    links: PrefillLinks,
}

/// The keepers running, by address, each with whether its address is
/// still one the names resolve to. An entry exists exactly while its
/// keeper runs: a keeper removes its own entry, under the lock, when it
/// finds itself unwanted, so an address is never kept twice and never
/// dropped while wanted.
struct Keepers {
    template: KeeperTemplate,
    wanted: Arc<Mutex<HashMap<SocketAddr, bool>>>,
}

impl Keepers {
    /// Makes sure a keeper runs for `address`. The first time, it dials
    /// now when `dial_now` (a refusal that can never change is returned);
    /// otherwise the keeper dials on its own thread.
    fn keep(&self, address: SocketAddr, dial_now: bool) -> Result<(), FleetError> {
        if let Some(flag) = lock(&self.wanted).get_mut(&address) {
            *flag = true;
            return Ok(());
        }
        let keeper = PrefillKeeper {
            address,
            shared: self.template.clone(),
            wanted: Arc::clone(&self.wanted),
        };
        // Dialled outside the lock: a dial may take seconds. Only this
        // thread adds entries, so the address is still not kept after it.
        let first = if dial_now {
            match keeper.dial() {
                Ok(link) => Some(link),
                Err(error) if error.is_transient() => {
                    warn!(%address, %error, "prefill worker unreachable; dialling again in the background");
                    None
                }
                Err(error) => return Err(error),
            }
        } else {
            None
        };
        let fresh = lock(&self.wanted).insert(address, true).is_none();
        assert!(
            fresh,
            "only the discovery thread adds keepers, one per address"
        );
        std::thread::Builder::new()
            .name("kvfence-prefill-keeper".into())
            .spawn(move || keeper.run(first))
            .map_err(io)?;
        Ok(())
    }

    /// Marks every keeper whose address is not in `wanted` as unwanted:
    /// it ends when its link does, instead of dialling again.
    fn release_all_but(&self, wanted: &BTreeSet<SocketAddr>) {
        for (address, flag) in lock(&self.wanted).iter_mut() {
            if *flag && !wanted.contains(address) {
                info!(%address, "prefill worker left the names: its link is not dialled again");
                *flag = false;
            }
        }
    }
}

/// Keeps one prefill link up for a decode worker.
struct PrefillKeeper {
    address: SocketAddr,
    shared: KeeperTemplate,
    wanted: Arc<Mutex<HashMap<SocketAddr, bool>>>,
}

impl PrefillKeeper {
    /// One dial: the link and its `Hello`, checked.
    fn dial(&self) -> Result<(Link, Hello), FleetError> {
        let shared = &self.shared;
        let (link, hello) = dial(self.address, LinkRole::Prefill, &shared.credentials)?;
        hello
            .check(shared.model, Some(&shared.layout))
            .map_err(|why| FleetError::Refused {
                reason: format!(
                    "the prefill worker at {} does not match: {why}",
                    self.address
                ),
            })?;
        Ok((link, hello))
    }

    /// Whether this keeper's address is still one the names resolve to;
    /// if not, its entry is removed under the same lock, and the keeper
    /// must end.
    fn still_wanted(&self) -> bool {
        let mut wanted = lock(&self.wanted);
        let keep = wanted.get(&self.address).copied().unwrap_or(false);
        if !keep {
            wanted.remove(&self.address);
        }
        keep
    }

    /// Links, waits for the link to end, and dials again, until the decode
    /// worker stops or the address leaves the names.
    fn run(self, mut first: Option<(Link, Hello)>) {
        let address = self.address;
        let shared = &self.shared;
        let mut backoff = Backoff::new();
        loop {
            let dialled = match first.take() {
                Some(link) => Ok(link),
                None if !self.still_wanted() => {
                    info!(%address, "prefill keeper ends: the address left the names");
                    return;
                }
                None => self.dial(),
            };
            let (link, hello) = match dialled {
                Ok(link) => link,
                Err(error) => {
                    if error.is_transient() {
                        tracing::debug!(%address, %error, "prefill worker still unreachable");
                    } else {
                        warn!(%address, %error, "prefill worker refused");
                    }
                    backoff.wait();
                    continue;
                }
            };
            let prefill = PrefillPeer {
                name: address.to_string(),
                tokens: hello.tokens,
            };
            let reader = match shared
                .links
                .link(prefill)
                .map_err(FleetError::from)
                .and_then(|port| bridge(link, port, "kvfence-decode-link").map_err(io))
            {
                Ok(reader) => reader,
                // The worker has stopped: so does this keeper.
                Err(_) => {
                    lock(&self.wanted).remove(&address);
                    return;
                }
            };
            info!(%address, tokens = hello.tokens, "linked to a prefill worker");
            backoff.reset();
            let _ = reader.join();
            warn!(%address, "link to the prefill worker lost");
            backoff.wait();
        }
    }
}

/// Serves routers on `listener` (only certificates of the router role) for
/// a running decode worker. Returns only on a listener error.
pub fn serve_routers(
    engine: Arc<Engine>,
    listener: TcpListener,
    credentials: &Credentials,
) -> Result<(), FleetError> {
    let links = net::accept(
        listener,
        credentials,
        &[LinkRole::Router],
        ListenLimits::new(MAX_ROUTER_LINKS),
    )?;
    loop {
        let link = links.recv().map_err(|_| FleetError::ShuttingDown)?;
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

pub(crate) fn hello(engine: &Engine) -> Hello {
    Hello {
        protocol: PROTOCOL,
        role: engine.role().label().into(),
        model: ModelFingerprint::of(engine.model()),
        page_size: engine.pool().geometry().page_size,
        kv_dtype: engine.pool().geometry().elem.name().into(),
        layer_groups: PageLayout::of(engine.pool()).layer_groups,
        tokens: engine.pool().capacity_tokens(),
        prefills: engine.prefill_peers(),
    }
}

fn serve_router(engine: &Engine, link: Link) -> Result<(), FleetError> {
    let Link { tx, rx, .. } = link;
    let mut grammars = LinkGrammars::new(Arc::clone(engine.model()));
    if !send_control(&tx, &Control::Hello(hello(engine))) {
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
    let refuse = |id, refusal| {
        let _ = out_tx.send(Control::Refused { id, refusal });
    };
    let result = loop {
        let Ok(frame) = rx.recv() else {
            break Ok(());
        };
        let control = match parse_control(&frame) {
            Ok(control) => control,
            Err(error) => break Err(FleetError::Malformed(error)),
        };
        match control {
            Control::Submit {
                id,
                mut request,
                prefill,
            } => {
                if request.cache == Some(CacheScope::Public) {
                    let reason = PUBLIC_OVER_A_LINK.into();
                    refuse(id, Refusal::Invalid { reason });
                    continue;
                }
                if lock(&cancellers).len() >= limit {
                    refuse(id, Refusal::QueueFull { capacity: limit });
                    continue;
                }
                request.constraint = match request
                    .constraint
                    .map(|constraint| grammars.compile(constraint))
                    .transpose()
                {
                    Ok(constraint) => constraint,
                    Err(reason) => {
                        refuse(id, Refusal::Invalid { reason });
                        continue;
                    }
                };
                match engine.submit_to(*request, prefill) {
                    Ok(handle) => {
                        lock(&cancellers).insert(id, handle.canceller());
                        let _ = out_tx.send(Control::Accepted { id });
                        let (out, cancellers) = (out_tx.clone(), Arc::clone(&cancellers));
                        // A task per request on the link runtime, asleep
                        // until its next event: no thread per request.
                        let relaying = engine.relaying();
                        net::runtime().spawn(forward(id, handle, out, cancellers, relaying));
                    }
                    Err(error) => refuse(id, refusal(error)),
                }
            }
            Control::Cancel { id } => {
                if let Some(canceller) = lock(&cancellers).remove(&id) {
                    canceller.cancel();
                }
            }
            Control::StatsRequest { id } => {
                let _ = out_tx.send(Control::Stats {
                    id,
                    stats: wire_stats(engine),
                });
            }
            _ => {
                break Err(FleetError::Malformed(HandoffError::Malformed {
                    kind: "control",
                    reason: "unexpected message from a router",
                }));
            }
        }
    };
    // The router is gone: nobody will read these answers; free their pages.
    for (_, canceller) in lock(&cancellers).drain() {
        canceller.cancel();
    }
    result
}

/// Relays one request's events to its router.
async fn forward(
    id: u64,
    mut handle: RequestHandle,
    out: mpsc::Sender<Control>,
    cancellers: Arc<Mutex<HashMap<u64, Canceller>>>,
    _relaying: Relaying,
) {
    while let Some(event) = handle.next().await {
        let terminal = !matches!(event, Event::Token { .. } | Event::Prompt { .. });
        if out.send(Control::Event { id, event }).is_err() || terminal {
            break;
        }
    }
    lock(&cancellers).remove(&id);
}

fn refusal(error: EngineError) -> Refusal {
    match error {
        EngineError::QueueFull { capacity } => Refusal::QueueFull { capacity },
        EngineError::TooLong { needed, capacity } => Refusal::TooLong { needed, capacity },
        EngineError::Invalid { reason } => Refusal::Invalid { reason },
        EngineError::Unavailable { reason } => Refusal::Unavailable { reason },
        EngineError::ShuttingDown => Refusal::ShuttingDown,
        other => Refusal::Internal {
            message: other.to_string(),
        },
    }
}

fn wire_stats(engine: &Engine) -> WireStats {
    let (pools, stats) = engine.snapshot();
    WireStats {
        pools: pools
            .iter()
            .map(|(role, s)| WirePool::new(role, s))
            .collect(),
        engine: stats,
        prefills: engine.prefill_peers(),
        admitting: engine.is_admitting(),
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use kvfence_engine::{CacheScope, GenerationRequest, Share};
    use kvfence_handoff::tls::ClusterCa;
    use kvfence_pool::{ElemType, PoolSize, PoolSpec};

    use super::*;

    /// A router's link to a decode worker that serves routers: what the
    /// worker answers a `Submit` with.
    fn answer_to(request: GenerationRequest) -> Control {
        let model = Arc::new(LoadedModel::load("builtin:tiny").unwrap());
        let spec = PoolSpec::new(
            model.model.kv_shape(),
            16,
            ElemType::F32,
            PoolSize::Pages(8),
        );
        let engine = Arc::new(Engine::start_decode(
            Arc::clone(&model),
            Pool::new(&spec).unwrap(),
            EngineConfig::default(),
        ));
        let ca = ClusterCa::generate().unwrap();
        let decode = ca.credentials(LinkRole::Decode).unwrap();
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let address = listener.local_addr().unwrap();
        std::thread::spawn(move || serve_routers(engine, listener, &decode));
        let router = ca.credentials(LinkRole::Router).unwrap();
        let (link, _hello) = dial(address, LinkRole::Decode, &router).unwrap();
        let submit = Control::Submit {
            id: 5,
            request: Box::new(request),
            prefill: None,
        };
        assert!(send_control(&link.tx, &submit));
        let frame = link.rx.recv_timeout(Duration::from_secs(10)).unwrap();
        parse_control(&frame).unwrap()
    }

    #[test]
    fn a_router_cannot_reach_the_public_prefix_cache() {
        let request = GenerationRequest {
            cache: Some(CacheScope::Public),
            share: Share::new("acme", 1),
            ..GenerationRequest::greedy(vec![1, 2, 3], 1)
        };
        let answer = answer_to(request);
        assert!(
            matches!(
                &answer,
                Control::Refused { id: 5, refusal: Refusal::Invalid { reason } }
                    if reason == PUBLIC_OVER_A_LINK
            ),
            "{answer:?}"
        );
    }
}

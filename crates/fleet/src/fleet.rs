//! [`Fleet`]: the router's decode workers, and its choice of a pair per
//! request.
//!
//! A pair is a decode worker and one of the prefill workers it is linked
//! to. A pair is a candidate only if its decode worker is linked, answering
//! (a fresh view) and admitting, and both pools can hold the request —
//! the decode pool its prompt plus `max_tokens`, the prefill pool its
//! prompt (I6 for the pair, not only for the fleet). Candidates are tried
//! in order of load: requests this router has in flight on the decode
//! worker plus those on the prefill worker (through any decode worker),
//! then the decode pool's free pages, most first. A refusal that says
//! "elsewhere might work" (unavailable, draining, queue full) moves on to
//! the next candidate; nothing was started, so trying again is safe.
//!
//! A request whose tenant sent a prefix of it before goes first to the pair
//! that took that prefix ([`Affinity`]), whose caches hold its pages,
//! unless that pair carries more than [`AFFINITY_SLACK`] requests above
//! the least loaded one: a cache is worth a little queueing, not a hot spot.
//!
//! Membership follows the names the router was given ([`PeerNames`]),
//! resolved again every few seconds: an address that appears joins; one
//! that disappears gets no new work and is let go once the requests it
//! carries have ended, so scaling decode workers down fails nothing.

use std::cmp::Reverse;
use std::collections::BTreeSet;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, RwLock, Weak};

use kvfence_handoff::tls::Credentials;
use tracing::{info, warn};

use super::affinity::{Affinity, Pair};
use super::client::RemoteEngine;
use super::discovery::{Membership, PeerNames};
use super::lock;
use super::wire::ModelFingerprint;
use crate::error::FleetError;
use kvfence_engine::EngineError;
use kvfence_engine::GenerationRequest;
use kvfence_engine::Role;
use kvfence_engine::WorkerSnapshot;

/// The decode workers behind one router. The advertised context is the
/// smallest pool any of them, or any prefill worker they were linked to,
/// holds; a worker that joins later with a smaller pool is only given
/// requests it can hold (I6 per pair).
#[derive(Debug)]
pub struct Fleet {
    /// The workers requests may go to, in address order.
    members: RwLock<Vec<Arc<RemoteEngine>>>,
    /// Workers whose address left the names while they still carried
    /// requests: no new work goes to them; they are let go once idle.
    retiring: Mutex<Vec<Arc<RemoteEngine>>>,
    affinity: Affinity,
    stopped: AtomicBool,
}

/// How long a request waits for a decode worker whose link is up but whose
/// view went stale, when no other worker can take it: a worker starved of
/// CPU for a few seconds is busy, not gone (a gone one's link breaks, and
/// then nothing waits), and a client is better served late than refused.
const SILENT_GRACE: std::time::Duration = std::time::Duration::from_secs(6);

/// Requests in flight a pair holding a request's prefix may carry above
/// the least loaded pair and still be chosen first.
const AFFINITY_SLACK: usize = 4;

/// One pair the router could send a request to.
struct Candidate {
    worker: Arc<RemoteEngine>,
    prefill: String,
    load: usize,
    free_pages: usize,
}

/// Opens a client of the decode worker at an address.
type Connect = dyn Fn(SocketAddr) -> Result<RemoteEngine, FleetError> + Send + Sync;

impl Fleet {
    /// The fleet of decode workers `names` resolve to, each of which must
    /// prove the decode role with a certificate from the cluster CA and
    /// run `model`. Every address is dialled now — one that can never
    /// work (certificate, role, model) is an error here — and the names
    /// are resolved again in the background for as long as the fleet
    /// lives. A name that resolves to nothing yet is not an error: its
    /// workers join when they appear.
    pub fn start(
        names: PeerNames,
        credentials: &Credentials,
        model: ModelFingerprint,
    ) -> Result<Arc<Fleet>, FleetError> {
        let every = names.resolve_every();
        let mut membership = Membership::new(names);
        let credentials = credentials.clone();
        let connect: Box<Connect> =
            Box::new(move |address| RemoteEngine::connect(address, &credentials, model));
        let mut members = Vec::new();
        for address in membership.refresh() {
            members.push(Arc::new(connect(address)?));
        }
        let fleet = Arc::new(Fleet {
            members: RwLock::new(members),
            retiring: Mutex::default(),
            affinity: Affinity::default(),
            stopped: AtomicBool::new(false),
        });
        let weak: Weak<Fleet> = Arc::downgrade(&fleet);
        std::thread::Builder::new()
            .name("kvfence-fleet-discovery".into())
            .spawn(move || {
                loop {
                    std::thread::sleep(every);
                    let Some(fleet) = weak.upgrade() else { return };
                    if fleet.stopped.load(Ordering::Acquire) {
                        return;
                    }
                    fleet.reconcile(&membership.refresh(), &*connect);
                }
            })
            .map_err(super::io)?;
        Ok(fleet)
    }

    fn members(&self) -> Vec<Arc<RemoteEngine>> {
        self.members
            .read()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone()
    }

    /// The addresses of the workers that may take new requests, in order.
    pub fn member_addresses(&self) -> Vec<SocketAddr> {
        self.members().iter().map(|w| w.address()).collect()
    }

    /// Workers that left the names but still carry requests.
    pub fn retiring_addresses(&self) -> Vec<SocketAddr> {
        lock(&self.retiring).iter().map(|w| w.address()).collect()
    }

    /// Makes the members exactly `wanted`: new addresses are dialled
    /// (outside any lock: a dial may take seconds), addresses that left
    /// move to the retiring list, retirees that came back rejoin, and
    /// retirees with nothing in flight are let go.
    fn reconcile(&self, wanted: &BTreeSet<SocketAddr>, connect: &Connect) {
        let known: BTreeSet<SocketAddr> = self
            .members()
            .iter()
            .chain(lock(&self.retiring).iter())
            .map(|w| w.address())
            .collect();
        let mut joined = Vec::new();
        for &address in wanted.difference(&known) {
            match connect(address) {
                Ok(worker) => joined.push(Arc::new(worker)),
                Err(error) => {
                    warn!(%address, %error, "a decode worker the names resolve to was refused")
                }
            }
        }
        let mut members = self
            .members
            .write()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let mut retiring = lock(&self.retiring);
        let (mut stay, leave): (Vec<_>, Vec<_>) = members
            .drain(..)
            .partition(|w| wanted.contains(&w.address()));
        for worker in leave {
            info!(address = %worker.address(), in_flight = worker.in_flight(),
                "decode worker left the names: no new work; let go once idle");
            retiring.push(worker);
        }
        let (back, still_retiring): (Vec<_>, Vec<_>) = retiring
            .drain(..)
            .partition(|w| wanted.contains(&w.address()));
        *retiring = still_retiring;
        for worker in back.into_iter().chain(joined) {
            info!(address = %worker.address(), "decode worker joined the fleet");
            stay.push(worker);
        }
        stay.sort_by_key(|w| w.address());
        *members = stay;
        retiring.retain(|worker| {
            let busy = worker.in_flight() > 0 && worker.is_alive();
            if !busy {
                info!(address = %worker.address(), "retired decode worker let go");
                kvfence_engine::Backend::shutdown(&**worker);
            }
            busy
        });
        debug_assert!(
            members.windows(2).all(|w| w[0].address() < w[1].address()),
            "members are unique and in address order"
        );
        debug_assert!(
            retiring.iter().all(|r| !wanted.contains(&r.address())),
            "a retiree is never an address the names resolve to"
        );
    }

    /// Requests in flight on each member, in address order.
    pub fn load(&self) -> Vec<usize> {
        self.members().iter().map(|w| w.in_flight()).collect()
    }

    /// Whether some member has answered, and every member has, so the
    /// advertised context is known from all of them.
    pub fn has_heard_from_every_worker(&self) -> bool {
        let members = self.members();
        !members.is_empty() && members.iter().all(|w| w.hello().is_some())
    }

    /// Whether some member has answered once.
    pub fn has_heard_from_any_worker(&self) -> bool {
        self.members().iter().any(|w| w.hello().is_some())
    }

    /// [`Fleet::candidates`], waiting up to [`SILENT_GRACE`] while there
    /// are none but some linked worker has gone silent (its view stale):
    /// the next answer it gives makes it a candidate again.
    async fn candidates_waiting(&self, request: &GenerationRequest) -> Vec<Candidate> {
        let started = std::time::Instant::now();
        loop {
            let candidates = self.candidates(request);
            let silent = self.members().iter().any(|w| w.is_silent());
            if !candidates.is_empty() || !silent || started.elapsed() >= SILENT_GRACE {
                return candidates;
            }
            tokio::time::sleep(super::client::POLL).await;
        }
    }

    /// The pairs that could take `request`, best first.
    fn candidates(&self, request: &GenerationRequest) -> Vec<Candidate> {
        let members = self.members();
        let mut candidates = Vec::new();
        for worker in &members {
            let Some(view) = worker.fresh_view() else {
                continue;
            };
            let stats = view.stats.as_ref();
            if stats.is_some_and(|s| !s.admitting) || view.hello.tokens < request.kv_tokens() {
                continue;
            }
            let free_pages = stats
                .and_then(|s| s.pools.iter().find(|p| p.role == Role::Decode.label()))
                .map_or(0, |p| p.free_pages);
            for prefill in &view.hello.prefills {
                if prefill.tokens < request.prompt.len() {
                    continue;
                }
                let on_prefill: usize = members.iter().map(|w| w.in_flight_on(&prefill.name)).sum();
                candidates.push(Candidate {
                    worker: Arc::clone(worker),
                    prefill: prefill.name.clone(),
                    load: worker.in_flight() + on_prefill,
                    free_pages,
                });
            }
        }
        candidates.sort_by_key(|c| (c.load, Reverse(c.free_pages)));
        if let Some((pair, _)) = self.affinity.find(request)
            && let Some(at) = candidates
                .iter()
                .position(|c| c.worker.address() == pair.decode && c.prefill == pair.prefill)
            && candidates[at].load <= candidates[0].load + AFFINITY_SLACK
        {
            let preferred = candidates.remove(at);
            candidates.insert(0, preferred);
        }
        candidates
    }
}

impl kvfence_engine::Status for Fleet {
    fn capacities(&self) -> Vec<(&'static str, usize)> {
        let mut least: Vec<(&'static str, usize)> = Vec::new();
        for (role, tokens) in self
            .members()
            .iter()
            .flat_map(kvfence_engine::Status::capacities)
        {
            match least.iter_mut().find(|(r, _)| *r == role) {
                Some(entry) => entry.1 = entry.1.min(tokens),
                None => least.push((role, tokens)),
            }
        }
        least
    }

    fn snapshot(&self) -> Vec<WorkerSnapshot> {
        self.members()
            .iter()
            .flat_map(kvfence_engine::Status::snapshot)
            .collect()
    }

    fn is_ready(&self) -> bool {
        self.members().iter().any(kvfence_engine::Status::is_ready)
    }
}

impl kvfence_engine::Backend for Fleet {
    fn submit(&self, request: GenerationRequest) -> kvfence_engine::Submitted<'_> {
        Box::pin(async move {
            let mut last = EngineError::Unavailable {
                reason: format!(
                    "no decode worker with a prefill worker that can hold {} tokens is reachable",
                    request.kv_tokens()
                ),
            };
            for candidate in self.candidates_waiting(&request).await {
                let pair = Pair {
                    decode: candidate.worker.address(),
                    prefill: candidate.prefill.clone(),
                };
                match candidate
                    .worker
                    .submit_to(request.clone(), Some(candidate.prefill))
                    .await
                {
                    Ok(handle) => {
                        self.affinity.record(&request, &pair);
                        return Ok(handle);
                    }
                    Err(
                        error @ (EngineError::Unavailable { .. }
                        | EngineError::ShuttingDown
                        | EngineError::QueueFull { .. }),
                    ) => last = error,
                    Err(error) => return Err(error),
                }
            }
            Err(match last {
                // The router is not shutting down: to the client, a draining
                // worker is a worker that is unavailable.
                EngineError::ShuttingDown => EngineError::Unavailable {
                    reason: "every decode worker that could take the request is draining".into(),
                },
                other => other,
            })
        })
    }

    fn shutdown(&self) {
        self.stopped.store(true, Ordering::Release);
        for worker in self.members().iter().chain(lock(&self.retiring).iter()) {
            kvfence_engine::Backend::shutdown(&**worker);
        }
    }
}

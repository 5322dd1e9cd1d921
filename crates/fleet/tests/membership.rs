//! Membership that follows names: a router's decode workers and a decode
//! worker's prefill workers are whatever their names resolve to now, as a
//! Kubernetes headless Service answers with the pods that are ready. Real
//! links with real certificates, in one process; the resolver is the
//! test's, so addresses can join and leave a name at will.

#![allow(clippy::unwrap_used)]

use std::collections::BTreeSet;
use std::net::{SocketAddr, TcpListener};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use kvfence_engine::{
    Backend, Engine, EngineConfig, Event, GenerationRequest, PrefillWorker, RequestHandle, Status,
};
use kvfence_fleet::tls::{ClusterCa, Role as LinkRole};
use kvfence_fleet::{
    Fleet, ModelFingerprint, PeerNames, Resolver, serve_decode_workers, serve_routers,
    start_decode_worker,
};
use kvfence_model::LoadedModel;
use kvfence_pool::{ElemType, Pool, PoolSize, PoolSpec};

const EVERY: Duration = Duration::from_millis(50);
/// Tokens of a request that outlasts several resolutions.
const LONG: usize = 4_000;

fn pool(model: &LoadedModel) -> Pool {
    let spec = PoolSpec::new(
        model.model.kv_shape(),
        16,
        ElemType::F16,
        PoolSize::Tokens(16_384),
    );
    Pool::new(&spec).unwrap()
}

/// A name whose answer the test sets.
#[derive(Clone, Default)]
struct Name(Arc<Mutex<Vec<SocketAddr>>>);

impl Name {
    fn set(&self, addresses: &[SocketAddr]) {
        *self.0.lock().unwrap() = addresses.to_vec();
    }

    fn names(&self) -> PeerNames {
        let answer = Arc::clone(&self.0);
        let resolver: Resolver = Arc::new(move |_: &str| Ok(answer.lock().unwrap().clone()));
        PeerNames::parse(&["workers.test:1".to_string()], "worker")
            .unwrap()
            .with_resolver(resolver, EVERY)
    }
}

struct Cluster {
    ca: ClusterCa,
    model: Arc<LoadedModel>,
}

impl Cluster {
    fn new() -> Cluster {
        Cluster {
            ca: ClusterCa::generate().unwrap(),
            model: Arc::new(LoadedModel::load("builtin:tiny").unwrap()),
        }
    }

    fn prefill(&self) -> (SocketAddr, Arc<PrefillWorker>) {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let address = listener.local_addr().unwrap();
        let worker = Arc::new(
            PrefillWorker::start(
                Arc::clone(&self.model),
                pool(&self.model),
                EngineConfig::default(),
            )
            .unwrap(),
        );
        let credentials = self.ca.credentials(LinkRole::Prefill).unwrap();
        serve_decode_workers(&worker, listener, &credentials).unwrap();
        (address, worker)
    }

    /// A decode worker over the prefill workers `prefills` names, serving
    /// routers on a port of its own.
    fn decode(&self, prefills: PeerNames) -> (SocketAddr, Arc<Engine>) {
        let credentials = self.ca.credentials(LinkRole::Decode).unwrap();
        let engine = Arc::new(
            start_decode_worker(
                Arc::clone(&self.model),
                pool(&self.model),
                EngineConfig::default(),
                prefills,
                &credentials,
            )
            .unwrap(),
        );
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let address = listener.local_addr().unwrap();
        let serving = Arc::clone(&engine);
        std::thread::spawn(move || serve_routers(serving, listener, &credentials));
        (address, engine)
    }

    fn fleet(&self, decodes: &Name) -> Arc<Fleet> {
        Fleet::start(
            decodes.names(),
            &self.ca.credentials(LinkRole::Router).unwrap(),
            ModelFingerprint::of(&self.model),
        )
        .unwrap()
    }
}

fn until(what: &str, mut done: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(20);
    while !done() {
        assert!(Instant::now() < deadline, "timed out waiting until {what}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn request(max_tokens: usize) -> GenerationRequest {
    GenerationRequest {
        ignore_eos: true,
        ..GenerationRequest::greedy((0..40).collect(), max_tokens)
    }
}

fn submit(fleet: &Fleet, request: GenerationRequest) -> RequestHandle {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    runtime.block_on(fleet.submit(request)).unwrap()
}

/// Events to the end: the tokens the closing event counts, and it.
fn finish(mut handle: RequestHandle) -> (usize, Event) {
    loop {
        match handle.blocking_next().unwrap() {
            Event::Token { .. } => {}
            closing @ Event::Finished { usage, .. } => {
                return (usage.completion_tokens, closing);
            }
            closing => return (0, closing),
        }
    }
}

fn prefill_names(engine: &Engine) -> BTreeSet<String> {
    engine.prefill_peers().into_iter().map(|p| p.name).collect()
}

#[test]
fn a_decode_worker_links_to_prefill_workers_as_they_join_the_name() {
    let cluster = Cluster::new();
    let prefills = Name::default();
    let (first, _p1) = cluster.prefill();
    let (second, _p2) = cluster.prefill();
    prefills.set(&[first]);
    let (_, decode) = cluster.decode(prefills.names());
    until("the first prefill worker is linked", || {
        prefill_names(&decode) == BTreeSet::from([first.to_string()])
    });
    prefills.set(&[first, second]);
    until("the second prefill worker is linked", || {
        prefill_names(&decode) == BTreeSet::from([first.to_string(), second.to_string()])
    });
}

#[test]
fn a_prefill_worker_that_left_the_name_is_not_dialled_again_once_its_link_drops() {
    let cluster = Cluster::new();
    let prefills = Name::default();
    let (first, p1) = cluster.prefill();
    let (second, _p2) = cluster.prefill();
    prefills.set(&[first, second]);
    let (_, decode) = cluster.decode(prefills.names());
    until("both are linked", || prefill_names(&decode).len() == 2);
    prefills.set(&[second]);
    std::thread::sleep(EVERY * 3);
    assert_eq!(
        prefill_names(&decode).len(),
        2,
        "a link up is kept while it lasts: hand-offs on it finish"
    );
    drop(p1);
    until("the departed worker's link is gone", || {
        prefill_names(&decode) == BTreeSet::from([second.to_string()])
    });
    // A new worker on the same port would be dialled only if the name
    // named it again.
    std::thread::sleep(EVERY * 5);
    assert_eq!(prefill_names(&decode), BTreeSet::from([second.to_string()]));
}

#[test]
fn a_router_follows_its_decode_name_and_lets_a_leaving_worker_finish_first() {
    let cluster = Cluster::new();
    let prefills = Name::default();
    let (prefill, _p) = cluster.prefill();
    prefills.set(&[prefill]);
    let (a, decode_a) = cluster.decode(prefills.names());
    let (b, decode_b) = cluster.decode(prefills.names());
    let decodes = Name::default();
    let fleet = cluster.fleet(&decodes);
    assert!(
        fleet.member_addresses().is_empty(),
        "a name with no answer yet is no error"
    );
    decodes.set(&[a]);
    until("a joins and is ready", || fleet.is_ready());
    assert_eq!(fleet.member_addresses(), [a]);
    let (tokens, closing) = finish(submit(&fleet, request(4)));
    assert_eq!(tokens, 4);
    assert!(matches!(closing, Event::Finished { .. }), "{closing:?}");

    decodes.set(&[a, b]);
    until("b joins", || fleet.member_addresses().len() == 2);
    // A long request (seconds, even optimised) on whichever worker the
    // fleet picks; then that worker leaves the name while it runs.
    let long = submit(&fleet, request(LONG));
    until("the long request runs", || {
        decode_a.in_flight() + decode_b.in_flight() == 1
    });
    let ((busy, busy_worker), (idle, idle_worker)) = if decode_a.in_flight() == 1 {
        ((a, &decode_a), (b, &decode_b))
    } else {
        ((b, &decode_b), (a, &decode_a))
    };
    let finished = (busy_worker.stats().finished, idle_worker.stats().finished);
    decodes.set(&[idle]);
    until("the busy worker retires", || {
        fleet.member_addresses() == [idle]
    });
    assert_eq!(
        busy_worker.in_flight(),
        1,
        "the long request outlasted the resolution"
    );
    assert_eq!(
        fleet.retiring_addresses(),
        [busy],
        "it still carries a request"
    );
    until("the idle worker's view is fresh", || fleet.is_ready());
    for _ in 0..3 {
        let (tokens, closing) = finish(submit(&fleet, request(2)));
        assert_eq!(tokens, 2);
        assert!(matches!(closing, Event::Finished { .. }), "{closing:?}");
    }
    assert_eq!(
        idle_worker.stats().finished,
        finished.1 + 3,
        "new work went to the member"
    );
    assert_eq!(
        busy_worker.stats().finished,
        finished.0,
        "and none to the retiree"
    );
    let (tokens, closing) = finish(long);
    assert_eq!(tokens, LONG, "the retiring worker finished what it carried");
    assert!(matches!(closing, Event::Finished { .. }), "{closing:?}");
    until("the retiree is let go once idle", || {
        fleet.retiring_addresses().is_empty()
    });
    until("the retiree's engine is idle", || {
        busy_worker.in_flight() == 0
    });
    // It comes back under the name: it rejoins.
    decodes.set(&[a, b]);
    // Members are in address order, whichever port each worker drew.
    let both = BTreeSet::from([a, b]);
    until("a rejoins", || {
        BTreeSet::from_iter(fleet.member_addresses()) == both
    });
}

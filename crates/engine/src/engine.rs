//! [`Engine`]: a colocated worker. One scheduler thread owns every running
//! request and their leases; clients talk to it through [`Engine::submit`]
//! and the returned [`RequestHandle`].

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::mpsc;
use std::thread::JoinHandle;

use kvfence_model::LoadedModel;
use kvfence_pool::{Pool, PoolError, RequestId};

use crate::config::EngineConfig;
use crate::config::Role;
use crate::counters::{Counters, EngineStats, WorkerSnapshot};
use crate::error::EngineError;
use crate::port::{Facing, Port, Transport};
use crate::request::{CacheScope, Event, GenerationRequest, LinkGrammars, RequestHandle};
use crate::scheduler::{Command, ComputeTurn, PeerId, PeerTx, PeerUp, Pending, Scheduler, Shell};

/// A worker: the scheduler(s) behind one client-facing queue.
pub struct Engine {
    commands: mpsc::Sender<Command>,
    counters: Arc<Counters>,
    pool: Pool,
    role: Role,
    prefill: Option<Peer>,
    /// Decode role: the prefill workers in other processes it has a link
    /// to now.
    prefills: Arc<PrefillDirectory>,
    model: Arc<LoadedModel>,
    config: EngineConfig,
    next_id: AtomicU64,
    /// Cleared when the worker drains: new requests are refused, those in
    /// flight finish.
    admitting: AtomicBool,
    /// Requests from routers whose last event has not yet been handed to
    /// their link (a decode worker's): work in flight until it has.
    relaying: Arc<AtomicUsize>,
    threads: Vec<JoinHandle<()>>,
}

/// A public system prompt as the pools hold it
/// ([`Engine::cache_public_system_prompt`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PublicPrompt {
    /// Tokens of its whole pages, held by every worker that computes
    /// prompts.
    pub tokens: usize,
    /// Whether the decode worker holds them too; if not, they cross the
    /// link with each request.
    pub decode_keeps: bool,
}

/// One router request's answer on its way back: counted in
/// [`Engine::in_flight`] until dropped, after its last event is handed to
/// the link, so a draining worker does not exit between its scheduler
/// finishing a request and the router hearing so.
pub struct Relaying(Arc<AtomicUsize>);

impl Drop for Relaying {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

/// A prefill worker in another process that a decode worker has a link to.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct PrefillPeer {
    /// How the decode worker was told to reach it (its address).
    pub name: String,
    /// Tokens of KV its pool holds.
    pub tokens: usize,
}

/// The prefill workers a decode worker has a link to now: written where
/// links come up and go, read for capacity, routing and metrics.
#[derive(Debug, Default)]
pub(crate) struct PrefillDirectory {
    linked: std::sync::Mutex<BTreeMap<PeerId, PrefillPeer>>,
    /// The next link's name: each link is a namespace of its own.
    next: AtomicU64,
}

impl PrefillDirectory {
    fn insert(&self, peer: PeerId, prefill: PrefillPeer) {
        let replaced = self.lock().insert(peer, prefill);
        assert!(replaced.is_none(), "{peer} names one link, once");
    }

    fn remove(&self, peer: PeerId) {
        let removed = self.lock().remove(&peer);
        assert!(removed.is_some(), "{peer} ends once, after it was linked");
    }

    pub(crate) fn list(&self) -> Vec<PrefillPeer> {
        self.lock().values().cloned().collect()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, BTreeMap<PeerId, PrefillPeer>> {
        self.linked
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

/// How links to prefill workers in other processes join a decode worker
/// ([`Engine::prefill_links`]): held by whatever keeps those links up,
/// without keeping the worker alive.
#[derive(Clone)]
pub struct PrefillLinks {
    commands: mpsc::Sender<Command>,
    directory: std::sync::Weak<PrefillDirectory>,
}

impl std::fmt::Debug for PrefillLinks {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PrefillLinks")
            .field("closed", &self.is_closed())
            .finish()
    }
}

impl PrefillLinks {
    /// A new link to the prefill worker `prefill` (its name and pool): the
    /// decode worker may grant on it at once, lists it among its prefill
    /// peers while it lasts, and fails what it was filling when the port's
    /// [`Inbound`](crate::Inbound) drops. `ShuttingDown` once the worker
    /// has stopped.
    pub fn link(&self, prefill: PrefillPeer) -> Result<Port, EngineError> {
        let directory = self.directory.upgrade().ok_or(EngineError::ShuttingDown)?;
        let peer = PeerId(directory.next.fetch_add(1, Ordering::Relaxed));
        let (name, tokens) = (prefill.name.clone(), prefill.tokens);
        directory.insert(peer, prefill);
        let weak = Arc::downgrade(&directory);
        let on_end = Box::new(move || {
            if let Some(directory) = weak.upgrade() {
                directory.remove(peer);
            }
        });
        Port::open(
            self.commands.clone(),
            peer,
            name,
            tokens,
            Facing::Prefill,
            Some(on_end),
        )
        .inspect_err(|_| directory.remove(peer))
    }

    /// Whether the decode worker has stopped: no link will join it again.
    pub fn is_closed(&self) -> bool {
        self.directory.strong_count() == 0
    }
}

/// The prefill half of an in-process disaggregated pair.
struct Peer {
    commands: mpsc::Sender<Command>,
    pool: Pool,
}

fn spawn(name: &str, shell: Shell) -> JoinHandle<()> {
    std::thread::Builder::new()
        .name(name.into())
        .spawn(move || shell.run())
        .expect("the OS can start a scheduler thread")
}

impl Engine {
    /// A colocated worker: one scheduler does prefill and decode over `pool`.
    pub fn start(model: Arc<LoadedModel>, pool: Pool, config: EngineConfig) -> Engine {
        let (commands, inbox) = mpsc::channel();
        let counters = Arc::new(Counters::default());
        let scheduler = Scheduler::new(
            Role::Colocated,
            Arc::clone(&model),
            pool.clone(),
            config,
            Arc::clone(&counters),
        );
        let thread = spawn("kvfence-colocated", Shell::new(scheduler, inbox));
        Engine {
            commands,
            counters,
            pool,
            role: Role::Colocated,
            prefill: None,
            prefills: Arc::default(),
            model,
            config,
            next_id: AtomicU64::new(1),
            admitting: AtomicBool::new(true),
            relaying: Arc::default(),
            threads: vec![thread],
        }
    }

    /// A disaggregated pair: a prefill worker over `prefill_pool` and a
    /// decode worker over `decode_pool`, joined by `transport`. Every
    /// hand-off message crosses as an encoded frame, so the codec's checks
    /// are on the path. Clients talk to the decode worker, which reserves,
    /// grants, verifies and decodes.
    pub fn start_disaggregated(
        model: Arc<LoadedModel>,
        prefill_pool: Pool,
        decode_pool: Pool,
        config: EngineConfig,
        transport: &Transport,
    ) -> Result<Engine, EngineError> {
        let grouped = prefill_pool.layer_groups().len() > 1 || decode_pool.layer_groups().len() > 1;
        let one_sided = matches!(transport, Transport::SharedMemory);
        if one_sided && grouped {
            return Err(EngineError::Pool(PoolError::InvalidSpec {
                reason: "a one-sided (shared-memory) hand-off moves pools of one layer group: \
                         keep every position of sliding-window layers, or use another transport"
                    .into(),
            }));
        }
        let (prefill_tx, prefill_inbox) = mpsc::channel();
        // The two workers compute on this process's one pool, in turns.
        let turn = Arc::new(ComputeTurn::default());
        let mut engine =
            Engine::decode_worker(model.clone(), decode_pool, config, one_sided, &turn);
        // One link each way, named 0 at both ends.
        let link = PeerId(0);
        let prefill_tokens = prefill_pool.capacity_tokens();
        match transport {
            Transport::InProcess | Transport::SharedMemory => {
                // Each scheduler's way to its peer is the peer's inbox.
                let up = |tx, name: &str, tokens| {
                    Command::PeerUp(Box::new(PeerUp {
                        peer: link,
                        tx: PeerTx::new(tx, link),
                        name: name.into(),
                        tokens,
                    }))
                };
                let sent = prefill_tx
                    .send(up(engine.commands.clone(), "decode", 0))
                    .is_ok()
                    && engine
                        .commands
                        .send(up(prefill_tx.clone(), "prefill", prefill_tokens))
                        .is_ok();
                assert!(sent, "both schedulers' inboxes are open until they stop");
            }
            Transport::Linked(connector) => {
                let facing = Facing::Decode(LinkGrammars::new(Arc::clone(&model)));
                let prefill_end =
                    Port::open(prefill_tx.clone(), link, "decode".into(), 0, facing, None)?;
                let decode_end = Port::open(
                    engine.commands.clone(),
                    link,
                    "prefill".into(),
                    prefill_tokens,
                    Facing::Prefill,
                    None,
                )?;
                connector.connect(prefill_end, decode_end)?;
            }
        }
        let prefill = Scheduler::new(
            Role::Prefill,
            model,
            prefill_pool.clone(),
            config,
            Arc::new(Counters::default()),
        )
        .sharing_turn(turn);
        engine.prefill = Some(Peer {
            commands: prefill_tx,
            pool: prefill_pool,
        });
        let prefill = Shell::new(prefill, prefill_inbox);
        engine.threads.push(spawn("kvfence-prefill", prefill));
        Ok(engine)
    }

    /// A decode worker with no prefill worker yet: links to prefill workers
    /// in other processes join it through [`Engine::prefill_links`].
    pub fn start_decode(model: Arc<LoadedModel>, pool: Pool, config: EngineConfig) -> Engine {
        Engine::decode_worker(model, pool, config, false, &Arc::default())
    }

    /// A decode worker with no prefill worker yet. `one_sided` grants
    /// shared-memory windows; `turn` is the compute pool's, shared with
    /// the other workers of this process.
    fn decode_worker(
        model: Arc<LoadedModel>,
        pool: Pool,
        config: EngineConfig,
        one_sided: bool,
        turn: &Arc<ComputeTurn>,
    ) -> Engine {
        let (commands, inbox) = mpsc::channel();
        let counters = Arc::new(Counters::default());
        let decode = Scheduler::new(
            Role::Decode,
            Arc::clone(&model),
            pool.clone(),
            config,
            Arc::clone(&counters),
        )
        .with_one_sided_grants(one_sided)
        .sharing_turn(Arc::clone(turn));
        let decode = Shell::new(decode, inbox);
        Engine {
            commands,
            counters,
            pool,
            role: Role::Decode,
            prefill: None,
            prefills: Arc::default(),
            model,
            config,
            next_id: AtomicU64::new(1),
            admitting: AtomicBool::new(true),
            relaying: Arc::default(),
            threads: vec![spawn("kvfence-decode", decode)],
        }
    }

    /// Tokens of KV each worker's pool holds, by role label.
    pub fn capacities(&self) -> Vec<(&'static str, usize)> {
        let mut out = vec![(self.role.label(), self.pool.capacity_tokens())];
        if let Some(peer) = &self.prefill {
            out.push((Role::Prefill.label(), peer.pool.capacity_tokens()));
        }
        for prefill in self.prefills.list() {
            out.push((Role::Prefill.label(), prefill.tokens));
        }
        out
    }

    /// The prefill workers in other processes this decode worker has a
    /// link to now.
    pub fn prefill_peers(&self) -> Vec<PrefillPeer> {
        self.prefills.list()
    }

    /// Where links to prefill workers in other processes join this decode
    /// worker.
    pub fn prefill_links(&self) -> PrefillLinks {
        PrefillLinks {
            commands: self.commands.clone(),
            directory: Arc::downgrade(&self.prefills),
        }
    }

    /// Pool and engine counters, by role (local pools only).
    pub fn snapshot(&self) -> (Vec<(&'static str, kvfence_pool::PoolStats)>, EngineStats) {
        let pools = self
            .pools()
            .iter()
            .map(|(role, pool)| (role.label(), pool.stats()))
            .collect();
        (pools, self.stats())
    }

    /// The model this worker runs.
    pub fn model(&self) -> &Arc<LoadedModel> {
        &self.model
    }

    /// Stops only the prefill worker, as if its process ended: its in-flight
    /// hand-offs are rejected and, over TCP, the connection closes, so the
    /// decode worker fails what is left and refuses new work (503).
    pub fn shutdown_prefill(&self) {
        if let Some(peer) = &self.prefill {
            let _ = peer.commands.send(Command::Shutdown);
        }
    }

    /// The role facing clients: `Colocated` or `Decode`.
    pub fn role(&self) -> Role {
        self.role
    }

    /// Every worker's pool with its role (for metrics and capacity).
    pub fn pools(&self) -> Vec<(Role, &Pool)> {
        let mut pools = vec![(self.role, &self.pool)];
        if let Some(peer) = &self.prefill {
            pools.push((Role::Prefill, &peer.pool));
        }
        pools
    }

    /// Computes `prompt` once and seals its full pages into the public
    /// namespace of every pool this engine runs — the decode worker's too,
    /// which receives them over the hand-off like any prompt — where they
    /// stay pinned: every tenant's prompt that begins with them reads them
    /// (above the pool's public minimum), and no traffic evicts them.
    /// Returns, for each pool, the leading tokens of `prompt` it now holds
    /// in public pages: fewer than the prompt's full pages means its public
    /// quota ran out (or, for a decode worker behind one-sided writes, that
    /// it caches nothing). Blocks until the prompt is computed: call it
    /// before serving.
    pub fn cache_public_prefix(&self, prompt: Vec<u32>) -> Result<Vec<(Role, usize)>, EngineError> {
        if let Some((role, _)) = self
            .pools()
            .into_iter()
            .find(|(_, p)| !p.has_prefix_cache())
        {
            return Err(EngineError::Invalid {
                reason: format!("the {} worker has no prefix cache", role.label()),
            });
        }
        let mut handle = self.submit(GenerationRequest {
            ignore_eos: true,
            cache: Some(CacheScope::Public),
            ..GenerationRequest::greedy(prompt.clone(), 1)
        })?;
        loop {
            match handle.blocking_next() {
                Some(Event::Token { .. } | Event::Prompt { .. }) => {}
                Some(Event::Finished { .. }) => break,
                Some(Event::Failed { message, .. }) => {
                    return Err(EngineError::Internal { reason: message });
                }
                None => return Err(EngineError::ShuttingDown),
            }
        }
        Ok(self
            .pools()
            .into_iter()
            .map(|(role, pool)| (role, pool.public_prefix_tokens(&self.model.name, &prompt)))
            .collect())
    }

    /// Caches `text` as a public system prompt: encoded as a chat's first
    /// message is (so its tokens begin every chat that begins with it) and
    /// its whole pages sealed into every pool's public namespace
    /// ([`Engine::cache_public_prefix`]). Refused before any work when the
    /// text is empty, the model has no chat template, or its whole pages
    /// hold fewer tokens than a public prefix must cover; after, when a
    /// worker that computes prompts could not keep every page. A decode
    /// worker that keeps none (behind one-sided writes) is no error: the
    /// pages then cross the link with each request, as any prompt's do.
    /// Errors never quote the text (I10).
    pub fn cache_public_system_prompt(&self, text: &str) -> Result<PublicPrompt, EngineError> {
        if text.trim().is_empty() {
            return Err(EngineError::PublicPromptEmpty);
        }
        let template =
            self.model
                .chat_template
                .as_ref()
                .ok_or_else(|| EngineError::NoChatTemplate {
                    model: self.model.name.clone(),
                })?;
        let message = kvfence_model::ChatMessage {
            role: "system".into(),
            content: text.to_string(),
        };
        let tokens =
            template.encode(&self.model.tokenizer, std::slice::from_ref(&message), false)?;
        let page_size = self.pool.geometry().page_size;
        let whole = tokens.len() / page_size * page_size;
        // A public match must cover at least one token, as the pool's
        // lookup requires.
        let min_tokens = self.pool.public_min_tokens().unwrap_or(0).max(1);
        if whole < min_tokens {
            return Err(EngineError::PublicPromptTooShort {
                tokens: tokens.len(),
                whole,
                page_size,
                min_tokens,
            });
        }
        let mut decode_keeps = true;
        for (role, kept) in self.cache_public_prefix(tokens)? {
            match role {
                Role::Colocated | Role::Prefill if kept < whole => {
                    return Err(EngineError::PublicPromptNotKept {
                        role: role.label(),
                        kept,
                        whole,
                    });
                }
                Role::Decode if kept < whole => decode_keeps = false,
                _ => {}
            }
        }
        Ok(PublicPrompt {
            tokens: whole,
            decode_keeps,
        })
    }

    /// Queues a request. Refused at once, holding nothing, if it can never
    /// fit the pool or the queue is full.
    pub fn submit(&self, request: GenerationRequest) -> Result<RequestHandle, EngineError> {
        self.submit_to(request, None)
    }

    /// [`Engine::submit`], naming the prefill worker (as listed by
    /// [`Engine::prefill_peers`]) a decode worker should use if it still
    /// can: the router's half of choosing the pair.
    pub fn submit_to(
        &self,
        request: GenerationRequest,
        prefill: Option<String>,
    ) -> Result<RequestHandle, EngineError> {
        if !self.is_admitting() {
            return Err(EngineError::ShuttingDown);
        }
        // Checked here, once, for every path in — HTTP, a router's link,
        // tests — so a bad request is refused alone, before it can share a
        // batch with anyone.
        if request.prompt.is_empty() || request.max_tokens == 0 {
            return Err(EngineError::Invalid {
                reason: "a request needs prompt tokens and max_tokens of at least 1".into(),
            });
        }
        let config = self.model.model.config();
        if let Some(&token) = request
            .prompt
            .iter()
            .find(|&&t| t as usize >= config.vocab_size)
        {
            return Err(EngineError::Invalid {
                reason: format!(
                    "token id {token} is outside the vocabulary of {}",
                    config.vocab_size
                ),
            });
        }
        if request.kv_tokens() > config.max_position_embeddings {
            return Err(EngineError::TooLong {
                needed: request.kv_tokens(),
                capacity: config.max_position_embeddings,
            });
        }
        request
            .sampling
            .validate()
            .map_err(|e| EngineError::Invalid {
                reason: e.to_string(),
            })?;
        let capacity = self.pool.capacity_tokens();
        if request.kv_tokens() > capacity {
            return Err(EngineError::TooLong {
                needed: request.kv_tokens(),
                capacity,
            });
        }
        // Sheddable work may fill half the queue: the rest stays for
        // work that is not, which a full queue would refuse.
        let bound = match request.share.sheddable() {
            true => self.config.max_queue / 2,
            false => self.config.max_queue,
        };
        self.counters
            .queued
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |q| {
                (q < bound).then_some(q + 1)
            })
            .map_err(|_| {
                if request.share.sheddable() {
                    self.counters.shed.fetch_add(1, Ordering::Relaxed);
                }
                EngineError::QueueFull { capacity: bound }
            })?;
        let id = RequestId(self.next_id.fetch_add(1, Ordering::Relaxed));
        let (pending, handle) = Pending::for_client(id, request, prefill);
        if self
            .commands
            .send(Command::Submit(Box::new(pending)))
            .is_err()
        {
            self.counters.queued.fetch_sub(1, Ordering::AcqRel);
            return Err(EngineError::ShuttingDown);
        }
        Ok(handle)
    }

    /// Starts draining: new requests are refused (`ShuttingDown`), those
    /// queued and running go on to their end.
    pub fn stop_admitting(&self) {
        self.admitting.store(false, Ordering::Release);
    }

    /// Whether new requests are taken.
    pub fn is_admitting(&self) -> bool {
        self.admitting.load(Ordering::Acquire)
    }

    /// Whether the worker can take work now: it admits, and a decode
    /// worker has a prefill worker to fill its grants.
    pub fn is_ready(&self) -> bool {
        self.is_admitting()
            && (self.role != Role::Decode
                || self.prefill.is_some()
                || !self.prefills.list().is_empty())
    }

    /// Requests queued or running — or, when more, router requests whose
    /// answers are still on their way back (each is one of the former
    /// until its scheduler finishes it): zero only once both are.
    pub fn in_flight(&self) -> usize {
        let stats = self.stats();
        (stats.queued + stats.running).max(self.relaying.load(Ordering::Acquire))
    }

    /// Counts a router request's answer as in flight until the returned
    /// guard drops.
    pub fn relaying(&self) -> Relaying {
        self.relaying.fetch_add(1, Ordering::AcqRel);
        Relaying(Arc::clone(&self.relaying))
    }

    /// Stops the scheduler now: queued and running requests end with a
    /// `ShuttingDown` failure and give their pages back; new ones are refused.
    pub fn shutdown(&self) {
        let _ = self.commands.send(Command::Shutdown);
        if let Some(peer) = &self.prefill {
            let _ = peer.commands.send(Command::Shutdown);
        }
    }

    /// The scheduling limits this engine runs with.
    pub fn config(&self) -> EngineConfig {
        self.config
    }

    /// The client-facing worker's KV pool (colocated or decode).
    pub fn pool(&self) -> &Pool {
        &self.pool
    }

    /// Current counters.
    pub fn stats(&self) -> EngineStats {
        self.counters.snapshot()
    }
}

impl Drop for Engine {
    /// Stops the scheduler: requests still queued or running get a
    /// `ShuttingDown` failure, and every lease is returned.
    fn drop(&mut self) {
        self.shutdown();
        for thread in self.threads.drain(..) {
            let _ = thread.join();
        }
    }
}

impl std::fmt::Debug for Engine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Engine")
            .field("config", &self.config)
            .field("stats", &self.stats())
            .finish()
    }
}

impl crate::Status for Engine {
    fn capacities(&self) -> Vec<(&'static str, usize)> {
        Engine::capacities(self)
    }

    fn snapshot(&self) -> Vec<WorkerSnapshot> {
        let (pools, engine) = Engine::snapshot(self);
        WorkerSnapshot::local(pools, engine)
    }

    fn is_ready(&self) -> bool {
        Engine::is_ready(self)
    }
}

/// How a decode (or colocated) worker drains: it stops admitting and
/// finishes what it holds, answers on their way to routers included.
impl crate::Drain for Engine {
    fn stop_admitting(&self) {
        Engine::stop_admitting(self)
    }

    fn in_flight(&self) -> usize {
        Engine::in_flight(self)
    }
}

impl crate::Backend for Engine {
    fn submit(&self, request: GenerationRequest) -> crate::Submitted<'_> {
        // Queueing here never waits: answer at once.
        Box::pin(std::future::ready(Engine::submit(self, request)))
    }

    fn shutdown(&self) {
        Engine::shutdown(self)
    }
}

#[cfg(test)]
mod tests {
    use kvfence_pool::{ElemType, Pool, PoolSize, PoolSpec};

    use super::*;

    #[test]
    fn an_answer_on_its_way_to_a_router_keeps_the_worker_in_flight() {
        // A draining decode worker exits once nothing is in flight: an
        // answer its scheduler finished but its link has not sent yet must
        // count, or the router hears "unreachable" instead of the end.
        let model = crate::testing::tiny_model();
        let spec = PoolSpec::new(
            model.model.kv_shape(),
            16,
            ElemType::F32,
            PoolSize::Tokens(256),
        );
        let engine = Engine::start(
            Arc::clone(&model),
            Pool::new(&spec).expect("a 256-token pool"),
            EngineConfig::default(),
        );
        assert_eq!(engine.in_flight(), 0);
        let first = engine.relaying();
        let second = engine.relaying();
        assert_eq!(engine.in_flight(), 2);
        drop(first);
        assert_eq!(engine.in_flight(), 1);
        drop(second);
        assert_eq!(engine.in_flight(), 0);
        // A request running and being relayed is one request in flight.
        let mut handle = engine
            .submit(crate::request::GenerationRequest {
                ignore_eos: true,
                ..GenerationRequest::greedy(vec![1, 2, 3], 64)
            })
            .expect("the pool holds it");
        let relayed = engine.relaying();
        assert!(matches!(handle.blocking_next(), Some(Event::Token { .. })));
        assert_eq!(engine.in_flight(), 1, "counted once while it runs");
        drop(handle);
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while engine.stats().running > 0 {
            assert!(
                std::time::Instant::now() < deadline,
                "the cancelled request ends"
            );
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
        assert_eq!(engine.in_flight(), 1, "still relaying its end");
        drop(relayed);
        assert_eq!(engine.in_flight(), 0);
        engine.shutdown();
    }

    /// A colocated worker that keeps only its windows keeps a public system
    /// prompt longer than a window's pages whole: the windowed groups seal
    /// its pages as they slide past them, so every group holds it.
    #[test]
    fn a_public_prompt_longer_than_a_window_is_kept_by_every_group() {
        let model = crate::testing::windowed_model();
        let config = EngineConfig::default();
        let spec = PoolSpec::new(
            model.model.kv_shape(),
            16,
            ElemType::F32,
            PoolSize::Tokens(8192),
        )
        .with_layer_groups(model.model.layer_groups(config.longest_write()).unwrap())
        .with_prefix_cache(1024);
        let pool = Pool::new(&spec).unwrap();
        assert!(pool.layer_groups().is_windowed());
        let engine = Engine::start(Arc::clone(&model), pool, config);
        let kept = engine
            .cache_public_system_prompt(&"Answer in full sentences. ".repeat(40))
            .unwrap();
        // Past the 448 positions a window's pages hold at 256-token steps.
        assert!(kept.tokens > 900, "{} tokens kept", kept.tokens);
        engine.shutdown();
    }

    /// Disaggregated workers that keep only their windows hand off only
    /// what decode reads — every prompt page of the global layers, the
    /// window of the others — and answer exactly as one colocated worker
    /// keeping every position does, over both two-sided transports, with
    /// and without the prefix caches (a second long prompt starts from
    /// cached pages at both ends). Both pools end at baseline (I8).
    #[test]
    fn sliding_windows_cross_the_hand_off_and_answer_as_full_kv_does() {
        use crate::request::{CacheScope, Event, GenerationRequest, Share};
        use crate::{EngineStats, Transport};

        let model = crate::testing::windowed_model();
        let config = EngineConfig::default();
        let groups = model.model.layer_groups(config.longest_write()).unwrap();
        assert!(groups.is_windowed());
        let pool = |windows: bool, cache: bool| {
            let mut spec = PoolSpec::new(
                model.model.kv_shape(),
                16,
                ElemType::F32,
                PoolSize::Tokens(4096),
            );
            if windows {
                spec = spec.with_layer_groups(groups.clone());
            }
            if cache {
                spec = spec.with_prefix_cache(256);
            }
            Pool::new(&spec).unwrap()
        };
        // Past the window (40), and past the 448 positions a window's
        // pages hold at 256-token steps: a decode lease's window jumps.
        let long: Vec<u32> = (0..1000).map(|i| (i * 7 + 1) % 250).collect();
        let prompts = [long.clone(), (0..30).collect(), long];
        // Texts, counters, and each pool's prefix-cache hits.
        let run = |engine: &Engine| -> (Vec<String>, EngineStats, Vec<u64>) {
            let texts = prompts
                .iter()
                .map(|prompt| {
                    let mut handle = engine
                        .submit(GenerationRequest {
                            ignore_eos: true,
                            cache: Some(CacheScope::tenant("a", None)),
                            share: Share::new("a", 1),
                            ..GenerationRequest::greedy(prompt.clone(), 30)
                        })
                        .unwrap();
                    let mut text = String::new();
                    loop {
                        match handle.blocking_next().unwrap() {
                            Event::Token { text: t, .. } => text.push_str(&t),
                            Event::Finished { .. } => return text,
                            other => panic!("{other:?}"),
                        }
                    }
                })
                .collect();
            // The answer's end reaches the client before its pages go back.
            let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
            while engine
                .pools()
                .iter()
                .any(|(_, p)| p.stats().leased_pages + p.stats().quarantined_pages > 0)
            {
                assert!(
                    std::time::Instant::now() < deadline,
                    "I8: every page back once every request ended"
                );
                std::thread::sleep(std::time::Duration::from_millis(5));
            }
            let hits: Vec<u64> = engine
                .pools()
                .iter()
                .map(|(_, p)| p.stats().cache_hit_tokens)
                .collect();
            (texts, engine.stats(), hits)
        };
        let colocated = Engine::start(Arc::clone(&model), pool(false, false), config);
        let (reference, ..) = run(&colocated);
        colocated.shutdown();
        for transport in [
            Transport::InProcess,
            Transport::Linked(Arc::new(crate::testing::Pipe)),
        ] {
            let start = |windows: bool, cache: bool| {
                Engine::start_disaggregated(
                    Arc::clone(&model),
                    pool(windows, cache),
                    pool(windows, cache),
                    config,
                    &transport,
                )
                .unwrap()
            };
            let full = start(false, false);
            let (texts, everything, _) = run(&full);
            full.shutdown();
            assert_eq!(texts, reference, "{transport:?}, every position");
            for cache in [false, true] {
                let windowed = start(true, cache);
                let (texts, windows, hits) = run(&windowed);
                windowed.shutdown();
                assert_eq!(texts, reference, "{transport:?}, windows, cache {cache}");
                // The second long prompt: the prefill worker computes from
                // its cached pages, the decode worker is sent only the rest.
                assert_eq!(
                    hits.iter().all(|&h| h > 500),
                    cache,
                    "decode and prefill cache hits {hits:?}"
                );
                assert_eq!(windows.handoffs_committed, 3);
                // Half the layers cross with a window of their prompt.
                assert!(
                    windows.handoff_bytes * 10 < everything.handoff_bytes * 7,
                    "{} bytes where every position took {}",
                    windows.handoff_bytes,
                    everything.handoff_bytes
                );
            }
        }
    }
}

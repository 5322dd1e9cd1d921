//! Admission: which waiting requests get pages now — fair shares between
//! tenants, priority bands, the admission cap and shedding — and, when the
//! pool runs out, which running request gives its pages back (preemption).

use std::cmp::Reverse;
use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::Ordering;
use std::time::Instant;

use kvfence_model::Sampler;
use kvfence_pool::mutation::Mutation;
use kvfence_pool::{Lease, PoolError, RequestId};
use tracing::{debug, warn};

use super::{Active, Awaiting, Kv, Origin, PeerId, Pending, Resume, Role, Scheduler, fair};
use crate::request::{CacheScope, FailureKind};
use crate::text::TextStream;

/// What admission does with the request at the front of the queue.
enum Admission {
    /// It waits — for a running slot, for room to grow, or for pages —
    /// and sheddable work behind it is shed unless it is sheddable itself.
    Wait { sheddable: bool },
    /// It can never be served here (or the worker it needs is gone).
    Refuse(FailureKind, String),
    /// It starts on these pages, computed as `Route` says.
    Admit(Lease, Route),
}

/// Where an admitted request's KV is computed.
enum Route {
    /// On this worker's own pages (colocated, prefill, a preempted request
    /// resuming on a decode worker).
    Local,
    /// By the prefill worker on this link, into pages granted it.
    Grant(PeerId),
}

impl Scheduler {
    pub(super) fn drop_cancelled(&mut self) {
        let dropped_waiting = self.waiting.retain(|p| !p.is_cancelled());
        self.counters
            .queued
            .fetch_sub(dropped_waiting, Ordering::AcqRel);
        let mut dropped_active = 0;
        for index in (0..self.active.len()).rev() {
            let stepping = self
                .in_flight
                .as_ref()
                .is_some_and(|flight| flight.ids.contains(&self.active[index].pending.id));
            // One in the step in flight goes when the step ends: its pass
            // still holds positions in the batch.
            if self.active[index].pending.is_cancelled() && !stepping {
                let active = self.active.swap_remove(index);
                if let Some(peer) = active.kv.awaited_from()
                    && let Some(abort) = self.receiver.abort(active.pending.handoff_id())
                {
                    // The reservation is freed now; tell prefill to stop.
                    self.send_to_peer(peer, &abort);
                }
                dropped_active += 1;
            }
        }
        self.counters
            .running
            .fetch_sub(dropped_active, Ordering::AcqRel);
        let dropped = dropped_waiting + dropped_active;
        if dropped > 0 {
            self.counters
                .cancelled
                .fetch_add(dropped as u64, Ordering::Relaxed);
            debug!(dropped, "cancelled requests released");
        }
    }

    /// Refuses (503) every client request that has waited in the queue
    /// longer than `max_queue_wait` without being admitted: it cost nothing
    /// yet, and its client learns to retry instead of hanging. A request
    /// that already streamed tokens (preempted) or a prefill worker's order
    /// (its decode worker keeps the deadlines) is never expired here.
    pub(super) fn expire_waits(&mut self, now: Instant) {
        let limit = self.config.max_queue_wait;
        for pending in self.waiting.iter_mut() {
            pending.waiting_since.get_or_insert(now);
        }
        let expired = self.waiting.take_where(|p| {
            matches!(p.origin, Origin::Client { .. })
                && p.resume.is_none()
                && p.waiting_since.is_some_and(|since| now >= since + limit)
        });
        for mut pending in expired {
            self.counters.queued.fetch_sub(1, Ordering::AcqRel);
            self.counters.queue_timeouts.fetch_add(1, Ordering::Relaxed);
            debug!(request = %pending.id, "waited past --max-queue-wait; refused");
            let message = format!(
                "the request waited {} s in the queue without being admitted; retry later",
                limit.as_secs_f64()
            );
            self.refuse(&mut pending, FailureKind::Unavailable, message);
        }
    }

    /// Under pressure — the next request to admit waits for room — every
    /// sheddable client request still waiting (negative priority, none of
    /// its tokens sent yet) is refused with 503 if the one that waits is
    /// not sheddable itself: bands keep them behind it, and their clients
    /// learn at once to retry later or elsewhere instead of holding queue
    /// places. Sheddable work waits only behind other sheddable work.
    pub(super) fn shed_for(&mut self, blocked_is_sheddable: bool) {
        if blocked_is_sheddable {
            return;
        }
        let shed = self.waiting.take_where(|p| {
            p.request.share.sheddable()
                && matches!(p.origin, Origin::Client { .. })
                && p.resume.is_none()
        });
        for mut pending in shed {
            self.counters.queued.fetch_sub(1, Ordering::AcqRel);
            self.counters.shed.fetch_add(1, Ordering::Relaxed);
            debug!(request = %pending.id, priority = pending.request.share.priority(), "sheddable request shed");
            self.refuse(
                &mut pending,
                FailureKind::Unavailable,
                "the worker is full and this request is sheddable (negative priority); retry later"
                    .into(),
            );
        }
    }

    /// What a request leases when it is admitted: its context so far (the
    /// prompt, or after a preemption the prompt and what it generated but
    /// its last token) and, where it decodes, one page of room to grow. A
    /// prefill worker leases the prompt alone.
    pub(super) fn first_lease(&self, pending: &Pending) -> (usize, Vec<u32>) {
        let request = &pending.request;
        let mut context = request.prompt.clone();
        if let Some(resume) = &pending.resume {
            let written = resume.generated.len().saturating_sub(1);
            context.extend_from_slice(&resume.generated[..written]);
        }
        let room = match self.role {
            Role::Prefill => 0,
            Role::Colocated | Role::Decode => {
                let page_size = self.pool.geometry().page_size;
                let left = request.kv_tokens().saturating_sub(context.len());
                left.min(page_size)
            }
        };
        (context.len() + room, context)
    }

    /// The link `peer` is gone. A decode worker fails every hand-off that
    /// link was filling (their reservations freed) and sends new grants to
    /// its other prefill workers; a prefill worker drops that link's orders.
    pub(super) fn lose_peer(&mut self, peer: PeerId) {
        let Some(lost) = self.peers.remove(&peer) else {
            return;
        };
        warn!(role = self.role.label(), %peer, name = %lost.name, "peer link lost; failing its hand-offs");
        match self.role {
            Role::Decode => self.move_handoffs_of(peer),
            Role::Prefill | Role::Colocated => self.drop_orders_of(peer),
        }
    }

    /// Leases a request's first pages (see [`Scheduler::first_lease`]),
    /// starting with the longest prefix of its context its tenant has
    /// cached here: a colocated or prefill worker then computes only the
    /// rest, a decode worker is sent only the pages it lacks. (A one-sided
    /// writer is never given shared pages: shared-memory grants lease
    /// plainly. A prompt being scored is computed whole where it is
    /// computed: a cached position would have no logits to score it by.)
    ///
    /// A lease a decode worker grants holds, of each sliding-window layer
    /// group, only the pages from where its first pass reads: its windows
    /// slide there now, so that sliding past cached pages, which takes
    /// fresh ones, runs short here (`Exhausted`: the request waits) rather
    /// than in the grant.
    pub(super) fn lease_for(&self, pending: &Pending) -> Result<Lease, PoolError> {
        let mut lease = self.first_pages(pending)?;
        if self.role == Role::Decode && pending.resume.is_none() {
            lease.slide_windows(pending.request.prompt.len())?;
        }
        Ok(lease)
    }

    /// [`Scheduler::lease_for`] before any window slides.
    fn first_pages(&self, pending: &Pending) -> Result<Lease, PoolError> {
        let (tokens, context) = self.first_lease(pending);
        let one_sided_grant =
            self.role == Role::Decode && self.one_sided && pending.resume.is_none();
        let computes_scores = self.role != Role::Decode && pending.scores_prompt();
        match &pending.request.cache {
            Some(scope) if !one_sided_grant && !computes_scores && self.pool.has_prefix_cache() => {
                let namespace = match scope {
                    CacheScope::Tenant(scope) => {
                        self.pool
                            .namespace(&scope.tenant, scope.salt.as_deref(), &self.model.name)
                    }
                    CacheScope::Public => self.pool.public_namespace(&self.model.name),
                };
                self.pool
                    .lease_with_prefix(pending.id, tokens, &namespace, &context)
            }
            _ => self.pool.lease(pending.id, tokens),
        }
    }

    /// Whether a request must be refused because it can never fit this
    /// worker's pool, however long it waits (I6): for a prefill worker its
    /// prompt, for the others prompt plus `max_tokens`, since pages grow as
    /// it decodes.
    pub(super) fn can_never_fit(&self, pending: &Pending) -> Option<String> {
        let needed = match self.role {
            Role::Prefill => pending.request.prompt.len(),
            Role::Colocated | Role::Decode => pending.request.kv_tokens(),
        };
        let capacity = self.pool.capacity_tokens();
        (needed > capacity).then(|| {
            PoolError::LargerThanPool {
                owner: pending.id,
                needed,
                capacity,
            }
            .to_string()
        })
    }

    /// Whether admitting a request that needs `pages` new pages leaves
    /// every running request room to grow by a page of positions (a page
    /// of each of its layer groups at most): admission stops short of the
    /// point where the next step would have to preempt.
    pub(super) fn leaves_room_to_grow(&self, pages: usize) -> bool {
        if self.role == Role::Prefill || self.active.is_empty() {
            return true;
        }
        let growth = self.active.len() * self.pool.layer_groups().len();
        self.pool.stats().available_pages() >= pages + growth
    }

    /// Tenants admitted no more for now: they hold
    /// [`fair::MAX_POOL_SHARE`] of this worker's pool while it knows other
    /// tenants (I11). Held pages count by capacity; a grant awaiting its
    /// hand-off by its prompt.
    /// Pool tokens each tenant's running requests hold (a grant awaiting
    /// its KV holds its prompt's pages), with the tenant's weight.
    pub(super) fn held_by_tenant(&self) -> BTreeMap<&str, (u32, usize)> {
        let mut held: BTreeMap<&str, (u32, usize)> = BTreeMap::new();
        for a in &self.active {
            let tokens = match &a.kv {
                Kv::Held(lease) => lease.capacity_tokens(),
                Kv::Awaited(_) => a.pending.request.prompt.len(),
            };
            let share = &a.pending.request.share;
            let entry = held.entry(share.tenant.as_str()).or_default();
            entry.0 = share.weight();
            entry.1 += tokens;
        }
        held
    }

    /// Tenants holding more of the pool than their weighted share of it
    /// among the tenants holding pages (none while only one does).
    pub(super) fn tenants_over_their_share(&self) -> BTreeSet<String> {
        let held = self.held_by_tenant();
        if held.len() < 2 {
            return BTreeSet::new();
        }
        let weights: u64 = held.values().map(|(w, _)| u64::from(*w)).sum();
        let pool = self.pool.capacity_tokens() as u64;
        held.into_iter()
            .filter(|(_, (weight, tokens))| *tokens as u64 * weights > pool * u64::from(*weight))
            .map(|(tenant, _)| tenant.to_string())
            .collect()
    }

    /// Tenants admitted no more while the worker knows another: those
    /// holding [`fair::MAX_POOL_SHARE`] of the pool.
    pub(super) fn tenants_at_their_cap(&self) -> BTreeSet<String> {
        if !self.shared() {
            return BTreeSet::new();
        }
        let (num, den) = fair::MAX_POOL_SHARE;
        let cap = self.pool.capacity_tokens() * num / den;
        self.held_by_tenant()
            .into_iter()
            .filter(|&(_, (_, tokens))| tokens >= cap)
            .map(|(tenant, _)| tenant.to_string())
            .collect()
    }

    /// Takes the request at the front of the queue for tenants `eligible`
    /// — one is there: the caller just looked at it — and stops counting
    /// it queued.
    fn take_front(&mut self, eligible: impl Fn(&str) -> bool) -> Pending {
        let pending = self
            .waiting
            .pop_front(eligible)
            .expect("the front the caller looked at is still there");
        self.counters.queued.fetch_sub(1, Ordering::AcqRel);
        pending
    }

    /// What admission does with the request at the front of the queue,
    /// decided without changing anything but the pool (a lease taken for
    /// `Admit` is given back if the decision is dropped).
    fn decide(&self, pending: &Pending) -> Admission {
        let wait = Admission::Wait {
            sheddable: pending.request.share.sheddable(),
        };
        if self.active.len() >= self.config.max_running {
            return wait;
        }
        if let Some(message) = self.can_never_fit(pending) {
            return Admission::Refuse(FailureKind::TooLong, message);
        }
        if !self.leaves_room_to_grow(self.pool.pages_for(self.first_lease(pending).0)) {
            return wait;
        }
        // A preempted request comes back to this worker's own pages and
        // recomputes here; only a new one is granted to prefill.
        let route = if self.role == Role::Decode && pending.resume.is_none() {
            match self.choose_prefill(pending) {
                Ok(peer) => Route::Grant(peer),
                Err((kind, message)) => return Admission::Refuse(kind, message),
            }
        } else {
            Route::Local
        };
        match self.lease_for(pending) {
            Ok(lease) => Admission::Admit(lease, route),
            // Pages will come back as running requests end; keep order.
            Err(PoolError::Exhausted { .. }) => wait,
            Err(error) => Admission::Refuse(FailureKind::TooLong, error.to_string()),
        }
    }

    /// Admits waiting requests, in the order fair shares and priority
    /// bands give, until the front one must wait.
    pub(super) fn admit(&mut self, now: Instant) {
        // Incident replay (l): cached tokens read off the pool-wide counter
        // across an admission pass, other tenants' hits included.
        let pass_hits = Mutation::ForeignCachedCount
            .active()
            .then(|| self.pool.stats().cache_hit_tokens);
        loop {
            let capped = self.tenants_at_their_cap();
            let eligible = |tenant: &str| !capped.contains(tenant);
            let Some(pending) = self.waiting.front(eligible) else {
                break;
            };
            match self.decide(pending) {
                Admission::Wait { sheddable } => {
                    self.shed_for(sheddable);
                    break;
                }
                Admission::Refuse(kind, message) => {
                    let mut pending = self.take_front(eligible);
                    self.refuse(&mut pending, kind, message);
                }
                Admission::Admit(lease, route) => {
                    let pending = self.take_front(eligible);
                    self.start_admitted(pending, lease, route, now, pass_hits);
                }
            }
        }
    }

    /// Starts an admitted request on `lease`: a preempted one goes on where
    /// it stopped; a new one gets its sampler and grammar and, granted to a
    /// prefill worker, is ordered there. `pass_hits` is incident replay
    /// (l)'s pool-wide count at the pass's start.
    fn start_admitted(
        &mut self,
        mut pending: Pending,
        lease: Lease,
        route: Route,
        now: Instant,
        pass_hits: Option<u64>,
    ) {
        if matches!(pending.origin, Origin::Client { .. }) && pending.resume.is_none() {
            let waited = pending
                .waiting_since
                .map_or(std::time::Duration::ZERO, |since| {
                    now.saturating_duration_since(since)
                });
            self.counters
                .queue_wait(&pending.request.share.tenant, waited);
        }
        self.admissions += 1;
        let admitted = self.admissions;
        pending.timeline.admitted();
        if let Some(resume) = pending.resume.take() {
            assert!(
                matches!(route, Route::Local),
                "a preempted request resumes on this worker's own pages"
            );
            let Resume {
                sampler,
                constraint,
                text,
                generated,
                cached,
            } = *resume;
            debug!(request = %pending.id, written = lease.cached_tokens(), "preempted request resumes");
            self.counters.running.fetch_add(1, Ordering::AcqRel);
            self.active.push(Active {
                written: lease.cached_tokens(),
                pending,
                kv: Kv::Held(lease),
                sampler,
                constraint,
                text,
                cached,
                generated,
                admitted,
            });
            return;
        }
        let sampler = match Sampler::new(pending.request.sampling.clone()) {
            Ok(sampler) => sampler,
            Err(error) => {
                self.refuse(&mut pending, FailureKind::Internal, error.to_string());
                return;
            }
        };
        let constraint = match self.constraint_for(&pending.request) {
            Ok(None) if Mutation::LeftoverConstraint.active() => self.left_in_row.constraint.take(),
            Ok(constraint) => constraint,
            Err(error) => {
                // The front door compiled this grammar before; failing
                // here is the grammar's limits, never its text (I10).
                warn!(request = %pending.id, "the request's grammar did not compile");
                self.refuse(&mut pending, FailureKind::Internal, error.to_string());
                return;
            }
        };
        // A decode worker's cached pages only spare the link; its request
        // counts as written when the hand-off commits.
        let written = match self.role {
            Role::Decode => 0,
            Role::Colocated | Role::Prefill => lease.cached_tokens(),
        };
        let cached = match pass_hits {
            Some(before) => (self.pool.stats().cache_hit_tokens - before) as usize,
            None => written,
        };
        let kv = match route {
            Route::Local => Kv::Held(lease),
            Route::Grant(peer) => match self.grant_to_prefill(&pending, lease, peer, now) {
                Ok(awaiting) => Kv::Awaited(awaiting),
                Err(error) => {
                    self.refuse(&mut pending, FailureKind::Internal, error.to_string());
                    return;
                }
            },
        };
        let text = TextStream::new(pending.request.stop.clone());
        self.counters.running.fetch_add(1, Ordering::AcqRel);
        self.active.push(Active {
            pending,
            kv,
            sampler,
            constraint,
            text,
            written,
            cached,
            generated: Vec::new(),
            admitted,
        });
    }

    /// Grants `lease` to the prefill worker on link `peer` for `pending`'s
    /// prompt and sends it the order: the request then awaits its KV.
    fn grant_to_prefill(
        &mut self,
        pending: &Pending,
        lease: Lease,
        peer: PeerId,
        now: Instant,
    ) -> Result<Awaiting, kvfence_handoff::HandoffError> {
        let prompt = pending.request.prompt.len();
        let (grant, window) = if self.one_sided {
            let (grant, window) =
                self.receiver
                    .grant_one_sided(pending.handoff_id(), lease, prompt)?;
            (grant, Some((window.clone(), window.key())))
        } else {
            let grant = self.receiver.grant(pending.handoff_id(), lease, prompt)?;
            (grant, None)
        };
        if let Some(top) = pending.request.sampling.prompt_logprobs {
            // It commits only with every prompt score (I7).
            self.receiver
                .expect_prompt_logprobs(pending.handoff_id(), top);
        }
        // Its prompt is computed for this worker's tenant elsewhere:
        // charged here, or this worker's admission — which decides whose
        // prompts the prefill workers get — would see only decode rows and
        // admit in arrival order (I11).
        self.waiting.charge(&pending.request.share, prompt);
        self.send_order(peer, grant, pending, window);
        Ok(Awaiting {
            prefill: peer,
            granted_at: now,
            heard_at: now,
            news: false,
        })
    }

    /// Gives every decoding request room for the position its next token
    /// writes, higher priorities and older requests first. One that cannot
    /// grow takes the pages of another request holding pages — the lowest
    /// priority, then one of a tenant over its weighted share of the pool,
    /// then the most recently admitted — or, if that is itself, steps back itself:
    /// a running request is preempted, never failed, for lack of pages,
    /// and the oldest requests keep going.
    pub(super) fn make_room(&mut self) {
        let mut order: Vec<(Reverse<i32>, u64, RequestId)> = self
            .active
            .iter()
            .filter(|a| a.kv.lease().is_some() && a.prefill_done())
            .map(|a| {
                let priority = a.pending.request.share.priority();
                (Reverse(priority), a.admitted, a.pending.id)
            })
            .collect();
        order.sort_unstable();
        for (_, _, id) in order {
            while let Some(index) = self.position(id) {
                let active = &mut self.active[index];
                let need = active.written + 1;
                let lease = active.kv.lease_mut().expect("chosen for holding a lease");
                if lease.capacity_tokens() >= need || lease.grow(1).is_ok() {
                    break;
                }
                // The lowest priority first, then a tenant holding more
                // than its weighted share of the pool (I11: growth must
                // not let one tenant push another out), then the newest.
                let over_share = self.tenants_over_their_share();
                let victim = self
                    .active
                    .iter()
                    .enumerate()
                    .filter(|(_, a)| a.kv.lease().is_some())
                    .max_by_key(|(_, a)| {
                        let share = &a.pending.request.share;
                        (
                            Reverse(share.priority()),
                            over_share.contains(&share.tenant),
                            a.admitted,
                        )
                    })
                    .map(|(i, _)| i)
                    .expect("the request itself holds a lease");
                self.preempt(victim);
            }
        }
    }

    /// Takes request `index`'s pages back and puts it at the front of the
    /// queue with its progress. What it wrote is sealed into the cache
    /// first, so coming back costs little more than its last page.
    pub(super) fn preempt(&mut self, index: usize) {
        let mut active = self.active.swap_remove(index);
        assert!(
            matches!(active.pending.origin, Origin::Client { .. }),
            "only a decoding request grows, so only one is preempted"
        );
        active.seal_conversation();
        let Active {
            mut pending,
            kv,
            sampler,
            constraint,
            text,
            generated,
            cached,
            ..
        } = active;
        drop(kv);
        debug!(request = %pending.id, generated = generated.len(), "preempted for pages");
        pending.timeline.preempted();
        pending.resume = Some(Box::new(Resume {
            sampler,
            constraint,
            text,
            generated,
            cached,
        }));
        self.counters.running.fetch_sub(1, Ordering::AcqRel);
        self.counters.queued.fetch_add(1, Ordering::AcqRel);
        self.counters.preempted.fetch_add(1, Ordering::Relaxed);
        self.waiting.push_front(pending);
    }
}

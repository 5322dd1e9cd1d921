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

use std::cmp::Reverse;

use super::affinity::{Affinity, Pair};
use super::client::RemoteEngine;
use crate::counters::WorkerSnapshot;
use crate::error::EngineError;
use crate::request::GenerationRequest;
use crate::scheduler::Role;

/// Several decode workers behind one router. The advertised context is
/// the smallest pool any of them, or any prefill worker they were linked
/// to, holds: any pair may get any request (I6).
#[derive(Debug)]
pub struct Fleet {
    workers: Vec<RemoteEngine>,
    affinity: Affinity,
}

/// Requests in flight a pair holding a request's prefix may carry above
/// the least loaded pair and still be chosen first.
const AFFINITY_SLACK: usize = 4;

/// One pair the router could send a request to.
struct Candidate<'a> {
    index: usize,
    worker: &'a RemoteEngine,
    prefill: String,
    load: usize,
    free_pages: usize,
}

impl Fleet {
    /// A fleet of decode workers (at least one).
    pub fn new(workers: Vec<RemoteEngine>) -> Result<Fleet, EngineError> {
        if workers.is_empty() {
            return Err(EngineError::Invalid {
                reason: "a router needs at least one decode worker".into(),
            });
        }
        Ok(Fleet {
            workers,
            affinity: Affinity::default(),
        })
    }

    /// Requests in flight on each worker, in the order given.
    pub fn load(&self) -> Vec<usize> {
        self.workers.iter().map(RemoteEngine::in_flight).collect()
    }

    /// Whether every worker has answered once, so the advertised context
    /// is known from all of them.
    pub fn has_heard_from_every_worker(&self) -> bool {
        self.workers.iter().all(|w| w.hello().is_some())
    }

    /// Whether some worker has answered once.
    pub fn has_heard_from_any_worker(&self) -> bool {
        self.workers.iter().any(|w| w.hello().is_some())
    }

    /// The pairs that could take `request`, best first.
    fn candidates(&self, request: &GenerationRequest) -> Vec<Candidate<'_>> {
        let mut candidates = Vec::new();
        for (index, worker) in self.workers.iter().enumerate() {
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
                let on_prefill: usize = self
                    .workers
                    .iter()
                    .map(|w| w.in_flight_on(&prefill.name))
                    .sum();
                candidates.push(Candidate {
                    index,
                    worker,
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
                .position(|c| c.index == pair.decode && c.prefill == pair.prefill)
            && candidates[at].load <= candidates[0].load + AFFINITY_SLACK
        {
            let preferred = candidates.remove(at);
            candidates.insert(0, preferred);
        }
        candidates
    }
}

impl crate::Backend for Fleet {
    fn submit(&self, request: GenerationRequest) -> crate::Submitted<'_> {
        Box::pin(async move {
            let mut last = EngineError::Unavailable {
                reason: format!(
                    "no decode worker with a prefill worker that can hold {} tokens is reachable",
                    request.kv_tokens()
                ),
            };
            for candidate in self.candidates(&request) {
                let pair = Pair {
                    decode: candidate.index,
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

    fn capacities(&self) -> Vec<(&'static str, usize)> {
        let mut least: Vec<(&'static str, usize)> = Vec::new();
        for (role, tokens) in self.workers.iter().flat_map(crate::Backend::capacities) {
            match least.iter_mut().find(|(r, _)| *r == role) {
                Some(entry) => entry.1 = entry.1.min(tokens),
                None => least.push((role, tokens)),
            }
        }
        least
    }

    fn snapshot(&self) -> Vec<WorkerSnapshot> {
        self.workers
            .iter()
            .flat_map(crate::Backend::snapshot)
            .collect()
    }

    fn is_ready(&self) -> bool {
        self.workers.iter().any(crate::Backend::is_ready)
    }

    fn shutdown(&self) {
        for worker in &self.workers {
            crate::Backend::shutdown(worker);
        }
    }
}

//! Fair shares of one worker between tenants (I11): who is admitted next,
//! and how each step's prefill budget is split.
//!
//! Every tenant has a **virtual time**: the tokens this worker computed for
//! it (prompt and completion), divided by its weight. Admission takes the
//! oldest waiting request of the tenant whose virtual time is lowest, so
//! over time each tenant with work gets compute in proportion to its
//! weight, whatever the others send; within a tenant, requests keep their
//! arrival order. A tenant that comes back from idle starts at the lowest
//! virtual time of the tenants that have work: idling banks no credit, and
//! a newcomer waits behind nobody's history.
//!
//! Each step's prefill budget is split between the tenants with prompt
//! tokens to compute by weight ([`split_budget`]: water-filling, work
//! conserving), so a tenant's short prompt is computed in the next step
//! however many long prompts another tenant has admitted. Decode rows are
//! one token per running request and always run; they are charged to their
//! tenants' virtual times like prefill tokens.
//!
//! Priorities come first: a request's priority (within what its tenant may
//! use) picks its band, the highest band with work is admitted first, and
//! fair shares hold within a band. A tenant's own queue is kept in band
//! order, arrival order within a band.
//!
//! Pages are shared too: while a worker knows more than one tenant, no
//! tenant is admitted more once it holds [`MAX_POOL_SHARE`] of a pool, so
//! another tenant's request always finds room without waiting for the
//! first tenant's requests to end (a tenant holding nothing is admitted
//! whatever its request's size: nothing starves).
//!
//! The queue is bounded by the engine's `max_queue` before anything is
//! pushed; the ledger keeps one entry per tenant this worker has seen.

use std::cmp::Reverse;
use std::collections::{BTreeMap, VecDeque};

use super::Pending;
use crate::request::Share;

/// The share of a pool's tokens one tenant may hold before it is admitted
/// no more, while the worker knows other tenants: the rest is room another
/// tenant's request finds at once. (Numerator, denominator.)
pub(crate) const MAX_POOL_SHARE: (usize, usize) = (3, 4);

/// Virtual time of one token at weight 1. Weights divide it; 2^32 keeps
/// every weight up to [`Share::MAX_WEIGHT`] exact to a millionth of a token.
const TOKEN: u128 = 1 << 32;

/// Requests waiting for pages, one FIFO per tenant, taken in fair order.
#[derive(Default)]
pub(crate) struct FairQueue {
    tenants: BTreeMap<String, Ledger>,
    /// Order of arrival: stamps of `push_back` grow from the middle of the
    /// range, those of `push_front` shrink from it, so a request put back
    /// at the front is older than every arrival.
    next_back: u64,
    next_front: u64,
    len: usize,
    /// A request said its front door serves several tenants.
    told_shared: bool,
}

/// One tenant's queue and virtual time.
struct Ledger {
    weight: u32,
    vtime: u128,
    waiting: VecDeque<(u64, Pending)>,
}

impl FairQueue {
    pub(crate) fn new() -> FairQueue {
        FairQueue {
            tenants: BTreeMap::new(),
            next_back: u64::MAX / 2,
            next_front: u64::MAX / 2 - 1,
            len: 0,
            told_shared: false,
        }
    }

    /// Requests waiting.
    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// A new request, at the back of its tenant's queue. `running` says
    /// whether a tenant has requests holding pages: a tenant with neither
    /// those nor waiting requests is idle, and comes back no earlier than
    /// the lowest virtual time of the tenants that have work.
    pub(crate) fn push_back(&mut self, pending: Pending, running: impl Fn(&str) -> bool) {
        let share = &pending.request.share;
        let floor = self
            .tenants
            .iter()
            .filter(|(name, ledger)| {
                **name != share.tenant && (!ledger.waiting.is_empty() || running(name))
            })
            .map(|(_, ledger)| ledger.vtime)
            .min();
        let idle = !running(&share.tenant);
        let stamp = self.next_back;
        self.next_back += 1;
        let ledger = self.ledger(share);
        if idle && ledger.waiting.is_empty() {
            ledger.vtime = ledger.vtime.max(floor.unwrap_or(0));
        }
        // Behind every request of its band or a higher one.
        let band = priority(&pending);
        let at = ledger
            .waiting
            .iter()
            .position(|(_, p)| priority(p) < band)
            .unwrap_or(ledger.waiting.len());
        ledger.waiting.insert(at, (stamp, pending));
        self.len += 1;
    }

    /// A request that held pages and gave them back (preempted, or its
    /// prefill worker lost): at the front of its tenant's queue, older than
    /// every arrival, its tenant's virtual time unchanged.
    pub(crate) fn push_front(&mut self, pending: Pending) {
        let stamp = self.next_front;
        self.next_front -= 1;
        let band = priority(&pending);
        let waiting = &mut self.ledger(&pending.request.share).waiting;
        // Ahead of every request of its band, behind higher bands.
        let at = waiting
            .iter()
            .position(|(_, p)| priority(p) <= band)
            .unwrap_or(waiting.len());
        waiting.insert(at, (stamp, pending));
        self.len += 1;
    }

    /// The entry of `share`'s tenant, made at virtual time 0 if new; the
    /// weight is the latest the gateway gave.
    fn ledger(&mut self, share: &Share) -> &mut Ledger {
        self.told_shared |= share.shared();
        let ledger = self
            .tenants
            .entry(share.tenant.clone())
            .or_insert_with(|| Ledger {
                weight: share.weight(),
                vtime: 0,
                waiting: VecDeque::new(),
            });
        ledger.weight = share.weight();
        ledger
    }

    /// The tenant whose request is admitted next: among tenants with
    /// requests waiting that `eligible` allows, the highest band first,
    /// then the lowest virtual time, then the oldest request.
    fn next_tenant(&self, eligible: impl Fn(&str) -> bool) -> Option<&str> {
        self.tenants
            .iter()
            .filter(|(name, _)| eligible(name))
            .filter_map(|(name, ledger)| {
                let (stamp, front) = ledger.waiting.front()?;
                Some((
                    (Reverse(priority(front)), ledger.vtime, *stamp),
                    name.as_str(),
                ))
            })
            .min()
            .map(|(_, name)| name)
    }

    /// The request admitted next among the tenants `eligible` allows, if
    /// any waits.
    pub(crate) fn front(&self, eligible: impl Fn(&str) -> bool) -> Option<&Pending> {
        let tenant = self.next_tenant(eligible)?;
        self.tenants[tenant].waiting.front().map(|(_, p)| p)
    }

    /// Whether this worker serves several tenants, as far as its work
    /// tells: a request said its front door does, or two named tenants
    /// have sent work (work of no tenant, such as the engine's own start-up
    /// requests, is not a tenant's).
    pub(crate) fn serves_several(&self) -> bool {
        self.told_shared || self.tenants.keys().filter(|name| !name.is_empty()).count() > 1
    }

    /// Takes the request [`FairQueue::front`] shows for the same `eligible`.
    pub(crate) fn pop_front(&mut self, eligible: impl Fn(&str) -> bool) -> Option<Pending> {
        let tenant = self.next_tenant(eligible)?.to_string();
        let (_, pending) = self
            .tenants
            .get_mut(&tenant)
            .and_then(|ledger| ledger.waiting.pop_front())
            .expect("the next tenant has a request waiting");
        self.len -= 1;
        Some(pending)
    }

    /// Adds `tokens` computed for `share`'s tenant to its virtual time.
    pub(crate) fn charge(&mut self, share: &Share, tokens: usize) {
        let ledger = self.ledger(share);
        ledger.vtime += tokens as u128 * TOKEN / u128::from(ledger.weight);
    }

    /// What `tenant` has been charged, in tokens at weight 1.
    #[cfg(test)]
    pub(crate) fn charged(&self, tenant: &str) -> u128 {
        self.tenants
            .get(tenant)
            .map_or(0, |ledger| ledger.vtime * u128::from(ledger.weight) / TOKEN)
    }

    /// Every waiting request, tenant by tenant.
    pub(crate) fn iter(&self) -> impl Iterator<Item = &Pending> {
        self.tenants
            .values()
            .flat_map(|ledger| ledger.waiting.iter().map(|(_, p)| p))
    }

    /// Every waiting request, mutably.
    pub(crate) fn iter_mut(&mut self) -> impl Iterator<Item = &mut Pending> {
        self.tenants
            .values_mut()
            .flat_map(|ledger| ledger.waiting.iter_mut().map(|(_, p)| p))
    }

    /// Keeps the requests `keep` says yes to; returns how many it dropped.
    pub(crate) fn retain(&mut self, mut keep: impl FnMut(&Pending) -> bool) -> usize {
        let before = self.len;
        for ledger in self.tenants.values_mut() {
            ledger.waiting.retain(|(_, p)| keep(p));
        }
        self.len = self.tenants.values().map(|l| l.waiting.len()).sum();
        before - self.len
    }

    /// Takes out the requests `expired` says yes to, oldest first.
    pub(crate) fn take_where(&mut self, mut expired: impl FnMut(&Pending) -> bool) -> Vec<Pending> {
        let mut taken: Vec<(u64, Pending)> = Vec::new();
        for ledger in self.tenants.values_mut() {
            let (gone, kept): (VecDeque<_>, VecDeque<_>) =
                ledger.waiting.drain(..).partition(|(_, p)| expired(p));
            ledger.waiting = kept;
            taken.extend(gone);
        }
        self.len -= taken.len();
        taken.sort_unstable_by_key(|(stamp, _)| *stamp);
        taken.into_iter().map(|(_, p)| p).collect()
    }

    /// Empties the queue, oldest first.
    pub(crate) fn take_all(&mut self) -> Vec<Pending> {
        let mut all: Vec<(u64, Pending)> = self
            .tenants
            .values_mut()
            .flat_map(|ledger| ledger.waiting.drain(..))
            .collect();
        all.sort_unstable_by_key(|(stamp, _)| *stamp);
        self.len = 0;
        all.into_iter().map(|(_, p)| p).collect()
    }
}

fn priority(pending: &Pending) -> i32 {
    pending.request.share.priority()
}

/// Splits `budget` tokens between claimants of `(weight, demand)` by
/// water-filling: a claimant whose demand is below its weighted share of
/// what is left gets all of it; the others share the rest by weight, to
/// within a token. Never more than a demand; the whole budget while
/// demands are unmet (work conserving).
pub(crate) fn split_budget(budget: usize, claims: &[(u32, usize)]) -> Vec<usize> {
    let weight = |i: usize| u128::from(claims[i].0.max(1));
    let demand = |i: usize| claims[i].1 as u128;
    let mut given = vec![0usize; claims.len()];
    // Smallest demand per unit of weight first: those are met whole.
    let mut order: Vec<usize> = (0..claims.len()).collect();
    order.sort_by(|&a, &b| (demand(a) * weight(b)).cmp(&(demand(b) * weight(a))));
    let mut left = budget as u128;
    let mut weights: u128 = (0..claims.len()).map(weight).sum();
    let mut met = 0;
    while let Some(&i) = order.get(met) {
        if demand(i) * weights > left * weight(i) {
            break;
        }
        given[i] = claims[i].1;
        left -= demand(i);
        weights -= weight(i);
        met += 1;
    }
    // Everyone left wants more than its share: each gets the floor of it,
    // and the few tokens the floors leave go one each, in order.
    let capped = &order[met..];
    let mut spare = left;
    for &i in capped {
        let share = left * weight(i) / weights;
        given[i] = share as usize;
        spare -= share;
    }
    for &i in capped.iter().take(spare as usize) {
        given[i] += 1;
    }
    debug_assert!(given.iter().sum::<usize>() <= budget);
    debug_assert!(given.iter().zip(claims).all(|(g, c)| *g <= c.1));
    given
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use proptest::prelude::*;

    use super::*;

    proptest! {
        #[test]
        fn a_split_gives_the_budget_away_by_weight(
            budget in 0usize..600,
            claims in proptest::collection::vec((1u32..8, 0usize..400), 0..6),
        ) {
            let given = split_budget(budget, &claims);
            let demand: usize = claims.iter().map(|c| c.1).sum();
            prop_assert_eq!(given.iter().sum::<usize>(), budget.min(demand), "work conserving");
            for (g, c) in given.iter().zip(&claims) {
                prop_assert!(*g <= c.1, "never more than asked");
            }
            // Two claimants both left wanting got shares in proportion to
            // their weights, to within a token each.
            for i in 0..claims.len() {
                for j in 0..claims.len() {
                    if given[i] < claims[i].1 && given[j] < claims[j].1 {
                        let per_i = given[i] as f64 / f64::from(claims[i].0);
                        let per_j = given[j] as f64 / f64::from(claims[j].0);
                        prop_assert!((per_i - per_j).abs() < 2.0, "{given:?} for {claims:?}");
                    }
                }
            }
        }
    }

    #[test]
    fn a_short_claim_is_met_whole_beside_a_long_one() {
        assert_eq!(split_budget(256, &[(1, 10_000), (1, 30)]), vec![226, 30]);
        assert_eq!(
            split_budget(256, &[(1, 10_000), (3, 10_000)]),
            vec![64, 192]
        );
    }
}

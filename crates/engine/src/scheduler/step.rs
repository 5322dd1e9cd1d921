//! One step: the batch plan under the step's token budget, the forward
//! pass, and what each row's logits mean for its request (sampling, stop
//! conditions, the end of a request).

use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use kvfence_handoff::{Message, RejectReason};
use kvfence_model::{Constraint, DrawContext, Logits, ModelError, Sequence, TokenLogprobs};
use kvfence_pool::mutation::Mutation;
use kvfence_pool::{Lease, RequestId};
use tracing::{trace, warn};

#[cfg(feature = "failpoints")]
use super::crash_or_stall;
use super::fair::split_budget;
use super::{
    Active, End, InFlight, Origin, Outbox, Outside, Pending, PromptScores, Role, Scheduler, Work,
};
use crate::request::{Event, FailureKind, FinishReason, GenerationRequest, Usage};
use crate::trace::Outcome;

/// What an express pass counts against the step it runs ahead of, at the
/// least: a pass reads every weight once however few its rows, which costs
/// as much as computing several prompt tokens, so many one-token passes must
/// not add up to a free ride.
const EXPRESS_PASS_MIN_TOKENS: usize = 16;

/// The most logits the chunks of prompts being scored may ask for in one
/// pass, all together, in bytes: every row of such a chunk returns a whole
/// vocabulary of them (a 262,144-token vocabulary makes this 64 rows), and
/// a tenant's many scored prompts must not make a pass's memory many times
/// that.
pub(super) const SCORING_LOGITS_BYTES: usize = 64 << 20;

impl Scheduler {
    /// Tokens this step may process: `step_tokens`, or once this worker
    /// serves more than one tenant the shorter `shared_step_tokens` (I11).
    /// A tenant's request that arrives waits for the step in flight — which
    /// may be another tenant's alone — and then its own, so their length is
    /// its latency; measured, the shorter steps cost a few percent of
    /// prefill throughput, and a worker of one tenant keeps the long ones.
    pub(super) fn step_budget(&self) -> usize {
        if self.shared() {
            self.config.shared_step_tokens.min(self.config.step_tokens)
        } else {
            self.config.step_tokens
        }
    }

    /// Decode tokens first (one per decoding request), then prefill chunks
    /// with what is left of the budget, split between the tenants with
    /// prompt tokens to compute by weight ([`split_budget`]) and, within a
    /// tenant, given in admission order: one tenant's long prompts cannot
    /// hold back another's short one by more than a step. Prefill always
    /// gets some room so a full decode batch cannot starve new requests.
    pub(super) fn plan(&self) -> Vec<Work> {
        let mut work = self.decode_rows();
        let rows = work.len();
        let budget = self.step_budget().saturating_sub(rows).max(16);
        work.extend(self.prefill_chunks(|_| true, budget));
        debug_assert!(
            tokens(&work) <= rows + budget,
            "a step stays within its token budget"
        );
        work
    }

    /// The next token of every decoding request.
    fn decode_rows(&self) -> Vec<Work> {
        let mut work = Vec::new();
        for (index, a) in self.active.iter().enumerate() {
            if a.kv.lease().is_some() && a.prefill_done() {
                let last = *a
                    .generated
                    .last()
                    .expect("a decoding request has sampled a token");
                debug_assert_eq!(
                    a.written,
                    a.kv_target(),
                    "a decoding request's KV is complete"
                );
                work.push(Work {
                    index,
                    past: a.written,
                    tokens: vec![last],
                    logits: Logits::Last,
                    draws: true,
                });
            }
        }
        work
    }

    /// Prefill chunks of the requests `include` picks, `budget` tokens in
    /// all, split between their tenants by weight.
    fn prefill_chunks(&self, include: impl Fn(&Active) -> bool, budget: usize) -> Vec<Work> {
        let mut work = Vec::new();
        let mut prefilling: Vec<usize> = (0..self.active.len())
            .filter(|&i| {
                let a = &self.active[i];
                include(a) && a.kv.lease().is_some() && !a.prefill_done()
            })
            .collect();
        prefilling.sort_unstable_by_key(|&i| self.active[i].admitted);
        // Each tenant's claim on the step's tokens, and on its rows of
        // scored prompts (whose logits bound a pass's memory): both split
        // by weight.
        let mut claims: BTreeMap<&str, (u32, usize)> = BTreeMap::new();
        let mut scoring_claims: BTreeMap<&str, (u32, usize)> = BTreeMap::new();
        for &i in &prefilling {
            let a = &self.active[i];
            let share = &a.pending.request.share;
            let left = a.kv_target() - a.written;
            let tenant = share.tenant.as_str();
            claims.entry(tenant).or_insert((share.weight(), 0)).1 += left;
            if a.pending.scores_prompt() {
                scoring_claims
                    .entry(tenant)
                    .or_insert((share.weight(), 0))
                    .1 += left;
            }
        }
        let mut allowance = by_weight(budget, &claims);
        let mut scoring_allowance = by_weight(self.scoring_rows, &scoring_claims);
        for index in prefilling {
            let a = &self.active[index];
            let tenant = a.pending.request.share.tenant.as_str();
            let left = allowance
                .get_mut(tenant)
                .expect("every prefilling request's tenant has a claim");
            let target = a.kv_target();
            let scoring = a.pending.scores_prompt();
            let mut take = (target - a.written).min(*left);
            if scoring {
                let rows = scoring_allowance
                    .get_mut(tenant)
                    .expect("every scored prompt's tenant has a claim on the rows");
                take = take.min(*rows);
                *rows -= take;
            }
            if take == 0 {
                continue;
            }
            *left -= take;
            let end = a.written + take;
            // A fresh prompt's last chunk samples the first token; a
            // preempted request's recomputation samples nothing (its next
            // input is the token it had already generated).
            let draws = end == target && a.generated.is_empty();
            let logits = match (scoring, draws) {
                (true, _) => Logits::All,
                (false, true) => Logits::Last,
                (false, false) => Logits::None,
            };
            work.push(Work {
                index,
                past: a.written,
                tokens: a.context(a.written..end),
                logits,
                draws,
            });
        }
        work
    }

    /// Runs the step in flight on, or starts the next one (I11: a tenant's
    /// short request waits a layer of another tenant's step, not the step).
    ///
    /// - A step's forward pass stops between two layers when a command
    ///   arrives, so the shell takes it at once instead of after the whole
    ///   step — a hand-off's commit and its first token, a new order — and
    ///   the step goes on at the next poll.
    /// - When a step pauses with prompts of tenants that have no work in
    ///   it admitted meanwhile, those that fit whole in less than what is
    ///   left of the paused step get a step of their own first (an express
    ///   step, run whole): the shorter job first, so a long prompt never
    ///   holds up a nearly finished step, nor a part of one any.
    /// - Likewise, once a worker serves several tenants, the last chunks of
    ///   prompts of the tenants with the least work in a step run first,
    ///   alone, while they are the shorter part ([`Self::finishing_apart`]):
    ///   a short chat that arrives between two steps does not wait for
    ///   another tenant's chunks to compute its first token.
    /// - A pass computes only while this worker holds the compute pool's
    ///   turn ([`super::turn`]), and stops between two layers, as for a
    ///   command, when the process's other worker has waited a quantum.
    ///
    /// Express steps are charged to their tenants like any step, and the
    /// ones run ahead of a step add up to at most about a step's budget
    /// (each counted at least [`EXPRESS_PASS_MIN_TOKENS`]), so a step is
    /// delayed by about one step at most, however many requests arrive.
    pub(super) fn step(&mut self, outside: &mut (dyn Outside + Send)) {
        let Some(flight) = &self.in_flight else {
            self.make_room();
            let mut work = self.plan();
            if work.is_empty() {
                return;
            }
            let express = self.finishing_apart(&mut work);
            return self.start(work, express, outside);
        };
        // Shorter than what is left of the paused step, and within what
        // may still run ahead of it.
        let budget = flight
            .pass
            .rows_left()
            .min(self.step_budget().saturating_sub(flight.express_tokens));
        if budget > 0 {
            let ids = flight.ids.clone();
            let busy = self.tenants_of(&ids);
            // Prefill only: decode rows would need pages to grow, and
            // growing may preempt a request of the paused step.
            // Only prompts it finishes: a part of a longer one would not
            // bring its first token nearer.
            let express = self.prefill_chunks(
                |a| {
                    !busy.contains(a.pending.request.share.tenant.as_str())
                        && a.kv_target() - a.written <= budget
                        && a.generated.is_empty()
                },
                budget,
            );
            self.run_express(express, outside);
        }
        self.resume_step(outside);
    }

    /// Begins the pass of `work` and runs it, after `express` if any.
    fn start(&mut self, work: Vec<Work>, express: Vec<Work>, outside: &mut (dyn Outside + Send)) {
        trace!(
            role = self.role.label(),
            sequences = work.len(),
            tokens = tokens(&work),
            "step"
        );
        if self.role == Role::Decode {
            // Fault injection: a slow or crashing decode step.
            fail::fail_point!("decode-step", crash_or_stall);
        }
        let ids = work
            .iter()
            .map(|w| self.active[w.index].pending.id)
            .collect();
        let pass = {
            let batch = lend(&mut self.active, &work);
            self.model.model.begin(&batch)
        };
        self.in_flight = Some(InFlight {
            pass,
            work,
            ids,
            express_tokens: 0,
            computing: Duration::ZERO,
        });
        self.run_express(express, outside);
        self.resume_step(outside);
    }

    /// Takes out of `work` the last chunks of fresh prompts of the tenants
    /// with the least work in it, once this worker serves several tenants:
    /// shortest first, as many tenants as stay the shorter part (so never
    /// all of it). A tenant goes only whole, and only if all its work in
    /// the step ends prompts: a part of a longer one would not bring its
    /// first token nearer. Another tenant's chunks that end prompts too (a
    /// flood of short ones) no longer hold a short chat back.
    fn finishing_apart(&self, work: &mut Vec<Work>) -> Vec<Work> {
        if !self.shared() {
            return Vec::new();
        }
        let finishing = |w: &Work| {
            let a = &self.active[w.index];
            !a.prefill_done() && w.draws
        };
        let tenant = |w: &Work| self.active[w.index].pending.request.share.tenant.as_str();
        let busy: BTreeSet<&str> = work.iter().filter(|w| !finishing(w)).map(tenant).collect();
        let mut candidates: BTreeMap<&str, usize> = BTreeMap::new();
        for w in work.iter().filter(|w| !busy.contains(tenant(w))) {
            *candidates.entry(tenant(w)).or_default() += w.tokens.len();
        }
        let mut shortest: Vec<(usize, &str)> =
            candidates.into_iter().map(|(t, n)| (n, t)).collect();
        shortest.sort_unstable();
        let total = tokens(work);
        let mut apart = 0;
        let mut chosen: BTreeSet<&str> = BTreeSet::new();
        for (n, t) in shortest {
            if 2 * (apart + n) > total {
                break;
            }
            apart += n;
            chosen.insert(t);
        }
        if chosen.is_empty() {
            return Vec::new();
        }
        let (express, rest): (Vec<Work>, Vec<Work>) = std::mem::take(work)
            .into_iter()
            .partition(|w| chosen.contains(tenant(w)));
        assert!(
            !rest.is_empty() && tokens(&express) <= tokens(&rest),
            "the work set apart is the shorter part of the step"
        );
        *work = rest;
        express
    }

    /// The tenants of requests `ids`.
    fn tenants_of(&self, ids: &[RequestId]) -> BTreeSet<String> {
        self.active
            .iter()
            .filter(|a| ids.contains(&a.pending.id))
            .map(|a| a.pending.request.share.tenant.clone())
            .collect()
    }

    /// Runs `express` whole, ahead of the step in flight (which names its
    /// requests by id, so the ones this ends do not confuse it), and counts
    /// it against that step's allowance.
    fn run_express(&mut self, express: Vec<Work>, outside: &mut (dyn Outside + Send)) {
        if express.is_empty() {
            return;
        }
        let tokens = tokens(&express);
        trace!(
            role = self.role.label(),
            sequences = express.len(),
            tokens,
            "express step"
        );
        self.counters.express_steps.fetch_add(1, Ordering::Relaxed);
        if let Some(flight) = &mut self.in_flight {
            flight.express_tokens += tokens.max(EXPRESS_PASS_MIN_TOKENS);
        }
        outside.send(self.outbox.take());
        let (result, pass) = self.stopwatch.time(|| {
            let mut batch = lend(&mut self.active, &express);
            // Run whole: short by choice, and what it is for is its end.
            let _turn = self.turn.take();
            self.model.model.forward_each(&mut batch)
        });
        self.conclude(&express, result, pass);
    }

    /// Runs the step in flight until its pass ends or a command arrives;
    /// at its end, acts on its rows and takes the commands it held back.
    fn resume_step(&mut self, outside: &mut (dyn Outside + Send)) {
        let mut flight = self
            .in_flight
            .take()
            .expect("a step is in flight when it is resumed");
        for (work, id) in flight.work.iter_mut().zip(&flight.ids) {
            // An express step may end requests, which moves others in `active`.
            work.index =
                self.active.iter().position(|a| a.pending.id == *id).expect(
                    "a request of a paused step is neither ended nor preempted before it ends",
                );
        }
        outside.send(self.outbox.take());
        let result = {
            let turn = self.turn.take();
            let (result, took) = self.stopwatch.time(|| {
                let mut batch = lend(&mut self.active, &flight.work);
                // Stops for a command, or for the other worker once this
                // one has had its quantum of the pool.
                let mut pause = || outside.command_waiting() || turn.wanted();
                self.model
                    .model
                    .resume(&mut flight.pass, &mut batch, &mut pause)
            });
            flight.computing += took;
            result
        };
        match result {
            None => self.in_flight = Some(flight),
            Some(result) => {
                self.conclude(&flight.work, result, flight.computing);
                for command in std::mem::take(&mut self.held_back) {
                    self.take(command);
                }
            }
        }
    }

    /// Acts on one finished pass's rows: charges each row to its tenant,
    /// ships or samples, and ends what is done.
    fn conclude(
        &mut self,
        work: &[Work],
        result: Vec<Result<Vec<f32>, ModelError>>,
        pass: Duration,
    ) {
        self.counters.steps.fetch_add(1, Ordering::Relaxed);
        let masks = self.compute_masks(work);
        let tokens = tokens(work);
        self.charge_masks(&masks, tokens, pass);
        let mut ended: Vec<(usize, End)> = Vec::new();
        for (w, row) in work.iter().zip(result) {
            let row = match row {
                Ok(row) => row,
                Err(error) => {
                    // Fail closed (I7), and alone: this request ends with an
                    // error and no token from this step; the rest of the
                    // batch goes on, its rows untouched by this one.
                    warn!(request = %self.active[w.index].pending.id, %error, "a sequence failed its forward pass");
                    ended.push((
                        w.index,
                        End::Failed(FailureKind::Internal, error.to_string()),
                    ));
                    continue;
                }
            };
            let active = &mut self.active[w.index];
            self.waiting.charge(
                &active.pending.request.share,
                charged_tokens(self.model.model.config(), w),
            );
            let prefilling = !active.prefill_done();
            active.written += w.tokens.len();
            if prefilling {
                self.counters
                    .prompt_tokens
                    .fetch_add(w.tokens.len() as u64, Ordering::Relaxed);
                if active.prefill_done()
                    && active.generated.is_empty()
                    && let Some(lease) = active.kv.lease_mut()
                {
                    // The prompt's full pages serve the tenant's next
                    // requests from now on, this one's siblings included.
                    lease.seal(&active.pending.request.prompt);
                }
                if !active.prefill_done()
                    && let Err(error) = self.ship_ready_pages(w.index)
                {
                    ended.push((
                        w.index,
                        End::Failed(FailureKind::Internal, error.to_string()),
                    ));
                    continue;
                }
            }
            let row = match w.logits {
                Logits::All => match self.score_prompt(w, &row) {
                    Ok(last) => last,
                    Err(end) => {
                        ended.push((w.index, end));
                        continue;
                    }
                },
                Logits::Last | Logits::None => &row[..],
            };
            if w.draws
                && let Some(end) = self.advance(w.index, row)
            {
                ended.push((w.index, end));
            }
        }
        ended.sort_unstable_by_key(|(index, _)| *index);
        for (index, end) in ended.into_iter().rev() {
            self.end(index, end);
        }
    }

    /// The token masks this step's draws need, computed together on the
    /// compute pool rather than one after another on this thread: a large
    /// schema's mask takes milliseconds, and every row of the batch waits
    /// for the last. A mask that fails is computed again, and its error
    /// reported, where the request draws. Returns how long each request's
    /// mask took, by its index.
    pub(super) fn compute_masks(&mut self, work: &[Work]) -> Vec<(usize, Duration)> {
        use rayon::prelude::*;
        let drawing: BTreeSet<usize> = work.iter().filter(|w| w.draws).map(|w| w.index).collect();
        let constraints: Vec<(usize, &mut Constraint)> = self
            .active
            .iter_mut()
            .enumerate()
            .filter(|(index, _)| drawing.contains(index))
            .filter_map(|(index, active)| Some((index, active.constraint.as_mut()?)))
            .collect();
        let _turn = (!constraints.is_empty()).then(|| self.turn.take());
        let stopwatch = self.stopwatch;
        constraints
            .into_par_iter()
            .map(|(index, constraint)| {
                let ((), took) = stopwatch.time(|| {
                    let _ = constraint.mask();
                });
                (index, took)
            })
            .collect()
    }

    /// Scores the prompt tokens that chunk `w`'s rows of `logits` (one
    /// vocabulary per row) predict and were not scored before (a request
    /// preempted while prefilling computes some rows twice); at the end of
    /// the prompt, tells the client every score. Returns the last row, for
    /// the draw, or how the request ends if its logits are not numbers.
    fn score_prompt<'r>(&mut self, w: &Work, logits: &'r [f32]) -> Result<&'r [f32], End> {
        let vocab = self.model.model.config().vocab_size;
        let pending = &mut self.active[w.index].pending;
        let top = pending
            .request
            .sampling
            .prompt_logprobs
            .expect("only a request that asked is scored");
        let prompt = &pending.request.prompt;
        let PromptScores::Scoring(scores) = &mut pending.prompt_scores else {
            unreachable!("a chunk asks for every row's logits only while its prompt is scored");
        };
        debug_assert_eq!(logits.len(), w.tokens.len() * vocab, "a row per token");
        for (position, row) in (w.past..).zip(logits.chunks_exact(vocab)) {
            if position != scores.len() || position + 1 >= prompt.len() {
                continue;
            }
            if row.iter().any(|l| !l.is_finite()) {
                let error = ModelError::NonFiniteLogits;
                return Err(End::Failed(FailureKind::Internal, error.to_string()));
            }
            scores.push(kvfence_model::prompt_logprob(
                row,
                prompt[position + 1],
                top,
            ));
        }
        assert!(
            scores.len() < prompt.len(),
            "a prompt has a score per token after its first, no more"
        );
        if w.draws && matches!(pending.origin, Origin::Client { .. }) {
            // Complete: the last chunk's rows reach the prompt's end. (A
            // prefill worker's go in its `Done`.)
            assert_eq!(scores.len() + 1, prompt.len(), "every prompt token scored");
            let logprobs = pending.prompt_scores.take();
            pending.tell(&mut self.outbox, Event::Prompt { logprobs });
        }
        Ok(logits
            .rchunks_exact(vocab)
            .next()
            .expect("a chunk has a row"))
    }

    /// Charges each grammar mask of a step to its request's tenant, in the
    /// tokens the worker could have computed meanwhile (the step computed
    /// `tokens` in `pass`): a tenant whose schema makes every draw cost
    /// milliseconds pays for them in its share, like for tokens (I11).
    fn charge_masks(&mut self, masks: &[(usize, Duration)], tokens: usize, pass: Duration) {
        for &(index, took) in masks {
            let charge = mask_charge(took, tokens, pass);
            if charge > 0 {
                self.waiting
                    .charge(&self.active[index].pending.request.share, charge);
            }
        }
    }

    /// Removes request `index`, dropping its lease (I8), and tells whoever waits.
    pub(super) fn end(&mut self, index: usize, end: End) {
        let mut active = self.active.swap_remove(index);
        self.counters.running.fetch_sub(1, Ordering::AcqRel);
        if Mutation::LeftoverConstraint.active() {
            self.left_in_row.constraint = active.constraint.take();
        }
        if Mutation::LeftoverHistory.active() {
            self.left_in_row.generated = std::mem::take(&mut active.generated);
        }
        match end {
            End::Finished(event) => {
                if let Event::Finished { reason, usage } = &event {
                    active
                        .pending
                        .timeline
                        .ends(Outcome::Finished(*reason), Some(*usage));
                }
                active.seal_conversation();
                self.counters.finished.fetch_add(1, Ordering::Relaxed);
                active.pending.tell(&mut self.outbox, event);
            }
            End::Failed(kind, message) => self.refuse(&mut active.pending, kind, message),
            End::Shipped => {
                active.pending.timeline.ends(
                    Outcome::Shipped,
                    Some(Usage {
                        prompt_tokens: active.pending.request.prompt.len(),
                        completion_tokens: 1,
                        cached_tokens: active.cached,
                    }),
                );
                self.counters.finished.fetch_add(1, Ordering::Relaxed);
            }
        }
    }

    pub(super) fn refuse(&mut self, pending: &mut Pending, kind: FailureKind, message: String) {
        self.counters.failed.fetch_add(1, Ordering::Relaxed);
        pending.timeline.ends(Outcome::Failed(kind), None);
        match &pending.origin {
            Origin::Client(client) => self.outbox.client(client, Event::Failed { kind, message }),
            Origin::Handoff { peer, id, .. } => {
                let reason = if kind == FailureKind::TooLong {
                    RejectReason::TooLong
                } else {
                    RejectReason::Failed
                };
                self.send_to_peer(*peer, &Message::Reject { id: *id, reason });
            }
        }
    }

    /// A fresh constraint for `request`'s grammar, if it has one: a copy
    /// of the start state the front door compiled, or — for a request
    /// that came over a link — compiled here.
    pub(super) fn constraint_for(
        &mut self,
        request: &GenerationRequest,
    ) -> Result<Option<Constraint>, kvfence_model::ModelError> {
        let Some(constrained) = &request.constraint else {
            return Ok(None);
        };
        match constrained.start() {
            Some(start) => Ok(Some(start)),
            None => self
                .grammars
                .constraint(&self.model, &constrained.grammar)
                .map(Some),
        }
    }

    /// Samples the next token of one request and acts on it.
    pub(super) fn advance(&mut self, index: usize, logits: &[f32]) -> Option<End> {
        let active = &mut self.active[index];
        let mask = match active.constraint.as_mut().map(Constraint::mask).transpose() {
            Ok(mask) => mask,
            Err(error) => return Some(End::Failed(FailureKind::Internal, error.to_string())),
        };
        let allows = mask.map(|mask| move |token: u32| mask.allows(token));
        let carried;
        let generated = if Mutation::LeftoverHistory.active() {
            carried = [&self.left_in_row.generated[..], &active.generated].concat();
            &carried
        } else {
            &active.generated
        };
        let context = DrawContext {
            prompt: &active.pending.request.prompt,
            generated,
            allowed: allows.as_ref().map(|f| f as &dyn Fn(u32) -> bool),
        };
        let draw = match active.sampler.draw(logits, context) {
            Ok(draw) => draw,
            Err(error) => return Some(End::Failed(FailureKind::Internal, error.to_string())),
        };
        active.pending.timeline.token();
        if matches!(self.active[index].pending.origin, Origin::Handoff { .. }) {
            return Some(self.ship(index, draw.token, draw.logprobs));
        }
        self.accept(index, draw.token, draw.logprobs)
    }

    /// Records a generated token, streams its text, and says whether the
    /// request is done.
    pub(super) fn accept(
        &mut self,
        index: usize,
        token: u32,
        logprobs: Option<TokenLogprobs>,
    ) -> Option<End> {
        let eos = &self.model.model.config().eos_token_ids;
        let tokenizer = &self.model.tokenizer;
        let active = &mut self.active[index];
        active.generated.push(token);
        if let Some(constraint) = &mut active.constraint
            && let Err(error) = constraint.accept(token)
        {
            return Some(End::Failed(FailureKind::Internal, error.to_string()));
        }
        self.counters
            .generated_tokens
            .fetch_add(1, Ordering::Relaxed);
        let request = &active.pending.request;
        let usage = Usage {
            prompt_tokens: request.prompt.len(),
            completion_tokens: active.generated.len(),
            cached_tokens: active.cached,
        };
        let finish = |reason| Some(End::Finished(Event::Finished { reason, usage }));
        let outbox = &mut self.outbox;
        let flush = |active: &mut Active, outbox: &mut Outbox| match active.text.flush(tokenizer) {
            Ok(rest) => {
                if !rest.is_empty() {
                    active.pending.tell(
                        outbox,
                        Event::Token {
                            text: rest,
                            logprobs: None,
                        },
                    );
                }
                None
            }
            Err(error) => Some(End::Failed(FailureKind::Internal, error.to_string())),
        };
        if !request.ignore_eos && eos.contains(&token) {
            active.pending.tell(
                outbox,
                Event::Token {
                    text: String::new(),
                    logprobs: None,
                },
            );
            return flush(active, outbox).or_else(|| finish(FinishReason::Stop));
        }
        let pushed = match active.text.push(tokenizer, token) {
            Ok(pushed) => pushed,
            Err(error) => return Some(End::Failed(FailureKind::Internal, error.to_string())),
        };
        active.pending.tell(
            outbox,
            Event::Token {
                text: pushed.delta,
                logprobs,
            },
        );
        if pushed.stopped {
            return finish(FinishReason::Stop);
        }
        if active
            .constraint
            .as_ref()
            .is_some_and(Constraint::is_finished)
        {
            // The grammar is complete: nothing but the end may follow.
            return flush(active, outbox).or_else(|| finish(FinishReason::Stop));
        }
        if active.generated.len() == active.pending.request.max_tokens {
            return flush(active, outbox).or_else(|| finish(FinishReason::Length));
        }
        None
    }

    /// Ends every request queued or running with `ShuttingDown`, giving
    /// back every page.
    pub(super) fn fail_everything(&mut self) {
        // A paused step holds no lease; its requests end below.
        self.in_flight = None;
        self.held_back.clear();
        let reason = || {
            (
                FailureKind::ShuttingDown,
                "the server is shutting down".to_string(),
            )
        };
        for mut pending in self.waiting.take_all() {
            self.counters.queued.fetch_sub(1, Ordering::AcqRel);
            let (kind, message) = reason();
            self.refuse(&mut pending, kind, message);
        }
        for mut active in std::mem::take(&mut self.active) {
            self.counters.running.fetch_sub(1, Ordering::AcqRel);
            let (kind, message) = reason();
            self.refuse(&mut active.pending, kind, message);
        }
    }
}

/// Tokens computed by `work`.
fn tokens(work: &[Work]) -> usize {
    work.iter().map(|w| w.tokens.len()).sum()
}

/// The batch of `work`: each request's lease, lent once, with its tokens.
fn lend<'a>(active: &'a mut [Active], work: &'a [Work]) -> Vec<Sequence<'a>> {
    let mut leases: Vec<Option<&mut Lease>> = active.iter_mut().map(|a| a.kv.lease_mut()).collect();
    work.iter()
        .map(|w| Sequence {
            lease: leases[w.index]
                .take()
                .expect("planned work has a lease, one piece per request"),
            past: w.past,
            tokens: &w.tokens,
            logits: w.logits,
        })
        .collect()
}

/// `budget` split between the tenants of `claims` (weight, tokens wanted)
/// by weight ([`split_budget`]).
fn by_weight<'t>(
    budget: usize,
    claims: &BTreeMap<&'t str, (u32, usize)>,
) -> BTreeMap<&'t str, usize> {
    let shares = split_budget(budget, &claims.values().copied().collect::<Vec<_>>());
    claims.keys().copied().zip(shares).collect()
}

/// What a piece of work is charged to its tenant, in prompt tokens' worth
/// of computation: its tokens, and for a prompt being scored the logits of
/// every row on top (I11) — with a large vocabulary they cost more than
/// the layers (Gemma 3 270M: 1.7 times), so a tenant scoring prompts pays
/// for what it takes, not what a plain prompt of that length would.
fn charged_tokens(config: &kvfence_model::ModelConfig, w: &Work) -> usize {
    let rows = w.tokens.len();
    match w.logits {
        Logits::All => {
            let logits = rows * config.logit_macs_per_token();
            rows + logits.div_ceil(config.layer_macs_per_token().max(1))
        }
        Logits::Last | Logits::None => rows,
    }
}

/// What a grammar mask that took `took` costs its tenant, in tokens: what
/// the step computed (`tokens` in `pass`) in that time, to the nearest
/// token (a regex's microseconds cost nothing).
fn mask_charge(took: Duration, tokens: usize, pass: Duration) -> usize {
    if pass.is_zero() {
        return 0;
    }
    // `as` saturates: a mask beyond any count of tokens costs the most.
    (took.as_secs_f64() * tokens as f64 / pass.as_secs_f64()).round() as usize
}

/// Measures how long the compute charged to tenants took: passes and
/// grammar masks (I11). The worker reads the wall clock; a test reads
/// every span as the same length, so what each tenant is charged does not
/// hang on what else the machine runs meanwhile.
#[derive(Clone, Copy, Debug, Default)]
pub(super) enum Stopwatch {
    #[default]
    Wall,
    /// Every span takes this long.
    #[cfg(test)]
    Fixed(Duration),
}

impl Stopwatch {
    /// Runs `work` and returns what it returned and how long it took.
    pub(super) fn time<T>(self, work: impl FnOnce() -> T) -> (T, Duration) {
        let started = Instant::now();
        let value = work();
        let took = match self {
            Stopwatch::Wall => started.elapsed(),
            #[cfg(test)]
            Stopwatch::Fixed(span) => span,
        };
        (value, took)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_mask_costs_the_tokens_the_step_computed_in_its_time() {
        let ms = Duration::from_millis;
        // 64 tokens in 128 ms: 2 ms a token.
        assert_eq!(mask_charge(ms(13), 64, ms(128)), 7);
        assert_eq!(mask_charge(Duration::from_micros(20), 64, ms(128)), 0);
        assert_eq!(mask_charge(ms(500), 1, ms(10)), 50);
        assert_eq!(mask_charge(ms(5), 64, Duration::ZERO), 0);
    }
}

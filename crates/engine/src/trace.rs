//! Where a request's time went on one worker, as OpenTelemetry spans.
//!
//! A request that carries a [`TraceContext`] — the router's span for it,
//! passed in `Submit` and in prefill orders — is followed: its
//! [`Timeline`] marks when it reached the worker, was first admitted, had
//! its KV (committed from a hand-off), drew its first token and left.
//! Whichever way it leaves — finished, failed, shipped to a decode worker,
//! cancelled, dropped at shutdown — dropping the timeline makes one span
//! for the worker with a child per phase (`queue`, `prefill`, `handoff`,
//! `decode`), through the process's global tracer: a no-op unless the
//! binary installed an exporter, so the engine depends on the
//! OpenTelemetry API alone.
//!
//! Spans carry counts, durations and outcomes, never text (I10): not the
//! prompt, not the completion, not the tenant. The scheduler reads the
//! clock here only to measure, never to decide what is due.

use std::time::{Instant, SystemTime};

use opentelemetry::trace::{Span, SpanBuilder, SpanId, SpanKind, Status, TraceContextExt, Tracer};
use opentelemetry::{Context, KeyValue, global};

use crate::config::Role;
use crate::request::{FailureKind, FinishReason, Usage};
pub use crate::trace_context::TraceContext;

/// How a request left a worker.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Outcome {
    /// It finished; the client has its answer.
    Finished(FinishReason),
    /// It failed, or was refused.
    Failed(FailureKind),
    /// A prefill worker shipped its KV and first token.
    Shipped,
    /// Its client went away, or its decode worker aborted it — or nothing
    /// said otherwise before it was dropped.
    Cancelled,
}

impl Outcome {
    fn label(self) -> &'static str {
        match self {
            Outcome::Finished(_) => "finished",
            Outcome::Failed(_) => "failed",
            Outcome::Shipped => "shipped",
            Outcome::Cancelled => "cancelled",
        }
    }
}

/// One request's marks on one worker, while it is followed.
struct Marks {
    parent: TraceContext,
    /// This worker's span for the request, chosen up front so a prefill
    /// order can name it as its parent before it ends.
    span: u64,
    /// Set when a scheduler takes the request.
    role: Option<Role>,
    received: Instant,
    received_wall: SystemTime,
    admitted: Option<Instant>,
    kv_ready: Option<Instant>,
    first_token: Option<Instant>,
    preemptions: u32,
    outcome: Outcome,
    usage: Option<Usage>,
}

/// A request's time on this worker: empty (and free) unless it carries a
/// trace context. Dropping it records the spans.
#[derive(Default)]
pub(crate) struct Timeline(Option<Box<Marks>>);

impl Timeline {
    /// Starts now for a request under `trace`, if it has one.
    pub(crate) fn start(trace: Option<TraceContext>) -> Timeline {
        Timeline(trace.map(|parent| {
            Box::new(Marks {
                parent,
                span: new_span_id(),
                role: None,
                received: Instant::now(),
                received_wall: SystemTime::now(),
                admitted: None,
                kv_ready: None,
                first_token: None,
                preemptions: 0,
                outcome: Outcome::Cancelled,
                usage: None,
            })
        }))
    }

    fn mark(&mut self, f: impl FnOnce(&mut Marks)) {
        if let Some(marks) = &mut self.0 {
            f(marks);
        }
    }

    /// A scheduler in `role` took the request.
    pub(crate) fn taken_by(&mut self, role: Role) {
        self.mark(|m| m.role = Some(role));
    }

    /// It leased pages (its first admission; a preempted request's return
    /// is not a new one).
    pub(crate) fn admitted(&mut self) {
        self.mark(|m| {
            m.admitted.get_or_insert_with(Instant::now);
        });
    }

    /// Its prompt's KV is here: a decode worker committed the hand-off.
    pub(crate) fn kv_ready(&mut self) {
        self.mark(|m| {
            m.kv_ready.get_or_insert_with(Instant::now);
        });
    }

    /// It drew a token (only the first is marked).
    pub(crate) fn token(&mut self) {
        self.mark(|m| {
            m.first_token.get_or_insert_with(Instant::now);
        });
    }

    /// It gave back its pages to wait again.
    pub(crate) fn preempted(&mut self) {
        self.mark(|m| m.preemptions += 1);
    }

    /// How it ends here, and its counts where it has them.
    pub(crate) fn ends(&mut self, outcome: Outcome, usage: Option<Usage>) {
        self.mark(|m| {
            m.outcome = outcome;
            m.usage = usage.or(m.usage);
        });
    }

    /// The context a prefill order for this request carries: under this
    /// worker's span when it is followed here, else whatever it came with.
    pub(crate) fn context_for_peer(&self, came_with: Option<TraceContext>) -> Option<TraceContext> {
        match &self.0 {
            Some(marks) => TraceContext::new(marks.parent.trace_id(), marks.span),
            None => came_with,
        }
    }
}

impl Drop for Timeline {
    fn drop(&mut self) {
        if let Some(marks) = self.0.take() {
            marks.record(Instant::now());
        }
    }
}

impl Marks {
    /// The worker's span and its phases, ended at `ended`.
    fn record(self, ended: Instant) {
        let tracer = global::tracer("kvfence");
        let role = self.role.map_or("unscheduled", Role::label);
        let wall = |at: Instant| self.received_wall + at.saturating_duration_since(self.received);
        let mut attributes = vec![
            KeyValue::new("kvfence.role", role),
            KeyValue::new("kvfence.outcome", self.outcome.label()),
            KeyValue::new("kvfence.preemptions", i64::from(self.preemptions)),
        ];
        match self.outcome {
            Outcome::Finished(reason) => attributes.push(KeyValue::new(
                "kvfence.finish_reason",
                match reason {
                    FinishReason::Stop => "stop",
                    FinishReason::Length => "length",
                },
            )),
            Outcome::Failed(kind) => {
                attributes.push(KeyValue::new("kvfence.failure", kind.label()))
            }
            Outcome::Shipped | Outcome::Cancelled => {}
        }
        if let Some(usage) = self.usage {
            let count = |n: usize| i64::try_from(n).unwrap_or(i64::MAX);
            attributes.extend([
                KeyValue::new("kvfence.prompt_tokens", count(usage.prompt_tokens)),
                KeyValue::new("kvfence.cached_tokens", count(usage.cached_tokens)),
                KeyValue::new("kvfence.completion_tokens", count(usage.completion_tokens)),
            ]);
        }
        let status = match self.outcome {
            Outcome::Failed(kind) => Status::error(kind.label()),
            _ => Status::Unset,
        };
        let mut worker = tracer.build_with_context(
            SpanBuilder::from_name(format!("{role} worker"))
                .with_span_id(SpanId::from_bytes(self.span.to_be_bytes()))
                .with_kind(SpanKind::Internal)
                .with_start_time(self.received_wall)
                .with_attributes(attributes)
                .with_status(status),
            &self.parent.as_parent(),
        );
        let under = Context::new().with_remote_span_context(worker.span_context().clone());
        let phase = |name: &'static str, from: Instant, to: Instant| {
            let mut span = tracer.build_with_context(
                SpanBuilder::from_name(name)
                    .with_kind(SpanKind::Internal)
                    .with_start_time(wall(from)),
                &under,
            );
            span.end_with_timestamp(wall(to.max(from)));
        };
        let admitted = self.admitted.unwrap_or(ended);
        phase("queue", self.received, admitted);
        if self.admitted.is_some() {
            match self.role {
                Some(Role::Decode) => {
                    let committed = self.kv_ready.unwrap_or(ended);
                    phase("handoff", admitted, committed);
                    if self.kv_ready.is_some() {
                        phase("decode", committed, ended);
                    }
                }
                Some(Role::Prefill) => {
                    phase("prefill", admitted, self.first_token.unwrap_or(ended));
                }
                Some(Role::Colocated) | None => {
                    let first = self.first_token.unwrap_or(ended);
                    phase("prefill", admitted, first);
                    if self.first_token.is_some() {
                        phase("decode", first, ended);
                    }
                }
            }
        }
        worker.end_with_timestamp(wall(ended));
    }
}

/// A span id for this worker's span: random, never zero.
fn new_span_id() -> u64 {
    loop {
        let id = rand::random::<u64>();
        if id != 0 {
            return id;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_untraced_request_keeps_no_marks_and_passes_on_what_it_came_with() {
        let mut timeline = Timeline::start(None);
        timeline.admitted();
        timeline.token();
        assert!(timeline.0.is_none());
        let came = TraceContext::new(7, 9);
        assert_eq!(timeline.context_for_peer(came), came);
        let traced = Timeline::start(came);
        let passed = traced.context_for_peer(None).expect("followed");
        assert_eq!(passed.trace_id(), 7);
        assert_ne!(
            passed.span_id(),
            9,
            "a prefill order hangs under this worker's span"
        );
    }
}

//! A traced request's spans, as the workers record them: one span per
//! worker under the caller's, a child per phase, the prefill worker's under
//! the decode worker's over every transport; every way of leaving a worker
//! recorded; counts and outcomes, never text (I10); nothing for a request
//! that is not traced.
//!
//! The tracer provider is the process's global one, installed once for
//! this test binary; each test reads only its own traces' spans.

#![allow(clippy::unwrap_used)]

use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant, SystemTime};

use kvfence_engine::trace::TraceContext;
use kvfence_engine::{
    Engine, EngineConfig, Event, FailureKind, GenerationRequest, RequestHandle, Share, Transport,
};
use kvfence_model::LoadedModel;
use kvfence_pool::{ElemType, Pool, PoolSize, PoolSpec};
use opentelemetry::Value;
use opentelemetry::trace::Status;
use opentelemetry_sdk::error::OTelSdkResult;
use opentelemetry_sdk::trace::{SdkTracerProvider, SpanData, SpanExporter};

/// Every span the process ended, in the order they ended.
#[derive(Debug, Clone, Default)]
struct Collected(Arc<Mutex<Vec<SpanData>>>);

impl SpanExporter for Collected {
    async fn export(&self, batch: Vec<SpanData>) -> OTelSdkResult {
        self.0.lock().unwrap().extend(batch);
        Ok(())
    }
}

fn collected() -> &'static Collected {
    static COLLECTED: OnceLock<Collected> = OnceLock::new();
    COLLECTED.get_or_init(|| {
        let collected = Collected::default();
        let provider = SdkTracerProvider::builder()
            .with_simple_exporter(collected.clone())
            .build();
        opentelemetry::global::set_tracer_provider(provider);
        collected
    })
}

/// The spans of trace `trace`, once `count` of them have ended.
fn spans_of(trace: u128, count: usize) -> Vec<SpanData> {
    let wanted = |s: &SpanData| u128::from_be_bytes(s.span_context.trace_id().to_bytes()) == trace;
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let spans: Vec<SpanData> = collected()
            .0
            .lock()
            .unwrap()
            .iter()
            .filter(|s| wanted(s))
            .cloned()
            .collect();
        if spans.len() >= count || Instant::now() > deadline {
            return spans;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

fn span<'a>(spans: &'a [SpanData], name: &str) -> &'a SpanData {
    spans
        .iter()
        .find(|s| s.name == name)
        .unwrap_or_else(|| panic!("no span {name:?} in {:?}", names(spans)))
}

fn names(spans: &[SpanData]) -> Vec<String> {
    spans.iter().map(|s| s.name.to_string()).collect()
}

fn attribute(span: &SpanData, key: &str) -> Option<Value> {
    span.attributes
        .iter()
        .find(|kv| kv.key.as_str() == key)
        .map(|kv| kv.value.clone())
}

fn find<'a>(phases: &[&'a SpanData], name: &str) -> &'a SpanData {
    phases.iter().find(|s| s.name == name).unwrap()
}

fn span_id(span: &SpanData) -> u64 {
    u64::from_be_bytes(span.span_context.span_id().to_bytes())
}

fn parent_id(span: &SpanData) -> u64 {
    u64::from_be_bytes(span.parent_span_id.to_bytes())
}

fn model() -> Arc<LoadedModel> {
    Arc::new(LoadedModel::load("builtin:tiny").unwrap())
}

fn pool(model: &LoadedModel, tokens: usize) -> Pool {
    let spec = PoolSpec::new(
        model.model.kv_shape(),
        16,
        ElemType::F32,
        PoolSize::Tokens(tokens),
    );
    Pool::new(&spec).unwrap()
}

/// A fresh caller's span: the router's, in a real deployment.
fn caller() -> TraceContext {
    TraceContext::new(rand::random::<u128>() | 1, rand::random::<u64>() | 1).unwrap()
}

/// The words of the prompt, which no span may carry.
const SECRET: &str = "zebra-canary";

fn request(model: &LoadedModel, trace: Option<TraceContext>) -> GenerationRequest {
    GenerationRequest {
        ignore_eos: true,
        share: Share::new("tenant-secret-name", 1),
        trace,
        ..GenerationRequest::greedy(
            model
                .tokenizer
                .encode(&format!("{SECRET} {SECRET} {SECRET}"))
                .unwrap(),
            6,
        )
    }
}

fn finish(mut handle: RequestHandle) -> Event {
    loop {
        match handle
            .blocking_next()
            .expect("the request ends with an event")
        {
            Event::Token { .. } => {}
            end => return end,
        }
    }
}

/// No attribute of any span says anything the client sent.
fn carries_no_text(spans: &[SpanData]) {
    for span in spans {
        let text = format!("{:?} {:?} {:?}", span.name, span.attributes, span.status);
        assert!(!text.contains(SECRET), "prompt text in {text}");
        assert!(!text.contains("tenant-secret-name"), "tenant in {text}");
    }
}

/// Each phase lies inside its worker's span, in order.
fn phases_in_order(worker: &SpanData, phases: &[&SpanData]) {
    let mut at: SystemTime = worker.start_time;
    for phase in phases {
        assert_eq!(
            parent_id(phase),
            span_id(worker),
            "{} under its worker",
            phase.name
        );
        assert!(
            phase.start_time >= at,
            "{} starts after the phase before",
            phase.name
        );
        assert!(phase.end_time >= phase.start_time);
        at = phase.end_time;
    }
    assert!(worker.end_time >= at, "the worker's span holds its phases");
}

#[test]
fn a_colocated_request_is_one_worker_span_with_queue_prefill_and_decode() {
    collected();
    let model = model();
    let engine = Engine::start(
        Arc::clone(&model),
        pool(&model, 512),
        EngineConfig::default(),
    );
    let trace = caller();
    let end = finish(engine.submit(request(&model, Some(trace))).unwrap());
    assert!(matches!(end, Event::Finished { .. }), "{end:?}");
    let spans = spans_of(trace.trace_id(), 4);
    assert_eq!(spans.len(), 4, "{:?}", names(&spans));
    let worker = span(&spans, "colocated worker");
    assert_eq!(
        parent_id(worker),
        trace.span_id(),
        "under the caller's span"
    );
    phases_in_order(
        worker,
        &[
            span(&spans, "queue"),
            span(&spans, "prefill"),
            span(&spans, "decode"),
        ],
    );
    assert_eq!(
        attribute(worker, "kvfence.outcome"),
        Some("finished".into())
    );
    assert_eq!(
        attribute(worker, "kvfence.finish_reason"),
        Some("length".into())
    );
    assert_eq!(
        attribute(worker, "kvfence.completion_tokens"),
        Some(6i64.into())
    );
    let prompt = request(&model, None).prompt.len() as i64;
    assert_eq!(
        attribute(worker, "kvfence.prompt_tokens"),
        Some(prompt.into())
    );
    carries_no_text(&spans);
    engine.shutdown();
}

#[test]
fn the_prefill_workers_span_hangs_under_the_decode_workers_over_every_transport() {
    collected();
    let model = model();
    for transport in [
        Transport::InProcess,
        Transport::SharedMemory,
        kvfence_fleet::TlsLoopback::transport(),
    ] {
        let engine = Engine::start_disaggregated(
            Arc::clone(&model),
            pool(&model, 512),
            pool(&model, 512),
            EngineConfig::default(),
            &transport,
        )
        .unwrap();
        let trace = caller();
        let end = finish(engine.submit(request(&model, Some(trace))).unwrap());
        assert!(matches!(end, Event::Finished { .. }), "{end:?}");
        // decode worker, queue, handoff, decode; prefill worker, queue, prefill.
        let spans = spans_of(trace.trace_id(), 7);
        assert_eq!(spans.len(), 7, "{transport:?}: {:?}", names(&spans));
        let decode = span(&spans, "decode worker");
        let prefill = span(&spans, "prefill worker");
        assert_eq!(parent_id(decode), trace.span_id());
        assert_eq!(
            parent_id(prefill),
            span_id(decode),
            "{transport:?}: the order carried the decode worker's span"
        );
        let under = |worker: &SpanData| -> Vec<&SpanData> {
            spans
                .iter()
                .filter(|s| parent_id(s) == span_id(worker))
                .collect()
        };
        let decode_phases = under(decode);
        phases_in_order(
            decode,
            &[
                find(&decode_phases, "queue"),
                find(&decode_phases, "handoff"),
                find(&decode_phases, "decode"),
            ],
        );
        let prefill_phases = under(prefill);
        phases_in_order(
            prefill,
            &[
                find(&prefill_phases, "queue"),
                find(&prefill_phases, "prefill"),
            ],
        );
        assert_eq!(
            attribute(prefill, "kvfence.outcome"),
            Some("shipped".into())
        );
        assert_eq!(
            attribute(prefill, "kvfence.completion_tokens"),
            Some(1i64.into())
        );
        assert_eq!(
            attribute(decode, "kvfence.outcome"),
            Some("finished".into())
        );
        assert!(
            prefill.start_time >= decode.start_time && prefill.end_time <= decode.end_time,
            "{transport:?}: the prefill worker worked inside the decode worker's time"
        );
        carries_no_text(&spans);
        engine.shutdown();
    }
}

#[test]
fn refused_and_cancelled_requests_are_recorded_and_untraced_ones_are_not() {
    collected();
    let model = model();
    // The incident's shape: a prompt that fits the decode worker's pool
    // but not the prefill worker's. Both record the failure.
    let incident = Engine::start_disaggregated(
        Arc::clone(&model),
        pool(&model, 16),
        pool(&model, 512),
        EngineConfig::default(),
        &Transport::InProcess,
    )
    .unwrap();
    let too_long = caller();
    let request_too_long = request(&model, Some(too_long));
    assert!(request_too_long.prompt.len() > 16);
    let end = finish(incident.submit(request_too_long).unwrap());
    assert!(
        matches!(
            end,
            Event::Failed {
                kind: FailureKind::TooLong,
                ..
            }
        ),
        "{end:?}"
    );
    incident.shutdown();
    // decode worker, queue, handoff; prefill worker, queue (never admitted).
    let spans = spans_of(too_long.trace_id(), 5);
    assert_eq!(spans.len(), 5, "{:?}", names(&spans));
    for name in ["decode worker", "prefill worker"] {
        let worker = span(&spans, name);
        assert_eq!(attribute(worker, "kvfence.outcome"), Some("failed".into()));
        assert_eq!(
            attribute(worker, "kvfence.failure"),
            Some("too_long".into())
        );
        assert!(matches!(worker.status, Status::Error { .. }));
    }
    carries_no_text(&spans);

    let engine = Engine::start(
        Arc::clone(&model),
        pool(&model, 512),
        EngineConfig::default(),
    );
    // A client that leaves after its first token.
    let cancelled = caller();
    let mut long = request(&model, Some(cancelled));
    long.max_tokens = 40;
    let mut handle = engine.submit(long).unwrap();
    assert!(matches!(handle.blocking_next(), Some(Event::Token { .. })));
    drop(handle);
    let spans = spans_of(cancelled.trace_id(), 4);
    let worker = span(&spans, "colocated worker");
    assert_eq!(
        attribute(worker, "kvfence.outcome"),
        Some("cancelled".into())
    );
    carries_no_text(&spans);

    // Untraced: the same request with no context. The engine makes no
    // root span, ever: a span for an untraced request would be one.
    let end = finish(engine.submit(request(&model, None)).unwrap());
    assert!(matches!(end, Event::Finished { .. }));
    engine.shutdown();
    for span in collected().0.lock().unwrap().iter() {
        assert_ne!(
            parent_id(span),
            0,
            "a root span from the engine: {}",
            span.name
        );
    }
}

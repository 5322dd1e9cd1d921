//! OpenTelemetry traces as a collector receives them (`--otlp-endpoint`):
//! a request followed through a router, a decode worker and a prefill
//! worker — three processes — in one trace; the same in `serve`'s one
//! process over OTLP's JSON encoding; a trace of the server's own whatever
//! `traceparent` a client sends; tenants named only when the operator
//! allows it; and no prompt or completion text in anything exported (I10).

#![allow(clippy::unwrap_used)]

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::body::Bytes;
use axum::http::HeaderMap;
use opentelemetry_proto::tonic::collector::trace::v1::ExportTraceServiceRequest;
use opentelemetry_proto::tonic::common::v1::{AnyValue, KeyValue, any_value};
use prost::Message;
use serde_json::json;

use crate::common::{ClusterTls, Server, tenant, tenants_file};
use crate::multiprocess::{start_decode_with, start_prefill_with, start_router_with};

/// Flush spans within a tenth of a second (the batch processor's delay).
const QUICK_EXPORT: (&str, &str) = ("OTEL_BSP_SCHEDULE_DELAY", "100");

/// Words in every prompt; no exported byte may carry them.
const CANARY: &str = "okapi-lantern-canary";

/// One span as received, with the process that sent it.
#[derive(Debug, Clone)]
struct Seen {
    process: String,
    trace: Vec<u8>,
    id: Vec<u8>,
    parent: Vec<u8>,
    name: String,
    attributes: HashMap<String, String>,
}

/// An OTLP/HTTP collector on a free loopback port: every export it is
/// sent, protobuf or JSON, decoded; and every body as received.
struct Collector {
    endpoint: String,
    spans: Arc<Mutex<Vec<Seen>>>,
    bodies: Arc<Mutex<Vec<Vec<u8>>>>,
}

impl Collector {
    async fn start() -> Collector {
        let spans: Arc<Mutex<Vec<Seen>>> = Arc::default();
        let bodies: Arc<Mutex<Vec<Vec<u8>>>> = Arc::default();
        let (into_spans, into_bodies) = (Arc::clone(&spans), Arc::clone(&bodies));
        let receive = move |headers: HeaderMap, body: Bytes| {
            let (spans, bodies) = (Arc::clone(&into_spans), Arc::clone(&into_bodies));
            async move {
                let json = headers
                    .get("content-type")
                    .is_some_and(|v| v.as_bytes().starts_with(b"application/json"));
                let request = if json {
                    serde_json::from_slice::<ExportTraceServiceRequest>(&body).unwrap()
                } else {
                    ExportTraceServiceRequest::decode(body.as_ref()).unwrap()
                };
                bodies.lock().unwrap().push(body.to_vec());
                spans.lock().unwrap().extend(flatten(request));
                if json { "{}" } else { "" }
            }
        };
        let app = axum::Router::new().route("/v1/traces", axum::routing::post(receive));
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let endpoint = format!("http://{}", listener.local_addr().unwrap());
        tokio::spawn(async move { axum::serve(listener, app).await });
        Collector {
            endpoint,
            spans,
            bodies,
        }
    }

    /// Every span of the trace that `root_of` picks, once `count` have
    /// come (or 30 s have passed).
    async fn trace(&self, count: usize, root_of: impl Fn(&Seen) -> bool) -> Vec<Seen> {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let spans = self.spans.lock().unwrap().clone();
            if let Some(root) = spans.iter().find(|s| root_of(s)) {
                let trace: Vec<Seen> = spans
                    .iter()
                    .filter(|s| s.trace == root.trace)
                    .cloned()
                    .collect();
                if trace.len() >= count || Instant::now() > deadline {
                    return trace;
                }
            } else if Instant::now() > deadline {
                panic!("no such trace among {:?}", names(&spans));
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Nothing exported so far says `text`.
    fn never_saw(&self, text: &str) {
        // Searched as bytes: a body is protobuf, and decoding it lossily
        // would make replacement characters of its binary fields — which a
        // tiny model's completion may be made of too.
        let needle = text.as_bytes();
        for body in self.bodies.lock().unwrap().iter() {
            let found = body.windows(needle.len()).any(|window| window == needle);
            assert!(
                !found,
                "{text:?} exported: {}",
                String::from_utf8_lossy(body)
            );
        }
        for span in self.spans.lock().unwrap().iter() {
            let all = format!("{span:?}");
            assert!(!all.contains(text), "{text:?} exported: {all}");
        }
    }
}

fn text_of(value: &Option<AnyValue>) -> String {
    match value.as_ref().and_then(|v| v.value.as_ref()) {
        Some(any_value::Value::StringValue(s)) => s.clone(),
        Some(any_value::Value::IntValue(i)) => i.to_string(),
        Some(any_value::Value::BoolValue(b)) => b.to_string(),
        Some(any_value::Value::DoubleValue(d)) => d.to_string(),
        other => format!("{other:?}"),
    }
}

fn attributes(list: &[KeyValue]) -> HashMap<String, String> {
    list.iter()
        .map(|kv| (kv.key.clone(), text_of(&kv.value)))
        .collect()
}

fn flatten(request: ExportTraceServiceRequest) -> Vec<Seen> {
    let mut out = Vec::new();
    for resource in request.resource_spans {
        let process = resource
            .resource
            .as_ref()
            .map(|r| attributes(&r.attributes))
            .and_then(|a| a.get("kvfence.process").cloned())
            .unwrap_or_default();
        for scope in resource.scope_spans {
            for span in scope.spans {
                out.push(Seen {
                    process: process.clone(),
                    trace: span.trace_id,
                    id: span.span_id,
                    parent: span.parent_span_id,
                    name: span.name,
                    attributes: attributes(&span.attributes),
                });
            }
        }
    }
    out
}

fn names(spans: &[Seen]) -> Vec<String> {
    spans
        .iter()
        .map(|s| format!("{}:{}", s.process, s.name))
        .collect()
}

fn one<'a>(spans: &'a [Seen], process: &str, name: &str) -> &'a Seen {
    let found: Vec<&Seen> = spans
        .iter()
        .filter(|s| s.process == process && s.name == name)
        .collect();
    assert_eq!(found.len(), 1, "{process}:{name} in {:?}", names(spans));
    found[0]
}

/// The phases under `worker` (its own process's spans beneath it), by name.
fn phases(spans: &[Seen], worker: &Seen) -> Vec<String> {
    let mut names: Vec<String> = spans
        .iter()
        .filter(|s| s.parent == worker.id && s.process == worker.process)
        .map(|s| s.name.clone())
        .collect();
    names.sort();
    names
}

fn prompt() -> serde_json::Value {
    json!({
        "prompt": format!("{CANARY} {CANARY} {CANARY}"),
        "max_tokens": 5,
        "ignore_eos": true,
    })
}

#[tokio::test(flavor = "multi_thread")]
async fn a_request_is_one_trace_through_router_decode_and_prefill_processes() {
    let collector = Collector::start().await;
    let tls = ClusterTls::init();
    let otlp = ["--otlp-endpoint", collector.endpoint.as_str()];
    let env = [QUICK_EXPORT];
    let prefill = start_prefill_with(&tls, &otlp, &env);
    let decode = start_decode_with(&tls, &prefill.base, &otlp, &env);
    let router = start_router_with(&tls, &decode.base, &otlp, &env);

    let response = reqwest::Client::new()
        .post(router.url("/v1/completions"))
        .json(&prompt())
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 200);
    assert!(
        response.headers().contains_key("content-length"),
        "a traced whole answer keeps its length"
    );
    let request_id = response.headers()["x-request-id"]
        .to_str()
        .unwrap()
        .to_string();
    let answer: serde_json::Value = response.json().await.unwrap();
    let completion = answer["choices"][0]["text"].as_str().unwrap().to_string();

    // Router: the request; decode: worker + queue, handoff, decode;
    // prefill: worker + queue, prefill.
    let spans = collector
        .trace(8, |s| {
            s.attributes.get("kvfence.request_id") == Some(&request_id)
        })
        .await;
    assert_eq!(spans.len(), 8, "{:?}", names(&spans));
    let front = one(&spans, "router", "POST /v1/completions");
    assert!(
        front.parent.is_empty(),
        "the router's span is the trace's root"
    );
    assert_eq!(front.attributes["http.response.status_code"], "200");
    let decode_worker = one(&spans, "decode", "decode worker");
    let prefill_worker = one(&spans, "prefill", "prefill worker");
    assert_eq!(
        decode_worker.parent, front.id,
        "the decode worker's span is under the router's"
    );
    assert_eq!(
        prefill_worker.parent, decode_worker.id,
        "the prefill worker's span is under the decode worker's"
    );
    assert_eq!(
        phases(&spans, decode_worker),
        ["decode", "handoff", "queue"]
    );
    assert_eq!(phases(&spans, prefill_worker), ["prefill", "queue"]);
    assert_eq!(decode_worker.attributes["kvfence.outcome"], "finished");
    assert_eq!(decode_worker.attributes["kvfence.completion_tokens"], "5");
    assert_eq!(prefill_worker.attributes["kvfence.outcome"], "shipped");
    assert_eq!(
        decode_worker.attributes["kvfence.prompt_tokens"],
        prefill_worker.attributes["kvfence.prompt_tokens"]
    );
    collector.never_saw(CANARY);
    if completion.trim().len() >= 4 {
        collector.never_saw(completion.trim());
    }
    drop((router, decode, prefill));
}

#[tokio::test(flavor = "multi_thread")]
async fn serve_exports_json_names_tenants_only_when_allowed_and_ignores_client_traces() {
    let collector = Collector::start().await;
    let (key, lines) = tenant("acme-traced", &[]);
    let file = tenants_file(&[lines]);
    let config = file.path().to_str().unwrap();
    let otlp = [
        "--config",
        config,
        "--otlp-endpoint",
        collector.endpoint.as_str(),
        "--otlp-protocol",
        "json",
    ];
    let server = Server::start_with_env(&otlp, &[QUICK_EXPORT]);
    let client_trace = "4bf92f3577b34da6a3ce929d0e0e4736";
    let streamed = reqwest::Client::new()
        .post(server.url("/v1/chat/completions"))
        .bearer_auth(&key)
        .header(
            "traceparent",
            format!("00-{client_trace}-00f067aa0ba902b7-01"),
        )
        .json(&json!({
            "messages": [{"role": "user", "content": CANARY}],
            "max_tokens": 4,
            "stream": true,
        }))
        .send()
        .await
        .unwrap();
    assert_eq!(streamed.status(), 200);
    let request_id = streamed.headers()["x-request-id"]
        .to_str()
        .unwrap()
        .to_string();
    let _ = streamed.text().await.unwrap();
    // serve is disaggregated in one process: both workers report under it.
    let spans = collector
        .trace(8, |s| {
            s.attributes.get("kvfence.request_id") == Some(&request_id)
        })
        .await;
    assert_eq!(spans.len(), 8, "{:?}", names(&spans));
    let front = one(&spans, "serve", "POST /v1/chat/completions");
    assert_ne!(
        hex(&front.trace),
        client_trace,
        "a client's traceparent is not followed"
    );
    assert!(front.parent.is_empty());
    let decode_worker = one(&spans, "serve", "decode worker");
    let prefill_worker = one(&spans, "serve", "prefill worker");
    assert_eq!(decode_worker.parent, front.id);
    assert_eq!(prefill_worker.parent, decode_worker.id);
    assert!(
        !front.attributes.contains_key("kvfence.tenant"),
        "tenants are not named unless the operator says so"
    );
    collector.never_saw("acme-traced");

    // A refused request is a span too: its status, and no worker beneath.
    let (status, _) = crate::common::post(
        &server.url("/v1/chat/completions"),
        Some(&key),
        json!({"messages": [{"role": "user", "content": CANARY}], "max_tokens": 0}),
    )
    .await;
    assert_eq!(status, 400);
    let refused = collector
        .trace(1, |s| {
            s.name == "POST /v1/chat/completions"
                && s.attributes
                    .get("http.response.status_code")
                    .map(String::as_str)
                    == Some("400")
        })
        .await;
    assert_eq!(refused.len(), 1, "{:?}", names(&refused));
    collector.never_saw(CANARY);
    drop(server);

    // With --trace-tenant-names the front door's span says who asked.
    let mut named = otlp.to_vec();
    named.push("--trace-tenant-names");
    let server = Server::start_with_env(&named, &[QUICK_EXPORT]);
    let (status, _) =
        crate::common::post(&server.url("/v1/completions"), Some(&key), prompt()).await;
    assert_eq!(status, 200);
    let spans = collector
        .trace(1, |s| s.attributes.contains_key("kvfence.tenant"))
        .await;
    let front = one(&spans, "serve", "POST /v1/completions");
    assert_eq!(front.attributes["kvfence.tenant"], "acme-traced");
}

#[test]
fn a_bad_endpoint_stops_the_start_with_a_reason() {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_kvfence"))
        .args([
            "serve",
            "--model",
            "builtin:tiny",
            "--port",
            "0",
            "--otlp-endpoint",
            "collector:4318",
        ])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("--otlp-endpoint"), "{stderr}");
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

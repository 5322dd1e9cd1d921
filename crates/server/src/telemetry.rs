//! Traces out of the process: an OpenTelemetry tracer provider that sends
//! spans over OTLP/HTTP (protobuf or JSON) to a collector, installed as
//! the process's global provider ([`Traces::export`]); and the span of one
//! HTTP request at the front door ([`RequestSpan`]), under which every
//! worker the request reaches — in this process or across a fleet's links —
//! records its own (`kvfence_engine::trace`).
//!
//! One trace per request, made here: a client's `traceparent` is not
//! followed, so no client chooses an id the server keeps (as for
//! `x-request-id`). Spans carry routes, statuses, counts and timings;
//! never prompt or completion text (I10), and the tenant's name only where
//! the operator allows it.
//!
//! Export runs on the batch processor's own thread with a blocking HTTP
//! client: never on the compute pool, never on the async runtime. A
//! collector that is down costs dropped spans, not requests.

use std::pin::Pin;
use std::task::Poll;
use std::time::Duration;

use axum::body::{Body, Bytes, HttpBody};
use axum::http::StatusCode;
use hyper::body::{Frame, SizeHint};
use kvfence_engine::trace::TraceContext;
use opentelemetry::trace::{Span, SpanKind, Status, Tracer};
use opentelemetry::{KeyValue, global};
use opentelemetry_otlp::{Protocol, WithExportConfig};
use opentelemetry_sdk::Resource;
use opentelemetry_sdk::trace::SdkTracerProvider;

use crate::error::ServerError;

/// How spans are encoded on the wire (OTLP/HTTP).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OtlpProtocol {
    /// `application/x-protobuf`: OTLP/HTTP's default.
    Protobuf,
    /// `application/json`.
    Json,
}

/// The process's span export; dropping it sends what is buffered and stops.
#[derive(Debug)]
pub struct Traces {
    provider: SdkTracerProvider,
}

/// How long one export may take before its spans are dropped.
const EXPORT_TIMEOUT: Duration = Duration::from_secs(10);

impl Traces {
    /// Sends this process's spans to the collector at `endpoint`: a base
    /// URL (`http://collector:4318`, spans to its `/v1/traces`) or, with a
    /// path, the exact URL to post to. `process` names the process in the
    /// spans' resource (`kvfence.process`: serve, router, decode, prefill).
    /// Installed as the global provider, which the engine's workers use.
    pub fn export(
        endpoint: &str,
        protocol: OtlpProtocol,
        process: &'static str,
    ) -> Result<Traces, ServerError> {
        let url = traces_url(endpoint)?;
        let exporter = opentelemetry_otlp::SpanExporter::builder()
            .with_http()
            .with_protocol(match protocol {
                OtlpProtocol::Protobuf => Protocol::HttpBinary,
                OtlpProtocol::Json => Protocol::HttpJson,
            })
            .with_endpoint(url)
            .with_timeout(EXPORT_TIMEOUT)
            .build()
            .map_err(|error| ServerError::Traces(error.to_string()))?;
        let resource = Resource::builder()
            .with_service_name("kvfence")
            .with_attributes([
                KeyValue::new("service.version", env!("CARGO_PKG_VERSION")),
                KeyValue::new("kvfence.process", process),
            ])
            .build();
        let provider = SdkTracerProvider::builder()
            .with_batch_exporter(exporter)
            .with_resource(resource)
            .build();
        global::set_tracer_provider(provider.clone());
        Ok(Traces { provider })
    }
}

impl Drop for Traces {
    fn drop(&mut self) {
        // Sends what is buffered: a process that stops cleanly loses no span.
        let _ = self.provider.shutdown();
    }
}

/// Where spans are posted: `endpoint` as given when it names a path, else
/// its `/v1/traces`. Only `http` and `https` URLs with a host.
fn traces_url(endpoint: &str) -> Result<String, ServerError> {
    let bad = |why: &str| ServerError::Traces(format!("--otlp-endpoint {why}"));
    let uri: axum::http::Uri = endpoint
        .parse()
        .map_err(|_| bad("is not a URL (http://HOST:PORT)"))?;
    if !matches!(uri.scheme_str(), Some("http" | "https")) {
        return Err(bad("must be an http:// or https:// URL"));
    }
    if uri.host().is_none_or(str::is_empty) {
        return Err(bad("names no host"));
    }
    if uri.query().is_some() {
        return Err(bad("may not carry a query"));
    }
    Ok(match uri.path() {
        "" | "/" => format!("{}/v1/traces", endpoint.trim_end_matches('/')),
        _ => endpoint.to_string(),
    })
}

/// One generation request's span at the front door: from its arrival to
/// the last byte of its answer (it ends when the answer's body is
/// dropped). Empty when no provider is installed or the trace is not
/// sampled: then nothing downstream is traced either.
pub(crate) struct RequestSpan(Option<global::BoxedSpan>);

impl RequestSpan {
    /// A new trace for a request to `route`, named by the server's own
    /// `request_id`.
    pub(crate) fn start(route: &'static str, request_id: &str) -> RequestSpan {
        let tracer = global::tracer("kvfence");
        let span = tracer
            .span_builder(format!("POST {route}"))
            .with_kind(SpanKind::Server)
            .with_attributes([
                KeyValue::new("http.request.method", "POST"),
                KeyValue::new("http.route", route),
                KeyValue::new("kvfence.request_id", request_id.to_string()),
            ])
            .start(&tracer);
        let sampled = span.span_context().is_sampled();
        RequestSpan(sampled.then_some(span))
    }

    /// What the workers' spans hang under.
    pub(crate) fn context(&self) -> Option<TraceContext> {
        self.0
            .as_ref()
            .and_then(|span| TraceContext::of(span.span_context()))
    }

    /// Names the tenant (only where the operator allows it).
    pub(crate) fn tenant(&mut self, name: &str) {
        if let Some(span) = &mut self.0 {
            span.set_attribute(KeyValue::new("kvfence.tenant", name.to_string()));
        }
    }

    /// `body`, holding this span until it is dropped: the span ends with
    /// the answer's last byte.
    pub(crate) fn around(self, body: Body) -> SpannedBody {
        SpannedBody { body, _span: self }
    }

    /// The answer's status; a server error marks the span failed.
    pub(crate) fn answered(&mut self, status: StatusCode) {
        if let Some(span) = &mut self.0 {
            span.set_attribute(KeyValue::new(
                "http.response.status_code",
                i64::from(status.as_u16()),
            ));
            if status.is_server_error() {
                span.set_status(Status::error(status.as_u16().to_string()));
            }
        }
    }
}

/// An answer's body and the span that ends when it is dropped. Frames,
/// end and size pass through unchanged (a whole JSON answer keeps its
/// `content-length`).
pub(crate) struct SpannedBody {
    body: Body,
    _span: RequestSpan,
}

impl HttpBody for SpannedBody {
    type Data = Bytes;
    type Error = axum::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, axum::Error>>> {
        Pin::new(&mut self.body).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.body.size_hint()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_endpoint_is_a_base_url_or_the_exact_url() {
        assert_eq!(
            traces_url("http://collector:4318").unwrap(),
            "http://collector:4318/v1/traces"
        );
        assert_eq!(
            traces_url("http://127.0.0.1:4318/").unwrap(),
            "http://127.0.0.1:4318/v1/traces"
        );
        assert_eq!(
            traces_url("https://otel.example/ingest/traces").unwrap(),
            "https://otel.example/ingest/traces"
        );
        for bad in [
            "collector:4318",
            "ftp://collector",
            "http://",
            "http://c/x?key=secret",
            "not a url",
        ] {
            assert!(traces_url(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn a_spanned_body_keeps_its_size_so_an_answer_keeps_its_content_length() {
        let body = RequestSpan(None).around(Body::from("hello"));
        assert_eq!(body.size_hint().exact(), Some(5));
        assert!(!body.is_end_stream());
    }

    #[test]
    fn without_a_provider_a_request_is_not_traced() {
        // No provider in this test binary: the global tracer is a no-op.
        let span = RequestSpan::start("/v1/chat/completions", "req_1");
        assert!(span.0.is_none());
        assert_eq!(span.context(), None);
    }
}

//! A request's place in a distributed trace: the W3C trace context its
//! caller passed (in `Submit`, prefill orders, or as `traceparent`). A
//! leaf of the crate: requests carry one, and the `trace` module records
//! spans under it.

use std::borrow::Cow;

use opentelemetry::Context;
use opentelemetry::trace::{SpanContext, SpanId, TraceContextExt, TraceFlags, TraceId, TraceState};

/// The span a request's work on a worker hangs under: its trace and that
/// span's id (W3C trace context; a sampled trace is implied — only
/// sampled requests carry one).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct TraceContext {
    trace_id: u128,
    span_id: u64,
}

impl TraceContext {
    /// A context, unless either id is zero (W3C: an invalid id).
    pub fn new(trace_id: u128, span_id: u64) -> Option<TraceContext> {
        (trace_id != 0 && span_id != 0).then_some(TraceContext { trace_id, span_id })
    }

    /// The context of an OpenTelemetry span, if it is valid and sampled.
    pub fn of(span: &SpanContext) -> Option<TraceContext> {
        if !span.is_valid() || !span.is_sampled() {
            return None;
        }
        TraceContext::new(
            u128::from_be_bytes(span.trace_id().to_bytes()),
            u64::from_be_bytes(span.span_id().to_bytes()),
        )
    }

    /// The trace's id.
    pub fn trace_id(&self) -> u128 {
        self.trace_id
    }

    /// The parent span's id.
    pub fn span_id(&self) -> u64 {
        self.span_id
    }

    /// As a W3C `traceparent` value: `00-<trace>-<span>-01`.
    pub fn traceparent(&self) -> String {
        format!("00-{:032x}-{:016x}-01", self.trace_id, self.span_id)
    }

    /// A W3C `traceparent` value, version 00, sampled; `None` for anything
    /// else (a peer's bytes: never a panic).
    pub fn from_traceparent(value: &str) -> Option<TraceContext> {
        let mut parts = value.split('-');
        let (version, trace, span, flags) =
            (parts.next()?, parts.next()?, parts.next()?, parts.next()?);
        let hex = |s: &str, len| s.len() == len && s.bytes().all(|b| b.is_ascii_hexdigit());
        if parts.next().is_some()
            || version != "00"
            || flags != "01"
            || !hex(trace, 32)
            || !hex(span, 16)
        {
            return None;
        }
        TraceContext::new(
            u128::from_str_radix(trace, 16).ok()?,
            u64::from_str_radix(span, 16).ok()?,
        )
    }

    /// This context as the remote parent of a new span.
    pub(crate) fn as_parent(&self) -> Context {
        Context::new().with_remote_span_context(SpanContext::new(
            TraceId::from_bytes(self.trace_id.to_be_bytes()),
            SpanId::from_bytes(self.span_id.to_be_bytes()),
            TraceFlags::SAMPLED,
            true,
            TraceState::default(),
        ))
    }
}

impl serde::Serialize for TraceContext {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.serialize_str(&self.traceparent())
    }
}

impl<'de> serde::Deserialize<'de> for TraceContext {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let value = <Cow<'de, str>>::deserialize(deserializer)?;
        TraceContext::from_traceparent(&value)
            .ok_or_else(|| serde::de::Error::custom("not a sampled W3C traceparent"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_traceparent_round_trips_and_anything_else_is_refused() {
        let context = TraceContext::new(0x0af7651916cd43dd8448eb211c80319c, 0xb7ad6b7169203331)
            .expect("non-zero ids");
        let text = context.traceparent();
        assert_eq!(
            text,
            "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
        );
        assert_eq!(TraceContext::from_traceparent(&text), Some(context));
        let json = serde_json::to_string(&context).expect("serializes");
        assert_eq!(
            serde_json::from_str::<TraceContext>(&json).ok(),
            Some(context)
        );
        for bad in [
            "",
            "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-00",
            "01-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
            "00-00000000000000000000000000000000-b7ad6b7169203331-01",
            "00-0af7651916cd43dd8448eb211c80319c-0000000000000000-01",
            "00-0af7651916cd43dd8448eb211c80319c-b7ad6b716920333-01",
            "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01-",
            "00-+af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
        ] {
            assert_eq!(TraceContext::from_traceparent(bad), None, "{bad:?}");
        }
        assert!(serde_json::from_str::<TraceContext>("\"nonsense\"").is_err());
    }
}

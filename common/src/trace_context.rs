//! W3C trace context across processes and with every event, and the messaging spans made
//! from it (OpenTelemetry messaging semantic conventions).
//!
//! Contract:
//! * Nothing here does any work unless span export is on ([`enabled`], set by
//!   [`crate::telemetry::init`] when `OTEL_EXPORTER_OTLP_ENDPOINT` is set): with export off a
//!   check is one relaxed atomic load.
//! * Between processes the context travels as the `traceparent` / `tracestate` gRPC metadata:
//!   [`TraceContextInjector`] (a tonic interceptor on every internal channel,
//!   [`crate::grpc::InternalChannel`]) writes the calling span's context, and
//!   [`TraceContextLayer`] (a tower layer every server runs, [`crate::grpc::ServerLayers`])
//!   opens the server span of a call that carries a **sampled** context as its child. A call
//!   without one opens no span here.
//! * With an event the context travels as its `traceparent` attribute (the CloudEvents
//!   distributed-tracing extension; a frame attribute in the MQ). It is the producer's and is
//!   never rewritten; an event published without one gets the publish span's (when sampled).
//! * Per-event spans ([`EventTrace::span`]) exist only for events whose context is sampled:
//!   parent-based sampling (`OTEL_TRACES_SAMPLER`, default `parentbased_always_on`) decides
//!   once, where the trace starts, and an unsampled event costs no span anywhere.
//! * A span serving many events (one offset write, one broker ACK) is not any one event's
//!   child: it starts its own trace and *links* to each event's span ([`links_span`]).

use std::sync::atomic::{AtomicBool, Ordering};
use std::task::{Context as TaskContext, Poll};

use opentelemetry::propagation::{Extractor, Injector, TextMapPropagator};
pub use opentelemetry::trace::SpanContext;
use opentelemetry::trace::TraceContextExt as _;
use opentelemetry_sdk::propagation::TraceContextPropagator;
use tonic::codegen::http;
use tower::{Layer, Service};
use tracing::Instrument as _;
use tracing::instrument::Instrumented;
use tracing_opentelemetry::OpenTelemetrySpanExt as _;

/// The W3C header and event attribute carrying the trace and parent span.
pub const TRACEPARENT: &str = "traceparent";
/// The W3C header carrying vendor trace state.
pub const TRACESTATE: &str = "tracestate";
/// `messaging.system` of every messaging span.
pub const MESSAGING_SYSTEM: &str = "eventmesh";
/// Most links one batch span carries (the rest of the batch is counted, not linked).
pub const MAX_LINKS: usize = 128;

static ENABLED: AtomicBool = AtomicBool::new(false);

/// Whether spans are exported (and so whether any trace work is done).
#[inline]
pub fn enabled() -> bool {
    ENABLED.load(Ordering::Relaxed)
}

/// Turns trace work on; called once span export is installed ([`crate::telemetry::init`], or
/// the SDK's `otel` feature in an application that exports its own spans).
pub fn enable() {
    ENABLED.store(true, Ordering::Relaxed);
}

/// The sampled context in `traceparent` (and `tracestate`) text, `None` for anything else
/// (empty, malformed, unsampled).
fn sampled_context(traceparent: &str, tracestate: Option<&str>) -> Option<SpanContext> {
    remote_context(traceparent, tracestate).filter(SpanContext::is_sampled)
}

/// The context in `traceparent` (and `tracestate`) text, sampled or not; `None` when empty or
/// malformed.
fn remote_context(traceparent: &str, tracestate: Option<&str>) -> Option<SpanContext> {
    struct Pair<'a>(&'a str, Option<&'a str>);
    impl Extractor for Pair<'_> {
        fn get(&self, key: &str) -> Option<&str> {
            match key {
                TRACEPARENT => Some(self.0),
                TRACESTATE => self.1,
                _ => None,
            }
        }
        fn keys(&self) -> Vec<&str> {
            vec![TRACEPARENT, TRACESTATE]
        }
    }
    let cx = TraceContextPropagator::new().extract(&Pair(traceparent, tracestate));
    let span_context = cx.span().span_context().clone();
    span_context.is_valid().then_some(span_context)
}

/// The `traceparent` text of a span context.
pub fn traceparent(span_context: &SpanContext) -> String {
    format!(
        "00-{}-{}-{:02x}",
        span_context.trace_id(),
        span_context.span_id(),
        span_context.trace_flags().to_u8()
    )
}

/// The context of a span when it is sampled (what an event or a call should carry).
pub fn sampled(span: &tracing::Span) -> Option<SpanContext> {
    if !enabled() || span.is_disabled() {
        return None;
    }
    let span_context = span.context().span().span_context().clone();
    (span_context.is_valid() && span_context.is_sampled()).then_some(span_context)
}

/// The `traceparent` text of a span when it is sampled: what an event published inside it
/// should carry when it has no context of its own.
pub fn sampled_traceparent(span: &tracing::Span) -> Option<String> {
    sampled(span).map(|span_context| traceparent(&span_context))
}

/// The sampled trace context an event carries, kept with it while the runtime handles it.
#[derive(Debug, Clone, PartialEq)]
pub struct EventTrace(SpanContext);

impl EventTrace {
    /// The context of an event's `traceparent` text; `None` when export is off or the text is
    /// empty, malformed or unsampled.
    pub fn parse(traceparent: &str) -> Option<Box<EventTrace>> {
        if !enabled() || traceparent.is_empty() {
            return None;
        }
        sampled_context(traceparent, None).map(|cx| Box::new(EventTrace(cx)))
    }

    /// The context of `span` when it is sampled: what a later hop continues from.
    pub fn of(span: &tracing::Span) -> Option<Box<EventTrace>> {
        sampled(span).map(|cx| Box::new(EventTrace(cx)))
    }

    /// As an OpenTelemetry context (a remote parent), for `set_parent`.
    pub fn context(&self) -> opentelemetry::Context {
        opentelemetry::Context::new().with_remote_span_context(self.0.clone())
    }

    /// The span context (for links).
    pub fn span_context(&self) -> &SpanContext {
        &self.0
    }

    /// A messaging span for one operation on this event, its child.
    pub fn span(&self, operation: Operation, destination: &str) -> tracing::Span {
        let span = messaging_span(operation, destination, None);
        let _ = span.set_parent(self.context());
        span
    }
}

/// A messaging operation: its name (span name prefix, `messaging.operation.name`), its
/// `messaging.operation.type` and its span kind.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Operation {
    /// `messaging.operation.name`, and the span name's first word.
    pub name: &'static str,
    /// `messaging.operation.type`: `create`, `send`, `receive`, `process` or `settle`.
    pub kind_of_operation: &'static str,
    /// `otel.kind`: `producer`, `consumer`, `client`, `server` or `internal`.
    pub span_kind: &'static str,
}

impl Operation {
    const fn new(
        name: &'static str,
        kind_of_operation: &'static str,
        span_kind: &'static str,
    ) -> Operation {
        Operation {
            name,
            kind_of_operation,
            span_kind,
        }
    }

    /// dispatcher-svc answering a client's Publish.
    pub const PUBLISH: Operation = Operation::new("publish", "send", "server");
    /// puller-svc writing published events to the MQ.
    pub const APPEND: Operation = Operation::new("append", "send", "producer");
    /// puller-svc reading an event from the MQ for a group.
    pub const PULL: Operation = Operation::new("pull", "receive", "consumer");
    /// dispatcher-svc sending an event to a subscriber's session (one attempt).
    pub const DELIVER: Operation = Operation::new("deliver", "process", "producer");
    /// dispatcher-svc taking a subscriber's ACK.
    pub const ACK: Operation = Operation::new("ack", "settle", "server");
    /// dispatcher-svc writing ACK progress to offset-svc (a batch: links).
    pub const OFFSET_WRITE: Operation = Operation::new("commit", "settle", "client");
    /// The SDK sending events (one call; `messaging.batch.message_count` for a batch).
    pub const SDK_PUBLISH: Operation = Operation::new("publish", "send", "producer");
    /// The SDK's batching publisher taking one event (its creation context).
    pub const SDK_CREATE: Operation = Operation::new("create", "create", "producer");
    /// The SDK handing a delivery to the application.
    pub const RECEIVE: Operation = Operation::new("receive", "receive", "consumer");
    /// The SDK ACKing a delivery.
    pub const SDK_ACK: Operation = Operation::new("ack", "settle", "client");
    /// The SDK NACKing a delivery.
    pub const SDK_NACK: Operation = Operation::new("nack", "settle", "client");
    /// The broker ACK of pulled messages, dispatcher-svc to puller-svc to the MQ (a batch).
    pub const BROKER_ACK: Operation = Operation::new("broker_ack", "settle", "client");
}

/// A span named `<operation> <destination>` with the messaging attributes; the optional ones
/// (`messaging.consumer.group.name`, `messaging.client.id`, `messaging.message.id`,
/// `messaging.destination.partition.id`, `eventmesh.offset`, `eventmesh.delivery.attempt`,
/// `messaging.batch.message_count`) are recorded by the caller. `parent`: `None` starts a
/// trace (unless a remote parent is set afterwards).
pub fn messaging_span(
    operation: Operation,
    destination: &str,
    parent: Option<tracing::Id>,
) -> tracing::Span {
    tracing::info_span!(
        target: "eventmesh::messaging",
        parent: parent,
        "messaging",
        otel.name = %format_args!("{} {destination}", operation.name),
        otel.kind = operation.span_kind,
        messaging.system = MESSAGING_SYSTEM,
        messaging.operation.name = operation.name,
        messaging.operation.type = operation.kind_of_operation,
        messaging.destination.name = destination,
        messaging.consumer.group.name = tracing::field::Empty,
        messaging.client.id = tracing::field::Empty,
        messaging.message.id = tracing::field::Empty,
        messaging.destination.partition.id = tracing::field::Empty,
        messaging.batch.message_count = tracing::field::Empty,
        eventmesh.offset = tracing::field::Empty,
        eventmesh.delivery.attempt = tracing::field::Empty,
    )
}

/// A span for an operation serving many events: the root of its own trace, linked to at most
/// [`MAX_LINKS`] of the events' spans, with `messaging.batch.message_count`.
pub fn links_span<'a>(
    operation: Operation,
    destination: &str,
    links: impl IntoIterator<Item = &'a SpanContext>,
    count: usize,
) -> tracing::Span {
    let span = messaging_span(operation, destination, None);
    span.record("messaging.batch.message_count", count as u64);
    for link in links.into_iter().take(MAX_LINKS) {
        span.add_link(link.clone());
    }
    span
}

/// The server span of the call `request` belongs to, when the caller sent a sampled context
/// ([`TraceContextLayer`] puts it in the request's extensions).
pub fn call_span<T>(request: &tonic::Request<T>) -> Option<tracing::Span> {
    request
        .extensions()
        .get::<CallSpan>()
        .map(|call| call.0.clone())
}

/// A messaging span, child of a call's server span ([`call_span`]); a disabled span when the
/// call carries no sampled context.
pub fn call_child_span<T>(
    request: &tonic::Request<T>,
    operation: Operation,
    destination: &str,
) -> tracing::Span {
    match call_span(request) {
        Some(call) => messaging_span(operation, destination, call.id()),
        None => tracing::Span::none(),
    }
}

/// The span of a call that starts messaging work (a Publish): a child of the caller's
/// context when it sent a sampled one, else of `event` (a lone event's own context, sampled
/// or not), else a new trace that the sampler decides on; a disabled span when export is off.
pub fn entry_span<T>(
    request: &tonic::Request<T>,
    event: Option<&str>,
    operation: Operation,
    destination: &str,
) -> tracing::Span {
    if !enabled() {
        return tracing::Span::none();
    }
    if let Some(call) = call_span(request) {
        return messaging_span(operation, destination, call.id());
    }
    let span = messaging_span(operation, destination, None);
    // An unsampled producer's context is a parent too: parent-based sampling then drops the
    // span, and the event stays untraced everywhere.
    if let Some(producer) = event.and_then(|tp| remote_context(tp, None)) {
        let _ = span.set_parent(opentelemetry::Context::new().with_remote_span_context(producer));
    }
    span
}

#[derive(Clone)]
struct CallSpan(tracing::Span);

/// Writes the current span's context into outgoing gRPC metadata (a tonic interceptor, on
/// every internal channel). Does nothing when export is off or the current span is unsampled.
#[derive(Debug, Clone, Copy, Default)]
pub struct TraceContextInjector;

impl tonic::service::Interceptor for TraceContextInjector {
    fn call(
        &mut self,
        mut request: tonic::Request<()>,
    ) -> Result<tonic::Request<()>, tonic::Status> {
        if let Some(span_context) = sampled(&tracing::Span::current()) {
            inject(&span_context, request.metadata_mut());
        }
        Ok(request)
    }
}

/// Writes `span_context` as `traceparent` / `tracestate` metadata.
pub fn inject(span_context: &SpanContext, metadata: &mut tonic::metadata::MetadataMap) {
    struct Metadata<'a>(&'a mut tonic::metadata::MetadataMap);
    impl Injector for Metadata<'_> {
        fn set(&mut self, key: &str, value: String) {
            if let (Ok(key), Ok(value)) = (
                tonic::metadata::MetadataKey::from_bytes(key.as_bytes()),
                value.parse(),
            ) {
                self.0.insert(key, value);
            }
        }
    }
    let cx = opentelemetry::Context::new().with_remote_span_context(span_context.clone());
    TraceContextPropagator::new().inject_context(&cx, &mut Metadata(metadata));
}

/// Opens a server span, child of the caller's, for every call carrying a sampled context
/// (see the module doc).
#[derive(Debug, Clone, Copy, Default)]
pub struct TraceContextLayer;

impl<S> Layer<S> for TraceContextLayer {
    type Service = TraceContextService<S>;

    fn layer(&self, inner: S) -> TraceContextService<S> {
        TraceContextService { inner }
    }
}

/// The service [`TraceContextLayer`] wraps around the server's routes.
#[derive(Debug, Clone)]
pub struct TraceContextService<S> {
    inner: S,
}

impl<S, RequestBody> Service<http::Request<RequestBody>> for TraceContextService<S>
where
    S: Service<http::Request<RequestBody>>,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = Instrumented<S::Future>;

    fn poll_ready(&mut self, cx: &mut TaskContext<'_>) -> Poll<Result<(), S::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, mut request: http::Request<RequestBody>) -> Self::Future {
        let span = server_span(&request);
        if !span.is_none() {
            request.extensions_mut().insert(CallSpan(span.clone()));
        }
        self.inner.call(request).instrument(span)
    }
}

/// The server span of a call carrying a sampled context, else a disabled span.
fn server_span<B>(request: &http::Request<B>) -> tracing::Span {
    if !enabled() {
        return tracing::Span::none();
    }
    let header = |name: &str| {
        request
            .headers()
            .get(name)
            .and_then(|value| value.to_str().ok())
    };
    let Some(parent) = header(TRACEPARENT).and_then(|tp| sampled_context(tp, header(TRACESTATE)))
    else {
        return tracing::Span::none();
    };
    // `/package.Service/Method`
    let path = request.uri().path().trim_start_matches('/');
    let (service, method) = path.split_once('/').unwrap_or((path, ""));
    let span = tracing::info_span!(
        target: "eventmesh::grpc",
        "grpc",
        otel.name = path,
        otel.kind = "server",
        rpc.system = "grpc",
        rpc.service = service,
        rpc.method = method,
    );
    let _ = span.set_parent(opentelemetry::Context::new().with_remote_span_context(parent));
    span
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    const SAMPLED: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
    const UNSAMPLED: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-00";

    #[test]
    fn only_sampled_well_formed_contexts_are_taken() {
        let cx = sampled_context(SAMPLED, None).unwrap();
        assert_eq!(
            cx.trace_id().to_string(),
            "4bf92f3577b34da6a3ce929d0e0e4736"
        );
        assert_eq!(traceparent(&cx), SAMPLED);
        assert!(sampled_context(UNSAMPLED, None).is_none());
        for bad in [
            "",
            "garbage",
            "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7",
        ] {
            assert!(sampled_context(bad, None).is_none(), "{bad:?}");
        }
    }

    #[test]
    fn nothing_is_parsed_while_export_is_off() {
        // `enable` is never called in this test binary.
        assert!(!enabled());
        assert!(EventTrace::parse(SAMPLED).is_none());
    }

    #[test]
    fn injected_metadata_carries_the_context() {
        let cx = sampled_context(SAMPLED, Some("vendor=1")).unwrap();
        let mut metadata = tonic::metadata::MetadataMap::new();
        inject(&cx, &mut metadata);
        assert_eq!(
            metadata.get(TRACEPARENT).unwrap().to_str().unwrap(),
            SAMPLED
        );
        assert_eq!(
            metadata.get(TRACESTATE).unwrap().to_str().unwrap(),
            "vendor=1"
        );
    }
}

//! The SDK's part in a trace (the `otel` feature). An event's trace context is its
//! `traceparent` attribute (W3C text; the CloudEvents distributed-tracing extension), kept in
//! the MQ with the event and handed back with every [`Delivery`]. With the feature:
//!
//! * every call the SDK makes carries the calling span's context as `traceparent` /
//!   `tracestate` gRPC metadata — the interceptor the services use
//!   (`eventmesh_common::trace_context`);
//! * [`Client::publish_with_key`](crate::Client::publish_with_key) opens `publish <topic>`
//!   (producer, `send`), a child of the application's current span, and
//!   [`Client::publish_batch`](crate::Client::publish_batch) one such span for the batch
//!   (`messaging.batch.message_count`); [`Publisher::submit`](crate::Publisher::submit) opens
//!   `create <topic>` (producer, `create`) per event. Each gives its context to the events
//!   that carry none, so their hops in the runtime and at the consumer join the producer's
//!   trace;
//! * a delivery taken from [`Subscription::next`](crate::Subscription::next) opens
//!   `receive <topic>` (consumer, `receive`), a child of the event's context;
//!   [`Delivery::context`] is that span's context, for the application's processing span;
//! * an ACK or NACK opens `ack <topic>` / `nack <topic>` (client, `settle`), a child of the
//!   receive span; for [`Delivery::ack_and_wait`] it lasts until the outcome arrives.
//!
//! The spans are `tracing` spans (target `eventmesh::messaging`, level INFO) with the
//! OpenTelemetry messaging attributes; the application exports them with its own
//! `tracing-opentelemetry` layer (opentelemetry 0.33, tracing-opentelemetry 0.34) and its
//! sampler decides: an unsampled span gives no event a context and no delivery a span.
//! Without the feature this module is empty shims: no span, no metadata, no cost.

use eventmesh_proto::client as pb;
use tonic::transport::Channel;

use crate::subscription::Delivery;

#[cfg(feature = "otel")]
pub(crate) use traced::*;
#[cfg(not(feature = "otel"))]
pub(crate) use untraced::*;

#[cfg(feature = "otel")]
mod traced {
    use eventmesh_common::trace_context::{self, EventTrace, Operation};

    use super::*;

    /// The channel every SDK call goes over: it carries the caller's trace context.
    pub(crate) type SdkChannel = eventmesh_common::grpc::InternalChannel;

    /// What a delivery keeps of its trace: the receive span's context, when sampled.
    pub(crate) type DeliveryTrace = Option<Box<EventTrace>>;

    pub(crate) fn traced(channel: Channel) -> SdkChannel {
        eventmesh_common::grpc::traced(channel)
    }

    /// Turns the trace work on: the application that enables the feature exports spans.
    pub(crate) fn enable() {
        trace_context::enable();
    }

    /// The span of one publish call of `count` events to `topic`, child of the current span.
    pub(crate) fn publish_span(topic: &str, count: usize) -> tracing::Span {
        let span = trace_context::messaging_span(
            Operation::SDK_PUBLISH,
            topic,
            tracing::Span::current().id(),
        );
        if count != 1 {
            span.record("messaging.batch.message_count", count as u64);
        }
        span
    }

    /// The creation span of one event queued in a [`crate::Publisher`].
    pub(crate) fn create_span(topic: &str, event: &pb::Event) -> tracing::Span {
        let span = trace_context::messaging_span(
            Operation::SDK_CREATE,
            topic,
            tracing::Span::current().id(),
        );
        span.record("messaging.message.id", event.id.as_str());
        span
    }

    /// Gives `span`'s context (when sampled) to the events that carry none.
    pub(crate) fn stamp<'a>(
        span: &tracing::Span,
        events: impl IntoIterator<Item = &'a mut pb::Event>,
    ) {
        if let Some(traceparent) = trace_context::sampled_traceparent(span) {
            events
                .into_iter()
                .for_each(|event| event.carry_traceparent(&traceparent));
        }
    }

    /// Opens the receive span of a delivery the application takes, and keeps its context.
    pub(crate) fn received(delivery: &mut Delivery) {
        let Some(event) = delivery.traceparent().and_then(EventTrace::parse) else {
            return;
        };
        let span = event.span(Operation::RECEIVE, &delivery.topic);
        record_delivery(&span, delivery);
        span.record(
            "messaging.destination.partition.id",
            delivery.partition.as_str(),
        );
        span.record("eventmesh.offset", delivery.offset);
        delivery.trace = EventTrace::of(&span);
    }

    /// The settle span (`ack` or `nack`) of a delivery, child of its receive span.
    pub(crate) fn settle_span(delivery: &Delivery, nack: bool) -> tracing::Span {
        let Some(receive) = delivery.trace.as_deref() else {
            return tracing::Span::none();
        };
        let operation = if nack {
            Operation::SDK_NACK
        } else {
            Operation::SDK_ACK
        };
        let span = receive.span(operation, &delivery.topic);
        record_delivery(&span, delivery);
        span
    }

    fn record_delivery(span: &tracing::Span, delivery: &Delivery) {
        span.record("messaging.message.id", delivery.event.id.as_str());
        span.record("eventmesh.delivery.attempt", delivery.attempt);
    }

    impl Delivery {
        /// The OpenTelemetry context of this delivery's `receive` span (an empty context when
        /// the event is not traced or not sampled): make the processing span its child, e.g.
        /// `span.set_parent(delivery.context())` with `tracing-opentelemetry`.
        pub fn context(&self) -> opentelemetry::Context {
            self.trace
                .as_deref()
                .map(EventTrace::context)
                .unwrap_or_default()
        }
    }
}

#[cfg(not(feature = "otel"))]
mod untraced {
    use super::*;

    pub(crate) type SdkChannel = Channel;
    pub(crate) type DeliveryTrace = ();

    pub(crate) fn traced(channel: Channel) -> SdkChannel {
        channel
    }

    pub(crate) fn enable() {}

    pub(crate) fn publish_span(_topic: &str, _count: usize) -> tracing::Span {
        tracing::Span::none()
    }

    pub(crate) fn create_span(_topic: &str, _event: &pb::Event) -> tracing::Span {
        tracing::Span::none()
    }

    pub(crate) fn stamp<'a>(
        _span: &tracing::Span,
        _events: impl IntoIterator<Item = &'a mut pb::Event>,
    ) {
    }

    pub(crate) fn received(_delivery: &mut Delivery) {}

    pub(crate) fn settle_span(_delivery: &Delivery, _nack: bool) -> tracing::Span {
        tracing::Span::none()
    }
}

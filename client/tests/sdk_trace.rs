//! The SDK's `otel` feature: an application that exports its own spans (here to the test's
//! OTLP endpoint, like the three service processes) sees one trace per event from its own
//! span through the runtime to its consumer's ACK.
//!
//! * `Client::publish` inside the application's span opens the SDK's `publish <topic>` span
//!   as its child, carries that context on the call (dispatcher-svc's server span of the call
//!   is its child: gRPC metadata) and gives it to the event (the consumer's `receive` continues it).
//! * `Publisher::submit` gives each event its own `create <topic>` span's context.
//! * Taking a delivery opens `receive <topic>`; `Delivery::context` is that span's context;
//!   `ack_and_wait` opens `ack <topic>` under it.

#![allow(clippy::unwrap_used)]

mod support;

use std::collections::HashMap;
use std::time::Duration;

use eventmesh_client::local::{LocalConfig, LocalInstance};
use eventmesh_client::{AckOutcome, Event, Publisher, PublisherOptions};
use opentelemetry::trace::{TraceContextExt as _, TracerProvider as _};
use opentelemetry_otlp::WithExportConfig as _;
use opentelemetry_sdk::Resource;
use opentelemetry_sdk::trace::SdkTracerProvider;
use support::otlp::{Collector, Exported, find, hex};
use support::*;
use tracing::Instrument as _;
use tracing_opentelemetry::OpenTelemetrySpanExt as _;
use tracing_subscriber::layer::SubscriberExt as _;
use tracing_subscriber::util::SubscriberInitExt as _;

const APP: &str = "sdk-trace-app";

fn event(id: &str) -> Event {
    Event {
        id: id.to_owned(),
        source: "/sdk-trace-test".into(),
        r#type: "trace.test".into(),
        data: bytes::Bytes::from_static(b"traced by the sdk"),
        ..Event::default()
    }
}

/// The trace id of a tracing span (as the application's layer exports it).
fn trace_of(span: &tracing::Span) -> String {
    span.context().span().span_context().trace_id().to_string()
}

/// The span of the application named `name` in `trace`.
fn app_span<'a>(spans: &'a [Exported], trace: &str, name: &str) -> Option<&'a Exported> {
    find(spans, trace, APP, name)
}

#[test]
fn the_sdk_continues_the_applications_trace_through_the_runtime() {
    let _serial = serial();
    let runtime = tokio::runtime::Runtime::new().unwrap();
    runtime.block_on(async {
        let collector = Collector::default();
        let endpoint = collector.serve().await;
        // What an application using the feature installs: its own exporter and layer.
        let exporter = opentelemetry_otlp::SpanExporter::builder()
            .with_tonic()
            .with_endpoint(format!("http://{endpoint}"))
            .build()
            .unwrap();
        let provider = SdkTracerProvider::builder()
            .with_batch_exporter(exporter)
            .with_resource(Resource::builder().with_service_name(APP).build())
            .build();
        tracing_subscriber::registry()
            .with(tracing_opentelemetry::layer().with_tracer(provider.tracer(APP)))
            .try_init()
            .unwrap();

        let dir = tempfile::tempdir().unwrap();
        let config = LocalConfig::new(dir.path())
            .env("OTEL_EXPORTER_OTLP_ENDPOINT", format!("http://{endpoint}"))
            .env("OTEL_BSP_SCHEDULE_DELAY", "100");
        let instance = LocalInstance::start(config).await.unwrap();
        let client = connect(&instance, "sdk-trace-consumer").await;
        let mut subscription = subscribe(&client).await;

        let checkout = tracing::info_span!("checkout");
        let published = client
            .publish(TOPIC, event("published"))
            .instrument(checkout.clone())
            .await
            .unwrap();
        let checkout_trace = trace_of(&checkout);
        let batch_job = tracing::info_span!("batch-job");
        let publisher = Publisher::new(client.clone(), TOPIC, PublisherOptions::default());
        publisher
            .submit("", event("submitted"))
            .instrument(batch_job.clone())
            .await
            .unwrap()
            .wait()
            .await
            .unwrap();
        let batch_trace = trace_of(&batch_job);
        assert_ne!(checkout_trace, batch_trace);
        drop((checkout, batch_job));

        let mut carried = HashMap::new();
        while carried.len() < 2 {
            let delivery = tokio::time::timeout(Duration::from_secs(30), subscription.next())
                .await
                .expect("two deliveries within 30 s")
                .unwrap()
                .unwrap();
            let receive = delivery.context();
            assert!(receive.span().span_context().is_sampled());
            assert_eq!(delivery.ack_and_wait().await.unwrap(), AckOutcome::Durable);
            carried.insert(
                delivery.event.id.clone(),
                (
                    delivery.traceparent().unwrap().to_owned(),
                    receive.span().span_context().span_id().to_string(),
                ),
            );
        }
        assert_eq!(published.event_id, "published");
        let flush = provider.clone();
        tokio::task::spawn_blocking(move || flush.force_flush())
            .await
            .unwrap()
            .unwrap();

        let topic = TOPIC;
        let spans = collector
            .wait_for("the SDK's and the runtime's spans", |spans| {
                app_span(spans, &checkout_trace, &format!("ack {topic}")).is_some()
                    && app_span(spans, &batch_trace, &format!("ack {topic}")).is_some()
                    && find(
                        spans,
                        &checkout_trace,
                        "dispatcher-svc",
                        &format!("ack {topic}"),
                    )
                    .is_some()
            })
            .await;

        // publish: the application's span → the SDK's → dispatcher-svc's (call metadata).
        let checkout = app_span(&spans, &checkout_trace, "checkout").unwrap();
        let sdk_publish = app_span(&spans, &checkout_trace, &format!("publish {topic}")).unwrap();
        assert_eq!(sdk_publish.span.parent_span_id, checkout.span.span_id);
        assert_eq!(
            sdk_publish.attribute("messaging.operation.type").as_deref(),
            Some("send")
        );
        assert_eq!(
            sdk_publish.attribute("messaging.message.id").as_deref(),
            Some("published")
        );
        let runtime_publish = find(
            &spans,
            &checkout_trace,
            "dispatcher-svc",
            &format!("publish {topic}"),
        )
        .unwrap();
        let call = find(
            &spans,
            &checkout_trace,
            "dispatcher-svc",
            "eventmesh.v1.EventMeshService/Publish",
        )
        .unwrap();
        assert_eq!(call.span.parent_span_id, sdk_publish.span.span_id);
        assert_eq!(runtime_publish.span.parent_span_id, call.span.span_id);
        // The event carries the SDK's publish span; the consumer's spans continue from it.
        let (traceparent, receive_id) = &carried["published"];
        assert_eq!(
            traceparent,
            &format!("00-{checkout_trace}-{}-01", hex(&sdk_publish.span.span_id))
        );
        let receive = app_span(&spans, &checkout_trace, &format!("receive {topic}")).unwrap();
        assert_eq!(&hex(&receive.span.span_id), receive_id);
        assert_eq!(receive.span.parent_span_id, sdk_publish.span.span_id);
        assert_eq!(
            receive.attribute("messaging.operation.type").as_deref(),
            Some("receive")
        );
        assert_eq!(
            receive.attribute("eventmesh.delivery.attempt").as_deref(),
            Some("1")
        );
        let ack = app_span(&spans, &checkout_trace, &format!("ack {topic}")).unwrap();
        assert_eq!(ack.span.parent_span_id, receive.span.span_id);
        assert_eq!(
            ack.attribute("messaging.operation.type").as_deref(),
            Some("settle")
        );
        for hop in ["deliver", "ack"] {
            assert!(
                find(
                    &spans,
                    &checkout_trace,
                    "dispatcher-svc",
                    &format!("{hop} {topic}")
                )
                .is_some(),
                "{hop}"
            );
        }

        // The batching publisher: one creation span per event, continued by the consumer.
        let create = app_span(&spans, &batch_trace, &format!("create {topic}")).unwrap();
        assert_eq!(
            create.attribute("messaging.message.id").as_deref(),
            Some("submitted")
        );
        let (traceparent, _) = &carried["submitted"];
        assert!(traceparent.contains(&hex(&create.span.span_id)));
        let receive = app_span(&spans, &batch_trace, &format!("receive {topic}")).unwrap();
        assert_eq!(receive.span.parent_span_id, create.span.span_id);

        subscription.close().await;
        drop(instance);
        let _ = tokio::task::spawn_blocking(move || provider.shutdown()).await;
    });
}

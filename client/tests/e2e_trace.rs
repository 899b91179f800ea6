//! One trace from publish to the offset write, across the three real processes, collected by
//! a real OTLP/gRPC endpoint: this test serves the OpenTelemetry trace collector service
//! (`opentelemetry.proto.collector.trace.v1.TraceService`) on loopback and points the
//! services' exporters at it with the standard `OTEL_*` variables.
//!
//! * An event published with a producer's sampled `traceparent` yields spans in that trace in
//!   every hop — dispatcher-svc `publish`, puller-svc's server span and `append`, puller-svc
//!   `pull`, dispatcher-svc `deliver` and `ack` — each with the messaging attributes, and a
//!   dispatcher-svc `commit` span (the offset write, many events at once) that *links* to the
//!   trace and whose own trace continues in offset-svc. The consumer sees the producer's
//!   `traceparent` on the delivery.
//! * An event published without one joins the dispatcher's publish span's trace (its delivery
//!   carries that context).
//! * An event whose producer did not sample it makes no span anywhere (parent-based sampling).
//!
//! * On `rocketmq5` (POP with a deferred broker ACK) the broker ACK is a `broker_ack` span that
//!   links to the event and whose trace continues in puller-svc's AckPulled. The local
//!   backend has no broker ACK.

#![allow(clippy::unwrap_used)]

mod support;

use std::collections::HashMap;
use std::time::Duration;

use eventmesh_client::local::{LocalConfig, LocalInstance, Service};
use eventmesh_client::{AckOutcome, Event, StartPosition, SubscribeOptions};
use support::otlp::{Collector, Exported, find, hex};
use support::*;

/// The producer's span of the traced event.
const PRODUCER_TRACE: &str = "4bf92f3577b34da6a3ce929d0e0e4736";
const PRODUCER_SPAN: &str = "00f067aa0ba902b7";
/// A producer that did not sample its trace.
const UNSAMPLED_TRACE: &str = "0af7651916cd43dd8448eb211c80319c";

fn event(id: &str, traceparent: Option<String>) -> Event {
    Event {
        id: id.to_owned(),
        source: "/trace-test".into(),
        r#type: "trace.test".into(),
        data: bytes::Bytes::from_static(b"traced"),
        attributes: traceparent
            .map(|tp| HashMap::from([("traceparent".to_owned(), tp)]))
            .unwrap_or_default(),
        ..Event::default()
    }
}

/// The dispatcher-svc span `name` (a batch) that links to the traced event and whose own
/// trace continues in `callee` (the call's server span is its child).
fn linked_batch<'a>(spans: &'a [Exported], name: &str, callee: &str) -> Option<&'a Exported> {
    spans
        .iter()
        .filter(|s| {
            s.service == "dispatcher-svc" && s.span.name == name && s.links_to(PRODUCER_TRACE)
        })
        .find(|batch| {
            spans.iter().any(|s| {
                s.service == callee
                    && s.span.trace_id == batch.span.trace_id
                    && s.span.parent_span_id == batch.span.span_id
            })
        })
}

/// Whether every hop of the traced event was exported (the broker ACK's too when the backend
/// has one).
fn hops_seen(spans: &[Exported], topic: &str, broker_ack: bool) -> bool {
    let in_trace = [
        ("dispatcher-svc", format!("publish {topic}")),
        (
            "puller-svc",
            "eventmesh.puller.v1.PullerService/Publish".to_owned(),
        ),
        ("puller-svc", format!("append {topic}")),
        ("puller-svc", format!("pull {topic}")),
        ("dispatcher-svc", format!("deliver {topic}")),
        ("dispatcher-svc", format!("ack {topic}")),
    ];
    let all_in_trace = in_trace
        .iter()
        .all(|(service, name)| find(spans, PRODUCER_TRACE, service, name).is_some());
    let commit = linked_batch(spans, &format!("commit {topic}"), "offset-svc");
    let acked =
        !broker_ack || linked_batch(spans, &format!("broker_ack {topic}"), "puller-svc").is_some();
    all_in_trace && commit.is_some() && acked
}

#[test]
fn one_event_is_one_trace_across_the_three_processes() {
    let dir = tempfile::tempdir().unwrap();
    one_trace(LocalConfig::new(dir.path()), TOPIC, false);
}

/// The same on `rocketmq5` (a real name server and broker): the broker ACK of the POPped
/// message is a `broker_ack` batch span linked to the event, continued in puller-svc.
#[test]
fn the_broker_ack_links_to_the_event_on_rocketmq5() {
    let rocketmq = eventmesh_testkit::RocketMq::get();
    let dir = tempfile::tempdir().unwrap();
    let config = LocalConfig::new(dir.path()).args(
        Service::Puller,
        [
            "--backend",
            "rocketmq5",
            "--rocketmq-namesrv",
            rocketmq.namesrv(),
            "--auto-create-topics",
            "true",
        ],
    );
    one_trace(config, &format!("em-trace-{}", std::process::id()), true);
}

fn one_trace(config: LocalConfig, topic: &str, broker_ack: bool) {
    let _serial = serial();
    let runtime = tokio::runtime::Runtime::new().unwrap();
    runtime.block_on(async {
        let collector = Collector::default();
        let endpoint = collector.serve().await;
        let config = config
            .env("OTEL_EXPORTER_OTLP_ENDPOINT", format!("http://{endpoint}"))
            .env("OTEL_BSP_SCHEDULE_DELAY", "100");
        let instance = LocalInstance::start(config).await.unwrap();
        let client = connect(&instance, "trace-consumer").await;

        let traced = format!("00-{PRODUCER_TRACE}-{PRODUCER_SPAN}-01");
        let unsampled = format!("00-{UNSAMPLED_TRACE}-{PRODUCER_SPAN}-00");
        client
            .publish(topic, event("traced", Some(traced.clone())))
            .await
            .unwrap();
        client
            .publish(topic, event("unsampled", Some(unsampled.clone())))
            .await
            .unwrap();
        client
            .publish(topic, event("untraced", None))
            .await
            .unwrap();

        // Subscribed after publishing: on RocketMQ the topic exists (auto-created) only then.
        let mut subscription = client
            .subscribe(
                SubscribeOptions::new(topic)
                    .group(GROUP)
                    .start(StartPosition::Earliest),
            )
            .await
            .unwrap();
        let mut carried = HashMap::new();
        while carried.len() < 3 {
            let delivery = tokio::time::timeout(Duration::from_secs(30), subscription.next())
                .await
                .expect("three deliveries within 30 s")
                .unwrap()
                .unwrap();
            assert_eq!(delivery.ack_and_wait().await.unwrap(), AckOutcome::Durable);
            carried.insert(
                delivery.event.id.clone(),
                delivery.traceparent().map(str::to_owned),
            );
        }
        // The consumer continues the producer's trace; an untraced event got the publish's.
        assert_eq!(carried["traced"].as_deref(), Some(traced.as_str()));
        assert_eq!(carried["unsampled"].as_deref(), Some(unsampled.as_str()));
        let stamped = carried["untraced"]
            .clone()
            .expect("the publish span's context");

        let spans = collector
            .wait_for("every hop of the traced event", |spans| {
                hops_seen(spans, topic, broker_ack)
            })
            .await;
        let publish = find(
            &spans,
            PRODUCER_TRACE,
            "dispatcher-svc",
            &format!("publish {topic}"),
        )
        .unwrap();
        assert_eq!(hex(&publish.span.parent_span_id), PRODUCER_SPAN);
        for (service, name, operation_type) in [
            ("dispatcher-svc", "publish", "send"),
            ("puller-svc", "append", "send"),
            ("puller-svc", "pull", "receive"),
            ("dispatcher-svc", "deliver", "process"),
            ("dispatcher-svc", "ack", "settle"),
        ] {
            let span = find(&spans, PRODUCER_TRACE, service, &format!("{name} {topic}")).unwrap();
            assert_eq!(
                span.attribute("messaging.system").as_deref(),
                Some("eventmesh")
            );
            assert_eq!(
                span.attribute("messaging.operation.type").as_deref(),
                Some(operation_type),
                "{name}"
            );
            assert_eq!(
                span.attribute("messaging.operation.name").as_deref(),
                Some(name)
            );
            assert_eq!(
                span.attribute("messaging.destination.name").as_deref(),
                Some(topic),
                "{name}"
            );
        }
        let pull = find(
            &spans,
            PRODUCER_TRACE,
            "puller-svc",
            &format!("pull {topic}"),
        )
        .unwrap();
        assert_eq!(
            pull.attribute("messaging.message.id").as_deref(),
            Some("traced")
        );
        assert!(
            pull.attribute("messaging.destination.partition.id")
                .is_some()
        );
        assert!(pull.attribute("eventmesh.offset").is_some());
        for name in ["deliver", "ack"] {
            let span = find(
                &spans,
                PRODUCER_TRACE,
                "dispatcher-svc",
                &format!("{name} {topic}"),
            )
            .unwrap();
            assert_eq!(
                span.attribute("messaging.consumer.group.name").as_deref(),
                Some(GROUP)
            );
            assert_eq!(
                span.attribute("messaging.client.id").as_deref(),
                Some("trace-consumer")
            );
            assert_eq!(
                span.attribute("eventmesh.delivery.attempt").as_deref(),
                Some("1")
            );
        }
        let mut batches = vec![linked_batch(
            &spans,
            &format!("commit {topic}"),
            "offset-svc",
        )];
        if broker_ack {
            batches.push(linked_batch(
                &spans,
                &format!("broker_ack {topic}"),
                "puller-svc",
            ));
        }
        for batch in batches {
            let batch = batch.unwrap();
            assert_ne!(
                batch.trace_id(),
                PRODUCER_TRACE,
                "a batch span is linked, not parented"
            );
            assert_eq!(
                batch.attribute("messaging.operation.type").as_deref(),
                Some("settle")
            );
            let settled = batch.attribute("messaging.batch.message_count");
            assert!(
                settled.as_deref().and_then(|n| n.parse::<u64>().ok()) >= Some(1),
                "a batch span counts what it settled: {settled:?}"
            );
        }

        // The untraced event joined the dispatcher's publish trace, which reached the puller.
        let stamped_trace = stamped.split('-').nth(1).unwrap().to_owned();
        let spans = collector
            .wait_for(
                "the hops of the event published without a context",
                |spans| {
                    find(
                        spans,
                        &stamped_trace,
                        "puller-svc",
                        &format!("pull {topic}"),
                    )
                    .is_some()
                },
            )
            .await;
        let root = find(
            &spans,
            &stamped_trace,
            "dispatcher-svc",
            &format!("publish {topic}"),
        )
        .unwrap();
        assert!(
            root.span.parent_span_id.is_empty(),
            "the publish span starts the trace"
        );
        // The unsampled producer's event made no span in any process.
        assert!(
            spans.iter().all(|s| s.trace_id() != UNSAMPLED_TRACE),
            "an unsampled event was traced"
        );
        subscription.close().await;
        drop(instance);
    });
}

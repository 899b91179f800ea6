//! Frozen neighbours (issue 10, item 6): a SIGSTOPped service keeps its sockets open and
//! answers nothing, so only deadlines and HTTP/2 keepalive on the internal calls can tell. Each
//! is noticed within a bounded time, exactly as a dead one is, and the instance recovers after
//! SIGCONT. (A frozen dispatcher, as the SDK sees it, is `sdk.rs`'s keepalive test.)

#![allow(clippy::unwrap_used)]

mod support;

use std::time::{Duration, Instant};

use eventmesh_client::local::{LocalConfig, LocalInstance, Service};
use eventmesh_client::{Event, StartPosition, SubscribeOptions};
use eventmesh_proto::client::event_mesh_service_client::EventMeshServiceClient;
use support::*;
use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::health_client::HealthClient;

/// How long a frozen neighbour may go unnoticed: the 2 s call deadline these tests configure,
/// or keepalive (1 s + 2 s), plus scheduling slack on a loaded 2-core machine.
const NOTICED_WITHIN: Duration = Duration::from_secs(15);

async fn instance(dir: &std::path::Path) -> LocalInstance {
    LocalInstance::start(
        LocalConfig::new(dir)
            .args(Service::Dispatcher, ["--dependency-timeout-ms", "2000"])
            .args(Service::Puller, ["--dependency-timeout-ms", "2000"]),
    )
    .await
    .unwrap()
}

fn event(n: u64) -> Event {
    Event {
        id: event_id(n),
        source: "/frozen".into(),
        r#type: "frozen.test".into(),
        data: format!("{n}").into_bytes().into(),
        ..Event::default()
    }
}

async fn readiness(instance: &LocalInstance) -> ServingStatus {
    let channel = tonic::transport::Endpoint::from_shared(instance.endpoint())
        .unwrap()
        .connect()
        .await
        .unwrap();
    let mut health = HealthClient::new(channel);
    let answer = tokio::time::timeout(
        Duration::from_secs(5),
        health.check(tonic_health::pb::HealthCheckRequest {
            service: "readiness".into(),
        }),
    )
    .await
    .expect("the dispatcher itself answers")
    .unwrap();
    answer.into_inner().status()
}

async fn until(what: &str, since: Instant, mut done: impl AsyncFnMut() -> bool) -> Duration {
    while !done().await {
        assert!(
            since.elapsed() < NOTICED_WITHIN,
            "{what}: not within {NOTICED_WITHIN:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    since.elapsed()
}

/// A frozen offset-svc: ACKs answer PENDING and readiness goes NOT_SERVING within the bound,
/// as for a dead one; after SIGCONT the ACKs become DURABLE and readiness comes back.
/// Without deadlines the offset write hung on the open socket: no PENDING, readiness on.
#[tokio::test]
async fn a_frozen_offset_svc_is_noticed_like_a_dead_one() {
    let dir = tempfile::tempdir().unwrap();
    let instance = instance(dir.path()).await;
    let client = connect(&instance, "frozen-offsets").await;
    for n in 0..10 {
        client.publish("frozen-o", event(n)).await.unwrap();
    }
    let mut subscription = client
        .subscribe(
            SubscribeOptions::new("frozen-o")
                .group("g")
                .start(StartPosition::Earliest),
        )
        .await
        .unwrap();
    let held = take_deliveries(&mut subscription, 10).await;
    assert_eq!(readiness(&instance).await, ServingStatus::Serving);

    instance.signal(Service::Offset, "STOP").unwrap();
    let frozen_at = Instant::now();
    for delivery in &held {
        delivery.ack();
    }
    let pending = until("ACKs answered PENDING", frozen_at, async || {
        subscription.stats().pending > 0
    })
    .await;
    let not_ready = until("readiness NOT_SERVING", frozen_at, async || {
        readiness(&instance).await == ServingStatus::NotServing
    })
    .await;
    assert_eq!(
        subscription.stats().durable,
        0,
        "nothing durable while frozen"
    );
    eprintln!("frozen offset-svc: PENDING after {pending:?}, NOT_SERVING after {not_ready:?}");

    // The puller cannot align a reader either: its call fails within the bound, not never.
    let mut puller = eventmesh_proto::puller::puller_service_client::PullerServiceClient::connect(
        instance.uri(Service::Puller),
    )
    .await
    .unwrap();
    let asked = Instant::now();
    let refused = puller
        .attach(eventmesh_proto::puller::AttachRequest {
            dispatcher_id: "probe".into(),
            readers: vec![eventmesh_proto::puller::GroupTopic {
                group: "probe".into(),
                topic: "frozen-o".into(),
            }],
            positions: Vec::new(),
        })
        .await
        .unwrap_err();
    assert_eq!(refused.code(), tonic::Code::Unavailable, "{refused}");
    assert!(asked.elapsed() < NOTICED_WITHIN, "{:?}", asked.elapsed());

    instance.signal(Service::Offset, "CONT").unwrap();
    let thawed_at = Instant::now();
    until("every ACK DURABLE", thawed_at, async || {
        subscription.stats().durable >= 10
    })
    .await;
    until("readiness SERVING", thawed_at, async || {
        readiness(&instance).await == ServingStatus::Serving
    })
    .await;
    subscription.close().await;
    instance.stop(Duration::from_secs(10)).await;
}

/// A frozen puller-svc: a publish fails with UNAVAILABLE within the bound instead of hanging
/// (the SDK then retries elsewhere or reports it), and after SIGCONT publishing and delivery
/// go on.
#[tokio::test]
async fn a_frozen_puller_fails_publishes_fast_and_recovers() {
    let dir = tempfile::tempdir().unwrap();
    let instance = instance(dir.path()).await;
    let client = connect(&instance, "frozen-puller").await;
    client.publish("frozen-p", event(0)).await.unwrap();
    let mut subscription = client
        .subscribe(
            SubscribeOptions::new("frozen-p")
                .group("g")
                .start(StartPosition::Earliest),
        )
        .await
        .unwrap();
    let first = tokio::time::timeout(Duration::from_secs(20), subscription.next())
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    first.ack();

    instance.signal(Service::Puller, "STOP").unwrap();
    let mut raw = EventMeshServiceClient::connect(instance.endpoint())
        .await
        .unwrap();
    let asked = Instant::now();
    let refused = raw
        .publish(eventmesh_proto::client::PublishRequest {
            topic: "frozen-p".into(),
            event: Some(event(1)),
            key: String::new(),
        })
        .await
        .unwrap_err();
    let took = asked.elapsed();
    assert_eq!(refused.code(), tonic::Code::Unavailable, "{refused}");
    assert!(took < NOTICED_WITHIN, "{took:?}");
    eprintln!("frozen puller-svc: publish refused after {took:?}");

    instance.signal(Service::Puller, "CONT").unwrap();
    client.publish("frozen-p", event(2)).await.unwrap();
    // The refused publish was still in the frozen puller's socket, so it may be written after
    // all: always as the same event (same id), which the client's retry would have carried
    // too — the rule for a publish answered as failed (DECISIONS.md).
    loop {
        let next = tokio::time::timeout(Duration::from_secs(30), subscription.next())
            .await
            .unwrap()
            .unwrap()
            .unwrap();
        next.ack();
        if next.event.id == event_id(2) {
            break;
        }
        assert_eq!(
            next.event.id,
            event_id(1),
            "only the refused event can come first"
        );
    }
    subscription.close().await;
    instance.stop(Duration::from_secs(10)).await;
}

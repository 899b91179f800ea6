//! The reference's AckTimeoutRedeliveryIntegrationTest on a real Kafka-compatible broker
//! (tansu on loopback, started by `scripts/kafka.sh`, or the one in `KAFKA_BOOTSTRAP`): with an
//! ACK timeout of 3 s and 3 attempts, a subscriber that never ACKs gets the event at least
//! twice, and then it is readable from `<topic>_DLQ`.

#![allow(clippy::unwrap_used)]

mod support;

use std::sync::Arc;
use std::time::Duration;

use eventmesh_common::dead_letter::DeadLetter;
use eventmesh_proto::client::SubscriptionMode;
use eventmesh_testkit::KafkaBroker as Broker;
use puller_svc::cursors::StartAt;
use puller_svc::storage::Storage;
use puller_svc::storage::kafka::KafkaStorage;
use support::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unacked_event_is_redelivered_then_dead_lettered_on_kafka() {
    let broker = Broker::get();
    let dir = tempfile::tempdir().unwrap();
    let offset_svc =
        start_offset_svc(&dir.path().join("offsets"), "127.0.0.1:0".parse().unwrap()).await;
    let storage: Arc<dyn Storage> = Arc::new(
        KafkaStorage::new(
            broker.bootstrap(),
            dir.path().join("puller"),
            StartAt::Earliest,
        )
        .unwrap(),
    );
    let puller = start_puller_over(storage, offset_svc.local_addr(), 1).await;
    let settings = dispatcher_svc::config::DeliverySettings {
        ack_timeout_ms: 3_000,
        max_attempts: 3,
        backoff_base_ms: 100,
        backoff_max_ms: 200,
        ..dispatcher_svc::config::DeliverySettings::default()
    };
    let (dispatcher, _shared) =
        start_dispatcher(puller.local_addr(), offset_svc.local_addr(), settings).await;
    let topic = format!("redelivery-{}", std::process::id());
    let mut client =
        eventmesh_proto::client::event_mesh_service_client::EventMeshServiceClient::new(lazy(
            dispatcher.local_addr(),
        ));
    let mut session = subscribe(
        dispatcher.local_addr(),
        open("never-acks", &topic, "", SubscriptionMode::LoadBalance),
    )
    .await;
    publish(&mut client, &topic, 0..1).await;
    let attempts = session.deliveries(3, Duration::from_secs(30)).await;
    assert!(attempts.len() >= 2, "delivered {} times", attempts.len());
    assert!(
        attempts
            .iter()
            .all(|d| d.delivery_id == attempts[0].delivery_id)
    );
    assert_eq!(
        attempts.iter().map(|d| d.attempt).collect::<Vec<_>>()[..2],
        [1, 2]
    );

    let dlq = format!("{topic}_DLQ");
    let mut letters = Vec::new();
    let mut reader = TopicReader::new(puller.local_addr(), "dlq-reader", &dlq);
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    while letters.is_empty() && tokio::time::Instant::now() < deadline {
        if let Ok(batch) = reader.pull(500).await {
            letters.extend(batch);
        } else {
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }
    assert_eq!(letters.len(), 1, "one dead letter in {dlq}");
    let letter = DeadLetter::decode(&letters[0].frame).unwrap().unwrap();
    assert_eq!(letter.attempts, 3);
    assert_eq!(letter.topic, topic);
    assert!(letter.reason.contains("ACK timeout"), "{}", letter.reason);
    dispatcher.shutdown();
    dispatcher.wait().await.unwrap();
}

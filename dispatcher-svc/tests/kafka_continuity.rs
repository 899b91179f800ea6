//! A Kafka topic deleted and created again under the same name, on a real broker (tansu):
//! its offsets restart at 0, below the group's stored position. Before issue 10 the new events
//! were dropped as "below the watermark" (or the reader was reset without a word); now the
//! group rewinds the partition to its log start — its session is told to reconnect, its
//! watermark is reset — and the new events are delivered.
//!
//! The topic is recreated while the services are down: librdkafka 2.12 crashes on tansu 0.6's
//! metadata answer for a deleted topic it had cached, which a live puller would be.

#![allow(clippy::unwrap_used)]

mod support;

use std::sync::Arc;
use std::time::Duration;

use eventmesh_proto::client::SubscriptionMode;
use eventmesh_testkit::KafkaBroker;
use puller_svc::cursors::StartAt;
use puller_svc::storage::Storage;
use puller_svc::storage::kafka::KafkaStorage;
use rdkafka::config::ClientConfig;
use support::*;

const LB: SubscriptionMode = SubscriptionMode::LoadBalance;

async fn services(
    bootstrap: &str,
    dir: &std::path::Path,
    offsets: std::net::SocketAddr,
) -> (
    Arc<dyn Storage>,
    puller_svc::server::RunningServer,
    dispatcher_svc::server::RunningServer,
) {
    let storage: Arc<dyn Storage> =
        Arc::new(KafkaStorage::new(bootstrap, dir.join("puller"), StartAt::Earliest).unwrap());
    let puller = start_puller_over(Arc::clone(&storage), offsets, 1).await;
    let (dispatcher, _) = start_dispatcher(puller.local_addr(), offsets, fast_settings()).await;
    (storage, puller, dispatcher)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_recreated_topic_rewinds_the_group_and_its_new_events_are_delivered() {
    let broker = KafkaBroker::get();
    let dir = tempfile::tempdir().unwrap();
    let offset_svc =
        start_offset_svc(&dir.path().join("offsets"), "127.0.0.1:0".parse().unwrap()).await;
    let offsets = offset_svc.local_addr();
    let topic = format!("recreated-{}", std::process::id());

    let (storage, puller, dispatcher) = services(broker.bootstrap(), dir.path(), offsets).await;
    let mut client =
        eventmesh_proto::client::event_mesh_service_client::EventMeshServiceClient::new(lazy(
            dispatcher.local_addr(),
        ));
    publish(&mut client, &topic, 0..6).await;
    let mut session = subscribe(dispatcher.local_addr(), open("app", &topic, "g", LB)).await;
    let old = session.deliveries(6, Duration::from_secs(20)).await;
    assert_eq!(old.len(), 6);
    session.ack_durably(&old).await;
    drop(session);
    dispatcher.shutdown();
    dispatcher.wait().await.unwrap();
    puller.shutdown();
    puller.wait().await.unwrap();
    drop(storage);
    assert_eq!(
        stored_offsets(offsets, &topic, "__mqcursor@g__")
            .await
            .get("0"),
        Some(&5)
    );

    // Deleted and created again while the services are down.
    {
        let admin: rdkafka::admin::AdminClient<rdkafka::client::DefaultClientContext> =
            ClientConfig::new()
                .set("bootstrap.servers", broker.bootstrap())
                .create()
                .unwrap();
        admin
            .delete_topics(&[topic.as_str()], &rdkafka::admin::AdminOptions::new())
            .await
            .unwrap();
    }
    let (_storage, _puller, dispatcher) = services(broker.bootstrap(), dir.path(), offsets).await;
    let mut client =
        eventmesh_proto::client::event_mesh_service_client::EventMeshServiceClient::new(lazy(
            dispatcher.local_addr(),
        ));
    publish(&mut client, &topic, 100..102).await;

    // The group resumes at offset 6, finds the log ends at 2, and restarts the partition.
    let mut first = subscribe(dispatcher.local_addr(), open("app", &topic, "g", LB)).await;
    let ended = tokio::time::timeout(Duration::from_secs(20), async {
        loop {
            match first.rx.message().await {
                Ok(Some(message)) => {
                    assert!(
                        !message.into_items().iter().any(|item| matches!(
                            item,
                            eventmesh_proto::SubscribeItem::Delivery(_)
                        )),
                        "nothing is delivered from past the end"
                    );
                }
                Ok(None) => return None,
                Err(status) => return Some(status),
            }
        }
    })
    .await
    .expect("the group restarts its session")
    .expect("with a status");
    assert_eq!(ended.code(), tonic::Code::Unavailable);
    assert!(ended.message().contains("restarts"), "{}", ended.message());
    let mut again = None;
    for _ in 0..50 {
        if stored_offsets(offsets, &topic, "__mqcursor@g__")
            .await
            .get("0")
            == Some(&-1)
        {
            again = Some(subscribe(dispatcher.local_addr(), open("app", &topic, "g", LB)).await);
            break;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let mut again = again.expect("the group's watermark is rewound to the log start");
    let new = again.deliveries(2, Duration::from_secs(20)).await;
    assert_eq!(
        new.iter().map(number).collect::<Vec<_>>(),
        [100, 101],
        "the new events are delivered, not dropped as settled"
    );
    again.ack_durably(&new).await;
    dispatcher.shutdown();
    dispatcher.wait().await.unwrap();
}

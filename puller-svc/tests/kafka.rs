//! The `kafka` backend against a real Kafka-compatible broker (tansu on loopback, started by
//! `scripts/kafka.sh` unless `KAFKA_BOOTSTRAP` names one). One test runs the scenarios in
//! sequence so exactly one broker is started and stopped.

#![allow(clippy::unwrap_used)] // tests: a failed unwrap is a failed test

mod support;

use support::{event, ids, limits, poll_n, reader};

use std::time::Duration;

use bytes::Bytes;
use eventmesh_common::frame::{Frame, FrameLimits};
use eventmesh_common::keys::{PartitionId, Topic};
use eventmesh_testkit::KafkaBroker as Broker;
use puller_svc::cursors::{Alignment, StartAt};
use puller_svc::ingest::BodyKind;
use puller_svc::storage::kafka::KafkaStorage;
use puller_svc::storage::{Selection, Storage, StorageError};
use rdkafka::config::ClientConfig;
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::message::{Header, OwnedHeaders};
use rdkafka::producer::{FutureProducer, FutureRecord};
use rdkafka::{Offset, TopicPartitionList};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kafka_backend_against_a_real_broker() {
    let broker = Broker::get();
    stamps_foreign_bodies_and_checkpoints(broker.bootstrap()).await;
    groups_are_independent_and_alignment_repulls(broker.bootstrap()).await;
    unknown_topics_and_lite_are_clear_errors(broker.bootstrap()).await;
    one_partition_at_a_time_drops_nothing(broker.bootstrap()).await;
    publish_and_pull_through_the_grpc_service(broker.bootstrap()).await;
    fidelity_with_other_producers(broker.bootstrap()).await;
    a_recreated_topic_is_reported_past_the_end(broker.bootstrap()).await;
    a_frozen_broker_is_unavailable_then_recovers().await;
}

/// Issue 10, item 10, against the broker: what other producers and consumers of the topic see
/// and write is kept as it is.
async fn fidelity_with_other_producers(bootstrap: &str) {
    let dir = tempfile::tempdir().unwrap();
    let storage = KafkaStorage::new(bootstrap, dir.path(), StartAt::Earliest).unwrap();
    // A publish to a topic that does not exist fails at once, and nothing of it is written
    // later (librdkafka used to queue it for minutes and write it once a subscriber created
    // the topic).
    let late = Topic::new("em-kafka-never-queued").unwrap();
    let started = std::time::Instant::now();
    let err = storage
        .send(&late, Bytes::new(), event("lost?"), None)
        .await
        .unwrap_err();
    assert!(matches!(err, StorageError::UnknownTopic(_)), "{err}");
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "{:?}",
        started.elapsed()
    );
    storage.create_topic(&late, 1).await.unwrap();
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert_eq!(
        storage.end_offsets(&late).await.unwrap()[0].end,
        0,
        "the refused publish never appears"
    );
    // Keys land where the Java producer puts them (murmur2, not librdkafka's CRC32).
    let keyed = Topic::new("em-kafka-keyed").unwrap();
    storage.create_topic(&keyed, 3).await.unwrap();
    for (key, java_partition) in [("21", 0), ("kafka", 1), ("a-little-bit-long-string", 2)] {
        let sent = storage
            .send(&keyed, Bytes::from(key), event(key), None)
            .await
            .unwrap();
        assert_eq!(
            sent.partition,
            PartitionId::number(java_partition),
            "key {key}"
        );
    }
    // A foreign record: its key, its header bytes, and a stable id reach the dispatcher.
    let foreign = Topic::new("em-kafka-foreign").unwrap();
    storage.create_topic(&foreign, 1).await.unwrap();
    let producer: FutureProducer = ClientConfig::new()
        .set("bootstrap.servers", bootstrap)
        .create()
        .unwrap();
    producer
        .send(
            FutureRecord::<[u8], [u8]>::to(foreign.as_str())
                .key(&b"k-1"[..])
                .payload(&b"raw bytes"[..])
                .headers(
                    OwnedHeaders::new()
                        .insert(Header {
                            key: "sig",
                            value: Some(&[0xFF_u8, 0x00, 0x80][..]),
                        })
                        .insert(Header {
                            key: "tenant",
                            value: Some(&b"acme"[..]),
                        }),
                ),
            Duration::from_secs(10),
        )
        .await
        .unwrap();
    let batch = poll_n(&storage, &reader(None, &foreign), 1).await;
    let record = &batch.records[0];
    assert_eq!(&record.key[..], b"k-1");
    let frame = Frame::decode(&record.ingested.frame, &FrameLimits::STAMPED).unwrap();
    assert_eq!(frame.binary_attribute("sig").unwrap(), [0xFF, 0x00, 0x80]);
    assert_eq!(frame.attribute("tenant"), Some("acme"));
    assert_eq!(frame.attribute("id"), Some("em-kafka-foreign/0/0"));
    // Dead-letter topics do not expire with the broker's default retention; names Kafka
    // cannot hold are refused with the rule.
    let dead = Topic::new("em-kafka-foreign_DLQ").unwrap();
    storage.create_topic(&dead, 1).await.unwrap();
    let admin: rdkafka::admin::AdminClient<rdkafka::client::DefaultClientContext> =
        ClientConfig::new()
            .set("bootstrap.servers", bootstrap)
            .create()
            .unwrap();
    let configs = admin
        .describe_configs(
            [&rdkafka::admin::ResourceSpecifier::Topic(dead.as_str())],
            &rdkafka::admin::AdminOptions::new(),
        )
        .await
        .unwrap();
    let config = configs.into_iter().next().unwrap().unwrap();
    let retention = config
        .entries
        .iter()
        .find(|e| e.name == "retention.ms")
        .and_then(|e| e.value.clone());
    assert_eq!(retention.as_deref(), Some("-1"), "{:?}", config.entries);
    let err = storage
        .create_topic(&Topic::new("has space").unwrap(), 1)
        .await
        .unwrap_err();
    assert!(matches!(err, StorageError::Invalid(_)), "{err}");
    assert!(err.to_string().contains("[A-Za-z0-9._-]"), "{err}");
}

/// A topic deleted and created again under the same name restarts its offsets at 0, below the
/// reader's position: the puller reports the position past the end (it never moves it), so
/// the dispatcher can rewind the group instead of dropping the new events as settled. tansu
/// answers such a fetch with no records and no error; the high watermark of its answers
/// tells. (The topic is recreated while no client of this puller knows it: librdkafka 2.12
/// crashes on tansu 0.6's metadata answer for a deleted topic it had cached.)
async fn a_recreated_topic_is_reported_past_the_end(bootstrap: &str) {
    let dir = tempfile::tempdir().unwrap();
    let topic = Topic::new("em-kafka-recreated").unwrap();
    let group = reader(Some("g"), &topic);
    {
        let storage = KafkaStorage::new(bootstrap, dir.path(), StartAt::Earliest).unwrap();
        storage.create_topic(&topic, 1).await.unwrap();
        for i in 0..6 {
            storage
                .send(&topic, Bytes::new(), event(&format!("old{i}")), None)
                .await
                .unwrap();
        }
        assert_eq!(poll_n(&storage, &group, 6).await.records.len(), 6);
        storage.checkpoint().await.unwrap();
    }
    {
        let admin: rdkafka::admin::AdminClient<rdkafka::client::DefaultClientContext> =
            ClientConfig::new()
                .set("bootstrap.servers", bootstrap)
                .create()
                .unwrap();
        admin
            .delete_topics(&[topic.as_str()], &rdkafka::admin::AdminOptions::new())
            .await
            .unwrap();
    }
    let storage = KafkaStorage::new(bootstrap, dir.path(), StartAt::Earliest).unwrap();
    storage.create_topic(&topic, 1).await.unwrap();
    for i in 0..2 {
        storage
            .send(&topic, Bytes::new(), event(&format!("new{i}")), None)
            .await
            .unwrap();
    }
    let positioned = Selection::Positioned([(PartitionId::number(0), 6)].into());
    let mut reported = None;
    for _ in 0..100 {
        let batch = storage.poll(&group, &positioned, limits(10)).await.unwrap();
        assert!(batch.records.is_empty(), "nothing is read past the end");
        if let Some(past) = batch.past_end.into_iter().next() {
            reported = Some(past);
            break;
        }
    }
    let past = reported.expect("the position past the end is reported");
    assert_eq!((past.position, past.log_end), (6, 2), "{past:?}");
    assert_eq!(
        storage.cursors(&group).await.unwrap(),
        [(PartitionId::number(0), 6)],
        "reported, not moved"
    );
}

async fn stamps_foreign_bodies_and_checkpoints(bootstrap: &str) {
    let dir = tempfile::tempdir().unwrap();
    let storage = KafkaStorage::new(bootstrap, dir.path(), StartAt::Earliest).unwrap();
    let topic = Topic::new("em-kafka-mixed").unwrap();
    assert!(storage.create_topic(&topic, 2).await.unwrap());
    assert!(!storage.create_topic(&topic, 2).await.unwrap(), "exists");
    assert_eq!(storage.partition_count(&topic).await.unwrap(), 2);
    let sent = storage
        .send(
            &topic,
            Bytes::new(),
            event("ours"),
            Some(PartitionId::number(1)),
        )
        .await
        .unwrap();
    assert_eq!(sent.partition, PartitionId::number(1));
    // An independent producer writes bodies that are not frames.
    let producer: FutureProducer = ClientConfig::new()
        .set("bootstrap.servers", bootstrap)
        .create()
        .unwrap();
    let json = br#"{"specversion":"1.0","id":"ce-1","type":"t","data":"x"}"#;
    let bom = "\u{FEFF}plain text".as_bytes();
    for body in [&json[..], bom] {
        producer
            .send(
                FutureRecord::<[u8], [u8]>::to(topic.as_str())
                    .partition(1)
                    .payload(body)
                    .headers(OwnedHeaders::new().insert(Header {
                        key: "origin",
                        value: Some("legacy"),
                    })),
                Duration::from_secs(10),
            )
            .await
            .unwrap();
    }
    let group = reader(None, &topic);
    let batch = poll_n(&storage, &group, 3).await;
    let kinds: Vec<BodyKind> = batch.records.iter().map(|r| r.ingested.kind).collect();
    assert_eq!(
        kinds,
        [BodyKind::Frame, BodyKind::CloudEventsJson, BodyKind::Opaque]
    );
    for (i, record) in batch.records.iter().enumerate() {
        assert_eq!(record.partition, PartitionId::number(1));
        assert_eq!(record.offset, sent.offset + i as i64);
        let frame = Frame::decode(&record.ingested.frame, &FrameLimits::DEFAULT).unwrap();
        assert_eq!(frame.attribute("emmqpartition"), Some("1"));
        assert_eq!(
            frame.attribute("emmqoffset"),
            Some(record.offset.to_string().as_str())
        );
    }
    let opaque = Frame::decode(&batch.records[2].ingested.frame, &FrameLimits::DEFAULT).unwrap();
    assert_eq!(&opaque.data[..], bom);
    assert_eq!(
        opaque.attribute("origin"),
        Some("legacy"),
        "headers become attributes"
    );

    // The cursor file is written atomically and reloaded by a new instance.
    storage.checkpoint().await.unwrap();
    let file = std::fs::read_to_string(dir.path().join("kafka-pull-offsets.properties")).unwrap();
    assert!(
        file.contains(&format!("em-kafka-mixed\\#1={}", sent.offset + 3)),
        "{file}"
    );
    let prefix = storage.instance_group_prefix().to_owned();
    drop(storage);
    let reopened = KafkaStorage::new(bootstrap, dir.path(), StartAt::Earliest).unwrap();
    reopened
        .send(
            &topic,
            Bytes::new(),
            event("after"),
            Some(PartitionId::number(1)),
        )
        .await
        .unwrap();
    assert_eq!(
        ids(&poll_n(&reopened, &group, 1).await),
        ["after"],
        "resumed from the checkpoint"
    );

    // The throwaway group ids hold no committed offsets on the broker.
    for group_id in [
        format!("{prefix}--em-kafka-mixed"),
        format!("{prefix}-metadata"),
    ] {
        let probe: BaseConsumer = ClientConfig::new()
            .set("bootstrap.servers", bootstrap)
            .set("group.id", &group_id)
            .create()
            .unwrap();
        let mut partitions = TopicPartitionList::new();
        partitions.add_partition(topic.as_str(), 0);
        partitions.add_partition(topic.as_str(), 1);
        let committed = probe
            .committed_offsets(partitions, Duration::from_secs(10))
            .unwrap();
        for element in committed.elements() {
            assert_eq!(
                element.offset(),
                Offset::Invalid,
                "{group_id} has a committed offset"
            );
        }
    }
}

async fn groups_are_independent_and_alignment_repulls(bootstrap: &str) {
    let dir = tempfile::tempdir().unwrap();
    let storage = KafkaStorage::new(bootstrap, dir.path(), StartAt::Earliest).unwrap();
    let topic = Topic::new("em-kafka-groups").unwrap();
    storage.create_topic(&topic, 1).await.unwrap();
    for i in 0..10 {
        storage
            .send(&topic, Bytes::new(), event(&format!("e{i}")), None)
            .await
            .unwrap();
    }
    let (fast, slow) = (reader(Some("fast"), &topic), reader(Some("slow"), &topic));
    assert_eq!(ids(&poll_n(&storage, &fast, 8).await).len(), 8);
    assert_eq!(ids(&poll_n(&storage, &slow, 2).await), ["e0", "e1"]);
    assert_eq!(
        ids(&poll_n(&storage, &fast, 2).await),
        ["e8", "e9"],
        "the slow group holds nobody back"
    );
    // The reference's restart alignment with out-of-order ACKs: 0..7 read, watermark 4.
    storage.checkpoint().await.unwrap();
    drop(storage);
    let storage = KafkaStorage::new(bootstrap, dir.path(), StartAt::Earliest).unwrap();
    assert_eq!(
        storage
            .align_pull_offset(&fast, &PartitionId::number(0), Some(4))
            .await
            .unwrap(),
        Alignment::Rewound {
            from: Some(10),
            to: 5
        }
    );
    assert_eq!(
        ids(&poll_n(&storage, &fast, 5).await),
        ["e5", "e6", "e7", "e8", "e9"]
    );
    assert_eq!(
        ids(&poll_n(&storage, &slow, 1).await),
        ["e2"],
        "its own cursor, after the restart"
    );
}

async fn unknown_topics_and_lite_are_clear_errors(bootstrap: &str) {
    let dir = tempfile::tempdir().unwrap();
    let storage = KafkaStorage::new(bootstrap, dir.path(), StartAt::Earliest).unwrap();
    let missing = Topic::new("em-kafka-missing").unwrap();
    let err = storage
        .poll(&reader(None, &missing), &Selection::All, limits(1))
        .await
        .unwrap_err();
    assert!(matches!(err, StorageError::UnknownTopic(_)), "{err}");
    let err = storage.create_lite(&missing, "x").await.unwrap_err();
    assert!(matches!(err, StorageError::Invalid(_)), "{err}");
    // Publishing to a topic that does not exist says so (the dispatcher then creates it), and
    // once it is created the publish goes through.
    let fresh = Topic::new("em-kafka-created-on-publish").unwrap();
    let err = storage
        .send(&fresh, Bytes::new(), Bytes::from_static(b"x"), None)
        .await
        .unwrap_err();
    assert!(matches!(err, StorageError::UnknownTopic(_)), "{err}");
    storage.create_topic(&fresh, 1).await.unwrap();
    storage
        .send(&fresh, Bytes::new(), Bytes::from_static(b"x"), None)
        .await
        .unwrap();
}

async fn a_frozen_broker_is_unavailable_then_recovers() {
    let broker = Broker::start_own();
    let dir = tempfile::tempdir().unwrap();
    let storage = KafkaStorage::new(broker.bootstrap(), dir.path(), StartAt::Earliest).unwrap();
    let topic = Topic::new("em-kafka-freeze").unwrap();
    storage.create_topic(&topic, 1).await.unwrap();
    for i in 0..3 {
        storage
            .send(&topic, Bytes::new(), event(&format!("e{i}")), None)
            .await
            .unwrap();
    }
    let group = reader(None, &topic);
    assert_eq!(ids(&poll_n(&storage, &group, 1).await), ["e0"]);
    broker.signal("-STOP");
    let frozen = storage.poll(&group, &Selection::All, limits(10)).await;
    broker.signal("-CONT");
    match frozen {
        Err(StorageError::Unavailable(why)) => assert!(why.contains("kafka"), "{why}"),
        Ok(batch) => assert!(
            batch.records.is_empty(),
            "nothing can arrive from a frozen broker"
        ),
        Err(other) => panic!("unexpected error while frozen: {other}"),
    }
    assert_eq!(
        ids(&poll_n(&storage, &group, 2).await),
        ["e1", "e2"],
        "nothing lost or skipped"
    );
}

async fn one_partition_at_a_time_drops_nothing(bootstrap: &str) {
    let dir = tempfile::tempdir().unwrap();
    let storage = KafkaStorage::new(bootstrap, dir.path(), StartAt::Earliest).unwrap();
    let topic = Topic::new("em-kafka-l4").unwrap();
    storage.create_topic(&topic, 2).await.unwrap();
    for i in 0..6u32 {
        storage
            .send(
                &topic,
                Bytes::new(),
                event(&format!("p{}-{i}", i % 2)),
                Some(PartitionId::number(i % 2)),
            )
            .await
            .unwrap();
    }
    let group = reader(None, &topic);
    // Read partition 0 alone (the reference's L4 dropped partition 1's prefetched records).
    let mut zero = Vec::new();
    for _ in 0..100 {
        let batch = storage
            .poll(&group, &Selection::One(PartitionId::number(0)), limits(10))
            .await
            .unwrap();
        zero.extend(ids(&batch));
        if zero.len() >= 3 {
            break;
        }
    }
    assert_eq!(zero, ["p0-0", "p0-2", "p0-4"]);
    assert_eq!(
        ids(&poll_n(&storage, &group, 3).await),
        ["p1-1", "p1-3", "p1-5"],
        "partition 1 intact"
    );

    // Partition discovery (metadata read on every poll) cannot be exercised here: tansu 0.6.0
    // answers CreatePartitions with UnsupportedFeature.
}

async fn publish_and_pull_through_the_grpc_service(bootstrap: &str) {
    use eventmesh_proto::puller::{self as pb};
    let (offsets, offset_channel) = support::memory_offset_svc().await;
    let dir = tempfile::tempdir().unwrap();
    let storage: std::sync::Arc<dyn Storage> =
        std::sync::Arc::new(KafkaStorage::new(bootstrap, dir.path(), StartAt::Earliest).unwrap());
    let (server, mut client) = support::puller_over(storage, offset_channel).await;
    let created = client
        .create_topic(pb::CreateTopicRequest {
            topic: "em-kafka-grpc".into(),
            partitions: 2,
            implicit: false,
        })
        .await
        .unwrap()
        .into_inner();
    assert!(created.created);
    assert_eq!(created.partitions, 2);
    for id in ["g0", "g1", "g2"] {
        client
            .publish(pb::PublishRequest {
                topic: "em-kafka-grpc".into(),
                body: event(id),
                key: Bytes::from_static(b"same-key"),
                partition: String::new(),
            })
            .await
            .unwrap();
    }
    let mut got = Vec::new();
    let reader = pb::GroupTopic {
        group: String::new(),
        topic: "em-kafka-grpc".into(),
    };
    let generation = support::attach(&mut client, "test", reader.clone()).await;
    for _ in 0..50 {
        let response = client
            .pull(pb::PullRequest {
                reader: Some(reader.clone()),
                max_records: 10,
                max_wait_ms: 200,
                generation,
                ..Default::default()
            })
            .await
            .unwrap()
            .into_inner();
        for record in &response.records {
            assert_eq!(&record.key[..], b"same-key");
            let frame = Frame::decode(&record.frame, &FrameLimits::DEFAULT).unwrap();
            got.push(frame.attribute("id").unwrap().to_owned());
        }
        if got.len() >= 3 {
            break;
        }
    }
    assert_eq!(got, ["g0", "g1", "g2"], "one key, one partition, in order");
    server.shutdown();
    server.wait().await.unwrap();
    offsets.shutdown();
    offsets.wait().await.unwrap();
}

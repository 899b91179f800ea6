//! The `rocketmq4` backend against a real RocketMQ name server and broker (rocketmq-namesrv /
//! rocketmq-broker 1.0.0 on loopback, started by `scripts/rocketmq.sh` unless
//! `ROCKETMQ_NAMESRV` names one). One test runs the shared-broker scenarios in sequence;
//! scenarios that freeze or add brokers start their own.

#![allow(clippy::unwrap_used)] // tests: a failed unwrap is a failed test

mod support;

use support::{event, ids, limits, poll_n, reader};

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use eventmesh_common::frame::{Frame, FrameLimits};
use eventmesh_common::keys::{PartitionId, Topic};
use eventmesh_testkit::RocketMq;
use puller_svc::cursors::{Alignment, StartAt};
use puller_svc::ingest::BodyKind;
use puller_svc::storage::rocketmq::client::RocketMqSettings;
use puller_svc::storage::rocketmq::names::PULL_GROUP;
use puller_svc::storage::rocketmq4::RocketMq4Storage;
use puller_svc::storage::{Selection, Storage, StorageError};

/// `name` made this process's own: a broker shared between test runs keeps its topics.
fn unique(name: &str) -> String {
    format!("{name}-{}", std::process::id())
}

fn queue(broker: &str, id: u32) -> PartitionId {
    PartitionId::queue(broker, id).unwrap()
}

async fn storage_at(namesrv: &str, dir: &std::path::Path) -> RocketMq4Storage {
    RocketMq4Storage::new(RocketMqSettings::new(namesrv), dir, StartAt::Earliest)
        .await
        .unwrap()
}

/// Sends `body` to `broker-a:queue_id` with a producer of its own (another application), with
/// `properties` as user properties.
async fn foreign_send(
    namesrv: &str,
    topic: &Topic,
    queue_id: i32,
    body: &[u8],
    properties: &[(&str, &str)],
) {
    use rocketmq_client_rust::{
        ClientRuntime, ClientRuntimeConfig, DefaultMQProducer, TelemetryHandle,
    };
    use rocketmq_model::common::message::message_queue::MessageQueue;
    use rocketmq_model::common::message::message_single::Message;
    use rocketmq_runtime::{RuntimeConfig, RuntimeOwner};
    let owner = RuntimeOwner::plan(RuntimeConfig {
        thread_name: "foreign".into(),
        worker_threads: 1,
        ..RuntimeConfig::default()
    })
    .unwrap()
    .build()
    .unwrap();
    let runtime = ClientRuntime::try_new(
        owner.root_context().component("foreign"),
        ClientRuntimeConfig::default(),
        TelemetryHandle::noop(),
    )
    .unwrap();
    let mut producer = DefaultMQProducer::builder(runtime.clone())
        .name_server_addr(namesrv)
        .producer_group("em-test-foreign")
        .build();
    producer.start().await.unwrap();
    let mut message = Message::builder()
        .topic(topic.as_str())
        .body(Bytes::copy_from_slice(body));
    for (name, value) in properties {
        message = message.raw_property(*name, *value).unwrap();
    }
    producer
        .send_to_queue(
            message.build().unwrap(),
            MessageQueue::from_parts(topic.as_str(), "broker-a", queue_id),
        )
        .await
        .unwrap();
    producer.shutdown().await;
    runtime.shutdown().await;
    owner.shutdown_tasks().await;
    owner.shutdown_background();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rocketmq4_backend_against_a_real_broker() {
    let rocketmq = RocketMq::get();
    let namesrv = rocketmq.namesrv();
    stamps_foreign_bodies_and_checkpoints(namesrv).await;
    groups_are_independent_and_alignment_repulls(namesrv).await;
    bad_names_unknown_topics_and_partitions(namesrv).await;
    one_queue_at_a_time_drops_nothing(namesrv).await;
    keys_land_where_java_puts_them(namesrv).await;
    a_position_past_the_end_is_reported(namesrv).await;
    publish_and_pull_through_the_grpc_service(namesrv).await;
    the_brokers_describe_the_topics_storage(namesrv).await;
    publish_batches_go_as_broker_batches(namesrv).await;
}

async fn stamps_foreign_bodies_and_checkpoints(namesrv: &str) {
    let dir = tempfile::tempdir().unwrap();
    let storage = storage_at(namesrv, dir.path()).await;
    let topic = Topic::new(unique("em-rmq4-mixed")).unwrap();
    assert!(storage.create_topic(&topic, 2).await.unwrap());
    assert!(!storage.create_topic(&topic, 2).await.unwrap(), "exists");
    assert_eq!(storage.partition_count(&topic).await.unwrap(), 2);
    let sent = storage
        .send(
            &topic,
            Bytes::new(),
            event("ours"),
            Some(queue("broker-a", 1)),
        )
        .await
        .unwrap();
    assert_eq!(sent.partition, queue("broker-a", 1));
    // Another producer writes bodies that are not frames, with user properties.
    let json = br#"{"specversion":"1.0","id":"ce-1","type":"t","data":"x"}"#;
    let bom = "\u{FEFF}plain text".as_bytes();
    for body in [&json[..], bom] {
        foreign_send(namesrv, &topic, 1, body, &[("origin", "legacy")]).await;
    }
    let group = reader(None, &topic);
    let batch = poll_n(&storage, &group, 3).await;
    let kinds: Vec<BodyKind> = batch.records.iter().map(|r| r.ingested.kind).collect();
    assert_eq!(
        kinds,
        [BodyKind::Frame, BodyKind::CloudEventsJson, BodyKind::Opaque]
    );
    for (i, record) in batch.records.iter().enumerate() {
        assert_eq!(record.partition, queue("broker-a", 1));
        assert_eq!(record.offset, sent.offset + i as i64);
        let frame = Frame::decode(&record.ingested.frame, &FrameLimits::STAMPED).unwrap();
        assert_eq!(frame.attribute("emmqpartition"), Some("broker-a:1"));
        assert_eq!(
            frame.attribute("emmqoffset"),
            Some(record.offset.to_string().as_str())
        );
    }
    let opaque = Frame::decode(&batch.records[2].ingested.frame, &FrameLimits::STAMPED).unwrap();
    assert_eq!(&opaque.data[..], bom);
    assert_eq!(
        opaque.attribute("origin"),
        Some("legacy"),
        "user properties become attributes"
    );
    assert_eq!(
        opaque.attribute("UNIQ_KEY"),
        None,
        "system properties stay out"
    );
    assert_eq!(
        opaque.attribute("id"),
        Some(format!("{topic}/broker-a:1/{}", sent.offset + 2).as_str())
    );

    // The cursor file is written atomically, names the queue, and is reloaded.
    storage.checkpoint().await.unwrap();
    let file =
        std::fs::read_to_string(dir.path().join("rocketmq4-pull-offsets.properties")).unwrap();
    assert!(
        file.contains(&format!("{topic}\\#broker-a\\:1={}", sent.offset + 3)),
        "{file}"
    );
    drop(storage);
    let reopened = storage_at(namesrv, dir.path()).await;
    reopened
        .send(
            &topic,
            Bytes::new(),
            event("after"),
            Some(queue("broker-a", 1)),
        )
        .await
        .unwrap();
    assert_eq!(
        ids(&poll_n(&reopened, &group, 1).await),
        ["after"],
        "resumed from the checkpoint"
    );

    // The fixed pull group holds no consume offset on the broker, for any queue.
    for id in 0..2 {
        let offset = reopened
            .client()
            .consume_offset(PULL_GROUP, &topic, &queue("broker-a", id))
            .await
            .unwrap();
        assert_eq!(
            offset, None,
            "{PULL_GROUP} has a consume offset on broker-a:{id}"
        );
    }
}

async fn groups_are_independent_and_alignment_repulls(namesrv: &str) {
    let dir = tempfile::tempdir().unwrap();
    let storage = storage_at(namesrv, dir.path()).await;
    let topic = Topic::new(unique("em-rmq4-groups")).unwrap();
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
    // The reference's restart alignment with out-of-order ACKs: 0..9 read, watermark 4.
    storage.checkpoint().await.unwrap();
    drop(storage);
    let storage = storage_at(namesrv, dir.path()).await;
    assert_eq!(
        storage
            .align_pull_offset(&fast, &queue("broker-a", 0), Some(4))
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

/// A publish batch goes as broker batches per queue; every record is answered on its own, at
/// the offset the broker stored it at, keyed records in order; refused records alone fail; a
/// body of exactly the size limit goes through.
async fn publish_batches_go_as_broker_batches(namesrv: &str) {
    use puller_svc::storage::NewRecord;
    let dir = tempfile::tempdir().unwrap();
    let storage = storage_at(namesrv, dir.path()).await;
    let topic = Topic::new(unique("em-rmq4-batch")).unwrap();
    storage.create_topic(&topic, 4).await.unwrap();
    const RECORDS: usize = 700;
    let records: Vec<NewRecord> = (0..RECORDS)
        .map(|i| NewRecord {
            key: match i {
                10 => Bytes::from_static(&[0xFF, 0xFE]),
                i if i.is_multiple_of(3) => Bytes::from(format!("k{}", i % 5)),
                _ => Bytes::new(),
            },
            body: if i == 11 {
                Bytes::from(vec![b'x'; RocketMqSettings::DEFAULT_MAX_MESSAGE_BYTES + 1])
            } else {
                event(&format!("b{i}"))
            },
            partition: (i.is_multiple_of(7) && !i.is_multiple_of(3)).then(|| queue("broker-a", 3)),
        })
        .collect();
    let answers = storage.send_batch(&topic, records).await.unwrap();
    assert_eq!(answers.len(), RECORDS);
    for refused in [10, 11] {
        let err = answers[refused].as_ref().unwrap_err();
        assert!(matches!(err, StorageError::Invalid(_)), "{refused}: {err}");
    }
    let stored: HashMap<(PartitionId, i64), usize> = answers
        .iter()
        .enumerate()
        .filter(|(i, _)| ![10, 11].contains(i))
        .map(|(i, answer)| {
            let appended = answer.as_ref().unwrap();
            ((appended.partition.clone(), appended.offset), i)
        })
        .collect();
    assert_eq!(
        stored.len(),
        RECORDS - 2,
        "every answer names its own offset"
    );
    let batch = poll_n(&storage, &reader(Some("check"), &topic), RECORDS - 2).await;
    assert_eq!(batch.records.len(), RECORDS - 2);
    for (record, id) in batch.records.iter().zip(ids(&batch)) {
        let index = stored[&(record.partition.clone(), record.offset)];
        assert_eq!(
            id,
            format!("b{index}"),
            "the answer's offset holds its record"
        );
        let key = if index.is_multiple_of(3) {
            format!("k{}", index % 5)
        } else {
            String::new()
        };
        assert_eq!(
            record.key,
            key.as_bytes(),
            "a batched message keeps its key"
        );
    }
    // A key's records are in input order in their queue.
    for key in 0..5 {
        let offsets: Vec<(PartitionId, i64)> = (0..RECORDS)
            .filter(|i| i.is_multiple_of(3) && i % 5 == key)
            .map(|i| {
                let a = answers[i].as_ref().unwrap();
                (a.partition.clone(), a.offset)
            })
            .collect();
        assert!(
            offsets
                .windows(2)
                .all(|w| w[0].0 == w[1].0 && w[0].1 < w[1].1)
        );
    }
    // A body at exactly the limit, between small ones.
    let limit = RocketMqSettings::DEFAULT_MAX_MESSAGE_BYTES;
    let records = vec![
        NewRecord {
            key: Bytes::new(),
            body: event("before"),
            partition: Some(queue("broker-a", 0)),
        },
        NewRecord {
            key: Bytes::new(),
            body: Bytes::from(vec![b'y'; limit]),
            partition: Some(queue("broker-a", 0)),
        },
        NewRecord {
            key: Bytes::new(),
            body: event("after"),
            partition: Some(queue("broker-a", 0)),
        },
    ];
    let answers = storage.send_batch(&topic, records).await.unwrap();
    let offsets: Vec<i64> = answers.iter().map(|a| a.as_ref().unwrap().offset).collect();
    assert!(offsets.windows(2).all(|w| w[1] == w[0] + 1), "{offsets:?}");

    // A broker batch the broker refuses fails with every later batch of its queue, unsent: a
    // puller whose limit was raised above the broker's sends two 3 MiB bodies in one batch.
    let raised = RocketMq4Storage::new(
        RocketMqSettings {
            max_message_bytes: 8 * 1024 * 1024,
            ..RocketMqSettings::new(namesrv)
        },
        dir.path().join("raised"),
        StartAt::Earliest,
    )
    .await
    .unwrap();
    let small = |id: &str| NewRecord {
        key: Bytes::new(),
        body: event(id),
        partition: Some(queue("broker-a", 2)),
    };
    let mut records = vec![small("first, alone")];
    for _ in 0..2 {
        records.push(NewRecord {
            key: Bytes::new(),
            body: Bytes::from(vec![b'z'; 3 * 1024 * 1024]),
            partition: Some(queue("broker-a", 2)),
        });
    }
    records.extend((0..300).map(|i| small(&format!("s{i}"))));
    let before = storage.end_offsets(&topic).await.unwrap();
    let answers = raised.send_batch(&topic, records).await.unwrap();
    assert!(answers[0].is_ok(), "{:?}", answers[0]);
    assert!(answers[1..].iter().all(Result::is_err), "{answers:?}");
    let unsent = answers.last().unwrap().as_ref().unwrap_err().to_string();
    assert!(unsent.contains("not sent: an earlier batch"), "{unsent}");
    let after = storage.end_offsets(&topic).await.unwrap();
    let grown: i64 = after.iter().zip(&before).map(|(a, b)| a.end - b.end).sum();
    assert_eq!(grown, 1, "only the first record was stored");
}

/// What bounds storage, read from the broker: its commit log and settings, each queue's range
/// and the commit-log position of its lowest entry (inside the commit log: trimmed in step).
async fn the_brokers_describe_the_topics_storage(namesrv: &str) {
    let dir = tempfile::tempdir().unwrap();
    let storage = storage_at(namesrv, dir.path()).await;
    let topic = Topic::new(unique("em-rmq4-describe")).unwrap();
    storage.create_topic(&topic, 2).await.unwrap();
    let mut sent = Vec::new();
    for i in 0..5 {
        sent.push(
            storage
                .send(
                    &topic,
                    Bytes::new(),
                    event(&format!("d{i}")),
                    Some(queue("broker-a", 0)),
                )
                .await
                .unwrap(),
        );
    }
    let report = storage.describe_broker_storage(&topic).await.unwrap();
    assert_eq!(report.brokers.len(), 1, "{report:?}");
    let broker = &report.brokers[0];
    assert_eq!(broker.broker, "broker-a");
    assert!(broker.commit_log_min_offset >= 0, "{broker:?}");
    assert!(
        broker.commit_log_max_offset > broker.commit_log_min_offset,
        "{broker:?}"
    );
    assert_eq!(broker.file_reserved_hours, Some(72), "the broker's default");
    assert!(broker.delete_when.is_some(), "{broker:?}");
    assert_eq!(report.queues.len(), 2, "{report:?}");
    let written = &report.queues[0];
    assert_eq!(written.partition, queue("broker-a", 0));
    assert_eq!((written.min_offset, written.max_offset), (0, 5));
    let position = written.min_entry_commit_log_offset.unwrap();
    assert!(
        (broker.commit_log_min_offset..broker.commit_log_max_offset).contains(&position),
        "{report:?}"
    );
    let empty = &report.queues[1];
    assert_eq!((empty.min_offset, empty.max_offset), (0, 0));
    assert_eq!(empty.min_entry_commit_log_offset, None);

    let missing = Topic::new("em-rmq4-describe-missing").unwrap();
    let err = storage.describe_broker_storage(&missing).await.unwrap_err();
    assert!(matches!(err, StorageError::UnknownTopic(_)), "{err}");
}

async fn bad_names_unknown_topics_and_partitions(namesrv: &str) {
    let dir = tempfile::tempdir().unwrap();
    let storage = storage_at(namesrv, dir.path()).await;
    // A name RocketMQ cannot hold is refused with the rule, never mangled.
    for bad in ["has.dot", &"x".repeat(124)] {
        let topic = Topic::new(bad).unwrap();
        let err = storage.create_topic(&topic, 1).await.unwrap_err();
        assert!(matches!(err, StorageError::Invalid(_)), "{bad}: {err}");
        assert!(err.to_string().contains("[%|a-zA-Z0-9_-]"), "{err}");
        let err = storage
            .send(&topic, Bytes::new(), event("x"), None)
            .await
            .unwrap_err();
        assert!(matches!(err, StorageError::Invalid(_)), "{bad}: {err}");
    }
    let missing = Topic::new("em-rmq4-missing").unwrap();
    let err = storage
        .poll(&reader(None, &missing), &Selection::All, limits(1))
        .await
        .unwrap_err();
    assert!(matches!(err, StorageError::UnknownTopic(_)), "{err}");
    let err = storage.create_lite(&missing, "x").await.unwrap_err();
    assert!(matches!(err, StorageError::Invalid(_)), "{err}");
    // A publish to a topic that does not exist says so — the broker's auto-create is never
    // used — and once the topic is created it goes through.
    let fresh = Topic::new(unique("em-rmq4-created-on-publish")).unwrap();
    let err = storage
        .send(&fresh, Bytes::new(), event("x"), None)
        .await
        .unwrap_err();
    assert!(matches!(err, StorageError::UnknownTopic(_)), "{err}");
    assert_eq!(
        storage
            .partition_count(&fresh)
            .await
            .unwrap_err()
            .to_string(),
        StorageError::UnknownTopic(fresh.to_string()).to_string(),
        "the refused publish created nothing"
    );
    storage.create_topic(&fresh, 1).await.unwrap();
    storage
        .send(&fresh, Bytes::new(), event("x"), None)
        .await
        .unwrap();
    // Partitions the topic does not have, in every form, are NOT_FOUND.
    for partition in [
        PartitionId::number(0),
        queue("broker-a", 7),
        queue("broker-z", 0),
    ] {
        let err = storage
            .poll(
                &reader(None, &fresh),
                &Selection::One(partition.clone()),
                limits(1),
            )
            .await
            .unwrap_err();
        assert!(
            matches!(err, StorageError::UnknownPartition { .. }),
            "{partition}: {err}"
        );
        let err = storage
            .send(&fresh, Bytes::new(), event("x"), Some(partition.clone()))
            .await
            .unwrap_err();
        assert!(
            matches!(err, StorageError::UnknownPartition { .. }),
            "{partition}: {err}"
        );
    }
    // A body over the brokers' message limit is refused as invalid (a retry cannot help).
    let err = storage
        .send(
            &fresh,
            Bytes::new(),
            Bytes::from(vec![b'x'; RocketMqSettings::DEFAULT_MAX_MESSAGE_BYTES + 1]),
            None,
        )
        .await
        .unwrap_err();
    assert!(matches!(err, StorageError::Invalid(_)), "{err}");
    assert!(err.to_string().contains("4194304-byte limit"), "{err}");
    // A key RocketMQ cannot carry as text is refused, not altered.
    let err = storage
        .send(&fresh, Bytes::from_static(b"\xff\xfe"), event("x"), None)
        .await
        .unwrap_err();
    assert!(matches!(err, StorageError::Invalid(_)), "{err}");
}

async fn one_queue_at_a_time_drops_nothing(namesrv: &str) {
    let dir = tempfile::tempdir().unwrap();
    let storage = storage_at(namesrv, dir.path()).await;
    let topic = Topic::new(unique("em-rmq4-l4")).unwrap();
    storage.create_topic(&topic, 2).await.unwrap();
    for i in 0..6u32 {
        storage
            .send(
                &topic,
                Bytes::new(),
                event(&format!("q{}-{i}", i % 2)),
                Some(queue("broker-a", i % 2)),
            )
            .await
            .unwrap();
    }
    let group = reader(None, &topic);
    // Read queue 0 alone (the reference's L4 dropped the other queue's prefetched records).
    let batch = storage
        .poll(&group, &Selection::One(queue("broker-a", 0)), limits(10))
        .await
        .unwrap();
    assert_eq!(ids(&batch), ["q0-0", "q0-2", "q0-4"]);
    assert_eq!(
        ids(&poll_n(&storage, &group, 3).await),
        ["q1-1", "q1-3", "q1-5"],
        "queue 1 intact"
    );
    // Limits cut a batch at a record: the cursor ends after the last one handed on.
    for i in 0..5 {
        storage
            .send(
                &topic,
                Bytes::new(),
                event(&format!("more{i}")),
                Some(queue("broker-a", 0)),
            )
            .await
            .unwrap();
    }
    let batch = storage
        .poll(&group, &Selection::One(queue("broker-a", 0)), limits(2))
        .await
        .unwrap();
    assert_eq!(ids(&batch), ["more0", "more1"]);
    assert_eq!(
        (batch.ranges[0].first, batch.ranges[0].next),
        (3, 5),
        "{:?}",
        batch.ranges
    );
    assert_eq!(
        ids(&poll_n(&storage, &group, 3).await),
        ["more2", "more3", "more4"]
    );
}

async fn keys_land_where_java_puts_them(namesrv: &str) {
    let dir = tempfile::tempdir().unwrap();
    let storage = storage_at(namesrv, dir.path()).await;
    let topic = Topic::new(unique("em-rmq4-keyed")).unwrap();
    storage.create_topic(&topic, 4).await.unwrap();
    // Java: Math.abs("hello".hashCode() % 4) == 2; "order-17" → 3; "k" → 3 ("k".hashCode() = 107).
    for (key, java_queue) in [
        ("hello", 2),
        (
            "order-17",
            puller_svc::storage::rocketmq::client::queue_for_key("order-17", 4) as u32,
        ),
        ("k", 3),
    ] {
        let sent = storage
            .send(&topic, Bytes::from(key), event(key), None)
            .await
            .unwrap();
        assert_eq!(sent.partition, queue("broker-a", java_queue), "key {key}");
    }
    // The key comes back as the record key (RocketMQ's KEYS).
    let batch = poll_n(&storage, &reader(None, &topic), 3).await;
    let mut keys: Vec<&[u8]> = batch.records.iter().map(|r| &r.key[..]).collect();
    keys.sort();
    assert_eq!(keys, [&b"hello"[..], b"k", b"order-17"]);
    // Without a key, sends go round robin over the queues.
    let spread = Topic::new(unique("em-rmq4-spread")).unwrap();
    storage.create_topic(&spread, 4).await.unwrap();
    let mut queues = std::collections::BTreeSet::new();
    for i in 0..4 {
        let sent = storage
            .send(&spread, Bytes::new(), event(&format!("r{i}")), None)
            .await
            .unwrap();
        queues.insert(sent.partition.to_string());
    }
    assert_eq!(queues.len(), 4, "{queues:?}");
}

async fn a_position_past_the_end_is_reported(namesrv: &str) {
    let dir = tempfile::tempdir().unwrap();
    let storage = storage_at(namesrv, dir.path()).await;
    let topic = Topic::new(unique("em-rmq4-past-end")).unwrap();
    storage.create_topic(&topic, 1).await.unwrap();
    for i in 0..2 {
        storage
            .send(&topic, Bytes::new(), event(&format!("e{i}")), None)
            .await
            .unwrap();
    }
    let group = reader(Some("g"), &topic);
    let positioned = Selection::Positioned([(queue("broker-a", 0), 6)].into());
    let batch = storage.poll(&group, &positioned, limits(10)).await.unwrap();
    assert!(batch.records.is_empty(), "nothing is read past the end");
    let past = batch
        .past_end
        .first()
        .expect("the position past the end is reported");
    assert_eq!(
        (past.position, past.log_start, past.log_end),
        (6, 0, 2),
        "{past:?}"
    );
    assert_eq!(
        storage.cursors(&group).await.unwrap(),
        [(queue("broker-a", 0), 6)],
        "reported, not moved"
    );
    // The dispatcher rewinds the group: the records are read from there.
    let rewound = Selection::Positioned([(queue("broker-a", 0), 0)].into());
    let batch = storage.poll(&group, &rewound, limits(10)).await.unwrap();
    assert_eq!(ids(&batch), ["e0", "e1"]);
}

async fn publish_and_pull_through_the_grpc_service(namesrv: &str) {
    use eventmesh_proto::puller::{self as pb};
    let (offsets, offset_channel) = support::memory_offset_svc().await;
    let dir = tempfile::tempdir().unwrap();
    let storage =
        support::recording::RecordingStorage::new(Arc::new(storage_at(namesrv, dir.path()).await));
    let (server, mut client) = support::puller_over(storage.clone(), offset_channel).await;
    let topic = unique("em-rmq4-grpc");
    let created = client
        .create_topic(pb::CreateTopicRequest {
            topic: topic.clone(),
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
                topic: topic.clone(),
                body: event(id),
                key: Bytes::from_static(b"same-key"),
                partition: String::new(),
            })
            .await
            .unwrap();
    }
    // Bad input through the API: a name RocketMQ cannot hold, a queue the topic lacks.
    let status = client
        .create_topic(pb::CreateTopicRequest {
            topic: "em.rmq4.dotted".into(),
            partitions: 1,
            implicit: false,
        })
        .await
        .unwrap_err();
    assert_eq!(status.code(), tonic::Code::InvalidArgument, "{status:?}");
    assert!(status.message().contains("[%|a-zA-Z0-9_-]"), "{status:?}");
    let status = client
        .publish(pb::PublishRequest {
            topic: topic.clone(),
            body: event("x"),
            key: Bytes::new(),
            partition: "broker-a:9".into(),
        })
        .await
        .unwrap_err();
    assert_eq!(status.code(), tonic::Code::NotFound, "{status:?}");
    let mut got = Vec::new();
    let group = pb::GroupTopic {
        group: String::new(),
        topic: topic.clone(),
    };
    let generation = support::attach(&mut client, "test", group.clone()).await;
    for _ in 0..50 {
        let response = client
            .pull(pb::PullRequest {
                reader: Some(group.clone()),
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
            let frame = Frame::decode(&record.frame, &FrameLimits::STAMPED).unwrap();
            got.push(frame.attribute("id").unwrap().to_owned());
        }
        if got.len() >= 3 {
            break;
        }
    }
    assert_eq!(got, ["g0", "g1", "g2"], "one key, one queue, in order");
    // What the puller did through the backend: three sends to one queue, read back in order.
    let sends: Vec<_> = storage
        .calls()
        .into_iter()
        .filter_map(|call| match call {
            support::recording::Call::Send { landed, .. } => landed,
            _ => None,
        })
        .collect();
    assert_eq!(sends.len(), 3, "{sends:?}");
    assert!(sends.iter().all(|(p, _)| *p == sends[0].0), "{sends:?}");
    assert_eq!(storage.polled(), sends, "read back exactly what was sent");
    server.shutdown();
    server.wait().await.unwrap();
    offsets.shutdown();
    offsets.wait().await.unwrap();
}

/// Two brokers under one name server: a topic's queues are `broker:queue` on both, sends
/// spread over them, and every record comes back from the queue it was sent to.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_brokers_each_queue_named_by_its_broker() {
    let rocketmq = RocketMq::start_own();
    rocketmq.start_broker("broker-b");
    let dir = tempfile::tempdir().unwrap();
    let storage = storage_at(rocketmq.namesrv(), dir.path()).await;
    let topic = Topic::new("em-rmq4-two-brokers").unwrap();
    storage.create_topic(&topic, 2).await.unwrap();
    let ranges = storage.end_offsets(&topic).await.unwrap();
    let partitions: Vec<String> = ranges.iter().map(|r| r.partition.to_string()).collect();
    assert_eq!(
        partitions,
        ["broker-a:0", "broker-a:1", "broker-b:0", "broker-b:1"]
    );
    let mut sent = Vec::new();
    for i in 0..8 {
        let appended = storage
            .send(&topic, Bytes::new(), event(&format!("e{i}")), None)
            .await
            .unwrap();
        sent.push((
            appended.partition.to_string(),
            appended.offset,
            format!("e{i}"),
        ));
    }
    let batch = poll_n(&storage, &reader(None, &topic), 8).await;
    let mut got: Vec<(String, i64, String)> = batch
        .records
        .iter()
        .zip(ids(&batch))
        .map(|(r, id)| (r.partition.to_string(), r.offset, id))
        .collect();
    got.sort();
    sent.sort();
    assert_eq!(got, sent, "each record from the queue it was sent to");
}

/// A frozen broker makes polls UNAVAILABLE (or empty), never loses or skips a record, and the
/// reader recovers when it thaws. A name server that is down at start does not stop the
/// backend from starting; calls are UNAVAILABLE until it is up.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_frozen_broker_or_name_server_is_unavailable_then_recovers() {
    let rocketmq = RocketMq::start_own();
    let dir = tempfile::tempdir().unwrap();
    let storage = storage_at(rocketmq.namesrv(), dir.path()).await;
    let topic = Topic::new("em-rmq4-freeze").unwrap();
    support::a_frozen_broker_loses_nothing(&storage, &rocketmq, &topic).await;
    let group = reader(None, &topic);

    // The name server down at start.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let nowhere = tempfile::tempdir().unwrap();
    let started = Instant::now();
    let orphan = storage_at(&format!("127.0.0.1:{port}"), nowhere.path()).await;
    assert!(
        started.elapsed() < Duration::from_secs(2),
        "started without it"
    );
    let err = orphan
        .poll(&group, &Selection::All, limits(1))
        .await
        .unwrap_err();
    assert!(matches!(err, StorageError::Unavailable(_)), "{err}");
    let err = orphan
        .send(&topic, Bytes::new(), event("x"), None)
        .await
        .unwrap_err();
    assert!(matches!(err, StorageError::Unavailable(_)), "{err}");
}

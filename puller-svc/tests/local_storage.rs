//! The `local` backend through the `Storage` contract: stamping, ranges, independent groups,
//! restart with checkpoint and watermark alignment (the reference's RestartCursorAlignmentTest
//! and its out-of-order variant), foreign bodies, limits, lite channels and errors.

#![allow(clippy::unwrap_used)] // tests: a failed unwrap is a failed test

use bytes::Bytes;
use eventmesh_common::frame::{Frame, FrameLimits};
use eventmesh_common::keys::{GroupName, PartitionId, Topic};
use puller_svc::cursors::{Alignment, StartAt};
use puller_svc::ingest::BodyKind;
use puller_svc::local_log::LogSettings;
use puller_svc::storage::local::LocalStorage;
use puller_svc::storage::{
    AckPulledOutcome, PollLimits, ReaderKey, Selection, Storage, StorageError,
};

fn settings() -> LogSettings {
    LogSettings {
        retention_ms: None,
        ..LogSettings::default()
    }
}

fn open(dir: &std::path::Path) -> LocalStorage {
    LocalStorage::open(dir, settings(), StartAt::Earliest).unwrap()
}

fn event(id: &str) -> Bytes {
    let mut frame = Frame::event();
    frame.set_attribute("id", id);
    frame.data = Bytes::from(format!("data-{id}"));
    frame.encode(&FrameLimits::DEFAULT).unwrap()
}

/// Creates `name` with `partitions` partitions and sends events `e0..e{n}` spread over them.
async fn topic_with(storage: &LocalStorage, name: &str, partitions: u32, n: usize) -> Topic {
    let topic = Topic::new(name).unwrap();
    storage.create_topic(&topic, partitions).await.unwrap();
    for i in 0..n {
        storage
            .send(&topic, Bytes::new(), event(&format!("e{i}")), None)
            .await
            .unwrap();
    }
    topic
}

fn reader(group: Option<&str>, topic: &Topic) -> ReaderKey {
    ReaderKey {
        group: group.map(|g| GroupName::new(g).unwrap()),
        topic: topic.clone(),
    }
}

fn limits(max_records: usize) -> PollLimits {
    PollLimits {
        max_records,
        ..PollLimits::default()
    }
}

fn ids(batch: &puller_svc::storage::PolledBatch) -> Vec<String> {
    batch
        .records
        .iter()
        .map(|r| {
            let frame = Frame::decode(&r.ingested.frame, &FrameLimits::DEFAULT).unwrap();
            frame.attribute("id").unwrap().to_owned()
        })
        .collect()
}

#[tokio::test]
async fn polled_records_are_stamped_and_ranges_reported() {
    let dir = tempfile::tempdir().unwrap();
    let storage = open(dir.path());
    let topic = Topic::new("orders").unwrap();
    assert!(storage.create_topic(&topic, 2).await.unwrap());
    for i in 0..4 {
        let appended = storage
            .send(
                &topic,
                Bytes::new(),
                event(&format!("e{i}")),
                Some(PartitionId::number(i % 2)),
            )
            .await
            .unwrap();
        assert_eq!(appended.offset, i64::from(i / 2));
    }
    let group = reader(None, &topic);
    let batch = storage
        .poll(&group, &Selection::All, limits(100))
        .await
        .unwrap();
    assert_eq!(ids(&batch), ["e0", "e2", "e1", "e3"]);
    for record in &batch.records {
        let frame = Frame::decode(&record.ingested.frame, &FrameLimits::DEFAULT).unwrap();
        assert_eq!(
            frame.attribute("emmqpartition"),
            Some(record.partition.as_str())
        );
        assert_eq!(
            frame.attribute("emmqoffset"),
            Some(record.offset.to_string().as_str())
        );
        assert_eq!(record.ack_key, None);
    }
    let ranges: Vec<(String, i64, i64)> = batch
        .ranges
        .iter()
        .map(|r| (r.partition.to_string(), r.first, r.next))
        .collect();
    assert_eq!(ranges, [("0".into(), 0, 2), ("1".into(), 0, 2)]);
    assert!(
        storage
            .poll(&group, &Selection::All, limits(100))
            .await
            .unwrap()
            .records
            .is_empty(),
        "cursor advanced"
    );
    assert_eq!(
        storage.ack_pulled(&group, "anything").await.unwrap(),
        AckPulledOutcome::NotApplicable
    );
}

/// Flips the last byte of partition `partition`'s segment of `topic` under `dir` (its last
/// record's CRC no longer matches; flipping again repairs it).
fn flip_last_byte(dir: &std::path::Path, topic: &str, partition: u32) {
    let partition_dir = dir
        .join("local-log")
        .join(topic)
        .join(partition.to_string());
    let segment = std::fs::read_dir(&partition_dir)
        .unwrap()
        .map(|entry| entry.unwrap().path())
        .find(|path| path.extension().is_some_and(|e| e == "log"))
        .unwrap();
    let mut bytes = std::fs::read(&segment).unwrap();
    let last = bytes.len() - 1;
    bytes[last] ^= 0xFF;
    std::fs::write(&segment, &bytes).unwrap();
}

#[tokio::test]
async fn a_damaged_partition_is_held_while_the_others_are_read() {
    let dir = tempfile::tempdir().unwrap();
    let storage = open(dir.path());
    let topic = Topic::new("damaged").unwrap();
    storage.create_topic(&topic, 2).await.unwrap();
    for i in 0..4 {
        let partition = Some(PartitionId::number(i % 2));
        let body = event(&format!("e{i}"));
        storage
            .send(&topic, Bytes::new(), body, partition)
            .await
            .unwrap();
    }
    let group = reader(Some("g"), &topic);

    // Partition 0 (read first) fails its CRC: partition 1 is still read, 0 is left behind.
    flip_last_byte(dir.path(), "damaged", 0);
    let poll_all = || storage.poll(&group, &Selection::All, limits(100));
    let batch = poll_all().await.unwrap();
    assert_eq!(ids(&batch), ["e1", "e3"]);
    assert_eq!(batch.failed_partitions, 1);
    // Only the damaged partition has records left: the poll answers empty (a long poll waits
    // for appends) and still counts it.
    let batch = poll_all().await.unwrap();
    assert!(batch.records.is_empty());
    assert_eq!(batch.failed_partitions, 1);
    // When every partition fails, the poll fails and says why.
    let single = topic_with(&storage, "single", 1, 2).await;
    flip_last_byte(dir.path(), "single", 0);
    let err = storage
        .poll(&reader(Some("g"), &single), &Selection::All, limits(100))
        .await
        .unwrap_err();
    assert!(err.to_string().contains("CRC"), "{err}");

    // Repaired, partition 0 is read from where it stood: nothing skipped.
    flip_last_byte(dir.path(), "damaged", 0);
    let batch = poll_all().await.unwrap();
    assert_eq!(ids(&batch), ["e0", "e2"]);
    assert_eq!(batch.failed_partitions, 0);
}

#[tokio::test]
async fn groups_read_independently_and_resume_after_restart() {
    let dir = tempfile::tempdir().unwrap();
    let topic = Topic::new("t").unwrap();
    let (fast, slow) = (reader(Some("fast"), &topic), reader(Some("slow"), &topic));
    {
        let storage = open(dir.path());
        topic_with(&storage, topic.as_str(), 1, 10).await;
        assert_eq!(
            storage
                .poll(&fast, &Selection::All, limits(8))
                .await
                .unwrap()
                .records
                .len(),
            8
        );
        assert_eq!(
            ids(&storage
                .poll(&slow, &Selection::All, limits(2))
                .await
                .unwrap()),
            ["e0", "e1"]
        );
        storage.checkpoint().await.unwrap();
    }
    assert!(
        dir.path()
            .join("local-pull-offsets@fast.properties")
            .exists()
    );
    assert!(
        dir.path()
            .join("local-pull-offsets@slow.properties")
            .exists()
    );
    let storage = open(dir.path());
    assert_eq!(
        ids(&storage
            .poll(&fast, &Selection::All, limits(100))
            .await
            .unwrap()),
        ["e8", "e9"]
    );
    assert_eq!(
        ids(&storage
            .poll(&slow, &Selection::All, limits(3))
            .await
            .unwrap()),
        ["e2", "e3", "e4"]
    );
    assert_eq!(
        storage.cursors(&slow).await.unwrap(),
        [(PartitionId::number(0), 5)]
    );
}

#[tokio::test]
async fn restart_alignment_repulls_everything_above_the_watermark() {
    // Offsets 0..7 pulled one at a time; 0..4 ACKed and 7 ACKed out of order, so the gap-free
    // watermark is 4; the puller dies after checkpointing cursor 8.
    let dir = tempfile::tempdir().unwrap();
    let topic = Topic::new("orders").unwrap();
    let group = reader(None, &topic);
    {
        let storage = open(dir.path());
        topic_with(&storage, topic.as_str(), 1, 10).await;
        for _ in 0..8 {
            assert_eq!(
                storage
                    .poll(&group, &Selection::All, limits(1))
                    .await
                    .unwrap()
                    .records
                    .len(),
                1
            );
        }
        storage.checkpoint().await.unwrap();
    }
    let storage = open(dir.path());
    let partition = PartitionId::number(0);
    assert_eq!(
        storage
            .align_pull_offset(&group, &partition, Some(4))
            .await
            .unwrap(),
        Alignment::Rewound {
            from: Some(8),
            to: 5
        }
    );
    let batch = storage
        .poll(&group, &Selection::All, limits(10))
        .await
        .unwrap();
    assert_eq!(
        ids(&batch),
        ["e5", "e6", "e7", "e8", "e9"],
        "5, 6 and 7 come back"
    );
}

#[tokio::test]
async fn a_partition_filter_and_limits_are_respected() {
    let dir = tempfile::tempdir().unwrap();
    let storage = open(dir.path());
    let topic = topic_with(&storage, "t", 3, 30).await;
    let group = reader(None, &topic);
    let only_two = storage
        .poll(&group, &Selection::One(PartitionId::number(2)), limits(100))
        .await
        .unwrap();
    assert_eq!(only_two.records.len(), 10);
    assert!(
        only_two
            .records
            .iter()
            .all(|r| r.partition == PartitionId::number(2))
    );
    let limited = storage
        .poll(&group, &Selection::All, limits(6))
        .await
        .unwrap();
    assert_eq!(limited.records.len(), 6);
    assert_eq!(
        limited.ranges.len(),
        2,
        "shared between the partitions with records left"
    );
}

#[tokio::test]
async fn foreign_bodies_are_delivered_and_broken_frames_flagged() {
    let dir = tempfile::tempdir().unwrap();
    let storage = open(dir.path());
    let topic = Topic::new("mixed").unwrap();
    storage.create_topic(&topic, 1).await.unwrap();
    let bodies: [&[u8]; 3] = [
        br#"{"specversion":"1.0","id":"ce-1","data":"x"}"#,
        "\u{FEFF}plain text".as_bytes(),
        &[
            0xEF, 1, 3, 0, 0, 0, 0, 0, 0, 1, 0, 0, 0, 0, 0, 1, 0xFF, 0, 0, 0, 0,
        ],
    ];
    for body in bodies {
        storage
            .send(&topic, Bytes::new(), Bytes::copy_from_slice(body), None)
            .await
            .unwrap();
    }
    let batch = storage
        .poll(&reader(None, &topic), &Selection::All, limits(10))
        .await
        .unwrap();
    let kinds: Vec<BodyKind> = batch.records.iter().map(|r| r.ingested.kind).collect();
    assert_eq!(
        kinds,
        [
            BodyKind::CloudEventsJson,
            BodyKind::Opaque,
            BodyKind::MalformedFrame
        ]
    );
    assert_eq!(
        &batch.records[2].ingested.frame[..],
        bodies[2],
        "original bytes for the DLQ"
    );
}

#[tokio::test]
async fn lite_channels_replay_from_their_head_for_a_fresh_reader() {
    let dir = tempfile::tempdir().unwrap();
    let parent = Topic::new("chat").unwrap();
    {
        let storage = open(dir.path());
        storage.create_topic(&parent, 4).await.unwrap();
        for i in 0..3 {
            storage
                .send_lite(&parent, "room-1", event(&format!("m{i}")))
                .await
                .unwrap();
        }
        let first = storage
            .pull_lite(&reader(None, &parent), "room-1", limits(2))
            .await
            .unwrap();
        assert_eq!(ids(&first), ["m0", "m1"]);
        assert!(first.records[0].partition.as_str().starts_with("room-1@"));
    }
    // A fresh instance (no checkpoint was written) replays from the head.
    let storage = open(dir.path());
    let replay = storage
        .pull_lite(&reader(None, &parent), "room-1", limits(10))
        .await
        .unwrap();
    assert_eq!(ids(&replay), ["m0", "m1", "m2"]);
}

#[tokio::test]
async fn appends_signal_the_waiting_readers_of_their_topic_only() {
    let dir = tempfile::tempdir().unwrap();
    let storage = open(dir.path());
    let orders = topic_with(&storage, "orders", 2, 0).await;
    let other = topic_with(&storage, "other", 1, 0).await;
    let mut waiting = storage.appends(&orders).unwrap();
    let mut elsewhere = storage.appends(&other).unwrap();
    assert!(!waiting.has_changed().unwrap());
    storage
        .send(&orders, Bytes::new(), event("e0"), None)
        .await
        .unwrap();
    assert!(
        waiting.has_changed().unwrap(),
        "an append wakes the topic's readers"
    );
    assert!(!elsewhere.has_changed().unwrap(), "and no one else's");
    waiting.borrow_and_update();
    storage
        .send_lite(&orders, "room", event("m0"))
        .await
        .unwrap();
    assert!(
        waiting.has_changed().unwrap(),
        "a lite append counts for its parent"
    );
    // A failed append signals nothing.
    elsewhere.borrow_and_update();
    let missing = PartitionId::new("7").unwrap();
    assert!(
        storage
            .send(&other, Bytes::new(), event("x"), Some(missing))
            .await
            .is_err()
    );
    assert!(!elsewhere.has_changed().unwrap());
}

#[tokio::test]
async fn unknown_topics_and_partitions_are_not_found() {
    let dir = tempfile::tempdir().unwrap();
    let storage = open(dir.path());
    let missing = Topic::new("missing").unwrap();
    let err = storage
        .poll(&reader(None, &missing), &Selection::All, limits(1))
        .await
        .unwrap_err();
    assert!(matches!(err, StorageError::UnknownTopic(_)), "{err}");
    assert_eq!(tonic::Status::from(err).code(), tonic::Code::NotFound);
    let topic = Topic::new("t").unwrap();
    storage.create_topic(&topic, 1).await.unwrap();
    let err = storage
        .poll(
            &reader(None, &topic),
            &Selection::One(PartitionId::number(5)),
            limits(1),
        )
        .await
        .unwrap_err();
    assert!(
        matches!(err, StorageError::UnknownPartition { .. }),
        "{err}"
    );
    let err = storage
        .send(&missing, Bytes::new(), event("x"), None)
        .await
        .unwrap_err();
    assert!(matches!(err, StorageError::UnknownTopic(_)), "{err}");
}

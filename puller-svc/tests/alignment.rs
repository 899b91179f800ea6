//! Alignment against a real offset-svc (in-process, over loopback gRPC): the default group's
//! and a named group's watermarks rewind the right cursors; an unreachable offset-svc moves
//! nothing and says why.

#![allow(clippy::unwrap_used)] // tests: a failed unwrap is a failed test

mod support;

use bytes::Bytes;
use eventmesh_common::keys::{GroupName, PartitionId, Topic};
use eventmesh_proto::offset::offset_service_client::OffsetServiceClient;
use eventmesh_proto::offset::{OffsetEntry, OffsetKey, WriteOffsetsRequest};
use puller_svc::alignment::{AlignError, WatermarkSource, align_reader};
use puller_svc::cursors::{Alignment, StartAt};
use puller_svc::local_log::LogSettings;
use puller_svc::storage::local::LocalStorage;
use puller_svc::storage::{PollLimits, ReaderKey, Selection, Storage};

async fn write_watermark(
    channel: &tonic::transport::Channel,
    topic: &str,
    client: &str,
    partition: &str,
    w: i64,
) {
    OffsetServiceClient::new(channel.clone())
        .write_offsets(WriteOffsetsRequest {
            entries: vec![OffsetEntry {
                key: Some(OffsetKey {
                    topic: topic.into(),
                    client_id: client.into(),
                    partition: partition.into(),
                }),
                offset: w,
            }],
            sync: false,
        })
        .await
        .unwrap();
}

async fn storage_with_pulled(dir: &std::path::Path, readers: &[&ReaderKey]) -> LocalStorage {
    let storage = LocalStorage::open(dir, LogSettings::default(), StartAt::Earliest).unwrap();
    let topic = &readers[0].topic;
    storage.create_topic(topic, 2).await.unwrap();
    for i in 0..20u32 {
        storage
            .send(
                topic,
                Bytes::new(),
                Bytes::from(format!("m{i}")),
                Some(PartitionId::number(i % 2)),
            )
            .await
            .unwrap();
    }
    for reader in readers {
        // Everything pulled: cursors at 10 in both partitions.
        let batch = storage
            .poll(
                reader,
                &Selection::All,
                PollLimits {
                    max_records: 100,
                    max_bytes: usize::MAX,
                    ..PollLimits::default()
                },
            )
            .await
            .unwrap();
        assert_eq!(batch.records.len(), 20);
    }
    storage
}

#[tokio::test]
async fn watermarks_from_offset_svc_rewind_each_group() {
    let (server, channel) = support::memory_offset_svc().await;
    let dir = tempfile::tempdir().unwrap();
    let topic = Topic::new("orders").unwrap();
    let default = ReaderKey {
        group: None,
        topic: topic.clone(),
    };
    let billing = ReaderKey {
        group: Some(GroupName::new("billing").unwrap()),
        topic: topic.clone(),
    };
    let storage = storage_with_pulled(dir.path(), &[&default, &billing]).await;
    write_watermark(&channel, "orders", "__mqcursor__", "0", 4).await;
    write_watermark(&channel, "orders", "__mqcursor@billing__", "1", 7).await;
    let source = WatermarkSource::new(eventmesh_common::grpc::traced(channel));

    let outcomes = align_reader(&storage, &source, &default).await.unwrap();
    assert_eq!(
        outcomes,
        [
            (
                PartitionId::number(0),
                Alignment::Rewound {
                    from: Some(10),
                    to: 5
                }
            ),
            (PartitionId::number(1), Alignment::NoWatermark),
        ]
    );
    let outcomes = align_reader(&storage, &source, &billing).await.unwrap();
    assert_eq!(
        outcomes,
        [
            (PartitionId::number(0), Alignment::NoWatermark),
            (
                PartitionId::number(1),
                Alignment::Rewound {
                    from: Some(10),
                    to: 8
                }
            ),
        ]
    );
    // A cursor without a watermark is dropped: nothing of that group is settled there, so
    // its next poll starts where a new reader starts.
    assert_eq!(
        storage.cursors(&default).await.unwrap(),
        [(PartitionId::number(0), 5)]
    );
    assert_eq!(
        storage.cursors(&billing).await.unwrap(),
        [(PartitionId::number(1), 8)]
    );
    server.shutdown();
    server.wait().await.unwrap();
}

#[tokio::test]
async fn an_unreachable_offset_svc_moves_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let topic = Topic::new("orders").unwrap();
    let reader = ReaderKey { group: None, topic };
    let storage = storage_with_pulled(dir.path(), &[&reader]).await;
    let channel = support::unreachable_channel();
    let err = align_reader(
        &storage,
        &WatermarkSource::new(eventmesh_common::grpc::traced(channel)),
        &reader,
    )
    .await
    .unwrap_err();
    assert!(matches!(err, AlignError::OffsetService { .. }), "{err}");
    assert!(err.to_string().contains("(default)/orders"), "{err}");
    assert_eq!(
        storage.cursors(&reader).await.unwrap(),
        [(PartitionId::number(0), 10), (PartitionId::number(1), 10)],
        "no cursor moved"
    );
}

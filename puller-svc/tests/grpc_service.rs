//! PullerService end to end over loopback gRPC, next to a real in-process offset-svc:
//! publish/pull with stamps and ranges, dispatcher re-attach realigning to the watermark
//! (frames pulled but never ACKed come back without a puller restart), credit-driven
//! streaming, long-poll, operator reads, lite channels, and bad input / unavailable offset-svc.

#![allow(clippy::unwrap_used)] // tests: a failed unwrap is a failed test

mod support;

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use eventmesh_common::frame::{Frame, FrameLimits};
use eventmesh_proto::offset::offset_service_client::OffsetServiceClient;
use eventmesh_proto::offset::{OffsetEntry, OffsetKey, WriteOffsetsRequest};
use eventmesh_proto::puller::puller_service_client::PullerServiceClient;
use eventmesh_proto::puller::{self as pb, pull_stream_request::Kind};
use puller_svc::cursors::StartAt;
use puller_svc::local_log::LogSettings;
use puller_svc::server::RunningServer;
use puller_svc::storage::Storage;
use puller_svc::storage::local::LocalStorage;
use tonic::Code;
use tonic::transport::Channel;

struct Stack {
    offsets: Option<offset_svc::server::RunningServer>,
    offset_channel: Channel,
    puller: RunningServer,
    client: PullerServiceClient<Channel>,
    _dir: tempfile::TempDir,
}

async fn stack(with_offset_svc: bool) -> Stack {
    let (offsets, offset_channel) = if with_offset_svc {
        let (server, channel) = support::memory_offset_svc().await;
        (Some(server), channel)
    } else {
        (None, support::unreachable_channel())
    };
    let dir = tempfile::tempdir().unwrap();
    let storage: Arc<dyn Storage> = Arc::new(
        LocalStorage::open(dir.path(), LogSettings::default(), StartAt::Earliest).unwrap(),
    );
    let (puller, client) = support::puller_over(storage, offset_channel.clone()).await;
    Stack {
        offsets,
        offset_channel,
        puller,
        client,
        _dir: dir,
    }
}

impl Stack {
    async fn stop(self) {
        self.puller.shutdown();
        self.puller.wait().await.unwrap();
        if let Some(offsets) = self.offsets {
            offsets.shutdown();
            offsets.wait().await.unwrap();
        }
    }
}

fn event(id: &str) -> Bytes {
    let mut frame = Frame::event();
    frame.set_attribute("id", id);
    frame.encode(&FrameLimits::DEFAULT).unwrap()
}

fn reader(group: &str, topic: &str) -> pb::GroupTopic {
    pb::GroupTopic {
        group: group.into(),
        topic: topic.into(),
    }
}

fn ids(response: &pb::PullResponse) -> Vec<String> {
    response
        .records
        .iter()
        .map(|r| {
            Frame::decode(&r.frame, &FrameLimits::DEFAULT)
                .unwrap()
                .attribute("id")
                .unwrap()
                .to_owned()
        })
        .collect()
}

async fn publish_n(client: &mut PullerServiceClient<Channel>, topic: &str, n: usize) {
    client
        .create_topic(pb::CreateTopicRequest {
            topic: topic.into(),
            partitions: 1,
        })
        .await
        .unwrap();
    for i in 0..n {
        client
            .publish(pb::PublishRequest {
                topic: topic.into(),
                body: event(&format!("e{i}")),
                key: Bytes::new(),
                partition: String::new(),
            })
            .await
            .unwrap();
    }
}

async fn pull(
    client: &mut PullerServiceClient<Channel>,
    group: &str,
    topic: &str,
    max: u32,
) -> pb::PullResponse {
    client
        .pull(pb::PullRequest {
            reader: Some(reader(group, topic)),
            partition: String::new(),
            max_records: max,
            max_bytes: 0,
            max_wait_ms: 0,
        })
        .await
        .unwrap()
        .into_inner()
}

#[tokio::test]
async fn publish_and_pull_with_stamps_and_ranges() {
    let mut stack = stack(true).await;
    publish_n(&mut stack.client, "orders", 3).await;
    let response = pull(&mut stack.client, "", "orders", 10).await;
    assert_eq!(ids(&response), ["e0", "e1", "e2"]);
    assert_eq!(response.records[2].offset, 2);
    assert_eq!(response.records[2].body_kind, pb::BodyKind::Frame as i32);
    assert_eq!(
        response.ranges,
        [pb::PartitionRange {
            partition: "0".into(),
            first: 0,
            next: 3
        }]
    );
    let end = stack
        .client
        .end_offsets(pb::EndOffsetsRequest {
            topic: "orders".into(),
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(end.partitions[0].end, 3);
    let acks = stack
        .client
        .ack_pulled(pb::AckPulledRequest {
            entries: vec![pb::AckPulledEntry {
                reader: Some(reader("", "orders")),
                ack_key: "x".into(),
            }],
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(
        acks.results[0].outcome,
        pb::AckPulledOutcome::NotApplicable as i32
    );
    stack.stop().await;
}

#[tokio::test]
async fn a_dispatcher_reattach_realigns_without_a_restart() {
    let mut stack = stack(true).await;
    publish_n(&mut stack.client, "orders", 8).await;
    assert_eq!(
        pull(&mut stack.client, "", "orders", 8).await.records.len(),
        8
    );
    // The dispatcher settled 0..4 and 7 (out of order), then died holding 5 and 6.
    OffsetServiceClient::new(stack.offset_channel.clone())
        .write_offsets(WriteOffsetsRequest {
            entries: vec![OffsetEntry {
                key: Some(OffsetKey {
                    topic: "orders".into(),
                    client_id: "__mqcursor__".into(),
                    partition: "0".into(),
                }),
                offset: 4,
            }],
            sync: false,
        })
        .await
        .unwrap();
    let attached = stack
        .client
        .attach(pb::AttachRequest {
            dispatcher_id: "dispatcher-2".into(),
            readers: vec![reader("", "orders")],
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(attached.cursors[0].next_offset, 5);
    assert_eq!(
        ids(&pull(&mut stack.client, "", "orders", 10).await),
        ["e5", "e6", "e7"]
    );
    stack.stop().await;
}

#[tokio::test]
async fn the_stream_pushes_only_within_credit() {
    let mut stack = stack(true).await;
    publish_n(&mut stack.client, "s", 10).await;
    let (tx, rx) = tokio::sync::mpsc::channel(8);
    let mut inbound = stack
        .client
        .pull_stream(tokio_stream::wrappers::ReceiverStream::new(rx))
        .await
        .unwrap()
        .into_inner();
    let credit = |records| pb::PullStreamRequest {
        kind: Some(Kind::Credit(pb::Credit {
            reader: Some(reader("", "s")),
            records,
        })),
    };
    tx.send(pb::PullStreamRequest {
        kind: Some(Kind::OpenReader(reader("", "s"))),
    })
    .await
    .unwrap();
    tx.send(credit(3)).await.unwrap();
    let mut received = Vec::new();
    while received.len() < 3 {
        let message = inbound.message().await.unwrap().unwrap();
        received.extend(ids(message.batch.as_ref().unwrap()));
    }
    assert_eq!(received, ["e0", "e1", "e2"]);
    let nothing = tokio::time::timeout(Duration::from_millis(300), inbound.message()).await;
    assert!(nothing.is_err(), "no credit, no push: {nothing:?}");
    tx.send(credit(100)).await.unwrap();
    while received.len() < 10 {
        let message = inbound.message().await.unwrap().unwrap();
        received.extend(ids(message.batch.as_ref().unwrap()));
    }
    assert_eq!(received.len(), 10);
    assert_eq!(received.last().unwrap(), "e9");
    // Credit for a reader that was never opened ends the stream with a clear status.
    tx.send(pb::PullStreamRequest {
        kind: Some(Kind::Credit(pb::Credit {
            reader: Some(reader("", "other")),
            records: 1,
        })),
    })
    .await
    .unwrap();
    let status = inbound.message().await.unwrap_err();
    assert_eq!(status.code(), Code::FailedPrecondition);
    drop(tx);
    stack.stop().await;
}

#[tokio::test]
async fn a_long_poll_returns_when_a_record_arrives() {
    let mut stack = stack(true).await;
    publish_n(&mut stack.client, "lp", 0).await;
    let mut publisher = stack.client.clone();
    let later = tokio::spawn(async move {
        tokio::time::sleep(Duration::from_millis(100)).await;
        publisher
            .publish(pb::PublishRequest {
                topic: "lp".into(),
                body: event("late"),
                key: Bytes::new(),
                partition: String::new(),
            })
            .await
            .unwrap();
    });
    let response = stack
        .client
        .pull(pb::PullRequest {
            reader: Some(reader("", "lp")),
            partition: String::new(),
            max_records: 10,
            max_bytes: 0,
            max_wait_ms: 10_000,
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(ids(&response), ["late"]);
    later.await.unwrap();
    stack.stop().await;
}

#[tokio::test]
async fn lite_channels_over_grpc() {
    let mut stack = stack(true).await;
    publish_n(&mut stack.client, "chat", 0).await;
    let created = stack
        .client
        .create_lite(pb::CreateLiteRequest {
            parent: "chat".into(),
            lite: "room".into(),
        })
        .await
        .unwrap()
        .into_inner();
    assert!(
        created.partition.starts_with("room@"),
        "{}",
        created.partition
    );
    for id in ["a", "b"] {
        stack
            .client
            .publish_lite(pb::PublishLiteRequest {
                parent: "chat".into(),
                lite: "room".into(),
                body: event(id),
            })
            .await
            .unwrap();
    }
    let pulled = stack
        .client
        .pull_lite(pb::PullLiteRequest {
            parent: "chat".into(),
            lite: "room".into(),
            max_records: 10,
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(ids(pulled.batch.as_ref().unwrap()), ["a", "b"]);
    stack.stop().await;
}

#[tokio::test]
async fn bad_input_unknown_topics_and_an_unavailable_offset_svc() {
    let mut stack = stack(false).await;
    let status = stack
        .client
        .pull(pb::PullRequest {
            reader: Some(reader("bad group", "t")),
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::InvalidArgument);
    assert!(
        status.message().contains("reader.group"),
        "{}",
        status.message()
    );
    let status = stack
        .client
        .publish(pb::PublishRequest {
            topic: "a#b".into(),
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::InvalidArgument);
    let status = stack
        .client
        .publish(pb::PublishRequest {
            topic: "missing".into(),
            body: event("x"),
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::NotFound);
    // The topic exists, but the reader cannot be aligned: offset-svc is down.
    publish_n(&mut stack.client, "t", 1).await;
    let status = stack
        .client
        .pull(pb::PullRequest {
            reader: Some(reader("", "t")),
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::Unavailable, "{status:?}");
    assert!(
        status.message().contains("offset-svc"),
        "{}",
        status.message()
    );
    stack.stop().await;
}

//! PullerService end to end over loopback gRPC, next to a real in-process offset-svc:
//! publish/pull with stamps and ranges, dispatcher re-attach realigning to the watermark
//! (frames pulled but never ACKed come back without a puller restart), fencing by attach
//! generation, positions that confirm (a lost response is read again), retention and past-end
//! reports, credit-driven streaming, long-poll, operator reads, lite channels, and bad input /
//! unavailable offset-svc.

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
    /// Generations of the readers this test attached.
    generations: std::collections::HashMap<(String, String), u64>,
    _dir: tempfile::TempDir,
}

async fn stack(with_offset_svc: bool) -> Stack {
    stack_with(with_offset_svc, LogSettings::default()).await
}

async fn stack_with(with_offset_svc: bool, settings: LogSettings) -> Stack {
    let (offsets, offset_channel) = if with_offset_svc {
        let (server, channel) = support::memory_offset_svc().await;
        (Some(server), channel)
    } else {
        (None, support::unreachable_channel())
    };
    let dir = tempfile::tempdir().unwrap();
    let storage: Arc<dyn Storage> =
        Arc::new(LocalStorage::open(dir.path(), settings, StartAt::Earliest).unwrap());
    let (puller, client) = support::puller_over(storage, offset_channel.clone()).await;
    Stack {
        offsets,
        offset_channel,
        puller,
        client,
        generations: Default::default(),
        _dir: dir,
    }
}

impl Stack {
    /// The reader's generation, attaching it (aligned to its watermark) the first time.
    async fn generation(&mut self, group: &str, topic: &str) -> u64 {
        let key = (group.to_owned(), topic.to_owned());
        if let Some(generation) = self.generations.get(&key) {
            return *generation;
        }
        let generation = support::attach(&mut self.client, "test", reader(group, topic)).await;
        self.generations.insert(key, generation);
        generation
    }

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
            implicit: false,
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

async fn pull(stack: &mut Stack, group: &str, topic: &str, max: u32) -> pb::PullResponse {
    pull_from(stack, group, topic, max, &[]).await.unwrap()
}

fn positions(at: &[(&str, i64)]) -> Vec<pb::Position> {
    at.iter()
        .map(|(partition, next)| pb::Position {
            partition: (*partition).into(),
            next: *next,
        })
        .collect()
}

async fn pull_from(
    stack: &mut Stack,
    group: &str,
    topic: &str,
    max: u32,
    at: &[(&str, i64)],
) -> Result<pb::PullResponse, tonic::Status> {
    let generation = stack.generation(group, topic).await;
    stack
        .client
        .pull(pb::PullRequest {
            reader: Some(reader(group, topic)),
            max_records: max,
            generation,
            positions: positions(at),
            ..Default::default()
        })
        .await
        .map(tonic::Response::into_inner)
}

/// `bare_frames`: our own frames come exactly as published (no stamps), their place in the
/// record's fields; a second reader that does not ask gets the same records stamped.
#[tokio::test]
async fn bare_frames_come_as_published_with_their_place_in_the_record() {
    let mut stack = stack(true).await;
    publish_n(&mut stack.client, "orders", 3).await;
    let generation = stack.generation("bare", "orders").await;
    let bare = stack
        .client
        .pull(pb::PullRequest {
            reader: Some(reader("bare", "orders")),
            max_records: 10,
            generation,
            bare_frames: true,
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    let places: Vec<_> = bare
        .records
        .iter()
        .map(|r| (r.partition.as_str(), r.offset, r.frame.clone()))
        .collect();
    assert_eq!(
        places,
        [
            ("0", 0, event("e0")),
            ("0", 1, event("e1")),
            ("0", 2, event("e2"))
        ]
    );
    let stamped = pull(&mut stack, "stamped", "orders", 10).await;
    let frame = Frame::decode(&stamped.records[2].frame, &FrameLimits::STAMPED).unwrap();
    assert_eq!(frame.attribute("emmqpartition"), Some("0"));
    assert_eq!(frame.attribute("emmqoffset"), Some("2"));
}

#[tokio::test]
async fn publish_and_pull_with_stamps_and_ranges() {
    let mut stack = stack(true).await;
    publish_n(&mut stack.client, "orders", 3).await;
    let response = pull(&mut stack, "", "orders", 10).await;
    assert_eq!(ids(&response), ["e0", "e1", "e2"]);
    assert_eq!(response.records[2].offset, 2);
    assert_eq!(response.records[2].body_kind, pb::BodyKind::Frame as i32);
    assert_eq!(
        response.ranges,
        [pb::PartitionRange {
            partition: "0".into(),
            first: 0,
            next: 3,
            lost_to_retention: 0,
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
    assert_eq!(pull(&mut stack, "", "orders", 8).await.records.len(), 8);
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
            positions: Vec::new(),
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(attached.cursors[0].next_offset, 5);
    stack.generations.insert(
        (String::new(), "orders".into()),
        attached.generations[0].generation,
    );
    assert_eq!(
        ids(&pull(&mut stack, "", "orders", 10).await),
        ["e5", "e6", "e7"]
    );
    stack.stop().await;
}

/// A second (or stale) dispatcher cannot move a reader it does not hold: its pulls are
/// refused, naming the holder; a reader never attached is refused without one.
#[tokio::test]
async fn pulls_carry_the_attach_generation_and_a_stale_one_is_refused() {
    let mut stack = stack(true).await;
    publish_n(&mut stack.client, "fenced", 4).await;
    let old = support::attach(&mut stack.client, "dispatcher-a", reader("g", "fenced")).await;
    let request = |generation| pb::PullRequest {
        reader: Some(reader("g", "fenced")),
        max_records: 2,
        generation,
        ..Default::default()
    };
    let first = stack.client.pull(request(old)).await.unwrap().into_inner();
    assert_eq!(ids(&first), ["e0", "e1"]);
    let new = support::attach(&mut stack.client, "dispatcher-b", reader("g", "fenced")).await;
    assert_ne!(new, old);
    let refused = stack.client.pull(request(old)).await.unwrap_err();
    assert_eq!(refused.code(), Code::FailedPrecondition);
    assert_eq!(
        refused.metadata().get("em-reader-holder").unwrap(),
        "dispatcher-b"
    );
    assert!(
        refused.message().contains("dispatcher-b"),
        "{}",
        refused.message()
    );
    // The refused pull moved nothing: the holder reads from where its attach put it.
    let holder = stack.client.pull(request(new)).await.unwrap().into_inner();
    assert_eq!(ids(&holder), ["e0", "e1"]);
    let never = stack
        .client
        .pull(pb::PullRequest {
            reader: Some(reader("other", "fenced")),
            generation: new,
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(never.code(), Code::FailedPrecondition);
    assert!(never.metadata().get("em-reader-holder").is_none());
    assert!(
        never.message().contains("not attached"),
        "{}",
        never.message()
    );
    stack.stop().await;
}

/// A long poll of the generation an Attach ends is refused as the attach happens, not when its
/// wait runs out: the dispatcher that lost the reader hears it at once.
#[tokio::test]
async fn a_waiting_long_poll_is_refused_when_the_reader_is_attached_again() {
    let mut stack = stack(true).await;
    publish_n(&mut stack.client, "fenced-wait", 0).await;
    let old = support::attach(
        &mut stack.client,
        "dispatcher-a",
        reader("g", "fenced-wait"),
    )
    .await;
    let mut stale = stack.client.clone();
    let waiting = tokio::spawn(async move {
        stale
            .pull(pb::PullRequest {
                reader: Some(reader("g", "fenced-wait")),
                max_records: 10,
                max_wait_ms: 30_000,
                generation: old,
                ..Default::default()
            })
            .await
    });
    // Let the poll find nothing and wait: its look-again timer (1 s) fires 1 s after it
    // began, 0.8 s after the attach below.
    tokio::time::sleep(Duration::from_millis(200)).await;
    let new = support::attach(
        &mut stack.client,
        "dispatcher-b",
        reader("g", "fenced-wait"),
    )
    .await;
    let attached = std::time::Instant::now();
    assert_ne!(new, old);
    let refused = tokio::time::timeout(Duration::from_secs(20), waiting)
        .await
        .expect("the stale long poll was answered before its 30 s wait ran out")
        .unwrap()
        .unwrap_err();
    // Woken by the attach, not by its timer (which would answer about 0.8 s after it).
    assert!(
        attached.elapsed() < Duration::from_millis(500),
        "refused {:?} after the attach",
        attached.elapsed()
    );
    assert_eq!(refused.code(), Code::FailedPrecondition);
    assert_eq!(
        refused.metadata().get("em-reader-holder").unwrap(),
        "dispatcher-b"
    );
    stack.stop().await;
}

/// The hole: a response lost after the cursor moved. Naming the position the last kept
/// batch ended at reads it again instead of skipping it.
#[tokio::test]
async fn a_lost_response_is_read_again_from_the_confirmed_position() {
    let mut stack = stack(true).await;
    publish_n(&mut stack.client, "confirm", 6).await;
    let lost = pull_from(&mut stack, "g", "confirm", 3, &[("0", 0)])
        .await
        .unwrap();
    assert_eq!(ids(&lost), ["e0", "e1", "e2"]);
    // The answer never arrived: the caller names the same position again.
    let again = pull_from(&mut stack, "g", "confirm", 3, &[("0", 0)])
        .await
        .unwrap();
    assert_eq!(ids(&again), ["e0", "e1", "e2"]);
    assert_eq!(again.ranges[0].first, 0);
    let next = pull_from(&mut stack, "g", "confirm", 10, &[("0", 3)])
        .await
        .unwrap();
    assert_eq!(ids(&next), ["e3", "e4", "e5"]);
    assert_eq!((next.ranges[0].first, next.ranges[0].next), (3, 6));
    stack.stop().await;
}

/// Positions name what is read; the others are reported with their ranges. A position below
/// the log start reports what retention removed; one past the end is reported and not moved.
#[tokio::test]
async fn positions_report_unpositioned_partitions_retention_losses_and_past_end() {
    let settings = LogSettings {
        segment_bytes: 512,
        retention_bytes: Some(1024),
        retention_ms: None,
        ..LogSettings::default()
    };
    let mut stack = stack_with(true, settings).await;
    stack
        .client
        .create_topic(pb::CreateTopicRequest {
            topic: "ret".into(),
            partitions: 2,
            implicit: false,
        })
        .await
        .unwrap();
    for i in 0..60 {
        stack
            .client
            .publish(pb::PublishRequest {
                topic: "ret".into(),
                body: event(&format!("e{i}")),
                partition: "0".into(),
                ..Default::default()
            })
            .await
            .unwrap();
    }
    let ends = stack
        .client
        .end_offsets(pb::EndOffsetsRequest {
            topic: "ret".into(),
        })
        .await
        .unwrap()
        .into_inner();
    let start = ends.partitions[0].start;
    assert!(start > 0, "retention removed the oldest segments");
    let batch = pull_from(&mut stack, "g", "ret", 5, &[("0", 0)])
        .await
        .unwrap();
    assert_eq!(
        batch.ranges[0].first, 0,
        "the range starts where the read started"
    );
    assert_eq!(batch.ranges[0].lost_to_retention, start);
    assert_eq!(batch.records[0].offset, start);
    assert_eq!(
        batch.unpositioned,
        [pb::PartitionOffsets {
            partition: "1".into(),
            start: 0,
            end: 0
        }]
    );
    let past = pull_from(&mut stack, "g", "ret", 5, &[("0", 500)])
        .await
        .unwrap();
    assert!(past.records.is_empty() && past.ranges.is_empty());
    assert_eq!(
        past.past_end,
        [pb::PastEnd {
            partition: "0".into(),
            position: 500,
            log_start: start,
            log_end: 60
        }]
    );
    let cursors = stack
        .client
        .cursors(pb::CursorsRequest {
            topic: "ret".into(),
            group: "g".into(),
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(cursors.cursors[0].next_offset, 500, "reported, not moved");
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
    let generation = stack.generation("", "s").await;
    tx.send(pb::PullStreamRequest {
        kind: Some(Kind::Open(pb::OpenReader {
            reader: Some(reader("", "s")),
            generation,
            positions: Vec::new(),
        })),
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

/// An open without a generation (the superseded form) is refused.
#[tokio::test]
async fn a_stream_open_without_a_generation_is_refused() {
    let mut stack = stack(true).await;
    publish_n(&mut stack.client, "s", 1).await;
    let (tx, rx) = tokio::sync::mpsc::channel(8);
    let mut inbound = stack
        .client
        .pull_stream(tokio_stream::wrappers::ReceiverStream::new(rx))
        .await
        .unwrap()
        .into_inner();
    tx.send(pb::PullStreamRequest {
        kind: Some(Kind::OpenReader(reader("", "s"))),
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
    let generation = stack.generation("", "lp").await;
    let response = stack
        .client
        .pull(pb::PullRequest {
            reader: Some(reader("", "lp")),
            max_records: 10,
            max_wait_ms: 10_000,
            generation,
            ..Default::default()
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
        .attach(pb::AttachRequest {
            dispatcher_id: "d".into(),
            readers: vec![reader("", "t")],
            positions: Vec::new(),
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

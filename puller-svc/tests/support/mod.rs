//! Shared by puller-svc's integration tests: a real offset-svc next to the puller.

#![allow(dead_code, clippy::unwrap_used)] // each test binary uses a subset

use std::sync::Arc;
use std::time::Duration;

use eventmesh_common::shutdown::CancellationToken;
use eventmesh_proto::puller::puller_service_client::PullerServiceClient;
use offset_svc::config::{Config, StoreKind};
use puller_svc::alignment::WatermarkSource;
use puller_svc::server::RunningServer;
use puller_svc::service::PullerGrpc;
use puller_svc::storage::Storage;
use tonic::transport::Channel;

use bytes::Bytes;
use eventmesh_common::frame::{Frame, FrameLimits};
use eventmesh_common::keys::{GroupName, Topic};
use puller_svc::storage::{PollLimits, PolledBatch, ReaderKey, Selection, StorageError};
use std::time::Instant;

/// An in-process offset-svc (memory store) on a free loopback port, and a channel to it.
pub async fn memory_offset_svc() -> (offset_svc::server::RunningServer, Channel) {
    let config = Config {
        listen: "127.0.0.1:0".parse().unwrap(),
        store: StoreKind::Memory,
        ..Config::default()
    };
    let server = offset_svc::server::start(config, CancellationToken::new())
        .await
        .unwrap();
    let channel = server.channel().await.unwrap();
    (server, channel)
}

/// A lazy channel to a loopback port nothing listens on (an offset-svc that is down).
pub fn unreachable_channel() -> Channel {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    tonic::transport::Endpoint::from_shared(format!("http://127.0.0.1:{port}"))
        .unwrap()
        .connect_lazy()
}

/// An in-process puller-svc over `storage`, reading watermarks through `offset_svc`, and a
/// client to it.
pub async fn puller_over(
    storage: Arc<dyn Storage>,
    offset_svc: Channel,
) -> (RunningServer, PullerServiceClient<Channel>) {
    let grpc = PullerGrpc::new(
        Arc::clone(&storage),
        WatermarkSource::new(eventmesh_common::grpc::traced(offset_svc)),
    );
    let server = puller_svc::server::start(
        "127.0.0.1:0".parse().unwrap(),
        storage,
        grpc,
        CancellationToken::new(),
        Duration::from_secs(2),
    )
    .await
    .unwrap();
    let client = PullerServiceClient::connect(format!("http://{}", server.local_addr()))
        .await
        .unwrap();
    (server, client)
}

/// Attaches one reader for `dispatcher` (aligned to its watermark); returns its generation.
pub async fn attach(
    client: &mut PullerServiceClient<Channel>,
    dispatcher: &str,
    reader: eventmesh_proto::puller::GroupTopic,
) -> u64 {
    client
        .attach(eventmesh_proto::puller::AttachRequest {
            dispatcher_id: dispatcher.into(),
            readers: vec![reader],
            positions: Vec::new(),
        })
        .await
        .unwrap()
        .into_inner()
        .generations[0]
        .generation
}

// Shared by the backend tests (kafka, rocketmq4).

pub fn event(id: &str) -> Bytes {
    let mut frame = Frame::event();
    frame.set_attribute("id", id);
    frame.encode(&FrameLimits::DEFAULT).unwrap()
}

pub fn reader(group: Option<&str>, topic: &Topic) -> ReaderKey {
    ReaderKey {
        group: group.map(|g| GroupName::new(g).unwrap()),
        topic: topic.clone(),
    }
}

pub fn limits(max_records: usize) -> PollLimits {
    PollLimits {
        max_records,
        ..PollLimits::default()
    }
}

/// Polls until `n` records arrived, at most 10 s.
pub async fn poll_n(storage: &dyn Storage, reader: &ReaderKey, n: usize) -> PolledBatch {
    let mut all = PolledBatch::default();
    let deadline = Instant::now() + Duration::from_secs(10);
    while Instant::now() < deadline {
        let batch = storage
            .poll(reader, &Selection::All, limits(n - all.records.len()))
            .await
            .unwrap();
        all.records.extend(batch.records);
        all.ranges.extend(batch.ranges);
        if all.records.len() >= n {
            return all;
        }
    }
    panic!("only {} of {n} records arrived", all.records.len());
}

pub fn ids(batch: &PolledBatch) -> Vec<String> {
    batch
        .records
        .iter()
        .map(|r| {
            Frame::decode(&r.ingested.frame, &FrameLimits::STAMPED)
                .unwrap()
                .attribute("id")
                .unwrap_or("-")
                .to_owned()
        })
        .collect()
}

pub mod binary;
pub mod recording;

/// A RocketMQ broker frozen (SIGSTOP) under `storage`: a poll brings nothing or UNAVAILABLE, a
/// send fails UNAVAILABLE; after SIGCONT everything comes, nothing lost or skipped.
pub async fn a_frozen_broker_loses_nothing(
    storage: &dyn Storage,
    rocketmq: &eventmesh_testkit::RocketMq,
    topic: &Topic,
) {
    storage.create_topic(topic, 1).await.unwrap();
    for i in 0..3 {
        storage
            .send(topic, Bytes::new(), event(&format!("e{i}")), None)
            .await
            .unwrap();
    }
    let group = reader(None, topic);
    let first = storage
        .poll(&group, &Selection::All, limits(1))
        .await
        .unwrap();
    assert_eq!(ids(&first), ["e0"]);
    rocketmq.signal_broker("broker-a", "-STOP");
    let frozen = storage.poll(&group, &Selection::All, limits(10)).await;
    let sent = storage
        .send(topic, Bytes::new(), event("lost?"), None)
        .await;
    rocketmq.signal_broker("broker-a", "-CONT");
    match frozen {
        Err(StorageError::Unavailable(why)) => assert!(why.contains("rocketmq"), "{why}"),
        Ok(batch) => assert!(
            batch.records.is_empty(),
            "nothing can come from a frozen broker"
        ),
        Err(other) => panic!("unexpected error while frozen: {other}"),
    }
    assert!(
        matches!(sent, Err(StorageError::Unavailable(_))),
        "a send to a frozen broker fails: {sent:?}"
    );
    assert_eq!(
        ids(&poll_n(storage, &group, 2).await),
        ["e1", "e2"],
        "nothing lost or skipped"
    );
}

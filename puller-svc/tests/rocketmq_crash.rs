//! The real puller-svc binary on `rocketmq4` and on `rocketmq5` over two real brokers, next to
//! a real offset-svc: a group reads every queue, its dispatcher settles each queue to a different watermark (ACKs
//! out of order), the puller is killed with `kill -9` after checkpointing cursors past all of
//! it; after the restart exactly the un-settled messages come back, each from its own
//! `broker:queue` — never a neighbour's (the reference rewound a flattened queue index). On
//! `rocketmq5` the brokers' POP positions stay past everything and the broker never revives
//! an un-ACKed POP: the restarted puller must set them back to its rewound cursors.

#![allow(clippy::unwrap_used)] // tests: a failed unwrap is a failed test

mod support;

use std::collections::BTreeSet;
use std::time::{Duration, Instant};

use bytes::Bytes;
use eventmesh_common::frame::{Frame, FrameLimits};
use eventmesh_proto::offset::offset_service_client::OffsetServiceClient;
use eventmesh_proto::offset::{OffsetEntry, OffsetKey, WriteOffsetsRequest};
use eventmesh_proto::puller::{self as pb};
use eventmesh_testkit::RocketMq;
use support::binary::Puller;

const TOPIC: &str = "em-rmq-crash";
const PER_QUEUE: i64 = 10;

fn event(id: &str) -> Bytes {
    let mut frame = Frame::event();
    frame.set_attribute("id", id);
    frame.encode(&FrameLimits::DEFAULT).unwrap()
}

fn reader(group: &str) -> pb::GroupTopic {
    pb::GroupTopic {
        group: group.into(),
        topic: TOPIC.into(),
    }
}

/// `(partition, offset, id)` of every record a group's reader hands out until it has nothing
/// more for a second (attaching it first, which aligns it as a dispatcher's attach does).
async fn drain(puller: &mut Puller, group: &str) -> BTreeSet<(String, i64, String)> {
    let generation = support::attach(&mut puller.client, "test", reader(group)).await;
    let mut got = BTreeSet::new();
    let mut quiet_since = Instant::now();
    while quiet_since.elapsed() < Duration::from_secs(1) {
        let response = puller
            .client
            .pull(pb::PullRequest {
                reader: Some(reader(group)),
                max_records: 100,
                max_wait_ms: 200,
                generation,
                ..Default::default()
            })
            .await
            .unwrap()
            .into_inner();
        if !response.records.is_empty() {
            quiet_since = Instant::now();
        }
        for record in response.records {
            let frame = Frame::decode(&record.frame, &FrameLimits::STAMPED).unwrap();
            let id = frame.attribute("id").unwrap().to_owned();
            assert!(
                got.insert((record.partition, record.offset, id)),
                "one pass hands each record out once"
            );
        }
    }
    got
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn kill_minus_nine_brings_back_exactly_the_unsettled_messages_of_each_queue_rocketmq4() {
    kill_minus_nine_brings_back_exactly_the_unsettled_messages("rocketmq4").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn kill_minus_nine_brings_back_exactly_the_unsettled_messages_of_each_queue_rocketmq5() {
    kill_minus_nine_brings_back_exactly_the_unsettled_messages("rocketmq5").await;
}

async fn kill_minus_nine_brings_back_exactly_the_unsettled_messages(backend_name: &str) {
    let rocketmq = RocketMq::start_own();
    rocketmq.start_broker("broker-b");
    let (offsets, offset_channel) = support::memory_offset_svc().await;
    let offset_url = format!("http://{}", offsets.local_addr());
    let dir = tempfile::tempdir().unwrap();
    let backend = [
        "--backend",
        backend_name,
        "--rocketmq-namesrv",
        rocketmq.namesrv(),
    ];
    let mut puller = Puller::start(dir.path(), &offset_url, &backend).await;
    puller
        .client
        .create_topic(pb::CreateTopicRequest {
            topic: TOPIC.into(),
            partitions: 2,
            implicit: false,
        })
        .await
        .unwrap();
    let queues = ["broker-a:0", "broker-a:1", "broker-b:0", "broker-b:1"];
    let mut sent = BTreeSet::new();
    for queue in queues {
        for i in 0..PER_QUEUE {
            let id = format!("{queue}/{i}");
            let answer = puller
                .client
                .publish(pb::PublishRequest {
                    topic: TOPIC.into(),
                    body: event(&id),
                    key: Bytes::new(),
                    partition: queue.into(),
                })
                .await
                .unwrap()
                .into_inner();
            assert_eq!(answer.partition, queue);
            sent.insert((queue.to_owned(), answer.offset, id));
        }
    }
    let first = drain(&mut puller, "g").await;
    assert_eq!(first, sent, "every message once, from its own queue");
    // The cursors past everything are checkpointed before the crash.
    let checkpoint = dir
        .path()
        .join(format!("{backend_name}-pull-offsets@g.properties"));
    let written = |text: &str| {
        queues
            .iter()
            .all(|q| text.contains(&format!("{TOPIC}\\#{}={PER_QUEUE}", q.replace(':', "\\:"))))
    };
    let deadline = Instant::now() + Duration::from_secs(10);
    while !std::fs::read_to_string(&checkpoint).is_ok_and(|t| written(&t)) {
        assert!(Instant::now() < deadline, "cursors never checkpointed");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // The dispatcher settled each queue to its own watermark (ACKs out of order across them):
    // all of broker-a:0, nothing of broker-b:0.
    let watermarks = [
        ("broker-a:0", PER_QUEUE - 1),
        ("broker-a:1", 3),
        ("broker-b:0", -1),
        ("broker-b:1", 6),
    ];
    OffsetServiceClient::new(offset_channel.clone())
        .write_offsets(WriteOffsetsRequest {
            entries: watermarks
                .iter()
                .map(|(queue, watermark)| OffsetEntry {
                    key: Some(OffsetKey {
                        topic: TOPIC.into(),
                        client_id: "__mqcursor@g__".into(),
                        partition: (*queue).into(),
                    }),
                    offset: *watermark,
                })
                .collect(),
            sync: true,
        })
        .await
        .unwrap();
    puller.kill9();

    let mut puller = Puller::start(dir.path(), &offset_url, &backend).await;
    let expected: BTreeSet<_> = sent
        .iter()
        .filter(|(queue, offset, _)| {
            let watermark = watermarks.iter().find(|(q, _)| q == queue).unwrap().1;
            *offset > watermark
        })
        .cloned()
        .collect();
    assert_eq!(expected.len(), 6 + 10 + 3);
    let again = drain(&mut puller, "g").await;
    assert_eq!(
        again, expected,
        "exactly the unsettled messages, each from its own queue"
    );
    drop(puller);
    offsets.shutdown();
    offsets.wait().await.unwrap();
}

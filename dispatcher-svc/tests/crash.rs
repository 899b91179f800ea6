//! Crash tests of the real dispatcher binary (`kill -9`, and the named crash points of
//! `EM_DISPATCHER_CRASH_AT`), with puller-svc and offset-svc alive in this process. A checker
//! counts every event: nothing un-ACKed may be lost, nothing ACKed at or below the stored
//! watermark may come back, and duplicates are bounded by what was in flight.

#![allow(clippy::unwrap_used)]

mod support;

use std::collections::{BTreeMap, BTreeSet};
use std::net::SocketAddr;
use std::time::Duration;

use eventmesh_proto::client::{AckOutcome, Delivery, SubscriptionMode};
use support::*;

const WAIT: Duration = Duration::from_secs(10);

struct Neighbours {
    _dir: tempfile::TempDir,
    offset_svc: offset_svc::server::RunningServer,
    puller: puller_svc::server::RunningServer,
}

impl Neighbours {
    async fn start(topic: &str) -> Neighbours {
        Neighbours::start_with(topic, 1).await
    }

    /// With `topic` made of `partitions` partitions.
    async fn start_with(topic: &str, partitions: u32) -> Neighbours {
        let dir = tempfile::tempdir().unwrap();
        let offset_svc =
            start_offset_svc(&dir.path().join("offsets"), "127.0.0.1:0".parse().unwrap()).await;
        let puller = start_puller(&dir.path().join("puller"), offset_svc.local_addr()).await;
        let mut client = eventmesh_proto::puller::puller_service_client::PullerServiceClient::new(
            lazy(puller.local_addr()),
        );
        client
            .create_topic(eventmesh_proto::puller::CreateTopicRequest {
                topic: topic.into(),
                partitions,
                implicit: false,
            })
            .await
            .unwrap();
        Neighbours {
            _dir: dir,
            offset_svc,
            puller,
        }
    }

    fn dispatcher(&self, crash_at: Option<&str>) -> Dispatcher {
        self.dispatcher_with(crash_at, &[])
    }

    fn dispatcher_with(&self, crash_at: Option<&str>, flags: &[&str]) -> Dispatcher {
        Dispatcher::start_with(
            self.puller.local_addr(),
            self.offset_svc.local_addr(),
            crash_at,
            flags,
        )
    }

    async fn watermark(&self, topic: &str) -> Option<i64> {
        let mut offsets = eventmesh_proto::offset::offset_service_client::OffsetServiceClient::new(
            lazy(self.offset_svc.local_addr()),
        );
        offsets
            .read_topic_offsets(eventmesh_proto::offset::ReadTopicOffsetsRequest {
                topic: topic.into(),
                client_id: "__mqcursor__".into(),
            })
            .await
            .unwrap()
            .into_inner()
            .entries
            .first()
            .map(|e| e.offset)
    }
}

async fn publish_via(addr: SocketAddr, topic: &str, range: std::ops::Range<u64>) {
    let mut client =
        eventmesh_proto::client::event_mesh_service_client::EventMeshServiceClient::new(lazy(addr));
    publish(&mut client, topic, range).await;
}

/// The deliveries at `offsets`, in that order.
fn delivered_at<const N: usize>(
    by_offset: &BTreeMap<i64, eventmesh_proto::client::Delivery>,
    offsets: [i64; N],
) -> Vec<eventmesh_proto::client::Delivery> {
    offsets.iter().map(|o| by_offset[o].clone()).collect()
}

fn lb(topic: &str) -> eventmesh_proto::client::Open {
    open("crash-app", topic, "", SubscriptionMode::LoadBalance)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kill_minus_nine_after_out_of_order_acks_brings_back_every_unacked_event() {
    let topic = "crashy";
    let neighbours = Neighbours::start(topic).await;
    let mut dispatcher = neighbours.dispatcher(None);
    publish_via(dispatcher.addr, topic, 0..10).await;
    let mut session = subscribe(dispatcher.addr, lb(topic)).await;
    let delivered = session.deliveries(10, WAIT).await;
    assert_eq!(delivered.len(), 10);
    let by_offset: BTreeMap<i64, _> = delivered.iter().map(|d| (d.offset, d.clone())).collect();
    // In order 0..=2, then out of order 7, 4, 6; 3, 5, 8, 9 stay un-ACKed.
    session
        .ack_durably(&delivered_at(&by_offset, [0, 1, 2]))
        .await;
    let above_gap = delivered_at(&by_offset, [7, 4, 6]);
    let ids: Vec<&str> = above_gap.iter().map(|d| d.delivery_id.as_str()).collect();
    session.ack(&ids).await;
    // A second ACK of 0 is answered only after the group took the three before it.
    session.ack(&[&by_offset[&0].delivery_id]).await;
    let results = session.results(1, WAIT).await;
    assert_eq!(
        results.iter().map(|r| r.outcome()).collect::<Vec<_>>(),
        [AckOutcome::AlreadySettled],
        "ACKs above the gap are not DURABLE: {results:?}"
    );
    assert_eq!(
        neighbours.watermark(topic).await,
        Some(2),
        "the gap at 3 holds the watermark"
    );
    dispatcher.kill9();
    drop(session);

    let restarted = neighbours.dispatcher(None);
    let mut session = subscribe(restarted.addr, lb(topic)).await;
    let again = session.deliveries(10, Duration::from_secs(3)).await;
    let mut seen: BTreeMap<i64, usize> = BTreeMap::new();
    for d in &again {
        *seen.entry(d.offset).or_default() += 1;
    }
    for lost in [3, 5, 8, 9] {
        assert_eq!(
            seen.get(&lost),
            Some(&1),
            "un-ACKed offset {lost} must come back once"
        );
    }
    for not_durable in [4, 6, 7] {
        assert_eq!(
            seen.get(&not_durable),
            Some(&1),
            "offset {not_durable} was ACKed above the gap, never answered DURABLE: it comes back once"
        );
    }
    for settled in [0, 1, 2] {
        assert_eq!(
            seen.get(&settled),
            None,
            "offset {settled} is below the watermark"
        );
    }
    // Exactly what was above the watermark comes back.
    assert_eq!(again.len(), 7, "{seen:?}");
    session.ack_durably(&again).await;
    assert_eq!(neighbours.watermark(topic).await, Some(9));
}

/// A group spread over two shards (`--group-shards 2`; of 4 partitions shard 0 owns 0 and 2,
/// shard 1 owns 1 and 3). ACKs arrive out of order within partitions and interleaved across
/// shards; then `kill -9`. Every partition comes back from its own stored watermark: what was
/// answered DURABLE never comes back, everything else (un-ACKed, or ACKed above a gap and so
/// never answered DURABLE) comes back exactly once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kill_minus_nine_of_a_sharded_group_brings_back_exactly_what_each_partition_did_not_settle()
{
    let topic = "sharded";
    let neighbours = Neighbours::start_with(topic, 4).await;
    let sharded = ["--group-shards", "2"];
    let mut dispatcher = neighbours.dispatcher_with(None, &sharded);
    publish_via(dispatcher.addr, topic, 0..80).await;
    let mut session = subscribe(dispatcher.addr, lb(topic)).await;
    let delivered = session.deliveries(80, WAIT).await;
    assert_eq!(delivered.len(), 80);
    let issuers: BTreeSet<&str> = delivered
        .iter()
        .map(|d| d.delivery_id.split('.').nth(1).unwrap())
        .collect();
    assert_eq!(issuers.len(), 2, "two shards issue the deliveries");
    let mut by_partition: BTreeMap<String, BTreeMap<i64, Delivery>> = BTreeMap::new();
    for d in &delivered {
        by_partition
            .entry(d.partition.clone())
            .or_default()
            .insert(d.offset, d.clone());
    }
    assert_eq!(by_partition.len(), 4);
    for (partition, deliveries) in &by_partition {
        assert!(
            deliveries.len() >= 6,
            "partition {partition}: {deliveries:?}"
        );
        assert_eq!(
            deliveries.keys().copied().collect::<Vec<_>>(),
            (0..deliveries.len() as i64).collect::<Vec<_>>()
        );
    }
    let at = |partition: &str, offset: i64| by_partition[partition][&offset].clone();
    // Offsets 1 then 0 of every partition, partitions in the order 3, 0, 1, 2 (shards 1, 0,
    // 1, 0): offset 1 waits for 0 in each, then both are DURABLE.
    let mut settled = Vec::new();
    for offset in [1, 0] {
        for partition in ["3", "0", "1", "2"] {
            settled.push(at(partition, offset));
        }
    }
    session.ack_durably(&settled).await;
    // Offsets 4 and 3 of every partition, above the gap at 2: accepted, never DURABLE.
    let mut above_gap = Vec::new();
    for partition in ["2", "1", "0", "3"] {
        above_gap.push(at(partition, 4));
        above_gap.push(at(partition, 3));
    }
    let ids: Vec<&str> = above_gap.iter().map(|d| d.delivery_id.as_str()).collect();
    session.ack(&ids).await;
    // A repeated ACK to each shard is answered after that shard took the ones before it.
    session
        .ack(&[&at("0", 0).delivery_id, &at("1", 0).delivery_id])
        .await;
    let results = session.results(2, WAIT).await;
    assert_eq!(
        results.iter().map(|r| r.outcome()).collect::<Vec<_>>(),
        [AckOutcome::AlreadySettled, AckOutcome::AlreadySettled],
        "ACKs above the gaps are not DURABLE: {results:?}"
    );
    let stored = stored_offsets(neighbours.offset_svc.local_addr(), topic, "__mqcursor__").await;
    for partition in ["0", "1", "2", "3"] {
        assert_eq!(
            stored[partition], 1,
            "partition {partition}: the gap at 2 holds it"
        );
    }
    dispatcher.kill9();
    drop(session);

    let restarted = neighbours.dispatcher_with(None, &sharded);
    let mut session = subscribe(restarted.addr, lb(topic)).await;
    let expected = 80 - 4 * 2;
    let again = session
        .deliveries(expected + 1, Duration::from_secs(3))
        .await;
    let mut seen: BTreeMap<(String, i64), usize> = BTreeMap::new();
    for d in &again {
        *seen.entry((d.partition.clone(), d.offset)).or_default() += 1;
    }
    for (partition, deliveries) in &by_partition {
        for offset in deliveries.keys() {
            let times = seen.get(&(partition.clone(), *offset)).copied();
            if *offset <= 1 {
                assert_eq!(times, None, "{partition}@{offset} was DURABLE");
            } else {
                assert_eq!(times, Some(1), "{partition}@{offset} was not settled: once");
            }
        }
    }
    assert_eq!(again.len(), expected, "{seen:?}");
    session.ack_durably(&again).await;
    let stored = stored_offsets(neighbours.offset_svc.local_addr(), topic, "__mqcursor__").await;
    for (partition, deliveries) in &by_partition {
        assert_eq!(stored[partition], deliveries.len() as i64 - 1);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn crash_after_deliver_redelivers_the_delivered_event() {
    let topic = "after-deliver";
    let neighbours = Neighbours::start(topic).await;
    let mut dispatcher = neighbours.dispatcher(Some("after-deliver"));
    publish_via(dispatcher.addr, topic, 0..3).await;
    let session = try_subscribe(dispatcher.addr, lb(topic)).await;
    assert!(dispatcher.died_within(WAIT), "the crash point must fire");
    drop(session);
    let restarted = neighbours.dispatcher(None);
    let mut session = subscribe(restarted.addr, lb(topic)).await;
    let all = session.deliveries(3, WAIT).await;
    assert_eq!(all.iter().map(number).collect::<Vec<_>>(), [0, 1, 2]);
    session.ack_durably(&all).await;
    assert_eq!(neighbours.watermark(topic).await, Some(2));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn crash_after_the_offset_write_does_not_redeliver_what_became_durable() {
    let topic = "after-write";
    let neighbours = Neighbours::start(topic).await;
    let mut dispatcher = neighbours.dispatcher(Some("after-offset-write"));
    publish_via(dispatcher.addr, topic, 0..3).await;
    let mut session = subscribe(dispatcher.addr, lb(topic)).await;
    let delivered = session.deliveries(3, WAIT).await;
    assert_eq!(delivered.len(), 3);
    session.ack(&[&delivered[0].delivery_id]).await;
    assert!(dispatcher.died_within(WAIT), "the crash point must fire");
    drop(session);
    assert_eq!(
        neighbours.watermark(topic).await,
        Some(0),
        "the write was durable"
    );
    let restarted = neighbours.dispatcher(None);
    let mut session = subscribe(restarted.addr, lb(topic)).await;
    let rest = session.deliveries(3, Duration::from_secs(3)).await;
    assert_eq!(rest.iter().map(number).collect::<Vec<_>>(), [1, 2]);
    session.ack_durably(&rest).await;
}

//! The broker ACK of `rocketmq5` through a whole instance (offset-svc on RocksDB, puller-svc
//! over a real name server and broker from `scripts/rocketmq.sh`, the dispatcher): every
//! message gets exactly one `ack_pulled`, only after the client's ACK made it durable (also
//! while a client holds one for 10 s), the broker answers ACKED; a dead letter's broker ACK
//! comes after its `<topic>_DLQ` send, a malformed body included. What the puller did is seen
//! through `RecordingStorage`; what the broker said is its own answer.

#![allow(clippy::unwrap_used)] // tests: a failed unwrap is a failed test

#[path = "../../puller-svc/tests/support/recording.rs"]
#[allow(dead_code)] // shared with puller-svc's tests, which use the rest
mod recording;
mod support;

use std::collections::{BTreeSet, HashMap};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use dispatcher_svc::config::DeliverySettings;
use eventmesh_common::dead_letter::DeadLetter;
use eventmesh_common::keys::Topic;
use eventmesh_proto::client::event_mesh_service_client::EventMeshServiceClient;
use eventmesh_proto::client::{AckOutcome, SubscriptionMode};
use eventmesh_testkit::RocketMq;
use puller_svc::cursors::StartAt;
use puller_svc::storage::rocketmq::client::RocketMqSettings;
use puller_svc::storage::rocketmq5::{PopSettings, RocketMq5Storage};
use puller_svc::storage::{AckPulledOutcome, Storage};
use recording::{Call, RecordingStorage};
use support::*;

/// An instance whose puller pops from the real broker through a recorder.
struct PopInstance {
    _dir: tempfile::TempDir,
    _offset_svc: offset_svc::server::RunningServer,
    puller: puller_svc::server::RunningServer,
    offsets: std::net::SocketAddr,
    dispatcher: dispatcher_svc::server::RunningServer,
    recorder: Arc<RecordingStorage>,
    topic: String,
}

impl PopInstance {
    async fn start(namesrv: &str, name: &str, settings: DeliverySettings) -> PopInstance {
        let dir = tempfile::tempdir().unwrap();
        let offset_svc =
            start_offset_svc(&dir.path().join("offsets"), "127.0.0.1:0".parse().unwrap()).await;
        let storage = RocketMq5Storage::new(
            RocketMqSettings::new(namesrv),
            PopSettings::default(),
            &dir.path().join("puller"),
            StartAt::Earliest,
        )
        .await
        .unwrap();
        let recorder = RecordingStorage::new(Arc::new(storage));
        // A shared broker keeps topics between test processes: names of our own. As long as
        // RocketMQ allows (123 characters: its dead-letter topic `<topic>_DLQ` takes 127).
        let topic = format!("{name}-{}-{}-", std::process::id(), rand::random::<u32>());
        let topic = format!("{topic:x<123}");
        recorder
            .create_topic(&Topic::new(&topic).unwrap(), 2)
            .await
            .unwrap();
        let puller = start_puller_over(
            Arc::clone(&recorder) as Arc<dyn Storage>,
            offset_svc.local_addr(),
            2,
        )
        .await;
        let (dispatcher, _shared) =
            start_dispatcher(puller.local_addr(), offset_svc.local_addr(), settings).await;
        PopInstance {
            offsets: offset_svc.local_addr(),
            _dir: dir,
            _offset_svc: offset_svc,
            puller,
            dispatcher,
            recorder,
            topic,
        }
    }

    async fn session(&self, group: &str) -> Session {
        self.session_at(self.dispatcher.local_addr(), group).await
    }

    async fn session_at(&self, dispatcher: std::net::SocketAddr, group: &str) -> Session {
        subscribe(
            dispatcher,
            open(group, &self.topic, group, SubscriptionMode::LoadBalance),
        )
        .await
    }

    /// Waits until the puller made `n` broker ACKs (at most `wait`); every broker ACK so far:
    /// its group, the record it named and the broker's answer.
    async fn broker_acks(&self, n: usize, wait: Duration) -> Vec<BrokerAck> {
        let deadline = Instant::now() + wait;
        loop {
            let acks = self.broker_acks_now();
            if acks.len() >= n || Instant::now() >= deadline {
                return acks;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    fn broker_acks_now(&self) -> Vec<BrokerAck> {
        self.recorder
            .calls()
            .into_iter()
            .filter_map(|call| match call {
                Call::AckPulled {
                    group,
                    key,
                    outcome,
                } => Some(BrokerAck {
                    group: group.unwrap_or_default(),
                    record: self
                        .recorder
                        .acked_record(&key)
                        .unwrap_or_else(|| panic!("broker ACK of a key never polled: {key}")),
                    outcome,
                }),
                _ => None,
            })
            .collect()
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
struct BrokerAck {
    group: String,
    record: (String, i64),
    outcome: Option<AckPulledOutcome>,
}

fn record_of(delivery: &eventmesh_proto::client::Delivery) -> (String, i64) {
    (delivery.partition.clone(), delivery.offset)
}

/// Checks `acks` name each of `expected` exactly once, every one ACKED by the broker.
fn exactly_once(acks: &[BrokerAck], expected: &BTreeSet<(String, i64)>, what: &str) {
    let mut seen: HashMap<&(String, i64), usize> = HashMap::new();
    for ack in acks {
        *seen.entry(&ack.record).or_default() += 1;
        assert_eq!(
            ack.outcome,
            Some(AckPulledOutcome::Acked),
            "{what}: the broker did not ACK {ack:?}"
        );
    }
    let named: BTreeSet<(String, i64)> = seen.keys().map(|r| (*r).clone()).collect();
    assert_eq!(&named, expected, "{what}: broker ACKs name these records");
    let twice: Vec<_> = seen.iter().filter(|(_, n)| **n > 1).collect();
    assert!(twice.is_empty(), "{what}: ACKed more than once: {twice:?}");
}

/// One name server and broker for every scenario (each starts its own instance and topic):
/// a broker per scenario, started at once, made topic creation time out on a loaded machine.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn broker_acks_through_a_dispatcher() {
    let rocketmq = RocketMq::get();
    one_broker_ack_per_message_and_only_after_the_clients_ack(rocketmq.namesrv()).await;
    dead_letters_are_acked_at_the_broker_after_their_dlq_send(rocketmq.namesrv()).await;
    a_killed_dispatcher_redelivers_and_each_message_is_acked_at_the_broker_once(rocketmq.namesrv())
        .await;
}

async fn one_broker_ack_per_message_and_only_after_the_clients_ack(namesrv: &str) {
    let settings = DeliverySettings {
        ack_timeout_ms: 60_000,
        ..fast_settings()
    };
    let instance = PopInstance::start(namesrv, "bkack", settings).await;
    let mut client = EventMeshServiceClient::new(lazy(instance.dispatcher.local_addr()));
    const EVENTS: usize = 20;
    publish(&mut client, &instance.topic, 0..EVENTS as u64).await;

    let mut first = instance.session("first").await;
    let deliveries = first.deliveries(EVENTS, Duration::from_secs(30)).await;
    assert_eq!(
        deliveries.len(),
        EVENTS,
        "every message delivered; the puller's calls:\n{}",
        instance.recorder.story()
    );
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert!(
        instance.broker_acks_now().is_empty(),
        "no broker ACK before the client's ACK: {:?}",
        instance.broker_acks_now()
    );

    // The client holds the lowest delivery of one queue for 10 s and ACKs all the others.
    let held_queue = deliveries[0].partition.clone();
    let held = deliveries
        .iter()
        .filter(|d| d.partition == held_queue)
        .min_by_key(|d| d.offset)
        .unwrap()
        .clone();
    let others: Vec<&str> = deliveries
        .iter()
        .filter(|d| d.delivery_id != held.delivery_id)
        .map(|d| d.delivery_id.as_str())
        .collect();
    first.ack(&others).await;
    // Durable now: every other queue's messages. The held queue's others wait behind the held
    // one (its watermark cannot pass it), so they must not be ACKed at the broker either.
    let settled: BTreeSet<(String, i64)> = deliveries
        .iter()
        .filter(|d| d.partition != held_queue)
        .map(record_of)
        .collect();
    let behind = deliveries.len() - settled.len() - 1;
    assert!(
        !settled.is_empty() && behind > 0,
        "the keys spread over both queues: {} settled, {behind} behind the held one",
        settled.len()
    );
    let holding = Instant::now();
    let acks = instance
        .broker_acks(settled.len(), Duration::from_secs(15))
        .await;
    exactly_once(&acks, &settled, "while one is held");
    tokio::time::sleep(Duration::from_secs(10).saturating_sub(holding.elapsed())).await;
    let acks = instance.broker_acks_now();
    exactly_once(&acks, &settled, "after holding one for 10 s");

    first.ack(&[held.delivery_id.as_str()]).await;
    let every: BTreeSet<(String, i64)> = deliveries.iter().map(record_of).collect();
    let acks = instance.broker_acks(EVENTS, Duration::from_secs(15)).await;
    exactly_once(&acks, &every, "after the held one's ACK");
    let results = first.results(EVENTS, Duration::from_secs(15)).await;
    let durable = results
        .iter()
        .filter(|r| r.outcome() == AckOutcome::Durable)
        .count();
    assert_eq!(durable, EVENTS, "every ACK answered DURABLE: {results:?}");
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert_eq!(
        instance.broker_acks_now().len(),
        EVENTS,
        "no broker ACK repeated"
    );

    // A second group on the topic gets every message too and ACKs on its own; its name is as
    // long as a group name can be (128 characters; its POP groups take 159 of the broker's 255).
    let mut second = instance.session(&format!("{:s<128}", "second")).await;
    let again = second.deliveries(EVENTS, Duration::from_secs(30)).await;
    let again_records: BTreeSet<(String, i64)> = again.iter().map(record_of).collect();
    assert_eq!(
        again_records,
        every,
        "the second group gets every message; the puller's calls:\n{}",
        instance.recorder.story()
    );
    second.ack_durably(&again).await;
    let acks = instance
        .broker_acks(2 * EVENTS, Duration::from_secs(15))
        .await;
    let first_group = acks[0].group.clone();
    let (of_first, of_second): (Vec<BrokerAck>, Vec<BrokerAck>) =
        acks.into_iter().partition(|a| a.group == first_group);
    exactly_once(&of_first, &every, "first group at the end");
    exactly_once(&of_second, &every, "second group");
}

async fn dead_letters_are_acked_at_the_broker_after_their_dlq_send(namesrv: &str) {
    let settings = DeliverySettings {
        ack_timeout_ms: 500,
        max_attempts: 2,
        ..fast_settings()
    };
    let instance = PopInstance::start(namesrv, "bkdlq", settings).await;
    let topic = Topic::new(&instance.topic).unwrap();
    let mut client = EventMeshServiceClient::new(lazy(instance.dispatcher.local_addr()));
    publish(&mut client, &instance.topic, 0..1).await;
    // Structurally a frame, but an attribute name is not UTF-8: sent raw, as a foreign
    // producer would, so the puller finds it malformed.
    let mut malformed = vec![0xEF, 1, 3, 0, 0, 0, 0, 0, 0, 1, 0, 0, 0, 0];
    malformed.extend_from_slice(&[0, 1, 0xFF, 0, 0, 0, 0]);
    let malformed = Bytes::from(malformed);
    instance
        .recorder
        .send(&topic, Bytes::new(), malformed.clone(), None)
        .await
        .unwrap();

    // The client never ACKs: the event is delivered twice, then dead-lettered; the malformed
    // body is never delivered, it goes to the dead-letter topic at once.
    let mut session = instance.session("never-acks").await;
    let attempts = session.deliveries(2, Duration::from_secs(30)).await;
    assert_eq!(attempts.len(), 2, "delivered, then once more");
    assert!(
        attempts
            .iter()
            .all(|d| d.event.as_ref().unwrap().id == "e-0")
    );
    let acks = instance.broker_acks(2, Duration::from_secs(30)).await;
    assert_eq!(acks.len(), 2, "one broker ACK per message: {acks:?}");
    assert!(
        acks.iter()
            .all(|a| a.outcome == Some(AckPulledOutcome::Acked)),
        "{acks:?}"
    );
    assert_ne!(acks[0].record, acks[1].record, "{acks:?}");

    // Each broker ACK comes after a dead letter landed in <topic>_DLQ.
    let dlq = format!("{}_DLQ", instance.topic);
    let mut letters_sent = 0;
    let mut broker_acks = 0;
    for call in instance.recorder.calls() {
        match call {
            Call::Send {
                topic,
                landed: Some(_),
            } if topic == dlq => letters_sent += 1,
            Call::AckPulled { .. } => {
                broker_acks += 1;
                assert!(
                    letters_sent >= broker_acks,
                    "broker ACK {broker_acks} before its dead letter was sent"
                );
            }
            _ => {}
        }
    }
    assert_eq!(letters_sent, 2, "two dead letters sent");
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert_eq!(
        instance.broker_acks_now().len(),
        2,
        "no broker ACK repeated"
    );

    let mut reader = TopicReader::new(instance.puller.local_addr(), "inspect", &dlq);
    let mut letters = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(30);
    while letters.len() < 2 && Instant::now() < deadline {
        if let Ok(batch) = reader.pull(500).await {
            letters.extend(batch);
        } else {
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }
    let letters: Vec<DeadLetter> = letters
        .iter()
        .map(|l| DeadLetter::decode(&l.frame).unwrap().unwrap())
        .collect();
    assert_eq!(letters.len(), 2, "{letters:?}");
    let bad = letters
        .iter()
        .find(|l| l.original == malformed)
        .unwrap_or_else(|| panic!("the malformed body is kept as it was: {letters:?}"));
    assert!(bad.reason.contains("UTF-8"), "{}", bad.reason);
    let timed_out = letters.iter().find(|l| l.original != malformed).unwrap();
    assert_eq!(timed_out.attempts, 2);
    assert!(
        timed_out.reason.contains("ACK timeout"),
        "{}",
        timed_out.reason
    );
}

/// The real dispatcher binary is killed (`kill -9`) after delivering and before any ACK: a new
/// one delivers every message again (a new POP epoch from the watermark), and each message is
/// then ACKed at the broker exactly once — the dead dispatcher's receipts never.
async fn a_killed_dispatcher_redelivers_and_each_message_is_acked_at_the_broker_once(
    namesrv: &str,
) {
    let instance = PopInstance::start(namesrv, "bkkill", fast_settings()).await;
    let mut client = EventMeshServiceClient::new(lazy(instance.dispatcher.local_addr()));
    const EVENTS: usize = 12;
    publish(&mut client, &instance.topic, 0..EVENTS as u64).await;
    let puller = instance.puller.local_addr();
    let mut doomed = Dispatcher::start(puller, instance.offsets, None);
    let mut first = instance.session_at(doomed.addr, "crashing").await;
    let delivered = first.deliveries(EVENTS, Duration::from_secs(30)).await;
    assert_eq!(
        delivered.len(),
        EVENTS,
        "every message delivered; the puller's calls:\n{}",
        instance.recorder.story()
    );
    doomed.kill9();
    drop(first);
    assert!(
        instance.broker_acks_now().is_empty(),
        "nothing ACKed at the broker before the client's ACK"
    );

    let successor = Dispatcher::start(puller, instance.offsets, None);
    let mut again = instance.session_at(successor.addr, "crashing").await;
    let redelivered = again.deliveries(EVENTS, Duration::from_secs(30)).await;
    let every: BTreeSet<(String, i64)> = delivered.iter().map(record_of).collect();
    let back: BTreeSet<(String, i64)> = redelivered.iter().map(record_of).collect();
    assert_eq!(
        back,
        every,
        "every un-ACKed message delivered again; the puller's calls:\n{}",
        instance.recorder.story()
    );
    again.ack_durably(&redelivered).await;
    let acks = instance.broker_acks(EVENTS, Duration::from_secs(15)).await;
    exactly_once(&acks, &every, "after the crash");
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert_eq!(
        instance.broker_acks_now().len(),
        EVENTS,
        "no receipt of the dead dispatcher's deliveries ACKed"
    );
}

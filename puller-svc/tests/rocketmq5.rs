//! The `rocketmq5` backend against a real name server and broker (rocketmq-rust 1.0.0, started
//! by `scripts/rocketmq.sh`): POP from our own cursors, one broker group per subscription
//! group, the broker ACK from a record's receipt, and the POP position set back to the cursor
//! wherever the broker's has moved on (a restart that rewound to the watermark, a dispatcher
//! that re-attached lower), so nothing un-ACKed is skipped although this broker never revives
//! an un-ACKed POP.

#![allow(clippy::unwrap_used)] // tests: a failed unwrap is a failed test

mod support;

use support::{event, ids, limits, poll_n, reader};

use std::time::Duration;

use bytes::Bytes;
use eventmesh_common::keys::{PartitionId, Topic};
use eventmesh_testkit::RocketMq;
use puller_svc::cursors::{Alignment, StartAt};
use puller_svc::storage::rocketmq::client::RocketMqSettings;
use puller_svc::storage::rocketmq5::{PopSettings, RocketMq5Storage, pop_request};
use puller_svc::storage::{
    AckPulledOutcome, PolledBatch, ReaderKey, Selection, Storage, StorageError,
};

fn queue(broker: &str, id: u32) -> PartitionId {
    PartitionId::queue(broker, id).unwrap()
}

async fn storage_at(namesrv: &str, dir: &std::path::Path) -> RocketMq5Storage {
    RocketMq5Storage::new(
        RocketMqSettings::new(namesrv),
        PopSettings::default(),
        dir,
        StartAt::Earliest,
    )
    .await
    .unwrap()
}

/// ACKs every record of `batch` at the broker by its receipt; each must answer ACKED.
async fn every_receipt_is_acked(
    storage: &RocketMq5Storage,
    reader: &ReaderKey,
    batch: &PolledBatch,
) {
    for record in &batch.records {
        let outcome = storage
            .ack_pulled(reader, record.ack_key.as_deref().unwrap())
            .await
            .unwrap();
        assert_eq!(
            outcome,
            AckPulledOutcome::Acked,
            "{reader:?} {}",
            record.offset
        );
    }
}

async fn send_all(storage: &RocketMq5Storage, topic: &Topic, count: usize) {
    for i in 0..count {
        storage
            .send(topic, Bytes::new(), event(&format!("e{i}")), None)
            .await
            .unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rocketmq5_backend_against_a_real_broker() {
    let rocketmq = RocketMq::get();
    let namesrv = rocketmq.namesrv();
    pops_per_group_and_acks_at_the_broker(namesrv).await;
    a_restart_and_a_lower_attach_pop_again_from_the_cursor(namesrv).await;
    a_position_past_the_end_is_reported(namesrv).await;
    lite_channels_are_refused(namesrv).await;
    worn_epochs_switch_without_skipping_anything(namesrv).await;
    the_longest_names_pop_and_ack(namesrv).await;
    many_groups_at_once_each_get_every_message(namesrv).await;
}

/// A frozen broker (SIGSTOP) under POP: UNAVAILABLE or nothing while frozen, then every
/// message after SIGCONT, nothing lost or skipped.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_frozen_broker_is_unavailable_then_recovers() {
    let rocketmq = RocketMq::start_own();
    let dir = tempfile::tempdir().unwrap();
    let storage = storage_at(rocketmq.namesrv(), dir.path()).await;
    let topic = Topic::new("em-rmq5-freeze").unwrap();
    support::a_frozen_broker_loses_nothing(&storage, &rocketmq, &topic).await;
}

async fn pops_per_group_and_acks_at_the_broker(namesrv: &str) {
    let dir = tempfile::tempdir().unwrap();
    let storage = storage_at(namesrv, dir.path()).await;
    let topic = Topic::new(format!("em-rmq5-pop-{}", std::process::id())).unwrap();
    assert!(storage.create_topic(&topic, 2).await.unwrap());
    send_all(&storage, &topic, 10).await;

    let fast = reader(Some("fast"), &topic);
    let batch = poll_n(&storage, &fast, 10).await;
    let mut got = ids(&batch);
    got.sort();
    let mut want: Vec<String> = (0..10).map(|i| format!("e{i}")).collect();
    want.sort();
    assert_eq!(got, want, "every message once");
    for record in &batch.records {
        assert!(
            record.partition == queue("broker-a", 0) || record.partition == queue("broker-a", 1),
            "{}",
            record.partition
        );
        let receipt = record.ack_key.as_deref().expect("a POP receipt per record");
        assert!(receipt.contains("broker-a"), "{receipt}");
    }
    // Per queue, offsets follow each other from the queue's start: read from our cursors.
    for id in 0..2 {
        let offsets: Vec<i64> = batch
            .records
            .iter()
            .filter(|r| r.partition == queue("broker-a", id))
            .map(|r| r.offset)
            .collect();
        assert_eq!(offsets, (0..offsets.len() as i64).collect::<Vec<_>>());
    }

    // Another group pops the same messages under its own broker group.
    let slow = reader(Some("slow"), &topic);
    assert_eq!(ids(&poll_n(&storage, &slow, 3).await).len(), 3);

    // The broker ACK, from the receipt alone; a receipt that is not one is named unknown.
    every_receipt_is_acked(&storage, &fast, &batch).await;
    assert_eq!(
        storage.ack_pulled(&fast, "not a receipt").await.unwrap(),
        AckPulledOutcome::UnknownKey
    );
    // Nothing is left for the fast group.
    let after = storage
        .poll(&fast, &Selection::All, limits(10))
        .await
        .unwrap();
    assert!(after.records.is_empty(), "{:?}", ids(&after));
}

async fn a_restart_and_a_lower_attach_pop_again_from_the_cursor(namesrv: &str) {
    let dir = tempfile::tempdir().unwrap();
    let storage = storage_at(namesrv, dir.path()).await;
    let topic = Topic::new(format!("em-rmq5-rewind-{}", std::process::id())).unwrap();
    storage.create_topic(&topic, 1).await.unwrap();
    send_all(&storage, &topic, 10).await;
    let group = reader(Some("g"), &topic);
    assert_eq!(ids(&poll_n(&storage, &group, 10).await).len(), 10);

    // The puller restarts; the ACK watermark is 4 (nothing above it was ACKed): the cursor
    // rewinds to 5 while the broker's POP position for the group stays at 10, and nothing
    // there is ever revived. The messages must come again.
    storage.checkpoint().await.unwrap();
    drop(storage);
    let storage = storage_at(namesrv, dir.path()).await;
    assert_eq!(
        storage
            .align_pull_offset(&group, &queue("broker-a", 0), Some(4))
            .await
            .unwrap(),
        Alignment::Rewound {
            from: Some(10),
            to: 5
        }
    );
    assert_eq!(
        ids(&poll_n(&storage, &group, 5).await),
        ["e5", "e6", "e7", "e8", "e9"]
    );

    // A dispatcher re-attaches lower (its watermark is 1) in the same process.
    let lower = Selection::Positioned([(queue("broker-a", 0), 2)].into());
    let batch = storage.poll(&group, &lower, limits(3)).await.unwrap();
    let mut got = ids(&batch);
    if got.is_empty() {
        got = ids(&poll_n(&storage, &group, 3).await);
    }
    assert_eq!(got, ["e2", "e3", "e4"]);

    // New messages follow on, each once.
    storage
        .send(&topic, Bytes::new(), event("later"), None)
        .await
        .unwrap();
    assert_eq!(
        ids(&poll_n(&storage, &group, 6).await),
        ["e5", "e6", "e7", "e8", "e9", "later"]
    );
}

/// A reader switches epochs after `realign_every` POPs of a queue (10,000 in production,
/// before the broker's 20,000-batch stall; 2 here): every message comes once, in order, across
/// the switches, and each ended epoch's broker group is deleted.
async fn worn_epochs_switch_without_skipping_anything(namesrv: &str) {
    use puller_svc::storage::rocketmq::epochs::Epochs;
    use puller_svc::storage::rocketmq::names;
    let dir = tempfile::tempdir().unwrap();
    let storage = RocketMq5Storage::new(
        RocketMqSettings::new(namesrv),
        PopSettings {
            realign_every: 2,
            ..PopSettings::default()
        },
        dir.path(),
        StartAt::Earliest,
    )
    .await
    .unwrap();
    let topic = Topic::new(format!("em-rmq5-worn-{}", std::process::id())).unwrap();
    storage.create_topic(&topic, 1).await.unwrap();
    send_all(&storage, &topic, 12).await;
    let group = reader(Some("worn"), &topic);
    let (mut got, mut epochs) = (Vec::new(), Vec::new());
    while got.len() < 12 {
        // One record per POP, so the queue wears after two polls.
        let batch = poll_n(&storage, &group, 1).await;
        for record in &batch.records {
            let key = record.ack_key.as_deref().unwrap();
            let (epoch, _) = Epochs::parse_ack_key(key).unwrap();
            if epochs.last() != Some(&epoch) {
                epochs.push(epoch);
            }
        }
        got.extend(ids(&batch));
    }
    let expected: Vec<String> = (0..12).map(|i| format!("e{i}")).collect();
    assert_eq!(
        got, expected,
        "every message once, in order, across the switches"
    );
    assert!(epochs.len() >= 6, "a new epoch every two POPs: {epochs:?}");
    let base = names::pop_group(group.group.as_ref()).unwrap();
    let live = Epochs::group_name(&base, *epochs.last().unwrap());
    let positioned = storage
        .client()
        .consume_offset(&live, &topic, &queue("broker-a", 0))
        .await
        .unwrap();
    assert!(
        positioned.is_some(),
        "the live epoch's group was positioned"
    );
    for ended in &epochs[..epochs.len() - 1] {
        let ended = Epochs::group_name(&base, *ended);
        assert_eq!(
            storage
                .client()
                .consume_offset(&ended, &topic, &queue("broker-a", 0))
                .await
                .unwrap(),
            None,
            "the ended epoch's group {ended} holds nothing (live: {live})"
        );
    }
}

async fn a_position_past_the_end_is_reported(namesrv: &str) {
    let dir = tempfile::tempdir().unwrap();
    let storage = storage_at(namesrv, dir.path()).await;
    let topic = Topic::new(format!("em-rmq5-past-end-{}", std::process::id())).unwrap();
    storage.create_topic(&topic, 1).await.unwrap();
    send_all(&storage, &topic, 2).await;
    let group = reader(Some("g"), &topic);
    let positioned = Selection::Positioned([(queue("broker-a", 0), 6)].into());
    let batch = storage.poll(&group, &positioned, limits(10)).await.unwrap();
    assert!(batch.records.is_empty(), "nothing is read past the end");
    let past = batch.past_end.first().expect("reported");
    assert_eq!((past.position, past.log_start, past.log_end), (6, 0, 2));
    let rewound = Selection::Positioned([(queue("broker-a", 0), 0)].into());
    let batch = storage.poll(&group, &rewound, limits(10)).await.unwrap();
    let mut got = ids(&batch);
    if got.len() < 2 {
        got.extend(ids(&poll_n(&storage, &group, 2 - got.len()).await));
    }
    assert_eq!(got, ["e0", "e1"]);
}

/// The longest topic RocketMQ takes (123 characters: `<topic>_DLQ` must fit in 127) and the
/// longest group of ours (a BROADCAST client's own: `~` and 128 characters) pop and ACK at
/// the broker; their POP groups stay inside the broker's 255.
async fn the_longest_names_pop_and_ack(namesrv: &str) {
    let dir = tempfile::tempdir().unwrap();
    let storage = storage_at(namesrv, dir.path()).await;
    let topic = format!("em-rmq5-long-{}-", std::process::id());
    let topic = Topic::new(format!("{topic:x<123}")).unwrap();
    storage.create_topic(&topic, 1).await.unwrap();
    send_all(&storage, &topic, 3).await;
    let group = reader(Some(&format!("~{}", "c".repeat(128))), &topic);
    let batch = poll_n(&storage, &group, 3).await;
    assert_eq!(ids(&batch), ["e0", "e1", "e2"]);
    every_receipt_is_acked(&storage, &group, &batch).await;
}

/// Sixteen groups popping one topic at the same time, each under its own broker groups: each
/// gets every message once, and every broker ACK is accepted.
async fn many_groups_at_once_each_get_every_message(namesrv: &str) {
    let dir = tempfile::tempdir().unwrap();
    let storage = storage_at(namesrv, dir.path()).await;
    let topic = Topic::new(format!("em-rmq5-many-{}", std::process::id())).unwrap();
    storage.create_topic(&topic, 2).await.unwrap();
    send_all(&storage, &topic, 20).await;
    let mut want: Vec<String> = (0..20).map(|i| format!("e{i}")).collect();
    want.sort();
    let groups: Vec<String> = (0..16).map(|i| format!("many.{i}")).collect();
    futures::future::join_all(groups.iter().map(|name| {
        let (storage, topic, want) = (&storage, &topic, &want);
        async move {
            let group = reader(Some(name), topic);
            let batch = poll_n(storage, &group, 20).await;
            let mut got = ids(&batch);
            got.sort();
            assert_eq!(&got, want, "group {name}: every message once");
            every_receipt_is_acked(storage, &group, &batch).await;
        }
    }))
    .await;
}

async fn lite_channels_are_refused(namesrv: &str) {
    let dir = tempfile::tempdir().unwrap();
    let storage = storage_at(namesrv, dir.path()).await;
    let topic = Topic::new(format!("em-rmq5-lite-{}", std::process::id())).unwrap();
    let refused = storage.create_lite(&topic, "lite-1").await.unwrap_err();
    assert!(matches!(refused, StorageError::Invalid(_)), "{refused}");
    assert!(refused.to_string().contains("rocketmq5"), "{refused}");
}

/// Canaries: the broker and client defects `rocketmq5` works around, asserted as they are
/// today. When one fails, the defect is fixed: drop its workaround (docs/ROCKETMQ.md).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn canaries_of_the_defects_worked_around() {
    use cheetah_string::CheetahString;
    use rocketmq_protocol::protocol::header::pop_message_request_header::PopMessageRequestHeader;
    use rocketmq_protocol::protocol::header::reset_offset_request_header::ResetOffsetRequestHeader;
    use rocketmq_protocol::{RemotingCommand, RequestCode};

    let rocketmq = RocketMq::get();
    let dir = tempfile::tempdir().unwrap();
    let storage = storage_at(rocketmq.namesrv(), dir.path()).await;
    let topic = Topic::new(format!("em-rmq5-canary-{}", std::process::id())).unwrap();
    storage.create_topic(&topic, 1).await.unwrap();
    let handle = storage.client().handle().await.unwrap();
    let route = storage.client().route(&topic).await.unwrap();
    let addr: CheetahString = route.master("broker-a").unwrap().into();
    let broker: CheetahString = "broker-a".into();
    let pop = |group: &str, max: u32| {
        pop_request(
            group,
            topic.as_str(),
            "broker-a",
            0,
            max,
            Duration::from_secs(60),
        )
    };
    let client = storage.client();
    let timeout = Duration::from_secs(10);

    // 1. The client cannot decode an empty POP (code 210 without a response header).
    let (h, a, b, header) = (
        handle.clone(),
        addr.clone(),
        broker.clone(),
        pop("em-canary-1", 1),
    );
    let empty = client
        .call("canary", timeout, async move {
            Ok(h.pop_message(&b, &a, header, 5_000).await)
        })
        .await
        .unwrap();
    let Err(err) = empty else {
        panic!("the client decoded an empty POP: drop the raw POP decoding");
    };
    assert!(err.to_string().contains("serialization"), "{err}");

    // 2. A POP position is not moved back once the group popped the queue: the reset is
    // accepted, the next POP finds nothing. Not in every try (how far the broker got with the
    // POP's check point decides), so ten groups try; a broker that honours every reset fails.
    send_all(&storage, &topic, 3).await;
    let mut kept_position = 0;
    for round in 0..10 {
        let group = format!("em-canary-reset-{}-{round}", std::process::id());
        let pop_code = |group: &str| {
            let (h, a, header) = (handle.clone(), addr.clone(), pop(group, 3));
            client.call("canary", timeout, async move {
                let request =
                    RemotingCommand::create_request_command(RequestCode::PopMessage, header);
                Ok(h.invoke_remoting(&a, request, 5_000).await.unwrap().code())
            })
        };
        assert_eq!(
            pop_code(&group).await.unwrap(),
            0,
            "the first POP finds the messages"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
        let (h, a, topic_name, reset_group) = (
            handle.clone(),
            addr.clone(),
            topic.to_string(),
            group.clone(),
        );
        let reset = client
            .call("canary", timeout, async move {
                let request = RemotingCommand::create_request_command(
                    RequestCode::InvokeBrokerToResetOffset,
                    ResetOffsetRequestHeader {
                        topic: topic_name.as_str().into(),
                        group: reset_group.as_str().into(),
                        queue_id: 0,
                        offset: Some(0),
                        timestamp: 0,
                        is_force: true,
                        topic_request_header: None,
                    },
                );
                Ok(h.invoke_remoting(&a, request, 5_000).await.unwrap().code())
            })
            .await
            .unwrap();
        assert_eq!(reset, 0, "the broker accepts the reset");
        if pop_code(&group).await.unwrap() == 210 {
            kept_position += 1;
        }
    }
    assert!(
        kept_position > 0,
        "every POP after a reset found the messages: the broker honours resets (epochs may go)"
    );
    eprintln!("the broker kept its POP position after a reset in {kept_position} of 10 tries");

    // 3. The client's POP of two messages from one queue holding two fails its parsing (or
    // loses one): the backend decodes POPs raw.
    let pair = Topic::new(format!("em-rmq5-canary-pair-{}", std::process::id())).unwrap();
    storage.create_topic(&pair, 1).await.unwrap();
    send_all(&storage, &pair, 2).await;
    let pop_pair = PopMessageRequestHeader {
        topic: pair.as_str().into(),
        ..pop(&format!("em-canary-pair-{}", std::process::id()), 2)
    };
    let (h, a, b) = (handle.clone(), addr.clone(), broker.clone());
    let popped = client
        .call("canary", timeout, async move {
            Ok(h.pop_message(&b, &a, pop_pair, 5_000).await)
        })
        .await
        .unwrap();
    let parsed = popped
        .as_ref()
        .ok()
        .and_then(|result| result.msg_found_list.as_ref())
        .map_or(0, Vec::len);
    assert!(
        parsed < 2,
        "the client parsed a POP of two from one queue: its raw decoding may go"
    );

    // 4. CHANGE_INVISIBLE_TIME fails (the broker's timer refuses the absolute time it stores
    // as a delay): the backend never uses it.
    send_all(&storage, &topic, 1).await;
    let group = format!("em-canary-invisible-{}", std::process::id());
    let (h, a, b, header) = (handle.clone(), addr.clone(), broker.clone(), pop(&group, 1));
    let first = client
        .call("canary", timeout, async move {
            Ok(h.pop_message(&b, &a, header, 5_000).await)
        })
        .await
        .unwrap()
        .expect("a POP of one message decodes");
    let message = first
        .msg_found_list
        .and_then(|list| list.into_iter().next())
        .expect("a message to change");
    let receipt = message
        .property(&CheetahString::from_static_str(
            rocketmq_model::common::message::MessageConst::PROPERTY_POP_CK,
        ))
        .expect("the client sets the receipt");
    let change = rocketmq_protocol::protocol::header::change_invisible_time_request_header::ChangeInvisibleTimeRequestHeader {
        consumer_group: group.as_str().into(),
        topic: topic.as_str().into(),
        queue_id: message.queue_id(),
        extra_info: receipt.into(),
        offset: message.queue_offset(),
        invisible_time: 60_000,
        topic_request_header: puller_svc::storage::rocketmq::client::broker_header("broker-a"),
        ..Default::default()
    };
    // Sent raw: the client also fails to decode the broker's refusal.
    let h = handle.clone();
    let a = addr.clone();
    let (code, remark) = client
        .call("canary", timeout, async move {
            let request = RemotingCommand::create_request_command(
                RequestCode::ChangeMessageInvisibleTime,
                change,
            );
            let answer = h.invoke_remoting(&a, request, 5_000).await.unwrap();
            Ok((
                answer.code(),
                answer.remark().map(|r| r.to_string()).unwrap_or_default(),
            ))
        })
        .await
        .unwrap();
    assert_ne!(
        code, 0,
        "CHANGE_INVISIBLE_TIME worked: the broker may revive now"
    );
    eprintln!("CHANGE_INVISIBLE_TIME refused as expected: code {code} {remark}");
}

/// Whether the broker revives a popped, un-ACKed message after its invisible time. Broker
/// 1.0.0 does not (docs/ROCKETMQ.md): the test says SKIPPED and passes, unless
/// `ROCKETMQ_REQUIRE_REVIVE=1`. Nothing of ours depends on reviving: a puller `kill -9`
/// between POP and ACK is covered by our cursors (tests/rocketmq_crash.rs), and a revived copy
/// is ACKed and dropped.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_popped_message_not_acked_is_revived_or_skipped() {
    use cheetah_string::CheetahString;

    let rocketmq = RocketMq::get();
    let dir = tempfile::tempdir().unwrap();
    let storage = storage_at(rocketmq.namesrv(), dir.path()).await;
    let topic = Topic::new(format!("em-rmq5-revive-{}", std::process::id())).unwrap();
    storage.create_topic(&topic, 1).await.unwrap();
    send_all(&storage, &topic, 1).await;
    let handle = storage.client().handle().await.unwrap();
    let route = storage.client().route(&topic).await.unwrap();
    let addr: CheetahString = route.master("broker-a").unwrap().into();
    let group = format!("em-revive-probe-{}", std::process::id());
    let invisible = Duration::from_secs(2);
    let pop =
        |popped_topic: String| pop_request(&group, &popped_topic, "broker-a", 0, 1, invisible);
    let pop_from = |popped_topic: String| {
        let (h, a, header) = (handle.clone(), addr.clone(), pop(popped_topic));
        storage
            .client()
            .call("revive probe", Duration::from_secs(10), async move {
                let found = match h.pop_message(&"broker-a".into(), &a, header, 5_000).await {
                    Ok(result) => result.msg_found_list.map_or(0, |list| list.len()),
                    // The client cannot decode an empty POP (see the canaries).
                    Err(_) => 0,
                };
                Ok(found)
            })
    };
    assert_eq!(
        pop_from(topic.to_string()).await.unwrap(),
        1,
        "popped, never ACKed"
    );
    tokio::time::sleep(invisible * 2).await;
    let retry = format!("%RETRY%{group}_{topic}");
    let mut revived = 0;
    for _ in 0..3 {
        revived += pop_from(topic.to_string()).await.unwrap();
        revived += pop_from(retry.clone()).await.unwrap();
        if revived > 0 {
            break;
        }
        tokio::time::sleep(invisible).await;
    }
    if revived == 0 {
        assert!(
            std::env::var("ROCKETMQ_REQUIRE_REVIVE").as_deref() != Ok("1"),
            "the broker did not revive a popped message after twice its invisible time"
        );
        eprintln!("SKIPPED: broker does not revive popped messages (see docs/ROCKETMQ.md)");
    } else {
        eprintln!("the broker revived the popped message");
    }
}

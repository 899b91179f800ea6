//! The reliable dispatcher end to end on a real instance (offset-svc on RocksDB, puller-svc on
//! the local log): the ACK chain, the gap-free watermark, redelivery, dead-lettering,
//! reassignment, BROADCAST isolation, offset-svc outages and bounded memory. Adapted from the
//! reference's DeferredAckDispatcherTest, ReliableDispatcherTest and MqCursorRecordingTest.

#![allow(clippy::unwrap_used)]

mod support;

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use bytes::Bytes;
use eventmesh_common::dead_letter::DeadLetter;
use eventmesh_proto::client as pb;
use eventmesh_proto::client::{AckOutcome, SubscriptionMode};
use support::*;

const WAIT: Duration = Duration::from_secs(10);
const LB: SubscriptionMode = SubscriptionMode::LoadBalance;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn acks_become_durable_watermarks_per_group_and_client() {
    let instance = Instance::start(fast_settings()).await;
    instance.create_topic("orders", 2).await;
    let mut client = instance.client().await;
    publish(&mut client, "orders", 0..20).await;
    let mut session = subscribe(instance.dispatcher_addr(), open("app-1", "orders", "", LB)).await;
    assert_eq!(session.opened.group, "(default)");
    let deliveries = session.deliveries(20, WAIT).await;
    assert_eq!(deliveries.len(), 20);
    let numbers: BTreeSet<u64> = deliveries.iter().map(number).collect();
    assert_eq!(numbers, (0..20).collect());
    for d in &deliveries {
        assert_eq!(d.attempt, 1);
        assert!(d.ack_deadline_unix_ms > 0);
        let event = d.event.as_ref().unwrap();
        assert!(
            event.attributes.keys().all(|name| !name.starts_with("em")),
            "the puller's stamps stay inside: {:?}",
            event.attributes
        );
    }
    session.ack_durably(&deliveries).await;
    let mut last: BTreeMap<String, i64> = BTreeMap::new();
    for d in &deliveries {
        let slot = last.entry(d.partition.clone()).or_insert(-1);
        *slot = (*slot).max(d.offset);
    }
    let cursor = instance.stored("orders", "__mqcursor__").await;
    let client_offsets = instance.stored("orders", "app-1").await;
    for (partition, offset) in &last {
        assert_eq!(cursor[partition], *offset, "group watermark of {partition}");
        assert_eq!(
            client_offsets[partition], *offset,
            "client watermark of {partition}"
        );
    }
    // A second ACK is a no-op that says so.
    session.ack(&[&deliveries[0].delivery_id]).await;
    let again = session.results(1, WAIT).await;
    assert_eq!(again[0].outcome(), AckOutcome::AlreadySettled);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn out_of_order_acks_keep_the_watermark_below_the_gap_and_wait_for_it_to_be_durable() {
    let instance = Instance::start(fast_settings()).await;
    instance.create_topic("single", 1).await;
    let mut client = instance.client().await;
    publish(&mut client, "single", 0..3).await;
    let mut session = subscribe(instance.dispatcher_addr(), open("app", "single", "", LB)).await;
    let d = session.deliveries(3, WAIT).await;
    assert_eq!(d.iter().map(|d| d.offset).collect::<Vec<_>>(), [0, 1, 2]);
    session.ack(&[&d[2].delivery_id, &d[1].delivery_id]).await;
    // Their writes finish within milliseconds, but a crash now would bring offsets 1 and 2
    // back (the stored watermark cannot pass 0): they are not DURABLE yet.
    let early = session.results(1, Duration::from_millis(500)).await;
    assert!(early.is_empty(), "no DURABLE above the gap: {early:?}");
    assert_eq!(
        instance.stored("single", "__mqcursor__").await.get("0"),
        Some(&-1),
        "offsets 1 and 2 are ACKed but 0 is not: only the group's start marker is stored"
    );
    assert_eq!(instance.stored("single", "app").await.get("0"), None);
    // ACKing 0 closes the gap: all three are answered DURABLE.
    session.ack(&[&d[0].delivery_id]).await;
    let results = session.results(3, WAIT).await;
    assert_eq!(results.len(), 3, "{results:?}");
    for delivery in &d {
        assert_eq!(
            outcome_of(&results, &delivery.delivery_id),
            AckOutcome::Durable
        );
    }
    assert_eq!(instance.stored("single", "__mqcursor__").await["0"], 2);
    assert_eq!(instance.stored("single", "app").await["0"], 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nack_redelivers_with_the_same_id_and_an_earlier_attempts_ack_counts() {
    let instance = Instance::start(fast_settings()).await;
    instance.create_topic("nacks", 1).await;
    let mut client = instance.client().await;
    publish(&mut client, "nacks", 0..1).await;
    let mut session = subscribe(instance.dispatcher_addr(), open("app", "nacks", "", LB)).await;
    let first = session.deliveries(1, WAIT).await.remove(0);
    session.nack(&first.delivery_id, 100).await;
    assert_eq!(
        session.results(1, WAIT).await[0].outcome(),
        AckOutcome::Nacked
    );
    let second = session.deliveries(1, WAIT).await.remove(0);
    assert_eq!(second.delivery_id, first.delivery_id);
    assert_eq!(second.attempt, 2);
    // Each send decodes the pulled body: the redelivery carries the same event.
    assert!(first.event.is_some());
    assert_eq!(second.event, first.event);
    assert_eq!(
        (second.partition.as_str(), second.offset),
        (first.partition.as_str(), first.offset)
    );
    // Extend, then ACK "the first attempt" (same id): it settles.
    session.extend(&second.delivery_id, 60_000).await;
    assert_eq!(
        session.results(1, WAIT).await[0].outcome(),
        AckOutcome::Extended
    );
    session.ack_durably(std::slice::from_ref(&first)).await;
    // Unknown and malformed ids are answered and the stream goes on.
    session.ack(&["nonsense", "1.2.3", ""]).await;
    let results = session.results(3, WAIT).await;
    assert!(
        results.iter().all(|r| r.outcome() == AckOutcome::Unknown),
        "{results:?}"
    );
    publish(&mut client, "nacks", 1..2).await;
    let next = session.deliveries(1, WAIT).await;
    assert_eq!(number(&next[0]), 1, "the stream still works");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ack_timeouts_redeliver_then_dead_letter_to_the_dlq_topic() {
    let settings = dispatcher_svc::config::DeliverySettings {
        ack_timeout_ms: 300,
        max_attempts: 3,
        ..fast_settings()
    };
    let instance = Instance::start(settings).await;
    instance.create_topic("slowpoke", 1).await;
    let mut client = instance.client().await;
    publish(&mut client, "slowpoke", 0..1).await;
    let mut session = subscribe(
        instance.dispatcher_addr(),
        open("never-acks", "slowpoke", "", LB),
    )
    .await;
    let attempts = session.deliveries(3, WAIT).await;
    assert_eq!(
        attempts.iter().map(|d| d.attempt).collect::<Vec<_>>(),
        [1, 2, 3]
    );
    assert!(
        attempts
            .iter()
            .all(|d| d.delivery_id == attempts[0].delivery_id)
    );
    // Dead-lettered: readable from slowpoke_DLQ, and settled (the watermark moves past it).
    let mut dlq = TopicReader::new(instance.puller.local_addr(), "inspect", "slowpoke_DLQ");
    let mut letters = Vec::new();
    for _ in 0..100 {
        match dlq.pull(200).await {
            Ok(batch) => letters.extend(batch),
            // The DLQ topic does not exist until the first dead letter.
            Err(_) => tokio::time::sleep(Duration::from_millis(100)).await,
        }
        if !letters.is_empty() {
            break;
        }
    }
    assert_eq!(letters.len(), 1);
    let body: Bytes = letters[0].frame.clone();
    // The puller stamps what it hands out; the envelope is inside as a frame of its own.
    let frame = eventmesh_common::frame::Frame::decode(
        &body,
        &eventmesh_common::dead_letter::ENVELOPE_LIMITS,
    )
    .unwrap();
    assert_eq!(frame.attribute("emdlqattempts"), Some("3"));
    assert!(
        frame
            .attribute("emdlqreason")
            .unwrap()
            .contains("ACK timeout")
    );
    let letter = DeadLetter::decode(&body).unwrap().unwrap();
    assert_eq!(letter.topic, "slowpoke");
    assert_eq!(letter.offset, 0);
    let original = eventmesh_common::frame::Frame::decode(
        &letter.original,
        &eventmesh_common::dead_letter::ENVELOPE_LIMITS,
    )
    .unwrap();
    assert_eq!(&original.data[..], b"0");
    wait_for(|| async { instance.stored("slowpoke", "__mqcursor__").await.get("0") == Some(&0) })
        .await;
    // An ACK after dead-lettering says so.
    session.ack(&[&attempts[0].delivery_id]).await;
    assert_eq!(
        session.results(1, WAIT).await[0].outcome(),
        AckOutcome::AlreadySettled
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_leaving_session_hands_its_deliveries_to_the_other_and_a_late_ack_settles() {
    // A long backoff: what a leaving session held must not wait for it (it used to).
    let instance = Instance::start(dispatcher_svc::config::DeliverySettings {
        backoff_base_ms: 20_000,
        backoff_max_ms: 20_000,
        ..fast_settings()
    })
    .await;
    instance.create_topic("shared", 1).await;
    let mut client = instance.client().await;
    let addr = instance.dispatcher_addr();
    let mut first = subscribe(addr, open("worker-a", "shared", "workers", LB)).await;
    let mut second = subscribe(addr, open("worker-b", "shared", "workers", LB)).await;
    publish(&mut client, "shared", 0..10).await;
    let a = first.deliveries(5, WAIT).await;
    let b = second.deliveries(5, WAIT).await;
    assert_eq!(a.len() + b.len(), 10, "round robin over both sessions");
    // worker-b ACKs its share; offsets interleave, so these wait above worker-a's gaps.
    let b_ids: Vec<&str> = b.iter().map(|d| d.delivery_id.as_str()).collect();
    second.ack(&b_ids).await;
    // worker-a leaves with its deliveries in flight: they go to worker-b at once.
    drop(first);
    let moved = second.deliveries(a.len(), Duration::from_secs(5)).await;
    let ids = |ds: &[eventmesh_proto::client::Delivery]| {
        ds.iter()
            .map(|d| d.delivery_id.clone())
            .collect::<BTreeSet<_>>()
    };
    assert_eq!(ids(&moved), ids(&a), "same delivery ids");
    assert!(moved.iter().all(|d| d.attempt == 2));
    // worker-a comes back (a new session, same client) and ACKs what it had: that settles.
    let mut again = subscribe(addr, open("worker-a", "shared", "workers", LB)).await;
    let late: Vec<&str> = a.iter().map(|d| d.delivery_id.as_str()).collect();
    again.ack(&late).await;
    let results = again.results(late.len(), WAIT).await;
    assert!(
        results.iter().all(|r| r.outcome() == AckOutcome::Durable),
        "{results:?}"
    );
    // That closed the gaps under worker-b's ACKs: they are durable now too.
    let results = second.results(b.len(), WAIT).await;
    assert_eq!(results.len(), b.len());
    for id in &b_ids {
        assert_eq!(outcome_of(&results, id), AckOutcome::Durable);
    }
    // worker-b's ACKs of worker-a's deliveries are now no-ops.
    second.ack(&late).await;
    let results = second.results(late.len(), WAIT).await;
    assert!(
        results
            .iter()
            .all(|r| r.outcome() == AckOutcome::AlreadySettled),
        "{results:?}"
    );
    assert_eq!(
        instance.stored("shared", "__mqcursor@workers__").await["0"],
        9
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn broadcast_isolates_a_slow_client_and_its_copies_survive_a_restart() {
    let mut instance = Instance::start(fast_settings()).await;
    instance.create_topic("news", 1).await;
    let mut client = instance.client().await;
    let addr = instance.dispatcher_addr();
    let mut fast = subscribe(addr, open("fast", "news", "", SubscriptionMode::Broadcast)).await;
    let mut slow = subscribe(addr, open("slow", "news", "", SubscriptionMode::Broadcast)).await;
    // BROADCAST groups live in a namespace of their own (a client id equal to a named
    // group's name never joins that group).
    assert_eq!(fast.opened.group, "~fast");
    publish(&mut client, "news", 0..5).await;
    let got = fast.deliveries(5, WAIT).await;
    fast.ack_durably(&got).await;
    assert_eq!(
        slow.deliveries(5, WAIT).await.len(),
        5,
        "slow gets its copies but never ACKs"
    );
    assert_eq!(instance.stored("news", "__mqcursor@~fast__").await["0"], 4);
    assert_eq!(
        instance.stored("news", "__mqcursor@~slow__").await.get("0"),
        Some(&-1),
        "only its start marker: it settled nothing"
    );
    drop(slow);
    drop(fast);
    instance.restart_dispatcher().await;
    let addr = instance.dispatcher_addr();
    let mut slow = subscribe(addr, open("slow", "news", "", SubscriptionMode::Broadcast)).await;
    let copies = slow.deliveries(5, WAIT).await;
    assert_eq!(
        copies.iter().map(number).collect::<Vec<_>>(),
        [0, 1, 2, 3, 4]
    );
    let mut fast = subscribe(addr, open("fast", "news", "", SubscriptionMode::Broadcast)).await;
    assert!(
        fast.deliveries(1, Duration::from_millis(800))
            .await
            .is_empty(),
        "fast's ACKed copies do not come back"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn offset_svc_outage_makes_acks_pending_without_redelivery_or_dead_letters() {
    let settings = dispatcher_svc::config::DeliverySettings {
        ack_timeout_ms: 500,
        max_attempts: 2,
        ..fast_settings()
    };
    let mut instance = Instance::start(settings).await;
    instance.create_topic("outage", 1).await;
    let mut client = instance.client().await;
    publish(&mut client, "outage", 0..20).await;
    let mut session = subscribe(instance.dispatcher_addr(), open("app", "outage", "", LB)).await;
    let first = session.deliveries(10, WAIT).await;
    session.ack_durably(&first).await;
    let rest = session.deliveries(10, WAIT).await;
    assert_eq!(rest.len(), 10);
    instance.stop_offset_svc().await;
    let ids: Vec<&str> = rest.iter().map(|d| d.delivery_id.as_str()).collect();
    session.ack(&ids).await;
    let pending = session.results(10, WAIT).await;
    assert!(
        pending.iter().all(|r| r.outcome() == AckOutcome::Pending),
        "{pending:?}"
    );
    // A minute down (120 ACK timeouts) while producers keep publishing: nothing ACKed comes
    // back or is dead-lettered, and pulling pauses (the new events wait in the MQ). A pull
    // already waiting when the writes failed ends within its 500 ms long-poll.
    tokio::time::sleep(Duration::from_secs(1)).await;
    for second in 0..60 {
        publish(&mut client, "outage", 20 + second * 5..25 + second * 5).await;
        assert!(
            session
                .deliveries(1, Duration::from_secs(1))
                .await
                .is_empty(),
            "nothing may be delivered while ACKs are pending (second {second})"
        );
    }
    instance.restart_offset_svc().await;
    let durable = session.results(10, Duration::from_secs(20)).await;
    assert_eq!(durable.len(), 10);
    assert!(
        durable.iter().all(|r| r.outcome() == AckOutcome::Durable),
        "{durable:?}"
    );
    // Pulling resumes: the 300 events published meanwhile arrive, once each.
    let mut later = BTreeSet::new();
    while later.len() < 300 {
        let got = session.deliveries(100, WAIT).await;
        assert!(!got.is_empty(), "only {} of 300 arrived", later.len());
        session.ack_durably(&got).await;
        for d in &got {
            assert!(later.insert(number(d)), "{} delivered twice", number(d));
        }
    }
    assert_eq!(instance.stored("outage", "__mqcursor__").await["0"], 319);
    let mut puller = instance.puller_client().await;
    let dlq = puller
        .end_offsets(eventmesh_proto::puller::EndOffsetsRequest {
            topic: "outage_DLQ".into(),
        })
        .await;
    let dead = dlq
        .map(|r| r.into_inner().partitions.iter().map(|p| p.end).sum::<i64>())
        .unwrap_or(0);
    assert_eq!(dead, 0, "no ACKed event was dead-lettered");
}

/// An ACK's answer does not wait behind the deliveries queued for a client that is slow to
/// read: it overtakes them. 3,000 events of 4 KiB (12 MiB, far more than the transport's
/// windows hold) go to one session that reads one message, ACKs and then reads on; the answer
/// must come before most of the rest (behind them all, as it used to, it would come after
/// every one): only what the transport's windows and buffers hold (1,264 here) comes first.
/// The ACK names an id no group issued, answered at once, so what is measured is the queueing
/// alone, not how long an offset write takes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_acks_answer_overtakes_the_deliveries_queued_for_a_slow_reader() {
    const EVENTS: usize = 3_000;
    let instance = Instance::start(fast_settings()).await;
    instance.create_topic("bulky", 1).await;
    let mut client = instance.client().await;
    let payload = Bytes::from(vec![b'x'; 4096]);
    for chunk in 0..(EVENTS / 500) {
        let entries = (0..500)
            .map(|n| pb::PublishEntry {
                event: Some(bulky_event(format!("bulky-{chunk}-{n}"), &payload)),
                key: String::new(),
            })
            .collect();
        client
            .publish_batch(pb::PublishBatchRequest {
                topic: "bulky".into(),
                entries,
            })
            .await
            .unwrap();
    }
    let mut open = open("reader", "bulky", "g", LB);
    open.max_in_flight = EVENTS as u32;
    let mut session = subscribe(instance.dispatcher_addr(), open).await;
    let first = session.deliveries(1, WAIT).await;
    assert_eq!(first.len(), 1);
    // Let the group queue everything for this session before the ACK arrives.
    tokio::time::sleep(Duration::from_millis(500)).await;
    session.ack(&["not-an-id"]).await;
    // Nor read while the dispatcher answers: what comes before the answer is then only what
    // the transport already held, not also what a reader on a busy machine took while the ACK
    // was on its way (the count measured that race too, and CI once saw 2,017).
    tokio::time::sleep(Duration::from_secs(1)).await;
    let result = session.results(1, WAIT).await;
    assert_eq!(result[0].outcome(), AckOutcome::Unknown);
    let before = session.deliveries.len();
    assert!(
        before < EVENTS * 2 / 3,
        "the answer came after {before} of the {} other deliveries",
        EVENTS - 1
    );
    let rest = session.deliveries(EVENTS - 1, WAIT).await;
    assert_eq!(rest.len(), EVENTS - 1, "every delivery still comes");
}

/// A group spread over two shards: a session's in-flight limit is one pool both shards take
/// from, so it never holds more than its limit however many shards deliver to it, and a shard
/// that found the pool empty delivers again once the other shard's ACK gives a credit back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sessions_in_flight_limit_binds_every_shard_of_its_group_together() {
    let instance = Instance::start(dispatcher_svc::config::DeliverySettings {
        group_shards: 2,
        ..fast_settings()
    })
    .await;
    instance.create_topic("pooled", 4).await;
    let mut client = instance.client().await;
    publish(&mut client, "pooled", 0..60).await;
    let mut limited = open("app-1", "pooled", "", LB);
    limited.max_in_flight = 3;
    let mut session = subscribe(instance.dispatcher_addr(), limited).await;
    let mut received = Vec::new();
    let mut issuers = BTreeSet::new();
    while received.len() < 60 {
        let held = session.deliveries(3, WAIT).await;
        assert_eq!(
            held.len(),
            3.min(60 - received.len()),
            "the session's limit is filled"
        );
        // Nothing beyond the limit comes while these are held, from either shard.
        let beyond = session.deliveries(1, Duration::from_millis(100)).await;
        assert!(beyond.is_empty(), "a 4th un-ACKed delivery: {beyond:?}");
        for d in &held {
            issuers.insert(d.delivery_id.split('.').nth(1).unwrap().to_owned());
        }
        session.ack_durably(&held).await;
        received.extend(held);
    }
    let numbers: BTreeSet<u64> = received.iter().map(number).collect();
    assert_eq!(numbers, (0..60).collect());
    assert_eq!(issuers.len(), 2, "both shards delivered");
}

/// One group whose client never ACKs holds at most its share of the topic's buffer: the
/// topic's other group keeps flowing to the end (before fair shares it filled the whole budget
/// and paused every group of the topic).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stalled_group_holds_only_its_share_while_another_group_flows_to_the_end() {
    let settings = dispatcher_svc::config::DeliverySettings {
        topic_buffer_records: 40,
        pull_batch: 10,
        ack_timeout_ms: 60_000,
        ..fast_settings()
    };
    let instance = Instance::start(settings).await;
    instance.create_topic("busy", 1).await;
    let mut client = instance.client().await;
    let addr = instance.dispatcher_addr();
    let mut stalled_open = open("stalled", "busy", "stalled", LB);
    stalled_open.max_in_flight = 5;
    let mut stalled = subscribe(addr, stalled_open).await;
    let mut healthy = subscribe(addr, open("healthy", "busy", "healthy", LB)).await;
    publish(&mut client, "busy", 0..200).await;
    let mut acked = 0;
    while acked < 200 {
        let got = healthy.deliveries(10, Duration::from_secs(5)).await;
        assert!(
            !got.is_empty(),
            "the healthy group stopped at {acked} of 200"
        );
        acked += got.len();
        healthy.ack_durably(&got).await;
    }
    let budget = instance
        .shared
        .budget(&eventmesh_common::keys::Topic::new("busy").unwrap());
    let held = budget.held_by("stalled");
    assert!(
        held.records <= 20,
        "the stalled group holds its share at most: {held:?}"
    );
    let held_ids: BTreeSet<String> = stalled
        .deliveries(100, Duration::from_millis(500))
        .await
        .into_iter()
        .map(|d| d.delivery_id)
        .collect();
    assert_eq!(held_ids.len(), 5, "in-flight limit");
    // The stalled group ACKs again: it gets everything too.
    let mut stalled_total = 5;
    stalled.deliveries.clear();
    drop(stalled);
    let mut stalled = subscribe(addr, open("stalled", "busy", "stalled", LB)).await;
    loop {
        let got = stalled.deliveries(50, Duration::from_secs(2)).await;
        if got.is_empty() {
            break;
        }
        stalled_total += got.len();
        stalled.ack_durably(&got).await;
    }
    assert!(stalled_total >= 200);
    assert_eq!(budget.governing_group(), None);
}

/// A session whose stream takes nothing (its client never reads, so HTTP/2 flow control stops
/// the writes) does not keep its group's deliveries: after the assignment timeout they go to the
/// group's other session. Before this, the ones its stream never took stayed with it forever.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deliveries_a_session_never_takes_go_to_the_groups_other_session() {
    let settings = dispatcher_svc::config::DeliverySettings {
        ack_timeout_ms: 3_000,
        assign_timeout_ms: 1_000,
        ..fast_settings()
    };
    let instance = Instance::start(settings).await;
    instance.create_topic("pair", 1).await;
    let addr = instance.dispatcher_addr();
    let mut silent_open = open("silent", "pair", "pair", LB);
    silent_open.max_in_flight = 10;
    // Never read: its HTTP/2 window and send buffer hold a few 256 KiB events, the rest stay
    // queued.
    let silent = subscribe(addr, silent_open).await;
    let mut reader = subscribe(addr, open("reader", "pair", "pair", LB)).await;
    let mut client = instance.client().await;
    for n in 0..30u64 {
        let mut event = event(n);
        event.attributes.insert("pad".into(), "x".repeat(4000));
        event.data = Bytes::from(format!("{n}{}", " ".repeat(256 * 1024)));
        client
            .publish(eventmesh_proto::client::PublishRequest {
                topic: "pair".into(),
                event: Some(event),
                key: String::new(),
            })
            .await
            .unwrap();
    }
    let mut seen = BTreeSet::new();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    while seen.len() < 30 && tokio::time::Instant::now() < deadline {
        let got = reader.deliveries(30, Duration::from_secs(1)).await;
        for delivery in &got {
            let data = &delivery.event.as_ref().unwrap().data;
            let n: u64 = std::str::from_utf8(data).unwrap().trim().parse().unwrap();
            seen.insert(n);
        }
        // Plain ACKs: DURABLE answers wait while lower offsets are still out.
        let ids: Vec<&str> = got.iter().map(|d| d.delivery_id.as_str()).collect();
        reader.ack(&ids).await;
    }
    assert_eq!(
        seen.len(),
        30,
        "the reading session got every event: {seen:?}"
    );
    drop(silent);
}

async fn wait_for<F, Fut>(mut check: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    for _ in 0..100 {
        if check().await {
            return;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    panic!("condition not reached in 10 s");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn start_positions_apply_to_new_groups_and_existing_groups_resume() {
    let instance = Instance::start(fast_settings()).await;
    instance.create_topic("starts", 1).await;
    let mut client = instance.client().await;
    publish(&mut client, "starts", 0..3).await;
    let addr = instance.dispatcher_addr();
    let mut latest_open = open("late", "starts", "late", LB);
    latest_open.start = eventmesh_proto::client::StartPosition::Latest as i32;
    let mut late = subscribe(addr, latest_open).await;
    let mut live_open = open("live", "starts", "live", LB);
    live_open.start = eventmesh_proto::client::StartPosition::Unspecified as i32;
    let mut live = subscribe(addr, live_open).await;
    let mut early = subscribe(addr, open("early", "starts", "early", LB)).await;
    assert_eq!(
        early.deliveries(3, WAIT).await.len(),
        3,
        "EARLIEST sees the history"
    );
    assert!(
        late.deliveries(1, Duration::from_millis(500))
            .await
            .is_empty(),
        "LATEST does not"
    );
    assert!(
        live.deliveries(1, Duration::from_millis(100))
            .await
            .is_empty(),
        "the default does not"
    );
    assert_eq!(
        instance.stored("starts", "__mqcursor@late__").await["0"],
        2,
        "the skip is recorded"
    );
    publish(&mut client, "starts", 3..4).await;
    for session in [&mut late, &mut live, &mut early] {
        let got = session.deliveries(1, WAIT).await;
        assert_eq!(got.iter().map(number).collect::<Vec<_>>(), [3]);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_group_without_sessions_dead_letters_its_delivered_events_after_the_grace_period() {
    let settings = dispatcher_svc::config::DeliverySettings {
        group_grace_ms: 300,
        ..fast_settings()
    };
    let instance = Instance::start(settings).await;
    instance.create_topic("graceful", 1).await;
    let mut client = instance.client().await;
    publish(&mut client, "graceful", 0..2).await;
    let mut session = subscribe(instance.dispatcher_addr(), open("app", "graceful", "g", LB)).await;
    let delivered = session.deliveries(2, WAIT).await;
    session.ack_durably(&delivered[..1]).await;
    drop(session);
    // After the grace period the un-ACKed delivery is in graceful_DLQ, tagged with the group,
    // and the group's watermark covers it.
    wait_for(|| async { instance.stored("graceful", "__mqcursor@g__").await.get("0") == Some(&1) })
        .await;
    let letters = TopicReader::new(instance.puller.local_addr(), "inspect", "graceful_DLQ")
        .pull(1_000)
        .await
        .unwrap();
    assert_eq!(letters.len(), 1);
    let letter = DeadLetter::decode(&letters[0].frame).unwrap().unwrap();
    assert_eq!(letter.group, "g");
    assert_eq!(letter.offset, delivered[1].offset);
    assert!(letter.reason.contains("grace period"), "{}", letter.reason);
    wait_for(|| async { instance.shared.group_count() == 0 }).await;
}

/// A client that stops reading while many small runs of deliveries queue for it (more runs
/// than the session's response queue holds, more bytes than the stream's HTTP/2 window) still
/// has its ACKs taken: the delivery it ACKed becomes durable before it reads anything more.
/// The session used to wait for room in that queue without reading the client's messages, so
/// the ACK waited until the client read on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_stops_reading_still_has_its_acks_taken() {
    const RUNS: usize = 150;
    let instance = Instance::start(fast_settings()).await;
    instance.create_topic("stalled", 1).await;
    let mut client = instance.client().await;
    let mut open = open("reader", "stalled", "g", LB);
    open.max_in_flight = 1_000;
    let mut session = subscribe(instance.dispatcher_addr(), open).await;
    let payload = Bytes::from(vec![b'x'; 64 * 1024]);
    let publish_one = |n: usize| pb::PublishRequest {
        topic: "stalled".into(),
        event: Some(bulky_event(format!("stalled-{n}"), &payload)),
        key: String::new(),
    };
    client.publish(publish_one(0)).await.unwrap();
    let first = session.deliveries(1, WAIT).await;
    assert_eq!(first.len(), 1);
    // One event at a time, so the group hands each out in a run of its own.
    for n in 1..=RUNS {
        client.publish(publish_one(n)).await.unwrap();
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    session.ack(&[first[0].delivery_id.as_str()]).await;
    let deadline = tokio::time::Instant::now() + WAIT;
    loop {
        let stored = instance.stored("stalled", "__mqcursor@g__").await;
        if stored.get("0").is_some_and(|&at| at >= first[0].offset) {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "the ACK of a client that stopped reading was not taken: {stored:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let rest = session.deliveries(RUNS, WAIT).await;
    assert_eq!(rest.len(), RUNS, "every delivery still comes");
}

/// An event of `id` carrying `payload`.
fn bulky_event(id: String, payload: &Bytes) -> pb::Event {
    pb::Event {
        id,
        source: "/test".into(),
        r#type: "test".into(),
        data: payload.clone(),
        ..pb::Event::default()
    }
}

/// One delivery waits out a NACK delay while thousands of newer ones of the other partition are
/// delivered, ACKed and retired, a few hundred at a time — past the span after which the
/// group's ring of tracked deliveries moves it aside (4,096 sequence numbers): it still comes
/// back when its delay ends, with the same id, its partition's stored watermark stays below it
/// until it is ACKed, and then every covering ACK of that partition is answered DURABLE.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_delivery_held_back_while_thousands_pass_it_comes_back_and_holds_its_partition() {
    let instance = Instance::start(fast_settings()).await;
    instance.create_topic("held", 2).await;
    let mut client = instance.client().await;
    let publish_one = |n: u64, key: String| pb::PublishRequest {
        topic: "held".into(),
        event: Some(event(n)),
        key,
    };
    let held_at = client
        .publish(publish_one(0, "held".into()))
        .await
        .unwrap()
        .into_inner();
    // A key of the other partition (probes that land beside the held one stay behind it).
    let mut next = 1;
    let other_key = loop {
        let key = format!("other-{next}");
        let at = client
            .publish(publish_one(next, key.clone()))
            .await
            .unwrap();
        next += 1;
        if at.into_inner().partition != held_at.partition {
            break key;
        }
    };
    let mut session = subscribe(instance.dispatcher_addr(), open("app", "held", "", LB)).await;
    let first = session.deliveries(next as usize, WAIT).await;
    assert_eq!(first.len(), next as usize);
    let held = first.iter().find(|d| number(d) == 0).unwrap().clone();
    session.nack(&held.delivery_id, 15_000).await;
    let others: Vec<&str> = first
        .iter()
        .filter(|d| number(d) != 0)
        .map(|d| d.delivery_id.as_str())
        .collect();
    session.ack(&others).await;
    // 6,000 more on the other partition, 500 at a time, each ACKed as it comes: what the
    // group tracks stays small while the sequence numbers run far past the held one.
    const PASSING: u64 = 6_000;
    const CHUNK: u64 = 500;
    let mut redelivered = None;
    for first in (next..next + PASSING).step_by(CHUNK as usize) {
        let entries = (first..first + CHUNK)
            .map(|n| pb::PublishEntry {
                event: Some(event(n)),
                key: other_key.clone(),
            })
            .collect();
        client
            .publish_batch(pb::PublishBatchRequest {
                topic: "held".into(),
                entries,
            })
            .await
            .unwrap();
        let mut passed = 0;
        while passed < CHUNK {
            let got = session.deliveries(256, Duration::from_millis(200)).await;
            let mut ids = Vec::new();
            for delivery in got {
                if number(&delivery) == 0 {
                    redelivered = Some(delivery);
                } else {
                    assert_ne!(delivery.partition, held.partition);
                    ids.push(delivery.delivery_id);
                    passed += 1;
                }
            }
            let ids: Vec<&str> = ids.iter().map(String::as_str).collect();
            session.ack(&ids).await;
        }
    }
    let other_partition = if held.partition == "0" { "1" } else { "0" };
    wait_for(|| async {
        instance
            .stored("held", "__mqcursor__")
            .await
            .get(other_partition)
            .copied()
            >= Some(i64::try_from(PASSING).unwrap())
    })
    .await;
    let before = instance.stored("held", "__mqcursor__").await;
    assert!(
        before.get(&held.partition).is_none_or(|&w| w < held.offset),
        "the held delivery's partition stays below it: {before:?}"
    );
    // Its delay ends: the same id again, as its second attempt.
    let again = match redelivered {
        Some(delivery) => delivery,
        None => session
            .deliveries(1, Duration::from_secs(20))
            .await
            .into_iter()
            .next()
            .expect("the held delivery comes back once its delay ends"),
    };
    assert_eq!(again.delivery_id, held.delivery_id);
    assert_eq!(again.attempt, 2);
    session.ack(&[&again.delivery_id]).await;
    let probes = others.len();
    wait_for(|| async {
        instance
            .stored("held", "__mqcursor__")
            .await
            .get(&held.partition)
            .copied()
            >= Some(held.offset)
    })
    .await;
    // Every ACK of the held partition is answered DURABLE now, the held one included.
    // (One more answer: the NACK's.)
    let acked = PASSING as usize + probes + 1;
    let results = session.results(acked + 1, WAIT).await;
    let durable = results
        .iter()
        .filter(|r| r.outcome() == AckOutcome::Durable)
        .count();
    assert_eq!(durable, acked, "{} answers", results.len());
}

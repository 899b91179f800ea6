//! No silent loss, no stuck group (issue 10), on a real instance: pulls bigger than tonic's
//! 4 MiB default are delivered whole and nothing is skipped; an event at every limit is
//! delivered, not dead-lettered; a second dispatcher on the same puller fences the first off
//! and the group moves without loss; offsets retention removed are reported and stored, never
//! silently passed. (A batch racing a group's end is tested on the actor itself, in
//! `group::tests`.)

#![allow(clippy::unwrap_used)]

mod support;

use std::collections::BTreeSet;
use std::time::Duration;

use bytes::Bytes;
use eventmesh_proto::client::{PublishRequest, SubscriptionMode};
use support::*;

const LB: SubscriptionMode = SubscriptionMode::LoadBalance;

async fn publish_event(
    client: &mut eventmesh_proto::client::event_mesh_service_client::EventMeshServiceClient<
        tonic::transport::Channel,
    >,
    topic: &str,
    event: eventmesh_proto::client::Event,
) {
    client
        .publish(PublishRequest {
            topic: topic.into(),
            event: Some(event),
            key: String::new(),
        })
        .await
        .unwrap();
}

/// Receives and ACKs until `n` distinct events arrived; returns their numbers.
async fn consume(session: &mut Session, n: usize, wait: Duration) -> BTreeSet<u64> {
    let mut seen = BTreeSet::new();
    let deadline = tokio::time::Instant::now() + wait;
    while seen.len() < n && tokio::time::Instant::now() < deadline {
        let got = session.deliveries(64, Duration::from_secs(1)).await;
        let ids: Vec<&str> = got.iter().map(|d| d.delivery_id.as_str()).collect();
        if !ids.is_empty() {
            session.ack(&ids).await;
        }
        seen.extend(got.iter().map(|d| {
            let data = &d.event.as_ref().unwrap().data;
            std::str::from_utf8(data)
                .unwrap()
                .trim()
                .parse::<u64>()
                .unwrap()
        }));
    }
    seen
}

/// The first finding: 16 KB events filled an 8 MiB pull, the dispatcher's client
/// refused the 8 MB answer (tonic's 4 MiB default), the cursor had moved, and the next batch's
/// jump was counted as skipped: the watermark passed every event without a delivery.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pulls_above_four_mebibytes_are_delivered_whole_and_nothing_is_skipped() {
    let instance = Instance::start(fast_settings()).await;
    instance.create_topic("big", 1).await;
    let mut client = instance.client().await;
    for n in 0..600u64 {
        let mut event = event(n);
        event.data = Bytes::from(format!("{n:<16384}"));
        publish_event(&mut client, "big", event).await;
    }
    let mut session = subscribe(instance.dispatcher_addr(), open("app", "big", "", LB)).await;
    let seen = consume(&mut session, 600, Duration::from_secs(60)).await;
    assert_eq!(seen.len(), 600, "every event delivered");
    let mut watermark = None;
    for _ in 0..100 {
        watermark = instance
            .stored("big", "__mqcursor__")
            .await
            .get("0")
            .copied();
        if watermark == Some(599) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(watermark, Some(599));
    assert!(
        instance.stored("big", "__mqlost__").await.is_empty(),
        "nothing was lost"
    );
}

/// An event at every limit: 8 MiB of data and 64 attributes (3 context + 61 extensions of
/// 4 KiB). The puller's stamps used to push it over the 64-attribute limit, so it was
/// dead-lettered; and its delivery exceeds any 4 MiB message limit.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_event_at_every_limit_is_delivered_not_dead_lettered() {
    let instance = Instance::start(fast_settings()).await;
    instance.create_topic("max", 1).await;
    let mut client = instance
        .client()
        .await
        .max_encoding_message_size(dispatcher_svc::server::MAX_MESSAGE_BYTES);
    let mut event = event(7);
    event.data = Bytes::from(vec![b'7'; 8 * 1024 * 1024]);
    for i in 0..61 {
        event
            .attributes
            .insert(format!("x{i:02}"), "v".repeat(4096));
    }
    publish_event(&mut client, "max", event).await;
    let mut session = subscribe(instance.dispatcher_addr(), open("app", "max", "", LB)).await;
    let got = session.deliveries(1, Duration::from_secs(20)).await;
    assert_eq!(got.len(), 1, "the event is delivered");
    let delivered = got[0].event.as_ref().unwrap();
    assert_eq!(delivered.data.len(), 8 * 1024 * 1024);
    assert_eq!(
        delivered
            .attributes
            .keys()
            .filter(|k| k.starts_with('x'))
            .count(),
        61
    );
    session.ack_durably(&got).await;
}

/// Two dispatchers on one puller (a rollout with surge): the second to attach a group's
/// reader holds it; the first's next pull is refused naming the holder, so the first ends
/// the group (its session is told to reconnect) instead of moving a cursor under the other.
/// Every event is ACKed through one of them; none is lost.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_dispatcher_on_the_puller_fences_the_first_and_nothing_is_lost() {
    let instance = Instance::start(fast_settings()).await;
    instance.create_topic("moving", 1).await;
    let mut client = instance.client().await;
    publish(&mut client, "moving", 0..50).await;
    let mut first = subscribe(instance.dispatcher_addr(), open("a", "moving", "g", LB)).await;
    let early = first.deliveries(20, Duration::from_secs(10)).await;
    assert!(!early.is_empty());
    first.ack_durably(&early[..early.len() / 2]).await;
    let (second_dispatcher, second_shared) = start_dispatcher(
        instance.puller.local_addr(),
        instance.offset_addr,
        fast_settings(),
    )
    .await;
    let mut second = subscribe(second_dispatcher.local_addr(), open("b", "moving", "g", LB)).await;
    // The first instance's session ends, naming the dispatcher that holds the group now.
    let ended = tokio::time::timeout(Duration::from_secs(10), async {
        loop {
            match first.rx.message().await {
                Ok(Some(_)) => continue,
                Ok(None) => return None,
                Err(status) => return Some(status),
            }
        }
    })
    .await
    .expect("the first dispatcher gives the group up");
    let status = ended.expect("the stream ends with a status");
    assert_eq!(status.code(), tonic::Code::Unavailable);
    assert!(
        status.message().contains(&second_shared.instance_id),
        "{}",
        status.message()
    );
    // The second delivers everything the first had not made durable.
    let durable: BTreeSet<u64> = early[..early.len() / 2].iter().map(number).collect();
    let rest = consume(&mut second, 50 - durable.len(), Duration::from_secs(30)).await;
    let all: BTreeSet<u64> = durable.union(&rest).copied().collect();
    assert_eq!(all, (0..50).collect(), "no event lost");
    let mut watermark = None;
    for _ in 0..100 {
        watermark = instance
            .stored("moving", "__mqcursor@g__")
            .await
            .get("0")
            .copied();
        if watermark == Some(49) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(watermark, Some(49));
    second_dispatcher.shutdown();
    second_dispatcher.wait().await.unwrap();
}

/// Events retention removed before the group delivered them are reported, not silently
/// passed: the range says how many, the group stores the count with the watermark that passes
/// them (`__mqlost@g__`), and delivery goes on at the log start.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn events_lost_to_retention_are_counted_and_stored_with_the_group() {
    let log = LogSettings {
        segment_bytes: 1024,
        retention_bytes: Some(2048),
        retention_ms: None,
        ..LogSettings::default()
    };
    let instance = Instance::start_with_log(fast_settings(), log).await;
    instance.create_topic("short", 1).await;
    // The group starts at offset 0 and leaves; its grace period keeps it (not pulling).
    let session = subscribe(instance.dispatcher_addr(), open("app", "short", "g", LB)).await;
    drop(session);
    // Past its last long poll (500 ms): the paused group pulls nothing more.
    tokio::time::sleep(Duration::from_millis(800)).await;
    let mut client = instance.client().await;
    publish(&mut client, "short", 0..80).await;
    let mut puller = instance.puller_client().await;
    let start = puller
        .end_offsets(eventmesh_proto::puller::EndOffsetsRequest {
            topic: "short".into(),
        })
        .await
        .unwrap()
        .into_inner()
        .partitions[0]
        .start;
    assert!(start > 0, "retention removed the oldest events");
    let mut session = subscribe(instance.dispatcher_addr(), open("app", "short", "g", LB)).await;
    let seen = consume(&mut session, (80 - start) as usize, Duration::from_secs(30)).await;
    assert_eq!(seen, (start as u64..80).collect());
    let mut lost = None;
    for _ in 0..100 {
        lost = instance
            .stored("short", "__mqlost@g__")
            .await
            .get("0")
            .copied();
        if lost.is_some() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(lost, Some(start), "the loss is stored with the group");
    let mut watermark = None;
    for _ in 0..100 {
        watermark = instance
            .stored("short", "__mqcursor@g__")
            .await
            .get("0")
            .copied();
        if watermark == Some(79) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(watermark, Some(79));
}

/// An operator reset of a live group goes through the dispatcher: the group ends first (its
/// session is told why), everything it wrote is durable before the reset, nothing writes over
/// the reset afterwards, and the group starts again from it. Written to offset-svc directly,
/// the live group kept its in-memory position and its next write raised the watermark again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reset_of_a_live_group_ends_it_first_and_is_not_written_over() {
    let instance = Instance::start(fast_settings()).await;
    instance.create_topic("reset", 1).await;
    let mut client = instance.client().await;
    publish(&mut client, "reset", 0..20).await;
    let mut session = subscribe(instance.dispatcher_addr(), open("app", "reset", "g", LB)).await;
    let delivered = session.deliveries(20, Duration::from_secs(10)).await;
    assert_eq!(delivered.len(), 20);
    session.ack_durably(&delivered[..10]).await;
    let mut admin = eventmesh_proto::client::admin_service_client::AdminServiceClient::connect(
        format!("http://{}", instance.dispatcher_addr()),
    )
    .await
    .unwrap();
    let answer = admin
        .reset_offsets(eventmesh_proto::client::ResetOffsetsRequest {
            topic: "reset".into(),
            target: Some(eventmesh_proto::client::reset_offsets_request::Target::Group("g".into())),
            partition: "0".into(),
            offset: -1,
            reason: "replay everything".into(),
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(answer.sessions_ended, 1);
    assert_eq!(answer.changed.len(), 1);
    assert_eq!(
        (answer.changed[0].previous, answer.changed[0].offset),
        (9, -1)
    );
    let ended = loop {
        match tokio::time::timeout(Duration::from_secs(5), session.rx.message())
            .await
            .unwrap()
        {
            Ok(Some(_)) => continue,
            Ok(None) => panic!("the stream ended without a status"),
            Err(status) => break status,
        }
    };
    assert_eq!(ended.code(), tonic::Code::Unavailable);
    assert!(ended.message().contains("reset"), "{}", ended.message());
    // The ACKs the old session still sends reach no live group; nothing moves the reset.
    let late: Vec<&str> = delivered[10..]
        .iter()
        .map(|d| d.delivery_id.as_str())
        .collect();
    let _ = session
        .tx
        .send(eventmesh_proto::client::SubscribeRequest {
            kind: Some(eventmesh_proto::client::subscribe_request::Kind::Ack(
                eventmesh_proto::client::Ack {
                    delivery_ids: late.iter().map(|id| (*id).to_owned()).collect(),
                },
            )),
        })
        .await;
    tokio::time::sleep(Duration::from_millis(800)).await;
    assert_eq!(
        instance.stored("reset", "__mqcursor@g__").await.get("0"),
        Some(&-1)
    );
    let mut again = subscribe(instance.dispatcher_addr(), open("app", "reset", "g", LB)).await;
    let replayed = again.deliveries(20, Duration::from_secs(10)).await;
    assert_eq!(
        replayed.iter().map(|d| d.offset).collect::<Vec<_>>(),
        (0..20).collect::<Vec<i64>>(),
        "the group starts again from the reset"
    );
}

/// Caps on what one client can ask for: a NACK delay or an extension beyond the configured
/// maximum is capped, and the answer says so; the capped NACK redelivers at the cap.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nack_delays_and_extensions_are_capped_and_the_answer_says_so() {
    let settings = dispatcher_svc::config::DeliverySettings {
        max_nack_delay_ms: 300,
        max_extend_ms: 1_000,
        ..fast_settings()
    };
    let instance = Instance::start(settings).await;
    instance.create_topic("caps", 1).await;
    let mut client = instance.client().await;
    publish(&mut client, "caps", 0..2).await;
    let mut session = subscribe(instance.dispatcher_addr(), open("app", "caps", "", LB)).await;
    let got = session.deliveries(2, Duration::from_secs(10)).await;
    session.extend(&got[1].delivery_id, 3_600_000).await;
    session.nack(&got[0].delivery_id, 3_600_000).await;
    let results = session.results(2, Duration::from_secs(5)).await;
    let extended = results
        .iter()
        .find(|r| r.delivery_id == got[1].delivery_id)
        .unwrap();
    assert!(
        extended.detail.contains("capped to 1000 ms"),
        "{extended:?}"
    );
    let nacked = results
        .iter()
        .find(|r| r.delivery_id == got[0].delivery_id)
        .unwrap();
    assert!(nacked.detail.contains("capped to 300 ms"), "{nacked:?}");
    // Asked for an hour, back within the cap.
    let again = session.deliveries(1, Duration::from_secs(3)).await;
    assert_eq!(again.len(), 1, "redelivered at the capped delay");
    assert_eq!(again[0].delivery_id, got[0].delivery_id);
}

/// A BROADCAST client whose id equals a named group's name is a group of its own: each gets
/// every event (it used to join the named group and share its events and progress).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_broadcast_client_named_like_a_group_does_not_join_it() {
    let instance = Instance::start(fast_settings()).await;
    instance.create_topic("names", 1).await;
    let mut client = instance.client().await;
    let addr = instance.dispatcher_addr();
    let mut named = subscribe(addr, open("worker", "names", "billing", LB)).await;
    let mut broadcast = subscribe(
        addr,
        open("billing", "names", "", SubscriptionMode::Broadcast),
    )
    .await;
    assert_eq!(named.opened.group, "billing");
    assert_eq!(broadcast.opened.group, "~billing");
    publish(&mut client, "names", 0..10).await;
    assert_eq!(
        consume(&mut named, 10, Duration::from_secs(10)).await.len(),
        10
    );
    assert_eq!(
        consume(&mut broadcast, 10, Duration::from_secs(10))
            .await
            .len(),
        10
    );
}

/// A new group starting at LATEST on an empty partition, whose dispatcher crashes after
/// delivering and before any ACK: after the restart the events come back. Before, nothing was
/// stored for the start (the end was 0), the restarted group looked new, and a puller set to
/// `--start latest` put it at the end, past events delivered but never ACKed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_group_starting_at_latest_gets_its_unacked_events_back_after_a_crash() {
    let dir = tempfile::tempdir().unwrap();
    let offsets =
        start_offset_svc(&dir.path().join("offsets"), "127.0.0.1:0".parse().unwrap()).await;
    let storage: std::sync::Arc<dyn puller_svc::storage::Storage> = std::sync::Arc::new(
        puller_svc::storage::local::LocalStorage::open(
            dir.path().join("puller"),
            LogSettings::default(),
            puller_svc::cursors::StartAt::Latest,
        )
        .unwrap(),
    );
    let puller = start_puller_over(storage, offsets.local_addr(), 1).await;
    let (dispatcher, _) =
        start_dispatcher(puller.local_addr(), offsets.local_addr(), fast_settings()).await;
    let mut latest = open("app", "fresh", "late", LB);
    latest.start = eventmesh_proto::client::StartPosition::Latest as i32;
    let mut session = subscribe(dispatcher.local_addr(), latest.clone()).await;
    let mut client =
        eventmesh_proto::client::event_mesh_service_client::EventMeshServiceClient::new(lazy(
            dispatcher.local_addr(),
        ));
    publish(&mut client, "fresh", 0..5).await;
    assert_eq!(
        session.deliveries(5, Duration::from_secs(10)).await.len(),
        5
    );
    // The dispatcher goes away before any ACK (it stored nothing but the group's start).
    drop(session);
    dispatcher.shutdown();
    dispatcher.wait().await.unwrap();
    let (dispatcher, _) =
        start_dispatcher(puller.local_addr(), offsets.local_addr(), fast_settings()).await;
    let mut again = subscribe(dispatcher.local_addr(), latest).await;
    let back = consume(&mut again, 5, Duration::from_secs(10)).await;
    assert_eq!(
        back,
        (0..5).collect(),
        "delivered but never ACKed: they come back"
    );
}

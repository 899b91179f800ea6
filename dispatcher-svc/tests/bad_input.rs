//! Bad input on the client API gets the documented status or outcome, never a panic, never a
//! silent drop, and never breaks a session over one bad delivery id.

#![allow(clippy::unwrap_used)]

mod support;

use std::collections::HashMap;
use std::time::Duration;

use bytes::Bytes;
use eventmesh_proto::client as pb;
use eventmesh_proto::client::{AckOutcome, SubscriptionMode, subscribe_request};
use support::*;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::Code;

const WAIT: Duration = Duration::from_secs(10);
const LB: SubscriptionMode = SubscriptionMode::LoadBalance;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn invalid_opens_are_refused_with_invalid_argument_naming_the_field() {
    let instance = Instance::start(fast_settings()).await;
    let addr = instance.dispatcher_addr();
    let cases = [
        (open("", "t", "", LB), "open.client_id"),
        (open("a#b", "t", "", LB), "open.client_id"),
        (open("__mqcursor__", "t", "", LB), "open.client_id"),
        (open("app", "", "", LB), "open.topic"),
        (open("app", "a@b", "", LB), "open.topic"),
        (open("app", "a#b", "", LB), "open.topic"),
        (open("app", "t", "bad group", LB), "open.group"),
        (open("app", "t", &"g".repeat(129), LB), "open.group"),
        (
            open("has space", "t", "", SubscriptionMode::Broadcast),
            "BROADCAST",
        ),
        (
            pb::Open {
                mode: 42,
                ..open("app", "t", "", LB)
            },
            "open.mode",
        ),
        (
            pb::Open {
                start: 9,
                ..open("app", "t", "", LB)
            },
            "open.start",
        ),
    ];
    for (open, field) in cases {
        let status = match try_subscribe(addr, open.clone()).await {
            Ok(_) => panic!("{open:?} was accepted"),
            Err(status) => status,
        };
        assert_eq!(status.code(), Code::InvalidArgument, "{open:?}: {status}");
        assert!(status.message().contains(field), "{open:?}: {status}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_must_start_with_one_open() {
    let instance = Instance::start(fast_settings()).await;
    let mut client = instance.client().await;
    let (tx, rx) = mpsc::channel(4);
    tx.send(pb::SubscribeRequest {
        kind: Some(subscribe_request::Kind::Ack(pb::Ack {
            delivery_ids: vec!["x".into()],
        })),
    })
    .await
    .unwrap();
    let status = client.subscribe(ReceiverStream::new(rx)).await.unwrap_err();
    assert_eq!(status.code(), Code::FailedPrecondition);

    let mut session = subscribe(instance.dispatcher_addr(), open("app", "twice", "", LB)).await;
    session
        .tx
        .send(pb::SubscribeRequest {
            kind: Some(subscribe_request::Kind::Open(open("app", "twice", "", LB))),
        })
        .await
        .unwrap();
    let status = loop {
        match session.rx.message().await {
            Ok(Some(_)) => continue,
            Ok(None) => panic!("ended without a status"),
            Err(status) => break status,
        }
    };
    assert_eq!(status.code(), Code::FailedPrecondition);
    assert!(status.message().contains("open"), "{status}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn publish_refuses_reserved_attributes_and_oversized_events() {
    let instance = Instance::start(fast_settings()).await;
    let mut client = instance.client().await;
    let publish = |event: pb::Event, topic: &str| pb::PublishRequest {
        topic: topic.into(),
        event: Some(event),
        key: String::new(),
    };
    let mut reserved = event(1);
    reserved.attributes = HashMap::from([("emmqoffset".to_owned(), "7".to_owned())]);
    let status = client.publish(publish(reserved, "t")).await.unwrap_err();
    assert_eq!(status.code(), Code::InvalidArgument);
    assert!(status.message().contains("reserved"), "{status}");

    let mut huge = event(1);
    huge.data = Bytes::from(vec![0u8; 8 * 1024 * 1024 + 1]);
    let status = client.publish(publish(huge, "t")).await.unwrap_err();
    assert_eq!(status.code(), Code::ResourceExhausted, "{status}");

    let status = client
        .publish(publish(event(1), "bad#topic"))
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::InvalidArgument);
    let status = client
        .publish(pb::PublishRequest {
            topic: "t".into(),
            event: None,
            key: String::new(),
        })
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::InvalidArgument);
    // A topic name whose on-disk form cannot be a file name (each space takes three bytes) is
    // refused with the rule, not answered UNAVAILABLE (which clients retry forever); so is a
    // name too long to leave room for its dead-letter topic, and a key above 64 KiB.
    let status = client
        .publish(publish(event(1), &" ".repeat(100)))
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::InvalidArgument, "{status}");
    assert!(status.message().contains("255"), "{status}");
    let status = client
        .publish(publish(event(1), &"t".repeat(246)))
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::InvalidArgument, "{status}");
    let status = client
        .publish(pb::PublishRequest {
            topic: "t".into(),
            event: Some(event(1)),
            key: "k".repeat(64 * 1024 + 1),
        })
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::InvalidArgument, "{status}");
    assert!(status.message().contains("key"), "{status}");
    let mut open_spaces = open("c", &" ".repeat(100), "", SubscriptionMode::LoadBalance);
    open_spaces.start = 0;
    let status = try_subscribe(instance.dispatcher_addr(), open_spaces)
        .await
        .err()
        .unwrap();
    assert_eq!(status.code(), Code::InvalidArgument, "{status}");
    // Nothing of the above reached the topic; a good event does, with a generated id.
    let mut good = event(1);
    good.id = String::new();
    let stored = client
        .publish(publish(good, "t"))
        .await
        .unwrap()
        .into_inner();
    assert!(!stored.event_id.is_empty());
    assert_eq!(stored.offset, 0, "the refused events were never appended");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_cannot_settle_another_clients_delivery() {
    let instance = Instance::start(fast_settings()).await;
    instance.create_topic("owned", 1).await;
    let mut client = instance.client().await;
    publish(&mut client, "owned", 0..2).await;
    let addr = instance.dispatcher_addr();
    let mut owner = subscribe(addr, open("owner", "owned", "g", LB)).await;
    let mut deliveries = owner.deliveries(2, WAIT).await;
    let (delivery, second) = (deliveries.remove(0), deliveries.remove(0));
    let mut thief = subscribe(addr, open("thief", "other-topic", "", LB)).await;
    thief.ack(&[&delivery.delivery_id]).await;
    thief.nack(&delivery.delivery_id, 0).await;
    let results = thief.results(2, WAIT).await;
    assert!(
        results.iter().all(|r| r.outcome() == AckOutcome::NotOwned),
        "{results:?}"
    );
    // Still the owner's to settle.
    owner.ack_durably(std::slice::from_ref(&delivery)).await;
    // An id of a group that never existed, and one from "another instance".
    let mut parts: Vec<String> = delivery.delivery_id.split('.').map(str::to_owned).collect();
    parts[1] = "ffff".into();
    let foreign_group = parts.join(".");
    parts[0] = "1".into();
    let foreign_epoch = parts.join(".");
    // Mixed in one message with a good id and a malformed one: each is answered on its own.
    owner
        .ack(&[
            &foreign_group,
            &second.delivery_id,
            "not-an-id",
            &foreign_epoch,
        ])
        .await;
    let results = owner.results(4, WAIT).await;
    assert_eq!(outcome_of(&results, &foreign_group), AckOutcome::Unknown);
    assert_eq!(outcome_of(&results, &foreign_epoch), AckOutcome::Unknown);
    assert_eq!(outcome_of(&results, "not-an-id"), AckOutcome::Unknown);
    assert_eq!(
        outcome_of(&results, &second.delivery_id),
        AckOutcome::Durable
    );
}

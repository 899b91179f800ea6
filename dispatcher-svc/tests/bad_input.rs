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

/// A client speaking the protocol byte by byte can send an ACK id that is not UTF-8 (no SDK
/// can: ids are strings). It is answered UNKNOWN like any malformed id, with the bytes as text
/// (replacement characters), and the good id beside it in the same message still settles: the
/// session does not fail over one bad id.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_ack_id_that_is_not_utf8_is_answered_unknown_and_the_session_goes_on() {
    use eventmesh_proto::encoded::SubscribeRequestIn;
    use tonic::codegen::http::uri::PathAndQuery;

    let instance = Instance::start(fast_settings()).await;
    instance.create_topic("bytes", 1).await;
    let mut client = instance.client().await;
    publish(&mut client, "bytes", 0..2).await;
    let channel =
        tonic::transport::Channel::from_shared(format!("http://{}", instance.dispatcher_addr()))
            .unwrap()
            .connect()
            .await
            .unwrap();
    let mut grpc = tonic::client::Grpc::new(channel);
    grpc.ready().await.unwrap();
    let (tx, rx) = mpsc::channel(8);
    let open = pb::SubscribeRequest {
        kind: Some(subscribe_request::Kind::Open(open("raw", "bytes", "g", LB))),
    };
    tx.send(SubscribeRequestIn::from(open)).await.unwrap();
    let mut responses = grpc
        .streaming(
            tonic::Request::new(ReceiverStream::new(rx)),
            PathAndQuery::from_static("/eventmesh.v1.EventMeshService/Subscribe"),
            tonic_prost::ProstCodec::<SubscribeRequestIn, pb::SubscribeResponse>::default(),
        )
        .await
        .unwrap()
        .into_inner();
    async fn receive(
        responses: &mut tonic::Streaming<pb::SubscribeResponse>,
        deliveries: &mut Vec<pb::Delivery>,
        results: &mut Vec<pb::AckResult>,
        done: impl Fn(&[pb::Delivery], &[pb::AckResult]) -> bool,
    ) {
        while !done(deliveries, results) {
            let message = tokio::time::timeout(WAIT, responses.message())
                .await
                .expect("in time")
                .expect("the stream goes on")
                .expect("not ended");
            for item in message.into_items() {
                match item {
                    eventmesh_proto::SubscribeItem::Delivery(d) => deliveries.push(d),
                    eventmesh_proto::SubscribeItem::AckResult(r) => results.push(r),
                    eventmesh_proto::SubscribeItem::Opened(_) => {}
                }
            }
        }
    }
    let (mut deliveries, mut results) = (Vec::new(), Vec::new());
    receive(&mut responses, &mut deliveries, &mut results, |d, _| {
        d.len() >= 2
    })
    .await;
    let not_text = Bytes::from_static(&[b'1', 0xff, b'.', 0x00]);
    tx.send(SubscribeRequestIn::Ack(vec![
        not_text,
        Bytes::from(deliveries[0].delivery_id.clone()),
    ]))
    .await
    .unwrap();
    receive(&mut responses, &mut deliveries, &mut results, |_, r| {
        r.len() >= 2
    })
    .await;
    assert_eq!(outcome_of(&results, "1\u{fffd}.\0"), AckOutcome::Unknown);
    assert_eq!(
        outcome_of(&results, &deliveries[0].delivery_id),
        AckOutcome::Durable
    );
    // And the session still works.
    tx.send(SubscribeRequestIn::Ack(vec![Bytes::from(
        deliveries[1].delivery_id.clone(),
    )]))
    .await
    .unwrap();
    receive(&mut responses, &mut deliveries, &mut results, |_, r| {
        r.len() >= 3
    })
    .await;
    assert_eq!(results[2].outcome(), AckOutcome::Durable);
}

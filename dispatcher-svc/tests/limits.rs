//! Protective limits on the client port (issue 14, item 3), each answered RESOURCE_EXHAUSTED
//! with the limit named: sessions per client id, Subscribe streams per connection, and publish
//! calls in progress (shed at once with a retry pushback; nothing shed is stored, nothing
//! accepted is lost).

#![allow(clippy::unwrap_used)]

mod support;

use std::time::Duration;

use eventmesh_proto::client::SubscriptionMode;
use eventmesh_proto::client::event_mesh_service_client::EventMeshServiceClient;
use support::*;
use tonic::Code;

#[tokio::test]
async fn a_client_id_gets_its_session_limit_and_a_closed_session_frees_one() {
    let mut settings = fast_settings();
    settings.max_sessions_per_client = 2;
    let instance = Instance::start(settings).await;
    let addr = instance.dispatcher_addr();
    let first = subscribe(
        addr,
        open("app", "lim", "g1", SubscriptionMode::LoadBalance),
    )
    .await;
    let _second = subscribe(
        addr,
        open("app", "lim", "g2", SubscriptionMode::LoadBalance),
    )
    .await;
    let refused = try_subscribe(
        addr,
        open("app", "lim", "g3", SubscriptionMode::LoadBalance),
    )
    .await
    .err()
    .unwrap();
    assert_eq!(refused.code(), Code::ResourceExhausted, "{refused}");
    assert!(
        refused.message().contains("max_sessions_per_client")
            && refused.message().contains("\"app\""),
        "{refused}"
    );
    // Another client id is not affected.
    let _other = subscribe(
        addr,
        open("other", "lim", "g3", SubscriptionMode::LoadBalance),
    )
    .await;
    // Closing a session frees its place (the count drops when its task ends).
    drop(first);
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        match try_subscribe(
            addr,
            open("app", "lim", "g3", SubscriptionMode::LoadBalance),
        )
        .await
        {
            Ok(_) => break,
            Err(status) => {
                assert_eq!(status.code(), Code::ResourceExhausted, "{status}");
                assert!(
                    tokio::time::Instant::now() < deadline,
                    "the closed session's place never freed"
                );
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    }
}

#[tokio::test]
async fn a_connection_gets_its_stream_limit_and_another_connection_its_own() {
    let mut settings = fast_settings();
    settings.max_streams_per_connection = 2;
    let instance = Instance::start(settings).await;
    let addr = instance.dispatcher_addr();
    let mut connection = EventMeshServiceClient::connect(format!("http://{addr}"))
        .await
        .unwrap();
    let _a = try_subscribe_on(
        &mut connection,
        open("c1", "conn", "g", SubscriptionMode::LoadBalance),
    )
    .await
    .unwrap();
    let _b = try_subscribe_on(
        &mut connection,
        open("c2", "conn", "g", SubscriptionMode::LoadBalance),
    )
    .await
    .unwrap();
    let refused = try_subscribe_on(
        &mut connection,
        open("c3", "conn", "g", SubscriptionMode::LoadBalance),
    )
    .await
    .err()
    .unwrap();
    assert_eq!(refused.code(), Code::ResourceExhausted, "{refused}");
    assert!(
        refused.message().contains("max_streams_per_connection"),
        "{refused}"
    );
    // A new connection has its own streams.
    let _c = subscribe(addr, open("c3", "conn", "g", SubscriptionMode::LoadBalance)).await;
    assert_eq!(instance.shared.connection_streams.connections(), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn publishes_beyond_the_limit_are_shed_with_a_pushback_and_none_is_lost() {
    let mut settings = fast_settings();
    settings.max_publishes_in_progress = 1;
    let instance = Instance::start(settings).await;
    instance.create_topic("shed", 1).await;
    let client = instance.client().await;
    let calls: Vec<_> = (0..300)
        .map(|n| {
            let mut client = client.clone();
            tokio::spawn(async move {
                client
                    .publish(eventmesh_proto::client::PublishRequest {
                        topic: "shed".into(),
                        key: String::new(),
                        event: Some(event(n)),
                    })
                    .await
            })
        })
        .collect();
    let (mut accepted, mut shed) = (0, 0);
    for call in calls {
        match call.await.unwrap() {
            Ok(_) => accepted += 1,
            Err(status) => {
                assert_eq!(status.code(), Code::ResourceExhausted, "{status}");
                assert!(
                    status.metadata().get("grpc-retry-pushback-ms").is_some(),
                    "{status:?}"
                );
                assert!(
                    status.message().contains("max_publishes_in_progress"),
                    "{status}"
                );
                shed += 1;
            }
        }
    }
    assert!(
        shed > 0,
        "300 concurrent publishes with a limit of 1 shed none"
    );
    assert!(accepted > 0);
    // Exactly what was accepted is in the log.
    let ends = instance
        .puller_client()
        .await
        .end_offsets(eventmesh_proto::puller::EndOffsetsRequest {
            topic: "shed".into(),
        })
        .await
        .unwrap()
        .into_inner();
    let stored: i64 = ends.partitions.iter().map(|p| p.end - p.start).sum();
    assert_eq!(stored, accepted, "accepted {accepted}, shed {shed}");
}

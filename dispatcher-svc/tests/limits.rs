//! Protective limits on the client port (issue 14, item 3), each answered with a clear status
//! naming the limit: sessions per client id, Subscribe streams per connection and publish
//! calls in progress (RESOURCE_EXHAUSTED; shed at once with a retry pushback, nothing shed is
//! stored, nothing accepted is lost); the per-call limit (DEADLINE_EXCEEDED); and the HTTP/2
//! header limit (refused before any handler).

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

/// A Subscribe that never sends its `open` holds its stream slot only until the call limit,
/// then ends with DEADLINE_EXCEEDED naming the setting; the connection's slot is free again.
#[tokio::test]
async fn a_subscribe_that_never_opens_ends_at_the_call_limit_and_frees_its_stream() {
    let mut settings = fast_settings();
    settings.max_streams_per_connection = 1;
    settings.call_limit_ms = 300;
    let instance = Instance::start(settings).await;
    let addr = instance.dispatcher_addr();
    let mut connection = EventMeshServiceClient::connect(format!("http://{addr}"))
        .await
        .unwrap();
    // A request stream that stays open and never yields a message.
    let (_silent, requests) = tokio::sync::mpsc::unbounded_channel();
    let cut = connection
        .subscribe(tokio_stream::wrappers::UnboundedReceiverStream::new(
            requests,
        ))
        .await
        .err()
        .unwrap();
    assert_eq!(cut.code(), Code::DeadlineExceeded, "{cut}");
    assert!(
        cut.message().contains("300 ms") && cut.message().contains("call_limit_ms"),
        "{cut}"
    );
    // The same connection opens a session: the silent stream's slot was given back.
    let _session = try_subscribe_on(
        &mut connection,
        open("c1", "silent", "g", SubscriptionMode::LoadBalance),
    )
    .await
    .unwrap();
}

/// A publish whose neighbour never answers (a puller that accepts connections and says
/// nothing) is answered DEADLINE_EXCEEDED at the call limit, well before the dependency
/// timeout, and names the setting.
#[tokio::test]
async fn a_publish_stuck_on_a_silent_puller_is_answered_at_the_call_limit() {
    let silent = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let silent_addr = silent.local_addr().unwrap();
    let holder = tokio::spawn(async move {
        let mut held = Vec::new();
        while let Ok((socket, _)) = silent.accept().await {
            held.push(socket);
        }
    });
    let offsets = tempfile::tempdir().unwrap();
    let offset_svc = start_offset_svc(offsets.path(), "127.0.0.1:0".parse().unwrap()).await;
    let mut settings = fast_settings();
    settings.call_limit_ms = 300;
    let (dispatcher, _shared) =
        start_dispatcher(silent_addr, offset_svc.local_addr(), settings).await;
    let mut client = EventMeshServiceClient::new(lazy(dispatcher.local_addr()));
    let stuck = client
        .publish(eventmesh_proto::client::PublishRequest {
            topic: "silent".into(),
            event: Some(event(1)),
            key: String::new(),
        })
        .await
        .err()
        .unwrap();
    assert_eq!(stuck.code(), Code::DeadlineExceeded, "{stuck}");
    assert!(stuck.message().contains("call_limit_ms"), "{stuck}");
    holder.abort();
}

/// A call whose metadata is larger than the servers' 16 KiB header limit is refused before
/// any handler runs (HTTP 431, which gRPC clients report with that reason); the server goes
/// on serving normal calls.
#[tokio::test]
async fn oversized_metadata_is_refused_and_the_server_goes_on() {
    let instance = Instance::start(fast_settings()).await;
    let addr = instance.dispatcher_addr();
    let mut client = EventMeshServiceClient::new(lazy(addr));
    let mut request = tonic::Request::new(eventmesh_proto::client::PublishRequest {
        topic: "big-headers".into(),
        event: Some(event(1)),
        key: String::new(),
    });
    request
        .metadata_mut()
        .insert("x-padding", "p".repeat(32 * 1024).parse().unwrap());
    let refused = client.publish(request).await.err().unwrap();
    // HTTP 431 Request Header Fields Too Large, from the server (the client sent it all).
    assert!(refused.message().contains("431"), "{refused:?}");
    // Nothing was stored, and a normal call on a new connection is served.
    let mut client = EventMeshServiceClient::new(lazy(addr));
    let stored = client
        .publish(eventmesh_proto::client::PublishRequest {
            topic: "big-headers".into(),
            event: Some(event(2)),
            key: String::new(),
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(stored.offset, 0, "the refused event was not stored");
}

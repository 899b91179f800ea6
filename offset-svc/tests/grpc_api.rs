//! The gRPC OffsetService end to end over loopback: batched writes, reads, operator calls,
//! bad input, health, reflection, a failing store, and graceful shutdown.

#![allow(clippy::unwrap_used)] // tests and benches: a failed unwrap is a failed run

use std::path::Path;

use eventmesh_common::shutdown::CancellationToken;
use eventmesh_proto::offset::offset_service_client::OffsetServiceClient;
use eventmesh_proto::offset::{
    DeleteOffsetsRequest, ListTopicsRequest, OffsetEntry, OffsetKey, OffsetSelector,
    ReadOffsetRequest, ReadTopicOffsetsRequest, ResetOffsetsRequest, WriteOffsetsRequest,
    WriteOffsetsStreamRequest, WriteOffsetsStreamResponse,
};
use offset_svc::config::{Config, StoreKind};
use offset_svc::server::{RunningServer, start};
use tonic::Code;
use tonic::transport::Channel;

async fn serve(
    store: StoreKind,
    data_dir: &Path,
    read_only: bool,
) -> (RunningServer, OffsetServiceClient<Channel>) {
    let config = Config {
        listen: "127.0.0.1:0".parse().unwrap(),
        data_dir: data_dir.to_owned(),
        store,
        read_only,
        ..Config::default()
    };
    let server = start(config, CancellationToken::new()).await.unwrap();
    let client = OffsetServiceClient::new(server.channel().await.unwrap());
    (server, client)
}

fn pkey(topic: &str, client: &str, partition: &str) -> OffsetKey {
    OffsetKey {
        topic: topic.into(),
        client_id: client.into(),
        partition: partition.into(),
    }
}

fn entry(topic: &str, client: &str, partition: &str, offset: i64) -> OffsetEntry {
    OffsetEntry {
        key: Some(pkey(topic, client, partition)),
        offset,
    }
}

async fn read(client: &mut OffsetServiceClient<Channel>, key: OffsetKey) -> i64 {
    client
        .read_offset(ReadOffsetRequest { key: Some(key) })
        .await
        .unwrap()
        .into_inner()
        .offset
}

#[tokio::test]
async fn batched_writes_answer_each_entry_from_memory() {
    for kind in [StoreKind::Memory, StoreKind::Rocksdb] {
        let dir = tempfile::tempdir().unwrap();
        let (server, mut client) = serve(kind, dir.path(), false).await;
        let response = client
            .write_offsets(WriteOffsetsRequest {
                entries: vec![
                    entry("orders", "c-1", "0", 100),
                    entry("orders", "c-1", "0", 10),
                    entry("orders", "__mqcursor__", "0", 99),
                    entry("orders", "__mqcursor@billing__", "broker-a:3", 5),
                    entry("parent", "c-1", "chat@2", 1),
                ],
                sync: true,
            })
            .await
            .unwrap()
            .into_inner();
        let got: Vec<(i64, bool)> = response
            .results
            .iter()
            .map(|r| (r.stored, r.advanced))
            .collect();
        assert_eq!(
            got,
            [(100, true), (100, false), (99, true), (5, true), (1, true)],
            "{kind:?}"
        );
        assert_eq!(read(&mut client, pkey("orders", "c-1", "0")).await, 100);
        assert_eq!(read(&mut client, pkey("orders", "nobody", "0")).await, -1);

        let topics = client
            .list_topics(ListTopicsRequest {})
            .await
            .unwrap()
            .into_inner()
            .topics;
        assert_eq!(topics, ["orders", "parent"]);
        let cursors = client
            .read_topic_offsets(ReadTopicOffsetsRequest {
                topic: "orders".into(),
                client_id: "__mqcursor@billing__".into(),
            })
            .await
            .unwrap()
            .into_inner()
            .entries;
        assert_eq!(
            cursors,
            [entry("orders", "__mqcursor@billing__", "broker-a:3", 5)]
        );
        server.shutdown();
        server.wait().await.unwrap();
    }
}

#[tokio::test]
async fn bad_input_is_invalid_argument_naming_the_field() {
    let dir = tempfile::tempdir().unwrap();
    let (server, mut client) = serve(StoreKind::Memory, dir.path(), false).await;
    let cases = [
        (
            entry("a#b", "c", "0", 1),
            "entries[1].key.topic",
            "must not contain '#'",
        ),
        (
            entry("a@b", "c", "0", 1),
            "entries[1].key.topic",
            "must not contain '@'",
        ),
        (
            entry("", "c", "0", 1),
            "entries[1].key.topic",
            "must not be empty",
        ),
        (
            entry("t", "", "0", 1),
            "entries[1].key.client_id",
            "must not be empty",
        ),
        (
            entry("t", "x#y", "0", 1),
            "entries[1].key.client_id",
            "must not contain '#'",
        ),
        (
            entry("t", "__admin__", "0", 1),
            "entries[1].key.client_id",
            "reserved form",
        ),
        (
            entry("t", "__mqcursor@bad group__", "0", 1),
            "entries[1].key.client_id",
            "group",
        ),
        (
            entry("t", "c", "-1", 1),
            "entries[1].key.partition",
            "malformed",
        ),
        (
            entry("t", "c", "a#1", 1),
            "entries[1].key.partition",
            "must not contain '#'",
        ),
        (entry("t", "c", "0", -5), "entries[1].offset", "below -1"),
        (
            OffsetEntry {
                key: None,
                offset: 1,
            },
            "entries[1].key",
            "missing",
        ),
    ];
    for (bad, field, why) in cases {
        let status = client
            .write_offsets(WriteOffsetsRequest {
                entries: vec![entry("good", "c", "0", 1), bad.clone()],
                sync: false,
            })
            .await
            .unwrap_err();
        assert_eq!(status.code(), Code::InvalidArgument, "{bad:?}");
        assert!(
            status.message().starts_with(&format!("invalid {field}:")),
            "{}",
            status.message()
        );
        assert!(status.message().contains(why), "{}", status.message());
    }
    assert_eq!(
        read(&mut client, pkey("good", "c", "0")).await,
        -1,
        "a rejected batch applies nothing"
    );

    let status = client
        .read_offset(ReadOffsetRequest { key: None })
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::InvalidArgument);
    let status = client
        .reset_offsets(ResetOffsetsRequest {
            selector: Some(OffsetSelector {
                topic: "t".into(),
                client_id: String::new(),
                partition: String::new(),
            }),
            offset: 1,
            reason: String::new(),
        })
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::InvalidArgument);
    assert!(status.message().contains("reason"), "{}", status.message());
    server.shutdown();
    server.wait().await.unwrap();
}

#[tokio::test]
async fn operator_reset_and_delete_over_grpc() {
    let dir = tempfile::tempdir().unwrap();
    let (server, mut client) = serve(StoreKind::Rocksdb, dir.path(), false).await;
    client
        .write_offsets(WriteOffsetsRequest {
            entries: vec![entry("t", "a", "0", 50), entry("t", "b", "0", 60)],
            sync: false,
        })
        .await
        .unwrap();
    let selector = OffsetSelector {
        topic: "t".into(),
        client_id: "a".into(),
        partition: String::new(),
    };
    let previous = client
        .reset_offsets(ResetOffsetsRequest {
            selector: Some(selector.clone()),
            offset: 7,
            reason: "reprocess".into(),
        })
        .await
        .unwrap()
        .into_inner()
        .previous;
    assert_eq!(previous, [entry("t", "a", "0", 50)]);
    assert_eq!(read(&mut client, pkey("t", "a", "0")).await, 7);
    let removed = client
        .delete_offsets(DeleteOffsetsRequest {
            selector: Some(selector),
            reason: "client retired".into(),
        })
        .await
        .unwrap()
        .into_inner()
        .removed;
    assert_eq!(removed, [entry("t", "a", "0", 7)]);
    assert_eq!(read(&mut client, pkey("t", "a", "0")).await, -1);
    assert_eq!(read(&mut client, pkey("t", "b", "0")).await, 60);
    server.shutdown();
    server.wait().await.unwrap();
}

#[tokio::test]
async fn a_failing_store_answers_unavailable() {
    let dir = tempfile::tempdir().unwrap();
    {
        let (server, mut client) = serve(StoreKind::Rocksdb, dir.path(), false).await;
        client
            .write_offsets(WriteOffsetsRequest {
                entries: vec![entry("t", "c", "0", 3)],
                sync: false,
            })
            .await
            .unwrap();
        server.shutdown();
        server.wait().await.unwrap();
    }
    let (server, mut client) = serve(StoreKind::Rocksdb, dir.path(), true).await;
    let status = client
        .write_offsets(WriteOffsetsRequest {
            entries: vec![entry("t", "c", "0", 4)],
            sync: false,
        })
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::Unavailable, "{status:?}");
    assert!(
        status.message().contains("write failed"),
        "{}",
        status.message()
    );
    assert_eq!(read(&mut client, pkey("t", "c", "0")).await, 3);
    server.shutdown();
    server.wait().await.unwrap();
}

#[tokio::test]
async fn health_and_reflection_are_served() {
    use tonic_health::pb::health_check_response::ServingStatus;
    use tonic_health::pb::{HealthCheckRequest, health_client::HealthClient};
    use tonic_reflection::pb::v1::ServerReflectionRequest;
    use tonic_reflection::pb::v1::server_reflection_client::ServerReflectionClient;
    use tonic_reflection::pb::v1::server_reflection_request::MessageRequest;
    use tonic_reflection::pb::v1::server_reflection_response::MessageResponse;

    let dir = tempfile::tempdir().unwrap();
    let (server, _client) = serve(StoreKind::Memory, dir.path(), false).await;
    let channel = server.channel().await.unwrap();
    let mut health = HealthClient::new(channel.clone());
    for service in [
        "",
        "readiness",
        "liveness",
        "eventmesh.offset.v1.OffsetService",
    ] {
        let status = health
            .check(HealthCheckRequest {
                service: service.into(),
            })
            .await
            .unwrap()
            .into_inner()
            .status;
        assert_eq!(status, ServingStatus::Serving as i32, "{service:?}");
    }
    let unknown = health
        .check(HealthCheckRequest {
            service: "nope".into(),
        })
        .await
        .unwrap_err();
    assert_eq!(unknown.code(), Code::NotFound);

    let mut reflection = ServerReflectionClient::new(channel);
    let request = ServerReflectionRequest {
        host: String::new(),
        message_request: Some(MessageRequest::ListServices(String::new())),
    };
    let mut responses = reflection
        .server_reflection_info(tokio_stream::iter([request]))
        .await
        .unwrap()
        .into_inner();
    let response = responses.message().await.unwrap().unwrap();
    let Some(MessageResponse::ListServicesResponse(list)) = response.message_response else {
        panic!("unexpected reflection answer {response:?}");
    };
    let names: Vec<String> = list.service.into_iter().map(|s| s.name).collect();
    assert!(
        names.contains(&"eventmesh.offset.v1.OffsetService".to_string()),
        "{names:?}"
    );
    assert!(
        names.contains(&"grpc.health.v1.Health".to_string()),
        "{names:?}"
    );
    server.shutdown();
    server.wait().await.unwrap();
}

#[tokio::test]
async fn graceful_shutdown_flushes_and_a_restart_serves_the_data() {
    let dir = tempfile::tempdir().unwrap();
    {
        let (server, mut client) = serve(StoreKind::Rocksdb, dir.path(), false).await;
        let entries = (0..1000)
            .map(|p| entry("t", "c", &p.to_string(), p))
            .collect();
        client
            .write_offsets(WriteOffsetsRequest {
                entries,
                sync: false,
            })
            .await
            .unwrap();
        server.shutdown();
        server.wait().await.unwrap();
        assert!(
            client.list_topics(ListTopicsRequest {}).await.is_err(),
            "a stopped server answers nothing"
        );
    }
    let (server, mut client) = serve(StoreKind::Rocksdb, dir.path(), false).await;
    let entries = client
        .read_topic_offsets(ReadTopicOffsetsRequest {
            topic: "t".into(),
            client_id: "c".into(),
        })
        .await
        .unwrap()
        .into_inner()
        .entries;
    assert_eq!(entries.len(), 1000);
    assert!(
        entries
            .iter()
            .all(|e| e.offset.to_string() == e.key.as_ref().unwrap().partition)
    );
    server.shutdown();
    server.wait().await.unwrap();
}

/// WriteOffsetsStream: batch after batch answered in order, each as a WriteOffsets call
/// would be; a bad batch (or a message without one) ends the stream with INVALID_ARGUMENT
/// naming the field and nothing of it applied; a shutdown ends an open stream UNAVAILABLE at once (the drain does not wait
/// for a writer that keeps its stream open), and what was answered survives the restart.
#[tokio::test]
async fn a_write_stream_answers_batch_after_batch_and_ends_on_bad_input_or_shutdown() {
    let dir = tempfile::tempdir().unwrap();
    let config = Config {
        listen: "127.0.0.1:0".parse().unwrap(),
        data_dir: dir.path().to_owned(),
        store: StoreKind::Rocksdb,
        shutdown_timeout_secs: 600,
        ..Config::default()
    };
    let server = start(config.clone(), CancellationToken::new())
        .await
        .unwrap();
    let mut client = OffsetServiceClient::new(server.channel().await.unwrap());
    let (batches, mut answers) = open_write_stream(&mut client).await;
    let mut highest = 0;
    for offset in [5, 3, 9] {
        batches
            .send(batch(WriteOffsetsRequest {
                entries: vec![
                    entry("t", "c", "0", offset),
                    entry("t", "c", "1", offset + 1),
                ],
                sync: false,
            }))
            .await
            .unwrap();
        let answer = answers.message().await.unwrap().unwrap().answer.unwrap();
        let results: Vec<_> = answer
            .results
            .iter()
            .map(|r| (r.stored, r.advanced))
            .collect();
        let advanced = offset > highest;
        highest = highest.max(offset);
        assert_eq!(results, [(highest, advanced), (highest + 1, advanced)]);
    }
    batches
        .send(batch(WriteOffsetsRequest {
            entries: vec![entry("t", "c", "0", 20), entry("t#x", "c", "0", 1)],
            sync: false,
        }))
        .await
        .unwrap();
    let status = answers.message().await.unwrap_err();
    assert_eq!(status.code(), Code::InvalidArgument, "{status:?}");
    assert!(
        status.message().contains("entries[1].key.topic"),
        "{}",
        status.message()
    );
    assert_eq!(read(&mut client, pkey("t", "c", "0")).await, 9);

    let (batches, mut answers) = open_write_stream(&mut client).await;
    batches
        .send(WriteOffsetsStreamRequest { batch: None })
        .await
        .unwrap();
    let status = answers.message().await.unwrap_err();
    assert_eq!(status.code(), Code::InvalidArgument, "{status:?}");
    assert_eq!(status.message(), "batch: missing");

    let (batches, mut answers) = open_write_stream(&mut client).await;
    batches
        .send(batch(WriteOffsetsRequest {
            entries: vec![entry("t", "c", "0", 11)],
            sync: false,
        }))
        .await
        .unwrap();
    let answer = answers.message().await.unwrap().unwrap().answer.unwrap();
    assert_eq!(answer.results[0].stored, 11);
    server.shutdown();
    let within = std::time::Duration::from_secs(60);
    let status = tokio::time::timeout(within, answers.message())
        .await
        .expect("the open stream is ended by the shutdown")
        .unwrap_err();
    assert_eq!(status.code(), Code::Unavailable, "{status:?}");
    tokio::time::timeout(within, server.wait())
        .await
        .expect("the drain does not wait for the open stream")
        .unwrap();
    drop(batches);

    let server = start(config, CancellationToken::new()).await.unwrap();
    let mut client = OffsetServiceClient::new(server.channel().await.unwrap());
    assert_eq!(read(&mut client, pkey("t", "c", "0")).await, 11);
    assert_eq!(read(&mut client, pkey("t", "c", "1")).await, 10);
    server.shutdown();
    server.wait().await.unwrap();
}

fn batch(batch: WriteOffsetsRequest) -> WriteOffsetsStreamRequest {
    WriteOffsetsStreamRequest { batch: Some(batch) }
}

/// A new WriteOffsetsStream: where its batches go in, and its answers.
async fn open_write_stream(
    client: &mut OffsetServiceClient<Channel>,
) -> (
    tokio::sync::mpsc::Sender<WriteOffsetsStreamRequest>,
    tonic::Streaming<WriteOffsetsStreamResponse>,
) {
    let (batches, queued) = tokio::sync::mpsc::channel(1);
    let answers = client
        .write_offsets_stream(tokio_stream::wrappers::ReceiverStream::new(queued))
        .await
        .unwrap()
        .into_inner();
    (batches, answers)
}

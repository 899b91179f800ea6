//! The HTTP/2 settings every server and internal client advertises, read off the wire: large
//! frames above all, since h2 writes each DATA frame with a syscall of its own and the
//! protocol's default 16 KiB frames cut every batch into pieces.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::Duration;

use eventmesh_common::call_limit::CallLimitLayer;
use eventmesh_common::grpc::{self, HTTP2_MAX_FRAME_SIZE};
use eventmesh_testkit::http2::{self, SETTINGS_MAX_FRAME_SIZE, setting};
use tokio_util::sync::CancellationToken;

#[tokio::test]
async fn servers_advertise_large_frames() {
    let (health, router) = grpc::standard_router(&[], CallLimitLayer::none()).unwrap();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let shutdown = CancellationToken::new();
    let server = tokio::spawn(grpc::serve(
        router,
        listener,
        health,
        "test.Service",
        shutdown.clone(),
        Duration::from_secs(1),
    ));
    let settings = tokio::task::spawn_blocking(move || {
        let mut stream = std::net::TcpStream::connect(addr).unwrap();
        stream
            .set_read_timeout(Some(Duration::from_secs(10)))
            .unwrap();
        http2::server_settings(&mut stream).unwrap()
    })
    .await
    .unwrap();
    assert_eq!(
        setting(&settings, SETTINGS_MAX_FRAME_SIZE),
        Some(HTTP2_MAX_FRAME_SIZE),
        "{settings:?}"
    );
    shutdown.cancel();
    server.await.unwrap().unwrap();
}

#[tokio::test]
async fn internal_clients_advertise_large_frames() {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let uri = format!("http://{}", listener.local_addr().unwrap());
    let accepted = tokio::task::spawn_blocking(move || http2::accept_client_settings(&listener));
    // The handshake starts on connect; nothing answers it, so the connect itself is left.
    let connecting = tokio::spawn(async move {
        grpc::internal_endpoint(&uri, Duration::from_secs(30))
            .unwrap()
            .connect()
            .await
    });
    let settings = accepted.await.unwrap().unwrap();
    connecting.abort();
    assert_eq!(
        setting(&settings, SETTINGS_MAX_FRAME_SIZE),
        Some(HTTP2_MAX_FRAME_SIZE),
        "{settings:?}"
    );
}

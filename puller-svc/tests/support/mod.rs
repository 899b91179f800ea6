//! Shared by puller-svc's integration tests: a real offset-svc next to the puller.

#![allow(dead_code, clippy::unwrap_used)] // each test binary uses a subset

use std::sync::Arc;
use std::time::Duration;

use eventmesh_common::shutdown::CancellationToken;
use eventmesh_proto::puller::puller_service_client::PullerServiceClient;
use offset_svc::config::{Config, StoreKind};
use puller_svc::alignment::WatermarkSource;
use puller_svc::server::RunningServer;
use puller_svc::service::PullerGrpc;
use puller_svc::storage::Storage;
use tonic::transport::Channel;

/// An in-process offset-svc (memory store) on a free loopback port, and a channel to it.
pub async fn memory_offset_svc() -> (offset_svc::server::RunningServer, Channel) {
    let config = Config {
        listen: "127.0.0.1:0".parse().unwrap(),
        store: StoreKind::Memory,
        ..Config::default()
    };
    let server = offset_svc::server::start(config, CancellationToken::new())
        .await
        .unwrap();
    let channel = server.channel().await.unwrap();
    (server, channel)
}

/// A lazy channel to a loopback port nothing listens on (an offset-svc that is down).
pub fn unreachable_channel() -> Channel {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    tonic::transport::Endpoint::from_shared(format!("http://127.0.0.1:{port}"))
        .unwrap()
        .connect_lazy()
}

/// An in-process puller-svc over `storage`, reading watermarks through `offset_svc`, and a
/// client to it.
pub async fn puller_over(
    storage: Arc<dyn Storage>,
    offset_svc: Channel,
) -> (RunningServer, PullerServiceClient<Channel>) {
    let grpc = PullerGrpc::new(Arc::clone(&storage), WatermarkSource::new(offset_svc));
    let server = puller_svc::server::start(
        "127.0.0.1:0".parse().unwrap(),
        storage,
        grpc,
        CancellationToken::new(),
        Duration::from_secs(2),
    )
    .await
    .unwrap();
    let client = PullerServiceClient::connect(format!("http://{}", server.local_addr()))
        .await
        .unwrap();
    (server, client)
}

/// Attaches one reader for `dispatcher` (aligned to its watermark); returns its generation.
pub async fn attach(
    client: &mut PullerServiceClient<Channel>,
    dispatcher: &str,
    reader: eventmesh_proto::puller::GroupTopic,
) -> u64 {
    client
        .attach(eventmesh_proto::puller::AttachRequest {
            dispatcher_id: dispatcher.into(),
            readers: vec![reader],
            positions: Vec::new(),
        })
        .await
        .unwrap()
        .into_inner()
        .generations[0]
        .generation
}

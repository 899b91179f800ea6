//! Shared by puller-svc's integration tests: a real offset-svc next to the puller.

#![allow(dead_code, clippy::unwrap_used)] // each test binary uses a subset

use eventmesh_common::shutdown::CancellationToken;
use offset_svc::config::{Config, StoreKind};
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

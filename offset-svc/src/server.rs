//! Running offset-svc: open the store, serve gRPC (OffsetService, grpc.health.v1, reflection)
//! and shut down in order.
//!
//! Health: the overall service (`""`), `eventmesh.offset.v1.OffsetService`, `readiness` and
//! `liveness`. Readiness is SERVING once the store is open and goes NOT_SERVING as soon as
//! shutdown starts; liveness stays SERVING until the process exits.
//!
//! Shutdown order: readiness off → stop accepting and drain in-flight requests (bounded by
//! `shutdown_timeout_secs`) → flush the store (WAL fsync + memtable flush).

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use eventmesh_common::shutdown::CancellationToken;
use eventmesh_proto::offset::offset_service_server::OffsetServiceServer;
use tokio::net::TcpListener;
use tokio::task::JoinHandle;
use tonic::transport::server::TcpIncoming;
use tonic_health::ServingStatus;

use crate::config::{Config, StoreKind};
use crate::error::Error;
use crate::memory::MemoryOffsetStore;
use crate::rocks::{OpenMode, RocksDbOffsetStore};
use crate::service::OffsetGrpc;
use crate::store::OffsetStore;

/// Largest request or response message, bytes (a full batch of long keys fits).
pub const MAX_MESSAGE_BYTES: usize = 64 * 1024 * 1024;

/// HTTP/2 per-stream flow-control window, bytes.
pub const HTTP2_STREAM_WINDOW: u32 = 4 * 1024 * 1024;
/// HTTP/2 per-connection flow-control window, bytes.
pub const HTTP2_CONNECTION_WINDOW: u32 = 16 * 1024 * 1024;

/// A started offset-svc.
pub struct RunningServer {
    local_addr: SocketAddr,
    shutdown: CancellationToken,
    task: JoinHandle<Result<(), Error>>,
}

impl RunningServer {
    /// The address it listens on (the real port when configured with port 0).
    pub fn local_addr(&self) -> SocketAddr {
        self.local_addr
    }

    /// A client channel to this server over loopback, with the same HTTP/2 windows and
    /// TCP_NODELAY the server uses (for co-located callers and tests).
    pub async fn channel(&self) -> Result<tonic::transport::Channel, Error> {
        tonic::transport::Endpoint::from_shared(format!("http://{}", self.local_addr))
            .map_err(|_| Error::Internal("local address is not a valid URI"))?
            .tcp_nodelay(true)
            .initial_stream_window_size(HTTP2_STREAM_WINDOW)
            .initial_connection_window_size(HTTP2_CONNECTION_WINDOW)
            .connect()
            .await
            .map_err(Error::Serve)
    }

    /// Starts the ordered shutdown.
    pub fn shutdown(&self) {
        self.shutdown.cancel();
    }

    /// Waits until the server has stopped and the store is flushed.
    pub async fn wait(self) -> Result<(), Error> {
        self.task
            .await
            .map_err(|err| Error::Task(err.to_string()))?
    }
}

/// Opens the configured store.
pub async fn open_store(config: &Config) -> Result<Arc<dyn OffsetStore>, Error> {
    match config.store {
        StoreKind::Memory => Ok(Arc::new(MemoryOffsetStore::new())),
        StoreKind::Rocksdb => {
            let path = config.data_dir.clone();
            let mode = if config.read_only {
                OpenMode::ReadOnly
            } else {
                OpenMode::ReadWrite
            };
            let store = tokio::task::spawn_blocking(move || {
                if mode == OpenMode::ReadWrite {
                    std::fs::create_dir_all(&path).map_err(|source| Error::DataDir {
                        path: path.clone(),
                        source,
                    })?;
                }
                RocksDbOffsetStore::open_with(&path, mode)
            })
            .await
            .map_err(|err| Error::Task(err.to_string()))??;
            Ok(Arc::new(store))
        }
    }
}

/// Binds, opens the store and starts serving; shutdown begins when `shutdown` is cancelled.
pub async fn start(config: Config, shutdown: CancellationToken) -> Result<RunningServer, Error> {
    let listener = TcpListener::bind(config.listen)
        .await
        .map_err(|source| Error::Bind {
            addr: config.listen,
            source,
        })?;
    let local_addr = listener.local_addr().map_err(|source| Error::Bind {
        addr: config.listen,
        source,
    })?;
    let store = open_store(&config).await?;
    let (health, health_service) = tonic_health::server::health_reporter();
    let reflection = tonic_reflection::server::Builder::configure()
        .register_encoded_file_descriptor_set(eventmesh_proto::FILE_DESCRIPTOR_SET)
        .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
        .build_v1()
        .map_err(|_| Error::Internal("reflection descriptors do not load"))?;
    let sync_writes = config.sync_writes;
    let grpc =
        OffsetServiceServer::new(OffsetGrpc::new(Arc::clone(&store)).with_forced_sync(sync_writes))
            .max_decoding_message_size(MAX_MESSAGE_BYTES)
            .max_encoding_message_size(MAX_MESSAGE_BYTES);
    for name in ["", "readiness", "liveness"] {
        health
            .set_service_status(name, ServingStatus::Serving)
            .await;
    }
    health
        .set_serving::<OffsetServiceServer<OffsetGrpc>>()
        .await;
    tracing::info!(%local_addr, store = ?config.store, data_dir = %config.data_dir.display(), "offset-svc serving");

    let drain = CancellationToken::new();
    let server = tonic::transport::Server::builder()
        .tcp_nodelay(true)
        // Write batches are tens of kilobytes and several are in flight: the 64 KiB HTTP/2
        // default windows would stall them on flow control.
        .initial_stream_window_size(Some(HTTP2_STREAM_WINDOW))
        .initial_connection_window_size(Some(HTTP2_CONNECTION_WINDOW))
        .http2_keepalive_interval(Some(Duration::from_secs(10)))
        .http2_keepalive_timeout(Some(Duration::from_secs(5)))
        .add_service(health_service)
        .add_service(reflection)
        .add_service(grpc)
        // Our own listener (so port 0 can be reported) does not get the builder's TCP
        // options: set TCP_NODELAY here, or responses wait on Nagle + delayed ACK (~40 ms).
        .serve_with_incoming_shutdown(
            TcpIncoming::from(listener).with_nodelay(Some(true)),
            drain.clone().cancelled_owned(),
        );
    let timeout = Duration::from_secs(config.shutdown_timeout_secs);
    let token = shutdown.clone();
    let task = tokio::spawn(async move {
        let mut server = std::pin::pin!(server);
        tokio::select! {
            result = &mut server => result?,
            () = token.cancelled() => {
                tracing::info!("offset-svc shutting down: readiness off, draining requests");
                for name in ["", "readiness"] {
                    health.set_service_status(name, ServingStatus::NotServing).await;
                }
                health.set_not_serving::<OffsetServiceServer<OffsetGrpc>>().await;
                drain.cancel();
                match tokio::time::timeout(timeout, &mut server).await {
                    Ok(result) => result?,
                    Err(_) => tracing::warn!(?timeout, "requests still in flight at the shutdown timeout; stopping anyway"),
                }
            }
        }
        let flushed = tokio::task::spawn_blocking(move || store.flush())
            .await
            .map_err(|err| Error::Task(err.to_string()))?;
        flushed?;
        tracing::info!("offset-svc stopped; store flushed");
        Ok(())
    });
    Ok(RunningServer {
        local_addr,
        shutdown,
        task,
    })
}

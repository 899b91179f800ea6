//! Running offset-svc: open the store, serve gRPC (OffsetService, grpc.health.v1, reflection)
//! and shut down in order.
//!
//! Health: the overall service (`""`), `eventmesh.offset.v1.OffsetService`, `readiness` and
//! `liveness`. Readiness is SERVING once the store is open and goes NOT_SERVING as soon as
//! shutdown starts; liveness stays SERVING until the process exits.
//!
//! Shutdown order: readiness off → stop accepting and drain in-flight requests (bounded by
//! `shutdown_timeout_secs`) → flush the store (WAL fsync + memtable flush).

use std::sync::Arc;
use std::time::Duration;

use eventmesh_common::call_limit::CallLimitLayer;
use eventmesh_common::grpc;
use eventmesh_common::shutdown::CancellationToken;
use eventmesh_proto::offset::offset_service_server::OffsetServiceServer;
use tokio::net::TcpListener;
use tonic::server::NamedService;

use crate::config::{Config, StoreKind};
use crate::error::Error;
use crate::memory::MemoryOffsetStore;
use crate::rocks::{OpenMode, RocksDbOffsetStore};
use crate::service::OffsetGrpc;
use crate::store::OffsetStore;

/// Largest request or response message, bytes: a full batch of long keys, or a topic's
/// offsets for every client, fits.
pub const MAX_MESSAGE_BYTES: usize = grpc::OFFSETS_MESSAGE_LIMIT;

/// A started offset-svc.
pub type RunningServer = grpc::RunningServer<Error>;

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
    let (health, router) = grpc::standard_router(
        &[eventmesh_proto::FILE_DESCRIPTOR_SET],
        CallLimitLayer::none(),
    )
    .map_err(|_| Error::Internal("reflection descriptors do not load"))?;
    let service = OffsetServiceServer::new(
        OffsetGrpc::new(Arc::clone(&store))
            .with_forced_sync(config.sync_writes)
            .with_shutdown(shutdown.clone()),
    )
    .max_decoding_message_size(MAX_MESSAGE_BYTES)
    .max_encoding_message_size(MAX_MESSAGE_BYTES);
    let router = router.add_service(service);
    tracing::info!(%local_addr, store = ?config.store, data_dir = %config.data_dir.display(), "offset-svc serving");
    let drain_timeout = Duration::from_secs(config.shutdown_timeout_secs);
    let name = <OffsetServiceServer<OffsetGrpc> as NamedService>::NAME;
    grpc::mark_serving(&health, name).await;
    let token = shutdown.clone();
    let task = tokio::spawn(async move {
        grpc::serve(router, listener, health, name, token, drain_timeout).await?;
        let flushed = tokio::task::spawn_blocking(move || store.flush())
            .await
            .map_err(|err| Error::Task(err.to_string()))?;
        flushed?;
        tracing::info!("offset-svc stopped; store flushed");
        Ok(())
    });
    Ok(RunningServer::new(local_addr, shutdown, task))
}

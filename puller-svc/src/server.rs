//! Running the puller's gRPC server: PullerService with health and reflection, served and
//! drained by `eventmesh_common::grpc`, then a final checkpoint of every reader's cursors.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use eventmesh_common::call_limit::CallLimitLayer;
use eventmesh_common::grpc;
use eventmesh_common::shutdown::CancellationToken;
use eventmesh_proto::puller::puller_service_server::PullerServiceServer;
use tokio::net::TcpListener;
use tokio::task::JoinHandle;
use tonic::server::NamedService;

use crate::service::PullerGrpc;
use crate::storage::{Storage, StorageError};

/// Why the server stopped badly.
#[derive(Debug, thiserror::Error)]
pub enum ServerError {
    /// Binding failed.
    #[error("cannot listen on {addr}: {source}")]
    Bind {
        /// The address.
        addr: SocketAddr,
        /// The I/O error.
        source: std::io::Error,
    },
    /// Serving failed.
    #[error("gRPC server failed: {0}")]
    Serve(#[from] tonic::transport::Error),
    /// The final checkpoint failed.
    #[error("final checkpoint failed: {0}")]
    Checkpoint(#[from] StorageError),
    /// A task died.
    #[error("server task failed: {0}")]
    Task(String),
}

/// A started puller server.
pub type RunningServer = grpc::RunningServer<ServerError>;

impl From<tokio::task::JoinError> for ServerError {
    fn from(err: tokio::task::JoinError) -> Self {
        ServerError::Task(err.to_string())
    }
}

/// Checkpoints every reader's cursors every `interval` until `shutdown` (the server itself
/// writes the final checkpoint). A failed checkpoint is logged and retried next time: the
/// cursors stay in memory and alignment covers a crash meanwhile.
pub fn spawn_checkpoints(
    storage: Arc<dyn Storage>,
    interval: Duration,
    shutdown: CancellationToken,
) -> JoinHandle<()> {
    // Exported from the start: an alert on failures (or on the age) needs the series first.
    metrics::counter!("puller_checkpoint_failures_total").increment(0);
    metrics::counter!("puller_pull_errors_total", "backend" => storage.backend()).increment(0);
    every(interval, shutdown, move || {
        let storage = Arc::clone(&storage);
        async move {
            match storage.checkpoint().await {
                // The checkpoint's age is `time() - puller_checkpoint_last_success_timestamp_seconds`.
                Ok(()) => metrics::gauge!("puller_checkpoint_last_success_timestamp_seconds")
                    .set(unix_seconds()),
                Err(err) => {
                    metrics::counter!("puller_checkpoint_failures_total").increment(1);
                    tracing::error!(error = %err, "periodic cursor checkpoint failed; retrying at the next interval");
                }
            }
        }
    })
}

fn unix_seconds() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0.0, |elapsed| elapsed.as_secs_f64())
}

/// Evicts readers no dispatcher used for the idle time, looking every idle/4 (at most once a
/// minute), until `shutdown`.
fn spawn_eviction(grpc_service: PullerGrpc, shutdown: CancellationToken) -> JoinHandle<()> {
    let period =
        (grpc_service.reader_idle() / 4).clamp(Duration::from_millis(100), Duration::from_secs(60));
    every(period, shutdown, move || {
        let grpc_service = grpc_service.clone();
        async move {
            grpc_service.evict_idle().await;
        }
    })
}

/// Runs `work` every `period` (a late run is not made up for) until `shutdown`.
fn every<F, Fut>(period: Duration, shutdown: CancellationToken, work: F) -> JoinHandle<()>
where
    F: Fn() -> Fut + Send + 'static,
    Fut: std::future::Future<Output = ()> + Send,
{
    tokio::spawn(async move {
        let mut ticks = tokio::time::interval(period);
        ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                () = shutdown.cancelled() => return,
                _ = ticks.tick() => work().await,
            }
        }
    })
}

/// Binds `listen` and serves `grpc` over `storage` until `shutdown` is cancelled.
pub async fn start(
    listen: SocketAddr,
    storage: Arc<dyn Storage>,
    grpc_service: PullerGrpc,
    shutdown: CancellationToken,
    drain_timeout: Duration,
) -> Result<RunningServer, ServerError> {
    let bind_error = |source| ServerError::Bind {
        addr: listen,
        source,
    };
    let listener = TcpListener::bind(listen).await.map_err(bind_error)?;
    let local_addr = listener.local_addr().map_err(bind_error)?;
    let (health, router) = grpc::standard_router(
        &[eventmesh_proto::FILE_DESCRIPTOR_SET],
        CallLimitLayer::none(),
    )
    .map_err(|err| ServerError::Task(err.to_string()))?;
    let sweeper = grpc_service.clone();
    let router = router.add_service(
        // The largest request is a publish batch (a single publish carries one frame, a
        // dead-letter envelope at most); a pull answer is bounded by the largest pull this
        // service allows.
        PullerServiceServer::new(grpc_service)
            .max_decoding_message_size(grpc::PUBLISH_BATCH_REQUEST_LIMIT)
            .max_encoding_message_size(grpc::pull_response_limit(
                grpc::MAX_PULL_RECORDS,
                grpc::MAX_PULL_BYTES,
            )),
    );
    let name = <PullerServiceServer<PullerGrpc> as NamedService>::NAME;
    grpc::mark_serving(&health, name).await;
    spawn_eviction(sweeper, shutdown.clone());
    let token = shutdown.clone();
    let backend = storage.backend();
    let task = tokio::spawn(async move {
        grpc::serve(router, listener, health, name, token, drain_timeout).await?;
        storage.checkpoint().await?;
        tracing::info!("puller-svc stopped; cursors checkpointed");
        Ok(())
    });
    tracing::info!(%local_addr, backend, "puller-svc serving");
    Ok(RunningServer::new(local_addr, shutdown, task))
}

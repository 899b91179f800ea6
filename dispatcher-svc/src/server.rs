//! Running an instance: the offset writer, the broker-ACK forwarder, the groups and the
//! client-facing gRPC server with health (readiness follows the offset writer: an instance
//! whose ACKs cannot become durable is not ready) and reflection.
//!
//! Shutdown order (DESIGN §12): readiness off and no new streams; the groups drain — they
//! deliver nothing new and stop pulling, the sessions keep carrying ACKs of what was sent and
//! their DURABLE answers, and each group ends its sessions with the `em-draining` status once
//! all it sent is settled and durable (or the session ends at the `drain_ms` window) — so a
//! client that ACKs within the window moves to another instance with nothing redelivered; the
//! groups stop and flush their watermarks; the writer and forwarder get a moment to finish;
//! with a cluster, the groups' last progress is mirrored and the lease revoked (every home of
//! the instance is free at once). What is still un-ACKed then is pulled again by the next
//! instance.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use eventmesh_common::call_limit::CallLimitLayer;
use eventmesh_common::grpc;
use eventmesh_common::grpc::InternalChannel;
use eventmesh_common::shutdown::CancellationToken;
use eventmesh_proto::client::admin_service_server::AdminServiceServer;
use eventmesh_proto::encoded::server::event_mesh_service_server::EventMeshServiceServer;
use tokio::net::TcpListener;
use tonic::server::NamedService;
use tonic::transport::Endpoint;
use tonic_health::ServingStatus;

use crate::admin::AdminGrpc;
use crate::broker_ack::BrokerAcker;
use crate::cluster::Cluster;
use crate::cluster::meter::Meter;
use crate::config::Config;
use crate::offset_writer::OffsetWriter;
use crate::registry::{Shared, SharedParts};
use crate::service::EventMeshGrpc;

/// Largest client message (an event at the frame limit plus the request around it).
pub const MAX_MESSAGE_BYTES: usize = 17 * 1024 * 1024;
/// How long groups get to flush at shutdown.
const FLUSH_GRACE: Duration = Duration::from_millis(500);

/// Why the server could not start or stopped badly.
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
    /// An endpoint setting is not a URI.
    #[error("invalid {name} endpoint {value:?}: {source}")]
    Endpoint {
        /// Which setting.
        name: &'static str,
        /// Its value.
        value: String,
        /// Why.
        source: tonic::transport::Error,
    },
    /// Serving failed.
    #[error("gRPC server failed: {0}")]
    Serve(#[from] tonic::transport::Error),
    /// The cluster refused this instance (a live instance has its id) or its settings.
    #[error("cluster: {0}")]
    Cluster(#[from] crate::cluster::ClusterError),
    /// A task died or reflection could not be built.
    #[error("server task failed: {0}")]
    Task(String),
}

impl From<tokio::task::JoinError> for ServerError {
    fn from(err: tokio::task::JoinError) -> Self {
        ServerError::Task(err.to_string())
    }
}

/// A started dispatcher.
pub type RunningServer = grpc::RunningServer<ServerError>;

fn lazy_channel(
    name: &'static str,
    value: &str,
    call_timeout: Duration,
) -> Result<InternalChannel, ServerError> {
    Ok(grpc::traced(
        endpoint(name, value, call_timeout)?.connect_lazy(),
    ))
}

/// The co-located service `name` at `value`, not yet connected.
fn endpoint(
    name: &'static str,
    value: &str,
    call_timeout: Duration,
) -> Result<Endpoint, ServerError> {
    grpc::internal_endpoint(value, call_timeout).map_err(|source| ServerError::Endpoint {
        name,
        value: value.to_owned(),
        source,
    })
}

/// Starts an instance per `config`; it serves until `shutdown` is cancelled. Returns the
/// running server and the shared state (for inspection by tests and operators' tooling).
pub async fn start(
    config: Config,
    shutdown: CancellationToken,
) -> Result<(RunningServer, Arc<Shared>), ServerError> {
    let bind_error = |source| ServerError::Bind {
        addr: config.listen,
        source,
    };
    let listener = TcpListener::bind(config.listen).await.map_err(bind_error)?;
    let local_addr = listener.local_addr().map_err(bind_error)?;
    // Lazy: the dispatcher starts while its neighbours are still coming up.
    let call_timeout = Duration::from_millis(config.dependency_timeout_ms);
    let puller = lazy_channel("puller", &config.puller, call_timeout)?;
    let offsets = lazy_channel("offset_svc", &config.offset_svc, call_timeout)?;
    let window = Duration::from_millis(config.delivery.ack_flush_ms);
    let workers = CancellationToken::new();
    let (writer, writer_task) = OffsetWriter::spawn(
        endpoint("offset_svc", &config.offset_svc, call_timeout)?,
        call_timeout,
        window,
        config.delivery.sync_offsets,
        workers.clone(),
    )
    .map_err(|err| ServerError::Task(format!("starting the offset writer: {err}")))?;
    let (broker_acks, acker_task) = BrokerAcker::spawn(puller.clone(), window, workers.clone());
    let instance_id = if config.instance_id.is_empty() {
        format!("dispatcher-{:08x}", rand::random::<u32>())
    } else {
        config.instance_id.clone()
    };
    let advertise = if config.advertise.is_empty() {
        local_addr.to_string()
    } else {
        config.advertise.clone()
    };
    let meter = Arc::new(Meter::default());
    let cluster = if config.cluster.enabled() {
        let cluster = Cluster::connect(
            &config.cluster,
            instance_id.clone(),
            advertise.clone(),
            Arc::clone(&meter),
        )
        .await?;
        // Registered before serving, so a duplicate id fails the start; an unreachable etcd
        // does not: the instance serves publishes and registers in the background (Opens
        // answer UNAVAILABLE until then).
        match cluster.register().await {
            Ok(_) => {}
            Err(error @ crate::cluster::ClusterError::DuplicateInstance { .. }) => {
                return Err(error.into());
            }
            Err(error) => {
                tracing::warn!(%error, "etcd is not reachable; registering in the background")
            }
        }
        Some(cluster)
    } else {
        None
    };
    let shared = Shared::new(SharedParts {
        settings: config.delivery.clone(),
        instance_id: instance_id.clone(),
        puller,
        offsets,
        writer: writer.clone(),
        broker_acks,
        shutdown: shutdown.clone(),
        cluster: cluster.clone(),
        meter,
    });
    if let Some(cluster) = &cluster {
        cluster.spawn(&shared, shutdown.clone());
    }
    crate::lag::spawn(
        Arc::clone(&shared),
        Duration::from_millis(config.lag_interval_ms),
        shutdown.clone(),
    );
    let call_limit = CallLimitLayer::new(
        Duration::from_millis(config.delivery.call_limit_ms),
        "call_limit_ms",
    );
    let (health, router) =
        grpc::standard_router(&[eventmesh_proto::FILE_DESCRIPTOR_SET], call_limit)
            .map_err(|err| ServerError::Task(err.to_string()))?;
    let service = EventMeshGrpc::new(Arc::clone(&shared), advertise.clone(), shutdown.clone());
    let router = router.add_service(
        EventMeshServiceServer::new(service)
            .max_decoding_message_size(MAX_MESSAGE_BYTES)
            .max_encoding_message_size(MAX_MESSAGE_BYTES),
    );
    let router = router.add_service(AdminServiceServer::new(AdminGrpc::new(
        Arc::clone(&shared),
        advertise,
    )));
    let name = <EventMeshServiceServer<EventMeshGrpc> as NamedService>::NAME;
    grpc::mark_serving(&health, name).await;
    // Readiness follows the offset writer.
    {
        let health = health.clone();
        let mut writes = writer.health();
        let shutdown = shutdown.clone();
        tokio::spawn(async move {
            loop {
                tokio::select! {
                    changed = writes.changed() => if changed.is_err() { return },
                    () = shutdown.cancelled() => return,
                }
                let status = if *writes.borrow_and_update() {
                    ServingStatus::Serving
                } else {
                    ServingStatus::NotServing
                };
                health.set_service_status(grpc::READINESS, status).await;
            }
        });
    }
    // A graceful stop starts with the drain: groups deliver nothing new and end their sessions
    // (telling the clients to move) once everything sent is ACKed and durable.
    {
        let shared = Arc::clone(&shared);
        let shutdown = shutdown.clone();
        tokio::spawn(async move {
            shutdown.cancelled().await;
            shared.drain_all();
        });
    }
    let drain = Duration::from_secs(config.shutdown_timeout_secs);
    let token = shutdown.clone();
    let state = Arc::clone(&shared);
    let task = tokio::spawn(async move {
        let served = grpc::serve(router, listener, health, name, token, drain).await;
        state.stop_all();
        let deadline = tokio::time::Instant::now() + FLUSH_GRACE;
        while state.group_count() > 0 && tokio::time::Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        tokio::time::sleep(window + Duration::from_millis(50)).await;
        workers.cancel();
        drop(state);
        drop(writer);
        let _ = tokio::time::timeout(FLUSH_GRACE, writer_task).await;
        let _ = tokio::time::timeout(FLUSH_GRACE, acker_task).await;
        if let Some(cluster) = cluster {
            // The groups' last progress goes to their next homes, then every home is freed.
            if let Err(error) = cluster.mirror().flush(&cluster).await {
                tracing::warn!(%error, "mirroring the groups' last progress failed");
            }
            cluster.leave().await;
        }
        tracing::info!("dispatcher-svc stopped");
        served.map_err(ServerError::from)
    });
    tracing::info!(%local_addr, instance = instance_id, "dispatcher-svc serving");
    Ok((RunningServer::new(local_addr, shutdown, task), shared))
}

//! Serving gRPC the same way in every service.
//!
//! * [`server_builder`]: TCP_NODELAY, HTTP/2 windows sized for batches of tens of kilobytes
//!   with several in flight (the 64 KiB defaults stall them on flow control), keepalive pings
//!   every 10 s with a 5 s timeout, and HTTP/2 limits against flooding peers: at most
//!   [`HTTP2_MAX_CONCURRENT_STREAMS`] streams open per connection (more wait for a free one;
//!   hyper's default is unbounded), header blocks of at most [`HTTP2_MAX_HEADER_LIST_BYTES`]
//!   (a larger one is refused before any handler runs; hyper's default is 16 MiB), and
//!   [`HTTP2_MAX_PENDING_RESETS`] streams reset by the peer before they were served (the
//!   "rapid reset" flood ends the connection). The layers: [`ServerLayers`].
//! * [`standard_router`]: grpc.health.v1 and server reflection (v1) for the given descriptor
//!   sets plus health's own, with the server's [`CallLimitLayer`].
//! * [`mark_serving`]: `""`, `readiness`, `liveness` and the service SERVING — call it before
//!   reporting the server as started.
//! * [`serve`]: serves on a listener the caller bound (so port 0 can be reported) with TCP_NODELAY set on every
//!   accepted socket — without it responses wait on Nagle + delayed ACK, about 40 ms each —
//!   and on shutdown turns readiness (and the service) NOT_SERVING, then drains requests for
//!   at most the drain timeout. Liveness stays SERVING until the process exits.
//! * [`RunningServer`]: what a service's `start` returns — the bound address, the shutdown
//!   trigger, the task that serves and then flushes, and a loopback client channel.
//! * [`internal_channel`]: the channel one service uses to call a co-located one — HTTP/2
//!   keepalive while idle too (a frozen neighbour, e.g. SIGSTOPped, is noticed in about
//!   [`KEEPALIVE_INTERVAL`] + [`KEEPALIVE_TIMEOUT`]) and a deadline on every call.
//! * Message limits ([`pull_response_limit`], [`PUBLISH_REQUEST_LIMIT`],
//!   [`PUBLISH_BATCH_REQUEST_LIMIT`], [`OFFSETS_MESSAGE_LIMIT`]): every internal client and server sizes its limits from the frame
//!   limits and the pull size, never tonic's 4 MiB default.

use std::net::SocketAddr;
use std::time::Duration;

use crate::frame::FrameLimits;
use tokio::net::TcpListener;
use tokio::task::{JoinError, JoinHandle};
use tokio_util::sync::CancellationToken;
use tonic::transport::server::{Router, TcpIncoming};
use tower::layer::util::{Identity, Stack};

use crate::call_limit::CallLimitLayer;
use crate::grpc_metrics::GrpcMetricsLayer;
use crate::trace_context::{TraceContextInjector, TraceContextLayer};
use tonic::service::interceptor::InterceptedService;
use tonic::transport::{Channel, Endpoint, Server};
use tonic_health::ServingStatus;
use tonic_health::server::HealthReporter;

/// HTTP/2 per-stream flow-control window, bytes.
pub const HTTP2_STREAM_WINDOW: u32 = 4 * 1024 * 1024;
/// HTTP/2 per-connection flow-control window, bytes.
pub const HTTP2_CONNECTION_WINDOW: u32 = 16 * 1024 * 1024;
/// Largest HTTP/2 frame a server or internal client accepts, bytes (advertised in SETTINGS,
/// so the peer may send frames this large). The protocol's default of 16 KiB splits a batch
/// of deliveries or a pull response into many DATA frames, and h2 writes each data frame with
/// a syscall of its own: at 1 KiB events that was one write per ~13 events on every link.
pub const HTTP2_MAX_FRAME_SIZE: u32 = 1024 * 1024;
/// Most HTTP/2 streams one peer may have open on one connection.
pub const HTTP2_MAX_CONCURRENT_STREAMS: u32 = 4096;
/// Largest HTTP/2 header block (all metadata of a call) a server accepts, bytes.
pub const HTTP2_MAX_HEADER_LIST_BYTES: u32 = 16 * 1024;
/// Streams a peer may open and reset before they are served, at once, before the connection
/// is ended (CVE-2023-44487, "rapid reset").
pub const HTTP2_MAX_PENDING_RESETS: usize = 20;
/// Health service name Kubernetes readiness probes ask for.
pub const READINESS: &str = "readiness";
/// Health service name Kubernetes liveness probes ask for.
pub const LIVENESS: &str = "liveness";

/// Keepalive ping interval on internal channels.
pub const KEEPALIVE_INTERVAL: Duration = Duration::from_secs(1);
/// How long an internal channel waits for a keepalive answer before it fails its calls.
pub const KEEPALIVE_TIMEOUT: Duration = Duration::from_secs(2);

/// Longest record key a puller hands over (longer keys are dead-lettered with the reason).
pub const MAX_RECORD_KEY_BYTES: usize = 64 * 1024;
/// What one pulled record adds around its frame and key (partition, offset, ack key, reason).
pub const PULLED_RECORD_OVERHEAD: usize = 1024;
/// The largest single record a pull may carry: a stamped frame at the limit (or a body to
/// dead-letter, cut to the envelope's data limit) and its key.
pub const MAX_PULLED_RECORD_BYTES: usize =
    FrameLimits::STAMPED.max_frame_bytes + MAX_RECORD_KEY_BYTES + PULLED_RECORD_OVERHEAD;
/// Most records one pull returns.
pub const MAX_PULL_RECORDS: usize = 10_000;
/// Most body bytes one pull aims for (at least one record always comes back).
pub const MAX_PULL_BYTES: usize = 32 * 1024 * 1024;

/// The largest PullResponse for a pull of at most `max_records` records and `max_bytes`
/// bytes: the bytes, plus one whole record beyond them (a pull returns at least one), plus
/// each record's overhead.
pub fn pull_response_limit(max_records: usize, max_bytes: usize) -> usize {
    max_bytes
        .saturating_add(MAX_PULLED_RECORD_BYTES)
        .saturating_add(max_records.saturating_mul(PULLED_RECORD_OVERHEAD))
}

/// The largest Publish request between services: a dead-letter envelope (any event at the
/// frame limit plus the envelope) with its key and the request around it.
pub const PUBLISH_REQUEST_LIMIT: usize =
    FrameLimits::STAMPED.max_frame_bytes + 128 * 1024 + MAX_RECORD_KEY_BYTES;

/// Most records (events) one publish batch carries.
pub const MAX_PUBLISH_BATCH: usize = 10_000;
/// The largest PublishBatch request between services: a client's batch at the dispatcher's
/// message limit (17 MiB) once each of up to [`MAX_PUBLISH_BATCH`] events got the runtime's
/// stamps and framing (well under 1 KiB each) — under twice the single-record limit.
pub const PUBLISH_BATCH_REQUEST_LIMIT: usize = 2 * PUBLISH_REQUEST_LIMIT;

/// The largest offset-svc message (a topic's offsets for every client, a merged write batch).
/// Writers split batches well below it.
pub const OFFSETS_MESSAGE_LIMIT: usize = 256 * 1024 * 1024;

/// A channel to a co-located service: every call carries the calling span's trace context
/// ([`TraceContextInjector`]).
pub type InternalChannel = InterceptedService<Channel, TraceContextInjector>;

/// A lazily connecting channel to a co-located service at `uri`, with keepalive, a deadline
/// of `call_timeout` on every call and the caller's trace context.
pub fn internal_channel(
    uri: &str,
    call_timeout: Duration,
) -> Result<InternalChannel, tonic::transport::Error> {
    Ok(traced(internal_endpoint(uri, call_timeout)?.connect_lazy()))
}

/// What [`internal_channel`] connects to, not yet connected: a channel's tasks run on the
/// runtime that calls `connect_lazy`, so a component with a runtime of its own connects there.
pub fn internal_endpoint(
    uri: &str,
    call_timeout: Duration,
) -> Result<Endpoint, tonic::transport::Error> {
    Ok(Endpoint::from_shared(uri.to_owned())?
        .tcp_nodelay(true)
        .initial_stream_window_size(HTTP2_STREAM_WINDOW)
        .initial_connection_window_size(HTTP2_CONNECTION_WINDOW)
        .max_frame_size(HTTP2_MAX_FRAME_SIZE)
        .http2_keep_alive_interval(KEEPALIVE_INTERVAL)
        .keep_alive_timeout(KEEPALIVE_TIMEOUT)
        .keep_alive_while_idle(true)
        .connect_timeout(call_timeout)
        .timeout(call_timeout))
}

/// `channel` with the caller's trace context on every call (what [`internal_channel`] makes).
pub fn traced(channel: Channel) -> InternalChannel {
    InterceptedService::new(channel, TraceContextInjector)
}

/// The layers every server runs its services in, outermost first: gRPC metrics
/// ([`GrpcMetricsLayer`]), the caller's trace context ([`TraceContextLayer`]) and the call
/// limit ([`CallLimitLayer`]) — so a call cut at the limit is counted and traced.
pub type ServerLayers =
    Stack<CallLimitLayer, Stack<TraceContextLayer, Stack<GrpcMetricsLayer, Identity>>>;

/// A server builder with the project's transport settings and [`ServerLayers`].
pub fn server_builder(call_limit: CallLimitLayer) -> Server<ServerLayers> {
    Server::builder()
        .tcp_nodelay(true)
        .initial_stream_window_size(Some(HTTP2_STREAM_WINDOW))
        .initial_connection_window_size(Some(HTTP2_CONNECTION_WINDOW))
        .max_frame_size(HTTP2_MAX_FRAME_SIZE)
        .http2_keepalive_interval(Some(Duration::from_secs(10)))
        .http2_keepalive_timeout(Some(Duration::from_secs(5)))
        .max_concurrent_streams(HTTP2_MAX_CONCURRENT_STREAMS)
        .http2_max_header_list_size(HTTP2_MAX_HEADER_LIST_BYTES)
        .http2_max_pending_accept_reset_streams(Some(HTTP2_MAX_PENDING_RESETS))
        .layer(GrpcMetricsLayer)
        .layer(TraceContextLayer)
        .layer(call_limit)
}

/// A reflection descriptor set failed to load.
#[derive(Debug, thiserror::Error)]
#[error("cannot build the reflection service: {0}")]
pub struct ReflectionError(String);

/// A router with health and reflection already added, and the health reporter.
pub fn standard_router(
    descriptor_sets: &[&[u8]],
    call_limit: CallLimitLayer,
) -> Result<(HealthReporter, Router<ServerLayers>), ReflectionError> {
    let (health, health_service) = tonic_health::server::health_reporter();
    let mut reflection = tonic_reflection::server::Builder::configure()
        .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET);
    for set in descriptor_sets {
        reflection = reflection.register_encoded_file_descriptor_set(set);
    }
    let reflection = reflection
        .build_v1()
        .map_err(|err| ReflectionError(err.to_string()))?;
    let router = server_builder(call_limit)
        .add_service(health_service)
        .add_service(reflection);
    Ok((health, router))
}

/// Marks the server and `service_name` (the gRPC service's full name) SERVING.
pub async fn mark_serving(health: &HealthReporter, service_name: &str) {
    for name in ["", READINESS, LIVENESS, service_name] {
        health
            .set_service_status(name, ServingStatus::Serving)
            .await;
    }
}

/// Serves `router` on `listener` until `shutdown` is cancelled, then drains (see the module
/// doc). `service_name` is the gRPC service's full name, as given to [`mark_serving`].
pub async fn serve(
    router: Router<ServerLayers>,
    listener: TcpListener,
    health: HealthReporter,
    service_name: &str,
    shutdown: CancellationToken,
    drain_timeout: Duration,
) -> Result<(), tonic::transport::Error> {
    let drain = CancellationToken::new();
    let server = router.serve_with_incoming_shutdown(
        TcpIncoming::from(listener).with_nodelay(Some(true)),
        drain.clone().cancelled_owned(),
    );
    let mut server = std::pin::pin!(server);
    tokio::select! {
        result = &mut server => result,
        () = shutdown.cancelled() => {
            tracing::info!(service = service_name, "shutting down: readiness off, draining requests");
            for name in ["", READINESS, service_name] {
                health.set_service_status(name, ServingStatus::NotServing).await;
            }
            drain.cancel();
            match tokio::time::timeout(drain_timeout, &mut server).await {
                Ok(result) => result,
                Err(_) => {
                    tracing::warn!(service = service_name, ?drain_timeout, "requests still in flight at the drain timeout; stopping anyway");
                    Ok(())
                }
            }
        }
    }
}

/// A started service: its task serves, then runs the service's own final step (flush,
/// checkpoint) and ends with that result.
pub struct RunningServer<E> {
    local_addr: SocketAddr,
    shutdown: CancellationToken,
    task: JoinHandle<Result<(), E>>,
}

impl<E: From<JoinError>> RunningServer<E> {
    /// Wraps a started service.
    pub fn new(
        local_addr: SocketAddr,
        shutdown: CancellationToken,
        task: JoinHandle<Result<(), E>>,
    ) -> Self {
        RunningServer {
            local_addr,
            shutdown,
            task,
        }
    }

    /// The address it listens on (the real port when configured with port 0).
    pub fn local_addr(&self) -> SocketAddr {
        self.local_addr
    }

    /// A client channel to it over loopback, with the transport settings the server uses
    /// (for co-located callers and tests).
    pub async fn channel(&self) -> Result<Channel, tonic::transport::Error> {
        Endpoint::from(self.local_addr_uri())
            .tcp_nodelay(true)
            .initial_stream_window_size(HTTP2_STREAM_WINDOW)
            .initial_connection_window_size(HTTP2_CONNECTION_WINDOW)
            .max_frame_size(HTTP2_MAX_FRAME_SIZE)
            .connect()
            .await
    }

    fn local_addr_uri(&self) -> tonic::codegen::http::Uri {
        tonic::codegen::http::Uri::builder()
            .scheme("http")
            .authority(self.local_addr.to_string())
            .path_and_query("/")
            .build()
            // A socket address always forms a valid authority.
            .unwrap_or_default()
    }

    /// Starts the ordered shutdown.
    pub fn shutdown(&self) {
        self.shutdown.cancel();
    }

    /// Waits until the service stopped and ran its final step.
    pub async fn wait(self) -> Result<(), E> {
        self.task.await?
    }
}

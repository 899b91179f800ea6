//! Code shared by the EventMesh services.
//!
//! * [`crash`] — named crash points armed by an environment variable, for crash tests.
//! * [`frame`] — the EventMeshFrame codec (the body format in the MQ).
//! * [`dead_letter`] — the envelope of `<topic>_DLQ` records (written by dispatcher-svc, read
//!   by the SDK and `emctl`).
//! * [`keys`] — validated names (`Topic`, `ClientId`, `GroupName`, `PartitionId`) and the
//!   composite keys `OffsetKey` (`topic#client#partition`) and `PullKey` (`topic#partition`).
//! * [`status`] — the one mapping from errors to `tonic::Status`.
//! * [`config`] — config file loading and flag precedence.
//! * [`telemetry`] — tracing and OpenTelemetry initialisation.
//! * [`trace_context`] — W3C trace context between processes and with events; messaging spans.
//! * [`metrics`] — the Prometheus exporter.
//! * [`grpc`] — the gRPC server settings, health, reflection and ordered drain every service uses.
//! * [`call_limit`] — the tower layer that answers a call DEADLINE_EXCEEDED at the server's limit.
//! * [`grpc_metrics`] — the tower layer that counts and times every gRPC call a service serves.
//! * [`shutdown`] — the signal-driven cancellation token.
//! * [`alloc`] — the services' global allocator (counting, with feature `count-allocations`).
//! * [`probe`] — latency probes of an ACK's stages (feature `latency-probes`, benchmarks only).
//! * [`runtime`] — the services' tokio runtime, with its configured worker threads.
//!
//! Code lands here only when two services really share it.

pub mod alloc;
pub mod call_limit;
pub mod config;
pub mod crash;
pub mod dead_letter;
pub mod frame;
pub mod grpc;
pub mod grpc_metrics;
pub mod keys;
pub mod metrics;
pub mod probe;
pub mod runtime;
pub mod shutdown;
pub mod status;
pub mod telemetry;
pub mod trace_context;

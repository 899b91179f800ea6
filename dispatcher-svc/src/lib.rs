//! dispatcher-svc — not built yet (issue "dispatcher-svc: subscriptions, reliable push
//! delivery over gRPC streaming, the ACK chain and the gap-free watermark").
//!
//! It will serve the client-facing `eventmesh.v1.EventMeshService` (Recommend, Publish,
//! Subscribe), track every delivery until ACK (timeout, NACK backoff, attempts, `<topic>_DLQ`),
//! write ACK progress and the gap-free watermarks to offset-svc, and only then forward broker
//! ACKs to puller-svc; it registers in etcd for session recommendation.

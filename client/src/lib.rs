//! The EventMesh Rust SDK.
//!
//! Publish events and consume them at least once with per-event ACKs:
//!
//! ```no_run
//! use std::time::Duration;
//! use eventmesh_client::{Client, ClientConfig, Event, SubscribeOptions};
//!
//! # async fn run() -> Result<(), eventmesh_client::ClientError> {
//! let client = Client::connect(ClientConfig::new("billing-1").endpoint("http://127.0.0.1:50051")).await?;
//!
//! let stored = client
//!     .publish_with_key("orders", "customer-42", Event {
//!         source: "/shop".into(),
//!         r#type: "order.created".into(),
//!         data: b"{\"order\":1}".to_vec().into(),
//!         ..Event::default()
//!     })
//!     .await?;
//! println!("stored at {}:{} as {}", stored.partition, stored.offset, stored.event_id);
//!
//! let mut subscription = client.subscribe(SubscribeOptions::new("orders").group("billing")).await?;
//! while let Some(delivery) = subscription.next().await {
//!     let delivery = delivery?;
//!     // ... do the work, idempotently by delivery.event.id ...
//!     if delivery.event.data.is_empty() {
//!         delivery.nack(Duration::from_secs(5)); // try again later
//!     } else {
//!         delivery.ack();
//!     }
//! }
//! # Ok(()) }
//! ```
//!
//! A complete program is `client/examples/quickstart.rs` (`cargo run -p eventmesh-client
//! --example quickstart` against `emctl up`).
//!
//! Contract: every [`Delivery`] must be ACKed; what is not (ACK timeout, NACK, broken session,
//! instance death) comes back, with the same event id, until it is ACKed or dead-lettered to
//! `<topic>_DLQ`. An ACK is answered DURABLE once the offset is stored, PENDING while the store
//! is unavailable (no redelivery follows; DURABLE comes later). The SDK reconnects a broken
//! session with backoff and fails over between the seed endpoints; HTTP/2 keepalive (1 s
//! interval, 2 s timeout) detects a frozen instance, not only a closed socket. Publishes with an
//! empty event id get one from the SDK before the first try, so a retry after a lost answer
//! carries the same id.
//!
//! With the `otel` feature the SDK makes its own `publish`, `create`, `receive` and `ack`/`nack`
//! spans (OpenTelemetry messaging conventions) and carries the trace context on its calls and
//! events; [`Delivery::traceparent`] is there either way. See docs/TRACING.md.
//!
//! The crate also runs a local instance (three service processes) for development and tests
//! ([`local`]) and holds the `emctl` command-line tool. It depends on the proto crate and the
//! gRPC stack only: no RocksDB, rdkafka or etcd in a user's build.

mod client;
mod config;
mod error;
mod handoff;
pub mod local;
mod otel;
mod publisher;
mod subscription;

pub use client::{Client, Published, new_event_id};
pub use config::{ClientConfig, DEFAULT_ENDPOINT, HTTP2_MAX_FRAME_SIZE};
pub use error::ClientError;
pub use eventmesh_proto::client::Event;
pub use publisher::{PendingPublish, Publisher, PublisherOptions, PublisherStats};

/// The largest event payload (`Event::data`) a Publish accepts: 8 MiB.
pub const MAX_EVENT_DATA_BYTES: usize = 8 * 1024 * 1024;

/// A size mix for test and demo traffic: mostly `typical` bytes, every 10th event 4 KiB, every
/// 100th 64 KiB, and every 5,000th at [`MAX_EVENT_DATA_BYTES`] — so the whole path (pull sizes,
/// message limits, budgets) carries events up to the limit, not only small ones.
pub fn mixed_event_size(n: u64, typical: usize) -> usize {
    match (n % 5_000, n % 100, n % 10) {
        (4_999, _, _) => MAX_EVENT_DATA_BYTES,
        (_, 37, _) => 64 * 1024,
        (_, _, 3) => 4 * 1024,
        _ => typical,
    }
}
pub use subscription::{
    AckOutcome, AckResult, Delivery, SessionInfo, StartPosition, SubscribeOptions, Subscription,
    SubscriptionMode, SubscriptionStats,
};

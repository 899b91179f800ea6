//! The protobuf contracts of the EventMesh offset runtime and their generated code.
//!
//! This crate alone runs codegen. Packages are versioned (`eventmesh.v1`,
//! `eventmesh.offset.v1`, `eventmesh.puller.v1`): later changes add fields and RPCs, never
//! renumber or repurpose them. `bytes` fields are generated as [`bytes::Bytes`]-compatible
//! `prost::bytes::Bytes` so payloads move between services without copies.

#![allow(clippy::all, missing_docs)]

/// The client-facing API served by dispatcher-svc.
pub mod eventmesh {
    pub mod v1 {
        tonic::include_proto!("eventmesh.v1");
    }
    /// The offset store API served by offset-svc.
    pub mod offset {
        pub mod v1 {
            tonic::include_proto!("eventmesh.offset.v1");
        }
    }
    /// The MQ reader API served by puller-svc.
    pub mod puller {
        pub mod v1 {
            tonic::include_proto!("eventmesh.puller.v1");
        }
    }
}

pub mod encoded;

pub use eventmesh::offset::v1 as offset;
pub use eventmesh::puller::v1 as puller;
pub use eventmesh::v1 as client;

/// The trailer metadata key of a Subscribe stream that dispatcher-svc ends because it is
/// draining for a graceful stop (status UNAVAILABLE), sent once every delivery of the session
/// is ACKed and durable: the client reconnects elsewhere at once and nothing is redelivered.
/// A client that does not know the key sees an ordinary UNAVAILABLE and reconnects anyway.
pub const DRAINING_METADATA: &str = "em-draining";

/// The encoded `FileDescriptorSet` of every package, for gRPC server reflection.
pub const FILE_DESCRIPTOR_SET: &[u8] = tonic::include_file_descriptor_set!("eventmesh_descriptor");

/// One message of a Subscribe response stream with batches taken apart: what a client acts on.
#[derive(Debug, Clone, PartialEq)]
pub enum SubscribeItem {
    /// The answer to Open.
    Opened(client::Opened),
    /// An event to process and ACK.
    Delivery(client::Delivery),
    /// The outcome of an Ack, Nack or Extend.
    AckResult(client::AckResult),
}

impl client::SubscribeResponse {
    /// The items this message carries, in the order to act on them: a batch's deliveries, then
    /// its results (a result never settles a delivery of the same batch). Empty for a message
    /// without a kind.
    pub fn into_items(self) -> Vec<SubscribeItem> {
        use client::subscribe_response::Kind;
        match self.kind {
            None => Vec::new(),
            Some(Kind::Opened(opened)) => vec![SubscribeItem::Opened(opened)],
            Some(Kind::Delivery(delivery)) => vec![SubscribeItem::Delivery(delivery)],
            Some(Kind::AckResult(result)) => vec![SubscribeItem::AckResult(result)],
            Some(Kind::Batch(batch)) => batch
                .deliveries
                .into_iter()
                .map(SubscribeItem::Delivery)
                .chain(batch.ack_results.into_iter().map(SubscribeItem::AckResult))
                .collect(),
        }
    }
}

/// The event attribute carrying its W3C trace context (the CloudEvents distributed-tracing
/// extension).
pub const TRACEPARENT_ATTRIBUTE: &str = "traceparent";

impl client::Event {
    /// Gives the event the trace context `traceparent` unless it carries one already (as a
    /// text or a binary attribute): a producer's context is never rewritten.
    pub fn carry_traceparent(&mut self, traceparent: &str) {
        if self.binary_attributes.contains_key(TRACEPARENT_ATTRIBUTE) {
            return;
        }
        self.attributes
            .entry(TRACEPARENT_ATTRIBUTE.to_owned())
            .or_insert_with(|| traceparent.to_owned());
    }
}

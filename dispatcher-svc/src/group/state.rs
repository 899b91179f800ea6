//! The record a group keeps per delivery.

use std::time::{Duration, Instant};

use bytes::Bytes;
use eventmesh_common::dead_letter::DeadLetter;
use eventmesh_common::keys::{ClientId, PartitionId, Topic};
use eventmesh_proto::client as pb;
use eventmesh_proto::puller::PulledRecord;

use crate::budget::Charge;
use crate::registry::GroupKey;

/// Where a delivery is in its life (see the module doc of `group`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DeliveryState {
    /// Waiting for a session with capacity.
    Ready,
    /// Handed to a session; not yet written to its stream (the ACK clock has not started).
    Assigned {
        /// The session.
        session: u64,
    },
    /// Written to a session's stream; the ACK clock runs.
    Sent {
        /// The session.
        session: u64,
    },
    /// Waiting out a NACK delay or backoff before the next attempt.
    Backoff,
    /// ACKed (or dead-lettered); its offset write is not durable yet.
    Writing,
    /// Its offset write is durable, but the partition's stored watermark is still below it
    /// (an earlier offset is unsettled): a crash now would bring it back, so it is not
    /// answered DURABLE yet.
    Covering,
    /// Being written to the dead-letter topic.
    DeadLettering,
}

impl DeliveryState {
    /// The session holding it, if any.
    pub fn session(&self) -> Option<u64> {
        match self {
            DeliveryState::Assigned { session } | DeliveryState::Sent { session } => Some(*session),
            _ => None,
        }
    }
}

/// One tracked delivery.
#[derive(Debug)]
pub struct Delivery {
    /// Its id, as clients see it.
    pub id: String,
    /// The MQ partition.
    pub partition: PartitionId,
    /// The MQ offset.
    pub offset: i64,
    /// The decoded event; `None` when it cannot be delivered (dead-lettered at once).
    pub event: Option<pb::Event>,
    /// The body as pulled, for the dead-letter copy.
    pub body: Bytes,
    /// The broker ACK key, empty when none is needed.
    pub ack_key: String,
    /// The record's ordering key in the MQ.
    pub key: Bytes,
    /// The current (or next) attempt, from 1.
    pub attempt: u32,
    /// Where it is.
    pub state: DeliveryState,
    /// Every client it was sent to (any of them may settle it).
    pub clients: Vec<ClientId>,
    /// Budget it holds.
    pub charge: Charge,
    /// Sessions waiting for its ACK's outcome.
    pub waiters: Vec<tokio::sync::mpsc::UnboundedSender<super::Outbound>>,
    /// The pending timer (ACK deadline or backoff end).
    pub timer: Option<Instant>,
    /// An extension asked for before the ACK clock started.
    pub extension: Option<Duration>,
}

impl Delivery {
    /// A new, ready delivery of a pulled record.
    pub fn new(
        id: String,
        partition: PartitionId,
        event: Option<pb::Event>,
        record: PulledRecord,
        charge: Charge,
    ) -> Self {
        Delivery {
            id,
            partition,
            offset: record.offset,
            event,
            body: record.frame,
            ack_key: record.ack_key,
            key: record.key,
            attempt: 1,
            state: DeliveryState::Ready,
            clients: Vec::new(),
            charge,
            waiters: Vec::new(),
            timer: None,
            extension: None,
        }
    }

    /// The message for the client (the deadline is stamped when written).
    pub fn message(&self, topic: &Topic) -> pb::Delivery {
        pb::Delivery {
            delivery_id: self.id.clone(),
            attempt: self.attempt,
            topic: topic.to_string(),
            partition: self.partition.to_string(),
            offset: self.offset,
            event: self.event.clone(),
            ack_deadline_unix_ms: 0,
            key: self.key.clone(),
        }
    }

    /// Remembers that `client` received it.
    pub fn note_client(&mut self, client: &ClientId) {
        if !self.clients.contains(client) {
            self.clients.push(client.clone());
        }
    }

    /// Whether it was ever sent to `client`.
    pub fn was_sent_to(&self, client: &ClientId) -> bool {
        self.clients.contains(client)
    }

    /// Its dead-letter envelope.
    pub fn dead_letter(&self, group: &GroupKey, reason: String) -> DeadLetter {
        // An undecodable event was never delivered.
        let attempts = if self.event.is_none() {
            0
        } else {
            self.attempt
        };
        DeadLetter {
            reason,
            attempts,
            group: group
                .group
                .as_ref()
                .map(ToString::to_string)
                .unwrap_or_default(),
            topic: group.topic.to_string(),
            partition: self.partition.to_string(),
            offset: self.offset,
            original: self.body.clone(),
        }
    }
}

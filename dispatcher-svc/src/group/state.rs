//! The record a group keeps per delivery.

use std::time::{Duration, Instant};

use bytes::Bytes;
use eventmesh_common::dead_letter::DeadLetter;
use eventmesh_common::keys::{ClientId, PartitionId};
use eventmesh_common::trace_context::{EventTrace, Operation};
use eventmesh_proto::puller::PulledRecord;
use smallvec::SmallVec;

use crate::budget::Charge;
use crate::delivery_id::DeliveryId;
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

/// A delivery on its way to a session, not yet a message: the session's stream writes its
/// message straight from the frame ([`crate::wire`]), so that per-delivery work runs on the
/// sessions' tasks, spread over the cores, instead of on the group's one actor.
#[derive(Debug, Clone)]
pub struct Sending {
    /// Its id.
    pub id: DeliveryId,
    /// This attempt.
    pub attempt: u32,
    /// The MQ partition (the topic is the session's: its stream writes it).
    pub partition: PartitionId,
    /// The MQ offset.
    pub offset: i64,
    /// Whether `body` decodes (checked at intake).
    pub decodable: bool,
    /// The body as pulled.
    pub body: Bytes,
    /// The record's ordering key.
    pub key: Bytes,
}

impl Sending {
    /// The message for the client (the deadline is stamped when written), built field by
    /// field: what [`crate::wire`]'s bytes must decode to.
    #[cfg(test)]
    pub fn into_message(
        self,
        topic: &eventmesh_common::keys::Topic,
    ) -> eventmesh_proto::client::Delivery {
        let event = if self.decodable {
            crate::event::decode_for_delivery(&self.body).ok()
        } else {
            None
        };
        eventmesh_proto::client::Delivery {
            delivery_id: self.id.to_text(),
            attempt: self.attempt,
            topic: topic.to_string(),
            partition: self.partition.to_string(),
            offset: self.offset,
            event,
            ack_deadline_unix_ms: 0,
            key: self.key,
        }
    }
}

/// One tracked delivery.
#[derive(Debug)]
pub struct Delivery {
    /// Its id (made text only when sent: clients answer with it, and an ACK's waiter keeps
    /// the client's copy).
    pub id: DeliveryId,
    /// The MQ partition.
    pub partition: PartitionId,
    /// The MQ offset.
    pub offset: i64,
    /// Whether the body decodes (checked at intake; an undecodable one is dead-lettered at
    /// once, never sent). The event is decoded from `body` for each send: a waiting delivery
    /// holds no decoded copy, and the tracked record stays small (it moves in and out of the
    /// group's map).
    decodable: bool,
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
    /// Every client it was sent to (any of them may settle it); nearly always one, kept
    /// inline.
    pub clients: SmallVec<[ClientId; 1]>,
    /// Budget it holds.
    pub charge: Charge,
    /// Sessions waiting for its ACK's outcome.
    pub waiters: SmallVec<[tokio::sync::mpsc::UnboundedSender<super::Outbound>; 1]>,
    /// The pending timer (ACK deadline or backoff end).
    pub timer: Option<Instant>,
    /// An extension asked for before the ACK clock started.
    pub extension: Option<Duration>,
    /// When it was pulled: the age of the oldest un-ACKed delivery counts from here.
    pub pulled_at: Instant,
    /// When a client ACKed it: its ACK → DURABLE latency counts from here.
    pub acked_at: Option<Instant>,
    /// The event's sampled trace context, when it has one and spans are exported: its hops
    /// here (deliver, ack, offset write, broker ACK) are recorded against it.
    pub trace: Option<Box<EventTrace>>,
}

impl Delivery {
    /// A new, ready delivery of a pulled record.
    pub fn new(
        id: DeliveryId,
        partition: PartitionId,
        decodable: bool,
        record: PulledRecord,
        charge: Charge,
        pulled_at: Instant,
    ) -> Self {
        Delivery {
            trace: EventTrace::parse(&record.traceparent),
            id,
            partition,
            offset: record.offset,
            decodable,
            body: record.frame,
            ack_key: record.ack_key,
            key: record.key,
            attempt: 1,
            state: DeliveryState::Ready,
            clients: SmallVec::new(),
            charge,
            waiters: SmallVec::new(),
            timer: None,
            extension: None,
            pulled_at,
            acked_at: None,
        }
    }

    /// What its message for the client is made of, for the session's stream to build
    /// ([`crate::wire`]): the group's actor only counts references here.
    pub fn sending(&self) -> Sending {
        Sending {
            id: self.id,
            attempt: self.attempt,
            partition: self.partition.clone(),
            offset: self.offset,
            decodable: self.decodable,
            body: self.body.clone(),
            key: self.key.clone(),
        }
    }

    /// Records one hop of a traced delivery (`deliver` when sent to `client`, `ack` when it
    /// ACKed) as a span, child of the event's context; nothing for an untraced one.
    pub fn record_hop(&self, operation: Operation, group: &GroupKey, client: &ClientId) {
        let Some(trace) = &self.trace else {
            return;
        };
        let span = trace.span(operation, group.topic.as_str());
        span.record("messaging.consumer.group.name", group.label().as_str());
        span.record("messaging.client.id", client.as_str());
        span.record(
            "messaging.destination.partition.id",
            self.partition.as_str(),
        );
        span.record("eventmesh.offset", self.offset);
        span.record("eventmesh.delivery.attempt", self.attempt);
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
        let attempts = if self.decodable { self.attempt } else { 0 };
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

#[cfg(test)]
impl Delivery {
    /// A ready delivery numbered `seq`, of offset `seq` in partition 0 (for tests).
    pub fn numbered(seq: u64) -> Self {
        let id = DeliveryId {
            epoch: 1,
            group: 1,
            seq,
        };
        let record = PulledRecord {
            offset: seq as i64,
            ..PulledRecord::default()
        };
        let partition = PartitionId::number(0);
        Delivery::new(
            id,
            partition,
            true,
            record,
            Charge::default(),
            Instant::now(),
        )
    }
}

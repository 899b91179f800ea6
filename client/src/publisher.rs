//! A pipelined, batching publisher for one topic.
//!
//! [`Publisher::submit`] queues an event and returns a [`PendingPublish`] that resolves to its
//! own answer once the event is stored, so a caller keeps thousands in flight without a task
//! per event. A background task takes what is queued — as much as is ready, never waiting for
//! more, so a lone event goes out at once — into batches of at most
//! [`PublisherOptions::max_batch_events`] events and [`PublisherOptions::max_batch_bytes`]
//! bytes, with at most [`PublisherOptions::max_in_flight_batches`] batches in flight
//! ([`Client::publish_batch`], with its per-event retry rule: every event keeps its id).
//!
//! Memory is bounded: queued and in-flight events hold at most
//! `max_batch_events × max_in_flight_batches` events and `max_batch_bytes ×
//! max_in_flight_batches` encoded bytes (an event larger than that alone takes all of it);
//! `submit` waits for room. Order: events of one batch keep their order per key;
//! batches in flight concurrently may overtake each other, so events that must stay in order
//! either go through a publisher with `max_in_flight_batches = 1` or wait for each other's
//! answers.
//!
//! Dropping every clone of the [`Publisher`] stops taking events; what was queued is still sent
//! and answered.

use std::sync::Arc;

use eventmesh_proto::client as pb;
use prost::Message;
use tokio::sync::{OwnedSemaphorePermit, Semaphore, mpsc, oneshot};

use crate::client::{Client, MAX_MESSAGE, Published, new_event_id};
use crate::error::ClientError;
use crate::otel;

/// How a [`Publisher`] batches.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PublisherOptions {
    /// Most events in one batch (at most 10,000, the server's limit).
    pub max_batch_events: usize,
    /// Most encoded event bytes in one batch (an event larger than this goes alone). At most
    /// 8 MiB, leaving room under the SDK's 9 MiB message limit for ids and framing.
    pub max_batch_bytes: usize,
    /// Most batches waiting for their answers at once.
    pub max_in_flight_batches: usize,
}

impl Default for PublisherOptions {
    fn default() -> Self {
        PublisherOptions {
            max_batch_events: 512,
            max_batch_bytes: 1024 * 1024,
            max_in_flight_batches: 8,
        }
    }
}

/// The server's limit on events per batch.
const MAX_BATCH_EVENTS: usize = 10_000;
/// Largest `max_batch_bytes`: the SDK's message limit less room for what is added to each
/// event after it is measured (a generated id, per-entry framing: ~50 bytes × 10,000).
const MAX_BATCH_BYTES: usize = MAX_MESSAGE - 1024 * 1024;

/// Publishes to one topic in pipelined batches. Cheap to clone; clones share the queue.
#[derive(Debug, Clone)]
pub struct Publisher {
    queue: mpsc::Sender<Queued>,
    /// Encoded bytes queued or in flight may not exceed its permits.
    room: Arc<Semaphore>,
    room_bytes: usize,
    topic: Arc<str>,
}

/// One event waiting for its batch.
#[derive(Debug)]
struct Queued {
    key: String,
    event: pb::Event,
    answer: oneshot::Sender<Result<Published, ClientError>>,
    /// Its share of the byte budget, returned once it is answered.
    room: OwnedSemaphorePermit,
}

/// The answer to one submitted event; resolves once it is stored (or refused).
#[derive(Debug)]
pub struct PendingPublish {
    answer: oneshot::Receiver<Result<Published, ClientError>>,
}

impl PendingPublish {
    /// Waits for the event's answer.
    pub async fn wait(self) -> Result<Published, ClientError> {
        // The sender is dropped unanswered only if the batching task is gone (runtime shut
        // down): nothing says the event was stored.
        self.answer.await.unwrap_or(Err(ClientError::Closed))
    }
}

impl Publisher {
    /// A publisher for `topic` over `client`; its batching task runs on the current Tokio
    /// runtime.
    pub fn new(client: Client, topic: impl Into<String>, options: PublisherOptions) -> Publisher {
        let options = PublisherOptions {
            max_batch_events: options.max_batch_events.clamp(1, MAX_BATCH_EVENTS),
            max_batch_bytes: options.max_batch_bytes.clamp(1, MAX_BATCH_BYTES),
            max_in_flight_batches: options.max_in_flight_batches.max(1),
        };
        let (queue, queued) =
            mpsc::channel(options.max_batch_events * options.max_in_flight_batches);
        let topic: Arc<str> = topic.into().into();
        tokio::spawn(run_batches(client, topic.to_string(), options, queued));
        let room_bytes = options.max_batch_bytes * options.max_in_flight_batches;
        Publisher {
            queue,
            room: Arc::new(Semaphore::new(room_bytes)),
            room_bytes,
            topic,
        }
    }

    /// Queues `event` (with an ordering key; empty lets the backend spread) and returns its
    /// pending answer; waits while the queue is full.
    pub async fn submit(
        &self,
        key: &str,
        mut event: pb::Event,
    ) -> Result<PendingPublish, ClientError> {
        if event.id.is_empty() {
            event.id = new_event_id();
        }
        // The event's own creation context, taken now: the batch is sent from another task.
        otel::stamp(&otel::create_span(&self.topic, &event), [&mut event]);
        let (answer, pending) = oneshot::channel();
        let size = (event.encoded_len() + key.len()).clamp(1, self.room_bytes);
        let room = Arc::clone(&self.room)
            .acquire_many_owned(u32::try_from(size).unwrap_or(u32::MAX))
            .await
            .map_err(|_| ClientError::Closed)?;
        self.queue
            .send(Queued {
                key: key.to_owned(),
                event,
                answer,
                room,
            })
            .await
            .map_err(|_| ClientError::Closed)?;
        Ok(PendingPublish { answer: pending })
    }

    /// Publishes `event` and waits for its answer.
    pub async fn publish(&self, key: &str, event: pb::Event) -> Result<Published, ClientError> {
        self.submit(key, event).await?.wait().await
    }
}

/// The publisher's task: forms batches from what is queued and sends them, at most
/// `max_in_flight_batches` at once, until every sender is gone and the queue is empty.
async fn run_batches(
    client: Client,
    topic: String,
    options: PublisherOptions,
    mut queued: mpsc::Receiver<Queued>,
) {
    let in_flight = Arc::new(Semaphore::new(options.max_in_flight_batches));
    // An event taken from the queue that did not fit the previous batch.
    let mut carried: Option<Queued> = None;
    loop {
        let Ok(permit) = Arc::clone(&in_flight).acquire_owned().await else {
            return;
        };
        let first = match carried.take() {
            Some(event) => event,
            None => match queued.recv().await {
                Some(event) => event,
                None => return,
            },
        };
        let mut bytes = first.event.encoded_len() + first.key.len();
        let mut batch = vec![first];
        while batch.len() < options.max_batch_events {
            let Ok(next) = queued.try_recv() else {
                break;
            };
            let size = next.event.encoded_len() + next.key.len();
            if bytes + size > options.max_batch_bytes {
                carried = Some(next);
                break;
            }
            bytes += size;
            batch.push(next);
        }
        let client = client.clone();
        let topic = topic.clone();
        tokio::spawn(async move {
            send_batch(&client, &topic, batch).await;
            drop(permit);
        });
    }
}

/// Sends one batch and hands each event its answer.
async fn send_batch(client: &Client, topic: &str, batch: Vec<Queued>) {
    let mut events = Vec::with_capacity(batch.len());
    let mut answers = Vec::with_capacity(batch.len());
    // The events' byte budget goes back only once they are answered.
    let mut room = Vec::with_capacity(batch.len());
    for queued in batch {
        events.push((queued.key, queued.event));
        answers.push(queued.answer);
        room.push(queued.room);
    }
    match client.publish_batch(topic, events).await {
        Ok(results) => {
            for (answer, result) in answers.into_iter().zip(results) {
                // A caller that stopped waiting does not need the answer.
                let _ = answer.send(result);
            }
        }
        Err(error) => {
            for answer in answers {
                let _ = answer.send(Err(error.for_each_event()));
            }
        }
    }
    drop(room);
}

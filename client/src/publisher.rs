//! A pipelined, batching publisher for one topic.
//!
//! [`Publisher::submit`] queues an event and returns a [`PendingPublish`] that resolves to its
//! own answer once the event is stored, so a caller keeps thousands in flight without a task
//! per event. A background task takes what is queued into batches of at most
//! [`PublisherOptions::max_batch_events`] events and [`PublisherOptions::max_batch_bytes`]
//! bytes, with at most [`PublisherOptions::max_in_flight_batches`] batches in flight
//! ([`Client::publish_batch`], with its per-event retry rule: every event keeps its id).
//!
//! When a batch goes: with no batch in flight, at once with what is queued (a lone event is
//! never held back). While others are in flight, a batch that is not full waits for more events
//! until it is full, one of those batches is answered, or [`PublisherOptions::max_linger`]
//! passed. A call costs the server about the same whatever its size, so a steady stream of
//! events goes out as a few large batches, one per answer, rather than as
//! `max_in_flight_batches` small ones; a burst that fills batches still gets all of them in
//! flight. [`Publisher::stats`] counts the batches sent.
//!
//! Memory is bounded: queued, forming and in-flight events hold at most `max_batch_bytes ×
//! max_in_flight_batches` encoded bytes (an event larger than that alone takes all of it;
//! `submit` waits for room), and at most `max_batch_events × (2 × max_in_flight_batches + 1)`
//! events (the queue, the batch being formed, the batches in flight).
//!
//! Order: events of one batch keep their order per key; batches in flight concurrently may
//! overtake each other, so events that must stay in order either go through a publisher with
//! `max_in_flight_batches = 1` or wait for each other's answers.
//!
//! Dropping every clone of the [`Publisher`] stops taking events; what was queued is still sent
//! and answered.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use eventmesh_proto::client as pb;
use prost::Message;
use tokio::sync::{Notify, OwnedSemaphorePermit, Semaphore, mpsc, oneshot};

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
    /// Longest a batch that is not full waits for more events while others are in flight (it
    /// goes sooner when one of them is answered). Bounds what gathering adds to a publish's
    /// latency when calls are slow, retries of transiently failed events included.
    pub max_linger: Duration,
}

impl Default for PublisherOptions {
    fn default() -> Self {
        PublisherOptions {
            max_batch_events: 512,
            max_batch_bytes: 1024 * 1024,
            max_in_flight_batches: 8,
            max_linger: Duration::from_millis(5),
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
    sent: Arc<Sent>,
}

/// What a [`Publisher`] has sent so far (its clones' events included). The two counts are
/// read one after the other: while batches are being sent they may be a batch apart.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PublisherStats {
    /// `PublishBatch` calls made (a retry of a failed call is not counted again).
    pub batches: u64,
    /// Events in those calls.
    pub events: u64,
}

/// The counters behind [`PublisherStats`].
#[derive(Debug, Default)]
struct Sent {
    batches: AtomicU64,
    events: AtomicU64,
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
            max_linger: options.max_linger,
        };
        let (queue, queued) =
            mpsc::channel(options.max_batch_events * options.max_in_flight_batches);
        let topic: Arc<str> = topic.into().into();
        let sent = Arc::new(Sent::default());
        tokio::spawn(run_batches(
            client,
            topic.to_string(),
            options,
            queued,
            Arc::clone(&sent),
        ));
        let room_bytes = options.max_batch_bytes * options.max_in_flight_batches;
        Publisher {
            queue,
            room: Arc::new(Semaphore::new(room_bytes)),
            room_bytes,
            topic,
            sent,
        }
    }

    /// The batches and events sent so far.
    pub fn stats(&self) -> PublisherStats {
        PublisherStats {
            batches: self.sent.batches.load(Ordering::Relaxed),
            events: self.sent.events.load(Ordering::Relaxed),
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
    sent: Arc<Sent>,
) {
    let in_flight = Arc::new(Semaphore::new(options.max_in_flight_batches));
    // Told each time a batch is answered.
    let answered = Arc::new(Notify::new());
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
        let mut batch = Batch::new(first, options);
        // What is ready now.
        while !batch.full() {
            let Ok(next) = queued.try_recv() else {
                break;
            };
            carried = batch.add(next);
        }
        // Others in flight (this batch holds a permit too): linger for more until full or one
        // of them is answered. Listening before looking: an answer after the look is heard,
        // one before it shows in the permits.
        let answer = answered.notified();
        tokio::pin!(answer);
        answer.as_mut().enable();
        let give_up = tokio::time::sleep(options.max_linger);
        tokio::pin!(give_up);
        while !batch.full() && options.max_in_flight_batches - in_flight.available_permits() > 1 {
            tokio::select! {
                biased;
                () = &mut answer => break,
                () = &mut give_up => break,
                next = queued.recv() => match next {
                    Some(next) => carried = batch.add(next),
                    None => break,
                },
            }
        }
        sent.batches.fetch_add(1, Ordering::Relaxed);
        sent.events
            .fetch_add(batch.events.len() as u64, Ordering::Relaxed);
        let client = client.clone();
        let topic = topic.clone();
        let answered = Arc::clone(&answered);
        tokio::spawn(async move {
            send_batch(&client, &topic, batch.events).await;
            drop(permit);
            answered.notify_waiters();
        });
    }
}

/// A batch being formed.
struct Batch {
    events: Vec<Queued>,
    bytes: usize,
    options: PublisherOptions,
    /// An event did not fit: the batch goes as it is.
    closed: bool,
}

impl Batch {
    fn new(first: Queued, options: PublisherOptions) -> Self {
        Batch {
            bytes: first.event.encoded_len() + first.key.len(),
            events: vec![first],
            options,
            closed: false,
        }
    }

    fn full(&self) -> bool {
        self.closed || self.events.len() >= self.options.max_batch_events
    }

    /// Adds `next`, or gives it back (and closes the batch) when it does not fit.
    fn add(&mut self, next: Queued) -> Option<Queued> {
        let size = next.event.encoded_len() + next.key.len();
        if self.bytes + size > self.options.max_batch_bytes {
            self.closed = true;
            return Some(next);
        }
        self.bytes += size;
        self.events.push(next);
        None
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

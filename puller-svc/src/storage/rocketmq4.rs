//! The `rocketmq4` backend: RocketMQ 4.x semantics, PULL from the puller's own cursors.
//!
//! * Reads: the stateless classic pull (`DefaultMQPullConsumer::pull(queue, "*", offset,
//!   max)`) at each reader's cursor, under **one fixed consumer group**
//!   ([`PULL_GROUP`](super::rocketmq::names::PULL_GROUP)) that never commits an offset: the
//!   classic pull sends `commitOffset=false` and persists nothing, and we never call an offset
//!   update, so the broker holds no consume offset for it. Groups are ours, not the broker's:
//!   every reader (group × topic) has its own cursors.
//! * Partitions are the topic's queues, `broker:queue`, everywhere — cursor files
//!   (`rocketmq4-pull-offsets[@group].properties`), stamps, ranges, watermarks, alignment. A
//!   queue is never a flattened index (the reference rewound the wrong queue with one).
//! * A batch's range in a queue is `[cursor, nextBeginOffset)`; records the limits cut off
//!   end it at the last record handed on. The broker's answer to a position outside the queue
//!   (`OFFSET_ILLEGAL`, with the queue's min and max) goes through
//!   [`GroupCursors::resolve`](crate::cursors::GroupCursors::resolve): below the minimum →
//!   moved there, the gap reported lost to retention; past the maximum → reported, not moved.
//! * Queues are pulled concurrently; when none has anything, one more round holds each pull at
//!   the broker up to [`FETCH_WAIT`] (long polling) and answers with the first queue that gets
//!   a message. A queue whose broker fails is skipped while others make progress; the poll
//!   fails (UNAVAILABLE) only when nothing made progress.
//! * Sends: an explicit queue, else the queue the key's Java hash picks, else round robin
//!   ([`RocketMqClient::pick_queue`]). Topics are created on every master of the configured
//!   cluster with `partitions` queues per broker.
//! * No broker ACK, no lite channels (they need `rocketmq5` or the local backend).

// `DefaultMQPullConsumer` is deprecated in favour of the lite pull consumer, which keeps its
// own positions and commits them; the stateless classic pull is what our own cursors need.
#![allow(deprecated)]

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use eventmesh_common::frame::FrameLimits;
use eventmesh_common::keys::{PartitionId, PullKey, Topic};
use futures::StreamExt;
use futures::stream::FuturesUnordered;
use rocketmq_client_rust::{DefaultMQPullConsumer, MessageSelector, PullOptions};
use rocketmq_model::result::PullStatus;

use super::rocketmq::client::{
    CALL_TIMEOUT, QueueRef, RocketMqClient, RocketMqSettings, Route, unavailable,
};
use super::rocketmq::{message, names};
use super::{
    Appended, CoveredRange, PartitionRange, PastEnd, PollLimits, PolledBatch, PolledRecord,
    ReaderKey, Selection, Storage, StorageError,
};
use crate::cursors::{CursorBook, Resolution, StartAt};

/// The backend name used in checkpoint files.
pub const BACKEND: &str = "rocketmq4";
/// Longest the broker holds a pull that found nothing (long polling).
pub const FETCH_WAIT: Duration = Duration::from_millis(100);
/// Most messages one pull asks for (the broker's own default cap is 32).
const MAX_PULL: usize = 32;
/// Bound of one pull, broker wait included.
const PULL_TIMEOUT: Duration = Duration::from_secs(3);

/// What one queue's pull found.
enum Pulled {
    /// Records, and where the next pull starts.
    Found {
        records: Vec<PolledRecord>,
        next: i64,
        min: i64,
    },
    /// Nothing new; `next` is where the broker says to pull next.
    Empty { next: i64, min: i64 },
    /// The position lies outside the queue `[min, max)`.
    Illegal { min: i64, max: i64 },
}

struct Inner {
    client: Arc<RocketMqClient>,
    consumer: tokio::sync::OnceCell<DefaultMQPullConsumer>,
    cursors: Arc<CursorBook>,
    start_at: StartAt,
    limits: FrameLimits,
    /// One poll at a time per reader: two would read the same cursor twice.
    polling: Mutex<HashMap<ReaderKey, Arc<tokio::sync::Mutex<()>>>>,
}

/// The RocketMQ 4.x backend.
#[derive(Clone)]
pub struct RocketMq4Storage {
    inner: Arc<Inner>,
}

impl RocketMq4Storage {
    /// A backend for the cluster `settings` name; checkpoints live in `data_dir`. Nothing is
    /// contacted yet: a name server that is down makes calls UNAVAILABLE until it is up.
    pub async fn new(
        settings: RocketMqSettings,
        data_dir: impl Into<PathBuf>,
        start_at: StartAt,
    ) -> Result<Self, StorageError> {
        let client = Arc::new(RocketMqClient::new(settings).await?);
        Ok(RocketMq4Storage {
            inner: Arc::new(Inner {
                client,
                consumer: tokio::sync::OnceCell::new(),
                cursors: Arc::new(CursorBook::new(data_dir.into(), BACKEND)),
                start_at,
                limits: FrameLimits::DEFAULT,
                polling: Mutex::new(HashMap::new()),
            }),
        })
    }

    /// The shared client (for operator checks).
    pub fn client(&self) -> &Arc<RocketMqClient> {
        &self.inner.client
    }
}

impl Inner {
    async fn consumer(&self) -> Result<DefaultMQPullConsumer, StorageError> {
        self.consumer
            .get_or_try_init(|| async {
                let consumer = DefaultMQPullConsumer::builder(self.client.runtime())
                    .name_server_addr(self.client.namesrv())
                    .consumer_group(names::PULL_GROUP)
                    .consumer_pull_timeout(PULL_TIMEOUT)
                    .build()
                    .map_err(|err| unavailable("pull consumer", &err))?;
                let started = consumer.clone();
                self.client
                    .call("pull consumer start", CALL_TIMEOUT, async move {
                        started
                            .start()
                            .await
                            .map_err(|err| unavailable("pull consumer start", &err))
                    })
                    .await?;
                Ok(consumer)
            })
            .await
            .cloned()
    }

    /// The queue's retained range `[min, max)`.
    async fn range(&self, topic: &Topic, queue: &QueueRef) -> Result<PartitionRange, StorageError> {
        let (start, end) = self.client.queue_range(topic, queue).await?;
        Ok(PartitionRange {
            partition: queue.partition.clone(),
            start,
            end,
        })
    }

    /// Pulls one queue from `offset`; with `wait`, the broker holds an empty pull that long.
    async fn pull(
        &self,
        topic: &Topic,
        queue: &QueueRef,
        offset: i64,
        max: usize,
        wait: Option<Duration>,
    ) -> Result<Pulled, StorageError> {
        let consumer = self.consumer().await?;
        let (topic, partition, limits) = (topic.clone(), queue.partition.clone(), self.limits);
        let mq = queue.message_queue(&topic);
        let max = max.clamp(1, MAX_PULL) as i32;
        self.client
            .call("pull", PULL_TIMEOUT + CALL_TIMEOUT, async move {
                let options = PullOptions::new(mq, MessageSelector::by_tag("*"), offset, max)
                    .map_err(|err| StorageError::Internal(format!("rocketmq pull options: {err}")))?
                    .timeout(PULL_TIMEOUT)
                    .block_if_not_found(wait.is_some())
                    // Only a blocking pull is held; the client insists on a positive value.
                    .broker_suspend_timeout(wait.unwrap_or(Duration::from_millis(1)));
                let result = consumer
                    .pull_with_options(options)
                    .await
                    .map_err(|err| unavailable("pull", &err))?;
                let (next, min, max) = (
                    result.next_begin_offset() as i64,
                    result.min_offset() as i64,
                    result.max_offset() as i64,
                );
                Ok(match result.pull_status() {
                    PullStatus::Found => {
                        let mut records: Vec<PolledRecord> = result
                            .msg_found_list()
                            .unwrap_or_default()
                            .iter()
                            .filter(|m| m.queue_offset() >= offset)
                            .map(|m| {
                                message::record(
                                    &topic,
                                    &partition,
                                    m.queue_offset(),
                                    m,
                                    None,
                                    &limits,
                                )
                            })
                            .collect();
                        records.sort_by_key(|r| r.offset);
                        Pulled::Found { records, next, min }
                    }
                    PullStatus::NoNewMsg | PullStatus::NoMatchedMsg => Pulled::Empty { next, min },
                    PullStatus::OffsetIllegal => Pulled::Illegal { min, max },
                })
            })
            .await
    }

    /// The selection's queues, and the topic's queues it leaves unread.
    fn targets(
        &self,
        topic: &Topic,
        route: &Route,
        selection: &Selection,
    ) -> Result<(Vec<QueueRef>, Vec<QueueRef>), StorageError> {
        Ok(match selection {
            Selection::All => (route.read.clone(), Vec::new()),
            Selection::One(partition) => (
                vec![route.read_queue(topic, partition)?.clone()],
                Vec::new(),
            ),
            Selection::Positioned(positions) => {
                let targets = positions
                    .keys()
                    .map(|p| route.read_queue(topic, p).cloned())
                    .collect::<Result<Vec<_>, _>>()?;
                let unread = route
                    .read
                    .iter()
                    .filter(|q| !positions.contains_key(&q.partition))
                    .cloned()
                    .collect();
                (targets, unread)
            }
        })
    }

    async fn poll(
        &self,
        reader: &ReaderKey,
        selection: &Selection,
        limits: PollLimits,
    ) -> Result<PolledBatch, StorageError> {
        let topic = &reader.topic;
        let route = self.client.route(topic).await?;
        let (targets, unread) = self.targets(topic, &route, selection)?;
        let key_of = |q: &QueueRef| PullKey::new(topic.clone(), q.partition.clone());
        if let Selection::Positioned(positions) = selection {
            self.cursors.with(&reader.group, |c| {
                for (partition, next) in positions {
                    let key = PullKey::new(topic.clone(), partition.clone());
                    if let Some(before) = c.position(&key, *next) {
                        tracing::debug!(%key, ?before, next, "cursor set to the position the dispatcher confirmed");
                    }
                }
            });
        }
        let mut batch = PolledBatch::default();
        for queue in &unread {
            batch.unpositioned.push(self.range(topic, queue).await?);
        }
        // Where each target's read starts; queues without a cursor start per the config.
        let mut first: Vec<(QueueRef, i64)> = Vec::with_capacity(targets.len());
        for queue in targets {
            let key = key_of(&queue);
            let cursor = match self.cursors.with(&reader.group, |c| c.get(&key)) {
                Some(cursor) => cursor,
                None => {
                    let range = self.range(topic, &queue).await?;
                    self.cursors.with(&reader.group, |c| {
                        c.resolve(&key, range.start, range.end, self.start_at);
                        c.get(&key).unwrap_or(range.start)
                    })
                }
            };
            first.push((queue, cursor));
        }
        let max = limits.max_records.max(1);
        let mut answers: Vec<(usize, Result<Pulled, StorageError>)> =
            futures::future::join_all(first.iter().enumerate().map(
                |(i, (queue, cursor))| async move {
                    (i, self.pull(topic, queue, *cursor, max, None).await)
                },
            ))
            .await;
        let quiet = answers.iter().all(
            |(i, answer)| matches!(answer, Ok(Pulled::Empty { next, .. }) if *next <= first[*i].1),
        );
        if quiet && !first.is_empty() {
            // Nothing anywhere: hold one pull per queue at the broker and take the first
            // queue that gets a message (the others' answers are dropped; their cursors did
            // not move, so nothing is lost).
            let mut waiting: FuturesUnordered<_> = first
                .iter()
                .enumerate()
                .map(|(i, (queue, cursor))| async move {
                    (
                        i,
                        self.pull(topic, queue, *cursor, max, Some(FETCH_WAIT))
                            .await,
                    )
                })
                .collect();
            answers.clear();
            while let Some((i, answer)) = waiting.next().await {
                let found = matches!(
                    answer,
                    Ok(Pulled::Found { .. }) | Ok(Pulled::Illegal { .. })
                );
                answers.push((i, answer));
                if found {
                    break;
                }
            }
        }
        answers.sort_by_key(|(i, _)| *i);
        let (mut count, mut bytes) = (0usize, 0usize);
        let mut failures = Vec::new();
        for (i, answer) in answers {
            let (queue, cursor) = &first[i];
            let key = key_of(queue);
            match answer {
                Err(err) => failures.push((queue.partition.clone(), err)),
                Ok(Pulled::Found { records, next, min }) if records.is_empty() => {
                    if next > *cursor {
                        self.settle(reader, &key, &mut batch, *cursor, next, min);
                    }
                }
                Ok(Pulled::Found { records, next, min }) => {
                    let found = records.len();
                    let mut kept = Vec::with_capacity(found);
                    for record in records {
                        let size = record.ingested.frame.len() + record.key.len();
                        if count >= limits.max_records
                            || (count > 0 && bytes + size > limits.max_bytes)
                        {
                            break;
                        }
                        count += 1;
                        bytes += size;
                        kept.push(record);
                    }
                    let next = match kept.last() {
                        Some(last) if kept.len() == found => next.max(last.offset + 1),
                        Some(last) => last.offset + 1,
                        // The limits were used up by earlier queues: this one waits.
                        None => continue,
                    };
                    self.settle(reader, &key, &mut batch, *cursor, next, min);
                    batch.records.extend(kept);
                }
                Ok(Pulled::Empty { next, min }) if next > *cursor => {
                    self.settle(reader, &key, &mut batch, *cursor, next, min);
                }
                Ok(Pulled::Empty { .. }) => {}
                Ok(Pulled::Illegal { min, max }) => {
                    let resolution = self
                        .cursors
                        .with(&reader.group, |c| c.resolve(&key, min, max, self.start_at));
                    match resolution {
                        Resolution::LostToRetention { to, lost } => {
                            batch.ranges.push(CoveredRange {
                                partition: queue.partition.clone(),
                                first: *cursor,
                                next: to,
                                lost_to_retention: lost,
                            })
                        }
                        Resolution::PastEnd(position) => batch.past_end.push(PastEnd {
                            partition: queue.partition.clone(),
                            position,
                            log_start: min,
                            log_end: max,
                        }),
                        Resolution::Started(_) | Resolution::InRange(_) => {}
                    }
                }
            }
        }
        if let Some((partition, err)) = failures.into_iter().next() {
            if batch.is_empty() {
                return Err(err);
            }
            tracing::warn!(topic = %topic, %partition, %err, "queue skipped this poll: its broker failed");
        }
        Ok(batch)
    }

    /// Moves the cursor to `next` and reports `[cursor, next)`, counting what lies below the
    /// queue's minimum as lost to retention.
    fn settle(
        &self,
        reader: &ReaderKey,
        key: &PullKey,
        batch: &mut PolledBatch,
        cursor: i64,
        next: i64,
        min: i64,
    ) {
        self.cursors
            .with(&reader.group, |c| c.settle_read(key, next));
        batch.ranges.push(CoveredRange {
            partition: key.partition.clone(),
            first: cursor,
            next,
            lost_to_retention: (min - cursor).clamp(0, next - cursor),
        });
    }

    fn poll_lock(&self, reader: &ReaderKey) -> Arc<tokio::sync::Mutex<()>> {
        let mut polling = self.polling.lock().unwrap_or_else(|p| p.into_inner());
        Arc::clone(polling.entry(reader.clone()).or_default())
    }
}

#[async_trait::async_trait]
impl Storage for RocketMq4Storage {
    fn backend(&self) -> &'static str {
        BACKEND
    }

    fn cursor_book(&self) -> Arc<CursorBook> {
        Arc::clone(&self.inner.cursors)
    }

    fn check_topic_name(&self, topic: &Topic) -> Result<(), StorageError> {
        names::check_topic(topic)
    }

    async fn create_topic(&self, topic: &Topic, partitions: u32) -> Result<bool, StorageError> {
        names::check_topic(topic)?;
        self.inner.client.create_topic(topic, partitions).await
    }

    async fn partition_count(&self, topic: &Topic) -> Result<u32, StorageError> {
        Ok(self.inner.client.route(topic).await?.read.len() as u32)
    }

    async fn send(
        &self,
        topic: &Topic,
        key: Bytes,
        body: Bytes,
        partition: Option<PartitionId>,
    ) -> Result<Appended, StorageError> {
        names::check_topic(topic)?;
        let key = message::key_text(&key)?;
        let client = &self.inner.client;
        client.check_body(&body)?;
        let route = client.route(topic).await?;
        let queue = client
            .pick_queue(&route, topic, key.as_deref(), partition.as_ref())?
            .clone();
        let outgoing = message::outgoing(topic, key.as_deref(), body)?;
        let producer = client.producer().await?;
        let mq = queue.message_queue(topic);
        let sent = client
            .call("send", CALL_TIMEOUT * 2, async move {
                producer
                    .send_to_queue(outgoing, mq)
                    .await
                    .map_err(|err| unavailable("send", &err))
            })
            .await?
            .ok_or_else(|| {
                StorageError::Internal("rocketmq send answered without a result".into())
            })?;
        if !matches!(sent.send_status, rocketmq_model::result::SendStatus::SendOk) {
            // Stored on the master, only its flush or replication lagged: the message is in
            // the queue, so it is answered as written (a retry would duplicate it).
            tracing::warn!(%topic, partition = %queue.partition, status = ?sent.send_status, "rocketmq stored the message with a degraded status");
        }
        Ok(Appended {
            partition: queue.partition,
            offset: sent.queue_offset as i64,
        })
    }

    /// Each poll that finds nothing holds one pull per queue at the broker (long polling).
    fn waits_in_poll(&self) -> bool {
        true
    }

    async fn poll(
        &self,
        reader: &ReaderKey,
        selection: &Selection,
        limits: PollLimits,
    ) -> Result<PolledBatch, StorageError> {
        let lock = self.inner.poll_lock(reader);
        let _polling = lock.lock().await;
        self.inner.poll(reader, selection, limits).await
    }

    async fn end_offsets(&self, topic: &Topic) -> Result<Vec<PartitionRange>, StorageError> {
        let route = self.inner.client.route(topic).await?;
        futures::future::try_join_all(route.read.iter().map(|q| self.inner.range(topic, q))).await
    }

    async fn evict_reader(&self, reader: &ReaderKey) -> Result<(), StorageError> {
        self.inner
            .polling
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(reader);
        super::evict_cursors(Arc::clone(&self.inner.cursors), reader).await
    }
}

//! Reading a topic's queues from the puller's own cursors: what `rocketmq4` (PULL) and
//! `rocketmq5` (POP) share, each supplying how one queue is read ([`QueueFetch`]).
//!
//! * Partitions are the topic's queues, `broker:queue`, everywhere — cursor files, stamps,
//!   ranges, watermarks, alignment. A queue is never a flattened index (the reference rewound
//!   the wrong queue with one).
//! * A batch's range in a queue is `[cursor, next)`; records the limits cut off end it at the
//!   last record handed on. A position outside the queue (the broker's `OFFSET_ILLEGAL`, with
//!   the queue's min and max) goes through
//!   [`GroupCursors::resolve`](crate::cursors::GroupCursors::resolve): below the minimum →
//!   moved there, the gap reported lost to retention; past the maximum → reported, not moved.
//! * Queues are read concurrently; when none has anything, one more round holds each read at
//!   the broker up to [`FETCH_WAIT`] (long polling) and answers with the first queue that gets
//!   a message. A queue whose broker fails is skipped while others make progress; the poll
//!   fails (UNAVAILABLE) only when nothing made progress.
//! * One poll at a time per reader: two would read the same cursor twice.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use eventmesh_common::keys::{PartitionId, PullKey, Topic};
use futures::StreamExt;
use futures::stream::FuturesUnordered;

use super::client::{QueueRef, RocketMqClient, Route};
use super::{names, sends};
use crate::cursors::{CursorBook, Resolution, StartAt};
use crate::storage::{
    Appended, CoveredRange, PartitionRange, PastEnd, PollLimits, PolledBatch, PolledRecord,
    ReaderKey, Selection, StorageError,
};

/// Longest the broker holds a read that found nothing (long polling).
pub const FETCH_WAIT: Duration = Duration::from_millis(100);

/// What reading one queue from a cursor found.
pub enum Fetched {
    /// Records (in offset order, none below the cursor), and where the next read starts.
    Found {
        records: Vec<PolledRecord>,
        next: i64,
        min: i64,
    },
    /// Nothing new; `next` is where the broker says to read next.
    Empty { next: i64, min: i64 },
    /// The position lies outside the queue `[min, max)`.
    Illegal { min: i64, max: i64 },
}

/// How a backend reads one queue.
#[async_trait::async_trait]
pub trait QueueFetch: Send + Sync {
    /// Reads `queue` of `reader`'s topic from `cursor`, at most `max` records; with `wait`, the
    /// broker may hold an empty read that long.
    async fn fetch(
        &self,
        reader: &ReaderKey,
        queue: &QueueRef,
        cursor: i64,
        max: usize,
        wait: Option<Duration>,
    ) -> Result<Fetched, StorageError>;
}

/// The cursors of every reader over the RocketMQ client, and the operations both backends
/// share (sends, topics, ranges).
pub struct QueueReads {
    pub client: Arc<RocketMqClient>,
    pub cursors: Arc<CursorBook>,
    start_at: StartAt,
    polling: Mutex<HashMap<ReaderKey, Arc<tokio::sync::Mutex<()>>>>,
}

impl QueueReads {
    /// Reads over `client`, with `backend`'s checkpoint files in `data_dir`.
    pub fn new(
        client: Arc<RocketMqClient>,
        backend: &'static str,
        data_dir: PathBuf,
        start_at: StartAt,
    ) -> Self {
        QueueReads {
            client,
            cursors: Arc::new(CursorBook::new(data_dir, backend)),
            start_at,
            polling: Mutex::new(HashMap::new()),
        }
    }

    /// The queue's retained range `[min, max)`.
    pub async fn range(
        &self,
        topic: &Topic,
        queue: &QueueRef,
    ) -> Result<PartitionRange, StorageError> {
        let (start, end) = self.client.queue_range(topic, queue).await?;
        Ok(PartitionRange {
            partition: queue.partition.clone(),
            start,
            end,
        })
    }

    /// Every queue's retained range.
    pub async fn end_offsets(&self, topic: &Topic) -> Result<Vec<PartitionRange>, StorageError> {
        let route = self.client.route(topic).await?;
        futures::future::try_join_all(route.read.iter().map(|q| self.range(topic, q))).await
    }

    /// Creates `topic` with `partitions` queues on every master of the cluster.
    pub async fn create_topic(&self, topic: &Topic, partitions: u32) -> Result<bool, StorageError> {
        names::check_topic(topic)?;
        self.client.create_topic(topic, partitions).await
    }

    /// The topic's queue count.
    pub async fn partition_count(&self, topic: &Topic) -> Result<u32, StorageError> {
        Ok(self.client.route(topic).await?.read.len() as u32)
    }

    /// Sends one message ([`sends::send`]).
    pub async fn send(
        &self,
        topic: &Topic,
        key: Bytes,
        body: Bytes,
        partition: Option<PartitionId>,
    ) -> Result<Appended, StorageError> {
        sends::send(&self.client, topic, key, body, partition).await
    }

    /// One poll of `reader` through `fetch` (one at a time per reader).
    pub async fn poll(
        &self,
        fetch: &(impl QueueFetch + ?Sized),
        reader: &ReaderKey,
        selection: &Selection,
        limits: PollLimits,
    ) -> Result<PolledBatch, StorageError> {
        let lock = {
            let mut polling = self.polling.lock().unwrap_or_else(|p| p.into_inner());
            Arc::clone(polling.entry(reader.clone()).or_default())
        };
        let _polling = lock.lock().await;
        self.poll_queues(fetch, reader, selection, limits).await
    }

    /// Forgets `reader`: its poll lock and cursors.
    pub async fn evict(&self, reader: &ReaderKey) -> Result<(), StorageError> {
        self.polling
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(reader);
        crate::storage::evict_cursors(Arc::clone(&self.cursors), reader).await
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

    async fn poll_queues(
        &self,
        fetch: &(impl QueueFetch + ?Sized),
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
        let mut answers: Vec<(usize, Result<Fetched, StorageError>)> =
            futures::future::join_all(first.iter().enumerate().map(
                |(i, (queue, cursor))| async move {
                    (i, fetch.fetch(reader, queue, *cursor, max, None).await)
                },
            ))
            .await;
        let quiet = answers.iter().all(
            |(i, answer)| matches!(answer, Ok(Fetched::Empty { next, .. }) if *next <= first[*i].1),
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
                        fetch
                            .fetch(reader, queue, *cursor, max, Some(FETCH_WAIT))
                            .await,
                    )
                })
                .collect();
            answers.clear();
            while let Some((i, answer)) = waiting.next().await {
                let found = matches!(
                    answer,
                    Ok(Fetched::Found { .. }) | Ok(Fetched::Illegal { .. })
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
                Ok(Fetched::Found { records, next, min }) if records.is_empty() => {
                    if next > *cursor {
                        self.settle(reader, &key, &mut batch, *cursor, next, min);
                    }
                }
                Ok(Fetched::Found { records, next, min }) => {
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
                Ok(Fetched::Empty { next, min }) if next > *cursor => {
                    self.settle(reader, &key, &mut batch, *cursor, next, min);
                }
                Ok(Fetched::Empty { .. }) => {}
                Ok(Fetched::Illegal { min, max }) => {
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
}

/// Implements `Storage` for a RocketMQ backend `$storage` whose `self.inner` holds `reads`
/// ([`QueueReads`]) and the backend's [`QueueFetch`] in the field `$fetch`: what every
/// RocketMQ backend answers alike comes from the reads; `$own` adds the backend's own methods.
macro_rules! rocketmq_storage {
    ($storage:ty, $backend:expr, $fetch:ident, { $($own:tt)* }) => {
        #[async_trait::async_trait]
        impl $crate::storage::Storage for $storage {
            fn backend(&self) -> &'static str {
                $backend
            }

            fn cursor_book(&self) -> std::sync::Arc<$crate::cursors::CursorBook> {
                std::sync::Arc::clone(&self.inner.reads.cursors)
            }

            fn check_topic_name(
                &self,
                topic: &eventmesh_common::keys::Topic,
            ) -> Result<(), $crate::storage::StorageError> {
                $crate::storage::rocketmq::names::check_topic(topic)
            }

            async fn create_topic(
                &self,
                topic: &eventmesh_common::keys::Topic,
                partitions: u32,
            ) -> Result<bool, $crate::storage::StorageError> {
                self.inner.reads.create_topic(topic, partitions).await
            }

            async fn partition_count(
                &self,
                topic: &eventmesh_common::keys::Topic,
            ) -> Result<u32, $crate::storage::StorageError> {
                self.inner.reads.partition_count(topic).await
            }

            async fn send(
                &self,
                topic: &eventmesh_common::keys::Topic,
                key: bytes::Bytes,
                body: bytes::Bytes,
                partition: Option<eventmesh_common::keys::PartitionId>,
            ) -> Result<$crate::storage::Appended, $crate::storage::StorageError> {
                self.inner.reads.send(topic, key, body, partition).await
            }

            /// The first record alone (the producer's route for a new topic is refreshed by
            /// it), then the rest at once.
            async fn send_batch(
                &self,
                topic: &eventmesh_common::keys::Topic,
                records: Vec<$crate::storage::NewRecord>,
            ) -> Result<
                Vec<Result<$crate::storage::Appended, $crate::storage::StorageError>>,
                $crate::storage::StorageError,
            > {
                // The producer learns a topic created a moment ago from the first record; the
                // rest go as broker batches.
                $crate::storage::send_first_alone(self, topic, records, |rest| {
                    $crate::storage::rocketmq::sends::send_batch(&self.inner.reads.client, topic, rest)
                })
                .await
            }

            /// A poll that finds nothing holds one read per queue at the broker (long
            /// polling).
            fn waits_in_poll(&self) -> bool {
                true
            }

            async fn poll(
                &self,
                reader: &$crate::storage::ReaderKey,
                selection: &$crate::storage::Selection,
                limits: $crate::storage::PollLimits,
            ) -> Result<$crate::storage::PolledBatch, $crate::storage::StorageError> {
                let inner = &self.inner;
                inner.reads.poll(&inner.$fetch, reader, selection, limits).await
            }

            async fn end_offsets(
                &self,
                topic: &eventmesh_common::keys::Topic,
            ) -> Result<Vec<$crate::storage::PartitionRange>, $crate::storage::StorageError> {
                self.inner.reads.end_offsets(topic).await
            }

            async fn describe_broker_storage(
                &self,
                topic: &eventmesh_common::keys::Topic,
            ) -> Result<$crate::storage::BrokerStorageReport, $crate::storage::StorageError> {
                $crate::storage::rocketmq::inspect::describe(&self.inner.reads.client, topic).await
            }

            $($own)*
        }
    };
}
pub(crate) use rocketmq_storage;

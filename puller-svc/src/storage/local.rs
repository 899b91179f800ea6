//! The `local` backend: the embedded [`LocalLog`] behind the [`Storage`] contract, with one
//! [`GroupCursors`] set (and checkpoint file `local-pull-offsets[@group].properties`) per
//! subscription group. No broker ACK exists, so `ack_pulled` is not applicable.
//!
//! A poll reads every requested partition from the reader's cursor (the partitions with
//! records pending share `max_records` equally), ingests the records, and only then moves the cursors, so a
//! failure half-way returns what was read and leaves the rest for the next poll (the
//! reference's loss path L3). A read that races retention re-resolves the cursor once.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use bytes::Bytes;
use eventmesh_common::frame::FrameLimits;
use eventmesh_common::keys::{PartitionId, PullKey, Topic};
use tokio::sync::watch;

use super::{
    Appended, CoveredRange, PartitionRange, PollLimits, PolledBatch, PolledRecord, ReaderKey,
    Storage, StorageError,
};
use crate::cursors::{CursorBook, GroupCursors, StartAt};
use crate::ingest::{Origin, ingest};
use crate::local_log::partition::now_ms;
use crate::local_log::{LocalLog, LogError, LogSettings, TopicError};

/// The backend name used in checkpoint files.
pub const BACKEND: &str = "local";

impl From<TopicError> for StorageError {
    fn from(err: TopicError) -> Self {
        match err {
            TopicError::UnknownTopic(topic) => StorageError::UnknownTopic(topic),
            TopicError::UnknownPartition { topic, partition } => {
                StorageError::UnknownPartition { topic, partition }
            }
            TopicError::NoPartitions | TopicError::BadLiteName(_) => {
                StorageError::Invalid(err.to_string())
            }
            TopicError::Log(LogError::TooLarge { .. }) => StorageError::Invalid(err.to_string()),
            TopicError::Log(LogError::Io { .. } | LogError::OffsetOutOfRange { .. }) => {
                StorageError::Unavailable(err.to_string())
            }
            TopicError::BadMetadata { .. } | TopicError::Log(LogError::Corrupt { .. }) => {
                StorageError::Internal(err.to_string())
            }
        }
    }
}

struct Inner {
    log: LocalLog,
    start_at: StartAt,
    limits: FrameLimits,
    cursors: Arc<CursorBook>,
    /// Per topic with a waiting reader: bumped after each append (see `Storage::appends`).
    appends: Mutex<HashMap<Topic, watch::Sender<u64>>>,
}

impl Inner {
    /// Wakes the readers waiting on `topic`, if any.
    fn appended(&self, topic: &Topic) {
        let appends = self.appends.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(signal) = appends.get(topic) {
            signal.send_modify(|count| *count = count.wrapping_add(1));
        }
    }
}

/// The embedded local backend.
#[derive(Clone)]
pub struct LocalStorage {
    inner: Arc<Inner>,
}

impl LocalStorage {
    /// Opens the log under `data_dir/local-log`; checkpoints live in `data_dir`.
    pub fn open(
        data_dir: impl Into<PathBuf>,
        settings: LogSettings,
        start_at: StartAt,
    ) -> Result<Self, StorageError> {
        let data_dir = data_dir.into();
        let log = LocalLog::open(data_dir.join("local-log"), settings)?;
        Ok(LocalStorage {
            inner: Arc::new(Inner {
                log,
                start_at,
                limits: FrameLimits::DEFAULT,
                cursors: Arc::new(CursorBook::new(&data_dir, BACKEND)),
                appends: Mutex::default(),
            }),
        })
    }

    async fn blocking<T, F>(&self, work: F) -> Result<T, StorageError>
    where
        T: Send + 'static,
        F: FnOnce(&Inner) -> Result<T, StorageError> + Send + 'static,
    {
        super::on_blocking(Arc::clone(&self.inner), work).await
    }
}

impl Inner {
    /// Reads one partition from the reader's cursor without moving it; re-resolves once if
    /// retention removed the start meanwhile.
    fn read_partition(
        &self,
        cursors: &mut GroupCursors,
        topic: &Topic,
        range: &PartitionRange,
        start_at: StartAt,
        max_records: usize,
        max_bytes: usize,
    ) -> Result<(i64, Vec<crate::local_log::Record>), TopicError> {
        let key = PullKey::new(topic.clone(), range.partition.clone());
        cursors.resolve(&key, range.start, range.end, start_at);
        let mut from = cursors.get(&key).unwrap_or(range.start);
        for attempt in 0..2 {
            match self
                .log
                .read(topic, &range.partition, from, max_records, max_bytes)
            {
                Err(TopicError::Log(LogError::OffsetOutOfRange { start, .. })) if attempt == 0 => {
                    cursors.resolve(&key, start, range.end.max(start), start_at);
                    from = cursors.get(&key).unwrap_or(start);
                }
                other => return other.map(|records| (from, records)),
            }
        }
        Ok((from, Vec::new()))
    }

    fn poll(
        &self,
        reader: &ReaderKey,
        targets: Vec<PartitionRange>,
        start_at: StartAt,
        limits: PollLimits,
    ) -> Result<PolledBatch, StorageError> {
        self.cursors.with(&reader.group, |cursors| {
            // Share the record limit among the partitions that have something to read.
            let pending: Vec<&PartitionRange> = targets
                .iter()
                .filter(|range| {
                    let key = PullKey::new(reader.topic.clone(), range.partition.clone());
                    cursors.resolve(&key, range.start, range.end, start_at);
                    cursors.get(&key).is_some_and(|cursor| cursor < range.end)
                })
                .collect();
            let share = limits.max_records.div_ceil(pending.len().max(1)).max(1);
            let mut batch = PolledBatch::default();
            let mut bytes = 0usize;
            let mut advances = Vec::new();
            for range in pending {
                let remaining = limits.max_records.saturating_sub(batch.records.len());
                if remaining == 0 || (bytes >= limits.max_bytes && !batch.records.is_empty()) {
                    break;
                }
                let read = self.read_partition(
                    cursors,
                    &reader.topic,
                    range,
                    start_at,
                    share.min(remaining),
                    limits.max_bytes.saturating_sub(bytes).max(1),
                );
                let (from, records) = match read {
                    Ok(read) => read,
                    Err(err) if batch.records.is_empty() => return Err(err.into()),
                    Err(err) => {
                        // Keep what was read; the failed partition is retried by the next poll.
                        tracing::warn!(topic = %reader.topic, partition = %range.partition, error = %err, "partition read failed; returning the partial batch");
                        break;
                    }
                };
                let Some(last) = records.last().map(|r| r.offset) else {
                    continue;
                };
                for record in records {
                    bytes += record.body.len();
                    let origin = Origin {
                        partition: &range.partition,
                        offset: record.offset,
                        pop_ck: None,
                    };
                    batch.records.push(PolledRecord {
                        partition: range.partition.clone(),
                        offset: record.offset,
                        key: record.key,
                        timestamp_ms: record.timestamp_ms,
                        ack_key: None,
                        ingested: ingest(record.body, &[], &origin, &self.limits),
                    });
                }
                batch.ranges.push(CoveredRange {
                    partition: range.partition.clone(),
                    first: from,
                    next: last + 1,
                });
                advances.push((PullKey::new(reader.topic.clone(), range.partition.clone()), last + 1));
            }
            // Only now: every record above is in the batch that goes back to the caller.
            for (key, next) in advances {
                cursors.advance(&key, next);
            }
            Ok(batch)
        })
    }
}

#[async_trait::async_trait]
impl Storage for LocalStorage {
    fn backend(&self) -> &'static str {
        BACKEND
    }

    fn cursor_book(&self) -> Arc<CursorBook> {
        Arc::clone(&self.inner.cursors)
    }

    async fn create_topic(&self, topic: &Topic, partitions: u32) -> Result<bool, StorageError> {
        let topic = topic.clone();
        self.blocking(move |inner| Ok(inner.log.create_topic(&topic, partitions)?))
            .await
    }

    async fn partition_count(&self, topic: &Topic) -> Result<u32, StorageError> {
        let topic = topic.clone();
        self.blocking(move |inner| Ok(inner.log.ranges(&topic)?.len() as u32))
            .await
    }

    async fn send(
        &self,
        topic: &Topic,
        key: Bytes,
        body: Bytes,
        partition: Option<PartitionId>,
    ) -> Result<Appended, StorageError> {
        let topic = topic.clone();
        self.blocking(move |inner| {
            let appended = inner
                .log
                .append(&topic, &key, &body, partition.as_ref(), now_ms())?;
            inner.appended(&topic);
            Ok(appended)
        })
        .await
    }

    fn appends(&self, topic: &Topic) -> Option<watch::Receiver<u64>> {
        let mut appends = self.inner.appends.lock().unwrap_or_else(|p| p.into_inner());
        Some(
            appends
                .entry(topic.clone())
                .or_insert_with(|| watch::channel(0).0)
                .subscribe(),
        )
    }

    async fn poll(
        &self,
        reader: &ReaderKey,
        partition: Option<&PartitionId>,
        limits: PollLimits,
    ) -> Result<PolledBatch, StorageError> {
        let reader = reader.clone();
        let partition = partition.cloned();
        self.blocking(move |inner| {
            let targets = match &partition {
                Some(partition) => vec![inner.log.range(&reader.topic, partition)?],
                None => inner.log.ranges(&reader.topic)?,
            };
            inner.poll(&reader, targets, inner.start_at, limits)
        })
        .await
    }

    async fn end_offsets(&self, topic: &Topic) -> Result<Vec<PartitionRange>, StorageError> {
        let topic = topic.clone();
        self.blocking(move |inner| Ok(inner.log.ranges(&topic)?))
            .await
    }

    async fn create_lite(&self, parent: &Topic, lite: &str) -> Result<PartitionId, StorageError> {
        let (parent, lite) = (parent.clone(), lite.to_owned());
        self.blocking(move |inner| Ok(inner.log.create_lite(&parent, &lite)?))
            .await
    }

    async fn send_lite(
        &self,
        parent: &Topic,
        lite: &str,
        body: Bytes,
    ) -> Result<Appended, StorageError> {
        let (parent, lite) = (parent.clone(), lite.to_owned());
        self.blocking(move |inner| {
            let appended = inner.log.append_lite(&parent, &lite, &body, now_ms())?;
            inner.appended(&parent);
            Ok(appended)
        })
        .await
    }

    async fn pull_lite(
        &self,
        reader: &ReaderKey,
        lite: &str,
        limits: PollLimits,
    ) -> Result<PolledBatch, StorageError> {
        let (reader, lite) = (reader.clone(), lite.to_owned());
        self.blocking(move |inner| {
            let partition = inner.log.create_lite(&reader.topic, &lite)?;
            let range = inner.log.range(&reader.topic, &partition)?;
            // A fresh reader replays a lite channel from its head.
            inner.poll(&reader, vec![range], StartAt::Earliest, limits)
        })
        .await
    }
}

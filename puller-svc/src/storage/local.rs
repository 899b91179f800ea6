//! The `local` backend: the embedded [`LocalLog`] behind the [`Storage`] contract, with one
//! [`GroupCursors`] set (and checkpoint file `local-pull-offsets[@group].properties`) per
//! subscription group. No broker ACK exists, so `ack_pulled` is not applicable.
//!
//! A poll reads every selected partition from the reader's cursor (the partitions with
//! records pending share `max_records` equally), ingests the records, and only then moves the
//! cursors, so a failure half-way returns what was read and leaves the rest for the next poll
//! (the reference's loss path L3). A cursor below the log start reads from the log start and
//! reports what retention removed (also when a read races retention); one past the log end is
//! reported and left alone.

use std::collections::{HashMap, HashSet};
use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use bytes::Bytes;
use eventmesh_common::frame::FrameLimits;
use eventmesh_common::keys::{PartitionId, PullKey, Topic};
use tokio::sync::watch;

use super::{
    Appended, CoveredRange, NewRecord, PartitionRange, PastEnd, PollLimits, PolledBatch,
    PolledRecord, ReaderKey, Selection, Storage, StorageError,
};
use crate::cursors::{CursorBook, GroupCursors, Resolution, StartAt};
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
            TopicError::NoPartitions
            | TopicError::BadLiteName(_)
            | TopicError::NameTooLong { .. } => StorageError::Invalid(err.to_string()),
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
    /// Partitions whose last read failed: a failure is logged when a partition joins, and
    /// its recovery when it leaves, not at every poll.
    failing: Mutex<HashSet<PullKey>>,
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
    /// Opens the log under `data_dir/local-log`; checkpoints live in `data_dir`. Dead-letter
    /// topics are kept forever.
    pub fn open(
        data_dir: impl Into<PathBuf>,
        settings: LogSettings,
        start_at: StartAt,
    ) -> Result<Self, StorageError> {
        LocalStorage::open_with(data_dir, settings, None, start_at)
    }

    /// As [`LocalStorage::open`], with an age limit for dead-letter topics (`None`: keep).
    pub fn open_with(
        data_dir: impl Into<PathBuf>,
        settings: LogSettings,
        dead_letter_retention_ms: Option<i64>,
        start_at: StartAt,
    ) -> Result<Self, StorageError> {
        let data_dir = data_dir.into();
        let log = LocalLog::open_with(
            data_dir.join("local-log"),
            settings,
            dead_letter_retention_ms,
        )?;
        Ok(LocalStorage {
            inner: Arc::new(Inner {
                log,
                start_at,
                limits: FrameLimits::DEFAULT,
                cursors: Arc::new(CursorBook::new(&data_dir, BACKEND)),
                appends: Mutex::default(),
                failing: Mutex::default(),
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
    /// The partitions a selection reads (with their retained ranges) and, for positions, the
    /// topic's partitions it leaves unread.
    fn targets(
        &self,
        topic: &Topic,
        selection: &Selection,
    ) -> Result<(Vec<PartitionRange>, Vec<PartitionRange>), StorageError> {
        Ok(match selection {
            Selection::All => (self.log.ranges(topic)?, Vec::new()),
            Selection::One(partition) => (vec![self.log.range(topic, partition)?], Vec::new()),
            Selection::Positioned(positions) => {
                let mut targets = Vec::with_capacity(positions.len());
                for partition in positions.keys() {
                    targets.push(self.log.range(topic, partition)?);
                }
                let unpositioned = self
                    .log
                    .ranges(topic)?
                    .into_iter()
                    .filter(|range| !positions.contains_key(&range.partition))
                    .collect();
                (targets, unpositioned)
            }
        })
    }

    /// Notes how the last read of a partition went (`Some(error)`: it failed), logging only
    /// the changes: the first failure at WARN, the recovery at INFO.
    fn read_state(&self, key: &PullKey, failed: Option<&TopicError>) {
        let mut failing = self.failing.lock().unwrap_or_else(|p| p.into_inner());
        match failed {
            Some(error) => {
                if failing.insert(key.clone()) {
                    tracing::warn!(%key, %error, "partition read failed; it is held (read again at every poll, never skipped) while the others are read");
                }
            }
            None => {
                if failing.remove(key) {
                    tracing::info!(%key, "partition readable again");
                }
            }
        }
    }

    fn poll(
        &self,
        reader: &ReaderKey,
        selection: &Selection,
        start_at: StartAt,
        limits: PollLimits,
    ) -> Result<PolledBatch, StorageError> {
        let (targets, unpositioned) = self.targets(&reader.topic, selection)?;
        self.cursors.with(&reader.group, |cursors| {
            if let Selection::Positioned(positions) = selection {
                for (partition, next) in positions {
                    let key = PullKey::new(reader.topic.clone(), partition.clone());
                    if let Some(before) = cursors.position(&key, *next) {
                        tracing::debug!(%key, ?before, next, "cursor set to the position the dispatcher confirmed");
                    }
                }
            }
            let mut batch = PolledBatch {
                unpositioned,
                ..PolledBatch::default()
            };
            let mut plans = Vec::new();
            for range in &targets {
                let key = PullKey::new(reader.topic.clone(), range.partition.clone());
                match PartitionRead::plan(cursors, key, range, start_at) {
                    Ok(plan) => plans.push(plan),
                    Err(past_end) => batch.past_end.push(past_end),
                }
            }
            // Share the record limit among the partitions that have something to read.
            let pending = plans.iter().filter(|plan| plan.from < plan.range.end).count();
            let share = limits.max_records.div_ceil(pending.max(1)).max(1);
            let mut bytes = 0usize;
            let mut first_error = None;
            for plan in &mut plans {
                let remaining = limits.max_records.saturating_sub(batch.records.len());
                let full = remaining == 0 || (bytes >= limits.max_bytes && !batch.records.is_empty());
                if full || plan.from >= plan.range.end {
                    continue;
                }
                let max_bytes = limits.max_bytes.saturating_sub(bytes).max(1);
                match self.read(&reader.topic, plan, share.min(remaining), max_bytes) {
                    Ok(records) => {
                        bytes += records.iter().map(|r| r.body.len() + r.key.len()).sum::<usize>();
                        plan.records = records;
                        self.read_state(&plan.key, None);
                    }
                    Err(err) => {
                        // The other partitions are still read (one damaged partition must not
                        // hold the topic); this one is read again from its cursor next time.
                        self.read_state(&plan.key, Some(&err));
                        plan.failed = true;
                        batch.failed_partitions += 1;
                        first_error.get_or_insert(err);
                    }
                }
                batch.records.reserve(plan.records.len());
                for record in &plan.records {
                    let origin = Origin {
                        topic: &reader.topic,
                        partition: &plan.range.partition,
                        offset: record.offset,
                        pop_ck: None,
                    };
                    batch.records.push(PolledRecord {
                        partition: plan.range.partition.clone(),
                        offset: record.offset,
                        key: record.key.clone(),
                        timestamp_ms: record.timestamp_ms,
                        ack_key: None,
                        ingested: ingest(
                            record.body.clone(),
                            &[],
                            &origin,
                            &self.limits,
                            limits.stamping,
                        ),
                    });
                }
            }
            // Every partition failed: the poll fails (and says why). With one partition left
            // behind the others still answer — empty when they are caught up, so the caller's
            // long poll waits for appends instead of retrying at once.
            if batch.failed_partitions as usize == plans.len()
                && let Some(err) = first_error
            {
                return Err(err.into());
            }
            // Only now: every range below goes back to the caller with its records.
            for plan in plans {
                if let Some(range) = plan.finish(cursors) {
                    batch.ranges.push(range);
                }
            }
            Ok(batch)
        })
    }

    /// Reads one partition from `plan.from`; when retention removed that start meanwhile,
    /// moves the plan to the new log start (counting the loss) and reads once more.
    fn read(
        &self,
        topic: &Topic,
        plan: &mut PartitionRead,
        max_records: usize,
        max_bytes: usize,
    ) -> Result<Vec<crate::local_log::Record>, TopicError> {
        for attempt in 0..2 {
            match self.log.read(
                topic,
                &plan.range.partition,
                plan.from,
                max_records,
                max_bytes,
            ) {
                Err(TopicError::Log(LogError::OffsetOutOfRange { start, .. }))
                    if attempt == 0 && start > plan.from =>
                {
                    if plan.cursor.is_some() {
                        // A reader that starts here has lost nothing it ever had.
                        plan.lost += start - plan.from;
                    }
                    plan.from = start;
                }
                other => return other,
            }
        }
        Ok(Vec::new())
    }
}

/// One partition of a poll: where its read starts and what it found.
struct PartitionRead {
    key: PullKey,
    range: PartitionRange,
    /// The cursor before the poll (`None`: the partition had none and starts now).
    cursor: Option<i64>,
    /// Where reading starts.
    from: i64,
    /// Offsets from the cursor on that retention removed unread.
    lost: i64,
    records: Vec<crate::local_log::Record>,
    failed: bool,
}

impl PartitionRead {
    /// Plans the read of one partition; a cursor past the end of the log is reported instead.
    fn plan(
        cursors: &GroupCursors,
        key: PullKey,
        range: &PartitionRange,
        start_at: StartAt,
    ) -> Result<PartitionRead, PastEnd> {
        let cursor = cursors.get(&key);
        let (from, lost) = match cursors.classify(&key, range.start, range.end, start_at) {
            Resolution::PastEnd(position) => {
                return Err(PastEnd {
                    partition: range.partition.clone(),
                    position,
                    log_start: range.start,
                    log_end: range.end,
                });
            }
            Resolution::LostToRetention { to, lost } => (to, lost),
            Resolution::Started(at) | Resolution::InRange(at) => (at, 0),
        };
        Ok(PartitionRead {
            key,
            range: range.clone(),
            cursor,
            from,
            lost,
            records: Vec::new(),
            failed: false,
        })
    }

    /// Moves the cursor past what was read and returns the range to report, if any.
    fn finish(self, cursors: &mut GroupCursors) -> Option<CoveredRange> {
        let next = match self.records.last() {
            Some(last) => last.offset + 1,
            None if self.lost > 0 && !self.failed => self.from,
            None => {
                if self.cursor.is_none() && !self.failed {
                    // A reader starting here keeps its start even before a record arrives.
                    cursors.settle_read(&self.key, self.from);
                }
                return None;
            }
        };
        cursors.settle_read(&self.key, next);
        Some(CoveredRange {
            partition: self.range.partition,
            first: self.from - self.lost,
            next,
            lost_to_retention: self.lost,
        })
    }
}

#[async_trait::async_trait]
impl Storage for LocalStorage {
    fn backend(&self) -> &'static str {
        BACKEND
    }

    fn check_topic_name(&self, topic: &Topic) -> Result<(), StorageError> {
        Ok(LocalLog::check_name(topic)?)
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

    async fn send_batch(
        &self,
        topic: &Topic,
        records: Vec<NewRecord>,
    ) -> Result<Vec<Result<Appended, StorageError>>, StorageError> {
        let topic = topic.clone();
        self.blocking(move |inner| {
            let results = inner.log.append_batch(&topic, &records, now_ms())?;
            if results.iter().any(Result::is_ok) {
                inner.appended(&topic);
            }
            Ok(results
                .into_iter()
                .map(|result| result.map_err(StorageError::from))
                .collect())
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
        selection: &Selection,
        limits: PollLimits,
    ) -> Result<PolledBatch, StorageError> {
        let (reader, selection) = (reader.clone(), selection.clone());
        self.blocking(move |inner| inner.poll(&reader, &selection, inner.start_at, limits))
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
            // A fresh reader replays a lite channel from its head.
            inner.poll(
                &reader,
                &Selection::One(partition),
                StartAt::Earliest,
                limits,
            )
        })
        .await
    }
}

//! The `Storage` contract every MQ backend implements (DESIGN §5), and the types it speaks.
//!
//! A backend owns the pull position of every **reader** — one subscription group on one topic
//! ([`ReaderKey`]) — so groups never hold each other back. `poll` reads from that position and
//! moves it past what it returns; `align_pull_offset` applies the group's inclusive ACK
//! watermark (see [`crate::cursors`]); `ack_pulled` forwards a settled message to brokers that
//! need one (RocketMQ 5 POP) and answers [`AckPulledOutcome::NotApplicable`] elsewhere.
//!
//! Every polled record is ingested ([`crate::ingest`]): stamped with its partition and offset
//! (our own frames as stored when the poll asks, [`Stamping::ExceptOwnFrames`]), foreign
//! bodies converted, broken ones flagged for the dead-letter topic. Every batch reports,
//! per partition it advanced, the `[first, next)` range it covered, starting exactly where the
//! read started: offsets in it without a record are absent from the log, the first
//! `lost_to_retention` of them removed by retention before the reader got to them. A position
//! past the end of the log is reported ([`PastEnd`]) and never moved by the backend.
//!
//! What a poll reads is a [`Selection`]: the reader's cursors, or positions its dispatcher
//! names (the cursors are set to them first, so a batch whose response was lost is read again;
//! the topic's partitions it did not name are reported as unpositioned, not read).

pub mod kafka;
pub mod local;
pub mod report;
pub mod rocketmq;
pub mod rocketmq4;
pub mod rocketmq5;

use std::collections::BTreeMap;

use bytes::Bytes;
use eventmesh_common::keys::{GroupName, KeyError, PartitionId, Topic};
use eventmesh_common::status::{ClassifiedError, ErrorClass, to_status};

use std::sync::Arc;

use eventmesh_common::keys::PullKey;

use crate::cursors::{Alignment, CursorBook};
use crate::ingest::Ingested;
pub use crate::ingest::Stamping;

/// One reader: a subscription group (`None`: the topic's default group) on a topic.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ReaderKey {
    /// The group.
    pub group: Option<GroupName>,
    /// The topic.
    pub topic: Topic,
}

/// Bounds and form of one poll's answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PollLimits {
    /// Most records.
    pub max_records: usize,
    /// About this many body bytes at most (at least one record is returned when any exists).
    pub max_bytes: usize,
    /// Which frames are stamped ([`Stamping`]).
    pub stamping: Stamping,
}

impl Default for PollLimits {
    fn default() -> Self {
        PollLimits {
            max_records: 500,
            max_bytes: 4 * 1024 * 1024,
            stamping: Stamping::Every,
        }
    }
}

/// One polled message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PolledRecord {
    /// Its partition.
    pub partition: PartitionId,
    /// Its offset.
    pub offset: i64,
    /// Its ordering key (may be empty).
    pub key: Bytes,
    /// Broker or append time, ms since the Unix epoch (0 if unknown).
    pub timestamp_ms: i64,
    /// The key to pass to `ack_pulled`, where the broker needs one.
    pub ack_key: Option<String>,
    /// The frame, stamped as the poll asked ([`Stamping`]), or the original body of a
    /// dead-letter case.
    pub ingested: Ingested,
}

/// The span a batch covered in one partition: `[first, next)`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CoveredRange {
    /// The partition.
    pub partition: PartitionId,
    /// First offset covered: where the read started.
    pub first: i64,
    /// One past the last offset covered: the reader's cursor afterwards.
    pub next: i64,
    /// How many offsets from `first` on retention removed before they were read.
    pub lost_to_retention: i64,
}

/// A partition whose position lies past the end of its log: not read, not moved.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PastEnd {
    /// The partition.
    pub partition: PartitionId,
    /// The position (cursor) found there.
    pub position: i64,
    /// The log's oldest retained offset.
    pub log_start: i64,
    /// The offset the log's next record gets.
    pub log_end: i64,
}

/// The result of one poll.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PolledBatch {
    /// Records, partition by partition, offsets ascending.
    pub records: Vec<PolledRecord>,
    /// One range per partition the batch advanced.
    pub ranges: Vec<CoveredRange>,
    /// Partitions of the topic a [`Selection::Positioned`] poll did not name (not read).
    pub unpositioned: Vec<PartitionRange>,
    /// Partitions whose position is past the end of their log (not read).
    pub past_end: Vec<PastEnd>,
    /// Partitions whose read failed while others succeeded: the batch carries the others,
    /// these are read again from the same cursor next time (a read that fails for every
    /// partition fails the poll instead). Each counts in `puller_pull_errors_total`.
    pub failed_partitions: u32,
}

impl PolledBatch {
    /// Whether the batch tells its caller nothing (a long poll keeps waiting).
    pub fn is_empty(&self) -> bool {
        self.records.is_empty()
            && self.ranges.is_empty()
            && self.unpositioned.is_empty()
            && self.past_end.is_empty()
    }
}

/// Which partitions a poll reads, and from where.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Selection {
    /// Every partition of the topic, from the reader's cursors.
    All,
    /// One partition, from the reader's cursor.
    One(PartitionId),
    /// Exactly these partitions, from these positions (the cursors are set to them first);
    /// the topic's other partitions are reported as unpositioned.
    Positioned(BTreeMap<PartitionId, i64>),
}

impl Selection {
    /// The selection a request makes: positions when any are named (narrowed to `only` when
    /// given), else one partition or all.
    pub fn of(only: Option<PartitionId>, positions: BTreeMap<PartitionId, i64>) -> Selection {
        match (only, positions.is_empty()) {
            (None, true) => Selection::All,
            (Some(partition), true) => Selection::One(partition),
            (only, false) => Selection::Positioned(
                positions
                    .into_iter()
                    .filter(|(p, _)| only.as_ref().is_none_or(|o| o == p))
                    .collect(),
            ),
        }
    }
}

/// Where an appended record landed.
pub use crate::local_log::Appended;
/// A record to append.
pub use crate::local_log::NewRecord;
/// A partition's retained range `[start, end)`.
pub use crate::local_log::PartitionRange;
pub use report::BrokerStorageReport;

/// The outcome of a broker ACK.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum AckPulledOutcome {
    /// The broker confirmed.
    Acked,
    /// The backend has no broker ACK.
    NotApplicable,
    /// The key is unknown (e.g. from before a restart); the broker redelivers on its own.
    UnknownKey,
}

/// Errors of a storage backend.
#[derive(Debug, Clone, thiserror::Error)]
pub enum StorageError {
    /// The topic does not exist.
    #[error("unknown topic {0}")]
    UnknownTopic(String),
    /// The partition does not exist.
    #[error("topic {topic} has no partition {partition}")]
    UnknownPartition {
        /// The topic.
        topic: String,
        /// The partition.
        partition: String,
    },
    /// The request is invalid.
    #[error("{0}")]
    Invalid(String),
    /// The backend (broker, disk) failed; retry.
    #[error("storage unavailable: {0}")]
    Unavailable(String),
    /// A bug or corrupted state.
    #[error("storage internal error: {0}")]
    Internal(String),
}

impl ClassifiedError for StorageError {
    fn class(&self) -> ErrorClass {
        match self {
            StorageError::UnknownTopic(_) | StorageError::UnknownPartition { .. } => {
                ErrorClass::NotFound
            }
            StorageError::Invalid(_) => ErrorClass::InvalidArgument,
            StorageError::Unavailable(_) => ErrorClass::Unavailable,
            StorageError::Internal(_) => ErrorClass::Internal,
        }
    }
}

impl From<StorageError> for tonic::Status {
    fn from(err: StorageError) -> tonic::Status {
        to_status(&err)
    }
}

impl From<KeyError> for StorageError {
    fn from(err: KeyError) -> Self {
        StorageError::Invalid(err.to_string())
    }
}

/// Sends each record with [`Storage::send`], all at once (a client that batches on its own,
/// like Kafka's producer, turns them into one produce request per partition); the answers in
/// record order.
pub(crate) async fn send_each<S: Storage + ?Sized>(
    storage: &S,
    topic: &Topic,
    records: impl IntoIterator<Item = NewRecord>,
) -> Vec<Result<Appended, StorageError>> {
    let sends = records
        .into_iter()
        .map(|record| storage.send(topic, record.key, record.body, record.partition));
    futures::future::join_all(sends).await
}

/// Sends the first record alone with [`Storage::send`], then the rest with `send_rest`: for a
/// topic a client has not produced to yet (maybe just created), so the first send finds out
/// whether it exists and refreshes the client's metadata, and the rest do not all fail on a
/// stale "unknown topic". Unknown: nothing was stored, the batch fails as a whole.
pub(crate) async fn send_first_alone<S, F, Rest>(
    storage: &S,
    topic: &Topic,
    records: Vec<NewRecord>,
    send_rest: F,
) -> Result<Vec<Result<Appended, StorageError>>, StorageError>
where
    S: Storage + ?Sized,
    F: FnOnce(Vec<NewRecord>) -> Rest,
    Rest: Future<Output = Result<Vec<Result<Appended, StorageError>>, StorageError>>,
{
    let mut records = records.into_iter();
    let mut results = Vec::with_capacity(records.len());
    let Some(first) = records.next() else {
        return Ok(results);
    };
    match storage
        .send(topic, first.key, first.body, first.partition)
        .await
    {
        Err(StorageError::UnknownTopic(name)) => return Err(StorageError::UnknownTopic(name)),
        first => results.push(first),
    }
    results.extend(send_rest(records.collect()).await?);
    whole_batch_unknown(topic, results)
}

/// Lite channels on a backend that has none (they need `local` or `rocketmq5`).
fn lite_unsupported(backend: &str) -> StorageError {
    StorageError::Invalid(format!(
        "lite channels are not supported by the {backend} backend (use local or rocketmq5)"
    ))
}

/// A batch whose every record found the topic unknown fails as a whole (nothing was stored).
pub(crate) fn whole_batch_unknown(
    topic: &Topic,
    results: Vec<Result<Appended, StorageError>>,
) -> Result<Vec<Result<Appended, StorageError>>, StorageError> {
    if !results.is_empty()
        && results
            .iter()
            .all(|result| matches!(result, Err(StorageError::UnknownTopic(_))))
    {
        return Err(StorageError::UnknownTopic(topic.to_string()));
    }
    Ok(results)
}

/// An MQ backend.
#[async_trait::async_trait]
pub trait Storage: Send + Sync + 'static {
    /// The backend's name, as used in checkpoint file names (`local`, `kafka`, ...).
    fn backend(&self) -> &'static str;

    /// Refuses a topic name this backend cannot hold (for the topic or its dead-letter topic),
    /// with the rule: checked before any create or append, so a client never retries a name
    /// that can never work.
    fn check_topic_name(&self, _topic: &Topic) -> Result<(), StorageError> {
        Ok(())
    }

    /// Creates a topic; `Ok(false)` when it existed.
    async fn create_topic(&self, topic: &Topic, partitions: u32) -> Result<bool, StorageError>;

    /// Number of partitions of a topic.
    async fn partition_count(&self, topic: &Topic) -> Result<u32, StorageError>;

    /// Appends one record (explicit partition, else by key, else spread).
    async fn send(
        &self,
        topic: &Topic,
        key: Bytes,
        body: Bytes,
        partition: Option<PartitionId>,
    ) -> Result<Appended, StorageError>;

    /// Appends records to one topic, answering each on its own and in order (placed as
    /// [`Storage::send`] places one; records of one partition keep their order). Fails as a
    /// whole only when the topic is unknown, so the caller can create it and send again.
    ///
    /// The default sends them concurrently, for backends whose client batches on its own
    /// (Kafka's producer: linger and one produce request per partition).
    async fn send_batch(
        &self,
        topic: &Topic,
        records: Vec<NewRecord>,
    ) -> Result<Vec<Result<Appended, StorageError>>, StorageError> {
        let results = send_each(self, topic, records).await;
        whole_batch_unknown(topic, results)
    }

    /// Reads the reader's next batch from the selected partitions, moving its position past
    /// what is returned.
    async fn poll(
        &self,
        reader: &ReaderKey,
        selection: &Selection,
        limits: PollLimits,
    ) -> Result<PolledBatch, StorageError>;

    /// A signal bumped after every append to `topic` made through this process, so an idle
    /// long-poll wakes at once instead of on its next timer tick. Only for backends whose
    /// records all arrive through this process (the local log); a broker others write to keeps
    /// this default (`None`: poll on the timer).
    fn appends(&self, _topic: &Topic) -> Option<tokio::sync::watch::Receiver<u64>> {
        None
    }

    /// Whether [`Storage::poll`] itself waits a while for records when there are none (a broker
    /// consumer's own long poll, answered as soon as a record arrives). A long-poll over such a
    /// backend polls again at once instead of sleeping on a look-again timer, so the first
    /// record after a quiet spell is not held by the timer.
    fn waits_in_poll(&self) -> bool {
        false
    }

    /// Forwards a settled message to the broker where it needs an ACK; backends without a
    /// broker ACK keep this default.
    async fn ack_pulled(
        &self,
        _reader: &ReaderKey,
        _ack_key: &str,
    ) -> Result<AckPulledOutcome, StorageError> {
        Ok(AckPulledOutcome::NotApplicable)
    }

    /// The per-group cursors behind the default cursor operations below (backends whose
    /// positions live in files; a broker-managed backend overrides those operations).
    fn cursor_book(&self) -> Arc<CursorBook>;

    /// Applies the group's inclusive watermark to the reader's position in one partition.
    async fn align_pull_offset(
        &self,
        reader: &ReaderKey,
        partition: &PartitionId,
        watermark: Option<i64>,
    ) -> Result<Alignment, StorageError> {
        let key = PullKey::new(reader.topic.clone(), partition.clone());
        let group = reader.group.clone();
        on_blocking(self.cursor_book(), move |book| {
            Ok(book.with(&group, |c| c.align(&key, watermark)))
        })
        .await
    }

    /// Sets the reader's position in one partition (a dispatcher's Attach position).
    async fn position_pull_offset(
        &self,
        reader: &ReaderKey,
        partition: &PartitionId,
        next: i64,
    ) -> Result<(), StorageError> {
        let key = PullKey::new(reader.topic.clone(), partition.clone());
        let group = reader.group.clone();
        on_blocking(self.cursor_book(), move |book| {
            book.with(&group, |c| c.position(&key, next));
            Ok(())
        })
        .await
    }

    /// The retained range of every partition of a topic.
    async fn end_offsets(&self, topic: &Topic) -> Result<Vec<PartitionRange>, StorageError>;

    /// What the brokers report about the topic's storage (`DescribeBrokerStorage`). Backends
    /// without brokers of their own to ask keep this default (INVALID_ARGUMENT).
    async fn describe_broker_storage(
        &self,
        _topic: &Topic,
    ) -> Result<BrokerStorageReport, StorageError> {
        Err(StorageError::Invalid(format!(
            "the {} backend has no broker storage to describe (the rocketmq4 and rocketmq5 \
             backends have)",
            self.backend()
        )))
    }

    /// The reader's current positions.
    async fn cursors(&self, reader: &ReaderKey) -> Result<Vec<(PartitionId, i64)>, StorageError> {
        let reader = reader.clone();
        on_blocking(self.cursor_book(), move |book| {
            Ok(book.list(&reader.group, &reader.topic))
        })
        .await
    }

    /// Forgets an idle reader: what the backend keeps for it (a Kafka consumer and its
    /// threads) and its cursors (and their checkpoint file when its group has no other).
    async fn evict_reader(&self, reader: &ReaderKey) -> Result<(), StorageError> {
        evict_cursors(self.cursor_book(), reader).await
    }

    /// How many readers hold backend resources of their own (a Kafka consumer each); 0 where
    /// readers hold none.
    fn reader_count(&self) -> usize {
        0
    }

    /// Persists every reader's positions (called every few seconds and at shutdown).
    async fn checkpoint(&self) -> Result<(), StorageError> {
        on_blocking(self.cursor_book(), |book| {
            book.checkpoint_all()
                .map_err(|err| StorageError::Unavailable(err.to_string()))
        })
        .await
    }

    /// Creates a lite channel inside `parent`; returns its partition id `<lite>@<queue>`.
    /// Backends without lite channels keep this default (INVALID_ARGUMENT).
    async fn create_lite(&self, _parent: &Topic, _lite: &str) -> Result<PartitionId, StorageError> {
        Err(lite_unsupported(self.backend()))
    }

    /// Appends to a lite channel.
    async fn send_lite(
        &self,
        _parent: &Topic,
        _lite: &str,
        _body: Bytes,
    ) -> Result<Appended, StorageError> {
        Err(lite_unsupported(self.backend()))
    }

    /// Reads a lite channel from the reader's position in it (from its head on a fresh reader).
    async fn pull_lite(
        &self,
        _reader: &ReaderKey,
        _lite: &str,
        _limits: PollLimits,
    ) -> Result<PolledBatch, StorageError> {
        Err(lite_unsupported(self.backend()))
    }
}

/// Forgets a reader's cursors (and their checkpoint file when its group has no other).
pub(crate) async fn evict_cursors(
    book: Arc<CursorBook>,
    reader: &ReaderKey,
) -> Result<(), StorageError> {
    let reader = reader.clone();
    on_blocking(book, move |book| {
        book.evict(&reader.group, &reader.topic);
        Ok(())
    })
    .await
}

/// Runs blocking backend work (file I/O, librdkafka calls) on the blocking pool.
pub(crate) async fn on_blocking<S, T, F>(state: Arc<S>, work: F) -> Result<T, StorageError>
where
    S: Send + Sync + 'static + ?Sized,
    T: Send + 'static,
    F: FnOnce(&S) -> Result<T, StorageError> + Send + 'static,
{
    tokio::task::spawn_blocking(move || work(&state))
        .await
        .map_err(|err| StorageError::Internal(format!("blocking task failed: {err}")))?
}

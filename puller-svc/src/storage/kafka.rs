//! The `kafka` backend: Kafka used as a durable FIFO log, never as a consumer group.
//!
//! * Producer: `acks=all`; a record goes to the requested partition, else Kafka's key hash,
//!   else Kafka's spreading.
//! * Readers: one `BaseConsumer` per reader (group × topic), **assigned** to partitions at the
//!   reader's cursors and never subscribed. librdkafka refuses `assign` without a `group.id`, so
//!   each consumer gets a throwaway id unique to this process and reader that is never joined,
//!   never committed to (`enable.auto.commit=false`, `enable.auto.offset.store=false`, no
//!   commit call anywhere), so the broker holds no offsets for it.
//! * Cursors: the same [`GroupCursors`] files as every backend (`kafka-pull-offsets[@group]`);
//!   the consumer is re-assigned whenever a cursor moved under it (alignment, resolution).
//!   `auto.offset.reset=error`: an offset outside the log is not silently reset by librdkafka
//!   (it reports `AUTO_OFFSET_RESET`, or passes the broker's `OFFSET_OUT_OF_RANGE`); the reader
//!   fits its cursors into the partition watermarks again: below the log start → the log start,
//!   reporting what retention removed; past the end → reported, not moved (the dispatcher
//!   decides).
//! * Partitions are read from metadata on every poll, so partitions added to a topic are picked
//!   up. Offsets Kafka skipped (compaction, transaction markers) fall inside the reported
//!   `[first, next)` range and so count as settled.
//! * No broker ACK, no lite channels (they need RocketMQ 5 or the local backend).

use std::collections::{BTreeMap, HashMap};
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use eventmesh_common::frame::FrameLimits;
use eventmesh_common::grpc::MAX_RECORD_KEY_BYTES;
use eventmesh_common::keys::{PartitionId, PartitionKind, PullKey, Topic};
use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use rdkafka::client::DefaultClientContext;
use rdkafka::config::ClientConfig;
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::error::{KafkaError, RDKafkaErrorCode};
use rdkafka::message::{Headers, Message};
use rdkafka::producer::{FutureProducer, FutureRecord, Producer};
use rdkafka::{Offset, TopicPartitionList};

use super::{
    Appended, CoveredRange, NewRecord, PartitionRange, PastEnd, PollLimits, PolledBatch,
    PolledRecord, ReaderKey, Selection, Storage, StorageError,
};
use crate::cursors::{CursorBook, Resolution, StartAt};
use crate::ingest::{Header, Origin, ingest, malformed};

/// The backend name used in checkpoint files.
pub const BACKEND: &str = "kafka";
/// Broker round-trip bound for metadata, watermarks and admin calls.
const CALL_TIMEOUT: Duration = Duration::from_secs(10);
/// How long one poll waits for records from the broker.
const FETCH_WAIT: Duration = Duration::from_millis(100);
/// How long librdkafka tries to deliver a produced record before failing it.
const MESSAGE_TIMEOUT: Duration = Duration::from_secs(10);

fn unavailable(what: &str, err: KafkaError) -> StorageError {
    StorageError::Unavailable(format!("kafka {what}: {err}"))
}

struct ReaderConsumer {
    consumer: BaseConsumer,
    /// The next offset this consumer will hand us per partition (as assigned or advanced).
    positions: BTreeMap<i32, i64>,
    /// Partitions whose position was above the high watermark of the last fetch answer, and
    /// in how many polls in a row.
    above_end: BTreeMap<i32, u32>,
}

/// Polls in a row a position must stay above the fetched high watermark before it is reported
/// past the end (one stale answer is not enough).
const PAST_END_POLLS: u32 = 2;

/// The low and high watermarks of the last fetch answer for a partition, as librdkafka cached
/// them (no broker call); `None` before the first answer. Brokers answer a fetch past the end
/// with OFFSET_OUT_OF_RANGE, which the error path handles; some (tansu 0.6) answer with no
/// records and no error, so a position above the high watermark is noticed here.
#[allow(unsafe_code)]
fn cached_watermarks(consumer: &BaseConsumer, topic: &str, partition: i32) -> Option<(i64, i64)> {
    let topic = std::ffi::CString::new(topic).ok()?;
    let (mut low, mut high) = (-1i64, -1i64);
    // SAFETY: the client pointer is live as long as `consumer` is borrowed; `topic` is a valid
    // NUL-terminated string for the call; `low` and `high` are valid for writes. librdkafka
    // only reads its own cached state under its own locks.
    let err = unsafe {
        rdkafka_sys::rd_kafka_get_watermark_offsets(
            consumer.client().native_ptr(),
            topic.as_ptr(),
            partition,
            &mut low,
            &mut high,
        )
    };
    (err == rdkafka_sys::rd_kafka_resp_err_t::RD_KAFKA_RESP_ERR_NO_ERROR && high >= 0)
        .then_some((low.max(0), high))
}

struct Inner {
    bootstrap: String,
    instance: String,
    producer: FutureProducer,
    admin: AdminClient<DefaultClientContext>,
    metadata: BaseConsumer,
    start_at: StartAt,
    tuning: KafkaTuning,
    limits: FrameLimits,
    cursors: Arc<CursorBook>,
    /// One consumer per reader, each behind its own lock: readers never wait for each other.
    consumers: Mutex<HashMap<ReaderKey, Arc<Mutex<ReaderConsumer>>>>,
    /// Topics the producer has seen in the broker's metadata: a publish to any other topic
    /// asks the broker first, so nothing waits in librdkafka's queue for a topic that does
    /// not exist (and appears after the publish was answered as failed).
    known_topics: Mutex<std::collections::HashSet<Topic>>,
}

/// The Kafka backend.
#[derive(Clone)]
pub struct KafkaStorage {
    inner: Arc<Inner>,
    /// `retention.ms` of dead-letter topics this backend creates (`None`: -1, keep forever).
    dead_letter_retention_ms: Option<i64>,
}

/// librdkafka settings an operator tunes per broker.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KafkaTuning {
    /// `fetch.wait.max.ms`: longest the broker holds a fetch that found nothing new. Apache
    /// Kafka answers a held fetch as soon as a record is produced, so this bounds only idle
    /// fetch traffic; a broker that holds it the full time (tansu 0.6) adds up to this much to
    /// the first record after a quiet spell.
    pub fetch_wait_ms: u32,
    /// `linger.ms`: how long the producer gathers records into one produce request. 0 sends
    /// at once (a lone publish is answered sooner); under load records still share requests
    /// while earlier ones are in flight.
    pub linger_ms: u32,
}

impl Default for KafkaTuning {
    fn default() -> Self {
        KafkaTuning {
            fetch_wait_ms: 500,
            linger_ms: 5,
        }
    }
}

fn consumer_config(bootstrap: &str, group: &str, tuning: KafkaTuning) -> ClientConfig {
    let mut config = ClientConfig::new();
    config
        .set("fetch.wait.max.ms", tuning.fetch_wait_ms.to_string())
        .set("bootstrap.servers", bootstrap)
        // Required by librdkafka for assign(); never joined (no subscribe), never committed.
        .set("group.id", group)
        .set("enable.auto.commit", "false")
        .set("enable.auto.offset.store", "false")
        .set("auto.offset.reset", "error")
        .set("enable.partition.eof", "false");
    config
}

impl KafkaStorage {
    /// Connects to `bootstrap` (clients connect lazily; nothing fails here if the broker is
    /// down). Checkpoints live in `data_dir`.
    pub fn new(
        bootstrap: &str,
        data_dir: impl Into<PathBuf>,
        start_at: StartAt,
    ) -> Result<Self, StorageError> {
        Self::with_tuning(bootstrap, data_dir, start_at, KafkaTuning::default())
    }

    /// [`KafkaStorage::new`] with librdkafka settings other than the defaults.
    pub fn with_tuning(
        bootstrap: &str,
        data_dir: impl Into<PathBuf>,
        start_at: StartAt,
        tuning: KafkaTuning,
    ) -> Result<Self, StorageError> {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos());
        let instance = format!("eventmesh-puller-{}-{nanos}", std::process::id());
        let producer: FutureProducer = ClientConfig::new()
            .set("bootstrap.servers", bootstrap)
            .set("acks", "all")
            .set("enable.idempotence", "false")
            // The Java producer's key hash: a key lands on the same partition whoever
            // publishes it (librdkafka's default is CRC32).
            .set("partitioner", "murmur2_random")
            .set("linger.ms", tuning.linger_ms.to_string())
            // A publish answered as failed is given up by librdkafka within this bound, not
            // delivered minutes later (the SDK's retry carries the same event id anyway).
            .set(
                "message.timeout.ms",
                MESSAGE_TIMEOUT.as_millis().to_string(),
            )
            .create()
            .map_err(|err| unavailable("producer", err))?;
        let admin = ClientConfig::new()
            .set("bootstrap.servers", bootstrap)
            .create()
            .map_err(|err| unavailable("admin client", err))?;
        let metadata = consumer_config(bootstrap, &format!("{instance}-metadata"), tuning)
            .create()
            .map_err(|err| unavailable("metadata client", err))?;
        let data_dir = data_dir.into();
        Ok(KafkaStorage {
            inner: Arc::new(Inner {
                bootstrap: bootstrap.to_owned(),
                instance,
                producer,
                admin,
                metadata,
                start_at,
                tuning,
                limits: FrameLimits::DEFAULT,
                cursors: Arc::new(CursorBook::new(&data_dir, BACKEND)),
                consumers: Mutex::new(HashMap::new()),
                known_topics: Mutex::default(),
            }),
            dead_letter_retention_ms: None,
        })
    }

    /// Dead-letter topics this backend creates keep records this long (default: forever).
    pub fn with_dead_letter_retention(mut self, retention_ms: Option<i64>) -> Self {
        self.dead_letter_retention_ms = retention_ms;
        self
    }

    /// The throwaway `group.id` prefix of this instance's consumers (never joined).
    pub fn instance_group_prefix(&self) -> &str {
        &self.inner.instance
    }

    async fn blocking<T, F>(&self, work: F) -> Result<T, StorageError>
    where
        T: Send + 'static,
        F: FnOnce(&Inner) -> Result<T, StorageError> + Send + 'static,
    {
        super::on_blocking(Arc::clone(&self.inner), work).await
    }
}

impl KafkaStorage {
    async fn produce(
        &self,
        topic: &Topic,
        key: &Bytes,
        body: &Bytes,
        partition: Option<i32>,
    ) -> Result<Appended, StorageError> {
        let mut record: FutureRecord<'_, [u8], [u8]> =
            FutureRecord::to(topic.as_str()).payload(&body[..]);
        if !key.is_empty() {
            record = record.key(&key[..]);
        }
        if let Some(partition) = partition {
            record = record.partition(partition);
        }
        match self.inner.producer.send(record, CALL_TIMEOUT).await {
            Ok(delivery) => Ok(Appended {
                partition: PartitionId::number(delivery.partition as u32),
                offset: delivery.offset,
            }),
            // The broker's answer, or librdkafka's own (`Local: Unknown topic`) when its metadata
            // says the topic does not exist: both mean "create it first", not "try later".
            Err((
                KafkaError::MessageProduction(
                    RDKafkaErrorCode::UnknownTopicOrPartition | RDKafkaErrorCode::UnknownTopic,
                ),
                _,
            )) => Err(StorageError::UnknownTopic(topic.to_string())),
            Err((err, _)) => Err(unavailable("produce", err)),
        }
    }

    /// Topics the producer has seen in the broker's metadata.
    fn known_topics(&self) -> std::sync::MutexGuard<'_, std::collections::HashSet<Topic>> {
        self.inner
            .known_topics
            .lock()
            .unwrap_or_else(|p| p.into_inner())
    }

    /// Asks the broker through the producer's own client (refreshing its metadata cache)
    /// whether `topic` exists now.
    async fn producer_sees_topic(&self, topic: &Topic) -> bool {
        let topic = topic.clone();
        self.blocking(move |inner| {
            let metadata = inner
                .producer
                .client()
                .fetch_metadata(Some(topic.as_str()), CALL_TIMEOUT)
                .map_err(|err| unavailable("metadata", err))?;
            Ok(metadata.topics().iter().any(|t| {
                t.name() == topic.as_str() && t.error().is_none() && !t.partitions().is_empty()
            }))
        })
        .await
        .unwrap_or(false)
    }
}

fn partition_number(topic: &Topic, partition: &PartitionId) -> Result<i32, StorageError> {
    match partition.kind() {
        PartitionKind::Number(n) if n <= i32::MAX as u32 => Ok(n as i32),
        _ => Err(StorageError::UnknownPartition {
            topic: topic.to_string(),
            partition: partition.to_string(),
        }),
    }
}

impl Inner {
    fn partition_count(&self, topic: &Topic) -> Result<u32, StorageError> {
        let metadata = self
            .metadata
            .fetch_metadata(Some(topic.as_str()), CALL_TIMEOUT)
            .map_err(|err| unavailable("metadata", err))?;
        let Some(found) = metadata
            .topics()
            .iter()
            .find(|t| t.name() == topic.as_str())
        else {
            return Err(StorageError::UnknownTopic(topic.to_string()));
        };
        if found.error().is_some() || found.partitions().is_empty() {
            return Err(StorageError::UnknownTopic(topic.to_string()));
        }
        Ok(found.partitions().len() as u32)
    }

    fn range(&self, topic: &Topic, partition: i32) -> Result<PartitionRange, StorageError> {
        let (low, high) = self
            .metadata
            .fetch_watermarks(topic.as_str(), partition, CALL_TIMEOUT)
            .map_err(|err| unavailable("watermarks", err))?;
        Ok(PartitionRange {
            partition: PartitionId::number(partition as u32),
            start: low,
            end: high,
        })
    }

    fn new_consumer(&self, reader: &ReaderKey) -> Result<ReaderConsumer, StorageError> {
        let group = match &reader.group {
            Some(group) => format!("{}-{group}-{}", self.instance, reader.topic),
            None => format!("{}--{}", self.instance, reader.topic),
        };
        let consumer = consumer_config(&self.bootstrap, &group, self.tuning)
            .create()
            .map_err(|err| unavailable("consumer", err))?;
        Ok(ReaderConsumer {
            consumer,
            positions: BTreeMap::new(),
            above_end: BTreeMap::new(),
        })
    }

    /// The selection's partition numbers, and the topic's partitions it leaves unread.
    fn targets(
        &self,
        topic: &Topic,
        selection: &Selection,
    ) -> Result<(Vec<i32>, Vec<i32>), StorageError> {
        let count = self.partition_count(topic)? as i32;
        let checked = |partition: &PartitionId| {
            let number = partition_number(topic, partition)?;
            if number >= count {
                return Err(StorageError::UnknownPartition {
                    topic: topic.to_string(),
                    partition: partition.to_string(),
                });
            }
            Ok(number)
        };
        Ok(match selection {
            Selection::All => ((0..count).collect(), Vec::new()),
            Selection::One(partition) => (vec![checked(partition)?], Vec::new()),
            Selection::Positioned(positions) => {
                let targets = positions
                    .keys()
                    .map(checked)
                    .collect::<Result<Vec<_>, _>>()?;
                let unread = (0..count).filter(|p| !targets.contains(p)).collect();
                (targets, unread)
            }
        })
    }

    fn poll(
        &self,
        reader: &ReaderKey,
        selection: &Selection,
        limits: PollLimits,
    ) -> Result<PolledBatch, StorageError> {
        let (mut targets, unread) = self.targets(&reader.topic, selection)?;
        let key_of = |p: i32| PullKey::new(reader.topic.clone(), PartitionId::number(p as u32));
        if let Selection::Positioned(positions) = selection {
            self.cursors.with(&reader.group, |c| {
                for (partition, next) in positions {
                    let key = PullKey::new(reader.topic.clone(), partition.clone());
                    if let Some(before) = c.position(&key, *next) {
                        tracing::debug!(%key, ?before, next, "cursor set to the position the dispatcher confirmed");
                    }
                }
            });
        }
        let mut batch = PolledBatch::default();
        for p in unread {
            batch.unpositioned.push(self.range(&reader.topic, p)?);
        }
        // Where each target's read starts; partitions without a cursor start per the config.
        let mut first: BTreeMap<i32, i64> = BTreeMap::new();
        for &p in &targets {
            let key = key_of(p);
            let cursor = match self.cursors.with(&reader.group, |c| c.get(&key)) {
                Some(cursor) => cursor,
                None => {
                    let range = self.range(&reader.topic, p)?;
                    self.cursors.with(&reader.group, |c| {
                        c.resolve(&key, range.start, range.end, self.start_at);
                        c.get(&key).unwrap_or(range.start)
                    })
                }
            };
            first.insert(p, cursor);
        }
        // Offsets retention removed under a cursor, per partition (found on an out-of-range
        // fetch, which is the only time the broker tells).
        let mut lost: BTreeMap<i32, i64> = BTreeMap::new();
        let mut resolved = false;
        let by_partition = loop {
            match self.fetch(reader, &targets, limits) {
                Ok(fetched) => {
                    targets.retain(|p| !fetched.past_end.iter().any(|e| e.0 == *p));
                    batch
                        .past_end
                        .extend(fetched.past_end.into_iter().map(|(_, past_end)| past_end));
                    break fetched.records;
                }
                Err(Fetch::OutOfRange) if !resolved => {
                    resolved = true;
                    let outcome = self.reresolve(reader, &targets)?;
                    for (p, n) in outcome.lost {
                        *lost.entry(p).or_default() += n;
                    }
                    targets.retain(|p| !outcome.past_end.iter().any(|e| e.0 == *p));
                    batch
                        .past_end
                        .extend(outcome.past_end.into_iter().map(|(_, past_end)| past_end));
                }
                Err(Fetch::OutOfRange) => {
                    return Err(StorageError::Unavailable(format!(
                        "kafka fetch of {} still out of range after fitting the cursors into the log",
                        reader.topic
                    )));
                }
                Err(Fetch::Failed(err)) => return Err(err),
            }
        };
        for &p in &targets {
            let records = by_partition.get(&p);
            let lost = lost.get(&p).copied().unwrap_or(0);
            let next = match records.and_then(|r| r.last()) {
                Some(last) => last.offset + 1,
                None if lost > 0 => first.get(&p).copied().unwrap_or(0) + lost,
                None => continue,
            };
            let key = key_of(p);
            self.cursors
                .with(&reader.group, |c| c.settle_read(&key, next));
            batch.ranges.push(CoveredRange {
                partition: PartitionId::number(p as u32),
                first: first.get(&p).copied().unwrap_or(next),
                next,
                lost_to_retention: lost,
            });
        }
        batch.records.extend(by_partition.into_values().flatten());
        Ok(batch)
    }

    /// The reader's consumer, created on first use.
    fn consumer(&self, reader: &ReaderKey) -> Result<Arc<Mutex<ReaderConsumer>>, StorageError> {
        let mut consumers = self.consumers.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(shared) = consumers.get(reader) {
            return Ok(Arc::clone(shared));
        }
        let shared = Arc::new(Mutex::new(self.new_consumer(reader)?));
        consumers.insert(reader.clone(), Arc::clone(&shared));
        Ok(shared)
    }

    /// Fetches from the targets' cursors (re-assigning the consumer when they moved under it).
    /// Cursors are not moved here.
    fn fetch(
        &self,
        reader: &ReaderKey,
        targets: &[i32],
        limits: PollLimits,
    ) -> Result<Fetched, Fetch> {
        let mut wanted: BTreeMap<i32, i64> = BTreeMap::new();
        for &p in targets {
            let key = PullKey::new(reader.topic.clone(), PartitionId::number(p as u32));
            if let Some(cursor) = self.cursors.with(&reader.group, |c| c.get(&key)) {
                wanted.insert(p, cursor);
            }
        }
        let shared = self.consumer(reader).map_err(Fetch::Failed)?;
        let mut guard = shared.lock().unwrap_or_else(|p| p.into_inner());
        let slot = &mut *guard;
        if slot.positions != wanted {
            let mut assignment = TopicPartitionList::new();
            for (&p, &offset) in &wanted {
                assignment
                    .add_partition_offset(reader.topic.as_str(), p, Offset::Offset(offset))
                    .map_err(|err| Fetch::Failed(unavailable("assignment", err)))?;
            }
            slot.consumer
                .assign(&assignment)
                .map_err(|err| Fetch::Failed(unavailable("assign", err)))?;
            slot.positions = wanted.clone();
            slot.above_end.clear();
        }
        let mut by_partition: BTreeMap<i32, Vec<PolledRecord>> = BTreeMap::new();
        let (mut count, mut bytes) = (0usize, 0usize);
        let deadline = Instant::now() + FETCH_WAIT;
        while count < limits.max_records && bytes < limits.max_bytes {
            // Wait for the first record only: once one came, take what librdkafka has already
            // fetched and answer, so a record is never held back waiting for more.
            let remaining = if count == 0 {
                deadline.saturating_duration_since(Instant::now())
            } else {
                Duration::ZERO
            };
            let Some(message) = slot.consumer.poll(remaining) else {
                break;
            };
            let message = match message {
                Ok(message) => message,
                // With `auto.offset.reset=error` librdkafka reports an offset outside the log
                // as its own AUTO_OFFSET_RESET error (or passes the broker's OFFSET_OUT_OF_RANGE).
                Err(KafkaError::MessageConsumption(
                    RDKafkaErrorCode::OffsetOutOfRange | RDKafkaErrorCode::AutoOffsetReset,
                )) => {
                    // The consumer stopped fetching there; assign again after the cursors move.
                    slot.positions.clear();
                    return Err(Fetch::OutOfRange);
                }
                Err(err) => return Err(Fetch::Failed(unavailable("fetch", err))),
            };
            let p = message.partition();
            // Prefetched records from before a re-assignment, or not asked for: skip.
            let Some(expected) = slot.positions.get(&p).copied() else {
                continue;
            };
            if message.offset() < expected {
                continue;
            }
            let partition_id = PartitionId::number(p as u32);
            let body = Bytes::copy_from_slice(message.payload().unwrap_or_default());
            // Header values are bytes: kept exactly (see `ingest`).
            let headers: Vec<Header> = message
                .headers()
                .map(|headers| {
                    headers
                        .iter()
                        .map(|h| {
                            (
                                h.key.to_owned(),
                                Bytes::copy_from_slice(h.value.unwrap_or_default()),
                            )
                        })
                        .collect()
                })
                .unwrap_or_default();
            let origin = Origin {
                topic: &reader.topic,
                partition: &partition_id,
                offset: message.offset(),
                pop_ck: None,
            };
            let key = message.key().unwrap_or_default();
            bytes += body.len() + key.len();
            count += 1;
            slot.positions.insert(p, message.offset() + 1);
            let (key, ingested) = if key.len() > MAX_RECORD_KEY_BYTES {
                let reason = format!(
                    "record key of {} bytes exceeds the {MAX_RECORD_KEY_BYTES}-byte limit",
                    key.len()
                );
                (Bytes::new(), malformed(body, reason))
            } else {
                (
                    Bytes::copy_from_slice(key),
                    ingest(body, &headers, &origin, &self.limits, limits.stamping),
                )
            };
            by_partition.entry(p).or_default().push(PolledRecord {
                partition: partition_id.clone(),
                offset: message.offset(),
                key,
                timestamp_ms: message.timestamp().to_millis().unwrap_or(0),
                ack_key: None,
                ingested,
            });
        }
        let mut past_end = Vec::new();
        for (&p, &position) in &wanted {
            if by_partition.contains_key(&p) {
                slot.above_end.remove(&p);
                continue;
            }
            match cached_watermarks(&slot.consumer, reader.topic.as_str(), p) {
                Some((low, high)) if position > high => {
                    let polls = slot.above_end.entry(p).or_insert(0);
                    *polls += 1;
                    if *polls >= PAST_END_POLLS {
                        slot.above_end.remove(&p);
                        past_end.push((
                            p,
                            PastEnd {
                                partition: PartitionId::number(p as u32),
                                position,
                                log_start: low,
                                log_end: high,
                            },
                        ));
                    }
                }
                _ => {
                    slot.above_end.remove(&p);
                }
            }
        }
        Ok(Fetched {
            records: by_partition,
            past_end,
        })
    }

    /// After an out-of-range fetch: a cursor below its log start moves there (the offsets in
    /// between were lost to retention); one past the log end is reported and left alone.
    fn reresolve(&self, reader: &ReaderKey, targets: &[i32]) -> Result<Refit, StorageError> {
        let mut refit = Refit::default();
        for &p in targets {
            let range = self.range(&reader.topic, p)?;
            let key = PullKey::new(reader.topic.clone(), range.partition.clone());
            let resolution = self.cursors.with(&reader.group, |c| {
                c.resolve(&key, range.start, range.end, self.start_at)
            });
            match resolution {
                Resolution::LostToRetention { lost, .. } => refit.lost.push((p, lost)),
                Resolution::PastEnd(position) => refit.past_end.push((
                    p,
                    PastEnd {
                        partition: range.partition,
                        position,
                        log_start: range.start,
                        log_end: range.end,
                    },
                )),
                Resolution::Started(_) | Resolution::InRange(_) => {}
            }
        }
        Ok(refit)
    }
}

/// What a fetch found.
struct Fetched {
    records: BTreeMap<i32, Vec<PolledRecord>>,
    /// Partitions whose position stayed above the high watermark the broker answered with.
    past_end: Vec<(i32, PastEnd)>,
}

/// Why a fetch stopped without records.
enum Fetch {
    /// A cursor lies outside its partition's log.
    OutOfRange,
    /// The broker or client failed.
    Failed(StorageError),
}

/// What fitting the cursors into the log found.
#[derive(Default)]
struct Refit {
    lost: Vec<(i32, i64)>,
    past_end: Vec<(i32, PastEnd)>,
}

#[async_trait::async_trait]
impl Storage for KafkaStorage {
    fn backend(&self) -> &'static str {
        BACKEND
    }

    fn cursor_book(&self) -> Arc<CursorBook> {
        Arc::clone(&self.inner.cursors)
    }

    fn check_topic_name(&self, topic: &Topic) -> Result<(), StorageError> {
        let name = topic.as_str();
        let legal = |c: char| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-');
        if name == "." || name == ".." || !name.chars().all(legal) {
            return Err(StorageError::Invalid(format!(
                "topic name {name:?} is not a Kafka topic name: use [A-Za-z0-9._-], not '.' or '..'"
            )));
        }
        Ok(())
    }

    async fn create_topic(&self, topic: &Topic, partitions: u32) -> Result<bool, StorageError> {
        self.check_topic_name(topic)?;
        let count = i32::try_from(partitions)
            .map_err(|_| StorageError::Invalid("too many partitions".into()))?;
        let retention = self
            .dead_letter_retention_ms
            .map_or_else(|| "-1".to_owned(), |ms| ms.to_string());
        let mut new_topic = NewTopic::new(topic.as_str(), count, TopicReplication::Fixed(1));
        if eventmesh_common::dead_letter::is_dlq_topic(topic.as_str()) {
            // A dead letter is the one copy left of an event: the broker's default retention
            // (often 7 days) must not delete it unless configured to.
            new_topic = new_topic
                .set("retention.ms", &retention)
                .set("retention.bytes", "-1");
        }
        let results = self
            .inner
            .admin
            .create_topics(
                [&new_topic],
                &AdminOptions::new().operation_timeout(Some(CALL_TIMEOUT)),
            )
            .await
            .map_err(|err| unavailable("create topic", err))?;
        match results.into_iter().next() {
            Some(Ok(_)) => Ok(true),
            Some(Err((_, RDKafkaErrorCode::TopicAlreadyExists))) => Ok(false),
            Some(Err((_, code))) => Err(StorageError::Unavailable(format!(
                "kafka create topic {topic}: {code}"
            ))),
            None => Err(StorageError::Internal(
                "kafka create topic returned no result".into(),
            )),
        }
    }

    async fn partition_count(&self, topic: &Topic) -> Result<u32, StorageError> {
        let topic = topic.clone();
        self.blocking(move |inner| inner.partition_count(&topic))
            .await
    }

    async fn send(
        &self,
        topic: &Topic,
        key: Bytes,
        body: Bytes,
        partition: Option<PartitionId>,
    ) -> Result<Appended, StorageError> {
        self.check_topic_name(topic)?;
        let partition = partition.map(|p| partition_number(topic, &p)).transpose()?;
        let known = self.known_topics().contains(topic);
        if !known {
            if !self.producer_sees_topic(topic).await {
                return Err(StorageError::UnknownTopic(topic.to_string()));
            }
            self.known_topics().insert(topic.clone());
        }
        match self.produce(topic, &key, &body, partition).await {
            Err(StorageError::UnknownTopic(_)) if self.producer_sees_topic(topic).await => {
                // librdkafka cached "unknown" before the topic was created; its cache is
                // refreshed now, so one more try goes through.
                self.produce(topic, &key, &body, partition).await
            }
            Err(StorageError::UnknownTopic(name)) => {
                // Deleted since: ask the broker again next time.
                self.known_topics().remove(topic);
                Err(StorageError::UnknownTopic(name))
            }
            other => other,
        }
    }

    async fn send_batch(
        &self,
        topic: &Topic,
        records: Vec<NewRecord>,
    ) -> Result<Vec<Result<Appended, StorageError>>, StorageError> {
        if !self.known_topics().contains(topic) {
            // A topic not produced to yet: librdkafka's metadata cache may not know it.
            return super::send_first_alone(self, topic, records, |rest| async move {
                Ok(super::send_each(self, topic, rest).await)
            })
            .await;
        }
        let results = super::send_each(self, topic, records).await;
        super::whole_batch_unknown(topic, results)
    }

    /// The consumer's poll waits up to [`FETCH_WAIT`] for a first record.
    fn waits_in_poll(&self) -> bool {
        true
    }

    async fn poll(
        &self,
        reader: &ReaderKey,
        selection: &Selection,
        limits: PollLimits,
    ) -> Result<PolledBatch, StorageError> {
        let (reader, selection) = (reader.clone(), selection.clone());
        self.blocking(move |inner| inner.poll(&reader, &selection, limits))
            .await
    }

    async fn end_offsets(&self, topic: &Topic) -> Result<Vec<PartitionRange>, StorageError> {
        let topic = topic.clone();
        self.blocking(move |inner| {
            (0..inner.partition_count(&topic)? as i32)
                .map(|p| inner.range(&topic, p))
                .collect()
        })
        .await
    }

    async fn evict_reader(&self, reader: &ReaderKey) -> Result<(), StorageError> {
        let reader = reader.clone();
        self.blocking(move |inner| {
            let consumer = inner
                .consumers
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .remove(&reader);
            // The consumer's threads end when it is dropped, off the async workers.
            drop(consumer);
            inner.cursors.evict(&reader.group, &reader.topic);
            Ok(())
        })
        .await
    }

    /// Readers with a consumer (for tests and operators).
    fn reader_count(&self) -> usize {
        self.inner
            .consumers
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .len()
    }
}

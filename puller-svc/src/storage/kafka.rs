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
//!   `auto.offset.reset=error`: an offset outside the log is not silently reset by librdkafka;
//!   the reader re-resolves its cursors against the partition watermarks (below the log start →
//!   the log start, counting what retention removed; past the end → the configured start).
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
    Appended, CoveredRange, PartitionRange, PollLimits, PolledBatch, PolledRecord, ReaderKey,
    Storage, StorageError,
};
use crate::cursors::{CursorBook, StartAt};
use crate::ingest::{Origin, ingest};

/// The backend name used in checkpoint files.
pub const BACKEND: &str = "kafka";
/// Broker round-trip bound for metadata, watermarks and admin calls.
const CALL_TIMEOUT: Duration = Duration::from_secs(10);
/// How long one poll waits for records from the broker.
const FETCH_WAIT: Duration = Duration::from_millis(100);

fn unavailable(what: &str, err: KafkaError) -> StorageError {
    StorageError::Unavailable(format!("kafka {what}: {err}"))
}

struct ReaderConsumer {
    consumer: BaseConsumer,
    /// The next offset this consumer will hand us per partition (as assigned or advanced).
    positions: BTreeMap<i32, i64>,
}

struct Inner {
    bootstrap: String,
    instance: String,
    producer: FutureProducer,
    admin: AdminClient<DefaultClientContext>,
    metadata: BaseConsumer,
    start_at: StartAt,
    limits: FrameLimits,
    cursors: Arc<CursorBook>,
    /// One consumer per reader, each behind its own lock: readers never wait for each other.
    consumers: Mutex<HashMap<ReaderKey, Arc<Mutex<ReaderConsumer>>>>,
}

/// The Kafka backend.
#[derive(Clone)]
pub struct KafkaStorage {
    inner: Arc<Inner>,
}

fn consumer_config(bootstrap: &str, group: &str) -> ClientConfig {
    let mut config = ClientConfig::new();
    config
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
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos());
        let instance = format!("eventmesh-puller-{}-{nanos}", std::process::id());
        let producer: FutureProducer = ClientConfig::new()
            .set("bootstrap.servers", bootstrap)
            .set("acks", "all")
            .set("enable.idempotence", "false")
            .create()
            .map_err(|err| unavailable("producer", err))?;
        let admin = ClientConfig::new()
            .set("bootstrap.servers", bootstrap)
            .create()
            .map_err(|err| unavailable("admin client", err))?;
        let metadata = consumer_config(bootstrap, &format!("{instance}-metadata"))
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
                limits: FrameLimits::DEFAULT,
                cursors: Arc::new(CursorBook::new(&data_dir, BACKEND)),
                consumers: Mutex::new(HashMap::new()),
            }),
        })
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
        let consumer = consumer_config(&self.bootstrap, &group)
            .create()
            .map_err(|err| unavailable("consumer", err))?;
        Ok(ReaderConsumer {
            consumer,
            positions: BTreeMap::new(),
        })
    }

    fn poll(
        &self,
        reader: &ReaderKey,
        partition: Option<&PartitionId>,
        limits: PollLimits,
    ) -> Result<PolledBatch, StorageError> {
        self.poll_once(reader, partition, limits, true)
    }

    fn poll_once(
        &self,
        reader: &ReaderKey,
        partition: Option<&PartitionId>,
        limits: PollLimits,
        may_reresolve: bool,
    ) -> Result<PolledBatch, StorageError> {
        let targets: Vec<i32> = match partition {
            Some(partition) => {
                let number = partition_number(&reader.topic, partition)?;
                if number as u32 >= self.partition_count(&reader.topic)? {
                    return Err(StorageError::UnknownPartition {
                        topic: reader.topic.to_string(),
                        partition: partition.to_string(),
                    });
                }
                vec![number]
            }
            None => (0..self.partition_count(&reader.topic)? as i32).collect(),
        };
        // Cursors for every target, resolved against the log where unknown.
        let mut wanted: BTreeMap<i32, i64> = BTreeMap::new();
        for &p in &targets {
            let key = PullKey::new(reader.topic.clone(), PartitionId::number(p as u32));
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
            wanted.insert(p, cursor);
        }
        let shared = {
            let mut consumers = self.consumers.lock().unwrap_or_else(|p| p.into_inner());
            match consumers.get(reader) {
                Some(shared) => Arc::clone(shared),
                None => {
                    let shared = Arc::new(Mutex::new(self.new_consumer(reader)?));
                    consumers.insert(reader.clone(), Arc::clone(&shared));
                    shared
                }
            }
        };
        let mut guard = shared.lock().unwrap_or_else(|p| p.into_inner());
        let slot = &mut *guard;
        if slot.positions != wanted {
            let mut assignment = TopicPartitionList::new();
            for (&p, &offset) in &wanted {
                assignment
                    .add_partition_offset(reader.topic.as_str(), p, Offset::Offset(offset))
                    .map_err(|err| unavailable("assignment", err))?;
            }
            slot.consumer
                .assign(&assignment)
                .map_err(|err| unavailable("assign", err))?;
            slot.positions = wanted.clone();
        }
        let mut by_partition: BTreeMap<i32, Vec<PolledRecord>> = BTreeMap::new();
        let (mut count, mut bytes) = (0usize, 0usize);
        let deadline = Instant::now() + FETCH_WAIT;
        while count < limits.max_records && bytes < limits.max_bytes {
            let remaining = deadline.saturating_duration_since(Instant::now());
            let Some(message) = slot.consumer.poll(remaining) else {
                break;
            };
            let message = match message {
                Ok(message) => message,
                Err(KafkaError::MessageConsumption(RDKafkaErrorCode::OffsetOutOfRange))
                    if may_reresolve =>
                {
                    // Fit the cursors into the log again and re-assign, once per poll.
                    drop(guard);
                    self.reresolve(reader, &targets)?;
                    return self.poll_once(reader, partition, limits, false);
                }
                Err(err) => return Err(unavailable("fetch", err)),
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
            let headers: Vec<(String, String)> = message
                .headers()
                .map(|headers| {
                    headers
                        .iter()
                        .map(|h| {
                            (
                                h.key.to_owned(),
                                String::from_utf8_lossy(h.value.unwrap_or_default()).into_owned(),
                            )
                        })
                        .collect()
                })
                .unwrap_or_default();
            let origin = Origin {
                partition: &partition_id,
                offset: message.offset(),
                pop_ck: None,
            };
            bytes += body.len();
            count += 1;
            slot.positions.insert(p, message.offset() + 1);
            by_partition.entry(p).or_default().push(PolledRecord {
                partition: partition_id.clone(),
                offset: message.offset(),
                key: Bytes::copy_from_slice(message.key().unwrap_or_default()),
                timestamp_ms: message.timestamp().to_millis().unwrap_or(0),
                ack_key: None,
                ingested: ingest(body, &headers, &origin, &self.limits),
            });
        }
        drop(guard);
        let mut batch = PolledBatch::default();
        for (p, records) in by_partition {
            let Some(last) = records.last().map(|r| r.offset) else {
                continue;
            };
            let first = wanted.get(&p).copied().unwrap_or(last);
            let partition_id = PartitionId::number(p as u32);
            batch.ranges.push(CoveredRange {
                partition: partition_id.clone(),
                first,
                next: last + 1,
            });
            let key = PullKey::new(reader.topic.clone(), partition_id);
            self.cursors
                .with(&reader.group, |c| c.advance(&key, last + 1));
            batch.records.extend(records);
        }
        Ok(batch)
    }

    /// After an out-of-range fetch: fit every target cursor into its partition's log again and
    /// force a re-assignment.
    fn reresolve(&self, reader: &ReaderKey, targets: &[i32]) -> Result<(), StorageError> {
        for &p in targets {
            let range = self.range(&reader.topic, p)?;
            let key = PullKey::new(reader.topic.clone(), range.partition.clone());
            self.cursors.with(&reader.group, |c| {
                c.resolve(&key, range.start, range.end, self.start_at)
            });
        }
        let shared = self
            .consumers
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(reader)
            .cloned();
        if let Some(shared) = shared {
            shared
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .positions
                .clear();
        }
        Ok(())
    }
}

fn lite_unsupported() -> StorageError {
    StorageError::Invalid(
        "lite channels are not supported by the kafka backend (use local or rocketmq5)".into(),
    )
}

#[async_trait::async_trait]
impl Storage for KafkaStorage {
    fn backend(&self) -> &'static str {
        BACKEND
    }

    fn cursor_book(&self) -> Arc<CursorBook> {
        Arc::clone(&self.inner.cursors)
    }

    async fn create_topic(&self, topic: &Topic, partitions: u32) -> Result<bool, StorageError> {
        let count = i32::try_from(partitions)
            .map_err(|_| StorageError::Invalid("too many partitions".into()))?;
        let new_topic = NewTopic::new(topic.as_str(), count, TopicReplication::Fixed(1));
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
        let partition = partition.map(|p| partition_number(topic, &p)).transpose()?;
        match self.produce(topic, &key, &body, partition).await {
            Err(StorageError::UnknownTopic(_)) if self.producer_sees_topic(topic).await => {
                // librdkafka cached "unknown" before the topic was created; its cache is
                // refreshed now, so one more try goes through.
                self.produce(topic, &key, &body, partition).await
            }
            other => other,
        }
    }

    async fn poll(
        &self,
        reader: &ReaderKey,
        partition: Option<&PartitionId>,
        limits: PollLimits,
    ) -> Result<PolledBatch, StorageError> {
        let (reader, partition) = (reader.clone(), partition.cloned());
        self.blocking(move |inner| inner.poll(&reader, partition.as_ref(), limits))
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

    async fn create_lite(&self, _parent: &Topic, _lite: &str) -> Result<PartitionId, StorageError> {
        Err(lite_unsupported())
    }

    async fn send_lite(
        &self,
        _parent: &Topic,
        _lite: &str,
        _body: Bytes,
    ) -> Result<Appended, StorageError> {
        Err(lite_unsupported())
    }

    async fn pull_lite(
        &self,
        _reader: &ReaderKey,
        _lite: &str,
        _limits: PollLimits,
    ) -> Result<PolledBatch, StorageError> {
        Err(lite_unsupported())
    }
}

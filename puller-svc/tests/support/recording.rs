//! `RecordingStorage`: a real backend wrapped so a test sees, in order, every poll, send and
//! broker ACK the puller made through it. It changes nothing: every call goes to the backend
//! and its answer comes back as it was. Claims about the broker come from the broker itself.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use bytes::Bytes;
use eventmesh_common::keys::{PartitionId, Topic};
use puller_svc::cursors::{Alignment, CursorBook};
use puller_svc::storage::{
    AckPulledOutcome, Appended, BrokerStorageReport, NewRecord, PartitionRange, PollLimits,
    PolledBatch, ReaderKey, Selection, Storage, StorageError,
};

/// One call the puller made to the backend.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Call {
    /// A poll of `topic` by `group`, and the `(partition, offset)` of each record it returned.
    Poll {
        group: Option<String>,
        topic: String,
        records: Vec<(String, i64)>,
    },
    /// A poll that failed, and why.
    PollFailed {
        group: Option<String>,
        topic: String,
        error: String,
    },
    /// A send and where it landed (`None`: it failed).
    Send {
        topic: String,
        landed: Option<(String, i64)>,
    },
    /// A broker ACK and its outcome (`None`: it failed).
    AckPulled {
        group: Option<String>,
        key: String,
        outcome: Option<AckPulledOutcome>,
    },
}

/// The recording wrapper.
pub struct RecordingStorage {
    inner: Arc<dyn Storage>,
    calls: Mutex<Vec<Call>>,
    /// Polls that returned no record (not in `calls`: a waiting reader makes many).
    empty_polls: std::sync::atomic::AtomicU64,
    /// The `(partition, offset)` of each polled record that carried a broker-ACK key.
    ack_keys: Mutex<HashMap<String, (String, i64)>>,
}

impl RecordingStorage {
    /// Wraps `inner`.
    pub fn new(inner: Arc<dyn Storage>) -> Arc<RecordingStorage> {
        Arc::new(RecordingStorage {
            inner,
            calls: Mutex::new(Vec::new()),
            empty_polls: std::sync::atomic::AtomicU64::new(0),
            ack_keys: Mutex::new(HashMap::new()),
        })
    }

    /// Every call so far, in order.
    pub fn calls(&self) -> Vec<Call> {
        self.calls.lock().unwrap().clone()
    }

    /// The `(partition, offset)` of every record polled so far, in order.
    pub fn polled(&self) -> Vec<(String, i64)> {
        self.calls()
            .into_iter()
            .flat_map(|call| match call {
                Call::Poll { records, .. } => records,
                _ => Vec::new(),
            })
            .collect()
    }

    /// The `(partition, offset)` of the polled record whose broker-ACK key is `ack_key`.
    pub fn acked_record(&self, ack_key: &str) -> Option<(String, i64)> {
        self.ack_keys.lock().unwrap().get(ack_key).cloned()
    }

    /// What the puller did, for a failing test's message: every call in order, then how many
    /// polls found nothing.
    pub fn story(&self) -> String {
        let mut story: Vec<String> = self.calls().iter().map(|c| format!("{c:?}")).collect();
        story.push(format!(
            "and {} polls that found nothing",
            self.empty_polls.load(std::sync::atomic::Ordering::Relaxed)
        ));
        story.join("\n")
    }

    fn record(&self, call: Call) {
        self.calls.lock().unwrap().push(call);
    }
}

fn landed(result: &Result<Appended, StorageError>) -> Option<(String, i64)> {
    result
        .as_ref()
        .ok()
        .map(|a| (a.partition.to_string(), a.offset))
}

#[async_trait::async_trait]
impl Storage for RecordingStorage {
    fn backend(&self) -> &'static str {
        self.inner.backend()
    }

    fn check_topic_name(&self, topic: &Topic) -> Result<(), StorageError> {
        self.inner.check_topic_name(topic)
    }

    async fn create_topic(&self, topic: &Topic, partitions: u32) -> Result<bool, StorageError> {
        self.inner.create_topic(topic, partitions).await
    }

    async fn partition_count(&self, topic: &Topic) -> Result<u32, StorageError> {
        self.inner.partition_count(topic).await
    }

    async fn send(
        &self,
        topic: &Topic,
        key: Bytes,
        body: Bytes,
        partition: Option<PartitionId>,
    ) -> Result<Appended, StorageError> {
        let result = self.inner.send(topic, key, body, partition).await;
        self.record(Call::Send {
            topic: topic.to_string(),
            landed: landed(&result),
        });
        result
    }

    async fn send_batch(
        &self,
        topic: &Topic,
        records: Vec<NewRecord>,
    ) -> Result<Vec<Result<Appended, StorageError>>, StorageError> {
        let results = self.inner.send_batch(topic, records).await?;
        for result in &results {
            self.record(Call::Send {
                topic: topic.to_string(),
                landed: landed(result),
            });
        }
        Ok(results)
    }

    async fn poll(
        &self,
        reader: &ReaderKey,
        selection: &Selection,
        limits: PollLimits,
    ) -> Result<PolledBatch, StorageError> {
        let batch = match self.inner.poll(reader, selection, limits).await {
            Ok(batch) => batch,
            Err(err) => {
                self.record(Call::PollFailed {
                    group: reader.group.as_ref().map(|g| g.to_string()),
                    topic: reader.topic.to_string(),
                    error: err.to_string(),
                });
                return Err(err);
            }
        };
        if batch.records.is_empty() {
            self.empty_polls
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        } else {
            let mut keys = self.ack_keys.lock().unwrap();
            for record in &batch.records {
                if let Some(key) = &record.ack_key {
                    keys.insert(key.clone(), (record.partition.to_string(), record.offset));
                }
            }
            drop(keys);
            self.record(Call::Poll {
                group: reader.group.as_ref().map(|g| g.to_string()),
                topic: reader.topic.to_string(),
                records: batch
                    .records
                    .iter()
                    .map(|r| (r.partition.to_string(), r.offset))
                    .collect(),
            });
        }
        Ok(batch)
    }

    fn appends(&self, topic: &Topic) -> Option<tokio::sync::watch::Receiver<u64>> {
        self.inner.appends(topic)
    }

    fn waits_in_poll(&self) -> bool {
        self.inner.waits_in_poll()
    }

    async fn ack_pulled(
        &self,
        reader: &ReaderKey,
        ack_key: &str,
    ) -> Result<AckPulledOutcome, StorageError> {
        let result = self.inner.ack_pulled(reader, ack_key).await;
        self.record(Call::AckPulled {
            group: reader.group.as_ref().map(|g| g.to_string()),
            key: ack_key.to_owned(),
            outcome: result.as_ref().ok().cloned(),
        });
        result
    }

    fn cursor_book(&self) -> Arc<CursorBook> {
        self.inner.cursor_book()
    }

    async fn align_pull_offset(
        &self,
        reader: &ReaderKey,
        partition: &PartitionId,
        watermark: Option<i64>,
    ) -> Result<Alignment, StorageError> {
        self.inner
            .align_pull_offset(reader, partition, watermark)
            .await
    }

    async fn position_pull_offset(
        &self,
        reader: &ReaderKey,
        partition: &PartitionId,
        next: i64,
    ) -> Result<(), StorageError> {
        self.inner
            .position_pull_offset(reader, partition, next)
            .await
    }

    async fn end_offsets(&self, topic: &Topic) -> Result<Vec<PartitionRange>, StorageError> {
        self.inner.end_offsets(topic).await
    }

    async fn describe_broker_storage(
        &self,
        topic: &Topic,
    ) -> Result<BrokerStorageReport, StorageError> {
        self.inner.describe_broker_storage(topic).await
    }

    async fn cursors(&self, reader: &ReaderKey) -> Result<Vec<(PartitionId, i64)>, StorageError> {
        self.inner.cursors(reader).await
    }

    async fn evict_reader(&self, reader: &ReaderKey) -> Result<(), StorageError> {
        self.inner.evict_reader(reader).await
    }

    fn reader_count(&self) -> usize {
        self.inner.reader_count()
    }

    async fn checkpoint(&self) -> Result<(), StorageError> {
        self.inner.checkpoint().await
    }

    async fn create_lite(&self, parent: &Topic, lite: &str) -> Result<PartitionId, StorageError> {
        self.inner.create_lite(parent, lite).await
    }

    async fn send_lite(
        &self,
        parent: &Topic,
        lite: &str,
        body: Bytes,
    ) -> Result<Appended, StorageError> {
        self.inner.send_lite(parent, lite, body).await
    }

    async fn pull_lite(
        &self,
        reader: &ReaderKey,
        lite: &str,
        limits: PollLimits,
    ) -> Result<PolledBatch, StorageError> {
        self.inner.pull_lite(reader, lite, limits).await
    }
}

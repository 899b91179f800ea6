//! The `rocketmq4` backend: RocketMQ 4.x semantics, PULL from the puller's own cursors.
//!
//! * Reads: the stateless classic pull (`DefaultMQPullConsumer::pull(queue, "*", offset,
//!   max)`) at each reader's cursor, under **one fixed consumer group**
//!   ([`PULL_GROUP`](super::rocketmq::names::PULL_GROUP)) that never commits an offset: the
//!   classic pull sends `commitOffset=false` and persists nothing, and we never call an offset
//!   update, so the broker holds no consume offset for it. Groups are ours, not the broker's:
//!   every reader (group × topic) has its own cursors.
//! * Cursors, ranges, long polling and failing brokers as every RocketMQ read
//!   ([`reads`](super::rocketmq::reads)); a batch's range in a queue is `[cursor,
//!   nextBeginOffset)`, and the broker's `OFFSET_ILLEGAL` carries the queue's min and max.
//! * Sends: an explicit queue, else the queue the key's Java hash picks, else round robin
//!   ([`RocketMqClient::pick_queue`]). Topics are created on every master of the configured
//!   cluster with `partitions` queues per broker.
//! * No broker ACK, no lite channels (they need `rocketmq5` or the local backend).

// `DefaultMQPullConsumer` is deprecated in favour of the lite pull consumer, which keeps its
// own positions and commits them; the stateless classic pull is what our own cursors need.
#![allow(deprecated)]

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use eventmesh_common::frame::FrameLimits;
use eventmesh_common::keys::Topic;
use rocketmq_client_rust::{DefaultMQPullConsumer, MessageSelector, PullOptions};
use rocketmq_model::result::PullStatus;

use super::rocketmq::client::{
    CALL_TIMEOUT, QueueRef, RocketMqClient, RocketMqSettings, unavailable,
};
use super::rocketmq::reads::{Fetched, QueueFetch, QueueReads, rocketmq_storage};
use super::rocketmq::{message, names};
use super::{PolledRecord, ReaderKey, StorageError};
use crate::cursors::StartAt;

/// The backend name used in checkpoint files.
pub const BACKEND: &str = "rocketmq4";
/// Most messages one pull asks for (the broker's own default cap is 32).
const MAX_PULL: usize = 32;
/// Bound of one pull, broker wait included.
const PULL_TIMEOUT: Duration = Duration::from_secs(3);

/// Pulls with the classic pull consumer (started on first use).
struct Puller {
    client: Arc<RocketMqClient>,
    consumer: tokio::sync::OnceCell<DefaultMQPullConsumer>,
    limits: FrameLimits,
}

struct Inner {
    reads: QueueReads,
    puller: Puller,
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
                reads: QueueReads::new(Arc::clone(&client), BACKEND, data_dir.into(), start_at),
                puller: Puller {
                    client,
                    consumer: tokio::sync::OnceCell::new(),
                    limits: FrameLimits::DEFAULT,
                },
            }),
        })
    }

    /// The shared client (for operator checks).
    pub fn client(&self) -> &Arc<RocketMqClient> {
        &self.inner.reads.client
    }
}

impl Puller {
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

    /// Pulls one queue from `offset`; with `wait`, the broker holds an empty pull that long.
    async fn pull(
        &self,
        topic: &Topic,
        queue: &QueueRef,
        offset: i64,
        max: usize,
        wait: Option<Duration>,
    ) -> Result<Fetched, StorageError> {
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
                        Fetched::Found { records, next, min }
                    }
                    PullStatus::NoNewMsg | PullStatus::NoMatchedMsg => Fetched::Empty { next, min },
                    PullStatus::OffsetIllegal => Fetched::Illegal { min, max },
                })
            })
            .await
    }
}

#[async_trait::async_trait]
impl QueueFetch for Puller {
    async fn fetch(
        &self,
        reader: &ReaderKey,
        queue: &QueueRef,
        cursor: i64,
        max: usize,
        wait: Option<Duration>,
    ) -> Result<Fetched, StorageError> {
        self.pull(&reader.topic, queue, cursor, max, wait).await
    }
}

rocketmq_storage!(RocketMq4Storage, BACKEND, puller, {
    async fn evict_reader(&self, reader: &ReaderKey) -> Result<(), StorageError> {
        self.inner.reads.evict(reader).await
    }
});

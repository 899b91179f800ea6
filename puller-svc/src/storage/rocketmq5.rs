//! The `rocketmq5` backend: RocketMQ 5.x semantics, POP with the broker ACK deferred to the
//! client's ACK.
//!
//! * Reads: POP at each queue's broker (`queue_id` explicit), up to [`MAX_POPS`] messages per
//!   POP, sent and decoded here (the 1.0.0 client cannot decode the broker's empty answer nor
//!   parse a POP of several messages from one queue). Every record's ACK key is its POP
//!   receipt (the broker's check-point info) with the epoch it was popped in.
//! * **The cursors are ours**, as on `rocketmq4`: a popped message is handed on only when its
//!   offset is the reader's cursor. One broker consumer group per subscription group at a
//!   time — `<pop group>-<epoch>` ([`Epochs`]): a new epoch (a new broker group, positioned
//!   at the cursor) starts whenever the broker would pop elsewhere than the cursor — a puller
//!   that rewound to the ACK watermark at boot, a dispatcher that re-attached lower, a broker
//!   that restarted — and after [`REALIGN_EVERY`] POPs of one queue. So nothing un-ACKed is
//!   skipped although broker 1.0.0 never revives an un-ACKed POP and cannot move a POP
//!   position back (docs/ROCKETMQ.md), and no queue reaches the broker's 20,000-batch stall.
//! * The broker ACK: the dispatcher forwards each settled record's key after its watermark is
//!   durable (`ack_pulled`); it goes to the broker that served the POP, under the epoch's
//!   group. A receipt the broker does not know (its epoch ended) is `UnknownKey`: nothing
//!   depends on it. A message revived from a retry topic (a broker that revives) is ACKed at
//!   once and dropped: our cursors read it again.
//! * Cursors, ranges, long polling and failing brokers as every RocketMQ read
//!   ([`reads`](super::rocketmq::reads)); sends and topics as `rocketmq4`.
//! * Lite channels: not on RocketMQ 1.0.0 (its ACK ignores the lite topic and the client
//!   exposes no lite POP): INVALID_ARGUMENT, as on `kafka` and `rocketmq4`.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use cheetah_string::CheetahString;
use eventmesh_common::frame::FrameLimits;
use eventmesh_common::keys::Topic;
use rocketmq_client_rust::{AckStatus, ClientInstanceHandle};
use rocketmq_model::common::message::MessageConst;
use rocketmq_model::common::message::MessageTrait;
use rocketmq_model::common::message::message_ext::MessageExt;
use rocketmq_protocol::common::message::message_decoder;
use rocketmq_protocol::protocol::RemotingSerializable;
use rocketmq_protocol::protocol::header::ack_message_request_header::AckMessageRequestHeader;
use rocketmq_protocol::protocol::header::delete_subscription_group_request_header::DeleteSubscriptionGroupRequestHeader;
use rocketmq_protocol::protocol::header::empty_header::EmptyHeader;
use rocketmq_protocol::protocol::header::extra_info_util::ExtraInfoUtil;
use rocketmq_protocol::protocol::header::namesrv::topic_operation_header::TopicRequestHeader as PopTopicHeader;
use rocketmq_protocol::protocol::header::pop_message_request_header::PopMessageRequestHeader;
use rocketmq_protocol::protocol::header::reset_offset_request_header::ResetOffsetRequestHeader;
use rocketmq_protocol::protocol::subscription::subscription_group_config::SubscriptionGroupConfig;
use rocketmq_protocol::{RemotingCommand, RequestCode, RpcRequestHeader};

use super::rocketmq::client::{
    CALL_TIMEOUT, QueueRef, RocketMqClient, RocketMqSettings, SUCCESS, broker_header, unavailable,
};
use super::rocketmq::epochs::{Epochs, QueuePosition, ReaderEpoch};
use super::rocketmq::reads::{Fetched, QueueFetch, QueueReads, rocketmq_storage};
use super::rocketmq::{message, names};
use super::{AckPulledOutcome, PolledRecord, ReaderKey, StorageError};
use crate::cursors::StartAt;

/// The backend name used in checkpoint files.
pub const BACKEND: &str = "rocketmq5";
/// Most messages one POP asks for (the broker's own cap).
pub const MAX_POPS: usize = 32;
/// POPs of one queue after which the reader moves to a new epoch: broker 1.0.0 keeps a queue
/// of uncommitted check points per group and queue and stops serving the queue once 20,000
/// accumulate; only a new group (or a broker restart) clears it.
pub const REALIGN_EVERY: u64 = 10_000;
/// Default invisible time of a popped message: how long a broker that revives would wait for
/// our ACK before re-delivering it through the group's retry topic (longer than a delivery
/// lives under the dispatcher's defaults, so a revived copy is rare; it is dropped anyway).
pub const DEFAULT_INVISIBLE_TIME: Duration = Duration::from_secs(300);
/// The broker's answers to a POP that found nothing.
const POLLING_FULL: i32 = 209;
const POLLING_TIMEOUT: i32 = 210;
const PULL_NOT_FOUND: i32 = 19;

/// The POP/ACK settings.
#[derive(Debug, Clone)]
pub struct PopSettings {
    /// Invisible time asked with every POP.
    pub invisible_time: Duration,
    /// POPs of one queue after which a reader starts a new epoch ([`REALIGN_EVERY`]; lower
    /// only to test the switch).
    pub realign_every: u64,
}

impl Default for PopSettings {
    fn default() -> Self {
        PopSettings {
            invisible_time: DEFAULT_INVISIBLE_TIME,
            realign_every: REALIGN_EVERY,
        }
    }
}

/// One message a POP brought.
enum Popped {
    /// A message of the topic: its queue offset, and the record to hand on.
    Message(i64, Box<PolledRecord>),
    /// A message revived from the retry topic, already ACKed.
    Revived,
}

/// Pops queues for readers, keeping the brokers' POP positions on our cursors.
struct Popper {
    client: Arc<RocketMqClient>,
    settings: PopSettings,
    limits: FrameLimits,
    epochs: Epochs,
}

/// The RocketMQ 5.x backend.
#[derive(Clone)]
pub struct RocketMq5Storage {
    inner: Arc<Inner>,
}

struct Inner {
    reads: QueueReads,
    popper: Popper,
}

impl RocketMq5Storage {
    /// A backend for the cluster `settings` name; checkpoints live in `data_dir`. Nothing is
    /// contacted yet.
    pub async fn new(
        settings: RocketMqSettings,
        pop: PopSettings,
        data_dir: impl Into<PathBuf>,
        start_at: StartAt,
    ) -> Result<Self, StorageError> {
        let client = Arc::new(RocketMqClient::new(settings).await?);
        let data_dir = data_dir.into();
        Ok(RocketMq5Storage {
            inner: Arc::new(Inner {
                reads: QueueReads::new(Arc::clone(&client), BACKEND, data_dir.clone(), start_at),
                popper: Popper {
                    client,
                    settings: pop,
                    limits: FrameLimits::DEFAULT,
                    epochs: Epochs::new(data_dir),
                },
            }),
        })
    }

    /// The shared client (for operator checks).
    pub fn client(&self) -> &Arc<RocketMqClient> {
        &self.inner.reads.client
    }
}

fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

/// The broker ACK of one receipt of `topic` for `pop_group`: under the topic the receipt was
/// popped from — the POP retry topic (`%RETRY%<group>_<topic>`) for a revived message — at its
/// queue and offset; with the broker that served the POP. `None`: not a receipt.
fn ack_header(
    pop_group: &str,
    topic: &str,
    receipt: &str,
) -> Option<(String, AckMessageRequestHeader)> {
    let info = ExtraInfoUtil::parse_ack_extra_info(receipt).ok()?;
    let real_topic = ExtraInfoUtil::get_real_topic_with_retry(topic, pop_group, info.retry).ok()?;
    let header = AckMessageRequestHeader {
        consumer_group: pop_group.into(),
        topic: real_topic.into(),
        queue_id: info.queue_id,
        extra_info: receipt.into(),
        offset: info.queue_offset,
        lite_topic: None,
        topic_request_header: broker_header(info.broker_name),
    };
    Some((info.broker_name.to_owned(), header))
}

/// A POP of up to `max` messages of queue `queue_id` of `topic` at `broker` for `pop_group`,
/// not held at the broker; a new group starts at the queue's minimum (never used by the
/// backend: a queue is reset to the cursor before its first POP).
pub fn pop_request(
    pop_group: &str,
    topic: &str,
    broker: &str,
    queue_id: u32,
    max: u32,
    invisible_time: Duration,
) -> PopMessageRequestHeader {
    PopMessageRequestHeader {
        consumer_group: pop_group.into(),
        topic: topic.into(),
        queue_id: queue_id as i32,
        max_msg_nums: max,
        invisible_time: invisible_time.as_millis() as u64,
        poll_time: 0,
        born_time: now_ms(),
        init_mode: 0,
        exp_type: Some("TAG".into()),
        exp: Some("*".into()),
        order: Some(false),
        attempt_id: None,
        topic_request_header: Some(PopTopicHeader {
            lo: None,
            rpc: Some(RpcRequestHeader {
                broker_name: Some(broker.into()),
                ..RpcRequestHeader::default()
            }),
        }),
    }
}

/// The receipt a message revived from the POP retry topic carries (`POP_CK`, set by the broker
/// only there); `None` for a message popped at the reader's position.
fn revived_receipt(message: &MessageExt) -> Option<CheetahString> {
    message.property(&CheetahString::from_static_str(
        MessageConst::PROPERTY_POP_CK,
    ))
}

/// Sends one broker ACK of `topic` ([`ack_header`]) to the broker at `addr`.
async fn ack_receipt(
    handle: Arc<ClientInstanceHandle>,
    addr: CheetahString,
    topic: String,
    header: AckMessageRequestHeader,
) -> Result<AckPulledOutcome, StorageError> {
    let (queue_id, offset) = (header.queue_id, header.offset);
    let answer = handle
        .ack_message(&addr, header, CALL_TIMEOUT.as_millis() as u64)
        .await
        .map_err(|err| unavailable("ack", &err))?;
    match answer.status() {
        AckStatus::Ok => Ok(AckPulledOutcome::Acked),
        // The client folds every broker refusal into NOT_EXIST: the broker does not know the
        // receipt (the message left the queue's range, or its checkpoint went with a reset).
        // Nothing depends on it — our cursors decide what is read again — so it is not retried.
        AckStatus::NotExist => {
            tracing::debug!(%topic, queue_id, offset, "the broker does not know this POP receipt");
            Ok(AckPulledOutcome::UnknownKey)
        }
    }
}

impl Popper {
    /// The address of `broker`'s master in `topic`'s route.
    async fn master(&self, topic: &Topic, broker: &str) -> Result<CheetahString, StorageError> {
        let route = self.client.route(topic).await?;
        Ok(route.master(broker)?.into())
    }

    /// Pops up to `max` messages of `queue` for `pop_group`, waiting up to `wait` for one.
    ///
    /// Sent as a raw request and decoded here: the 1.0.0 client fails to decode the broker's
    /// empty answer (code 210 carries no response header) and to parse a POP of several
    /// messages from one queue. The receipt of each message is built as the client would
    /// (`ExtraInfoUtil`: the batch's start offset, POP time, invisible time, revive queue,
    /// broker, queue, offset).
    async fn pop(
        &self,
        pop_group: &str,
        epoch: u64,
        topic: &Topic,
        queue: &QueueRef,
        max: usize,
        wait: Option<Duration>,
    ) -> Result<Vec<Popped>, StorageError> {
        let addr = self.master(topic, &queue.broker).await?;
        let poll = wait.unwrap_or(Duration::ZERO);
        let header = pop_request(
            pop_group,
            topic.as_str(),
            &queue.broker,
            queue.queue_id,
            max.clamp(1, MAX_POPS) as u32,
            self.settings.invisible_time,
        );
        let header = PopMessageRequestHeader {
            poll_time: poll.as_millis() as u64,
            ..header
        };
        let lane = self.client.lane().await?;
        let handle = lane.handle();
        let (broker, topic_name) = (queue.broker.clone(), topic.clone());
        let (partition, limits) = (queue.partition.clone(), self.limits);
        let timeout = poll + CALL_TIMEOUT;
        let mut answer = self
            .client
            .call("pop", timeout + Duration::from_secs(1), async move {
                let request =
                    RemotingCommand::create_request_command(RequestCode::PopMessage, header);
                handle
                    .invoke_remoting(&addr, request, timeout.as_millis() as u64)
                    .await
                    .map_err(|err| unavailable("pop", &err))
            })
            .await?;
        match answer.code() {
            SUCCESS => {}
            POLLING_FULL | POLLING_TIMEOUT | PULL_NOT_FOUND => return Ok(Vec::new()),
            code => {
                return Err(StorageError::Unavailable(format!(
                    "the broker refused a POP of {topic} {}: code {code} {}",
                    queue.partition,
                    answer.remark().map(|r| r.as_str()).unwrap_or("")
                )));
            }
        }
        let field = |name: &str| -> Option<String> {
            answer
                .ext_fields()
                .and_then(|fields| fields.get(&CheetahString::from(name)))
                .map(|v| v.to_string())
        };
        let number = |name: &str| -> Result<i64, StorageError> {
            field(name)
                .and_then(|v| v.parse::<i64>().ok())
                .ok_or_else(|| {
                    StorageError::Internal(format!("a POP answer without a valid {name}"))
                })
        };
        let (pop_time, invisible_time, revive_qid) = (
            number("popTime")?,
            number("invisibleTime")?,
            number("reviveQid")?,
        );
        let starts = ExtraInfoUtil::parse_start_offset_info(
            field("startOffsetInfo").as_deref().unwrap_or(""),
        )
        .map_err(|err| StorageError::Internal(format!("a POP answer's startOffsetInfo: {err}")))?;
        let mut body = answer.take_body().unwrap_or_default();
        let messages = message_decoder::decodes_batch(&mut body, true, true);
        let mut popped = Vec::with_capacity(messages.len());
        for message in messages {
            if let Some(receipt) = revived_receipt(&message) {
                let ack = self
                    .ack(pop_group, topic, receipt.as_str())
                    .await
                    .unwrap_or_else(|err| {
                        tracing::warn!(%topic, %err, "ACK of a revived POP message failed");
                        AckPulledOutcome::UnknownKey
                    });
                tracing::debug!(%topic, ?ack, "dropped a message revived from the POP retry topic (our cursors re-read)");
                popped.push(Popped::Revived);
                continue;
            }
            let offset = message.queue_offset();
            let start_key = ExtraInfoUtil::get_start_offset_info_map_key(
                message.topic().as_str(),
                message.queue_id() as i64,
            );
            let start = starts.get(&start_key).copied().unwrap_or(offset);
            let receipt = ExtraInfoUtil::build_extra_info_with_offset(
                start,
                pop_time,
                invisible_time,
                revive_qid as i32,
                message.topic().as_str(),
                &broker,
                message.queue_id(),
                offset,
            );
            let record = message::record(
                &topic_name,
                &partition,
                offset,
                &message,
                Some(Epochs::ack_key(epoch, &receipt)),
                &limits,
            );
            popped.push(Popped::Message(offset, Box::new(record)));
        }
        Ok(popped)
    }

    /// ACKs one receipt of `topic` for `pop_group` at the broker that served its POP.
    async fn ack(
        &self,
        pop_group: &str,
        topic: &Topic,
        receipt: &str,
    ) -> Result<AckPulledOutcome, StorageError> {
        let Some((broker, header)) = ack_header(pop_group, topic.as_str(), receipt) else {
            return Ok(AckPulledOutcome::UnknownKey);
        };
        let addr = self.master(topic, &broker).await?;
        let lane = self.client.lane().await?;
        let handle = lane.handle();
        self.client
            .call(
                "ack",
                CALL_TIMEOUT + Duration::from_secs(1),
                ack_receipt(handle, addr, topic.to_string(), header),
            )
            .await
    }

    /// Sets the POP position of `queue` in `group` (a group that has not popped it yet: a
    /// broker that popped it already keeps its own, see [`Epochs`]) to `offset`.
    async fn set_position(
        &self,
        group: &str,
        topic: &Topic,
        queue: &QueueRef,
        offset: i64,
    ) -> Result<(), StorageError> {
        let addr = self.master(topic, &queue.broker).await?;
        let request = RemotingCommand::create_request_command(
            RequestCode::InvokeBrokerToResetOffset,
            ResetOffsetRequestHeader {
                topic: topic.as_str().into(),
                group: group.into(),
                queue_id: queue.queue_id as i32,
                offset: Some(offset),
                timestamp: 0,
                is_force: true,
                topic_request_header: broker_header(&queue.broker),
            },
        );
        let what = format!(
            "setting of the POP position of {group} on {topic} {} to {offset}",
            queue.partition
        );
        self.client.admin(&what, addr, request).await.map(drop)
    }

    /// Creates the broker group `group` on `queue`'s broker.
    async fn create_group(
        &self,
        group: &str,
        topic: &Topic,
        broker: &str,
    ) -> Result<(), StorageError> {
        let addr = self.master(topic, broker).await?;
        let config = SubscriptionGroupConfig::new(group.into())
            .encode()
            .map_err(|err| StorageError::Internal(format!("rocketmq group config: {err}")))?;
        let request = RemotingCommand::create_request_command(
            RequestCode::UpdateAndCreateSubscriptionGroup,
            EmptyHeader {},
        )
        .set_body(config);
        let what = format!("creation of the POP group {group} on {broker}");
        self.client.admin(&what, addr, request).await.map(drop)
    }

    /// Deletes the broker group `group` (and its offsets) on `broker`; one that does not exist
    /// is fine.
    async fn delete_group(
        &self,
        group: &str,
        topic: &Topic,
        broker: &str,
    ) -> Result<(), StorageError> {
        let addr = self.master(topic, broker).await?;
        let request = RemotingCommand::create_request_command(
            RequestCode::DeleteSubscriptionGroup,
            DeleteSubscriptionGroupRequestHeader {
                group_name: group.into(),
                clean_offset: true,
                rpc_request_header: None,
            },
        );
        let what = format!("deletion of the POP group {group} on {broker}");
        match self.client.admin(&what, addr, request).await.map(drop) {
            Err(StorageError::Unavailable(text)) if text.contains(" code 26 ") => Ok(()),
            other => other,
        }
    }

    /// Ends `reader`'s epoch (if any) and starts a fresh one: recorded first, so a crash
    /// from here on finds it; the previous epoch's group is deleted (best effort: a group
    /// left behind only holds a name).
    async fn next_epoch(
        &self,
        reader: &ReaderKey,
        base: &str,
        state: &mut ReaderEpoch,
    ) -> Result<(), StorageError> {
        let previous = match state.epoch {
            0 => self.epochs.recorded(reader).await?,
            epoch => Some(epoch),
        };
        let epoch = self.epochs.fresh();
        self.epochs.record(reader, Some(epoch)).await?;
        let brokers = std::mem::take(&mut state.brokers);
        *state = ReaderEpoch {
            epoch,
            ..ReaderEpoch::default()
        };
        tracing::info!(topic = %reader.topic, group = %Epochs::group_name(base, epoch), ?previous, "POP group epoch started");
        if let Some(previous) = previous {
            let old = Epochs::group_name(base, previous);
            // An earlier process's epoch may exist on any broker of the topic.
            let brokers: Vec<String> = match brokers.is_empty() {
                false => brokers.into_iter().collect(),
                true => self
                    .client
                    .route(&reader.topic)
                    .await?
                    .masters
                    .keys()
                    .cloned()
                    .collect(),
            };
            for broker in brokers {
                if let Err(err) = self.delete_group(&old, &reader.topic, &broker).await {
                    tracing::warn!(group = %old, %broker, %err, "an ended POP group epoch was not deleted");
                }
            }
        }
        Ok(())
    }

    /// Ends `reader`'s epoch for good (the reader is evicted).
    async fn end(&self, reader: &ReaderKey) -> Result<(), StorageError> {
        let Some(state) = self.epochs.forget(reader) else {
            return Ok(());
        };
        let state = state.lock().await;
        if state.epoch == 0 {
            return Ok(());
        }
        let group = Epochs::group_name(&names::pop_group(reader.group.as_ref())?, state.epoch);
        for broker in &state.brokers {
            if let Err(err) = self.delete_group(&group, &reader.topic, broker).await {
                tracing::warn!(%group, %broker, %err, "an evicted reader's POP group was not deleted");
            }
        }
        self.epochs.record(reader, None).await
    }
}

#[async_trait::async_trait]
impl QueueFetch for Popper {
    async fn fetch(
        &self,
        reader: &ReaderKey,
        queue: &QueueRef,
        cursor: i64,
        max: usize,
        wait: Option<Duration>,
    ) -> Result<Fetched, StorageError> {
        let topic = &reader.topic;
        let base = names::pop_group(reader.group.as_ref())?;
        let state = self.epochs.state(reader);
        let (group, epoch) = {
            let mut state = state.lock().await;
            // The broker pops on from where it stands: a cursor set anywhere else (a rewind
            // to the watermark, a lower attach) needs a new epoch, as a worn queue does.
            let elsewhere = state
                .positioned
                .get(&queue.partition)
                .is_some_and(|at| at.next != cursor || at.pops >= self.settings.realign_every);
            if state.epoch == 0 || state.stale || elsewhere {
                self.next_epoch(reader, &base, &mut state).await?;
            }
            let group = Epochs::group_name(&base, state.epoch);
            if !state.positioned.contains_key(&queue.partition) {
                let (min, max) = self.client.queue_range(topic, queue).await?;
                if cursor < min || cursor > max {
                    return Ok(Fetched::Illegal { min, max });
                }
                if !state.brokers.contains(&queue.broker) {
                    self.create_group(&group, topic, &queue.broker).await?;
                    state.brokers.insert(queue.broker.clone());
                }
                self.set_position(&group, topic, queue, cursor).await?;
                state.positioned.insert(
                    queue.partition.clone(),
                    QueuePosition {
                        next: cursor,
                        pops: 0,
                    },
                );
                tracing::debug!(%topic, partition = %queue.partition, %group, cursor, "POP position set to the cursor");
            }
            (group, state.epoch)
        };
        let mut records = Vec::new();
        let mut next = cursor;
        let mut disagreed = false;
        for popped in self.pop(&group, epoch, topic, queue, max, wait).await? {
            match popped {
                Popped::Revived => continue,
                Popped::Message(offset, record) if offset == next => {
                    records.push(*record);
                    next += 1;
                }
                Popped::Message(offset, _) => {
                    // The broker's position is not our cursor (the cursor was rewound, or
                    // the broker restarted): the epoch ends and the next one starts at the
                    // cursor. What was popped from here on is popped again in it.
                    tracing::debug!(%topic, partition = %queue.partition, %group, offset, expected = next, "POP answered another offset than the cursor; a new epoch starts");
                    disagreed = true;
                    break;
                }
            }
        }
        {
            let mut state = state.lock().await;
            if state.epoch == epoch {
                state.stale |= disagreed;
                if let Some(at) = state.positioned.get_mut(&queue.partition) {
                    at.next = next;
                    at.pops += 1;
                }
            }
        }
        Ok(match records.is_empty() {
            true => Fetched::Empty {
                next: cursor,
                min: cursor,
            },
            false => Fetched::Found {
                records,
                next,
                min: cursor,
            },
        })
    }
}

rocketmq_storage!(RocketMq5Storage, BACKEND, popper, {
    /// ACKs a settled message at the broker that served its POP, under the epoch's group it
    /// was popped in (named in the key).
    async fn ack_pulled(
        &self,
        reader: &ReaderKey,
        ack_key: &str,
    ) -> Result<AckPulledOutcome, StorageError> {
        let Some((epoch, receipt)) = Epochs::parse_ack_key(ack_key) else {
            return Ok(AckPulledOutcome::UnknownKey);
        };
        let base = names::pop_group(reader.group.as_ref())?;
        let group = Epochs::group_name(&base, epoch);
        self.inner.popper.ack(&group, &reader.topic, receipt).await
    }

    async fn evict_reader(&self, reader: &ReaderKey) -> Result<(), StorageError> {
        if let Err(err) = self.inner.popper.end(reader).await {
            tracing::warn!(topic = %reader.topic, %err, "an evicted reader's POP epoch was not ended cleanly");
        }
        self.inner.reads.evict(reader).await
    }
});

#[cfg(test)]
mod tests {
    use super::*;

    /// Synthetic messages and receipts (broker 1.0.0 never revives, so no test on the broker
    /// can make one): a message revived from the POP retry topic is told apart by its
    /// `POP_CK`, and its ACK goes to the retry topic; a message at the reader's position is
    /// ACKed under the reader's topic.
    #[test]
    fn revived_messages_are_recognised_and_acked_under_the_retry_topic() {
        let group = "eventmesh-pop_orders-000000000000002a";
        let retry_topic = format!("%RETRY%{group}_orders");
        let receipt_of = |topic: &str| {
            ExtraInfoUtil::build_extra_info_with_offset(
                5,
                1_700_000_000_000,
                300_000,
                0,
                topic,
                "broker-a",
                1,
                7,
            )
        };

        let mut revived = MessageExt::default();
        revived.set_topic(retry_topic.as_str().into());
        let receipt = receipt_of(&retry_topic);
        revived.put_property(
            CheetahString::from_static_str(MessageConst::PROPERTY_POP_CK),
            receipt.as_str().into(),
        );
        assert_eq!(revived_receipt(&revived).as_deref(), Some(receipt.as_str()));
        let (broker, ack) = ack_header(group, "orders", &receipt).unwrap();
        assert_eq!(broker, "broker-a");
        assert_eq!(ack.topic.as_str(), retry_topic);
        assert_eq!((ack.queue_id, ack.offset), (1, 7));
        assert_eq!(ack.consumer_group.as_str(), group);

        let mut fresh = MessageExt::default();
        fresh.set_topic("orders".into());
        assert_eq!(revived_receipt(&fresh), None);
        let (_, ack) = ack_header(group, "orders", &receipt_of("orders")).unwrap();
        assert_eq!(ack.topic.as_str(), "orders");

        assert!(ack_header(group, "orders", "not a receipt").is_none());
    }
}

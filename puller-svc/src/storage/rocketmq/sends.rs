//! Sends to a RocketMQ topic: one message, or a publish batch as broker batches.
//!
//! * A message goes to its explicit queue, else the queue its key's Java hash picks, else
//!   round robin ([`RocketMqClient::pick_queue`]).
//! * A publish batch is checked record by record (a refused key, body or queue answers that
//!   record alone), grouped by queue in input order, and each queue's records go as broker
//!   batches (`SEND_BATCH_MESSAGE`, at most [`BATCH_MESSAGES`] messages and the broker's message
//!   size each), one after the other per queue, queues at once. The broker stores a batch in
//!   one queue contiguously: the n-th message of a batch sits at the batch's first offset + n.
//! * Order per queue holds through failures: when a broker batch fails, it and every later one
//!   of that queue fail (never sent), as a local-log write does, so a retry cannot land a key's
//!   earlier event after a later one.
//! * The client serialises the calls of one handle, so per-message sends top out near one
//!   round trip each (about 1,000/s here); batches carry many messages per round trip.

use std::collections::BTreeMap;

use bytes::Bytes;
use eventmesh_common::keys::{PartitionId, Topic};
use rocketmq_model::common::message::message_single::Message;
use rocketmq_model::result::SendStatus;

use super::client::{CALL_TIMEOUT, QueueRef, RocketMqClient, Route, unavailable};
use super::{message, names};
use crate::storage::{Appended, NewRecord, StorageError};

/// Most messages in one broker batch.
pub const BATCH_MESSAGES: usize = 256;
/// What a message adds to a batch besides its body and key (its encoding in the batch body:
/// lengths, flags, properties such as the unique id), counted generously.
const MESSAGE_OVERHEAD: usize = 256;

/// Sends one message.
pub async fn send(
    client: &RocketMqClient,
    topic: &Topic,
    key: Bytes,
    body: Bytes,
    partition: Option<PartitionId>,
) -> Result<Appended, StorageError> {
    names::check_topic(topic)?;
    let route = client.route(topic).await?;
    let (queue, outgoing) = prepare(client, &route, topic, &key, body, partition.as_ref())?;
    let offset = send_to(client, topic, &queue, vec![outgoing]).await?;
    Ok(Appended {
        partition: queue.partition,
        offset,
    })
}

/// Sends a publish batch; one answer per record, in order. Fails as a whole only when the
/// topic is unknown or unnamed.
pub async fn send_batch(
    client: &RocketMqClient,
    topic: &Topic,
    records: Vec<NewRecord>,
) -> Result<Vec<Result<Appended, StorageError>>, StorageError> {
    names::check_topic(topic)?;
    let route = client.route(topic).await?;
    let mut results: Vec<Option<Result<Appended, StorageError>>> = vec![None; records.len()];
    let mut queues: BTreeMap<PartitionId, (QueueRef, Vec<(usize, Message)>)> = BTreeMap::new();
    for (index, record) in records.into_iter().enumerate() {
        match prepare(
            client,
            &route,
            topic,
            &record.key,
            record.body,
            record.partition.as_ref(),
        ) {
            Ok((queue, outgoing)) => queues
                .entry(queue.partition.clone())
                .or_insert_with(|| (queue, Vec::new()))
                .1
                .push((index, outgoing)),
            Err(err) => results[index] = Some(Err(err)),
        }
    }
    let sent = futures::future::join_all(
        queues
            .into_values()
            .map(|(queue, messages)| send_queue(client, topic, queue, messages)),
    )
    .await;
    for (index, result) in sent.into_iter().flatten() {
        results[index] = Some(result);
    }
    Ok(results
        .into_iter()
        .map(|result| {
            result.unwrap_or_else(|| {
                Err(StorageError::Internal(
                    "a record of the batch got no answer".into(),
                ))
            })
        })
        .collect())
}

/// Checks one record and builds its message and queue.
fn prepare(
    client: &RocketMqClient,
    route: &Route,
    topic: &Topic,
    key: &Bytes,
    body: Bytes,
    partition: Option<&PartitionId>,
) -> Result<(QueueRef, Message), StorageError> {
    let key = message::key_text(key)?;
    client.check_body(&body)?;
    let queue = client
        .pick_queue(route, topic, key.as_deref(), partition)?
        .clone();
    Ok((queue, message::outgoing(topic, key.as_deref(), body)?))
}

/// Splits one queue's messages into broker batches: at most [`BATCH_MESSAGES`], and within the
/// broker's message size with [`MESSAGE_OVERHEAD`] each.
fn chunks(messages: Vec<(usize, Message)>, max_bytes: usize) -> Vec<Vec<(usize, Message)>> {
    let mut chunks: Vec<Vec<(usize, Message)>> = Vec::new();
    let mut bytes = 0;
    for (index, outgoing) in messages {
        let size = encoded_size(&outgoing);
        let full = chunks
            .last()
            .is_none_or(|chunk| chunk.len() >= BATCH_MESSAGES || bytes + size > max_bytes);
        if full {
            chunks.push(Vec::new());
            bytes = 0;
        }
        bytes += size;
        if let Some(chunk) = chunks.last_mut() {
            chunk.push((index, outgoing));
        }
    }
    chunks
}

fn encoded_size(outgoing: &Message) -> usize {
    outgoing.body().map_or(0, |b| b.len())
        + outgoing
            .keys()
            .map_or(0, |keys| keys.iter().map(|k| k.len() + 1).sum())
        + MESSAGE_OVERHEAD
}

/// Sends one queue's messages in order; after a failure the rest fail unsent.
async fn send_queue(
    client: &RocketMqClient,
    topic: &Topic,
    queue: QueueRef,
    messages: Vec<(usize, Message)>,
) -> Vec<(usize, Result<Appended, StorageError>)> {
    let mut answers = Vec::with_capacity(messages.len());
    let mut failed: Option<StorageError> = None;
    for chunk in chunks(messages, client.max_message_bytes()) {
        if let Some(err) = &failed {
            answers.extend(chunk.into_iter().map(|(index, _)| {
                (
                    index,
                    Err(StorageError::Unavailable(format!(
                        "not sent: an earlier batch to {} failed ({err})",
                        queue.partition
                    ))),
                )
            }));
            continue;
        }
        let (indexes, outgoing): (Vec<usize>, Vec<Message>) = chunk.into_iter().unzip();
        let sent = send_to(client, topic, &queue, outgoing).await;
        match sent {
            Ok(first) => answers.extend(indexes.into_iter().zip(first..).map(|(index, offset)| {
                (
                    index,
                    Ok(Appended {
                        partition: queue.partition.clone(),
                        offset,
                    }),
                )
            })),
            Err(err) => {
                answers.extend(indexes.into_iter().map(|index| (index, Err(err.clone()))));
                failed = Some(err);
            }
        }
    }
    answers
}

/// Sends `outgoing` to `queue`: one message as itself (a batch adds its own overhead, so a
/// body at the size limit would no longer fit), several as one broker batch. The offset of the
/// first.
async fn send_to(
    client: &RocketMqClient,
    topic: &Topic,
    queue: &QueueRef,
    mut outgoing: Vec<Message>,
) -> Result<i64, StorageError> {
    let producer = client.producer().await?;
    let mq = queue.message_queue(topic);
    let sent = client
        .call("send", CALL_TIMEOUT * 2, async move {
            if outgoing.len() == 1
                && let Some(single) = outgoing.pop()
            {
                producer
                    .send_to_queue(single, mq)
                    .await
                    .map_err(|err| unavailable("send", &err))?
                    .ok_or_else(|| {
                        StorageError::Internal("rocketmq send answered without a result".into())
                    })
            } else {
                producer
                    .send_batch_to_queue(outgoing, mq)
                    .await
                    .map_err(|err| unavailable("batch send", &err))
            }
        })
        .await?;
    if !matches!(sent.send_status, SendStatus::SendOk) {
        // Stored on the master, only its flush or replication lagged: the messages are in the
        // queue, so they are answered as written (a retry would duplicate them).
        tracing::warn!(%topic, partition = %queue.partition, status = ?sent.send_status, "rocketmq stored the message with a degraded status");
    }
    Ok(sent.queue_offset as i64)
}

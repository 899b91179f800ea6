//! Aligning a reader to its group's ACK watermark, read from offset-svc (the seed's
//! `alignPullOffsetsToAck`, DESIGN §6).
//!
//! The watermark of a subscription group lives in offset-svc under the reserved client id
//! `__mqcursor__` (the topic's default group) or `__mqcursor@<group>__`, one entry per
//! partition, inclusive. [`align_reader`] reads them all for the reader's topic and applies
//! each to the reader's cursor in that partition (every numbered partition, plus any lite
//! channel that has a watermark) — before the reader's first poll and whenever a dispatcher
//! (re)attaches. If offset-svc cannot be read, nothing moves and the error says so: a reader
//! must not poll unaligned.

use std::collections::BTreeMap;

use eventmesh_common::grpc::InternalChannel;
use eventmesh_common::keys::{OffsetClient, PartitionId};
use eventmesh_proto::offset::ReadTopicOffsetsRequest;
use eventmesh_proto::offset::offset_service_client::OffsetServiceClient;

use crate::cursors::Alignment;
use crate::storage::{ReaderKey, Storage, StorageError};

/// Why a reader could not be aligned.
#[derive(Debug, thiserror::Error)]
pub enum AlignError {
    /// offset-svc did not answer.
    #[error("cannot read the watermarks of {reader} from offset-svc: {status}")]
    OffsetService {
        /// The reader, `group/topic`.
        reader: String,
        /// The gRPC status.
        status: tonic::Status,
    },
    /// offset-svc answered with an entry this puller cannot use.
    #[error("offset-svc returned an unusable watermark entry: {0}")]
    BadEntry(String),
    /// The storage failed.
    #[error(transparent)]
    Storage(#[from] StorageError),
}

/// Reads group watermarks from offset-svc.
#[derive(Clone)]
pub struct WatermarkSource {
    client: OffsetServiceClient<InternalChannel>,
}

impl WatermarkSource {
    /// Uses an established (or lazily connecting) channel to offset-svc.
    pub fn new(channel: InternalChannel) -> Self {
        WatermarkSource {
            client: OffsetServiceClient::new(channel)
                .max_decoding_message_size(eventmesh_common::grpc::OFFSETS_MESSAGE_LIMIT),
        }
    }

    /// The reader's group watermark per partition (absent: nothing settled there yet).
    pub async fn watermarks(
        &self,
        reader: &ReaderKey,
    ) -> Result<BTreeMap<PartitionId, i64>, AlignError> {
        let request = ReadTopicOffsetsRequest {
            topic: reader.topic.to_string(),
            client_id: OffsetClient::MqCursor(reader.group.clone()).to_string(),
        };
        let entries = self
            .client
            .clone()
            .read_topic_offsets(request)
            .await
            .map_err(|status| AlignError::OffsetService {
                reader: describe(reader),
                status,
            })?
            .into_inner()
            .entries;
        entries
            .into_iter()
            .map(|entry| {
                let key = entry
                    .key
                    .ok_or_else(|| AlignError::BadEntry("entry without a key".into()))?;
                let partition = PartitionId::new(key.partition)
                    .map_err(|err| AlignError::BadEntry(err.to_string()))?;
                Ok((partition, entry.offset))
            })
            .collect()
    }
}

/// A reader as logs and errors name it: `group/topic` (`(default)/topic`).
pub(crate) fn describe(reader: &ReaderKey) -> String {
    match &reader.group {
        Some(group) => format!("{group}/{}", reader.topic),
        None => format!("(default)/{}", reader.topic),
    }
}

/// Aligns every partition of the reader (and every lite channel with a watermark) to the
/// group's watermark. Reads offset-svc first: on failure nothing moves.
pub async fn align_reader(
    storage: &dyn Storage,
    source: &WatermarkSource,
    reader: &ReaderKey,
) -> Result<Vec<(PartitionId, Alignment)>, AlignError> {
    let mut watermarks = source.watermarks(reader).await?;
    let mut outcomes = Vec::new();
    for range in storage.end_offsets(&reader.topic).await? {
        let watermark = watermarks.remove(&range.partition);
        let outcome = storage
            .align_pull_offset(reader, &range.partition, watermark)
            .await?;
        outcomes.push((range.partition, outcome));
    }
    // What is left are lite channels (or partitions the topic no longer has).
    for (partition, watermark) in watermarks {
        let outcome = storage
            .align_pull_offset(reader, &partition, Some(watermark))
            .await?;
        outcomes.push((partition, outcome));
    }
    tracing::info!(reader = %describe(reader), partitions = outcomes.len(), "reader aligned to the ACK watermark");
    Ok(outcomes)
}

//! Messages in and out of RocketMQ, for both backends.
//!
//! * Out: the body as it is (our frames, or any bytes), the record key as the `KEYS` property.
//!   RocketMQ keys are text: a key that is not UTF-8, or holds the property separators
//!   `\u{1}`/`\u{2}`, is refused with INVALID_ARGUMENT rather than altered.
//! * In: user properties (every property RocketMQ does not reserve for itself) are the
//!   record's headers, in name order, so a foreign body's metadata reaches the dispatcher as
//!   attributes (see [`crate::ingest`]); `KEYS` is the record key; the born time is its time.

use bytes::Bytes;
use eventmesh_common::frame::FrameLimits;
use eventmesh_common::grpc::MAX_RECORD_KEY_BYTES;
use eventmesh_common::keys::{PartitionId, Topic};
use rocketmq_model::common::message::message_ext::MessageExt;
use rocketmq_model::common::message::message_single::Message;
use rocketmq_model::common::message::{MessageConst, STRING_HASH_SET};

use crate::ingest::{Header, Origin, Stamping, ingest, malformed};
use crate::storage::{PolledRecord, StorageError};

/// The record key as RocketMQ's `KEYS` text (`None` for an empty key).
pub fn key_text(key: &Bytes) -> Result<Option<String>, StorageError> {
    if key.is_empty() {
        return Ok(None);
    }
    let text = std::str::from_utf8(key)
        .map_err(|_| StorageError::Invalid("a RocketMQ record key must be UTF-8 text".into()))?;
    if text.contains(['\u{1}', '\u{2}']) {
        return Err(StorageError::Invalid(
            "a RocketMQ record key must not contain the characters U+0001 or U+0002".into(),
        ));
    }
    Ok(Some(text.to_owned()))
}

/// The message a send writes.
pub fn outgoing(topic: &Topic, key: Option<&str>, body: Bytes) -> Result<Message, StorageError> {
    let mut builder = Message::builder().topic(topic.as_str()).body(body);
    if let Some(key) = key {
        builder = builder.key(key);
    }
    builder
        .build()
        .map_err(|err| StorageError::Invalid(format!("rocketmq message: {err}")))
}

/// A message's user properties as record headers, in name order.
pub fn user_headers(message: &MessageExt) -> Vec<Header> {
    let mut headers: Vec<Header> = message
        .properties()
        .iter()
        .filter(|(name, _)| !STRING_HASH_SET.contains(name.as_str()))
        .map(|(name, value)| (name.to_string(), Bytes::copy_from_slice(value.as_bytes())))
        .collect();
    headers.sort_by(|a, b| a.0.cmp(&b.0));
    headers
}

/// A pulled or popped message as a polled record of `topic` (its reader's topic), stamped at
/// `partition` and `offset`; `ack_key` is the broker ACK handle where there is one.
pub fn record(
    topic: &Topic,
    partition: &PartitionId,
    offset: i64,
    message: &MessageExt,
    ack_key: Option<String>,
    limits: &FrameLimits,
) -> PolledRecord {
    let body = message.body().unwrap_or_default();
    let key = message
        .properties()
        .get(MessageConst::PROPERTY_KEYS)
        .map(|keys| Bytes::copy_from_slice(keys.as_bytes()))
        .unwrap_or_default();
    let (key, ingested) = if key.len() > MAX_RECORD_KEY_BYTES {
        let reason = format!(
            "record key of {} bytes exceeds the {MAX_RECORD_KEY_BYTES}-byte limit",
            key.len()
        );
        (Bytes::new(), malformed(body, reason))
    } else {
        let origin = Origin {
            topic,
            partition,
            offset,
            pop_ck: ack_key.as_deref(),
        };
        // Stamped always: the RocketMQ reads do not pass the poll's form down this far.
        let ingested = ingest(
            body,
            &user_headers(message),
            &origin,
            limits,
            Stamping::Every,
        );
        (key, ingested)
    };
    PolledRecord {
        partition: partition.clone(),
        offset,
        key,
        timestamp_ms: message.born_timestamp(),
        ack_key,
        ingested,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_are_text_without_separators() {
        assert_eq!(key_text(&Bytes::new()).ok(), Some(None));
        assert_eq!(
            key_text(&Bytes::from_static(b"order 42")).ok(),
            Some(Some("order 42".to_owned()))
        );
        for bad in [&b"\xff\xfe"[..], b"a\x01b", b"a\x02b"] {
            let err = key_text(&Bytes::copy_from_slice(bad)).err();
            assert!(
                matches!(err, Some(StorageError::Invalid(_))),
                "{bad:?}: {err:?}"
            );
        }
    }
}

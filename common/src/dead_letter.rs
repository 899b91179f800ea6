//! The dead-letter envelope (DESIGN §10): what `<topic>_DLQ` holds.
//!
//! An envelope is an EventMeshFrame whose data is the original MQ body, byte for byte (the
//! frame as pulled — as stored, or stamped —, or a foreign or broken body), and whose attributes say why and from where:
//! `emdlqreason`, `emdlqattempts`, `emdlqgroup` (empty for the topic's default group),
//! `emdlqtopic`, `emdlqpartition`, `emdlqoffset`. It is encoded with [`ENVELOPE_LIMITS`], which
//! exceed the user limits by the envelope's own overhead, so any event — even one at the frame
//! limit — can be dead-lettered. Readers (the SDK, `emctl`) decode it with [`DeadLetter::decode`].

use bytes::Bytes;

use crate::frame::{Frame, FrameError, FrameLimits};

/// Why the event was dead-lettered (free text).
pub const ATTR_REASON: &str = "emdlqreason";
/// Delivery attempts made.
pub const ATTR_ATTEMPTS: &str = "emdlqattempts";
/// The subscription group (empty: the topic's default group).
pub const ATTR_GROUP: &str = "emdlqgroup";
/// The source topic.
pub const ATTR_TOPIC: &str = "emdlqtopic";
/// The source partition.
pub const ATTR_PARTITION: &str = "emdlqpartition";
/// The source MQ offset.
pub const ATTR_OFFSET: &str = "emdlqoffset";

/// The suffix of a topic's dead-letter topic.
pub const DLQ_SUFFIX: &str = "_DLQ";

/// Limits for envelopes: a whole stamped user frame fits as data, with room for the envelope's
/// attributes (a reason is cut to fit a value).
pub const ENVELOPE_LIMITS: FrameLimits = FrameLimits {
    max_frame_bytes: FrameLimits::STAMPED.max_frame_bytes + 64 * 1024,
    max_data_bytes: FrameLimits::STAMPED.max_frame_bytes,
    ..FrameLimits::DEFAULT
};

/// The name of `topic`'s dead-letter topic. A dead-letter topic's own dead letters go back to
/// it (wrapped again, with the new reason), so a name never grows past the topic-name limit,
/// which leaves room for one suffix.
pub fn dlq_topic(topic: &str) -> String {
    if is_dlq_topic(topic) {
        topic.to_owned()
    } else {
        format!("{topic}{DLQ_SUFFIX}")
    }
}

/// Whether `topic` is a dead-letter topic.
pub fn is_dlq_topic(topic: &str) -> bool {
    topic.ends_with(DLQ_SUFFIX)
}

/// One dead-lettered event.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeadLetter {
    /// Why.
    pub reason: String,
    /// Delivery attempts made (0: never delivered, for example an undecodable body).
    pub attempts: u32,
    /// The group, empty for the topic's default group.
    pub group: String,
    /// The source topic.
    pub topic: String,
    /// The source partition.
    pub partition: String,
    /// The source MQ offset.
    pub offset: i64,
    /// The original MQ body.
    pub original: Bytes,
}

impl DeadLetter {
    /// Encodes the envelope.
    pub fn encode(&self) -> Result<Bytes, FrameError> {
        let mut frame = Frame::event();
        let max_value = ENVELOPE_LIMITS.max_attr_value_bytes;
        frame.set_attribute(ATTR_REASON, truncate(&self.reason, max_value));
        frame.set_attribute(ATTR_ATTEMPTS, self.attempts.to_string());
        frame.set_attribute(ATTR_GROUP, self.group.clone());
        frame.set_attribute(ATTR_TOPIC, self.topic.clone());
        frame.set_attribute(ATTR_PARTITION, self.partition.clone());
        frame.set_attribute(ATTR_OFFSET, self.offset.to_string());
        frame.data = self.original.clone();
        frame.encode(&ENVELOPE_LIMITS)
    }

    /// Decodes an envelope; `None` when `body` is a frame but not an envelope.
    pub fn decode(body: &Bytes) -> Result<Option<DeadLetter>, FrameError> {
        let frame = Frame::decode(body, &ENVELOPE_LIMITS)?;
        let text = |name: &str| frame.attribute(name).map(str::to_owned);
        let (Some(reason), Some(attempts), Some(offset)) = (
            text(ATTR_REASON),
            frame.attribute(ATTR_ATTEMPTS).and_then(|v| v.parse().ok()),
            frame.attribute(ATTR_OFFSET).and_then(|v| v.parse().ok()),
        ) else {
            return Ok(None);
        };
        Ok(Some(DeadLetter {
            reason,
            attempts,
            group: text(ATTR_GROUP).unwrap_or_default(),
            topic: text(ATTR_TOPIC).unwrap_or_default(),
            partition: text(ATTR_PARTITION).unwrap_or_default(),
            offset,
            original: frame.data,
        }))
    }
}

fn truncate(text: &str, max: usize) -> String {
    if text.len() <= max {
        return text.to_owned();
    }
    let mut end = max;
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    text[..end].to_owned()
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn dead_letter_topic_names_never_grow_twice() {
        assert_eq!(dlq_topic("orders"), "orders_DLQ");
        assert_eq!(dlq_topic("orders_DLQ"), "orders_DLQ");
        let longest = "x".repeat(crate::keys::MAX_TOPIC_BYTES_WITH_ROOM);
        let dead = dlq_topic(&longest);
        assert_eq!(dead.len(), 249, "fits Kafka's limit");
        assert!(crate::keys::Topic::new(dead.as_str()).is_ok());
        assert_eq!(dlq_topic(&dead), dead);
    }

    #[test]
    fn an_event_at_the_frame_limit_fits_an_envelope() {
        let mut frame = Frame::event();
        frame.data = Bytes::from(vec![7u8; FrameLimits::DEFAULT.max_data_bytes]);
        frame.set_attribute("id", "x");
        let original = frame.encode(&FrameLimits::DEFAULT).unwrap();
        let letter = DeadLetter {
            reason: "é".repeat(10_000),
            attempts: 6,
            group: "g".into(),
            topic: "orders".into(),
            partition: "3".into(),
            offset: 41,
            original: original.clone(),
        };
        let decoded = DeadLetter::decode(&letter.encode().unwrap())
            .unwrap()
            .unwrap();
        assert_eq!(decoded.original, original);
        assert_eq!(decoded.attempts, 6);
        assert!(decoded.reason.len() <= 4096 && decoded.reason.starts_with('é'));
        assert_eq!(dlq_topic("orders"), "orders_DLQ");
    }

    #[test]
    fn a_plain_frame_is_not_an_envelope() {
        let frame = Frame::event().encode(&FrameLimits::DEFAULT).unwrap();
        assert_eq!(DeadLetter::decode(&frame).unwrap(), None);
    }
}

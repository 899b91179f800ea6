//! Subscribe responses written straight from the frames the group holds.
//!
//! A delivery's message is not built as a `pb::Delivery` (an `Event` with a `String` per
//! context attribute, a map of owned attribute strings, the delivery's own strings), measured
//! and then encoded: [`DeliveryMessage`] reads the frame in place ([`read_for_delivery`]),
//! measures it once, and [`ResponseBuilder`] writes its protobuf bytes into the session's one
//! reusable buffer. The bytes decode to exactly the message field-by-field building gives
//! (`Sending::into_message` with its deadline; property-tested below), so clients see no
//! difference.
//!
//! One response is either a single item (`delivery = 2`, `ack_result = 3`) or a
//! `ResponseBatch` (`batch = 4`: `deliveries = 1`, `ack_results = 2`). Items are written as
//! batch entries after room left for the batch's header; a response that ends up with one item
//! gets the single form by changing its entry's one key byte (same length), so no byte moves.

use bytes::{BufMut, BytesMut};
use eventmesh_common::keys::Topic;
use eventmesh_proto::encoded::SubscribeResponseBytes;
use prost::encoding::{WireType, encode_key, encode_varint, encoded_len_varint, key_len};

use crate::delivery_id::IdText;
use crate::event::{DeliveredEvent, read_for_delivery};
use crate::group::{Answer, AnsweredId, Sending};

/// `SubscribeResponse.batch`.
const RESPONSE_BATCH: u32 = 4;
/// `ResponseBatch.deliveries`; alone, the entry becomes `SubscribeResponse.delivery` (2).
const BATCH_DELIVERIES: u32 = 1;
/// `ResponseBatch.ack_results`; alone, the entry becomes `SubscribeResponse.ack_result` (3).
const BATCH_ACK_RESULTS: u32 = 2;
/// Field numbers of `Delivery`.
mod delivery {
    pub const ID: u32 = 1;
    pub const ATTEMPT: u32 = 2;
    pub const TOPIC: u32 = 3;
    pub const PARTITION: u32 = 4;
    pub const OFFSET: u32 = 5;
    pub const EVENT: u32 = 6;
    pub const DEADLINE: u32 = 7;
    pub const KEY: u32 = 8;
}
/// Field numbers of `Event` (the context attributes are 1 to 6, in `DeliveredEvent` order).
mod event {
    pub const ATTRIBUTES: u32 = 7;
    pub const DATA: u32 = 8;
    pub const BINARY_ATTRIBUTES: u32 = 9;
}
/// Field numbers of `AckResult`.
mod ack_result {
    pub const ID: u32 = 1;
    pub const OUTCOME: u32 = 2;
    pub const DETAIL: u32 = 3;
}
/// Field numbers of a map entry.
const MAP_KEY: u32 = 1;
const MAP_VALUE: u32 = 2;

/// Room before the first item for the batch's key and length.
const HEADER_ROOM: usize = 1 + 5;

/// A length-delimited field of `len` bytes, key and length included.
fn delimited_len(tag: u32, len: usize) -> usize {
    key_len(tag) + encoded_len_varint(len as u64) + len
}

/// A `string`/`bytes` field; proto3 writes nothing for an empty one.
fn text_len(tag: u32, text: &[u8]) -> usize {
    if text.is_empty() {
        0
    } else {
        delimited_len(tag, text.len())
    }
}

/// A varint field; nothing for zero.
fn varint_len(tag: u32, value: u64) -> usize {
    if value == 0 {
        0
    } else {
        key_len(tag) + encoded_len_varint(value)
    }
}

fn put_delimited_header(tag: u32, len: usize, buf: &mut impl BufMut) {
    encode_key(tag, WireType::LengthDelimited, buf);
    encode_varint(len as u64, buf);
}

fn put_text(tag: u32, text: &[u8], buf: &mut impl BufMut) {
    if !text.is_empty() {
        put_delimited_header(tag, text.len(), buf);
        buf.put_slice(text);
    }
}

fn put_varint(tag: u32, value: u64, buf: &mut impl BufMut) {
    if value != 0 {
        encode_key(tag, WireType::Varint, buf);
        encode_varint(value, buf);
    }
}

/// A map entry's length (its key and value fields).
fn entry_len(name: &str, value: &[u8]) -> usize {
    text_len(MAP_KEY, name.as_bytes()) + text_len(MAP_VALUE, value)
}

fn put_entry(tag: u32, name: &str, value: &[u8], buf: &mut impl BufMut) {
    put_delimited_header(tag, entry_len(name, value), buf);
    put_text(MAP_KEY, name.as_bytes(), buf);
    put_text(MAP_VALUE, value, buf);
}

/// The encoded length of an event's message.
fn event_len(event: &DeliveredEvent<'_>) -> usize {
    let context: usize = (1..)
        .zip(event.context)
        .map(|(tag, value)| text_len(tag, value.as_bytes()))
        .sum();
    let attributes: usize = event
        .attributes
        .iter()
        .map(|(name, value)| delimited_len(event::ATTRIBUTES, entry_len(name, value.as_bytes())))
        .sum();
    let binary: usize = event
        .binary_attributes
        .iter()
        .map(|(name, value)| delimited_len(event::BINARY_ATTRIBUTES, entry_len(name, value)))
        .sum();
    context + attributes + text_len(event::DATA, &event.data) + binary
}

fn put_event(event: &DeliveredEvent<'_>, buf: &mut impl BufMut) {
    for (tag, value) in (1..).zip(event.context) {
        put_text(tag, value.as_bytes(), buf);
    }
    for (name, value) in &event.attributes {
        put_entry(event::ATTRIBUTES, name, value.as_bytes(), buf);
    }
    put_text(event::DATA, &event.data, buf);
    for (name, value) in &event.binary_attributes {
        put_entry(event::BINARY_ATTRIBUTES, name, value, buf);
    }
}

/// One delivery's message, read from its frame and measured, ready to write.
pub struct DeliveryMessage<'a> {
    sending: &'a Sending,
    topic: &'a Topic,
    id: IdText,
    deadline_unix_ms: i64,
    /// `None` when the frame does not decode (intake dead-letters those; an event that is
    /// there but does not read goes without its event, as the field-by-field message did).
    event: Option<(DeliveredEvent<'a>, usize)>,
    len: usize,
}

impl<'a> DeliveryMessage<'a> {
    /// `sending`'s message, of `topic` (the session's), with the ACK deadline
    /// `deadline_unix_ms`.
    pub fn new(sending: &'a Sending, topic: &'a Topic, deadline_unix_ms: i64) -> Self {
        let id = sending.id.text();
        let event = sending
            .decodable
            .then(|| match read_for_delivery(&sending.body) {
                Ok(event) => Some(event),
                Err(err) => {
                    // The puller called it a frame that decodes (BODY_KIND_FRAME) and the
                    // pull loop found its layout sound: only text that is not UTF-8 gets here,
                    // a puller breaking its contract. Said loudly; the event goes without it.
                    tracing::error!(partition = %sending.partition, offset = sending.offset, %err, "a frame the puller called decodable does not read; delivered without its event");
                    None
                }
            })
            .flatten()
            .map(|event| {
                let len = event_len(&event);
                (event, len)
            });
        let len = text_len(delivery::ID, id.as_bytes())
            + varint_len(delivery::ATTEMPT, u64::from(sending.attempt))
            + text_len(delivery::TOPIC, topic.as_str().as_bytes())
            + text_len(delivery::PARTITION, sending.partition.as_str().as_bytes())
            // int64 is written as the two's complement's 64 bits (a negative one takes 10 bytes).
            + varint_len(delivery::OFFSET, sending.offset as u64)
            + event
                .as_ref()
                .map_or(0, |(_, len)| delimited_len(delivery::EVENT, *len))
            + varint_len(delivery::DEADLINE, deadline_unix_ms as u64)
            + text_len(delivery::KEY, &sending.key);
        DeliveryMessage {
            sending,
            topic,
            id,
            deadline_unix_ms,
            event,
            len,
        }
    }

    /// The message's encoded length (without the key and length that frame it).
    pub fn encoded_len(&self) -> usize {
        self.len
    }

    /// Bytes of event data it carries.
    pub fn data_len(&self) -> usize {
        self.event.as_ref().map_or(0, |(event, _)| event.data.len())
    }

    fn put(&self, buf: &mut impl BufMut) {
        let sending = self.sending;
        put_text(delivery::ID, self.id.as_bytes(), buf);
        put_varint(delivery::ATTEMPT, u64::from(sending.attempt), buf);
        put_text(delivery::TOPIC, self.topic.as_str().as_bytes(), buf);
        put_text(
            delivery::PARTITION,
            sending.partition.as_str().as_bytes(),
            buf,
        );
        put_varint(delivery::OFFSET, sending.offset as u64, buf);
        if let Some((event, len)) = &self.event {
            put_delimited_header(delivery::EVENT, *len, buf);
            put_event(event, buf);
        }
        put_varint(delivery::DEADLINE, self.deadline_unix_ms as u64, buf);
        put_text(delivery::KEY, &sending.key, buf);
    }
}

/// One answer's `AckResult`, measured, ready to write.
pub struct AnswerMessage<'a> {
    answer: &'a Answer,
    id: AnswerIdText<'a>,
    len: usize,
}

/// The text an answer names its delivery by.
enum AnswerIdText<'a> {
    /// Written from an id this instance issued.
    Issued(IdText),
    /// As the client sent it.
    Text(&'a str),
}

impl<'a> AnswerMessage<'a> {
    /// `answer`'s message.
    pub fn new(answer: &'a Answer) -> Self {
        let id = match &answer.delivery_id {
            AnsweredId::Issued(id) => AnswerIdText::Issued(id.text()),
            AnsweredId::Text(text) => AnswerIdText::Text(text),
        };
        let mut message = AnswerMessage { answer, id, len: 0 };
        message.len = text_len(ack_result::ID, message.id())
            + varint_len(ack_result::OUTCOME, message.outcome())
            + text_len(ack_result::DETAIL, answer.detail.as_bytes());
        message
    }

    fn id(&self) -> &[u8] {
        match &self.id {
            AnswerIdText::Issued(text) => text.as_bytes(),
            AnswerIdText::Text(text) => text.as_bytes(),
        }
    }

    /// An enum is an int32: a negative one would take ten bytes (sign-extended).
    fn outcome(&self) -> u64 {
        i64::from(self.answer.outcome as i32) as u64
    }

    /// The message's encoded length (without the key and length that frame it).
    pub fn encoded_len(&self) -> usize {
        self.len
    }

    fn put(&self, buf: &mut impl BufMut) {
        put_text(ack_result::ID, self.id(), buf);
        put_varint(ack_result::OUTCOME, self.outcome(), buf);
        put_text(ack_result::DETAIL, self.answer.detail.as_bytes(), buf);
    }
}

/// Builds a session's responses in one buffer it keeps: a response's bytes are handed to the
/// transport, which copies them into its frame and drops them before the next response is
/// built, so the buffer's space is used again instead of allocating per message.
#[derive(Default)]
pub struct ResponseBuilder {
    buf: BytesMut,
    items: usize,
}

impl ResponseBuilder {
    /// Items in the response so far.
    pub fn items(&self) -> usize {
        self.items
    }

    /// Starts a response expected to take about `capacity` bytes.
    pub fn start(&mut self, capacity: usize) {
        self.buf.clear();
        self.buf.reserve(HEADER_ROOM + capacity);
        self.buf.put_bytes(0, HEADER_ROOM);
        self.items = 0;
    }

    /// Adds a delivery.
    pub fn delivery(&mut self, message: &DeliveryMessage<'_>) {
        put_delimited_header(BATCH_DELIVERIES, message.encoded_len(), &mut self.buf);
        message.put(&mut self.buf);
        self.items += 1;
    }

    /// Adds an ACK result.
    pub fn result(&mut self, message: &AnswerMessage<'_>) {
        put_delimited_header(BATCH_ACK_RESULTS, message.encoded_len(), &mut self.buf);
        message.put(&mut self.buf);
        self.items += 1;
    }

    /// The response: the lone item's single form, or a batch of all of them.
    pub fn finish(&mut self) -> SubscribeResponseBytes {
        let start = if self.items == 1 {
            // Entry field n of ResponseBatch is field n + 1 of SubscribeResponse; all are
            // below 16, so each key is one byte (field << 3 | wire type) and only it changes.
            self.buf[HEADER_ROOM] += 1 << 3;
            HEADER_ROOM
        } else {
            let body = self.buf.len() - HEADER_ROOM;
            let header = delimited_len(RESPONSE_BATCH, body) - body;
            let start = HEADER_ROOM - header;
            let mut room = &mut self.buf[start..HEADER_ROOM];
            put_delimited_header(RESPONSE_BATCH, body, &mut room);
            start
        };
        let mut bytes = self.buf.split();
        let _ = bytes.split_to(start);
        SubscribeResponseBytes::from_encoded(bytes.freeze())
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use bytes::Bytes;
    use eventmesh_common::frame::{FrameLimits, append_attributes};
    use eventmesh_common::keys::{PartitionId, Topic};
    use eventmesh_proto::client as pb;
    use eventmesh_proto::client::AckOutcome;
    use eventmesh_proto::client::subscribe_response::Kind;
    use proptest::prelude::*;
    use prost::Message;

    use super::*;
    use crate::delivery_id::DeliveryId;

    /// A published event's frame, stamped by the puller, with `extra` appended as a foreign
    /// producer might (repeated names, context names, empty values).
    fn frame(event: pb::Event, extra: &[(String, String)]) -> Bytes {
        let (body, _) = crate::event::encode_for_publish(event).unwrap();
        let mut appended: Vec<(&str, &str)> = extra
            .iter()
            .map(|(name, value)| (name.as_str(), value.as_str()))
            .collect();
        appended.extend([("emmqpartition", "3"), ("emmqoffset", "41")]);
        append_attributes(&body, &appended, &FrameLimits::STAMPED.stamped()).unwrap()
    }

    /// The topic of the test's session.
    fn topic() -> Topic {
        Topic::new("orders").unwrap()
    }

    fn sending(n: u64, body: Bytes, decodable: bool) -> Sending {
        Sending {
            id: DeliveryId {
                epoch: 0xfeed,
                group: 2,
                seq: n,
            },
            attempt: 1 + n as u32 % 3,
            partition: PartitionId::number(n as u32 % 4),
            offset: n as i64 - 1,
            decodable,
            body,
            key: if n.is_multiple_of(2) {
                Bytes::new()
            } else {
                Bytes::from_static(b"k")
            },
        }
    }

    /// The message field-by-field building gives.
    fn reference(sending: &Sending, deadline: i64) -> pb::Delivery {
        let mut message = sending.clone().into_message(&topic());
        message.ack_deadline_unix_ms = deadline;
        message
    }

    /// Answer `n`: an issued id or a text one, each outcome, with or without a detail.
    fn result(n: u64) -> Answer {
        Answer {
            delivery_id: if n.is_multiple_of(3) {
                AnsweredId::Text(format!("r{n}"))
            } else {
                AnsweredId::Issued(DeliveryId {
                    epoch: n,
                    group: 1,
                    seq: u64::MAX - n,
                })
            },
            outcome: AckOutcome::try_from((n % 7) as i32).unwrap(),
            detail: if n.is_multiple_of(2) {
                String::new()
            } else {
                "why".into()
            },
        }
    }

    /// The `AckResult` field-by-field building gives.
    fn reference_result(answer: &Answer) -> pb::AckResult {
        pb::AckResult {
            delivery_id: match &answer.delivery_id {
                AnsweredId::Issued(id) => id.to_text(),
                AnsweredId::Text(text) => text.clone(),
            },
            outcome: answer.outcome as i32,
            detail: answer.detail.clone(),
        }
    }

    enum Item {
        Delivery(Sending),
        Result(Answer),
    }

    /// Builds one response of `items` both ways and checks they decode the same.
    fn check(items: &[Item], deadline: i64) {
        let mut builder = ResponseBuilder::default();
        builder.start(64);
        let mut deliveries = Vec::new();
        let mut results = Vec::new();
        for item in items {
            match item {
                Item::Delivery(sending) => {
                    let topic = topic();
                    let message = DeliveryMessage::new(sending, &topic, deadline);
                    let expected = reference(sending, deadline);
                    assert_eq!(message.encoded_len(), expected.encoded_len());
                    assert_eq!(
                        message.data_len(),
                        expected.event.as_ref().map_or(0, |e| e.data.len())
                    );
                    builder.delivery(&message);
                    deliveries.push(expected);
                }
                Item::Result(answer) => {
                    let message = AnswerMessage::new(answer);
                    let expected = reference_result(answer);
                    assert_eq!(message.encoded_len(), expected.encoded_len());
                    builder.result(&message);
                    results.push(expected);
                }
            }
        }
        let kind = match (deliveries.len(), results.len()) {
            (1, 0) => Kind::Delivery(deliveries.remove(0)),
            (0, 1) => Kind::AckResult(results.remove(0)),
            _ => Kind::Batch(pb::ResponseBatch {
                deliveries,
                ack_results: results,
            }),
        };
        let expected = pb::SubscribeResponse { kind: Some(kind) };
        let built = builder.finish();
        assert_eq!(built.decode_message().unwrap(), expected);
        assert_eq!(built.as_bytes().len(), expected.encoded_len());
    }

    fn plain_event(data: &[u8]) -> pb::Event {
        pb::Event {
            source: "/s".into(),
            r#type: "t".into(),
            data: Bytes::copy_from_slice(data),
            ..pb::Event::default()
        }
    }

    #[test]
    fn single_items_and_batches_decode_as_built_field_by_field() {
        let body = frame(plain_event(b"hello"), &[]);
        check(
            &[Item::Delivery(sending(1, body.clone(), true))],
            1_700_000_000_000,
        );
        check(&[Item::Result(result(1))], 0);
        check(&[Item::Result(result(0))], 0);
        check(
            &[
                Item::Delivery(sending(2, body.clone(), true)),
                Item::Result(result(3)),
                Item::Delivery(sending(4, body, true)),
            ],
            5,
        );
    }

    #[test]
    fn an_undecodable_frame_goes_without_its_event_and_an_empty_event_with_an_empty_one() {
        let junk = Bytes::from_static(b"not a frame");
        check(&[Item::Delivery(sending(1, junk.clone(), false))], 9);
        // Flagged decodable but not reading: no event, as before.
        check(&[Item::Delivery(sending(1, junk, true))], 9);
        let (empty, _) = crate::event::encode_for_publish(pb::Event::default()).unwrap();
        let message = sending(0, empty, true);
        assert!(reference(&message, 0).event.is_some());
        check(&[Item::Delivery(message)], 0);
    }

    #[test]
    fn a_large_batch_gets_a_long_header_and_the_buffer_is_used_again() {
        let body = frame(plain_event(&[7; 5000]), &[]);
        let items: Vec<Item> = (0..40)
            .map(|n| Item::Delivery(sending(n, body.clone(), true)))
            .collect();
        check(&items, 1);
        let mut builder = ResponseBuilder::default();
        for round in 0..3 {
            builder.start(10);
            let message = sending(round, body.clone(), true);
            builder.delivery(&DeliveryMessage::new(&message, &topic(), 1));
            let built = builder.finish();
            assert!(matches!(
                built.decode_message().unwrap().kind,
                Some(Kind::Delivery(d)) if d.offset == round as i64 - 1
            ));
        }
    }

    fn attribute() -> impl Strategy<Value = (String, String)> {
        (
            prop::sample::select(vec![
                "id",
                "source",
                "type",
                "subject",
                "time",
                "datacontenttype",
                "specversion",
                "tenant",
                "région",
                "embinary",
                "sig",
            ]),
            "[a-zA-Z0-9+/=é]{0,12}",
        )
            .prop_map(|(name, value)| (name.to_owned(), value))
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(300))]

        #[test]
        fn any_frame_decodes_as_built_field_by_field(
            events in prop::collection::vec(
                (
                    "[a-z]{0,3}",
                    "[ -~]{0,8}",
                    prop::collection::btree_map("[a-z]{1,6}", "[ -~]{0,10}", 0..4),
                    prop::collection::btree_map("[a-z]{1,6}", prop::collection::vec(any::<u8>(), 0..6), 0..3),
                    prop::collection::vec(any::<u8>(), 0..300),
                    prop::collection::vec(attribute(), 0..5),
                    any::<bool>(),
                ),
                1..6,
            ),
            deadline in any::<i64>(),
        ) {
            let mut items = Vec::new();
            for (n, (id, subject, attributes, binary, data, extra, with_result)) in events.into_iter().enumerate() {
                let event = pb::Event {
                    id,
                    source: "/src".into(),
                    r#type: "t".into(),
                    subject,
                    data: data.into(),
                    attributes: attributes.into_iter().map(|(k, v)| (format!("x{k}"), v)).collect(),
                    binary_attributes: binary.into_iter().map(|(k, v)| (format!("b{k}"), v.into())).collect(),
                    ..pb::Event::default()
                };
                items.push(Item::Delivery(sending(n as u64, frame(event, &extra), true)));
                if with_result {
                    items.push(Item::Result(result(n as u64)));
                }
            }
            check(&items, deadline);
        }
    }
}

//! Messages a server encodes or reads itself.
//!
//! A dispatcher sends most of a session's bytes as `Delivery` messages made from frames it
//! already holds. Building a [`client::Delivery`] for each (the event's strings and attribute
//! map), then measuring and encoding it, costs more than the rest of sending it; writing the
//! protobuf bytes straight from the frame costs one pass. [`SubscribeResponseBytes`] carries
//! such bytes through tonic: it is a `prost::Message` whose encoding is the bytes it holds, and
//! [`server`] is the `EventMeshService` server generated once more with it as the Subscribe
//! response type (every other type is the one in [`client`]). On the wire nothing changes: a
//! client decodes the same `eventmesh.v1.SubscribeResponse` it always did.
//!
//! The other way, [`SubscribeRequestIn`] reads a client's `SubscribeRequest` keeping an
//! `Ack`'s delivery ids as the bytes received (slices of the received message) instead of a
//! `String` each: a server checks and parses every id anyway, and most become numbers. And
//! [`PublishBatchRequestIn`] reads a `PublishBatchRequest` keeping each entry as the bytes
//! received: the dispatcher writes each event's frame from them in place.
//!
//! Whoever builds a [`SubscribeResponseBytes`] from raw bytes vouches that they are a valid
//! encoding of an `eventmesh.v1.SubscribeResponse`; [`SubscribeResponseBytes::decode_message`]
//! checks that (tests use it).

use prost::Message;
use prost::bytes::{Buf, BufMut, Bytes};
use prost::encoding::{DecodeContext, WireType, decode_key, skip_field};

use crate::client;

/// The server side of `eventmesh.v1.EventMeshService`, its Subscribe stream sending
/// [`SubscribeResponseBytes`].
pub mod server {
    include!(concat!(env!("OUT_DIR"), "/encoded/eventmesh.v1.rs"));
}

/// An encoded `eventmesh.v1.SubscribeResponse`.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SubscribeResponseBytes {
    bytes: Bytes,
}

impl SubscribeResponseBytes {
    /// Bytes the caller encoded as one `SubscribeResponse` (not checked here).
    pub fn from_encoded(bytes: Bytes) -> Self {
        SubscribeResponseBytes { bytes }
    }

    /// `message`, encoded.
    pub fn from_message(message: &client::SubscribeResponse) -> Self {
        SubscribeResponseBytes {
            bytes: message.encode_to_vec().into(),
        }
    }

    /// The encoded bytes.
    pub fn as_bytes(&self) -> &Bytes {
        &self.bytes
    }

    /// The message these bytes encode, or why they are not one.
    pub fn decode_message(&self) -> Result<client::SubscribeResponse, prost::DecodeError> {
        client::SubscribeResponse::decode(self.bytes.as_ref())
    }
}

impl From<client::SubscribeResponse> for SubscribeResponseBytes {
    fn from(message: client::SubscribeResponse) -> Self {
        SubscribeResponseBytes::from_message(&message)
    }
}

impl Message for SubscribeResponseBytes {
    fn encode_raw(&self, buf: &mut impl BufMut) {
        buf.put_slice(&self.bytes);
    }

    /// Decoding (which a server never does) goes field by field through the generated
    /// message, so what is kept is what `SubscribeResponse` keeps, re-encoded.
    fn merge_field(
        &mut self,
        tag: u32,
        wire_type: WireType,
        buf: &mut impl Buf,
        ctx: DecodeContext,
    ) -> Result<(), prost::DecodeError> {
        let mut field = client::SubscribeResponse::default();
        field.merge_field(tag, wire_type, buf, ctx)?;
        let mut bytes = Vec::with_capacity(self.bytes.len() + field.encoded_len());
        bytes.extend_from_slice(&self.bytes);
        field.encode_raw(&mut bytes);
        self.bytes = bytes.into();
        Ok(())
    }

    fn encoded_len(&self) -> usize {
        self.bytes.len()
    }

    fn clear(&mut self) {
        self.bytes = Bytes::new();
    }
}

/// `SubscribeRequest.ack`.
const REQUEST_ACK: u32 = 2;
/// `Ack.delivery_ids`.
const ACK_DELIVERY_IDS: u32 = 1;

/// A `SubscribeRequest` as a server reads it.
#[derive(Clone, Debug, PartialEq)]
pub enum SubscribeRequestIn {
    /// An `Ack`: its delivery ids as received, not checked to be UTF-8 (a server answers an
    /// id it cannot read as malformed, instead of failing the whole message).
    Ack(Vec<Bytes>),
    /// Any other request (or none: `kind` empty), decoded as usual.
    Other(client::SubscribeRequest),
}

impl Default for SubscribeRequestIn {
    fn default() -> Self {
        SubscribeRequestIn::Other(client::SubscribeRequest::default())
    }
}

impl From<client::SubscribeRequest> for SubscribeRequestIn {
    /// The request as a server reads it (an `Ack`'s ids become their bytes).
    fn from(request: client::SubscribeRequest) -> Self {
        match request.kind {
            Some(client::subscribe_request::Kind::Ack(ack)) => {
                SubscribeRequestIn::Ack(ack.delivery_ids.into_iter().map(Bytes::from).collect())
            }
            kind => SubscribeRequestIn::Other(client::SubscribeRequest { kind }),
        }
    }
}

/// The encoded length of an `Ack` message with `ids`.
fn ack_len(ids: &[Bytes]) -> usize {
    ids.iter()
        .map(|id| prost::encoding::bytes::encoded_len(ACK_DELIVERY_IDS, id))
        .sum()
}

impl Message for SubscribeRequestIn {
    /// Encodes as the `SubscribeRequest` it stands for (a server never sends one; tests do).
    fn encode_raw(&self, buf: &mut impl BufMut) {
        match self {
            SubscribeRequestIn::Ack(ids) => {
                prost::encoding::encode_key(REQUEST_ACK, WireType::LengthDelimited, buf);
                prost::encoding::encode_varint(ack_len(ids) as u64, buf);
                for id in ids {
                    prost::encoding::bytes::encode(ACK_DELIVERY_IDS, id, buf);
                }
            }
            SubscribeRequestIn::Other(request) => request.encode_raw(buf),
        }
    }

    /// The oneof's rule: the last kind in the message wins, and two `Ack`s merge (their ids
    /// in order). A field that is not one of the kinds is skipped, as the generated message
    /// skips it.
    fn merge_field(
        &mut self,
        tag: u32,
        wire_type: WireType,
        buf: &mut impl Buf,
        ctx: DecodeContext,
    ) -> Result<(), prost::DecodeError> {
        if tag != REQUEST_ACK {
            let mut other = match std::mem::take(self) {
                SubscribeRequestIn::Other(request) => request,
                ack @ SubscribeRequestIn::Ack(_) => {
                    *self = ack;
                    client::SubscribeRequest::default()
                }
            };
            other.merge_field(tag, wire_type, buf, ctx)?;
            if other.kind.is_some() || matches!(self, SubscribeRequestIn::Other(_)) {
                *self = SubscribeRequestIn::Other(other);
            }
            return Ok(());
        }
        let mut body = Bytes::new();
        prost::encoding::bytes::merge(wire_type, &mut body, buf, ctx.clone())?;
        if !matches!(self, SubscribeRequestIn::Ack(_)) {
            *self = SubscribeRequestIn::Ack(Vec::new());
        }
        let SubscribeRequestIn::Ack(ids) = self else {
            return Ok(()); // made an Ack just above
        };
        while body.has_remaining() {
            let (tag, wire_type) = decode_key(&mut body)?;
            if tag == ACK_DELIVERY_IDS {
                let mut id = Bytes::new();
                prost::encoding::bytes::merge(wire_type, &mut id, &mut body, ctx.clone())?;
                ids.push(id);
            } else {
                skip_field(wire_type, tag, &mut body, ctx.clone())?;
            }
        }
        Ok(())
    }

    fn encoded_len(&self) -> usize {
        match self {
            SubscribeRequestIn::Ack(ids) => {
                let body = ack_len(ids);
                prost::encoding::key_len(REQUEST_ACK)
                    + prost::encoding::encoded_len_varint(body as u64)
                    + body
            }
            SubscribeRequestIn::Other(request) => request.encoded_len(),
        }
    }

    fn clear(&mut self) {
        *self = SubscribeRequestIn::default();
    }
}

/// `PublishBatchRequest.topic`.
const PUBLISH_BATCH_TOPIC: u32 = 1;
/// `PublishBatchRequest.entries`.
const PUBLISH_BATCH_ENTRIES: u32 = 2;

/// A `PublishBatchRequest` as a server reads it: each entry kept as the bytes received (a
/// slice of the received message) instead of an `Event` of owned strings and maps. A server
/// reads each entry in place, and an entry that is not a valid `PublishEntry` is that entry's
/// error rather than the whole request's. The topic is decoded as usual.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct PublishBatchRequestIn {
    /// The destination topic.
    pub topic: String,
    /// Each entry, an encoded `PublishEntry` (not checked here), in order.
    pub entries: Vec<Bytes>,
}

impl From<client::PublishBatchRequest> for PublishBatchRequestIn {
    /// The request as a server reads it (each entry encoded).
    fn from(request: client::PublishBatchRequest) -> Self {
        PublishBatchRequestIn {
            topic: request.topic,
            entries: request
                .entries
                .iter()
                .map(|entry| entry.encode_to_vec().into())
                .collect(),
        }
    }
}

impl Message for PublishBatchRequestIn {
    /// Encodes as the `PublishBatchRequest` it stands for (a server never sends one; tests do).
    fn encode_raw(&self, buf: &mut impl BufMut) {
        if !self.topic.is_empty() {
            prost::encoding::string::encode(PUBLISH_BATCH_TOPIC, &self.topic, buf);
        }
        prost::encoding::bytes::encode_repeated(PUBLISH_BATCH_ENTRIES, &self.entries, buf);
    }

    /// The generated message's rules: the last topic wins, entries add up in order, unknown
    /// fields are skipped; a topic that is not UTF-8 fails the request.
    fn merge_field(
        &mut self,
        tag: u32,
        wire_type: WireType,
        buf: &mut impl Buf,
        ctx: DecodeContext,
    ) -> Result<(), prost::DecodeError> {
        match tag {
            PUBLISH_BATCH_TOPIC => {
                prost::encoding::string::merge(wire_type, &mut self.topic, buf, ctx)
            }
            PUBLISH_BATCH_ENTRIES => {
                // A slice of the received message, not a copy (`Buf::copy_to_bytes` of the
                // received `Bytes`).
                let mut entry = Bytes::new();
                prost::encoding::bytes::merge(wire_type, &mut entry, buf, ctx)?;
                self.entries.push(entry);
                Ok(())
            }
            _ => skip_field(wire_type, tag, buf, ctx),
        }
    }

    fn encoded_len(&self) -> usize {
        let topic = if self.topic.is_empty() {
            0
        } else {
            prost::encoding::string::encoded_len(PUBLISH_BATCH_TOPIC, &self.topic)
        };
        topic + prost::encoding::bytes::encoded_len_repeated(PUBLISH_BATCH_ENTRIES, &self.entries)
    }

    fn clear(&mut self) {
        *self = PublishBatchRequestIn::default();
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;
    use crate::client::subscribe_response::Kind;

    fn result(id: &str) -> client::SubscribeResponse {
        client::SubscribeResponse {
            kind: Some(Kind::AckResult(client::AckResult {
                delivery_id: id.into(),
                outcome: client::AckOutcome::Durable as i32,
                detail: String::new(),
            })),
        }
    }

    #[test]
    fn encodes_as_the_message_and_decodes_back() {
        let message = result("1.2.3");
        let encoded = SubscribeResponseBytes::from_message(&message);
        assert_eq!(encoded.encode_to_vec(), message.encode_to_vec());
        assert_eq!(encoded.encoded_len(), message.encoded_len());
        assert_eq!(encoded.decode_message().unwrap(), message);
        let decoded = SubscribeResponseBytes::decode(message.encode_to_vec().as_slice()).unwrap();
        assert_eq!(decoded.decode_message().unwrap(), message);
    }

    #[test]
    fn a_decode_keeps_what_the_message_keeps_and_refuses_what_it_refuses() {
        let mut wire = result("a").encode_to_vec();
        // An unknown field is dropped, as the generated message drops it.
        prost::encoding::encode_key(99, WireType::Varint, &mut wire);
        prost::encoding::encode_varint(7, &mut wire);
        let decoded = SubscribeResponseBytes::decode(wire.as_slice()).unwrap();
        assert_eq!(decoded.decode_message().unwrap(), result("a"));
        // A length running past the end is an error, not a panic.
        let truncated = &result("abcdef").encode_to_vec()[..5];
        assert!(SubscribeResponseBytes::decode(truncated).is_err());
        let mut cleared = decoded;
        cleared.clear();
        assert_eq!(cleared, SubscribeResponseBytes::default());
    }

    fn ack(ids: &[&str]) -> client::SubscribeRequest {
        client::SubscribeRequest {
            kind: Some(client::subscribe_request::Kind::Ack(client::Ack {
                delivery_ids: ids.iter().map(|id| (*id).to_owned()).collect(),
            })),
        }
    }

    fn nack(id: &str) -> client::SubscribeRequest {
        client::SubscribeRequest {
            kind: Some(client::subscribe_request::Kind::Nack(client::Nack {
                delivery_id: id.into(),
                delay_ms: 5,
            })),
        }
    }

    #[test]
    fn a_request_reads_as_the_message_reads_with_ack_ids_as_bytes() {
        for request in [
            ack(&["1.2.3", "", "x"]),
            ack(&[]),
            nack("1.2.4"),
            client::SubscribeRequest::default(),
        ] {
            let wire = request.encode_to_vec();
            let read = SubscribeRequestIn::decode(wire.as_slice()).unwrap();
            assert_eq!(read, SubscribeRequestIn::from(request.clone()));
            assert_eq!(read.encode_to_vec(), wire, "and encodes back the same");
            assert_eq!(read.encoded_len(), wire.len());
        }
    }

    #[test]
    fn kinds_follow_the_oneof_rule_and_ids_need_not_be_text() {
        // Two Acks merge; a later other kind replaces them; an unknown field changes nothing.
        let mut wire = ack(&["a"]).encode_to_vec();
        wire.extend(ack(&["b"]).encode_to_vec());
        let mut unknown = Vec::new();
        prost::encoding::encode_key(9, WireType::Varint, &mut unknown);
        prost::encoding::encode_varint(1, &mut unknown);
        wire.extend(&unknown);
        assert_eq!(
            SubscribeRequestIn::decode(wire.as_slice()).unwrap(),
            SubscribeRequestIn::from(ack(&["a", "b"]))
        );
        wire.extend(nack("c").encode_to_vec());
        assert_eq!(
            SubscribeRequestIn::decode(wire.as_slice()).unwrap(),
            SubscribeRequestIn::from(nack("c"))
        );
        // An id that is not UTF-8 is kept as its bytes (the generated message refuses the
        // whole request).
        let raw = SubscribeRequestIn::Ack(vec![Bytes::from_static(&[0xff, 0x00])]);
        let wire = raw.encode_to_vec();
        assert!(client::SubscribeRequest::decode(wire.as_slice()).is_err());
        assert_eq!(SubscribeRequestIn::decode(wire.as_slice()).unwrap(), raw);
        // A truncated Ack is an error.
        let wire = ack(&["1.2.3"]).encode_to_vec();
        assert!(SubscribeRequestIn::decode(&wire[..wire.len() - 1]).is_err());
    }

    fn batch() -> client::PublishBatchRequest {
        let event = client::Event {
            id: "e-1".into(),
            source: "/orders".into(),
            attributes: [("tenant".into(), "a".into())].into(),
            data: Bytes::from_static(b"{}"),
            ..client::Event::default()
        };
        client::PublishBatchRequest {
            topic: "orders".into(),
            entries: vec![
                client::PublishEntry {
                    event: Some(event),
                    key: "k".into(),
                },
                client::PublishEntry::default(),
            ],
        }
    }

    #[test]
    fn a_batch_reads_with_each_entry_as_its_bytes() {
        for request in [batch(), client::PublishBatchRequest::default()] {
            let wire = request.encode_to_vec();
            let read = PublishBatchRequestIn::decode(Bytes::from(wire.clone())).unwrap();
            assert_eq!(read, PublishBatchRequestIn::from(request.clone()));
            assert_eq!(read.topic, request.topic);
            for (bytes, entry) in read.entries.iter().zip(&request.entries) {
                assert_eq!(
                    &client::PublishEntry::decode(bytes.as_ref()).unwrap(),
                    entry
                );
            }
            assert_eq!(read.encode_to_vec(), wire, "and encodes back the same");
            assert_eq!(read.encoded_len(), wire.len());
        }
    }

    #[test]
    fn a_batchs_entries_are_slices_of_the_received_bytes() {
        let wire = Bytes::from(batch().encode_to_vec());
        let read = PublishBatchRequestIn::decode(wire.clone()).unwrap();
        let range = wire.as_ptr_range();
        // (The second entry is empty: nothing to point at.)
        assert!(!read.entries[0].is_empty());
        let first = read.entries[0].as_ptr_range();
        assert!(
            range.start <= first.start && first.end <= range.end,
            "not copied"
        );
    }

    #[test]
    fn a_batch_follows_the_generated_messages_rules() {
        // A bad entry is kept as its bytes (the generated message refuses the whole batch).
        let mut wire = batch().encode_to_vec();
        prost::encoding::bytes::encode(PUBLISH_BATCH_ENTRIES, &vec![0xffu8, 0xff], &mut wire);
        assert!(client::PublishBatchRequest::decode(wire.as_slice()).is_err());
        let read = PublishBatchRequestIn::decode(wire.as_slice()).unwrap();
        assert_eq!(read.entries.len(), 3);
        assert_eq!(read.entries[2].as_ref(), &[0xff, 0xff]);
        // An unknown field is skipped; a later topic wins.
        let mut wire = batch().encode_to_vec();
        prost::encoding::encode_key(9, WireType::Varint, &mut wire);
        prost::encoding::encode_varint(1, &mut wire);
        prost::encoding::string::encode(PUBLISH_BATCH_TOPIC, &"later".to_owned(), &mut wire);
        let read = PublishBatchRequestIn::decode(wire.as_slice()).unwrap();
        assert_eq!(read.topic, "later");
        assert_eq!(read.entries.len(), 2);
        // An entry of the wrong wire type, a truncated entry, a topic that is not text: errors.
        let mut wire = Vec::new();
        prost::encoding::encode_key(PUBLISH_BATCH_ENTRIES, WireType::Varint, &mut wire);
        prost::encoding::encode_varint(1, &mut wire);
        assert!(PublishBatchRequestIn::decode(wire.as_slice()).is_err());
        let wire = batch().encode_to_vec();
        assert!(PublishBatchRequestIn::decode(&wire[..wire.len() - 1]).is_err());
        let mut wire = Vec::new();
        prost::encoding::bytes::encode(PUBLISH_BATCH_TOPIC, &vec![0xffu8], &mut wire);
        assert!(PublishBatchRequestIn::decode(wire.as_slice()).is_err());
    }
}

//! A `PublishBatchRequest`'s entries read in place.
//!
//! The dispatcher receives a batch's entries as the bytes the client sent
//! ([`eventmesh_proto::encoded::PublishBatchRequestIn`]) and reads each `PublishEntry` here
//! into a [`PublishedEvent`] of slices of those bytes: no `String` per context attribute, no
//! map of owned attribute strings, no copy of the payload before the frame is written
//! ([`crate::event::encode_published`]; an event with binary attributes, which is rare, takes
//! one).
//!
//! The contract is what the generated message (prost) decodes: a field given twice keeps its
//! last value (a message field, `event`, merges), a map entry repeated keeps the last value
//! for its key, a missing map key or value is empty, unknown fields are skipped, and what prost
//! refuses (text that is not UTF-8 in any occurrence, a known field of the wrong wire type, a
//! length running past the end, a bad varint) is refused. Property-tested against prost below.
//! Three differences, all refusals of this entry alone:
//! - a refusal is this entry's answer (INVALID_ARGUMENT), not the whole batch's;
//! - an event naming more than [`FrameLimits::DEFAULT`]'s `max_attributes` distinct
//!   attributes in one map is refused while it is read (its frame would be refused anyway), so
//!   reading stays linear whatever a request holds;
//! - unknown fields nested deeper than prost's recursion limit allows are skipped with the
//!   limit counted from this entry (prost counts from the request; not reproducible, as prost
//!   keeps its counter private).

use std::borrow::Cow;
use std::fmt;

use eventmesh_common::frame::FrameLimits;
use prost::DecodeError;
use prost::encoding::{DecodeContext, WireType, decode_key, decode_varint, skip_field};
use smallvec::SmallVec;

use crate::error::DispatcherError;
use crate::event::{CONTEXT_FIELDS, PublishedEvent};

/// `PublishEntry.event`.
const ENTRY_EVENT: u32 = 1;
/// `PublishEntry.key`.
const ENTRY_KEY: u32 = 2;
/// Field numbers of `Event` (the context attributes are 1 to 6, in `PublishedEvent` order).
const EVENT_ATTRIBUTES: u32 = 7;
const EVENT_DATA: u32 = 8;
const EVENT_BINARY_ATTRIBUTES: u32 = 9;
/// Field numbers of a map entry.
const MAP_KEY: u32 = 1;
const MAP_VALUE: u32 = 2;

/// Why an entry is not a valid `PublishEntry`, in prost's words where prost found it.
#[derive(Debug)]
struct Malformed(Cow<'static, str>);

impl From<DecodeError> for Malformed {
    fn from(err: DecodeError) -> Self {
        Malformed(err.to_string().into())
    }
}

impl fmt::Display for Malformed {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// One entry of a batch, read in place.
#[derive(Debug, PartialEq, Eq)]
pub struct PublishedEntry<'a> {
    /// The event; `None` when the entry has none.
    pub event: Option<PublishedEvent<'a>>,
    /// The ordering key (empty: none).
    pub key: &'a str,
}

/// Reads an encoded `PublishEntry`.
pub fn read_entry(bytes: &[u8]) -> Result<PublishedEntry<'_>, DispatcherError> {
    read_entry_fields(bytes).map_err(|err| {
        DispatcherError::invalid("entry", format!("not a valid PublishEntry: {err}"))
    })
}

fn read_entry_fields(mut buf: &[u8]) -> Result<PublishedEntry<'_>, Malformed> {
    let mut key = "";
    let mut event = None;
    while !buf.is_empty() {
        let (tag, wire_type) = decode_key(&mut buf)?;
        match tag {
            // A message field given more than once merges: each part read over the last.
            ENTRY_EVENT => read_event_fields(
                delimited(&mut buf, wire_type)?,
                event.get_or_insert_with(PublishedEvent::empty),
            )?,
            ENTRY_KEY => key = text(delimited(&mut buf, wire_type)?)?,
            _ => skip_field(wire_type, tag, &mut buf, DecodeContext::default())?,
        }
    }
    Ok(PublishedEntry { event, key })
}

/// Reads an encoded `Event`'s fields into `event`, over what it holds.
fn read_event_fields<'a>(
    mut buf: &'a [u8],
    event: &mut PublishedEvent<'a>,
) -> Result<(), Malformed> {
    while !buf.is_empty() {
        let (tag, wire_type) = decode_key(&mut buf)?;
        match tag {
            1..=6 => {
                // 1 to CONTEXT_FIELDS by the match arm.
                let field = tag as usize - 1;
                debug_assert!(field < CONTEXT_FIELDS);
                event.context[field] = text(delimited(&mut buf, wire_type)?)?;
            }
            EVENT_ATTRIBUTES => {
                let entry = map_entry(delimited(&mut buf, wire_type)?, text)?;
                keep_last(&mut event.attributes, entry)?;
            }
            EVENT_DATA => event.data = delimited(&mut buf, wire_type)?,
            EVENT_BINARY_ATTRIBUTES => {
                let entry = map_entry(delimited(&mut buf, wire_type)?, Ok)?;
                keep_last(&mut event.binary_attributes, entry)?;
            }
            _ => skip_field(wire_type, tag, &mut buf, DecodeContext::default())?,
        }
    }
    Ok(())
}

/// Adds a map entry, replacing an earlier value of the same name (protobuf maps keep the
/// last); refuses a name past the frame's attribute limit. The list stays that short, so a
/// scan is as cheap as hashing and reading an entry stays linear in its size.
fn keep_last<'a, V, const N: usize>(
    list: &mut SmallVec<[(&'a str, V); N]>,
    entry: (&'a str, V),
) -> Result<(), Malformed>
where
    [(&'a str, V); N]: smallvec::Array<Item = (&'a str, V)>,
{
    if let Some(earlier) = list.iter_mut().find(|(name, _)| *name == entry.0) {
        *earlier = entry;
    } else if list.len() >= FrameLimits::DEFAULT.max_attributes {
        return Err(Malformed(
            format!(
                "more than {} attributes in one map",
                FrameLimits::DEFAULT.max_attributes
            )
            .into(),
        ));
    } else {
        list.push(entry);
    }
    Ok(())
}

/// A map entry's key and value (the last occurrence of each), empty when missing. Every
/// occurrence is checked as it is read (the key is text; `value` reads a value: text for
/// `attributes`, bytes as they are for `binary_attributes`), as prost decodes each.
fn map_entry<'a, V: Default>(
    mut buf: &'a [u8],
    value: impl Fn(&'a [u8]) -> Result<V, Malformed>,
) -> Result<(&'a str, V), Malformed> {
    let mut entry = (<&str>::default(), V::default());
    while !buf.is_empty() {
        let (tag, wire_type) = decode_key(&mut buf)?;
        match tag {
            MAP_KEY => entry.0 = text(delimited(&mut buf, wire_type)?)?,
            MAP_VALUE => entry.1 = value(delimited(&mut buf, wire_type)?)?,
            _ => skip_field(wire_type, tag, &mut buf, DecodeContext::default())?,
        }
    }
    Ok(entry)
}

/// A length-delimited field's bytes, taken off the front of `buf`.
fn delimited<'a>(buf: &mut &'a [u8], wire_type: WireType) -> Result<&'a [u8], Malformed> {
    if wire_type != WireType::LengthDelimited {
        return Err(Malformed(
            format!("invalid wire type: {wire_type:?} (expected LengthDelimited)").into(),
        ));
    }
    let len = decode_varint(buf)?;
    let Some(len) = usize::try_from(len).ok().filter(|len| *len <= buf.len()) else {
        return Err(Malformed("buffer underflow".into()));
    };
    let (field, rest) = buf.split_at(len);
    *buf = rest;
    Ok(field)
}

/// A `string` field's text.
fn text(bytes: &[u8]) -> Result<&str, Malformed> {
    std::str::from_utf8(bytes)
        .map_err(|_| Malformed("invalid string value: data is not UTF-8 encoded".into()))
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use std::collections::HashMap;

    use bytes::Bytes;
    use eventmesh_proto::client::{Event, PublishEntry};
    use proptest::prelude::*;
    use prost::Message;
    use prost::encoding::bytes::encode as put_bytes;
    use prost::encoding::encode_key;

    use super::*;
    use crate::event::encode_published;

    fn entry(event: Option<Event>, key: &str) -> PublishEntry {
        PublishEntry {
            event,
            key: key.into(),
        }
    }

    fn full_event() -> Event {
        Event {
            id: "e-1".into(),
            source: "/orders".into(),
            r#type: "order.created".into(),
            subject: "order/7".into(),
            time: "2026-12-07T15:00:00Z".into(),
            data_content_type: "application/json".into(),
            attributes: [
                ("tenant".into(), "a".into()),
                ("zone".into(), String::new()),
            ]
            .into(),
            data: Bytes::from_static(b"{\"n\":1}"),
            binary_attributes: [("sig".into(), Bytes::from_static(&[0xff, 0]))].into(),
        }
    }

    /// What the generated message reads from `wire`, as the event's borrowed fields (sorted,
    /// so lists compare whatever the map order).
    fn reference(decoded: &PublishEntry) -> PublishedEntry<'_> {
        PublishedEntry {
            event: decoded
                .event
                .as_ref()
                .map(|event| sorted(PublishedEvent::of(event))),
            key: &decoded.key,
        }
    }

    fn sorted(mut event: PublishedEvent<'_>) -> PublishedEvent<'_> {
        event.attributes.sort_unstable();
        event.binary_attributes.sort_unstable();
        event
    }

    fn read_sorted(wire: &[u8]) -> Result<PublishedEntry<'_>, DispatcherError> {
        let mut read = read_entry(wire)?;
        read.event = read.event.map(sorted);
        Ok(read)
    }

    #[test]
    fn an_entry_reads_as_the_generated_message_reads() {
        for message in [
            entry(Some(full_event()), "k-1"),
            entry(Some(Event::default()), ""),
            entry(None, "only-a-key"),
            entry(None, ""),
        ] {
            let wire = message.encode_to_vec();
            assert_eq!(read_sorted(&wire).unwrap(), reference(&message));
        }
    }

    #[test]
    fn repeated_fields_keep_the_last_value_and_unknown_fields_are_skipped() {
        let mut wire = entry(Some(full_event()), "k-1").encode_to_vec();
        // A second event part: a new source, the tenant attribute again, a new one.
        let second = Event {
            source: "/billing".into(),
            attributes: [("tenant".into(), "b".into()), ("x".into(), "1".into())].into(),
            ..Event::default()
        };
        wire.extend(entry(Some(second), "k-2").encode_to_vec());
        encode_key(15, WireType::Varint, &mut wire);
        prost::encoding::encode_varint(7, &mut wire);
        let decoded = PublishEntry::decode(wire.as_slice()).unwrap();
        assert_eq!(decoded.key, "k-2");
        assert_eq!(decoded.event.as_ref().unwrap().source, "/billing");
        assert_eq!(decoded.event.as_ref().unwrap().attributes["tenant"], "b");
        assert_eq!(read_sorted(&wire).unwrap(), reference(&decoded));
    }

    #[test]
    fn what_the_generated_message_refuses_is_this_entrys_error() {
        let good = entry(Some(full_event()), "k").encode_to_vec();
        // Truncated anywhere inside.
        for end in 1..good.len() {
            let cut = &good[..end];
            assert_eq!(
                PublishEntry::decode(cut).is_ok(),
                read_entry(cut).is_ok(),
                "cut at {end}"
            );
        }
        // A key that is not UTF-8.
        let mut wire = Vec::new();
        encode_key(ENTRY_KEY, WireType::LengthDelimited, &mut wire);
        prost::encoding::encode_varint(2, &mut wire);
        wire.extend([0xff, 0xfe]);
        assert!(PublishEntry::decode(wire.as_slice()).is_err());
        let err = read_entry(&wire).unwrap_err();
        assert!(matches!(err, DispatcherError::InvalidArgument(_)), "{err}");
        assert!(err.to_string().contains("UTF-8"), "{err}");
        // A known field with the wrong wire type.
        let mut wire = Vec::new();
        encode_key(ENTRY_EVENT, WireType::Varint, &mut wire);
        prost::encoding::encode_varint(1, &mut wire);
        assert!(PublishEntry::decode(wire.as_slice()).is_err());
        assert!(read_entry(&wire).is_err());
    }

    #[test]
    fn a_map_field_of_another_wire_type_is_refused_as_prost_refuses_it() {
        // Entry: event = 1 (7 bytes) holding attributes = 7 keyed as a varint (0x38), then 5
        // and what would be the map entry {key: "a", value: ""}.
        let wire = [0x0a, 0x07, 0x38, 0x05, 0x0a, 0x01, b'a', 0x12, 0x00];
        assert!(PublishEntry::decode(wire.as_slice()).is_err());
        assert!(read_entry(&wire).is_err());
        // Keyed as length-delimited (0x3a): the attribute.
        let wire = [0x0a, 0x07, 0x3a, 0x05, 0x0a, 0x01, b'a', 0x12, 0x00];
        let decoded = PublishEntry::decode(wire.as_slice()).unwrap();
        assert_eq!(decoded.event.as_ref().unwrap().attributes["a"], "");
        assert_eq!(read_sorted(&wire).unwrap(), reference(&decoded));
    }

    #[test]
    fn every_occurrence_of_a_map_key_or_text_value_must_be_text() {
        let map_field = |entry: &[u8]| {
            let mut event = Vec::new();
            put_bytes(EVENT_ATTRIBUTES, &entry.to_vec(), &mut event);
            let mut wire = Vec::new();
            put_bytes(ENTRY_EVENT, &event, &mut wire);
            wire
        };
        // key: 0xff, then key: "a" (the last wins, but the first is not text).
        for entry in [
            [0x0a, 0x01, 0xff, 0x0a, 0x01, b'a'],
            [0x12, 0x01, 0xff, 0x12, 0x01, b'a'],
        ] {
            let wire = map_field(&entry);
            assert!(PublishEntry::decode(wire.as_slice()).is_err());
            assert!(read_entry(&wire).is_err());
        }
    }

    #[test]
    fn an_event_with_more_attributes_than_a_frame_holds_is_refused_while_read() {
        let max = FrameLimits::DEFAULT.max_attributes;
        let with = |count: usize| Event {
            attributes: (0..count)
                .map(|n| (format!("a{n}"), String::new()))
                .collect(),
            ..full_event()
        };
        let at_limit = entry(Some(with(max)), "").encode_to_vec();
        assert!(read_entry(&at_limit).is_ok());
        let past = entry(Some(with(max + 1)), "").encode_to_vec();
        let err = read_entry(&past).unwrap_err();
        assert!(err.to_string().contains("attributes"), "{err}");
        // prost reads it, and its frame is refused with the same code.
        let decoded = PublishEntry::decode(past.as_slice()).unwrap();
        let refused = encode_published(PublishedEvent::of(decoded.event.as_ref().unwrap()));
        assert_eq!(
            tonic::Status::from(refused.unwrap_err()).code(),
            tonic::Status::from(err).code()
        );
    }

    fn name() -> impl Strategy<Value = String> {
        // Ordinary names, reserved and context names, and any text.
        prop_oneof![
            "[a-z]{1,6}",
            Just("emx".to_owned()),
            Just("id".to_owned()),
            Just("traceparent".to_owned()),
            ".{0,4}",
        ]
    }

    fn event_strategy() -> impl Strategy<Value = Event> {
        (
            proptest::collection::vec(".{0,8}", 6),
            proptest::collection::hash_map(name(), ".{0,8}", 0..5),
            proptest::collection::vec(any::<u8>(), 0..64),
            proptest::collection::hash_map(
                name(),
                proptest::collection::vec(any::<u8>(), 0..8),
                0..2,
            ),
        )
            .prop_map(|(context, attributes, data, binary)| Event {
                id: context[0].clone(),
                source: context[1].clone(),
                r#type: context[2].clone(),
                subject: context[3].clone(),
                time: context[4].clone(),
                data_content_type: context[5].clone(),
                attributes,
                data: data.into(),
                binary_attributes: binary
                    .into_iter()
                    .map(|(name, value)| (name, Bytes::from(value)))
                    .collect::<HashMap<_, _>>(),
            })
    }

    proptest! {
        /// Read in place, an entry encodes to the frame its decoded event encodes to, or is
        /// refused with the same code.
        #[test]
        fn an_entry_read_in_place_encodes_as_its_decoded_event(
            mut event in event_strategy(),
            key in ".{0,8}",
        ) {
            // A generated id differs per call; give every event one.
            if event.id.is_empty() {
                event.id = "given".into();
            }
            let wire = entry(Some(event.clone()), &key).encode_to_vec();
            let read = read_entry(&wire).unwrap();
            prop_assert_eq!(read.key, key.as_str());
            let in_place = encode_published(read.event.unwrap());
            let decoded = encode_published(PublishedEvent::of(&event));
            match (in_place, decoded) {
                (Ok((body, id)), Ok((expected, expected_id))) => {
                    prop_assert_eq!(body, expected);
                    prop_assert_eq!(id, expected_id);
                }
                (Err(err), Err(expected)) => prop_assert_eq!(
                    tonic::Status::from(err).code(),
                    tonic::Status::from(expected).code()
                ),
                (got, expected) => prop_assert!(false, "{:?} against {:?}", got, expected),
            }
        }

        /// Any bytes: read in place exactly when the generated message decodes them, and then
        /// to the same fields; never a panic.
        #[test]
        fn any_bytes_read_as_the_generated_message_reads(
            wire in proptest::collection::vec(any::<u8>(), 0..96),
        ) {
            match PublishEntry::decode(wire.as_slice()) {
                Ok(decoded) => prop_assert_eq!(read_sorted(&wire).unwrap(), reference(&decoded)),
                Err(_) => prop_assert!(read_entry(&wire).is_err()),
            }
        }

        /// Valid entries cut or with a byte changed: the same verdict as the generated message.
        #[test]
        fn damaged_entries_read_as_the_generated_message_reads(
            event in event_strategy(),
            at in any::<prop::sample::Index>(),
            byte in any::<u8>(),
        ) {
            let mut wire = entry(Some(event), "k").encode_to_vec();
            let at = at.index(wire.len());
            wire[at] = byte;
            match PublishEntry::decode(wire.as_slice()) {
                Ok(decoded) => prop_assert_eq!(read_sorted(&wire).unwrap(), reference(&decoded)),
                Err(_) => prop_assert!(read_entry(&wire).is_err()),
            }
        }
    }
}

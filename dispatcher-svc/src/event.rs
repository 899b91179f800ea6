//! Events between the client API (`eventmesh.v1.Event`) and the MQ (EventMeshFrame).
//!
//! The CloudEvents context attributes travel as frame attributes with their CloudEvents names
//! (`id`, `source`, `type`, `subject`, `time`, `datacontenttype`), extensions as further
//! attributes, the payload as data. On Publish, user attribute names may not start with `em`
//! (the runtime's prefix) nor repeat a context attribute name (use the field), and the frame
//! must fit [`FrameLimits::DEFAULT`]; on delivery every attribute that is not a context
//! attribute appears in `attributes`, except the puller's stamps (`emmqpartition`,
//! `emmqoffset`, `empopck`): the `Delivery` carries the partition and offset in its own fields,
//! and an event received can be published again as it is (Publish refuses `em` names).

use std::borrow::Cow;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use eventmesh_common::frame::{
    ATTR_BINARY, Frame, FrameError, FrameHead, FrameLimits, FrameView, INLINE_ATTRIBUTES,
    RESERVED_ATTR_PREFIX, check_layout, encode_borrowed, is_runtime_stamp,
};
use eventmesh_proto::TRACEPARENT_ATTRIBUTE;
use eventmesh_proto::client::Event;
use smallvec::SmallVec;

use crate::error::DispatcherError;

const ID: &str = "id";
const SOURCE: &str = "source";
const TYPE: &str = "type";
const SUBJECT: &str = "subject";
const TIME: &str = "time";
const DATA_CONTENT_TYPE: &str = "datacontenttype";
const SPEC_VERSION: &str = "specversion";
const CONTEXT_ATTRIBUTES: [&str; 7] = [
    ID,
    SOURCE,
    TYPE,
    SUBJECT,
    TIME,
    DATA_CONTENT_TYPE,
    SPEC_VERSION,
];

/// A published event's fields, borrowed: from a decoded [`Event`] ([`PublishedEvent::of`]) or
/// read in place from a request's bytes ([`crate::published`]). Each list names an attribute
/// at most once (its constructors keep the last value of a repeated name, as decoding the
/// protobuf map does).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PublishedEvent<'a> {
    /// `id`, `source`, `type`, `subject`, `time`, `datacontenttype`, in the order of the
    /// event's fields (1 to 6); empty when not set.
    pub context: [&'a str; CONTEXT_FIELDS],
    /// The text extension attributes, in no particular order.
    pub attributes: SmallVec<[(&'a str, &'a str); INLINE_ATTRIBUTES]>,
    /// The binary extension attributes, in no particular order (most events have none).
    pub binary_attributes: SmallVec<[(&'a str, &'a [u8]); 2]>,
    /// The payload.
    pub data: &'a [u8],
}

impl<'a> PublishedEvent<'a> {
    /// An event with no field set.
    pub fn empty() -> Self {
        PublishedEvent {
            context: [""; CONTEXT_FIELDS],
            attributes: SmallVec::new(),
            binary_attributes: SmallVec::new(),
            data: &[],
        }
    }

    /// The fields of a decoded event.
    pub fn of(event: &'a Event) -> Self {
        PublishedEvent {
            context: [
                event.id.as_str(),
                event.source.as_str(),
                event.r#type.as_str(),
                event.subject.as_str(),
                event.time.as_str(),
                event.data_content_type.as_str(),
            ],
            attributes: event
                .attributes
                .iter()
                .map(|(name, value)| (name.as_str(), value.as_str()))
                .collect(),
            binary_attributes: event
                .binary_attributes
                .iter()
                .map(|(name, value)| (name.as_str(), value.as_ref()))
                .collect(),
            data: &event.data,
        }
    }

    /// Gives the event a trace context unless it carries its own (as text or bytes), as
    /// [`Event::carry_traceparent`] does.
    pub fn carry_traceparent(&mut self, traceparent: &'a str) {
        let named = |name: &str| name == TRACEPARENT_ATTRIBUTE;
        if self.binary_attributes.iter().any(|(name, _)| named(name))
            || self.attributes.iter().any(|(name, _)| named(name))
        {
            return;
        }
        self.attributes.push((TRACEPARENT_ATTRIBUTE, traceparent));
    }
}

/// Encodes a published event as a frame, generating its id when empty. Returns the frame and
/// the event id.
pub fn encode_for_publish(event: Event) -> Result<(Bytes, String), DispatcherError> {
    encode_published(PublishedEvent::of(&event)).map(|(body, id)| (body, id.into_owned()))
}

/// Encodes a published event as a frame, generating its id when empty: the frame and the
/// event id (borrowed from the event unless generated). Refuses a name in both attribute
/// lists, names reserved for the runtime or naming a context attribute, and what does not fit
/// [`FrameLimits::DEFAULT`].
pub fn encode_published(
    mut event: PublishedEvent<'_>,
) -> Result<(Bytes, Cow<'_, str>), DispatcherError> {
    for (name, _) in &event.binary_attributes {
        if event.attributes.iter().any(|(text, _)| text == name) {
            return Err(DispatcherError::invalid(
                format!("event.binary_attributes[{name:?}]"),
                "is also a text attribute; a name is in one map only",
            ));
        }
    }
    let names = event.attributes.iter().map(|(name, _)| *name);
    for name in names.chain(event.binary_attributes.iter().map(|(name, _)| *name)) {
        if name.starts_with(RESERVED_ATTR_PREFIX) {
            return Err(DispatcherError::invalid(
                format!("event.attributes[{name:?}]"),
                "attribute names starting with `em` are reserved for the runtime",
            ));
        }
        if CONTEXT_ATTRIBUTES.contains(&name) {
            return Err(DispatcherError::invalid(
                format!("event.attributes[{name:?}]"),
                "is a CloudEvents context attribute; set the event's field instead",
            ));
        }
    }
    let id = match event.context[0] {
        "" => Cow::Owned(new_event_id()),
        given => Cow::Borrowed(given),
    };
    let mut values = event.context;
    values[0] = &id;
    // Sorted (names are unique), so equal events encode equally.
    event.attributes.sort_unstable();
    let context = CONTEXT_ATTRIBUTES[..CONTEXT_FIELDS]
        .iter()
        .copied()
        .zip(values)
        .filter(|(_, value)| !value.is_empty());
    // The common case is written straight from the borrowed fields; names are unique, so
    // this is the frame built attribute by attribute below.
    let encoded = if event.binary_attributes.is_empty() {
        let attributes = context.chain(event.attributes.iter().copied());
        encode_borrowed(
            FrameHead::EVENT,
            attributes,
            event.data,
            &FrameLimits::DEFAULT,
        )
    } else {
        let mut frame = Frame::event();
        for (name, value) in context.chain(event.attributes.iter().copied()) {
            frame.set_attribute(name, value);
        }
        event.binary_attributes.sort_unstable();
        for (name, value) in &event.binary_attributes {
            frame.set_binary_attribute(name, value);
        }
        frame.data = Bytes::copy_from_slice(event.data);
        frame.encode(&FrameLimits::DEFAULT)
    };
    let body = encoded.map_err(|err| match err {
        FrameError::FrameLength { .. } | FrameError::DataLength { .. } => {
            DispatcherError::TooLarge(err.to_string())
        }
        other => DispatcherError::invalid("event", other.to_string()),
    })?;
    Ok((body, id))
}

/// Whether a pulled frame will decode into an event: [`read_for_delivery`]'s checks, without
/// building the event and without checking that its text is UTF-8 — puller-svc decoded every
/// record it calls a frame (what it could not decode comes as MALFORMED_FRAME), so what is
/// left to check is the layout within this side's limits.
pub fn check_for_delivery(body: &Bytes) -> Result<(), FrameError> {
    check_layout(body, &FrameLimits::STAMPED)
}

/// A pulled frame read as the client's event, borrowing from it: what a delivery's message
/// carries, without the puller's stamps. [`crate::wire`] writes it to the client as it is.
#[derive(Debug)]
pub struct DeliveredEvent<'a> {
    /// `id`, `source`, `type`, `subject`, `time`, `datacontenttype`, in the order of the
    /// event's fields (1 to 6); a repeated name keeps its last value, as decoding does.
    pub context: [&'a str; CONTEXT_FIELDS],
    /// Every other text attribute in frame order (a repeated name: the last one counts).
    pub attributes: SmallVec<[(&'a str, &'a str); INLINE_ATTRIBUTES]>,
    /// The binary attributes, their bytes decoded (most events have none: no allocation).
    pub binary_attributes: Vec<(&'a str, Vec<u8>)>,
    /// The payload.
    pub data: Bytes,
}

/// How many CloudEvents context attributes the event has fields for.
pub const CONTEXT_FIELDS: usize = 6;

/// Reads a pulled frame (stamped or as stored) as the client's event, without any stamps; fails on what
/// [`check_for_delivery`] refuses.
pub fn read_for_delivery(body: &Bytes) -> Result<DeliveredEvent<'_>, FrameError> {
    // Stamping adds a few attributes to a frame that met the user limits; decode with room.
    let frame = FrameView::decode(body, &FrameLimits::STAMPED)?;
    // Most frames list no binary attribute: then nothing needs looking up per attribute.
    let any_binary = frame.attribute(ATTR_BINARY).is_some();
    let mut event = DeliveredEvent {
        context: [""; CONTEXT_FIELDS],
        attributes: SmallVec::new(),
        binary_attributes: Vec::new(),
        data: frame.data.clone(),
    };
    for &(name, value) in frame.attributes() {
        if name == ATTR_BINARY || is_runtime_stamp(name) {
            continue;
        }
        // A listed value that is not base64 stays a text attribute.
        if any_binary && let Some(bytes) = frame.binary_attribute(name, value) {
            event.binary_attributes.push((name, bytes));
            continue;
        }
        match CONTEXT_ATTRIBUTES[..CONTEXT_FIELDS]
            .iter()
            .position(|context| *context == name)
        {
            Some(field) => event.context[field] = value,
            None => event.attributes.push((name, value)),
        }
    }
    Ok(event)
}

/// Turns a pulled frame (stamped or as stored) into the client's event, without any stamps: the message
/// [`crate::wire`]'s bytes must decode to (its tests' reference).
#[cfg(test)]
pub fn decode_for_delivery(body: &Bytes) -> Result<Event, FrameError> {
    let read = read_for_delivery(body)?;
    let [id, source, r#type, subject, time, data_content_type] = read.context.map(str::to_owned);
    Ok(Event {
        id,
        source,
        r#type,
        subject,
        time,
        data_content_type,
        attributes: read
            .attributes
            .iter()
            .map(|&(name, value)| (name.to_owned(), value.to_owned()))
            .collect(),
        data: read.data,
        binary_attributes: read
            .binary_attributes
            .into_iter()
            .map(|(name, bytes)| (name.to_owned(), Bytes::from(bytes)))
            .collect(),
    })
}

/// A fresh event id: time, process and a counter, unique without coordination.
pub fn new_event_id() -> String {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    static PROCESS: std::sync::OnceLock<u32> = std::sync::OnceLock::new();
    let process = *PROCESS.get_or_init(rand::random::<u32>);
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64);
    let count = COUNTER.fetch_add(1, Ordering::Relaxed);
    format!("{nanos:016x}-{process:08x}-{count:x}")
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn event() -> Event {
        Event {
            source: "/orders".into(),
            r#type: "order.created".into(),
            data: Bytes::from_static(b"{}"),
            attributes: [("tenant".to_owned(), "a".to_owned())].into(),
            ..Event::default()
        }
    }

    #[test]
    fn round_trip_fills_the_id() {
        let (body, id) = encode_for_publish(event()).unwrap();
        assert!(!id.is_empty());
        let back = decode_for_delivery(&body).unwrap();
        assert_eq!(back.id, id);
        assert_eq!(back.source, "/orders");
        assert_eq!(back.r#type, "order.created");
        assert_eq!(back.attributes["tenant"], "a");
        assert_eq!(&back.data[..], b"{}");
        assert_ne!(new_event_id(), new_event_id());
    }

    #[test]
    fn the_pullers_stamps_are_not_delivered_so_an_event_received_can_be_published_again() {
        let (body, _) = encode_for_publish(event()).unwrap();
        let mut stamped = Frame::decode(&body, &FrameLimits::STAMPED).unwrap();
        stamped.set_attribute("emmqpartition", "3");
        stamped.set_attribute("emmqoffset", "41");
        stamped.set_attribute("empopck", "ck");
        let stamped = stamped.encode(&FrameLimits::STAMPED).unwrap();
        let delivered = decode_for_delivery(&stamped).unwrap();
        assert_eq!(
            delivered.attributes,
            [("tenant".to_owned(), "a".to_owned())].into(),
            "user attributes only"
        );
        let (again, id) = encode_for_publish(delivered.clone()).unwrap();
        assert_eq!(id, delivered.id, "the id travels on");
        assert_eq!(decode_for_delivery(&again).unwrap(), delivered);
    }

    #[test]
    fn binary_attributes_round_trip_byte_for_byte() {
        let mut with_bytes = event();
        with_bytes
            .binary_attributes
            .insert("sig".into(), Bytes::from_static(&[0xFF, 0, 0x80]));
        with_bytes
            .binary_attributes
            .insert("plain".into(), Bytes::from_static(b"text"));
        let (body, _) = encode_for_publish(with_bytes).unwrap();
        let back = decode_for_delivery(&body).unwrap();
        assert_eq!(&back.binary_attributes["sig"][..], &[0xFF, 0, 0x80]);
        assert_eq!(
            &back.binary_attributes["plain"][..],
            b"text",
            "binary stays binary"
        );
        assert!(!back.attributes.contains_key("embinary"));
        let mut clash = event();
        clash
            .binary_attributes
            .insert("tenant".into(), Bytes::from_static(b"x"));
        assert!(encode_for_publish(clash).is_err(), "a name in both maps");
    }

    #[test]
    fn reserved_and_context_names_are_refused() {
        for name in ["emmqoffset", "em", "id", "specversion"] {
            let mut bad = event();
            bad.attributes.insert(name.into(), "x".into());
            let err = encode_for_publish(bad).unwrap_err();
            assert!(matches!(err, DispatcherError::InvalidArgument(_)), "{name}");
        }
    }

    /// Without binary attributes the frame is written from the request's fields directly: the
    /// same bytes as building it attribute by attribute (context fields in order, then the
    /// attributes sorted).
    #[test]
    fn a_text_event_is_written_as_its_frame() {
        let mut full = event();
        full.id = "e-1".into();
        full.subject = "order/7".into();
        full.data_content_type = "application/json".into();
        for (name, value) in [("zone", "eu"), ("attempt", "2"), ("b", "")] {
            full.attributes.insert(name.into(), value.into());
        }
        let (body, id) = encode_for_publish(full.clone()).unwrap();
        assert_eq!(id, "e-1");
        let mut expected = Frame::event();
        for (name, value) in [
            (ID, "e-1"),
            (SOURCE, "/orders"),
            (TYPE, "order.created"),
            (SUBJECT, "order/7"),
            (DATA_CONTENT_TYPE, "application/json"),
            ("attempt", "2"),
            ("b", ""),
            ("tenant", "a"),
            ("zone", "eu"),
        ] {
            expected.set_attribute(name, value);
        }
        expected.data = full.data.clone();
        assert_eq!(body, expected.encode(&FrameLimits::DEFAULT).unwrap());
    }

    #[test]
    fn oversized_data_is_too_large() {
        let mut big = event();
        big.data = Bytes::from(vec![0u8; FrameLimits::DEFAULT.max_data_bytes + 1]);
        assert!(matches!(
            encode_for_publish(big).unwrap_err(),
            DispatcherError::TooLarge(_)
        ));
        let mut long_value = event();
        long_value.attributes.insert("k".into(), "v".repeat(5000));
        assert!(encode_for_publish(long_value).is_err());
    }
}

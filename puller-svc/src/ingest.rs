//! Turning whatever a topic holds into a stamped EventMeshFrame (DESIGN §10).
//!
//! Topics are often written by other producers too, so a body is classified first:
//!
//! | body | result |
//! | --- | --- |
//! | an EventMeshFrame (magic, version and every length walk exactly to the end) that decodes | [`BodyKind::Frame`] |
//! | structurally a frame but fails to decode (limits, UTF-8) | [`BodyKind::MalformedFrame`], the original bytes and the reason: dead-lettered, never dropped |
//! | a JSON object with a string `specversion` (structured CloudEvents) that fits the frame limits | [`BodyKind::CloudEventsJson`]: attributes + data |
//! | anything else (including text starting with a UTF-8 BOM, which also begins with `0xEF`) | [`BodyKind::Opaque`]: data = the body, attributes = the message headers |
//!
//! An opaque body or header set that cannot fit a frame is [`BodyKind::MalformedFrame`] too, so
//! it reaches the dead-letter topic with its reason instead of vanishing. Every result is
//! stamped with `emmqpartition` and `emmqoffset` (and `empopck` when the broker needs an ACK)
//! and encoded. Our own frames, the common case, are stamped by appending to their bytes
//! (checked without allocating, one copy); the result decodes exactly as the general path's.
//! A reader that takes a record's place from the record ([`Stamping::ExceptOwnFrames`]) gets
//! our own frames as stored instead (checked the same way, not copied).
//!
//! Fidelity with other producers' records:
//! * header values are kept byte for byte: UTF-8 text as is, anything else base64-encoded and
//!   listed in `embinary` (clients see binary attributes);
//! * a record in the Kafka binding's binary mode (a `ce_specversion` header) has its `ce_*`
//!   headers mapped to the CloudEvents attributes (`ce_id` → `id`, …) and `content-type` to
//!   `datacontenttype`;
//! * an event without an id gets a stable one, `<topic>/<partition>/<offset>`, so consumers
//!   can de-duplicate redeliveries of foreign records too.
//!
//! Tracing: an event whose `traceparent` attribute (the CloudEvents distributed-tracing
//! extension; a Kafka `traceparent` / `ce_traceparent` header arrives as that attribute) holds
//! a sampled context gets a `pull <topic>` span, its child, and the context goes to the
//! dispatcher with the record ([`Ingested::traceparent`]), so no one decodes it again.

use base64::Engine as _;
use bytes::Bytes;
use eventmesh_common::dead_letter::ENVELOPE_LIMITS;
use eventmesh_common::frame::{
    ATTR_MQ_OFFSET, ATTR_MQ_PARTITION, ATTR_POP_CK, Frame, FrameLimits, FrameView,
    append_attributes, is_runtime_stamp, sniff,
};
use eventmesh_common::keys::PartitionId;
use eventmesh_common::trace_context::{EventTrace, Operation, TRACEPARENT};
use smallvec::SmallVec;

/// What the MQ body was.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BodyKind {
    /// One of our frames.
    Frame,
    /// Structured CloudEvents JSON, converted.
    CloudEventsJson,
    /// Anything else, wrapped as data.
    Opaque,
    /// Cannot be delivered as an event; carry the original bytes to the dead-letter topic.
    MalformedFrame,
}

/// Which records [`ingest`] stamps.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stamping {
    /// Every record (what a reader of the frames alone needs).
    Every,
    /// Every record but our own frames with an id, which are handed on exactly as stored
    /// (uncopied; stamps a producer left in one stay as they are): for a caller that takes a
    /// record's place from the record (`PullRequest.bare_frames`).
    ExceptOwnFrames,
}

/// A message header: its name and its value's bytes (empty for a null value).
pub type Header = (String, Bytes);

/// Where a message came from in the MQ.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Origin<'a> {
    /// Its topic.
    pub topic: &'a eventmesh_common::keys::Topic,
    /// Its partition.
    pub partition: &'a PartitionId,
    /// Its offset.
    pub offset: i64,
    /// The broker ACK handle (RocketMQ 5 POP), if any.
    pub pop_ck: Option<&'a str>,
}

/// A message ready to hand to the dispatcher.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Ingested {
    /// What the body was.
    pub kind: BodyKind,
    /// The stamped, encoded frame; for [`BodyKind::MalformedFrame`], the original body.
    pub frame: Bytes,
    /// Why the body could not become a frame.
    pub malformed_reason: Option<String>,
    /// The event's sampled trace context (`traceparent` text), empty when it has none or
    /// span export is off.
    pub traceparent: String,
}

/// Classifies, converts and stamps one MQ message body (`headers`: the message's own
/// headers / user properties, used for opaque bodies; `stamping`: whether our own frames are
/// stamped too).
pub fn ingest(
    body: Bytes,
    headers: &[Header],
    origin: &Origin<'_>,
    limits: &FrameLimits,
    stamping: Stamping,
) -> Ingested {
    if let Some(own) = own_frame(&body, origin, limits, stamping) {
        return own;
    }
    let (kind, converted) = if sniff(&body) {
        (
            BodyKind::Frame,
            Frame::decode(&body, limits).map_err(|e| e.to_string()),
        )
    } else if let Some(event) = cloudevent(&body) {
        (BodyKind::CloudEventsJson, event)
    } else {
        (BodyKind::Opaque, Ok(opaque(&body, headers)))
    };
    let mut traceparent = String::new();
    let stamped = converted.and_then(|mut frame| {
        traceparent = traced(frame.attribute(TRACEPARENT), frame.attribute("id"), origin);
        if frame.attribute("id").is_none_or(str::is_empty) {
            frame.set_attribute(
                "id",
                format!("{}/{}/{}", origin.topic, origin.partition, origin.offset),
            );
        }
        let offset = origin.offset.to_string();
        for (name, value) in stamps(origin, &offset) {
            frame.set_attribute(name, value);
        }
        // Room for the stamps: a frame that met every limit at Publish still passes.
        frame.encode(&limits.stamped()).map_err(|e| e.to_string())
    });
    match stamped {
        Ok(frame) => Ingested {
            kind,
            frame,
            malformed_reason: None,
            traceparent,
        },
        Err(reason) => {
            tracing::warn!(partition = %origin.partition, offset = origin.offset, ?kind, %reason, "MQ body cannot be delivered as an event; it will be dead-lettered");
            malformed(body, format!("{kind:?} body: {reason}"))
        }
    }
}

/// The common case, one of our own frames with its id: handed on as it is
/// ([`Stamping::ExceptOwnFrames`]), or stamped without decoding it into owned attributes and
/// encoding it again — the stamps are appended to the bytes ([`append_attributes`]), which
/// decodes to what the general path builds. `None` when the body needs the general path (not
/// a frame, broken, no id; to be stamped and already stamped).
fn own_frame(
    body: &Bytes,
    origin: &Origin<'_>,
    limits: &FrameLimits,
    stamping: Stamping,
) -> Option<Ingested> {
    // (What decodes passes `sniff` too: no need to ask first.)
    let view = FrameView::decode(body, limits).ok()?;
    if view.attribute("id").is_none_or(str::is_empty) {
        return None;
    }
    let frame = match stamping {
        Stamping::ExceptOwnFrames => body.clone(),
        Stamping::Every => {
            if view
                .attributes()
                .iter()
                .any(|(name, _)| is_runtime_stamp(name))
            {
                return None;
            }
            let offset = origin.offset.to_string();
            let stamps = stamps(origin, &offset);
            append_attributes(body, &stamps, &limits.stamped()).ok()?
        }
    };
    let traceparent = traced(view.attribute(TRACEPARENT), view.attribute("id"), origin);
    Some(Ingested {
        kind: BodyKind::Frame,
        frame,
        malformed_reason: None,
        traceparent,
    })
}

/// The stamps of a record from `origin` (`offset` is its offset as text).
fn stamps<'a>(origin: &Origin<'a>, offset: &'a str) -> SmallVec<[(&'a str, &'a str); 3]> {
    let mut stamps = SmallVec::new();
    stamps.push((ATTR_MQ_PARTITION, origin.partition.as_str()));
    stamps.push((ATTR_MQ_OFFSET, offset));
    if let Some(pop_ck) = origin.pop_ck {
        stamps.push((ATTR_POP_CK, pop_ck));
    }
    stamps
}

/// The event's sampled trace context as text (empty when it has none), recording the read in
/// a `pull <topic>` span when it has one.
fn traced(traceparent: Option<&str>, id: Option<&str>, origin: &Origin<'_>) -> String {
    match traceparent.and_then(|text| Some((text, EventTrace::parse(text)?))) {
        Some((text, trace)) => {
            pulled_span(&trace, id, origin);
            text.to_owned()
        }
        None => String::new(),
    }
}

/// Records the read of a traced event: a `pull <topic>` span, child of its context.
fn pulled_span(trace: &EventTrace, id: Option<&str>, origin: &Origin<'_>) {
    let span = trace.span(Operation::PULL, origin.topic.as_str());
    span.record(
        "messaging.destination.partition.id",
        origin.partition.as_str(),
    );
    span.record("eventmesh.offset", origin.offset);
    if let Some(id) = id {
        span.record("messaging.message.id", id);
    }
}

/// A message that cannot be delivered as an event: its body (cut to what a dead-letter
/// envelope carries, which keeps every pull answer within its message limit) and the reason.
pub fn malformed(body: Bytes, mut reason: String) -> Ingested {
    let keep = ENVELOPE_LIMITS.max_data_bytes;
    let frame = if body.len() > keep {
        reason.push_str(&format!(
            " (original body of {} bytes cut to {keep})",
            body.len()
        ));
        body.slice(..keep)
    } else {
        body
    };
    Ingested {
        kind: BodyKind::MalformedFrame,
        frame,
        malformed_reason: Some(reason),
        traceparent: String::new(),
    }
}

fn opaque(body: &Bytes, headers: &[Header]) -> Frame {
    let mut frame = Frame::event();
    let binary_mode = headers.iter().any(|(name, _)| name == "ce_specversion");
    for (name, value) in headers {
        let name = if binary_mode {
            match name.strip_prefix("ce_") {
                Some("specversion") => continue,
                Some(attribute) => attribute,
                None if name.eq_ignore_ascii_case("content-type") => "datacontenttype",
                None => name.as_str(),
            }
        } else {
            name.as_str()
        };
        frame.set_bytes_attribute(name, value);
    }
    frame.data = body.clone();
    frame
}

/// A structured-mode CloudEvent: `Some` when the body is a JSON object with a string
/// `specversion`; the inner result fails when it cannot be a frame.
fn cloudevent(body: &[u8]) -> Option<Result<Frame, String>> {
    // Cheap pre-check: JSON objects start with `{` after optional whitespace.
    if body.iter().find(|b| !b.is_ascii_whitespace()) != Some(&b'{') {
        return None;
    }
    let serde_json::Value::Object(map) = serde_json::from_slice(body).ok()? else {
        return None;
    };
    if !map
        .get("specversion")
        .is_some_and(serde_json::Value::is_string)
    {
        return None;
    }
    let mut frame = Frame::event();
    for (name, value) in &map {
        match (name.as_str(), value) {
            ("data" | "data_base64", _) => {}
            (_, serde_json::Value::String(text)) => {
                frame.set_attribute(name.as_str(), text.as_str())
            }
            (_, other) => frame.set_attribute(name.as_str(), other.to_string()),
        }
    }
    frame.data = match (map.get("data_base64"), map.get("data")) {
        (Some(serde_json::Value::String(encoded)), _) => {
            match base64::engine::general_purpose::STANDARD.decode(encoded) {
                Ok(bytes) => Bytes::from(bytes),
                Err(err) => return Some(Err(format!("data_base64 is not base64: {err}"))),
            }
        }
        (Some(_), _) => return Some(Err("data_base64 is not a string".into())),
        (None, Some(serde_json::Value::String(text))) => Bytes::from(text.clone().into_bytes()),
        (None, Some(other)) => Bytes::from(other.to_string().into_bytes()),
        (None, None) => Bytes::new(),
    };
    Some(Ok(frame))
}

#[cfg(test)]
mod tests {
    use super::*;

    const LIMITS: FrameLimits = FrameLimits::DEFAULT;

    fn topic() -> &'static eventmesh_common::keys::Topic {
        static TOPIC: std::sync::OnceLock<eventmesh_common::keys::Topic> =
            std::sync::OnceLock::new();
        TOPIC.get_or_init(|| eventmesh_common::keys::Topic::new("orders").unwrap())
    }

    fn origin(partition: &PartitionId) -> Origin<'_> {
        Origin {
            topic: topic(),
            partition,
            offset: 41,
            pop_ck: None,
        }
    }

    fn decoded(ingested: &Ingested) -> Frame {
        Frame::decode(&ingested.frame, &LIMITS).unwrap()
    }

    #[test]
    fn our_frames_are_stamped() {
        let mut frame = Frame::event();
        frame.set_attribute("id", "e-1");
        frame.data = Bytes::from_static(b"payload");
        let partition = PartitionId::number(3);
        let out = ingest(
            frame.encode(&LIMITS).unwrap(),
            &[],
            &origin(&partition),
            &LIMITS,
            Stamping::Every,
        );
        assert_eq!(out.kind, BodyKind::Frame);
        let stamped = decoded(&out);
        assert_eq!(stamped.attribute("id"), Some("e-1"));
        assert_eq!(stamped.attribute("emmqpartition"), Some("3"));
        assert_eq!(stamped.attribute("emmqoffset"), Some("41"));
        assert_eq!(&stamped.data[..], b"payload");
    }

    /// Frames the fast path leaves to the general one: stamped already (a dead-letter topic
    /// read again: the new stamps replace the old, in place) or without an id.
    #[test]
    fn restamped_and_id_less_frames_take_the_general_path_with_the_same_result() {
        let partition = PartitionId::number(3);
        let origin = origin(&partition);
        let mut own = Frame::event();
        own.set_attribute("id", "e-1");
        own.set_attribute("tenant", "a");
        own.data = Bytes::from_static(b"payload");
        let own = own.encode(&LIMITS).unwrap();
        let fast = own_frame(&own, &origin, &LIMITS, Stamping::Every).expect("the fast path");
        assert_eq!(
            fast,
            ingest(own.clone(), &[], &origin, &LIMITS, Stamping::Every)
        );

        let mut stamped = Frame::decode(&fast.frame, &LIMITS.stamped()).unwrap();
        stamped.set_attribute("emmqoffset", "7");
        let stamped = stamped.encode(&LIMITS.stamped()).unwrap();
        assert!(own_frame(&stamped, &origin, &LIMITS, Stamping::Every).is_none());
        let again = ingest(stamped, &[], &origin, &LIMITS, Stamping::Every);
        assert_eq!(again.kind, BodyKind::Frame);
        let again = decoded(&again);
        let names: Vec<&str> = again.attributes().iter().map(|(n, _)| n.as_str()).collect();
        assert_eq!(names, ["id", "tenant", "emmqpartition", "emmqoffset"]);
        assert_eq!(again.attribute("emmqoffset"), Some("41"));

        let mut no_id = Frame::event();
        no_id.data = Bytes::from_static(b"x");
        let no_id = no_id.encode(&LIMITS).unwrap();
        assert!(own_frame(&no_id, &origin, &LIMITS, Stamping::Every).is_none());
        assert_eq!(
            decoded(&ingest(no_id, &[], &origin, &LIMITS, Stamping::Every)).attribute("id"),
            Some("orders/3/41")
        );
    }

    /// A caller that takes a record's place from the record gets our own frames exactly as
    /// stored (the same bytes, not a copy); a frame without an id, or a body that is not a
    /// frame, is made and stamped as always.
    #[test]
    fn own_frames_come_as_stored_when_stamps_are_not_wanted() {
        let partition = PartitionId::number(3);
        let origin = origin(&partition);
        let mut own = Frame::event();
        own.set_attribute("id", "e-1");
        own.data = Bytes::from_static(b"payload");
        let own = own.encode(&LIMITS).unwrap();
        let out = ingest(
            own.clone(),
            &[],
            &origin,
            &LIMITS,
            Stamping::ExceptOwnFrames,
        );
        assert_eq!(out.kind, BodyKind::Frame);
        assert_eq!(out.frame, own);
        assert_eq!(out.frame.as_ptr(), own.as_ptr(), "handed on, not copied");

        let mut no_id = Frame::event();
        no_id.data = Bytes::from_static(b"x");
        let no_id = no_id.encode(&LIMITS).unwrap();
        let made = ingest(no_id, &[], &origin, &LIMITS, Stamping::ExceptOwnFrames);
        let made = decoded(&made);
        assert_eq!(made.attribute("id"), Some("orders/3/41"));
        assert_eq!(made.attribute("emmqoffset"), Some("41"));

        let plain = Bytes::from_static(b"plain");
        let opaque = ingest(plain, &[], &origin, &LIMITS, Stamping::ExceptOwnFrames);
        assert_eq!(opaque.kind, BodyKind::Opaque);
        assert_eq!(decoded(&opaque).attribute("emmqpartition"), Some("3"));
    }

    #[test]
    fn pop_handles_are_stamped_too() {
        let partition = PartitionId::new("broker-a:1").unwrap();
        let origin = Origin {
            topic: topic(),
            partition: &partition,
            offset: 7,
            pop_ck: Some("ck-123"),
        };
        let out = ingest(
            Bytes::from_static(b"plain"),
            &[],
            &origin,
            &LIMITS,
            Stamping::Every,
        );
        assert_eq!(decoded(&out).attribute("empopck"), Some("ck-123"));
    }

    #[test]
    fn structured_cloudevents_json_becomes_attributes_and_data() {
        let body = br#"{"specversion":"1.0","id":"ce-9","source":"/s","type":"t","time":"2026-01-01T00:00:00Z","count":3,"data":{"k":[1,2]}}"#;
        let partition = PartitionId::number(0);
        let out = ingest(
            Bytes::from_static(body),
            &[],
            &origin(&partition),
            &LIMITS,
            Stamping::Every,
        );
        assert_eq!(out.kind, BodyKind::CloudEventsJson);
        let frame = decoded(&out);
        assert_eq!(frame.attribute("id"), Some("ce-9"));
        assert_eq!(frame.attribute("type"), Some("t"));
        assert_eq!(
            frame.attribute("count"),
            Some("3"),
            "non-string values as JSON text"
        );
        assert_eq!(&frame.data[..], br#"{"k":[1,2]}"#);

        let binary = br#"{"specversion":"1.0","id":"b","data_base64":"AAEC"}"#;
        let frame = decoded(&ingest(
            Bytes::from_static(binary),
            &[],
            &origin(&partition),
            &LIMITS,
            Stamping::Every,
        ));
        assert_eq!(&frame.data[..], &[0, 1, 2]);
        let text = br#"{"specversion":"1.0","id":"x","data":"hello"}"#;
        assert_eq!(
            &decoded(&ingest(
                Bytes::from_static(text),
                &[],
                &origin(&partition),
                &LIMITS,
                Stamping::Every,
            ))
            .data[..],
            b"hello"
        );
    }

    #[test]
    fn other_bodies_are_opaque_with_headers_as_attributes() {
        let partition = PartitionId::number(1);
        let headers = vec![("content-type".to_owned(), Bytes::from_static(b"text/plain"))];
        for body in [
            &b"{\"no\":\"specversion\"}"[..],
            b"just text",
            "\u{FEFF}{\"specversion\":\"1.0\"}".as_bytes(),
            &[0xEF, 1, 0, 0],
            b"",
        ] {
            let out = ingest(
                Bytes::copy_from_slice(body),
                &headers,
                &origin(&partition),
                &LIMITS,
                Stamping::Every,
            );
            assert_eq!(out.kind, BodyKind::Opaque, "{body:?}");
            let frame = decoded(&out);
            assert_eq!(&frame.data[..], body);
            assert_eq!(frame.attribute("content-type"), Some("text/plain"));
            assert_eq!(frame.attribute("emmqoffset"), Some("41"));
        }
    }

    /// Records of other producers: their header bytes are kept exactly, Kafka binary-mode
    /// CloudEvents headers become the event's attributes, and an event without an id gets a
    /// stable one (it used to arrive with an empty id, so consumers could not de-duplicate).
    #[test]
    fn foreign_records_keep_header_bytes_and_get_stable_ids() {
        let partition = PartitionId::number(2);
        let headers = vec![
            ("trace".to_owned(), Bytes::from_static(&[0xFF, 0x00, 0x80])),
            ("tenant".to_owned(), Bytes::from_static(b"acme")),
        ];
        let frame = decoded(&ingest(
            Bytes::from_static(b"raw"),
            &headers,
            &origin(&partition),
            &LIMITS,
            Stamping::Every,
        ));
        assert_eq!(frame.binary_attribute("trace").unwrap(), [0xFF, 0x00, 0x80]);
        assert_eq!(frame.attribute("tenant"), Some("acme"));
        assert_eq!(frame.binary_attribute("tenant"), None, "text stays text");
        assert_eq!(
            frame.attribute("id"),
            Some("orders/2/41"),
            "derived, stable"
        );

        let binary_mode = vec![
            ("ce_specversion".to_owned(), Bytes::from_static(b"1.0")),
            ("ce_id".to_owned(), Bytes::from_static(b"ce-77")),
            ("ce_source".to_owned(), Bytes::from_static(b"/java")),
            ("ce_type".to_owned(), Bytes::from_static(b"order.created")),
            ("ce_region".to_owned(), Bytes::from_static(b"eu")),
            (
                "content-type".to_owned(),
                Bytes::from_static(b"application/json"),
            ),
        ];
        let frame = decoded(&ingest(
            Bytes::from_static(b"{}"),
            &binary_mode,
            &origin(&partition),
            &LIMITS,
            Stamping::Every,
        ));
        assert_eq!(frame.attribute("id"), Some("ce-77"));
        assert_eq!(frame.attribute("source"), Some("/java"));
        assert_eq!(frame.attribute("type"), Some("order.created"));
        assert_eq!(frame.attribute("region"), Some("eu"));
        assert_eq!(frame.attribute("datacontenttype"), Some("application/json"));
        assert_eq!(frame.attribute("specversion"), None);
    }

    #[test]
    fn broken_frames_and_oversized_bodies_go_to_the_dead_letter_path() {
        let partition = PartitionId::number(0);
        // Structurally a frame, but the attribute name is not UTF-8.
        let mut broken = vec![0xEF, 1, 3, 0, 0, 0, 0, 0, 0, 1, 0, 0, 0, 0];
        broken.extend_from_slice(&[0, 1, 0xFF, 0, 0, 0, 0]);
        let out = ingest(
            Bytes::from(broken.clone()),
            &[],
            &origin(&partition),
            &LIMITS,
            Stamping::Every,
        );
        assert_eq!(out.kind, BodyKind::MalformedFrame);
        assert_eq!(&out.frame[..], &broken[..], "original bytes kept");
        assert!(out.malformed_reason.unwrap().contains("UTF-8"));

        let huge = Bytes::from(vec![b'x'; LIMITS.max_data_bytes + 1]);
        let out = ingest(
            huge.clone(),
            &[],
            &origin(&partition),
            &LIMITS,
            Stamping::Every,
        );
        assert_eq!(out.kind, BodyKind::MalformedFrame);
        assert_eq!(out.frame, huge);
        assert!(out.malformed_reason.unwrap().contains("data length"));

        let bad_base64 = br#"{"specversion":"1.0","data_base64":"!!"}"#;
        let out = ingest(
            Bytes::from_static(bad_base64),
            &[],
            &origin(&partition),
            &LIMITS,
            Stamping::Every,
        );
        assert_eq!(out.kind, BodyKind::MalformedFrame);
        assert!(out.malformed_reason.unwrap().contains("base64"));
    }
}

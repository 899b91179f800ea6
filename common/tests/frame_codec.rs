//! EventMeshFrame codec: round trips, every limit at the limit and one past it, and the
//! reference's hostile-header cases (FrameLimitsTest, DESIGN §10).

#![allow(clippy::unwrap_used)] // tests and benches: a failed unwrap is a failed run

use bytes::Bytes;
use eventmesh_common::frame::{
    Frame, FrameError, FrameHead, FrameLimits, FrameView, HEADER_LEN, INLINE_ATTRIBUTES,
    MSG_TYPE_EVENT, append_attributes, check_layout, encode_borrowed, sniff,
};
use proptest::prelude::*;

const DEFAULT: FrameLimits = FrameLimits::DEFAULT;
/// Limits large enough to build frames that break the defaults.
const LAX: FrameLimits = FrameLimits {
    max_frame_bytes: 64 * 1024 * 1024,
    max_data_bytes: 32 * 1024 * 1024,
    max_attributes: 1024,
    max_attr_name_bytes: 65_535,
    max_attr_value_bytes: 1024 * 1024,
};

fn frame_with(attrs: usize, name_len: usize, value_len: usize, data_len: usize) -> Frame {
    let mut frame = Frame::event();
    for i in 0..attrs {
        let mut name = format!("a{i}-");
        name.push_str(&"n".repeat(name_len.saturating_sub(name.len())));
        frame.set_attribute(name, "v".repeat(value_len));
    }
    frame.data = Bytes::from(vec![7u8; data_len]);
    frame
}

/// Encodes with lax limits, then checks the default limits accept or reject it both ways.
fn check_both_ways(frame: &Frame, accepted: bool, what: &str) {
    let encoded = frame.encode(&LAX).expect("lax encode");
    assert_eq!(frame.encode(&DEFAULT).is_ok(), accepted, "encode {what}");
    let decoded = Frame::decode(&encoded, &DEFAULT);
    assert_eq!(decoded.is_ok(), accepted, "decode {what}: {decoded:?}");
    if accepted {
        assert_eq!(&decoded.unwrap(), frame);
    }
}

#[test]
fn attribute_count_limit() {
    check_both_ways(&frame_with(64, 4, 1, 0), true, "64 attributes");
    check_both_ways(&frame_with(65, 4, 1, 0), false, "65 attributes");
    assert!(matches!(
        frame_with(65, 4, 1, 0).encode(&DEFAULT),
        Err(FrameError::AttributeCount { count: 65, max: 64 })
    ));
}

#[test]
fn attribute_name_limit() {
    check_both_ways(&frame_with(1, 256, 1, 0), true, "256-byte name");
    check_both_ways(&frame_with(1, 257, 1, 0), false, "257-byte name");
    let err = frame_with(1, 257, 1, 0).encode(&DEFAULT).unwrap_err();
    assert!(err.to_string().contains("attribute name length"), "{err}");
}

#[test]
fn attribute_value_limit() {
    check_both_ways(&frame_with(1, 4, 4096, 0), true, "4096-byte value");
    check_both_ways(&frame_with(1, 4, 4097, 0), false, "4097-byte value");
    let err = frame_with(1, 4, 4097, 0).encode(&DEFAULT).unwrap_err();
    assert!(err.to_string().contains("attribute value length"), "{err}");
}

#[test]
fn data_limit() {
    check_both_ways(&frame_with(0, 0, 0, 8 * 1024 * 1024), true, "8 MiB data");
    check_both_ways(
        &frame_with(0, 0, 0, 8 * 1024 * 1024 + 1),
        false,
        "8 MiB + 1 data",
    );
    let err = frame_with(0, 0, 0, 8 * 1024 * 1024 + 1)
        .encode(&DEFAULT)
        .unwrap_err();
    assert!(err.to_string().contains("data length"), "{err}");
}

#[test]
fn whole_frame_limit() {
    // With the default limits the part limits bind first, so test the frame bound on its own.
    let frame = frame_with(2, 8, 8, 100);
    let len = frame.encoded_len();
    let at = FrameLimits {
        max_frame_bytes: len,
        ..DEFAULT
    };
    let under = FrameLimits {
        max_frame_bytes: len - 1,
        ..DEFAULT
    };
    let encoded = frame.encode(&at).unwrap();
    assert_eq!(encoded.len(), len);
    assert_eq!(Frame::decode(&encoded, &at).unwrap(), frame);
    assert!(matches!(
        frame.encode(&under),
        Err(FrameError::FrameLength { .. })
    ));
    assert!(matches!(
        Frame::decode(&encoded, &under),
        Err(FrameError::FrameLength { .. })
    ));
}

fn header(key_count: u16, data_len: i32) -> Vec<u8> {
    let mut out = vec![0xEF, 1, MSG_TYPE_EVENT, 0, 0, 0, 0, 0];
    out.extend_from_slice(&key_count.to_be_bytes());
    out.extend_from_slice(&data_len.to_be_bytes());
    out
}

/// A frame's bytes written by hand, attributes exactly as given (repeats included).
fn raw_frame(attributes: &[(&str, &str)], data: &[u8]) -> Vec<u8> {
    let mut bytes = header(attributes.len() as u16, data.len() as i32);
    for (name, value) in attributes {
        bytes.extend_from_slice(&(name.len() as u16).to_be_bytes());
        bytes.extend_from_slice(name.as_bytes());
        bytes.extend_from_slice(&(value.len() as i32).to_be_bytes());
        bytes.extend_from_slice(value.as_bytes());
    }
    bytes.extend_from_slice(data);
    bytes
}

#[test]
fn hostile_headers_are_rejected_before_allocating() {
    let mut huge = header(0, i32::MAX);
    huge.resize(64, 0);
    let err = Frame::decode(&Bytes::from(huge), &DEFAULT).unwrap_err();
    assert!(err.to_string().contains("data length"), "{err}");

    let mut many = header(65, 0);
    many.resize(64, 0);
    let err = Frame::decode(&Bytes::from(many), &DEFAULT).unwrap_err();
    assert!(err.to_string().contains("attribute count"), "{err}");

    let short_data = header(0, 10);
    assert_eq!(short_data.len(), HEADER_LEN);
    let err = Frame::decode(&Bytes::from(short_data), &DEFAULT).unwrap_err();
    assert!(err.to_string().contains("buffer"), "{err}");

    let negative = header(0, -1);
    assert!(matches!(
        Frame::decode(&Bytes::from(negative), &DEFAULT),
        Err(FrameError::DataLength { len: -1, .. })
    ));

    assert!(matches!(
        Frame::decode(&Bytes::from_static(&[0xEF, 1, 3]), &DEFAULT),
        Err(FrameError::TooShort { len: 3 })
    ));
    let mut bad_magic = header(0, 0);
    bad_magic[0] = 0xEE;
    assert!(matches!(
        Frame::decode(&Bytes::from(bad_magic), &DEFAULT),
        Err(FrameError::BadMagic(0xEE))
    ));
    let mut bad_version = header(0, 0);
    bad_version[1] = 2;
    let err = Frame::decode(&Bytes::from(bad_version), &DEFAULT).unwrap_err();
    assert_eq!(err.to_string(), "unsupported frame version 2");
}

#[test]
fn trailing_bytes_and_bad_utf8_are_errors() {
    let frame = frame_with(1, 4, 4, 3);
    let mut bytes = frame.encode(&DEFAULT).unwrap().to_vec();
    bytes.push(0);
    assert!(matches!(
        Frame::decode(&Bytes::from(bytes.clone()), &DEFAULT),
        Err(FrameError::TrailingBytes(1))
    ));
    assert!(!sniff(&bytes), "a body with trailing bytes is not a frame");

    let mut bad = header(1, 0);
    bad.extend_from_slice(&1u16.to_be_bytes());
    bad.push(0xFF);
    bad.extend_from_slice(&0i32.to_be_bytes());
    assert!(sniff(&bad), "structurally a frame");
    let bad = Bytes::from(bad);
    assert!(matches!(
        Frame::decode(&bad, &DEFAULT),
        Err(FrameError::InvalidUtf8 { what: "name" })
    ));
    // The layout check leaves the text to whoever checked it before.
    assert!(check_layout(&bad, &DEFAULT).is_ok());
}

#[test]
fn duplicate_names_keep_first_position_and_last_value() {
    let bytes = raw_frame(&[("a", "1"), ("b", "2"), ("a", "3")], b"");
    let frame = Frame::decode(&Bytes::from(bytes), &DEFAULT).unwrap();
    let attrs: Vec<(&str, &str)> = frame
        .attributes()
        .iter()
        .map(|(n, v)| (n.as_str(), v.as_str()))
        .collect();
    assert_eq!(attrs, [("a", "3"), ("b", "2")]);
    let bytes = frame.encode(&DEFAULT).unwrap();
    let view = FrameView::decode(&bytes, &DEFAULT).unwrap();
    assert_eq!(view.attributes(), [("a", "3"), ("b", "2")]);
}

/// The borrowed view reads what the owned frame reads: attributes past the inline capacity,
/// binary attributes (listed and base64), a listed name whose value is not base64.
#[test]
fn the_borrowed_view_agrees_with_the_owned_frame() {
    let mut frame = Frame::event();
    for i in 0..INLINE_ATTRIBUTES + 3 {
        frame.set_attribute(format!("k{i}"), format!("v{i}"));
    }
    frame.set_binary_attribute("sig", &[0xFF, 0, 0x80]);
    frame.set_binary_attribute("bad", b"x");
    frame.set_attribute("bad", "not base64!");
    frame.data = Bytes::from_static(b"payload");
    let bytes = frame.encode(&DEFAULT).unwrap();
    let owned = Frame::decode(&bytes, &DEFAULT).unwrap();
    let view = FrameView::decode(&bytes, &DEFAULT).unwrap();
    let owned_attrs: Vec<(&str, &str)> = owned
        .attributes()
        .iter()
        .map(|(n, v)| (n.as_str(), v.as_str()))
        .collect();
    assert_eq!(view.attributes(), owned_attrs.as_slice());
    assert_eq!(view.data, owned.data);
    for (name, value) in view.attributes() {
        assert_eq!(
            view.binary_attribute(name, value),
            owned.binary_attribute(name),
            "{name}"
        );
    }
    assert_eq!(
        view.binary_attribute("sig", view.attribute("sig").unwrap()),
        Some(vec![0xFF, 0, 0x80])
    );
    assert_eq!(view.binary_attribute("bad", "not base64!"), None);
    assert_eq!(view.binary_attribute("k1", "djE="), None, "not listed");
}

#[test]
fn foreign_bodies_are_not_frames() {
    assert!(!sniff(b"{\"specversion\":\"1.0\",\"id\":\"1\"}"));
    assert!(
        !sniff("\u{FEFF}{\"id\":1}".as_bytes()),
        "UTF-8 BOM starts with 0xEF"
    );
    assert!(!sniff(b""));
    assert!(!sniff(&[0xEF, 1]));
    let frame = frame_with(2, 4, 4, 10);
    assert!(sniff(&frame.encode(&DEFAULT).unwrap()));
}

#[test]
fn reference_byte_layout() {
    // Fixed vector: one attribute "id"="x", data "hi", seq 7, flags 1.
    let mut frame = Frame::event();
    frame.seq = 7;
    frame.flags = 1;
    frame.set_attribute("id", "x");
    frame.data = Bytes::from_static(b"hi");
    let expected: &[u8] = &[
        0xEF, 1, 3, 1, 0, 0, 0, 7, 0, 1, 0, 0, 0, 2, // header
        0, 2, b'i', b'd', 0, 0, 0, 1, b'x', // attribute
        b'h', b'i', // data
    ];
    assert_eq!(&frame.encode(&DEFAULT).unwrap()[..], expected);
}

/// Appending to the encoded bytes gives what setting the attributes and encoding again gives,
/// also when the original repeats a name (appended after the raw entries, first position and
/// last value still decide).
#[test]
fn appending_to_the_bytes_is_setting_and_encoding_again() {
    let bytes = raw_frame(&[("id", "1"), ("b", "2"), ("id", "3")], b"hi");
    let extra = [("emmqpartition", "3"), ("emmqoffset", "41")];
    let appended = append_attributes(&bytes, &extra, &DEFAULT.stamped()).unwrap();
    let mut expected = Frame::decode(&Bytes::from(bytes), &DEFAULT).unwrap();
    for (name, value) in extra {
        expected.set_attribute(name, value);
    }
    let decoded = Frame::decode(&appended, &DEFAULT.stamped()).unwrap();
    assert_eq!(decoded, expected);
    assert_eq!(decoded.attribute("id"), Some("3"));
    assert_eq!(&decoded.data[..], b"hi");
}

#[test]
fn appending_keeps_every_limit() {
    let full = frame_with(64, 4, 1, 3).encode(&DEFAULT).unwrap();
    let stamped = DEFAULT.stamped();
    let three = [("x1", "1"), ("x2", "2"), ("x3", "3")];
    assert!(append_attributes(&full, &three, &stamped).is_ok());
    assert!(matches!(
        append_attributes(&full, &three, &DEFAULT),
        Err(FrameError::AttributeCount { count: 67, max: 64 })
    ));
    let long_value = "v".repeat(DEFAULT.max_attr_value_bytes + 1);
    assert!(matches!(
        append_attributes(&full, &[("x", long_value.as_str())], &stamped),
        Err(FrameError::AttributeValueLength { .. })
    ));
    let long_name = "n".repeat(DEFAULT.max_attr_name_bytes + 1);
    assert!(matches!(
        append_attributes(&full, &[(long_name.as_str(), "v")], &stamped),
        Err(FrameError::AttributeNameLength { .. })
    ));
    let big = frame_with(1, 4, 1, DEFAULT.max_data_bytes)
        .encode(&LAX)
        .unwrap();
    let tight = FrameLimits {
        max_frame_bytes: big.len(),
        ..DEFAULT
    };
    assert!(matches!(
        append_attributes(&big, &[("x", "1")], &tight),
        Err(FrameError::FrameLength { .. })
    ));
}

fn arb_frame() -> impl Strategy<Value = Frame> {
    (
        any::<u8>(),
        any::<u8>(),
        any::<i32>(),
        prop::collection::btree_map("[a-z\u{e9}\u{4e2d}]{0,40}", "\\PC{0,60}", 0..20),
        prop::collection::vec(any::<u8>(), 0..2048),
    )
        .prop_map(|(msg_type, flags, seq, attrs, data)| {
            let mut frame = Frame::default();
            frame.msg_type = msg_type;
            frame.flags = flags;
            frame.seq = seq;
            frame.data = Bytes::from(data);
            for (name, value) in attrs {
                frame.set_attribute(name, value);
            }
            frame
        })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]
    #[test]
    fn encode_decode_round_trips(frame in arb_frame()) {
        let encoded = frame.encode(&DEFAULT).unwrap();
        prop_assert_eq!(encoded.len(), frame.encoded_len());
        prop_assert!(sniff(&encoded));
        prop_assert_eq!(Frame::decode(&encoded, &DEFAULT).unwrap(), frame);
    }

    #[test]
    fn borrowed_parts_encode_as_the_frame(frame in arb_frame()) {
        let head = FrameHead { msg_type: frame.msg_type, flags: frame.flags, seq: frame.seq };
        let attributes = frame.attributes().iter().map(|(n, v)| (n.as_str(), v.as_str()));
        prop_assert_eq!(
            encode_borrowed(head, attributes, &frame.data, &DEFAULT).unwrap(),
            frame.encode(&DEFAULT).unwrap()
        );
    }

    #[test]
    fn appended_frames_decode_as_set_attributes(frame in arb_frame(), offset in any::<i64>()) {
        let encoded = frame.encode(&DEFAULT).unwrap();
        let offset = offset.to_string();
        let extra = [("emmqpartition", "broker-a:1"), ("emmqoffset", offset.as_str())];
        let mut expected = frame.clone();
        for (name, value) in extra {
            expected.set_attribute(name, value);
        }
        let appended = append_attributes(&encoded, &extra, &DEFAULT.stamped()).unwrap();
        prop_assert_eq!(appended.len(), expected.encoded_len());
        let decoded = Frame::decode(&appended, &DEFAULT.stamped()).unwrap();
        prop_assert_eq!(decoded, expected);
    }

    #[test]
    fn appending_to_arbitrary_bytes_never_panics(bytes in prop::collection::vec(any::<u8>(), 0..256)) {
        let _ = append_attributes(&bytes, &[("x", "1")], &DEFAULT.stamped());
    }

    #[test]
    fn arbitrary_bytes_never_panic(bytes in prop::collection::vec(any::<u8>(), 0..256)) {
        let bytes = Bytes::from(bytes);
        let decoded = Frame::decode(&bytes, &DEFAULT);
        // The view accepts and refuses exactly what the owned decode does.
        prop_assert_eq!(
            FrameView::decode(&bytes, &DEFAULT).map(|v| v.attributes().len()).map_err(|e| e.to_string()),
            decoded.as_ref().map(|f| f.attributes().len()).map_err(|e| e.to_string())
        );
        if decoded.is_ok() {
            prop_assert!(sniff(&bytes), "everything that decodes passes the sniff test");
        }
        // The layout check refuses what decoding refuses, for the same reason, except text
        // that is not UTF-8 (decoding may stop at it before the layout's own fault).
        match (check_layout(&bytes, &DEFAULT), &decoded) {
            (Ok(()) | Err(_), Err(FrameError::InvalidUtf8 { .. })) | (Ok(()), Ok(_)) => {}
            (Err(layout), Err(decode)) => prop_assert_eq!(layout.to_string(), decode.to_string()),
            (layout, decode) => prop_assert!(false, "layout {:?}, decode {:?}", layout, decode),
        }
    }
}

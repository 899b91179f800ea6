//! The EventMeshFrame binary codec: the body format of every event the runtime writes to the
//! MQ, byte-compatible with the Java reference.
//!
//! Layout, all integers big-endian:
//!
//! ```text
//! header (14 bytes): [magic 0xEF][version 1][msgType u8][flags u8][seq i32][keyCount u16][dataLen i32]
//! keyCount times:    [nameLen u16][name UTF-8][valLen i32][value UTF-8]
//! then:              dataLen bytes of payload
//! ```
//!
//! Contract:
//! * Limits ([`FrameLimits`]) are enforced on encode and on decode, and decode checks every
//!   length against the limits and the remaining buffer **before** allocating, so a hostile
//!   header cannot make us allocate more than the input size.
//! * A value exactly at a limit is accepted; one more is rejected.
//! * Attribute order is preserved; a name that repeats keeps its first position and its last
//!   value (the reference's `LinkedHashMap` behaviour).
//! * Decode is strict: trailing bytes after the payload are an error. [`sniff`] is the cheap
//!   structural test "is this body a frame at all?" used to tell our frames from foreign
//!   producers' bodies (a UTF-8 BOM also starts with `0xEF`).
//! * `msgType` is carried but not validated, as in the reference.

use bytes::{BufMut, Bytes, BytesMut};
use smallvec::SmallVec;

/// First byte of every frame.
pub const MAGIC: u8 = 0xEF;
/// The only frame version this codec reads and writes.
pub const VERSION: u8 = 1;
/// Size of the fixed header.
pub const HEADER_LEN: usize = 14;

/// Frame message type: a stream request.
pub const MSG_TYPE_STREAM_REQ: u8 = 1;
/// Frame message type: a stream chunk.
pub const MSG_TYPE_STREAM_CHUNK: u8 = 2;
/// Frame message type: an event (what the runtime carries).
pub const MSG_TYPE_EVENT: u8 = 3;

/// Runtime attribute: the RocketMQ 5 POP check key of a pulled message.
pub const ATTR_POP_CK: &str = "empopck";
/// Runtime attribute: the MQ offset of a pulled message, decimal.
pub const ATTR_MQ_OFFSET: &str = "emmqoffset";
/// Runtime attribute: the MQ partition (a `PartitionId`) of a pulled message.
pub const ATTR_MQ_PARTITION: &str = "emmqpartition";
/// Runtime attribute: W3C trace context of the producer.
pub const ATTR_TRACEPARENT: &str = "traceparent";
/// Prefix of attribute names reserved for the runtime; publishers may not use it.
pub const RESERVED_ATTR_PREFIX: &str = "em";
/// Runtime attribute: the names of attributes whose values are bytes that are not UTF-8 text,
/// stored base64-encoded (separated by U+001F). Clients see them as binary attributes.
pub const ATTR_BINARY: &str = "embinary";
const BINARY_SEPARATOR: char = '\u{1f}';

/// Size bounds of a frame. [`FrameLimits::DEFAULT`] are the reference's values.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FrameLimits {
    /// Whole encoded frame.
    pub max_frame_bytes: usize,
    /// Payload.
    pub max_data_bytes: usize,
    /// Number of attributes.
    pub max_attributes: usize,
    /// One attribute name, in bytes.
    pub max_attr_name_bytes: usize,
    /// One attribute value, in bytes.
    pub max_attr_value_bytes: usize,
}

impl FrameLimits {
    /// 16 MiB frame, 8 MiB data, 64 attributes, 256-byte names, 4 KiB values.
    pub const DEFAULT: FrameLimits = FrameLimits {
        max_frame_bytes: 16 * 1024 * 1024,
        max_data_bytes: 8 * 1024 * 1024,
        max_attributes: 64,
        max_attr_name_bytes: 256,
        max_attr_value_bytes: 4096,
    };
}

/// Attributes the runtime may add to a user's frame after Publish checked it against
/// [`FrameLimits::DEFAULT`]: `emmqpartition`, `emmqoffset`, `empopck`, and one spare.
pub const RUNTIME_STAMPS: usize = 4;

/// Whether `name` is one of the stamps a puller adds to a frame it reads
/// ([`ATTR_MQ_PARTITION`], [`ATTR_MQ_OFFSET`], [`ATTR_POP_CK`]): where the record sits in the
/// MQ, which the record itself carries in its own fields once pulled.
pub fn is_runtime_stamp(name: &str) -> bool {
    matches!(name, ATTR_MQ_PARTITION | ATTR_MQ_OFFSET | ATTR_POP_CK)
}

impl FrameLimits {
    /// A published frame plus the runtime's stamps: what a puller encodes and a dispatcher
    /// decodes. A frame at every user limit still fits once stamped.
    pub const STAMPED: FrameLimits = FrameLimits::DEFAULT.stamped();

    /// These limits with room for the runtime's stamps.
    pub const fn stamped(self) -> FrameLimits {
        FrameLimits {
            max_frame_bytes: self.max_frame_bytes + 16 * 1024,
            max_attributes: self.max_attributes + RUNTIME_STAMPS,
            ..self
        }
    }
}

impl Frame {
    /// Sets an attribute whose value may be any bytes: UTF-8 text as it is, anything else
    /// base64-encoded and listed in [`ATTR_BINARY`], so its bytes come back exactly.
    pub fn set_bytes_attribute(&mut self, name: &str, value: &[u8]) {
        match std::str::from_utf8(value) {
            Ok(text) => self.set_attribute(name, text),
            Err(_) => self.set_binary_attribute(name, value),
        }
    }

    /// Sets a binary attribute: base64-encoded and listed in [`ATTR_BINARY`], whatever the
    /// bytes are.
    pub fn set_binary_attribute(&mut self, name: &str, value: &[u8]) {
        use base64::Engine as _;
        self.set_attribute(
            name,
            base64::engine::general_purpose::STANDARD.encode(value),
        );
        let mut names: Vec<String> = self.binary_names().map(str::to_owned).collect();
        if !names.iter().any(|n| n == name) {
            names.push(name.to_owned());
        }
        let listed = names.join(&BINARY_SEPARATOR.to_string());
        self.set_attribute(ATTR_BINARY, listed);
    }

    /// Names of the attributes stored as base64 bytes.
    pub fn binary_names(&self) -> impl Iterator<Item = &str> {
        listed_binary_names(self.attribute(ATTR_BINARY))
    }

    /// The bytes of an attribute listed in [`ATTR_BINARY`]; `None` when it is not one (or is
    /// not valid base64).
    pub fn binary_attribute(&self, name: &str) -> Option<Vec<u8>> {
        binary_value(self.attribute(ATTR_BINARY), name, self.attribute(name))
    }
}

/// The names an [`ATTR_BINARY`] value lists.
fn listed_binary_names(listed: Option<&str>) -> impl Iterator<Item = &str> {
    listed
        .into_iter()
        .flat_map(|listed| listed.split(BINARY_SEPARATOR))
        .filter(|name| !name.is_empty())
}

/// The bytes of attribute `name` with value `value`, when `listed` (the [`ATTR_BINARY`] value)
/// names it and the value is base64.
fn binary_value(listed: Option<&str>, name: &str, value: Option<&str>) -> Option<Vec<u8>> {
    use base64::Engine as _;
    if !listed_binary_names(listed).any(|listed| listed == name) {
        return None;
    }
    base64::engine::general_purpose::STANDARD
        .decode(value?)
        .ok()
}

impl Default for FrameLimits {
    fn default() -> Self {
        Self::DEFAULT
    }
}

/// Why a frame could not be encoded or decoded.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum FrameError {
    /// Fewer than [`HEADER_LEN`] bytes.
    #[error("buffer too short for a frame header: {len} < {HEADER_LEN} bytes")]
    TooShort {
        /// Bytes available.
        len: usize,
    },
    /// The first byte is not [`MAGIC`].
    #[error("bad frame magic 0x{0:02X}")]
    BadMagic(u8),
    /// The version byte is not [`VERSION`].
    #[error("unsupported frame version {0}")]
    UnsupportedVersion(u8),
    /// More attributes than allowed.
    #[error("attribute count {count} exceeds the limit of {max}")]
    AttributeCount {
        /// Attributes claimed or given.
        count: usize,
        /// The limit.
        max: usize,
    },
    /// The payload is negative or larger than allowed.
    #[error("data length {len} is outside 0..={max}")]
    DataLength {
        /// Length claimed or given.
        len: i64,
        /// The limit.
        max: usize,
    },
    /// An attribute name is longer than allowed.
    #[error("attribute name length {len} exceeds the limit of {max}")]
    AttributeNameLength {
        /// Length claimed or given.
        len: usize,
        /// The limit.
        max: usize,
    },
    /// An attribute value is negative or longer than allowed.
    #[error("attribute value length {len} is outside 0..={max}")]
    AttributeValueLength {
        /// Length claimed or given.
        len: i64,
        /// The limit.
        max: usize,
    },
    /// The whole frame is larger than allowed.
    #[error("frame length {len} exceeds the limit of {max}")]
    FrameLength {
        /// The length.
        len: usize,
        /// The limit.
        max: usize,
    },
    /// A length field points past the end of the buffer.
    #[error("buffer underflow reading {what}: need {needed} bytes, {remaining} remain")]
    Truncated {
        /// What was being read.
        what: &'static str,
        /// Bytes needed.
        needed: usize,
        /// Bytes left.
        remaining: usize,
    },
    /// Bytes follow the payload.
    #[error("buffer has {0} trailing bytes after the frame")]
    TrailingBytes(usize),
    /// An attribute name or value is not UTF-8.
    #[error("attribute {what} is not valid UTF-8")]
    InvalidUtf8 {
        /// `name` or `value`.
        what: &'static str,
    },
}

/// A decoded (or to-be-encoded) EventMeshFrame.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Frame {
    /// Message type ([`MSG_TYPE_EVENT`] for events).
    pub msg_type: u8,
    /// Flag bits: bit0 done, bit1 hasError, bit2 hasMeta.
    pub flags: u8,
    /// Stream sequence number (STREAM_CHUNK), 0 otherwise.
    pub seq: i32,
    attributes: Vec<(String, String)>,
    /// The payload.
    pub data: Bytes,
}

impl Frame {
    /// An empty EVENT frame.
    pub fn event() -> Self {
        Frame {
            msg_type: MSG_TYPE_EVENT,
            ..Frame::default()
        }
    }

    /// Attributes in insertion order.
    pub fn attributes(&self) -> &[(String, String)] {
        &self.attributes
    }

    /// The value of an attribute.
    pub fn attribute(&self, name: &str) -> Option<&str> {
        self.attributes
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.as_str())
    }

    /// Sets an attribute: an existing name keeps its position and takes the new value.
    pub fn set_attribute(&mut self, name: impl Into<String>, value: impl Into<String>) {
        let name = name.into();
        let value = value.into();
        match self.attributes.iter_mut().find(|(n, _)| *n == name) {
            Some(slot) => slot.1 = value,
            None => self.attributes.push((name, value)),
        }
    }

    /// Removes an attribute, returning its value.
    pub fn remove_attribute(&mut self, name: &str) -> Option<String> {
        let index = self.attributes.iter().position(|(n, _)| n == name)?;
        Some(self.attributes.remove(index).1)
    }

    /// Size of the encoding of this frame, in bytes.
    pub fn encoded_len(&self) -> usize {
        HEADER_LEN
            + self
                .attributes
                .iter()
                .map(|(n, v)| attribute_len(n, v))
                .sum::<usize>()
            + self.data.len()
    }

    /// Encodes the frame, enforcing `limits`.
    pub fn encode(&self, limits: &FrameLimits) -> Result<Bytes, FrameError> {
        let head = FrameHead {
            msg_type: self.msg_type,
            flags: self.flags,
            seq: self.seq,
        };
        let attributes = self
            .attributes
            .iter()
            .map(|(name, value)| (name.as_str(), value.as_str()));
        encode_borrowed(head, attributes, &self.data, limits)
    }

    /// Decodes a frame, enforcing `limits`. The payload shares `buf`'s memory.
    pub fn decode(buf: &Bytes, limits: &FrameLimits) -> Result<Frame, FrameError> {
        let view = FrameView::decode(buf, limits)?;
        Ok(Frame {
            msg_type: view.msg_type,
            flags: view.flags,
            seq: view.seq,
            attributes: view
                .attributes
                .iter()
                .map(|(name, value)| ((*name).to_owned(), (*value).to_owned()))
                .collect(),
            data: view.data,
        })
    }
}

/// Appends attributes to an encoded frame without decoding it: the header's count grows,
/// the new attributes go after the existing ones, the payload follows unchanged. One copy of
/// the body, no allocation per attribute (the puller stamps every record it reads).
///
/// `body` must be a frame [`FrameView::decode`] accepted, and no appended name may already be
/// in it: then the result decodes to exactly what [`Frame::set_attribute`] of each appended
/// attribute and an encode would give. `limits` bound the result (count, lengths, size).
pub fn append_attributes(
    body: &[u8],
    extra: &[(&str, &str)],
    limits: &FrameLimits,
) -> Result<Bytes, FrameError> {
    let header = Header::parse(body)?;
    let count = header.key_count + extra.len();
    check_count(count, limits)?;
    let data_len = usize::try_from(header.data_len).map_err(|_| FrameError::DataLength {
        len: header.data_len,
        max: limits.max_data_bytes,
    })?;
    let attributes_end = body
        .len()
        .checked_sub(data_len)
        .filter(|end| *end >= HEADER_LEN)
        .ok_or(FrameError::Truncated {
            what: "data",
            needed: data_len,
            remaining: body.len().saturating_sub(HEADER_LEN),
        })?;
    let mut len = body.len();
    for (name, value) in extra {
        check_attribute(name, value, limits)?;
        len += attribute_len(name, value);
    }
    check_frame_len(len, limits)?;
    let mut out = BytesMut::with_capacity(len);
    out.put_slice(&body[..8]);
    // `check_count` keeps the count within u16 for any limits a frame can be decoded with.
    out.put_u16(
        u16::try_from(count).map_err(|_| FrameError::AttributeCount {
            count,
            max: usize::from(u16::MAX),
        })?,
    );
    out.put_slice(&body[10..attributes_end]);
    for (name, value) in extra {
        put_attribute(&mut out, name, value);
    }
    out.put_slice(&body[attributes_end..]);
    Ok(out.freeze())
}

/// Whether `body` is structurally an EventMeshFrame: magic, version, and every length field
/// walking exactly to the end of the body. Limits and UTF-8 are not checked here: a body that
/// passes this test but then fails [`Frame::decode`] is a broken frame (dead-lettered with the
/// reason), while one that fails it is a foreign body (delivered as it is).
pub fn sniff(body: &[u8]) -> bool {
    let Ok(header) = Header::parse(body) else {
        return false;
    };
    if header.data_len < 0 {
        return false;
    }
    let mut pos = HEADER_LEN;
    for _ in 0..header.key_count {
        let Some(name_len) = read_be::<2>(body, pos).map(|b| u16::from_be_bytes(b) as usize) else {
            return false;
        };
        pos += 2 + name_len;
        let Some(value_len) = read_be::<4>(body, pos).map(i32::from_be_bytes) else {
            return false;
        };
        if value_len < 0 {
            return false;
        }
        pos += 4 + value_len as usize;
    }
    pos.checked_add(header.data_len as usize) == Some(body.len())
}

struct Header {
    msg_type: u8,
    flags: u8,
    seq: i32,
    key_count: usize,
    data_len: i64,
}

impl Header {
    fn parse(buf: &[u8]) -> Result<Header, FrameError> {
        if buf.len() < HEADER_LEN {
            return Err(FrameError::TooShort { len: buf.len() });
        }
        if buf[0] != MAGIC {
            return Err(FrameError::BadMagic(buf[0]));
        }
        if buf[1] != VERSION {
            return Err(FrameError::UnsupportedVersion(buf[1]));
        }
        Ok(Header {
            msg_type: buf[2],
            flags: buf[3],
            seq: i32::from_be_bytes([buf[4], buf[5], buf[6], buf[7]]),
            key_count: u16::from_be_bytes([buf[8], buf[9]]) as usize,
            data_len: i32::from_be_bytes([buf[10], buf[11], buf[12], buf[13]]) as i64,
        })
    }
}

fn read_be<const N: usize>(buf: &[u8], pos: usize) -> Option<[u8; N]> {
    buf.get(pos..pos.checked_add(N)?)?.try_into().ok()
}

/// A decoded frame whose attribute names and values borrow the encoded buffer: no allocation
/// up to [`INLINE_ATTRIBUTES`] attributes, none per attribute (the delivery path reads every
/// pulled frame).
/// Validation is exactly [`Frame::decode`]'s, which is this view made owned.
#[derive(Debug, Clone)]
pub struct FrameView<'a> {
    /// Message type.
    pub msg_type: u8,
    /// Flag bits.
    pub flags: u8,
    /// Stream sequence number.
    pub seq: i32,
    /// Attributes in first-seen order; a repeated name keeps its first position and takes the
    /// last value (as [`Frame::set_attribute`] does).
    attributes: SmallVec<[(&'a str, &'a str); INLINE_ATTRIBUTES]>,
    /// The payload (shares the buffer's memory).
    pub data: Bytes,
}

/// Attributes a [`FrameView`] holds without allocating (an event's context attributes, the
/// runtime's stamps and a few extensions).
pub const INLINE_ATTRIBUTES: usize = 12;

impl<'a> FrameView<'a> {
    /// Decodes a frame, enforcing `limits`.
    pub fn decode(buf: &'a Bytes, limits: &FrameLimits) -> Result<FrameView<'a>, FrameError> {
        let text =
            |bytes, what| std::str::from_utf8(bytes).map_err(|_| FrameError::InvalidUtf8 { what });
        // Inline up to INLINE_ATTRIBUTES; beyond, bounded by max_attributes.
        let mut attributes: SmallVec<[(&'a str, &'a str); INLINE_ATTRIBUTES]> = SmallVec::new();
        let (header, data) = walk(buf, limits, |name, value| {
            let (name, value) = (text(name, "name")?, text(value, "value")?);
            match attributes.iter_mut().find(|(n, _)| *n == name) {
                Some(slot) => slot.1 = value,
                None => attributes.push((name, value)),
            }
            Ok(())
        })?;
        Ok(FrameView {
            msg_type: header.msg_type,
            flags: header.flags,
            seq: header.seq,
            attributes,
            data,
        })
    }

    /// Attributes in order.
    pub fn attributes(&self) -> &[(&'a str, &'a str)] {
        &self.attributes
    }

    /// The value of an attribute.
    pub fn attribute(&self, name: &str) -> Option<&'a str> {
        self.attributes
            .iter()
            .find(|(n, _)| *n == name)
            .map(|(_, v)| *v)
    }

    /// The bytes of an attribute listed in [`ATTR_BINARY`] whose value is `value`; `None`
    /// when it is not one (or is not valid base64), as [`Frame::binary_attribute`].
    pub fn binary_attribute(&self, name: &str, value: &str) -> Option<Vec<u8>> {
        binary_value(self.attribute(ATTR_BINARY), name, Some(value))
    }
}

/// Checks everything [`FrameView::decode`] checks but that names and values are UTF-8, without
/// collecting anything: for a frame whose text was already checked (dispatcher-svc, of the
/// frames puller-svc decoded before calling them frames).
pub fn check_layout(buf: &Bytes, limits: &FrameLimits) -> Result<(), FrameError> {
    walk(buf, limits, |_, _| Ok(())).map(drop)
}

/// Walks a frame under `limits`: its header, then `attribute(name, value)` for each attribute
/// as bytes, then the payload, which must end the buffer.
fn walk<'a>(
    buf: &'a Bytes,
    limits: &FrameLimits,
    mut attribute: impl FnMut(&'a [u8], &'a [u8]) -> Result<(), FrameError>,
) -> Result<(Header, Bytes), FrameError> {
    check_frame_len(buf.len(), limits)?;
    let header = Header::parse(buf)?;
    check_count(header.key_count, limits)?;
    check_data_len(header.data_len, limits)?;
    let mut reader = Reader {
        buf,
        pos: HEADER_LEN,
    };
    for _ in 0..header.key_count {
        let name_len = reader.u16("attribute name length")? as usize;
        check_name_len(name_len, limits)?;
        let name = reader.slice(name_len, "name")?;
        let value_len = reader.i32("attribute value length")? as i64;
        check_value_len(value_len, limits)?;
        let value = reader.slice(value_len as usize, "value")?;
        attribute(name, value)?;
    }
    let data = reader.take(header.data_len as usize, "data")?;
    let trailing = buf.len() - reader.pos;
    if trailing != 0 {
        return Err(FrameError::TrailingBytes(trailing));
    }
    Ok((header, data))
}

struct Reader<'a> {
    buf: &'a Bytes,
    pos: usize,
}

impl<'a> Reader<'a> {
    /// The next `len` bytes, borrowed.
    fn slice(&mut self, len: usize, what: &'static str) -> Result<&'a [u8], FrameError> {
        let remaining = self.buf.len() - self.pos;
        if len > remaining {
            return Err(FrameError::Truncated {
                what,
                needed: len,
                remaining,
            });
        }
        let buf: &'a [u8] = self.buf;
        let out = &buf[self.pos..self.pos + len];
        self.pos += len;
        Ok(out)
    }

    /// The next `len` bytes, sharing the buffer's memory.
    fn take(&mut self, len: usize, what: &'static str) -> Result<Bytes, FrameError> {
        let start = self.pos;
        self.slice(len, what)?;
        Ok(self.buf.slice(start..self.pos))
    }

    fn u16(&mut self, what: &'static str) -> Result<u16, FrameError> {
        let b = self.slice(2, what)?;
        Ok(u16::from_be_bytes([b[0], b[1]]))
    }

    fn i32(&mut self, what: &'static str) -> Result<i32, FrameError> {
        let b = self.slice(4, what)?;
        Ok(i32::from_be_bytes([b[0], b[1], b[2], b[3]]))
    }
}

/// A frame's fixed fields other than its lengths.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FrameHead {
    /// Message type ([`MSG_TYPE_EVENT`] for events).
    pub msg_type: u8,
    /// Flag bits.
    pub flags: u8,
    /// Stream sequence number (STREAM_CHUNK), 0 otherwise.
    pub seq: i32,
}

impl FrameHead {
    /// An event's head: [`MSG_TYPE_EVENT`], no flags, sequence 0 (as [`Frame::event`]).
    pub const EVENT: FrameHead = FrameHead {
        msg_type: MSG_TYPE_EVENT,
        flags: 0,
        seq: 0,
    };
}

/// Encodes a frame from borrowed parts, enforcing `limits`: the bytes [`Frame::encode`]
/// writes for a frame with these fields and attributes in this order, without building the
/// [`Frame`] (no owned name or value per attribute). The caller gives each name once; a
/// repeated name is written twice (a [`Frame`] would keep the last value).
pub fn encode_borrowed<'a, I>(
    head: FrameHead,
    attributes: I,
    data: &[u8],
    limits: &FrameLimits,
) -> Result<Bytes, FrameError>
where
    I: Iterator<Item = (&'a str, &'a str)> + Clone,
{
    // Checked in the order a decoder meets the fields: count, payload length, attributes.
    let count = attributes.clone().count();
    check_count(count, limits)?;
    check_data_len(data.len() as i64, limits)?;
    let mut attributes_len = 0;
    for (name, value) in attributes.clone() {
        check_attribute(name, value, limits)?;
        attributes_len += attribute_len(name, value);
    }
    let len = HEADER_LEN + attributes_len + data.len();
    check_frame_len(len, limits)?;
    let mut out = BytesMut::with_capacity(len);
    out.put_u8(MAGIC);
    out.put_u8(VERSION);
    out.put_u8(head.msg_type);
    out.put_u8(head.flags);
    out.put_i32(head.seq);
    // The limit checks above keep these casts lossless.
    out.put_u16(count as u16);
    out.put_i32(data.len() as i32);
    for (name, value) in attributes {
        put_attribute(&mut out, name, value);
    }
    out.put_slice(data);
    Ok(out.freeze())
}

/// Encoded size of one attribute.
fn attribute_len(name: &str, value: &str) -> usize {
    2 + name.len() + 4 + value.len()
}

/// Writes one attribute; its lengths must have passed [`check_attribute`] (which keeps the
/// length casts lossless).
fn put_attribute(out: &mut BytesMut, name: &str, value: &str) {
    out.put_u16(name.len() as u16);
    out.put_slice(name.as_bytes());
    out.put_i32(value.len() as i32);
    out.put_slice(value.as_bytes());
}

fn check_attribute(name: &str, value: &str, limits: &FrameLimits) -> Result<(), FrameError> {
    check_name_len(name.len(), limits)?;
    check_value_len(value.len() as i64, limits)
}

fn check_frame_len(len: usize, limits: &FrameLimits) -> Result<(), FrameError> {
    if len > limits.max_frame_bytes {
        return Err(FrameError::FrameLength {
            len,
            max: limits.max_frame_bytes,
        });
    }
    Ok(())
}

fn check_count(count: usize, limits: &FrameLimits) -> Result<(), FrameError> {
    if count > limits.max_attributes {
        return Err(FrameError::AttributeCount {
            count,
            max: limits.max_attributes,
        });
    }
    Ok(())
}

fn check_data_len(len: i64, limits: &FrameLimits) -> Result<(), FrameError> {
    if len < 0 || len > limits.max_data_bytes as i64 {
        return Err(FrameError::DataLength {
            len,
            max: limits.max_data_bytes,
        });
    }
    Ok(())
}

fn check_name_len(len: usize, limits: &FrameLimits) -> Result<(), FrameError> {
    if len > limits.max_attr_name_bytes {
        return Err(FrameError::AttributeNameLength {
            len,
            max: limits.max_attr_name_bytes,
        });
    }
    Ok(())
}

fn check_value_len(len: i64, limits: &FrameLimits) -> Result<(), FrameError> {
    if len < 0 || len > limits.max_attr_value_bytes as i64 {
        return Err(FrameError::AttributeValueLength {
            len,
            max: limits.max_attr_value_bytes,
        });
    }
    Ok(())
}

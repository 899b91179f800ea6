//! Delivery ids: `<instance epoch>.<group number>.<sequence>`, hexadecimal.
//!
//! The epoch is random per process start, so an id is unique across restarts and instances;
//! the group number routes an ACK to the group that owns the delivery, whichever session of
//! the client it arrives on; the sequence is the delivery within the group. A redelivery keeps
//! its id. Anything that does not parse, or carries another epoch, is answered UNKNOWN.

use std::fmt;

/// A parsed delivery id.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct DeliveryId {
    /// The process start it was issued by.
    pub epoch: u64,
    /// The group within that process.
    pub group: u64,
    /// The delivery within the group.
    pub seq: u64,
}

impl DeliveryId {
    /// Parses an id as sent by a client; `None` when malformed.
    /// Only the canonical form is accepted (what [`fmt::Display`] writes: lowercase hex, no
    /// signs, no leading zeros, exactly three parts), checked without allocating: every ACK
    /// parses one.
    pub fn parse(text: &str) -> Option<DeliveryId> {
        let mut parts = text.split('.');
        let mut next = || canonical_hex(parts.next()?);
        let id = DeliveryId {
            epoch: next()?,
            group: next()?,
            seq: next()?,
        };
        parts.next().is_none().then_some(id)
    }

    /// The id as text, in one allocation.
    pub fn to_text(&self) -> String {
        self.text().as_str().to_owned()
    }

    /// The id as text, on the stack (every delivery writes one into its message).
    pub fn text(&self) -> IdText {
        let mut text = IdText {
            bytes: [0; MAX_TEXT_LEN],
            len: 0,
        };
        for (n, part) in [self.epoch, self.group, self.seq].into_iter().enumerate() {
            if n > 0 {
                text.push(b'.');
            }
            let digits = (64 - part.leading_zeros()).div_ceil(4).max(1);
            for shift in (0..digits).rev() {
                let nibble = (part >> (shift * 4)) & 0xf;
                text.push(b"0123456789abcdef"[nibble as usize]);
            }
        }
        text
    }
}

/// The longest id text: three 16-digit numbers and two dots.
pub const MAX_TEXT_LEN: usize = 3 * 16 + 2;

/// A delivery id's text ([`DeliveryId::text`]).
pub struct IdText {
    bytes: [u8; MAX_TEXT_LEN],
    len: usize,
}

impl IdText {
    fn push(&mut self, byte: u8) {
        self.bytes[self.len] = byte;
        self.len += 1;
    }

    /// The text's bytes (ASCII: hexadecimal digits and dots), as written into messages.
    pub fn as_bytes(&self) -> &[u8] {
        &self.bytes[..self.len]
    }

    /// The text.
    pub fn as_str(&self) -> &str {
        // Only ASCII digits and dots are ever pushed.
        std::str::from_utf8(self.as_bytes()).unwrap_or_default()
    }
}

/// A lowercase hexadecimal number without sign or leading zeros.
fn canonical_hex(part: &str) -> Option<u64> {
    let digits_only = part
        .bytes()
        .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b));
    let no_leading_zero = part.len() == 1 || !part.starts_with('0');
    if part.is_empty() || !digits_only || !no_leading_zero {
        return None;
    }
    u64::from_str_radix(part, 16).ok()
}

impl fmt::Display for DeliveryId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:x}.{:x}.{:x}", self.epoch, self.group, self.seq)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trips_and_refuses_junk() {
        let id = DeliveryId {
            epoch: 0xdead_beef,
            group: 3,
            seq: 1_000,
        };
        assert_eq!(DeliveryId::parse(&id.to_string()), Some(id));
        let extremes = DeliveryId {
            epoch: u64::MAX,
            group: 0,
            seq: 0xa,
        };
        assert_eq!(DeliveryId::parse(&extremes.to_string()), Some(extremes));
        for id in [
            id,
            extremes,
            DeliveryId {
                epoch: 0,
                group: 0x10,
                seq: u64::MAX >> 4,
            },
        ] {
            assert_eq!(
                id.text().as_str(),
                id.to_string(),
                "the stack text is the display form"
            );
            assert_eq!(id.to_text(), id.to_string());
        }
        for junk in [
            "",
            "x",
            "1.2",
            "1.2.3.4",
            "1.2.-3",
            "01.2.3",
            "1.2.3 ",
            "+1.2.3",
            "1.2.A",
            "1.2.3.",
            ".1.2",
            "1..2",
            "1.2.00",
            "1.2.10000000000000000",
        ] {
            assert_eq!(DeliveryId::parse(junk), None, "{junk:?}");
        }
    }
}

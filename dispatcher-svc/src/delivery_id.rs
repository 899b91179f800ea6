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

    /// The id as text, in one allocation (formatting into an empty `String` grows it several
    /// times; every delivery makes one).
    pub fn to_text(&self) -> String {
        use std::fmt::Write as _;
        let mut text = String::with_capacity(3 * 16 + 2);
        let _ = write!(text, "{self}");
        text
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

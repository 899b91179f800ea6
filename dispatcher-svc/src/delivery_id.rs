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
    pub fn parse(text: &str) -> Option<DeliveryId> {
        let mut parts = text.splitn(3, '.');
        let mut next = || u64::from_str_radix(parts.next()?, 16).ok();
        let id = DeliveryId {
            epoch: next()?,
            group: next()?,
            seq: next()?,
        };
        // Exactly the canonical form: no signs, no leading zeros, no extra parts.
        (id.to_string() == text).then_some(id)
    }
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
        for junk in [
            "", "x", "1.2", "1.2.3.4", "1.2.-3", "01.2.3", "1.2.3 ", "+1.2.3",
        ] {
            assert_eq!(DeliveryId::parse(junk), None, "{junk:?}");
        }
    }
}

//! Named crash points for crash tests (DESIGN §6).
//!
//! `EM_DISPATCHER_CRASH_AT=<point>` makes the process abort — like `kill -9`, no cleanup — the
//! first time execution reaches that point, so a test hits a narrow window deterministically:
//!
//! | point | where |
//! | --- | --- |
//! | `after-deliver` | a delivery has just been handed to a client stream; no ACK yet |
//! | `after-offset-write` | an offset write became durable; the deliveries are not retired and nothing was forwarded to the broker |
//! | `before-broker-ack` | a batch of broker ACKs is about to be sent |
//!
//! Unset (the normal case) it costs one relaxed atomic load per point.

use std::sync::OnceLock;

/// A place the process can be told to die.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CrashPoint {
    /// After a delivery was written to a client stream.
    AfterDeliver,
    /// After an offset write became durable, before retiring.
    AfterOffsetWrite,
    /// Before broker ACKs are sent.
    BeforeBrokerAck,
}

impl CrashPoint {
    fn parse(text: &str) -> Option<CrashPoint> {
        match text {
            "after-deliver" => Some(CrashPoint::AfterDeliver),
            "after-offset-write" => Some(CrashPoint::AfterOffsetWrite),
            "before-broker-ack" => Some(CrashPoint::BeforeBrokerAck),
            _ => None,
        }
    }
}

/// The environment variable that arms a crash point.
pub const CRASH_AT_ENV: &str = "EM_DISPATCHER_CRASH_AT";

fn armed() -> Option<CrashPoint> {
    static ARMED: OnceLock<Option<CrashPoint>> = OnceLock::new();
    *ARMED.get_or_init(|| {
        let value = std::env::var(CRASH_AT_ENV).ok()?;
        let point = CrashPoint::parse(&value);
        if point.is_none() {
            tracing::error!(value, "unknown {CRASH_AT_ENV}; no crash point armed");
        }
        point
    })
}

/// Aborts the process if `point` is armed.
pub fn crash_point(point: CrashPoint) {
    if armed() == Some(point) {
        eprintln!("dispatcher-svc: crash point {point:?} reached; aborting");
        std::process::abort();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_parse() {
        assert_eq!(
            CrashPoint::parse("after-deliver"),
            Some(CrashPoint::AfterDeliver)
        );
        assert_eq!(
            CrashPoint::parse("after-offset-write"),
            Some(CrashPoint::AfterOffsetWrite)
        );
        assert_eq!(
            CrashPoint::parse("before-broker-ack"),
            Some(CrashPoint::BeforeBrokerAck)
        );
        assert_eq!(CrashPoint::parse("later"), None);
    }
}

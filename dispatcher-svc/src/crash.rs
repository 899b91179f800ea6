//! Named crash points of dispatcher-svc (see [`eventmesh_common::crash`]).
//!
//! `EM_DISPATCHER_CRASH_AT=<point>` aborts the process the first time it reaches (`<point>:<n>`: the n-th time):
//!
//! | point | where |
//! | --- | --- |
//! | `after-deliver` | a delivery has just been handed to a client stream; no ACK yet |
//! | `after-offset-write` | an offset write became durable; the deliveries are not retired and nothing was forwarded to the broker |
//! | `before-broker-ack` | a batch of broker ACKs is about to be sent |

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

impl eventmesh_common::crash::CrashPoint for CrashPoint {
    const ENV: &'static str = "EM_DISPATCHER_CRASH_AT";
    const SERVICE: &'static str = "dispatcher-svc";
    const ALL: &'static [Self] = &[
        CrashPoint::AfterDeliver,
        CrashPoint::AfterOffsetWrite,
        CrashPoint::BeforeBrokerAck,
    ];
    fn name(self) -> &'static str {
        match self {
            CrashPoint::AfterDeliver => "after-deliver",
            CrashPoint::AfterOffsetWrite => "after-offset-write",
            CrashPoint::BeforeBrokerAck => "before-broker-ack",
        }
    }
}

/// The environment variable that arms a crash point.
pub const CRASH_AT_ENV: &str = <CrashPoint as eventmesh_common::crash::CrashPoint>::ENV;

/// Aborts the process if `point` is armed.
pub fn crash_point(point: CrashPoint) {
    static ARMED: OnceLock<Option<eventmesh_common::crash::Armed<CrashPoint>>> = OnceLock::new();
    eventmesh_common::crash::reach(&ARMED, point);
}

//! Named crash points of dispatcher-svc (see [`eventmesh_common::crash`]).
//!
//! `EM_DISPATCHER_CRASH_AT=<point>` aborts the process the first time it reaches (`<point>:<n>`: the n-th time):
//!
//! | point | where |
//! | --- | --- |
//! | `after-deliver` | a delivery has just been handed to a client stream; no ACK yet |
//! | `after-offset-write` | an offset write became durable; the deliveries are not retired and nothing was forwarded to the broker |
//! | `before-broker-ack` | a batch of broker ACKs is about to be sent |

eventmesh_common::crash_points! {
    /// A place the process can be told to die.
    pub enum CrashPoint: "EM_DISPATCHER_CRASH_AT", "dispatcher-svc" {
        /// After a delivery was written to a client stream.
        AfterDeliver = "after-deliver",
        /// After an offset write became durable, before retiring.
        AfterOffsetWrite = "after-offset-write",
        /// Before broker ACKs are sent.
        BeforeBrokerAck = "before-broker-ack",
    }
}

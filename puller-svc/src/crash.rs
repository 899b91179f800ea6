//! Named crash points of puller-svc (see [`eventmesh_common::crash`]).
//!
//! `EM_PULLER_CRASH_AT=<point>` aborts the process the first time it reaches (`<point>:<n>`: the n-th time):
//!
//! | point | where |
//! | --- | --- |
//! | `after-publish` | a published record is in the MQ; the publisher has no answer yet (it retries: a duplicate) |
//! | `after-pull` | a batch was read and the cursor moved in memory; the dispatcher has not received it |
//! | `before-checkpoint-rename` | a new checkpoint is fsynced as `<file>.tmp`; the old file is still in place |
//! | `after-checkpoint` | a checkpoint is in place, typically ahead of the ACK watermark (boot must rewind) |

use std::sync::OnceLock;

/// A place the process can be told to die.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CrashPoint {
    /// After the MQ accepted a published record, before answering.
    AfterPublish,
    /// After a batch was read, before it is returned.
    AfterPull,
    /// After the temporary checkpoint file is durable, before it replaces the old one.
    BeforeCheckpointRename,
    /// After a checkpoint replaced the old one.
    AfterCheckpoint,
}

impl eventmesh_common::crash::CrashPoint for CrashPoint {
    const ENV: &'static str = "EM_PULLER_CRASH_AT";
    const SERVICE: &'static str = "puller-svc";
    const ALL: &'static [Self] = &[
        CrashPoint::AfterPublish,
        CrashPoint::AfterPull,
        CrashPoint::BeforeCheckpointRename,
        CrashPoint::AfterCheckpoint,
    ];
    fn name(self) -> &'static str {
        match self {
            CrashPoint::AfterPublish => "after-publish",
            CrashPoint::AfterPull => "after-pull",
            CrashPoint::BeforeCheckpointRename => "before-checkpoint-rename",
            CrashPoint::AfterCheckpoint => "after-checkpoint",
        }
    }
}

/// Aborts the process if `point` is armed.
pub fn crash_point(point: CrashPoint) {
    static ARMED: OnceLock<Option<eventmesh_common::crash::Armed<CrashPoint>>> = OnceLock::new();
    eventmesh_common::crash::reach(&ARMED, point);
}

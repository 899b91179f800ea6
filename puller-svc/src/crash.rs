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

eventmesh_common::crash_points! {
    /// A place the process can be told to die.
    pub enum CrashPoint: "EM_PULLER_CRASH_AT", "puller-svc" {
        /// After the MQ accepted a published record, before answering.
        AfterPublish = "after-publish",
        /// After a batch was read, before it is returned.
        AfterPull = "after-pull",
        /// After the temporary checkpoint file is durable, before it replaces the old one.
        BeforeCheckpointRename = "before-checkpoint-rename",
        /// After a checkpoint replaced the old one.
        AfterCheckpoint = "after-checkpoint",
    }
}

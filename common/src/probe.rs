//! Latency probes: where an ACK's time goes between the client's `ack()` and its DURABLE
//! answer, stage by stage (`emctl bench` reads them; docs/BENCHMARKS.md, "Where an ACK's time
//! goes").
//!
//! A probe point marks the moment a sampled delivery passes a stage: every
//! [`SAMPLE_EVERY`]th delivery sequence number of a group. Marks are lines
//! `<stage> <sequence> <unix time in ns>` in `<$EM_PROBE_DIR>/<binary>-<pid>.probes`, written
//! at once (a process killed mid-run keeps what it marked). The directory must exist at the
//! process's first mark (the file is opened then, or never). Wall-clock time, so marks of
//! different processes on one machine compare.
//!
//! Only in builds with the feature `latency-probes` (benchmark builds); without it [`mark`]
//! is an empty inline function. With it, and `EM_PROBE_DIR` unset, a mark costs a remainder
//! and a load.

/// Which delivery sequence numbers are marked: every `SAMPLE_EVERY`th.
pub const SAMPLE_EVERY: u64 = 128;

/// The environment variable naming the directory marks are written to.
pub const DIR_ENV: &str = "EM_PROBE_DIR";

/// A stage of an ACK on its way to DURABLE in dispatcher-svc, in the order it passes them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stage {
    /// The session read the ACK from the client's stream.
    AckRead,
    /// The group shard took the ACK.
    GroupTook,
    /// The group handed the watermarks it moves to the offset writer.
    WriteQueued,
    /// The offset writer's write carrying them succeeded.
    WriteDurable,
    /// The group heard so and answered DURABLE.
    GroupAnswered,
    /// The session's stream put the answer into a message for the client.
    AnswerSent,
}

impl Stage {
    /// Every stage, in order.
    pub const ALL: [Stage; 6] = [
        Stage::AckRead,
        Stage::GroupTook,
        Stage::WriteQueued,
        Stage::WriteDurable,
        Stage::GroupAnswered,
        Stage::AnswerSent,
    ];

    /// The stage's name in the marks.
    pub const fn name(self) -> &'static str {
        match self {
            Stage::AckRead => "ack_read",
            Stage::GroupTook => "group_took",
            Stage::WriteQueued => "write_queued",
            Stage::WriteDurable => "write_durable",
            Stage::GroupAnswered => "group_answered",
            Stage::AnswerSent => "answer_sent",
        }
    }
}

/// Marks delivery `seq` passing `stage` (when sampled and enabled).
#[inline]
pub fn mark(stage: Stage, seq: u64) {
    #[cfg(feature = "latency-probes")]
    if seq.is_multiple_of(SAMPLE_EVERY) {
        enabled::mark(stage, seq);
    }
    #[cfg(not(feature = "latency-probes"))]
    let _ = (stage, seq);
}

#[cfg(feature = "latency-probes")]
mod enabled {
    use std::fs::File;
    use std::io::Write as _;
    use std::sync::{Mutex, OnceLock};
    use std::time::{SystemTime, UNIX_EPOCH};

    use super::{DIR_ENV, Stage};

    /// The marks file, opened at the first mark; `None` when `EM_PROBE_DIR` is unset or the
    /// file cannot be created (a diagnostic never fails the service).
    fn file() -> Option<&'static Mutex<File>> {
        static FILE: OnceLock<Option<Mutex<File>>> = OnceLock::new();
        FILE.get_or_init(|| {
            let dir = std::env::var_os(DIR_ENV)?;
            let exe = std::env::current_exe().ok()?;
            let name = exe.file_name()?.to_string_lossy().into_owned();
            let path =
                std::path::Path::new(&dir).join(format!("{name}-{}.probes", std::process::id()));
            File::create(path).ok().map(Mutex::new)
        })
        .as_ref()
    }

    pub(super) fn mark(stage: Stage, seq: u64) {
        let Some(file) = file() else { return };
        let ns = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |since| since.as_nanos());
        let mut file = file.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        let _ = writeln!(file, "{} {seq} {ns}", stage.name());
    }
}

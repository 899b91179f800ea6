//! The pull cursors of one subscription group on one backend, and the rules that move them.
//!
//! A cursor is the **next** MQ offset the group's reader will read from a partition
//! (exclusive: every offset below it has been handed to the dispatcher). The group's
//! watermark `W` in offset-svc is **inclusive** (every offset `<= W` is settled; `-1` is a
//! group that starts at offset 0 and has settled nothing yet). So after a restart, or when a
//! dispatcher (re)attaches, the reader must resume at `W + 1` at the latest:
//!
//! * [`GroupCursors::align`] — a cursor that is missing or ahead of `W + 1` moves to `W + 1`;
//!   a cursor at or below `W + 1` stays (re-reading settled offsets is harmless: the
//!   dispatcher ignores frames `<= W`). Without a watermark the cursor is dropped, so the
//!   reader starts where a new one starts.
//! * [`GroupCursors::position`] — the dispatcher names the exact position (at Attach, and in
//!   every Pull to confirm where its last kept batch ended); the cursor is set to it.
//! * [`GroupCursors::resolve`] — a partition with no cursor starts at the configured start; a
//!   cursor below the log start (retention removed records) moves to the log start and reports
//!   how many offsets were lost to retention; a cursor past the log end (the topic was
//!   recreated, or the broker lost records) is **not** moved: it is reported, and the caller
//!   decides (the dispatcher rewinds the group, counted and logged there).
//! * [`GroupCursors::advance`] — only forward, and only for records actually handed on.
//!
//! Cursors persist in the group's checkpoint file ([`crate::checkpoint`]); a checkpoint writes
//! only when something changed. It copies the cursors under the group's lock and writes the
//! copy (two fsyncs, milliseconds on a busy disk) outside it, so the group's reads and the
//! blocking pool's other work never wait for the disk. Writes of one file are serialized, an
//! older copy never replaces a newer one, and a copy of an evicted group never brings its
//! removed file back.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use eventmesh_common::keys::{GroupName, PartitionId, PullKey, Topic};

use crate::checkpoint::{self, CheckpointError, Cursors, Loaded};

/// Where a partition without a cursor starts.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum StartAt {
    /// The oldest retained record.
    #[default]
    Earliest,
    /// The next record to be appended.
    Latest,
}

/// What [`GroupCursors::align`] did to one cursor.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Alignment {
    /// No watermark: nothing known to align to.
    NoWatermark,
    /// The cursor was at or below `W + 1` and stays.
    Kept(i64),
    /// The cursor was missing (`from: None`) or ahead, and now is `W + 1`.
    Rewound {
        /// The cursor before.
        from: Option<i64>,
        /// `W + 1`.
        to: i64,
    },
}

/// What [`GroupCursors::resolve`] did to one cursor.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Resolution {
    /// The cursor is inside the log; nothing changed.
    InRange(i64),
    /// No cursor: set to the configured start.
    Started(i64),
    /// Below the log start: moved to it; `lost` offsets were removed by retention unread.
    LostToRetention {
        /// The new cursor (the log start).
        to: i64,
        /// How many offsets were never read.
        lost: i64,
    },
    /// Past the log end (topic recreated, or records lost by the broker): left where it is.
    PastEnd(i64),
}

/// The cursors of one group on one backend, with their checkpoint file.
#[derive(Debug)]
pub struct GroupCursors {
    cursors: Cursors,
    /// Counts the changes to `cursors`; the file is stale while it holds fewer.
    changes: u64,
    file: Arc<CheckpointFile>,
}

/// One group's checkpoint file, shared by the cursors and the copies being written.
#[derive(Debug)]
struct CheckpointFile {
    path: PathBuf,
    /// The change count of the copy the file holds (0: as loaded).
    written: AtomicU64,
    /// Held while a copy is written, so writes of the file never interleave; `true` once the
    /// group was evicted and the file removed.
    removed: Mutex<bool>,
}

/// A copy of a group's cursors, to be written to its checkpoint file without the group's lock.
#[derive(Debug)]
pub struct Snapshot {
    cursors: Cursors,
    changes: u64,
    file: Arc<CheckpointFile>,
}

impl Snapshot {
    /// Writes the copy atomically unless the file already holds it or a newer one, or the
    /// group was evicted; `true` when it wrote. A failed write leaves the file stale, so the
    /// next checkpoint writes again.
    pub fn write(self) -> Result<bool, CheckpointError> {
        let removed = self.file.removed.lock().unwrap_or_else(|p| p.into_inner());
        if *removed || self.file.written.load(Ordering::Acquire) >= self.changes {
            return Ok(false);
        }
        checkpoint::store(&self.file.path, &self.cursors)?;
        crate::crash::crash_point(crate::crash::CrashPoint::AfterCheckpoint);
        self.file.written.store(self.changes, Ordering::Release);
        Ok(true)
    }
}

impl GroupCursors {
    /// Loads the group's checkpoint in `dir` (an unusable file is set aside and the group
    /// starts without cursors: alignment and the configured start then decide).
    pub fn load(dir: &std::path::Path, backend: &str, group: Option<&GroupName>) -> Self {
        let path = checkpoint::path(dir, backend, group);
        let loaded = checkpoint::load(&path);
        if let Loaded::Cursors(cursors) = &loaded {
            tracing::info!(file = %path.display(), cursors = cursors.len(), "pull cursors loaded");
        }
        GroupCursors {
            cursors: loaded.into_cursors(),
            changes: 0,
            file: Arc::new(CheckpointFile {
                path,
                written: AtomicU64::new(0),
                removed: Mutex::new(false),
            }),
        }
    }

    /// The cursor of a partition.
    pub fn get(&self, key: &PullKey) -> Option<i64> {
        self.cursors.get(key).copied()
    }

    /// Every cursor.
    pub fn all(&self) -> &Cursors {
        &self.cursors
    }

    fn set(&mut self, key: &PullKey, next: i64) {
        if self.cursors.insert(key.clone(), next) != Some(next) {
            self.changes += 1;
        }
    }

    /// Sets a cursor to the position its dispatcher names; returns the cursor before when it
    /// differed (a re-read after a lost response, or a new position at Attach).
    pub fn position(&mut self, key: &PullKey, next: i64) -> Option<Option<i64>> {
        let before = self.get(key);
        (before != Some(next)).then(|| {
            self.set(key, next);
            before
        })
    }

    /// Applies the group's inclusive watermark `W` (None: nothing stored; `-1`: nothing settled
    /// yet, start at 0) to one cursor.
    pub fn align(&mut self, key: &PullKey, watermark: Option<i64>) -> Alignment {
        let Some(watermark) = watermark.filter(|w| *w >= -1) else {
            // Nothing of this group is settled here: whatever the reader passed may be
            // un-ACKed, so it starts over where a new reader starts (the configured start).
            // Dispatchers store a watermark whenever a group starts later than that.
            if let Some(from) = self.cursors.remove(key) {
                self.changes += 1;
                tracing::info!(%key, from, "pull cursor without a watermark dropped: the reader restarts at the configured start");
            }
            return Alignment::NoWatermark;
        };
        let resume = watermark + 1;
        match self.get(key) {
            Some(cursor) if cursor <= resume => Alignment::Kept(cursor),
            from => {
                self.set(key, resume);
                tracing::info!(%key, ?from, to = resume, "pull cursor aligned to the ACK watermark");
                Alignment::Rewound { from, to: resume }
            }
        }
    }

    /// Where a read of one partition starts, given its retained range `[log_start, log_end)`;
    /// changes nothing (a poll applies it with [`GroupCursors::settle_read`] once its batch
    /// is built, so a failed poll moves nothing).
    pub fn classify(
        &self,
        key: &PullKey,
        log_start: i64,
        log_end: i64,
        start_at: StartAt,
    ) -> Resolution {
        match self.get(key) {
            None => Resolution::Started(match start_at {
                StartAt::Earliest => log_start,
                StartAt::Latest => log_end,
            }),
            Some(cursor) if cursor < log_start => Resolution::LostToRetention {
                to: log_start,
                lost: log_start - cursor,
            },
            Some(cursor) if cursor > log_end => Resolution::PastEnd(cursor),
            Some(cursor) => Resolution::InRange(cursor),
        }
    }

    /// Fits one cursor into the partition's retained range `[log_start, log_end)` and applies
    /// the result at once (see [`GroupCursors::classify`]).
    pub fn resolve(
        &mut self,
        key: &PullKey,
        log_start: i64,
        log_end: i64,
        start_at: StartAt,
    ) -> Resolution {
        let resolution = self.classify(key, log_start, log_end, start_at);
        match resolution {
            Resolution::Started(to) | Resolution::LostToRetention { to, .. } => self.set(key, to),
            Resolution::InRange(_) | Resolution::PastEnd(_) => {}
        }
        resolution
    }

    /// Records where a poll left a partition: `next` after what it handed on (a started or
    /// retention-moved cursor moves even when no record followed).
    pub fn settle_read(&mut self, key: &PullKey, next: i64) {
        self.set(key, next);
    }

    /// Moves a cursor forward to `next` after records below it were handed on; never back.
    pub fn advance(&mut self, key: &PullKey, next: i64) {
        if self.get(key).is_none_or(|cursor| next > cursor) {
            self.set(key, next);
        }
    }

    /// Forgets the cursors of `topic`; `true` when none is left (the file can go).
    fn forget_topic(&mut self, topic: &Topic) -> bool {
        let before = self.cursors.len();
        self.cursors.retain(|key, _| key.topic != *topic);
        if self.cursors.len() != before {
            self.changes += 1;
        }
        self.cursors.is_empty()
    }

    /// Removes the checkpoint file for good: a write in progress finishes first, and no copy
    /// taken before is written after.
    fn remove_file(&self) -> std::io::Result<()> {
        let mut removed = self.file.removed.lock().unwrap_or_else(|p| p.into_inner());
        *removed = true;
        match std::fs::remove_file(&self.file.path) {
            Err(err) if err.kind() == std::io::ErrorKind::NotFound => Ok(()),
            done => done,
        }
    }

    /// A copy of the cursors to write, if anything changed since the file was last written.
    pub fn snapshot(&self) -> Option<Snapshot> {
        (self.changes > self.file.written.load(Ordering::Acquire)).then(|| Snapshot {
            cursors: self.cursors.clone(),
            changes: self.changes,
            file: Arc::clone(&self.file),
        })
    }
}

#[cfg(test)]
impl GroupCursors {
    /// Writes the checkpoint now, with the cursors borrowed (the service writes through
    /// [`CursorBook::checkpoint_all`], which lets go of the group's lock first).
    fn checkpoint(&mut self) -> Result<bool, CheckpointError> {
        self.snapshot().map_or(Ok(false), Snapshot::write)
    }
}

/// Every group's cursors of one backend, loaded on first use: what each backend keeps.
/// Each group has its own lock, so groups never wait for each other.
#[derive(Debug)]
pub struct CursorBook {
    dir: PathBuf,
    backend: &'static str,
    groups: Mutex<HashMap<Option<GroupName>, Arc<Mutex<GroupCursors>>>>,
}

impl CursorBook {
    /// Cursors of `backend` with their checkpoint files in `dir`.
    pub fn new(dir: impl Into<PathBuf>, backend: &'static str) -> Self {
        CursorBook {
            dir: dir.into(),
            backend,
            groups: Mutex::new(HashMap::new()),
        }
    }

    /// Runs `work` on a group's cursors (loading its checkpoint the first time).
    pub fn with<T>(
        &self,
        group: &Option<GroupName>,
        work: impl FnOnce(&mut GroupCursors) -> T,
    ) -> T {
        // Only the group's own lock is held while `work` runs.
        let shared = {
            let mut groups = self.groups.lock().unwrap_or_else(|p| p.into_inner());
            Arc::clone(groups.entry(group.clone()).or_insert_with(|| {
                Arc::new(Mutex::new(GroupCursors::load(
                    &self.dir,
                    self.backend,
                    group.as_ref(),
                )))
            }))
        };
        let mut cursors = shared.lock().unwrap_or_else(|p| p.into_inner());
        work(&mut cursors)
    }

    /// A group's cursors on one topic.
    pub fn list(&self, group: &Option<GroupName>, topic: &Topic) -> Vec<(PartitionId, i64)> {
        self.with(group, |cursors| {
            cursors
                .all()
                .iter()
                .filter(|(key, _)| key.topic == *topic)
                .map(|(key, next)| (key.partition.clone(), *next))
                .collect()
        })
    }

    /// Forgets a group's cursors on `topic` (a reader no one used for a long time); a group
    /// left without cursors is dropped from memory and its checkpoint file deleted. Its next
    /// Attach positions it again.
    pub fn evict(&self, group: &Option<GroupName>, topic: &Topic) {
        let mut groups = self.groups.lock().unwrap_or_else(|p| p.into_inner());
        let Some(shared) = groups.get(group).cloned() else {
            return;
        };
        let mut cursors = shared.lock().unwrap_or_else(|p| p.into_inner());
        if cursors.forget_topic(topic) {
            groups.remove(group);
            let file = cursors.file.path.display();
            match cursors.remove_file() {
                Ok(()) => tracing::info!(%file, "idle reader evicted; its checkpoint removed"),
                Err(error) => {
                    tracing::warn!(%file, %error, "removing an evicted reader's checkpoint failed");
                }
            }
        }
    }

    /// Groups whose cursors are in memory.
    pub fn group_count(&self) -> usize {
        self.groups.lock().unwrap_or_else(|p| p.into_inner()).len()
    }

    /// Checkpoints every group that changed, each from a copy taken under its lock and
    /// written without it.
    pub fn checkpoint_all(&self) -> Result<(), CheckpointError> {
        let groups: Vec<Arc<Mutex<GroupCursors>>> = self
            .groups
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .values()
            .cloned()
            .collect();
        for shared in groups {
            let snapshot = shared.lock().unwrap_or_else(|p| p.into_inner()).snapshot();
            if let Some(snapshot) = snapshot {
                snapshot.write()?;
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(text: &str) -> PullKey {
        text.parse().unwrap()
    }

    fn fresh(dir: &std::path::Path) -> GroupCursors {
        GroupCursors::load(dir, "local", None)
    }

    #[test]
    fn restart_alignment_rewinds_to_the_watermark() {
        // RestartCursorAlignmentTest: 0..4 ACKed (W = 4), 5..7 pulled but not ACKed (cursor 8).
        let dir = tempfile::tempdir().unwrap();
        let orders = key("orders#0");
        let mut cursors = fresh(dir.path());
        cursors.advance(&orders, 8);
        cursors.checkpoint().unwrap();
        let mut restarted = fresh(dir.path());
        assert_eq!(restarted.get(&orders), Some(8));
        assert_eq!(
            restarted.align(&orders, Some(4)),
            Alignment::Rewound {
                from: Some(8),
                to: 5
            }
        );
        assert_eq!(
            restarted.get(&orders),
            Some(5),
            "5, 6 and 7 are pulled again"
        );
    }

    #[test]
    fn out_of_order_acks_do_not_skip_unacked_offsets() {
        // 7 ACKed but 5 and 6 not: the gap-free watermark is 4, not the reference's max (7).
        let dir = tempfile::tempdir().unwrap();
        let orders = key("orders#0");
        let mut cursors = fresh(dir.path());
        cursors.advance(&orders, 8);
        cursors.align(&orders, Some(4));
        assert_eq!(cursors.get(&orders), Some(5));
    }

    #[test]
    fn without_a_watermark_a_cursor_goes_back_to_the_configured_start() {
        // The reference kept a cursor of 42 with no persisted offsets, skipping 0..42 although
        // nothing was ACKed (the BROADCAST copies of #5294). Here the cursor is dropped and the
        // next resolve starts the reader where a new one starts.
        let dir = tempfile::tempdir().unwrap();
        let fresh_key = key("fresh#0");
        let mut cursors = fresh(dir.path());
        cursors.advance(&fresh_key, 42);
        assert_eq!(cursors.align(&fresh_key, None), Alignment::NoWatermark);
        assert_eq!(cursors.get(&fresh_key), None);
        assert_eq!(cursors.align(&fresh_key, Some(-2)), Alignment::NoWatermark);
        assert_eq!(
            cursors.resolve(&fresh_key, 0, 100, StartAt::Earliest),
            Resolution::Started(0)
        );
    }

    #[test]
    fn missing_cursors_start_at_the_watermark_and_lower_ones_stay() {
        let dir = tempfile::tempdir().unwrap();
        let mut cursors = fresh(dir.path());
        let a = key("t#0");
        assert_eq!(
            cursors.align(&a, Some(9)),
            Alignment::Rewound { from: None, to: 10 }
        );
        let b = key("t#1");
        cursors.advance(&b, 3);
        assert_eq!(cursors.align(&b, Some(9)), Alignment::Kept(3));
        let lite = key("parent#chat@2");
        assert_eq!(
            cursors.align(&lite, Some(0)),
            Alignment::Rewound { from: None, to: 1 }
        );
        // -1: the group starts at offset 0 and has settled nothing yet.
        let marked = key("t#2");
        cursors.advance(&marked, 7);
        assert_eq!(
            cursors.align(&marked, Some(-1)),
            Alignment::Rewound {
                from: Some(7),
                to: 0
            }
        );
    }

    #[test]
    fn positions_set_the_cursor_either_way() {
        let dir = tempfile::tempdir().unwrap();
        let mut cursors = fresh(dir.path());
        let a = key("t#0");
        assert_eq!(cursors.position(&a, 5), Some(None));
        cursors.advance(&a, 9);
        assert_eq!(cursors.position(&a, 9), None, "confirmed: no change");
        assert_eq!(
            cursors.position(&a, 7),
            Some(Some(9)),
            "a lost batch is read again"
        );
        assert_eq!(cursors.get(&a), Some(7));
    }

    #[test]
    fn resolve_handles_start_retention_and_recreated_topics() {
        let dir = tempfile::tempdir().unwrap();
        let mut cursors = fresh(dir.path());
        let (a, b, c, d, e) = (key("t#0"), key("t#1"), key("t#2"), key("t#3"), key("t#4"));
        assert_eq!(
            cursors.resolve(&a, 5, 20, StartAt::Earliest),
            Resolution::Started(5)
        );
        assert_eq!(
            cursors.resolve(&b, 5, 20, StartAt::Latest),
            Resolution::Started(20)
        );
        cursors.advance(&c, 2);
        assert_eq!(
            cursors.resolve(&c, 5, 20, StartAt::Earliest),
            Resolution::LostToRetention { to: 5, lost: 3 }
        );
        cursors.advance(&d, 30);
        assert_eq!(
            cursors.resolve(&d, 0, 10, StartAt::Earliest),
            Resolution::PastEnd(30)
        );
        assert_eq!(
            cursors.get(&d),
            Some(30),
            "past the end: reported, never moved"
        );
        cursors.advance(&e, 10);
        assert_eq!(
            cursors.resolve(&e, 0, 10, StartAt::Earliest),
            Resolution::InRange(10),
            "at the end is fine"
        );
    }

    #[test]
    fn advance_never_goes_back_and_checkpoints_only_changes() {
        let dir = tempfile::tempdir().unwrap();
        let mut cursors = fresh(dir.path());
        let a = key("t#0");
        assert!(!cursors.checkpoint().unwrap(), "nothing to write yet");
        cursors.advance(&a, 10);
        cursors.advance(&a, 7);
        assert_eq!(cursors.get(&a), Some(10));
        assert!(cursors.checkpoint().unwrap());
        assert!(!cursors.checkpoint().unwrap(), "unchanged: no rewrite");
        cursors.advance(&a, 10);
        assert!(!cursors.checkpoint().unwrap(), "same value is not a change");
        let group = GroupName::new("billing").unwrap();
        let mut billing = GroupCursors::load(dir.path(), "local", Some(&group));
        assert_eq!(billing.get(&a), None, "groups never share cursors");
        billing.advance(&a, 1);
        billing.checkpoint().unwrap();
        assert_eq!(fresh(dir.path()).get(&a), Some(10));
        assert_eq!(
            GroupCursors::load(dir.path(), "local", Some(&group)).get(&a),
            Some(1)
        );
    }

    fn billing() -> Option<GroupName> {
        Some(GroupName::new("billing").unwrap())
    }

    #[test]
    fn an_older_copy_never_replaces_a_newer_one() {
        let dir = tempfile::tempdir().unwrap();
        let mut cursors = fresh(dir.path());
        let a = key("t#0");
        cursors.advance(&a, 5);
        let older = cursors.snapshot().expect("changed");
        cursors.advance(&a, 9);
        let newer = cursors.snapshot().expect("changed");
        assert!(newer.write().unwrap());
        assert!(
            !older.write().unwrap(),
            "the file already holds a newer copy"
        );
        assert_eq!(fresh(dir.path()).get(&a), Some(9));
        assert!(cursors.snapshot().is_none(), "written: nothing to copy");
    }

    #[test]
    fn a_copy_taken_before_an_eviction_does_not_bring_the_file_back() {
        let dir = tempfile::tempdir().unwrap();
        let book = CursorBook::new(dir.path(), "local");
        let a = key("t#0");
        book.with(&billing(), |cursors| cursors.advance(&a, 3));
        book.checkpoint_all().unwrap();
        let file = checkpoint::path(dir.path(), "local", billing().as_ref());
        assert!(file.exists());
        let copy = book.with(&billing(), |cursors| {
            cursors.advance(&a, 5);
            cursors.snapshot().expect("changed")
        });
        book.evict(&billing(), &a.topic);
        assert!(!file.exists(), "evicted with its last cursor: file removed");
        assert!(!copy.write().unwrap());
        assert!(
            !file.exists(),
            "a copy taken before the eviction is not written"
        );
    }

    #[test]
    fn a_failed_write_is_written_at_the_next_checkpoint() {
        let dir = tempfile::tempdir().unwrap();
        // The checkpoint directory's place is taken by a file: writing fails.
        let blocked = dir.path().join("cursors");
        std::fs::write(&blocked, b"").unwrap();
        let book = CursorBook::new(&blocked, "local");
        let a = key("t#0");
        book.with(&None, |cursors| cursors.advance(&a, 7));
        assert!(book.checkpoint_all().is_err());
        std::fs::remove_file(&blocked).unwrap();
        book.checkpoint_all().unwrap();
        assert_eq!(
            fresh(&blocked).get(&a),
            Some(7),
            "written once the disk allowed"
        );
    }

    #[test]
    fn a_group_is_not_locked_while_its_checkpoint_is_written() {
        let dir = tempfile::tempdir().unwrap();
        let book = Arc::new(CursorBook::new(dir.path(), "local"));
        let a = key("t#0");
        let file = book.with(&None, |cursors| {
            cursors.advance(&a, 1);
            Arc::clone(&cursors.file)
        });
        // A slow disk: the write waits for the file's lock, held here.
        let writing = file.removed.lock().unwrap();
        let checkpointer = {
            let book = Arc::clone(&book);
            std::thread::spawn(move || book.checkpoint_all())
        };
        // The checkpointer has its copy (it holds the file too) and waits to write it.
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while Arc::strong_count(&file) < 3 && std::time::Instant::now() < deadline {
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
        assert_eq!(
            Arc::strong_count(&file),
            3,
            "the checkpointer took its copy"
        );
        let (done, moved) = std::sync::mpsc::channel();
        let reader = {
            let book = Arc::clone(&book);
            let a = a.clone();
            std::thread::spawn(move || {
                book.with(&None, |cursors| cursors.advance(&a, 2));
                let _ = done.send(());
            })
        };
        assert!(
            moved
                .recv_timeout(std::time::Duration::from_secs(10))
                .is_ok(),
            "the group's cursors moved while its checkpoint was being written"
        );
        drop(writing);
        checkpointer.join().unwrap().unwrap();
        reader.join().unwrap();
        assert_eq!(fresh(dir.path()).get(&a), Some(1), "the copy taken first");
        book.checkpoint_all().unwrap();
        assert_eq!(
            fresh(dir.path()).get(&a),
            Some(2),
            "the later move at the next one"
        );
    }
}

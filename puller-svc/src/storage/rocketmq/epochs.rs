//! POP group epochs (`rocketmq5`): which broker consumer group a reader pops under now.
//!
//! A broker's POP position cannot be moved back on rocketmq-rust 1.0.0: its POP reads the
//! reset marker with topic and group swapped (never finds it) and keeps popping from its
//! in-memory checkpoint queue, which only a broker restart, five idle minutes or the group's
//! deletion clear; the same queue stops the POP after 20,000 uncommitted batches. A brand-new
//! group has neither, and starts exactly where it is told. So a reader pops under
//! `<pop group>-<epoch>` (the epoch in 16 hex digits: a fixed width keeps the names injective),
//! and moves to a new epoch whenever its cursor and the broker disagree (a rewind to the ACK
//! watermark after a restart, a lower attach) and after
//! [`REALIGN_EVERY`](crate::storage::rocketmq5::REALIGN_EVERY)
//! POPs of one queue; the old epoch's group is deleted from the brokers.
//!
//! Each reader's live epoch is recorded before it is used, in
//! `rocketmq5-pop-epochs[@group].properties` (atomic, as the cursor checkpoints), so a puller
//! that died deletes its predecessor's group when it starts the next epoch.

use std::collections::{HashMap, HashSet};
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{SystemTime, UNIX_EPOCH};

use eventmesh_common::keys::{PartitionId, PullKey};

use crate::checkpoint;
use crate::storage::{ReaderKey, StorageError};

/// What one reader pops under.
#[derive(Debug, Default)]
pub struct ReaderEpoch {
    /// The live epoch (0: none yet in this process).
    pub epoch: u64,
    /// The epoch must end before the next POP (the broker and a cursor disagreed).
    pub stale: bool,
    /// Brokers where the epoch's group exists.
    pub brokers: HashSet<String>,
    /// Queues whose position was set in this epoch.
    pub positioned: HashMap<PartitionId, QueuePosition>,
}

/// Where the broker's POP of one queue stands in an epoch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QueuePosition {
    /// The offset its next POP starts at.
    pub next: i64,
    /// POPs since the position was set.
    pub pops: u64,
}

/// How many characters [`Epochs::group_name`] adds to a POP group: `-` and 16 hex digits.
pub const EPOCH_SUFFIX_CHARS: usize = 17;

/// Every reader's epoch, and the file that outlives the process.
pub struct Epochs {
    dir: PathBuf,
    next: AtomicU64,
    readers: Mutex<HashMap<ReaderKey, Arc<tokio::sync::Mutex<ReaderEpoch>>>>,
}

impl Epochs {
    /// Epochs recorded in `dir`; new ones start above every earlier process's (clock-based).
    pub fn new(dir: PathBuf) -> Self {
        let now_ms = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_millis() as u64)
            .unwrap_or(1);
        Epochs {
            dir,
            // Room for 1,024 epochs per millisecond before a later process could repeat one.
            next: AtomicU64::new(now_ms << 10),
            readers: Mutex::new(HashMap::new()),
        }
    }

    /// The broker group of `base` (the reader's POP group) in `epoch`: `base` and
    /// [`EPOCH_SUFFIX_CHARS`] more.
    pub fn group_name(base: &str, epoch: u64) -> String {
        format!("{base}-{epoch:016x}")
    }

    /// A receipt as an ACK key: the epoch, then the broker's receipt.
    pub fn ack_key(epoch: u64, receipt: &str) -> String {
        format!("{epoch:016x}@{receipt}")
    }

    /// The epoch and broker receipt of an ACK key (`None`: not one of ours).
    pub fn parse_ack_key(key: &str) -> Option<(u64, &str)> {
        let (epoch, receipt) = key.split_once('@')?;
        (epoch.len() == 16)
            .then(|| u64::from_str_radix(epoch, 16).ok())
            .flatten()
            .map(|epoch| (epoch, receipt))
    }

    /// The reader's state (created empty).
    pub fn state(&self, reader: &ReaderKey) -> Arc<tokio::sync::Mutex<ReaderEpoch>> {
        let mut readers = self.readers.lock().unwrap_or_else(|p| p.into_inner());
        Arc::clone(readers.entry(reader.clone()).or_default())
    }

    /// Forgets the reader; its last epoch, if any.
    pub fn forget(&self, reader: &ReaderKey) -> Option<Arc<tokio::sync::Mutex<ReaderEpoch>>> {
        self.readers
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(reader)
    }

    /// A fresh epoch.
    pub fn fresh(&self) -> u64 {
        self.next.fetch_add(1, Ordering::Relaxed)
    }

    fn file(&self, reader: &ReaderKey) -> PathBuf {
        match &reader.group {
            None => self.dir.join("rocketmq5-pop-epochs.properties"),
            Some(group) => self
                .dir
                .join(format!("rocketmq5-pop-epochs@{group}.properties")),
        }
    }

    /// The file's entry of a reader: `<topic>#0` (the file holds epochs, one per topic).
    fn entry(reader: &ReaderKey) -> Result<PullKey, StorageError> {
        Ok(PullKey::new(reader.topic.clone(), PartitionId::number(0)))
    }

    /// The epoch recorded for `reader` by this or an earlier process.
    pub async fn recorded(&self, reader: &ReaderKey) -> Result<Option<u64>, StorageError> {
        let (file, entry) = (self.file(reader), Self::entry(reader)?);
        let loaded = tokio::task::spawn_blocking(move || checkpoint::load(&file).into_cursors())
            .await
            .map_err(|err| StorageError::Internal(format!("epoch file read: {err}")))?;
        Ok(loaded.get(&entry).map(|epoch| *epoch as u64))
    }

    /// Records `epoch` as `reader`'s live one (`None`: it has none), atomically.
    pub async fn record(&self, reader: &ReaderKey, epoch: Option<u64>) -> Result<(), StorageError> {
        let (file, entry) = (self.file(reader), Self::entry(reader)?);
        tokio::task::spawn_blocking(move || {
            let mut epochs = checkpoint::load(&file).into_cursors();
            match epoch {
                Some(epoch) => epochs.insert(entry, epoch as i64),
                None => epochs.remove(&entry),
            };
            checkpoint::store(&file, &epochs)
        })
        .await
        .map_err(|err| StorageError::Internal(format!("epoch file write: {err}")))?
        .map_err(|err| StorageError::Internal(err.to_string()))
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    #[test]
    fn names_and_keys_round_trip() {
        assert_eq!(
            Epochs::group_name("eventmesh-pop_g", 0x1a),
            "eventmesh-pop_g-000000000000001a"
        );
        for epoch in [0, 1, u64::MAX] {
            assert_eq!(Epochs::group_name("b", epoch).len(), 1 + EPOCH_SUFFIX_CHARS);
        }
        let receipt = "0 1700000000000 300000 0 0 broker-a 1 7";
        let key = Epochs::ack_key(42, receipt);
        assert_eq!(Epochs::parse_ack_key(&key), Some((42, receipt)));
        for bad in ["", "no separator", "2a@x", "zzzzzzzzzzzzzzzz@x"] {
            assert_eq!(Epochs::parse_ack_key(bad), None, "{bad}");
        }
    }

    #[tokio::test]
    async fn the_live_epoch_survives_the_process() {
        let dir = tempfile::tempdir().unwrap();
        let topic = eventmesh_common::keys::Topic::new("t").unwrap();
        let reader = ReaderKey {
            group: Some(eventmesh_common::keys::GroupName::new("g").unwrap()),
            topic,
        };
        let epochs = Epochs::new(dir.path().to_owned());
        assert_eq!(epochs.recorded(&reader).await.unwrap(), None);
        let first = epochs.fresh();
        epochs.record(&reader, Some(first)).await.unwrap();
        // A restart takes more than the millisecond the clock-based epochs step by.
        std::thread::sleep(std::time::Duration::from_millis(2));
        let later = Epochs::new(dir.path().to_owned());
        assert_eq!(later.recorded(&reader).await.unwrap(), Some(first));
        assert!(later.fresh() > first, "a later process starts above");
        later.record(&reader, None).await.unwrap();
        assert_eq!(later.recorded(&reader).await.unwrap(), None);
    }
}

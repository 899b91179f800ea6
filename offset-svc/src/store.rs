//! The [`OffsetStore`] contract and the in-memory table both stores are built on.
//!
//! Semantics (the seed's, kept exactly):
//! * [`OffsetStore::write_batch`] is CAS-max per key: a write lower than or equal to the stored
//!   value is a no-op and never a regression. A batch is applied atomically and, for the
//!   durable store, survives a process crash once the call returns `Ok`; `sync` also fsyncs
//!   the write-ahead log. A write that fails returns `Err` and changes nothing visible.
//! * [`OffsetStore::read_offset`] of an unknown key is `-1`. Writing `-1` creates a key that
//!   reads `-1` but is listed: a subscription group's start marker ("starts at offset 0,
//!   nothing settled yet"), so a later start does not mistake the group for a new one.
//! * Writes never race an operator change: a reset or delete takes the table exclusively
//!   (writers share it), so what RocksDB holds and what the index answers never differ.
//! * Only the operator calls [`OffsetStore::reset`] and [`OffsetStore::delete`] can lower or
//!   remove a value; both require a reason and log every key they touch.
//!
//! Entries of a batch are applied in order against a running value, so for every entry
//! `advanced` says whether it raised the value at its point in the batch, and `stored` is the
//! key's value after the whole batch (it may be higher still if a concurrent batch raised it).

use eventmesh_common::keys::{OffsetClient, OffsetKey, PartitionId, Topic};

use crate::error::Error;
pub(crate) use crate::table::MaxTable;

/// The value of a key nobody has written.
pub const UNKNOWN_OFFSET: i64 = -1;

/// The result of one entry of a write batch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WriteOutcome {
    /// The key's value after the batch.
    pub stored: i64,
    /// Whether this entry raised the value.
    pub advanced: bool,
}

/// Which entries an operator action touches.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Selector {
    /// The topic.
    pub topic: Topic,
    /// One client (or MQ cursor); `None` for all.
    pub client: Option<OffsetClient>,
    /// One partition; `None` for all.
    pub partition: Option<PartitionId>,
}

impl Selector {
    /// The single key this selector names, when client and partition are both given.
    pub fn exact_key(&self) -> Option<OffsetKey> {
        Some(OffsetKey::new(
            self.topic.clone(),
            self.client.clone()?,
            self.partition.clone()?,
        ))
    }

    pub(crate) fn prefix(&self) -> String {
        match &self.client {
            Some(client) => OffsetKey::client_prefix(&self.topic, client),
            None => OffsetKey::topic_prefix(&self.topic),
        }
    }

    pub(crate) fn matches(&self, key: &str) -> bool {
        key.starts_with(&self.prefix())
            && self
                .partition
                .as_ref()
                .is_none_or(|p| key.rsplit_once('#').map(|(_, part)| part) == Some(p.as_str()))
    }
}

/// A store of monotonic offsets. Implementations are cheap to share (`Arc<dyn OffsetStore>`);
/// calls may block on I/O, so async callers run them on a blocking thread.
pub trait OffsetStore: Send + Sync + 'static {
    /// Applies a batch of CAS-max writes atomically; one outcome per entry, in order.
    fn write_batch(
        &self,
        entries: &[(OffsetKey, i64)],
        sync: bool,
    ) -> Result<Vec<WriteOutcome>, Error>;

    /// [`write_batch`](Self::write_batch) without fsync, done now only if it waits for
    /// nothing: not for an operator's change in progress, not for the store to catch up
    /// (RocksDB's write stall). `None` when it would have waited; nothing was applied then,
    /// and the caller writes with `write_batch` on a blocking thread. Lets an async caller
    /// skip the hop to a blocking thread for the common write (a memory-table insert and a
    /// buffered log append: microseconds).
    fn write_batch_without_waiting(
        &self,
        entries: &[(OffsetKey, i64)],
    ) -> Option<Result<Vec<WriteOutcome>, Error>>;

    /// Writes one CAS-max value.
    fn write_offset(&self, key: &OffsetKey, offset: i64) -> Result<WriteOutcome, Error> {
        let mut outcomes = self.write_batch(&[(key.clone(), offset)], false)?;
        outcomes
            .pop()
            .ok_or(Error::Internal("empty outcome for a one-entry batch"))
    }

    /// Reads one value; [`UNKNOWN_OFFSET`] when absent.
    fn read_offset(&self, key: &OffsetKey) -> Result<i64, Error>;

    /// Every entry of `topic` (optionally of one client), ordered by key.
    fn read_topic(
        &self,
        topic: &Topic,
        client: Option<&OffsetClient>,
    ) -> Result<Vec<(OffsetKey, i64)>, Error>;

    /// Every topic with at least one entry, sorted.
    fn list_topics(&self) -> Result<Vec<Topic>, Error>;

    /// Operator action: sets the selected entries to `offset` (which may be lower). With an
    /// exact selector the key is created if missing. Returns each changed key with its
    /// previous value.
    fn reset(
        &self,
        selector: &Selector,
        offset: i64,
        reason: &str,
    ) -> Result<Vec<(OffsetKey, i64)>, Error>;

    /// Operator action: removes the selected entries. Returns each with its last value.
    fn delete(&self, selector: &Selector, reason: &str) -> Result<Vec<(OffsetKey, i64)>, Error>;

    /// Makes everything written so far durable against an OS crash too.
    fn flush(&self) -> Result<(), Error>;

    /// Number of keys stored.
    fn key_count(&self) -> usize;
}

/// A change to persist, in the order given.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Change<'a> {
    /// Raise the key to at least this value.
    Max(&'a str, i64),
    /// Set the key to exactly this value (operator reset).
    Set(&'a str, i64),
    /// Remove the key (operator delete).
    Delete(&'a str),
}

/// Where a [`TableStore`] makes its changes durable.
pub trait Persistence: Send + Sync + 'static {
    /// Applies `changes` atomically; `sync` also fsyncs (the write-ahead log, so everything
    /// persisted before is on stable storage too). On `Err` nothing was applied.
    fn persist(&self, changes: &[Change<'_>], sync: bool) -> Result<(), Error>;
    /// [`persist`](Self::persist) without fsync, or [`Error::WouldStall`] (nothing applied)
    /// when it would have to wait for the store to catch up first.
    fn persist_without_stalling(&self, changes: &[Change<'_>]) -> Result<(), Error> {
        self.persist(changes, false)
    }
    /// Flushes everything to stable storage (shutdown).
    fn flush(&self) -> Result<(), Error>;
}

/// The one implementation of [`OffsetStore`]: a sharded in-memory index in front of a
/// [`Persistence`]. The in-memory and the RocksDB store differ only in `P`, so both run the
/// very same CAS-max and operator code.
pub struct TableStore<P> {
    table: MaxTable,
    persistence: P,
    /// Writers share it; an operator change takes it alone, so a raise can never land
    /// between an operator's persisted put and its update of the index (or the other way
    /// round), which would leave disk and memory different.
    operators: std::sync::RwLock<()>,
}

impl<P> TableStore<P> {
    pub(crate) fn with_persistence(table: MaxTable, persistence: P) -> Self {
        TableStore {
            table,
            persistence,
            operators: std::sync::RwLock::new(()),
        }
    }

    pub(crate) fn persistence(&self) -> &P {
        &self.persistence
    }

    /// Number of keys held.
    pub fn len(&self) -> usize {
        self.table.len()
    }

    /// Whether no key is held.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

impl<P: Persistence> OffsetStore for TableStore<P> {
    fn write_batch(
        &self,
        entries: &[(OffsetKey, i64)],
        sync: bool,
    ) -> Result<Vec<WriteOutcome>, Error> {
        let _shared = self.operators.read().unwrap_or_else(|p| p.into_inner());
        // Every key of a non-empty batch is persisted (a value that raises nothing is a no-op
        // merge), so a `sync` batch also makes durable what a concurrent batch without `sync`
        // wrote before it.
        self.table
            .write_batch(entries, |changes| self.persistence.persist(changes, sync))
    }

    fn write_batch_without_waiting(
        &self,
        entries: &[(OffsetKey, i64)],
    ) -> Option<Result<Vec<WriteOutcome>, Error>> {
        let _shared = match self.operators.try_read() {
            Ok(shared) => shared,
            Err(std::sync::TryLockError::Poisoned(poisoned)) => poisoned.into_inner(),
            Err(std::sync::TryLockError::WouldBlock) => return None,
        };
        match self.table.write_batch(entries, |changes| {
            self.persistence.persist_without_stalling(changes)
        }) {
            Err(Error::WouldStall) => None,
            done => Some(done),
        }
    }

    fn read_offset(&self, key: &OffsetKey) -> Result<i64, Error> {
        Ok(self.table.get(&key.to_string()).unwrap_or(UNKNOWN_OFFSET))
    }

    fn read_topic(
        &self,
        topic: &Topic,
        client: Option<&OffsetClient>,
    ) -> Result<Vec<(OffsetKey, i64)>, Error> {
        self.table.read_topic(topic, client)
    }

    fn list_topics(&self) -> Result<Vec<Topic>, Error> {
        self.table.list_topics()
    }

    fn reset(
        &self,
        selector: &Selector,
        offset: i64,
        reason: &str,
    ) -> Result<Vec<(OffsetKey, i64)>, Error> {
        // Operator actions are rare and must not be lost: always fsynced.
        let _alone = self.operators.write().unwrap_or_else(|p| p.into_inner());
        self.table
            .operator_change(selector, Some(offset), reason, |changes| {
                self.persistence.persist(changes, true)
            })
    }

    fn delete(&self, selector: &Selector, reason: &str) -> Result<Vec<(OffsetKey, i64)>, Error> {
        let _alone = self.operators.write().unwrap_or_else(|p| p.into_inner());
        self.table
            .operator_change(selector, None, reason, |changes| {
                self.persistence.persist(changes, true)
            })
    }

    fn flush(&self) -> Result<(), Error> {
        self.persistence.flush()
    }

    fn key_count(&self) -> usize {
        self.table.len()
    }
}

impl Change<'_> {
    /// The key this change touches.
    pub fn key(&self) -> &str {
        match self {
            Change::Max(key, _) | Change::Set(key, _) | Change::Delete(key) => key,
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use std::collections::HashMap;
    use std::sync::Arc;
    use std::sync::Mutex;
    use std::time::Duration;

    /// A "disk" that applies changes in the order they are persisted, and is slow to finish
    /// an operator's put (as an fsync is).
    #[derive(Default)]
    struct SlowDisk {
        values: Mutex<HashMap<String, i64>>,
    }

    impl Persistence for SlowDisk {
        fn persist(&self, changes: &[Change<'_>], _sync: bool) -> Result<(), Error> {
            let mut slow = false;
            {
                let mut values = self.values.lock().unwrap();
                for change in changes {
                    match change {
                        Change::Max(key, value) => {
                            let slot = values.entry((*key).to_owned()).or_insert(*value);
                            *slot = (*slot).max(*value);
                        }
                        Change::Set(key, value) => {
                            values.insert((*key).to_owned(), *value);
                            slow = true;
                        }
                        Change::Delete(key) => {
                            values.remove(*key);
                        }
                    }
                }
            }
            if slow {
                std::thread::sleep(Duration::from_millis(100));
            }
            Ok(())
        }
        fn flush(&self) -> Result<(), Error> {
            Ok(())
        }
    }

    /// A store holding a key at 10, and an operator's reset of it to 0 on another thread, now
    /// inside its slow persist (holding the operators' lock).
    fn a_reset_in_progress() -> (
        Arc<TableStore<SlowDisk>>,
        OffsetKey,
        std::thread::JoinHandle<()>,
    ) {
        let store = Arc::new(TableStore::with_persistence(
            MaxTable::new(),
            SlowDisk::default(),
        ));
        let key: OffsetKey = "t#__mqcursor__#0".parse().unwrap();
        store.write_offset(&key, 10).unwrap();
        let resetter = {
            let (store, key) = (Arc::clone(&store), key.clone());
            std::thread::spawn(move || {
                let selector = Selector {
                    topic: key.topic.clone(),
                    client: Some(key.client.clone()),
                    partition: Some(key.partition.clone()),
                };
                store.reset(&selector, 0, "test").unwrap();
            })
        };
        std::thread::sleep(Duration::from_millis(30));
        (store, key, resetter)
    }

    /// A raise landing while an operator's reset is between its persisted put and its index
    /// update used to leave the index (the raise) and the disk (the merge after the put, or
    /// the put) answering differently until the next restart. Writers now wait for it.
    #[test]
    fn a_raise_during_a_reset_leaves_index_and_disk_equal() {
        let (store, key, resetter) = a_reset_in_progress();
        store.write_offset(&key, 50).unwrap();
        resetter.join().unwrap();
        let in_memory = store.read_offset(&key).unwrap();
        let on_disk = store.persistence().values.lock().unwrap()[&key.to_string()];
        assert_eq!(in_memory, on_disk, "index and disk agree");
        assert_eq!(in_memory, 50, "the raise came after the reset");
    }

    /// A disk that is always catching up: every write would stall.
    struct Stalling;

    impl Persistence for Stalling {
        fn persist(&self, _changes: &[Change<'_>], _sync: bool) -> Result<(), Error> {
            Ok(())
        }
        fn persist_without_stalling(&self, _changes: &[Change<'_>]) -> Result<(), Error> {
            Err(Error::WouldStall)
        }
        fn flush(&self) -> Result<(), Error> {
            Ok(())
        }
    }

    #[test]
    fn a_write_without_waiting_answers_as_a_write_batch_does() {
        let store = TableStore::with_persistence(MaxTable::new(), SlowDisk::default());
        let key: OffsetKey = "t#__mqcursor__#0".parse().unwrap();
        store.write_offset(&key, 10).unwrap();
        let outcomes = store
            .write_batch_without_waiting(&[(key.clone(), 5), (key.clone(), 12)])
            .expect("nothing to wait for")
            .unwrap();
        assert_eq!(
            outcomes,
            vec![
                WriteOutcome {
                    stored: 12,
                    advanced: false
                },
                WriteOutcome {
                    stored: 12,
                    advanced: true
                }
            ]
        );
        assert_eq!(store.read_offset(&key).unwrap(), 12);
        assert_eq!(
            store.persistence().values.lock().unwrap()[&key.to_string()],
            12
        );
    }

    #[test]
    fn a_write_that_would_stall_is_left_undone_for_the_blocking_path() {
        let store = TableStore::with_persistence(MaxTable::new(), Stalling);
        let key: OffsetKey = "t#__mqcursor__#0".parse().unwrap();
        assert!(
            store
                .write_batch_without_waiting(&[(key.clone(), 7)])
                .is_none()
        );
        assert_eq!(
            store.read_offset(&key).unwrap(),
            UNKNOWN_OFFSET,
            "nothing applied"
        );
        store.write_batch(&[(key.clone(), 7)], false).unwrap();
        assert_eq!(store.read_offset(&key).unwrap(), 7);
    }

    #[test]
    fn a_write_during_an_operators_change_is_left_for_the_blocking_path() {
        let (store, key, resetter) = a_reset_in_progress();
        assert!(
            store
                .write_batch_without_waiting(&[(key.clone(), 50)])
                .is_none()
        );
        resetter.join().unwrap();
        assert_eq!(
            store.read_offset(&key).unwrap(),
            0,
            "the reset, and nothing after it"
        );
    }
}

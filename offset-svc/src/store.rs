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

use std::hash::BuildHasher;
use std::sync::{Mutex, MutexGuard};

// Keys come from clients, so the hasher is seeded per process (no fixed-seed HashDoS), but it
// is much cheaper than SipHash on these short keys.
use foldhash::fast::RandomState;
use hashbrown::HashTable;

use eventmesh_common::keys::{OffsetClient, OffsetKey, PartitionId, Topic};

use crate::error::Error;

/// The value of a key nobody has written.
pub const UNKNOWN_OFFSET: i64 = -1;
/// Below every storable value: a key not in the table, inside a write batch.
const ABSENT: i64 = i64::MIN;

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

    fn prefix(&self) -> String {
        match &self.client {
            Some(client) => OffsetKey::client_prefix(&self.topic, client),
            None => OffsetKey::topic_prefix(&self.topic),
        }
    }

    fn matches(&self, key: &str) -> bool {
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
    /// Applies `changes` atomically; `sync` also fsyncs. On `Err` nothing was applied.
    fn persist(&self, changes: &[Change<'_>], sync: bool) -> Result<(), Error>;
    /// Makes every value already persisted survive an OS crash (a `sync` batch that had
    /// nothing new to write still answers with values that must be on stable storage).
    fn sync_held(&self) -> Result<(), Error>;
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
        let mut wrote = false;
        let _shared = self.operators.read().unwrap_or_else(|p| p.into_inner());
        let outcomes = self.table.write_batch(entries, |changes| {
            wrote = true;
            self.persistence.persist(changes, sync)
        })?;
        if sync && !wrote && !entries.is_empty() {
            // Every value was already held, possibly written by a concurrent batch without
            // sync: make sure what we answer with is on stable storage.
            self.persistence.sync_held()?;
        }
        Ok(outcomes)
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

const SHARDS: usize = 64;

/// One lock's worth of the table: (encoded key, offset), placed by a hash computed once per
/// key and batch (see [`MaxTable::hash`]).
type Shard = Mutex<HashTable<(Box<str>, i64)>>;

/// A sharded map from encoded key to offset with max-only updates.
///
/// It is the whole in-memory store, and the durable store's index of what is on disk: every
/// value it holds has been persisted, because values enter it only after the persistence
/// step succeeded. Writers to different shards never contend, and a shard lock is held only
/// for hash-map operations, never across I/O.
pub(crate) struct MaxTable {
    shards: Box<[Shard]>,
    hasher: RandomState,
}

impl MaxTable {
    pub(crate) fn new() -> Self {
        MaxTable {
            shards: (0..SHARDS).map(|_| Mutex::new(HashTable::new())).collect(),
            hasher: RandomState::default(),
        }
    }

    fn hash(&self, key: &str) -> u64 {
        self.hasher.hash_one(key)
    }

    fn shard(&self, hash: u64) -> MutexGuard<'_, HashTable<(Box<str>, i64)>> {
        // Bits 32..38 pick the shard: the table itself uses the low bits (bucket) and the top
        // seven (tag), so the shard choice does not skew either inside a shard.
        let index = ((hash >> 32) as usize) % SHARDS;
        // A poisoned shard only means another writer panicked between two map operations,
        // each of which leaves the map consistent; keep serving.
        self.shards[index]
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    pub(crate) fn get(&self, key: &str) -> Option<i64> {
        self.get_hashed(key, self.hash(key))
    }

    fn get_hashed(&self, key: &str, hash: u64) -> Option<i64> {
        self.shard(hash)
            .find(hash, |(k, _)| **k == *key)
            .map(|(_, v)| *v)
    }

    /// Raises `key` to at least `value`; returns the value now held.
    pub(crate) fn raise(&self, key: &str, value: i64) -> i64 {
        self.raise_hashed(key, self.hash(key), value)
    }

    fn raise_hashed(&self, key: &str, hash: u64, value: i64) -> i64 {
        let mut shard = self.shard(hash);
        match shard.find_mut(hash, |(k, _)| **k == *key) {
            Some((_, current)) => {
                *current = (*current).max(value);
                *current
            }
            None => {
                shard.insert_unique(hash, (key.into(), value), |(k, _)| self.hash(k));
                value
            }
        }
    }

    fn set(&self, key: &str, value: i64) {
        let hash = self.hash(key);
        let mut shard = self.shard(hash);
        match shard.find_mut(hash, |(k, _)| **k == *key) {
            Some((_, current)) => *current = value,
            None => {
                shard.insert_unique(hash, (key.into(), value), |(k, _)| self.hash(k));
            }
        }
    }

    fn remove(&self, key: &str) {
        let hash = self.hash(key);
        if let Ok(entry) = self.shard(hash).find_entry(hash, |(k, _)| **k == *key) {
            entry.remove();
        }
    }

    pub(crate) fn apply(&self, change: &Change) {
        match change {
            Change::Max(key, value) => {
                self.raise(key, *value);
            }
            Change::Set(key, value) => self.set(key, *value),
            Change::Delete(key) => self.remove(key),
        }
    }

    /// Every (key, value) whose key starts with `prefix`, sorted by key.
    pub(crate) fn scan(&self, prefix: &str) -> Vec<(String, i64)> {
        let mut out: Vec<(String, i64)> = self
            .shards
            .iter()
            .flat_map(|shard| {
                let shard = shard.lock().unwrap_or_else(|p| p.into_inner());
                shard
                    .iter()
                    .filter(|(k, _)| k.starts_with(prefix))
                    .map(|(k, v)| (k.to_string(), *v))
                    .collect::<Vec<_>>()
            })
            .collect();
        out.sort_unstable();
        out
    }

    pub(crate) fn len(&self) -> usize {
        self.shards
            .iter()
            .map(|s| s.lock().unwrap_or_else(|p| p.into_inner()).len())
            .sum()
    }

    /// Runs a CAS-max batch: computes what raises which key, persists those raises with
    /// `persist` (nothing is persisted when nothing rises), then publishes them.
    ///
    /// Hot path. The batch's keys are encoded into one buffer; entry indices are sorted by key
    /// (ties in batch order), which groups repeated keys for the in-order CAS-max and hands
    /// RocksDB its writes in key order (its memtable inserts ordered keys much faster); each
    /// distinct key is hashed once for both index lookups.
    pub(crate) fn write_batch(
        &self,
        entries: &[(OffsetKey, i64)],
        persist: impl FnOnce(&[Change<'_>]) -> Result<(), Error>,
    ) -> Result<Vec<WriteOutcome>, Error> {
        let mut arena = String::with_capacity(entries.len() * 40);
        let mut spans = Vec::with_capacity(entries.len());
        for (key, offset) in entries {
            if *offset < UNKNOWN_OFFSET {
                return Err(Error::NegativeOffset {
                    key: key.to_string(),
                    offset: *offset,
                });
            }
            let start = arena.len();
            key.encode_into(&mut arena);
            spans.push(start..arena.len());
        }
        let key_of = |entry: usize| &arena[spans[entry].clone()];
        let mut order: Vec<usize> = (0..entries.len()).collect();
        order.sort_unstable_by(|&a, &b| key_of(a).cmp(key_of(b)).then(a.cmp(&b)));

        struct Distinct {
            entry: usize,
            hash: u64,
            before: i64,
            after: i64,
        }
        let mut distinct: Vec<Distinct> = Vec::with_capacity(entries.len());
        let mut slot_of_entry = vec![0usize; entries.len()];
        let mut advanced = vec![false; entries.len()];
        let mut run = 0;
        while run < order.len() {
            let key = key_of(order[run]);
            let hash = self.hash(key);
            // Absent is below every value, so a first write of -1 (a group's start marker)
            // creates the key.
            let before = self.get_hashed(key, hash).unwrap_or(ABSENT);
            let mut after = before;
            let mut next = run;
            while next < order.len() && key_of(order[next]) == key {
                let entry = order[next];
                let offset = entries[entry].1;
                if offset > after {
                    after = offset;
                    advanced[entry] = true;
                }
                slot_of_entry[entry] = distinct.len();
                next += 1;
            }
            distinct.push(Distinct {
                entry: order[run],
                hash,
                before,
                after,
            });
            run = next;
        }
        let raises: Vec<Change<'_>> = distinct
            .iter()
            .filter(|d| d.after > d.before)
            .map(|d| Change::Max(key_of(d.entry), d.after))
            .collect();
        if !raises.is_empty() {
            persist(&raises)?;
        }
        // Publish the raises, and keep what is stored now (a concurrent batch may have gone
        // higher). A key that did not rise already holds `before`, which is what is stored.
        for d in distinct.iter_mut().filter(|d| d.after > d.before) {
            d.after = self.raise_hashed(key_of(d.entry), d.hash, d.after);
        }
        Ok((0..entries.len())
            .map(|entry| WriteOutcome {
                stored: distinct[slot_of_entry[entry]].after.max(UNKNOWN_OFFSET),
                advanced: advanced[entry],
            })
            .collect())
    }

    pub(crate) fn read_topic(
        &self,
        topic: &Topic,
        client: Option<&OffsetClient>,
    ) -> Result<Vec<(OffsetKey, i64)>, Error> {
        let prefix = match client {
            Some(client) => OffsetKey::client_prefix(topic, client),
            None => OffsetKey::topic_prefix(topic),
        };
        self.scan(&prefix)
            .into_iter()
            .map(|(key, value)| Ok((parse_stored_key(&key)?, value)))
            .collect()
    }

    pub(crate) fn list_topics(&self) -> Result<Vec<Topic>, Error> {
        let mut topics: Vec<String> = self
            .scan("")
            .into_iter()
            .filter_map(|(key, _)| key.split_once('#').map(|(t, _)| t.to_owned()))
            .collect();
        topics.dedup();
        topics
            .into_iter()
            .map(|t| Topic::new(t.clone()).map_err(|_| Error::CorruptKey(t)))
            .collect()
    }

    /// Plans and runs an operator reset or delete over the selected keys.
    pub(crate) fn operator_change(
        &self,
        selector: &Selector,
        new_value: Option<i64>,
        reason: &str,
        persist: impl FnOnce(&[Change<'_>]) -> Result<(), Error>,
    ) -> Result<Vec<(OffsetKey, i64)>, Error> {
        if reason.trim().is_empty() {
            return Err(Error::MissingReason);
        }
        if let Some(value) = new_value
            && value < UNKNOWN_OFFSET
        {
            return Err(Error::NegativeOffset {
                key: selector.prefix(),
                offset: value,
            });
        }
        let mut selected: Vec<(String, i64)> = self
            .scan(&selector.prefix())
            .into_iter()
            .filter(|(key, _)| selector.matches(key))
            .collect();
        if let (Some(exact), Some(_)) = (selector.exact_key(), new_value)
            && selected.is_empty()
        {
            selected.push((exact.to_string(), UNKNOWN_OFFSET));
        }
        let changes: Vec<Change<'_>> = selected
            .iter()
            .map(|(key, _)| match new_value {
                Some(value) => Change::Set(key, value),
                None => Change::Delete(key),
            })
            .collect();
        if !changes.is_empty() {
            persist(&changes)?;
        }
        for change in &changes {
            self.apply(change);
        }
        let mut out = Vec::with_capacity(selected.len());
        for (key, previous) in &selected {
            let previous = *previous;
            match new_value {
                Some(value) => {
                    tracing::warn!(%key, previous, new = value, reason, "operator reset offset")
                }
                None => tracing::warn!(%key, previous, reason, "operator deleted offset"),
            }
            out.push((parse_stored_key(key)?, previous));
        }
        Ok(out)
    }
}

fn parse_stored_key(key: &str) -> Result<OffsetKey, Error> {
    key.parse().map_err(|_| Error::CorruptKey(key.to_owned()))
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use std::collections::HashMap;
    use std::sync::Arc;
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
        fn sync_held(&self) -> Result<(), Error> {
            Ok(())
        }
        fn flush(&self) -> Result<(), Error> {
            Ok(())
        }
    }

    /// A raise landing while an operator's reset is between its persisted put and its index
    /// update used to leave the index (the raise) and the disk (the merge after the put, or
    /// the put) answering differently until the next restart. Writers now wait for it.
    #[test]
    fn a_raise_during_a_reset_leaves_index_and_disk_equal() {
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
        // The reset is now inside its slow persist.
        std::thread::sleep(Duration::from_millis(30));
        store.write_offset(&key, 50).unwrap();
        resetter.join().unwrap();
        let in_memory = store.read_offset(&key).unwrap();
        let on_disk = store.persistence().values.lock().unwrap()[&key.to_string()];
        assert_eq!(in_memory, on_disk, "index and disk agree");
        assert_eq!(in_memory, 50, "the raise came after the reset");
    }
}

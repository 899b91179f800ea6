//! [`MaxTable`]: the in-memory map from encoded key to offset behind both stores.
//!
//! It is the whole in-memory store, and the durable store's index of what is on disk: every
//! value it holds has been persisted, because values enter it only after the persistence step
//! succeeded. It is sharded; a shard lock is held only for map operations, never across I/O.
//!
//! Built for the CAS-max hot path (see [`MaxTable::write_batch`]):
//! * a key of up to [`INLINE_KEY_BYTES`] bytes (nearly every `topic#client#partition`) is
//!   stored inside its table slot, so finding it touches one cache line and creating it
//!   allocates nothing; longer keys go to the heap;
//! * each key of a batch is encoded and hashed once, and repeats within the batch are found by
//!   that hash (no sort);
//! * a batch takes each shard's lock once to look its keys up and once to publish its raises,
//!   instead of once per key and phase.

use std::hash::BuildHasher;
use std::sync::{Mutex, MutexGuard};

// Keys come from clients, so the hasher is seeded per process (no fixed-seed HashDoS), but it
// is much cheaper than SipHash on these short keys.
use foldhash::fast::RandomState;
use hashbrown::HashTable;
use hashbrown::hash_table::Entry;

use eventmesh_common::keys::{OffsetClient, OffsetKey, Topic};

use crate::error::Error;
use crate::store::{Change, Selector, UNKNOWN_OFFSET, WriteOutcome};

/// Below every storable value: a key not in the table, inside a write batch.
const ABSENT: i64 = i64::MIN;

const SHARDS: usize = 64;

/// Keys up to this many bytes are stored inline (the whole slot is 48 bytes).
pub(crate) const INLINE_KEY_BYTES: usize = 38;

/// An encoded key as the table holds it.
#[derive(Debug, Clone)]
enum StoredKey {
    Inline {
        len: u8,
        bytes: [u8; INLINE_KEY_BYTES],
    },
    Heap(Box<[u8]>),
}

impl StoredKey {
    fn new(key: &[u8]) -> Self {
        match u8::try_from(key.len()) {
            Ok(len) if key.len() <= INLINE_KEY_BYTES => {
                let mut bytes = [0u8; INLINE_KEY_BYTES];
                bytes[..key.len()].copy_from_slice(key);
                StoredKey::Inline { len, bytes }
            }
            _ => StoredKey::Heap(key.into()),
        }
    }

    fn as_bytes(&self) -> &[u8] {
        match self {
            StoredKey::Inline { len, bytes } => &bytes[..usize::from(*len)],
            StoredKey::Heap(bytes) => bytes,
        }
    }

    /// The key as text; keys enter the table only from `&str`, so this never fails in
    /// practice, and a key that did not decode would read as empty rather than panic.
    fn to_text(&self) -> String {
        String::from_utf8_lossy(self.as_bytes()).into_owned()
    }
}

type Slot = (StoredKey, i64);

/// One distinct key of a write batch.
struct Distinct {
    /// The first entry with this key.
    entry: usize,
    hash: u64,
    before: i64,
    after: i64,
}
type Shard = Mutex<HashTable<Slot>>;

/// A sharded map from encoded key to offset with max-only updates.
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

    fn hash(&self, key: &[u8]) -> u64 {
        self.hasher.hash_one(key)
    }

    fn shard_of(hash: u64) -> usize {
        // Bits 32..38 pick the shard: the table itself uses the low bits (bucket) and the top
        // seven (tag), so the shard choice does not skew either inside a shard.
        ((hash >> 32) as usize) % SHARDS
    }

    fn lock(&self, index: usize) -> MutexGuard<'_, HashTable<Slot>> {
        // A poisoned shard only means another writer panicked between two map operations,
        // each of which leaves the map consistent; keep serving.
        self.shards[index]
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    fn find(shard: &HashTable<Slot>, hash: u64, key: &[u8]) -> Option<i64> {
        shard
            .find(hash, |(k, _)| k.as_bytes() == key)
            .map(|(_, v)| *v)
    }

    /// Raises `key` to at least `value` inside a locked shard, in one probe sequence (it
    /// finds the key or the slot to create it in); returns the value held before
    /// ([`ABSENT`] for a new key) and the value held now.
    fn raise_in(
        &self,
        shard: &mut HashTable<Slot>,
        hash: u64,
        key: &[u8],
        value: i64,
    ) -> (i64, i64) {
        match shard.entry(
            hash,
            |(k, _)| k.as_bytes() == key,
            |(k, _)| self.hash(k.as_bytes()),
        ) {
            Entry::Occupied(mut slot) => {
                let current = &mut slot.get_mut().1;
                let before = *current;
                *current = before.max(value);
                (before, *current)
            }
            Entry::Vacant(slot) => {
                slot.insert((StoredKey::new(key), value));
                (ABSENT, value)
            }
        }
    }

    pub(crate) fn get(&self, key: &str) -> Option<i64> {
        let hash = self.hash(key.as_bytes());
        Self::find(&self.lock(Self::shard_of(hash)), hash, key.as_bytes())
    }

    /// Raises `key` to at least `value`; returns the value now held.
    pub(crate) fn raise(&self, key: &str, value: i64) -> i64 {
        let hash = self.hash(key.as_bytes());
        let mut shard = self.lock(Self::shard_of(hash));
        self.raise_in(&mut shard, hash, key.as_bytes(), value).1
    }

    fn set(&self, key: &str, value: i64) {
        let hash = self.hash(key.as_bytes());
        let mut shard = self.lock(Self::shard_of(hash));
        match shard.entry(
            hash,
            |(k, _)| k.as_bytes() == key.as_bytes(),
            |(k, _)| self.hash(k.as_bytes()),
        ) {
            Entry::Occupied(mut slot) => slot.get_mut().1 = value,
            Entry::Vacant(slot) => {
                slot.insert((StoredKey::new(key.as_bytes()), value));
            }
        }
    }

    fn remove(&self, key: &str) {
        let hash = self.hash(key.as_bytes());
        if let Ok(entry) = self
            .lock(Self::shard_of(hash))
            .find_entry(hash, |(k, _)| k.as_bytes() == key.as_bytes())
        {
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
        let mut out: Vec<(String, i64)> = (0..SHARDS)
            .flat_map(|index| {
                self.lock(index)
                    .iter()
                    .filter(|(k, _)| k.as_bytes().starts_with(prefix.as_bytes()))
                    .map(|(k, v)| (k.to_text(), *v))
                    .collect::<Vec<_>>()
            })
            .collect();
        out.sort_unstable();
        out
    }

    pub(crate) fn len(&self) -> usize {
        (0..SHARDS).map(|index| self.lock(index).len()).sum()
    }

    /// Runs a CAS-max batch: persists each key's highest value of the batch with `persist`
    /// (a merge under the max operator, so a value that does not raise the stored one
    /// changes nothing), then publishes them, learning each key's previous value on the way.
    ///
    /// Hot path. The batch's keys are encoded into one buffer; each is hashed once, and that
    /// hash both finds repeats of a key within the batch (applied in batch order against a
    /// running value) and places it in the table; the table is probed once per key and each
    /// shard locked once. (Earlier versions sorted the batch by key to group repeats — the sort
    /// cost more than RocksDB gained from ordered inserts — and looked every key up before
    /// writing too, to skip writes that raise nothing.)
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
        // Repeated keys of the batch share one `Distinct`, found by the key's hash.
        let mut distinct: Vec<Distinct> = Vec::with_capacity(entries.len());
        let mut slot_of_entry = Vec::with_capacity(entries.len());
        let mut seen: HashTable<usize> = HashTable::with_capacity(entries.len());
        for entry in 0..entries.len() {
            let key = key_of(entry);
            let hash = self.hash(key.as_bytes());
            let slot = match seen.find(hash, |&d| key_of(distinct[d].entry) == key) {
                Some(&slot) => slot,
                None => {
                    distinct.push(Distinct {
                        entry,
                        hash,
                        before: ABSENT,
                        after: ABSENT,
                    });
                    let slot = distinct.len() - 1;
                    seen.insert_unique(hash, slot, |&d| distinct[d].hash);
                    slot
                }
            };
            slot_of_entry.push(slot);
        }
        if distinct.is_empty() {
            return Ok(Vec::new());
        }
        // Each key's highest value in the batch is persisted as a merge operand (RocksDB's max
        // operator makes one that does not raise the stored value a no-op), so the index is
        // looked up once per key, when publishing, not also before writing to plan.
        for (entry, (_, offset)) in entries.iter().enumerate() {
            let d = &mut distinct[slot_of_entry[entry]];
            d.after = d.after.max(*offset);
        }
        let changes: Vec<Change<'_>> = distinct
            .iter()
            .map(|d| Change::Max(key_of(d.entry), d.after))
            .collect();
        persist(&changes)?;
        // Distinct keys by shard, so each shard is locked once. Absent is below every value,
        // so a first write of -1 (a group's start marker) creates the key. `after` becomes
        // what is stored now (a concurrent batch may have gone higher).
        let mut by_shard: Vec<usize> = (0..distinct.len()).collect();
        by_shard.sort_unstable_by_key(|&d| Self::shard_of(distinct[d].hash));
        self.each_by_shard(&mut distinct, &by_shard, |shard, d| {
            (d.before, d.after) = self.raise_in(shard, d.hash, key_of(d.entry).as_bytes(), d.after);
        });
        // Entries in batch order against each key's running value from before the batch.
        let mut running: Vec<i64> = distinct.iter().map(|d| d.before).collect();
        Ok(entries
            .iter()
            .enumerate()
            .map(|(entry, (_, offset))| {
                let slot = slot_of_entry[entry];
                let advanced = *offset > running[slot];
                running[slot] = running[slot].max(*offset);
                WriteOutcome {
                    stored: distinct[slot].after.max(UNKNOWN_OFFSET),
                    advanced,
                }
            })
            .collect())
    }

    /// Visits `distinct` in `by_shard` order (grouped by shard), each shard locked once.
    fn each_by_shard(
        &self,
        distinct: &mut [Distinct],
        by_shard: &[usize],
        mut visit: impl FnMut(&mut HashTable<Slot>, &mut Distinct),
    ) {
        let mut at = 0;
        while at < by_shard.len() {
            let index = Self::shard_of(distinct[by_shard[at]].hash);
            let mut shard = self.lock(index);
            while at < by_shard.len() && Self::shard_of(distinct[by_shard[at]].hash) == index {
                visit(&mut shard, &mut distinct[by_shard[at]]);
                at += 1;
            }
        }
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

pub(crate) fn parse_stored_key(key: &str) -> Result<OffsetKey, Error> {
    key.parse().map_err(|_| Error::CorruptKey(key.to_owned()))
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn short_keys_are_inline_and_long_ones_on_the_heap() {
        for key in ["", "t#c#0", &"k".repeat(INLINE_KEY_BYTES)] {
            let stored = StoredKey::new(key.as_bytes());
            assert!(matches!(stored, StoredKey::Inline { .. }), "{key}");
            assert_eq!(stored.as_bytes(), key.as_bytes());
        }
        for key in ["k".repeat(INLINE_KEY_BYTES + 1), "k".repeat(300)] {
            let stored = StoredKey::new(key.as_bytes());
            assert!(matches!(stored, StoredKey::Heap(_)), "{}", key.len());
            assert_eq!(stored.to_text(), key);
        }
        assert_eq!(std::mem::size_of::<Slot>(), 48);
    }

    /// Inline and heap keys side by side, in one batch with repeats, across every shard.
    #[test]
    fn batches_of_short_and_long_keys_raise_in_order() {
        let table = MaxTable::new();
        let long_client = "c".repeat(60);
        let keys: Vec<OffsetKey> = (0..300)
            .map(|i| {
                let client = if i % 2 == 0 {
                    "c"
                } else {
                    long_client.as_str()
                };
                OffsetKey::parse_parts("t", client, &(i / 2).to_string()).unwrap()
            })
            .collect();
        let mut entries: Vec<(OffsetKey, i64)> = keys.iter().map(|k| (k.clone(), 5)).collect();
        entries.push((keys[0].clone(), 3));
        entries.push((keys[1].clone(), 9));
        let outcomes = table.write_batch(&entries, |_| Ok(())).unwrap();
        assert!(outcomes[..300].iter().all(|o| o.advanced));
        assert_eq!(outcomes[0].stored, 5);
        assert_eq!(outcomes[1].stored, 9);
        assert!(!outcomes[300].advanced, "3 after 5 does not raise");
        assert!(outcomes[301].advanced, "9 after 5 raises");
        assert_eq!(table.len(), 300);
        assert_eq!(table.get(&keys[1].to_string()), Some(9));
        assert_eq!(table.get(&keys[299].to_string()), Some(5));
        // Nothing rises: the writes are persisted as no-op merges and nothing advances.
        let mut persisted = 0;
        let again = table
            .write_batch(&entries[..10], |changes| {
                persisted += changes.len();
                Ok(())
            })
            .unwrap();
        assert_eq!(persisted, 10);
        assert!(again.iter().all(|o| !o.advanced));
        assert_eq!(again[1].stored, 9);
        // A failed persist publishes nothing.
        let higher: Vec<(OffsetKey, i64)> = keys.iter().map(|k| (k.clone(), 50)).collect();
        assert!(
            table
                .write_batch(&higher, |_| Err(Error::Internal("disk full")))
                .is_err()
        );
        assert_eq!(table.get(&keys[2].to_string()), Some(5));
        let scanned = table.scan("t#c#");
        assert_eq!(scanned.len(), 150);
        assert!(scanned.windows(2).all(|w| w[0].0 < w[1].0));
    }
}

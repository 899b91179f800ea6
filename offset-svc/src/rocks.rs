//! The durable [`OffsetStore`] on RocksDB.
//!
//! Layout: one database, default column family. Key = the UTF-8 text `topic#client#partition`
//! (see `eventmesh_common::keys::OffsetKey`). Value = [`encode_value`]:
//!
//! ```text
//! version 1: [0x01][offset: i64 big-endian]        (9 bytes)
//! legacy:    ASCII decimal, e.g. b"42"             (the Java reference's format; read only)
//! ```
//!
//! Writes never read the disk and never take a global lock: each raise is a RocksDB *merge*
//! operand, and the associative merge operator [`MERGE_OPERATOR_NAME`] keeps the maximum, so
//! concurrent writers converge to the highest value whatever order RocksDB applies them in.
//! The answer "what is stored now" comes from the in-memory index ([`MaxTable`]), which holds
//! every key, is loaded at open, and takes a value only after RocksDB accepted it.
//!
//! Durability: the write-ahead log is always on, so an acknowledged batch survives a process
//! crash (`kill -9`); with `sync` it is fsynced and survives an OS crash or power loss too.
//! Operator resets are plain puts (a put replaces every older merge operand) and deletes are
//! deletes.

use std::path::{Path, PathBuf};

use eventmesh_common::keys::OffsetKey;
use rocksdb::{DB, IteratorMode, MergeOperands, Options, WriteBatch, WriteOptions};

use crate::error::Error;
use crate::store::{Change, MaxTable, Persistence, TableStore};

/// The name RocksDB records for the merge operator; changing it makes old databases refuse
/// to open, so it carries the value-format version.
pub const MERGE_OPERATOR_NAME: &str = "eventmesh.offset.max.v1";

/// Version byte of the current value encoding.
pub const VALUE_VERSION: u8 = 1;

/// Encodes an offset as a version-1 value.
pub fn encode_value(offset: i64) -> [u8; 9] {
    let mut out = [0u8; 9];
    out[0] = VALUE_VERSION;
    out[1..].copy_from_slice(&offset.to_be_bytes());
    out
}

/// Decodes a stored value (version 1, or the legacy ASCII decimal form).
pub fn decode_value(bytes: &[u8]) -> Result<i64, String> {
    match bytes {
        [VALUE_VERSION, rest @ ..] => rest
            .try_into()
            .map(i64::from_be_bytes)
            .map_err(|_| format!("version-1 value has {} bytes, expected 9", bytes.len())),
        [b'0'..=b'9' | b'-', ..] => std::str::from_utf8(bytes)
            .ok()
            .and_then(|text| text.parse().ok())
            .ok_or_else(|| "legacy value is not a decimal number".to_owned()),
        [] => Err("empty value".to_owned()),
        [version, ..] => Err(format!("unknown value version {version}")),
    }
}

/// The merge operator: the maximum of the existing value and every operand. A value that does
/// not decode fails the merge, which RocksDB reports as corruption on the next read of that
/// key — loud, instead of silently dropping or regressing an offset.
pub fn max_merge(key: &[u8], existing: Option<&[u8]>, operands: &MergeOperands) -> Option<Vec<u8>> {
    let mut max: Option<i64> = None;
    for value in existing.into_iter().chain(operands.iter()) {
        match decode_value(value) {
            Ok(offset) => max = Some(max.map_or(offset, |m| m.max(offset))),
            Err(why) => {
                tracing::error!(key = %String::from_utf8_lossy(key), why, "corrupt offset value in merge");
                return None;
            }
        }
    }
    max.map(|offset| encode_value(offset).to_vec())
}

/// How to open the database.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum OpenMode {
    /// Read and write (creates the database if missing).
    #[default]
    ReadWrite,
    /// Read only, for inspection while another process owns the database; every write fails.
    ReadOnly,
}

/// RocksDB as the [`Persistence`] of a [`TableStore`].
pub struct RocksDb {
    db: DB,
    path: PathBuf,
    mode: OpenMode,
}

/// Offsets in RocksDB with an in-memory index.
pub type RocksDbOffsetStore = TableStore<RocksDb>;

impl TableStore<RocksDb> {
    /// Opens (creating if missing) the database at `path` and loads its index.
    pub fn open(path: impl AsRef<Path>) -> Result<Self, Error> {
        Self::open_with(path, OpenMode::ReadWrite)
    }

    /// Opens the database in the given mode and loads its index.
    pub fn open_with(path: impl AsRef<Path>, mode: OpenMode) -> Result<Self, Error> {
        let path = path.as_ref().to_owned();
        let mut options = Options::default();
        options.create_if_missing(true);
        options.set_merge_operator_associative(MERGE_OPERATOR_NAME, max_merge);
        // Offsets are tiny and hot: keep more of them in the memtable before flushing.
        options.set_write_buffer_size(64 * 1024 * 1024);
        options.increase_parallelism(2);
        let opened = match mode {
            OpenMode::ReadWrite => DB::open(&options, &path),
            OpenMode::ReadOnly => DB::open_for_read_only(&options, &path, false),
        };
        let db = opened.map_err(|source| Error::Open {
            path: path.clone(),
            source,
        })?;
        let table = MaxTable::new();
        let mut skipped = 0usize;
        for item in db.iterator(IteratorMode::Start) {
            let (key, value) = item.map_err(Error::Read)?;
            let key_text = String::from_utf8_lossy(&key).into_owned();
            let value = decode_value(&value).map_err(|why| Error::CorruptValue {
                key: key_text.clone(),
                why,
            })?;
            if key_text.parse::<OffsetKey>().is_err() {
                // Written by something that did not validate names (e.g. the Java reference
                // with a `#` in a topic). Kept on disk untouched, but not served.
                tracing::warn!(key = %key_text, "ignoring stored offset with an invalid key");
                skipped += 1;
                continue;
            }
            table.raise(&key_text, value);
        }
        tracing::info!(path = %path.display(), keys = table.len(), skipped, ?mode, "offset store opened");
        Ok(TableStore::with_persistence(
            table,
            RocksDb { db, path, mode },
        ))
    }

    /// The database directory.
    pub fn path(&self) -> &Path {
        &self.persistence().path
    }
}

impl Persistence for RocksDb {
    fn persist(&self, changes: &[Change<'_>], sync: bool) -> Result<(), Error> {
        let mut options = WriteOptions::default();
        options.set_sync(sync);
        self.db
            .write_opt(write_batch(changes), &options)
            .map_err(Error::Write)
    }

    fn persist_without_stalling(&self, changes: &[Change<'_>]) -> Result<(), Error> {
        let mut options = WriteOptions::default();
        // Fails at once with `Incomplete` where it would wait for compaction or a flush.
        options.set_no_slowdown(true);
        self.db
            .write_opt(write_batch(changes), &options)
            .map_err(|err| match err.kind() {
                rocksdb::ErrorKind::Incomplete => Error::WouldStall,
                _ => Error::Write(err),
            })
    }

    fn flush(&self) -> Result<(), Error> {
        if self.mode == OpenMode::ReadOnly {
            // Nothing of ours to flush; RocksDB refuses the call on a read-only handle.
            return Ok(());
        }
        self.db.flush_wal(true).map_err(Error::Flush)?;
        self.db.flush().map_err(Error::Flush)
    }
}

/// `changes` as one RocksDB write batch.
fn write_batch(changes: &[Change<'_>]) -> WriteBatch {
    let mut batch = WriteBatch::default();
    for change in changes {
        match change {
            Change::Max(key, value) => batch.merge(key.as_bytes(), encode_value(*value)),
            Change::Set(key, value) => batch.put(key.as_bytes(), encode_value(*value)),
            Change::Delete(key) => batch.delete(key.as_bytes()),
        }
    }
    batch
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn value_encoding_round_trips_and_reads_legacy() {
        for offset in [0, 1, 42, i64::MAX, -1] {
            assert_eq!(decode_value(&encode_value(offset)), Ok(offset));
        }
        assert_eq!(decode_value(b"42"), Ok(42));
        assert_eq!(decode_value(b"-1"), Ok(-1));
        assert!(decode_value(b"").is_err());
        assert!(decode_value(&[1, 2, 3]).is_err());
        assert!(
            decode_value(&[9; 9])
                .unwrap_err()
                .contains("unknown value version 9")
        );
        assert!(decode_value(b"4x2").is_err());
    }

    /// The write without waiting (RocksDB's `no_slowdown`) is a real, persisted write.
    #[test]
    #[allow(clippy::unwrap_used)]
    fn a_write_without_waiting_is_persisted() {
        use crate::store::OffsetStore;
        let dir = tempfile::tempdir().unwrap();
        let key: eventmesh_common::keys::OffsetKey = "t#__mqcursor__#0".parse().unwrap();
        {
            let store = RocksDbOffsetStore::open(dir.path()).unwrap();
            let outcomes = store
                .write_batch_without_waiting(&[(key.clone(), 9)])
                .expect("an idle database does not stall")
                .unwrap();
            assert!(outcomes[0].advanced);
        }
        let reopened = RocksDbOffsetStore::open(dir.path()).unwrap();
        assert_eq!(reopened.read_offset(&key).unwrap(), 9);
    }
}

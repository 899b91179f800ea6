//! The in-memory [`OffsetStore`](crate::OffsetStore): the same code as the RocksDB store with
//! nothing persisted, so nothing survives the process. For tests, demos and single-process
//! experiments.

use crate::error::Error;
use crate::store::{Change, MaxTable, Persistence, TableStore};

/// Persistence that keeps nothing.
#[derive(Debug, Default)]
pub struct Volatile;

impl Persistence for Volatile {
    fn persist(&self, _changes: &[Change<'_>], _sync: bool) -> Result<(), Error> {
        Ok(())
    }

    fn flush(&self) -> Result<(), Error> {
        Ok(())
    }
}

/// Offsets in a sharded in-memory map.
pub type MemoryOffsetStore = TableStore<Volatile>;

impl TableStore<Volatile> {
    /// An empty store.
    pub fn new() -> Self {
        TableStore::with_persistence(MaxTable::new(), Volatile)
    }
}

impl Default for TableStore<Volatile> {
    fn default() -> Self {
        Self::new()
    }
}

//! The in-memory [`OffsetStore`]: same semantics as the RocksDB store, nothing survives the
//! process. For tests, demos and single-process experiments.

use eventmesh_common::keys::{OffsetClient, OffsetKey, Topic};

use crate::error::Error;
use crate::store::{MaxTable, OffsetStore, Selector, UNKNOWN_OFFSET, WriteOutcome};

/// Offsets in a sharded in-memory map.
pub struct MemoryOffsetStore {
    table: MaxTable,
}

impl MemoryOffsetStore {
    /// An empty store.
    pub fn new() -> Self {
        MemoryOffsetStore {
            table: MaxTable::new(),
        }
    }
}

impl Default for MemoryOffsetStore {
    fn default() -> Self {
        Self::new()
    }
}

impl OffsetStore for MemoryOffsetStore {
    fn write_batch(
        &self,
        entries: &[(OffsetKey, i64)],
        _sync: bool,
    ) -> Result<Vec<WriteOutcome>, Error> {
        self.table.write_batch(entries, |_| Ok(()))
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
        self.table
            .operator_change(selector, Some(offset), reason, |_| Ok(()))
    }

    fn delete(&self, selector: &Selector, reason: &str) -> Result<Vec<(OffsetKey, i64)>, Error> {
        self.table
            .operator_change(selector, None, reason, |_| Ok(()))
    }

    fn flush(&self) -> Result<(), Error> {
        Ok(())
    }
}

//! offset-svc: the durable, monotonic store of ACK progress.
//!
//! It owns one RocksDB database of keys `topic#client#partition` → offset, where `client` is
//! an application client id (its gap-free ACK watermark) or a subscription group's reserved MQ
//! cursor `__mqcursor__` / `__mqcursor@<group>__` (the group's gap-free MQ watermark, which
//! puller-svc reads at boot to rewind its cursors). Writes are CAS-max: a value never goes down
//! except through the explicit, logged operator calls.
//!
//! * [`store`] — the [`store::OffsetStore`] contract.
//! * [`memory`], [`rocks`] — the two stores, over one in-memory index (`table`).
//! * [`service`] — the gRPC `OffsetService`.
//! * [`server`], [`config`] — running it.

pub mod config;
pub mod error;
pub mod memory;
pub mod rocks;
pub mod server;
pub mod service;
pub mod store;
mod table;

pub use error::Error;
pub use memory::MemoryOffsetStore;
pub use rocks::RocksDbOffsetStore;
pub use store::{OffsetStore, Persistence, Selector, TableStore, UNKNOWN_OFFSET, WriteOutcome};

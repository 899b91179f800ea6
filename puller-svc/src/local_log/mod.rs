//! The embedded `local` backend's storage: a durable, partitioned, append-only log on local
//! disk for one machine, demos and tests. See [`partition`] for the record format, recovery
//! and retention.

pub mod partition;

pub use partition::{LogError, LogSettings, PartitionLog, Record};

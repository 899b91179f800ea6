//! The embedded `local` backend's storage: a durable, partitioned, append-only log on local
//! disk for one machine, demos and tests. See [`partition`] for the record format, recovery
//! and retention, and [`topics`] for topics, partitioning and lite channels.

pub mod partition;
pub mod topics;

pub use partition::{LogError, LogSettings, PartitionLog, Record};
pub use topics::{Appended, LocalLog, NewRecord, PartitionRange, TopicError};

//! What a backend's brokers report about a topic's storage: the bounds an operator checks
//! (`emctl rocketmq-check`) next to our cursors and watermarks. Read-only; nothing here moves
//! a position.

use eventmesh_common::keys::PartitionId;

/// One broker's own storage.
#[derive(Debug, Clone, PartialEq)]
pub struct BrokerStorage {
    /// The broker's name.
    pub broker: String,
    /// Its master's address.
    pub address: String,
    /// The lowest commit-log offset still on disk (older files were deleted).
    pub commit_log_min_offset: i64,
    /// One past the highest commit-log offset written.
    pub commit_log_max_offset: i64,
    /// Hours a commit-log file is kept (`fileReservedTime`).
    pub file_reserved_hours: Option<i64>,
    /// When expired files are deleted (`deleteWhen`).
    pub delete_when: Option<String>,
    /// Share of the commit log's disk in use, 0 to 1.
    pub commit_log_disk_ratio: Option<f64>,
}

/// One consume queue of the topic.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct QueueStorage {
    /// The partition (`broker:queue`).
    pub partition: PartitionId,
    /// The lowest logical offset the queue still indexes.
    pub min_offset: i64,
    /// One past the highest logical offset.
    pub max_offset: i64,
    /// The commit-log offset the entry at `min_offset` points at (`None`: empty queue, or not
    /// returned).
    pub min_entry_commit_log_offset: Option<i64>,
}

/// A topic's brokers and queues.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct BrokerStorageReport {
    /// The brokers holding the topic's queues, by name.
    pub brokers: Vec<BrokerStorage>,
    /// Every readable queue, in route order.
    pub queues: Vec<QueueStorage>,
}

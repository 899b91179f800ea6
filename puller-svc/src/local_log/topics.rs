//! Topics of the embedded local log: each a fixed set of numbered partitions plus lite
//! sub-logs, under one root directory.
//!
//! Layout: `<root>/<topic>/topic.properties` (format version and partition count, written
//! atomically), `<root>/<topic>/<n>/` per partition, `<root>/<topic>/lite/<lite>@<queue>/`
//! per lite channel. Topic and lite names are percent-encoded for the file system (every byte
//! outside `[A-Za-z0-9_-]`, so `/`, `.` and `..` can never escape the root).
//!
//! Partition choice on append: an explicit partition; else the key's CRC-32C modulo the
//! partition count (stable across restarts and instances); else round-robin. A lite channel
//! lives on queue `crc32c(lite) % partitions` of its parent, which gives its partition id
//! `<lite>@<queue>`.
//!
//! Appends and reads block on file I/O; async callers run them on a blocking thread.

use std::collections::HashMap;
use std::fs;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};

use bytes::Bytes;
use eventmesh_common::keys::{PartitionId, PartitionKind, Topic};

use super::partition::{LogError, LogSettings, PartitionLog, Record};
use crate::properties;

const META_FILE: &str = "topic.properties";
const META_VERSION: &str = "1";
const LITE_DIR: &str = "lite";

/// Errors of the topic layer.
#[derive(Debug, thiserror::Error)]
pub enum TopicError {
    /// The topic does not exist.
    #[error("unknown topic {0}")]
    UnknownTopic(String),
    /// The partition does not exist in the topic.
    #[error("topic {topic} has no partition {partition}")]
    UnknownPartition {
        /// The topic.
        topic: String,
        /// The partition asked for.
        partition: String,
    },
    /// A partition count of zero.
    #[error("a topic needs at least one partition")]
    NoPartitions,
    /// A topic's metadata file is unusable.
    #[error("topic metadata {path} is unusable: {why}")]
    BadMetadata {
        /// The file.
        path: PathBuf,
        /// Why.
        why: String,
    },
    /// A lite channel name is invalid.
    #[error(
        "invalid lite channel name {0:?}: must be non-empty without '#', '@' or control characters, and fit a file name once encoded"
    )]
    BadLiteName(String),
    /// A topic name whose on-disk form does not fit a file name.
    #[error(
        "topic name {name:?} takes {encoded} bytes on disk once encoded (bytes outside [A-Za-z0-9_-] take three), more than the local backend's limit of {MAX_NAME_COMPONENT}: use a shorter name or fewer other characters"
    )]
    NameTooLong {
        /// The name (the topic's or its dead-letter topic's).
        name: String,
        /// Its encoded length.
        encoded: usize,
    },
    /// The partition log failed.
    #[error(transparent)]
    Log(#[from] LogError),
}

/// Percent-encodes a name for use as one path component.
pub fn encode_name(name: &str) -> String {
    let mut out = String::with_capacity(name.len());
    for byte in name.bytes() {
        if byte.is_ascii_alphanumeric() || byte == b'_' || byte == b'-' {
            out.push(byte as char);
        } else {
            out.push_str(&format!("%{byte:02X}"));
        }
    }
    out
}

/// Reverses [`encode_name`]; `None` for text it could not have produced.
pub fn decode_name(encoded: &str) -> Option<String> {
    let mut bytes = Vec::with_capacity(encoded.len());
    let mut iter = encoded.bytes();
    while let Some(byte) = iter.next() {
        if byte == b'%' {
            let hex = [iter.next()?, iter.next()?];
            bytes.push(u8::from_str_radix(std::str::from_utf8(&hex).ok()?, 16).ok()?);
        } else {
            bytes.push(byte);
        }
    }
    String::from_utf8(bytes).ok()
}

type SharedLog = Arc<Mutex<PartitionLog>>;

struct TopicLog {
    dir: PathBuf,
    partitions: Vec<SharedLog>,
    lites: Mutex<HashMap<PartitionId, SharedLog>>,
    round_robin: AtomicU64,
}

impl TopicLog {
    /// The numbered partition a record goes to: the explicit one, else by key, else round
    /// robin.
    fn partition_for(
        &self,
        topic: &Topic,
        key: &[u8],
        partition: Option<&PartitionId>,
    ) -> Result<usize, TopicError> {
        let count = self.partitions.len() as u64;
        Ok(match partition {
            Some(id) => numbered(topic, id, self.partitions.len())?,
            None if !key.is_empty() => (crc32c::crc32c(key) as u64 % count) as usize,
            None => (self.round_robin.fetch_add(1, Ordering::Relaxed) % count) as usize,
        })
    }
}

/// Where an append landed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Appended {
    /// The partition.
    pub partition: PartitionId,
    /// The offset inside it.
    pub offset: i64,
}

/// A record to append.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NewRecord {
    /// Ordering key (may be empty).
    pub key: Bytes,
    /// The body.
    pub body: Bytes,
    /// An explicit numbered partition; `None` places by key, else round robin.
    pub partition: Option<PartitionId>,
}

/// A partition's retained range: `[start, end)`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PartitionRange {
    /// The partition.
    pub partition: PartitionId,
    /// The oldest retained offset.
    pub start: i64,
    /// The offset of the next append.
    pub end: i64,
}

/// All topics of one local log directory.
pub struct LocalLog {
    root: PathBuf,
    settings: LogSettings,
    /// Age limit of dead-letter topics (`<topic>_DLQ`); `None` keeps them, whatever the
    /// settings of other topics say: a dead letter is the one copy left of an event.
    dead_letter_retention_ms: Option<i64>,
    topics: RwLock<HashMap<Topic, Arc<TopicLog>>>,
}

/// Longest file-name component the local log writes (ext4, XFS, btrfs: 255 bytes).
pub const MAX_NAME_COMPONENT: usize = 255;

fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    // A panic while holding a partition lock cannot leave a half-written record in memory
    // (the index is updated after the write), so the data is still consistent.
    mutex
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

impl LocalLog {
    /// Opens every topic under `root` (creating the directory if missing), recovering each
    /// partition. Dead-letter topics are kept forever.
    pub fn open(root: impl Into<PathBuf>, settings: LogSettings) -> Result<Self, TopicError> {
        LocalLog::open_with(root, settings, None)
    }

    /// As [`LocalLog::open`], with an age limit for dead-letter topics (`None`: keep them).
    pub fn open_with(
        root: impl Into<PathBuf>,
        settings: LogSettings,
        dead_letter_retention_ms: Option<i64>,
    ) -> Result<Self, TopicError> {
        let root = root.into();
        fs::create_dir_all(&root).map_err(|source| LogError::Io {
            path: root.clone(),
            source,
        })?;
        let mut topics = HashMap::new();
        let entries = fs::read_dir(&root).map_err(|source| LogError::Io {
            path: root.clone(),
            source,
        })?;
        for entry in entries.flatten() {
            let dir = entry.path();
            let Some(name) = entry.file_name().to_str().and_then(decode_name) else {
                tracing::warn!(dir = %dir.display(), "ignoring a directory that is not an encoded topic name");
                continue;
            };
            let Ok(topic) = Topic::new(name) else {
                tracing::warn!(dir = %dir.display(), "ignoring a directory whose name is not a valid topic");
                continue;
            };
            if !dir.join(META_FILE).exists() {
                // A topic whose creation never completed: no metadata, nothing acknowledged.
                tracing::warn!(dir = %dir.display(), "ignoring a topic directory without metadata");
                continue;
            }
            let count = read_partition_count(&dir)?;
            let settings = settings_for(&topic, settings, dead_letter_retention_ms);
            topics.insert(topic, Arc::new(open_topic(&dir, count, settings)?));
        }
        Ok(LocalLog {
            root,
            settings,
            dead_letter_retention_ms,
            topics: RwLock::new(topics),
        })
    }

    /// Refuses a topic name whose on-disk form (every byte outside `[A-Za-z0-9_-]` takes
    /// three) would not fit a file name, for the topic and for its dead-letter topic.
    pub fn check_name(topic: &Topic) -> Result<(), TopicError> {
        let dead_letters = eventmesh_common::dead_letter::dlq_topic(topic.as_str());
        for name in [topic.as_str(), dead_letters.as_str()] {
            let encoded = encode_name(name).len();
            if encoded > MAX_NAME_COMPONENT {
                return Err(TopicError::NameTooLong {
                    name: name.to_owned(),
                    encoded,
                });
            }
        }
        Ok(())
    }

    fn topic(&self, topic: &Topic) -> Result<Arc<TopicLog>, TopicError> {
        self.topics
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .get(topic)
            .cloned()
            .ok_or_else(|| TopicError::UnknownTopic(topic.to_string()))
    }

    /// Creates a topic with `partitions` partitions; `Ok(false)` when it already existed (its
    /// partition count is kept).
    pub fn create_topic(&self, topic: &Topic, partitions: u32) -> Result<bool, TopicError> {
        if partitions == 0 {
            return Err(TopicError::NoPartitions);
        }
        LocalLog::check_name(topic)?;
        let mut topics = self.topics.write().unwrap_or_else(|p| p.into_inner());
        if topics.contains_key(topic) {
            return Ok(false);
        }
        let dir = self.root.join(encode_name(topic.as_str()));
        let settings = settings_for(topic, self.settings, self.dead_letter_retention_ms);
        let log = open_topic(&dir, partitions, settings)?;
        // Metadata last: a crash before this leaves a directory that open() ignores.
        write_metadata(&dir, partitions)?;
        topics.insert(topic.clone(), Arc::new(log));
        tracing::info!(%topic, partitions, "local log topic created");
        Ok(true)
    }

    /// Topics, sorted.
    pub fn topics(&self) -> Vec<Topic> {
        let mut names: Vec<Topic> = self
            .topics
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .keys()
            .cloned()
            .collect();
        names.sort();
        names
    }

    /// Appends one record (explicit partition, else by key, else round robin).
    pub fn append(
        &self,
        topic: &Topic,
        key: &[u8],
        body: &[u8],
        partition: Option<&PartitionId>,
        timestamp_ms: i64,
    ) -> Result<Appended, TopicError> {
        let log = self.topic(topic)?;
        let index = log.partition_for(topic, key, partition)?;
        let offset = lock(&log.partitions[index]).append(key, body, timestamp_ms)?;
        Ok(Appended {
            partition: PartitionId::number(index as u32),
            offset,
        })
    }

    /// Appends records to one topic, each placed as [`LocalLog::append`] places it, taking
    /// each partition's lock once and writing each partition's records in one write (see
    /// [`PartitionLog::append_batch`] for what a result means). Records of one partition keep
    /// their order. Fails as a whole only when the topic is unknown.
    pub fn append_batch(
        &self,
        topic: &Topic,
        records: &[NewRecord],
        timestamp_ms: i64,
    ) -> Result<Vec<Result<Appended, TopicError>>, TopicError> {
        let log = self.topic(topic)?;
        let mut results: Vec<Result<Appended, TopicError>> = Vec::with_capacity(records.len());
        // Per partition, the indexes of its records in `records`.
        let mut by_partition: Vec<Vec<usize>> = vec![Vec::new(); log.partitions.len()];
        for (i, record) in records.iter().enumerate() {
            match log.partition_for(topic, &record.key, record.partition.as_ref()) {
                Ok(index) => {
                    by_partition[index].push(i);
                    // Replaced below by the partition's answer.
                    results.push(Err(TopicError::NoPartitions));
                }
                Err(error) => results.push(Err(error)),
            }
        }
        for (index, members) in by_partition.iter().enumerate() {
            if members.is_empty() {
                continue;
            }
            let offsets = lock(&log.partitions[index]).append_batch(
                members
                    .iter()
                    .map(|&i| (&records[i].key[..], &records[i].body[..])),
                timestamp_ms,
            );
            for (&i, offset) in members.iter().zip(offsets) {
                results[i] = offset
                    .map(|offset| Appended {
                        partition: PartitionId::number(index as u32),
                        offset,
                    })
                    .map_err(TopicError::from);
            }
        }
        Ok(results)
    }

    /// Reads a numbered partition or a lite channel from `from`.
    pub fn read(
        &self,
        topic: &Topic,
        partition: &PartitionId,
        from: i64,
        max_records: usize,
        max_bytes: usize,
    ) -> Result<Vec<Record>, TopicError> {
        let shared = self.partition_log(topic, partition)?;
        let records = lock(&shared).read(from, max_records, max_bytes)?;
        Ok(records)
    }

    /// The retained range of every numbered partition of a topic.
    pub fn ranges(&self, topic: &Topic) -> Result<Vec<PartitionRange>, TopicError> {
        let log = self.topic(topic)?;
        Ok(log
            .partitions
            .iter()
            .enumerate()
            .map(|(index, shared)| {
                let partition = lock(shared);
                PartitionRange {
                    partition: PartitionId::number(index as u32),
                    start: partition.start_offset(),
                    end: partition.end_offset(),
                }
            })
            .collect())
    }

    /// The retained range of one numbered partition or lite channel.
    pub fn range(
        &self,
        topic: &Topic,
        partition: &PartitionId,
    ) -> Result<PartitionRange, TopicError> {
        let shared = self.partition_log(topic, partition)?;
        let log = lock(&shared);
        Ok(PartitionRange {
            partition: partition.clone(),
            start: log.start_offset(),
            end: log.end_offset(),
        })
    }

    /// The partition id of a lite channel of `parent` (`<lite>@<queue>`), creating its log.
    pub fn create_lite(&self, parent: &Topic, lite: &str) -> Result<PartitionId, TopicError> {
        let log = self.topic(parent)?;
        let queue = crc32c::crc32c(lite.as_bytes()) % log.partitions.len() as u32;
        let id =
            PartitionId::lite(lite, queue).map_err(|_| TopicError::BadLiteName(lite.to_owned()))?;
        if matches!(id.kind(), PartitionKind::Lite { lite: name, .. } if name != lite)
            || encode_name(id.as_str()).len() > MAX_NAME_COMPONENT
        {
            return Err(TopicError::BadLiteName(lite.to_owned()));
        }
        let mut lites = lock(&log.lites);
        if !lites.contains_key(&id) {
            let dir = log.dir.join(LITE_DIR).join(encode_name(id.as_str()));
            lites.insert(
                id.clone(),
                Arc::new(Mutex::new(PartitionLog::open(dir, self.settings)?)),
            );
        }
        Ok(id)
    }

    /// Appends to a lite channel (created on first use).
    pub fn append_lite(
        &self,
        parent: &Topic,
        lite: &str,
        body: &[u8],
        timestamp_ms: i64,
    ) -> Result<Appended, TopicError> {
        let partition = self.create_lite(parent, lite)?;
        let shared = self.partition_log(parent, &partition)?;
        let offset = lock(&shared).append(b"", body, timestamp_ms)?;
        Ok(Appended { partition, offset })
    }

    fn partition_log(
        &self,
        topic: &Topic,
        partition: &PartitionId,
    ) -> Result<SharedLog, TopicError> {
        let log = self.topic(topic)?;
        if let PartitionKind::Lite { .. } = partition.kind() {
            return lock(&log.lites).get(partition).cloned().ok_or_else(|| {
                TopicError::UnknownPartition {
                    topic: topic.to_string(),
                    partition: partition.to_string(),
                }
            });
        }
        let index = numbered(topic, partition, log.partitions.len())?;
        Ok(Arc::clone(&log.partitions[index]))
    }
}

fn numbered(topic: &Topic, partition: &PartitionId, count: usize) -> Result<usize, TopicError> {
    match partition.kind() {
        PartitionKind::Number(n) if (n as usize) < count => Ok(n as usize),
        _ => Err(TopicError::UnknownPartition {
            topic: topic.to_string(),
            partition: partition.to_string(),
        }),
    }
}

/// The partition settings of `topic`: a dead-letter topic has no size limit and its own age
/// limit (none by default).
fn settings_for(
    topic: &Topic,
    settings: LogSettings,
    dead_letter_retention_ms: Option<i64>,
) -> LogSettings {
    if eventmesh_common::dead_letter::is_dlq_topic(topic.as_str()) {
        LogSettings {
            retention_bytes: None,
            retention_ms: dead_letter_retention_ms,
            ..settings
        }
    } else {
        settings
    }
}

fn open_topic(dir: &Path, partitions: u32, settings: LogSettings) -> Result<TopicLog, TopicError> {
    let logs = (0..partitions)
        .map(|n| {
            Ok(Arc::new(Mutex::new(PartitionLog::open(
                dir.join(n.to_string()),
                settings,
            )?)))
        })
        .collect::<Result<Vec<_>, TopicError>>()?;
    let mut lites = HashMap::new();
    if let Ok(entries) = fs::read_dir(dir.join(LITE_DIR)) {
        for entry in entries.flatten() {
            let id = entry
                .file_name()
                .to_str()
                .and_then(decode_name)
                .and_then(|name| PartitionId::new(name).ok());
            match id {
                Some(id) => {
                    lites.insert(
                        id,
                        Arc::new(Mutex::new(PartitionLog::open(entry.path(), settings)?)),
                    );
                }
                None => {
                    tracing::warn!(dir = %entry.path().display(), "ignoring an unrecognised lite directory")
                }
            }
        }
    }
    Ok(TopicLog {
        dir: dir.to_owned(),
        partitions: logs,
        lites: Mutex::new(lites),
        round_robin: AtomicU64::new(0),
    })
}

fn write_metadata(dir: &Path, partitions: u32) -> Result<(), TopicError> {
    let path = dir.join(META_FILE);
    let count = partitions.to_string();
    let text = properties::write(
        &["EventMesh local log topic"],
        [("version", META_VERSION), ("partitions", count.as_str())],
    );
    let io = |source| LogError::Io {
        path: path.clone(),
        source,
    };
    let tmp = dir.join(format!("{META_FILE}.tmp"));
    fs::write(&tmp, text).map_err(io)?;
    fs::File::open(&tmp)
        .and_then(|f| f.sync_all())
        .map_err(io)?;
    fs::rename(&tmp, &path).map_err(io)?;
    fs::File::open(dir).and_then(|d| d.sync_all()).map_err(io)?;
    Ok(())
}

fn read_partition_count(dir: &Path) -> Result<u32, TopicError> {
    let path = dir.join(META_FILE);
    let bad = |why: String| TopicError::BadMetadata {
        path: path.clone(),
        why,
    };
    let text = fs::read_to_string(&path).map_err(|e| bad(e.to_string()))?;
    let entries: HashMap<String, String> = properties::parse(&text)
        .map_err(|e| bad(e.to_string()))?
        .into_iter()
        .collect();
    if entries.get("version").map(String::as_str) != Some(META_VERSION) {
        return Err(bad(format!(
            "version {:?} is not {META_VERSION}",
            entries.get("version")
        )));
    }
    entries
        .get("partitions")
        .and_then(|p| p.parse().ok())
        .filter(|p| *p > 0)
        .ok_or_else(|| bad("missing or invalid partition count".into()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_encode_into_one_safe_path_component() {
        for name in ["orders", "a/b", "..", ".", "a b", "日本", "x%y", "Ab_-9"] {
            let encoded = encode_name(name);
            assert!(
                !encoded.contains('/') && encoded != "." && encoded != "..",
                "{encoded}"
            );
            assert_eq!(decode_name(&encoded).as_deref(), Some(name));
        }
        assert_eq!(encode_name("a.b"), "a%2Eb");
        assert_eq!(decode_name("%G1"), None);
        assert_eq!(decode_name("%4"), None);
    }
}

//! One partition of the embedded local log: an append-only sequence of records in segment
//! files, offsets assigned at append, readable from any retained offset.
//!
//! On disk, a partition is a directory of segments named by their first offset
//! (`00000000000000000000.log`, zero-padded to 20 digits so names sort). A record is
//!
//! ```text
//! [len u32][crc u32][version u8 = 1][offset i64][timestamp_ms i64][key_len u32][key][body_len u32][body]
//! ```
//!
//! big-endian, where `len` counts the bytes after `crc`, and `crc` is the CRC-32C of those same
//! bytes. A record is written with one `write` call, so a `kill -9` leaves at most one partial
//! record at the tail; an append that returned survives a process crash (and, with `sync`,
//! an OS crash).
//!
//! Recovery at open scans every segment. In the last segment a record that is cut short, fails
//! its CRC, or breaks the offset sequence marks a torn tail: the file is truncated there, with a
//! warning naming the bytes dropped — they were never acknowledged. The same defect in an
//! earlier (sealed) segment is real corruption and fails the open: silently dropping the middle
//! of a log would skip messages.
//!
//! Retention removes whole sealed segments, oldest first, while the partition holds more than
//! `retention_bytes` or its oldest record is older than `retention_ms`; the active segment is
//! never removed. Reads below the oldest retained offset answer
//! [`LogError::OffsetOutOfRange`] with the log start, so the caller can move forward knowingly.

use std::fs::{self, File, OpenOptions};
use std::io::{self, Write};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use bytes::Bytes;

/// Record format version.
pub const RECORD_VERSION: u8 = 1;
/// Bytes before the key: len, crc, version, offset, timestamp, key_len.
const HEAD: usize = 4 + 4 + 1 + 8 + 8 + 4;
/// Largest record body accepted (the frame limit plus envelope slack).
pub const MAX_BODY_BYTES: usize = 17 * 1024 * 1024;
/// Largest record key accepted.
pub const MAX_KEY_BYTES: usize = 64 * 1024;

/// Size and retention settings of a partition.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LogSettings {
    /// Roll to a new segment once the active one reaches this size.
    pub segment_bytes: u64,
    /// Keep at most about this many bytes (whole segments); `None` keeps everything.
    pub retention_bytes: Option<u64>,
    /// Drop sealed segments whose newest record is older than this; `None` keeps everything.
    pub retention_ms: Option<i64>,
    /// fsync after every append (survives an OS crash, slower).
    pub sync: bool,
}

impl Default for LogSettings {
    fn default() -> Self {
        LogSettings {
            segment_bytes: 64 * 1024 * 1024,
            retention_bytes: None,
            retention_ms: Some(7 * 24 * 3600 * 1000),
            sync: false,
        }
    }
}

/// Errors of the local log.
#[derive(Debug, thiserror::Error)]
pub enum LogError {
    /// File system failure.
    #[error("local log I/O on {path}: {source}")]
    Io {
        /// The file or directory.
        path: PathBuf,
        /// The error.
        source: io::Error,
    },
    /// A sealed segment is damaged.
    #[error("local log segment {path} is corrupt at byte {position}: {why}")]
    Corrupt {
        /// The segment.
        path: PathBuf,
        /// Where.
        position: u64,
        /// What is wrong.
        why: String,
    },
    /// A read below the retained range.
    #[error("offset {requested} is below the log start {start}")]
    OffsetOutOfRange {
        /// The offset asked for.
        requested: i64,
        /// The oldest retained offset.
        start: i64,
    },
    /// A record larger than allowed.
    #[error("record {what} of {len} bytes exceeds the limit of {max}")]
    TooLarge {
        /// `key` or `body`.
        what: &'static str,
        /// Its size.
        len: usize,
        /// The limit.
        max: usize,
    },
}

fn io_error(path: &Path) -> impl FnOnce(io::Error) -> LogError + '_ {
    move |source| LogError::Io {
        path: path.to_owned(),
        source,
    }
}

/// A stored record.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Record {
    /// Its offset.
    pub offset: i64,
    /// Append time, milliseconds since the Unix epoch.
    pub timestamp_ms: i64,
    /// Ordering key (may be empty).
    pub key: Bytes,
    /// The body.
    pub body: Bytes,
}

struct Segment {
    base: i64,
    path: PathBuf,
    file: File,
    /// Byte position of each record, by `offset - base`.
    positions: Vec<u64>,
    size: u64,
    newest_timestamp_ms: i64,
}

impl Segment {
    fn next_offset(&self) -> i64 {
        self.base + self.positions.len() as i64
    }
}

/// One partition's log.
pub struct PartitionLog {
    dir: PathBuf,
    settings: LogSettings,
    segments: Vec<Segment>,
    /// Set when a failed write could not be cut off: the file's tail no longer matches the
    /// index, so appends are refused until a restart recovers the segment.
    broken: Option<String>,
}

fn segment_path(dir: &Path, base: i64) -> PathBuf {
    dir.join(format!("{base:020}.log"))
}

fn encode_into(out: &mut Vec<u8>, offset: i64, timestamp_ms: i64, key: &[u8], body: &[u8]) {
    let start = out.len();
    let len = HEAD - 8 + key.len() + 4 + body.len();
    out.reserve(8 + len);
    out.extend_from_slice(&(len as u32).to_be_bytes());
    out.extend_from_slice(&[0; 4]);
    out.push(RECORD_VERSION);
    out.extend_from_slice(&offset.to_be_bytes());
    out.extend_from_slice(&timestamp_ms.to_be_bytes());
    out.extend_from_slice(&(key.len() as u32).to_be_bytes());
    out.extend_from_slice(key);
    out.extend_from_slice(&(body.len() as u32).to_be_bytes());
    out.extend_from_slice(body);
    let crc = crc32c::crc32c(&out[start + 8..]);
    out[start + 4..start + 8].copy_from_slice(&crc.to_be_bytes());
}

/// Records encoded but not yet written: the bytes, and for each record its index in the
/// batch's results and its encoded length.
#[derive(Default)]
struct PendingWrite {
    buffer: Vec<u8>,
    records: Vec<(usize, u64)>,
}

/// Refuses a record whose key or body is over the limit.
fn check_record(key: &[u8], body: &[u8]) -> Result<(), LogError> {
    if key.len() > MAX_KEY_BYTES {
        return Err(LogError::TooLarge {
            what: "key",
            len: key.len(),
            max: MAX_KEY_BYTES,
        });
    }
    if body.len() > MAX_BODY_BYTES {
        return Err(LogError::TooLarge {
            what: "body",
            len: body.len(),
            max: MAX_BODY_BYTES,
        });
    }
    Ok(())
}

/// What a failed write tells the records after it.
fn error_reason(error: &LogError) -> (io::ErrorKind, String) {
    match error {
        // The records after it carry their own path: only the cause is repeated.
        LogError::Io { source, .. } => (source.kind(), source.to_string()),
        other => (io::ErrorKind::Other, other.to_string()),
    }
}

/// Decodes the record that is all of `buf` (its stored length is `buf.len() - 8`); key and
/// body share `buf`'s memory.
fn decode(buf: &Bytes) -> Result<Record, String> {
    if buf.len() < HEAD + 4 {
        return Err("record shorter than its header".into());
    }
    let stored_crc = u32::from_be_bytes([buf[4], buf[5], buf[6], buf[7]]);
    if crc32c::crc32c(&buf[8..]) != stored_crc {
        return Err("CRC mismatch".into());
    }
    if buf[8] != RECORD_VERSION {
        return Err(format!("unknown record version {}", buf[8]));
    }
    let be_i64 = |at: usize| i64::from_be_bytes(buf[at..at + 8].try_into().unwrap_or([0; 8]));
    let be_u32 =
        |at: usize| u32::from_be_bytes(buf[at..at + 4].try_into().unwrap_or([0; 4])) as usize;
    let offset = be_i64(9);
    let timestamp_ms = be_i64(17);
    let key_len = be_u32(25);
    let key_end = HEAD + key_len;
    if key_end + 4 > buf.len() {
        return Err("key length past the record".into());
    }
    let body_len = be_u32(key_end);
    if key_end + 4 + body_len != buf.len() {
        return Err("body length does not match the record length".into());
    }
    Ok(Record {
        offset,
        timestamp_ms,
        key: buf.slice(HEAD..key_end),
        body: buf.slice(key_end + 4..),
    })
}

/// Reads the record at `position`; `Ok(None)` at the end of the file.
fn read_record(file: &File, position: u64, file_len: u64) -> Result<Option<(Record, u64)>, String> {
    if position == file_len {
        return Ok(None);
    }
    if file_len - position < 8 {
        return Err("record header cut short".into());
    }
    let mut len = [0u8; 4];
    file.read_exact_at(&mut len, position)
        .map_err(|e| e.to_string())?;
    let len = u32::from_be_bytes(len) as u64;
    if len < (HEAD - 8 + 4) as u64 || len > (MAX_BODY_BYTES + MAX_KEY_BYTES + HEAD) as u64 {
        return Err(format!("implausible record length {len}"));
    }
    if file_len - position - 8 < len {
        return Err("record cut short".into());
    }
    let mut buf = vec![0u8; 8 + len as usize];
    file.read_exact_at(&mut buf, position)
        .map_err(|e| e.to_string())?;
    let record = decode(&Bytes::from(buf))?;
    Ok(Some((record, position + 8 + len)))
}

/// Reads the `count` indexed records from `positions[0]` on (the last ends at `end`) with one
/// read into one buffer; each record's key and body are slices of it.
fn read_span(
    file: &File,
    positions: &[u64],
    end: u64,
    out: &mut Vec<Record>,
) -> Result<(), String> {
    let Some(&start) = positions.first() else {
        return Ok(());
    };
    let len = usize::try_from(end.saturating_sub(start)).map_err(|e| e.to_string())?;
    let mut buf = vec![0u8; len];
    file.read_exact_at(&mut buf, start)
        .map_err(|e| e.to_string())?;
    let buf = Bytes::from(buf);
    for (i, &position) in positions.iter().enumerate() {
        let next = positions.get(i + 1).copied().unwrap_or(end);
        let (from, to) = ((position - start) as usize, (next - start) as usize);
        if to <= from || to > buf.len() || to - from < 8 {
            return Err(format!("index position {position} does not bound a record"));
        }
        let stored = u32::from_be_bytes([buf[from], buf[from + 1], buf[from + 2], buf[from + 3]]);
        if stored as usize != to - from - 8 {
            return Err(format!(
                "record at {position} is {stored} bytes, the index says {}",
                to - from - 8
            ));
        }
        out.push(decode(&buf.slice(from..to))?);
    }
    Ok(())
}

impl PartitionLog {
    /// Opens (creating if missing) the partition in `dir`, recovering as the module doc says.
    pub fn open(dir: impl Into<PathBuf>, settings: LogSettings) -> Result<Self, LogError> {
        let dir = dir.into();
        fs::create_dir_all(&dir).map_err(io_error(&dir))?;
        let mut bases: Vec<i64> = fs::read_dir(&dir)
            .map_err(io_error(&dir))?
            .filter_map(|entry| {
                let name = entry.ok()?.file_name().into_string().ok()?;
                name.strip_suffix(".log")?.parse().ok()
            })
            .collect();
        bases.sort_unstable();
        if bases.is_empty() {
            bases.push(0);
        }
        let mut segments = Vec::with_capacity(bases.len());
        let last = bases.len() - 1;
        for (index, base) in bases.iter().enumerate() {
            let expected_base = segments.last().map_or(*base, |s: &Segment| s.next_offset());
            if *base != expected_base {
                return Err(LogError::Corrupt {
                    path: segment_path(&dir, *base),
                    position: 0,
                    why: format!(
                        "segment starts at {base}, the previous one ends at {expected_base}"
                    ),
                });
            }
            segments.push(Self::recover_segment(&dir, *base, index == last)?);
        }
        let mut log = PartitionLog {
            dir,
            settings,
            segments,
            broken: None,
        };
        log.enforce_retention(now_ms())?;
        Ok(log)
    }

    fn recover_segment(dir: &Path, base: i64, is_last: bool) -> Result<Segment, LogError> {
        let path = segment_path(dir, base);
        let file = OpenOptions::new()
            .create(true)
            .read(true)
            .append(true)
            .open(&path)
            .map_err(io_error(&path))?;
        let file_len = file.metadata().map_err(io_error(&path))?.len();
        let mut positions = Vec::new();
        let mut position = 0u64;
        let mut newest_timestamp_ms = 0;
        loop {
            let expected = base + positions.len() as i64;
            let outcome = read_record(&file, position, file_len).and_then(|read| match read {
                Some((record, _)) if record.offset != expected => Err(format!(
                    "record offset {} where {expected} was expected",
                    record.offset
                )),
                other => Ok(other),
            });
            match outcome {
                Ok(Some((record, next))) => {
                    positions.push(position);
                    newest_timestamp_ms = newest_timestamp_ms.max(record.timestamp_ms);
                    position = next;
                }
                Ok(None) => break,
                Err(why) if is_last => {
                    tracing::warn!(
                        segment = %path.display(),
                        at = position,
                        dropped_bytes = file_len - position,
                        %why,
                        "truncating the torn tail of the local log (never acknowledged)"
                    );
                    file.set_len(position).map_err(io_error(&path))?;
                    break;
                }
                Err(why) => {
                    return Err(LogError::Corrupt {
                        path,
                        position,
                        why,
                    });
                }
            }
        }
        Ok(Segment {
            base,
            path,
            file,
            positions,
            size: position,
            newest_timestamp_ms,
        })
    }

    /// The oldest retained offset.
    pub fn start_offset(&self) -> i64 {
        self.segments.first().map_or(0, |s| s.base)
    }

    /// The offset the next append gets.
    pub fn end_offset(&self) -> i64 {
        self.segments.last().map_or(0, Segment::next_offset)
    }

    /// Appends a record and returns its offset once the write returned (see
    /// [`PartitionLog::append_batch`]).
    pub fn append(&mut self, key: &[u8], body: &[u8], timestamp_ms: i64) -> Result<i64, LogError> {
        self.append_batch([(key, body)], timestamp_ms)
            .pop()
            .unwrap_or_else(|| Err(self.corrupt("an append of one record returned no result")))
    }

    /// Appends records in order with one write — and, with [`LogSettings::sync`], one fsync —
    /// per segment they land in, and answers each record on its own, in order:
    ///
    /// * a record too large is refused alone; the others are written;
    /// * a failed write fails the records of that write and every later one (nothing after a
    ///   failure is written, so a client retrying them cannot reorder the partition), and the
    ///   torn tail is cut off so the partition stays appendable;
    /// * an offset is returned once the write returned: in the page cache, so it survives the
    ///   process being killed; it survives power loss only with `sync`.
    pub fn append_batch<'a>(
        &mut self,
        records: impl IntoIterator<Item = (&'a [u8], &'a [u8])>,
        timestamp_ms: i64,
    ) -> Vec<Result<i64, LogError>> {
        let records = records.into_iter();
        let mut results = Vec::with_capacity(records.size_hint().0);
        let mut pending = PendingWrite::default();
        // Why a write failed: every record after it fails with the same reason.
        let mut failed: Option<(io::ErrorKind, String)> = self
            .broken
            .as_ref()
            .map(|why| (io::ErrorKind::Other, why.clone()));
        for (key, body) in records {
            if let Some((kind, why)) = &failed {
                results.push(Err(LogError::Io {
                    path: self.dir.clone(),
                    source: io::Error::new(*kind, why.clone()),
                }));
                continue;
            }
            if let Err(refused) = check_record(key, body) {
                results.push(Err(refused));
                continue;
            }
            if let Err(error) = self.make_room(&mut pending, &mut results, timestamp_ms) {
                failed = Some(error_reason(&error));
                results.push(Err(error));
                continue;
            }
            let Some(segment) = self.segments.last() else {
                results.push(Err(self.corrupt("partition has no segment")));
                continue;
            };
            let offset = segment.next_offset() + pending.records.len() as i64;
            let before = pending.buffer.len();
            encode_into(&mut pending.buffer, offset, timestamp_ms, key, body);
            pending
                .records
                .push((results.len(), (pending.buffer.len() - before) as u64));
            results.push(Ok(offset));
        }
        if failed.is_none() {
            // Its failure is already recorded in the results of the records it held.
            let _ = self.write_pending(&mut pending, &mut results, timestamp_ms);
        }
        results
    }

    /// Before the next record: writes what is pending and rolls the active segment when it
    /// is full (counting what is pending).
    fn make_room(
        &mut self,
        pending: &mut PendingWrite,
        results: &mut [Result<i64, LogError>],
        timestamp_ms: i64,
    ) -> Result<(), LogError> {
        let full = self.segments.last().is_some_and(|s| {
            s.size + pending.buffer.len() as u64 >= self.settings.segment_bytes
                && !(s.positions.is_empty() && pending.records.is_empty())
        });
        if full {
            self.write_pending(pending, results, timestamp_ms)?;
            self.roll()?;
            self.enforce_retention(timestamp_ms)?;
        }
        Ok(())
    }

    /// Writes the pending records to the active segment in one write (and one fsync with
    /// `sync`), then indexes them. On failure the segment is cut back to its size before the
    /// write and the pending records' results become the error.
    fn write_pending(
        &mut self,
        pending: &mut PendingWrite,
        results: &mut [Result<i64, LogError>],
        timestamp_ms: i64,
    ) -> Result<(), LogError> {
        if pending.records.is_empty() {
            return Ok(());
        }
        let sync = self.settings.sync;
        let Some(segment) = self.segments.last_mut() else {
            return Err(self.corrupt("partition has no segment"));
        };
        let written = segment.file.write_all(&pending.buffer).and_then(|()| {
            if sync {
                segment.file.sync_data()
            } else {
                Ok(())
            }
        });
        if let Err(source) = written {
            // Cut the torn tail (appends go to the file's end): what is indexed stays what is
            // in the file. If even that fails, the partition refuses appends until the next
            // start recovers the segment (see `broken`).
            if let Err(truncate) = segment.file.set_len(segment.size) {
                tracing::error!(path = %segment.path.display(), error = %truncate, "cannot cut a failed append off the local log; refusing appends to this partition until a restart");
                self.broken = Some(format!(
                    "{}: a failed append could not be cut off ({truncate}); appends are refused until a restart recovers the segment",
                    segment.path.display()
                ));
            }
            for (index, _) in pending.records.drain(..) {
                results[index] = Err(LogError::Io {
                    path: segment.path.clone(),
                    source: io::Error::new(source.kind(), source.to_string()),
                });
            }
            pending.buffer.clear();
            return Err(LogError::Io {
                path: segment.path.clone(),
                source,
            });
        }
        for (_, len) in pending.records.drain(..) {
            segment.positions.push(segment.size);
            segment.size += len;
        }
        segment.newest_timestamp_ms = segment.newest_timestamp_ms.max(timestamp_ms);
        pending.buffer.clear();
        Ok(())
    }

    fn corrupt(&self, why: &str) -> LogError {
        LogError::Corrupt {
            path: self.dir.clone(),
            position: 0,
            why: why.into(),
        }
    }

    fn roll(&mut self) -> Result<(), LogError> {
        let base = self.end_offset();
        let segment = Self::recover_segment(&self.dir, base, true)?;
        // Make the new file's name durable before anything is acknowledged from it.
        File::open(&self.dir)
            .and_then(|d| d.sync_all())
            .map_err(io_error(&self.dir))?;
        self.segments.push(segment);
        Ok(())
    }

    /// Removes sealed segments past the retention limits (never the active one).
    pub fn enforce_retention(&mut self, now_ms: i64) -> Result<(), LogError> {
        while self.segments.len() > 1 {
            let total: u64 = self.segments.iter().map(|s| s.size).sum();
            let oldest = &self.segments[0];
            let over_bytes = self
                .settings
                .retention_bytes
                .is_some_and(|limit| total > limit);
            let over_age = self
                .settings
                .retention_ms
                .is_some_and(|limit| now_ms - oldest.newest_timestamp_ms > limit);
            if !(over_bytes || over_age) {
                break;
            }
            let removed = self.segments.remove(0);
            fs::remove_file(&removed.path).map_err(io_error(&removed.path))?;
            tracing::info!(
                segment = %removed.path.display(),
                records = removed.positions.len(),
                new_start = self.start_offset(),
                "retention removed a local log segment"
            );
        }
        Ok(())
    }

    /// Reads up to `max_records` records (and about `max_bytes` of bodies, at least one record)
    /// from `from`. Reading at or past the end returns nothing.
    pub fn read(
        &self,
        from: i64,
        max_records: usize,
        max_bytes: usize,
    ) -> Result<Vec<Record>, LogError> {
        let start = self.start_offset();
        if from < start {
            return Err(LogError::OffsetOutOfRange {
                requested: from,
                start,
            });
        }
        // Records of a segment are contiguous: each segment's share is one read into one
        // buffer, sized from the index (whole records count against `max_bytes`, so a read
        // stops a little sooner than counting bodies alone would).
        let mut out = Vec::new();
        let mut bytes = 0usize;
        let first = self.segments.partition_point(|s| s.next_offset() <= from);
        let mut offset = from;
        for segment in &self.segments[first..] {
            if out.len() >= max_records || (bytes >= max_bytes && !out.is_empty()) {
                break;
            }
            let index = (offset - segment.base) as usize;
            let end_of = |i: usize| segment.positions.get(i).copied().unwrap_or(segment.size);
            let start = end_of(index);
            let mut count = 0;
            while index + count < segment.positions.len()
                && out.len() + count < max_records
                && (bytes + (end_of(index + count) - start) as usize) < max_bytes
            {
                count += 1;
            }
            // At least one record per call.
            if count == 0 && out.is_empty() && index < segment.positions.len() {
                count = 1;
            }
            if count == 0 {
                break;
            }
            let end = end_of(index + count);
            out.reserve(count);
            read_span(
                &segment.file,
                &segment.positions[index..index + count],
                end,
                &mut out,
            )
            .map_err(|why| LogError::Corrupt {
                path: segment.path.clone(),
                position: start,
                why,
            })?;
            bytes += (end - start) as usize;
            offset += count as i64;
        }
        Ok(out)
    }

    /// Segment files, oldest first (for tests and operators).
    pub fn segment_paths(&self) -> Vec<PathBuf> {
        self.segments.iter().map(|s| s.path.clone()).collect()
    }
}

/// Milliseconds since the Unix epoch.
pub fn now_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as i64)
}

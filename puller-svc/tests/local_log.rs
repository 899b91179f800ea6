//! The local log: append/read, reopen, torn-tail recovery, corruption in sealed segments,
//! rolling and retention, limits, and a real `kill -9` in the middle of a stream of appends.

#![allow(clippy::unwrap_used)] // tests: a failed unwrap is a failed test

use std::fs::OpenOptions;
use std::io::{BufRead, BufReader, Write};
use std::process::{Command, Stdio};

use puller_svc::local_log::{LogError, LogSettings, PartitionLog};

fn settings() -> LogSettings {
    LogSettings {
        segment_bytes: 1024 * 1024,
        retention_bytes: None,
        retention_ms: None,
        sync: false,
    }
}

/// Opens a log in `dir` and appends records 0..n (key `k`, body `body(i)`, timestamp `i`).
fn filled(dir: &std::path::Path, settings: LogSettings, n: i64) -> PartitionLog {
    let mut log = PartitionLog::open(dir, settings).unwrap();
    for i in 0..n {
        assert_eq!(log.append(b"k", &body(i), i).unwrap(), i);
    }
    log
}

fn body(i: i64) -> Vec<u8> {
    format!("record-{i}-{}", "x".repeat((i % 7) as usize)).into_bytes()
}

#[test]
fn appends_get_sequential_offsets_and_read_back() {
    let dir = tempfile::tempdir().unwrap();
    let mut log = PartitionLog::open(dir.path(), settings()).unwrap();
    assert_eq!((log.start_offset(), log.end_offset()), (0, 0));
    for i in 0..100 {
        assert_eq!(
            log.append(format!("k{i}").as_bytes(), &body(i), 1000 + i)
                .unwrap(),
            i
        );
    }
    let records = log.read(40, 10, usize::MAX).unwrap();
    assert_eq!(records.len(), 10);
    for (n, record) in records.iter().enumerate() {
        let i = 40 + n as i64;
        assert_eq!(record.offset, i);
        assert_eq!(record.timestamp_ms, 1000 + i);
        assert_eq!(&record.key[..], format!("k{i}").as_bytes());
        assert_eq!(&record.body[..], &body(i)[..]);
    }
    assert_eq!(log.read(99, 10, usize::MAX).unwrap().len(), 1);
    assert!(
        log.read(100, 10, usize::MAX).unwrap().is_empty(),
        "at the end: nothing"
    );
    assert_eq!(
        log.read(0, 100, 1).unwrap().len(),
        1,
        "max_bytes still returns one record"
    );
}

#[test]
fn reopening_keeps_records_and_continues_offsets() {
    let dir = tempfile::tempdir().unwrap();
    {
        let mut log = PartitionLog::open(dir.path(), settings()).unwrap();
        for i in 0..5 {
            log.append(b"", &body(i), i).unwrap();
        }
    }
    let mut log = PartitionLog::open(dir.path(), settings()).unwrap();
    assert_eq!(log.end_offset(), 5);
    assert_eq!(log.append(b"", &body(5), 5).unwrap(), 5);
    let all = log.read(0, 100, usize::MAX).unwrap();
    assert_eq!(
        all.iter().map(|r| r.offset).collect::<Vec<_>>(),
        [0, 1, 2, 3, 4, 5]
    );
}

fn append_raw(path: &std::path::Path, bytes: &[u8]) {
    OpenOptions::new()
        .append(true)
        .open(path)
        .unwrap()
        .write_all(bytes)
        .unwrap();
}

#[test]
fn a_torn_tail_is_truncated_and_appends_continue() {
    let dir = tempfile::tempdir().unwrap();
    let segment = {
        let log = filled(dir.path(), settings(), 3);
        log.segment_paths()[0].clone()
    };
    let good_len = std::fs::metadata(&segment).unwrap().len();
    // Half a record header, as a kill in the middle of a write could leave.
    append_raw(&segment, &[0, 0, 0, 40, 1, 2]);
    let mut log = PartitionLog::open(dir.path(), settings()).unwrap();
    assert_eq!(log.end_offset(), 3);
    assert_eq!(
        std::fs::metadata(&segment).unwrap().len(),
        good_len,
        "tail truncated"
    );
    assert_eq!(log.append(b"k", &body(3), 3).unwrap(), 3);
    assert_eq!(log.read(3, 1, usize::MAX).unwrap()[0].body, body(3));
}

#[test]
fn a_last_record_failing_its_crc_is_dropped() {
    let dir = tempfile::tempdir().unwrap();
    let segment = {
        let log = filled(dir.path(), settings(), 3);
        log.segment_paths()[0].clone()
    };
    let mut bytes = std::fs::read(&segment).unwrap();
    let last = bytes.len() - 1;
    bytes[last] ^= 0xFF;
    std::fs::write(&segment, &bytes).unwrap();
    let log = PartitionLog::open(dir.path(), settings()).unwrap();
    assert_eq!(
        log.end_offset(),
        2,
        "the damaged (unacknowledgeable) tail record is gone"
    );
    assert_eq!(log.read(0, 10, usize::MAX).unwrap().len(), 2);
}

#[test]
fn corruption_in_a_sealed_segment_fails_the_open() {
    let dir = tempfile::tempdir().unwrap();
    let small = LogSettings {
        segment_bytes: 100,
        ..settings()
    };
    let first = {
        let log = filled(dir.path(), small, 20);
        assert!(log.segment_paths().len() > 2);
        log.segment_paths()[0].clone()
    };
    let mut bytes = std::fs::read(&first).unwrap();
    bytes[20] ^= 0xFF;
    std::fs::write(&first, &bytes).unwrap();
    let err = PartitionLog::open(dir.path(), small)
        .err()
        .expect("must refuse to open");
    assert!(matches!(err, LogError::Corrupt { .. }), "{err}");
    assert!(err.to_string().contains("CRC mismatch"), "{err}");
}

#[test]
fn retention_by_bytes_drops_old_segments_and_reports_the_start() {
    let dir = tempfile::tempdir().unwrap();
    let settings = LogSettings {
        segment_bytes: 200,
        retention_bytes: Some(600),
        ..settings()
    };
    let log = filled(dir.path(), settings, 100);
    let start = log.start_offset();
    assert!(start > 0, "old segments removed");
    assert_eq!(log.end_offset(), 100);
    assert!(log.segment_paths().len() <= 5, "{:?}", log.segment_paths());
    match log.read(0, 10, usize::MAX) {
        Err(LogError::OffsetOutOfRange {
            requested: 0,
            start: s,
        }) => assert_eq!(s, start),
        other => panic!("{other:?}"),
    }
    assert_eq!(log.read(start, 1, usize::MAX).unwrap()[0].offset, start);
    drop(log);
    // Retention also runs at open, so the start may move on; nothing else changes.
    let log = PartitionLog::open(dir.path(), settings).unwrap();
    assert!(
        log.start_offset() >= start,
        "{} < {start}",
        log.start_offset()
    );
    assert_eq!(log.end_offset(), 100, "survives reopen");
    let first = log.read(log.start_offset(), 1, usize::MAX).unwrap();
    assert_eq!(first[0].body, body(log.start_offset()));
}

#[test]
fn retention_by_age_keeps_the_active_segment() {
    let dir = tempfile::tempdir().unwrap();
    let settings = LogSettings {
        segment_bytes: 100,
        retention_ms: Some(1_000),
        ..settings()
    };
    let mut log = filled(dir.path(), settings, 10);
    log.enforce_retention(1_000_000).unwrap();
    assert_eq!(
        log.segment_paths().len(),
        1,
        "only the active segment remains"
    );
    assert_eq!(log.end_offset(), 10);
}

#[test]
fn oversized_records_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let mut log = PartitionLog::open(dir.path(), settings()).unwrap();
    let huge = vec![0u8; puller_svc::local_log::partition::MAX_BODY_BYTES + 1];
    assert!(matches!(
        log.append(b"", &huge, 0),
        Err(LogError::TooLarge { what: "body", .. })
    ));
    assert_eq!(log.end_offset(), 0, "nothing written");
}

const CHILD_DIR: &str = "LOCAL_LOG_WRITER_DIR";

/// Not a test of its own: the writer process of the kill -9 test (does nothing otherwise).
#[test]
fn writer_child() {
    let Ok(dir) = std::env::var(CHILD_DIR) else {
        return;
    };
    let mut log = PartitionLog::open(
        &dir,
        LogSettings {
            segment_bytes: 64 * 1024,
            ..settings()
        },
    )
    .unwrap();
    let mut stdout = std::io::stdout().lock();
    for i in log.end_offset().. {
        let offset = log.append(b"k", &body(i), i).unwrap();
        // libtest may have printed a partial line already: mark ours.
        writeln!(stdout, "\nACK {offset}").unwrap();
        stdout.flush().unwrap();
    }
}

#[test]
fn acknowledged_appends_survive_kill_minus_nine() {
    let dir = tempfile::tempdir().unwrap();
    let mut acknowledged = -1i64;
    for round in 0..3 {
        let mut child = Command::new(std::env::current_exe().unwrap())
            .args([
                "--exact",
                "writer_child",
                "--nocapture",
                "--test-threads",
                "1",
            ])
            .env(CHILD_DIR, dir.path())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
        let mut seen = 0;
        while let Some(Ok(line)) = lines.next() {
            if let Some(Ok(offset)) = line.strip_prefix("ACK ").map(str::parse::<i64>) {
                assert_eq!(
                    offset,
                    acknowledged + 1,
                    "offsets are dense across restarts"
                );
                acknowledged = offset;
                seen += 1;
                if seen == 2_000 + round * 500 {
                    break;
                }
            }
        }
        child.kill().unwrap(); // SIGKILL
        child.wait().unwrap();
        let log = PartitionLog::open(dir.path(), settings()).unwrap();
        assert!(
            log.end_offset() > acknowledged,
            "acknowledged {acknowledged}, log ends at {}",
            log.end_offset()
        );
        for record in log.read(0, usize::MAX, usize::MAX).unwrap() {
            assert_eq!(
                record.body,
                body(record.offset),
                "record {} intact",
                record.offset
            );
        }
        // Resume after anything written but not yet reported before the kill.
        acknowledged = log.end_offset() - 1;
    }
}

mod topics {
    use eventmesh_common::keys::{PartitionId, Topic};
    use puller_svc::local_log::{LocalLog, LogSettings, TopicError};

    fn settings() -> LogSettings {
        super::settings()
    }

    #[test]
    fn topics_partition_by_key_and_survive_reopen() {
        let dir = tempfile::tempdir().unwrap();
        let orders = Topic::new("orders").unwrap();
        let (first, second) = {
            let log = LocalLog::open(dir.path(), settings()).unwrap();
            assert!(log.create_topic(&orders, 4).unwrap());
            assert!(!log.create_topic(&orders, 8).unwrap(), "exists: kept as is");
            let first = log.append(&orders, b"customer-7", b"a", None, 1).unwrap();
            let second = log.append(&orders, b"customer-7", b"b", None, 2).unwrap();
            assert_eq!(
                first.partition, second.partition,
                "same key, same partition"
            );
            assert_eq!(second.offset, first.offset + 1);
            let explicit = log
                .append(&orders, b"", b"c", Some(&PartitionId::number(3)), 3)
                .unwrap();
            assert_eq!(explicit.partition, PartitionId::number(3));
            (first, second)
        };
        let log = LocalLog::open(dir.path(), settings()).unwrap();
        assert_eq!(log.topics(), std::slice::from_ref(&orders));
        let ranges = log.ranges(&orders).unwrap();
        assert_eq!(ranges.len(), 4, "partition count from the metadata");
        let records = log
            .read(&orders, &first.partition, 0, 10, usize::MAX)
            .unwrap();
        let bodies: Vec<&[u8]> = records.iter().map(|r| &r.body[..]).collect();
        assert!(bodies.ends_with(&[b"a", b"b"]), "{bodies:?}");
        let again = log.append(&orders, b"customer-7", b"d", None, 4).unwrap();
        assert_eq!(
            again.partition, second.partition,
            "key hashing is stable across restarts"
        );
    }

    #[test]
    fn round_robin_without_a_key() {
        let dir = tempfile::tempdir().unwrap();
        let log = LocalLog::open(dir.path(), settings()).unwrap();
        let topic = Topic::new("rr").unwrap();
        log.create_topic(&topic, 3).unwrap();
        for _ in 0..9 {
            log.append(&topic, b"", b"x", None, 0).unwrap();
        }
        let ends: Vec<i64> = log.ranges(&topic).unwrap().iter().map(|r| r.end).collect();
        assert_eq!(ends, [3, 3, 3]);
    }

    #[test]
    fn unknown_topics_partitions_and_bad_names_are_clear_errors() {
        let dir = tempfile::tempdir().unwrap();
        let log = LocalLog::open(dir.path(), settings()).unwrap();
        let missing = Topic::new("missing").unwrap();
        let err = log.append(&missing, b"", b"x", None, 0).unwrap_err();
        assert!(matches!(err, TopicError::UnknownTopic(_)), "{err}");
        assert!(matches!(
            log.read(&missing, &PartitionId::number(0), 0, 1, 1),
            Err(TopicError::UnknownTopic(_))
        ));
        let topic = Topic::new("t").unwrap();
        log.create_topic(&topic, 2).unwrap();
        let err = log
            .append(&topic, b"", b"x", Some(&PartitionId::number(2)), 0)
            .unwrap_err();
        assert_eq!(err.to_string(), "topic t has no partition 2");
        assert!(matches!(
            log.create_topic(&Topic::new("z").unwrap(), 0),
            Err(TopicError::NoPartitions)
        ));
        assert!(matches!(
            log.create_lite(&topic, "a@b"),
            Err(TopicError::BadLiteName(_))
        ));
        assert!(matches!(
            log.create_lite(&topic, ""),
            Err(TopicError::BadLiteName(_))
        ));
    }

    #[test]
    fn topic_names_cannot_escape_the_root() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path().join("root");
        let log = LocalLog::open(&root, settings()).unwrap();
        for name in ["..", "a/../../b", "."] {
            let topic = Topic::new(name).unwrap();
            log.create_topic(&topic, 1).unwrap();
            log.append(&topic, b"", b"x", None, 0).unwrap();
        }
        let outside: Vec<_> = std::fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(outside, ["root"], "nothing written outside the root");
        drop(log);
        assert_eq!(LocalLog::open(&root, settings()).unwrap().topics().len(), 3);
    }

    #[test]
    fn lite_channels_are_separate_logs_that_survive_reopen() {
        let dir = tempfile::tempdir().unwrap();
        let parent = Topic::new("chat").unwrap();
        let room = {
            let log = LocalLog::open(dir.path(), settings()).unwrap();
            log.create_topic(&parent, 8).unwrap();
            let first = log.append_lite(&parent, "room-1", b"hello", 1).unwrap();
            let second = log.append_lite(&parent, "room-1", b"again", 2).unwrap();
            let other = log.append_lite(&parent, "room-2", b"elsewhere", 3).unwrap();
            assert_eq!(
                (first.offset, second.offset, other.offset),
                (0, 1, 0),
                "own offsets"
            );
            assert!(
                first.partition.as_str().starts_with("room-1@"),
                "{}",
                first.partition
            );
            assert_eq!(
                log.ranges(&parent)
                    .unwrap()
                    .iter()
                    .map(|r| r.end)
                    .sum::<i64>(),
                0,
                "parent untouched"
            );
            first.partition
        };
        let log = LocalLog::open(dir.path(), settings()).unwrap();
        let bodies: Vec<Vec<u8>> = log
            .read(&parent, &room, 0, 10, usize::MAX)
            .unwrap()
            .into_iter()
            .map(|r| r.body.to_vec())
            .collect();
        assert_eq!(bodies, [b"hello".to_vec(), b"again".to_vec()]);
        assert_eq!(
            log.create_lite(&parent, "room-1").unwrap(),
            room,
            "same queue after reopen"
        );
    }

    #[test]
    fn a_topic_without_metadata_is_ignored_and_bad_metadata_is_an_error() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(dir.path().join("half-created/0")).unwrap();
        assert!(
            LocalLog::open(dir.path(), settings())
                .unwrap()
                .topics()
                .is_empty()
        );
        std::fs::write(
            dir.path().join("half-created/topic.properties"),
            "version=9\n",
        )
        .unwrap();
        let err = LocalLog::open(dir.path(), settings())
            .err()
            .expect("bad metadata fails");
        assert!(matches!(err, TopicError::BadMetadata { .. }), "{err}");
    }
}

/// A dead-letter topic is the one copy left of what it holds: the topic-wide size and age
/// limits do not apply to it (it has its own age limit, none by default).
#[test]
fn dead_letter_topics_keep_what_other_topics_drop() {
    use eventmesh_common::keys::Topic;
    use puller_svc::local_log::LocalLog;
    let dir = tempfile::tempdir().unwrap();
    let settings = LogSettings {
        segment_bytes: 200,
        retention_bytes: Some(400),
        ..settings()
    };
    let log = LocalLog::open(dir.path(), settings).unwrap();
    let (orders, dead) = (
        Topic::new("orders").unwrap(),
        Topic::new("orders_DLQ").unwrap(),
    );
    for topic in [&orders, &dead] {
        log.create_topic(topic, 1).unwrap();
        for i in 0..100 {
            log.append(topic, b"", &body(i), None, i).unwrap();
        }
    }
    assert!(
        log.ranges(&orders).unwrap()[0].start > 0,
        "retention applies"
    );
    assert_eq!(log.ranges(&dead).unwrap()[0].start, 0, "dead letters kept");
    drop(log);
    // Reopened with an age limit for dead letters, old ones go.
    let log = LocalLog::open_with(dir.path(), settings, Some(1)).unwrap();
    log.append(&dead, b"", &body(100), None, 100_000).unwrap();
    for i in 101..200 {
        log.append(&dead, b"", &body(i), None, 100_000 + i).unwrap();
    }
    assert!(
        log.ranges(&dead).unwrap()[0].start > 0,
        "configured age limit applies"
    );
}

/// A topic whose on-disk name (bytes outside [A-Za-z0-9_-] take three) exceeds a file name is
/// refused with the rule before anything is created.
#[test]
fn topic_names_that_cannot_be_file_names_are_refused() {
    use eventmesh_common::keys::Topic;
    use puller_svc::local_log::{LocalLog, TopicError};
    let dir = tempfile::tempdir().unwrap();
    let log = LocalLog::open(dir.path(), settings()).unwrap();
    let spaces = Topic::new(" ".repeat(100)).unwrap();
    let err = log.create_topic(&spaces, 1).unwrap_err();
    assert!(
        matches!(err, TopicError::NameTooLong { encoded: 300, .. }),
        "{err}"
    );
    assert!(err.to_string().contains("255"), "{err}");
    assert!(log.topics().is_empty());
    assert!(
        log.create_topic(&Topic::new("x".repeat(245)).unwrap(), 1)
            .unwrap()
    );
}

/// Reads take each segment's share in one read: across segment boundaries every record comes
/// back whole and in order, the byte budget stops a read after the record that reaches it
/// (always at least one), and a record damaged after the log was opened is reported, not
/// returned.
#[test]
fn reads_span_segments_keep_the_byte_budget_and_report_damage() {
    let dir = tempfile::tempdir().unwrap();
    let small = LogSettings {
        segment_bytes: 200,
        ..settings()
    };
    let log = filled(dir.path(), small, 50);
    assert!(log.segment_paths().len() > 5);
    let all = log.read(3, 1_000, usize::MAX).unwrap();
    assert_eq!(all.len(), 47);
    for (n, record) in all.iter().enumerate() {
        let i = 3 + n as i64;
        assert_eq!((record.offset, record.timestamp_ms), (i, i));
        assert_eq!(&record.key[..], b"k");
        assert_eq!(&record.body[..], &body(i)[..]);
    }
    assert_eq!(
        log.read(10, 1_000, 1).unwrap().len(),
        1,
        "at least one record"
    );
    assert_eq!(log.read(10, 4, usize::MAX).unwrap().len(), 4, "max_records");
    // A budget of ~3 bodies: stops after the record that reaches it, never before the first.
    let budget = 3 * body(20).len();
    let some = log.read(20, 1_000, budget).unwrap();
    assert!((1..=4).contains(&some.len()), "{}", some.len());

    let second = log.segment_paths()[1].clone();
    let mut bytes = std::fs::read(&second).unwrap();
    let last = bytes.len() - 1;
    bytes[last] ^= 0xFF;
    std::fs::write(&second, &bytes).unwrap();
    let err = log.read(0, 1_000, usize::MAX).unwrap_err();
    assert!(matches!(err, LogError::Corrupt { .. }), "{err}");
    assert!(err.to_string().contains("CRC mismatch"), "{err}");
}

//! A batch append whose write fails midway (the file-size limit reached: the kernel writes
//! part of the batch, then refuses with EFBIG) answers every record truthfully: the records of
//! the failed write and the ones after it are errors, the torn tail is cut off, the partition
//! stays appendable, and a reopen finds exactly what was answered as stored.
//!
//! Its own test binary: the file-size limit applies to the whole process.

#![allow(clippy::unwrap_used)] // tests: a failed unwrap is a failed test
#![allow(unsafe_code)] // setrlimit and signal have no safe wrapper in std

use puller_svc::local_log::{LogError, LogSettings, PartitionLog};

fn set_file_size_limit(bytes: u64) {
    let limit = libc::rlimit {
        rlim_cur: bytes,
        rlim_max: libc::RLIM_INFINITY,
    };
    // SAFETY: plain system calls with valid arguments; SIGXFSZ is ignored so that an
    // over-limit write returns EFBIG instead of killing the process.
    unsafe {
        libc::signal(libc::SIGXFSZ, libc::SIG_IGN);
        assert_eq!(libc::setrlimit(libc::RLIMIT_FSIZE, &limit), 0);
    }
}

fn segment_len(dir: &std::path::Path) -> u64 {
    std::fs::read_dir(dir)
        .unwrap()
        .map(|entry| entry.unwrap().metadata().unwrap().len())
        .sum()
}

#[test]
fn a_batch_whose_write_fails_midway_answers_each_record_truthfully() {
    let dir = tempfile::tempdir().unwrap();
    let settings = LogSettings {
        segment_bytes: 1024 * 1024,
        retention_bytes: None,
        retention_ms: None,
        sync: true,
    };
    let mut log = PartitionLog::open(dir.path(), settings).unwrap();
    let body = vec![b'x'; 1000];
    let huge = vec![b'h'; puller_svc::local_log::partition::MAX_BODY_BYTES + 1];

    // A record too large is refused alone; the others of the batch are written.
    let results = log.append_batch([(&b"a"[..], &body[..]), (b"b", &huge), (b"c", &body)], 1);
    assert_eq!(results.len(), 3);
    assert_eq!(results[0].as_ref().unwrap(), &0);
    assert!(matches!(
        results[1],
        Err(LogError::TooLarge { what: "body", .. })
    ));
    assert_eq!(results[2].as_ref().unwrap(), &1);

    // Room for one and a half more records: the kernel writes part of the next batch.
    let before = segment_len(dir.path());
    set_file_size_limit(before + 1500);
    let results = log.append_batch(
        [
            (&b"d"[..], &body[..]),
            (b"e", &body),
            (b"f", &body),
            (b"g", &body),
        ],
        2,
    );
    assert_eq!(results.len(), 4);
    for result in &results {
        assert!(
            matches!(result, Err(LogError::Io { .. })),
            "every record of a failed write is an error: {result:?}"
        );
    }
    assert_eq!(segment_len(dir.path()), before, "the torn tail is cut off");
    assert_eq!(log.end_offset(), 2);

    // The partition stays appendable once there is room again.
    set_file_size_limit(libc::RLIM_INFINITY);
    let results = log.append_batch([(&b"d"[..], &body[..]), (b"e", &body)], 3);
    assert_eq!(
        results.into_iter().map(Result::unwrap).collect::<Vec<_>>(),
        vec![2, 3]
    );
    drop(log);

    // A reopen finds exactly the four records answered as stored, in order.
    let log = PartitionLog::open(dir.path(), settings).unwrap();
    let keys: Vec<_> = log
        .read(0, 100, usize::MAX)
        .unwrap()
        .into_iter()
        .map(|record| (record.offset, record.key))
        .collect();
    assert_eq!(
        keys,
        vec![
            (0, "a".into()),
            (1, "c".into()),
            (2, "d".into()),
            (3, "e".into())
        ]
    );
}

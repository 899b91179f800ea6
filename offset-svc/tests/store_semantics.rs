//! The reference's OffsetMonotonicAndRecoveryTest and StateStoreDurabilityTest (scenario 1),
//! plus batch, operator and bad-input behaviour, for both stores.

#![allow(clippy::unwrap_used)] // tests and benches: a failed unwrap is a failed run

use eventmesh_common::keys::{OffsetClient, OffsetKey, PartitionId, Topic};
use offset_svc::rocks::{OpenMode, RocksDbOffsetStore, encode_value};
use offset_svc::{Error, MemoryOffsetStore, OffsetStore, Selector, UNKNOWN_OFFSET, WriteOutcome};

fn key(topic: &str, client: &str, partition: &str) -> OffsetKey {
    OffsetKey::parse_parts(topic, client, partition).expect("valid key")
}

/// Runs `scenario` against a fresh store of each kind.
fn for_each_store(scenario: impl Fn(&dyn OffsetStore)) {
    scenario(&MemoryOffsetStore::new());
    let dir = tempfile::tempdir().unwrap();
    scenario(&RocksDbOffsetStore::open(dir.path().join("offset")).unwrap());
}

#[test]
fn write_offset_is_monotonic() {
    for_each_store(|store| {
        let k = key("orders", "group-A", "0");
        let mut reads = Vec::new();
        for value in [100, 10, 200, 200] {
            store.write_offset(&k, value).unwrap();
            reads.push(store.read_offset(&k).unwrap());
        }
        assert_eq!(reads, [100, 100, 200, 200]);
    });
}

#[test]
fn clients_are_independent() {
    for_each_store(|store| {
        let a = key("topic", "client-A", "0");
        let b = key("topic", "client-B", "0");
        let c = key("topic", "client-C", "0");
        store.write_offset(&a, 50).unwrap();
        store.write_offset(&b, 80).unwrap();
        store.write_offset(&c, 10).unwrap();
        assert_eq!(store.read_offset(&a).unwrap(), 50);
        assert_eq!(store.read_offset(&b).unwrap(), 80);
        assert_eq!(store.read_offset(&c).unwrap(), 10);
        store.write_offset(&a, 60).unwrap();
        assert_eq!(store.read_offset(&a).unwrap(), 60);
        assert_eq!(store.read_offset(&b).unwrap(), 80);
        assert_eq!(store.read_offset(&c).unwrap(), 10);
    });
}

#[test]
fn unknown_offset_is_minus_one() {
    for_each_store(|store| {
        let k = key("unknown", "nobody", "0");
        assert_eq!(store.read_offset(&k).unwrap(), UNKNOWN_OFFSET);
        store.write_offset(&k, 1).unwrap();
        assert!(store.read_offset(&k).unwrap() >= 0);
    });
}

#[test]
fn rocksdb_is_monotonic_across_restart() {
    let dir = tempfile::tempdir().unwrap();
    let k = key("topic", "client-A", "0");
    {
        let store = RocksDbOffsetStore::open(dir.path()).unwrap();
        store.write_offset(&k, 100).unwrap();
        store.flush().unwrap();
    }
    let store = RocksDbOffsetStore::open(dir.path()).unwrap();
    assert_eq!(store.read_offset(&k).unwrap(), 100);
    store.write_offset(&k, 50).unwrap();
    assert_eq!(store.read_offset(&k).unwrap(), 100);
}

#[test]
fn offset_survives_process_restart() {
    // StateStoreDurabilityTest scenario 1.
    let dir = tempfile::tempdir().unwrap();
    let k = key("topic-T", "client-C", "0");
    {
        let store = RocksDbOffsetStore::open(dir.path()).unwrap();
        assert!(store.write_offset(&k, 100).unwrap().advanced);
        assert!(store.write_offset(&k, 200).unwrap().advanced);
        assert_eq!(store.read_offset(&k).unwrap(), 200);
        store.flush().unwrap();
    }
    let store = RocksDbOffsetStore::open(dir.path()).unwrap();
    assert_eq!(store.read_offset(&k).unwrap(), 200);
    assert!(
        store
            .list_topics()
            .unwrap()
            .contains(&Topic::new("topic-T").unwrap())
    );
    assert_eq!(
        store.write_offset(&k, 50).unwrap(),
        WriteOutcome {
            stored: 200,
            advanced: false
        },
        "a lower write succeeds as a no-op"
    );
    assert_eq!(store.read_offset(&k).unwrap(), 200);
    store.write_offset(&k, 300).unwrap();
    assert_eq!(store.read_offset(&k).unwrap(), 300);
}

#[test]
fn rocksdb_keeps_unflushed_writes_across_reopen() {
    // No flush: the write-ahead log alone carries the value.
    let dir = tempfile::tempdir().unwrap();
    let k = key("t", "c", "3");
    {
        let store = RocksDbOffsetStore::open(dir.path()).unwrap();
        store.write_batch(&[(k.clone(), 7)], false).unwrap();
    }
    assert_eq!(
        RocksDbOffsetStore::open(dir.path())
            .unwrap()
            .read_offset(&k)
            .unwrap(),
        7
    );
}

#[test]
fn batches_apply_in_order_and_answer_every_entry() {
    for_each_store(|store| {
        let a = key("t", "c", "0");
        let b = key("t", "c", "1");
        store.write_offset(&a, 10).unwrap();
        let outcomes = store
            .write_batch(
                &[
                    (a.clone(), 5),
                    (b.clone(), 3),
                    (a.clone(), 12),
                    (b.clone(), 2),
                    (a.clone(), 11),
                ],
                false,
            )
            .unwrap();
        let got: Vec<(i64, bool)> = outcomes.iter().map(|o| (o.stored, o.advanced)).collect();
        assert_eq!(
            got,
            [(12, false), (3, true), (12, true), (3, false), (12, false)]
        );
        assert_eq!(store.read_offset(&a).unwrap(), 12);
        assert_eq!(store.read_offset(&b).unwrap(), 3);
        assert!(store.write_batch(&[], true).unwrap().is_empty());
    });
}

#[test]
fn offsets_below_minus_one_are_rejected_and_nothing_is_applied() {
    for_each_store(|store| {
        let a = key("t", "c", "0");
        let err = store
            .write_batch(&[(a.clone(), 4), (a.clone(), -2)], false)
            .unwrap_err();
        assert!(
            matches!(err, Error::NegativeOffset { offset: -2, .. }),
            "{err}"
        );
        assert_eq!(store.read_offset(&a).unwrap(), UNKNOWN_OFFSET);
    });
}

/// `-1` is a group's start marker: it creates the key (listed, reads -1), and any real offset
/// raises it; it never lowers a stored value.
#[test]
fn minus_one_is_a_start_marker_that_creates_the_key() {
    for_each_store(|store| {
        let marker = key("t", "__mqcursor@g__", "0");
        let outcome = store.write_offset(&marker, -1).unwrap();
        assert_eq!(
            outcome,
            WriteOutcome {
                stored: -1,
                advanced: true
            }
        );
        let listed = store.read_topic(&Topic::new("t").unwrap(), None).unwrap();
        assert_eq!(listed, [(marker.clone(), -1)]);
        assert!(!store.write_offset(&marker, -1).unwrap().advanced);
        store.write_offset(&marker, 5).unwrap();
        assert_eq!(store.write_offset(&marker, -1).unwrap().stored, 5);
    });
}

#[test]
fn topic_reads_are_prefix_exact_and_sorted() {
    for_each_store(|store| {
        let cursor = OffsetClient::MqCursor(None);
        let entries = [
            (key("orders", "b", "1"), 5),
            (key("orders", "a", "0"), 1),
            (key("orders", "__mqcursor__", "0"), 9),
            (key("orders2", "a", "0"), 7),
            (key("ord", "a", "0"), 8),
        ];
        store.write_batch(&entries, false).unwrap();
        let orders = Topic::new("orders").unwrap();
        let all: Vec<String> = store
            .read_topic(&orders, None)
            .unwrap()
            .iter()
            .map(|(k, v)| format!("{k}={v}"))
            .collect();
        assert_eq!(
            all,
            ["orders#__mqcursor__#0=9", "orders#a#0=1", "orders#b#1=5"]
        );
        let cursors = store.read_topic(&orders, Some(&cursor)).unwrap();
        assert_eq!(cursors, [(key("orders", "__mqcursor__", "0"), 9)]);
        let names: Vec<String> = store
            .list_topics()
            .unwrap()
            .iter()
            .map(|t| t.to_string())
            .collect();
        assert_eq!(names, ["ord", "orders", "orders2"]);
    });
}

#[test]
fn operator_reset_and_delete() {
    for_each_store(|store| {
        let topic = Topic::new("orders").unwrap();
        store
            .write_batch(
                &[
                    (key("orders", "a", "0"), 100),
                    (key("orders", "a", "1"), 50),
                    (key("orders", "b", "0"), 70),
                ],
                false,
            )
            .unwrap();
        let all_of_a = Selector {
            topic: topic.clone(),
            client: Some(OffsetClient::parse("a").unwrap()),
            partition: None,
        };
        assert!(matches!(
            store.reset(&all_of_a, 3, " "),
            Err(Error::MissingReason)
        ));
        let previous = store.reset(&all_of_a, 3, "replay after bug #12").unwrap();
        assert_eq!(
            previous,
            [
                (key("orders", "a", "0"), 100),
                (key("orders", "a", "1"), 50)
            ]
        );
        assert_eq!(
            store.read_offset(&key("orders", "a", "0")).unwrap(),
            3,
            "reset may lower"
        );
        assert_eq!(
            store.read_offset(&key("orders", "b", "0")).unwrap(),
            70,
            "other clients untouched"
        );

        let exact_new = Selector {
            topic: topic.clone(),
            client: Some(OffsetClient::parse("c").unwrap()),
            partition: Some(PartitionId::new("4").unwrap()),
        };
        assert_eq!(
            store.reset(&exact_new, 9, "seed").unwrap(),
            [(key("orders", "c", "4"), -1)]
        );
        assert_eq!(store.read_offset(&key("orders", "c", "4")).unwrap(), 9);

        let partition_zero = Selector {
            topic: topic.clone(),
            client: None,
            partition: Some(PartitionId::new("0").unwrap()),
        };
        let removed = store.delete(&partition_zero, "drop partition 0").unwrap();
        assert_eq!(
            removed,
            [(key("orders", "a", "0"), 3), (key("orders", "b", "0"), 70)]
        );
        assert_eq!(
            store.read_offset(&key("orders", "b", "0")).unwrap(),
            UNKNOWN_OFFSET
        );
        assert_eq!(store.read_offset(&key("orders", "a", "1")).unwrap(), 3);
        store.write_offset(&key("orders", "b", "0"), 1).unwrap();
        assert_eq!(
            store.read_offset(&key("orders", "b", "0")).unwrap(),
            1,
            "a deleted key starts over"
        );
    });
}

#[test]
fn operator_changes_persist_across_reopen() {
    let dir = tempfile::tempdir().unwrap();
    let selector = Selector {
        topic: Topic::new("t").unwrap(),
        client: None,
        partition: None,
    };
    {
        let store = RocksDbOffsetStore::open(dir.path()).unwrap();
        store
            .write_batch(
                &[(key("t", "a", "0"), 100), (key("t", "b", "0"), 100)],
                false,
            )
            .unwrap();
        store.reset(&selector, 10, "test").unwrap();
        store
            .delete(
                &Selector {
                    client: Some(OffsetClient::parse("b").unwrap()),
                    ..selector.clone()
                },
                "test",
            )
            .unwrap();
    }
    let store = RocksDbOffsetStore::open(dir.path()).unwrap();
    assert_eq!(
        store.read_offset(&key("t", "a", "0")).unwrap(),
        10,
        "a put replaces older merges"
    );
    assert_eq!(
        store.read_offset(&key("t", "b", "0")).unwrap(),
        UNKNOWN_OFFSET
    );
}

#[test]
fn failed_writes_are_reported_and_change_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let k = key("t", "c", "0");
    RocksDbOffsetStore::open(dir.path())
        .unwrap()
        .write_offset(&k, 5)
        .unwrap();
    // A read-only database makes RocksDB itself refuse every write.
    let store = RocksDbOffsetStore::open_with(dir.path(), OpenMode::ReadOnly).unwrap();
    let err = store.write_batch(&[(k.clone(), 9)], false).unwrap_err();
    assert!(matches!(err, Error::Write(_)), "{err}");
    assert_eq!(
        store.read_offset(&k).unwrap(),
        5,
        "a failed write is not served"
    );
    assert!(matches!(store.write_offset(&k, 10), Err(Error::Write(_))));
    store
        .flush()
        .expect("flushing a read-only store is a no-op");
}

#[test]
fn reads_legacy_decimal_values_and_rejects_corrupt_ones() {
    let dir = tempfile::tempdir().unwrap();
    {
        let db = rocksdb::DB::open_default(dir.path()).unwrap();
        db.put(b"orders#client-1#0", b"42").unwrap();
        db.put(b"orders#client-1#1", encode_value(7)).unwrap();
    }
    {
        let store = RocksDbOffsetStore::open(dir.path()).unwrap();
        assert_eq!(
            store.read_offset(&key("orders", "client-1", "0")).unwrap(),
            42
        );
        store
            .write_offset(&key("orders", "client-1", "0"), 43)
            .unwrap();
        store
            .write_offset(&key("orders", "client-1", "0"), 41)
            .unwrap();
    }
    let store = RocksDbOffsetStore::open(dir.path()).unwrap();
    assert_eq!(
        store.read_offset(&key("orders", "client-1", "0")).unwrap(),
        43,
        "merged over a legacy value"
    );
    assert_eq!(
        store.read_offset(&key("orders", "client-1", "1")).unwrap(),
        7
    );
    drop(store);

    let corrupt = tempfile::tempdir().unwrap();
    {
        let db = rocksdb::DB::open_default(corrupt.path()).unwrap();
        db.put(b"orders#client-1#0", [9u8, 0, 0]).unwrap();
    }
    let err = RocksDbOffsetStore::open(corrupt.path())
        .err()
        .expect("corrupt value must fail the open");
    assert!(err.to_string().contains("unknown value version 9"), "{err}");
}

#[test]
fn invalid_stored_keys_are_not_served() {
    let dir = tempfile::tempdir().unwrap();
    {
        let db = rocksdb::DB::open_default(dir.path()).unwrap();
        // The Java reference never validated names: a topic with '#' makes a 4-part key.
        db.put(b"a#b#client#0", encode_value(3)).unwrap();
        db.put(b"good#client#0", encode_value(4)).unwrap();
    }
    let store = RocksDbOffsetStore::open(dir.path()).unwrap();
    assert_eq!(store.len(), 1);
    assert_eq!(store.list_topics().unwrap(), [Topic::new("good").unwrap()]);
}

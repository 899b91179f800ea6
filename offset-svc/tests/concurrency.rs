//! Property: many writers racing on the same keys never make a stored value go down, every
//! writer's answer is at least what it wrote, and the final (and, for RocksDB, the reopened)
//! value is the maximum ever written.

#![allow(clippy::unwrap_used)] // tests and benches: a failed unwrap is a failed run

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use eventmesh_common::keys::OffsetKey;
use offset_svc::{MemoryOffsetStore, OffsetStore, RocksDbOffsetStore};
use proptest::prelude::*;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

const KEYS: usize = 4;

fn keys() -> Vec<OffsetKey> {
    (0..KEYS)
        .map(|p| OffsetKey::parse_parts("hot", "client", &p.to_string()).unwrap())
        .collect()
}

/// Returns the highest value each writer wrote per key.
fn race(store: Arc<dyn OffsetStore>, seed: u64, writers: usize, batches: usize) -> Vec<i64> {
    let keys = Arc::new(keys());
    let done = Arc::new(AtomicBool::new(false));
    let observer = {
        let (store, keys, done) = (Arc::clone(&store), Arc::clone(&keys), Arc::clone(&done));
        std::thread::spawn(move || {
            let mut last = [-1i64; KEYS];
            let mut observations = 0u64;
            while !done.load(Ordering::Acquire) || observations == 0 {
                for (i, key) in keys.iter().enumerate() {
                    let now = store.read_offset(key).unwrap();
                    assert!(now >= last[i], "{key} went down from {} to {now}", last[i]);
                    last[i] = now;
                }
                observations += 1;
            }
        })
    };
    let handles: Vec<_> = (0..writers)
        .map(|w| {
            let (store, keys) = (Arc::clone(&store), Arc::clone(&keys));
            std::thread::spawn(move || {
                let mut rng = StdRng::seed_from_u64(seed ^ ((w as u64) << 32));
                let mut max = vec![-1i64; KEYS];
                for _ in 0..batches {
                    let batch: Vec<(OffsetKey, i64)> = (0..rng.random_range(1..8))
                        .map(|_| {
                            let k = rng.random_range(0..KEYS);
                            (keys[k].clone(), rng.random_range(0..1_000_000))
                        })
                        .collect();
                    let outcomes = store.write_batch(&batch, false).unwrap();
                    for ((key, offset), outcome) in batch.iter().zip(outcomes) {
                        assert!(
                            outcome.stored >= *offset,
                            "{key}: wrote {offset}, stored {}",
                            outcome.stored
                        );
                        let k = keys.iter().position(|x| x == key).unwrap();
                        max[k] = max[k].max(*offset);
                    }
                }
                max
            })
        })
        .collect();
    let mut overall = vec![-1i64; KEYS];
    for handle in handles {
        for (o, m) in overall.iter_mut().zip(handle.join().unwrap()) {
            *o = (*o).max(m);
        }
    }
    done.store(true, Ordering::Release);
    observer.join().unwrap();
    overall
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(6))]

    #[test]
    fn memory_store_never_regresses(seed in any::<u64>(), writers in 2usize..8) {
        let store: Arc<dyn OffsetStore> = Arc::new(MemoryOffsetStore::new());
        let expected = race(Arc::clone(&store), seed, writers, 300);
        for (key, max) in keys().iter().zip(expected) {
            prop_assert_eq!(store.read_offset(key).unwrap(), max);
        }
    }

    #[test]
    fn rocksdb_store_never_regresses_even_after_reopen(seed in any::<u64>(), writers in 2usize..8) {
        let dir = tempfile::tempdir().unwrap();
        let store: Arc<dyn OffsetStore> = Arc::new(RocksDbOffsetStore::open(dir.path()).unwrap());
        let expected = race(Arc::clone(&store), seed, writers, 300);
        for (key, max) in keys().iter().zip(&expected) {
            prop_assert_eq!(store.read_offset(key).unwrap(), *max);
        }
        drop(store);
        let reopened = RocksDbOffsetStore::open(dir.path()).unwrap();
        for (key, max) in keys().iter().zip(&expected) {
            prop_assert_eq!(reopened.read_offset(key).unwrap(), *max, "on disk after reopen");
        }
    }
}

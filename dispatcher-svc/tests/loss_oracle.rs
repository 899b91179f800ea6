//! A loss oracle (issue 10, item 9): the dispatcher's continuity check and gap-free watermark
//! tracker, driven against the puller's real reader on the real local log (small segments, byte
//! retention) through random appends, pulls whose answers are lost, out-of-order ACKs and
//! dead letters, dispatcher restarts (the tracker and positions rebuilt from what was stored)
//! and puller restarts (the log reopened, cursors from its checkpoint). After every step the
//! stored watermark may pass an offset only if it was ACKed, dead-lettered, or reported absent
//! by the log (removed by retention before it was read).

#![allow(clippy::unwrap_used)]

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use bytes::Bytes;
use dispatcher_svc::pulling::Positions;
use dispatcher_svc::watermark::{Admission, GroupWatermark};
use eventmesh_common::keys::{GroupName, PartitionId, Topic};
use eventmesh_proto::puller as pb;
use proptest::prelude::*;
use puller_svc::cursors::StartAt;
use puller_svc::local_log::LogSettings;
use puller_svc::storage::local::LocalStorage;
use puller_svc::storage::{PollLimits, PolledBatch, ReaderKey, Selection, Storage};

const PARTITIONS: u32 = 2;

#[derive(Debug, Clone)]
enum Op {
    /// Append this many records to a partition.
    Append(u32, u8),
    /// Pull at most this many records; `true`: the answer is lost on the way.
    Pull(u8, bool),
    /// Settle the n-th (modulo) unsettled delivery; `true`: by dead-lettering it.
    Settle(u16, bool),
    /// The dispatcher crashes: what it held is gone; it restarts from what was stored.
    RestartDispatcher,
    /// The puller restarts on the same disk.
    RestartPuller,
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        3 => (0..PARTITIONS, 1u8..12).prop_map(|(p, n)| Op::Append(p, n)),
        4 => (1u8..20, prop::bool::weighted(0.25)).prop_map(|(n, lost)| Op::Pull(n, lost)),
        4 => (any::<u16>(), prop::bool::weighted(0.1)).prop_map(|(i, dead)| Op::Settle(i, dead)),
        1 => Just(Op::RestartDispatcher),
        1 => Just(Op::RestartPuller),
    ]
}

/// What the dispatcher holds for one partition.
struct Track {
    tracker: GroupWatermark,
    unsettled: BTreeSet<i64>,
}

struct World {
    dir: tempfile::TempDir,
    storage: Arc<LocalStorage>,
    reader: ReaderKey,
    topic: Topic,
    positions: Positions,
    tracks: BTreeMap<PartitionId, Track>,
    /// The stored watermark per partition (what offset-svc holds).
    stored: BTreeMap<PartitionId, i64>,
    /// Offsets settled per partition (ACKed or dead-lettered), ever.
    settled: BTreeMap<PartitionId, BTreeSet<i64>>,
    /// Offsets the log reported absent (removed by retention before they were read).
    absent: BTreeMap<PartitionId, BTreeSet<i64>>,
}

fn settings() -> LogSettings {
    LogSettings {
        segment_bytes: 256,
        retention_bytes: Some(1024),
        retention_ms: None,
        sync: false,
    }
}

impl World {
    fn new() -> World {
        let dir = tempfile::tempdir().unwrap();
        let storage =
            Arc::new(LocalStorage::open(dir.path(), settings(), StartAt::Earliest).unwrap());
        let topic = Topic::new("oracle").unwrap();
        let mut world = World {
            dir,
            storage,
            reader: ReaderKey {
                group: Some(GroupName::new("g").unwrap()),
                topic: topic.clone(),
            },
            topic,
            positions: Positions {
                next: BTreeMap::new(),
                generation: 0,
            },
            tracks: BTreeMap::new(),
            stored: BTreeMap::new(),
            settled: BTreeMap::new(),
            absent: BTreeMap::new(),
        };
        world.restart_dispatcher();
        world
    }

    /// The dispatcher (re)starts: every partition resumes at its stored watermark + 1 (a new
    /// group starts at 0 with a -1 marker), the tracker is seeded there, nothing is held.
    fn restart_dispatcher(&mut self) {
        self.tracks.clear();
        self.positions.next.clear();
        for p in 0..PARTITIONS {
            let partition = PartitionId::number(p);
            let stored = *self.stored.entry(partition.clone()).or_insert(-1);
            self.positions.next.insert(partition.clone(), stored + 1);
            self.tracks.insert(
                partition,
                Track {
                    tracker: GroupWatermark::new(stored),
                    unsettled: BTreeSet::new(),
                },
            );
        }
    }

    fn restart_puller(&mut self) {
        self.storage =
            Arc::new(LocalStorage::open(self.dir.path(), settings(), StartAt::Earliest).unwrap());
    }

    async fn step(&mut self, op: &Op, appended: &mut u64) {
        match *op {
            Op::Append(p, n) => {
                for _ in 0..n {
                    *appended += 1;
                    self.storage
                        .send(
                            &self.topic,
                            Bytes::new(),
                            Bytes::from(format!("record {appended} padding padding")),
                            Some(PartitionId::number(p)),
                        )
                        .await
                        .unwrap();
                }
            }
            Op::Pull(max, lost) => {
                let selection = Selection::Positioned(self.positions.next.clone());
                let limits = PollLimits {
                    max_records: usize::from(max),
                    max_bytes: usize::MAX,
                    ..PollLimits::default()
                };
                let batch = self
                    .storage
                    .poll(&self.reader, &selection, limits)
                    .await
                    .unwrap();
                if lost {
                    return; // the answer never arrived: nothing moves on this side
                }
                let answer = to_proto(batch);
                if self.positions.accept(&answer).is_err() {
                    return; // dropped and read again
                }
                for record in &answer.records {
                    let partition = PartitionId::new(record.partition.as_str()).unwrap();
                    let track = self.tracks.get_mut(&partition).unwrap();
                    if track.tracker.admit(record.offset) == Admission::Deliver {
                        track.unsettled.insert(record.offset);
                    }
                }
                for range in &answer.ranges {
                    let partition = PartitionId::new(range.partition.as_str()).unwrap();
                    let absent = self.absent.entry(partition.clone()).or_default();
                    absent.extend(range.first..range.first + range.lost_to_retention);
                    let track = self.tracks.get_mut(&partition).unwrap();
                    track.tracker.cover(range.next);
                    self.write(&partition);
                }
            }
            Op::Settle(index, _dead_letter) => {
                let held: Vec<(PartitionId, i64)> = self
                    .tracks
                    .iter()
                    .flat_map(|(p, t)| t.unsettled.iter().map(move |o| (p.clone(), *o)))
                    .collect();
                if held.is_empty() {
                    return;
                }
                let (partition, offset) = held[usize::from(index) % held.len()].clone();
                let track = self.tracks.get_mut(&partition).unwrap();
                track.unsettled.remove(&offset);
                track.tracker.settle(offset);
                // An ACK and a durable dead letter settle alike.
                self.settled
                    .entry(partition.clone())
                    .or_default()
                    .insert(offset);
                self.write(&partition);
            }
            Op::RestartDispatcher => self.restart_dispatcher(),
            Op::RestartPuller => self.restart_puller(),
        }
    }

    /// The dispatcher writes its watermark (CAS-max, as offset-svc stores it).
    fn write(&mut self, partition: &PartitionId) {
        let watermark = self.tracks[partition].tracker.watermark();
        let stored = self.stored.entry(partition.clone()).or_insert(-1);
        *stored = (*stored).max(watermark);
    }

    /// The oracle: every offset at or below the stored watermark was ACKed, dead-lettered or
    /// reported absent by the log.
    fn check(&self) -> Result<(), TestCaseError> {
        for (partition, &watermark) in &self.stored {
            let settled = self.settled.get(partition);
            let absent = self.absent.get(partition);
            for offset in 0..=watermark {
                let ok = settled.is_some_and(|s| s.contains(&offset))
                    || absent.is_some_and(|a| a.contains(&offset));
                prop_assert!(
                    ok,
                    "partition {partition}: stored watermark {watermark} passes offset {offset}, which was neither settled nor reported absent"
                );
            }
        }
        Ok(())
    }
}

fn to_proto(batch: PolledBatch) -> pb::PullResponse {
    pb::PullResponse {
        records: batch
            .records
            .into_iter()
            .map(|r| pb::PulledRecord {
                partition: r.partition.to_string(),
                offset: r.offset,
                ..pb::PulledRecord::default()
            })
            .collect(),
        ranges: batch
            .ranges
            .into_iter()
            .map(|r| pb::PartitionRange {
                partition: r.partition.to_string(),
                first: r.first,
                next: r.next,
                lost_to_retention: r.lost_to_retention,
            })
            .collect(),
        ..pb::PullResponse::default()
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    #[test]
    fn the_stored_watermark_never_passes_an_offset_that_was_not_settled_or_absent(
        ops in prop::collection::vec(op(), 1..80)
    ) {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        runtime.block_on(async {
            let mut world = World::new();
            world
                .storage
                .create_topic(&world.topic, PARTITIONS)
                .await
                .unwrap();
            let mut appended = 0;
            for op in &ops {
                world.step(op, &mut appended).await;
                world.check()?;
            }
            // Settle everything that is left and pull to the end: the watermark reaches the
            // end of each partition (nothing is stuck), still passing nothing unsettled.
            for _ in 0..200 {
                world.step(&Op::Pull(50, false), &mut appended).await;
                while world.tracks.values().any(|t| !t.unsettled.is_empty()) {
                    world.step(&Op::Settle(0, false), &mut appended).await;
                }
            }
            world.check()?;
            let ends = world.storage.end_offsets(&world.topic).await.unwrap();
            for range in ends {
                prop_assert_eq!(world.stored[&range.partition], range.end - 1, "{}", range.partition);
            }
            Ok(())
        })?;
    }
}

//! A subscription group's partitions spread over several actors ("shards"), so one group is
//! not held to one core (issue 12 item 4; `delivery.group_shards`).
//!
//! Contract:
//! * A group of `n` shards is `n` actors ([`crate::group`]), each owning a fixed subset of the
//!   topic's partitions ([`shard_of`]: partition number modulo `n`; a partition id that is not
//!   a number is hashed with FNV-1a, the same on every run). Everything per partition — the
//!   gap-free watermark, DURABLE only once the stored watermark covers, the offset writes,
//!   the broker ACKs — lives in the one actor that owns it, so every per-partition rule holds
//!   as it does for one actor.
//! * One pull loop per group reads the group's one reader (polls stay serialized, one attach
//!   generation) and hands each shard its part of a batch ([`split`]), budget included.
//! * Every shard has its own group number, so a delivery id routes its ACK straight to the
//!   shard that issued it.
//! * A session joins every shard; its in-flight limit is one pool of credits all shards take
//!   from ([`crate::group::Credits`]), and a shard that found it empty is woken when another
//!   shard gives a credit back.
//! * The pull loop pulls only while every shard lets it ([`GateBoard`]): a shard that pauses
//!   (no session, offset writes failing, draining) pauses the group, one that closes ends it.
//! * When one shard ends, the registry ends the others: a group lives and dies as one.

use std::sync::{Arc, Mutex};

use eventmesh_proto::puller::PullResponse;
use tokio::sync::watch;

use crate::budget::{Charge, kib_cost};
use crate::group::PullGate;

/// Most shards a group may have (a session's credit waiters are one bit per shard).
pub const MAX_SHARDS: u32 = 64;

/// The shard of `count` that owns `partition`.
pub fn shard_of(partition: &str, count: usize) -> usize {
    if count <= 1 {
        return 0;
    }
    let key = match partition.parse::<u64>() {
        Ok(number) => number,
        Err(_) => partition
            .bytes()
            .fold(0xcbf2_9ce4_8422_2325_u64, |hash, byte| {
                (hash ^ u64::from(byte)).wrapping_mul(0x0100_0000_01b3)
            }),
    };
    (key % count as u64) as usize
}

/// Splits a pulled batch into each shard's part with the budget its records hold (one per
/// record, their KiB). `None` for a shard the batch has nothing for. Records keep their
/// order within a partition; nothing is copied.
pub fn split(batch: PullResponse, count: usize) -> Vec<Option<(PullResponse, Charge)>> {
    let mut parts: Vec<Option<(PullResponse, Charge)>> = (0..count).map(|_| None).collect();
    fn part<'a>(
        parts: &'a mut [Option<(PullResponse, Charge)>],
        partition: &str,
    ) -> &'a mut (PullResponse, Charge) {
        let count = parts.len();
        parts[shard_of(partition, count)].get_or_insert_with(Default::default)
    }
    for range in batch.ranges {
        part(&mut parts, &range.partition).0.ranges.push(range);
    }
    for record in batch.records {
        let (batch, charge) = part(&mut parts, &record.partition);
        charge.records += 1;
        charge.kib += kib_cost(record.frame.len());
        batch.records.push(record);
    }
    parts
}

/// What each shard lets the group's pull loop do, combined into one gate: closed when any
/// shard closed, open when every shard is open, else paused.
#[derive(Debug)]
pub struct GateBoard {
    shards: Mutex<Vec<PullGate>>,
    combined: watch::Sender<PullGate>,
}

impl GateBoard {
    /// A board for `count` shards, all paused, and the combined gate the pull loop watches.
    pub fn new(count: usize) -> (Arc<GateBoard>, watch::Receiver<PullGate>) {
        let (combined, receiver) = watch::channel(PullGate::Paused);
        let board = GateBoard {
            shards: Mutex::new(vec![PullGate::Paused; count.max(1)]),
            combined,
        };
        (Arc::new(board), receiver)
    }

    /// Shard `shard` now says `gate`.
    pub fn set(&self, shard: usize, gate: PullGate) {
        let mut shards = self.shards.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(slot) = shards.get_mut(shard) {
            *slot = gate;
        }
        let combined = if shards.contains(&PullGate::Closed) {
            PullGate::Closed
        } else if shards.iter().all(|g| *g == PullGate::Open) {
            PullGate::Open
        } else {
            PullGate::Paused
        };
        self.combined
            .send_if_modified(|g| std::mem::replace(g, combined) != combined);
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use eventmesh_proto::puller::{PartitionRange, PulledRecord};

    #[test]
    fn numbered_partitions_spread_evenly_and_names_stay_put() {
        let counts = (0..8).fold([0; 4], |mut counts, p| {
            counts[shard_of(&p.to_string(), 4)] += 1;
            counts
        });
        assert_eq!(counts, [2, 2, 2, 2]);
        assert_eq!(shard_of("7", 1), 0);
        let named = shard_of("broker-a:3", 3);
        assert!(named < 3);
        assert_eq!(shard_of("broker-a:3", 3), named, "the same on every call");
    }

    #[test]
    fn a_batch_splits_by_partition_with_each_parts_budget() {
        let record = |partition: &str, offset, bytes| PulledRecord {
            partition: partition.into(),
            offset,
            frame: vec![0; bytes].into(),
            ..PulledRecord::default()
        };
        let range = |partition: &str, first, next| PartitionRange {
            partition: partition.into(),
            first,
            next,
            lost_to_retention: 0,
        };
        let batch = PullResponse {
            records: vec![
                record("0", 5, 10),
                record("0", 6, 2000),
                record("1", 0, 10),
                record("2", 9, 10),
            ],
            ranges: vec![range("0", 5, 7), range("1", 0, 1), range("2", 9, 10)],
            ..PullResponse::default()
        };
        let parts = split(batch, 2);
        let (even, even_charge) = parts[0].clone().unwrap();
        let (odd, odd_charge) = parts[1].clone().unwrap();
        assert_eq!(
            even.records
                .iter()
                .map(|r| (r.partition.as_str(), r.offset))
                .collect::<Vec<_>>(),
            [("0", 5), ("0", 6), ("2", 9)]
        );
        assert_eq!(even.ranges.len(), 2);
        assert_eq!(even_charge, Charge { records: 3, kib: 4 });
        assert_eq!(odd.records.len(), 1);
        assert_eq!(odd_charge, Charge { records: 1, kib: 1 });
        let only_ranges = PullResponse {
            ranges: vec![range("1", 1, 4)],
            ..PullResponse::default()
        };
        let parts = split(only_ranges, 2);
        assert!(parts[0].is_none());
        assert_eq!(parts[1].as_ref().unwrap().1, Charge::default());
    }

    #[test]
    fn the_gate_opens_only_when_every_shard_does_and_closes_when_any_does() {
        let (board, gate) = GateBoard::new(2);
        board.set(0, PullGate::Open);
        assert_eq!(*gate.borrow(), PullGate::Paused);
        board.set(1, PullGate::Open);
        assert_eq!(*gate.borrow(), PullGate::Open);
        board.set(1, PullGate::Paused);
        assert_eq!(*gate.borrow(), PullGate::Paused);
        board.set(0, PullGate::Closed);
        assert_eq!(*gate.borrow(), PullGate::Closed);
    }
}

//! Intake: pulled batches become tracked deliveries.
//!
//! Batches reach the actor only after the pull loop checked their continuity
//! ([`crate::pulling`]), so every range starts where the partition's last one ended. Per range:
//! the partition's tracker is created if new (seeded just below where the range starts), its
//! records are admitted ([`GroupWatermark::admit`]: a record at or below the watermark, or
//! already tracked, is dropped, not delivered twice), and then the range is covered — its
//! offsets without a record are absent from the log and count as settled. The first
//! `lost_to_retention` of them were removed by retention before the group delivered them:
//! that is logged at WARN with the group, partition and count, counted
//! (`dispatcher_retention_lost_offsets_total{topic,group}`), and stored under the group's
//! `__mqlost…__` record together with the watermark that passes them (`emctl offsets` shows
//! it).
//!
//! A closing group takes no batch: what it would admit could never be delivered and would
//! keep it from ending, so the batch's budget goes back and its records stay unsettled (the
//! next reader of the group pulls them again).

use std::collections::{BTreeSet, VecDeque};
use std::time::Instant;

use eventmesh_common::keys::PartitionId;
use eventmesh_proto::puller::{BodyKind, PullResponse};

use super::{Delivery, Group, PartitionTrack};
use crate::budget::{Charge, kib_cost};
use crate::delivery_id::DeliveryId;
use crate::watermark::{Admission, GroupWatermark};

impl PartitionTrack {
    fn new(seed: i64, lost_total: i64) -> Self {
        PartitionTrack {
            tracker: GroupWatermark::new(seed),
            submitted: seed,
            durable: seed,
            covering: BTreeSet::new(),
            lost_total,
            lost_pending: VecDeque::new(),
        }
    }

    /// Adds the losses a watermark of `watermark` passes to the total; returns the new total
    /// when it grew (to be written with that watermark).
    pub(super) fn passed_losses(&mut self, watermark: i64) -> Option<i64> {
        let before = self.lost_total;
        while let Some(&(end, count)) = self.lost_pending.front() {
            if end - 1 > watermark {
                break;
            }
            self.lost_pending.pop_front();
            self.lost_total += count;
        }
        (self.lost_total > before).then_some(self.lost_total)
    }
}

impl Group {
    pub(super) fn pulled(&mut self, batch: PullResponse, charge: Charge) {
        if self.closing {
            tracing::debug!(group = %self.key, records = batch.records.len(), "a closing group takes no batch; its records stay unsettled");
            self.budget.release(&self.label, charge);
            return;
        }
        for range in &batch.ranges {
            if let Ok(partition) = PartitionId::new(range.partition.as_str()) {
                self.partition(&partition, range.first);
            }
        }
        let mut unused = charge;
        let taken_at = Instant::now();
        for mut record in batch.records {
            // A partition the group tracks already is shared, not parsed again.
            let known = self
                .partitions
                .get_key_value(record.partition.as_str())
                .map(|(known, _)| known.clone());
            let Some(partition) =
                known.or_else(|| PartitionId::new(record.partition.as_str()).ok())
            else {
                tracing::error!(
                    partition = record.partition,
                    "puller sent an invalid partition id; record ignored (it stays unsettled)"
                );
                continue;
            };
            let track = self.partition(&partition, record.offset);
            match track.tracker.admit(record.offset) {
                Admission::Deliver => {}
                admission => {
                    tracing::trace!(group = %self.key, %partition, offset = record.offset, ?admission, "duplicate record dropped");
                    continue;
                }
            }
            let cost = Charge {
                records: 1,
                kib: kib_cost(record.frame.len()),
            };
            unused.records = unused.records.saturating_sub(cost.records);
            unused.kib = unused.kib.saturating_sub(cost.kib);
            let seq = self.next_seq;
            self.next_seq += 1;
            let id = DeliveryId {
                epoch: self.shared.epoch,
                group: self.number,
                seq,
            };
            // Frames were checked by the pull loop (`crate::pulling`) and are decoded when
            // sent: a waiting delivery holds only the pulled bytes.
            let problem = match BodyKind::try_from(record.body_kind) {
                Ok(BodyKind::MalformedFrame) => Some(std::mem::take(&mut record.malformed_reason)),
                _ => None,
            };
            let delivery = Delivery::new(id, partition, problem.is_none(), record, cost, taken_at);
            self.deliveries.insert(seq, delivery);
            match problem {
                Some(reason) => self.dead_letter(seq, reason),
                None => self.ready.push_back(seq),
            }
        }
        for range in batch.ranges {
            let Ok(partition) = PartitionId::new(range.partition) else {
                continue;
            };
            if range.lost_to_retention > 0 {
                self.lost_to_retention(&partition, range.first, range.lost_to_retention);
            }
            self.partition(&partition, range.first)
                .tracker
                .cover(range.next);
        }
        // Budget reserved but not filled (duplicates, short batches) goes back at once.
        if unused != Charge::default() {
            self.budget.release(&self.label, unused);
        }
        self.pump();
    }

    /// Offsets `[first, first + lost)` were removed by retention before this group delivered
    /// them: reported now, stored once the written watermark passes them.
    fn lost_to_retention(&mut self, partition: &PartitionId, first: i64, lost: i64) {
        tracing::warn!(group = %self.key, %partition, lost, from = first, to = first + lost - 1, "events removed by retention before this group delivered them; counted as lost");
        metrics::counter!(
            "dispatcher_retention_lost_offsets_total",
            "topic" => self.key.topic.to_string(),
            "group" => eventmesh_common::metrics::group_label(&self.label)
        )
        .increment(lost.unsigned_abs());
        self.partition(partition, first)
            .lost_pending
            .push_back((first + lost, lost));
    }

    /// The partition's tracker, seeded from the stored watermark (the group's position) or,
    /// for a partition the group had no position in, from just below `first_seen`.
    pub(super) fn partition(
        &mut self,
        partition: &PartitionId,
        first_seen: i64,
    ) -> &mut PartitionTrack {
        let (seeds, lost, tallies) = (&self.seeds, &self.lost_seeds, &mut self.tallies);
        self.partitions.entry(partition.clone()).or_insert_with(|| {
            tallies.touch(partition);
            let seed = seeds.get(partition).copied().unwrap_or(first_seen - 1);
            PartitionTrack::new(seed, lost.get(partition).copied().unwrap_or(0))
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn losses_are_stored_with_the_watermark_that_passes_them() {
        let mut track = PartitionTrack::new(9, 4);
        track.lost_pending.push_back((15, 5)); // 10..=14
        track.lost_pending.push_back((30, 2)); // 28..=29
        assert_eq!(track.passed_losses(13), None, "14 is not passed yet");
        assert_eq!(track.passed_losses(14), Some(9));
        assert_eq!(track.passed_losses(20), None);
        assert_eq!(track.passed_losses(29), Some(11));
        assert!(track.lost_pending.is_empty());
    }
}

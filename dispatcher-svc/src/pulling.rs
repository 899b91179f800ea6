//! A group's pull loop and the continuity rule it enforces (DESIGN §6 "Continuity").
//!
//! The loop reserves topic budget, long-polls the group's reader in puller-svc and hands each
//! batch to the group's actor — to each shard of the group its part ([`crate::shard::split`]).
//! It pauses while the group has no session or offset writes are failing, and ends with the
//! group.
//!
//! **Continuity.** Per partition the loop knows where the next batch must start
//! ([`Positions`]): the position the group was attached at, then the `next` of every batch it
//! kept. Every Pull names these positions and carries the reader's attach generation, so
//!
//! * a lost or failed response is read again: the puller sets its cursor back to the position
//!   the request names before reading;
//! * a batch that does not start where the last one ended (a bug, a puller that answered
//!   another generation's read) is dropped and read again — never taken as offsets the log
//!   skipped. Only the log declares a skip: a range's offsets without a record, of which the
//!   first `lost_to_retention` were removed by retention (reported by the actor);
//! * a Pull refused because another dispatcher attached the reader (the status names the
//!   holder) ends the group here: its sessions are told to reconnect and its unsettled events
//!   come back from the holder. A reader that is not attached (puller-svc restarted) is
//!   attached again at the loop's positions;
//! * a partition the Pull did not name (added to the topic since) starts at its log start,
//!   after its start marker is stored, and a position past the end of its log (topic
//!   recreated) makes the group rewind that partition ([`crate::registry::Shared::rewind`]).
//!
//! Nothing pulled is dropped silently: a batch the actor cannot take any more (the group ended)
//! was never settled, so the next reader gets it again.

use std::collections::BTreeMap;
use std::sync::Arc;

use eventmesh_common::keys::PartitionId;
use eventmesh_proto::offset::{OffsetEntry, WriteOffsetsRequest};
use eventmesh_proto::puller::{
    BodyKind, PartitionOffsets, PastEnd, Position, PullRequest, PullResponse, ReaderPositions,
};
use tokio::sync::{mpsc, watch};

use crate::batching::Backoff;
use crate::budget::{Charge, TopicBudget, kib_cost};
use crate::event::check_for_delivery;
use crate::group::{GroupCmd, PullGate};
use crate::registry::{GroupKey, Shared};
use crate::shard::split;

/// Status metadata naming the dispatcher that holds a reader (set by puller-svc).
pub const HOLDER_METADATA: &str = "em-reader-holder";
/// Longest a pull waits for records.
pub const PULL_WAIT_MS: u32 = 500;
/// KiB asked for per pull at most.
pub const PULL_KIB: u32 = 8 * 1024;

/// Where each partition's next batch must start, and the reader's attach generation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Positions {
    /// Next offset to read per partition.
    pub next: BTreeMap<PartitionId, i64>,
    /// The generation from the reader's last Attach.
    pub generation: u64,
}

/// Why a batch breaks continuity.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Discontinuity {
    /// A range starts elsewhere than the last batch ended.
    #[error("partition {partition}: the batch starts at {first}, the last one ended at {expected}")]
    Gap {
        /// The partition.
        partition: String,
        /// Where the batch starts.
        first: i64,
        /// Where it had to start.
        expected: i64,
    },
    /// A range or record names a partition the pull did not ask for.
    #[error("partition {0} was not asked for")]
    NotAsked(String),
    /// A range is malformed, or a record lies outside its partition's range.
    #[error("partition {partition}: {why}")]
    Malformed {
        /// The partition.
        partition: String,
        /// What is wrong.
        why: String,
    },
}

impl Positions {
    /// The positions a Pull names.
    pub fn request(&self) -> Vec<Position> {
        self.next
            .iter()
            .map(|(partition, next)| Position {
                partition: partition.to_string(),
                next: *next,
            })
            .collect()
    }

    /// Checks that `batch` continues exactly where the last kept batch ended and, if so,
    /// moves every partition it covered to the range's end. Changes nothing when it does not.
    pub fn accept(&mut self, batch: &PullResponse) -> Result<(), Discontinuity> {
        let mut moves: Vec<(PartitionId, i64)> = Vec::with_capacity(batch.ranges.len());
        for range in &batch.ranges {
            let malformed = |why: String| Discontinuity::Malformed {
                partition: range.partition.clone(),
                why,
            };
            let partition = PartitionId::new(range.partition.as_str())
                .map_err(|err| malformed(err.to_string()))?;
            let Some(&expected) = self.next.get(&partition) else {
                return Err(Discontinuity::NotAsked(range.partition.clone()));
            };
            if range.first != expected {
                return Err(Discontinuity::Gap {
                    partition: range.partition.clone(),
                    first: range.first,
                    expected,
                });
            }
            if range.next < range.first
                || range.lost_to_retention < 0
                || range.lost_to_retention > range.next - range.first
            {
                return Err(malformed(format!(
                    "range [{}, {}) with {} lost to retention",
                    range.first, range.next, range.lost_to_retention
                )));
            }
            moves.push((partition, range.next));
        }
        for record in &batch.records {
            let range = batch
                .ranges
                .iter()
                .find(|r| r.partition == record.partition)
                .ok_or_else(|| Discontinuity::NotAsked(record.partition.clone()))?;
            if record.offset < range.first + range.lost_to_retention || record.offset >= range.next
            {
                return Err(Discontinuity::Malformed {
                    partition: record.partition.clone(),
                    why: format!(
                        "record at {} outside its range [{}, {})",
                        record.offset, range.first, range.next
                    ),
                });
            }
        }
        self.next.extend(moves);
        Ok(())
    }
}

/// Waits until the gate opens; `false` when the group ended.
async fn gate_open(gate: &mut watch::Receiver<PullGate>) -> bool {
    loop {
        match *gate.borrow_and_update() {
            PullGate::Open => return true,
            PullGate::Closed => return false,
            PullGate::Paused => {}
        }
        if gate.changed().await.is_err() {
            return false;
        }
    }
}

/// The loop of one group (see the module doc); when it ends, a budget nothing holds any more
/// is dropped.
pub(crate) async fn pull_loop(
    shared: Arc<Shared>,
    key: GroupKey,
    group: Arc<[mpsc::UnboundedSender<GroupCmd>]>,
    gate: watch::Receiver<PullGate>,
    budget: Arc<TopicBudget>,
    positions: Positions,
) {
    run(
        Arc::clone(&shared),
        key.clone(),
        group,
        gate,
        budget,
        positions,
    )
    .await;
    shared.drop_budget_if_unused(&key.topic);
}

async fn run(
    shared: Arc<Shared>,
    key: GroupKey,
    group: Arc<[mpsc::UnboundedSender<GroupCmd>]>,
    mut gate: watch::Receiver<PullGate>,
    budget: Arc<TopicBudget>,
    mut positions: Positions,
) {
    let label = key.label();
    let mut puller = shared.puller();
    let mut backoff = Backoff::default();
    let batch = shared.settings.pull_batch;
    loop {
        let open = tokio::select! {
            open = gate_open(&mut gate) => open,
            () = shared.shutdown.cancelled() => false,
        };
        if !open {
            return;
        }
        let mut charge = tokio::select! {
            charge = budget.reserve(&label, batch, PULL_KIB) => charge,
            () = shared.shutdown.cancelled() => return,
        };
        let request = PullRequest {
            reader: Some(key.reader()),
            partition: String::new(),
            max_records: charge.records,
            max_bytes: charge.kib.saturating_mul(1024),
            max_wait_ms: PULL_WAIT_MS,
            generation: positions.generation,
            positions: positions.request(),
            // Deliveries carry the partition and offset in fields of their own (the stamps
            // would be skipped anyway): our frames come as stored, not copied to stamp them.
            bare_frames: true,
        };
        let mut pulled = match puller.pull(request).await {
            Ok(response) => response.into_inner(),
            Err(status) => {
                budget.release(&label, charge);
                if status.code() == tonic::Code::FailedPrecondition {
                    if let Some(holder) = status.metadata().get(HOLDER_METADATA) {
                        let holder = holder.to_str().unwrap_or("another dispatcher").to_owned();
                        tracing::warn!(group = %key, holder, "the group's reader was attached by another dispatcher; this instance gives the group up");
                        let status = tonic::Status::unavailable(format!(
                            "subscription group {key} is now served by dispatcher {holder}; reconnect"
                        ));
                        for shard in group.iter() {
                            let _ = shard.send(GroupCmd::End {
                                status: status.clone(),
                                reply: None,
                            });
                        }
                        return;
                    }
                    // Not attached: puller-svc restarted. Attach again where we are.
                    match shared.attach(&key, &positions.next).await {
                        Ok(generation) => {
                            tracing::info!(group = %key, "reader attached again after puller-svc lost it");
                            positions.generation = generation;
                            continue;
                        }
                        Err(err) => {
                            tracing::warn!(group = %key, error = %err, "attaching the reader again failed; retrying");
                        }
                    }
                } else {
                    tracing::warn!(group = %key, code = ?status.code(), message = status.message(), "pull failed; retrying from the same positions");
                }
                tokio::select! {
                    () = tokio::time::sleep(backoff.next_delay()) => {}
                    () = shared.shutdown.cancelled() => return,
                }
                continue;
            }
        };
        if let Err(broken) = positions.accept(&pulled) {
            budget.release(&label, charge);
            metrics::counter!("dispatcher_pull_discontinuities_total", "topic" => key.topic.to_string())
                .increment(1);
            tracing::warn!(group = %key, %broken, "pulled batch does not continue the last one; dropped and read again");
            tokio::time::sleep(backoff.next_delay()).await;
            continue;
        }
        backoff.reset();
        if !pulled.past_end.is_empty() {
            budget.release(&label, charge);
            tokio::spawn(Arc::clone(&shared).rewind(key.clone(), pulled.past_end));
            return;
        }
        if !pulled.unpositioned.is_empty() {
            position_new_partitions(&shared, &key, &mut positions, &pulled.unpositioned).await;
        }
        if pulled.records.is_empty() && pulled.ranges.is_empty() {
            budget.release(&label, charge);
            continue;
        }
        let kib: u32 = pulled.records.iter().map(|r| kib_cost(r.frame.len())).sum();
        if kib > charge.kib {
            budget.charge_more_kib(&label, kib - charge.kib).await;
            charge.kib = kib;
        }
        metrics::counter!("dispatcher_pulled_records_total", "topic" => key.topic.to_string())
            .increment(pulled.records.len() as u64);
        mark_undecodable(&mut pulled);
        if !hand_over(&group, pulled, charge, &budget, &label) {
            return;
        }
    }
}

/// Marks the records whose frames will not decode as events (the group dead-letters those
/// instead of delivering them). Checked here, on the loop's task, rather than by the group's
/// actor: the actor is one task for the whole group, and this is one layout walk per record
/// ([`check_for_delivery`]).
fn mark_undecodable(batch: &mut PullResponse) {
    for record in &mut batch.records {
        if record.body_kind == BodyKind::MalformedFrame as i32 {
            continue;
        }
        if let Err(err) = check_for_delivery(&record.frame) {
            record.body_kind = BodyKind::MalformedFrame as i32;
            record.malformed_reason = format!("frame does not decode: {err}");
        }
    }
}

/// Hands a batch to the group (each shard its part, with the budget its records hold; what
/// the batch did not fill goes back). `false` when a shard has ended: what it did not take
/// goes back too, and the loop ends with the group.
fn hand_over(
    group: &[mpsc::UnboundedSender<GroupCmd>],
    batch: PullResponse,
    charge: Charge,
    budget: &TopicBudget,
    label: &str,
) -> bool {
    if let [only] = group {
        if let Err(refused) = only.send(GroupCmd::Pulled { batch, charge }) {
            if let GroupCmd::Pulled { charge, .. } = refused.0 {
                budget.release(label, charge);
            }
            return false;
        }
        return true;
    }
    let mut left = charge;
    let mut taken = true;
    for (shard, part) in group.iter().zip(split(batch, group.len())) {
        let Some((batch, part_charge)) = part else {
            continue;
        };
        left.records = left.records.saturating_sub(part_charge.records);
        left.kib = left.kib.saturating_sub(part_charge.kib);
        if shard
            .send(GroupCmd::Pulled {
                batch,
                charge: part_charge,
            })
            .is_err()
        {
            budget.release(label, part_charge);
            taken = false;
        }
    }
    if left != Charge::default() {
        budget.release(label, left);
    }
    taken
}

/// Partitions that appeared after the group was attached start at their log start (the
/// group never saw anything of them); each start marker is stored first, so a restart before
/// any ACK resumes there too. A partition whose marker cannot be stored yet is left for the
/// next pull.
async fn position_new_partitions(
    shared: &Shared,
    key: &GroupKey,
    positions: &mut Positions,
    unpositioned: &[PartitionOffsets],
) {
    let mut starts = BTreeMap::new();
    for range in unpositioned {
        match PartitionId::new(range.partition.as_str()) {
            Ok(partition) => {
                starts.insert(partition, range.start);
            }
            Err(err) => {
                tracing::error!(group = %key, partition = range.partition, error = %err, "puller reported an invalid partition id; ignored");
            }
        }
    }
    if starts.is_empty() {
        return;
    }
    let entries = starts
        .iter()
        .map(|(partition, start)| OffsetEntry {
            key: Some(shared.cursor_key(key, partition)),
            offset: start - 1,
        })
        .collect();
    let request = WriteOffsetsRequest {
        entries,
        sync: shared.settings.sync_offsets,
    };
    match shared.offsets().write_offsets(request).await {
        Ok(_) => {
            tracing::info!(group = %key, partitions = ?starts.keys().map(ToString::to_string).collect::<Vec<_>>(), "new partitions start at their log start");
            positions.next.extend(starts);
        }
        Err(status) => {
            tracing::warn!(group = %key, code = ?status.code(), message = status.message(), "storing the start of new partitions failed; retried at the next pull");
        }
    }
}

/// What a rewind resets: a partition and the log start it restarts at.
pub(crate) fn rewind_targets(past_end: &[PastEnd]) -> Vec<(PartitionId, i64, &PastEnd)> {
    past_end
        .iter()
        .filter_map(|past| {
            PartitionId::new(past.partition.as_str())
                .ok()
                .map(|partition| (partition, past.log_start, past))
        })
        .collect()
}

/// The positions an Attach names, for one reader.
pub(crate) fn reader_positions(
    key: &GroupKey,
    next: &BTreeMap<PartitionId, i64>,
) -> ReaderPositions {
    ReaderPositions {
        reader: Some(key.reader()),
        positions: next
            .iter()
            .map(|(partition, next)| Position {
                partition: partition.to_string(),
                next: *next,
            })
            .collect(),
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use eventmesh_proto::puller::{PartitionRange, PulledRecord};

    fn positions(next: &[(&str, i64)]) -> Positions {
        Positions {
            next: next
                .iter()
                .map(|(p, n)| (PartitionId::new(*p).unwrap(), *n))
                .collect(),
            generation: 7,
        }
    }

    fn range(partition: &str, first: i64, next: i64, lost: i64) -> PartitionRange {
        PartitionRange {
            partition: partition.into(),
            first,
            next,
            lost_to_retention: lost,
        }
    }

    fn record(partition: &str, offset: i64) -> PulledRecord {
        PulledRecord {
            partition: partition.into(),
            offset,
            ..PulledRecord::default()
        }
    }

    #[test]
    fn frames_that_will_not_decode_are_marked_for_the_dead_letter_topic_before_the_group_gets_them()
    {
        let event = eventmesh_proto::client::Event {
            source: "/orders".into(),
            r#type: "order.created".into(),
            ..Default::default()
        };
        let (good, _) = crate::event::encode_for_publish(event).unwrap();
        let mut batch = PullResponse {
            records: vec![record("0", 1), record("0", 2), record("0", 3)],
            ..PullResponse::default()
        };
        batch.records[0].frame = good;
        batch.records[1].frame = bytes::Bytes::from_static(b"not a frame");
        for record in &mut batch.records[..2] {
            record.body_kind = BodyKind::Frame as i32;
        }
        batch.records[2].body_kind = BodyKind::MalformedFrame as i32;
        batch.records[2].malformed_reason = "the puller's reason".into();
        mark_undecodable(&mut batch);
        let kinds: Vec<i32> = batch.records.iter().map(|r| r.body_kind).collect();
        assert_eq!(
            kinds,
            vec![
                BodyKind::Frame as i32,
                BodyKind::MalformedFrame as i32,
                BodyKind::MalformedFrame as i32
            ]
        );
        assert!(
            batch.records[1]
                .malformed_reason
                .starts_with("frame does not decode: "),
            "{}",
            batch.records[1].malformed_reason
        );
        assert_eq!(batch.records[2].malformed_reason, "the puller's reason");
    }

    #[test]
    fn a_batch_that_continues_moves_the_positions() {
        let mut at = positions(&[("0", 10), ("1", 0)]);
        let batch = PullResponse {
            records: vec![record("0", 10), record("0", 12)],
            ranges: vec![range("0", 10, 13, 0), range("1", 0, 5, 5)],
            ..PullResponse::default()
        };
        at.accept(&batch).unwrap();
        assert_eq!(at, positions(&[("0", 13), ("1", 5)]));
    }

    /// The hole the issue found: a response lost after the puller moved its cursor made the
    /// next batch start higher, and the jump was counted as offsets the log skipped.
    #[test]
    fn a_batch_that_starts_elsewhere_is_refused_and_changes_nothing() {
        let mut at = positions(&[("0", 10), ("1", 3)]);
        let jumped = PullResponse {
            records: vec![record("0", 10), record("1", 750)],
            ranges: vec![range("0", 10, 11, 0), range("1", 750, 751, 0)],
            ..PullResponse::default()
        };
        assert_eq!(
            at.accept(&jumped),
            Err(Discontinuity::Gap {
                partition: "1".into(),
                first: 750,
                expected: 3
            })
        );
        assert_eq!(at, positions(&[("0", 10), ("1", 3)]), "nothing moved");
        let unasked = PullResponse {
            ranges: vec![range("2", 0, 1, 0)],
            ..PullResponse::default()
        };
        assert!(matches!(
            at.accept(&unasked),
            Err(Discontinuity::NotAsked(_))
        ));
        let outside = PullResponse {
            records: vec![record("0", 20)],
            ranges: vec![range("0", 10, 11, 0)],
            ..PullResponse::default()
        };
        assert!(matches!(
            at.accept(&outside),
            Err(Discontinuity::Malformed { .. })
        ));
        let lost_record = PullResponse {
            records: vec![record("0", 11)],
            ranges: vec![range("0", 10, 15, 3)],
            ..PullResponse::default()
        };
        assert!(
            matches!(
                at.accept(&lost_record),
                Err(Discontinuity::Malformed { .. })
            ),
            "a record inside the range retention removed"
        );
    }
}

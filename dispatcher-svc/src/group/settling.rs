//! ACKs settled in one burst share one offset write job.
//!
//! Settling a delivery moves the group's watermark of its partition and its clients' own
//! watermarks; those values must become durable before the delivery is retired (DESIGN §3).
//! Instead of one write job per ACK — a `Vec` of keys, a listener and a notice each — the actor
//! collects the values of every delivery it settles while it works through the commands that
//! are already queued, keeping the highest value per key, and hands them to the writer as one
//! job once the queue is empty (or [`MAX_SETTLED_PER_JOB`] deliveries were collected). The
//! writer's notice then names every delivery of the job. Nothing changes for correctness: each
//! delivery is still retired only once a write covering its values — and the group watermark
//! covering its offset — is durable, and the job is handed over before the actor waits again.

use super::FastMap;

use eventmesh_common::keys::{ClientId, OffsetClient, OffsetKey, PartitionId};
use eventmesh_common::trace_context::{MAX_LINKS, SpanContext};

use crate::registry::GroupKey;

/// Most deliveries collected before a job is handed over even though commands keep coming.
pub const MAX_SETTLED_PER_JOB: usize = 1024;
/// Most commands handled after the first delivery was collected before the job is handed over.
pub const MAX_COMMANDS_PER_JOB: usize = 4096;

/// What the deliveries settled since the last hand-over need durable. Values are kept per
/// partition and per client, the highest of each; their offset keys are made once per job
/// ([`SettledWrites::take`]), not once per delivery.
#[derive(Debug, Default)]
pub struct SettledWrites {
    /// The deliveries (sequence numbers), told when the job is durable.
    tokens: Vec<u64>,
    /// The highest group watermark per partition, and the highest lost-offset total passed.
    cursors: FastMap<PartitionId, (i64, Option<i64>)>,
    /// The highest watermark per client and partition.
    clients: FastMap<(ClientId, PartitionId), i64>,
    /// Commands handled since the first delivery of this job was collected.
    commands_since_first: usize,
    /// The trace contexts of the traced deliveries among them (the write links to them).
    links: Vec<SpanContext>,
}

/// One write job's contents.
pub struct SettledJob {
    /// The deliveries.
    pub tokens: Vec<u64>,
    /// Keys and values.
    pub entries: Vec<(OffsetKey, i64)>,
    /// Group watermarks written, per partition.
    pub cursors: Vec<(PartitionId, i64)>,
    /// The traced deliveries' contexts.
    pub links: Vec<SpanContext>,
}

fn raise(slot: &mut i64, value: i64) {
    *slot = (*slot).max(value);
}

impl SettledWrites {
    /// Adds a settled delivery; the values it needs durable are added with
    /// [`SettledWrites::cursor`] and [`SettledWrites::client`].
    pub fn add(&mut self, token: u64) {
        self.tokens.push(token);
    }

    /// The group watermark of `partition` is to be `watermark` (and its lost-offset total
    /// `lost`, when it grew).
    pub fn cursor(&mut self, partition: &PartitionId, watermark: i64, lost: Option<i64>) {
        match self.cursors.get_mut(partition) {
            Some((kept, kept_lost)) => {
                raise(kept, watermark);
                if let Some(lost) = lost {
                    raise(kept_lost.get_or_insert(lost), lost);
                }
            }
            None => {
                self.cursors.insert(partition.clone(), (watermark, lost));
            }
        }
    }

    /// A client's watermark in a partition is to be `watermark`.
    pub fn client(&mut self, key: (ClientId, PartitionId), watermark: i64) {
        raise(self.clients.entry(key).or_insert(watermark), watermark);
    }

    /// Notes the trace context of a traced delivery being settled (at most
    /// [`MAX_LINKS`] are kept per job).
    pub fn link(&mut self, trace: &SpanContext) {
        if self.links.len() < MAX_LINKS {
            self.links.push(trace.clone());
        }
    }

    /// Whether to hand the job over now (called once per command handled): something is
    /// collected and either nothing else is queued, the job is full, or
    /// [`MAX_COMMANDS_PER_JOB`] commands went by since the first delivery was collected — so
    /// a client flooding other commands cannot hold settled ACKs back.
    pub fn due(&mut self, queue_empty: bool) -> bool {
        if self.tokens.is_empty() {
            return false;
        }
        self.commands_since_first += 1;
        queue_empty
            || self.tokens.len() >= MAX_SETTLED_PER_JOB
            || self.commands_since_first >= MAX_COMMANDS_PER_JOB
    }

    /// Takes what was collected as the job of `group` (`None` when nothing was).
    pub fn take(&mut self, group: &GroupKey) -> Option<SettledJob> {
        if self.tokens.is_empty() {
            return None;
        }
        self.commands_since_first = 0;
        let mut entries = Vec::with_capacity(self.cursors.len() + self.clients.len());
        let mut cursors = Vec::with_capacity(self.cursors.len());
        for (partition, (watermark, lost)) in self.cursors.drain() {
            entries.extend(group.watermark_entries(&partition, watermark, lost));
            cursors.push((partition, watermark));
        }
        for ((client, partition), watermark) in self.clients.drain() {
            let key = OffsetKey::new(group.topic.clone(), OffsetClient::Client(client), partition);
            entries.push((key, watermark));
        }
        Some(SettledJob {
            tokens: std::mem::take(&mut self.tokens),
            entries,
            cursors,
            links: std::mem::take(&mut self.links),
        })
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use std::collections::HashMap;

    use eventmesh_common::keys::{GroupName, Topic};

    use super::*;

    fn group() -> GroupKey {
        GroupKey {
            topic: Topic::new("t".to_owned()).unwrap(),
            group: Some(GroupName::named("g".to_owned()).unwrap()),
        }
    }

    fn client(name: &str) -> (ClientId, PartitionId) {
        (
            ClientId::new(name.to_owned()).unwrap(),
            PartitionId::number(0),
        )
    }

    fn key(client: OffsetClient) -> OffsetKey {
        OffsetKey::new(
            Topic::new("t".to_owned()).unwrap(),
            client,
            PartitionId::number(0),
        )
    }

    #[test]
    fn a_job_keeps_the_highest_value_per_key_and_names_every_delivery() {
        let group = group();
        let mut settled = SettledWrites::default();
        assert!(!settled.due(true));
        assert!(settled.take(&group).is_none());
        let partition = PartitionId::number(0);
        settled.add(1);
        settled.cursor(&partition, 5, None);
        settled.client(client("a"), 5);
        settled.add(2);
        settled.client(client("a"), 3);
        settled.add(3);
        settled.cursor(&partition, 7, Some(2));
        settled.cursor(&partition, 6, Some(1));
        assert!(settled.due(true));
        assert!(
            !settled.due(false),
            "more commands are queued and the job is not full"
        );
        let job = settled.take(&group).unwrap();
        assert_eq!(job.tokens, vec![1, 2, 3]);
        let entries: HashMap<_, _> = job.entries.into_iter().collect();
        let named = || group.group.clone();
        assert_eq!(entries[&key(OffsetClient::MqCursor(named()))], 7);
        assert_eq!(entries[&key(OffsetClient::MqLost(named()))], 2);
        assert_eq!(
            entries[&key(OffsetClient::Client(client("a").0))],
            5,
            "a lower value never lowers what is written"
        );
        assert_eq!(entries.len(), 3);
        assert_eq!(job.cursors, vec![(partition, 7)]);
        assert!(settled.take(&group).is_none(), "taken once");
    }

    #[test]
    fn a_job_is_due_after_many_other_commands() {
        let group = group();
        let mut settled = SettledWrites::default();
        settled.add(1);
        settled.client(client("a"), 1);
        for _ in 1..MAX_COMMANDS_PER_JOB {
            assert!(!settled.due(false));
        }
        assert!(
            settled.due(false),
            "a flood of other commands cannot hold it back"
        );
        assert!(settled.take(&group).is_some());
        settled.add(2);
        assert!(
            !settled.due(false),
            "the count starts again with the next job"
        );
    }

    #[test]
    fn a_full_job_is_due_while_commands_keep_coming() {
        let mut settled = SettledWrites::default();
        for token in 0..MAX_SETTLED_PER_JOB as u64 {
            assert!(!settled.due(false));
            settled.add(token);
            settled.client(client("a"), token as i64);
        }
        assert!(settled.due(false));
    }
}

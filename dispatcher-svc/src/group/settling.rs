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

use eventmesh_common::keys::{OffsetKey, PartitionId};
use eventmesh_common::trace_context::{MAX_LINKS, SpanContext};

/// Most deliveries collected before a job is handed over even though commands keep coming.
pub const MAX_SETTLED_PER_JOB: usize = 1024;
/// Most commands handled after the first delivery was collected before the job is handed over.
pub const MAX_COMMANDS_PER_JOB: usize = 4096;

/// What the deliveries settled since the last hand-over need durable.
#[derive(Debug, Default)]
pub struct SettledWrites {
    /// The deliveries (sequence numbers), told when the job is durable.
    tokens: Vec<u64>,
    /// The highest value per key.
    entries: FastMap<OffsetKey, i64>,
    /// The highest group watermark per partition among the entries.
    cursors: FastMap<PartitionId, i64>,
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

impl SettledWrites {
    /// Adds a settled delivery and the values it needs durable.
    pub fn add(
        &mut self,
        token: u64,
        entries: impl IntoIterator<Item = (OffsetKey, i64)>,
        cursor: Option<(PartitionId, i64)>,
    ) {
        self.tokens.push(token);
        for (key, value) in entries {
            let slot = self.entries.entry(key).or_insert(value);
            *slot = (*slot).max(value);
        }
        if let Some((partition, watermark)) = cursor {
            let slot = self.cursors.entry(partition).or_insert(watermark);
            *slot = (*slot).max(watermark);
        }
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

    /// Takes what was collected (`None` when nothing was).
    pub fn take(&mut self) -> Option<SettledJob> {
        if self.tokens.is_empty() {
            return None;
        }
        self.commands_since_first = 0;
        Some(SettledJob {
            tokens: std::mem::take(&mut self.tokens),
            entries: self.entries.drain().collect(),
            cursors: self.cursors.drain().collect(),
            links: std::mem::take(&mut self.links),
        })
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use eventmesh_common::keys::{ClientId, GroupName, OffsetClient, Topic};

    use super::*;

    fn key(client: &str) -> OffsetKey {
        OffsetKey::new(
            Topic::new("t".to_owned()).unwrap(),
            OffsetClient::Client(ClientId::new(client.to_owned()).unwrap()),
            PartitionId::number(0),
        )
    }

    #[test]
    fn a_job_keeps_the_highest_value_per_key_and_names_every_delivery() {
        let mut settled = SettledWrites::default();
        assert!(!settled.due(true));
        assert!(settled.take().is_none());
        let cursor = OffsetKey::new(
            Topic::new("t".to_owned()).unwrap(),
            OffsetClient::MqCursor(Some(GroupName::named("g".to_owned()).unwrap())),
            PartitionId::number(0),
        );
        settled.add(
            1,
            vec![(cursor.clone(), 5), (key("a"), 5)],
            Some((PartitionId::number(0), 5)),
        );
        settled.add(2, vec![(key("a"), 3)], None);
        settled.add(
            3,
            vec![(cursor.clone(), 7)],
            Some((PartitionId::number(0), 7)),
        );
        assert!(settled.due(true));
        assert!(
            !settled.due(false),
            "more commands are queued and the job is not full"
        );
        let job = settled.take().unwrap();
        assert_eq!(job.tokens, vec![1, 2, 3]);
        let entries: std::collections::HashMap<_, _> = job.entries.into_iter().collect();
        assert_eq!(entries[&cursor], 7);
        assert_eq!(
            entries[&key("a")],
            5,
            "a lower value never lowers what is written"
        );
        assert_eq!(job.cursors, vec![(PartitionId::number(0), 7)]);
        assert!(settled.take().is_none(), "taken once");
    }

    #[test]
    fn a_job_is_due_after_many_other_commands() {
        let mut settled = SettledWrites::default();
        settled.add(1, vec![(key("a"), 1)], None);
        for _ in 1..MAX_COMMANDS_PER_JOB {
            assert!(!settled.due(false));
        }
        assert!(
            settled.due(false),
            "a flood of other commands cannot hold it back"
        );
        assert!(settled.take().is_some());
        settled.add(2, vec![(key("a"), 2)], None);
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
            settled.add(token, vec![(key("a"), token as i64)], None);
        }
        assert!(settled.due(false));
    }
}

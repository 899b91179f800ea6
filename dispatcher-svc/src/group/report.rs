//! What a group tells about itself.
//!
//! * Counters, labeled `topic` and `group` (the group label bounded by
//!   `eventmesh_common::metrics::group_label`): deliveries, ACKs, NACKs, redeliveries, ACK
//!   timeouts and dead letters, counted as they happen. The counters of what goes wrong —
//!   NACKs, redeliveries, ACK timeouts, dead letters — also carry `partition`
//!   ([`PartitionTally`]): they point at a poison or slow partition. A partition's series
//!   start at 0 when the group first reads it, so `rate()` sees the first count. Deliveries and
//!   ACKs, counted for every event, stay per group.
//! * Every flush interval (and when the group ends) a [`GroupReport`] snapshot — sessions,
//!   where its deliveries are, the age of its oldest un-ACKed delivery, its counters and each
//!   partition's durable watermark — published on a watch channel that `DescribeGroups` (and so
//!   `emctl top`) reads, and the same values set on the group's gauges. Nothing is computed on a
//!   read: a reader never waits for the actor.
//! * The ACK → DURABLE latency histogram ([`AckLatency`]), bucketed in the actor.

use std::collections::HashMap;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use eventmesh_common::keys::PartitionId;
use eventmesh_common::metrics::{KeptCounter, KeptGauge, LATENCY_BUCKETS};
use metrics::Label;

/// One counter of the group: its value since the group started (for the report) and its
/// Prometheus counter, which is brought up to date at each report — counting an event costs
/// one addition, not a metric update (the exposition lags by at most one report interval).
pub(crate) struct Tally {
    total: u64,
    exported: u64,
    metric: KeptCounter,
}

impl Tally {
    fn new(name: &'static str, labels: &[Label]) -> Self {
        Tally {
            total: 0,
            exported: 0,
            metric: KeptCounter::counter(name, labels.to_vec()),
        }
    }

    /// Counts one.
    pub(crate) fn add(&mut self) {
        self.total += 1;
    }

    /// Adds what was counted since the last export to the Prometheus counter.
    fn export(&mut self) {
        if self.total > self.exported {
            self.metric.increment(self.total - self.exported);
            self.exported = self.total;
        }
    }
}

/// A counter of the group per partition (the Prometheus counter gets a `partition` label); a
/// partition's series starts at 0 when [`touch`](Self::touch)ed.
pub(crate) struct PartitionTally {
    name: &'static str,
    labels: Vec<Label>,
    by_partition: HashMap<PartitionId, Tally>,
    total: u64,
}

impl PartitionTally {
    fn new(name: &'static str, labels: &[Label]) -> Self {
        PartitionTally {
            name,
            labels: labels.to_vec(),
            by_partition: HashMap::new(),
            total: 0,
        }
    }

    /// Counts one for `partition`.
    pub(crate) fn add(&mut self, partition: &PartitionId) {
        self.total += 1;
        self.tally(partition).add();
    }

    /// Makes `partition`'s series exist, at 0.
    pub(crate) fn touch(&mut self, partition: &PartitionId) {
        self.tally(partition).metric.increment(0);
    }

    fn tally(&mut self, partition: &PartitionId) -> &mut Tally {
        let (name, labels) = (self.name, &self.labels);
        self.by_partition
            .entry(partition.clone())
            .or_insert_with(|| {
                let mut labels = labels.clone();
                labels.push(Label::new("partition", partition.to_string()));
                Tally::new(name, &labels)
            })
    }

    /// The count over all partitions.
    pub(crate) fn total(&self) -> u64 {
        self.total
    }

    fn export(&mut self) {
        self.by_partition.values_mut().for_each(Tally::export);
    }
}

/// The group's counters.
pub(crate) struct Tallies {
    /// `dispatcher_deliveries_total`: deliveries written to sessions, retries included.
    pub delivered: Tally,
    /// `dispatcher_acks_total`: ACKs accepted.
    pub acked: Tally,
    /// `dispatcher_nacks_total{partition}`: NACKs accepted.
    pub nacked: PartitionTally,
    /// `dispatcher_redeliveries_total{partition}`: retries scheduled (NACK, timeout, lost
    /// session).
    pub redelivered: PartitionTally,
    /// `dispatcher_ack_timeouts_total{partition}`: ACK deadlines that passed.
    pub timed_out: PartitionTally,
    /// `dispatcher_dead_letters_total{partition}`: events settled by a durable dead-letter
    /// copy.
    pub dead_lettered: PartitionTally,
}

impl Tallies {
    /// Makes the per-partition series of `partition` exist, at 0 (the group reads it now).
    pub(crate) fn touch(&mut self, partition: &PartitionId) {
        self.nacked.touch(partition);
        self.redelivered.touch(partition);
        self.timed_out.touch(partition);
        self.dead_lettered.touch(partition);
    }

    /// Brings every Prometheus counter up to date.
    pub(crate) fn export(&mut self) {
        self.delivered.export();
        self.acked.export();
        for tally in [
            &mut self.nacked,
            &mut self.redelivered,
            &mut self.timed_out,
            &mut self.dead_lettered,
        ] {
            tally.export();
        }
    }

    pub(crate) fn new(labels: &[Label]) -> Self {
        Tallies {
            delivered: Tally::new("dispatcher_deliveries_total", labels),
            acked: Tally::new("dispatcher_acks_total", labels),
            nacked: PartitionTally::new("dispatcher_nacks_total", labels),
            redelivered: PartitionTally::new("dispatcher_redeliveries_total", labels),
            timed_out: PartitionTally::new("dispatcher_ack_timeouts_total", labels),
            dead_lettered: PartitionTally::new("dispatcher_dead_letters_total", labels),
        }
    }
}

/// ACK → DURABLE latency of a group's deliveries (from the client's ACK to the answer that
/// the stored watermark covers it), bucketed in the actor and exported at every report as the
/// Prometheus histogram `dispatcher_ack_durable_seconds{topic,group}` (`_bucket{le}`, `_sum`,
/// `_count`): each interval's counts are added to counters, so no per-event sample is kept
/// anywhere and memory stays fixed however fast events go and however rarely it is scraped.
pub(crate) struct AckLatency {
    /// Observations since the last report per bucket of [`LATENCY_BUCKETS`] (not cumulative;
    /// the last one is `+Inf`).
    counts: Vec<u64>,
    sum: f64,
    total_sum: f64,
    buckets: Vec<KeptCounter>,
    sum_metric: KeptGauge,
    count_metric: KeptCounter,
}

impl AckLatency {
    pub(crate) fn new(labels: &[Label]) -> Self {
        let bounds = LATENCY_BUCKETS
            .iter()
            .map(|bound| bound.to_string())
            .chain(std::iter::once("+Inf".to_owned()));
        let buckets = bounds
            .map(|le| {
                let mut labels = labels.to_vec();
                labels.push(Label::new("le", le));
                KeptCounter::counter("dispatcher_ack_durable_seconds_bucket", labels)
            })
            .collect();
        AckLatency {
            counts: vec![0; LATENCY_BUCKETS.len() + 1],
            sum: 0.0,
            total_sum: 0.0,
            buckets,
            // A running total never decreases: `rate()` works on it as on a counter's.
            sum_metric: KeptGauge::gauge("dispatcher_ack_durable_seconds_sum", labels.to_vec()),
            count_metric: KeptCounter::counter(
                "dispatcher_ack_durable_seconds_count",
                labels.to_vec(),
            ),
        }
    }

    /// Counts one delivery answered DURABLE `latency` after its ACK.
    pub(crate) fn observe(&mut self, latency: Duration) {
        let seconds = latency.as_secs_f64();
        let bucket = LATENCY_BUCKETS.partition_point(|bound| *bound < seconds);
        self.counts[bucket] += 1;
        self.sum += seconds;
    }

    /// Adds what was observed since the last flush to the exported counters.
    pub(crate) fn flush(&mut self) {
        let observed: u64 = self.counts.iter().sum();
        if observed == 0 {
            return;
        }
        let mut cumulative = 0;
        for (count, metric) in self.counts.iter_mut().zip(&mut self.buckets) {
            cumulative += *count;
            metric.increment(cumulative);
            *count = 0;
        }
        self.total_sum += self.sum;
        self.sum = 0.0;
        self.sum_metric.set(self.total_sum);
        self.count_metric.increment(observed);
    }
}

/// Where a group's tracked deliveries are, counted by the actor at a report.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct DeliveryCounts {
    /// Handed to a session, not settled by it yet.
    pub in_flight: u64,
    /// Waiting for a session with capacity.
    pub ready: u64,
    /// Waiting out a NACK delay or backoff.
    pub backoff: u64,
    /// ACKed or dead-lettered, progress not durable yet.
    pub settling: u64,
    /// Since when the oldest delivery not yet ACKed was pulled.
    pub oldest_unacked: Option<Instant>,
}

/// A group's report of itself (see the module doc).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct GroupReport {
    /// Open sessions.
    pub sessions: u32,
    /// Where its deliveries are.
    pub counts: DeliveryCounts,
    /// Age of the oldest delivery not yet ACKed at the report.
    pub oldest_unacked_age: Duration,
    /// Counter values since the group started: delivered, ACKed, NACKed, redelivered, timed
    /// out, dead-lettered.
    pub delivered_total: u64,
    /// ACKs accepted.
    pub acked_total: u64,
    /// NACKs accepted.
    pub nacked_total: u64,
    /// Retries scheduled.
    pub redelivered_total: u64,
    /// ACK deadlines passed.
    pub timed_out_total: u64,
    /// Dead letters written.
    pub dead_lettered_total: u64,
    /// Each partition's durable watermark, by partition.
    pub partitions: Vec<(PartitionId, i64)>,
    /// When it was made, Unix milliseconds.
    pub reported_unix_ms: i64,
}

impl GroupReport {
    /// One report of a sharded group from its shards' reports: sessions (every shard has the
    /// same) the most any shard has, counts and counters added, the oldest un-ACKed delivery
    /// the oldest of any, partitions together; made when the least recent was (0 while a
    /// shard has not reported).
    pub fn merge(reports: impl IntoIterator<Item = GroupReport>) -> GroupReport {
        let mut merged: Option<GroupReport> = None;
        for report in reports {
            let Some(into) = merged.as_mut() else {
                merged = Some(report);
                continue;
            };
            into.sessions = into.sessions.max(report.sessions);
            let (a, b) = (&mut into.counts, report.counts);
            a.in_flight += b.in_flight;
            a.ready += b.ready;
            a.backoff += b.backoff;
            a.settling += b.settling;
            a.oldest_unacked = match (a.oldest_unacked, b.oldest_unacked) {
                (Some(x), Some(y)) => Some(x.min(y)),
                (x, y) => x.or(y),
            };
            into.oldest_unacked_age = into.oldest_unacked_age.max(report.oldest_unacked_age);
            into.delivered_total += report.delivered_total;
            into.acked_total += report.acked_total;
            into.nacked_total += report.nacked_total;
            into.redelivered_total += report.redelivered_total;
            into.timed_out_total += report.timed_out_total;
            into.dead_lettered_total += report.dead_lettered_total;
            into.partitions.extend(report.partitions);
            into.reported_unix_ms = if into.reported_unix_ms == 0 || report.reported_unix_ms == 0 {
                0
            } else {
                into.reported_unix_ms.min(report.reported_unix_ms)
            };
        }
        let mut merged = merged.unwrap_or_default();
        merged.partitions.sort_by(|a, b| a.0.cmp(&b.0));
        merged
    }
}

/// The group's gauges, set at every report.
pub(crate) struct Gauges {
    sessions: KeptGauge,
    in_flight: KeptGauge,
    ready: KeptGauge,
    oldest_unacked: KeptGauge,
}

impl Gauges {
    pub(crate) fn new(labels: &[Label]) -> Self {
        Gauges {
            sessions: KeptGauge::gauge("dispatcher_group_sessions", labels.to_vec()),
            in_flight: KeptGauge::gauge("dispatcher_group_in_flight", labels.to_vec()),
            ready: KeptGauge::gauge("dispatcher_group_ready", labels.to_vec()),
            oldest_unacked: KeptGauge::gauge(
                "dispatcher_group_oldest_unacked_seconds",
                labels.to_vec(),
            ),
        }
    }

    /// Sets every gauge from `report`.
    pub(crate) fn set(&mut self, report: &GroupReport) {
        self.sessions.set(f64::from(report.sessions));
        self.in_flight.set(report.counts.in_flight as f64);
        self.ready.set(report.counts.ready as f64);
        self.oldest_unacked
            .set(report.oldest_unacked_age.as_secs_f64());
    }
}

/// Builds the report from the actor's parts.
pub(crate) fn build(
    sessions: u32,
    counts: DeliveryCounts,
    tallies: &Tallies,
    mut partitions: Vec<(PartitionId, i64)>,
    now: Instant,
) -> GroupReport {
    partitions.sort_by(|a, b| a.0.cmp(&b.0));
    GroupReport {
        sessions,
        counts,
        oldest_unacked_age: counts
            .oldest_unacked
            .map_or(Duration::ZERO, |since| now.saturating_duration_since(since)),
        delivered_total: tallies.delivered.total,
        acked_total: tallies.acked.total,
        nacked_total: tallies.nacked.total(),
        redelivered_total: tallies.redelivered.total(),
        timed_out_total: tallies.timed_out.total(),
        dead_lettered_total: tallies.dead_lettered.total(),
        partitions,
        reported_unix_ms: SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_millis() as i64),
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn ack_latency_buckets_are_cumulative_and_reset_per_flush() {
        let mut latency = AckLatency::new(&[]);
        latency.observe(Duration::from_micros(700)); // ≤ 1 ms
        latency.observe(Duration::from_millis(1)); // on a bound: ≤ 1 ms
        latency.observe(Duration::from_millis(3)); // ≤ 5 ms
        latency.observe(Duration::from_secs(60)); // +Inf
        let bucket = |seconds: f64| LATENCY_BUCKETS.iter().position(|b| *b == seconds).unwrap();
        assert_eq!(latency.counts[bucket(0.001)], 2);
        assert_eq!(latency.counts[bucket(0.005)], 1);
        assert_eq!(latency.counts[LATENCY_BUCKETS.len()], 1);
        assert!((latency.sum - 60.0047).abs() < 1e-9, "{}", latency.sum);
        latency.flush();
        assert!(latency.counts.iter().all(|c| *c == 0));
        assert!((latency.total_sum - 60.0047).abs() < 1e-9);
        latency.flush(); // nothing new: nothing changes
        assert!((latency.total_sum - 60.0047).abs() < 1e-9);
    }

    #[test]
    fn a_report_carries_the_counters_the_age_and_sorted_partitions() {
        let mut tallies = Tallies::new(&[]);
        tallies.delivered.add();
        tallies.delivered.add();
        tallies.acked.add();
        let p = |text: &str| PartitionId::new(text).unwrap();
        tallies.nacked.add(&p("0"));
        tallies.redelivered.add(&p("1"));
        tallies.redelivered.add(&p("1"));
        tallies.redelivered.add(&p("0"));
        tallies.dead_lettered.add(&p("1"));
        let now = Instant::now();
        let counts = DeliveryCounts {
            in_flight: 1,
            ready: 2,
            backoff: 3,
            settling: 4,
            oldest_unacked: now.checked_sub(Duration::from_millis(1500)),
        };
        let report = build(2, counts, &tallies, vec![(p("1"), 9), (p("0"), -1)], now);
        assert_eq!(report.sessions, 2);
        assert_eq!(report.counts, counts);
        assert_eq!(report.oldest_unacked_age, Duration::from_millis(1500));
        assert_eq!(
            (
                report.delivered_total,
                report.acked_total,
                report.nacked_total,
                report.redelivered_total,
                report.timed_out_total,
                report.dead_lettered_total
            ),
            (2, 1, 1, 3, 0, 1)
        );
        let by_partition = |n: &str| tallies.redelivered.by_partition[&p(n)].total;
        assert_eq!((by_partition("0"), by_partition("1")), (1, 2));
        assert_eq!(report.partitions, vec![(p("0"), -1), (p("1"), 9)]);
        assert!(report.reported_unix_ms > 0);

        let idle = build(0, DeliveryCounts::default(), &tallies, Vec::new(), now);
        assert_eq!(idle.oldest_unacked_age, Duration::ZERO);
    }
}

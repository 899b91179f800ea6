//! Consumer lag per group and partition as a Prometheus gauge:
//! `dispatcher_consumer_lag_records{topic,group,partition}`, the records of the partition's
//! retained range after the group's durable watermark — what is still to be delivered and
//! ACKed durably. `emctl top` shows the same, summed per group.
//!
//! Contract:
//! * Every `lag_interval_ms` the instance asks puller-svc for the retained ranges of each
//!   topic it has live groups of — one `EndOffsets` per topic however many groups read it —
//!   and takes each group's durable watermarks from its latest report (at most one report
//!   interval old), so nothing waits on a group's actor.
//! * A partition the group has no watermark for yet counts whole; a watermark past the end
//!   (records removed) counts 0.
//! * A topic whose ranges cannot be read keeps its last values (a lag that cannot be measured
//!   is not "no lag"); the failure is logged at WARN once until a read succeeds again. Kept
//!   values not updated for [`eventmesh_common::metrics::IDLE_TIMEOUT`] leave the exposition.
//! * Groups beyond the group-label bound share the label `(other)`: their lags add up. The
//!   label is the one the group's actor uses for its other metrics.
//! * A group that ended here (closed, or moved to another instance) is set to 0 once — this
//!   instance no longer holds any of its lag, its new home reports it, so a `sum` over
//!   instances stays right — and then left to leave the exposition after the idle timeout.
//! * A group that has not reported yet is left out until its first report.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::Duration;

use eventmesh_common::keys::{PartitionId, Topic};
use eventmesh_common::metrics::KeptGauge;
use eventmesh_common::shutdown::CancellationToken;
use eventmesh_proto::puller::EndOffsetsRequest;
use metrics::Label;

use crate::registry::Shared;

/// A partition's retained range `[start, end)`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Retained {
    /// The first retained offset.
    pub start: i64,
    /// One past the last offset.
    pub end: i64,
}

/// Records of `range` after `watermark` (the last durably ACKed offset; `None` or anything
/// below the range: none of it).
pub fn lag(range: Retained, watermark: Option<i64>) -> i64 {
    let done = watermark.unwrap_or(range.start - 1).max(range.start - 1);
    (range.end - 1 - done).max(0)
}

/// Each partition's lag for a group with durable `watermarks`, in `ranges`' order.
pub fn group_lag(
    ranges: &[(PartitionId, Retained)],
    watermarks: &[(PartitionId, i64)],
) -> Vec<(PartitionId, i64)> {
    let watermarks: HashMap<&PartitionId, i64> = watermarks.iter().map(|(p, w)| (p, *w)).collect();
    ranges
        .iter()
        .map(|(partition, range)| {
            (
                partition.clone(),
                lag(*range, watermarks.get(partition).copied()),
            )
        })
        .collect()
}

/// The gauge's label values: topic, group label, partition.
type SeriesKey = (String, String, String);

/// A group's durable watermarks, by partition (its latest report's).
type Watermarks = Vec<(PartitionId, i64)>;

/// Sets the lag gauges every `interval` until `shutdown` (see the module doc).
pub fn spawn(shared: Arc<Shared>, interval: Duration, shutdown: CancellationToken) {
    if interval.is_zero() {
        return;
    }
    tokio::spawn(async move {
        let mut gauges: HashMap<SeriesKey, KeptGauge> = HashMap::new();
        let mut failing: HashSet<Topic> = HashSet::new();
        let mut ticks = tokio::time::interval(interval);
        ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                _ = ticks.tick() => {}
                () = shutdown.cancelled() => return,
            }
            measure(&shared, &mut gauges, &mut failing).await;
        }
    });
}

/// One round: reads the ranges of every topic with live groups and sets the gauges.
async fn measure(
    shared: &Shared,
    gauges: &mut HashMap<SeriesKey, KeptGauge>,
    failing: &mut HashSet<Topic>,
) {
    let mut by_topic: HashMap<Topic, Vec<(Arc<str>, Watermarks)>> = HashMap::new();
    for group in shared.group_reports() {
        // A group that has not reported yet has no watermarks to measure from.
        if group.report.reported_unix_ms == 0 {
            continue;
        }
        by_topic
            .entry(group.key.topic)
            .or_default()
            .push((group.metric_label, group.report.partitions));
    }
    failing.retain(|topic| by_topic.contains_key(topic));
    let mut values: HashMap<SeriesKey, i64> = HashMap::new();
    let mut kept: HashSet<SeriesKey> = HashSet::new();
    for (topic, groups) in by_topic {
        let ranges = match ranges(shared, &topic).await {
            Ok(ranges) => {
                if failing.remove(&topic) {
                    tracing::info!(%topic, "consumer lag measurable again");
                }
                ranges
            }
            Err(status) => {
                if failing.insert(topic.clone()) {
                    tracing::warn!(%topic, error = %status.message(), "cannot read the topic's ranges for consumer lag; keeping the last values");
                }
                let name = topic.to_string();
                kept.extend(gauges.keys().filter(|key| key.0 == name).cloned());
                continue;
            }
        };
        for (label, watermarks) in groups {
            for (partition, lag) in group_lag(&ranges, &watermarks) {
                *values
                    .entry((topic.to_string(), label.to_string(), partition.to_string()))
                    .or_default() += lag;
            }
        }
    }
    // Series of groups no longer here: 0 once (see the module doc), then forgotten.
    gauges.retain(|key, gauge| {
        let live = values.contains_key(key) || kept.contains(key);
        if !live {
            gauge.set(0.0);
        }
        live
    });
    for (key, value) in values {
        gauges
            .entry(key.clone())
            .or_insert_with(|| {
                KeptGauge::gauge(
                    "dispatcher_consumer_lag_records",
                    vec![
                        Label::new("topic", key.0),
                        Label::new("group", key.1),
                        Label::new("partition", key.2),
                    ],
                )
            })
            .set(value as f64);
    }
}

/// The topic's retained ranges, from puller-svc.
async fn ranges(
    shared: &Shared,
    topic: &Topic,
) -> Result<Vec<(PartitionId, Retained)>, tonic::Status> {
    let partitions = shared
        .puller()
        .end_offsets(EndOffsetsRequest {
            topic: topic.to_string(),
        })
        .await?
        .into_inner()
        .partitions;
    Ok(partitions
        .into_iter()
        .filter_map(|range| {
            let partition = PartitionId::new(range.partition).ok()?;
            Some((
                partition,
                Retained {
                    start: range.start,
                    end: range.end,
                },
            ))
        })
        .collect())
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn p(text: &str) -> PartitionId {
        PartitionId::new(text).unwrap()
    }

    #[test]
    fn lag_counts_what_the_watermark_has_not_covered() {
        let range = Retained { start: 10, end: 20 };
        assert_eq!(lag(range, None), 10, "no watermark: all retained");
        assert_eq!(lag(range, Some(-1)), 10, "below the range: all retained");
        assert_eq!(lag(range, Some(9)), 10);
        assert_eq!(lag(range, Some(14)), 5);
        assert_eq!(lag(range, Some(19)), 0);
        assert_eq!(lag(range, Some(30)), 0, "past the end (records removed)");
        assert_eq!(lag(Retained { start: 0, end: 0 }, None), 0, "empty");
    }

    #[test]
    fn every_partition_of_the_topic_gets_a_lag() {
        let ranges = [
            (p("0"), Retained { start: 0, end: 5 }),
            (p("1"), Retained { start: 0, end: 7 }),
            (p("2"), Retained { start: 3, end: 3 }),
        ];
        let lags = group_lag(&ranges, &[(p("1"), 2), (p("9"), 100)]);
        assert_eq!(lags, vec![(p("0"), 5), (p("1"), 4), (p("2"), 0)]);
    }
}

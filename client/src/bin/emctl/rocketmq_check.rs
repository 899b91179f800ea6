//! `emctl rocketmq-check --topic T`: what bounds a RocketMQ topic's storage, read from its
//! brokers through puller-svc, beside our cursors and watermarks.
//!
//! Neither RocketMQ backend commits an offset to the broker (positions are ours), so nothing
//! we do trims the broker's storage: the commit log is deleted by age (`fileReservedTime`) and
//! the consume queues are expected to be trimmed in step with it. This command checks that per
//! deployment, and what retention means for our groups. It warns — and exits with status 1 —
//! when:
//! * a consume queue's lowest entry points below its broker's lowest commit-log offset (the
//!   queue indexes messages whose bodies were deleted: not trimmed in step);
//! * a group's watermark is below a queue's lowest offset minus one (events deleted before the
//!   group ACKed them);
//! * a group's cursor is past a queue's end (the topic was recreated or the broker lost data).

use std::collections::BTreeMap;

use anyhow::Context;
use eventmesh_proto::puller as puller_pb;
use eventmesh_proto::puller::puller_service_client::PullerServiceClient;

use crate::offsets::{PartitionView, TopicReportArgs, lag, topic_view};

/// One queue with what we hold for it.
#[derive(Debug, Clone, serde::Serialize)]
struct QueueCheck {
    partition: String,
    broker: String,
    /// The consume queue's range `[min, max)`.
    min_offset: i64,
    max_offset: i64,
    /// Where its lowest entry sits in the commit log (absent: empty queue).
    min_entry_commit_log_offset: Option<i64>,
    /// Per group: its watermark (last offset ACKed with everything below).
    watermarks: BTreeMap<String, i64>,
    /// Per group: the next offset its reader reads.
    cursors: BTreeMap<String, i64>,
}

#[derive(Debug, Clone, serde::Serialize)]
struct BrokerCheck {
    broker: String,
    address: String,
    commit_log_min_offset: i64,
    commit_log_max_offset: i64,
    file_reserved_hours: Option<i64>,
    delete_when: Option<String>,
    commit_log_disk_ratio: Option<f64>,
}

#[derive(Debug, Clone, serde::Serialize)]
struct Check {
    topic: String,
    backend: String,
    brokers: Vec<BrokerCheck>,
    queues: Vec<QueueCheck>,
    warnings: Vec<String>,
}

pub async fn run(args: TopicReportArgs) -> anyhow::Result<()> {
    let mut puller = PullerServiceClient::connect(args.services.puller.clone())
        .await
        .with_context(|| format!("connecting to puller-svc at {}", args.services.puller))?;
    let storage = puller
        .describe_broker_storage(puller_pb::DescribeBrokerStorageRequest {
            topic: args.topic.clone(),
        })
        .await
        .with_context(|| format!("asking the brokers of {} about their storage", args.topic))?
        .into_inner();
    let view = topic_view(&args.services, &args.topic).await?;
    let mut cursors: BTreeMap<(String, String), i64> = BTreeMap::new();
    let groups: std::collections::BTreeSet<String> = view
        .iter()
        .flat_map(|p| p.watermarks.keys().cloned())
        .collect();
    for group in groups {
        let asked = if group == crate::offsets::DEFAULT_GROUP {
            String::new()
        } else {
            group.clone()
        };
        let listed = puller
            .cursors(puller_pb::CursorsRequest {
                topic: args.topic.clone(),
                group: asked,
            })
            .await
            .with_context(|| format!("reading the cursors of group {group}"))?
            .into_inner();
        for cursor in listed.cursors {
            cursors.insert((group.clone(), cursor.partition), cursor.next_offset);
        }
    }
    let check = assemble(&args.topic, storage, &view, &cursors);
    if args.json {
        println!("{}", serde_json::to_string_pretty(&check)?);
    } else {
        print_table(&check);
    }
    if !check.warnings.is_empty() {
        anyhow::bail!("{} warning(s) for {}", check.warnings.len(), args.topic);
    }
    Ok(())
}

/// Puts the brokers' report beside our watermarks and cursors, and finds what to warn about.
fn assemble(
    topic: &str,
    storage: puller_pb::DescribeBrokerStorageResponse,
    view: &[PartitionView],
    cursors: &BTreeMap<(String, String), i64>,
) -> Check {
    let known = |n: i64| (n >= 0).then_some(n);
    let brokers: Vec<BrokerCheck> = storage
        .brokers
        .into_iter()
        .map(|b| BrokerCheck {
            broker: b.broker,
            address: b.address,
            commit_log_min_offset: b.commit_log_min_offset,
            commit_log_max_offset: b.commit_log_max_offset,
            file_reserved_hours: known(b.file_reserved_hours),
            delete_when: Some(b.delete_when).filter(|d| !d.is_empty()),
            commit_log_disk_ratio: Some(b.commit_log_disk_ratio).filter(|r| *r >= 0.0),
        })
        .collect();
    let mut warnings = Vec::new();
    let queues: Vec<QueueCheck> = storage
        .queues
        .into_iter()
        .map(|q| {
            let broker = q
                .partition
                .rsplit_once(':')
                .map(|(b, _)| b.to_owned())
                .unwrap_or_default();
            let ours = view.iter().find(|p| p.partition == q.partition);
            let watermarks = ours.map(|p| p.watermarks.clone()).unwrap_or_default();
            let queue_cursors: BTreeMap<String, i64> = cursors
                .iter()
                .filter(|((_, partition), _)| *partition == q.partition)
                .map(|((group, _), next)| (group.clone(), *next))
                .collect();
            let check = QueueCheck {
                partition: q.partition,
                broker,
                min_offset: q.min_offset,
                max_offset: q.max_offset,
                min_entry_commit_log_offset: known(q.min_entry_commit_log_offset),
                watermarks,
                cursors: queue_cursors,
            };
            warnings.extend(queue_warnings(&check, &brokers));
            check
        })
        .collect();
    Check {
        topic: topic.to_owned(),
        backend: storage.backend,
        brokers,
        queues,
        warnings,
    }
}

fn queue_warnings(queue: &QueueCheck, brokers: &[BrokerCheck]) -> Vec<String> {
    let mut warnings = Vec::new();
    let broker = brokers.iter().find(|b| b.broker == queue.broker);
    if let (Some(broker), Some(position)) = (broker, queue.min_entry_commit_log_offset)
        && position < broker.commit_log_min_offset
    {
        warnings.push(format!(
            "consume queue {} is not trimmed in step with the commit log: its lowest entry \
             (offset {}) points at commit-log offset {position}, below {}'s lowest kept {} — \
             those messages' bodies are gone",
            queue.partition, queue.min_offset, broker.broker, broker.commit_log_min_offset
        ));
    }
    for (group, watermark) in &queue.watermarks {
        if watermark + 1 < queue.min_offset {
            warnings.push(format!(
                "group {group} on {}: offsets {} to {} were deleted by retention before the group \
                 ACKed them (watermark {watermark}, the queue now starts at {})",
                queue.partition,
                watermark + 1,
                queue.min_offset - 1,
                queue.min_offset
            ));
        }
    }
    for (group, next) in &queue.cursors {
        if *next > queue.max_offset {
            warnings.push(format!(
                "group {group}'s cursor on {} is at {next}, past the queue's end {} (the topic \
                 was recreated or the broker lost messages)",
                queue.partition, queue.max_offset
            ));
        }
    }
    warnings
}

fn print_table(check: &Check) {
    println!("topic {} on {}", check.topic, check.backend);
    for broker in &check.brokers {
        let reserved = broker
            .file_reserved_hours
            .map_or("unknown".to_owned(), |h| format!("{h} h"));
        let disk = broker
            .commit_log_disk_ratio
            .map_or("unknown".to_owned(), |r| format!("{:.1} %", r * 100.0));
        println!(
            "  broker {} ({})  commit log [{}, {})  fileReservedTime {reserved}  deleteWhen {}  disk used {disk}",
            broker.broker,
            broker.address,
            broker.commit_log_min_offset,
            broker.commit_log_max_offset,
            broker.delete_when.as_deref().unwrap_or("unknown"),
        );
    }
    for queue in &check.queues {
        let trimmed = match queue.min_entry_commit_log_offset {
            None => "empty".to_owned(),
            Some(position) => {
                let in_step = check
                    .brokers
                    .iter()
                    .find(|b| b.broker == queue.broker)
                    .is_none_or(|b| position >= b.commit_log_min_offset);
                format!(
                    "lowest entry at commit log {position}: {}",
                    if in_step { "in step" } else { "NOT in step" }
                )
            }
        };
        println!(
            "  queue {:<24} consume queue [{}, {})  {trimmed}",
            queue.partition, queue.min_offset, queue.max_offset
        );
        for (group, watermark) in &queue.watermarks {
            let cursor = queue
                .cursors
                .get(group)
                .map_or("-".to_owned(), |c| c.to_string());
            println!(
                "    group {group:<24} watermark {watermark:>10}  cursor {cursor:>10}  lag {}",
                lag(queue.min_offset, queue.max_offset, Some(*watermark))
            );
        }
    }
    if check.warnings.is_empty() {
        println!("no warnings");
    }
    for warning in &check.warnings {
        println!("WARNING: {warning}");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn broker(min: i64) -> puller_pb::BrokerStorage {
        puller_pb::BrokerStorage {
            broker: "broker-a".into(),
            address: "127.0.0.1:10911".into(),
            commit_log_min_offset: min,
            commit_log_max_offset: 1 << 30,
            file_reserved_hours: 72,
            delete_when: "04".into(),
            commit_log_disk_ratio: 0.5,
        }
    }

    fn queue(min: i64, max: i64, position: i64) -> puller_pb::QueueStorage {
        puller_pb::QueueStorage {
            partition: "broker-a:0".into(),
            min_offset: min,
            max_offset: max,
            min_entry_commit_log_offset: position,
        }
    }

    fn view(watermark: i64) -> Vec<PartitionView> {
        vec![PartitionView {
            partition: "broker-a:0".into(),
            watermarks: BTreeMap::from([("g".to_owned(), watermark)]),
            ..PartitionView::default()
        }]
    }

    fn check(clmin: i64, q: puller_pb::QueueStorage, watermark: i64, cursor: i64) -> Vec<String> {
        let storage = puller_pb::DescribeBrokerStorageResponse {
            backend: "rocketmq4".into(),
            brokers: vec![broker(clmin)],
            queues: vec![q],
        };
        let cursors = BTreeMap::from([(("g".to_owned(), "broker-a:0".to_owned()), cursor)]);
        assemble("t", storage, &view(watermark), &cursors).warnings
    }

    /// Synthetic reports (a broker that deleted commit-log files is not made in a test): what
    /// each condition looks like, and a healthy report without warnings.
    #[test]
    fn warnings_name_each_condition_on_synthetic_reports() {
        assert!(check(1_000, queue(10, 20, 1_000), 9, 20).is_empty());
        // An empty queue has no entry to place.
        assert!(check(1_000, queue(20, 20, -1), 19, 20).is_empty());

        let not_in_step = check(5_000, queue(10, 20, 4_000), 15, 16);
        assert_eq!(not_in_step.len(), 1, "{not_in_step:?}");
        assert!(
            not_in_step[0].contains("not trimmed in step"),
            "{not_in_step:?}"
        );
        assert!(not_in_step[0].contains("4000") && not_in_step[0].contains("5000"));

        let lost = check(0, queue(10, 20, 0), 5, 11);
        assert_eq!(lost.len(), 1, "{lost:?}");
        assert!(lost[0].contains("offsets 6 to 9 were deleted"), "{lost:?}");
        // A watermark just below the start lost nothing.
        assert!(check(0, queue(10, 20, 0), 9, 11).is_empty());

        let past_end = check(0, queue(0, 20, 0), 19, 25);
        assert_eq!(past_end.len(), 1, "{past_end:?}");
        assert!(
            past_end[0].contains("past the queue's end 20"),
            "{past_end:?}"
        );
    }
}

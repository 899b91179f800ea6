//! `emctl top`: a live view of the subscription groups of one dispatcher-svc — delivery and
//! ACK rates, lag, in-flight, oldest un-ACKed age, redeliveries, NACKs and dead letters —
//! refreshed every interval. Everything comes from the services' own APIs: the groups'
//! reports (`DescribeGroups`, refreshed by each group twice a second) and the partitions' ends
//! (puller-svc `EndOffsets`) for lag. Rates are counter differences between two frames.

use std::collections::{BTreeMap, HashMap};
use std::io::Write;
use std::time::Duration;

use anyhow::Context;
use clap::Args;
use eventmesh_proto::client as pb;
use eventmesh_proto::client::admin_service_client::AdminServiceClient;
use eventmesh_proto::puller as puller_pb;
use eventmesh_proto::puller::puller_service_client::PullerServiceClient;
use tonic::transport::Channel;

use crate::offsets::{DEFAULT_GROUP, lag};

#[derive(Debug, Args)]
pub struct TopArgs {
    /// The dispatcher-svc whose groups are shown.
    #[arg(long, env = "EMCTL_ENDPOINT", default_value = eventmesh_client::DEFAULT_ENDPOINT)]
    endpoint: String,
    /// puller-svc's gRPC address, for the partitions' ends (lag).
    #[arg(long, env = "EMCTL_PULLER", default_value = "http://127.0.0.1:50052")]
    puller: String,
    /// Only this topic's groups.
    #[arg(long, default_value = "")]
    topic: String,
    /// Refresh interval in milliseconds.
    #[arg(long, default_value_t = 1000, value_parser = clap::value_parser!(u64).range(100..))]
    interval_ms: u64,
    /// Frames to show, then exit (0: until Ctrl-C).
    #[arg(long, default_value_t = 0)]
    count: u64,
    /// One JSON object per frame and line instead of a refreshing table.
    #[arg(long)]
    json: bool,
}

/// One group in one frame.
#[derive(Debug, Clone, serde::Serialize)]
struct GroupRow {
    topic: String,
    group: String,
    sessions: u32,
    /// Deliveries and ACKs per second since the previous frame (absent in the first).
    delivered_per_sec: Option<f64>,
    acked_per_sec: Option<f64>,
    /// Records not yet durably ACKed, over the group's partitions (absent when puller-svc
    /// could not be read).
    lag: Option<i64>,
    in_flight: u64,
    ready: u64,
    backoff: u64,
    settling: u64,
    oldest_unacked_ms: u64,
    delivered_total: u64,
    acked_total: u64,
    nacked_total: u64,
    redelivered_total: u64,
    timed_out_total: u64,
    dead_lettered_total: u64,
    reported_unix_ms: i64,
}

/// One refresh.
#[derive(Debug, serde::Serialize)]
struct Frame {
    instance_id: String,
    groups: Vec<GroupRow>,
    /// Why lag is missing, when it is.
    #[serde(skip_serializing_if = "Option::is_none")]
    lag_error: Option<String>,
}

/// Shows frames until `count` (or Ctrl-C).
pub async fn run(args: TopArgs) -> anyhow::Result<()> {
    let mut admin = AdminServiceClient::connect(args.endpoint.clone())
        .await
        .with_context(|| format!("connecting to dispatcher-svc at {}", args.endpoint))?;
    // Lazy: lag is shown when puller-svc answers, and the rest either way.
    let puller = Channel::from_shared(args.puller.clone())
        .with_context(|| format!("invalid puller-svc address {:?}", args.puller))?
        .connect_lazy();
    let mut puller = PullerServiceClient::new(puller);
    let mut previous: HashMap<(String, String), GroupRow> = HashMap::new();
    let mut ticker = tokio::time::interval(Duration::from_millis(args.interval_ms));
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut shown = 0u64;
    loop {
        ticker.tick().await;
        let frame = frame(&mut admin, &mut puller, &args.topic, &previous).await?;
        let mut stdout = std::io::stdout().lock();
        if args.json {
            writeln!(stdout, "{}", serde_json::to_string(&frame)?)?;
        } else {
            // Home the cursor and clear the screen, then the table.
            write!(stdout, "\x1b[H\x1b[2J{}", render(&frame))?;
        }
        stdout.flush()?;
        drop(stdout);
        previous = frame
            .groups
            .into_iter()
            .map(|row| ((row.topic.clone(), row.group.clone()), row))
            .collect();
        shown += 1;
        if args.count != 0 && shown >= args.count {
            return Ok(());
        }
    }
}

async fn frame(
    admin: &mut AdminServiceClient<Channel>,
    puller: &mut PullerServiceClient<Channel>,
    topic: &str,
    previous: &HashMap<(String, String), GroupRow>,
) -> anyhow::Result<Frame> {
    let described = admin
        .describe_groups(pb::DescribeGroupsRequest {
            topic: topic.to_owned(),
        })
        .await
        .context("DescribeGroups")?
        .into_inner();
    // Each topic's partition ranges, read once per frame.
    let mut ends: BTreeMap<String, HashMap<String, (i64, i64)>> = BTreeMap::new();
    let mut lag_error = None;
    for group in &described.groups {
        if ends.contains_key(&group.topic) || lag_error.is_some() {
            continue;
        }
        match puller
            .end_offsets(puller_pb::EndOffsetsRequest {
                topic: group.topic.clone(),
            })
            .await
        {
            Ok(answer) => {
                let ranges = answer
                    .into_inner()
                    .partitions
                    .into_iter()
                    .map(|p| (p.partition, (p.start, p.end)))
                    .collect();
                ends.insert(group.topic.clone(), ranges);
            }
            Err(status) => {
                lag_error = Some(format!(
                    "puller-svc: {}: {}",
                    status.code(),
                    status.message()
                ))
            }
        }
    }
    let groups = described
        .groups
        .into_iter()
        .map(|group| {
            let lag = ends
                .get(&group.topic)
                .map(|ranges| group_lag(&group, ranges));
            row(group, lag, previous)
        })
        .collect();
    Ok(Frame {
        instance_id: described.instance_id,
        groups,
        lag_error,
    })
}

/// Records of the topic not yet durably ACKed by the group: every partition's lag against the
/// group's durable watermark (a partition the group has not reached counts whole).
fn group_lag(group: &pb::GroupStatus, ranges: &HashMap<String, (i64, i64)>) -> i64 {
    let watermarks: HashMap<&str, i64> = group
        .partitions
        .iter()
        .map(|p| (p.partition.as_str(), p.durable_watermark))
        .collect();
    ranges
        .iter()
        .map(|(partition, (start, end))| {
            lag(*start, *end, watermarks.get(partition.as_str()).copied())
        })
        .sum()
}

fn row(
    group: pb::GroupStatus,
    lag: Option<i64>,
    previous: &HashMap<(String, String), GroupRow>,
) -> GroupRow {
    let name = if group.group.is_empty() {
        DEFAULT_GROUP.to_owned()
    } else {
        group.group
    };
    let before = previous.get(&(group.topic.clone(), name.clone()));
    // Per second between the two reports; none when the group did not report again since.
    let rate = |now: u64, then: fn(&GroupRow) -> u64| {
        let before = before?;
        let millis = group.reported_unix_ms - before.reported_unix_ms;
        (millis > 0 && now >= then(before))
            .then(|| (now - then(before)) as f64 * 1000.0 / millis as f64)
    };
    GroupRow {
        delivered_per_sec: rate(group.delivered_total, |r| r.delivered_total),
        acked_per_sec: rate(group.acked_total, |r| r.acked_total),
        topic: group.topic,
        group: name,
        sessions: group.sessions,
        lag,
        in_flight: group.in_flight,
        ready: group.ready,
        backoff: group.backoff,
        settling: group.settling,
        oldest_unacked_ms: group.oldest_unacked_ms,
        delivered_total: group.delivered_total,
        acked_total: group.acked_total,
        nacked_total: group.nacked_total,
        redelivered_total: group.redelivered_total,
        timed_out_total: group.timed_out_total,
        dead_lettered_total: group.dead_lettered_total,
        reported_unix_ms: group.reported_unix_ms,
    }
}

/// The table of a frame.
fn render(frame: &Frame) -> String {
    let mut out = format!(
        "emctl top — instance {}, {} group(s)\n\n",
        frame.instance_id,
        frame.groups.len()
    );
    if let Some(error) = &frame.lag_error {
        out.push_str(&format!("lag unknown: {error}\n\n"));
    }
    out.push_str(&format!(
        "{:<20} {:<20} {:>4} {:>10} {:>10} {:>10} {:>9} {:>7} {:>7} {:>9} {:>9} {:>7} {:>6}\n",
        "TOPIC",
        "GROUP",
        "SESS",
        "DELIV/s",
        "ACK/s",
        "LAG",
        "IN-FLIGHT",
        "READY",
        "BACKOFF",
        "OLDEST",
        "REDELIV",
        "NACK",
        "DLQ"
    ));
    let rate = |value: Option<f64>| value.map_or_else(|| "-".to_owned(), |v| format!("{v:.0}"));
    for row in &frame.groups {
        out.push_str(&format!(
            "{:<20} {:<20} {:>4} {:>10} {:>10} {:>10} {:>9} {:>7} {:>7} {:>9} {:>9} {:>7} {:>6}\n",
            clip(&row.topic),
            clip(&row.group),
            row.sessions,
            rate(row.delivered_per_sec),
            rate(row.acked_per_sec),
            row.lag
                .map_or_else(|| "?".to_owned(), |lag| lag.to_string()),
            row.in_flight,
            row.ready,
            row.backoff,
            age(row.oldest_unacked_ms),
            row.redelivered_total,
            row.nacked_total,
            row.dead_lettered_total,
        ));
    }
    out
}

/// A name cut to its column (20), marked when cut.
fn clip(name: &str) -> String {
    if name.chars().count() <= 20 {
        return name.to_owned();
    }
    let kept: String = name.chars().take(19).collect();
    format!("{kept}…")
}

/// A duration for the OLDEST column.
fn age(millis: u64) -> String {
    match millis {
        0 => "-".to_owned(),
        1..=9_999 => format!("{millis}ms"),
        10_000..=599_999 => format!("{}s", millis / 1000),
        _ => format!("{}m", millis / 60_000),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn status(delivered: u64, acked: u64, at: i64) -> pb::GroupStatus {
        pb::GroupStatus {
            topic: "orders".into(),
            group: String::new(),
            sessions: 1,
            delivered_total: delivered,
            acked_total: acked,
            reported_unix_ms: at,
            partitions: vec![
                pb::PartitionProgress {
                    partition: "0".into(),
                    durable_watermark: 4,
                },
                pb::PartitionProgress {
                    partition: "1".into(),
                    durable_watermark: -1,
                },
            ],
            ..pb::GroupStatus::default()
        }
    }

    #[test]
    fn rates_come_from_two_reports_and_lag_from_the_watermarks() {
        let first = row(status(100, 90, 1_000), Some(3), &HashMap::new());
        assert_eq!(first.group, DEFAULT_GROUP);
        assert_eq!(first.delivered_per_sec, None);
        let previous = HashMap::from([(("orders".to_owned(), DEFAULT_GROUP.to_owned()), first)]);
        let second = row(status(300, 290, 1_500), None, &previous);
        assert_eq!(second.delivered_per_sec, Some(400.0));
        assert_eq!(second.acked_per_sec, Some(400.0));
        // No new report since: no rate rather than a made-up zero.
        let same = row(status(300, 290, 1_000), None, &previous);
        assert_eq!(same.delivered_per_sec, None);

        // Partition 0 ends at 10 (watermark 4: 5 left), partition 1 at 3 from 0 (nothing
        // durable: 3 left), partition 2 is new to the group (2 retained: 2 left).
        let ranges = HashMap::from([
            ("0".to_owned(), (0, 10)),
            ("1".to_owned(), (0, 3)),
            ("2".to_owned(), (5, 7)),
        ]);
        assert_eq!(group_lag(&status(0, 0, 0), &ranges), 10);
    }

    #[test]
    fn the_table_shows_unknowns_and_ages() {
        let frame = Frame {
            instance_id: "i-1".into(),
            groups: vec![row(status(1, 1, 1), None, &HashMap::new())],
            lag_error: Some("puller-svc: Unavailable: down".into()),
        };
        let table = render(&frame);
        assert!(table.contains("lag unknown: puller-svc"), "{table}");
        let line = table.lines().last().unwrap_or_default();
        assert!(line.starts_with("orders"), "{table}");
        assert!(line.contains(" ? "), "{table}");
        assert_eq!(age(0), "-");
        assert_eq!(age(1500), "1500ms");
        assert_eq!(age(42_000), "42s");
        assert_eq!(age(3_600_000), "60m");
        assert_eq!(clip(&"x".repeat(30)).chars().count(), 20);
    }
}

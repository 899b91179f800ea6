//! `emctl offsets` and `emctl reset-offsets`: what offset-svc stores for a topic next to what
//! the MQ holds, and the operator's reset.

use std::collections::BTreeMap;
use std::io::{BufRead, Write};

use anyhow::{Context, bail};
use clap::Args;
use eventmesh_proto::offset as offset_pb;
use eventmesh_proto::offset::offset_service_client::OffsetServiceClient;
use eventmesh_proto::puller as puller_pb;
use eventmesh_proto::puller::puller_service_client::PullerServiceClient;

/// Where offset-svc and puller-svc listen.
#[derive(Debug, Clone, Args)]
pub struct Services {
    /// offset-svc's gRPC address.
    #[arg(
        long,
        env = "EMCTL_OFFSET_SVC",
        default_value = "http://127.0.0.1:50053"
    )]
    pub offset_svc: String,
    /// puller-svc's gRPC address.
    #[arg(long, env = "EMCTL_PULLER", default_value = "http://127.0.0.1:50052")]
    pub puller: String,
}

/// A command that reports on one topic (`offsets`, `rocketmq-check`).
#[derive(Debug, Args)]
pub struct TopicReportArgs {
    #[command(flatten)]
    pub services: Services,
    /// The topic.
    #[arg(long)]
    pub topic: String,
    /// Print JSON instead of a table.
    #[arg(long)]
    pub json: bool,
}

/// One partition's view.
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct PartitionView {
    pub partition: String,
    /// Oldest retained offset.
    pub start: i64,
    /// The offset the next record gets.
    pub end: i64,
    /// Group watermarks (highest offset with everything at or below ACKed), by group
    /// (`(default)` for the topic's default group).
    pub watermarks: BTreeMap<String, i64>,
    /// Per-client offsets.
    pub clients: BTreeMap<String, i64>,
    /// Per group: offsets retention removed before the group delivered them (events lost to
    /// retention, counted by the dispatcher; absent: none).
    pub lost_to_retention: BTreeMap<String, i64>,
}

impl PartitionView {
    /// Records not yet ACKed by a group: `end - 1 - watermark` (everything retained when the
    /// group has no watermark).
    pub fn lag(&self, watermark: Option<i64>) -> i64 {
        lag(self.start, self.end, watermark)
    }
}

/// Records of a retained range `[start, end)` not yet ACKed by a group: `end - 1 - watermark`
/// (everything retained when the group has no watermark).
pub fn lag(start: i64, end: i64, watermark: Option<i64>) -> i64 {
    let done = watermark.unwrap_or(start - 1).max(start - 1);
    (end - 1 - done).max(0)
}

pub const DEFAULT_GROUP: &str = "(default)";
const CURSOR_PREFIX: &str = "__mqcursor";
const LOST_PREFIX: &str = "__mqlost";
/// A topic's offsets for thousands of clients exceed tonic's 4 MiB default; offset-svc's own
/// limit is 256 MiB.
const OFFSETS_MESSAGE_LIMIT: usize = 256 * 1024 * 1024;

/// Reads the topic's partitions and stored offsets.
pub async fn topic_view(services: &Services, topic: &str) -> anyhow::Result<Vec<PartitionView>> {
    let mut puller = PullerServiceClient::connect(services.puller.clone())
        .await
        .with_context(|| format!("connecting to puller-svc at {}", services.puller))?;
    let mut offsets = OffsetServiceClient::connect(services.offset_svc.clone())
        .await
        .with_context(|| format!("connecting to offset-svc at {}", services.offset_svc))?
        .max_decoding_message_size(OFFSETS_MESSAGE_LIMIT);
    let ends = puller
        .end_offsets(puller_pb::EndOffsetsRequest {
            topic: topic.to_owned(),
        })
        .await
        .with_context(|| format!("reading end offsets of {topic}"))?
        .into_inner();
    let mut view: BTreeMap<String, PartitionView> = ends
        .partitions
        .into_iter()
        .map(|p| {
            (
                p.partition.clone(),
                PartitionView {
                    partition: p.partition,
                    start: p.start,
                    end: p.end,
                    ..PartitionView::default()
                },
            )
        })
        .collect();
    let stored = offsets
        .read_topic_offsets(offset_pb::ReadTopicOffsetsRequest {
            topic: topic.to_owned(),
            client_id: String::new(),
        })
        .await
        .with_context(|| format!("reading stored offsets of {topic}"))?
        .into_inner();
    for entry in stored.entries {
        let Some(key) = entry.key else { continue };
        let partition = view
            .entry(key.partition.clone())
            .or_insert_with(|| PartitionView {
                partition: key.partition.clone(),
                ..PartitionView::default()
            });
        if let Some(group) = group_of_cursor(&key.client_id) {
            partition.watermarks.insert(group, entry.offset);
        } else if let Some(group) = group_of(LOST_PREFIX, &key.client_id) {
            partition.lost_to_retention.insert(group, entry.offset);
        } else {
            partition.clients.insert(key.client_id, entry.offset);
        }
    }
    Ok(view.into_values().collect())
}

/// `__mqcursor__` → the default group, `__mqcursor@g__` → `g`; other ids are not cursors.
fn group_of_cursor(client_id: &str) -> Option<String> {
    group_of(CURSOR_PREFIX, client_id)
}

/// The group a reserved record id (`<prefix>__` or `<prefix>@<group>__`) belongs to.
fn group_of(prefix: &str, client_id: &str) -> Option<String> {
    let rest = client_id.strip_prefix(prefix)?;
    if rest == "__" {
        return Some(DEFAULT_GROUP.to_owned());
    }
    rest.strip_prefix('@')?
        .strip_suffix("__")
        .map(str::to_owned)
}

/// The reserved client id holding a group's watermark.
pub fn cursor_client(group: &str) -> String {
    if group.is_empty() || group == DEFAULT_GROUP {
        format!("{CURSOR_PREFIX}__")
    } else {
        format!("{CURSOR_PREFIX}@{group}__")
    }
}

pub async fn show(args: TopicReportArgs) -> anyhow::Result<()> {
    let view = topic_view(&args.services, &args.topic).await?;
    if args.json {
        println!("{}", serde_json::to_string_pretty(&view)?);
        return Ok(());
    }
    println!("topic {}", args.topic);
    for partition in &view {
        println!(
            "  partition {:>6}  retained [{}, {})  {} records",
            partition.partition,
            partition.start,
            partition.end,
            partition.end - partition.start
        );
        if partition.watermarks.is_empty() {
            println!("    no group has ACKed anything here");
        }
        for (group, watermark) in &partition.watermarks {
            let lost = match partition.lost_to_retention.get(group) {
                Some(lost) => format!("  lost to retention {lost}"),
                None => String::new(),
            };
            println!(
                "    group  {group:<24} watermark {watermark:>10}  lag {}{lost}",
                partition.lag(Some(*watermark))
            );
        }
        for (client, offset) in &partition.clients {
            println!("    client {client:<24} offset    {offset:>10}");
        }
    }
    Ok(())
}

#[derive(Debug, Args)]
pub struct ResetArgs {
    #[command(flatten)]
    services: Services,
    /// The dispatcher-svc the reset goes through (it ends the groups concerned first, so none
    /// writes over the reset).
    #[arg(long, env = "EMCTL_ENDPOINT", default_value = eventmesh_client::DEFAULT_ENDPOINT)]
    endpoint: String,
    /// Write offset-svc directly, without a dispatcher (only when no dispatcher runs: a live
    /// group would write over the reset).
    #[arg(long)]
    direct: bool,
    /// The topic.
    #[arg(long)]
    topic: String,
    /// Reset a group's watermark (where the group resumes when it is next created; `(default)`
    /// or empty for the topic's default group).
    #[arg(long, conflicts_with = "client_id")]
    group: Option<String>,
    /// Reset one client's offsets instead.
    #[arg(long)]
    client_id: Option<String>,
    /// Only this partition (default: every partition with a stored entry).
    #[arg(long)]
    partition: Option<String>,
    /// The new value: the last offset to count as ACKed (-1: nothing; the group re-reads what
    /// the MQ retains).
    #[arg(long, allow_hyphen_values = true)]
    to: i64,
    /// Why (required; logged by offset-svc with every changed key).
    #[arg(long)]
    reason: String,
    /// Do not ask for confirmation.
    #[arg(long, short = 'y')]
    yes: bool,
}

pub async fn reset(args: ResetArgs) -> anyhow::Result<()> {
    if args.to < -1 {
        bail!("--to must be -1 or more, not {}", args.to);
    }
    if args.reason.trim().is_empty() {
        bail!("--reason must say why");
    }
    let client_id = match (&args.group, &args.client_id) {
        (_, Some(client)) => client.clone(),
        (Some(group), None) => cursor_client(group),
        (None, None) => bail!("name what to reset: --group G or --client-id C"),
    };
    let view = topic_view(&args.services, &args.topic).await?;
    let mut changes = Vec::new();
    for partition in &view {
        if args
            .partition
            .as_ref()
            .is_some_and(|p| *p != partition.partition)
        {
            continue;
        }
        let current = match group_of_cursor(&client_id) {
            Some(group) => partition.watermarks.get(&group).copied(),
            None => partition.clients.get(&client_id).copied(),
        };
        if current.is_some() || args.partition.is_some() {
            changes.push((partition.partition.clone(), current.unwrap_or(-1)));
        }
    }
    if changes.is_empty() {
        bail!(
            "nothing stored for {client_id} on topic {} (name --partition to create an entry)",
            args.topic
        );
    }
    println!("topic {}, {client_id}:", args.topic);
    for (partition, current) in &changes {
        println!("  partition {partition}: {current} -> {}", args.to);
    }
    if args.direct {
        println!(
            "--direct: offset-svc is written without a dispatcher; a dispatcher serving these groups would write over it."
        );
    } else {
        println!(
            "Through the dispatcher at {}: the groups concerned end first (their sessions reconnect) and start again from the new values.",
            args.endpoint
        );
    }
    if !args.yes && !confirm("apply these changes?")? {
        println!("nothing changed");
        return Ok(());
    }
    let partitions: Vec<String> = changes.into_iter().map(|(p, _)| p).collect();
    if args.direct {
        reset_direct(&args, &client_id, &partitions).await
    } else {
        reset_through_dispatcher(&args, &partitions).await
    }
}

async fn reset_through_dispatcher(args: &ResetArgs, partitions: &[String]) -> anyhow::Result<()> {
    use eventmesh_proto::client as client_pb;
    let mut admin =
        client_pb::admin_service_client::AdminServiceClient::connect(args.endpoint.clone())
            .await
            .with_context(|| {
                format!(
                    "connecting to dispatcher-svc at {} (with no dispatcher running, use --direct)",
                    args.endpoint
                )
            })?;
    let target = match (&args.group, &args.client_id) {
        (_, Some(client)) => client_pb::reset_offsets_request::Target::ClientId(client.clone()),
        (Some(group), None) if group == DEFAULT_GROUP => {
            client_pb::reset_offsets_request::Target::Group(String::new())
        }
        (Some(group), None) => client_pb::reset_offsets_request::Target::Group(group.clone()),
        (None, None) => bail!("name what to reset: --group G or --client-id C"),
    };
    for partition in partitions {
        let answer = admin
            .reset_offsets(client_pb::ResetOffsetsRequest {
                topic: args.topic.clone(),
                target: Some(target.clone()),
                partition: partition.clone(),
                offset: args.to,
                reason: args.reason.clone(),
            })
            .await
            .with_context(|| format!("resetting partition {partition}"))?
            .into_inner();
        for changed in answer.changed {
            println!(
                "  reset partition {}: was {}, now {}",
                changed.partition, changed.previous, changed.offset
            );
        }
        if answer.sessions_ended > 0 {
            println!("  {} sessions told to reconnect", answer.sessions_ended);
        }
    }
    Ok(())
}

async fn reset_direct(
    args: &ResetArgs,
    client_id: &str,
    partitions: &[String],
) -> anyhow::Result<()> {
    let mut offsets = OffsetServiceClient::connect(args.services.offset_svc.clone())
        .await
        .with_context(|| format!("connecting to offset-svc at {}", args.services.offset_svc))?;
    for partition in partitions {
        let answer = offsets
            .reset_offsets(offset_pb::ResetOffsetsRequest {
                selector: Some(offset_pb::OffsetSelector {
                    topic: args.topic.clone(),
                    client_id: client_id.to_owned(),
                    partition: partition.clone(),
                }),
                offset: args.to,
                reason: args.reason.clone(),
            })
            .await
            .with_context(|| format!("resetting partition {partition}"))?
            .into_inner();
        for previous in answer.previous {
            println!(
                "  reset partition {}: was {}, now {}",
                previous.key.map(|k| k.partition).unwrap_or_default(),
                previous.offset,
                args.to
            );
        }
    }
    Ok(())
}

fn confirm(question: &str) -> anyhow::Result<bool> {
    print!("{question} [y/N] ");
    std::io::stdout().flush()?;
    let mut answer = String::new();
    std::io::stdin().lock().read_line(&mut answer)?;
    Ok(matches!(answer.trim(), "y" | "Y" | "yes"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cursor_ids_name_groups_and_round_trip() {
        assert_eq!(
            group_of_cursor("__mqcursor__").as_deref(),
            Some(DEFAULT_GROUP)
        );
        assert_eq!(
            group_of_cursor("__mqcursor@billing__").as_deref(),
            Some("billing")
        );
        assert_eq!(group_of_cursor("app-1"), None);
        assert_eq!(group_of_cursor("__mqlost@billing__"), None);
        assert_eq!(
            group_of(LOST_PREFIX, "__mqlost@billing__").as_deref(),
            Some("billing")
        );
        for group in ["billing", DEFAULT_GROUP] {
            assert_eq!(
                group_of_cursor(&cursor_client(group)).as_deref(),
                Some(group)
            );
        }
    }

    #[test]
    fn lag_counts_what_is_not_acked() {
        let partition = PartitionView {
            start: 0,
            end: 10,
            ..PartitionView::default()
        };
        assert_eq!(partition.lag(Some(9)), 0);
        assert_eq!(partition.lag(Some(4)), 5);
        assert_eq!(partition.lag(None), 10);
        let trimmed = PartitionView {
            start: 5,
            end: 10,
            ..PartitionView::default()
        };
        assert_eq!(trimmed.lag(Some(2)), 5);
    }
}

//! `emctl cluster`: the live instances with the load each reports, and every group's home, as
//! one dispatcher-svc sees them (its watch-fed view of etcd).

use anyhow::Context;
use clap::Args;
use eventmesh_proto::client as pb;
use eventmesh_proto::client::admin_service_client::AdminServiceClient;

#[derive(Debug, Args)]
pub struct ClusterArgs {
    /// The dispatcher-svc to ask (any instance of the cluster).
    #[arg(long, env = "EMCTL_ENDPOINT", default_value = eventmesh_client::DEFAULT_ENDPOINT)]
    endpoint: String,
    /// Print JSON instead of tables.
    #[arg(long)]
    json: bool,
}

#[derive(Debug, serde::Serialize)]
struct Instance<'a> {
    instance_id: &'a str,
    address: &'a str,
    active_sessions: Option<u64>,
    inflow_bytes_per_sec: Option<u64>,
    outflow_bytes_per_sec: Option<u64>,
    cpu_load: Option<f64>,
    reported_unix_ms: i64,
    score: f64,
}

#[derive(Debug, serde::Serialize)]
struct Home<'a> {
    topic: &'a str,
    group: &'a str,
    instance_id: &'a str,
    address: &'a str,
}

/// Prints the cluster.
pub async fn run(args: ClusterArgs) -> anyhow::Result<()> {
    let mut admin = AdminServiceClient::connect(args.endpoint.clone())
        .await
        .with_context(|| format!("connecting to dispatcher-svc at {}", args.endpoint))?;
    let view = admin
        .describe_cluster(pb::DescribeClusterRequest {})
        .await
        .context("DescribeCluster")?
        .into_inner();
    let known = |known: bool, value| known.then_some(value);
    let instances: Vec<Instance<'_>> = view
        .instances
        .iter()
        .map(|i| Instance {
            instance_id: &i.instance_id,
            address: &i.address,
            active_sessions: known(i.load_known, i.active_sessions),
            inflow_bytes_per_sec: known(i.load_known, i.inflow_bytes_per_sec),
            outflow_bytes_per_sec: known(i.load_known, i.outflow_bytes_per_sec),
            cpu_load: i.load_known.then_some(i.cpu_load),
            reported_unix_ms: i.reported_unix_ms,
            score: i.score,
        })
        .collect();
    let homes: Vec<Home<'_>> = view
        .homes
        .iter()
        .map(|h| Home {
            topic: &h.topic,
            group: if h.group.is_empty() {
                "(default)"
            } else {
                &h.group
            },
            instance_id: &h.instance_id,
            address: &h.address,
        })
        .collect();
    if args.json {
        let out = serde_json::json!({
            "answered_by": view.instance_id,
            "clustered": view.clustered,
            "instances": instances,
            "homes": homes,
        });
        println!("{}", serde_json::to_string_pretty(&out)?);
        return Ok(());
    }
    if !view.clustered {
        println!(
            "{} is a single instance (no [cluster] etcd_endpoints configured).",
            view.instance_id
        );
    } else {
        println!("as seen by {}:", view.instance_id);
    }
    println!(
        "{:<24} {:<22} {:>9} {:>12} {:>12} {:>6} {:>9}",
        "INSTANCE", "ADDRESS", "SESSIONS", "IN B/s", "OUT B/s", "CPU", "SCORE"
    );
    let or_dash = |v: Option<u64>| v.map_or_else(|| "-".to_owned(), |v| v.to_string());
    for i in &instances {
        println!(
            "{:<24} {:<22} {:>9} {:>12} {:>12} {:>6} {:>9.1}",
            i.instance_id,
            i.address,
            or_dash(i.active_sessions),
            or_dash(i.inflow_bytes_per_sec),
            or_dash(i.outflow_bytes_per_sec),
            i.cpu_load
                .map_or_else(|| "-".to_owned(), |c| format!("{:.0}%", c * 100.0)),
            i.score
        );
    }
    if view.clustered {
        println!();
        println!("{:<32} {:<24} {:<24}", "TOPIC", "GROUP", "HOME");
        if homes.is_empty() {
            println!("(no group is homed)");
        }
        for h in &homes {
            println!(
                "{:<32} {:<24} {} ({})",
                h.topic, h.group, h.instance_id, h.address
            );
        }
    }
    Ok(())
}

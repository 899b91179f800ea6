//! A tour of offset-svc over gRPC: CAS-max writes, a batch, a group watermark, topic reads.
//! Run by `scripts/run.sh` against a freshly started service.

use clap::Parser;
use eventmesh_proto::offset::offset_service_client::OffsetServiceClient;
use eventmesh_proto::offset::{
    ListTopicsRequest, OffsetEntry, OffsetKey, ReadOffsetRequest, ReadTopicOffsetsRequest,
    WriteOffsetsRequest,
};

#[derive(Parser)]
struct Args {
    /// offset-svc endpoint.
    #[arg(long, default_value = "http://127.0.0.1:50053")]
    endpoint: String,
}

fn key(topic: &str, client: &str, partition: &str) -> OffsetKey {
    OffsetKey {
        topic: topic.into(),
        client_id: client.into(),
        partition: partition.into(),
    }
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let mut client = connect(&args.endpoint).await?;
    let demo = key("demo-orders", "demo-client", "0");

    println!(
        "CAS-max writes to {}#{}#{}:",
        demo.topic, demo.client_id, demo.partition
    );
    for offset in [100, 10, 200, 200] {
        let result = client
            .write_offsets(WriteOffsetsRequest {
                entries: vec![OffsetEntry {
                    key: Some(demo.clone()),
                    offset,
                }],
                sync: false,
            })
            .await?
            .into_inner();
        let r = &result.results[0];
        println!(
            "  write {offset:>4} -> stored {:>4} (advanced: {})",
            r.stored, r.advanced
        );
    }
    let read = client
        .read_offset(ReadOffsetRequest {
            key: Some(demo.clone()),
        })
        .await?
        .into_inner();
    println!("  read -> {}", read.offset);

    let batch: Vec<OffsetEntry> = (0..4)
        .map(|p| OffsetEntry {
            key: Some(key("demo-orders", "__mqcursor__", &p.to_string())),
            offset: 1000 + p,
        })
        .collect();
    client
        .write_offsets(WriteOffsetsRequest {
            entries: batch,
            sync: true,
        })
        .await?;
    println!("\nOne synced batch of group watermarks; every entry of the topic now:");
    let entries = client
        .read_topic_offsets(ReadTopicOffsetsRequest {
            topic: "demo-orders".into(),
            client_id: String::new(),
        })
        .await?
        .into_inner()
        .entries;
    for entry in entries {
        let k = entry.key.unwrap_or_default();
        println!(
            "  {}#{}#{} = {}",
            k.topic, k.client_id, k.partition, entry.offset
        );
    }
    let unknown = client
        .read_offset(ReadOffsetRequest {
            key: Some(key("demo-orders", "never-seen", "0")),
        })
        .await?
        .into_inner();
    println!("\nAn unknown key reads {}", unknown.offset);
    let refused = client
        .write_offsets(WriteOffsetsRequest {
            entries: vec![OffsetEntry {
                key: Some(key("bad#topic", "c", "0")),
                offset: 1,
            }],
            sync: false,
        })
        .await;
    match refused {
        Err(status) => println!(
            "A topic containing '#' is refused: {:?}: {}",
            status.code(),
            status.message()
        ),
        Ok(_) => anyhow::bail!("offset-svc accepted a topic containing '#'"),
    }
    let topics = client
        .list_topics(ListTopicsRequest {})
        .await?
        .into_inner()
        .topics;
    println!("Topics with offsets: {topics:?}");
    Ok(())
}

/// The service may still be opening its database: retry the connection for a few seconds.
async fn connect(endpoint: &str) -> anyhow::Result<OffsetServiceClient<tonic::transport::Channel>> {
    let mut last_error = None;
    for _ in 0..50 {
        match OffsetServiceClient::connect(endpoint.to_owned()).await {
            Ok(client) => return Ok(client),
            Err(err) => last_error = Some(err),
        }
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
    Err(anyhow::anyhow!(
        "cannot reach offset-svc at {endpoint}: {last_error:?}"
    ))
}

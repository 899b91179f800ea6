//! A tour of puller-svc on the local backend next to offset-svc: publish, pull with stamps
//! and ranges, a group watermark in offset-svc, and a dispatcher attach that rewinds the
//! reader to it. Run by `scripts/run.sh` against freshly started services.

use bytes::Bytes;
use clap::Parser;
use eventmesh_common::frame::{Frame, FrameLimits};
use eventmesh_proto::offset::offset_service_client::OffsetServiceClient;
use eventmesh_proto::offset::{OffsetEntry, OffsetKey, WriteOffsetsRequest};
use eventmesh_proto::puller::puller_service_client::PullerServiceClient;
use eventmesh_proto::puller::{self as pb};

#[derive(Parser)]
struct Args {
    /// puller-svc endpoint.
    #[arg(long, default_value = "http://127.0.0.1:50052")]
    puller: String,
    /// offset-svc endpoint.
    #[arg(long, default_value = "http://127.0.0.1:50053")]
    offsets: String,
}

fn reader() -> pb::GroupTopic {
    pb::GroupTopic {
        group: "demo-group".into(),
        topic: "demo-events".into(),
    }
}

/// Attaches the demo's reader (as a dispatcher does when it takes a group); returns the
/// generation its pulls must carry.
async fn attach(
    client: &mut PullerServiceClient<tonic::transport::Channel>,
) -> anyhow::Result<(u64, Vec<pb::Cursor>)> {
    let attached = client
        .attach(pb::AttachRequest {
            dispatcher_id: "demo-dispatcher".into(),
            readers: vec![reader()],
            positions: Vec::new(),
        })
        .await?
        .into_inner();
    let generation = attached
        .generations
        .first()
        .map(|g| g.generation)
        .ok_or_else(|| anyhow::anyhow!("attach answered without a generation"))?;
    Ok((generation, attached.cursors))
}

async fn pull(
    client: &mut PullerServiceClient<tonic::transport::Channel>,
    generation: u64,
) -> anyhow::Result<pb::PullResponse> {
    Ok(client
        .pull(pb::PullRequest {
            reader: Some(reader()),
            max_records: 100,
            generation,
            ..Default::default()
        })
        .await?
        .into_inner())
}

fn show(response: &pb::PullResponse) -> anyhow::Result<()> {
    for record in &response.records {
        let frame = Frame::decode(&record.frame, &FrameLimits::DEFAULT)?;
        println!(
            "  partition {} offset {:>2}: id={} stamped emmqoffset={}",
            record.partition,
            record.offset,
            frame.attribute("id").unwrap_or("?"),
            frame.attribute("emmqoffset").unwrap_or("?"),
        );
    }
    for range in &response.ranges {
        println!(
            "  covered partition {}: [{}, {})",
            range.partition, range.first, range.next
        );
    }
    Ok(())
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let mut puller = connect(&args.puller).await?;
    let created = puller
        .create_topic(pb::CreateTopicRequest {
            topic: "demo-events".into(),
            partitions: 1,
            implicit: false,
        })
        .await?
        .into_inner();
    println!(
        "\nTopic demo-events (created now: {}, partitions: {})",
        created.created, created.partitions
    );
    let start = puller
        .end_offsets(pb::EndOffsetsRequest {
            topic: "demo-events".into(),
        })
        .await?
        .into_inner()
        .partitions[0]
        .end;
    for i in 0..5 {
        let mut frame = Frame::event();
        frame.set_attribute("id", format!("demo-{}", start + i));
        let body = frame.encode(&FrameLimits::DEFAULT)?;
        let at = puller
            .publish(pb::PublishRequest {
                topic: "demo-events".into(),
                body,
                key: Bytes::new(),
                partition: String::new(),
            })
            .await?
            .into_inner();
        println!(
            "published demo-{} at partition {} offset {}",
            start + i,
            at.partition,
            at.offset
        );
    }
    println!("\nGroup demo-group pulls:");
    let (generation, _) = attach(&mut puller).await?;
    show(&pull(&mut puller, generation).await?)?;

    let watermark = start + 1;
    println!(
        "\nThe dispatcher settled offsets up to {watermark} only, then restarted and re-attached:"
    );
    OffsetServiceClient::new(
        tonic::transport::Endpoint::from_shared(args.offsets)?
            .connect()
            .await?,
    )
    .write_offsets(WriteOffsetsRequest {
        entries: vec![OffsetEntry {
            key: Some(OffsetKey {
                topic: "demo-events".into(),
                client_id: "__mqcursor@demo-group__".into(),
                partition: "0".into(),
            }),
            offset: watermark,
        }],
        sync: true,
    })
    .await?;
    let (generation, cursors) = attach(&mut puller).await?;
    for cursor in &cursors {
        println!(
            "  cursor of partition {} rewound to {}",
            cursor.partition, cursor.next_offset
        );
    }
    println!("Pulled again (nothing un-ACKed is skipped):");
    show(&pull(&mut puller, generation).await?)?;
    Ok(())
}

/// The service may still be starting: retry the connection for a few seconds.
async fn connect(endpoint: &str) -> anyhow::Result<PullerServiceClient<tonic::transport::Channel>> {
    let mut last_error = None;
    for _ in 0..50 {
        match PullerServiceClient::connect(endpoint.to_owned()).await {
            Ok(client) => return Ok(client),
            Err(err) => last_error = Some(err),
        }
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
    Err(anyhow::anyhow!(
        "cannot reach puller-svc at {endpoint}: {last_error:?}"
    ))
}

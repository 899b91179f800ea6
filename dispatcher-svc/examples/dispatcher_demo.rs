//! Shows the client API of a running instance: publishes a few events, subscribes, ACKs
//! them, and prints the ACK results and the group's stored watermark.
//!
//! `cargo run --example dispatcher_demo -- --dispatcher http://127.0.0.1:50051 --offsets http://127.0.0.1:50053`

use std::time::Duration;

use anyhow::{Context, bail};
use eventmesh_proto::SubscribeItem;
use eventmesh_proto::client as pb;
use eventmesh_proto::client::event_mesh_service_client::EventMeshServiceClient;
use eventmesh_proto::client::subscribe_request;
use eventmesh_proto::offset::ReadTopicOffsetsRequest;
use eventmesh_proto::offset::offset_service_client::OffsetServiceClient;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;

fn flag(name: &str, default: &str) -> String {
    let args: Vec<String> = std::env::args().collect();
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1).cloned())
        .unwrap_or_else(|| default.to_owned())
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let dispatcher = flag("--dispatcher", "http://127.0.0.1:50051");
    let offsets = flag("--offsets", "http://127.0.0.1:50053");
    let topic = "demo-orders";
    let mut client = EventMeshServiceClient::connect(dispatcher.clone())
        .await
        .with_context(|| format!("connecting to dispatcher-svc at {dispatcher}"))?;
    let (tx, rx) = mpsc::channel(16);
    tx.send(pb::SubscribeRequest {
        kind: Some(subscribe_request::Kind::Open(pb::Open {
            client_id: "demo-app".into(),
            topic: topic.into(),
            group: "demo".into(),
            ..pb::Open::default()
        })),
    })
    .await?;
    let mut stream = client
        .subscribe(ReceiverStream::new(rx))
        .await?
        .into_inner();
    println!("subscribed: {:?}", stream.message().await?);
    for n in 0..5 {
        let stored = client
            .publish(pb::PublishRequest {
                topic: topic.into(),
                event: Some(pb::Event {
                    source: "/demo".into(),
                    r#type: "order.created".into(),
                    data: format!("order {n}").into_bytes().into(),
                    ..pb::Event::default()
                }),
                key: format!("customer-{n}"),
            })
            .await?
            .into_inner();
        println!(
            "published event {} -> partition {} offset {}",
            stored.event_id, stored.partition, stored.offset
        );
    }
    let mut acked = 0;
    while acked < 5 {
        let message = tokio::time::timeout(Duration::from_secs(10), stream.message())
            .await
            .context("no delivery within 10 s")??
            .context("stream ended")?;
        for item in message.into_items() {
            match item {
                SubscribeItem::Delivery(d) => {
                    let data = d
                        .event
                        .map(|e| String::from_utf8_lossy(&e.data).into_owned())
                        .unwrap_or_default();
                    println!(
                        "delivered {} (attempt {}, partition {} offset {}): {data}",
                        d.delivery_id, d.attempt, d.partition, d.offset
                    );
                    tx.send(pb::SubscribeRequest {
                        kind: Some(subscribe_request::Kind::Ack(pb::Ack {
                            delivery_ids: vec![d.delivery_id],
                        })),
                    })
                    .await?;
                }
                SubscribeItem::AckResult(r) => {
                    println!("ack {} -> {:?}", r.delivery_id, r.outcome());
                    if r.outcome() == pb::AckOutcome::Durable {
                        acked += 1;
                    }
                }
                other => bail!("unexpected {other:?}"),
            }
        }
    }
    let stored = OffsetServiceClient::connect(offsets)
        .await?
        .read_topic_offsets(ReadTopicOffsetsRequest {
            topic: topic.into(),
            client_id: "__mqcursor@demo__".into(),
        })
        .await?
        .into_inner();
    for entry in stored.entries {
        let key = entry.key.unwrap_or_default();
        println!(
            "group watermark {}#{}#{} = {}",
            key.topic, key.client_id, key.partition, entry.offset
        );
    }
    Ok(())
}

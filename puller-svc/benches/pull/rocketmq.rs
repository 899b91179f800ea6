//! The RocketMQ part of the pull benchmark: both backends through puller-svc against the
//! client's own loops on the same broker, rounds alternated.
//!
//! * `rocketmq4`: the client's classic pull (`DefaultMQPullConsumer`, 32 per pull, the
//!   broker's cap) over every queue, against puller-svc's gRPC `Pull` (1,000 per call).
//! * `rocketmq5`: the client's own POP-and-ACK loop — `pop_message` one message per POP (a POP
//!   of several from one queue breaks its parsing) and one `ack_message` per message — against
//!   puller-svc's `Pull` plus one `AckPulled` per batch (our raw POP takes up to 32 per call).
//!   The difference is what one message per POP costs.

#![allow(deprecated)] // the classic pull consumer, as the rocketmq4 backend uses it

use std::sync::Arc;
use std::time::{Duration, Instant};

use cheetah_string::CheetahString;
use eventmesh_common::keys::Topic;
use puller_svc::cursors::StartAt;
use puller_svc::storage::rocketmq::client::{RocketMqClient, RocketMqSettings};
use puller_svc::storage::rocketmq4::RocketMq4Storage;
use puller_svc::storage::rocketmq5::{PopSettings, RocketMq5Storage, pop_request};
use puller_svc::storage::{NewRecord, Storage};
use rocketmq_client_rust::{DefaultMQPullConsumer, MessageSelector, PullOptions};
use rocketmq_model::common::message::MessageConst;
use rocketmq_model::common::message::MessageTrait;
use rocketmq_protocol::protocol::header::ack_message_request_header::AckMessageRequestHeader;

use super::{Run, body, median, support, through_puller};

const QUEUES: u32 = 4;
const TIMEOUT: Duration = Duration::from_secs(30);

/// Publishes `n` records of `size` through the backend's batch send; the queues' offsets.
async fn publish(storage: &dyn Storage, topic: &Topic, n: usize, size: usize) -> Vec<(u32, i64)> {
    for chunk in (0..n).collect::<Vec<_>>().chunks(2_000) {
        let records = chunk
            .iter()
            .map(|&i| NewRecord {
                key: bytes::Bytes::new(),
                body: body(i, size),
                partition: None,
            })
            .collect();
        for answer in storage.send_batch(topic, records).await.unwrap() {
            answer.unwrap();
        }
    }
    storage
        .end_offsets(topic)
        .await
        .unwrap()
        .into_iter()
        .map(|range| {
            let queue = range
                .partition
                .as_str()
                .rsplit_once(':')
                .and_then(|(_, q)| q.parse().ok())
                .unwrap();
            (queue, range.end)
        })
        .collect()
}

/// The client's own classic pull over every queue, 32 at a time.
async fn raw_pull(client: &Arc<RocketMqClient>, topic: &Topic, ends: &[(u32, i64)]) -> Run {
    let consumer = DefaultMQPullConsumer::builder(client.runtime())
        .name_server_addr(client.namesrv())
        .consumer_group(format!("bench-raw-pull-{}", std::process::id()))
        .build()
        .unwrap();
    let (records, bytes, elapsed) = {
        let (consumer, topic, ends) = (consumer.clone(), topic.to_string(), ends.to_vec());
        client
            .call("bench pull", TIMEOUT * 20, async move {
                consumer.start().await.unwrap();
                let (mut records, mut bytes) = (0usize, 0usize);
                let start = Instant::now();
                for (queue, end) in ends {
                    let mq =
                        rocketmq_model::common::message::message_queue::MessageQueue::from_parts(
                            topic.as_str(),
                            "broker-a",
                            queue as i32,
                        );
                    let mut offset = 0;
                    while offset < end {
                        let options =
                            PullOptions::new(mq.clone(), MessageSelector::by_tag("*"), offset, 32)
                                .unwrap()
                                .timeout(Duration::from_secs(3));
                        let result = consumer.pull_with_options(options).await.unwrap();
                        for message in result.msg_found_list().unwrap_or_default() {
                            bytes += message.body().map_or(0, |b| b.len());
                            records += 1;
                        }
                        offset = result.next_begin_offset() as i64;
                    }
                }
                Ok((records, bytes, start.elapsed()))
            })
            .await
            .unwrap()
    };
    Run {
        name: "raw client PULL (DefaultMQPullConsumer, 32 per pull)",
        records,
        bytes,
        elapsed,
        latencies: Vec::new(),
    }
}

/// The client's own POP-and-ACK loop: one message per POP, one ACK per message.
async fn raw_pop_and_ack(client: &Arc<RocketMqClient>, topic: &Topic, ends: &[(u32, i64)]) -> Run {
    let handle = client.handle().await.unwrap();
    let route = client.route(topic).await.unwrap();
    let addr: CheetahString = route.master("broker-a").unwrap().into();
    let group = format!("bench-raw-pop-{}-{}", std::process::id(), rand_suffix());
    let (topic, ends) = (topic.to_string(), ends.to_vec());
    let (records, bytes, elapsed) = client
        .call("bench pop", TIMEOUT * 20, async move {
            let broker: CheetahString = "broker-a".into();
            let header = |queue: u32| {
                pop_request(
                    &group,
                    &topic,
                    "broker-a",
                    queue,
                    1,
                    Duration::from_secs(60),
                )
            };
            let (mut records, mut bytes) = (0usize, 0usize);
            let start = Instant::now();
            for (queue, end) in ends {
                let mut popped = 0;
                while popped < end {
                    // The client fails to decode an empty POP: counted as empty, asked again.
                    let Ok(result) = handle
                        .pop_message(&broker, &addr, header(queue), 5_000)
                        .await
                    else {
                        continue;
                    };
                    for message in result.msg_found_list.unwrap_or_default() {
                        let receipt = message
                            .property(&CheetahString::from_static_str(
                                MessageConst::PROPERTY_POP_CK,
                            ))
                            .unwrap_or_default();
                        let ack = AckMessageRequestHeader {
                            consumer_group: group.as_str().into(),
                            topic: topic.as_str().into(),
                            queue_id: queue as i32,
                            extra_info: receipt,
                            offset: message.queue_offset(),
                            lite_topic: None,
                            topic_request_header: None,
                        };
                        handle.ack_message(&addr, ack, 5_000).await.unwrap();
                        bytes += message.body().map_or(0, |b| b.len());
                        records += 1;
                        popped += 1;
                    }
                }
            }
            Ok((records, bytes, start.elapsed()))
        })
        .await
        .unwrap();
    Run {
        name: "raw client POP + ACK (1 per POP, 1 ACK per message)",
        records,
        bytes,
        elapsed,
        latencies: Vec::new(),
    }
}

fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

fn rand_suffix() -> u64 {
    now_ms() ^ u64::from(std::process::id())
}

/// Runs both backends, `rounds` alternated rounds each; (raw, through puller-svc) medians per
/// backend.
pub fn runs(
    runtime: &tokio::runtime::Runtime,
    n: usize,
    size: usize,
    rounds: usize,
) -> Vec<(Run, Run)> {
    let rocketmq = eventmesh_testkit::RocketMq::get();
    let namesrv = rocketmq.namesrv().to_owned();
    let data = tempfile::tempdir().unwrap();
    runtime.block_on(async {
        let (offsets, offset_channel) = support::memory_offset_svc().await;
        let settings = RocketMqSettings::new(namesrv.as_str());
        let four: Arc<RocketMq4Storage> = Arc::new(
            RocketMq4Storage::new(settings.clone(), data.path().join("4"), StartAt::Earliest)
                .await
                .unwrap(),
        );
        let five: Arc<RocketMq5Storage> = Arc::new(
            RocketMq5Storage::new(
                settings,
                PopSettings::default(),
                &data.path().join("5"),
                StartAt::Earliest,
            )
            .await
            .unwrap(),
        );
        let topic = Topic::new(format!("bench-rmq-{}", std::process::id())).unwrap();
        four.create_topic(&topic, QUEUES).await.unwrap();
        let started = Instant::now();
        let ends = publish(four.as_ref(), &topic, n, size).await;
        println!(
            "# rocketmq: published {n} records in {:.1} s through the batch send ({:.0}/s)",
            started.elapsed().as_secs_f64(),
            n as f64 / started.elapsed().as_secs_f64()
        );
        let client = Arc::clone(four.client());
        let (server4, mut puller4) = support::puller_over(
            Arc::clone(&four) as Arc<dyn Storage>,
            offset_channel.clone(),
        )
        .await;
        let (server5, mut puller5) =
            support::puller_over(Arc::clone(&five) as Arc<dyn Storage>, offset_channel).await;
        let mut columns: Vec<Vec<Run>> = (0..4).map(|_| Vec::new()).collect();
        const OURS4: &str = "puller-svc gRPC Pull (rocketmq4)";
        const OURS5: &str = "puller-svc gRPC Pull + AckPulled (rocketmq5)";
        for round in 0..rounds {
            let group = format!("bench-{round}");
            // Alternate who goes first.
            let raw_first = round % 2 == 0;
            if raw_first {
                columns[0].push(raw_pull(&client, &topic, &ends).await);
            }
            columns[1].push(through_puller(&mut puller4, OURS4, topic.as_str(), &group, n).await);
            if !raw_first {
                columns[0].push(raw_pull(&client, &topic, &ends).await);
                columns[3]
                    .push(through_puller(&mut puller5, OURS5, topic.as_str(), &group, n).await);
            }
            columns[2].push(raw_pop_and_ack(&client, &topic, &ends).await);
            if raw_first {
                columns[3]
                    .push(through_puller(&mut puller5, OURS5, topic.as_str(), &group, n).await);
            }
        }
        for server in [server4, server5] {
            server.shutdown();
            server.wait().await.unwrap();
        }
        offsets.shutdown();
        offsets.wait().await.unwrap();
        let mut medians = columns.into_iter().map(median);
        let mut pairs = Vec::new();
        while let (Some(raw), Some(ours)) = (medians.next(), medians.next()) {
            pairs.push((raw, ours));
        }
        pairs
    })
}

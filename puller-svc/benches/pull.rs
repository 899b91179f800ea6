//! Pull throughput: records read from Kafka through puller-svc (gRPC `Pull`, 1,000 per call)
//! against direct rdkafka reads of the same topic in the same run; and the local backend's
//! append and pull rates against raw `PartitionLog` appends and reads. Median of
//! `BENCH_ROUNDS` (default 3). Needs tansu (`scripts/kafka.sh install`) or `KAFKA_BOOTSTRAP`.
//!
//! RocketMQ (`rocketmq4` and `rocketmq5` through puller-svc against the client's own pull and
//! POP-and-ACK loops, [`rocketmq`]) needs `scripts/rocketmq.sh install` or `ROCKETMQ_NAMESRV`.
//!
//! `cargo bench -p puller-svc --bench pull` (env: BENCH_RECORDS, BENCH_BODY_BYTES,
//! BENCH_ROUNDS, BENCH_BACKENDS = a comma list of `kafka`, `local`, `rocketmq`, default all;
//! BENCH_ROCKETMQ_RECORDS, default 20,000). Method and latest numbers: docs/BENCHMARKS.md.

#![allow(clippy::unwrap_used)] // a benchmark: a failed unwrap is a failed run
#![recursion_limit = "256"] // the RocketMQ client's futures are deep

#[path = "pull/rocketmq.rs"]
mod rocketmq;
#[path = "../tests/support/mod.rs"]
mod support;

use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use eventmesh_common::frame::{Frame, FrameLimits};
use eventmesh_common::keys::{PartitionId, Topic};
use eventmesh_proto::puller::puller_service_client::PullerServiceClient;
use eventmesh_proto::puller::{self as pb};
use puller_svc::cursors::StartAt;
use puller_svc::local_log::{LogSettings, PartitionLog};
use puller_svc::storage::kafka::KafkaStorage;
use puller_svc::storage::local::LocalStorage;
use puller_svc::storage::{PollLimits, ReaderKey, Selection, Storage};
use rdkafka::config::ClientConfig;
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::producer::{FutureProducer, FutureRecord};
use rdkafka::{Offset, TopicPartitionList};

const PARTITIONS: i32 = 4;
const KAFKA_PULL: &str = "puller-svc gRPC Pull (kafka backend)";

fn env_usize(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

struct Run {
    name: &'static str,
    records: usize,
    bytes: usize,
    elapsed: Duration,
    latencies: Vec<Duration>,
}

impl Run {
    fn per_sec(&self) -> f64 {
        self.records as f64 / self.elapsed.as_secs_f64()
    }
    fn mb_per_sec(&self) -> f64 {
        self.bytes as f64 / self.elapsed.as_secs_f64() / 1e6
    }
    fn percentile(&self, p: f64) -> String {
        if self.latencies.is_empty() {
            return "–".into();
        }
        let mut sorted = self.latencies.clone();
        sorted.sort_unstable();
        let at = sorted[((sorted.len() - 1) as f64 * p).round() as usize];
        format!("{:.2} ms", at.as_secs_f64() * 1e3)
    }
}

fn median(mut runs: Vec<Run>) -> Run {
    runs.sort_by(|a, b| a.per_sec().total_cmp(&b.per_sec()));
    let middle = runs.len() / 2;
    runs.swap_remove(middle)
}

fn body(i: usize, size: usize) -> Bytes {
    let mut frame = Frame::event();
    frame.set_attribute("id", i.to_string());
    let overhead = frame.encoded_len();
    frame.data = Bytes::from(vec![b'x'; size.saturating_sub(overhead)]);
    frame.encode(&FrameLimits::DEFAULT).unwrap()
}

async fn produce(bootstrap: &str, topic: &str, n: usize, size: usize) {
    let producer: FutureProducer = ClientConfig::new()
        .set("bootstrap.servers", bootstrap)
        .set("linger.ms", "5")
        .create()
        .unwrap();
    for chunk in (0..n).collect::<Vec<_>>().chunks(2_000) {
        let sends = chunk.iter().map(|&i| {
            let payload = body(i, size);
            let producer = &producer;
            async move {
                producer
                    .send(
                        FutureRecord::<(), [u8]>::to(topic)
                            .partition(i as i32 % PARTITIONS)
                            .payload(&payload[..]),
                        Duration::from_secs(30),
                    )
                    .await
                    .unwrap();
            }
        });
        futures::future::join_all(sends).await;
    }
}

fn direct_rdkafka(bootstrap: &str, topic: &str, n: usize) -> Run {
    let consumer: BaseConsumer = ClientConfig::new()
        .set("bootstrap.servers", bootstrap)
        .set("group.id", format!("bench-direct-{}", std::process::id()))
        .set("enable.auto.commit", "false")
        .create()
        .unwrap();
    let mut assignment = TopicPartitionList::new();
    for p in 0..PARTITIONS {
        assignment
            .add_partition_offset(topic, p, Offset::Beginning)
            .unwrap();
    }
    consumer.assign(&assignment).unwrap();
    let (mut records, mut bytes) = (0, 0);
    let start = Instant::now();
    while records < n {
        if let Some(message) = consumer.poll(Duration::from_secs(5)) {
            let message = message.unwrap();
            bytes += rdkafka::Message::payload(&message).map_or(0, <[u8]>::len);
            records += 1;
        }
    }
    Run {
        name: "direct rdkafka BaseConsumer",
        records,
        bytes,
        elapsed: start.elapsed(),
        latencies: Vec::new(),
    }
}

/// puller-svc's Pull, with one AckPulled per batch when the records carry broker-ACK keys.
async fn through_puller(
    client: &mut PullerServiceClient<tonic::transport::Channel>,
    name: &'static str,
    topic: &str,
    group: &str,
    n: usize,
) -> Run {
    let reader = pb::GroupTopic {
        group: group.into(),
        topic: topic.into(),
    };
    let generation = client
        .attach(pb::AttachRequest {
            dispatcher_id: "pull-bench".into(),
            readers: vec![reader.clone()],
            positions: Vec::new(),
        })
        .await
        .unwrap()
        .into_inner()
        .generations[0]
        .generation;
    let (mut records, mut bytes, mut latencies) = (0, 0, Vec::new());
    let mut acking = Duration::ZERO;
    let start = Instant::now();
    while records < n {
        let t = Instant::now();
        let response = client
            .pull(pb::PullRequest {
                reader: Some(reader.clone()),
                max_records: 1_000,
                max_wait_ms: 1_000,
                generation,
                ..Default::default()
            })
            .await
            .unwrap()
            .into_inner();
        let keys: Vec<String> = response
            .records
            .iter()
            .filter(|r| !r.ack_key.is_empty())
            .map(|r| r.ack_key.clone())
            .collect();
        if !keys.is_empty() {
            let acked = Instant::now();
            client
                .ack_pulled(pb::AckPulledRequest {
                    entries: keys
                        .into_iter()
                        .map(|ack_key| pb::AckPulledEntry {
                            reader: Some(reader.clone()),
                            ack_key,
                        })
                        .collect(),
                })
                .await
                .unwrap();
            acking += acked.elapsed();
        }
        latencies.push(t.elapsed());
        records += response.records.len();
        bytes += response
            .records
            .iter()
            .map(|r| r.frame.len())
            .sum::<usize>();
    }
    let elapsed = start.elapsed();
    if !acking.is_zero() {
        println!(
            "# {name}: {} calls, AckPulled {:.0} % of the time",
            latencies.len(),
            acking.as_secs_f64() / elapsed.as_secs_f64() * 100.0
        );
    }
    Run {
        name,
        records,
        bytes,
        elapsed,
        latencies,
    }
}

fn local_runs(dir: &Path, n: usize, size: usize, runtime: &tokio::runtime::Runtime) -> Vec<Run> {
    let bodies: Vec<Bytes> = (0..n).map(|i| body(i, size)).collect();
    let bytes = bodies.iter().map(Bytes::len).sum::<usize>();
    let settings = LogSettings {
        retention_ms: None,
        ..LogSettings::default()
    };
    // Raw partition log: the baseline of the local path.
    let mut raw = PartitionLog::open(dir.join("raw"), settings).unwrap();
    let start = Instant::now();
    for body in &bodies {
        raw.append(b"", body, 0).unwrap();
    }
    let raw_append = start.elapsed();
    let start = Instant::now();
    let mut read = 0;
    while read < n {
        read += raw.read(read as i64, 1_000, usize::MAX).unwrap().len();
    }
    let raw_read = start.elapsed();
    // The same through the Storage contract (blocking-pool hop, ingestion and stamping).
    let storage = LocalStorage::open(dir.join("storage"), settings, StartAt::Earliest).unwrap();
    let topic = Topic::new("bench-local").unwrap();
    let (append, pull) = runtime.block_on(async {
        storage.create_topic(&topic, 1).await.unwrap();
        let start = Instant::now();
        for body in &bodies {
            storage
                .send(
                    &topic,
                    Bytes::new(),
                    body.clone(),
                    Some(PartitionId::number(0)),
                )
                .await
                .unwrap();
        }
        let append = start.elapsed();
        let reader = ReaderKey {
            group: None,
            topic: topic.clone(),
        };
        let start = Instant::now();
        let mut pulled = 0;
        while pulled < n {
            pulled += storage
                .poll(
                    &reader,
                    &Selection::All,
                    PollLimits {
                        max_records: 1_000,
                        max_bytes: usize::MAX,
                        ..PollLimits::default()
                    },
                )
                .await
                .unwrap()
                .records
                .len();
        }
        (append, start.elapsed())
    });
    let run = |name, elapsed| Run {
        name,
        records: n,
        bytes,
        elapsed,
        latencies: Vec::new(),
    };
    vec![
        run("raw PartitionLog append", raw_append),
        run("LocalStorage send (one record per call)", append),
        run("raw PartitionLog read", raw_read),
        run("LocalStorage poll (1,000 per call, stamped)", pull),
    ]
}

fn main() {
    let n = env_usize("BENCH_RECORDS", 200_000);
    let size = env_usize("BENCH_BODY_BYTES", 256);
    let rounds = env_usize("BENCH_ROUNDS", 3).max(1);
    let backends =
        std::env::var("BENCH_BACKENDS").unwrap_or_else(|_| "kafka,local,rocketmq".into());
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .unwrap();
    println!("| run | msgs/s | MB/s | ratio | p50 call | p99 call |");
    println!("| --- | ---: | ---: | ---: | ---: | ---: |");
    if backends.contains("kafka") {
        kafka_runs(&runtime, n, size, rounds);
    }
    if backends.contains("local") {
        local_table(&runtime, n, size, rounds);
    }
    if backends.contains("rocketmq") {
        let n = env_usize("BENCH_ROCKETMQ_RECORDS", 20_000);
        println!(
            "# rocketmq: {n} records of {size} B, 4 queues on one broker, median of {rounds} rounds"
        );
        for (raw, ours) in rocketmq::runs(&runtime, n, size, rounds) {
            print_row(&raw, &raw);
            print_row(&ours, &raw);
        }
    }
}

fn print_row(run: &Run, baseline: &Run) {
    println!(
        "| {} | {:.0} | {:.1} | {:.2} | {} | {} |",
        run.name,
        run.per_sec(),
        run.mb_per_sec(),
        run.per_sec() / baseline.per_sec(),
        run.percentile(0.5),
        run.percentile(0.99)
    );
}

fn kafka_runs(runtime: &tokio::runtime::Runtime, n: usize, size: usize, rounds: usize) {
    // Started here unless KAFKA_BOOTSTRAP names one; stopped when dropped at the end of main.
    let broker = eventmesh_testkit::KafkaBroker::get();
    let bootstrap = broker.bootstrap().to_owned();
    println!(
        "# pull benchmark: {n} records of {size} B, {PARTITIONS} partitions, median of {rounds} rounds"
    );
    let topic = format!("bench-pull-{}", std::process::id());
    let (mut direct, mut puller) = (Vec::new(), Vec::new());
    let data = tempfile::tempdir().unwrap();
    runtime.block_on(async {
        let (offsets, offset_channel) = support::memory_offset_svc().await;
        let storage: Arc<dyn Storage> =
            Arc::new(KafkaStorage::new(&bootstrap, data.path(), StartAt::Earliest).unwrap());
        storage
            .create_topic(&Topic::new(topic.as_str()).unwrap(), PARTITIONS as u32)
            .await
            .unwrap();
        produce(&bootstrap, &topic, n, size).await;
        let (server, mut client) = support::puller_over(storage, offset_channel).await;
        for round in 0..rounds {
            let direct_round = || {
                let (bootstrap, topic) = (bootstrap.clone(), topic.clone());
                tokio::task::spawn_blocking(move || direct_rdkafka(&bootstrap, &topic, n))
            };
            // Alternate who goes first.
            let direct_first = round % 2 == 0;
            if direct_first {
                direct.push(direct_round().await.unwrap());
            }
            let group = format!("bench-{round}");
            puller.push(through_puller(&mut client, KAFKA_PULL, &topic, &group, n).await);
            if !direct_first {
                direct.push(direct_round().await.unwrap());
            }
        }
        server.shutdown();
        server.wait().await.unwrap();
        offsets.shutdown();
        offsets.wait().await.unwrap();
    });
    let (direct, puller) = (median(direct), median(puller));
    print_row(&direct, &direct);
    print_row(&puller, &direct);
}

fn local_table(runtime: &tokio::runtime::Runtime, n: usize, size: usize, rounds: usize) {
    let mut local: Vec<Vec<Run>> = Vec::new();
    for _ in 0..rounds {
        let dir = tempfile::tempdir().unwrap();
        local.push(local_runs(dir.path(), n, size, runtime));
    }
    let mut columns: Vec<Vec<Run>> = (0..4).map(|_| Vec::new()).collect();
    for round in local {
        for (i, run) in round.into_iter().enumerate() {
            columns[i].push(run);
        }
    }
    let local: Vec<Run> = columns.into_iter().map(median).collect();
    for (run, baseline) in [
        (&local[0], &local[0]),
        (&local[1], &local[0]),
        (&local[2], &local[2]),
        (&local[3], &local[2]),
    ] {
        println!(
            "| {} | {:.0} | {:.1} | {:.2} | – | – |",
            run.name,
            run.per_sec(),
            run.mb_per_sec(),
            run.per_sec() / baseline.per_sec()
        );
    }
}

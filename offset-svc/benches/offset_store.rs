//! Offset store benchmark: CAS-max writes of N distinct keys (default 1,000,000) in batches
//! (default 1,000), compared in the same run against raw RocksDB `WriteBatch` puts of the same
//! keys and values with the same database options. Reports throughput, the ratio to raw,
//! p50/p99 batch latency and RSS, with and without `sync`.
//!
//! `cargo bench -p offset-svc --bench offset_store` (env: BENCH_KEYS, BENCH_BATCH,
//! BENCH_GRPC_CONCURRENCY). Method and latest numbers: docs/BENCHMARKS.md.

#![allow(clippy::unwrap_used)] // tests and benches: a failed unwrap is a failed run

use std::sync::Arc;
use std::time::{Duration, Instant};

use eventmesh_common::keys::OffsetKey;
use eventmesh_common::shutdown::CancellationToken;
use eventmesh_proto::offset::offset_service_client::OffsetServiceClient;
use eventmesh_proto::offset::{OffsetEntry, WriteOffsetsRequest};
use offset_svc::config::{Config, StoreKind};
use offset_svc::rocks::encode_value;
use offset_svc::{OffsetStore, RocksDbOffsetStore};

fn env_usize(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn rss_mib() -> f64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<f64>().ok())
        .map_or(f64::NAN, |kb| kb / 1024.0)
}

struct Run {
    name: String,
    writes: usize,
    elapsed: Duration,
    latencies: Vec<Duration>,
    rss_after: f64,
}

impl Run {
    fn per_sec(&self) -> f64 {
        self.writes as f64 / self.elapsed.as_secs_f64()
    }
    fn percentile(&self, p: f64) -> Duration {
        let mut sorted = self.latencies.clone();
        sorted.sort_unstable();
        sorted[((sorted.len() - 1) as f64 * p).round() as usize]
    }
}

/// The benchmark's keys: topic `orders`, 1000 clients × N/1000 partitions.
fn keys(n: usize) -> Vec<OffsetKey> {
    (0..n)
        .map(|i| {
            OffsetKey::parse_parts(
                "orders",
                &format!("client-{}", i % 1000),
                &(i / 1000).to_string(),
            )
            .unwrap()
        })
        .collect()
}

fn raw_rocksdb(keys: &[OffsetKey], batch: usize, sync: bool) -> Run {
    let dir = tempfile::tempdir().unwrap();
    let mut options = rocksdb::Options::default();
    options.create_if_missing(true);
    options.set_write_buffer_size(64 * 1024 * 1024);
    options.increase_parallelism(2);
    let db = rocksdb::DB::open(&options, dir.path()).unwrap();
    let mut write_options = rocksdb::WriteOptions::default();
    write_options.set_sync(sync);
    let mut latencies = Vec::new();
    let start = Instant::now();
    for (b, chunk) in keys.chunks(batch).enumerate() {
        let t = Instant::now();
        let mut wb = rocksdb::WriteBatch::default();
        for (i, key) in chunk.iter().enumerate() {
            wb.put(
                key.to_string().as_bytes(),
                encode_value((b * batch + i) as i64),
            );
        }
        db.write_opt(wb, &write_options).unwrap();
        latencies.push(t.elapsed());
    }
    let elapsed = start.elapsed();
    Run {
        name: format!(
            "raw RocksDB WriteBatch put{}",
            if sync { ", sync" } else { "" }
        ),
        writes: keys.len(),
        elapsed,
        latencies,
        rss_after: rss_mib(),
    }
}

fn store_writes(keys: &[OffsetKey], batch: usize, sync: bool) -> Run {
    let dir = tempfile::tempdir().unwrap();
    let store = RocksDbOffsetStore::open(dir.path()).unwrap();
    let batches: Vec<Vec<(OffsetKey, i64)>> = keys
        .chunks(batch)
        .enumerate()
        .map(|(b, chunk)| {
            chunk
                .iter()
                .enumerate()
                .map(|(i, k)| (k.clone(), (b * batch + i) as i64))
                .collect()
        })
        .collect();
    let mut latencies = Vec::new();
    let start = Instant::now();
    for entries in &batches {
        let t = Instant::now();
        store.write_batch(entries, sync).unwrap();
        latencies.push(t.elapsed());
    }
    let elapsed = start.elapsed();
    Run {
        name: format!(
            "RocksDbOffsetStore CAS-max{}",
            if sync { ", sync" } else { "" }
        ),
        writes: keys.len(),
        elapsed,
        latencies,
        rss_after: rss_mib(),
    }
}

async fn grpc_writes(keys: &[OffsetKey], batch: usize, sync: bool, concurrency: usize) -> Run {
    let dir = tempfile::tempdir().unwrap();
    let config = Config {
        listen: "127.0.0.1:0".parse().unwrap(),
        data_dir: dir.path().to_owned(),
        store: StoreKind::Rocksdb,
        ..Config::default()
    };
    let server = offset_svc::server::start(config, CancellationToken::new())
        .await
        .unwrap();
    let channel =
        tonic::transport::Endpoint::from_shared(format!("http://{}", server.local_addr()))
            .unwrap()
            .connect()
            .await
            .unwrap();
    let requests: Vec<WriteOffsetsRequest> = keys
        .chunks(batch)
        .enumerate()
        .map(|(b, chunk)| WriteOffsetsRequest {
            entries: chunk
                .iter()
                .enumerate()
                .map(|(i, k)| OffsetEntry {
                    key: Some(eventmesh_proto::offset::OffsetKey {
                        topic: k.topic.to_string(),
                        client_id: k.client.to_string(),
                        partition: k.partition.to_string(),
                    }),
                    offset: (b * batch + i) as i64,
                })
                .collect(),
            sync,
        })
        .collect();
    let queue = Arc::new(std::sync::Mutex::new(requests.into_iter()));
    let start = Instant::now();
    let mut tasks = Vec::new();
    for _ in 0..concurrency {
        let queue = Arc::clone(&queue);
        let mut client =
            OffsetServiceClient::new(channel.clone()).max_encoding_message_size(64 << 20);
        tasks.push(tokio::spawn(async move {
            let mut latencies = Vec::new();
            loop {
                let Some(request) = queue.lock().unwrap().next() else {
                    return latencies;
                };
                let t = Instant::now();
                client.write_offsets(request).await.unwrap();
                latencies.push(t.elapsed());
            }
        }));
    }
    let mut latencies = Vec::new();
    for task in tasks {
        latencies.extend(task.await.unwrap());
    }
    let elapsed = start.elapsed();
    let rss_after = rss_mib();
    server.shutdown();
    server.wait().await.unwrap();
    Run {
        name: format!(
            "offset-svc gRPC WriteOffsets ×{concurrency}{}",
            if sync { ", sync" } else { "" }
        ),
        writes: keys.len(),
        elapsed,
        latencies,
        rss_after,
    }
}

fn main() {
    let n = env_usize("BENCH_KEYS", 1_000_000);
    let batch = env_usize("BENCH_BATCH", 1_000);
    let concurrency = env_usize("BENCH_GRPC_CONCURRENCY", 4);
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .unwrap();
    let keys = keys(n);
    println!(
        "# offset store benchmark: {n} distinct keys, batches of {batch}, {} cores",
        std::thread::available_parallelism().map_or(0, |p| p.get())
    );
    println!("| run | writes/s | ratio to raw | p50 batch | p99 batch | RSS after (MiB) |");
    println!("| --- | ---: | ---: | ---: | ---: | ---: |");
    for sync in [false, true] {
        let raw = raw_rocksdb(&keys, batch, sync);
        let store = store_writes(&keys, batch, sync);
        let grpc = runtime.block_on(grpc_writes(&keys, batch, sync, concurrency));
        for run in [&raw, &store, &grpc] {
            println!(
                "| {} | {:.0} | {:.2} | {:.2} ms | {:.2} ms | {:.0} |",
                run.name,
                run.per_sec(),
                run.per_sec() / raw.per_sec(),
                run.percentile(0.5).as_secs_f64() * 1e3,
                run.percentile(0.99).as_secs_f64() * 1e3,
                run.rss_after,
            );
        }
    }
}

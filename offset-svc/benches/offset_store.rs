//! Offset store benchmark: CAS-max writes of N distinct keys (default 1,000,000) in batches
//! (default 1,000), compared in the same run against raw RocksDB `WriteBatch` puts of the same
//! keys and values with the same database options. Reports throughput, the ratio to raw,
//! p50/p99 batch latency and RSS growth, with and without `sync`. Each configuration runs
//! `BENCH_ROUNDS` times (default 3), interleaved, and the median round is reported.
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

/// A memory figure of this process from /proc/self/status (`VmRSS`, `VmHWM`), in MiB.
fn proc_status_mib(field: &str) -> f64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix(field)?.strip_prefix(':'))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<f64>().ok())
        .map_or(f64::NAN, |kb| kb / 1024.0)
}

struct Run {
    name: String,
    writes: usize,
    elapsed: Duration,
    latencies: Vec<Duration>,
    /// Slowest and fastest writes/s over the rounds (set by `median`).
    spread: (f64, f64),
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

const PASSES: [&str; 2] = ["new keys", "advancing keys"];

/// Writes every key once per pass, in batches, timing each batch. `write` gets the value of
/// the chunk's first key (values ascend through the whole run) and the chunk.
fn timed_passes(
    label: &str,
    sync: bool,
    keys: &[OffsetKey],
    batch: usize,
    mut write: impl FnMut(usize, &[OffsetKey]),
) -> Vec<Run> {
    let n = keys.len();
    PASSES
        .iter()
        .enumerate()
        .map(|(pass, pass_name)| {
            let mut latencies = Vec::new();
            let start = Instant::now();
            for (b, chunk) in keys.chunks(batch).enumerate() {
                let t = Instant::now();
                write(pass * n + b * batch, chunk);
                latencies.push(t.elapsed());
            }
            Run {
                name: format!("{label}, {pass_name}{}", sync_label(sync)),
                writes: n,
                elapsed: start.elapsed(),
                latencies,
                spread: (0.0, 0.0),
            }
        })
        .collect()
}

fn sync_label(sync: bool) -> &'static str {
    if sync { ", sync" } else { "" }
}

/// Raw RocksDB writes of every key once per pass: plain puts (the baseline), or, with
/// `merge`, merge operands under the store's max operator (how much the operator costs).
fn raw_rocksdb(keys: &[OffsetKey], batch: usize, sync: bool, merge: bool) -> Vec<Run> {
    let dir = tempfile::tempdir().unwrap();
    let mut options = rocksdb::Options::default();
    if merge {
        options.set_merge_operator_associative(
            offset_svc::rocks::MERGE_OPERATOR_NAME,
            offset_svc::rocks::max_merge,
        );
    }
    options.create_if_missing(true);
    options.set_write_buffer_size(64 * 1024 * 1024);
    options.increase_parallelism(2);
    let db = rocksdb::DB::open(&options, dir.path()).unwrap();
    let mut write_options = rocksdb::WriteOptions::default();
    write_options.set_sync(sync);
    let label = if merge {
        "raw RocksDB WriteBatch merge (max operator)"
    } else {
        "raw RocksDB WriteBatch put"
    };
    timed_passes(label, sync, keys, batch, |first, chunk| {
        let mut wb = rocksdb::WriteBatch::default();
        for (i, key) in chunk.iter().enumerate() {
            let value = encode_value((first + i) as i64);
            if merge {
                wb.merge(key.to_string().as_bytes(), value);
            } else {
                wb.put(key.to_string().as_bytes(), value);
            }
        }
        db.write_opt(wb, &write_options).unwrap();
    })
}

/// Writes every key once per pass into a store at `dir`; one Run per pass. Building the
/// entries is inside the timing, as formatting keys is for raw.
fn store_writes(dir: &std::path::Path, keys: &[OffsetKey], batch: usize, sync: bool) -> Vec<Run> {
    let store = RocksDbOffsetStore::open(dir).unwrap();
    timed_passes(
        "RocksDbOffsetStore CAS-max",
        sync,
        keys,
        batch,
        |first, chunk| {
            let entries: Vec<(OffsetKey, i64)> = chunk
                .iter()
                .enumerate()
                .map(|(i, k)| (k.clone(), (first + i) as i64))
                .collect();
            store.write_batch(&entries, sync).unwrap();
        },
    )
}

/// The same writes through the gRPC service (new keys only).
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
    let channel = server.channel().await.unwrap();
    let chunks: Vec<(usize, Vec<OffsetKey>)> = keys
        .chunks(batch)
        .map(<[OffsetKey]>::to_vec)
        .enumerate()
        .collect();
    let queue = Arc::new(std::sync::Mutex::new(chunks.into_iter()));
    let start = Instant::now();
    let mut tasks = Vec::new();
    for _ in 0..concurrency {
        let queue = Arc::clone(&queue);
        let mut client =
            OffsetServiceClient::new(channel.clone()).max_encoding_message_size(64 << 20);
        tasks.push(tokio::spawn(async move {
            let mut latencies = Vec::new();
            loop {
                let Some((b, chunk)) = queue.lock().unwrap().next() else {
                    return latencies;
                };
                let t = Instant::now();
                let request = WriteOffsetsRequest {
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
                };
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
    server.shutdown();
    server.wait().await.unwrap();
    Run {
        name: format!(
            "offset-svc gRPC WriteOffsets ×{concurrency}, new keys{}",
            sync_label(sync)
        ),
        writes: keys.len(),
        elapsed,
        latencies,
        spread: (0.0, 0.0),
    }
}

/// The median round, with the spread (slowest and fastest writes/s) of all rounds.
fn median(mut runs: Vec<Run>) -> Run {
    runs.sort_by(|a, b| a.per_sec().total_cmp(&b.per_sec()));
    let spread = (runs[0].per_sec(), runs[runs.len() - 1].per_sec());
    let middle = runs.len() / 2;
    let mut run = runs.swap_remove(middle);
    run.spread = spread;
    run
}

/// Child-process mode: open the store at `dir`, report load time and resident memory.
fn reopen_report(dir: &str) {
    let before = proc_status_mib("VmRSS");
    let start = Instant::now();
    let store = RocksDbOffsetStore::open(dir).unwrap();
    let elapsed = start.elapsed();
    println!(
        "{} {:.3} {:.1} {:.1}",
        store.len(),
        elapsed.as_secs_f64(),
        before,
        proc_status_mib("VmRSS")
    );
}

fn main() {
    if let Ok(dir) = std::env::var("BENCH_REOPEN_DIR") {
        return reopen_report(&dir);
    }
    let n = env_usize("BENCH_KEYS", 1_000_000);
    let batch = env_usize("BENCH_BATCH", 1_000);
    let concurrency = env_usize("BENCH_GRPC_CONCURRENCY", 4);
    let rounds = env_usize("BENCH_ROUNDS", 3).max(1);
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .unwrap();
    let keys = keys(n);
    println!(
        "# offset store benchmark: {n} distinct keys, batches of {batch}, median of {rounds} rounds, {} cores",
        std::thread::available_parallelism().map_or(0, |p| p.get())
    );
    println!("| run | writes/s (median) | rounds' range | ratio to raw | p50 batch | p99 batch |");
    println!("| --- | ---: | ---: | ---: | ---: | ---: |");
    let kept = tempfile::tempdir().unwrap();
    for sync in [false, true] {
        let mut raws: Vec<Vec<Run>> = vec![Vec::new(), Vec::new()];
        let mut merges: Vec<Vec<Run>> = vec![Vec::new(), Vec::new()];
        let mut stores: Vec<Vec<Run>> = vec![Vec::new(), Vec::new()];
        let mut grpcs = Vec::new();
        for round in 0..rounds {
            // Whoever runs first in a round runs slower (the previous round's databases are
            // still being torn down): rotate the order so no contender always goes first.
            for turn in 0..4 {
                match (round + turn) % 4 {
                    0 => {
                        for (pass, run) in raw_rocksdb(&keys, batch, sync, false)
                            .into_iter()
                            .enumerate()
                        {
                            raws[pass].push(run);
                        }
                    }
                    1 => {
                        for (pass, run) in raw_rocksdb(&keys, batch, sync, true)
                            .into_iter()
                            .enumerate()
                        {
                            merges[pass].push(run);
                        }
                    }
                    2 => {
                        let dir = tempfile::tempdir().unwrap();
                        // Keep one database of n keys for the reopen measurement below.
                        let path = if round == 0 && !sync {
                            kept.path().to_owned()
                        } else {
                            dir.path().to_owned()
                        };
                        for (pass, run) in store_writes(&path, &keys, batch, sync)
                            .into_iter()
                            .enumerate()
                        {
                            stores[pass].push(run);
                        }
                    }
                    _ => grpcs.push(runtime.block_on(grpc_writes(&keys, batch, sync, concurrency))),
                }
            }
        }
        let raw: Vec<Run> = raws.into_iter().map(median).collect();
        let merge: Vec<Run> = merges.into_iter().map(median).collect();
        let store: Vec<Run> = stores.into_iter().map(median).collect();
        let grpc = median(grpcs);
        for (run, baseline) in [
            (&raw[0], &raw[0]),
            (&merge[0], &raw[0]),
            (&store[0], &raw[0]),
            (&grpc, &raw[0]),
            (&raw[1], &raw[1]),
            (&merge[1], &raw[1]),
            (&store[1], &raw[1]),
        ] {
            println!(
                "| {} | {:.0} | {:.0}–{:.0} | {:.2} | {:.2} ms | {:.2} ms |",
                run.name,
                run.per_sec(),
                run.spread.0,
                run.spread.1,
                run.per_sec() / baseline.per_sec(),
                run.percentile(0.5).as_secs_f64() * 1e3,
                run.percentile(0.99).as_secs_f64() * 1e3,
            );
        }
    }
    let output = std::process::Command::new(std::env::current_exe().unwrap())
        .env("BENCH_REOPEN_DIR", kept.path())
        .output()
        .unwrap();
    let report = String::from_utf8_lossy(&output.stdout);
    let fields: Vec<&str> = report.split_whitespace().collect();
    if let [keys_loaded, secs, before, after] = fields[..] {
        let growth: f64 = after.parse::<f64>().unwrap() - before.parse::<f64>().unwrap();
        println!(
            "\nReopen (fresh process): {keys_loaded} keys loaded into the index in {secs} s; resident memory grew by {growth:.0} MiB (total {after} MiB)."
        );
    }
    println!(
        "Benchmark process peak RSS: {:.0} MiB",
        proc_status_mib("VmHWM")
    );
}

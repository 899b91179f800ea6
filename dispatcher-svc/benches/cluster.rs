//! Cluster benchmark (issue 11), on a real etcd and real service processes:
//!
//! 1. **Failover**: three instances on one tansu (lease TTL 3 s, keep-alive 1 s, the default
//!    1 s mirror interval), one group under a steady publish load. Rounds alternate `kill -9`
//!    of the home's three processes and SIGSTOP of its dispatcher (thawed once the group moved);
//!    each round reports the time from the kill until the group delivers from another instance
//!    and the duplicates it caused next to what was unsettled at the kill. The killed instance
//!    is restarted (or thawed) before the next round.
//! 2. **Recommend** latency and rate against a raw etcd prefix read of `instances/` (what a
//!    Recommend without the watch-fed view would cost at least), rounds alternated.
//! 3. **Mirror cost**: one instance (local backend) with `BENCH_GROUPS` (default 1,000) active
//!    groups under load: etcd transactions/s and key writes/s of the mirror, and the bytes its
//!    records take.
//!
//! `cargo bench -p dispatcher-svc --bench cluster` (env: BENCH_KILLS per kind, default 20;
//! BENCH_GROUPS; BENCH_PARTS=failover,recommend,mirror). Method and latest numbers:
//! docs/BENCHMARKS.md.

#![allow(clippy::unwrap_used)] // benches: a failed unwrap is a failed run

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use eventmesh_client::local::{LocalConfig, LocalInstance, Service};
use eventmesh_client::{Client, ClientConfig, Event, StartPosition, SubscribeOptions};
use eventmesh_proto::client::RecommendRequest;
use eventmesh_proto::client::event_mesh_service_client::EventMeshServiceClient;
use eventmesh_testkit::{Etcd, KafkaBroker};

fn env_usize(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn part_enabled(name: &str) -> bool {
    std::env::var("BENCH_PARTS").map_or(true, |parts| parts.split(',').any(|p| p == name))
}

fn percentile(values: &[Duration], p: f64) -> Duration {
    let mut sorted = values.to_vec();
    sorted.sort_unstable();
    sorted
        .get(((sorted.len().max(1) - 1) as f64 * p).round() as usize)
        .copied()
        .unwrap_or_default()
}

struct Node {
    id: String,
    instance: LocalInstance,
    _dir: tempfile::TempDir,
}

async fn node(id: &str, etcd: &Etcd, kafka: Option<&KafkaBroker>) -> Node {
    let dir = tempfile::tempdir().unwrap();
    let mut config = LocalConfig::new(dir.path()).args(
        Service::Dispatcher,
        [
            "--instance-id",
            id,
            "--etcd-endpoints",
            &etcd.endpoints_arg(),
            "--lease-ttl-secs",
            "3",
            "--keepalive-secs",
            "1",
        ],
    );
    config.log_filter = "warn".into();
    if let Some(kafka) = kafka {
        config = config.args(
            Service::Puller,
            [
                "--backend",
                "kafka",
                "--kafka-bootstrap",
                kafka.bootstrap(),
                "--auto-create-topics",
                "true",
            ],
        );
    }
    Node {
        id: id.to_owned(),
        instance: LocalInstance::start(config).await.unwrap(),
        _dir: dir,
    }
}

async fn client(nodes: &[&Node], id: &str) -> Client {
    let mut config = ClientConfig::new(id)
        .backoff(Duration::from_millis(50), Duration::from_millis(500))
        .retry_deadline(Duration::from_secs(120));
    for node in nodes {
        config = config.endpoint(node.instance.endpoint());
    }
    Client::connect(config).await.unwrap()
}

fn event(n: u64) -> Event {
    Event {
        id: format!("bench-{n:010}"),
        source: "/bench".into(),
        r#type: "bench.cluster".into(),
        data: vec![b'x'; 256].into(),
        ..Event::default()
    }
}

/// What the consumer saw: deliveries per event id and per instance, DURABLE answers.
#[derive(Default)]
struct Seen {
    deliveries: HashMap<String, u32>,
    total: usize,
    unsettled: HashMap<String, String>,
    latest_instance: String,
    last_at: Option<Instant>,
}

async fn failover(etcd: &Etcd) {
    let kafka = KafkaBroker::get();
    let mut nodes = vec![
        node("bf-a", etcd, Some(&kafka)).await,
        node("bf-b", etcd, Some(&kafka)).await,
        node("bf-c", etcd, Some(&kafka)).await,
    ];
    let topic = format!("bench-failover-{}", rand::random::<u32>());
    let all: Vec<&Node> = nodes.iter().collect();
    let publisher = client(&all, "bench-publisher").await;
    let consumer = client(&all, "bench-consumer").await;
    publisher.publish(&topic, event(0)).await.unwrap();
    let mut subscription = consumer
        .subscribe(
            SubscribeOptions::new(topic.as_str())
                .group("g")
                .start(StartPosition::Earliest)
                .max_in_flight(64),
        )
        .await
        .unwrap();
    let seen = Arc::new(Mutex::new(Seen::default()));
    let consuming = {
        let seen = Arc::clone(&seen);
        let mut results = subscription.ack_results();
        tokio::spawn(async move {
            loop {
                tokio::select! {
                    delivery = subscription.next() => {
                        let Some(Ok(delivery)) = delivery else { break };
                        let mut seen = seen.lock().unwrap();
                        *seen.deliveries.entry(delivery.event.id.clone()).or_default() += 1;
                        seen.total += 1;
                        seen.latest_instance = delivery.instance_id.to_string();
                        seen.last_at = Some(Instant::now());
                        seen.unsettled.insert(delivery.id.clone(), delivery.event.id.clone());
                        drop(seen);
                        delivery.ack();
                    }
                    Some(result) = results.recv() => {
                        if result.outcome == eventmesh_client::AckOutcome::Durable {
                            seen.lock().unwrap().unsettled.remove(&result.delivery_id);
                        }
                    }
                }
            }
        })
    };
    let publishing = tokio::spawn(async move {
        let mut n = 1;
        loop {
            if publisher.publish(&topic, event(n)).await.is_err() {
                continue;
            }
            n += 1;
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
    });
    let kills = env_usize("BENCH_KILLS", 20);
    let mut took: HashMap<&str, Vec<Duration>> = HashMap::new();
    let mut duplicates: HashMap<&str, Vec<(usize, usize)>> = HashMap::new();
    tokio::time::sleep(Duration::from_secs(3)).await;
    for round in 0..kills * 2 {
        let kind = if round % 2 == 0 { "kill -9" } else { "SIGSTOP" };
        // Steady: deliveries flowing.
        let home = loop {
            let flowing = {
                let seen = seen.lock().unwrap();
                seen.last_at
                    .is_some_and(|at| at.elapsed() < Duration::from_millis(200))
                    .then(|| seen.latest_instance.clone())
            };
            if let Some(home) = flowing {
                break home;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        };
        let (dup_before, unsettled) = {
            let seen = seen.lock().unwrap();
            (seen.total - seen.deliveries.len(), seen.unsettled.len())
        };
        let index = nodes.iter().position(|n| n.id == home).unwrap();
        let killed = Instant::now();
        if kind == "kill -9" {
            for service in Service::ALL {
                nodes[index].instance.kill(service).await.unwrap();
            }
        } else {
            nodes[index]
                .instance
                .signal(Service::Dispatcher, "STOP")
                .unwrap();
        }
        loop {
            let moved = {
                let seen = seen.lock().unwrap();
                seen.latest_instance != home && seen.last_at.is_some_and(|at| at > killed)
            };
            if moved {
                break;
            }
            assert!(killed.elapsed() < Duration::from_secs(60), "no failover");
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        took.entry(kind).or_default().push(killed.elapsed());
        // Let what the old home had out come back, then count.
        tokio::time::sleep(Duration::from_secs(2)).await;
        let dup_after = {
            let seen = seen.lock().unwrap();
            seen.total - seen.deliveries.len()
        };
        duplicates
            .entry(kind)
            .or_default()
            .push((dup_after - dup_before, unsettled));
        if kind == "kill -9" {
            for service in Service::ALL {
                nodes[index]
                    .instance
                    .start_service(service, None)
                    .await
                    .unwrap();
            }
        } else {
            nodes[index]
                .instance
                .signal(Service::Dispatcher, "CONT")
                .unwrap();
        }
        // Registered again (a fresh lease) before the next round.
        tokio::time::sleep(Duration::from_secs(2)).await;
    }
    publishing.abort();
    consuming.abort();
    println!(
        "\n## Failover (3 instances, TTL 3 s, keep-alive 1 s, mirror 1 s; {kills} rounds each)"
    );
    println!(
        "| kill | p50 | p99 | max | duplicates per kill (median / max) | unsettled at the kill (median) |"
    );
    println!("| --- | --- | --- | --- | --- | --- |");
    for kind in ["kill -9", "SIGSTOP"] {
        let times = &took[kind];
        let mut dups: Vec<usize> = duplicates[kind].iter().map(|d| d.0).collect();
        let mut unsettled: Vec<usize> = duplicates[kind].iter().map(|d| d.1).collect();
        dups.sort_unstable();
        unsettled.sort_unstable();
        println!(
            "| {kind} | {:.2} s | {:.2} s | {:.2} s | {} / {} | {} |",
            percentile(times, 0.5).as_secs_f64(),
            percentile(times, 0.99).as_secs_f64(),
            times.iter().max().unwrap().as_secs_f64(),
            dups[dups.len() / 2],
            dups[dups.len() - 1],
            unsettled[unsettled.len() / 2],
        );
    }
    for node in nodes.drain(..) {
        node.instance.stop(Duration::from_secs(10)).await;
    }
}

async fn recommend(etcd: &Etcd) {
    let nodes = [
        node("br-a", etcd, None).await,
        node("br-b", etcd, None).await,
    ];
    tokio::time::sleep(Duration::from_secs(2)).await;
    let mut raw = EventMeshServiceClient::connect(nodes[0].instance.endpoint())
        .await
        .unwrap();
    let mut kv = etcd_client::Client::connect(etcd.endpoints(), None)
        .await
        .unwrap();
    const CALLS: usize = 2_000;
    let mut ours = Vec::new();
    let mut baseline = Vec::new();
    for round in 0..6 {
        let mut latencies = Vec::with_capacity(CALLS);
        let started = Instant::now();
        for i in 0..CALLS {
            let asked = Instant::now();
            if round % 2 == 0 {
                raw.recommend(RecommendRequest {
                    client_id: format!("c{}", i % 50),
                    topic: "t".into(),
                    group: format!("g{}", i % 100),
                    exclude: Vec::new(),
                })
                .await
                .unwrap();
            } else {
                kv.get(
                    "/em/instances/",
                    Some(etcd_client::GetOptions::new().with_prefix()),
                )
                .await
                .unwrap();
            }
            latencies.push(asked.elapsed());
        }
        let rate = CALLS as f64 / started.elapsed().as_secs_f64();
        if round % 2 == 0 {
            ours.push((rate, latencies));
        } else {
            baseline.push((rate, latencies));
        }
    }
    println!(
        "\n## Recommend (2 instances; {CALLS} sequential calls per round, 3 rounds each, alternated)"
    );
    println!("| what | calls/s (median round) | p50 | p99 |");
    println!("| --- | --- | --- | --- |");
    for (name, runs) in [
        ("Recommend (watch-fed view)", &mut ours),
        ("raw etcd prefix read of instances/", &mut baseline),
    ] {
        runs.sort_by(|a, b| a.0.total_cmp(&b.0));
        let (rate, latencies) = &runs[runs.len() / 2];
        println!(
            "| {name} | {rate:.0} | {} µs | {} µs |",
            percentile(latencies, 0.5).as_micros(),
            percentile(latencies, 0.99).as_micros()
        );
    }
    for node in nodes {
        node.instance.stop(Duration::from_secs(10)).await;
    }
}

async fn mirror(etcd: &Etcd) {
    let groups = env_usize("BENCH_GROUPS", 1_000);
    let node = node("bm-a", etcd, None).await;
    let sdk = client(&[&node], "bench-mirror").await;
    let topic = "bench-mirror";
    sdk.publish(topic, event(0)).await.unwrap();
    let mut subscriptions = Vec::new();
    for g in 0..groups {
        let mut subscription = sdk
            .subscribe(
                SubscribeOptions::new(topic)
                    .group(format!("g{g}"))
                    .start(StartPosition::Earliest)
                    .max_in_flight(16),
            )
            .await
            .unwrap();
        subscriptions.push(tokio::spawn(async move {
            while let Some(Ok(delivery)) = subscription.next().await {
                delivery.ack();
            }
        }));
    }
    let publishing = tokio::spawn(async move {
        let mut n = 1;
        loop {
            if sdk.publish(topic, event(n)).await.is_ok() {
                n += 1;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    });
    tokio::time::sleep(Duration::from_secs(5)).await;
    let mut kv = etcd_client::Client::connect(etcd.endpoints(), None)
        .await
        .unwrap();
    let mut watch = kv
        .watch(
            "/em/watermarks/",
            Some(etcd_client::WatchOptions::new().with_prefix()),
        )
        .await
        .unwrap();
    let revision = |kv: &mut etcd_client::Client| {
        let mut kv = kv.clone();
        async move {
            kv.get("/em/none", None)
                .await
                .unwrap()
                .header()
                .map_or(0, |h| h.revision())
        }
    };
    let first = revision(&mut kv).await;
    let started = Instant::now();
    let window = Duration::from_secs(20);
    let mut puts = 0usize;
    while started.elapsed() < window {
        if let Ok(Ok(Some(response))) =
            tokio::time::timeout(Duration::from_millis(200), watch.message()).await
        {
            puts += response.events().len();
        }
    }
    let seconds = started.elapsed().as_secs_f64();
    let last = revision(&mut kv).await;
    let stored = kv
        .get(
            "/em/watermarks/",
            Some(etcd_client::GetOptions::new().with_prefix()),
        )
        .await
        .unwrap();
    let bytes: usize = stored
        .kvs()
        .iter()
        .map(|kv| kv.key().len() + kv.value().len())
        .sum();
    let per_thousand = 1_000.0 / groups as f64;
    println!(
        "\n## Mirror cost ({groups} active groups on one 4-partition topic published at ~100/s; {seconds:.0} s)"
    );
    println!(
        "| etcd transactions/s | watermark key writes/s | keys | bytes stored (keys + values) | per 1,000 groups: txn/s, writes/s, bytes |"
    );
    println!("| --- | --- | --- | --- | --- |");
    let txns = (last - first) as f64 / seconds;
    let writes = puts as f64 / seconds;
    println!(
        "| {txns:.1} | {writes:.0} | {} | {bytes} | {:.1}, {:.0}, {:.0} |",
        stored.kvs().len(),
        txns * per_thousand,
        writes * per_thousand,
        bytes as f64 * per_thousand
    );
    publishing.abort();
    for task in subscriptions {
        task.abort();
    }
    node.instance.stop(Duration::from_secs(10)).await;
}

#[tokio::main]
async fn main() {
    let etcd = Etcd::start_own();
    if part_enabled("recommend") {
        recommend(&etcd).await;
    }
    if part_enabled("mirror") {
        mirror(&etcd).await;
    }
    if part_enabled("failover") {
        failover(&etcd).await;
    }
}

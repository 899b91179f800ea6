//! Several instances on one etcd (real etcd from `scripts/etcd.sh`, real tansu from
//! `scripts/kafka.sh`, real service processes): registration and its lease, one home per
//! group with redirects, failover without loss, and bad input.

#![allow(clippy::unwrap_used)]

mod support;

use std::collections::HashMap;
use std::process::Command;
use std::sync::Arc;
use std::time::{Duration, Instant};

use eventmesh_client::local::{LocalConfig, LocalInstance, Service};
use eventmesh_client::{Client, ClientConfig, Event, StartPosition, SubscribeOptions};
use eventmesh_proto::client::event_mesh_service_client::EventMeshServiceClient;
use eventmesh_proto::client::{
    Open, RecommendRequest, SubscribeRequest, SubscriptionMode, subscribe_request,
};
use eventmesh_testkit::{Etcd, KafkaBroker};
use support::{Ledger, spawn_consumer};

/// One test at a time: each runs several instances (three processes each) on a small machine.
async fn serial() -> tokio::sync::MutexGuard<'static, ()> {
    static LOCK: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());
    LOCK.lock().await
}

/// Lease TTL of the test instances, seconds: how long a dead instance keeps its groups.
const TTL_SECS: u64 = 3;

/// One instance of the cluster.
struct Node {
    id: String,
    instance: LocalInstance,
    _dir: tempfile::TempDir,
}

async fn try_node(
    id: &str,
    etcd: &Etcd,
    kafka: Option<&KafkaBroker>,
    extra: &[&str],
) -> Result<Node, String> {
    let dir = tempfile::tempdir().unwrap();
    let mut config = LocalConfig::new(dir.path()).args(
        Service::Dispatcher,
        [
            "--instance-id",
            id,
            "--etcd-endpoints",
            &etcd.endpoints_arg(),
            "--lease-ttl-secs",
            &TTL_SECS.to_string(),
            "--keepalive-secs",
            "1",
            "--mirror-interval-ms",
            "300",
            "--dependency-timeout-ms",
            "2000",
            "--group-grace-ms",
            "500",
        ],
    );
    config = config.args(Service::Dispatcher, extra.iter().copied());
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
    let instance = LocalInstance::start(config).await.map_err(|error| {
        let log =
            std::fs::read_to_string(dir.path().join("logs/dispatcher-svc.log")).unwrap_or_default();
        format!("{error}; its log:\n{log}")
    })?;
    Ok(Node {
        id: id.to_owned(),
        instance,
        _dir: dir,
    })
}

async fn node(id: &str, etcd: &Etcd, kafka: Option<&KafkaBroker>) -> Node {
    try_node(id, etcd, kafka, &[]).await.unwrap()
}

impl Node {
    /// Kills all three processes with SIGKILL (a node failure).
    async fn kill_all(&mut self) {
        for service in Service::ALL {
            self.instance.kill(service).await.unwrap();
        }
    }
}

/// `etcdctl` against the test's etcd; its stdout.
fn etcdctl(etcd: &Etcd, args: &[&str]) -> String {
    let output = Command::new("etcdctl")
        .env("ETCDCTL_API", "3")
        .arg("--endpoints")
        .arg(etcd.endpoints_arg())
        .args(args)
        .output()
        .expect("etcdctl runs (scripts/etcd.sh install)");
    assert!(
        output.status.success(),
        "etcdctl {args:?}: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    String::from_utf8_lossy(&output.stdout).into_owned()
}

/// A key's value and lease (`None`: absent).
fn etcd_get(etcd: &Etcd, key: &str) -> Option<(String, i64)> {
    let fields = etcdctl(etcd, &["get", key, "-w", "fields"]);
    let field = |name: &str| {
        fields.lines().find_map(|line| {
            let rest = line.trim().strip_prefix(&format!("\"{name}\" : "))?;
            Some(rest.trim().trim_matches('"').to_owned())
        })
    };
    let value = field("Value")?;
    let lease = field("Lease")?.parse().ok()?;
    Some((value, lease))
}

/// Every key under `prefix` with its value.
fn etcd_prefix(etcd: &Etcd, prefix: &str) -> HashMap<String, String> {
    let out = etcdctl(etcd, &["get", prefix, "--prefix"]);
    let lines: Vec<&str> = out.lines().collect();
    lines
        .chunks(2)
        .filter_map(|pair| Some((pair.first()?.to_string(), pair.get(1)?.to_string())))
        .collect()
}

async fn eventually(what: &str, wait: Duration, mut check: impl FnMut() -> bool) -> Duration {
    let started = Instant::now();
    loop {
        if check() {
            return started.elapsed();
        }
        assert!(started.elapsed() < wait, "{what}: not within {wait:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

async fn client(nodes: &[&Node], client_id: &str) -> Client {
    let mut config = ClientConfig::new(client_id)
        .backoff(Duration::from_millis(50), Duration::from_millis(500))
        .retry_deadline(Duration::from_secs(60));
    for node in nodes {
        config = config.endpoint(node.instance.endpoint());
    }
    Client::connect(config).await.expect("client connects")
}

fn event(n: u64) -> Event {
    Event {
        id: format!("cl-{n:08}"),
        source: "/cluster".into(),
        r#type: "cluster.test".into(),
        data: format!("{n}").into_bytes().into(),
        ..Event::default()
    }
}

async fn raw_open(node: &Node, client_id: &str, topic: &str, group: &str) -> tonic::Status {
    let mut raw = EventMeshServiceClient::connect(node.instance.endpoint())
        .await
        .unwrap();
    let open = SubscribeRequest {
        kind: Some(subscribe_request::Kind::Open(Open {
            client_id: client_id.into(),
            topic: topic.into(),
            group: group.into(),
            mode: SubscriptionMode::LoadBalance.into(),
            ..Open::default()
        })),
    };
    match raw.subscribe(futures::stream::iter([open])).await {
        Err(status) => status,
        Ok(response) => {
            let mut stream = response.into_inner();
            match stream.message().await {
                Err(status) => status,
                Ok(first) => tonic::Status::ok(format!("opened: {first:?}")),
            }
        }
    }
}

/// Registration: the record under the lease, kept alive past the TTL, gone at once after
/// SIGTERM and within the TTL after `kill -9`; a duplicate id refused; garbage under
/// `instances/` skipped; Recommend's bad input refused naming the field; a topic with `/`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn registration_follows_the_lease() {
    let _serial = serial().await;
    let etcd = Etcd::start_own();
    let a = node("reg-a", &etcd, None).await;
    let (value, lease) = etcd_get(&etcd, "/em/instances/reg-a").expect("registered");
    assert_ne!(lease, 0, "the record is under a lease");
    let fields: Vec<&str> = value.split('|').collect();
    assert_eq!(fields.len(), 6, "ts|addr|sessions|in|out|cpu: {value}");
    assert_eq!(fields[1], a.instance.addr(Service::Dispatcher).to_string());

    // Garbage written by hand is skipped, never fatal.
    etcdctl(&etcd, &["put", "/em/instances/zz-garbage", "no bars here"]);
    etcdctl(
        &etcd,
        &["put", "/em/instances/zz-expired", "1|10.0.0.1:1|0|0|0|0"],
    );
    etcdctl(&etcd, &["put", "/em/groups/t/g", "garbage"]);

    // Alive past the TTL while kept alive, its record rewritten.
    tokio::time::sleep(Duration::from_secs(TTL_SECS + 1)).await;
    let (later, same_lease) = etcd_get(&etcd, "/em/instances/reg-a").expect("still registered");
    assert_eq!(same_lease, lease);
    assert_ne!(later, value, "rewritten each keep-alive");

    let mut raw = EventMeshServiceClient::connect(a.instance.endpoint())
        .await
        .unwrap();
    let answer = raw
        .recommend(RecommendRequest {
            client_id: "c".into(),
            ..RecommendRequest::default()
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(answer.instance_id, "reg-a", "garbage is never recommended");
    for (request, field) in [
        (
            RecommendRequest {
                client_id: "bad#id".into(),
                ..RecommendRequest::default()
            },
            "client_id",
        ),
        (
            RecommendRequest {
                client_id: "c".into(),
                topic: "bad#topic".into(),
                ..RecommendRequest::default()
            },
            "topic",
        ),
        (
            RecommendRequest {
                client_id: "c".into(),
                topic: "t".into(),
                group: "bad group".into(),
                ..RecommendRequest::default()
            },
            "group",
        ),
    ] {
        let refused = raw.recommend(request).await.unwrap_err();
        assert_eq!(refused.code(), tonic::Code::InvalidArgument);
        assert!(refused.message().contains(field), "{refused}");
    }

    // A topic with `/`: its home key is encoded.
    let sdk = client(&[&a], "slash").await;
    sdk.publish("a/b", event(0)).await.unwrap();
    let mut subscription = sdk
        .subscribe(
            SubscribeOptions::new("a/b")
                .group("g")
                .start(StartPosition::Earliest),
        )
        .await
        .unwrap();
    let first = tokio::time::timeout(Duration::from_secs(20), subscription.next())
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    first.ack();
    let (home, home_lease) = etcd_get(&etcd, "/em/groups/a%2Fb/g").expect("the group is homed");
    assert!(home.starts_with("reg-a|"), "{home}");
    assert_eq!(home_lease, lease, "the home is under the instance's lease");
    let record = etcd_prefix(&etcd, "/em/watermarks/a%2Fb/g/");
    assert!(!record.is_empty(), "the group's start is recorded");
    subscription.close().await;
    // The home goes with the group (grace period 500 ms).
    eventually("home released", Duration::from_secs(10), || {
        etcd_get(&etcd, "/em/groups/a%2Fb/g").is_none()
    })
    .await;

    // A duplicate id is refused, naming the holder.
    let duplicate = try_node("reg-a", &etcd, None, &[]).await;
    let Err(error) = duplicate else {
        panic!("a second reg-a started")
    };
    assert!(
        error.contains("registered by another live instance"),
        "{error}"
    );

    // SIGTERM: gone at once.
    let stopped = Instant::now();
    a.instance.stop(Duration::from_secs(10)).await;
    assert!(
        etcd_get(&etcd, "/em/instances/reg-a").is_none(),
        "revoked at shutdown"
    );
    eprintln!("graceful stop took {:?}", stopped.elapsed());

    // kill -9: gone within the TTL.
    let mut b = node("reg-b", &etcd, None).await;
    assert!(etcd_get(&etcd, "/em/instances/reg-b").is_some());
    b.kill_all().await;
    let took = eventually(
        "a killed instance's record expires",
        Duration::from_secs(TTL_SECS + 3),
        || etcd_get(&etcd, "/em/instances/reg-b").is_none(),
    )
    .await;
    eprintln!("killed instance's record gone after {took:?}");
}

/// Two instances on one tansu: sessions of one group opened at different instances end at
/// one home; a raw Open at the other instance is redirected; every event once per group.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_group_has_one_home() {
    let _serial = serial().await;
    let etcd = Etcd::start_own();
    let kafka = KafkaBroker::get();
    let a = node("home-a", &etcd, Some(&kafka)).await;
    let b = node("home-b", &etcd, Some(&kafka)).await;
    let topic = format!("homes-{}", rand::random::<u32>());

    let at_a = client(&[&a], "home-client-1").await;
    let at_b = client(&[&b], "home-client-2").await;
    let options = || {
        SubscribeOptions::new(topic.as_str())
            .group("g")
            .start(StartPosition::Earliest)
    };
    let first = at_a.subscribe(options()).await.unwrap();
    let home = first.session().unwrap().instance_id;
    let second = at_b.subscribe(options()).await.unwrap();
    assert_eq!(
        second.session().unwrap().instance_id,
        home,
        "both sessions at the group's home"
    );
    let other = if home == a.id { &b } else { &a };
    let refused = raw_open(other, "raw", &topic, "g").await;
    assert_eq!(refused.code(), tonic::Code::FailedPrecondition, "{refused}");
    assert_eq!(
        refused.metadata().get("em-home-instance").unwrap(),
        home.as_str()
    );
    assert!(refused.metadata().get("em-home-address").is_some());

    let ledger = Arc::new(Ledger::default());
    let (one, stop_one) = spawn_consumer(first, Arc::clone(&ledger), 1);
    let (two, stop_two) = spawn_consumer(second, Arc::clone(&ledger), 2);
    const EVENTS: u64 = 400;
    for n in 0..EVENTS {
        let publisher = if n % 2 == 0 { &at_a } else { &at_b };
        publisher.publish(&topic, event(n)).await.unwrap();
        ledger.published(event(n).id);
    }
    eventually("every event delivered", Duration::from_secs(60), || {
        ledger.count().distinct_delivered == EVENTS as usize
    })
    .await;
    tokio::time::sleep(Duration::from_secs(1)).await;
    let count = ledger.count();
    assert_eq!(count.lost, 0, "{count:?}");
    assert_eq!(
        count.duplicates, 0,
        "once per group, not once per instance: {count:?}"
    );
    let _ = stop_one.send(true);
    let _ = stop_two.send(true);
    one.await.unwrap().close().await;
    two.await.unwrap().close().await;
}

/// Failover: three instances on one tansu; the home of a group under steady load is killed
/// (`kill -9` of its three processes). The group moves, resumes from the mirrored progress:
/// nothing lost, duplicates bounded by what was unsettled at the kill plus one mirror interval.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_home_hands_its_group_over_without_loss() {
    let _serial = serial().await;
    let etcd = Etcd::start_own();
    let kafka = KafkaBroker::get();
    let mut nodes = [
        node("fo-a", &etcd, Some(&kafka)).await,
        node("fo-b", &etcd, Some(&kafka)).await,
        node("fo-c", &etcd, Some(&kafka)).await,
    ];
    let topic = format!("failover-{}", rand::random::<u32>());
    let all: Vec<&Node> = nodes.iter().collect();
    let consumer = client(&all, "fo-consumer").await;
    let publisher = client(&all, "fo-publisher").await;
    let subscription = consumer
        .subscribe(
            SubscribeOptions::new(topic.as_str())
                .group("g")
                .start(StartPosition::Earliest)
                .max_in_flight(64),
        )
        .await
        .unwrap();
    let home = subscription.session().unwrap().instance_id;
    let ledger = Arc::new(Ledger::default());
    let (consuming, stop) = spawn_consumer(subscription, Arc::clone(&ledger), 7);

    // Steady load: a publisher that keeps going across the kill.
    const EVENTS: u64 = 3_000;
    let publishing = {
        let ledger = Arc::clone(&ledger);
        let topic = topic.clone();
        tokio::spawn(async move {
            for n in 0..EVENTS {
                publisher.publish(&topic, event(n)).await.unwrap();
                ledger.published(event(n).id);
                tokio::time::sleep(Duration::from_millis(2)).await;
            }
        })
    };
    eventually("deliveries under way", Duration::from_secs(60), || {
        ledger.count().distinct_delivered > 500
    })
    .await;
    let durable_before = ledger.durable_count();
    tokio::time::sleep(Duration::from_millis(300)).await;
    let home_node = nodes.iter_mut().find(|n| n.id == home).unwrap();
    let unsettled_at_kill = ledger.unsettled();
    let durable_in_last_interval = ledger.durable_count() - durable_before;
    let killed = Instant::now();
    let delivered_at_kill = ledger.count().deliveries;
    home_node.kill_all().await;
    let resumed = eventually("delivering again", Duration::from_secs(60), || {
        ledger.latest_instance().is_some_and(|i| *i != *home)
            && ledger.count().deliveries > delivered_at_kill
    })
    .await;
    eprintln!("kill -9 of the home: delivering again after {resumed:?}");
    publishing.await.unwrap();
    eventually("every event delivered", Duration::from_secs(120), || {
        ledger.count().lost == 0 && ledger.count().published == EVENTS as usize
    })
    .await;
    let count = ledger.count();
    let bound = unsettled_at_kill + durable_in_last_interval;
    eprintln!(
        "failover: {count:?}; unsettled at the kill {unsettled_at_kill}, ACKed durable in the last mirror interval {durable_in_last_interval}; took {:?}",
        killed.elapsed()
    );
    assert_eq!(count.lost, 0);
    assert!(count.duplicates <= bound, "{count:?} > {bound}");
    let _ = stop.send(true);
    consuming.await.unwrap().close().await;
}

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
use eventmesh_proto::client::admin_service_client::AdminServiceClient;
use eventmesh_proto::client::event_mesh_service_client::EventMeshServiceClient;
use eventmesh_proto::client::{
    Ack, Open, RecommendRequest, ResetOffsetsRequest, SubscribeRequest, SubscriptionMode,
    reset_offsets_request, subscribe_request, subscribe_response,
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
    try_node_at(id, &etcd.endpoints_arg(), kafka, extra).await
}

/// [`try_node`] with the etcd endpoints given (a proxy in front of etcd, say); `extra` may
/// override the lease TTL.
async fn try_node_at(
    id: &str,
    etcd_endpoints: &str,
    kafka: Option<&KafkaBroker>,
    extra: &[&str],
) -> Result<Node, String> {
    let dir = tempfile::tempdir().unwrap();
    let ttl = TTL_SECS.to_string();
    let mut config = LocalConfig::new(dir.path()).args(
        Service::Dispatcher,
        [
            "--instance-id",
            id,
            "--etcd-endpoints",
            etcd_endpoints,
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
    if !extra.contains(&"--lease-ttl-secs") {
        config = config.args(Service::Dispatcher, ["--lease-ttl-secs", ttl.as_str()]);
    }
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

async fn eventually(what: &str, wait: Duration, check: impl FnMut() -> bool) -> Duration {
    match within(wait, check).await {
        Some(took) => took,
        None => panic!("{what}: not within {wait:?}"),
    }
}

/// How long until `check` holds, or `None` if not within `wait`.
async fn within(wait: Duration, mut check: impl FnMut() -> bool) -> Option<Duration> {
    let started = Instant::now();
    loop {
        if check() {
            return Some(started.elapsed());
        }
        if started.elapsed() >= wait {
            return None;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// The last `lines` lines of a service's log on `node`, to explain a failure.
fn log_tail(node: &Node, service: Service, lines: usize) -> String {
    let log = std::fs::read_to_string(node.instance.log_file(service)).unwrap_or_default();
    let all: Vec<&str> = log.lines().collect();
    all[all.len().saturating_sub(lines)..].join("\n")
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

/// Opens a raw session of `group` at `node` (no recommendation, no redirect followed),
/// ACKs its first delivery, ends the session and returns that delivery's event id.
async fn first_delivery_at(node: &Node, topic: &str, group: &str) -> String {
    let mut raw = EventMeshServiceClient::connect(node.instance.endpoint())
        .await
        .unwrap();
    let (requests, inbound) = futures::channel::mpsc::unbounded();
    requests
        .unbounded_send(SubscribeRequest {
            kind: Some(subscribe_request::Kind::Open(Open {
                client_id: "raw-replay".into(),
                topic: topic.into(),
                group: group.into(),
                mode: SubscriptionMode::LoadBalance.into(),
                start: eventmesh_proto::client::StartPosition::Earliest.into(),
                ..Open::default()
            })),
        })
        .unwrap();
    let mut stream = raw.subscribe(inbound).await.unwrap().into_inner();
    let first = tokio::time::timeout(Duration::from_secs(30), async {
        loop {
            let message = stream
                .message()
                .await
                .unwrap()
                .expect("the stream stays open");
            let delivery = match message.kind {
                Some(subscribe_response::Kind::Delivery(delivery)) => Some(delivery),
                Some(subscribe_response::Kind::Batch(batch)) => batch.deliveries.into_iter().next(),
                _ => None,
            };
            if let Some(delivery) = delivery {
                return delivery;
            }
        }
    })
    .await
    .expect("a delivery within 30 s");
    requests
        .unbounded_send(SubscribeRequest {
            kind: Some(subscribe_request::Kind::Ack(Ack {
                delivery_ids: vec![first.delivery_id.clone()],
            })),
        })
        .unwrap();
    // The end of the request stream ends the session; the server then ends its stream.
    drop(requests);
    tokio::time::timeout(Duration::from_secs(10), async {
        while let Ok(Some(_)) = stream.message().await {}
    })
    .await
    .expect("the session ends");
    first.event.map(|e| e.id).unwrap_or_default()
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

    // The home key made to name another instance (an operator, or a split brain): the group
    // is given up at once; once the key is gone the subscription is served here again.
    let before = subscription.session().unwrap().session_id;
    etcdctl(
        &etcd,
        &["put", "/em/groups/a%2Fb/g", "elsewhere|127.0.0.1:9"],
    );
    eventually("the group given up", Duration::from_secs(10), || {
        subscription
            .session()
            .is_none_or(|session| session.session_id != before)
    })
    .await;
    etcdctl(&etcd, &["del", "/em/groups/a%2Fb/g"]);
    sdk.publish("a/b", event(1)).await.unwrap();
    loop {
        let next = tokio::time::timeout(Duration::from_secs(30), subscription.next())
            .await
            .expect("served again after the foreign home key went")
            .unwrap()
            .unwrap();
        next.ack();
        if next.event.id == event(1).id {
            break;
        }
    }
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

    // A configuration error at start names the key.
    let bad = try_node("reg-bad", &etcd, None, &["--etcd-prefix", "em"]).await;
    let Err(error) = bad else {
        panic!("started with a prefix not starting with /")
    };
    assert!(error.contains("etcd_prefix"), "{error}");

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

    // `emctl cluster` at either instance: both live, and the group's home.
    let output = Command::new(env!("CARGO_BIN_EXE_emctl"))
        .args(["cluster", "--json", "--endpoint"])
        .arg(other.instance.endpoint())
        .output()
        .unwrap();
    assert!(output.status.success(), "{output:?}");
    let view: serde_json::Value = serde_json::from_slice(&output.stdout).unwrap();
    let ids: Vec<&str> = view["instances"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|i| i["instance_id"].as_str())
        .collect();
    assert!(ids.contains(&"home-a") && ids.contains(&"home-b"), "{view}");
    let homes = view["homes"].as_array().unwrap();
    assert!(
        homes.iter().any(|h| h["topic"] == topic.as_str()
            && h["group"] == "g"
            && h["instance_id"] == home.as_str()),
        "{view}"
    );
    let table = Command::new(env!("CARGO_BIN_EXE_emctl"))
        .args(["cluster", "--endpoint"])
        .arg(other.instance.endpoint())
        .output()
        .unwrap();
    eprintln!("{}", String::from_utf8_lossy(&table.stdout));

    let _ = stop_one.send(true);
    let _ = stop_two.send(true);
    one.await.unwrap().close().await;
    two.await.unwrap().close().await;

    // An operator's reset through the instance that never served the group: it takes the
    // home for the reset and lowers the mirrored record too, so the group starts over.
    let home_key = format!("/em/groups/{topic}/g");
    eventually("home released", Duration::from_secs(10), || {
        etcd_get(&etcd, &home_key).is_none()
    })
    .await;
    let mut admin = AdminServiceClient::connect(other.instance.endpoint())
        .await
        .unwrap();
    let answer = admin
        .reset_offsets(ResetOffsetsRequest {
            topic: topic.clone(),
            target: Some(reset_offsets_request::Target::Group("g".into())),
            partition: String::new(),
            offset: -1,
            reason: "test".into(),
        })
        .await
        .unwrap()
        .into_inner();
    assert!(
        !answer.changed.is_empty(),
        "the moved group's progress was reset"
    );
    let record = etcd_prefix(&etcd, &format!("/em/watermarks/{topic}/g/"));
    assert!(!record.is_empty());
    assert!(record.values().all(|v| v == "-1"), "{record:?}");
    // The old home's own offset-svc still holds the progress from before the reset: the group
    // created there again must take the lowered record, not its stale local watermarks.
    let old_home = if home == a.id { &a } else { &b };
    let first = first_delivery_at(old_home, &topic, "g").await;
    assert!(
        first.starts_with("cl-"),
        "the reset group replays at its old home too (first delivery {first})"
    );
    eventually("home released again", Duration::from_secs(10), || {
        etcd_get(&etcd, &home_key).is_none()
    })
    .await;
    let mut again = at_b.subscribe(options()).await.unwrap();
    let replayed = tokio::time::timeout(Duration::from_secs(30), again.next())
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    replayed.ack();
    again.close().await;
}

/// A subscription of group `g` under steady load: a publisher of `events` ids and a consumer
/// ACKing in random order, both with every node as a seed.
struct Steady {
    ledger: Arc<Ledger>,
    events: u64,
    /// The group's home when the load started.
    home: String,
    publishing: tokio::task::JoinHandle<()>,
    consuming: tokio::task::JoinHandle<eventmesh_client::Subscription>,
    stop: tokio::sync::watch::Sender<bool>,
}

impl Steady {
    async fn start(nodes: &[&Node], topic: &str, events: u64) -> Steady {
        let consumer = client(nodes, "steady-consumer").await;
        let publisher = client(nodes, "steady-publisher").await;
        // Kafka topics are created by their first publish.
        publisher.publish(topic, event(0)).await.unwrap();
        let ledger = Arc::new(Ledger::default());
        ledger.published(event(0).id);
        let subscription = consumer
            .subscribe(
                SubscribeOptions::new(topic)
                    .group("g")
                    .start(StartPosition::Earliest)
                    .max_in_flight(64),
            )
            .await
            .unwrap();
        let home = subscription.session().unwrap().instance_id;
        let (consuming, stop) = spawn_consumer(subscription, Arc::clone(&ledger), 7);
        let publishing = {
            let ledger = Arc::clone(&ledger);
            let topic = topic.to_owned();
            tokio::spawn(async move {
                for n in 1..events {
                    publisher.publish(&topic, event(n)).await.unwrap();
                    ledger.published(event(n).id);
                    tokio::time::sleep(Duration::from_millis(2)).await;
                }
            })
        };
        Steady {
            ledger,
            events,
            home,
            publishing,
            consuming,
            stop,
        }
    }

    /// Waits until `n` distinct events were delivered.
    async fn delivered(&self, n: usize) {
        eventually("deliveries under way", Duration::from_secs(60), || {
            self.ledger.count().distinct_delivered >= n
        })
        .await;
    }

    /// Waits until another instance than `old_home` delivers; returns how long that took.
    async fn moved_from(&self, old_home: &str, since: Instant) -> Duration {
        eventually("the group delivers again", Duration::from_secs(60), || {
            self.ledger
                .latest_instance()
                .is_some_and(|i| &*i != old_home)
        })
        .await;
        since.elapsed()
    }

    /// Waits until everything published was delivered; checks nothing was lost.
    async fn finish(self, label: &str) -> support::Count {
        self.publishing.await.unwrap();
        let events = self.events as usize;
        eventually(label, Duration::from_secs(120), || {
            let count = self.ledger.count();
            count.published == events && count.lost == 0
        })
        .await;
        let _ = self.stop.send(true);
        self.consuming.await.unwrap().close().await;
        let count = self.ledger.count();
        eprintln!("{label}: {count:?}");
        assert_eq!(count.lost, 0, "{label}");
        count
    }
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
    let load = Steady::start(&all, &topic, 3_000).await;
    load.delivered(500).await;
    // The last mirror write that landed before the kill holds progress up to one period old:
    // the 300 ms interval plus the time a write takes (the loop sleeps, then writes). 200 ms
    // covers that write on a loaded 2-core machine; the kill itself (three processes, one after
    // the other) falls inside the window too, since DURABLE answers stop only with the last.
    let durable_before = load.ledger.durable_count();
    tokio::time::sleep(Duration::from_millis(300 + 200)).await;
    let killed = Instant::now();
    let home = load.home.clone();
    let home_node = nodes.iter_mut().find(|n| n.id == home).unwrap();
    home_node.kill_all().await;
    let durable_in_last_period = load.ledger.durable_count() - durable_before;
    let resumed = load.moved_from(&home, killed).await;
    eprintln!("kill -9 of the home: delivering again after {resumed:?}");
    let ledger = Arc::clone(&load.ledger);
    let count = load.finish("kill -9 failover").await;
    // Counted at the end: deliveries the killed home had sent before it died and the
    // application took afterwards are included.
    let unsettled_at_kill = ledger.unsettled_by_replaced_instances();
    let bound = unsettled_at_kill + durable_in_last_period;
    eprintln!(
        "unsettled at the kill {unsettled_at_kill}, ACKed durable in the last mirror period {durable_in_last_period}"
    );
    assert!(count.duplicates <= bound, "{count:?} > {bound}");
}

/// A frozen home (SIGSTOP of its dispatcher): its lease runs out, another instance takes the
/// group over; thawed after that, it must give the group up, never deliver beside the new home.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_frozen_home_is_fenced_and_gives_its_group_up() {
    let _serial = serial().await;
    let etcd = Etcd::start_own();
    let kafka = KafkaBroker::get();
    let nodes = [
        node("fz-a", &etcd, Some(&kafka)).await,
        node("fz-b", &etcd, Some(&kafka)).await,
    ];
    let topic = format!("frozen-home-{}", rand::random::<u32>());
    let all: Vec<&Node> = nodes.iter().collect();
    let load = Steady::start(&all, &topic, 2_500).await;
    load.delivered(300).await;
    let home = load.home.clone();
    let home_node = nodes.iter().find(|n| n.id == home).unwrap();
    let frozen = Instant::now();
    home_node
        .instance
        .signal(Service::Dispatcher, "STOP")
        .unwrap();
    let resumed = load.moved_from(&home, frozen).await;
    eprintln!("SIGSTOP of the home: delivering again after {resumed:?}");
    let (_, frozen_last) = load.ledger.delivery_span(&home).unwrap();
    home_node
        .instance
        .signal(Service::Dispatcher, "CONT")
        .unwrap();
    // Thawed, it registers again (a new lease) and serves no group it lost.
    let key = format!("/em/instances/{home}");
    let wait = Duration::from_secs(30);
    if within(wait, || etcd_get(&etcd, &key).is_some())
        .await
        .is_none()
    {
        panic!(
            "the thawed instance registers again: not within {wait:?}; its dispatcher's log ends:\n{}",
            log_tail(home_node, Service::Dispatcher, 40)
        );
    }
    tokio::time::sleep(Duration::from_secs(1)).await;
    let new_home = load.ledger.latest_instance().unwrap();
    let (new_first, _) = load.ledger.delivery_span(&new_home).unwrap();
    assert!(frozen_last < new_first, "the two homes' deliveries overlap");
    assert_eq!(
        load.ledger.delivery_span(&home).unwrap().1,
        frozen_last,
        "the thawed home delivered again"
    );
    load.finish("SIGSTOP failover").await;
}

/// Mirror off: a taken-over group replays from EARLIEST; nothing lost.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_the_mirror_a_moved_group_replays_from_earliest() {
    let _serial = serial().await;
    let etcd = Etcd::start_own();
    let kafka = KafkaBroker::get();
    let off = ["--mirror-progress", "false"];
    let mut nodes = [
        try_node("mo-a", &etcd, Some(&kafka), &off).await.unwrap(),
        try_node("mo-b", &etcd, Some(&kafka), &off).await.unwrap(),
    ];
    let topic = format!("mirror-off-{}", rand::random::<u32>());
    let all: Vec<&Node> = nodes.iter().collect();
    let load = Steady::start(&all, &topic, 600).await;
    load.delivered(300).await;
    eventually("event 0 ACKed durably", Duration::from_secs(30), || {
        load.ledger.durable_count() > 100
    })
    .await;
    let home = load.home.clone();
    let killed = Instant::now();
    nodes
        .iter_mut()
        .find(|n| n.id == home)
        .unwrap()
        .kill_all()
        .await;
    let resumed = load.moved_from(&home, killed).await;
    eprintln!("mirror off: delivering again after {resumed:?}");
    eventually("event 0 delivered again", Duration::from_secs(60), || {
        load.ledger.deliveries_of(&event(0).id) >= 2
    })
    .await;
    load.finish("mirror off").await;
}

/// A TCP proxy in front of etcd that a test can cut: existing connections are dropped and new
/// ones accepted but never forwarded (a partition between one instance and etcd, while its
/// clients still reach it).
struct EtcdLink {
    endpoint: String,
    cut: tokio::sync::watch::Sender<bool>,
    task: tokio::task::JoinHandle<()>,
}

impl EtcdLink {
    async fn to(etcd: &Etcd) -> EtcdLink {
        let upstream: std::net::SocketAddr = etcd.endpoints()[0]
            .trim_start_matches("http://")
            .parse()
            .unwrap();
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let endpoint = format!("http://{}", listener.local_addr().unwrap());
        let (cut, cut_rx) = tokio::sync::watch::channel(false);
        let task = tokio::spawn(async move {
            while let Ok((mut inbound, _)) = listener.accept().await {
                let mut cut_rx = cut_rx.clone();
                tokio::spawn(async move {
                    if *cut_rx.borrow() {
                        // Blackholed: held open, never answered, until the link is restored.
                        let _ = cut_rx.wait_for(|cut| !*cut).await;
                        return;
                    }
                    let Ok(mut outbound) = tokio::net::TcpStream::connect(upstream).await else {
                        return;
                    };
                    tokio::select! {
                        _ = tokio::io::copy_bidirectional(&mut inbound, &mut outbound) => {}
                        _ = cut_rx.wait_for(|cut| *cut) => {}
                    }
                });
            }
        });
        EtcdLink {
            endpoint,
            cut,
            task,
        }
    }

    fn set_cut(&self, cut: bool) {
        self.cut.send_replace(cut);
    }
}

impl Drop for EtcdLink {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// An instance cut off from etcd only (its clients still reach it) fences within the limit;
/// its group moves; nothing lost; the two homes never deliver at the same time; restored, it
/// registers again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_instance_cut_off_from_etcd_fences_and_its_group_moves() {
    let _serial = serial().await;
    let etcd = Etcd::start_own();
    let kafka = KafkaBroker::get();
    let links = [EtcdLink::to(&etcd).await, EtcdLink::to(&etcd).await];
    let nodes = [
        try_node_at("cut-a", &links[0].endpoint, Some(&kafka), &[])
            .await
            .unwrap(),
        try_node_at("cut-b", &links[1].endpoint, Some(&kafka), &[])
            .await
            .unwrap(),
    ];
    let topic = format!("cut-off-{}", rand::random::<u32>());
    let all: Vec<&Node> = nodes.iter().collect();
    let load = Steady::start(&all, &topic, 2_500).await;
    load.delivered(300).await;
    let home = load.home.clone();
    let index = nodes.iter().position(|n| n.id == home).unwrap();
    let cut_at = Instant::now();
    links[index].set_cut(true);
    let resumed = load.moved_from(&home, cut_at).await;
    eprintln!("home cut off from etcd: delivering again after {resumed:?}");
    let log = std::fs::read_to_string(nodes[index].instance.log_file(Service::Dispatcher)).unwrap();
    assert!(
        log.contains("home lease lost"),
        "the cut-off home fenced itself"
    );
    let (_, old_last) = load.ledger.delivery_span(&home).unwrap();
    let new_home = load.ledger.latest_instance().unwrap();
    let (new_first, _) = load.ledger.delivery_span(&new_home).unwrap();
    assert!(old_last < new_first, "the two homes' deliveries overlap");
    links[index].set_cut(false);
    let key = format!("/em/instances/{home}");
    eventually(
        "registered again once restored",
        Duration::from_secs(30),
        || etcd_get(&etcd, &key).is_some(),
    )
    .await;
    load.finish("cut off from etcd").await;
}

/// etcd stopped for less than the fencing limit: delivery never stops. Stopped for longer:
/// the instance fences, and resumes when etcd is back on the same data. Nothing lost.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn etcd_outages_short_and_long() {
    let _serial = serial().await;
    let mut etcd = Etcd::start_own();
    // TTL 8 s, keep-alive 1 s: the fencing limit is 7 s. (Stopping etcd takes up to 2 s and
    // starting it again about 1 s, both part of the outage.)
    let node = try_node("out-a", &etcd, None, &["--lease-ttl-secs", "8"])
        .await
        .unwrap();
    let load = Steady::start(&[&node], "outages", 4_000).await;
    load.delivered(300).await;

    let outage = Instant::now();
    etcd.stop();
    let at_stop = load.ledger.count().deliveries;
    tokio::time::sleep(Duration::from_millis(1_000)).await;
    let during = load.ledger.count().deliveries;
    etcd.start();
    eprintln!("short etcd outage: {:?}", outage.elapsed());
    assert!(
        during > at_stop + 50,
        "delivery went on during a short outage ({at_stop} → {during})"
    );
    let log_file = node.instance.log_file(Service::Dispatcher);
    let fenced = || {
        std::fs::read_to_string(&log_file)
            .unwrap_or_default()
            .contains("home lease lost")
    };
    assert!(!fenced(), "a short outage fenced the instance");

    tokio::time::sleep(Duration::from_secs(2)).await;
    etcd.stop();
    eventually(
        "fenced during a long outage",
        Duration::from_secs(20),
        fenced,
    )
    .await;
    tokio::time::sleep(Duration::from_secs(1)).await;
    etcd.start();
    let back = Instant::now();
    let delivered = load.ledger.count().deliveries;
    eventually(
        "delivering again after etcd is back",
        Duration::from_secs(60),
        || load.ledger.count().deliveries > delivered + 50,
    )
    .await;
    eprintln!("etcd back: delivering again after {:?}", back.elapsed());
    load.finish("etcd outages").await;
}

/// etcd unreachable at start: the dispatcher starts, Publish works, Open answers UNAVAILABLE
/// until it has registered, then serves.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_instance_starts_without_etcd_and_registers_later() {
    let _serial = serial().await;
    let mut etcd = Etcd::start_own();
    etcd.stop();
    let node = try_node("late-a", &etcd, None, &[]).await.unwrap();
    let sdk = client(&[&node], "late").await;
    sdk.publish("late", event(0)).await.unwrap();
    let refused = raw_open(&node, "late-raw", "late", "g").await;
    assert_eq!(refused.code(), tonic::Code::Unavailable, "{refused}");
    etcd.start();
    eventually("registered", Duration::from_secs(30), || {
        etcd_get(&etcd, "/em/instances/late-a").is_some()
    })
    .await;
    let mut subscription = sdk
        .subscribe(
            SubscribeOptions::new("late")
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
    assert_eq!(first.event.id, event(0).id);
    first.ack();
    subscription.close().await;
}

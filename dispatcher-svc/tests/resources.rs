//! Bounded resources for everything ever seen (issue 10, item 8): groups that end leave no
//! group, budget or label behind in the dispatcher; readers no dispatcher uses any more are
//! evicted from the puller with their cursors, checkpoint files and Kafka consumers (and so
//! their threads); topics are created on publish or subscribe only where that is allowed.

#![allow(clippy::unwrap_used)]

mod support;

use std::sync::Arc;
use std::time::Duration;

use eventmesh_proto::client::SubscriptionMode;
use eventmesh_testkit::KafkaBroker;
use puller_svc::cursors::StartAt;
use puller_svc::local_log::LogSettings;
use puller_svc::storage::Storage;
use puller_svc::storage::kafka::KafkaStorage;
use puller_svc::storage::local::LocalStorage;
use support::*;
use tonic::Code;

fn checkpoint_files(dir: &std::path::Path) -> usize {
    std::fs::read_dir(dir)
        .unwrap()
        .filter(|e| {
            e.as_ref()
                .unwrap()
                .file_name()
                .to_string_lossy()
                .contains("pull-offsets")
        })
        .count()
}

/// Threads of this process whose name starts with `prefix` (librdkafka names its own `rdk:`).
fn threads_named(prefix: &str) -> usize {
    std::fs::read_dir("/proc/self/task")
        .unwrap()
        .filter_map(|task| std::fs::read_to_string(task.ok()?.path().join("comm")).ok())
        .filter(|name| name.starts_with(prefix))
        .count()
}

fn rss_kib() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .unwrap()
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches(" kB").trim().parse().ok())
        .unwrap_or(0)
}

async fn wait_until(what: &str, wait: Duration, mut done: impl FnMut() -> bool) {
    let deadline = tokio::time::Instant::now() + wait;
    while !done() {
        assert!(
            tokio::time::Instant::now() < deadline,
            "{what}: not within {wait:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

fn short_lived() -> dispatcher_svc::config::DeliverySettings {
    dispatcher_svc::config::DeliverySettings {
        group_grace_ms: 100,
        ..fast_settings()
    }
}

/// One BROADCAST client after another (each its own group, its own reader, its own checkpoint
/// file): once they are gone, the dispatcher holds no group or budget for them and the puller
/// no reader, cursor or file.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_thousand_short_lived_broadcast_clients_leave_nothing_behind() {
    let dir = tempfile::tempdir().unwrap();
    let offsets =
        start_offset_svc(&dir.path().join("offsets"), "127.0.0.1:0".parse().unwrap()).await;
    let puller_dir = dir.path().join("puller");
    let storage: Arc<dyn Storage> = Arc::new(
        LocalStorage::open(&puller_dir, LogSettings::default(), StartAt::Earliest).unwrap(),
    );
    let checkpoints = puller_svc::server::spawn_checkpoints(
        Arc::clone(&storage),
        Duration::from_millis(100),
        eventmesh_common::shutdown::CancellationToken::new(),
    );
    let (puller, readers) =
        start_puller_configured(Arc::clone(&storage), offsets.local_addr(), |grpc| {
            grpc.with_reader_idle(Duration::from_millis(500))
        })
        .await;
    let (dispatcher, shared) =
        start_dispatcher(puller.local_addr(), offsets.local_addr(), short_lived()).await;
    let addr = dispatcher.local_addr();
    let mut client =
        eventmesh_proto::client::event_mesh_service_client::EventMeshServiceClient::new(lazy(addr));
    publish(&mut client, "fanout", 0..1).await;
    let baseline_files = checkpoint_files(&puller_dir);
    let baseline_rss = rss_kib();
    let clients: Vec<String> = (0..1_000).map(|i| format!("c{i}")).collect();
    for wave in clients.chunks(50) {
        let sessions = wave.iter().map(|id| async move {
            let mut session =
                subscribe(addr, open(id, "fanout", "", SubscriptionMode::Broadcast)).await;
            let got = session.deliveries(1, Duration::from_secs(10)).await;
            assert_eq!(got.len(), 1, "{id} got the event");
            session.ack_durably(&got).await;
        });
        futures::future::join_all(sessions).await;
    }
    let peak_files = checkpoint_files(&puller_dir);
    println!(
        "after 1,000 clients: {} groups, {} readers, {peak_files} checkpoint files, RSS {} KiB (baseline {baseline_rss})",
        shared.group_count(),
        readers.reader_count(),
        rss_kib()
    );
    wait_until("every group ended", Duration::from_secs(30), || {
        shared.group_count() == 0
    })
    .await;
    // Pull loops still in their long poll return their charges within 500 ms.
    wait_until(
        "no budget left for the topic",
        Duration::from_secs(10),
        || shared.budget_count() == 0,
    )
    .await;
    wait_until("every reader evicted", Duration::from_secs(30), || {
        readers.reader_count() == 0
    })
    .await;
    wait_until(
        "checkpoint files back to baseline",
        Duration::from_secs(30),
        || checkpoint_files(&puller_dir) == baseline_files,
    )
    .await;
    println!(
        "after eviction: RSS {} KiB (baseline {baseline_rss}, files peaked at {peak_files})",
        rss_kib()
    );
    // A client that comes back after its reader was evicted resumes from its stored progress.
    let mut back = subscribe(addr, open("c7", "fanout", "", SubscriptionMode::Broadcast)).await;
    assert!(
        back.deliveries(1, Duration::from_millis(800))
            .await
            .is_empty(),
        "its ACKed event does not come back"
    );
    drop(back);
    checkpoints.abort();
}

/// On Kafka every reader has a consumer with threads of its own: readers of groups that are
/// gone are evicted and their threads end.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn evicted_kafka_readers_take_their_consumer_threads_with_them() {
    let broker = KafkaBroker::get();
    let dir = tempfile::tempdir().unwrap();
    let offsets =
        start_offset_svc(&dir.path().join("offsets"), "127.0.0.1:0".parse().unwrap()).await;
    let storage: Arc<dyn Storage> = Arc::new(
        KafkaStorage::new(
            broker.bootstrap(),
            dir.path().join("puller"),
            StartAt::Earliest,
        )
        .unwrap(),
    );
    let (puller, readers) =
        start_puller_configured(Arc::clone(&storage), offsets.local_addr(), |grpc| {
            grpc.with_default_partitions(1)
                .with_reader_idle(Duration::from_millis(500))
        })
        .await;
    let (dispatcher, shared) =
        start_dispatcher(puller.local_addr(), offsets.local_addr(), short_lived()).await;
    let addr = dispatcher.local_addr();
    let topic = format!("evict-{}", std::process::id());
    let mut client =
        eventmesh_proto::client::event_mesh_service_client::EventMeshServiceClient::new(lazy(addr));
    publish(&mut client, &topic, 0..1).await;
    let baseline = threads_named("rdk:");
    for i in 0..10 {
        let id = format!("k{i}");
        let mut session = subscribe(addr, open(&id, &topic, "", SubscriptionMode::Broadcast)).await;
        let got = session.deliveries(1, Duration::from_secs(20)).await;
        assert_eq!(got.len(), 1, "{id} got the event");
        session.ack_durably(&got).await;
    }
    let peak = threads_named("rdk:");
    assert!(
        peak > baseline,
        "each reader's consumer runs threads: {baseline} -> {peak}"
    );
    assert!(storage.reader_count() >= 1);
    wait_until("every group ended", Duration::from_secs(30), || {
        shared.group_count() == 0
    })
    .await;
    wait_until("every reader evicted", Duration::from_secs(30), || {
        readers.reader_count() == 0 && storage.reader_count() == 0
    })
    .await;
    wait_until("consumer threads gone", Duration::from_secs(30), || {
        threads_named("rdk:") <= baseline
    })
    .await;
    println!(
        "librdkafka threads: {baseline} before, {peak} with 10 readers, {} after eviction",
        threads_named("rdk:")
    );
}

/// With auto-creation off (the default for brokers), a publish or subscribe naming a topic
/// that does not exist is refused at once with NOT_FOUND, not retried or created.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_auto_creation_unknown_topics_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let offsets =
        start_offset_svc(&dir.path().join("offsets"), "127.0.0.1:0".parse().unwrap()).await;
    let storage: Arc<dyn Storage> = Arc::new(
        LocalStorage::open(
            dir.path().join("puller"),
            LogSettings::default(),
            StartAt::Earliest,
        )
        .unwrap(),
    );
    let (puller, _) = start_puller_configured(Arc::clone(&storage), offsets.local_addr(), |grpc| {
        grpc.with_auto_create_topics(false)
    })
    .await;
    let (dispatcher, _shared) =
        start_dispatcher(puller.local_addr(), offsets.local_addr(), fast_settings()).await;
    let addr = dispatcher.local_addr();
    let mut client =
        eventmesh_proto::client::event_mesh_service_client::EventMeshServiceClient::new(lazy(addr));
    let status = client
        .publish(eventmesh_proto::client::PublishRequest {
            topic: "missing".into(),
            event: Some(event(1)),
            key: String::new(),
        })
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::NotFound, "{status}");
    assert!(status.message().contains("auto_create_topics"), "{status}");
    let status = try_subscribe(
        addr,
        open("c", "missing", "", SubscriptionMode::LoadBalance),
    )
    .await
    .err()
    .unwrap();
    assert_eq!(status.code(), Code::NotFound, "{status}");
    assert!(
        storage
            .end_offsets(&eventmesh_common::keys::Topic::new("missing").unwrap())
            .await
            .is_err(),
        "not created"
    );
    // An explicit creation goes through, and then both work.
    storage
        .create_topic(&eventmesh_common::keys::Topic::new("missing").unwrap(), 1)
        .await
        .unwrap();
    publish(&mut client, "missing", 0..1).await;
    let mut session = subscribe(
        addr,
        open("c", "missing", "", SubscriptionMode::LoadBalance),
    )
    .await;
    assert_eq!(
        session.deliveries(1, Duration::from_secs(10)).await.len(),
        1
    );
}

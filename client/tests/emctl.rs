//! `emctl` publish / subscribe / offsets / reset-offsets against a real local instance.

#![allow(clippy::unwrap_used)]

use std::io::Write;
use std::path::Path;
use std::process::{Command, Output, Stdio};
use std::time::Duration;

use eventmesh_client::local::{LocalConfig, LocalInstance, Service};

mod support;

fn emctl(instance: &LocalInstance, args: &[&str], stdin: &str) -> Output {
    let mut child = Command::new(env!("CARGO_BIN_EXE_emctl"))
        .args(args)
        .env("EMCTL_ENDPOINT", instance.endpoint())
        .env("EMCTL_OFFSET_SVC", instance.uri(Service::Offset))
        .env("EMCTL_PULLER", instance.uri(Service::Puller))
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    child
        .stdin
        .take()
        .unwrap()
        .write_all(stdin.as_bytes())
        .unwrap();
    child.wait_with_output().unwrap()
}

fn ok(output: &Output) -> String {
    assert!(
        output.status.success(),
        "emctl failed: {}\n{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    String::from_utf8_lossy(&output.stdout).into_owned()
}

fn watermarks(instance: &LocalInstance) -> Vec<(i64, Option<i64>)> {
    let view: serde_json::Value = serde_json::from_str(&ok(&emctl(
        instance,
        &["offsets", "--topic", "cli", "--json"],
        "",
    )))
    .unwrap();
    view.as_array()
        .unwrap()
        .iter()
        .map(|p| (p["end"].as_i64().unwrap(), p["watermarks"]["g"].as_i64()))
        .collect()
}

#[tokio::test]
async fn publish_subscribe_offsets_and_a_confirmed_reset() {
    let dir = tempfile::tempdir().unwrap();
    let emctl_dir = Path::new(env!("CARGO_BIN_EXE_emctl")).parent().unwrap();
    let mut config = LocalConfig::new(dir.path());
    config.bin_dir = Some(emctl_dir.to_owned());
    let instance = LocalInstance::start(config).await.unwrap();

    let out = ok(&emctl(
        &instance,
        &["publish", "--topic", "cli", "--count", "20"],
        "",
    ));
    assert!(out.contains("published 20 events"), "{out}");
    let output = emctl(
        &instance,
        &[
            "subscribe",
            "--topic",
            "cli",
            "--group",
            "g",
            "--start",
            "earliest",
            "--count",
            "20",
        ],
        "",
    );
    let out = ok(&output);
    assert_eq!(out.lines().count(), 20, "{out}");
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(stderr.contains("ACKs durable 20"), "{stderr}");

    // Every partition's group watermark reached its end: lag 0.
    let view = watermarks(&instance);
    assert_eq!(view.iter().map(|(end, _)| end).sum::<i64>(), 20);
    for (end, watermark) in &view {
        if *end > 0 {
            assert_eq!(*watermark, Some(end - 1), "{view:?}");
        }
    }
    let table = ok(&emctl(&instance, &["offsets", "--topic", "cli"], ""));
    assert!(
        table.contains("group  g") && table.contains("lag 0"),
        "{table}"
    );

    // A reset asks first; "n" changes nothing.
    let reset = [
        "reset-offsets",
        "--topic",
        "cli",
        "--group",
        "g",
        "--to",
        "-1",
        "--reason",
        "replay",
    ];
    let out = ok(&emctl(&instance, &reset, "n\n"));
    assert!(out.contains("nothing changed"), "{out}");
    assert_eq!(watermarks(&instance), view);
    // "y" applies it.
    let out = ok(&emctl(&instance, &reset, "y\n"));
    assert!(out.contains("now -1"), "{out}");
    for (end, watermark) in watermarks(&instance) {
        if end > 0 {
            assert_eq!(watermark, Some(-1));
        }
    }

    // Bad input is refused with a reason.
    let output = emctl(
        &instance,
        &[
            "reset-offsets",
            "--topic",
            "cli",
            "--to",
            "3",
            "--reason",
            "x",
            "--yes",
        ],
        "",
    );
    assert!(!output.status.success());
    assert!(String::from_utf8_lossy(&output.stderr).contains("--group"));
    let output = emctl(&instance, &["publish", "--topic", "bad#topic"], "");
    assert!(!output.status.success());
    assert!(String::from_utf8_lossy(&output.stderr).contains("topic"));
    // The local log has no brokers to ask.
    let output = emctl(&instance, &["rocketmq-check", "--topic", "cli"], "");
    assert!(!output.status.success());
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        stderr.contains("the local backend has no broker storage"),
        "{stderr}"
    );

    instance.stop(std::time::Duration::from_secs(10)).await;
}

/// `emctl rocketmq-check` on `rocketmq4` against a real broker: the commit log, its settings and
/// each consume queue as the broker reports them, beside the group's watermark and cursor; a
/// healthy broker gives no warning (exit 0).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rocketmq_check_reads_the_brokers_storage_beside_our_positions() {
    let rocketmq = eventmesh_testkit::RocketMq::get();
    let dir = tempfile::tempdir().unwrap();
    let emctl_dir = Path::new(env!("CARGO_BIN_EXE_emctl")).parent().unwrap();
    let mut config = LocalConfig::new(dir.path()).args(
        Service::Puller,
        [
            "--backend",
            "rocketmq4",
            "--rocketmq-namesrv",
            rocketmq.namesrv(),
            "--auto-create-topics",
            "true",
        ],
    );
    config.bin_dir = Some(emctl_dir.to_owned());
    let instance = LocalInstance::start(config).await.unwrap();
    let topic = format!("em-check-{}", std::process::id());
    ok(&emctl(
        &instance,
        &["publish", "--topic", &topic, "--count", "12"],
        "",
    ));
    ok(&emctl(
        &instance,
        &[
            "subscribe",
            "--topic",
            &topic,
            "--group",
            "g",
            "--start",
            "earliest",
            "--count",
            "12",
        ],
        "",
    ));
    let table = ok(&emctl(
        &instance,
        &["rocketmq-check", "--topic", &topic],
        "",
    ));
    eprintln!("{table}");
    assert!(table.contains("on rocketmq4"), "{table}");
    assert!(table.contains("fileReservedTime 72 h"), "{table}");
    assert!(table.contains(": in step"), "{table}");
    assert!(table.contains("no warnings"), "{table}");
    let check: serde_json::Value = serde_json::from_str(&ok(&emctl(
        &instance,
        &["rocketmq-check", "--topic", &topic, "--json"],
        "",
    )))
    .unwrap();
    assert_eq!(check["warnings"].as_array().unwrap().len(), 0, "{check}");
    let broker = &check["brokers"][0];
    let commit_log_min = broker["commit_log_min_offset"].as_i64().unwrap();
    let queues = check["queues"].as_array().unwrap();
    let mut total = 0;
    for queue in queues {
        let (min, max) = (
            queue["min_offset"].as_i64().unwrap(),
            queue["max_offset"].as_i64().unwrap(),
        );
        total += max - min;
        if max > min {
            let position = queue["min_entry_commit_log_offset"].as_i64().unwrap();
            assert!(position >= commit_log_min, "{check}");
            // Everything was ACKed: the watermark is the last offset, the cursor past it.
            assert_eq!(queue["watermarks"]["g"].as_i64(), Some(max - 1), "{check}");
            assert_eq!(queue["cursors"]["g"].as_i64(), Some(max), "{check}");
        }
    }
    assert_eq!(total, 12, "{check}");

    let output = emctl(
        &instance,
        &["rocketmq-check", "--topic", "em-check-missing"],
        "",
    );
    assert!(!output.status.success());
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(stderr.contains("em-check-missing"), "{stderr}");
    instance.stop(std::time::Duration::from_secs(10)).await;
}

/// `emctl publish --help` names the placeholder literally (`{n}` used to render as a line
/// break), and `emctl offsets` reads a topic whose offsets exceed 4 MiB (it used tonic's
/// 4 MiB default and failed on topics with many clients).
#[tokio::test]
async fn help_renders_the_placeholder_and_offsets_read_large_topics() {
    let dir = tempfile::tempdir().unwrap();
    let emctl_dir = Path::new(env!("CARGO_BIN_EXE_emctl")).parent().unwrap();
    let mut config = LocalConfig::new(dir.path());
    config.bin_dir = Some(emctl_dir.to_owned());
    let instance = LocalInstance::start(config).await.unwrap();

    let help = ok(&emctl(&instance, &["publish", "--help"], ""));
    assert!(
        help.contains("`<n>` is replaced by the event's number"),
        "{help}"
    );
    assert!(help.contains("[default: \"event <n>\"]"), "{help}");

    ok(&emctl(&instance, &["publish", "--topic", "wide"], ""));
    // 80,000 clients' offsets: about 6 MB of ReadTopicOffsets answer.
    let mut offsets = eventmesh_proto::offset::offset_service_client::OffsetServiceClient::connect(
        instance.uri(Service::Offset),
    )
    .await
    .unwrap();
    let entries: Vec<_> = (0..80_000)
        .map(|i| eventmesh_proto::offset::OffsetEntry {
            key: Some(eventmesh_proto::offset::OffsetKey {
                topic: "wide".into(),
                client_id: format!("a-client-with-a-rather-long-id-{i:08}"),
                partition: "0".into(),
            }),
            offset: 0,
        })
        .collect();
    offsets
        .write_offsets(eventmesh_proto::offset::WriteOffsetsRequest {
            entries,
            sync: false,
        })
        .await
        .unwrap();
    let view: serde_json::Value = serde_json::from_str(&ok(&emctl(
        &instance,
        &["offsets", "--topic", "wide", "--json"],
        "",
    )))
    .unwrap();
    let clients: usize = view
        .as_array()
        .unwrap()
        .iter()
        .map(|p| p["clients"].as_object().unwrap().len())
        .sum();
    assert_eq!(clients, 80_000);
    instance.stop(std::time::Duration::from_secs(10)).await;
}

/// One small row of `emctl bench --json`, as the bench prints it.
/// A bench run's JSON lines: its one throughput row and its idle first-event row.
fn bench_rows(output: &Output) -> (serde_json::Value, serde_json::Value) {
    let stdout = ok(output);
    let parsed: Vec<serde_json::Value> = stdout
        .lines()
        .map(|line| serde_json::from_str(line).unwrap_or_else(|error| panic!("{error}: {stdout}")))
        .collect();
    let [row, idle] = <[serde_json::Value; 2]>::try_from(parsed)
        .unwrap_or_else(|lines| panic!("expected two JSON lines, got {lines:?}"));
    (row, idle)
}

/// `emctl bench` runs a whole (small) round on both backends, twice against one broker, and
/// reports every event delivered and ACKed. On Kafka it once failed at its first publish (the
/// puller creates Kafka topics only when told to); each run names its own topics, so a second
/// run against the same broker starts on empty ones.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bench_runs_on_the_local_log_and_twice_on_one_kafka_broker() {
    let kafka = eventmesh_testkit::KafkaBroker::get();
    let dir = tempfile::tempdir().unwrap();
    let data_dir = dir.path().to_str().unwrap();
    let small = [
        "bench",
        "--events",
        "300",
        "--sizes",
        "64",
        "--streams",
        "2",
        "--json",
        "--idle-samples",
        "5",
        "--idle-gap-ms",
        "50",
        "--data-dir",
        data_dir,
    ];
    let run = |extra: &[&str]| {
        let output = Command::new(env!("CARGO_BIN_EXE_emctl"))
            .args(small)
            .args(extra)
            .output()
            .unwrap();
        let (row, idle) = bench_rows(&output);
        // The idle probe: every sample timed, publish → delivery no shorter than publish alone
        // would be a broken clock, so only order and presence are checked.
        assert_eq!(idle["idle_samples"], 5, "{idle}");
        let p50 = idle["first_event_p50_ms"].as_f64().unwrap();
        assert!(p50 > 0.0, "{idle}");
        assert!(
            idle["first_event_p99_ms"].as_f64().unwrap() >= p50,
            "{idle}"
        );
        assert!(
            idle["first_event_max_ms"].as_f64().unwrap() >= p50,
            "{idle}"
        );
        row
    };
    let local = run(&[]);
    let third = eventmesh_client::local::a_third_of_the_cores();
    for (process, expected) in [("puller", third), ("offset", third), ("client", third)] {
        assert_eq!(local["worker_threads"][process], expected, "{local}");
    }
    let two = run(&["--worker-threads", "2"]);
    for process in ["dispatcher", "puller", "offset", "client"] {
        assert_eq!(two["worker_threads"][process], 2, "{two}");
    }
    let kafka_args = [
        "--backend",
        "kafka",
        "--kafka-bootstrap",
        kafka.bootstrap(),
        "--puller-arg=--kafka-fetch-wait-ms=5",
    ];
    let kafka_rows = [run(&kafka_args), run(&kafka_args)];
    for row in std::iter::once(&local).chain(&kafka_rows) {
        for rss in ["rss_mib_dispatcher", "rss_mib_puller", "rss_mib_offset"] {
            assert!(row[rss].as_f64().unwrap() > 1.0, "{rss}: {row}");
        }
        assert_eq!(row["events"], 300, "{row}");
        assert_eq!(row["streams"], 2, "{row}");
        for rate in [
            "publish_per_sec",
            "raw_pull_per_sec",
            "e2e_per_sec",
            "live_per_sec",
            "half_rate_per_sec",
        ] {
            assert!(row[rate].as_f64().unwrap() > 0.0, "{rate}: {row}");
        }
        for phase in ["full", "live", "half"] {
            let p50 = row[format!("{phase}_ack_p50_ms")].as_f64().unwrap();
            let p99 = row[format!("{phase}_ack_p99_ms")].as_f64().unwrap();
            assert!(p50 > 0.0 && p99 >= p50, "{phase}: {row}");
        }
        assert_eq!(row["half_load_of"], "live", "{row}");
    }
    assert_eq!(local["backend"], "local");
    assert_eq!(kafka_rows[1]["backend"], "kafka");
    // The run's data directory is removed afterwards.
    assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0);
}

/// Each service of a local instance runs as many async workers as it is given, and says so in
/// its log, with huge pages off; 0 leaves the service's default, a worker per core; by default
/// the dispatcher keeps that and the other two get a third of the cores.
#[tokio::test]
async fn a_local_instance_starts_each_service_with_its_worker_threads() {
    let default = std::env::var("TOKIO_WORKER_THREADS").map_or_else(
        |_| std::thread::available_parallelism().map_or(1, std::num::NonZeroUsize::get),
        |value| value.parse().unwrap(),
    );
    let third = eventmesh_client::local::a_third_of_the_cores();
    // Offset, puller, dispatcher (Service::ALL): as given, 0 as the default, and co-located.
    for (workers, expected) in [
        (Some([3, 2, 0]), [3, 2, default]),
        (None, [third, third, default]),
    ] {
        let dir = tempfile::tempdir().unwrap();
        let mut config = LocalConfig::new(dir.path());
        if let Some(workers) = workers {
            config.worker_threads = workers;
        }
        let instance = LocalInstance::start(config).await.unwrap();
        let logs: Vec<String> = Service::ALL
            .iter()
            .map(|service| std::fs::read_to_string(instance.log_file(*service)).unwrap())
            .collect();
        instance.stop(Duration::from_secs(10)).await;
        for ((service, log), expected) in Service::ALL.iter().zip(&logs).zip(expected) {
            let line = log
                .lines()
                .find(|line| line.contains("async runtime started"))
                .unwrap_or_else(|| panic!("{service}: no start-up line in {log}"));
            assert!(
                line.contains(&format!("workers={expected}")),
                "{service} given {workers:?}: {line}"
            );
            assert!(line.contains("huge_pages_off=true"), "{service}: {line}");
        }
    }
}

/// One `emctl top --json` frame of `topic`'s groups.
fn top_frame(instance: &LocalInstance, topic: &str) -> serde_json::Value {
    let out = ok(&emctl(
        instance,
        &["top", "--topic", topic, "--json", "--count", "1"],
        "",
    ));
    serde_json::from_str(out.trim()).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn top_shows_a_groups_rates_lag_in_flight_and_settlements() {
    let dir = tempfile::tempdir().unwrap();
    let emctl_dir = Path::new(env!("CARGO_BIN_EXE_emctl")).parent().unwrap();
    // A group ends 1.5 s after its last session (checked at the end).
    let mut config =
        metered_config(dir.path()).args(Service::Dispatcher, ["--group-grace-ms", "1500"]);
    config.bin_dir = Some(emctl_dir.to_owned());
    let instance = LocalInstance::start(config).await.unwrap();
    ok(&emctl(
        &instance,
        &["publish", "--topic", "top", "--count", "40"],
        "",
    ));
    // No group yet: an empty frame, not an error.
    let frame = top_frame(&instance, "top");
    assert_eq!(frame["groups"].as_array().unwrap().len(), 0, "{frame}");

    let mut subscription = subscribe_earliest(&instance, "top-client", "top", "watched").await;
    // 40 delivered: the first 25 ACKed, the last NACKed (retried in a minute: it stays in
    // backoff), 14 held. Each partition's deliveries come in offset order, so the ACKed ones
    // are a prefix of every partition (lag 15) and, once the held ones are ACKed too, only
    // the NACKed one, its partition's last, is left (lag 1).
    let mut held = Vec::new();
    let mut nacked_partition = None;
    for n in 0..40 {
        let delivery = tokio::time::timeout(Duration::from_secs(20), subscription.next())
            .await
            .unwrap()
            .unwrap()
            .unwrap();
        match n {
            0..25 => delivery.ack_and_wait().await.map(|_| ()).unwrap(),
            39 => {
                nacked_partition = Some(delivery.partition.clone());
                delivery.nack(Duration::from_secs(60))
            }
            _ => held.push(delivery),
        }
    }
    // Groups report every 500 ms: wait for the report that has all of it.
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    let group = loop {
        let frame = top_frame(&instance, "top");
        let group = frame["groups"][0].clone();
        if group["acked_total"] == 25 && group["nacked_total"] == 1 && group["lag"] == 15 {
            break group;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the report never showed 25 ACKs, 1 NACK and lag 15: {frame}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    assert_eq!(group["topic"], "top", "{group}");
    assert_eq!(group["group"], "watched", "{group}");
    assert_eq!(group["sessions"], 1, "{group}");
    assert_eq!(group["delivered_total"], 40, "{group}");
    assert_eq!(group["redelivered_total"], 1, "{group}");
    assert_eq!(group["in_flight"], 14, "{group}");
    assert_eq!(group["backoff"], 1, "{group}");
    assert_eq!(group["dead_lettered_total"], 0, "{group}");
    assert!(group["oldest_unacked_ms"].as_u64().unwrap() > 0, "{group}");

    // The same in the exposition, by partition: the lags add up to the group's, and the one
    // redelivery (the NACK) is counted under its event's partition.
    let nacked_partition = nacked_partition.unwrap();
    let dispatcher_metrics = instance.metrics_addr(Service::Dispatcher);
    let watched = [("topic", "top"), ("group", "watched")];
    wait_for_metric_sum(
        dispatcher_metrics,
        "dispatcher_consumer_lag_records",
        &watched,
        15.0,
    )
    .await;
    // Every partition the group reads has its series (from 0); the NACKed one counts 1.
    let exposition = scrape(dispatcher_metrics);
    let lag_partitions: Vec<String> =
        series(&exposition, "dispatcher_consumer_lag_records", &watched)
            .into_iter()
            .map(|(partition, _)| partition)
            .collect();
    for counter in ["dispatcher_redeliveries_total", "dispatcher_nacks_total"] {
        let counted = series(&exposition, counter, &watched);
        let partitions: Vec<&String> = counted.iter().map(|(partition, _)| partition).collect();
        assert_eq!(
            partitions.len(),
            lag_partitions.len(),
            "{counter}: {counted:?}"
        );
        let nonzero: Vec<&(String, f64)> = counted.iter().filter(|(_, n)| *n > 0.0).collect();
        assert_eq!(
            nonzero,
            vec![&(nacked_partition.clone(), 1.0)],
            "{counter}: one, under the NACKed event's partition"
        );
    }

    // Two frames: the second has rates (14 more ACKs land between them).
    let top = std::process::Command::new(env!("CARGO_BIN_EXE_emctl"))
        .args(["top", "--topic", "top", "--json", "--count", "2"])
        .args(["--interval-ms", "1500"])
        .env("EMCTL_ENDPOINT", instance.endpoint())
        .env("EMCTL_PULLER", instance.uri(Service::Puller))
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    tokio::time::sleep(Duration::from_millis(300)).await;
    for delivery in held.drain(..) {
        delivery.ack_and_wait().await.unwrap();
    }
    let out = ok(&top.wait_with_output().unwrap());
    let frames: Vec<serde_json::Value> = out
        .lines()
        .map(|line| serde_json::from_str(line).unwrap())
        .collect();
    assert_eq!(frames.len(), 2, "{out}");
    assert!(frames[0]["groups"][0]["acked_per_sec"].is_null(), "{out}");
    let second = &frames[1]["groups"][0];
    assert!(second["acked_per_sec"].as_f64().unwrap() > 0.0, "{out}");
    assert_eq!(second["acked_total"], 39, "{out}");
    assert_eq!(second["lag"], 1, "{out}");
    assert_eq!(second["in_flight"], 0, "{out}");
    let lags = wait_for_metric_sum(
        dispatcher_metrics,
        "dispatcher_consumer_lag_records",
        &watched,
        1.0,
    )
    .await;
    assert!(
        lags.contains(&(nacked_partition, 1.0)),
        "the lag left is the NACKed event's partition: {lags:?}"
    );

    // The table, once.
    let table = ok(&emctl(&instance, &["top", "--count", "1"], ""));
    assert!(
        table.contains("TOPIC") && table.contains("watched"),
        "{table}"
    );

    // Every metric the Grafana dashboard queries is in the services' exposition, now that
    // they published, delivered, ACKed and NACKed.
    let exposed: std::collections::HashSet<String> = Service::ALL
        .iter()
        .flat_map(|service| {
            let text = scrape(instance.metrics_addr(*service));
            text.lines()
                .filter(|line| !line.starts_with('#') && !line.trim().is_empty())
                .filter_map(|line| line.split(['{', ' ']).next().map(str::to_owned))
                .collect::<Vec<_>>()
        })
        .collect();
    let dashboard =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/grafana/eventmesh-dashboard.json");
    let dashboard: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dashboard).unwrap()).unwrap();
    let mut queried = Vec::new();
    collect_queried_metrics(&dashboard, &mut queried);
    assert!(queried.len() >= 10, "{queried:?}");
    let missing: Vec<&String> = queried.iter().filter(|m| !exposed.contains(*m)).collect();
    assert!(
        missing.is_empty(),
        "dashboard metrics not exposed: {missing:?}; exposed: {exposed:?}"
    );

    // The group ends once its last session has been gone for the grace period: this instance
    // holds nothing of it any more, so its gauges read 0 — the lag too, which is measured
    // against the partitions' ends and would otherwise keep its last value (a new home
    // reports it).
    drop(subscription);
    for gauge in [
        "dispatcher_group_oldest_unacked_seconds",
        "dispatcher_consumer_lag_records",
    ] {
        wait_for_metric_sum(dispatcher_metrics, gauge, &watched, 0.0).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_record_failing_its_crc_holds_its_partition_counts_pull_errors_and_flows_once_repaired() {
    let dir = tempfile::tempdir().unwrap();
    let instance = metered_instance(dir.path(), "damaged", 20).await;
    // Damage the last record of one partition's segment: its CRC no longer matches.
    let segment = segments(&instance.data_dir().join("puller"))
        .into_iter()
        .find(|path| {
            path.components().any(|c| c.as_os_str() == "damaged")
                && std::fs::metadata(path).unwrap().len() > 0
        })
        .expect("a segment of the topic with records");
    let partition = segment
        .parent()
        .unwrap()
        .file_name()
        .unwrap()
        .to_string_lossy()
        .into_owned();
    let flip_last_byte = || {
        let mut bytes = std::fs::read(&segment).unwrap();
        let last = bytes.len() - 1;
        bytes[last] ^= 0xFF;
        std::fs::write(&segment, &bytes).unwrap();
    };
    flip_last_byte();

    let mut subscription = subscribe_earliest(&instance, "damage-reader", "damaged", "g").await;
    let delivered = std::sync::Arc::new(std::sync::Mutex::new(Vec::<String>::new()));
    let reader = tokio::spawn({
        let delivered = delivered.clone();
        async move {
            while let Some(Ok(delivery)) = subscription.next().await {
                delivered.lock().unwrap().push(delivery.event.id.clone());
                delivery.ack();
            }
        }
    });
    // The puller counts the failing reads; the damaged partition is held, not skipped: its
    // lag stays while the other partitions are delivered.
    let puller_metrics = instance.metrics_addr(Service::Puller);
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    while pull_errors(&scrape(puller_metrics)) < 1.0 {
        assert!(
            std::time::Instant::now() < deadline,
            "puller_pull_errors_total never rose"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    // Every other partition is delivered meanwhile: what is missing is the damaged
    // partition's lag.
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    loop {
        let held = series(
            &scrape(instance.metrics_addr(Service::Dispatcher)),
            "dispatcher_consumer_lag_records",
            &[
                ("topic", "damaged"),
                ("group", "g"),
                ("partition", &partition),
            ],
        );
        let count = delivered.lock().unwrap().len();
        if let [(_, lag)] = held.as_slice()
            && *lag >= 1.0
            && count as f64 == 20.0 - lag
        {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "partition {partition} should be held (lag {held:?}) and the rest delivered ({count})"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }

    // Repaired (the byte restored), the partition flows: all 20, each once.
    flip_last_byte();
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while delivered.lock().unwrap().len() < 20 {
        assert!(
            std::time::Instant::now() < deadline,
            "only {} of 20 delivered after the repair",
            delivered.lock().unwrap().len()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let ids: std::collections::HashSet<String> =
        delivered.lock().unwrap().iter().cloned().collect();
    assert_eq!(ids.len(), 20, "{:?}", delivered.lock().unwrap());
    assert_eq!(delivered.lock().unwrap().len(), 20, "nothing twice");
    reader.abort();
}

/// The lag gauge while puller-svc cannot answer: the last values are kept (a lag that
/// cannot be measured is not "no lag"), even as ACKs move the watermarks; once puller-svc is
/// back the gauge follows them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_lag_gauge_keeps_its_last_values_while_the_puller_cannot_answer() {
    let dir = tempfile::tempdir().unwrap();
    let instance = metered_instance(dir.path(), "blind", 10).await;
    let mut subscription = subscribe_earliest(&instance, "blind-reader", "blind", "g").await;
    let mut held = support::take_deliveries(&mut subscription, 10).await;
    let metrics = instance.metrics_addr(Service::Dispatcher);
    let group = [("topic", "blind"), ("group", "g")];
    let lag = "dispatcher_consumer_lag_records";
    wait_for_metric_sum(metrics, lag, &group, 10.0).await;

    // puller-svc frozen: the ranges cannot be read (the dispatcher says so once).
    instance.signal(Service::Puller, "STOP").unwrap();
    let log = instance.log_file(Service::Dispatcher);
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    while !std::fs::read_to_string(&log)
        .unwrap_or_default()
        .contains("cannot read the topic's ranges for consumer lag")
    {
        assert!(
            std::time::Instant::now() < deadline,
            "the failed lag read was never logged"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    // Every delivery ACKed and durable (offset-svc answers): the lag is not re-measured.
    for delivery in held.drain(..) {
        delivery.ack_and_wait().await.unwrap();
    }
    tokio::time::sleep(Duration::from_secs(1)).await;
    let kept: f64 = series(
        &tokio::task::block_in_place(|| scrape(metrics)),
        lag,
        &group,
    )
    .iter()
    .map(|(_, value)| value)
    .sum();
    assert_eq!(kept, 10.0, "the last measured lag is kept, not zeroed");

    instance.signal(Service::Puller, "CONT").unwrap();
    wait_for_metric_sum(metrics, lag, &group, 0.0).await;
    drop(subscription);
}

/// An instance in `dir` whose metrics are scraped: known metrics ports, and lag gauges
/// measured every 300 ms (so a test need not wait the default 5 s).
fn metered_config(dir: &Path) -> LocalConfig {
    let mut config = LocalConfig::new(dir).args(Service::Dispatcher, ["--lag-interval-ms", "300"]);
    for addr in &mut config.metrics_listen {
        *addr = free_loopback_addr();
    }
    config
}

/// A [`metered_config`] instance in `dir`, with `count` events published to `topic`.
async fn metered_instance(dir: &Path, topic: &str, count: u32) -> LocalInstance {
    let instance = LocalInstance::start(metered_config(dir)).await.unwrap();
    let count = count.to_string();
    ok(&emctl(
        &instance,
        &["publish", "--topic", topic, "--count", &count],
        "",
    ));
    instance
}

/// A subscription of `group` on `topic` from the earliest record, as `client_id`.
async fn subscribe_earliest(
    instance: &LocalInstance,
    client_id: &str,
    topic: &str,
    group: &str,
) -> eventmesh_client::Subscription {
    use eventmesh_client::{Client, ClientConfig, StartPosition, SubscribeOptions};
    let client = Client::connect(ClientConfig::new(client_id).endpoint(instance.endpoint()))
        .await
        .unwrap();
    client
        .subscribe(
            SubscribeOptions::new(topic)
                .group(group)
                .start(StartPosition::Earliest),
        )
        .await
        .unwrap()
}

/// `puller_pull_errors_total{backend="local"}` in an exposition (0 when absent).
fn pull_errors(exposition: &str) -> f64 {
    exposition
        .lines()
        .find_map(|line| line.strip_prefix("puller_pull_errors_total{backend=\"local\"} "))
        .map_or(0.0, |value| value.trim().parse().unwrap())
}

/// Every `*.log` file under `dir`.
fn segments(dir: &Path) -> Vec<std::path::PathBuf> {
    let mut found = Vec::new();
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            found.extend(segments(&path));
        } else if path.extension().is_some_and(|e| e == "log") {
            found.push(path);
        }
    }
    found.sort();
    found
}

fn free_loopback_addr() -> std::net::SocketAddr {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
}

/// The `partition` label and value of every `name` series whose labels include `labels`.
fn series(exposition: &str, name: &str, labels: &[(&str, &str)]) -> Vec<(String, f64)> {
    let mut found: Vec<(String, f64)> = exposition
        .lines()
        .filter_map(|line| {
            let rest = line.strip_prefix(name)?.strip_prefix('{')?;
            let (label_text, value) = rest.split_once("} ")?;
            let mut partition = String::new();
            let mut matched = 0;
            for pair in label_text.split(',') {
                let (key, quoted) = pair.split_once('=')?;
                let text = quoted.trim_matches('"');
                if key == "partition" {
                    partition = text.to_owned();
                }
                matched += usize::from(labels.contains(&(key, text)));
            }
            let value: f64 = value.trim().parse().ok()?;
            (matched == labels.len()).then_some((partition, value))
        })
        .collect();
    found.sort_by(|a, b| a.0.cmp(&b.0));
    found
}

/// Scrapes until the `name` series matching `labels` add up to `sum` (20 s at most); the
/// series seen.
async fn wait_for_metric_sum(
    addr: std::net::SocketAddr,
    name: &str,
    labels: &[(&str, &str)],
    sum: f64,
) -> Vec<(String, f64)> {
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    loop {
        let found = series(&tokio::task::block_in_place(|| scrape(addr)), name, labels);
        if !found.is_empty() && found.iter().map(|(_, v)| v).sum::<f64>() == sum {
            return found;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "{name}{labels:?} never added up to {sum}: {found:?}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// `GET /metrics` over HTTP/1.0; the body.
fn scrape(addr: std::net::SocketAddr) -> String {
    use std::io::Read;
    let mut stream = std::net::TcpStream::connect(addr).unwrap();
    stream
        .set_read_timeout(Some(Duration::from_secs(5)))
        .unwrap();
    stream
        .write_all(b"GET /metrics HTTP/1.0\r\nHost: localhost\r\n\r\n")
        .unwrap();
    let mut response = String::new();
    stream.read_to_string(&mut response).unwrap();
    let (head, body) = response.split_once("\r\n\r\n").unwrap();
    assert!(
        head.starts_with("HTTP/1.1 200") || head.starts_with("HTTP/1.0 200"),
        "{head}"
    );
    body.to_owned()
}

/// The metric names in every `expr` and `definition` of a Grafana dashboard (panels'
/// targets, template variables): identifiers of ours (`dispatcher_…`, `eventmesh_…`,
/// `grpc_server_…`).
fn collect_queried_metrics(value: &serde_json::Value, found: &mut Vec<String>) {
    match value {
        serde_json::Value::Object(map) => {
            for (key, value) in map {
                match (key.as_str(), value) {
                    ("expr" | "definition", serde_json::Value::String(expr)) => {
                        for token in expr.split(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
                        {
                            let ours = ["dispatcher_", "eventmesh_", "puller_", "grpc_server_"]
                                .iter()
                                .any(|prefix| token.starts_with(prefix));
                            if ours && !found.iter().any(|f| f == token) {
                                found.push(token.to_owned());
                            }
                        }
                    }
                    _ => collect_queried_metrics(value, found),
                }
            }
        }
        serde_json::Value::Array(items) => {
            for item in items {
                collect_queried_metrics(item, found);
            }
        }
        _ => {}
    }
}

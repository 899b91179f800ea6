//! `emctl demo` — the README's run command — runs with a small N and its counted summary is
//! checked for every victim.

#![allow(clippy::unwrap_used)]

use std::path::Path;
use std::process::Command;

fn demo(kill: &str, events: u64) -> serde_json::Value {
    demo_on(kill, events, &[])
}

/// The demo with extra flags (a backend).
fn demo_on(kill: &str, events: u64, extra: &[&str]) -> serde_json::Value {
    let dir = tempfile::tempdir().unwrap();
    let emctl = Path::new(env!("CARGO_BIN_EXE_emctl"));
    let output = Command::new(emctl)
        .args([
            "demo",
            "--json",
            "--events",
            &events.to_string(),
            "--kill",
            kill,
        ])
        .arg("--data-dir")
        .arg(dir.path())
        .arg("--bin-dir")
        .arg(emctl.parent().unwrap())
        .args(extra)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(output.status.success(), "demo failed\n{stdout}\n{stderr}");
    eprintln!("{stderr}");
    let summary: serde_json::Value = serde_json::from_str(stdout.lines().last().unwrap())
        .unwrap_or_else(|e| panic!("no JSON summary ({e}) in\n{stdout}"));
    // The demo cleans up after itself.
    assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0);
    summary
}

fn number(summary: &serde_json::Value, field: &str) -> i64 {
    summary[field]
        .as_i64()
        .unwrap_or_else(|| panic!("{field} missing in {summary}"))
}

#[test]
fn the_demo_counts_everything_through_a_dispatcher_crash() {
    let summary = demo("dispatcher", 2000);
    check_dispatcher_crash(&summary, 2000);
}

/// The same scenario with puller-svc on each broker backend (brokers of the test's own, so
/// the demo's fixed topic starts empty). Events are uniform: RocketMQ's default message
/// limit (4 MiB) is below the demo's 8 MiB events.
#[test]
fn the_demo_counts_everything_through_a_dispatcher_crash_on_each_broker() {
    {
        let kafka = eventmesh_testkit::KafkaBroker::start_own();
        let summary = demo_on(
            "dispatcher",
            1000,
            &[
                "--uniform",
                "--backend",
                "kafka",
                "--kafka-bootstrap",
                kafka.bootstrap(),
                "--puller-arg=--kafka-fetch-wait-ms=5",
            ],
        );
        check_dispatcher_crash(&summary, 1000);
    }
    for backend in ["rocketmq4", "rocketmq5"] {
        let rocketmq = eventmesh_testkit::RocketMq::start_own();
        let summary = demo_on(
            "dispatcher",
            1000,
            &[
                "--uniform",
                "--backend",
                backend,
                "--rocketmq-namesrv",
                rocketmq.namesrv(),
            ],
        );
        check_dispatcher_crash(&summary, 1000);
    }
}

fn check_dispatcher_crash(summary: &serde_json::Value, events: i64) {
    eprintln!("{summary}");
    assert_eq!(number(summary, "published"), events);
    assert_eq!(number(summary, "lost"), 0);
    assert_eq!(number(summary, "lag"), 0);
    assert_eq!(number(summary, "dead_lettered"), 0);
    assert_eq!(summary["killed"], "dispatcher-svc");
    // Every delivery is one of the published events, counted once or as a redelivery.
    assert_eq!(
        number(summary, "delivered"),
        events + number(summary, "redelivered")
    );
    // lag 0 says every event is ACKed durably; the DURABLE *answers* for ACKs the killed
    // dispatcher had already written but not yet answered are gone with it (at most what was
    // in flight: 512 deliveries).
    let acked = number(summary, "acked");
    assert!(
        (events - 512..=events + number(summary, "redelivered")).contains(&acked),
        "{summary}"
    );
    assert!(number(summary, "reconnects") >= 1, "{summary}");
}

#[test]
fn the_demo_counts_everything_through_offset_and_puller_crashes() {
    for (victim, process) in [("offset", "offset-svc"), ("puller", "puller-svc")] {
        let summary = demo(victim, 1000);
        eprintln!("{summary}");
        assert_eq!(summary["killed"], process);
        assert_eq!(number(&summary, "published"), 1000);
        assert_eq!(number(&summary, "lost"), 0);
        assert_eq!(number(&summary, "lag"), 0);
        assert_eq!(
            number(&summary, "delivered"),
            1000 + number(&summary, "redelivered")
        );
    }
}

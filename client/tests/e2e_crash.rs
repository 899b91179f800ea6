//! End to end across the three real processes with the SDK: 20,000 events ACKed in random
//! order while one service dies at a named crash point (`EM_<SERVICE>_CRASH_AT=<point>:<n>`,
//! the n-th visit, so the crash lands mid-stream) and is restarted; then one seeded random soak
//! that SIGKILLs any of the three. The checker counts every published event id: none may be
//! lost, and the duplicates must stay within the bound — the events delivered but not yet
//! answered DURABLE when the process died, plus the publishes then awaiting an answer (a lost
//! publish answer is retried with the same id).

#![allow(clippy::unwrap_used)]

mod support;

use std::sync::Arc;
use std::time::Duration;

use eventmesh_client::local::{LocalConfig, Service};
use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};
use support::*;

const EVENTS: u64 = 20_000;
const CRASH_WAIT: Duration = Duration::from_secs(120);
const COMPLETE_WAIT: Duration = Duration::from_secs(240);

/// Runs the 20,000-event stream with `point` armed on `service`; restarts it when it dies.
fn crash_scenario(service: Service, point: &str) {
    let _serial = serial();
    let runtime = tokio::runtime::Runtime::new().unwrap();
    runtime.block_on(async {
        let dir = tempfile::tempdir().unwrap();
        let config = test_config(dir.path()).crash_at(service, point);
        let mut instance = eventmesh_client::local::LocalInstance::start(config)
            .await
            .unwrap();
        let ledger = Arc::new(Ledger::default());
        let client = connect(&instance, "e2e-app").await;
        let subscription = subscribe(&client).await;
        let (consumer, stop) = spawn_consumer(subscription, Arc::clone(&ledger), 7);
        let publisher = spawn_publisher(client.clone(), EVENTS, Arc::clone(&ledger));

        wait_for_crash(&mut instance, service, CRASH_WAIT).await;
        let unsettled = ledger.unsettled();
        let bound = unsettled + PUBLISHES_IN_FLIGHT;
        let at_crash = ledger.count();
        instance.start_service(service, None).await.unwrap();

        publisher.await.unwrap();
        let count =
            wait_until_complete(&instance, &ledger, EVENTS as usize, COMPLETE_WAIT).await;
        stop.send(true).unwrap();
        let subscription = consumer.await.unwrap();
        let stats = subscription.stats();
        eprintln!(
            "{service} {point}: crashed with {} published, {} delivered; final {count:?}; duplicates {} (bound {bound}: {unsettled} unsettled + {PUBLISHES_IN_FLIGHT} publishes in flight); SDK {stats:?}",
            at_crash.published, at_crash.distinct_delivered, count.duplicates
        );
        assert_eq!(count.published, EVENTS as usize);
        assert_eq!(count.lost, 0, "{count:?}");
        assert!(
            count.duplicates <= bound,
            "duplicates {} above the bound {bound}",
            count.duplicates
        );
        instance.stop(Duration::from_secs(10)).await;
    });
}

fn test_config(dir: &std::path::Path) -> LocalConfig {
    LocalConfig::new(dir)
        .args(Service::Puller, ["--checkpoint-interval-ms", "300"])
        .args(
            Service::Dispatcher,
            ["--backoff-base-ms", "100", "--backoff-max-ms", "400"],
        )
}

#[test]
fn dispatcher_dies_after_a_delivery_mid_stream() {
    crash_scenario(Service::Dispatcher, "after-deliver:6000");
}

#[test]
fn dispatcher_dies_after_an_offset_write_mid_stream() {
    crash_scenario(Service::Dispatcher, "after-offset-write:1500");
}

#[test]
fn puller_dies_after_a_publish_was_stored_but_not_answered() {
    crash_scenario(Service::Puller, "after-publish:6000");
}

#[test]
fn puller_dies_after_a_pull_before_the_dispatcher_got_it() {
    crash_scenario(Service::Puller, "after-pull:200");
}

#[test]
fn puller_dies_between_checkpoint_fsync_and_rename() {
    crash_scenario(Service::Puller, "before-checkpoint-rename:6");
}

#[test]
fn puller_dies_after_a_checkpoint_ahead_of_the_watermark() {
    crash_scenario(Service::Puller, "after-checkpoint:6");
}

/// Seeded random soak: while 20,000 events flow, any of the three processes is SIGKILLed at a
/// random moment, stays down for a random while, and comes back; five kills, each process
/// at least once.
#[test]
fn seeded_random_soak_kills_any_process() {
    let _serial = serial();
    let seed = seed(20261202);
    let runtime = tokio::runtime::Runtime::new().unwrap();
    runtime.block_on(async {
        let mut rng = StdRng::seed_from_u64(seed);
        let dir = tempfile::tempdir().unwrap();
        let mut instance = eventmesh_client::local::LocalInstance::start(test_config(dir.path()))
            .await
            .unwrap();
        let ledger = Arc::new(Ledger::default());
        let client = connect(&instance, "e2e-soak").await;
        let subscription = subscribe(&client).await;
        let (consumer, stop) = spawn_consumer(subscription, Arc::clone(&ledger), seed);
        let publisher = spawn_publisher(client.clone(), EVENTS, Arc::clone(&ledger));

        // Every process dies at least once; the order and the other two victims are random.
        let mut victims = Service::ALL.to_vec();
        victims.extend((0..2).map(|_| Service::ALL[rng.random_range(0..3)]));
        victims.shuffle(&mut rng);
        let mut bound = 0;
        let mut kills = Vec::new();
        for victim in victims {
            tokio::time::sleep(Duration::from_millis(rng.random_range(500..3000))).await;
            let down = Duration::from_millis(rng.random_range(0..1500));
            instance.kill(victim).await.unwrap();
            let unsettled = ledger.unsettled();
            bound += unsettled + PUBLISHES_IN_FLIGHT;
            kills.push((victim, down, unsettled, ledger.count().distinct_delivered));
            tokio::time::sleep(down).await;
            instance.start_service(victim, None).await.unwrap();
        }
        publisher.await.unwrap();
        let count = wait_until_complete(&instance, &ledger, EVENTS as usize, COMPLETE_WAIT).await;
        stop.send(true).unwrap();
        let subscription = consumer.await.unwrap();
        for (victim, down, unsettled, delivered) in &kills {
            eprintln!(
                "killed {victim} after {delivered} delivered, {unsettled} unsettled, down {down:?}"
            );
        }
        eprintln!(
            "soak seed {seed}: {count:?}; duplicates {} (bound {bound}); SDK {:?}",
            count.duplicates,
            subscription.stats()
        );
        assert_eq!(count.lost, 0, "{count:?}");
        assert!(
            count.duplicates <= bound,
            "duplicates {} above the bound {bound}",
            count.duplicates
        );
        instance.stop(Duration::from_secs(10)).await;
    });
}

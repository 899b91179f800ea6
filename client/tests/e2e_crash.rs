//! End to end across the three real processes with the SDK: 20,000 events ACKed in random
//! order while one service dies at a named crash point (`EM_<SERVICE>_CRASH_AT=<point>:<n>`,
//! the n-th visit, so the crash lands mid-stream) and is restarted; then one seeded random soak
//! that SIGKILLs any of the three. The checker counts every published event id: none may be
//! lost, and the duplicates must stay within the bound — the events delivered but not yet
//! answered DURABLE when the process died (for a dispatcher: every event the dead instance
//! delivered, even one the application took after the crash, and did not answer DURABLE),
//! plus the publishes then awaiting an answer (a lost publish answer is retried with the same
//! id).

#![allow(clippy::unwrap_used)]

mod support;

use std::time::Duration;

use eventmesh_client::local::{LocalConfig, Service};
use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};
use support::*;

const EVENTS: u64 = 20_000;
const CRASH_WAIT: Duration = Duration::from_secs(120);

/// Runs the 20,000-event stream with `point` armed on `service`; restarts it when it dies.
fn crash_scenario(service: Service, point: &str) {
    let _serial = serial();
    let runtime = tokio::runtime::Runtime::new().unwrap();
    runtime.block_on(async {
        let mut run = Run::start(|dir| test_config(dir).crash_at(service, point), EVENTS, 7).await;
        wait_for_crash(&mut run.instance, service, CRASH_WAIT).await;
        run.crashed(service);
        let at_crash = run.ledger.count();
        run.instance.start_service(service, None).await.unwrap();
        let label = format!(
            "{service} {point} (crashed with {} published, {} delivered)",
            at_crash.published, at_crash.distinct_delivered
        );
        run.finish(&label).await;
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
        let mut run = Run::start(test_config, EVENTS, seed).await;
        // Every process dies at least once; the order and the other two victims are random.
        let mut victims = Service::ALL.to_vec();
        victims.extend((0..2).map(|_| Service::ALL[rng.random_range(0..3)]));
        victims.shuffle(&mut rng);
        for victim in victims {
            tokio::time::sleep(Duration::from_millis(rng.random_range(500..3000))).await;
            let down = Duration::from_millis(rng.random_range(0..1500));
            run.instance.kill(victim).await.unwrap();
            let bound = run.crashed(victim);
            eprintln!(
                "killed {victim} with {} delivered, bound now {bound}; down {down:?}",
                run.ledger.count().distinct_delivered
            );
            tokio::time::sleep(down).await;
            run.instance.start_service(victim, None).await.unwrap();
        }
        run.finish(&format!("soak seed {seed}")).await;
    });
}

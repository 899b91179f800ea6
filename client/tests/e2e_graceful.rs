//! Graceful restarts under load, across the three real processes with the SDK: while 20,000
//! events are published and ACKed in random order (every ACK within a few milliseconds, well
//! inside the dispatcher's drain window), each service in turn gets SIGTERM, stops by itself
//! and is started again — offset-svc, then puller-svc, then dispatcher-svc. A graceful stop
//! must cost nothing: no event lost, none delivered twice (the SDK sees no redelivery and the
//! checker no duplicate id), and the dispatcher's sessions move (the `em-draining` end) rather
//! than break.

#![allow(clippy::unwrap_used)]

mod support;

use std::time::{Duration, Instant};

use eventmesh_client::local::{LocalConfig, Service};
use support::*;

const EVENTS: u64 = 20_000;

fn test_config(dir: &std::path::Path) -> LocalConfig {
    LocalConfig::new(dir).args(Service::Puller, ["--checkpoint-interval-ms", "300"])
}

/// Waits (bounded) until `more` further distinct events were delivered.
async fn wait_for_progress(run: &Run, more: usize) {
    let start = run.ledger.count().distinct_delivered;
    let deadline = Instant::now() + Duration::from_secs(60);
    while run.ledger.count().distinct_delivered < (start + more).min(EVENTS as usize) {
        assert!(
            Instant::now() < deadline,
            "no progress: {:?}",
            run.ledger.count()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[test]
fn rolling_graceful_restarts_lose_nothing_and_redeliver_nothing() {
    let _serial = serial();
    let runtime = tokio::runtime::Runtime::new().unwrap();
    runtime.block_on(async {
        let mut run = Run::start(test_config, EVENTS, 11).await;
        for service in [Service::Offset, Service::Puller, Service::Dispatcher] {
            wait_for_progress(&run, 2_000).await;
            let before = run.ledger.count();
            run.instance.signal(service, "TERM").unwrap();
            let stopping = Instant::now();
            assert!(
                run.instance
                    .wait_for_exit(service, Duration::from_secs(30))
                    .await,
                "{service} did not stop within 30 s of SIGTERM"
            );
            eprintln!(
                "{service} stopped gracefully in {:?} with {} delivered",
                stopping.elapsed(),
                before.distinct_delivered
            );
            run.instance.start_service(service, None).await.unwrap();
        }
        let (count, stats) = run.finish("rolling graceful restarts").await;
        assert_eq!(count.lost, 0, "{count:?}");
        assert_eq!(
            count.duplicates, 0,
            "a graceful restart delivered an event twice: {count:?}; SDK {stats:?}"
        );
        assert_eq!(stats.redelivered, 0, "{stats:?}");
        assert!(
            stats.moves >= 1,
            "the dispatcher's restart should have moved the session: {stats:?}"
        );
        assert_eq!(
            stats.reconnects, 0,
            "a graceful restart broke the session instead of moving it: {stats:?}"
        );
    });
}

//! End-to-end harness: a local instance (three real service processes), the SDK, a publisher
//! of known event ids, a consumer that ACKs in random order, and a checker that counts every
//! event id.

#![allow(dead_code)]

pub mod otlp;

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use eventmesh_client::local::{LocalInstance, Service};
use eventmesh_client::{
    AckOutcome, Client, ClientConfig, Event, StartPosition, SubscribeOptions, Subscription,
};
use futures::StreamExt;
use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};
use tokio::task::JoinHandle;

pub const TOPIC: &str = "e2e-orders";
pub const GROUP: &str = "e2e";
/// Publishes awaiting an answer at once: the most duplicates one publisher-side crash can add.
pub const PUBLISHES_IN_FLIGHT: usize = 32;
pub const MAX_IN_FLIGHT: u32 = 256;

/// One end-to-end test at a time: each runs three processes on a small machine.
pub fn serial() -> std::sync::MutexGuard<'static, ()> {
    static LOCK: Mutex<()> = Mutex::new(());
    LOCK.lock().unwrap_or_else(|p| p.into_inner())
}

pub async fn connect(instance: &LocalInstance, client_id: &str) -> Client {
    Client::connect(
        ClientConfig::new(client_id)
            .endpoint(instance.endpoint())
            .backoff(Duration::from_millis(50), Duration::from_millis(500))
            .retry_deadline(Duration::from_secs(60)),
    )
    .await
    .expect("client connects")
}

pub async fn subscribe(client: &Client) -> Subscription {
    client
        .subscribe(
            SubscribeOptions::new(TOPIC)
                .group(GROUP)
                .start(StartPosition::Earliest)
                .max_in_flight(MAX_IN_FLIGHT),
        )
        .await
        .expect("subscription opens")
}

/// The next `n` deliveries of `subscription`, taken and not settled (20 s each at most).
pub async fn take_deliveries(
    subscription: &mut Subscription,
    n: usize,
) -> Vec<eventmesh_client::Delivery> {
    let mut taken = Vec::with_capacity(n);
    while taken.len() < n {
        let delivery = tokio::time::timeout(Duration::from_secs(20), subscription.next())
            .await
            .expect("a delivery within 20 s")
            .expect("the subscription is open")
            .expect("a delivery, not an error");
        taken.push(delivery);
    }
    taken
}

pub fn event_id(n: u64) -> String {
    format!("e2e-{n:08}")
}

/// Publishes events 0..count (ids [`event_id`]), [`PUBLISHES_IN_FLIGHT`] at a time; every
/// confirmed id goes into the ledger.
pub fn spawn_publisher(client: Client, count: u64, ledger: Arc<Ledger>) -> JoinHandle<()> {
    tokio::spawn(async move {
        // A mix of sizes up to the largest event (the loss oracle covers big pulls too).
        let max = bytes::Bytes::from(vec![b'e'; eventmesh_client::MAX_EVENT_DATA_BYTES]);
        let mut publishes = futures::stream::iter(0..count)
            .map(|n| {
                let client = client.clone();
                let event = Event {
                    id: event_id(n),
                    source: "/e2e".into(),
                    r#type: "e2e.order".into(),
                    data: max.slice(..eventmesh_client::mixed_event_size(n, 256)),
                    ..Event::default()
                };
                async move { (n, client.publish(TOPIC, event).await) }
            })
            .buffer_unordered(PUBLISHES_IN_FLIGHT);
        while let Some((n, result)) = publishes.next().await {
            match result {
                Ok(_) => ledger.published(event_id(n)),
                Err(error) => panic!("publish of event {n} failed for good: {error}"),
            }
        }
    })
}

/// What the checker counts.
#[derive(Debug, Default)]
pub struct Ledger {
    inner: Mutex<LedgerInner>,
}

#[derive(Debug, Default)]
struct LedgerInner {
    published: HashSet<String>,
    /// Per event id, each of its deliveries: instance, attempt, partition and offset (how many
    /// times it was delivered, and, when a checker finds a duplicate, whether it was a
    /// redelivery or a second copy of the event).
    delivered: HashMap<String, Vec<DeliveryRecord>>,
    /// Event ids with a DURABLE answer.
    durable: HashSet<String>,
    /// Delivery id → (event id, delivering instance), to map ACK answers.
    delivery_events: HashMap<String, (String, Arc<str>)>,
    /// Per dispatcher instance: the event ids it delivered, and those it answered DURABLE.
    instances: HashMap<Arc<str>, InstanceLedger>,
    /// The instance of the latest delivery.
    latest_instance: Option<Arc<str>>,
}

/// One delivery as the checker saw it: instance, attempt, partition, offset.
type DeliveryRecord = (Arc<str>, u32, String, i64);

#[derive(Debug, Default)]
struct InstanceLedger {
    delivered: HashSet<String>,
    durable: HashSet<String>,
    /// When the application took the instance's first and latest delivery.
    first_at: Option<Instant>,
    last_at: Option<Instant>,
}

/// The checker's verdict.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Count {
    pub published: usize,
    pub distinct_delivered: usize,
    pub deliveries: usize,
    pub duplicates: usize,
    pub lost: usize,
}

impl Ledger {
    pub fn published(&self, id: String) {
        self.lock().published.insert(id);
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, LedgerInner> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn delivered(&self, delivery: &eventmesh_client::Delivery) {
        let mut inner = self.lock();
        let event = delivery.event.id.clone();
        inner.delivered.entry(event.clone()).or_default().push((
            Arc::clone(&delivery.instance_id),
            delivery.attempt,
            delivery.partition.clone(),
            delivery.offset,
        ));
        let now = Instant::now();
        let by_instance = inner
            .instances
            .entry(Arc::clone(&delivery.instance_id))
            .or_default();
        by_instance.delivered.insert(event.clone());
        by_instance.first_at.get_or_insert(now);
        by_instance.last_at = Some(now);
        inner.latest_instance = Some(Arc::clone(&delivery.instance_id));
        inner.delivery_events.insert(
            delivery.id.clone(),
            (event, Arc::clone(&delivery.instance_id)),
        );
    }

    fn durable(&self, delivery_id: &str) {
        let mut inner = self.lock();
        if let Some((event, instance)) = inner.delivery_events.get(delivery_id).cloned() {
            inner.durable.insert(event.clone());
            inner
                .instances
                .entry(instance)
                .or_default()
                .durable
                .insert(event);
        }
    }

    /// What the dispatcher instances that no longer serve may bring back: per instance, the
    /// events it delivered and did not answer DURABLE. Counted at the end, so deliveries a dead
    /// instance had sent but the application took only after the crash are included.
    pub fn unsettled_by_replaced_instances(&self) -> usize {
        let inner = self.lock();
        inner
            .instances
            .iter()
            .filter(|(id, _)| Some(*id) != inner.latest_instance.as_ref())
            .map(|(_, ledger)| ledger.delivered.difference(&ledger.durable).count())
            .sum()
    }

    /// When the application took `instance`'s first and latest delivery.
    pub fn delivery_span(&self, instance: &str) -> Option<(Instant, Instant)> {
        let inner = self.lock();
        let ledger = inner.instances.get(instance)?;
        Some((ledger.first_at?, ledger.last_at?))
    }

    /// Up to `max` event ids delivered more than once, each with its deliveries (instance,
    /// attempt, partition@offset) and whether it was answered DURABLE: one record delivered
    /// twice is a redelivery, two records of one id a publish stored twice.
    pub fn duplicate_detail(&self, max: usize) -> String {
        let inner = self.lock();
        let mut duplicated: Vec<(&String, &Vec<DeliveryRecord>)> = inner
            .delivered
            .iter()
            .filter(|(_, deliveries)| deliveries.len() > 1)
            .collect();
        duplicated.sort_by_key(|(id, _)| *id);
        duplicated
            .iter()
            .take(max)
            .map(|(id, deliveries)| {
                let deliveries: Vec<String> = deliveries
                    .iter()
                    .map(|(instance, attempt, partition, offset)| {
                        format!("{instance} attempt {attempt} at {partition}@{offset}")
                    })
                    .collect();
                let durable = inner.durable.contains(*id);
                format!("{id} (durable {durable}): {}", deliveries.join("; "))
            })
            .collect::<Vec<_>>()
            .join("\n")
    }

    /// How many times `id` was delivered.
    pub fn deliveries_of(&self, id: &str) -> u32 {
        self.lock()
            .delivered
            .get(id)
            .map_or(0, |deliveries| deliveries.len() as u32)
    }

    /// Event ids answered DURABLE so far.
    pub fn durable_count(&self) -> usize {
        self.lock().durable.len()
    }

    /// The instance of the latest delivery.
    pub fn latest_instance(&self) -> Option<Arc<str>> {
        self.lock().latest_instance.clone()
    }

    /// Event ids delivered and not yet answered DURABLE: what a crash now may bring back.
    pub fn unsettled(&self) -> usize {
        let inner = self.lock();
        inner
            .delivered
            .keys()
            .filter(|id| !inner.durable.contains(*id))
            .count()
    }

    pub fn count(&self) -> Count {
        let inner = self.lock();
        let deliveries: usize = inner.delivered.values().map(Vec::len).sum();
        Count {
            published: inner.published.len(),
            distinct_delivered: inner.delivered.len(),
            deliveries,
            duplicates: deliveries - inner.delivered.len(),
            lost: inner
                .published
                .iter()
                .filter(|id| !inner.delivered.contains_key(*id))
                .count(),
        }
    }
}

/// Consumes the subscription, ACKing in random order: deliveries are held in a window of a
/// random size (1..=64, at most 20 ms) and the window is ACKed shuffled. Runs until stopped.
pub fn spawn_consumer(
    mut subscription: Subscription,
    ledger: Arc<Ledger>,
    seed: u64,
) -> (JoinHandle<Subscription>, tokio::sync::watch::Sender<bool>) {
    let (stop, mut stopped) = tokio::sync::watch::channel(false);
    let handle = tokio::spawn(async move {
        let mut rng = StdRng::seed_from_u64(seed);
        let mut results = subscription.ack_results();
        let mut window = Vec::new();
        let mut window_size = rng.random_range(1..=64);
        loop {
            tokio::select! {
                _ = stopped.changed() => break,
                Some(result) = results.recv() => {
                    if result.outcome == AckOutcome::Durable {
                        ledger.durable(&result.delivery_id);
                    }
                }
                delivery = tokio::time::timeout(Duration::from_millis(20), subscription.next()) => {
                    match delivery {
                        Ok(Some(Ok(delivery))) => {
                            ledger.delivered(&delivery);
                            window.push(delivery);
                        }
                        Ok(Some(Err(error))) => panic!("subscription failed: {error}"),
                        Ok(None) => break,
                        Err(_) => {
                            // Quiet: ACK what is held.
                            window_size = window.len().max(1);
                        }
                    }
                    if window.len() >= window_size {
                        window.shuffle(&mut rng);
                        for delivery in window.drain(..) {
                            delivery.ack();
                        }
                        window_size = rng.random_range(1..=64);
                    }
                }
            }
        }
        subscription
    });
    (handle, stop)
}

/// The default group's lag (records not covered by its stored watermark), from offset-svc
/// and puller-svc.
pub async fn lag(instance: &LocalInstance) -> Option<i64> {
    use eventmesh_proto::offset::offset_service_client::OffsetServiceClient;
    use eventmesh_proto::puller::puller_service_client::PullerServiceClient;
    let mut puller = PullerServiceClient::connect(instance.uri(Service::Puller))
        .await
        .ok()?;
    let mut offsets = OffsetServiceClient::connect(instance.uri(Service::Offset))
        .await
        .ok()?;
    let ends = puller
        .end_offsets(eventmesh_proto::puller::EndOffsetsRequest {
            topic: TOPIC.into(),
        })
        .await
        .ok()?
        .into_inner();
    let stored = offsets
        .read_topic_offsets(eventmesh_proto::offset::ReadTopicOffsetsRequest {
            topic: TOPIC.into(),
            client_id: format!("__mqcursor@{GROUP}__"),
        })
        .await
        .ok()?
        .into_inner();
    let watermarks: HashMap<String, i64> = stored
        .entries
        .into_iter()
        .filter_map(|e| Some((e.key?.partition, e.offset)))
        .collect();
    Some(
        ends.partitions
            .iter()
            .map(|p| {
                let done = watermarks
                    .get(&p.partition)
                    .copied()
                    .unwrap_or(-1)
                    .max(p.start - 1);
                (p.end - 1 - done).max(0)
            })
            .sum(),
    )
}

/// Waits until every published event was delivered and the group's lag is 0.
pub async fn wait_until_complete(
    instance: &LocalInstance,
    ledger: &Ledger,
    expected: usize,
    wait: Duration,
) -> Count {
    let deadline = Instant::now() + wait;
    loop {
        let count = ledger.count();
        if count.published == expected && count.lost == 0 && lag(instance).await == Some(0) {
            return count;
        }
        if Instant::now() > deadline {
            panic!(
                "not complete after {wait:?}: {count:?}, lag {:?}",
                lag(instance).await
            );
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Polls until `service` has exited (an armed crash point fired); panics after `wait`.
pub async fn wait_for_crash(instance: &mut LocalInstance, service: Service, wait: Duration) {
    assert!(
        instance.wait_for_exit(service, wait).await,
        "{service} did not reach its crash point within {wait:?}"
    );
}

/// A running stream: an instance, a publisher of `events` known ids, and a consumer ACKing in
/// random order, all counted by one ledger.
pub struct Run {
    pub instance: LocalInstance,
    pub ledger: Arc<Ledger>,
    events: u64,
    publisher: JoinHandle<()>,
    consumer: JoinHandle<Subscription>,
    stop: tokio::sync::watch::Sender<bool>,
    /// Duplicates allowed by the crashes recorded so far.
    bound: usize,
    _dir: tempfile::TempDir,
}

impl Run {
    /// Starts an instance from `config(dir)` and the stream.
    pub async fn start(
        config: impl FnOnce(&std::path::Path) -> eventmesh_client::local::LocalConfig,
        events: u64,
        seed: u64,
    ) -> Run {
        let dir = tempfile::tempdir().unwrap();
        let instance = LocalInstance::start(config(dir.path())).await.expect(
            "local instance starts (service binaries are built by `cargo test --workspace`)",
        );
        let ledger = Arc::new(Ledger::default());
        let client = connect(&instance, "e2e-app").await;
        let subscription = subscribe(&client).await;
        let (consumer, stop) = spawn_consumer(subscription, Arc::clone(&ledger), seed);
        let publisher = spawn_publisher(client, events, Arc::clone(&ledger));
        Run {
            instance,
            ledger,
            events,
            publisher,
            consumer,
            stop,
            bound: 0,
            _dir: dir,
        }
    }

    /// Records that `service` just died: what that may duplicate joins the bound. Any crash
    /// may lose the answers of the publishes in flight (retried with the same ids); a puller or
    /// offset-svc crash may bring back what was delivered and not yet answered DURABLE. A dead
    /// dispatcher's deliveries are counted per instance at the end (see
    /// [`Ledger::unsettled_by_replaced_instances`]). Returns the bound so far.
    pub fn crashed(&mut self, service: Service) -> usize {
        self.bound += PUBLISHES_IN_FLIGHT;
        if service != Service::Dispatcher {
            self.bound += self.ledger.unsettled();
        }
        self.bound
    }

    /// Waits for every event to be published, delivered and covered by the watermark; stops
    /// the instance; checks nothing was lost and the duplicates stay within the bound.
    pub async fn finish(self, label: &str) -> (Count, eventmesh_client::SubscriptionStats) {
        self.publisher.await.unwrap();
        let count = wait_until_complete(
            &self.instance,
            &self.ledger,
            self.events as usize,
            Duration::from_secs(240),
        )
        .await;
        self.stop.send(true).unwrap();
        let subscription = self.consumer.await.unwrap();
        let bound = self.bound + self.ledger.unsettled_by_replaced_instances();
        eprintln!(
            "{label}: {count:?}; duplicates {} (bound {bound}); SDK {:?}",
            count.duplicates,
            subscription.stats()
        );
        assert_eq!(count.published, self.events as usize);
        assert_eq!(count.lost, 0, "{label}: {count:?}");
        assert!(
            count.duplicates <= bound,
            "{label}: duplicates {} above the bound {bound}; the first ones:\n{}",
            count.duplicates,
            self.ledger.duplicate_detail(10)
        );
        let stats = subscription.stats();
        self.instance.stop(Duration::from_secs(10)).await;
        (count, stats)
    }
}

/// Random source for a test, printed so a failure can be replayed with `EM_TEST_SEED`.
pub fn seed(default: u64) -> u64 {
    let seed = std::env::var("EM_TEST_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(default);
    eprintln!("seed {seed} (replay with EM_TEST_SEED={seed})");
    seed
}

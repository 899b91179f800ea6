//! `emctl bench`: end-to-end delivered-and-ACKed throughput of one local instance, against the
//! raw pull throughput of its puller-svc measured in the same run.
//!
//! For every event size × subscriber-stream count:
//! 1. **preload** N events on a fresh topic (publish throughput is reported too);
//! 2. **raw pull**: one reader pulls the N records straight from puller-svc (`Pull`, 512 per
//!    batch) — the baseline;
//! 3. **full load**: S sessions of one group start at the earliest offset and ACK every
//!    delivery at once; throughput = N / (time from the S connections being up until the last
//!    ACK was answered DURABLE);
//!    ACK → DURABLE latency of every 64th delivery of each stream (as JetStream's side samples);
//!    CPU seconds of each process over the phase;
//! 4. **live load**: a fresh topic and group, N/2 events published as fast as they are answered
//!    while the S sessions consume: the most the machine does when publishing and consuming
//!    share it (`live.rs`);
//! 5. **half load**: a fresh topic and group, published at half the live load's rate while the
//!    S sessions consume; ACK → DURABLE latency at that steady load. (`--half-load-share` sets
//!    another share, `--half-load-of full` takes it of the full load's rate.) With
//!    `EM_PROBE_DIR` set and services built with the feature `latency-probes`, each stage's
//!    share of that time too (`stages.rs`).
//!
//! Resident memory (VmRSS) of each service is read after the full load. Once per run, after
//! the rows, the **idle first event** probe publishes single events to a topic one subscriber
//! waits on, each after a quiet gap (longer than any look-again timer), and measures publish
//! call → delivery received: what a sparse topic's consumer sees.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use clap::Args;
use eventmesh_client::local::{LocalConfig, LocalInstance, Service};
use eventmesh_client::{
    AckOutcome, Client, ClientConfig, Delivery, Event, Publisher, PublisherOptions, PublisherStats,
    StartPosition, SubscribeOptions, Subscription,
};
use eventmesh_proto::puller as puller_pb;
use eventmesh_proto::puller::puller_service_client::PullerServiceClient;

use crate::backend::BackendArgs;
use crate::stages::{self, ClientMark};
use live::{HalfLoadOf, Phase};

mod live;

#[derive(Debug, Args)]
pub struct BenchArgs {
    #[command(flatten)]
    backend: BackendArgs,
    /// Event payload sizes in bytes.
    #[arg(long, value_delimiter = ',', default_value = "256,1024")]
    sizes: Vec<usize>,
    /// Subscriber stream counts.
    #[arg(long, value_delimiter = ',', default_value = "1,8,64")]
    streams: Vec<usize>,
    /// Events per full-load run (half load uses half).
    #[arg(long, default_value_t = 100_000)]
    events: u64,
    /// Per-session in-flight limit.
    #[arg(long, default_value_t = 1024)]
    max_in_flight: u32,
    /// Parent of the bench's fresh data directory (removed afterwards).
    #[arg(long, default_value = "data")]
    data_dir: PathBuf,
    /// Directory holding the service binaries (default: next to emctl).
    #[arg(long, env = "EM_BIN_DIR")]
    bin_dir: Option<PathBuf>,
    /// Skip the live- and half-load runs.
    #[arg(long)]
    no_half_load: bool,
    /// The "half" load's share of the measured maximum (0.5: half).
    #[arg(long, default_value_t = 0.5)]
    half_load_share: f64,
    /// Which measured maximum the half load is a share of: the live load's (publishing while
    /// consuming, as at half load) or the full load's (consuming what was published before).
    #[arg(long, value_enum, default_value_t = HalfLoadOf::Live)]
    half_load_of: HalfLoadOf,
    /// The "half" load's rate in events per second, whatever the live or full load measured (to
    /// compare builds at one load).
    #[arg(long, conflicts_with = "half_load_share")]
    half_load_rate: Option<f64>,
    /// Record a `perf` profile of each service and of this client during the first full-load
    /// run into the data directory (kept).
    #[arg(long)]
    perf: bool,
    /// Each service's async worker threads, and this client's (0: a worker per core)
    /// [default: dispatcher-svc a worker per core; puller-svc, offset-svc and this client a
    /// third of the cores, at least one].
    #[arg(long)]
    worker_threads: Option<usize>,
    /// This client's async worker threads alone, whatever `--worker-threads` gives the
    /// services (0: a worker per core).
    #[arg(long)]
    client_worker_threads: Option<usize>,
    /// Extra dispatcher-svc flag (repeat; e.g. `--dispatcher-arg=--ack-flush-ms=0`).
    #[arg(long = "dispatcher-arg", allow_hyphen_values = true)]
    dispatcher_args: Vec<String>,
    /// Samples of the idle first-event probe (0 skips it).
    #[arg(long, default_value_t = 100)]
    pub idle_samples: u32,
    /// Quiet time before each idle probe event, in milliseconds.
    #[arg(long, default_value_t = 200)]
    pub idle_gap_ms: u64,
    /// Run only the idle first-event probe (no throughput rows).
    #[arg(long)]
    pub idle_only: bool,
    /// Print results as JSON lines.
    #[arg(long)]
    json: bool,
}

impl BenchArgs {
    /// The async worker threads of the bench's client (0: a worker per core).
    pub fn client_worker_threads(&self) -> usize {
        self.client_worker_threads
            .or(self.worker_threads)
            .unwrap_or_else(eventmesh_client::local::a_third_of_the_cores)
    }
}

/// The async worker threads each process of a run had.
#[derive(Debug, Default, serde::Serialize)]
pub struct WorkerThreads {
    pub dispatcher: usize,
    pub puller: usize,
    pub offset: usize,
    pub client: usize,
}

impl WorkerThreads {
    /// The services' as the instance was configured, this client's as its runtime has them.
    fn of(instance: &LocalInstance) -> Self {
        // 0 is the service's default: a worker per core (TOKIO_WORKER_THREADS aside).
        let resolved = |service| match instance.worker_threads(service) {
            0 => std::thread::available_parallelism().map_or(1, std::num::NonZeroUsize::get),
            n => n,
        };
        WorkerThreads {
            dispatcher: resolved(Service::Dispatcher),
            puller: resolved(Service::Puller),
            offset: resolved(Service::Offset),
            client: tokio::runtime::Handle::current().metrics().num_workers(),
        }
    }
}

/// One configuration's results.
#[derive(Debug, Default, serde::Serialize)]
pub struct Row {
    pub backend: String,
    pub size: usize,
    pub streams: usize,
    pub events: u64,
    pub publish_per_sec: f64,
    /// Events per `PublishBatch` call of the preload, the live load and the half load (the
    /// SDK's `Publisher` gathers more per call the longer its calls in flight take).
    pub publish_events_per_batch: f64,
    pub live_events_per_batch: f64,
    pub half_events_per_batch: f64,
    pub raw_pull_per_sec: f64,
    pub e2e_per_sec: f64,
    pub ratio: f64,
    pub full_ack_p50_ms: f64,
    pub full_ack_p99_ms: f64,
    /// The live load: N/2 published as fast as answered while consumed; N/2 / (first publish
    /// → last ACK DURABLE), and ACK → DURABLE of every 64th delivery of each stream.
    pub live_per_sec: f64,
    pub live_ack_p50_ms: f64,
    pub live_ack_p99_ms: f64,
    /// The maximum the half load is a share of.
    pub half_load_of: Option<HalfLoadOf>,
    /// The half load: N/2 / (first publish → last ACK DURABLE), ACK → DURABLE of every one.
    pub half_rate_per_sec: f64,
    pub half_ack_p50_ms: f64,
    pub half_ack_p99_ms: f64,
    /// Where the half load's ACK → DURABLE time went, stage by stage (only with
    /// `EM_PROBE_DIR` set and services built with `latency-probes`: see `stages.rs`).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub half_ack_stages: Vec<stages::StageLatency>,
    /// The async worker threads of each process.
    pub worker_threads: WorkerThreads,
    /// CPU cores used during the full-load phase: dispatcher, puller, offset-svc, this client.
    pub cpu_dispatcher: f64,
    pub cpu_puller: f64,
    pub cpu_offset: f64,
    pub cpu_client: f64,
    /// Resident memory after the full load, MiB: dispatcher, puller, offset-svc.
    pub rss_mib_dispatcher: f64,
    pub rss_mib_puller: f64,
    pub rss_mib_offset: f64,
    /// Heap allocations of the dispatcher per delivered and ACKed event over the full load;
    /// only from a dispatcher built with `--features count-allocations`.
    pub dispatcher_allocs_per_event: Option<f64>,
    /// The same per published event over the preload (batch publish through the dispatcher).
    pub dispatcher_publish_allocs_per_event: Option<f64>,
    /// The full-load group's actors (its shards): seconds at work over the phase, all shards
    /// together, that per event in µs, and the rate the group could sustain with each shard
    /// on a core of its own (events / the busiest shard's seconds at work); `None` when the
    /// dispatcher's metrics could not be read.
    pub group_busy_secs: Option<f64>,
    pub group_shards: Option<usize>,
    pub group_us_per_event: Option<f64>,
    pub group_ceiling_per_sec: Option<f64>,
}

/// The idle first-event probe's results (publish call → delivery received).
#[derive(Debug, Default, serde::Serialize)]
pub struct IdleRow {
    pub backend: String,
    pub idle_samples: usize,
    pub idle_gap_ms: u64,
    pub first_event_p50_ms: f64,
    pub first_event_p99_ms: f64,
    pub first_event_max_ms: f64,
    /// The publish call alone (answered when stored): whether a slow sample was slow before
    /// or after the event was stored.
    pub publish_p50_ms: f64,
    pub publish_p99_ms: f64,
    pub publish_max_ms: f64,
}

pub async fn run(args: BenchArgs) -> anyhow::Result<()> {
    let run_dir = args.data_dir.join(format!("bench-{}", std::process::id()));
    // Topics are named per run so that a second run against the same broker starts on empty
    // topics (a Kafka broker outlives the bench's data directory).
    let run_tag = format!(
        "{:x}",
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|since| since.as_millis())
            .unwrap_or_default()
    );
    let mut config = LocalConfig::new(&run_dir)
        .args(Service::Puller, ["--start", "earliest"])
        .args(
            Service::Dispatcher,
            [
                "--max-in-flight-limit".to_owned(),
                args.max_in_flight.max(256).to_string(),
            ],
        );
    config = config.args(Service::Dispatcher, args.dispatcher_args.iter().cloned());
    config.log_filter = "warn".into();
    config.bin_dir = args.bin_dir.clone();
    if let Some(workers) = args.worker_threads {
        config.worker_threads = [workers; 3];
    }
    // A known metrics port for the dispatcher: a build with its `count-allocations` feature
    // reports heap allocations there.
    config.metrics_listen[Service::Dispatcher.index()] = free_loopback_addr()?;
    let config = args.backend.apply(config)?;
    // A service opens its marks file at its first mark, so the directory comes first.
    stages::probe_dir()?;
    let mut instance = LocalInstance::start(config).await?;
    let outcome = bench_all(&args, &mut instance, &run_tag).await;
    instance.stop(Duration::from_secs(15)).await;
    if !args.perf {
        let _ = std::fs::remove_dir_all(&run_dir);
    }
    outcome
}

async fn bench_all(
    args: &BenchArgs,
    instance: &mut LocalInstance,
    run_tag: &str,
) -> anyhow::Result<()> {
    let connection = ClientConfig::new("bench")
        .endpoint(instance.endpoint())
        .retry_deadline(Duration::from_secs(60));
    let client = Client::connect(connection.clone()).await?;
    if !args.idle_only {
        let clients = Clients {
            publisher: client.clone(),
            consumers: connection,
        };
        bench_rows(args, instance, &clients, run_tag).await?;
    }
    if args.idle_samples > 0 {
        let row = idle_first_event(args, &client, run_tag).await?;
        if args.json {
            println!("{}", serde_json::to_string(&row)?);
        } else {
            println!(
                "idle first event ({} samples, {} ms apart): p50 {:.2} ms, p99 {:.2} ms, max {:.2} ms (publish call alone p50 {:.2} ms, p99 {:.2} ms, max {:.2} ms)",
                row.idle_samples,
                row.idle_gap_ms,
                row.first_event_p50_ms,
                row.first_event_p99_ms,
                row.first_event_max_ms,
                row.publish_p50_ms,
                row.publish_p99_ms,
                row.publish_max_ms
            );
        }
    }
    Ok(())
}

/// The bench's connections: the publisher's, and what each consumer stream connects with —
/// a connection of its own per stream, as JetStream's harness gives each consumer task.
struct Clients {
    publisher: Client,
    consumers: ClientConfig,
}

async fn bench_rows(
    args: &BenchArgs,
    instance: &mut LocalInstance,
    clients: &Clients,
    run_tag: &str,
) -> anyhow::Result<()> {
    let mut first = true;
    if !args.json {
        println!(
            "{:<6} {:>5} {:>7} {:>9} {:>10} {:>10} {:>6} {:>15} {:>9} {:>15} {:>9} {:>15} {:>24} {:>18} {:>11}",
            "backend",
            "size",
            "streams",
            "publish/s",
            "raw pull/s",
            "e2e/s",
            "ratio",
            "full p50/p99 ms",
            "live/s",
            "live p50/p99 ms",
            "half/s",
            "half p50/p99 ms",
            "cpu disp/pull/off/cli",
            "rss MiB d/p/o",
            "group µs/ev"
        );
    }
    for &size in &args.sizes {
        for &streams in &args.streams {
            let row = bench_one(args, instance, clients, run_tag, size, streams, first).await?;
            first = false;
            if args.json {
                println!("{}", serde_json::to_string(&row)?);
            } else {
                println!(
                    "{:<6} {:>5} {:>7} {:>9.0} {:>10.0} {:>10.0} {:>6.2} {:>7.2}/{:<7.2} {:>9.0} {:>7.2}/{:<7.2} {:>9.0} {:>7.2}/{:<7.2} {:>5.2}/{:.2}/{:.2}/{:.2} {:>6.0}/{:.0}/{:.0} {:>11}",
                    row.backend,
                    row.size,
                    row.streams,
                    row.publish_per_sec,
                    row.raw_pull_per_sec,
                    row.e2e_per_sec,
                    row.ratio,
                    row.full_ack_p50_ms,
                    row.full_ack_p99_ms,
                    row.live_per_sec,
                    row.live_ack_p50_ms,
                    row.live_ack_p99_ms,
                    row.half_rate_per_sec,
                    row.half_ack_p50_ms,
                    row.half_ack_p99_ms,
                    row.cpu_dispatcher,
                    row.cpu_puller,
                    row.cpu_offset,
                    row.cpu_client,
                    row.rss_mib_dispatcher,
                    row.rss_mib_puller,
                    row.rss_mib_offset,
                    row.group_us_per_event
                        .map_or_else(|| "-".to_owned(), |us| format!("{us:.2}"))
                );
                for stage in &row.half_ack_stages {
                    println!(
                        "    half-load ACK stage {:>15} → {:<15} p50 {:>6.2} ms, p90 {:>6.2} ms, p99 {:>6.2} ms ({} samples)",
                        stage.from,
                        stage.to,
                        stage.p50_ms,
                        stage.p90_ms,
                        stage.p99_ms,
                        stage.samples
                    );
                }
            }
        }
    }
    Ok(())
}

async fn bench_one(
    args: &BenchArgs,
    instance: &mut LocalInstance,
    clients: &Clients,
    run_tag: &str,
    size: usize,
    streams: usize,
    profile: bool,
) -> anyhow::Result<Row> {
    let topic = format!("bench-{run_tag}-{size}-{streams}");
    let events = args.events;
    // 1. Preload.
    let publish_allocations_before = dispatcher_allocations(instance).await;
    let started = Instant::now();
    let preload = publish(&clients.publisher, &topic, size, events, None).await?;
    let publish_per_sec = events as f64 / started.elapsed().as_secs_f64();
    let dispatcher_publish_allocs_per_event =
        allocations_per_event(instance, publish_allocations_before, events).await;

    // 2. Raw pull from puller-svc.
    let raw_pull_per_sec = raw_pull(instance, &topic, events).await?;

    // 3. Full load.
    let perf = if profile && args.perf {
        Some(start_perf(instance)?)
    } else {
        None
    };
    let allocations_before = dispatcher_allocations(instance).await;
    let cpu_before = cpu_seconds(instance);
    let group = format!("full-{size}-{streams}");
    let started = Instant::now();
    let consumed = consume(
        &clients.consumers,
        &topic,
        &group,
        streams,
        args.max_in_flight,
        events,
        Sampling {
            every: FULL_LOAD_SAMPLE_EVERY,
            marking: false,
        },
    )
    .await?;
    // Throughput from when the streams' connections were up (JetStream's clock likewise
    // starts once its tasks are connected); CPU over the whole phase.
    let elapsed = consumed.connected.elapsed().as_secs_f64();
    let cpu_elapsed = started.elapsed().as_secs_f64();
    let cpu_after = cpu_seconds(instance);
    let dispatcher_allocs_per_event =
        allocations_per_event(instance, allocations_before, events).await;
    if let Some(perf) = perf {
        stop_perf(perf).await;
    }
    // The group is new: everything its actor did is in the sum (read once its last interval
    // is reported).
    let group_busy = group_busy_seconds(instance, &group).await;
    let group_busy_secs = group_busy.as_ref().map(|shards| shards.iter().sum::<f64>());
    let group_busiest_secs = group_busy
        .as_ref()
        .map(|shards| shards.iter().copied().fold(0.0, f64::max));
    let rss = [Service::Dispatcher, Service::Puller, Service::Offset]
        .map(|service| instance.pid(service).map_or(0.0, proc_rss_mib));
    let e2e_per_sec = events as f64 / elapsed;
    let cores = |i: usize| (cpu_after[i] - cpu_before[i]) / cpu_elapsed;
    let (full_ack_p50_ms, full_ack_p99_ms) = percentiles(consumed.latencies);

    // 4. Live load, 5. half load.
    let (live, half) = if args.no_half_load {
        Default::default()
    } else {
        let live = live::run(args, clients, run_tag, size, streams, Phase::Live).await?;
        let maximum = match args.half_load_of {
            HalfLoadOf::Live => live.rate_per_sec,
            HalfLoadOf::Full => e2e_per_sec,
        };
        let rate = args
            .half_load_rate
            .unwrap_or(args.half_load_share * maximum);
        let half = live::run(args, clients, run_tag, size, streams, Phase::Half { rate }).await?;
        (live, half)
    };

    Ok(Row {
        backend: args.backend.name(),
        size,
        streams,
        events,
        publish_per_sec,
        publish_events_per_batch: events_per_batch(preload),
        live_events_per_batch: live.events_per_batch,
        half_events_per_batch: half.events_per_batch,
        raw_pull_per_sec,
        e2e_per_sec,
        ratio: e2e_per_sec / raw_pull_per_sec,
        full_ack_p50_ms,
        full_ack_p99_ms,
        live_per_sec: live.rate_per_sec,
        live_ack_p50_ms: live.ack_p50_ms,
        live_ack_p99_ms: live.ack_p99_ms,
        half_load_of: (!args.no_half_load && args.half_load_rate.is_none())
            .then_some(args.half_load_of),
        half_rate_per_sec: half.rate_per_sec,
        half_ack_p50_ms: half.ack_p50_ms,
        half_ack_p99_ms: half.ack_p99_ms,
        half_ack_stages: half.ack_stages,
        worker_threads: WorkerThreads::of(instance),
        cpu_dispatcher: cores(0),
        cpu_puller: cores(1),
        cpu_offset: cores(2),
        cpu_client: cores(3),
        rss_mib_dispatcher: rss[0],
        rss_mib_puller: rss[1],
        rss_mib_offset: rss[2],
        dispatcher_allocs_per_event,
        dispatcher_publish_allocs_per_event,
        group_busy_secs,
        group_shards: group_busy.as_ref().map(Vec::len),
        group_us_per_event: group_busy_secs.map(|busy| busy * 1e6 / events as f64),
        group_ceiling_per_sec: group_busiest_secs
            .filter(|busy| *busy > 0.0)
            .map(|busy| events as f64 / busy),
    })
}

/// The idle first-event probe: one subscriber waits on a quiet topic; each sample publishes a
/// single event after `--idle-gap-ms` of quiet and times the publish call → the delivery.
async fn idle_first_event(
    args: &BenchArgs,
    client: &Client,
    run_tag: &str,
) -> anyhow::Result<IdleRow> {
    let topic = format!("bench-idle-{run_tag}");
    let event = || Event {
        source: "/emctl/bench".into(),
        r#type: "bench-idle".into(),
        data: bytes::Bytes::from_static(b"idle"),
        ..Event::default()
    };
    // Create the topic, then let the subscriber take that first event before timing.
    client.publish(&topic, event()).await?;
    let mut subscription = client
        .subscribe(
            SubscribeOptions::new(&topic)
                .group("idle")
                .start(StartPosition::Earliest),
        )
        .await?;
    let receive = async |subscription: &mut Subscription| -> anyhow::Result<Delivery> {
        Ok(
            tokio::time::timeout(Duration::from_secs(30), subscription.next())
                .await
                .context("no delivery within 30 s")?
                .context("subscription ended")??,
        )
    };
    receive(&mut subscription).await?.ack();
    let mut micros = Vec::with_capacity(args.idle_samples as usize);
    let mut publish_micros = Vec::with_capacity(args.idle_samples as usize);
    for _ in 0..args.idle_samples {
        tokio::time::sleep(Duration::from_millis(args.idle_gap_ms)).await;
        let started = Instant::now();
        // The delivery may arrive before the publish call returns: wait for both.
        let publish = {
            let client = client.clone();
            let event = event();
            let topic = topic.clone();
            tokio::spawn(async move {
                let answered = client.publish(&topic, event).await;
                (answered, started.elapsed())
            })
        };
        let delivery = receive(&mut subscription).await?;
        micros.push(u32::try_from(started.elapsed().as_micros()).unwrap_or(u32::MAX));
        delivery.ack();
        let (answered, took) = publish.await.context("idle probe publish")?;
        answered?;
        publish_micros.push(u32::try_from(took.as_micros()).unwrap_or(u32::MAX));
    }
    let publish_max = publish_micros.iter().copied().max().unwrap_or(0);
    let (publish_p50, publish_p99) = percentiles(publish_micros);
    subscription.close().await;
    let max = micros.iter().copied().max().unwrap_or(0);
    let samples = micros.len();
    let (p50, p99) = percentiles(micros);
    Ok(IdleRow {
        backend: args.backend.name(),
        idle_samples: samples,
        idle_gap_ms: args.idle_gap_ms,
        first_event_p50_ms: p50,
        first_event_p99_ms: p99,
        first_event_max_ms: f64::from(max) / 1000.0,
        publish_p50_ms: publish_p50,
        publish_p99_ms: publish_p99,
        publish_max_ms: f64::from(publish_max) / 1000.0,
    })
}

/// Publishes `count` events through a `Publisher` of the SDK's defaults, paced to `rate` per
/// second when given; what the publisher sent.
async fn publish(
    client: &Client,
    topic: &str,
    size: usize,
    count: u64,
    rate: Option<f64>,
) -> anyhow::Result<PublisherStats> {
    let payload = bytes::Bytes::from(vec![b'b'; size]);
    // Batched and pipelined: up to 8 batches of up to 512 events in flight.
    let publisher = Publisher::new(client.clone(), topic, PublisherOptions::default());
    let event = |_| Event {
        source: "/emctl/bench".into(),
        r#type: "bench".into(),
        data: payload.clone(),
        ..Event::default()
    };
    crate::pubsub::publish_pipelined(&publisher, "", count, rate, event, |_, _| {}).await?;
    Ok(publisher.stats())
}

/// Mean events per batch call (0 without calls).
fn events_per_batch(stats: PublisherStats) -> f64 {
    if stats.batches == 0 {
        0.0
    } else {
        stats.events as f64 / stats.batches as f64
    }
}

async fn raw_pull(instance: &LocalInstance, topic: &str, events: u64) -> anyhow::Result<f64> {
    // The transport settings the dispatcher's own link to the puller has: the baseline is the
    // fastest raw read, not one slowed by 16 KiB HTTP/2 frames.
    let channel = tonic::transport::Endpoint::from_shared(instance.uri(Service::Puller))?
        .tcp_nodelay(true)
        .initial_stream_window_size(4 << 20)
        .initial_connection_window_size(16 << 20)
        .max_frame_size(eventmesh_client::HTTP2_MAX_FRAME_SIZE)
        .connect()
        .await?;
    let mut puller = PullerServiceClient::new(channel).max_decoding_message_size(64 << 20);
    let reader = puller_pb::GroupTopic {
        group: format!("raw-{topic}"),
        topic: topic.to_owned(),
    };
    // Readers are fenced: take this one (from its start) before pulling.
    let generation = puller
        .attach(puller_pb::AttachRequest {
            dispatcher_id: "emctl-bench".to_owned(),
            readers: vec![reader.clone()],
            positions: Vec::new(),
        })
        .await?
        .into_inner()
        .generations
        .first()
        .map(|g| g.generation)
        .context("attach answered without a generation")?;
    let started = Instant::now();
    let mut pulled = 0u64;
    while pulled < events {
        let batch = puller
            .pull(puller_pb::PullRequest {
                reader: Some(reader.clone()),
                partition: String::new(),
                max_records: 512,
                max_bytes: 0,
                max_wait_ms: 500,
                generation,
                positions: Vec::new(),
                // As dispatcher-svc pulls.
                bare_frames: true,
            })
            .await?
            .into_inner();
        if batch.records.is_empty() && started.elapsed() > Duration::from_secs(60) {
            bail!("raw pull stalled at {pulled} of {events}");
        }
        pulled += batch.records.len() as u64;
    }
    Ok(events as f64 / started.elapsed().as_secs_f64())
}

/// At full load, the ACK of every `FULL_LOAD_SAMPLE_EVERY`th delivery of a stream is timed
/// (JetStream's side times as many); every ACK is still counted until it is DURABLE.
const FULL_LOAD_SAMPLE_EVERY: u64 = 64;

/// Which ACKs a consumer times.
#[derive(Debug, Clone, Copy)]
struct Sampling {
    /// Every `every`th delivery of each stream: ACK → DURABLE in microseconds.
    every: u64,
    /// Also mark the deliveries the services mark (`stages.rs`): ACK and answer, wall clock.
    marking: bool,
}

/// Consumes `events` deliveries over `streams` sessions of `group`, ACKing each at once, until
/// `events` ACKs are answered DURABLE.
async fn consume(
    connection: &ClientConfig,
    topic: &str,
    group: &str,
    streams: usize,
    max_in_flight: u32,
    events: u64,
    sampling: Sampling,
) -> anyhow::Result<Consumed> {
    let durable = Arc::new(AtomicU64::new(0));
    // Each stream on a connection of its own, apart from the publisher's, all connected before
    // the first subscribes (the clock's start: JetStream's tasks connect before its clock too).
    let mut clients = Vec::with_capacity(streams);
    for _ in 0..streams {
        clients.push(Client::connect(connection.clone()).await?);
    }
    let connected = Instant::now();
    let mut tasks = Vec::new();
    for client in clients {
        let subscription = client
            .subscribe(
                SubscribeOptions::new(topic)
                    .group(group)
                    .start(StartPosition::Earliest)
                    .max_in_flight(max_in_flight),
            )
            .await?;
        tasks.push(tokio::spawn(stream_worker(
            subscription,
            Arc::clone(&durable),
            events,
            sampling,
        )));
    }
    let mut latencies = Vec::with_capacity(events as usize);
    let mut marks = Vec::new();
    for task in tasks {
        let (stream_latencies, stream_marks) = task.await.context("stream worker")??;
        latencies.extend(stream_latencies);
        marks.extend(stream_marks);
    }
    Ok(Consumed {
        latencies,
        marks,
        connected,
    })
}

/// What [`consume`] measured.
struct Consumed {
    /// ACK → DURABLE of the sampled deliveries, microseconds.
    latencies: Vec<u32>,
    /// The client's marks, when marking.
    marks: Vec<ClientMark>,
    /// When every stream's connection was up, before the first subscribed.
    connected: Instant,
}

/// One session: ACKs every delivery at once and counts DURABLE answers (a delivery id is
/// answered DURABLE once; a second ACK of it is ALREADY_SETTLED), timing the sampled ones and
/// marking those the services mark when `sampling.marking`.
async fn stream_worker(
    mut subscription: Subscription,
    durable: Arc<AtomicU64>,
    events: u64,
    sampling: Sampling,
) -> anyhow::Result<(Vec<u32>, Vec<ClientMark>)> {
    let mut results = subscription.ack_results();
    let mut sampled: HashMap<String, Instant> = HashMap::new();
    let mut latencies = Vec::new();
    // Delivery id → (sequence number, when ACKed), for the deliveries the services mark.
    let mut marked: HashMap<String, (u64, u128)> = HashMap::new();
    let mut marks = Vec::new();
    let mut delivered = 0u64;
    let deadline = Instant::now() + Duration::from_secs(600);
    // Wakes the loop to see the other streams' progress and the deadline.
    let mut look = tokio::time::interval(Duration::from_millis(50));
    look.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    while durable.load(Ordering::Relaxed) < events {
        tokio::select! {
            Some(result) = results.recv() => {
                if result.outcome == AckOutcome::Durable {
                    if let Some(at) = sampled.remove(&result.delivery_id) {
                        latencies.push(u32::try_from(at.elapsed().as_micros()).unwrap_or(u32::MAX));
                    }
                    if let Some((seq, acked_ns)) = marked.remove(&result.delivery_id) {
                        marks.push(ClientMark { seq, acked_ns, answered_ns: stages::now_ns() });
                    }
                    durable.fetch_add(1, Ordering::Relaxed);
                }
            }
            Some(delivery) = subscription.next() => {
                let delivery = delivery?;
                if delivered.is_multiple_of(sampling.every) {
                    sampled.insert(delivery.id.clone(), Instant::now());
                }
                if sampling.marking && let Some(seq) = stages::sampled_seq(&delivery.id) {
                    marked.insert(delivery.id.clone(), (seq, stages::now_ns()));
                }
                delivered += 1;
                delivery.ack();
            }
            _ = look.tick() => {
                if Instant::now() > deadline {
                    bail!("stalled at {} of {events}", durable.load(Ordering::Relaxed));
                }
            }
        }
    }
    subscription.close().await;
    Ok((latencies, marks))
}

fn percentiles(mut micros: Vec<u32>) -> (f64, f64) {
    if micros.is_empty() {
        return (0.0, 0.0);
    }
    micros.sort_unstable();
    let at = |q: f64| f64::from(micros[((micros.len() - 1) as f64 * q) as usize]) / 1000.0;
    (at(0.50), at(0.99))
}

/// CPU seconds (user + system) of dispatcher, puller, offset-svc and this process.
fn cpu_seconds(instance: &LocalInstance) -> [f64; 4] {
    let of = |pid: Option<u32>| pid.map_or(0.0, proc_cpu_seconds);
    [
        of(instance.pid(Service::Dispatcher)),
        of(instance.pid(Service::Puller)),
        of(instance.pid(Service::Offset)),
        proc_cpu_seconds(std::process::id()),
    ]
}

fn proc_cpu_seconds(pid: u32) -> f64 {
    let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
        return 0.0;
    };
    // Fields after the parenthesised command name; utime and stime are fields 14 and 15.
    let Some(rest) = stat.rsplit_once(')').map(|(_, rest)| rest) else {
        return 0.0;
    };
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let ticks = |i: usize| {
        fields
            .get(i)
            .and_then(|f| f.parse::<f64>().ok())
            .unwrap_or(0.0)
    };
    // `rest` starts at field 3 (state); utime is field 14 → index 11.
    (ticks(11) + ticks(12)) / CLOCK_TICKS
}

/// A loopback address with a port free right now (for a service to bind next).
fn free_loopback_addr() -> anyhow::Result<std::net::SocketAddr> {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").context("finding a free port")?;
    Ok(listener.local_addr()?)
}

/// The dispatcher's heap allocations since `before` (its count at a phase's start) per event
/// of the phase; `None` when it does not count them.
async fn allocations_per_event(
    instance: &LocalInstance,
    before: Option<u64>,
    events: u64,
) -> Option<f64> {
    let before = before?;
    let after = dispatcher_allocations(instance).await?;
    Some(after.saturating_sub(before) as f64 / events as f64)
}

/// The dispatcher's `process_heap_allocations_total`, when its build counts allocations
/// (`None` at once otherwise). The counter is refreshed every 200 ms, so it is read again
/// after that long: the value then covers everything done before the call.
async fn dispatcher_allocations(instance: &LocalInstance) -> Option<u64> {
    let addr = instance.metrics_addr(Service::Dispatcher);
    let read = async || {
        let metrics = scrape(addr).await.ok()?;
        metrics.lines().find_map(|line| {
            line.strip_prefix("process_heap_allocations_total ")
                .and_then(|value| value.trim().parse::<f64>().ok())
                .map(|value| value as u64)
        })
    };
    read().await?;
    tokio::time::sleep(Duration::from_millis(250)).await;
    read().await
}

/// Seconds each actor (shard) of subscription group `group` spent at work so far: the
/// dispatcher's `dispatcher_group_busy_seconds_sum` series of it, read after the group's next
/// report (every 500 ms) so the end of the phase is in.
async fn group_busy_seconds(instance: &LocalInstance, group: &str) -> Option<Vec<f64>> {
    tokio::time::sleep(Duration::from_millis(600)).await;
    let metrics = scrape(instance.metrics_addr(Service::Dispatcher))
        .await
        .ok()?;
    busy_sums_of(&metrics, group)
}

/// Every `dispatcher_group_busy_seconds_sum` series of `group` (one per shard) in a
/// Prometheus exposition; `None` when it has none.
fn busy_sums_of(metrics: &str, group: &str) -> Option<Vec<f64>> {
    let label = format!("group=\"{group}\"");
    let sums: Vec<f64> = metrics
        .lines()
        .filter_map(|line| {
            let rest = line.strip_prefix("dispatcher_group_busy_seconds_sum{")?;
            let (labels, value) = rest.rsplit_once("} ")?;
            labels
                .split(',')
                .any(|l| l == label)
                .then(|| value.trim().parse::<f64>().ok())
                .flatten()
        })
        .collect();
    (!sums.is_empty()).then_some(sums)
}

/// `GET /metrics` over a plain HTTP/1.0 connection.
async fn scrape(addr: std::net::SocketAddr) -> anyhow::Result<String> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut stream =
        tokio::time::timeout(Duration::from_secs(2), tokio::net::TcpStream::connect(addr))
            .await
            .context("metrics endpoint timed out")??;
    stream
        .write_all(b"GET /metrics HTTP/1.0\r\nHost: localhost\r\n\r\n")
        .await?;
    let mut body = String::new();
    tokio::time::timeout(Duration::from_secs(2), stream.read_to_string(&mut body))
        .await
        .context("metrics read timed out")??;
    Ok(body)
}

/// Resident memory (VmRSS) of a process, in MiB; 0 when unreadable.
fn proc_rss_mib(pid: u32) -> f64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|status| {
            status
                .lines()
                .find_map(|line| line.strip_prefix("VmRSS:"))
                .and_then(|value| {
                    value
                        .trim()
                        .trim_end_matches("kB")
                        .trim()
                        .parse::<f64>()
                        .ok()
                })
        })
        .map_or(0.0, |kib| kib / 1024.0)
}

/// The kernel's USER_HZ on Linux.
const CLOCK_TICKS: f64 = 100.0;

fn start_perf(instance: &LocalInstance) -> anyhow::Result<Vec<tokio::process::Child>> {
    let mut children = Vec::new();
    // Each service, and this process: the bench's consumers are the client side of the load.
    let processes = Service::ALL
        .iter()
        .filter_map(|&service| Some((service.binary(), instance.pid(service)?)))
        .chain([("emctl", std::process::id())]);
    for (name, pid) in processes {
        let out = instance.data_dir().join(format!("perf-{name}.data"));
        children.push(
            tokio::process::Command::new("perf")
                .args(["record", "-F", "499", "-g", "-p", &pid.to_string(), "-o"])
                .arg(out)
                .stdout(std::process::Stdio::null())
                .stderr(std::process::Stdio::null())
                .spawn()
                .context("running perf (install linux-perf)")?,
        );
    }
    Ok(children)
}

async fn stop_perf(children: Vec<tokio::process::Child>) {
    for mut child in children {
        if let Some(pid) = child.id() {
            let _ = std::process::Command::new("kill")
                .args(["-INT", &pid.to_string()])
                .status();
        }
        let _ = child.wait().await;
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    #[test]
    fn the_busy_sums_of_one_group_are_found_one_per_shard() {
        let metrics = "\
# TYPE dispatcher_group_busy_seconds summary
dispatcher_group_busy_seconds_sum{topic=\"t\",group=\"full-256-10\"} 9.5
dispatcher_group_busy_seconds_count{topic=\"t\",group=\"full-256-1\"} 3
dispatcher_group_busy_seconds_sum{topic=\"t\",group=\"full-256-1\"} 0.25
dispatcher_group_busy_seconds_sum{topic=\"t\",group=\"full-256-8\",shard=\"0\"} 1.5
dispatcher_group_busy_seconds_sum{topic=\"t\",group=\"full-256-8\",shard=\"1\"} 2
";
        assert_eq!(busy_sums_of(metrics, "full-256-1"), Some(vec![0.25]));
        assert_eq!(busy_sums_of(metrics, "full-256-10"), Some(vec![9.5]));
        assert_eq!(busy_sums_of(metrics, "full-256-8"), Some(vec![1.5, 2.0]));
        assert_eq!(busy_sums_of(metrics, "other"), None);
    }
}

//! `emctl demo`: the whole system on one machine, with a crash in the middle, counted.
//!
//! Brings up a local instance (three processes, embedded backend, free loopback ports, a fresh
//! data directory), publishes N events with known ids while a subscriber consumes and ACKs
//! them, SIGKILLs one service once a share of the events is ACKed and restarts it, waits until
//! the group's watermark reaches the end of every partition, and prints a summary in which every
//! number is counted: what the publisher had confirmed, what the subscriber saw (per event id),
//! what offset-svc and puller-svc report. Nothing is assumed; `lost` is the published ids
//! never delivered, `lag` what the stored watermark still has to cover.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use anyhow::{Context, bail};
use clap::{Args, ValueEnum};
use eventmesh_client::local::{LocalConfig, LocalInstance, Service};
use eventmesh_client::{
    Client, ClientConfig, Event, StartPosition, SubscribeOptions, Subscription,
};
use eventmesh_proto::puller as puller_pb;
use eventmesh_proto::puller::puller_service_client::PullerServiceClient;
use futures::StreamExt;
use indicatif::MultiProgress;

use crate::backend::BackendArgs;
use crate::offsets::{Services, topic_view};
use crate::pubsub::progress;

const TOPIC: &str = "demo-orders";
const GROUP: &str = "demo";
/// Publishes awaiting their answer at once.
const PUBLISHES_IN_FLIGHT: usize = 32;

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Victim {
    /// Kill nothing.
    None,
    /// offset-svc: ACKs answer PENDING until it is back, then DURABLE.
    Offset,
    /// puller-svc: reads stop; its cursors rewind to the ACK watermark on restart.
    Puller,
    /// dispatcher-svc: the SDK reconnects; un-ACKed events come back.
    Dispatcher,
}

#[derive(Debug, Args)]
pub struct DemoArgs {
    /// How many events to publish.
    #[arg(long, default_value_t = 20_000)]
    events: u64,
    /// Payload bytes of a typical event (every 10th event carries 4 KiB, every 100th 64 KiB
    /// and every 5,000th the 8 MiB maximum, unless --uniform).
    #[arg(long, default_value_t = 256)]
    size: usize,
    /// Every event carries --size bytes.
    #[arg(long)]
    uniform: bool,
    /// Which service to SIGKILL part-way.
    #[arg(long, value_enum, default_value_t = Victim::Dispatcher)]
    kill: Victim,
    /// Kill when this share of the events is ACKed.
    #[arg(long, default_value_t = 0.4)]
    kill_at: f64,
    /// How long the killed service stays down, milliseconds.
    #[arg(long, default_value_t = 1000)]
    down_ms: u64,
    /// Parent of the demo's fresh data directory.
    #[arg(long, default_value = "data")]
    data_dir: PathBuf,
    /// Keep the demo's data directory afterwards.
    #[arg(long)]
    keep: bool,
    /// Directory holding the service binaries (default: next to emctl).
    #[arg(long, env = "EM_BIN_DIR")]
    bin_dir: Option<PathBuf>,
    /// Print the summary as one JSON object.
    #[arg(long)]
    json: bool,
    #[command(flatten)]
    backend: BackendArgs,
    /// Give up waiting for lag 0 after this many seconds.
    #[arg(long, default_value_t = 120)]
    timeout_secs: u64,
}

/// Every number is counted.
#[derive(Debug, Default, serde::Serialize)]
pub struct Summary {
    pub published: u64,
    pub publish_failures: u64,
    pub delivered: u64,
    pub redelivered: u64,
    pub acked: u64,
    pub ack_pending_answers: u64,
    pub dead_lettered: i64,
    pub lost: u64,
    pub lag: i64,
    pub reconnects: u64,
    pub killed: Option<String>,
    pub seconds: f64,
}

pub async fn run(args: DemoArgs) -> anyhow::Result<()> {
    let stamp = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis())
        .unwrap_or_default();
    let run_dir = args.data_dir.join(format!("demo-{stamp}"));
    let mut config = args.backend.apply(LocalConfig::new(&run_dir))?;
    config.bin_dir = args.bin_dir.clone();
    config.log_filter = "warn".into();
    let mut instance = LocalInstance::start(config)
        .await
        .context("starting the local instance")?;
    let outcome = drive(&args, &mut instance).await;
    instance.stop(Duration::from_secs(15)).await;
    if !args.keep {
        let _ = std::fs::remove_dir_all(&run_dir);
    }
    let summary = outcome?;
    if args.json {
        println!("{}", serde_json::to_string(&summary)?);
    } else {
        print_summary(&summary);
    }
    if summary.lost > 0 || summary.lag > 0 {
        bail!("{} events lost, lag {}", summary.lost, summary.lag);
    }
    Ok(())
}

async fn drive(args: &DemoArgs, instance: &mut LocalInstance) -> anyhow::Result<Summary> {
    let started = Instant::now();
    let bars = MultiProgress::new();
    let say = |line: String| {
        if bars.is_hidden() {
            eprintln!("{line}");
        } else {
            let _ = bars.println(line);
        }
    };
    say(format!(
        "instance up: dispatcher {}, puller {}, offset-svc {} (data {})",
        instance.uri(Service::Dispatcher),
        instance.uri(Service::Puller),
        instance.uri(Service::Offset),
        instance.data_dir().display()
    ));
    let client = Client::connect(
        ClientConfig::new("demo-app")
            .endpoint(instance.endpoint())
            .retry_deadline(Duration::from_secs(60)),
    )
    .await?;
    let mut subscription = client
        .subscribe(
            SubscribeOptions::new(TOPIC)
                .group(GROUP)
                .start(StartPosition::Earliest)
                .max_in_flight(512),
        )
        .await?;

    let published_bar = bars.add(progress(args.events, "published"));
    let acked_bar = bars.add(progress(args.events, "ACKed"));
    let published = Arc::new(AtomicU64::new(0));
    let publisher = tokio::spawn(publish_all(
        client.clone(),
        args.events,
        args.size,
        args.uniform,
        Arc::clone(&published),
        published_bar.clone(),
    ));

    let mut seen: HashMap<String, u32> = HashMap::new();
    let mut killed = None;
    let kill_after = (args.events as f64 * args.kill_at) as usize;
    let deadline = Instant::now() + Duration::from_secs(args.timeout_secs);
    let mut publisher = Some(publisher);
    let mut publish_result = None;
    loop {
        if let Some(handle) = publisher.as_ref()
            && handle.is_finished()
            && let Some(handle) = publisher.take()
        {
            publish_result = Some(handle.await.context("publisher task")??);
        }
        if let Some((ok, _)) = publish_result
            && seen.len() as u64 >= ok
        {
            break;
        }
        if Instant::now() > deadline {
            say(format!("timeout: {} of the events seen", seen.len()));
            break;
        }
        if killed.is_none() && args.kill != Victim::None && seen.len() >= kill_after {
            let service = match args.kill {
                Victim::Offset => Service::Offset,
                Victim::Puller => Service::Puller,
                Victim::Dispatcher | Victim::None => Service::Dispatcher,
            };
            say(format!(
                "SIGKILL {service} (pid {}) with {} of {} events ACKed",
                instance.pid(service).unwrap_or_default(),
                seen.len(),
                args.events
            ));
            instance.kill(service).await?;
            tokio::time::sleep(Duration::from_millis(args.down_ms)).await;
            instance.start_service(service, None).await?;
            say(format!(
                "{service} restarted (pid {}) after {} ms down",
                instance.pid(service).unwrap_or_default(),
                args.down_ms
            ));
            killed = Some(service.to_string());
        }
        receive(&mut subscription, &mut seen, &acked_bar).await?;
    }
    let (published_ok, publish_failures) = match publish_result {
        Some(result) => result,
        None => {
            if let Some(handle) = publisher.take() {
                handle.abort();
            }
            (published.load(Ordering::Relaxed), 0)
        }
    };
    published_bar.finish();
    acked_bar.finish();

    // The watermark trails the ACKs by one coalescing window; wait for lag 0 (or the deadline).
    let services = Services {
        offset_svc: instance.uri(Service::Offset),
        puller: instance.uri(Service::Puller),
    };
    // The watermark trails the ACKs by one coalescing window, and deliveries whose ACK died with
    // a killed service come back: keep ACKing until the lag is 0 (or the deadline).
    let lag = loop {
        let lag = group_lag(&services).await?;
        if lag == 0 || Instant::now() > deadline {
            break lag;
        }
        receive(&mut subscription, &mut seen, &acked_bar).await?;
    };
    // Lag 0 says the offsets are durable; the DURABLE answers of the last ACKs may still be on
    // their way here. Count them once every ACK is answered, or once answers have stopped
    // arriving for a moment (ACKs sent to a killed dispatcher are never answered).
    let answered =
        |stats: &eventmesh_client::SubscriptionStats| stats.durable + stats.pending + stats.no_op;
    let mut last = answered(&subscription.stats());
    let mut quiet_since = Instant::now();
    while lag == 0 && Instant::now() < deadline && quiet_since.elapsed() < ANSWERS_SETTLE {
        let stats = subscription.stats();
        if answered(&stats) >= stats.acks_sent {
            break;
        }
        receive(&mut subscription, &mut seen, &acked_bar).await?;
        let now = answered(&subscription.stats());
        if now != last {
            last = now;
            quiet_since = Instant::now();
        }
    }
    let stats = subscription.stats();
    subscription.close().await;
    let lost = (0..published_ok)
        .filter(|n| !seen.contains_key(&event_id(*n)))
        .count() as u64;
    Ok(Summary {
        published: published_ok,
        publish_failures,
        delivered: seen.values().map(|&n| u64::from(n)).sum(),
        redelivered: seen.values().map(|&n| u64::from(n - 1)).sum(),
        acked: stats.durable,
        ack_pending_answers: stats.pending,
        dead_lettered: dead_lettered(&services).await?,
        lost,
        lag,
        reconnects: stats.reconnects,
        killed,
        seconds: started.elapsed().as_secs_f64(),
    })
}

/// How long no ACK answer may arrive before the demo stops waiting for the last ones.
const ANSWERS_SETTLE: Duration = Duration::from_millis(500);

/// Takes one delivery (waiting at most 200 ms), counts it by event id and ACKs it.
async fn receive(
    subscription: &mut Subscription,
    seen: &mut HashMap<String, u32>,
    acked_bar: &indicatif::ProgressBar,
) -> anyhow::Result<()> {
    let delivery = match tokio::time::timeout(Duration::from_millis(200), subscription.next()).await
    {
        Ok(Some(delivery)) => delivery.context("subscription ended")?,
        Ok(None) => bail!("subscription ended"),
        Err(_) => return Ok(()),
    };
    let count = seen.entry(delivery.event.id.clone()).or_default();
    *count += 1;
    if *count == 1 {
        acked_bar.inc(1);
    }
    delivery.ack();
    Ok(())
}

fn event_id(n: u64) -> String {
    format!("demo-{n:08}")
}

/// Publishes events 0..count with known ids; returns (confirmed, failed).
async fn publish_all(
    client: Client,
    count: u64,
    size: usize,
    uniform: bool,
    published: Arc<AtomicU64>,
    bar: indicatif::ProgressBar,
) -> anyhow::Result<(u64, u64)> {
    let largest = if uniform {
        size
    } else {
        size.max(eventmesh_client::MAX_EVENT_DATA_BYTES)
    };
    let payload = bytes::Bytes::from(vec![b'x'; largest]);
    let mut publishes = futures::stream::iter(0..count)
        .map(|n| {
            let bytes = if uniform {
                size
            } else {
                eventmesh_client::mixed_event_size(n, size)
            };
            let event = Event {
                id: event_id(n),
                source: "/emctl/demo".into(),
                r#type: "demo.order".into(),
                data: payload.slice(..bytes),
                ..Event::default()
            };
            let client = client.clone();
            async move { (n, client.publish(TOPIC, event).await) }
        })
        .buffer_unordered(PUBLISHES_IN_FLIGHT);
    let mut failures = 0;
    while let Some((n, result)) = publishes.next().await {
        match result {
            Ok(_) => {
                published.fetch_add(1, Ordering::Relaxed);
                bar.inc(1);
            }
            Err(error) => {
                failures += 1;
                tracing::warn!(n, %error, "publish failed");
            }
        }
    }
    Ok((published.load(Ordering::Relaxed), failures))
}

async fn group_lag(services: &Services) -> anyhow::Result<i64> {
    let view = topic_view(services, TOPIC).await?;
    Ok(view
        .iter()
        .map(|partition| partition.lag(partition.watermarks.get(GROUP).copied()))
        .sum())
}

async fn dead_lettered(services: &Services) -> anyhow::Result<i64> {
    let mut puller = PullerServiceClient::connect(services.puller.clone()).await?;
    match puller
        .end_offsets(puller_pb::EndOffsetsRequest {
            topic: format!("{TOPIC}_DLQ"),
        })
        .await
    {
        Ok(answer) => Ok(answer
            .into_inner()
            .partitions
            .iter()
            .map(|p| p.end - p.start)
            .sum()),
        Err(status) if status.code() == tonic::Code::NotFound => Ok(0),
        Err(status) => Err(status).context("reading the dead-letter topic"),
    }
}

fn print_summary(summary: &Summary) {
    println!();
    println!("summary (counted, {:.1} s)", summary.seconds);
    println!("  published      {:>8}", summary.published);
    if summary.publish_failures > 0 {
        println!("  publish failed {:>8}", summary.publish_failures);
    }
    println!("  delivered      {:>8}", summary.delivered);
    println!(
        "  redelivered    {:>8}  (un-ACKed or not yet durable when {} died)",
        summary.redelivered,
        summary.killed.as_deref().unwrap_or("nothing")
    );
    println!("  ACKed          {:>8}  (answered DURABLE)", summary.acked);
    if summary.ack_pending_answers > 0 {
        println!(
            "  ACKs pending   {:>8}  (answered PENDING first, while offset-svc was down)",
            summary.ack_pending_answers
        );
    }
    println!("  dead-lettered  {:>8}", summary.dead_lettered);
    println!("  lost           {:>8}", summary.lost);
    println!("  lag            {:>8}", summary.lag);
    println!("  reconnects     {:>8}", summary.reconnects);
}

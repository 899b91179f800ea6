//! `emctl publish` and `emctl subscribe`.

use std::time::{Duration, Instant};

use anyhow::Context;
use clap::{Args, ValueEnum};
use eventmesh_client::{
    Client, ClientConfig, Event, PendingPublish, Published, Publisher, PublisherOptions,
    StartPosition, SubscribeOptions,
};
use indicatif::{ProgressBar, ProgressStyle};

/// How to reach a dispatcher.
#[derive(Debug, Clone, Args)]
pub struct Connection {
    /// A dispatcher-svc address; repeat for failover seeds.
    #[arg(long = "endpoint", env = "EMCTL_ENDPOINT", default_value = eventmesh_client::DEFAULT_ENDPOINT)]
    pub endpoints: Vec<String>,
    /// This client's id (ACK progress is stored per client).
    #[arg(long, default_value = "emctl")]
    pub client_id: String,
}

impl Connection {
    pub async fn connect(&self) -> anyhow::Result<Client> {
        let mut config = ClientConfig::new(&self.client_id);
        for endpoint in &self.endpoints {
            config = config.endpoint(endpoint);
        }
        Client::connect(config)
            .await
            .with_context(|| format!("connecting to {:?}", self.endpoints))
    }
}

#[derive(Debug, Args)]
pub struct PublishArgs {
    #[command(flatten)]
    connection: Connection,
    /// The topic.
    #[arg(long)]
    topic: String,
    /// Ordering key (same key, same partition, in order).
    #[arg(long, default_value = "")]
    key: String,
    /// The payload; `<n>` is replaced by the event's number (the older brace form too).
    #[arg(long, default_value = "event <n>")]
    data: String,
    /// How many events.
    #[arg(long, default_value_t = 1)]
    count: u64,
    /// CloudEvents type.
    #[arg(long = "type", default_value = "emctl.event")]
    event_type: String,
}

pub async fn publish(args: PublishArgs) -> anyhow::Result<()> {
    let client = args.connection.connect().await?;
    let bar = progress(args.count, "published");
    let started = Instant::now();
    // Batched and pipelined; one batch in flight at a time when a key asks for order.
    let options = PublisherOptions {
        max_in_flight_batches: if args.key.is_empty() { 8 } else { 1 },
        ..PublisherOptions::default()
    };
    let publisher = Publisher::new(client, &args.topic, options);
    let event = |n: u64| Event {
        source: "/emctl".into(),
        r#type: args.event_type.clone(),
        data: args
            .data
            .replace("<n>", &n.to_string())
            .replace("{n}", &n.to_string())
            .into_bytes()
            .into(),
        ..Event::default()
    };
    let single = args.count == 1;
    let answered = bar.clone();
    publish_pipelined(
        &publisher,
        &args.key,
        args.count,
        None,
        event,
        move |_, stored| {
            if single {
                println!(
                    "published {} -> partition {} offset {}",
                    stored.event_id, stored.partition, stored.offset
                );
            }
            answered.inc(1);
        },
    )
    .await
    .with_context(|| format!("publishing to {}", args.topic))?;
    bar.finish();
    if args.count > 1 {
        let seconds = started.elapsed().as_secs_f64();
        println!(
            "published {} events to {} in {seconds:.2} s ({:.0}/s)",
            args.count,
            args.topic,
            args.count as f64 / seconds
        );
    }
    Ok(())
}

/// Publishes events `0..count` (built by `event`) through `publisher`, at most `rate` per
/// second when given, and calls `stored` with each event's number and answer in submit order.
/// Submitting never waits for an answer (a second task awaits them), so the publisher's
/// batches fill up; the first failed event ends it with its error.
pub async fn publish_pipelined(
    publisher: &Publisher,
    key: &str,
    count: u64,
    rate: Option<f64>,
    mut event: impl FnMut(u64) -> Event,
    mut stored: impl FnMut(u64, Published) + Send + 'static,
) -> anyhow::Result<()> {
    let started = Instant::now();
    let (answers, mut answered) = tokio::sync::mpsc::channel::<(u64, PendingPublish)>(64 * 1024);
    let waiter = tokio::spawn(async move {
        while let Some((n, pending)) = answered.recv().await {
            let published = pending
                .wait()
                .await
                .with_context(|| format!("publishing event {n}"))?;
            stored(n, published);
        }
        anyhow::Ok(())
    });
    for n in 0..count {
        if let Some(rate) = rate {
            let due = started + Duration::from_secs_f64(n as f64 / rate);
            tokio::time::sleep_until(due.into()).await;
        }
        let pending = publisher.submit(key, event(n)).await?;
        if answers.send((n, pending)).await.is_err() {
            break; // the waiter stopped at a failed event: its error is returned below
        }
    }
    drop(answers);
    waiter.await?
}

#[derive(Debug, Clone, Copy, ValueEnum)]
pub enum Start {
    /// The server's default (stored watermark, else the live end).
    Default,
    /// Only new events.
    Latest,
    /// Everything retained.
    Earliest,
    /// The stored watermark + 1.
    Stored,
}

impl From<Start> for StartPosition {
    fn from(start: Start) -> Self {
        match start {
            Start::Default => StartPosition::Unspecified,
            Start::Latest => StartPosition::Latest,
            Start::Earliest => StartPosition::Earliest,
            Start::Stored => StartPosition::Stored,
        }
    }
}

#[derive(Debug, Args)]
pub struct SubscribeArgs {
    #[command(flatten)]
    connection: Connection,
    /// The topic.
    #[arg(long)]
    topic: String,
    /// The subscription group (empty: the topic's default group).
    #[arg(long, default_value = "")]
    group: String,
    /// Receive every event (BROADCAST: this client is its own group).
    #[arg(long)]
    broadcast: bool,
    /// Where a newly created group starts.
    #[arg(long, value_enum, default_value_t = Start::Default)]
    start: Start,
    /// Stop after this many deliveries (default: until Ctrl-C).
    #[arg(long)]
    count: Option<u64>,
    /// Most un-ACKed deliveries at once (0: server default).
    #[arg(long, default_value_t = 0)]
    max_in_flight: u32,
    /// Print deliveries without ACKing them (they come back after the ACK timeout).
    #[arg(long)]
    no_ack: bool,
    /// Only count, print nothing per delivery.
    #[arg(long)]
    quiet: bool,
}

pub async fn subscribe(args: SubscribeArgs) -> anyhow::Result<()> {
    let client = args.connection.connect().await?;
    let mut options = SubscribeOptions::new(&args.topic)
        .group(&args.group)
        .start(args.start.into())
        .max_in_flight(args.max_in_flight);
    if args.broadcast {
        options = options.broadcast();
    }
    let mut subscription = client
        .subscribe(options)
        .await
        .with_context(|| format!("subscribing to {}", args.topic))?;
    if let Some(session) = subscription.session() {
        eprintln!(
            "subscribed: session {} group {} on {} (max in flight {})",
            session.session_id, session.group, session.instance_id, session.max_in_flight
        );
    }
    let mut received = 0u64;
    loop {
        if args.count.is_some_and(|count| received >= count) {
            break;
        }
        let delivery = tokio::select! {
            delivery = subscription.next() => delivery,
            _ = tokio::signal::ctrl_c() => break,
        };
        let Some(delivery) = delivery else { break };
        let delivery = delivery.context("subscription ended")?;
        received += 1;
        if !args.quiet {
            println!(
                "{} attempt {} partition {} offset {} id {}: {}",
                delivery.topic,
                delivery.attempt,
                delivery.partition,
                delivery.offset,
                delivery.event.id,
                String::from_utf8_lossy(&delivery.event.data)
            );
        }
        if !args.no_ack {
            delivery.ack();
        }
    }
    // Let the last ACKs' answers arrive before the session closes.
    let deadline = Instant::now() + Duration::from_secs(5);
    while !args.no_ack && subscription.stats().durable < received && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let stats = subscription.stats();
    subscription.close().await;
    eprintln!(
        "received {received}; ACKs durable {}, pending {}, no-op {}; redelivered {}; reconnects {}; moves {}",
        stats.durable, stats.pending, stats.no_op, stats.redelivered, stats.reconnects, stats.moves
    );
    Ok(())
}

/// A progress bar on stderr (hidden when stderr is not a terminal).
pub fn progress(total: u64, what: &'static str) -> ProgressBar {
    let bar = ProgressBar::new(total);
    bar.set_style(
        ProgressStyle::with_template("{prefix:>12} [{bar:40}] {pos}/{len} {per_sec} {msg}")
            .unwrap_or_else(|_| ProgressStyle::default_bar())
            .progress_chars("=> "),
    );
    bar.set_prefix(what);
    bar
}

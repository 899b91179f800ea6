//! The round itself: publish, full-load consume, live- and half-load consume (method in the
//! crate docs).
//!
//! Every wait is bounded: API calls and ACK confirmations by [`API_TIMEOUT`], consuming by
//! [`STALL_TIMEOUT`] without progress, draining by [`DRAIN_TIMEOUT`]; each ends the round with
//! an error saying what was being waited for and how far it got.

use crate::cli::{Cli, HalfLoadOf};
use crate::procstat::{CpuMark, rss_mb};
use crate::report::{Report, SYNC_NOTE, round};
use crate::stats::Latencies;
use anyhow::{Context as _, Result, anyhow, bail, ensure};
use async_nats::jetstream::consumer::{AckPolicy, DeliverPolicy, PullConsumer, pull};
use async_nats::jetstream::context::PublishAckFuture;
use async_nats::jetstream::stream::{self, RetentionPolicy, StorageType};
use async_nats::jetstream::{self, Context};
use async_nats::{Client, ConnectOptions, Subject};
use bytes::Bytes;
use futures::StreamExt;
use std::collections::VecDeque;
use std::fmt::Display;
use std::future::{Future, IntoFuture};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, SystemTime, UNIX_EPOCH};
use tokio::sync::{Barrier, mpsc, watch};
use tokio::task::{JoinError, JoinSet};
use tokio::time::Instant;

/// Publish ACK futures outstanding at most while publishing (awaited in publish order).
pub const PUBLISH_WINDOW: usize = 4096;
/// At full load, every `SAMPLE_EVERY`th first delivery is ACKed with `double_ack` and timed.
pub const SAMPLE_EVERY: u64 = 64;
/// Bound of one API request, one publish ACK, one `double_ack` confirmation, one connect.
pub const API_TIMEOUT: Duration = Duration::from_secs(10);
/// Consuming fails when no message arrives (or no ACK is confirmed) for this long.
pub const STALL_TIMEOUT: Duration = Duration::from_secs(30);
/// Bound of the end of a phase: consumer info reaching zero, tasks ending, ACKs draining.
pub const DRAIN_TIMEOUT: Duration = Duration::from_secs(30);
/// How often progress and consumer info are polled.
const POLL: Duration = Duration::from_millis(5);
/// The durable consumer's name (one per stream; the streams are unique per round).
const DURABLE: &str = "bench";

/// async-nats errors are boxed `dyn Error`s or its own error types: all `Display`.
pub(crate) trait NatsContext<T> {
    fn nats(self, what: impl FnOnce() -> String) -> Result<T>;
}

impl<T, E: Display> NatsContext<T> for std::result::Result<T, E> {
    fn nats(self, what: impl FnOnce() -> String) -> Result<T> {
        self.map_err(|err| anyhow!("{}: {err}", what()))
    }
}

/// `fut`, or an error naming `what` after `limit`.
pub(crate) async fn within<T>(
    limit: Duration,
    what: impl Display,
    fut: impl Future<Output = T>,
) -> Result<T> {
    tokio::time::timeout(limit, fut)
        .await
        .map_err(|_| anyhow!("timed out after {limit:?} waiting for {what}"))
}

pub(crate) async fn connect(url: &str) -> Result<Client> {
    let connecting = ConnectOptions::new()
        .name("jetstream-bench")
        .connection_timeout(API_TIMEOUT)
        .request_timeout(Some(API_TIMEOUT))
        .connect(url);
    within(API_TIMEOUT, format!("a connection to {url}"), connecting)
        .await?
        .nats(|| format!("connecting to {url}"))
}

pub(crate) fn jetstream_context(client: Client) -> Context {
    jetstream::ContextBuilder::new()
        .timeout(API_TIMEOUT)
        .max_ack_inflight(2 * PUBLISH_WINDOW)
        .backpressure_on_inflight(true)
        .build(client)
}

/// A stream name no other round uses (names may not hold `.`, `*`, `>` or spaces).
pub(crate) fn unique_name() -> String {
    let millis = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|since| since.as_millis())
        .unwrap_or_default();
    format!("PB_{}_{millis}", std::process::id())
}

/// A fresh file-store stream on `bench.<name>`: limits retention, one replica, the server's
/// default sync interval (no fsync per write).
pub(crate) async fn create_stream(js: &Context, name: &str) -> Result<(stream::Stream, Subject)> {
    let subject = format!("bench.{name}");
    let config = stream::Config {
        name: name.to_string(),
        subjects: vec![subject.clone()],
        storage: StorageType::File,
        retention: RetentionPolicy::Limits,
        num_replicas: 1,
        ..Default::default()
    };
    let stream = within(
        API_TIMEOUT,
        format!("stream {name} created"),
        js.create_stream(config),
    )
    .await?
    .nats(|| format!("creating stream {name}"))?;
    Ok((stream, Subject::from(subject)))
}

/// The one durable pull consumer every consumer task of a phase pulls from.
pub(crate) async fn create_consumer(
    stream: &stream::Stream,
    name: &str,
    streams: usize,
) -> Result<PullConsumer> {
    let max_ack_pending = 65_536.max(streams * 1024) as i64;
    let config = pull::Config {
        durable_name: Some(DURABLE.to_string()),
        ack_policy: AckPolicy::Explicit,
        deliver_policy: DeliverPolicy::All,
        max_ack_pending,
        ..Default::default()
    };
    within(
        API_TIMEOUT,
        format!("consumer on {name} created"),
        stream.create_consumer(config),
    )
    .await?
    .nats(|| format!("creating the durable consumer on {name}"))
}

/// Awaits one publish ACK and checks it: from `stream`, not a duplicate.
async fn check_publish_ack(ack: PublishAckFuture, stream: &str) -> Result<()> {
    let ack = within(
        API_TIMEOUT + Duration::from_secs(1),
        "a publish ACK",
        ack.into_future(),
    )
    .await?
    .nats(|| "publish ACK".to_string())?;
    ensure!(
        ack.stream == stream && !ack.duplicate,
        "unexpected publish ACK {ack:?} (stream {stream})"
    );
    Ok(())
}

async fn publish_one(js: &Context, subject: &Subject, payload: &Bytes) -> Result<PublishAckFuture> {
    within(
        API_TIMEOUT,
        "a publish to be sent",
        js.publish(subject.clone(), payload.clone()),
    )
    .await?
    .nats(|| format!("publishing to {subject}"))
}

/// Phase 2: publishes `n` events, up to [`PUBLISH_WINDOW`] ACKs outstanding, awaited in order.
/// Returns the seconds from the first publish to the last ACK.
async fn publish_all(
    js: &Context,
    subject: &Subject,
    payload: &Bytes,
    n: u64,
    stream: &str,
) -> Result<f64> {
    let mut pending = VecDeque::with_capacity(PUBLISH_WINDOW);
    let start = Instant::now();
    for _ in 0..n {
        if pending.len() >= PUBLISH_WINDOW
            && let Some(ack) = pending.pop_front()
        {
            check_publish_ack(ack, stream).await?;
        }
        pending.push_back(publish_one(js, subject, payload).await?);
    }
    while let Some(ack) = pending.pop_front() {
        check_publish_ack(ack, stream).await?;
    }
    Ok(start.elapsed().as_secs_f64())
}

/// Phase 4's publisher: `n` events of `payload` to `subject` at `rate` per second from `start`.
struct Paced {
    js: Context,
    subject: Subject,
    payload: Bytes,
    n: u64,
    rate: f64,
    start: Instant,
    stream: String,
    progress: Arc<Progress>,
}

/// Sends each event when it is due; the ACKs are awaited in order by a second task so pacing
/// never waits on them.
async fn publish_paced(paced: Paced) -> Result<TaskEnd> {
    let Paced {
        js,
        subject,
        payload,
        n,
        rate,
        start,
        stream,
        progress,
    } = paced;
    let (ack_tx, mut ack_rx) = mpsc::channel::<PublishAckFuture>(PUBLISH_WINDOW);
    let acks = tokio::spawn(async move {
        let mut acked = 0u64;
        while let Some(ack) = ack_rx.recv().await {
            check_publish_ack(ack, &stream).await?;
            acked += 1;
        }
        Ok::<u64, anyhow::Error>(acked)
    });
    for i in 0..n {
        let due = start + Duration::from_secs_f64(i as f64 / rate);
        if due > Instant::now() {
            tokio::time::sleep_until(due).await;
        }
        let ack = publish_one(&js, &subject, &payload).await?;
        if ack_tx.send(ack).await.is_err() {
            // The ACK task stopped: its error says why.
            acks.await.context("publish-ACK task")??;
            bail!("the publish-ACK task ended early");
        }
    }
    drop(ack_tx);
    let acked = within(DRAIN_TIMEOUT, "the last publish ACKs", acks)
        .await?
        .context("publish-ACK task")??;
    ensure!(acked == n, "{acked} of {n} publishes ACKed");
    let micros = u64::try_from(start.elapsed().as_micros()).unwrap_or(u64::MAX);
    progress.published_micros.store(micros, Ordering::Relaxed);
    Ok(TaskEnd::Publisher)
}

/// Which deliveries a consumer task ACKs with `double_ack` (timed) instead of a plain `ack`.
#[derive(Debug, Clone, Copy)]
enum AckMode {
    /// Every `n`th first delivery (counted over all tasks).
    Sampled(u64),
    /// Every delivery.
    EveryDouble,
}

/// Counters shared by a phase's consumer tasks and its coordinator.
#[derive(Debug, Default)]
struct Progress {
    /// First deliveries received.
    first: AtomicU64,
    /// Deliveries after the first (ACK wait expired).
    redelivered: AtomicU64,
    /// `double_ack`s of first deliveries the server confirmed.
    confirmed: AtomicU64,
    /// Half load: microseconds from the first publish to the last publish ACK.
    published_micros: AtomicU64,
}

/// What a phase's task returns when it ends without error.
enum TaskEnd {
    Worker(Latencies),
    Publisher,
}

struct WorkerSetup {
    url: String,
    stream: String,
    pull_batch: usize,
    mode: AckMode,
    progress: Arc<Progress>,
    ready: Arc<Barrier>,
    stop: watch::Receiver<bool>,
}

/// One consumer task: its own connection and pull message stream on the phase's durable
/// consumer; ACKs each message as soon as it arrives, until told to stop. Returns the
/// `double_ack` latencies it timed.
async fn consumer_task(setup: WorkerSetup) -> Result<TaskEnd> {
    let WorkerSetup {
        url,
        stream,
        pull_batch,
        mode,
        progress,
        ready,
        mut stop,
    } = setup;
    let client = connect(&url).await?;
    let js = jetstream_context(client.clone());
    let consumer: PullConsumer = within(
        API_TIMEOUT,
        format!("consumer {DURABLE} of {stream}"),
        js.get_consumer_from_stream(DURABLE, &stream),
    )
    .await?
    .nats(|| format!("getting consumer {DURABLE} of {stream}"))?;
    ready.wait().await;
    let mut messages = within(
        API_TIMEOUT,
        "the pull message stream",
        consumer
            .stream()
            .max_messages_per_batch(pull_batch)
            .messages(),
    )
    .await?
    .nats(|| format!("pulling from {stream}"))?;

    let mut acks: JoinSet<Result<Duration>> = JoinSet::new();
    let mut latencies = Latencies::default();
    loop {
        let next = tokio::select! {
            biased;
            () = stopped(&mut stop) => break,
            next = messages.next() => next,
        };
        let message = next
            .ok_or_else(|| anyhow!("the pull message stream of {stream} ended"))?
            .nats(|| format!("pulling from {stream}"))?;
        let delivered = message
            .info()
            .map(|info| info.delivered)
            .nats(|| "message info".into())?;
        // Keep only the ACK handle: the payload is dropped here.
        let (_, acker) = message.split();
        let first = delivered <= 1;
        let double = if first {
            let k = progress.first.fetch_add(1, Ordering::Relaxed);
            match mode {
                AckMode::Sampled(every) => k % every == 0,
                AckMode::EveryDouble => true,
            }
        } else {
            progress.redelivered.fetch_add(1, Ordering::Relaxed);
            matches!(mode, AckMode::EveryDouble)
        };
        if double {
            // Sent without blocking this task: it goes on pulling while the server answers.
            let progress = progress.clone();
            acks.spawn(async move {
                let sent = Instant::now();
                acker.double_ack().await.nats(|| "double_ack".into())?;
                let latency = sent.elapsed();
                if first {
                    progress.confirmed.fetch_add(1, Ordering::Relaxed);
                }
                Ok(latency)
            });
        } else {
            acker.ack().await.nats(|| "ack".into())?;
        }
        while let Some(done) = acks.try_join_next() {
            latencies.push(done.context("double_ack task")??);
        }
    }
    drop(messages);
    within(DRAIN_TIMEOUT, "the last double_ack confirmations", async {
        while let Some(done) = acks.join_next().await {
            latencies.push(done.context("double_ack task")??);
        }
        Ok::<(), anyhow::Error>(())
    })
    .await??;
    within(API_TIMEOUT, "the connection to flush", client.flush())
        .await?
        .nats(|| "flushing".into())?;
    // Only starts draining (closes the connection in the background).
    let _ = client.drain().await;
    Ok(TaskEnd::Worker(latencies))
}

/// Resolves once the coordinator says stop (or is gone).
async fn stopped(stop: &mut watch::Receiver<bool>) {
    // `wait_for`'s guard is not `Send`: drop it here, not across the select.
    let _ = stop.wait_for(|stop| *stop).await.map(|_| ());
}

fn task_failure(
    done: std::result::Result<Result<TaskEnd>, JoinError>,
    what: &str,
) -> anyhow::Error {
    match done {
        Ok(Err(err)) => err.context(format!("{what}: a task failed")),
        Ok(Ok(_)) => anyhow!("{what}: a consumer task ended before it was told to stop"),
        Err(err) => anyhow!("{what}: a task panicked or was cancelled: {err}"),
    }
}

/// A phase's running consumer tasks (and, at half load, its publisher).
struct Group {
    tasks: JoinSet<Result<TaskEnd>>,
    progress: Arc<Progress>,
    stop: watch::Sender<bool>,
    what: &'static str,
}

impl Group {
    /// Starts `cli.streams` consumer tasks on `stream` and returns once all are connected and
    /// about to pull (the moment the phase's clock starts).
    async fn start(cli: &Cli, stream: &str, mode: AckMode, what: &'static str) -> Result<Self> {
        let progress = Arc::new(Progress::default());
        let (stop, stop_rx) = watch::channel(false);
        let ready = Arc::new(Barrier::new(cli.streams + 1));
        let mut tasks = JoinSet::new();
        for _ in 0..cli.streams {
            tasks.spawn(consumer_task(WorkerSetup {
                url: cli.url.clone(),
                stream: stream.to_string(),
                pull_batch: cli.pull_batch,
                mode,
                progress: progress.clone(),
                ready: ready.clone(),
                stop: stop_rx.clone(),
            }));
        }
        let all_ready = async {
            tokio::select! {
                _ = ready.wait() => Ok(()),
                Some(done) = tasks.join_next() => Err(task_failure(done, what)),
            }
        };
        within(
            API_TIMEOUT * 2,
            format!("{what}: {} consumer connections", cli.streams),
            all_ready,
        )
        .await??;
        Ok(Self {
            tasks,
            progress,
            stop,
            what,
        })
    }

    /// Fails when a task ended with an error (a publisher's clean end is fine).
    fn check_tasks(&mut self) -> Result<()> {
        while let Some(done) = self.tasks.try_join_next() {
            if !matches!(done, Ok(Ok(TaskEnd::Publisher))) {
                return Err(task_failure(done, self.what));
            }
        }
        Ok(())
    }

    /// Waits until `counter` reaches `target`; fails after [`STALL_TIMEOUT`] without progress.
    async fn wait_count(
        &mut self,
        counter: fn(&Progress) -> &AtomicU64,
        target: u64,
        noun: &str,
    ) -> Result<()> {
        let mut last = 0;
        let mut last_change = Instant::now();
        loop {
            let now = counter(&self.progress).load(Ordering::Relaxed);
            if now >= target {
                return Ok(());
            }
            if now != last {
                last = now;
                last_change = Instant::now();
            } else if last_change.elapsed() > STALL_TIMEOUT {
                bail!(
                    "{}: {now} of {target} {noun}, no progress for {STALL_TIMEOUT:?}",
                    self.what
                );
            }
            self.check_tasks()?;
            tokio::time::sleep(POLL).await;
        }
    }

    /// Waits until consumer info says every message was delivered and every ACK processed.
    async fn wait_drained(&mut self, consumer: &PullConsumer) -> Result<()> {
        let start = Instant::now();
        loop {
            let info = within(API_TIMEOUT, "consumer info", consumer.get_info())
                .await?
                .nats(|| "consumer info".into())?;
            if info.num_ack_pending == 0 && info.num_pending == 0 {
                return Ok(());
            }
            if start.elapsed() > DRAIN_TIMEOUT {
                bail!(
                    "{}: consumer info still reports {} un-ACKed and {} undelivered after {DRAIN_TIMEOUT:?}",
                    self.what,
                    info.num_ack_pending,
                    info.num_pending
                );
            }
            self.check_tasks()?;
            tokio::time::sleep(POLL).await;
        }
    }

    /// Waits until all `n` messages were received and consumer info reports every ACK
    /// processed: the end of a phase ACKed with plain `ack()`s.
    async fn wait_consumed(&mut self, consumer: &PullConsumer, n: u64) -> Result<()> {
        self.wait_count(|p| &p.first, n, "messages received")
            .await?;
        self.wait_drained(consumer).await
    }

    /// Tells the tasks to stop and collects their latencies.
    async fn finish(mut self) -> Result<(Latencies, u64)> {
        let _ = self.stop.send(true);
        let mut latencies = Latencies::default();
        let what = self.what;
        within(
            DRAIN_TIMEOUT,
            format!("{what}: consumer tasks to end"),
            async {
                while let Some(done) = self.tasks.join_next().await {
                    match done {
                        Ok(Ok(TaskEnd::Worker(timed))) => latencies.extend(timed),
                        Ok(Ok(TaskEnd::Publisher)) => {}
                        failed => return Err(task_failure(failed, what)),
                    }
                }
                Ok(())
            },
        )
        .await??;
        Ok((latencies, self.progress.redelivered.load(Ordering::Relaxed)))
    }
}

/// Runs one round (publish, full load, live and half load unless disabled) and deletes its
/// streams.
pub async fn run(cli: &Cli) -> Result<Report> {
    ensure!(cli.events > 0, "--events must be at least 1");
    ensure!(cli.streams > 0, "--streams must be at least 1");
    ensure!(cli.pull_batch > 0, "--pull-batch must be at least 1");
    if let Some(pid) = cli.server_pid {
        ensure!(
            std::path::Path::new(&format!("/proc/{pid}/stat")).exists(),
            "--server-pid {pid}: no such process"
        );
    }
    let client = connect(&cli.url).await?;
    let js = jetstream_context(client.clone());
    let mut created = Vec::new();
    let result = round_trip(cli, &client, &js, &unique_name(), &mut created).await;
    for name in created {
        // Best effort: the result of the round stands either way.
        let _ = within(API_TIMEOUT, "stream deletion", js.delete_stream(&name)).await;
    }
    let _ = within(API_TIMEOUT, "the connection to flush", client.flush()).await;
    result
}

/// What a live phase (publishing while the consumer tasks consume) measured.
#[derive(Debug, Clone, Copy)]
struct Live {
    events: u64,
    /// The publish target, per second (infinite: as fast as the server answers).
    target: f64,
    publish_rate: f64,
    /// Events / time from the first publish to the last ACK processed.
    rate: f64,
    p50_p99: Option<(f64, f64)>,
    redelivered: u64,
}

/// One live phase on a fresh stream `{base}_{suffix}`: the consumer tasks start, then `n`
/// events are published at `rate` per second (`f64::INFINITY`: unpaced). The clock stops at
/// the last ACK: with `AckMode::EveryDouble` when the last `double_ack` is confirmed, with
/// `AckMode::Sampled` when consumer info reports nothing pending (as at full load).
#[allow(clippy::too_many_arguments)]
async fn live_phase(
    cli: &Cli,
    js: &Context,
    base: &str,
    suffix: &str,
    payload: &Bytes,
    n: u64,
    rate: f64,
    mode: AckMode,
    what: &'static str,
    created: &mut Vec<String>,
) -> Result<Live> {
    let name = format!("{base}_{suffix}");
    let (stream, subject) = create_stream(js, &name).await?;
    created.push(name.clone());
    let consumer = create_consumer(&stream, &name, cli.streams).await?;
    let mut group = Group::start(cli, &name, mode, what).await?;
    let start = Instant::now();
    group.tasks.spawn(publish_paced(Paced {
        js: js.clone(),
        subject,
        payload: payload.clone(),
        n,
        rate,
        start,
        stream: name.clone(),
        progress: group.progress.clone(),
    }));
    let secs = match mode {
        AckMode::EveryDouble => {
            group
                .wait_count(|p| &p.confirmed, n, "ACKs confirmed")
                .await?;
            let secs = start.elapsed().as_secs_f64();
            group.wait_drained(&consumer).await?;
            secs
        }
        AckMode::Sampled(_) => {
            group.wait_consumed(&consumer, n).await?;
            start.elapsed().as_secs_f64()
        }
    };
    let progress = group.progress.clone();
    // After `finish`: the publisher has ended (and stored its time) once the tasks are joined.
    let (mut latencies, redelivered) = group.finish().await?;
    let published_secs = progress.published_micros.load(Ordering::Relaxed) as f64 / 1e6;
    Ok(Live {
        events: n,
        target: rate,
        publish_rate: n as f64 / published_secs.max(1e-9),
        rate: n as f64 / secs,
        p50_p99: latencies.p50_p99(),
        redelivered,
    })
}

async fn round_trip(
    cli: &Cli,
    client: &Client,
    js: &Context,
    base: &str,
    created: &mut Vec<String>,
) -> Result<Report> {
    let payload = Bytes::from(vec![0x5a; cli.size]);
    let n = cli.events;

    // 1–2: a fresh file-store stream, N events published.
    let full_name = format!("{base}_FULL");
    let (full_stream, full_subject) = create_stream(js, &full_name).await?;
    created.push(full_name.clone());
    let publish_secs = publish_all(js, &full_subject, &payload, n, &full_name).await?;
    let stored = within(API_TIMEOUT, "stream info", full_stream.get_info())
        .await?
        .nats(|| "stream info".into())?
        .state
        .messages;
    ensure!(
        stored == n,
        "stream {full_name} holds {stored} messages, {n} were published"
    );

    // 3: full load.
    let full_consumer = create_consumer(&full_stream, &full_name, cli.streams).await?;
    let mut group =
        Group::start(cli, &full_name, AckMode::Sampled(SAMPLE_EVERY), "full load").await?;
    let cpu_start = CpuMark::now(cli.server_pid)?;
    let start = Instant::now();
    group.wait_consumed(&full_consumer, n).await?;
    let e2e_secs = start.elapsed().as_secs_f64();
    let cpu_end = CpuMark::now(cli.server_pid)?;
    let (mut full_latencies, mut redelivered) = group.finish().await?;
    let e2e_per_sec = n as f64 / e2e_secs;
    let (server_cpu, client_cpu) = cpu_start.cores_until(&cpu_end, e2e_secs);
    let full_samples = full_latencies.len();
    let full_p = full_latencies.p50_p99();

    // 4: live load, 5: half load.
    let mut live = None;
    let mut half = None;
    if !cli.no_half_load {
        let half_n = (n / 2).max(1);
        let measured = live_phase(
            cli,
            js,
            base,
            "LIVE",
            &payload,
            half_n,
            f64::INFINITY,
            AckMode::Sampled(SAMPLE_EVERY),
            "live load",
            created,
        )
        .await?;
        let basis = match cli.half_load_of {
            HalfLoadOf::Live => measured.rate,
            HalfLoadOf::Full => e2e_per_sec,
        };
        let measured_half = live_phase(
            cli,
            js,
            base,
            "HALF",
            &payload,
            half_n,
            basis / 2.0,
            AckMode::EveryDouble,
            "half load",
            created,
        )
        .await?;
        redelivered += measured.redelivered + measured_half.redelivered;
        live = Some(measured);
        half = Some(measured_half);
    }

    let server_rss = cli.server_pid.map(rss_mb).transpose()?;
    let half_p = half.and_then(|h| h.p50_p99);
    let live_p = live.and_then(|l| l.p50_p99);
    Ok(Report {
        peer: "jetstream",
        size: cli.size,
        streams: cli.streams,
        events: n,
        publish_per_sec: round(n as f64 / publish_secs, 1),
        e2e_per_sec: round(e2e_per_sec, 1),
        full_ack_p50_ms: full_p.map(|(p50, _)| round(p50, 3)),
        full_ack_p99_ms: full_p.map(|(_, p99)| round(p99, 3)),
        live_per_sec: live.map(|l| round(l.rate, 1)),
        live_ack_p50_ms: live_p.map(|(p50, _)| round(p50, 3)),
        live_ack_p99_ms: live_p.map(|(_, p99)| round(p99, 3)),
        half_load_of: cli.half_load_of,
        half_rate_per_sec: half.map(|h| round(h.rate, 1)),
        half_ack_p50_ms: half_p.map(|(p50, _)| round(p50, 3)),
        half_ack_p99_ms: half_p.map(|(_, p99)| round(p99, 3)),
        server_cpu_cores: server_cpu.map(|c| round(c, 3)),
        server_rss_mb: server_rss.map(|mb| round(mb, 1)),
        client_cpu_cores: round(client_cpu, 3),
        full_ack_samples: full_samples,
        half_events: half.map(|h| h.events),
        half_target_per_sec: half.map(|h| round(h.target, 1)),
        half_publish_per_sec: half.map(|h| round(h.publish_rate, 1)),
        redelivered,
        server_version: client.server_info().version,
        storage: SYNC_NOTE,
    })
}

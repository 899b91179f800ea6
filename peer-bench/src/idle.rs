//! The idle first-event probe against JetStream (`--idle-only`): the same shape as
//! `emctl bench --idle-only`, so the two can be alternated and put side by side.
//!
//! One connection; a fresh file-store stream and one durable pull consumer (explicit ACK) with
//! one pull message stream on it, waiting. Each sample, after `--idle-gap-ms` of quiet,
//! publishes one event (a spawned task awaits its publish ACK) and times it until the consumer
//! receives it; then the message is ACKed (plain `ack`, as `emctl` ACKs without waiting) and
//! the sample waits for the publish ACK too. A first event, published and received before timing,
//! warms the path, as ours does. Reported: the publish → delivery latency (p50, p99, max) and
//! the publish call alone (p50, p99, max); nearest-rank percentiles, which pick the same
//! sample as `emctl`'s for the p50 always and for the p99 at 100, 200 or 1,000 samples (the
//! script's 200), not at every count.

use std::future::IntoFuture;
use std::time::Duration;

use anyhow::{Context as _, Result, anyhow, ensure};
use async_nats::Subject;
use async_nats::jetstream::consumer::PullConsumer;
use async_nats::jetstream::{self, Context};
use bytes::Bytes;
use futures::{Stream, StreamExt};
use serde::Serialize;
use tokio::time::Instant;

use crate::cli::Cli;
use crate::report::round;
use crate::stats::Latencies;
use crate::workload::{
    API_TIMEOUT, NatsContext as _, connect, create_consumer, create_stream, jetstream_context,
    unique_name, within,
};

/// Longest a sample waits for its delivery.
const DELIVERY_TIMEOUT: Duration = Duration::from_secs(30);

/// The probe's results, with the field names of `emctl bench --idle-only --json`.
#[derive(Debug, Clone, Serialize)]
pub struct IdleReport {
    pub peer: &'static str,
    pub idle_samples: usize,
    pub idle_gap_ms: u64,
    pub first_event_p50_ms: f64,
    pub first_event_p99_ms: f64,
    pub first_event_max_ms: f64,
    /// The publish call alone (answered by the server's publish ACK).
    pub publish_p50_ms: f64,
    pub publish_p99_ms: f64,
    pub publish_max_ms: f64,
    pub storage: &'static str,
}

impl IdleReport {
    pub fn human_line(&self) -> String {
        format!(
            "jetstream idle first event ({} samples, {} ms apart): p50 {:.2} ms, p99 {:.2} ms, max {:.2} ms (publish call alone p50 {:.2} ms, p99 {:.2} ms, max {:.2} ms)",
            self.idle_samples,
            self.idle_gap_ms,
            self.first_event_p50_ms,
            self.first_event_p99_ms,
            self.first_event_max_ms,
            self.publish_p50_ms,
            self.publish_p99_ms,
            self.publish_max_ms
        )
    }
}

/// Runs the probe on a fresh stream and deletes it.
pub async fn run_idle(cli: &Cli) -> Result<IdleReport> {
    ensure!(cli.idle_samples > 0, "--idle-samples must be at least 1");
    let client = connect(&cli.url).await?;
    let js = jetstream_context(client.clone());
    let name = format!("{}_IDLE", unique_name());
    let result = probe(cli, &js, &name).await;
    // Best effort: the result stands either way.
    let _ = within(API_TIMEOUT, "stream deletion", js.delete_stream(&name)).await;
    let _ = within(API_TIMEOUT, "the connection to flush", client.flush()).await;
    result
}

async fn probe(cli: &Cli, js: &Context, name: &str) -> Result<IdleReport> {
    let (stream, subject) = create_stream(js, name).await?;
    let consumer: PullConsumer = create_consumer(&stream, name, 1).await?;
    let mut messages = within(API_TIMEOUT, "the pull message stream", consumer.messages())
        .await?
        .nats(|| format!("pulling from {name}"))?;
    let payload = Bytes::from_static(b"idle");
    // The first event warms the path and is not timed.
    publish_acked(js.clone(), subject.clone(), payload.clone()).await?;
    ack(receive(&mut messages).await?).await?;

    let mut first_event = Latencies::default();
    let mut publish_call = Latencies::default();
    for _ in 0..cli.idle_samples {
        tokio::time::sleep(Duration::from_millis(cli.idle_gap_ms)).await;
        let started = Instant::now();
        // The delivery may arrive before the publish ACK: wait for both.
        let publish = {
            let (js, subject, payload) = (js.clone(), subject.clone(), payload.clone());
            tokio::spawn(async move {
                let answered = publish_acked(js, subject, payload).await;
                (answered, started.elapsed())
            })
        };
        let message = receive(&mut messages).await?;
        first_event.push(started.elapsed());
        ack(message).await?;
        let (answered, took) = publish.await.context("idle probe publish task")?;
        answered?;
        publish_call.push(took);
    }
    let summary = |latencies: &mut Latencies| -> Result<(f64, f64, f64)> {
        let (p50, p99) = latencies.p50_p99().ok_or_else(|| anyhow!("no samples"))?;
        Ok((p50, p99, latencies.max().unwrap_or(p99)))
    };
    let (p50, p99, max) = summary(&mut first_event)?;
    let (publish_p50, publish_p99, publish_max) = summary(&mut publish_call)?;
    Ok(IdleReport {
        peer: "jetstream",
        idle_samples: first_event.len(),
        idle_gap_ms: cli.idle_gap_ms,
        first_event_p50_ms: round(p50, 3),
        first_event_p99_ms: round(p99, 3),
        first_event_max_ms: round(max, 3),
        publish_p50_ms: round(publish_p50, 3),
        publish_p99_ms: round(publish_p99, 3),
        publish_max_ms: round(publish_max, 3),
        storage: crate::report::SYNC_NOTE,
    })
}

/// Publishes one event and awaits its publish ACK.
async fn publish_acked(js: Context, subject: Subject, payload: Bytes) -> Result<()> {
    let ack = within(
        API_TIMEOUT,
        "a publish to be sent",
        js.publish(subject, payload),
    )
    .await?
    .nats(|| "publishing".into())?;
    within(API_TIMEOUT, "a publish ACK", ack.into_future())
        .await?
        .nats(|| "publish ACK".into())?;
    Ok(())
}

/// The next message.
async fn receive<S>(messages: &mut S) -> Result<jetstream::Message>
where
    S: Stream<Item = Result<jetstream::Message, jetstream::consumer::pull::MessagesError>> + Unpin,
{
    within(
        DELIVERY_TIMEOUT,
        "the idle probe's delivery",
        messages.next(),
    )
    .await?
    .ok_or_else(|| anyhow!("the pull message stream ended"))?
    .nats(|| "pulling".into())
}

/// ACKs a message without waiting for the server's confirmation, after the sample's clock
/// stopped (as `emctl` takes the delivery's time before its ACK leaves).
async fn ack(message: jetstream::Message) -> Result<()> {
    message.ack().await.nats(|| "ack".into())
}

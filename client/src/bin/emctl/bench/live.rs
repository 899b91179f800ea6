//! The live phases of `emctl bench`: events published while the sessions consume them, on a
//! fresh topic and group each.
//!
//! - **Live load**: N/2 events published as fast as the instance answers while the S sessions
//!   consume; its rate is N/2 / (first publish → last ACK answered DURABLE), the most the
//!   machine does when publishing and consuming share it. ACK → DURABLE of every 64th delivery
//!   of each stream, as at full load.
//! - **Half load**: N/2 events published at a share (`--half-load-share`, 0.5) of a measured
//!   maximum, paced; ACK → DURABLE of every delivery, and each stage's share when probing
//!   (`EM_PROBE_DIR`, `stages.rs`). The maximum is the live load's by default; with
//!   `--half-load-of full` it is the full load's (the method before 2026-12-07): publishing then
//!   shares the machine, so half of the full load's rate is near the live maximum, not half.

use std::time::{Duration, Instant};

use anyhow::Context;
use clap::ValueEnum;

use super::{
    BenchArgs, Clients, FULL_LOAD_SAMPLE_EVERY, Sampling, consume, events_per_batch, percentiles,
    publish,
};
use crate::stages;

/// The measured maximum the half load is a share of (`--half-load-of`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum HalfLoadOf {
    /// The live load's rate: publishing and consuming at once, as fast as they go.
    Live,
    /// The full load's rate: consuming what was published before.
    Full,
}

/// Which live phase to run.
#[derive(Debug, Clone, Copy)]
pub(super) enum Phase {
    /// Unpaced.
    Live,
    /// Paced to `rate` per second.
    Half { rate: f64 },
}

impl Phase {
    fn name(self) -> &'static str {
        match self {
            Phase::Live => "live",
            Phase::Half { .. } => "half",
        }
    }
}

/// What a live phase measured.
#[derive(Debug, Default)]
pub(super) struct LiveLoad {
    /// N/2 / (first publish → last ACK answered DURABLE).
    pub rate_per_sec: f64,
    pub ack_p50_ms: f64,
    pub ack_p99_ms: f64,
    pub ack_stages: Vec<stages::StageLatency>,
    /// Events per `PublishBatch` call.
    pub events_per_batch: f64,
}

/// Runs `phase` on a fresh topic and group of `streams` sessions.
pub(super) async fn run(
    args: &BenchArgs,
    clients: &Clients,
    run_tag: &str,
    size: usize,
    streams: usize,
    phase: Phase,
) -> anyhow::Result<LiveLoad> {
    // Unpaced with every 64th ACK timed, or paced with every ACK timed (and marked when
    // probing).
    let (pace, sampling, probes) = match phase {
        Phase::Live => (
            None,
            Sampling {
                every: FULL_LOAD_SAMPLE_EVERY,
                marking: false,
            },
            None,
        ),
        Phase::Half { rate } => {
            let probes = stages::probe_dir()?;
            let sampling = Sampling {
                every: 1,
                marking: probes.is_some(),
            };
            (Some(rate), sampling, probes)
        }
    };
    let name = phase.name();
    let topic = format!("bench-{name}-{run_tag}-{size}-{streams}");
    let events = (args.events / 2).max(1);
    // Create the topic so the group can start before the first publish.
    publish(&clients.publisher, &topic, size, 1, None).await?;
    let consumer = {
        let connection = clients.consumers.clone();
        let topic = topic.clone();
        let group = format!("{name}-{size}-{streams}");
        let max_in_flight = args.max_in_flight;
        tokio::spawn(async move {
            consume(
                &connection,
                &topic,
                &group,
                streams,
                max_in_flight,
                events + 1,
                sampling,
            )
            .await
        })
    };
    // The sessions join and take the topic's first event before the clock starts.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let window_start = stages::now_ns();
    let started = Instant::now();
    let sent = publish(&clients.publisher, &topic, size, events, pace).await?;
    let consumed = consumer
        .await
        .with_context(|| format!("{name}-load consumer"))??;
    let rate_per_sec = events as f64 / started.elapsed().as_secs_f64();
    let (ack_p50_ms, ack_p99_ms) = percentiles(consumed.latencies);
    let ack_stages = match &probes {
        Some(dir) => stages::breakdown(dir, (window_start, stages::now_ns()), &consumed.marks)?,
        None => Vec::new(),
    };
    Ok(LiveLoad {
        rate_per_sec,
        ack_p50_ms,
        ack_p99_ms,
        ack_stages,
        events_per_batch: events_per_batch(sent),
    })
}

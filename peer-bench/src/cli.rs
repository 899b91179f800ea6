//! Command-line flags of `jetstream-bench`: one round of one configuration per invocation.

use clap::{Parser, ValueEnum};
use serde::Serialize;

/// Runs one round of the `emctl bench` workload against NATS JetStream and prints one line.
#[derive(Debug, Clone, Parser)]
#[command(name = "jetstream-bench", version, about)]
pub struct Cli {
    /// The NATS server's client URL (`scripts/nats.sh start` prints it).
    #[arg(long, env = "NATS_URL", default_value = "nats://127.0.0.1:4222")]
    pub url: String,
    /// The nats-server's pid, for its CPU and RSS (`DIR/nats.pid` of `scripts/nats.sh`);
    /// without it those fields are null.
    #[arg(long, env = "NATS_SERVER_PID")]
    pub server_pid: Option<u32>,
    /// Events published and consumed at full load (half load uses half of them).
    #[arg(long, default_value_t = 200_000)]
    pub events: u64,
    /// Payload size in bytes.
    #[arg(long, default_value_t = 256)]
    pub size: usize,
    /// Concurrent consumer tasks (each its own connection) pulling from one durable consumer.
    #[arg(long, default_value_t = 1)]
    pub streams: usize,
    /// Messages asked for per pull request by each task.
    #[arg(long, default_value_t = 1024)]
    pub pull_batch: usize,
    /// Skip the live- and half-load phases (their fields are null).
    #[arg(long)]
    pub no_half_load: bool,
    /// Which measured maximum the half load is half of: the live load's (N/2 published while
    /// the consumer consumes: publishing and consuming share the machine, as they do at half
    /// load) or the full load's (consuming a stream published beforehand).
    #[arg(long, value_enum, default_value_t = HalfLoadOf::Live)]
    pub half_load_of: HalfLoadOf,
    /// Run only the idle first-event probe (single events after quiet spells, timed publish
    /// → delivery), as `emctl bench --idle-only` does on our side.
    #[arg(long)]
    pub idle_only: bool,
    /// Samples of the idle probe.
    #[arg(long, default_value_t = 200)]
    pub idle_samples: u32,
    /// Quiet time before each idle probe event, in milliseconds.
    #[arg(long, default_value_t = 200)]
    pub idle_gap_ms: u64,
    /// Print one JSON object instead of a human-readable line.
    #[arg(long)]
    pub json: bool,
}

/// The maximum the half load is half of (`--half-load-of`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum HalfLoadOf {
    /// The live load's rate: publishing and consuming at once, as fast as they go.
    Live,
    /// The full load's rate: consuming what was published before.
    Full,
}

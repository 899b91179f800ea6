//! `emctl`: run a local EventMesh instance, publish, subscribe, inspect and reset offsets, and
//! the end-to-end demo. `emctl --help` and `emctl <command> --help` describe everything.

mod backend;
mod bench;
mod cluster;
mod demo;
mod offsets;
mod pubsub;
mod rocketmq_check;
mod stages;
mod top;
mod up;

use clap::{Parser, Subcommand};

/// mimalloc, as the services use: `emctl bench` is the client side of the benchmarks, and
/// `jetstream-bench` (its peer) uses the same allocator.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

#[derive(Debug, Parser)]
#[command(
    name = "emctl",
    version,
    about = "Run, use and inspect EventMesh: a local instance, publish/subscribe, offsets, and the crash-and-recover demo."
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Start offset-svc, puller-svc (embedded local backend) and dispatcher-svc on loopback;
    /// Ctrl-C stops them cleanly.
    Up(up::UpArgs),
    /// Publish events to a topic.
    Publish(pubsub::PublishArgs),
    /// Subscribe to a topic, print and ACK deliveries.
    Subscribe(pubsub::SubscribeArgs),
    /// Per-partition end offsets, group watermark, per-client offsets and lag of a topic.
    Offsets(offsets::TopicReportArgs),
    /// Operator: set stored offsets of a topic (asks for confirmation).
    ResetOffsets(offsets::ResetArgs),
    /// The cluster's live instances with their load, and each group's home instance.
    Cluster(cluster::ClusterArgs),
    /// A live view of one dispatcher-svc's groups: rates, lag, in-flight, oldest un-ACKed
    /// age, redeliveries, NACKs, dead letters (Ctrl-C ends it).
    Top(top::TopArgs),
    /// Bring an instance up, publish and consume N events, SIGKILL a service part-way and
    /// restart it, then count what happened.
    Demo(demo::DemoArgs),
    /// RocketMQ backends: what bounds a topic's storage on its brokers (commit log, consume
    /// queues, fileReservedTime) beside our cursors and watermarks; exits 1 on a warning.
    RocketmqCheck(offsets::TopicReportArgs),
    /// Measure end-to-end delivered-and-ACKed throughput and ACK → durable latency of a local
    /// instance against raw pull throughput from its puller-svc.
    Bench(bench::BenchArgs),
}

fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("EMCTL_LOG")
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("error")),
        )
        .with_writer(std::io::stderr)
        .init();
    let command = Cli::parse().command;
    // The bench's client shares the machine with the instance it starts: it gets a share of
    // the cores as puller-svc and offset-svc do (0: tokio's default, as for every other command).
    let workers = match &command {
        Command::Bench(args) => {
            // As every service does (eventmesh_common::alloc), and `jetstream-bench` too.
            turn_huge_pages_off();
            args.client_worker_threads()
        }
        _ => 0,
    };
    let mut runtime = tokio::runtime::Builder::new_multi_thread();
    if workers > 0 {
        runtime.worker_threads(workers);
    }
    runtime.enable_all().build()?.block_on(run(command))
}

/// Transparent huge pages off for this process (`prctl(PR_SET_THP_DISABLE)`): the bench's
/// client then pays the same page faults as the services it measures. A refusal (a kernel
/// without THP) changes nothing worth failing for.
#[allow(unsafe_code)]
fn turn_huge_pages_off() {
    // SAFETY: integer arguments only; it sets a flag of this process.
    let _ = unsafe { libc::prctl(libc::PR_SET_THP_DISABLE, 1, 0, 0, 0) };
}

async fn run(command: Command) -> anyhow::Result<()> {
    match command {
        Command::Up(args) => up::run(args).await,
        Command::Publish(args) => pubsub::publish(args).await,
        Command::Subscribe(args) => pubsub::subscribe(args).await,
        Command::Offsets(args) => offsets::show(args).await,
        Command::ResetOffsets(args) => offsets::reset(args).await,
        Command::Cluster(args) => cluster::run(args).await,
        // A live view ends on Ctrl-C: that is its normal end, not a failure.
        Command::Top(args) => tokio::select! {
            result = top::run(args) => result,
            _ = terminated() => Ok(()),
        },
        Command::RocketmqCheck(args) => rocketmq_check::run(args).await,
        // Dropping the run on a signal drops its local instance, which kills the services.
        Command::Demo(args) => until_signal(demo::run(args)).await,
        Command::Bench(args) => until_signal(bench::run(args)).await,
    }
}

/// Resolves on Ctrl-C or SIGTERM, naming it.
pub async fn terminated() -> &'static str {
    let mut term = match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
        Ok(term) => term,
        Err(_) => {
            let _ = tokio::signal::ctrl_c().await;
            return "SIGINT";
        }
    };
    tokio::select! {
        _ = tokio::signal::ctrl_c() => "SIGINT",
        _ = term.recv() => "SIGTERM",
    }
}

async fn until_signal(work: impl Future<Output = anyhow::Result<()>>) -> anyhow::Result<()> {
    tokio::select! {
        result = work => result,
        signal = terminated() => anyhow::bail!("stopped by {signal}"),
    }
}

//! The puller-svc binary: parse flags, open the backend, serve until SIGINT/SIGTERM, with
//! periodic cursor checkpoints and a final one at shutdown.

use std::io::Write;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use clap::Parser;
use puller_svc::alignment::WatermarkSource;
use puller_svc::config::{Args, Backend};
use puller_svc::server::{spawn_checkpoints, start};
use puller_svc::service::PullerGrpc;
use puller_svc::storage::Storage;
use puller_svc::storage::kafka::KafkaStorage;
use puller_svc::storage::local::LocalStorage;
use puller_svc::storage::rocketmq4::RocketMq4Storage;
use puller_svc::storage::rocketmq5::RocketMq5Storage;

#[global_allocator]
static ALLOCATOR: eventmesh_common::alloc::Allocator = eventmesh_common::alloc::ALLOCATOR;

fn main() -> anyhow::Result<()> {
    let Some(config) = eventmesh_common::config::resolve_or_check("puller-svc", Args::parse())?
    else {
        return Ok(()); // --check-config: the report is printed
    };
    eventmesh_common::runtime::build_with_blocking(
        "puller-svc",
        config.worker_threads,
        config.effective_blocking_threads(),
    )
    .context("starting the async runtime")?
    .block_on(serve(config))
}

async fn serve(config: puller_svc::config::Config) -> anyhow::Result<()> {
    let _telemetry = eventmesh_common::telemetry::init("puller-svc", config.log_format)?;
    eventmesh_common::runtime::log_workers();
    eventmesh_common::metrics::install(config.metrics_listen)?;
    let shutdown =
        eventmesh_common::shutdown::on_signals().context("installing signal handlers")?;
    let storage: Arc<dyn Storage> = match config.backend {
        Backend::Local => {
            let (dir, settings, dead_letters, start_at) = (
                config.data_dir.clone(),
                config.log_settings(),
                config.dead_letter_retention_ms(),
                config.start.into(),
            );
            // Recovery scans every segment: keep it off the async workers.
            Arc::new(
                tokio::task::spawn_blocking(move || {
                    LocalStorage::open_with(dir, settings, dead_letters, start_at)
                })
                .await??,
            )
        }
        Backend::Kafka => Arc::new(
            KafkaStorage::with_tuning(
                &config.kafka_bootstrap,
                config.data_dir.clone(),
                config.start.into(),
                config.kafka_tuning(),
            )?
            .with_dead_letter_retention(config.dead_letter_retention_ms()),
        ),
        Backend::Rocketmq4 => Arc::new(
            RocketMq4Storage::new(
                config.rocketmq_settings(),
                config.data_dir.clone(),
                config.start.into(),
            )
            .await?,
        ),
        Backend::Rocketmq5 => Arc::new(
            RocketMq5Storage::new(
                config.rocketmq_settings(),
                config.pop_settings(),
                config.data_dir.clone(),
                config.start.into(),
            )
            .await?,
        ),
    };
    // Lazy: the puller starts even while offset-svc is down; readers then wait for it.
    let offset_svc = eventmesh_common::grpc::internal_channel(
        &config.offset_svc,
        Duration::from_millis(config.dependency_timeout_ms),
    )
    .with_context(|| format!("invalid offset_svc endpoint {:?}", config.offset_svc))?;
    let grpc = PullerGrpc::new(Arc::clone(&storage), WatermarkSource::new(offset_svc))
        .with_default_partitions(config.default_partitions)
        .with_auto_create_topics(config.auto_create())
        .with_reader_idle(Duration::from_secs(config.reader_idle_secs));
    let server = start(
        config.listen,
        Arc::clone(&storage),
        grpc,
        shutdown.clone(),
        Duration::from_secs(config.shutdown_timeout_secs),
    )
    .await?;
    let checkpoints = spawn_checkpoints(
        storage,
        Duration::from_millis(config.checkpoint_interval_ms),
        shutdown,
    );
    // The one line on stdout: scripts and tests read the bound address from it.
    let mut stdout = std::io::stdout().lock();
    writeln!(stdout, "puller-svc listening on {}", server.local_addr())?;
    stdout.flush()?;
    drop(stdout);
    server.wait().await?;
    checkpoints.await?;
    Ok(())
}

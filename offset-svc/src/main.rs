//! The offset-svc binary: parse flags, start telemetry, serve until SIGINT/SIGTERM.

use std::io::Write;

use anyhow::Context;
use clap::Parser;
use offset_svc::config::Args;

#[global_allocator]
static ALLOCATOR: eventmesh_common::alloc::Allocator = eventmesh_common::alloc::ALLOCATOR;

fn main() -> anyhow::Result<()> {
    let Some(config) = eventmesh_common::config::resolve_or_check("offset-svc", Args::parse())?
    else {
        return Ok(()); // --check-config: the report is printed
    };
    eventmesh_common::runtime::build("offset-svc", config.worker_threads)
        .context("starting the async runtime")?
        .block_on(serve(config))
}

async fn serve(config: offset_svc::config::Config) -> anyhow::Result<()> {
    let _telemetry = eventmesh_common::telemetry::init("offset-svc", config.log_format)?;
    eventmesh_common::runtime::log_workers();
    eventmesh_common::metrics::install(config.metrics_listen)?;
    let shutdown =
        eventmesh_common::shutdown::on_signals().context("installing signal handlers")?;
    let server = offset_svc::server::start(config, shutdown).await?;
    // The one line on stdout: scripts and tests read the bound address from it.
    let mut stdout = std::io::stdout().lock();
    writeln!(stdout, "offset-svc listening on {}", server.local_addr())?;
    stdout.flush()?;
    drop(stdout);
    server.wait().await?;
    Ok(())
}

//! `emctl up`: a local instance on the well-known loopback ports until Ctrl-C.

use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context;
use clap::Args;
use eventmesh_client::local::{LocalConfig, LocalInstance, Service};

#[derive(Debug, Args)]
pub struct UpArgs {
    /// Where the services keep offsets, cursors, the local log and their logs.
    #[arg(long, default_value = "data")]
    data_dir: PathBuf,
    /// Directory holding offset-svc, puller-svc and dispatcher-svc (default: next to emctl).
    #[arg(long, env = "EM_BIN_DIR")]
    bin_dir: Option<PathBuf>,
    /// Pick free ports instead of 50051 (dispatcher), 50052 (puller), 50053 (offset-svc).
    #[arg(long)]
    any_ports: bool,
}

pub async fn run(args: UpArgs) -> anyhow::Result<()> {
    let mut config = LocalConfig::new(&args.data_dir);
    if !args.any_ports {
        config = config.well_known_ports();
    }
    config.bin_dir = args.bin_dir;
    let instance = LocalInstance::start(config)
        .await
        .context("starting the local instance")?;
    for service in Service::ALL {
        println!(
            "{service:<15} {}  (pid {}, log {})",
            instance.uri(service),
            instance.pid(service).unwrap_or_default(),
            instance.log_file(service).display()
        );
    }
    println!(
        "serving; data in {}. Ctrl-C (or SIGTERM) stops all three cleanly.",
        args.data_dir.display()
    );
    let signal = crate::terminated().await;
    println!("{signal}: stopping (dispatcher first, so ACKs are flushed)…");
    instance.stop(Duration::from_secs(15)).await;
    println!("stopped");
    Ok(())
}

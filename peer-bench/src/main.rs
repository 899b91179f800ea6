//! `jetstream-bench`: one round of the `emctl bench` workload against NATS JetStream (method in
//! the library's docs); prints one line, JSON with `--json`.

use clap::Parser;
use eventmesh_peer_bench::{Cli, run};

/// mimalloc, as `emctl bench` (the other side's client) uses.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    let report = run(&cli).await?;
    if cli.json {
        println!("{}", serde_json::to_string(&report)?);
    } else {
        println!("{}", report.human_line());
    }
    Ok(())
}

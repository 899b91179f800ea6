//! `jetstream-bench`: one round of the `emctl bench` workload against NATS JetStream (method in
//! the library's docs); prints one line, JSON with `--json`.

use clap::Parser;
use eventmesh_peer_bench::{Cli, run, run_idle};

/// mimalloc, as `emctl bench` (the other side's client) uses.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// Transparent huge pages off for this process, as `emctl bench` and every EventMesh service
/// run (`prctl(PR_SET_THP_DISABLE)`), so both sides' clients pay the same page faults.
#[allow(unsafe_code)]
fn turn_huge_pages_off() {
    // SAFETY: integer arguments only; it sets a flag of this process.
    let _ = unsafe { libc::prctl(libc::PR_SET_THP_DISABLE, 1, 0, 0, 0) };
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    turn_huge_pages_off();
    let cli = Cli::parse();
    if cli.idle_only {
        let report = run_idle(&cli).await?;
        if cli.json {
            println!("{}", serde_json::to_string(&report)?);
        } else {
            println!("{}", report.human_line());
        }
        return Ok(());
    }
    let report = run(&cli).await?;
    if cli.json {
        println!("{}", serde_json::to_string(&report)?);
    } else {
        println!("{}", report.human_line());
    }
    Ok(())
}

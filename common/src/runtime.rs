//! The services' async runtime: tokio's multi-threaded scheduler with as many worker threads
//! as the configuration says.
//!
//! Every service has the setting `worker_threads`. `0`, the default, leaves the choice to
//! tokio: `TOKIO_WORKER_THREADS` when set, else one worker per core the process may use
//! (`std::thread::available_parallelism`, which honours CPU affinity and a cgroup's CPU quota).
//! A positive number is used as it is.
//!
//! Why it is a setting: the three services run side by side on every node, so by default each
//! starts a worker per core and three schedulers compete for the same cores, and a session's
//! work and its group's are handed between workers on different cores. On a small node fewer
//! workers per service are faster (docs/CONFIG.md, "Worker threads").
//!
//! Building the runtime also turns transparent huge pages off for the process
//! ([`crate::alloc::disable_huge_pages`]); the start-up line says whether that took
//! (`huge_pages_off`), since a kernel without THP support refuses the call and nothing is lost.

use std::io;

/// Builds the runtime a service's `main` runs on, its threads named after the service, with
/// huge pages off (module doc). `worker_threads == 0` is tokio's default.
pub fn build(service: &str, worker_threads: usize) -> io::Result<tokio::runtime::Runtime> {
    build_with_blocking(service, worker_threads, 0)
}

/// [`build`], with at most `blocking_threads` threads in the blocking pool (`spawn_blocking`;
/// 0: tokio's default, 512). A small pool keeps short blocking work on the same few threads
/// instead of waking a different idle one each time (puller-svc's `blocking_threads`).
pub fn build_with_blocking(
    service: &str,
    worker_threads: usize,
    blocking_threads: usize,
) -> io::Result<tokio::runtime::Runtime> {
    // A refusal only leaves the kernel's default; `log_workers` reports the outcome.
    let _ = crate::alloc::disable_huge_pages();
    let mut builder = tokio::runtime::Builder::new_multi_thread();
    if worker_threads > 0 {
        builder.worker_threads(worker_threads);
    }
    if blocking_threads > 0 {
        builder.max_blocking_threads(blocking_threads);
    }
    builder.enable_all().thread_name(service).build()
}

/// Logs the current runtime's worker threads and whether huge pages are off (one line at
/// start-up, `workers=N huge_pages_off=true`), so an operator sees what the settings resolved to.
pub fn log_workers() {
    if let Ok(runtime) = tokio::runtime::Handle::try_current() {
        tracing::info!(
            workers = runtime.metrics().num_workers(),
            huge_pages_off = crate::alloc::huge_pages_disabled(),
            "async runtime started"
        );
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    /// The number of threads of the given name running in this process.
    fn threads_named(name: &str) -> usize {
        std::fs::read_dir("/proc/self/task")
            .unwrap()
            .filter_map(|task| std::fs::read_to_string(task.ok()?.path().join("comm")).ok())
            .filter(|comm| comm.trim_end() == name)
            .count()
    }

    #[test]
    fn a_configured_count_of_workers_is_started() {
        let runtime = build("em-rt-test-3", 3).unwrap();
        assert_eq!(runtime.metrics().num_workers(), 3);
        // The workers are spawned with the runtime; each names itself once it runs, which may
        // be a moment later.
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while threads_named("em-rt-test-3") < 3 && std::time::Instant::now() < deadline {
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
        assert_eq!(threads_named("em-rt-test-3"), 3);
    }

    #[test]
    fn the_blocking_pool_runs_at_most_its_threads_at_once() {
        use std::sync::Arc;
        use std::sync::atomic::{AtomicUsize, Ordering};
        let runtime = build_with_blocking("em-rt-test-b", 1, 2).unwrap();
        let running = Arc::new(AtomicUsize::new(0));
        let most = Arc::new(AtomicUsize::new(0));
        runtime.block_on(async {
            let tasks: Vec<_> = (0..6)
                .map(|_| {
                    let (running, most) = (Arc::clone(&running), Arc::clone(&most));
                    tokio::task::spawn_blocking(move || {
                        let now = running.fetch_add(1, Ordering::SeqCst) + 1;
                        most.fetch_max(now, Ordering::SeqCst);
                        std::thread::sleep(std::time::Duration::from_millis(30));
                        running.fetch_sub(1, Ordering::SeqCst);
                    })
                })
                .collect();
            for task in tasks {
                task.await.unwrap();
            }
        });
        // Six tasks of 30 ms each: with tokio's default pool they would all run at once.
        let most = most.load(Ordering::SeqCst);
        assert!((1..=2).contains(&most), "{most} at once");
    }

    #[test]
    fn zero_is_tokios_default() {
        let runtime = build("em-rt-test-0", 0).unwrap();
        let expected = match std::env::var("TOKIO_WORKER_THREADS") {
            Ok(value) => value.parse().unwrap(),
            Err(_) => std::thread::available_parallelism().unwrap().get(),
        };
        assert_eq!(runtime.metrics().num_workers(), expected);
    }
}

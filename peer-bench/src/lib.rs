//! The NATS JetStream side of the side-by-side benchmark: the workload of `emctl bench`
//! (docs/BENCHMARKS.md, "End to end") run against a JetStream server, so the two can be put in
//! one table. The server is started by `scripts/nats.sh` (Debian's nats-server 2.9, JetStream on,
//! loopback only); `jetstream-bench` is its client. One invocation runs one round of one
//! configuration (event size × consumer streams) and prints one line (JSON with `--json`).
//!
//! # Method
//!
//! 1. **Stream.** A fresh stream per invocation (unique name, subject `bench.<name>`), **file
//!    storage**, limits retention, one replica. JetStream's file store does **not** fsync every
//!    write: by default (2.9) it syncs every 2 minutes, and a publish or ACK is answered once
//!    the write is in the OS page cache. That default is kept (nothing here changes
//!    `sync_interval`), and the human output says so. Our own ACK → DURABLE is a RocksDB write
//!    with its write-ahead log (no fsync either unless `sync_writes`), so both sides answer
//!    "written, not fsynced".
//! 2. **Publish.** N events of `size` bytes (one shared payload buffer: memory stays bounded)
//!    with JetStream async publish; up to [`workload::PUBLISH_WINDOW`] publish-ACK futures are
//!    outstanding and awaited in publish order; every ACK must succeed. `publish_per_sec` =
//!    N / time from the first publish to the last ACK.
//! 3. **Full load.** One durable pull consumer (explicit ACK, deliver all, `max_ack_pending` =
//!    max(65,536, streams × 1,024)); `streams` tasks, each with its own connection and its own
//!    pull message stream on that one consumer (the shared group), ACK every message as it
//!    arrives, one explicit ACK per message. The clock starts when the tasks start pulling and
//!    stops when, after all N were received, consumer info (polled every 5 ms) reports
//!    `num_ack_pending == 0` and `num_pending == 0`: every ACK processed by the server.
//!    `e2e_per_sec` = N / that time. Waiting for the server's confirmation of every ACK
//!    (`double_ack`) would slow the round down, so the full-load latency is a **sample**: every
//!    [`workload::SAMPLE_EVERY`]th first delivery is ACKed with `double_ack()` (sent without
//!    blocking the task's consumption) and its round trip — ACK sent → server confirmation — is
//!    recorded; the others use a plain `ack()`. CPU = (utime + stime) over this phase / wall
//!    time, from `/proc/<pid>/stat`, for the server (`--server-pid`) and for this process.
//! 4. **Live load** (unless `--no-half-load`). A fresh stream and consumer; the consumer tasks
//!    start first, then N/2 events are published as fast as the server answers them while the
//!    tasks consume, ACKing as at full load (every 64th with a timed `double_ack`).
//!    `live_per_sec` = N/2 / time from the first publish to consumer info reporting nothing
//!    pending: the most the machine does when publishing and consuming share it.
//! 5. **Half load** (unless `--no-half-load`). A fresh stream and consumer; the consumer tasks
//!    start first, then N/2 events are published at 50 % of the measured `live_per_sec` (of
//!    `e2e_per_sec` with `--half-load-of full`, the method before 2026-12-07: as publishing
//!    then shares the machine, half of the full load's rate is close to the live maximum, not
//!    half of it), paced against the clock, publish ACKs awaited in order by a separate task.
//!    **Every** message is ACKed with `double_ack()` and its ACK latency (sent → server
//!    confirmation) recorded. `half_rate_per_sec` = N/2 / time from the first publish to the
//!    last confirmed ACK.
//!
//! With `--idle-only` it runs the idle first-event probe instead ([`idle`]): single events
//! after quiet spells, timed publish → delivery, the shape of `emctl bench --idle-only`.
//!
//! Percentiles are nearest-rank over the sorted samples. Every wait has a timeout that ends
//! the run with an error naming what did not arrive. The streams are deleted at the end.

pub mod cli;
pub mod idle;
pub mod procstat;
pub mod report;
pub mod stats;
pub mod workload;

pub use cli::Cli;
pub use idle::{IdleReport, run_idle};
pub use report::Report;
pub use workload::run;

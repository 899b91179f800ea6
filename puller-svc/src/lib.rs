//! puller-svc — the MQ reader.
//!
//! It owns, per subscription group, the MQ pull cursors (`topic#partition`, lite
//! `parent#lite@queue`, each the NEXT offset to read) for every backend (`local`, `kafka`,
//! `rocketmq4`, and `rocketmq5` to come), checkpoints them atomically every 5 s, rewinds them
//! at boot and on dispatcher attach to the group's gap-free watermark + 1 read from
//! offset-svc, and serves the `eventmesh.puller.v1.PullerService` contract defined in the
//! proto crate.
//!
//! * [`properties`] — a `java.util.Properties`-compatible text codec.
//! * [`checkpoint`] — the versioned, atomically replaced cursor files, with unusable files set
//!   aside instead of crashing or being half-used.
//! * [`cursors`] — one group's cursors and the rules that move them: alignment to the ACK
//!   watermark, start positions, retention and recreated topics.
//! * [`ingest`] — any MQ body (our frame, CloudEvents JSON, opaque, broken) to a stamped frame
//!   or a dead-letter candidate.
//! * [`local_log`] — the embedded backend's storage: partition logs (segments, CRC, torn-tail
//!   recovery, retention) and topics with key partitioning and lite channels.
//! * [`storage`] — the `Storage` contract and its backends: `local`, `kafka`, `rocketmq4`.
//! * [`alignment`] — reading a group's watermarks from offset-svc and aligning a reader.
//! * [`service`], [`server`] — the gRPC `PullerService` (alignment before the first poll and on
//!   every attach, long-poll `Pull`, credit-driven `PullStream`) and its server.
//! * [`config`] and the `puller-svc` binary (periodic checkpoints every 5 s by default).

// The RocketMQ client's futures nest deeply enough that proving them `Send` needs more than
// the default 128 levels.
#![recursion_limit = "256"]

pub mod alignment;
pub mod checkpoint;
pub mod config;
pub mod crash;
pub mod cursors;
pub mod ingest;
pub mod local_log;
pub mod properties;
pub mod server;
pub mod service;
pub mod storage;

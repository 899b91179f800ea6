//! puller-svc — the MQ reader. **Partly built**: the pull-cursor checkpoint files exist; the
//! rest belongs to the issue "puller-svc: pull cursors, 5 s atomic checkpoints, boot
//! alignment, the embedded local log and the Kafka backend".
//!
//! It will own, per subscription group, the MQ pull cursors (`topic#partition`, lite
//! `parent#lite@queue`, each the NEXT offset to read) for every backend (`local`, `kafka`,
//! `rocketmq5`, `rocketmq4`), checkpoint them atomically every 5 s, rewind them at boot and on
//! dispatcher attach to the group's gap-free watermark + 1 read from offset-svc, and serve the
//! `eventmesh.puller.v1.PullerService` contract defined in the proto crate.
//!
//! Built so far:
//! * [`properties`] — a `java.util.Properties`-compatible text codec.
//! * [`checkpoint`] — the versioned, atomically replaced cursor files, with unusable files set
//!   aside instead of crashing or being half-used.
//! * [`cursors`] — one group's cursors and the rules that move them: alignment to the ACK
//!   watermark, start positions, retention and recreated topics.
//! * [`ingest`] — any MQ body (our frame, CloudEvents JSON, opaque, broken) to a stamped frame
//!   or a dead-letter candidate.
//! * [`local_log`] — the embedded backend's storage: partition logs (segments, CRC, torn-tail
//!   recovery, retention) and topics with key partitioning and lite channels.
//! * [`storage`] — the `Storage` contract and the `local` backend behind it.
//! * [`alignment`] — reading a group's watermarks from offset-svc and aligning a reader.
//! * [`service`], [`server`] — the gRPC `PullerService` (alignment before the first poll and on
//!   every attach, long-poll `Pull`, credit-driven `PullStream`) and its server.
//!
//! * [`config`] and the `puller-svc` binary (periodic checkpoints every 5 s by default).
//!
//! Not built yet: the Kafka and RocketMQ backends.

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

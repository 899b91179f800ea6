//! dispatcher-svc: subscriptions, reliable push delivery over gRPC streaming, the ACK chain
//! and the gap-free watermark (DESIGN §3, §4, §6, §7, §9, §10).
//!
//! * [`service`] — the client-facing `eventmesh.v1.EventMeshService` (Recommend, Publish,
//!   Subscribe sessions).
//! * [`admin`] — the operator's `eventmesh.v1.AdminService` (offset resets that no live group
//!   writes over).
//! * [`cluster`] — several instances through etcd: membership with measured load, one home
//!   per group, the progress mirror, fencing, Recommend.
//! * [`registry`] — the instance's subscription groups: creation (start positions, reader
//!   attach), lookup, and stopping a group to change its offsets.
//! * [`pulling`] — each group's pull loop and the continuity rule (only the log declares a
//!   skip; a stale or second dispatcher is fenced off).
//! * [`group`] — one group's actor: the reliable dispatcher (in-flight limits, ACK timeout,
//!   NACK backoff, attempts, dead-lettering, reassignment, grace period).
//! * [`watermark`] — the gap-free watermarks, the only values written to offset-svc.
//! * [`offset_writer`] and [`broker_ack`] — steps 1 and 3 of the ACK chain, coalesced.
//! * [`budget`] — the per-topic buffer bound (back-pressure to the MQ).
//! * [`dead_letters`] — `<topic>_DLQ` writes.
//! * [`responses`] and [`wire`] — a session's response stream, its deliveries written straight
//!   from their frames.
//! * [`crash`] — named crash points for crash tests.
//! * [`config`], [`server`], [`error`] — settings, startup/shutdown, errors → status.
//!
//! The ACK chain is ordered: an ACK's offset write is durable before the delivery is retired,
//! and retired before its broker ACK is forwarded.

pub mod admin;
pub mod batching;
pub mod broker_ack;
pub mod budget;
pub mod cluster;
pub mod config;
pub mod crash;
pub mod dead_letters;
pub mod delivery_id;
pub mod error;
pub mod event;
pub mod group;
pub mod lag;
pub mod limits;
pub mod offset_writer;
pub mod published;
pub mod pulling;
pub mod registry;
pub mod responses;
pub mod server;
pub mod service;
pub mod shard;
pub mod watermark;
pub mod wire;

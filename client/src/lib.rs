//! eventmesh-client — not built yet (issue "The Rust SDK, emctl and the one-command demo").
//!
//! It will hold the Rust SDK (recommend → connect → subscribe / ack / nack / extend / publish,
//! reconnect and failover) and the `emctl` CLI, depending only on the proto crate: no RocksDB,
//! rdkafka or etcd in a user's build.

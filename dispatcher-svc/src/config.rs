//! dispatcher-svc configuration: built-in defaults < TOML file (`--config`) < environment
//! (`EM_DISPATCHER_*`) < flags. Every setting is listed in `docs/CONFIG.md`.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use clap::Parser;
use eventmesh_common::config::{
    ConfigError, ServiceArgs, apply, check_endpoint, check_worker_threads, load_file,
};
use eventmesh_common::telemetry::LogFormat;
use serde::{Deserialize, Serialize};

/// The effective configuration.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct Config {
    /// Client-facing gRPC listen address; port 0 picks a free port (printed on stdout).
    pub listen: SocketAddr,
    /// The address clients are told to use (Recommend); empty: the bound listen address.
    pub advertise: String,
    /// This instance's id; empty: generated at start.
    pub instance_id: String,
    /// Prometheus `/metrics` listen address.
    pub metrics_listen: SocketAddr,
    /// puller-svc endpoint.
    pub puller: String,
    /// offset-svc endpoint.
    pub offset_svc: String,
    /// Log line format.
    pub log_format: LogFormat,
    /// Longest a graceful shutdown waits for open streams, seconds.
    pub shutdown_timeout_secs: u64,
    /// Async worker threads; 0: one per core the process may use (docs/CONFIG.md).
    pub worker_threads: usize,
    /// Deadline of every call to puller-svc and offset-svc, milliseconds (a frozen neighbour
    /// also fails calls through HTTP/2 keepalive within about 3 s).
    pub dependency_timeout_ms: u64,
    /// How often the consumer-lag gauges are measured (one EndOffsets per topic with live
    /// groups, see `lag.rs`), milliseconds; 0: no lag gauges.
    pub lag_interval_ms: u64,
    /// Delivery behaviour (the `[delivery]` table of the file).
    pub delivery: DeliverySettings,
    /// Several instances coordinated through etcd (the `[cluster]` table of the file).
    pub cluster: ClusterSettings,
}

/// Membership, homes and Recommend through etcd. Without endpoints the instance is alone and
/// behaves exactly as a single node (Recommend answers with itself, every group is local).
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct ClusterSettings {
    /// etcd client URLs (`http://host:port`); empty: no cluster.
    pub etcd_endpoints: Vec<String>,
    /// The prefix of every key this cluster writes; must start with `/`.
    pub etcd_prefix: String,
    /// The instance lease's TTL, seconds: how long a dead instance keeps its groups.
    pub lease_ttl_secs: u64,
    /// How often the lease is renewed and the instance's load rewritten, seconds.
    pub keepalive_secs: u64,
    /// How often a group's progress is mirrored to etcd, ms.
    pub mirror_interval_ms: u64,
    /// Mirror each group's progress to etcd, so a group that moves resumes where it was
    /// (false: only its start is recorded, and a moved group replays from EARLIEST).
    pub mirror_progress: bool,
}

impl Default for ClusterSettings {
    fn default() -> Self {
        ClusterSettings {
            etcd_endpoints: Vec::new(),
            etcd_prefix: "/em".into(),
            lease_ttl_secs: 15,
            keepalive_secs: 5,
            mirror_interval_ms: 1_000,
            mirror_progress: true,
        }
    }
}

impl ClusterSettings {
    /// Whether an etcd cluster is configured.
    pub fn enabled(&self) -> bool {
        !self.etcd_endpoints.is_empty()
    }

    /// The lease TTL.
    pub fn lease_ttl(&self) -> Duration {
        Duration::from_secs(self.lease_ttl_secs)
    }

    /// The keep-alive interval.
    pub fn keepalive(&self) -> Duration {
        Duration::from_secs(self.keepalive_secs)
    }

    fn validate(&self) -> Result<(), ConfigError> {
        let invalid = |key, message: &str| {
            Err(ConfigError::Invalid {
                key,
                message: message.into(),
            })
        };
        if !self.etcd_prefix.starts_with('/') {
            return invalid("etcd_prefix", "must start with /");
        }
        if self.etcd_prefix.len() > 1 && self.etcd_prefix.ends_with('/') {
            return invalid("etcd_prefix", "must not end with /");
        }
        if self.keepalive_secs == 0 {
            return invalid("keepalive_secs", "must be at least 1");
        }
        if self.lease_ttl_secs <= self.keepalive_secs {
            return invalid(
                "lease_ttl_secs",
                "must exceed keepalive_secs (the lease would expire between renewals)",
            );
        }
        if self.mirror_interval_ms == 0 {
            return invalid("mirror_interval_ms", "must be at least 1");
        }
        if let Some(bad) = self
            .etcd_endpoints
            .iter()
            .find(|e| !(e.starts_with("http://") || e.starts_with("https://")))
        {
            return invalid(
                "etcd_endpoints",
                &format!("{bad:?} is not an http:// or https:// URL"),
            );
        }
        Ok(())
    }
}

/// How deliveries are tracked, retried, bounded and settled.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct DeliverySettings {
    /// Time a client has to ACK a delivery, from when it was written to its stream, ms.
    pub ack_timeout_ms: u64,
    /// Delivery attempts before dead-lettering (the first included).
    pub max_attempts: u32,
    /// First NACK / timeout backoff, ms; doubles per attempt.
    pub backoff_base_ms: u64,
    /// Largest backoff, ms.
    pub backoff_max_ms: u64,
    /// Random spread of each backoff, percent either way.
    pub backoff_jitter_percent: u32,
    /// In-flight limit of a session that asks for none.
    pub default_max_in_flight: u32,
    /// Highest in-flight limit a session may ask for.
    pub max_in_flight_limit: u32,
    /// Pulled records one topic may hold in memory (all its groups together).
    pub topic_buffer_records: u32,
    /// Pulled bytes one topic may hold in memory, KiB.
    pub topic_buffer_kib: u32,
    /// How long a group without sessions keeps its deliveries before dead-lettering them, ms.
    pub group_grace_ms: u64,
    /// Extra wait before an offset write to gather more ACKs, ms; 0 writes as soon as the
    /// previous write returned (one write in flight, whatever arrived meanwhile goes together).
    pub ack_flush_ms: u64,
    /// Records asked for per pull.
    pub pull_batch: u32,
    /// Actors one subscription group's partitions are spread over (`crate::shard`); 0: one
    /// per core the process may use beyond the first (at least one): the first is left to the
    /// sessions' streams, the ACK intake and the writers. Never more than the topic's
    /// partitions or 64.
    pub group_shards: u32,
    /// fsync offset writes (node-loss durability).
    pub sync_offsets: bool,
    /// Longest NACK delay a client may ask for, ms (longer ones are capped, and said so).
    pub max_nack_delay_ms: u64,
    /// Longest ACK-deadline extension one Extend may ask for, ms (capped likewise).
    pub max_extend_ms: u64,
    /// A session whose stream took none of its deliveries for this long is stalled: they go
    /// to the group's other sessions, ms.
    pub assign_timeout_ms: u64,
    /// Graceful stop (SIGTERM): how long sessions keep taking ACKs of what was sent to them
    /// while nothing new is delivered, before they are told to move, ms. A session whose
    /// deliveries are all ACKed and durable moves at once; must be below the shutdown timeout.
    pub drain_ms: u64,
    /// Most open Subscribe sessions one client id may have on this instance; more are refused
    /// with RESOURCE_EXHAUSTED.
    pub max_sessions_per_client: u32,
    /// Most open Subscribe streams on one client connection (HTTP/2 multiplexes them); more
    /// are refused with RESOURCE_EXHAUSTED.
    pub max_streams_per_connection: u32,
    /// Most Publish / PublishBatch calls in progress at once; more are shed at once with
    /// RESOURCE_EXHAUSTED and `grpc-retry-pushback-ms` (the SDK backs off and retries).
    pub max_publishes_in_progress: u32,
    /// Longest a call on the client port may take before its answer starts — a unary call's
    /// whole handling, a Subscribe until its `open` is read — before it is answered
    /// DEADLINE_EXCEEDED (`eventmesh_common::call_limit`), milliseconds.
    pub call_limit_ms: u64,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            listen: SocketAddr::from(([127, 0, 0, 1], 50051)),
            advertise: String::new(),
            instance_id: String::new(),
            metrics_listen: SocketAddr::from(([127, 0, 0, 1], 9151)),
            puller: "http://127.0.0.1:50052".into(),
            offset_svc: "http://127.0.0.1:50053".into(),
            log_format: LogFormat::Text,
            shutdown_timeout_secs: 10,
            worker_threads: 0,
            dependency_timeout_ms: 5_000,
            lag_interval_ms: 5_000,
            delivery: DeliverySettings::default(),
            cluster: ClusterSettings::default(),
        }
    }
}

impl Default for DeliverySettings {
    fn default() -> Self {
        DeliverySettings {
            ack_timeout_ms: 30_000,
            max_attempts: 6,
            backoff_base_ms: 1_000,
            backoff_max_ms: 16_000,
            backoff_jitter_percent: 20,
            default_max_in_flight: 256,
            max_in_flight_limit: 10_000,
            topic_buffer_records: 65_536,
            topic_buffer_kib: 64 * 1024,
            group_grace_ms: 60_000,
            ack_flush_ms: 0,
            pull_batch: 512,
            group_shards: 0,
            sync_offsets: false,
            max_nack_delay_ms: 600_000,
            max_extend_ms: 600_000,
            assign_timeout_ms: 30_000,
            drain_ms: 5_000,
            max_sessions_per_client: 256,
            max_streams_per_connection: 1_024,
            max_publishes_in_progress: 4_096,
            call_limit_ms: 30_000,
        }
    }
}

impl DeliverySettings {
    /// The graceful-stop drain window.
    pub fn drain(&self) -> Duration {
        Duration::from_millis(self.drain_ms)
    }

    /// The ACK timeout.
    pub fn ack_timeout(&self) -> Duration {
        Duration::from_millis(self.ack_timeout_ms)
    }

    /// The backoff before attempt `next_attempt` (2 = the first redelivery): base × 2^(n-2),
    /// capped, spread by the jitter.
    pub fn backoff(&self, next_attempt: u32) -> Duration {
        let doublings = next_attempt.saturating_sub(2).min(20);
        let nominal = self
            .backoff_base_ms
            .saturating_mul(1 << doublings)
            .min(self.backoff_max_ms);
        let jitter = f64::from(self.backoff_jitter_percent.min(100)) / 100.0;
        let factor = 1.0 + jitter * (rand::random::<f64>() * 2.0 - 1.0);
        Duration::from_millis((nominal as f64 * factor) as u64)
    }

    /// A client's NACK / Extend within the caps; the detail says when it was capped.
    pub fn cap(&self, op: crate::group::SettleOp) -> (crate::group::SettleOp, String) {
        use crate::group::SettleOp;
        let limit = |asked: Duration, max_ms: u64, what: &str| {
            let max = Duration::from_millis(max_ms);
            if asked > max {
                (
                    max,
                    format!("{what} of {} ms capped to {max_ms} ms", asked.as_millis()),
                )
            } else {
                (asked, String::new())
            }
        };
        match op {
            SettleOp::Nack(Some(delay)) => {
                let (delay, detail) = limit(delay, self.max_nack_delay_ms, "NACK delay");
                (SettleOp::Nack(Some(delay)), detail)
            }
            SettleOp::Extend(extra) => {
                let (extra, detail) = limit(extra, self.max_extend_ms, "extension");
                (SettleOp::Extend(extra), detail)
            }
            other => (other, String::new()),
        }
    }

    /// How many shards a group of a topic with `partitions` partitions gets.
    pub fn shards_for(&self, partitions: usize) -> usize {
        let wanted = match self.group_shards {
            // Measured on 2 cores (docs/BENCHMARKS.md): two shards there gained throughput
            // with one stream only and raised half-load ACK latency, the actors crowding out
            // the rest of the dispatcher's work.
            0 => async_workers().saturating_sub(1),
            n => n as usize,
        };
        wanted
            .min(partitions)
            .min(crate::shard::MAX_SHARDS as usize)
            .max(1)
    }

    fn validate(&self) -> Result<(), ConfigError> {
        let positive = [
            ("ack_timeout_ms", self.ack_timeout_ms),
            ("max_attempts", u64::from(self.max_attempts)),
            (
                "default_max_in_flight",
                u64::from(self.default_max_in_flight),
            ),
            ("max_in_flight_limit", u64::from(self.max_in_flight_limit)),
            ("topic_buffer_records", u64::from(self.topic_buffer_records)),
            ("topic_buffer_kib", u64::from(self.topic_buffer_kib)),
            ("pull_batch", u64::from(self.pull_batch)),
            ("assign_timeout_ms", self.assign_timeout_ms),
        ];
        for (key, value) in positive {
            if value == 0 {
                return Err(ConfigError::Invalid {
                    key,
                    message: "must be at least 1".into(),
                });
            }
        }
        if self.group_shards > crate::shard::MAX_SHARDS {
            return Err(ConfigError::Invalid {
                key: "group_shards",
                message: format!("must be at most {}", crate::shard::MAX_SHARDS),
            });
        }
        if self.backoff_max_ms < self.backoff_base_ms {
            return Err(ConfigError::Invalid {
                key: "backoff_max_ms",
                message: "must be at least backoff_base_ms".into(),
            });
        }
        Ok(())
    }
}

/// The worker threads of the runtime the caller runs on (`worker_threads`, or a worker per core
/// the process may use); outside a runtime, the cores.
fn async_workers() -> usize {
    tokio::runtime::Handle::try_current().map_or_else(
        |_| std::thread::available_parallelism().map_or(1, std::num::NonZeroUsize::get),
        |runtime| runtime.metrics().num_workers(),
    )
}

/// Command-line flags; each also reads an environment variable.
#[derive(Debug, Parser)]
#[command(
    name = "dispatcher-svc",
    version,
    about = "The EventMesh dispatcher: pushes events to subscribers over gRPC streaming and tracks every delivery until ACK."
)]
pub struct Args {
    /// TOML config file.
    #[arg(long, env = "EM_DISPATCHER_CONFIG")]
    pub config: Option<PathBuf>,
    /// Check FILE instead of starting: resolve it as `--config FILE` would (environment and
    /// flags applied), print the effective settings as TOML and exit; refused settings exit
    /// non-zero naming the key. Nothing is opened or contacted.
    #[arg(long, value_name = "FILE")]
    pub check_config: Option<PathBuf>,
    /// gRPC listen address [default: 127.0.0.1:50051].
    #[arg(long, env = "EM_DISPATCHER_LISTEN")]
    pub listen: Option<SocketAddr>,
    /// Address clients are told to use [default: the bound address].
    #[arg(long, env = "EM_DISPATCHER_ADVERTISE")]
    pub advertise: Option<String>,
    /// Instance id [default: generated].
    #[arg(long, env = "EM_DISPATCHER_INSTANCE_ID")]
    pub instance_id: Option<String>,
    /// Prometheus /metrics listen address [default: 127.0.0.1:9151].
    #[arg(long, env = "EM_DISPATCHER_METRICS_LISTEN")]
    pub metrics_listen: Option<SocketAddr>,
    /// puller-svc endpoint [default: http://127.0.0.1:50052].
    #[arg(long, env = "EM_DISPATCHER_PULLER")]
    pub puller: Option<String>,
    /// offset-svc endpoint [default: http://127.0.0.1:50053].
    #[arg(long, env = "EM_DISPATCHER_OFFSET_SVC")]
    pub offset_svc: Option<String>,
    /// ACK timeout, ms [default: 30000].
    #[arg(long, env = "EM_DISPATCHER_ACK_TIMEOUT_MS")]
    pub ack_timeout_ms: Option<u64>,
    /// Delivery attempts before dead-lettering [default: 6].
    #[arg(long, env = "EM_DISPATCHER_MAX_ATTEMPTS")]
    pub max_attempts: Option<u32>,
    /// First backoff, ms [default: 1000].
    #[arg(long, env = "EM_DISPATCHER_BACKOFF_BASE_MS")]
    pub backoff_base_ms: Option<u64>,
    /// Largest backoff, ms [default: 16000].
    #[arg(long, env = "EM_DISPATCHER_BACKOFF_MAX_MS")]
    pub backoff_max_ms: Option<u64>,
    /// Backoff jitter, percent [default: 20].
    #[arg(long, env = "EM_DISPATCHER_BACKOFF_JITTER_PERCENT")]
    pub backoff_jitter_percent: Option<u32>,
    /// Default in-flight limit per session [default: 256].
    #[arg(long, env = "EM_DISPATCHER_DEFAULT_MAX_IN_FLIGHT")]
    pub default_max_in_flight: Option<u32>,
    /// Highest in-flight limit per session [default: 10000].
    #[arg(long, env = "EM_DISPATCHER_MAX_IN_FLIGHT_LIMIT")]
    pub max_in_flight_limit: Option<u32>,
    /// Pulled records held per topic [default: 65536].
    #[arg(long, env = "EM_DISPATCHER_TOPIC_BUFFER_RECORDS")]
    pub topic_buffer_records: Option<u32>,
    /// Pulled KiB held per topic [default: 65536].
    #[arg(long, env = "EM_DISPATCHER_TOPIC_BUFFER_KIB")]
    pub topic_buffer_kib: Option<u32>,
    /// Grace period of a group without sessions, ms [default: 60000].
    #[arg(long, env = "EM_DISPATCHER_GROUP_GRACE_MS")]
    pub group_grace_ms: Option<u64>,
    /// Extra wait before an offset write to gather more ACKs, ms; 0 writes as soon as the
    /// previous write returned [default: 0].
    #[arg(long, env = "EM_DISPATCHER_ACK_FLUSH_MS")]
    pub ack_flush_ms: Option<u64>,
    /// Records per pull [default: 512].
    #[arg(long, env = "EM_DISPATCHER_PULL_BATCH")]
    pub pull_batch: Option<u32>,
    /// Actors a group's partitions are spread over; 0: one per core beyond the first
    /// [default: 0].
    #[arg(long, env = "EM_DISPATCHER_GROUP_SHARDS")]
    pub group_shards: Option<u32>,
    /// fsync offset writes.
    #[arg(long, env = "EM_DISPATCHER_SYNC_OFFSETS")]
    pub sync_offsets: Option<bool>,
    /// Longest NACK delay, ms [default: 600000].
    #[arg(long, env = "EM_DISPATCHER_MAX_NACK_DELAY_MS")]
    pub max_nack_delay_ms: Option<u64>,
    /// Longest single extension, ms [default: 600000].
    #[arg(long, env = "EM_DISPATCHER_MAX_EXTEND_MS")]
    pub max_extend_ms: Option<u64>,
    /// Assignment timeout of a session that does not read, ms [default: 30000].
    #[arg(long, env = "EM_DISPATCHER_ASSIGN_TIMEOUT_MS")]
    pub assign_timeout_ms: Option<u64>,
    /// Graceful-stop drain window, ms [default: 5000].
    #[arg(long, env = "EM_DISPATCHER_DRAIN_MS")]
    pub drain_ms: Option<u64>,
    /// Most open sessions per client id [default: 256].
    #[arg(long, env = "EM_DISPATCHER_MAX_SESSIONS_PER_CLIENT")]
    pub max_sessions_per_client: Option<u32>,
    /// Most open Subscribe streams per connection [default: 1024].
    #[arg(long, env = "EM_DISPATCHER_MAX_STREAMS_PER_CONNECTION")]
    pub max_streams_per_connection: Option<u32>,
    /// Most publish calls in progress before shedding [default: 4096].
    #[arg(long, env = "EM_DISPATCHER_MAX_PUBLISHES_IN_PROGRESS")]
    pub max_publishes_in_progress: Option<u32>,
    /// Longest time to an answer on the client port, ms [default: 30000].
    #[arg(long, env = "EM_DISPATCHER_CALL_LIMIT_MS")]
    pub call_limit_ms: Option<u64>,
    /// Log format [default: text].
    #[arg(long, env = "EM_DISPATCHER_LOG_FORMAT")]
    pub log_format: Option<LogFormat>,
    /// Graceful shutdown timeout, seconds [default: 10].
    #[arg(long, env = "EM_DISPATCHER_SHUTDOWN_TIMEOUT_SECS")]
    pub shutdown_timeout_secs: Option<u64>,
    /// Async worker threads; 0: one per core [default: 0].
    #[arg(long, env = "EM_DISPATCHER_WORKER_THREADS")]
    pub worker_threads: Option<usize>,
    /// Deadline of calls to puller-svc and offset-svc, ms [default: 5000].
    #[arg(long, env = "EM_DISPATCHER_DEPENDENCY_TIMEOUT_MS")]
    pub dependency_timeout_ms: Option<u64>,
    /// Consumer-lag gauge interval, ms; 0: none [default: 5000].
    #[arg(long, env = "EM_DISPATCHER_LAG_INTERVAL_MS")]
    pub lag_interval_ms: Option<u64>,
    /// etcd client URLs, comma-separated [default: none, a single instance].
    #[arg(long, env = "EM_DISPATCHER_ETCD_ENDPOINTS", value_delimiter = ',')]
    pub etcd_endpoints: Option<Vec<String>>,
    /// Prefix of the cluster's etcd keys [default: /em].
    #[arg(long, env = "EM_DISPATCHER_ETCD_PREFIX")]
    pub etcd_prefix: Option<String>,
    /// Instance lease TTL, seconds [default: 15].
    #[arg(long, env = "EM_DISPATCHER_LEASE_TTL_SECS")]
    pub lease_ttl_secs: Option<u64>,
    /// Lease renewal and load report interval, seconds [default: 5].
    #[arg(long, env = "EM_DISPATCHER_KEEPALIVE_SECS")]
    pub keepalive_secs: Option<u64>,
    /// Progress mirror interval, ms [default: 1000].
    #[arg(long, env = "EM_DISPATCHER_MIRROR_INTERVAL_MS")]
    pub mirror_interval_ms: Option<u64>,
    /// Mirror group progress to etcd (false: a moved group replays from EARLIEST) [default:
    /// true].
    #[arg(long, env = "EM_DISPATCHER_MIRROR_PROGRESS")]
    pub mirror_progress: Option<bool>,
}

impl ServiceArgs for Args {
    type Config = Config;

    fn check_config(&self) -> Option<&Path> {
        self.check_config.as_deref()
    }

    fn into_config(self) -> Result<Config, ConfigError> {
        let mut config: Config =
            load_file(self.check_config.as_deref().or(self.config.as_deref()))?;
        apply(&mut config.listen, self.listen);
        apply(&mut config.advertise, self.advertise);
        apply(&mut config.instance_id, self.instance_id);
        apply(&mut config.metrics_listen, self.metrics_listen);
        apply(&mut config.puller, self.puller);
        apply(&mut config.offset_svc, self.offset_svc);
        apply(&mut config.log_format, self.log_format);
        apply(
            &mut config.shutdown_timeout_secs,
            self.shutdown_timeout_secs,
        );
        apply(&mut config.worker_threads, self.worker_threads);
        check_worker_threads(config.worker_threads)?;
        apply(
            &mut config.dependency_timeout_ms,
            self.dependency_timeout_ms,
        );
        apply(&mut config.lag_interval_ms, self.lag_interval_ms);
        if config.dependency_timeout_ms <= u64::from(crate::pulling::PULL_WAIT_MS) {
            return Err(ConfigError::Invalid {
                key: "dependency_timeout_ms",
                message: format!(
                    "must exceed the pull wait of {} ms",
                    crate::pulling::PULL_WAIT_MS
                ),
            });
        }
        check_endpoint("puller", &config.puller)?;
        check_endpoint("offset_svc", &config.offset_svc)?;
        let d = &mut config.delivery;
        apply(&mut d.ack_timeout_ms, self.ack_timeout_ms);
        apply(&mut d.max_attempts, self.max_attempts);
        apply(&mut d.backoff_base_ms, self.backoff_base_ms);
        apply(&mut d.backoff_max_ms, self.backoff_max_ms);
        apply(&mut d.backoff_jitter_percent, self.backoff_jitter_percent);
        apply(&mut d.default_max_in_flight, self.default_max_in_flight);
        apply(&mut d.max_in_flight_limit, self.max_in_flight_limit);
        apply(&mut d.topic_buffer_records, self.topic_buffer_records);
        apply(&mut d.topic_buffer_kib, self.topic_buffer_kib);
        apply(&mut d.group_grace_ms, self.group_grace_ms);
        apply(&mut d.ack_flush_ms, self.ack_flush_ms);
        apply(&mut d.pull_batch, self.pull_batch);
        apply(&mut d.group_shards, self.group_shards);
        apply(&mut d.sync_offsets, self.sync_offsets);
        apply(&mut d.max_nack_delay_ms, self.max_nack_delay_ms);
        apply(&mut d.max_extend_ms, self.max_extend_ms);
        apply(&mut d.assign_timeout_ms, self.assign_timeout_ms);
        apply(&mut d.drain_ms, self.drain_ms);
        apply(&mut d.max_sessions_per_client, self.max_sessions_per_client);
        apply(
            &mut d.max_streams_per_connection,
            self.max_streams_per_connection,
        );
        apply(
            &mut d.max_publishes_in_progress,
            self.max_publishes_in_progress,
        );
        apply(&mut d.call_limit_ms, self.call_limit_ms);
        if d.call_limit_ms == 0 {
            return Err(ConfigError::Invalid {
                key: "call_limit_ms",
                message: "must be at least 1".into(),
            });
        }
        for (key, value) in [
            ("max_sessions_per_client", d.max_sessions_per_client),
            ("max_streams_per_connection", d.max_streams_per_connection),
            ("max_publishes_in_progress", d.max_publishes_in_progress),
        ] {
            if value == 0 {
                return Err(ConfigError::Invalid {
                    key,
                    message: "must be at least 1".into(),
                });
            }
        }
        if d.drain_ms >= config.shutdown_timeout_secs.saturating_mul(1000) {
            return Err(ConfigError::Invalid {
                key: "drain_ms",
                message: format!(
                    "must be below the shutdown timeout ({} s): the drain happens inside it",
                    config.shutdown_timeout_secs
                ),
            });
        }
        d.validate()?;
        let c = &mut config.cluster;
        apply(&mut c.etcd_endpoints, self.etcd_endpoints);
        c.etcd_endpoints.retain(|e| !e.trim().is_empty());
        apply(&mut c.etcd_prefix, self.etcd_prefix);
        apply(&mut c.lease_ttl_secs, self.lease_ttl_secs);
        apply(&mut c.keepalive_secs, self.keepalive_secs);
        apply(&mut c.mirror_interval_ms, self.mirror_interval_ms);
        apply(&mut c.mirror_progress, self.mirror_progress);
        if c.enabled() && config.instance_id.contains('|') {
            return Err(ConfigError::Invalid {
                key: "instance_id",
                message: "must not contain | (it separates the fields of etcd values)".into(),
            });
        }
        c.validate()?;
        Ok(config)
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn every_setting_flag_and_variable_is_documented() {
        use clap::CommandFactory;
        use eventmesh_common::config::undocumented_settings;
        let problems =
            undocumented_settings("dispatcher-svc", &Config::default(), &Args::command());
        assert!(
            problems.is_empty(),
            "docs/CONFIG.md, dispatcher-svc: {problems:#?}"
        );
    }

    #[test]
    fn shards_are_bounded_by_partitions_and_the_cap() {
        let settings = |group_shards| DeliverySettings {
            group_shards,
            ..DeliverySettings::default()
        };
        assert_eq!(
            settings(4).shards_for(2),
            2,
            "never more than the partitions"
        );
        assert_eq!(settings(4).shards_for(8), 4);
        assert_eq!(settings(1).shards_for(8), 1);
        assert_eq!(settings(4).shards_for(0), 1, "at least one");
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        assert_eq!(
            settings(0).shards_for(1_000),
            cores.saturating_sub(1).clamp(1, 64),
            "outside a runtime: one per core beyond the first"
        );
        for workers in [1, 3] {
            let runtime = eventmesh_common::runtime::build("shards-test", workers).unwrap();
            let shards = runtime.block_on(async { settings(0).shards_for(1_000) });
            assert_eq!(
                shards,
                workers.saturating_sub(1).max(1),
                "one per worker beyond the first ({workers} workers)"
            );
        }
        assert!(settings(65).validate().is_err());
        assert!(settings(64).validate().is_ok());
    }

    #[test]
    fn defaults_are_the_references() {
        let config = Args::parse_from(["dispatcher-svc"]).into_config().unwrap();
        let d = &config.delivery;
        assert_eq!(d.ack_timeout(), Duration::from_secs(30));
        assert_eq!(d.max_attempts, 6);
        for (attempt, nominal) in [
            (2, 1_000.0),
            (3, 2_000.0),
            (4, 4_000.0),
            (6, 16_000.0),
            (9, 16_000.0),
        ] {
            for _ in 0..50 {
                let ms = d.backoff(attempt).as_millis() as f64;
                assert!(
                    ms >= nominal * 0.8 - 1.0 && ms <= nominal * 1.2 + 1.0,
                    "{attempt}: {ms}"
                );
            }
        }
    }

    #[test]
    fn file_flags_and_invalid_values() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("d.toml");
        std::fs::write(
            &file,
            "[delivery]\nack_timeout_ms = 3000\nmax_attempts = 3\n",
        )
        .unwrap();
        let config = Args::parse_from([
            "dispatcher-svc",
            "--config",
            file.to_str().unwrap(),
            "--max-attempts",
            "4",
        ])
        .into_config()
        .unwrap();
        assert_eq!(config.delivery.ack_timeout_ms, 3000);
        assert_eq!(config.delivery.max_attempts, 4);
        let err = Args::parse_from(["dispatcher-svc", "--max-attempts", "0"])
            .into_config()
            .unwrap_err();
        assert!(err.to_string().contains("max_attempts"), "{err}");
        std::fs::write(&file, "[delivery]\nack_timeout = 3\n").unwrap();
        assert!(
            Args::parse_from(["dispatcher-svc", "--config", file.to_str().unwrap()])
                .into_config()
                .is_err()
        );
    }

    /// The `[cluster]` table: off by default, and every inconsistent value named.
    #[test]
    fn cluster_settings_and_their_errors() {
        let config = Args::parse_from(["dispatcher-svc"]).into_config().unwrap();
        assert!(!config.cluster.enabled());
        assert_eq!(config.cluster.etcd_prefix, "/em");
        assert_eq!(config.cluster.lease_ttl_secs, 15);
        assert_eq!(config.cluster.keepalive_secs, 5);
        assert_eq!(config.cluster.mirror_interval_ms, 1_000);
        let config = Args::parse_from([
            "dispatcher-svc",
            "--etcd-endpoints",
            "http://127.0.0.1:1,http://127.0.0.1:2",
        ])
        .into_config()
        .unwrap();
        assert_eq!(config.cluster.etcd_endpoints.len(), 2);
        for (args, key) in [
            (vec!["--etcd-prefix", "em"], "etcd_prefix"),
            (vec!["--etcd-prefix", "/em/"], "etcd_prefix"),
            (vec!["--lease-ttl-secs", "5"], "lease_ttl_secs"),
            (
                vec!["--lease-ttl-secs", "3", "--keepalive-secs", "4"],
                "lease_ttl_secs",
            ),
            (vec!["--keepalive-secs", "0"], "keepalive_secs"),
            (vec!["--mirror-interval-ms", "0"], "mirror_interval_ms"),
            (vec!["--etcd-endpoints", "127.0.0.1:2379"], "etcd_endpoints"),
        ] {
            let err = Args::parse_from(std::iter::once("dispatcher-svc").chain(args.clone()))
                .into_config()
                .unwrap_err();
            assert!(err.to_string().contains(key), "{args:?}: {err}");
        }
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("d.toml");
        std::fs::write(
            &file,
            "[cluster]\netcd_endpoints = [\"http://127.0.0.1:2379\"]\nlease_ttl_secs = 3\nkeepalive_secs = 1\n",
        )
        .unwrap();
        let config = Args::parse_from(["dispatcher-svc", "--config", file.to_str().unwrap()])
            .into_config()
            .unwrap();
        assert!(config.cluster.enabled());
        assert_eq!(config.cluster.lease_ttl_secs, 3);
        std::fs::write(&file, "[cluster]\nttl = 3\n").unwrap();
        assert!(
            Args::parse_from(["dispatcher-svc", "--config", file.to_str().unwrap()])
                .into_config()
                .is_err()
        );
    }
}

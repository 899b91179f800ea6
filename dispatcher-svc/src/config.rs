//! dispatcher-svc configuration: built-in defaults < TOML file (`--config`) < environment
//! (`EM_DISPATCHER_*`) < flags. Every setting is listed in `docs/CONFIG.md`.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use clap::Parser;
use eventmesh_common::config::{ConfigError, apply, load_file};
use eventmesh_common::telemetry::LogFormat;
use serde::Deserialize;

/// The effective configuration.
#[derive(Debug, Clone, PartialEq, Deserialize)]
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
    /// Deadline of every call to puller-svc and offset-svc, milliseconds (a frozen neighbour
    /// also fails calls through HTTP/2 keepalive within about 3 s).
    pub dependency_timeout_ms: u64,
    /// Delivery behaviour (the `[delivery]` table of the file).
    pub delivery: DeliverySettings,
}

/// How deliveries are tracked, retried, bounded and settled.
#[derive(Debug, Clone, PartialEq, Deserialize)]
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
    /// ACKs arriving within this window share one offset write, ms.
    pub ack_flush_ms: u64,
    /// Records asked for per pull.
    pub pull_batch: u32,
    /// fsync offset writes (node-loss durability).
    pub sync_offsets: bool,
    /// Longest NACK delay a client may ask for, ms (longer ones are capped, and said so).
    pub max_nack_delay_ms: u64,
    /// Longest ACK-deadline extension one Extend may ask for, ms (capped likewise).
    pub max_extend_ms: u64,
    /// A session whose stream took none of its deliveries for this long is stalled: they go
    /// to the group's other sessions, ms.
    pub assign_timeout_ms: u64,
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
            dependency_timeout_ms: 5_000,
            delivery: DeliverySettings::default(),
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
            topic_buffer_records: 20_000,
            topic_buffer_kib: 64 * 1024,
            group_grace_ms: 60_000,
            ack_flush_ms: 2,
            pull_batch: 512,
            sync_offsets: false,
            max_nack_delay_ms: 600_000,
            max_extend_ms: 600_000,
            assign_timeout_ms: 30_000,
        }
    }
}

impl DeliverySettings {
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
        if self.backoff_max_ms < self.backoff_base_ms {
            return Err(ConfigError::Invalid {
                key: "backoff_max_ms",
                message: "must be at least backoff_base_ms".into(),
            });
        }
        Ok(())
    }
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
    /// Pulled records held per topic [default: 20000].
    #[arg(long, env = "EM_DISPATCHER_TOPIC_BUFFER_RECORDS")]
    pub topic_buffer_records: Option<u32>,
    /// Pulled KiB held per topic [default: 65536].
    #[arg(long, env = "EM_DISPATCHER_TOPIC_BUFFER_KIB")]
    pub topic_buffer_kib: Option<u32>,
    /// Grace period of a group without sessions, ms [default: 60000].
    #[arg(long, env = "EM_DISPATCHER_GROUP_GRACE_MS")]
    pub group_grace_ms: Option<u64>,
    /// ACK coalescing window, ms [default: 2].
    #[arg(long, env = "EM_DISPATCHER_ACK_FLUSH_MS")]
    pub ack_flush_ms: Option<u64>,
    /// Records per pull [default: 512].
    #[arg(long, env = "EM_DISPATCHER_PULL_BATCH")]
    pub pull_batch: Option<u32>,
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
    /// Log format [default: text].
    #[arg(long, env = "EM_DISPATCHER_LOG_FORMAT")]
    pub log_format: Option<LogFormat>,
    /// Graceful shutdown timeout, seconds [default: 10].
    #[arg(long, env = "EM_DISPATCHER_SHUTDOWN_TIMEOUT_SECS")]
    pub shutdown_timeout_secs: Option<u64>,
    /// Deadline of calls to puller-svc and offset-svc, ms [default: 5000].
    #[arg(long, env = "EM_DISPATCHER_DEPENDENCY_TIMEOUT_MS")]
    pub dependency_timeout_ms: Option<u64>,
}

impl Args {
    /// Resolves the effective configuration.
    pub fn into_config(self) -> Result<Config, ConfigError> {
        let mut config: Config = load_file(self.config.as_deref())?;
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
        apply(
            &mut config.dependency_timeout_ms,
            self.dependency_timeout_ms,
        );
        if config.dependency_timeout_ms <= u64::from(crate::pulling::PULL_WAIT_MS) {
            return Err(ConfigError::Invalid {
                key: "dependency_timeout_ms",
                message: format!(
                    "must exceed the pull wait of {} ms",
                    crate::pulling::PULL_WAIT_MS
                ),
            });
        }
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
        apply(&mut d.sync_offsets, self.sync_offsets);
        apply(&mut d.max_nack_delay_ms, self.max_nack_delay_ms);
        apply(&mut d.max_extend_ms, self.max_extend_ms);
        apply(&mut d.assign_timeout_ms, self.assign_timeout_ms);
        d.validate()?;
        Ok(config)
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

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
}

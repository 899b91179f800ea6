//! offset-svc configuration: built-in defaults < TOML file (`--config`) < environment
//! (`EM_OFFSET_*`) < flags. Every setting is listed in `docs/CONFIG.md`.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use clap::Parser;
use eventmesh_common::config::{ConfigError, ServiceArgs, apply, check_worker_threads, load_file};
use eventmesh_common::telemetry::LogFormat;
use serde::{Deserialize, Serialize};

/// Default gRPC listen address of offset-svc.
pub const DEFAULT_LISTEN: &str = "127.0.0.1:50053";
/// Default Prometheus listen address of offset-svc.
pub const DEFAULT_METRICS_LISTEN: &str = "127.0.0.1:9153";

/// Which store implementation backs the service.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, clap::ValueEnum, Deserialize, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum StoreKind {
    /// RocksDB in `data_dir` (durable).
    #[default]
    Rocksdb,
    /// In memory (lost on exit; tests and demos only).
    Memory,
}

/// The effective configuration.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct Config {
    /// gRPC listen address; port 0 picks a free port (printed on stdout).
    pub listen: SocketAddr,
    /// Prometheus `/metrics` listen address (served by the binary).
    pub metrics_listen: SocketAddr,
    /// Directory of the RocksDB database.
    pub data_dir: PathBuf,
    /// Store implementation.
    pub store: StoreKind,
    /// fsync every write batch regardless of what the request asks (node-loss durability).
    pub sync_writes: bool,
    /// Open the database read-only (inspection next to a running owner); writes fail.
    pub read_only: bool,
    /// Log line format.
    pub log_format: LogFormat,
    /// Longest a graceful shutdown waits for in-flight requests, in seconds.
    pub shutdown_timeout_secs: u64,
    /// Async worker threads; 0: one per core the process may use (docs/CONFIG.md).
    pub worker_threads: usize,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            // The same values as DEFAULT_LISTEN / DEFAULT_METRICS_LISTEN (a test checks).
            listen: SocketAddr::from(([127, 0, 0, 1], 50053)),
            metrics_listen: SocketAddr::from(([127, 0, 0, 1], 9153)),
            data_dir: PathBuf::from("data/offset"),
            store: StoreKind::Rocksdb,
            sync_writes: false,
            read_only: false,
            log_format: LogFormat::Text,
            shutdown_timeout_secs: 10,
            worker_threads: 0,
        }
    }
}

/// Command-line flags; each also reads an environment variable.
#[derive(Debug, Parser)]
#[command(
    name = "offset-svc",
    version,
    about = "The EventMesh offset service: monotonic ACK offsets in RocksDB over gRPC."
)]
pub struct Args {
    /// TOML config file.
    #[arg(long, env = "EM_OFFSET_CONFIG")]
    pub config: Option<PathBuf>,
    /// Check FILE instead of starting: resolve it as `--config FILE` would (environment and
    /// flags applied), print the effective settings as TOML and exit; refused settings exit
    /// non-zero naming the key. Nothing is opened or contacted.
    #[arg(long, value_name = "FILE")]
    pub check_config: Option<PathBuf>,
    /// gRPC listen address [default: 127.0.0.1:50053].
    #[arg(long, env = "EM_OFFSET_LISTEN")]
    pub listen: Option<SocketAddr>,
    /// Prometheus /metrics listen address [default: 127.0.0.1:9153].
    #[arg(long, env = "EM_OFFSET_METRICS_LISTEN")]
    pub metrics_listen: Option<SocketAddr>,
    /// RocksDB directory [default: data/offset].
    #[arg(long, env = "EM_OFFSET_DATA_DIR")]
    pub data_dir: Option<PathBuf>,
    /// Store implementation [default: rocksdb].
    #[arg(long, env = "EM_OFFSET_STORE")]
    pub store: Option<StoreKind>,
    /// fsync every write batch.
    #[arg(long, env = "EM_OFFSET_SYNC_WRITES")]
    pub sync_writes: Option<bool>,
    /// Open the database read-only.
    #[arg(long, env = "EM_OFFSET_READ_ONLY")]
    pub read_only: Option<bool>,
    /// Log format [default: text].
    #[arg(long, env = "EM_OFFSET_LOG_FORMAT")]
    pub log_format: Option<LogFormat>,
    /// Graceful shutdown timeout in seconds [default: 10].
    #[arg(long, env = "EM_OFFSET_SHUTDOWN_TIMEOUT_SECS")]
    pub shutdown_timeout_secs: Option<u64>,
    /// Async worker threads; 0: one per core [default: 0].
    #[arg(long, env = "EM_OFFSET_WORKER_THREADS")]
    pub worker_threads: Option<usize>,
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
        apply(&mut config.metrics_listen, self.metrics_listen);
        apply(&mut config.data_dir, self.data_dir);
        apply(&mut config.store, self.store);
        apply(&mut config.sync_writes, self.sync_writes);
        apply(&mut config.read_only, self.read_only);
        apply(&mut config.log_format, self.log_format);
        apply(
            &mut config.shutdown_timeout_secs,
            self.shutdown_timeout_secs,
        );
        apply(&mut config.worker_threads, self.worker_threads);
        check_worker_threads(config.worker_threads)?;
        if config.read_only && config.store == StoreKind::Memory {
            return Err(ConfigError::Invalid {
                key: "read_only",
                message: "a read-only memory store would always be empty".into(),
            });
        }
        Ok(config)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_setting_flag_and_variable_is_documented() {
        use clap::CommandFactory;
        use eventmesh_common::config::undocumented_settings;
        let problems = undocumented_settings("offset-svc", &Config::default(), &Args::command());
        assert!(
            problems.is_empty(),
            "docs/CONFIG.md, offset-svc: {problems:#?}"
        );
    }

    #[test]
    fn flags_override_file_which_overrides_defaults() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("offset.toml");
        std::fs::write(&file, "data_dir = \"/from/file\"\nsync_writes = true\n").unwrap();
        let args = Args::parse_from([
            "offset-svc",
            "--config",
            file.to_str().unwrap(),
            "--data-dir",
            "/from/flag",
        ]);
        let config = args.into_config().unwrap();
        assert_eq!(config.data_dir, PathBuf::from("/from/flag"));
        assert!(config.sync_writes, "file value kept where no flag is given");
        assert_eq!(config.listen, DEFAULT_LISTEN.parse().unwrap());
        assert_eq!(
            config.metrics_listen,
            DEFAULT_METRICS_LISTEN.parse().unwrap()
        );
    }

    #[test]
    fn worker_threads_are_bounded() {
        let workers =
            |value: &str| Args::parse_from(["offset-svc", "--worker-threads", value]).into_config();
        assert_eq!(workers("1024").unwrap().worker_threads, 1024);
        assert_eq!(workers("0").unwrap().worker_threads, 0, "0: the default");
        let err = workers("5000").unwrap_err().to_string();
        assert!(err.contains("worker_threads"), "{err}");
    }

    #[test]
    fn unknown_file_keys_are_rejected() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("offset.toml");
        std::fs::write(&file, "sync_write = true\n").unwrap();
        let args = Args::parse_from(["offset-svc", "--config", file.to_str().unwrap()]);
        let err = args.into_config().unwrap_err().to_string();
        assert!(err.contains("sync_write"), "{err}");
    }
}

//! puller-svc configuration: built-in defaults < TOML file (`--config`) < environment
//! (`EM_PULLER_*`) < flags. Every setting is listed in `docs/CONFIG.md`.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use clap::Parser;
use eventmesh_common::config::{
    ConfigError, ServiceArgs, apply, check_endpoint, check_thread_count, check_worker_threads,
    load_file,
};
use eventmesh_common::telemetry::LogFormat;
use serde::{Deserialize, Serialize};

use crate::cursors::StartAt;
use crate::local_log::LogSettings;
use crate::storage::kafka::KafkaTuning;
use crate::storage::rocketmq::client::RocketMqSettings;
use crate::storage::rocketmq5::{DEFAULT_INVISIBLE_TIME, PopSettings};

/// Which MQ backend the puller reads.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, clap::ValueEnum, Deserialize, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Backend {
    /// The embedded local log in `data_dir` (one machine, demos, tests).
    #[default]
    Local,
    /// A Kafka (or Kafka-compatible) cluster at `kafka_bootstrap`.
    Kafka,
    /// RocketMQ 4.x semantics: PULL from the puller's own cursors, through the name server
    /// at `rocketmq_namesrv`.
    Rocketmq4,
    /// RocketMQ 5.x semantics: POP with the broker ACK deferred to the client's ACK, the POP
    /// position kept on the puller's own cursors (docs/ROCKETMQ.md).
    Rocketmq5,
}

/// Where a reader without a cursor or watermark starts.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, clap::ValueEnum, Deserialize, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Start {
    /// The oldest retained record.
    #[default]
    Earliest,
    /// Only new records.
    Latest,
}

impl From<Start> for StartAt {
    fn from(start: Start) -> Self {
        match start {
            Start::Earliest => StartAt::Earliest,
            Start::Latest => StartAt::Latest,
        }
    }
}

/// The effective configuration.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct Config {
    /// gRPC listen address; port 0 picks a free port (printed on stdout).
    pub listen: SocketAddr,
    /// Prometheus `/metrics` listen address.
    pub metrics_listen: SocketAddr,
    /// Cursor checkpoints and (for `local`) the log itself.
    pub data_dir: PathBuf,
    /// MQ backend.
    pub backend: Backend,
    /// offset-svc endpoint, for the group watermarks.
    pub offset_svc: String,
    /// Kafka bootstrap servers (`host:port,...`) for the `kafka` backend.
    pub kafka_bootstrap: String,
    /// Kafka: longest the broker holds an empty fetch, ms (librdkafka `fetch.wait.max.ms`).
    /// Apache Kafka answers it as soon as a record arrives; a broker that does not (tansu)
    /// adds up to this much to an idle topic's first record.
    pub kafka_fetch_wait_ms: u32,
    /// Kafka: how long the producer gathers records per request, ms (`linger.ms`).
    pub kafka_linger_ms: u32,
    /// RocketMQ name server(s) (`host:port;...`) for the `rocketmq4` and `rocketmq5` backends.
    pub rocketmq_namesrv: String,
    /// RocketMQ: the cluster whose masters get the topics the puller creates.
    pub rocketmq_cluster: String,
    /// RocketMQ: the largest message body the brokers accept (their `maxMessageSize`).
    pub rocketmq_max_message_bytes: usize,
    /// RocketMQ 5: the invisible time asked with every POP, ms.
    pub rocketmq_invisible_time_ms: u64,
    /// How often cursors are checkpointed, milliseconds (also at shutdown).
    pub checkpoint_interval_ms: u64,
    /// Where a reader with neither cursor nor watermark starts.
    pub start: Start,
    /// Partitions of a topic created without a count.
    pub default_partitions: u32,
    /// Local log: segment size, bytes.
    pub segment_bytes: u64,
    /// Local log: keep at most about this many bytes per partition; 0 keeps everything.
    pub retention_bytes: u64,
    /// Local log: drop segments older than this many hours; 0 keeps everything.
    pub retention_hours: u64,
    /// Local log: fsync every append (survives an OS crash, slower).
    pub sync_appends: bool,
    /// Log line format.
    pub log_format: LogFormat,
    /// Longest a graceful shutdown waits for open requests and streams, seconds.
    pub shutdown_timeout_secs: u64,
    /// Async worker threads; 0: one per core the process may use (docs/CONFIG.md).
    pub worker_threads: usize,
    /// Most threads of the blocking pool (file reads and appends, librdkafka calls); 0: by
    /// backend, [`LOCAL_BLOCKING_THREADS`] for `local`, tokio's default (512) for brokers.
    pub blocking_threads: usize,
    /// Deadline of every call to offset-svc, milliseconds (a frozen one also fails calls
    /// through HTTP/2 keepalive within about 3 s).
    pub dependency_timeout_ms: u64,
    /// Create a topic when a publish or subscribe names one that does not exist; unset: on
    /// for `local`, off for brokers (where topics are usually provisioned).
    pub auto_create_topics: Option<bool>,
    /// Age limit of dead-letter topics (`<topic>_DLQ`), hours; 0 keeps them forever.
    pub dead_letter_retention_hours: u64,
    /// A reader no dispatcher used for this long is evicted (its generation, its Kafka
    /// consumer, its cursors and their checkpoint), seconds.
    pub reader_idle_secs: u64,
}

/// The blocking pool of the `local` backend by default. Its blocking work is short (a read or
/// an append in the page cache; long polls wait outside the pool), and with tokio's default a
/// pull or append woke whichever of up to nine idle pool threads came next: each a thread
/// whose core the scheduler had to find again. Two keep one free while the other fsyncs
/// (`sync_appends`, checkpoints). Measured (docs/BENCHMARKS.md): half-load ACK → DURABLE p99
/// 8.58 → 4.98 ms (256 B × 1) and 7.57 → 4.83 ms (1 KiB × 8), medians of 8 rounds.
pub const LOCAL_BLOCKING_THREADS: usize = 2;

/// Most blocking-pool threads `blocking_threads` may ask for (tokio's own default is 512).
pub const MAX_BLOCKING_THREADS: usize = 4096;

impl Config {
    /// The blocking pool's size for the runtime (0: tokio's default).
    pub fn effective_blocking_threads(&self) -> usize {
        match (self.blocking_threads, self.backend) {
            (0, Backend::Local) => LOCAL_BLOCKING_THREADS,
            (threads, _) => threads,
        }
    }
}

impl Default for Config {
    fn default() -> Self {
        Config {
            listen: SocketAddr::from(([127, 0, 0, 1], 50052)),
            metrics_listen: SocketAddr::from(([127, 0, 0, 1], 9152)),
            data_dir: PathBuf::from("data/puller"),
            backend: Backend::Local,
            offset_svc: "http://127.0.0.1:50053".into(),
            kafka_bootstrap: "127.0.0.1:9092".into(),
            kafka_fetch_wait_ms: KafkaTuning::default().fetch_wait_ms,
            kafka_linger_ms: KafkaTuning::default().linger_ms,
            rocketmq_namesrv: "127.0.0.1:9876".into(),
            rocketmq_cluster: "DefaultCluster".into(),
            rocketmq_max_message_bytes: RocketMqSettings::DEFAULT_MAX_MESSAGE_BYTES,
            rocketmq_invisible_time_ms: DEFAULT_INVISIBLE_TIME.as_millis() as u64,
            checkpoint_interval_ms: 5_000,
            start: Start::Earliest,
            default_partitions: 4,
            segment_bytes: 64 * 1024 * 1024,
            retention_bytes: 0,
            retention_hours: 168,
            sync_appends: false,
            log_format: LogFormat::Text,
            shutdown_timeout_secs: 10,
            worker_threads: 0,
            blocking_threads: 0,
            dependency_timeout_ms: 5_000,
            auto_create_topics: None,
            dead_letter_retention_hours: 0,
            reader_idle_secs: 600,
        }
    }
}

impl Config {
    /// Whether topics named by a publish or subscribe are created.
    pub fn auto_create(&self) -> bool {
        self.auto_create_topics
            .unwrap_or(self.backend == Backend::Local)
    }

    /// The age limit of dead-letter topics (`None`: keep them).
    pub fn dead_letter_retention_ms(&self) -> Option<i64> {
        (self.dead_letter_retention_hours > 0)
            .then(|| self.dead_letter_retention_hours as i64 * 3_600_000)
    }

    /// Where the RocketMQ backends find the cluster.
    pub fn rocketmq_settings(&self) -> RocketMqSettings {
        RocketMqSettings {
            namesrv: self.rocketmq_namesrv.clone(),
            cluster: self.rocketmq_cluster.clone(),
            max_message_bytes: self.rocketmq_max_message_bytes,
        }
    }

    /// The POP settings of the `rocketmq5` backend.
    pub fn pop_settings(&self) -> PopSettings {
        PopSettings {
            invisible_time: Duration::from_millis(self.rocketmq_invisible_time_ms),
            ..PopSettings::default()
        }
    }

    /// The librdkafka settings of the `kafka` backend.
    pub fn kafka_tuning(&self) -> KafkaTuning {
        KafkaTuning {
            fetch_wait_ms: self.kafka_fetch_wait_ms,
            linger_ms: self.kafka_linger_ms,
        }
    }

    /// The local log settings this configuration implies.
    pub fn log_settings(&self) -> LogSettings {
        LogSettings {
            segment_bytes: self.segment_bytes,
            retention_bytes: (self.retention_bytes > 0).then_some(self.retention_bytes),
            retention_ms: (self.retention_hours > 0)
                .then_some(self.retention_hours as i64 * 3_600_000),
            sync: self.sync_appends,
        }
    }
}

/// Command-line flags; each also reads an environment variable.
#[derive(Debug, Parser)]
#[command(
    name = "puller-svc",
    version,
    about = "The EventMesh puller: per-group MQ pull cursors, checkpointed and aligned to the ACK watermark."
)]
pub struct Args {
    /// TOML config file.
    #[arg(long, env = "EM_PULLER_CONFIG")]
    pub config: Option<PathBuf>,
    /// Check FILE instead of starting: resolve it as `--config FILE` would (environment and
    /// flags applied), print the effective settings as TOML and exit; refused settings exit
    /// non-zero naming the key. Nothing is opened or contacted.
    #[arg(long, value_name = "FILE")]
    pub check_config: Option<PathBuf>,
    /// gRPC listen address [default: 127.0.0.1:50052].
    #[arg(long, env = "EM_PULLER_LISTEN")]
    pub listen: Option<SocketAddr>,
    /// Prometheus /metrics listen address [default: 127.0.0.1:9152].
    #[arg(long, env = "EM_PULLER_METRICS_LISTEN")]
    pub metrics_listen: Option<SocketAddr>,
    /// Data directory [default: data/puller].
    #[arg(long, env = "EM_PULLER_DATA_DIR")]
    pub data_dir: Option<PathBuf>,
    /// MQ backend [default: local].
    #[arg(long, env = "EM_PULLER_BACKEND")]
    pub backend: Option<Backend>,
    /// offset-svc endpoint [default: http://127.0.0.1:50053].
    #[arg(long, env = "EM_PULLER_OFFSET_SVC")]
    pub offset_svc: Option<String>,
    /// Kafka bootstrap servers [default: 127.0.0.1:9092].
    #[arg(long, env = "EM_PULLER_KAFKA_BOOTSTRAP")]
    pub kafka_bootstrap: Option<String>,
    /// Kafka: longest the broker holds an empty fetch, ms [default: 500].
    #[arg(long, env = "EM_PULLER_KAFKA_FETCH_WAIT_MS")]
    pub kafka_fetch_wait_ms: Option<u32>,
    /// Kafka: producer linger, ms [default: 5].
    #[arg(long, env = "EM_PULLER_KAFKA_LINGER_MS")]
    pub kafka_linger_ms: Option<u32>,
    /// RocketMQ name server(s), `host:port;...` [default: 127.0.0.1:9876].
    #[arg(long, env = "EM_PULLER_ROCKETMQ_NAMESRV")]
    pub rocketmq_namesrv: Option<String>,
    /// RocketMQ cluster whose masters get created topics [default: DefaultCluster].
    #[arg(long, env = "EM_PULLER_ROCKETMQ_CLUSTER")]
    pub rocketmq_cluster: Option<String>,
    /// RocketMQ brokers' maxMessageSize, bytes [default: 4194304].
    #[arg(long, env = "EM_PULLER_ROCKETMQ_MAX_MESSAGE_BYTES")]
    pub rocketmq_max_message_bytes: Option<usize>,
    /// RocketMQ 5: invisible time of a popped message, ms [default: 300000].
    #[arg(long, env = "EM_PULLER_ROCKETMQ_INVISIBLE_TIME_MS")]
    pub rocketmq_invisible_time_ms: Option<u64>,
    /// Checkpoint interval, ms [default: 5000].
    #[arg(long, env = "EM_PULLER_CHECKPOINT_INTERVAL_MS")]
    pub checkpoint_interval_ms: Option<u64>,
    /// Start of a reader with no cursor and no watermark [default: earliest].
    #[arg(long, env = "EM_PULLER_START")]
    pub start: Option<Start>,
    /// Partitions of topics created without a count [default: 4].
    #[arg(long, env = "EM_PULLER_DEFAULT_PARTITIONS")]
    pub default_partitions: Option<u32>,
    /// Local log segment size, bytes [default: 67108864].
    #[arg(long, env = "EM_PULLER_SEGMENT_BYTES")]
    pub segment_bytes: Option<u64>,
    /// Local log retention per partition, bytes; 0 keeps everything [default: 0].
    #[arg(long, env = "EM_PULLER_RETENTION_BYTES")]
    pub retention_bytes: Option<u64>,
    /// Local log retention, hours; 0 keeps everything [default: 168].
    #[arg(long, env = "EM_PULLER_RETENTION_HOURS")]
    pub retention_hours: Option<u64>,
    /// fsync every local append write (one per publish batch and partition) before it is
    /// answered: what was answered then survives power loss, not only a crash of the process.
    #[arg(long, env = "EM_PULLER_SYNC_APPENDS")]
    pub sync_appends: Option<bool>,
    /// Log format [default: text].
    #[arg(long, env = "EM_PULLER_LOG_FORMAT")]
    pub log_format: Option<LogFormat>,
    /// Graceful shutdown timeout, seconds [default: 10].
    #[arg(long, env = "EM_PULLER_SHUTDOWN_TIMEOUT_SECS")]
    pub shutdown_timeout_secs: Option<u64>,
    /// Async worker threads; 0: one per core [default: 0].
    #[arg(long, env = "EM_PULLER_WORKER_THREADS")]
    pub worker_threads: Option<usize>,
    /// Most blocking-pool threads; 0: 2 for local, tokio's default for brokers [default: 0].
    #[arg(long, env = "EM_PULLER_BLOCKING_THREADS")]
    pub blocking_threads: Option<usize>,
    /// Deadline of calls to offset-svc, ms [default: 5000].
    #[arg(long, env = "EM_PULLER_DEPENDENCY_TIMEOUT_MS")]
    pub dependency_timeout_ms: Option<u64>,
    /// Create topics a publish or subscribe names [default: on for local, off for brokers].
    #[arg(long, env = "EM_PULLER_AUTO_CREATE_TOPICS")]
    pub auto_create_topics: Option<bool>,
    /// Age limit of dead-letter topics, hours; 0 keeps them [default: 0].
    #[arg(long, env = "EM_PULLER_DEAD_LETTER_RETENTION_HOURS")]
    pub dead_letter_retention_hours: Option<u64>,
    /// Evict readers unused for this long, seconds [default: 600].
    #[arg(long, env = "EM_PULLER_READER_IDLE_SECS")]
    pub reader_idle_secs: Option<u64>,
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
        apply(&mut config.backend, self.backend);
        apply(&mut config.offset_svc, self.offset_svc);
        apply(&mut config.kafka_bootstrap, self.kafka_bootstrap);
        apply(&mut config.kafka_fetch_wait_ms, self.kafka_fetch_wait_ms);
        apply(&mut config.kafka_linger_ms, self.kafka_linger_ms);
        apply(&mut config.rocketmq_namesrv, self.rocketmq_namesrv);
        apply(&mut config.rocketmq_cluster, self.rocketmq_cluster);
        apply(
            &mut config.rocketmq_max_message_bytes,
            self.rocketmq_max_message_bytes,
        );
        apply(
            &mut config.rocketmq_invisible_time_ms,
            self.rocketmq_invisible_time_ms,
        );
        apply(
            &mut config.checkpoint_interval_ms,
            self.checkpoint_interval_ms,
        );
        apply(&mut config.start, self.start);
        apply(&mut config.default_partitions, self.default_partitions);
        apply(&mut config.segment_bytes, self.segment_bytes);
        apply(&mut config.retention_bytes, self.retention_bytes);
        apply(&mut config.retention_hours, self.retention_hours);
        apply(&mut config.sync_appends, self.sync_appends);
        apply(&mut config.log_format, self.log_format);
        apply(
            &mut config.shutdown_timeout_secs,
            self.shutdown_timeout_secs,
        );
        apply(&mut config.worker_threads, self.worker_threads);
        check_worker_threads(config.worker_threads)?;
        apply(&mut config.blocking_threads, self.blocking_threads);
        check_thread_count(
            "blocking_threads",
            config.blocking_threads,
            MAX_BLOCKING_THREADS,
            "by backend",
        )?;
        apply(
            &mut config.dependency_timeout_ms,
            self.dependency_timeout_ms,
        );
        if self.auto_create_topics.is_some() {
            config.auto_create_topics = self.auto_create_topics;
        }
        apply(
            &mut config.dead_letter_retention_hours,
            self.dead_letter_retention_hours,
        );
        apply(&mut config.reader_idle_secs, self.reader_idle_secs);
        for (key, value) in [
            ("checkpoint_interval_ms", config.checkpoint_interval_ms),
            ("dependency_timeout_ms", config.dependency_timeout_ms),
            ("reader_idle_secs", config.reader_idle_secs),
        ] {
            if value == 0 {
                return Err(ConfigError::Invalid {
                    key,
                    message: "must be at least 1".into(),
                });
            }
        }
        check_endpoint("offset_svc", &config.offset_svc)?;
        if config.default_partitions == 0 {
            return Err(ConfigError::Invalid {
                key: "default_partitions",
                message: "must be at least 1".into(),
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
        // Every optional setting set, so it is serialized too.
        let config = Config {
            auto_create_topics: Some(true),
            ..Config::default()
        };
        let problems = undocumented_settings("puller-svc", &config, &Args::command());
        assert!(
            problems.is_empty(),
            "docs/CONFIG.md, puller-svc: {problems:#?}"
        );
    }

    #[test]
    fn the_blocking_pool_is_small_for_the_local_log_and_tokios_for_brokers() {
        let config = |args: &[&str]| {
            let mut argv = vec!["puller-svc"];
            argv.extend_from_slice(args);
            Args::parse_from(argv).into_config()
        };
        let local = config(&[]).unwrap();
        assert_eq!(local.effective_blocking_threads(), LOCAL_BLOCKING_THREADS);
        for backend in ["kafka", "rocketmq4", "rocketmq5"] {
            let broker = config(&["--backend", backend]).unwrap();
            assert_eq!(broker.effective_blocking_threads(), 0, "{backend}");
        }
        let given = config(&["--blocking-threads", "7"]).unwrap();
        assert_eq!(given.effective_blocking_threads(), 7);
        let kafka = config(&["--backend", "kafka", "--blocking-threads", "3"]).unwrap();
        assert_eq!(kafka.effective_blocking_threads(), 3);
        let err = config(&["--blocking-threads", "5000"]).unwrap_err();
        assert!(err.to_string().contains("blocking_threads"), "{err}");
    }

    #[test]
    fn defaults_file_and_flags() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("puller.toml");
        std::fs::write(
            &file,
            "checkpoint_interval_ms = 1000\nretention_hours = 0\n",
        )
        .unwrap();
        let config = Args::parse_from([
            "puller-svc",
            "--config",
            file.to_str().unwrap(),
            "--start",
            "latest",
        ])
        .into_config()
        .unwrap();
        assert_eq!(config.checkpoint_interval_ms, 1000);
        assert_eq!(config.start, Start::Latest);
        assert_eq!(config.listen, Config::default().listen);
        assert_eq!(
            config.log_settings().retention_ms,
            None,
            "0 keeps everything"
        );
        assert_eq!(config.log_settings().retention_bytes, None);
    }

    #[test]
    fn invalid_values_are_refused() {
        let err = Args::parse_from(["puller-svc", "--checkpoint-interval-ms", "0"])
            .into_config()
            .unwrap_err();
        assert!(err.to_string().contains("checkpoint_interval_ms"), "{err}");
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("bad.toml");
        std::fs::write(&file, "backend = \"pulsar\"\n").unwrap();
        assert!(
            Args::parse_from(["puller-svc", "--config", file.to_str().unwrap()])
                .into_config()
                .is_err()
        );
    }
}

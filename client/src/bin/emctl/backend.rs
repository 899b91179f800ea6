//! Which MQ backend the puller-svc of an `emctl demo` or `emctl bench` instance reads, and
//! the flags that point it there.

use anyhow::Context;
use clap::{Args, ValueEnum};
use eventmesh_client::local::{LocalConfig, Service};

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Backend {
    /// The embedded local log.
    Local,
    /// A Kafka-compatible broker at --kafka-bootstrap.
    Kafka,
    /// RocketMQ, PULL from the puller's own cursors, through the name server at
    /// --rocketmq-namesrv.
    Rocketmq4,
    /// RocketMQ, POP with the broker ACK after the client's ACK, through the name server at
    /// --rocketmq-namesrv.
    Rocketmq5,
}

#[derive(Debug, Args)]
pub struct BackendArgs {
    /// puller-svc's backend.
    #[arg(long, value_enum, default_value_t = Backend::Local)]
    pub backend: Backend,
    /// Kafka bootstrap servers (with --backend kafka).
    #[arg(long)]
    pub kafka_bootstrap: Option<String>,
    /// RocketMQ name server, `host:port` (with --backend rocketmq4 or rocketmq5).
    #[arg(long)]
    pub rocketmq_namesrv: Option<String>,
    /// Extra puller-svc flag (repeat; e.g. `--puller-arg=--sync-appends=true`).
    #[arg(long = "puller-arg", allow_hyphen_values = true)]
    pub puller_args: Vec<String>,
}

impl BackendArgs {
    /// The backend's name, as puller-svc spells it.
    pub fn name(&self) -> String {
        format!("{:?}", self.backend).to_lowercase()
    }

    /// Points the instance's puller-svc at the backend (and passes the extra flags).
    pub fn apply(&self, config: LocalConfig) -> anyhow::Result<LocalConfig> {
        let mut flags = Vec::new();
        match self.backend {
            Backend::Local => {}
            Backend::Kafka => {
                let bootstrap = self
                    .kafka_bootstrap
                    .clone()
                    .context("--backend kafka needs --kafka-bootstrap")?;
                flags.extend(["--kafka-bootstrap".to_owned(), bootstrap]);
            }
            Backend::Rocketmq4 | Backend::Rocketmq5 => {
                let namesrv = self.rocketmq_namesrv.clone().with_context(|| {
                    format!("--backend {} needs --rocketmq-namesrv", self.name())
                })?;
                flags.extend(["--rocketmq-namesrv".to_owned(), namesrv]);
            }
        }
        if self.backend != Backend::Local {
            // Every run publishes to fresh topics; on a broker the puller creates topics only
            // when told to.
            flags.extend([
                "--backend".to_owned(),
                self.name(),
                "--auto-create-topics".to_owned(),
                "true".to_owned(),
            ]);
        }
        Ok(config
            .args(Service::Puller, flags)
            .args(Service::Puller, self.puller_args.iter().cloned()))
    }
}

//! Tracing initialisation for the service binaries.
//!
//! * Logs go to stderr, as text or JSON (`--log-format`), filtered by `RUST_LOG`
//!   (default `info`).
//! * When `OTEL_EXPORTER_OTLP_ENDPOINT` is set, spans are also exported over OTLP/gRPC with
//!   the service name as `service.name`; the exporter and the sampler read the standard
//!   `OTEL_*` variables (`OTEL_TRACES_SAMPLER=parentbased_traceidratio`,
//!   `OTEL_TRACES_SAMPLER_ARG=0.01`, `OTEL_BSP_SCHEDULE_DELAY`, …). Without it, nothing is
//!   exported, nothing is buffered and [`crate::trace_context`] does no work.
//! * Exported are the hop spans only — the messaging spans and the gRPC server spans of calls
//!   that carry a sampled context ([`crate::trace_context`]) — never the log-only spans, and
//!   independently of `RUST_LOG`.
//!
//! Keep the returned [`TelemetryGuard`] alive for the life of the process: dropping it flushes
//! and shuts down the exporter.

use opentelemetry::trace::TracerProvider as _;
use opentelemetry_sdk::Resource;
use opentelemetry_sdk::trace::SdkTracerProvider;
use tracing_subscriber::filter::{LevelFilter, Targets};
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;
use tracing_subscriber::{EnvFilter, Layer};

/// Log line format.
#[derive(
    Debug,
    Clone,
    Copy,
    Default,
    PartialEq,
    Eq,
    clap::ValueEnum,
    serde::Deserialize,
    serde::Serialize,
)]
#[serde(rename_all = "lowercase")]
pub enum LogFormat {
    /// Human-readable lines.
    #[default]
    Text,
    /// One JSON object per line.
    Json,
}

/// Why telemetry could not start.
#[derive(Debug, thiserror::Error)]
pub enum TelemetryError {
    /// The OTLP exporter could not be built.
    #[error("cannot build the OTLP span exporter: {0}")]
    Exporter(String),
    /// A global subscriber was already installed.
    #[error("cannot install the tracing subscriber: {0}")]
    Subscriber(String),
}

/// Flushes and stops span export when dropped.
pub struct TelemetryGuard {
    provider: Option<SdkTracerProvider>,
}

impl Drop for TelemetryGuard {
    fn drop(&mut self) {
        if let Some(provider) = self.provider.take()
            && let Err(err) = provider.shutdown()
        {
            eprintln!("OpenTelemetry shutdown failed: {err}");
        }
    }
}

/// Installs the global tracing subscriber for `service_name`.
pub fn init(
    service_name: &'static str,
    format: LogFormat,
) -> Result<TelemetryGuard, TelemetryError> {
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info"));
    let fmt_layer = match format {
        LogFormat::Text => tracing_subscriber::fmt::layer()
            .with_writer(std::io::stderr)
            .boxed(),
        LogFormat::Json => tracing_subscriber::fmt::layer()
            .json()
            .with_writer(std::io::stderr)
            .boxed(),
    }
    .with_filter(filter);
    let provider = match std::env::var_os("OTEL_EXPORTER_OTLP_ENDPOINT") {
        Some(_) => Some(otlp_provider(service_name)?),
        None => None,
    };
    let otel_layer = provider.as_ref().map(|provider| {
        let hops = Targets::new()
            .with_target("eventmesh::messaging", LevelFilter::INFO)
            .with_target("eventmesh::grpc", LevelFilter::INFO);
        tracing_opentelemetry::layer()
            .with_tracer(provider.tracer(service_name))
            .with_filter(hops)
    });
    tracing_subscriber::registry()
        .with(fmt_layer)
        .with(otel_layer)
        .try_init()
        .map_err(|err| TelemetryError::Subscriber(err.to_string()))?;
    if provider.is_some() {
        crate::trace_context::enable();
    }
    Ok(TelemetryGuard { provider })
}

fn otlp_provider(service_name: &'static str) -> Result<SdkTracerProvider, TelemetryError> {
    let exporter = opentelemetry_otlp::SpanExporter::builder()
        .with_tonic()
        .build()
        .map_err(|err| TelemetryError::Exporter(err.to_string()))?;
    Ok(SdkTracerProvider::builder()
        .with_batch_exporter(exporter)
        .with_resource(Resource::builder().with_service_name(service_name).build())
        .build())
}

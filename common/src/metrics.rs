//! Prometheus exposition for the service binaries.
//!
//! Services record through the `metrics` facade (`counter!`, `histogram!`, `gauge!`); the
//! binary installs the process-wide exporter once with [`install`], which serves the text
//! format on `http://<listen>/metrics`. Without an installed exporter (library use, in-process
//! tests) recording is a no-op. Metric names follow Prometheus conventions: an `eventmesh_`
//! prefix, base units (`_seconds`, `_bytes`), `_total` for counters.

use std::net::SocketAddr;

use metrics_exporter_prometheus::{Matcher, PrometheusBuilder};

/// Histogram buckets for every `*_seconds` metric: 50 µs to 10 s.
pub const LATENCY_BUCKETS: &[f64] = &[
    0.000_05, 0.000_1, 0.000_25, 0.000_5, 0.001, 0.002_5, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
    1.0, 2.5, 5.0, 10.0,
];

/// Why the exporter could not start.
#[derive(Debug, thiserror::Error)]
#[error("cannot start the Prometheus exporter on {listen}: {message}")]
pub struct MetricsError {
    /// The requested address.
    pub listen: SocketAddr,
    /// The exporter's message.
    pub message: String,
}

/// Installs the global recorder and serves `/metrics` on `listen`. Call once, inside the
/// tokio runtime.
pub fn install(listen: SocketAddr) -> Result<(), MetricsError> {
    let error = |message: String| MetricsError { listen, message };
    PrometheusBuilder::new()
        .with_http_listener(listen)
        .set_buckets_for_metric(Matcher::Suffix("_seconds".into()), LATENCY_BUCKETS)
        .map_err(|err| error(err.to_string()))?
        .install()
        .map_err(|err| error(err.to_string()))
}

//! Prometheus exposition for the service binaries.
//!
//! Services record through the `metrics` facade (`counter!`, `histogram!`, `gauge!`); the
//! binary installs the process-wide exporter once with [`install`], which serves the text
//! format on `http://<listen>/metrics`. Without an installed exporter (library use, in-process
//! tests) recording is a no-op. Metric names follow Prometheus conventions: an `eventmesh_`
//! prefix, base units (`_seconds`, `_bytes`), `_total` for counters.
//!
//! Label sets stay bounded whatever clients do: a label set not updated for
//! [`IDLE_TIMEOUT`] leaves the exposition, and subscription groups (one per BROADCAST client)
//! get their own `group` label only up to [`MAX_GROUP_LABELS`] live at once ([`group_label`]);
//! the others share [`OTHER_GROUPS`].

use std::collections::HashSet;
use std::net::SocketAddr;
use std::sync::{Mutex, OnceLock};
use std::time::Duration;

use metrics_exporter_prometheus::{Matcher, PrometheusBuilder};
use metrics_util::MetricKindMask;

/// A label set not updated for this long leaves the exposition.
pub const IDLE_TIMEOUT: Duration = Duration::from_secs(600);
/// Most subscription groups with a `group` label of their own at once.
pub const MAX_GROUP_LABELS: usize = 256;
/// The `group` label of groups beyond [`MAX_GROUP_LABELS`].
pub const OTHER_GROUPS: &str = "(other)";

fn group_labels() -> &'static Mutex<HashSet<String>> {
    static LABELS: OnceLock<Mutex<HashSet<String>>> = OnceLock::new();
    LABELS.get_or_init(Mutex::default)
}

/// The `group` label value for `group`: itself while fewer than [`MAX_GROUP_LABELS`] groups
/// have one, else [`OTHER_GROUPS`].
pub fn group_label(group: &str) -> String {
    let mut labels = group_labels().lock().unwrap_or_else(|p| p.into_inner());
    if labels.contains(group) {
        return group.to_owned();
    }
    if labels.len() < MAX_GROUP_LABELS {
        labels.insert(group.to_owned());
        return group.to_owned();
    }
    OTHER_GROUPS.to_owned()
}

/// A group ended: its label value may go to another group.
pub fn forget_group_label(group: &str) {
    group_labels()
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .remove(group);
}

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
        .idle_timeout(MetricKindMask::ALL, Some(IDLE_TIMEOUT))
        .set_buckets_for_metric(Matcher::Suffix("_seconds".into()), LATENCY_BUCKETS)
        .map_err(|err| error(err.to_string()))?
        .install()
        .map_err(|err| error(err.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn group_labels_are_bounded() {
        let names: Vec<String> = (0..MAX_GROUP_LABELS + 10)
            .map(|i| format!("g{i}"))
            .collect();
        let given: Vec<String> = names.iter().map(|n| group_label(n)).collect();
        assert!(given.iter().filter(|g| *g == OTHER_GROUPS).count() >= 10);
        assert_eq!(group_label(&names[0]), names[0], "kept while live");
        forget_group_label(&names[0]);
        let late = format!("g{}", MAX_GROUP_LABELS + 5);
        assert_eq!(
            group_label(&late),
            late,
            "a freed label goes to another group"
        );
        for name in &names {
            forget_group_label(name);
        }
    }
}

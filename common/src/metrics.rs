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

use std::time::Instant;

use metrics::{Counter, Gauge, Histogram, Label};
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

/// A metric handle kept by a hot path: `counter!`/`gauge!` look the metric up (and allocate)
/// on every call, a kept handle does not. The exporter drops a metric left idle for
/// [`IDLE_TIMEOUT`], after which updates through an old handle would be lost, so a handle
/// unused for half that time is fetched again before its next update.
#[derive(Debug)]
pub struct Kept<H> {
    name: &'static str,
    labels: Vec<Label>,
    handle: H,
    used: Instant,
    fetch: fn(&'static str, &[Label]) -> H,
}

impl<H> Kept<H> {
    fn new(name: &'static str, labels: Vec<Label>, fetch: fn(&'static str, &[Label]) -> H) -> Self {
        Kept {
            handle: fetch(name, &labels),
            name,
            labels,
            used: Instant::now(),
            fetch,
        }
    }

    fn handle(&mut self) -> &H {
        let now = Instant::now();
        if now.duration_since(self.used) > IDLE_TIMEOUT / 2 {
            self.handle = (self.fetch)(self.name, &self.labels);
        }
        self.used = now;
        &self.handle
    }
}

/// A kept counter.
pub type KeptCounter = Kept<Counter>;
/// A kept gauge.
pub type KeptGauge = Kept<Gauge>;
/// A kept histogram.
pub type KeptHistogram = Kept<Histogram>;

impl Kept<Histogram> {
    /// The histogram `name` with `labels`.
    pub fn histogram(name: &'static str, labels: Vec<Label>) -> Self {
        Kept::new(name, labels, |name, labels| {
            metrics::histogram!(name, labels.to_vec())
        })
    }

    /// Records `value`.
    pub fn record(&mut self, value: f64) {
        self.handle().record(value);
    }
}

impl Kept<Counter> {
    /// The counter `name` with `labels`.
    pub fn counter(name: &'static str, labels: Vec<Label>) -> Self {
        Kept::new(name, labels, |name, labels| {
            metrics::counter!(name, labels.to_vec())
        })
    }

    /// Adds `value`.
    pub fn increment(&mut self, value: u64) {
        self.handle().increment(value);
    }
}

impl Kept<Gauge> {
    /// The gauge `name` with `labels`.
    pub fn gauge(name: &'static str, labels: Vec<Label>) -> Self {
        Kept::new(name, labels, |name, labels| {
            metrics::gauge!(name, labels.to_vec())
        })
    }

    /// Sets the value.
    pub fn set(&mut self, value: f64) {
        self.handle().set(value);
    }
}

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

//! The one line a round prints: a JSON object (`--json`) or a human-readable summary.

use serde::Serialize;

use crate::cli::HalfLoadOf;

/// What JetStream's file store promises when it answers a publish or an ACK (its default,
/// which the bench keeps).
pub const SYNC_NOTE: &str =
    "file store, server default sync (2.9: fsync every 2 min, not per write)";

/// One round's results. Rates are per second, latencies in ms, CPU in cores (CPU seconds /
/// wall seconds over the full-load consume phase), RSS in MiB after the run. Fields that a
/// round did not measure (no `--server-pid`, `--no-half-load`) are null.
#[derive(Debug, Clone, Serialize)]
pub struct Report {
    pub peer: &'static str,
    pub size: usize,
    pub streams: usize,
    pub events: u64,
    pub publish_per_sec: f64,
    pub e2e_per_sec: f64,
    pub full_ack_p50_ms: Option<f64>,
    pub full_ack_p99_ms: Option<f64>,
    /// The live load: N/2 events published as fast as the server answers while the consumer
    /// tasks consume; events / first publish to the last ACK processed, and the sampled ACK
    /// latencies (every 64th, as at full load).
    pub live_per_sec: Option<f64>,
    pub live_ack_p50_ms: Option<f64>,
    pub live_ack_p99_ms: Option<f64>,
    /// Which rate the half load is half of.
    pub half_load_of: HalfLoadOf,
    pub half_rate_per_sec: Option<f64>,
    pub half_ack_p50_ms: Option<f64>,
    pub half_ack_p99_ms: Option<f64>,
    pub server_cpu_cores: Option<f64>,
    pub server_rss_mb: Option<f64>,
    pub client_cpu_cores: f64,
    /// How many full-load ACKs were timed with `double_ack` (every 64th first delivery).
    pub full_ack_samples: usize,
    /// Events of the half-load phase (N/2), when it ran.
    pub half_events: Option<u64>,
    /// The half-load publish target: 50 % of `live_per_sec` (or of `e2e_per_sec` with
    /// `--half-load-of full`).
    pub half_target_per_sec: Option<f64>,
    /// The half-load publish rate reached (N/2 / first publish to last publish ACK): below the
    /// target when the client cannot keep up.
    pub half_publish_per_sec: Option<f64>,
    /// Deliveries after the first (ACK wait expired) over both phases; 0 in a clean round.
    pub redelivered: u64,
    pub server_version: String,
    pub storage: &'static str,
}

/// `x` rounded to `digits` decimals, so the JSON stays readable.
pub fn round(x: f64, digits: i32) -> f64 {
    let scale = 10f64.powi(digits);
    (x * scale).round() / scale
}

fn opt(value: Option<f64>, unit: &str) -> String {
    value.map_or_else(|| "-".to_string(), |v| format!("{v:.2}{unit}"))
}

impl Report {
    /// The same values on one human-readable line, with the store's durability caveat.
    pub fn human_line(&self) -> String {
        format!(
            "jetstream {} | size {} B, streams {}, N {} | publish {:.0}/s | e2e {:.0}/s, ACK \
             p50/p99 {}/{} ({} sampled double_acks) | live {}/s ACK p50/p99 {}/{} | half load of {:?} {}/s (target {}/s, published {}/s) ACK p50/p99 \
             {}/{} | CPU server {} client {:.2} cores | server RSS {} | redelivered {} | {}",
            self.server_version,
            self.size,
            self.streams,
            self.events,
            self.publish_per_sec,
            self.e2e_per_sec,
            opt(self.full_ack_p50_ms, " ms"),
            opt(self.full_ack_p99_ms, " ms"),
            self.full_ack_samples,
            opt(self.live_per_sec, ""),
            opt(self.live_ack_p50_ms, " ms"),
            opt(self.live_ack_p99_ms, " ms"),
            self.half_load_of,
            opt(self.half_rate_per_sec, ""),
            opt(self.half_target_per_sec, ""),
            opt(self.half_publish_per_sec, ""),
            opt(self.half_ack_p50_ms, " ms"),
            opt(self.half_ack_p99_ms, " ms"),
            opt(self.server_cpu_cores, ""),
            self.client_cpu_cores,
            opt(self.server_rss_mb, " MiB"),
            self.redelivered,
            self.storage,
        )
    }
}

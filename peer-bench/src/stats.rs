//! Latency percentiles: nearest rank over the sorted samples.

use std::time::Duration;

/// Latency samples in milliseconds.
#[derive(Debug, Default, Clone)]
pub struct Latencies {
    ms: Vec<f64>,
}

impl Latencies {
    pub fn push(&mut self, latency: Duration) {
        self.ms.push(latency.as_secs_f64() * 1e3);
    }

    pub fn extend(&mut self, other: Latencies) {
        self.ms.extend(other.ms);
    }

    pub fn len(&self) -> usize {
        self.ms.len()
    }

    pub fn is_empty(&self) -> bool {
        self.ms.is_empty()
    }

    /// The largest sample in ms, or `None` without samples.
    pub fn max(&self) -> Option<f64> {
        self.ms.iter().copied().max_by(f64::total_cmp)
    }

    /// (p50, p99) in ms, or `None` without samples.
    pub fn p50_p99(&mut self) -> Option<(f64, f64)> {
        self.ms.sort_by(f64::total_cmp);
        Some((percentile(&self.ms, 50.0)?, percentile(&self.ms, 99.0)?))
    }
}

/// The nearest-rank `p`th percentile of ascending `sorted` samples: the smallest sample with at
/// least p % of the samples at or below it.
pub fn percentile(sorted: &[f64], p: f64) -> Option<f64> {
    if sorted.is_empty() {
        return None;
    }
    let rank = ((p / 100.0) * sorted.len() as f64).ceil() as usize;
    sorted.get(rank.clamp(1, sorted.len()) - 1).copied()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nearest_rank() {
        let sorted: Vec<f64> = (1..=100).map(f64::from).collect();
        assert_eq!(percentile(&sorted, 50.0), Some(50.0));
        assert_eq!(percentile(&sorted, 99.0), Some(99.0));
        assert_eq!(percentile(&sorted, 100.0), Some(100.0));
        assert_eq!(percentile(&[7.0], 99.0), Some(7.0));
        assert_eq!(percentile(&[], 50.0), None);
    }

    #[test]
    fn samples_are_sorted_before_ranking() {
        let mut latencies = Latencies::default();
        for ms in [9u64, 1, 5, 3, 7] {
            latencies.push(Duration::from_millis(ms));
        }
        let (p50, p99) = latencies.p50_p99().unwrap_or_default();
        assert!((p50 - 5.0).abs() < 1e-9);
        assert!((p99 - 9.0).abs() < 1e-9);
    }
}

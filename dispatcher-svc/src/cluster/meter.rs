//! The load an instance reports about itself: open sessions (in all and per client id), bytes
//! published and delivered per second, and the process's CPU share.
//!
//! Counting is a few relaxed atomic adds on the hot path; rates are taken by
//! [`Meter::sample`] once per keep-alive, as the difference since the previous sample.

use std::collections::HashMap;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use super::load::Load;

/// Clock ticks per second of `/proc/self/stat` (`USER_HZ`): 100 on every Linux ABI in use.
const USER_HZ: f64 = 100.0;

/// Counters of one process.
#[derive(Debug)]
pub struct Meter {
    inflow_bytes: AtomicU64,
    outflow_bytes: AtomicU64,
    sessions: Mutex<HashMap<String, u64>>,
    previous: Mutex<Sample>,
}

#[derive(Debug, Clone, Copy)]
struct Sample {
    at: Instant,
    inflow_bytes: u64,
    outflow_bytes: u64,
    cpu_ticks: Option<u64>,
}

impl Default for Meter {
    fn default() -> Self {
        Meter {
            inflow_bytes: AtomicU64::new(0),
            outflow_bytes: AtomicU64::new(0),
            sessions: Mutex::default(),
            previous: Mutex::new(Sample {
                at: Instant::now(),
                inflow_bytes: 0,
                outflow_bytes: 0,
                cpu_ticks: process_cpu_ticks(),
            }),
        }
    }
}

impl Meter {
    /// Bytes published through this instance.
    pub fn published(&self, bytes: usize) {
        self.inflow_bytes.fetch_add(bytes as u64, Ordering::Relaxed);
    }

    /// Bytes delivered by this instance.
    pub fn delivered(&self, bytes: usize) {
        self.outflow_bytes
            .fetch_add(bytes as u64, Ordering::Relaxed);
    }

    /// A session of `client` opened.
    pub fn session_opened(&self, client: &str) {
        *self.lock_sessions().entry(client.to_owned()).or_default() += 1;
    }

    /// Counts a session of `client` opening unless it already has `limit` open; answers the
    /// count it has when refused.
    pub fn try_session_opened(&self, client: &str, limit: u32) -> Result<(), u64> {
        let mut sessions = self.lock_sessions();
        let count = sessions.entry(client.to_owned()).or_default();
        if *count >= u64::from(limit) {
            let open = *count;
            if open == 0 {
                sessions.remove(client);
            }
            return Err(open);
        }
        *count += 1;
        Ok(())
    }

    /// A session of `client` closed.
    pub fn session_closed(&self, client: &str) {
        let mut sessions = self.lock_sessions();
        if let Some(count) = sessions.get_mut(client) {
            *count = count.saturating_sub(1);
            if *count == 0 {
                sessions.remove(client);
            }
        }
    }

    /// Open sessions per client id.
    pub fn sessions_by_client(&self) -> HashMap<String, u64> {
        self.lock_sessions().clone()
    }

    /// Open sessions.
    pub fn session_count(&self) -> u64 {
        self.lock_sessions().values().sum()
    }

    fn lock_sessions(&self) -> std::sync::MutexGuard<'_, HashMap<String, u64>> {
        self.sessions.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The load since the previous sample.
    pub fn sample(&self) -> Load {
        let now = Sample {
            at: Instant::now(),
            inflow_bytes: self.inflow_bytes.load(Ordering::Relaxed),
            outflow_bytes: self.outflow_bytes.load(Ordering::Relaxed),
            cpu_ticks: process_cpu_ticks(),
        };
        let mut previous = self.previous.lock().unwrap_or_else(|p| p.into_inner());
        let seconds = now.at.duration_since(previous.at).as_secs_f64().max(0.001);
        let rate = |now: u64, before: u64| (now.saturating_sub(before) as f64 / seconds) as u64;
        let cores = std::thread::available_parallelism().map_or(1, usize::from) as f64;
        let cpu_load = match (now.cpu_ticks, previous.cpu_ticks) {
            (Some(now), Some(before)) => {
                (now.saturating_sub(before) as f64 / USER_HZ / seconds / cores).clamp(0.0, 1.0)
            }
            _ => 0.0,
        };
        let load = Load {
            active_sessions: self.session_count(),
            inflow_bytes_per_sec: rate(now.inflow_bytes, previous.inflow_bytes),
            outflow_bytes_per_sec: rate(now.outflow_bytes, previous.outflow_bytes),
            // Two decimals are all a score needs and keep the value short.
            cpu_load: (cpu_load * 100.0).round() / 100.0,
        };
        *previous = now;
        load
    }
}

/// User plus system CPU time of this process in clock ticks (`None` without procfs).
fn process_cpu_ticks() -> Option<u64> {
    let stat = std::fs::read_to_string("/proc/self/stat").ok()?;
    parse_cpu_ticks(&stat)
}

/// Fields 14 and 15 (`utime`, `stime`) of a `/proc/<pid>/stat` line; the command name (field
/// 2) is parenthesised and may hold spaces, so counting starts after its closing parenthesis.
fn parse_cpu_ticks(stat: &str) -> Option<u64> {
    let (_, rest) = stat.rsplit_once(") ")?;
    let mut fields = rest.split_ascii_whitespace().skip(11);
    let utime: u64 = fields.next()?.parse().ok()?;
    let stime: u64 = fields.next()?.parse().ok()?;
    Some(utime + stime)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn cpu_ticks_follow_the_command_name() {
        let line = "4242 (a (weird) name) S 1 4242 4242 0 -1 4194560 100 0 0 0 250 50 0 0 20 0 9 0";
        assert_eq!(parse_cpu_ticks(line), Some(300));
        assert_eq!(parse_cpu_ticks("garbage"), None);
        assert!(process_cpu_ticks().is_some(), "Linux has /proc/self/stat");
    }

    #[test]
    fn sessions_and_rates() {
        let meter = Meter::default();
        meter.session_opened("a");
        meter.session_opened("a");
        meter.session_opened("b");
        meter.session_closed("b");
        meter.session_closed("unknown");
        assert_eq!(meter.session_count(), 2);
        assert_eq!(meter.sessions_by_client(), [("a".to_owned(), 2)].into());
        meter.published(1_000_000);
        meter.delivered(10);
        let load = meter.sample();
        assert_eq!(load.active_sessions, 2);
        assert!(load.inflow_bytes_per_sec > 0);
        assert!((0.0..=1.0).contains(&load.cpu_load));
        // Rates are per interval: nothing new, nothing counted.
        assert_eq!(meter.sample().inflow_bytes_per_sec, 0);
    }
}
